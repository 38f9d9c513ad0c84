//! llama.cpp's 4-bit non-linear formats, IQ4_NL and IQ4_XS: each value a 4-bit index into one
//! fixed table of 16 signed 8-bit levels, times a block scale. candle's GGML module does not
//! read them, so they are read here: dequantized to f32 for the exact path; IQ4_NL blocks go to
//! the integer kernels as they are ([`super::formats::Format::Iq4Nl`]), IQ4_XS ones as IQ4_NL.
//!
//! - IQ4_NL: blocks of 32 values, `{ f16 d; u8 qs[16] }` (18 bytes). Value j < 16 is
//!   `d * LEVELS[qs[j] & 15]`, value j + 16 is `d * LEVELS[qs[j] >> 4]` (Q4_0's nibble order).
//! - IQ4_XS: super-blocks of 256 values, `{ f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }`
//!   (136 bytes): eight sub-blocks of 32, sub-block i scaled by `d * (ls_i - 32)` with a 6-bit
//!   `ls_i` (low 4 bits in `scales_l`, high 2 in `scales_h`), its values as IQ4_NL's. As IQ4_NL
//!   (18 bytes per 32 values against 17) each sub-block keeps its indices and takes that scale
//!   rounded to f16: every value within a relative 2^-11 of its IQ4_XS value (the rounding of
//!   one f16 product) where that scale is a normal f16 (at least 6.1e-5; a smaller one is
//!   rounded to f16's subnormal step of 6e-8).

use half::f16;
use rayon::prelude::*;

/// The 16 levels of both formats (ggml's `kvalues_iq4nl`).
pub const LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// One of the two formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Iq4 {
    Nl,
    Xs,
}

impl Iq4 {
    pub fn name(self) -> &'static str {
        match self {
            Iq4::Nl => "iq4_nl",
            Iq4::Xs => "iq4_xs",
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Iq4::Nl => 32,
            Iq4::Xs => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Iq4::Nl => 18,
            Iq4::Xs => 136,
        }
    }

    /// The 32-value sub-blocks of one block: (scale, 16 bytes of indices) for each.
    fn sub_blocks(self, block: &[u8]) -> impl Iterator<Item = (f32, &[u8])> {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let (subs, qs) = (self.block_size() / 32, &block[self.type_size() - self.block_size() / 2..]);
        let high = u16::from_le_bytes([block[2], block[3]]); // IQ4_XS's scales_h
        let scale = move |i: usize| match self {
            Iq4::Nl => d,
            Iq4::Xs => {
                let low = (block[4 + i / 2] >> (4 * (i % 2))) & 15;
                let ls = low as i32 | ((((high >> (2 * i)) & 3) as i32) << 4);
                d * (ls - 32) as f32
            }
        };
        qs.chunks_exact(16).take(subs).enumerate().map(move |(i, q)| (scale(i), q))
    }

    /// Whole blocks: asserts `bytes` holds a whole number of them.
    fn blocks(self, bytes: &[u8]) -> std::slice::ChunksExact<'_, u8> {
        assert_eq!(bytes.len() % self.type_size(), 0, "{} bytes are not whole {} blocks", bytes.len(), self.name());
        bytes.chunks_exact(self.type_size())
    }
}

/// Dequantizes whole blocks `bytes` of `kind` into `out` (one f32 per value).
pub fn dequantize(kind: Iq4, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), bytes.len() / kind.type_size() * kind.block_size(), "output size");
    for (block, values) in kind.blocks(bytes).zip(out.chunks_exact_mut(kind.block_size())) {
        for ((scale, qs), values) in kind.sub_blocks(block).zip(values.chunks_exact_mut(32)) {
            let (low, high) = values.split_at_mut(16);
            for ((&q, l), h) in qs.iter().zip(low).zip(high) {
                *l = scale * LEVELS[(q & 15) as usize] as f32;
                *h = scale * LEVELS[(q >> 4) as usize] as f32;
            }
        }
    }
}

