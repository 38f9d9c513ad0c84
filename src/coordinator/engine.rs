//! The step loop of one served model: continuous batching over the ranks.
//!
//! Each iteration admits waiting requests, builds one GenerateStep from every running
//! sequence (a decode token, or the next prefill chunk), fans it out to all ranks, and routes
//! rank 0's sampled tokens back to the clients. Detokenization and stop conditions run here, so
//! a sequence stops the step after it finishes, and its caches are freed on every rank.
//!
//! The loop never waits on a client (see `stream`), and a failed step is handled by how far it
//! reaches: a step the ranks refused fails the request at fault alone; a lost rank or a failed
//! collective recovers the group, after which every model's sequences re-prefill in the new
//! epoch. Unloading the model cancels its requests and ends the loop.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

mod admission;

use admission::Prefix;

use super::blocks::{BlockManager, SeqBlocks};
use super::detokenizer::IncrementalDecoder;
use super::error::{Error, Kind};
use super::ranks::{RankFailure, StepError};
use super::stop::{StopMatcher, StopSet};
use super::stream::{ClientSender, Push};
use super::{ModelHandle, Supervisor};
use crate::proto::rank::v1 as rank_pb;
use crate::proto::v1 as pb;

/// A validated request, ready to run.
pub struct NewRequest {
    /// the request's root span (its trace); closes when the request ends
    pub span: tracing::Span,
    /// open while the request waits for admission
    pub queue_span: tracing::Span,
    /// when the service accepted it, for TTFT and end-to-end latency
    pub arrived: Instant,
    pub prompt_ids: Vec<u32>,
    /// from the client's grpc-timeout: the stream ends with DEADLINE_EXCEEDED past it
    pub deadline: Option<Instant>,
    pub sampling: rank_pb::SamplingParams,
    /// already clamped so that prompt + max_tokens fits the context
    pub max_tokens: usize,
    pub stop: Arc<StopSet>,
    pub ignore_eos: bool,
    pub responses: ClientSender,
}

/// Limits of one step, and of the queue in front of it.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_batch_sequences: usize,
    pub max_batch_tokens: usize,
    /// also the most prefill tokens in one step, so a long prompt delays running streams by
    /// at most one chunk
    pub prefill_chunk: usize,
    /// requests waiting for admission beyond this are refused with RESOURCE_EXHAUSTED
    pub max_waiting: usize,
    /// step deadline: base plus a per-token allowance, so a long prefill is not mistaken for a hang
    pub step_timeout_base: Duration,
    pub step_timeout_per_token: Duration,
    /// automatic prefix caching (--prefix-cache)
    pub prefix_cache: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_sequences: 64,
            max_batch_tokens: 2048,
            prefill_chunk: 512,
            max_waiting: 256,
            step_timeout_base: Duration::from_secs(10),
            step_timeout_per_token: Duration::from_millis(50),
            prefix_cache: true,
        }
    }
}

/// Counters ModelInfo reports.
#[derive(Debug, Default)]
pub struct ModelStats {
    pub requests_total: AtomicU64,
    pub requests_cancelled_total: AtomicU64,
    pub sequences_freed_total: AtomicU64,
    pub active_sequences: AtomicU64,
    pub kv_cached_tokens: AtomicU64,
    /// KV tokens of the blocks committed to admitted sequences (prompt + max_tokens each,
    /// shared prefix blocks counted once)
    pub kv_reserved_tokens: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_cached: AtomicU64,
    pub kv_blocks_reserved: AtomicU64,
    pub kv_state_blocks: AtomicU64,
    /// prompt tokens looked up in the prefix cache, and those found
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    /// requests queued but not admitted; the service increments it, the engine decrements
    pub waiting: AtomicU64,
    pub steps_total: AtomicU64,
    /// recent per-step overheads in µs (round trip minus rank compute), newest last
    pub step_overheads_us: std::sync::Mutex<VecDeque<f64>>,
}

