//! Bootstrap frames, `[u32 len = 1 + body.len()][u8 kind][body]` little-endian, and the bodies
//! the init protocol sends in them: hello, peer table, init-failed notice. Blocking I/O with a
//! deadline; the data path never uses these.

use std::io;
use std::time::{Duration, Instant};

use super::address::RendezvousAddr;
use super::conn::{Conn, deadline_after, remaining};
use super::id::{CommId, NONCE_LEN, hex_encode};
use crate::comm::CommError;

pub(super) const FRAME_HELLO: u8 = 1;
pub(super) const FRAME_REJECT: u8 = 2;
pub(super) const FRAME_PEERS: u8 = 3;
pub(super) const FRAME_ACCEPT: u8 = 4;
pub(super) const FRAME_READY: u8 = 5;
pub(super) const FRAME_GO: u8 = 6;
pub(super) const FRAME_INIT_FAILED: u8 = 7;
/// Largest frame accepted: a peer table for any real group fits many times over.
const MAX_FRAME: usize = 1 << 20;
/// First bytes of a hello; a connection from anything else is turned away at once.
const HELLO_MAGIC: &[u8; 4] = b"TPC1";

pub(super) fn write_frame(conn: &Conn, kind: u8, body: &[u8], deadline: Instant) -> io::Result<()> {
    let mut msg = Vec::with_capacity(5 + body.len());
    msg.extend_from_slice(&((1 + body.len()) as u32).to_le_bytes());
    msg.push(kind);
    msg.extend_from_slice(body);
    let mut off = 0;
    while off < msg.len() {
        let rem = remaining(deadline)
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "send timed out"))?;
        conn.set_timeouts(Some(rem))?;
        match conn.send_blocking(&msg[off..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "socket accepted no data",
                ));
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_exact_until(conn: &Conn, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let rem = remaining(deadline)
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "receive timed out"))?;
        conn.set_timeouts(Some(rem))?;
        match conn.recv_blocking(&mut buf[off..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn read_frame(conn: &Conn, deadline: Instant) -> io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    read_exact_until(conn, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad bootstrap frame length {len}"),
        ));
    }
    let mut body = vec![0u8; len];
    read_exact_until(conn, &mut body, deadline)?;
    let kind = body[0];
    body.remove(0);
    Ok((kind, body))
}

/// Best effort: tell a connecting client why it was turned away, then drop the connection.
pub(super) fn reject(conn: Conn, reason: &str) {
    let _ = write_frame(
        &conn,
        FRAME_REJECT,
        reason.as_bytes(),
        deadline_after(Duration::from_secs(1)),
    );
}

/// A rank introducing itself: which group (nonce), which rank of how many, and where its own
/// mesh listener is (empty for none).
pub(super) struct Hello {
    nonce: [u8; NONCE_LEN],
    pub(super) rank: usize,
    world: usize,
    pub(super) addr: Vec<u8>,
}

pub(super) fn encode_hello(nonce: &[u8; NONCE_LEN], rank: usize, world: usize, addr: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + NONCE_LEN + 8 + addr.len());
    v.extend_from_slice(HELLO_MAGIC);
    v.extend_from_slice(nonce);
    v.extend_from_slice(&(rank as u32).to_le_bytes());
    v.extend_from_slice(&(world as u32).to_le_bytes());
    v.extend_from_slice(addr);
    v
}

fn decode_hello(b: &[u8]) -> Result<Hello, String> {
    if b.len() < 4 + NONCE_LEN + 8 || &b[..4] != HELLO_MAGIC {
        return Err("not a tpcomm hello (wrong protocol or version)".into());
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&b[4..4 + NONCE_LEN]);
    let o = 4 + NONCE_LEN;
    let rank = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize;
    let world = u32::from_le_bytes([b[o + 4], b[o + 5], b[o + 6], b[o + 7]]) as usize;
    Ok(Hello {
        nonce,
        rank,
        world,
        addr: b[o + 8..].to_vec(),
    })
}

/// Reads and checks a hello on a freshly accepted connection. `Err` carries the reason to send
/// back in a REJECT frame.
pub(super) fn read_hello(
    conn: &Conn,
    id: &CommId,
    world: usize,
    allowed: std::ops::Range<usize>,
    deadline: Instant,
) -> Result<Hello, String> {
    let (kind, body) = read_frame(conn, deadline).map_err(|e| format!("no hello received: {e}"))?;
    if kind != FRAME_HELLO {
        return Err(format!("expected a hello frame, got frame kind {kind}"));
    }
    let hello = decode_hello(&body)?;
    if hello.nonce != id.nonce {
        return Err(format!(
            "nonce mismatch: this connection belongs to another communicator or an older epoch (expected {}, got {})",
            hex_encode(&id.nonce),
            hex_encode(&hello.nonce)
        ));
    }
    if hello.world != world {
        return Err(format!(
            "world size mismatch: rank {} says {}, this group has {world}",
            hello.rank, hello.world
        ));
    }
    if !allowed.contains(&hello.rank) {
        return Err(format!(
            "rank {} is not expected on this listener (expected {allowed:?}, world size {world})",
            hello.rank
        ));
    }
    Ok(hello)
}

pub(super) fn encode_peers(addrs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
    for a in addrs {
        v.extend_from_slice(&(a.len() as u32).to_le_bytes());
        v.extend_from_slice(a);
    }
    v
}

pub(super) fn decode_peers(b: &[u8], world: usize) -> Result<Vec<Option<RendezvousAddr>>, String> {
    let mut r = ByteReader(b);
    let n = r.u32()? as usize;
    if n != world {
        return Err(format!("peer table has {n} entries, expected {world}"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u32()? as usize;
        let a = r.take(len)?;
        out.push(if a.is_empty() {
            None
        } else {
            Some(RendezvousAddr::from_wire(a, false)?)
        });
    }
    Ok(out)
}

pub(super) fn encode_init_failed(waited: Duration, missing: &[usize]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(waited.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
    v.extend_from_slice(&(missing.len() as u32).to_le_bytes());
    for &m in missing {
        v.extend_from_slice(&(m as u32).to_le_bytes());
    }
    v
}

pub(super) fn decode_init_failed(b: &[u8], world: usize) -> CommError {
    let parse = || -> Result<(Duration, Vec<usize>), String> {
        let mut r = ByteReader(b);
        let waited = Duration::from_millis(r.u64()?);
        let n = r.u32()? as usize;
        let mut missing = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            missing.push(r.u32()? as usize);
        }
        Ok((waited, missing))
    };
    match parse() {
        Ok((waited, missing)) => CommError::InitTimeout {
            waited,
            missing,
            world_size: world,
        },
        Err(e) => CommError::Invalid {
            op: "init",
            reason: format!("garbled init-failed notice from rank 0: {e}"),
        },
    }
}

struct ByteReader<'a>(&'a [u8]);

impl<'a> ByteReader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated frame".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}
