//! `tandem daemon`: the warm process that owns one device's models and runs the model stages'
//! jobs for their clients, one at a time (the others wait in arrival order).
//!
//! Threads: the main thread owns the backend and the models and runs jobs (CUDA work stays on
//! one thread); an acceptor thread takes connections on the unix socket; one thread per
//! connection reads its requests, answers `health`/`status`/`shutdown` at once, and queues
//! jobs to the main thread. SIGTERM, SIGINT and `shutdown` finish the running job, refuse the
//! queued ones, remove the socket and exit 0.
//!
//! A job belongs to its connection: while it waits or runs, the connection's thread watches the
//! socket, and when the client is gone (killed, or its end closed) it sets the job's
//! [`Cancel`] flag. The engine's loops stop at their next step, the stage writes nothing, the
//! half-trained policy is forgotten (reloaded from files by the next job), and the daemon serves
//! the next client.
//!
//! A daemon group (`tandem launch --nproc-per-node N -- tandem daemon ...`, one rank per GPU):
//! the ranks form one [`ProcessGroup`] that lives as long as they do. Rank 0 listens on
//! `--socket` and takes the jobs; a job the stages split over ranks
//! ([`StageJob::splits_over_ranks`]) it hands to every rank through the rendezvous store, in
//! its order, and the ranks run the stage's code together (each its share, rank 0 writes the
//! files), as the ranks of an in-process launch do; the other jobs rank 0 runs alone. Rank r > 0
//! listens on `SOCKET.rank<r>` for `status`/`shutdown` only. A failed or cancelled part stops
//! every rank's part; a rank that dies stops the whole group (`dist` failure handling). An
//! update trains the policy every rank keeps, with the optimizer shards it keeps
//! ([`Resident::train_group`]), over the group's communicator that its policy keeps.

use super::protocol::{Reply, Request, Response};
use super::resident::{Options, Resident};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::bail_input;
use crate::engine::cancel::{self, Cancel};
use crate::engine::policy::kept::MakeComm;
use crate::engine::policy::{
    resolve_model, HeldPolicy, Holder, ModelRef, SavedShards, Sharding, Train, Trained,
};
use crate::engine::resume::TrainerState;
use crate::error::is_input_error;
use crate::parallel::exchange::{as_local, RankFailed};
use crate::parallel::health::Health;
use crate::parallel::{Comm, Exchange, HostComm, NcclComm, ProcessGroup, World};
use crate::stage::common::{after_rank0, Device, LoraFlags};
use crate::stage::transfer::{Bridge, Transferred};
use crate::stage::{ref_logprob, rollout, Compute, Console, Hold, StageJob, Topology};
use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
#[command(about = "Keep a device's models warm and run the model stages' jobs (--daemon PATH)")]
pub struct DaemonArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// The unix socket to listen on (created with mode 0600; put it in the run directory).
    /// Under a launcher (one daemon per GPU) rank 0 listens here and takes the jobs, rank r on
    /// SOCKET.rank<r>.
    #[arg(long)]
    pub socket: PathBuf,
    /// The policy to load at start: a model directory or a sync-weights pointer file.
    #[arg(long)]
    pub policy: PathBuf,
    /// The reference model to load at start.
    #[arg(long = "ref")]
    pub reference: Option<PathBuf>,
    /// Keep the AdamW moments in host memory between updates.
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Keep the reference weights in host memory; upload them for each ref-logprob job.
    #[arg(long)]
    pub offload_ref: bool,
    // Load the policy as LoRA adapters on its frozen base (no f32 masters or optimizer state
    // of the base), as the LoRA updates to come will train it; rank 0: as its files give it.
    #[command(flatten)]
    pub lora: LoraFlags,
    /// With --lora-rank on a model (not an adapter checkpoint): the `update --seed` of the
    /// first update, which draws the fresh adapters (an update with another seed loads its own).
    #[arg(long, default_value_t = 0)]
    pub lora_seed: u64,
}

/// Set by SIGTERM/SIGINT and by a `shutdown` request.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Store keys of a daemon group: job N as rank 0 hands it on (a `Request`: a job, or
/// `shutdown` for the group's end), a rank's "loaded and listening", another rank's stop asked
/// of rank 0.
fn job_key(n: u64) -> String {
    format!("daemon/job/{n}")
}
fn ready_key(rank: usize) -> String {
    format!("daemon/ready/{rank}")
}
const STOP_REQUEST_KEY: &str = "daemon/stop-request";

/// A job handed from a connection thread to the main thread (or, on a rank > 0 of a group,
/// from rank 0: no client, its lines go to the daemon's log).
struct Work {
    cwd: PathBuf,
    job: Box<StageJob>,
    reply: Option<Reply>,
    done: mpsc::Sender<()>,
    /// Set by the connection's thread when the client goes away.
    cancel: Cancel,
}

