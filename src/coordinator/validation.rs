//! Checks on every public request before it reaches the step loop: sizes first (so a huge
//! field costs nothing), then the request against its model, then admission to the queue.
//! Tokenization and chat-template rendering run here too, on blocking threads, a few at a
//! time: a long prompt must not stall the async runtime that streams everyone's tokens.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::ModelHandle;
use super::error::{Error, Kind};
use super::chat_template::{ChatMessage, TemplateInputs};
use super::pyjson;
use super::engine::NewRequest;
use super::stop::{self, StopLimits, StopSet};
use super::stream::{self, ClientStream};
use crate::proto::rank::v1 as rank_pb;
use crate::proto::v1 as pb;
use crate::sampling::SamplingParams;

/// At most this many alternatives per token, as in OpenAI's API.
const MAX_TOP_LOGPROBS: u32 = 20;

/// Bounds on the variable-size fields of a request (docs/reliability.md lists them).
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// bytes of prompt text (Generate, Tokenize), or of all chat messages together, before
    /// tokenization
    pub max_prompt_bytes: usize,
    pub max_chat_messages: usize,
    pub stop: StopLimits,
    /// messages a stream may fall behind its client before it is cut off
    pub stream_buffer: usize,
    /// tokenizations and template renderings running at once
    pub tokenizer_threads: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_prompt_bytes: 1 << 20,
            max_chat_messages: 1024,
            stop: StopLimits { max_count: 64, max_bytes: 256 },
            stream_buffer: 512,
            tokenizer_threads: 2,
        }
    }
}

/// Validates requests and turns text into token ids, within [`RequestLimits`].
pub struct Validator {
    pub limits: RequestLimits,
    tokenizing: Arc<Semaphore>,
}

impl Validator {
    pub fn new(limits: RequestLimits) -> Self {
        let tokenizing = Arc::new(Semaphore::new(limits.tokenizer_threads.max(1)));
        Self { limits, tokenizing }
    }

    fn check_text(&self, what: &str, bytes: usize) -> Result<(), Error> {
        let limit = self.limits.max_prompt_bytes;
        if bytes > limit {
            return Err(Error::invalid(format!(
                "{what} is {bytes} bytes; at most {limit} bytes are accepted (--max-prompt-bytes)"
            )));
        }
        Ok(())
    }

