//! Qwen3.5 (Gated DeltaNet + gated attention, dense and MoE) and Qwen3 MoE against the Hugging
//! Face reference (tests/fixtures, transformers 5.24.0): greedy ids exactly, last-position logits
//! within 1e-4, at TP 1, 2 and 4, through separate rank processes and through the served system;
//! the hub's checkpoint layout; chunked prefill; rewinds; and deliberately broken variants that
//! must fail the same checks.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use common::{ExpectedPrompt, ShardRun, Transport, parse_json_stream};
use serde_json::{Value, json};
use tpserve::comm::{Collective, CommResult};
use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::paged::{BlockPool, contiguous_table};
use tpserve::model::{CacheStore, LoadOptions, Model, SequenceInput};
use tpserve::rank::offline::PromptResult;

const EOS: u32 = 2;
const NEW_TOKENS: usize = 16;
const FIXTURES: [&str; 4] = ["qwen3_5_dense", "qwen3_5_moe", "qwen3_moe", "qwen3_moe_b"];
/// The Qwen3.5 fixtures, which also have a hub layout.
const HYBRID: [&str; 2] = ["qwen3_5_dense", "qwen3_5_moe"];

fn load_in_process(dir: &Path) -> (Model, u64) {
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    let progress = Arc::new(LoadProgress::default());
    let model = Model::load(dir, &TpGroup::single(), &options, progress.clone()).expect("model loads");
    (model, progress.bytes.load(Ordering::Relaxed))
}

fn prompts_of(expected: &[ExpectedPrompt]) -> Vec<Vec<u32>> {
    expected.iter().map(|p| p.ids.clone()).collect()
}

/// Whether `got` passes the parity checks against `want`, and its max logit difference.
fn parity(got: &PromptResult, want: &ExpectedPrompt) -> (bool, f32) {
    let diff = common::max_abs_diff(&got.last_logits, &want.last_logits);
    (got.new_ids == want.greedy_new_ids && diff < 1e-4, diff)
}

fn assert_parity(label: &str, got: &[PromptResult], expected: &[ExpectedPrompt]) {
    assert_eq!(got.len(), expected.len(), "{label}: one result per prompt");
    for (i, (got, want)) in got.iter().zip(expected).enumerate() {
        let diff = common::max_abs_diff(&got.last_logits, &want.last_logits);
        println!("{label} prompt {i}: max |logit diff| = {diff:.3e}");
        assert_eq!(got.new_ids, want.greedy_new_ids, "{label} prompt {i}: greedy ids");
        assert!(diff < 1e-4, "{label} prompt {i}: logits differ by {diff}");
    }
}

/// Every fixture as `tp` separate rank processes, each prompt prefilled in one step.
fn check_separate_processes(tp: usize, transport: Transport) {
    for name in FIXTURES {
        let expected = common::expected(name);
        let prompts = prompts_of(&expected);
        let dir = common::fixture(name);
        let got = ShardRun { transport, ..ShardRun::new(&dir, &prompts, tp) }.run();
        assert_parity(&format!("{name} TP {tp}"), &got, &expected);
    }
}

#[test]
fn tp1_separate_process_matches_reference() {
    check_separate_processes(1, Transport::Unix);
}

#[test]
fn tp2_over_tcp_matches_reference() {
    check_separate_processes(2, Transport::Tcp);
}

/// At TP 4 each rank holds 2 of the 8 value heads and the 1 key head they read, 2 of the 8
/// query heads and 1 of the 4 KV heads, and a quarter of every expert.
#[test]
fn tp4_over_unix_sockets_matches_reference() {
    check_separate_processes(4, Transport::Unix);
}