/// This daemon's place in a daemon group.
#[derive(Clone)]
struct GroupInfo {
    world: World,
    rank: usize,
    world_size: usize,
    /// The group's socket (rank 0's), absolute.
    base: PathBuf,
    health: Arc<Health>,
}

/// What connection threads report without waiting for the main thread.
struct Shared {
    started: Instant,
    socket: PathBuf,
    running: Option<&'static str>,
    queued: usize,
    jobs_done: u64,
    jobs_failed: u64,
    /// Jobs stopped (or never started) because their client went away.
    jobs_cancelled: u64,
    /// The models' part, refreshed by the main thread after each job.
    resident: Value,
    group: Option<GroupInfo>,
    /// The client of the running job (told when the group fails under it).
    current: Option<Reply>,
}

impl Shared {
    fn snapshot(&self) -> Value {
        let mut v = json!({
            "ok": true,
            "pid": std::process::id(),
            "socket": self.socket.display().to_string(),
            "uptime_seconds": self.started.elapsed().as_secs_f64(),
            "running": self.running,
            "queued": self.queued,
            "jobs_done": self.jobs_done,
            "jobs_failed": self.jobs_failed,
            "jobs_cancelled": self.jobs_cancelled,
            "resident": self.resident,
        });
        if let Some(g) = &self.group {
            v["rank"] = g.rank.into();
            v["world_size"] = g.world_size.into();
        }
        v
    }
}

/// `status` of a group's rank 0: every rank's status in rank order (a rank that does not
/// answer is shown with its error).
fn group_status(mine: Value, g: &GroupInfo) -> Value {
    let mut ranks = vec![mine.clone()];
    for r in 1..g.world_size {
        let socket = super::rank_socket(&g.base, r);
        ranks.push(match super::client::request(&socket, &Request::Status) {
            Ok(Response::Status { status }) => status,
            Ok(Response::Error { message, .. }) => {
                json!({"ok": false, "rank": r, "error": message})
            }
            Ok(other) => {
                json!({"ok": false, "rank": r, "error": format!("unexpected answer {other:?}")})
            }
            Err(e) => json!({"ok": false, "rank": r, "error": format!("{e:#}")}),
        });
    }
    let mut v = mine;
    v["ranks"] = Value::Array(ranks);
    v
}

pub fn run(args: DaemonArgs) -> Result<()> {
    let opts = Options {
        offload_optimizer: args.offload_optimizer,
        offload_ref: args.offload_ref,
    };
    // Under a launcher: one rank of a daemon group, on the GPU of its local rank.
    let world = World::from_env()?;
    let group = match world.is_single() {
        true => None,
        false => Some(Arc::new(ProcessGroup::new(
            world,
            crate::parallel::Options::from_env()?,
        )?)),
    };
    let device = match &group {
        Some(pg) => args.device.for_rank(pg.world())?,
        None => args.device,
    };
    match device {
        Device::Cpu => {
            let mut resident = Resident::new(Box::new(|| Ok(Cpu)), device, opts);
            let make: MakeComm<Cpu> = Rc::new(|_: &Cpu, pg: &ProcessGroup| {
                Ok(Box::new(HostComm::new(pg)?) as Box<dyn Comm<Cpu>>)
            });
            resident.set_bridge_maker(make.clone());
            if group.is_some() {
                resident.set_comm_maker(make);
            }
            serve(&args, resident, group)
        }
        Device::Cuda(n) => {
            // Open the device once now so that a missing GPU is reported before anything else.
            CudaBackend::new(n)?;
            let make = Box::new(move || crate::backend::ops::open_cuda(n));
            let mut resident = Resident::new(make, device, opts);
            let make: MakeComm<CudaBackend> = Rc::new(|b: &CudaBackend, pg: &ProcessGroup| {
                Ok(Box::new(NcclComm::new(b, pg)?) as Box<dyn Comm<CudaBackend>>)
            });
            resident.set_bridge_maker(make.clone());
            if group.is_some() {
                resident.set_comm_maker(make);
            }
            serve(&args, resident, group)
        }
    }
}

/// Refuses a socket path that a live daemon holds or that is not a socket; removes a stale one.
fn claim_socket(path: &Path) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    use std::os::unix::fs::FileTypeExt;
    if !meta.file_type().is_socket() {
        bail_input!(
            "--socket {}: exists and is not a socket; choose another path",
            path.display()
        );
    }
    if UnixStream::connect(path).is_ok() {
        bail_input!(
            "--socket {}: a daemon is already listening there (stop it with `tandem daemon-ctl --socket {} shutdown`)",
            path.display(),
            path.display()
        );
    }
    std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))
}

