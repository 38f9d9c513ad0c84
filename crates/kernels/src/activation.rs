//! SwiGLU's activation, `silu(gate) * up`, over the fused gate/up product `[rows, 2 * width]`.
//!
//! candle computes it as three strided passes (silu over the gate half's view, libm's `expf`
//! per element, then a multiply by the up half's view), 179 µs a layer at 16 rows of the 100M
//! model (2,048 wide): 2.1 ms of a 35 ms decode step. Here it is one pass over each row, with
//! an 8-lane exponential (16 lanes on AVX-512): 23 µs on the rank's two-thread pool (AVX2).
//!
//! `exp` is Cephes' `expf` (range reduction by `ln 2` in two parts, a degree-5 polynomial,
//! scaling by `2^n` through the exponent bits), within 2 ulp of the exact value over the range
//! it serves (test). libm's `expf` is correctly rounded, so a result may differ from candle's by
//! an ulp or two; it is the same computation otherwise, `x / (1 + exp(-x)) * up`. Every path
//! runs the same operations in the same order (separate multiplies and adds, no FMA), so every
//! path returns the same bits (test). Decode attention's softmax uses the same exponential
//! ([`exp_in_place`]).

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

use crate::cpu_matmul::Isa;

/// Rows per parallel task: one row stays on its thread, a batch of 16 spreads over four tasks.
const ROWS_PER_TASK: usize = 4;

// Cephes expf's constants.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];
/// exp's input is clamped to this range, so that 2^n is a normal f32 or, from 88.37 up where
/// n = 128, +inf (the exact value is 2.4e38 to 3.4e38 there, and beyond it overflows anyway).
/// In silu, `x / (1 + exp(-x))`: x above 87.3 divides by 1 exactly as it should, and x below
/// -88.37 gives -0, which is within 1e-35 of the exact result.
const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.72;

/// `silu(gate) * up` for a fused `[rows, 2 * width]` f32 tensor on the CPU: `[rows, width]`.
/// None when it does not apply (another device or dtype, not 2-D, an odd or zero width), for
/// the caller's general path.
pub fn silu_mul(gate_up: &Tensor) -> Result<Option<Tensor>> {
    silu_mul_with(gate_up, Isa::selected())
}

/// [`silu_mul`] on a given path. Panics if the CPU does not have it.
pub fn silu_mul_with(gate_up: &Tensor, isa: Isa) -> Result<Option<Tensor>> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    let Ok((rows, fused)) = gate_up.dims2() else { return Ok(None) };
    if !gate_up.device().is_cpu() || gate_up.dtype() != DType::F32 || fused == 0 || fused % 2 != 0 {
        return Ok(None);
    }
    let gate_up = gate_up.contiguous()?;
    let (storage, layout) = gate_up.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let start = layout.start_offset();
    let values = &cpu.as_slice::<f32>()?[start..start + rows * fused];
    Ok(Some(Tensor::from_vec(silu_mul_rows(values, fused / 2, isa), (rows, fused / 2), gate_up.device())?))
}

/// The rows of `gate_up` (each `width` gate values then `width` up values) activated. Panics if
/// the CPU does not have the path.
pub fn silu_mul_rows(gate_up: &[f32], width: usize, isa: Isa) -> Vec<f32> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    assert!(width > 0 && gate_up.len() % (2 * width) == 0, "{} values are not rows of 2 x {width}", gate_up.len());
    let mut out = vec![0f32; gate_up.len() / 2];
    out.par_chunks_mut(ROWS_PER_TASK * width).zip(gate_up.par_chunks(ROWS_PER_TASK * 2 * width)).for_each(|(out, rows)| {
        for (out, row) in out.chunks_exact_mut(width).zip(rows.chunks_exact(2 * width)) {
            let (gate, up) = row.split_at(width);
            match isa {
                // SAFETY: `isa` is available (asserted above; every CPU with AVX-512F has AVX2),
                // and the three slices have `width` elements each.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { x86::silu_mul_avx2(gate, up, out) },
                // SAFETY: as above, AVX-512F.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { x86::silu_mul_avx512(gate, up, out) },
                _ => silu_mul_portable(gate, up, out),
            }
        }
    });
    out
}

/// `values[i] = exp(values[i])` with the exponential of this module (the softmax of decode
/// attention): every path the same bits.
/// Panics if the CPU does not have the path.
pub fn exp_in_place(values: &mut [f32], isa: Isa) {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    match isa {
        // SAFETY (both arms): the CPU has the path (asserted above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::exp_in_place_avx2(values) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::exp_in_place_avx512(values) },
        _ => exp_in_place_portable(values),
    }
}

