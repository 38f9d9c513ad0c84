//! The coordinator's view of its ranks: connecting (patiently, since sidecars start in any
//! order), the communicator bootstrap, and fanning every call out to all ranks at once.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::future::try_join_all;
use tonic::transport::Channel;

use tonic::service::interceptor::InterceptedService;

use super::error::{Error, Kind};
use crate::auth::{AttachToken, Secret};
use crate::net::{self, Address, ClientTls};
use crate::proto::RANK_PROTOCOL_VERSION;
use crate::proto::rank::v1 as pb;
use crate::proto::rank::v1::rank_client::RankClient;

/// Messages can carry a long prompt's tokens; allow more than tonic's 4 MiB default.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

type Client = RankClient<InterceptedService<Channel, AttachToken>>;

/// How the ranks hold a model's weights and cache: `--dtype`, `--quantize`,
/// `--matmul-precision` and `--kv-cache-dtype`, sent in LoadShard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightFormat {
    pub dtype: String,
    pub quantize: String,
    pub matmul_precision: String,
    pub kv_cache_dtype: String,
}

impl WeightFormat {
    /// Weights in `dtype`, not quantized, with exact products.
    pub fn dtype(dtype: &str) -> WeightFormat {
        WeightFormat { dtype: dtype.to_owned(), ..WeightFormat::default() }
    }
}

#[derive(Clone)]
pub struct RankSet {
    addresses: Vec<Address>,
    clients: Vec<Client>,
}

impl RankSet {
    /// Connects to every rank, retrying with exponential backoff until `patience` runs out,
    /// then checks each speaks our protocol version.
    pub async fn connect(
        addresses: &[Address],
        patience: Duration,
        cluster_token: Option<&Secret>,
        tls: Option<&ClientTls>,
    ) -> Result<Self> {
        let token = AttachToken::cluster(cluster_token)?;
        let clients = try_join_all(addresses.iter().map(|a| connect_one(a, patience, token.clone(), tls))).await?;
        let set = Self { addresses: addresses.to_vec(), clients };
        let infos = set.info().await?;
        for (address, info) in addresses.iter().zip(&infos) {
            tracing::info!(rank_address = %address, device = %info.device, backend = %info.backend,
                version = %info.server_version, "rank connected");
        }
        Ok(set)
    }

    pub fn world_size(&self) -> usize {
        self.clients.len()
    }

    pub fn addresses(&self) -> &[Address] {
        &self.addresses
    }

    pub async fn info(&self) -> Result<Vec<pb::InfoResponse>> {
        let calls = self.clients.iter().zip(&self.addresses).map(|(client, address)| {
            let mut client = client.clone();
            async move {
                let request = pb::InfoRequest { protocol_version: RANK_PROTOCOL_VERSION };
                let info = with_deadline(INFO_DEADLINE, client.info(request))
                    .await
                    .map_err(|status| anyhow::anyhow!("rank at {address}: {}", status.message()))?
                    .into_inner();
                if info.protocol_version != RANK_PROTOCOL_VERSION {
                    bail!(
                        "rank at {address} speaks rank protocol {} but this coordinator speaks {RANK_PROTOCOL_VERSION}",
                        info.protocol_version
                    );
                }
                Ok(info)
            }
        });
        try_join_all(calls).await
    }

