//! The Kubernetes manifests' probes ask for health service names the servers really register.

mod common;

use std::time::Duration;

use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
use tpserve::net::{self, Address};

/// Health service names in the manifests' gRPC probes (`service: "..."`) and `tpserve health`
/// exec probes (`"--service", "..."`).
fn probe_services() -> Vec<String> {
    let mut names = Vec::new();
    let mut files = vec![std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("k8s/deployment.yaml")];
    files.push(std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("k8s/multinode/leaderworkerset.yaml"));
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for marker in ["service: \"", "\"--service\", \""] {
            for (at, _) in text.match_indices(marker) {
                let rest = &text[at + marker.len()..];
                names.push(rest[..rest.find('"').unwrap()].to_owned());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

async fn status(address: &str, service: &str) -> Result<ServingStatus, tonic::Status> {
    let address: Address = address.parse().unwrap();
    let channel = net::connect(&address, Duration::from_secs(5)).await.unwrap();
    let response = HealthClient::new(channel).check(HealthCheckRequest { service: service.to_owned() }).await?;
    Ok(ServingStatus::try_from(response.into_inner().status).unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn probe_service_names_are_registered() {
    let names = probe_services();
    assert!(names.contains(&"tpserve.v1.Generator".to_owned()) && names.contains(&"liveness".to_owned()), "{names:?}");
    let server = common::Served::start("qwen3_a", 1);
    for name in &names {
        assert_eq!(status(&server.address, name).await.ok(), Some(ServingStatus::Serving), "coordinator: {name}");
    }
    // Ranks are probed for liveness only.
    let dir = tempfile::tempdir().unwrap();
    let rank = format!("unix://{}", dir.path().join("rank.sock").display());
    let mut child = common::tpserve()
        .args(["rank", "--listen", &rank, "--threads", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&rank, Duration::from_secs(30));
    assert_eq!(status(&rank, "liveness").await.ok(), Some(ServingStatus::Serving));
    // An unregistered name is NOT_FOUND, so the check above means something.
    assert_eq!(status(&rank, "no.such.Service").await.unwrap_err().code(), tonic::Code::NotFound);
    common::terminate(&mut child);
}
