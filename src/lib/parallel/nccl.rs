//! The NCCL communicator for CUDA ranks (one process per GPU), on cudarc's raw NCCL calls.
//!
//! - Init: rank 0 makes the unique id (`ncclGetUniqueId`) and hands it out through the
//!   rendezvous store; every rank calls `ncclCommInitRank`. A world of one is a real
//!   one-rank communicator (the calls run, and cost what NCCL costs for one rank).
//! - Streams: collectives run on the communicator's own stream. `start` records an event on
//!   the backend's compute stream and makes the communication stream wait for it (so the
//!   inputs are ready), enqueues the group between `ncclGroupStart`/`ncclGroupEnd`, and records
//!   an event after it; `Work::wait` makes the compute stream wait for that event (the host
//!   does not block). Kernels queued between the two overlap the communication.
//! - Failures: a watchdog thread polls `ncclCommGetAsyncError` and the pending events; a
//!   timer thread that makes no CUDA or NCCL call (those can block behind the main thread's
//!   sync) times them. A collective older than the timeout fails the job, naming the ranks that have not started
//!   it (from the store's heartbeat counts); the failure (or one relayed by the store) calls
//!   `ncclCommAbort`, which releases kernels spinning on a dead peer, and the process ends
//!   within the grace period even if the main thread is stuck in a device sync.
//! - Reductions: NCCL's own order (ring or tree: not rank order, so sums are not bitwise equal
//!   to a host loop). Avg is `ncclAvg`; Scaled(s) is `ncclRedOpCreatePreMulSum` (at most one
//!   distinct scale per group).

use super::comm::{dtype_bytes, Collective, Comm, Kind, Pending, ReduceOp, Work};
use super::group::ProcessGroup;
use super::health::Health;
use super::store::Prober;
use crate::backend::cuda::{CudaBackend, CudaBuf, NO_DRIVER};
use crate::backend::{DType, Device};
use crate::error::input_error;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as dr, sys as dsys, CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::{result as nr, sys as ns};
use half::bf16;
use std::collections::VecDeque;
use std::ffi::{c_void, CStr};
use std::marker::PhantomData;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// NCCL's `ncclRedOp_t` as the C int it is: the ops `ncclRedOpCreatePreMulSum` makes are ints
/// outside cudarc's Rust enum (NCCL 2.28 numbers them far past `ncclNumOps`), and holding one in
/// that enum would be undefined behaviour, so the calls that take an op go through [`raw`].
type RawOp = std::ffi::c_int;

/// The NCCL calls that take a reduction op, bound from the library cudarc loaded, with the op
/// typed as [`RawOp`].
mod raw {
    use super::RawOp;
    use cudarc::nccl::{result::NcclError, sys as ns};
    use std::ffi::c_void;
    use std::sync::OnceLock;

