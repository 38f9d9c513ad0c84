//! Qwen3 dense and Llama (Qwen3 without the per-head q/k norms), tensor-parallel.
//!
//! Per layer: RMSNorm -> attention (q/k/v column-parallel, per-head q/k RMSNorm, RoPE, GQA,
//! o_proj row-parallel) -> residual -> RMSNorm -> SwiGLU MLP (gate/up column-parallel, down
//! row-parallel) -> residual. Two all-reduces per layer. The layers are the shared ones of
//! `layers.rs`, assembled by the shared decoder (`decoder.rs`) that also runs the MoE and
//! hybrid families; this file holds what is Qwen3's own, plus the RoPE tables and the
//! attention kernel every family uses.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

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

/// cos/sin tables for every position, [max_positions, rotary_dim / 2].
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    pub fn new(rotary_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Result<Self> {
        // Same formula and precision as transformers' default RoPE: f32 inverse frequencies,
        // f32 angles.
        let inv_freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32)
            .collect();
        let entries = max_positions
            .checked_mul(inv_freq.len())
            .filter(|&n| n <= isize::MAX as usize / 8)
            .ok_or_else(|| anyhow::anyhow!("RoPE tables for {max_positions} positions do not fit in memory"))?;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        cos.try_reserve_exact(entries).and_then(|()| sin.try_reserve_exact(entries)).map_err(|_| {
            anyhow::anyhow!("cannot allocate RoPE tables for {max_positions} positions ({} bytes)", entries * 8)
        })?;
        for position in 0..max_positions {
            for &f in &inv_freq {
                let angle = position as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let shape = (max_positions, inv_freq.len());
        Ok(Self { cos: Tensor::from_vec(cos, shape, device)?, sin: Tensor::from_vec(sin, shape, device)? })
    }

    /// x [1, heads, tokens, rotary_dim] rotated at `positions` (one per token).
    pub fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let cos = self.cos.index_select(positions, 0)?.to_dtype(x.dtype())?;
        let sin = self.sin.index_select(positions, 0)?.to_dtype(x.dtype())?;
        Ok(candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)?)
    }
}

/// Causal scaled-dot-product attention of one sequence against its cached history.
/// q [q_heads, n, hd]; keys, values [kv_heads, total, hd]; returns [n, q_heads * hd].
pub fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start_pos: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (q_heads, n, _) = q.dims3()?;
    let total = keys.dim(1)?;
    let group = q_heads / kv_heads;
    let compute = q.dtype();
    // Fold the query heads that share a KV head into the row dimension: [kv, group * n, hd].
    let q = q.contiguous()?.reshape((kv_heads, group * n, head_dim))?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&keys.t()?.contiguous()?)? * scale)?; // [kv, group * n, total]
    let scores = if n > 1 {
        let mask = causal_mask(n, total, start_pos, q.device())?.to_dtype(compute)?;
        scores
            .reshape((kv_heads, group, n, total))?
            .broadcast_add(&mask)?
            .reshape((kv_heads, group * n, total))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(compute)?;
    let out = probs.matmul(&values.contiguous()?)?; // [kv, group * n, hd]
    Ok(out.reshape((q_heads, n, head_dim))?.transpose(0, 1)?.reshape((n, q_heads * head_dim))?)
}

/// [n, total]: 0 where query i (at position start + i) may see key j, -inf elsewhere.
fn causal_mask(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}

