//! The device worker: one OS thread that owns the rank's device state (communicator, model
//! shards, caches, samplers). The gRPC handlers send it commands and await the replies.
//!
//! One owning thread is what CUDA contexts and NCCL communicators require, and it serialises
//! steps for free: a rank can only run one forward pass at a time anyway.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use rayon::prelude::*;
use tokio::sync::oneshot;

use crate::comm::Collective;
use crate::comm::socket::{CommId, Rendezvous, SocketCollective, SocketOptions};
use crate::model::loader::LoadProgress;
use crate::model::parallel::TpGroup;
use crate::model::paged::{BlockPool, DEFAULT_BLOCK_SIZE};
use crate::model::placement::with_host_f32;
use crate::model::{CacheStore, LoadOptions, Model, SequenceInput};
use crate::proto::rank::v1 as pb;
use crate::sampling::{Sampler, SamplingParams};

use super::error::{Error, Kind};

pub type Reply<T> = oneshot::Sender<Result<T, Error>>;

pub enum Command {
    Init { request: pb::InitRequest, rendezvous: Option<Rendezvous>, reply: Reply<pb::InitResponse> },
    Load { request: pb::LoadShardRequest, progress: Arc<LoadProgress>, reply: Reply<pb::ShardInfo> },
    Step { request: pb::GenerateStepRequest, span: tracing::Span, reply: Reply<pb::GenerateStepResponse> },
    ClearKv { request: pb::ClearKvRequest, reply: Reply<pb::ClearKvResponse> },
    Unload { request: pb::UnloadRequest, reply: Reply<pb::UnloadResponse> },
}

/// What the gRPC side may read without going through the worker queue (Info must answer even
/// while a long step runs).
#[derive(Default)]
pub struct SharedState {
    pub initialized: bool,
    pub rank: u32,
    pub world_size: u32,
    pub epoch: u64,
    /// the newest epoch an Init has asked for; queued Inits of older epochs are skipped
    pub requested_epoch: u64,
    pub loaded_models: Vec<String>,
    /// the live communicator, so a newer Init can abort it even while the worker is blocked in it
    pub communicator: Option<Arc<dyn Collective>>,
    /// (total, free) bytes of a CUDA device's memory, read by the worker (None on the CPU)
    pub device_memory: Option<(u64, u64)>,
}

pub struct WorkerConfig {
    pub device: Device,
    pub metrics: Arc<crate::metrics::RankMetrics>,
    /// KV cache budget in bytes per loaded model; None: a share of the memory available after
    /// loading the weights
    pub kv_cache_bytes: Option<u64>,
    pub default_init_timeout: Duration,
    pub collective_timeout: Duration,
}

/// Starts the worker thread and returns the queue that feeds it.
pub fn spawn(config: WorkerConfig, shared: Arc<Mutex<SharedState>>) -> std::io::Result<std::sync::mpsc::Sender<Command>> {
    let (sender, receiver) = std::sync::mpsc::channel::<Command>();
    // The worker loop runs on a thread of the compute pool, so that the products it starts run
    // in the pool without a sleep and wake-up each (see model::compute_pool).
    let pool = crate::model::compute_pool::pool("device-worker")?;
    std::thread::Builder::new().name("device-worker".into()).spawn(move || pool.install(move || {
        let mut worker = Worker { config, shared, group: None, models: HashMap::new() };
        worker.publish_device_memory();
        while let Ok(command) = receiver.recv() {
            // A panic leaves the device state (caches half-written, a collective half-run)
            // unknowable, and a rank whose worker is gone would still answer Info and liveness
            // as if healthy. So a panic ends the process: `serve`, Kubernetes or systemd start a
            // fresh one and the coordinator recovers the group, as for any lost rank.
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.handle(command)));
            if let Err(payload) = handled {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".into());
                tracing::error!(panic = %message, exit_code = EXIT_WORKER_PANIC, "the device worker panicked; ending the rank process so that it is restarted");
                std::process::exit(EXIT_WORKER_PANIC);
            }
            worker.publish_device_memory();
        }
    }))?;
    Ok(sender)
}