    /// Creates a communicator for `epoch`: an id from rank 0, then Init on every rank at once
    /// (each Init blocks until all ranks have joined).
    pub async fn bootstrap(&self, epoch: u64, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let mut rank0 = self.clients[0].clone();
        let comm_id = with_deadline(CONTROL_DEADLINE, rank0.create_comm_id(pb::CreateCommIdRequest { epoch }))
            .await
            .map_err(|s| anyhow::anyhow!("rank 0 could not create a communicator id: {}", s.message()))?
            .into_inner()
            .comm_id;
        let world_size = self.world_size() as u32;
        let calls = self.clients.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            let request = pb::InitRequest {
                rank: rank as u32,
                world_size,
                comm_id: comm_id.clone(),
                epoch,
                timeout_ms: timeout.as_millis() as u32,
            };
            let address = &self.addresses[rank];
            // Init blocks on the rank until every rank has joined, for at most `timeout`.
            async move {
                with_deadline(timeout + CONTROL_DEADLINE, client.init(request))
                    .await
                    .map_err(|s| anyhow::anyhow!("rank {rank} at {address} failed to init: {}", s.message()))
            }
        });
        try_join_all(calls).await?;
        tracing::info!(epoch, world_size, elapsed = ?started.elapsed(), "communicator ready");
        Ok(())
    }

    /// Loads a model on every rank, logging the slowest rank's progress. Returns every rank's
    /// shard, in rank order.
    pub async fn load(
        &self,
        model_id: &str,
        path: &str,
        weights: &WeightFormat,
        epoch: u64,
        load_timeout: Duration,
        kv_blocks: u64,
    ) -> Result<Vec<pb::ShardInfo>, Error> {
        let progress = Arc::new(LoadMeter::new(self.world_size()));
        let reporter = tokio::spawn(progress.clone().report(path.to_owned()));
        let lost = |message: String| Error::new(Kind::RankUnavailable, format!("loading {path}: {message}"));
        let calls = self.clients.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            let progress = progress.clone();
            let request = pb::LoadShardRequest {
                model_id: model_id.to_owned(),
                model_path: path.to_owned(),
                dtype: weights.dtype.clone(),
                epoch,
                quantize: weights.quantize.clone(),
                matmul_precision: weights.matmul_precision.clone(),
                kv_cache_dtype: weights.kv_cache_dtype.clone(),
                kv_block_size: crate::model::paged::DEFAULT_BLOCK_SIZE as u32,
                kv_blocks,
            };
            // A rank reports progress every 250 ms while it loads: silence means it is stuck or
            // gone, however long the whole load may take. A rank that cannot load the files
            // says why (INVALID_ARGUMENT), which is the request's fault, not the rank's.
            async move {
                let refused = |status: tonic::Status| Error::from_rank(&format!("loading {path} on rank {rank}"), &status);
                let mut stream =
                    with_deadline(LOAD_STALL_DEADLINE, client.load_shard(request)).await.map_err(refused)?.into_inner();
                loop {
                    let message = match tokio::time::timeout(LOAD_STALL_DEADLINE, stream.message()).await {
                        Ok(Ok(Some(message))) => message,
                        Ok(Ok(None)) => return Err(lost(format!("rank {rank} closed the load stream before finishing"))),
                        Ok(Err(status)) => return Err(refused(status)),
                        Err(_) => return Err(lost(format!("rank {rank} reported no progress for {LOAD_STALL_DEADLINE:?}"))),
                    };
                    progress.update(rank, &message);
                    if message.done {
                        return message.shard.ok_or_else(|| Error::internal(format!("rank {rank} finished loading without shard info")));
                    }
                }
            }
        });
        let result = match tokio::time::timeout(load_timeout, try_join_all(calls)).await {
            Ok(result) => result,
            Err(_) => Err(lost(format!("the ranks did not finish within {load_timeout:?} (--load-timeout-secs)"))),
        };
        reporter.abort();
        progress.finish(result.is_ok());
        result
    }

    /// One step on every rank; returns rank 0's answer (the sampled tokens). Every rank's reply
    /// (or its deadline) is awaited, so no rank can fall a step behind, and the failure is
    /// classified from all of them (see [`StepError`]).
    pub async fn step(
        &self,
        request: pb::GenerateStepRequest,
        deadline: Duration,
        trace: Option<&tracing::Span>,
    ) -> Result<pb::GenerateStepResponse, StepError> {
        let calls = self.clients.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            let mut request = tonic::Request::new(request.clone());
            request.set_timeout(deadline);
            if let Some(span) = trace {
                crate::telemetry::inject(span, request.metadata_mut());
            }
            async move {
                with_deadline(deadline, client.generate_step(request))
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|status| RankFailure { rank, status })
            }
        });
        let mut results = futures::future::join_all(calls).await;
        if results.iter().all(Result::is_ok) {
            return results.swap_remove(0).map_err(StepError::Group);
        }
        let failures: Vec<RankFailure> = results.into_iter().filter_map(Result::err).collect();
        Err(StepError::classify(failures, self.world_size()))
    }

    pub async fn clear_kv(&self, request: pb::ClearKvRequest) -> Result<pb::ClearKvResponse, RankFailure> {
        let calls = self.clients.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            let request = request.clone();
            async move {
                with_deadline(CONTROL_DEADLINE, client.clear_kv(request))
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|status| RankFailure { rank, status })
            }
        });
        let mut responses = try_join_all(calls).await?;
        Ok(responses.swap_remove(0))
    }

    /// Unloads a model from every rank; a rank that does not hold it (it restarted since) is
    /// already where unloading would leave it.
    pub async fn unload(&self, model_id: &str) -> Result<(), RankFailure> {
        let calls = self.clients.iter().enumerate().map(|(rank, client)| {
            let mut client = client.clone();
            let request = pb::UnloadRequest { model_id: model_id.to_owned() };
            async move {
                match with_deadline(CONTROL_DEADLINE, client.unload(request)).await {
                    Ok(_) => Ok(()),
                    Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
                    Err(status) => Err(RankFailure { rank, status }),
                }
            }
        });
        try_join_all(calls).await?;
        Ok(())
    }

    /// Aborts `epoch`'s communicator on every rank that answers within a second, so steps
    /// blocked on a lost peer fail now rather than at the collective timeout.
    pub async fn abort_comm(&self, epoch: u64) {
        let calls = self.clients.iter().map(|client| {
            let mut client = client.clone();
            async move {
                let request = pb::AbortCommRequest { epoch };
                let _ = tokio::time::timeout(Duration::from_secs(1), client.abort_comm(request)).await;
            }
        });
        futures::future::join_all(calls).await;
    }

    /// Asks every rank to exit; ranks that are already gone are ignored.
    pub async fn shutdown(&self) {
        let calls = self.clients.iter().map(|client| {
            let mut client = client.clone();
            async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown(pb::ShutdownRequest {})).await;
            }
        });
        futures::future::join_all(calls).await;
    }
}

