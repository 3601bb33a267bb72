//! The step loop. Each step is a list of tasks: stage commands (run as subprocesses, exactly
//! the command lines a user could type, appended to `commands.sh`) and the runner's own small
//! tasks (sampling prompts, pruning checkpoints, writing metrics). A task that finishes is
//! recorded in `state.json` before the next one starts; a rerun skips recorded tasks, so a
//! killed run continues from the last finished stage and ends where an uninterrupted one would.

use super::console::{short_duration, Console};
use super::dynamic;
use super::metrics::{self, StepFiles};
use super::rundir::{parse_step_name, step_name, RunDir, State, StepProgress};
use super::sampler::{derive_seed, Cursor, Sampler};
use super::spec::{Device, Source, Spec, Stages};
use crate::bail_input;
use crate::batch::{Batch, StageInfo};
use crate::engine::resume;
use crate::error::input_error;
use crate::process::die_with_parent;
use crate::stage::sync_weights::{self, SyncWeightsArgs};
use crate::stage::{self, InProcess};
use anyhow::{Context, Result};
use arrow_array::UInt64Array;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

/// Where the stage binaries are: `TANDEM_BIN_DIR` when set, else the directory of the running
/// `pipeline` binary (cargo puts all of a package's binaries side by side).
pub fn bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TANDEM_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("locating the pipeline binary")?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

/// What a task does.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Run a stage binary with these arguments.
    Stage {
        bin: &'static str,
        args: Vec<String>,
    },
    /// Draw the step's prompts into `step-000K/prompts.parquet`.
    SamplePrompts,
    /// DAPO's dynamic sampling (`[algorithm] filter-groups`): rounds of prompts, rollout and
    /// score until enough groups vary, kept into the step's rollout and scored files
    /// (`super::dynamic`).
    DynamicSampling,
    /// Copy the previous step's adaptive-KL state so that a rerun of `advantage` starts from
    /// the same coefficient.
    CopyKlState,
    /// Delete checkpoints that the cadence does not keep.
    PruneCheckpoints,
    /// Append the evaluation's line to eval.jsonl.
    EvalSummary,
    /// Append the step's line to metrics.jsonl.
    StepMetrics,
}

/// One unit of recorded progress.
#[derive(Clone, Debug, PartialEq)]
pub struct Task {
    /// The name recorded in state.json (unique within a step).
    pub name: &'static str,
    pub action: Action,
}

/// Quote an argument for a POSIX shell when it needs it.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=,+@%".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

/// Where one sampling pass (prompts -> rollout -> score) reads and writes.
pub struct SampleFiles {
    pub prompts: PathBuf,
    pub rollout: PathBuf,
    pub scored: PathBuf,
    pub rollout_metrics: PathBuf,
    pub score_metrics: PathBuf,
}

/// The runner of one run directory.
pub struct Runner {
    pub spec: Spec,
    /// The stages' flags from the spec, parsed by the stages.
    pub stages: Stages,
    pub run: RunDir,
    pub bins: PathBuf,
    pub state: State,
    /// The training set, read on first use.
    train: Option<Batch>,
    /// Steps whose header comment was already written to commands.sh by this process.
    announced: Option<u64>,
    /// The console (one line per step, a progress bar) and the run's log.
    pub console: Console,
    /// The `pipeline run` command that continues this run, for the message of a failed stage.
    pub rerun: String,
    /// The evaluation summary of the step in progress, for its step line.
    eval_note: Option<String>,
    /// The warm daemon the model stages are sent to (`daemon = true`), once started.
    daemon: Option<DaemonProc>,
    /// Whether this runner started a daemon before (a missing one was then lost).
    daemon_started: bool,
}

/// How often a dead daemon is restarted for one stage before the run gives up.
const MAX_DAEMON_RESTARTS: u32 = 3;

/// The run must go back to the end of step `to`: the daemon that died held the only copy of
/// the optimizer state of the steps after it.
#[derive(Debug)]
struct Rewind {
    to: u64,
    lost: u64,
}

impl std::fmt::Display for Rewind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the daemon died holding the policy of step {}; the run goes back to step {}",
            self.lost, self.to
        )
    }
}

impl std::error::Error for Rewind {}

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
                .wait_timeout(std::time::Duration::from_secs(60))
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

impl Runner {
    /// A runner for `spec` (the stage tables are parsed again here: `--steps` may have changed
    /// what the runner derives from them).
    pub fn new(spec: Spec, run: RunDir, bins: PathBuf, state: State) -> Result<Runner> {
        let stages = spec.stages(&Source {
            origin: "the spec",
            text: None,
        })?;
        Ok(Runner {
            spec,
            stages,
            run,
            bins,
            state,
            train: None,
            announced: None,
            console: Console::new(false),
            rerun: "pipeline run SPEC --run-dir RUN".into(),
            eval_note: None,
            daemon: None,
            daemon_started: false,
        })
    }

    /// Whether the step needs reference log-probs: a KL term in the reward or the loss, or a
    /// separate reference model.
    pub fn needs_ref(&self) -> bool {
        self.stages.advantage.args.kl_in_reward
            || self.stages.update.args.use_kl_loss
            || self.spec.model.reference.is_some()
    }

    /// Whether the old-logprob pass runs as a stage (an `old_logprobs` column before
    /// `advantage`): when the reward's KL or masked importance sampling (`[update] rollout-rs`)
    /// needs the column. Several optimizer steps per batch (epochs, mini-batches) need the old
    /// log-probs too, but `update` computes those itself, and with one epoch takes the first
    /// mini-batch's from its own first forward: a pass over the other rows only, and no batch
    /// file. Never in bypass mode (`[update] bypass-mode`): the rollout's log-probs are the
    /// old ones.
    pub fn needs_old(&self) -> bool {
        let u = &self.stages.update.args;
        !u.bypass_mode && (self.stages.advantage.args.kl_in_reward || u.rollout_rs.is_some())
    }

    /// Bypass mode's conditions, which hold for the whole run: the rollout's log-probs are the
    /// trainer's (batch-invariant kernels: always on the CPU), and nothing else needs the
    /// old-logprob pass it skips.
    fn check_bypass(&self) -> Result<()> {
        if !self.stages.update.args.bypass_mode {
            return Ok(());
        }
        if self.spec.device != Device::Cpu && !self.spec.batch_invariant {
            bail_input!(
                "[update] bypass-mode = true takes the rollout's log-probs as the old ones, which holds only when they are the trainer's: set batch-invariant = true (the GPU's batch-invariant kernels), or drop bypass-mode"
            );
        }
        if self.stages.advantage.args.kl_in_reward {
            bail_input!(
                "[update] bypass-mode = true skips the old-logprob pass, which [advantage] kl-in-reward needs; drop one of them"
            );
        }
        Ok(())
    }