/// Binds with mode 0600: the umask covers the window between bind and chmod.
fn bind_private(path: &Path) -> Result<UnixListener> {
    // SAFETY: umask(2) only swaps the process's file-mode mask (no memory is passed); the
    // old mask is put back below.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: umask(2) puts back the mask it returned above; it cannot fail.
    unsafe { libc::umask(old) };
    let listener = bound.with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The uid of the process at the other end (SO_PEERCRED).
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live ucred and `len` its size, so getsockopt writes at most `len`
    // bytes into it; the descriptor is `stream`'s, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Binds the daemon's socket at `path`. A group answers on rank 0's socket once every rank has
/// loaded and listens: a rank > 0 says so in the store once bound, rank 0 binds after all did.
fn listen(path: &Path, group: Option<&ProcessGroup>) -> Result<UnixListener> {
    let Some((pg, store)) = group.and_then(|pg| Some((pg, pg.store()?))) else {
        return bind_private(path);
    };
    if pg.rank() > 0 {
        let l = bind_private(path)?;
        store.set(&ready_key(pg.rank()), b"1")?;
        return Ok(l);
    }
    for r in 1..pg.world_size() {
        store.get_any(&[ready_key(r)], None, &|| false)?;
    }
    bind_private(path)
}

/// When the group fails (a rank died or hung), the running job's client hears why before this
/// process ends (the failure handling ends it after its grace period).
fn tell_client_on_failure(pg: &ProcessGroup, shared: &Arc<Mutex<Shared>>) {
    let (weak, health) = (Arc::downgrade(shared), Arc::downgrade(pg.health()));
    pg.health().on_failure(move || {
        let (Some(shared), Some(health)) = (weak.upgrade(), health.upgrade()) else {
            return;
        };
        let reason = health.failure().map(|f| f.reason).unwrap_or_default();
        if let Some(reply) = shared.lock().ok().and_then(|s| s.current.clone()) {
            reply.send(&Response::Error {
                message: format!("{:#}", group_failed(&reason)),
                input_error: false,
            });
        }
    });
}

fn serve<B: Backend>(
    args: &DaemonArgs,
    mut resident: Resident<B>,
    group: Option<Arc<ProcessGroup>>,
) -> Result<()> {
    let rank = group.as_ref().map_or(0, |pg| pg.rank());
    let base = std::path::absolute(&args.socket)?;
    let path = super::rank_socket(&base, rank);
    claim_socket(&path)?;
    // SAFETY: `on_signal` is an extern "C" fn that only stores to an atomic, which is
    // async-signal-safe; signal(2) is given valid signal numbers.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    // Load before listening: a daemon that answers `health` is ready for jobs.
    let policy = resolve_model(&args.policy)?;
    let lora = args.lora.spec()?;
    resident.preload_policy(&policy, lora.as_ref().map(|l| (l, args.lora_seed)))?;
    if let Some(r) = &args.reference {
        resident.preload_ref(&resolve_model(r)?.dir)?;
    }
    let listener = listen(&path, group.as_deref())?;
    let socket = path.canonicalize()?;
    resident.set_socket(&socket);
    let home = std::env::current_dir()?;
    let shared = Arc::new(Mutex::new(Shared {
        started: Instant::now(),
        socket: socket.clone(),
        running: None,
        queued: 0,
        jobs_done: 0,
        jobs_failed: 0,
        jobs_cancelled: 0,
        resident: resident.status(),
        group: group.as_ref().map(|pg| GroupInfo {
            world: pg.world().clone(),
            rank,
            world_size: pg.world_size(),
            base: base.clone(),
            health: pg.health().clone(),
        }),
        current: None,
    }));
    if let Some(pg) = &group {
        tell_client_on_failure(pg, &shared);
    }
    let ranks_note = match &group {
        Some(pg) => format!(" (rank {rank} of {})", pg.world_size()),
        None => String::new(),
    };
    let lora_note = match &lora {
        Some(l) => format!(", as LoRA adapters (rank {}) on its frozen base", l.rank),
        None => String::new(),
    };
    eprintln!(
        "daemon: {}{ranks_note} on {} (pid {}), policy {} (policy_version {}){lora_note}",
        socket.display(),
        resident.device,
        std::process::id(),
        policy.dir.display(),
        policy.policy_version
    );
    let (tx, rx) = mpsc::channel::<Work>();
    listener.set_nonblocking(true)?;
    let acceptor = {
        let shared = shared.clone();
        std::thread::spawn(move || accept_loop(listener, tx, shared))
    };

    let served = match &group {
        Some(pg) if rank > 0 => follow(&mut resident, pg, &shared, &home),
        _ => lead(&mut resident, group.as_ref(), &rx, &shared, &home),
    };
    STOP.store(true, Ordering::SeqCst);
    let _ = acceptor.join();
    // Jobs that were queued behind the last one are refused, not dropped silently.
    while let Ok(w) = rx.try_recv() {
        refuse(
            w,
            &shared,
            "the daemon is shutting down; the job did not run",
            false,
        );
    }
    std::fs::remove_file(&socket).ok();
    // Every rank of a group ends together, so that no rank's exit looks like a crash.
    let finished = match (&served, &group) {
        (Ok(()), Some(pg)) => pg.finish_shared(),
        _ => Ok(()),
    };
    eprintln!("daemon: stopped, {} removed", socket.display());
    served.and(finished)
}

/// What the client of a job hears when the daemon group fails under it.
fn group_failed(reason: &str) -> anyhow::Error {
    anyhow::anyhow!("the daemon group failed: {reason}; the job stopped and nothing was written")
}

/// Answers a job that will not run (and takes it off the queued count).
fn refuse(w: Work, shared: &Mutex<Shared>, message: &str, input_error: bool) {
    {
        let mut s = shared.lock().expect("shared");
        s.queued = s.queued.saturating_sub(1);
    }
    if let Some(reply) = &w.reply {
        reply.send(&Response::Error {
            message: message.into(),
            input_error,
        });
    }
    let _ = w.done.send(());
}

/// The main loop of a lone daemon or of a group's rank 0: runs the jobs of its clients in
/// arrival order; in a group, hands each job the stages split over ranks to every rank first.
fn lead<B: Backend>(
    resident: &mut Resident<B>,
    group: Option<&Arc<ProcessGroup>>,
    rx: &mpsc::Receiver<Work>,
    shared: &Arc<Mutex<Shared>>,
    home: &Path,
) -> Result<()> {
    // Another rank's signal or `shutdown` stops the group here, after the running job.
    let asked = group.cloned().map(|pg| {
        std::thread::spawn(move || {
            let store = pg.store().expect("a group of several ranks has a store");
            let keys = [STOP_REQUEST_KEY.to_string()];
            if let Ok(Some(_)) = store.get_any(&keys, None, &|| STOP.load(Ordering::SeqCst)) {
                STOP.store(true, Ordering::SeqCst);
            }
        })
    });
    let mut next = 0u64;
    let mut result = Ok(());
    while !STOP.load(Ordering::SeqCst) {
        if let Some(pg) = group {
            // The group failed (a rank died or hung): stop, naming it.
            if let Err(e) = pg.health().check() {
                result = Err(e);
                break;
            }
        }
        let work = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(w) => w,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        // Alone, or a job whose client left while it waited (dropped without running).
        let pg = match group {
            Some(pg) if !work.cancel.is_cancelled() => pg,
            _ => {
                run_job(resident, work, shared, home, None);
                continue;
            }
        };
        if !work.job.splits_over_ranks() {
            run_job(resident, work, shared, home, None);
            continue;
        }
        let n = next;
        next += 1;
        let req = Request::Job {
            cwd: work.cwd.clone(),
            job: work.job.clone(),
        };
        let store = pg.store().expect("a group of several ranks has a store");
        if let Err(e) = store.set(&job_key(n), serde_json::to_string(&req)?.as_bytes()) {
            refuse(work, shared, &format!("{e:#}"), false);
            continue;
        }
        let x = Exchange::new(pg.clone(), format!("{}-{n}", work.job.name()));
        run_job(resident, work, shared, home, Some(&x));
    }
    STOP.store(true, Ordering::SeqCst);
    if let Some(pg) = group {
        if result.is_ok() {
            // The other ranks end at this marker, after the jobs before it.
            let end = serde_json::to_string(&Request::Shutdown)?;
            let store = pg.store().expect("a group of several ranks has a store");
            result = store.set(&job_key(next), end.as_bytes());
        }
    }
    if let Some(t) = asked {
        let _ = t.join();
    }
    result
}

/// The main loop of a group's rank r > 0: runs the jobs rank 0 hands on, in its order, until
/// rank 0 ends the group. Its own signal or `shutdown` asks rank 0 to end it.
fn follow<B: Backend>(
    resident: &mut Resident<B>,
    pg: &Arc<ProcessGroup>,
    shared: &Arc<Mutex<Shared>>,
    home: &Path,
) -> Result<()> {
    {
        let pg = pg.clone();
        std::thread::spawn(move || {
            while !STOP.load(Ordering::SeqCst) {
                if pg.health().failure().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Some(store) = pg.store() {
                let _ = store.set(STOP_REQUEST_KEY, b"1");
            }
        });
    }
    let store = pg.store().expect("a group of several ranks has a store");
    for n in 0.. {
        let (_, value) = store
            .get_any(&[job_key(n)], None, &|| false)?
            .expect("never stopped");
        let Request::Job { cwd, job } = serde_json::from_slice(&value)? else {
            return Ok(());
        };
        let (done, _) = mpsc::channel();
        let x = Exchange::new(pg.clone(), format!("{}-{n}", job.name()));
        let work = Work {
            cwd,
            job,
            reply: None,
            done,
            cancel: Cancel::new(),
        };
        run_job(resident, work, shared, home, Some(&x));
    }
    Ok(())
}

fn accept_loop(listener: UnixListener, tx: mpsc::Sender<Work>, shared: Arc<Mutex<Shared>>) {
    // SAFETY: geteuid(2) takes no arguments, touches no memory and always succeeds.
    let me = unsafe { libc::geteuid() };
    while !STOP.load(Ordering::SeqCst) {
        // Woken by a client's connect; looks at STOP every 100 ms meanwhile.
        if poll_one(listener.as_raw_fd(), libc::POLLIN, 100) == 0 {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if peer_uid(&stream).ok() != Some(me) {
                    let reply = Reply(Arc::new(Mutex::new(stream)));
                    reply.send(&Response::Error {
                        message: "refused: the daemon serves only its own user".into(),
                        input_error: true,
                    });
                    continue;
                }
                let (tx, shared) = (tx.clone(), shared.clone());
                std::thread::spawn(move || connection(stream, tx, shared));
            }
            // The client gave up between the poll and the accept.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                eprintln!("daemon: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Whether the client at the other end of `stream` is gone: its end of the socket closed
/// (the process exited or was killed). A client that only shut down its writing half is still
/// there (it may be reading the answer).
fn client_gone(stream: &UnixStream) -> bool {
    // A unix stream socket reports POLLHUP once the peer's end is closed for good.
    poll_one(stream.as_raw_fd(), libc::POLLIN, 0) & (libc::POLLHUP | libc::POLLERR) != 0
}

/// poll(2) on the open descriptor `fd` for `events`, waiting up to `timeout_ms` (0: a look
/// without waiting): the events reported, 0 when none came in time.
fn poll_one(fd: std::os::unix::io::RawFd, events: libc::c_short, timeout_ms: i32) -> libc::c_short {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: `pfd` is one live pollfd (nfds = 1) on a descriptor the caller keeps open for
    // the call; poll writes only its `revents`.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if n > 0 {
        pfd.revents
    } else {
        0
    }
}

/// Serves one client: any number of requests, one line each, in order.
fn connection(stream: UnixStream, tx: mpsc::Sender<Work>, shared: Arc<Mutex<Shared>>) {
    let (Ok(read_half), Ok(watch)) = (stream.try_clone(), stream.try_clone()) else {
        return;
    };
    let reply = Reply(Arc::new(Mutex::new(stream)));
    for line in BufReader::new(read_half).lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let req = match serde_json::from_str::<Request>(&line) {
            Ok(r) => r,
            Err(e) => {
                reply.send(&Response::Error {
                    message: format!("malformed request: {e}"),
                    input_error: true,
                });
                continue;
            }
        };
        match req {
            Request::Health | Request::Status => {
                reply.send(&status(&shared, matches!(req, Request::Status)));
            }
            Request::Shutdown => {
                STOP.store(true, Ordering::SeqCst);
                reply.send(&Response::ShuttingDown);
            }
            Request::Job { cwd, job } => {
                if !queue_job(cwd, job, &reply, &watch, &tx, &shared) {
                    return;
                }
            }
        }
    }
}

/// `health` or `status` (`full`: a group's rank 0 adds every rank's): the snapshot, or the
/// group's failure.
fn status(shared: &Mutex<Shared>, full: bool) -> Response {
    let (status, group) = {
        let s = shared.lock().expect("shared");
        (s.snapshot(), s.group.clone())
    };
    let Some(g) = &group else {
        return Response::Status { status };
    };
    if let Some(f) = g.health.failure() {
        return Response::Error {
            message: format!("the daemon group failed: {}", f.reason),
            input_error: false,
        };
    }
    let status = match full && g.rank == 0 {
        true => group_status(status, g),
        false => status,
    };
    Response::Status { status }
}

/// Queues a client's job for the main thread and waits until it has run, cancelling it as
/// soon as the client is gone (`watch`: the client's socket). False when the connection is
/// done (the client went away, or the daemon's queue closed).
fn queue_job(
    cwd: PathBuf,
    job: Box<StageJob>,
    reply: &Reply,
    watch: &UnixStream,
    tx: &mpsc::Sender<Work>,
    shared: &Mutex<Shared>,
) -> bool {
    let follower = shared
        .lock()
        .expect("shared")
        .group
        .as_ref()
        .filter(|g| g.rank > 0)
        .map(|g| (g.rank, g.world_size, g.base.clone()));
    if let Some((rank, world, base)) = follower {
        reply.send(&Response::Error {
            message: format!(
                "this daemon is rank {rank} of a group of {world}: send jobs to the group's socket {} (rank 0)",
                base.display()
            ),
            input_error: true,
        });
        return true;
    }
    if STOP.load(Ordering::SeqCst) {
        reply.send(&Response::Error {
            message: "the daemon is shutting down; the job did not run".into(),
            input_error: false,
        });
        return true;
    }
    let (done, wait) = mpsc::channel();
    shared.lock().expect("shared").queued += 1;
    let cancel = Cancel::new();
    let sent = tx.send(Work {
        cwd,
        job,
        reply: Some(reply.clone()),
        done,
        cancel: cancel.clone(),
    });
    if sent.is_err() {
        return false;
    }
    // The next request of this client waits for this job; meanwhile the job is cancelled as
    // soon as its client is gone.
    loop {
        match wait.recv_timeout(Duration::from_millis(100)) {
            Ok(()) => break,
            Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !cancel.is_cancelled() && client_gone(watch) {
                    cancel.cancel();
                }
            }
        }
    }
    !cancel.is_cancelled()
}

/// Runs one job on the main thread: in the client's working directory, with a ticker that
/// streams the stage's progress bars. `ranks`: the job's exchanges when the ranks of a group
/// run it together.
fn run_job<B: Backend>(
    resident: &mut Resident<B>,
    work: Work,
    shared: &Arc<Mutex<Shared>>,
    home: &Path,
    ranks: Option<&Exchange>,
) {
    let Work {
        cwd,
        job,
        reply,
        done,
        cancel,
    } = work;
    let name = job.name();
    if cancel.is_cancelled() && ranks.is_none() {
        let mut s = shared.lock().expect("shared");
        s.queued = s.queued.saturating_sub(1);
        s.jobs_cancelled += 1;
        drop(s);
        eprintln!("daemon: a queued {name} job was dropped: its client went away before it ran");
        let _ = done.send(());
        return;
    }
    let world = {
        let mut s = shared.lock().expect("shared");
        s.queued = s.queued.saturating_sub(1);
        s.running = Some(name);
        s.current = reply.clone();
        s.group.as_ref().map(|g| g.world.clone())
    };
    let started = Instant::now();
    resident.begin(name, reply.clone());
    let run = Running {
        name,
        reply: reply.as_ref(),
        cancel: &cancel,
        ranks,
    };
    let result = run.execute(resident, cwd, *job, world.as_ref());
    let _ = std::env::set_current_dir(home);
    let mut metrics = resident.end(name, result.is_ok());
    if let Some(m) = metrics.as_object_mut() {
        m.insert("seconds".into(), started.elapsed().as_secs_f64().into());
    }
    let result = run.record(result, resident, shared, started);
    if let Some(reply) = &reply {
        match result {
            Ok(()) => reply.send(&Response::Done { metrics }),
            Err(e) => reply.send(&Response::Error {
                message: format!("{e:#}"),
                input_error: is_input_error(&e),
            }),
        }
    }
    let _ = done.send(());
}

/// A job as it runs on the main thread.
struct Running<'a> {
    name: &'static str,
    /// Its client (None on a group's rank > 0).
    reply: Option<&'a Reply>,
    cancel: &'a Cancel,
    ranks: Option<&'a Exchange>,
}

