//! Rendezvous and mesh-listener addresses: TCP `host:port` or a Unix socket path, their text
//! forms and the canonical byte form that communicator ids and peer tables carry.

use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::comm::{CommError, CommResult};

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
    pub(super) fn to_wire(&self) -> Vec<u8> {
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
    pub(super) fn from_wire(b: &[u8], lenient: bool) -> Result<Self, String> {
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

pub(super) fn validate_host(host: &str) -> Result<(), String> {
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
