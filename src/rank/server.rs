//! The rank's gRPC service: turns RPCs into device-worker commands.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::Device;
use tokio::sync::{Notify, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::comm::socket::{self, Rendezvous};
use crate::model::hub::HubModel;
use crate::model::loader::LoadProgress;
use crate::net::{Address, Listener};
use crate::proto::rank::v1 as pb;
use crate::proto::rank::v1::rank_server::{Rank, RankServer};
use crate::proto::RANK_PROTOCOL_VERSION;
use crate::rank::error::Error;
use crate::rank::worker::{self, Command, SharedState, WorkerConfig};

/// Settings of one rank process.
pub struct RankOptions {
    pub listen: Address,
    pub device: Device,
    pub device_name: String,
    pub threads: usize,
    /// where rank 0 opens its rendezvous for the collective bootstrap (TCP host:port, port 0 to
    /// pick one, or a Unix socket path)
    pub rendezvous_bind: String,
    /// the host other ranks use to reach the rendezvous (for TCP across hosts)
    pub advertise_host: Option<String>,
    pub init_timeout: Duration,
    pub collective_timeout: Duration,
    /// KV cache budget per model in bytes (None: derived from available memory)
    pub kv_cache_bytes: Option<u64>,
    /// required on every rank RPC when set
    pub cluster_token: Option<crate::auth::Secret>,
    /// serve over TLS with this identity
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// host:port to serve Prometheus metrics on
    pub metrics_listen: Option<String>,
}

pub struct RankService {
    commands: std::sync::mpsc::Sender<Command>,
    shared: Arc<Mutex<SharedState>>,
    /// the rendezvous rank 0 keeps open between CreateCommId and Init
    rendezvous: Mutex<Option<(u64, Rendezvous)>>,
    options: Arc<RankOptions>,
    shutdown: Arc<Notify>,
}

impl RankService {
    fn shared(&self) -> std::sync::MutexGuard<'_, SharedState> {
        self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a command for the device worker and waits for its reply.
    async fn call<T>(&self, make: impl FnOnce(worker::Reply<T>) -> Command) -> Result<T, Error> {
        let (reply, receive) = oneshot::channel();
        self.commands.send(make(reply)).map_err(|_| Error::worker_gone())?;
        receive.await.map_err(|_| Error::worker_gone())?
    }
}

type ProgressStream = Pin<Box<dyn Stream<Item = Result<pb::LoadShardProgress, Status>> + Send>>;

#[tonic::async_trait]
impl Rank for RankService {
    async fn info(&self, request: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let asked = request.get_ref().protocol_version;
        if asked != RANK_PROTOCOL_VERSION {
            return Err(Error::not_ready(format!(
                "rank protocol version mismatch: this rank speaks {RANK_PROTOCOL_VERSION}, the caller {asked}; \
                 run the same tpserve version on the coordinator and every rank"
            ))
            .into());
        }
        // A GPU rank reports its device's memory, which only the device worker can read.
        let nccl = self.options.device.is_cuda();
        let (memory_total, memory_available) =
            if nccl { self.shared().device_memory.unwrap_or_default() } else { worker::memory_info() };
        let shared = self.shared();
        Ok(Response::new(pb::InfoResponse {
            protocol_version: RANK_PROTOCOL_VERSION,
            server_version: env!("CARGO_PKG_VERSION").to_owned(),
            backend: if nccl { "nccl" } else { "socket" }.to_owned(),
            device: self.options.device_name.clone(),
            memory_total_bytes: memory_total,
            memory_available_bytes: memory_available,
            threads: self.options.threads as u32,
            initialized: shared.initialized,
            rank: shared.rank,
            world_size: shared.world_size,
            epoch: shared.epoch,
            loaded_models: shared.loaded_models.clone(),
        }))
    }

    async fn create_comm_id(
        &self,
        request: Request<pb::CreateCommIdRequest>,
    ) -> Result<Response<pb::CreateCommIdResponse>, Status> {
        // NCCL's id is made here, not on the device worker: the worker may be stuck in a step
        // that the Init following this call is about to abort.
        #[cfg(feature = "cuda")]
        if self.options.device.is_cuda() {
            let id = tokio::task::spawn_blocking(crate::comm::nccl::NcclId::new)
                .await
                .map_err(|err| Error::internal(format!("NCCL id task failed: {err}")))?
                .map_err(|err| Error::collective(format!("cannot create an NCCL id: {err}")))?;
            return Ok(Response::new(pb::CreateCommIdResponse { comm_id: id.to_bytes() }));
        }
        let epoch = request.get_ref().epoch;
        let bind = self.options.rendezvous_bind.clone();
        let advertise = self.options.advertise_host.clone();
        let (id, rendezvous) = tokio::task::spawn_blocking(move || {
            let bind = socket::RendezvousAddr::parse(&bind)?;
            socket::create_comm_id(&bind, advertise.as_deref())
        })
            .await
            .map_err(|err| Error::internal(format!("rendezvous task failed: {err}")))?
            .map_err(|err| Error::collective(format!("cannot open the rendezvous: {err}")))?;
        *self.rendezvous.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, rendezvous));
        Ok(Response::new(pb::CreateCommIdResponse { comm_id: id.to_bytes() }))
    }

    async fn init(&self, request: Request<pb::InitRequest>) -> Result<Response<pb::InitResponse>, Status> {
        let request = request.into_inner();
        // Only the socket backend's rank 0 holds a rendezvous; NCCL bootstraps from its id alone.
        let rendezvous = if request.rank == 0 && !self.options.device.is_cuda() {
            let taken = self.rendezvous.lock().unwrap_or_else(|p| p.into_inner()).take();
            match taken {
                Some((epoch, rendezvous)) if epoch == request.epoch => Some(rendezvous),
                _ => {
                    return Err(Error::not_ready(format!(
                        "rank 0 has no rendezvous for epoch {}: call CreateCommId on rank 0 first",
                        request.epoch
                    ))
                    .into());
                }
            }
        } else {
            None
        };
        // A newer epoch must not wait behind a step blocked on a dead communicator.
        let stale = {
            let mut shared = self.shared();
            shared.requested_epoch = shared.requested_epoch.max(request.epoch);
            if request.epoch > shared.epoch { shared.communicator.clone() } else { None }
        };
        if let Some(old) = stale {
            old.abort();
        }
        let response = self.call(|reply| Command::Init { request, rendezvous, reply }).await?;
        Ok(Response::new(response))
    }

    type LoadShardStream = ProgressStream;

    async fn load_shard(
        &self,
        request: Request<pb::LoadShardRequest>,
    ) -> Result<Response<Self::LoadShardStream>, Status> {
        let request = request.into_inner();
        let (sender, receiver) = tokio::sync::mpsc::channel(16);
        let commands = self.commands.clone();
        tokio::spawn(async move {
            let request = match fetch_from_hub(request, &sender).await {
                Ok(request) => request,
                Err(error) => {
                    let _ = sender.send(Err(error.into())).await;
                    return;
                }
            };
            let bytes_total = checkpoint_bytes(&request.model_path);
            let progress = Arc::new(LoadProgress::default());
            let (reply, done) = oneshot::channel();
            if commands.send(Command::Load { request, progress: progress.clone(), reply }).is_err() {
                let _ = sender.send(Err(Error::worker_gone().into())).await;
                return;
            }
            report_progress(progress, bytes_total, done, sender).await;
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver))))
    }

    async fn generate_step(
        &self,
        request: Request<pb::GenerateStepRequest>,
    ) -> Result<Response<pb::GenerateStepResponse>, Status> {
        let span = tracing::info_span!("rank_step", rank = self.shared().rank, step = request.get_ref().step);
        crate::telemetry::set_parent_from(&span, request.metadata());
        let request = request.into_inner();
        let response = self.call(|reply| Command::Step { request, span, reply }).await?;
        Ok(Response::new(response))
    }

    async fn abort_comm(&self, request: Request<pb::AbortCommRequest>) -> Result<Response<pb::AbortCommResponse>, Status> {
        let epoch = request.get_ref().epoch;
        let live = {
            let shared = self.shared();
            if shared.epoch == epoch { shared.communicator.clone() } else { None }
        };
        let aborted = live.is_some();
        if let Some(communicator) = live {
            tracing::warn!(epoch, "aborting the communicator at the coordinator's request");
            communicator.abort();
        }
        Ok(Response::new(pb::AbortCommResponse { aborted }))
    }

    async fn clear_kv(&self, request: Request<pb::ClearKvRequest>) -> Result<Response<pb::ClearKvResponse>, Status> {
        let request = request.into_inner();
        Ok(Response::new(self.call(|reply| Command::ClearKv { request, reply }).await?))
    }

    async fn unload(&self, request: Request<pb::UnloadRequest>) -> Result<Response<pb::UnloadResponse>, Status> {
        let request = request.into_inner();
        Ok(Response::new(self.call(|reply| Command::Unload { request, reply }).await?))
    }

    async fn shutdown(&self, _request: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        tracing::info!("shutdown requested by the coordinator");
        if let Some(comm) = self.shared().communicator.clone() {
            comm.abort();
        }
        self.shutdown.notify_one();
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}

