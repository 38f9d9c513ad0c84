//! GGUF checkpoints (llama.cpp's single-file format): Llama, Qwen3 dense and Qwen3 MoE.
//!
//! A GGUF file carries the hyper-parameters and the tokenizer as metadata and the weights as
//! (usually quantized) tensors. tpserve serves them through the same code as safetensors
//! checkpoints: the metadata becomes a [`ModelConfig`] (via the config.json it implies), tensor
//! names are mapped to the Hugging Face ones, and each rank reads only its own slice (kept in
//! its blocks, or dequantized to f32 one tensor at a time).
//!
//! For Llama, llama.cpp's converter permutes the rows of the q and k projections for its
//! interleaved RoPE; we undo that here so the shared rotate-half RoPE of [`super::rope`] applies
//! unchanged. Qwen3 files keep Hugging Face's row order (llama.cpp runs them with rotate-half
//! RoPE). A Qwen3 MoE file stacks each layer's experts in one 3-D tensor per projection
//! (`ffn_{gate,up,down}_exps`); they keep that layout under our names (`mlp.experts.gate_proj`
//! [experts, intermediate, hidden], ...), and each rank cuts every expert's slice from it.
//! Llama 3's RoPE scaling arrives as a tensor, `rope_freqs.weight`, one divisor per
//! frequency; it becomes the config's [`RopeScaling::Divisors`].
//!
//! Tensors in IQ4_NL or IQ4_XS (types candle does not read) are read by
//! `tpserve_kernels::quant::iq4`: dequantized for the dense path, held as IQ4_NL blocks by the
//! quantized one (IQ4_XS's 32-value scales rounded to f16).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::Value;
use candle_core::{Device, Tensor};
use tpserve_kernels::quant::iq4::{self, Iq4};

use super::config::{ModelConfig, RopeScaling};
use super::gguf_header::{Header, Stored, TensorInfo};
use super::quant::Format;