/// Exit status of a rank whose device worker panicked (EX_SOFTWARE).
pub const EXIT_WORKER_PANIC: i32 = 70;

struct Worker {
    config: WorkerConfig,
    shared: Arc<Mutex<SharedState>>,
    group: Option<TpGroup>,
    models: HashMap<String, Shard>,
}

/// A loaded model on this rank with the per-sequence state that goes with it.
struct Shard {
    model: Model,
    caches: CacheStore,
    /// sampling-rank state per sequence
    sequences: HashMap<u64, SequenceTokens>,
}

/// The tokens a sequence has been fed, for penalties, and its sampler.
#[derive(Default)]
struct SequenceTokens {
    tokens: Vec<u32>,
    sampler: Option<Sampler>,
    /// tokens[..observed] have been shown to the sampler
    observed: usize,
}

impl Worker {
    /// KV cache blocks from the configured budget, or, without one, half of the memory
    /// available now divided by the group size (on one host the ranks share that memory); on a
    /// GPU, half of its free memory (no other rank uses it). Recurrent state is paid for out of
    /// the same blocks (the coordinator counts it in block units).
    fn kv_blocks(&self, block_bytes: u64, world_size: usize) -> u64 {
        let budget = self.config.kv_cache_bytes.unwrap_or_else(|| match self.device_memory() {
            Some((_, free)) => free / 2,
            None => available_memory_bytes() / 2 / world_size.max(1) as u64,
        });
        budget / block_bytes.max(1)
    }

    /// (total, free) memory of a CUDA device; None on the CPU. Only this thread may ask: the
    /// query needs the device's context.
    fn device_memory(&self) -> Option<(u64, u64)> {
        #[cfg(feature = "cuda")]
        return crate::comm::nccl::device_memory(&self.config.device);
        #[cfg(not(feature = "cuda"))]
        None
    }

    fn publish_device_memory(&self) {
        if let Some(memory) = self.device_memory() {
            self.shared().device_memory = Some(memory);
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Init { request, rendezvous, reply } => {
                let _ = reply.send(self.init(request, rendezvous));
            }
            Command::Load { request, progress, reply } => {
                let _ = reply.send(self.load(request, progress));
            }
            Command::Step { request, span, reply } => {
                let _entered = span.enter();
                let _ = reply.send(self.step(request));
            }
            Command::ClearKv { request, reply } => {
                let _ = reply.send(self.clear_kv(request));
            }
            Command::Unload { request, reply } => {
                let removed = self.models.remove(&request.model_id).is_some();
                self.publish_models();
                let _ = reply.send(if removed {
                    Ok(pb::UnloadResponse {})
                } else {
                    Err(Error::model_not_loaded(&request.model_id))
                });
            }
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, SharedState> {
        self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish_models(&self) {
        let mut names: Vec<String> = self.models.keys().cloned().collect();
        names.sort();
        self.shared().loaded_models = names;
    }

    fn init(&mut self, request: pb::InitRequest, rendezvous: Option<Rendezvous>) -> Result<pb::InitResponse, Error> {
        let (rank, world_size) = (request.rank as usize, request.world_size as usize);
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!(
                "rank {rank} is not valid for world size {world_size}"
            )));
        }
        let (current_epoch, requested_epoch) = {
            let shared = self.shared();
            (shared.epoch, shared.requested_epoch)
        };
        if request.epoch < requested_epoch {
            return Err(Error::new(Kind::Superseded, format!(
                "Init for epoch {} was superseded by epoch {requested_epoch} while it waited",
                request.epoch
            )));
        }
        if self.group.is_some() && request.epoch < current_epoch {
            return Err(Error::not_ready(format!(
                "Init epoch {} is older than this rank's epoch {current_epoch}",
                request.epoch
            )));
        }
        // A new epoch replaces everything built on the old communicator: the models hold it.
        if let Some(old) = self.group.take() {
            old.comm.abort();
        }
        self.models.clear();
        {
            let mut shared = self.shared();
            shared.initialized = false;
            shared.communicator = None;
            shared.loaded_models.clear();
        }
        let init_timeout = if request.timeout_ms == 0 {
            self.config.default_init_timeout
        } else {
            Duration::from_millis(request.timeout_ms as u64)
        };
        let started = Instant::now();
        let comm = self.join(&request, rendezvous, init_timeout)?;
        let backend = if self.config.device.is_cuda() { "nccl" } else { "socket" };
        crate::comm::check_sum_of_ones(comm.as_ref(), &self.config.device).map_err(|err| {
            comm.abort();
            Error::collective(format!("rank {rank}: the {backend} communicator failed its check at Init: {err}"))
        })?;
        let comm: Arc<dyn Collective> = Arc::new(crate::comm::timed::TimedCollective::new(comm, self.config.metrics.clone()));
        tracing::info!(rank, world_size, epoch = request.epoch, backend, elapsed = ?started.elapsed(), "joined communicator (checked)");
        self.group = Some(TpGroup::new(comm.clone()));
        let mut shared = self.shared();
        shared.initialized = true;
        shared.rank = rank as u32;
        shared.world_size = world_size as u32;
        shared.epoch = request.epoch;
        shared.communicator = Some(comm);
        Ok(pb::InitResponse { epoch: request.epoch })
    }