/// Streams load progress every 250 ms until the worker answers, then the final message.
async fn report_progress(
    progress: Arc<LoadProgress>,
    bytes_total: u64,
    mut done: oneshot::Receiver<Result<pb::ShardInfo, Error>>,
    sender: tokio::sync::mpsc::Sender<Result<pb::LoadShardProgress, Status>>,
) {
    let snapshot = |done: bool, shard: Option<pb::ShardInfo>| pb::LoadShardProgress {
        bytes_loaded: progress.bytes.load(std::sync::atomic::Ordering::Relaxed),
        bytes_total,
        tensors_loaded: progress.tensors.load(std::sync::atomic::Ordering::Relaxed),
        done,
        shard,
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            result = &mut done => {
                let last = match result {
                    Ok(Ok(shard)) => Ok(snapshot(true, Some(shard))),
                    Ok(Err(error)) => Err(error.into()),
                    Err(_) => Err(Error::worker_gone().into()),
                };
                let _ = sender.send(last).await;
                return;
            }
            _ = ticker.tick() => {
                // A caller that went away does not stop the load: the worker finishes it.
                let _ = sender.send(Ok(snapshot(false, None))).await;
            }
        }
    }
}

/// A LoadShard naming a hub model (`ORG/NAME[@REVISION]`) instead of a directory: fetches the
/// config and weights into the Hugging Face cache, then names the snapshot directory. Empty
/// progress messages meanwhile keep the coordinator's silence deadline from firing during a long
/// download.
async fn fetch_from_hub(
    mut request: pb::LoadShardRequest,
    sender: &tokio::sync::mpsc::Sender<Result<pb::LoadShardProgress, Status>>,
) -> Result<pb::LoadShardRequest, Error> {
    let Some(hub) = HubModel::parse(&request.model_path) else { return Ok(request) };
    let name = hub.to_string();
    let mut fetch = tokio::task::spawn_blocking(move || hub.fetch_rank_files());
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    let fetched = loop {
        tokio::select! {
            fetched = &mut fetch => break fetched,
            _ = ticker.tick() => {
                let _ = sender.send(Ok(pb::LoadShardProgress::default())).await;
            }
        }
    };
    let dir = fetched
        .map_err(|err| Error::internal(format!("fetching {name} from the hub: {err}")))?
        .map_err(|err| Error::invalid(format!("cannot fetch the weights of {name}: {err:#}")))?;
    request.model_path = dir.to_str().ok_or_else(|| Error::invalid("the Hugging Face cache path is not UTF-8"))?.to_owned();
    Ok(request)
}

