//! No request and no partial failure may hurt anyone else: a client that stops reading, requests
//! with huge fields, a model unloaded mid-stream, a request the ranks refuse, and a rank lost
//! while two models stream. Real `tpserve serve` processes at TP 2, real sockets and gRPC; the
//! reader that stops is a raw HTTP/2 client that never reopens its flow-control window.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use tonic::Code;
use tonic::transport::Channel;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::admin_client::AdminClient;
use tpserve::proto::v1::generator_client::GeneratorClient;

async fn channel(address: &str) -> Channel {
    let address: Address = address.parse().unwrap();
    net::connect(&address, Duration::from_secs(10)).await.unwrap()
}

async fn client(address: &str) -> GeneratorClient<Channel> {
    GeneratorClient::new(channel(address).await)
}

fn greedy(max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt_ids: common::expected("qwen3_a")[1].ids.clone(),
        params: Some(pb::GenerationParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            seed: Some(1),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn on_model(mut request: pb::GenerateRequest, model: &str) -> pb::GenerateRequest {
    request.model = model.to_owned();
    request
}

/// A stream read to its end: its token ids, its decode rate (tokens/s after the first token),
/// and the status it ended with, if it failed.
struct Outcome {
    ids: Vec<u32>,
    rate: f64,
    error: Option<tonic::Status>,
}

async fn read_stream(mut stream: tonic::Streaming<pb::GenerateResponse>, mut ids: Vec<u32>) -> Outcome {
    let mut first = None;
    let mut decoded = 0usize;
    let error = loop {
        match stream.message().await {
            Ok(Some(message)) => {
                if let Some(id) = message.token_id {
                    ids.push(id);
                    match first {
                        None => first = Some(Instant::now()),
                        Some(_) => decoded += 1,
                    }
                }
            }
            Ok(None) => break None,
            Err(status) => break Some(status),
        }
    };
    let seconds = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    Outcome { ids, rate: if seconds > 0.0 { decoded as f64 / seconds } else { 0.0 }, error }
}

async fn run_stream(address: &str, request: pb::GenerateRequest) -> Outcome {
    let stream = client(address).await.generate(request).await.unwrap().into_inner();
    read_stream(stream, Vec::new()).await
}

/// Reads `count` tokens of a stream and hands it back for the rest.
async fn start_stream(address: &str, request: pb::GenerateRequest, count: usize) -> (tonic::Streaming<pb::GenerateResponse>, Vec<u32>) {
    let mut stream = client(address).await.generate(request).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while ids.len() < count {
        ids.extend(stream.message().await.unwrap().expect("the stream ended early").token_id);
    }
    (stream, ids)
}

async fn active_sequences(address: &str, model: &str) -> u32 {
    let request = pb::ModelInfoRequest { model: model.to_owned() };
    client(address).await.model_info(request).await.unwrap().into_inner().active_sequences
}

fn unix_path(address: &str) -> &Path {
    Path::new(address.strip_prefix("unix://").unwrap())
}

/// A Generate call over a raw HTTP/2 connection whose per-stream window is `window` bytes and
/// is never reopened: once that much arrived, the server can send the stream nothing more.
async fn stalled_generate(
    connection: &mut h2::client::SendRequest<bytes::Bytes>,
    request: &pb::GenerateRequest,
) -> h2::RecvStream {
    let http_request = http::Request::builder()
        .method("POST")
        .uri("http://localhost/tpserve.v1.Generator/Generate")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let mut ready = connection.clone().ready().await.unwrap();
    let (response, mut send) = ready.send_request(http_request, false).unwrap();
    let message = prost::Message::encode_to_vec(request);
    let mut frame = vec![0u8];
    frame.extend((message.len() as u32).to_be_bytes());
    frame.extend(message);
    send.send_data(frame.into(), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body()
}

async fn raw_connection(path: &Path, window: u32) -> h2::client::SendRequest<bytes::Bytes> {
    let io = tokio::net::UnixStream::connect(path).await.unwrap();
    let (sender, connection) = h2::client::Builder::new().initial_window_size(window).handshake(io).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    sender
}

/// Reads what is left of a raw stream (opening the window as it goes): (grpc-status,
/// grpc-message) from its trailers.
async fn finish_raw(mut body: h2::RecvStream) -> (String, String) {
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        body.flow_control().release_capacity(chunk.len()).unwrap();
    }
    let trailers = body.trailers().await.unwrap().expect("trailers");
    let field = |name: &str| trailers.get(name).map(|v| percent_decode(v.to_str().unwrap())).unwrap_or_default();
    (field("grpc-status"), field("grpc-message"))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(byte) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One `GET /metrics` over plain HTTP/1.0.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find(|line| line.starts_with(series))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// Resident memory of a process in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib / 1024
}

/// These tests compare speeds and count recoveries, which a loaded machine distorts (a rank
/// too slow to answer the watchdog is rightly recovered): they run one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn recoveries(log: &str) -> usize {
    log.matches("rank group lost; recovering").count()
}

/// Four streams whose client stops reading (three sharing one connection) must not slow a
/// fifth: they are cut off once 32 messages behind, with RESOURCE_EXHAUSTED, while their
/// connections stay open.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_slow_anyone_else() {
    let _serial = one_at_a_time();
    let metrics_port = common::free_port();
    let metrics = format!("127.0.0.1:{metrics_port}");
    let server = common::Served::start_with("qwen3_a", 2, &["--stream-buffer", "32", "--metrics-listen", &metrics]);
    let solo = run_stream(&server.address, greedy(300)).await;
    assert!(solo.error.is_none() && solo.ids.len() == 300);

    let path = unix_path(&server.address);
    let mut shared = raw_connection(path, 64).await;
    let mut own = raw_connection(path, 64).await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stalled_generate(&mut shared, &greedy(3000)).await);
    }
    stalled.push(stalled_generate(&mut own, &greedy(3000)).await);

    let beside = tokio::time::timeout(Duration::from_secs(120), run_stream(&server.address, greedy(300)))
        .await
        .expect("a stream beside stalled readers must not freeze");
    assert!(beside.error.is_none(), "{:?}", beside.error);
    assert_eq!(beside.ids, solo.ids);

    // The stalled streams were cut off, their sequences freed, while their sockets stay open.
    let deadline = Instant::now() + Duration::from_secs(30);
    while active_sequences(&server.address, "").await > 0 {
        assert!(Instant::now() < deadline, "the stalled streams still hold sequences");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Alone again, with the stalled connections still open: the solo figure is the mean of the
    // runs before and after, so a machine that slows down meanwhile does not fail the test.
    let after = run_stream(&server.address, greedy(300)).await;
    let alone = (solo.rate + after.rate) / 2.0;
    println!(
        "alone {:.0} and {:.0} tokens/s, beside four stalled readers {:.0} tokens/s",
        solo.rate, after.rate, beside.rate
    );
    assert!(beside.rate >= 0.5 * alone, "beside stalled readers: {:.0} tokens/s, alone {alone:.0}", beside.rate);
    let text = scrape(metrics_port);
    assert_eq!(counter(&text, "tpserve:request_failure_total{reason=\"slow_client\"}"), 4, "{text}");
    for body in stalled {
        let (status, message) = finish_raw(body).await;
        assert_eq!(status, "8", "RESOURCE_EXHAUSTED expected: {message}");
        assert!(message.contains("32 messages behind") && message.contains("--stream-buffer"), "{message}");
    }
    assert!(server.log().contains("a client stopped reading its stream; cutting it off"));
}

