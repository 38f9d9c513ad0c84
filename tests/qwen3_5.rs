//! Qwen3.5 (Gated DeltaNet hybrid, dense and MoE) and Qwen3 MoE against the Hugging Face reference.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};
use tpserve::rank::offline;

const EOS: u32 = 2;
const FIXTURES: [&str; 3] = ["qwen3_5_dense", "qwen3_5_moe", "qwen3_moe"];

#[test]
fn tp1_in_process_matches_reference() {
    for name in FIXTURES {
        let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu };
        let model = Model::load(&common::fixture(name), &TpGroup::single(), &options, Arc::new(LoadProgress::default())).unwrap();
        for (i, prompt) in common::expected(name).iter().enumerate() {
            let result = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
            let diff = common::max_abs_diff(&result.last_logits, &prompt.last_logits);
            println!("{name} prompt {i}: max |logit diff| = {diff:.3e} ids {:?} want {:?}", result.new_ids, prompt.greedy_new_ids);
        }
    }
}
