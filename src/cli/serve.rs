//! `tpserve rank`, `tpserve serve`, and the local cluster they share with `tpserve demo`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use super::device::{ServeDevice, parse_device};
use super::{RankArgs, SchedulerArgs, ServeArgs, available_cores};
use crate::auth::{CLUSTER_TOKEN_ENV, Secret, load_token};
use crate::coordinator::{self, CoordinatorOptions, Tokens, WeightFormat};
use crate::model::hub::HubModel;
use crate::net::Address;
use crate::rank::server::{RankOptions, run as run_rank_server};

pub async fn run_rank(args: RankArgs) -> Result<()> {
    let (device, device_name) = parse_device(&args.device)?;
    if let Some(gib) = args.kv_cache_gib {
        if !(gib.is_finite() && gib > 0.0) {
            bail!("--kv-cache-gib must be a positive number of GiB, got {gib}");
        }
    }
    let threads = args.threads.unwrap_or_else(available_cores);
    let advertise_host = args.advertise_host.clone().or_else(local_hostname);
    run_rank_server(RankOptions {
        listen: args.listen,
        device,
        device_name,
        threads,
        rendezvous_bind: args.rendezvous,
        advertise_host,
        init_timeout: Duration::from_secs(120),
        collective_timeout: Duration::from_secs(args.collective_timeout_secs),
        kv_cache_bytes: args.kv_cache_gib.map(|gib| (gib * (1u64 << 30) as f64) as u64),
        cluster_token: load_token(args.cluster_token_file.as_deref(), CLUSTER_TOKEN_ENV)?,
        tls: args.tls.config()?,
        metrics_listen: args.metrics_listen,
    })
    .await
}

fn local_hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty())
}

pub async fn run_serve(args: ServeArgs, otlp_endpoint: Option<String>) -> Result<()> {
    let device = ServeDevice::choose(args.device.as_deref(), args.tp)?;
    tracing::info!(device = ?device, tp = args.tp, "starting the ranks");
    let ranks = RankSettings { threads: args.threads, kv_cache_gib: args.kv_cache_gib, log_filter: None, otlp_endpoint, device };
    let tokens = args.tokens.tokens(None)?;
    let server = ServerSettings {
        tokens,
        tls: args.tls.config()?,
        metrics_listen: args.metrics_listen.clone(),
        http_listen: args.http_listen.clone(),
    };
    let cluster = LocalCluster::start(&args.model, args.tp, args.weights.format()?, ranks, &args.scheduler, server, args.listen.clone()).await?;
    // A coordinator that ends on its own (its model cannot be loaded, say) ends serve with its
    // error, rather than leaving a process that will never serve.
    tokio::select! {
        _ = super::termination_signal() => tracing::info!("stopping"),
        _ = cluster.coordinator_ended() => {}
    }
    cluster.shutdown().await
}

/// How `LocalCluster` starts its rank processes.
#[derive(Debug, Clone, Default)]
pub struct RankSettings {
    /// compute threads per rank (default: cores / tp)
    pub threads: Option<usize>,
    pub kv_cache_gib: Option<f64>,
    /// RUST_LOG for the ranks (default: inherited)
    pub log_filter: Option<String>,
    /// where the ranks export traces (default: inherited environment)
    pub otlp_endpoint: Option<String>,
    /// CPU ranks, or rank i on cuda:i
    pub device: ServeDevice,
}

/// How `LocalCluster` serves its public API.
#[derive(Debug, Clone, Default)]
pub struct ServerSettings {
    pub tokens: Tokens,
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    pub metrics_listen: Option<String>,
    pub http_listen: Option<String>,
}

/// N rank processes spawned from this binary plus an in-process coordinator. Ranks that die
/// are restarted (the coordinator then recovers the group); when this process dies, the
/// kernel takes the ranks with it (PR_SET_PDEATHSIG), so no orphans are left.
pub struct LocalCluster {
    pub listen: Address,
    coordinator: JoinHandle<Result<()>>,
    stop_coordinator: Arc<tokio::sync::Notify>,
    supervisors: Vec<JoinHandle<()>>,
    /// set when shutdown begins: ranks that exit are no longer restarted
    draining: Arc<AtomicBool>,
    /// set once the coordinator is done: ranks still running are terminated
    stopping: Arc<AtomicBool>,
    shutdown_grace: Duration,
    _socket_dir: tempfile::TempDir,
}

