//! Qwen3 dense and Llama (Qwen3 without the per-head q/k norms), tensor-parallel.
//!
//! Per layer: RMSNorm -> attention (q/k/v column-parallel, per-head q/k RMSNorm, RoPE, GQA,
//! o_proj row-parallel) -> residual -> RMSNorm -> SwiGLU MLP (gate/up column-parallel, down
//! row-parallel) -> residual. Two all-reduces per layer. The layers are the shared ones of
//! `layers.rs`, assembled by the shared decoder (`decoder.rs`) that also runs the MoE and
//! hybrid families; this file holds only what is Qwen3's own: its loader.

use anyhow::Result;

use super::config::ModelConfig;
use super::decoder::{self, DecoderLayer, FeedForward, TokenMixer};
use super::layers::{Attention, AttentionConfig, Mlp, NormWeight, RmsNorm};
use super::loader::ShardLoader;
use super::parallel::{HeadLayout, TpGroup};

/// Loads a Qwen3 dense or Llama shard.
pub fn load(loader: &ShardLoader, group: &TpGroup, config: &ModelConfig) -> Result<decoder::Model> {
    let attention = AttentionConfig {
        hidden_size: config.hidden_size,
        num_heads: config.num_attention_heads,
        num_kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        rotary_dim: config.head_dim,
        gated: false,
        qk_norm: config.qk_norm,
        bias: config.attention_bias,
        norm: NormWeight::Plain,
        eps: config.rms_norm_eps,
    };
    // Check every divisibility requirement up front, so the error names the field before
    // any bytes are read.
    HeadLayout::new(group, config.num_attention_heads, config.num_key_value_heads)?;
    group.check_divisible("intermediate_size", config.intermediate_size)?;
    let model = loader.pp("model");
    let (h, eps) = (config.hidden_size, config.rms_norm_eps);
    let layers = (0..config.num_hidden_layers)
        .map(|i| {
            let layer = model.pp(format!("layers.{i}"));
            Ok(DecoderLayer {
                input_norm: RmsNorm::load(&layer, "input_layernorm", h, eps, NormWeight::Plain)?,
                mixer: TokenMixer::Attention(Attention::load(&layer.pp("self_attn"), group, &attention)?),
                post_attention_norm: RmsNorm::load(&layer, "post_attention_layernorm", h, eps, NormWeight::Plain)?,
                ffn: FeedForward::Dense(Mlp::load(&layer.pp("mlp"), group, h, config.intermediate_size, "intermediate_size")?),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    decoder::Model::assemble(loader, &model, group, config, layers, NormWeight::Plain, config.head_dim)
}
