//! Tool calling and chat-template variables against transformers' own renderings of the real
//! Qwen3 template (tests/fixtures/qwen3_chat, from scripts/oracle/make_qwen3_chat.py): tools,
//! an assistant turn with tool calls, a tool result, `enable_thinking`.
//!
//! The template is checked three ways: rendered in-process (string and ids equal the
//! reference); served, through the official `openai` client, where greedy output and logprobs
//! for the chat must equal those for the reference ids sent as a raw prompt (so the served
//! prompt is the reference prompt token for token); and through gRPC's Chat, which must match
//! HTTP. The served model has random weights over the real Qwen3 vocabulary, written by the test,
//! so it never calls a tool by itself: here the output parser is tested on the real tokenizer's
//! tokens of a Qwen3 tool call, streamed through the real detokenizer, and `tests/tool_calls.rs`
//! serves a model that does call one.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tpserve::coordinator::chat_template::ChatTemplate;
use tpserve::coordinator::detokenizer::IncrementalDecoder;
use tpserve::coordinator::{pyjson, tools};
use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

use common::qwen3_chat::{CASES, case, inputs, messages, oracle, oracle_dir, reference_ids, text};


/// Every case renders to transformers' string, and that string tokenizes to its ids.
#[test]
fn qwen3_template_renders_like_transformers() {
    let template = ChatTemplate::from_model_dir(&oracle_dir()).unwrap().expect("the Qwen3 template");
    let tokenizer = tokenizers::Tokenizer::from_file(oracle_dir().join("tokenizer.json")).unwrap();
    for name in CASES {
        let case = case(name);
        let rendered = template.render_with(&messages(&case), true, &inputs(&case)).unwrap();
        assert_eq!(rendered, text(&case, "rendered").unwrap(), "case {name}");
        let ids = tokenizer.encode(rendered.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(ids, reference_ids(&case), "case {name}");
    }
}

/// A Qwen3 tool call as the model emits it (the real tokenizer's tokens, after some content),
/// detokenized token by token as the engine does, splits into content and the call, streamed or
/// whole; streamed, the call comes with the `</tool_call>` token; the arguments come back as
/// Python's json.dumps text.
#[test]
fn the_parser_reads_a_real_qwen3_tool_call() {
    let example = text(&oracle(), "tool_call_output_example").unwrap();
    let output = format!("Let me check the weather.\n\n{example}");
    let tokenizer = Arc::new(tokenizers::Tokenizer::from_file(oracle_dir().join("tokenizer.json")).unwrap());
    let ids = tokenizer.encode(output.as_str(), false).unwrap().get_ids().to_vec();
    assert!(ids.contains(&151657) && ids.contains(&151658), "<tool_call> and </tool_call> are single tokens: {ids:?}");
    let mut decoder = IncrementalDecoder::new(tokenizer.clone(), &[151644, 77091, 198]);
    let mut parser = tools::StreamParser::default();
    let mut streamed = tools::Output::default();
    let mut whole = String::new();
    for id in ids {
        let delta = decoder.push(id).unwrap();
        whole.push_str(&delta);
        let out = parser.push(&delta);
        assert_eq!(out.calls.is_empty(), id != 151658, "token {id}: the call comes with its end tag");
        streamed.append(out);
    }
    let rest = decoder.finish();
    whole.push_str(&rest);
    streamed.append(parser.push(&rest));
    streamed.append(parser.finish());
    assert_eq!(whole, output);
    assert_eq!(streamed.content, "Let me check the weather.\n\n");
    let parsed = tools::parse(&whole);
    assert_eq!(parsed.content, streamed.content);
    for calls in [&streamed.calls, &parsed.calls] {
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].name.as_str(), calls[0].arguments.as_str()), ("get_weather", r#"{"city": "Paris"}"#));
    }
}

/// A random-weight Qwen3 over the real Qwen3 vocabulary with the real tokenizer and template,
/// written once under target/.
fn qwen3_vocab_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-qwen3-vocab-model");
    static MADE: std::sync::Once = std::sync::Once::new();
    MADE.call_once(|| common::qwen3_vocab::write_random(&dir));
    dir
}

/// The official client: chats with tools, with a tool call and its result, and with
/// enable_thinking off, each beside the completion of transformers' ids for the same case.
const CLIENT: &str = r#"
import json, sys, openai
base, model, cases = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))["cases"]
case = {c["name"]: c for c in cases}
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
greedy = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
def chat(**kwargs):
    return client.chat.completions.create(logprobs=True, **greedy, **kwargs).model_dump()
def raw(name):
    return client.completions.create(prompt=case[name]["ids"], logprobs=0, **greedy).model_dump()
tools = case["tools"]["tools"]
out = {"tools": chat(messages=case["tools"]["messages"], tools=tools), "tools_raw": raw("tools")}
# The round trip as a client makes it: the call comes back with an id and its arguments as JSON
# text, the result answers that id.
call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
turns = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21, "unit": "c"}'}]
out["round_trip"] = chat(messages=turns, tools=tools, tool_choice="auto")
out["round_trip_raw"] = raw("tool_round_trip")
out["round_trip_stream"] = [c.model_dump() for c in client.chat.completions.create(messages=turns, tools=tools, stream=True, **greedy)]
extra = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
out["no_thinking"] = client.chat.completions.create(messages=case["no_thinking"]["messages"], logprobs=True,
    **{**greedy, "extra_body": extra}).model_dump()