    /// Checks every stage command of the next step (with step 0's and an evaluation's) with the
    /// stage's own parser and flag checks, before anything runs: a value the stage would refuse
    /// stops the run here, not at its stage.
    pub fn check_commands(&self) -> Result<()> {
        self.check_bypass()?;
        let step = self.state.steps_done + 1;
        let tasks = self
            .init_tasks()
            .into_iter()
            .map(|t| (0, t))
            .chain(self.step_tasks(step).into_iter().map(|t| (step, t)))
            .chain(
                dynamic::first_round_tasks(self, step)
                    .into_iter()
                    .map(|t| (step, t)),
            )
            .chain(
                (self.spec.eval.every > 0)
                    .then(|| self.eval_tasks(step))
                    .into_iter()
                    .flatten()
                    .map(|t| (step, t)),
            );
        for (step, task) in tasks {
            let Action::Stage { bin, args } = &task.action else {
                continue;
            };
            let def = stage::def(bin).expect("the runner runs the stages of STAGES");
            if let Err(e) = def.check_args(args) {
                let table = match task.name {
                    "eval-rollout" => "[rollout] or [eval]".to_string(),
                    _ => format!("[{bin}]"),
                };
                bail_input!(
                    "{table}: {e:#}\n  (`{bin}` would refuse the runner's command for {}: {})",
                    step_name(step),
                    self.stage_line(bin, args)
                );
            }
        }
        Ok(())
    }

    /// The socket of the run's daemon.
    pub fn daemon_socket(&self) -> PathBuf {
        self.run.root.join("daemon.sock")
    }

    /// `--daemon SOCKET` for the model stages when the spec asks for the warm daemon.
    fn daemon_args(&self) -> Vec<String> {
        if self.spec.daemon {
            vec!["--daemon".into(), path_arg(&self.daemon_socket())]
        } else {
            Vec::new()
        }
    }

    /// Every rank's socket: the run's socket, and with `gpus = N > 1` the other ranks'.
    fn daemon_sockets(&self) -> Vec<PathBuf> {
        (0..self.spec.gpus.max(1) as usize)
            .map(|r| crate::daemon::rank_socket(&self.daemon_socket(), r))
            .collect()
    }

    /// `tandem launch --nproc-per-node N --` before `tandem daemon` when `gpus = N > 1`: one
    /// daemon per GPU, a daemon group that serves the stages together.
    fn daemon_launch_prefix(&self) -> Vec<String> {
        if self.spec.gpus <= 1 {
            return Vec::new();
        }
        vec![
            "launch".into(),
            "--nproc-per-node".into(),
            self.spec.gpus.to_string(),
            "--".into(),
            path_arg(&self.bins.join("tandem")),
        ]
    }

