//! Addresses and transports shared by every server and client: `unix:///path/to.sock` or
//! `host:port` (TCP), both everywhere.

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
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

    /// Serves `router` until `shutdown` resolves.
    pub async fn serve<F>(self, router: tonic::transport::server::Router, shutdown: F) -> Result<()>
    where
        F: std::future::Future<Output = ()> + Send,
    {
        match self {
            Listener::Tcp(listener) => {
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                router.serve_with_incoming_shutdown(incoming, shutdown).await?;
            }
            Listener::Unix(listener, path) => {
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let result = router.serve_with_incoming_shutdown(incoming, shutdown).await;
                let _ = std::fs::remove_file(&path);
                result?;
            }
        }
        Ok(())
    }
}

/// Opens a gRPC channel to `address`, failing if it cannot connect within `timeout`.
pub async fn connect(address: &Address, timeout: Duration) -> Result<Channel> {
    match address {
        Address::Tcp(host_port) => {
            let endpoint = Endpoint::from_shared(format!("http://{host_port}"))
                .with_context(|| format!("invalid address {host_port}"))?
                .connect_timeout(timeout)
                .tcp_nodelay(true);
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

/// Parses a TCP address that must already be a literal socket address.
pub fn socket_addr(text: &str) -> Result<SocketAddr> {
    text.parse().with_context(|| format!("\"{text}\" is not an IP:port address"))
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
