//! Qwen3.5 (dense and MoE), tensor-parallel: Gated DeltaNet linear-attention layers
//! ([`super::gated_delta_net`]) interleaved with gated full-attention layers (q_proj carries a
//! sigmoid output gate per head; RoPE rotates the first `partial_rotary_factor` of each head),
//! each followed by a dense SwiGLU MLP or, for Qwen3.5 MoE, a sparse MoE block with a shared
//! expert. Every RMSNorm but the DeltaNet's gated one scales by (1 + w).
//!
//! Two checkpoint layouts load: the text-only classes' (model_type qwen3_5_text or
//! qwen3_5_moe_text, tensors `model.*`) and the hub's multimodal wrapper (qwen3_5 or qwen3_5_moe,
//! config under "text_config", tensors `model.language_model.*`, plus vision-tower and
//! multi-token-prediction tensors that are never read).

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::config::{Fields, ModelConfig, ModelFamily};
use super::decoder::{self, DecoderLayer, FeedForward, TokenMixer};
use super::gated_delta_net::{GatedDeltaNet, LinearConfig, LinearHeads};
use super::layers::{Attention, AttentionConfig, Mlp, NormWeight, RmsNorm};
use super::loader::ShardLoader;
use super::moe::{MoeConfig, SparseMoe};
use super::parallel::{HeadLayout, TpGroup};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LayerType {
    LinearAttention,
    FullAttention,
}

/// Qwen3.5's own hyper-parameters; the common ones are in [`ModelConfig`].
#[derive(Debug, Clone)]
struct HybridConfig {
    layer_types: Vec<LayerType>,
    linear: LinearConfig,
    rotary_dim: usize,
    /// Some for Qwen3.5 MoE
    moe: Option<MoeConfig>,
}

impl HybridConfig {
    fn parse(config: &ModelConfig) -> Result<Self> {
        let text = &config.text_config;
        let fields = Fields(text);
        let layers = config.num_hidden_layers;
        let layer_types = match fields.opt_str_list("layer_types")? {
            Some(names) => {
                if names.len() != layers {
                    bail!("layer_types has {} entries but num_hidden_layers is {layers}", names.len());
                }
                names
                    .iter()
                    .map(|name| match name.as_str() {
                        "linear_attention" => Ok(LayerType::LinearAttention),
                        "full_attention" => Ok(LayerType::FullAttention),
                        other => bail!(
                            "layer_types: unknown layer type \"{other}\" (expected linear_attention or full_attention)"
                        ),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            // transformers' default: every full_attention_interval-th layer is full attention.
            None => {
                let interval = fields.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    bail!("full_attention_interval must be positive");
                }
                (0..layers)
                    .map(|i| if (i + 1).is_multiple_of(interval) { LayerType::FullAttention } else { LayerType::LinearAttention })
                    .collect()
            }
        };
        // Defaults are transformers' Qwen3_5TextConfig defaults.
        let linear = LinearConfig {
            conv_kernel: fields.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            key_head_dim: fields.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            value_head_dim: fields.opt_usize("linear_value_head_dim")?.unwrap_or(128),
            num_key_heads: fields.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            num_value_heads: fields.opt_usize("linear_num_value_heads")?.unwrap_or(32),
        };
        for (name, value) in [
            ("linear_conv_kernel_dim", linear.conv_kernel),
            ("linear_key_head_dim", linear.key_head_dim),
            ("linear_value_head_dim", linear.value_head_dim),
            ("linear_num_key_heads", linear.num_key_heads),
            ("linear_num_value_heads", linear.num_value_heads),
        ] {
            if value == 0 {
                bail!("{name} must be positive");
            }
        }
        if !linear.num_value_heads.is_multiple_of(linear.num_key_heads) {
            bail!(
                "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                linear.num_value_heads,
                linear.num_key_heads
            );
        }
        let moe = match config.family {
            ModelFamily::Qwen3_5Moe => Some(MoeConfig::qwen3_5_moe(text)?),
            _ => None,
        };
        Ok(Self { layer_types, linear, rotary_dim: rotary_dim(text, config.head_dim)?, moe })
    }
}

/// `int(head_dim * partial_rotary_factor)`, the factor read from rope_parameters (transformers 5)
/// or the top level, defaulting to Qwen3.5's 0.25.
///
/// rope_parameters may also carry mrope_section / mrope_interleaved: Qwen3.5's multimodal RoPE
/// takes temporal, height and width positions for different frequency bands, but a text token
/// has all three equal to its position, so every band gets the ordinary angle and the layout
/// reduces to plain RoPE on the first rotary_dim dims.
fn rotary_dim(text: &Value, head_dim: usize) -> Result<usize> {
    let nested = text.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor"));
    let factor = match nested.or_else(|| text.get("partial_rotary_factor")) {
        None | Some(Value::Null) => 0.25,
        Some(v) => v
            .as_f64()
            .filter(|f| *f > 0.0 && *f <= 1.0)
            .with_context(|| format!("partial_rotary_factor must be a number in (0, 1], got {v}"))?,
    };
    let dim = (head_dim as f64 * factor) as usize;
    if dim == 0 || !dim.is_multiple_of(2) {
        bail!("partial_rotary_factor {factor} of head_dim {head_dim} gives {dim} rotary dims; it must be a positive even number");
    }
    Ok(dim)
}

/// Deliberate faults that prove the parity tests can fail, chosen with the environment variable
/// TPSERVE_TEST_BREAK (comma-separated names) when a model loads. Never set it in production.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TestBreaks {
    /// scale the (1 + w) RMSNorms by plain w
    pub plain_rms_weight: bool,
    /// forget the convolution history between the chunks of a chunked prefill
    pub drop_conv_state: bool,
}

impl TestBreaks {
    #[doc(hidden)]
    pub const ENV: &'static str = "TPSERVE_TEST_BREAK";

