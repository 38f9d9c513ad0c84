//! Accepting connections without letting the clients decide what it costs: a cap on open
//! connections, TCP keepalive so dead peers are found, and an accept loop that backs off (and
//! logs once in a while, not once per try) when accept(2) fails, e.g. out of file descriptors.
//! Without the backoff a listener whose backlog holds a connection it cannot accept is readable
//! forever, and the loop spins at full CPU.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use futures::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Address;

/// TCP keepalive on accepted connections: a peer silent this long is probed...
const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// ...every this often...
const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ...and the connection is dropped after this many unanswered probes (about 90 s in all).
const TCP_KEEPALIVE_RETRIES: u32 = 3;

/// A bound listener for a tonic or hyper server.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, PathBuf),
}

impl Listener {
    /// Binds `address`. A stale socket file from an earlier run is removed first, and the new one
    /// is made accessible to its owner and group only.
    pub async fn bind(address: &Address) -> Result<Self> {
        match address {
            Address::Tcp(host_port) => {
                let listener = tokio::net::TcpListener::bind(host_port)
                    .await
                    .with_context(|| format!("cannot listen on {host_port}"))?;
                Ok(Listener::Tcp(listener))
            }
            Address::Unix(path) => {
                if let Some(parent) = path.parent() {
                    if !parent.as_os_str().is_empty() {
                        std::fs::create_dir_all(parent)
                            .with_context(|| format!("cannot create {}", parent.display()))?;
                    }
                }
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => return Err(err).with_context(|| format!("cannot remove stale socket {}", path.display())),
                }
                let listener = tokio::net::UnixListener::bind(path)
                    .with_context(|| format!("cannot listen on unix socket {}", path.display()))?;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
                    .with_context(|| format!("cannot set the mode of {}", path.display()))?;
                Ok(Listener::Unix(listener, path.clone()))
            }
        }
    }

    /// The address clients can reach this listener at (the real port when bound to port 0).
    pub fn local_address(&self) -> Result<Address> {
        match self {
            Listener::Tcp(listener) => Ok(Address::Tcp(listener.local_addr()?.to_string())),
            Listener::Unix(_, path) => Ok(Address::Unix(path.clone())),
        }
    }

    /// Accepts the next connection once fewer than the cap are open. Never fails: accept errors
    /// are paced by `backoff` and retried. Dropping the returned connection frees its slot.
    pub async fn accept(&self, slots: &Arc<Semaphore>, backoff: &mut AcceptBackoff) -> Connection {
        // Wait for a slot before accepting: past the cap, clients queue in the kernel's backlog
        // instead of costing this process a descriptor each.
        // (The semaphore is never closed; if it were, the cap would simply stop applying.)
        let permit = slots.clone().acquire_owned().await.ok();
        loop {
            let accepted = match self {
                Listener::Tcp(listener) => listener.accept().await.and_then(|(stream, _)| {
                    // Token streams are many small writes: do not let Nagle batch them.
                    stream.set_nodelay(true)?;
                    set_tcp_keepalive(&stream)?;
                    Ok(Io::Tcp(stream))
                }),
                Listener::Unix(listener, _) => listener.accept().await.map(|(stream, _)| Io::Unix(stream)),
            };
            match accepted {
                Ok(io) => {
                    backoff.succeeded();
                    return Connection { io, _slot: permit };
                }
                Err(err) => backoff.failed(&err).await,
            }
        }
    }

    /// The stream of accepted connections, at most `max_connections` open at once, for tonic's
    /// `serve_with_incoming_shutdown`. It never yields an error (tonic would retry at once, in a
    /// silent busy loop). A Unix socket file is removed when the stream is dropped.
    pub fn into_incoming(self, max_connections: usize, what: &'static str) -> Incoming {
        let unix_path = match &self {
            Listener::Unix(_, path) => Some(path.clone()),
            Listener::Tcp(_) => None,
        };
        let state = (self, Arc::new(Semaphore::new(max_connections.max(1))), AcceptBackoff::new(what));
        let inner = futures::stream::unfold(state, |(listener, slots, mut backoff)| async move {
            let connection = listener.accept(&slots, &mut backoff).await;
            Some((Ok(connection), (listener, slots, backoff)))
        })
        .boxed();
        Incoming { inner, unix_path }
    }
}

fn set_tcp_keepalive(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(TCP_KEEPALIVE_IDLE)
        .with_interval(TCP_KEEPALIVE_INTERVAL)
        .with_retries(TCP_KEEPALIVE_RETRIES);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// Paces a failing accept loop: sleeps 10 ms after the first failure, doubling to 1 s, and logs
/// a warning at most every 10 s with the number of failures since the last one.
pub struct AcceptBackoff {
    what: &'static str,
    delay: Duration,
    failures: u64,
    unlogged: u64,
    last_log: Option<Instant>,
}

const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

impl AcceptBackoff {
    /// `what` names the listener in the log ("public API", "metrics", ...).
    pub fn new(what: &'static str) -> Self {
        Self { what, delay: ACCEPT_BACKOFF_FIRST, failures: 0, unlogged: 0, last_log: None }
    }

    pub async fn failed(&mut self, err: &std::io::Error) {
        self.failures += 1;
        self.unlogged += 1;
        if self.last_log.is_none_or(|at| at.elapsed() >= ACCEPT_LOG_EVERY) {
            tracing::warn!(
                listener = self.what,
                error = %err,
                failures = self.unlogged,
                retry_in_ms = self.delay.as_millis() as u64,
                "cannot accept connections (out of file descriptors?); backing off"
            );
            self.last_log = Some(Instant::now());
            self.unlogged = 0;
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(ACCEPT_BACKOFF_MAX);
    }

    pub fn succeeded(&mut self) {
        if self.failures > 0 {
            tracing::info!(listener = self.what, failures = self.failures, "accepting connections again");
        }
        self.delay = ACCEPT_BACKOFF_FIRST;
        self.failures = 0;
        self.unlogged = 0;
        self.last_log = None;
    }
}

/// Accepted connections of a [`Listener`].
pub struct Incoming {
    inner: futures::stream::BoxStream<'static, std::io::Result<Connection>>,
    unix_path: Option<PathBuf>,
}

impl futures::Stream for Incoming {
    type Item = std::io::Result<Connection>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        if let Some(path) = &self.unix_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// One accepted connection, TCP or Unix, holding its slot under the connection cap.
pub struct Connection {
    io: Io,
    _slot: Option<OwnedSemaphorePermit>,
}

enum Io {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Connection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Io::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Io::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Tcp(s) => Pin::new(s).poll_flush(cx),
            Io::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Io::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