    /// Runs `work` on a blocking thread, at most `tokenizer_threads` at a time.
    async fn off_runtime<T: Send + 'static>(&self, work: impl FnOnce() -> Result<T, Error> + Send + 'static) -> Result<T, Error> {
        let _permit = self.tokenizing.clone().acquire_owned().await.map_err(|_| Error::unavailable("the server is stopping"))?;
        tokio::task::spawn_blocking(work).await.map_err(|err| Error::internal(format!("tokenizer task failed: {err}")))?
    }

    /// The token ids of a prompt text.
    pub async fn encode_prompt(&self, model: &Arc<ModelHandle>, text: String, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
        self.check_text("the prompt", text.len())?;
        let model = model.clone();
        self.off_runtime(move || encode(&model, &text, add_special_tokens)).await
    }

    /// The token ids of a chat, rendered through the model's template with the request's tools
    /// and template variables, which count toward the size limit with the messages. A
    /// `forced_call` (the opening of a tool call, for tool_choice required or a named function)
    /// follows the template's generation prompt, so the model's turn starts with it.
    pub async fn encode_chat(
        &self,
        model: &Arc<ModelHandle>,
        messages: Vec<ChatMessage>,
        inputs: TemplateInputs,
        forced_call: Option<String>,
    ) -> Result<Vec<u32>, Error> {
        if messages.is_empty() {
            return Err(Error::invalid("messages is empty: give at least one message"));
        }
        let limit = self.limits.max_chat_messages;
        if messages.len() > limit {
            return Err(Error::invalid(format!(
                "{} chat messages given; at most {limit} are accepted (--max-chat-messages)",
                messages.len()
            )));
        }
        self.check_text("the chat's messages, tools and template variables together", chat_bytes(&messages, &inputs))?;
        let Some(template) = &model.chat_template else {
            return Err(Error::new(Kind::Unsupported, format!("model \"{}\" has no chat template; use Generate", model.id)));
        };
        if forced_call.is_some() && !template.writes_hermes_calls() {
            // Forcing a format the model was not taught would only produce a broken call.
            return Err(Error::new(
                Kind::Unsupported,
                format!(
                    "tool_choice \"required\" or a named function forces a Hermes-style <tool_call> JSON call, and the chat \
                     template of model \"{}\" does not teach that format; use tool_choice \"auto\"",
                    model.id
                ),
            ));
        }
        let model = model.clone();
        self.off_runtime(move || {
            let template = model.chat_template.as_ref().ok_or_else(|| Error::internal("chat template missing"))?;
            let mut prompt = template
                .render_with(&messages, true, &inputs)
                .map_err(|err| Error::invalid(format!("cannot render the chat template: {err:#}")))?;
            if let Some(forced) = forced_call {
                prompt.push_str(&forced);
            }
            // The template already wrote any special tokens the model expects.
            encode(&model, &prompt, false)
        })
        .await
    }

    /// Tokenize RPC: ids and token strings, empty text allowed.
    pub async fn tokenize(&self, model: &Arc<ModelHandle>, text: String, add_special_tokens: bool) -> Result<pb::TokenizeResponse, Error> {
        self.check_text("the text", text.len())?;
        let model = model.clone();
        self.off_runtime(move || {
            let encoding = model
                .tokenizer
                .encode(text.as_str(), add_special_tokens)
                .map_err(|err| Error::invalid(format!("cannot tokenize: {err}")))?;
            Ok(pb::TokenizeResponse { ids: encoding.get_ids().to_vec(), tokens: encoding.get_tokens().to_vec() })
        })
        .await
    }

    /// Validates a request against the model and queues it; the stream carries its tokens.
    pub async fn queue(
        &self,
        model: &Arc<ModelHandle>,
        prompt_ids: Vec<u32>,
        params: pb::GenerationParams,
        deadline: Option<std::time::Instant>,
        span: tracing::Span,
    ) -> Result<ClientStream, Error> {
        validate_and_queue(model, prompt_ids, params, deadline, span, &self.limits).await
    }
}

fn encode(model: &ModelHandle, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
    let encoding = model
        .tokenizer
        .encode(text, add_special_tokens)
        .map_err(|err| Error::invalid(format!("cannot tokenize the prompt: {err}")))?;
    if encoding.get_ids().is_empty() {
        return Err(Error::invalid("the prompt encodes to no tokens"));
    }
    Ok(encoding.get_ids().to_vec())
}

