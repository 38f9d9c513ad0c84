//! GGML block formats as raw bytes: which ones tpserve keeps resident, their sizes, and how a
//! rank cuts its slice out of a tensor without dequantizing the whole tensor.
//!
//! A quantized matrix is held row-major, each row a whole number of blocks (a GGUF tensor's
//! rows always are). Cutting rows (column-parallel layers, the vocabulary slice) copies whole
//! block rows. Cutting columns (row-parallel layers) copies whole blocks when the cut falls on
//! block boundaries; when it falls inside a block (a 256-wide K-quant block and a 192-wide
//! shard), the covered blocks are dequantized and the slice re-quantized to Q8_0, whose 32-wide
//! blocks fit more cuts; where even those do not fit, the slice stays f32. Both fallbacks are
//! logged once per kind.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Mutex;

use anyhow::{Result, bail};
use rayon::prelude::*;
use candle_core::quantized::GgmlDType;

use super::iq4::{self, Iq4};
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, GgmlType,
};

/// A block format held resident and multiplied by the integer kernels: GGML's 32-value formats
/// and K-quants (their blocks as candle's `k_quants` types define them), and IQ4_NL (4-bit
/// levels from a table, [`super::iq4`]). tpserve's own type: candle's `GgmlDType` has no IQ4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
}

impl Format {
    /// The formats candle's block types define: every one but IQ4_NL.
    const GGML: [Format; 10] = {
        use Format::*;
        [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K]
    };

    /// The format of a tensor stored in `dtype`, when it is one held resident.
    pub fn of_ggml(dtype: GgmlDType) -> Option<Format> {
        Format::GGML.into_iter().find(|f| f.ggml() == Some(dtype))
    }

    /// candle's name for it, whose block type dequantizes and quantizes it; None for IQ4_NL.
    pub fn ggml(self) -> Option<GgmlDType> {
        use Format::*;
        Some(match self {
            Q4_0 => GgmlDType::Q4_0,
            Q4_1 => GgmlDType::Q4_1,
            Q5_0 => GgmlDType::Q5_0,
            Q5_1 => GgmlDType::Q5_1,
            Q8_0 => GgmlDType::Q8_0,
            Q2K => GgmlDType::Q2K,
            Q3K => GgmlDType::Q3K,
            Q4K => GgmlDType::Q4K,
            Q5K => GgmlDType::Q5K,
            Q6K => GgmlDType::Q6K,
            Iq4Nl => return None,
        })
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        self.ggml().map_or(Iq4::Nl.block_size(), |d| d.block_size())
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.ggml().map_or(Iq4::Nl.type_size(), |d| d.type_size())
    }

    /// K-quants: 256-value super-blocks, multiplied against Q8_K activations.
    pub fn is_k_quant(self) -> bool {
        use Format::*;
        matches!(self, Q2K | Q3K | Q4K | Q5K | Q6K)
    }

    /// The GGUF name, lower case (`q4_k`, `q8_0`, `iq4_nl`).
    pub fn name(self) -> &'static str {
        use Format::*;
        match self {
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q2K => "q2_k",
            Q3K => "q3_k",
            Q4K => "q4_k",
            Q5K => "q5_k",
            Q6K => "q6_k",
            Iq4Nl => Iq4::Nl.name(),
        }
    }
}

/// A `--quantize` value: a format tpserve quantizes to, by its GGUF name (case-insensitive).
/// Every format but IQ4_NL, which is read from files only (its levels need llama.cpp's search
/// for the best scale to quantize well).
pub fn parse(text: &str) -> Option<Format> {
    Format::GGML.into_iter().find(|d| d.name().eq_ignore_ascii_case(text))
}

/// Bytes of one row of `cols` values (`cols` a multiple of the block size).
pub fn row_bytes(dtype: Format, cols: usize) -> usize {
    cols / dtype.block_size() * dtype.type_size()
}

