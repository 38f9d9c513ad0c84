//! Rank 0's side of the bootstrap before init: binding the rendezvous listener and minting the
//! communicator id that names it.

use std::fmt;
use std::net::{SocketAddr, TcpListener};

use tracing::debug;

use super::address::{RendezvousAddr, validate_host};
use super::conn::{Listener, io_ctx};
use super::id::CommId;
use crate::comm::{CommError, CommResult};

/// Rank 0's bound rendezvous listener. Keep it alive from [`create_comm_id`] until it is handed
/// to [`SocketCollective::init`]; ranks that connect in the meantime wait in the kernel backlog.
/// Dropping it closes the listener (and removes the Unix socket file).
pub struct Rendezvous {
    pub(super) id: CommId,
    pub(super) listener: Listener,
}

impl Rendezvous {
    /// The id this rendezvous serves.
    pub fn id(&self) -> &CommId {
        &self.id
    }
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Binds rank 0's rendezvous listener and creates a fresh communicator id for it.
///
/// `bind` is `Tcp { host, port }` (port 0 picks a free port; the id carries the actual one) or a
/// Unix socket path (a stale socket file there is removed first). For TCP the id advertises
/// `advertise_host` if given, else the bound IP; binding a wildcard address (`0.0.0.0`, `::`)
/// without an `advertise_host` is an error because other hosts could not reach it.
pub fn create_comm_id(
    bind: &RendezvousAddr,
    advertise_host: Option<&str>,
) -> CommResult<(CommId, Rendezvous)> {
    const OP: &str = "create_comm_id";
    let (listener, addr) = match bind {
        RendezvousAddr::Tcp { host, port } => {
            let l = TcpListener::bind((host.as_str(), *port))
                .map_err(|e| io_ctx(OP, format!("bind tcp {bind}"), e))?;
            let local: SocketAddr = l
                .local_addr()
                .map_err(|e| io_ctx(OP, "local_addr".into(), e))?;
            let host = match advertise_host {
                Some(h) => {
                    let h = h
                        .strip_prefix('[')
                        .and_then(|h| h.strip_suffix(']'))
                        .unwrap_or(h);
                    validate_host(h).map_err(|reason| CommError::Invalid {
                        op: OP,
                        reason: format!("advertise_host: {reason}"),
                    })?;
                    h.to_string()
                }
                None if local.ip().is_unspecified() => {
                    return Err(CommError::Invalid {
                        op: OP,
                        reason: format!(
                            "bound the wildcard address {local}; pass advertise_host so other ranks can reach it"
                        ),
                    });
                }
                None => local.ip().to_string(),
            };
            (
                Listener::Tcp(l),
                RendezvousAddr::Tcp {
                    host,
                    port: local.port(),
                },
            )
        }
        RendezvousAddr::Unix(path) => (
            Listener::bind_unix(path, OP)?,
            RendezvousAddr::Unix(path.clone()),
        ),
    };
    let nonce = rand::random::<u128>().to_le_bytes();
    let id = CommId { addr, nonce };
    debug!(%id, "created communicator id");
    Ok((id.clone(), Rendezvous { id, listener }))
}