/// Huge stop lists, prompt texts, chats and Tokenize texts are refused before they cost
/// anything, with INVALID_ARGUMENT naming the limit; a stream running meanwhile keeps its speed
/// and the coordinator's memory stays flat.
#[tokio::test(flavor = "multi_thread")]
async fn huge_fields_are_refused_before_they_cost_anything() {
    let _serial = one_at_a_time();
    let server = common::Served::start("qwen3_a", 2);
    let solo = run_stream(&server.address, greedy(300)).await;
    let rss_before = rss_mib(server.child.id());
    let address = server.address.clone();
    let background = tokio::spawn(async move { run_stream(&address, greedy(300)).await });

    let refused = |status: tonic::Status, mentions: &[&str]| {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        for mention in mentions {
            assert!(status.message().contains(mention), "{mention:?} not in {:?}", status.message());
        }
    };
    // 8 requests with 4,000 stop strings of 1,000 bytes each, all at once.
    let stops: Vec<String> = (0..4000).map(|i| format!("{i:04}{}", "x".repeat(996))).collect();
    let calls = (0..8).map(|_| {
        let mut request = greedy(300);
        if let Some(params) = request.params.as_mut() {
            params.stop = stops.clone();
        }
        let address = server.address.clone();
        async move { client(&address).await.generate(request).await }
    });
    for result in futures::future::join_all(calls).await {
        refused(result.err().expect("4,000 stop strings must be refused"), &["4000 stop sequences", "at most 64", "--max-stop-sequences"]);
    }
    let mut long_stop = greedy(10);
    long_stop.params.as_mut().unwrap().stop = vec!["y".repeat(300)];
    refused(client(&server.address).await.generate(long_stop).await.unwrap_err(), &["300 bytes", "at most 256", "--max-stop-bytes"]);

    // Four 3.9 MB prompt texts at once.
    let text = "hello world ".repeat(325_000);
    let calls = (0..4).map(|_| {
        let request = pb::GenerateRequest { prompt: text.clone(), ..Default::default() };
        let address = server.address.clone();
        async move { client(&address).await.generate(request).await }
    });
    for result in futures::future::join_all(calls).await {
        refused(result.err().expect("a 3.9 MB prompt must be refused"), &["3900000 bytes", "--max-prompt-bytes"]);
    }
    let tokenize = pb::TokenizeRequest { text: text.clone(), ..Default::default() };
    refused(client(&server.address).await.tokenize(tokenize).await.unwrap_err(), &["--max-prompt-bytes"]);
    let message = |content: &str| pb::ChatMessage { role: "user".into(), content: content.into(), ..Default::default() };
    let many = pb::ChatRequest { messages: (0..2000).map(|_| message("hi")).collect(), ..Default::default() };
    refused(client(&server.address).await.chat(many).await.unwrap_err(), &["2000 chat messages", "--max-chat-messages"]);
    let big = pb::ChatRequest { messages: vec![message(&text)], ..Default::default() };
    refused(client(&server.address).await.chat(big).await.unwrap_err(), &["--max-prompt-bytes"]);

    let beside = background.await.unwrap();
    let rss_after = rss_mib(server.child.id());
    println!(
        "stream alone {:.0} tokens/s, beside the huge requests {:.0} tokens/s; coordinator RSS {rss_before} -> {rss_after} MiB",
        solo.rate, beside.rate
    );
    assert_eq!(beside.ids, solo.ids);
    assert!(beside.rate >= 0.5 * solo.rate, "{:.0} against {:.0} tokens/s alone", beside.rate, solo.rate);
    assert!(rss_after < rss_before + 150, "coordinator memory grew from {rss_before} to {rss_after} MiB");
    // Within the limits, the same kinds of request still work.
    let mut fine = greedy(8);
    fine.params.as_mut().unwrap().stop = (0..64).map(|i| format!("never-{i}")).collect();
    assert!(run_stream(&server.address, fine).await.error.is_none());
}

