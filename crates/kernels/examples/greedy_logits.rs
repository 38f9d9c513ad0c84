//! Speed of greedy rows' logits from a bf16 weight held for exact products
//! (`panels::argmax_logits`) against the exact product and the bf16 products alone, for the
//! output layer of the ~100M Qwen3 shape of `benches/tp_bench.rs` ([32000, 768], random bf16
//! weights, random activations), at 1, 16 and 64 rows, medians of 20 calls in rounds that
//! alternate the three. Also prints how many columns a row computed exactly.
//! A figure, not a test.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release -p tpserve-kernels --example greedy_logits

use std::time::Instant;

use tpserve_kernels::cpu_matmul::Isa;
use tpserve_kernels::panels::{self, ColumnNorms, Packed, Products};

const N: usize = 32000;
const K: usize = 768;

fn main() {
    let isa = Isa::selected();
    if !panels::argmax_available(isa) {
        println!("this CPU has no bf16 pair body under {isa:?}: greedy rows take the exact product");
        return;
    }
    // xorshift: uniform weights in [-0.035, 0.035) as the benchmarks' models, activations in
    // [-1.7, 1.7) (unit variance, as after the final RMSNorm)
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let bits: Vec<u16> = (0..N * K).map(|_| half::bf16::from_f32(uniform() * 0.035).to_bits()).collect();
    let w = panels::pack_bf16(&bits, N, K);
    let norms = ColumnNorms::of(&w, N, K);
    println!("[{N}, {K}] bf16 output layer, {} threads, ms a call (median of 20)", rayon::current_num_threads());
    for m in [1usize, 16, 64] {
        let x: Vec<f32> = (0..m * K).map(|_| uniform() * 1.7).collect();
        let masked: Vec<&[usize]> = vec![&[]; m];
        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        let mut kept = 0;
        for _ in 0..20 {
            let started = Instant::now();
            std::hint::black_box(panels::matmul(&x, m, K, Packed::Bf16(&w), N, isa, Products::Exact));
            times[0].push(started.elapsed().as_secs_f64());
            let started = Instant::now();
            std::hint::black_box(panels::matmul(&x, m, K, Packed::Bf16(&w), N, isa, Products::Bf16));
            times[1].push(started.elapsed().as_secs_f64());
            let started = Instant::now();
            let out = std::hint::black_box(panels::argmax_logits(&x, m, K, &w, N, &norms, &masked, isa));
            times[2].push(started.elapsed().as_secs_f64());
            kept = out.iter().filter(|v| v.is_finite()).count();
        }
        let median = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2] * 1e3
        };
        let [exact, pairs, argmax] = times.each_mut().map(median);
        println!(
            "{m:>3} rows: exact {exact:.3}, bf16 products {pairs:.3}, greedy rows {argmax:.3} ({:.2}x the exact), {:.1} columns a row exact",
            exact / argmax,
            kept as f64 / m as f64
        );
    }
}