/// Prompts prefilled in steps of 64 tokens (prompt 2, 165 tokens, carries its conv and
/// recurrent state across three steps) and token by token (the recurrent form at every
/// position) give the reference's tokens and logits, as the whole-prompt prefill (the chunked
/// delta rule over three blocks in one step) does.
#[test]
fn chunked_and_token_by_token_prefill_match_reference() {
    for name in HYBRID {
        let expected = common::expected(name);
        assert!(expected[2].ids.len() > 2 * 64, "prompt 2 must span several chunks");
        let prompts = prompts_of(&expected);
        let dir = common::fixture(name);
        for (tp, chunk) in [(2, 64), (1, 1)] {
            let got = ShardRun { chunk, ..ShardRun::new(&dir, &prompts, tp) }.run();
            assert_parity(&format!("{name} TP {tp} prefill chunk {chunk}"), &got, &expected);
        }
    }
}

/// With TPSERVE_TENSOR_OPS_ON_CPU=1 the CPU ranks take the forms a GPU takes (the chunk decay
/// matrices and their triangular solve, the gates, the MoE routing, the attention mask, all as
/// tensor ops), so the GPU's forward pass meets the reference on every CPU run: every fixture
/// at TP 1 with whole prompts and at TP 2 with 64-token prefill steps.
#[test]
fn tensor_op_forms_match_reference() {
    for name in FIXTURES {
        let expected = common::expected(name);
        let prompts = prompts_of(&expected);
        let dir = common::fixture(name);
        for (tp, chunk) in [(1, 0), (2, 64)] {
            let env = [("TPSERVE_TENSOR_OPS_ON_CPU", "1")];
            let got = ShardRun { chunk, env: &env, ..ShardRun::new(&dir, &prompts, tp) }.run();
            assert_parity(&format!("{name} TP {tp} prefill chunk {chunk}, tensor-op forms"), &got, &expected);
        }
    }
}

/// Rank 0 of a pretend 2-rank group whose collectives only count: enough to load a TP 2 shard
/// and count the all-reduces a step makes.
struct CountingRank0(AtomicUsize);

impl Collective for CountingRank0 {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(tensor.clone())
    }
    fn all_gather(&self, tensor: &Tensor, _dim: usize) -> CommResult<Tensor> {
        Ok(tensor.clone())
    }
    fn gather(&self, tensor: &Tensor, _dim: usize, _root: usize) -> CommResult<Option<Tensor>> {
        Ok(Some(tensor.clone()))
    }
    fn broadcast(&self, tensor: &Tensor, _root: usize) -> CommResult<Tensor> {
        Ok(tensor.clone())
    }
    fn barrier(&self) -> CommResult<()> {
        Ok(())
    }
    fn abort(&self) {}
}

/// One all-reduce for the embedding and two per layer (token mixer, then MLP or MoE block:
/// routed experts and the shared expert share one), whatever the batch.
#[test]
fn a_step_makes_two_all_reduces_per_layer() {
    for name in FIXTURES {
        let counter = Arc::new(CountingRank0(AtomicUsize::new(0)));
        let group = TpGroup::new(counter.clone());
        let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
        let model = Model::load(&common::fixture(name), &group, &options, Arc::new(LoadProgress::default())).unwrap();
        let layers = model.config().num_hidden_layers;
        let ids = &common::expected(name)[2].ids;
        let mut store = CacheStore::new(BlockPool::new(32, 16));
        let (first, second) = (contiguous_table(0, 112, 16), contiguous_table(16, 32, 16));
        for batch in [
            vec![SequenceInput::new(1, &ids[..100], 0, true, &first)],
            vec![SequenceInput::new(1, &ids[100..101], 100, true, &first), SequenceInput::new(2, &ids[..30], 0, false, &second)],
        ] {
            counter.0.store(0, Ordering::SeqCst);
            model.step(&batch, &mut store).unwrap();
            assert_eq!(counter.0.load(Ordering::SeqCst), 1 + 2 * layers, "{name}: all-reduces in one step");
        }
    }
}

