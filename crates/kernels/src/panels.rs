//! Dense f32 and bf16 weights packed at load into column panels, and their products with f32
//! activations by a broadcast-form microkernel.
//!
//! The row-major tiles of [`crate::cpu_matmul`] take dot products: each step loads a vector of
//! every weight row and of every x row, and each tile ends in horizontal sums. At 16 rows they
//! reached 86-145 GFLOP/s of the two Ice Lake cores' 276. Here a weight `[n, k]` is stored as
//! panels of [`PANEL`] weight rows (output columns), k-major: at each k a panel holds one vector
//! of 16 weights, one per column. A tile keeps `R x V` vector accumulators, `R` x rows against
//! `V` panels; at each k it loads `V` weight vectors and broadcasts one x value per row, so a
//! loaded weight serves `R` rows and a broadcast serves `V` panels, and no horizontal sum is
//! needed (a whole step of the 100M Qwen3 shape, Ice Lake, 2 threads, alternating in one
//! process: bf16 1.16x the tiles' speed at 1 row, 1.39x at 8, 1.25x at 16, 1.55x at 32, 1.45x
//! at 512; f32 1.19x at 1 and at 16 rows, 1.46x at 64).
//!
//! bf16 panels hold pairs: the 32-bit lane of a column at pair `j` has the weight at k = 2j in
//! its low half and k = 2j + 1 in its high half. A shift left by 16 widens the first and a mask
//! of the high half the second, exactly (a bf16 is the high half of an f32): one load and two
//! integer operations per 32 weights, no shuffle.
//!
//! Every output element is one accumulator lane that adds `x[k] * w[k]` (fused) in the order of
//! k, in runs of [`K_RUN`] terms from zero whose sums are added to the element's total in turn,
//! whatever the number of rows, the tile or the thread: a row's result does not depend on its
//! batch, and a prefill's last row equals the same row decoded alone.
//!
//! The loader packs dense CPU weights when [`Isa::selected`] has a panel body (AVX-512F);
//! elsewhere they stay row-major for `cpu_matmul`'s tiles. (A 256-bit body, four or six rows
//! against one panel, measured 0.79-1.15x the AVX2 tiles' speed on the same Ice Lake, so AVX2
//! keeps the tiles.) The portable body here is the reference the SIMD body is tested against.

use rayon::prelude::*;

use crate::cpu_matmul::Isa;
use crate::output::Output;

/// Columns (weight rows) per panel: one AVX-512 vector of f32.
pub const PANEL: usize = 16;
/// Terms an output element sums from zero before adding the run's sum to its total: runs of
/// 64 along k err like the row tiles' sixteen lanes (each a serial sum of k / 16 terms), where
/// one serial sum over k = 1,536 erred by twice as much on SmolLM2's logits (1.1e-4 against
/// transformers, 6.4e-5 before). Even, so that a run starts on a bf16 pair.
const K_RUN: usize = 64;
/// Panels per parallel task: large enough to amortise scheduling, small enough to balance.
const TASK_PANELS: usize = 6;
/// x rows a task takes through all of its panels before the next rows, so that a long prompt's
/// block of rows (147 KiB at k = 768, 393 KiB at 2,048) stays in L2 beside the task's panels
/// while every tile of the block reads it.
const ROW_BLOCK: usize = 48;

/// Whether the loader should pack dense weights for this path: it has a panel body.
pub fn packs_for(isa: Isa) -> bool {
    isa == Isa::Avx512
}

