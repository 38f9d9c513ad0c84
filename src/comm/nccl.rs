//! NCCL collective backend for CUDA ranks (the `cuda` feature), through cudarc's NCCL bindings.
//!
//! It implements the same [`Collective`] trait as the CPU socket backend, so the model code has
//! one path, and it bootstraps the same way: rank 0 creates an id ([`NcclId::new`], NCCL's
//! 128-byte `ncclUniqueId`), the coordinator hands the bytes to every rank unchanged, and every
//! rank calls [`NcclCollective::init`]. See `docs/gpu.md`.
//!
//! Design points:
//!
//! - **On the compute stream, inside the forward pass.** Collectives on CUDA tensors are candle
//!   custom ops ([`CustomOp1::cuda_fwd`]) that enqueue the NCCL call on the rank's one CUDA
//!   stream, the stream every kernel of the model runs on. Nothing goes through the host and
//!   the host does not wait; ordering comes from the stream. Results land in a fresh device
//!   buffer: NCCL's out-of-place form costs the same as in place, and writing into the
//!   caller's tensor would be unsound because candle tensors share storage between clones and
//!   views.
//! - **Non-blocking communicator.** The communicator is created with `blocking = 0`, so no NCCL
//!   call can block the calling thread: calls return `ncclInProgress` and we poll
//!   `ncclCommGetAsyncError`, which lets init honour a deadline and lets [`Collective::abort`]
//!   take the communicator from another thread without waiting behind a stuck call.
//! - **Abort and the watchdog.** `abort()` marks the communicator aborted (every later call
//!   fails fast with [`CommError::Aborted`]) and runs `ncclCommAbort` on a helper thread, which
//!   stops NCCL's kernels so that a device worker blocked on the stream gets its thread back. A
//!   watchdog thread waits up to the abort timeout for `ncclCommAbort` to return and for the
//!   stream to drain; if either does not happen the device is wedged, and the process exits
//!   with [`EXIT_ABORT_HUNG`] so that its supervisor (`tpserve serve`, Kubernetes) restarts it.
//! - **Checked shapes where ranks may differ.** `all_gather` and `gather` allow the gathered
//!   dimension to differ per rank (uneven vocabulary slices), so they first all-gather a small
//!   shape descriptor, check it as the socket backend checks its headers, and wait for it on the
//!   host. `gather_sized`, the lm_head's gather every step, is told every rank's size and skips
//!   that exchange. It, `all_reduce_sum` and `broadcast` trust the caller (the model runs the
//!   same batch on every rank): NCCL itself cannot detect a mismatch.
//! - **Host tensors** are copied to the device, reduced there and copied back (the offline
//!   driver broadcasts its sampled token that way).
//!
//! Sums are NCCL's: identical on every rank, but the order of additions follows NCCL's
//! algorithm (ring or tree), not rank order, so the bits can differ from the socket backend's.

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::{CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError};
use cudarc::nccl::sys;

use super::{Collective, CommError, CommResult, dtype};

/// Exit code of a rank process whose NCCL communicator could not be aborted: `ncclCommAbort`
/// did not return, or the device stream did not drain, within the abort timeout after an
/// abort was requested. The device is wedged; only a new process recovers it. (75 is
/// `EX_TEMPFAIL`: try again, which is what a supervisor restarting the rank does.)
pub const EXIT_ABORT_HUNG: i32 = 75;

/// Size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_ID_BYTES: usize = 128;

/// Ops refuse to name more dims than the socket backend's wire format allows.
const MAX_DIMS: usize = 8;
/// A shape descriptor exchanged before all_gather / gather: dtype code, number of dims, dims.
const DESCRIPTOR_LEN: usize = 2 + MAX_DIMS;

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// Opens CUDA device `ordinal` for a rank: a candle device with a stream of its own, on which
/// every kernel, copy and NCCL call of the rank is issued.
pub fn open_device(ordinal: usize) -> candle_core::Result<Device> {
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|err| candle_core::Error::Msg(format!("cannot query the CUDA devices (is the driver loaded?): {err}")))?;
    let count = count.max(0) as usize;
    if ordinal >= count {
        let have = match count {
            0 => "no CUDA device".to_owned(),
            1 => "one CUDA device, cuda:0".to_owned(),
            n => format!("{n} CUDA devices, cuda:0 to cuda:{}", n - 1),
        };
        return Err(candle_core::Error::Msg(format!("there is no cuda:{ordinal}: this machine has {have}")));
    }
    let device = Device::new_cuda_with_stream(ordinal)?;
    // SAFETY: a rank issues all of its device work on this one stream (candle's kernels and
    // copies, and the NCCL calls of this module), so there is no cross-stream use for cudarc to
    // order with events. With tracking on, cudarc would record two events per tensor access,
    // a large cost for decode steps made of many small kernels.
    unsafe { device.as_cuda_device()?.disable_event_tracking() };
    Ok(device)
}

/// (total, free) bytes of the device's memory; None for a CPU device or when the query fails.
/// Call it on the device worker's thread (it makes the device's context current).
pub fn device_memory(device: &Device) -> Option<(u64, u64)> {
    let Device::Cuda(cuda) = device else { return None };
    let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
    Some((total as u64, free as u64))
}

// ---------------------------------------------------------------------------------------------
// The communicator id
// ---------------------------------------------------------------------------------------------

