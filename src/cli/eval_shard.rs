//! `tpserve eval-shard` (hidden): one rank of a group, with no coordinator. Rank 0 opens the
//! rendezvous and prints the communicator id; the others join with it. Every rank runs the
//! same prompts greedily and rank 0 writes the tokens and logits as JSON. The parity tests and
//! the benchmark run the model and the collectives this way, as separate processes.
//!
//! With `--device cuda:N` (cuda feature) the ranks join an NCCL communicator, at world size 1
//! too, and rank 0 prints the NCCL id as hex. `--bench-batches` times batched greedy decode
//! (scripts/gpu-smoke.sh uses it).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use serde::Serialize;

use crate::comm::Collective;
use crate::comm::socket::{self, CommId, SocketCollective, SocketOptions};
use crate::model::loader::LoadProgress;
use crate::model::parallel::TpGroup;
use crate::model::paged::{BlockPool, DEFAULT_BLOCK_SIZE, contiguous_table};
use crate::model::{CacheStore, LoadOptions, Model, SequenceInput};
use crate::rank::offline::{self, PromptResult};

#[derive(Args, Debug, Clone)]
pub struct EvalShardArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub world_size: usize,
    /// Communicator id from rank 0 (ranks other than 0)
    #[arg(long)]
    pub comm_id: Option<String>,
    /// Rank 0: where to open the rendezvous (host:port or unix:///path); prints COMM_ID=<id>
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// JSON file with a list of prompts, each a list of token ids
    #[arg(long)]
    pub prompts: PathBuf,
    #[arg(long, default_value_t = 16)]
    pub max_new: usize,
    /// Prefill chunk size (0: whole prompt in one step)
    #[arg(long, default_value_t = 0)]
    pub chunk: usize,
    /// f32, bf16 or f16 (on CPU: 16-bit weights, f32 compute), checkpoint, or auto (a quantized
    /// GGUF stays in its blocks)
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Quantize every matrix at load time to a GGUF block format (CPU): q8_0, q4_0, q4_1,
    /// q5_0, q5_1, q4_k, q5_k, q6_k; none keeps the dtype
    #[arg(long, default_value = "none")]
    pub quantize: String,
    /// exact, or bf16: bf16 weights' products with activations rounded to bf16 (CPU)
    #[arg(long, default_value = "exact")]
    pub matmul_precision: String,
    /// The KV cache's element type: auto (the compute dtype), f32, or f16 (CPU; lossy)
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Token ids never chosen (EOS while it is ignored)
    #[arg(long, value_delimiter = ',')]
    pub suppress: Vec<u32>,
    /// Where rank 0 writes its results
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Compute threads
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 60)]
    pub init_timeout_secs: u64,
    /// cpu, or cuda:N (cuda feature): the ranks then join an NCCL communicator
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Decode benchmark after the prompts: batch sizes to time, comma-separated
    #[arg(long, value_delimiter = ',')]
    pub bench_batches: Vec<usize>,
    /// Timed single-token steps per benchmark batch
    #[arg(long, default_value_t = 64)]
    pub bench_steps: usize,
    /// Untimed steps before them (kernel loading, allocator warm-up)
    #[arg(long, default_value_t = 4)]
    pub bench_warmup: usize,
    /// Prompt length of every benchmark sequence
    #[arg(long, default_value_t = 32)]
    pub bench_prompt_len: usize,
}

#[derive(Serialize)]
struct Report {
    prompts: Vec<PromptResult>,
    /// prefill speed over all prompts (each prompt's steps until its first logits)
    prefill_tokens: usize,
    prefill_seconds: f64,
    /// greedy decode speed over all prompts (single-token steps only)
    decode_tokens: usize,
    decode_seconds: f64,
    load_seconds: f64,
    device: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    bench: Vec<BenchResult>,
}

/// Batched greedy decode: `batch` sequences of `prompt_len` tokens, then `steps` timed steps
/// of one token each.
#[derive(Serialize)]
struct BenchResult {
    batch: usize,
    prompt_len: usize,
    steps: usize,
    seconds: f64,
    tokens_per_second: f64,
    ms_per_step: f64,
    /// the first step: every sequence's whole prompt at once (batch * prompt_len rows)
    prefill_ms: f64,
}

