//! The coordinator: owns no device. It tokenizes, schedules, streams tokens to clients and
//! drives the ranks (see docs/architecture.md).

pub mod blocks;
pub mod chat_template;
pub mod choices;
pub mod detokenizer;
pub mod engine;
pub mod error;
pub mod gguf_tokenizer;
pub mod http;
pub mod pyjson;
pub mod ranks;
pub mod service;
pub mod stop;
pub mod stream;
pub mod tools;
pub mod validation;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use tokenizers::Tokenizer;
use tokio::sync::{Mutex, RwLock, mpsc, watch};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::metrics::{CoordinatorMetrics, Occupancy};
use crate::model::config::{ModelConfig, generation_eos_ids};
use crate::model::hub::HubModel;
use crate::net::{Address, Listener};
use crate::proto::rank::v1 as rank_pb;
use crate::proto::v1 as pb;
use blocks::PoolGeometry;
use chat_template::ChatTemplate;
use error::{Error, Kind};
use engine::{Engine, ModelStats, NewRequest, SchedulerConfig};
pub use ranks::WeightFormat;
use ranks::{RankFailure, RankSet, StepError};

/// Health service names that follow readiness (grpc.health.v1): NOT_SERVING until every rank is
/// initialised and the model loaded, and whenever a rank is lost. "" is the whole server.
pub const HEALTH_SERVICES: [&str; 3] = ["", "tpserve.v1.Generator", "tpserve.v1.Admin"];

pub use crate::proto::LIVENESS_SERVICE;

pub struct CoordinatorOptions {
    pub ranks: Vec<Address>,
    pub model: PathBuf,
    pub model_id: Option<String>,
    pub weights: WeightFormat,
    pub listen: Address,
    pub scheduler: SchedulerConfig,
    pub limits: service::RpcLimits,
    /// how long to wait for ranks to appear at start
    pub rank_patience: Duration,
    pub init_timeout: Duration,
    /// how long a recovery may take before in-flight requests are failed with UNAVAILABLE
    pub recovery_timeout: Duration,
    /// how long loading a model on the ranks may take in all
    pub load_timeout: Duration,
    /// on SIGTERM, how long in-flight requests may run before the server stops anyway
    pub shutdown_grace: Duration,
    pub tokens: Tokens,
    /// TLS identity of the public port
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// trust for TLS connections to ranks given by host:port
    pub rank_tls: Option<crate::net::ClientTls>,
    /// host:port for Prometheus metrics
    pub metrics_listen: Option<String>,
    /// host:port for the OpenAI-compatible HTTP API
    pub http_listen: Option<String>,
}

/// The shared secrets a coordinator uses (see `crate::auth`).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// sent to the ranks
    pub cluster: Option<crate::auth::Secret>,
    /// required from public API clients when set
    pub api: Option<crate::auth::Secret>,
    /// required for Admin; without it Admin is disabled
    pub admin: Option<crate::auth::Secret>,
}

/// A model being served: what the coordinator needs to tokenize, validate and stop, plus the
/// queue into its step loop.
pub struct ModelHandle {
    pub id: String,
    pub path: PathBuf,
    pub dtype: String,
    pub config: ModelConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub eos_token_ids: Vec<u32>,
    pub max_context: usize,
    /// KV cache tokens one sequence can hold (the smallest rank's pool, less a recurrent state)
    pub kv_capacity_tokens: usize,
    /// what each rank holds (ModelInfo)
    pub shards: Vec<pb::ShardWeights>,
    /// the ranks' KV block pools
    pub pool: PoolGeometry,
    pub prefix_cache: bool,
    /// most requests waiting for admission before new ones are refused
    pub max_waiting: usize,
    pub stats: Arc<ModelStats>,
    /// the coordinator's Prometheus metrics, shared by every model
    pub metrics: Arc<CoordinatorMetrics>,
    pub submit: mpsc::Sender<NewRequest>,
    /// set when the model is being unloaded: its step loop cancels its requests and ends
    pub unloading: watch::Sender<bool>,
}

