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
//! k (for a bf16 weight, a run's even k, then its odd k), in runs of [`K_RUN`] terms from zero
//! whose sums are added to the element's total in turn, whatever the number of rows, the tile or
//! the thread: a row's result does not depend on its batch, and a prefill's last row equals the
//! same row decoded alone.
//!
//! A bf16 weight's products come in two precisions ([`Products`]). `Exact` multiplies the f32
//! activations by the widened weights, as above: the f32 computation on the bf16 weights. `Bf16`
//! rounds the activations to bf16 first (to nearest even), as torch, vLLM and llama.cpp compute
//! a bf16 model, and on a CPU with avx512_bf16 sums each pair's products with one `vdpbf16ps`
//! (32 products an instruction against a fused multiply-add's 16, the broadcast being a pair of
//! x values): faster where a batch makes the products the bound, and lossy, so only on request.
//! Elsewhere the f32 body multiplies the rounded activations, for the same values.
//!
//! The loader packs dense CPU weights when [`Isa::selected`] has a panel body (AVX-512F);
//! elsewhere they stay row-major for `cpu_matmul`'s tiles. (A 256-bit body, four or six rows
//! against one panel, measured 0.79-1.15x the AVX2 tiles' speed on the same Ice Lake, so AVX2
//! keeps the tiles.) The portable body here is the reference the SIMD body is tested against.

use rayon::prelude::*;

use crate::cpu_matmul::Isa;
use crate::output::Output;

mod greedy;
pub use greedy::{ColumnNorms, argmax_available, argmax_logits};

/// Columns (weight rows) per panel: one AVX-512 vector of f32.
pub const PANEL: usize = 16;
/// Terms an output element sums from zero before adding the run's sum to its total: runs of
/// 64 along k err like the row tiles' sixteen lanes (each a serial sum of k / 16 terms), where
/// one serial sum over k = 1,536 erred by twice as much on SmolLM2's logits (1.1e-4 against
/// transformers, 6.4e-5 before). Even, so that a run starts on a bf16 pair.
const K_RUN: usize = 64;
/// Terms of a run of bf16 pair products ([`Products::Bf16`]): their activations' rounding errs by
/// up to 2^-9 of each term, so the f32 sum of 512 terms (at most about 2^-15 of their magnitudes)
/// adds nothing that matters, and each tile adds its runs' sums an eighth as often as with
/// [`K_RUN`] (a whole 100M step at 16 rows, when the runs' sums went through the outputs: their
/// loads and stores were 8.5% of the step's samples).
const PAIR_RUN: usize = 512;
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

/// How the products of a bf16 weight are computed (an f32 weight's are always `Exact`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Products {
    /// f32 activations times the weights widened to f32 (exactly): the f32 product of the bf16
    /// weights up to the order of additions.
    Exact,
    /// Activations rounded to bf16 (to nearest even), each pair of products summed in f32
    /// (`vdpbf16ps`, whose inputs' and outputs' subnormals are zeros, where the CPU has it).
    /// Faster in a batch, lossy: the rounding errs by up to 2^-9 of each activation.
    Bf16,
}

/// Whether this CPU sums bf16 pair products in one instruction (AVX-512F and avx512_bf16), the
/// path [`Products::Bf16`] is fast on, under the selected instruction set.
pub fn bf16_dot_available() -> bool {
    has_pair_body(Isa::selected())
}

/// Whether path `isa` has the bf16 pair body on this CPU: AVX-512 and avx512_bf16.
fn has_pair_body(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa == Isa::Avx512 && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
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
/// where it has none of its own), in precision `products` for a bf16 weight. Panics if the CPU
/// does not have the path.
pub fn matmul(x: &[f32], m: usize, k: usize, w: Packed, n: usize, isa: Isa, products: Products) -> Vec<f32> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
    let bf16 = matches!(w, Packed::Bf16(_));
    let stored = match w {
        Packed::F32(p) => p.len(),
        Packed::Bf16(p) => p.len(),
    };
    assert_eq!(stored, packed_len(n, k, bf16), "the packed weight is not [{n}, {k}]");
    if k == 0 {
        return vec![0f32; m * n];
    }
    let rounded = bf16 && products == Products::Bf16;
    let pairs = rounded && has_pair_body(isa);
    // Not zeroed first: every tile stores its totals (a 16-row step of the 100M
    // shape zeroed 7 MB of outputs, 1-3% of its time).
    let mut values = Vec::with_capacity(m * n);
    product(Output::uninit(&mut values.spare_capacity_mut()[..m * n], n), x, m, k, w, n, isa, rounded, pairs);
    // SAFETY: the tasks wrote every element: the tiles of `for_each_tile` cover rows 0..m and
    // the columns of every panel, 0..n, and each tile stores its totals (k > 0).
    unsafe { values.set_len(m * n) };
    values
}

