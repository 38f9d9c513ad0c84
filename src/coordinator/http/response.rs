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

pub fn finish_reason(reason: i32) -> &'static str {
    match pb::FinishReason::try_from(reason) {
        Ok(pb::FinishReason::Length | pb::FinishReason::ContextLength) => "length",
        _ => "stop",
    }
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

/// One finished choice of a whole response.
pub fn choice(endpoint: Endpoint, index: usize, text: String, logprobs: Value, finish_reason: &str) -> Value {
    match endpoint {
        Endpoint::Chat => json!({
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }),
        Endpoint::Completion => json!({
            "index": index,
            "text": text,
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
