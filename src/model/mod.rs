//! Model definitions, checkpoint loading and the tensor-parallel layers they share.
//!
//! One file per model family; every family is written against [`parallel`] and [`loader`], so
//! the same code runs at any TP size and on any device.

pub mod activation;
pub mod arena;
pub mod attention;
pub mod cache;
pub mod compute_pool;
pub mod config;
pub use tpserve_kernels::cpu_matmul;
pub mod decoder;
pub mod gated_delta_net;
pub mod gguf;
mod gguf_header;
pub mod hub;
pub mod layers;
pub mod loader;
pub mod moe;
pub mod paged;
pub mod panels;
pub mod parallel;
pub mod placement;
pub mod quant;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod rope;

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

pub use cache::{CacheStore, SequenceCache};
pub use config::{ModelConfig, ModelFamily};
use loader::{LoadProgress, ShardLoader, WeightFiles};
pub use quant::{Products, QuantMode};
use parallel::TpGroup;

/// The new tokens of one sequence in a step: `tokens` occupy positions
/// `start_pos .. start_pos + tokens.len()`. `sample` asks for the logits after the last one
/// (false for all but the last chunk of a chunked prefill).
#[derive(Debug, Clone, Copy)]
pub struct SequenceInput<'a> {
    pub seq_id: u64,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub sample: bool,
    /// the sequence's block table, covering at least `start_pos + tokens.len()` positions
    pub blocks: &'a [u32],
    /// for a sequence this rank holds no state for: how many leading positions its blocks
    /// already hold (a prefix-cache hit); `start_pos` must equal it
    pub cached_prefix: usize,
    /// for such a sequence with recurrent layers: the block whose snapshot holds their state at
    /// `cached_prefix`
    pub restore_state: Option<u32>,
    /// after the step, snapshot the recurrent state under this block id
    pub save_state: Option<u32>,
    /// Some(suppressed) where the sampler takes only the largest of the sequence's logits and
    /// never one of the token ids `suppressed` (greedy, no logprobs, no penalties): its row may
    /// then hold only the values that can be that largest, exact, and NEG_INFINITY elsewhere,
    /// if every sampling sequence of the step is so (`ParallelLmHead::forward_argmax`)
    pub argmax_only: Option<&'a [u32]>,
}

impl<'a> SequenceInput<'a> {
    /// A step with no prefix-cache involvement.
    pub fn new(seq_id: u64, tokens: &'a [u32], start_pos: usize, sample: bool, blocks: &'a [u32]) -> Self {
        Self { seq_id, tokens, start_pos, sample, blocks, cached_prefix: 0, restore_state: None, save_state: None, argmax_only: None }
    }
}

/// How to load a shard.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// dtype the weights are converted to; None keeps the checkpoint's dtype. The model computes
    /// in it too, except bf16 and f16 on CPU: there the weights of matrix products stay in their
    /// 16 bits (half the bytes of f32 to hold and to stream per token) and everything is
    /// computed in f32 (see `cpu_matmul`), as exact as converting the weights to f32.
    pub dtype: Option<DType>,
    pub device: Device,
    /// how bf16 weights' products are computed on the CPU (`--matmul-precision`):
    /// [`Products::Exact`], or with the activations rounded to bf16
    pub products: Products,
}

/// (compute dtype, dtype of the weights of matrix products) for weights in `dtype`.
pub fn resident_dtypes(dtype: DType, device: &Device) -> (DType, DType) {
    if device.is_cpu() && matches!(dtype, DType::BF16 | DType::F16) { (DType::F32, dtype) } else { (dtype, dtype) }
}

/// What `--dtype auto` loads on CPU: a bf16 or f16 checkpoint stays in its dtype where the CPU
/// has a fast kernel for such weights ([`cpu_matmul::half_weights_fast`]); anything else is
/// computed in f32.
/// A checkpoint that cannot be read gets f32 (loading it reports the error).
pub fn cpu_auto_dtype(dir: &Path) -> DType {
    let stored = WeightFiles::open(dir).and_then(|files| checkpoint_dtype(&files));
    match stored {
        Ok(dtype @ (DType::BF16 | DType::F16)) if cpu_matmul::half_weights_fast() => dtype,
        _ => DType::F32,
    }
}