pub fn run(args: EvalShardArgs) -> Result<()> {
    let prompts: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(&args.prompts).with_context(|| format!("cannot read {}", args.prompts.display()))?,
    )
    .context("--prompts must be a JSON list of token id lists")?;
    let (device, device_name) = super::device::parse_device(&args.device)?;
    let comm = join_on(
        &device,
        args.rank,
        args.world_size,
        args.comm_id.as_deref(),
        args.rendezvous.as_deref(),
        args.init_timeout_secs,
    )?;
    let group = TpGroup::new(comm.clone());
    let (dtype, quant) = crate::model::parse_load_dtype(&args.dtype, &args.quantize, &device, &args.model).map_err(anyhow::Error::msg)?;
    let started = Instant::now();
    let products = crate::model::parse_matmul_precision(&args.matmul_precision, dtype, quant, &device).map_err(anyhow::Error::msg)?;
    let kv_dtype = crate::model::parse_kv_cache_dtype(&args.kv_cache_dtype, &device).map_err(anyhow::Error::msg)?;
    let options = LoadOptions { dtype, device, products };
    let progress = Arc::new(LoadProgress::default());
    let model = Model::load_quantized(&args.model, &group, &options, quant, progress.clone())?;
    tracing::info!(formats = %progress.format_summary(), weight_bytes = model.weight_bytes(), "shard loaded");
    let load_seconds = started.elapsed().as_secs_f64();
    let mut results = Vec::new();
    let (mut prefill_seconds, mut prefill_tokens) = (0.0, 0);
    let (mut decode_seconds, mut decode_tokens) = (0.0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let timed = offline::greedy_timed(&model, i as u64 + 1, prompt, args.max_new, args.chunk, &args.suppress, kv_dtype)?;
        prefill_seconds += timed.timing.prefill_time.as_secs_f64();
        prefill_tokens += timed.timing.prefill_tokens;
        decode_seconds += timed.timing.decode_time.as_secs_f64();
        decode_tokens += timed.timing.decode_steps;
        results.extend(timed.result);
    }
    let mut bench = Vec::with_capacity(args.bench_batches.len());
    let mut next_seq = prompts.len() as u64 + 1;
    for &batch in &args.bench_batches {
        let result = bench_decode(&model, comm.as_ref(), next_seq, batch, &args, kv_dtype)?;
        if args.rank == 0 {
            eprintln!(
                "decode batch {batch}: {:.1} tokens/s ({:.2} ms/step over {} steps); its prefill of {} rows: {:.1} ms",
                result.tokens_per_second,
                result.ms_per_step,
                result.steps,
                batch * result.prompt_len,
                result.prefill_ms
            );
        }
        next_seq += batch as u64;
        bench.push(result);
    }
    comm.barrier()?;
    if args.rank == 0 {
        let report = Report {
            prompts: results,
            prefill_tokens,
            prefill_seconds,
            decode_tokens,
            decode_seconds,
            load_seconds,
            device: device_name,
            bench,
        };
        let text = serde_json::to_string(&report)?;
        match &args.out {
            Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
            None => println!("{text}"),
        }
    }
    Ok(())
}

/// Times batched greedy decode (one process per rank, every rank runs it).
fn bench_decode(model: &Model, comm: &dyn Collective, first_seq: u64, batch: usize, args: &EvalShardArgs, kv_dtype: Option<DType>) -> Result<BenchResult> {
    if batch == 0 {
        bail!("--bench-batches sizes must be positive");
    }
    let vocab = model.config().vocab_size;
    // Any fixed ids do: the speed does not depend on them.
    let prompt: Vec<u32> = (0..args.bench_prompt_len.max(1)).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let seq_ids: Vec<u64> = (0..batch as u64).map(|b| first_seq + b).collect();
    // Each sequence gets its own run of blocks, long enough for the whole benchmark.
    let positions = prompt.len() + args.bench_warmup + args.bench_steps;
    let per_sequence = positions.div_ceil(DEFAULT_BLOCK_SIZE);
    let tables: Vec<Vec<u32>> =
        (0..batch).map(|b| contiguous_table((b * per_sequence) as u32, positions, DEFAULT_BLOCK_SIZE)).collect();
    let mut store = CacheStore::new(BlockPool::new(batch * per_sequence, DEFAULT_BLOCK_SIZE).with_kv_dtype(kv_dtype));
    let prefill: Vec<SequenceInput<'_>> =
        seq_ids.iter().zip(&tables).map(|(&seq_id, table)| SequenceInput::new(seq_id, &prompt, 0, true, table)).collect();
    let prefill_started = Instant::now();
    let mut tokens = next_tokens(comm, model.step(&prefill, &mut store)?, batch)?;
    let prefill_ms = prefill_started.elapsed().as_secs_f64() * 1e3;
    let (mut seconds, mut steps) = (0.0, 0);
    for step in 0..args.bench_warmup + args.bench_steps {
        let started = Instant::now();
        let feed: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
        let inputs: Vec<SequenceInput<'_>> = seq_ids
            .iter()
            .zip(&feed)
            .zip(&tables)
            .map(|((&seq_id, token), table)| SequenceInput::new(seq_id, token, prompt.len() + step, true, table))
            .collect();
        // next_tokens reads the result on the host, so the time covers the device's work.
        tokens = next_tokens(comm, model.step(&inputs, &mut store)?, batch)?;
        if step >= args.bench_warmup {
            seconds += started.elapsed().as_secs_f64();
            steps += 1;
        }
    }
    let per_step = if steps == 0 { 0.0 } else { seconds / steps as f64 };
    Ok(BenchResult {
        batch,
        prompt_len: prompt.len(),
        steps,
        seconds,
        tokens_per_second: if seconds > 0.0 { (batch * steps) as f64 / seconds } else { 0.0 },
        ms_per_step: per_step * 1e3,
        prefill_ms,
    })
}

