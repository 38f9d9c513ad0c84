//! Shared helpers for the integration tests: fixtures and the oracle's expected outputs.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub struct ExpectedPrompt {
    pub ids: Vec<u32>,
    pub greedy_new_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
}

/// The oracle's outputs for a fixture. For bf16 weights computed in f32 the reference is
/// `f32_compute_of_same_bf16_weights` (bf16 compute has exact top-2 ties).
pub fn expected(name: &str) -> Vec<ExpectedPrompt> {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).expect("expected.json");
    // Python's json writes -Infinity for masked logits; JSON has no such number.
    let text = text.replace("-Infinity", "null").replace("Infinity", "null").replace("NaN", "null");
    let json: Value = serde_json::from_str(&text).expect("expected.json parses");
    let prompts = json["prompts"].as_array().expect("prompts").clone();
    let reference = json.get("f32_compute_of_same_bf16_weights").and_then(Value::as_array).cloned();
    prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let source = reference.as_ref().map(|r| &r[i]).unwrap_or(prompt);
            ExpectedPrompt {
                ids: ids(&prompt["ids"]),
                greedy_new_ids: ids(&source["greedy_new_ids"]),
                last_logits: source["last_logits_full"]
                    .as_array()
                    .expect("last_logits_full")
                    .iter()
                    .map(|v| v.as_f64().expect("logit") as f32)
                    .collect(),
            }
        })
        .collect()
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().expect("id list").iter().map(|v| v.as_u64().expect("id") as u32).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