fn admin_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("authorization", "Bearer admin-secret".parse().unwrap());
    request
}

async fn load(admin: &mut AdminClient<Channel>, id: &str, fixture: &str) {
    let path = common::fixture(fixture).display().to_string();
    let request = pb::LoadModelRequest { model_id: id.into(), path, dtype: String::new(), quantize: String::new(), matmul_precision: String::new(), kv_cache_dtype: String::new() };
    admin.load_model(admin_request(request)).await.unwrap();
}

/// Unloading a model with streams in flight ends those streams with UNAVAILABLE ("being
/// unloaded") and its step loop, and touches nothing else: no recovery, and a stream of the
/// other model runs to the tokens of an undisturbed run. Load/unload cycles leave no step loop
/// behind.
#[tokio::test(flavor = "multi_thread")]
async fn unloading_a_model_mid_stream_touches_no_other_model() {
    let _serial = one_at_a_time();
    let server = common::Served::start_with_env("qwen3_a", 2, &[], &[("TPSERVE_ADMIN_TOKEN", "admin-secret")]);
    let mut admin = AdminClient::new(channel(&server.address).await);
    load(&mut admin, "second", "qwen3_b").await;
    let undisturbed = run_stream(&server.address, greedy(600)).await;

    let (default_stream, default_ids) = start_stream(&server.address, greedy(600), 5).await;
    let other = tokio::spawn(read_stream(default_stream, default_ids));
    let mut doomed = Vec::new();
    for _ in 0..3 {
        doomed.push(start_stream(&server.address, on_model(greedy(3000), "second"), 10).await);
    }
    admin.unload_model(admin_request(pb::UnloadModelRequest { model_id: "second".into() })).await.unwrap();
    for (stream, ids) in doomed {
        let outcome = read_stream(stream, ids).await;
        let status = outcome.error.expect("a stream of the unloaded model must end with an error");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("\"second\" is being unloaded"), "{}", status.message());
    }
    let other = other.await.unwrap();
    assert!(other.error.is_none(), "{:?}", other.error);
    assert_eq!(other.ids, undisturbed.ids, "the other model's stream must be undisturbed");

    // New requests for it are refused, and the ranks no longer hold it.
    let status = client(&server.address).await.generate(on_model(greedy(4), "second")).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let listed = admin.list_models(admin_request(pb::ListModelsRequest {})).await.unwrap().into_inner();
    assert_eq!(listed.models.iter().map(|m| m.model_id.as_str()).collect::<Vec<_>>(), ["qwen3_a"]);

    for _ in 0..4 {
        load(&mut admin, "second", "qwen3_b").await;
        let (stream, _) = start_stream(&server.address, on_model(greedy(3000), "second"), 2).await;
        admin.unload_model(admin_request(pb::UnloadModelRequest { model_id: "second".into() })).await.unwrap();
        drop(stream);
    }
    let log = server.log();
    assert_eq!(recoveries(&log), 0, "unloading must not recover the group:\n{log}");
    assert!(!log.contains("step failed"), "{log}");
    assert_eq!(log.matches("model unloaded; its step loop ends").count(), 5, "every unload ends its step loop");
    assert_eq!(active_sequences(&server.address, "").await, 0);
}