    /// Joins the group's communicator: NCCL on a CUDA device, the socket backend on the CPU.
    fn join(
        &self,
        request: &pb::InitRequest,
        rendezvous: Option<Rendezvous>,
        init_timeout: Duration,
    ) -> Result<Arc<dyn Collective>, Error> {
        let (rank, world_size) = (request.rank as usize, request.world_size as usize);
        #[cfg(feature = "cuda")]
        if self.config.device.is_cuda() {
            use crate::comm::nccl::{NcclCollective, NcclId, NcclOptions};
            let id = NcclId::from_bytes(&request.comm_id)
                .map_err(|err| Error::invalid(format!("bad comm_id: {err}")))?;
            // NCCL's kernels stop moments after an abort: a device still busy a collective
            // timeout later is wedged, and the rank exits to be restarted (docs/gpu.md).
            let options = NcclOptions {
                init_timeout,
                op_timeout: self.config.collective_timeout,
                abort_timeout: self.config.collective_timeout,
            };
            let comm = NcclCollective::init(&id, rank, world_size, &self.config.device, options)
                .map_err(|err| Error::collective(format!("NCCL communicator init failed: {err}")))?;
            return Ok(Arc::new(comm));
        }
        let comm_id = CommId::from_bytes(&request.comm_id)
            .map_err(|err| Error::invalid(format!("bad comm_id: {err}")))?;
        let options = SocketOptions { init_timeout, op_timeout: self.config.collective_timeout };
        let comm = SocketCollective::init(&comm_id, rank, world_size, rendezvous, options)
            .map_err(|err| Error::collective(format!("communicator init failed: {err}")))?;
        Ok(Arc::new(comm))
    }

