//! Prometheus metrics in the text exposition format, served over plain HTTP on their own port.
//!
//! Names follow vLLM's under a `tpserve:` prefix so existing dashboards and alerts carry over.
//! The registry is a handful of atomics: recording a sample never blocks the step loop.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};

/// Latency buckets in seconds, from sub-millisecond decode steps to minute-long requests.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];

/// A cumulative histogram with fixed buckets.
pub struct Histogram {
    buckets: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// sum in nanoseconds (these histograms measure durations)
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn new(buckets: &'static [f64]) -> Self {
        Self { buckets, counts: buckets.iter().map(|_| AtomicU64::new(0)).collect(), count: AtomicU64::new(0), sum_nanos: AtomicU64::new(0) }
    }

    pub fn observe(&self, value: Duration) {
        let seconds = value.as_secs_f64();
        for (bound, count) in self.buckets.iter().zip(&self.counts) {
            if seconds <= *bound {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(value.as_nanos() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in self.buckets.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", count.load(Ordering::Relaxed));
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

fn render_counter(out: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}_total {value}");
}

fn render_gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
}

/// The coordinator's request metrics.
pub struct CoordinatorMetrics {
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// prompt tokens looked up in the prefix cache, and those found there (vLLM's names)
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    failures: Mutex<BTreeMap<&'static str, u64>>,
}

/// Gauges read from the engines when scraped.
#[derive(Default)]
pub struct Occupancy {
    pub running: u64,
    pub waiting: u64,
    pub kv_reserved_tokens: u64,
    pub kv_capacity_tokens: u64,
}

impl CoordinatorMetrics {
    pub fn new() -> Self {
        Self {
            time_to_first_token: Histogram::new(LATENCY_BUCKETS),
            inter_token_latency: Histogram::new(LATENCY_BUCKETS),
            e2e_request_latency: Histogram::new(LATENCY_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            failures: Mutex::new(BTreeMap::new()),
        }
    }

    /// A request that did not finish normally; `reason` is a fixed label value.
    pub fn failure(&self, reason: &'static str) {
        *self.failures.lock().unwrap_or_else(|p| p.into_inner()).entry(reason).or_insert(0) += 1;
    }

    pub fn render(&self, occupancy: &Occupancy) -> String {
        let mut out = String::new();
        self.time_to_first_token.render(&mut out, "tpserve:time_to_first_token_seconds", "Time from request arrival to its first token.");
        self.inter_token_latency.render(&mut out, "tpserve:inter_token_latency_seconds", "Time between consecutive tokens of a stream.");
        self.e2e_request_latency.render(&mut out, "tpserve:e2e_request_latency_seconds", "Time from request arrival to its last message.");
        render_gauge(&mut out, "tpserve:num_requests_running", "Sequences in the running batch.", occupancy.running as f64);
        render_gauge(&mut out, "tpserve:num_requests_waiting", "Requests waiting for admission.", occupancy.waiting as f64);
        let usage = if occupancy.kv_capacity_tokens == 0 {
            0.0
        } else {
            occupancy.kv_reserved_tokens as f64 / occupancy.kv_capacity_tokens as f64
        };
        render_gauge(&mut out, "tpserve:kv_cache_usage_perc", "Fraction of KV cache capacity reserved (0 to 1).", usage);
        render_counter(&mut out, "tpserve:prompt_tokens", "Prompt tokens admitted.", self.prompt_tokens.load(Ordering::Relaxed));
        render_counter(&mut out, "tpserve:generation_tokens", "Tokens generated.", self.generation_tokens.load(Ordering::Relaxed));
        render_counter(
            &mut out,
            "tpserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            self.prefix_cache_queries.load(Ordering::Relaxed),
        );
        render_counter(
            &mut out,
            "tpserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            self.prefix_cache_hits.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP tpserve:request_failure Requests that ended without finishing, by reason.\n# TYPE tpserve:request_failure counter"
        );
        for (reason, count) in self.failures.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "tpserve:request_failure_total{{reason=\"{reason}\"}} {count}");
        }
        out
    }
}

impl Default for CoordinatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// A rank's step and collective timings.
pub struct RankMetrics {
    pub step_duration: Histogram,
    /// time spent inside collectives, in nanoseconds
    pub collective_nanos: AtomicU64,
    pub collective_calls: AtomicU64,
}

impl RankMetrics {
    pub fn new() -> Self {
        Self { step_duration: Histogram::new(LATENCY_BUCKETS), collective_nanos: AtomicU64::new(0), collective_calls: AtomicU64::new(0) }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        self.step_duration.render(&mut out, "tpserve:rank_step_duration_seconds", "Time a rank spends on one GenerateStep.");
        let _ = writeln!(
            out,
            "# HELP tpserve:rank_collective_seconds Time spent inside collectives (all-reduce, gather, ...).\n\
             # TYPE tpserve:rank_collective_seconds counter\ntpserve:rank_collective_seconds_total {}",
            self.collective_nanos.load(Ordering::Relaxed) as f64 / 1e9
        );
        render_counter(&mut out, "tpserve:rank_collective_calls", "Collective operations run.", self.collective_calls.load(Ordering::Relaxed));
        out
    }
}

impl Default for RankMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Scrapers open a connection or two; more than this at once are left in the kernel's backlog.
const METRICS_MAX_CONNECTIONS: usize = 64;
/// A connection must send a request's headers within this time of opening or of its previous
/// response, or it is closed: an idle keep-alive connection and a slowloris alike.
const METRICS_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// No connection lives longer than this, whatever it does.
const METRICS_CONNECTION_LIFETIME: Duration = Duration::from_secs(300);

/// Serves `GET /metrics` with whatever `render` returns, until the process ends.
pub async fn serve(address: &str, render: impl Fn() -> String + Send + Sync + Clone + 'static) -> Result<()> {
    let listener = crate::net::Listener::bind(&crate::net::Address::Tcp(address.to_owned()))
        .await
        .with_context(|| format!("cannot listen for metrics on {address}"))?;
    tracing::info!(address = %listener.local_address()?, "serving Prometheus metrics at /metrics");
    let slots = Arc::new(tokio::sync::Semaphore::new(METRICS_MAX_CONNECTIONS));
    let mut backoff = crate::net::AcceptBackoff::new("metrics");
    loop {
        let connection = listener.accept(&slots, &mut backoff).await;
        let render = render.clone();
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(connection);
            let serving = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(METRICS_HEADER_TIMEOUT)
                .serve_connection(io, hyper::service::service_fn(move |request| respond(request, render.clone())));
            let _ = tokio::time::timeout(METRICS_CONNECTION_LIFETIME, serving).await;
        });
    }
}

async fn respond(
    request: hyper::Request<hyper::body::Incoming>,
    render: impl Fn() -> String,
) -> Result<hyper::Response<http_body_util::Full<bytes::Bytes>>, hyper::http::Error> {
    use hyper::{Response, StatusCode};
    if request.uri().path() == "/metrics" {
        Response::builder()
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(http_body_util::Full::new(bytes::Bytes::from(render())))
    } else {
        Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"not found; try /metrics\n")))
    }
}
