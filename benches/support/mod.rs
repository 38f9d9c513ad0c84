//! Shared by the benchmarks: random-weight models in the Hugging Face layout.
#![allow(dead_code)]

pub mod served;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

/// The shape of a Qwen3-style dense model.
pub struct Qwen3Shape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
}

/// About 100M parameters with tied embeddings.
pub const QWEN3_100M: Qwen3Shape =
    Qwen3Shape { hidden: 768, layers: 12, heads: 12, kv_heads: 4, head_dim: 64, intermediate: 2048, vocab: 32000 };

/// Deterministic uniform weights in about [-0.035, 0.035] (xorshift; no RNG crate needed).
pub struct Weights(u64);

impl Weights {
    pub fn new() -> Self {
        Self(0x9E37_79B9_7F4A_7C15)
    }

    pub fn random(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.07
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    pub fn ones(&self, n: usize) -> Tensor {
        Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()
    }
}

/// Writes config.json, model.safetensors and a word-level tokenizer.json covering the whole
/// vocabulary (so the coordinator can detokenize every id); returns the parameter count.
pub fn write_qwen3(dir: &Path, shape: &Qwen3Shape) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    let config = json!({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": shape.vocab, "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "hidden_act": "silu", "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    write_tokenizer(dir, shape.vocab);
    let mut w = Weights::new();
    let (h, hd) = (shape.hidden, shape.head_dim);
    let mut tensors: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), w.random(&[shape.vocab, h])),
        ("model.norm.weight".into(), w.ones(h)),
    ];
    for layer in 0..shape.layers {
        let p = |name: &str| format!("model.layers.{layer}.{name}");
        tensors.push((p("input_layernorm.weight"), w.ones(h)));
        tensors.push((p("post_attention_layernorm.weight"), w.ones(h)));
        tensors.push((p("self_attn.q_proj.weight"), w.random(&[shape.heads * hd, h])));
        tensors.push((p("self_attn.k_proj.weight"), w.random(&[shape.kv_heads * hd, h])));
        tensors.push((p("self_attn.v_proj.weight"), w.random(&[shape.kv_heads * hd, h])));
        tensors.push((p("self_attn.o_proj.weight"), w.random(&[h, shape.heads * hd])));
        tensors.push((p("self_attn.q_norm.weight"), w.ones(hd)));
        tensors.push((p("self_attn.k_norm.weight"), w.ones(hd)));
        tensors.push((p("mlp.gate_proj.weight"), w.random(&[shape.intermediate, h])));
        tensors.push((p("mlp.up_proj.weight"), w.random(&[shape.intermediate, h])));
        tensors.push((p("mlp.down_proj.weight"), w.random(&[h, shape.intermediate])));
    }
    let params = tensors.iter().map(|(_, t)| t.elem_count()).sum();
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    params
}

/// A word-level tokenizer whose tokens are "w0" .. "w{vocab-1}".
pub fn write_tokenizer(dir: &Path, vocab: usize) {
    let words: serde_json::Map<String, serde_json::Value> = (0..vocab).map(|i| (format!("w{i}"), json!(i))).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}
