//! Quantized weights that stay quantized: GGML blocks resident on the CPU, multiplied by f32
//! activations through integer kernels.
//!
//! The byte-level parts live in the `tpserve-kernels` crate (compiled optimized in every
//! profile) and are re-exported here:
//!
//! - [`formats`]: the block formats, a rank's slice of a quantized tensor (whole block rows;
//!   columns on block boundaries, else re-quantized to Q8_0, else f32), load-time quantization.
//! - [`kernels`]: activations quantized per block to 8 bits and integer dot products, AVX-512
//!   VNNI / AVX2 / portable, chosen in one place ([`kernels::Path::selected`]).
//! - [`interleaved`]: the resident layout of the 32-value block formats (Q4_0..Q8_0, IQ4_NL), Q4_K,
//!   Q5_K and Q6_K, eight rows interleaved so that one vector holds the same block of eight rows, and its
//!   products.
//! - [`Weight`]: the weight of a linear layer, embedding or LM head: dense, in column panels
//!   (dense on a CPU with a panel kernel, `crate::model::panels`), or quantized.

pub use tpserve_kernels::quant::{formats, interleaved, kernels};

use std::sync::Arc;

use anyhow::{Result, bail};
use candle_core::{DType, Device, Storage, Tensor};

use super::panels::PanelMatrix;
use super::placement::with_host_f32;
pub use tpserve_kernels::panels::Products;
pub use formats::{Format, Sliced};

/// How a loader treats the weights of matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantMode {
    /// Dense, in the matmul dtype (GGUF tensors dequantized to f32): today's exact path.
    #[default]
    Off,
    /// GGUF tensors in a supported block format stay in their blocks (`--dtype auto` on CPU).
    KeepGguf,
    /// Every matrix is quantized to this format at load time (`--quantize`), each rank its slice.
    To(Format),
}

/// Rows of one format inside a [`QMatrix`] (the fused q/k/v of a Q4_K_M file mixes formats).
#[derive(Clone)]
pub struct Segment {
    /// the block format, or None for a dense f32 part
    pub format: Option<Format>,
    pub rows: usize,
    /// U8 `[rows, row_bytes]` of blocks (eight rows interleaved where
    /// [`interleaved::packable`]), or F32 `[rows, cols]`
    data: Tensor,
}

impl Segment {
    /// A segment of `rows` rows of `cols` values from GGML's row-major block bytes.
    fn blocks(dtype: Format, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self> {
        let rb = formats::row_bytes(dtype, cols);
        let bytes = if interleaved::packable(dtype) { interleaved::pack(dtype, rows, cols, &bytes) } else { bytes };
        Ok(Segment { format: Some(dtype), rows, data: Tensor::from_vec(bytes, (rows, rb), &Device::Cpu)? })
    }

    /// Its blocks (format `dtype`) in GGML's row-major layout (a copy).
    fn row_major_bytes(&self, dtype: Format, cols: usize) -> Result<Vec<u8>> {
        with_bytes(&self.data, |bytes| {
            if interleaved::packable(dtype) { interleaved::unpack(dtype, self.rows, cols, bytes) } else { bytes.to_vec() }
        })
    }

    /// `segments` of format `dtype` stacked into one. Their held bytes are appended where that
    /// is the stack's layout: a format in row layout, or an interleaved one where every segment
    /// but the last is whole groups of eight rows (as the fused q/k/v and gate/up of a model
    /// are). Others go through GGML's row layout and are interleaved anew.
    fn stack(dtype: Format, cols: usize, mut segments: Vec<Segment>) -> Result<Self> {
        if let [_] = segments[..]
            && let Some(only) = segments.pop()
        {
            return Ok(only);
        }
        let rows = segments.iter().map(|s| s.rows).sum();
        let whole_groups = segments[..segments.len() - 1].iter().all(|s| s.rows % interleaved::GROUP == 0);
        if interleaved::packable(dtype) && !whole_groups {
            let mut bytes = Vec::new();
            for s in &segments {
                bytes.extend(s.row_major_bytes(dtype, cols)?);
            }
            return Segment::blocks(dtype, rows, cols, bytes);
        }
        let rb = formats::row_bytes(dtype, cols);
        let mut bytes = Vec::with_capacity(rows * rb);
        // a resident weight, as `interleaved::pack`'s output is
        tpserve_kernels::pages::advise_unwritten(bytes.spare_capacity_mut());
        for s in &segments {
            with_bytes(&s.data, |held| bytes.extend_from_slice(held))?;
        }
        Ok(Segment { format: Some(dtype), rows, data: Tensor::from_vec(bytes, (rows, rb), &Device::Cpu)? })
    }

    /// Its format's GGUF name (`q4_k`), or `f32`.
    pub fn format_name(&self) -> &'static str {
        self.format.map_or("f32", Format::name)
    }

