//! tpserve's CPU kernels for `x @ w.T`, the products that bound decode speed on a CPU.
//!
//! - [`cpu_matmul`]: f32 and bf16 weights against f32 activations (AVX-512F, AVX2 + FMA,
//!   portable), and the one place an instruction set is chosen ([`cpu_matmul::Isa`]).
//! - [`panels`]: f32 and bf16 weights packed at load into column panels, and their
//!   broadcast-form products (AVX-512F; the model holds dense weights so where it applies);
//!   bf16 weights also against activations rounded to bf16 (`vdpbf16ps`, on request), and
//!   greedy rows' logits from those products with the possible winners computed exactly.
//! - [`quant`]: GGML block formats kept as bytes ([`quant::formats`]) and their integer dot
//!   products with 8-bit activations ([`quant::kernels`]).
//! - [`activation`]: SwiGLU's `silu(gate) * up` in one pass, with an 8- or 16-lane exponential.
//! - [`norm`]: per-row RMSNorm and RoPE, candle's arithmetic with rows side by side.
//! - [`attention`]: one query row's attention (a decode step's token or a prompt's row), read in
//!   place from the paged KV cache.
//! - [`pages`]: loaded weights moved into 2 MiB pages, which the kernels stream faster.
//!
//! They live in a crate of their own so that the workspace compiles them with optimizations in
//! every profile: unoptimized SIMD intrinsics run tens of times slower, which made the tests that
//! decode a real model through these kernels take most of CI's time. The model layer wraps them
//! (`tpserve::model::cpu_matmul`, `tpserve::model::quant`).

pub mod activation;
pub mod attention;
pub mod cpu_matmul;
pub mod norm;
mod output;
pub mod pages;
pub mod panels;
pub mod quant;

/// Deterministic test inputs shared by the quantized formats' and kernels' tests.
#[cfg(test)]
pub(crate) mod test_values {
    /// `len` values in [-1, 1) from an LCG seeded by `seed`.
    pub fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// A `[rows, cols]` matrix of `values(rows * cols, seed)` quantized to `dtype` itself (the
    /// shape must take whole blocks: no fallback format); for IQ4_NL, which tpserve does not
    /// quantize to, blocks of indices from the same generator and scales from 0.004 to 0.012
    /// (values within [-1.6, 1.6]).
    pub fn blocks(dtype: crate::quant::formats::Format, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        use crate::quant::formats::{Format, Sliced, quantize_matrix};
        if dtype == Format::Iq4Nl {
            let count = rows * cols / 32;
            let mut bytes: Vec<u8> = values(count * 18, seed).iter().map(|v| ((v + 1.0) * 128.0) as u8).collect();
            for (block, v) in bytes.chunks_exact_mut(18).zip(values(count, seed + 1)) {
                block[..2].copy_from_slice(&half::f16::from_f32(0.008 + 0.004 * v).to_le_bytes());
            }
            return bytes;
        }
        let Sliced::Blocks { bytes, dtype: held, .. } = quantize_matrix(dtype, rows, cols, values(rows * cols, seed)) else {
            panic!("{dtype:?} [{rows}, {cols}] was not held in blocks")
        };
        assert_eq!(held, dtype);
        bytes
    }

    /// Asserts that `got`, a product of weight row `w` with activations `x` quantized to 8 bits,
    /// is within the activation rounding of the exact product: at most half a step (amax / 254)
    /// per value, within 0.01 |w| |x| + 1e-4 for these inputs.
    pub fn assert_within_activation_rounding(got: f32, w: &[f32], x: &[f32], at: &str) {
        let exact: f32 = w.iter().zip(x).map(|(a, b)| a * b).sum();
        let norm = |v: &[f32]| v.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((got - exact).abs() <= 0.01 * norm(w) * norm(x) + 1e-4, "{at}: {got} vs dequantized {exact}");
    }
}
