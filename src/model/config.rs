//! config.json parsing for the model families we serve.
//!
//! Real checkpoints disagree on where things live (transformers 5 moved rope_theta into
//! `rope_parameters`, multimodal checkpoints nest the text model under `text_config`), so the
//! parser reads a JSON value and normalises it into one [`ModelConfig`].

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The architectures tpserve knows how to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFamily {
    Qwen3,
    Llama,
    /// Qwen3 with sparse mixture-of-experts MLPs.
    Qwen3Moe,
    /// Qwen3.5 dense: Gated DeltaNet layers interleaved with gated full attention.
    Qwen3_5,
    /// Qwen3.5 hybrid layers with mixture-of-experts MLPs and a shared expert.
    Qwen3_5Moe,
}

impl ModelFamily {
    fn from_model_type(model_type: &str) -> Result<Self> {
        match model_type {
            "qwen3" => Ok(Self::Qwen3),
            "llama" => Ok(Self::Llama),
            "qwen3_moe" => Ok(Self::Qwen3Moe),
            "qwen3_5" | "qwen3_5_text" => Ok(Self::Qwen3_5),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Ok(Self::Qwen3_5Moe),
            other => bail!(
                "unsupported model_type \"{other}\" in config.json (supported: qwen3, llama, \
                 qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text)"
            ),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::Llama => "llama",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen3_5 => "qwen3_5",
            Self::Qwen3_5Moe => "qwen3_5_moe",
        }
    }
}

/// The multimodal wrappers (Qwen3.5 as published on the hub) keep the language model's
/// hyper-parameters under "text_config"; the text-only classes write them at the top level.
fn nests_text_config(model_type: &str) -> bool {
    matches!(model_type, "qwen3_5" | "qwen3_5_moe")
}

/// Normalised hyper-parameters of a decoder-only transformer.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: ModelFamily,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// 0 for families whose every MLP is a mixture of experts and that may omit it (Qwen3.5 MoE).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// Qwen3 normalises q and k per head before RoPE; Llama does not.
    pub qk_norm: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The JSON object the text model's fields were read from (the top level, or "text_config"),
    /// for the family-specific parsers.
    pub text_config: Value,
}

