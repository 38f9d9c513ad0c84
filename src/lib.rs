//! tpserve: a tensor-parallel LLM inference service.
//!
//! - [`comm`]: collectives between ranks (sockets on CPU, NCCL on GPU).
//! - [`model`]: configs, checkpoint loading, parallel layers, model families.

pub mod comm;
pub mod model;
pub mod rank;