    fn load(&mut self, request: pb::LoadShardRequest, progress: Arc<LoadProgress>) -> Result<pb::ShardInfo, Error> {
        let group = self.group.clone().ok_or_else(not_initialized)?;
        if request.model_id.is_empty() {
            return Err(Error::invalid("model_id must not be empty"));
        }
        let (dtype, quant) = crate::model::parse_load_dtype(&request.dtype, &request.quantize, &self.config.device, Path::new(&request.model_path))
            .map_err(Error::invalid)?;
        let products = crate::model::parse_matmul_precision(&request.matmul_precision, dtype, quant, &self.config.device).map_err(Error::invalid)?;
        let kv_dtype = crate::model::parse_kv_cache_dtype(&request.kv_cache_dtype, &self.config.device).map_err(Error::invalid)?;
        let options = LoadOptions { dtype, device: self.config.device.clone(), products };
        let path = PathBuf::from(&request.model_path);
        let started = Instant::now();
        let model = Model::load_quantized(&path, &group, &options, quant, progress.clone())
            .map_err(|err| Error::invalid(format!("cannot load {}: {err:#}", path.display())))?;
        let block_size = match request.kv_block_size {
            0 => DEFAULT_BLOCK_SIZE,
            size => size as usize,
        };
        let mut info = shard_info(&model, block_size, kv_dtype);
        // Quantized weights: the format holding most of the matrices' bytes (`q4_1`), which
        // ModelInfo shows; the log has every format's share.
        if quant != crate::model::QuantMode::Off {
            if let Some(format) = progress.main_format() {
                info.dtype = format;
            }
        }
        info.formats = progress.format_summary();
        let budget_blocks = self.kv_blocks(info.kv_block_bytes, group.world_size);
        // A reload keeps the pool the coordinator's ledger counts (block storage is allocated
        // as it is written, so only blocks in use take memory).
        info.kv_blocks = match request.kv_blocks {
            0 => budget_blocks,
            asked => {
                if asked > budget_blocks {
                    tracing::warn!(asked, budget_blocks, "reloading with the block pool the coordinator counts, above this rank's budget now");
                }
                asked
            }
        };
        info.kv_capacity_tokens = info.kv_blocks * block_size as u64;
        tracing::info!(
            model = %request.model_id,
            path = %path.display(),
            dtype = %info.dtype,
            formats = %info.formats,
            weight_bytes = info.weight_bytes,
            kernels = crate::model::quant::kernels::Path::selected().name(),
            kv_blocks = info.kv_blocks,
            kv_cache_dtype = %info.kv_cache_dtype,
            block_size,
            elapsed = ?started.elapsed(),
            "shard loaded"
        );
        // Replacing a model drops its old caches with it.
        let caches = CacheStore::new(BlockPool::new(info.kv_blocks as usize, block_size).with_kv_dtype(kv_dtype));
        self.models.insert(request.model_id, Shard { model, caches, sequences: HashMap::new() });
        self.publish_models();
        Ok(info)
    }

    fn step(&mut self, request: pb::GenerateStepRequest) -> Result<pb::GenerateStepResponse, Error> {
        let started = Instant::now();
        let (rank, epoch) = {
            let shared = self.shared();
            (shared.rank, shared.epoch)
        };
        if self.group.is_none() {
            return Err(not_initialized());
        }
        if request.epoch != epoch {
            return Err(Error::not_ready(format!(
                "step for epoch {} but this rank is in epoch {epoch}",
                request.epoch
            )));
        }
        let shard = self.models.get_mut(&request.model_id).ok_or_else(|| {
            Error::model_not_loaded(&request.model_id)
        })?;
        let inputs: Vec<SequenceInput<'_>> = request
            .sequences
            .iter()
            .map(|seq| SequenceInput {
                seq_id: seq.seq_id,
                tokens: &seq.token_ids,
                start_pos: seq.start_pos as usize,
                sample: seq.sample,
                blocks: &seq.block_table,
                cached_prefix: seq.cached_prefix as usize,
                restore_state: seq.restore_state_block,
                save_state: seq.save_state_block,
                argmax_only: argmax_only(seq),
            })
            .collect();
        check_prefix_tokens(shard, &request.sequences)?;
        // Refuse bad sampling parameters before the forward pass changes any cache.
        let vocab_size = shard.model.config().vocab_size;
        for seq in request.sequences.iter().filter(|s| s.sample) {
            let params = sampling_params(&seq.sampling.clone().unwrap_or_default());
            params.validate(vocab_size).map_err(|reason| {
                Error::invalid(format!("sequence {}: {reason}", seq.seq_id))
            })?;
            refuse_by_fault_injection(seq)?;
        }
        panic_by_fault_injection();
        shard.caches.drop_snapshots(&request.dropped_snapshots);
        let logits = shard.model.step(&inputs, &mut shard.caches).map_err(step_error)?;
        let mut tokens = Vec::new();
        for seq in &request.sequences {
            shard.sequences.entry(seq.seq_id).or_default().record(seq);
        }
        if let Some(logits) = logits {
            let sampling: Vec<&pb::SequenceStep> = request.sequences.iter().filter(|s| s.sample).collect();
            let reading = |err: candle_core::Error| Error::internal(format!("reading logits: {err}"));
            // [sampling sequences, vocab] on the host, read in place (a copy per row was 2 MB a
            // step at 16 sequences of a 32,000-token vocabulary)
            let logits = logits.to_device(&Device::Cpu).and_then(|l| l.to_dtype(DType::F32)?.contiguous()).map_err(reading)?;
            let (rows, vocab) = logits.dims2().map_err(reading)?;
            if rows != sampling.len() || vocab == 0 {
                return Err(Error::internal(format!("{rows} rows of {vocab} logits for {} sampled sequences", sampling.len())));
            }
            let sampled = with_host_f32(&logits, |all| sample_rows(&mut shard.sequences, all, vocab, &sampling))
            .map_err(reading)?
            .ok_or_else(|| Error::internal("the logits are not f32 on the host"))??;
            tokens.extend(sampled);
        }
        Ok(pb::GenerateStepResponse {
            step: request.step,
            rank,
            tokens,
            compute_micros: {
                let elapsed = started.elapsed();
                self.config.metrics.step_duration.observe(elapsed);
                elapsed.as_micros() as u64
            },
        })
    }

