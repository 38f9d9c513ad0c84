//! The public gRPC API with a real client: health transitions, reflection, request validation,
//! cancellation, and rank loss.

mod common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

async fn channel(address: &str) -> Channel {
    let address: Address = address.parse().unwrap();
    net::connect(&address, Duration::from_secs(10)).await.unwrap()
}

async fn health(address: &str, service: &str) -> Option<ServingStatus> {
    let address: Address = address.parse().ok()?;
    let channel = net::connect(&address, Duration::from_secs(2)).await.ok()?;
    let response = HealthClient::new(channel).check(HealthCheckRequest { service: service.to_owned() }).await.ok()?;
    ServingStatus::try_from(response.into_inner().status).ok()
}

async fn wait_for_health(address: &str, want: ServingStatus, patience: Duration) {
    let deadline = Instant::now() + patience;
    loop {
        let got = health(address, "").await;
        if got == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{address}: health is {got:?}, expected {want:?} within {patience:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn spawn_rank(address: &str) -> Child {
    common::tpserve()
        .args(["rank", "--listen", address, "--threads", "1", "--collective-timeout-secs", "10"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

struct Killed(Vec<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for child in &mut self.0 {
            common::terminate(child);
        }
    }
}

/// NOT_SERVING while a rank is missing, SERVING once it appears, NOT_SERVING again when it is
/// killed, and SERVING after it is restarted (new communicator epoch, model reloaded).
#[tokio::test(flavor = "multi_thread")]
async fn health_follows_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let rank_address = |i: usize| format!("unix://{}", dir.path().join(format!("rank{i}.sock")).display());
    let api = format!("unix://{}", dir.path().join("api.sock").display());
    let mut processes = Killed(vec![spawn_rank(&rank_address(0))]);
    let coordinator = common::tpserve()
        .args(["coordinator", "--rank", &rank_address(0), "--rank", &rank_address(1), "--listen", &api, "--model"])
        .arg(common::fixture("qwen3_a"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    processes.0.push(coordinator);

    wait_for_health(&api, ServingStatus::NotServing, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(health(&api, "tpserve.v1.Generator").await, Some(ServingStatus::NotServing));
    let mut client = GeneratorClient::new(channel(&api).await);
    let early = client.model_info(pb::ModelInfoRequest::default()).await.unwrap_err();
    assert_eq!(early.code(), Code::Unavailable, "{early:?}");

    processes.0.push(spawn_rank(&rank_address(1)));
    wait_for_health(&api, ServingStatus::Serving, Duration::from_secs(30)).await;
    assert_eq!(health(&api, "tpserve.v1.Generator").await, Some(ServingStatus::Serving));
    // A rank reports SERVING on its own socket.
    assert_eq!(health(&rank_address(1), "").await, Some(ServingStatus::Serving));

    // Lose rank 1.
    let mut rank1 = processes.0.pop().unwrap();
    rank1.kill().unwrap();
    rank1.wait().unwrap();
    wait_for_health(&api, ServingStatus::NotServing, Duration::from_secs(15)).await;

    // Restart it: the coordinator re-initialises the group and serves again.
    processes.0.push(spawn_rank(&rank_address(1)));
    wait_for_health(&api, ServingStatus::Serving, Duration::from_secs(30)).await;
    let expected = &common::expected("qwen3_a")[0];
    let ids = generate_ids(&mut client, expected.ids.clone(), 16).await;
    assert_eq!(ids, expected.greedy_new_ids, "greedy output after recovery");
}

async fn generate_ids(client: &mut GeneratorClient<Channel>, prompt_ids: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    let request = pb::GenerateRequest {
        prompt_ids,
        params: Some(pb::GenerationParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        ids.extend(message.token_id);
    }
    ids
}

fn greedy(max_tokens: Option<u32>) -> pb::GenerationParams {
    pb::GenerationParams { max_tokens, temperature: Some(0.0), ..Default::default() }
}

/// Each bad request gets the right code and a message naming what to fix; the server keeps
/// serving afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_clear_statuses() {
    let server = common::Served::start("qwen3_a", 2);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let prompt = |text: &str, params: pb::GenerationParams| pb::GenerateRequest {
        prompt: text.to_owned(),
        params: Some(params),
        ..Default::default()
    };
    let cases: Vec<(&str, pb::GenerateRequest, Code, &str)> = vec![
        ("unknown model", pb::GenerateRequest { model: "nope".into(), ..prompt("hi", greedy(Some(4))) }, Code::NotFound, "nope"),
        ("empty prompt", prompt("", greedy(Some(4))), Code::InvalidArgument, "prompt"),
        (
            "prompt longer than the context",
            pb::GenerateRequest { prompt_ids: vec![5; 5000], params: Some(greedy(Some(4))), ..Default::default() },
            Code::OutOfRange,
            "context",
        ),
        ("max_tokens 0", prompt("hi", greedy(Some(0))), Code::InvalidArgument, "max_tokens"),
        ("max_tokens beyond the context", prompt("hi", greedy(Some(1_000_000))), Code::OutOfRange, "max_tokens"),
        (
            "temperature NaN",
            prompt("hi", pb::GenerationParams { temperature: Some(f32::NAN), ..greedy(Some(4)) }),
            Code::InvalidArgument,
            "temperature",
        ),
        (
            "negative temperature",
            prompt("hi", pb::GenerationParams { temperature: Some(-1.0), ..greedy(Some(4)) }),
            Code::InvalidArgument,
            "temperature",
        ),
        (
            "top_p above 1",
            prompt("hi", pb::GenerationParams { top_p: Some(1.5), ..greedy(Some(4)) }),
            Code::InvalidArgument,
            "top_p",
        ),
        (
            "token id outside the vocabulary",
            pb::GenerateRequest { prompt_ids: vec![1, 448, 2], params: Some(greedy(Some(4))), ..Default::default() },
            Code::InvalidArgument,
            "vocabulary",
        ),
        (
            "both prompt and ids",
            pb::GenerateRequest { prompt: "hi".into(), prompt_ids: vec![1], params: Some(greedy(Some(4))), ..Default::default() },
            Code::InvalidArgument,
            "prompt",
        ),
    ];
    for (what, request, code, mention) in cases {
        let status = client.generate(request).await.err().unwrap_or_else(|| panic!("{what}: accepted"));
        println!("{what}: {:?}: {}", status.code(), status.message());
        assert_eq!(status.code(), code, "{what}: {}", status.message());
        assert!(status.message().contains(mention), "{what}: message {:?} should mention {mention}", status.message());
    }
    let info = client.model_info(pb::ModelInfoRequest { model: "missing".into() }).await.unwrap_err();
    assert_eq!(info.code(), Code::NotFound);
    let chat = client.chat(pb::ChatRequest::default()).await.unwrap_err();
    assert_eq!(chat.code(), Code::InvalidArgument);

    // Still serving, and still right.
    let expected = &common::expected("qwen3_a")[1];
    assert_eq!(generate_ids(&mut client, expected.ids.clone(), 16).await, expected.greedy_new_ids);
}

/// Dropping a stream stops its generation and frees its KV cache on every rank.
#[tokio::test(flavor = "multi_thread")]
async fn cancelled_stream_frees_its_cache() {
    let server = common::Served::start("qwen3_a", 2);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let request = pb::GenerateRequest {
        prompt: "Once upon a time".into(),
        params: Some(pb::GenerationParams { max_tokens: Some(4000), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    for _ in 0..3 {
        stream.message().await.unwrap().unwrap();
    }
    let running = client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(running.active_sequences, 1, "{running:?}");
    assert!(running.kv_cached_tokens > 0, "{running:?}");
    drop(stream);

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner();
        if info.requests_cancelled_total == 1 && info.sequences_freed_total == 1 && info.active_sequences == 0 {
            assert_eq!(info.kv_cached_tokens, 0, "{info:?}");
            break;
        }
        assert!(Instant::now() < deadline, "cancellation not observed: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Chat renders the model's template; stop strings end the stream before the stop text.
#[tokio::test(flavor = "multi_thread")]
async fn chat_and_stop_sequences() {
    let server = common::Served::start("qwen3_a", 1);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let request = pb::ChatRequest {
        messages: vec![pb::ChatMessage { role: "user".into(), content: "Hello there".into(), ..Default::default() }],
        params: Some(pb::GenerationParams { max_tokens: Some(8), temperature: Some(0.0), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.chat(request).await.unwrap().into_inner();
    let mut last = None;
    let mut text = String::new();
    while let Some(message) = stream.message().await.unwrap() {
        text.push_str(&message.text);
        last = Some(message);
    }
    let last = last.unwrap();
    let usage = last.usage.unwrap();
    // "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n" tokenizes to more than 6 ids.
    assert!(usage.prompt_tokens > 6, "{usage:?}");
    assert_eq!(usage.completion_tokens, 8);

    // Greedy text of reference prompt 0 starts "ide"; stopping at "iv" cuts it short.
    let expected = &common::expected("qwen3_a")[0];
    let request = pb::GenerateRequest {
        prompt_ids: expected.ids.clone(),
        params: Some(pb::GenerationParams { stop: vec!["iv".into()], ..greedy(Some(16)) }),
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut text = String::new();
    let mut reason = 0;
    while let Some(message) = stream.message().await.unwrap() {
        text.push_str(&message.text);
        reason = message.finish_reason;
    }
    assert_eq!(reason, pb::FinishReason::StopSequence as i32, "text {text:?}");
    assert!(!text.contains("iv"), "{text:?}");
}

/// ignore_eos as vLLM means it: EOS does not end the sequence but is not suppressed, so the
/// model's distribution is untouched. Suppressing EOS would renormalise the others and move every
/// logprob by -ln(1 - p(EOS)); here they are exactly those of the same request without ignore_eos.
#[tokio::test(flavor = "multi_thread")]
async fn ignore_eos_does_not_suppress_eos() {
    // Without prefix caching the second request prefills the same tokens in the same shapes, so
    // its logprobs are bitwise those of the first (a cached prefix would round differently).
    let server = common::Served::start_with("qwen3_a", 1, &["--prefix-cache", "off"]);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let expected = &common::expected("qwen3_a")[0];
    let mut first = Vec::new();
    for ignore_eos in [false, true] {
        let params = pb::GenerationParams { ignore_eos, logprobs: true, top_logprobs: 20, ..greedy(Some(1)) };
        let request = pb::GenerateRequest { prompt_ids: expected.ids.clone(), params: Some(params), ..Default::default() };
        let message = client.generate(request).await.unwrap().into_inner().message().await.unwrap().unwrap();
        let top: Vec<(u32, f32)> = message.top_logprobs.iter().map(|t| (t.token_id, t.logprob)).collect();
        assert_eq!(top.len(), 20);
        first.push((message.token_id, message.logprob, top));
    }
    assert_eq!(first[0], first[1]);
}

/// `n` over gRPC: the choices' messages interleave on one stream, tagged with their index, and
/// choice i is the request with seed + i.
#[tokio::test(flavor = "multi_thread")]
async fn n_choices_are_tagged_and_seeded() {
    let server = common::Served::start("qwen3_a", 2);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let sampled = |seed: u64, n: u32| pb::GenerateRequest {
        prompt: "Once upon a time".into(),
        n,
        params: Some(pb::GenerationParams { max_tokens: Some(12), temperature: Some(0.9), seed: Some(seed), ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut choices: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut finished = 0;
    let mut stream = client.generate(sampled(7, 3)).await.unwrap().into_inner();
    while let Some(message) = stream.message().await.unwrap() {
        choices[message.index as usize].extend(message.token_id);
        finished += usize::from(message.finish_reason != 0);
    }
    assert_eq!(finished, 3);
    for (i, choice) in choices.iter().enumerate() {
        let mut alone = Vec::new();
        let mut stream = client.generate(sampled(7 + i as u64, 1)).await.unwrap().into_inner();
        while let Some(message) = stream.message().await.unwrap() {
            assert_eq!(message.index, 0);
            alone.extend(message.token_id);
        }
        assert_eq!(choice, &alone, "choice {i}");
    }
    assert!(choices[0] != choices[1] || choices[1] != choices[2], "the choices were not seeded apart");
    let too_many = client.generate(sampled(7, 17)).await.unwrap_err();
    assert_eq!(too_many.code(), Code::InvalidArgument);
    assert!(too_many.message().contains("n must be between 1 and 16"), "{}", too_many.message());
}

/// Chat's tool and template fields are checked with messages naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn chat_tool_fields_are_checked() {
    let server = common::Served::start("qwen3_a", 1);
    let mut client = GeneratorClient::new(channel(&server.address).await);
    let user = pb::ChatMessage { role: "user".into(), content: "hi".into(), ..Default::default() };
    let cases = [
        (pb::ChatRequest { tools_json: "[{".into(), ..Default::default() }, "tools_json is not valid JSON"),
        (pb::ChatRequest { tools_json: r#"[{"type": "function"}]"#.into(), ..Default::default() }, "tools[0].function.name is required"),
        (pb::ChatRequest { tool_choice: pb::ToolChoice::Auto as i32, ..Default::default() }, "needs tools"),
        (
            pb::ChatRequest {
                tools_json: r#"[{"type": "function", "function": {"name": "f"}}]"#.into(),
                tool_choice: pb::ToolChoice::Function as i32,
                tool_choice_function: "g".into(),
                ..Default::default()
            },
            "names the function \"g\", which is not in tools",
        ),
        (pb::ChatRequest { tool_choice_function: "f".into(), ..Default::default() }, "only read with tool_choice TOOL_CHOICE_FUNCTION"),
        (pb::ChatRequest { chat_template_kwargs_json: "[1]".into(), ..Default::default() }, "must be a JSON object"),
        (
            pb::ChatRequest {
                messages: vec![pb::ChatMessage {
                    role: "assistant".into(),
                    tool_calls: vec![pb::ToolCall {
                        function: Some(pb::FunctionCall { name: "f".into(), arguments: "{oops".into() }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            },
            "messages[0].tool_calls[0].function.arguments must be a JSON object in text",
        ),
    ];
    for (mut request, needle) in cases {
        request.messages.push(user.clone());
        request.params = Some(greedy(Some(2)));
        let status = client.chat(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{needle}: {}", status.message());
        assert!(status.message().contains(needle), "{:?} lacks {needle:?}", status.message());
    }
    // qwen3_a's template knows no tools: a call in the Hermes format cannot be forced on it.
    let request = pb::ChatRequest {
        messages: vec![user],
        tools_json: r#"[{"type": "function", "function": {"name": "f"}}]"#.into(),
        tool_choice: pb::ToolChoice::Required as i32,
        params: Some(greedy(Some(2))),
        ..Default::default()
    };
    let status = client.chat(request).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{}", status.message());
    assert!(status.message().contains("does not teach that format"), "{}", status.message());
}
