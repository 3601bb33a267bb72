//! The run's warm daemon (`daemon = true`): starting `tandem daemon` (with `gpus = N > 1` a
//! daemon group under `tandem launch`), its sockets and health, restarts, and stopping it. A
//! placed run (`[placement]`) has two: the training side's and the rollout side's.

use super::console::Console;
use super::placement::Side;
use super::plan::Plan;
use crate::bail_input;
use crate::process::die_with_parent;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How often a dead daemon is restarted for one stage before the run gives up.
pub(super) const MAX_DAEMON_RESTARTS: u32 = 3;

/// A daemon process started by the runner. Dropping it stops it (shutdown by SIGTERM, SIGKILL
/// after a grace period) and removes its socket, so no run leaves one behind.
struct DaemonProc {
    /// The daemon, or the launcher of a daemon group (its ranks die with it).
    child: std::process::Child,
    /// The socket the stages use (rank 0's in a group).
    socket: PathBuf,
    /// Every rank's socket, removed when it stops.
    sockets: Vec<PathBuf>,
}

impl DaemonProc {
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        use wait_timeout::ChildExt;
        if self.alive() {
            // SAFETY: kill(2) of our own child, which has not been reaped (alive above).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
            let stopped = self
                .child
                .wait_timeout(Duration::from_secs(60))
                .ok()
                .flatten();
            if stopped.is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        for s in &self.sockets {
            let _ = std::fs::remove_file(s);
        }
    }
}

/// The daemon's answer to `health` when it is up and well (a daemon group whose rank failed
/// answers with an error: it is as good as gone).
fn daemon_health(socket: &Path) -> Result<()> {
    use crate::daemon::protocol::{Request, Response};
    match crate::daemon::client::request(socket, &Request::Health)? {
        Response::Status { .. } => Ok(()),
        Response::Error { message, .. } => anyhow::bail!("{message}"),
        other => anyhow::bail!("unexpected answer to health: {other:?}"),
    }
}

/// The run's daemon: none until a stage needs it, then the process (or group) serving the
/// model stages.
#[derive(Default)]
pub(super) struct Daemon {
    /// The warm daemon the model stages are sent to, once started.
    proc: Option<DaemonProc>,
    /// Whether this runner started a daemon before (a missing one was then lost).
    started: bool,
    /// Which side's daemon this is.
    side: Side,
    /// The length of its log when it last started (what follows is this group's).
    log_from: u64,
}

impl Daemon {
    /// The daemon of `side` (none started yet).
    pub(super) fn of(side: Side) -> Daemon {
        Daemon {
            side,
            ..Daemon::default()
        }
    }