    fn clear_kv(&mut self, request: pb::ClearKvRequest) -> Result<pb::ClearKvResponse, Error> {
        let shard = self.models.get_mut(&request.model_id).ok_or_else(|| {
            Error::model_not_loaded(&request.model_id)
        })?;
        let cleared = if request.all {
            shard.sequences.clear();
            shard.caches.clear()
        } else {
            request
                .seq_ids
                .iter()
                .filter(|id| {
                    shard.sequences.remove(id);
                    shard.caches.remove(**id)
                })
                .count()
        };
        Ok(pb::ClearKvResponse {
            cleared: cleared as u32,
            remaining_sequences: shard.caches.len() as u32,
            cached_tokens: shard.caches.cached_tokens() as u64,
        })
    }
}

/// A token for each sequence of `sampling` from its row of `logits` ([sampling.len(), vocab]),
/// the rows spread over the compute pool's threads unless every one is greedy without
/// logprobs (one pass for the maximum, which another thread would take longer to pick up).
/// Sampling is passes over a row, and a step's rows one after another kept the pool's other
/// threads idle: 16 rows in the pool, Zen 5, 2 threads, one after another against spread, at
/// temperature 1 1,661 -> 912 µs (151,936 tokens) and 300 -> 194 (32,000), with top_p 0.9
/// 2,240 -> 1,188 and 409 -> 247; greedy 100 -> 78 and 20 -> 30. Each sequence has its own
/// sampler, seeded by sequence and token, so which thread samples a row changes nothing; the
/// step refused a sequence that appears twice, and every sequence of the step has its state
/// (`SequenceTokens::record`).
fn sample_rows(
    states: &mut HashMap<u64, SequenceTokens>,
    logits: &[f32],
    vocab: usize,
    sampling: &[&pb::SequenceStep],
) -> Result<Vec<pb::SampledToken>, Error> {
    let rows: HashMap<u64, usize> = sampling.iter().enumerate().map(|(row, seq)| (seq.seq_id, row)).collect();
    let mut owned: Vec<Option<&mut SequenceTokens>> = (0..sampling.len()).map(|_| None).collect();
    for (id, state) in states.iter_mut() {
        if let Some(&row) = rows.get(id) {
            owned[row] = Some(state);
        }
    }
    let jobs: Vec<_> = owned.into_iter().zip(logits.chunks_exact(vocab)).zip(sampling).collect();
    let sample = |((state, row), seq): ((Option<&mut SequenceTokens>, &[f32]), &&pb::SequenceStep)| {
        let state = state.ok_or_else(|| Error::internal(format!("sequence {} has no sampling state", seq.seq_id)))?;
        let params = seq.sampling.clone().unwrap_or_default();
        let values: std::borrow::Cow<'_, [f32]> = if params.suppressed_token_ids.is_empty() {
            row.into()
        } else {
            let mut values = row.to_vec();
            for &id in &params.suppressed_token_ids {
                if let Some(v) = values.get_mut(id as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
            values.into()
        };
        state.sample(seq, &params, &values)
    };
    let one_pass = |seq: &pb::SequenceStep| {
        seq.sampling.as_ref().is_none_or(|p| sampling_params(p).is_greedy() && !p.logprobs && p.top_logprobs == 0)
    };
    if sampling.iter().all(|seq| one_pass(seq)) {
        jobs.into_iter().map(sample).collect()
    } else {
        jobs.into_par_iter().map(sample).collect()
    }
}

impl SequenceTokens {
    /// Tracks the tokens fed to the sequence; a rewind (start_pos before the end) forgets the
    /// sampler so it is rebuilt from the surviving history.
    fn record(&mut self, seq: &pb::SequenceStep) {
        let start = seq.start_pos as usize;
        if self.tokens.is_empty() && start > 0 && seq.cached_token_ids.len() == start {
            self.tokens.extend_from_slice(&seq.cached_token_ids);
        }
        if start < self.tokens.len() {
            self.tokens.truncate(start);
            self.sampler = None;
            self.observed = 0;
        }
        self.tokens.extend_from_slice(&seq.token_ids);
    }

    fn sample(&mut self, seq: &pb::SequenceStep, params: &pb::SamplingParams, logits: &[f32]) -> Result<pb::SampledToken, Error> {
        let prompt_len = (seq.prompt_len as usize).min(self.tokens.len());
        if self.sampler.is_none() {
            // The chosen token's logprob costs a vocabulary-wide pass: only when asked.
            let sampler = Sampler::new(sampling_params(params), &self.tokens[..prompt_len]).with_logprob(params.logprobs);
            self.sampler = Some(sampler);
            self.observed = prompt_len;
        }
        let Some(sampler) = self.sampler.as_mut() else {
            return Err(Error::internal("sampler missing"));
        };
        if self.observed < self.tokens.len() {
            sampler.observe(&self.tokens[self.observed..]);
            self.observed = self.tokens.len();
        }
        let sampled = sampler.sample(logits);
        Ok(pb::SampledToken {
            seq_id: seq.seq_id,
            token_id: sampled.token_id,
            logprob: sampled.logprob,
            top_logprobs: sampled
                .top_logprobs
                .into_iter()
                .map(|(token_id, logprob)| pb::TokenLogprob { token_id, logprob })
                .collect(),
        })
    }
}

/// The token ids a sampling sequence's sampler never picks, where it reads nothing else of its
/// logits but the largest (`SequenceInput::argmax_only`): then the model may compute only the
/// values that can be the largest.
fn argmax_only(seq: &pb::SequenceStep) -> Option<&[u32]> {
    match &seq.sampling {
        _ if !seq.sample => None,
        None => Some(&[]),
        Some(p) => (sampling_params(p).reads_only_the_maximum() && !p.logprobs).then_some(p.suppressed_token_ids.as_slice()),
    }
}

/// proto3 cannot tell 0 from unset: top_p and repetition_penalty of 0 (meaningless values)
/// mean "off", as an unset field would.
fn sampling_params(p: &pb::SamplingParams) -> SamplingParams {
    let unset_is_one = |v: f32| if v == 0.0 { 1.0 } else { v };
    SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: unset_is_one(p.top_p),
        min_p: p.min_p,
        repetition_penalty: unset_is_one(p.repetition_penalty),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        top_logprobs: p.top_logprobs,
    }
}