/// IQ4_XS blocks `bytes` as IQ4_NL blocks (in order, 18 bytes per 32 values), converted in
/// parallel: each sub-block keeps its indices and takes its scale rounded to f16. None when
/// such a scale overflows f16 (a super-block scale above 2,047: quantize the dequantized
/// values instead).
pub fn xs_to_nl(bytes: &[u8]) -> Option<Vec<u8>> {
    let (xs, nl) = (Iq4::Xs, Iq4::Nl);
    let per_block = xs.block_size() / nl.block_size() * nl.type_size();
    let mut out = vec![0u8; xs.blocks(bytes).len() * per_block];
    let fits = out.par_chunks_mut(per_block).zip(bytes.par_chunks(xs.type_size())).all(|(out, block)| {
        xs.sub_blocks(block).zip(out.chunks_exact_mut(nl.type_size())).all(|((scale, qs), nl)| {
            let d = f16::from_f32(scale);
            nl[..2].copy_from_slice(&d.to_le_bytes());
            nl[2..].copy_from_slice(qs);
            d.is_finite() || !scale.is_finite()
        })
    });
    fits.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of `kind` from a simple generator: any bytes are a valid block once the scale is a
    /// finite f16.
    fn blocks(kind: Iq4, count: usize, seed: u32) -> Vec<u8> {
        let mut state = seed;
        let mut bytes: Vec<u8> = (0..count * kind.type_size())
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as u8
            })
            .collect();
        for (i, block) in bytes.chunks_exact_mut(kind.type_size()).enumerate() {
            block[..2].copy_from_slice(&f16::from_f32(0.001 * (i as f32 + 1.0)).to_le_bytes());
        }
        bytes
    }

    /// The formats' definitions written out value by value, as ggml's
    /// `dequantize_row_iq4_nl` / `dequantize_row_iq4_xs` loop.
    fn reference(kind: Iq4, bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for block in bytes.chunks_exact(kind.type_size()) {
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            match kind {
                Iq4::Nl => {
                    let qs = &block[2..];
                    out.extend((0..16).map(|j| d * LEVELS[(qs[j] & 15) as usize] as f32));
                    out.extend((0..16).map(|j| d * LEVELS[(qs[j] >> 4) as usize] as f32));
                }
                Iq4::Xs => {
                    let scales_h = u16::from_le_bytes([block[2], block[3]]) as i32;
                    for ib in 0..8 {
                        let ls = ((block[4 + ib / 2] as i32 >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4);
                        let dl = d * (ls - 32) as f32;
                        let qs = &block[8 + 16 * ib..8 + 16 * ib + 16];
                        out.extend((0..16).map(|j| dl * LEVELS[(qs[j] & 15) as usize] as f32));
                        out.extend((0..16).map(|j| dl * LEVELS[(qs[j] >> 4) as usize] as f32));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn dequantizes_as_ggml_defines_the_formats() {
        for kind in [Iq4::Nl, Iq4::Xs] {
            let bytes = blocks(kind, 5, 7);
            let mut got = vec![0f32; 5 * kind.block_size()];
            dequantize(kind, &bytes, &mut got);
            assert_eq!(got, reference(kind, &bytes), "{kind:?}");
        }
    }

    #[test]
    fn iq4_xs_becomes_iq4_nl_within_an_f16_rounding() {
        let bytes = blocks(Iq4::Xs, 3, 11);
        let want = reference(Iq4::Xs, &bytes);
        let nl = xs_to_nl(&bytes).expect("scales fit f16");
        assert_eq!(nl.len(), want.len() / 32 * Iq4::Nl.type_size());
        let mut got = vec![0f32; want.len()];
        dequantize(Iq4::Nl, &nl, &mut got);
        assert_eq!(got, reference(Iq4::Nl, &nl));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= w.abs() * 2f32.powi(-11), "{g} vs {w}");
        }
    }

    #[test]
    fn a_scale_beyond_f16_is_left_to_the_caller() {
        let mut bytes = blocks(Iq4::Xs, 1, 3);
        bytes[..2].copy_from_slice(&f16::from_f32(60_000.0).to_le_bytes());
        // Sub-block 0's 6-bit ls = 0: a scale of -32 d, beyond f16's 65,504.
        bytes[4] &= !15;
        bytes[2] &= !3;
        assert!(xs_to_nl(&bytes).is_none());
    }
}