    /// Starts the daemon (policy: the run's current policy pointer once there is one, so a
    /// restart resumes from the last synced checkpoint) and waits until it answers `health`.
    /// With `gpus = N > 1`, N daemons under `tandem launch` (rank 0 answers once all are up).
    fn start_daemon(&mut self) -> Result<()> {
        let socket = self.daemon_socket();
        let sockets = self.daemon_sockets();
        let longest = sockets.last().expect("one socket at least");
        // sun_path holds 108 bytes with its NUL.
        if longest.as_os_str().len() > 100 {
            bail_input!(
                "daemon = true: the socket path {} is too long for a unix socket; use a shorter --run-dir (a relative one)",
                longest.display()
            );
        }
        let policy = if self.run.policy().exists() {
            self.run.policy()
        } else {
            self.spec.model.path.clone()
        };
        let program = self.bins.join("tandem");
        let mut cmd = std::process::Command::new(&program);
        if self.spec.batch_invariant {
            cmd.env("TANDEM_BATCH_INVARIANT", "1");
        }
        cmd.args(self.daemon_launch_prefix())
            .args(["daemon", "--device", self.spec.device.as_str(), "--socket"])
            .arg(&socket)
            .arg("--policy")
            .arg(&policy);
        if self.needs_ref() {
            cmd.arg("--ref").arg(self.spec.reference_model());
        }
        let log_path = self.run.root.join("daemon.log");
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
            if !proc.alive() || t0.elapsed() > std::time::Duration::from_secs(1800) {
                anyhow::bail!(
                    "the daemon did not come up (see {}): {}",
                    log_path.display(),
                    health.err().map(|e| format!("{e:#}")).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        self.daemon = Some(proc);
        Ok(())
    }

    /// Makes sure the daemon runs before a stage that uses it: starts it the first time,
    /// restarts it when it died. Returns whether it was (re)started.
    fn ensure_daemon(&mut self, restarts: &mut u32) -> Result<bool> {
        let first = !self.daemon_started;
        if let Some(d) = &mut self.daemon {
            if d.alive() {
                return Ok(false);
            }
        }
        if !first {
            let status = match &mut self.daemon {
                Some(d) => d.child.wait().ok().map(|s| s.to_string()),
                None => Some("stopped: it no longer answered".to_string()),
            };
            *restarts += 1;
            let msg = format!(
                "pipeline: the daemon died ({}); restarting it from the current policy ({} of at most {MAX_DAEMON_RESTARTS} restarts)",
                status.unwrap_or_default(),
                restarts
            );
            self.console.say(&msg);
            self.daemon = None;
            if *restarts > MAX_DAEMON_RESTARTS {
                anyhow::bail!(
                    "the daemon died {restarts} times; giving up (see {})",
                    self.run.root.join("daemon.log").display()
                );
            }
        }
        self.start_daemon()?;
        self.daemon_started = true;
        Ok(true)
    }

    /// Whether the daemon is dead or no longer answers (after a stage failed). A daemon that
    /// is still there but silent is stopped, so that `ensure_daemon` starts a new one.
    fn daemon_gone(&mut self) -> bool {
        let Some(d) = &mut self.daemon else {
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
        while d.alive() && t0.elapsed() < std::time::Duration::from_secs(2) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if d.alive() {
            self.daemon = None;
        }
        true
    }

    /// Stops the daemon (at the end of the run).
    fn stop_daemon(&mut self) {
        self.daemon = None;
    }

    fn stage_cmd(&self, bin: &'static str, args: Vec<String>) -> Action {
        Action::Stage { bin, args }
    }

    /// `--device` for the model stages when not on the CPU (the stages' default).
    fn device_args(&self) -> Vec<String> {
        let mut a = match self.spec.device {
            Device::Cpu => Vec::new(),
            d => vec!["--device".into(), d.as_str().into()],
        };
        a.extend(self.daemon_args());
        a
    }

    /// The tasks of step 0: publish the initial model as the policy, then evaluate it.
    pub fn init_tasks(&self) -> Vec<Task> {
        let mut t = vec![Task {
            name: "sync",
            action: self.stage_cmd(
                "sync-weights",
                vec![
                    "--from".into(),
                    path_arg(&self.spec.model.path),
                    "--to".into(),
                    path_arg(&self.run.policy()),
                    "--policy-version".into(),
                    "0".into(),
                ]
                .into_iter()
                .chain(self.stages.sync_weights.argv.iter().cloned())
                .chain(self.daemon_args())
                .collect(),
            ),
        }];
        if self.spec.eval.every > 0 && self.spec.eval.at_start {
            t.extend(self.eval_tasks(0));
        }
        t
    }

    fn eval_tasks(&self, step: u64) -> Vec<Task> {
        let spec = &self.spec;
        let dir = self.run.eval_dir(step);
        let val = spec
            .data
            .val
            .as_ref()
            .expect("validated: eval needs data.val");
        let mut rollout = vec![
            "--model".into(),
            path_arg(&self.run.policy()),
            "--in".into(),
            path_arg(val),
            "--out".into(),
            path_arg(&dir.join("rollout.parquet")),
        ];
        rollout.extend(self.stages.eval.argv.iter().cloned());
        rollout.extend([
            "--seed".into(),
            derive_seed(spec.seed, &[step, 2]).to_string(),
        ]);
        rollout.extend(self.device_args());
        let mut score = vec![
            "--in".into(),
            path_arg(&dir.join("rollout.parquet")),
            "--out".into(),
            path_arg(&dir.join("scored.parquet")),
        ];
        score.extend(self.stages.score.argv.iter().cloned());
        score.extend(["--metrics".into(), path_arg(&dir.join("score.json"))]);
        vec![
            Task {
                name: "eval-rollout",
                action: self.stage_cmd("rollout", rollout),
            },
            Task {
                name: "eval-score",
                action: self.stage_cmd("score", score),
            },
            Task {
                name: "eval-summary",
                action: Action::EvalSummary,
            },
        ]
    }

    /// Whether step `step` ends with an evaluation (every `eval.every` steps, and the last).
    fn evaluates(&self, step: u64) -> bool {
        let every = self.spec.eval.every;
        every > 0 && (step.is_multiple_of(every) || step == self.spec.steps)
    }

    /// The tasks of training step `step` (1-based).
    pub fn step_tasks(&self, step: u64) -> Vec<Task> {
        let spec = &self.spec;
        let run = &self.run;
        let b = |name: &str| path_arg(&run.batch(step, name));
        let m = |name: &str| path_arg(&run.stage_metrics(step, name));
        let policy = path_arg(&run.policy());
        let mut tasks = Vec::new();
        if spec.filter_groups().is_some() {
            tasks.push(Task {
                name: "sample",
                action: Action::DynamicSampling,
            });
        } else {
            tasks.push(Task {
                name: "prompts",
                action: Action::SamplePrompts,
            });
            let files = SampleFiles {
                prompts: run.batch(step, "prompts"),
                rollout: run.batch(step, "rollout"),
                scored: run.batch(step, "scored"),
                rollout_metrics: run.stage_metrics(step, "rollout"),
                score_metrics: run.stage_metrics(step, "score"),
            };
            tasks.extend(self.sample_tasks(step, &files, derive_seed(spec.seed, &[step, 1])));
        }
        let mut last = "scored";

        // Log-probs are taken at the sampling temperature (the spec's stage flags carry it).
        let lp_flags = &self.stages.ref_logprob.argv;
        if self.needs_ref() {
            let mut args = vec![
                "--model".into(),
                path_arg(spec.reference_model()),
                "--in".into(),
                b(last),
                "--out".into(),
                b("ref"),
                "--column".into(),
                "ref_logprobs".into(),
            ];
            args.extend(lp_flags.iter().cloned());
            args.extend(self.device_args());
            tasks.push(Task {
                name: "ref",
                action: self.stage_cmd("ref-logprob", args),
            });
            last = "ref";
        }
        if self.needs_old() {
            let mut args = vec![
                "--model".into(),
                policy.clone(),
                "--in".into(),
                b(last),
                "--out".into(),
                b("old"),
                "--column".into(),
                "old_logprobs".into(),
            ];
            args.extend(lp_flags.iter().cloned());
            args.extend(self.device_args());
            tasks.push(Task {
                name: "old",
                action: self.stage_cmd("ref-logprob", args),
            });
            last = "old";
        }

        let mut adv = vec!["--in".into(), b(last), "--out".into(), b("adv")];
        adv.extend(self.stages.advantage.argv.iter().cloned());
        if self.stages.adaptive_kl() {
            tasks.push(Task {
                name: "kl-state",
                action: Action::CopyKlState,
            });
            adv.extend(["--kl-state".into(), path_arg(&self.kl_state(step))]);
        }
        adv.extend(["--metrics".into(), m("advantage")]);
        tasks.push(Task {
            name: "advantage",
            action: self.stage_cmd("advantage", adv),
        });

        let mut update = vec![
            "--model".into(),
            policy.clone(),
            "--in".into(),
            b("adv"),
            "--out-model".into(),
            path_arg(&run.ckpt(step)),
        ];
        // With the sampling temperature and a cosine schedule's horizon (see `Stages`).
        update.extend(self.stages.update.argv.iter().cloned());
        update.extend([
            "--seed".into(),
            derive_seed(spec.seed, &[step, 3]).to_string(),
            "--metrics".into(),
            m("update"),
        ]);
        if !self.writes_checkpoint(step) {
            update.push("--resident".into());
        }
        update.extend(self.device_args());
        tasks.push(Task {
            name: "update",
            action: self.stage_cmd("update", update),
        });
        tasks.push(Task {
            name: "sync",
            action: self.stage_cmd(
                "sync-weights",
                vec![
                    "--from".into(),
                    path_arg(&run.ckpt(step)),
                    "--to".into(),
                    policy,
                    // Explicit, so that a sync rerun after an interruption sets the same version.
                    "--policy-version".into(),
                    step.to_string(),
                ]
                .into_iter()
                .chain(self.stages.sync_weights.argv.iter().cloned())
                .chain(self.daemon_args())
                .collect(),
            ),
        });
        tasks.push(Task {
            name: "prune",
            action: Action::PruneCheckpoints,
        });
        if self.evaluates(step) {
            tasks.extend(self.eval_tasks(step));
        }
        tasks.push(Task {
            name: "metrics",
            action: Action::StepMetrics,
        });
        tasks
    }

    /// The rollout and score of one sampling pass: `files.prompts` to `files.scored`, the
    /// rollout seeded with `seed`.
    pub(super) fn sample_tasks(&self, step: u64, files: &SampleFiles, seed: u64) -> [Task; 2] {
        let mut rollout = vec![
            "--model".into(),
            path_arg(&self.run.policy()),
            "--in".into(),
            path_arg(&files.prompts),
            "--out".into(),
            path_arg(&files.rollout),
        ];
        rollout.extend(self.stages.rollout.argv.iter().cloned());
        rollout.extend([
            "--seed".into(),
            seed.to_string(),
            "--step".into(),
            step.to_string(),
            "--metrics".into(),
            path_arg(&files.rollout_metrics),
        ]);
        rollout.extend(self.device_args());
        let mut score = vec![
            "--in".into(),
            path_arg(&files.rollout),
            "--out".into(),
            path_arg(&files.scored),
        ];
        score.extend(self.stages.score.argv.iter().cloned());
        score.extend(["--metrics".into(), path_arg(&files.score_metrics)]);
        [
            Task {
                name: "rollout",
                action: self.stage_cmd("rollout", rollout),
            },
            Task {
                name: "score",
                action: self.stage_cmd("score", score),
            },
        ]
    }

    /// Whether step `step`'s update writes its checkpoint as files (weights and optimizer
    /// state). Stages run as processes need them every step (the next `update` reads them);
    /// the daemon keeps the policy in memory (`update --resident`: no weight write, no read
    /// back) and writes it on the checkpoint cadence and at the last step, as verl's save_freq
    /// does (the optimizer state alone is ~12 bytes per parameter: 6 GB at 0.5B). A dead
    /// daemon is restarted from the newest checkpoint written as files ([`Runner::rewind`]).
    /// A daemon group (`gpus > 1`) does the same, each rank keeping its shards of the state
    /// (under `[update] shard = "full"` its shards of the compute weights too).
    fn writes_checkpoint(&self, step: u64) -> bool {
        let every = self.spec.checkpoint.every;
        !self.spec.daemon || step == self.spec.steps || (every > 0 && step.is_multiple_of(every))
    }

    fn kl_state(&self, step: u64) -> PathBuf {
        self.run.step_dir(step).join("kl-state.json")
    }

    /// A task as the shell line a user could type (stage commands) or a comment saying what
    /// the runner does itself.
    pub fn describe(&self, step: u64, task: &Task) -> String {
        match &task.action {
            Action::Stage { bin, args } => self.stage_line(bin, args),
            Action::SamplePrompts => format!(
                "# pipeline: sample {} prompts of {} into {}",
                self.spec.data.prompts_per_step,
                self.spec.data.train.display(),
                self.run.batch(step, "prompts").display()
            ),
            Action::DynamicSampling => dynamic::describe(self, step),
            Action::CopyKlState if step <= 1 => format!(
                "# pipeline: start {} afresh (the controller begins at --kl-coef)",
                self.kl_state(step).display()
            ),
            Action::CopyKlState => format!(
                "# pipeline: copy {} to {}",
                self.kl_state(step - 1).display(),
                self.kl_state(step).display()
            ),
            Action::PruneCheckpoints => format!(
                "# pipeline: prune {} (keep every {}, last {})",
                self.run.ckpt_root().display(),
                self.spec.checkpoint.every,
                self.spec.checkpoint.keep_last
            ),
            Action::EvalSummary => format!(
                "# pipeline: summarise {} into {}",
                self.run.eval_dir(step).join("scored.parquet").display(),
                self.run.eval_path().display()
            ),
            Action::StepMetrics => format!(
                "# pipeline: write step {step} to {}",
                self.run.metrics_path().display()
            ),
        }
    }

    /// A stage command as a shell line.
    pub fn stage_line(&self, bin: &str, args: &[String]) -> String {
        let mut line = String::new();
        for a in self.launch_prefix(bin) {
            line.push_str(&shell_quote(&a));
            line.push(' ');
        }
        line.push_str(&shell_quote(&path_arg(&self.bins.join(bin))));
        for a in args {
            line.push(' ');
            line.push_str(&shell_quote(a));
        }
        line
    }

    /// `tandem launch --nproc-per-node N --` before a model stage when the spec has `gpus = N`
    /// (N > 1, no daemon): its ranks share the work (rollout and ref-logprob by prompts, update
    /// by rows: `StageJob::splits_over_ranks`). Nothing otherwise: one process, as before.
    fn launch_prefix(&self, bin: &str) -> Vec<String> {
        let model_stage = matches!(bin, "rollout" | "ref-logprob" | "update");
        if self.spec.gpus <= 1 || self.spec.daemon || !model_stage {
            return Vec::new();
        }
        vec![
            path_arg(&self.bins.join("tandem")),
            "launch".into(),
            "--nproc-per-node".into(),
            self.spec.gpus.to_string(),
            "--".into(),
        ]
    }

    /// Every remaining task of the run, in order, with its step.
    pub fn plan(&self) -> Vec<(u64, Task)> {
        let mut out = Vec::new();
        let skip = |step: u64, t: &Task| {
            self.state
                .current
                .as_ref()
                .is_some_and(|c| c.step == step && c.is_done(t.name))
        };
        if !self.state.init_done {
            for t in self.init_tasks() {
                if !skip(0, &t) {
                    out.push((0, t));
                }
            }
        }
        for step in self.state.steps_done + 1..=self.spec.steps {
            for t in self.step_tasks(step) {
                if !skip(step, &t) {
                    out.push((step, t));
                }
            }
        }
        out
    }

    /// Check that every stage binary the plan needs exists.
    fn check_bins(&self, plan: &[(u64, Task)]) -> Result<()> {
        let daemon = self.spec.daemon.then_some("tandem");
        let bins = plan
            .iter()
            .filter_map(|(_, t)| match &t.action {
                Action::Stage { bin, .. } => Some(*bin),
                _ => None,
            })
            .chain(daemon);
        for bin in bins {
            {
                let p = self.bins.join(bin);
                if !p.is_file() {
                    anyhow::bail!(
                        "stage binary `{bin}` not found at {} (build the stages with `cargo build`, or set TANDEM_BIN_DIR to where they are)",
                        p.display()
                    );
                }
            }
        }
        Ok(())
    }

    /// Run every remaining task.
    pub fn run(&mut self) -> Result<()> {
        // A resumed run whose daemon held the newest optimizer state (the runner was stopped
        // between checkpoints) goes back to the last checkpoint that has it.
        if self.spec.daemon && self.state.init_done {
            if let Some(r) = self.rewind_target(self.state.steps_done + 1)? {
                self.rewind(r.to, r.lost)?;
            }
        }
        let plan = self.plan();
        self.check_bins(&plan)?;
        let total = self.spec.steps;
        // Drawn only on a terminal; piped, the step lines are the progress.
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} step {pos}/{len} [{elapsed_precise}<{eta}] {msg}",
            )
            .expect("valid template"),
        );
        bar.set_position(self.state.steps_done.min(total));
        if Console::is_terminal() {
            bar.enable_steady_tick(std::time::Duration::from_secs(1));
        }
        self.console.bar = bar;
        self.console.start_clock(self.state.steps_done);
        let mut plan = plan;
        let mut rewinds = 0;
        let result = loop {
            let result = plan
                .iter()
                .try_for_each(|(step, task)| self.run_task(*step, task));
            match result {
                Err(e) => match e.downcast_ref::<Rewind>() {
                    Some(&Rewind { to, lost }) if rewinds < MAX_DAEMON_RESTARTS => {
                        rewinds += 1;
                        if let Err(e) = self.rewind(to, lost) {
                            break Err(e);
                        }
                        plan = self.plan();
                    }
                    _ => break Err(e),
                },
                Ok(()) => break Ok(()),
            }
        };
        // Stop the daemon whether the run finished or failed: no process outlives the runner.
        self.stop_daemon();
        self.console.bar.finish_and_clear();
        result
    }