/// A sequence that starts from a cached prefix brings the prefix's token ids, which its
/// sampler's penalties count; without them they would silently count only the rest. (The
/// memory guard is the block pool: every block id of a step is checked against its size.)
fn check_prefix_tokens(shard: &Shard, steps: &[pb::SequenceStep]) -> Result<(), Error> {
    for seq in steps.iter().filter(|s| s.cached_prefix > 0 && !shard.sequences.contains_key(&s.seq_id)) {
        if seq.cached_token_ids.len() != seq.cached_prefix as usize {
            return Err(Error::invalid(format!(
                "sequence {} resumes from a cached prefix of {} tokens but carries {} of its token ids",
                seq.seq_id,
                seq.cached_prefix,
                seq.cached_token_ids.len()
            )));
        }
    }
    Ok(())
}

/// Fault injection for tests (docs/reliability.md): with `TPSERVE_FAULT_REFUSE_SEED=N` in its
/// environment, a rank refuses every step that samples a sequence seeded N, before the forward
/// pass, as it refuses any bad request. That is the request-level rank error a coordinator must
/// fail alone, which a coordinator that validates its requests never causes otherwise.
fn refuse_by_fault_injection(seq: &pb::SequenceStep) -> Result<(), Error> {
    static SEED: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| std::env::var("TPSERVE_FAULT_REFUSE_SEED").ok().and_then(|v| v.parse().ok()));
    match (seed, &seq.sampling) {
        (Some(seed), Some(params)) if params.seed == seed => Err(Error::invalid(format!(
            "sequence {}: refused by fault injection (TPSERVE_FAULT_REFUSE_SEED={seed})",
            seq.seq_id
        ))),
        _ => Ok(()),
    }
}

