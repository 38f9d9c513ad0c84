//! Exact parity of the Qwen3 model core with the Hugging Face reference (tests/fixtures).

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};
use tpserve::rank::offline;

const EOS: u32 = 2;

fn load_single(name: &str) -> Model {
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu };
    Model::load(&common::fixture(name), &TpGroup::single(), &options, Arc::new(LoadProgress::default()))
        .expect("model loads")
}

/// TP 1 in-process: the arithmetic alone, before any communication is involved.
#[test]
fn tp1_in_process_matches_reference() {
    for name in ["qwen3_a", "qwen3_b", "qwen3_c_bf16"] {
        let model = load_single(name);
        for (i, prompt) in common::expected(name).iter().enumerate() {
            let result = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
            let diff = common::max_abs_diff(&result.last_logits, &prompt.last_logits);
            println!("{name} prompt {i}: max |logit diff| = {diff:.3e}");
            assert_eq!(result.new_ids, prompt.greedy_new_ids, "{name} prompt {i} greedy ids");
            assert!(diff < 1e-4, "{name} prompt {i}: logits differ by {diff}");
        }
    }
}
