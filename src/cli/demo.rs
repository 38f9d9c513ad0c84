//! `tpserve demo`: the bundled tiny model (random weights, tests/fixtures/qwen3_a) served at
//! TP 2 on temporary Unix sockets, one streamed generation, and its speed.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};

use super::SchedulerArgs;
use super::client::{consume_stream, wait_until_serving};
use super::serve::{LocalCluster, RankSettings, ServerSettings};
use crate::coordinator::WeightFormat;
use crate::net::{self, Address};
use crate::proto::v1 as pb;
use crate::proto::v1::generator_client::GeneratorClient;

/// The bundled model's files, compiled into the binary so the demo runs from anywhere.
const BUNDLED_MODEL: [(&str, &[u8]); 5] = [
    ("config.json", include_bytes!("../../tests/fixtures/qwen3_a/config.json")),
    ("generation_config.json", include_bytes!("../../tests/fixtures/qwen3_a/generation_config.json")),
    ("model.safetensors", include_bytes!("../../tests/fixtures/qwen3_a/model.safetensors")),
    ("tokenizer.json", include_bytes!("../../tests/fixtures/qwen3_a/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../tests/fixtures/qwen3_a/tokenizer_config.json")),
];

const PROMPT: &str = "Once upon a time, there was a little robot";
const TP: usize = 2;
const MAX_TOKENS: u32 = 64;

pub async fn run() -> Result<ExitCode> {
    let workdir = tempfile::Builder::new().prefix("tpserve-demo-").tempdir().context("cannot create a temporary directory")?;
    let model_dir = workdir.path().join("tiny-qwen3");
    std::fs::create_dir(&model_dir)?;
    for (name, bytes) in BUNDLED_MODEL {
        std::fs::write(model_dir.join(name), bytes).with_context(|| format!("cannot write {name}"))?;
    }
    let listen = Address::Unix(workdir.path().join("coordinator.sock"));
    eprintln!("tpserve demo: tiny random-weight Qwen3 (tests/fixtures/qwen3_a) at TP {TP}, on {listen}");
    let scheduler = SchedulerArgs {
        max_batch_size: 8,
        max_batch_tokens: 2048,
        prefill_chunk: 512,
        max_waiting: 16,
        max_concurrent_rpcs: 64,
        max_connections: 64,
        request_timeout_secs: 60,
        shutdown_grace_secs: 5,
        max_prompt_bytes: 1 << 20,
        max_chat_messages: 1024,
        max_stop_sequences: 64,
        max_stop_bytes: 256,
        prefix_cache: super::Switch::On,
        stream_buffer: 512,
        load_timeout_secs: 600,
    };
    let ranks = RankSettings { log_filter: Some("error".to_owned()), ..RankSettings::default() };
    let cluster = LocalCluster::start(&model_dir, TP, WeightFormat::dtype("f32"), ranks, &scheduler, ServerSettings::default(), listen.clone()).await?;
    let outcome = generate_once(&listen).await;
    cluster.shutdown().await?;
    let summary = outcome?;
    let decode_seconds = summary.elapsed.saturating_sub(summary.first_token.unwrap_or_default()).as_secs_f64();
    let decode_tokens = summary.tokens.saturating_sub(1);
    eprintln!(
        "{} tokens in {:.3} s (finish: {}); first token after {:.1} ms; decode {:.1} tokens/s",
        summary.tokens,
        summary.elapsed.as_secs_f64(),
        summary.finish_reason,
        summary.first_token.unwrap_or_default().as_secs_f64() * 1e3,
        if decode_seconds > 0.0 { decode_tokens as f64 / decode_seconds } else { 0.0 },
    );
    Ok(ExitCode::SUCCESS)
}

async fn generate_once(listen: &Address) -> Result<super::client::StreamSummary> {
    wait_until_serving(listen, Duration::from_secs(120)).await?;
    let mut client = GeneratorClient::new(net::connect(listen, Duration::from_secs(5)).await?);
    let request = pb::GenerateRequest {
        prompt: PROMPT.to_owned(),
        params: Some(pb::GenerationParams {
            max_tokens: Some(MAX_TOKENS),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    println!("{PROMPT}");
    let response = client.generate(request).await;
    consume_stream(response, false, &mut std::io::stdout())
        .await
        .map_err(|status| anyhow::anyhow!("generation failed: {:?}: {}", status.code(), status.message()))
}
