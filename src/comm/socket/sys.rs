//! The libc socket calls that the standard library does not offer with the flags we need
//! (`MSG_NOSIGNAL`, `MSG_DONTWAIT`, two-buffer `sendmsg`, multi-fd `poll`), each behind a safe
//! function. This is the socket backend's only `unsafe` code.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// `poll(2)` timeout in milliseconds, rounded up so that we never spin on a zero-timeout poll.
fn timeout_ms(d: Duration) -> libc::c_int {
    let ms = d.as_nanos().div_ceil(1_000_000);
    ms.min(libc::c_int::MAX as u128) as libc::c_int
}

/// A syscall's byte count, or the OS error it reported.
fn byte_count(n: isize) -> io::Result<usize> {
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// `send(2)` of `buf` with `flags`.
pub(super) fn send(fd: RawFd, buf: &[u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is a live slice that send only reads, for exactly its length.
    byte_count(unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) })
}

/// `recv(2)` into `buf` with `flags`.
pub(super) fn recv(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is a live, exclusively borrowed slice that recv writes within its length.
    byte_count(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) })
}

/// `sendmsg(2)` of `a` then `b` as one gather write (header and payload without a copy). Empty
/// parts are left out of the iovec list.
pub(super) fn send_two(fd: RawFd, a: &[u8], b: &[u8], flags: libc::c_int) -> io::Result<usize> {
    let mut iov = [a, b].map(|part| libc::iovec {
        iov_base: part.as_ptr() as *mut libc::c_void,
        iov_len: part.len(),
    });
    let first = usize::from(a.is_empty());
    let count = usize::from(!a.is_empty()) + usize::from(!b.is_empty());
    // SAFETY: msghdr is plain data; all zeroes is a valid "no address, no control" message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov[first..].as_mut_ptr();
    msg.msg_iovlen = count as _;
    // SAFETY: the iovecs point into live slices that sendmsg only reads (the `*mut` in iovec is
    // the C type's, not a licence to write).
    byte_count(unsafe { libc::sendmsg(fd, &msg, flags) })
}

/// `poll(2)` on `fds` for up to `timeout`; returns how many are ready.
pub(super) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    // SAFETY: `fds` is a live, exclusively borrowed array of exactly `fds.len()` pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms(timeout)) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc as usize) }
}