impl Running<'_> {
    /// Runs the stage, with the ticker and (in a group) the watch on the other ranks' parts
    /// beside it; a panic is the job's error. A part stopped because another rank's failed
    /// fails with that rank's error, and a failed part stops every rank's.
    fn execute<B: Backend>(
        &self,
        resident: &mut Resident<B>,
        cwd: PathBuf,
        job: StageJob,
        world: Option<&World>,
    ) -> Result<()> {
        let (name, cancel, ranks) = (self.name, self.cancel, self.ranks);
        let finished = AtomicBool::new(false);
        // Dropped when the job ends: wakes the ticker at once (the scope waits for it).
        let (job_over, over) = mpsc::channel::<()>();
        let bars = resident.bars.clone();
        // The first failure of another rank's part: this rank's part stops too (cancelled).
        let peer_failed: Mutex<Option<RankFailed>> = Mutex::new(None);
        let result = std::thread::scope(|scope| {
            if let Some(reply) = self.reply {
                let bars = &bars;
                scope.spawn(move || ticker(bars, reply, over, TICK));
            }
            if let Some(x) = ranks {
                scope.spawn(|| {
                    if let Ok(Some(f)) = x.watch_others(&|| finished.load(Ordering::SeqCst)) {
                        *peer_failed.lock().expect("peer") = Some(f);
                        cancel.cancel();
                    }
                });
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                cancel.install(|| run_in(&mut Watched(resident, ranks), cwd, job, world))
            }));
            finished.store(true, Ordering::SeqCst);
            drop(job_over);
            match r {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!(
                    "the daemon's {name} job panicked (a bug; its message is in the daemon's log)"
                )),
            }
        });
        // Stopped because another rank's part failed: that failure is this part's error too
        // (every rank waiting for this one stops with it); a part cancelled because rank 0's
        // client went away stays a cancelled job.
        let result = match (result, peer_failed.into_inner().expect("peer")) {
            (Err(e), Some(f))
                if cancel::is_cancelled(&e) && f.message != cancel::Cancelled.to_string() =>
            {
                Err(f.into())
            }
            (r, _) => r,
        };
        match (result, ranks) {
            (Err(e), Some(x)) => {
                x.fail(&e);
                Err(as_local(e))
            }
            (r, _) => r,
        }
    }

    /// Counts the finished job in `shared`, logs a cancelled or (without a client) failed one,
    /// and returns what its client hears: the group's failure when the group failed under it
    /// (the message the failure hook sends too, whichever reaches the client first).
    fn record<B: Backend>(
        &self,
        result: Result<()>,
        resident: &Resident<B>,
        shared: &Mutex<Shared>,
        started: Instant,
    ) -> Result<()> {
        let name = self.name;
        let cancelled = matches!(&result, Err(e) if cancel::is_cancelled(e));
        let group_failure = {
            let mut s = shared.lock().expect("shared");
            s.running = None;
            s.current = None;
            match (&result, cancelled) {
                (Ok(()), _) => s.jobs_done += 1,
                (Err(_), true) => s.jobs_cancelled += 1,
                (Err(_), false) => s.jobs_failed += 1,
            }
            s.resident = resident.status();
            s.group.as_ref().map(|g| g.health.clone())
        };
        if cancelled {
            let whose = match self.reply {
                Some(_) => "its client",
                None => "rank 0's client",
            };
            eprintln!(
                "daemon: the {name} job was cancelled after {:.1} s: {whose} went away; nothing was written",
                started.elapsed().as_secs_f64()
            );
        } else if let (Err(e), None) = (&result, self.reply) {
            eprintln!("daemon: the {name} job failed: {e:#}");
        }
        match (result, group_failure.and_then(|h| h.failure())) {
            (Err(_), Some(f)) => Err(group_failed(&f.reason)),
            (r, _) => r,
        }
    }
}

