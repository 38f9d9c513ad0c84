//! The served system under load: prints figures, asserts nothing.
//!
//!     cargo bench --bench serving
//!
//! Drives `tpserve serve --tp 1` (a real rank process, real gRPC over a Unix socket) on a
//! generated ~100M-parameter Qwen3-shaped model with N concurrent streaming clients, and prints
//! TTFT and inter-token latency (p50, p99), aggregate tokens/s at concurrency 1, 4, 16 and 64
//! (the median of `TPSERVE_BENCH_ROUNDS` rounds, default 3, the levels interleaved),
//! the per-step orchestration overhead the coordinator measures (GenerateStep round trip minus
//! the rank's compute time), and, as the baseline of the same run, the decode tokens/s of the
//! same model driven by an in-process loop with no RPC.
//!
//! Requests are greedy unless `TPSERVE_BENCH_TEMPERATURE` sets a temperature: sampled decoding,
//! an OpenAI client's default (each client's requests seeded; the in-process baseline stays
//! greedy).
//!
//! It runs once per weight format in `TPSERVE_BENCH_WEIGHTS` (default `f32,bf16,q8_0`): `f32`
//! and `bf16` are `--dtype`, `bf16x` is `--dtype bf16 --matmul-precision bf16` (activations
//! rounded to bf16), a GGUF block format name is `--quantize`.

mod support;

use support::served::{client, percentile, start_server, stop, wait_ready};

use std::sync::Arc;
use std::time::{Duration, Instant};

use tpserve::model::loader::LoadProgress;
use tpserve::model::parallel::TpGroup;
use tpserve::model::{LoadOptions, Model};
use tpserve::proto::v1 as pb;
use tpserve::rank::offline;

const PROMPT_TOKENS: usize = 32;
const NEW_TOKENS: u32 = 64;
const CONCURRENCY: [usize; 4] = [1, 4, 16, 64];

struct Stream {
    ttft: Duration,
    inter_token: Vec<Duration>,
    tokens: usize,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3-100m");
    let params = support::write_qwen3(&model, &support::QWEN3_100M);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let formats = std::env::var("TPSERVE_BENCH_WEIGHTS").unwrap_or_else(|_| "f32,bf16,q8_0".to_owned());
    for format in formats.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        println!("tpserve serving benchmark: Qwen3-shaped random model, {:.1}M parameters, weights {format}, TP 1, {cores} cores", params as f64 / 1e6);
        let sampling = if temperature() > 0.0 { format!("sampled at temperature {}", temperature()) } else { "greedy".to_owned() };
        println!("{PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens per request, {sampling}, EOS ignored\n");
        run_format(&model, dir.path(), format);
        println!();
    }
}

/// The requests' temperature: `TPSERVE_BENCH_TEMPERATURE`, 0 (greedy) unless set (read once).
fn temperature() -> f32 {
    static TEMPERATURE: std::sync::OnceLock<f32> = std::sync::OnceLock::new();
    *TEMPERATURE.get_or_init(|| std::env::var("TPSERVE_BENCH_TEMPERATURE").ok().and_then(|t| t.parse().ok()).unwrap_or(0.0))
}

/// `serve` flags for a weight format: a dtype, bf16 with bf16 products, or a quantization.
fn weight_flags(format: &str) -> Vec<&str> {
    if tpserve::model::quant::formats::parse(format).is_some() {
        vec!["--quantize", format]
    } else if format == "bf16x" {
        vec!["--dtype", "bf16", "--matmul-precision", "bf16"]
    } else {
        vec!["--dtype", format]
    }
}