    type Reduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ns::ncclDataType_t,
        RawOp,
        ns::ncclComm_t,
        ns::cudaStream_t,
    ) -> ns::ncclResult_t;
    type Destroy = unsafe extern "C" fn(RawOp, ns::ncclComm_t) -> ns::ncclResult_t;

    /// # Safety
    /// `name` must be the NUL-terminated name of an NCCL function of type `T`.
    unsafe fn symbol<T: Copy>(name: &[u8]) -> T {
        // SAFETY: the caller names a function of type T; the library lives for the process.
        unsafe {
            *ns::culib()
                .get::<T>(name)
                .unwrap_or_else(|e| panic!("NCCL has no {}: {e}", String::from_utf8_lossy(name)))
        }
    }

    fn ok(r: ns::ncclResult_t) -> Result<(), NcclError> {
        r.result().map(|_| ())
    }

    /// # Safety
    /// As `ncclAllReduce`.
    pub unsafe fn all_reduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dt: ns::ncclDataType_t,
        op: RawOp,
        comm: ns::ncclComm_t,
        stream: ns::cudaStream_t,
    ) -> Result<(), NcclError> {
        static F: OnceLock<Reduce> = OnceLock::new();
        // SAFETY: ncclAllReduce has the `Reduce` signature (nccl.h of NCCL 2.x).
        let f = *F.get_or_init(|| unsafe { symbol(b"ncclAllReduce\0") });
        // SAFETY: the caller keeps ncclAllReduce's contract (this function's # Safety).
        ok(unsafe { f(send, recv, count, dt, op, comm, stream) })
    }

    /// # Safety
    /// As `ncclReduceScatter`.
    pub unsafe fn reduce_scatter(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dt: ns::ncclDataType_t,
        op: RawOp,
        comm: ns::ncclComm_t,
        stream: ns::cudaStream_t,
    ) -> Result<(), NcclError> {
        static F: OnceLock<Reduce> = OnceLock::new();
        // SAFETY: ncclReduceScatter has the `Reduce` signature (nccl.h of NCCL 2.x).
        let f = *F.get_or_init(|| unsafe { symbol(b"ncclReduceScatter\0") });
        // SAFETY: the caller keeps ncclReduceScatter's contract (this function's # Safety).
        ok(unsafe { f(send, recv, count, dt, op, comm, stream) })
    }

    /// # Safety
    /// As `ncclRedOpDestroy`.
    pub(crate) unsafe fn reduce_op_destroy(
        op: RawOp,
        comm: ns::ncclComm_t,
    ) -> Result<(), NcclError> {
        static F: OnceLock<Destroy> = OnceLock::new();
        // SAFETY: ncclRedOpDestroy has the `Destroy` signature (nccl.h of NCCL 2.x).
        let f = *F.get_or_init(|| unsafe { symbol(b"ncclRedOpDestroy\0") });
        // SAFETY: the caller keeps ncclRedOpDestroy's contract (this function's # Safety).
        ok(unsafe { f(op, comm) })
    }
}

/// GPUs this process sees (an input error naming the fix when there is no driver).
pub(crate) fn visible_gpus() -> Result<usize> {
    // SAFETY: is_culib_present only tries to load the driver library; it has no preconditions.
    if !unsafe { dsys::is_culib_present() } {
        return Err(input_error(NO_DRIVER));
    }
    catch_unwind(|| dr::init().and_then(|_| dr::device::get_count()))
        .map_err(|_| input_error(format!("{NO_DRIVER} (the driver library is unusable)")))?
        .map(|n| n.max(0) as usize)
        .map_err(|e| input_error(format!("{NO_DRIVER} ({e:?})")))
}

/// NCCL's version as (major, minor, patch); an input error when libnccl cannot be loaded.
pub(crate) fn nccl_version() -> Result<(i32, i32, i32)> {
    // SAFETY: is_culib_present only tries to load libnccl; it has no preconditions.
    if !unsafe { ns::is_culib_present() } {
        return Err(input_error(
            "libnccl not found: CUDA ranks communicate through NCCL 2.x, which must be on the \
             library path as libnccl.so (pip's nvidia-nccl wheel ships libnccl.so.2: link it as \
             libnccl.so in a directory on LD_LIBRARY_PATH); or use --device cpu",
        ));
    }
    let v = catch_unwind(nr::get_nccl_version)
        .map_err(|_| {
            input_error("libnccl is unusable (a symbol is missing); use NCCL 2.28 or newer")
        })?
        .map_err(|e| anyhow!("ncclGetVersion: {}", error_text(e.0, None)))?;
    Ok((v / 10000, (v % 10000) / 100, v % 100))
}

