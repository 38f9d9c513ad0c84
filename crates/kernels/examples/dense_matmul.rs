//! Speed of the f32 and bf16 weight kernels on a whole decode step's matrices, beside the
//! memory-read bandwidth measured in the same run and candle's matmul (the baseline): the
//! row-major tiles (`cpu_matmul`, each path) and, where the CPU has a panel kernel, the column
//! panels the loader holds dense weights in (`panels`), bf16 also with the activations rounded to
//! bf16 (`Products::Bf16`, "panels-avx512-bf16x").
//!
//! The weights are those of the ~100M-parameter Qwen3 shape of `benches/tp_bench.rs` (hidden
//! 768, 12 layers, fused q/k/v [1280x768], o [768x768], fused gate/up [4096x768], down
//! [768x2048], LM head [32000x768]): 400 MB in f32, well past any cache, so one "step" (every
//! matrix once) streams them from memory as decode does. For one activation row it prints the
//! step time and GB/s (and the fraction of the bandwidth); for batches, GFLOP/s.
//! A figure, not a test.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release -p tpserve-kernels --example dense_matmul

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use tpserve_kernels::cpu_matmul::{Isa, matmul_transposed_with};
use tpserve_kernels::panels::{self, Packed, Products};

const HIDDEN: usize = 768;
const LAYERS: usize = 12;