/// How many recent steps the overhead percentiles cover.
const OVERHEAD_WINDOW: usize = 4096;

impl ModelStats {
    fn record_overhead(&self, micros: f64) {
        self.steps_total.fetch_add(1, Ordering::Relaxed);
        let mut window = self.step_overheads_us.lock().unwrap_or_else(|p| p.into_inner());
        if window.len() == OVERHEAD_WINDOW {
            window.pop_front();
        }
        window.push_back(micros);
    }

    /// (p50, p99) of the recent step overheads in µs; zeros before the first step.
    pub fn overhead_percentiles(&self) -> (f64, f64) {
        let mut values: Vec<f64> = self.step_overheads_us.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
        if values.is_empty() {
            return (0.0, 0.0);
        }
        values.sort_by(f64::total_cmp);
        let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
        (at(0.5), at(0.99))
    }
}

struct Sequence {
    seq_id: u64,
    span: tracing::Span,
    /// open from admission to the first token
    prefill_span: Option<tracing::Span>,
    arrived: Instant,
    /// when the last token was streamed (None before the first)
    last_token_at: Option<Instant>,
    deadline: Option<Instant>,
    /// its KV blocks; None while it waits to be re-admitted after a new epoch
    blocks: Option<SeqBlocks>,
    /// the prefix-cache hit it was admitted with
    prefix: Prefix,
    /// a snapshot the step in flight takes, until that step succeeds
    pending_snapshot: Option<u32>,
    /// times this sequence was re-prefilled after a rank failure
    resumes: u32,
    /// prompt followed by generated tokens
    tokens: Vec<u32>,
    prompt_len: usize,
    /// tokens[..processed] are in the ranks' caches
    processed: usize,
    max_tokens: usize,
    ignore_eos: bool,
    sampling: rank_pb::SamplingParams,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    responses: ClientSender,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Positions the ranks may ever hold for it.
    fn reservation(&self) -> usize {
        self.prompt_len + self.max_tokens
    }
}

enum Finish {
    Running,
    Done,
    /// the client has gone away
    Cancelled,
    /// the client fell too far behind and the stream was cut off
    CutOff,
}

pub struct Engine {
    model: Arc<ModelHandle>,
    supervisor: Arc<Supervisor>,
    config: SchedulerConfig,
    requests: mpsc::Receiver<NewRequest>,
    /// becomes true when the model is being unloaded
    unloading: watch::Receiver<bool>,
    waiting: VecDeque<NewRequest>,
    running: Vec<Sequence>,
    next_seq_id: u64,
    step: u64,
    /// the ranks' KV blocks: reservations, block tables, the prefix cache
    blocks: BlockManager,
    /// the communicator epoch the running sequences' caches live in
    cache_epoch: u64,
}

impl Engine {
    pub fn new(
        model: Arc<ModelHandle>,
        supervisor: Arc<Supervisor>,
        config: SchedulerConfig,
        requests: mpsc::Receiver<NewRequest>,
    ) -> Self {
        let unloading = model.unloading.subscribe();
        let cache_epoch = supervisor.epoch();
        // Prefix keys include the model's files and dtype: another model never matches.
        let key = format!("{}\0{}\0{}", model.id, model.path.display(), model.dtype);
        let blocks = BlockManager::new(model.pool, model.prefix_cache, &key);
        Self {
            model,
            supervisor,
            config,
            requests,
            unloading,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_seq_id: 1,
            step: 0,
            blocks,
            cache_epoch,
        }
    }

