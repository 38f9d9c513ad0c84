//! Integer dot products of K-quant weight rows (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) with 8-bit
//! activations.
//!
//! As llama.cpp's `ggml_vec_dot_q*_K_q8_K`, each activation row is quantized per 256-value
//! block to one f32 scale and 256 signed bytes, with the sums of its sixteen 16-value groups
//! (`bsums`, [`quantize_act_k`]). A weight block is `d * sc_j * q - dmin * m_j` for its eight
//! 32-value sub-blocks (Q4_K: 4-bit q; Q5_K: 5-bit q; both with 6-bit `sc_j`, `m_j`), or for its
//! sixteen 16-value groups `d * sc_g * q - dmin * m_g` (Q2_K: 2-bit q, 4-bit `sc_g`, `m_g`) or
//! `d * s_g * (q - o)` (Q3_K: 3-bit q, o = 4, signed 6-bit `s_g`; Q6_K: 6-bit q, o = 32, signed
//! 8-bit `s_g`), so a block's product is integer sums scaled by one or two floats:
//!
//! - Q2_K, Q4_K, Q5_K: `d_w d_x sum(sc q x) - dmin_w d_x sum(m bsum)`
//! - Q3_K, Q6_K:       `d_w d_x (sum(s_g q x) - o sum(s_g bsum_g))`
//!
//! The integer sums are kept in eight i32 lanes, the lanes of a 256-bit register on AVX2, and
//! the lanes are defined once for every path ([`block_lanes`]): lane `l` holds the products of
//! bytes `4l..4l+4` of every 32-value chunk (times their scale), which is what `vpmaddubsw`
//! followed by `vpmaddwd` against the chunk's scales leaves there; the offset lanes `M` hold, in
//! lane `j`, the sums of the 16-value groups `2j` and `2j+1` (times their mins or scales), which
//! is what `vpmaddwd` of the sixteen `bsums` leaves there. Integer sums are exact in any order,
//! so per block and lane each path does the same float operations in the same order:
//!
//! ```text
//! acc[l] = acc[l] + Q[l] * (d_w * d_x)           (Q3_K, Q6_K: Q[l] - o M[l])
//! acc[l] = acc[l] - M[l] * (dmin_w * d_x)        (Q2_K, Q4_K, Q5_K)
//! result = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
//! ```
//!
//! (separate multiplies and adds, not fused: Rust never contracts them, and the portable path,
//! compiled without FMA, would otherwise call libm's `fmaf` sixteen times a block).
//!
//! Every SIMD path therefore equals [`dot_portable`] bit for bit, and since each activation row
//! has its own accumulators, a row's result does not depend on the batch it is in. The batched
//! SIMD body unpacks a weight block once for up to four activation rows.

use super::formats::Format;
use super::kernels::Path;

/// Values per K-quant block.
pub const QK_K: usize = 256;

/// The K-quant formats with kernels here (all five).
pub fn has_kernel(dtype: Format) -> bool {
    matches!(dtype, Format::Q2K | Format::Q3K | Format::Q4K | Format::Q5K | Format::Q6K)
}

/// One row of activations quantized per 256 values: a scale per block, the bytes, and the
/// sums of each block's sixteen 16-value groups.
pub struct ActQ8K {
    pub d: Vec<f32>,
    pub qs: Vec<i8>,
    pub bsums: Vec<i16>,
}

/// Q8_K quantization of `x` (a multiple of 256 values), as GGML's `quantize_row_q8_K` and
/// candle's `BlockQ8K::from_float` do it: the value of largest magnitude maps to -127.
pub fn quantize_act_k(x: &[f32]) -> ActQ8K {
    assert!(x.len().is_multiple_of(QK_K), "{} values are not whole 256-value blocks", x.len());
    let blocks = x.len() / QK_K;
    let mut act = ActQ8K { d: vec![0.0; blocks], qs: vec![0; x.len()], bsums: vec![0; blocks * 16] };
    for (b, values) in x.chunks_exact(QK_K).enumerate() {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in values {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            continue;
        }
        let iscale = -127.0 / max;
        let qs = &mut act.qs[b * QK_K..(b + 1) * QK_K];
        for (q, v) in qs.iter_mut().zip(values) {
            *q = round_to_i8(iscale * v);
        }
        for (g, sum) in act.bsums[b * 16..(b + 1) * 16].iter_mut().enumerate() {
            *sum = qs[16 * g..16 * (g + 1)].iter().map(|&q| q as i16).sum();
        }
        act.d[b] = 1.0 / iscale;
    }
    act
}

