//! CPU kernels for `x @ w.T` (x `[m, k]` f32, w `[n, k]`): the decode case and bf16 weights.
//!
//! candle's gemm path for a handful of rows against a [out, in] weight reaches about a third of
//! this machine's memory bandwidth, and decode is bound by streaming the weights once per step.
//! Here each weight row is read once and dotted with every row of `x` while it is in L1, and the
//! weight rows are split across the rayon pool (sized by RAYON_NUM_THREADS, like candle's).
//!
//! Weights may be f32 (up to [`MAX_ROWS`] rows of `x`; candle's gemm does the rest) or bf16
//! (any number of rows): a bf16 weight stays bf16 in memory, which halves the bytes a decode step
//! streams, and is widened to f32 in registers (a bf16 is the high half of an f32, so widening is
//! exact). Products and sums are f32, so the result equals the f32 computation on the widened
//! weights up to the order of additions.
//!
//! One place, [`Isa::selected`], picks the instruction set: AVX-512F, AVX2 + FMA, or portable
//! Rust. `TPSERVE_CPU_ISA=portable|avx2|avx512` caps it (for tests and comparisons), and
//! [`matmul_transposed_with`] takes it explicitly.

use std::sync::OnceLock;

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

/// Above this many rows candle's blocked gemm wins for f32 weights (it reuses weights across
/// rows in registers). bf16 weights have no such limit: their kernel blocks rows itself.
const MAX_ROWS: usize = 8;
/// Weight rows per parallel task: large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 64;

/// The instruction-set paths of these kernels, in increasing order of preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, whatever the compiler vectorises for the baseline target.
    Portable,
    /// AVX2 and FMA: 8 f32 lanes.
    Avx2,
    /// AVX-512F: 16 f32 lanes.
    Avx512,
}