fn run_format(model: &std::path::Path, dir: &std::path::Path, format: &str) {
    let baseline = in_process_decode(model, format);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let address = format!("unix://{}", dir.join(format!("api-{format}.sock")).display());
    let mut server = start_server(model, &address, &weight_flags(format));
    runtime.block_on(async {
        wait_ready(&address).await;
        run_level(&address, 2, 0).await; // warm-up
        // Rounds of every level, interleaved, so that each level samples the same stretches of
        // a shared machine's noise; a level's figure is its median round (one round of
        // concurrency 1 is a single 64-token request, a fifth of a second).
        let rounds: usize = std::env::var("TPSERVE_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).filter(|&r| r > 0).unwrap_or(3);
        let mut levels: Vec<Level> = CONCURRENCY.iter().map(|_| Level::default()).collect();
        let mut overhead = (0.0, 0.0);
        for round in 0..rounds {
            for (level, &concurrency) in levels.iter_mut().zip(&CONCURRENCY) {
                let (streams, wall) = run_level(&address, concurrency, (round * CONCURRENCY.len()) as u64 + concurrency as u64).await;
                level.add(&streams, wall);
                if concurrency == 1 {
                    overhead = step_overhead(&address).await; // the coordinator's recent steps: this level's
                }
            }
        }
        println!("| concurrency | aggregate tokens/s (median of {rounds} rounds) | rounds | vs concurrency 1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |");
        println!("|---|---|---|---|---|---|---|---|");
        let single = levels[0].median_throughput();
        for (level, &concurrency) in levels.iter_mut().zip(&CONCURRENCY) {
            let throughput = level.median_throughput();
            let each: Vec<String> = level.throughputs.iter().map(|t| format!("{t:.0}")).collect();
            println!(
                "| {concurrency} | {throughput:.1} | {} | {:.2}x | {:.1} | {:.1} | {:.2} | {:.2} |",
                each.join(" / "),
                throughput / single,
                percentile(&mut level.ttft, 0.5),
                percentile(&mut level.ttft, 0.99),
                percentile(&mut level.itl, 0.5),
                percentile(&mut level.itl, 0.99)
            );
        }
        let single_decode = levels[0].itl.len() as f64 / (levels[0].itl.iter().sum::<f64>() / 1e3);
        println!("\nper-step orchestration overhead at concurrency 1 (round trip minus rank compute): p50 {:.0} µs, p99 {:.0} µs", overhead.0, overhead.1);
        println!("served batch-1 decode: {single_decode:.1} tokens/s; in-process loop (no RPC): {baseline:.1} tokens/s; ratio {:.3}", single_decode / baseline);
    });
    stop(&mut server);
}

/// One concurrency level's rounds: each round's aggregate tokens/s, every stream's TTFT and
/// inter-token gaps (ms).
#[derive(Default)]
struct Level {
    throughputs: Vec<f64>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

impl Level {
    fn add(&mut self, streams: &[Stream], wall: Duration) {
        let tokens: usize = streams.iter().map(|s| s.tokens).sum();
        self.throughputs.push(tokens as f64 / wall.as_secs_f64());
        self.ttft.extend(streams.iter().map(|s| s.ttft.as_secs_f64() * 1e3));
        self.itl.extend(streams.iter().flat_map(|s| s.inter_token.iter().map(|d| d.as_secs_f64() * 1e3)));
    }

    fn median_throughput(&self) -> f64 {
        percentile(&mut self.throughputs.clone(), 0.5)
    }
}

/// `concurrency` streams at once, each on its own connection; returns them and the wall time.
async fn run_level(address: &str, concurrency: usize, salt: u64) -> (Vec<Stream>, Duration) {
    let mut clients = Vec::new();
    for _ in 0..concurrency {
        clients.push(client(address).await);
    }
    let started = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut client)| {
            let prompt: Vec<u32> =
                (0..PROMPT_TOKENS).map(|t| ((t as u64 * 7919 + i as u64 * 104729 + salt * 15485863) % 32000) as u32).collect();
            tokio::spawn(async move {
                let request = pb::GenerateRequest {
                    prompt_ids: prompt,
                    params: Some(pb::GenerationParams {
                        max_tokens: Some(NEW_TOKENS),
                        temperature: Some(temperature()),
                        seed: Some(i as u64),
                        ignore_eos: true,
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let sent = Instant::now();
                let mut stream = client.generate(request).await.unwrap().into_inner();
                let mut last = sent;
                let mut result = Stream { ttft: Duration::ZERO, inter_token: Vec::new(), tokens: 0 };
                while let Some(message) = stream.message().await.unwrap() {
                    if message.token_id.is_none() {
                        continue;
                    }
                    let now = Instant::now();
                    if result.tokens == 0 {
                        result.ttft = now - sent;
                    } else {
                        result.inter_token.push(now - last);
                    }
                    last = now;
                    result.tokens += 1;
                }
                result
            })
        })
        .collect();
    let mut streams = Vec::new();
    for task in tasks {
        streams.push(task.await.unwrap());
    }
    (streams, started.elapsed())
}

async fn step_overhead(address: &str) -> (f64, f64) {
    let info = client(address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    (info.step_overhead_us_p50, info.step_overhead_us_p99)
}

/// Greedy decode tokens/s of the same model loaded in this process, no RPC, same threads.
fn in_process_decode(model: &std::path::Path, format: &str) -> f64 {
    let flags = weight_flags(format);
    let flag = |name: &str| flags.chunks(2).find(|pair| pair[0] == name).map(|pair| pair[1]);
    let device = candle_core::Device::Cpu;
    let (dtype, quant) = tpserve::model::parse_load_dtype(flag("--dtype").unwrap_or("auto"), flag("--quantize").unwrap_or(""), &device, model).unwrap();
    let products = tpserve::model::parse_matmul_precision(flag("--matmul-precision").unwrap_or(""), dtype, quant, &device).unwrap();
    let options = LoadOptions { dtype, device, products };
    let model = Model::load_quantized(model, &TpGroup::single(), &options, quant, Arc::new(LoadProgress::default())).unwrap();
    let prompt: Vec<u32> = (0..PROMPT_TOKENS as u32).map(|t| (t * 7919) % 32000).collect();
    let mut best: f64 = 0.0;
    for run in 0..3 {
        let timed = offline::greedy_timed(&model, run + 1, &prompt, NEW_TOKENS as usize, 0, &[], None).unwrap();
        best = best.max(timed.timing.decode_steps as f64 / timed.timing.decode_time.as_secs_f64());
    }
    best
}

