//! Integration tests for the socket collective backend: real OS processes, real sockets.
//!
//! Multi-process tests re-execute this test binary (`current_exe() --exact child_<name>`) with
//! `TPCOMM_TEST_*` environment variables telling the child its role, rank and communicator id.
//! The parent process creates the id, plays rank 0 in-process and checks what the children
//! print (one `TPCOMM_RESULT ...` line each). Without the variables the `child_*` tests return
//! immediately. Every wait has a generous upper bound so that a hang fails instead of blocking.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use tpserve::comm::socket::{
    CommId, RendezvousAddr, SocketCollective, SocketOptions, create_comm_id,
};
use tpserve::comm::{Collective, CommError};

const ENV_ROLE: &str = "TPCOMM_TEST_ROLE";
const ENV_RANK: &str = "TPCOMM_TEST_RANK";
const ENV_WORLD: &str = "TPCOMM_TEST_WORLD";
const ENV_ID: &str = "TPCOMM_TEST_ID";
const ENV_INIT_MS: &str = "TPCOMM_TEST_INIT_MS";
const ENV_OP_MS: &str = "TPCOMM_TEST_OP_MS";
const RESULT_TAG: &str = "TPCOMM_RESULT ";

/// Upper bound for anything that should be "prompt" on a loaded 2-core machine.
const PROMPT: Duration = Duration::from_secs(20);

fn opts(init: Duration, op: Duration) -> SocketOptions {
    SocketOptions {
        init_timeout: init,
        op_timeout: op,
    }
}

// ---------------------------------------------------------------------------------------------
// Process plumbing
// ---------------------------------------------------------------------------------------------

struct ChildCfg {
    rank: usize,
    world: usize,
    id: CommId,
    opts: SocketOptions,
}

impl ChildCfg {
    fn init(&self) -> Result<SocketCollective, CommError> {
        SocketCollective::init(&self.id, self.rank, self.world, None, self.opts.clone())
    }
}

/// `Some` only inside a child process spawned for `role`.
fn child_cfg(role: &str) -> Option<ChildCfg> {
    if std::env::var(ENV_ROLE).ok()? != role {
        return None;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("child: {k} not set"));
    let num = |k: &str| {
        var(k)
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("child: bad {k}"))
    };
    Some(ChildCfg {
        rank: num(ENV_RANK) as usize,
        world: num(ENV_WORLD) as usize,
        id: CommId::from_bytes(var(ENV_ID).as_bytes()).expect("child: bad comm id"),
        opts: opts(
            Duration::from_millis(num(ENV_INIT_MS)),
            Duration::from_millis(num(ENV_OP_MS)),
        ),
    })
}

fn report(rank: usize, body: &str) {
    println!("\n{RESULT_TAG}{rank} {body}");
}