    /// What the messages call it.
    fn name(&self) -> &'static str {
        match self.side {
            Side::Train => "daemon",
            Side::Rollout => "rollout group",
        }
    }

    /// The side's log file in the run directory.
    fn log_path(&self, plan: &Plan) -> PathBuf {
        match self.side {
            Side::Train => plan.run.root.join("daemon.log"),
            Side::Rollout => plan.run.root.join("rollout-daemon.log"),
        }
    }

    /// Starts the daemon (policy: the run's current policy pointer once there is one, so a
    /// restart resumes from the last synced checkpoint) and waits until it answers `health`.
    /// With `gpus = N > 1`, N daemons under `tandem launch` (rank 0 answers once all are up).
    fn start(&mut self, plan: &Plan) -> Result<()> {
        let socket = plan.socket_of(self.side);
        let sockets = plan.daemon_sockets(self.side);
        let longest = sockets.last().expect("one socket at least");
        // sun_path holds 108 bytes with its NUL.
        if longest.as_os_str().len() > 100 {
            bail_input!(
                "daemon = true: the socket path {} is too long for a unix socket; use a shorter --run-dir (a relative one)",
                longest.display()
            );
        }
        let log_path = self.log_path(plan);
        self.log_from = std::fs::metadata(&log_path).map_or(0, |m| m.len());
        let (program, mut cmd) = daemon_command(plan, &socket, self.side);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let mut proc = DaemonProc {
            child,
            socket: socket.clone(),
            sockets,
        };
        let t0 = Instant::now();
        loop {
            let health = daemon_health(&socket);
            if health.is_ok() {
                break;
            }
            if !proc.alive() || t0.elapsed() > Duration::from_secs(1800) {
                anyhow::bail!(
                    "the daemon did not come up (see {}): {}",
                    log_path.display(),
                    health.err().map(|e| format!("{e:#}")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.proc = Some(proc);
        Ok(())
    }

    /// Makes sure the daemon runs before a stage that uses it: starts it the first time,
    /// restarts it when it died. Returns whether it was (re)started.
    pub(super) fn ensure(
        &mut self,
        plan: &Plan,
        console: &mut Console,
        restarts: &mut u32,
    ) -> Result<bool> {
        let first = !self.started;
        if let Some(d) = &mut self.proc {
            if d.alive() {
                return Ok(false);
            }
        }
        if !first {
            let status = match &mut self.proc {
                Some(d) => d.child.wait().ok().map(|s| s.to_string()),
                None => Some("stopped: it no longer answered".to_string()),
            };
            *restarts += 1;
            let msg = format!(
                "pipeline: the {} died ({}); restarting it {} ({} of at most {MAX_DAEMON_RESTARTS} restarts)",
                self.name(),
                status.unwrap_or_default(),
                match self.side {
                    Side::Train => "from the current policy",
                    Side::Rollout => "from the initial model",
                },
                restarts
            );
            console.say(&msg);
            self.proc = None;
            if *restarts > MAX_DAEMON_RESTARTS {
                anyhow::bail!(
                    "the {} died {restarts} times; giving up (see {})",
                    self.name(),
                    self.log_path(plan).display()
                );
            }
        }
        self.start(plan)?;
        self.started = true;
        Ok(true)
    }

    /// Whether the daemon is dead or no longer answers (after a stage failed). A daemon that
    /// is still there but silent is stopped, so that `ensure` starts a new one.
    pub(super) fn gone(&mut self) -> bool {
        let Some(d) = &mut self.proc else {
            return false;
        };
        if !d.alive() {
            return true;
        }
        if daemon_health(&d.socket).is_ok() {
            return false;
        }
        // The socket closes a moment before the process is reapable.
        let t0 = Instant::now();
        while d.alive() && t0.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if d.alive() {
            self.proc = None;
        }
        true
    }

    /// What the launcher of the group said about the rank that ended it (its first line in
    /// the side's log since the group started); None when it said nothing (one rank).
    pub(super) fn death_note(&self, plan: &Plan) -> Option<String> {
        use std::io::{Read, Seek};
        let mut f = std::fs::File::open(self.log_path(plan)).ok()?;
        f.seek(std::io::SeekFrom::Start(self.log_from)).ok()?;
        let mut text = String::new();
        f.read_to_string(&mut text).ok()?;
        let line = text
            .lines()
            .find(|l| l.starts_with("tandem launch: rank "))?;
        let what = line.trim_start_matches("tandem launch: ");
        // Without what the launcher did next ("; stopping the other ranks").
        Some(what.split("; ").next().unwrap_or(what).to_string())
    }

    /// Stops the daemon (at the end of the run).
    pub(super) fn stop(&mut self) {
        self.proc = None;
    }
}

/// The `tandem daemon` command (under `tandem launch` for a group) serving `side`'s model
/// stages at `socket`, and the program it runs. The rollout side starts from the initial model:
/// the current policy reaches it by a transfer.
fn daemon_command(plan: &Plan, socket: &Path, side: Side) -> (PathBuf, std::process::Command) {
    let spec = &plan.spec;
    let policy = if plan.run.policy().exists() && side == Side::Train {
        plan.run.policy()
    } else {
        spec.model.path.clone()
    };
    let program = plan.bins.join("tandem");
    let mut cmd = std::process::Command::new(&program);
    if spec.batch_invariant {
        cmd.env("TANDEM_BATCH_INVARIANT", "1");
    }
    if let Some(gpus) = plan.visible_gpus(side) {
        cmd.env("CUDA_VISIBLE_DEVICES", gpus);
    }
    cmd.args(plan.daemon_launch_prefix(side))
        .args(["daemon", "--device", spec.device.as_str(), "--socket"])
        .arg(socket)
        .arg("--policy")
        .arg(&policy);
    if plan.needs_ref() && side == Side::Train {
        cmd.arg("--ref").arg(spec.reference_model());
    }
    let update = &plan.stages.update.args;
    if update.lora.lora_rank > 0 && side == Side::Train {
        // The policy as the LoRA updates train it, from the start: the base frozen, never
        // with f32 masters. A daemon that starts on the base model serves step 1's update
        // next (a checkpoint's adapters are read from it instead), whose seed draws them.
        cmd.args(["--lora-rank", &update.lora.lora_rank.to_string()])
            .args(["--lora-alpha", &update.lora.lora_alpha.to_string()])
            .args(["--lora-targets", &update.lora.lora_targets])
            .args(["--lora-seed", &plan.update_seed(1).to_string()]);
    }
    (program, cmd)
}
