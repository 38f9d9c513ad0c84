//! Shared helpers for the integration tests: fixtures and the oracle's expected outputs.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub struct ExpectedPrompt {
    pub ids: Vec<u32>,
    pub greedy_new_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
}

/// The oracle's outputs for a fixture. For bf16 weights computed in f32 the reference is
/// `f32_compute_of_same_bf16_weights` (bf16 compute has exact top-2 ties).
pub fn expected(name: &str) -> Vec<ExpectedPrompt> {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).expect("expected.json");
    // Python's json writes -Infinity for masked logits; JSON has no such number.
    let text = text.replace("-Infinity", "null").replace("Infinity", "null").replace("NaN", "null");
    let json: Value = serde_json::from_str(&text).expect("expected.json parses");
    let prompts = json["prompts"].as_array().expect("prompts").clone();
    let reference = json.get("f32_compute_of_same_bf16_weights").and_then(Value::as_array).cloned();
    prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let source = reference.as_ref().map(|r| &r[i]).unwrap_or(prompt);
            ExpectedPrompt {
                ids: ids(&prompt["ids"]),
                greedy_new_ids: ids(&source["greedy_new_ids"]),
                last_logits: source["last_logits_full"]
                    .as_array()
                    .expect("last_logits_full")
                    .iter()
                    .map(|v| v.as_f64().expect("logit") as f32)
                    .collect(),
            }
        })
        .collect()
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().expect("id list").iter().map(|v| v.as_u64().expect("id") as u32).collect()
}

/// The largest |a - b|. A NaN on either side is an infinite difference (`f32::max` would skip
/// it and report a match); equal infinities (masked logits) are no difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else if x.is_nan() || y.is_nan() { f32::INFINITY } else { (x - y).abs() })
        .fold(0.0, f32::max)
}

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `tpserve` command whose process dies with the test that started it, even when the test
/// panics: PR_SET_PDEATHSIG fires when the spawning thread (the test's) exits.
pub fn tpserve() -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_tpserve"));
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    command
}

/// A `tpserve serve` process on a private Unix socket (or TCP), stopped with SIGTERM on drop.
pub struct Served {
    pub child: Child,
    pub address: String,
    /// the server's stderr (its log, ranks included)
    pub log_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Served {
    pub fn start(model: &str, tp: usize) -> Self {
        Self::start_with(model, tp, &[])
    }

    pub fn start_with(model: &str, tp: usize, extra: &[&str]) -> Self {
        Self::start_with_env(model, tp, extra, &[])
    }

    /// Like [`Served::start_with`], with extra environment for the server (e.g. an admin token).
    pub fn start_with_env(model: &str, tp: usize, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let address = format!("unix://{}", dir.path().join("api.sock").display());
        let log_path = server_log(model, dir.path());
        let child = tpserve()
            .args(["serve", "--model"])
            .arg(fixture(model))
            .args(["--tp", &tp.to_string(), "--listen", &address])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).expect("create the server log"))
            .spawn()
            .expect("spawn tpserve serve");
        let served = Self { child, address, log_path, _dir: dir };
        served.wait_serving(Duration::from_secs(60));
        served
    }

    pub fn wait_serving(&self, patience: Duration) {
        wait_serving(&self.address, patience);
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `tpserve generate` against this server; returns (stdout, success).
    pub fn generate(&self, args: &[&str]) -> (String, bool) {
        let output = tpserve().args(["generate", "--server", &self.address]).args(args).output().unwrap();
        (String::from_utf8_lossy(&output.stdout).into_owned(), output.status.success())
    }
}

/// Where a server's log goes: under $TPSERVE_TEST_LOG_DIR when set (kept after the test, for
/// debugging failures), else in the server's own temporary directory.
fn server_log(name: &str, dir: &std::path::Path) -> PathBuf {
    match std::env::var_os("TPSERVE_TEST_LOG_DIR") {
        Some(logs) => std::path::Path::new(&logs).join(format!("{name}-{}-{}.log", std::process::id(), unique())),
        None => dir.join("server.log"),
    }
}

fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Drop for Served {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// SIGTERM, then SIGKILL if the process has not exited within 15 s.
pub fn terminate(child: &mut Child) {
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The pid of the rank process of `tpserve serve` (pid `serve`) that listens on rank-{rank}.sock.
pub fn rank_pid(serve: u32, rank: usize) -> i32 {
    let children = std::fs::read_to_string(format!("/proc/{serve}/task/{serve}/children")).unwrap_or_default();
    for pid in children.split_whitespace() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&format!("rank-{rank}.sock")) {
            return pid.parse().unwrap();
        }
    }
    // Children of other threads (tokio spawns from worker threads).
    for entry in std::fs::read_dir(format!("/proc/{serve}/task")).unwrap() {
        let task = entry.unwrap().file_name();
        let children = std::fs::read_to_string(format!("/proc/{serve}/task/{}/children", task.to_string_lossy())).unwrap_or_default();
        for pid in children.split_whitespace() {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&format!("rank-{rank}.sock")) {
                return pid.parse().unwrap();
            }
        }
    }
    panic!("rank {rank} of tpserve serve {serve} not found");
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Polls `tpserve health` until it exits 0.
pub fn wait_serving(address: &str, patience: Duration) {
    let deadline = Instant::now() + patience;
    loop {
        let status = tpserve().args(["health", "--server", address]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap();
        if status.success() {
            return;
        }
        assert!(Instant::now() < deadline, "{address} did not become SERVING within {patience:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The token ids from `tpserve generate --json` output, and the final object.
pub fn parse_json_stream(stdout: &str) -> (Vec<u32>, Value) {
    let mut ids = Vec::new();
    let mut last = Value::Null;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad JSON line {line:?}: {e}"));
        if let Some(id) = value.get("token_id").and_then(Value::as_u64) {
            ids.push(id as u32);
        }
        if value.get("finish_reason").is_some() {
            last = value;
        }
    }
    (ids, last)
}

pub fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// How a group of rank processes reaches its rendezvous.
#[derive(Clone, Copy, Debug)]
pub enum Transport {
    Tcp,
    Unix,
}

/// One `tpserve eval-shard` group: the model, its prompts, and how to run it.
pub struct ShardRun<'a> {
    pub model: &'a std::path::Path,
    pub prompts: &'a [Vec<u32>],
    pub tp: usize,
    /// prefill chunk in tokens (0: the whole prompt in one step)
    pub chunk: usize,
    pub transport: Transport,
    /// extra environment for every rank process
    pub env: &'a [(&'a str, &'a str)],
}

impl<'a> ShardRun<'a> {
    pub fn new(model: &'a std::path::Path, prompts: &'a [Vec<u32>], tp: usize) -> Self {
        Self { model, prompts, tp, chunk: 0, transport: Transport::Unix, env: &[] }
    }

    /// Runs the group as `tp` separate OS processes joined by the CPU socket backend (greedy,
    /// 16 new tokens, EOS suppressed) and returns rank 0's results, one per prompt.
    pub fn run(&self) -> Vec<tpserve::rank::offline::PromptResult> {
        use std::io::BufRead;

        let tp = self.tp;
        let label = format!("{} TP {tp}", self.model.display());
        let dir = tempfile::tempdir().unwrap();
        let prompts_file = dir.path().join("prompts.json");
        std::fs::write(&prompts_file, serde_json::to_string(self.prompts).unwrap()).unwrap();
        let out = dir.path().join("out.json");
        let rendezvous = match self.transport {
            Transport::Tcp => "127.0.0.1:0".to_owned(),
            Transport::Unix => format!("unix://{}", dir.path().join("comm.sock").display()),
        };
        let base = |rank: usize| {
            let mut command = tpserve();
            command.args(["eval-shard", "--model"]).arg(self.model);
            command.args(["--rank", &rank.to_string(), "--world-size", &tp.to_string()]);
            command.arg("--prompts").arg(&prompts_file);
            command.args(["--chunk", &self.chunk.to_string(), "--suppress", "2", "--threads", "1"]);
            command.args(["--init-timeout-secs", "60"]);
            command.envs(self.env.iter().copied());
            command
        };
        let mut rank0 = base(0);
        rank0.args(["--rendezvous", &rendezvous]).arg("--out").arg(&out).stdout(Stdio::piped());
        let mut children = vec![rank0.spawn().expect("spawn rank 0")];
        if tp > 1 {
            let stdout = children[0].stdout.take().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line).unwrap();
            let comm_id =
                line.trim().strip_prefix("COMM_ID=").unwrap_or_else(|| panic!("{label}: rank 0 printed {line:?}")).to_owned();
            for rank in 1..tp {
                children.push(base(rank).args(["--comm-id", &comm_id]).spawn().expect("spawn rank"));
            }
        }
        // A watchdog turns a hang into a failure rather than a stuck CI job.
        let deadline = Instant::now() + Duration::from_secs(120);
        for i in 0..children.len() {
            loop {
                if let Some(status) = children[i].try_wait().unwrap() {
                    assert!(status.success(), "{label}: rank {i} exited with {status}");
                    break;
                }
                if Instant::now() > deadline {
                    for child in &mut children {
                        let _ = child.kill();
                    }
                    panic!("{label}: ranks did not finish within 120 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        serde_json::from_value(report["prompts"].clone()).unwrap()
    }
}

/// Python packages the third-party client tests use, pinned; .ci/run installs the same.
pub const PYTHON_PACKAGES: [&str; 4] =
    ["grpcio==1.85.*", "grpcio-health-checking==1.85.*", "grpcio-reflection==1.85.*", "prometheus-client==0.26.*"];

/// A Python that has those packages: the system one if it already does, else a virtual
/// environment under target/ that is created once (so `cargo test` works on a fresh machine too).
pub fn python() -> &'static str {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| {
        let ready = |python: &str| {
            Command::new(python)
                .args(["-c", "import grpc, grpc_health.v1, grpc_reflection.v1alpha, prometheus_client"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if ready("python3") {
            return "python3".to_owned();
        }
        let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-python-venv");
        let python = format!("{venv}/bin/python");
        if !ready(&python) {
            let created = Command::new("python3").args(["-m", "venv", venv]).status().expect("python3 runs");
            assert!(created.success(), "cannot create {venv}");
            let installed = Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
                .args(PYTHON_PACKAGES)
                .status()
                .expect("pip runs");
            assert!(installed.success(), "cannot install {PYTHON_PACKAGES:?} from PyPI");
        }
        python
    })
}