fn error_text(code: ns::ncclResult_t, comm: Option<ns::ncclComm_t>) -> String {
    let cstr = |p: *const std::ffi::c_char| {
        // SAFETY: NCCL returns static or per-thread NUL-terminated C strings (or null, skipped).
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // SAFETY: ncclGetErrorString takes any result code and returns a static string.
    let what = cstr(unsafe { ns::ncclGetErrorString(code) }).unwrap_or_default();
    let last = comm
        // SAFETY: `c` is the caller's live communicator (the one whose call failed).
        .and_then(|c| cstr(unsafe { ns::ncclGetLastError(c) }))
        .filter(|s| !s.is_empty())
        .map(|s| format!(": {s}"))
        .unwrap_or_default();
    format!("{code:?} ({what}){last}")
}

fn nccl_type(d: DType) -> ns::ncclDataType_t {
    match d {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
    }
}

/// The address of element `off` of a buffer.
fn at(buf: &CudaBuf, off: usize) -> *mut c_void {
    let (ptr, _, dtype) = buf.raw();
    (ptr + (off * dtype_bytes(dtype)) as u64) as *mut c_void
}

/// A collective enqueued and not yet seen complete by the watchdog.
struct Watched {
    done: Arc<CudaEvent>,
    /// Index of its first collective among the group's (the heartbeat count before it).
    first: u64,
    what: String,
    started: Instant,
}

/// What the communicator shares with its watchdog thread and its abort hook.
struct Shared {
    rank: usize,
    /// The NCCL communicator; null once aborted or destroyed.
    comm: AtomicPtr<ns::ncclComm>,
    /// Held around every NCCL call of the main thread.
    calls: Mutex<()>,
    pending: Mutex<VecDeque<Watched>>,
    /// The group the main thread is enqueueing (first collective, name, since): NCCL's first
    /// collective of a kind connects to the peers inside `ncclGroupEnd`, which blocks until
    /// they take part, before there is an event to watch.
    enqueueing: Mutex<Option<(u64, String, Instant)>>,
    timeout_ms: AtomicU64,
    stop: AtomicBool,
    health: Arc<Health>,
    prober: Option<Prober>,
}

impl Shared {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// `ncclCommAbort`, once. A main-thread call blocked inside NCCL holds `calls`; abort is
    /// what releases it, so after a short wait it goes ahead without the lock.
    fn abort(&self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        let _guard = loop {
            match self.calls.try_lock() {
                Ok(g) => break Some(g),
                Err(_) if Instant::now() >= deadline => break None,
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let comm = self.comm.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !comm.is_null() {
            // SAFETY: a communicator made by ncclCommInitRank, aborted once (the swap).
            unsafe {
                let _ = nr::comm_abort(comm);
            }
        }
    }

    /// Fails the job when NCCL reports an asynchronous error or a pending collective's event
    /// reports a CUDA error; pops the collectives seen complete. Never holds `pending` while it
    /// calls into CUDA or NCCL: such a call can block behind the main thread's (a synchronous
    /// copy waiting on a collective a peer never joins), and [`Shared::time`] must still run.
    fn watch(&self) {
        loop {
            std::thread::sleep(Duration::from_millis(50));
            if self.stop.load(Ordering::SeqCst) || self.health.failure().is_some() {
                return;
            }
            let comm = self.comm.load(Ordering::SeqCst);
            if !comm.is_null() {
                let mut code = 0u32;
                // SAFETY: meant to be polled from another thread; the result is read as a
                // plain integer (NCCL may add codes cudarc's enum lacks).
                unsafe {
                    let _ = ns::ncclCommGetAsyncError(
                        comm,
                        &mut code as *mut u32 as *mut ns::ncclResult_t,
                    );
                }
                let in_progress = ns::ncclResult_t::ncclInProgress as u32;
                if code != 0 && code != in_progress {
                    self.health.fail(
                        None,
                        format!(
                            "rank {}: NCCL reported an asynchronous error (code {code}): a peer \
                             failed or the network broke",
                            self.rank
                        ),
                    );
                    return;
                }
            }
            loop {
                let front = self.pending.lock().unwrap().front().map(|w| w.done.clone());
                let Some(done) = front else { break };
                match done.try_is_complete() {
                    Ok(true) => {
                        let mut pending = self.pending.lock().unwrap();
                        if pending.front().is_some_and(|w| Arc::ptr_eq(&w.done, &done)) {
                            pending.pop_front();
                        }
                    }
                    Ok(false) => break,
                    Err(e) => {
                        let what = self.pending.lock().unwrap().front().map(|w| w.what.clone());
                        let msg = format!(
                            "rank {}: {} failed on the device: {e:?}",
                            self.rank,
                            what.unwrap_or_default()
                        );
                        self.health.fail(None, msg);
                        return;
                    }
                }
            }
        }
    }

    /// Fails the job when the oldest pending collective, or a group still being enqueued, is
    /// older than the timeout. Host clocks and locks only (no CUDA or NCCL call), so it runs
    /// whatever the driver is blocked on. The failure names the newest pending collective:
    /// when the poller is stuck in the driver, older ones may have completed unseen, and a rank
    /// that has not started the newest is the one behind.
    fn time(&self) {
        loop {
            std::thread::sleep(Duration::from_millis(50));
            if self.stop.load(Ordering::SeqCst) || self.health.failure().is_some() {
                return;
            }
            let late = {
                let pending = self.pending.lock().unwrap();
                match (pending.front(), pending.back()) {
                    (Some(old), Some(new)) if old.started.elapsed() > self.timeout() => {
                        Some((new.first, new.what.clone()))
                    }
                    _ => None,
                }
            };
            let late = late.or_else(|| {
                self.enqueueing
                    .lock()
                    .unwrap()
                    .as_ref()
                    .filter(|(_, _, since)| since.elapsed() > self.timeout())
                    .map(|(first, what, _)| (*first, format!("{what} (enqueueing)")))
            });
            if let Some((first, what)) = late {
                self.fail_late(first, &what);
                return;
            }
        }
    }

    fn fail_late(&self, first: u64, what: &str) {
        let (ranks, who) = match &self.prober {
            Some(p) => p.behind(first),
            None => (Vec::new(), "this is the only rank".into()),
        };
        self.health.fail(
            ranks.first().copied(),
            format!(
                "rank {}: {what} (the group's collective #{first}) did not complete within {:?}; {who}",
                self.rank,
                self.timeout()
            ),
        );
    }
}

/// The NCCL communicator of one process group on one GPU (see the module docs).
pub struct NcclComm {
    rank: usize,
    n: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    shared: Arc<Shared>,
    next_seq: AtomicU64,
    progress: Arc<AtomicU64>,
    scratch: Mutex<CudaBuf>,
    /// The device poller ([`Shared::watch`]) and the timer ([`Shared::time`]).
    watchdog: Mutex<Vec<JoinHandle<()>>>,
}

impl NcclComm {
    /// Makes the communicator of `pg` on `backend`'s GPU (a collective call: every rank makes
    /// it).
    pub fn new(backend: &CudaBackend, pg: &ProcessGroup) -> Result<NcclComm> {
        nccl_version()?;
        // NVLink SHARP (multicast) is off unless the user asked for it: the machines we run
        // on do not grant multicast objects (DEVICE.md); `tandem launch` sets it too.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let (rank, n) = (pg.rank(), pg.world_size());
        let comm_id = pg.next_comm_id();
        let id_bytes = pg.share(&format!("nccl_id/{comm_id}"), || {
            let id = nr::get_uniqueid()
                .map_err(|e| anyhow!("ncclGetUniqueId: {}", error_text(e.0, None)))?;
            Ok(id.internal.iter().map(|&c| c as u8).collect())
        })?;
        if id_bytes.len() != 128 {
            bail!(
                "rank {rank}: the NCCL id from the store has {} bytes, not 128",
                id_bytes.len()
            );
        }
        let mut id = ns::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(&id_bytes) {
            *d = *s as std::ffi::c_char;
        }
        let ctx = backend.context().clone();
        ctx.bind_to_thread()
            .map_err(|e| anyhow!("cuda: bind context: {e:?}"))?;
        let shared = Arc::new(Shared {
            rank,
            comm: AtomicPtr::new(std::ptr::null_mut()),
            calls: Mutex::new(()),
            pending: Mutex::new(VecDeque::new()),
            enqueueing: Mutex::new(None),
            timeout_ms: AtomicU64::new(pg.timeout().as_millis() as u64),
            stop: AtomicBool::new(false),
            health: pg.health().clone(),
            prober: pg.store().map(|s| s.prober()),
        });
        // Init is a collective too: count it, and fail by name if it does not return in time.
        let first = pg.seq().fetch_add(1, Ordering::Relaxed);
        let init_done = Arc::new(AtomicBool::new(false));
        {
            let (shared, done) = (shared.clone(), init_done.clone());
            std::thread::Builder::new()
                .name("dist-nccl-init".into())
                .spawn(move || {
                    let t = Instant::now();
                    while t.elapsed() < shared.timeout() {
                        if done.load(Ordering::SeqCst) || shared.health.failure().is_some() {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    if !done.load(Ordering::SeqCst) {
                        shared.fail_late(first, "ncclCommInitRank");
                    }
                })?;
        }
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: comm is written by NCCL; id is the group's id; rank < n.
        let init = unsafe { nr::comm_init_rank(&mut comm, n as i32, id, rank as i32) };
        init_done.store(true, Ordering::SeqCst);
        init.map_err(|e| {
            anyhow!(
                "rank {rank}: ncclCommInitRank ({n} ranks): {}",
                error_text(e.0, None)
            )
        })?;
        shared.comm.store(comm, Ordering::SeqCst);
        let weak = Arc::downgrade(&shared);
        pg.health().on_failure(move || {
            if let Some(s) = weak.upgrade() {
                s.abort();
            }
        });
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cuda: create the communication stream: {e:?}"))?;
        let scratch = backend.alloc(1)?;
        let (s, c) = (shared.clone(), ctx.clone());
        let watchdog = std::thread::Builder::new()
            .name("dist-nccl-watch".into())
            .spawn(move || {
                // Event queries go to the communicator's device.
                let _ = c.bind_to_thread();
                s.watch()
            })?;
        let s = shared.clone();
        let timer = std::thread::Builder::new()
            .name("dist-nccl-time".into())
            .spawn(move || s.time())?;
        Ok(NcclComm {
            rank,
            n,
            compute: backend.stream().clone(),
            ctx,
            stream,
            shared,
            next_seq: AtomicU64::new(0),
            progress: pg.seq().clone(),
            scratch: Mutex::new(scratch),
            watchdog: Mutex::new(vec![watchdog, timer]),
        })
    }

    /// The communication stream (for timing with events).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn dtype_of(&self, c: &Collective<'_, CudaBackend>, buf: &CudaBuf) -> Result<DType> {
        let d = buf.dtype();
        match c.dtype {
            Some(want) if want != d => bail!(
                "{}: a CUDA buffer of {d:?} cannot run as {want:?} (as_dtype is for backends that store f32)",
                c.name()
            ),
            _ => Ok(d),
        }
    }

    /// Enqueues one collective (inside the group); `custom` is the group's pre-multiplied
    /// sum, made on first use.
    fn enqueue(
        &self,
        comm: ns::ncclComm_t,
        c: &Collective<'_, CudaBackend>,
        custom: &mut Option<(u32, DType, RawOp)>,
    ) -> Result<()> {
        let stream = self.stream.cu_stream() as ns::cudaStream_t;
        let r = self.rank;
        let fail = |e: nr::NcclError| anyhow!("{}: {}", c.name(), error_text(e.0, Some(comm)));
        let mut op_of = |op: ReduceOp, d: DType| raw_op(comm, c.name(), op, d, custom);
        // Every call below: addresses are inside the buffers (validated), which stay borrowed
        // until the group is waited for; the stream belongs to the comm's context.
        match &c.kind {
            Kind::AllReduce { buf, off, len, op } => {
                let d = self.dtype_of(c, buf)?;
                if *len > 0 {
                    let (p, o) = (at(buf, *off), op_of(*op, d)?);
                    // SAFETY: `len` elements of type d at `p` lie in `buf` (see above); in place.
                    unsafe { raw::all_reduce(p, p, *len, nccl_type(d), o, comm, stream) }
                        .map_err(fail)?;
                }
            }
            Kind::Broadcast {
                buf,
                off,
                len,
                root,
            } => {
                let d = self.dtype_of(c, buf)?;
                if *len > 0 {
                    let p = at(buf, *off);
                    // SAFETY: `len` elements of type d at `p` lie in `buf` (see above); in place.
                    unsafe { nr::broadcast(p, p, *len, nccl_type(d), *root as i32, comm, stream) }
                        .map_err(fail)?;
                }
            }
            Kind::AllGather {
                send,
                recv,
                off,
                count,
            } => {
                let d = self.dtype_of(c, recv)?;
                let src = match send {
                    Some((s, so)) => {
                        if s.dtype() != d {
                            bail!("all_gather: send is {:?}, receive {d:?}", s.dtype());
                        }
                        at(s, *so)
                    }
                    None => at(recv, off + r * count),
                };
                if *count > 0 {
                    let dst = at(recv, *off);
                    // SAFETY: `count` elements at `src` and ranks × `count` at `dst` lie in their
                    // buffers of type d (see above).
                    unsafe { nr::all_gather(src, dst, *count, nccl_type(d), comm, stream) }
                        .map_err(fail)?;
                }
            }
            Kind::ReduceScatter {
                send,
                recv,
                off,
                count,
                op,
            } => {
                let d = self.dtype_of(c, recv)?;
                let (src, dst) = match send {
                    Some((s, so)) => {
                        if s.dtype() != d {
                            bail!("reduce_scatter: send is {:?}, receive {d:?}", s.dtype());
                        }
                        (at(s, *so), at(recv, *off))
                    }
                    None => (at(recv, *off), at(recv, off + r * count)),
                };
                if *count > 0 {
                    let o = op_of(*op, d)?;
                    // SAFETY: ranks × `count` elements at `src` and `count` at `dst` lie in their
                    // buffers of type d (see above).
                    unsafe { raw::reduce_scatter(src, dst, *count, nccl_type(d), o, comm, stream) }
                        .map_err(fail)?;
                }
            }
        }
        Ok(())
    }
}

/// NCCL's op for `op` on `d`: a built-in one, or the group's pre-multiplied sum (`custom`),
/// made on first use; `what` names the collective in errors.
fn raw_op(
    comm: ns::ncclComm_t,
    what: &str,
    op: ReduceOp,
    d: DType,
    custom: &mut Option<(u32, DType, RawOp)>,
) -> Result<RawOp> {
    let fail = |e: nr::NcclError| anyhow!("{what}: {}", error_text(e.0, Some(comm)));
    match op {
        ReduceOp::Sum => Ok(ns::ncclRedOp_t::ncclSum as RawOp),
        ReduceOp::Avg => Ok(ns::ncclRedOp_t::ncclAvg as RawOp),
        ReduceOp::Scaled(s) => {
            if let Some((bits, dt, made)) = *custom {
                if bits == s.to_bits() && dt == d {
                    return Ok(made);
                }
                bail!("the NCCL communicator takes one scale (ReduceOp::Scaled) per group");
            }
            let mut value_f32 = s;
            let mut value_bf16 = bf16::from_f32(s);
            let scalar = match d {
                DType::F32 => &mut value_f32 as *mut f32 as *mut c_void,
                DType::BF16 => &mut value_bf16 as *mut bf16 as *mut c_void,
            };
            let mut raw: RawOp = -1;
            // SAFETY: NCCL writes the new op's int id into `raw` (user ops are ints
            // outside cudarc's enum, so it is never read as one); the host-immediate
            // scalar is read during the call.
            unsafe {
                nr::reduce_op_create_pre_mul_sum(
                    &mut raw as *mut RawOp as *mut ns::ncclRedOp_t,
                    scalar,
                    nccl_type(d),
                    ns::ncclScalarResidence_t::ncclScalarHostImmediate,
                    comm,
                )
            }
            .map_err(fail)?;
            let made = raw;
            *custom = Some((s.to_bits(), d, made));
            Ok(made)
        }
    }
}

/// A started group: the compute stream waits for `done` on `wait`.
struct NcclPending<'a> {
    done: Arc<CudaEvent>,
    compute: Arc<CudaStream>,
    health: Arc<Health>,
    _buffers: PhantomData<&'a mut ()>,
}

impl Pending for NcclPending<'_> {
    fn wait(self: Box<Self>) -> Result<()> {
        self.compute
            .wait(&self.done)
            .map_err(|e| anyhow!("cuda: wait for a collective: {e:?}"))?;
        self.health.check()
    }
}

impl Comm<CudaBackend> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn follow(&mut self, backend: &CudaBackend) -> Result<()> {
        if backend.context().ordinal() != self.ctx.ordinal() {
            bail!(
                "rank {}: a communicator of GPU {} cannot serve buffers on GPU {}",
                self.rank,
                self.ctx.ordinal(),
                backend.context().ordinal()
            );
        }
        self.compute = backend.stream().clone();
        Ok(())
    }

    fn rank_order_reductions(&self) -> bool {
        false
    }

    fn start<'a>(&'a self, ops: Vec<Collective<'a, CudaBackend>>) -> Result<Work<'a>> {
        let sh = &self.shared;
        sh.health.check()?;
        for c in &ops {
            c.validate(self.n, |b: &CudaBuf| b.raw().1)?;
        }
        let names: Vec<&str> = ops.iter().map(|c| c.name()).collect();
        let first = self.progress.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let seq = self.next_seq.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let what = format!("{} #{seq}", names.join("+"));
        let _calls = sh.calls.lock().unwrap();
        let comm = sh.comm.load(Ordering::SeqCst);
        if comm.is_null() {
            sh.health.check()?;
            bail!("the NCCL communicator was aborted");
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("cuda: bind context: {e:?}"))?;
        let cuda = |e: dr::DriverError| anyhow!("cuda: order {what} after the compute: {e:?}");
        let ready = self.compute.record_event(None).map_err(cuda)?;
        self.stream.wait(&ready).map_err(cuda)?;
        let mut custom = None;
        nr::group_start()
            .map_err(|e| anyhow!("ncclGroupStart: {}", error_text(e.0, Some(comm))))?;
        *sh.enqueueing.lock().unwrap() = Some((first, what.clone(), Instant::now()));
        let enqueued: Result<()> = ops
            .iter()
            .try_for_each(|c| self.enqueue(comm, c, &mut custom));
        let ended = nr::group_end();
        *sh.enqueueing.lock().unwrap() = None;
        if let Some((_, _, op)) = custom {
            // SAFETY: the op was made on this comm; NCCL allows destroying it once the calls
            // that use it returned.
            unsafe {
                let _ = raw::reduce_op_destroy(op, comm);
            }
        }
        enqueued?;
        ended.map_err(|e| anyhow!("{what}: ncclGroupEnd: {}", error_text(e.0, Some(comm))))?;
        let done = Arc::new(
            self.stream
                .record_event(None)
                .map_err(|e| anyhow!("cuda: record {what}: {e:?}"))?,
        );
        sh.pending.lock().unwrap().push_back(Watched {
            done: done.clone(),
            first,
            what,
            started: Instant::now(),
        });
        Ok(Work::new(Box::new(NcclPending {
            done,
            compute: self.compute.clone(),
            health: sh.health.clone(),
            _buffers: PhantomData,
        })))
    }

    fn barrier(&self) -> Result<()> {
        let mut scratch = self.scratch.lock().unwrap();
        self.run(vec![Collective::all_reduce(
            &mut *scratch,
            0,
            1,
            ReduceOp::Sum,
        )])?;
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: barrier: {e:?}"))?;
        self.shared.health.check()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.shared
            .timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Let queued collectives finish while the watchdog still guards them, then stop it and
        // release the communicator (abort: frees it without talking to the peers).
        if self.shared.health.failure().is_none() {
            let _ = self.ctx.bind_to_thread();
            let _ = self.stream.synchronize();
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        for w in self.watchdog.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        self.shared.abort();
    }
}