fn shard_weights(rank: usize, shard: &rank_pb::ShardInfo) -> pb::ShardWeights {
    pb::ShardWeights {
        rank: rank as u32,
        dtype: shard.dtype.clone(),
        formats: shard.formats.clone(),
        weight_bytes: shard.weight_bytes,
        kv_cache_dtype: shard.kv_cache_dtype.clone(),
    }
}

impl ModelHandle {
    pub fn info(&self, tp_size: usize) -> pb::ModelInfoResponse {
        let stats = &self.stats;
        let overhead = stats.overhead_percentiles();
        pb::ModelInfoResponse {
            model_id: self.id.clone(),
            model_type: self.config.model_type.clone(),
            vocab_size: self.config.vocab_size as u32,
            max_context: self.max_context as u32,
            tp_size: tp_size as u32,
            dtype: self.dtype.clone(),
            eos_token_ids: self.eos_token_ids.clone(),
            active_sequences: stats.active_sequences.load(Ordering::Relaxed) as u32,
            kv_cached_tokens: stats.kv_cached_tokens.load(Ordering::Relaxed),
            requests_cancelled_total: stats.requests_cancelled_total.load(Ordering::Relaxed),
            sequences_freed_total: stats.sequences_freed_total.load(Ordering::Relaxed),
            requests_total: stats.requests_total.load(Ordering::Relaxed),
            kv_capacity_tokens: self.kv_capacity_tokens as u64,
            kv_reserved_tokens: stats.kv_reserved_tokens.load(Ordering::Relaxed),
            waiting_requests: stats.waiting.load(Ordering::Relaxed) as u32,
            steps_total: stats.steps_total.load(Ordering::Relaxed),
            step_overhead_us_p50: overhead.0,
            step_overhead_us_p99: overhead.1,
            shards: self.shards.clone(),
            kv_block_size: self.pool.block_size as u32,
            kv_blocks_total: self.pool.blocks as u64,
            kv_blocks_used: stats.kv_blocks_used.load(Ordering::Relaxed),
            kv_blocks_cached: stats.kv_blocks_cached.load(Ordering::Relaxed),
            kv_blocks_reserved: stats.kv_blocks_reserved.load(Ordering::Relaxed),
            kv_state_blocks: stats.kv_state_blocks.load(Ordering::Relaxed),
            prefix_cache_enabled: self.prefix_cache,
            prefix_cache_queries_total: stats.prefix_cache_queries.load(Ordering::Relaxed),
            prefix_cache_hits_total: stats.prefix_cache_hits.load(Ordering::Relaxed),
        }
    }
}

/// Owns the rank group: the communicator epoch, the step lock, health, and recovery.
pub struct Supervisor {
    ranks: RankSet,
    epoch: AtomicU64,
    /// Steps of different models must not interleave: every rank has to run the collectives of
    /// one step before the next.
    step_lock: Mutex<()>,
    recovering: Mutex<()>,
    /// the rank group is initialised and has every model loaded; steps wait while it is not
    group_ok: watch::Sender<bool>,
    health: HealthReporter,
    init_timeout: Duration,
    /// how long one recovery may take before in-flight requests are failed
    recovery_timeout: Duration,
    load_timeout: Duration,
    /// (model id, path, weight format, KV blocks) of every loaded model, to reload after
    /// recovery with the pool its block ledger counts
    loaded: Mutex<Vec<(String, String, WeightFormat, u64)>>,
    /// set on SIGTERM: no new requests, health NOT_SERVING
    draining: AtomicBool,
}

