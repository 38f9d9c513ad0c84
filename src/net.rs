//! Addresses and transports shared by every server and client: `unix:///path/to.sock` or
//! `host:port` (TCP), both everywhere.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use anyhow::{Context as _, Result, bail};
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Where a server listens or a client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    /// host:port, resolved when used
    Tcp(String),
}

impl FromStr for Address {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self> {
        if let Some(path) = text.strip_prefix("unix://") {
            if path.is_empty() {
                bail!("unix address \"{text}\" has no path (expected unix:///path/to.sock)");
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if text.contains("://") {
            bail!("address \"{text}\": only unix:///path and host:port are supported");
        }
        let Some((host, port)) = text.rsplit_once(':') else {
            bail!("address \"{text}\" must be host:port or unix:///path");
        };
        if host.is_empty() || port.parse::<u16>().is_err() {
            bail!("address \"{text}\" must be host:port with a port number, or unix:///path");
        }
        Ok(Address::Tcp(text.to_owned()))
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix://{}", path.display()),
            Address::Tcp(host_port) => f.write_str(host_port),
        }
    }
}

/// A bound listener for a tonic server.
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

    /// The stream of accepted connections, for tonic's `serve_with_incoming_shutdown`. A Unix
    /// socket file is removed when the stream is dropped (the server stopped).
    pub fn into_incoming(self) -> Incoming {
        use futures::StreamExt;
        match self {
            Listener::Tcp(listener) => Incoming {
                inner: tokio_stream::wrappers::TcpListenerStream::new(listener)
                    .map(|c| {
                        let stream = c?;
                        // Token streams are many small writes: do not let Nagle batch them.
                        stream.set_nodelay(true)?;
                        Ok(Connection::Tcp(stream))
                    })
                    .boxed(),
                unix_path: None,
            },
            Listener::Unix(listener, path) => Incoming {
                inner: tokio_stream::wrappers::UnixListenerStream::new(listener).map(|c| c.map(Connection::Unix)).boxed(),
                unix_path: Some(path),
            },
        }
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

/// One accepted connection, TCP or Unix.
pub enum Connection {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Connection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connection::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Connection::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Connection::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Connection::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connection::Tcp(s) => Pin::new(s).poll_flush(cx),
            Connection::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connection::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Connection::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A server's TLS identity (PEM certificate chain and private key).
pub fn server_tls(cert: &Path, key: &Path) -> Result<tonic::transport::ServerTlsConfig> {
    let cert = std::fs::read(cert).with_context(|| format!("cannot read TLS certificate {}", cert.display()))?;
    let key = std::fs::read(key).with_context(|| format!("cannot read TLS key {}", key.display()))?;
    Ok(tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(cert, key)))
}

/// How a client verifies a TLS server: the CA (or self-signed certificate) to trust.
#[derive(Clone)]
pub struct ClientTls {
    ca: tonic::transport::Certificate,
}

impl ClientTls {
    pub fn from_ca_file(path: &Path) -> Result<Self> {
        let pem = std::fs::read(path).with_context(|| format!("cannot read TLS CA {}", path.display()))?;
        Ok(Self { ca: tonic::transport::Certificate::from_pem(pem) })
    }
}

/// Opens a gRPC channel to `address`, failing if it cannot connect within `timeout`.
pub async fn connect(address: &Address, timeout: Duration) -> Result<Channel> {
    connect_with(address, timeout, None).await
}

/// [`connect`], over TLS when `tls` is given (TCP only: a Unix socket is protected by its mode).
pub async fn connect_with(address: &Address, timeout: Duration, tls: Option<&ClientTls>) -> Result<Channel> {
    match address {
        Address::Tcp(host_port) => {
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut endpoint = Endpoint::from_shared(format!("{scheme}://{host_port}"))
                .with_context(|| format!("invalid address {host_port}"))?
                .connect_timeout(timeout)
                .tcp_nodelay(true);
            if let Some(tls) = tls {
                let host = host_port.rsplit_once(':').map_or(host_port.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let config = tonic::transport::ClientTlsConfig::new().ca_certificate(tls.ca.clone()).domain_name(host);
                endpoint = endpoint.tls_config(config).with_context(|| format!("TLS settings for {host_port}"))?;
            }
            endpoint.connect().await.with_context(|| format!("cannot connect to {host_port}"))
        }
        Address::Unix(path) => {
            let path = path.clone();
            // The URI is required by tonic but unused: the connector decides where to go.
            let endpoint = Endpoint::try_from("http://localhost")?.connect_timeout(timeout);
            let display = path.display().to_string();
            endpoint
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
                .await
                .with_context(|| format!("cannot connect to unix socket {display}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms_and_rejects_others() {
        assert_eq!("unix:///tmp/a.sock".parse::<Address>().unwrap(), Address::Unix("/tmp/a.sock".into()));
        assert_eq!("localhost:50051".parse::<Address>().unwrap(), Address::Tcp("localhost:50051".into()));
        assert_eq!("[::1]:1".parse::<Address>().unwrap(), Address::Tcp("[::1]:1".into()));
        for bad in ["unix://", "http://x:1", "nohost", "host:notaport", ":80"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }
}
