//! The timeouts a caller chooses for a [`SocketCollective`](super::SocketCollective).

use std::time::Duration;

/// Timeouts of a [`SocketCollective`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketOptions {
    /// How long [`SocketCollective::init`] waits for the whole group to join.
    pub init_timeout: Duration,
    /// How long an operation may go without moving a single byte on any of its sockets before it
    /// fails with [`CommError::Timeout`] (a stopped or wedged peer).
    pub op_timeout: Duration,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            init_timeout: Duration::from_secs(120),
            op_timeout: Duration::from_secs(60),
        }
    }
}