    /// Runs until the model is unloaded (or its request queue closes and no work is left).
    pub async fn run(mut self) {
        loop {
            let unloading = *self.unloading.borrow();
            if unloading {
                self.cancel_for_unload();
                tracing::info!(model = %self.model.id, "model unloaded; its step loop ends");
                return;
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                tokio::select! {
                    request = self.requests.recv() => match request {
                        Some(request) => self.waiting.push_back(request),
                        None => return,
                    },
                    _ = self.unloading.changed() => continue,
                }
            }
            while let Ok(request) = self.requests.try_recv() {
                self.waiting.push_back(request);
            }
            self.expire_waiting();
            self.admit();
            self.drop_cancelled().await;
            if self.running.is_empty() {
                if !self.waiting.is_empty() {
                    // Nothing runs, yet the head of the queue does not fit: it never will.
                    self.refuse_unfittable();
                }
                continue;
            }
            self.follow_epoch();
            let plan = self.plan_step();
            if plan.is_empty() {
                // Every running sequence waits for blocks (after an epoch) or failed planning.
                tokio::task::yield_now().await;
                continue;
            }
            match self.run_step(&plan).await {
                Ok(()) | Err(StepError::StaleEpoch) => {}
                Err(StepError::Refused(failure)) => self.isolate_refusal(plan, failure).await,
                Err(StepError::Group(failure)) => self.recover(failure).await,
                Err(StepError::Unavailable(reason)) => self.fail_running(&Error::unavailable(reason)),
            }
        }
    }

    /// Ends waiting requests whose deadline passed.
    fn expire_waiting(&mut self) {
        let now = Instant::now();
        let (expired, waiting): (VecDeque<NewRequest>, VecDeque<NewRequest>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|r| r.deadline.is_some_and(|d| d <= now));
        self.waiting = waiting;
        for mut request in expired {
            self.model.metrics.failure("deadline");
            self.model.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            self.model.stats.requests_cancelled_total.fetch_add(1, Ordering::Relaxed);
            request.responses.fail(Error::new(Kind::Deadline, "the request's deadline passed while it waited for admission"));
        }
    }

    /// Ends every queued and running request: the model is being unloaded. Its caches go with
    /// the model on the ranks, so nothing is freed one by one.
    fn cancel_for_unload(&mut self) {
        self.requests.close();
        while let Ok(request) = self.requests.try_recv() {
            self.waiting.push_back(request);
        }
        let status = Error::unavailable(format!(
            "model \"{}\" is being unloaded; the request was cancelled (see Admin.ListModels)",
            self.model.id
        ));
        for mut request in self.waiting.drain(..) {
            self.model.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            self.model.metrics.failure("unloaded");
            request.responses.fail(status.clone());
        }
        for seq in &mut self.running {
            self.model.metrics.failure("unloaded");
            seq.responses.fail(status.clone());
        }
        self.running.clear();
        self.blocks.reset();
        self.publish_occupancy();
    }

    /// Frees the sequences whose clients went away, or whose deadline passed, before the next
    /// step spends work on them.
    async fn drop_cancelled(&mut self) {
        let now = Instant::now();
        let (mut ended, running): (Vec<Sequence>, Vec<Sequence>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.responses.is_closed() || s.deadline.is_some_and(|d| d <= now));
        self.running = running;
        if ended.is_empty() {
            return;
        }
        self.model.stats.requests_cancelled_total.fetch_add(ended.len() as u64, Ordering::Relaxed);
        tracing::info!(count = ended.len(), "clients went away or deadlines passed; freeing their sequences");
        for seq in &mut ended {
            let expired = seq.deadline.is_some_and(|d| d <= now);
            self.model.metrics.failure(if expired { "deadline" } else { "cancelled" });
            if expired {
                seq.responses.fail(Error::new(Kind::Deadline, "the request's deadline passed"));
            }
        }
        self.release(&mut ended);
        self.free(ended.iter().map(|s| s.seq_id).collect()).await;
    }