/// A request every rank refuses (here by fault injection, as a rank refuses any bad request)
/// fails alone with the ranks' status, whether it ran alone or batched with another stream;
/// the group is not recovered and the other stream is untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_the_ranks_refuse_fails_alone() {
    let _serial = one_at_a_time();
    let server = common::Served::start_with_env("qwen3_a", 2, &[], &[("TPSERVE_FAULT_REFUSE_SEED", "4242")]);
    let undisturbed = run_stream(&server.address, greedy(400)).await;
    let refused_request = || {
        let mut request = greedy(50);
        let params = request.params.as_mut().unwrap();
        params.temperature = Some(0.8);
        params.seed = Some(4242);
        request
    };
    // Batched: it joins the running stream's steps.
    let (stream, ids) = start_stream(&server.address, greedy(400), 10).await;
    let running = tokio::spawn(read_stream(stream, ids));
    for _ in 0..3 {
        let outcome = run_stream(&server.address, refused_request()).await;
        let status = outcome.error.expect("the refused request must fail");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("refused the request") && status.message().contains("fault injection"), "{}", status.message());
    }
    let running = running.await.unwrap();
    assert!(running.error.is_none(), "{:?}", running.error);
    assert_eq!(running.ids, undisturbed.ids);
    // Alone in its step.
    let outcome = run_stream(&server.address, refused_request()).await;
    assert_eq!(outcome.error.map(|s| s.code()), Some(Code::InvalidArgument));
    let log = server.log();
    assert_eq!(recoveries(&log), 0, "a refused request must not recover the group:\n{log}");
    assert!(log.contains("the ranks refused a batched step; running its sequences one by one"), "{log}");
    assert_eq!(run_stream(&server.address, greedy(400)).await.ids, undisturbed.ids);
}

