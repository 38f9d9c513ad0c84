//! `tpserve eval-shard` (hidden): one rank of a group, with no coordinator. Rank 0 opens the
//! rendezvous and prints the communicator id; the others join with it. Every rank runs the
//! same prompts greedily and rank 0 writes the tokens and logits as JSON. The parity tests and
//! the benchmark run the model and the collectives this way, as separate processes.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device};
use clap::Args;
use serde::Serialize;

use crate::comm::Collective;
use crate::comm::socket::{self, CommId, SocketCollective, SocketOptions};
use crate::model::loader::LoadProgress;
use crate::model::parallel::TpGroup;
use crate::model::{LoadOptions, Model};
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
    /// f32, bf16, f16 or checkpoint
    #[arg(long, default_value = "f32")]
    pub dtype: String,
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
}

#[derive(Serialize)]
struct Report {
    prompts: Vec<PromptResult>,
    /// greedy decode speed over all prompts (single-token steps only)
    decode_tokens: usize,
    decode_seconds: f64,
    load_seconds: f64,
}

pub fn run(args: EvalShardArgs) -> Result<()> {
    let prompts: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(&args.prompts).with_context(|| format!("cannot read {}", args.prompts.display()))?,
    )
    .context("--prompts must be a JSON list of token id lists")?;
    let comm = join(args.rank, args.world_size, args.comm_id.as_deref(), args.rendezvous.as_deref(), args.init_timeout_secs)?;
    let group = TpGroup::new(comm.clone());
    let dtype = match args.dtype.as_str() {
        "f32" => Some(DType::F32),
        "bf16" => Some(DType::BF16),
        "f16" => Some(DType::F16),
        "checkpoint" => None,
        other => bail!("unknown dtype {other}"),
    };
    let started = Instant::now();
    let options = LoadOptions { dtype, device: Device::Cpu };
    let model = Model::load(&args.model, &group, &options, Arc::new(LoadProgress::default()))?;
    let load_seconds = started.elapsed().as_secs_f64();
    let mut results = Vec::new();
    let mut decode_seconds = 0.0;
    let mut decode_tokens = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let timed = offline::greedy_timed(&model, i as u64 + 1, prompt, args.max_new, args.chunk, &args.suppress)?;
        decode_seconds += timed.decode_time.as_secs_f64();
        decode_tokens += timed.decode_steps;
        results.extend(timed.result);
    }
    comm.barrier()?;
    if args.rank == 0 {
        let report = Report { prompts: results, decode_tokens, decode_seconds, load_seconds };
        let text = serde_json::to_string(&report)?;
        match &args.out {
            Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
            None => println!("{text}"),
        }
    }
    Ok(())
}

/// Joins a communicator as `rank`: rank 0 opens the rendezvous and prints `COMM_ID=<id>` on
/// stdout for whoever starts the other ranks; they join with that id.
pub(crate) fn join(
    rank: usize,
    world_size: usize,
    comm_id: Option<&str>,
    rendezvous: Option<&str>,
    init_timeout_secs: u64,
) -> Result<Arc<dyn Collective>> {
    if world_size == 1 {
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