/// NCCL's unique id: made by rank 0, handed to every rank unchanged as 128 opaque bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl NcclId {
    /// `ncclGetUniqueId`: opens NCCL's bootstrap listener in this process (rank 0's). It needs
    /// no CUDA context, so the rank server calls it off the device worker, which may be stuck
    /// in a step that the coming re-initialisation is about to abort.
    pub fn new() -> CommResult<Self> {
        let id = cudarc::nccl::Id::new().map_err(|err| nccl_error("get_unique_id", err.0, None))?;
        let mut bytes = [0u8; NCCL_ID_BYTES];
        for (byte, &c) in bytes.iter_mut().zip(id.internal().iter()) {
            *byte = c as u8;
        }
        Ok(Self(bytes))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    /// Never panics: anything but 128 bytes is [`CommError::InvalidId`].
    pub fn from_bytes(bytes: &[u8]) -> CommResult<Self> {
        if bytes.starts_with(super::socket::ID_PREFIX) {
            return Err(CommError::InvalidId(
                "this is a CPU (socket backend) communicator id, but this rank runs on CUDA: \
                 every rank of a group must run on the same kind of device"
                    .into(),
            ));
        }
        let array: [u8; NCCL_ID_BYTES] = bytes.try_into().map_err(|_| {
            CommError::InvalidId(format!("an NCCL id is {NCCL_ID_BYTES} bytes, got {}", bytes.len()))
        })?;
        Ok(Self(array))
    }

    /// Lowercase hex, for command lines (`tpserve eval-shard` prints `COMM_ID=<hex>`).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> CommResult<Self> {
        let text = text.trim();
        if text.len() != 2 * NCCL_ID_BYTES || !text.is_ascii() {
            return Err(CommError::InvalidId(format!(
                "an NCCL id is {} hex digits, got {:?}",
                2 * NCCL_ID_BYTES,
                text.chars().take(16).collect::<String>()
            )));
        }
        let mut bytes = [0u8; NCCL_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                .map_err(|_| CommError::InvalidId(format!("bad hex digits at {}", 2 * i)))?;
        }
        Ok(Self(bytes))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        let mut internal = [0 as c_char; NCCL_ID_BYTES];
        for (c, &byte) in internal.iter_mut().zip(self.0.iter()) {
            *c = byte as c_char;
        }
        sys::ncclUniqueId { internal }
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The id holds rank 0's bootstrap address; a prefix is enough to tell ids apart in logs.
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

/// Timeouts of an [`NcclCollective`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclOptions {
    /// How long [`NcclCollective::init`] waits for the whole group to join.
    pub init_timeout: Duration,
    /// How long the host waits for a collective it has to wait for (the shape exchange of
    /// all_gather and gather, barrier, host tensors). Collectives inside the forward pass are
    /// never waited for on the host; a hung peer there is caught by the coordinator's step
    /// deadline, which leads to an abort.
    pub op_timeout: Duration,
    /// How long, after an abort is requested, `ncclCommAbort` may take to return and the device
    /// stream to drain before the process exits with [`EXIT_ABORT_HUNG`].
    pub abort_timeout: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            init_timeout: Duration::from_secs(120),
            op_timeout: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(60),
        }
    }
}

/// The prefix of `ncclConfig_t` that NCCL 2.17 defined. NCCL copies only `size` bytes of a
/// caller's config and gives every later field its default, so this layout stays valid for
/// every NCCL since 2.17 whatever version the bindings were generated for.
#[repr(C)]
struct ConfigV21700 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl ConfigV21700 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    fn non_blocking() -> Self {
        const UNDEF_INT: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,  // NCCL_API_MAGIC
            version: 2_17_00, // NCCL_VERSION(2, 17, 0)
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The communicator
// ---------------------------------------------------------------------------------------------

/// A raw NCCL communicator handle; null once aborted.
struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread as long as calls on one communicator
// do not overlap; every call here holds the mutex around this handle. ncclCommAbort is the
// documented way to stop a communicator from another thread.
unsafe impl Send for RawComm {}

/// The part of a communicator the abort and watchdog threads share with it.
struct Shared {
    comm: Mutex<RawComm>,
    rank: usize,
    stream: Arc<CudaStream>,
    abort_timeout: Duration,
    /// set by abort(): every later call fails fast
    aborted: AtomicBool,
    /// the abort thread has been started (abort runs once)
    abort_started: AtomicBool,
    /// ncclCommAbort has returned
    abort_done: Mutex<bool>,
    abort_done_signal: Condvar,
    /// the first error, which poisons the communicator
    failure: Mutex<Option<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Marks the communicator aborted and runs ncclCommAbort on a helper thread, watched by a
    /// second thread that ends the process if the device does not come back.
    fn start_abort(self: &Arc<Self>, reason: &str) {
        self.aborted.store(true, Ordering::SeqCst);
        if self.abort_started.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::info!(rank = self.rank, reason, "aborting the NCCL communicator");
        let (finished, finished_signal) = std::sync::mpsc::channel::<()>();
        let state = self.clone();
        let spawned = std::thread::Builder::new().name("nccl-abort".into()).spawn(move || {
            state.abort_now();
            let _ = finished.send(());
        });
        if let Err(err) = spawned {
            tracing::warn!(rank = self.rank, error = %err, "cannot start the abort thread; aborting inline");
            self.abort_now();
            return;
        }
        let state = self.clone();
        let watchdog = std::thread::Builder::new()
            .name("nccl-abort-watchdog".into())
            .spawn(move || state.watch_abort(finished_signal));
        if let Err(err) = watchdog {
            tracing::warn!(rank = self.rank, error = %err, "cannot start the abort watchdog");
        }
    }

    fn abort_now(&self) {
        {
            let mut comm = lock(&self.comm);
            if !comm.0.is_null() {
                // NCCL's calls expect the communicator's device to be current on the caller.
                let _ = self.stream.context().bind_to_thread();
                // SAFETY: the handle is live (non-null) and no other call holds it (mutex).
                let result = unsafe { sys::ncclCommAbort(comm.0) };
                comm.0 = std::ptr::null_mut();
                if result != sys::ncclResult_t::ncclSuccess {
                    tracing::warn!(rank = self.rank, error = %error_string(result), "ncclCommAbort reported an error");
                }
            }
        }
        *lock(&self.abort_done) = true;
        self.abort_done_signal.notify_all();
    }

