//! Listeners and connections: TCP or Unix stream sockets behind one type each, blocking I/O
//! with deadlines for the bootstrap, connect-with-retry, and the deadline arithmetic.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::debug;

use super::address::RendezvousAddr;
use super::sys;
use crate::comm::{CommError, CommResult};

pub(super) enum Listener {
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
    pub(super) fn bind_unix(path: &Path, op: &'static str) -> CommResult<Self> {
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

    pub(super) fn fd(&self) -> RawFd {
        match self {
            Self::Tcp(l) => l.as_raw_fd(),
            Self::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }

    pub(super) fn set_nonblocking(&self, nb: bool) -> io::Result<()> {
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
    pub(super) fn accept_until(&self, deadline: Instant) -> io::Result<Option<(Conn, String)>> {
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

pub(super) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    pub(super) fn tcp(s: TcpStream) -> io::Result<Self> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        Ok(Self::Tcp(s))
    }

    pub(super) fn fd(&self) -> RawFd {
        match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        }
    }

    pub(super) fn shutdown(&self) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(Shutdown::Both),
            Self::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    pub(super) fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
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
    pub(super) fn send_blocking(&self, buf: &[u8]) -> io::Result<usize> {
        sys::send(self.fd(), buf, libc::MSG_NOSIGNAL)
    }

    /// Blocking recv honoring SO_RCVTIMEO.
    pub(super) fn recv_blocking(&self, buf: &mut [u8]) -> io::Result<usize> {
        sys::recv(self.fd(), buf, 0)
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
pub(super) fn connect_retry(addr: &RendezvousAddr, peer: usize, deadline: Instant) -> CommResult<Conn> {
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

pub(super) fn remaining(deadline: Instant) -> Option<Duration> {
    let now = Instant::now();
    if now >= deadline {
        None
    } else {
        Some((deadline - now).max(Duration::from_millis(1)))
    }
}

pub(super) fn deadline_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Waits until `fd` is ready for `events` or `timeout` passes. Returns whether it is ready.
pub(super) fn poll_one(fd: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut pfd = [libc::pollfd { fd, events, revents: 0 }];
    match sys::poll(&mut pfd, timeout) {
        Ok(ready) => Ok(ready > 0),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(e) => Err(e),
    }
}

pub(super) fn io_ctx(op: &'static str, what: String, e: io::Error) -> CommError {
    CommError::Io {
        op,
        source: io::Error::new(e.kind(), format!("{what}: {e}")),
    }
}

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