    fn from_env() -> Result<Self> {
        let mut breaks = Self::default();
        let Ok(value) = std::env::var(Self::ENV) else {
            return Ok(breaks);
        };
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "plain_rms_weight" => breaks.plain_rms_weight = true,
                "drop_conv_state" => breaks.drop_conv_state = true,
                other => bail!("{}: unknown fault \"{other}\" (plain_rms_weight, drop_conv_state)", Self::ENV),
            }
        }
        if breaks.plain_rms_weight || breaks.drop_conv_state {
            tracing::warn!("{} is set: this Qwen3.5 model is deliberately wrong ({breaks:?})", Self::ENV);
        }
        Ok(breaks)
    }
}

/// Loads a Qwen3.5 or Qwen3.5 MoE shard.
pub fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<decoder::Model> {
    let hybrid = HybridConfig::parse(config)?;
    let breaks = TestBreaks::from_env()?;
    // Every divisibility requirement, before any bytes are read.
    if hybrid.layer_types.contains(&LayerType::FullAttention) {
        HeadLayout::new(group, config.num_attention_heads, config.num_key_value_heads)?;
    }
    if hybrid.layer_types.contains(&LayerType::LinearAttention) {
        LinearHeads::new(group, &hybrid.linear)?;
    }
    match &hybrid.moe {
        Some(moe) => moe.check_divisible(group)?,
        None => group.check_divisible("intermediate_size", config.intermediate_size)?,
    }

    let norm = if breaks.plain_rms_weight { NormWeight::Plain } else { NormWeight::OffsetFromOne };
    let attention = AttentionConfig {
        hidden_size: config.hidden_size,
        num_heads: config.num_attention_heads,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        rotary_dim: hybrid.rotary_dim,
        qk_norm: true,
        gated: true,
        bias: config.attention_bias,
        norm,
        eps: config.rms_norm_eps,
    };
    let model = if loader.contains("model.language_model.embed_tokens.weight") {
        loader.pp("model.language_model")
    } else {
        loader.pp("model")
    };
    let (h, eps) = (config.hidden_size, config.rms_norm_eps);
    let layers = hybrid
        .layer_types
        .iter()
        .enumerate()
        .map(|(i, kind)| {
            let layer = model.pp(format!("layers.{i}"));
            let mixer = match kind {
                LayerType::FullAttention => TokenMixer::Attention(Attention::load(&layer.pp("self_attn"), group, &attention)?),
                LayerType::LinearAttention => TokenMixer::Linear(GatedDeltaNet::load(
                    &layer.pp("linear_attn"),
                    group,
                    config,
                    &hybrid.linear,
                    breaks.drop_conv_state,
                )?),
            };
            let mlp = layer.pp("mlp");
            let ffn = match &hybrid.moe {
                Some(moe) => FeedForward::Sparse(SparseMoe::load(&mlp, group, h, moe)?),
                None => FeedForward::Dense(Mlp::load(&mlp, group, h, config.intermediate_size, "intermediate_size")?),
            };
            Ok(DecoderLayer {
                input_norm: RmsNorm::load(&layer, "input_layernorm", h, eps, norm)?,
                mixer,
                post_attention_norm: RmsNorm::load(&layer, "post_attention_layernorm", h, eps, norm)?,
                ffn,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    decoder::Model::assemble(loader, &model, group, config, layers, norm, hybrid.rotary_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: Value) -> ModelConfig {
        let mut fields = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        });
        for (key, value) in text.as_object().into_iter().flatten() {
            fields[key] = value.clone();
        }
        ModelConfig::from_json_str(&fields.to_string()).unwrap()
    }

    #[test]
    fn layer_types_default_to_every_fourth_layer_full_attention() {
        use LayerType::{FullAttention as F, LinearAttention as L};
        let hybrid = HybridConfig::parse(&config(serde_json::json!({}))).unwrap();
        assert_eq!(hybrid.layer_types, [L, L, L, F, L, L, L, F]);
        let hybrid = HybridConfig::parse(&config(serde_json::json!({"full_attention_interval": 2}))).unwrap();
        assert_eq!(hybrid.layer_types, [L, F, L, F, L, F, L, F]);
        // partial_rotary_factor defaults to 0.25
        assert_eq!(hybrid.rotary_dim, 4);
        let err = HybridConfig::parse(&config(serde_json::json!({"layer_types": ["full_attention"]}))).unwrap_err();
        assert!(err.to_string().contains("layer_types has 1 entries"), "{err}");
    }

    #[test]
    fn rotary_dim_follows_partial_rotary_factor() {
        let text = serde_json::json!({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                                         "mrope_section": [2, 1, 1], "mrope_interleaved": true}});
        assert_eq!(rotary_dim(&text, 32).unwrap(), 16);
        assert_eq!(rotary_dim(&serde_json::json!({"partial_rotary_factor": 1.0}), 32).unwrap(), 32);
        assert!(rotary_dim(&serde_json::json!({"partial_rotary_factor": 0.1}), 16).is_err());
    }
}
