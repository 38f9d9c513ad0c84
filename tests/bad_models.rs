//! Bad model directories fail at load time with errors a person can act on, never a panic.

mod common;

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use tpserve::comm::SingleRank;
use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};

/// The group of rank 0 in a world of `world_size`. No collective runs during loading, so the
/// single-rank communicator stands in for the peers.
fn group(world_size: usize) -> TpGroup {
    TpGroup { rank: 0, world_size, comm: Arc::new(SingleRank) }
}

fn load_error(dir: &Path, world_size: usize) -> String {
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    match Model::load(dir, &group(world_size), &options, Arc::new(LoadProgress::default())) {
        Ok(_) => panic!("loading {} at TP {world_size} should fail", dir.display()),
        Err(err) => format!("{err:#}"),
    }
}

/// A copy of a fixture that a test may break.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(common::fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

#[test]
fn missing_directory_and_missing_weights() {
    let err = load_error(Path::new("/nonexistent/model"), 1);
    assert!(err.contains("config.json"), "{err}");
    let dir = copy_fixture("qwen3_a");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("no weights") && err.contains("model.safetensors"), "{err}");
}

#[test]
fn bad_config_json() {
    let dir = copy_fixture("qwen3_a");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("config.json") && err.contains("not valid JSON"), "{err}");
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("unsupported model_type \"gpt2\""), "{err}");
}

#[test]
fn heads_that_do_not_divide_name_the_field_and_tp_size() {
    // qwen3_a: 8 query heads, 4 KV heads, intermediate 128.
    let err = load_error(&common::fixture("qwen3_a"), 3);
    assert!(err.contains("num_attention_heads (8)") && err.contains("tensor-parallel size 3"), "{err}");
    // qwen3_b: 12 query heads do not split 8 ways.
    let err = load_error(&common::fixture("qwen3_b"), 8);
    assert!(err.contains("num_attention_heads (12)") && err.contains("tensor-parallel size 8"), "{err}");
    // qwen3_b at TP 3: the query heads divide (12 / 3) but 2 KV heads can neither be split
    // three ways nor replicated evenly.
    let err = load_error(&common::fixture("qwen3_b"), 3);
    assert!(err.contains("num_key_value_heads (2)") && err.contains("tensor-parallel size 3"), "{err}");
    // qwen3_a at TP 4 with an intermediate size that does not divide.
    let dir = copy_fixture("qwen3_a");
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("config.json"), config.replace("\"intermediate_size\": 128", "\"intermediate_size\": 126")).unwrap();
    let err = load_error(dir.path(), 4);
    assert!(err.contains("intermediate_size (126)") && err.contains("tensor-parallel size 4"), "{err}");
}

#[test]
fn missing_tensor_and_wrong_shape() {
    let dir = copy_fixture("qwen3_a");
    let path = dir.path().join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut without: std::collections::HashMap<String, candle_core::Tensor> = tensors.clone();
    without.remove("model.layers.2.mlp.up_proj.weight");
    candle_core::safetensors::save(&without, &path).unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("model.layers.2.mlp.up_proj.weight") && err.contains("missing"), "{err}");

    let mut reshaped = tensors;
    let bad = candle_core::Tensor::zeros((64, 64), DType::F32, &Device::Cpu).unwrap();
    reshaped.insert("model.layers.0.mlp.gate_proj.weight".into(), bad);
    candle_core::safetensors::save(&reshaped, &path).unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("[64, 64]"), "{err}");
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("qwen3_a");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_error(dir.path(), 1);
    assert!(err.contains("safetensors"), "{err}");
}