/// A packed weight, as stored.
#[derive(Clone, Copy)]
pub enum Packed<'a> {
    /// panel `p` is `[k][PANEL]` f32
    F32(&'a [f32]),
    /// panel `p` is `[k.div_ceil(2)][PANEL][2]` bf16 bit patterns (pairs along k)
    Bf16(&'a [u16]),
}

/// Elements of one panel of a `[n, k]` weight.
fn panel_len(k: usize, bf16: bool) -> usize {
    if bf16 { PANEL * 2 * k.div_ceil(2) } else { PANEL * k }
}

/// Elements of a packed `[n, k]` weight (the last panel padded with zero columns).
pub fn packed_len(n: usize, k: usize, bf16: bool) -> usize {
    n.div_ceil(PANEL) * panel_len(k, bf16)
}

/// Where weight `(row, kk)` of a `[_, k]` weight lies in its packing.
#[inline]
fn position(row: usize, kk: usize, k: usize, bf16: bool) -> usize {
    let (panel, lane) = (row / PANEL, row % PANEL);
    let within = if bf16 { (kk / 2) * PANEL * 2 + lane * 2 + kk % 2 } else { kk * PANEL + lane };
    panel * panel_len(k, bf16) + within
}

/// Packs a row-major `[n, k]` weight (f32 values or bf16 bits), a panel per parallel task. The
/// buffer is advised for 2 MiB pages before it is written (`crate::pages`).
fn pack<T: Copy + Default + Send + Sync>(w: &[T], n: usize, k: usize, bf16: bool) -> Vec<T> {
    assert_eq!(w.len(), n * k, "{} values are not [{n}, {k}]", w.len());
    let mut out = Vec::with_capacity(packed_len(n, k, bf16));
    crate::pages::advise_unwritten(out.spare_capacity_mut());
    out.resize(packed_len(n, k, bf16), T::default());
    out.par_chunks_mut(panel_len(k, bf16).max(1)).enumerate().for_each(|(p, panel)| {
        for lane in 0..PANEL.min(n - p * PANEL) {
            let row = &w[(p * PANEL + lane) * k..(p * PANEL + lane + 1) * k];
            for (kk, &v) in row.iter().enumerate() {
                panel[position(lane, kk, k, bf16)] = v;
            }
        }
    });
    out
}

/// A row-major `[n, k]` f32 weight in panels.
pub fn pack_f32(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    pack(w, n, k, false)
}

/// A row-major `[n, k]` bf16 weight in panels (`half::bf16` values or their `u16` bits).
pub fn pack_bf16<T: Copy + Default + Send + Sync>(bits: &[T], n: usize, k: usize) -> Vec<T> {
    pack(bits, n, k, true)
}

/// Rows `rows` of a packed `[n, k]` weight, row-major, as stored (f32 values or bf16 bits).
fn unpack<T: Copy>(packed: &[T], k: usize, bf16: bool, rows: std::ops::Range<usize>) -> Vec<T> {
    let mut out = Vec::with_capacity(rows.len() * k);
    for row in rows {
        out.extend((0..k).map(|kk| packed[position(row, kk, k, bf16)]));
    }
    out
}

impl Packed<'_> {
    /// Rows `rows` of this `[_, k]` weight, widened to f32 (an embedding lookup).
    pub fn rows_f32(self, k: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
        match self {
            Packed::F32(p) => unpack(p, k, false, rows),
            Packed::Bf16(p) => unpack(p, k, true, rows).into_iter().map(widen).collect(),
        }
    }
}

/// Rows `rows` of a packed `[_, k]` f32 weight, row-major.
pub fn unpack_f32(packed: &[f32], k: usize, rows: std::ops::Range<usize>) -> Vec<f32> {
    unpack(packed, k, false, rows)
}

/// Rows `rows` of a packed `[_, k]` bf16 weight, row-major (`half::bf16` values or bits).
pub fn unpack_bf16<T: Copy>(packed: &[T], k: usize, rows: std::ops::Range<usize>) -> Vec<T> {
    unpack(packed, k, true, rows)
}

#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `x [m, k] @ w.T` -> `[m, n]` for a packed `[n, k]` weight, on path `isa` (the portable body
/// where it has none of its own). Panics if the CPU does not have the path.
pub fn matmul(x: &[f32], m: usize, k: usize, w: Packed, n: usize, isa: Isa) -> Vec<f32> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
    let bf16 = matches!(w, Packed::Bf16(_));
    let stored = match w {
        Packed::F32(p) => p.len(),
        Packed::Bf16(p) => p.len(),
    };
    assert_eq!(stored, packed_len(n, k, bf16), "the packed weight is not [{n}, {k}]");
    let mut values = vec![0f32; m * n];
    if k == 0 {
        return values;
    }
    let out = Output::new(&mut values, n);
    let panels = n.div_ceil(PANEL);
    (0..panels.div_ceil(TASK_PANELS)).into_par_iter().for_each(|task| {
        let panels = task * TASK_PANELS..((task + 1) * TASK_PANELS).min(panels);
        match isa {
            // SAFETY: the CPU has AVX-512F (asserted above); the task writes only the columns
            // of its panels, and `w` holds `n` columns packed for `k` (asserted above).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::task(out, panels, w, n, x, m, k) },
            _ => portable_task(out, panels, w, n, x, m, k),
        }
    });
    values
}

