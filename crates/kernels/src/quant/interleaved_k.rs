//! The K-quant group-blocks of the interleaved ("x8") layout, Q4_K, Q5_K and Q6_K, and their
//! products with Q8_K activations ([`super::kquant`]).
//!
//! A group-block (block `b` of eight consecutive rows, [`super::interleaved`]) holds each f16
//! field of the eight rows together (16 bytes), then 32-byte chunks whose lane `r` holds four
//! bytes of row r: a 256-bit register holds four bytes of each of the eight rows, and four
//! activation bytes broadcast to every lane yield the eight rows' partial sums lane by lane. A
//! group-block has exactly the bytes of its eight blocks.
//!
//! | format | block | f16 fields, x8 | chunks |
//! |--------|-------|----------------|--------|
//! | Q4_K   | 144   | d, dmin (32)   | 3 of packed 6-bit scales and mins, 32 of nibbles (GGML's words in order) |
//! | Q5_K   | 176   | d, dmin (32)   | as Q4_K, with 8 of 5th bits (`qh`) before the nibbles |
//! | Q6_K   | 210   | d (16)         | 4 of i8 scales, 48 of 6-bit values |
//!
//! Q4_K: with scale chunks `0..3`, GGML's unpacking (`get_scale_min_k4`) runs on the eight rows
//! at once, lane by lane, leaving each row's eight scales and eight mins as bytes of its lanes.
//! Value chunk `v = 8p + u` holds the low nibbles of values `4u..4u+4` of sub-block `2p` and in
//! its high nibbles the same values of sub-block `2p + 1`. Per block and lane the product is
//! `Q = sum_j sc_j isum_j` (`isum_j`: sub-block j's 32 integer products) and `M = sum_j m_j bs_j`
//! (`bs_j`: the activation sum of sub-block j), then `acc = acc + Q * (d_w * d_x)` and
//! `acc = acc - M * (dmin_w * d_x)`. Q5_K adds a 5th bit to each value: bit `j` of byte `l` of
//! `qh` for value `l` of sub-block j, so `qh` chunk `u` holds the 5th bits of values `4u..4u+4`
//! of every sub-block.
//!
//! Q6_K: GGML stores value `128h + 32t + l` (h < 2, t < 4, l < 32) as a low nibble in
//! `ql[64h + 32(t % 2) + l]` (the high nibble when t >= 2) and two high bits in bits `2t, 2t + 1`
//! of `qh[32h + l]`; it means `q - 32`, in 16-value group `g = 8h + 2t + l / 16` with the signed
//! scale `s_g`. Joining the two parts took 17 vector operations per four weight vectors, which
//! bound a single row's product below the row kernel's speed. The group-block stores the 6-bit
//! values whole instead, four in three bytes: value chunks `3(8h + i) + j` (j < 3) hold in byte
//! `e` of lane r value `128h + 32j + 4i + e` of row r, with bits `2j, 2j + 1` of value
//! `128h + 96 + 4i + e` in its top two bits (eleven operations for the four vectors). Per block
//! and lane, `Q = sum_g s_g (isum_g - 32 bs_g)`, then `acc = acc + Q * (d_w * d_x)`.
//!
//! At one activation row the products are bound by reading the weights, and the hardware
//! prefetcher alone left each group-block's first loads waiting on memory: every body
//! prefetches the next group-block's lines as it goes, evenly over its steps.
//!
//! Integer sums are exact in any order, and the float operations (separate multiplies and adds,
//! as [`super::kquant`]) happen in the same order on every path and for every batch size: every
//! path equals [`group_portable`] bit for bit, each lane is a row's result (no horizontal sum),
//! and a row's result does not depend on its batch.

use super::formats::Format;
use super::interleaved::GROUP;
use super::kernels::Path;
use super::kquant::{ActQ8K, QK_K};

/// A K-quant block's size, the byte offsets of its f16 fields (in group-block order), and the
/// number of chunks after them in a group-block.
struct Layout {
    block: usize,
    f16s: &'static [usize],
    chunks: usize,
}

impl Layout {
    /// Where chunk `c` starts in a group-block.
    const fn chunk(&self, c: usize) -> usize {
        16 * self.f16s.len() + 32 * c
    }
}

const Q4K: Layout = Layout { block: 144, f16s: &[0, 2], chunks: 35 };
const Q5K: Layout = Layout { block: 176, f16s: &[0, 2], chunks: 43 };
const Q6K: Layout = Layout { block: 210, f16s: &[208], chunks: 52 };

/// Offsets in a Q4_K or Q5_K group-block: dmin x8, the three scale chunks, (Q5_K: the eight
/// chunks of 5th bits,) the 32 value chunks.
const K_DMIN: usize = 16;
const K_SCALES: usize = Q4K.chunk(0);
const Q5K_QH: usize = Q5K.chunk(3);
const fn k_qs(five: bool) -> usize {
    if five { Q5K.chunk(11) } else { Q4K.chunk(3) }
}
/// Offsets in a Q6_K group-block: the 4 scale chunks, the 48 value chunks (in the order the
/// products read them: a group-block streamed from memory front to back).
const Q6K_SCALES: usize = Q6K.chunk(0);
const Q6K_VALUES: usize = Q6K.chunk(4);
/// Bytes of a GGML Q6_K block: `ql`, `qh`, the scales (then d).
const Q6K_QH: usize = 128;
const Q6K_BLOCK_SCALES: usize = 192;