/// The checks above can fail: a model scaling its norms by w instead of 1 + w, or forgetting the
/// convolution history between prefill chunks, is caught.
#[test]
fn deliberately_broken_models_fail_the_parity_checks() {
    let name = "qwen3_5_dense";
    let expected = common::expected(name);
    let prompts = prompts_of(&expected);
    let dir = common::fixture(name);

    let env = [("TPSERVE_TEST_BREAK", "plain_rms_weight")];
    let got = ShardRun { env: &env, ..ShardRun::new(&dir, &prompts, 2) }.run();
    for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
        let (passes, diff) = parity(got, want);
        println!("plain_rms_weight prompt {i}: max |logit diff| = {diff:.3e}");
        assert!(!passes, "plain_rms_weight: prompt {i} still matches the reference");
    }

    // Prompts 0 and 1 fit in one chunk; prompt 2 spans three.
    let env = [("TPSERVE_TEST_BREAK", "drop_conv_state")];
    let got = ShardRun { chunk: 64, env: &env, ..ShardRun::new(&dir, &prompts, 2) }.run();
    let (passes, diff) = parity(&got[2], &expected[2]);
    println!("drop_conv_state prompt 2: max |logit diff| = {diff:.3e}");
    assert!(!passes, "drop_conv_state: prompt 2 still matches the reference");
    let (passes, _) = parity(&got[0], &expected[0]);
    assert!(passes, "a single-chunk prompt has no conv state to drop");
}

/// Several sequences in one step, prefills and decodes mixed: prompt 2 is prefilled in chunks
/// of 64 (not sampling until its last chunk) while prompts 0 and 1 prefill whole and then
/// decode in the same steps.
#[test]
fn batched_steps_match_reference() {
    for name in FIXTURES {
        let (model, _) = load_in_process(&common::fixture(name));
        let expected = common::expected(name);
        let chunks = [usize::MAX, usize::MAX, 64];
        let mut fed = vec![0usize; expected.len()];
        let mut generated: Vec<Vec<u32>> = vec![Vec::new(); expected.len()];
        let mut last_logits: Vec<Option<Vec<f32>>> = vec![None; expected.len()];
        // Each sequence its own 64 blocks.
        let tables: Vec<Vec<u32>> = (0..expected.len()).map(|i| contiguous_table(i as u32 * 64, 1024, 16)).collect();
        let mut store = CacheStore::new(BlockPool::new(64 * expected.len(), 16));
        while generated.iter().any(|g| g.len() < NEW_TOKENS) {
            let mut batch = Vec::new();
            let mut owners = Vec::new();
            for (i, prompt) in expected.iter().enumerate() {
                let tokens: &[u32] = if fed[i] < prompt.ids.len() {
                    let end = prompt.ids.len().min(fed[i].saturating_add(chunks[i]));
                    &prompt.ids[fed[i]..end]
                } else if generated[i].len() < NEW_TOKENS {
                    std::slice::from_ref(generated[i].last().expect("a token was sampled"))
                } else {
                    continue;
                };
                let start_pos = fed[i];
                let sample = start_pos + tokens.len() >= prompt.ids.len();
                batch.push(SequenceInput::new(i as u64 + 1, tokens, start_pos, sample, &tables[i]));
                if sample {
                    owners.push(i);
                }
            }
            let logits = model.step(&batch, &mut store).unwrap();
            for seq in &batch {
                fed[seq.seq_id as usize - 1] += seq.tokens.len();
            }
            let Some(logits) = logits else { continue };
            for (row, &i) in owners.iter().enumerate() {
                let row = logits.get(row).unwrap().to_vec1::<f32>().unwrap();
                if last_logits[i].is_none() {
                    last_logits[i] = Some(row.clone());
                }
                generated[i].push(argmax_except(&row, EOS));
            }
        }
        let got: Vec<PromptResult> = generated
            .into_iter()
            .zip(last_logits)
            .map(|(new_ids, last)| PromptResult { new_ids, last_logits: last.unwrap() })
            .collect();
        assert_parity(&format!("{name} batched"), &got, &expected);
    }
}

