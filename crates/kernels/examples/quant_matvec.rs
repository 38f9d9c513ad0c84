//! Speed of the quantized kernels on SmolLM2-135M's shapes, every path this CPU has, for one
//! activation row (decode) and sixteen (a batch): prints µs per product and GB/s of weights
//! streamed, for GGML's row layout (`rows`) and, for the formats held interleaved, that layout
//! (`x8`), beside candle's quantized matmul (`QMatMul`, the baseline) on the
//! same weights.
//! The K-quants (Q4_K, Q5_K, Q6_K, then Q2_K, Q3_K) follow on shapes whose rows are whole
//! 256-value blocks, in row layout and, for Q4_K, the x8 layout, beside candle's `QMatMul` and
//! candle's own `vec_dot` per row (what tpserve ran for them before `quant::kquant`, split over
//! the rayon pool the same way).
//! A figure, not a test.
//!
//! `--batches` prints instead, for the interleaved layout on this CPU's fastest path, products of
//! 1 to 512 activation rows on the 100M Qwen3 shape of the serving benchmark, in G multiply-adds
//! a second: how far batching multiplies a kernel's throughput, against `cpu_peak`'s ceilings.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release -p tpserve-kernels --example quant_matvec [-- --k-quants | --batches]

use std::time::Instant;

use candle_core::quantized::k_quants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, GgmlType};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;
use tpserve_kernels::quant::formats::{Format, Sliced, quantize_matrix, row_bytes};
use tpserve_kernels::quant::interleaved;
use tpserve_kernels::quant::kernels::{Path, matmul};

fn main() {
    // On a thread of the pool, as the rank's compute does (`src/model/compute_pool.rs`): a call
    // from outside pays a cross-thread wake-up per product, which on a VM was most of a small
    // product's time (50-100 µs).
    rayon::ThreadPoolBuilder::new().build().expect("thread pool").install(run);
}

fn run() {
    if std::env::args().any(|a| a == "--batches") {
        return batches();
    }
    // `--k-quants`: only the K-quant lines
    let only_k = std::env::args().any(|a| a == "--k-quants");
    if !only_k {
        // (k, n): q/k/v+o, gate/up, down, LM head of SmolLM2-135M
        let shapes = [(576, 960), (576, 3072), (1536, 576), (576, 49152)];
        for (dtype, m) in [(Format::Q4_1, 1), (Format::Q8_0, 1), (Format::Q4_1, 16), (Format::Q8_0, 16)] {
            layout_lines(dtype, m, &shapes);
            candle_line(dtype, m, &shapes);
        }
    }
    // K-quants: (k, n) with k whole 256-value blocks (candle refuses others): SmolLM2's down
    // projection, Qwen3-0.6B's gate/up and down, a 2048-wide attention projection.
    let shapes = [(1536, 576), (1024, 3072), (3072, 1024), (2048, 2048)];
    for m in [1, 16] {
        for dtype in [Format::Q4K, Format::Q5K, Format::Q6K, Format::Q2K, Format::Q3K] {
            layout_lines(dtype, m, &shapes);
            let mut line = format!("{dtype:?} m={m:<2} {:>16}:", "candle vec_dot");
            for &(k, n) in &shapes {
                let Sliced::Blocks { bytes, .. } = quantize_matrix(dtype, n, k, weights(n, k)) else { continue };
                let x = activations(m, k);
                let seconds = time(m, n, k, || candle_vec_dot(dtype, &x, m, k, &bytes, n));
                line += &figure(k, n, seconds, n * row_bytes(dtype, k));
            }
            println!("{line}");
            candle_line(dtype, m, &shapes);
        }
    }
}

/// One line per path this CPU has and per layout of `dtype`: GGML's rows, and the interleaved
/// one where the format is held so (`interleaved::packable`).
fn layout_lines(dtype: Format, m: usize, shapes: &[(usize, usize)]) {
    for path in Path::ALL.into_iter().filter(|p| p.available()) {
        for x8 in [false, true] {
            if x8 && !interleaved::packable(dtype) {
                continue;
            }
            let layout = if x8 { "x8" } else { "rows" };
            let mut line = format!("{dtype:?} m={m:<2} {:>11} {layout:>4}:", path.name());
            for &(k, n) in shapes {
                let Sliced::Blocks { dtype: held, bytes, .. } = quantize_matrix(dtype, n, k, weights(n, k)) else { continue };
                let bytes = if x8 { interleaved::pack(held, n, k, &bytes) } else { bytes };
                let x = activations(m, k);
                let seconds = time(m, n, k, || {
                    if x8 { interleaved::matmul(&x, m, k, held, &bytes, n, path) } else { matmul(&x, m, k, held, &bytes, n, path) }
                });
                line += &figure(k, n, seconds, n * row_bytes(held, k));
            }
            println!("{line}");
        }
    }
}