/// A rank killed while two models stream: one recovery, after which both models' sequences
/// resume in the new epoch (no second recovery from the model whose step did not fail) and
/// finish with the tokens of an undisturbed run.
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_lost_while_two_models_stream_recovers_once() {
    let _serial = one_at_a_time();
    let server = common::Served::start_with_env("qwen3_a", 2, &[], &[("TPSERVE_ADMIN_TOKEN", "admin-secret")]);
    let mut admin = AdminClient::new(channel(&server.address).await);
    load(&mut admin, "twin", "qwen3_a").await;
    let undisturbed = run_stream(&server.address, greedy(600)).await;
    let (first, first_ids) = start_stream(&server.address, greedy(600), 20).await;
    let (second, second_ids) = start_stream(&server.address, on_model(greedy(600), "twin"), 20).await;
    let first = tokio::spawn(read_stream(first, first_ids));
    let second = tokio::spawn(read_stream(second, second_ids));
    unsafe { libc::kill(common::rank_pid(server.child.id(), 1), libc::SIGKILL) };
    for outcome in [first.await.unwrap(), second.await.unwrap()] {
        assert!(outcome.error.is_none(), "the streams must pause, not fail: {:?}", outcome.error);
        assert_eq!(outcome.ids, undisturbed.ids);
    }
    let log = server.log();
    assert_eq!(recoveries(&log), 1, "one lost rank, one recovery:\n{log}");
}

/// Health as the server reports it over an existing connection (a new one may be impossible
/// while the server is out of descriptors).
async fn health(channel: &Channel) -> Option<i32> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let request = HealthCheckRequest { service: String::new() };
    HealthClient::new(channel.clone()).check(request).await.ok().map(|r| r.into_inner().status)
}

const SERVING: i32 = 1;

/// Sets the soft RLIMIT_NOFILE of process `pid` and returns the old limits.
fn set_open_files_limit(pid: i32, soft: u64) -> libc::rlimit {
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit with a null new limit only reads the current one into `old`.
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) }, 0);
    let new = libc::rlimit { rlim_cur: soft, rlim_max: old.rlim_max };
    // SAFETY: both pointers are to live rlimit values; the target is our own child.
    assert_eq!(unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) }, 0);
    old
}

/// With the server out of file descriptors, a killed rank cannot be restarted: `serve` logs
/// each failed start and keeps retrying with backoff, health says NOT_SERVING, and the accept
/// loops of the public and metrics ports back off instead of spinning (a few log lines, not
/// megabytes). Once descriptors are back the rank starts, the group recovers and serves the
/// same tokens as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_that_cannot_be_restarted_is_retried_until_it_can() {
    let _serial = one_at_a_time();
    let metrics_port = common::free_port();
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let server = common::Served::start_with("qwen3_a", 2, &["--metrics-listen", &metrics_listen]);
    let undisturbed = run_stream(&server.address, greedy(64)).await;
    let kept = channel(&server.address).await;
    assert_eq!(health(&kept).await, Some(SERVING));

    // Descriptors 0..8 (stdio, the runtime's epoll and wakers) stay open: with the soft limit at
    // 8, every new descriptor fails with EMFILE.
    let serve = server.child.id() as i32;
    let old = set_open_files_limit(serve, 8);
    unsafe { libc::kill(common::rank_pid(server.child.id(), 1), libc::SIGKILL) };
    // Clients knock on both ports meanwhile; the server cannot accept them.
    let knocking_tcp: Vec<_> = (0..20).filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", metrics_port)).ok()).collect();
    let knocking_unix: Vec<_> = (0..20).filter_map(|_| std::os::unix::net::UnixStream::connect(unix_path(&server.address)).ok()).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.log().matches("cannot start rank process; retrying").count() < 3 {
        assert!(Instant::now() < deadline, "no retried start within 30 s:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_ne!(health(&kept).await, Some(SERVING), "health must not say SERVING while a rank is missing");
    set_open_files_limit(serve, old.rlim_cur);
    drop((knocking_tcp, knocking_unix));

    common::wait_serving(&server.address, Duration::from_secs(90));
    assert_eq!(run_stream(&server.address, greedy(64)).await.ids, undisturbed.ids);
    let log = server.log();
    let accept_warnings = log.matches("cannot accept connections").count();
    assert!((1..=12).contains(&accept_warnings), "accept failures must be paced and logged sparingly ({accept_warnings} warnings):\n{log}");
    assert!(log.len() < 1 << 20, "the log grew to {} bytes", log.len());
    assert!(log.contains("accepting connections again"), "{log}");
}

/// The metrics port closes idle keep-alive connections, connections that never send a request
/// and slowloris clients after its header timeout (10 s), and past its connection cap (64) a
/// scraper waits for a slot rather than a descriptor each.
#[test]
fn metrics_connections_are_closed_after_the_timeout() {
    use std::io::{Read, Write};
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let mut rank = common::tpserve()
        .args(["rank", "--listen", &format!("unix://{}", dir.path().join("rank.sock").display())])
        .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
        .env("TPSERVE_CLUSTER_TOKEN", "test-token")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let connect = || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(stream) => break stream,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                Err(err) => panic!("metrics port never opened: {err}"),
            }
        }
    };
    // Waits for the server to close `stream` (EOF or reset), reading whatever it sends first.
    let closed_after = |mut stream: std::net::TcpStream, started: Instant| {
        stream.set_read_timeout(Some(Duration::from_secs(40))).unwrap();
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
        started.elapsed()
    };
    assert!(scrape_when_up(port).contains("tpserve:rank_step_duration_seconds"));

    let started = Instant::now();
    let silent = connect();
    let mut slow = connect();
    let mut keep_alive = connect();
    keep_alive.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let slowloris = std::thread::spawn(move || {
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
        for _ in 0..30 {
            std::thread::sleep(Duration::from_secs(1));
            if slow.write_all(b"X").is_err() {
                break;
            }
        }
        slow
    });
    for (what, elapsed) in [
        ("a connection that never sends a request", closed_after(silent, started)),
        ("an idle keep-alive connection", closed_after(keep_alive, started)),
        ("a slowloris", closed_after(slowloris.join().unwrap(), started)),
    ] {
        assert!(elapsed < Duration::from_secs(25), "{what} stayed open {elapsed:?}");
    }

    // 80 silent connections, past the cap: a scrape still gets through once they time out.
    let hogs: Vec<_> = (0..80).map(|_| connect()).collect();
    let started = Instant::now();
    assert!(scrape_when_up(port).contains("tpserve:rank_step_duration_seconds"));
    assert!(started.elapsed() < Duration::from_secs(40), "a scrape waited {:?} behind idle connections", started.elapsed());
    drop(hogs);
    common::terminate(&mut rank);
}