/// Calls `tile(rows, columns, first_row, first_column)` for every tile of a task: blocks of
/// [`ROW_BLOCK`] x rows, each through every group of `group` panels, each in tiles of `r` rows.
fn for_each_tile(panels: std::ops::Range<usize>, n: usize, m: usize, group: usize, r: usize, mut tile: impl FnMut(usize, usize, usize, usize)) {
    let mut block = 0;
    while block < m {
        let block_end = (block + ROW_BLOCK).min(m);
        let mut p = panels.start;
        while p < panels.end {
            let panels_here = (panels.end - p).min(group);
            let columns = (n - p * PANEL).min(panels_here * PANEL);
            let mut i = block;
            while i < block_end {
                let rows = (block_end - i).min(r);
                tile(rows, columns, i, p * PANEL);
                i += rows;
            }
            p += panels_here;
        }
        block = block_end;
    }
}

/// The portable body: each element's additions in the SIMD body's order (runs of [`K_RUN`] from
/// zero, added to the total in turn), one multiply and one add per term (not fused, so its last
/// bits may differ from the SIMD body's), a row and a panel at a time.
fn portable_task(out: Output, panels: std::ops::Range<usize>, w: Packed, n: usize, x: &[f32], m: usize, k: usize) {
    let weight = |column: usize, kk: usize| match w {
        Packed::F32(p) => p[position(column, kk, k, false)],
        Packed::Bf16(p) => widen(p[position(column, kk, k, true)]),
    };
    for_each_tile(panels, n, m, 1, 1, |_, columns, i, first| {
        let mut total = [0f32; PANEL];
        for run in (0..k).step_by(K_RUN) {
            let mut acc = [0f32; PANEL];
            for kk in run..(run + K_RUN).min(k) {
                let xv = x[i * k + kk];
                for (lane, acc) in acc.iter_mut().enumerate().take(columns) {
                    *acc += xv * weight(first + lane, kk);
                }
            }
            for (total, acc) in total.iter_mut().zip(acc) {
                *total = if run == 0 { acc } else { *total + acc };
            }
        }
        for (lane, &total) in total.iter().enumerate().take(columns) {
            // SAFETY: i < m and first + lane < n, a column of this task's panels.
            unsafe { *out.at(first, i, lane) = total }
        }
    });
}

