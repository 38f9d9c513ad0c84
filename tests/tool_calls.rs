//! Tool calls made by the served model, end to end: a one-layer Qwen3 over the real Qwen3
//! tokenizer and chat template whose greedy output is a Qwen3 tool call
//! (`common::qwen3_vocab::write_successor`), served at TP 2, asked through the official `openai`
//! package and through gRPC's Chat with a tonic client.
//!
//! With tool_choice auto the model's call comes back as `tool_calls`, whole and streamed; the
//! call and its result go back in a round trip that renders as the template renders it. With
//! `required` and a named function the opening of the call is forced into the prompt, and the
//! model's continuation completes the same call (or, cut short, comes back as text). gRPC streams the same call on the message that
//! closes its block, with no markup in the text.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use tpserve::coordinator::chat_template::{ChatMessage, ChatTemplate, FunctionCall, TemplateInputs, ToolCall};
use tpserve::coordinator::pyjson;
use tpserve::coordinator::tools::ToolChoice;
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

/// What the model writes after `<|im_start|>assistant\n`, EOS included.
const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
/// The Qwen3 template's generation prompt (thinking on, its default): the context of the call's
/// first token.
const GENERATION_PROMPT: &str = "<|im_start|>assistant\n";
const END_TAG: u32 = 151658;
/// Sent as text, so the server and the in-process rendering see the same key order.
const TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;
const QUESTION: &str = "What is the weather in Paris?";
const RESULT: &str = r#"{"temperature": 21, "unit": "celsius"}"#;

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(common::fixture("qwen3_chat").join("tokenizer.json")).unwrap()
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap().get_ids().to_vec()
}

/// The model, in a directory named for the model id it is served under.
fn write_model(root: &Path) -> PathBuf {
    let dir = root.join("qwen3-tool-caller");
    common::qwen3_vocab::write_successor(&dir, &encode(&format!("{GENERATION_PROMPT}{CALL}")));
    dir
}

/// The number of tokens of a conversation's prompt as the template renders it, with a forced
/// opening after the generation prompt.
fn prompt_tokens(model: &Path, messages: &[ChatMessage], forced: &ToolChoice) -> usize {
    let template = ChatTemplate::from_model_dir(model).unwrap().unwrap();
    let inputs = TemplateInputs { tools: Some(pyjson::parse(TOOLS).unwrap()), ..Default::default() };
    let prompt = template.render_with(messages, true, &inputs).unwrap() + &forced.forced_prefix().unwrap_or_default();
    encode(&prompt).len()
}

/// The official client: each tool choice whole and streamed, then the round trip an application
/// makes with the call it got: the assistant message as returned, and the tool's result.
const CLIENT: &str = r#"
import json, sys, openai
base, model, tools, question, result = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
user = [{"role": "user", "content": question}]
greedy = dict(model=model, temperature=0, max_tokens=64, tools=tools)
choices = {"auto": None, "required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}
out = {}
for name, choice in choices.items():
    extra = {} if choice is None else {"tool_choice": choice}
    out[name] = client.chat.completions.create(messages=user, **greedy, **extra).model_dump()
    stream = client.chat.completions.create(messages=user, stream=True, stream_options={"include_usage": True}, **greedy, **extra)
    out[name + "_stream"] = [chunk.model_dump() for chunk in stream]
message = out["auto"]["choices"][0]["message"]
call = message["tool_calls"][0]
turns = user + [
    {"role": "assistant", "content": message["content"], "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}]},
    {"role": "tool", "tool_call_id": call["id"], "content": result},
]
out["round_trip"] = client.chat.completions.create(messages=turns, **greedy).model_dump()
# A forced call the model has no room to finish is returned as text, forced opening included.
out["cut"] = client.chat.completions.create(messages=user, tool_choice=choices["named"], **{**greedy, "max_tokens": 3}).model_dump()
print(json.dumps(out))
"#;

/// The one call of a whole response.
fn assert_called(response: &Value, what: &str) {
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{what}: {choice}");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null, "{what}: no content besides the call");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{what}: {calls:?}");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"), "{what}");
    assert_eq!(calls[0]["type"], "function", "{what}");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{what}");
    let arguments: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}), "{what}");
}