/// [`matmul`]'s body into `out` (`[m, n]`, every element written): with the activations
/// `rounded` to bf16, summed in pairs (`pairs`, which needs avx512_bf16 and the AVX-512 path) or
/// by the f32 bodies.
#[allow(clippy::too_many_arguments)]
fn product(out: Output, x: &[f32], m: usize, k: usize, w: Packed, n: usize, isa: Isa, rounded: bool, pairs: bool) {
    let panels = n.div_ceil(PANEL);
    assert!(!pairs || has_pair_body(isa), "bf16 pairs need avx512_bf16 and the AVX-512 path");
    #[cfg(target_arch = "x86_64")]
    if pairs {
        // SAFETY: the CPU has AVX-512F and avx512_bf16 (asserted above).
        let pairs = unsafe { x86::bf16_pairs(x, m, k) };
        for_each_task(panels, |task| {
            // SAFETY: the CPU has AVX-512F and avx512_bf16 (asserted above); the task writes only
            // the columns of its panels; `w` holds `n` columns packed for `k` (asserted above)
            // and `pairs` is x's `m` rows of `k.div_ceil(2)` pairs.
            unsafe { x86::task(out, task, w, n, x86::Rows::Pairs(&pairs), m, k) }
        });
        return;
    }
    // Elsewhere the f32 bodies multiply the rounded activations, for the same products.
    let rounded_x: Vec<f32>;
    let x = if rounded {
        rounded_x = x.iter().map(|&v| widen(half::bf16::from_f32(v).to_bits())).collect();
        &rounded_x
    } else {
        x
    };
    for_each_task(panels, |task| match isa {
        // SAFETY: the CPU has AVX-512F (asserted above); the task writes only the columns of
        // its panels, and `w` holds `n` columns packed for `k` (asserted above).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::task(out, task, w, n, x86::Rows::F32(x), m, k) },
        _ => portable_task(out, task, w, n, x, m, k),
    });
}

/// Runs `f` on the panels of every parallel task, in parallel, each task one job that an idle
/// thread can take.
///
/// Left to itself, rayon splits a range into a few pieces per thread and runs each piece's
/// tasks in one go, so that a thread that ran out of work waited, at the end of every product,
/// on up to a piece of its neighbour's tasks that no one could take from it (a 16-row exact bf16
/// step of the 100M shape: 2.7% of both threads' samples idle during the fused gate/up alone,
/// about 54 µs a product, several tasks' worth). One job per task costs a push onto the deque
/// each. The layers' products of that shape, 2 threads, medians of 28 alternating passes in one
/// process: exact bf16 16 rows 3.4-8.3% less time in four runs, 8 rows 15% (one run), 64 rows
/// 4%, one row the same; f32 16 rows 3-5%. Whole 16-row steps (`eval-shard`, both ways
/// alternating step by step, medians of 100 each): exact bf16 5.5% and 3.4% less time, f32 6.3%
/// (with the attention's tasks split the same way), one row the same.
fn for_each_task(panels: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    (0..panels.div_ceil(TASK_PANELS))
        .into_par_iter()
        .with_max_len(1)
        .for_each(|task| f(task * TASK_PANELS..((task + 1) * TASK_PANELS).min(panels)));
}