    async fn run_step(&mut self, sequences: &[rank_pb::SequenceStep]) -> Result<(), StepError> {
        let tokens: usize = sequences.iter().map(|s| s.token_ids.len()).sum();
        self.step += 1;
        let dropped = self.blocks.take_dropped();
        let request = rank_pb::GenerateStepRequest {
            model_id: self.model.id.clone(),
            step: self.step,
            epoch: self.cache_epoch,
            sequences: sequences.to_vec(),
            dropped_snapshots: dropped.clone(),
        };
        let deadline = self.config.step_timeout_base + self.config.step_timeout_per_token * tokens as u32;
        let started = Instant::now();
        // One span per sequence in its own trace; the ranks' spans hang under the first one
        // (a step serves several traces, and gRPC metadata carries one parent).
        let step_spans: Vec<tracing::Span> = sequences
            .iter()
            .filter_map(|planned| self.running.iter().find(|s| s.seq_id == planned.seq_id).map(|seq| (planned, seq)))
            .map(|(planned, seq)| tracing::info_span!(parent: &seq.span, "step", step = self.step, tokens = planned.token_ids.len()))
            .collect();
        let response = match self.supervisor.step(request, deadline, step_spans.first()).await {
            Ok(response) => response,
            Err(err) => {
                // Not dropped yet: a refused step changes nothing on the ranks.
                self.blocks.requeue_dropped(dropped);
                return Err(err);
            }
        };
        drop(step_spans);
        let round_trip = started.elapsed();
        let overhead_us = round_trip.as_secs_f64() * 1e6 - response.compute_micros as f64;
        self.model.stats.record_overhead(overhead_us.max(0.0));
        tracing::trace!(step = self.step, tokens, ?round_trip, compute_us = response.compute_micros, "step");
        for planned in sequences {
            if let Some(seq) = self.running.iter_mut().find(|s| s.seq_id == planned.seq_id) {
                seq.processed += planned.token_ids.len();
                if let (false, Some(id)) = (seq.prefix.on_ranks, seq.prefix.restore) {
                    self.blocks.restored(id);
                }
                seq.prefix.on_ranks = true;
                seq.pending_snapshot = None;
                if let Some(blocks) = seq.blocks.as_mut() {
                    self.blocks.register(blocks, &seq.tokens, seq.processed);
                }
            }
        }
        let mut finished = Vec::new();
        for sampled in response.tokens {
            let Some(index) = self.running.iter().position(|s| s.seq_id == sampled.seq_id) else { continue };
            let outcome = self.accept_token(index, &sampled);
            let label = match outcome {
                Finish::Running => continue,
                Finish::Done => None,
                Finish::Cancelled => Some("cancelled"),
                Finish::CutOff => Some("slow_client"),
            };
            if let Some(label) = label {
                self.model.stats.requests_cancelled_total.fetch_add(1, Ordering::Relaxed);
                self.model.metrics.failure(label);
            }
            finished.push(self.running.swap_remove(index));
        }
        self.release(&mut finished);
        if !finished.is_empty() {
            self.free(finished.iter().map(|s| s.seq_id).collect()).await;
        }
        Ok(())
    }