/// A K-quant held interleaved: their x8 products measured faster than their row kernels at one
/// activation row and at sixteen (`quant_matvec --k-quants`, and whole decode steps:
/// docs/performance.md; Q6_K's row kernel was also slower than candle's at sixteen). Q2_K and
/// Q3_K stay in row layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuant {
    Q4K,
    Q5K,
    Q6K,
}

impl KQuant {
    /// The format `dtype` held interleaved, or None (not a K-quant, or one in row layout).
    pub fn of(dtype: Format) -> Option<KQuant> {
        match dtype {
            Format::Q4K => Some(KQuant::Q4K),
            Format::Q5K => Some(KQuant::Q5K),
            Format::Q6K => Some(KQuant::Q6K),
            _ => None,
        }
    }

    fn layout(self) -> &'static Layout {
        match self {
            KQuant::Q4K => &Q4K,
            KQuant::Q5K => &Q5K,
            KQuant::Q6K => &Q6K,
        }
    }
}

/// Interleaves the eight blocks `rows` of format `kq` into group-block `out`.
pub(super) fn pack_block(kq: KQuant, rows: [&[u8]; GROUP], out: &mut [u8]) {
    let l = kq.layout();
    for (r, blk) in rows.iter().enumerate() {
        for (i, &at) in l.f16s.iter().enumerate() {
            out[16 * i + 2 * r..16 * i + 2 * r + 2].copy_from_slice(&blk[at..at + 2]);
        }
        let mut lane = |c: usize, word: &[u8]| out[l.chunk(c) + 4 * r..l.chunk(c) + 4 * r + 4].copy_from_slice(word);
        if kq != KQuant::Q6K {
            // Q4_K, Q5_K: GGML's words past d and dmin, in order
            for c in 0..l.chunks {
                lane(c, &blk[4 + 4 * c..8 + 4 * c]);
            }
            continue;
        }
        for c in 0..4 {
            lane(c, &blk[Q6K_BLOCK_SCALES + 4 * c..Q6K_BLOCK_SCALES + 4 * c + 4]);
        }
        for h in 0..2 {
            for i in 0..8 {
                for (j, word) in q6k_value_words(blk, h, i).into_iter().enumerate() {
                    lane(4 + 3 * (8 * h + i) + j, &word.to_le_bytes());
                }
            }
        }
    }
}

/// A row's lane words of Q6_K value chunks `3(8h + i) + j`, j = 0..3, from its GGML block:
/// [`q6k_value_byte`]'s bytes four at a time, each byte of a word a value `l = 4i + e` of half
/// `h` (the packing read the 256 values one by one before, which made Q6_K a third of a
/// Q4_0 file's load).
fn q6k_value_words(blk: &[u8], h: usize, i: usize) -> [u32; 3] {
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word = |at: usize| u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    let (ql0, ql1, qh) = (word(64 * h + 4 * i), word(64 * h + 32 + 4 * i), word(Q6K_QH + 32 * h + 4 * i));
    // values 128h + 32t + 4i + e for t = 0..4, as GGML's dequantization assembles them
    let t = [
        (ql0 & LOW4) | ((qh & LOW2) << 4),
        (ql1 & LOW4) | (((qh >> 2) & LOW2) << 4),
        ((ql0 >> 4) & LOW4) | (((qh >> 4) & LOW2) << 4),
        ((ql1 >> 4) & LOW4) | (((qh >> 6) & LOW2) << 4),
    ];
    std::array::from_fn(|j| t[j] | (((t[3] >> (2 * j)) & LOW2) << 6))
}

/// Row `r`'s block out of group-block `group` (the inverse of [`pack_block`]).
pub(super) fn unpack_block(kq: KQuant, group: &[u8], r: usize, out: &mut [u8]) {
    let l = kq.layout();
    for (i, &at) in l.f16s.iter().enumerate() {
        out[at..at + 2].copy_from_slice(&group[16 * i + 2 * r..16 * i + 2 * r + 2]);
    }
    let lane = |c: usize| &group[l.chunk(c) + 4 * r..l.chunk(c) + 4 * r + 4];
    if kq != KQuant::Q6K {
        for c in 0..l.chunks {
            out[4 + 4 * c..8 + 4 * c].copy_from_slice(lane(c));
        }
        return;
    }
    out[..Q6K_BLOCK_SCALES].fill(0);
    for (v, &value) in q6k_lane_values(|c, e| lane(4 + c)[e]).iter().enumerate() {
        let (h, t, l) = (v / 128, v % 128 / 32, v % 32);
        out[64 * h + 32 * (t % 2) + l] |= (value & 15) << (4 * (t / 2));
        out[Q6K_QH + 32 * h + l] |= (value >> 4) << (2 * t);
    }
    for c in 0..4 {
        out[Q6K_BLOCK_SCALES + 4 * c..Q6K_BLOCK_SCALES + 4 * c + 4].copy_from_slice(lane(c));
    }
}

/// The 256 six-bit values (`q`, meaning `q - 32`) of a GGML Q6_K block.
#[cfg(test)]
fn q6k_values(blk: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|v| {
        let (h, t, l) = (v / 128, v % 128 / 32, v % 32);
        let (ql, qh) = (blk[64 * h + 32 * (t % 2) + l], blk[Q6K_QH + 32 * h + l]);
        (ql >> (4 * (t / 2))) & 15 | ((qh >> (2 * t)) & 3) << 4
    })
}

