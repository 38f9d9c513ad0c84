//! Per-row RMSNorm and RoPE, as candle's CPU ops (`candle_nn::ops::rms_norm`,
//! `candle_nn::rotary_emb::rope`) compute them, bit for bit: the same operations on each element
//! in the same order, with no fused multiply-adds.
//!
//! candle sums a row's squares as one chain of dependent additions, a few cycles each: 768 of
//! them per row of the 100M shape. Here eight rows' chains run side by side, each still in its
//! own row's order, so the sums, and every result, are candle's.

/// Rows summed side by side.
const ROWS_TOGETHER: usize = 8;

/// `x` (rows of `width`) RMS-normed into `out`: `x / sqrt(mean(x^2) + eps) * scale`, per row.
pub fn rms_norm_rows(x: &[f32], width: usize, scale: &[f32], eps: f32, out: &mut [f32]) {
    assert!(width > 0 && x.len() % width == 0 && out.len() == x.len() && scale.len() == width, "rows of {width} with a scale of {}", scale.len());
    for (x, out) in x.chunks(ROWS_TOGETHER * width).zip(out.chunks_mut(ROWS_TOGETHER * width)) {
        let rows = x.len() / width;
        let mut sums = [0f32; ROWS_TOGETHER];
        // one slice per row, of a length the compiler knows, so that the loop has no bounds checks
        let row: [&[f32]; ROWS_TOGETHER] = std::array::from_fn(|r| if r < rows { &x[r * width..(r + 1) * width] } else { &x[..width] });
        for d in 0..width {
            for (sum, row) in sums.iter_mut().zip(&row) {
                let v = row[d];
                *sum += v * v;
            }
        }
        for ((x, out), sum) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)).zip(sums) {
            let m = (sum / width as f32 + eps).sqrt();
            for ((o, &v), &s) in out.iter_mut().zip(x).zip(scale) {
                *o = v / m * s;
            }
        }
    }
}

/// RoPE in place on every head of `x` (heads of `head_dim`): the first `rotary_dim` dims of
/// each rotated by the angles whose cosines and sines are `cos` and `sin` (`rotary_dim / 2`
/// each; dims i and i + rotary_dim / 2 form a pair), the rest passed through.
pub fn rope_heads(x: &mut [f32], head_dim: usize, rotary_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = rotary_dim / 2;
    assert!(rotary_dim <= head_dim && cos.len() == half && sin.len() == half && x.len() % head_dim == 0, "RoPE of {rotary_dim} of heads of {head_dim}");
    for head in x.chunks_exact_mut(head_dim) {
        let (first, second) = head[..2 * half].split_at_mut(half);
        for (((a, b), &c), &s) in first.iter_mut().zip(second).zip(cos).zip(sin) {
            let (x1, x2) = (*a, *b);
            *a = x1 * c - x2 * s;
            *b = x1 * s + x2 * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows side by side give each row's result alone, in its plain order (any number of rows,
    /// a last group of fewer than eight).
    #[test]
    fn rows_side_by_side_equal_one_row_at_a_time() {
        let width = 40;
        let x: Vec<f32> = (0..11 * width).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let scale: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 / 64.0).collect();
        let mut together = vec![0f32; x.len()];
        rms_norm_rows(&x, width, &scale, 1e-5, &mut together);
        for (row, got) in x.chunks_exact(width).zip(together.chunks_exact(width)) {
            let sum = row.iter().map(|v| v * v).sum::<f32>();
            let m = (sum / width as f32 + 1e-5).sqrt();
            let alone: Vec<f32> = row.iter().zip(&scale).map(|(v, s)| v / m * s).collect();
            assert_eq!(got, &alone[..]);
        }
    }

    /// RoPE rotates the pairs (i, i + rotary_dim / 2) of each head and passes the rest through.
    #[test]
    fn rope_rotates_the_pairs_and_passes_the_rest() {
        let (head_dim, rotary_dim) = (6, 4);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, -1.0, 2.0, 0.0, 7.0, 8.0];
        let (cos, sin) = ([0.0, 1.0], [1.0, 0.0]);
        rope_heads(&mut x, head_dim, rotary_dim, &cos, &sin);
        // pair (0, 2) turned a quarter (cos 0, sin 1), pair (1, 3) not at all; dims 4 and 5 kept
        assert_eq!(x, [-3.0, 2.0, 1.0, 4.0, 5.0, 6.0, -2.0, -1.0, 0.5, 0.0, 7.0, 8.0]);
    }
}
