//! CPU kernels for `x @ w.T` (x `[m, k]` f32, w `[n, k]` f32, bf16 or f16): decode and batches.
//!
//! candle's gemm path for a handful of rows against a [out, in] weight reaches about a third of
//! this machine's memory bandwidth, and decode is bound by streaming the weights once per step.
//! For a batch it repacks the whole transposed weight on every call, which was 40% of a
//! 16-row decode step. Here the weight rows are split across the rayon pool (sized by
//! RAYON_NUM_THREADS, like candle's) and each task computes register tiles of `RW` weight rows
//! against up to `RX` rows of x: every weight vector loaded is used for `RX` rows and every x
//! vector for `RW` weight rows, and the weights are read in place, never copied. Past
//! [`f32_max_rows`] rows (a long prompt) f32 weights go back to candle's gemm, faster there.
//!
//! A bf16 or f16 weight stays in its 16 bits in memory, which halves the bytes a decode step
//! streams, and is widened to f32 in registers (a bf16 is the high half of an f32; F16C's
//! `vcvtph2ps` converts an f16; both exactly). Products
//! and sums are f32, so the result equals the f32 computation on the widened weights up to the
//! order of additions. Every element's additions happen in the same order whatever the number of
//! rows, so a row's result does not depend on the batch it is in.
//!
//! On a CPU with AVX-512F the model holds dense weights in column panels instead
//! ([`crate::panels`], faster at every row count); these tiles serve the other paths and the
//! few weights that stay row-major (an MoE router, dense rows inside a quantized weight).
//!
//! One place, [`Isa::selected`], picks the instruction set: AVX-512F, AVX2 + FMA, or portable
//! Rust. `TPSERVE_CPU_ISA=portable|avx2|avx512` caps it (for tests and comparisons), and
//! [`matmul_transposed_with`] takes it explicitly.

use std::sync::OnceLock;

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

use crate::output::Output;

/// Above this many rows an f32 weight goes to candle's gemm: its broadcast microkernel beats the
/// AVX2 dot-product tiles once repacking the weight is spread over enough rows (examples/dense_matmul,
/// 2 threads, Zen 3: tiles 75 against 53 GFLOP/s at 16 rows and 90 against 71 at 32;
/// about even from 48 to 64 rows, where runs disagree by more than the difference; 117 against
/// 153 at 256). The AVX-512 tiles (six x rows a pass) stay ahead of candle up to 256 rows and
/// even at 512 (Ice Lake, 2 threads, a whole step of the 100M shape, alternating in one
/// process: 96 against 78 GFLOP/s at 64 rows, 102 against 90 at 128, 104 against 97 at 256,
/// 96 against 98 at 512; pass-major since (`PASS_MAJOR_ROWS`), 1.14x candle's speed at 256
/// and 0.93-0.96x at 512 and 1,024). Decode batches are below either limit. bf16 weights have
/// no limit (an f32 copy of the weight per call makes candle slower up to 512 rows).
pub fn f32_max_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 256,
        Isa::Avx2 | Isa::Portable => 64,
    }
}

/// From this many x rows on, a task goes pass-major (`x86::block_by_pass`): every pass of x rows
/// over all of the task's weight rows, which then come from L2, rather than every few weight
/// rows over all x rows, which at hundreds of rows come from L3. Ice Lake, 2 threads, a whole
/// step of the 100M shape, alternating in one process: bf16 weights 0.93x at 16 rows, 0.97x at
/// 32, 1.20x at 48, 1.29x at 128, 1.68x at 512; f32 0.90x at 16, 1.01x at 48, 1.20x at 128,
/// 1.17x at 256; the AVX2 path on bf16 0.87x at 32, 1.05x at 48, 1.47x at 512.
const PASS_MAJOR_ROWS: usize = 48;
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
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
            }
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

/// Whether bf16- or f16-resident weights are the better default on this CPU: a SIMD path widens
/// them for about the cost of a load, so decode streams half the bytes of f32 for the same result.
pub fn half_weights_fast() -> bool {
    Isa::selected() >= Isa::Avx2
}