    /// After the daemon died: the step to go back to when the checkpoint the run continues
    /// from (this step's update output once that ran, else the policy) had its weights or
    /// optimizer state only in the daemon's memory (a resident directory). That is the newest finished step whose checkpoint is
    /// complete, or step 0 (the initial model, where a fresh optimizer started the run).
    /// Returns that step and the step whose state was lost.
    fn rewind_target(&self, step: u64) -> Result<Option<Rewind>> {
        let update_done = self
            .state
            .current
            .as_ref()
            .is_some_and(|c| c.step == step && c.is_done("update"));
        let (frontier, lost) = if update_done {
            (self.run.ckpt(step), step)
        } else if self.run.policy().exists() {
            let policy = crate::stage::common::resolve_model(&self.run.policy())?;
            (policy.dir, policy.policy_version)
        } else {
            return Ok(None);
        };
        if resume::resumable(&frontier)? {
            return Ok(None);
        }
        let mut to = 0;
        for s in (1..=self.state.steps_done.min(lost.saturating_sub(1))).rev() {
            let dir = self.run.ckpt(s);
            if dir.is_dir() && resume::resumable(&dir)? {
                to = s;
                break;
            }
        }
        Ok(Some(Rewind { to, lost }))
    }

    /// Goes back to the end of step `to`: its checkpoint (the initial model for 0) becomes the
    /// policy again, the sampler's cursor is replayed to where it stood, and the steps after
    /// it run again (deterministically: their seeds derive from the step).
    fn rewind(&mut self, to: u64, lost: u64) -> Result<()> {
        let msg = format!(
            "pipeline: the policy after step {lost} (weights and optimizer state) was only in the daemon's memory; going back to step {to}, the last checkpoint written as files"
        );
        self.console.say(&msg);
        let from = if to == 0 {
            self.spec.model.path.clone()
        } else {
            self.run.ckpt(to)
        };
        let args = SyncWeightsArgs {
            from,
            to: self.run.policy(),
            policy_version: Some(to),
            daemon: None,
        };
        sync_weights::run(args, &mut InProcess::new(crate::stage::common::Device::Cpu))?;
        self.state.sampler = dynamic::cursor_after(self, to)?;
        self.state.steps_done = to;
        self.state.current = None;
        self.console.bar.set_position(to);
        self.run.save_state(&self.state)
    }

