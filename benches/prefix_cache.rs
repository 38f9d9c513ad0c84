//! Automatic prefix caching on a multi-turn chat workload: prints figures, asserts nothing.
//!
//!     cargo bench --bench prefix_cache
//!
//! 16 concurrent conversations of 8 turns share a 1,000-token system prompt; each turn sends
//! the whole conversation so far (system prompt, earlier user messages and the model's replies)
//! plus a new 32-token user message and asks for 32 greedy tokens. The same workload runs against
//! `tpserve serve --tp 1` with `--prefix-cache on` and `off`, in one run, on a generated
//! Qwen3-shaped model; it prints TTFT p50 and p99 (all turns, and the turns after the first, whose
//! whole earlier conversation is cached), aggregate tokens/s, and the hit rate the server reports.
//! Set PREFIX_BENCH_CONVERSATIONS / PREFIX_BENCH_TURNS to shrink it.

mod support;

use support::served::{client, percentile, start_server, stop, wait_ready};

use std::time::{Duration, Instant};

use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

const SYSTEM_TOKENS: usize = 1000;
const USER_TOKENS: usize = 32;
const REPLY_TOKENS: u32 = 32;

/// Hidden 512, 8 layers, 8 query / 4 KV heads of 64, intermediate 1536, vocabulary 32000:
/// about 42M parameters, so the cache-off run finishes in minutes on two cores.
const MODEL: support::Qwen3Shape =
    support::Qwen3Shape { hidden: 512, layers: 8, heads: 8, kv_heads: 4, head_dim: 64, intermediate: 1536, vocab: 32000 };

struct Turn {
    turn: usize,
    ttft: Duration,
    tokens: usize,
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let conversations = env_or("PREFIX_BENCH_CONVERSATIONS", 16);
    let turns = env_or("PREFIX_BENCH_TURNS", 8);
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3-42m");
    let params = support::write_qwen3(&model, &MODEL);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("tpserve prefix-cache benchmark: Qwen3-shaped random model, {:.1}M parameters, f32, TP 1, {cores} cores", params as f64 / 1e6);
    println!(
        "{conversations} concurrent conversations x {turns} turns; {SYSTEM_TOKENS}-token shared system prompt, \
         {USER_TOKENS}-token user messages, {REPLY_TOKENS}-token greedy replies\n"
    );
    println!("| prefix cache | TTFT p50 ms | TTFT p99 ms | TTFT p50 ms, turns 2+ | TTFT p99 ms, turns 2+ | aggregate tokens/s | prompt tokens hit | wall s |");
    println!("|---|---|---|---|---|---|---|---|");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mut p50_later = Vec::new();
    for setting in ["off", "on"] {
        let address = format!("unix://{}", dir.path().join(format!("api-{setting}.sock")).display());
        let mut server = start_server(&model, &address, &["--prefix-cache", setting, "--kv-cache-gib", "2"]);
        runtime.block_on(async {
            wait_ready(&address).await;
            let started = Instant::now();
            let results = run_workload(&address, conversations, turns).await;
            let wall = started.elapsed();
            let info = client(&address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
            let tokens: usize = results.iter().map(|t| t.tokens).sum();
            let mut all: Vec<f64> = results.iter().map(|t| t.ttft.as_secs_f64() * 1e3).collect();
            let mut later: Vec<f64> = results.iter().filter(|t| t.turn > 0).map(|t| t.ttft.as_secs_f64() * 1e3).collect();
            let hit_rate = if info.prefix_cache_queries_total == 0 {
                0.0
            } else {
                info.prefix_cache_hits_total as f64 / info.prefix_cache_queries_total as f64
            };
            p50_later.push(percentile(&mut later, 0.5));
            println!(
                "| {setting} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1}% | {:.1} |",
                percentile(&mut all, 0.5),
                percentile(&mut all, 0.99),
                percentile(&mut later, 0.5),
                percentile(&mut later, 0.99),
                tokens as f64 / wall.as_secs_f64(),
                hit_rate * 100.0,
                wall.as_secs_f64()
            );
        });
        stop(&mut server);
    }
    if let [off, on] = p50_later[..] {
        println!("\nTTFT p50 of turns 2+: {:.1}x lower with the prefix cache", off / on);
    }
}

/// Every conversation runs its turns one after the other; the conversations run at once.
async fn run_workload(address: &str, conversations: usize, turns: usize) -> Vec<Turn> {
    let system: Vec<u32> = (0..SYSTEM_TOKENS as u32).map(|t| 3 + (t * 7919) % 31000).collect();
    let tasks: Vec<_> = (0..conversations)
        .map(|c| {
            let address = address.to_owned();
            let mut history = system.clone();
            tokio::spawn(async move {
                let mut client = client(&address).await;
                let mut results = Vec::with_capacity(turns);
                for turn in 0..turns {
                    history.extend((0..USER_TOKENS).map(|t| 3 + ((c * 104729 + turn * 7907 + t * 31) % 31000) as u32));
                    let (reply, ttft) = generate(&mut client, history.clone()).await;
                    results.push(Turn { turn, ttft, tokens: reply.len() });
                    history.extend(reply);
                }
                results
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    all
}

async fn generate(client: &mut GeneratorClient<tonic::transport::Channel>, prompt: Vec<u32>) -> (Vec<u32>, Duration) {
    let request = pb::GenerateRequest {
        prompt_ids: prompt,
        params: Some(pb::GenerationParams {
            max_tokens: Some(REPLY_TOKENS),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let sent = Instant::now();
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut ttft = Duration::ZERO;
    let mut reply = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        if let Some(id) = message.token_id {
            if reply.is_empty() {
                ttft = sent.elapsed();
            }
            reply.push(id);
        }
    }
    (reply, ttft)
}