    /// Appends a sampled token, streams its text, and decides whether the sequence is done.
    fn accept_token(&mut self, index: usize, sampled: &rank_pb::SampledToken) -> Finish {
        let max_context = self.model.max_context;
        let eos = &self.model.eos_token_ids;
        let metrics = self.model.metrics.clone();
        let seq = &mut self.running[index];
        seq.tokens.push(sampled.token_id);
        metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        match seq.last_token_at {
            None => metrics.time_to_first_token.observe(now - seq.arrived),
            Some(last) => metrics.inter_token_latency.observe(now - last),
        }
        seq.last_token_at = Some(now);
        seq.prefill_span = None;
        if !seq.ignore_eos && eos.contains(&sampled.token_id) {
            return finish(seq, pb::FinishReason::Eos, &metrics);
        }
        let detokenize = tracing::info_span!(parent: &seq.span, "detokenize");
        let decoded = detokenize.in_scope(|| seq.decoder.push(sampled.token_id).map(|delta| seq.stop.push(&delta)));
        let outcome = match decoded {
            Ok(outcome) => outcome,
            Err(err) => {
                seq.responses.fail(Error::internal(format!("detokenization failed: {err:#}")));
                return Finish::Cancelled;
            }
        };
        let message = pb::GenerateResponse {
            token_id: Some(sampled.token_id),
            text: outcome.emit,
            logprob: seq.sampling.logprobs.then_some(sampled.logprob),
            top_logprobs: sampled
                .top_logprobs
                .iter()
                .map(|t| pb::TokenLogprob { token_id: t.token_id, logprob: t.logprob })
                .collect(),
            finish_reason: pb::FinishReason::Unspecified as i32,
            ..Default::default()
        };
        match seq.responses.push(message) {
            Push::Sent => {}
            Push::Gone => return Finish::Cancelled,
            Push::Behind => {
                let behind = seq.responses.capacity();
                tracing::warn!(seq_id = seq.seq_id, behind, "a client stopped reading its stream; cutting it off");
                seq.responses.fail(Error::capacity(format!(
                    "the client fell {behind} messages behind the stream and it was cut off (--stream-buffer); \
                     read the stream as it arrives"
                )));
                return Finish::CutOff;
            }
        }
        if outcome.stopped {
            return finish(seq, pb::FinishReason::StopSequence, &metrics);
        }
        if seq.tokens.len() >= max_context {
            return finish(seq, pb::FinishReason::ContextLength, &metrics);
        }
        if seq.generated() >= seq.max_tokens {
            return finish(seq, pb::FinishReason::Length, &metrics);
        }
        Finish::Running
    }

    async fn free(&self, seq_ids: Vec<u64>) {
        let count = seq_ids.len() as u64;
        let request = rank_pb::ClearKvRequest { model_id: self.model.id.clone(), seq_ids, all: false };
        match self.supervisor.clear_kv(request).await {
            Ok(_) => {
                self.model.stats.sequences_freed_total.fetch_add(count, Ordering::Relaxed);
            }
            Err(failure) => tracing::warn!(%failure, "could not free sequences; they are dropped with the next epoch"),
        }
    }

    /// Every rank refused a step before running it. Alone in its step, the request is at fault
    /// and fails with the rank's status; in a batch, each sequence runs alone once to find it
    /// (a refused step changed no cache, so repeating it is safe).
    async fn isolate_refusal(&mut self, plan: Vec<rank_pb::SequenceStep>, failure: RankFailure) {
        if let [only] = plan.as_slice() {
            self.refuse_sequence(only.seq_id, &failure).await;
            return;
        }
        tracing::warn!(%failure, sequences = plan.len(), "the ranks refused a batched step; running its sequences one by one");
        for planned in plan {
            if !self.running.iter().any(|s| s.seq_id == planned.seq_id) {
                continue;
            }
            match self.run_step(std::slice::from_ref(&planned)).await {
                Ok(()) => {}
                Err(StepError::Refused(failure)) => self.refuse_sequence(planned.seq_id, &failure).await,
                Err(StepError::StaleEpoch) => return,
                Err(StepError::Group(failure)) => return self.recover(failure).await,
                Err(StepError::Unavailable(reason)) => return self.fail_running(&Error::unavailable(reason)),
            }
        }
    }

    /// Fails one request with the status its step was refused with.
    async fn refuse_sequence(&mut self, seq_id: u64, failure: &RankFailure) {
        let Some(index) = self.running.iter().position(|s| s.seq_id == seq_id) else { return };
        let mut seq = self.running.swap_remove(index);
        tracing::warn!(seq_id, %failure, "the ranks refused a request; failing it alone");
        self.model.metrics.failure("rank_refused");
        seq.responses.fail(Error::from_rank(&format!("rank {} refused the request", failure.rank), &failure.status));
        self.release(std::slice::from_mut(&mut seq));
        if seq.prefix.on_ranks {
            self.free(vec![seq.seq_id]).await;
        }
    }