/// Load progress over all ranks: a progress bar (bytes, rate, ETA) on a terminal, periodic log
/// lines otherwise.
struct LoadMeter {
    started: Instant,
    bytes: Vec<AtomicU64>,
    /// the checkpoint's size on disk; together the ranks read about that much
    total: AtomicU64,
    terminal: bool,
}

impl LoadMeter {
    fn new(ranks: usize) -> Self {
        Self {
            started: Instant::now(),
            bytes: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            total: AtomicU64::new(0),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn update(&self, rank: usize, message: &pb::LoadShardProgress) {
        if let Some(slot) = self.bytes.get(rank) {
            slot.store(message.bytes_loaded, Ordering::Relaxed);
        }
        self.total.fetch_max(message.bytes_total, Ordering::Relaxed);
    }

    /// (loaded bytes, total bytes, bytes per second, seconds left)
    fn snapshot(&self) -> (u64, u64, f64, Option<f64>) {
        let loaded: u64 = self.bytes.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        let total = self.total.load(Ordering::Relaxed).max(loaded);
        let rate = loaded as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        let eta = (rate > 0.0 && total > 0).then(|| (total - loaded) as f64 / rate);
        (loaded, total, rate, eta)
    }

    async fn report(self: Arc<Self>, path: String) {
        let period = if self.terminal { Duration::from_millis(200) } else { Duration::from_secs(2) };
        loop {
            tokio::time::sleep(period).await;
            let (loaded, total, rate, eta) = self.snapshot();
            let eta = eta.map_or("?".to_owned(), |s| format!("{s:.0}s"));
            if self.terminal {
                let fraction = if total == 0 { 0.0 } else { loaded as f64 / total as f64 };
                let filled = (fraction * 30.0) as usize;
                eprint!(
                    "\rloading {path} [{}{}] {:>5.1}% {} / {} MiB, {:.0} MiB/s, ETA {eta}   ",
                    "#".repeat(filled),
                    " ".repeat(30 - filled.min(30)),
                    fraction * 100.0,
                    loaded >> 20,
                    total >> 20,
                    rate / (1u64 << 20) as f64
                );
            } else {
                tracing::info!(loaded_mib = loaded >> 20, checkpoint_mib = total >> 20, mib_per_s = rate as u64 >> 20, %eta, "loading shards");
            }
        }
    }

    fn finish(&self, ok: bool) {
        if self.terminal && self.started.elapsed() > Duration::from_millis(200) {
            let (loaded, _, rate, _) = self.snapshot();
            let outcome = if ok { "loaded" } else { "failed after" };
            eprintln!("\r{outcome} {} MiB in {:.1} s ({:.0} MiB/s){}", loaded >> 20, self.started.elapsed().as_secs_f64(), rate / (1u64 << 20) as f64, " ".repeat(30));
        }
    }
}

/// A rank RPC that failed, and which rank it was.
#[derive(Debug)]
pub struct RankFailure {
    pub rank: usize,
    pub status: tonic::Status,
}

impl RankFailure {
    /// Whether the rank refused the call because of what it asked (so nothing ran and the
    /// group is intact), rather than failing to run it.
    fn is_refusal(&self) -> bool {
        Kind::of_rank_status(self.status.code()).concerns_one_request()
    }
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}: {:?}: {}", self.rank, self.status.code(), self.status.message())
    }
}

impl std::error::Error for RankFailure {}

/// Why a step did not produce tokens, and so how far the failure reaches.
#[derive(Debug)]
pub enum StepError {
    /// Every rank refused the step before running it (INVALID_ARGUMENT, OUT_OF_RANGE,
    /// NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED): one of its requests is at fault, the
    /// group and its caches are intact.
    Refused(RankFailure),
    /// A rank was lost or hung, a collective failed, or the ranks disagree: the group must
    /// recover before it can run another step.
    Group(RankFailure),
    /// The group moved to a newer epoch before the step ran; the caches it assumed are gone.
    StaleEpoch,
    /// The group is recovering and did not come back in time.
    Unavailable(String),
}

