//! Integer kernels for `x @ w.T` with `w` in GGML blocks and `x` f32 (decode and small batches).
//!
//! As in llama.cpp, each row of `x` is first quantized per 32-value block to 8 bits (a scale `d`
//! and 32 signed bytes; `s = d * sum(q)` serves the formats with an offset), and each weight
//! block is dotted with it in integers:
//!
//! - Q4_0 / Q5_0: `w = d_w * (q - 8|16)`   -> `d_w d_x sum(q x) - (8|16) d_w s_x`
//! - Q4_1 / Q5_1: `w = d_w * q + m_w`      -> `d_w d_x sum(q x) + m_w s_x`
//! - Q8_0:        `w = d_w * q` (signed)   -> `d_w d_x sum(q x)`
//! - IQ4_NL:      `w = d_w * LEVELS[q]`    -> `d_w d_x sum(LEVELS[q] x)`
//!
//! with `q` unsigned (0..15, 0..31) so that AVX2's `vpmaddubsw` (u8 x i8) applies directly
//! (Q8_0 and IQ4_NL's signed levels through the sign trick), or AVX-512 VNNI's `vpdpbusd` where
//! the CPU has it.
//! The K-quants (Q2_K..Q6_K) go through [`super::kquant`]'s kernels against Q8_K activations
//! (256 values a block).
//!
//! Weight rows are split across the rayon pool; each row is read once and dotted with every
//! row of `x` while it is in L1. [`Path::selected`] is the one place a path is chosen.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::formats::{Format, row_bytes};
use super::iq4::LEVELS;
use super::kquant::{self, ActQ8K, quantize_act_k};
use crate::cpu_matmul::Isa;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 32;
const QK: usize = 32;

/// The instruction-set paths of the quantized kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Plain Rust integer arithmetic (the scalar references).
    Portable,
    /// AVX2 + FMA + F16C: `vpmaddubsw` / `vpmaddwd`.
    Avx2,
    /// AVX-512 VNNI (with BW and VL): `vpdpbusd`, on 512-bit vectors for two interleaved groups
    /// at once ([`super::interleaved`]) and on 256-bit ones elsewhere.
    Avx512Vnni,
}

impl Path {
    pub const ALL: [Path; 3] = [Path::Portable, Path::Avx2, Path::Avx512Vnni];