/// Byte `e` of a row's lane in Q6_K value chunk `c = 3(8h + i) + j`: value `128h + 32j + 4i + e`
/// with bits `2j, 2j + 1` of value `128h + 96 + 4i + e` on top: the layout's definition, the
/// reference of [`q6k_value_words`].
#[cfg(test)]
fn q6k_value_byte(values: &[u8; QK_K], c: usize, e: usize) -> u8 {
    let (h, i, j) = (c / 24, c / 3 % 8, c % 3);
    let at = 128 * h + 4 * i + e;
    values[at + 32 * j] | ((values[at + 96] >> (2 * j)) & 3) << 6
}

/// A row's 256 six-bit values from byte `e` of its lane in value chunk `c`, `byte(c, e)` (the
/// inverse of [`q6k_value_byte`]).
fn q6k_lane_values(byte: impl Fn(usize, usize) -> u8) -> [u8; QK_K] {
    let mut values = [0u8; QK_K];
    for c in 0..48 {
        let (h, i, j) = (c / 24, c / 3 % 8, c % 3);
        for e in 0..4 {
            let (b, at) = (byte(c, e), 128 * h + 4 * i + e);
            values[at + 32 * j] = b & 63;
            values[at + 96] |= (b >> 6) << (2 * j);
        }
    }
    values
}

