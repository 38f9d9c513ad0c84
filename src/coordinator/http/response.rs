//! OpenAI response bodies built from the coordinator's token messages: whole responses for
//! `stream: false`, chunks for server-sent events.

use serde_json::{Value, json};

use super::types::Endpoint;
use crate::coordinator::ModelHandle;
use crate::proto::v1 as pb;

/// What a response says about its request, whatever its choices.
pub struct Header {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Header {
    pub fn new(endpoint: Endpoint, model: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        let id: [u8; 12] = rand::random();
        let id = format!("{prefix}-{}", id.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Self { endpoint, id, created, model: model.to_owned() }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// A whole response.
    pub fn response(&self, choices: Vec<Value>, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        })
    }

    /// One chunk of a stream; `usage` is null on every chunk but the last when usage was asked
    /// for, and absent when it was not.
    pub fn chunk(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }
}

pub fn usage(prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// OpenAI's finish reason: an output with tool calls is "tool_calls" (as in vLLM, whatever
/// ended it: the stream reading them says so), else "length" or "stop".
pub fn finish_reason(reason: i32) -> &'static str {
    match pb::FinishReason::try_from(reason) {
        Ok(pb::FinishReason::ToolCalls) => "tool_calls",
        Ok(pb::FinishReason::Length | pb::FinishReason::ContextLength) => "length",
        _ => "stop",
    }
}

/// Calls in OpenAI's shape; in a stream's delta each also carries its `index` in the choice's
/// calls, counted from `first_index`.
pub fn tool_calls(calls: &[pb::ToolCall], first_index: Option<usize>) -> Value {
    let call = |(i, call): (usize, &pb::ToolCall)| {
        let (name, arguments) = call.function.as_ref().map_or(("", ""), |f| (f.name.as_str(), f.arguments.as_str()));
        let mut value = json!({"id": call.id, "type": "function", "function": {"name": name, "arguments": arguments}});
        if let Some(first) = first_index {
            value["index"] = json!(first + i);
        }
        value
    };
    Value::Array(calls.iter().enumerate().map(call).collect())
}

/// A token as text: what it decodes to on its own.
fn token_text(model: &ModelHandle, id: u32) -> String {
    model.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// The logprobs of the tokens of `messages`, in the endpoint's shape: chat's
/// `{"content": [{token, logprob, bytes, top_logprobs}]}`, or completions' `{tokens,
/// token_logprobs, top_logprobs, text_offset}` with offsets counted from `offset`.
pub fn logprobs(endpoint: Endpoint, model: &ModelHandle, messages: &[&pb::GenerateResponse], offset: usize) -> Value {
    let tokens = messages.iter().filter_map(|m| m.token_id.map(|id| (id, *m)));
    match endpoint {
        Endpoint::Chat => {
            let entry = |id: u32, logprob: f32| {
                let token = token_text(model, id);
                json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
            };
            let content: Vec<Value> = tokens
                .map(|(id, m)| {
                    let mut value = entry(id, m.logprob.unwrap_or(0.0));
                    value["top_logprobs"] = m.top_logprobs.iter().map(|t| entry(t.token_id, t.logprob)).collect();
                    value
                })
                .collect();
            json!({"content": content})
        }
        Endpoint::Completion => {
            let (mut texts, mut logprobs, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut at = offset;
            for (id, m) in tokens {
                texts.push(token_text(model, id));
                logprobs.push(m.logprob.unwrap_or(0.0));
                let top: serde_json::Map<String, Value> =
                    m.top_logprobs.iter().map(|t| (token_text(model, t.token_id), json!(t.logprob))).collect();
                tops.push(Value::Object(top));
                offsets.push(at);
                at += m.text.len();
            }
            json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
        }
    }
}

/// One finished choice of a whole response. A chat message with tool calls has null content
/// when the model wrote nothing else.
pub fn choice(endpoint: Endpoint, index: usize, content: String, calls: &[pb::ToolCall], logprobs: Value, finish_reason: &str) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let no_content = content.is_empty();
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                if no_content {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = tool_calls(calls, None);
            }
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        }
        Endpoint::Completion => json!({
            "index": index,
            "text": content,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }),
    }
}

/// One choice of a chunk: some text (chat: a delta), maybe logprobs, maybe the finish reason.
pub fn chunk_choice(endpoint: Endpoint, index: usize, delta: Value, logprobs: Value, finish_reason: Option<&str>) -> Value {
    match endpoint {
        Endpoint::Chat => json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}),
        Endpoint::Completion => json!({
            "index": index,
            "text": delta.get("content").cloned().unwrap_or(json!("")),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, arguments: &str) -> pb::ToolCall {
        pb::ToolCall {
            id: id.into(),
            r#type: "function".into(),
            function: Some(pb::FunctionCall { name: name.into(), arguments: arguments.into() }),
        }
    }

    /// Calls come back in OpenAI's shape: whole (content null, arguments as JSON text, finish
    /// reason tool_calls) and as stream deltas (each call with its index in the choice).
    #[test]
    fn tool_calls_have_the_openai_shape() {
        let calls = [call("chatcmpl-tool-1", "get_weather", "{\"city\": \"Paris\"}")];
        let reason = finish_reason(pb::FinishReason::ToolCalls as i32);
        let whole = choice(Endpoint::Chat, 1, String::new(), &calls, Value::Null, reason);
        assert_eq!(whole["finish_reason"], "tool_calls");
        assert_eq!(whole["message"]["content"], Value::Null);
        let whole_call = &whole["message"]["tool_calls"][0];
        assert_eq!(whole_call["type"], "function");
        assert_eq!(whole_call["id"], "chatcmpl-tool-1");
        assert_eq!(whole_call["function"], json!({"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}));
        assert!(whole_call.get("index").is_none());
        let delta = tool_calls(&[call("a", "f", "{}"), call("b", "g", "{}")], Some(2));
        assert_eq!((delta[0]["index"].clone(), delta[1]["index"].clone(), delta[1]["id"].clone()), (json!(2), json!(3), json!("b")));
        // Without calls: the model's text, and the engine's reason.
        let plain = choice(Endpoint::Chat, 0, "hello".into(), &[], Value::Null, finish_reason(pb::FinishReason::Length as i32));
        assert_eq!(plain["message"], json!({"role": "assistant", "content": "hello"}));
        assert_eq!(plain["finish_reason"], "length");
        assert_eq!(finish_reason(pb::FinishReason::Eos as i32), "stop");
    }
}