impl Isa {
    /// Every path, for tests that run each one the CPU has.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best path this CPU has, capped by `TPSERVE_CPU_ISA` when set (read once).
    pub fn selected() -> Isa {
        static SELECTED: OnceLock<Isa> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let cap = Isa::selected_cap();
            Isa::ALL.into_iter().filter(|isa| *isa <= cap && isa.available()).max().unwrap_or(Isa::Portable)
        })
    }

    /// The cap `TPSERVE_CPU_ISA` sets (Avx512, the highest, when unset); the quantized kernels
    /// (`quant::kernels::Path`) read the same setting.
    pub fn selected_cap() -> Isa {
        match std::env::var("TPSERVE_CPU_ISA").as_deref() {
            Ok("portable") => Isa::Portable,
            Ok("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Whether bf16-resident weights are the better default on this CPU: a SIMD path widens them
/// for about the cost of a load, so decode streams half the bytes of f32 for the same result.
pub fn bf16_weights_fast() -> bool {
    Isa::selected() >= Isa::Avx2
}

/// `x [m, k] @ w.T` for w `[n, k]`, or None when this kernel does not apply (not CPU, x not
/// f32, w neither f32 nor bf16, too many rows for an f32 weight, non-contiguous weight).
pub fn matmul_transposed(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    matmul_transposed_with(x, w, Isa::selected())
}

/// [`matmul_transposed`] on a given path. Panics if the CPU does not have it.
pub fn matmul_transposed_with(x: &Tensor, w: &Tensor, isa: Isa) -> Result<Option<Tensor>> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    if !x.device().is_cpu() || x.dtype() != DType::F32 || !w.is_contiguous() {
        return Ok(None);
    }
    let (Ok((m, k)), Ok((n, k_w))) = (x.dims2(), w.dims2()) else { return Ok(None) };
    if m == 0 || k != k_w || k == 0 {
        return Ok(None);
    }
    let transposed = match w.dtype() {
        DType::F32 if m <= MAX_ROWS => {
            let x_values = x.flatten_all()?.to_vec1::<f32>()?;
            let (storage, layout) = w.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
            let all = cpu.as_slice::<f32>()?;
            f32_weights(&x_values, &all[layout.start_offset()..layout.start_offset() + n * k], m, k, isa)
        }
        DType::BF16 => {
            let x_values = x.flatten_all()?.to_vec1::<f32>()?;
            let (storage, layout) = w.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
            let all = cpu.as_slice::<half::bf16>()?;
            let weights = &all[layout.start_offset()..layout.start_offset() + n * k];
            bf16_weights(&x_values, bf16_bits(weights), m, k, isa)
        }
        _ => return Ok(None),
    };
    Ok(Some(Tensor::from_vec(transpose(&transposed, n, m), (m, n), x.device())?))
}

/// `[n, m]` -> `[m, n]` (the kernels compute one task's weight rows into one contiguous block).
fn transpose(values: &[f32], n: usize, m: usize) -> Vec<f32> {
    if m == 1 {
        return values.to_vec();
    }
    let mut out = vec![0f32; m * n];
    for (j, row) in values.chunks_exact(m).enumerate() {
        for (i, &value) in row.iter().enumerate() {
            out[i * n + j] = value;
        }
    }
    out
}

fn bf16_bits(values: &[half::bf16]) -> &[u16] {
    // SAFETY: half::bf16 is a #[repr(transparent)] wrapper of u16: same size, alignment and
    // validity, so the slice can be viewed as its bit patterns.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u16>(), values.len()) }
}

#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The f32-weight path: out `[n, m]`, out[j * m + i] = dot(w[j], x[i]).
fn f32_weights(x: &[f32], weights: &[f32], m: usize, k: usize, isa: Isa) -> Vec<f32> {
    let n = weights.len() / k;
    let mut transposed = vec![0f32; n * m];
    let use_fma = isa >= Isa::Avx2;
    transposed
        .par_chunks_mut(ROWS_PER_TASK * m)
        .zip(weights.par_chunks(ROWS_PER_TASK * k))
        .for_each(|(out, w_rows)| {
            if use_fma {
                // SAFETY: `isa` is available (asserted by the caller), and Avx2 or better implies
                // the CPU has AVX2 and FMA.
                unsafe { rows_fma(out, w_rows, x, m, k) }
            } else {
                rows_generic(out, w_rows, x, m, k)
            }
        });
    transposed
}

/// The bf16-weight path: out `[n, m]`, out[j * m + i] = dot(widen(w[j]), x[i]) in f32.
fn bf16_weights(x: &[f32], weights: &[u16], m: usize, k: usize, isa: Isa) -> Vec<f32> {
    let n = weights.len() / k;
    let mut transposed = vec![0f32; n * m];
    transposed
        .par_chunks_mut(ROWS_PER_TASK * m)
        .zip(weights.par_chunks(ROWS_PER_TASK * k))
        .for_each(|(out, w_rows)| match isa {
            Isa::Portable => bf16_block_portable(out, w_rows, x, m, k),
            // SAFETY (both arms): `isa` is available on this CPU, asserted by the caller.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::bf16_block::<x86::Avx2>(out, w_rows, x, m, k) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::bf16_block::<x86::Avx512>(out, w_rows, x, m, k) },
            // Isa::available is false for the x86 paths elsewhere, so this arm is never taken;
            // the portable path keeps it correct rather than a crash.
            #[cfg(not(target_arch = "x86_64"))]
            _ => bf16_block_portable(out, w_rows, x, m, k),
        });
    transposed
}

/// Portable: each weight row widened once into a scratch row, then dotted with every x row.
fn bf16_block_portable(out: &mut [f32], w_rows: &[u16], x: &[f32], m: usize, k: usize) {
    let mut row = vec![0f32; k];
    for (j, w_row) in w_rows.chunks_exact(k).enumerate() {
        for (dst, &bits) in row.iter_mut().zip(w_row) {
            *dst = widen(bits);
        }
        for i in 0..m {
            out[j * m + i] = dot::<false>(&row, &x[i * k..(i + 1) * k]);
        }
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

/// The SIMD paths for bf16 weights. A tile computes `RW` weight rows against `RX` rows of x
/// with one f32 vector accumulator per pair, so each weight vector loaded (and widened) is used
/// `RX` times and each x vector `RW` times.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Weight rows per tile (the last rows of a task go one at a time).
    const RW: usize = 4;

    pub struct Avx2;
    pub struct Avx512;

    pub trait Simd {
        /// Most x rows per tile: the accumulators, `RW * RX` vectors, must fit the registers.
        const RX: usize;
        /// Writes out[r * out_stride + c] = dot(w row r, x row c) for r < rw, c < rx.
        ///
        /// # Safety
        /// The CPU has the path's features; `w` points to `rw` rows of `k` elements (u16 bf16
        /// bits when `bf16`, else f32), `x` to `rx` rows of `k` f32, `out` to `rw` rows of
        /// `out_stride >= rx` f32; `rw` is 1 or [`RW`], `1 <= rx <= Self::RX`.
        unsafe fn tile(bf16: bool, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize);
    }

    macro_rules! tile_fn {
        ($name:ident, $feature:literal, $lanes:expr, $zero:ident, $load:ident, $widen:ident, $fma:ident, $hsum:ident) => {
            /// # Safety
            /// As [`Simd::tile`].
            #[target_feature(enable = $feature)]
            unsafe fn $name<const BF16: bool, const TR: usize, const TC: usize>(
                w: *const u8,
                x: *const f32,
                k: usize,
                out: *mut f32,
                out_stride: usize,
            ) {
                // SAFETY: every pointer offset below stays inside the rows the caller vouched
                // for (r < TR, c < TC, element < k), and the CPU has $feature.
                unsafe {
                    let mut acc = [[$zero(); TC]; TR];
                    let mut kk = 0;
                    while kk + $lanes <= k {
                        let mut xv = [$zero(); TC];
                        for c in 0..TC {
                            xv[c] = $load(x.add(c * k + kk));
                        }
                        for r in 0..TR {
                            let wv = if BF16 {
                                $widen(w.cast::<u16>().add(r * k + kk))
                            } else {
                                $load(w.cast::<f32>().add(r * k + kk))
                            };
                            for c in 0..TC {
                                acc[r][c] = $fma(wv, xv[c], acc[r][c]);
                            }
                        }
                        kk += $lanes;
                    }
                    for r in 0..TR {
                        for c in 0..TC {
                            let mut sum = $hsum(acc[r][c]);
                            for t in kk..k {
                                let wt = if BF16 {
                                    super::widen(*w.cast::<u16>().add(r * k + t))
                                } else {
                                    *w.cast::<f32>().add(r * k + t)
                                };
                                sum += wt * *x.add(c * k + t);
                            }
                            *out.add(r * out_stride + c) = sum;
                        }
                    }
                }
            }
        };
    }

    macro_rules! dispatch {
        ($f:ident, $bf16:expr, $rw:expr, $rx:expr, $args:tt, [$($c:literal),*]) => {
            match ($bf16, $rw, $rx) {
                $(
                    (true, RW, $c) => $f::<true, RW, $c>$args,
                    (true, 1, $c) => $f::<true, 1, $c>$args,
                    (false, RW, $c) => $f::<false, RW, $c>$args,
                    (false, 1, $c) => $f::<false, 1, $c>$args,
                )*
                // The callers' contract (`Simd::tile`): rw is RW or 1 and rx is 1..=RX, every
                // one of which has an arm above.
                other => unreachable!("no tile for {other:?}"),
            }
        };
    }

    // ---- AVX2 + FMA: 8 lanes, 16 vector registers (RW * RX accumulators + RX + 1 in use).

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn zero256() -> __m256 {
        _mm256_setzero_ps()
    }

    /// # Safety
    /// `p` points to 8 readable f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load256(p: *const f32) -> __m256 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        unsafe { _mm256_loadu_ps(p) }
    }

    /// 8 bf16 -> 8 f32: zero-extend each to 32 bits and shift it into the high half (exact).
    /// # Safety
    /// `p` points to 8 readable u16.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen256(p: *const u16) -> __m256 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        let bits = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fma256(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum256(v: __m256) -> f32 {
        let sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        _mm_cvtss_f32(_mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1)))
    }

    tile_fn!(tile256, "avx2,fma", 8, zero256, load256, widen256, fma256, hsum256);

    impl Simd for Avx2 {
        const RX: usize = 2;
        unsafe fn tile(bf16: bool, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { dispatch!(tile256, bf16, rw, rx, (w, x, k, out, out_stride), [1, 2]) }
        }
    }

    // ---- AVX-512F: 16 lanes, 32 vector registers.

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn zero512() -> __m512 {
        _mm512_setzero_ps()
    }

    /// # Safety
    /// `p` points to 16 readable f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load512(p: *const f32) -> __m512 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        unsafe { _mm512_loadu_ps(p) }
    }

    /// 16 bf16 -> 16 f32, as [`widen256`].
    /// # Safety
    /// `p` points to 16 readable u16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen512(p: *const u16) -> __m512 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        let bits = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fma512(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum512(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    tile_fn!(tile512, "avx512f", 16, zero512, load512, widen512, fma512, hsum512);

    impl Simd for Avx512 {
        const RX: usize = 4;
        unsafe fn tile(bf16: bool, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { dispatch!(tile512, bf16, rw, rx, (w, x, k, out, out_stride), [1, 2, 3, 4]) }
        }
    }

    /// One task's weight rows against every x row: out `[rows, m]`. With at most `S::RX` x rows
    /// the tiles read bf16 directly; with more, each group of weight rows is widened once into
    /// an f32 scratch block (in L1) and reused for every group of x rows.
    ///
    /// # Safety
    /// The CPU has the features of path `S`.
    pub unsafe fn bf16_block<S: Simd>(out: &mut [f32], w_rows: &[u16], x: &[f32], m: usize, k: usize) {
        let rows = w_rows.len() / k;
        assert!(w_rows.len() == rows * k && x.len() == m * k && out.len() == rows * m);
        let mut scratch = if m > S::RX { vec![0f32; RW * k] } else { Vec::new() };
        let mut j = 0;
        while j < rows {
            let rw = if rows - j >= RW { RW } else { 1 };
            let w = &w_rows[j * k..(j + rw) * k];
            let out_rows = out[j * m..(j + rw) * m].as_mut_ptr();
            if m <= S::RX {
                // SAFETY: w holds rw rows of k bf16, x holds m <= RX rows of k, out_rows rw rows
                // of m; the CPU has S's features (this function's contract).
                unsafe { S::tile(true, rw, m, w.as_ptr().cast(), x.as_ptr(), k, out_rows, m) }
            } else {
                for (dst, &bits) in scratch.iter_mut().zip(w) {
                    *dst = super::widen(bits);
                }
                let mut i = 0;
                while i < m {
                    let rx = (m - i).min(S::RX);
                    // SAFETY: scratch holds rw rows of k f32, x[i * k..] holds rx more rows of
                    // k, and out_rows + i leaves rx columns of each of the rw rows of m.
                    unsafe { S::tile(false, rw, rx, scratch.as_ptr().cast(), x[i * k..].as_ptr(), k, out_rows.add(i), m) }
                    i += rx;
                }
            }
            j += rw;
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Deterministic values in [-1, 1), some exactly representable, some not.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The plain reference: sum over k in f64 of x * w (w as stored), and the sum of |terms|
    /// that bounds the rounding error of any f32 order of summation.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![0f32; m * n];
        let mut scale = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut abs) = (0f64, 0f64);
                for t in 0..k {
                    let term = x[i * k + t] as f64 * w[j * k + t] as f64;
                    sum += term;
                    abs += term.abs();
                }
                out[i * n + j] = sum as f32;
                scale[i * n + j] = abs as f32;
            }
        }
        (out, scale)
    }

    fn check(isa: Isa, weight_dtype: DType, m: usize, k: usize, n: usize) {
        let x = Tensor::from_vec(values(m * k, (m * 1000 + k) as u64), (m, k), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(values(n * k, (n * 7 + k) as u64), (n, k), &Device::Cpu)
            .unwrap()
            .to_dtype(weight_dtype)
            .unwrap();
        let ours = matmul_transposed_with(&x, &w, isa).unwrap().unwrap();
        assert_eq!(ours.dims(), &[m, n]);
        let ours = ours.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let x_values = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let w_values = w.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (expected, scale) = reference(&x_values, &w_values, m, n, k);
        for idx in 0..m * n {
            let diff = (ours[idx] - expected[idx]).abs();
            assert!(
                diff <= 1e-6 * (k as f32).sqrt() * (1.0 + scale[idx]),
                "{isa:?} {weight_dtype:?} m={m} k={k} n={n} at ({}, {}): {} vs {}",
                idx / n,
                idx % n,
                ours[idx],
                expected[idx]
            );
        }
    }

    /// Odd shapes: k below, at and off multiples of 8/16/32, n off multiples of the tile (4)
    /// and of the task (64 rows), m from 1 to 8 and past the f32 limit.
    const SHAPES: [(usize, usize); 9] =
        [(1, 1), (7, 3), (16, 5), (17, 4), (31, 67), (64, 64), (100, 37), (257, 130), (768, 129)];

    #[test]
    fn bf16_weights_match_the_reference_on_every_path_this_cpu_has() {
        let mut ran = Vec::new();
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            for m in (1..=8).chain([9, 13, 33, 64]) {
                for (k, n) in SHAPES {
                    check(isa, DType::BF16, m, k, n);
                }
            }
            ran.push(isa);
        }
        assert!(ran.contains(&Isa::Portable));
        eprintln!("bf16 kernel paths tested: {ran:?} (selected: {:?})", Isa::selected());
    }

    #[test]
    fn f32_weights_match_the_reference_on_every_path_this_cpu_has() {
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            for m in 1..=MAX_ROWS {
                for (k, n) in SHAPES {
                    check(isa, DType::F32, m, k, n);
                }
            }
        }
    }

    #[test]
    fn the_portable_path_can_be_forced() {
        // The same product through the forced portable path and the selected one.
        let x = Tensor::from_vec(values(3 * 100, 1), (3, 100), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(values(37 * 100, 2), (37, 100), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let portable = matmul_transposed_with(&x, &w, Isa::Portable).unwrap().unwrap();
        let selected = matmul_transposed(&x, &w).unwrap().unwrap();
        let diff = (portable - selected).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-4, "{diff}");
    }

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
        // Too many rows for an f32 weight (candle's gemm is faster there).
        let x = Tensor::zeros((9, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w).unwrap().is_none());
        // bf16 activations: the model computes in bf16, candle handles it.
        let x = Tensor::zeros((1, 4), DType::BF16, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w.to_dtype(DType::BF16).unwrap()).unwrap().is_none());
        // f16 weights have no kernel.
        let x = Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w.to_dtype(DType::F16).unwrap()).unwrap().is_none());
        // A transposed (non-contiguous) weight.
        let w = Tensor::zeros((4, 6), DType::BF16, &Device::Cpu).unwrap().t().unwrap();
        assert!(matmul_transposed(&Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap(), &w).unwrap().is_none());
    }
}