    pub fn resident_bytes(&self) -> usize {
        self.data.elem_count() * self.data.dtype().size_in_bytes()
    }
}

/// A `[rows, cols]` matrix held as row segments of GGML blocks.
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub segments: Vec<Segment>,
}

/// The weight of a matrix product `x @ w.T`: dense (any dtype, any device), dense f32 or bf16
/// in column panels (CPU), or quantized (CPU).
#[derive(Clone)]
pub enum Weight {
    Dense(Tensor),
    Panels(Arc<PanelMatrix>),
    Quant(Arc<QMatrix>),
}

/// Runs `f` on the bytes of a contiguous U8 CPU tensor.
fn with_bytes<R>(tensor: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { bail!("quantized weights live on the CPU") };
    let all = cpu.as_slice::<u8>()?;
    let start = layout.start_offset();
    Ok(f(&all[start..start + tensor.elem_count()]))
}

/// A panel weight's format: its dtype, and `bf16 (bf16 products)` for bf16 weights whose
/// activations are rounded to bf16.
pub(crate) fn panel_format(p: &PanelMatrix) -> String {
    let dtype = format!("{:?}", p.dtype()).to_lowercase();
    if p.products() == Products::Bf16 { format!("{dtype} (bf16 products)") } else { dtype }
}

impl Weight {
    /// A dense weight as it is best held here: in panels where [`PanelMatrix::applies`] (an f32
    /// or bf16 CPU tensor, an AVX-512 CPU), multiplied in precision `products` if bf16; else as
    /// it is (exact products).
    pub fn dense(t: Tensor, products: Products) -> Result<Self> {
        Ok(if PanelMatrix::applies(&t) { Weight::Panels(Arc::new(PanelMatrix::pack(&t, products)?)) } else { Weight::Dense(t) })
    }

    /// How its products are computed: [`Products::Bf16`] only for bf16 panels loaded so.
    pub fn products(&self) -> Products {
        match self {
            Weight::Panels(p) => p.products(),
            Weight::Dense(_) | Weight::Quant(_) => Products::Exact,
        }
    }

    /// A dense weight as a row-major tensor (panels unpacked); None when quantized.
    fn row_major(&self) -> Result<Option<Tensor>> {
        Ok(match self {
            Weight::Dense(t) => Some(t.clone()),
            Weight::Panels(p) => Some(p.unpack()?),
            Weight::Quant(_) => None,
        })
    }

    /// A rank's slice as a weight: blocks stay blocks, f32 becomes a dense tensor.
    pub fn from_sliced(sliced: Sliced, device: &Device) -> Result<Self> {
        if !device.is_cpu() {
            bail!("quantized weights are only supported on the CPU");
        }
        Ok(match sliced {
            Sliced::Blocks { dtype, rows, cols, bytes } => {
                Weight::Quant(Arc::new(QMatrix { rows, cols, segments: vec![Segment::blocks(dtype, rows, cols, bytes)?] }))
            }
            Sliced::F32 { rows, cols, values } => Weight::dense(Tensor::from_vec(values, (rows, cols), device)?, Products::Exact)?,
        })
    }

