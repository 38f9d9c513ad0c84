//! Greedy decoding's logits from bf16 products, exact where it matters.
//!
//! A step whose every row only wants its largest logit (greedy, no logprobs, no penalties) uses
//! nothing else of the output product. For a bf16 weight held for exact products, the bf16
//! products ([`Products::Bf16`]: `vdpbf16ps`, two multiply-adds a lane and instruction) find the
//! winner to within a bound, and only the columns that could win are computed again, exactly,
//! in the exact product's arithmetic: those columns get [`Products::Exact`]'s bits, every other
//! column NEG_INFINITY. The winner, ties included, is the exact product's.
//!
//! The bound. Column j's exact value e_j and its bf16 products' value a_j both approximate
//! s_j = sum_i w_ji x_i. Rounding x_i to bf16 errs by at most 2^-9 |x_i| (a subnormal x_i,
//! which the products read as zero, by less than 2^-126), each product of bf16 values is exact
//! in f32 but for results below 2^-126 (flushed to zero), and a sum of k terms in f32 errs by at
//! most γ_k = k 2^-24 / (1 - k 2^-24) of the sum of the terms' magnitudes (runs from zero, then
//! added, err less). With S_j = sum_i |w_ji| |x_i|:
//!
//! |e_j - a_j| <= (2^-9 + 2.01 γ_k) S_j + k 2^-125 (1 + max_i |w_ji|)
//!
//! [`candidates`] takes twice the first factor, S_j's upper bound |w_j|_2 |x|_2 (Cauchy-Schwarz),
//! and the weight's largest |w_j|_1 in place of max_i |w_ji|. With T = max_t (a_t - B_t),
//! the exact maximum e_m >= e_t >= a_t - B_t for every t, so e_m >= T and a_m + B_m >= e_m >= T:
//! the candidates {j : a_j + B_j >= T} hold every column whose exact value can be the maximum,
//! and every other column's exact value is below T, strictly below e_m.

use rayon::prelude::*;

use super::{K_RUN, Packed, Products, has_pair_body, matmul, position, run_order, widen};
use crate::cpu_matmul::Isa;

/// Per-column norms of a packed bf16 weight, for the bound: made once per weight.
pub struct ColumnNorms {
    /// |w_j|_2, rounded up to f32
    l2: Vec<f32>,
    /// the bound's part for flushed subnormals, k 2^-125 (1 + max_j |w_j|_1)
    floor: f32,
}

impl ColumnNorms {
    /// The norms of the `n` columns (weight rows) of a packed `[n, k]` bf16 weight.
    pub fn of(packed: &[u16], n: usize, k: usize) -> Self {
        let (l2, l1): (Vec<f32>, Vec<f64>) = (0..n)
            .into_par_iter()
            .map(|j| {
                let (mut squares, mut sum) = (0f64, 0f64);
                for kk in 0..k {
                    let w = widen(packed[position(j, kk, k, true)]) as f64;
                    squares += w * w;
                    sum += w.abs();
                }
                ((squares.sqrt() * (1.0 + 2f64.powi(-20))) as f32, sum)
            })
            .unzip();
        let floor = (k as f64 * 2f64.powi(-125) * (1.0 + l1.iter().copied().fold(0.0, f64::max))) as f32;
        Self { l2, floor }
    }
}

/// Whether [`argmax_logits`] runs on this CPU under `isa`: the bf16 pair body (AVX-512F and
/// avx512_bf16), whose exact products are the AVX-512 tiles' fused multiply-adds.
pub fn argmax_available(isa: Isa) -> bool {
    has_pair_body(isa)
}

