//! The communicator id: rank 0's rendezvous address plus a nonce naming the group's epoch, in
//! the text form the coordinator ships to every rank.

use std::fmt;
use std::str::FromStr;

use super::address::RendezvousAddr;
use crate::comm::{CommError, CommResult};

/// What every id starts with; the NCCL backend recognises an id from a CPU rank 0 by it.
pub(crate) const ID_PREFIX: &[u8] = b"tpcomm1;";
pub(super) const NONCE_LEN: usize = 16;
const MAX_ID_LEN: usize = 4096;

/// Opaque communicator id: the rendezvous address of rank 0 plus a random nonce that names this
/// group incarnation (epoch). Text form: `tpcomm1;tcp://10.0.0.5:41234;<32 hex digits>` or
/// `tpcomm1;unix:///run/tp.sock;<32 hex digits>`. The nonce tells groups apart; it is not
/// authentication.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CommId {
    pub(super) addr: RendezvousAddr,
    pub(super) nonce: [u8; NONCE_LEN],
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

pub(super) fn hex_encode(b: &[u8]) -> String {
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
}
