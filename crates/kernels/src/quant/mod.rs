//! GGML block formats as bytes and the integer kernels that multiply them.
//!
//! - [`formats`]: the formats ([`formats::Format`]), a rank's slice of a tensor, load-time
//!   quantization.
//! - [`kernels`]: 8-bit activations and dot products against GGML's row layout (K-quants, and
//!   the rows of a matrix past its last group of eight).
//! - [`iq4`]: IQ4_NL and IQ4_XS (4-bit levels from a table): dequantized, and IQ4_XS's blocks
//!   as IQ4_NL's.
//! - [`kquant`]: the integer dot products of K-quant rows (Q2_K..Q6_K) with Q8_K activations.
//! - [`interleaved`]: the resident layout of the 32-value block formats, eight rows
//!   interleaved, and its products.
//! - [`interleaved_k`]: the same layout's group-blocks and products for Q4_K, Q5_K and Q6_K.

pub mod formats;
pub mod interleaved;
pub mod interleaved_k;
pub mod iq4;
pub mod kernels;
pub mod kquant;