/// llama.cpp's token types (`llama_token_type`) that name special tokens.
pub const TOKEN_TYPE_CONTROL: i64 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Whether `path` names a GGUF file (rather than a model directory).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|ext| ext.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file, mapped: its header (metadata and tensor directory) parsed, its tensors read on
/// request.
pub struct GgufFile {
    path: PathBuf,
    header: Header,
    map: memmap2::Mmap,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the mapping is read-only, and like the safetensors files' mappings it assumes
        // the model file is not truncated or rewritten while it is served; every read is checked
        // against its length (the header's, and each tensor's in `raw`).
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let header = Header::parse(&map).with_context(|| format!("{} is not a valid GGUF file", path.display()))?;
        // Shapes are checked here, once, so that no later slicing or reshaping meets an empty
        // or zero-sized dimension. A type tpserve does not read is refused when it is read.
        for (name, info) in &header.tensors {
            let dims = &info.dims;
            if dims.is_empty() || dims.contains(&0) {
                bail!("{}: tensor \"{name}\" has shape {dims:?}; every dimension must be positive", path.display());
            }
            if let Some((block, _)) = info.stored.block()
                && dims[dims.len() - 1] % block != 0
            {
                bail!(
                    "{}: tensor \"{name}\" has rows of {} values, not a whole number of {} blocks of {block}",
                    path.display(),
                    dims[dims.len() - 1],
                    info.stored.name()
                );
            }
        }
        Ok(Self { path: path.to_owned(), header, map })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn value(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    /// A non-negative integer field, whatever integer type the writer chose.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.value(key).map(|v| as_u64(v).with_context(|| format!("GGUF metadata \"{key}\" must be a non-negative integer, got {v:?}"))).transpose()
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?.with_context(|| format!("GGUF metadata \"{key}\" is missing"))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.value(key)
            .map(|v| match v {
                Value::F32(x) => Ok(*x as f64),
                Value::F64(x) => Ok(*x),
                other => bail!("GGUF metadata \"{key}\" must be a float, got {other:?}"),
            })
            .transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.value(key)
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                other => bail!("GGUF metadata \"{key}\" must be a boolean, got {other:?}"),
            })
            .transpose()
    }

    pub fn opt_string(&self, key: &str) -> Result<Option<&str>> {
        self.value(key)
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => bail!("GGUF metadata \"{key}\" must be a string, got {:?}", other.value_type()),
            })
            .transpose()
    }

    pub fn string_list(&self, key: &str) -> Result<Vec<&str>> {
        let items = self.array(key)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.as_str()),
                other => bail!("GGUF metadata \"{key}\"[{i}] must be a string, got {:?}", other.value_type()),
            })
            .collect()
    }

    /// An integer array (token types are i32 in practice).
    pub fn opt_int_list(&self, key: &str) -> Result<Option<Vec<i64>>> {
        if self.value(key).is_none() {
            return Ok(None);
        }
        let items = self.array(key)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| as_i64(v).with_context(|| format!("GGUF metadata \"{key}\"[{i}] must be an integer, got {v:?}")))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn array(&self, key: &str) -> Result<&Vec<Value>> {
        match self.value(key) {
            Some(Value::Array(items)) => Ok(items),
            Some(other) => bail!("GGUF metadata \"{key}\" must be an array, got {:?}", other.value_type()),
            None => bail!("GGUF metadata \"{key}\" is missing"),
        }
    }

    pub fn architecture(&self) -> Result<Architecture> {
        let name = self.opt_string("general.architecture")?.context("GGUF metadata \"general.architecture\" is missing")?;
        Architecture::parse(name)
    }

    pub fn has_tensor(&self, gguf_name: &str) -> bool {
        self.header.tensors.contains_key(gguf_name)
    }

    fn info(&self, gguf: &str) -> Result<&TensorInfo> {
        self.header.tensors.get(gguf).with_context(|| format!("GGUF tensor \"{gguf}\" is missing from {}", self.path.display()))
    }

    /// The stored bytes of tensor `gguf`, in the mapped file.
    fn raw(&self, gguf: &str, info: &TensorInfo) -> Result<&[u8]> {
        let Some((block, block_bytes)) = info.stored.block() else {
            bail!(
                "tensor \"{gguf}\" is stored as {}, which tpserve does not read; use a GGUF in f32, f16, bf16, \
                 Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL or IQ4_XS",
                info.stored.name()
            )
        };
        // Checked: a corrupt header may declare dimensions whose product overflows.
        let elements = info.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let Some(size) = elements.and_then(|n| (n / block).checked_mul(block_bytes)) else {
            bail!("tensor \"{gguf}\" declares dimensions {:?}, too large to address", info.dims)
        };
        let start = self.header.data_offset.saturating_add(info.offset);
        usize::try_from(start)
            .ok()
            .and_then(|start| self.map.get(start..start.checked_add(size)?))
            .with_context(|| format!("the tensor's {size} bytes at offset {start} lie beyond the file's end ({} bytes)", self.map.len()))
    }

    /// The hyper-parameters, as the config.json transformers would write for this model.
    pub fn config_json(&self) -> Result<serde_json::Value> {
        let arch = self.architecture()?;
        let key = |name: &str| format!("{}.{name}", arch.name());
        if let Some(kind) = self.opt_string(&key("rope.scaling.type"))? {
            if kind != "none" {
                bail!("GGUF metadata \"{}\" is \"{kind}\": scaled RoPE is not supported", key("rope.scaling.type"));
            }
        }
        let hidden = self.u64(&key("embedding_length"))?;
        let heads = self.u64(&key("attention.head_count"))?;
        let kv_heads = self.opt_u64(&key("attention.head_count_kv"))?.unwrap_or(heads);
        let head_dim = match self.opt_u64(&key("attention.key_length"))? {
            Some(d) => d,
            None if heads > 0 => hidden / heads,
            None => bail!("GGUF metadata \"{}\" must be positive", key("attention.head_count")),
        };
        if let Some(rope_dim) = self.opt_u64(&key("rope.dimension_count"))? {
            if rope_dim != head_dim {
                bail!("GGUF metadata \"{}\" ({rope_dim}) differs from the head size ({head_dim}): partial RoPE is not supported", key("rope.dimension_count"));
            }
        }
        let vocab_size = self.array("tokenizer.ggml.tokens")?.len();
        let mut config = serde_json::json!({
            "model_type": arch.model_type(),
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": self.u64(&key("feed_forward_length"))?,
            "num_hidden_layers": self.u64(&key("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": self.opt_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
            "rope_theta": self.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            "max_position_embeddings": self.opt_u64(&key("context_length"))?.unwrap_or(4096),
            // No separate output matrix means the embedding doubles as the lm_head.
            "tie_word_embeddings": !self.has_tensor("output.weight"),
            "attention_bias": self.has_tensor("blk.0.attn_q.bias"),
        });
        if arch == Architecture::Qwen3Moe {
            self.add_moe_fields(&mut config, &key)?;
        }
        if let Some(id) = self.opt_u64("tokenizer.ggml.bos_token_id")? {
            config["bos_token_id"] = id.into();
        }
        let stops = self.end_of_generation_ids()?;
        if !stops.is_empty() {
            config["eos_token_id"] = stops.into();
        }
        Ok(config)
    }

    /// The ids that end a generation. A checkpoint's generation_config.json lists several
    /// (Qwen3's `<|im_end|>` and `<|endoftext|>`, Llama 3 Instruct's `<|end_of_text|>`,
    /// `<|eom_id|>` and `<|eot_id|>`); a GGUF keeps one as `eos_token_id`, perhaps
    /// `eot_token_id` and `eom_token_id`. The rest are the control tokens of those names, which
    /// llama.cpp stops at too.
    fn end_of_generation_ids(&self) -> Result<Vec<u64>> {
        const END_TOKENS: [&str; 5] = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"];
        let mut ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            ids.extend(self.opt_u64(key)?);
        }
        if self.value("tokenizer.ggml.tokens").is_some() {
            let types = self.opt_int_list("tokenizer.ggml.token_type")?.unwrap_or_default();
            for (id, token) in self.string_list("tokenizer.ggml.tokens")?.iter().enumerate() {
                if END_TOKENS.contains(token) && types.get(id) == Some(&TOKEN_TYPE_CONTROL) {
                    ids.push(id as u64);
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        ids.retain(|id| seen.insert(*id));
        Ok(ids)
    }

    /// Qwen3 MoE's expert fields. A layer without a router (`ffn_gate_inp`) has a dense MLP,
    /// which is what `mlp_only_layers` says in config.json; the top-k weights are renormalised,
    /// as llama.cpp always does for this architecture unless the file says otherwise.
    fn add_moe_fields(&self, config: &mut serde_json::Value, key: &dyn Fn(&str) -> String) -> Result<()> {
        let layers = config["num_hidden_layers"].as_u64().unwrap_or(0);
        let dense: Vec<u64> = (0..layers).filter(|i| !self.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight"))).collect();
        config["num_experts"] = self.u64(&key("expert_count"))?.into();
        config["num_experts_per_tok"] = self.u64(&key("expert_used_count"))?.into();
        config["moe_intermediate_size"] = self.u64(&key("expert_feed_forward_length"))?.into();
        config["norm_topk_prob"] = self.opt_bool(&key("expert_weights_norm"))?.unwrap_or(true).into();
        config["decoder_sparse_step"] = 1.into();
        config["mlp_only_layers"] = dense.into();
        Ok(())
    }

    pub fn model_config(&self) -> Result<ModelConfig> {
        let json = self.config_json()?;
        let mut config = ModelConfig::from_json_str(&json.to_string())
            .with_context(|| format!("invalid model metadata in {}", self.path.display()))?;
        if let Some(divisors) = self.rope_divisors()? {
            config.rope_scaling = RopeScaling::Divisors(divisors);
        }
        Ok(config)
    }

    /// `rope_freqs.weight`: what llama.cpp's converter writes for Llama 3's RoPE scaling, the
    /// divisor of each frequency (a few hundred bytes, read here rather than by the loader).
    fn rope_divisors(&self) -> Result<Option<Vec<f32>>> {
        const NAME: &str = "rope_freqs.weight";
        if !self.has_tensor(NAME) {
            return Ok(None);
        }
        let read = || -> Result<Vec<f32>> {
            let info = self.info(NAME)?;
            if info.stored != Stored::Ggml(GgmlDType::F32) {
                bail!("is stored as {}, not f32", info.stored.name());
            }
            let divisors: Vec<f32> = self.raw(NAME, info)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if let Some(bad) = divisors.iter().find(|d| !(d.is_finite() && **d > 0.0)) {
                bail!("holds {bad}; every divisor must be a positive number");
            }
            Ok(divisors)
        };
        read().map(Some).with_context(|| format!("cannot read GGUF tensor \"{NAME}\" of {}", self.path.display()))
    }
}

/// A `general.architecture` tpserve serves, and what it tells the loader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
    Qwen3Moe,
}

impl Architecture {
    fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" => Ok(Self::Llama),
            "qwen3" => Ok(Self::Qwen3),
            "qwen3moe" => Ok(Self::Qwen3Moe),
            other => bail!("GGUF architecture \"{other}\" is not supported (llama, qwen3, qwen3moe)"),
        }
    }

    /// The name llama.cpp gives it, which prefixes its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
        }
    }

    /// The config.json `model_type` it implies.
    fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3Moe => "qwen3_moe",
            other => other.name(),
        }
    }

    /// Whether llama.cpp's converter stored the q/k projection rows permuted for interleaved
    /// RoPE (`LlamaModel.permute`); its Qwen3 converter leaves them as they are.
    fn permutes_qk(self) -> bool {
        self == Self::Llama
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U64(n) => Some(*n),
        other => as_i64(other).and_then(|n| u64::try_from(n).ok()),
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::U8(n) => Some(*n as i64),
        Value::I8(n) => Some(*n as i64),
        Value::U16(n) => Some(*n as i64),
        Value::I16(n) => Some(*n as i64),
        Value::U32(n) => Some(*n as i64),
        Value::I32(n) => Some(*n as i64),
        Value::U64(n) => i64::try_from(*n).ok(),
        Value::I64(n) => Some(*n),
        _ => None,
    }
}