    pub(super) fn progress(&mut self, step: u64) -> &mut StepProgress {
        if self.state.current.as_ref().map(|c| c.step) != Some(step) {
            self.state.current = Some(StepProgress {
                step,
                ..StepProgress::default()
            });
        }
        self.state.current.as_mut().expect("set above")
    }

    fn run_task(&mut self, step: u64, task: &Task) -> Result<()> {
        self.console
            .bar
            .set_message(format!("{} ({})", task.name, step_name(step)));
        let t0 = Instant::now();
        match &task.action {
            Action::Stage { bin, args } => self.run_stage(step, task.name, bin, args)?,
            Action::SamplePrompts => self.sample_prompts(step)?,
            Action::DynamicSampling => dynamic::run(self, step)?,
            Action::CopyKlState => self.copy_kl_state(step)?,
            Action::PruneCheckpoints => self.prune(step)?,
            Action::EvalSummary => {
                let line =
                    metrics::eval_line(step, &self.run.eval_dir(step).join("scored.parquet"))?;
                metrics::put_line(
                    &self.run.eval_path(),
                    step,
                    &serde_json::Value::Object(line.clone()),
                )?;
                let acc = line.get("accuracy").and_then(|v| v.as_f64()).unwrap_or(0.0);
                let note = format!("eval acc {acc:.3} ({} rows)", line["rows"]);
                if step == 0 {
                    // Step 0 has no metrics line: its evaluation is its line.
                    let total = self.spec.steps;
                    self.console
                        .say(&format!("step 0/{total}  {note} (the initial policy)"));
                } else {
                    self.eval_note = Some(note);
                }
            }
            Action::StepMetrics => self.step_metrics(step)?,
        }
        let secs = t0.elapsed().as_secs_f64();
        let last = matches!(task.action, Action::StepMetrics)
            || (step == 0 && self.init_tasks().last().map(|t| t.name) == Some(task.name));
        let progress = self.progress(step);
        progress.done.push(task.name.to_string());
        if matches!(task.action, Action::Stage { .. }) {
            progress.seconds.insert(task.name.to_string(), secs);
        }
        if last {
            self.state.current = None;
            if step == 0 {
                self.state.init_done = true;
            } else {
                self.state.steps_done = step;
                self.console.bar.set_position(step);
            }
        }
        self.run.save_state(&self.state)
    }

