//! `TPSERVE_TP1_COLLECTIVES=1`: a TP 1 rank runs every collective through a real communicator
//! of one rank instead of skipping it, so one device exercises the backend's operations (on a
//! GPU, NCCL's; here, the socket backend's). The tokens must not change, and the rank's
//! collective counter shows the operations ran.

mod common;

use std::io::{Read, Write};
use std::process::Stdio;
use std::time::Duration;

use common::{ShardRun, Transport};

const ENV: (&str, &str) = ("TPSERVE_TP1_COLLECTIVES", "1");

/// Every family's greedy ids at TP 1 through a world-1 socket communicator equal the reference.
#[test]
fn greedy_ids_through_a_world_of_one_equal_the_reference() {
    for name in ["qwen3_a", "qwen3_moe", "qwen3_5_dense", "qwen3_5_moe"] {
        let model = common::fixture(name);
        let expected = common::expected(name);
        let prompts: Vec<Vec<u32>> = expected.iter().map(|p| p.ids.clone()).collect();
        let run = ShardRun { transport: Transport::Unix, env: &[ENV], ..ShardRun::new(&model, &prompts, 1) };
        for (i, (got, want)) in run.run().iter().zip(&expected).enumerate() {
            assert_eq!(got.new_ids, want.greedy_new_ids, "{name} prompt {i}");
        }
    }
}

/// The counter of collectives a rank ran (its /metrics), after three generations at TP 1.
fn collective_calls(env: &[(&str, &str)]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let metrics_port = common::free_port();
    let rank = format!("unix://{}", dir.path().join("r0.sock").display());
    let api = format!("unix://{}", dir.path().join("api.sock").display());
    let mut processes = vec![
        common::tpserve()
            .args(["rank", "--listen", &rank, "--threads", "1"])
            .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        common::tpserve()
            .args(["coordinator", "--rank", &rank, "--listen", &api, "--model"])
            .arg(common::fixture("qwen3_a"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ];
    common::wait_serving(&api, Duration::from_secs(60));
    for _ in 0..3 {
        let output = common::tpserve()
            .args(["generate", "--server", &api, "--prompt", "Once upon a time", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"])
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    }
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    for process in &mut processes {
        common::terminate(process);
    }
    let line = text.lines().find(|l| l.starts_with("tpserve:rank_collective_calls_total")).unwrap_or_else(|| panic!("{text}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn the_setting_makes_a_tp1_rank_run_its_collectives() {
    let skipped = collective_calls(&[]);
    let ran = collective_calls(&[ENV]);
    println!("collectives run by a TP 1 rank for three 5-token generations: {skipped} by default, {ran} with {}=1", ENV.0);
    assert_eq!(skipped, 0.0);
    // two all-reduces per layer and a gather of the logits per step, at least
    assert!(ran > 3.0 * 5.0 * 2.0, "{ran}");
}