impl Supervisor {
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Whether the rank group is up (it may still be draining).
    pub fn is_serving(&self) -> bool {
        *self.group_ok.borrow()
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn tp_size(&self) -> usize {
        self.ranks.world_size()
    }

    /// Records whether the group is up and publishes health: SERVING only when it is and the
    /// server is not draining.
    async fn set_group_ok(&self, ok: bool) {
        self.group_ok.send_replace(ok);
        self.publish_health().await;
    }

    async fn publish_health(&self) {
        let serving = self.is_serving() && !self.draining.load(Ordering::SeqCst);
        let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        for service in HEALTH_SERVICES {
            self.health.set_service_status(service, status).await;
        }
    }

    /// Runs one step of `request.epoch`. While the group recovers, steps wait for it (for at
    /// most the recovery timeout) rather than run against half-reloaded ranks; a step of an
    /// epoch the group has left is not run at all.
    pub async fn step(
        &self,
        request: rank_pb::GenerateStepRequest,
        deadline: Duration,
        trace: Option<&tracing::Span>,
    ) -> Result<rank_pb::GenerateStepResponse, StepError> {
        let mut group_ok = self.group_ok.subscribe();
        let _guard = loop {
            let serving = matches!(
                tokio::time::timeout(self.recovery_timeout, group_ok.wait_for(|ok| *ok)).await,
                Ok(Ok(_))
            );
            if !serving {
                return Err(StepError::Unavailable(format!(
                    "the ranks have been recovering for over {:?}; retry later",
                    self.recovery_timeout
                )));
            }
            let guard = self.step_lock.lock().await;
            // Recovery reloads models under the step lock: check again now that it is held.
            if self.is_serving() {
                break guard;
            }
        };
        if request.epoch != self.epoch() {
            return Err(StepError::StaleEpoch);
        }
        self.ranks.step(request, deadline, trace).await
    }

    pub async fn clear_kv(&self, request: rank_pb::ClearKvRequest) -> Result<rank_pb::ClearKvResponse, RankFailure> {
        self.ranks.clear_kv(request).await
    }

    /// Creates a communicator for a new epoch, above any epoch a rank has seen: after a
    /// coordinator restart the ranks still hold the old one, and its state must be dropped.
    async fn bootstrap(&self, init_timeout: Duration) -> Result<()> {
        let infos = self.ranks.info().await?;
        let highest = infos.iter().map(|i| i.epoch).max().unwrap_or(0).max(self.epoch());
        let epoch = highest + 1;
        self.epoch.store(epoch, Ordering::SeqCst);
        self.ranks.bootstrap(epoch, init_timeout).await
    }

    /// Loads a model on every rank: (the group's shard, as its smallest rank can hold; every
    /// rank's shard, in rank order).
    async fn load(
        &self,
        model_id: &str,
        path: &str,
        weights: &WeightFormat,
    ) -> Result<(rank_pb::ShardInfo, Vec<rank_pb::ShardInfo>), Error> {
        let _guard = self.step_lock.lock().await;
        let shards = match self.ranks.load(model_id, path, weights, self.epoch(), self.load_timeout, 0).await {
            Ok(shards) => shards,
            Err(err) => {
                // Ranks that did load it must not keep a model the coordinator does not serve.
                if !self.loaded.lock().await.iter().any(|(id, ..)| id == model_id) {
                    let _ = self.ranks.unload(model_id).await;
                }
                return Err(err);
            }
        };
        let group = ranks::group_shard(&shards)?;
        let mut loaded = self.loaded.lock().await;
        loaded.retain(|(id, ..)| id != model_id);
        loaded.push((model_id.to_owned(), path.to_owned(), weights.clone(), group.kv_blocks));
        Ok((group, shards))
    }

    /// Marks the server NOT_SERVING and rebuilds the group: waits for every rank to answer,
    /// bootstraps a new communicator epoch and reloads every model, retrying with backoff for
    /// at most `recovery_timeout`. Returns whether the group is serving again.
    /// `failed_epoch` is the epoch the failure was seen in: if another caller already recovered
    /// past it, there is nothing left to do.
    pub async fn recover(&self, failed_epoch: u64, reason: &str) -> bool {
        let _guard = self.recovering.lock().await;
        if self.epoch() > failed_epoch && self.is_serving() {
            return true;
        }
        tracing::warn!(%reason, "rank group lost; recovering");
        self.set_group_ok(false).await;
        self.ranks.abort_comm(self.epoch()).await;
        let deadline = tokio::time::Instant::now() + self.recovery_timeout;
        let mut delay = Duration::from_millis(200);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let attempt_result = match tokio::time::timeout(left, self.try_recover()).await {
                Ok(result) => result,
                Err(_) => Err(anyhow::anyhow!("recovery attempt ran past the recovery deadline")),
            };
            match attempt_result {
                Ok(()) => {
                    tracing::info!(epoch = self.epoch(), attempt, "ranks recovered");
                    self.set_group_ok(true).await;
                    return true;
                }
                Err(err) => {
                    tracing::warn!(attempt, %reason, error = %format!("{err:#}"), "recovery attempt failed");
                    if tokio::time::Instant::now() + delay >= deadline {
                        tracing::error!(attempts = attempt, "ranks did not recover within {:?}", self.recovery_timeout);
                        return false;
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Checks every rank once a second, so a dead or hung rank turns health NOT_SERVING even
    /// when no request is running, and keeps recovering in the background after a recovery
    /// gave up. Info is answered outside the rank's step queue, so a long step does not look
    /// like a hung rank.
    pub async fn watch_ranks(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if !self.is_serving() {
                // Not serving may mean a recovery is under way, which bumps the epoch before it
                // reloads the models and marks the group serving. Read the epoch only once no
                // recovery runs: if the group is still not serving then, the last one gave up.
                let given_up = {
                    let _quiet = self.recovering.lock().await;
                    (!self.is_serving()).then(|| self.epoch())
                };
                if let Some(epoch) = given_up {
                    self.recover(epoch, "the previous recovery gave up").await;
                }
                continue;
            }
            let epoch = self.epoch();
            let failure = match tokio::time::timeout(Duration::from_secs(3), self.ranks.info()).await {
                Ok(Ok(infos)) => infos
                    .iter()
                    .position(|info| !info.initialized || info.epoch != epoch)
                    .map(|rank| format!("rank {rank} lost its communicator (restarted?)")),
                Ok(Err(err)) => Some(format!("{err:#}")),
                Err(_) => Some("a rank did not answer Info within 3 s (hung?)".to_owned()),
            };
            if let Some(reason) = failure {
                self.recover(epoch, &reason).await;
            }
        }
    }

    async fn try_recover(&self) -> Result<()> {
        // Short per attempt: a rank that is hung now may be back for the next attempt.
        self.bootstrap(self.init_timeout.min(Duration::from_secs(15))).await?;
        let models = self.loaded.lock().await.clone();
        for (id, path, weights, kv_blocks) in models {
            let _guard = self.step_lock.lock().await;
            self.ranks.load(&id, &path, &weights, self.epoch(), self.load_timeout, kv_blocks).await?;
        }
        Ok(())
    }
}

/// The coordinator's shared state, used by the gRPC services.
pub struct Coordinator {
    pub supervisor: Arc<Supervisor>,
    pub models: RwLock<HashMap<String, Arc<ModelHandle>>>,
    pub default_model: RwLock<Option<String>>,
    pub scheduler: SchedulerConfig,
    pub metrics: Arc<CoordinatorMetrics>,
    /// each model's step loop, awaited when it is unloaded
    engines: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    /// loads and unloads one at a time, so they cannot interleave on the ranks
    admin: Mutex<()>,
}

impl Coordinator {
    /// Finds a model by id; "" means the default model.
    pub async fn model(&self, id: &str) -> Option<Arc<ModelHandle>> {
        let id = if id.is_empty() { self.default_model.read().await.clone()? } else { id.to_owned() };
        self.models.read().await.get(&id).cloned()
    }

    /// Loads a model on every rank and starts its step loop.
    pub async fn load_model(&self, id: &str, path: &Path, weights: &WeightFormat) -> Result<Arc<ModelHandle>, Error> {
        let _admin = self.admin.lock().await;
        if self.models.read().await.contains_key(id) {
            return Err(Error::new(Kind::AlreadyExists, format!("model \"{id}\" is already loaded")));
        }
        let path_text = path.to_str().ok_or_else(|| Error::invalid("the model path is not valid UTF-8"))?;
        // A hub id: the coordinator fetches what it reads, and each rank its weights.
        let hub = HubModel::parse(path_text);
        let local = {
            let (path, hub) = (path.to_owned(), hub.clone());
            tokio::task::spawn_blocking(move || match hub {
                Some(hub) => LocalModelFiles::read(&hub.fetch_coordinator_files()?),
                None => LocalModelFiles::read(&path),
            })
            .await
            .map_err(|err| Error::internal(format!("reading the model files: {err}")))?
            .map_err(|err| Error::invalid(format!("cannot load model: {err:#}")))?
        };
        let ranks_path = hub.map_or_else(|| path_text.to_owned(), |hub| hub.to_string());
        let (info, shards) = self.supervisor.load(id, &ranks_path, weights).await?;
        let pool = pool_geometry(&info);
        let (submit, requests) = mpsc::channel(1024);
        let handle = Arc::new(ModelHandle {
            id: id.to_owned(),
            path: path.to_owned(),
            dtype: info.dtype.clone(),
            max_context: local.config.max_position_embeddings,
            kv_capacity_tokens: pool.max_sequence_tokens(),
            pool,
            prefix_cache: self.scheduler.prefix_cache,
            shards: shards.iter().enumerate().map(|(rank, s)| shard_weights(rank, s)).collect(),
            max_waiting: self.scheduler.max_waiting,
            config: local.config,
            tokenizer: local.tokenizer,
            chat_template: local.chat_template,
            eos_token_ids: local.eos_token_ids,
            stats: Arc::new(ModelStats::default()),
            metrics: self.metrics.clone(),
            submit,
            unloading: watch::channel(false).0,
        });
        let engine = Engine::new(handle.clone(), self.supervisor.clone(), self.scheduler.clone(), requests);
        self.engines.lock().await.insert(id.to_owned(), tokio::spawn(engine.run()));
        self.models.write().await.insert(id.to_owned(), handle.clone());
        let mut default = self.default_model.write().await;
        if default.is_none() {
            *default = Some(id.to_owned());
        }
        for (rank, shard) in shards.iter().enumerate() {
            tracing::info!(
                model = id,
                rank,
                dtype = %shard.dtype,
                formats = %shard.formats,
                weight_bytes = shard.weight_bytes,
                kv_cache_dtype = %shard.kv_cache_dtype,
                "rank holds"
            );
        }
        tracing::info!(model = id, path = %path.display(), dtype = %handle.dtype, kv_capacity_tokens = handle.kv_capacity_tokens, kv_blocks = handle.pool.blocks, "model ready");
        Ok(handle)
    }

    /// Graceful shutdown: refuse new requests (health NOT_SERVING, UNAVAILABLE), then let the
    /// running and queued ones finish for at most `grace`.
    pub async fn drain(&self, grace: Duration) {
        self.supervisor.draining.store(true, Ordering::SeqCst);
        self.supervisor.publish_health().await;
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let busy: u64 = self
                .models
                .read()
                .await
                .values()
                .map(|m| m.stats.active_sequences.load(Ordering::Relaxed) + m.stats.waiting.load(Ordering::Relaxed))
                .sum();
            if busy == 0 {
                tracing::info!("drained: no request in flight");
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(in_flight = busy, ?grace, "grace period over; stopping with requests in flight");
                return;
            }
            tracing::info!(in_flight = busy, "draining before shutdown");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Unloads a model: no new requests reach it, its queued and running requests end with
    /// UNAVAILABLE ("being unloaded"), its step loop finishes its current step and ends, and
    /// only then do the ranks drop it, so no step of it can reach a rank that no longer holds
    /// it. Other models are not touched.
    pub async fn unload_model(&self, id: &str) -> Result<bool, Error> {
        let _admin = self.admin.lock().await;
        let Some(model) = self.models.write().await.remove(id) else { return Ok(false) };
        self.supervisor.loaded.lock().await.retain(|(loaded, ..)| loaded != id);
        {
            let mut default = self.default_model.write().await;
            if default.as_deref() == Some(id) {
                *default = self.models.read().await.keys().next().cloned();
            }
        }
        model.unloading.send_replace(true);
        if let Some(engine) = self.engines.lock().await.remove(id) {
            if let Err(err) = engine.await {
                tracing::error!(model = id, error = %err, "the model's step loop failed");
            }
        }
        drop(model);
        self.supervisor
            .ranks
            .unload(id)
            .await
            .map_err(|f| Error::new(Kind::RankUnavailable, format!("unloading \"{id}\" failed on rank {}: {}", f.rank, f.status.message())))?;
        tracing::info!(model = id, "model unloaded");
        Ok(true)
    }
}

/// What the coordinator reads from a model directory itself (it never reads the weights).
struct LocalModelFiles {
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    eos_token_ids: Vec<u32>,
}

impl LocalModelFiles {
    fn read(dir: &Path) -> Result<Self> {
        if crate::model::gguf::is_gguf(dir) {
            // One file: config, tokenizer and chat template all come from its metadata.
            let file = crate::model::gguf::GgufFile::open(dir)?;
            let config = file.model_config()?;
            let tokenizer = gguf_tokenizer::tokenizer(&file)?;
            let chat_template = gguf_tokenizer::chat_template(&file)?;
            let eos_token_ids = config.eos_token_ids.clone();
            return Ok(Self { config, tokenizer: Arc::new(tokenizer), chat_template, eos_token_ids });
        }
        let config = ModelConfig::from_model_dir(dir)?;
        let tokenizer_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tokenizer_path)
            .map_err(|err| anyhow::anyhow!("cannot load {}: {err}", tokenizer_path.display()))?;
        let chat_template = ChatTemplate::from_model_dir(dir)?;
        let eos_token_ids = generation_eos_ids(dir)?.unwrap_or_else(|| config.eos_token_ids.clone());
        Ok(Self { config, tokenizer: Arc::new(tokenizer), chat_template, eos_token_ids })
    }
}

/// Runs a coordinator until SIGINT/SIGTERM.
pub async fn run(options: CoordinatorOptions) -> Result<()> {
    run_until(options, crate::signals::termination_signal()).await
}

/// Runs a coordinator until `stop` resolves, then shuts its ranks down.
pub async fn run_until(options: CoordinatorOptions, stop: impl std::future::Future<Output = ()> + Send + 'static) -> Result<()> {
    let stop = futures::FutureExt::shared(Box::pin(stop));
    let (health, health_service) = tonic_health::server::health_reporter();
    for service in HEALTH_SERVICES {
        health.set_service_status(service, ServingStatus::NotServing).await;
    }
    health.set_service_status(LIVENESS_SERVICE, ServingStatus::Serving).await;
    // Serve health and reflection right away: probes must get NOT_SERVING, not a refused
    // connection, while the ranks come up.
    let listener = Listener::bind(&options.listen).await?;
    tracing::info!(listen = %listener.local_address()?, ranks = options.ranks.len(), "coordinator listening");

    let (coordinator_sender, coordinator_receiver) = tokio::sync::watch::channel::<Option<Arc<Coordinator>>>(None);
    let metrics = Arc::new(CoordinatorMetrics::new());
    if let Some(address) = options.metrics_listen.clone() {
        let (metrics, cell) = (metrics.clone(), coordinator_receiver.clone());
        tokio::spawn(async move {
            let render = move || metrics.render(&occupancy(&cell));
            if let Err(err) = crate::metrics::serve(&address, render).await {
                tracing::error!(error = %format!("{err:#}"), "metrics server stopped");
            }
        });
    }
    let http = match &options.http_listen {
        Some(address) => {
            let api = service::Api::new(coordinator_receiver.clone(), options.limits.request.clone());
            Some(http::HttpServer::start(address, api, options.tokens.api.clone(), &options.limits).await?)
        }
        None => None,
    };
    let (stop_server, server_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(service::serve(
        health_service,
        coordinator_receiver,
        options.limits.clone(),
        options.tokens.clone(),
        options.tls.clone(),
        listener.into_incoming(options.limits.max_connections, "public API"),
        async move {
            let _ = server_stopped.await;
        },
    ));

    let startup = async {
        let ranks =
            RankSet::connect(&options.ranks, options.rank_patience, options.tokens.cluster.as_ref(), options.rank_tls.as_ref())
                .await?;
        let supervisor = Arc::new(Supervisor {
            ranks,
            epoch: AtomicU64::new(0),
            step_lock: Mutex::new(()),
            recovering: Mutex::new(()),
            group_ok: watch::channel(false).0,
            health,
            init_timeout: options.init_timeout,
            recovery_timeout: options.recovery_timeout,
            load_timeout: options.load_timeout,
            loaded: Mutex::new(Vec::new()),
            draining: AtomicBool::new(false),
        });
        supervisor.bootstrap(options.init_timeout).await?;
        let coordinator = Arc::new(Coordinator {
            supervisor: supervisor.clone(),
            models: RwLock::new(HashMap::new()),
            default_model: RwLock::new(None),
            scheduler: options.scheduler.clone(),
            metrics: metrics.clone(),
            engines: Mutex::new(HashMap::new()),
            admin: Mutex::new(()),
        });
        let model_id = options.model_id.clone().unwrap_or_else(|| default_model_id(&options.model));
        coordinator.load_model(&model_id, &options.model, &options.weights).await?;
        supervisor.set_group_ok(true).await;
        tokio::spawn(supervisor.clone().watch_ranks());
        anyhow::Ok(coordinator)
    };
    let coordinator = tokio::select! {
        result = startup => result?,
        _ = stop.clone() => {
            tracing::info!("stopped during startup");
            server.abort();
            return Ok(());
        }
    };
    let _ = coordinator_sender.send(Some(coordinator.clone()));
    tracing::info!("coordinator serving");
    tokio::select! {
        result = &mut server => {
            // The server ended by itself: an error, not a shutdown.
            result.context("server task panicked")?.context("serving the public API")?;
        }
        _ = stop.clone() => {
            coordinator.drain(options.shutdown_grace).await;
            let _ = stop_server.send(());
            if let Some(http) = http {
                http.stop().await;
            }
            match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
                Ok(result) => result.context("server task panicked")?.context("serving the public API")?,
                Err(_) => {
                    tracing::warn!("connections did not close within 5 s; closing them");
                    server.abort();
                }
            }
        }
    }
    tracing::info!("shutting down the ranks");
    coordinator.supervisor.ranks.shutdown().await;
    Ok(())
}

/// Running, waiting and KV figures summed over the served models, for the metrics gauges.
fn occupancy(cell: &tokio::sync::watch::Receiver<Option<Arc<Coordinator>>>) -> Occupancy {
    let mut total = Occupancy::default();
    let Some(coordinator) = cell.borrow().clone() else { return total };
    let Ok(models) = coordinator.models.try_read() else { return total };
    for model in models.values() {
        total.running += model.stats.active_sequences.load(Ordering::Relaxed);
        total.waiting += model.stats.waiting.load(Ordering::Relaxed);
        total.kv_reserved_tokens += model.stats.kv_reserved_tokens.load(Ordering::Relaxed);
        total.kv_capacity_tokens += model.kv_capacity_tokens as u64;
    }
    total
}

/// The ranks' block pools as the coordinator counts them: a recurrent state takes as many
/// blocks' worth of the budget as its bytes need.
fn pool_geometry(info: &rank_pb::ShardInfo) -> PoolGeometry {
    let state_units = info.recurrent_state_bytes.div_ceil(info.kv_block_bytes.max(1)) as usize;
    PoolGeometry {
        blocks: info.kv_blocks as usize,
        block_size: (info.kv_block_size as usize).max(1),
        state_units,
        recurrent: info.recurrent_state_bytes > 0,
    }
}

/// A model's id when none is given: its directory name.
pub fn default_model_id(path: &Path) -> String {
    if let Some(hub) = path.to_str().and_then(HubModel::parse) {
        return hub.model_id().to_owned();
    }
    path.file_name().and_then(|n| n.to_str()).unwrap_or("default").to_owned()
}
