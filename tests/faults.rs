//! Surviving rank loss: kill -9 and SIGSTOP of a rank mid-stream, kill -9 of the coordinator.
//! Real processes throughout; a streaming client must see a pause, not an error, and greedy
//! output identical to an undisturbed run.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

async fn client(address: &str) -> GeneratorClient<Channel> {
    let address: Address = address.parse().unwrap();
    GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap())
}

fn long_greedy() -> pb::GenerateRequest {
    let prompt = &common::expected("qwen3_a")[1];
    pb::GenerateRequest {
        prompt_ids: prompt.ids.clone(),
        params: Some(pb::GenerationParams { max_tokens: Some(600), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

async fn collect(mut stream: tonic::Streaming<pb::GenerateResponse>, mut ids: Vec<u32>) -> Vec<u32> {
    while let Some(message) = stream.message().await.expect("the stream must pause, not fail") {
        ids.extend(message.token_id);
    }
    ids
}

async fn kill_rank_mid_stream(tp: usize, victim: usize) {
    let server = common::Served::start("qwen3_a", tp);
    let undisturbed = collect(client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner(), vec![]).await;
    assert_eq!(undisturbed.len(), 600);

    let mut stream = client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while ids.len() < 20 {
        ids.extend(stream.message().await.unwrap().unwrap().token_id);
    }
    let pid = common::rank_pid(server.child.id(), victim);
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let started = Instant::now();
    let ids = collect(stream, ids).await;
    println!("TP {tp}: rank {victim} killed; stream finished {:?} later", started.elapsed());
    assert_eq!(ids, undisturbed, "output after recovery must equal the undisturbed run");
    let info = client(&server.address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.active_sequences, 0, "{info:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_a_rank_mid_stream_at_tp2() {
    kill_rank_mid_stream(2, 1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_a_rank_mid_stream_at_tp4() {
    kill_rank_mid_stream(4, 2).await;
}

/// A stopped (hung) rank is detected (health NOT_SERVING), and once it continues the group is
/// rebuilt and the stream resumes; the stale step it was in does no harm.
#[tokio::test(flavor = "multi_thread")]
async fn sigstop_of_a_rank_is_detected_and_recovered() {
    let server = common::Served::start("qwen3_a", 2);
    let undisturbed = collect(client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner(), vec![]).await;
    let mut stream = client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while ids.len() < 20 {
        ids.extend(stream.message().await.unwrap().unwrap().token_id);
    }
    let pid = common::rank_pid(server.child.id(), 1);
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Instant::now();
    // Detected within seconds: health goes NOT_SERVING.
    loop {
        let status = common::tpserve().args(["health", "--server", &server.address]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap();
        if !status.success() {
            break;
        }
        assert!(stopped.elapsed() < Duration::from_secs(20), "a stopped rank was not detected");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("stopped rank detected after {:?}", stopped.elapsed());
    tokio::time::sleep(Duration::from_secs(1)).await;
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let ids = collect(stream, ids).await;
    assert_eq!(ids, undisturbed);
    common::wait_serving(&server.address, Duration::from_secs(30));
    // And the server keeps working afterwards.
    let again = collect(client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner(), vec![]).await;
    assert_eq!(again, undisturbed);
}

/// kill -9 of the coordinator: a new coordinator re-initialises the live ranks with a newer
/// epoch, and the ranks drop the old epoch's state.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_coordinator_takes_over_live_ranks() {
    use tpserve::proto::rank::v1::InfoRequest;
    use tpserve::proto::rank::v1::rank_client::RankClient;

    let dir = tempfile::tempdir().unwrap();
    let rank_address = |i: usize| format!("unix://{}", dir.path().join(format!("rank{i}.sock")).display());
    let mut processes: Vec<std::process::Child> = (0..2)
        .map(|i| {
            common::tpserve()
                .args(["rank", "--listen", &rank_address(i), "--threads", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let start_coordinator = |api: &str| {
        common::tpserve()
            .args(["coordinator", "--rank", &rank_address(0), "--rank", &rank_address(1), "--listen", api, "--model"])
            .arg(common::fixture("qwen3_a"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let first_api = format!("unix://{}", dir.path().join("api1.sock").display());
    let mut first = start_coordinator(&first_api);
    common::wait_serving(&first_api, Duration::from_secs(30));
    let mut stream = client(&first_api).await.generate(long_greedy()).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    first.kill().unwrap();
    first.wait().unwrap();
    let rank_epoch = |address: String| async move {
        let address: Address = address.parse().unwrap();
        let channel = net::connect(&address, Duration::from_secs(5)).await.unwrap();
        let info = RankClient::new(channel).info(InfoRequest { protocol_version: tpserve::proto::RANK_PROTOCOL_VERSION }).await;
        info.unwrap().into_inner()
    };
    let old = rank_epoch(rank_address(0)).await;
    assert!(old.initialized);

    let second_api = format!("unix://{}", dir.path().join("api2.sock").display());
    processes.push(start_coordinator(&second_api));
    common::wait_serving(&second_api, Duration::from_secs(30));
    for rank in 0..2 {
        let info = rank_epoch(rank_address(rank)).await;
        assert!(info.epoch > old.epoch, "rank {rank} still in epoch {} (old {})", info.epoch, old.epoch);
        assert_eq!(info.loaded_models, vec!["qwen3_a".to_owned()]);
    }
    let expected = &common::expected("qwen3_a")[1];
    let ids = collect(client(&second_api).await.generate(long_greedy()).await.unwrap().into_inner(), vec![]).await;
    assert_eq!(ids[..16], expected.greedy_new_ids[..]);
    for child in &mut processes {
        common::terminate(child);
    }
}

/// SIGTERM: new requests are refused, the stream in flight finishes, then everything exits.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_in_flight_streams() {
    let mut server = common::Served::start("qwen3_a", 2);
    let undisturbed = collect(client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner(), vec![]).await;
    let mut late_client = client(&server.address).await;
    let mut stream = client(&server.address).await.generate(long_greedy()).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while ids.len() < 10 {
        ids.extend(stream.message().await.unwrap().unwrap().token_id);
    }
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = late_client.generate(long_greedy()).await;
    assert!(refused.is_err(), "a request after SIGTERM must be refused");
    println!("after SIGTERM: {:?}", refused.err().map(|s| (s.code(), s.message().to_owned())));
    let ids = collect(stream, ids).await;
    assert_eq!(ids, undisturbed, "the in-flight stream must finish");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "tpserve serve did not exit after draining");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}