/// The resident models as a stage's `Exec`, checking the job's cancel flag before and after
/// each compute: a job whose client went away stops there, before the stage writes anything
/// (the engine's loops also check it between their steps).
struct Watched<'a, B: Backend>(&'a mut Resident<B>, Option<&'a Exchange>);

impl<B: Backend> Compute for Watched<'_, B> {
    fn generate(
        &mut self,
        model: &ModelRef,
        job: rollout::Generate<'_>,
    ) -> Result<rollout::Generated> {
        cancel::check()?;
        let out = self.0.generate(model, job)?;
        cancel::check()?;
        Ok(out)
    }

    fn score(
        &mut self,
        model: &ModelRef,
        job: ref_logprob::Score<'_>,
    ) -> Result<Vec<crate::model::decoder::TokenStats>> {
        cancel::check()?;
        let out = self.0.score(model, job)?;
        cancel::check()?;
        Ok(out)
    }

    fn train(&mut self, model: &ModelRef, job: Train<'_>) -> Result<Trained> {
        cancel::check()?;
        let out = self.0.train(model, job)?;
        cancel::check()?;
        Ok(out)
    }

    fn train_sharded(
        &mut self,
        model: &ModelRef,
        job: Train<'_>,
        sharding: Sharding,
    ) -> Result<Trained> {
        cancel::check()?;
        let x = self
            .1
            .expect("a sharded update runs among the group's ranks");
        let out = self.0.train_group(x.group(), model, job, sharding)?;
        cancel::check()?;
        Ok(out)
    }
}