impl StepError {
    /// A refusal only counts as one when every rank refused: a rank that ran the step while
    /// another refused it is stuck in (or failed) a collective.
    fn classify(mut failures: Vec<RankFailure>, world_size: usize) -> Self {
        if failures.len() == world_size && failures.iter().all(RankFailure::is_refusal) {
            return StepError::Refused(failures.swap_remove(0));
        }
        let first_group = failures.iter().position(|f| !f.is_refusal()).unwrap_or(0);
        StepError::Group(failures.swap_remove(first_group))
    }
}

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepError::Refused(failure) => write!(f, "refused by {failure}"),
            StepError::Group(failure) => failure.fmt(f),
            StepError::StaleEpoch => f.write_str("the rank group moved to a new epoch"),
            StepError::Unavailable(reason) => f.write_str(reason),
        }
    }
}

/// Most calls to a rank answer at once; these bound how long a hung rank can hold one up.
const INFO_DEADLINE: Duration = Duration::from_secs(10);
/// ClearKv, Unload, CreateCommId, and the margin on top of Init's own timeout.
const CONTROL_DEADLINE: Duration = Duration::from_secs(30);
/// Longest silence on a LoadShard progress stream (the rank reports every 250 ms).
const LOAD_STALL_DEADLINE: Duration = Duration::from_secs(60);

/// Runs a rank call for at most `deadline`; past it, DEADLINE_EXCEEDED.
async fn with_deadline<T>(
    deadline: Duration,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(deadline, call).await {
        Ok(result) => result,
        Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {deadline:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    fn failure(rank: usize, status: Status) -> RankFailure {
        RankFailure { rank, status }
    }

    #[test]
    fn only_a_refusal_by_every_rank_is_a_refusal() {
        let refused = StepError::classify(
            vec![failure(0, Status::invalid_argument("bad")), failure(1, Status::not_found("gone"))],
            2,
        );
        assert!(matches!(refused, StepError::Refused(RankFailure { rank: 0, .. })), "{refused:?}");
        // One rank ran it: the other refusing leaves that one stuck in a collective.
        let partial = StepError::classify(vec![failure(1, Status::invalid_argument("bad"))], 2);
        assert!(matches!(partial, StepError::Group(_)), "{partial:?}");
        let lost = StepError::classify(
            vec![failure(0, Status::invalid_argument("bad")), failure(1, Status::unavailable("collective failed"))],
            2,
        );
        assert!(matches!(lost, StepError::Group(RankFailure { rank: 1, .. })), "{lost:?}");
        for status in [Status::deadline_exceeded("hung"), Status::internal("worker"), Status::failed_precondition("epoch")] {
            assert!(matches!(StepError::classify(vec![failure(0, status)], 1), StepError::Group(_)));
        }
    }
}

async fn connect_one(address: &Address, patience: Duration, token: AttachToken, tls: Option<&ClientTls>) -> Result<Client> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(50);
    let mut announced = false;
    loop {
        match net::connect_with(address, Duration::from_secs(5), tls).await {
            Ok(channel) => {
                return Ok(RankClient::with_interceptor(channel, token)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES));
            }
            Err(err) if started.elapsed() < patience => {
                if !announced || delay >= Duration::from_secs(2) {
                    tracing::info!(rank_address = %address, error = %format!("{err:#}"), "waiting for rank");
                    announced = true;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(err) => return Err(err).with_context(|| format!("rank at {address} did not come up within {patience:?}")),
        }
    }
}

/// The shard a group can hold: the smallest rank's KV capacity and pool, and the largest
/// recurrent state (counted in the smallest blocks, so that it is never undercounted); the
/// rest is rank 0's.
pub fn group_shard(infos: &[pb::ShardInfo]) -> Result<pb::ShardInfo, Error> {
    let mut group = infos.first().cloned().ok_or_else(|| Error::internal("no ranks"))?;
    group.kv_capacity_tokens = infos.iter().map(|i| i.kv_capacity_tokens).min().unwrap_or(0);
    group.kv_blocks = infos.iter().map(|i| i.kv_blocks).min().unwrap_or(0);
    group.kv_block_bytes = infos.iter().map(|i| i.kv_block_bytes).min().unwrap_or(0);
    group.recurrent_state_bytes = infos.iter().map(|i| i.recurrent_state_bytes).max().unwrap_or(0);
    Ok(group)
}