/// Calls `$body` with `$t` bound to candle's block type of `$dtype` (any format but IQ4_NL).
macro_rules! with_block_type {
    ($dtype:expr, $t:ident => $body:expr) => {{
        use Format as G;
        match $dtype {
            G::Q4_0 => { type $t = BlockQ4_0; $body }
            G::Q4_1 => { type $t = BlockQ4_1; $body }
            G::Q5_0 => { type $t = BlockQ5_0; $body }
            G::Q5_1 => { type $t = BlockQ5_1; $body }
            G::Q8_0 => { type $t = BlockQ8_0; $body }
            G::Q2K => { type $t = BlockQ2K; $body }
            G::Q3K => { type $t = BlockQ3K; $body }
            G::Q4K => { type $t = BlockQ4K; $body }
            G::Q5K => { type $t = BlockQ5K; $body }
            G::Q6K => { type $t = BlockQ6K; $body }
            G::Iq4Nl => panic!("IQ4_NL has no candle block type"),
        }
    }};
}

/// Runs `f` on `bytes` viewed as blocks of `T` (copied into an aligned buffer if they are not
/// aligned for `T`; allocations are in practice, so this copy is a safety net).
pub(crate) fn with_blocks<T: GgmlType, R>(bytes: &[u8], f: impl FnOnce(&[T]) -> R) -> R {
    let size = std::mem::size_of::<T>();
    assert_eq!(bytes.len() % size, 0, "{} bytes are not whole {:?} blocks", bytes.len(), T::DTYPE);
    assert_eq!(size, T::DTYPE.type_size());
    let count = bytes.len() / size;
    if (bytes.as_ptr() as usize) % std::mem::align_of::<T>() == 0 {
        // SAFETY: the block types are #[repr(C)] structs of f16/f32/integer fields, for which every
        // bit pattern is valid; the pointer is aligned for T (checked) and `count * size_of::<T>()`
        // bytes are in bounds (checked above); the borrow of `bytes` outlives the slice.
        f(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), count) })
    } else {
        let mut blocks: Vec<T> = (0..count).map(|_| T::zeros()).collect();
        // SAFETY: `blocks` owns count * size bytes, written here from `bytes` of the same length;
        // any byte pattern is a valid block (see above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), blocks.as_mut_ptr().cast::<u8>(), bytes.len()) };
        f(&blocks)
    }
}

/// Dequantizes whole blocks `bytes` of `dtype` into `out` (one f32 per value).
pub fn dequantize(dtype: Format, bytes: &[u8], out: &mut [f32]) {
    if dtype == Format::Iq4Nl {
        return iq4::dequantize(Iq4::Nl, bytes, out);
    }
    with_block_type!(dtype, T => with_blocks::<T, _>(bytes, |blocks| T::to_float(blocks, out)))
}

/// Quantizes `values` (a multiple of the block size) to `dtype` (one [`parse`] admits: not
/// IQ4_NL), appending the blocks to `out`.
pub fn quantize_into(dtype: Format, values: &[f32], out: &mut Vec<u8>) {
    with_block_type!(dtype, T => {
        let mut blocks: Vec<T> = (0..values.len() / T::BLCK_SIZE).map(|_| T::zeros()).collect();
        T::from_float(values, &mut blocks);
        // SAFETY: the blocks are plain #[repr(C)] data; viewing them as their bytes reads
        // exactly blocks.len() * size_of::<T>() initialised bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), blocks.len() * std::mem::size_of::<T>())
        };
        out.extend_from_slice(bytes);
    })
}

/// Logs `message` at most once per process (per distinct text).
pub fn log_once(message: String) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(message.clone()) {
        tracing::info!("{message}");
    }
}

/// A rank's slice of a quantized matrix: blocks of one format, or f32 where none fits.
pub enum Sliced {
    Blocks { dtype: Format, rows: usize, cols: usize, bytes: Vec<u8> },
    F32 { rows: usize, cols: usize, values: Vec<f32> },
}

