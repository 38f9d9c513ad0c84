//! GGML block formats as bytes and the integer kernels that multiply them.

pub mod formats;
pub mod kernels;
