//! Qwen3 MoE, tensor-parallel: Qwen3's attention (per-head q/k RMSNorm, full RoPE, GQA) with
//! sparse mixture-of-experts MLPs, except on the layers `mlp_only_layers` names or that fall off
//! the `decoder_sparse_step` grid, which keep a dense SwiGLU MLP of `intermediate_size`.

use anyhow::{Result, bail};

use super::config::{Fields, ModelConfig};
use super::decoder::{self, DecoderLayer, FeedForward, TokenMixer};
use super::layers::{Attention, AttentionConfig, Mlp, NormWeight, RmsNorm};
use super::loader::ShardLoader;
use super::moe::{MoeConfig, SparseMoe};
use super::parallel::{HeadLayout, TpGroup};

/// Which layers are sparse, from config.json.
struct SparseLayers {
    mlp_only_layers: Vec<usize>,
    decoder_sparse_step: usize,
}

impl SparseLayers {
    fn parse(config: &ModelConfig) -> Result<Self> {
        let fields = Fields(&config.text_config);
        let decoder_sparse_step = fields.opt_usize("decoder_sparse_step")?.unwrap_or(1);
        if decoder_sparse_step == 0 {
            bail!("decoder_sparse_step must be positive");
        }
        let mlp_only_layers = fields.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
        if let Some(&bad) = mlp_only_layers.iter().find(|&&i| i >= config.num_hidden_layers) {
            bail!("mlp_only_layers names layer {bad}, but there are {} layers", config.num_hidden_layers);
        }
        Ok(Self { mlp_only_layers, decoder_sparse_step })
    }

    /// transformers' rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
    fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer) && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

pub fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<decoder::Model> {
    let moe = MoeConfig::qwen3_moe(&config.text_config)?;
    let sparse = SparseLayers::parse(config)?;
    let attention = AttentionConfig {
        hidden_size: config.hidden_size,
        num_heads: config.num_attention_heads,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        rotary_dim: config.head_dim,
        qk_norm: true,
        gated: false,
        bias: config.attention_bias,
        norm: NormWeight::Plain,
        eps: config.rms_norm_eps,
    };
    // Every divisibility requirement, before any bytes are read.
    HeadLayout::new(group, config.num_attention_heads, config.num_key_value_heads)?;
    moe.check_divisible(group)?;
    if (0..config.num_hidden_layers).any(|i| !sparse.is_sparse(i)) {
        group.check_divisible("intermediate_size", config.intermediate_size)?;
    }

    let model = loader.pp("model");
    let (h, eps) = (config.hidden_size, config.rms_norm_eps);
    let layers = (0..config.num_hidden_layers)
        .map(|i| {
            let layer = model.pp(format!("layers.{i}"));
            let mlp = layer.pp("mlp");
            let ffn = if sparse.is_sparse(i) {
                FeedForward::Sparse(SparseMoe::load(&mlp, group, h, &moe)?)
            } else {
                FeedForward::Dense(Mlp::load(&mlp, group, h, config.intermediate_size, "intermediate_size")?)
            };
            Ok(DecoderLayer {
                input_norm: RmsNorm::load(&layer, "input_layernorm", h, eps, NormWeight::Plain)?,
                mixer: TokenMixer::Attention(Attention::load(&layer.pp("self_attn"), group, &attention)?),
                post_attention_norm: RmsNorm::load(&layer, "post_attention_layernorm", h, eps, NormWeight::Plain)?,
                ffn,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    decoder::Model::assemble(loader, &model, group, config, layers, NormWeight::Plain, config.head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step() {
        let config = |extra: &str| {
            ModelConfig::from_json_str(&format!(
                r#"{{"model_type":"qwen3_moe","vocab_size":64,"hidden_size":32,"intermediate_size":64,
                "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
                "num_local_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":16{extra}}}"#
            ))
            .unwrap()
        };
        let sparse = |extra: &str| {
            let layers = SparseLayers::parse(&config(extra)).unwrap();
            (0..6).filter(|&i| layers.is_sparse(i)).collect::<Vec<_>>()
        };
        assert_eq!(sparse(""), [0, 1, 2, 3, 4, 5]);
        assert_eq!(sparse(r#","mlp_only_layers":[1,4]"#), [0, 2, 3, 5]);
        assert_eq!(sparse(r#","decoder_sparse_step":2"#), [1, 3, 5]);
        assert_eq!(sparse(r#","decoder_sparse_step":2,"mlp_only_layers":[3]"#), [1, 5]);
        let err = SparseLayers::parse(&config(r#","mlp_only_layers":[6]"#)).err().unwrap();
        assert!(err.to_string().contains("mlp_only_layers"), "{err}");
        let moe = MoeConfig::qwen3_moe(&config("").text_config).unwrap();
        assert_eq!((moe.num_experts, moe.top_k, moe.norm_topk_prob), (4, 2, false));
    }
}
