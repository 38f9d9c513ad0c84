//! Server-sent events as OpenAI frames them: one `data: {chunk}` event per token message (whose
//! text is withheld inside a tool call), each tool call whole in a delta of its own when its
//! block closes, the finish reason in a chunk of its own, usage in a last chunk with no choices
//! when the client asked for it (`stream_options.include_usage`), then `data: [DONE]`. An error
//! that ends a stream is sent as `data: {"error": {...}}` before `[DONE]`.
//!
//! The event stream owns the choices' response streams: when the client goes away, the HTTP
//! server drops it, and with it the streams, which cancels their sequences and frees their KV.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{BoxStream, SelectAll, StreamExt};
use serde_json::{Value, json};

use super::response::{self, Header};
use super::types::Endpoint;
use crate::coordinator::ModelHandle;
use crate::coordinator::error::Error;
use crate::coordinator::stream::Item;
use crate::proto::v1 as pb;

pub struct Events {
    header: Header,
    model: Arc<ModelHandle>,
    logprobs: bool,
    /// per choice, the calls sent so far: the next one's index in the choice's `tool_calls`
    calls_sent: Vec<usize>,
    include_usage: bool,
    /// choices per prompt: usage counts each prompt once
    n: usize,
    choices: SelectAll<BoxStream<'static, (usize, Item)>>,
    /// completions: where each choice's next text starts, for text_offset
    offsets: Vec<usize>,
    out: VecDeque<Bytes>,
    done: bool,
    prompt_tokens: u64,
    completion_tokens: u64,
}

fn frame(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

impl Events {
    /// `streams` are the choices' streams, already read for tool calls when the request asked
    /// for that (`tools::stream`).
    pub fn new(
        header: Header,
        model: Arc<ModelHandle>,
        logprobs: bool,
        include_usage: bool,
        n: usize,
        streams: Vec<(usize, BoxStream<'static, Item>)>,
    ) -> Self {
        let mut events = Self {
            header,
            model,
            logprobs,
            calls_sent: vec![0; streams.len()],
            include_usage,
            n,
            choices: SelectAll::new(),
            offsets: vec![0; streams.len()],
            out: VecDeque::new(),
            done: false,
            prompt_tokens: 0,
            completion_tokens: 0,
        };
        for (index, stream) in streams {
            if events.header.endpoint == Endpoint::Chat {
                let delta = json!({"role": "assistant", "content": ""});
                let choice = response::chunk_choice(Endpoint::Chat, index, delta, Value::Null, None);
                events.push(vec![choice]);
            }
            events.choices.push(stream.map(move |item| (index, item)).boxed());
        }
        events
    }

    fn push(&mut self, choices: Vec<Value>) {
        let usage = self.include_usage.then_some(Value::Null);
        let chunk = self.header.chunk(choices, usage);
        self.out.push_back(frame(&chunk));
    }

    fn on_message(&mut self, index: usize, message: pb::GenerateResponse) {
        let endpoint = self.header.endpoint;
        let finished = message.finish_reason != pb::FinishReason::Unspecified as i32;
        let has_token = message.token_id.is_some();
        if !message.text.is_empty() || (self.logprobs && has_token) {
            let logprobs = if self.logprobs && has_token {
                response::logprobs(endpoint, &self.model, &[&message], self.offsets[index])
            } else {
                Value::Null
            };
            self.offsets[index] += message.text.len();
            let delta = json!({"content": message.text});
            self.push(vec![response::chunk_choice(endpoint, index, delta, logprobs, None)]);
        }
        if !message.tool_calls.is_empty() {
            // Each call whole, in one delta, as soon as its block closed.
            let delta = json!({"tool_calls": response::tool_calls(&message.tool_calls, Some(self.calls_sent[index]))});
            self.calls_sent[index] += message.tool_calls.len();
            self.push(vec![response::chunk_choice(endpoint, index, delta, Value::Null, None)]);
        }
        if finished {
            if let Some(usage) = message.usage {
                if index % self.n == 0 {
                    self.prompt_tokens += u64::from(usage.prompt_tokens);
                }
                self.completion_tokens += u64::from(usage.completion_tokens);
            }
            let reason = response::finish_reason(message.finish_reason);
            self.push(vec![response::chunk_choice(endpoint, index, json!({}), Value::Null, Some(reason))]);
        }
    }

    fn end(&mut self, error: Option<Error>) {
        match error {
            Some(error) => {
                self.out.push_back(frame(&error.openai_body(None)));
                // Cancel the other choices now rather than when the body is dropped.
                self.choices = SelectAll::new();
            }
            None if self.include_usage => {
                let usage = response::usage(self.prompt_tokens, self.completion_tokens);
                let chunk = self.header.chunk(Vec::new(), Some(usage));
                self.out.push_back(frame(&chunk));
            }
            None => {}
        }
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }

    /// The body: SSE frames as they become ready.
    pub fn into_stream(self) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send {
        futures::stream::unfold(self, |mut events| async move {
            loop {
                if let Some(bytes) = events.out.pop_front() {
                    return Some((Ok(bytes), events));
                }
                if events.done {
                    return None;
                }
                match events.choices.next().await {
                    Some((index, Ok(message))) => events.on_message(index, message),
                    Some((_, Err(status))) => events.end(Some(Error::from_status(&status))),
                    None => events.end(None),
                }
            }
        })
    }
}