/// The greedy token of every row of a step's logits, taken on the sampling rank's device and
/// shared with the other ranks, as the coordinator would tell them.
fn next_tokens(comm: &dyn Collective, logits: Option<Tensor>, batch: usize) -> Result<Vec<u32>> {
    let local = match logits {
        Some(logits) => logits.argmax(1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?,
        None => vec![0; batch],
    };
    if comm.world_size() == 1 && !crate::comm::collectives_at_tp1() {
        return Ok(local);
    }
    let shared = comm.broadcast(&Tensor::from_vec(local, batch, &Device::Cpu)?, 0)?;
    Ok(shared.to_vec1::<u32>()?)
}

/// Joins a CPU communicator as `rank`; see [`join_on`].
pub(crate) fn join(
    rank: usize,
    world_size: usize,
    comm_id: Option<&str>,
    rendezvous: Option<&str>,
    init_timeout_secs: u64,
) -> Result<Arc<dyn Collective>> {
    join_on(&Device::Cpu, rank, world_size, comm_id, rendezvous, init_timeout_secs)
}

/// Joins a communicator as `rank`: rank 0 prints `COMM_ID=<id>` on stdout for whoever starts
/// the other ranks; they join with that id. On the CPU rank 0 opens the rendezvous first (and a
/// group of one needs no communicator); on a CUDA device every group, one rank too, is an NCCL
/// communicator and the id is NCCL's, in hex.
pub(crate) fn join_on(
    device: &Device,
    rank: usize,
    world_size: usize,
    comm_id: Option<&str>,
    rendezvous: Option<&str>,
    init_timeout_secs: u64,
) -> Result<Arc<dyn Collective>> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        use crate::comm::nccl::{NcclCollective, NcclId, NcclOptions};
        let id = if rank == 0 {
            let id = NcclId::new()?;
            let mut stdout = std::io::stdout();
            writeln!(stdout, "COMM_ID={}", id.to_hex())?;
            stdout.flush()?;
            id
        } else {
            NcclId::from_hex(comm_id.context("ranks other than 0 need --comm-id")?)?
        };
        let options = NcclOptions { init_timeout: Duration::from_secs(init_timeout_secs), ..NcclOptions::default() };
        return Ok(Arc::new(NcclCollective::init(&id, rank, world_size, device, options)?));
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    if world_size == 1 && !crate::comm::collectives_at_tp1() {
        return Ok(Arc::new(crate::comm::SingleRank));
    }
    let options = SocketOptions {
        init_timeout: Duration::from_secs(init_timeout_secs),
        op_timeout: Duration::from_secs(60),
    };
    let (id, rendezvous) = if rank == 0 {
        let bind = rendezvous.context("rank 0 needs --rendezvous")?;
        let (id, rendezvous) = socket::create_comm_id(&socket::RendezvousAddr::parse(bind)?, None)?;
        let mut stdout = std::io::stdout();
        writeln!(stdout, "COMM_ID={}", String::from_utf8_lossy(&id.to_bytes()))?;
        stdout.flush()?;
        (id, Some(rendezvous))
    } else {
        let text = comm_id.context("ranks other than 0 need --comm-id")?;
        (CommId::from_bytes(text.as_bytes())?, None)
    };
    let comm = SocketCollective::init(&id, rank, world_size, rendezvous, options)?;
    Ok(Arc::new(comm))
}