/// A child process whose stdout/stderr are collected in the background; killed on drop.
struct Proc {
    rank: usize,
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

fn drain(mut r: impl Read + Send + 'static, sink: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
}

fn spawn_child(role: &str, rank: usize, world: usize, id: &CommId, o: &SocketOptions) -> Proc {
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = Command::new(exe)
        .args([
            &format!("child_{role}"),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_ROLE, role)
        .env(ENV_RANK, rank.to_string())
        .env(ENV_WORLD, world.to_string())
        .env(ENV_ID, String::from_utf8(id.to_bytes()).expect("utf-8 id"))
        .env(ENV_INIT_MS, o.init_timeout.as_millis().to_string())
        .env(ENV_OP_MS, o.op_timeout.as_millis().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let out = Arc::new(Mutex::new(String::new()));
    let err = Arc::new(Mutex::new(String::new()));
    let readers = vec![
        drain(child.stdout.take().expect("stdout"), out.clone()),
        drain(child.stderr.take().expect("stderr"), err.clone()),
    ];
    Proc {
        rank,
        child,
        out,
        err,
        readers,
        status: None,
    }
}

impl Proc {
    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits up to `limit` for the child to exit; kills it and returns `None` on expiry.
    fn wait_for(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                self.status = Some(st);
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                return Some(st);
            }
            if Instant::now() >= deadline {
                self.signal(libc::SIGCONT);
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the child's stdout contains `needle`.
    fn wait_stdout(&self, needle: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.out.lock().unwrap().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// The child's `TPCOMM_RESULT <rank> <body>` line, as `body`.
    fn result(&self) -> Option<String> {
        let out = self.out.lock().unwrap();
        out.lines().find_map(|l| {
            let rest = &l[l.find(RESULT_TAG)? + RESULT_TAG.len()..];
            let (rank, body) = rest.split_once(' ')?;
            (rank == self.rank.to_string()).then(|| body.to_string())
        })
    }

    fn describe(&self) -> String {
        format!(
            "--- rank {} (status {:?}) stdout ---\n{}\n--- stderr ---\n{}",
            self.rank,
            self.status,
            self.out.lock().unwrap(),
            self.err.lock().unwrap()
        )
    }

    /// Waits for a clean exit and returns the result line; panics with the child's output
    /// otherwise.
    fn finish(&mut self, limit: Duration) -> String {
        match self.wait_for(limit) {
            Some(st) if st.success() => {}
            Some(_) => panic!("child failed\n{}", self.describe()),
            None => panic!("child did not exit within {limit:?}\n{}", self.describe()),
        }
        self.result()
            .unwrap_or_else(|| panic!("child printed no result\n{}", self.describe()))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            self.signal(libc::SIGCONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn describe_all(kids: &mut [Proc]) -> String {
    kids.iter_mut()
        .map(|k| {
            k.wait_for(Duration::from_secs(5));
            k.describe()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[derive(Clone, Copy, Debug)]
enum Transport {
    Tcp,
    Unix,
}

/// A fresh id and rendezvous; the temp dir (Unix) must outlive the group.
fn new_id(
    t: Transport,
) -> (
    CommId,
    tpserve::comm::socket::Rendezvous,
    Option<tempfile::TempDir>,
) {
    match t {
        Transport::Tcp => {
            let (id, rdv) =
                create_comm_id(&RendezvousAddr::tcp("127.0.0.1", 0), None).expect("create tcp id");
            (id, rdv, None)
        }
        Transport::Unix => {
            let dir = tempfile::tempdir().expect("tempdir");
            let (id, rdv) =
                create_comm_id(&RendezvousAddr::unix(dir.path().join("rdv.sock")), None)
                    .expect("create unix id");
            (id, rdv, Some(dir))
        }
    }
}

/// Initialises a whole group inside this process (one thread per rank).
fn local_group(
    t: Transport,
    world: usize,
    o: SocketOptions,
) -> (Vec<Arc<SocketCollective>>, Option<tempfile::TempDir>) {
    let (id, rdv, dir) = new_id(t);
    let handles: Vec<_> = (1..world)
        .map(|r| {
            let id = id.clone();
            let o = o.clone();
            std::thread::spawn(move || SocketCollective::init(&id, r, world, None, o))
        })
        .collect();
    let mut comms = vec![Arc::new(
        SocketCollective::init(&id, 0, world, Some(rdv), o).expect("rank 0 init"),
    )];
    for h in handles {
        comms.push(Arc::new(h.join().expect("init thread").expect("rank init")));
    }
    (comms, dir)
}

/// Runs `f(rank, comm)` on every rank in its own thread and returns the results in rank order,
/// failing the test if any takes longer than `limit`.
fn on_all<T: Send + 'static>(
    comms: &[Arc<SocketCollective>],
    limit: Duration,
    f: impl Fn(usize, &SocketCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for (r, c) in comms.iter().enumerate() {
        let (c, f, tx) = (c.clone(), f.clone(), tx.clone());
        std::thread::spawn(move || {
            let _ = tx.send((r, f(r, &c)));
        });
    }
    let deadline = Instant::now() + limit;
    let mut out: Vec<Option<T>> = comms.iter().map(|_| None).collect();
    for _ in 0..comms.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, v) = rx
            .recv_timeout(left)
            .expect("a rank did not finish in time (hang?)");
        out[r] = Some(v);
    }
    out.into_iter().map(|v| v.expect("result")).collect()
}

// ---------------------------------------------------------------------------------------------
// The collective suite every rank runs (children and the in-process rank 0 alike)
// ---------------------------------------------------------------------------------------------

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

/// Exact fingerprint of a tensor: dtype, shape and the bits of every element.
fn fingerprint(t: &Tensor) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    fnv(&mut h, t.dtype().as_str().as_bytes());
    for d in t.dims() {
        fnv(&mut h, &(*d as u64).to_le_bytes());
    }
    for x in f32_bits(t) {
        fnv(&mut h, &x.to_le_bytes());
    }
    h
}

/// Element bits after an exact widening to f32 (bf16/f16 -> f32 is exact).
fn f32_bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("read tensor")
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn same_bits(a: &Tensor, b: &Tensor) -> bool {
    a.dtype() == b.dtype() && a.dims() == b.dims() && f32_bits(a) == f32_bits(b)
}

/// Small multiples of 1/4 in [-2, 2]: exact in every dtype, and so are their sums over 4 ranks.
fn exact_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + rank * 13) % 17) as f32 - 8.0) * 0.25)
        .collect()
}

/// Values whose sums round, to check the rank-order accumulation bit for bit.
fn rough_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.37 + (rank as f32) * 1.3).sin() * 3.7 + 1e-3 * (i % 11) as f32)
        .collect()
}

