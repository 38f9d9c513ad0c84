//! The `tpserve` command line. Scripts depend on these forms; see README.md.

pub mod client;
pub mod collective_bench;
pub mod demo;
pub mod device;
pub mod eval_shard;
pub mod serve;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};

use crate::auth::{ADMIN_TOKEN_ENV, API_TOKEN_ENV, CLUSTER_TOKEN_ENV, Secret, load_token};
use crate::coordinator::{CoordinatorOptions, Tokens, WeightFormat};
use crate::coordinator::engine::SchedulerConfig;
use crate::coordinator::service::RpcLimits;
use crate::coordinator::stop::StopLimits;
use crate::coordinator::validation::RequestLimits;
use crate::net::Address;

#[derive(Parser, Debug)]
#[command(name = "tpserve", version, about = "Tensor-parallel LLM inference: a gRPC coordinator driving rank servers")]
pub struct Cli {
    /// Log format for servers: text or json
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Export traces over OTLP/gRPC to this endpoint (else $OTEL_EXPORTER_OTLP_ENDPOINT)
    #[arg(long, global = true)]
    pub otlp_endpoint: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one rank server (one tensor-parallel shard)
    Rank(RankArgs),
    /// Run the coordinator, driving already-running ranks
    Coordinator(CoordinatorArgs),
    /// Spawn N local ranks and a coordinator
    Serve(ServeArgs),
    /// Stream a generation from a server
    Generate(client::GenerateArgs),
    /// Chat with a server's model through its chat template
    Chat(client::ChatArgs),
    /// Check a server's grpc.health.v1 status (exit 0 when SERVING)
    ///
    /// The same check with grpcurl: `grpcurl -plaintext HOST:PORT grpc.health.v1.Health/Check`;
    /// over a Unix socket add `-unix -authority localhost` and give the socket's path, since
    /// grpcurl would otherwise send the path as :authority, which the server rejects
    /// (PROTOCOL_ERROR).
    Health(client::HealthArgs),
    /// Serve the bundled tiny model at TP 2 and stream one generation
    Demo,
    /// Join a communicator and run prompts through one shard, without a coordinator (tests, benchmarks)
    #[command(hide = true)]
    EvalShard(eval_shard::EvalShardArgs),
    /// Measure all-reduce latency between rank processes (benchmarks)
    #[command(hide = true)]
    BenchCollective(collective_bench::CollectiveBenchArgs),
}

