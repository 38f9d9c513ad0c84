//! The public gRPC services: Generator (generate, chat, tokenize, model info) and Admin.
//! Every request is validated here, so bad input gets a status a person can act on and never
//! reaches a rank.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::WeightFormat;
use super::chat_template::{ChatMessage, FunctionCall, TemplateInputs, ToolCall};
use super::choices;
use super::error::{Error, Kind};
use super::pyjson;
use super::tools::{self, ToolChoice};
use super::stream::ClientStream;
use super::validation::{RequestLimits, Validator};
use super::{Coordinator, ModelHandle};
use crate::auth::RequireToken;
use crate::proto::v1 as pb;
use crate::proto::v1::admin_server::{Admin, AdminServer};
use crate::proto::v1::generator_server::{Generator, GeneratorServer};

type CoordinatorCell = watch::Receiver<Option<Arc<Coordinator>>>;
type ResponseStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// Limits the tower layers enforce on every RPC of the public server.
#[derive(Debug, Clone)]
pub struct RpcLimits {
    /// RPCs handled at once; beyond it new ones are shed with UNAVAILABLE instead of queueing
    pub max_concurrent_rpcs: usize,
    /// open connections to the public port; past it new clients wait in the kernel's backlog
    pub max_connections: usize,
    /// bound on producing a response: the whole of a unary call, the start of a stream
    pub request_timeout: std::time::Duration,
    /// bounds on what one request may carry
    pub request: RequestLimits,
}

impl Default for RpcLimits {
    fn default() -> Self {
        Self {
            max_concurrent_rpcs: 1024,
            max_connections: 1024,
            request_timeout: std::time::Duration::from_secs(600),
            request: RequestLimits::default(),
        }
    }
}