impl<B: Backend> Hold for Watched<'_, B> {
    fn saved(&mut self, dir: &Path, trainer: Option<&TrainerState>) -> Result<()> {
        self.0.saved(dir, trainer)
    }

    fn holder(&self) -> Option<Holder> {
        self.0.holder()
    }

    fn save_sharded(
        &mut self,
        model: Option<&ModelRef>,
        staging: &Path,
    ) -> Result<Option<SavedShards>> {
        cancel::check()?;
        match self.1 {
            Some(x) => self.0.save_group(x.group(), model, staging),
            None => Ok(None),
        }
    }

    fn held_policy(&mut self, model: Option<&ModelRef>) -> Result<HeldPolicy> {
        cancel::check()?;
        self.0.held_policy(model)
    }

    fn publish(&mut self, dir: &Path, policy_version: u64) -> Result<()> {
        cancel::check()?;
        self.0.publish(dir, policy_version)
    }

    fn transfer(&mut self, model: &ModelRef, bridge: &Bridge) -> Result<Transferred> {
        cancel::check()?;
        self.0.transfer(model, bridge)
    }
}

impl<B: Backend> Console for Watched<'_, B> {
    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar {
        self.0.progress_bar(len, what)
    }

    fn log(&mut self, line: &str) {
        self.0.log(line)
    }
}