fn tensor(vals: Vec<f32>, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(vals, dims.to_vec(), &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("make tensor")
}

/// What a correct all-reduce returns: rank-order f32 accumulation of the (already rounded)
/// inputs, rounded once to `dtype`.
fn reference_sum(inputs: &[Tensor], dtype: DType) -> Tensor {
    let vals: Vec<Vec<f32>> = inputs
        .iter()
        .map(|t| {
            t.to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("vals")
        })
        .collect();
    let mut acc = vals[0].clone();
    for v in &vals[1..] {
        for (a, b) in acc.iter_mut().zip(v) {
            *a += *b;
        }
    }
    tensor(acc, inputs[0].dims(), dtype)
}

/// Runs every collective on `comm` and checks each result against the expected value computed
/// locally. Returns one fingerprint per result, to compare across ranks.
fn run_suite(comm: &SocketCollective) -> Result<Vec<u64>, String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut prints = Vec::new();
    let check = |what: &str, got: &Tensor, want: &Tensor| -> Result<u64, String> {
        if same_bits(got, want) {
            Ok(fingerprint(got))
        } else {
            Err(format!(
                "rank {rank}: {what}: got {:?} {:?}, want {:?} {:?}",
                got.dtype(),
                got.dims(),
                want.dtype(),
                want.dims()
            ))
        }
    };
    let err = |what: &str, e: CommError| format!("rank {rank}: {what} failed: {e}");
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // all_reduce_sum, exact values: compare with the true sum.
        let dims = [3, 5, 7];
        let n = 105;
        let got = comm
            .all_reduce_sum(&tensor(exact_values(rank, n), &dims, dtype))
            .map_err(|e| err("all_reduce exact", e))?;
        let mut truth = vec![0f32; n];
        for r in 0..world {
            for (t, v) in truth.iter_mut().zip(exact_values(r, n)) {
                *t += v;
            }
        }
        prints.push(check(
            &format!("all_reduce exact {dtype:?}"),
            &got,
            &tensor(truth, &dims, dtype),
        )?);

        // all_reduce_sum, rounding values, bigger than a socket buffer.
        let dims = [64, 1000];
        let inputs: Vec<Tensor> = (0..world)
            .map(|r| tensor(rough_values(r, 64_000), &dims, dtype))
            .collect();
        let got = comm
            .all_reduce_sum(&inputs[rank])
            .map_err(|e| err("all_reduce rough", e))?;
        prints.push(check(
            &format!("all_reduce rough {dtype:?}"),
            &got,
            &reference_sum(&inputs, dtype),
        )?);

        // all_gather along a middle dim with uneven sizes.
        let part = |r: usize| tensor(rough_values(r + 7, 2 * (r + 1) * 3), &[2, r + 1, 3], dtype);
        let got = comm
            .all_gather(&part(rank), 1)
            .map_err(|e| err("all_gather dim 1", e))?;
        let want = Tensor::cat(&(0..world).map(part).collect::<Vec<_>>(), 1).expect("cat");
        prints.push(check(&format!("all_gather dim 1 {dtype:?}"), &got, &want)?);

        // all_gather along the last dim (vocab slices); rank 0 contributes an empty slice.
        let part = |r: usize| tensor(rough_values(r + 11, 3 * 2 * r), &[3, 2 * r], dtype);
        let got = comm
            .all_gather(&part(rank), 1)
            .map_err(|e| err("all_gather last dim", e))?;
        let want = Tensor::cat(&(0..world).map(part).collect::<Vec<_>>(), 1).expect("cat");
        prints.push(check(
            &format!("all_gather last dim {dtype:?}"),
            &got,
            &want,
        )?);

        // gather along dim 0 to the last rank.
        let root = world - 1;
        let part = |r: usize| tensor(rough_values(r + 3, (r + 1) * 4), &[r + 1, 4], dtype);
        let got = comm
            .gather(&part(rank), 0, root)
            .map_err(|e| err("gather", e))?;
        match (rank == root, got) {
            (true, Some(got)) => {
                // Only the root has a result, so it is checked here but not fingerprinted.
                let want = Tensor::cat(&(0..world).map(part).collect::<Vec<_>>(), 0).expect("cat");
                check(&format!("gather {dtype:?}"), &got, &want)?;
            }
            (false, None) => {}
            (is_root, got) => {
                return Err(format!(
                    "rank {rank}: gather root={is_root} returned {:?}",
                    got.map(|t| t.dims().to_vec())
                ));
            }
        }

        // broadcast from a non-zero root (rank 1) and from rank 0; others pass zeros.
        for root in [1 % world, 0] {
            let dims = [4, 33];
            let src = tensor(rough_values(100 + root, 132), &dims, dtype);
            let mine = if rank == root {
                src.clone()
            } else {
                src.zeros_like().expect("zeros")
            };
            let got = comm
                .broadcast(&mine, root)
                .map_err(|e| err("broadcast", e))?;
            prints.push(check(
                &format!("broadcast root {root} {dtype:?}"),
                &got,
                &src,
            )?);
        }

        comm.barrier().map_err(|e| err("barrier", e))?;
    }
    // One larger f32 all-reduce (4 MiB) to exercise partial writes on every link.
    let n = 1 << 20;
    let inputs: Vec<Tensor> = (0..world)
        .map(|r| tensor(rough_values(r + 50, n), &[n], DType::F32))
        .collect();
    let got = comm
        .all_reduce_sum(&inputs[rank])
        .map_err(|e| err("all_reduce 4 MiB", e))?;
    prints.push(check(
        "all_reduce 4 MiB",
        &got,
        &reference_sum(&inputs, DType::F32),
    )?);
    comm.barrier().map_err(|e| err("final barrier", e))?;
    Ok(prints)
}

