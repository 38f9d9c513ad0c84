//! Rotary position embeddings (RoPE): cos/sin tables computed once per model for every
//! position, and their application to query and key heads. Shared by every family.

use std::f64::consts::PI;

use anyhow::{Result, bail};
use candle_core::{Device, Tensor};

use super::config::RopeScaling;
use super::placement::with_host_f32;

/// cos/sin tables for every position, [max_positions, rotary_dim / 2].
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

/// The angle per position of each rotated pair, `theta^(-2i/d)` stretched by `scaling`, as
/// transformers' RoPE initialisers compute them.
pub fn inverse_frequencies(rotary_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Vec<f32>> {
    let default = (0..rotary_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64));
    Ok(match scaling {
        RopeScaling::None => default.map(|f| f as f32).collect(),
        &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: context } => {
            let (low_freq_wavelen, high_freq_wavelen) = (context / low_freq_factor, context / high_freq_factor);
            default
                .map(|f| {
                    let wavelen = 2.0 * PI / f;
                    let scaled = if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    scaled as f32
                })
                .collect()
        }
        RopeScaling::Divisors(divisors) => {
            if divisors.len() != rotary_dim / 2 {
                bail!("{} RoPE frequency divisors for a rotary dimension of {rotary_dim} (need {})", divisors.len(), rotary_dim / 2);
            }
            default.zip(divisors).map(|(f, &d)| (f / d as f64) as f32).collect()
        }
    })
}

impl Rotary {
    pub fn new(rotary_dim: usize, theta: f64, scaling: &RopeScaling, max_positions: usize, device: &Device) -> Result<Self> {
        // Frequencies as transformers computes them, f32 angles.
        let inv_freq = inverse_frequencies(rotary_dim, theta, scaling)?;
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

    /// Calls `f` with the cos and sin tables ([max_positions, rotary_dim / 2] each, row-major)
    /// where they are f32 in a CPU's memory; None elsewhere.
    pub fn with_host_tables<R>(&self, f: impl FnOnce(&[f32], &[f32]) -> R) -> Result<Option<R>> {
        Ok(with_host_f32(&self.cos, |cos| with_host_f32(&self.sin, |sin| f(cos, sin)))?.transpose()?.flatten())
    }

    /// x [1, heads, tokens, rotary_dim] rotated at `positions` (one per token).
    pub fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let cos = self.cos.index_select(positions, 0)?.to_dtype(x.dtype())?;
        let sin = self.sin.index_select(positions, 0)?.to_dtype(x.dtype())?;
        Ok(candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3's ramp against the divisors llama.cpp's converter stores for the same parameters
    /// (tests/fixtures/llama3_gguf/llama3_a.f32.gguf's `rope_freqs.weight`): head size 16,
    /// theta 5e5, factor 32, ramp between wavelengths 16 and 64.
    #[test]
    fn llama3_scaling_matches_the_converters_divisors() {
        let llama3 = RopeScaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 64.0 };
        let divisors = RopeScaling::Divisors(vec![1.0, 2.8886335, 32.0, 32.0, 32.0, 32.0, 32.0, 32.0]);
        let plain = inverse_frequencies(16, 5e5, &RopeScaling::None).unwrap();
        let from_params = inverse_frequencies(16, 5e5, &llama3).unwrap();
        let from_divisors = inverse_frequencies(16, 5e5, &divisors).unwrap();
        assert_eq!(from_params[0], plain[0], "a short wavelength is kept");
        assert_eq!(from_params[7], plain[7] / 32.0, "a long wavelength is divided by the factor");
        for (a, b) in from_params.iter().zip(&from_divisors) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{from_params:?} vs {from_divisors:?}");
        }
        let err = inverse_frequencies(32, 5e5, &divisors).unwrap_err().to_string();
        assert!(err.contains("8 RoPE frequency divisors") && err.contains("need 16"), "{err}");
    }
}
