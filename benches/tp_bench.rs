//! tpserve's core benchmark: prints figures, asserts nothing.
//!
//!     cargo bench --bench tp_bench
//!
//! 1. all-reduce latency between 2 rank processes (4 KiB, 64 KiB, 1 MiB) over Unix sockets
//!    and TCP loopback;
//! 2. greedy decode tokens/s at TP 1 and TP 2 of a ~100M-parameter Qwen3-shaped model with
//!    random weights that this benchmark writes itself, each rank a separate process;
//! 3. the same with every rank limited to one thread, so TP 2 against TP 1 shows the parallel
//!    speed-up rather than two ranks fighting over two cores;
//! 4. 2 and 3 for a Qwen3.5-shaped model of the same size (Gated DeltaNet on 3 of every 4
//!    layers, gated attention on the others).
//!
//! Name sections to run only those: `cargo bench --bench tp_bench -- qwen3_5` (sections:
//! collectives, qwen3, qwen3_5).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use candle_core::{DType, Device, Tensor};
use serde_json::{Value, json};

const EXE: &str = env!("CARGO_BIN_EXE_tpserve");

/// Qwen3-shaped, about 100M parameters (tied embeddings).
const HIDDEN: usize = 768;
const LAYERS: usize = 12;
const HEADS: usize = 12;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const INTERMEDIATE: usize = 2048;
const VOCAB: usize = 32000;

/// The Qwen3.5-shaped model keeps the shape above and replaces 3 of every 4 attention layers
/// with Gated DeltaNet layers of 6 key heads and 12 value heads of 64 (about 109M parameters).
const LINEAR_KEY_HEADS: usize = 6;
const LINEAR_VALUE_HEADS: usize = 12;
const LINEAR_HEAD_DIM: usize = 64;
const FULL_ATTENTION_INTERVAL: usize = 4;

fn main() {
    // `cargo test --benches` lists benches with --list; there is nothing to list.
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // cargo passes --bench; any other argument names a section to run.
    let sections: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |section: &str| sections.is_empty() || sections.iter().any(|s| s == section);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("tpserve benchmark ({cores} cores)\n");
    let dir = tempfile::tempdir().unwrap();
    // TPSERVE_BENCH_MODEL_DIR keeps the generated models for profiling runs.
    let models = match std::env::var_os("TPSERVE_BENCH_MODEL_DIR") {
        Some(path) => Path::new(&path).to_owned(),
        None => dir.path().to_owned(),
    };
    if wanted("collectives") {
        collectives(dir.path());
    }
    if wanted("qwen3") {
        let model = models.join("qwen3-100m");
        let params = write_random_model(&model);
        decode_table("Qwen3-shaped", &model, params, cores, dir.path());
    }
    if wanted("qwen3_5") {
        let model = models.join("qwen3_5-100m");
        let params = write_random_qwen3_5(&model);
        decode_table("Qwen3.5-shaped", &model, params, cores, dir.path());
    }
}

fn collectives(dir: &Path) {
    println!("## all-reduce latency, 2 rank processes, f32 sum (200 iterations after warm-up)\n");
    println!("| transport | size | median µs | p99 µs |");
    println!("|---|---|---|---|");
    for (transport, rendezvous) in [
        ("unix", format!("unix://{}", dir.join("bench.sock").display())),
        ("tcp", "127.0.0.1:0".to_owned()),
    ] {
        let results = run_group(2, &rendezvous, |rank| {
            let mut c = Command::new(EXE);
            c.args(["bench-collective", "--rank", &rank.to_string(), "--world-size", "2"]);
            c
        });
        for r in results.as_array().unwrap() {
            println!(
                "| {transport} | {} KiB | {:.1} | {:.1} |",
                r["bytes"].as_u64().unwrap() / 1024,
                r["median_us"].as_f64().unwrap(),
                r["p99_us"].as_f64().unwrap()
            );
        }
    }
}