/// `[m, k]` activations rounded to bf16 (to nearest even), a row of `k.div_ceil(2)` pairs each:
/// a 32-bit lane with k = 2j in its low half and 2j + 1 (zero past k) in its high half, as the
/// bf16 panels pair their weights. The reference for `x86::bf16_pairs`.
#[cfg_attr(not(test), allow(dead_code))]
fn bf16_pairs(x: &[f32], m: usize, k: usize) -> Vec<u32> {
    let bits = |v: f32| half::bf16::from_f32(v).to_bits() as u32;
    let half_k = k.div_ceil(2);
    let mut pairs = Vec::with_capacity(m * half_k);
    for row in x.chunks_exact(k) {
        pairs.extend((0..half_k).map(|j| bits(row[2 * j]) | row.get(2 * j + 1).map_or(0, |&v| bits(v) << 16)));
    }
    pairs
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

/// The order in which a run `start..end` adds its terms: k's order for f32 weights; for bf16
/// ones (pairs), the run's even k, then its odd k, so that the SIMD body widens one half of its
/// pairs at a time.
fn run_order(start: usize, end: usize, bf16: bool) -> impl Iterator<Item = usize> {
    let step = if bf16 { 2 } else { 1 };
    (start..end).step_by(step).chain((start + 1..if bf16 { end } else { start }).step_by(2))
}

/// The portable body: each element's additions in the SIMD body's order (runs of [`K_RUN`] from
/// zero in [`run_order`], added to the total in turn), one multiply and one add per term (not
/// fused, so its last bits may differ from the SIMD body's), a row and a panel at a time.
fn portable_task(out: Output, panels: std::ops::Range<usize>, w: Packed, n: usize, x: &[f32], m: usize, k: usize) {
    let weight = |column: usize, kk: usize| match w {
        Packed::F32(p) => p[position(column, kk, k, false)],
        Packed::Bf16(p) => widen(p[position(column, kk, k, true)]),
    };
    for_each_tile(panels, n, m, 1, 1, |_, columns, i, first| {
        let mut total = [0f32; PANEL];
        for run in (0..k).step_by(K_RUN) {
            let mut acc = [0f32; PANEL];
            for kk in run_order(run, (run + K_RUN).min(k), matches!(w, Packed::Bf16(_))) {
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
    /// Most panels per tile: `R * V` = 24 accumulators, `V` weight vectors, `V` widened ones, a
    /// broadcast and bf16's mask, the 32 registers (exact bf16 takes fewer:
    /// `Form::panels_per_tile`).
    const V: usize = 3;

    /// A task's x rows: f32, or rounded to bf16 in pairs (`super::bf16_pairs`).
    #[derive(Clone, Copy)]
    pub(super) enum Rows<'a> {
        F32(&'a [f32]),
        Pairs(&'a [u32]),
    }

    /// The products a tile body computes: f32 panels, bf16 panels widened, or bf16 panels
    /// against bf16 pairs (`vdpbf16ps`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Form {
        F32,
        Bf16,
        Bf16Pairs,
    }

    impl Form {
        /// Panels a tile takes against `m` x rows; which panels a tile takes changes no
        /// element's additions. [`V`] for f32, and for bf16 pairs past [`R`] rows.
        ///
        /// One for a bf16 weight against a few rows: three bf16 panels side by side (three
        /// streams 24 KiB apart at k = 768) were read from memory at 33-38 GB/s where one panel
        /// after another (one stream) read 41-50, with f32 panels at 45-50 either way. Zen 5, 2
        /// threads, [4096x768] streamed from memory, GB/s of weights, medians of alternating
        /// runs, three panels against one: exact bf16 at 1 row 37.1 -> 48.9, 2 rows 35.9 ->
        /// 41.9, 4 rows 36.0 -> 38.0, 8 rows 33.0 -> 32.1; bf16 pairs at 1, 2, 4 and 8 rows
        /// 37-40 -> 44-47. [768x2048] and [32000x768] at 1 row: 35 -> 37-41 and 37 -> 41-50.
        ///
        /// Two for exact bf16 against more rows: three need all 32 registers (24 accumulators,
        /// three loaded and three widened vectors, the broadcast and the mask), two leave ten
        /// free. A whole step of the 100M shape, alternating, three panels against two: 6 rows
        /// 6.6-8.1 -> 5.7-5.8 ms, 8 rows 6.8-7.2 -> 5.7-5.9, 16 rows 10.6-11.1 -> 9.6-10.3, 32
        /// rows 20.2-20.8 -> 17.6-18.0, 64 rows 39.1-44.3 -> 35.2-36.1; prefill of 512 rows
        /// 221-222 -> 199-207, 2,048 rows 1,034-1,047 -> 933-947. f32 panels against two: the
        /// same within noise (16 rows 13.4-14.4 -> 13.1-13.6 ms, 32 and 64 rows the same).
        fn panels_per_tile(self, m: usize) -> usize {
            match self {
                Form::Bf16 if m <= 4 => 1,
                Form::Bf16 => 2,
                Form::Bf16Pairs if m <= R => 1,
                _ => V,
            }
        }
    }

    /// One task's panels against every x row.
    ///
    /// # Safety
    /// The CPU has AVX-512F, and avx512_bf16 for `Rows::Pairs` (which only goes with a bf16
    /// weight); `w` is a packed `[n, k]` weight; `x` holds `m` rows (of `k` f32, or of
    /// `k.div_ceil(2)` pairs); `out` is `[m, n]`, and no other task writes the columns of
    /// `panels`.
    pub(super) unsafe fn task(out: Output, panels: std::ops::Range<usize>, w: Packed, n: usize, x: Rows, m: usize, k: usize) {
        let (bf16, base, elem) = match w {
            Packed::F32(p) => (false, p.as_ptr().cast::<u8>(), 4),
            Packed::Bf16(p) => (true, p.as_ptr().cast::<u8>(), 2),
        };
        let (form, x_base, row_elems) = match x {
            Rows::F32(x) => (if bf16 { Form::Bf16 } else { Form::F32 }, x.as_ptr().cast::<u8>(), k),
            Rows::Pairs(x) => (Form::Bf16Pairs, x.as_ptr().cast::<u8>(), k.div_ceil(2)),
        };
        debug_assert!(bf16 || form == Form::F32, "bf16 pairs against an f32 weight");
        let panel_bytes = panel_len(k, bf16) * elem;
        let all_panels = n.div_ceil(PANEL);
        let group = form.panels_per_tile(m);
        for_each_tile(panels, n, m, group, R, |rows, columns, i, first| {
            let used = columns.div_ceil(PANEL);
            // A tile of fewer panels points the unused ones at its last (never read).
            let ptrs: [*const u8; V] = std::array::from_fn(|v| base.wrapping_add((first / PANEL + v.min(used - 1)) * panel_bytes));
            // A bf16 weight's last tile of rows over these panels asks for the next tile's panels
            // (this task's next group, or the next task's first, most often this thread's too):
            // widening its pairs, the tile issued its loads too slowly for the hardware
            // prefetchers to keep enough lines in flight, and a batch's later tiles, which find
            // the panels in cache, left the memory idle. Zen 5, 2 threads, 100M Qwen3 shape,
            // exact bf16, ms a step, alternating runs: 9.6-11.2 -> 7.1-9.6 at eight rows,
            // 15.6-16.7 -> 13.1-14.0 at sixteen, 5.7-7.4 -> 5.5-6.9 at one. f32 panels, whose
            // loads come twice as fast, measured no better (and at one row a little worse).
            let last_rows = (i + rows) % super::ROW_BLOCK == 0 || i + rows == m;
            let next_first = first / PANEL + used;
            let next: [*const u8; V] = std::array::from_fn(|v| base.wrapping_add((next_first + v) * panel_bytes));
            let next = if bf16 && last_rows { &next[..group.min(all_panels.saturating_sub(next_first))] } else { &next[..0] };
            // Rows of f32 and of u32 pairs have the same 4-byte elements.
            let x_rows = x_base.wrapping_add(i * row_elems * 4);
            // SAFETY: the panels hold `columns` columns packed for k, from column `first`; x
            // rows i..i + rows exist; the tile writes rows i.. and columns first..first +
            // columns of `out`, which are this task's; the CPU has the form's features (this
            // function's contract).
            unsafe { tile(form, rows, used, &ptrs, next, x_rows, k, out.at(first, i, 0), n, columns) }
        });
    }

    /// [`super::bf16_pairs`] with `vcvtneps2bf16`, sixteen activations an instruction: the same
    /// rounding (to nearest even), except that subnormals become zeros of their sign, as
    /// `vdpbf16ps` would read them anyway, so the products are the same. Pairs are bf16 values in
    /// the order of k, two to a 32-bit lane, which is what the conversion stores.
    ///
    /// # Safety
    /// The CPU has AVX-512F and avx512_bf16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_pairs(x: &[f32], m: usize, k: usize) -> Vec<u32> {
        assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
        let half_k = k.div_ceil(2);
        let mut pairs = vec![0u32; m * half_k];
        for (row, out) in x.chunks_exact(k.max(1)).zip(pairs.chunks_exact_mut(half_k.max(1))) {
            let mut chunks = row.chunks_exact(PANEL);
            for (i, chunk) in chunks.by_ref().enumerate() {
                // SAFETY: `chunk` holds 16 f32 and out[8 * i..8 * i + 8] is inside the row's
                // `half_k` pairs (16 * (i + 1) <= k); the CPU has the features (this function's
                // contract).
                unsafe {
                    let bits = _mm512_cvtneps_pbh(_mm512_loadu_ps(chunk.as_ptr()));
                    _mm256_storeu_si256(out.as_mut_ptr().add(8 * i).cast(), std::mem::transmute::<__m256bh, __m256i>(bits));
                }
            }
            let tail = chunks.remainder();
            if !tail.is_empty() {
                let mut padded = [0f32; PANEL];
                padded[..tail.len()].copy_from_slice(tail);
                // SAFETY: `padded` holds 16 f32; `__m256bh` is 32 bytes of bf16 lanes, any bits
                // valid as [u32; 8].
                let bits: [u32; 8] = unsafe { std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(padded.as_ptr()))) };
                let done = (row.len() - tail.len()) / 2;
                out[done..].copy_from_slice(&bits[..half_k - done]);
            }
        }
        pairs
    }

    /// Picks the monomorphised tile body for (form, rows, panels).
    ///
    /// # Safety
    /// As [`tile_body`] (f32 rows for `Form::F32` and `Form::Bf16`) and [`tile_pairs_body`]
    /// (pair rows for `Form::Bf16Pairs`); `1 <= rows <= R`, `1 <= used <= V`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile(form: Form, rows: usize, used: usize, w: &[*const u8], next: &[*const u8], x: *const u8, k: usize, out: *mut f32, out_stride: usize, columns: usize) {
        let (xf, xp) = (x.cast::<f32>(), x.cast::<u32>());
        macro_rules! pick {
            ($($r:literal)*) => {
                match (form, rows, used) {
                    $(
                        (Form::Bf16Pairs, $r, 3) => tile_pairs_body::<$r, 3>(w, next, xp, k, out, out_stride, columns),
                        (Form::Bf16Pairs, $r, 2) => tile_pairs_body::<$r, 2>(w, next, xp, k, out, out_stride, columns),
                        (Form::Bf16Pairs, $r, 1) => tile_pairs_body::<$r, 1>(w, next, xp, k, out, out_stride, columns),
                        (Form::Bf16, $r, 3) => tile_body::<true, $r, 3>(w, next, xf, k, out, out_stride, columns),
                        (Form::Bf16, $r, 2) => tile_body::<true, $r, 2>(w, next, xf, k, out, out_stride, columns),
                        (Form::Bf16, $r, 1) => tile_body::<true, $r, 1>(w, next, xf, k, out, out_stride, columns),
                        (Form::F32, $r, 3) => tile_body::<false, $r, 3>(w, next, xf, k, out, out_stride, columns),
                        (Form::F32, $r, 2) => tile_body::<false, $r, 2>(w, next, xf, k, out, out_stride, columns),
                        (Form::F32, $r, 1) => tile_body::<false, $r, 1>(w, next, xf, k, out, out_stride, columns),
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
    /// of which the first `columns <= TV * PANEL` are writable. `next` (bf16 only): panels to
    /// ask into L2 pair by pair as the tile goes (see `task`), or none.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_body<const BF16: bool, const TR: usize, const TV: usize>(
        w: &[*const u8],
        next: &[*const u8],
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
            let mut totals = [[_mm512_setzero_ps(); TV]; TR];
            let mut start = 0;
            while start < k {
                // A run of K_RUN terms from zero (K_RUN is even: a run starts on a pair).
                let end = (start + super::K_RUN).min(k);
                let mut acc = [[_mm512_setzero_ps(); TV]; TR];
                if BF16 {
                    // The run's even terms, then its odd ones (see `run_order`): one widened
                    // half of the pairs live at a time, where both halves and their sixteen
                    // broadcasts spilled registers (eight rows, Zen 4: 0.74x the speed).
                    for j in start / 2..end.div_ceil(2) {
                        prefetch_pair_lines(next, j);
                        step(&mut acc, &pair(j).map(|v| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))), 2 * j);
                    }
                    for j in start / 2..end / 2 {
                        step(&mut acc, &pair(j).map(|v| _mm512_castsi512_ps(_mm512_and_si512(v, high))), 2 * j + 1);
                    }
                } else {
                    for kk in start..end {
                        step(&mut acc, &std::array::from_fn(|v| _mm512_loadu_ps(w[v].cast::<f32>().add(kk * PANEL))), kk);
                    }
                }
                add_run(&acc, start == 0, &mut totals);
                start = end;
            }
            store_totals(&totals, out, out_stride, columns);
        }
    }

    /// `TR` rows of bf16 pairs (stride `k.div_ceil(2)`) against the bf16 panels `w[..TV]`, into
    /// `out` as [`tile_body`]: at every pair j, each row's pair is broadcast and `vdpbf16ps`
    /// adds both of its products into `TV` accumulators, in runs of [`super::PAIR_RUN`] terms.
    ///
    /// # Safety
    /// The CPU has AVX-512F and avx512_bf16; `w[v]`, v < TV, points to a bf16 panel packed for
    /// `k`; `x` to `TR` rows of `k.div_ceil(2)` pairs; `out` and `next` as for [`tile_body`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile_pairs_body<const TR: usize, const TV: usize>(
        w: &[*const u8],
        next: &[*const u8],
        x: *const u32,
        k: usize,
        out: *mut f32,
        out_stride: usize,
        columns: usize,
    ) {
        let half_k = k.div_ceil(2);
        // SAFETY: every load below is inside a panel (pair j < k.div_ceil(2)) or a pair row
        // (j < half_k), and `store_totals` stores inside the first `columns` columns of the out
        // rows, as the caller promises. `__m512i` and `__m512bh` are both 64 bytes of lanes
        // with no invalid bit patterns, so transmuting one into the other only renames them.
        unsafe {
            let w: [*const u16; TV] = std::array::from_fn(|v| w[v].cast::<u16>());
            let mut totals = [[_mm512_setzero_ps(); TV]; TR];
            let mut start = 0;
            while start < half_k {
                let end = (start + super::PAIR_RUN / 2).min(half_k);
                let mut acc = [[_mm512_setzero_ps(); TV]; TR];
                for j in start..end {
                    prefetch_pair_lines(next, j);
                    let wv: [__m512bh; TV] = std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(w[v].add(j * 2 * PANEL).cast())));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(r * half_k + j) as i32));
                        for v in 0..TV {
                            acc[v] = _mm512_dpbf16_ps(acc[v], wv[v], b);
                        }
                    }
                }
                add_run(&acc, start == 0, &mut totals);
                start = end;
            }
            store_totals(&totals, out, out_stride, columns);
        }
    }

    /// Asks for the cache line of pair j (its 16 columns' 64 bytes) of each bf16 panel of
    /// `panels` to be brought into L2. A prefetch never faults; `panels` are a packed weight's.
    #[inline(always)]
    fn prefetch_pair_lines(panels: &[*const u8], j: usize) {
        for p in panels {
            // SAFETY: a prefetch reads nothing and cannot fault, and SSE is part of x86-64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(j * 2 * PANEL * 2).cast()) };
        }
    }

    /// A run's sums into the tile's totals: the first run's taken as they are, the others'
    /// added. The totals stay in the tile (registers or its stack) and reach the outputs once,
    /// at its end: kept in the outputs, every run loaded and stored each row's sums there, and
    /// rows a multiple of 4 KiB apart (a [.., 4096] output, 16 KiB) made those loads wait on
    /// the stores of the rows before them (the same low address bits).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn add_run<const TR: usize, const TV: usize>(acc: &[[__m512; TV]; TR], first: bool, totals: &mut [[__m512; TV]; TR]) {
        for (totals, acc) in totals.iter_mut().zip(acc) {
            for (total, &acc) in totals.iter_mut().zip(acc) {
                *total = if first { acc } else { _mm512_add_ps(*total, acc) };
            }
        }
    }

    /// The tile's totals into its outputs.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `out` points to `TR` rows of `out_stride` f32 of which the first
    /// `columns <= TV * PANEL` are writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_totals<const TR: usize, const TV: usize>(totals: &[[__m512; TV]; TR], out: *mut f32, out_stride: usize, columns: usize) {
        for v in 0..TV {
            let lanes = columns.saturating_sub(v * PANEL).min(PANEL);
            for (r, totals) in totals.iter().enumerate() {
                // SAFETY: row r < TR, lanes v * PANEL.. within `columns`, as the caller promises.
                unsafe { store512(out.add(r * out_stride + v * PANEL), lanes, totals[v]) };
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

    /// `x` as [`Products::Bf16`] multiplies it: each value rounded to bf16, to nearest even.
    fn rounded(x: &[f32]) -> Vec<f32> {
        x.iter().map(|&v| widen(half::bf16::from_f32(v).to_bits())).collect()
    }

    /// Asserts `got` is within an f32 sum's rounding of the product of `x` and `w`.
    fn assert_near_reference(got: &[f32], x: &[f32], w: &[f32], (m, n, k): (usize, usize, usize), at: &str) {
        let (want, scale) = reference(x, w, m, n, k);
        for (idx, (&got, (&want, &scale))) in got.iter().zip(want.iter().zip(&scale)).enumerate() {
            // a serial f32 sum errs by at most about k * 2^-24 of the |terms|
            let bound = (k as f64 + 2.0) * 6e-8 * scale + 1e-30;
            assert!((got as f64 - want).abs() <= bound, "{at} m={m} n={n} k={k} at ({}, {}): {got} vs {want}", idx / n, idx % n);
        }
    }

    #[test]
    fn products_match_the_reference_on_every_path_this_cpu_has() {
        for isa in paths() {
            for (n, k) in SHAPES {
                let (f32s, bf16s, w, rounded_w) = weights(n, k, (n * 31 + k) as u64);
                // rows: one, a partial tile, one past a tile (8), past a row block (48)
                for m in [1, 3, 8, 9, 17, 50] {
                    let x = values(m * k, (m * 7 + k) as u64);
                    let shape = (m, n, k);
                    let got = matmul(&x, m, k, Packed::F32(&f32s), n, isa, Products::Exact);
                    assert_near_reference(&got, &x, &w, shape, &format!("{isa:?} f32"));
                    // an f32 weight's products are exact whatever is asked
                    assert_eq!(matmul(&x, m, k, Packed::F32(&f32s), n, isa, Products::Bf16), got);
                    let got = matmul(&x, m, k, Packed::Bf16(&bf16s), n, isa, Products::Exact);
                    assert_near_reference(&got, &x, &rounded_w, shape, &format!("{isa:?} bf16"));
                    let got = matmul(&x, m, k, Packed::Bf16(&bf16s), n, isa, Products::Bf16);
                    assert_near_reference(&got, &rounded(&x), &rounded_w, shape, &format!("{isa:?} bf16 products"));
                }
            }
        }
    }

    #[test]
    fn bf16_products_without_the_pair_instruction_match_the_reference() {
        // The AVX-512 body on rounded activations, which a CPU without avx512_bf16 runs for
        // Products::Bf16 (this one may have the instruction, so ask for the fallback directly).
        if !Isa::Avx512.available() {
            return;
        }
        for (n, k) in SHAPES {
            let (_, bf16s, _, rounded_w) = weights(n, k, 3);
            for m in [1, 9, 50] {
                let x = values(m * k, m as u64);
                let mut got = vec![0f32; m * n];
                product(Output::new(&mut got, n), &x, m, k, Packed::Bf16(&bf16s), n, Isa::Avx512, true, false);
                assert_near_reference(&got, &rounded(&x), &rounded_w, (m, n, k), "Avx512 bf16 products, f32 body");
            }
        }
    }

    #[test]
    fn bf16_products_err_from_the_exact_ones_by_the_activations_rounding() {
        // Rounding an activation to bf16 moves it by at most 2^-9 of itself, so a product moves
        // by at most 2^-9 of the sum of |terms| (and the sums' own rounding, far below).
        let (n, k) = (130, 768);
        let (_, bf16s, _, rounded_w) = weights(n, k, 4);
        let m = 9;
        let x = values(m * k, 8);
        let (_, scale) = reference(&x, &rounded_w, m, n, k);
        for isa in paths() {
            let exact = matmul(&x, m, k, Packed::Bf16(&bf16s), n, isa, Products::Exact);
            let fast = matmul(&x, m, k, Packed::Bf16(&bf16s), n, isa, Products::Bf16);
            let mut largest = 0f64;
            for ((&e, &f), &s) in exact.iter().zip(&fast).zip(&scale) {
                assert!(((e - f) as f64).abs() <= s / 512.0 + 1e-6 * s, "{isa:?}: {f} vs exact {e}");
                largest = largest.max(((e - f) as f64).abs() / s);
            }
            // and the rounding does show: these are not the exact products
            assert!(largest > 1e-6, "{isa:?}: bf16 products equal the exact ones");
        }
    }

    #[test]
    fn the_converted_pairs_are_the_reference_pairs() {
        // vcvtneps2bf16 against half's rounding: same bits but for subnormals, which become
        // zeros of their sign (vdpbf16ps reads them as zeros either way). Odd k and k past a
        // 16-value chunk cover the tail; ties, overflow to infinity, NaN and signed zero the
        // rounding.
        if !bf16_dot_available() {
            return;
        }
        let specials = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::MAX, -0.0, f32::INFINITY, f32::NAN, 1e-40, -1e-40];
        for (m, k) in [(1, 1), (3, 7), (2, 16), (5, 37), (4, 768)] {
            let mut x = values(m * k, k as u64);
            for (v, s) in x.iter_mut().zip(specials) {
                *v = s;
            }
            // SAFETY: the CPU has AVX-512F and avx512_bf16 (checked above).
            let got = unsafe { x86::bf16_pairs(&x, m, k) };
            let flushed: Vec<f32> = x.iter().map(|&v| if v != 0.0 && v.abs() < f32::MIN_POSITIVE { 0.0f32.copysign(v) } else { v }).collect();
            let want = bf16_pairs(&flushed, m, k);
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                // NaNs may differ in payload: compare those halves as "is a NaN"
                for shift in [0, 16] {
                    let (g, w) = (((g >> shift) & 0xFFFF) as u16, ((w >> shift) & 0xFFFF) as u16);
                    let nan = |b: u16| widen(b).is_nan();
                    assert!(g == w || (nan(g) && nan(w)), "m={m} k={k} pair {j} half {shift}: {g:#06x} vs {w:#06x}");
                }
            }
        }
    }

    #[test]
    fn a_bf16_run_adds_its_even_terms_then_its_odd_ones() {
        assert_eq!(run_order(0, 5, false).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        assert_eq!(run_order(64, 69, true).collect::<Vec<_>>(), [64, 66, 68, 65, 67]);
        assert_eq!(run_order(0, 4, true).collect::<Vec<_>>(), [0, 2, 1, 3]);
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        // Bit for bit, on every path, packing and precision: rows of a batch of 3 (bf16 tiles of
        // one panel), 13 (tiles of 8 and 5 rows; exact bf16 two panels a tile) and 100 (three
        // row blocks) against each row alone (bf16: one panel a tile).
        let (n, k) = (130, 257);
        let (f32s, bf16s, _, _) = weights(n, k, 9);
        for isa in paths() {
            for (packed, products) in [(Packed::F32(&f32s), Products::Exact), (Packed::Bf16(&bf16s), Products::Exact), (Packed::Bf16(&bf16s), Products::Bf16)] {
                for m in [3, 13, 100] {
                    let x = values(m * k, 5);
                    let batch = matmul(&x, m, k, packed, n, isa, products);
                    for i in 0..m {
                        let alone = matmul(&x[i * k..(i + 1) * k], 1, k, packed, n, isa, products);
                        assert_eq!(alone, batch[i * n..(i + 1) * n], "{isa:?} {products:?} row {i} of {m}");
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
