//! CPU collective backend: a full mesh of TCP or Unix-domain stream sockets between the ranks of
//! one tensor-parallel group, one OS process per rank.
//!
//! Bootstrap mirrors NCCL: rank 0 calls [`create_comm_id`], which binds a rendezvous listener and
//! returns an opaque [`CommId`] (rendezvous address + random nonce) together with the bound
//! [`Rendezvous`]. The coordinator hands the id to every rank; every rank calls
//! [`SocketCollective::init`] (rank 0 passes its `Rendezvous` back in). The design, wire format
//! and failure semantics are described in `docs/collectives.md`.

use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use tracing::{debug, warn};

use super::{Collective, CommError, CommResult};

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Addresses and the communicator id
// ---------------------------------------------------------------------------------------------

/// Where a rendezvous (or a rank's mesh listener) lives.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RendezvousAddr {
    /// `host` is an IP literal (IPv6 without brackets) or a host name; `port` 0 means "pick one"
    /// when binding.
    Tcp { host: String, port: u16 },
    /// Path of a Unix-domain stream socket.
    Unix(PathBuf),
}

impl RendezvousAddr {
    pub fn tcp(host: impl Into<String>, port: u16) -> Self {
        Self::Tcp {
            host: host.into(),
            port,
        }
    }

    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Self::Unix(path.into())
    }

    /// Parses `tcp://HOST:PORT`, `unix://PATH` (or `unix:PATH`), a bare `HOST:PORT`
    /// (`[v6]:PORT` for IPv6) or a bare absolute path.
    pub fn parse(s: &str) -> CommResult<Self> {
        Self::from_wire(s.as_bytes(), true).map_err(|reason| CommError::Invalid {
            op: "parse_address",
            reason: format!("bad address {s:?}: {reason}"),
        })
    }

    /// Canonical byte form: `tcp://HOST:PORT` or `unix://PATH` (raw path bytes).
    fn to_wire(&self) -> Vec<u8> {
        match self {
            Self::Tcp { host, port } => {
                if host.contains(':') {
                    format!("tcp://[{host}]:{port}").into_bytes()
                } else {
                    format!("tcp://{host}:{port}").into_bytes()
                }
            }
            Self::Unix(path) => {
                let mut v = b"unix://".to_vec();
                v.extend_from_slice(path.as_os_str().as_bytes());
                v
            }
        }
    }

    /// Parses the canonical byte form; `lenient` also accepts bare `host:port`, bare paths and
    /// `unix:PATH`.
    fn from_wire(b: &[u8], lenient: bool) -> Result<Self, String> {
        if let Some(rest) = b.strip_prefix(b"tcp://") {
            let text =
                std::str::from_utf8(rest).map_err(|_| "tcp address is not UTF-8".to_string())?;
            let (host, port) = split_host_port(text)?;
            return Ok(Self::Tcp { host, port });
        }
        let path = if let Some(rest) = b.strip_prefix(b"unix://") {
            Some(rest)
        } else if lenient {
            b.strip_prefix(b"unix:")
                .or(if b.starts_with(b"/") { Some(b) } else { None })
        } else {
            None
        };
        if let Some(path) = path {
            if path.is_empty() {
                return Err("empty unix socket path".into());
            }
            if path.contains(&0) {
                return Err("unix socket path contains a NUL byte".into());
            }
            return Ok(Self::Unix(PathBuf::from(std::ffi::OsStr::from_bytes(path))));
        }
        if lenient {
            let text = std::str::from_utf8(b).map_err(|_| "address is not UTF-8".to_string())?;
            let (host, port) = split_host_port(text)?;
            return Ok(Self::Tcp { host, port });
        }
        Err("address must start with tcp:// or unix://".into())
    }
}

impl fmt::Display for RendezvousAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.to_wire()))
    }
}

impl FromStr for RendezvousAddr {
    type Err = CommError;
    fn from_str(s: &str) -> CommResult<Self> {
        Self::parse(s)
    }
}

fn split_host_port(s: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("unterminated '[' in {s:?}"))?;
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| format!("missing :PORT in {s:?}"))?;
        (host, port)
    } else {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("missing :PORT in {s:?}"))?;
        if host.contains(':') {
            return Err(format!("IPv6 host must be written in brackets: {s:?}"));
        }
        (host, port)
    };
    validate_host(host)?;
    let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
    Ok((host.to_string(), port))
}

fn validate_host(host: &str) -> Result<(), String> {
    if host.is_empty() {
        return Err("empty host".into());
    }
    if host.len() > 255 {
        return Err("host name too long".into());
    }
    if host
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, ';' | '/' | '[' | ']' | '@'))
    {
        return Err(format!("bad character in host {host:?}"));
    }
    Ok(())
}

const ID_PREFIX: &[u8] = b"tpcomm1;";
const NONCE_LEN: usize = 16;
const MAX_ID_LEN: usize = 4096;

/// Opaque communicator id: the rendezvous address of rank 0 plus a random nonce that names this
/// group incarnation (epoch). Text form: `tpcomm1;tcp://10.0.0.5:41234;<32 hex digits>` or
/// `tpcomm1;unix:///run/tp.sock;<32 hex digits>`. The nonce tells groups apart; it is not
/// authentication.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CommId {
    addr: RendezvousAddr,
    nonce: [u8; NONCE_LEN],
}

impl CommId {
    /// The bytes to ship to the other ranks (e.g. in a protobuf `bytes` field).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = ID_PREFIX.to_vec();
        v.extend_from_slice(&self.addr.to_wire());
        v.push(b';');
        v.extend_from_slice(hex_encode(&self.nonce).as_bytes());
        v
    }

    /// Parses [`CommId::to_bytes`] output. Anything else gives [`CommError::InvalidId`].
    pub fn from_bytes(bytes: &[u8]) -> CommResult<Self> {
        let bad =
            |reason: &str| CommError::InvalidId(format!("{reason} (got {:?})", preview(bytes)));
        if bytes.len() > MAX_ID_LEN {
            return Err(bad("id too long"));
        }
        let rest = bytes
            .strip_prefix(ID_PREFIX)
            .ok_or_else(|| bad("missing 'tpcomm1;' prefix"))?;
        let split = rest
            .iter()
            .rposition(|&b| b == b';')
            .ok_or_else(|| bad("missing ';<nonce>'"))?;
        let (addr, nonce) = (&rest[..split], &rest[split + 1..]);
        let nonce = hex_decode_nonce(nonce).ok_or_else(|| bad("nonce must be 32 hex digits"))?;
        let addr = RendezvousAddr::from_wire(addr, false).map_err(|r| bad(&r))?;
        if let RendezvousAddr::Tcp { port: 0, .. } = addr {
            return Err(bad("tcp port 0 in a communicator id"));
        }
        Ok(Self { addr, nonce })
    }

    /// Rank 0's rendezvous address.
    pub fn addr(&self) -> &RendezvousAddr {
        &self.addr
    }

    /// The nonce in hex (for logs).
    pub fn nonce_hex(&self) -> String {
        hex_encode(&self.nonce)
    }
}