#[test]
fn child_suite() {
    let Some(cfg) = child_cfg("suite") else {
        return;
    };
    let comm = cfg
        .init()
        .unwrap_or_else(|e| panic!("rank {} init: {e}", cfg.rank));
    let prints = run_suite(&comm).unwrap_or_else(|e| panic!("{e}"));
    let body: Vec<String> = prints.iter().map(|p| format!("{p:016x}")).collect();
    report(cfg.rank, &body.join(","));
}

/// Rank 0 in this process, ranks 1.. as child processes; every rank checks its own results and
/// all ranks must agree bit for bit.
fn run_group(t: Transport, world: usize) {
    let started = Instant::now();
    let o = opts(Duration::from_secs(30), Duration::from_secs(30));
    let (id, rdv, _dir) = new_id(t);
    let mut kids: Vec<Proc> = (1..world)
        .map(|r| spawn_child("suite", r, world, &id, &o))
        .collect();
    let comm = match SocketCollective::init(&id, 0, world, Some(rdv), o) {
        Ok(c) => c,
        Err(e) => panic!("rank 0 init failed: {e}\n{}", describe_all(&mut kids)),
    };
    let mine = match run_suite(&comm) {
        Ok(p) => p,
        Err(e) => panic!("{e}\n{}", describe_all(&mut kids)),
    };
    let mine: Vec<String> = mine.iter().map(|p| format!("{p:016x}")).collect();
    let mine = mine.join(",");
    for k in &mut kids {
        let theirs = k.finish(Duration::from_secs(60));
        assert_eq!(
            theirs, mine,
            "rank {} disagrees with rank 0 ({t:?}, world {world})",
            k.rank
        );
    }
    eprintln!("{t:?} world {world}: ok in {:?}", started.elapsed());
}

#[test]
fn collectives_tcp_world2() {
    run_group(Transport::Tcp, 2);
}

#[test]
fn collectives_tcp_world4() {
    run_group(Transport::Tcp, 4);
}

#[test]
fn collectives_unix_world2() {
    run_group(Transport::Unix, 2);
}

#[test]
fn collectives_unix_world4() {
    run_group(Transport::Unix, 4);
}

// ---------------------------------------------------------------------------------------------
// Init failures
// ---------------------------------------------------------------------------------------------

#[test]
fn child_init_only() {
    let Some(cfg) = child_cfg("init_only") else {
        return;
    };
    println!("\nTPCOMM_STARTING");
    match cfg.init() {
        Ok(_) => report(cfg.rank, "ok"),
        Err(e) => report(cfg.rank, &format!("err {e:?} | {e}")),
    }
}

/// World 3 where rank 2 never shows up: rank 0 (here) and rank 1 (a child) both fail after the
/// deadline, naming rank 2.
#[test]
fn init_times_out_naming_missing_rank() {
    let (id, rdv, _dir) = new_id(Transport::Tcp);
    let o = opts(Duration::from_secs(2), Duration::from_secs(10));
    // Rank 1 waits longer than rank 0, so it reports rank 0's verdict rather than its own timer.
    let mut kid = spawn_child(
        "init_only",
        1,
        3,
        &id,
        &opts(Duration::from_secs(10), Duration::from_secs(10)),
    );
    // Start rank 0's clock only once rank 1 is about to connect, so a slow process start on a
    // busy machine cannot make rank 1 miss the window.
    assert!(
        kid.wait_stdout("TPCOMM_STARTING", PROMPT),
        "child never started\n{}",
        kid.describe()
    );
    let t0 = Instant::now();
    let err = SocketCollective::init(&id, 0, 3, Some(rdv), o).expect_err("init must time out");
    let took = t0.elapsed();
    assert!(took < PROMPT, "init took {took:?}");
    match &err {
        CommError::InitTimeout {
            missing,
            world_size: 3,
            ..
        } => assert_eq!(missing, &vec![2]),
        other => panic!("expected InitTimeout, got {other:?}"),
    }
    assert!(
        err.to_string().contains("[2]"),
        "message should name rank 2: {err}"
    );
    let theirs = kid.finish(PROMPT);
    assert!(
        theirs.contains("InitTimeout") && theirs.contains("missing: [2]"),
        "rank 1 got: {theirs}"
    );
}

