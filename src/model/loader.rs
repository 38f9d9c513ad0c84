//! Reading one rank's slice of a checkpoint.
//!
//! Safetensors files are memory-mapped, and a rank copies out only the byte ranges of its own
//! slice: a 70B checkpoint shared by 8 ranks on one host costs each rank 1/8 of the bytes, not a
//! full copy. Slices are described as index ranges along one dimension, so fused tensors
//! ([q | k | v] regions, per-head [query | gate] pairs) are cut region by region.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::quant::{Products, QuantMode, Sliced, Weight};

/// Counters a loading rank updates as it copies its shard, read by the LoadShard progress stream.
#[derive(Debug, Default)]
pub struct LoadProgress {
    pub bytes: AtomicU64,
    pub tensors: AtomicU64,
    /// resident bytes of the weights of matrix products, by the format they are held in
    /// (`q4_1`, `q8_0`, `f32`, `bf16`)
    pub formats: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl LoadProgress {
    fn record(&self, weight: &Weight) {
        let mut formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        // per segment: a fused weight may mix formats
        match weight {
            Weight::Dense(t) => {
                *formats.entry(format!("{:?}", t.dtype()).to_lowercase()).or_default() += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
            }
            Weight::Panels(p) => {
                *formats.entry(super::quant::panel_format(p)).or_default() += (p.data().elem_count() * p.dtype().size_in_bytes()) as u64;
            }
            Weight::Quant(q) => {
                for s in &q.segments {
                    *formats.entry(s.format_name().to_owned()).or_default() += s.resident_bytes() as u64;
                }
            }
        }
    }

    /// The formats, most resident bytes first, each with its share: `q4_1 96.1%, f32 3.9%`.
    pub fn format_summary(&self) -> String {
        let formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        let total: u64 = formats.values().sum();
        let mut entries: Vec<(&String, &u64)> = formats.iter().collect();
        entries.sort_by(|a, b| b.1.cmp(a.1));
        entries
            .iter()
            .map(|(name, bytes)| format!("{name} {:.1}%", **bytes as f64 * 100.0 / total.max(1) as f64))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The format holding the most bytes (`q4_1`), or None before any matrix is loaded.
    pub fn main_format(&self) -> Option<String> {
        let formats = self.formats.lock().unwrap_or_else(|p| p.into_inner());
        formats.iter().max_by_key(|(_, bytes)| **bytes).map(|(name, _)| name.clone())
    }
}

/// The safetensors files of one model directory, memory-mapped; or a GGUF file, dequantized
/// tensor by tensor (then `tensors` is empty and `gguf` answers every question).
pub struct WeightFiles {
    tensors: MmapedSafetensors,
    gguf: Option<super::gguf::GgufWeights>,
    /// tensor name -> file it lives in, for error messages
    locations: HashMap<String, PathBuf>,
    total_bytes: u64,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or every file named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        if super::gguf::is_gguf(dir) {
            let gguf = super::gguf::GgufWeights::open(dir)?;
            let total_bytes = gguf.total_bytes();
            // SAFETY: no file is mapped; an empty set of safetensors files.
            let tensors = unsafe { MmapedSafetensors::multi::<PathBuf>(&[]) }.map_err(|err| anyhow::anyhow!("{err}"))?;
            return Ok(Self { tensors, gguf: Some(gguf), locations: HashMap::new(), total_bytes });
        }
        let files = safetensors_files(dir)?;
        let mut total_bytes = 0;
        for file in &files {
            let meta = std::fs::metadata(file)
                .with_context(|| format!("cannot read weights file {}", file.display()))?;
            total_bytes += meta.len();
        }
        // SAFETY: the files are mapped read-only; tpserve never writes them. As with every mmap,
        // truncating a file while it is mapped is the operator's error (SIGBUS), not ours.
        let tensors = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|err| anyhow::anyhow!("{err}"))
            .with_context(|| format!("cannot parse safetensors in {}", dir.display()))?;
        let mut locations = HashMap::new();
        for file in &files {
            // SAFETY: as above. Reading the header again is cheap and keeps the routing explicit.
            let single = unsafe { MmapedSafetensors::new(file) }
                .map_err(|err| anyhow::anyhow!("{err}"))
                .with_context(|| format!("cannot parse {}", file.display()))?;
            for (name, view) in single.tensors() {
                check_view_bounds(&name, &view, file)?;
                locations.insert(name, file.clone());
            }
        }
        Ok(Self { tensors, gguf: None, locations, total_bytes })
    }