    /// The device worker is blocked on the stream until NCCL's kernels stop; if they do not
    /// (or ncclCommAbort itself hangs) nothing but a new process gets the device back.
    fn watch_abort(&self, finished: std::sync::mpsc::Receiver<()>) {
        let started = Instant::now();
        if finished.recv_timeout(self.abort_timeout).is_err() {
            exit_hung(self.rank, &format!("ncclCommAbort did not return within {:?}", self.abort_timeout));
        }
        loop {
            match stream_idle(&self.stream) {
                Ok(true) => return,
                Ok(false) => {}
                // A context in an error state fails every call at once: nothing blocks on it.
                Err(err) => {
                    tracing::warn!(rank = self.rank, error = %err, "the device reports an error after the abort");
                    return;
                }
            }
            if started.elapsed() > self.abort_timeout {
                exit_hung(
                    self.rank,
                    &format!("the device stream did not drain within {:?} of the abort", self.abort_timeout),
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_abort_done(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut done = lock(&self.abort_done);
        while !*done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            done = self.abort_done_signal.wait_timeout(done, left).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

fn stream_idle(stream: &CudaStream) -> Result<bool, DriverError> {
    use cudarc::driver::sys::CUresult;
    stream.context().bind_to_thread()?;
    // SAFETY: the stream is alive (we hold an Arc to it); cuStreamQuery only reads its state.
    match unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) } {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(DriverError(other)),
    }
}

fn exit_hung(rank: usize, what: &str) -> ! {
    tracing::error!(rank, code = EXIT_ABORT_HUNG, "{what}: exiting so that the rank is restarted");
    eprintln!("tpserve rank {rank}: {what}; exiting with code {EXIT_ABORT_HUNG} so that the rank is restarted");
    // _exit, not exit: the CUDA driver's and NCCL's exit handlers could block on the same
    // wedged device.
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(EXIT_ABORT_HUNG) }
}

/// One rank's NCCL communicator, bound to the rank's CUDA device and stream.
///
/// `Send + Sync`; calls are meant to come from the device worker's thread (they enqueue work
/// on its stream), except [`Collective::abort`], which any thread may call.
pub struct NcclCollective {
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    shared: Arc<Shared>,
    op_timeout: Duration,
}

impl fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("aborted", &self.shared.aborted.load(Ordering::Relaxed))
            .finish()
    }
}

impl NcclCollective {
    /// Joins the group named by `id` as `rank` of `world_size` on `device` (a CUDA device from
    /// [`open_device`]). Blocks until every rank has joined or `init_timeout` passes; on
    /// timeout the half-made communicator is aborted. Call it on the device worker's thread.
    pub fn init(
        id: &NcclId,
        rank: usize,
        world_size: usize,
        device: &Device,
        options: NcclOptions,
    ) -> CommResult<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Invalid {
                op: "init",
                reason: format!("rank {rank} is not valid for world size {world_size}"),
            });
        }
        let (Ok(nranks), Ok(my_rank)) = (c_int::try_from(world_size), c_int::try_from(rank)) else {
            return Err(CommError::Invalid { op: "init", reason: format!("world size {world_size} is too large") });
        };
        let Device::Cuda(cuda) = device else {
            return Err(CommError::Invalid {
                op: "init",
                reason: format!("NCCL needs a CUDA device, this rank runs on {device:?}"),
            });
        };
        let stream = cuda.cuda_stream();
        stream.context().bind_to_thread().map_err(|err| driver_error("init", err))?;
        let mut config = ConfigV21700::non_blocking();
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let started = Instant::now();
        // SAFETY: valid out-pointer and config; the id is 128 bytes by construction.
        let result = unsafe {
            sys::ncclCommInitRankConfig(
                &mut raw,
                nranks,
                id.raw(),
                my_rank,
                (&mut config as *mut ConfigV21700).cast::<sys::ncclConfig_t>(),
            )
        };
        if raw.is_null() {
            return Err(nccl_error("init", result, None));
        }
        let shared = Arc::new(Shared {
            comm: Mutex::new(RawComm(raw)),
            rank,
            stream: stream.clone(),
            abort_timeout: options.abort_timeout,
            aborted: AtomicBool::new(false),
            abort_started: AtomicBool::new(false),
            abort_done: Mutex::new(false),
            abort_done_signal: Condvar::new(),
            failure: Mutex::new(None),
        });
        // From here on, dropping `comm` on an error aborts the half-made communicator.
        let comm = Self { rank, world_size, device: cuda.clone(), stream, shared, op_timeout: options.op_timeout };
        comm.settle("init", result, options.init_timeout).map_err(|err| match err {
            CommError::Io { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => CommError::Io {
                op: "init",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "not all {world_size} ranks joined the NCCL communicator within {:?} \
                         (NCCL does not say which are missing)",
                        options.init_timeout
                    ),
                ),
            },
            other => other,
        })?;
        tracing::debug!(rank, world_size, elapsed = ?started.elapsed(), "NCCL communicator ready");
        Ok(comm)
    }

    fn device_of(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    /// The first error, or the abort, makes every later call fail fast.
    fn usable(&self, op: &'static str) -> CommResult<()> {
        if let Some(first) = lock(&self.shared.failure).as_ref() {
            return Err(CommError::Invalid { op, reason: format!("the communicator failed earlier: {first}") });
        }
        if self.shared.aborted.load(Ordering::SeqCst) {
            return Err(CommError::Aborted);
        }
        Ok(())
    }

    /// Records the first error, aborts the communicator and returns the error.
    fn fail(&self, error: CommError) -> CommError {
        {
            let mut failure = lock(&self.shared.failure);
            if failure.is_none() {
                *failure = Some(error.to_string());
            }
        }
        self.shared.start_abort("a collective failed");
        error
    }

    /// Runs one NCCL call (or a group of them) under the communicator's lock, then waits out
    /// `ncclInProgress` (the call is non-blocking) without the lock, so abort can get in.
    fn call(&self, op: &'static str, f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t) -> CommResult<()> {
        self.usable(op)?;
        let result = {
            let comm = lock(&self.shared.comm);
            if comm.0.is_null() {
                return Err(CommError::Aborted);
            }
            f(comm.0)
        };
        self.settle(op, result, self.op_timeout)
    }

    fn settle(&self, op: &'static str, result: sys::ncclResult_t, timeout: Duration) -> CommResult<()> {
        match result {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            sys::ncclResult_t::ncclInProgress => self.wait_ready(op, timeout),
            error => Err(self.fail(self.nccl_error(op, error))),
        }
    }

    /// Polls ncclCommGetAsyncError until the communicator leaves ncclInProgress.
    fn wait_ready(&self, op: &'static str, timeout: Duration) -> CommResult<()> {
        let deadline = Instant::now() + timeout;
        let mut polls = 0u32;
        loop {
            let state = {
                let comm = lock(&self.shared.comm);
                if comm.0.is_null() {
                    return Err(CommError::Aborted);
                }
                let mut state = sys::ncclResult_t::ncclInProgress;
                // SAFETY: live handle, valid out-pointer.
                let result = unsafe { sys::ncclCommGetAsyncError(comm.0, &mut state) };
                if result != sys::ncclResult_t::ncclSuccess {
                    drop(comm);
                    return Err(self.fail(self.nccl_error(op, result)));
                }
                state
            };
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                error => return Err(self.fail(self.nccl_error(op, error))),
            }
            if self.shared.aborted.load(Ordering::SeqCst) {
                return Err(CommError::Aborted);
            }
            if Instant::now() >= deadline {
                return Err(self.fail(timed_out(op, timeout)));
            }
            backoff(&mut polls);
        }
    }

    /// Waits on the host until the stream has run everything enqueued so far (bounded by the
    /// op timeout, cut short by an abort or an NCCL error).
    fn wait_stream(&self, op: &'static str) -> CommResult<()> {
        let event = self.stream.record_event(None).map_err(|err| self.fail(driver_error(op, err)))?;
        let deadline = Instant::now() + self.op_timeout;
        let mut polls = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(err) => return Err(self.fail(driver_error(op, err))),
            }
            self.usable(op)?;
            let async_error = {
                let comm = lock(&self.shared.comm);
                if comm.0.is_null() {
                    return Err(CommError::Aborted);
                }
                let mut state = sys::ncclResult_t::ncclSuccess;
                // SAFETY: live handle, valid out-pointer.
                unsafe { sys::ncclCommGetAsyncError(comm.0, &mut state) };
                state
            };
            if !matches!(async_error, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
                return Err(self.fail(self.nccl_error(op, async_error)));
            }
            if Instant::now() >= deadline {
                return Err(self.fail(timed_out(op, self.op_timeout)));
            }
            backoff(&mut polls);
        }
    }

    fn nccl_error(&self, op: &'static str, result: sys::ncclResult_t) -> CommError {
        let comm = lock(&self.shared.comm);
        let handle = (!comm.0.is_null()).then_some(comm.0);
        nccl_error(op, result, handle)
    }

    /// The tensor on this communicator's device, contiguous; `true` when it came from the host
    /// (the result then goes back there).
    fn on_device(&self, op: &'static str, tensor: &Tensor) -> CommResult<(Tensor, bool)> {
        match tensor.device() {
            Device::Cuda(device) if device.same_device(&self.device) => Ok((tensor.contiguous()?, false)),
            Device::Cpu => Ok((tensor.to_device(&self.device_of())?.contiguous()?, true)),
            other => Err(self.fail(CommError::Invalid {
                op,
                reason: format!("tensor is on {other:?}, the communicator on {:?}", self.device_of()),
            })),
        }
    }

    fn back(&self, op: &'static str, tensor: Tensor, to_host: bool) -> CommResult<Tensor> {
        if !to_host {
            return Ok(tensor);
        }
        // A plain device-to-host copy would block without a deadline if a peer never comes.
        self.wait_stream(op)?;
        Ok(tensor.to_device(&Device::Cpu)?)
    }

    /// Runs a custom op, turning its failure back into the CommError it recorded.
    fn apply<K: NcclKernel>(&self, tensor: &Tensor, op: &NcclOp<'_, K>) -> CommResult<Tensor> {
        let result = tensor.apply_op1_no_bwd(op);
        if let Some(error) = op.take_error() {
            return Err(error);
        }
        Ok(result?)
    }

    /// Every rank's shape for all_gather / gather, checked against this rank's: same dtype,
    /// same number of dims, same dims except `dim`. Waits for the exchange on the host.
    fn exchange_shapes(&self, op: &'static str, tensor: &Tensor, dim: usize) -> CommResult<Vec<Vec<usize>>> {
        let dims = tensor.dims();
        if dims.len() > MAX_DIMS {
            return Err(self.fail(CommError::Invalid { op, reason: format!("{} dims, at most {MAX_DIMS}", dims.len()) }));
        }
        if dim >= dims.len() {
            return Err(self.fail(CommError::Invalid { op, reason: format!("dim {dim} out of range for shape {dims:?}") }));
        }
        let mut mine = [0u64; DESCRIPTOR_LEN];
        mine[0] = dtype_code(tensor.dtype());
        mine[1] = dims.len() as u64;
        for (slot, &d) in mine[2..].iter_mut().zip(dims) {
            *slot = d as u64;
        }
        let send = self.stream.clone_htod(&mine[..]).map_err(|err| self.fail(driver_error(op, err)))?;
        // SAFETY: NCCL writes every element before the host reads it (after wait_stream).
        let mut all = unsafe { self.stream.alloc::<u64>(DESCRIPTOR_LEN * self.world_size) }
            .map_err(|err| self.fail(driver_error(op, err)))?;
        {
            let stream = self.stream.clone();
            let (src, _read) = send.device_ptr(&stream);
            let (dst, _write) = all.device_ptr_mut(&stream);
            self.call(op, |comm| unsafe {
                sys::ncclAllGather(
                    src as *const c_void,
                    dst as *mut c_void,
                    DESCRIPTOR_LEN,
                    sys::ncclDataType_t::ncclUint64,
                    comm,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })?;
        }
        self.wait_stream(op)?;
        let all = self.stream.clone_dtoh(&all).map_err(|err| self.fail(driver_error(op, err)))?;
        let mut shapes = Vec::with_capacity(self.world_size);
        for (peer, theirs) in all.chunks_exact(DESCRIPTOR_LEN).enumerate() {
            let mismatch = |what: String| {
                self.fail(CommError::Invalid { op, reason: format!("rank {peer} disagrees with rank {}: {what}", self.rank) })
            };
            if theirs[0] != mine[0] {
                return Err(mismatch(format!("dtype code {} vs {}", theirs[0], mine[0])));
            }
            if theirs[1] != mine[1] {
                return Err(mismatch(format!("{} dims vs {}", theirs[1], mine[1])));
            }
            let shape: Vec<usize> = theirs[2..2 + dims.len()].iter().map(|&d| d as usize).collect();
            if shape.iter().zip(dims).enumerate().any(|(i, (a, b))| i != dim && a != b) {
                return Err(mismatch(format!("shape {shape:?} vs {dims:?} (only dim {dim} may differ)")));
            }
            shapes.push(shape);
        }
        Ok(shapes)
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        self.shared.start_abort("the communicator was dropped");
        // The watchdog ends the process if the abort hangs; the bound only guards against a
        // watchdog that could not be started.
        self.shared.wait_abort_done(self.shared.abort_timeout.saturating_mul(2));
    }
}

