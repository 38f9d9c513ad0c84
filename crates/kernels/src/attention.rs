//! One query row's attention over the history it may see, read in place from the paged KV
//! cache's blocks: the attention of a decode step on a CPU ([`attend_one`]), and of a prompt's
//! rows, a tile at a time ([`attend_rows`]: the same bits, each chunk of keys scored for every
//! query vector of the tile while it is in L1).
//!
//! A block holds `block_size` positions of every KV head: keys transposed, `[kv_heads, head_dim,
//! block_size]`, so that one query element scales a contiguous run of positions, and values as
//! `[kv_heads, block_size, head_dim]`, one row per position. The scores of a block are then a
//! `[1, head_dim] x [head_dim, block_size]` product and the output a sum of value rows, both
//! written here over fixed-width chunks that the compiler keeps in vector registers.
//!
//! The same Rust body is compiled once per instruction set ([`Isa`], chosen in one place): the
//! portable build (SSE2 on x86-64) and AVX2 or AVX-512F builds of it. Every score is the sum over
//! `d` in order of `q[d] * k[d]`, and every output element the sum over positions in order of
//! `p * v`, each product rounded before its addition (no fused multiply-add), so every path
//! returns the same bits. The query heads that share a KV head take turns over runs of
//! positions, so that a long history is read from memory once per KV head, not once per query
//! head (4 sequences of 2,048 positions, 12 layers, in one process: 14.1 against 16.5 ms), and
//! their outputs are summed together, up to four heads per read of a value row. The softmax's
//! maximum and sum run in eight lanes in a fixed order (one scalar chain was a tenth of the
//! kernel's time at 2,048 positions).

use rayon::prelude::*;

use crate::activation::exp_in_place;
use crate::cpu_matmul::Isa;

/// An element type of the cache's blocks: f32, or f16 (`--kv-cache-dtype f16`: half the bytes
/// of a position, rounded to nearest on writing). Read widened to f32, exactly; the arithmetic
/// is f32 either way.
pub trait KvElement: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;

    /// `N` consecutive elements widened; `F16C` in the builds for CPUs with F16C (the AVX2 and
    /// AVX-512 phases), where f16 takes one `vcvtph2ps` per eight.
    #[inline(always)]
    fn widen_run<const F16C: bool, const N: usize>(run: &[Self; N]) -> [f32; N] {
        std::array::from_fn(|l| run[l].widen())
    }
}

impl KvElement for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvElement for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f16_to_f32(self.to_bits())
    }

    #[inline(always)]
    fn widen_run<const F16C: bool, const N: usize>(run: &[Self; N]) -> [f32; N] {
        #[cfg(target_arch = "x86_64")]
        if F16C && N.is_multiple_of(8) {
            use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
            let mut out = [0f32; N];
            for e in (0..N).step_by(8) {
                // SAFETY: F16C is set only in the phases compiled with F16C enabled, which run
                // only where attend_one_with found the CPU has it; the loads read eight f16 of
                // `run` (e + 8 <= N) and the stores write eight f32 of `out`.
                unsafe {
                    let half = _mm_loadu_si128(run.as_ptr().add(e).cast());
                    _mm256_storeu_ps(out.as_mut_ptr().add(e), _mm256_cvtph_ps(half));
                }
            }
            return out;
        }
        std::array::from_fn(|l| run[l].widen())
    }
}

/// An f16's bits widened to the f32 of the same value, in integer and f32 operations that the
/// compiler can vectorize (the portable build's widening; the SIMD builds use `vcvtph2ps`).
/// The exponent and mantissa move to f32's places, and a multiply by 2^112 moves the exponent
/// bias from 15 to 127, which also turns an f16 subnormal into the f32 normal of its value;
/// infinities and NaNs take f32's all-ones exponent instead.
#[inline(always)]
fn f16_to_f32(bits: u16) -> f32 {
    const TWO_POW_112: u32 = (112 + 127) << 23;
    let bits = bits as u32;
    let magnitude = (bits & 0x7fff) << 13;
    let finite = f32::from_bits(magnitude) * f32::from_bits(TWO_POW_112);
    let value = if bits & 0x7c00 == 0x7c00 { f32::from_bits(magnitude | 0x7f80_0000) } else { finite };
    f32::from_bits(value.to_bits() | (bits & 0x8000) << 16)
}

/// One cache block of a sequence's history.
pub struct HostBlock<'a, T = f32> {
    /// [kv_heads, head_dim, block_size], row-major
    pub keys_t: &'a [T],
    /// [kv_heads, block_size, head_dim], row-major
    pub values: &'a [T],
    /// how many of the block's positions belong to the history (all but in the last block)
    pub positions: usize,
}

/// Positions whose scores one chunk computes (a block of the default 16 positions is one chunk).
const SCORE_CHUNK: usize = 16;
/// Query heads whose outputs one pass over the values accumulates: each value row is read once
/// for up to this many heads of a group.
const HEADS_PER_PASS: usize = 4;

/// The attention of one token against `history`, for the query heads of KV head `kv`: q is
/// `[q_heads * head_dim]` (query head h uses KV head `h / (q_heads / kv_heads)`); returns
/// `[q_heads / kv_heads * head_dim]`, those heads' outputs in order. No mask: every position of
/// the history is visible.
pub fn attend_one<T: KvElement>(q: &[f32], history: &[HostBlock<'_, T>], kv_heads: usize, head_dim: usize, kv: usize, spread: Spread) -> Vec<f32> {
    attend_one_with(q, history, kv_heads, head_dim, kv, Isa::selected(), spread)
}

/// Whether one call of [`attend_one`] spreads the passes of a long history over the pool's
/// threads: for a caller with fewer (sequence, KV head) tasks than it has threads to keep busy,
/// such as a decode step at batch 1. The result is the same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    Serial,
    Threads,
}