fn argmax_except(logits: &[f32], banned: u32) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if i as u32 != banned && v > best.1 {
            best = (i as u32, v);
        }
    }
    best.0
}

/// Recurrent state cannot be rewound: a step starting inside the cached positions is refused
/// (and leaves the cache as it was); starting again at 0 resets it.
#[test]
fn recurrent_state_rewinds_only_to_the_start() {
    let (model, _) = load_in_process(&common::fixture("qwen3_5_dense"));
    let ids = &common::expected("qwen3_5_dense")[0].ids;
    let table = contiguous_table(0, ids.len(), 16);
    let mut store = CacheStore::new(BlockPool::new(table.len(), 16));
    let step = |store: &mut CacheStore, start: usize| model.step(&[SequenceInput::new(7, &ids[start..], start, true, &table)], store);
    let first = step(&mut store, 0).unwrap().unwrap().to_vec2::<f32>().unwrap();
    let err = format!("{:#}", step(&mut store, 5).unwrap_err());
    assert!(err.contains("cannot be rewound") && err.contains("sequence 7"), "{err}");
    assert_eq!(store.get_mut(7).map(|c| c.len), Some(ids.len()), "the refused step kept the cache");
    let again = step(&mut store, 0).unwrap().unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(first, again, "a restart from 0 starts from fresh state");
    assert!(store.remove(7));
}

