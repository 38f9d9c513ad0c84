//! GGML block formats as bytes and the integer kernels that multiply them.
//!
//! - [`formats`]: the formats, a rank's slice of a tensor, load-time quantization.
//! - [`kernels`]: 8-bit activations and dot products against GGML's row layout (K-quants, and
//!   the rows of a matrix past its last group of eight).
//! - [`kquant`]: the integer dot products of K-quant rows (Q2_K..Q6_K) with Q8_K activations.
//! - [`interleaved`]: the resident layout of the 32-value block formats and Q4_K, eight rows
//!   interleaved, and its products.

pub mod formats;
pub mod interleaved;
pub mod kernels;
pub mod kquant;