    pub fn available(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Vnni => {
                Path::Avx2.available()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best path this CPU has, capped by the same `TPSERVE_CPU_ISA` setting as the f32/bf16
    /// kernels (`portable`, `avx2`; `avx512` allows VNNI). Read once.
    pub fn selected() -> Path {
        static SELECTED: OnceLock<Path> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let cap = match Isa::selected_cap() {
                Isa::Portable => Path::Portable,
                Isa::Avx2 => Path::Avx2,
                Isa::Avx512 => Path::Avx512Vnni,
            };
            Path::ALL.into_iter().filter(|p| *p <= cap && p.available()).max().unwrap_or(Path::Portable)
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Portable => "portable",
            Path::Avx2 => "avx2",
            Path::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// One row of activations quantized per 32 values: scales, scaled sums and the bytes.
pub struct ActQ8 {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qs: Vec<i8>,
    /// Each block's sum of `qs` (so `s[b] = d[b] * sums[b]`): the 512-bit Q8_0 product
    /// multiplies `w + 128` and takes `128 * sums[b]` back off, exactly.
    pub sums: Vec<i32>,
}

/// Q8_0-style quantization of `x` (a multiple of 32 values), scales kept in f32.
pub fn quantize_act(x: &[f32]) -> ActQ8 {
    let blocks = x.len() / QK;
    let mut act = ActQ8 { d: Vec::with_capacity(blocks), s: Vec::with_capacity(blocks), qs: vec![0; x.len()], sums: Vec::with_capacity(blocks) };
    quantize_act_blocks(x, |b, values, d, sum| {
        act.qs[b * QK..(b + 1) * QK].copy_from_slice(values);
        act.d.push(d);
        act.s.push(d * sum as f32);
        act.sums.push(sum);
    });
    act
}

/// [`quantize_act`] block by block: `put(b, values, d, sum)` gets block `b`'s 32 bytes, its
/// scale and the sum of its bytes, in order, for whatever layout the caller keeps them in.
pub fn quantize_act_blocks(x: &[f32], mut put: impl FnMut(usize, &[i8; QK], f32, i32)) {
    #[cfg(target_arch = "x86_64")]
    if Path::selected() == Path::Avx512Vnni {
        // SAFETY: the selected path is available, and it includes AVX-512 F.
        return unsafe { quantize_blocks_avx512(x, &mut put) };
    }
    #[cfg(target_arch = "x86_64")]
    if Path::selected() >= Path::Avx2 {
        // SAFETY: the selected path is available, and every path from Avx2 up includes AVX2.
        return unsafe { quantize_blocks_avx2(x, &mut put) };
    }
    quantize_blocks_body(x, &mut put)
}

/// [`quantize_blocks_body`]'s bytes, scales and sums, each 32-value block in AVX2 registers.
/// The compiler kept the scalar form's rounding (`round_to_i8`: a saturating float-to-int cast
/// and two compares per value) scalar, about 3 ns a value: 5% of a 16-row Q8_0 decode step.
///
/// The same results, operation for operation: the largest magnitude in eight lanes (a maximum
/// is exact in any order; `maxps` returns its second operand when either is NaN, so a NaN value
/// leaves it, as `f32::max` skips it); `v * inv` as one rounded multiply; the clamp with the NaN
/// kept (`maxps`/`minps` with the value second), truncation, and the half-away-from-zero step
/// from the exact fraction; a NaN becomes 0, as the scalar cast makes it.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_blocks_avx2(x: &[f32], put: &mut impl FnMut(usize, &[i8; QK], f32, i32)) {
    use std::arch::x86_64::*;
    for (b, values) in x.chunks_exact(QK).enumerate() {
        let mut qs = [0i8; QK];
        // SAFETY: AVX2 is enabled here; `values` holds QK = 32 floats, read as four vectors,
        // and `qs` 32 bytes, written as one.
        let (d, sum) = unsafe {
            let v: [__m256; QK / 8] = std::array::from_fn(|i| _mm256_loadu_ps(values.as_ptr().add(8 * i)));
            let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let m = v.iter().fold(_mm256_setzero_ps(), |m, &v| _mm256_max_ps(_mm256_and_ps(v, magnitude), m));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
            let q: [__m256i; QK / 8] = v.map(|v| {
                let y = _mm256_min_ps(_mm256_set1_ps(127.0), _mm256_max_ps(_mm256_set1_ps(-128.0), _mm256_mul_ps(v, inv)));
                let whole = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm256_sub_ps(y, whole);
                let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
                let t = _mm256_and_si256(_mm256_cvttps_epi32(whole), ordered);
                // a true compare is -1: subtract the round-up, add the round-down
                let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5)));
                let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, _mm256_set1_ps(-0.5)));
                _mm256_add_epi32(_mm256_sub_epi32(t, up), down)
            });
            // Every value is in -128..=127, so the saturating packs keep it; they interleave
            // 128-bit lanes (bytes 4i..4i+4 of each vector in turn), which the permutation undoes.
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes);
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            (d, _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s))))
        };
        put(b, &qs, d, sum);
    }
}

/// [`quantize_blocks_avx2`] on 512-bit vectors: a block's 32 values in two registers, and the
/// scales of sixteen blocks at a time in one, so that a block's two divisions (`amax / 127`,
/// then its inverse) are a sixteenth of two `vdivps` rather than two scalar divisions waited on
/// in turn. The same operations lane for lane as the AVX2 form (the maximum that skips NaNs
/// takes the running value second), the rounding's ±1 through masks; `vpmovdb` truncates
/// values already in -128..=127. 16 rows of 768 values, Zen 5: 5.5 -> 2.3 µs (0.45 -> 0.19 ns a
/// value; 512 rows 175 -> 75 µs).
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_blocks_avx512(x: &[f32], put: &mut impl FnMut(usize, &[i8; QK], f32, i32)) {
    use std::arch::x86_64::*;
    let blocks = x.len() / QK;
    for first in (0..blocks).step_by(16) {
        let n = (blocks - first).min(16);
        let at = |j: usize| x[(first + j) * QK..(first + j + 1) * QK].as_ptr();
        // SAFETY (whole block): AVX-512 F is enabled here; `at(j)` for j < n points to a whole
        // block of QK = 32 floats, read as two vectors; `qs` is 32 bytes, written as two halves.
        unsafe {
            let mut amax = [0f32; 16];
            for (j, amax) in amax.iter_mut().enumerate().take(n) {
                let (a, b) = (_mm512_abs_ps(_mm512_loadu_ps(at(j))), _mm512_abs_ps(_mm512_loadu_ps(at(j).add(16))));
                *amax = _mm512_reduce_max_ps(_mm512_max_ps(b, _mm512_max_ps(a, _mm512_setzero_ps())));
            }
            let d = _mm512_div_ps(_mm512_loadu_ps(amax.as_ptr()), _mm512_set1_ps(127.0));
            let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
            let inv = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), d);
            let (mut ds, mut invs) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(ds.as_mut_ptr(), d);
            _mm512_storeu_ps(invs.as_mut_ptr(), inv);
            for j in 0..n {
                let inv = _mm512_set1_ps(invs[j]);
                let one = _mm512_set1_epi32(1);
                let q = [0, 16].map(|half| {
                    let y = _mm512_min_ps(_mm512_set1_ps(127.0), _mm512_max_ps(_mm512_set1_ps(-128.0), _mm512_mul_ps(_mm512_loadu_ps(at(j).add(half)), inv)));
                    let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                    let frac = _mm512_sub_ps(y, whole);
                    let t = _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y), whole);
                    let t = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5)), t, one);
                    _mm512_mask_sub_epi32(t, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, _mm512_set1_ps(-0.5)), t, one)
                });
                let mut qs = [0i8; QK];
                _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q[0]));
                _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(q[1]));
                put(first + j, &qs, ds[j], _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1])));
            }
        }
    }
}

