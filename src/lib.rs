//! tpserve: a tensor-parallel LLM inference service.
//!
//! - [`coordinator`]: the public gRPC service; tokenizes, schedules, streams, drives the ranks.
//! - [`rank`]: a rank server holding one tensor-parallel shard and its caches.
//! - [`comm`]: collectives between ranks (sockets on CPU, NCCL on GPU).
//! - [`model`]: configs, checkpoint loading, parallel layers, model families.
//! - [`sampling`]: request sampling parameters and the token sampler.
//! - [`proto`]: the generated protocol code; [`net`]: addresses and transports.
//! - [`auth`]: tokens; [`metrics`]: Prometheus metrics; [`telemetry`]: logs and traces;
//!   [`signals`]: SIGINT/SIGTERM.
//! - [`cli`]: the `tpserve` command line.
//!
//! Imports point down this list's stack: cli → coordinator → rank → model → comm, with proto,
//! net, auth, metrics, telemetry, signals and sampling below all of them.

pub mod auth;
pub mod cli;
pub mod comm;
pub mod coordinator;
pub mod metrics;
pub mod model;
pub mod net;
pub mod proto;
pub mod rank;
pub mod sampling;
pub mod signals;
pub mod telemetry;