/// For each of the `m` rows of `x` (`[m, k]`) against the packed bf16 weight `w` (`[n, k]`,
/// `norms` its [`ColumnNorms`]): the exact product's value of every column that can be the
/// row's largest once the columns `masked[row]` are left out, and NEG_INFINITY in every other
/// column (the masked ones included). A row whose activations or bf16 products are not all
/// finite, or with more candidates than an exact pass over its columns is worth, gets every
/// column exactly. `[m, n]`. Panics unless [`argmax_available`] for `isa`.
#[allow(clippy::too_many_arguments)]
pub fn argmax_logits(x: &[f32], m: usize, k: usize, w: &[u16], n: usize, norms: &ColumnNorms, masked: &[&[usize]], isa: Isa) -> Vec<f32> {
    assert!(argmax_available(isa), "no bf16 pair body on this CPU under {isa:?}");
    assert_eq!(masked.len(), m, "a list of masked columns per row");
    assert_eq!(norms.l2.len(), n, "the norms are not of {n} columns");
    // Each row's bf16 products, then in place its candidates' exact values and NEG_INFINITY
    // elsewhere, or the row left for the exact product.
    let mut out = matmul(x, m, k, Packed::Bf16(w), n, isa, Products::Bf16);
    let whole: Vec<bool> = out
        .par_chunks_mut(n.max(1))
        .enumerate()
        .map(|(row, out)| {
            let x = &x[row * k..(row + 1) * k];
            // SAFETY: the CPU has AVX-512F (it has the pair body, asserted above).
            let Some(candidates) = unsafe { candidates(x, out, norms, masked[row]) }.filter(|c| c.len() <= n / MOST_CANDIDATES_PER) else {
                return true;
            };
            // SAFETY: the CPU has AVX-512F, hence FMA.
            let values = unsafe { exact_columns(x, w, k, &candidates) };
            out.fill(f32::NEG_INFINITY);
            for (&j, value) in candidates.iter().zip(values) {
                out[j] = value;
            }
            false
        })
        .collect();
    let rows: Vec<usize> = (0..m).filter(|&row| whole[row]).collect();
    if !rows.is_empty() {
        let xs: Vec<f32> = rows.iter().flat_map(|&row| x[row * k..(row + 1) * k].iter().copied()).collect();
        let exact = matmul(&xs, rows.len(), k, Packed::Bf16(w), n, isa, Products::Exact);
        for (&row, exact) in rows.iter().zip(exact.chunks_exact(n)) {
            out[row * n..(row + 1) * n].copy_from_slice(exact);
        }
    }
    out
}

/// A row with more candidates than one in this many columns is computed whole.
const MOST_CANDIDATES_PER: usize = 16;