/// Connections with a stale nonce, a duplicate rank or a wrong world size are turned away
/// without disturbing the real group.
#[test]
fn init_rejects_stale_duplicate_and_mismatched_ranks() {
    let (id, rdv, _dir) = new_id(Transport::Tcp);
    let o = opts(Duration::from_secs(30), Duration::from_secs(10));
    let root = {
        let (id, o) = (id.clone(), o.clone());
        std::thread::spawn(move || SocketCollective::init(&id, 0, 3, Some(rdv), o))
    };

    // Same address, different nonce: an older epoch.
    let mut stale = id.to_bytes();
    let last = stale.len() - 1;
    stale[last] = if stale[last] == b'0' { b'1' } else { b'0' };
    let stale = CommId::from_bytes(&stale).expect("stale id parses");
    let err = SocketCollective::init(&stale, 1, 3, None, o.clone())
        .expect_err("stale nonce must be rejected");
    assert!(
        matches!(err, CommError::Invalid { .. }) && err.to_string().contains("nonce"),
        "{err}"
    );

    // Wrong world size.
    let err = SocketCollective::init(&id, 2, 4, None, o.clone())
        .expect_err("world size mismatch must be rejected");
    assert!(err.to_string().contains("world size"), "{err}");

    // Two processes claiming rank 1: whichever comes second is rejected.
    let (tx, rx) = mpsc::channel();
    for _ in 0..2 {
        let (id, o, tx) = (id.clone(), o.clone(), tx.clone());
        std::thread::spawn(move || {
            let _ = tx.send(SocketCollective::init(&id, 1, 3, None, o));
        });
    }
    let first = rx
        .recv_timeout(PROMPT)
        .expect("one rank-1 attempt must finish while rank 2 is missing");
    let err = first.expect_err("the duplicate rank 1 must be rejected");
    assert!(err.to_string().contains("already joined"), "{err}");

    // Local argument checks.
    assert!(matches!(
        SocketCollective::init(&id, 3, 3, None, o.clone()),
        Err(CommError::Invalid { .. })
    ));
    assert!(matches!(
        SocketCollective::init(&id, 0, 3, None, o.clone()),
        Err(CommError::Invalid { .. })
    ));

    // The real rank 2 arrives and the group works.
    let r2 = {
        let (id, o) = (id.clone(), o.clone());
        std::thread::spawn(move || SocketCollective::init(&id, 2, 3, None, o))
    };
    let r1 = rx
        .recv_timeout(PROMPT)
        .expect("rank 1 init")
        .expect("rank 1 init");
    let r0 = root.join().expect("join").expect("rank 0 init");
    let r2 = r2.join().expect("join").expect("rank 2 init");
    let comms = vec![Arc::new(r0), Arc::new(r1), Arc::new(r2)];
    let sums = on_all(&comms, PROMPT, |r, c| {
        c.barrier().expect("barrier");
        c.all_reduce_sum(&Tensor::new(&[r as f32 + 1.0], &Device::Cpu).expect("t"))
            .expect("all_reduce")
    });
    for s in sums {
        assert_eq!(s.to_vec1::<f32>().expect("vec"), vec![6.0]);
    }
}