fn exp_in_place_portable(values: &mut [f32]) {
    for v in values {
        *v = exp(*v);
    }
}

/// The scalar reference, and the portable path: every SIMD path matches it bit for bit.
pub fn silu_mul_portable(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((out, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *out = silu_mul_one(g, u);
    }
}

#[inline(always)]
fn silu_mul_one(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

/// Cephes' `expf`, in the operation order the SIMD paths use.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.max(EXP_MIN).min(EXP_MAX);
    // Rounded to nearest, ties to even, without `round_ties_even`, which is a library call on
    // x86-64 without SSE4.1 (the portable build): adding and taking away 1.5 * 2^23 drops the
    // fraction as the hardware rounds, exactly for |x * LOG2E| < 2^22 (here below 128).
    const ROUNDER: f32 = 12_582_912.0;
    let n = (x * LOG2E + ROUNDER) - ROUNDER;
    let r = x - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{EXP_MAX, EXP_MIN, LN2_HI, LN2_LO, LOG2E, P};

    /// 8 lanes of [`super::exp`], operation for operation.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp256(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
        let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
        let mut p = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
    }

    /// 16 lanes of [`super::exp`], operation for operation (as [`exp256`]).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp512(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)), _mm512_set1_ps(EXP_MAX));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
        let r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI)));
        let r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
        let mut p = _mm512_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0));
        let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(scale))
    }

    /// [`super::exp_in_place`] sixteen lanes at a time, the tail as one masked vector rather
    /// than one scalar `exp` at a time: the softmax rows of a short prompt (a few to a few dozen
    /// positions) are mostly tail.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_in_place_avx512(values: &mut [f32]) {
        let mut chunks = values.chunks_exact_mut(16);
        for chunk in chunks.by_ref() {
            // SAFETY: the chunk holds 16 f32; unaligned loads and stores are allowed.
            unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), exp512(_mm512_loadu_ps(chunk.as_ptr()))) };
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mask = ((1u32 << tail.len()) - 1) as __mmask16;
            // SAFETY: the mask covers the tail's 1..=15 elements; masked-off lanes are neither
            // read nor written.
            unsafe { _mm512_mask_storeu_ps(tail.as_mut_ptr(), mask, exp512(_mm512_maskz_loadu_ps(mask, tail.as_ptr()))) };
        }
    }

    /// [`super::silu_mul_portable`] sixteen lanes at a time, the tail through it.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `gate`, `up` and `out` have the same length.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len());
        let whole = out.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 <= whole <= the length of all three slices; unaligned loads and
            // stores are allowed.
            unsafe {
                let g = _mm512_loadu_ps(gate.as_ptr().add(i));
                let u = _mm512_loadu_ps(up.as_ptr().add(i));
                let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
                let silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(silu, u));
            }
        }
        super::silu_mul_portable(&gate[whole..], &up[whole..], &mut out[whole..]);
    }

    /// [`super::exp_in_place`] eight lanes at a time, the tail padded to one vector (see
    /// [`exp_in_place_avx512`]).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn exp_in_place_avx2(values: &mut [f32]) {
        let mut chunks = values.chunks_exact_mut(8);
        for chunk in chunks.by_ref() {
            // SAFETY: the chunk holds 8 f32; unaligned loads and stores are allowed.
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), exp256(_mm256_loadu_ps(chunk.as_ptr()))) };
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            // (AVX2's masked stores are slow on AMD cores: the tail goes through a copy.)
            let mut lanes = [0f32; 8];
            lanes[..tail.len()].copy_from_slice(tail);
            // SAFETY: `lanes` holds 8 f32; unaligned loads and stores are allowed.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), exp256(_mm256_loadu_ps(lanes.as_ptr()))) };
            tail.copy_from_slice(&lanes[..tail.len()]);
        }
    }

    /// [`super::silu_mul_portable`] eight lanes at a time, the tail through it.
    ///
    /// # Safety
    /// The CPU has AVX2; `gate`, `up` and `out` have the same length.
    #[target_feature(enable = "avx2")]
    pub unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len());
        let whole = out.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= whole <= the length of all three slices; unaligned loads and
            // stores are allowed.
            unsafe {
                let g = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
                let silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, u));
            }
        }
        super::silu_mul_portable(&gate[whole..], &up[whole..], &mut out[whole..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Inputs over silu's whole useful range and past both ends of exp's clamp, some exact.
    fn inputs(len: usize) -> Vec<f32> {
        let mut values: Vec<f32> = (0..len).map(|i| (i as f32 * 0.618_034).sin() * 20.0 * (1.0 + (i % 7) as f32)).collect();
        values.extend([0.0, -0.0, 1.0, -1.0, 88.5, -88.5, 100.0, -100.0, 1e-30, -1e-30, 1e30, -1e30]);
        values
    }

    /// exp within 2 ulp of the f64 value where it is finite, +inf past that.
    #[test]
    fn exp_is_within_two_ulp() {
        assert_eq!(exp(88.4), f32::INFINITY);
        assert_eq!(exp(1e30), f32::INFINITY);
        let mut x = EXP_MIN;
        while x <= 88.3 {
            let exact = (x as f64).exp();
            let ulp = (exact as f32).abs() * f32::EPSILON;
            let got = exp(x);
            assert!(((got as f64) - exact).abs() <= 2.0 * ulp as f64, "exp({x}) = {got}, exact {exact}");
            x += 0.0137;
        }
    }

    /// Every path the CPU has equals the portable one bit for bit, and the result is within
    /// 4 ulp of `x / (1 + e^-x) * up` in f64, or within 1e-35 of it: below x = -87.3 (exp's
    /// clamp) silu is smaller than that and only its magnitude is kept.
    #[test]
    fn every_path_equals_the_reference() {
        for width in [1usize, 7, 8, 9, 64, 2048 + 3] {
            let gate = inputs(3 * width);
            let rows = gate.len() / width;
            let gate = &gate[..rows * width];
            let up: Vec<f32> = (0..rows * width).map(|i| ((i % 13) as f32 - 6.0) * 0.37).collect();
            let fused: Vec<f32> = (0..rows).flat_map(|r| gate[r * width..(r + 1) * width].iter().chain(&up[r * width..(r + 1) * width]).copied()).collect();
            let reference = silu_mul_rows(&fused, width, Isa::Portable);
            for (i, (&got, (&g, &u))) in reference.iter().zip(gate.iter().zip(&up)).enumerate() {
                let exact = g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64;
                let tolerance = (4.0 * f32::EPSILON as f64 * exact.abs()).max(1e-35);
                assert!((got as f64 - exact).abs() <= tolerance, "width {width}, element {i}: silu({g}) * {u} = {got}, exact {exact}");
            }
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                let got = silu_mul_rows(&fused, width, isa);
                let same = got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?} differs from the portable path at width {width}");
            }
        }
    }

    #[test]
    fn exp_in_place_is_the_same_on_every_path() {
        let values: Vec<f32> = (0..1003).map(|i| i as f32 * 0.173 - 90.0).chain([f32::NEG_INFINITY, 0.0, -0.0]).collect();
        let mut reference = values.clone();
        exp_in_place(&mut reference, Isa::Portable);
        assert!(values.iter().zip(&reference).all(|(&x, &e)| e.to_bits() == exp(x).to_bits()));
        assert_eq!(reference[reference.len() - 3..], [exp(EXP_MIN), 1.0, 1.0]);
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            // Every tail length of 8 and 16 lanes, each run's last values the special ones.
            for len in (1..=33).chain([values.len()]) {
                let mut got = values[values.len() - len..].to_vec();
                exp_in_place(&mut got, isa);
                let same = got.iter().zip(&reference[values.len() - len..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?}, {len} values");
            }
        }
    }

    #[test]
    fn nan_stays_nan_and_the_tensor_form_matches_candle() {
        let mut out = [0f32; 1];
        silu_mul_portable(&[f32::NAN], &[1.0], &mut out);
        assert!(out[0].is_nan());
        let device = Device::Cpu;
        let gate_up = Tensor::randn(0f32, 3.0, (5, 2 * 40), &device).unwrap();
        let ours = silu_mul(&gate_up).unwrap().expect("f32 on the CPU");
        let candle = (candle_nn_silu(&gate_up.narrow(1, 0, 40).unwrap()) * gate_up.narrow(1, 40, 40).unwrap()).unwrap();
        let diff = (ours - candle).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "max |ours - candle| = {diff}");
        // Not for this kernel: another dtype or an odd width.
        assert!(silu_mul(&gate_up.to_dtype(DType::BF16).unwrap()).unwrap().is_none());
        assert!(silu_mul(&Tensor::zeros((2, 7), DType::F32, &device).unwrap()).unwrap().is_none());
        assert!(silu_mul(&Tensor::zeros((2, 0), DType::F32, &device).unwrap()).unwrap().is_none());
    }

    /// candle's silu, `x / (1 + exp(-x))` (candle-nn is not a dependency of this crate).
    fn candle_nn_silu(x: &Tensor) -> Tensor {
        (x / (x.neg().unwrap().exp().unwrap() + 1.0).unwrap()).unwrap()
    }
}