impl ModelConfig {
    /// Reads `<dir>/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("invalid {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        if !root.is_object() {
            bail!("config.json must be a JSON object");
        }
        let model_type = string_field(&root, "model_type")?;
        let family = ModelFamily::from_model_type(&model_type)?;
        let text = if nests_text_config(&model_type) {
            match root.get("text_config") {
                Some(text) if text.is_object() => text,
                _ => bail!(
                    "model_type \"{model_type}\" keeps the language model's config in a \
                     \"text_config\" object, which is missing"
                ),
            }
        } else {
            &root
        };
        // Fields the wrapper may hold instead of (or as well as) its text config.
        let outer = |name: &str| text.get(name).filter(|v| !v.is_null()).or_else(|| root.get(name));
        let reader = Fields(text);

        let hidden_size = reader.usize("hidden_size")?;
        let num_attention_heads = reader.usize("num_attention_heads")?;
        let num_key_value_heads =
            reader.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            bail!("num_attention_heads and num_key_value_heads must be positive");
        }
        if num_attention_heads % num_key_value_heads != 0 {
            bail!(
                "num_attention_heads ({num_attention_heads}) must be a multiple of \
                 num_key_value_heads ({num_key_value_heads})"
            );
        }
        let head_dim = match reader.opt_usize("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    bail!(
                        "head_dim is absent and hidden_size ({hidden_size}) is not divisible by \
                         num_attention_heads ({num_attention_heads})"
                    );
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("head_dim must be a positive even number, got {head_dim}");
        }
        let hidden_act = text.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if hidden_act != "silu" {
            bail!("hidden_act \"{hidden_act}\" is not supported (only silu)");
        }
        if text.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            bail!("use_sliding_window=true is not supported");
        }
        let rope_scaling = rope_scaling(text)?;
        let intermediate_size = match family {
            ModelFamily::Qwen3_5Moe => reader.opt_usize("intermediate_size")?.unwrap_or(0),
            _ => reader.usize("intermediate_size")?,
        };
        // The wrapper's flag is the one transformers ties by.
        let tie_word_embeddings = root
            .get("tie_word_embeddings")
            .or_else(|| text.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);

        let config = ModelConfig {
            family,
            vocab_size: reader.usize("vocab_size")?,
            hidden_size,
            intermediate_size,
            num_hidden_layers: reader.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: reader.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: rope_theta(text)?,
            rope_scaling,
            max_position_embeddings: reader.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings,
            attention_bias: text.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            qk_norm: family != ModelFamily::Llama,
            eos_token_ids: token_ids(outer("eos_token_id"), "eos_token_id")?,
            bos_token_id: token_ids(outer("bos_token_id"), "bos_token_id")?.first().copied(),
            model_type,
            text_config: text.clone(),
        };
        for (name, value) in [
            ("vocab_size", config.vocab_size),
            ("hidden_size", config.hidden_size),
            ("num_hidden_layers", config.num_hidden_layers),
            ("max_position_embeddings", config.max_position_embeddings),
        ] {
            if value == 0 {
                bail!("{name} must be positive");
            }
        }
        // The RoPE tables hold every position up front (rotary_dim * 4 bytes each), so an
        // absurd context length must be refused here rather than attempted as an allocation.
        if config.max_position_embeddings > MAX_POSITIONS {
            bail!(
                "max_position_embeddings is {}, above the {MAX_POSITIONS} positions tpserve supports",
                config.max_position_embeddings
            );
        }
        if config.intermediate_size == 0 && family != ModelFamily::Qwen3_5Moe {
            bail!("intermediate_size must be positive");
        }
        Ok(config)
    }
}

/// The longest context a model may declare (`max_position_embeddings`): 4Mi positions, whose
/// RoPE tables take 2 GiB at a head size of 128.
pub const MAX_POSITIONS: usize = 1 << 22;

/// Reads EOS ids from generation_config.json (which overrides config.json, as in transformers).
pub fn generation_eos_ids(dir: &Path) -> Result<Option<Vec<u32>>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let root: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    match root.get("eos_token_id") {
        None | Some(Value::Null) => Ok(None),
        some => Ok(Some(token_ids(some, "eos_token_id")?)),
    }
}

/// Typed reads of a config object's fields, with errors that name the field.
pub(crate) struct Fields<'a>(pub(crate) &'a Value);

impl Fields<'_> {
    pub(crate) fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .with_context(|| format!("field \"{name}\" must be a non-negative integer, got {v}")),
        }
    }

    pub(crate) fn usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?
            .with_context(|| format!("required field \"{name}\" is missing"))
    }

    pub(crate) fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .with_context(|| format!("field \"{name}\" must be a number, got {v}")),
        }
    }

    pub(crate) fn opt_bool(&self, name: &str) -> Result<Option<bool>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .with_context(|| format!("field \"{name}\" must be true or false, got {v}")),
        }
    }

    /// A list of non-negative integers; None when absent or null.
    pub(crate) fn opt_usize_list(&self, name: &str) -> Result<Option<Vec<usize>>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).with_context(|| {
                        format!("field \"{name}\" must be a list of non-negative integers, got {v}")
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => bail!("field \"{name}\" must be a list of non-negative integers, got {v}"),
        }
    }

    /// A list of strings; None when absent or null.
    pub(crate) fn opt_str_list(&self, name: &str) -> Result<Option<Vec<String>>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .with_context(|| format!("field \"{name}\" must be a list of strings, got {v}"))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => bail!("field \"{name}\" must be a list of strings, got {v}"),
        }
    }
}

fn string_field(root: &Value, name: &str) -> Result<String> {
    root.get(name)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .with_context(|| format!("required string field \"{name}\" is missing"))
}