/// `x [m, k] @ w.T` for w `[n, k]`, or None when this kernel does not apply (not CPU, x not
/// f32, w not f32, bf16 or f16, more than [`f32_max_rows`] rows against an f32 weight,
/// non-contiguous weight).
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
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
    let stored = layout.start_offset()..layout.start_offset() + n * k;
    let weights = match w.dtype() {
        DType::F32 if m <= f32_max_rows(isa) => Rows::F32(&cpu.as_slice::<f32>()?[stored]),
        DType::BF16 => Rows::Half(Half::Bf16, bits(&cpu.as_slice::<half::bf16>()?[stored])),
        DType::F16 => Rows::Half(Half::F16, bits(&cpu.as_slice::<half::f16>()?[stored])),
        _ => return Ok(None),
    };
    // x is read in place when contiguous (a copy of it per product was 3 MB a step at 16 rows).
    let x = x.contiguous()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let Storage::Cpu(x_cpu) = &*x_storage else { return Ok(None) };
    let x_values = &x_cpu.as_slice::<f32>()?[x_layout.start_offset()..x_layout.start_offset() + m * k];
    Ok(Some(Tensor::from_vec(product(x_values, weights, m, k, isa), (m, n), x.device())?))
}

/// A 16-bit float format of weights, widened to f32 exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    Bf16,
    F16,
}

impl Half {
    /// The tiles' const-generic code for weights of this format ([`x86`]'s `W`).
    #[cfg(target_arch = "x86_64")]
    fn code(self) -> u8 {
        match self {
            Half::Bf16 => x86::BF16,
            Half::F16 => x86::F16,
        }
    }
}

/// Weight rows `[rows, k]`, as stored.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    /// bf16 or f16 bit patterns
    Half(Half, &'a [u16]),
}

impl<'a> Rows<'a> {
    fn len(self) -> usize {
        match self {
            Rows::F32(w) => w.len(),
            Rows::Half(_, w) => w.len(),
        }
    }

    /// Rows `first..first + count` of `k` elements.
    fn rows(self, first: usize, count: usize, k: usize) -> Rows<'a> {
        match self {
            Rows::F32(w) => Rows::F32(&w[first * k..(first + count) * k]),
            Rows::Half(h, w) => Rows::Half(h, &w[first * k..(first + count) * k]),
        }
    }
}

/// The 16-bit float types of `half`, each a `#[repr(transparent)]` wrapper of its u16 bits.
trait Bits16 {}
impl Bits16 for half::bf16 {}
impl Bits16 for half::f16 {}

/// The bit patterns of 16-bit floats.
fn bits<T: Bits16>(values: &[T]) -> &[u16] {
    // SAFETY: T is half::bf16 or half::f16 (the only Bits16 types), #[repr(transparent)]
    // wrappers of u16: same size, alignment and validity, so the slice can be viewed as its
    // bit patterns.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u16>(), values.len()) }
}

/// One stored weight widened to f32 (exact for both formats).
#[inline(always)]
fn widen(half: Half, bits: u16) -> f32 {
    match half {
        Half::Bf16 => f32::from_bits((bits as u32) << 16),
        Half::F16 => half::f16::from_bits(bits).to_f32(),
    }
}

/// `x [m, k] @ w.T` as `[m, n]`, the weight rows split into tasks over the pool. The one place
/// a path is taken.
fn product(x: &[f32], w: Rows, m: usize, k: usize, isa: Isa) -> Vec<f32> {
    let n = w.len() / k;
    // Not zeroed first: the tasks write every element (a 16-row step of the 100M shape zeroed
    // 7.4 MB of outputs, 1.8% of a bf16 step's samples).
    let mut values = Vec::with_capacity(m * n);
    let out = Output::uninit(&mut values.spare_capacity_mut()[..m * n], n);
    // One job per task, as `panels::for_each_task` and for its reason (AVX2 tiles, a 16-row
    // step of the 100M shape alternating step by step in one process: bf16 2.2% less time, f32
    // 4.1%, one row the same).
    (0..n.div_ceil(ROWS_PER_TASK)).into_par_iter().with_max_len(1).for_each(|task| {
        let first = task * ROWS_PER_TASK;
        let rows = w.rows(first, ROWS_PER_TASK.min(n - first), k);
        match isa {
            Isa::Portable => portable(out, first, rows, x, m, k),
            // SAFETY (both arms): `isa` is available on this CPU, asserted by the caller; the
            // task writes only the columns of its rows `first..`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::block::<x86::Avx2>(out, first, rows, x, m, k) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::block::<x86::Avx512>(out, first, rows, x, m, k) },
            // Isa::available is false for the x86 paths elsewhere, so this arm is never taken;
            // the portable path keeps it correct rather than a crash.
            #[cfg(not(target_arch = "x86_64"))]
            _ => portable(out, first, rows, x, m, k),
        }
    });
    // SAFETY: the tasks wrote every element: their rows `first..` cover the n columns, and
    // each writes its columns of all m rows (every path's passes cover rows 0..m; k > 0 and
    // m > 0, checked by the caller).
    unsafe { values.set_len(m * n) };
    values
}

