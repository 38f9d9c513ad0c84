//! The OpenAI-compatible HTTP API, beside the gRPC one (`--http-listen`): `POST
//! /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` and `GET /health`.
//!
//! Requests go through the same [`Api`] as gRPC's Generator: readiness, model lookup, prompt
//! encoding, validation and the scheduler's queue, so both APIs refuse and generate alike.
//! Errors are OpenAI error objects with the HTTP status of their kind ([`Error::openai_body`]).
//! Each of `n` choices is its own sequence; dropping a response (the client went away) drops
//! its streams, which cancels the sequences and frees their KV cache.

mod response;
mod sse;
pub mod types;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tonic::service::Interceptor;

use super::error::{Error, Kind};
use super::service::{Api, RpcLimits};
use super::stream::{ClientStream, Item};
use super::tools;
use super::validation::RequestLimits;
use super::{Coordinator, ModelHandle};
use crate::auth::{RequireToken, Secret};
use crate::net::{AcceptBackoff, Address, Listener};
use crate::proto::v1 as pb;
use response::Header;
use types::{Endpoint, Parsed, PromptInput, Prompts};

/// An error as the HTTP API answers it: the coordinator's error, and the request field at fault.
#[derive(Debug)]
pub struct HttpError {
    pub error: Error,
    pub param: Option<String>,
}

impl HttpError {
    pub fn param(error: Error, param: &str) -> Self {
        Self { error, param: Some(param.to_owned()) }
    }
}

impl From<Error> for HttpError {
    fn from(error: Error) -> Self {
        Self { error, param: None }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.error.kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        json_response(status, &self.error.openai_body(self.param.as_deref()))
    }
}

fn json_response(status: StatusCode, value: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], value.to_string()).into_response()
}

struct HttpState {
    api: Api,
    /// the API token, as a bearer token (`Authorization: Bearer <token>`)
    token: Option<Secret>,
    body_limit: usize,
}

/// The largest request body: room for a prompt of `--max-prompt-bytes` even when every byte
/// of it is escaped in JSON, plus the other fields.
pub fn body_limit(limits: &RequestLimits) -> usize {
    limits.max_prompt_bytes.saturating_mul(6).saturating_add(64 << 10)
}

impl HttpState {
    /// The same check of the API token as the gRPC interceptor's.
    fn authorize(&self, headers: &HeaderMap) -> Result<(), HttpError> {
        let mut metadata = HeaderMap::new();
        if let Some(value) = headers.get(header::AUTHORIZATION) {
            metadata.insert(header::AUTHORIZATION, value.clone());
        }
        let request =
            tonic::Request::from_parts(tonic::metadata::MetadataMap::from_headers(metadata), tonic::Extensions::default(), ());
        RequireToken::api(self.token.clone()).call(request).map(drop).map_err(|status| Error::from_status(&status).into())
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, HttpError> {
        body.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                Error::invalid(format!(
                    "the request body is larger than {} bytes, the most accepted (6 × --max-prompt-bytes + 64 KiB)",
                    self.body_limit
                ))
            } else {
                Error::invalid(format!("cannot read the request body: {rejection}"))
            }
            .into()
        })
    }
}

