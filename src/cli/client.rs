//! Client subcommands: `generate`, `chat` and `health`.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde_json::json;
use tonic::transport::Channel;

use crate::auth::{API_TOKEN_ENV, AttachToken, load_token};
use crate::net::{self, Address};
use crate::proto::v1 as pb;
use crate::proto::v1::generator_client::GeneratorClient;

#[derive(Args, Debug, Clone)]
pub struct GenerationArgs {
    /// Most tokens to generate
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature (0: greedy)
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Seed for reproducible sampling
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past EOS until --max-tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop before this string (repeatable)
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object per line instead of text
    #[arg(long)]
    pub json: bool,
    /// Model id (default: the server's default model)
    #[arg(long, default_value = "")]
    pub model: String,
    /// File holding the server's API token (else $TPSERVE_API_TOKEN)
    #[arg(long)]
    pub token_file: Option<std::path::PathBuf>,
    /// PEM CA (or self-signed certificate) to verify a TLS server
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
}

impl GenerationArgs {
    fn params(&self) -> pb::GenerationParams {
        pb::GenerationParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            stop: self.stop.clone(),
            ..Default::default()
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// Server address: unix:///path or host:port
    #[arg(long)]
    pub server: Address,
    /// Prompt text
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    #[command(flatten)]
    pub generation: GenerationArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    #[arg(long)]
    pub server: Address,
    /// The user's message
    #[arg(long)]
    pub message: String,
    /// A system message before it
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub generation: GenerationArgs,
}

#[derive(Args, Debug, Clone)]
pub struct HealthArgs {
    #[arg(long)]
    pub server: Address,
    /// Service to check ("" is the whole server)
    #[arg(long, default_value = "")]
    pub service: String,
    /// PEM CA (or self-signed certificate) to verify a TLS server
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
}

async fn channel(server: &Address, tls_ca: Option<&std::path::Path>) -> Result<Channel> {
    let tls = tls_ca.map(net::ClientTls::from_ca_file).transpose()?;
    net::connect_with(server, Duration::from_secs(10), tls.as_ref()).await
}

type Client = GeneratorClient<tonic::service::interceptor::InterceptedService<Channel, AttachToken>>;

async fn generator(server: &Address, args: &GenerationArgs) -> Result<Client> {
    let token = load_token(args.token_file.as_deref(), API_TOKEN_ENV)?;
    let channel = channel(server, args.tls_ca.as_deref()).await?;
    Ok(GeneratorClient::with_interceptor(channel, AttachToken::bearer(token.as_ref())?))
}

pub async fn generate(args: GenerateArgs) -> Result<ExitCode> {
    let mut client = generator(&args.server, &args.generation).await?;
    let request = pb::GenerateRequest {
        model: args.generation.model.clone(),
        prompt: args.prompt.unwrap_or_default(),
        prompt_ids: args.prompt_ids.unwrap_or_default(),
        params: Some(args.generation.params()),
        ..Default::default()
    };
    let stream = client.generate(request).await;
    print_stream(stream, args.generation.json).await
}

pub async fn chat(args: ChatArgs) -> Result<ExitCode> {
    let mut client = generator(&args.server, &args.generation).await?;
    let mut messages = Vec::new();
    if let Some(system) = args.system {
        messages.push(pb::ChatMessage { role: "system".into(), content: system, ..Default::default() });
    }
    messages.push(pb::ChatMessage { role: "user".into(), content: args.message, ..Default::default() });
    let request = pb::ChatRequest { model: args.generation.model.clone(), messages, params: Some(args.generation.params()), ..Default::default() };
    let stream = client.chat(request).await;
    print_stream(stream, args.generation.json).await
}

/// What a finished stream reported.
pub struct StreamSummary {
    pub tokens: usize,
    pub finish_reason: String,
    pub elapsed: Duration,
    pub first_token: Option<Duration>,
}

/// Prints a generation stream as text (or JSON lines) and returns the exit code.
async fn print_stream(
    response: Result<tonic::Response<tonic::Streaming<pb::GenerateResponse>>, tonic::Status>,
    json: bool,
) -> Result<ExitCode> {
    match consume_stream(response, json, &mut std::io::stdout()).await {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(status) => {
            eprintln!("error: {:?}: {}", status.code(), status.message());
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Writes each message as it arrives; text mode ends with a newline.
pub async fn consume_stream(
    response: Result<tonic::Response<tonic::Streaming<pb::GenerateResponse>>, tonic::Status>,
    json: bool,
    out: &mut impl Write,
) -> Result<StreamSummary, tonic::Status> {
    let started = Instant::now();
    let mut stream = response?.into_inner();
    let mut summary = StreamSummary { tokens: 0, finish_reason: String::new(), elapsed: Duration::ZERO, first_token: None };
    while let Some(message) = stream.message().await? {
        if message.token_id.is_some() {
            summary.tokens += 1;
            summary.first_token.get_or_insert_with(|| started.elapsed());
        }
        let reason = pb::FinishReason::try_from(message.finish_reason).unwrap_or(pb::FinishReason::Unspecified);
        let write = if json { write_json(out, &message, reason) } else { write_text(out, &message) };
        write.map_err(|err| tonic::Status::internal(format!("cannot write output: {err}")))?;
        if reason != pb::FinishReason::Unspecified {
            summary.finish_reason = finish_reason_name(reason).to_owned();
        }
    }
    if !json {
        let _ = writeln!(out);
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

fn write_text(out: &mut impl Write, message: &pb::GenerateResponse) -> std::io::Result<()> {
    out.write_all(message.text.as_bytes())?;
    out.flush()
}

fn write_json(out: &mut impl Write, message: &pb::GenerateResponse, reason: pb::FinishReason) -> std::io::Result<()> {
    let mut line = json!({});
    if let Some(token_id) = message.token_id {
        line["token_id"] = json!(token_id);
        line["text"] = json!(message.text);
        if let Some(logprob) = message.logprob {
            line["logprob"] = json!(logprob);
        }
    } else if !message.text.is_empty() {
        line["text"] = json!(message.text);
    }
    if reason != pb::FinishReason::Unspecified {
        line["finish_reason"] = json!(finish_reason_name(reason));
        let usage = message.usage.unwrap_or_default();
        line["usage"] = json!({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens});
    }
    writeln!(out, "{line}")?;
    out.flush()
}

pub fn finish_reason_name(reason: pb::FinishReason) -> &'static str {
    match reason {
        pb::FinishReason::Unspecified => "unspecified",
        pb::FinishReason::Length => "length",
        pb::FinishReason::Eos => "eos",
        pb::FinishReason::StopSequence => "stop_sequence",
        pb::FinishReason::ContextLength => "context_length",
        pb::FinishReason::ToolCalls => "tool_calls",
    }
}

pub async fn health(args: HealthArgs) -> Result<ExitCode> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let channel = match channel(&args.server, args.tls_ca.as_deref()).await {
        Ok(channel) => channel,
        Err(err) => {
            println!("UNREACHABLE");
            eprintln!("error: {err:#}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest { service: args.service.clone() })
        .await;
    match response {
        Ok(response) => {
            let status = ServingStatus::try_from(response.into_inner().status).unwrap_or(ServingStatus::Unknown);
            println!("{}", status.as_str_name());
            Ok(if status == ServingStatus::Serving { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Err(status) => {
            println!("UNKNOWN");
            eprintln!("error: {:?}: {}", status.code(), status.message());
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Waits until the server at `address` reports SERVING, or `patience` runs out.
pub async fn wait_until_serving(address: &Address, patience: Duration) -> Result<()> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let started = Instant::now();
    loop {
        if let Ok(channel) = net::connect(address, Duration::from_secs(2)).await {
            let response = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await;
            if let Ok(response) = response {
                if response.into_inner().status == ServingStatus::Serving as i32 {
                    return Ok(());
                }
            }
        }
        if started.elapsed() > patience {
            return Err(anyhow::anyhow!("{address} did not become SERVING within {patience:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