#[test]
fn bad_comm_ids_are_invalid() {
    let bad: &[&[u8]] = &[
        b"",
        b"garbage",
        b"\xff\xfe\x00\x01",
        b"tpcomm1;",
        b"tpcomm2;tcp://127.0.0.1:1;00000000000000000000000000000000",
        b"tpcomm1;tcp://127.0.0.1:1",
        b"tpcomm1;tcp://127.0.0.1:1;0000",
        b"tpcomm1;tcp://127.0.0.1:1;zz000000000000000000000000000000",
        b"tpcomm1;tcp://127.0.0.1;00000000000000000000000000000000",
        b"tpcomm1;tcp://127.0.0.1:0;00000000000000000000000000000000",
        b"tpcomm1;tcp://127.0.0.1:99999;00000000000000000000000000000000",
        b"tpcomm1;tcp://::1:80;00000000000000000000000000000000",
        b"tpcomm1;tcp://:80;00000000000000000000000000000000",
        b"tpcomm1;unix://;00000000000000000000000000000000",
        b"tpcomm1;ftp://x:1;00000000000000000000000000000000",
        b"tpcomm1;tcp://\xff:1;00000000000000000000000000000000",
    ];
    for b in bad {
        match CommId::from_bytes(b) {
            Err(CommError::InvalidId(_)) => {}
            other => panic!(
                "{:?}: expected InvalidId, got {other:?}",
                String::from_utf8_lossy(b)
            ),
        }
    }
    let huge = vec![b'a'; 1 << 20];
    assert!(matches!(
        CommId::from_bytes(&huge),
        Err(CommError::InvalidId(_))
    ));
    assert!(matches!(
        "not an id".parse::<CommId>(),
        Err(CommError::InvalidId(_))
    ));

    // Real ids round-trip.
    for t in [Transport::Tcp, Transport::Unix] {
        let (id, _rdv, _dir) = new_id(t);
        assert_eq!(CommId::from_bytes(&id.to_bytes()).expect("roundtrip"), id);
    }
    let good = CommId::from_bytes(b"tpcomm1;tcp://[::1]:80;0123456789abcdef0123456789ABCDEF")
        .expect("ipv6 id");
    assert_eq!(good.addr(), &RendezvousAddr::tcp("::1", 80));

    // Wildcard binds need an advertised host.
    assert!(create_comm_id(&RendezvousAddr::tcp("0.0.0.0", 0), None).is_err());
    let (id, _rdv) =
        create_comm_id(&RendezvousAddr::tcp("0.0.0.0", 0), Some("10.1.2.3")).expect("advertised");
    assert!(
        id.to_string().starts_with("tpcomm1;tcp://10.1.2.3:"),
        "{id}"
    );
}

#[test]
fn world_size_one_is_identity() {
    let (id, rdv, _dir) = new_id(Transport::Unix);
    let c = SocketCollective::init(&id, 0, 1, Some(rdv), SocketOptions::default()).expect("init");
    let t = tensor(rough_values(0, 12), &[3, 4], DType::BF16);
    assert!(same_bits(&c.all_reduce_sum(&t).unwrap(), &t));
    assert!(same_bits(&c.all_gather(&t, 1).unwrap(), &t));
    assert!(same_bits(&c.gather(&t, 0, 0).unwrap().expect("root"), &t));
    assert!(same_bits(&c.broadcast(&t, 0).unwrap(), &t));
    c.barrier().unwrap();
    c.abort();
    assert!(matches!(c.barrier(), Err(CommError::Aborted)));
}

// ---------------------------------------------------------------------------------------------
// Failures during operations
// ---------------------------------------------------------------------------------------------

/// Loops all-reduces until one fails, then checks that the communicator stays poisoned.
#[test]
fn child_loop() {
    let Some(cfg) = child_cfg("loop") else { return };
    let comm = cfg
        .init()
        .unwrap_or_else(|e| panic!("rank {} init: {e}", cfg.rank));
    let t = Tensor::ones(256, DType::F32, &Device::Cpu).expect("t");
    let mut iters = 0u64;
    let err = loop {
        match comm.all_reduce_sum(&t) {
            Ok(_) => iters += 1,
            Err(e) => break e,
        }
    };
    let t0 = Instant::now();
    let again = comm.barrier();
    report(
        cfg.rank,
        &format!(
            "iters={iters} err={err:?} again_ok={} again_ms={}",
            again.is_ok(),
            t0.elapsed().as_millis()
        ),
    );
}

/// Drives rank 0's all-reduce loop until it fails; returns the error and how long after
/// `trigger` ran it arrived. `trigger` runs once after `warmup` successful iterations.
fn loop_until_error(
    comm: &SocketCollective,
    warmup: u64,
    trigger: impl FnOnce(),
) -> (CommError, Duration) {
    let t = Tensor::ones(256, DType::F32, &Device::Cpu).expect("t");
    let mut trigger = Some(trigger);
    let mut fired_at = None;
    let mut i = 0u64;
    let watchdog = Instant::now();
    loop {
        if i == warmup
            && let Some(f) = trigger.take()
        {
            f();
            fired_at = Some(Instant::now());
        }
        match comm.all_reduce_sum(&t) {
            Ok(r) => assert_eq!(
                r.to_vec1::<f32>().expect("vec")[0],
                comm.world_size() as f32
            ),
            Err(e) => {
                let fired = fired_at.unwrap_or_else(|| {
                    panic!("all_reduce failed before the trigger at iteration {i}: {e}")
                });
                return (e, fired.elapsed());
            }
        }
        i += 1;
        assert!(
            watchdog.elapsed() < Duration::from_secs(120),
            "loop never failed"
        );
    }
}

