//! One-layer Qwen3 checkpoints over the real Qwen3 vocabulary, tokenizer and chat template
//! (tests/fixtures/qwen3_chat), written by the tests that serve them: random weights
//! (`tests/tools.rs`), and a model whose greedy output is a chosen token sequence, such as a
//! tool call (`tests/tool_calls.rs`).
//!
//! The tool caller is a lookup table built from the layers: its next token is a function of
//! the last three tokens. Embeddings are one-hot over the tokens of the sequence plus a constant
//! dimension; attention head `l` attends only to the token `l + 1` places back (its queries and
//! keys are constant vectors whose RoPE phases line up at that distance and nowhere else in 4096
//! positions) and copies that token's one-hot into a dimension block of its own; each MLP unit
//! fires only when the current token and both earlier ones match one context of the sequence
//! (a threshold on the constant dimension; SiLU is ~0 below it) and writes the next token's
//! one-hot, which the tied LM head reads out. The last three tokens, not the last one, because
//! the JSON of a call repeats tokens (`":` then ` "` before both the name and the city).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::json;

use super::fixture;

pub const VOCAB: usize = 151936;

/// The sizes of a one-layer Qwen3.
pub struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub rope_theta: f64,
}

/// Writes config, generation config, tokenizer, chat template and weights (tied embeddings,
/// f32) to `dir`; `weight(name, shape)` gives each tensor's values, row-major.
pub fn write(dir: &Path, shape: &Shape, mut weight: impl FnMut(&str, &[usize]) -> Vec<f32>) {
    std::fs::create_dir_all(dir).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("qwen3_chat").join(file), dir.join(file)).unwrap();
    }
    let Shape { hidden, heads, kv_heads, head_dim, intermediate, rope_theta } = *shape;
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "tie_word_embeddings": true, "attention_bias": false,
        "bos_token_id": null, "eos_token_id": 151645, "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("generation_config.json"), json!({"eos_token_id": [151645, 151643]}).to_string()).unwrap();
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight", vec![VOCAB, hidden]),
        ("model.norm.weight", vec![hidden]),
        ("model.layers.0.input_layernorm.weight", vec![hidden]),
        ("model.layers.0.post_attention_layernorm.weight", vec![hidden]),
        ("model.layers.0.self_attn.q_proj.weight", vec![heads * head_dim, hidden]),
        ("model.layers.0.self_attn.k_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("model.layers.0.self_attn.v_proj.weight", vec![kv_heads * head_dim, hidden]),
        ("model.layers.0.self_attn.o_proj.weight", vec![hidden, heads * head_dim]),
        ("model.layers.0.self_attn.q_norm.weight", vec![head_dim]),
        ("model.layers.0.self_attn.k_norm.weight", vec![head_dim]),
        ("model.layers.0.mlp.gate_proj.weight", vec![intermediate, hidden]),
        ("model.layers.0.mlp.up_proj.weight", vec![intermediate, hidden]),
        ("model.layers.0.mlp.down_proj.weight", vec![hidden, intermediate]),
    ];
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(name, shape)| {
            let values = weight(name, shape);
            assert_eq!(values.len(), shape.iter().product::<usize>(), "{name}");
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(&str, safetensors::tensor::TensorView)> = shapes
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| (*name, safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Deterministic pseudo-random weights (an LCG); norms are ones, as initialised. TP 2 splits
/// its 4 query and 2 KV heads.
pub fn write_random(dir: &Path) {
    let shape = Shape { hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64, rope_theta: 1e6 };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    write(dir, &shape, |name, shape| {
        let count: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            return vec![1.0; count];
        }
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
            })
            .collect()
    });
}

/// Tokens back the next token depends on, besides the current one (one attention head each).
const LAGS: usize = 2;
const HEAD_DIM: usize = 32;
/// A small RoPE base spreads the head's frequencies from 1 down to 0.014 rad per position, so
/// the phases line up again nowhere within the context.
const ROPE_THETA: f64 = 10.0;
/// The q_norm and k_norm weights: the attention score of the attended position exceeds every
/// other by 2·8²·1.886/√32 ≈ 43, so the softmax leaves ~1e-18 elsewhere.
const QK_NORM: f32 = 8.0;

