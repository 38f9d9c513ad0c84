//! Exact parity of the dense model core (Qwen3; Llama 3 with its RoPE scaling) with the
//! Hugging Face reference (tests/fixtures).

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};
use tpserve::rank::offline;

use common::{ShardRun, Transport};

const EOS: u32 = 2;

fn load_single(name: &str) -> Model {
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    Model::load(&common::fixture(name), &TpGroup::single(), &options, Arc::new(LoadProgress::default()))
        .expect("model loads")
}

/// TP 1 in-process: the arithmetic alone, before any communication is involved.
#[test]
fn tp1_in_process_matches_reference() {
    for name in ["qwen3_a", "qwen3_b", "qwen3_c_bf16", "llama3_a"] {
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

struct GroupRun {
    prompts: Vec<offline::PromptResult>,
}

/// Runs `tpserve eval-shard` as `tp` separate OS processes joined by the CPU socket backend
/// (EOS suppressed) and returns rank 0's report (see [`common::ShardRun`]).
fn run_group(name: &str, tp: usize, chunk: usize, transport: Transport) -> GroupRun {
    run_group_with(name, tp, chunk, transport, "f32", None)
}

/// [`run_group`] loading the weights in `dtype`, with the CPU kernels capped at `isa`
/// (TPSERVE_CPU_ISA) when given.
fn run_group_with(name: &str, tp: usize, chunk: usize, transport: Transport, dtype: &str, isa: Option<&str>) -> GroupRun {
    let model = common::fixture(name);
    let prompts: Vec<Vec<u32>> = common::expected(name).into_iter().map(|p| p.ids).collect();
    let env: Vec<(&str, &str)> = isa.map(|isa| ("TPSERVE_CPU_ISA", isa)).into_iter().collect();
    let flags = ["--dtype", dtype];
    let run = ShardRun { chunk, transport, env: &env, flags: &flags, ..ShardRun::new(&model, &prompts, tp) };
    GroupRun { prompts: run.run() }
}

fn check_parity(tp: usize, transport: Transport) {
    for name in ["qwen3_a", "qwen3_b", "qwen3_c_bf16", "llama3_a"] {
        let run = run_group(name, tp, 0, transport);
        common::assert_matches_oracle(&format!("{name} TP {tp}"), name, &run.prompts);
    }
}

#[test]
fn tp1_separate_process_matches_reference() {
    check_parity(1, Transport::Unix);
}

#[test]
fn tp2_over_tcp_matches_reference() {
    check_parity(2, Transport::Tcp);
}

/// qwen3_b has 2 KV heads: at TP 4 each is replicated on two ranks.
#[test]
fn tp4_over_unix_sockets_matches_reference() {
    check_parity(4, Transport::Unix);
}

/// Prompt 2 (165 tokens) prefilled in chunks of 64 gives the same tokens and logits as in one
/// step (and as the reference).
#[test]
fn chunked_prefill_matches_single_step() {
    for tp in [1, 2] {
        let whole = run_group("qwen3_a", tp, 0, Transport::Unix);
        let chunked = run_group("qwen3_a", tp, 64, Transport::Unix);
        let expected = common::expected("qwen3_a");
        assert!(expected[2].ids.len() > 128, "prompt 2 must span several chunks");
        let diff = common::max_abs_diff(&chunked.prompts[2].last_logits, &whole.prompts[2].last_logits);
        println!("TP {tp}: chunked vs whole prefill, max |logit diff| = {diff:.3e}");
        assert_eq!(chunked.prompts[2].new_ids, expected[2].greedy_new_ids);
        assert_eq!(chunked.prompts[2].new_ids, whole.prompts[2].new_ids);
        assert!(diff < 1e-4, "chunked prefill changes logits by {diff}");
    }
}

/// A checkpoint split over several files with model.safetensors.index.json loads the same.
#[test]
fn sharded_checkpoint_with_index_matches_reference() {
    let dir = tempfile::tempdir().unwrap();
    let source = common::fixture("qwen3_b");
    for file in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    let tensors = candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (part, chunk) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", part + 1);
        let shard: std::collections::HashMap<&String, candle_core::Tensor> =
            chunk.iter().map(|name| (*name, tensors[*name].clone())).collect();
        candle_core::safetensors::save(&shard, dir.path().join(&file)).unwrap();
        for name in chunk {
            weight_map.insert((*name).clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();

    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    let model = Model::load(dir.path(), &TpGroup::single(), &options, Arc::new(LoadProgress::default())).unwrap();
    let prompt = &common::expected("qwen3_b")[0];
    let result = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
    assert_eq!(result.new_ids, prompt.greedy_new_ids);
    assert!(common::max_abs_diff(&result.last_logits, &prompt.last_logits) < 1e-4);
}

/// bf16 weights kept bf16 in memory (CPU: multiplied in f32 by the bf16-weight kernel) meet the
/// f32 tolerance of the f32-compute reference, with half the weight bytes of an f32 load.
#[test]
fn bf16_resident_weights_meet_the_f32_tolerance() {
    let f32_bytes = load_single("qwen3_c_bf16").weight_bytes();
    let options = LoadOptions { dtype: Some(DType::BF16), device: Device::Cpu, products: tpserve::model::Products::Exact };
    let model = Model::load(&common::fixture("qwen3_c_bf16"), &TpGroup::single(), &options, Arc::new(LoadProgress::default()))
        .unwrap();
    assert_eq!(model.dtype(), DType::BF16);
    // Norm weights stay f32, so a little over half.
    assert!(model.weight_bytes() * 10 < f32_bytes * 6, "{} of {f32_bytes} bytes", model.weight_bytes());
    let mut worst = 0f32;
    for (i, prompt) in common::expected("qwen3_c_bf16").iter().enumerate() {
        let result = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
        let diff = common::max_abs_diff(&result.last_logits, &prompt.last_logits);
        worst = worst.max(diff);
        assert_eq!(result.new_ids, prompt.greedy_new_ids, "prompt {i} greedy ids");
        assert!(diff < 1e-4, "prompt {i}: logits differ by {diff}");
    }
    println!("bf16-resident weights ({:?} kernel): max |logit diff| = {worst:.3e}", tpserve::model::cpu_matmul::Isa::selected());
}

/// Rows that only want their largest logit (greedy serving: `SequenceInput::argmax_only`) get,
/// from bf16 weights held for exact products, the exact product's value wherever a value can be
/// the largest, bit for bit, so the same greedy ids; on a CPU with the bf16 pair body the other
/// values come back NEG_INFINITY, the suppressed token's among them. Every prompt in one step.
#[test]
fn argmax_only_rows_keep_the_exact_winner() {
    use tpserve::model::paged::{BlockPool, DEFAULT_BLOCK_SIZE, contiguous_table};
    use tpserve::model::{CacheStore, SequenceInput};
    let options = LoadOptions { dtype: Some(DType::BF16), device: Device::Cpu, products: tpserve::model::Products::Exact };
    let model = Model::load(&common::fixture("qwen3_c_bf16"), &TpGroup::single(), &options, Arc::new(LoadProgress::default())).unwrap();
    let prompts = common::expected("qwen3_c_bf16");
    let blocks_each = prompts.iter().map(|p| p.ids.len().div_ceil(DEFAULT_BLOCK_SIZE)).max().unwrap();
    let tables: Vec<Vec<u32>> = (0..prompts.len()).map(|i| contiguous_table((i * blocks_each) as u32, blocks_each * DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)).collect();
    let logits = |argmax_only: Option<&[u32]>| -> Vec<Vec<f32>> {
        let mut store = CacheStore::new(BlockPool::new(prompts.len() * blocks_each, DEFAULT_BLOCK_SIZE));
        let inputs: Vec<SequenceInput<'_>> = prompts
            .iter()
            .zip(&tables)
            .enumerate()
            .map(|(i, (prompt, table))| SequenceInput { argmax_only, ..SequenceInput::new(i as u64, &prompt.ids, 0, true, table) })
            .collect();
        model.step(&inputs, &mut store).unwrap().unwrap().to_vec2::<f32>().unwrap()
    };
    let first_of_largest = |row: &[f32]| (0..row.len()).fold(0, |best, j| if row[j] > row[best] { j } else { best });
    let exact = logits(None);
    // EOS suppressed, as the reference's greedy ids were made (and `--ignore-eos` asks).
    let suppressed = [EOS];
    let fast = logits(Some(&suppressed));
    let mut dropped = 0;
    for (i, (fast, exact)) in fast.iter().zip(&exact).enumerate() {
        let mut open = exact.clone();
        open[EOS as usize] = f32::NEG_INFINITY;
        assert_eq!(first_of_largest(fast), first_of_largest(&open), "prompt {i}");
        assert_eq!(first_of_largest(&open), prompts[i].greedy_new_ids[0] as usize, "prompt {i}: the reference's first id");
        for (j, (&f, &e)) in fast.iter().zip(exact).enumerate() {
            if f == f32::NEG_INFINITY {
                dropped += 1;
            } else {
                assert_eq!(f.to_bits(), e.to_bits(), "prompt {i} token {j}: {f} against {e}");
            }
        }
        assert_eq!(fast[EOS as usize], f32::NEG_INFINITY, "prompt {i}: the suppressed token");
    }
    let pairs = tpserve_kernels::panels::bf16_dot_available();
    println!("argmax-only rows (bf16 pair body: {pairs}): {dropped} of {} values left out", fast.len() * fast[0].len());
    if pairs {
        assert!(dropped > fast.len() * fast[0].len() / 2, "only {dropped} values were left out");
    }
}

/// `--matmul-precision bf16`: bf16 weights whose products round the activations to bf16
/// (`vdpbf16ps` where the CPU has avx512_bf16). Lossy, so it meets a half-precision tolerance of
/// the f32-compute reference, not the f32 one; prints the logit difference and how many greedy
/// ids agree with the reference.
#[test]
fn bf16_products_stay_close_to_the_f32_compute_reference() {
    let options = LoadOptions { dtype: Some(DType::BF16), device: Device::Cpu, products: tpserve::model::Products::Bf16 };
    let progress = Arc::new(LoadProgress::default());
    let model = Model::load(&common::fixture("qwen3_c_bf16"), &TpGroup::single(), &options, progress.clone()).unwrap();
    let fast = tpserve_kernels::panels::bf16_dot_available();
    // The load says which products it holds: bf16 ones only where the CPU sums bf16 pairs.
    assert_eq!(progress.format_summary().contains("bf16 products"), fast, "{}", progress.format_summary());
    for (i, prompt) in common::expected("qwen3_c_bf16").iter().enumerate() {
        let result = offline::greedy(&model, 1, &prompt.ids, 16, 0, &[EOS]).unwrap().unwrap();
        let diff = common::max_abs_diff(&result.last_logits, &prompt.last_logits);
        let agree = result.new_ids.iter().zip(&prompt.greedy_new_ids).take_while(|(a, b)| a == b).count();
        println!("bf16 products (instruction: {fast}), prompt {i}: max |logit diff| vs f32 compute = {diff:.3e}; greedy ids agree for {agree} of {}", prompt.greedy_new_ids.len());
        if !fast {
            assert!(diff < 1e-4, "exact products where the CPU has no avx512_bf16: prompt {i}: {diff}");
            continue;
        }
        assert!(diff < 0.05, "prompt {i}: {diff}");
    }
}

/// The same at TP 2 in separate processes, on the selected kernel path and the portable one.
#[test]
fn bf16_resident_weights_tp2_match_reference_on_every_kernel_path() {
    for isa in [None, Some("portable")] {
        let got = run_group_with("qwen3_c_bf16", 2, 0, Transport::Unix, "bf16", isa);
        for (i, (got, want)) in got.prompts.iter().zip(common::expected("qwen3_c_bf16")).enumerate() {
            let diff = common::max_abs_diff(&got.last_logits, &want.last_logits);
            println!("bf16 TP 2 kernel {isa:?} prompt {i}: max |logit diff| = {diff:.3e}");
            assert_eq!(got.new_ids, want.greedy_new_ids, "kernel {isa:?} prompt {i}");
            assert!(diff < 1e-4, "kernel {isa:?} prompt {i}: {diff}");
        }
    }
}

/// Weights kept in their stored bf16 (no cast; on CPU computed in f32 as above), or cast to
/// f16 (held f16, computed in f32 on the CPU as bf16 is). The f16 cast rounds the weights, so it
/// cannot meet the f32 tolerance; this checks both 16-bit paths work and stay close: logits
/// within 0.05 of the f32-compute reference.
#[test]
fn half_precision_weights_stay_close_to_reference() {
    for dtype in [None, Some(DType::F16)] {
        let options = LoadOptions { dtype, device: Device::Cpu, products: tpserve::model::Products::Exact };
        let model = Model::load(&common::fixture("qwen3_c_bf16"), &TpGroup::single(), &options, Arc::new(LoadProgress::default()))
            .unwrap();
        let expected_dtype = dtype.unwrap_or(DType::BF16);
        assert_eq!(model.dtype(), expected_dtype);
        for (i, prompt) in common::expected("qwen3_c_bf16").iter().enumerate() {
            let result = offline::greedy(&model, 1, &prompt.ids, 4, 0, &[EOS]).unwrap().unwrap();
            let diff = common::max_abs_diff(&result.last_logits, &prompt.last_logits);
            println!("{expected_dtype:?} weights, prompt {i}: max |logit diff| vs f32 compute = {diff:.3e}");
            assert!(diff < 0.05, "{expected_dtype:?} prompt {i}: {diff}");
            assert_eq!(result.new_ids.len(), 4);
        }
    }
}
