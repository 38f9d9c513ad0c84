//! The rank server: one tensor-parallel shard, its caches and its communicator.

pub mod error;
pub mod offline;
pub mod server;
pub mod worker;