    /// A rank was lost or hung, or a collective failed. The supervisor rebuilds the group (new
    /// epoch, shards reloaded); the sequences then resume in the new epoch (`follow_epoch`).
    /// Past the recovery deadline, requests end with UNAVAILABLE.
    async fn recover(&mut self, failure: RankFailure) {
        tracing::error!(%failure, running = self.running.len(), "step failed; recovering the ranks");
        let reason = failure.to_string();
        if !self.supervisor.recover(self.cache_epoch, &reason).await {
            self.fail_running(&Error::new(
                Kind::RankUnavailable,
                format!("a rank failed ({reason}) and the ranks did not recover in time; retry later"),
            ));
        }
    }

    fn fail_running(&mut self, error: &Error) {
        let mut failed = std::mem::take(&mut self.running);
        for seq in &mut failed {
            self.model.metrics.failure("rank_failure");
            seq.responses.fail(error.clone());
        }
        self.release(&mut failed);
    }

    /// After the group moved to a new epoch (this model's failure or another's, or the
    /// watchdog's), the caches of the old one are gone: every running sequence resumes by
    /// re-prefilling its prompt plus the tokens already streamed. The client sees a pause, not
    /// an error, and the output is what it would have been (sampling draws depend only on the
    /// seed and the token index). A sequence interrupted too often is failed.
    fn follow_epoch(&mut self) {
        let epoch = self.supervisor.epoch();
        if epoch == self.cache_epoch {
            return;
        }
        self.cache_epoch = epoch;
        // The ranks dropped every cache and snapshot with the old epoch.
        self.blocks.reset();
        let (resumable, mut exhausted): (Vec<Sequence>, Vec<Sequence>) =
            std::mem::take(&mut self.running).into_iter().partition(|s| s.processed == 0 || s.resumes < MAX_RESUMES);
        for seq in &mut exhausted {
            self.model.metrics.failure("rank_failure");
            seq.responses.fail(Error::new(
                Kind::RankUnavailable,
                format!("generation was interrupted by rank failures {MAX_RESUMES} times; giving up"),
            ));
        }
        drop(exhausted);
        self.running = resumable;
        let mut resumed = 0;
        for seq in &mut self.running {
            if seq.processed > 0 {
                seq.resumes += 1;
                resumed += 1;
            }
            // Blocks again (and a prefix hit, maybe) from `readmit`, before the next step.
            seq.processed = 0;
            seq.blocks = None;
            seq.pending_snapshot = None;
            seq.prefix = Prefix::default();
        }
        self.readmit();
        tracing::info!(model = %self.model.id, epoch, resumed, "new communicator epoch; resuming sequences");
        self.publish_occupancy();
    }
}

/// How often one sequence may be resumed after rank failures before it is failed.
const MAX_RESUMES: u32 = 3;

/// Ends the stream with what text was held back, the finish reason and usage. The last message
/// never waits for buffer room, so a finishing stream is never cut off.
fn finish(seq: &mut Sequence, reason: pb::FinishReason, metrics: &crate::metrics::CoordinatorMetrics) -> Finish {
    if seq.responses.is_closed() {
        return Finish::Cancelled;
    }
    let tail = seq.decoder.finish();
    let mut text = String::new();
    if !seq.stop.is_stopped() {
        let outcome = seq.stop.push(&tail);
        text.push_str(&outcome.emit);
        if !outcome.stopped {
            text.push_str(&seq.stop.finish());
        }
    }
    let message = pb::GenerateResponse {
        token_id: None,
        text,
        logprob: None,
        top_logprobs: Vec::new(),
        finish_reason: reason as i32,
        usage: Some(pb::Usage { prompt_tokens: seq.prompt_len as u32, completion_tokens: seq.generated() as u32 }),
        ..Default::default()
    };
    seq.responses.end(Ok(message));
    metrics.e2e_request_latency.observe(seq.arrived.elapsed());
    Finish::Done
}