/// The Hugging Face name of a GGUF tensor, or None for tensors tpserve does not use.
pub fn hf_name(gguf_name: &str) -> Option<String> {
    let (stem, suffix) = gguf_name.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let top = match stem {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(top) = top {
        return Some(format!("{top}.{suffix}"));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // Experts stacked in one tensor per projection keep the packed layout's suffix-less names.
    let stacked = match part {
        "ffn_gate_exps" => Some("gate_proj"),
        "ffn_up_exps" => Some("up_proj"),
        "ffn_down_exps" => Some("down_proj"),
        _ => None,
    };
    if let Some(projection) = stacked {
        return (suffix == "weight").then(|| format!("model.layers.{layer}.mlp.experts.{projection}"));
    }
    let part = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" => "mlp.gate",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{part}.{suffix}"))
}

/// Undoes llama.cpp's `LlamaModel.permute` of q/k projection rows: GGUF holds each head's rows
/// as (head_dim/2, 2) interleaved pairs, Hugging Face as (2, head_dim/2) halves.
fn unpermute_rows(tensor: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = tensor.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || rows % (heads * 2) != 0 {
        bail!("{rows} rows do not split into {heads} heads of pairs");
    }
    let mut split = vec![heads, rows / heads / 2, 2];
    split.extend_from_slice(&dims[1..]);
    Ok(tensor.reshape(split)?.transpose(1, 2)?.contiguous()?.reshape(dims)?)
}

