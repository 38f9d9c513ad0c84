use std::process::ExitCode;

use clap::Parser;
use tpserve::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // rayon and candle size their CPU thread pools from these variables on first use, so they
    // are set before any thread (the tokio runtime's included) exists. The compute runs on a
    // rayon pool of `--threads` (`model::compute_pool`); candle's own pool for its elementwise
    // ops on large tensors (a prompt's residual adds) gets no threads of its own: its worker
    // spun for 25,000 pauses after each op, a third thread on two cores taking 6% of a prompt's
    // CPU time from the compute threads.
    let threads = match &cli.command {
        Command::Rank(args) => Some(args.threads),
        Command::EvalShard(args) => Some(args.threads),
        _ => None,
    };
    if let Some(threads) = threads {
        let threads = threads.unwrap_or_else(cli::available_cores).max(1).to_string();
        // SAFETY: single-threaded at this point; nothing reads the environment concurrently.
        unsafe {
            std::env::set_var("RAYON_NUM_THREADS", &threads);
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