out["no_thinking_raw"] = raw("no_thinking")
print(json.dumps(out))
"#;

fn assert_same_generation(chat: &Value, raw: &Value, reference: &[u32], what: &str) {
    let choice = &chat["choices"][0];
    assert_eq!(chat["usage"]["prompt_tokens"], reference.len(), "{what}: the prompt is the reference's length");
    assert_eq!(choice["message"]["content"], raw["choices"][0]["text"], "{what}");
    assert_eq!(choice["finish_reason"], "length", "{what}");
    assert!(choice["message"].get("tool_calls").is_none_or(Value::is_null), "{what}: {choice}");
    let chat_logprobs: Vec<f64> = choice["logprobs"]["content"].as_array().unwrap().iter().map(|e| e["logprob"].as_f64().unwrap()).collect();
    let raw_logprobs: Vec<f64> =
        raw["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(chat_logprobs.len(), 6, "{what}");
    assert_eq!(chat_logprobs, raw_logprobs, "{what}: the same prompt gives the same distributions");
}

struct Server {
    served: common::Served,
    port: u16,
}

fn serve() -> Server {
    let port = common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let model = qwen3_vocab_model();
    // Prefix caching off: a request that hits a cached prefix prefills fewer tokens and rounds
    // differently, and these comparisons are bitwise (the same prompt, the same distributions).
    let served = common::Served::start_with(model.to_str().unwrap(), 2, &["--http-listen", &listen, "--prefix-cache", "off"]);
    Server { served, port }
}

#[tokio::test(flavor = "multi_thread")]
async fn openai_client_tool_round_trip_renders_like_transformers() {
    let server = serve();
    let python = common::openai_python();
    let base = format!("http://127.0.0.1:{}/v1", server.port);
    let expected = oracle_dir().join("expected.json");
    let output = Command::new(python).args(["-c", CLIENT, &base, "test-qwen3-vocab-model"]).arg(&expected).output().unwrap();
    assert!(output.status.success(), "the openai client failed: {}", String::from_utf8_lossy(&output.stderr));
    let out: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_same_generation(&out["tools"], &out["tools_raw"], &reference_ids(&case("tools")), "tools");
    assert_same_generation(&out["round_trip"], &out["round_trip_raw"], &reference_ids(&case("tool_round_trip")), "round trip");
    assert_same_generation(&out["no_thinking"], &out["no_thinking_raw"], &reference_ids(&case("no_thinking")), "enable_thinking");
    let streamed: String = out["round_trip_stream"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, out["round_trip"]["choices"][0]["message"]["content"].as_str().unwrap());

    // gRPC's Chat with the same tools, messages and template variables gives the same tokens.
    let address: Address = server.served.address.parse().unwrap();
    let mut client = GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap());
    let call = pb::ToolCall {
        id: "call_0".into(),
        r#type: "function".into(),
        function: Some(pb::FunctionCall { name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() }),
    };
    let message = |role: &str, content: &str| pb::ChatMessage { role: role.into(), content: content.into(), ..Default::default() };
    let messages = vec![
        message("user", "Weather in Paris?"),
        pb::ChatMessage { tool_calls: vec![call], ..message("assistant", "") },
        pb::ChatMessage { tool_call_id: "call_0".into(), ..message("tool", r#"{"temp": 21, "unit": "c"}"#) },
    ];
    // The tools as JSON text in the oracle's key order (a serde_json::Value would sort the keys).
    let tools = pyjson::dumps(&case("tools").get_attr("tools").unwrap()).unwrap();
    let params = pb::GenerationParams { max_tokens: Some(6), temperature: Some(0.0), ignore_eos: true, ..Default::default() };
    let request = pb::ChatRequest { messages, tools_json: tools, params: Some(params.clone()), n: 2, ..Default::default() };
    let (texts, usage, last) = drain(client.chat(request).await.unwrap().into_inner()).await;
    assert_eq!(texts, vec![out["round_trip"]["choices"][0]["message"]["content"].as_str().unwrap().to_owned(); 2]);
    assert_eq!(usage.prompt_tokens as usize, reference_ids(&case("tool_round_trip")).len());
    assert_eq!(last, [pb::FinishReason::Length as i32; 2]);
    let request = pb::ChatRequest {
        messages: vec![message("user", "2+2?")],
        chat_template_kwargs_json: r#"{"enable_thinking": false}"#.into(),
        params: Some(params),
        ..Default::default()
    };
    let (texts, _, _) = drain(client.chat(request).await.unwrap().into_inner()).await;
    assert_eq!(texts[0], out["no_thinking"]["choices"][0]["message"]["content"].as_str().unwrap());
}

/// Each choice's text, the usage, and each choice's finish reason.
async fn drain(mut stream: tonic::Streaming<pb::GenerateResponse>) -> (Vec<String>, pb::Usage, Vec<i32>) {
    let (mut texts, mut usage, mut reasons) = (Vec::<String>::new(), pb::Usage::default(), Vec::new());
    while let Some(message) = stream.message().await.unwrap() {
        let index = message.index as usize;
        if texts.len() <= index {
            texts.resize(index + 1, String::new());
            reasons.resize(index + 1, 0);
        }
        texts[index].push_str(&message.text);
        if message.finish_reason != 0 {
            reasons[index] = message.finish_reason;
            usage = message.usage.unwrap_or_default();
        }
    }
    (texts, usage, reasons)
}