/// The interleaved products of 1 to 512 rows on the fastest path, in G multiply-adds a second.
fn batches() {
    let path = Path::ALL.into_iter().filter(|p| p.available()).last().expect("the portable path");
    // (k, n): fused gate/up, down, q/o of the 100M Qwen3 shape (`benches/support`)
    let shapes = [(768, 4096), (2048, 768), (768, 768)];
    for dtype in [Format::Q8_0, Format::Q4_1, Format::Q4K] {
        for m in [1, 8, 16, 64, 512] {
            let mut line = format!("{dtype:?} {} m={m:<3}:", path.name());
            for &(k, n) in &shapes {
                let Sliced::Blocks { dtype: held, bytes, .. } = quantize_matrix(dtype, n, k, weights(n, k)) else { continue };
                let bytes = interleaved::pack(held, n, k, &bytes);
                let x = activations(m, k);
                let seconds = time(m, n, k, || interleaved::matmul(&x, m, k, held, &bytes, n, path));
                line += &format!("  [{k}x{n}] {:.1} µs {:.0} G/s", seconds * 1e6, (m * n * k) as f64 / seconds / 1e9);
            }
            println!("{line}");
        }
    }
}

/// candle's quantized matmul (`QMatMul`, the baseline) on the same weights.
fn candle_line(dtype: Format, m: usize, shapes: &[(usize, usize)]) {
    let mut line = format!("{dtype:?} m={m:<2} {:>16}:", "candle");
    for &(k, n) in shapes {
        if k % dtype.block_size() != 0 {
            // candle refuses rows that are not whole blocks (tpserve holds them as Q8_0)
            line += &format!("  [{k}x{n}] n/a");
            continue;
        }
        let w = Tensor::from_vec(weights(n, k), (n, k), &Device::Cpu).unwrap();
        let ggml = dtype.ggml().expect("a format candle quantizes to");
        let q = QMatMul::from_qtensor(QTensor::quantize(&w, ggml).unwrap()).unwrap();
        let x = Tensor::from_vec(activations(m, k), (m, k), &Device::Cpu).unwrap();
        let seconds = time(m, n, k, || q.forward(&x).unwrap());
        line += &figure(k, n, seconds, n * row_bytes(dtype, k));
    }
    println!("{line}");
}

fn weights(n: usize, k: usize) -> Vec<f32> {
    (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect()
}

fn activations(m: usize, k: usize) -> Vec<f32> {
    (0..m * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect()
}

/// Seconds per call of `product` (about 2e8 multiply-adds of calls, at least 3).
fn time<R>(m: usize, n: usize, k: usize, mut product: impl FnMut() -> R) -> f64 {
    let reps = (200_000_000 / (n * k * m)).max(3);
    std::hint::black_box(product());
    let started = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(product());
    }
    started.elapsed().as_secs_f64() / reps as f64
}

fn figure(k: usize, n: usize, seconds: f64, bytes: usize) -> String {
    format!("  [{k}x{n}] {:.1} µs {:.1} GB/s", seconds * 1e6, bytes as f64 / seconds / 1e9)
}

/// `x @ w.T` through candle's `GgmlType::vec_dot` per weight row against candle's Q8_K
/// activations, 32 rows a rayon task: tpserve's K-quant product before `quant::kquant`.
fn candle_vec_dot(dtype: Format, x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    fn run<T: GgmlType<VecDotType = BlockQ8K>>(x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
        let acts: Vec<Vec<BlockQ8K>> = x
            .chunks_exact(k)
            .map(|row| {
                let mut blocks: Vec<BlockQ8K> = (0..k / 256).map(|_| BlockQ8K::zeros()).collect();
                BlockQ8K::from_float(row, &mut blocks);
                blocks
            })
            .collect();
        let rb = k / T::BLCK_SIZE * T::DTYPE.type_size();
        let mut out_t = vec![0f32; n * m];
        out_t.par_chunks_mut(32 * m).enumerate().for_each(|(task, out)| {
            for (j, out) in out.chunks_exact_mut(m).enumerate() {
                let row = &w[(task * 32 + j) * rb..(task * 32 + j + 1) * rb];
                assert_eq!(row.as_ptr() as usize % std::mem::align_of::<T>(), 0);
                assert_eq!(std::mem::size_of::<T>() * (k / 256), rb);
                // SAFETY: the block types are #[repr(C)] plain data for which any bytes are valid;
                // the row is aligned for T and holds exactly k / 256 blocks (asserted above).
                let blocks = unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<T>(), k / 256) };
                for (o, act) in out.iter_mut().zip(&acts) {
                    *o = T::vec_dot(k, blocks, act);
                }
            }
        });
        out_t
    }
    match dtype {
        Format::Q2K => run::<BlockQ2K>(x, m, k, w, n),
        Format::Q3K => run::<BlockQ3K>(x, m, k, w, n),
        Format::Q4K => run::<BlockQ4K>(x, m, k, w, n),
        Format::Q5K => run::<BlockQ5K>(x, m, k, w, n),
        _ => run::<BlockQ6K>(x, m, k, w, n),
    }
}