    /// The model config a GGUF file's metadata implies; None for safetensors.
    pub fn gguf_config(&self) -> Option<&super::config::ModelConfig> {
        self.gguf.as_ref().map(super::gguf::GgufWeights::config)
    }

    pub fn contains(&self, name: &str) -> bool {
        if let Some(gguf) = &self.gguf {
            return gguf.contains(name);
        }
        self.locations.contains_key(name)
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub fn tensor_names(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match &self.gguf {
            Some(gguf) => Box::new(gguf.tensor_names()),
            None => Box::new(self.locations.keys().map(String::as_str)),
        }
    }

    pub fn dtype(&self, name: &str) -> Result<DType> {
        if let Some(gguf) = &self.gguf {
            return gguf.stored_dtype(name);
        }
        let view = self.view(name)?;
        DType::try_from(view.dtype()).map_err(|err| anyhow::anyhow!("tensor \"{name}\": {err}"))
    }

    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        if let Some(gguf) = &self.gguf {
            return gguf.shape(name);
        }
        Ok(self.view(name)?.shape().to_vec())
    }

    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        if !self.contains(name) {
            bail!("tensor \"{name}\" is missing from the checkpoint");
        }
        self.tensors
            .get(name)
            .map_err(|err| anyhow::anyhow!("cannot read tensor \"{name}\": {err}"))
    }
}

/// safetensors validates offsets against the header, but a header can still describe a data
/// size that does not match shape x dtype; catch that before slicing.
fn check_view_bounds(
    name: &str,
    view: &safetensors::tensor::TensorView<'_>,
    file: &Path,
) -> Result<()> {
    let elements: usize = view.shape().iter().product();
    let expected = elements * view.dtype().bitsize() / 8;
    if view.data().len() != expected {
        bail!(
            "tensor \"{name}\" in {} holds {} bytes but shape {:?} of {:?} needs {expected}",
            file.display(),
            view.data().len(),
            view.shape(),
            view.dtype()
        );
    }
    Ok(())
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist or is not a directory", dir.display());
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no weight_map object", index.display()))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for value in map.values() {
            let file = value
                .as_str()
                .with_context(|| format!("{}: weight_map values must be file names", index.display()))?;
            if file.contains('/') || file.contains("..") {
                bail!("{}: weight file \"{file}\" must be a plain file name", index.display());
            }
            let path = dir.join(file);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        for file in &files {
            if !file.exists() {
                bail!("weight file {} named in {} is missing", file.display(), index.display());
            }
        }
        files.sort();
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!(
        "no weights in {}: expected model.safetensors or model.safetensors.index.json",
        dir.display()
    )
}

/// Reads tensors (or slices of them) under a name prefix, converting to the compute dtype, or
/// for the weights of matrix products ([`ShardLoader::matmul_slice`]) to the matmul dtype.
#[derive(Clone)]
pub struct ShardLoader {
    files: Arc<WeightFiles>,
    prefix: String,
    device: Device,
    dtype: DType,
    matmul_dtype: DType,
    quant: super::quant::QuantMode,
    products: Products,
    progress: Arc<LoadProgress>,
}

impl ShardLoader {
    pub fn new(files: Arc<WeightFiles>, device: Device, dtype: DType, progress: Arc<LoadProgress>) -> Self {
        Self { files, prefix: String::new(), device, dtype, matmul_dtype: dtype, quant: Default::default(), products: Products::Exact, progress }
    }

    /// Keeps the weights of matrix products (linear layers, embedding tables, experts) in
    /// `dtype` while everything else, and the computation, stays in the compute dtype: on CPU,
    /// bf16 weights multiplied by f32 activations (see `cpu_matmul`).
    pub fn with_matmul_dtype(self, dtype: DType) -> Self {
        Self { matmul_dtype: dtype, ..self }
    }

    /// Keeps GGUF blocks resident, or quantizes every matrix, for the weights loaded through
    /// [`Self::matmul_weight`] (CPU only; see `quant`).
    pub fn with_quant(self, quant: super::quant::QuantMode) -> Self {
        Self { quant, ..self }
    }

