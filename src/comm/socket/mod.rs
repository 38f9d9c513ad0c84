//! CPU collective backend: a full mesh of TCP or Unix-domain stream sockets between the ranks of
//! one tensor-parallel group, one OS process per rank.
//!
//! Bootstrap mirrors NCCL: rank 0 calls [`create_comm_id`], which binds a rendezvous listener and
//! returns an opaque [`CommId`] (rendezvous address + random nonce) together with the bound
//! [`Rendezvous`]. The coordinator hands the id to every rank; every rank calls
//! [`SocketCollective::init`] (rank 0 passes its `Rendezvous` back in). The design, wire format
//! and failure semantics are described in `docs/collectives.md`.
//!
//! The modules, bottom up:
//! - `options`, `address`, `id`: what a caller configures and passes around.
//! - `sys`: the few libc calls (send, recv, sendmsg, poll), each behind a safe function; the
//!   backend's only `unsafe` code.
//! - `conn`: listeners, connections and deadlines.
//! - `frames`, `rendezvous`, `bootstrap`: the init protocol that builds the mesh.
//! - `wire`: the data-path header and what a receiver checks it against.
//! - `reduce`: typed host buffers, the rank-order sum and the gather concatenation.
//! - `transfer`: the non-blocking engine that moves many messages at once.
//! - `ops`: each collective as headers out, transfers, arithmetic in.
//! - this module: [`SocketCollective`], its poisoning and abort, and the [`Collective`] impl.

mod address;
mod bootstrap;
mod conn;
mod frames;
mod id;
mod ops;
mod options;
mod reduce;
mod rendezvous;
mod sys;
mod transfer;
mod wire;

pub use address::RendezvousAddr;
pub use id::CommId;
pub use options::SocketOptions;
pub use rendezvous::{Rendezvous, create_comm_id};

#[cfg(feature = "cuda")]
pub(crate) use id::ID_PREFIX;

use std::fmt;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use candle_core::Tensor;
use tracing::{debug, warn};

use super::{Collective, CommError, CommResult};
use bootstrap::{bootstrap_peer, bootstrap_root};
use conn::{Conn, io_ctx};
use ops::{to_device, to_host};
use transfer::OpState;

/// The first error this communicator hit; later operations fail fast with a copy of it.
struct Poison {
    op: &'static str,
    peer: Option<usize>,
    message: String,
}

/// Collectives between OS processes over a full mesh of TCP or Unix-domain sockets.
///
/// Every error is terminal: the communicator shuts its sockets down (so peers fail fast too) and
/// every later operation fails quickly. Create a new id and group to recover.
pub struct SocketCollective {
    rank: usize,
    world_size: usize,
    /// Indexed by rank; `None` at our own rank. Immutable after init, so `abort` can shut the
    /// sockets down while an operation is using them.
    peers: Vec<Option<Conn>>,
    state: Mutex<OpState>,
    aborted: AtomicBool,
    poison: OnceLock<Poison>,
    wake_rx: UnixStream,
    wake_tx: UnixStream,
    op_timeout: Duration,
}

impl fmt::Debug for SocketCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SocketCollective")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("aborted", &self.aborted.load(Ordering::Relaxed))
            .field("poisoned", &self.poison.get().map(|p| p.message.as_str()))
            .finish()
    }
}

impl SocketCollective {
    /// Joins the group named by `id` as `rank` of `world_size`, blocking until every rank has
    /// joined and the mesh is connected, or until `options.init_timeout` passes
    /// ([`CommError::InitTimeout`] naming the ranks that never arrived). Rank 0 must pass the
    /// [`Rendezvous`] returned by [`create_comm_id`]; the other ranks pass `None`.
    pub fn init(
        id: &CommId,
        rank: usize,
        world_size: usize,
        rendezvous: Option<Rendezvous>,
        options: SocketOptions,
    ) -> CommResult<Self> {
        let invalid = |reason: String| CommError::Invalid { op: "init", reason };
        if world_size == 0 || world_size > u32::MAX as usize {
            return Err(invalid(format!("bad world size {world_size}")));
        }
        if rank >= world_size {
            return Err(invalid(format!(
                "rank {rank} out of range for world size {world_size}"
            )));
        }
        if options.op_timeout.is_zero() || options.init_timeout.is_zero() {
            return Err(invalid("timeouts must be non-zero".into()));
        }
        let peers = match (rank, rendezvous) {
            (0, Some(rdv)) => {
                if rdv.id != *id {
                    return Err(invalid(format!(
                        "rendezvous belongs to {} but init was given {id}",
                        rdv.id
                    )));
                }
                let peers = bootstrap_root(id, world_size, &rdv, &options)?;
                drop(rdv);
                peers
            }
            (0, None) => {
                return Err(invalid(
                    "rank 0 must be given the Rendezvous returned by create_comm_id".into(),
                ));
            }
            (_, Some(_)) => {
                return Err(invalid(format!(
                    "rank {rank} was given a Rendezvous; only rank 0 holds it"
                )));
            }
            (_, None) => bootstrap_peer(id, rank, world_size, &options)?,
        };
        for c in peers.iter().flatten() {
            // Back to blocking with no timeouts; the data path uses MSG_DONTWAIT + poll.
            c.set_timeouts(None)
                .map_err(|e| io_ctx("init", "clear socket timeouts".into(), e))?;
        }
        let (wake_rx, wake_tx) =
            UnixStream::pair().map_err(|e| io_ctx("init", "create wake-up pipe".into(), e))?;
        wake_tx
            .set_nonblocking(true)
            .map_err(|e| io_ctx("init", "set wake-up pipe non-blocking".into(), e))?;
        debug!(rank, world_size, id = %id, "communicator ready");
        Ok(Self {
            rank,
            world_size,
            peers,
            state: Mutex::new(OpState::new(rank, world_size)),
            aborted: AtomicBool::new(false),
            poison: OnceLock::new(),
            wake_rx,
            wake_tx,
            op_timeout: options.op_timeout,
        })
    }