impl<B: Backend> Topology for Watched<'_, B> {
    fn ranks(&self) -> Option<&Exchange> {
        self.1
    }
}

/// Runs the stage's own code in the client's working directory, with the resident models as
/// its `crate::stage::Exec`.
fn run_in<B: Backend>(
    resident: &mut Watched<B>,
    cwd: PathBuf,
    job: StageJob,
    world: Option<&World>,
) -> Result<()> {
    std::env::set_current_dir(&cwd).map_err(|e| {
        crate::error::input_error(format!(
            "the client's working directory {} is not usable by the daemon: {e}",
            cwd.display()
        ))
    })?;
    if let Some(asked) = job.device() {
        // In a group each rank computes on its own GPU, as the ranks of a launch do.
        let asked = match world {
            Some(w) => asked.for_rank(w)?,
            None => asked,
        };
        resident.0.check_device(asked)?;
    }
    job.run(resident)?;
    // The other ranks wait until rank 0 has written the files.
    after_rank0(resident)
}

/// How often the ticker sends the progress bars' positions.
const TICK: Duration = Duration::from_millis(100);

/// Streams the position of the job's progress bars every `tick` while they move, until `over`
/// says the job ended (its sender dropped): the ticker wakes then, not at its next tick, since
/// the job's answer waits for it (a sleeping ticker added up to a tick to every job).
fn ticker(
    bars: &Mutex<Vec<(String, indicatif::ProgressBar)>>,
    reply: &Reply,
    over: mpsc::Receiver<()>,
    tick: Duration,
) {
    let mut last: Vec<(u64, u64)> = Vec::new();
    loop {
        let done = !matches!(
            over.recv_timeout(tick),
            Err(mpsc::RecvTimeoutError::Timeout)
        );
        let now: Vec<(String, u64, u64)> = bars
            .lock()
            .map(|b| {
                b.iter()
                    .map(|(w, bar)| (w.clone(), bar.position(), bar.length().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default();
        for (i, (what, pos, len)) in now.iter().enumerate() {
            if last.get(i) != Some(&(*pos, *len)) {
                reply.send(&Response::Progress {
                    what: what.clone(),
                    pos: *pos,
                    len: *len,
                });
            }
        }
        last = now.into_iter().map(|(_, p, l)| (p, l)).collect();
        if done {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ticker ends when the job does, woken by the end rather than at its next tick: with
    /// a tick of an hour it still returns at once, after sending the bars' last positions.
    #[test]
    fn the_ticker_is_woken_by_the_end_of_the_job() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let reply = Reply(Arc::new(Mutex::new(ours)));
        let bar = indicatif::ProgressBar::hidden();
        bar.set_length(4);
        bar.set_position(3);
        let bars = Mutex::new(vec![("samples".to_string(), bar)]);
        let (job_over, over) = mpsc::channel::<()>();
        let (returned, ticker_done) = mpsc::channel();
        // Not joined: a ticker that sleeps its tick fails the test instead of hanging it.
        std::thread::spawn(move || {
            ticker(&bars, &reply, over, Duration::from_secs(3600));
            returned.send(()).unwrap();
        });
        drop(job_over);
        ticker_done
            .recv_timeout(Duration::from_secs(60))
            .expect("the ticker still sleeps after the job ended");
        let mut line = String::new();
        BufReader::new(theirs).read_line(&mut line).unwrap();
        let sent: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(sent["type"], "progress", "{line}");
        assert_eq!(
            (sent["pos"].as_u64(), sent["len"].as_u64()),
            (Some(3), Some(4))
        );
    }

    /// A connection is taken as soon as it comes: the listener's poll wakes for it (a look at
    /// it without waiting sees the client before `accept`).
    #[test]
    fn poll_one_sees_a_waiting_client_and_a_closed_peer() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("s")).unwrap();
        let fd = listener.as_raw_fd();
        assert_eq!(poll_one(fd, libc::POLLIN, 0), 0);
        let client = UnixStream::connect(dir.path().join("s")).unwrap();
        assert_ne!(poll_one(fd, libc::POLLIN, 0) & libc::POLLIN, 0);
        let (served, _) = listener.accept().unwrap();
        assert!(!client_gone(&served));
        drop(client);
        assert!(client_gone(&served));
    }
}
