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

use super::protocol::{Reply, Request, Response};
use super::resident::{Options, Resident};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::bail_input;
use crate::engine::cancel::{self, Cancel};
use crate::error::is_input_error;
use crate::stage::common::{resolve_model, Device, ModelRef};
use crate::stage::{ref_logprob, rollout, update, Exec, StageJob};
use anyhow::{Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
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
}

/// Set by SIGTERM/SIGINT and by a `shutdown` request.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// A job handed from a connection thread to the main thread.
struct Work {
    cwd: PathBuf,
    job: Box<StageJob>,
    reply: Reply,
    done: mpsc::Sender<()>,
    /// Set by the connection's thread when the client goes away.
    cancel: Cancel,
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
}

impl Shared {
    fn snapshot(&self) -> Value {
        json!({
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
        })
    }
}

pub fn run(args: DaemonArgs) -> Result<()> {
    let opts = Options {
        offload_optimizer: args.offload_optimizer,
        offload_ref: args.offload_ref,
    };
    match args.device {
        Device::Cpu => serve(
            &args,
            Resident::new(Box::new(|| Ok(Cpu)), args.device, opts),
        ),
        Device::Cuda(n) => {
            // Open the device once now so that a missing GPU is reported before anything else.
            CudaBackend::new(n)?;
            let make = Box::new(move || CudaBackend::new(n));
            serve(&args, Resident::new(make, args.device, opts))
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
    // SAFETY: umask(2) only swaps the process's file-mode mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
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
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
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

fn serve<B: Backend>(args: &DaemonArgs, mut resident: Resident<B>) -> Result<()> {
    claim_socket(&args.socket)?;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    // Load before listening: a daemon that answers `health` is ready for jobs.
    let policy = resolve_model(&args.policy)?;
    resident.preload_policy(&policy)?;
    if let Some(r) = &args.reference {
        resident.preload_ref(&resolve_model(r)?.dir)?;
    }
    let listener = bind_private(&args.socket)?;
    let socket = args.socket.canonicalize()?;
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
    }));
    eprintln!(
        "daemon: {} on {} (pid {}), policy {} (policy_version {})",
        socket.display(),
        args.device,
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

    while !STOP.load(Ordering::SeqCst) {
        let work = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(w) => w,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        run_job(&mut resident, work, &shared, &home);
    }
    STOP.store(true, Ordering::SeqCst);
    let _ = acceptor.join();
    // Jobs that were queued behind the last one are refused, not dropped silently.
    while let Ok(w) = rx.try_recv() {
        w.reply.send(&Response::Error {
            message: "the daemon is shutting down; the job did not run".into(),
            input_error: false,
        });
        let _ = w.done.send(());
    }
    std::fs::remove_file(&socket).ok();
    eprintln!("daemon: stopped, {} removed", socket.display());
    Ok(())
}

fn accept_loop(listener: UnixListener, tx: mpsc::Sender<Work>, shared: Arc<Mutex<Shared>>) {
    let me = unsafe { libc::geteuid() };
    while !STOP.load(Ordering::SeqCst) {
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
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
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
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one valid descriptor, no wait.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    // A unix stream socket reports POLLHUP once the peer's end is closed for good.
    n > 0 && pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0
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
                let status = shared.lock().expect("shared").snapshot();
                reply.send(&Response::Status { status });
            }
            Request::Shutdown => {
                STOP.store(true, Ordering::SeqCst);
                reply.send(&Response::ShuttingDown);
            }
            Request::Job { cwd, job } => {
                if STOP.load(Ordering::SeqCst) {
                    reply.send(&Response::Error {
                        message: "the daemon is shutting down; the job did not run".into(),
                        input_error: false,
                    });
                    continue;
                }
                let (done, wait) = mpsc::channel();
                shared.lock().expect("shared").queued += 1;
                let cancel = Cancel::new();
                let sent = tx.send(Work {
                    cwd,
                    job,
                    reply: reply.clone(),
                    done,
                    cancel: cancel.clone(),
                });
                if sent.is_err() {
                    return;
                }
                // The next request of this client waits for this job; meanwhile the job is
                // cancelled as soon as its client is gone.
                loop {
                    match wait.recv_timeout(Duration::from_millis(100)) {
                        Ok(()) => break,
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            if !cancel.is_cancelled() && client_gone(&watch) {
                                cancel.cancel();
                            }
                        }
                    }
                }
                if cancel.is_cancelled() {
                    return;
                }
            }
        }
    }
}