/// A stream's chunks assemble to the same call: no content, one call delta (index 0, whole),
/// finish reason tool_calls, and the usage of the whole response.
fn assert_streamed_call(chunks: &[Value], whole: &Value, what: &str) {
    let choices: Vec<&Value> = chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()).collect();
    let content: String = choices.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
    assert_eq!(content, "", "{what}: call markup never streams as content");
    let deltas: Vec<&Value> = choices.iter().filter_map(|c| c["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.len(), 1, "{what}: {deltas:?}");
    assert_eq!(deltas[0]["index"], 0, "{what}");
    assert!(deltas[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"), "{what}");
    let whole_call = &whole["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(deltas[0]["function"], *whole_call, "{what}: the streamed call is the whole response's");
    let reasons: Vec<&Value> = choices.iter().map(|c| &c["finish_reason"]).filter(|r| !r.is_null()).collect();
    assert_eq!(reasons, [&json!("tool_calls")], "{what}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(*usage, whole["usage"], "{what}");
}

struct Server {
    served: common::Served,
    port: u16,
    model: PathBuf,
    _dir: tempfile::TempDir,
}

fn serve() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let model = write_model(dir.path());
    let port = common::free_port();
    let served = common::Served::start_with(model.to_str().unwrap(), 2, &["--http-listen", &format!("127.0.0.1:{port}")]);
    Server { served, port, model, _dir: dir }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_served_model_calls_a_tool() {
    let server = serve();
    let base = format!("http://127.0.0.1:{}/v1", server.port);
    let output =
        Command::new(common::openai_python()).args(["-c", CLIENT, &base, "qwen3-tool-caller", TOOLS, QUESTION, RESULT]).output().unwrap();
    assert!(output.status.success(), "the openai client failed: {}", String::from_utf8_lossy(&output.stderr));
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();

    // Every tool choice gets the same call; forcing moves its opening from the output into the
    // prompt, token for token.
    let user = [ChatMessage::new("user", QUESTION)];
    let call_tokens = encode(CALL).len();
    for (name, choice) in [
        ("auto", ToolChoice::Auto),
        ("required", ToolChoice::Required),
        ("named", ToolChoice::Function("get_weather".into())),
    ] {
        assert_called(&out[name], name);
        assert_streamed_call(out[format!("{name}_stream")].as_array().unwrap(), &out[name], name);
        let usage = &out[name]["usage"];
        let prompt = prompt_tokens(&server.model, &user, &choice);
        let forced = prompt - prompt_tokens(&server.model, &user, &ToolChoice::Auto);
        assert_eq!(usage["prompt_tokens"], prompt, "{name}: the prompt is the template's, then the forced opening");
        assert_eq!(usage["completion_tokens"], call_tokens - forced, "{name}: the model wrote the rest of the call");
    }

    // The round trip is accepted and rendered as the template renders it.
    let call = &out["auto"]["choices"][0]["message"]["tool_calls"][0];
    let arguments = pyjson::parse(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let assistant = ChatMessage {
        tool_calls: vec![ToolCall {
            id: call["id"].as_str().unwrap().into(),
            kind: "function".into(),
            function: FunctionCall { name: "get_weather".into(), arguments },
        }],
        ..ChatMessage::new("assistant", "")
    };
    let tool = ChatMessage { tool_call_id: call["id"].as_str().map(str::to_owned), ..ChatMessage::new("tool", RESULT) };
    let turns = [ChatMessage::new("user", QUESTION), assistant, tool];
    let round_trip = &out["round_trip"];
    assert_eq!(round_trip["usage"]["prompt_tokens"], prompt_tokens(&server.model, &turns, &ToolChoice::Auto));
    // The model knows one answer: after the result it asks again.
    assert_called(round_trip, "round trip");

    // Only the opening is forced: cut short, the call does not parse and comes back as text.
    let cut = &out["cut"]["choices"][0];
    assert_eq!(cut["finish_reason"], "length");
    assert_eq!(cut["message"]["content"], "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":");
    assert!(cut["message"]["tool_calls"].is_null(), "{cut}");

    grpc_chat_streams_the_same_call(&server, &out["auto"]).await;
}

/// gRPC's Chat, each tool choice: the text carries no markup, the call arrives on the message
/// whose token closes its block, and the last message has the finish reason TOOL_CALLS; each
/// of n = 2 choices makes its own call, the same one HTTP returned.
async fn grpc_chat_streams_the_same_call(server: &Server, http: &Value) {
    let address: Address = server.served.address.parse().unwrap();
    let mut client = GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap());
    let expected = &http["choices"][0]["message"]["tool_calls"][0]["function"];
    for (choice, function) in [
        (pb::ToolChoice::Unspecified, ""),
        (pb::ToolChoice::Required, ""),
        (pb::ToolChoice::Function, "get_weather"),
    ] {
        let request = pb::ChatRequest {
            messages: vec![pb::ChatMessage { role: "user".into(), content: QUESTION.into(), ..Default::default() }],
            tools_json: TOOLS.into(),
            tool_choice: choice as i32,
            tool_choice_function: function.into(),
            params: Some(pb::GenerationParams { max_tokens: Some(64), temperature: Some(0.0), ..Default::default() }),
            n: 2,
            ..Default::default()
        };
        let mut stream = client.chat(request).await.unwrap().into_inner();
        let mut calls = [Vec::new(), Vec::new()];
        let mut finished = [0, 0];
        while let Some(message) = stream.message().await.unwrap() {
            let index = message.index as usize;
            assert_eq!(message.text, "", "{choice:?}: no markup in the text");
            if !message.tool_calls.is_empty() {
                assert_eq!(message.token_id, Some(END_TAG), "{choice:?}: the call comes with </tool_call>");
            }
            calls[index].extend(message.tool_calls);
            if message.finish_reason != 0 {
                finished[index] = message.finish_reason;
            }
        }
        assert_eq!(finished, [pb::FinishReason::ToolCalls as i32; 2], "{choice:?}");
        for calls in calls {
            assert_eq!(calls.len(), 1, "{choice:?}");
            let function = calls[0].function.as_ref().unwrap();
            assert_eq!((calls[0].r#type.as_str(), calls[0].id.starts_with("chatcmpl-tool-")), ("function", true));
            assert_eq!(json!({"name": function.name, "arguments": function.arguments}), *expected, "{choice:?}");
        }
    }
}
