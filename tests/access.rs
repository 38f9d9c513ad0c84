//! Access control: the cluster token on rank RPCs, socket modes, the optional API token, the
//! Admin token; and Admin loading broken models while the served one keeps serving.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::time::Duration;

use tonic::Code;
use tonic::metadata::MetadataValue;
use tpserve::net::{self, Address};
use tpserve::proto::rank::v1::InfoRequest;
use tpserve::proto::rank::v1::rank_client::RankClient;
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::admin_client::AdminClient;
use tpserve::proto::v1::generator_client::GeneratorClient;

async fn channel(address: &str) -> tonic::transport::Channel {
    let address: Address = address.parse().unwrap();
    net::connect(&address, Duration::from_secs(10)).await.unwrap()
}

fn with_header<T>(message: T, name: &'static str, value: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(name, MetadataValue::try_from(value).unwrap());
    request
}

fn info() -> InfoRequest {
    InfoRequest { protocol_version: tpserve::proto::RANK_PROTOCOL_VERSION }
}

/// Rank RPCs need the cluster token; health does not (probes); sockets are 0660; a
/// coordinator with the wrong token is refused with a message that says so.
#[tokio::test(flavor = "multi_thread")]
async fn rank_requires_the_cluster_token() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("rank.sock");
    let address = format!("unix://{}", socket.display());
    let mut rank = common::tpserve()
        .args(["rank", "--listen", &address, "--threads", "1"])
        .env("TPSERVE_CLUSTER_TOKEN", "right-token")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(30));
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");

    let mut client = RankClient::new(channel(&address).await);
    assert_eq!(client.info(info()).await.unwrap_err().code(), Code::Unauthenticated);
    let wrong = client.info(with_header(info(), "x-tpserve-cluster-token", "wrong")).await.unwrap_err();
    assert_eq!(wrong.code(), Code::Unauthenticated);
    assert!(client.info(with_header(info(), "x-tpserve-cluster-token", "right-token")).await.is_ok());

    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "wrong-token\n").unwrap();
    let api = format!("unix://{}", dir.path().join("api.sock").display());
    let output = common::tpserve()
        .args(["coordinator", "--rank", &address, "--listen", &api, "--rank-wait-secs", "5", "--model"])
        .arg(common::fixture("qwen3_a"))
        .arg("--cluster-token-file")
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("wrong cluster token"), "{stderr}");
    common::terminate(&mut rank);
}

/// With an API token, Generate needs it (the CLI reads it from the environment); health stays
/// open; Admin is disabled without an admin token.
#[tokio::test(flavor = "multi_thread")]
async fn api_token_protects_the_generator_and_admin_is_off_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("unix://{}", dir.path().join("api.sock").display());
    let mut server = common::tpserve()
        .args(["serve", "--tp", "1", "--listen", &address, "--model"])
        .arg(common::fixture("qwen3_a"))
        .env("TPSERVE_API_TOKEN", "api-secret")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(30));
    let mode = std::fs::metadata(dir.path().join("api.sock")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);

    let mut client = GeneratorClient::new(channel(&address).await);
    let request = pb::ModelInfoRequest::default();
    assert_eq!(client.model_info(request.clone()).await.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(
        client.model_info(with_header(request.clone(), "authorization", "Bearer nope")).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert!(client.model_info(with_header(request, "authorization", "Bearer api-secret")).await.is_ok());

    let run = |token: Option<&str>| {
        let mut command = common::tpserve();
        command.args(["generate", "--server", &address, "--prompt", "Once", "--max-tokens", "2", "--temperature", "0"]);
        command.env_remove("TPSERVE_API_TOKEN");
        if let Some(token) = token {
            command.env("TPSERVE_API_TOKEN", token);
        }
        command.output().unwrap()
    };
    let refused = run(None);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("Unauthenticated"));
    assert!(run(Some("api-secret")).status.success());

    let mut admin = AdminClient::new(channel(&address).await);
    let status = admin.list_models(with_header(pb::ListModelsRequest {}, "authorization", "Bearer api-secret")).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    common::terminate(&mut server);
}

fn copy_fixture(name: &str, into: &std::path::Path) -> std::path::PathBuf {
    let target = into.join(name);
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(common::fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), target.join(entry.file_name())).unwrap();
    }
    target
}