/// The columns of `approx` (one row's bf16 products) that can hold the row's exact maximum once
/// the `masked` ones are left out, in order; None where the bound does not hold (an activation
/// or product that is not finite, or k too large for it), or no column is left.
///
/// The bound on |e_j - a_j| (see the module's note) is `factor |w_j|_2 |x|_2 + floor`, in f32:
/// the norms are rounded up, and the factor is twice what the errors need, which covers the f32
/// rounding of the bound and of `a_j +- B_j` many times over. One pass of [`LANES`]-wide chunks,
/// which the compiler vectorizes: each lane keeps a running threshold over its columns, and
/// the columns that reach their lane's so far are kept, to be checked against the row's final
/// threshold at the end (a lane's running threshold is never above the row's final one, so
/// every column that reaches the final one reached its lane's when it was seen). The masked
/// columns' products become the most negative finite f32 / 4 first, so that they never set the
/// threshold, and are dropped from the candidates at the end whatever their bound.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn candidates(x: &[f32], approx: &mut [f32], norms: &ColumnNorms, masked: &[usize]) -> Option<Vec<usize>> {
    const SHUT: f32 = f32::MIN / 4.0;
    let k = x.len() as f64;
    if !x.iter().all(|v| v.is_finite()) || k * 2f64.powi(-24) >= 0.01 {
        return None;
    }
    let gamma = k * 2f64.powi(-24) / (1.0 - k * 2f64.powi(-24));
    let factor = (2.0 * (2f64.powi(-9) + 2.01 * gamma)) as f32;
    let x_l2 = (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() * (1.0 + 2f64.powi(-20))) as f32;
    let scale = factor * x_l2;
    // column j's bound B_j (the lanes' loop below computes it lane by lane, the same way)
    let bound = |j: usize| scale * norms.l2[j] + norms.floor;
    for &j in masked {
        if let Some(a) = approx.get_mut(j) {
            *a = if a.is_finite() { SHUT } else { *a };
        }
    }
    // a * 0 is NaN for an infinite or NaN a, and a sum of lanes keeps it.
    let mut poison = [0f32; LANES];
    // each lane's running threshold: the lanes' largest is the row's
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut kept = Vec::new();
    let columns = approx.len();
    let whole = columns / LANES * LANES;
    for (c, (a, l2)) in approx[..whole].chunks_exact(LANES).zip(norms.l2.chunks_exact(LANES)).enumerate() {
        let mut any = false;
        for l in 0..LANES {
            let bound = scale * l2[l] + norms.floor;
            poison[l] += a[l] * 0.0;
            lanes[l] = max(lanes[l], a[l] - bound);
            any |= a[l] + bound >= lanes[l];
        }
        if any {
            kept.extend((c * LANES..(c + 1) * LANES).filter(|&j| approx[j] + bound(j) >= lanes[j % LANES]));
        }
    }
    for j in whole..columns {
        poison[0] += approx[j] * 0.0;
        lanes[0] = max(lanes[0], approx[j] - bound(j));
        kept.push(j);
    }
    let threshold = lanes.iter().copied().fold(f32::NEG_INFINITY, max);
    if poison.iter().sum::<f32>().is_nan() || !(threshold > SHUT / 2.0) {
        return None;
    }
    kept.retain(|&j| approx[j] + bound(j) >= threshold && !masked.contains(&j));
    Some(kept)
}

/// Columns [`candidates`] takes at a time: one AVX-512 vector of f32.
const LANES: usize = 16;