/// The router of the HTTP API.
pub fn router(api: Api, token: Option<Secret>, limits: &RequestLimits) -> Router {
    let body_limit = body_limit(limits);
    let state = Arc::new(HttpState { api, token, body_limit });
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(|| async { HttpError::from(Error::not_found("no such endpoint")) })
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// A connection must send a request's headers within this time of opening or of its previous
/// response, or it is closed: idle keep-alive connections and slowloris clients alike.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running HTTP server; dropping it stops it at once.
pub struct HttpServer {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
    slots: Arc<Semaphore>,
    max_connections: usize,
}

impl HttpServer {
    /// Binds `address` (host:port) and serves the API there on this runtime, under the same
    /// limits as the gRPC port: at most `--max-connections` open connections (more wait in the
    /// kernel's backlog), `--max-concurrent-rpcs` requests producing a response at once (more get
    /// 503), and `--request-timeout-secs` to produce one (then 504).
    pub async fn start(address: &str, api: Api, token: Option<Secret>, limits: &RpcLimits) -> anyhow::Result<Self> {
        let listener = Listener::bind(&Address::Tcp(address.to_owned()))
            .await
            .map_err(|err| anyhow::anyhow!("cannot listen on {address} for the HTTP API: {err:#}"))?;
        tracing::info!(listen = %listener.local_address()?, "HTTP API (OpenAI-compatible) listening");
        let app = router(api, token, &limits.request).layer(axum::middleware::from_fn_with_state(
            Arc::new(Admission { in_flight: Arc::new(Semaphore::new(limits.max_concurrent_rpcs)), timeout: limits.request_timeout }),
            admit,
        ));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        let task = tokio::spawn(accept_loop(listener, app, slots.clone(), stopped));
        Ok(Self { task, stop, slots, max_connections: limits.max_connections })
    }

    /// Stops accepting, lets open responses finish for at most 5 s, then closes them.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let all_closed = self.slots.acquire_many(self.max_connections as u32);
        if tokio::time::timeout(Duration::from_secs(5), all_closed).await.is_err() {
            tracing::warn!("HTTP connections did not close within 5 s; closing them");
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.task.abort();
    }
}

/// Accepts connections (capped, backing off on errors) until stopped, and serves each over
/// HTTP/1.1 with a header timeout. Stopping asks every open connection to finish its response
/// and close.
async fn accept_loop(listener: Listener, app: Router, slots: Arc<Semaphore>, mut stopped: tokio::sync::watch::Receiver<bool>) {
    let mut backoff = AcceptBackoff::new("HTTP API");
    loop {
        let connection = tokio::select! {
            connection = listener.accept(&slots, &mut backoff) => connection,
            _ = stopped.changed() => return,
        };
        let (app, mut stopped) = (app.clone(), stopped.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: axum::http::Request<hyper::body::Incoming>| {
                tower::ServiceExt::oneshot(app.clone(), request)
            });
            let serving = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(connection), service);
            tokio::pin!(serving);
            tokio::select! {
                _ = serving.as_mut() => {}
                _ = stopped.changed() => {
                    serving.as_mut().graceful_shutdown();
                    let _ = serving.await;
                }
            }
        });
    }
}

struct Admission {
    in_flight: Arc<Semaphore>,
    timeout: Duration,
}

/// The gRPC port's load shedding and request timeout, for HTTP: a request waits for no slot
/// (503 when all are taken), and must produce its response (a whole body, or the start of a
/// stream) within the timeout.
async fn admit(State(admission): State<Arc<Admission>>, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Ok(_permit) = admission.in_flight.clone().try_acquire_owned() else {
        return HttpError::from(Error::unavailable("too many requests in flight (--max-concurrent-rpcs); retry shortly"))
            .into_response();
    };
    match tokio::time::timeout(admission.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => HttpError::from(Error::new(
            Kind::Deadline,
            format!("no response within {:?} (--request-timeout-secs)", admission.timeout),
        ))
        .into_response(),
    }
}

/// 200 while the server is SERVING, else 503 with the reason.
async fn health(State(state): State<Arc<HttpState>>) -> Response {
    match state.api.ready() {
        Ok(_) => json_response(StatusCode::OK, &json!({"status": "SERVING"})),
        Err(error) => HttpError::from(error).into_response(),
    }
}

async fn models(State(state): State<Arc<HttpState>>, headers: HeaderMap) -> Result<Response, HttpError> {
    state.authorize(&headers)?;
    let coordinator: Arc<Coordinator> = state.api.ready()?;
    let models = coordinator.models.read().await;
    let mut data: Vec<Value> = models
        .values()
        .map(|m| json!({"id": m.id, "object": "model", "created": 0, "owned_by": "tpserve", "max_model_len": m.max_context}))
        .collect();
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Ok(json_response(StatusCode::OK, &json!({"object": "list", "data": data})))
}