/// The weights `--dtype` and `--quantize` ask for: (dtype, quantization).
///
/// `quantize` is empty (or `none`) or a GGUF block format name (`q8_0`, `q4_0`, `q4_k`, ...):
/// every matrix is quantized to it at load time, each rank its own slice, and computed in f32
/// (CPU only). Without it, `auto` on CPU keeps a quantized GGUF in its blocks.
pub fn parse_load_dtype(
    dtype: &str,
    quantize: &str,
    device: &Device,
    model_path: &Path,
) -> std::result::Result<(Option<DType>, QuantMode), String> {
    match quantize {
        "" | "none" => {}
        text => {
            let Some(format) = quant::formats::parse(text) else {
                return Err(format!(
                    "unknown quantization \"{text}\" (expected none, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k)"
                ));
            };
            if !device.is_cpu() {
                return Err(format!("--quantize {text}: quantized weights are only supported on the CPU"));
            }
            if !matches!(dtype, "" | "auto" | "f32" | "float32") {
                return Err(format!("--quantize {text} computes in f32: leave --dtype at auto or f32 (got \"{dtype}\")"));
            }
            return Ok((Some(DType::F32), QuantMode::To(format)));
        }
    }
    Ok(match dtype {
        "" | "auto" if device.is_cpu() => {
            let quant = if gguf::is_gguf(model_path) { QuantMode::KeepGguf } else { QuantMode::Off };
            (Some(cpu_auto_dtype(model_path)), quant)
        }
        "" | "auto" => (Some(DType::BF16), QuantMode::Off),
        "checkpoint" => (None, QuantMode::Off),
        "f32" | "float32" => (Some(DType::F32), QuantMode::Off),
        "bf16" | "bfloat16" => (Some(DType::BF16), QuantMode::Off),
        "f16" | "float16" => (Some(DType::F16), QuantMode::Off),
        other if quant::formats::parse(other).is_some() => {
            return Err(format!("\"{other}\" is a quantization: use --quantize {other} (with --dtype auto or f32)"));
        }
        other => return Err(format!("unknown dtype \"{other}\" (expected auto, checkpoint, f32, bf16 or f16)")),
    })
}

/// The products `--matmul-precision` asks for (`exact`, the default, or `bf16`), for the weights
/// [`parse_load_dtype`] chose: `bf16` rounds the activations of bf16 weights' products to bf16,
/// as torch and llama.cpp compute a bf16 model (CPU; lossy, faster in a batch where the CPU has
/// avx512_bf16).
pub fn parse_matmul_precision(text: &str, dtype: Option<DType>, quant: QuantMode, device: &Device) -> std::result::Result<Products, String> {
    match text {
        "" | "exact" => Ok(Products::Exact),
        "bf16" => {
            if !device.is_cpu() {
                return Err("--matmul-precision bf16 is for bf16 weights on the CPU (on a GPU, --dtype bf16 computes in bf16)".into());
            }
            if let QuantMode::To(format) = quant {
                return Err(format!(
                    "--matmul-precision bf16 is for bf16 weights; --quantize {} multiplies 8-bit activations",
                    format.name()
                ));
            }
            match dtype {
                // a checkpoint's own dtype: bf16 weights use it, others stay exact
                Some(DType::BF16) | None => Ok(Products::Bf16),
                Some(other) => Err(format!(
                    "--matmul-precision bf16 is for bf16 weights, and these load as {}: pass --dtype bf16",
                    format!("{other:?}").to_lowercase()
                )),
            }
        }
        other => Err(format!("unknown matmul precision \"{other}\" (expected exact or bf16)")),
    }
}

/// The KV cache's element type `--kv-cache-dtype` asks for: None (`auto`, the default) keeps
/// the compute dtype; `f32`, or `f16` on a CPU (half the bytes a position, lossy: keys and
/// values rounded to nearest on writing, read back exactly widened to f32).
pub fn parse_kv_cache_dtype(text: &str, device: &Device) -> std::result::Result<Option<DType>, String> {
    let dtype = match text {
        "" | "auto" => return Ok(None),
        "f32" => DType::F32,
        "f16" => DType::F16,
        other => return Err(format!("unknown KV cache dtype \"{other}\" (expected auto, f32 or f16)")),
    };
    if !device.is_cpu() {
        return Err(format!("--kv-cache-dtype {text} is for CPU ranks; a GPU's cache holds the compute dtype (auto)"));
    }
    Ok(Some(dtype))
}