    pub fn quant(&self) -> super::quant::QuantMode {
        self.quant
    }

    /// Multiplies bf16 weights in precision `products` ([`Products::Bf16`]: activations rounded
    /// to bf16), for the weights held through [`Self::dense`].
    pub fn with_products(self, products: Products) -> Self {
        Self { products, ..self }
    }

    /// A dense weight of matrix products as this load holds it ([`Weight::dense`], in this
    /// load's precision).
    pub fn dense(&self, t: Tensor) -> Result<Weight> {
        Weight::dense(t, self.products)
    }

    /// A loader for the names under `prefix.` (like candle's `VarBuilder::pp`).
    pub fn pp(&self, prefix: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            prefix.to_string()
        } else {
            format!("{}.{prefix}", self.prefix)
        };
        Self { prefix, ..self.clone() }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype: activations, norms and every tensor not read by [`Self::matmul_slice`].
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype the weights of matrix products are held in.
    pub fn matmul_dtype(&self) -> DType {
        self.matmul_dtype
    }

    pub fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() { name.to_owned() } else { format!("{}.{name}", self.prefix) }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.files.contains(&self.full_name(name))
    }

    /// The whole tensor, after checking it has the shape the config implies.
    pub fn tensor(&self, name: &str, expected_shape: &[usize]) -> Result<Tensor> {
        self.slice(name, expected_shape, 0, &[0..expected_shape.first().copied().unwrap_or(1)])
            .and_then(|t| Ok(t.reshape(expected_shape)?))
    }

    /// The concatenation of `ranges` along `dim` (in order), copied straight from the mapped file.
    pub fn slice(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<Tensor> {
        self.slice_as(name, expected_shape, dim, ranges, self.dtype)
    }

    /// [`Self::slice`] of the weight of a matrix product, in the matmul dtype.
    pub fn matmul_slice(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<Tensor> {
        self.slice_as(name, expected_shape, dim, ranges, self.matmul_dtype)
    }

    /// [`Self::matmul_slice`] as a [`Weight`]: under a [`QuantMode`] other than Off, a 2-D
    /// matrix on the CPU stays (or becomes) GGML blocks, each rank cutting only its own slice.
    pub fn matmul_weight(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<Weight> {
        if self.device.is_cpu() && expected_shape.len() == 2 {
            match self.quant {
                QuantMode::Off => {}
                QuantMode::KeepGguf => {
                    if let Some(gguf) = &self.files.gguf {
                        let full_name = self.full_name(name);
                        if let Some(sliced) = gguf.quantized_slice(&full_name, expected_shape, dim, ranges)? {
                            let weight = self.kept_blocks(sliced)?;
                            self.progress.tensors.fetch_add(1, Ordering::Relaxed);
                            return Ok(weight);
                        }
                    }
                }
                QuantMode::To(_) => return self.weight_from(self.slice_as(name, expected_shape, dim, ranges, DType::F32)?),
            }
        }
        let weight = self.dense(self.matmul_slice(name, expected_shape, dim, ranges)?)?;
        self.progress.record(&weight);
        Ok(weight)
    }

    /// Every matrix of the stacks `names`, each [matrices, rows, cols] as `expected_shape` says
    /// (a layer's experts, packed as in the Qwen3.5 MoE hub checkpoints or stacked as GGUF
    /// stores them), cut along `dim` of the matrix to `ranges`; matrix i of each stack joined by
    /// rows, in `names`' order (an expert's gate and up). Held as [`Self::matmul_weight`] holds
    /// one matrix: a GGUF's blocks stay blocks under [`QuantMode::KeepGguf`], joined before they
    /// are interleaved. Each tensor is read once.
    pub fn stacked_matmul_weights(
        &self,
        names: &[&str],
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
    ) -> Result<Vec<Weight>> {
        if let Some(stacks) = self.stacked_gguf_slices(names, expected_shape, dim, ranges)? {
            let mut stacks: Vec<_> = stacks.into_iter().map(Vec::into_iter).collect();
            return (0..expected_shape[0])
                .map(|_| {
                    let parts: Vec<Sliced> = stacks.iter_mut().filter_map(Iterator::next).collect();
                    match Sliced::stack_rows(parts) {
                        Ok(joined) => self.kept_blocks(joined),
                        Err(parts) => Weight::cat_rows(parts.into_iter().map(|p| self.kept_blocks(p)).collect::<Result<_>>()?),
                    }
                })
                .collect();
        }
        let stacks = names.iter().map(|name| self.matmul_slice(name, expected_shape, dim + 1, ranges)).collect::<Result<Vec<_>>>()?;
        let joined = Tensor::cat(&stacks, 1)?;
        (0..expected_shape[0]).map(|i| self.weight_from(joined.get(i)?.contiguous()?)).collect()
    }

    /// A GGUF slice kept in its blocks as a weight, counted in the load's formats and bytes.
    fn kept_blocks(&self, sliced: Sliced) -> Result<Weight> {
        let weight = Weight::from_sliced(sliced, &self.device)?;
        self.progress.record(&weight);
        self.progress.bytes.fetch_add(weight.resident_bytes() as u64, Ordering::Relaxed);
        Ok(weight)
    }

    /// Each stack of `names` as block slices, one per matrix, when all are GGUF tensors in a
    /// block format kept under [`QuantMode::KeepGguf`]; None when any is read dense.
    fn stacked_gguf_slices(&self, names: &[&str], expected_shape: &[usize], dim: usize, ranges: &[Range<usize>]) -> Result<Option<Vec<Vec<Sliced>>>> {
        let Some(gguf) = self.files.gguf.as_ref().filter(|_| self.device.is_cpu() && self.quant == QuantMode::KeepGguf) else {
            return Ok(None);
        };
        let mut stacks = Vec::with_capacity(names.len());
        for name in names {
            match gguf.quantized_stack_slices(&self.full_name(name), expected_shape, dim, ranges)? {
                Some(slices) => stacks.push(slices),
                None => return Ok(None),
            }
        }
        self.progress.tensors.fetch_add(names.len() as u64, Ordering::Relaxed);
        Ok(Some(stacks))
    }

    /// A matrix assembled from slices read through [`Self::matmul_slice`] (an expert's gate and
    /// up rows joined, one expert of a packed tensor), held as this load holds its matrices: in
    /// the `--quantize` format on the CPU (each row quantized on its own, so joining and
    /// quantizing commute), else dense. Counted in the load's formats either way.
    pub fn weight_from(&self, matrix: Tensor) -> Result<Weight> {
        let weight = match self.quant {
            QuantMode::To(format) if self.device.is_cpu() && matrix.rank() == 2 => {
                let (rows, cols) = matrix.dims2()?;
                let values = matrix.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Weight::from_sliced(super::quant::formats::quantize_matrix(format, rows, cols, values), &self.device)?
            }
            _ => self.dense(matrix)?,
        };
        self.progress.record(&weight);
        Ok(weight)
    }

    fn slice_as(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
        target: DType,
    ) -> Result<Tensor> {
        let full_name = self.full_name(name);
        if let Some(gguf) = &self.files.gguf {
            return self.slice_dense(&full_name, gguf.dequantize(&full_name)?, expected_shape, dim, ranges, target);
        }
        let view = self.files.view(&full_name)?;
        let shape = view.shape();
        if shape != expected_shape {
            bail!(
                "tensor \"{full_name}\" has shape {shape:?} but config.json implies {expected_shape:?}"
            );
        }
        let dtype = DType::try_from(view.dtype())
            .map_err(|err| anyhow::anyhow!("tensor \"{full_name}\": unsupported dtype: {err}"))?;
        let shape = if shape.is_empty() { vec![1] } else { shape.to_vec() };
        if dim >= shape.len() {
            bail!("tensor \"{full_name}\" has no dimension {dim} to slice");
        }
        for range in ranges {
            if range.start > range.end || range.end > shape[dim] {
                bail!(
                    "slice {range:?} of dimension {dim} is out of bounds for tensor \"{full_name}\" of shape {shape:?}"
                );
            }
        }
        let element_bytes = dtype.size_in_bytes();
        let outer: usize = shape[..dim].iter().product();
        let inner_bytes: usize = shape[dim + 1..].iter().product::<usize>() * element_bytes;
        let data = view.data();
        let selected: usize = ranges.iter().map(|r| r.end - r.start).sum();
        let mut parts = Vec::with_capacity(outer * ranges.len());
        for block in 0..outer {
            let block_start = block * shape[dim] * inner_bytes;
            for range in ranges {
                parts.push(&data[block_start + range.start * inner_bytes..block_start + range.end * inner_bytes]);
            }
        }
        let bytes = outer * selected * inner_bytes;
        let mut out_shape = shape.clone();
        out_shape[dim] = selected;
        let tensor = match (dtype == target && self.device.is_cpu(), dtype) {
            (true, DType::F32) => host_tensor::<f32>(&parts, bytes, &out_shape),
            (true, DType::BF16) => host_tensor::<half::bf16>(&parts, bytes, &out_shape),
            (true, DType::F16) => host_tensor::<half::f16>(&parts, bytes, &out_shape),
            _ => Tensor::from_raw_buffer(&parts.concat(), dtype, &out_shape, &self.device).map_err(anyhow::Error::from),
        }
        .with_context(|| format!("cannot build tensor \"{full_name}\""))?
        .to_dtype(target)?;
        self.progress.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.progress.tensors.fetch_add(1, Ordering::Relaxed);
        Ok(tensor)
    }
}

impl ShardLoader {
    /// [`ShardLoader::slice`] of a tensor already in memory (a dequantized GGUF tensor).
    fn slice_dense(
        &self,
        full_name: &str,
        tensor: Tensor,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[Range<usize>],
        target: DType,
    ) -> Result<Tensor> {
        if tensor.dims() != expected_shape {
            bail!("tensor \"{full_name}\" has shape {:?} but the model config implies {expected_shape:?}", tensor.dims());
        }
        let tensor = if tensor.rank() == 0 { tensor.reshape(1)? } else { tensor };
        let size = tensor.dims().get(dim).copied().with_context(|| format!("tensor \"{full_name}\" has no dimension {dim} to slice"))?;
        let mut parts = Vec::with_capacity(ranges.len());
        for range in ranges {
            if range.start > range.end || range.end > size {
                bail!("slice {range:?} of dimension {dim} is out of bounds for tensor \"{full_name}\" of shape {:?}", tensor.dims());
            }
            parts.push(tensor.narrow(dim, range.start, range.end - range.start)?);
        }
        let out = Tensor::cat(&parts, dim)
            .with_context(|| format!("cannot build tensor \"{full_name}\""))?
            .to_dtype(target)?
            .to_device(&self.device)?;
        self.progress.bytes.fetch_add((out.elem_count() * DType::F32.size_in_bytes()) as u64, Ordering::Relaxed);
        self.progress.tensors.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }
}

/// A CPU tensor of `shape` holding `parts` one after the other (`bytes` in all, little-endian
/// `T`s, as safetensors stores them), written into memory advised for 2 MiB pages before its
/// first write: the page faults then take huge pages at once, where moving the weights into
/// them after the load would copy every page (`tpserve_kernels::pages`).
fn host_tensor<T: candle_core::WithDType>(parts: &[&[u8]], bytes: usize, shape: &[usize]) -> Result<Tensor> {
    let size = std::mem::size_of::<T>();
    if parts.iter().map(|p| p.len()).sum::<usize>() != bytes || !bytes.is_multiple_of(size) {
        bail!("{bytes} bytes do not make whole {size}-byte elements of the parts given");
    }
    let mut values: Vec<T> = Vec::with_capacity(bytes / size);
    tpserve_kernels::pages::advise_unwritten(values.spare_capacity_mut());
    let dst = values.spare_capacity_mut().as_mut_ptr().cast::<u8>();
    let mut at = 0;
    for part in parts {
        // SAFETY: the parts hold `bytes` bytes in all (checked above), the capacity reserved,
        // so each copy stays inside it; source and destination are different allocations.
        unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), dst.add(at), part.len()) };
        at += part.len();
    }
    // SAFETY: all bytes / size elements were written just above, and the element types used
    // here (f32, bf16, f16) are valid for any bits.
    unsafe { values.set_len(bytes / size) };
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}

/// Splits `0..len` into `world_size` contiguous parts of `ceil(len / world_size)` and returns
/// part `rank`; when `len` does not divide, the last parts are shorter (possibly empty).
pub fn even_part(len: usize, rank: usize, world_size: usize) -> Range<usize> {
    let chunk = len.div_ceil(world_size);
    let start = (rank * chunk).min(len);
    let end = ((rank + 1) * chunk).min(len);
    start..end
}