/// Writes a model whose greedy continuation of `sequence[..=LAGS]` is the rest of `sequence`:
/// after any three consecutive tokens of it, the next one. Panics if three consecutive tokens
/// occur twice with different successors. Other contexts give all-zero logits.
pub fn write_successor(dir: &Path, sequence: &[u32]) {
    let mut slots: BTreeMap<u32, usize> = BTreeMap::new();
    for &token in sequence {
        let next = slots.len();
        slots.entry(token).or_insert(next);
    }
    let distinct = slots.len();
    assert!(distinct <= HEAD_DIM, "a head copies a one-hot of {distinct} tokens in {HEAD_DIM} dimensions");
    // rules[context] = next, the context being the current token and then the earlier ones
    let mut rules: BTreeMap<Vec<u32>, u32> = BTreeMap::new();
    for window in sequence.windows(LAGS + 2) {
        let context: Vec<u32> = window[..=LAGS].iter().rev().copied().collect();
        let next = window[LAGS + 1];
        let known = *rules.entry(context.clone()).or_insert(next);
        assert_eq!(known, next, "the context {context:?} is followed by two different tokens");
    }
    // dimension 0: constant; block 0: the current token (and the output); block 1 + l: lag l + 1
    let hidden = 1 + (LAGS + 1) * distinct;
    let dim = |block: usize, token: u32| 1 + block * distinct + slots[&token];
    let intermediate = rules.len().next_multiple_of(4);
    let shape = Shape { hidden, heads: LAGS, kv_heads: LAGS, head_dim: HEAD_DIM, intermediate, rope_theta: ROPE_THETA };
    // Every hidden state in the table's contexts has 2 + LAGS unit entries, so RMSNorm scales
    // them all by s, and a unit's gate is A·s·(matches - LAGS - 0.5): +20 on a full match,
    // -20 or less otherwise.
    let s = (hidden as f32 / (LAGS + 2) as f32).sqrt();
    let gain = 40.0 / s;
    let half = HEAD_DIM / 2;
    let frequency = |j: usize| ROPE_THETA.powf(-2.0 * j as f64 / HEAD_DIM as f64);
    write(dir, &shape, |name, shape| {
        let columns = shape.last().copied().unwrap_or(1);
        let mut w = vec![0.0f32; shape.iter().product()];
        let mut set = |row: usize, column: usize, value: f32| w[row * columns + column] = value;
        match name.rsplit_once("layers.0.").map_or(name, |(_, rest)| rest) {
            "model.embed_tokens.weight" => {
                for token in 0..VOCAB {
                    set(token, 0, 1.0);
                }
                for (&token, &slot) in &slots {
                    set(token as usize, 1 + slot, 1.0);
                }
            }
            "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => w.fill(QK_NORM),
            name if name.ends_with("norm.weight") => w.fill(1.0),
            // Head l's query is constant: ones on the first half of each rotary pair. Its key is
            // rotated ahead by (l + 1) steps per frequency, so q·k peaks at that distance.
            "self_attn.q_proj.weight" => {
                for l in 0..LAGS {
                    for j in 0..half {
                        set(l * HEAD_DIM + j, 0, 1.0);
                    }
                }
            }
            "self_attn.k_proj.weight" => {
                for l in 0..LAGS {
                    for j in 0..half {
                        let angle = (l + 1) as f64 * frequency(j);
                        set(l * HEAD_DIM + j, 0, angle.cos() as f32);
                        set(l * HEAD_DIM + half + j, 0, angle.sin() as f32);
                    }
                }
            }
            // Values carry the token's one-hot (scaled by input_layernorm to √(hidden/2)), which
            // o_proj writes into the head's own block as ones.
            "self_attn.v_proj.weight" => {
                for l in 0..LAGS {
                    for slot in 0..distinct {
                        set(l * HEAD_DIM + slot, 1 + slot, 1.0);
                    }
                }
            }
            "self_attn.o_proj.weight" => {
                for l in 0..LAGS {
                    for slot in 0..distinct {
                        set(1 + (l + 1) * distinct + slot, l * HEAD_DIM + slot, (2.0 / hidden as f32).sqrt());
                    }
                }
            }
            "mlp.gate_proj.weight" => {
                for (unit, context) in rules.keys().enumerate() {
                    for (block, &token) in context.iter().enumerate() {
                        set(unit, dim(block, token), gain);
                    }
                    set(unit, 0, -gain * (LAGS as f32 + 0.5));
                }
            }
            "mlp.up_proj.weight" => {
                for unit in 0..rules.len() {
                    set(unit, 0, 1.0);
                }
            }
            "mlp.down_proj.weight" => {
                for (unit, &next) in rules.values().enumerate() {
                    set(dim(0, next), unit, 1.0);
                }
            }
            other => panic!("no weights for {other}"),
        }
        w
    });
}