#[derive(Args, Debug, Clone)]
pub struct RankArgs {
    /// Address to serve on: unix:///path/to.sock or host:port
    #[arg(long)]
    pub listen: Address,
    /// Device: cpu (cuda:N with the cuda feature)
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute threads (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where rank 0 opens the collective rendezvous: host:port (port 0 picks one) or unix:///path
    #[arg(long, default_value = "0.0.0.0:0")]
    pub rendezvous: String,
    /// Host the other ranks use to reach this rank's rendezvous (default: this host's name)
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// Seconds a collective waits for a peer before declaring it hung
    #[arg(long, default_value_t = 60)]
    pub collective_timeout_secs: u64,
    /// KV cache budget per model in GiB (default: half the available memory, shared by the group)
    #[arg(long)]
    pub kv_cache_gib: Option<f64>,
    /// File holding the cluster token every rank RPC must carry (else $TPSERVE_CLUSTER_TOKEN)
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: ServerTlsArgs,
    /// host:port to serve Prometheus metrics (step and collective time) on, at /metrics
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// TLS identity of a server (both files, or neither for plaintext).
#[derive(Args, Debug, Clone, Default)]
pub struct ServerTlsArgs {
    /// PEM certificate chain to serve TLS with (TCP addresses)
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ServerTlsArgs {
    pub fn config(&self) -> Result<Option<tonic::transport::ServerTlsConfig>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(crate::net::server_tls(cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// Tokens of a server that faces clients.
#[derive(Args, Debug, Clone, Default)]
pub struct TokenArgs {
    /// File holding the token public API clients must send as a bearer token (else
    /// $TPSERVE_API_TOKEN; without either the API is open)
    #[arg(long)]
    pub api_token_file: Option<PathBuf>,
    /// File holding the token the Admin service requires (else $TPSERVE_ADMIN_TOKEN; without
    /// either Admin is disabled)
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The API and admin tokens, plus the cluster token given.
    pub fn tokens(&self, cluster: Option<Secret>) -> Result<Tokens> {
        Ok(Tokens {
            cluster,
            api: load_token(self.api_token_file.as_deref(), API_TOKEN_ENV)?,
            admin: load_token(self.admin_token_file.as_deref(), ADMIN_TOKEN_ENV)?,
        })
    }
}

#[derive(Args, Debug, Clone)]
pub struct CoordinatorArgs {
    /// A rank address, in rank order (repeat for each rank)
    #[arg(long = "rank", required = true)]
    pub ranks: Vec<Address>,
    /// Model directory (config.json, tokenizer.json, safetensors), as seen by the ranks too; or a
    /// Hugging Face Hub id ORG/NAME[@REVISION], fetched into the Hugging Face cache (HF_HOME,
    /// HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE), the weights by each rank
    #[arg(long)]
    pub model: PathBuf,
    /// Id clients use for the model (default: the directory name)
    #[arg(long)]
    pub model_id: Option<String>,
    /// Address to serve the public API on
    #[arg(long)]
    pub listen: Address,
    #[command(flatten)]
    pub weights: WeightArgs,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    /// Seconds to wait for the ranks to appear
    #[arg(long, default_value_t = 300)]
    pub rank_wait_secs: u64,
    /// File holding the cluster token sent to the ranks (else $TPSERVE_CLUSTER_TOKEN)
    #[arg(long)]
    pub cluster_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub tokens: TokenArgs,
    #[command(flatten)]
    pub tls: ServerTlsArgs,
    /// PEM CA (or self-signed certificate) to verify ranks given as host:port over TLS
    #[arg(long)]
    pub rank_tls_ca: Option<PathBuf>,
    /// host:port to serve Prometheus metrics on, at /metrics
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// host:port to serve the OpenAI-compatible HTTP API on (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health), beside gRPC
    #[arg(long)]
    pub http_listen: Option<String>,
}

/// Scheduling and admission.
#[derive(Args, Debug, Clone)]
pub struct SchedulerArgs {
    /// Most sequences in one step
    #[arg(long, default_value_t = 64)]
    pub max_batch_size: usize,
    /// Most tokens in one step (decodes plus prefill chunks)
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Prefill chunk size in tokens (also the most prefill tokens per step)
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Requests waiting for admission beyond this are refused with RESOURCE_EXHAUSTED
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// RPCs handled at once by the public server; more are shed with UNAVAILABLE
    #[arg(long, default_value_t = 1024)]
    pub max_concurrent_rpcs: usize,
    /// Open connections to the public port; more wait in the kernel's backlog until one closes
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds to produce a response (a unary call, or the start of a stream)
    #[arg(long, default_value_t = 600)]
    pub request_timeout_secs: u64,
    /// On SIGTERM, seconds in-flight requests may take to finish before the server stops
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Most bytes of prompt text (or of a chat's messages together) before tokenization
    #[arg(long, default_value_t = 1 << 20)]
    pub max_prompt_bytes: usize,
    /// Most messages in one chat request
    #[arg(long, default_value_t = 1024)]
    pub max_chat_messages: usize,
    /// Most stop sequences in one request
    #[arg(long, default_value_t = 64)]
    pub max_stop_sequences: usize,
    /// Most bytes in one stop sequence
    #[arg(long, default_value_t = 256)]
    pub max_stop_bytes: usize,
    /// Messages a stream may fall behind its client before it is cut off (RESOURCE_EXHAUSTED)
    #[arg(long, default_value_t = 512)]
    pub stream_buffer: usize,
    /// Seconds loading a model on the ranks may take in all (a rank silent for 60 s fails sooner)
    #[arg(long, default_value_t = 1800)]
    pub load_timeout_secs: u64,
    /// Automatic prefix caching: reuse the KV blocks (and Gated DeltaNet state) of a prompt
    /// prefix another request already computed
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub prefix_cache: Switch,
}

/// An on/off flag value.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
}

impl SchedulerArgs {
    pub fn config(&self) -> Result<SchedulerConfig> {
        if self.max_batch_size == 0 || self.max_batch_tokens == 0 || self.prefill_chunk == 0 {
            bail!("--max-batch-size, --max-batch-tokens and --prefill-chunk must be positive");
        }
        Ok(SchedulerConfig {
            max_batch_sequences: self.max_batch_size,
            max_batch_tokens: self.max_batch_tokens,
            prefill_chunk: self.prefill_chunk,
            max_waiting: self.max_waiting,
            prefix_cache: self.prefix_cache == Switch::On,
            ..SchedulerConfig::default()
        })
    }

    pub fn limits(&self) -> Result<RpcLimits> {
        if self.max_concurrent_rpcs == 0 || self.max_connections == 0 || self.request_timeout_secs == 0 {
            bail!("--max-concurrent-rpcs, --max-connections and --request-timeout-secs must be positive");
        }
        if self.max_prompt_bytes == 0 || self.max_chat_messages == 0 || self.max_stop_bytes == 0 || self.stream_buffer == 0 {
            bail!("--max-prompt-bytes, --max-chat-messages, --max-stop-bytes and --stream-buffer must be positive");
        }
        Ok(RpcLimits {
            max_concurrent_rpcs: self.max_concurrent_rpcs,
            max_connections: self.max_connections,
            request_timeout: Duration::from_secs(self.request_timeout_secs),
            request: RequestLimits {
                max_prompt_bytes: self.max_prompt_bytes,
                max_chat_messages: self.max_chat_messages,
                stop: StopLimits { max_count: self.max_stop_sequences, max_bytes: self.max_stop_bytes },
                stream_buffer: self.stream_buffer,
                tokenizer_threads: available_cores(),
            },
        })
    }

    pub fn load_timeout(&self) -> Result<Duration> {
        if self.load_timeout_secs == 0 {
            bail!("--load-timeout-secs must be positive");
        }
        Ok(Duration::from_secs(self.load_timeout_secs))
    }
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Model directory, a GGUF file, or a Hugging Face Hub id ORG/NAME[@REVISION] (fetched into
    /// the Hugging Face cache: HF_HOME, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE)
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel size: number of local rank processes
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Address to serve the public API on
    #[arg(long)]
    pub listen: Address,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// Compute threads per rank (default: cores / tp)
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache budget per rank and model in GiB (default: half the available memory, shared)
    #[arg(long)]
    pub kv_cache_gib: Option<f64>,
    #[command(flatten)]
    pub scheduler: SchedulerArgs,
    #[command(flatten)]
    pub tokens: TokenArgs,
    /// TLS identity of the public port
    #[command(flatten)]
    pub tls: ServerTlsArgs,
    /// host:port to serve the coordinator's Prometheus metrics on, at /metrics
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// host:port to serve the OpenAI-compatible HTTP API on (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health), beside gRPC
    #[arg(long)]
    pub http_listen: Option<String>,
    /// Where the ranks run: cpu, or cuda (rank i on cuda:i, NCCL between them; needs a build
    /// with the cuda feature and one GPU per rank). Default: cuda in a cuda build on a machine
    /// with a GPU, else cpu
    #[arg(long)]
    pub device: Option<String>,
}

impl CoordinatorArgs {
    pub fn options(&self) -> Result<CoordinatorOptions> {
        Ok(CoordinatorOptions {
            ranks: self.ranks.clone(),
            model: self.model.clone(),
            model_id: self.model_id.clone(),
            weights: self.weights.format()?,
            listen: self.listen.clone(),
            scheduler: self.scheduler.config()?,
            limits: self.scheduler.limits()?,
            rank_patience: Duration::from_secs(self.rank_wait_secs),
            init_timeout: Duration::from_secs(120),
            recovery_timeout: Duration::from_secs(120),
            load_timeout: self.scheduler.load_timeout()?,
            shutdown_grace: Duration::from_secs(self.scheduler.shutdown_grace_secs),
            tokens: self.tokens.tokens(load_token(self.cluster_token_file.as_deref(), CLUSTER_TOKEN_ENV)?)?,
            tls: self.tls.config()?,
            rank_tls: self.rank_tls_ca.as_deref().map(crate::net::ClientTls::from_ca_file).transpose()?,
            metrics_listen: self.metrics_listen.clone(),
            http_listen: self.http_listen.clone(),
        })
    }
}

pub use crate::signals::termination_signal;

/// Logs to stderr, as text or JSON, filtered by RUST_LOG (default info); no trace export.
pub fn init_logging(format: &str) {
    let _ = crate::telemetry::init(format, "tpserve", None);
}

/// The cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Runs a parsed command line and returns the process exit code.
pub async fn run(cli: Cli) -> Result<std::process::ExitCode> {
    use std::process::ExitCode;
    let otlp = cli.otlp_endpoint.as_deref();
    match cli.command {
        Command::Rank(args) => {
            let telemetry = crate::telemetry::init(&cli.log_format, "tpserve-rank", otlp)?;
            let result = serve::run_rank(args).await;
            telemetry.shutdown();
            result.map(|()| ExitCode::SUCCESS)
        }
        Command::Coordinator(args) => {
            let telemetry = crate::telemetry::init(&cli.log_format, "tpserve-coordinator", otlp)?;
            let result = crate::coordinator::run(args.options()?).await;
            telemetry.shutdown();
            result.map(|()| ExitCode::SUCCESS)
        }
        Command::Serve(args) => {
            let telemetry = crate::telemetry::init(&cli.log_format, "tpserve-coordinator", otlp)?;
            let result = serve::run_serve(args, otlp.map(str::to_owned)).await;
            telemetry.shutdown();
            result.map(|()| ExitCode::SUCCESS)
        }
        Command::Generate(args) => client::generate(args).await,
        Command::Chat(args) => client::chat(args).await,
        Command::Health(args) => client::health(args).await,
        Command::Demo => demo::run().await,
        Command::EvalShard(args) => {
            init_logging(&cli.log_format);
            crate::model::compute_pool::run("compute", || eval_shard::run(args))??;
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchCollective(args) => {
            collective_bench::run(args)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// How the ranks hold the weights (`serve`, `coordinator`).
#[derive(Args, Debug, Clone)]
pub struct WeightArgs {
    /// Weight dtype: auto (GPU: bf16; CPU: a bf16 or f16 checkpoint stays so where the CPU has a
    /// SIMD kernel for it, a quantized GGUF stays in its blocks, else f32), checkpoint, f32 (a
    /// GGUF dequantized: the exact path), bf16 or f16 (on CPU: 16-bit weights, f32 compute)
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Quantize every matrix at load time to a GGUF block format, each rank its own slice, and
    /// multiply through integer kernels (CPU; dtype auto or f32): q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q4_k, q5_k, q6_k; none keeps the dtype
    #[arg(long, default_value = "none")]
    pub quantize: String,
    /// How bf16 weights' products are computed (CPU): exact (f32 activations times the widened
    /// weights), or bf16 (activations rounded to bf16, as torch computes a bf16 model: lossy,
    /// faster in a batch with avx512_bf16's vdpbf16ps); needs bf16 weights
    #[arg(long, default_value = "exact")]
    pub matmul_precision: String,
    /// The KV cache's element type: auto (the compute dtype: f32 on a CPU, the exact path), f32,
    /// or f16 (CPU: half the memory a position and half the bytes a decode step reads from a
    /// long history, keys and values rounded to f16; lossy, as llama.cpp's default cache)
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
}

impl WeightArgs {
    /// The format to send the ranks; an unknown `--quantize` is refused here, before any rank
    /// starts (the ranks check the combination with the device and the checkpoint).
    pub fn format(&self) -> Result<WeightFormat> {
        let quantize = self.quantize.as_str();
        if !matches!(quantize, "" | "none") && crate::model::quant::formats::parse(quantize).is_none() {
            bail!("unknown quantization \"{quantize}\" (expected none, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k)");
        }
        if !matches!(self.matmul_precision.as_str(), "" | "exact" | "bf16") {
            bail!("unknown matmul precision \"{}\" (expected exact or bf16)", self.matmul_precision);
        }
        if !matches!(self.kv_cache_dtype.as_str(), "" | "auto" | "f32" | "f16") {
            bail!("unknown KV cache dtype \"{}\" (expected auto, f32 or f16)", self.kv_cache_dtype);
        }
        Ok(WeightFormat {
            dtype: self.dtype.clone(),
            quantize: self.quantize.clone(),
            matmul_precision: self.matmul_precision.clone(),
            kv_cache_dtype: self.kv_cache_dtype.clone(),
        })
    }
}
