//! `tpserve bench-collective` (hidden): all-reduce latency between separate rank processes,
//! for the benchmark. Rank 0 prints one JSON object with the median and p99 per size.

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Args;
use serde::Serialize;

use super::eval_shard::join;

#[derive(Args, Debug, Clone)]
pub struct CollectiveBenchArgs {
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub world_size: usize,
    #[arg(long)]
    pub comm_id: Option<String>,
    #[arg(long)]
    pub rendezvous: Option<String>,
    /// Message sizes in bytes (f32 tensors)
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576")]
    pub sizes: Vec<usize>,
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
}

#[derive(Serialize)]
struct SizeResult {
    bytes: usize,
    median_us: f64,
    p99_us: f64,
}

pub fn run(args: CollectiveBenchArgs) -> Result<()> {
    let comm = join(args.rank, args.world_size, args.comm_id.as_deref(), args.rendezvous.as_deref(), 60)?;
    let mut results = Vec::new();
    for &bytes in &args.sizes {
        let tensor = Tensor::ones(bytes / 4, candle_core::DType::F32, &Device::Cpu)?;
        for _ in 0..10 {
            comm.all_reduce_sum(&tensor)?;
        }
        let mut samples = Vec::with_capacity(args.iterations);
        for _ in 0..args.iterations {
            // A barrier first, so each sample measures the all-reduce and not a late peer.
            comm.barrier()?;
            let started = Instant::now();
            comm.all_reduce_sum(&tensor)?;
            samples.push(started.elapsed().as_secs_f64() * 1e6);
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        results.push(SizeResult { bytes, median_us: at(0.5), p99_us: at(0.99) });
    }
    if args.rank == 0 {
        println!("{}", serde_json::to_string(&results)?);
    }
    Ok(())
}