/// transformers 5 writes `rope_parameters.rope_theta`; older checkpoints a top-level `rope_theta`.
fn rope_theta(root: &Value) -> Result<f64> {
    let nested = root.get("rope_parameters").and_then(|p| p.get("rope_theta"));
    match nested.or_else(|| root.get("rope_theta")) {
        None | Some(Value::Null) => Ok(10_000.0),
        Some(v) => v
            .as_f64()
            .filter(|t| *t > 0.0)
            .with_context(|| format!("rope_theta must be a positive number, got {v}")),
    }
}

/// How a checkpoint stretches RoPE's frequencies beyond the default `theta^(-2i/d)`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3.x (`rope_type: "llama3"`): frequencies whose wavelength exceeds
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, those
    /// shorter than `.. / high_freq_factor` kept, and a linear ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// One divisor per frequency, as a GGUF file stores Llama 3's scaling (`rope_freqs.weight`,
    /// computed by llama.cpp's converter from the parameters above).
    Divisors(Vec<f32>),
}

/// `rope_parameters` (transformers 5) or `rope_scaling` (earlier checkpoints). Other scaled
/// variants change the numerics in ways not implemented here: refusing them beats silently
/// wrong output.
fn rope_scaling(root: &Value) -> Result<RopeScaling> {
    let mut scaling = RopeScaling::None;
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(params) = root.get(key).filter(|p| p.is_object()) else { continue };
        let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str);
        match kind {
            None | Some("default") => {}
            Some("llama3") => scaling = llama3_scaling(key, &Fields(params))?,
            Some(other) => bail!("{key}.rope_type \"{other}\" is not supported (default, llama3)"),
        }
    }
    Ok(scaling)
}

fn llama3_scaling(key: &str, params: &Fields) -> Result<RopeScaling> {
    let positive = |name: &str| -> Result<f64> {
        match params.opt_f64(name).with_context(|| format!("in {key}"))? {
            Some(v) if v > 0.0 => Ok(v),
            Some(v) => bail!("{key}.{name} must be positive, got {v}"),
            None => bail!("{key}.{name} is required by rope_type \"llama3\""),
        }
    };
    let (low_freq_factor, high_freq_factor) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
    if high_freq_factor <= low_freq_factor {
        bail!("{key}.high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})");
    }
    Ok(RopeScaling::Llama3 {
        factor: positive("factor")?,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings: positive("original_max_position_embeddings")?,
    })
}

