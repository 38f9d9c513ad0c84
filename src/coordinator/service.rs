//! The public gRPC services: Generator (generate, chat, tokenize, model info) and Admin.
//! Every request is validated here, so bad input gets a status a person can act on and never
//! reaches a rank.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::chat_template::ChatMessage;
use super::engine::NewRequest;
use super::{Coordinator, ModelHandle};
use crate::auth::RequireToken;
use crate::proto::rank::v1 as rank_pb;
use crate::proto::v1 as pb;
use crate::proto::v1::admin_server::{Admin, AdminServer};
use crate::proto::v1::generator_server::{Generator, GeneratorServer};
use crate::rank::sampling::SamplingParams;

type CoordinatorCell = watch::Receiver<Option<Arc<Coordinator>>>;
type ResponseStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// At most this many alternatives per token, as in OpenAI's API.
const MAX_TOP_LOGPROBS: u32 = 20;

/// Limits the tower layers enforce on every RPC of the public server.
#[derive(Debug, Clone)]
pub struct RpcLimits {
    /// RPCs handled at once; beyond it new ones are shed with UNAVAILABLE instead of queueing
    pub max_concurrent_rpcs: usize,
    /// bound on producing a response: the whole of a unary call, the start of a stream
    pub request_timeout: std::time::Duration,
}

impl Default for RpcLimits {
    fn default() -> Self {
        Self { max_concurrent_rpcs: 1024, request_timeout: std::time::Duration::from_secs(600) }
    }
}

/// Serves health, reflection (v1 and v1alpha), Generator and Admin, behind load shedding, a
/// concurrency limit and a timeout, until `shutdown` resolves.
pub async fn serve(
    health: tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    coordinator: CoordinatorCell,
    limits: RpcLimits,
    tokens: super::Tokens,
    tls: Option<tonic::transport::ServerTlsConfig>,
    incoming: crate::net::Incoming,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let (reflection_v1, reflection_v1alpha) = crate::proto::reflection_services(&[
        "tpserve.v1.Generator",
        "tpserve.v1.Admin",
        "grpc.health.v1.Health",
    ])?;
    let layers = tower::ServiceBuilder::new()
        .load_shed()
        .concurrency_limit(limits.max_concurrent_rpcs)
        .timeout(limits.request_timeout)
        .into_inner();
    // Cancelling a stream is a normal client action (the engine frees its sequence), so allow
    // many per connection before h2's rapid-reset protection closes it; the default (20
    // pending) disconnects an ordinary client that cancels a few streams in a row.
    let mut builder = tonic::transport::Server::builder()
        .http2_max_pending_accept_reset_streams(Some(1024))
        .http2_max_local_error_reset_streams(Some(4096));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .layer(layers)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(GeneratorServer::with_interceptor(
            GeneratorService { coordinator: coordinator.clone() },
            RequireToken::api(tokens.api),
        ))
        .add_service(AdminServer::with_interceptor(AdminService { coordinator }, RequireToken::admin(tokens.admin)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

fn ready(cell: &CoordinatorCell) -> Result<Arc<Coordinator>, Status> {
    let coordinator = cell
        .borrow()
        .clone()
        .ok_or_else(|| Status::unavailable("the server is starting: ranks are initialising or the model is loading"))?;
    if coordinator.supervisor.is_draining() {
        return Err(Status::unavailable("the server is shutting down; send the request to another replica"));
    }
    if !coordinator.supervisor.is_serving() {
        return Err(Status::unavailable("the server is recovering from a rank failure; retry shortly"));
    }
    Ok(coordinator)
}

async fn find_model(coordinator: &Coordinator, id: &str) -> Result<Arc<ModelHandle>, Status> {
    coordinator.model(id).await.ok_or_else(|| {
        if id.is_empty() {
            Status::not_found("no model is loaded")
        } else {
            Status::not_found(format!("model \"{id}\" is not loaded (see Admin.ListModels)"))
        }
    })
}

pub struct GeneratorService {
    coordinator: CoordinatorCell,
}

#[tonic::async_trait]
impl Generator for GeneratorService {
    type GenerateStream = ResponseStream;
    type ChatStream = ResponseStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<ResponseStream>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let deadline = request_deadline(request.metadata());
        let span = request_span("generate", request.metadata());
        let request = request.into_inner();
        let model = find_model(&coordinator, &request.model).await?;
        let prompt_ids = match (request.prompt.is_empty(), request.prompt_ids.is_empty()) {
            (false, false) => return Err(Status::invalid_argument("give either prompt or prompt_ids, not both")),
            (true, true) => return Err(Status::invalid_argument("the prompt is empty: give prompt text or prompt_ids")),
            (false, true) => encode(&model, &request.prompt, true)?,
            (true, false) => request.prompt_ids,
        };
        start(&model, prompt_ids, request.params.unwrap_or_default(), deadline, span).await
    }

    async fn chat(&self, request: Request<pb::ChatRequest>) -> Result<Response<ResponseStream>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let deadline = request_deadline(request.metadata());
        let span = request_span("chat", request.metadata());
        let request = request.into_inner();
        let model = find_model(&coordinator, &request.model).await?;
        if request.messages.is_empty() {
            return Err(Status::invalid_argument("messages is empty: give at least one message"));
        }
        let template = model.chat_template.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!("model \"{}\" has no chat template; use Generate", model.id))
        })?;
        let messages: Vec<ChatMessage> =
            request.messages.into_iter().map(|m| ChatMessage { role: m.role, content: m.content }).collect();
        let prompt = template
            .render(&messages, true)
            .map_err(|err| Status::invalid_argument(format!("cannot render the chat template: {err:#}")))?;
        // The template already wrote any special tokens the model expects.
        let prompt_ids = encode(&model, &prompt, false)?;
        start(&model, prompt_ids, request.params.unwrap_or_default(), deadline, span).await
    }

    async fn tokenize(&self, request: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let request = request.into_inner();
        let model = find_model(&coordinator, &request.model).await?;
        let encoding = model
            .tokenizer
            .encode(request.text.as_str(), request.add_special_tokens)
            .map_err(|err| Status::invalid_argument(format!("cannot tokenize: {err}")))?;
        Ok(Response::new(pb::TokenizeResponse {
            ids: encoding.get_ids().to_vec(),
            tokens: encoding.get_tokens().to_vec(),
        }))
    }

    async fn model_info(&self, request: Request<pb::ModelInfoRequest>) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let model = find_model(&coordinator, &request.get_ref().model).await?;
        Ok(Response::new(model.info(coordinator.supervisor.tp_size())))
    }
}