/// Fault injection for tests (docs/reliability.md): with `TPSERVE_FAULT_PANIC_FILE=PATH` in
/// its environment, the first rank to find that file at a step removes it and panics, as a bug
/// in a kernel would. Removing is atomic, so exactly one rank panics per file the test creates.
fn panic_by_fault_injection() {
    static PATH: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    if let Some(path) = PATH.get_or_init(|| std::env::var_os("TPSERVE_FAULT_PANIC_FILE").map(PathBuf::from)) {
        if std::fs::remove_file(path).is_ok() {
            panic!("panic by fault injection (TPSERVE_FAULT_PANIC_FILE={})", path.display());
        }
    }
}

fn not_initialized() -> Error {
    Error::not_ready("this rank has not joined a communicator yet (Init first)")
}

/// A step refused before the forward pass is the request's fault (INVALID_ARGUMENT: the
/// coordinator fails that request alone); a collective failure means the group is broken
/// (UNAVAILABLE); a forward pass that failed otherwise left this rank's caches of the batch
/// dropped and its peers possibly inside a collective (INTERNAL). The last two make the
/// coordinator recover the group.
fn step_error(err: anyhow::Error) -> Error {
    let is_comm = err.chain().any(|cause| cause.downcast_ref::<crate::comm::CommError>().is_some());
    let refused = err.chain().any(|cause| cause.downcast_ref::<crate::model::InvalidStep>().is_some());
    if is_comm {
        Error::collective(format!("collective failed: {err:#}"))
    } else if refused {
        Error::invalid(format!("{err:#}"))
    } else {
        Error::internal(format!("{err:#}"))
    }
}

fn shard_info(model: &Model, block_size: usize, kv_dtype: Option<DType>) -> pb::ShardInfo {
    let config = model.config();
    let per_token = model.kv_bytes_per_token(kv_dtype) as u64;
    pb::ShardInfo {
        model_type: config.model_type.clone(),
        vocab_size: config.vocab_size as u32,
        max_context: config.max_position_embeddings as u32,
        dtype: format!("{:?}", model.dtype()).to_lowercase(),
        weight_bytes: model.weight_bytes() as u64,
        kv_bytes_per_token: per_token,
        kv_capacity_tokens: 0,
        kv_block_size: block_size as u32,
        kv_blocks: 0,
        kv_block_bytes: per_token * block_size as u64,
        recurrent_state_bytes: model.recurrent_state_bytes() as u64,
        formats: String::new(),
        kv_cache_dtype: format!("{:?}", kv_dtype.unwrap_or(model.compute_dtype())).to_lowercase(),
    }
}

fn available_memory_bytes() -> u64 {
    memory_info().1
}

/// (MemTotal, MemAvailable) in bytes from /proc/meminfo; zeros where unavailable.
pub fn memory_info() -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return (0, 0) };
    let field = |name: &str| {
        text.lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}
