//! The attention kernel every family uses: causal scaled-dot-product attention of one
//! sequence's new tokens against its cached keys and values, with grouped-query heads.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// Causal scaled-dot-product attention of one sequence against its cached history.
/// q [q_heads, n, hd]; keys_t [kv_heads, hd, total] (transposed, as the paged cache gathers
/// them); values [kv_heads, total, hd]; returns [n, q_heads * hd].
pub fn attend(
    q: &Tensor,
    keys_t: &Tensor,
    values: &Tensor,
    start_pos: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (q_heads, n, _) = q.dims3()?;
    let total = keys_t.dim(2)?;
    let group = q_heads / kv_heads;
    let compute = q.dtype();
    // Fold the query heads that share a KV head into the row dimension: [kv, group * n, hd].
    let q = q.contiguous()?.reshape((kv_heads, group * n, head_dim))?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&keys_t.contiguous()?)? * scale)?; // [kv, group * n, total]
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

