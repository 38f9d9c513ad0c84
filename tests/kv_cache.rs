//! The KV cache in f16 (`--kv-cache-dtype f16`, CPU) against the f32 cache on the public
//! fixtures: the largest logit difference and top-1 agreement at every step of a
//! teacher-forced run over the f32 path's greedy tokens, and the f16 cache served through
//! `tpserve serve` at TP 2 (real rank processes and gRPC), whose tokens equal the in-process
//! f16 run's and whose block pool holds twice the positions.

mod common;

use candle_core::{DType, Device};
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};
use tpserve::proto::v1 as pb;
use tpserve::rank::offline;

const EOS: u32 = 2;

fn load(name: &str) -> Model {
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    let progress = std::sync::Arc::new(tpserve::model::loader::LoadProgress::default());
    Model::load_quantized(&common::fixture(name), &TpGroup::single(), &options, tpserve::model::QuantMode::Off, progress).expect("model loads")
}

#[test]
fn f16_cache_stays_close_to_the_f32_cache() {
    for name in ["qwen3_a", "qwen3_b", "qwen3_c_bf16", "qwen3_5_dense", "qwen3_moe"] {
        let model = load(name);
        let (mut worst, mut agree, mut steps) = (0f32, 0, 0);
        for prompt in common::expected(name) {
            let greedy = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
            let want = offline::teacher_forced(&model, 1, &prompt.ids, &greedy.new_ids).unwrap().unwrap();
            let got = offline::teacher_forced_with(&model, 1, &prompt.ids, &greedy.new_ids, Some(DType::F16)).unwrap().unwrap();
            let (diff, same) = offline::compare_rows(&got, &want);
            worst = worst.max(diff);
            agree += same;
            steps += want.len();
        }
        println!("{name} f16 KV cache: max |logit - f32 cache| = {worst:.3e}, top-1 agreement {agree}/{steps}");
        // Keys and values rounded to f16 (11 significant bits) move the logits by a few 1e-3 on
        // these fixtures; a wrong conversion or layout gives errors of the logits' own size.
        // Random tiny models have top-1 margins as small as 0.005, so a step may flip.
        assert!(worst < 0.05, "{name}: {worst}");
        assert!(agree * 10 >= steps * 9, "{name}: top-1 agreement {agree}/{steps}");
    }
}

#[test]
fn serve_holds_an_f16_cache() {
    let name = "qwen3_a";
    let server = common::Served::start_with(name, 2, &["--kv-cache-dtype", "f16", "--kv-cache-gib", "0.01"]);
    let reference = common::Served::start_with(name, 2, &["--kv-cache-gib", "0.01"]);
    let info = |served: &common::Served| {
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            let channel = tpserve::net::connect(&served.address.parse().unwrap(), std::time::Duration::from_secs(10)).await.unwrap();
            let mut client = pb::generator_client::GeneratorClient::new(channel);
            client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner()
        })
    };
    let (half, full) = (info(&server), info(&reference));
    println!("KV blocks in the same budget: f16 {}, f32 {}", half.kv_blocks_total, full.kv_blocks_total);
    assert!(half.kv_blocks_total >= 2 * full.kv_blocks_total - 1 && full.kv_blocks_total > 0, "{half:?} {full:?}");
    assert!(half.shards.iter().all(|s| s.kv_cache_dtype == "f16") && half.shards.len() == 2, "{half:?}");
    assert!(full.shards.iter().all(|s| s.kv_cache_dtype == "f32"), "{full:?}");

    let model = load(name);
    for (i, prompt) in common::expected(name).iter().enumerate() {
        let timed = offline::greedy_timed(&model, 1, &prompt.ids, 16, 0, &[EOS], Some(DType::F16)).unwrap();
        assert_eq!(server.greedy(&prompt.ids, 16), timed.result.unwrap().new_ids, "prompt {i}");
    }

    let stderr = common::serve_refusal(name, &["--kv-cache-dtype", "fp8"]);
    assert!(stderr.contains("unknown KV cache dtype \"fp8\"") && stderr.contains("f16"), "{stderr}");
}