async fn chat_completions(State(state): State<Arc<HttpState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, HttpError> {
    complete(&state, &headers, body, Endpoint::Chat).await
}

async fn completions(State(state): State<Arc<HttpState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, HttpError> {
    complete(&state, &headers, body, Endpoint::Completion).await
}

async fn complete(state: &HttpState, headers: &HeaderMap, body: Result<Bytes, BytesRejection>, endpoint: Endpoint) -> Result<Response, HttpError> {
    state.authorize(headers)?;
    let body = state.body(body)?;
    let request = types::parse(endpoint, &body)?;
    let coordinator = state.api.ready()?;
    let model = state.api.model(&coordinator, &request.model).await.map_err(|e| HttpError::param(e, "model"))?;
    let name = match endpoint {
        Endpoint::Chat => "chat.completions",
        Endpoint::Completion => "completions",
    };
    let span = tracing::info_span!("request", otel.name = name, model = tracing::field::Empty);
    let streams = start(state, &model, &request, span).await?;
    // The one reading of tool calls both APIs share: call markup withheld, each call on the
    // message that closed it.
    let streams: Vec<(usize, BoxStream<'static, Item>)> =
        streams.into_iter().map(|(index, stream)| (index, tools::stream::read(stream, &request.tool_choice))).collect();
    let header = Header::new(endpoint, &model.id);
    let n = request.n as usize;
    let reading = Reading { endpoint, logprobs: request.logprobs() };
    if request.stream {
        let events = sse::Events::new(header, model, reading.logprobs, request.include_usage, n, streams);
        let mut response = Body::from_stream(events.into_stream()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(response);
    }
    let collected = futures::future::try_join_all(streams.into_iter().map(|(index, stream)| collect(reading, &model, index, stream))).await?;
    let (mut prompt_tokens, mut completion_tokens) = (0u64, 0u64);
    let mut choices = Vec::with_capacity(collected.len());
    for (index, (choice, usage)) in collected.into_iter().enumerate() {
        if index % n == 0 {
            prompt_tokens += u64::from(usage.prompt_tokens);
        }
        completion_tokens += u64::from(usage.completion_tokens);
        choices.push(choice);
    }
    Ok(json_response(StatusCode::OK, &header.response(choices, response::usage(prompt_tokens, completion_tokens))))
}

/// Encodes the prompts and queues `n` sequences for each: choice `p * n + i` is choice `i` of
/// prompt `p`, its seed (when one is given) the request's plus `i`.
async fn start(state: &HttpState, model: &Arc<ModelHandle>, request: &Parsed, span: tracing::Span) -> Result<Vec<(usize, ClientStream)>, HttpError> {
    let api = &state.api;
    let prompts: Vec<Result<Vec<u32>, Error>> = match &request.prompts {
        Prompts::Chat { messages, inputs } => {
            let forced = request.tool_choice.forced_prefix();
            vec![api.validator.encode_chat(model, messages.clone(), inputs.clone(), forced).await]
        }
        Prompts::Completion(inputs) => {
            let mut prompts = Vec::with_capacity(inputs.len());
            for input in inputs {
                prompts.push(match input {
                    PromptInput::Text(text) => api.prompt_ids(model, text.clone(), Vec::new()).await,
                    PromptInput::Ids(ids) => api.prompt_ids(model, String::new(), ids.clone()).await,
                });
            }
            prompts
        }
    };
    let n = request.n as usize;
    let mut streams = Vec::with_capacity(prompts.len() * n);
    for (p, prompt_ids) in prompts.into_iter().enumerate() {
        let choices = api.start_choices(model, prompt_ids, request.params.clone(), request.n, None, span.clone()).await?;
        streams.extend(choices.into_iter().enumerate().map(|(i, stream)| (p * n + i, stream)));
    }
    Ok(streams)
}

/// How a choice's output is read: with the endpoint's shape, logprobs or not.
#[derive(Clone, Copy)]
struct Reading {
    endpoint: Endpoint,
    logprobs: bool,
}

/// Reads one choice's stream to its end: the choice of a whole response, and its usage.
async fn collect(reading: Reading, model: &ModelHandle, index: usize, mut stream: BoxStream<'static, Item>) -> Result<(Value, pb::Usage), HttpError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut tokens = Vec::new();
    while let Some(item) = stream.next().await {
        let mut message = item.map_err(|status| Error::from_status(&status))?;
        text.push_str(&message.text);
        calls.append(&mut message.tool_calls);
        if message.finish_reason != pb::FinishReason::Unspecified as i32 {
            let logprobs = if reading.logprobs {
                response::logprobs(reading.endpoint, model, &tokens.iter().collect::<Vec<_>>(), 0)
            } else {
                Value::Null
            };
            let reason = response::finish_reason(message.finish_reason);
            let choice = response::choice(reading.endpoint, index, text, &calls, logprobs, reason);
            return Ok((choice, message.usage.unwrap_or_default()));
        }
        if reading.logprobs {
            tokens.push(message);
        }
    }
    Err(Error::new(Kind::Internal, "a response stream ended without a finish reason").into())
}