/// [`attend_one`] on a given path. Panics if the CPU does not have it.
pub fn attend_one_with<T: KvElement>(q: &[f32], history: &[HostBlock<'_, T>], kv_heads: usize, head_dim: usize, kv: usize, isa: Isa, spread: Spread) -> Vec<f32> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    assert!(head_dim > 0 && kv < kv_heads && q.len().is_multiple_of(head_dim * kv_heads), "q is not [q_heads * {head_dim}] for {kv_heads} KV heads");
    attend(q, history, kv_heads, head_dim, kv, phases_isa(isa), spread)
}

/// The path the phases run on for `isa`: the SIMD phases are built with F16C too (for f16
/// caches), which every CPU with AVX2 has; without it, the portable one.
fn phases_isa(isa: Isa) -> Isa {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable && !std::is_x86_feature_detected!("f16c") {
        return Isa::Portable;
    }
    isa
}

/// Runs one phase of [`attend`] (`pass_scores` or `pass_values`) in its build for
/// `isa`, which [`attend_one_with`] asserted the CPU has.
macro_rules! dispatch {
    ($isa:expr, $phase:ident($($arg:expr),* $(,)?)) => {
        match $isa {
            // SAFETY (both arms): the CPU has the path, asserted by attend_one_with.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::avx2::$phase($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::avx512::$phase($($arg),*) },
            _ => $phase::<_, false>($($arg),*),
        }
    };
}

/// The phases of [`attend`], compiled once per instruction set.
#[cfg(target_arch = "x86_64")]
mod x86 {
    macro_rules! phases {
        ($isa:ident, $features:literal) => {
            pub mod $isa {
                use crate::attention::{HostBlock, Isa, KvElement};

                /// # Safety
                /// The CPU has the features enabled here.
                #[target_feature(enable = $features)]
                #[allow(clippy::too_many_arguments)]
                pub unsafe fn pass_scores<T: KvElement>(
                    group_q: &[f32],
                    blocks: &[HostBlock<'_, T>],
                    positions: usize,
                    kv_heads: usize,
                    head_dim: usize,
                    kv: usize,
                    values_early: bool,
                    isa: Isa,
                ) -> Vec<f32> {
                    crate::attention::pass_scores::<T, true>(group_q, blocks, positions, kv_heads, head_dim, kv, values_early, isa)
                }

                /// # Safety
                /// The CPU has the features enabled here.
                #[target_feature(enable = $features)]
                pub unsafe fn tile_scores<T: KvElement>(
                    queries: &[&[f32]],
                    history: &[HostBlock<'_, T>],
                    kv_heads: usize,
                    head_dim: usize,
                    kv: usize,
                ) -> Vec<f32> {
                    crate::attention::tile_scores::<T, true>(queries, history, kv_heads, head_dim, kv)
                }

                /// # Safety
                /// The CPU has the features enabled here.
                #[target_feature(enable = $features)]
                pub unsafe fn softmax(probs: &mut [f32], scale: f32, isa: Isa) {
                    crate::attention::softmax(probs, scale, isa)
                }

                /// # Safety
                /// The CPU has the features enabled here.
                #[target_feature(enable = $features)]
                #[allow(clippy::too_many_arguments)]
                pub unsafe fn pass_values<T: KvElement>(
                    probs: &[f32],
                    total: usize,
                    run: std::ops::Range<usize>,
                    blocks: &[HostBlock<'_, T>],
                    kv_heads: usize,
                    head_dim: usize,
                    kv: usize,
                    isa: Isa,
                ) -> Vec<f32> {
                    crate::attention::pass_values::<T, true>(probs, total, run, blocks, kv_heads, head_dim, kv, isa)
                }
            }
        };
    }

    phases!(avx2, "avx2,fma,f16c");
    phases!(avx512, "avx512f,f16c");
}

/// The attention of `rows` consecutive query rows of one sequence (a prompt's), for the query
/// heads of KV head `kv`: `q_rows` is `[rows, q_heads * head_dim]`; row r sees the first
/// `first + r` positions of `history`, which holds at least `first + rows - 1`. Returns
/// `[rows, q_heads / kv_heads * head_dim]`, the same bits as [`attend_one`] row by row: the
/// scores are the same sums, computed for every query vector of the rows (each row's heads of
/// the group) against each chunk of keys while it is in L1, where row by row each row read its
/// whole history's keys from L2 or beyond; the softmax and the value passes are each row's own.
pub fn attend_rows<T: KvElement>(q_rows: &[f32], rows: usize, history: &[HostBlock<'_, T>], first: usize, kv_heads: usize, head_dim: usize, kv: usize) -> Vec<f32> {
    attend_rows_with(q_rows, rows, history, first, kv_heads, head_dim, kv, Isa::selected())
}

/// [`attend_rows`] on a given path. Panics if the CPU does not have it.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows_with<T: KvElement>(
    q_rows: &[f32],
    rows: usize,
    history: &[HostBlock<'_, T>],
    first: usize,
    kv_heads: usize,
    head_dim: usize,
    kv: usize,
    isa: Isa,
) -> Vec<f32> {
    assert!(isa.available(), "this CPU has no {isa:?} path");
    assert!(rows > 0 && first > 0 && q_rows.len().is_multiple_of(rows), "q_rows is not [{rows}, width] for rows seeing {first} positions on");
    let width = q_rows.len() / rows;
    assert!(head_dim > 0 && kv < kv_heads && width.is_multiple_of(head_dim * kv_heads), "a row is not [q_heads * {head_dim}] for {kv_heads} KV heads");
    let last = first + rows - 1;
    let history = visible_prefix(history, last);
    assert_eq!(history.iter().map(|b| b.positions).sum::<usize>(), last, "the history does not hold the last row's {last} positions");
    let isa = phases_isa(isa);
    let group = width / head_dim / kv_heads;
    // every row's query vectors of the group, row by row: [rows * group][head_dim]
    let queries: Vec<&[f32]> =
        q_rows.chunks_exact(width).flat_map(|q| q[kv * group * head_dim..(kv + 1) * group * head_dim].chunks_exact(head_dim)).collect();
    let scores = dispatch!(isa, tile_scores(&queries, &history, kv_heads, head_dim, kv)); // [rows * group, last]
    let mut out = Vec::with_capacity(rows * group * head_dim);
    for r in 0..rows {
        let total = first + r;
        let mut probs = vec![0f32; group * total]; // [group, total]
        for (g, probs) in probs.chunks_exact_mut(total).enumerate() {
            probs.copy_from_slice(&scores[(r * group + g) * last..(r * group + g) * last + total]);
        }
        let visible = visible_prefix(&history, total);
        out.extend(weigh_values(probs, total, &visible, &passes(&visible), kv_heads, head_dim, kv, isa, Spread::Serial));
    }
    out
}

/// The first `positions` positions of `history` (causal attention: what one query row sees).
pub fn visible_prefix<'a, T>(history: &[HostBlock<'a, T>], positions: usize) -> Vec<HostBlock<'a, T>> {
    let mut visible = Vec::with_capacity(history.len());
    let mut left = positions;
    for block in history {
        if left == 0 {
            break;
        }
        let taken = block.positions.min(left);
        visible.push(HostBlock { positions: taken, ..*block });
        left -= taken;
    }
    visible
}

/// Positions each query head of a KV head reads before the next head reads the same ones: their
/// keys, then their values (256 x head_dim 128 x 4 bytes = 128 KiB), stay in L2 for the whole
/// group, so a long history comes from memory once per KV head rather than once per query head.
/// A pass is also the unit of work the threads share (see [`attend`]).
const POSITIONS_PER_PASS: usize = 256;

/// Whole blocks of a history, about [`POSITIONS_PER_PASS`] positions (at least one block).
struct Pass {
    blocks: std::ops::Range<usize>,
    /// the pass's first position in the history
    at: usize,
    positions: usize,
}

/// The history's passes, in order. They depend on the blocks alone, never on the threads.
fn passes<T>(history: &[HostBlock<'_, T>]) -> Vec<Pass> {
    let mut passes = Vec::new();
    let (mut first, mut at) = (0, 0);
    while first < history.len() {
        let mut end = first + 1;
        let mut positions = history[first].positions;
        while end < history.len() && positions + history[end].positions <= POSITIONS_PER_PASS {
            positions += history[end].positions;
            end += 1;
        }
        passes.push(Pass { blocks: first..end, at, positions });
        (first, at) = (end, at + positions);
    }
    passes
}

/// `f` of every pass, in order; with [`Spread::Threads`] the passes run on the pool's threads,
/// so that a long history of one sequence keeps every thread reading (a decode step at batch 1
/// with fewer KV heads than threads, or a number that does not divide among them).
fn in_passes<T: Send>(passes: &[Pass], spread: Spread, f: impl Fn(&Pass) -> T + Sync + Send) -> Vec<T> {
    match spread {
        Spread::Threads if passes.len() > 1 => passes.par_iter().map(f).collect(),
        _ => passes.iter().map(f).collect(),
    }
}

/// The attention of one query row for the query heads of KV head `kv`: the scores of every
/// position, softmax per head, then the probability-weighted sums of the value rows. Scores and
/// values go a pass at a time (each pass's keys, then its values, read from memory once for the
/// whole group); each pass's weighted values are summed from zero and the passes' sums added in
/// order. Every path runs the same arithmetic in the same order, however the passes are spread
/// over threads.
fn attend<T: KvElement>(q: &[f32], history: &[HostBlock<'_, T>], kv_heads: usize, head_dim: usize, kv: usize, isa: Isa, spread: Spread) -> Vec<f32> {
    let q_heads = q.len() / head_dim;
    let group = q_heads / kv_heads;
    let total: usize = history.iter().map(|b| b.positions).sum();
    if total == 0 {
        return vec![0f32; group * head_dim]; // nothing to attend to (never so in a decode step)
    }
    let passes = passes(history);
    let group_q = &q[kv * group * head_dim..(kv + 1) * group * head_dim];
    // A history of one value pass has its values asked for with its keys (see below).
    let values_early = total <= POSITIONS_PER_PASS;
    let scores = in_passes(&passes, spread, |pass| {
        let blocks = &history[pass.blocks.clone()];
        dispatch!(isa, pass_scores(group_q, blocks, pass.positions, kv_heads, head_dim, kv, values_early, isa))
    });
    let mut probs = vec![0f32; group * total]; // [group, total]
    for (pass, scores) in passes.iter().zip(&scores) {
        for (g, scores) in scores.chunks_exact(pass.positions).enumerate() {
            probs[g * total + pass.at..g * total + pass.at + pass.positions].copy_from_slice(scores);
        }
    }
    weigh_values(probs, total, history, &passes, kv_heads, head_dim, kv, isa, spread)
}

/// The second half of [`attend`]: softmax of the scores `probs` ([group, total]) per head,
/// then the probability-weighted sums of the value rows, pass by pass, added in order.
#[allow(clippy::too_many_arguments)]
fn weigh_values<T: KvElement>(
    mut probs: Vec<f32>,
    total: usize,
    history: &[HostBlock<'_, T>],
    passes: &[Pass],
    kv_heads: usize,
    head_dim: usize,
    kv: usize,
    isa: Isa,
    spread: Spread,
) -> Vec<f32> {
    let group = probs.len() / total;
    let scale = 1.0 / (head_dim as f32).sqrt();
    for probs in probs.chunks_exact_mut(total) {
        match isa {
            // SAFETY (both arms): the CPU has the path, asserted by attend_one_with.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::avx2::softmax(probs, scale, isa) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::avx512::softmax(probs, scale, isa) },
            _ => softmax(probs, scale, isa),
        }
    }
    let sums = in_passes(passes, spread, |pass| {
        let blocks = &history[pass.blocks.clone()];
        dispatch!(isa, pass_values(&probs, total, pass.at..pass.at + pass.positions, blocks, kv_heads, head_dim, kv, isa))
    });
    let mut sums = sums.into_iter();
    let mut out = sums.next().unwrap_or_else(|| vec![0f32; group * head_dim]);
    for sum in sums {
        for (o, s) in out.iter_mut().zip(sum) {
            *o += s;
        }
    }
    out
}

/// The scores `q_g . k_t` of every head g of the group (`group_q`, [group, head_dim]) for the
/// positions of one pass's `blocks`: [group, positions]. The heads go [`SCORE_HEADS`] at a time
/// on AVX-512 (one at a time elsewhere) over four chunks at a time, each row of keys loaded once
/// for all of them; the first of these passes reads the keys from memory, asking for those
/// KEY_CHUNKS_AHEAD chunks further on meanwhile, and the later ones find them in L2.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pass_scores<T: KvElement, const F16C: bool>(
    group_q: &[f32],
    blocks: &[HostBlock<'_, T>],
    positions: usize,
    kv_heads: usize,
    head_dim: usize,
    kv: usize,
    values_early: bool,
    isa: Isa,
) -> Vec<f32> {
    let chunks = score_chunks(blocks, kv_heads, head_dim, kv);
    for chunk in chunks.whole.iter().take(KEY_CHUNKS_AHEAD) {
        prefetch_chunk(chunk, head_dim, values_early);
    }
    let mut scores = vec![0f32; group_q.len() / head_dim * positions];
    let per_pass = if isa == Isa::Avx512 { SCORE_HEADS } else { 1 };
    for (b, (bunch, scores)) in group_q.chunks(per_pass * head_dim).zip(scores.chunks_mut(per_pass * positions)).enumerate() {
        for (j, quad) in chunks.whole.chunks(4).enumerate() {
            if b == 0 {
                let next = 4 * j + KEY_CHUNKS_AHEAD;
                for chunk in chunks.whole.get(next..(next + 4).min(chunks.whole.len())).unwrap_or(&[]) {
                    prefetch_chunk(chunk, head_dim, values_early);
                }
            }
            heads_scores::<T, F16C>(bunch, head_dim, quad, positions, scores);
        }
        for (q, scores) in bunch.chunks_exact(head_dim).zip(scores.chunks_exact_mut(positions)) {
            partial_scores(q, &chunks.partial, scores);
        }
    }
    scores
}

/// softmax(scores * scale) in place, as candle's softmax_last_dim: exp(x - max) / sum, with the
/// 8-lane exponential of `activation` (with libm's, one position at a time, this kernel took
/// 20.7-22.1 ms over 12 layers of 4 x 2,048 positions, against 16.4-20.9).
#[inline(always)]
fn softmax(probs: &mut [f32], scale: f32, isa: Isa) {
    let max = lanes(probs, f32::NEG_INFINITY, |m, s| m.max(s * scale)).into_iter().fold(f32::NEG_INFINITY, f32::max);
    for p in probs.iter_mut() {
        *p = *p * scale - max;
    }
    exp_in_place(probs, isa);
    let [a, b, c, d, e, f, g, h] = lanes(probs, 0.0, |sum, p| sum + p);
    let sum = ((a + e) + (c + g)) + ((b + f) + (d + h));
    for p in probs.iter_mut() {
        *p /= sum;
    }
}

/// `sum_t p_g[t] * v_t` over the positions `run` of one pass's `blocks` in order (v_t: KV head
/// `kv`'s value row of position t), for every head g of the group (probabilities `probs`,
/// [group, total]): [group, head_dim], summed from zero, up to [`HEADS_PER_PASS`] heads per
/// read of a value row.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pass_values<T: KvElement, const F16C: bool>(
    probs: &[f32],
    total: usize,
    run: std::ops::Range<usize>,
    blocks: &[HostBlock<'_, T>],
    kv_heads: usize,
    head_dim: usize,
    kv: usize,
    isa: Isa,
) -> Vec<f32> {
    for block in blocks.iter().take(VALUE_BLOCKS_AHEAD) {
        prefetch_values(block, kv_heads, head_dim, kv);
    }
    // Wide enough runs of output elements to keep eight vector sums going on AVX2. AVX-512
    // takes runs of 64 (four 16-lane sums a head, 12 to 16 in all, of its 32 registers): each
    // value row is read once, whole, rather than a quarter of it in each of four passes over the
    // history, and three heads no longer wait on three chains of additions (1.02-1.42x,
    // about 1.1x most often, the AVX-512 step at 64-1,024 positions in `attention_decode`).
    let wide = isa == Isa::Avx512 && head_dim.is_multiple_of(64);
    let mut out = vec![0f32; probs.len() / total * head_dim];
    for (heads, out) in out.chunks_mut(HEADS_PER_PASS * head_dim).enumerate() {
        let head = |h: usize| &probs[(heads * HEADS_PER_PASS + h) * total + run.start..(heads * HEADS_PER_PASS + h) * total + run.end];
        match (out.len() / head_dim, wide) {
            (1, _) => heads_values::<1, 64, T, F16C>([head(0)], blocks, kv_heads, head_dim, kv, out),
            (2, false) => heads_values::<2, 32, T, F16C>([head(0), head(1)], blocks, kv_heads, head_dim, kv, out),
            (2, true) => heads_values::<2, 64, T, F16C>([head(0), head(1)], blocks, kv_heads, head_dim, kv, out),
            (3, false) => heads_values::<3, 16, T, F16C>([head(0), head(1), head(2)], blocks, kv_heads, head_dim, kv, out),
            (3, true) => heads_values::<3, 64, T, F16C>([head(0), head(1), head(2)], blocks, kv_heads, head_dim, kv, out),
            (_, false) => heads_values::<4, 16, T, F16C>([head(0), head(1), head(2), head(3)], blocks, kv_heads, head_dim, kv, out),
            (_, true) => heads_values::<4, 64, T, F16C>([head(0), head(1), head(2), head(3)], blocks, kv_heads, head_dim, kv, out),
        }
    }
    out
}

// Software prefetch of the KV cache. Each block is its own few KiB of memory, where hardware
// prefetchers stop at page ends, and a decode step reads each block once, after the step's weights
// have pushed it out of the caches: without prefetching, the reads waited on memory a block at a
// time. The first pass of a group's scores over the keys asks for them KEY_CHUNKS_AHEAD chunks
// ahead, the first pass over a run's value rows for the values VALUE_BLOCKS_AHEAD blocks ahead,
// and each asks for its first few before it starts. `attention_decode`, 16 sequences, ms a step:
// at 64 positions, Zen 2 (AVX2) 2.1–2.5 with none, 1.6–2.1 with a whole pass of 256 positions
// asked for at once, 1.3–1.8 so; at 512 positions 19.1, 17.1–18.8 and 13.8–16.0; at 1,024, 39.1,
// 35–38 and 28–33. Zen 4 (AVX-512), a pass at once: 0.66 against 0.96 at 64 positions. A history
// of one value pass asks for its values with its keys (`prefetch_chunk`): 96 positions 2.24–2.44
// against 2.46–2.88, 192 positions 4.94–5.02 against 5.52–6.04 (Zen 2). The value pass still asks
// for them again as it goes: skipping that for such histories was slower (192 positions 5.87–6.47
// against 5.23–5.82), as the early lines do not all stay in L1. A longer history has its values
// asked for into L2 with the keys, where the value pass's requests into L1 then find them: 512
// positions 12.9–13.5 against 13.5–14.5, 1,024 positions 25.5–26.7 against 27.8–29.4, six
// alternating runs (Zen 2). Changes no result.

/// Chunks ahead of the first pass's scores over the keys whose keys are asked for.
const KEY_CHUNKS_AHEAD: usize = 8;
/// Query heads whose scores one pass over the keys computes on AVX-512: each key row is loaded,
/// and for f16 widened, once for up to this many heads (4 chunks x 4 heads = 16 vector sums of
/// the 32 registers), where each head went over the keys in turn before (the first from memory,
/// the others from cache). `attention_decode` (16 sequences, 12 query heads over 4 KV heads, Zen
/// 5, 2 threads), ms a step, medians of 4 alternating runs, each head in turn against three
/// heads at once: f32 at 64 positions 0.46 -> 0.43, 96 0.70 -> 0.63, 192 1.65 -> 1.55, 512
/// 5.57 -> 4.93, 1,024 11.76 -> 11.83; f16 0.42 -> 0.41, 0.60 -> 0.55, 1.06 -> 0.96, 3.52 ->
/// 2.99, 7.11 -> 6.44. AVX2 keeps one head at a time: its 16 registers held the sums of three
/// heads only by spilling them (10-20% slower at every length).
const SCORE_HEADS: usize = 4;
/// Blocks ahead of the first pass over a run's value rows whose values are asked for.
const VALUE_BLOCKS_AHEAD: usize = 4;

/// Asks the CPU to bring every cache line of `run` into L1, or only into L2 with `L2`: one
/// request per 64-byte line the run's bytes touch. Requests for a run's first element every 64
/// bytes and its last, through an iterator, and for a chunk's keys row by row, cost more than
/// the scores at 64 positions (58% of a cache-resident call's time went to `pass_scores`, most
/// of it that loop): a call over 64 cached positions (12 query heads over 4, head_dim 64, Zen 5)
/// 1.55 -> 0.95 µs, 512 positions 11.8 -> 7.8. Over histories in memory, as in a served step,
/// the reads dominate: `attention_decode` f32 within 5% either way, f16 at 1,024 positions 9.0
/// -> 7.5-7.9 ms a step; a 16-sequence q8_0 decode step the same.
#[inline(always)]
fn prefetch_run<const L2: bool, T>(run: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        let start = run.as_ptr().cast::<i8>();
        let end = start.wrapping_add(std::mem::size_of_val(run));
        // the start of the line the run's first byte is in
        let mut line = start.wrapping_sub(start as usize % 64);
        while line < end {
            // SAFETY: a prefetch only hints at an address (a line `run` touches here); it never
            // faults and changes no memory. SSE is part of x86-64.
            unsafe {
                if L2 {
                    _mm_prefetch::<_MM_HINT_T1>(line)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line)
                }
            }
            line = line.wrapping_add(64);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = run;
}

/// Asks for a chunk's keys, each of its `head_dim` rows of `SCORE_CHUNK` f32, and its value
/// rows too. A history of one value pass (at most [`POSITIONS_PER_PASS`] positions, 128 KiB of
/// values at head_dim 128, `values_early`) has them come into L1 with the keys, over the scores
/// and the softmax, rather than a few blocks ahead of the value pass, whose first pass over the
/// rows waited on them. A longer one has them come into L2 only, where the value pass's own
/// requests, a few blocks ahead, then find them. In a block of `SCORE_CHUNK` positions (the
/// default 16) the key rows are one contiguous run.
#[inline(always)]
fn prefetch_chunk<T>(chunk: &ScoreChunk<'_, T>, head_dim: usize, values_early: bool) {
    if chunk.block_size == SCORE_CHUNK {
        prefetch_run::<false, T>(&chunk.keys_t[..head_dim * SCORE_CHUNK]);
    } else {
        for d in 0..head_dim {
            let row = d * chunk.block_size;
            prefetch_run::<false, T>(&chunk.keys_t[row..row + SCORE_CHUNK]);
        }
    }
    if values_early {
        prefetch_run::<false, T>(chunk.values);
    } else {
        prefetch_run::<true, T>(chunk.values);
    }
}

/// Asks for KV head `kv`'s value rows of `block`.
#[inline(always)]
fn prefetch_values<T>(block: &HostBlock<'_, T>, kv_heads: usize, head_dim: usize, kv: usize) {
    let span = block.values.len() / kv_heads.max(1);
    prefetch_run::<false, T>(&block.values[kv * span..kv * span + (block.positions * head_dim).min(span)]);
}

/// `values` folded into eight lanes, value i into lane i % 8: eight independent chains (vector
/// lanes) rather than one long scalar one, in an order every path shares.
#[inline(always)]
fn lanes(values: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> [f32; 8] {
    let mut lanes = [init; 8];
    let mut chunks = values.chunks_exact(8);
    for chunk in chunks.by_ref() {
        for l in 0..8 {
            lanes[l] = f(lanes[l], chunk[l]);
        }
    }
    for (lane, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane = f(*lane, v);
    }
    lanes
}

/// Up to `SCORE_CHUNK` consecutive positions of one block, for one KV head.
struct ScoreChunk<'a, T> {
    /// the head's `[head_dim, block_size]` keys from the chunk's first position on
    keys_t: &'a [T],
    /// the head's value rows of the chunk's positions, `[len, head_dim]`
    values: &'a [T],
    block_size: usize,
    /// the chunk's first position in the history
    at: usize,
    /// its positions in the history (fewer than `SCORE_CHUNK` at the end of a block)
    len: usize,
}

/// The history's positions as chunks, block by block, made once for every query head of a KV
/// head.
struct ScoreChunks<'a, T> {
    /// chunks with `SCORE_CHUNK` positions stored from the first on (a whole chunk of the
    /// block's storage; past `len` they hold values whose scores are dropped)
    whole: Vec<ScoreChunk<'a, T>>,
    /// the others (blocks whose size is not a multiple of `SCORE_CHUNK`)
    partial: Vec<ScoreChunk<'a, T>>,
}

#[inline(always)]
fn score_chunks<'a, T>(history: &[HostBlock<'a, T>], kv_heads: usize, head_dim: usize, kv: usize) -> ScoreChunks<'a, T> {
    let mut chunks = ScoreChunks { whole: Vec::new(), partial: Vec::new() };
    let mut at = 0;
    for block in history {
        let block_size = block.keys_t.len() / (kv_heads * head_dim);
        let keys_t = &block.keys_t[kv * head_dim * block_size..(kv + 1) * head_dim * block_size];
        let values = &block.values[kv * block_size * head_dim..(kv + 1) * block_size * head_dim];
        for s in (0..block.positions).step_by(SCORE_CHUNK) {
            let len = (block.positions - s).min(SCORE_CHUNK);
            let chunk = ScoreChunk { keys_t: &keys_t[s..], values: &values[s * head_dim..(s + len) * head_dim], block_size, at: at + s, len };
            if s + SCORE_CHUNK <= block_size { chunks.whole.push(chunk) } else { chunks.partial.push(chunk) }
        }
        at += block.positions;
    }
    chunks
}

/// The scores of the heads `qs` ([heads, head_dim], at most [`SCORE_HEADS`] heads) for the
/// whole chunks of `quad` (at most four), into `scores` ([heads, positions]).
#[inline(always)]
fn heads_scores<T: KvElement, const F16C: bool>(qs: &[f32], head_dim: usize, quad: &[ScoreChunk<'_, T>], positions: usize, scores: &mut [f32]) {
    macro_rules! scores {
        ($h:literal, $c:literal, $chunks:expr) => {{
            let acc = chunk_scores::<$h, $c, T, F16C>(std::array::from_fn(|h| &qs[h * head_dim..(h + 1) * head_dim]), $chunks);
            for (h, acc) in acc.iter().enumerate() {
                for (acc, chunk) in acc.iter().zip($chunks) {
                    let at = h * positions + chunk.at;
                    scores[at..at + chunk.len].copy_from_slice(&acc[..chunk.len]);
                }
            }
        }};
    }
    if let [a, b, c, d] = quad {
        match qs.len() / head_dim {
            1 => scores!(1, 4, [a, b, c, d]),
            2 => scores!(2, 4, [a, b, c, d]),
            3 => scores!(3, 4, [a, b, c, d]),
            _ => scores!(4, 4, [a, b, c, d]),
        }
    } else {
        for chunk in quad {
            match qs.len() / head_dim {
                1 => scores!(1, 1, [chunk]),
                2 => scores!(2, 1, [chunk]),
                3 => scores!(3, 1, [chunk]),
                _ => scores!(4, 1, [chunk]),
            }
        }
    }
}

/// The `SCORE_CHUNK` scores of each of `C` whole chunks for each of `H` query vectors:
/// `acc[h][c][l] = sum_d q_h[d] * k_c[d][l]`, in order of `d`. Each row of keys is loaded (and
/// widened) once for all `H` vectors: `H x C` independent vector sums, up to 16.
#[inline(always)]
fn chunk_scores<const H: usize, const C: usize, T: KvElement, const F16C: bool>(qs: [&[f32]; H], chunks: [&ScoreChunk<'_, T>; C]) -> [[[f32; SCORE_CHUNK]; C]; H] {
    let head_dim = qs[0].len();
    let qs = qs.map(|q| &q[..head_dim]);
    // Each chunk's rows, checked once: row d is `SCORE_CHUNK` elements from `d * block_size`.
    let keys: [&[T]; C] = chunks.map(|c| &c.keys_t[..(head_dim.max(1) - 1) * c.block_size + SCORE_CHUNK]);
    let strides = chunks.map(|c| c.block_size);
    let mut at = [0usize; C];
    let mut acc = [[[0f32; SCORE_CHUNK]; C]; H];
    for d in 0..head_dim {
        for c in 0..C {
            // SAFETY: for d < head_dim, at[c] = d * block_size and at[c] + SCORE_CHUNK <=
            // (head_dim - 1) * block_size + SCORE_CHUNK = keys[c].len().
            let k: &[T; SCORE_CHUNK] = unsafe { keys[c].get_unchecked(at[c]..at[c] + SCORE_CHUNK) }.try_into().expect("SCORE_CHUNK elements");
            let k = T::widen_run::<F16C, SCORE_CHUNK>(k);
            for h in 0..H {
                let qd = qs[h][d];
                for l in 0..SCORE_CHUNK {
                    acc[h][c][l] += qd * k[l];
                }
            }
            at[c] += strides[c];
        }
    }
    acc
}

/// The scores of every query vector of `queries` against every position of `history`:
/// [queries, positions]. Each whole chunk of keys is read once for the queries four at a time,
/// while it is in L1; every score is [`chunk_scores`]' sum, in the same order.
#[inline(always)]
fn tile_scores<T: KvElement, const F16C: bool>(queries: &[&[f32]], history: &[HostBlock<'_, T>], kv_heads: usize, head_dim: usize, kv: usize) -> Vec<f32> {
    let total: usize = history.iter().map(|b| b.positions).sum();
    let chunks = score_chunks(history, kv_heads, head_dim, kv);
    let mut scores = vec![0f32; queries.len() * total];
    for chunk in &chunks.whole {
        for (i, quad) in queries.chunks(4).enumerate() {
            let mut store = |j: usize, acc: &[f32; SCORE_CHUNK]| {
                let at = (4 * i + j) * total + chunk.at;
                scores[at..at + chunk.len].copy_from_slice(&acc[..chunk.len]);
            };
            if let &[a, b, c, d] = quad {
                for (j, [acc]) in chunk_scores::<4, 1, T, F16C>([a, b, c, d], [chunk]).iter().enumerate() {
                    store(j, acc);
                }
            } else {
                for (j, &q) in quad.iter().enumerate() {
                    store(j, &chunk_scores::<1, 1, T, F16C>([q], [chunk])[0][0]);
                }
            }
        }
    }
    for (q, scores) in queries.iter().zip(scores.chunks_exact_mut(total)) {
        partial_scores(q, &chunks.partial, scores);
    }
    scores
}

/// `scores[t] = q . k_t` for the positions of the other chunks, one position at a time.
#[inline(always)]
fn partial_scores<T: KvElement>(q: &[f32], partial: &[ScoreChunk<'_, T>], scores: &mut [f32]) {
    for chunk in partial {
        for t in 0..chunk.len {
            let mut acc = 0f32;
            for (d, &qd) in q.iter().enumerate() {
                acc += qd * chunk.keys_t[d * chunk.block_size + t].widen();
            }
            scores[chunk.at + t] = acc;
        }
    }
}

/// `out[h] += sum_t p_h[t] * v_t` for `H` heads (the sums already in `out`, [H, head_dim], go
/// on), `W` output elements of each at a time; every output element is the same sum in the same
/// order whatever `H` and `W`.
#[inline(always)]
fn heads_values<const H: usize, const W: usize, T: KvElement, const F16C: bool>(
    probs: [&[f32]; H],
    history: &[HostBlock<'_, T>],
    kv_heads: usize,
    head_dim: usize,
    kv: usize,
    out: &mut [f32],
) {
    #[inline(always)]
    fn rows<'a, T>(block: &HostBlock<'a, T>, kv_heads: usize, head_dim: usize, kv: usize) -> impl Iterator<Item = &'a [T]> {
        let block_size = block.values.len() / (kv_heads * head_dim);
        let values = &block.values[kv * block_size * head_dim..(kv + 1) * block_size * head_dim];
        values.chunks_exact(head_dim).take(block.positions)
    }
    let mut c = 0;
    while c + W <= head_dim {
        let mut acc: [[f32; W]; H] = std::array::from_fn(|h| out[h * head_dim + c..h * head_dim + c + W].try_into().expect("W elements"));
        let mut t = 0;
        for (b, block) in history.iter().enumerate() {
            if c == 0
                && let Some(next) = history.get(b + VALUE_BLOCKS_AHEAD)
            {
                prefetch_values(next, kv_heads, head_dim, kv);
            }
            for row in rows(block, kv_heads, head_dim, kv) {
                let row: &[T; W] = row[c..c + W].try_into().expect("W elements");
                let row = T::widen_run::<F16C, W>(row);
                for h in 0..H {
                    let p = probs[h][t];
                    for l in 0..W {
                        acc[h][l] += p * row[l];
                    }
                }
                t += 1;
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            out[h * head_dim + c..h * head_dim + c + W].copy_from_slice(acc);
        }
        c += W;
    }
    if c < head_dim {
        let mut t = 0;
        for block in history {
            for row in rows(block, kv_heads, head_dim, kv) {
                for h in 0..H {
                    for (o, &v) in out[h * head_dim + c..(h + 1) * head_dim].iter_mut().zip(&row[c..]) {
                        *o += probs[h][t] * v.widen();
                    }
                }
                t += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;
    use half::f16;

    /// A history of `total` positions in blocks of `block_size` (the last one partly filled,
    /// its unused positions holding values that must not count).
    fn history_storage(kv_heads: usize, head_dim: usize, block_size: usize, total: usize) -> Vec<(Vec<f32>, Vec<f32>, usize)> {
        (0..total.div_ceil(block_size))
            .map(|b| {
                let per_block = kv_heads * head_dim * block_size;
                let positions = (total - b * block_size).min(block_size);
                (values(per_block, 100 + b as u64), values(per_block, 200 + b as u64), positions)
            })
            .collect()
    }

    fn to_f16(values: &[f32]) -> Vec<f16> {
        values.iter().map(|&v| f16::from_f32(v)).collect()
    }

    /// The vectorizable widening equals `half`'s for every f16 (NaNs stay NaNs).
    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let (ours, theirs) = (f16_to_f32(bits), f16::from_bits(bits).to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{bits:#06x}: {ours} vs {theirs}");
        }
    }

    /// The definition in f64: softmax(q . k_t / sqrt(head_dim)) weighting the value rows.
    fn reference(q: &[f32], blocks: &[HostBlock<'_>], kv_heads: usize, head_dim: usize, kv: usize) -> Vec<f32> {
        let group = q.len() / head_dim / kv_heads;
        let mut rows = Vec::new(); // (key, value) per position
        for block in blocks {
            let bs = block.keys_t.len() / (kv_heads * head_dim);
            for t in 0..block.positions {
                let key: Vec<f64> = (0..head_dim).map(|d| block.keys_t[(kv * head_dim + d) * bs + t] as f64).collect();
                let value: Vec<f64> = (0..head_dim).map(|d| block.values[(kv * bs + t) * head_dim + d] as f64).collect();
                rows.push((key, value));
            }
        }
        let mut out = Vec::new();
        for g in 0..group {
            let q = &q[(kv * group + g) * head_dim..(kv * group + g + 1) * head_dim];
            let scores: Vec<f64> =
                rows.iter().map(|(k, _)| k.iter().zip(q).map(|(k, &q)| k * q as f64).sum::<f64>() / (head_dim as f64).sqrt()).collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            for d in 0..head_dim {
                out.push((rows.iter().zip(&weights).map(|((_, v), w)| v[d] * w).sum::<f64>() / sum) as f32);
            }
        }
        out
    }

    /// Every path this CPU has against the f64 definition, and every path the same bits as the
    /// portable one: groups of 1 to 8 heads (passes of up to four, and what is left), head sizes
    /// with and without a whole output chunk, block sizes with and without a whole score chunk,
    /// partly filled last blocks.
    #[test]
    fn every_path_matches_the_definition_and_the_portable_bits() {
        let mut ran = Vec::new();
        for (kv_heads, q_heads, head_dim) in [(2, 6, 64), (1, 4, 128), (2, 4, 64), (1, 5, 128), (4, 4, 72), (2, 2, 8), (1, 7, 40), (2, 16, 32)] {
            for block_size in [16, 32, 5] {
                for total in [1, 7, 16, 17, 50, POSITIONS_PER_PASS + 37, 3 * POSITIONS_PER_PASS + 11] {
                    let storage = history_storage(kv_heads, head_dim, block_size, total);
                    let blocks: Vec<HostBlock<'_>> =
                        storage.iter().map(|(k, v, positions)| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
                    let q = values(q_heads * head_dim, total as u64);
                    for kv in 0..kv_heads {
                        let expected = reference(&q, &blocks, kv_heads, head_dim, kv);
                        let portable = attend_one_with(&q, &blocks, kv_heads, head_dim, kv, Isa::Portable, Spread::Serial);
                        for (i, (got, want)) in portable.iter().zip(&expected).enumerate() {
                            assert!((got - want).abs() < 1e-5, "head_dim {head_dim} block {block_size} total {total} kv {kv} [{i}]: {got} vs {want}");
                        }
                        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                            assert_eq!(attend_one_with(&q, &blocks, kv_heads, head_dim, kv, isa, Spread::Serial), portable, "{isa:?}");
                            if !ran.contains(&isa) {
                                ran.push(isa);
                            }
                        }
                    }
                    // f16 blocks: the bits of f32 blocks holding the same (rounded) values.
                    let halves: Vec<(Vec<f16>, Vec<f16>, usize)> =
                        storage.iter().map(|(k, v, positions)| (to_f16(k), to_f16(v), *positions)).collect();
                    let widened: Vec<(Vec<f32>, Vec<f32>)> =
                        halves.iter().map(|(k, v, _)| (k.iter().map(|h| h.to_f32()).collect(), v.iter().map(|h| h.to_f32()).collect())).collect();
                    let half_blocks: Vec<HostBlock<'_, f16>> =
                        halves.iter().map(|(k, v, positions)| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
                    let wide_blocks: Vec<HostBlock<'_>> =
                        widened.iter().zip(&halves).map(|((k, v), (_, _, positions))| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
                    for kv in 0..kv_heads {
                        for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                            let want = attend_one_with(&q, &wide_blocks, kv_heads, head_dim, kv, isa, Spread::Serial);
                            assert_eq!(attend_one_with(&q, &half_blocks, kv_heads, head_dim, kv, isa, Spread::Serial), want, "f16 {isa:?}");
                        }
                    }
                }
            }
        }
        eprintln!("attention paths tested: {ran:?} (selected: {:?})", Isa::selected());
    }

    /// A tile of prompt rows gives, row by row, the bits of [`attend_one`] over what each row
    /// sees, on every path, f32 and f16 blocks: groups of 1 to 7 heads (whole and partial quads
    /// of query vectors), block sizes with and without whole score chunks, tiles from one row
    /// on, starting at the history's first position or later, across passes.
    #[test]
    fn a_tile_of_rows_equals_its_rows_one_by_one() {
        for (kv_heads, q_heads, head_dim) in [(2, 4, 64), (1, 7, 40), (2, 2, 8), (1, 3, 128)] {
            for block_size in [16, 5] {
                for (first, rows) in [(1, 1), (1, 9), (17, 6), (POSITIONS_PER_PASS - 2, 5), (300, 3)] {
                    let total = first + rows - 1;
                    let storage = history_storage(kv_heads, head_dim, block_size, total);
                    let blocks: Vec<HostBlock<'_>> = storage.iter().map(|(k, v, positions)| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
                    let halves: Vec<(Vec<f16>, Vec<f16>, usize)> = storage.iter().map(|(k, v, positions)| (to_f16(k), to_f16(v), *positions)).collect();
                    let half_blocks: Vec<HostBlock<'_, f16>> = halves.iter().map(|(k, v, positions)| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
                    let q = values(rows * q_heads * head_dim, (first * rows) as u64);
                    let width = q_heads * head_dim;
                    for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                        for kv in 0..kv_heads {
                            let one_by_one: Vec<f32> = (0..rows)
                                .flat_map(|r| attend_one_with(&q[r * width..(r + 1) * width], &visible_prefix(&blocks, first + r), kv_heads, head_dim, kv, isa, Spread::Serial))
                                .collect();
                            let at = format!("{isa:?} kv {kv} head_dim {head_dim} block {block_size} first {first} rows {rows}");
                            assert_eq!(attend_rows_with(&q, rows, &blocks, first, kv_heads, head_dim, kv, isa), one_by_one, "{at}");
                            let one_by_one: Vec<f32> = (0..rows)
                                .flat_map(|r| attend_one_with(&q[r * width..(r + 1) * width], &visible_prefix(&half_blocks, first + r), kv_heads, head_dim, kv, isa, Spread::Serial))
                                .collect();
                            assert_eq!(attend_rows_with(&q, rows, &half_blocks, first, kv_heads, head_dim, kv, isa), one_by_one, "f16 {at}");
                        }
                    }
                }
            }
        }
    }

    /// A long history's passes spread over threads give the bits of one thread's passes in
    /// order, on every path, whatever the pool's size.
    #[test]
    fn spreading_the_passes_over_threads_changes_no_bit() {
        let (kv_heads, q_heads, head_dim) = (3, 9, 64);
        for total in [POSITIONS_PER_PASS - 3, 2 * POSITIONS_PER_PASS, 5 * POSITIONS_PER_PASS + 9] {
            let storage = history_storage(kv_heads, head_dim, 16, total);
            let blocks: Vec<HostBlock<'_>> = storage.iter().map(|(k, v, positions)| HostBlock { keys_t: k, values: v, positions: *positions }).collect();
            let q = values(q_heads * head_dim, total as u64);
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available()) {
                for kv in 0..kv_heads {
                    let serial = attend_one_with(&q, &blocks, kv_heads, head_dim, kv, isa, Spread::Serial);
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                        let spread = pool.install(|| attend_one_with(&q, &blocks, kv_heads, head_dim, kv, isa, Spread::Threads));
                        assert_eq!(spread, serial, "{isa:?} total {total} kv {kv} threads {threads}");
                    }
                }
            }
        }
    }
}