async fn validate_and_queue(
    model: &Arc<ModelHandle>,
    prompt_ids: Vec<u32>,
    params: pb::GenerationParams,
    deadline: Option<std::time::Instant>,
    span: tracing::Span,
    limits: &RequestLimits,
) -> Result<ClientStream, Error> {
    let vocab_size = model.config.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Error::invalid(format!(
            "prompt token id {bad} is outside the vocabulary (ids must be below {vocab_size})"
        )));
    }
    let context = model.max_context;
    if prompt_ids.len() >= context {
        return Err(Error::out_of_range(format!(
            "the prompt has {} tokens but the model's context is {context}: shorten it to at most {} tokens",
            prompt_ids.len(),
            context - 1
        )));
    }
    let room = context - prompt_ids.len();
    let max_tokens = match params.max_tokens {
        Some(0) => return Err(Error::invalid("max_tokens must be at least 1")),
        Some(n) if n as usize > context => {
            return Err(Error::out_of_range(format!(
                "max_tokens {n} exceeds the model's context of {context} tokens"
            )));
        }
        // Generation also stops at the context length, reported as such.
        Some(n) => (n as usize).min(room),
        None => room.min(model.kv_capacity_tokens.saturating_sub(prompt_ids.len())).max(1),
    };
    let need = prompt_ids.len() + max_tokens;
    if need > model.kv_capacity_tokens {
        return Err(Error::out_of_range(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) needs {need} tokens of KV cache, \
             but the ranks hold {}; lower max_tokens or shorten the prompt",
            prompt_ids.len(),
            model.kv_capacity_tokens
        )));
    }
    let sampling = sampling_params(&params, vocab_size)?;
    stop::validate(&params.stop, limits.stop).map_err(Error::invalid)?;
    let stop = Arc::new(StopSet::new(&params.stop));
    let (responses, stream) = stream::channel(limits.stream_buffer);
    // Refuse at once rather than queue without bound: the client can back off or go elsewhere.
    let waiting = model.stats.waiting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if waiting >= model.max_waiting as u64 {
        model.stats.waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        model.metrics.failure("queue_full");
        return Err(Error::capacity(format!(
            "the server is at capacity: {waiting} requests are already waiting for model \"{}\"; retry later",
            model.id
        )));
    }
    span.record("model", model.id.as_str());
    let queue_span = tracing::info_span!(parent: &span, "queue");
    let request = NewRequest {
        span,
        queue_span,
        arrived: std::time::Instant::now(),
        deadline,
        prompt_ids,
        sampling,
        max_tokens,
        stop,
        ignore_eos: params.ignore_eos,
        responses,
    };
    model.stats.requests_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if model.submit.send(request).await.is_err() {
        model.stats.waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        return Err(Error::unavailable(format!("model \"{}\" is being unloaded", model.id)));
    }
    Ok(stream)
}

/// API defaults follow OpenAI's: temperature 1, no truncation, no penalties, a random seed.
fn sampling_params(params: &pb::GenerationParams, vocab_size: usize) -> Result<rank_pb::SamplingParams, Error> {
    let checked = SamplingParams {
        temperature: params.temperature.unwrap_or(1.0),
        top_k: params.top_k.unwrap_or(0),
        top_p: params.top_p.unwrap_or(1.0),
        min_p: params.min_p.unwrap_or(0.0),
        repetition_penalty: params.repetition_penalty.unwrap_or(1.0),
        presence_penalty: params.presence_penalty.unwrap_or(0.0),
        frequency_penalty: params.frequency_penalty.unwrap_or(0.0),
        seed: params.seed.unwrap_or_else(rand::random),
        top_logprobs: params.top_logprobs,
    };
    checked.validate(vocab_size).map_err(Error::invalid)?;
    if params.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(Error::invalid(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}")));
    }
    Ok(rank_pb::SamplingParams {
        temperature: checked.temperature,
        top_k: checked.top_k,
        top_p: checked.top_p,
        min_p: checked.min_p,
        repetition_penalty: checked.repetition_penalty,
        presence_penalty: checked.presence_penalty,
        frequency_penalty: checked.frequency_penalty,
        seed: checked.seed,
        top_logprobs: checked.top_logprobs,
        logprobs: params.logprobs || params.top_logprobs > 0,
        suppressed_token_ids: Vec::new(),
    })
}


/// The text a chat carries, in bytes: what its render and tokenization cost grows with.
fn chat_bytes(messages: &[ChatMessage], inputs: &TemplateInputs) -> usize {
    let json = |value: &minijinja::Value| pyjson::dumps(value).map_or(0, |text| text.len());
    let message = |m: &ChatMessage| {
        let calls: usize = m.tool_calls.iter().map(|c| c.id.len() + c.function.name.len() + json(&c.function.arguments)).sum();
        m.role.len() + m.content.len() + calls + m.tool_call_id.as_ref().map_or(0, String::len) + m.name.as_ref().map_or(0, String::len)
    };
    let kwargs: usize = inputs.kwargs.iter().map(|(k, v)| k.len() + json(v)).sum();
    messages.iter().map(message).sum::<usize>() + inputs.tools.as_ref().map_or(0, json) + kwargs
}