/// Size on disk of the safetensors files in a model directory (0 when unknown).
fn checkpoint_bytes(path: &str) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else { return 0 };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|ext| ext == "safetensors"))
        // through symlinks: a Hugging Face cache snapshot links to its blobs
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| m.len())
        .sum()
}

/// A rank's clients are its coordinator (one channel, reconnecting after a failure), probes and
/// the odd operator tool; this bounds what anything else can open.
const MAX_CONNECTIONS: usize = 64;

/// Runs a rank server until Shutdown, SIGINT or SIGTERM.
pub async fn run(options: RankOptions) -> anyhow::Result<()> {
    let options = Arc::new(options);
    let shared = Arc::new(Mutex::new(SharedState::default()));
    let metrics = Arc::new(crate::metrics::RankMetrics::new());
    if let Some(address) = options.metrics_listen.clone() {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            if let Err(err) = crate::metrics::serve(&address, move || metrics.render()).await {
                tracing::error!(error = %format!("{err:#}"), "metrics server stopped");
            }
        });
    }
    let commands = worker::spawn(
        WorkerConfig {
            device: options.device.clone(),
            metrics,
            default_init_timeout: options.init_timeout,
            collective_timeout: options.collective_timeout,
            kv_cache_bytes: options.kv_cache_bytes,
        },
        shared.clone(),
    )?;
    let shutdown = Arc::new(Notify::new());
    let service = RankService {
        commands,
        shared: shared.clone(),
        rendezvous: Mutex::new(None),
        options: options.clone(),
        shutdown: shutdown.clone(),
    };

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<RankServer<RankService>>().await;
    health.set_service_status(crate::proto::LIVENESS_SERVICE, tonic_health::ServingStatus::Serving).await;
    let (reflection_v1, reflection_v1alpha) =
        crate::proto::reflection_services(&["tpserve.rank.v1.Rank", "grpc.health.v1.Health"])?;

    if options.cluster_token.is_none() {
        tracing::warn!("no cluster token ({}): anyone who can reach this rank's address can drive it", crate::auth::CLUSTER_TOKEN_ENV);
    }
    let listener = Listener::bind(&options.listen).await?;
    tracing::info!(listen = %listener.local_address()?, device = %options.device_name, "rank serving");
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = options.tls.clone() {
        builder = builder.tls_config(tls)?;
    }
    let router = builder
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            RankServer::new(service).max_decoding_message_size(256 << 20),
            crate::auth::RequireToken::cluster(options.cluster_token.clone()),
        ));
    let stop = async move {
        tokio::select! {
            _ = shutdown.notified() => {}
            _ = crate::signals::termination_signal() => {}
        }
    };
    router.serve_with_incoming_shutdown(listener.into_incoming(MAX_CONNECTIONS, "rank"), stop).await?;
    if let Some(comm) = shared.lock().unwrap_or_else(|p| p.into_inner()).communicator.take() {
        comm.abort();
    }
    tracing::info!("rank stopped");
    Ok(())
}