/// The portable path for one task: each weight row (widened once into a scratch row when
/// bf16 or f16) dotted with every x row.
fn portable(out: Output, first: usize, w: Rows, x: &[f32], m: usize, k: usize) {
    let mut widened = vec![0f32; k];
    for r in 0..w.len() / k {
        let row: &[f32] = match w {
            Rows::F32(w) => &w[r * k..(r + 1) * k],
            Rows::Half(half, w) => {
                for (dst, &bits) in widened.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                    *dst = widen(half, bits);
                }
                &widened
            }
        };
        for c in 0..m {
            // SAFETY: c < m and first + r < n (the task's rows), written by this task only.
            unsafe { *out.at(first, c, r) = dot(row, &x[c * k..(c + 1) * k]) }
        }
    }
}

/// A dot product with 16 independent accumulators, which the compiler keeps in two vector
/// registers (the order of additions differs from a serial sum by rounding only).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (a, b) = (&a[c * LANES..(c + 1) * LANES], &b[c * LANES..(c + 1) * LANES]);
        for l in 0..LANES {
            acc[l] += a[l] * b[l];
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

/// The SIMD paths. A tile computes `RW` weight rows against `RX` rows of x
/// with one f32 vector accumulator per pair, so each weight vector loaded (and widened) is used
/// `RX` times and each x vector `RW` times.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Half, Output, Rows};

    /// Weight rows per tile (the last rows of a task go one at a time).
    const RW: usize = 4;

    /// The weights' element format, a tile's const generic `W`: f32, bf16 or f16 bits.
    pub const F32: u8 = 0;
    pub const BF16: u8 = 1;
    pub const F16: u8 = 2;

    pub struct Avx2;
    pub struct Avx512;

    /// Bytes to prefetch while a tile runs, spread evenly over its steps along k: part of the
    /// next tile's weights. Prefetching never faults, so the range need not be inside anything.
    #[derive(Clone, Copy)]
    pub struct Ahead {
        pub start: *const i8,
        pub len: usize,
    }

    pub trait Simd {
        /// Most x rows per tile: the accumulators, `RW * RX` vectors, must fit the registers.
        const RX: usize;
        /// From how many x rows on [`block`] widens 16-bit weight rows into an f32 scratch block
        /// once, rather than in registers on every pass (more than `RX`; `usize::MAX`: never).
        const WIDEN_ONCE_FROM: usize;
        /// Writes out[c * out_stride + r] = dot(w row r, x row c) for r < rw, c < rx, and
        /// prefetches the bytes of `ahead` meanwhile.
        ///
        /// # Safety
        /// The CPU has the path's features; `w` points to `rw` rows of `k` elements (f32 when
        /// `elem` is [`F32`], else u16 bits of [`BF16`] or [`F16`]), `x` to `rx` rows of `k`
        /// f32, `out` to `rx` rows of `out_stride >= rw` writable f32; `rw` is 1 or [`RW`],
        /// `1 <= rx <= Self::RX`.
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile(elem: u8, ahead: Ahead, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize);
        /// `out[i] = ` `bits[i]` widened to f32 (exact), for i below both lengths.
        ///
        /// # Safety
        /// The CPU has the path's features.
        unsafe fn widen_rows(half: Half, bits: &[u16], out: &mut [f32]);
    }

    /// [`Simd::widen_rows`] a vector at a time (`$lanes` values through `$widen`), the tail one
    /// by one.
    macro_rules! widen_rows_fn {
        ($name:ident, $feature:literal, $lanes:expr, $widen:ident, $widen_h:ident, $store:ident) => {
            /// # Safety
            /// As [`Simd::widen_rows`].
            #[target_feature(enable = $feature)]
            unsafe fn $name(half: Half, bits: &[u16], out: &mut [f32]) {
                let n = bits.len().min(out.len());
                let mut i = 0;
                while i + $lanes <= n {
                    // SAFETY: elements i..i + $lanes of both slices exist (i + $lanes <= n).
                    unsafe {
                        let p = bits.as_ptr().add(i);
                        $store(out.as_mut_ptr().add(i), if half == Half::Bf16 { $widen(p) } else { $widen_h(p) });
                    }
                    i += $lanes;
                }
                for (o, &b) in out[i..n].iter_mut().zip(&bits[i..n]) {
                    *o = super::widen(half, b);
                }
            }
        };
    }

    macro_rules! tile_fn {
        ($name:ident, $feature:literal, $lanes:expr, $zero:ident, $load:ident, $widen:ident, $widen_h:ident, $fma:ident, $hsum:ident) => {
            /// # Safety
            /// As [`Simd::tile`], with `W` for its `elem`.
            #[target_feature(enable = $feature)]
            unsafe fn $name<const W: u8, const TR: usize, const TC: usize>(
                ahead: Ahead,
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
                    // `ahead`'s cache lines, issued at an even rate over the steps (16.16 fixed
                    // point: no division in the loop).
                    let lines = ahead.len.div_ceil(64);
                    let rate = (lines << 16) / (k / $lanes).max(1);
                    let (mut due, mut issued) = (0usize, 0usize);
                    // Issues the lines due after `due` (16.16) more.
                    let mut prefetch = |more: usize| {
                        due += more;
                        while issued < lines && issued < (due >> 16) + 1 {
                            // A prefetch never faults, and wrapping_add computes the address
                            // without asserting that it is inside the weights.
                            _mm_prefetch::<_MM_HINT_T0>(ahead.start.wrapping_add(64 * issued));
                            issued += 1;
                        }
                    };
                    // One step: the vectors at kk of every row into the accumulators.
                    let step = |acc: &mut [[_; TC]; TR], kk: usize| {
                        let mut xv = [$zero(); TC];
                        for c in 0..TC {
                            xv[c] = $load(x.add(c * k + kk));
                        }
                        for r in 0..TR {
                            let wv = match W {
                                BF16 => $widen(w.cast::<u16>().add(r * k + kk)),
                                F16 => $widen_h(w.cast::<u16>().add(r * k + kk)),
                                _ => $load(w.cast::<f32>().add(r * k + kk)),
                            };
                            for c in 0..TC {
                                acc[r][c] = $fma(wv, xv[c], acc[r][c]);
                            }
                        }
                    };
                    // With several x rows, two steps an iteration (the same order of additions):
                    // the loop's own instructions and the prefetch bookkeeping were about as many
                    // as the arithmetic's, which the front end must also deliver (32 rows: 10%
                    // less time). One x row is bound by memory, where it made no difference.
                    let mut kk = 0;
                    while TC > 1 && kk + 2 * $lanes <= k {
                        prefetch(2 * rate);
                        step(&mut acc, kk);
                        step(&mut acc, kk + $lanes);
                        kk += 2 * $lanes;
                    }
                    while kk + $lanes <= k {
                        prefetch(rate);
                        step(&mut acc, kk);
                        kk += $lanes;
                    }
                    for r in 0..TR {
                        for c in 0..TC {
                            let mut sum = $hsum(acc[r][c]);
                            for t in kk..k {
                                let wt = match W {
                                    BF16 => super::widen(Half::Bf16, *w.cast::<u16>().add(r * k + t)),
                                    F16 => super::widen(Half::F16, *w.cast::<u16>().add(r * k + t)),
                                    _ => *w.cast::<f32>().add(r * k + t),
                                };
                                sum += wt * *x.add(c * k + t);
                            }
                            *out.add(c * out_stride + r) = sum;
                        }
                    }
                }
            }
        };
    }

    macro_rules! dispatch {
        ($f:ident, $elem:expr, $rw:expr, $rx:expr, $args:tt, [$($c:literal),*]) => {
            match ($elem, $rw, $rx) {
                $(
                    (F32, RW, $c) => $f::<F32, RW, $c>$args,
                    (F32, 1, $c) => $f::<F32, 1, $c>$args,
                    (BF16, RW, $c) => $f::<BF16, RW, $c>$args,
                    (BF16, 1, $c) => $f::<BF16, 1, $c>$args,
                    (F16, RW, $c) => $f::<F16, RW, $c>$args,
                    (F16, 1, $c) => $f::<F16, 1, $c>$args,
                )*
                // The callers' contract (`Simd::tile`): elem is one of the three, rw is RW or 1
                // and rx is 1..=RX, every one of which has an arm above.
                other => unreachable!("no tile for {other:?}"),
            }
        };
    }

    // ---- AVX2 + FMA (+ F16C): 8 lanes, 16 vector registers (RW * RX accumulators + RX + 1 in use).

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn zero256() -> __m256 {
        _mm256_setzero_ps()
    }

    /// # Safety
    /// `p` points to 8 readable f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load256(p: *const f32) -> __m256 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        unsafe { _mm256_loadu_ps(p) }
    }

    /// 8 bf16 -> 8 f32: zero-extend each to 32 bits and shift it into the high half (exact).
    /// # Safety
    /// `p` points to 8 readable u16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen256(p: *const u16) -> __m256 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        let bits = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))
    }

    /// 8 f16 -> 8 f32 (`vcvtph2ps`, exact).
    /// # Safety
    /// `p` points to 8 readable u16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen256_f16(p: *const u16) -> __m256 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast::<__m128i>()) })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fma256(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum256(v: __m256) -> f32 {
        let sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
        _mm_cvtss_f32(_mm_add_ss(sum, _mm_shuffle_ps(sum, sum, 1)))
    }

    tile_fn!(tile256, "avx2,fma,f16c", 8, zero256, load256, widen256, widen256_f16, fma256, hsum256);
    widen_rows_fn!(widen_rows256, "avx2,fma,f16c", 8, widen256, widen256_f16, _mm256_storeu_ps);

    impl Simd for Avx2 {
        const RX: usize = 3;
        /// Against widening in registers on every pass, a whole 16-40-row bf16 step took
        /// 1.3-1.5x less time (Ice Lake's AVX2 path, 2 threads, alternating in one process).
        /// Below nine rows (three passes or fewer) the scratch pass, bound by its stores, saves
        /// too little: widening in registers, a whole decode step of the 100M shape took
        /// 1.03-1.33x less time at 4 rows and 0.91-1.22x at 8, where at 16 rows it took
        /// 1.06-1.11x more and at 32 1.2x more (Zen 2, 2 threads, alternating runs).
        const WIDEN_ONCE_FROM: usize = 9;
        unsafe fn tile(elem: u8, ahead: Ahead, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { dispatch!(tile256, elem, rw, rx, (ahead, w, x, k, out, out_stride), [1, 2, 3]) }
        }
        unsafe fn widen_rows(half: Half, bits: &[u16], out: &mut [f32]) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { widen_rows256(half, bits, out) }
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

    /// 16 f16 -> 16 f32 (`vcvtph2ps`, exact).
    /// # Safety
    /// `p` points to 16 readable u16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen512_f16(p: *const u16) -> __m512 {
        // SAFETY: as the caller promises; unaligned loads are allowed.
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) })
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

    tile_fn!(tile512, "avx512f", 16, zero512, load512, widen512, widen512_f16, fma512, hsum512);
    widen_rows_fn!(widen_rows512, "avx512f", 16, widen512, widen512_f16, _mm512_storeu_ps);

    impl Simd for Avx512 {
        /// 24 accumulators, six x vectors and a weight vector: 31 of the 32 registers. Against
        /// four x rows (16 accumulators), a whole step of the 100M shape at 16, 32 and 64 rows took
        /// 1.03-1.21x less time (Ice Lake, 2 threads, alternating in one process).
        const RX: usize = 6;
        /// Widening in registers on every pass took 1.12-1.49x less time than widening once
        /// into scratch, on a whole bf16 step at 7-47 rows (Ice Lake, 2 threads, alternating
        /// in one process, three runs): the scratch pass waited on the weights from memory
        /// with nothing to overlap, where the tiles' loads overlap their arithmetic.
        const WIDEN_ONCE_FROM: usize = usize::MAX;
        unsafe fn tile(elem: u8, ahead: Ahead, rw: usize, rx: usize, w: *const u8, x: *const f32, k: usize, out: *mut f32, out_stride: usize) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { dispatch!(tile512, elem, rw, rx, (ahead, w, x, k, out, out_stride), [1, 2, 3, 4, 5, 6]) }
        }
        unsafe fn widen_rows(half: Half, bits: &[u16], out: &mut [f32]) {
            // SAFETY: forwarded from the caller's contract.
            unsafe { widen_rows512(half, bits, out) }
        }
    }

    /// One task's weight rows (the first is row `first` of the matrix) against every x row,
    /// into their columns of `out`, group-major: each group of `RW` weight rows against all the
    /// x rows, in even passes of at most `S::RX` ([`pass_rows`]). From
    /// [`super::PASS_MAJOR_ROWS`] x rows on, the passes go outside instead ([`block_by_pass`]).
    /// The tiles read f32 weights in place. bf16 and f16 weights are read in place too when there are
    /// at most `S::RX` x rows (one tile column: each weight vector is widened once anyway) or
    /// fewer than the path's [`Simd::WIDEN_ONCE_FROM`] (the tiles widen in registers on every
    /// pass); otherwise each group of `RW` weight rows is widened once, a vector at a time
    /// ([`Simd::widen_rows`]), into an f32 scratch block (in L1) and reused for every pass of x
    /// rows. (The scalar widening was a fifth of a 16-row bf16 step's samples; vectorised, the
    /// step took 1.03-1.26x less time at 8 to 32 rows, alternating in one process.)
    ///
    /// # Safety
    /// The CPU has the features of path `S`; `out` is `[m, n]` with `first + rows <= n`, and
    /// no other task writes these columns.
    pub(super) unsafe fn block<S: Simd>(out: Output, first: usize, w: Rows, x: &[f32], m: usize, k: usize) {
        let rows = w.len() / k;
        assert!(w.len() == rows * k && x.len() == m * k);
        if m >= super::PASS_MAJOR_ROWS {
            // SAFETY: this function's contract is block_by_pass's.
            return unsafe { block_by_pass::<S>(out, first, w, x, m, k) };
        }
        let widen_once = matches!(w, Rows::Half(..)) && m >= S::WIDEN_ONCE_FROM.max(S::RX + 1);
        let mut scratch = if widen_once { vec![0f32; RW * k] } else { Vec::new() };
        let mut j = 0;
        while j < rows {
            let rw = if rows - j >= RW { RW } else { 1 };
            let (elem, tile_w) = match w {
                Rows::Half(half, bits) if widen_once => {
                    // SAFETY: the CPU has S's features (this function's contract).
                    unsafe { S::widen_rows(half, &bits[j * k..(j + rw) * k], &mut scratch) };
                    (F32, scratch.as_ptr().cast::<u8>())
                }
                Rows::Half(half, bits) => (half.code(), bits[j * k..].as_ptr().cast::<u8>()),
                Rows::F32(values) => (F32, values[j * k..].as_ptr().cast::<u8>()),
            };
            // While this tile runs, the next RW weight rows (as stored: rows are contiguous)
            // come in, a share per pass over the x rows, so that fetching them overlaps all
            // of this tile's arithmetic rather than only its first pass (at 16 rows a step took
            // 17% less); none after the task's last rows, which may be another thread's.
            let next_rows = RW.min(rows - j - rw);
            let next = match w {
                Rows::F32(values) => Ahead { start: values[(j + rw) * k..].as_ptr().cast(), len: 4 * next_rows * k },
                Rows::Half(_, bits) => Ahead { start: bits[(j + rw) * k..].as_ptr().cast(), len: 2 * next_rows * k },
            };
            let passes = m.div_ceil(S::RX);
            let share = next.len.div_ceil(passes).next_multiple_of(64);
            let mut i = 0;
            for pass in 0..passes {
                let rx = pass_rows(m, passes, pass);
                let ahead = Ahead { start: next.start.wrapping_add(pass * share), len: share.min(next.len.saturating_sub(pass * share)) };
                // SAFETY: tile_w holds rw rows of k weights (of format `elem`:
                // the task's rows j.. or their widened copy), x[i * k..] holds rx more rows of
                // k, and the tile writes elements (i + c, first + j + r), c < rx, r < rw, of
                // the [m, n] output, which are this task's (this function's contract); the CPU
                // has S's features.
                unsafe {
                    let dst = out.at(first, i, j);
                    S::tile(elem, ahead, rw, rx, tile_w, x[i * k..].as_ptr(), k, dst, out.n());
                }
                i += rx;
            }
            j += rw;
        }
    }

    /// x rows of pass `pass` when `m` rows go in `passes` passes: as even as they can be, the
    /// longer passes first (16 rows in six passes take 3, 3, 3, 3, 2 and 2, where a last pass of
    /// one row loaded each weight vector for a single multiply-add).
    fn pass_rows(m: usize, passes: usize, pass: usize) -> usize {
        m / passes + usize::from(pass < m % passes)
    }

    thread_local! {
        /// A task's weight rows widened to f32 (16-bit weights against many x rows): 64 rows of
        /// the largest k a pool thread has met (192 KiB at k = 768, 2.2 MiB at k = 8,960), kept
        /// for the thread's life rather than allocated per product.
        static WIDENED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// [`block`] for many x rows, pass-major: each pass of up to `S::RX` x rows (in L1) goes over
    /// all of the task's weight rows (in L2 after the first pass), instead of every group of `RW`
    /// weight rows going over all the x rows (which, at hundreds of rows, streamed x from L3
    /// once per group). 16-bit weights are widened once for the whole task. The additions of each
    /// element are the same, in the same order, as in [`block`]'s tiles.
    ///
    /// # Safety
    /// As [`block`].
    unsafe fn block_by_pass<S: Simd>(out: Output, first: usize, w: Rows, x: &[f32], m: usize, k: usize) {
        let rows = w.len() / k;
        let mut widened = WIDENED.take();
        let weights: *const f32 = match w {
            Rows::F32(values) => values.as_ptr(),
            Rows::Half(half, bits) => {
                // It only grows (to the largest task's rows): resized to each product's size,
                // it would be zero-filled again whenever k changed from one product to the next.
                if widened.len() < rows * k {
                    widened.resize(rows * k, 0.0);
                }
                // SAFETY: the CPU has S's features (this function's contract).
                unsafe { S::widen_rows(half, bits, &mut widened[..rows * k]) };
                widened.as_ptr()
            }
        };
        let none = Ahead { start: std::ptr::null(), len: 0 };
        let passes = m.div_ceil(S::RX);
        let mut i = 0;
        for pass in 0..passes {
            let rx = pass_rows(m, passes, pass);
            let mut j = 0;
            while j < rows {
                let rw = if rows - j >= RW { RW } else { 1 };
                // The first pass reads f32 weights from memory: the next group's rows come in
                // meanwhile. Later passes find them in L2.
                let ahead = match w {
                    Rows::F32(values) if i == 0 => Ahead { start: values[(j + rw) * k..].as_ptr().cast(), len: 4 * RW.min(rows - j - rw) * k },
                    _ => none,
                };
                // SAFETY: weights + j * k holds rw rows of k f32 (the task's rows or their
                // widened copy), x[i * k..] holds rx rows of k, and the tile writes elements
                // (i + c, first + j + r), c < rx, r < rw, which are this task's (this function's
                // contract); the CPU has S's features.
                unsafe {
                    let dst = out.at(first, i, j);
                    S::tile(F32, ahead, rw, rx, weights.add(j * k).cast(), x[i * k..].as_ptr(), k, dst, out.n());
                }
                j += rw;
            }
            i += rx;
        }
        WIDENED.set(widened);
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
    /// and of the task (64 rows); the tests take m from 1 to 8 and past every tile width.
    const SHAPES: [(usize, usize); 9] =
        [(1, 1), (7, 3), (16, 5), (17, 4), (31, 67), (64, 64), (100, 37), (257, 130), (768, 129)];

    #[test]
    fn bf16_and_f16_weights_match_the_reference_on_every_path_this_cpu_has() {
        let mut ran = Vec::new();
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            for dtype in [DType::BF16, DType::F16] {
                for m in (1..=8).chain([9, 13, 33, 50, 64]) {
                    for (k, n) in SHAPES {
                        check(isa, dtype, m, k, n);
                    }
                }
            }
            ran.push(isa);
        }
        assert!(ran.contains(&Isa::Portable));
        eprintln!("bf16 and f16 kernel paths tested: {ran:?} (selected: {:?})", Isa::selected());
    }

    #[test]
    fn f32_weights_match_the_reference_on_every_path_this_cpu_has() {
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            for m in (1..=8).chain([9, 13, 33, 50, 64]) {
                for (k, n) in SHAPES {
                    check(isa, DType::F32, m, k, n);
                }
            }
        }
    }

    /// Widening a run of bf16 or f16 weights a vector at a time gives the scalar widening's
    /// values, on every path this CPU has, for runs on and off whole vectors (bit patterns of a
    /// u16 sampled across the range, subnormals and infinities included; a NaN stays a NaN).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn widening_half_rows_is_exact_on_every_path_this_cpu_has() {
        use x86::Simd;
        let bits: Vec<u16> = (0..4099u32).map(|i| (i.wrapping_mul(40503) >> 3) as u16).collect();
        let paths: [(Isa, unsafe fn(Half, &[u16], &mut [f32])); 2] = [(Isa::Avx2, x86::Avx2::widen_rows), (Isa::Avx512, x86::Avx512::widen_rows)];
        for (isa, widen_rows) in paths.into_iter().filter(|(isa, _)| isa.available()) {
            for half in [Half::Bf16, Half::F16] {
                let want: Vec<f32> = bits.iter().map(|&b| widen(half, b)).collect();
                for len in [0, 1, 7, 8, 15, 16, 17, 33, 4099] {
                    let mut out = vec![0f32; len];
                    // SAFETY: the CPU has the path (filtered above).
                    unsafe { widen_rows(half, &bits[..len], &mut out) };
                    for (i, (g, w)) in out.iter().zip(&want[..len]).enumerate() {
                        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{isa:?} {half:?} value {i}: {g} vs {w}");
                    }
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
        for (m, k, n) in [(1, 64, 448), (3, 100, 37), (8, 768, 130), (2, 17, 1), (16, 768, 300), (64, 96, 70)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let ours = matmul_transposed(&x, &w).unwrap().unwrap();
            let reference = x.matmul(&w.t().unwrap()).unwrap();
            let diff = (ours - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4 * (k as f32).sqrt(), "m={m} k={k} n={n}: {diff}");
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        // Every element sums in the same order whatever the number of rows: row i of a batch
        // equals the same row alone, bit for bit, on every path and weight dtype, in a batch
        // below PASS_MAJOR_ROWS and in one at or above it.
        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
            for (dtype, m) in [DType::F32, DType::BF16].into_iter().flat_map(|dtype| [(dtype, 13), (dtype, PASS_MAJOR_ROWS + 2)]) {
                let (k, n) = (257, 130);
                let x = Tensor::from_vec(values(m * k, 3), (m, k), &Device::Cpu).unwrap();
                let w = Tensor::from_vec(values(n * k, 4), (n, k), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                let batch = matmul_transposed_with(&x, &w, isa).unwrap().unwrap().to_vec2::<f32>().unwrap();
                for (i, row) in batch.iter().enumerate() {
                    let alone = matmul_transposed_with(&x.narrow(0, i, 1).unwrap(), &w, isa).unwrap().unwrap();
                    assert_eq!(&alone.to_vec2::<f32>().unwrap()[0], row, "{isa:?} {dtype:?} row {i}");
                }
            }
        }
    }

    #[test]
    fn declines_what_it_does_not_handle() {
        let w = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
        // A prefill's many rows against an f32 weight (candle's gemm is faster there).
        let x = Tensor::zeros((f32_max_rows(Isa::selected()) + 1, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w).unwrap().is_none());
        assert!(matmul_transposed(&x, &w.to_dtype(DType::BF16).unwrap()).unwrap().is_some());
        // bf16 activations: the model computes in bf16, candle handles it.
        let x = Tensor::zeros((1, 4), DType::BF16, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w.to_dtype(DType::BF16).unwrap()).unwrap().is_none());
        // f64 weights have no kernel (f16 ones do).
        let x = Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(matmul_transposed(&x, &w.to_dtype(DType::F64).unwrap()).unwrap().is_none());
        assert!(matmul_transposed(&x, &w.to_dtype(DType::F16).unwrap()).unwrap().is_some());
        // A transposed (non-contiguous) weight.
        let w = Tensor::zeros((4, 6), DType::BF16, &Device::Cpu).unwrap().t().unwrap();
        assert!(matmul_transposed(&Tensor::zeros((1, 4), DType::F32, &Device::Cpu).unwrap(), &w).unwrap().is_none());
    }
}
