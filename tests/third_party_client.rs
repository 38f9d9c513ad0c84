//! A third-party client (Python grpcio with grpcio-health-checking and grpcio-reflection, as
//! installed by .ci/run) checks health and lists services by reflection on the coordinator and
//! on a rank, over TCP and over a Unix socket, and sends malformed messages that must be
//! rejected without harm.

mod common;

use std::process::{Command, Stdio};

fn probe(target: &str, args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/grpc_probe.py");
    let output = Command::new(common::python()).arg(script).arg(target).args(args).output().expect("python runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "grpc_probe.py {target} {args:?} failed: {stderr}"
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn free_tcp_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn check_coordinator(target: &str) {
    assert_eq!(probe(target, &["health"]), "SERVING");
    assert_eq!(probe(target, &["health", "tpserve.v1.Generator"]), "SERVING");
    for version in ["v1", "v1alpha"] {
        let services = probe(target, &["list", version]);
        for expected in [
            "tpserve.v1.Generator",
            "tpserve.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ] {
            assert!(services.lines().any(|s| s == expected), "{target} {version}: {expected} missing from {services}");
        }
    }
    // Malformed bytes are refused, and the server keeps serving.
    let code = probe(target, &["malformed", "/tpserve.v1.Generator/Tokenize"]);
    assert_ne!(code, "OK", "a malformed message was accepted");
    println!("{target}: malformed Tokenize -> {code}");
    assert_eq!(probe(target, &["health"]), "SERVING");
}

#[test]
fn coordinator_over_unix_socket() {
    let server = common::Served::start("qwen3_a", 2);
    check_coordinator(&server.address);
}

#[test]
fn coordinator_over_tcp() {
    let address = free_tcp_address();
    let mut child = common::tpserve()
        .args(["serve", "--model"])
        .arg(common::fixture("qwen3_a"))
        .args(["--tp", "2", "--listen", &address])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, std::time::Duration::from_secs(60));
    check_coordinator(&address);
    common::terminate(&mut child);
}

#[test]
fn rank_over_unix_socket_and_tcp() {
    let dir = tempfile::tempdir().unwrap();
    for address in [format!("unix://{}", dir.path().join("rank.sock").display()), free_tcp_address()] {
        let mut rank = common::tpserve()
            .args(["rank", "--listen", &address, "--threads", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        common::wait_serving(&address, std::time::Duration::from_secs(30));
        assert_eq!(probe(&address, &["health"]), "SERVING");
        let services = probe(&address, &["list", "v1"]);
        assert!(services.lines().any(|s| s == "tpserve.rank.v1.Rank"), "{services}");
        let code = probe(&address, &["malformed", "/tpserve.rank.v1.Rank/GenerateStep"]);
        assert_ne!(code, "OK");
        println!("{address}: malformed GenerateStep -> {code}");
        assert_eq!(probe(&address, &["health"]), "SERVING");
        common::terminate(&mut rank);
    }
}