    /// The host tensors that can move into another buffer (`crate::model::arena`): a dense
    /// matrix, a packing of column panels, or a quantized one's blocks, when no other weight
    /// shares them (a tied embedding's are the LM head's too). Gathered, the f32 panels of the
    /// 100M test shape (288 of 381 MiB, 97 MiB of which had been in 4 KiB pages) took 6% less
    /// time a decode step at one row and 8% less at 16 (Zen 5, 2 threads, medians of 4
    /// alternating runs); its bf16 panels (144 of 190 MiB) 1-18% less at one row, 0-6% at 16.
    pub fn host_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            Weight::Dense(t) => vec![t],
            Weight::Panels(p) => Arc::get_mut(p).map_or_else(Vec::new, |p| vec![p.data_mut()]),
            Weight::Quant(q) => Arc::get_mut(q).map_or_else(Vec::new, |q| q.segments.iter_mut().map(|s| &mut s.data).collect()),
        }
    }

    /// The tensors that hold it (their bytes are its resident size).
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Weight::Dense(t) => vec![t],
            Weight::Panels(p) => vec![p.data()],
            Weight::Quant(q) => q.segments.iter().map(|s| &s.data).collect(),
        }
    }

    pub fn resident_bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    pub fn device(&self) -> Device {
        match self {
            Weight::Dense(t) => t.device().clone(),
            Weight::Panels(_) | Weight::Quant(_) => Device::Cpu,
        }
    }

    /// `[rows, cols]`.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match self {
            Weight::Dense(t) => Ok(t.dims2()?),
            Weight::Panels(p) => Ok((p.rows, p.cols)),
            Weight::Quant(q) => Ok((q.rows, q.cols)),
        }
    }

    /// The format(s) it is held in: `q4_1`, `q4_k+q6_k`, `f32`, `bf16`.
    pub fn format(&self) -> String {
        match self {
            Weight::Dense(t) => format!("{:?}", t.dtype()).to_lowercase(),
            Weight::Panels(p) => panel_format(p),
            Weight::Quant(q) => {
                let mut names: Vec<&str> = Vec::new();
                for s in &q.segments {
                    let name = s.format_name();
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
                names.join("+")
            }
        }
    }

    /// Stacks the rows of `parts` (fused q/k/v, gate/up), which share a precision.
    pub fn cat_rows(parts: Vec<Weight>) -> Result<Weight> {
        if parts.len() == 1 {
            return Ok(parts.into_iter().next().expect("one part"));
        }
        // Panels stack as they are where they can; other dense parts (panels unpacked) are
        // stacked row-major, then held as one weight again.
        let packed: Vec<&PanelMatrix> = parts.iter().filter_map(|p| if let Weight::Panels(p) = p { Some(p.as_ref()) } else { None }).collect();
        if packed.len() == parts.len() && let Some(stacked) = PanelMatrix::stack(&packed)? {
            return Ok(Weight::Panels(Arc::new(stacked)));
        }
        if parts.iter().all(|p| !matches!(p, Weight::Quant(_))) {
            let dense: Vec<Tensor> = parts.iter().map(Weight::row_major).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
            let products = parts[0].products();
            return Weight::dense(Tensor::cat(&dense, 0)?, products);
        }
        let cols = parts[0].dims2()?.1;
        // Consecutive parts of one format merge into one segment ([`Segment::stack`]; f32 rows
        // concatenated).
        enum Run {
            Blocks(Format, Vec<Segment>),
            Dense(Vec<Tensor>),
        }
        let mut runs: Vec<Run> = Vec::new();
        let mut rows = 0;
        for part in parts {
            let (part_rows, part_cols) = part.dims2()?;
            if part_cols != cols {
                bail!("cannot stack weights of {part_cols} and {cols} columns");
            }
            rows += part_rows;
            let pieces: Vec<Run> = match part {
                Weight::Dense(t) => vec![Run::Dense(vec![t.to_dtype(DType::F32)?])],
                Weight::Panels(p) => vec![Run::Dense(vec![p.unpack()?.to_dtype(DType::F32)?])],
                Weight::Quant(q) => q
                    .segments
                    .iter()
                    .map(|s| match s.format {
                        Some(dtype) => Run::Blocks(dtype, vec![s.clone()]),
                        None => Run::Dense(vec![s.data.clone()]),
                    })
                    .collect(),
            };
            for piece in pieces {
                match (runs.last_mut(), piece) {
                    (Some(Run::Blocks(dtype, segments)), Run::Blocks(d, more)) if *dtype == d => segments.extend(more),
                    (Some(Run::Dense(tensors)), Run::Dense(more)) => tensors.extend(more),
                    (_, piece) => runs.push(piece),
                }
            }
        }
        let segments = runs
            .into_iter()
            .map(|run| match run {
                Run::Blocks(dtype, segments) => Segment::stack(dtype, cols, segments),
                Run::Dense(tensors) => {
                    let data = Tensor::cat(&tensors, 0)?;
                    Ok(Segment { format: None, rows: data.dims2()?.0, data })
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weight::Quant(Arc::new(QMatrix { rows, cols, segments })))
    }

    /// `x [m, k] @ w.T` -> `[m, rows]`, in x's dtype.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(w) => crate::model::parallel::matmul_transposed(x, w),
            Weight::Panels(p) => p.matmul_t(x),
            Weight::Quant(q) => q.matmul_t(x, kernels::Path::selected()),
        }
    }

    /// Rows `ids` as f32 `[ids.len(), cols]` (an embedding lookup).
    pub fn rows_f32(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(w) => Ok(w.index_select(ids, 0)?.to_dtype(DType::F32)?),
            Weight::Panels(p) => p.rows_f32(&ids.to_vec1::<u32>()?),
            Weight::Quant(q) => {
                let ids = ids.to_vec1::<u32>()?;
                let mut out = vec![0f32; ids.len() * q.cols];
                for (&id, row_out) in ids.iter().zip(out.chunks_exact_mut(q.cols)) {
                    q.row_f32(id as usize, row_out)?;
                }
                Ok(Tensor::from_vec(out, (ids.len(), q.cols), &Device::Cpu)?)
            }
        }
    }
}