fn token_ids(value: Option<&Value>, name: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| format!("{name} must be a token id or a list of ids, got {v}"))
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3: &str = r#"{"model_type":"qwen3","vocab_size":448,"hidden_size":64,
        "intermediate_size":128,"num_hidden_layers":4,"num_attention_heads":8,
        "num_key_value_heads":4,"head_dim":16,"rope_parameters":{"rope_theta":1e6,"rope_type":"default"},
        "tie_word_embeddings":true,"eos_token_id":2}"#;

    #[test]
    fn parses_transformers5_rope_parameters() {
        let config = ModelConfig::from_json_str(QWEN3).unwrap();
        assert_eq!(config.rope_theta, 1e6);
        assert_eq!(config.eos_token_ids, vec![2]);
        assert!(config.qk_norm);
    }

    #[test]
    fn refuses_a_context_too_long_to_tabulate() {
        let text = QWEN3.replace(r#""eos_token_id":2"#, r#""eos_token_id":2,"max_position_embeddings":1000000000000"#);
        let err = format!("{:#}", ModelConfig::from_json_str(&text).unwrap_err());
        assert!(err.contains("max_position_embeddings") && err.contains("4194304"), "{err}");
    }

    #[test]
    fn accepts_top_level_rope_theta() {
        let text = QWEN3.replace(r#""rope_parameters":{"rope_theta":1e6,"rope_type":"default"}"#, r#""rope_theta":5e5"#);
        assert_eq!(ModelConfig::from_json_str(&text).unwrap().rope_theta, 5e5);
    }

    /// Llama 3.1's config.json (`rope_scaling`, top-level rope_theta) and transformers 5's
    /// (`rope_parameters`) give the same scaling; other scaled variants and incomplete
    /// parameters are refused with the field named.
    #[test]
    fn reads_llama3_rope_scaling_and_refuses_other_kinds() {
        let params = r#""factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192"#;
        let want = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 };
        let default = r#""rope_parameters":{"rope_theta":1e6,"rope_type":"default"}"#;
        let old = QWEN3.replace(default, &format!(r#""rope_theta":5e5,"rope_scaling":{{"rope_type":"llama3",{params}}}"#));
        let new = QWEN3.replace(default, &format!(r#""rope_parameters":{{"rope_type":"llama3","rope_theta":5e5,{params}}}"#));
        for text in [old, new] {
            let config = ModelConfig::from_json_str(&text).unwrap();
            assert_eq!((config.rope_theta, &config.rope_scaling), (5e5, &want));
        }
        assert_eq!(ModelConfig::from_json_str(QWEN3).unwrap().rope_scaling, RopeScaling::None);

        let refused = |replacement: &str| format!("{:#}", ModelConfig::from_json_str(&QWEN3.replace(default, replacement)).unwrap_err());
        let err = refused(r#""rope_scaling":{"type":"yarn","factor":4.0}"#);
        assert!(err.contains("rope_scaling.rope_type \"yarn\"") && err.contains("llama3"), "{err}");
        let err = refused(r#""rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}"#);
        assert!(err.contains("rope_parameters.original_max_position_embeddings is required"), "{err}");
        let err = refused(r#""rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":4.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#);
        assert!(err.contains("must exceed low_freq_factor"), "{err}");
        let err = refused(r#""rope_parameters":{"rope_type":"llama3","factor":-8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#);
        assert!(err.contains("rope_parameters.factor must be positive"), "{err}");
    }

    #[test]
    fn hub_layout_reads_the_nested_text_config() {
        let text = r#"{"model_type":"qwen3_5_moe","tie_word_embeddings":true,"text_config":{
            "model_type":"qwen3_5_moe_text","vocab_size":448,"hidden_size":64,"num_hidden_layers":4,
            "num_attention_heads":8,"num_key_value_heads":4,"head_dim":16,"eos_token_id":2,
            "rope_parameters":{"rope_theta":1e7,"rope_type":"default","partial_rotary_factor":0.25,
                "mrope_section":[1,1,0],"mrope_interleaved":true},
            "num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32}}"#;
        let config = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(config.family, ModelFamily::Qwen3_5Moe);
        assert_eq!((config.hidden_size, config.vocab_size, config.intermediate_size), (64, 448, 0));
        assert_eq!(config.rope_theta, 1e7);
        assert_eq!(config.eos_token_ids, vec![2]);
        assert!(config.tie_word_embeddings);
        assert_eq!(config.text_config["num_experts"], 4);

        let err = format!("{:#}", ModelConfig::from_json_str(r#"{"model_type":"qwen3_5"}"#).unwrap_err());
        assert!(err.contains("text_config"), "{err}");
    }

    #[test]
    fn errors_name_the_field() {
        let text = QWEN3.replace(r#""hidden_size":64,"#, "");
        let err = format!("{:#}", ModelConfig::from_json_str(&text).unwrap_err());
        assert!(err.contains("hidden_size"), "{err}");
        let err = format!("{:#}", ModelConfig::from_json_str("{nope").unwrap_err());
        assert!(err.contains("not valid JSON"), "{err}");
        let text = QWEN3.replace("qwen3", "gpt2");
        let err = format!("{:#}", ModelConfig::from_json_str(&text).unwrap_err());
        assert!(err.contains("unsupported model_type"), "{err}");
    }
}
