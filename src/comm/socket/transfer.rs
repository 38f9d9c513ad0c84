//! The transfer engine: every send and receive of one collective in flight at once, on
//! non-blocking sockets driven by poll(2), so that a full mesh of large messages cannot
//! deadlock on full socket buffers and a stopped peer is noticed within `op_timeout`.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::SocketCollective;
use super::reduce::Buf;
use super::sys;
use super::wire::{Expect, HDR_LEN, WireHeader};
use crate::comm::{CommError, CommResult};

/// Bytes in each peer's [`RxStage`].
const STAGE_LEN: usize = 64 * 1024;

/// One message to one peer: header, then payload, sent without copying either.
pub(super) struct SendJob<'a> {
    peer: usize,
    hdr: [u8; HDR_LEN],
    payload: &'a [u8],
    sent: usize,
}

impl<'a> SendJob<'a> {
    pub(super) fn new(peer: usize, hdr: [u8; HDR_LEN], payload: &'a [u8]) -> Self {
        Self { peer, hdr, payload, sent: 0 }
    }

    fn done(&self) -> bool {
        self.sent >= HDR_LEN + self.payload.len()
    }
}

/// One message from one peer: its header is checked against an [`Expect`] before the payload
/// buffer is allocated.
pub(super) struct RecvJob {
    peer: usize,
    hdr: [u8; HDR_LEN],
    hdr_got: usize,
    pub(super) header: Option<WireHeader>,
    pub(super) data: Option<Buf>,
    got: usize,
    done: bool,
}

impl RecvJob {
    pub(super) fn new(peer: usize) -> Self {
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
pub(super) struct RxStage {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// What the op lock guards: the sequence number of the current collective and the receive
/// stages, whose leftover bytes belong to the next message from that peer.
pub(super) struct OpState {
    pub(super) seq: u64,
    pub(super) stages: Vec<RxStage>,
}

impl OpState {
    /// Sequence 0 and an empty stage for every peer of `rank` (none for itself).
    pub(super) fn new(rank: usize, world_size: usize) -> Self {
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
        Self { seq: 0, stages }
    }
}

/// Runs a non-blocking socket call, retrying when a signal interrupts it; `Ok(None)` when the
/// socket is not ready (EAGAIN).
fn nonblocking(mut call: impl FnMut() -> io::Result<usize>) -> io::Result<Option<usize>> {
    loop {
        match call() {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn recv_nb(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    nonblocking(|| sys::recv(fd, &mut *buf, libc::MSG_DONTWAIT))
}

fn sendv_nb(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<Option<usize>> {
    nonblocking(|| sys::send_two(fd, a, b, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT))
}

impl SocketCollective {
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
    pub(super) fn exchange(
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
            if let Err(e) = sys::poll(&mut fds, self.op_timeout - idle)
                && e.kind() != io::ErrorKind::Interrupted
            {
                return Err(CommError::Io { op, source: e });
            }
        }
    }
}