/// One group's eight rows (`group`: group-blocks of format `kq`) against up to four Q8_K activation
/// rows: `out[j][r]` is row r dotted with activation row j. The one place a path is taken for
/// these formats.
pub(super) fn group_dot(path: Path, kq: KQuant, group: &[u8], acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
    let blocks = acts[0].d.len();
    assert!(acts.len() <= 4 && acts.len() == out.len());
    assert!(group.len() == blocks * GROUP * kq.layout().block);
    assert!(acts.iter().all(|a| a.d.len() == blocks && a.bsums.len() == blocks * 16 && a.qs.len() == blocks * QK_K));
    match path {
        Path::Portable => group_portable(kq, group, acts, out),
        // On the VNNI path the bodies sum with `vpdpbusd` (the same integers, hence the same
        // results).
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `interleaved::matmul` asserted this CPU has the path, which includes AVX2, FMA
        // and F16C; the group holds `blocks` group-blocks of `kq` and every activation row
        // `blocks` blocks (asserted above).
        Path::Avx2 | Path::Avx512Vnni => unsafe {
            let vnni = path == Path::Avx512Vnni;
            match kq {
                // SAFETY (VNNI): `Path::Avx512Vnni` is available (F, BW, VL and VNNI).
                KQuant::Q4K if vnni => x86::group_q4k_vnni(group.as_ptr(), blocks, acts, out),
                KQuant::Q5K if vnni => x86::group_q5k_vnni(group.as_ptr(), blocks, acts, out),
                KQuant::Q6K if vnni => x86::group_q6k_vnni(group.as_ptr(), blocks, acts, out),
                KQuant::Q4K => x86::group_q4k_avx2(group.as_ptr(), blocks, acts, out),
                KQuant::Q5K => x86::group_q5k_avx2(group.as_ptr(), blocks, acts, out),
                KQuant::Q6K => x86::group_q6k_avx2(group.as_ptr(), blocks, acts, out),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        _ => group_portable(kq, group, acts, out),
    }
}

/// The scalar reference of the x8 products, which every SIMD path computes lane by lane.
pub fn group_portable(kq: KQuant, group: &[u8], acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
    for o in out.iter_mut() {
        *o = [0.0; GROUP];
    }
    let gbytes = GROUP * kq.layout().block;
    for (b, gb) in group.chunks_exact(gbytes).enumerate() {
        for r in 0..GROUP {
            match kq {
                KQuant::Q4K => portable_q4k::<false>(gb, r, b, acts, out),
                KQuant::Q5K => portable_q4k::<true>(gb, r, b, acts, out),
                KQuant::Q6K => portable_q6k(gb, r, b, acts, out),
            }
        }
    }
}

fn f16_at(gb: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([gb[at], gb[at + 1]]).to_f32()
}

/// The eight 6-bit scales and mins of a Q4_K block from its three scale words (lane r of the
/// three scale chunks): GGML's `get_scale_min_k4`, as [`super::kquant`] unpacks one block.
/// Returns the words of sub-blocks 0..4 and 4..8: byte `j % 4` of `(scales_lo, scales_hi,
/// mins_lo, mins_hi)`.
#[inline(always)]
fn q4k_scale_words(u0: u32, u1: u32, u2: u32) -> [u32; 4] {
    [
        u0 & 0x3f3f_3f3f,
        (u2 & 0x0f0f_0f0f) | ((u0 >> 6) & 0x0303_0303) << 4,
        u1 & 0x3f3f_3f3f,
        ((u2 >> 4) & 0x0f0f_0f0f) | ((u1 >> 6) & 0x0303_0303) << 4,
    ]
}

/// Lane (row) r of Q4_K (Q5_K when `FIVE`) group-block `gb` (block b) against every activation
/// row, into `out`.
fn portable_q4k<const FIVE: bool>(gb: &[u8], r: usize, b: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
    let word = |at: usize| u32::from_le_bytes(gb[at..at + 4].try_into().expect("4 bytes"));
    let (d, dmin) = (f16_at(gb, 2 * r), f16_at(gb, K_DMIN + 2 * r));
    let [s_lo, s_hi, m_lo, m_hi] = q4k_scale_words(word(K_SCALES + 4 * r), word(K_SCALES + 32 + 4 * r), word(K_SCALES + 64 + 4 * r));
    let (scales, mins) = ((s_lo as u64 | (s_hi as u64) << 32).to_le_bytes(), (m_lo as u64 | (m_hi as u64) << 32).to_le_bytes());
    // Value 4u + i of sub-blocks 2p (low nibble) and 2p + 1 (high nibble) is byte i of lane r in
    // chunk 8p + u; its 5th bit, bit 2p (2p + 1) of byte i of lane r in qh chunk u.
    let mut values = [0i32; QK_K];
    for p in 0..4 {
        for u in 0..8 {
            for i in 0..4 {
                let byte = gb[k_qs(FIVE) + 32 * (8 * p + u) + 4 * r + i];
                let qh = if FIVE { gb[Q5K_QH + 32 * u + 4 * r + i] as i32 } else { 0 };
                values[64 * p + 4 * u + i] = (byte & 15) as i32 | ((qh >> (2 * p)) & 1) << 4;
                values[64 * p + 32 + 4 * u + i] = (byte >> 4) as i32 | ((qh >> (2 * p + 1)) & 1) << 4;
            }
        }
    }
    for (act, o) in acts.iter().zip(out.iter_mut()) {
        let x = &act.qs[b * QK_K..(b + 1) * QK_K];
        let bsums = &act.bsums[b * 16..(b + 1) * 16];
        let (mut q, mut m) = (0i32, 0i32);
        for j in 0..8 {
            let isum: i32 = values[32 * j..32 * j + 32].iter().zip(&x[32 * j..32 * j + 32]).map(|(&w, &x)| w * x as i32).sum();
            q += scales[j] as i32 * isum;
            m += mins[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
        }
        let dx = act.d[b];
        o[r] += q as f32 * (d * dx);
        o[r] -= m as f32 * (dmin * dx);
    }
}

/// Lane (row) r of Q6_K group-block `gb` (block b) against every activation row, into `out`.
fn portable_q6k(gb: &[u8], r: usize, b: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
    let d = f16_at(gb, 2 * r);
    let values = q6k_lane_values(|c, e| gb[Q6K_VALUES + 32 * c + 4 * r + e]).map(|v| v as i32);
    let scales: [i32; 16] = std::array::from_fn(|g| gb[Q6K_SCALES + 32 * (g / 4) + 4 * r + g % 4] as i8 as i32);
    for (act, o) in acts.iter().zip(out.iter_mut()) {
        let x = &act.qs[b * QK_K..(b + 1) * QK_K];
        let bsums = &act.bsums[b * 16..(b + 1) * 16];
        let mut q = 0i32;
        for g in 0..16 {
            let isum: i32 = values[16 * g..16 * g + 16].iter().zip(&x[16 * g..16 * g + 16]).map(|(&w, &x)| w * x as i32).sum();
            q += scales[g] * (isum - 32 * bsums[g] as i32);
        }
        o[r] += q as f32 * (d * act.d[b]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{ActQ8K, GROUP, K_DMIN, K_SCALES, Q4K, Q5K, Q5K_QH, Q6K, Q6K_SCALES, Q6K_VALUES, QK_K, k_qs};

    /// Calls `$body::<R>` with `R` the number of activation rows (1 to 4), so that each batch
    /// size gets its own unrolled body.
    macro_rules! by_rows {
        ($body:ident $(::<$($flag:literal),+>)?, $group:expr, $blocks:expr, $acts:expr, $out:expr) => {
            match $acts.len() {
                1 => $body::<$($($flag,)+)? 1>($group, $blocks, [$acts[0]], $out),
                2 => $body::<$($($flag,)+)? 2>($group, $blocks, [$acts[0], $acts[1]], $out),
                3 => $body::<$($($flag,)+)? 3>($group, $blocks, [$acts[0], $acts[1], $acts[2]], $out),
                _ => $body::<$($($flag,)+)? 4>($group, $blocks, [$acts[0], $acts[1], $acts[2], $acts[3]], $out),
            }
        };
    }

    /// Eight interleaved Q4_K rows against `acts` (1 to 4 Q8_K rows): `out[j][r]`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `group` points to `blocks` Q4_K group-blocks; every
    /// activation row holds `blocks` blocks (`d`, `qs`, `bsums`); `out` has `acts.len()` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_q4k_avx2(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q4k::<false, false>, group, blocks, acts, out) }
    }

    /// [`group_q4k_avx2`] with VNNI's `vpdpbusd` for the 8-bit products.
    ///
    /// # Safety
    /// As [`group_q4k_avx2`], and the CPU has AVX-512 F, VL and VNNI.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn group_q4k_vnni(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q4k::<false, true>, group, blocks, acts, out) }
    }

    /// Eight interleaved Q5_K rows against `acts` (1 to 4 Q8_K rows): `out[j][r]`.
    ///
    /// # Safety
    /// As [`group_q4k_avx2`], for Q5_K group-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_q5k_avx2(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q4k::<true, false>, group, blocks, acts, out) }
    }

    /// [`group_q5k_avx2`] with VNNI's `vpdpbusd` for the 8-bit products.
    ///
    /// # Safety
    /// As [`group_q4k_vnni`], for Q5_K group-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn group_q5k_vnni(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q4k::<true, true>, group, blocks, acts, out) }
    }

    /// Eight interleaved Q6_K rows against `acts` (1 to 4 Q8_K rows): `out[j][r]`.
    ///
    /// # Safety
    /// As [`group_q4k_avx2`], for Q6_K group-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_q6k_avx2(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q6k::<false>, group, blocks, acts, out) }
    }

    /// [`group_q6k_avx2`] with VNNI's `vpdpbusd` for the 8-bit products.
    ///
    /// # Safety
    /// As [`group_q4k_vnni`], for Q6_K group-blocks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn group_q6k_vnni(group: *const u8, blocks: usize, acts: &[&ActQ8K], out: &mut [[f32; GROUP]]) {
        // SAFETY: forwarded contract; each arm passes exactly its number of rows.
        unsafe { by_rows!(body_q6k::<true>, group, blocks, acts, out) }
    }

    /// `pick[i]`: the shuffle that puts byte i of each 32-bit lane into the lane's two i16,
    /// in their low bytes (`high` false: zero-extended) or high bytes (`high`: for a
    /// sign-extending shift right by 8).
    #[inline(always)]
    unsafe fn byte_picks(high: bool) -> [__m256i; 4] {
        let lane = |q: u32, i: u32| {
            let (at, zero) = (4 * q + i, 0x80);
            let half = if high { zero | at << 8 } else { at | zero << 8 };
            (half | half << 16) as i32
        };
        // SAFETY: AVX is enabled by every caller.
        std::array::from_fn(|i| unsafe {
            let i = i as u32;
            _mm256_setr_epi32(lane(0, i), lane(1, i), lane(2, i), lane(3, i), lane(0, i), lane(1, i), lane(2, i), lane(3, i))
        })
    }

    /// Four activation bytes at `at`, in every 32-bit lane.
    #[inline(always)]
    unsafe fn broadcast4(at: *const i8) -> __m256i {
        // SAFETY: the caller passes four readable bytes; the load is unaligned.
        unsafe { _mm256_set1_epi32(at.cast::<i32>().read_unaligned()) }
    }

    /// Bit `bit` (0..8) of every byte of `v` moved to bit 4, for a mask of 0x10 (what the 16-bit
    /// shifts carry across bytes lands elsewhere: in bits 0..4 or 5..8).
    #[inline(always)]
    unsafe fn bit_to_4(v: __m256i, bit: usize) -> __m256i {
        // SAFETY: AVX2 is enabled by every caller.
        unsafe {
            match bit {
                0 => _mm256_slli_epi16::<4>(v),
                1 => _mm256_slli_epi16::<3>(v),
                2 => _mm256_slli_epi16::<2>(v),
                3 => _mm256_slli_epi16::<1>(v),
                4 => v,
                5 => _mm256_srli_epi16::<1>(v),
                6 => _mm256_srli_epi16::<2>(v),
                _ => _mm256_srli_epi16::<3>(v),
            }
        }
    }

    /// Prefetches cache lines `first..first + count` from `at` (a prefetch never faults, so the
    /// lines need not be inside anything: past a matrix's last group-block they are wasted).
    #[inline(always)]
    unsafe fn prefetch_lines(at: *const u8, first: usize, count: usize) {
        for line in first..first + count {
            // SAFETY: a prefetch reads nothing architecturally; SSE is in the x86-64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64 * line).cast()) }
        }
    }

    /// The i16 pair `(a, c)` in every 32-bit lane.
    #[inline(always)]
    unsafe fn pair(a: i16, c: i16) -> __m256i {
        // SAFETY: AVX is enabled by every caller.
        unsafe { _mm256_set1_epi32((a as u16 as u32 | (c as u16 as u32) << 16) as i32) }
    }

    /// The lane-wise Q4_K (Q5_K when `FIVE`) products of `R` activation rows with one group's
    /// eight rows (the lanes of [`super::portable_q4k`]). A sub-block's products are summed per
    /// lane as i16 pairs (`vpmaddubsw`) and then times its scale as i32 (`vpmaddwd`), or with
    /// `VNNI` as i32 (`vpdpbusd`) and then times its scale (`vpmulld`): the same integers (the
    /// pairs never saturate, see below), hence the same results, in half the instructions a
    /// chunk.
    ///
    /// # Safety
    /// As [`group_q4k_avx2`] (Q5_K group-blocks when `FIVE`; AVX-512 VL and VNNI when `VNNI`),
    /// with `R` equal to the number of rows of `out`.
    #[inline(always)]
    unsafe fn body_q4k<const FIVE: bool, const VNNI: bool, const R: usize>(group: *const u8, blocks: usize, acts: [&ActQ8K; R], out: &mut [[f32; GROUP]]) {
        let gbytes = GROUP * if FIVE { Q5K.block } else { Q4K.block };
        // SAFETY (whole block): AVX2, FMA and F16C are enabled by every caller; group-block
        // b < blocks is in bounds of `group`, and activation bytes b * 256 + 256, sums
        // b * 16 + 16 and scale b of every row (the caller's contract); every load is unaligned.
        unsafe {
            let low4 = _mm256_set1_epi8(0x0F);
            let (six, four, two) = (_mm256_set1_epi32(0x3f3f_3f3f), _mm256_set1_epi32(0x0f0f_0f0f), _mm256_set1_epi32(0x0303_0303));
            let even_bytes = _mm256_set1_epi32(0x00ff_00ff);
            let bit4 = _mm256_set1_epi8(0x10);
            let pick = byte_picks(false);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let gb = group.add(b * gbytes);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(K_DMIN).cast()));
                // `super::q4k_scale_words`, lane by lane
                let u0 = _mm256_loadu_si256(gb.add(K_SCALES).cast());
                let u1 = _mm256_loadu_si256(gb.add(K_SCALES + 32).cast());
                let u2 = _mm256_loadu_si256(gb.add(K_SCALES + 64).cast());
                let s_lo = _mm256_and_si256(u0, six);
                let s_hi = _mm256_or_si256(_mm256_and_si256(u2, four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), two), 4));
                let m_lo = _mm256_and_si256(u1, six);
                let m_hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi32(u2, 4), four),
                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), two), 4),
                );
                let x = acts.map(|a| a.qs.as_ptr().add(b * QK_K));
                let mut q = [_mm256_setzero_si256(); R];
                for p in 0..4 {
                    // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles): i16 pair sums (with
                    // VNNI, i32 sums) of a span of chunks, eight of 4-bit values (at most 8 * 2 * 15 * 128 = 30720
                    // in magnitude) or four of 5-bit ones (4 * 2 * 31 * 128 = 31744)
                    let span = if FIVE { 4 } else { 8 };
                    for half in 0..8 / span {
                        // the next group-block's lines (Q4_K 18, Q5_K 22), evenly over the spans
                        let spans = 4 * (8 / span);
                        let each = (gbytes / 64).div_ceil(spans);
                        prefetch_lines(gb.wrapping_add(gbytes), each * (p * (8 / span) + half), each);
                        let mut lo_pairs = [_mm256_setzero_si256(); R];
                        let mut hi_pairs = [_mm256_setzero_si256(); R];
                        for v in 0..span {
                            let u = half * span + v;
                            let chunk = _mm256_loadu_si256(gb.add(k_qs(FIVE) + 32 * (8 * p + u)).cast());
                            let mut lo = _mm256_and_si256(chunk, low4);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low4);
                            if FIVE {
                                let qh = _mm256_loadu_si256(gb.add(Q5K_QH + 32 * u).cast());
                                lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(qh, 2 * p), bit4));
                                hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(qh, 2 * p + 1), bit4));
                            }
                            for j in 0..R {
                                let at = x[j].add(64 * p + 4 * u);
                                if VNNI {
                                    lo_pairs[j] = _mm256_dpbusd_epi32(lo_pairs[j], lo, broadcast4(at));
                                    hi_pairs[j] = _mm256_dpbusd_epi32(hi_pairs[j], hi, broadcast4(at.add(32)));
                                } else {
                                    lo_pairs[j] = _mm256_add_epi16(lo_pairs[j], _mm256_maddubs_epi16(lo, broadcast4(at)));
                                    hi_pairs[j] = _mm256_add_epi16(hi_pairs[j], _mm256_maddubs_epi16(hi, broadcast4(at.add(32))));
                                }
                            }
                        }
                        let words = if p < 2 { s_lo } else { s_hi };
                        // each lane's scale as an i16 pair (s, s), or with VNNI as an i32 s
                        let sc_lo = _mm256_shuffle_epi8(words, pick[(2 * p) % 4]);
                        let sc_hi = _mm256_shuffle_epi8(words, pick[(2 * p + 1) % 4]);
                        for j in 0..R {
                            let (lo, hi) = if VNNI {
                                let low_half = _mm256_set1_epi32(0xFFFF);
                                (_mm256_mullo_epi32(lo_pairs[j], _mm256_and_si256(sc_lo, low_half)), _mm256_mullo_epi32(hi_pairs[j], _mm256_and_si256(sc_hi, low_half)))
                            } else {
                                (_mm256_madd_epi16(lo_pairs[j], sc_lo), _mm256_madd_epi16(hi_pairs[j], sc_hi))
                            };
                            q[j] = _mm256_add_epi32(q[j], _mm256_add_epi32(lo, hi));
                        }
                    }
                }
                // the mins as i16: (m0, m2), (m1, m3), (m4, m6), (m5, m7) in each lane
                let mins = [
                    _mm256_and_si256(m_lo, even_bytes),
                    _mm256_srli_epi16(m_lo, 8),
                    _mm256_and_si256(m_hi, even_bytes),
                    _mm256_srli_epi16(m_hi, 8),
                ];
                for j in 0..R {
                    // bs_s: the activation sum of sub-block s, at most 32 * 128 in magnitude
                    let bsums = acts[j].bsums.as_ptr().add(16 * b);
                    let bs = |s: usize| (*bsums.add(2 * s) as i32 + *bsums.add(2 * s + 1) as i32) as i16;
                    let m = _mm256_add_epi32(
                        _mm256_add_epi32(_mm256_madd_epi16(mins[0], pair(bs(0), bs(2))), _mm256_madd_epi16(mins[1], pair(bs(1), bs(3)))),
                        _mm256_add_epi32(_mm256_madd_epi16(mins[2], pair(bs(4), bs(6))), _mm256_madd_epi16(mins[3], pair(bs(5), bs(7)))),
                    );
                    let dx = _mm256_set1_ps(*acts[j].d.get_unchecked(b));
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(q[j]), _mm256_mul_ps(d, dx)));
                    acc[j] = _mm256_sub_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, dx)));
                }
            }
            for j in 0..R {
                _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
            }
        }
    }

    /// The lane-wise Q6_K products of `R` activation rows with one group's eight rows (the lanes
    /// of [`super::portable_q6k`]). A 16-value group's products are summed per lane as i16
    /// pairs (`vpmaddubsw`, two pairs added) and then times its scale as i32 (`vpmaddwd`), each
    /// eight values at a time; or with `VNNI` all sixteen as i32 (`vpdpbusd`) and then times the
    /// scale once (`vpmulld`): the same integers (no pair saturates, see below), hence the same
    /// results, in about half the integer instructions. `quant_matvec --k-quants`, x8, one
    /// thread, the AVX2 body and the VNNI one in one process (two runs), 16 rows: [1536x576]
    /// 185 -> 175 and 187 -> 180 µs, [1024x3072] 527 -> 554 and 523 -> 437, [3072x1024] 580 ->
    /// 605 and 566 -> 488, [2048x2048] 709 -> 608; one row 0.9-1.0x the time.
    ///
    /// # Safety
    /// As [`group_q6k_avx2`] (AVX-512 VL and VNNI when `VNNI`), with `R` equal to the number of
    /// rows of `out`.
    #[inline(always)]
    unsafe fn body_q6k<const VNNI: bool, const R: usize>(group: *const u8, blocks: usize, acts: [&ActQ8K; R], out: &mut [[f32; GROUP]]) {
        // SAFETY (whole block): AVX2, FMA and F16C are enabled by every caller; group-block
        // b < blocks is in bounds of `group`, and activation bytes b * 256 + 256, sums
        // b * 16 + 16 and scale b of every row (the caller's contract); every load is unaligned.
        unsafe {
            let six = _mm256_set1_epi8(0x3F);
            let top = [_mm256_set1_epi8(0x03), _mm256_set1_epi8(0x0C), _mm256_set1_epi8(0x30)];
            let pick = byte_picks(true);
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..blocks {
                let gb = group.add(b * GROUP * Q6K.block);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(gb.cast()));
                let load = |at: usize| _mm256_loadu_si256(gb.add(at).cast::<__m256i>());
                // chunk c: the scales of groups 4c..4c+4 as the bytes of each lane
                let sc_chunks: [__m256i; 4] = std::array::from_fn(|c| load(Q6K_SCALES + 32 * c));
                // group g's scale, sign-extended, in both i16 of every lane
                let scales: [__m256i; 16] = std::array::from_fn(|g| _mm256_srai_epi16(_mm256_shuffle_epi8(sc_chunks[g / 4], pick[g % 4]), 8));
                let x = acts.map(|a| a.qs.as_ptr().add(b * QK_K));
                let mut q = [_mm256_setzero_si256(); R];
                for h in 0..2 {
                    // with VNNI: each group's i32 sums over the two iterations of i that share
                    // its scale (group 8h + 2t + i / 4), by t and row
                    let mut sums = [[_mm256_setzero_si256(); R]; 4];
                    for i in (0..8).step_by(2) {
                        // the next group-block's 27 lines, four an iteration
                        prefetch_lines(gb.wrapping_add(GROUP * Q6K.block), 4 * (4 * h + i / 2), 4);
                        // value chunks 3(8h + i) + j for i and i + 1: the values
                        // 128h + 32t + 4i..+8 for every t, in w[t][0] and w[t][1]
                        let mut w = [[_mm256_setzero_si256(); 2]; 4];
                        for e in 0..2 {
                            let chunk = |j: usize| load(Q6K_VALUES + 32 * (3 * (8 * h + i + e) + j));
                            let three = [chunk(0), chunk(1), chunk(2)];
                            // each byte's top two bits are bits 2j, 2j + 1 of the fourth value
                            // (what the 16-bit shifts carry across bytes lands outside the masks)
                            let shifted = [_mm256_srli_epi16(three[0], 6), _mm256_srli_epi16(three[1], 4), _mm256_srli_epi16(three[2], 2)];
                            for j in 0..3 {
                                w[j][e] = _mm256_and_si256(three[j], six);
                            }
                            w[3][e] = _mm256_or_si256(
                                _mm256_or_si256(_mm256_and_si256(shifted[0], top[0]), _mm256_and_si256(shifted[1], top[1])),
                                _mm256_and_si256(shifted[2], top[2]),
                            );
                        }
                        for (t, w) in w.iter().enumerate() {
                            let scale = scales[8 * h + 2 * t + i / 4];
                            for j in 0..R {
                                let at = x[j].add(128 * h + 32 * t + 4 * i);
                                if VNNI {
                                    sums[t][j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sums[t][j], w[0], broadcast4(at)), w[1], broadcast4(at.add(4)));
                                } else {
                                    // a pair of products is at most 2 * 63 * 128 in magnitude:
                                    // two pairs fit an i16
                                    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], broadcast4(at)), _mm256_maddubs_epi16(w[1], broadcast4(at.add(4))));
                                    q[j] = _mm256_add_epi32(q[j], _mm256_madd_epi16(pairs, scale));
                                }
                            }
                        }
                        if VNNI && i % 4 == 2 {
                            // the groups of this half of i are whole: times their scales, the
                            // i16 pair (s, s) of each lane read as the i32 s
                            for (t, sums) in sums.iter_mut().enumerate() {
                                let scale = _mm256_srai_epi32::<16>(scales[8 * h + 2 * t + i / 4]);
                                for j in 0..R {
                                    q[j] = _mm256_add_epi32(q[j], _mm256_mullo_epi32(sums[j], scale));
                                    sums[j] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                }
                // the scales as i16 pairs (s_4c, s_4c+2) and (s_4c+1, s_4c+3), sign-extended
                let evens = sc_chunks.map(|c| _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8));
                let odds = sc_chunks.map(|c| _mm256_srai_epi16(c, 8));
                for j in 0..R {
                    // bs_g: the activation sum of group g, at most 16 * 128 in magnitude
                    let bs = acts[j].bsums.as_ptr().add(16 * b);
                    let mut offsets = _mm256_setzero_si256();
                    for c in 0..4 {
                        let even = _mm256_madd_epi16(evens[c], pair(*bs.add(4 * c), *bs.add(4 * c + 2)));
                        let odd = _mm256_madd_epi16(odds[c], pair(*bs.add(4 * c + 1), *bs.add(4 * c + 3)));
                        offsets = _mm256_add_epi32(offsets, _mm256_add_epi32(even, odd));
                    }
                    let total = _mm256_sub_epi32(q[j], _mm256_slli_epi32(offsets, 5));
                    let dx = _mm256_set1_ps(*acts[j].d.get_unchecked(b));
                    acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx)));
                }
            }
            for j in 0..R {
                _mm256_storeu_ps(out[j].as_mut_ptr(), acc[j]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::formats::dequantize;
    use super::super::interleaved::tests::{check_packing, check_products, on_every_path};
    use super::super::interleaved::{matmul, pack};
    use super::super::kernels;
    use super::*;
    use crate::test_values::{assert_within_activation_rounding, blocks, values};

    const FORMATS: [Format; 3] = [Format::Q4K, Format::Q5K, Format::Q6K];

    /// The Q6_K packing's words are the layout's bytes, value by value, on blocks of every bit
    /// pattern the generator gives.
    #[test]
    fn q6k_value_words_are_the_layouts_bytes() {
        let bytes = blocks(Format::Q6K, 4, 256, 21);
        for blk in bytes.chunks_exact(Q6K.block) {
            let values = q6k_values(blk);
            for c in 0..48 {
                let (h, i, j) = (c / 24, c / 3 % 8, c % 3);
                let word = q6k_value_words(blk, h, i)[j].to_le_bytes();
                assert_eq!(word, std::array::from_fn(|e| q6k_value_byte(&values, c, e)), "chunk {c}");
            }
        }
    }

    /// Packing keeps the size, `unpack` and `row` invert it, on three 256-blocks a row.
    #[test]
    fn packing_round_trips() {
        for dtype in FORMATS {
            check_packing(dtype, 768, 40);
        }
    }

    /// Every path this CPU has equals the scalar reference bit for bit on the grouped rows (tail
    /// rows, in row layout: the row kernels' result), for batches of 1 to 9 rows; a row's result
    /// is the same alone or in a batch; it is within rounding of the row layout's sums and within
    /// the activation rounding of the dequantized product (at most half a step, amax / 254, a
    /// value: within 0.01 |w| |x| for these inputs, as `kquant`'s tests).
    #[test]
    fn every_path_equals_the_reference_and_the_dequantized_product() {
        on_every_path("K-quant interleaved", |path| {
            for dtype in FORMATS {
                let shapes = [(1, 256, 8), (1, 512, 37), (2, 768, 16), (3, 1280, 19), (4, 256, 24), (5, 512, 33), (6, 256, 8), (7, 512, 9), (8, 768, 15), (9, 2048, 17)];
                for &(m, k, n) in &shapes {
                    let bytes = blocks(dtype, n, k, (m * k + n) as u64);
                    let x = values(m * k, 5 + k as u64);
                    let rows_layout = kernels::matmul(&x, m, k, dtype, &bytes, n, Path::Portable);
                    let at = format!("{path:?} {dtype:?} m{m} k{k} n{n}");
                    check_products(dtype, path, (m, k, n), &bytes, &x, &at, |at, i, j, g, _, tail| {
                        let r = rows_layout[i * n + j];
                        if tail {
                            assert_eq!(g.to_bits(), r.to_bits(), "{at}: a tail row is the row kernels' result");
                        }
                        // the row layout's sums, in another float order
                        assert!((g - r).abs() <= 1e-4 * (1.0 + r.abs()), "{at}: {g} vs row layout {r}");
                    });
                }
            }
        });
    }

    /// Edge cases: all-zero activations give zeros; a single large activation (the others round
    /// to 0), values of the largest magnitude everywhere (the i16 pair sums at their largest)
    /// and alternating signs agree across paths and with the dequantized product.
    #[test]
    fn zero_and_extreme_activations() {
        for dtype in FORMATS {
            let (k, n) = (512, 16);
            let bytes = blocks(dtype, n, k, 8);
            let packed = pack(dtype, n, k, &bytes);
            let mut wd = vec![0f32; n * k];
            dequantize(dtype, &bytes, &mut wd);
            let mut spike = vec![1e-3f32; k];
            spike[300] = -50.0;
            let alternating: Vec<f32> = (0..k).map(|i| if i % 3 == 0 { 1.0 } else { -1.0 }).collect();
            for (case, x) in [vec![0f32; k], spike, alternating, vec![-1.0; k], vec![1.0; k]].into_iter().enumerate() {
                let reference = matmul(&x, 1, k, dtype, &packed, n, Path::Portable);
                if case == 0 {
                    assert!(reference.iter().all(|&v| v == 0.0));
                }
                for path in Path::ALL.into_iter().filter(|p| p.available()) {
                    let got = matmul(&x, 1, k, dtype, &packed, n, path);
                    for j in 0..n {
                        let at = format!("{path:?} {dtype:?} case {case} col {j}");
                        assert_eq!(got[j].to_bits(), reference[j].to_bits(), "{at}");
                        assert_within_activation_rounding(got[j], &wd[j * k..(j + 1) * k], &x, &at);
                    }
                }
            }
        }
    }
}
