//! Logs and traces.
//!
//! Logs go to stderr as text or JSON. With an OTLP endpoint (`--otlp-endpoint` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`), spans are also exported over OTLP/gRPC: one trace per
//! request, the coordinator's spans (request, queue, prefill, each step, detokenize) and each
//! rank's step span linked through W3C trace context carried in gRPC metadata.

use anyhow::{Context as _, Result};
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Keeps the trace exporter alive; `shutdown` flushes the spans not yet sent.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(err) = provider.shutdown() {
                eprintln!("warning: flushing traces failed: {err}");
            }
        }
    }
}

/// Installs the global subscriber: stderr logs filtered by RUST_LOG (default info), plus OTLP
/// export when an endpoint is configured. Must run inside the tokio runtime (the exporter's
/// gRPC client lives there).
pub fn init(log_format: &str, service_name: &str, otlp_endpoint: Option<&str>) -> Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = log_format == "json";
    let text_logs = (!json).then(|| tracing_subscriber::fmt::layer().with_writer(std::io::stderr));
    let json_logs = json.then(|| tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr));
    let endpoint = otlp_endpoint
        .map(str::to_owned)
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().filter(|e| !e.is_empty()));
    let provider = match &endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()
                .with_context(|| format!("cannot set up OTLP export to {endpoint}"))?;
            let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name.to_owned()).build();
            Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
        }
        None => None,
    };
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("tpserve")));
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    // A second init (tests, demo) keeps the first subscriber.
    let _ = tracing_subscriber::registry().with(filter).with(text_logs).with(json_logs).with(otel).try_init();
    if let Some(endpoint) = endpoint {
        tracing::info!(%endpoint, service = service_name, "exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}

/// Writes `span`'s trace context into gRPC metadata (W3C traceparent).
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    let context = span.context();
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.inject_context(&context, &mut MetadataWriter(metadata)));
}

/// Makes `span` a child of the trace context in incoming gRPC metadata, if there is one.
pub fn set_parent_from(span: &tracing::Span, metadata: &MetadataMap) {
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&MetadataReader(metadata)));
    let _ = span.set_parent(parent);
}

struct MetadataWriter<'a>(&'a mut MetadataMap);

impl Injector for MetadataWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str())) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataReader<'a>(&'a MetadataMap);

impl Extractor for MetadataReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
