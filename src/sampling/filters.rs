//! Candidate selection for the filtered draws: the `n` best tokens (top-k, top_logprobs), the
//! nucleus (top-p) without a full sort of the vocabulary, and the draws over ranked candidates
//! or over a row in id order, located through per-block masses.

use std::cmp::Ordering;

use super::kernels::{BLOCK, EXP_MIN_ARG, LANES, fast_exp, sum_exp};

/// Order of candidates: higher value first, then lower id, so ties resolve the same way
/// everywhere (and like greedy).
fn by_value_desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Keeps the shortest prefix of `cands` (sorted best first) whose mass reaches `target`.
pub(super) fn truncate_to_mass(cands: &mut Vec<(f32, u32)>, max_w: f32, target: f64) {
    let mut acc = 0.0f64;
    for i in 0..cands.len() {
        acc += f64::from(fast_exp(cands[i].0 - max_w));
        if acc >= target {
            cands.truncate(i + 1);
            return;
        }
    }
}

/// Fills `out` with the nucleus: the most likely tokens, best first, until their share of
/// `mass` reaches `top_p` (top-p without top-k).
///
/// Two things keep this far from a full sort of the vocabulary:
/// - Tokens with probability below (1 - top_p) / V are left out up front. Together they weigh
///   less than 1 - top_p and they are the least likely tokens, so they all lie in the
///   discarded tail; on real (peaked) distributions that removes nearly the whole vocabulary.
/// - The ranking grows in chunks: select the next chunk of best tokens with a linear-time
///   partition, sort only that chunk, stop once the mass is reached.
pub(super) fn sorted_prefix_to_mass(
    work: &[f32],
    max_w: f32,
    mass: f64,
    top_p: f64,
    pairs: &mut Vec<(f32, u32)>,
    out: &mut Vec<(f32, u32)>,
) {
    let tail_bound = mass * (1.0 - top_p) / work.len() as f64;
    // A small margin keeps float rounding from cutting a token that sits on the bound.
    let cutoff = ((tail_bound.ln() as f32) - 1e-3).max(EXP_MIN_ARG) + max_w;
    pairs.clear();
    // Whole lanes below the cutoff (nearly all of them on real rows) are skipped at once.
    let (chunks, tail) = work.as_chunks::<LANES>();
    for (ci, c) in chunks.iter().enumerate() {
        let mut any = false;
        for &x in c {
            any |= x >= cutoff;
        }
        if any {
            let base = ci * LANES;
            pairs.extend(c.iter().enumerate().filter(|&(_, &x)| x >= cutoff).map(|(j, &x)| (x, (base + j) as u32)));
        }
    }
    let tail_start = chunks.len() * LANES;
    pairs.extend(tail.iter().enumerate().filter(|&(_, &x)| x >= cutoff).map(|(j, &x)| (x, (tail_start + j) as u32)));
    out.clear();
    let target = top_p * mass;
    let mut acc = 0.0f64;
    let mut start = 0;
    let mut chunk = 256usize;
    while start < pairs.len() {
        let end = (start + chunk).min(pairs.len());
        if end < pairs.len() {
            pairs[start..].select_nth_unstable_by(end - start - 1, by_value_desc);
        }
        pairs[start..end].sort_unstable_by(by_value_desc);
        for &(x, id) in &pairs[start..end] {
            out.push((x, id));
            acc += f64::from(fast_exp(x - max_w));
            if acc >= target {
                return;
            }
        }
        start = end;
        chunk = chunk.saturating_mul(4);
    }
}

/// The `n` largest values as (value, id), best first, ties to the lower id; NaN is skipped.
///
/// For small `n` (top_logprobs, typical top-k) one pass with a sorted shortlist wins: once the
/// shortlist is full, whole lanes of values are rejected by a vectorised comparison against its
/// minimum. Large `n` switches to a linear-time partition over a (value, id) copy.
pub(super) fn top_n(values: &[f32], n: usize, out: &mut Vec<(f32, u32)>, pairs: &mut Vec<(f32, u32)>) {
    out.clear();
    let n = n.min(values.len());
    if n == 0 {
        return;
    }
    if n <= 64 {
        // Inserts after every entry with value >= x: earlier ids win ties.
        let insert = |out: &mut Vec<(f32, u32)>, x: f32, i: usize| {
            if out.len() == n {
                out.pop();
            }
            let pos = out.partition_point(|&(v, _)| v >= x);
            out.insert(pos, (x, i as u32));
        };
        let mut i = 0;
        while out.len() < n && i < values.len() {
            if !values[i].is_nan() {
                insert(out, values[i], i);
            }
            i += 1;
        }
        let Some(&(mut threshold, _)) = out.last() else { return };
        let (chunks, tail) = values[i..].as_chunks::<LANES>();
        let tail_start = i + chunks.len() * LANES;
        for (ci, c) in chunks.iter().enumerate() {
            let mut any = false;
            for &x in c {
                any |= x > threshold;
            }
            if any {
                for (j, &x) in c.iter().enumerate() {
                    if x > threshold {
                        insert(out, x, i + ci * LANES + j);
                        threshold = out.last().map_or(threshold, |e| e.0);
                    }
                }
            }
        }
        for (j, &x) in tail.iter().enumerate() {
            if x > threshold {
                insert(out, x, tail_start + j);
                threshold = out.last().map_or(threshold, |e| e.0);
            }
        }
        return;
    }
    pairs.clear();
    pairs.extend(values.iter().enumerate().filter(|(_, x)| !x.is_nan()).map(|(i, &x)| (x, i as u32)));
    let n = n.min(pairs.len());
    if n == 0 {
        return;
    }
    if n < pairs.len() {
        pairs.select_nth_unstable_by(n - 1, by_value_desc);
    }
    out.extend_from_slice(&pairs[..n]);
    out.sort_unstable_by(by_value_desc);
}

/// Per-block masses sum(exp(x - shift)) over x >= min_keep, into `out`; returns their total.
pub(super) fn block_sums(xs: &[f32], shift: f32, min_keep: f32, out: &mut Vec<f64>) -> f64 {
    out.clear();
    let mut total = 0.0;
    for block in xs.chunks(BLOCK) {
        let m = sum_exp(block, shift, min_keep);
        out.push(m);
        total += m;
    }
    total
}

/// Draws the token where the cumulative mass first exceeds `target`, using the block masses
/// from [`block_sums`] to skip straight to the block that contains it.
pub(super) fn draw_in_blocks(xs: &[f32], blocks: &[f64], shift: f32, min_keep: f32, target: f64) -> Option<u32> {
    let mut acc = 0.0f64;
    for (b, (block, &mass)) in xs.chunks(BLOCK).zip(blocks).enumerate() {
        if acc + mass > target {
            for (j, &x) in block.iter().enumerate() {
                if x >= min_keep {
                    acc += f64::from(fast_exp(x - shift));
                    if acc > target {
                        return Some((b * BLOCK + j) as u32);
                    }
                }
            }
            // Element-wise rounding fell short of the block mass; keep going.
        } else {
            acc += mass;
        }
    }
    None
}