/// Spins briefly (an enqueue that returned ncclInProgress is usually done at once), then backs
/// off so that a long wait, such as init waiting for the other ranks, costs no core.
fn backoff(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    match *polls {
        0..64 => std::thread::yield_now(),
        64..1024 => std::thread::sleep(Duration::from_micros(50)),
        _ => std::thread::sleep(Duration::from_millis(1)),
    }
}

fn timed_out(op: &'static str, waited: Duration) -> CommError {
    CommError::Io {
        op,
        source: std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("timed out after {waited:?} (NCCL does not say which rank is missing)"),
        ),
    }
}

fn driver_error(op: &'static str, err: DriverError) -> CommError {
    CommError::Io { op, source: std::io::Error::other(format!("CUDA: {err}")) }
}

fn error_string(result: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static NUL-terminated string for every result code.
    let text = unsafe { sys::ncclGetErrorString(result) };
    if text.is_null() {
        return format!("{result:?}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("{result:?} ({text})")
}

fn nccl_error(op: &'static str, result: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> CommError {
    let mut message = error_string(result);
    if let Some(comm) = comm {
        // SAFETY: live handle (the caller holds its lock); NCCL returns a NUL-terminated string.
        let last = unsafe { sys::ncclGetLastError(comm) };
        if !last.is_null() {
            // SAFETY: as above.
            let last = unsafe { CStr::from_ptr(last) }.to_string_lossy();
            if !last.is_empty() {
                message.push_str(": ");
                message.push_str(&last);
            }
        }
    }
    match result {
        sys::ncclResult_t::ncclInvalidArgument | sys::ncclResult_t::ncclInvalidUsage => {
            CommError::Invalid { op, reason: format!("NCCL: {message}") }
        }
        _ => CommError::Io { op, source: std::io::Error::other(format!("NCCL: {message}")) },
    }
}

/// The shared wire code of `dtype` (see `comm::dtype`), 255 for a dtype without one, as the
/// first word of a shape descriptor.
fn dtype_code(dtype: DType) -> u64 {
    dtype::code(dtype).map_or(255, u64::from)
}

/// NCCL's type for a reduction; None where NCCL cannot sum the dtype.
fn reduce_type(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::BF16 => T::ncclBfloat16,
        DType::F16 => T::ncclFloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        _ => return None,
    })
}

