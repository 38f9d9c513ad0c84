//! Addresses and transports shared by every server and client: `unix:///path/to.sock` or
//! `host:port` (TCP), both everywhere.

mod listener;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use listener::{AcceptBackoff, Connection, Incoming, Listener};

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

/// HTTP/2 PINGs on client channels (to ranks) find a peer that vanished without closing the
/// connection (a dead host, a dropped NAT entry) within about 30 s, even between requests.
/// Answering a PING needs only the peer's runtime, not its device worker, so a long step or load
/// does not trip it.
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(15);
/// TCP keepalive on client connections, under the HTTP/2 PINGs, for the kernel's own view.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

fn keepalive(endpoint: Endpoint) -> Endpoint {
    endpoint
        .http2_keep_alive_interval(HTTP2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(HTTP2_KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
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
            let mut endpoint = keepalive(Endpoint::from_shared(format!("{scheme}://{host_port}"))
                .with_context(|| format!("invalid address {host_port}"))?)
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .tcp_keepalive(Some(TCP_KEEPALIVE));
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
            let endpoint = keepalive(Endpoint::try_from("http://localhost")?).connect_timeout(timeout);
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
