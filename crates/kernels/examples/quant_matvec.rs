//! Speed of the quantized kernels on SmolLM2-135M's shapes, every path this CPU has, for one
//! activation row (decode) and sixteen (a batch): prints µs per product and GB/s of weights
//! streamed, for GGML's row layout (`rows`) and, for the 32-value block formats, the resident
//! interleaved layout (`x8`), beside candle's quantized matmul (`QMatMul`, the baseline) on the
//! same weights.
//! A figure, not a test.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release -p tpserve-kernels --example quant_matvec

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tpserve_kernels::quant::formats::{Sliced, quantize_matrix, row_bytes};
use tpserve_kernels::quant::interleaved;
use tpserve_kernels::quant::kernels::{Path, matmul};

fn main() {
    // (k, n): q/k/v+o, gate/up, down, LM head of SmolLM2-135M
    let shapes = [(576, 960), (576, 3072), (1536, 576), (576, 49152)];
    for (dtype, m) in [(GgmlDType::Q4_1, 1), (GgmlDType::Q8_0, 1), (GgmlDType::Q4K, 1), (GgmlDType::Q4_1, 16), (GgmlDType::Q8_0, 16)] {
        for path in Path::ALL.into_iter().filter(|p| p.available()) {
            for x8 in [false, true] {
                if x8 && !interleaved::packable(dtype) {
                    continue;
                }
                let layout = if x8 { "x8" } else { "rows" };
                let mut line = format!("{dtype:?} m={m:<2} {:>11} {layout:>4}:", path.name());
                for (k, n) in shapes {
                    let values: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
                    let Sliced::Blocks { dtype: held, bytes, .. } = quantize_matrix(dtype, n, k, values) else { continue };
                    let bytes = if x8 { interleaved::pack(held, n, k, &bytes) } else { bytes };
                    let product = |x: &[f32]| {
                        if x8 { interleaved::matmul(x, m, k, held, &bytes, n, path) } else { matmul(x, m, k, held, &bytes, n, path) }
                    };
                    let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
                    let reps = (200_000_000 / (n * k * m)).max(3);
                    let _ = product(&x);
                    let started = Instant::now();
                    for _ in 0..reps {
                        std::hint::black_box(product(&x));
                    }
                    let seconds = started.elapsed().as_secs_f64() / reps as f64;
                    let gbs = (n * row_bytes(held, k)) as f64 / seconds / 1e9;
                    line += &format!("  [{k}x{n}] {:.1} µs {gbs:.1} GB/s", seconds * 1e6);
                }
                println!("{line}");
            }
        }
        let mut line = format!("{dtype:?} m={m:<2} {:>16}:", "candle");
        for (k, n) in shapes {
            if k % dtype.block_size() != 0 {
                // candle refuses rows that are not whole blocks (tpserve holds them as Q8_0)
                line += &format!("  [{k}x{n}] n/a");
                continue;
            }
            let values: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
            let w = Tensor::from_vec(values, (n, k), &Device::Cpu).unwrap();
            let q = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
            let x = Tensor::from_vec((0..m * k).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect::<Vec<f32>>(), (m, k), &Device::Cpu).unwrap();
            let reps = (200_000_000 / (n * k * m)).max(3);
            let _ = q.forward(&x).unwrap();
            let started = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(q.forward(&x).unwrap());
            }
            let seconds = started.elapsed().as_secs_f64() / reps as f64;
            let gbs = (n * row_bytes(dtype, k)) as f64 / seconds / 1e9;
            line += &format!("  [{k}x{n}] {:.1} µs {gbs:.1} GB/s", seconds * 1e6);
        }
        println!("{line}");
    }
}