/// The parts of a flat buffer (rank r's elements at `offsets[r]`), each reshaped to that
/// rank's shape and concatenated along `dim`.
fn assemble(flat: &Tensor, shapes: &[Vec<usize>], offsets: &[usize], dim: usize) -> CommResult<Tensor> {
    let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let mut total_shape = shapes[0].clone();
    total_shape[dim] = shapes.iter().map(|s| s[dim]).sum();
    // When the parts lie back to back and nothing but ones precedes `dim`, rank-major order
    // already is the concatenation (always for dim 0; for a batch-1 row of logits too).
    let back_to_back = offsets.iter().zip(&lens).try_fold(0, |next, (&offset, &len)| (offset == next).then_some(offset + len));
    if let Some(total) = back_to_back
        && shapes[0][..dim].iter().all(|&d| d == 1)
    {
        return Ok(flat.narrow(0, 0, total)?.reshape(total_shape)?);
    }
    let parts: Vec<Tensor> = shapes
        .iter()
        .zip(offsets.iter().zip(&lens))
        .filter(|(_, (_, len))| **len > 0)
        .map(|(shape, (&offset, &len))| flat.narrow(0, offset, len)?.reshape(shape.clone()))
        .collect::<candle_core::Result<_>>()?;
    if parts.is_empty() {
        return Ok(Tensor::zeros(total_shape, flat.dtype(), flat.device())?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

// ---------------------------------------------------------------------------------------------
// The custom ops: NCCL calls inside the forward pass
// ---------------------------------------------------------------------------------------------

/// Dispatches over the dtypes a CUDA storage can hold; the body sees `$s: &CudaSlice<T>`.
macro_rules! with_slice {
    ($storage:expr, $s:ident => $body:expr, $unsupported:expr) => {
        match &$storage.slice {
            CudaStorageSlice::U8($s) => $body,
            CudaStorageSlice::U32($s) => $body,
            CudaStorageSlice::I16($s) => $body,
            CudaStorageSlice::I32($s) => $body,
            CudaStorageSlice::I64($s) => $body,
            CudaStorageSlice::BF16($s) => $body,
            CudaStorageSlice::F16($s) => $body,
            CudaStorageSlice::F32($s) => $body,
            CudaStorageSlice::F64($s) => $body,
            CudaStorageSlice::F8E4M3($s) => $body,
            CudaStorageSlice::F6E2M3(_)
            | CudaStorageSlice::F6E3M2(_)
            | CudaStorageSlice::F4(_)
            | CudaStorageSlice::F8E8M0(_) => $unsupported,
        }
    };
}

/// What one collective enqueues on the stream; [`NcclOp`] turns it into a candle custom op.
trait NcclKernel {
    /// candle's name for the op.
    const NAME: &'static str;
    /// The operation a [`CommError`] names.
    const OP: &'static str;

    /// Refuses a dtype before the storage is dispatched on (all-reduce: NCCL cannot sum it).
    fn check(&self, _dtype: DType) -> CommResult<()> {
        Ok(())
    }

    /// Enqueues the collective on `src[start..end]` and returns the storage of the result.
    fn run<T: DeviceRepr + CudaDType>(
        &self,
        comm: &NcclCollective,
        src: &CudaSlice<T>,
        start: usize,
        end: usize,
        dtype: DType,
        device: &CudaDevice,
    ) -> CommResult<CudaStorage>;

    /// Shape of the result for an input with `layout`.
    fn out_shape(&self, comm: &NcclCollective, layout: &Layout) -> Shape;
}

/// A collective as a candle custom op. The op records a [`CommError`] so the caller can return
/// it as such (candle's error type would flatten it, and the rank server tells collective
/// failures, which need recovery, from bad input by that type).
struct NcclOp<'a, K> {
    comm: &'a NcclCollective,
    kernel: K,
    error: RefCell<Option<CommError>>,
}

impl<'a, K: NcclKernel> NcclOp<'a, K> {
    fn new(comm: &'a NcclCollective, kernel: K) -> Self {
        Self { comm, kernel, error: RefCell::new(None) }
    }

    fn take_error(&self) -> Option<CommError> {
        self.error.borrow_mut().take()
    }

    fn record(&self, error: CommError) -> candle_core::Error {
        let text = error.to_string();
        *self.error.borrow_mut() = Some(error);
        candle_core::Error::Msg(text)
    }
}

impl<K: NcclKernel> CustomOp1 for NcclOp<'_, K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(format!("{} runs on CUDA tensors only", K::NAME)))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let result = (|| {
            let (start, end) = contiguous_range(K::OP, layout)?;
            let dtype = storage_dtype(storage);
            self.kernel.check(dtype)?;
            with_slice!(storage, s => self.kernel.run(self.comm, s, start, end, dtype, &storage.device), Err(CommError::Invalid {
                op: K::OP,
                reason: format!("unsupported dtype {dtype:?}"),
            }))
        })();
        match result {
            Ok(out) => Ok((out, self.kernel.out_shape(self.comm, layout))),
            Err(error) => Err(self.record(error)),
        }
    }
}