/// Admin with its token: loading each kind of broken model fails with a clear error on every
/// rank, and the model already served keeps serving; a good second model loads, serves and
/// unloads.
#[tokio::test(flavor = "multi_thread")]
async fn admin_loads_and_rejects_models_without_harm() {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("unix://{}", dir.path().join("api.sock").display());
    let mut server = common::tpserve()
        .args(["serve", "--tp", "2", "--listen", &address, "--model"])
        .arg(common::fixture("qwen3_a"))
        .env("TPSERVE_ADMIN_TOKEN", "admin-secret")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::wait_serving(&address, Duration::from_secs(30));
    let mut admin = AdminClient::new(channel(&address).await);
    let load = |id: &str, path: &std::path::Path| {
        with_header(
            pb::LoadModelRequest { model_id: id.into(), path: path.display().to_string(), dtype: String::new(), quantize: String::new(), matmul_precision: String::new(), kv_cache_dtype: String::new() },
            "authorization",
            "Bearer admin-secret",
        )
    };
    assert_eq!(
        admin.list_models(pb::ListModelsRequest {}).await.unwrap_err().code(),
        Code::Unauthenticated
    );

    let broken = dir.path().join("broken");
    let truncated = copy_fixture("qwen3_b", &broken.join("truncated"));
    let bytes = std::fs::read(truncated.join("model.safetensors")).unwrap();
    std::fs::write(truncated.join("model.safetensors"), &bytes[..bytes.len() - 1000]).unwrap();
    let bad_config = copy_fixture("qwen3_b", &broken.join("bad_config"));
    std::fs::write(bad_config.join("config.json"), "{\"model_type\": ").unwrap();
    let unsupported = copy_fixture("qwen3_b", &broken.join("unsupported"));
    let config = std::fs::read_to_string(unsupported.join("config.json")).unwrap();
    std::fs::write(unsupported.join("config.json"), config.replace("\"qwen3\"", "\"mamba\"")).unwrap();
    let heads = copy_fixture("qwen3_b", &broken.join("heads"));
    let config = std::fs::read_to_string(heads.join("config.json")).unwrap();
    let config = config.replace("\"num_attention_heads\": 12", "\"num_attention_heads\": 3");
    std::fs::write(heads.join("config.json"), config.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 1")).unwrap();
    let missing = copy_fixture("qwen3_b", &broken.join("missing"));
    let shapes = copy_fixture("qwen3_b", &broken.join("shapes"));
    let tensors = candle_core::safetensors::load(missing.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut without = tensors.clone();
    without.remove("model.layers.1.self_attn.k_proj.weight");
    candle_core::safetensors::save(&without, missing.join("model.safetensors")).unwrap();
    let mut reshaped = tensors;
    let wrong = candle_core::Tensor::zeros((8, 96), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    reshaped.insert("model.layers.0.self_attn.v_proj.weight".into(), wrong);
    candle_core::safetensors::save(&reshaped, shapes.join("model.safetensors")).unwrap();

    let cases = [
        ("truncated", &truncated, "safetensors"),
        ("bad_config", &bad_config, "config.json"),
        ("unsupported", &unsupported, "unsupported model_type"),
        ("heads", &heads, "tensor-parallel size 2"),
        ("missing", &missing, "model.layers.1.self_attn.k_proj.weight"),
        ("shapes", &shapes, "model.layers.0.self_attn.v_proj.weight"),
    ];
    let prompt = &common::expected("qwen3_a")[0];
    for (what, path, mention) in cases {
        let status = admin.load_model(load(what, path)).await.unwrap_err();
        println!("{what}: {:?}: {}", status.code(), status.message());
        assert_eq!(status.code(), Code::InvalidArgument, "{what}");
        assert!(status.message().contains(mention), "{what}: {}", status.message());
        let (stdout, ok) = generate(&address, &prompt.ids);
        assert!(ok, "{what}: the served model stopped serving");
        assert_eq!(common::parse_json_stream(&stdout).0, prompt.greedy_new_ids, "{what}");
    }

    let good = admin.load_model(load("second", &common::fixture("qwen3_b"))).await.unwrap().into_inner();
    assert_eq!(good.model.unwrap().model_id, "second");
    let listed = admin.list_models(with_header(pb::ListModelsRequest {}, "authorization", "Bearer admin-secret")).await.unwrap();
    assert_eq!(listed.into_inner().models.len(), 2);
    let b = &common::expected("qwen3_b")[0];
    let output = common::tpserve()
        .args(["generate", "--server", &address, "--model", "second", "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16"])
        .args(["--prompt-ids", &common::ids_arg(&b.ids)])
        .output()
        .unwrap();
    assert_eq!(common::parse_json_stream(&String::from_utf8_lossy(&output.stdout)).0, b.greedy_new_ids);
    let unload = with_header(pb::UnloadModelRequest { model_id: "second".into() }, "authorization", "Bearer admin-secret");
    admin.unload_model(unload).await.unwrap();
    let (stdout, ok) = generate(&address, &prompt.ids);
    assert!(ok);
    assert_eq!(common::parse_json_stream(&stdout).0, prompt.greedy_new_ids);
    common::terminate(&mut server);
}

fn generate(address: &str, ids: &[u32]) -> (String, bool) {
    let output = common::tpserve()
        .args(["generate", "--server", address, "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16"])
        .args(["--prompt-ids", &common::ids_arg(ids)])
        .output()
        .unwrap();
    (String::from_utf8_lossy(&output.stdout).into_owned(), output.status.success())
}

fn free_tcp_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("localhost:{}", listener.local_addr().unwrap().port())
}

/// TLS between coordinator and a rank over TCP, and on the public port: clients that trust the
/// certificate are served; plaintext clients are not.
#[tokio::test(flavor = "multi_thread")]
async fn tls_between_coordinator_and_ranks_and_on_the_public_port() {
    let dir = tempfile::tempdir().unwrap();
    // A CA, and a server certificate for localhost signed by it (webpki refuses a CA
    // certificate used as the server's own).
    let path = |name: &str| dir.path().join(name).display().to_string();
    let (ca, cert, key) = (dir.path().join("ca.pem"), dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let openssl = |args: &[&str]| {
        let status = std::process::Command::new("openssl").args(args).stderr(Stdio::null()).status().expect("openssl runs");
        assert!(status.success(), "openssl {args:?}");
    };
    openssl(&["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=tpserve test CA",
        "-keyout", &path("ca-key.pem"), "-out", &path("ca.pem")]);
    openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", &path("key.pem"), "-out", &path("cert.csr")]);
    std::fs::write(dir.path().join("san.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n").unwrap();
    openssl(&["x509", "-req", "-in", &path("cert.csr"), "-CA", &path("ca.pem"), "-CAkey", &path("ca-key.pem"),
        "-CAcreateserial", "-days", "1", "-extfile", &path("san.ext"), "-out", &path("cert.pem")]);
    let rank_address = free_tcp_address();
    let api = free_tcp_address();
    let mut rank = common::tpserve()
        .args(["rank", "--listen", &rank_address, "--threads", "1", "--rendezvous", "127.0.0.1:0", "--advertise-host", "127.0.0.1"])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("TPSERVE_CLUSTER_TOKEN", "tls-cluster")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut coordinator = common::tpserve()
        .args(["coordinator", "--rank", &rank_address, "--listen", &api, "--model"])
        .arg(common::fixture("qwen3_a"))
        .arg("--rank-tls-ca")
        .arg(&ca)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("TPSERVE_CLUSTER_TOKEN", "tls-cluster")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let health = |tls: bool| {
        let mut command = common::tpserve();
        command.args(["health", "--server", &api]);
        if tls {
            command.arg("--tls-ca").arg(&ca);
        }
        command.stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap().success()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !health(true) {
        assert!(std::time::Instant::now() < deadline, "TLS server did not become SERVING");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!health(false), "a plaintext client must not be served by a TLS port");
    let prompt = &common::expected("qwen3_a")[0];
    let output = common::tpserve()
        .args(["generate", "--server", &api, "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", "16"])
        .args(["--prompt-ids", &common::ids_arg(&prompt.ids)])
        .arg("--tls-ca")
        .arg(&ca)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(common::parse_json_stream(&String::from_utf8_lossy(&output.stdout)).0, prompt.greedy_new_ids);
    common::terminate(&mut coordinator);
    common::terminate(&mut rank);
}