/// Rewrites a text-only Qwen3.5 fixture in the layout of the hub's checkpoints: config under
/// "text_config" of a qwen3_5 / qwen3_5_moe wrapper with no layer_types (full attention every
/// full_attention_interval-th layer), tensors under model.language_model.*, routed experts
/// packed into experts.gate_up_proj / experts.down_proj, and vision-tower and MTP tensors that
/// must not be read (their dtypes and shapes fit nothing in the language model).
fn convert_to_hub_layout(name: &str, out: &Path) {
    let source = common::fixture(name);
    for file in ["generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(source.join(file), out.join(file)).unwrap();
    }
    let mut text: Value = serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    let moe = text["model_type"] == "qwen3_5_moe_text";
    let fields = text.as_object_mut().unwrap();
    let layer_types: Vec<String> = serde_json::from_value(fields.remove("layer_types").unwrap()).unwrap();
    let interval = layer_types.iter().position(|t| t == "full_attention").unwrap() + 1;
    for (i, kind) in layer_types.iter().enumerate() {
        let full = (i + 1) % interval == 0;
        assert_eq!(kind == "full_attention", full, "{name}: layer types are not periodic");
    }
    if interval != 4 {
        fields.insert("full_attention_interval".into(), json!(interval));
    }
    let tie = fields.remove("tie_word_embeddings").unwrap();
    fields.remove("architectures");
    let (model_type, architecture) =
        if moe { ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration") } else { ("qwen3_5", "Qwen3_5ForConditionalGeneration") };
    let config = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                          "out_hidden_size": 64, "patch_size": 16},
        "image_token_id": 440, "video_token_id": 441, "vision_start_token_id": 442, "vision_end_token_id": 443,
        "tie_word_embeddings": tie,
    });
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();

    let tensors = candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut hub: HashMap<String, Tensor> = HashMap::new();
    let mut experts: HashMap<String, Vec<(usize, String, Tensor)>> = HashMap::new();
    for (name, tensor) in tensors {
        let renamed = match name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => name,
        };
        match renamed.split_once(".mlp.experts.") {
            Some((layer, rest)) => {
                let (index, projection) = rest.split_once('.').unwrap();
                experts.entry(layer.to_owned()).or_default().push((index.parse().unwrap(), projection.to_owned(), tensor));
            }
            None => {
                hub.insert(renamed, tensor);
            }
        }
    }
    for (layer, mut parts) in experts {
        parts.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let count = parts.len() / 3;
        let find = |e: usize, projection: &str| {
            parts.iter().find(|p| p.0 == e && p.1 == format!("{projection}.weight")).unwrap().2.clone()
        };
        let gate_up: Vec<Tensor> =
            (0..count).map(|e| Tensor::cat(&[find(e, "gate_proj"), find(e, "up_proj")], 0).unwrap()).collect();
        let down: Vec<Tensor> = (0..count).map(|e| find(e, "down_proj")).collect();
        hub.insert(format!("{layer}.mlp.experts.gate_up_proj"), Tensor::stack(&gate_up, 0).unwrap());
        hub.insert(format!("{layer}.mlp.experts.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    let filler = |shape: &[usize], dtype: DType| Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    hub.insert("model.visual.patch_embed.proj.weight".into(), filler(&[32, 3, 2, 16, 16], DType::F16));
    hub.insert("model.visual.blocks.0.attn.qkv.weight".into(), filler(&[96, 32], DType::F16));
    hub.insert("model.visual.merger.linear_fc2.weight".into(), filler(&[64, 128], DType::BF16));
    hub.insert("mtp.fc.weight".into(), filler(&[64, 128], DType::BF16));
    hub.insert("mtp.layers.0.input_layernorm.weight".into(), filler(&[7], DType::F32));
    hub.insert("mtp.norm.weight".into(), filler(&[64], DType::BF16));
    candle_core::safetensors::save(&hub, out.join("model.safetensors")).unwrap();
}

/// The hub layout loads, reads exactly the bytes the text-only layout does (the vision tower and
/// MTP head are never touched), and matches the reference in process and at TP 2 and 4.
#[test]
fn hub_layout_matches_reference() {
    let root = tempfile::tempdir().unwrap();
    for name in HYBRID {
        let hub = root.path().join(format!("{name}_hub"));
        std::fs::create_dir(&hub).unwrap();
        convert_to_hub_layout(name, &hub);
        let expected = common::expected(name);

        let (flat_model, flat_bytes) = load_in_process(&common::fixture(name));
        let (hub_model, hub_bytes) = load_in_process(&hub);
        assert_eq!(hub_bytes, flat_bytes, "{name}: the hub layout read other bytes than the language model's");
        assert_eq!(hub_model.weight_bytes(), flat_model.weight_bytes());
        drop(flat_model);
        let got: Vec<PromptResult> = expected
            .iter()
            .map(|p| tpserve::rank::offline::greedy(&hub_model, 1, &p.ids, NEW_TOKENS, 0, &[EOS]).unwrap().unwrap())
            .collect();
        assert_parity(&format!("{name} hub layout TP 1"), &got, &expected);

        let prompts = prompts_of(&expected);
        for tp in [2, 4] {
            let got = ShardRun::new(&hub, &prompts, tp).run();
            assert_parity(&format!("{name} hub layout TP {tp}"), &got, &expected);
        }
    }
}

const ADMIN_TOKEN: &str = "qwen3_5-admin";

/// Loads `path` as `model_id` into a running server through the Admin API.
fn admin_load(address: &str, model_id: &str, path: &Path) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let address: tpserve::net::Address = address.parse().unwrap();
        let channel = tpserve::net::connect(&address, Duration::from_secs(10)).await.unwrap();
        let mut admin = tpserve::proto::v1::admin_client::AdminClient::new(channel);
        let mut request = tonic::Request::new(tpserve::proto::v1::LoadModelRequest {
            model_id: model_id.to_owned(),
            path: path.display().to_string(),
            dtype: String::new(),
            quantize: String::new(),
            matmul_precision: String::new(),
            kv_cache_dtype: String::new(),
        });
        let bearer = format!("Bearer {ADMIN_TOKEN}").parse().unwrap();
        request.metadata_mut().insert("authorization", bearer);
        admin.load_model(request).await.unwrap_or_else(|status| panic!("loading {model_id}: {status}"));
    });
}

