//! The data-path wire format: a fixed header in front of every collective's payload, and the
//! checks a receiver makes on it so that ranks which called different collectives, or the same
//! one with different shapes, fail with a message saying so instead of corrupting data.

use candle_core::DType;

use crate::comm::dtype;
use crate::comm::{CommError, CommResult};

const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"TPCM");
pub(super) const HDR_LEN: usize = 96;
/// Most dims a tensor on the wire may have (the header has room for this many).
pub(super) const MAX_DIMS: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum OpCode {
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
pub(super) struct WireHeader {
    op: u8,
    dtype: u8,
    ndims: u8,
    seq: u64,
    param: u64,
    payload_len: u64,
    dims: [u64; MAX_DIMS],
}

impl WireHeader {
    pub(super) fn new(
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

    pub(super) fn encode(&self) -> [u8; HDR_LEN] {
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

    pub(super) fn decode(b: &[u8; HDR_LEN]) -> Result<Self, String> {
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

    pub(super) fn dims(&self) -> &[u64] {
        &self.dims[..self.ndims as usize]
    }
}

/// What the receiving side checks every incoming header against.
pub(super) struct Expect<'a> {
    pub(super) op: OpCode,
    pub(super) seq: u64,
    pub(super) param: u64,
    pub(super) dtype: u8,
    pub(super) dims: &'a [usize],
    /// `Some(d)`: dims must match except `d` (gathers); `None`: exact match.
    pub(super) free_dim: Option<usize>,
}

impl Expect<'_> {
    pub(super) fn check(
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
                |c: u8| dtype::from_code(c).map_or_else(|| format!("code {c}"), |d| format!("{d:?}"));
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
        let dtype = dtype::from_code(h.dtype)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip() {
        let h = WireHeader::new(OpCode::AllGather, 8, &[2, 3, 4], 9, 1, 96);
        assert_eq!(WireHeader::decode(&h.encode()).unwrap(), h);
    }
}