/// For each Hugging Face row of a q/k projection, the GGUF row it is stored in: the row
/// reordering [`unpermute_rows`] performs, for tensors kept in blocks.
fn unpermuted_row_order(rows: usize, heads: usize) -> Result<Vec<usize>> {
    if heads == 0 || rows % (heads * 2) != 0 {
        bail!("{rows} rows do not split into {heads} heads of pairs");
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    // HF row h*hd + a*half + b holds GGUF row h*hd + 2b + a.
    Ok((0..rows)
        .map(|r| {
            let (h, within) = (r / head_dim, r % head_dim);
            let (a, b) = (within / half, within % half);
            h * head_dim + 2 * b + a
        })
        .collect())
}

/// The weights of a GGUF file, read from a memory map: block slices straight from the mapped
/// bytes, dense tensors dequantized one at a time on request.
pub struct GgufWeights {
    file: GgufFile,
    config: ModelConfig,
    /// our name -> GGUF name
    names: HashMap<String, String>,
    /// (query heads, KV heads) when the q/k projection rows are stored permuted (Llama)
    permuted_qk: Option<(usize, usize)>,
    total_bytes: u64,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config = file.model_config()?;
        let permutes = file.architecture()?.permutes_qk();
        let total_bytes = file.map.len() as u64;
        let names = file
            .header
            .tensors
            .keys()
            .filter_map(|gguf| hf_name(gguf).map(|ours| (ours, gguf.clone())))
            .collect();
        Ok(Self {
            file,
            names,
            permuted_qk: permutes.then_some((config.num_attention_heads, config.num_key_value_heads)),
            config,
            total_bytes,
        })
    }

    /// The model config its metadata implies.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The heads whose rows GGUF tensor `gguf` holds permuted: a Llama q or k projection.
    fn permuted_heads(&self, gguf: &str) -> Option<usize> {
        let (q_heads, kv_heads) = self.permuted_qk?;
        let layer_part = gguf.strip_prefix("blk.")?.split_once('.')?.1;
        match layer_part {
            "attn_q.weight" | "attn_q.bias" => Some(q_heads),
            "attn_k.weight" | "attn_k.bias" => Some(kv_heads),
            _ => None,
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn gguf_name(&self, name: &str) -> Result<&str> {
        self.names
            .get(name)
            .map(String::as_str)
            .with_context(|| format!("tensor \"{name}\" is missing from {}", self.file.path.display()))
    }

    /// The shape of `name` in row-major (Hugging Face) order.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let gguf = self.gguf_name(name)?;
        let info = self.file.info(gguf)?;
        Ok(info.dims.clone())
    }

    /// The dtype `name` holds its values in, as a dense tensor: f32, f16 or bf16 as stored; f32
    /// for the block formats, which are dequantized to f32 when read dense.
    pub fn stored_dtype(&self, name: &str) -> Result<candle_core::DType> {
        Ok(match self.file.info(self.gguf_name(name)?)?.stored {
            Stored::Ggml(GgmlDType::F16) => candle_core::DType::F16,
            Stored::Ggml(GgmlDType::BF16) => candle_core::DType::BF16,
            _ => candle_core::DType::F32,
        })
    }

    /// A rank's slice of a 2-D tensor in a supported block format, kept in blocks (see
    /// [`super::quant::formats::slice`]); None for other formats (f32, f16: read them dense).
    /// The q/k rows are put in Hugging Face order by reordering whole block rows.
    pub fn quantized_slice(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Option<super::quant::Sliced>> {
        self.with_blocks(name, expected_shape, |gguf, dtype, bytes| {
            let [rows, cols] = *expected_shape else { bail!("a matrix has 2 dimensions, not {expected_shape:?}") };
            let order = self.permuted_heads(gguf).map(|heads| unpermuted_row_order(rows, heads)).transpose()?;
            super::quant::formats::slice(dtype, rows, cols, bytes, dim, ranges, order.as_deref())
        })
    }

    /// A rank's slice of every matrix of a stack [matrices, rows, cols] (a Qwen3 MoE layer's
    /// experts), each cut along `dim` of the matrix as [`Self::quantized_slice`] cuts one; None
    /// for formats read dense.
    pub fn quantized_stack_slices(
        &self,
        name: &str,
        expected_shape: &[usize],
        dim: usize,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Option<Vec<super::quant::Sliced>>> {
        self.with_blocks(name, expected_shape, |_, dtype, bytes| {
            let [_, rows, cols] = *expected_shape else { bail!("a stack of matrices has 3 dimensions, not {expected_shape:?}") };
            let matrix_bytes = rows * super::quant::formats::row_bytes(dtype, cols);
            bytes.chunks_exact(matrix_bytes).map(|matrix| super::quant::formats::slice(dtype, rows, cols, matrix, dim, ranges, None)).collect()
        })
    }

    /// `f` of the GGUF name, block format and row-major block bytes of `name` when it is stored
    /// in a block format the quantized kernels take (after checking its shape); None otherwise.
    fn with_blocks<T>(
        &self,
        name: &str,
        expected_shape: &[usize],
        f: impl FnOnce(&str, Format, &[u8]) -> Result<T>,
    ) -> Result<Option<T>> {
        let gguf = self.gguf_name(name)?;
        let info = self.file.info(gguf)?;
        let format = match info.stored {
            Stored::Ggml(dtype) => Format::of_ggml(dtype),
            Stored::Iq4(_) => Some(Format::Iq4Nl),
            Stored::Other(..) => None,
        };
        let Some(format) = format else { return Ok(None) };
        if info.dims != expected_shape {
            bail!("tensor \"{name}\" has shape {:?} but the model config implies {expected_shape:?}", info.dims);
        }
        let context = || format!("cannot read GGUF tensor \"{gguf}\" (\"{name}\") from {}", self.file.path.display());
        let bytes = self.file.raw(gguf, info).with_context(context)?;
        let (format, blocks) = match info.stored {
            Stored::Iq4(Iq4::Xs) => iq4_xs_held(bytes),
            _ => (format, Cow::Borrowed(bytes)),
        };
        f(gguf, format, &blocks).with_context(context).map(Some)
    }

    /// The whole tensor in f32 on the CPU, with q/k rows in Hugging Face order.
    pub fn dequantize(&self, name: &str) -> Result<Tensor> {
        let gguf = self.gguf_name(name)?;
        let info = self.file.info(gguf)?;
        let context = || format!("cannot read GGUF tensor \"{gguf}\" (\"{name}\") from {}", self.file.path.display());
        let bytes = self.file.raw(gguf, info).with_context(context)?;
        let dims = info.dims.clone();
        let tensor = match info.stored {
            Stored::Iq4(kind) => {
                let mut values = vec![0f32; dims.iter().product()];
                iq4::dequantize(kind, bytes, &mut values);
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
            Stored::Ggml(dtype) => candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, bytes, dims, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .map_err(|err| anyhow::anyhow!("{err}"))
                .with_context(context)?,
            Stored::Other(..) => bail!("unreachable: raw() refuses {}", info.stored.name()),
        };
        match self.permuted_heads(gguf) {
            Some(heads) => unpermute_rows(&tensor, heads).with_context(context),
            None => Ok(tensor),
        }
    }
}

/// IQ4_XS blocks as the integer kernels hold them: IQ4_NL blocks, each 32-value scale rounded
/// to f16; or, where one overflows f16, Q8_0 blocks of the dequantized values (both logged
/// once).
fn iq4_xs_held(bytes: &[u8]) -> (Format, Cow<'_, [u8]>) {
    use super::quant::formats::log_once;
    if let Some(nl) = iq4::xs_to_nl(bytes) {
        log_once("IQ4_XS tensors are held as IQ4_NL, each 32-value scale rounded to f16 (relative error at most 2^-11 above 6.1e-5)".into());
        return (Format::Iq4Nl, Cow::Owned(nl));
    }
    log_once("IQ4_XS tensors with scales beyond f16 are dequantized and quantized to Q8_0".into());
    let mut values = vec![0f32; bytes.len() / Iq4::Xs.type_size() * Iq4::Xs.block_size()];
    iq4::dequantize(Iq4::Xs, bytes, &mut values);
    let mut q8_0 = Vec::new();
    super::quant::formats::quantize_into(Format::Q8_0, &values, &mut q8_0);
    (Format::Q8_0, Cow::Owned(q8_0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.12.attn_output.weight").as_deref(), Some("model.layers.12.self_attn.o_proj.weight"));
        assert_eq!(hf_name("blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.post_attention_layernorm.weight"));
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.3.attn_q_norm.weight").as_deref(), Some("model.layers.3.self_attn.q_norm.weight"));
        assert_eq!(hf_name("blk.3.attn_k_norm.weight").as_deref(), Some("model.layers.3.self_attn.k_norm.weight"));
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.2.ffn_gate_inp.weight").as_deref(), Some("model.layers.2.mlp.gate.weight"));
        assert_eq!(hf_name("blk.2.ffn_gate_exps.weight").as_deref(), Some("model.layers.2.mlp.experts.gate_proj"));
        assert_eq!(hf_name("blk.2.ffn_down_exps.weight").as_deref(), Some("model.layers.2.mlp.experts.down_proj"));
        assert_eq!(hf_name("blk.2.ffn_down_exps.bias"), None);
    }

    #[test]
    fn names_the_architectures_it_refuses() {
        assert_eq!(Architecture::parse("qwen3").unwrap(), Architecture::Qwen3);
        assert_eq!(Architecture::parse("qwen3moe").unwrap().model_type(), "qwen3_moe");
        assert!(Architecture::Llama.permutes_qk() && !Architecture::Qwen3.permutes_qk() && !Architecture::Qwen3Moe.permutes_qk());
        for (name, says) in [("gemma3", "(llama, qwen3, qwen3moe)"), ("qwen2moe", "not supported")] {
            let err = format!("{:#}", Architecture::parse(name).unwrap_err());
            assert!(err.contains(name) && err.contains(says), "{err}");
        }
    }

    /// The inverse of llama.cpp's permute (convert_hf_to_gguf.py), written the Python way.
    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (heads, hd, cols) = (3, 4, 2);
        let hf: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let hf = Tensor::from_vec(hf, (heads * hd, cols), &Device::Cpu).unwrap();
        // permute: reshape(heads, 2, hd/2, cols).swapaxes(1, 2)
        let gguf = hf.reshape((heads, 2, hd / 2, cols)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((heads * hd, cols)).unwrap();
        let back = unpermute_rows(&gguf, heads).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
        // the same as a row order, for tensors kept in blocks
        let order = unpermuted_row_order(heads * hd, heads).unwrap();
        let rows = gguf.to_vec2::<f32>().unwrap();
        let reordered: Vec<Vec<f32>> = order.iter().map(|&r| rows[r].clone()).collect();
        assert_eq!(reordered, hf.to_vec2::<f32>().unwrap());
        assert_ne!(gguf.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }

    /// A GGUF v3 file with no metadata and one tensor of `dims` (GGML order) and `dtype`.
    fn gguf_with_tensor(dims: &[u64], dtype: u32, data_bytes: usize) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend(1u64.to_le_bytes()); // tensors
        out.extend(0u64.to_le_bytes()); // metadata entries
        let name = b"token_embd.weight";
        out.extend((name.len() as u64).to_le_bytes());
        out.extend(name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(dtype.to_le_bytes());
        out.extend(0u64.to_le_bytes()); // offset
        out.resize(out.len().next_multiple_of(32), 0);
        out.resize(out.len() + data_bytes, 0);
        out
    }

    fn open_error(bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.gguf");
        std::fs::write(&path, bytes).unwrap();
        format!("{:#}", GgufFile::open(&path).err().expect("the file must be refused"))
    }

    #[test]
    fn refuses_empty_and_partial_block_shapes() {
        // f32 (type 0): a zero dimension, either way round.
        for dims in [[0u64, 8], [8, 0]] {
            let err = open_error(&gguf_with_tensor(&dims, 0, 0));
            assert!(err.contains("every dimension must be positive"), "{dims:?}: {err}");
        }
        // Q8_0 (type 8, blocks of 32 values in 34 bytes): rows of 48 values.
        let err = open_error(&gguf_with_tensor(&[48, 2], 8, 34 * 3));
        assert!(err.contains("not a whole number of"), "{err}");
    }

    /// A type tpserve does not read (IQ2_XXS: 256 values in 66 bytes) opens, and reading the
    /// tensor says which type it is and what is read.
    #[test]
    fn names_a_tensor_type_it_does_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("iq2.gguf");
        std::fs::write(&path, gguf_with_tensor(&[256, 2], 16, 66 * 2)).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let info = file.info("token_embd.weight").unwrap();
        let err = format!("{:#}", file.raw("token_embd.weight", info).unwrap_err());
        assert!(err.contains("IQ2_XXS (GGML type 16), which tpserve does not read") && err.contains("IQ4_XS"), "{err}");
    }
}