/// A loaded shard: every family is the one decoder of `decoder.rs` with per-layer mixers
/// (attention or Gated DeltaNet) and feed-forwards (dense or MoE).
pub use decoder::Model;

impl Model {
    /// Loads this rank's shard of the model in `dir`.
    pub fn load(dir: &Path, group: &TpGroup, options: &LoadOptions, progress: Arc<LoadProgress>) -> Result<Self> {
        Self::load_quantized(dir, group, options, QuantMode::Off, progress)
    }

    /// [`Self::load`] with the weights of matrix products kept in GGUF blocks or quantized at
    /// load time (see [`quant`]; CPU only, computing in f32).
    pub fn load_quantized(
        dir: &Path,
        group: &TpGroup,
        options: &LoadOptions,
        quant: QuantMode,
        progress: Arc<LoadProgress>,
    ) -> Result<Self> {
        // A .gguf file carries its config as metadata (parsed once, with its tensor directory);
        // a directory has config.json.
        let (config, files) = if gguf::is_gguf(dir) {
            let files = WeightFiles::open(dir)?;
            let config = files.gguf_config().cloned().context("a GGUF file opens as GGUF weights")?;
            (config, Arc::new(files))
        } else {
            (ModelConfig::from_model_dir(dir)?, Arc::new(WeightFiles::open(dir)?))
        };
        let dtype = match options.dtype {
            Some(dtype) => dtype,
            None => checkpoint_dtype(&files)?,
        };
        let (compute, matmul) = resident_dtypes(dtype, &options.device);
        if quant != QuantMode::Off && (!options.device.is_cpu() || compute != DType::F32) {
            anyhow::bail!("quantized weights need the CPU and f32 compute (got {:?} on {:?})", compute, options.device);
        }
        let products = if options.products == Products::Bf16 && !tpserve_kernels::panels::bf16_dot_available() {
            // Same values without the instruction, so no faster: keep the exact products.
            tracing::warn!("this CPU has no avx512_bf16 (or AVX-512 is capped off): bf16 weights keep exact products");
            Products::Exact
        } else {
            options.products
        };
        let loader = ShardLoader::new(files, options.device.clone(), compute, progress)
            .with_matmul_dtype(matmul)
            .with_quant(quant)
            .with_products(products);
        let mut model = match config.family {
            ModelFamily::Qwen3 | ModelFamily::Llama => qwen3::load(&loader, group, &config),
            ModelFamily::Qwen3Moe => qwen3_moe::load(&loader, group, &config),
            ModelFamily::Qwen3_5 | ModelFamily::Qwen3_5Moe => qwen3_5::load(&loader, group, &config),
        }?;
        if options.device.is_cpu() {
            model.back_with_huge_pages()?;
        }
        Ok(model)
    }

    /// Moves the weights into 2 MiB pages where the OS allows it: decode streams them every
    /// step, faster than from 4 KiB pages (`tpserve_kernels::pages`). The layers' matrices go
    /// into one buffer per element type first ([`arena`]: a matrix's own allocation holds only
    /// its whole pages, few for matrices of a few MiB). Weights the loader copied from the
    /// checkpoint in their own dtype are in huge pages already (advised before the copy); the
    /// kernel copies the others' pages now. The load pays for both (logged with the time they
    /// took).
    fn back_with_huge_pages(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        let gathered = if tpserve_kernels::pages::enabled() {
            let gathered = self.gather_layer_weights().context("gathering the layers' weights into 2 MiB pages")?;
            // The matrices' own buffers were freed; give the allocator's free pages back.
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only returns free heap memory to the kernel; it has no
            // preconditions and touches no live allocation.
            unsafe {
                libc::malloc_trim(0);
            }
            gathered
        } else {
            arena::Gathered::default()
        };
        // The gathered matrices' buffers had their pass; the other weights get theirs.
        let mut done = gathered.pages;
        for t in self.weight_tensors().into_iter().filter(|t| !gathered.holds(t)) {
            done += tpserve_kernels::pages::back_with_huge_pages(t);
        }
        let mib = |bytes: usize| bytes >> 20;
        tracing::info!(
            gathered_mib = mib(gathered.bytes),
            advised_mib = mib(done.advised),
            collapsed_mib = mib(done.collapsed),
            weights_mib = mib(self.weight_bytes()),
            seconds = started.elapsed().as_secs_f64(),
            "weights in 2 MiB pages"
        );
        Ok(())
    }