/// HTTP/2 PINGs on idle public connections find clients that vanished without closing (a
/// dead host, a dropped NAT entry), so their streams are cancelled and their sequences freed.
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

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
        .http2_max_local_error_reset_streams(Some(4096))
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .layer(layers)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(GeneratorServer::with_interceptor(
            GeneratorService { api: Api::new(coordinator.clone(), limits.request.clone()) },
            RequireToken::api(tokens.api),
        ))
        .add_service(AdminServer::with_interceptor(AdminService { coordinator }, RequireToken::admin(tokens.admin)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

fn ready(cell: &CoordinatorCell) -> Result<Arc<Coordinator>, Error> {
    let coordinator = cell
        .borrow()
        .clone()
        .ok_or_else(|| Error::unavailable("the server is starting: ranks are initialising or the model is loading"))?;
    if coordinator.supervisor.is_draining() {
        return Err(Error::unavailable("the server is shutting down; send the request to another replica"));
    }
    if !coordinator.supervisor.is_serving() {
        return Err(Error::unavailable("the server is recovering from a rank failure; retry shortly"));
    }
    Ok(coordinator)
}

async fn find_model(coordinator: &Coordinator, id: &str) -> Result<Arc<ModelHandle>, Error> {
    coordinator.model(id).await.ok_or_else(|| {
        if id.is_empty() {
            Error::not_found("no model is loaded")
        } else {
            Error::not_found(format!("model \"{id}\" is not loaded (the loaded models: Admin.ListModels, or GET /v1/models over HTTP)"))
        }
    })
}

/// What every public API (gRPC Generator, the OpenAI-compatible HTTP API) does with a request:
/// readiness, finding the model, encoding the prompt, validating and queueing.
#[derive(Clone)]
pub struct Api {
    coordinator: CoordinatorCell,
    pub validator: Arc<Validator>,
}

impl Api {
    pub fn new(coordinator: CoordinatorCell, limits: RequestLimits) -> Self {
        Self { coordinator, validator: Arc::new(Validator::new(limits)) }
    }

    /// The coordinator, if it is serving: not starting, draining or recovering.
    pub fn ready(&self) -> Result<Arc<Coordinator>, Error> {
        ready(&self.coordinator)
    }

    /// A loaded model by id ("" is the default model).
    pub async fn model(&self, coordinator: &Coordinator, id: &str) -> Result<Arc<ModelHandle>, Error> {
        find_model(coordinator, id).await
    }

    /// The token ids of a prompt given as text or as ids (exactly one of them).
    pub async fn prompt_ids(&self, model: &Arc<ModelHandle>, text: String, ids: Vec<u32>) -> Result<Vec<u32>, Error> {
        match (text.is_empty(), ids.is_empty()) {
            (false, false) => Err(Error::invalid("give either prompt or prompt_ids, not both")),
            (true, true) => Err(Error::invalid("the prompt is empty: give prompt text or prompt_ids")),
            (false, true) => self.validator.encode_prompt(model, text, true).await,
            (true, false) => Ok(ids),
        }
    }

    /// Queues `n` sequences of one prompt (0 counts as 1): choice `i` is seeded with the
    /// request's seed plus `i`, so choices differ yet each is reproducible.
    pub async fn start_choices(
        &self,
        model: &Arc<ModelHandle>,
        prompt_ids: Result<Vec<u32>, Error>,
        params: pb::GenerationParams,
        n: u32,
        deadline: Option<std::time::Instant>,
        span: tracing::Span,
    ) -> Result<Vec<ClientStream>, Error> {
        let n = check_choices(n)?;
        let prompt_ids = prompt_ids.map_err(|error| refused(model, error))?;
        let mut streams = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut params = params.clone();
            params.seed = params.seed.map(|seed| seed.wrapping_add(u64::from(i)));
            streams.push(self.start(model, Ok(prompt_ids.clone()), params, deadline, span.clone()).await?);
        }
        Ok(streams)
    }

    /// Queues a validated prompt; counts requests refused as invalid.
    pub async fn start(
        &self,
        model: &Arc<ModelHandle>,
        prompt_ids: Result<Vec<u32>, Error>,
        params: pb::GenerationParams,
        deadline: Option<std::time::Instant>,
        span: tracing::Span,
    ) -> Result<ClientStream, Error> {
        match prompt_ids {
            Ok(ids) => self.validator.queue(model, ids, params, deadline, span).await.map_err(|error| refused(model, error)),
            Err(error) => Err(refused(model, error)),
        }
    }
}

/// Counts a request refused as invalid.
fn refused(model: &ModelHandle, error: Error) -> Error {
    if matches!(error.kind, Kind::InvalidRequest | Kind::OutOfRange) {
        model.metrics.failure("invalid_request");
    }
    error
}

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: u32 = 16;

/// `n` as requested, 0 meaning 1.
pub fn check_choices(n: u32) -> Result<u32, Error> {
    match n {
        0 => Ok(1),
        n if n <= MAX_CHOICES => Ok(n),
        _ => Err(Error::invalid(format!("n must be between 1 and {MAX_CHOICES}"))),
    }
}

/// A Chat request's conversation, tools and template variables, as the template takes them.
fn chat_inputs(request: &mut pb::ChatRequest) -> Result<(Vec<ChatMessage>, TemplateInputs, ToolChoice), Error> {
    let json = |field: &str, text: &str| {
        pyjson::parse(text).map_err(|err| Error::invalid(format!("{field} is not valid JSON: {err}")))
    };
    let tools = match request.tools_json.as_str() {
        "" => None,
        text => Some(json("tools_json", text)?),
    };
    if let Some(tools) = &tools {
        tools::check_tools(tools).map_err(|err| Error::invalid(format!("tools_json: {err}")))?;
    }
    let mut kwargs = std::collections::BTreeMap::new();
    if !request.chat_template_kwargs_json.is_empty() {
        let value = json("chat_template_kwargs_json", &request.chat_template_kwargs_json)?;
        let keys = value.try_iter().ok().filter(|_| value.kind() == minijinja::value::ValueKind::Map);
        let keys = keys.ok_or_else(|| Error::invalid("chat_template_kwargs_json must be a JSON object"))?;
        for key in keys {
            let item = value.get_item(&key).unwrap_or_default();
            kwargs.insert(key.to_string(), item);
        }
    }
    // As OpenAI's JSON, so both APIs read it in one place.
    let function = std::mem::take(&mut request.tool_choice_function);
    let choice = match pb::ToolChoice::try_from(request.tool_choice) {
        Ok(pb::ToolChoice::Function) => Some(serde_json::json!({"type": "function", "function": {"name": function}})),
        Ok(_) if !function.is_empty() => {
            return Err(Error::invalid("tool_choice_function is only read with tool_choice TOOL_CHOICE_FUNCTION"));
        }
        Ok(pb::ToolChoice::Unspecified) => None,
        Ok(pb::ToolChoice::None) => Some(serde_json::json!("none")),
        Ok(pb::ToolChoice::Auto) => Some(serde_json::json!("auto")),
        Ok(pb::ToolChoice::Required) => Some(serde_json::json!("required")),
        Err(_) => return Err(Error::invalid(format!("tool_choice {} is not a ToolChoice", request.tool_choice))),
    };
    let choice = ToolChoice::parse(choice.as_ref(), tools.as_ref()).map_err(Error::invalid)?;
    let messages = std::mem::take(&mut request.messages).into_iter().enumerate().map(|(i, m)| chat_message(i, m)).collect::<Result<_, _>>()?;
    Ok((messages, TemplateInputs { tools, kwargs }, choice))
}

fn chat_message(index: usize, message: pb::ChatMessage) -> Result<ChatMessage, Error> {
    let tool_calls = message
        .tool_calls
        .into_iter()
        .enumerate()
        .map(|(j, call)| {
            let field = format!("messages[{index}].tool_calls[{j}]");
            let function = call.function.ok_or_else(|| Error::invalid(format!("{field}.function is required")))?;
            tool_call(&field, call.id, call.r#type, function.name, &function.arguments)
        })
        .collect::<Result<_, _>>()?;
    let optional = |text: String| (!text.is_empty()).then_some(text);
    Ok(ChatMessage {
        role: message.role,
        content: message.content,
        tool_calls,
        tool_call_id: optional(message.tool_call_id),
        name: optional(message.name),
    })
}

/// One call of an assistant message, its arguments parsed from OpenAI's JSON text (both APIs).
pub fn tool_call(field: &str, id: String, kind: String, name: String, arguments: &str) -> Result<ToolCall, Error> {
    if name.is_empty() {
        return Err(Error::invalid(format!("{field}.function.name is required")));
    }
    let arguments = pyjson::parse(arguments)
        .map_err(|err| Error::invalid(format!("{field}.function.arguments must be a JSON object in text: {err}")))?;
    let kind = if kind.is_empty() { "function".to_owned() } else { kind };
    Ok(ToolCall { id, kind, function: FunctionCall { name, arguments } })
}

pub struct GeneratorService {
    api: Api,
}

#[tonic::async_trait]
impl Generator for GeneratorService {
    type GenerateStream = ResponseStream;
    type ChatStream = ResponseStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<ResponseStream>, Status> {
        let coordinator = self.api.ready()?;
        let deadline = request_deadline(request.metadata());
        let span = request_span("generate", request.metadata());
        let request = request.into_inner();
        let model = self.api.model(&coordinator, &request.model).await?;
        let prompt_ids = self.api.prompt_ids(&model, request.prompt, request.prompt_ids).await;
        let params = request.params.unwrap_or_default();
        let streams = self.api.start_choices(&model, prompt_ids, params, request.n, deadline, span).await?;
        Ok(Response::new(choices::merge(streams, &ToolChoice::None)))
    }

    async fn chat(&self, request: Request<pb::ChatRequest>) -> Result<Response<ResponseStream>, Status> {
        let coordinator = self.api.ready()?;
        let deadline = request_deadline(request.metadata());
        let span = request_span("chat", request.metadata());
        let mut request = request.into_inner();
        let model = self.api.model(&coordinator, &request.model).await?;
        let (messages, inputs, tool_choice) = chat_inputs(&mut request)?;
        let prompt_ids = self.api.validator.encode_chat(&model, messages, inputs, tool_choice.forced_prefix()).await;
        let params = request.params.unwrap_or_default();
        let streams = self.api.start_choices(&model, prompt_ids, params, request.n, deadline, span).await?;
        Ok(Response::new(choices::merge(streams, &tool_choice)))
    }

    async fn tokenize(&self, request: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        let coordinator = self.api.ready()?;
        let request = request.into_inner();
        let model = self.api.model(&coordinator, &request.model).await?;
        Ok(Response::new(self.api.validator.tokenize(&model, request.text, request.add_special_tokens).await?))
    }

    async fn model_info(&self, request: Request<pb::ModelInfoRequest>) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let coordinator = self.api.ready()?;
        let model = self.api.model(&coordinator, &request.get_ref().model).await?;
        Ok(Response::new(model.info(coordinator.supervisor.tp_size())))
    }
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

pub struct AdminService {
    coordinator: CoordinatorCell,
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn load_model(&self, request: Request<pb::LoadModelRequest>) -> Result<Response<pb::LoadModelResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let request = request.into_inner();
        if request.model_id.is_empty() || request.path.is_empty() {
            return Err(Error::invalid("model_id and path are required").into());
        }
        if coordinator.model(&request.model_id).await.is_some() {
            return Err(Error::new(Kind::AlreadyExists, format!("model \"{}\" is already loaded", request.model_id)).into());
        }
        let dtype = if request.dtype.is_empty() { "auto" } else { &request.dtype };
        let weights = WeightFormat {
            dtype: dtype.to_owned(),
            quantize: request.quantize.clone(),
            matmul_precision: request.matmul_precision.clone(),
            kv_cache_dtype: request.kv_cache_dtype.clone(),
        };
        let handle = coordinator.load_model(&request.model_id, std::path::Path::new(&request.path), &weights).await?;
        Ok(Response::new(pb::LoadModelResponse { model: Some(handle.info(coordinator.supervisor.tp_size())) }))
    }

    async fn unload_model(&self, request: Request<pb::UnloadModelRequest>) -> Result<Response<pb::UnloadModelResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let id = &request.get_ref().model_id;
        match coordinator.unload_model(id).await? {
            true => Ok(Response::new(pb::UnloadModelResponse {})),
            false => Err(Error::not_found(format!("model \"{id}\" is not loaded")).into()),
        }
    }

    async fn list_models(&self, _request: Request<pb::ListModelsRequest>) -> Result<Response<pb::ListModelsResponse>, Status> {
        let coordinator = ready(&self.coordinator)?;
        let tp = coordinator.supervisor.tp_size();
        let models = coordinator.models.read().await.values().map(|m| m.info(tp)).collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}