/// Decode tokens/s at TP 1 and 2, with the cores split between the ranks and with one thread
/// per rank.
fn decode_table(shape: &str, model: &Path, params: usize, cores: usize, dir: &Path) {
    println!("\n## greedy decode, {shape} random model, {:.1}M parameters, f32, batch 1\n", params as f64 / 1e6);
    println!("64 new tokens after a 32-token prompt, 3 runs, best shown; each rank a separate process.\n");
    println!("| setting | TP | threads per rank | decode tokens/s | vs TP 1 |");
    println!("|---|---|---|---|---|");
    for (setting, threads) in [("cores split between ranks", None), ("one thread per rank", Some(1))] {
        let mut tp1 = 0.0;
        for tp in [1usize, 2] {
            let per_rank = threads.unwrap_or((cores / tp).max(1));
            let speed = (0..3).map(|_| decode_speed(model, tp, per_rank, dir)).fold(0.0, f64::max);
            if tp == 1 {
                tp1 = speed;
            }
            println!("| {setting} | {tp} | {per_rank} | {speed:.1} | {:.2}x |", speed / tp1);
        }
    }
}

/// Spawns `world_size` processes made by `command`; rank 0 opens `rendezvous` and prints the
/// communicator id, then its JSON result. Returns rank 0's JSON.
fn run_group(world_size: usize, rendezvous: &str, command: impl Fn(usize) -> Command) -> Value {
    let mut rank0 = command(0);
    rank0.args(["--rendezvous", rendezvous]).stdout(Stdio::piped());
    let mut first = rank0.spawn().expect("spawn rank 0");
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    let mut others = Vec::new();
    if world_size > 1 {
        let line = lines.next().unwrap().unwrap();
        let comm_id = line.strip_prefix("COMM_ID=").expect("rank 0 prints its communicator id").to_owned();
        for rank in 1..world_size {
            others.push(command(rank).args(["--comm-id", &comm_id]).spawn().unwrap());
        }
    }
    let result = lines.map(|l| l.unwrap()).filter(|l| l.starts_with('[') || l.starts_with('{')).last();
    assert!(first.wait().unwrap().success(), "rank 0 failed");
    for mut other in others {
        assert!(other.wait().unwrap().success(), "a rank failed");
    }
    serde_json::from_str(&result.expect("rank 0 printed a result")).unwrap()
}

fn decode_speed(model: &Path, tp: usize, threads: usize, dir: &Path) -> f64 {
    let prompts = dir.join("prompts.json");
    let prompt: Vec<u32> = (0..32).map(|i| (i * 997 + 13) % VOCAB as u32).collect();
    std::fs::write(&prompts, serde_json::to_string(&[prompt]).unwrap()).unwrap();
    let rendezvous = format!("unix://{}", dir.join("decode.sock").display());
    let report = run_group(tp, &rendezvous, |rank| {
        let mut c = Command::new(EXE);
        c.args(["eval-shard", "--model"]).arg(model);
        c.args(["--rank", &rank.to_string(), "--world-size", &tp.to_string()]);
        c.arg("--prompts").arg(&prompts);
        c.args(["--max-new", "65", "--threads", &threads.to_string()]);
        c
    });
    report["decode_tokens"].as_f64().unwrap() / report["decode_seconds"].as_f64().unwrap()
}

/// Writes config.json and model.safetensors with N(0, 0.02)-ish weights; returns the parameter count.
fn write_random_model(dir: &Path) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    let config = json!({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "tie_word_embeddings": true, "hidden_act": "silu", "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.07
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    };
    let ones = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
    let mut tensors: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), random(&[VOCAB, HIDDEN])),
        ("model.norm.weight".into(), ones(HIDDEN)),
    ];
    for layer in 0..LAYERS {
        let p = |name: &str| format!("model.layers.{layer}.{name}");
        tensors.push((p("input_layernorm.weight"), ones(HIDDEN)));
        tensors.push((p("post_attention_layernorm.weight"), ones(HIDDEN)));
        tensors.push((p("self_attn.q_proj.weight"), random(&[HEADS * HEAD_DIM, HIDDEN])));
        tensors.push((p("self_attn.k_proj.weight"), random(&[KV_HEADS * HEAD_DIM, HIDDEN])));
        tensors.push((p("self_attn.v_proj.weight"), random(&[KV_HEADS * HEAD_DIM, HIDDEN])));
        tensors.push((p("self_attn.o_proj.weight"), random(&[HIDDEN, HEADS * HEAD_DIM])));
        tensors.push((p("self_attn.q_norm.weight"), ones(HEAD_DIM)));
        tensors.push((p("self_attn.k_norm.weight"), ones(HEAD_DIM)));
        tensors.push((p("mlp.gate_proj.weight"), random(&[INTERMEDIATE, HIDDEN])));
        tensors.push((p("mlp.up_proj.weight"), random(&[INTERMEDIATE, HIDDEN])));
        tensors.push((p("mlp.down_proj.weight"), random(&[HIDDEN, INTERMEDIATE])));
    }
    let params = tensors.iter().map(|(_, t)| t.elem_count()).sum();
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    params
}