    /// Runs one step for a batch of sequences, creating caches for new sequences, and returns
    /// the last-token logits [sampling sequences, vocab] (f32) of the sequences that asked to
    /// sample, on the sampling rank; None elsewhere or when no sequence samples.
    ///
    /// A sequence's `start_pos` may be below its cached length (the cache is rewound, e.g. for
    /// a re-prefill) but not above it: positions cannot be skipped. Models with recurrent
    /// (linear-attention) state can only rewind to 0, which restarts the sequence.
    pub fn step(&self, batch: &[SequenceInput<'_>], store: &mut CacheStore) -> Result<Option<Tensor>> {
        let config = self.config();
        for (i, seq) in batch.iter().enumerate() {
            let refuse = |reason: String| Err(anyhow::Error::new(InvalidStep(reason)));
            if seq.tokens.is_empty() {
                return refuse(format!("sequence {} has no new tokens", seq.seq_id));
            }
            if batch[..i].iter().any(|other| other.seq_id == seq.seq_id) {
                return refuse(format!("sequence {} appears twice in one step", seq.seq_id));
            }
            if let Some(bad) = seq.tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
                return refuse(format!(
                    "token id {bad} of sequence {} is outside the vocabulary (size {})",
                    seq.seq_id, config.vocab_size
                ));
            }
            let end = seq.start_pos + seq.tokens.len();
            if end > config.max_position_embeddings {
                return refuse(format!(
                    "sequence {} would reach position {end}, beyond the context length {}",
                    seq.seq_id, config.max_position_embeddings
                ));
            }
            if seq.save_state.is_some() && end % store.pool.block_size() != 0 {
                return refuse(format!(
                    "sequence {}: a recurrent-state snapshot is taken at a block boundary, not at position {end}",
                    seq.seq_id
                ));
            }
            if let Err(err) = store.pool.check_table(seq.blocks, end) {
                return refuse(format!("sequence {}: {err:#}", seq.seq_id));
            }
            if let Err(reason) = self.check_resume(seq, store) {
                return refuse(format!("sequence {}: {reason}", seq.seq_id));
            }
        }
        // Take the caches out of the store so the forward pass can hold them all mutably.
        let mut caches: Vec<SequenceCache> = batch
            .iter()
            .map(|seq| match store.take(seq.seq_id) {
                Some(mut cache) => {
                    cache.truncate(seq.start_pos)?;
                    Ok(cache)
                }
                None => Ok(self.resumed_cache(seq, store)),
            })
            .collect::<Result<_>>()?;
        let mut refs: Vec<&mut SequenceCache> = caches.iter_mut().collect();
        // On a CPU the pass is a hundred or so parallel loops; keep the pool's threads awake
        // between them (not on a GPU, whose passes would have a core polling for nothing).
        let warm = self.device().is_cpu().then(compute_pool::KeepWarm::start);
        let result = self.forward(batch, &mut refs, &mut store.pool);
        drop(warm);
        // On failure the caches may be half-updated: drop them rather than keep corrupt state.
        if result.is_ok() {
            for (seq, cache) in batch.iter().zip(caches) {
                if let (Some(block), Some(snapshot)) = (seq.save_state, cache.snapshot()) {
                    store.save_snapshot(block, snapshot);
                }
                store.insert(seq.seq_id, cache);
            }
        }
        result.context("forward pass failed")
    }
}

