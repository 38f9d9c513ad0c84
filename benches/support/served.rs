//! A `tpserve serve` process for the serving benchmarks, and what they measure it with.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tpserve::net::{self, Address};
use tpserve::proto::v1 as pb;
use tpserve::proto::v1::generator_client::GeneratorClient;

/// `tpserve serve --tp 1 --max-batch-size 64` on `model` at `address`, plus `flags`. Its log
/// goes nowhere unless `TPSERVE_BENCH_SERVER_LOG` is set (then to this process's stderr, with
/// the server's own `RUST_LOG`: the coordinator's step trace is
/// `RUST_LOG=tpserve::coordinator::engine=trace`).
pub fn start_server(model: &std::path::Path, address: &str, flags: &[&str]) -> Child {
    let log = if std::env::var_os("TPSERVE_BENCH_SERVER_LOG").is_some() { Stdio::inherit() } else { Stdio::null() };
    Command::new(env!("CARGO_BIN_EXE_tpserve"))
        .args(["serve", "--tp", "1", "--max-batch-size", "64", "--listen", address])
        .args(flags)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

pub fn stop(server: &mut Child) {
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let _ = server.wait();
}

pub async fn client(address: &str) -> GeneratorClient<tonic::transport::Channel> {
    let address: Address = address.parse().unwrap();
    GeneratorClient::new(net::connect(&address, Duration::from_secs(10)).await.unwrap())
}

/// Waits (at most 120 s) until the server answers ModelInfo.
pub async fn wait_ready(address: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(address) = address.parse::<Address>() {
            if let Ok(channel) = net::connect(&address, Duration::from_secs(1)).await {
                if GeneratorClient::new(channel).model_info(pb::ModelInfoRequest::default()).await.is_ok() {
                    return;
                }
            }
        }
        assert!(Instant::now() < deadline, "server did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `q` quantile of `values` (sorted in place), 0 for none.
pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}
