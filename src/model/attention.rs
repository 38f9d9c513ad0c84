//! The attention kernel every family uses: causal scaled-dot-product attention of one
//! sequence's new tokens against its cached keys and values, with grouped-query heads.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

use super::placement::Placement;

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

/// [n, total] f32: 0 where query i (at position start + i) may see key j, -inf elsewhere.
fn causal_mask(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    match Placement::of(device) {
        Placement::Host => causal_mask_on_host(n, total, start, device),
        Placement::Device => causal_mask_with_tensor_ops(n, total, start, device),
    }
}

fn causal_mask_on_host(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (n, total), device)?)
}

/// The same built on `device` from two position ranges: it receives n + total positions
/// (candle builds a range on the host) instead of the n x total mask, and nothing is read back.
fn causal_mask_with_tensor_ops(n: usize, total: usize, start: usize, device: &Device) -> Result<Tensor> {
    let queries = Tensor::arange(start as u32, (start + n) as u32, device)?.unsqueeze(1)?;
    let keys = Tensor::arange(0u32, total as u32, device)?.unsqueeze(0)?;
    let visible = keys.broadcast_le(&queries)?; // [n, total] u8
    let open = Tensor::zeros((n, total), DType::F32, device)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (n, total), device)?;
    Ok(visible.where_cond(&open, &blocked)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-op mask (a GPU's) is the host's (a CPU's), bit for bit: a whole prompt, a
    /// later chunk of one, and a chunk shorter than the history.
    #[test]
    fn causal_mask_with_tensor_ops_equals_the_host_one() -> Result<()> {
        for (n, total, start) in [(5, 5, 0), (4, 11, 7), (1, 3, 2), (64, 200, 136)] {
            let host = causal_mask_on_host(n, total, start, &Device::Cpu)?.to_vec2::<f32>()?;
            let device = causal_mask_with_tensor_ops(n, total, start, &Device::Cpu)?.to_vec2::<f32>()?;
            assert_eq!(host, device, "n {n}, total {total}, start {start}");
        }
        Ok(())
    }
}
