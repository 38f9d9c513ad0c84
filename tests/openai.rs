//! The OpenAI-compatible HTTP API (`--http-listen`) with real clients: the official `openai`
//! Python package (chat and completions, streaming and not, usage, logprobs, stop, n=2), curl
//! -N for the SSE framing, and a raw HTTP client for statuses, error objects and disconnects.
//! Greedy output must be the same through gRPC and HTTP.

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tonic::transport::Channel;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

/// `tpserve serve` with the HTTP API on a free port.
struct HttpServed {
    served: common::Served,
    port: u16,
}

impl HttpServed {
    fn start(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let port = common::free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec!["--http-listen", listen.as_str()];
        args.extend_from_slice(extra);
        let served = common::Served::start_with_env("qwen3_a", 2, &args, env);
        Self { served, port }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

/// One HTTP/1.1 exchange over a fresh connection: (status, body). Chunked bodies are decoded.
fn http(port: u16, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = body.unwrap_or("");
    request.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, rest) = response.split_once("\r\n\r\n").expect("a complete response head");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_owned() };
    (status, body)
}

fn dechunk(mut rest: &str) -> String {
    let mut body = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        body.push_str(&tail[..size]);
        rest = &tail[size + 2..];
    }
    body
}

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, body) = http(port, "POST", path, Some(&body.to_string()), &[]);
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}")))
}

/// Asserts an OpenAI error object with `status`, whose message contains `needle`.
fn assert_error(response: (u16, Value), status: u16, needle: &str) {
    let (got, body) = response;
    assert_eq!(got, status, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_else(|| panic!("no error object: {body}"));
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

async fn grpc(address: &str) -> GeneratorClient<Channel> {
    let address: Address = address.parse().unwrap();
    GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap())
}

/// A gRPC stream's (ids, text, logprobs, usage).
async fn drain(stream: tonic::Response<tonic::Streaming<pb::GenerateResponse>>) -> (Vec<u32>, String, Vec<f32>, pb::Usage) {
    let mut stream = stream.into_inner();
    let (mut ids, mut text, mut logprobs, mut usage) = (Vec::new(), String::new(), Vec::new(), pb::Usage::default());
    while let Some(message) = stream.message().await.unwrap() {
        ids.extend(message.token_id);
        text.push_str(&message.text);
        logprobs.extend(message.logprob);
        if let Some(u) = message.usage {
            usage = u;
        }
    }
    (ids, text, logprobs, usage)
}

fn greedy(max_tokens: u32) -> pb::GenerationParams {
    pb::GenerationParams { max_tokens: Some(max_tokens), temperature: Some(0.0), ignore_eos: true, logprobs: true, ..Default::default() }
}

const CLIENT: &str = r#"
import json, sys, openai
base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
eos = {"ignore_eos": True}
out = {}
out["chat"] = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
    logprobs=True, top_logprobs=2, n=2, extra_body=eos).model_dump()
out["chat_stream"] = [c.model_dump() for c in client.chat.completions.create(model=model, messages=messages,
    max_completion_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=eos)]
out["completion"] = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
    logprobs=2, extra_body=eos).model_dump()
out["completion_stream"] = [c.model_dump() for c in client.completions.create(model=model, prompt="Once upon a time",
    max_tokens=8, temperature=0, n=2, stream=True, stream_options={"include_usage": True}, extra_body=eos)]