    fn append_command(&mut self, step: u64, line: &str) -> Result<()> {
        let path = self.run.commands_path();
        let mut text = String::new();
        if !path.exists() {
            let cwd = std::env::current_dir().unwrap_or_default();
            text += &format!(
                "#!/bin/sh\n# Stage commands of the tandem run in {}, in the order they ran\n# (a stage rerun after an interruption appears again). Run from {}.\nset -e\n",
                self.run.root.display(),
                shell_quote(&cwd.display().to_string())
            );
            if self.spec.daemon {
                text += &format!(
                    "# The model stages are clients of the run's daemon (--daemon); to replay them start one\n# first: {} {}daemon --device {} --socket {} --policy {}\n",
                    shell_quote(&path_arg(&self.bins.join("tandem"))),
                    self.daemon_launch_prefix()
                        .iter()
                        .map(|a| shell_quote(a) + " ")
                        .collect::<String>(),
                    self.spec.device.as_str(),
                    shell_quote(&path_arg(&self.daemon_socket())),
                    shell_quote(&path_arg(&self.spec.model.path)),
                );
            }
        }
        if self.announced != Some(step) {
            text += &format!("\n# {}\n", step_name(step));
            self.announced = Some(step);
        }
        text += line;
        text.push('\n');
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        f.write_all(text.as_bytes())?;
        Ok(())
    }

