//! Metrics: the coordinator's and a rank's /metrics, parsed by a real Prometheus parser
//! (prometheus-client's, from PyPI).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Parses the exposition at `url` with prometheus_client and returns {sample name: value} as
/// JSON (labels folded into the name), plus the family types.
fn scrape(url: &str) -> serde_json::Value {
    let script = r#"
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
samples, types = {}, {}
for family in text_string_to_metric_families(text):
    types[family.name] = family.type
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
        key = s.name + ("{" + labels + "}" if labels else "")
        if "le" in s.labels:
            key += "@" + s.labels["le"]
        samples[key] = s.value
print(json.dumps({"samples": samples, "types": types}))
"#;
    let output = Command::new(common::python()).args(["-c", script, url]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn coordinator_and_rank_metrics_parse_and_count() {
    let dir = tempfile::tempdir().unwrap();
    let (coordinator_port, rank_port) = (free_port(), free_port());
    let ranks: Vec<String> = (0..2).map(|i| format!("unix://{}", dir.path().join(format!("r{i}.sock")).display())).collect();
    let mut processes: Vec<std::process::Child> = ranks
        .iter()
        .enumerate()
        .map(|(i, address)| {
            let mut command = common::tpserve();
            command.args(["rank", "--listen", address, "--threads", "1"]);
            if i == 1 {
                command.args(["--metrics-listen", &format!("127.0.0.1:{rank_port}")]);
            }
            command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
        })
        .collect();
    let api = format!("unix://{}", dir.path().join("api.sock").display());
    processes.push(
        common::tpserve()
            .args(["coordinator", "--rank", &ranks[0], "--rank", &ranks[1], "--listen", &api])
            .args(["--metrics-listen", &format!("127.0.0.1:{coordinator_port}"), "--model"])
            .arg(common::fixture("qwen3_a"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::wait_serving(&api, Duration::from_secs(30));
    for _ in 0..3 {
        let output = common::tpserve()
            .args(["generate", "--server", &api, "--prompt", "Once upon a time", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"])
            .output()
            .unwrap();
        assert!(output.status.success());
    }
    let bad = common::tpserve().args(["generate", "--server", &api, "--prompt-ids", "9999"]).output().unwrap();
    assert!(!bad.status.success());

    let coordinator = scrape(&format!("http://127.0.0.1:{coordinator_port}/metrics"));
    let (samples, types) = (&coordinator["samples"], &coordinator["types"]);
    println!("{coordinator}");
    for (family, kind) in [
        ("tpserve:time_to_first_token_seconds", "histogram"),
        ("tpserve:inter_token_latency_seconds", "histogram"),
        ("tpserve:e2e_request_latency_seconds", "histogram"),
        ("tpserve:num_requests_running", "gauge"),
        ("tpserve:num_requests_waiting", "gauge"),
        ("tpserve:kv_cache_usage_perc", "gauge"),
        ("tpserve:prompt_tokens", "counter"),
        ("tpserve:generation_tokens", "counter"),
        ("tpserve:request_failure", "counter"),
    ] {
        assert_eq!(types[family], kind, "{family}");
    }
    assert_eq!(samples["tpserve:generation_tokens_total"], 15.0);
    assert_eq!(samples["tpserve:time_to_first_token_seconds_count"], 3.0);
    assert_eq!(samples["tpserve:inter_token_latency_seconds_count"], 12.0);
    assert_eq!(samples["tpserve:e2e_request_latency_seconds_count"], 3.0);
    assert_eq!(samples["tpserve:num_requests_running"], 0.0);
    assert_eq!(samples["tpserve:request_failure_total{reason=invalid_request}"], 1.0);

    let rank = scrape(&format!("http://127.0.0.1:{rank_port}/metrics"));
    println!("{rank}");
    let (samples, types) = (&rank["samples"], &rank["types"]);
    assert_eq!(types["tpserve:rank_step_duration_seconds"], "histogram");
    assert_eq!(types["tpserve:rank_collective_seconds"], "counter");
    assert!(samples["tpserve:rank_step_duration_seconds_count"].as_f64().unwrap() >= 15.0);
    assert!(samples["tpserve:rank_collective_seconds_total"].as_f64().unwrap() > 0.0);
    assert!(samples["tpserve:rank_collective_calls_total"].as_f64().unwrap() > 100.0);
    for child in &mut processes {
        common::terminate(child);
    }
}

mod otlp {
    //! A real OTLP/gRPC trace receiver: the collector's TraceService, recording every span.

    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
    use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

    #[derive(Debug, Clone)]
    pub struct Span {
        pub service: String,
        pub name: String,
        pub trace_id: Vec<u8>,
        pub span_id: Vec<u8>,
        pub parent_span_id: Vec<u8>,
    }

    #[derive(Clone, Default)]
    pub struct Receiver(pub Arc<Mutex<Vec<Span>>>);

    #[tonic::async_trait]
    impl TraceService for Receiver {
        async fn export(
            &self,
            request: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
            let mut spans = self.0.lock().unwrap();
            for resource in request.into_inner().resource_spans {
                let service = resource
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|a| a.key == "service.name")
                    .and_then(|a| a.value.as_ref())
                    .and_then(|v| match &v.value {
                        Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => Some(s.clone()),
                        _ => None,
                    })
                    .unwrap_or_default();
                for scope in resource.scope_spans {
                    for span in scope.spans {
                        spans.push(Span {
                            service: service.clone(),
                            name: span.name,
                            trace_id: span.trace_id,
                            span_id: span.span_id,
                            parent_span_id: span.parent_span_id,
                        });
                    }
                }
            }
            Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
        }
    }

    pub async fn start() -> (String, Receiver) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let receiver = Receiver::default();
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        (format!("http://{address}"), receiver)
    }
}

/// One trace per request: the coordinator's request span with queue, prefill, step and
/// detokenize children, and every rank's step span under a coordinator step span, linked
/// through W3C trace context in the gRPC metadata.
#[tokio::test(flavor = "multi_thread")]
async fn traces_link_coordinator_and_rank_spans() {
    let (endpoint, receiver) = otlp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let api = format!("unix://{}", dir.path().join("api.sock").display());
    let mut server = common::tpserve()
        .args(["--otlp-endpoint", &endpoint, "serve", "--tp", "2", "--listen", &api, "--model"])
        .arg(common::fixture("qwen3_a"))
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&api, Duration::from_secs(30));
    let output = common::tpserve()
        .args(["generate", "--server", &api, "--prompt", "Once upon a time", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(output.status.success());
    common::terminate(&mut server); // flushes the exporters

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = receiver.0.lock().unwrap().clone();
        let requests = spans.iter().filter(|s| s.name == "generate").count();
        let rank_steps = spans.iter().filter(|s| s.name == "rank_step").count();
        if requests == 1 && rank_steps >= 8 {
            break spans;
        }
        assert!(std::time::Instant::now() < deadline, "spans did not arrive: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let request = spans.iter().find(|s| s.name == "generate").unwrap();
    assert_eq!(request.service, "tpserve-coordinator");
    for name in ["queue", "prefill", "step", "detokenize"] {
        let children: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
        assert!(!children.is_empty(), "no {name} span");
        for child in children {
            assert_eq!(child.trace_id, request.trace_id, "{name} in another trace");
            assert_eq!(child.parent_span_id, request.span_id, "{name} is not a child of the request");
        }
    }
    let steps: Vec<&otlp::Span> = spans.iter().filter(|s| s.name == "step").collect();
    assert_eq!(steps.len(), 4, "one step span per generated token");
    let rank_steps: Vec<&otlp::Span> = spans.iter().filter(|s| s.name == "rank_step").collect();
    for rank_step in &rank_steps {
        assert_eq!(rank_step.service, "tpserve-rank");
        assert_eq!(rank_step.trace_id, request.trace_id);
        assert!(steps.iter().any(|s| s.span_id == rank_step.parent_span_id), "rank span without a step parent");
    }
    // Each coordinator step has one span on each of the two ranks.
    assert_eq!(rank_steps.len(), 2 * steps.len());
}