/// For every fixture (and the hub layouts) at TP 1, 2 and 4, the greedy ids streamed through
/// `tpserve serve` + `tpserve generate --json --ignore-eos --temperature 0` equal the reference.
/// One server per TP size serves all five models (the first from --model, the others loaded
/// through the Admin API), prefilling in chunks of 64 tokens.
#[test]
fn greedy_ids_through_serve_and_generate_equal_reference() {
    let hubs = tempfile::tempdir().unwrap();
    let mut models: Vec<(String, String)> =
        FIXTURES.iter().map(|name| (name.to_string(), common::fixture(name).display().to_string())).collect();
    for name in HYBRID {
        let dir = hubs.path().join(format!("{name}_hub"));
        std::fs::create_dir(&dir).unwrap();
        convert_to_hub_layout(name, &dir);
        models.push((format!("{name}_hub"), dir.display().to_string()));
    }
    for tp in [1, 2, 4] {
        let server = common::Served::start_with_env(
            FIXTURES[0],
            tp,
            &["--prefill-chunk", "64"],
            &[("TPSERVE_ADMIN_TOKEN", ADMIN_TOKEN)],
        );
        for (id, path) in &models[1..] {
            admin_load(&server.address, id, Path::new(path));
        }
        for (id, _) in &models {
            let fixture = id.trim_end_matches("_hub");
            for (i, prompt) in common::expected(fixture).iter().enumerate() {
                let ids = common::ids_arg(&prompt.ids);
                let (stdout, ok) = server.generate(&[
                    "--model", id, "--prompt-ids", &ids, "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16",
                ]);
                assert!(ok, "{id} TP {tp} prompt {i}: generate failed: {stdout}");
                let (got, last) = parse_json_stream(&stdout);
                assert_eq!(got, prompt.greedy_new_ids, "{id} TP {tp} prompt {i}");
                assert_eq!(last["finish_reason"], "length", "{last}");
            }
            println!("{id} TP {tp}: greedy ids equal the reference on all prompts");
        }
    }
}

/// Load-time errors name the field that does not divide and the TP size, before any weight is
/// read (the config is edited field by field to reach each check).
#[test]
fn indivisible_sizes_are_refused_at_load_naming_the_field() {
    let group = TpGroup { rank: 0, world_size: 3, comm: Arc::new(tpserve::comm::SingleRank) };
    let options = LoadOptions { dtype: Some(DType::F32), device: Device::Cpu, products: tpserve::model::Products::Exact };
    for (name, edits, field) in [
        ("qwen3_5_dense", vec![], "num_attention_heads (8)"),
        ("qwen3_5_dense", vec![("num_attention_heads", 6), ("num_key_value_heads", 3)], "linear_num_value_heads (8)"),
        (
            "qwen3_5_dense",
            vec![("num_attention_heads", 6), ("num_key_value_heads", 3), ("linear_num_value_heads", 12)],
            "intermediate_size (128)",
        ),
        (
            "qwen3_5_moe",
            vec![("num_attention_heads", 6), ("num_key_value_heads", 3), ("linear_num_value_heads", 12)],
            "moe_intermediate_size (32)",
        ),
        ("qwen3_moe", vec![("num_attention_heads", 6), ("num_key_value_heads", 3)], "moe_intermediate_size (32)"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let source = common::fixture(name);
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
        for (key, value) in &edits {
            config[*key] = json!(value);
        }
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        std::fs::copy(source.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
        let progress = Arc::new(LoadProgress::default());
        let err = match Model::load(dir.path(), &group, &options, progress.clone()) {
            Ok(_) => panic!("{name} {edits:?} loaded at TP 3"),
            Err(err) => format!("{err:#}"),
        };
        assert!(err.contains(field) && err.contains("tensor-parallel size 3"), "{name} {edits:?}: {err}");
        assert_eq!(progress.bytes.load(Ordering::Relaxed), 0, "{name}: weights were read before the check");
    }
}