impl Sliced {
    /// The rows of `parts` (slices of one width) stacked in order, when they share a format:
    /// blocks of one dtype or all f32, whose row-major layout makes that an append. Parts of
    /// mixed formats come back unchanged.
    pub fn stack_rows(parts: Vec<Sliced>) -> std::result::Result<Sliced, Vec<Sliced>> {
        match parts.first() {
            Some(&Sliced::Blocks { dtype, cols, .. })
                if parts.iter().all(|p| matches!(p, Sliced::Blocks { dtype: d, cols: c, .. } if *d == dtype && *c == cols)) =>
            {
                let (mut rows, mut bytes) = (0, Vec::with_capacity(parts.iter().map(Sliced::bytes).sum()));
                for part in parts {
                    if let Sliced::Blocks { rows: more, bytes: tail, .. } = part {
                        rows += more;
                        bytes.extend_from_slice(&tail);
                    }
                }
                Ok(Sliced::Blocks { dtype, rows, cols, bytes })
            }
            Some(&Sliced::F32 { cols, .. }) if parts.iter().all(|p| matches!(p, Sliced::F32 { cols: c, .. } if *c == cols)) => {
                let (mut rows, mut values) = (0, Vec::with_capacity(parts.iter().map(Sliced::bytes).sum::<usize>() / 4));
                for part in parts {
                    if let Sliced::F32 { rows: more, values: tail, .. } = part {
                        rows += more;
                        values.extend_from_slice(&tail);
                    }
                }
                Ok(Sliced::F32 { rows, cols, values })
            }
            _ => Err(parts),
        }
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        match self {
            Sliced::Blocks { bytes, .. } => bytes.len(),
            Sliced::F32 { values, .. } => values.len() * 4,
        }
    }
}

/// Cuts `ranges` of dimension `dim` (0: rows, 1: columns) out of a row-major `[rows, cols]`
/// matrix of `dtype` blocks, in the order given (their concatenation). `row_order`, when set,
/// maps each output row to the stored row it comes from (GGUF's permuted q/k rows).
pub fn slice(
    dtype: Format,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    dim: usize,
    ranges: &[Range<usize>],
    row_order: Option<&[usize]>,
) -> Result<Sliced> {
    let rb = row_bytes(dtype, cols);
    if bytes.len() != rows * rb {
        bail!("{} bytes do not hold {rows} rows of {cols} {} values", bytes.len(), dtype.name());
    }
    fn row_of<'a>(bytes: &'a [u8], rb: usize, order: Option<&[usize]>, r: usize) -> &'a [u8] {
        let stored = order.map_or(r, |order| order[r]);
        &bytes[stored * rb..(stored + 1) * rb]
    }
    let row = |r: usize| row_of(bytes, rb, row_order, r);
    let size = if dim == 0 { rows } else { cols };
    for range in ranges {
        if range.start > range.end || range.end > size {
            bail!("slice {range:?} of dimension {dim} is out of bounds for shape [{rows}, {cols}]");
        }
    }
    let selected: usize = ranges.iter().map(|r| r.len()).sum();
    match dim {
        0 => {
            let mut out = Vec::with_capacity(selected * rb);
            for range in ranges {
                for r in range.clone() {
                    out.extend_from_slice(row(r));
                }
            }
            Ok(Sliced::Blocks { dtype, rows: selected, cols, bytes: out })
        }
        1 => {
            let block = dtype.block_size();
            let ts = dtype.type_size();
            if ranges.iter().all(|r| r.start % block == 0 && r.end % block == 0) {
                let mut out = Vec::with_capacity(rows * row_bytes(dtype, selected));
                for r in 0..rows {
                    let row = row(r);
                    for range in ranges {
                        out.extend_from_slice(&row[range.start / block * ts..range.end / block * ts]);
                    }
                }
                return Ok(Sliced::Blocks { dtype, rows, cols: selected, bytes: out });
            }
            // Dequantize only the blocks each range covers, one row at a time.
            let mut values = Vec::with_capacity(rows * selected);
            let mut scratch = Vec::new();
            for r in 0..rows {
                let row = row(r);
                for range in ranges {
                    let (first, last) = (range.start / block, range.end.div_ceil(block));
                    scratch.resize((last - first) * block, 0.0);
                    dequantize(dtype, &row[first * ts..last * ts], &mut scratch);
                    let offset = first * block;
                    values.extend_from_slice(&scratch[range.start - offset..range.end - offset]);
                }
            }
            let q8 = Format::Q8_0;
            if selected % q8.block_size() == 0 && selected > 0 {
                log_once(format!(
                    "{} tensors cut inside their {block}-value blocks are re-quantized to q8_0 on this rank",
                    dtype.name()
                ));
                let mut out = Vec::with_capacity(rows * row_bytes(q8, selected));
                for row in values.chunks_exact(selected) {
                    quantize_into(q8, row, &mut out);
                }
                Ok(Sliced::Blocks { dtype: q8, rows, cols: selected, bytes: out })
            } else {
                log_once(format!(
                    "{} tensors cut into slices of {selected} columns (not whole q8_0 blocks) are held in f32 on this rank",
                    dtype.name()
                ));
                Ok(Sliced::F32 { rows, cols: selected, values })
            }
        }
        _ => bail!("a quantized matrix has no dimension {dim}"),
    }
}