impl fmt::Display for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.to_bytes()))
    }
}

impl fmt::Debug for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommId({self})")
    }
}

impl FromStr for CommId {
    type Err = CommError;
    fn from_str(s: &str) -> CommResult<Self> {
        Self::from_bytes(s.as_bytes())
    }
}

fn preview(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(80)]).into_owned();
    if b.len() > 80 { format!("{s}...") } else { s }
}

fn hex_encode(b: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(HEX[(x >> 4) as usize] as char);
        s.push(HEX[(x & 15) as usize] as char);
    }
    s
}

fn hex_decode_nonce(s: &[u8]) -> Option<[u8; NONCE_LEN]> {
    if s.len() != NONCE_LEN * 2 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; NONCE_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(s[2 * i])? << 4) | digit(s[2 * i + 1])?;
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Listeners, connections
// ---------------------------------------------------------------------------------------------

enum Listener {
    Tcp(TcpListener),
    /// `ident` is the (device, inode) of the socket file we created, so that dropping removes
    /// only our own file, never a newer one bound at the same path.
    Unix {
        listener: UnixListener,
        path: PathBuf,
        ident: (u64, u64),
    },
}

impl Listener {
    fn bind_unix(path: &Path, op: &'static str) -> CommResult<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                debug!(path = %path.display(), "removing stale unix socket");
                std::fs::remove_file(path).map_err(|e| {
                    io_ctx(op, format!("remove stale socket {}", path.display()), e)
                })?;
            }
            Ok(_) => {
                return Err(CommError::Invalid {
                    op,
                    reason: format!(
                        "{} exists and is not a socket; refusing to replace it",
                        path.display()
                    ),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_ctx(op, format!("stat {}", path.display()), e)),
        }
        let listener = UnixListener::bind(path)
            .map_err(|e| io_ctx(op, format!("bind unix socket {}", path.display()), e))?;
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| io_ctx(op, format!("stat {}", path.display()), e))?;
        Ok(Self::Unix {
            listener,
            path: path.to_path_buf(),
            ident: (meta.dev(), meta.ino()),
        })
    }

    fn fd(&self) -> RawFd {
        match self {
            Self::Tcp(l) => l.as_raw_fd(),
            Self::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }

    fn set_nonblocking(&self, nb: bool) -> io::Result<()> {
        match self {
            Self::Tcp(l) => l.set_nonblocking(nb),
            Self::Unix { listener, .. } => listener.set_nonblocking(nb),
        }
    }

    fn accept(&self) -> io::Result<(Conn, String)> {
        match self {
            Self::Tcp(l) => {
                let (s, peer) = l.accept()?;
                Ok((Conn::tcp(s)?, peer.to_string()))
            }
            Self::Unix { listener, path, .. } => {
                let (s, _) = listener.accept()?;
                s.set_nonblocking(false)?;
                Ok((Conn::Unix(s), format!("unix peer on {}", path.display())))
            }
        }
    }

    /// Waits for one connection until `deadline`; `Ok(None)` on timeout.
    fn accept_until(&self, deadline: Instant) -> io::Result<Option<(Conn, String)>> {
        loop {
            match self.accept() {
                Ok(c) => return Ok(Some(c)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let Some(rem) = remaining(deadline) else {
                        return Ok(None);
                    };
                    poll_one(self.fd(), libc::POLLIN, rem)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The client gave up between SYN and accept; not our problem.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                    ) =>
                {
                    debug!(error = %e, "ignoring aborted incoming connection");
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix { path, ident, .. } = self
            && let Ok(meta) = std::fs::symlink_metadata(&*path)
            && (meta.dev(), meta.ino()) == *ident
        {
            let _ = std::fs::remove_file(&*path);
        }
    }
}

enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn tcp(s: TcpStream) -> io::Result<Self> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        Ok(Self::Tcp(s))
    }

    fn fd(&self) -> RawFd {
        match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(Shutdown::Both),
            Self::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Self::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }

    /// Blocking send honoring SO_SNDTIMEO; never raises SIGPIPE.
    fn send_blocking(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: buf is a valid readable slice for its whole length.
        let n = unsafe {
            libc::send(
                self.fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Blocking recv honoring SO_RCVTIMEO.
    fn recv_blocking(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is a valid writable slice for its whole length.
        let n = unsafe { libc::recv(self.fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

fn connect_once(addr: &RendezvousAddr, timeout: Duration) -> io::Result<Conn> {
    match addr {
        RendezvousAddr::Tcp { host, port } => {
            let mut last = io::Error::new(
                io::ErrorKind::NotFound,
                format!("{host} resolved to no address"),
            );
            for sa in (host.as_str(), *port).to_socket_addrs()? {
                match TcpStream::connect_timeout(&sa, timeout) {
                    Ok(s) => return Conn::tcp(s),
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
        RendezvousAddr::Unix(path) => Ok(Conn::Unix(UnixStream::connect(path)?)),
    }
}

/// Connects to `peer` at `addr`, retrying (the peer may not be listening yet) until `deadline`.
fn connect_retry(addr: &RendezvousAddr, peer: usize, deadline: Instant) -> CommResult<Conn> {
    let mut backoff = Duration::from_millis(10);
    let mut last_err: Option<io::Error> = None;
    loop {
        let Some(rem) = remaining(deadline) else {
            let why = last_err.map_or_else(|| "no attempt finished".to_string(), |e| e.to_string());
            return Err(CommError::PeerFailed {
                peer,
                op: "init",
                reason: format!(
                    "could not connect to rank {peer} at {addr} before the init deadline: {why}"
                ),
            });
        };
        match connect_once(addr, rem.min(Duration::from_secs(10))) {
            Ok(c) => {
                debug!(peer, %addr, "connected");
                return Ok(c);
            }
            Err(e) => {
                debug!(peer, %addr, error = %e, "connect failed; retrying");
                last_err = Some(e);
                std::thread::sleep(backoff.min(rem));
                backoff = (backoff * 2).min(Duration::from_millis(250));
            }
        }
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let now = Instant::now();
    if now >= deadline {
        None
    } else {
        Some((deadline - now).max(Duration::from_millis(1)))
    }
}

fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

fn timeout_ms(d: Duration) -> libc::c_int {
    // Round up so that we never spin on a zero-timeout poll.
    let ms = d.as_nanos().div_ceil(1_000_000);
    ms.min(libc::c_int::MAX as u128) as libc::c_int
}

/// Waits until `fd` is ready for `events` or `timeout` passes. Returns whether it is ready.
fn poll_one(fd: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms(timeout)) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        }
    } else {
        Ok(rc > 0)
    }
}

fn io_ctx(op: &'static str, what: String, e: io::Error) -> CommError {
    CommError::Io {
        op,
        source: io::Error::new(e.kind(), format!("{what}: {e}")),
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

// ---------------------------------------------------------------------------------------------
// Bootstrap frames: [u32 len = 1 + body.len()][u8 kind][body], little-endian.
// ---------------------------------------------------------------------------------------------

const FRAME_HELLO: u8 = 1;
const FRAME_REJECT: u8 = 2;
const FRAME_PEERS: u8 = 3;
const FRAME_ACCEPT: u8 = 4;
const FRAME_READY: u8 = 5;
const FRAME_GO: u8 = 6;
const FRAME_INIT_FAILED: u8 = 7;
const MAX_FRAME: usize = 1 << 20;
const HELLO_MAGIC: &[u8; 4] = b"TPC1";
/// How long one unauthenticated incoming connection may take to say hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Non-root ranks wait this much past their own deadline for rank 0's verdict, so that they
/// report which ranks were missing rather than a bare timeout.
const VERDICT_GRACE: Duration = Duration::from_secs(2);

fn write_frame(conn: &Conn, kind: u8, body: &[u8], deadline: Instant) -> io::Result<()> {
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

fn read_frame(conn: &Conn, deadline: Instant) -> io::Result<(u8, Vec<u8>)> {
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
fn reject(conn: Conn, reason: &str) {
    let _ = write_frame(
        &conn,
        FRAME_REJECT,
        reason.as_bytes(),
        deadline_after(Duration::from_secs(1)),
    );
}

struct Hello {
    nonce: [u8; NONCE_LEN],
    rank: usize,
    world: usize,
    addr: Vec<u8>,
}

fn encode_hello(nonce: &[u8; NONCE_LEN], rank: usize, world: usize, addr: &[u8]) -> Vec<u8> {
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
fn read_hello(
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

fn encode_peers(addrs: &[Vec<u8>]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
    for a in addrs {
        v.extend_from_slice(&(a.len() as u32).to_le_bytes());
        v.extend_from_slice(a);
    }
    v
}

fn decode_peers(b: &[u8], world: usize) -> Result<Vec<Option<RendezvousAddr>>, String> {
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

fn encode_init_failed(waited: Duration, missing: &[usize]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(waited.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
    v.extend_from_slice(&(missing.len() as u32).to_le_bytes());
    for &m in missing {
        v.extend_from_slice(&(m as u32).to_le_bytes());
    }
    v
}

fn decode_init_failed(b: &[u8], world: usize) -> CommError {
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

// ---------------------------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------------------------

/// Rank 0's bound rendezvous listener. Keep it alive from [`create_comm_id`] until it is handed
/// to [`SocketCollective::init`]; ranks that connect in the meantime wait in the kernel backlog.
/// Dropping it closes the listener (and removes the Unix socket file).
pub struct Rendezvous {
    id: CommId,
    listener: Listener,
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

// ---------------------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------------------

fn missing_ranks(conns: &[Option<Conn>], range: std::ops::Range<usize>) -> Vec<usize> {
    range
        .filter(|&r| conns.get(r).is_none_or(Option::is_none))
        .collect()
}

fn bootstrap_root(
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

fn bootstrap_peer(
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

// ---------------------------------------------------------------------------------------------
// Data-path wire format
// ---------------------------------------------------------------------------------------------

const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"TPCM");
const HDR_LEN: usize = 96;
const MAX_DIMS: usize = 8;
const STAGE_LEN: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum OpCode {
    AllReduce = 1,
    AllGather = 2,
    Gather = 3,
    Broadcast = 4,
    Barrier = 5,
}

impl OpCode {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "all_reduce_sum",
            2 => "all_gather",
            3 => "gather",
            4 => "broadcast",
            5 => "barrier",
            _ => "unknown",
        }
    }
}

/// Fixed 96-byte little-endian header in front of every payload:
/// `magic u32 | op u8 | dtype u8 | ndims u8 | 0 u8 | seq u64 | param u64 | payload_len u64 |
/// dims [u64; 8]`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct WireHeader {
    op: u8,
    dtype: u8,
    ndims: u8,
    seq: u64,
    param: u64,
    payload_len: u64,
    dims: [u64; MAX_DIMS],
}

impl WireHeader {
    fn new(
        op: OpCode,
        dtype: u8,
        dims: &[usize],
        seq: u64,
        param: u64,
        payload_len: usize,
    ) -> Self {
        let mut d = [0u64; MAX_DIMS];
        for (o, &x) in d.iter_mut().zip(dims) {
            *o = x as u64;
        }
        Self {
            op: op as u8,
            dtype,
            ndims: dims.len() as u8,
            seq,
            param,
            payload_len: payload_len as u64,
            dims: d,
        }
    }

    fn encode(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..4].copy_from_slice(&WIRE_MAGIC.to_le_bytes());
        b[4] = self.op;
        b[5] = self.dtype;
        b[6] = self.ndims;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.param.to_le_bytes());
        b[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        for (i, d) in self.dims.iter().enumerate() {
            b[32 + 8 * i..40 + 8 * i].copy_from_slice(&d.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8; HDR_LEN]) -> Result<Self, String> {
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != WIRE_MAGIC {
            return Err("bad magic (stream out of sync)".into());
        }
        if b[6] as usize > MAX_DIMS {
            return Err(format!("{} dims", b[6]));
        }
        let mut dims = [0u64; MAX_DIMS];
        for (i, d) in dims.iter_mut().enumerate() {
            *d = u64_at(32 + 8 * i);
        }
        Ok(Self {
            op: b[4],
            dtype: b[5],
            ndims: b[6],
            seq: u64_at(8),
            param: u64_at(16),
            payload_len: u64_at(24),
            dims,
        })
    }

    fn dims(&self) -> &[u64] {
        &self.dims[..self.ndims as usize]
    }
}

fn dtype_code(dtype: DType) -> Option<u8> {
    Some(match dtype {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::BF16 => 6,
        DType::F16 => 7,
        DType::F32 => 8,
        DType::F64 => 9,
        _ => return None,
    })
}

fn code_dtype(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::U8,
        2 => DType::U32,
        3 => DType::I16,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::BF16,
        7 => DType::F16,
        8 => DType::F32,
        9 => DType::F64,
        _ => return None,
    })
}

/// Plain-old-data element types whose every bit pattern is valid.
trait Pod: Copy + 'static {}
impl Pod for u8 {}
impl Pod for u32 {}
impl Pod for i16 {}
impl Pod for i32 {}
impl Pod for i64 {}
impl Pod for bf16 {}
impl Pod for f16 {}
impl Pod for f32 {}
impl Pod for f64 {}

/// 16-bit floats that are summed by widening to f32. `widen`/`narrow` take equal-length slices.
trait Half16: Pod + Default {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half16 for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half16 for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

fn as_bytes<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is plain old data without padding; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid T, so writes through the view are fine.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn cast_slice<'a, T: Pod>(op: &'static str, b: &'a [u8]) -> CommResult<&'a [T]> {
    // SAFETY: every bit pattern is a valid T; alignment and length are checked below.
    let (pre, mid, post) = unsafe { b.align_to::<T>() };
    if !pre.is_empty() || !post.is_empty() {
        return Err(CommError::Invalid {
            op,
            reason: "misaligned or truncated buffer".into(),
        });
    }
    Ok(mid)
}

/// An owned, typed host buffer that becomes a tensor without a copy.
enum Buf {
    U8(Vec<u8>),
    U32(Vec<u32>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

macro_rules! buf_dispatch {
    ($self:expr, $v:ident => $e:expr) => {
        match $self {
            Buf::U8($v) => $e,
            Buf::U32($v) => $e,
            Buf::I16($v) => $e,
            Buf::I32($v) => $e,
            Buf::I64($v) => $e,
            Buf::BF16($v) => $e,
            Buf::F16($v) => $e,
            Buf::F32($v) => $e,
            Buf::F64($v) => $e,
        }
    };
}

fn zeroed_vec<T: Pod>(op: &'static str, n: usize, zero: T) -> CommResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| CommError::Invalid {
        op,
        reason: format!("cannot allocate {n} elements: {e}"),
    })?;
    v.resize(n, zero);
    Ok(v)
}

impl Buf {
    fn zeroed(op: &'static str, dtype: DType, n: usize) -> CommResult<Self> {
        Ok(match dtype {
            DType::U8 => Self::U8(zeroed_vec(op, n, 0)?),
            DType::U32 => Self::U32(zeroed_vec(op, n, 0)?),
            DType::I16 => Self::I16(zeroed_vec(op, n, 0)?),
            DType::I32 => Self::I32(zeroed_vec(op, n, 0)?),
            DType::I64 => Self::I64(zeroed_vec(op, n, 0)?),
            DType::BF16 => Self::BF16(zeroed_vec(op, n, bf16::ZERO)?),
            DType::F16 => Self::F16(zeroed_vec(op, n, f16::ZERO)?),
            DType::F32 => Self::F32(zeroed_vec(op, n, 0.0)?),
            DType::F64 => Self::F64(zeroed_vec(op, n, 0.0)?),
            other => {
                return Err(CommError::Invalid {
                    op,
                    reason: format!("unsupported dtype {other:?}"),
                });
            }
        })
    }

    fn bytes(&self) -> &[u8] {
        buf_dispatch!(self, v => as_bytes(v.as_slice()))
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        buf_dispatch!(self, v => as_bytes_mut(v.as_mut_slice()))
    }

    fn into_tensor(self, dims: &[usize]) -> CommResult<Tensor> {
        let dims = dims.to_vec();
        Ok(buf_dispatch!(self, v => Tensor::from_vec(v, dims, &Device::Cpu)?))
    }
}

/// The contiguous bytes of a CPU tensor's storage.
fn cpu_bytes<'a>(op: &'static str, storage: &'a Storage, layout: &Layout) -> CommResult<&'a [u8]> {
    let Storage::Cpu(cpu) = storage else {
        return Err(CommError::Invalid {
            op,
            reason: "tensor is not on the CPU".into(),
        });
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| CommError::Invalid {
            op,
            reason: "tensor is not contiguous".into(),
        })?;
    macro_rules! view {
        ($v:expr) => {
            $v.get(start..end).map(as_bytes)
        };
    }
    let bytes = match cpu {
        CpuStorage::U8(v) => view!(v),
        CpuStorage::U32(v) => view!(v),
        CpuStorage::I16(v) => view!(v),
        CpuStorage::I32(v) => view!(v),
        CpuStorage::I64(v) => view!(v),
        CpuStorage::BF16(v) => view!(v),
        CpuStorage::F16(v) => view!(v),
        CpuStorage::F32(v) => view!(v),
        CpuStorage::F64(v) => view!(v),
        _ => {
            return Err(CommError::Invalid {
                op,
                reason: "unsupported dtype".into(),
            });
        }
    };
    bytes.ok_or_else(|| CommError::Invalid {
        op,
        reason: "tensor layout is out of its storage's bounds".into(),
    })
}

/// Sum of `parts` (one per rank, in rank order), accumulated left to right so that every rank
/// computes bit-identical results. Half types accumulate in f32 and round once at the end.
fn reduce_sum(op: &'static str, dtype: DType, parts: &[&[u8]]) -> CommResult<Buf> {
    let Some(first) = parts.first() else {
        return Err(CommError::Invalid {
            op,
            reason: "nothing to reduce".into(),
        });
    };
    if parts.iter().any(|p| p.len() != first.len()) {
        return Err(CommError::Invalid {
            op,
            reason: "buffers of different sizes".into(),
        });
    }
    fn typed<'a, T: Pod>(op: &'static str, parts: &[&'a [u8]]) -> CommResult<Vec<&'a [T]>> {
        parts.iter().map(|p| cast_slice::<T>(op, p)).collect()
    }
    fn native<T: Pod>(parts: &[&[T]], add: impl Fn(T, T) -> T) -> Vec<T> {
        let mut acc = parts[0].to_vec();
        for p in &parts[1..] {
            for (a, &b) in acc.iter_mut().zip(p.iter()) {
                *a = add(*a, b);
            }
        }
        acc
    }
    /// Accumulates in f32 a chunk at a time, using half's bulk (SIMD where available)
    /// conversions; the f32 adds run in rank order, so every rank gets the same bits.
    fn via_f32<T: Half16>(parts: &[&[T]]) -> Vec<T> {
        const CHUNK: usize = 4096;
        let n = parts[0].len();
        let mut out = Vec::with_capacity(n);
        let mut acc = [0f32; CHUNK];
        let mut tmp = [0f32; CHUNK];
        let mut narrow = [T::default(); CHUNK];
        let mut start = 0;
        while start < n {
            let end = (start + CHUNK).min(n);
            let len = end - start;
            let (acc, tmp, narrow) = (&mut acc[..len], &mut tmp[..len], &mut narrow[..len]);
            T::widen(&parts[0][start..end], acc);
            for p in &parts[1..] {
                T::widen(&p[start..end], tmp);
                for (a, &x) in acc.iter_mut().zip(tmp.iter()) {
                    *a += x;
                }
            }
            T::narrow(acc, narrow);
            out.extend_from_slice(narrow);
            start = end;
        }
        out
    }
    Ok(match dtype {
        DType::F32 => Buf::F32(native(&typed::<f32>(op, parts)?, |a, b| a + b)),
        DType::F64 => Buf::F64(native(&typed::<f64>(op, parts)?, |a, b| a + b)),
        DType::BF16 => Buf::BF16(via_f32(&typed::<bf16>(op, parts)?)),
        DType::F16 => Buf::F16(via_f32(&typed::<f16>(op, parts)?)),
        DType::U8 => Buf::U8(native(&typed::<u8>(op, parts)?, u8::wrapping_add)),
        DType::U32 => Buf::U32(native(&typed::<u32>(op, parts)?, u32::wrapping_add)),
        DType::I16 => Buf::I16(native(&typed::<i16>(op, parts)?, i16::wrapping_add)),
        DType::I32 => Buf::I32(native(&typed::<i32>(op, parts)?, i32::wrapping_add)),
        DType::I64 => Buf::I64(native(&typed::<i64>(op, parts)?, i64::wrapping_add)),
        other => {
            return Err(CommError::Invalid {
                op,
                reason: format!("cannot sum dtype {other:?}"),
            });
        }
    })
}

/// Concatenates row-major chunks (one per rank, in rank order) along `dim`.
fn concat(
    op: &'static str,
    dtype: DType,
    parts: &[(&[u8], Vec<usize>)],
    dim: usize,
) -> CommResult<(Buf, Vec<usize>)> {
    let Some((_, first_dims)) = parts.first() else {
        return Err(CommError::Invalid {
            op,
            reason: "nothing to gather".into(),
        });
    };
    let es = dtype.size_in_bytes();
    let mut out_dims = first_dims.clone();
    out_dims[dim] = parts.iter().map(|(_, d)| d[dim]).sum();
    let outer: usize = first_dims[..dim].iter().product();
    let total: usize = out_dims.iter().product();
    let mut out = Buf::zeroed(op, dtype, total)?;
    let dst = out.bytes_mut();
    let mut pos = 0;
    for o in 0..outer {
        for (bytes, dims) in parts {
            let inner = dims[dim..].iter().product::<usize>() * es;
            let src = bytes
                .get(o * inner..(o + 1) * inner)
                .ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "chunk shorter than its shape".into(),
                })?;
            let d = dst
                .get_mut(pos..pos + inner)
                .ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "gathered chunks overflow the output".into(),
                })?;
            d.copy_from_slice(src);
            pos += inner;
        }
    }
    Ok((out, out_dims))
}

// ---------------------------------------------------------------------------------------------
// The transfer engine: non-blocking sends/receives on many sockets, driven by poll(2).
// ---------------------------------------------------------------------------------------------

struct SendJob<'a> {
    peer: usize,
    hdr: [u8; HDR_LEN],
    payload: &'a [u8],
    sent: usize,
}

impl SendJob<'_> {
    fn done(&self) -> bool {
        self.sent >= HDR_LEN + self.payload.len()
    }
}

struct RecvJob {
    peer: usize,
    hdr: [u8; HDR_LEN],
    hdr_got: usize,
    header: Option<WireHeader>,
    data: Option<Buf>,
    got: usize,
    done: bool,
}

impl RecvJob {
    fn new(peer: usize) -> Self {
        Self {
            peer,
            hdr: [0; HDR_LEN],
            hdr_got: 0,
            header: None,
            data: None,
            got: 0,
            done: false,
        }
    }
}

/// Per-peer receive staging buffer: a small message (header + payload, and possibly the start of
/// the next one) arrives with a single recv(2).
struct RxStage {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

struct OpState {
    seq: u64,
    stages: Vec<RxStage>,
}

/// What the receiving side checks every incoming header against.
struct Expect<'a> {
    op: OpCode,
    seq: u64,
    param: u64,
    dtype: u8,
    dims: &'a [usize],
    /// `Some(d)`: dims must match except `d` (gathers); `None`: exact match.
    free_dim: Option<usize>,
}

impl Expect<'_> {
    fn check(
        &self,
        op: &'static str,
        me: usize,
        peer: usize,
        h: &WireHeader,
    ) -> CommResult<Option<(DType, Vec<usize>)>> {
        let invalid = |reason: String| CommError::Invalid { op, reason };
        if h.op != self.op as u8 {
            return Err(invalid(format!(
                "rank {peer} called {} while rank {me} called {op} (collectives out of order)",
                OpCode::name(h.op)
            )));
        }
        if h.seq != self.seq {
            return Err(invalid(format!(
                "rank {peer} is at collective #{} but rank {me} is at #{} (ranks out of step)",
                h.seq, self.seq
            )));
        }
        if h.param != self.param {
            let what = match self.op {
                OpCode::Broadcast => "root",
                OpCode::Gather => "dim/root",
                _ => "dim",
            };
            return Err(invalid(format!(
                "rank {peer} passed a different {what} than rank {me}"
            )));
        }
        if h.dtype != self.dtype {
            let name =
                |c: u8| code_dtype(c).map_or_else(|| format!("code {c}"), |d| format!("{d:?}"));
            return Err(invalid(format!(
                "dtype mismatch: rank {peer} sent {} but rank {me} has {}",
                name(h.dtype),
                name(self.dtype)
            )));
        }
        if self.op == OpCode::Barrier {
            if h.payload_len != 0 {
                return Err(invalid(format!(
                    "rank {peer} sent a barrier with a payload"
                )));
            }
            return Ok(None);
        }
        let peer_dims = h.dims();
        let same = peer_dims.len() == self.dims.len()
            && peer_dims
                .iter()
                .zip(self.dims)
                .enumerate()
                .all(|(i, (&a, &b))| Some(i) == self.free_dim || a == b as u64);
        if !same {
            return Err(invalid(format!(
                "shape mismatch: rank {peer} sent {peer_dims:?} but rank {me} has {:?}",
                self.dims
            )));
        }
        let dtype = code_dtype(h.dtype)
            .ok_or_else(|| invalid(format!("unknown dtype code {}", h.dtype)))?;
        let dims: Vec<usize> = peer_dims
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| {
                invalid(format!(
                    "rank {peer} sent an impossible shape {peer_dims:?}"
                ))
            })?;
        let bytes = dims
            .iter()
            .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                invalid(format!(
                    "rank {peer} sent an impossible shape {peer_dims:?}"
                ))
            })?;
        if h.payload_len != bytes as u64 {
            return Err(invalid(format!(
                "rank {peer} sent {} payload bytes for shape {dims:?}",
                h.payload_len
            )));
        }
        Ok(Some((dtype, dims)))
    }
}

/// Outcome of one non-blocking send/recv call.
enum Sys {
    Done(usize),
    WouldBlock,
    Interrupted,
}

fn sys_result(n: isize) -> io::Result<Sys> {
    if n >= 0 {
        return Ok(Sys::Done(n as usize));
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock => Ok(Sys::WouldBlock),
        io::ErrorKind::Interrupted => Ok(Sys::Interrupted),
        _ => Err(e),
    }
}

fn recv_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is a valid writable slice for its whole length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        match sys_result(n)? {
            Sys::Done(n) => return Ok(Some(n)),
            Sys::WouldBlock => return Ok(None),
            Sys::Interrupted => {}
        }
    }
}

fn sendv_nb(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<Option<usize>> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    let cnt = if a.is_empty() { 0 } else { 1 } + if b.is_empty() { 0 } else { 1 };
    let first = if a.is_empty() { 1 } else { 0 };
    loop {
        // SAFETY: msghdr is plain data; zeroed is a valid "no address, no control" message.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[first..].as_mut_ptr();
        msg.msg_iovlen = cnt as _;
        // SAFETY: the iovecs point into live slices that sendmsg only reads.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        match sys_result(n)? {
            Sys::Done(n) => return Ok(Some(n)),
            Sys::WouldBlock => return Ok(None),
            Sys::Interrupted => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SocketCollective
// ---------------------------------------------------------------------------------------------

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
        let stages = (0..world_size)
            .map(|r| RxStage {
                buf: if r == rank {
                    Vec::new()
                } else {
                    vec![0u8; STAGE_LEN]
                },
                start: 0,
                end: 0,
            })
            .collect();
        debug!(rank, world_size, id = %id, "communicator ready");
        Ok(Self {
            rank,
            world_size,
            peers,
            state: Mutex::new(OpState { seq: 0, stages }),
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

    fn peer_io(&self, op: &'static str, peer: usize, what: &str, e: io::Error) -> CommError {
        match e.raw_os_error() {
            Some(libc::ECONNRESET | libc::EPIPE | libc::ENOTCONN | libc::ECONNABORTED) => {
                CommError::PeerFailed {
                    peer,
                    op,
                    reason: format!("{what} rank {peer}: {e}"),
                }
            }
            _ => CommError::Io {
                op,
                source: io::Error::new(e.kind(), format!("{what} rank {peer}: {e}")),
            },
        }
    }

    fn progress_send(&self, op: &'static str, job: &mut SendJob<'_>) -> CommResult<bool> {
        let fd = self.conn(op, job.peer)?.fd();
        let mut progressed = false;
        while !job.done() {
            let (a, b) = if job.sent < HDR_LEN {
                (&job.hdr[job.sent..], job.payload)
            } else {
                (&[][..], &job.payload[job.sent - HDR_LEN..])
            };
            match sendv_nb(fd, a, b).map_err(|e| self.peer_io(op, job.peer, "sending to", e))? {
                Some(n) => {
                    job.sent += n;
                    progressed = true;
                }
                None => break,
            }
        }
        Ok(progressed)
    }

    fn progress_recv(
        &self,
        op: &'static str,
        job: &mut RecvJob,
        stage: &mut RxStage,
        expect: &Expect<'_>,
    ) -> CommResult<bool> {
        let fd = self.conn(op, job.peer)?.fd();
        let peer = job.peer;
        let eof = || CommError::PeerFailed {
            peer,
            op,
            reason: format!(
                "rank {peer} closed the connection (it exited, aborted, or hit an error)"
            ),
        };
        let mut progressed = false;
        while job.header.is_none() {
            let avail = stage.end - stage.start;
            let take = avail.min(HDR_LEN - job.hdr_got);
            job.hdr[job.hdr_got..job.hdr_got + take]
                .copy_from_slice(&stage.buf[stage.start..stage.start + take]);
            job.hdr_got += take;
            stage.start += take;
            if job.hdr_got == HDR_LEN {
                let h = WireHeader::decode(&job.hdr).map_err(|r| CommError::Invalid {
                    op,
                    reason: format!("garbled header from rank {peer}: {r}"),
                })?;
                if let Some((dtype, dims)) = expect.check(op, self.rank, peer, &h)? {
                    job.data = Some(Buf::zeroed(op, dtype, dims.iter().product())?);
                }
                job.header = Some(h);
                break;
            }
            // The stage is drained: refill it.
            stage.start = 0;
            stage.end = 0;
            match recv_nb(fd, &mut stage.buf)
                .map_err(|e| self.peer_io(op, peer, "receiving from", e))?
            {
                Some(0) => return Err(eof()),
                Some(n) => {
                    stage.end = n;
                    progressed = true;
                }
                None => return Ok(progressed),
            }
        }
        if let Some(data) = job.data.as_mut() {
            let dst = data.bytes_mut();
            let avail = stage.end - stage.start;
            let take = avail.min(dst.len() - job.got);
            dst[job.got..job.got + take]
                .copy_from_slice(&stage.buf[stage.start..stage.start + take]);
            job.got += take;
            stage.start += take;
            while job.got < dst.len() {
                match recv_nb(fd, &mut dst[job.got..])
                    .map_err(|e| self.peer_io(op, peer, "receiving from", e))?
                {
                    Some(0) => return Err(eof()),
                    Some(n) => {
                        job.got += n;
                        progressed = true;
                    }
                    None => return Ok(progressed),
                }
            }
        }
        job.done = true;
        Ok(true)
    }

    /// Moves every send and receive to completion. Fails on a peer error, on abort, or when no
    /// byte moved on any socket for `op_timeout`.
    fn exchange(
        &self,
        op: &'static str,
        stages: &mut [RxStage],
        sends: &mut [SendJob<'_>],
        recvs: &mut [RecvJob],
        expect: &Expect<'_>,
    ) -> CommResult<()> {
        let mut last_progress = Instant::now();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.world_size + 1);
        let mut events: Vec<libc::c_short> = vec![0; self.world_size];
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted);
            }
            let mut progressed = false;
            for job in sends.iter_mut().filter(|j| !j.done()) {
                progressed |= self.progress_send(op, job)?;
            }
            for job in recvs.iter_mut().filter(|j| !j.done) {
                let stage = stages.get_mut(job.peer).ok_or_else(|| CommError::Invalid {
                    op,
                    reason: format!("no receive stage for rank {}", job.peer),
                })?;
                progressed |= self.progress_recv(op, job, stage, expect)?;
            }
            let pending_recv = recvs.iter().find(|j| !j.done).map(|j| j.peer);
            let pending_send = sends.iter().find(|j| !j.done()).map(|j| j.peer);
            let Some(blocking_peer) = pending_recv.or(pending_send) else {
                return Ok(());
            };
            if progressed {
                last_progress = Instant::now();
            }
            let idle = last_progress.elapsed();
            if idle >= self.op_timeout {
                return Err(CommError::Timeout {
                    op,
                    peer: blocking_peer,
                    waited: idle,
                });
            }

            events.iter_mut().for_each(|e| *e = 0);
            for j in sends.iter().filter(|j| !j.done()) {
                events[j.peer] |= libc::POLLOUT;
            }
            for j in recvs.iter().filter(|j| !j.done) {
                events[j.peer] |= libc::POLLIN;
            }
            fds.clear();
            fds.push(libc::pollfd {
                fd: self.wake_rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for (peer, &ev) in events.iter().enumerate() {
                if ev != 0 {
                    fds.push(libc::pollfd {
                        fd: self.conn(op, peer)?.fd(),
                        events: ev,
                        revents: 0,
                    });
                }
            }
            // SAFETY: fds is a valid array of fds.len() pollfds.
            let rc = unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    timeout_ms(self.op_timeout - idle),
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(CommError::Io { op, source: e });
                }
            }
        }
    }

    fn peer_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world_size).filter(move |&r| r != self.rank)
    }

    fn all_reduce_cpu(&self, st: &mut OpState, t: &Tensor) -> CommResult<Tensor> {
        const OP: &str = "all_reduce_sum";
        let (code, dims) = wire_meta(OP, t)?;
        let (guard, layout) = t.storage_and_layout();
        let own = cpu_bytes(OP, &guard, layout)?;
        let hdr = WireHeader::new(OpCode::AllReduce, code, &dims, st.seq, 0, own.len()).encode();
        let expect = Expect {
            op: OpCode::AllReduce,
            seq: st.seq,
            param: 0,
            dtype: code,
            dims: &dims,
            free_dim: None,
        };
        let mut sends: Vec<SendJob<'_>> = self
            .peer_ranks()
            .map(|peer| SendJob {
                peer,
                hdr,
                payload: own,
                sent: 0,
            })
            .collect();
        let mut recvs: Vec<RecvJob> = self.peer_ranks().map(RecvJob::new).collect();
        self.exchange(OP, &mut st.stages, &mut sends, &mut recvs, &expect)?;
        let mut parts: Vec<&[u8]> = Vec::with_capacity(self.world_size);
        let mut it = recvs.iter();
        for r in 0..self.world_size {
            if r == self.rank {
                parts.push(own);
            } else {
                parts.push(
                    it.next()
                        .and_then(|j| j.data.as_ref())
                        .map_or(&[][..], Buf::bytes),
                );
            }
        }
        let out = reduce_sum(OP, t.dtype(), &parts)?;
        drop(parts);
        drop(guard);
        out.into_tensor(&dims)
    }

    /// all_gather (`root` None) and gather (`root` Some).
    fn gather_cpu(
        &self,
        st: &mut OpState,
        t: &Tensor,
        dim: usize,
        root: Option<usize>,
    ) -> CommResult<Option<Tensor>> {
        let (op, opcode) = if root.is_some() {
            ("gather", OpCode::Gather)
        } else {
            ("all_gather", OpCode::AllGather)
        };
        let (code, dims) = wire_meta(op, t)?;
        if dim >= dims.len() {
            return Err(CommError::Invalid {
                op,
                reason: format!("dim {dim} out of range for a {}-d tensor", dims.len()),
            });
        }
        if let Some(root) = root
            && root >= self.world_size
        {
            return Err(CommError::Invalid {
                op,
                reason: format!(
                    "root {root} out of range for world size {}",
                    self.world_size
                ),
            });
        }
        let param = dim as u64 | (root.map_or(0, |r| r as u64) << 32);
        let (guard, layout) = t.storage_and_layout();
        let own = cpu_bytes(op, &guard, layout)?;
        let hdr = WireHeader::new(opcode, code, &dims, st.seq, param, own.len()).encode();
        let expect = Expect {
            op: opcode,
            seq: st.seq,
            param,
            dtype: code,
            dims: &dims,
            free_dim: Some(dim),
        };
        let receiver = root.is_none_or(|r| r == self.rank);
        let mut sends: Vec<SendJob<'_>> = match root {
            None => self
                .peer_ranks()
                .map(|peer| SendJob {
                    peer,
                    hdr,
                    payload: own,
                    sent: 0,
                })
                .collect(),
            Some(r) if r != self.rank => vec![SendJob {
                peer: r,
                hdr,
                payload: own,
                sent: 0,
            }],
            Some(_) => Vec::new(),
        };
        let mut recvs: Vec<RecvJob> = if receiver {
            self.peer_ranks().map(RecvJob::new).collect()
        } else {
            Vec::new()
        };
        self.exchange(op, &mut st.stages, &mut sends, &mut recvs, &expect)?;
        if !receiver {
            return Ok(None);
        }
        let mut parts: Vec<(&[u8], Vec<usize>)> = Vec::with_capacity(self.world_size);
        let mut it = recvs.iter();
        for r in 0..self.world_size {
            if r == self.rank {
                parts.push((own, dims.clone()));
            } else {
                let job = it.next().ok_or_else(|| CommError::Invalid {
                    op,
                    reason: "missing receive".into(),
                })?;
                let pd = job
                    .header
                    .as_ref()
                    .map(|h| h.dims().iter().map(|&d| d as usize).collect())
                    .unwrap_or_default();
                parts.push((job.data.as_ref().map_or(&[][..], Buf::bytes), pd));
            }
        }
        let (out, out_dims) = concat(op, t.dtype(), &parts, dim)?;
        drop(parts);
        drop(guard);
        Ok(Some(out.into_tensor(&out_dims)?))
    }

    fn broadcast_cpu(
        &self,
        st: &mut OpState,
        t: &Tensor,
        root: usize,
    ) -> CommResult<Option<Tensor>> {
        const OP: &str = "broadcast";
        if root >= self.world_size {
            return Err(CommError::Invalid {
                op: OP,
                reason: format!(
                    "root {root} out of range for world size {}",
                    self.world_size
                ),
            });
        }
        let (code, dims) = wire_meta(OP, t)?;
        let expect = Expect {
            op: OpCode::Broadcast,
            seq: st.seq,
            param: root as u64,
            dtype: code,
            dims: &dims,
            free_dim: None,
        };
        if root == self.rank {
            let (guard, layout) = t.storage_and_layout();
            let own = cpu_bytes(OP, &guard, layout)?;
            let hdr = WireHeader::new(
                OpCode::Broadcast,
                code,
                &dims,
                st.seq,
                root as u64,
                own.len(),
            )
            .encode();
            let mut sends: Vec<SendJob<'_>> = self
                .peer_ranks()
                .map(|peer| SendJob {
                    peer,
                    hdr,
                    payload: own,
                    sent: 0,
                })
                .collect();
            self.exchange(OP, &mut st.stages, &mut sends, &mut [], &expect)?;
            Ok(None)
        } else {
            let mut recvs = [RecvJob::new(root)];
            self.exchange(OP, &mut st.stages, &mut [], &mut recvs, &expect)?;
            let [job] = recvs;
            let data = job.data.ok_or_else(|| CommError::Invalid {
                op: OP,
                reason: "no data received".into(),
            })?;
            Ok(Some(data.into_tensor(&dims)?))
        }
    }

    fn barrier_impl(&self, st: &mut OpState) -> CommResult<()> {
        const OP: &str = "barrier";
        let hdr = WireHeader::new(OpCode::Barrier, 0, &[], st.seq, 0, 0).encode();
        let expect = Expect {
            op: OpCode::Barrier,
            seq: st.seq,
            param: 0,
            dtype: 0,
            dims: &[],
            free_dim: None,
        };
        let mut sends: Vec<SendJob<'_>> = self
            .peer_ranks()
            .map(|peer| SendJob {
                peer,
                hdr,
                payload: &[],
                sent: 0,
            })
            .collect();
        let mut recvs: Vec<RecvJob> = self.peer_ranks().map(RecvJob::new).collect();
        self.exchange(OP, &mut st.stages, &mut sends, &mut recvs, &expect)
    }
}

/// Dtype code and dims of a tensor about to go on the wire.
fn wire_meta(op: &'static str, t: &Tensor) -> CommResult<(u8, Vec<usize>)> {
    let code = dtype_code(t.dtype()).ok_or_else(|| CommError::Invalid {
        op,
        reason: format!("unsupported dtype {:?}", t.dtype()),
    })?;
    let dims = t.dims().to_vec();
    if dims.len() > MAX_DIMS {
        return Err(CommError::Invalid {
            op,
            reason: format!(
                "{}-d tensor; at most {MAX_DIMS} dims are supported",
                dims.len()
            ),
        });
    }
    Ok((code, dims))
}

/// Returns a contiguous CPU copy of `t` (no copy if it already is one) and the device to move
/// results back to.
fn to_host(t: &Tensor) -> CommResult<(Tensor, Option<Device>)> {
    let (host, back) = if t.device().is_cpu() {
        (t.clone(), None)
    } else {
        (t.to_device(&Device::Cpu)?, Some(t.device().clone()))
    };
    let host = if host.is_contiguous() {
        host
    } else {
        host.contiguous()?
    };
    Ok((host, back))
}

fn to_device(t: Tensor, device: &Option<Device>) -> CommResult<Tensor> {
    Ok(match device {
        Some(d) => t.to_device(d)?,
        None => t,
    })
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
            if self.world_size == 1 {
                return Ok(tensor.clone());
            }
            let (host, back) = to_host(tensor)?;
            to_device(self.all_reduce_cpu(st, &host)?, &back)
        })
    }

    fn all_gather(&self, tensor: &Tensor, dim: usize) -> CommResult<Tensor> {
        self.run("all_gather", |st| {
            if self.world_size == 1 {
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
            if self.world_size == 1 {
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
            if self.world_size == 1 {
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
            if self.world_size == 1 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_roundtrip() {
        let id = CommId {
            addr: RendezvousAddr::tcp("::1", 4000),
            nonce: [7; 16],
        };
        let b = id.to_bytes();
        assert_eq!(
            String::from_utf8_lossy(&b),
            "tpcomm1;tcp://[::1]:4000;07070707070707070707070707070707"
        );
        assert_eq!(CommId::from_bytes(&b).unwrap(), id);
        let id = CommId {
            addr: RendezvousAddr::unix("/tmp/a;b.sock"),
            nonce: [0xab; 16],
        };
        assert_eq!(CommId::from_bytes(&id.to_bytes()).unwrap(), id);
    }

    #[test]
    fn header_roundtrip() {
        let h = WireHeader::new(OpCode::AllGather, 8, &[2, 3, 4], 9, 1, 96);
        assert_eq!(WireHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn concat_middle_dim() {
        // [2, 1] and [2, 2] along dim 1 -> [2, 3]
        let a: Vec<u8> = vec![1, 2];
        let b: Vec<u8> = vec![3, 4, 5, 6];
        let (out, dims) = concat("t", DType::U8, &[(&a, vec![2, 1]), (&b, vec![2, 2])], 1).unwrap();
        assert_eq!(dims, vec![2, 3]);
        assert_eq!(out.bytes(), &[1, 3, 4, 2, 5, 6]);
    }
}