/// The largest magnitude of a block, NaNs skipped.
fn block_amax(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// The scalar reference of [`quantize_act_blocks`] (and its portable path): per block the
/// largest magnitude maps to 127, each value rounds half away from zero.
fn quantize_blocks_body(x: &[f32], put: &mut impl FnMut(usize, &[i8; QK], f32, i32)) {
    for (b, values) in x.chunks_exact(QK).enumerate() {
        let amax = block_amax(values);
        let d = amax / 127.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut qs = [0i8; QK];
        let mut sum = 0i32;
        for (q, v) in qs.iter_mut().zip(values) {
            *q = super::kquant::round_to_i8(v * inv);
            sum += *q as i32;
        }
        put(b, &qs, d, sum);
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Scalar reference of one weight row (simple formats) against one activation row.
pub fn dot_portable(dtype: Format, row: &[u8], act: &ActQ8) -> f32 {
    let ts = dtype.type_size();
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(ts).enumerate() {
        let x = &act.qs[b * QK..(b + 1) * QK];
        let d = f16_at(blk, 0);
        let (c, isum) = match dtype {
            Format::Q8_0 => (0.0, (0..QK).map(|j| blk[2 + j] as i8 as i32 * x[j] as i32).sum::<i32>()),
            Format::Q4_0 | Format::Q4_1 => {
                let (c, qs) = if dtype == Format::Q4_0 { (-8.0 * d, &blk[2..18]) } else { (f16_at(blk, 2), &blk[4..20]) };
                let isum = (0..16).map(|j| (qs[j] & 15) as i32 * x[j] as i32 + (qs[j] >> 4) as i32 * x[j + 16] as i32).sum();
                (c, isum)
            }
            Format::Q5_0 | Format::Q5_1 => {
                let (c, at) = if dtype == Format::Q5_0 { (-16.0 * d, 2) } else { (f16_at(blk, 2), 4) };
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                let qs = &blk[at + 4..at + 20];
                let isum = (0..16)
                    .map(|j| {
                        let lo = (qs[j] & 15) as u32 | ((qh >> j) & 1) << 4;
                        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                        lo as i32 * x[j] as i32 + hi as i32 * x[j + 16] as i32
                    })
                    .sum();
                (c, isum)
            }
            Format::Iq4Nl => {
                let level = |q: u8| LEVELS[q as usize] as i32;
                (0.0, (0..16).map(|j| level(blk[2 + j] & 15) * x[j] as i32 + level(blk[2 + j] >> 4) * x[j + 16] as i32).sum())
            }
            other => panic!("{other:?} is not a 32-value block format"),
        };
        acc += d * act.d[b] * isum as f32 + c * act.s[b];
    }
    acc
}

/// Activations of the rows of `x`, in the form the weight format multiplies with.
enum Acts {
    Q8(Vec<ActQ8>),
    /// Q8_K activations (the K-quants)
    K(Vec<ActQ8K>),
}

/// `x [m, k] @ w.T` for `w` `[n, k]` in `dtype` blocks (row-major bytes): returns `[m, n]`.
pub fn matmul(x: &[f32], m: usize, k: usize, dtype: Format, w: &[u8], n: usize, path: Path) -> Vec<f32> {
    assert!(path.available(), "this CPU has no {path:?} path");
    let rb = row_bytes(dtype, k);
    assert_eq!(w.len(), n * rb, "weight bytes do not match [{n}, {k}] of {dtype:?}");
    assert_eq!(x.len(), m * k);
    let acts = if kquant::has_kernel(dtype) {
        Acts::K(x.par_chunks_exact(k).map(quantize_act_k).collect())
    } else {
        Acts::Q8(x.par_chunks_exact(k).map(quantize_act).collect())
    };
    let mut out_t = vec![0f32; n * m];
    out_t.par_chunks_mut(ROWS_PER_TASK * m).enumerate().for_each(|(task, out)| {
        let first = task * ROWS_PER_TASK;
        let rows = out.len() / m;
        let w_rows = &w[first * rb..(first + rows) * rb];
        match &acts {
            Acts::Q8(acts) => rows_q8(out, w_rows, rb, acts, dtype, path),
            Acts::K(acts) => kquant::rows(out, w_rows, rb, acts, dtype, path),
        }
    });
    if m == 1 {
        return out_t;
    }
    // `[n, m]` -> `[m, n]` in parallel, TRANSPOSE_ROWS output rows a task: each weight row's
    // TRANSPOSE_ROWS values are one cache line read (done serially and value by value, this
    // was a seventh of a 512-token Q2_K prefill).
    const TRANSPOSE_ROWS: usize = 16;
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(TRANSPOSE_ROWS * n).enumerate().for_each(|(task, out)| {
        let first = task * TRANSPOSE_ROWS;
        let rows = out.len() / n;
        for (j, values) in out_t.chunks_exact(m).enumerate() {
            for (i, &v) in values[first..first + rows].iter().enumerate() {
                out[i * n + j] = v;
            }
        }
    });
    out
}

fn rows_q8(out: &mut [f32], w_rows: &[u8], rb: usize, acts: &[ActQ8], dtype: Format, path: Path) {
    let m = acts.len();
    for (row, out) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
        // Batches: four activation rows per pass over the weight row, so each weight block is
        // loaded and unpacked once for four products (register blocking across rows).
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        while path != Path::Portable && done + 4 <= m {
            let four = [&acts[done], &acts[done + 1], &acts[done + 2], &acts[done + 3]];
            // SAFETY: `matmul` asserted the CPU has this path's features; the row holds whole
            // blocks of `dtype` matching every activation's block count (checked there).
            let sums = unsafe { x86::dot4(path == Path::Avx512Vnni, dtype, row, four) };
            out[done..done + 4].copy_from_slice(&sums);
            done += 4;
        }
        for (o, act) in out[done..].iter_mut().zip(&acts[done..]) {
            *o = match path {
                Path::Portable => dot_portable(dtype, row, act),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `matmul` asserted the CPU has this path's features; the row holds
                // whole blocks of `dtype` matching the activation's block count (checked there).
                Path::Avx2 => unsafe { x86::dot::<false>(dtype, row, act) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above, with AVX-512 VNNI and VL checked by `Path::available`.
                Path::Avx512Vnni => unsafe { x86::dot::<true>(dtype, row, act) },
                #[cfg(not(target_arch = "x86_64"))]
                _ => dot_portable(dtype, row, act),
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use crate::quant::formats::Format;

    use super::{ActQ8, LEVELS, QK};

    /// An f16 at `p` (unaligned), widened.
    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller passes a pointer to two readable bytes; F16C is enabled by every
        // caller's target features.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32))) }
    }

    /// 32 bytes: the 16 low nibbles at `p`, then the 16 high nibbles.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: 16 readable bytes at p (the caller's block); AVX2 is enabled by every caller.
        unsafe {
            let tmp = _mm_loadu_si128(p.cast());
            let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        }
    }

    /// 32 bytes, 0x10 where bit j of the little-endian u32 at `p` is set (byte j), else 0.
    #[inline(always)]
    pub(crate) unsafe fn high_bits(p: *const u8) -> __m256i {
        // SAFETY: 4 readable bytes at p; AVX2 is enabled by every caller.
        unsafe {
            let qh = p.cast::<u32>().read_unaligned() as i32;
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh),
                _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
            );
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi8(-1));
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        }
    }

    /// 8 i32 sums of u8 `q` x i8 `x` products, four adjacent products each.
    #[inline(always)]
    unsafe fn dot_u8_i8<const VNNI: bool>(q: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller enables AVX2, and AVX-512 VNNI + VL when VNNI.
        unsafe {
            if VNNI {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
            } else {
                // u8 <= 31 (or <= 128 for Q8_0's and IQ4_NL's magnitudes) times |i8| <= 127,
                // twice: no i16 overflow.
                _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
            }
        }
    }

    // The 32-value block formats as const-generic parameters (shared with the interleaved
    // kernels).
    pub(crate) const Q4_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q5_0: u8 = 2;
    pub(crate) const Q5_1: u8 = 3;
    pub(crate) const Q8_0: u8 = 4;
    pub(crate) const IQ4_NL: u8 = 5;

    /// IQ4_NL's 16 levels in both 128-bit halves: `vpshufb` with it maps indices to levels.
    #[inline(always)]
    pub(crate) unsafe fn levels() -> __m256i {
        // SAFETY: LEVELS is 16 readable bytes; AVX2 is enabled by every caller.
        unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(LEVELS.as_ptr().cast())) }
    }

    /// IQ4_NL's 32 values of the block whose indices are at `p`, as signed bytes.
    #[inline(always)]
    unsafe fn iq4_values(p: *const u8) -> __m256i {
        // SAFETY: 16 readable bytes at p (the caller's block); AVX2 is enabled by every caller.
        unsafe { _mm256_shuffle_epi8(levels(), nibbles(p)) }
    }

    /// `$body::<$vnni, F>($args)` with `F` the format constant of `dtype`. Only 32-value block
    /// formats reach here: `matmul` sends K-quants to `kquant`, and a `QMatrix`
    /// holds only [`Format`]s.
    macro_rules! by_format {
        ($dtype:expr, $body:ident::<$vnni:tt>($($arg:expr),*)) => {
            match $dtype {
                Format::Q4_0 => $body::<$vnni, Q4_0>($($arg),*),
                Format::Q4_1 => $body::<$vnni, Q4_1>($($arg),*),
                Format::Q5_0 => $body::<$vnni, Q5_0>($($arg),*),
                Format::Q5_1 => $body::<$vnni, Q5_1>($($arg),*),
                Format::Q8_0 => $body::<$vnni, Q8_0>($($arg),*),
                Format::Iq4Nl => $body::<$vnni, IQ4_NL>($($arg),*),
                other => unreachable!("{other:?} is not a 32-value block format (matmul routes the others)"),
            }
        };
    }

    /// One instantiation of [`dot_body`] per format, compiled for the features of `$features`.
    macro_rules! dot_fn {
        ($name:ident, $vnni:expr, $features:literal) => {
            /// [`super::dot_portable`] with 256-bit integer products.
            ///
            /// # Safety
            /// The CPU must have the enabled features; `row` must hold `act.d.len()` blocks of
            /// `dtype`, a 32-value block format.
            #[target_feature(enable = $features)]
            unsafe fn $name(dtype: Format, row: &[u8], act: &ActQ8) -> f32 {
                // SAFETY: forwarded contract.
                unsafe { by_format!(dtype, dot_body::<$vnni>(row, act)) }
            }
        };
    }
    dot_fn!(dot_avx2, false, "avx2,fma,f16c");
    dot_fn!(dot_vnni, true, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni");

    /// One instantiation of [`dot4_body`] per format, compiled for the features of `$features`.
    macro_rules! dot4_fn {
        ($name:ident, $vnni:expr, $features:literal) => {
            /// Four activation rows against one weight row.
            ///
            /// # Safety
            /// As the single-row functions, for every one of the four activation rows.
            #[target_feature(enable = $features)]
            unsafe fn $name(dtype: Format, row: &[u8], acts: [&ActQ8; 4]) -> [f32; 4] {
                // SAFETY: forwarded contract.
                unsafe { by_format!(dtype, dot4_body::<$vnni>(row, acts)) }
            }
        };
    }
    dot4_fn!(dot4_avx2, false, "avx2,fma,f16c");
    dot4_fn!(dot4_vnni, true, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni");

    /// Four activation rows against one weight row, on the VNNI path when `vnni`.
    ///
    /// # Safety
    /// As [`dot4_avx2`] / [`dot4_vnni`].
    pub unsafe fn dot4(vnni: bool, dtype: Format, row: &[u8], acts: [&ActQ8; 4]) -> [f32; 4] {
        // SAFETY: forwarded contract.
        unsafe { if vnni { dot4_vnni(dtype, row, acts) } else { dot4_avx2(dtype, row, acts) } }
    }

    /// Weight block `b` of a row at `base` (`ts` bytes a block), unpacked once for any number of
    /// activation rows: (its values as unsigned bytes, the signs Q8_0's trick applies to the
    /// activations, its scale, its offset coefficient).
    ///
    /// # Safety
    /// AVX2 is enabled in the caller; block `b` of the row is in bounds.
    #[inline(always)]
    unsafe fn weight_block<const F: u8>(base: *const u8, ts: usize, b: usize) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the caller's contract; every load is unaligned.
        unsafe {
            let blk = base.add(b * ts);
            let d = f16_at(blk);
            match F {
                Q4_0 => {
                    let q = nibbles(blk.add(2));
                    (q, q, d, -8.0 * d)
                }
                Q4_1 => {
                    let q = nibbles(blk.add(4));
                    (q, q, d, f16_at(blk.add(2)))
                }
                Q5_0 => {
                    let q = _mm256_or_si256(nibbles(blk.add(6)), high_bits(blk.add(2)));
                    (q, q, d, -16.0 * d)
                }
                Q5_1 => {
                    let q = _mm256_or_si256(nibbles(blk.add(8)), high_bits(blk.add(4)));
                    (q, q, d, f16_at(blk.add(2)))
                }
                IQ4_NL => {
                    let w = iq4_values(blk.add(2));
                    (_mm256_sign_epi8(w, w), w, d, 0.0)
                }
                _ => {
                    let w = _mm256_loadu_si256(blk.add(2).cast());
                    (_mm256_sign_epi8(w, w), w, d, 0.0)
                }
            }
        }
    }

    /// One activation row's part of an unpacked weight block (see [`weight_block`]): the same
    /// (sums, scale, offset term) as [`block`].
    ///
    /// # Safety
    /// AVX2 (and VNNI when asked) are enabled in the caller; block `b` of `act` is in bounds.
    #[inline(always)]
    unsafe fn act_part<const VNNI: bool, const F: u8>(
        (q, signs, d, c): (__m256i, __m256i, f32, f32),
        act: &ActQ8,
        b: usize,
    ) -> (__m256, f32, f32) {
        // SAFETY: the caller's contract; the load is unaligned.
        unsafe {
            let x = _mm256_loadu_si256(act.qs.as_ptr().add(b * QK).cast());
            let x = if F == Q8_0 || F == IQ4_NL { _mm256_sign_epi8(x, signs) } else { x };
            let sums = _mm256_cvtepi32_ps(dot_u8_i8::<VNNI>(q, x));
            (sums, d * *act.d.get_unchecked(b), c * *act.s.get_unchecked(b))
        }
    }

    /// [`dot_body`] for four activation rows: each weight block is unpacked once and dotted with
    /// the four rows' blocks. Every row's additions happen in exactly [`dot_body`]'s order (four
    /// blocks an iteration into two accumulators, then the odd ones), so a row's result is
    /// bitwise the same whether it is multiplied alone or in a batch.
    #[inline(always)]
    unsafe fn dot4_body<const VNNI: bool, const F: u8>(row: &[u8], acts: [&ActQ8; 4]) -> [f32; 4] {
        let ts = match F {
            Q4_0 | IQ4_NL => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            _ => 34,
        };
        let blocks = acts[0].d.len();
        assert!(row.len() >= blocks * ts);
        assert!(acts.iter().all(|a| a.d.len() == blocks && a.s.len() == blocks && a.qs.len() >= blocks * QK));
        let base = row.as_ptr();
        // SAFETY (whole block): AVX2 and FMA are enabled by every caller; indices stay below
        // `blocks`, in bounds of the row and of every activation row by the asserts above.
        unsafe {
            let mut acc0 = [_mm256_setzero_ps(); 4];
            let mut acc1 = [_mm256_setzero_ps(); 4];
            let (mut off0, mut off1) = ([0f32; 4], [0f32; 4]);
            let mut b = 0;
            while b + 4 <= blocks {
                let w = [
                    weight_block::<F>(base, ts, b),
                    weight_block::<F>(base, ts, b + 1),
                    weight_block::<F>(base, ts, b + 2),
                    weight_block::<F>(base, ts, b + 3),
                ];
                for r in 0..4 {
                    let (s0, d0, c0) = act_part::<VNNI, F>(w[0], acts[r], b);
                    let (s1, d1, c1) = act_part::<VNNI, F>(w[1], acts[r], b + 1);
                    let (s2, d2, c2) = act_part::<VNNI, F>(w[2], acts[r], b + 2);
                    let (s3, d3, c3) = act_part::<VNNI, F>(w[3], acts[r], b + 3);
                    acc0[r] = _mm256_fmadd_ps(s0, _mm256_set1_ps(d0), acc0[r]);
                    acc1[r] = _mm256_fmadd_ps(s1, _mm256_set1_ps(d1), acc1[r]);
                    acc0[r] = _mm256_fmadd_ps(s2, _mm256_set1_ps(d2), acc0[r]);
                    acc1[r] = _mm256_fmadd_ps(s3, _mm256_set1_ps(d3), acc1[r]);
                    off0[r] += c0 + c2;
                    off1[r] += c1 + c3;
                }
                b += 4;
            }
            while b < blocks {
                let w = weight_block::<F>(base, ts, b);
                for r in 0..4 {
                    let (s0, d0, c0) = act_part::<VNNI, F>(w, acts[r], b);
                    acc0[r] = _mm256_fmadd_ps(s0, _mm256_set1_ps(d0), acc0[r]);
                    off0[r] += c0;
                }
                b += 1;
            }
            let mut out = [0f32; 4];
            for r in 0..4 {
                let acc = _mm256_add_ps(acc0[r], acc1[r]);
                let half = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
                let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
                let one = _mm_add_ss(half, _mm_movehdup_ps(half));
                out[r] = _mm_cvtss_f32(one) + (off0[r] + off1[r]);
            }
            out
        }
    }

    /// Dispatches to the instantiation compiled for the path's features.
    ///
    /// # Safety
    /// As [`dot_avx2`] / [`dot_vnni`].
    pub unsafe fn dot<const VNNI: bool>(dtype: Format, row: &[u8], act: &ActQ8) -> f32 {
        // SAFETY: forwarded contract.
        unsafe { if VNNI { dot_vnni(dtype, row, act) } else { dot_avx2(dtype, row, act) } }
    }

    /// Block `b` of a row at `base` (`ts` bytes a block): (its 8 partial integer sums as f32,
    /// their scale, the offset term). A function, not a closure, so that it is inlined into the
    /// callers' target features (a closure is compiled without them, and its intrinsics become
    /// calls).
    ///
    /// # Safety
    /// AVX2 (and VNNI when asked) are enabled in the caller; block `b` of the row and of the
    /// activations is in bounds.
    #[inline(always)]
    unsafe fn block<const VNNI: bool, const F: u8>(base: *const u8, ts: usize, act: &ActQ8, b: usize) -> (__m256, f32, f32) {
        // SAFETY: the caller's contract; every load is unaligned.
        unsafe {
            let blk = base.add(b * ts);
            let x = _mm256_loadu_si256(act.qs.as_ptr().add(b * QK).cast());
            let d = f16_at(blk);
            let (q, x, c) = match F {
                Q4_0 => (nibbles(blk.add(2)), x, -8.0 * d),
                Q4_1 => (nibbles(blk.add(4)), x, f16_at(blk.add(2))),
                Q5_0 => (_mm256_or_si256(nibbles(blk.add(6)), high_bits(blk.add(2))), x, -16.0 * d),
                Q5_1 => (_mm256_or_si256(nibbles(blk.add(8)), high_bits(blk.add(4))), x, f16_at(blk.add(2))),
                IQ4_NL => {
                    let w = iq4_values(blk.add(2));
                    (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), 0.0)
                }
                _ => {
                    let w = _mm256_loadu_si256(blk.add(2).cast());
                    (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), 0.0)
                }
            };
            let sums = _mm256_cvtepi32_ps(dot_u8_i8::<VNNI>(q, x));
            (sums, d * *act.d.get_unchecked(b), c * *act.s.get_unchecked(b))
        }
    }

    #[inline(always)]
    unsafe fn dot_body<const VNNI: bool, const F: u8>(row: &[u8], act: &ActQ8) -> f32 {
        let ts = match F {
            Q4_0 | IQ4_NL => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            _ => 34,
        };
        let blocks = act.d.len();
        assert!(row.len() >= blocks * ts && act.qs.len() >= blocks * QK);
        let base = row.as_ptr();
        // Two blocks per iteration into two accumulators (and two offsets): the FMA and add
        // latency chains of one block no longer serialise the next, and the weight loads of
        // both are in flight together.
        // SAFETY (whole block): AVX2 and FMA are enabled by every caller; indices stay below
        // `blocks` (pairs while two remain, then the odd last one), in bounds by the assert.
        unsafe {
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let (mut off0, mut off1) = (0f32, 0f32);
            let mut b = 0;
            while b + 4 <= blocks {
                let (s0, d0, c0) = block::<VNNI, F>(base, ts, act, b);
                let (s1, d1, c1) = block::<VNNI, F>(base, ts, act, b + 1);
                let (s2, d2, c2) = block::<VNNI, F>(base, ts, act, b + 2);
                let (s3, d3, c3) = block::<VNNI, F>(base, ts, act, b + 3);
                acc0 = _mm256_fmadd_ps(s0, _mm256_set1_ps(d0), acc0);
                acc1 = _mm256_fmadd_ps(s1, _mm256_set1_ps(d1), acc1);
                acc0 = _mm256_fmadd_ps(s2, _mm256_set1_ps(d2), acc0);
                acc1 = _mm256_fmadd_ps(s3, _mm256_set1_ps(d3), acc1);
                off0 += c0 + c2;
                off1 += c1 + c3;
                b += 4;
            }
            while b < blocks {
                let (s0, d0, c0) = block::<VNNI, F>(base, ts, act, b);
                acc0 = _mm256_fmadd_ps(s0, _mm256_set1_ps(d0), acc0);
                off0 += c0;
                b += 1;
            }
            let acc = _mm256_add_ps(acc0, acc1);
            let half = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
            let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let one = _mm_add_ss(half, _mm_movehdup_ps(half));
            _mm_cvtss_f32(one) + (off0 + off1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::formats::dequantize;
    use super::*;
    use crate::test_values::{assert_within_activation_rounding, blocks, values};

    /// Every format on every path this CPU has, odd shapes included, against a plain f32
    /// matmul of the dequantized weights; and the simple formats' SIMD paths against the scalar
    /// integer reference (same quantized activations) to float rounding.
    #[test]
    fn every_format_matches_the_dequantized_reference_on_every_path() {
        use Format::*;
        let mut ran = Vec::new();
        for path in Path::ALL.into_iter().filter(|p| p.available()) {
            ran.push(path);
            for dtype in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Iq4Nl, Q2K, Q3K, Q4K, Q5K, Q6K] {
                let shapes: &[(usize, usize, usize)] = if dtype.is_k_quant() {
                    &[(1, 256, 1), (1, 512, 37), (3, 768, 65), (9, 256, 33)]
                } else {
                    &[(1, 32, 1), (1, 96, 37), (3, 576, 65), (9, 1536, 33), (2, 32, 70), (16, 64, 9), (4, 32, 3)]
                };
                for &(m, k, n) in shapes {
                    let bytes = blocks(dtype, n, k, (m * k + n) as u64);
                    let mut wd = vec![0f32; n * k];
                    dequantize(dtype, &bytes, &mut wd);
                    let x = values(m * k, 99 + k as u64);
                    let got = matmul(&x, m, k, dtype, &bytes, n, path);
                    for i in 0..m {
                        let act = quantize_act(&x[i * k..(i + 1) * k]);
                        for j in 0..n {
                            let g = got[i * n + j];
                            let at = format!("{path:?} {dtype:?} m{m} k{k} n{n} [{i},{j}]");
                            assert_within_activation_rounding(g, &wd[j * k..(j + 1) * k], &x[i * k..(i + 1) * k], &at);
                            if !dtype.is_k_quant() {
                                let reference = dot_portable(dtype, &bytes[j * row_bytes(dtype, k)..(j + 1) * row_bytes(dtype, k)], &act);
                                assert!((g - reference).abs() <= 1e-4 * (1.0 + reference.abs()), "{path:?} {dtype:?} [{i},{j}]: {g} vs integer reference {reference}");
                            }
                        }
                    }
                }
            }
        }
        assert!(ran.contains(&Path::Portable));
        eprintln!("quantized kernel paths tested on this CPU: {ran:?}");
    }

    /// The AVX2 and AVX-512 activation quantizations give the scalar one's bytes, scales and sums, on
    /// ordinary values, exact halves, zero blocks, signed zeros, infinities and NaNs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn quantizing_activations_with_avx2_and_avx512_equals_the_scalar_form() {
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 on this CPU: only the scalar activation quantization runs here");
            return;
        }
        let mut x = values(32 * 40, 11);
        x[..32].fill(0.0);
        x[32..64].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.5);
        x[64..96].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 });
        x[100] = f32::NAN;
        x[130] = f32::INFINITY;
        x[170] = f32::NEG_INFINITY;
        x[200] = -1e30;
        x[231..240].fill(f32::NAN);
        // a block whose scale is 1: its values land on exact halves, rounded away from zero
        x[256..288].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 * 4.0 - 61.5);
        x[287] = 127.0;
        // every block's (bytes, scale bits, sum), in order
        let mut scalar = Vec::new();
        quantize_blocks_body(&x, &mut |b, q, d, sum| scalar.push((b, *q, d.to_bits(), sum)));
        let mut avx2 = Vec::new();
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { quantize_blocks_avx2(&x, &mut |b, q, d, sum| avx2.push((b, *q, d.to_bits(), sum))) };
        assert_eq!(scalar.len(), x.len() / QK);
        assert_eq!(avx2, scalar);
        // 40 blocks: two whole sixteens of scales and a part one
        if std::is_x86_feature_detected!("avx512f") {
            let mut avx512 = Vec::new();
            // SAFETY: the CPU has AVX-512 F (checked above).
            unsafe { quantize_blocks_avx512(&x, &mut |b, q, d, sum| avx512.push((b, *q, d.to_bits(), sum))) };
            assert_eq!(avx512, scalar);
        } else {
            eprintln!("no AVX-512 on this CPU: its activation quantization is not tested here");
        }
    }

    /// A row's product does not depend on the batch it is in: the four-row SIMD path adds in
    /// the single-row path's order, so every row of a batch equals that row multiplied alone,
    /// bit for bit (the greedy tokens of a sequence cannot change with the batch).
    #[test]
    fn batched_rows_equal_single_rows_bitwise() {
        use Format::*;
        for path in Path::ALL.into_iter().filter(|p| p.available()) {
            for dtype in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Iq4Nl] {
                let (m, k, n) = (11, 32 * 7, 19);
                let bytes = blocks(dtype, n, k, 5);
                let x = values(m * k, 6);
                let batch = matmul(&x, m, k, dtype, &bytes, n, path);
                for i in 0..m {
                    let alone = matmul(&x[i * k..(i + 1) * k], 1, k, dtype, &bytes, n, path);
                    for j in 0..n {
                        assert_eq!(batch[i * n + j].to_bits(), alone[j].to_bits(), "{path:?} {dtype:?} row {i} col {j}");
                    }
                }
            }
        }
    }
}
