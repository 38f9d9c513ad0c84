//! Rotary position embeddings (RoPE): cos/sin tables computed once per model for every
//! position, and their application to query and key heads. Shared by every family.

use anyhow::Result;
use candle_core::{Device, Tensor};

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
