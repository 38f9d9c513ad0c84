//! `--model ORG/NAME@REVISION` through the `hf-hub` crate, against a local server that answers
//! the hub's download route (`/{repo}/resolve/{revision}/{file}`, with the `etag`,
//! `x-repo-commit` and `content-range` headers hf-hub reads) from a fixture directory, and
//! requires the bearer token. HF_ENDPOINT points at it, HF_HOME at a fresh cache, HF_TOKEN holds
//! the token; then HF_HUB_OFFLINE=1 serves from that cache alone, and fails with a clear message
//! on an empty one.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const TOKEN: &str = "hf_test_token";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A minimal hub: serves `dir`'s files as the repository `repo` at any revision, counting the
/// requests per file.
struct Hub {
    port: u16,
    requests: Arc<Mutex<HashMap<String, usize>>>,
}

impl Hub {
    fn start(repo: &'static str, dir: PathBuf) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(HashMap::new()));
        let counts = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (dir, counts) = (dir.clone(), counts.clone());
                std::thread::spawn(move || answer(stream, repo, &dir, &counts));
            }
        });
        Self { port, requests }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn count(&self, file: &str) -> usize {
        self.requests.lock().unwrap().get(file).copied().unwrap_or(0)
    }
}

/// One request per connection: GET /{repo}/resolve/{revision}/{file}, honouring Range.
fn answer(stream: TcpStream, repo: &str, dir: &Path, counts: &Mutex<HashMap<String, usize>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let target = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    let mut headers = HashMap::new();
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).unwrap();
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    let mut stream = stream;
    let file = target.strip_prefix(&format!("/{repo}/resolve/")).and_then(|rest| rest.split_once('/')).map(|(_, file)| file.to_owned());
    if headers.get("authorization").map(String::as_str) != Some(&format!("Bearer {TOKEN}")) {
        let _ = stream.write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    }
    let Some(bytes) = file.as_ref().and_then(|file| std::fs::read(dir.join(file)).ok()) else {
        let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let file = file.unwrap();
    *counts.lock().unwrap().entry(file.clone()).or_default() += 1;
    let size = bytes.len();
    let (start, end) = headers
        .get("range")
        .and_then(|range| range.strip_prefix("bytes="))
        .and_then(|range| range.split_once('-'))
        .map(|(a, b)| (a.parse().unwrap_or(0), b.parse().unwrap_or(size - 1).min(size - 1)))
        .unwrap_or((0, size - 1));
    let etag = format!("{:x}-{size}", bytes.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b))));
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\netag: \"{etag}\"\r\nx-repo-commit: {COMMIT}\r\ncontent-range: bytes {start}-{end}/{size}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        end + 1 - start
    );
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(&bytes[start..=end]);
}

/// `tpserve serve --model MODEL` with `env`; None if it exits before serving (with its log).
fn serve(model: &str, env: &[(&str, String)]) -> Result<(std::process::Child, String, tempfile::TempDir), String> {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("unix://{}", dir.path().join("api.sock").display());
    let log = dir.path().join("server.log");
    let mut child = common::tpserve()
        .args(["serve", "--model", model, "--tp", "2", "--listen", &address])
        .env_remove("HF_HUB_OFFLINE")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return Err(std::fs::read_to_string(&log).unwrap_or_default());
        }
        let status = common::tpserve().args(["health", "--server", &address]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap();
        if status.success() {
            return Ok((child, address, dir));
        }
        assert!(std::time::Instant::now() < deadline, "not serving within 90 s: {}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The fixture's greedy tokens for its first prompt, served under the repository's id.
fn check_greedy(address: &str) {
    let expected = &common::expected("qwen3_a")[0];
    let ids = common::ids_arg(&expected.ids);
    let output = common::tpserve()
        .args(["generate", "--server", address, "--model", "test-org/qwen3_a", "--prompt-ids", &ids])
        .args(["--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let (got, _) = common::parse_json_stream(&String::from_utf8_lossy(&output.stdout));
    assert_eq!(got, expected.greedy_new_ids[..8]);
}

#[test]
fn a_hub_model_is_fetched_into_the_cache_then_served_offline() {
    let hub = Hub::start("test-org/qwen3_a", common::fixture("qwen3_a"));
    let cache = tempfile::tempdir().unwrap();
    let home = cache.path().to_str().unwrap().to_owned();
    let online = [("HF_HOME", home.clone()), ("HF_ENDPOINT", hub.endpoint()), ("HF_TOKEN", TOKEN.to_owned())];
    let (mut child, address, _dir) = serve("test-org/qwen3_a@main", &online).unwrap_or_else(|log| panic!("serve failed: {log}"));
    check_greedy(&address);
    common::terminate(&mut child);
    // The coordinator fetched its files, the ranks the weights; optional files that the
    // repository lacks (chat_template.jinja) were skipped.
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"] {
        assert!(hub.count(file) >= 1, "{file} was not fetched");
    }
    let snapshot = cache.path().join(format!("hub/models--test-org--qwen3_a/snapshots/{COMMIT}"));
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(snapshot.join(file).is_file(), "{file} is not in the cache at {}", snapshot.display());
    }
    assert_eq!(std::fs::read_to_string(cache.path().join("hub/models--test-org--qwen3_a/refs/main")).unwrap(), COMMIT);

    // Offline, from the cache alone: the hub is not asked again.
    let fetched = hub.count("model.safetensors");
    let offline = [("HF_HOME", home), ("HF_ENDPOINT", "http://127.0.0.1:9".to_owned()), ("HF_HUB_OFFLINE", "1".to_owned())];
    let (mut child, address, _dir) = serve("test-org/qwen3_a", &offline).unwrap_or_else(|log| panic!("offline serve failed: {log}"));
    check_greedy(&address);
    common::terminate(&mut child);
    assert_eq!(hub.count("model.safetensors"), fetched);

    // Offline with an empty cache: a clear refusal.
    let empty = tempfile::tempdir().unwrap();
    let offline = [("HF_HOME", empty.path().to_str().unwrap().to_owned()), ("HF_HUB_OFFLINE", "1".to_owned())];
    let log = serve("test-org/qwen3_a", &offline).map(|_| ()).expect_err("served without the files");
    assert!(log.contains("config.json of test-org/qwen3_a@main is not in the Hugging Face cache"), "{log}");
    assert!(log.contains("HF_HUB_OFFLINE"), "{log}");
}

#[test]
fn a_wrong_token_is_refused_with_the_hub_answer() {
    let hub = Hub::start("test-org/qwen3_a", common::fixture("qwen3_a"));
    let cache = tempfile::tempdir().unwrap();
    let env = [
        ("HF_HOME", cache.path().to_str().unwrap().to_owned()),
        ("HF_ENDPOINT", hub.endpoint()),
        ("HF_TOKEN", "wrong".to_owned()),
    ];
    let log = serve("test-org/qwen3_a", &env).map(|_| ()).expect_err("served with a wrong token");
    assert!(log.contains("cannot fetch config.json of test-org/qwen3_a@main"), "{log}");
    assert!(log.contains("401"), "{log}");
}