fn encode(model: &ModelHandle, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Status> {
    let encoding = model
        .tokenizer
        .encode(text, add_special_tokens)
        .map_err(|err| Status::invalid_argument(format!("cannot tokenize the prompt: {err}")))?;
    if encoding.get_ids().is_empty() {
        return Err(Status::invalid_argument("the prompt encodes to no tokens"));
    }
    Ok(encoding.get_ids().to_vec())
}

/// The deadline a client set with grpc-timeout ("<digits><unit>", unit one of H M S m u n).
fn request_deadline(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Instant> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let value: u64 = digits.parse().ok()?;
    let timeout = match unit {
        "H" => std::time::Duration::from_secs(value.saturating_mul(3600)),
        "M" => std::time::Duration::from_secs(value.saturating_mul(60)),
        "S" => std::time::Duration::from_secs(value),
        "m" => std::time::Duration::from_millis(value),
        "u" => std::time::Duration::from_micros(value),
        "n" => std::time::Duration::from_nanos(value),
        _ => return None,
    };
    std::time::Instant::now().checked_add(timeout)
}

/// The root span of one request's trace, continuing the client's trace when it sent one.
fn request_span(method: &'static str, metadata: &tonic::metadata::MetadataMap) -> tracing::Span {
    let span = tracing::info_span!("request", otel.name = method, model = tracing::field::Empty);
    crate::telemetry::set_parent_from(&span, metadata);
    span
}

/// Validates a request against the model and queues it; the stream carries its tokens.
async fn start(
    model: &Arc<ModelHandle>,
    prompt_ids: Vec<u32>,
    params: pb::GenerationParams,
    deadline: Option<std::time::Instant>,
    span: tracing::Span,
) -> Result<Response<ResponseStream>, Status> {
    let result = validate_and_queue(model, prompt_ids, params, deadline, span).await;
    if let Err(status) = &result {
        if status.code() == tonic::Code::InvalidArgument || status.code() == tonic::Code::OutOfRange {
            model.metrics.failure("invalid_request");
        }
    }
    result
}

async fn validate_and_queue(
    model: &Arc<ModelHandle>,
    prompt_ids: Vec<u32>,
    params: pb::GenerationParams,
    deadline: Option<std::time::Instant>,
    span: tracing::Span,
) -> Result<Response<ResponseStream>, Status> {
    let vocab_size = model.config.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(Status::invalid_argument(format!(
            "prompt token id {bad} is outside the vocabulary (ids must be below {vocab_size})"
        )));
    }
    let context = model.max_context;
    if prompt_ids.len() >= context {
        return Err(Status::out_of_range(format!(
            "the prompt has {} tokens but the model's context is {context}: shorten it to at most {} tokens",
            prompt_ids.len(),
            context - 1
        )));
    }
    let room = context - prompt_ids.len();
    let max_tokens = match params.max_tokens {
        Some(0) => return Err(Status::invalid_argument("max_tokens must be at least 1")),
        Some(n) if n as usize > context => {
            return Err(Status::out_of_range(format!(
                "max_tokens {n} exceeds the model's context of {context} tokens"
            )));
        }
        // Generation also stops at the context length, reported as such.
        Some(n) => (n as usize).min(room),
        None => room.min(model.kv_capacity_tokens.saturating_sub(prompt_ids.len())).max(1),
    };
    let need = prompt_ids.len() + max_tokens;
    if need > model.kv_capacity_tokens {
        return Err(Status::out_of_range(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) needs {need} tokens of KV cache, \
             but the ranks hold {}; lower max_tokens or shorten the prompt",
            prompt_ids.len(),
            model.kv_capacity_tokens
        )));
    }
    let sampling = sampling_params(&params, vocab_size)?;
    super::stop::validate(&params.stop).map_err(Status::invalid_argument)?;
    let (responses, receiver) = mpsc::channel(256);
    // Refuse at once rather than queue without bound: the client can back off or go elsewhere.
    let waiting = model.stats.waiting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if waiting >= model.max_waiting as u64 {
        model.stats.waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        model.metrics.failure("queue_full");
        return Err(Status::resource_exhausted(format!(
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
        stop: params.stop,
        ignore_eos: params.ignore_eos,
        responses,
    };
    model.stats.requests_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if model.submit.send(request).await.is_err() {
        model.stats.waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        return Err(Status::unavailable(format!("model \"{}\" is being unloaded", model.id)));
    }
    Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver))))
}

