//! The init protocol that turns a communicator id into a connected mesh: every rank joins rank
//! 0's rendezvous, rank 0 hands out the peer table, each rank connects to the lower ranks and
//! accepts the higher ones, and rank 0 releases the group once everyone reports ready. Timeouts
//! name the ranks that never arrived.

use std::io;
use std::net::{IpAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::address::RendezvousAddr;
use super::conn::{Conn, Listener, connect_retry, deadline_after, io_ctx, is_timeout};
use super::frames::{
    FRAME_ACCEPT, FRAME_GO, FRAME_HELLO, FRAME_INIT_FAILED, FRAME_PEERS, FRAME_READY, FRAME_REJECT,
    decode_init_failed, decode_peers, encode_hello, encode_init_failed, encode_peers, read_frame,
    read_hello, reject, write_frame,
};
use super::id::CommId;
use super::options::SocketOptions;
use super::rendezvous::Rendezvous;
use crate::comm::{CommError, CommResult};

/// How long one unauthenticated incoming connection may take to say hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Non-root ranks wait this much past their own deadline for rank 0's verdict, so that they
/// report which ranks were missing rather than a bare timeout.
const VERDICT_GRACE: Duration = Duration::from_secs(2);

fn missing_ranks(conns: &[Option<Conn>], range: std::ops::Range<usize>) -> Vec<usize> {
    range
        .filter(|&r| conns.get(r).is_none_or(Option::is_none))
        .collect()
}

pub(super) fn bootstrap_root(
    id: &CommId,
    world: usize,
    rdv: &Rendezvous,
    opts: &SocketOptions,
) -> CommResult<Vec<Option<Conn>>> {
    let waited = opts.init_timeout;
    let deadline = deadline_after(opts.init_timeout);
    let mut conns: Vec<Option<Conn>> = (0..world).map(|_| None).collect();
    let mut addrs: Vec<Vec<u8>> = vec![Vec::new(); world];
    rdv.listener
        .set_nonblocking(true)
        .map_err(|e| io_ctx("init", "set listener non-blocking".into(), e))?;

    // 1. Every other rank connects to the rendezvous and says hello.
    while conns[1..].iter().any(Option::is_none) {
        let accepted = rdv
            .listener
            .accept_until(deadline)
            .map_err(|e| io_ctx("init", "accept on rendezvous".into(), e))?;
        let Some((conn, from)) = accepted else {
            let missing = missing_ranks(&conns, 1..world);
            notify_init_failed(&conns, waited, &missing);
            return Err(CommError::InitTimeout {
                waited,
                missing,
                world_size: world,
            });
        };
        let hs_deadline = deadline_after(HANDSHAKE_TIMEOUT)
            .min(deadline.max(Instant::now() + Duration::from_millis(200)));
        match read_hello(&conn, id, world, 1..world, hs_deadline) {
            Ok(hello) if conns[hello.rank].is_some() => {
                let reason = format!("rank {} already joined this communicator", hello.rank);
                warn!(%from, %reason, "rejecting rendezvous connection");
                reject(conn, &reason);
            }
            Ok(hello) => {
                debug!(rank = hello.rank, %from, "rank joined the rendezvous");
                addrs[hello.rank] = hello.addr;
                conns[hello.rank] = Some(conn);
            }
            Err(reason) => {
                warn!(%from, %reason, "rejecting rendezvous connection");
                reject(conn, &reason);
            }
        }
    }

    // 2. Everyone is here: send the peer table.
    let table = encode_peers(&addrs);
    for (r, c) in conns.iter().enumerate().skip(1) {
        if let Some(c) = c {
            write_frame(c, FRAME_PEERS, &table, deadline)
                .map_err(|e| init_peer_err(r, world, waited, "sending the peer table", e))?;
        }
    }

    // 3. Wait until every rank has built its mesh links, then release everyone.
    for r in 1..world {
        let Some(c) = &conns[r] else { continue };
        match read_frame(c, deadline) {
            Ok((FRAME_READY, _)) => {}
            Ok((kind, body)) => {
                return Err(CommError::Invalid {
                    op: "init",
                    reason: format!(
                        "rank {r} sent frame kind {kind} instead of ready: {}",
                        String::from_utf8_lossy(&body)
                    ),
                });
            }
            Err(e) if is_timeout(&e) => {
                let missing: Vec<usize> = (r..world).collect();
                notify_init_failed(&conns, waited, &missing);
                return Err(CommError::InitTimeout {
                    waited,
                    missing,
                    world_size: world,
                });
            }
            Err(e) => {
                return Err(CommError::PeerFailed {
                    peer: r,
                    op: "init",
                    reason: format!("while waiting for it to connect its peers: {e}"),
                });
            }
        }
    }
    for (r, c) in conns.iter().enumerate().skip(1) {
        if let Some(c) = c {
            write_frame(c, FRAME_GO, &[], deadline_after(Duration::from_secs(5)))
                .map_err(|e| init_peer_err(r, world, waited, "sending go", e))?;
        }
    }
    Ok(conns)
}

fn notify_init_failed(conns: &[Option<Conn>], waited: Duration, missing: &[usize]) {
    let body = encode_init_failed(waited, missing);
    let deadline = deadline_after(Duration::from_secs(1));
    for c in conns.iter().flatten() {
        let _ = write_frame(c, FRAME_INIT_FAILED, &body, deadline);
    }
}

pub(super) fn bootstrap_peer(
    id: &CommId,
    rank: usize,
    world: usize,
    opts: &SocketOptions,
) -> CommResult<Vec<Option<Conn>>> {
    let waited = opts.init_timeout;
    let deadline = deadline_after(opts.init_timeout);
    let verdict_deadline = deadline + VERDICT_GRACE;
    let mut conns: Vec<Option<Conn>> = (0..world).map(|_| None).collect();

    // 1. Join the rendezvous; bind our own mesh listener on the interface that reaches rank 0.
    let conn0 = connect_retry(&id.addr, 0, deadline)?;
    let (listener, my_addr) = match (&conn0, &id.addr) {
        (Conn::Tcp(s), _) => {
            let ip: IpAddr = s
                .local_addr()
                .map_err(|e| io_ctx("init", "local_addr".into(), e))?
                .ip();
            let l = TcpListener::bind((ip, 0))
                .map_err(|e| io_ctx("init", format!("bind mesh listener on {ip}"), e))?;
            let port = l
                .local_addr()
                .map_err(|e| io_ctx("init", "local_addr".into(), e))?
                .port();
            (
                Listener::Tcp(l),
                RendezvousAddr::Tcp {
                    host: ip.to_string(),
                    port,
                },
            )
        }
        (Conn::Unix(_), RendezvousAddr::Unix(path)) => {
            let mut p = path.as_os_str().to_owned();
            p.push(format!(".r{rank}"));
            let p = PathBuf::from(p);
            (Listener::bind_unix(&p, "init")?, RendezvousAddr::Unix(p))
        }
        (Conn::Unix(_), RendezvousAddr::Tcp { .. }) => {
            return Err(CommError::Invalid {
                op: "init",
                reason: "unix connection for a tcp address".into(),
            });
        }
    };
    let hello = encode_hello(&id.nonce, rank, world, &my_addr.to_wire());
    write_frame(&conn0, FRAME_HELLO, &hello, deadline)
        .map_err(|e| init_peer_err(0, world, waited, "sending hello to rank 0", e))?;
    let peers = match read_frame(&conn0, verdict_deadline) {
        Ok((FRAME_PEERS, body)) => {
            decode_peers(&body, world).map_err(|reason| CommError::Invalid {
                op: "init",
                reason: format!("bad peer table from rank 0: {reason}"),
            })?
        }
        Ok((FRAME_REJECT, body)) => {
            return Err(CommError::Invalid {
                op: "init",
                reason: format!(
                    "rank 0 rejected rank {rank}: {}",
                    String::from_utf8_lossy(&body)
                ),
            });
        }
        Ok((FRAME_INIT_FAILED, body)) => return Err(decode_init_failed(&body, world)),
        Ok((kind, _)) => {
            return Err(CommError::Invalid {
                op: "init",
                reason: format!("unexpected frame kind {kind} from rank 0"),
            });
        }
        Err(e) => {
            return Err(init_peer_err(
                0,
                world,
                waited,
                "waiting for the peer table from rank 0",
                e,
            ));
        }
    };
    conns[0] = Some(conn0);

    // 2. Connect to every lower non-zero rank...
    for (s, peer_addr) in peers.iter().enumerate().take(rank).skip(1) {
        let Some(peer_addr) = peer_addr else {
            return Err(CommError::Invalid {
                op: "init",
                reason: format!("peer table has no address for rank {s}"),
            });
        };
        let c = connect_retry(peer_addr, s, deadline)?;
        write_frame(&c, FRAME_HELLO, &hello, deadline)
            .map_err(|e| init_peer_err(s, world, waited, "sending hello", e))?;
        match read_frame(&c, deadline) {
            Ok((FRAME_ACCEPT, _)) => {}
            Ok((FRAME_REJECT, body)) => {
                return Err(CommError::Invalid {
                    op: "init",
                    reason: format!(
                        "rank {s} rejected rank {rank}: {}",
                        String::from_utf8_lossy(&body)
                    ),
                });
            }
            Ok((kind, _)) => {
                return Err(CommError::Invalid {
                    op: "init",
                    reason: format!("unexpected frame kind {kind} from rank {s}"),
                });
            }
            Err(e) => return Err(init_peer_err(s, world, waited, "waiting for accept", e)),
        }
        debug!(rank, peer = s, %peer_addr, "mesh link up");
        conns[s] = Some(c);
    }

    // 3. ...and accept every higher rank.
    listener
        .set_nonblocking(true)
        .map_err(|e| io_ctx("init", "set listener non-blocking".into(), e))?;
    while conns[rank + 1..].iter().any(Option::is_none) {
        let accepted = listener
            .accept_until(deadline)
            .map_err(|e| io_ctx("init", "accept on mesh listener".into(), e))?;
        let Some((conn, from)) = accepted else {
            return Err(CommError::InitTimeout {
                waited,
                missing: missing_ranks(&conns, rank + 1..world),
                world_size: world,
            });
        };
        let hs_deadline = deadline_after(HANDSHAKE_TIMEOUT)
            .min(deadline.max(Instant::now() + Duration::from_millis(200)));
        match read_hello(&conn, id, world, rank + 1..world, hs_deadline) {
            Ok(h) if conns[h.rank].is_some() => reject(
                conn,
                &format!("rank {} already connected to rank {rank}", h.rank),
            ),
            Ok(h) => {
                write_frame(&conn, FRAME_ACCEPT, &[], deadline)
                    .map_err(|e| init_peer_err(h.rank, world, waited, "sending accept", e))?;
                debug!(rank, peer = h.rank, %from, "mesh link up");
                conns[h.rank] = Some(conn);
            }
            Err(reason) => {
                warn!(%from, %reason, "rejecting mesh connection");
                reject(conn, &reason);
            }
        }
    }
    drop(listener);

    // 4. Report ready and wait for rank 0 to release the group.
    let Some(c0) = &conns[0] else {
        return Err(CommError::Invalid {
            op: "init",
            reason: "lost the rank 0 connection".into(),
        });
    };
    write_frame(c0, FRAME_READY, &[], deadline)
        .map_err(|e| init_peer_err(0, world, waited, "sending ready", e))?;
    match read_frame(c0, verdict_deadline) {
        Ok((FRAME_GO, _)) => Ok(conns),
        Ok((FRAME_INIT_FAILED, body)) => Err(decode_init_failed(&body, world)),
        Ok((kind, _)) => Err(CommError::Invalid {
            op: "init",
            reason: format!("unexpected frame kind {kind} from rank 0"),
        }),
        Err(e) => Err(init_peer_err(
            0,
            world,
            waited,
            "waiting for go from rank 0",
            e,
        )),
    }
}

/// Maps an I/O failure talking to `peer` during init to the error the caller should see.
fn init_peer_err(
    peer: usize,
    world: usize,
    waited: Duration,
    what: &str,
    e: io::Error,
) -> CommError {
    if is_timeout(&e) {
        CommError::InitTimeout {
            waited,
            missing: vec![peer],
            world_size: world,
        }
    } else {
        CommError::PeerFailed {
            peer,
            op: "init",
            reason: format!("{what}: {e}"),
        }
    }
}