    fn check_usable(&self, op: &'static str) -> CommResult<()> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CommError::Aborted);
        }
        if let Some(p) = self.poison.get() {
            let reason = format!(
                "communicator unusable after an earlier failure in {}: {}",
                p.op, p.message
            );
            return Err(match p.peer {
                Some(peer) => CommError::PeerFailed { peer, op, reason },
                None => CommError::Invalid { op, reason },
            });
        }
        Ok(())
    }

    /// Records the first failure, tears the sockets down so the peers notice at once, and
    /// returns the error the caller should see.
    fn fail(&self, op: &'static str, err: CommError) -> CommError {
        if self.aborted.load(Ordering::SeqCst) {
            return CommError::Aborted;
        }
        let peer = match &err {
            CommError::PeerFailed { peer, .. } | CommError::Timeout { peer, .. } => Some(*peer),
            _ => None,
        };
        if self
            .poison
            .set(Poison {
                op,
                peer,
                message: err.to_string(),
            })
            .is_ok()
        {
            warn!(rank = self.rank, op, error = %err, "collective failed; communicator is now unusable");
            for c in self.peers.iter().flatten() {
                c.shutdown();
            }
        }
        err
    }

    /// Runs one collective: checks the communicator is usable, takes the op lock, bumps the
    /// sequence number, and poisons the communicator on failure.
    fn run<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut OpState) -> CommResult<R>,
    ) -> CommResult<R> {
        self.check_usable(op)?;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        self.check_usable(op)?;
        st.seq += 1;
        f(&mut st).map_err(|e| self.fail(op, e))
    }

    fn conn(&self, op: &'static str, peer: usize) -> CommResult<&Conn> {
        self.peers
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| CommError::Invalid {
                op,
                reason: format!("no connection to rank {peer}"),
            })
    }

}

impl SocketCollective {
    /// A group of one passes tensors through unchanged, unless asked to run the operations
    /// anyway ([`crate::comm::collectives_at_tp1`]).
    fn skips_collectives(&self) -> bool {
        self.world_size == 1 && !crate::comm::collectives_at_tp1()
    }
}

impl Collective for SocketCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
        self.run("all_reduce_sum", |st| {
            if self.skips_collectives() {
                return Ok(tensor.clone());
            }
            let (host, back) = to_host(tensor)?;
            to_device(self.all_reduce_cpu(st, &host)?, &back)
        })
    }

    fn all_gather(&self, tensor: &Tensor, dim: usize) -> CommResult<Tensor> {
        self.run("all_gather", |st| {
            if self.skips_collectives() {
                return Ok(tensor.clone());
            }
            let (host, back) = to_host(tensor)?;
            let out = self
                .gather_cpu(st, &host, dim, None)?
                .ok_or_else(|| CommError::Invalid {
                    op: "all_gather",
                    reason: "no result".into(),
                })?;
            to_device(out, &back)
        })
    }

    fn gather(&self, tensor: &Tensor, dim: usize, root: usize) -> CommResult<Option<Tensor>> {
        self.run("gather", |st| {
            if self.skips_collectives() {
                return Ok(Some(tensor.clone()));
            }
            let (host, back) = to_host(tensor)?;
            self.gather_cpu(st, &host, dim, Some(root))?
                .map(|t| to_device(t, &back))
                .transpose()
        })
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> CommResult<Tensor> {
        self.run("broadcast", |st| {
            if self.skips_collectives() {
                return Ok(tensor.clone());
            }
            let (host, back) = to_host(tensor)?;
            match self.broadcast_cpu(st, &host, root)? {
                Some(t) => to_device(t, &back),
                None => Ok(tensor.clone()),
            }
        })
    }

    fn barrier(&self) -> CommResult<()> {
        self.run("barrier", |st| {
            if self.skips_collectives() {
                Ok(())
            } else {
                self.barrier_impl(st)
            }
        })
    }

    fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        warn!(rank = self.rank, "communicator aborted");
        // Wake a blocked poll, then shut the sockets down so the peers notice too. The fds stay
        // open (owned by `peers`) until drop, so there is no fd-reuse race with a running op.
        let _ = (&self.wake_tx).write(&[1]);
        for c in self.peers.iter().flatten() {
            c.shutdown();
        }
    }
}