/// Quantizes a row-major `[rows, cols]` f32 matrix to `dtype`, or to Q8_0 when its rows are not
/// whole `dtype` blocks, or leaves it f32 when they are not even whole Q8_0 blocks (logged once).
pub fn quantize_matrix(dtype: Format, rows: usize, cols: usize, values: Vec<f32>) -> Sliced {
    let target = if cols % dtype.block_size() == 0 {
        dtype
    } else if cols % Format::Q8_0.block_size() == 0 {
        log_once(format!(
            "matrices with rows of {cols} values (not whole {} blocks of {}) are quantized to q8_0 instead",
            dtype.name(),
            dtype.block_size()
        ));
        Format::Q8_0
    } else {
        log_once(format!("matrices with rows of {cols} values (not whole q8_0 blocks) stay f32"));
        return Sliced::F32 { rows, cols, values };
    };
    // Rows are independent: quantize them across the rayon pool (a rank's load-time
    // quantization is bound by this loop).
    let rb = row_bytes(target, cols);
    let mut out = vec![0u8; rows * rb];
    if rb == 0 {
        return Sliced::Blocks { dtype: target, rows, cols, bytes: out };
    }
    out.par_chunks_mut(rb).zip(values.par_chunks(cols)).for_each_init(
        || Vec::with_capacity(rb),
        |scratch, (dst, row)| {
            scratch.clear();
            quantize_into(target, row, scratch);
            dst.copy_from_slice(scratch);
        },
    );
    Sliced::Blocks { dtype: target, rows, cols, bytes: out }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    /// Slices of one format stack into one (blocks appended row by row); mixed formats or
    /// widths are handed back.
    #[test]
    fn stack_rows_appends_slices_of_one_format() {
        let blocks = |rows: usize, cols: usize, fill: u8| Sliced::Blocks { dtype: Format::Q8_0, rows, cols, bytes: vec![fill; rows * row_bytes(Format::Q8_0, cols)] };
        let Ok(Sliced::Blocks { rows, cols, bytes, .. }) = Sliced::stack_rows(vec![blocks(2, 64, 1), blocks(3, 64, 2)]) else { panic!("one format stacks") };
        assert_eq!((rows, cols, bytes.len()), (5, 64, 5 * 68));
        assert!(bytes[..2 * 68].iter().all(|&b| b == 1) && bytes[2 * 68..].iter().all(|&b| b == 2));
        let f32s = vec![Sliced::F32 { rows: 1, cols: 2, values: vec![1.0, 2.0] }, Sliced::F32 { rows: 1, cols: 2, values: vec![3.0, 4.0] }];
        let Ok(Sliced::F32 { rows: 2, values, .. }) = Sliced::stack_rows(f32s) else { panic!("f32 stacks") };
        assert_eq!(values, [1.0, 2.0, 3.0, 4.0]);
        let mixed = vec![blocks(2, 64, 1), Sliced::F32 { rows: 1, cols: 64, values: vec![0.0; 64] }];
        assert_eq!(Sliced::stack_rows(mixed).err().map(|parts| parts.len()), Some(2));
        assert_eq!(Sliced::stack_rows(vec![blocks(2, 64, 1), blocks(2, 32, 1)]).err().map(|parts| parts.len()), Some(2));
    }

    fn dequantized(sliced: &Sliced) -> Vec<f32> {
        match sliced {
            Sliced::Blocks { dtype, rows, cols, bytes } => {
                let mut out = vec![0f32; rows * cols];
                dequantize(*dtype, bytes, &mut out);
                out
            }
            Sliced::F32 { values, .. } => values.clone(),
        }
    }

    #[test]
    fn slices_match_slices_of_the_dequantized_matrix() {
        use Format::*;
        for dtype in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K] {
            let (rows, cols) = (7, 512);
            let Sliced::Blocks { bytes, .. } = quantize_matrix(dtype, rows, cols, values(rows * cols, 3)) else { panic!() };
            let mut full = vec![0f32; rows * cols];
            dequantize(dtype, &bytes, &mut full);
            // rows, with a reordering
            let order = [6, 5, 4, 3, 2, 1, 0];
            let s = slice(dtype, rows, cols, &bytes, 0, &[1..3, 5..7], Some(&order)).unwrap();
            let expect: Vec<f32> = [5, 4, 1, 0].iter().flat_map(|&r| full[r * cols..(r + 1) * cols].to_vec()).collect();
            assert_eq!(dequantized(&s), expect, "{dtype:?} rows");
            // columns on block boundaries: the same blocks
            let s = slice(dtype, rows, cols, &bytes, 1, &[256..512], None).unwrap();
            assert!(matches!(s, Sliced::Blocks { dtype: d, .. } if d == dtype));
            let expect: Vec<f32> = (0..rows).flat_map(|r| full[r * cols + 256..(r + 1) * cols].to_vec()).collect();
            assert_eq!(dequantized(&s), expect, "{dtype:?} aligned columns");
            // columns inside blocks (of K-quants): Q8_0, close to the original values
            let s = slice(dtype, rows, cols, &bytes, 1, &[192..384], None).unwrap();
            let expect: Vec<f32> = (0..rows).flat_map(|r| full[r * cols + 192..r * cols + 384].to_vec()).collect();
            match &s {
                Sliced::Blocks { dtype: d, .. } if dtype.is_k_quant() => assert_eq!(*d, Q8_0),
                Sliced::Blocks { dtype: d, .. } => assert_eq!(*d, dtype),
                Sliced::F32 { .. } => panic!("192 columns fit q8_0"),
            }
            let got = dequantized(&s);
            for (a, b) in got.iter().zip(&expect) {
                assert!((a - b).abs() <= 0.01, "{dtype:?}: {a} vs {b}");
            }
            // 40 columns: not whole q8_0 blocks, f32 exactly
            let s = slice(dtype, rows, cols, &bytes, 1, &[4..44], None).unwrap();
            let expect: Vec<f32> = (0..rows).flat_map(|r| full[r * cols + 4..r * cols + 44].to_vec()).collect();
            assert!(matches!(s, Sliced::F32 { .. }));
            assert_eq!(dequantized(&s), expect);
        }
    }

    #[test]
    fn parses_names() {
        assert_eq!(parse("q4_k"), Some(Format::Q4K));
        assert_eq!(parse("Q8_0"), Some(Format::Q8_0));
        assert_eq!(parse("q8_1"), None);
        assert_eq!(parse("f32"), None);
    }
}
