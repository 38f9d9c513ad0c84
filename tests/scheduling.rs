//! Continuous batching, admission control and KV capacity, through the real served system.

mod common;

use std::time::{Duration, Instant};

use tonic::Code;
use tonic::transport::Channel;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

async fn client(address: &str) -> GeneratorClient<Channel> {
    let address: Address = address.parse().unwrap();
    GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap())
}

/// A request of the mixed workload: reference prompts greedy, and seeded sampling.
fn workload() -> Vec<pb::GenerateRequest> {
    let prompts = common::expected("qwen3_a");
    (0..16)
        .map(|i| {
            let prompt = &prompts[i % prompts.len()];
            let params = if i % 4 == 3 {
                pb::GenerationParams { temperature: Some(0.8), top_p: Some(0.9), seed: Some(i as u64), ..Default::default() }
            } else {
                pb::GenerationParams { temperature: Some(0.0), ..Default::default() }
            };
            pb::GenerateRequest {
                prompt_ids: prompt.ids[..prompt.ids.len() - (i % 5)].to_vec(),
                params: Some(pb::GenerationParams { max_tokens: Some(8 + (i as u32 % 3) * 6), ignore_eos: true, ..params }),
                ..Default::default()
            }
        })
        .collect()
}

async fn run(mut client: GeneratorClient<Channel>, request: pb::GenerateRequest) -> Vec<u32> {
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        ids.extend(message.token_id);
    }
    ids
}

/// Every request's output is the same alone as in a batch of 16 mixed requests (decodes
/// interleaved with chunked prefills of prompts up to 165 tokens).
#[tokio::test(flavor = "multi_thread")]
async fn output_is_identical_alone_and_in_a_batch_of_16() {
    let server = common::Served::start_with("qwen3_a", 2, &["--max-batch-size", "16", "--prefill-chunk", "64"]);
    let requests = workload();
    let mut alone = Vec::new();
    for request in &requests {
        alone.push(run(client(&server.address).await, request.clone()).await);
    }
    let mut tasks = Vec::new();
    for request in requests.clone() {
        let client = client(&server.address).await;
        tasks.push(tokio::spawn(run(client, request)));
    }
    let mut batched = Vec::new();
    for task in tasks {
        batched.push(task.await.unwrap());
    }
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a, b, "request {i} differs between alone and batched");
        assert_eq!(a.len() as u32, requests[i].params.as_ref().unwrap().max_tokens.unwrap());
    }
    // The reference prompts' greedy tokens are the oracle's, batched or not.
    let expected = common::expected("qwen3_a");
    assert_eq!(batched[0][..8], expected[0].greedy_new_ids[..8]);
    let info = client(&server.address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert!(info.steps_total > 0 && info.step_overhead_us_p50 > 0.0, "{info:?}");
}

fn long_request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: "Once upon a time".into(),
        params: Some(pb::GenerationParams { max_tokens: Some(3000), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Past --max-waiting, requests are refused at once with RESOURCE_EXHAUSTED.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_queue_is_bounded() {
    let server = common::Served::start_with("qwen3_a", 1, &["--max-batch-size", "1", "--max-waiting", "2"]);
    let mut first = client(&server.address).await.generate(long_request()).await.unwrap().into_inner();
    first.message().await.unwrap().unwrap(); // running
    let mut queued = Vec::new();
    for _ in 0..2 {
        queued.push(client(&server.address).await.generate(long_request()).await.unwrap());
    }
    let started = Instant::now();
    let refused = client(&server.address).await.generate(long_request()).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("waiting"), "{}", refused.message());
    assert!(started.elapsed() < Duration::from_secs(5), "refusal must not wait");
    let info = client(&server.address).await.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.waiting_requests, 2, "{info:?}");
}

/// A client's grpc-timeout ends its stream and frees its sequence on the ranks.
#[tokio::test(flavor = "multi_thread")]
async fn deadlines_are_honoured() {
    let server = common::Served::start("qwen3_a", 2);
    let mut request = tonic::Request::new(long_request());
    request.set_timeout(Duration::from_millis(700));
    let mut stream = client(&server.address).await.generate(request).await.unwrap().into_inner();
    let outcome = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream finished instead of hitting its deadline"),
            Err(status) => break status,
        }
    };
    assert!(matches!(outcome.code(), Code::DeadlineExceeded | Code::Cancelled), "{outcome:?}");
    let mut info_client = client(&server.address).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = info_client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
        if info.active_sequences == 0 && info.sequences_freed_total == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "sequence not freed after its deadline: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The ranks report their KV capacity in whole blocks; the scheduler never reserves beyond it,
/// queues what does not fit yet, and refuses what can never fit.
#[tokio::test(flavor = "multi_thread")]
async fn kv_capacity_is_reported_and_respected() {
    // qwen3_a at TP 2: 4 layers x (k + v) x 2 KV heads x 16 x 4 bytes = 1024 bytes per token,
    // 16 KiB per block of 16 positions: a budget of 300 tokens holds 18 blocks, 288 tokens.
    let budget_gib = format!("{}", 300.0 * 1024.0 / (1u64 << 30) as f64);
    let server = common::Served::start_with("qwen3_a", 2, &["--kv-cache-gib", &budget_gib, "--max-batch-size", "8"]);
    let mut info_client = client(&server.address).await;
    let info = info_client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!((info.kv_capacity_tokens, info.kv_blocks_total, info.kv_block_size), (288, 18, 16), "{info:?}");

    let too_big = pb::GenerateRequest {
        prompt_ids: vec![5; 100],
        params: Some(pb::GenerationParams { max_tokens: Some(250), temperature: Some(0.0), ..Default::default() }),
        ..Default::default()
    };
    let status = client(&server.address).await.generate(too_big).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("KV cache"), "{}", status.message());

    // Three requests of 180 tokens each: only one fits at a time, all complete.
    let fits_one = || pb::GenerateRequest {
        prompt_ids: vec![7; 20],
        params: Some(pb::GenerationParams { max_tokens: Some(160), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let client = client(&server.address).await;
        tasks.push(tokio::spawn(run(client, fits_one())));
    }
    let mut peak = 0;
    while tasks.iter().any(|t| !t.is_finished()) {
        let info = info_client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
        assert!(info.kv_reserved_tokens <= info.kv_capacity_tokens, "{info:?}");
        assert!(info.active_sequences <= 1, "{info:?}");
        peak = peak.max(info.kv_reserved_tokens);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().len(), 160);
    }
    assert!(peak <= 288);
}