impl QMatrix {
    /// Dequantizes row `row` into `out`.
    fn row_f32(&self, mut row: usize, out: &mut [f32]) -> Result<()> {
        for s in &self.segments {
            if row < s.rows {
                match s.format {
                    None => out.copy_from_slice(&s.data.get(row)?.to_vec1::<f32>()?),
                    Some(dtype) => {
                        let rb = formats::row_bytes(dtype, self.cols);
                        with_bytes(&s.data, |bytes| {
                            if interleaved::packable(dtype) {
                                formats::dequantize(dtype, &interleaved::row(dtype, s.rows, self.cols, bytes, row), out)
                            } else {
                                formats::dequantize(dtype, &bytes[row * rb..(row + 1) * rb], out)
                            }
                        })?;
                    }
                }
                return Ok(());
            }
            row -= s.rows;
        }
        bail!("row {row} is out of range")
    }

    /// `x [m, k] @ self.T` on a given kernel path.
    pub fn matmul_t(&self, x: &Tensor, path: kernels::Path) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            bail!("matmul of [{m}, {k}] by a quantized weight of {} columns", self.cols);
        }
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        // The activations are read in place: a copy of them was 3-4% of a 512-row prefill. (Dense
        // segments multiply after, through candle, with no storage guard of x held.)
        let quantized = with_host_f32(&x32, |values| -> Result<Vec<Option<Tensor>>> {
            let mut parts = Vec::with_capacity(self.segments.len());
            for s in &self.segments {
                let Some(dtype) = s.format else {
                    parts.push(None);
                    continue;
                };
                let out = with_bytes(&s.data, |bytes| {
                    if interleaved::packable(dtype) {
                        interleaved::matmul(values, m, k, dtype, bytes, s.rows, path)
                    } else {
                        kernels::matmul(values, m, k, dtype, bytes, s.rows, path)
                    }
                })?;
                parts.push(Some(Tensor::from_vec(out, (m, s.rows), &Device::Cpu)?));
            }
            Ok(parts)
        })?;
        let Some(quantized) = quantized.transpose()? else { bail!("quantized weights multiply activations on the CPU, not on {:?}", x.device()) };
        let mut parts = Vec::with_capacity(self.segments.len());
        for (s, part) in self.segments.iter().zip(quantized) {
            parts.push(match part {
                Some(part) => part,
                None => crate::model::parallel::matmul_transposed(&x32, &s.data)?,
            });
        }
        let y = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 1)? };
        Ok(y.to_dtype(dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_segments_multiply_like_their_dequantized_stack() {
        let (k, m) = (256, 3);
        let values = |n: usize, seed: u32| -> Vec<f32> { (0..n).map(|i| (((i as u32).wrapping_mul(2654435761u32) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect() };
        let a = Weight::from_sliced(formats::quantize_matrix(Format::Q4K, 5, k, values(5 * k, 1)), &Device::Cpu).unwrap();
        let b = Weight::from_sliced(formats::quantize_matrix(Format::Q6K, 3, k, values(3 * k, 2)), &Device::Cpu).unwrap();
        let c = Weight::Dense(Tensor::from_vec(values(2 * k, 3), (2, k), &Device::Cpu).unwrap());
        // interleaved formats, two adjacent parts of one merged: 9 + 9 rows (two whole groups and
        // a tail once merged: interleaved anew) and 16 + 11 (their held bytes appended)
        let d = Weight::from_sliced(formats::quantize_matrix(Format::Q4_1, 9, k, values(9 * k, 5)), &Device::Cpu).unwrap();
        let f = Weight::from_sliced(formats::quantize_matrix(Format::Q8_0, 16, k, values(16 * k, 7)), &Device::Cpu).unwrap();
        let e = Weight::from_sliced(formats::quantize_matrix(Format::Q8_0, 11, k, values(11 * k, 6)), &Device::Cpu).unwrap();
        let parts = vec![a.clone(), b.clone(), a, c, d.clone(), d, f, e];
        let w = Weight::cat_rows(parts.clone()).unwrap();
        let rows = 15 + 18 + 16 + 11;
        assert_eq!(w.dims2().unwrap(), (rows, k));
        assert_eq!(w.format(), "q4_k+q6_k+f32+q4_1+q8_0");
        let Weight::Quant(q) = &w else { panic!() };
        assert_eq!(q.segments.len(), 6, "the two q4_1 parts merge");
        let ids = Tensor::from_vec((0..rows as u32).collect::<Vec<_>>(), rows, &Device::Cpu).unwrap();
        let dense = w.rows_f32(&ids).unwrap();
        // every row is its part's
        let rows_of = |p: &Weight| {
            let n = p.dims2().unwrap().0 as u32;
            p.rows_f32(&Tensor::from_vec((0..n).collect::<Vec<_>>(), n as usize, &Device::Cpu).unwrap()).unwrap()
        };
        let stacked = Tensor::cat(&parts.iter().map(rows_of).collect::<Vec<_>>(), 0).unwrap();
        assert_eq!(dense.to_vec2::<f32>().unwrap(), stacked.to_vec2::<f32>().unwrap());
        let x = Tensor::from_vec(values(m * k, 4), (m, k), &Device::Cpu).unwrap();
        let got = w.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
        let want = x.matmul(&dense.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() < 0.05 * (1.0 + w.abs()), "{g} vs {w}");
        }
    }
}
