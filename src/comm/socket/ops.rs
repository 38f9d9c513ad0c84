//! Each collective on host tensors: encode a header, hand sends and receives to the transfer
//! engine, then sum or concatenate what arrived. Tensors on another device are copied to the
//! host and back around this (the socket backend's arithmetic runs on the CPU).

use candle_core::{DType, Device, Tensor};

use super::SocketCollective;
use super::reduce::{Buf, concat, cpu_bytes, reduce_sum};
use super::transfer::{OpState, RecvJob, SendJob};
use super::wire::{Expect, HDR_LEN, MAX_DIMS, OpCode, WireHeader};
use crate::comm::dtype;
use crate::comm::{CommError, CommResult};

/// The wire code of a dtype this backend carries: every coded dtype except the 8-bit floats,
/// which have no host arithmetic here.
fn wire_code(d: DType) -> Option<u8> {
    if d == DType::F8E4M3 { None } else { dtype::code(d) }
}

impl SocketCollective {
    fn peer_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world_size).filter(move |&r| r != self.rank)
    }

    /// The same message (`hdr` + `payload`) to every other rank.
    fn send_to_all<'a>(&self, hdr: [u8; HDR_LEN], payload: &'a [u8]) -> Vec<SendJob<'a>> {
        self.peer_ranks().map(|peer| SendJob::new(peer, hdr, payload)).collect()
    }

    pub(super) fn all_reduce_cpu(&self, st: &mut OpState, t: &Tensor) -> CommResult<Tensor> {
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
        let mut sends = self.send_to_all(hdr, own);
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
    pub(super) fn gather_cpu(
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
            None => self.send_to_all(hdr, own),
            Some(r) if r != self.rank => vec![SendJob::new(r, hdr, own)],
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

    pub(super) fn broadcast_cpu(
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
            let mut sends = self.send_to_all(hdr, own);
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

    pub(super) fn barrier_impl(&self, st: &mut OpState) -> CommResult<()> {
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
        let mut sends = self.send_to_all(hdr, &[]);
        let mut recvs: Vec<RecvJob> = self.peer_ranks().map(RecvJob::new).collect();
        self.exchange(OP, &mut st.stages, &mut sends, &mut recvs, &expect)
    }
}

/// Dtype code and dims of a tensor about to go on the wire.
fn wire_meta(op: &'static str, t: &Tensor) -> CommResult<(u8, Vec<usize>)> {
    let code = wire_code(t.dtype()).ok_or_else(|| CommError::Invalid {
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
pub(super) fn to_host(t: &Tensor) -> CommResult<(Tensor, Option<Device>)> {
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

pub(super) fn to_device(t: Tensor, device: &Option<Device>) -> CommResult<Tensor> {
    Ok(match device {
        Some(d) => t.to_device(d)?,
        None => t,
    })
}