/// A scrape that waits (up to 60 s) for the port to accept and answer.
fn scrape_when_up(port: u16) -> String {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = std::net::TcpStream::connect(("127.0.0.1", port)).and_then(|mut stream| {
            stream.set_read_timeout(Some(Duration::from_secs(60)))?;
            stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
            let mut text = String::new();
            stream.read_to_string(&mut text)?;
            Ok(text)
        });
        match attempt {
            Ok(text) if !text.is_empty() => return text,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            other => panic!("no metrics from port {port}: {other:?}"),
        }
    }
}

/// A panic in a rank's device worker (fault injection, as a kernel bug would) ends that rank
/// process; `serve` restarts it, the group recovers once and the stream resumes with the tokens
/// of an undisturbed run.
#[tokio::test(flavor = "multi_thread")]
async fn a_device_worker_panic_restarts_the_rank_and_streams_resume() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let trigger = dir.path().join("panic-now");
    let trigger_env = trigger.to_str().unwrap();
    let server = common::Served::start_with_env("qwen3_a", 2, &[], &[("TPSERVE_FAULT_PANIC_FILE", trigger_env)]);
    let undisturbed = run_stream(&server.address, greedy(400)).await;
    let (stream, ids) = start_stream(&server.address, greedy(400), 20).await;
    let running = tokio::spawn(read_stream(stream, ids));
    std::fs::write(&trigger, b"").unwrap();
    let outcome = running.await.unwrap();
    assert!(outcome.error.is_none(), "the stream must pause, not fail: {:?}", outcome.error);
    assert_eq!(outcome.ids, undisturbed.ids);
    assert!(!trigger.exists(), "a rank must have taken the fault");
    let log = server.log();
    assert!(log.contains("the device worker panicked; ending the rank process"), "{log}");
    assert!(log.contains("rank process exited; restarting it"), "{log}");
    assert_eq!(recoveries(&log), 1, "{log}");
    common::wait_serving(&server.address, Duration::from_secs(30));
}