impl LocalCluster {
    pub async fn start(
        model: &Path,
        tp: usize,
        weights: WeightFormat,
        settings: RankSettings,
        scheduler: &SchedulerArgs,
        server: ServerSettings,
        listen: Address,
    ) -> Result<Self> {
        let ServerSettings { mut tokens, tls, metrics_listen, http_listen } = server;
        // This process starts both sides, so it can make up the cluster token itself; the
        // ranks get it through their environment, not their command line.
        let cluster_token = tokens.cluster.clone().unwrap_or_else(Secret::random);
        tokens.cluster = Some(cluster_token.clone());
        if tp == 0 {
            bail!("--tp must be at least 1");
        }
        let socket_dir = tempfile::Builder::new().prefix("tpserve-").tempdir().context("cannot create a socket directory")?;
        let threads = settings.threads.unwrap_or_else(|| (available_cores() / tp).max(1));
        let exe = std::env::current_exe().context("cannot find the tpserve executable")?;
        let draining = Arc::new(AtomicBool::new(false));
        let stopping = Arc::new(AtomicBool::new(false));
        let mut ranks = Vec::with_capacity(tp);
        let mut supervisors = Vec::with_capacity(tp);
        for rank in 0..tp {
            let address = Address::Unix(socket_dir.path().join(format!("rank-{rank}.sock")));
            let mut args = vec![
                "rank".to_owned(),
                "--listen".to_owned(),
                address.to_string(),
                "--threads".to_owned(),
                threads.to_string(),
                "--rendezvous".to_owned(),
                format!("unix://{}", socket_dir.path().join(format!("comm-{rank}.sock")).display()),
            ];
            if let Some(gib) = settings.kv_cache_gib {
                args.extend(["--kv-cache-gib".to_owned(), gib.to_string()]);
            }
            args.extend(["--device".to_owned(), settings.device.rank_device(rank)]);
            let mut env = vec![(CLUSTER_TOKEN_ENV.to_owned(), cluster_token.expose().to_owned())];
            if let Some(filter) = &settings.log_filter {
                env.push(("RUST_LOG".to_owned(), filter.clone()));
            }
            if let Some(endpoint) = &settings.otlp_endpoint {
                env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), endpoint.clone()));
            }
            let flags = (draining.clone(), stopping.clone());
            supervisors.push(tokio::spawn(supervise_rank(exe.clone(), args, env, rank, flags)));
            ranks.push(address);
        }
        let options = CoordinatorOptions {
            ranks,
            model: if model.to_str().and_then(HubModel::parse).is_some() { model.to_owned() } else { absolute(model)? },
            model_id: None,
            weights,
            listen: listen.clone(),
            scheduler: scheduler.config()?,
            limits: scheduler.limits()?,
            rank_patience: Duration::from_secs(120),
            init_timeout: Duration::from_secs(120),
            recovery_timeout: Duration::from_secs(120),
            load_timeout: scheduler.load_timeout()?,
            shutdown_grace: Duration::from_secs(scheduler.shutdown_grace_secs),
            tokens,
            tls,
            // The ranks are on private Unix sockets.
            rank_tls: None,
            metrics_listen,
            http_listen,
        };
        let stop_coordinator = Arc::new(tokio::sync::Notify::new());
        let stop = stop_coordinator.clone();
        let coordinator = tokio::spawn(async move {
            coordinator::run_until(options, async move { stop.notified().await }).await
        });
        let shutdown_grace = Duration::from_secs(scheduler.shutdown_grace_secs);
        Ok(Self {
            listen,
            coordinator,
            stop_coordinator,
            supervisors,
            draining,
            stopping,
            shutdown_grace,
            _socket_dir: socket_dir,
        })
    }

    /// Stops the coordinator (which drains in-flight requests, then shuts the ranks down), then
    /// makes sure every rank exited.
    pub async fn shutdown(self) -> Result<()> {
        self.draining.store(true, Ordering::SeqCst);
        self.stop_coordinator.notify_one();
        let patience = self.shutdown_grace + Duration::from_secs(15);
        let result = match tokio::time::timeout(patience, self.coordinator).await {
            Ok(joined) => joined.context("coordinator task panicked")?,
            Err(_) => Err(anyhow::anyhow!("the coordinator did not stop within {patience:?}")),
        };
        self.stopping.store(true, Ordering::SeqCst);
        for supervisor in self.supervisors {
            let _ = supervisor.await;
        }
        result
    }

    /// True once the coordinator task has ended (normally only after shutdown).
    pub fn coordinator_finished(&self) -> bool {
        self.coordinator.is_finished()
    }

    /// Resolves once the coordinator task has ended (checked every 200 ms: `shutdown` still
    /// needs the task's handle to collect its result).
    pub async fn coordinator_ended(&self) {
        while !self.coordinator.is_finished() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("invalid model path {}", path.display()))
}