    pub(super) fn run_stage(
        &mut self,
        step: u64,
        task: &str,
        bin: &str,
        args: &[String],
    ) -> Result<()> {
        let via_daemon = self.spec.daemon && stage::def(bin).is_some_and(|d| d.takes("daemon"));
        if !via_daemon {
            return self.run_stage_once(step, task, bin, args);
        }
        let mut restarts = 0;
        loop {
            self.ensure_daemon(&mut restarts)?;
            match self.run_stage_once(step, task, bin, args) {
                Ok(()) => return Ok(()),
                // A stage that failed because the daemon died runs again on a new daemon
                // (which loads the current policy); any other failure stops the run.
                Err(e) if self.daemon_gone() => {
                    let msg = format!("pipeline: {task} failed with the daemon gone: {e:#}");
                    self.console.say(&msg);
                    if let Some(r) = self.rewind_target(step)? {
                        return Err(r.into());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn run_stage_once(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()> {
        let line = self.stage_line(bin, args);
        self.append_command(step, &line)?;
        // Stages write their outputs where they are told; the runner makes the directories.
        for pair in args.windows(2) {
            if ["--out", "--out-model", "--metrics", "--kl-state", "--to"]
                .contains(&pair[0].as_str())
            {
                if let Some(dir) = Path::new(&pair[1])
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                }
            }
        }
        let program = self.bins.join(bin);
        let launch = self.launch_prefix(bin);
        let mut cmd = match launch.split_first() {
            Some((tandem, rest)) => {
                let mut c = std::process::Command::new(tandem);
                c.args(rest).arg(&program);
                c
            }
            None => std::process::Command::new(&program),
        };
        if self.spec.batch_invariant {
            cmd.env("TANDEM_BATCH_INVARIANT", "1");
        }
        cmd.args(args).stdin(Stdio::null());
        die_with_parent(&mut cmd);
        let header = if task == bin {
            format!("[{}] {bin}: {line}", step_name(step))
        } else {
            format!("[{}] {task}: {line}", step_name(step))
        };
        self.console.detail(&header);
        let out = self
            .console
            .run(&mut cmd)
            .with_context(|| format!("starting {}", program.display()))?;
        if out.status.success() {
            return Ok(());
        }
        let what = match out.status.code() {
            Some(c) => format!("exit code {c}"),
            None => "killed by a signal".to_string(),
        };
        let tail: Vec<String> = out.tail.iter().map(|l| format!("  | {l}")).collect();
        let shown = match self.console.log_path() {
            Some(p) => format!("its output ended with (all of it in {}):", p.display()),
            None => "its output ended with:".to_string(),
        };
        let bad_input = out.status.code() == Some(2);
        // A stage that refused its input needs a fix in the spec (or in a file it names): the
        // run continues under the edited spec only when told so. Otherwise the same command
        // continues it.
        let next = match bad_input {
            true => format!(
                "Fix the cause (a value in the spec, or the file named above), then continue the run from this stage with:\n  {} --allow-spec-change\n(--allow-spec-change continues under the edited spec and records the edit in {})",
                self.rerun,
                self.run.spec_changes_path().display()
            ),
            false => format!(
                "Once the cause is fixed (or to retry), continue the run from this stage with:\n  {}",
                self.rerun
            ),
        };
        let msg = format!(
            "{}: stage `{bin}` failed ({what}); {shown}\n{}\nCommand:\n  {line}\n{next}",
            step_name(step),
            tail.join("\n")
        );
        if bad_input {
            Err(input_error(msg))
        } else {
            Err(anyhow::anyhow!(msg))
        }
    }

    /// The training set as `preflight::check` read it (sampled from without reading it again).
    pub fn set_train_set(&mut self, batch: Batch) {
        self.train = Some(batch);
    }

    fn train_batch(&mut self) -> Result<&Batch> {
        if self.train.is_none() {
            let b = Batch::read(&self.spec.data.train, &[])?;
            if b.num_rows() == 0 {
                bail_input!(
                    "{}: the training set has no rows",
                    self.spec.data.train.display()
                );
            }
            self.train = Some(b);
        }
        Ok(self.train.as_ref().expect("read above"))
    }

    fn sample_prompts(&mut self, step: u64) -> Result<()> {
        let out = self.run.batch(step, "prompts");
        let count = self.spec.data.prompts_per_step;
        self.state.sampler = self.draw_prompts(step, self.state.sampler, count, &out)?;
        Ok(())
    }

    /// The prompt sampler over the training set.
    pub(super) fn sampler(&self) -> Sampler {
        Sampler {
            seed: self.spec.seed,
            len: self.state.train_rows,
            shuffle: self.spec.data.shuffle,
        }
    }

    /// Writes `count` prompts drawn from `cursor` to `out`; returns the cursor after them.
    pub(super) fn draw_prompts(
        &mut self,
        step: u64,
        cursor: Cursor,
        count: u64,
        out: &Path,
    ) -> Result<Cursor> {
        let seed = self.spec.seed;
        let shuffle = self.spec.data.shuffle;
        let train_rows = self.state.train_rows;
        let batch = self.train_batch()?;
        if batch.num_rows() as u64 != train_rows {
            bail_input!(
                "{}: has {} rows but had {train_rows} when the run began; a resumed run must sample from the same data",
                batch.path.display(),
                batch.num_rows()
            );
        }
        let sampler = Sampler {
            seed,
            len: batch.num_rows() as u64,
            shuffle,
        };
        let (rows, next) = sampler.draw(cursor, count);
        let data = arrow_select::take::take_record_batch(&batch.data, &UInt64Array::from(rows))?;
        let meta = batch.derived_meta(&StageInfo {
            stage: "sample",
            params: json!({
                "dataset": batch.path,
                "seed": seed,
                "shuffle": shuffle,
                "epoch": cursor.epoch,
                "position": cursor.position,
                "count": count,
            }),
            policy_version: None,
            step: Some(step),
        });
        crate::batch::write_file(out, &data, &meta)?;
        Ok(next)
    }

    fn copy_kl_state(&mut self, step: u64) -> Result<()> {
        let dst = self.kl_state(step);
        let src = self.kl_state(step - 1);
        if src.exists() {
            let bytes =
                std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
            super::rundir::write_atomic(&dst, &bytes)?;
        } else if dst.exists() {
            // First step: the controller starts from --kl-coef, so no state may linger from an
            // interrupted attempt.
            std::fs::remove_file(&dst)?;
        }
        Ok(())
    }

    /// Keep the current policy's checkpoint and the newest `keep-last` of the cadence ones.
    fn prune(&mut self, step: u64) -> Result<()> {
        let root = self.run.ckpt_root();
        let Ok(entries) = std::fs::read_dir(&root) else {
            return Ok(());
        };
        let mut steps: Vec<(u64, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                parse_step_name(&name).map(|s| (s, e.path()))
            })
            .collect();
        steps.sort();
        let keep = kept_checkpoints(
            steps.iter().map(|(s, _)| *s).filter(|&s| s <= step),
            step,
            self.spec.checkpoint.every,
            self.spec.checkpoint.keep_last,
        );
        for (s, path) in steps {
            if s <= step && !keep.contains(&s) {
                std::fs::remove_dir_all(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            }
        }
        Ok(())
    }

    fn step_metrics(&mut self, step: u64) -> Result<()> {
        let run = self.run.clone();
        let seconds = self
            .state
            .current
            .as_ref()
            .map(|c| c.seconds.clone())
            .unwrap_or_default();
        let with_ref = if self.needs_ref() {
            Some(run.batch(step, "ref"))
        } else {
            None
        };
        let line = metrics::step_line(&StepFiles {
            step,
            scored: &run.batch(step, "scored"),
            with_ref: with_ref.as_deref(),
            stage_metrics: vec![
                ("rollout", run.stage_metrics(step, "rollout")),
                ("score", run.stage_metrics(step, "score")),
                ("sampling", run.stage_metrics(step, "sampling")),
                ("advantage", run.stage_metrics(step, "advantage")),
                ("update", run.stage_metrics(step, "update")),
            ],
            seconds: &seconds,
        })?;
        let total = self.spec.steps;
        let mut text = metrics::summary_text(&line, total);
        if let Some(note) = self.eval_note.take() {
            text += &format!("  {note}");
        }
        if let Some(eta) = self.console.eta(step, total) {
            text += &format!("  ETA {}", short_duration(eta));
        }
        metrics::put_line(&run.metrics_path(), step, &serde_json::Value::Object(line))?;
        self.console.say(&text);
        Ok(())
    }
}

/// Which checkpoint steps survive at `current`: the current one, and the newest `keep_last`
/// of those on the cadence (`every` > 0).
pub fn kept_checkpoints(
    present: impl Iterator<Item = u64>,
    current: u64,
    every: u64,
    keep_last: u64,
) -> Vec<u64> {
    let mut cadence: Vec<u64> = present
        .filter(|&s| every > 0 && s > 0 && s % every == 0)
        .collect();
    cadence.sort();
    let from = cadence.len().saturating_sub(keep_last as usize);
    let mut keep = cadence.split_off(from);
    if !keep.contains(&current) {
        keep.push(current);
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("a/b.parquet"), "a/b.parquet");
        assert_eq!(shell_quote("cmd:python3 r.py"), "'cmd:python3 r.py'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    const SPEC: &str = "steps = 2\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nval = \"v.parquet\"\nprompts-per-step = 4\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n[eval]\nevery = 1\n";

    fn runner(text: &str) -> Runner {
        let spec = Spec::parse(text, "t.toml").unwrap_or_else(|e| panic!("{e:#}"));
        let state = State::default();
        Runner::new(spec, RunDir::new("r"), PathBuf::from("bin"), state).unwrap()
    }

    #[test]
    fn what_a_step_runs_comes_from_the_parsed_flags() {
        let r = runner(SPEC);
        assert!(!r.needs_ref() && !r.needs_old());
        // Mini-batches and epochs: update computes the old log-probs itself, no stage.
        let r = runner(&format!("{SPEC}[update]\nmini-batch-size = 16\n"));
        assert!(!r.needs_old());
        let r = runner(&format!(
            "{SPEC}[update]\nuse-kl-loss = true\nppo-epochs = 2\n"
        ));
        assert!(r.needs_ref() && !r.needs_old());
        let r = runner(&format!(
            "{SPEC}[update]\nrollout-rs = \"token\"\nmini-batch-size = 16\n"
        ));
        assert!(r.needs_old());
        let text = SPEC.replace(
            "estimator = \"grpo\"",
            "estimator = \"grpo\"\nkl-in-reward = true\nkl-ctrl = \"adaptive\"",
        );
        let r = runner(&text);
        assert!(r.needs_ref() && r.needs_old() && r.stages.adaptive_kl());
        let names: Vec<&str> = r.step_tasks(1).iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            [
                "prompts",
                "rollout",
                "score",
                "ref",
                "old",
                "kl-state",
                "advantage",
                "update",
                "sync",
                "prune",
                "eval-rollout",
                "eval-score",
                "eval-summary",
                "metrics"
            ]
        );
        r.check_commands().unwrap();
    }

    /// Which updates write files: every one in-process; with the daemon (one, or a group at
    /// `gpus > 1`, under either shard mode) the cadence and the last step.
    #[test]
    fn updates_write_files_on_the_cadence_with_a_daemon() {
        let steps = |top: &str, update: &str| -> Vec<bool> {
            let text = SPEC.replace("steps = 2", &format!("steps = 5\n{top}"));
            let r = runner(&format!("{text}[checkpoint]\nevery = 2\n{update}"));
            (1..=5).map(|s| r.writes_checkpoint(s)).collect()
        };
        let cadence = [false, true, false, true, true];
        assert_eq!(steps("", ""), [true; 5]);
        assert_eq!(steps("gpus = 2", ""), [true; 5]);
        assert_eq!(steps("daemon = true", ""), cadence);
        assert_eq!(steps("daemon = true\ngpus = 2", ""), cadence);
        let full = "[update]\nshard = \"full\"\n";
        assert_eq!(steps("daemon = true\ngpus = 2", full), cadence);
        assert_eq!(steps("daemon = true", full), cadence);
    }

    #[test]
    fn stage_commands_are_checked_by_the_stages_before_anything_runs() {
        runner(SPEC).check_commands().unwrap();
        for (text, want) in [
            (
                format!("{SPEC}stop = [\"ok\"]\n[rollout]\nstop = [\"\"]\n"),
                "[rollout]: --stop: stop strings must not be empty\n  (`rollout` would refuse the runner's command for step-0001: bin/rollout --model r/policy",
            ),
            (
                format!("{SPEC}[rollout]\nmax-num-seqs = 8\nmax-batched-tokens = 4\n"),
                "--max-batched-tokens (4) must be >= --max-num-seqs (8)",
            ),
            (
                format!("{SPEC}max-num-seqs = 8\nmax-batched-tokens = 4\n"),
                "[rollout] or [eval]: --max-batched-tokens (4) must be >= --max-num-seqs (8): every running sample needs a token per step\n  (`rollout` would refuse the runner's command for step-0000: bin/rollout --model r/policy --in v.parquet",
            ),
            (
                format!("{SPEC}[update]\nlr-schedule = \"cosine\"\ntotal-steps = 2\nlr-warmup-steps = 5\n"),
                "[update]: --total-steps (2) must exceed --lr-warmup-steps (5)",
            ),
            (
                format!("{SPEC}[update]\nbetas = [0.9]\n"),
                "[update]: --betas takes two numbers in [0, 1)",
            ),
            (
                format!("{SPEC}[update]\nloss = \"sft\"\nrollout-is = \"token\"\n"),
                "[update]: --rollout-is weights a policy-gradient loss; --loss sft has none",
            ),
            (
                SPEC.replace("\"exact\"", "\"bogus\""),
                "[score]: --reward 'bogus': unknown reward; expected gsm8k, math,",
            ),
        ] {
            let r = runner(&text);
            let err = r.check_commands().unwrap_err();
            assert!(crate::error::is_input_error(&err));
            let msg = format!("{err:#}");
            assert!(msg.starts_with(want) || msg.contains(want), "{want:?} not in {msg:?}");
        }
        // A value out of its flag's range is refused earlier still, when the spec is loaded,
        // with its line (the flag's own value parser).
        for (text, want) in [
            (
                format!("{SPEC}[rollout]\ntemperature = nan\n"),
                "t.toml:15:1: [rollout] temperature = nan: invalid value 'NaN' for '--temperature <TEMPERATURE>': must be a finite number >= 0",
            ),
            (
                format!("{SPEC}[rollout]\ntop-p = 1.5\n"),
                "[rollout] top-p = 1.5: invalid value '1.5' for '--top-p <TOP_P>': must be a finite number in (0, 1]",
            ),
            (
                format!("{SPEC}[update]\nlr = -1.0\n"),
                "[update] lr = -1.0: invalid value '-1' for '--lr <LR>': must be a finite number >= 0",
            ),
            (
                SPEC.replace("\"grpo\"", "\"grpo\"\ngamma = 2.0"),
                "[advantage] gamma = 2.0: invalid value '2' for '--gamma <GAMMA>': must be a finite number in [0, 1]",
            ),
            (
                format!("{SPEC}[ref-logprob]\nmicro-batch-tokens = 0\n"),
                "[ref-logprob] micro-batch-tokens = 0: invalid value '0' for '--micro-batch-tokens <MICRO_BATCH_TOKENS>': must be an integer >= 1",
            ),
        ] {
            let Err(err) = Spec::parse(&text, "t.toml") else {
                panic!("accepted: {want}")
            };
            assert!(crate::error::is_input_error(&err));
            let msg = format!("{err:#}");
            assert!(msg.contains(want), "{want:?} not in {msg:?}");
        }
    }

    #[test]
    fn shipped_specs_pass_the_stages_checks() {
        // Run from the package root, where pipelines/rewards/ is.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let text = std::fs::read_to_string(&p).unwrap();
                let r = runner(&text);
                r.check_commands()
                    .unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
                // Their rewards resolve (a python: file imports and has its function).
                let score = &r.stages.score.args;
                let reward = crate::reward::RewardSpec::parse(&score.reward).unwrap();
                crate::pipeline::preflight::check_reward(
                    &reward,
                    &score.config().unwrap().options,
                    "",
                )
                .unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
                n += 1;
            }
        }
        assert!(n >= 3);
    }

    #[test]
    fn checkpoint_cadence() {
        // every 2, keep 2, now at step 7: 4 and 6 stay (2 is older), 7 is the policy.
        assert_eq!(kept_checkpoints(1..=7, 7, 2, 2), [4, 6, 7]);
        // current on the cadence is not listed twice
        assert_eq!(kept_checkpoints(1..=6, 6, 2, 2), [4, 6]);
        // no cadence: only the policy
        assert_eq!(kept_checkpoints(1..=5, 5, 0, 3), [5]);
    }
}
