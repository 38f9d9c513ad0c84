//! Speed of a decode step's attention on a CPU (`attention::attend_one`, every path this CPU
//! has): a batch of sequences, each attending over its history in the paged cache's blocks of
//! 16 positions, for every layer and KV head of the ~100M Qwen3 shape of `benches/tp_bench.rs`
//! (12 layers, 12 query heads over 4 KV heads, head_dim 64). Every block is its own allocation,
//! as the cache's are, and the histories of all layers together outgrow the caches past a few
//! hundred positions, so later layers read them from memory, as a served step does.
//! Prints µs per call (one sequence, layer and KV head) and the GB/s of keys and values read,
//! for a cache of f32 and of f16 (`--kv-cache-dtype f16`).
//! A figure, not a test.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release -p tpserve-kernels --example attention_decode

use std::time::Instant;

use rayon::prelude::*;
use tpserve_kernels::attention::{HostBlock, KvElement, Spread, attend_one_with};
use tpserve_kernels::cpu_matmul::Isa;

const LAYERS: usize = 12;
const Q_HEADS: usize = 12;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;
const BATCH: usize = 16;

/// One block's keys (transposed) and values, each `[KV_HEADS, ..]` of one layer.
struct Block<T> {
    keys_t: Vec<T>,
    values: Vec<T>,
}

/// [layer][sequence][block]
type Cache<T> = Vec<Vec<Vec<Block<T>>>>;

fn main() {
    rayon::ThreadPoolBuilder::new().build().expect("thread pool").install(run);
}

fn run() {
    let threads = rayon::current_num_threads();
    println!("attention of a decode step: {BATCH} sequences, {LAYERS} layers, {Q_HEADS} query heads over {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {threads} threads");
    let q: Vec<f32> = (0..Q_HEADS * HEAD_DIM).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
    for positions in [64usize, 96, 192, 512, 1024] {
        let blocks_per_seq = positions.div_ceil(BLOCK);
        // [layer][sequence][block]
        let cache: Cache<f32> = (0..LAYERS)
            .map(|l| {
                (0..BATCH)
                    .map(|s| {
                        (0..blocks_per_seq)
                            .map(|b| {
                                let seed = (l * 7919 + s * 104_729 + b * 31) as f32;
                                let fill = |n: usize, o: f32| (0..n).map(|i| ((i as f32 + seed + o) * 0.618).fract() - 0.5).collect();
                                Block { keys_t: fill(KV_HEADS * HEAD_DIM * BLOCK, 0.0), values: fill(KV_HEADS * HEAD_DIM * BLOCK, 0.5) }
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let halves: Cache<half::f16> = cache
            .iter()
            .map(|layer| {
                let half = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x)).collect();
                layer.iter().map(|blocks| blocks.iter().map(|b| Block { keys_t: half(&b.keys_t), values: half(&b.values) }).collect()).collect()
            })
            .collect();
        let mut line = format!("{positions:>5} positions:");
        line += &time(&cache, &q, positions, threads);
        line += " | f16:";
        line += &time(&halves, &q, positions, threads);
        println!("{line}");
    }
}

/// A step's attention over `cache` on every path this CPU has: ms a step, µs a call, GB/s.
fn time<T: KvElement>(cache: &Cache<T>, q: &[f32], positions: usize, threads: usize) -> String {
    let bytes = (LAYERS * BATCH * positions * KV_HEADS * HEAD_DIM * 2 * std::mem::size_of::<T>()) as f64;
    let mut line = format!(" {:.0} MB", bytes / 1e6);
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
        let step = || {
            for layer in cache {
                layer.par_iter().for_each(|blocks| {
                    let history: Vec<HostBlock<'_, T>> = blocks
                        .iter()
                        .enumerate()
                        .map(|(b, block)| HostBlock { keys_t: &block.keys_t, values: &block.values, positions: (positions - b * BLOCK).min(BLOCK) })
                        .collect();
                    (0..KV_HEADS).into_par_iter().for_each(|kv| {
                        std::hint::black_box(attend_one_with(q, &history, KV_HEADS, HEAD_DIM, kv, isa, Spread::Serial));
                    });
                });
            }
        };
        step();
        let reps = 5;
        let seconds = (0..reps)
            .map(|_| {
                let started = Instant::now();
                step();
                started.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        let calls = (LAYERS * BATCH * KV_HEADS) as f64;
        line += &format!("  {isa:?} {:.2} ms/step, {:.2} µs/call, {:.1} GB/s", seconds * 1e3, seconds * 1e6 * threads as f64 / calls, bytes / seconds / 1e9);
    }
    line
}
