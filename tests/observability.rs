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