/// Best-of-`reps` seconds of `f`.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Read bandwidth: a parallel sum over 1 GiB of f32, best of 5, in GB/s.
fn bandwidth() -> f64 {
    let data = vec![1f32; 1 << 28];
    let seconds = best(5, || {
        // Sixteen lanes so that the compiler vectorises the sum (a serial f32 sum is bound by
        // the add latency, not by memory).
        let sum: f32 = data
            .par_chunks(1 << 16)
            .map(|c| {
                let mut lanes = [0f32; 16];
                for v in c.chunks_exact(16) {
                    for l in 0..16 {
                        lanes[l] += v[l];
                    }
                }
                lanes.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(sum);
    });
    (data.len() * 4) as f64 / seconds / 1e9
}

fn main() {
    // On a thread of the pool, as the rank's compute does (`src/model/compute_pool.rs`): a
    // call from outside would pay a cross-thread wake-up per product.
    rayon::ThreadPoolBuilder::new().build().expect("thread pool").install(run);
}

fn run() {
    let shapes: Vec<(usize, usize)> = (0..LAYERS)
        .flat_map(|_| [(1280, HIDDEN), (HIDDEN, HIDDEN), (4096, HIDDEN), (HIDDEN, 2048)])
        .chain([(32000, HIDDEN)])
        .collect();
    let params: usize = shapes.iter().map(|(n, k)| n * k).sum();
    let gbs = bandwidth();
    println!("read bandwidth: {gbs:.1} GB/s; {params} weights per step, threads {}", rayon::current_num_threads());
    // The kernels' arithmetic alone: one [128x768] weight, in L2, many times.
    for dtype in [DType::F32, DType::BF16] {
        let w = Tensor::from_vec((0..128 * HIDDEN).map(|j| (j % 1000) as f32 / 500.0 - 1.0).collect::<Vec<f32>>(), (128, HIDDEN), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for m in [1, 16] {
            let x = Tensor::from_vec((0..m * HIDDEN).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect::<Vec<f32>>(), (m, HIDDEN), &Device::Cpu).unwrap();
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available() && *isa != Isa::Portable) {
                let seconds = best(10, || {
                    for _ in 0..300 {
                        std::hint::black_box(matmul_transposed_with(&x, &w, isa).unwrap());
                    }
                }) / 300.0;
                let flops = 2.0 * (128 * HIDDEN * m) as f64 / seconds / 1e9;
                println!("{dtype:?} m={m:<2} {:>7}: in cache, {:6.2} µs per product, {flops:6.1} GFLOP/s", isa.name(), seconds * 1e6);
            }
        }
    }
    for dtype in [DType::F32, DType::BF16] {
        let weights: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| {
                let values: Vec<f32> = (0..n * k).map(|j| (((i + j) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
                Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
            })
            .collect();
        // The same weights in column panels, as the loader holds them where the CPU has a
        // panel kernel (`tpserve_kernels::panels`).
        let packed: Vec<(Vec<f32>, Vec<u16>)> = weights
            .iter()
            .map(|w| {
                let (n, k) = w.dims2().unwrap();
                let values = w.flatten_all().unwrap();
                if dtype == DType::BF16 {
                    let bits: Vec<u16> = values.to_vec1::<half::bf16>().unwrap().iter().map(|b| b.to_bits()).collect();
                    (Vec::new(), panels::pack_bf16(&bits, n, k))
                } else {
                    (panels::pack_f32(&values.to_vec1::<f32>().unwrap(), n, k), Vec::new())
                }
            })
            .collect();
        let bytes = (params * dtype.size_in_bytes()) as f64;
        for m in [1, 4, 8, 16, 32, 64, 128, 256, 512] {
            let xs: Vec<Tensor> = [HIDDEN, 2048]
                .iter()
                .map(|&k| Tensor::from_vec((0..m * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect::<Vec<f32>>(), (m, k), &Device::Cpu).unwrap())
                .collect();
            let x_for = |k: usize| if k == HIDDEN { &xs[0] } else { &xs[1] };
            let mut runs: Vec<(String, f64)> = Vec::new();
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available() && *isa != Isa::Portable) {
                if matmul_transposed_with(&xs[0], &weights[0], isa).unwrap().is_none() {
                    println!("{dtype:?} m={m:<2} {:>7}: declined (candle's gemm takes these rows)", isa.name());
                    continue;
                }
                let seconds = best(3, || {
                    for w in &weights {
                        let y = matmul_transposed_with(x_for(w.dim(1).unwrap()), w, isa).unwrap();
                        std::hint::black_box(y);
                    }
                });
                runs.push((isa.name().to_string(), seconds));
            }
            let x_values: Vec<Vec<f32>> = xs.iter().map(|x| x.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
            // bf16 weights also with their activations rounded to bf16 (`vdpbf16ps` where the
            // CPU has avx512_bf16: "panels-bf16x")
            let precisions: &[Products] = if dtype == DType::BF16 { &[Products::Exact, Products::Bf16] } else { &[Products::Exact] };
            for isa in Isa::ALL.into_iter().filter(|isa| isa.available() && panels::packs_for(*isa)) {
                for &products in precisions {
                    let seconds = best(3, || {
                        for (w, (f32s, bf16s)) in weights.iter().zip(&packed) {
                            let (n, k) = w.dims2().unwrap();
                            let held = if dtype == DType::BF16 { Packed::Bf16(bf16s) } else { Packed::F32(f32s) };
                            let x = if k == HIDDEN { &x_values[0] } else { &x_values[1] };
                            std::hint::black_box(panels::matmul(x, m, k, held, n, isa, products));
                        }
                    });
                    let suffix = if products == Products::Bf16 { "-bf16x" } else { "" };
                    runs.push((format!("panels-{}{suffix}", isa.name()), seconds));
                }
            }
            // candle's gemm (for bf16 weights: on an f32 copy made per call, what the model
            // falls back to when the kernel declines)
            let seconds = best(3, || {
                for w in &weights {
                    let w = w.to_dtype(DType::F32).unwrap();
                    let y = x_for(w.dim(1).unwrap()).matmul(&w.t().unwrap()).unwrap();
                    std::hint::black_box(y);
                }
            });
            runs.push(("candle".to_string(), seconds));
            for (name, seconds) in runs {
                let flops = 2.0 * (params * m) as f64 / seconds / 1e9;
                let stream = bytes / seconds / 1e9;
                println!(
                    "{dtype:?} m={m:<2} {name:>14}: {:7.2} ms/step  {stream:5.1} GB/s ({:3.0}% of bandwidth)  {flops:6.1} GFLOP/s",
                    seconds * 1e3,
                    100.0 * stream / gbs
                );
            }
        }
    }
}