/// SIGKILL one of three ranks mid-loop: the survivors error out promptly, and later calls fail
/// fast.
#[test]
fn killed_peer_fails_survivors_promptly() {
    let (id, rdv, _dir) = new_id(Transport::Tcp);
    let o = opts(Duration::from_secs(30), Duration::from_secs(30));
    let mut kids: Vec<Proc> = (1..3).map(|r| spawn_child("loop", r, 3, &id, &o)).collect();
    let comm = SocketCollective::init(&id, 0, 3, Some(rdv), o)
        .unwrap_or_else(|e| panic!("init: {e}\n{}", describe_all(&mut kids)));
    let victim = kids[1].pid();
    let (err, took) = loop_until_error(&comm, 200, || {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(victim, libc::SIGKILL) };
    });
    assert!(
        took < PROMPT,
        "rank 0 noticed the dead peer only after {took:?}"
    );
    assert!(
        matches!(err, CommError::PeerFailed { .. } | CommError::Io { .. }),
        "rank 0 got {err:?}"
    );
    let t0 = Instant::now();
    assert!(
        comm.barrier().is_err(),
        "poisoned communicator must keep failing"
    );
    assert!(t0.elapsed() < Duration::from_secs(1));

    let survivor = kids[0].finish(PROMPT);
    assert!(
        survivor.contains("PeerFailed") || survivor.contains("Io"),
        "rank 1 got: {survivor}"
    );
    assert!(
        survivor.contains("again_ok=false"),
        "rank 1 must stay poisoned: {survivor}"
    );
    kids[1].wait_for(PROMPT);
}

/// SIGSTOP the only peer: rank 0 gets a Timeout after op_timeout; after SIGCONT the peer fails
/// promptly too (rank 0 shut the links down).
#[test]
fn stopped_peer_times_out() {
    let (id, rdv, _dir) = new_id(Transport::Unix);
    let op_timeout = Duration::from_millis(1500);
    let o = opts(Duration::from_secs(30), op_timeout);
    // The child gets a long op timeout so that it reports rank 0's shutdown, not its own timer.
    let mut kid = spawn_child(
        "loop",
        1,
        2,
        &id,
        &opts(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let comm = SocketCollective::init(&id, 0, 2, Some(rdv), o)
        .unwrap_or_else(|e| panic!("init: {e}\n{}", kid.describe()));
    let pid = kid.pid();
    let (err, took) = loop_until_error(&comm, 100, || {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
    });
    match err {
        CommError::Timeout {
            peer: 1, waited, ..
        } => assert!(waited >= op_timeout, "waited {waited:?}"),
        other => panic!("expected Timeout from rank 1, got {other:?}"),
    }
    assert!(
        took >= op_timeout && took < PROMPT,
        "timeout after {took:?}"
    );
    let t0 = Instant::now();
    assert!(
        comm.all_reduce_sum(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap())
            .is_err()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "poisoned op must fail fast"
    );
    kid.signal(libc::SIGCONT);
    let theirs = kid.finish(PROMPT);
    assert!(
        theirs.contains("PeerFailed") || theirs.contains("Io"),
        "rank 1 got: {theirs}"
    );
}

/// abort() from another thread unblocks an op that is waiting for a peer that never joins the
/// collective; later ops fail with Aborted and the peer notices promptly.
#[test]
fn abort_unblocks_pending_op() {
    let (comms, _dir) = local_group(
        Transport::Unix,
        2,
        opts(Duration::from_secs(30), Duration::from_secs(60)),
    );
    let c0 = comms[0].clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = c0.all_reduce_sum(&Tensor::ones(1024, DType::F32, &Device::Cpu).expect("t"));
        let _ = tx.send((r.map(|_| ()), t0.elapsed()));
    });
    // Let the op block, then abort it.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "all_reduce must block while rank 1 stays away"
    );
    comms[0].abort();
    let (r, _) = rx
        .recv_timeout(PROMPT)
        .expect("abort must unblock the pending op");
    assert!(matches!(r, Err(CommError::Aborted)), "{r:?}");
    assert!(matches!(comms[0].barrier(), Err(CommError::Aborted)));
    comms[0].abort(); // idempotent

    // Rank 1 sees its peer go away instead of hanging. Rank 0's all-reduce data was already on
    // the wire, so rank 1's matching all-reduce may still complete; the next op cannot.
    let r1 = on_all(&comms[1..], PROMPT, |_, c| {
        let _ = c.all_reduce_sum(&Tensor::ones(1024, DType::F32, &Device::Cpu).expect("t"));
        c.barrier()
    });
    assert!(
        matches!(r1[0], Err(CommError::PeerFailed { peer: 0, .. })),
        "{:?}",
        r1[0]
    );
}