/// Runs one rank process, restarting it whenever it dies before shutdown. Neither a failed start
/// (out of file descriptors or memory, say) nor a crash loop is ever final: each is logged and
/// retried after a backoff that doubles up to 10 s, and resets once a rank has run for a while.
/// Meanwhile the coordinator's watchdog reports the group NOT_SERVING.
async fn supervise_rank(
    exe: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    rank: usize,
    (draining, stopping): (Arc<AtomicBool>, Arc<AtomicBool>),
) {
    let shutting_down = || draining.load(Ordering::SeqCst) || stopping.load(Ordering::SeqCst);
    let mut backoff = RESPAWN_BACKOFF_FIRST;
    let mut restarts = 0u32;
    loop {
        match spawn_rank(&exe, &args, &env) {
            Ok(mut child) => {
                let started = Instant::now();
                let status = wait_or_stop(&mut child, &stopping).await;
                if shutting_down() {
                    return;
                }
                if started.elapsed() >= RESPAWN_HEALTHY_AFTER {
                    backoff = RESPAWN_BACKOFF_FIRST;
                }
                restarts += 1;
                tracing::warn!(rank, ?status, restarts, retry_in_ms = backoff.as_millis() as u64, "rank process exited; restarting it");
            }
            Err(err) => {
                if shutting_down() {
                    return;
                }
                tracing::error!(rank, error = %format!("{err:#}"), retry_in_ms = backoff.as_millis() as u64, "cannot start rank process; retrying");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RESPAWN_BACKOFF_MAX);
        if shutting_down() {
            return;
        }
    }
}

const RESPAWN_BACKOFF_FIRST: Duration = Duration::from_millis(300);
const RESPAWN_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A rank that ran this long before dying was not crash-looping: restart it promptly.
const RESPAWN_HEALTHY_AFTER: Duration = Duration::from_secs(60);

/// Waits for the child; once stopping is set, gives it a grace period, then kills it.
async fn wait_or_stop(child: &mut Child, stopping: &AtomicBool) -> Option<std::process::ExitStatus> {
    loop {
        tokio::select! {
            status = child.wait() => return status.ok(),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if stopping.load(Ordering::SeqCst) {
                    // The coordinator's Shutdown RPC normally ends the rank; SIGTERM, then
                    // SIGKILL, cover a rank that never got it.
                    if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(3), child.wait()).await {
                        return Some(status);
                    }
                    if let Some(pid) = child.id() {
                        // SAFETY: plain kill(2) on our own child's pid.
                        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                    }
                    if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                        return Some(status);
                    }
                    let _ = child.kill().await;
                    return child.wait().await.ok();
                }
            }
        }
    }
}

fn spawn_rank(exe: &Path, args: &[String], env: &[(String, String)]) -> Result<Child> {
    let mut command = Command::new(exe);
    command.args(args).stdin(Stdio::null()).kill_on_drop(true);
    command.envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: prctl and setpgid are async-signal-safe. PDEATHSIG asks the kernel to SIGTERM
    // the child when this process dies, however it dies. Its own process group keeps a
    // terminal's Ctrl-C from reaching the ranks directly: this process drains the in-flight
    // requests first, then shuts them down.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 || libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command.spawn().with_context(|| format!("cannot spawn {}", exe.display()))
}