/// Writes a Qwen3.5-shaped model (text-only layout) with random weights; returns the parameter
/// count. The (1 + w) norms get w = 0, as transformers initialises them.
fn write_random_qwen3_5(dir: &Path) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    let layer_types: Vec<&str> = (0..LAYERS)
        .map(|i| if (i + 1) % FULL_ATTENTION_INTERVAL == 0 { "full_attention" } else { "linear_attention" })
        .collect();
    let config = json!({
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "layer_types": layer_types,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": LINEAR_KEY_HEADS,
        "linear_num_value_heads": LINEAR_VALUE_HEADS, "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_value_head_dim": LINEAR_HEAD_DIM, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "tie_word_embeddings": true, "hidden_act": "silu", "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let mut random = xorshift_weights();
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
    let full = |n: usize, value: f32| Tensor::full(value, n, &Device::Cpu).unwrap();
    let key_dim = LINEAR_KEY_HEADS * LINEAR_HEAD_DIM;
    let value_dim = LINEAR_VALUE_HEADS * LINEAR_HEAD_DIM;
    let mut tensors: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), random(&[VOCAB, HIDDEN])),
        ("model.norm.weight".into(), zeros(HIDDEN)),
    ];
    for (layer, kind) in layer_types.iter().enumerate() {
        let p = |name: &str| format!("model.layers.{layer}.{name}");
        tensors.push((p("input_layernorm.weight"), zeros(HIDDEN)));
        tensors.push((p("post_attention_layernorm.weight"), zeros(HIDDEN)));
        if *kind == "full_attention" {
            tensors.push((p("self_attn.q_proj.weight"), random(&[2 * HEADS * HEAD_DIM, HIDDEN])));
            tensors.push((p("self_attn.k_proj.weight"), random(&[KV_HEADS * HEAD_DIM, HIDDEN])));
            tensors.push((p("self_attn.v_proj.weight"), random(&[KV_HEADS * HEAD_DIM, HIDDEN])));
            tensors.push((p("self_attn.o_proj.weight"), random(&[HIDDEN, HEADS * HEAD_DIM])));
            tensors.push((p("self_attn.q_norm.weight"), zeros(HEAD_DIM)));
            tensors.push((p("self_attn.k_norm.weight"), zeros(HEAD_DIM)));
        } else {
            tensors.push((p("linear_attn.in_proj_qkv.weight"), random(&[2 * key_dim + value_dim, HIDDEN])));
            tensors.push((p("linear_attn.in_proj_z.weight"), random(&[value_dim, HIDDEN])));
            tensors.push((p("linear_attn.in_proj_b.weight"), random(&[LINEAR_VALUE_HEADS, HIDDEN])));
            tensors.push((p("linear_attn.in_proj_a.weight"), random(&[LINEAR_VALUE_HEADS, HIDDEN])));
            tensors.push((p("linear_attn.conv1d.weight"), random(&[2 * key_dim + value_dim, 1, 4])));
            tensors.push((p("linear_attn.A_log"), zeros(LINEAR_VALUE_HEADS)));
            tensors.push((p("linear_attn.dt_bias"), full(LINEAR_VALUE_HEADS, 1.0)));
            tensors.push((p("linear_attn.norm.weight"), full(LINEAR_HEAD_DIM, 1.0)));
            tensors.push((p("linear_attn.out_proj.weight"), random(&[HIDDEN, value_dim])));
        }
        tensors.push((p("mlp.gate_proj.weight"), random(&[INTERMEDIATE, HIDDEN])));
        tensors.push((p("mlp.up_proj.weight"), random(&[INTERMEDIATE, HIDDEN])));
        tensors.push((p("mlp.down_proj.weight"), random(&[HIDDEN, INTERMEDIATE])));
    }
    let params = tensors.iter().map(|(_, t)| t.elem_count()).sum();
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    params
}

/// Deterministic uniform weights in about [-0.035, 0.035] (xorshift; no RNG crate needed).
fn xorshift_weights() -> impl FnMut(&[usize]) -> Tensor {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    move |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.07
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }
}