/// Mismatched shapes, dtypes or operations give Invalid on every rank, never a hang.
#[test]
fn mismatches_are_invalid() {
    let o = opts(Duration::from_secs(30), Duration::from_secs(30));
    type Case = fn(usize, &SocketCollective) -> Result<(), CommError>;
    let cases: Vec<(&str, Case)> = vec![
        ("shape", |r, c| {
            c.all_reduce_sum(&Tensor::zeros(4 + r, DType::F32, &Device::Cpu).unwrap())
                .map(|_| ())
        }),
        ("dtype", |r, c| {
            let dt = if r == 0 { DType::F32 } else { DType::BF16 };
            c.all_reduce_sum(&Tensor::zeros(4, dt, &Device::Cpu).unwrap())
                .map(|_| ())
        }),
        ("op", |r, c| {
            if r == 0 {
                c.all_reduce_sum(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap())
                    .map(|_| ())
            } else {
                c.barrier()
            }
        }),
        ("gather non-gathered dim", |r, c| {
            c.all_gather(
                &Tensor::zeros((2, 2 + r), DType::F32, &Device::Cpu).unwrap(),
                0,
            )
            .map(|_| ())
        }),
    ];
    for (what, f) in cases {
        let (comms, _dir) = local_group(Transport::Tcp, 2, o.clone());
        let results = on_all(&comms, PROMPT, f);
        for (r, res) in results.iter().enumerate() {
            assert!(
                matches!(res, Err(CommError::Invalid { .. })),
                "{what} mismatch, rank {r}: {res:?}"
            );
        }
        assert!(
            comms[0].barrier().is_err(),
            "{what}: communicator must be poisoned"
        );
    }
}

/// A 64 MiB all-reduce and all-gather between two processes over a Unix socket.
#[test]
fn large_tensors() {
    let (id, rdv, _dir) = new_id(Transport::Unix);
    let o = opts(Duration::from_secs(30), Duration::from_secs(30));
    let mut kid = spawn_child("large", 1, 2, &id, &o);
    let comm = SocketCollective::init(&id, 0, 2, Some(rdv), o)
        .unwrap_or_else(|e| panic!("init: {e}\n{}", kid.describe()));
    let mine = large_work(&comm)
        .unwrap_or_else(|e| panic!("{e}\n{}", describe_all(std::slice::from_mut(&mut kid))));
    assert_eq!(kid.finish(Duration::from_secs(120)), mine);
}

const LARGE_N: usize = 16 << 20; // 64 MiB of f32

fn large_input(rank: usize) -> Tensor {
    Tensor::arange(0u32, LARGE_N as u32, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.affine(1.0, rank as f64 * 0.5))
        .expect("large input")
}

/// Element-wise equality through candle's optimized kernels (the values are finite, so numeric
/// equality is bitwise equality); the per-element loops in this debug-built test would be slow.
fn all_equal(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims()
        && a.eq(b)
            .and_then(|m| m.to_dtype(DType::F32))
            .and_then(|m| m.min_all())
            .and_then(|m| m.to_scalar::<f32>())
            .expect("compare")
            == 1.0
}

fn large_work(comm: &SocketCollective) -> Result<String, String> {
    let rank = comm.rank();
    let inputs = [large_input(0), large_input(1)];
    let x = &inputs[rank];
    let sum = comm
        .all_reduce_sum(x)
        .map_err(|e| format!("rank {rank}: large all_reduce: {e}"))?;
    let want = (&inputs[0] + &inputs[1]).expect("add");
    if !all_equal(&sum, &want) {
        return Err(format!("rank {rank}: large all_reduce wrong"));
    }
    let gathered = comm
        .all_gather(x, 0)
        .map_err(|e| format!("rank {rank}: large all_gather: {e}"))?;
    let want = Tensor::cat(&inputs, 0).expect("cat");
    if !all_equal(&gathered, &want) {
        return Err(format!("rank {rank}: large all_gather wrong"));
    }
    // A cheap cross-rank fingerprint: a strided sample of the sum.
    let sample = sum
        .reshape((LARGE_N / 4096, 4096))
        .and_then(|t| t.narrow(1, 17, 1))
        .expect("sample");
    Ok(format!("{:016x}", fingerprint(&sample)))
}

#[test]
fn child_large() {
    let Some(cfg) = child_cfg("large") else {
        return;
    };
    let comm = cfg
        .init()
        .unwrap_or_else(|e| panic!("rank {} init: {e}", cfg.rank));
    let r = large_work(&comm).unwrap_or_else(|e| panic!("{e}"));
    report(cfg.rank, &r);
}

#[test]
fn socket_collective_is_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SocketCollective>();
    let _: Box<dyn Collective> = {
        let (id, rdv, _dir) = new_id(Transport::Tcp);
        Box::new(
            SocketCollective::init(&id, 0, 1, Some(rdv), SocketOptions::default()).expect("init"),
        )
    };
}