text = out["completion"]["choices"][0]["text"]
stop = text[len(text) // 2:len(text) // 2 + 2]
out["stop"] = {"stop": stop, "response": client.completions.create(model=model, prompt="Once upon a time",
    max_tokens=8, temperature=0, stop=[stop], extra_body=eos).model_dump()}
try:
    client.completions.create(model=model, prompt="x", temperature=-1)
except openai.BadRequestError as e:
    out["bad"] = {"status": e.status_code, "body": e.body}
try:
    client.chat.completions.create(model="nope", messages=messages)
except openai.NotFoundError as e:
    out["missing"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;

/// The official client against the HTTP API, compared with gRPC for the same greedy requests.
#[tokio::test(flavor = "multi_thread")]
async fn openai_python_client_matches_grpc() {
    let server = HttpServed::start(&[], &[]);
    let python = common::openai_python();
    let output = Command::new(python).args(["-c", CLIENT, &server.base(), "qwen3_a"]).output().unwrap();
    assert!(output.status.success(), "the openai client failed: {}", String::from_utf8_lossy(&output.stderr));
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();

    let mut client = grpc(&server.served.address).await;
    let messages = vec![
        pb::ChatMessage { role: "system".into(), content: "be brief".into(), ..Default::default() },
        pb::ChatMessage { role: "user".into(), content: "hello".into(), ..Default::default() },
    ];
    let chat = pb::ChatRequest { model: "qwen3_a".into(), messages, params: Some(greedy(8)), ..Default::default() };
    let (_, chat_text, chat_logprobs, chat_usage) = drain(client.chat(chat).await.unwrap()).await;
    let generate = pb::GenerateRequest { model: "qwen3_a".into(), prompt: "Once upon a time".into(), params: Some(greedy(8)), ..Default::default() };
    let (_, text, logprobs, usage) = drain(client.generate(generate).await.unwrap()).await;

    // Chat, n=2, logprobs: both choices are the greedy reply.
    let chat = &out["chat"];
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"].as_array().unwrap().len(), 2);
    for (i, choice) in chat["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["message"]["content"], chat_text.as_str());
        assert_eq!(choice["message"]["role"], "assistant");
        assert_eq!(choice["finish_reason"], "length");
        let content = choice["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 8);
        for (entry, want) in content.iter().zip(&chat_logprobs) {
            assert!((entry["logprob"].as_f64().unwrap() as f32 - want).abs() < 1e-5, "{entry} vs {want}");
            assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        }
    }
    assert_eq!(chat["usage"]["prompt_tokens"], chat_usage.prompt_tokens);
    assert_eq!(chat["usage"]["completion_tokens"], 16);

    // Chat streamed with usage: a role delta first, then the text, then usage with no choices.
    let chunks = out["chat_stream"].as_array().unwrap();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()).filter_map(|c| c["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, chat_text);
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));
    let last = chunks.last().unwrap();
    assert!(last["choices"].as_array().unwrap().is_empty());
    assert_eq!(last["usage"]["completion_tokens"], 8);
    assert_eq!(last["usage"]["prompt_tokens"], chat_usage.prompt_tokens);

    // Completions with logprobs: the same text and logprobs as gRPC's Generate.
    let completion = &out["completion"];
    assert_eq!(completion["object"], "text_completion");
    assert_eq!(completion["choices"][0]["text"], text.as_str());
    let token_logprobs = completion["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), logprobs.len());
    for (got, want) in token_logprobs.iter().zip(&logprobs) {
        assert!((got.as_f64().unwrap() as f32 - want).abs() < 1e-5);
    }
    assert_eq!(completion["usage"]["prompt_tokens"], usage.prompt_tokens);
    assert_eq!(completion["usage"]["completion_tokens"], usage.completion_tokens);

    // Completions streamed, n=2: each choice streams the whole greedy text.
    let chunks = out["completion_stream"].as_array().unwrap();
    for index in 0..2 {
        let streamed: String = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == index)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(streamed, text, "choice {index}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 16);

    // A stop string ends the text before it.
    let stop = out["stop"]["stop"].as_str().unwrap();
    let stopped = &out["stop"]["response"]["choices"][0];
    assert_eq!(stopped["text"], &text[..text.find(stop).unwrap()]);
    assert_eq!(stopped["finish_reason"], "stop");

    assert_eq!(out["bad"]["status"], 400, "{}", out["bad"]);
    assert!(out["bad"]["body"]["message"].as_str().unwrap().contains("temperature"), "{}", out["bad"]);
    assert_eq!(out["missing"]["status"], 404, "{}", out["missing"]);
}

/// Greedy ids through gRPC equal the fixture's, and HTTP returns the same tokens for the same
/// request given as token ids.
#[tokio::test(flavor = "multi_thread")]
async fn greedy_output_is_the_same_through_grpc_and_http() {
    let server = HttpServed::start(&[], &[]);
    let mut client = grpc(&server.served.address).await;
    for expected in common::expected("qwen3_a").iter().take(2) {
        let max = expected.greedy_new_ids.len() as u32;
        let request = pb::GenerateRequest { prompt_ids: expected.ids.clone(), params: Some(greedy(max)), ..Default::default() };
        let (ids, text, logprobs, _) = drain(client.generate(request).await.unwrap()).await;
        assert_eq!(ids, expected.greedy_new_ids);
        let body = json!({"model": "qwen3_a", "prompt": expected.ids, "max_tokens": max, "temperature": 0,
                          "ignore_eos": true, "logprobs": 0});
        let (status, response) = post(server.port, "/v1/completions", &body);
        assert_eq!(status, 200, "{response}");
        let choice = &response["choices"][0];
        assert_eq!(choice["text"], text.as_str());
        let got: Vec<f32> = choice["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        // The second request reuses the first one's cached prompt blocks (prefix caching), so its
        // logprobs come from a prefill of the rest alone: equal within float rounding, not bits.
        assert_eq!(got.len(), logprobs.len());
        let diff = common::max_abs_diff(&got, &logprobs);
        assert!(diff < 1e-4, "the same tokens have the same logprobs: {got:?} vs {logprobs:?} differ by {diff}");
        assert_eq!(response["usage"]["completion_tokens"], max);
    }
}

/// curl -N sees OpenAI's SSE framing: `data: {json}` events, then `data: [DONE]`.
#[test]
fn curl_sees_sse_framing() {
    let server = HttpServed::start(&[], &[]);
    let body = json!({"model": "qwen3_a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                      "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let output = Command::new("curl")
        .args(["-sN", "-D", "-", "-H", "Content-Type: application/json", "-d", &body.to_string()])
        .arg(format!("{}/chat/completions", server.base()))
        .output()
        .expect("curl runs");
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    let (head, events) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.to_ascii_lowercase().contains("content-type: text/event-stream"), "{head}");
    assert!(events.ends_with("data: [DONE]\n\n"), "{events:?}");
    let events: Vec<&str> = events.split("\n\n").filter(|e| !e.is_empty()).collect();
    for event in &events[..events.len() - 1] {
        let data = event.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {event:?}"));
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
    }
    let usage: Value = serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
}

/// Bad requests get 400/404 with an OpenAI error object naming the problem; /health is 200;
/// a client that disconnects mid-stream has its sequence freed.
#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_and_disconnects() {
    let server = HttpServed::start(&["--max-prompt-bytes", "1000"], &[]);
    let port = server.port;
    assert_eq!(http(port, "GET", "/health", None, &[]).0, 200);
    let chat = |extra: Value| {
        let mut body = json!({"model": "qwen3_a", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(port, "/v1/chat/completions", &body)
    };
    assert_error(chat(json!({"logit_bias": {"1": 1}})), 400, "\"logit_bias\" is not supported");
    assert_error(chat(json!({"tools": [{"type": "function"}]})), 400, "tools[0].function.name is required");
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    // qwen3_a's template knows no tools: a call in the Hermes format cannot be forced on it.
    assert_error(chat(json!({"tools": tools, "tool_choice": "required"})), 400, "does not teach that format");
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    assert_error(chat(json!({"tools": tools, "tool_choice": named("g")})), 400, "names the function \"g\", which is not in tools");
    assert_error(chat(json!({"tool_choice": named("f")})), 400, "needs tools");
    assert_error(chat(json!({"temperature": "hot"})), 400, "temperature");
    assert_error(chat(json!({"top_p": 0})), 400, "top_p");
    assert_error(chat(json!({"max_tokens": 100000})), 400, "max_tokens");
    assert_error(chat(json!({"n": 0})), 400, "n must be");
    assert_error(chat(json!({"model": "nope"})), 404, "nope");
    assert_error(chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})), 400, "text parts");
    assert_error(post(port, "/v1/completions", &json!({"prompt": "x".repeat(2000)})), 400, "--max-prompt-bytes");
    assert_error(post(port, "/v1/completions", &json!({"prompt": "x".repeat(200_000)})), 400, "request body is larger");
    assert_error(post(port, "/v1/nothing", &json!({})), 404, "no such endpoint");
    let (status, body) = http(port, "POST", "/v1/completions", Some("{not json"), &[]);
    assert_eq!(status, 400, "{body}");

    // A client that goes away mid-stream: its sequence is cancelled and its KV freed.
    let mut client = grpc(&server.served.address).await;
    let info = |mut client: GeneratorClient<Channel>| async move {
        client.model_info(pb::ModelInfoRequest::default()).await.unwrap().into_inner()
    };
    for stream in [true, false] {
        let before = info(client.clone()).await;
        let mut connection = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let body = json!({"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, "stream": stream}).to_string();
        write!(connection, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        if stream {
            let mut first = [0u8; 256];
            let read = connection.read(&mut first).unwrap();
            assert!(String::from_utf8_lossy(&first[..read]).starts_with("HTTP/1.1 200"));
        }
        // Response headers go out before admission: wait for the sequence to run.
        let deadline = Instant::now() + Duration::from_secs(20);
        while info(client.clone()).await.active_sequences != 1 {
            assert!(Instant::now() < deadline, "the request never ran (stream: {stream})");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(connection);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = info(client.clone()).await;
            if now.active_sequences == 0 && now.sequences_freed_total > before.sequences_freed_total {
                assert!(now.requests_cancelled_total > before.requests_cancelled_total);
                break;
            }
            assert!(Instant::now() < deadline, "the sequence of a gone client was not freed (stream: {stream}): {now:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The server still serves.
    let (status, body) = post(port, "/v1/completions", &json!({"prompt": "a", "max_tokens": 2}));
    assert_eq!(status, 200, "{body}");
    client.model_info(pb::ModelInfoRequest::default()).await.unwrap();
}

/// The API token works as the bearer token (401 without it), a full queue is 429, and a
/// coordinator whose ranks are not up answers /health and requests with 503.
#[test]
fn auth_capacity_and_unavailable() {
    let server = HttpServed::start(&["--max-waiting", "0"], &[("TPSERVE_API_TOKEN", "s3cret")]);
    let port = server.port;
    let body = json!({"model": "qwen3_a", "prompt": "a", "max_tokens": 2}).to_string();
    let parse = |(status, body): (u16, String)| (status, serde_json::from_str::<Value>(&body).unwrap());
    assert_error(parse(http(port, "POST", "/v1/completions", Some(&body), &[])), 401, "missing API token");
    assert_error(parse(http(port, "GET", "/v1/models", None, &[("Authorization", "Bearer wrong")])), 401, "wrong API token");
    let bearer = [("Authorization", "Bearer s3cret")];
    let (status, models) = parse(http(port, "GET", "/v1/models", None, &bearer));
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "qwen3_a");
    assert_error(parse(http(port, "POST", "/v1/completions", Some(&body), &bearer)), 429, "at capacity");

    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let mut coordinator = common::tpserve()
        .args(["coordinator", "--model"])
        .arg(common::fixture("qwen3_a"))
        .arg("--rank")
        .arg(format!("unix://{}", dir.path().join("absent.sock").display()))
        .arg("--listen")
        .arg(format!("unix://{}", dir.path().join("api.sock").display()))
        .args(["--http-listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the HTTP API did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_error(parse(http(port, "GET", "/health", None, &[])), 503, "starting");
    assert_error(parse(http(port, "POST", "/v1/completions", Some(&body), &[])), 503, "starting");
    common::terminate(&mut coordinator);
}

/// The HTTP port keeps the gRPC port's limits: past `--max-connections` new clients wait in the
/// backlog, a connection that sends no request headers for 30 s is closed (slowloris), and past
/// `--max-concurrent-rpcs` a request is refused with 503 rather than queued.
#[test]
fn http_connections_are_capped_and_idle_ones_closed() {
    use std::io::{Read, Write};
    let server = HttpServed::start(&["--max-connections", "4", "--max-concurrent-rpcs", "1"], &[]);
    let port = server.port;
    let started = Instant::now();
    let hogs: Vec<std::net::TcpStream> = (0..4).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    let mut slow = hogs[0].try_clone().unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    // The fifth client is accepted only once a hog is closed by the header timeout.
    let (status, _) = http(port, "GET", "/health", None, &[]);
    let waited = started.elapsed();
    assert_eq!(status, 200);
    assert!(waited >= Duration::from_secs(20), "a fifth connection was served after {waited:?}, past the cap of 4");
    assert!(waited < Duration::from_secs(60), "idle connections were not closed: the fifth waited {waited:?}");
    for mut hog in hogs {
        hog.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut sink = Vec::new();
        let _ = hog.read_to_end(&mut sink);
    }

    // One request at most producing a response: a long non-streamed completion holds the slot.
    let long = json!({"model": "qwen3_a", "prompt": "a", "max_tokens": 400, "ignore_eos": true}).to_string();
    let holder = std::thread::spawn(move || http(port, "POST", "/v1/completions", Some(&long), &[]).0);
    std::thread::sleep(Duration::from_millis(20));
    // Asked until one is refused while the long one runs (it may finish in a fraction of a
    // second in a release build, so no fixed wait can be sure to fall inside it).
    let short = json!({"model": "qwen3_a", "prompt": "a", "max_tokens": 2}).to_string();
    let mut refused = None;
    while refused.is_none() && !holder.is_finished() {
        let (status, body) = http(port, "POST", "/v1/completions", Some(&short), &[]);
        match status {
            503 => refused = Some(body),
            _ => assert_eq!(status, 200, "{body}"),
        }
    }
    let body = refused.expect("no request was refused while the long completion held the only slot");
    assert!(body.contains("--max-concurrent-rpcs"), "{body}");
    assert_eq!(holder.join().unwrap(), 200);
}