/// The contiguous element range of a layout (every op makes its input contiguous first).
fn contiguous_range(op: &'static str, layout: &Layout) -> CommResult<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| CommError::Invalid { op, reason: "tensor is not contiguous".into() })
}

/// NCCL's type for summing `dtype`, or why it cannot.
fn sum_type(dtype: DType) -> CommResult<sys::ncclDataType_t> {
    reduce_type(dtype).ok_or_else(|| CommError::Invalid { op: "all_reduce", reason: format!("NCCL cannot sum {dtype:?}") })
}

/// Sum over ranks, into a new buffer.
struct AllReduce;

impl NcclKernel for AllReduce {
    const NAME: &'static str = "nccl-all-reduce";
    const OP: &'static str = "all_reduce";

    fn check(&self, dtype: DType) -> CommResult<()> {
        sum_type(dtype).map(drop)
    }

    fn run<T: DeviceRepr + CudaDType>(
        &self,
        comm: &NcclCollective,
        src: &CudaSlice<T>,
        start: usize,
        end: usize,
        dtype: DType,
        device: &CudaDevice,
    ) -> CommResult<CudaStorage> {
        let nccl_type = sum_type(dtype)?;
        let stream = comm.stream.clone();
        let len = end - start;
        // SAFETY: NCCL writes every element of the result.
        let mut out = unsafe { stream.alloc::<T>(len) }.map_err(|err| comm.fail(driver_error("all_reduce", err)))?;
        {
            let view = src.slice(start..end);
            let (src_ptr, _read) = view.device_ptr(&stream);
            let (dst_ptr, _write) = out.device_ptr_mut(&stream);
            comm.call("all_reduce", |handle| unsafe {
                sys::ncclAllReduce(
                    src_ptr as *const c_void,
                    dst_ptr as *mut c_void,
                    len,
                    nccl_type,
                    sys::ncclRedOp_t::ncclSum,
                    handle,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
    }

    fn out_shape(&self, _: &NcclCollective, layout: &Layout) -> Shape {
        layout.shape().clone()
    }
}

/// Every rank's elements, each padded to `slot` elements, rank-major: `[world * slot]`.
struct AllGather {
    slot: usize,
}

impl NcclKernel for AllGather {
    const NAME: &'static str = "nccl-all-gather";
    const OP: &'static str = "all_gather";

    fn run<T: DeviceRepr + CudaDType>(
        &self,
        comm: &NcclCollective,
        src: &CudaSlice<T>,
        start: usize,
        end: usize,
        _dtype: DType,
        device: &CudaDevice,
    ) -> CommResult<CudaStorage> {
        let stream = comm.stream.clone();
        let fail = |err| comm.fail(driver_error("all_gather", err));
        let (len, slot) = (end - start, self.slot);
        // SAFETY: NCCL writes every slot; padding past a rank's length is never read.
        let mut out = unsafe { stream.alloc::<T>(slot * comm.world_size) }.map_err(fail)?;
        // NCCL's all-gather moves equal counts: a shorter part travels in a padded copy.
        let padded = if len < slot {
            // SAFETY: the first `len` elements are written below; the rest is never read.
            let mut padded = unsafe { stream.alloc::<T>(slot) }.map_err(fail)?;
            if len > 0 {
                stream.memcpy_dtod(&src.slice(start..end), &mut padded.slice_mut(0..len)).map_err(fail)?;
            }
            Some(padded)
        } else {
            None
        };
        {
            let view = match &padded {
                Some(padded) => padded.slice(0..slot),
                None => src.slice(start..end),
            };
            let bytes = slot * std::mem::size_of::<T>();
            let (src_ptr, _read) = view.device_ptr(&stream);
            let (dst_ptr, _write) = out.device_ptr_mut(&stream);
            comm.call("all_gather", |handle| unsafe {
                sys::ncclAllGather(
                    src_ptr as *const c_void,
                    dst_ptr as *mut c_void,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    handle,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })?;
        }
        // `padded` is freed in stream order, after the all-gather has read it.
        drop(padded);
        Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
    }

    fn out_shape(&self, comm: &NcclCollective, _: &Layout) -> Shape {
        Shape::from(self.slot * comm.world_size)
    }
}

/// On the root: every rank's elements at `offsets[r]` (`[total]`), received point to point.
struct GatherRoot {
    offsets: Vec<usize>,
    lens: Vec<usize>,
}

impl NcclKernel for GatherRoot {
    const NAME: &'static str = "nccl-gather";
    const OP: &'static str = "gather";

    fn run<T: DeviceRepr + CudaDType>(
        &self,
        comm: &NcclCollective,
        src: &CudaSlice<T>,
        start: usize,
        end: usize,
        _dtype: DType,
        device: &CudaDevice,
    ) -> CommResult<CudaStorage> {
        let stream = comm.stream.clone();
        let fail = |err| comm.fail(driver_error("gather", err));
        let total: usize = self.lens.iter().sum();
        // SAFETY: every rank's range is written (received or copied) before it is read.
        let mut out = unsafe { stream.alloc::<T>(total.max(1)) }.map_err(fail)?;
        let own = (self.offsets[comm.rank], self.lens[comm.rank]);
        if own.1 > 0 {
            stream.memcpy_dtod(&src.slice(start..end), &mut out.slice_mut(own.0..own.0 + own.1)).map_err(fail)?;
        }
        let size = std::mem::size_of::<T>();
        let peers: Vec<usize> = (0..comm.world_size).filter(|&r| r != comm.rank && self.lens[r] > 0).collect();
        if peers.is_empty() {
            return Ok(CudaStorage::wrap_cuda_slice(out, device.clone()));
        }
        {
            let (base, _write) = out.device_ptr_mut(&stream);
            let cu_stream = stream.cu_stream() as sys::cudaStream_t;
            comm.call("gather", |handle| unsafe {
                let started = sys::ncclGroupStart();
                if started != sys::ncclResult_t::ncclSuccess {
                    return started;
                }
                let mut first_error = sys::ncclResult_t::ncclSuccess;
                for &peer in &peers {
                    let dst = base + (self.offsets[peer] * size) as u64;
                    let result = sys::ncclRecv(
                        dst as *mut c_void,
                        self.lens[peer] * size,
                        sys::ncclDataType_t::ncclUint8,
                        peer as c_int,
                        handle,
                        cu_stream,
                    );
                    if result != sys::ncclResult_t::ncclSuccess && first_error == sys::ncclResult_t::ncclSuccess {
                        first_error = result;
                    }
                }
                // The group must be closed even after an error, or the next call joins it.
                let ended = sys::ncclGroupEnd();
                if first_error != sys::ncclResult_t::ncclSuccess { first_error } else { ended }
            })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
    }

    fn out_shape(&self, _: &NcclCollective, _: &Layout) -> Shape {
        Shape::from(self.lens.iter().sum::<usize>().max(1))
    }
}

/// The root's elements on every rank, into a new buffer.
struct Broadcast {
    root: usize,
}

impl NcclKernel for Broadcast {
    const NAME: &'static str = "nccl-broadcast";
    const OP: &'static str = "broadcast";

    fn run<T: DeviceRepr + CudaDType>(
        &self,
        comm: &NcclCollective,
        src: &CudaSlice<T>,
        start: usize,
        end: usize,
        _dtype: DType,
        device: &CudaDevice,
    ) -> CommResult<CudaStorage> {
        let stream = comm.stream.clone();
        let len = end - start;
        // SAFETY: NCCL writes every element of the result.
        let mut out = unsafe { stream.alloc::<T>(len) }.map_err(|err| comm.fail(driver_error("broadcast", err)))?;
        {
            let view = src.slice(start..end);
            let (src_ptr, _read) = view.device_ptr(&stream);
            let (dst_ptr, _write) = out.device_ptr_mut(&stream);
            let root = self.root as c_int;
            comm.call("broadcast", |handle| unsafe {
                sys::ncclBroadcast(
                    src_ptr as *const c_void,
                    dst_ptr as *mut c_void,
                    len * std::mem::size_of::<T>(),
                    sys::ncclDataType_t::ncclUint8,
                    root,
                    handle,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
    }

    fn out_shape(&self, _: &NcclCollective, layout: &Layout) -> Shape {
        layout.shape().clone()
    }
}

fn storage_dtype(storage: &CudaStorage) -> DType {
    use candle_core::backend::BackendStorage;
    storage.dtype()
}

impl NcclCollective {
    fn check_root(&self, op: &'static str, root: usize) -> CommResult<()> {
        if root >= self.world_size {
            return Err(self.fail(CommError::Invalid {
                op,
                reason: format!("root {root} is not a rank of a group of {}", self.world_size),
            }));
        }
        Ok(())
    }

    /// Gather of `input` (on this communicator's device) given every rank's shape: non-roots
    /// send, the root receives and concatenates along `dim`.
    fn gather_shaped(
        &self,
        input: &Tensor,
        to_host: bool,
        shapes: &[Vec<usize>],
        dim: usize,
        root: usize,
    ) -> CommResult<Option<Tensor>> {
        if self.rank != root {
            self.send_to_root(input, root)?;
            if to_host {
                // The send reads `input`, which the host-side caller cannot keep alive.
                self.wait_stream("gather")?;
            }
            return Ok(None);
        }
        let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0, |next, &len| {
                *next += len;
                Some(*next - len)
            })
            .collect();
        let op = NcclOp::new(self, GatherRoot { offsets: offsets.clone(), lens });
        let flat = self.apply(input, &op)?;
        let out = assemble(&flat, shapes, &offsets, dim)?;
        Ok(Some(self.back("gather", out, to_host)?))
    }

    /// A non-root rank's part of gather: its elements to the root, point to point.
    fn send_to_root(&self, tensor: &Tensor, root: usize) -> CommResult<()> {
        let (storage, layout) = tensor.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            return Err(self.fail(CommError::Invalid { op: "gather", reason: "tensor is not on the CUDA device".into() }));
        };
        let (start, end) = contiguous_range("gather", layout).map_err(|err| self.fail(err))?;
        if start == end {
            return Ok(());
        }
        let stream = self.stream.clone();
        let send = |ptr: u64, bytes: usize| {
            self.call("gather", |handle| unsafe {
                sys::ncclSend(
                    ptr as *const c_void,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    root as c_int,
                    handle,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })
        };
        with_slice!(storage, s => {
            let view = s.slice(start..end);
            let (ptr, _read) = view.device_ptr(&stream);
            send(ptr, (end - start) * elem_size(s))
        }, Err(self.fail(CommError::Invalid {
            op: "gather",
            reason: format!("unsupported dtype {:?}", tensor.dtype()),
        })))
    }
}

fn elem_size<T>(_: &CudaSlice<T>) -> usize {
    std::mem::size_of::<T>()
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, tensor: &Tensor) -> CommResult<Tensor> {
        self.usable("all_reduce")?;
        if tensor.elem_count() == 0 {
            return Ok(tensor.clone());
        }
        let (input, to_host) = self.on_device("all_reduce", tensor)?;
        let op = NcclOp::new(self, AllReduce);
        let out = self.apply(&input, &op)?;
        self.back("all_reduce", out, to_host)
    }

    fn all_gather(&self, tensor: &Tensor, dim: usize) -> CommResult<Tensor> {
        self.usable("all_gather")?;
        let (input, to_host) = self.on_device("all_gather", tensor)?;
        let shapes = self.exchange_shapes("all_gather", &input, dim)?;
        let slot = shapes.iter().map(|s| s.iter().product::<usize>()).max().unwrap_or(0);
        let out = if slot == 0 {
            let mut shape = shapes[0].clone();
            shape[dim] = shapes.iter().map(|s| s[dim]).sum();
            Tensor::zeros(shape, input.dtype(), input.device())?
        } else {
            let op = NcclOp::new(self, AllGather { slot });
            let flat = self.apply(&input, &op)?;
            let offsets: Vec<usize> = (0..self.world_size).map(|r| r * slot).collect();
            assemble(&flat, &shapes, &offsets, dim)?
        };
        self.back("all_gather", out, to_host)
    }

    fn gather(&self, tensor: &Tensor, dim: usize, root: usize) -> CommResult<Option<Tensor>> {
        self.usable("gather")?;
        self.check_root("gather", root)?;
        let (input, to_host) = self.on_device("gather", tensor)?;
        let shapes = self.exchange_shapes("gather", &input, dim)?;
        self.gather_shaped(&input, to_host, &shapes, dim, root)
    }

    /// No shape exchange: the shapes follow from the sizes every rank was given, so nothing
    /// waits on the host (the lm_head's logits, every step).
    fn gather_sized(&self, tensor: &Tensor, dim: usize, root: usize, sizes: &[usize]) -> CommResult<Option<Tensor>> {
        self.usable("gather")?;
        self.check_root("gather", root)?;
        let shapes = super::known_shapes("gather", tensor.dims(), dim, sizes, self.rank, self.world_size)
            .map_err(|err| self.fail(err))?;
        let (input, to_host) = self.on_device("gather", tensor)?;
        self.gather_shaped(&input, to_host, &shapes, dim, root)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> CommResult<Tensor> {
        self.usable("broadcast")?;
        self.check_root("broadcast", root)?;
        if tensor.elem_count() == 0 {
            return Ok(tensor.clone());
        }
        let (input, to_host) = self.on_device("broadcast", tensor)?;
        let op = NcclOp::new(self, Broadcast { root });
        let out = self.apply(&input, &op)?;
        self.back("broadcast", out, to_host)
    }

    fn barrier(&self) -> CommResult<()> {
        self.usable("barrier")?;
        let token = Tensor::zeros(1, DType::F32, &self.device_of())?;
        let op = NcclOp::new(self, AllReduce);
        let _sum = self.apply(&token, &op)?;
        self.wait_stream("barrier")
    }

    fn abort(&self) {
        self.shared.start_abort("abort requested");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_reject_bad_input() {
        let mut bytes = [0u8; NCCL_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let id = NcclId::from_bytes(&bytes).expect("128 bytes");
        assert_eq!(id.to_bytes(), bytes.to_vec());
        assert_eq!(NcclId::from_hex(&id.to_hex()).expect("hex"), id);
        assert!(matches!(NcclId::from_bytes(&bytes[..100]), Err(CommError::InvalidId(_))));
        assert!(matches!(NcclId::from_bytes(b"tpcomm1;tcp://h:1;00"), Err(CommError::InvalidId(_))));
        assert!(matches!(NcclId::from_hex("zz"), Err(CommError::InvalidId(_))));
    }

    #[test]
    fn config_prefix_matches_nccl_2_17() {
        // size_t, 2 x unsigned, 4 x int, a pointer: 8 + 8 + 16 + 8 on 64-bit targets.
        assert_eq!(std::mem::size_of::<ConfigV21700>(), 40);
        assert_eq!(ConfigV21700::non_blocking().version, 21700);
    }
}