/// `v.round().clamp(-128.0, 127.0) as i8` (half away from zero) without a call: `f32::round`
/// is libm's `roundf` on x86-64's baseline, a call per activation value. Clamping first gives
/// the same integer (the bounds are integers), `v - trunc(v)` is exact, and NaN becomes 0 as
/// before.
#[inline(always)]
pub(super) fn round_to_i8(v: f32) -> i8 {
    let v = v.clamp(-128.0, 127.0);
    let t = v as i32;
    let frac = v - t as f32;
    (t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32) as i8
}

/// Bytes of a block of format `f`.
const fn block_bytes(f: u8) -> usize {
    match f {
        Q2K => 84,
        Q3K => 110,
        Q4K => 144,
        Q5K => 176,
        _ => 210,
    }
}

const Q2K: u8 = 0;
const Q3K: u8 = 1;
const Q4K: u8 = 2;
const Q5K: u8 = 3;
const Q6K: u8 = 4;

/// The formats whose blocks have a `dmin` (a second float scale, for the mins).
const fn has_mins(f: u8) -> bool {
    matches!(f, Q2K | Q4K | Q5K)
}

fn format_of(dtype: Format) -> u8 {
    match dtype {
        Format::Q2K => Q2K,
        Format::Q3K => Q3K,
        Format::Q4K => Q4K,
        Format::Q5K => Q5K,
        Format::Q6K => Q6K,
        other => panic!("{other:?} has no K-quant kernel here (see has_kernel)"),
    }
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 scale bytes of a Q4_K / Q5_K
/// block (GGML's `get_scale_min_k4`, four at a time), each as eight bytes of a little-endian u64.
#[inline(always)]
fn scales_mins(s: &[u8; 12]) -> (u64, u64) {
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    // sub-blocks 0..4: the low six bits of bytes 0..4 (scales) and 4..8 (mins); sub-blocks
    // 4..8: the nibbles of bytes 8..12 with the top two bits of bytes 0..4 / 4..8 above them.
    let scales_lo = u0 & 0x3f3f_3f3f;
    let scales_hi = (u2 & 0x0f0f_0f0f) | ((u0 >> 6) & 0x0303_0303) << 4;
    let mins_lo = u1 & 0x3f3f_3f3f;
    let mins_hi = ((u2 >> 4) & 0x0f0f_0f0f) | ((u1 >> 6) & 0x0303_0303) << 4;
    (scales_lo as u64 | (scales_hi as u64) << 32, mins_lo as u64 | (mins_hi as u64) << 32)
}

/// The sixteen 6-bit scales packed in the 12 scale bytes of a Q3_K block (GGML's `kmask`
/// unpacking), as the bytes of four little-endian words: byte g is group g's scale plus 32.
#[inline(always)]
fn q3_scales(s: &[u8; 12]) -> [u32; 4] {
    let a0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let a1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let a2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    // groups 0..8: the low nibbles of bytes 0..8, groups 8..16 their high nibbles; the top two
    // bits of each from bytes 8..12 (pairs of bits 0-1, 2-3, 4-5, 6-7 for the four quarters)
    [
        (a0 & 0x0f0f_0f0f) | (a2 & 0x0303_0303) << 4,
        (a1 & 0x0f0f_0f0f) | ((a2 >> 2) & 0x0303_0303) << 4,
        ((a0 >> 4) & 0x0f0f_0f0f) | ((a2 >> 4) & 0x0303_0303) << 4,
        ((a1 >> 4) & 0x0f0f_0f0f) | ((a2 >> 6) & 0x0303_0303) << 4,
    ]
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The integer lanes of one weight block against one activation block (see the module
/// documentation): `(Q, M)`, with Q3_K's and Q6_K's offsets already in `Q` (`M` zero), and
/// the block's `d`, `dmin` (0 for Q3_K, Q6_K).
fn block_lanes(f: u8, blk: &[u8], x: &[i8], bsums: &[i16]) -> ([i32; 8], [i32; 8], f32, f32) {
    let mut q = [0i32; 8];
    let mut m = [0i32; 8];
    match f {
        Q4K | Q5K => {
            let (sc, mn) = scales_mins(blk[4..16].try_into().expect("12 scale bytes"));
            let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
            let qs = if f == Q4K { &blk[16..144] } else { &blk[48..176] };
            let qh = &blk[16..48];
            for c in 0..8 {
                // chunk c: the low (c even) or high nibbles of qs[32(c / 2)..], 5th bit c of qh
                let (qs, shift, x) = (&qs[32 * (c / 2)..32 * (c / 2) + 32], 4 * (c % 2), &x[32 * c..32 * c + 32]);
                for (l, lane) in q.iter_mut().enumerate() {
                    let mut sum = 0i32;
                    for t in 4 * l..4 * l + 4 {
                        let mut value = (qs[t] >> shift) as i32 & 15;
                        if f == Q5K {
                            value |= ((qh[t] >> c) as i32 & 1) << 4;
                        }
                        sum += value * x[t] as i32;
                    }
                    *lane += sc[c] as i32 * sum;
                }
            }
            for j in 0..8 {
                m[j] = mn[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
            }
            (q, m, f16_at(blk, 0), f16_at(blk, 2))
        }
        Q2K | Q3K => {
            // chunk c = 4n + j: bits 2j, 2j + 1 of qs[32n + i] (Q3_K: and bit c of hmask[i] as
            // the third); groups 2c (lanes 0..4) and 2c + 1 (lanes 4..8)
            let (qs, hmask) = if f == Q2K { (&blk[16..80], &blk[0..0]) } else { (&blk[32..96], &blk[0..32]) };
            let scales: [i32; 16] = if f == Q2K {
                std::array::from_fn(|g| (blk[g] & 15) as i32)
            } else {
                let words = q3_scales(blk[96..108].try_into().expect("12 scale bytes"));
                std::array::from_fn(|g| (words[g / 4] >> (8 * (g % 4))) as u8 as i32 - 32)
            };
            for c in 0..8 {
                let (n, j) = (c / 4, c % 4);
                let (qs, x) = (&qs[32 * n..32 * n + 32], &x[32 * c..32 * c + 32]);
                for (l, lane) in q.iter_mut().enumerate() {
                    let mut sum = 0i32;
                    for i in 4 * l..4 * l + 4 {
                        let mut value = (qs[i] >> (2 * j)) as i32 & 3;
                        if f == Q3K {
                            value |= ((hmask[i] >> c) as i32 & 1) << 2;
                        }
                        sum += value * x[i] as i32;
                    }
                    *lane += scales[2 * c + l / 4] * sum;
                }
            }
            for j in 0..8 {
                let (b0, b1) = (bsums[2 * j] as i32, bsums[2 * j + 1] as i32);
                if f == Q2K {
                    m[j] = (blk[2 * j] >> 4) as i32 * b0 + (blk[2 * j + 1] >> 4) as i32 * b1;
                } else {
                    q[j] -= 4 * (scales[2 * j] * b0 + scales[2 * j + 1] * b1);
                }
            }
            if f == Q2K { (q, m, f16_at(blk, 80), f16_at(blk, 82)) } else { (q, m, f16_at(blk, 108), 0.0) }
        }
        _ => {
            let (ql, qh, s) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            let s = |g: usize| s[g] as i8 as i32;
            for h in 0..2 {
                for t in 0..4 {
                    // chunk 4h + t, values 128h + 32t + i: low bits from ql[64h + 32(t % 2) + i]
                    // (low nibbles for t < 2), high bits 2t, 2t + 1 of qh[32h + i]; scales of
                    // groups 8h + 2t (lanes 0..4) and 8h + 2t + 1 (lanes 4..8)
                    let ql = &ql[64 * h + 32 * (t % 2)..64 * h + 32 * (t % 2) + 32];
                    let (qh, x) = (&qh[32 * h..32 * h + 32], &x[128 * h + 32 * t..128 * h + 32 * t + 32]);
                    let shift = if t < 2 { 0 } else { 4 };
                    for (l, lane) in q.iter_mut().enumerate() {
                        let mut sum = 0i32;
                        for i in 4 * l..4 * l + 4 {
                            let value = ((ql[i] >> shift) & 15 | ((qh[i] >> (2 * t)) & 3) << 4) as i32;
                            sum += value * x[i] as i32;
                        }
                        *lane += s(8 * h + 2 * t + l / 4) * sum;
                    }
                }
            }
            for j in 0..8 {
                q[j] -= 32 * (s(2 * j) * bsums[2 * j] as i32 + s(2 * j + 1) * bsums[2 * j + 1] as i32);
            }
            (q, m, f16_at(blk, 208), 0.0)
        }
    }
}

/// The eight accumulators summed in the order of the SIMD paths' horizontal sum.
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Scalar reference of one weight row of `dtype` (a K-quant) against one activation row.
pub fn dot_portable(dtype: Format, row: &[u8], act: &ActQ8K) -> f32 {
    let f = format_of(dtype);
    let ts = block_bytes(f);
    assert_eq!(row.len(), act.d.len() * ts, "a weight row of {dtype:?} against {} activation blocks", act.d.len());
    let mut acc = [0f32; 8];
    for (b, blk) in row.chunks_exact(ts).enumerate() {
        let x = &act.qs[b * QK_K..(b + 1) * QK_K];
        let (q, m, d, dmin) = block_lanes(f, blk, x, &act.bsums[b * 16..(b + 1) * 16]);
        let (dq, dm) = (d * act.d[b], dmin * act.d[b]);
        for l in 0..8 {
            acc[l] += q[l] as f32 * dq;
            if has_mins(f) {
                acc[l] -= m[l] as f32 * dm;
            }
        }
    }
    hsum(acc)
}

/// `out[r * m + i]` = weight row r of `w_rows` (rows of `rb` bytes of `dtype`) dotted with
/// activation row i (`m = acts.len()`): the one place a path is taken for these formats. The
/// SIMD path unpacks each weight block once for up to four activation rows.
pub fn rows(out: &mut [f32], w_rows: &[u8], rb: usize, acts: &[ActQ8K], dtype: Format, path: Path) {
    let m = acts.len();
    let f = format_of(dtype);
    let blocks = rb / block_bytes(f);
    assert_eq!(rb, blocks * block_bytes(f), "{rb} bytes are not whole {dtype:?} blocks");
    assert!(acts.iter().all(|a| a.d.len() == blocks && a.qs.len() == blocks * QK_K && a.bsums.len() == blocks * 16));
    if m == 0 || rb == 0 {
        // no products, or empty ones (k = 0)
        out.fill(0.0);
        return;
    }
    assert!(w_rows.len().is_multiple_of(rb) && out.len() == w_rows.len() / rb * m);
    match path {
        Path::Portable => {
            for (row, out) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                for (o, act) in out.iter_mut().zip(acts) {
                    *o = dot_portable(dtype, row, act);
                }
            }
        }
        // The VNNI path runs the AVX2 body: `vpdpbusd` would replace only the
        // `vpmaddubsw` + `vpmaddwd` pairs, and the CPU this was written on has no AVX-512 to
        // test a VNNI body on. The integer lanes, hence the results, would be the same.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `kernels::matmul` asserted the CPU has this path, which includes AVX2, FMA
        // and F16C; every weight row holds `blocks` whole blocks of `dtype`, every activation
        // row `blocks` blocks, and `out` m values a weight row (asserted above).
        Path::Avx2 | Path::Avx512Vnni => unsafe { x86::rows_avx2(f, w_rows, rb, blocks, acts, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => {
            for (row, out) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                for (o, act) in out.iter_mut().zip(acts) {
                    *o = dot_portable(dtype, row, act);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{ActQ8K, Q2K, Q3K, Q4K, Q5K, Q6K, QK_K, block_bytes, q3_scales, scales_mins};

    /// An f16 at `p` (unaligned), widened.
    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller passes a pointer to two readable bytes; F16C is enabled by every
        // caller's target features.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32))) }
    }

    /// Weight rows (`rb` bytes each, `blocks` blocks of format `f`) against every activation
    /// row: `out[r * m + i]`, four activation rows at a time, then the one to three left.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `rb == blocks * block_bytes(f)`; every activation row
    /// holds `blocks` blocks (`d`, `qs`, `bsums`); `out` holds `acts.len()` values a weight row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_avx2(f: u8, w_rows: &[u8], rb: usize, blocks: usize, acts: &[ActQ8K], out: &mut [f32]) {
        // SAFETY: forwarded contract.
        unsafe {
            match f {
                Q2K => rows_of::<Q2K>(w_rows, rb, blocks, acts, out),
                Q3K => rows_of::<Q3K>(w_rows, rb, blocks, acts, out),
                Q4K => rows_of::<Q4K>(w_rows, rb, blocks, acts, out),
                Q5K => rows_of::<Q5K>(w_rows, rb, blocks, acts, out),
                _ => rows_of::<Q6K>(w_rows, rb, blocks, acts, out),
            }
        }
    }

    /// [`rows_avx2`] for format `F`. Four activation rows at a time go over all the task's
    /// weight rows, so that both stay in L1/L2 for the pass: weight row by weight row over every
    /// activation row, a prompt's activations (600 KB for 512 rows of 1,024) streamed from L3
    /// once per weight row, which made Q2_K and Q3_K prefill two thirds of llama.cpp's.
    ///
    /// # Safety
    /// As [`rows_avx2`].
    #[inline(always)]
    unsafe fn rows_of<const F: u8>(w_rows: &[u8], rb: usize, blocks: usize, acts: &[ActQ8K], out: &mut [f32]) {
        let m = acts.len();
        let mut done = 0;
        // SAFETY (whole loop): forwarded contract; each call passes exactly its number of
        // rows, all below m.
        unsafe {
            while done + 4 <= m {
                let four = [&acts[done], &acts[done + 1], &acts[done + 2], &acts[done + 3]];
                for (row, out) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                    out[done..done + 4].copy_from_slice(&body::<F, 4>(row.as_ptr(), blocks, four));
                }
                done += 4;
            }
            for (row, out) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                let p = row.as_ptr();
                match m - done {
                    1 => out[done] = body::<F, 1>(p, blocks, [&acts[done]])[0],
                    2 => out[done..].copy_from_slice(&body::<F, 2>(p, blocks, [&acts[done], &acts[done + 1]])),
                    3 => out[done..].copy_from_slice(&body::<F, 3>(p, blocks, [&acts[done], &acts[done + 1], &acts[done + 2]])),
                    _ => {}
                }
            }
        }
    }

    /// 32 bytes, `value` where bit `c` of the byte is set, else 0.
    #[inline(always)]
    unsafe fn bit_to(qh: __m256i, c: usize, value: i8) -> __m256i {
        // SAFETY: AVX2 is enabled by every caller.
        unsafe {
            let mask = _mm256_set1_epi8((1u8 << c) as i8);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mask), mask), _mm256_set1_epi8(value))
        }
    }

    /// The 2-bit fields `2j, 2j + 1` of 32 bytes (`j` below 4).
    #[inline(always)]
    unsafe fn two_bits(q: __m256i, j: usize) -> __m256i {
        // SAFETY: AVX2 is enabled by every caller.
        unsafe { _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), _mm256_set1_epi8(3)) }
    }

    /// The shuffle that spreads i16 `i` (in each 128-bit half of a register) over that half's
    /// eight i16: `lo` for the low half, `hi` for the high one.
    #[inline(always)]
    unsafe fn pick_i16(lo: usize, hi: usize) -> __m256i {
        // SAFETY: AVX is enabled by every caller.
        unsafe {
            let at = |i: usize| ((2 * i + 1) << 8 | 2 * i) as i16;
            _mm256_set_m128i(_mm_set1_epi16(at(hi)), _mm_set1_epi16(at(lo)))
        }
    }

    /// The lanes of `w` (32 unsigned weight values, each below 64) times `x` (32 signed bytes),
    /// four adjacent products a lane, times the i16 `scale` of the lane: `vpmaddubsw` (a pair is
    /// at most 2 * 63 * 128 in magnitude, no i16 saturation) then `vpmaddwd`.
    #[inline(always)]
    unsafe fn scaled_dot(w: __m256i, x: *const i8, scale: __m256i) -> __m256i {
        // SAFETY: the caller passes 32 readable bytes at `x`; AVX2 is enabled by every caller.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256(x.cast())), scale) }
    }

    /// `R` activation rows against one weight row, each with its own eight accumulators (the
    /// lanes of [`super::dot_portable`]), each weight block unpacked once for all `R`.
    ///
    /// # Safety
    /// As [`rows_avx2`], for one weight row at `row` and `R` activation rows.
    #[inline(always)]
    unsafe fn body<const F: u8, const R: usize>(row: *const u8, blocks: usize, acts: [&ActQ8K; R]) -> [f32; R] {
        let ts = block_bytes(F);
        // SAFETY (whole block): AVX2, FMA and F16C are enabled by every caller; block b < blocks
        // is in bounds of the row, and activation bytes b * 256 + 256, sums b * 16 + 16 and
        // scale b of every row (the caller's contract); every load is unaligned.
        unsafe {
            let low4 = _mm256_set1_epi8(0x0F);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let blk = row.add(b * ts);
                let x = acts.map(|a| a.qs.as_ptr().add(b * QK_K));
                let mut q = [_mm256_setzero_si256(); R];
                if F == Q4K || F == Q5K {
                    let (sc, mn) = scales_mins(&blk.add(4).cast::<[u8; 12]>().read_unaligned());
                    // the eight scales as i16 in both halves; the mins as i16, each twice
                    let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
                    let mins = _mm_cvtsi64_si128(mn as i64);
                    let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
                    let qs = blk.add(if F == Q4K { 16 } else { 48 });
                    let qh = if F == Q5K { _mm256_loadu_si256(blk.add(16).cast()) } else { _mm256_setzero_si256() };
                    for p in 0..4 {
                        // chunks 2p (low nibbles) and 2p + 1 (high nibbles)
                        let bytes = _mm256_loadu_si256(qs.add(32 * p).cast());
                        let mut lo = _mm256_and_si256(bytes, low4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                        if F == Q5K {
                            lo = _mm256_or_si256(lo, bit_to(qh, 2 * p, 0x10));
                            hi = _mm256_or_si256(hi, bit_to(qh, 2 * p + 1, 0x10));
                        }
                        let s_lo = _mm256_shuffle_epi8(scales, pick_i16(2 * p, 2 * p));
                        let s_hi = _mm256_shuffle_epi8(scales, pick_i16(2 * p + 1, 2 * p + 1));
                        for r in 0..R {
                            let both = _mm256_add_epi32(scaled_dot(lo, x[r].add(64 * p), s_lo), scaled_dot(hi, x[r].add(64 * p + 32), s_hi));
                            q[r] = _mm256_add_epi32(q[r], both);
                        }
                    }
                    let (d, dmin) = (f16_at(blk), f16_at(blk.add(2)));
                    for r in 0..R {
                        let bsums = _mm256_loadu_si256(acts[r].bsums.as_ptr().add(16 * b).cast());
                        let m = _mm256_madd_epi16(bsums, mins);
                        let dx = *acts[r].d.get_unchecked(b);
                        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(q[r]), _mm256_set1_ps(d * dx)));
                        acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * dx)));
                    }
                } else {
                    // Q2_K, Q3_K, Q6_K: sixteen groups of 16 values with a scale each; chunk
                    // 4h + t (values 128h + 32t..) is groups 8h + 2t (lanes 0..4) and 8h + 2t + 1
                    // (lanes 4..8). The sixteen scales as i16 (s0..s7 in the low half, s8..s15 in
                    // the high one), and Q2_K's sixteen mins.
                    let (s16, m16) = match F {
                        Q2K => {
                            let packed = _mm_loadu_si128(blk.cast());
                            let low = _mm_set1_epi8(0x0F);
                            (_mm256_cvtepu8_epi16(_mm_and_si128(packed, low)), _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low)))
                        }
                        Q3K => {
                            let [w0, w1, w2, w3] = q3_scales(&blk.add(96).cast::<[u8; 12]>().read_unaligned());
                            let biased = _mm_setr_epi32(w0 as i32, w1 as i32, w2 as i32, w3 as i32);
                            (_mm256_cvtepi8_epi16(_mm_sub_epi8(biased, _mm_set1_epi8(32))), _mm256_setzero_si256())
                        }
                        _ => (_mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192).cast())), _mm256_setzero_si256()),
                    };
                    let hmask = if F == Q3K { _mm256_loadu_si256(blk.cast()) } else { _mm256_setzero_si256() };
                    for h in 0..2 {
                        let sv = if h == 0 { _mm256_permute2x128_si256(s16, s16, 0x00) } else { _mm256_permute2x128_si256(s16, s16, 0x11) };
                        let w = if F == Q6K {
                            // low bits from ql[64h + 32(t % 2)..] (low nibbles for t < 2), high
                            // bits 2t, 2t + 1 of qh[32h..]
                            let (ql, qh) = (blk, blk.add(128));
                            let l0 = _mm256_loadu_si256(ql.add(64 * h).cast());
                            let l1 = _mm256_loadu_si256(ql.add(64 * h + 32).cast());
                            let hb = _mm256_loadu_si256(qh.add(32 * h).cast());
                            [
                                _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x03)), 4)),
                                _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0C)), 2)),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, _mm256_set1_epi8(0x30))),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                    _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0xC0u8 as i8)), 2),
                                ),
                            ]
                        } else {
                            // bits 2t, 2t + 1 of qs[32h..] (Q3_K: bit 4h + t of hmask as the third)
                            let qs = _mm256_loadu_si256(blk.add(if F == Q2K { 16 } else { 32 } + 32 * h).cast());
                            let mut w = [two_bits(qs, 0), two_bits(qs, 1), two_bits(qs, 2), two_bits(qs, 3)];
                            if F == Q3K {
                                for (t, w) in w.iter_mut().enumerate() {
                                    *w = _mm256_or_si256(*w, bit_to(hmask, 4 * h + t, 0x04));
                                }
                            }
                            w
                        };
                        for (t, w) in w.into_iter().enumerate() {
                            let s = _mm256_shuffle_epi8(sv, pick_i16(2 * t, 2 * t + 1));
                            for r in 0..R {
                                q[r] = _mm256_add_epi32(q[r], scaled_dot(w, x[r].add(128 * h + 32 * t), s));
                            }
                        }
                    }
                    let (d, dmin) = match F {
                        Q2K => (f16_at(blk.add(80)), f16_at(blk.add(82))),
                        Q3K => (f16_at(blk.add(108)), 0.0),
                        _ => (f16_at(blk.add(208)), 0.0),
                    };
                    for r in 0..R {
                        let bsums = _mm256_loadu_si256(acts[r].bsums.as_ptr().add(16 * b).cast());
                        let dx = *acts[r].d.get_unchecked(b);
                        if F == Q2K {
                            let m = _mm256_madd_epi16(bsums, m16);
                            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(q[r]), _mm256_set1_ps(d * dx)));
                            acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * dx)));
                        } else {
                            // the offset (32 or 4) times each group's scale and activation sum
                            let offsets = _mm256_madd_epi16(bsums, s16);
                            let offsets = if F == Q6K { _mm256_slli_epi32(offsets, 5) } else { _mm256_slli_epi32(offsets, 2) };
                            let lanes = _mm256_sub_epi32(q[r], offsets);
                            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d * dx)));
                        }
                    }
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                // ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), as `super::hsum`
                let half = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
                let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
                out[r] = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::k_quants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, GgmlType};

    use super::super::formats::{dequantize, row_bytes, with_blocks};
    use super::super::kernels::matmul;
    use super::*;
    use crate::test_values::{assert_within_activation_rounding, blocks, values};

    const FORMATS: [Format; 5] = [Format::Q2K, Format::Q3K, Format::Q4K, Format::Q5K, Format::Q6K];

    fn paths() -> Vec<Path> {
        Path::ALL.into_iter().filter(|p| p.available()).collect()
    }

    /// Every format on every path this CPU has, several 256-blocks and odd n (not a multiple of
    /// 4 nor of the 32-row task), against an f32 product of the dequantized weights and the
    /// unquantized activations. Tolerance: the activations' rounding is at most half a step
    /// (amax / 254) a value, so its error is at most |w| * sqrt(k) * amax / 254, within
    /// 0.01 |w| |x| for these inputs (uniform in [-1, 1): |x| is about sqrt(k / 3) amax).
    #[test]
    fn every_format_matches_the_dequantized_product_on_every_path() {
        let mut ran = Vec::new();
        for path in paths() {
            ran.push(path);
            for dtype in FORMATS {
                for &(m, k, n) in &[(1, 256, 1), (1, 512, 37), (3, 768, 65), (9, 1280, 33), (5, 2048, 13), (16, 256, 70)] {
                    let bytes = blocks(dtype, n, k, (m * k + n) as u64);
                    let mut wd = vec![0f32; n * k];
                    dequantize(dtype, &bytes, &mut wd);
                    let x = values(m * k, 99 + k as u64);
                    let got = matmul(&x, m, k, dtype, &bytes, n, path);
                    for i in 0..m {
                        let xi = &x[i * k..(i + 1) * k];
                        for j in 0..n {
                            let at = format!("{path:?} {dtype:?} m{m} k{k} n{n} [{i},{j}]");
                            assert_within_activation_rounding(got[i * n + j], &wd[j * k..(j + 1) * k], xi, &at);
                        }
                    }
                }
            }
        }
        assert!(ran.contains(&Path::Portable));
        eprintln!("K-quant kernel paths tested on this CPU: {ran:?}");
    }

    /// Every SIMD path equals the portable reference bit for bit, on every format, for batches
    /// of 1 to 9 rows; and every row of a batch equals that row multiplied alone, bit for bit.
    #[test]
    fn paths_and_batches_agree_bitwise() {
        for dtype in FORMATS {
            let (k, n) = (768, 37);
            let bytes = blocks(dtype, n, k, 11);
            for m in 1..=9 {
                let x = values(m * k, 20 + m as u64);
                let reference = matmul(&x, m, k, dtype, &bytes, n, Path::Portable);
                for path in paths() {
                    let got = matmul(&x, m, k, dtype, &bytes, n, path);
                    for i in 0..m {
                        let alone = matmul(&x[i * k..(i + 1) * k], 1, k, dtype, &bytes, n, path);
                        for j in 0..n {
                            let (g, want) = (got[i * n + j], reference[i * n + j]);
                            assert_eq!(g.to_bits(), want.to_bits(), "{path:?} {dtype:?} m{m} [{i},{j}]: {g} vs portable {want}");
                            assert_eq!(g.to_bits(), alone[j].to_bits(), "{path:?} {dtype:?} m{m} [{i},{j}]: batch {g} vs alone {}", alone[j]);
                        }
                    }
                }
            }
        }
    }

    /// The integer formulas and the activation quantization agree with candle's scalar
    /// `vec_dot_unopt` against its own Q8_K activations, to float rounding (the sums differ only
    /// in the order of float operations).
    #[test]
    fn the_reference_agrees_with_candles_scalar_dot_products() {
        fn candle<T: GgmlType<VecDotType = BlockQ8K>>(row: &[u8], x: &[f32]) -> f32 {
            let mut act: Vec<BlockQ8K> = (0..x.len() / QK_K).map(|_| BlockQ8K::zeros()).collect();
            BlockQ8K::from_float(x, &mut act);
            with_blocks::<T, _>(row, |blocks| T::vec_dot_unopt(x.len(), blocks, &act))
        }
        for dtype in FORMATS {
            let (k, n) = (1024, 9);
            let bytes = blocks(dtype, n, k, 3);
            let rb = row_bytes(dtype, k);
            let x = values(k, 4);
            let act = quantize_act_k(&x);
            for j in 0..n {
                let row = &bytes[j * rb..(j + 1) * rb];
                let ours = dot_portable(dtype, row, &act);
                let theirs = match dtype {
                    Format::Q2K => candle::<BlockQ2K>(row, &x),
                    Format::Q3K => candle::<BlockQ3K>(row, &x),
                    Format::Q4K => candle::<BlockQ4K>(row, &x),
                    Format::Q5K => candle::<BlockQ5K>(row, &x),
                    _ => candle::<BlockQ6K>(row, &x),
                };
                assert!((ours - theirs).abs() <= 1e-5 * (1.0 + theirs.abs()), "{dtype:?} row {j}: {ours} vs candle {theirs}");
            }
        }
    }

    /// The call-free rounding equals `round` then `clamp` on the f32 of magnitude up to 256 (at
    /// a stride of 61 bit patterns, every one near 0.5 and near the clamp), on every half up to
    /// 300 and its two neighbours, and on the special values.
    #[test]
    fn rounding_matches_round_then_clamp() {
        let want = |v: f32| v.round().clamp(-128.0, 127.0) as i8;
        let mut cases = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, 0.0, -0.0, 1e30, -1e30];
        for half in -600..=600 {
            let v = half as f32 / 2.0;
            cases.extend([v, f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits().wrapping_sub(1))]);
        }
        let bits_below_256 = 256f32.to_bits();
        let dense = |v: f32| (0.45..0.55).contains(&v) || (126.5..128.5).contains(&v);
        let stride = |bits: u32| if dense(f32::from_bits(bits)) { 1 } else { 61 };
        let mut bits = 0u32;
        while bits <= bits_below_256 {
            let v = f32::from_bits(bits);
            cases.extend([v, -v]);
            bits += stride(bits);
        }
        for v in cases {
            assert_eq!(round_to_i8(v), want(v), "{v:e} ({:#x})", v.to_bits());
        }
    }

    /// Edge cases: an all-zero activation row gives zeros; extreme activations (a single
    /// large value, so the others round to 0, and values of the largest magnitude in every
    /// position) still match the dequantized product on every path and agree across paths.
    #[test]
    fn zero_and_extreme_activations() {
        for dtype in FORMATS {
            let (k, n) = (512, 6);
            let bytes = blocks(dtype, n, k, 8);
            let mut wd = vec![0f32; n * k];
            dequantize(dtype, &bytes, &mut wd);
            let mut spike = vec![1e-3f32; k];
            spike[300] = -50.0;
            let alternating: Vec<f32> = (0..k).map(|i| if i % 3 == 0 { 1.0 } else { -1.0 }).collect();
            for x in [vec![0f32; k], spike, alternating] {
                let reference = matmul(&x, 1, k, dtype, &bytes, n, Path::Portable);
                let xnorm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
                for path in paths() {
                    let got = matmul(&x, 1, k, dtype, &bytes, n, path);
                    for j in 0..n {
                        assert_eq!(got[j].to_bits(), reference[j].to_bits(), "{path:?} {dtype:?} col {j}");
                        let wrow = &wd[j * k..(j + 1) * k];
                        let exact: f32 = wrow.iter().zip(&x).map(|(a, b)| a * b).sum();
                        let wnorm = wrow.iter().map(|v| v * v).sum::<f32>().sqrt();
                        assert!((got[j] - exact).abs() <= 0.01 * wnorm * xnorm + 1e-4, "{path:?} {dtype:?} col {j}: {} vs {exact}", got[j]);
                    }
                }
            }
        }
    }
}