/// API defaults follow OpenAI's: temperature 1, no truncation, no penalties, a random seed.
fn sampling_params(params: &pb::GenerationParams, vocab_size: usize) -> Result<rank_pb::SamplingParams, Status> {
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
    checked.validate(vocab_size).map_err(Status::invalid_argument)?;
    if params.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(Status::invalid_argument(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}")));
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

pub struct AdminService {
    coordinator: CoordinatorCell,
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn load_model(&self, request: Request<pb::LoadModelRequest>) -> Result<Response<pb::LoadModelResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let request = request.into_inner();
        if request.model_id.is_empty() || request.path.is_empty() {
            return Err(Status::invalid_argument("model_id and path are required"));
        }
        if coordinator.model(&request.model_id).await.is_some() {
            return Err(Status::already_exists(format!("model \"{}\" is already loaded", request.model_id)));
        }
        let dtype = if request.dtype.is_empty() { "auto" } else { &request.dtype };
        let handle = coordinator
            .load_model(&request.model_id, std::path::Path::new(&request.path), dtype)
            .await
            .map_err(|err| Status::invalid_argument(format!("cannot load model: {err:#}")))?;
        Ok(Response::new(pb::LoadModelResponse { model: Some(handle.info(coordinator.supervisor.tp_size())) }))
    }

    async fn unload_model(&self, request: Request<pb::UnloadModelRequest>) -> Result<Response<pb::UnloadModelResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let id = &request.get_ref().model_id;
        match coordinator.unload_model(id).await {
            Ok(true) => Ok(Response::new(pb::UnloadModelResponse {})),
            Ok(false) => Err(Status::not_found(format!("model \"{id}\" is not loaded"))),
            Err(err) => Err(Status::unavailable(format!("unloading failed on a rank: {err:#}"))),
        }
    }

    async fn list_models(&self, _request: Request<pb::ListModelsRequest>) -> Result<Response<pb::ListModelsResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let tp = coordinator.supervisor.tp_size();
        let models = coordinator.models.read().await.values().map(|m| m.info(tp)).collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}
