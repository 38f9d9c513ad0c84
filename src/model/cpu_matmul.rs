//! A CPU kernel for `x @ w.T` with few rows in `x`: the decode case.
//!
//! candle's gemm path for a handful of rows against a [out, in] weight reaches about a third of
//! this machine's memory bandwidth, and decode is bound by streaming the weights once per step.
//! Here each weight row is read once and dotted with every row of `x` while it is in L1, and the
//! weight rows are split across the rayon pool (sized by RAYON_NUM_THREADS, like candle's).

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

/// Above this many rows candle's blocked gemm wins (it reuses weights across rows in registers).
const MAX_ROWS: usize = 8;
/// Weight rows per parallel task: large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 64;

/// `x [m, k] @ w.T` for w `[n, k]`, or None when this kernel does not apply (not CPU f32,
/// too many rows, non-contiguous weight).
pub fn matmul_transposed(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 || w.dtype() != DType::F32 || !w.is_contiguous() {
        return Ok(None);
    }
    let (Ok((m, k)), Ok((n, k_w))) = (x.dims2(), w.dims2()) else { return Ok(None) };
    if m == 0 || m > MAX_ROWS || k != k_w || k == 0 {
        return Ok(None);
    }
    let x_values = x.flatten_all()?.to_vec1::<f32>()?;
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let all = cpu.as_slice::<f32>()?;
    let weights = &all[layout.start_offset()..layout.start_offset() + n * k];

    // Computed as [n, m] so each task writes one contiguous block, then transposed (m * n is small).
    let mut transposed = vec![0f32; n * m];
    let use_fma = has_avx2_fma();
    transposed
        .par_chunks_mut(ROWS_PER_TASK * m)
        .zip(weights.par_chunks(ROWS_PER_TASK * k))
        .for_each(|(out, w_rows)| {
            if use_fma {
                // SAFETY: the CPU supports AVX2 and FMA (checked at runtime above).
                unsafe { rows_fma(out, w_rows, &x_values, m, k) }
            } else {
                rows_generic(out, w_rows, &x_values, m, k)
            }
        });
    let mut out = vec![0f32; m * n];
    for (j, values) in transposed.chunks_exact(m).enumerate() {
        for (i, &value) in values.iter().enumerate() {
            out[i * n + j] = value;
        }
    }
    Ok(Some(Tensor::from_vec(out, (m, n), x.device())?))
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_fma(out: &mut [f32], w_rows: &[f32], x: &[f32], m: usize, k: usize) {
    rows::<true>(out, w_rows, x, m, k)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_fma(out: &mut [f32], w_rows: &[f32], x: &[f32], m: usize, k: usize) {
    rows::<false>(out, w_rows, x, m, k)
}

fn rows_generic(out: &mut [f32], w_rows: &[f32], x: &[f32], m: usize, k: usize) {
    rows::<false>(out, w_rows, x, m, k)
}

/// out[j * m + i] = dot(w_rows[j], x[i]) for the weight rows of one task.
#[inline(always)]
fn rows<const FMA: bool>(out: &mut [f32], w_rows: &[f32], x: &[f32], m: usize, k: usize) {
    for (j, w_row) in w_rows.chunks_exact(k).enumerate() {
        for i in 0..m {
            out[j * m + i] = dot::<FMA>(w_row, &x[i * k..(i + 1) * k]);
        }
    }
}

/// A dot product with 16 independent accumulators, which the compiler keeps in two vector
/// registers (the order of additions differs from a serial sum by rounding only).
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (a, b) = (&a[c * LANES..(c + 1) * LANES], &b[c * LANES..(c + 1) * LANES]);
        for l in 0..LANES {
            acc[l] = if FMA { a[l].mul_add(b[l], acc[l]) } else { acc[l] + a[l] * b[l] };
        }
    }
    let mut sum = 0f32;
    for l in 0..LANES {
        sum += acc[l];
    }
    for i in chunks * LANES..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_matmul() {
        for (m, k, n) in [(1, 64, 448), (3, 100, 37), (8, 768, 130), (2, 17, 1)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let ours = matmul_transposed(&x, &w).unwrap().unwrap();
            let reference = x.matmul(&w.t().unwrap()).unwrap();
            let diff = (ours - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4 * (k as f32).sqrt(), "m={m} k={k} n={n}: {diff}");
        }
    }

    #[test]
    fn declines_what_it_does_not_handle() {
        let x = Tensor::zeros((9, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w).unwrap().is_none());
        let x = Tensor::zeros((1, 4), DType::BF16, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w.to_dtype(DType::BF16).unwrap()).unwrap().is_none());
    }
}