/// Runs one job on the main thread: in the client's working directory, with a ticker that
/// streams the stage's progress bars.
fn run_job<B: Backend>(
    resident: &mut Resident<B>,
    work: Work,
    shared: &Arc<Mutex<Shared>>,
    home: &Path,
) {
    let Work {
        cwd,
        job,
        reply,
        done,
        cancel,
    } = work;
    let name = job.name();
    if cancel.is_cancelled() {
        let mut s = shared.lock().expect("shared");
        s.queued = s.queued.saturating_sub(1);
        s.jobs_cancelled += 1;
        drop(s);
        eprintln!("daemon: a queued {name} job was dropped: its client went away before it ran");
        let _ = done.send(());
        return;
    }
    {
        let mut s = shared.lock().expect("shared");
        s.queued = s.queued.saturating_sub(1);
        s.running = Some(name);
    }
    let started = Instant::now();
    resident.begin(name, Some(reply.clone()));
    let finished = AtomicBool::new(false);
    let bars = resident.bars.clone();
    let result = std::thread::scope(|scope| {
        scope.spawn(|| ticker(&bars, &reply, &finished));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cancel.install(|| run_in(&mut Watched(resident), cwd, *job))
        }));
        finished.store(true, Ordering::SeqCst);
        match r {
            Ok(r) => r,
            Err(_) => Err(anyhow::anyhow!(
                "the daemon's {name} job panicked (a bug; its message is in the daemon's log)"
            )),
        }
    });
    let _ = std::env::set_current_dir(home);
    let mut metrics = resident.end(name, result.is_ok());
    if let Some(m) = metrics.as_object_mut() {
        m.insert("seconds".into(), started.elapsed().as_secs_f64().into());
    }
    let cancelled = matches!(&result, Err(e) if cancel::is_cancelled(e));
    {
        let mut s = shared.lock().expect("shared");
        s.running = None;
        match (&result, cancelled) {
            (Ok(()), _) => s.jobs_done += 1,
            (Err(_), true) => s.jobs_cancelled += 1,
            (Err(_), false) => s.jobs_failed += 1,
        }
        s.resident = resident.status();
    }
    if cancelled {
        eprintln!(
            "daemon: the {name} job was cancelled after {:.1} s: its client went away; nothing was written",
            started.elapsed().as_secs_f64()
        );
    }
    match result {
        Ok(()) => reply.send(&Response::Done { metrics }),
        Err(e) => reply.send(&Response::Error {
            message: format!("{e:#}"),
            input_error: is_input_error(&e),
        }),
    }
    let _ = done.send(());
}

/// The resident models as a stage's [`Exec`], checking the job's cancel flag before and after
/// each compute: a job whose client went away stops there, before the stage writes anything
/// (the engine's loops also check it between their steps).
struct Watched<'a, B: Backend>(&'a mut Resident<B>);

impl<B: Backend> Exec for Watched<'_, B> {
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

    fn train(&mut self, model: &ModelRef, job: update::Train<'_>) -> Result<update::Trained> {
        cancel::check()?;
        let out = self.0.train(model, job)?;
        cancel::check()?;
        Ok(out)
    }

    fn saved(
        &mut self,
        dir: &Path,
        trainer: Option<&crate::engine::resume::TrainerState>,
    ) -> Result<()> {
        self.0.saved(dir, trainer)
    }

    fn holder(&self) -> Option<update::Holder> {
        self.0.holder()
    }

    fn held_policy(&mut self, model: Option<&ModelRef>) -> Result<update::HeldPolicy> {
        cancel::check()?;
        self.0.held_policy(model)
    }

    fn publish(&mut self, dir: &Path, policy_version: u64) -> Result<()> {
        cancel::check()?;
        self.0.publish(dir, policy_version)
    }

    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar {
        self.0.progress_bar(len, what)
    }

    fn log(&mut self, line: &str) {
        self.0.log(line)
    }
}

/// Runs the stage's own code in the client's working directory, with the resident models as
/// its [`crate::stage::Exec`].
fn run_in<B: Backend>(resident: &mut Watched<B>, cwd: PathBuf, job: StageJob) -> Result<()> {
    std::env::set_current_dir(&cwd).map_err(|e| {
        crate::error::input_error(format!(
            "the client's working directory {} is not usable by the daemon: {e}",
            cwd.display()
        ))
    })?;
    if let Some(asked) = job.device() {
        resident.0.check_device(asked)?;
    }
    job.run(resident)
}

/// Streams the position of the job's progress bars every 100 ms while they move.
fn ticker(bars: &Mutex<Vec<(String, indicatif::ProgressBar)>>, reply: &Reply, stop: &AtomicBool) {
    let mut last: Vec<(u64, u64)> = Vec::new();
    loop {
        let done = stop.load(Ordering::SeqCst);
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
        std::thread::sleep(Duration::from_millis(100));
    }
}