/// The AVX-512F body: tiles of up to [`R`] x rows against up to [`V`] panels.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Output, PANEL, Packed, for_each_tile, panel_len};

    /// x rows per tile.
    const R: usize = 8;
    /// Panels per tile: `R * V` = 24 accumulators, `V` weight vectors, `V` widened ones, a
    /// broadcast and bf16's mask, the 32 registers.
    const V: usize = 3;

    /// One task's panels against every x row.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `w` is a packed `[n, k]` weight; `out` is `[m, n]`, and no other
    /// task writes the columns of `panels`.
    pub(super) unsafe fn task(out: Output, panels: std::ops::Range<usize>, w: Packed, n: usize, x: &[f32], m: usize, k: usize) {
        let (bf16, base, elem) = match w {
            Packed::F32(p) => (false, p.as_ptr().cast::<u8>(), 4),
            Packed::Bf16(p) => (true, p.as_ptr().cast::<u8>(), 2),
        };
        let panel_bytes = panel_len(k, bf16) * elem;
        for_each_tile(panels, n, m, V, R, |rows, columns, i, first| {
            let used = columns.div_ceil(PANEL);
            // A tile of fewer panels points the unused ones at its last (never read).
            let ptrs: [*const u8; V] = std::array::from_fn(|v| base.wrapping_add((first / PANEL + v.min(used - 1)) * panel_bytes));
            // SAFETY: the panels hold `columns` columns packed for k, from column `first`; x
            // rows i..i + rows exist; the tile writes rows i.. and columns first..first +
            // columns of `out`, which are this task's (this function's contract); the CPU has
            // AVX-512F.
            unsafe { tile(bf16, rows, used, &ptrs, x[i * k..].as_ptr(), k, out.at(first, i, 0), n, columns) }
        });
    }

    /// Picks the monomorphised [`tile_body`] for (bf16, rows, panels).
    ///
    /// # Safety
    /// As [`tile_body`]; `1 <= rows <= R`, `1 <= used <= V`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(bf16: bool, rows: usize, used: usize, w: &[*const u8], x: *const f32, k: usize, out: *mut f32, out_stride: usize, columns: usize) {
        macro_rules! pick {
            ($($r:literal)*) => {
                match (bf16, rows, used) {
                    $(
                        (true, $r, 3) => tile_body::<true, $r, 3>(w, x, k, out, out_stride, columns),
                        (true, $r, 2) => tile_body::<true, $r, 2>(w, x, k, out, out_stride, columns),
                        (true, $r, 1) => tile_body::<true, $r, 1>(w, x, k, out, out_stride, columns),
                        (false, $r, 3) => tile_body::<false, $r, 3>(w, x, k, out, out_stride, columns),
                        (false, $r, 2) => tile_body::<false, $r, 2>(w, x, k, out, out_stride, columns),
                        (false, $r, 1) => tile_body::<false, $r, 1>(w, x, k, out, out_stride, columns),
                    )*
                    // for_each_tile gives 1..=R rows and 1..=V panels a tile.
                    other => unreachable!("no panel tile for {other:?}"),
                }
            };
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { pick!(1 2 3 4 5 6 7 8) }
    }

    /// `TR` x rows (stride `k`) against the panels `w[..TV]` (a pair of k per 32-bit lane when
    /// `BF16`), into `out[r * out_stride + column]` for the first `columns` columns. At every
    /// k, each row's x value is broadcast and multiplied into `TV` accumulators, so each
    /// element adds its terms in the order of k.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `w[v]`, v < TV, points to a panel packed for `k` (bf16 bits when
    /// `BF16`, else f32); `x` to `TR` rows of `k` f32; `out` to `TR` rows of `out_stride` f32
    /// of which the first `columns <= TV * PANEL` are writable.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_body<const BF16: bool, const TR: usize, const TV: usize>(
        w: &[*const u8],
        x: *const f32,
        k: usize,
        out: *mut f32,
        out_stride: usize,
        columns: usize,
    ) {
        // SAFETY: every load below is inside a panel (pair j < k.div_ceil(2), or kk < k)
        // or an x row (element < k), and every store inside the first `columns` columns
        // of an out row, as the caller promises.
        unsafe {
            let w: [*const u8; TV] = std::array::from_fn(|v| w[v]);
            // One step: weight vectors `wv` against x at `kk`.
            let step = |acc: &mut [[__m512; TV]; TR], wv: &[__m512; TV], kk: usize| {
                for r in 0..TR {
                    let b = _mm512_set1_ps(*x.add(r * k + kk));
                    for v in 0..TV {
                        acc[r][v] = _mm512_fmadd_ps(b, wv[v], acc[r][v]);
                    }
                }
            };
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let pair = |j: usize| -> [__m512i; TV] { std::array::from_fn(|v| _mm512_loadu_si512(w[v].cast::<u16>().add(j * 2 * PANEL).cast())) };
            let mut start = 0;
            while start < k {
                // A run of K_RUN terms from zero (K_RUN is even: a run starts on a pair).
                let end = (start + super::K_RUN).min(k);
                let mut acc = [[_mm512_setzero_ps(); TV]; TR];
                if BF16 {
                    for j in start / 2..end / 2 {
                        let wv = pair(j);
                        step(&mut acc, &wv.map(|v| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))), 2 * j);
                        step(&mut acc, &wv.map(|v| _mm512_castsi512_ps(_mm512_and_si512(v, high))), 2 * j + 1);
                    }
                    if end % 2 == 1 {
                        let wv = pair(end / 2);
                        step(&mut acc, &wv.map(|v| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))), end - 1);
                    }
                } else {
                    for kk in start..end {
                        step(&mut acc, &std::array::from_fn(|v| _mm512_loadu_ps(w[v].cast::<f32>().add(kk * PANEL))), kk);
                    }
                }
                // The run's sums into the outputs: stored after the first run, added
                // to them after the others.
                for v in 0..TV {
                    let lanes = columns.saturating_sub(v * PANEL).min(PANEL);
                    for r in 0..TR {
                        let at = out.add(r * out_stride + v * PANEL);
                        let sum = if start == 0 { acc[r][v] } else { _mm512_add_ps(load512part(at, lanes), acc[r][v]) };
                        store512(at, lanes, sum);
                    }
                }
                start = end;
            }
        }
    }

    /// Stores the first `lanes` (1..=16) lanes of `v` at `p`.
    ///
    /// # Safety
    /// `p` points to `lanes` writable f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store512(p: *mut f32, lanes: usize, v: __m512) {
        // SAFETY: as the caller promises; masked-off lanes are not written.
        unsafe { _mm512_mask_storeu_ps(p, ((1u32 << lanes) - 1) as __mmask16, v) }
    }

    /// The first `lanes` (1..=16) f32 at `p`, zeros after.
    ///
    /// # Safety
    /// `p` points to `lanes` readable f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load512part(p: *const f32, lanes: usize) -> __m512 {
        // SAFETY: as the caller promises; masked-off lanes are not read.
        unsafe { _mm512_maskz_loadu_ps(((1u32 << lanes) - 1) as __mmask16, p) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    /// Both packings of a `[n, k]` weight of `values`, and the weight as the kernels see it
    /// (bf16 rounded), row-major f32.
    fn weights(n: usize, k: usize, seed: u64) -> (Vec<f32>, Vec<u16>, Vec<f32>, Vec<f32>) {
        let w = values(n * k, seed);
        let bits: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let rounded: Vec<f32> = bits.iter().map(|&b| widen(b)).collect();
        (pack_f32(&w, n, k), pack_bf16(&bits, n, k), w, rounded)
    }

    /// The product in f64 and the sum of |terms|, which bounds any f32 order's rounding.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut scale) = (vec![0f64; m * n], vec![0f64; m * n]);
        for i in 0..m {
            for j in 0..n {
                for t in 0..k {
                    let term = x[i * k + t] as f64 * w[j * k + t] as f64;
                    out[i * n + j] += term;
                    scale[i * n + j] += term.abs();
                }
            }
        }
        (out, scale)
    }

    fn paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.available()).collect()
    }

    /// n off multiples of the panel (16), of a tile's three panels and of a task's six; k odd
    /// (a bf16 pair half empty), tiny and long.
    const SHAPES: [(usize, usize); 8] = [(1, 1), (7, 3), (16, 5), (17, 4), (48, 64), (100, 37), (130, 257), (300, 768)];

    #[test]
    fn products_match_the_reference_on_every_path_this_cpu_has() {
        for isa in paths() {
            for (n, k) in SHAPES {
                let (f32s, bf16s, w, rounded) = weights(n, k, (n * 31 + k) as u64);
                // rows: one, a partial tile, one past a tile (8), past a row block (48)
                for m in [1, 3, 8, 9, 17, 50] {
                    let x = values(m * k, (m * 7 + k) as u64);
                    for (packed, plain) in [(Packed::F32(&f32s), &w), (Packed::Bf16(&bf16s), &rounded)] {
                        let got = matmul(&x, m, k, packed, n, isa);
                        let (want, scale) = reference(&x, plain, m, n, k);
                        for (idx, (&got, (&want, &scale))) in got.iter().zip(want.iter().zip(&scale)).enumerate() {
                            // a serial f32 sum errs by at most about k * 2^-24 of the |terms|
                            let bound = (k as f64 + 2.0) * 6e-8 * scale + 1e-30;
                            assert!(
                                (got as f64 - want).abs() <= bound,
                                "{isa:?} m={m} n={n} k={k} bf16={} at ({}, {}): {got} vs {want}",
                                matches!(packed, Packed::Bf16(_)),
                                idx / n,
                                idx % n
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        // Bit for bit, on every path and packing: rows of a batch of 13 (tiles of 8 and 5) and of
        // 100 (three row blocks) against each row alone.
        let (n, k) = (130, 257);
        let (f32s, bf16s, _, _) = weights(n, k, 9);
        for isa in paths() {
            for packed in [Packed::F32(&f32s), Packed::Bf16(&bf16s)] {
                for m in [13, 100] {
                    let x = values(m * k, 5);
                    let batch = matmul(&x, m, k, packed, n, isa);
                    for i in 0..m {
                        let alone = matmul(&x[i * k..(i + 1) * k], 1, k, packed, n, isa);
                        assert_eq!(alone, batch[i * n..(i + 1) * n], "{isa:?} row {i} of {m}");
                    }
                }
            }
        }
    }

    #[test]
    fn rows_come_back_as_they_were_packed() {
        let (n, k) = (37, 11);
        let (f32s, bf16s, w, rounded) = weights(n, k, 2);
        assert_eq!(unpack_f32(&f32s, k, 0..n), w);
        let bits: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        assert_eq!(unpack_bf16(&bf16s, k, 0..n), bits);
        assert_eq!(Packed::F32(&f32s).rows_f32(k, 5..9), w[5 * k..9 * k]);
        assert_eq!(Packed::Bf16(&bf16s).rows_f32(k, 30..37), rounded[30 * k..37 * k]);
        // the padding columns of the last panel are zeros
        assert_eq!(f32s.len(), packed_len(n, k, false));
        assert!((n..48).all(|row| (0..k).all(|kk| f32s[position(row, kk, k, false)] == 0.0)));
    }
}