impl Model {
    /// Where a sequence may start: at most at its cached length, or, for a sequence this rank
    /// holds nothing for, exactly at its prefix-cache hit, whose recurrent state (if the model
    /// has recurrent layers) must be in a snapshot. A rewind of recurrent state is refused here,
    /// before any cache leaves the store, so a refused step loses nothing.
    fn check_resume(&self, seq: &SequenceInput<'_>, store: &mut CacheStore) -> Result<(), String> {
        if let Some(cache) = store.get_mut(seq.seq_id) {
            if seq.start_pos > cache.len {
                return Err(format!("starts at position {} but only {} positions are cached", seq.start_pos, cache.len));
            }
            return cache.check_truncate(seq.start_pos).map_err(|err| format!("{err:#}"));
        }
        if seq.start_pos != seq.cached_prefix {
            return Err(format!(
                "starts at position {} but only {} positions are cached",
                seq.start_pos, seq.cached_prefix
            ));
        }
        if seq.cached_prefix > 0 && self.recurrent_state_bytes() > 0 {
            match seq.restore_state {
                Some(block) if store.snapshot(block).is_some() => {}
                Some(block) => return Err(format!("no recurrent-state snapshot is kept for block {block}")),
                None => return Err("resumes from a cached prefix without a recurrent-state snapshot".into()),
            }
        }
        Ok(())
    }

    /// The cache of a sequence this rank holds nothing for: empty, or restored to its cached
    /// prefix (checked by [`Self::check_resume`]).
    fn resumed_cache(&self, seq: &SequenceInput<'_>, store: &CacheStore) -> SequenceCache {
        let mut cache = self.new_sequence_cache();
        if seq.cached_prefix > 0 {
            if let Some(layers) = seq.restore_state.and_then(|block| store.snapshot(block)) {
                cache.layers = layers.clone();
            }
            cache.len = seq.cached_prefix;
        }
        cache
    }
}

/// A step refused before the forward pass, with every cache as it was: the request is at
/// fault, not the rank (errors of the forward pass itself are not this).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidStep(pub String);

/// The dtype most floating-point tensors of the checkpoint are stored in.
fn checkpoint_dtype(files: &WeightFiles) -> Result<DType> {
    let mut counts = std::collections::HashMap::new();
    for name in files.tensor_names() {
        if let Ok(dtype) = files.dtype(name) {
            *counts.entry(dtype).or_insert(0usize) += 1;
        }
    }
    counts
        .into_iter()
        .filter(|(dtype, _)| dtype.is_float())
        .max_by_key(|(_, count)| *count)
        .map(|(dtype, _)| dtype)
        .context("the checkpoint has no floating-point tensors")
}

/// RMSNorm over the last dimension, normalising in f32 and scaling by `weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() == DType::F32 && weight.dtype() == DType::F32 {
        return Ok(candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32)?);
    }
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let variance = x32.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    let normed = x32.broadcast_div(&(variance + eps)?.sqrt()?)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(weight)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_precision_bf16_needs_bf16_weights_on_the_cpu() {
        let cpu = Device::Cpu;
        let bf16 = Some(DType::BF16);
        assert_eq!(parse_matmul_precision("", Some(DType::F32), QuantMode::Off, &cpu), Ok(Products::Exact));
        assert_eq!(parse_matmul_precision("exact", bf16, QuantMode::Off, &cpu), Ok(Products::Exact));
        assert_eq!(parse_matmul_precision("bf16", bf16, QuantMode::Off, &cpu), Ok(Products::Bf16));
        // each refusal says what to do instead
        let f32_weights = parse_matmul_precision("bf16", Some(DType::F32), QuantMode::Off, &cpu).unwrap_err();
        assert!(f32_weights.contains("--dtype bf16"), "{f32_weights}");
        let q8 = QuantMode::To(quant::Format::Q8_0);
        let quantized = parse_matmul_precision("bf16", Some(DType::F32), q8, &cpu).unwrap_err();
        assert!(quantized.contains("--quantize q8_0"), "{quantized}");
        let unknown = parse_matmul_precision("fp8", bf16, QuantMode::Off, &cpu).unwrap_err();
        assert!(unknown.contains("expected exact or bf16"), "{unknown}");
    }

    #[test]
    fn kv_cache_dtype_names() {
        let cpu = Device::Cpu;
        assert_eq!(parse_kv_cache_dtype("", &cpu), Ok(None));
        assert_eq!(parse_kv_cache_dtype("auto", &cpu), Ok(None));
        assert_eq!(parse_kv_cache_dtype("f32", &cpu), Ok(Some(DType::F32)));
        assert_eq!(parse_kv_cache_dtype("f16", &cpu), Ok(Some(DType::F16)));
        let unknown = parse_kv_cache_dtype("fp8", &cpu).unwrap_err();
        assert!(unknown.contains("expected auto, f32 or f16"), "{unknown}");
    }
}