/// The larger of two numbers that are not NaN (one compare and blend: `f32::max`'s NaN rules
/// cost a second compare per lane).
#[inline(always)]
fn max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The exact product of `x` (one row of `k`) with each of the `columns` of the packed bf16
/// weight `w`, in the AVX-512 tiles' arithmetic: runs of [`K_RUN`] terms from zero in
/// [`run_order`], each term one fused multiply-add, each run's sum added to the total in turn
/// (the first taken as it is). The same bits as those columns of [`matmul`] with
/// [`Products::Exact`] on the AVX-512 path. A column's runs go side by side, each its own chain
/// of multiply-adds, so that one column does not wait on one chain of k.
///
/// # Safety
/// The CPU has FMA.
#[target_feature(enable = "fma")]
unsafe fn exact_columns(x: &[f32], w: &[u16], k: usize, columns: &[usize]) -> Vec<f32> {
    let runs = k.div_ceil(K_RUN);
    if runs == 0 {
        return vec![0.0; columns.len()];
    }
    // [K_RUN][runs]: term t of each run, None past a short last run's end
    let mut order = vec![None; K_RUN * runs];
    for run in 0..runs {
        for (t, kk) in run_order(run * K_RUN, ((run + 1) * K_RUN).min(k), true).enumerate() {
            order[t * runs + run] = Some(kk);
        }
    }
    let mut acc = vec![0f32; runs];
    columns
        .iter()
        .map(|&j| {
            acc.fill(0.0);
            for terms in order.chunks_exact(runs) {
                for (acc, kk) in acc.iter_mut().zip(terms) {
                    if let Some(kk) = *kk {
                        *acc = x[kk].mul_add(widen(w[position(j, kk, k, true)]), *acc);
                    }
                }
            }
            acc[1..].iter().fold(acc[0], |total, &run| total + run)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::panels::pack_bf16;
    use crate::test_values::values;

    fn bf16_bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
    }

    /// Every candidate's value is the exact product's, bit for bit; every other column is
    /// below the exact maximum and NEG_INFINITY; the winner (first of the largest) is the
    /// exact product's, with masked columns left out: shapes with and without whole runs and
    /// panels, odd k, rows with near ties planted.
    #[test]
    fn the_winner_and_its_rivals_are_the_exact_products() {
        let isa = Isa::selected();
        if !argmax_available(isa) {
            eprintln!("no bf16 pair body here: nothing to test");
            return;
        }
        let mut bounded = 0;
        for (m, n, k) in [(1, 37, 64), (3, 200, 130), (5, 1000, 768), (16, 513, 127), (2, 16, 1)] {
            let weights = values(n * k, (n * k) as u64);
            let packed = pack_bf16(&bf16_bits(&weights), n, k);
            let norms = ColumnNorms::of(&packed, n, k);
            let mut x = values(m * k, (m + k) as u64);
            // Row 1 (where there is one): a copy of column 3's weights, so that column 3 wins
            // by a wide margin; others random, where the winners' margins are small.
            if m > 1 {
                for kk in 0..k {
                    x[k + kk] = weights[3 * k + kk] * 4.0;
                }
            }
            let exact = matmul(&x, m, k, Packed::Bf16(&packed), n, isa, Products::Exact);
            let masks: Vec<Vec<usize>> = (0..m).map(|r| if r % 2 == 0 { vec![] } else { vec![3, 5] }).collect();
            let masked: Vec<&[usize]> = masks.iter().map(|v| v.as_slice()).collect();
            let got = argmax_logits(&x, m, k, &packed, n, &norms, &masked, isa);
            for row in 0..m {
                let (got, exact) = (&got[row * n..(row + 1) * n], &exact[row * n..(row + 1) * n]);
                let open = |j: &usize| !masks[row].contains(j);
                let winner = (0..n).filter(open).fold(None, |best: Option<usize>, j| match best {
                    Some(b) if exact[b] >= exact[j] => Some(b),
                    _ => Some(j),
                });
                let winner = winner.expect("an open column");
                let ours = (0..n).fold(0, |b, j| if got[j] > got[b] { j } else { b });
                if (0..n).filter(open).any(|j| got[j] == f32::NEG_INFINITY) {
                    bounded += 1;
                }
                assert_eq!(ours, winner, "[{m}, {n}, {k}] row {row}");
                for j in 0..n {
                    if got[j] == f32::NEG_INFINITY {
                        assert!(!open(&j) || exact[j] < exact[winner], "[{m}, {n}, {k}] row {row}: column {j} dropped");
                    } else {
                        assert_eq!(got[j].to_bits(), exact[j].to_bits(), "[{m}, {n}, {k}] row {row} column {j}");
                        assert!(open(&j), "masked column {j} kept");
                    }
                }
            }
        }
        assert!(bounded >= 10, "only {bounded} rows took the bound");
    }

    /// A row whose activations are not all finite gets every column of the exact product.
    #[test]
    fn a_row_without_a_bound_is_exact_whole() {
        let isa = Isa::selected();
        if !argmax_available(isa) {
            return;
        }
        let (m, n, k) = (2, 40, 70);
        let packed = pack_bf16(&bf16_bits(&values(n * k, 7)), n, k);
        let norms = ColumnNorms::of(&packed, n, k);
        let mut x = values(m * k, 8);
        x[k + 5] = f32::INFINITY;
        let exact = matmul(&x, m, k, Packed::Bf16(&packed), n, isa, Products::Exact);
        let got = argmax_logits(&x, m, k, &packed, n, &norms, &[&[], &[]], isa);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[n..]), bits(&exact[n..]));
        assert!(got[..n].iter().filter(|v| v.is_finite()).count() < n, "row 0 took the bound");
    }
}
