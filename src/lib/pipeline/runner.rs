//! The step loop with its state: it runs the tasks `plan` derives, stage commands as
//! subprocesses (exactly the command lines a user could type, appended to `commands.sh`; on the
//! run's daemon when the spec asks for one) and the runner's own tasks (`chores`, `dynamic`).
//! A task that finishes is recorded in `state.json` before the next one starts; a rerun skips
//! recorded tasks, so a killed run continues from the last finished stage and ends where an
//! uninterrupted one would. A daemon that died holding the only copy of the policy sends the
//! run back to its last checkpoint written as files (a rewind).

use super::asynchronous::{self, Steps};
use super::chores;
use super::console::{Captured, Console};
use super::daemons::{Daemon, MAX_DAEMON_RESTARTS};
use super::dynamic::{self, Rounds};
use super::placement::Side;
use super::plan::{path_arg, shell_quote, Action, Plan, Task};
use super::rundir::{step_name, RunDir, State};
use super::sampler::{draw_into, Cursor};
use super::spec::Spec;
use crate::bail_input;
use crate::batch::Batch;
use crate::engine::resume;
use crate::error::input_error;
use crate::process::die_with_parent;
use crate::stage::sync_weights::{self, SyncWeightsArgs};
use crate::stage::{self, InProcess};
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

/// Where the stage binaries are: `TANDEM_BIN_DIR` when set, else the directory of the running
/// `pipeline` binary (cargo puts all of a package's binaries side by side).
pub(crate) fn bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TANDEM_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("locating the pipeline binary")?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

/// The runner of one run directory.
pub(crate) struct Runner {
    /// The spec, its stages' flags, the run directory and the binaries the tasks derive from.
    pub(crate) plan: Plan,
    pub(crate) state: State,
    /// The training set, read on first use.
    train: Option<Batch>,
    /// Steps whose header comment was already written to commands.sh by this process.
    announced: Option<u64>,
    /// The console (one line per step, a progress bar) and the run's log.
    pub(crate) console: Console,
    /// The `pipeline run` command that continues this run, for the message of a failed stage.
    pub(crate) rerun: String,
    /// The evaluation summary of the step in progress, for its step line.
    eval_note: Option<String>,
    /// The warm daemon the model stages are sent to (`daemon = true`).
    daemon: Daemon,
    /// A placed run's rollout group (`[placement]`; never started otherwise).
    rollout_daemon: Daemon,
    /// `mode = "async"`: the queue the rollout rounds fill (while they run).
    rounds: Option<std::sync::Arc<asynchronous::Shared>>,
}

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

impl Runner {
    /// A runner for `spec` (the stage tables are parsed again here: `--steps` may have changed
    /// what the runner derives from them).
    pub fn new(spec: Spec, run: RunDir, bins: PathBuf, state: State) -> Result<Runner> {
        Ok(Runner {
            plan: Plan::new(spec, run, bins)?,
            state,
            train: None,
            announced: None,
            console: Console::new(false),
            rerun: "pipeline run SPEC --run-dir RUN".into(),
            eval_note: None,
            daemon: Daemon::default(),
            rollout_daemon: Daemon::of(Side::Rollout),
            rounds: None,
        })
    }

    /// Checks every stage command of the next step (with step 0's and an evaluation's) with the
    /// stage's own parser and flag checks (`Plan::check_commands`).
    pub(crate) fn check_commands(&self) -> Result<()> {
        self.plan.check_commands(self.state.steps_done + 1)
    }

    /// Every remaining task of the run, in order, with its step.
    pub fn remaining(&self) -> Vec<(u64, Task)> {
        self.plan.remaining(&self.state)
    }

    /// Check that every stage binary the tasks need exists.
    fn check_bins(&self, tasks: &[(u64, Task)]) -> Result<()> {
        for bin in self.plan.bins_needed(tasks) {
            let p = self.plan.bins.join(bin);
            if !p.is_file() {
                anyhow::bail!(
                    "stage binary `{bin}` not found at {} (build the stages with `cargo build`, or set TANDEM_BIN_DIR to where they are)",
                    p.display()
                );
            }
        }
        Ok(())
    }

    /// Run every remaining task.
    pub fn run(&mut self) -> Result<()> {
        // A resumed run whose daemon held the newest optimizer state (the runner was stopped
        // between checkpoints) goes back to the last checkpoint that has it.
        if self.plan.spec.daemon && self.state.init_done {
            if let Some(r) = self.rewind_target(self.state.steps_done + 1)? {
                self.rewind(r.to, r.lost)?;
            }
        }
        let tasks = self.remaining();
        self.check_bins(&tasks)?;
        self.start_progress();
        let result = self.run_tasks(tasks);
        // Stop the daemons whether the run finished or failed: no process outlives the runner.
        self.daemon.stop();
        self.rollout_daemon.stop();
        self.console.bar.finish_and_clear();
        result
    }

    /// The progress bar over the run's steps, and the clock of the ETA.
    fn start_progress(&mut self) {
        let total = self.plan.spec.steps;
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
    }

    /// Runs `tasks` in order (in async mode beside the rollout rounds); after a rewind, the
    /// tasks remaining from there.
    fn run_tasks(&mut self, mut tasks: Vec<(u64, Task)>) -> Result<()> {
        let mut rewinds = 0;
        loop {
            let result = match self.plan.asynchronous() {
                true => asynchronous::run(self, tasks),
                false => tasks
                    .iter()
                    .try_for_each(|(step, task)| self.run_task(*step, task)),
            };
            match result {
                Err(e) => match e.downcast_ref::<Rewind>() {
                    Some(&Rewind { to, lost }) if rewinds < MAX_DAEMON_RESTARTS => {
                        rewinds += 1;
                        self.rewind(to, lost)?;
                        if self.plan.asynchronous() {
                            // The rollout group holds a newer policy than the one gone back
                            // to: a new one gets it by a transfer, and the rounds start afresh.
                            self.rollout_daemon = Daemon::of(Side::Rollout);
                        }
                        tasks = self.remaining();
                    }
                    _ => return Err(e),
                },
                Ok(()) => return Ok(()),
            }
        }
    }

    /// After the daemon died: the step to go back to when a checkpoint the run continues from
    /// (the policy's: this step's update output once that ran, else the policy; the critic's
    /// likewise) had its weights or optimizer state only in the daemon's memory (a resident
    /// directory). That is the newest finished step whose checkpoints are complete, or step 0
    /// (the initial models, where fresh optimizers started the run). Returns that step and
    /// the step whose state was lost.
    fn rewind_target(&self, step: u64) -> Result<Option<Rewind>> {
        let run = &self.plan.run;
        let policy = if self.state.is_done(step, "update") {
            Some((run.ckpt(step), step))
        } else if run.policy().exists() {
            let policy = crate::stage::common::resolve_model(&run.policy())?;
            Some((policy.dir, policy.policy_version))
        } else {
            None
        };
        let critic = match (&self.plan.spec.critic, self.state.is_done(step, "critic")) {
            (None, _) => None,
            (Some(_), true) => Some((run.critic_ckpt(step), step)),
            (Some(_), false) => Some((self.plan.critic_in(step), step.saturating_sub(1))),
        };
        let mut lost = None;
        for (frontier, at) in [policy, critic].into_iter().flatten() {
            if frontier.is_dir() && !resume::resumable(&frontier)? {
                lost = lost.max(Some(at));
            }
        }
        let Some(lost) = lost else {
            return Ok(None);
        };
        let mut to = 0;
        for s in (1..=self.state.steps_done.min(lost.saturating_sub(1))).rev() {
            if self.checkpoints_complete(s)? {
                to = s;
                break;
            }
        }
        Ok(Some(Rewind { to, lost }))
    }

    /// Whether the models after step `s` (the policy's and the critic's) are written as files
    /// with their optimizer state. In the critic's warm-up the policy is the initial model.
    fn checkpoints_complete(&self, s: u64) -> Result<bool> {
        let run = &self.plan.run;
        let mut dirs = vec![self.plan.policy_after(s)];
        if self.plan.spec.critic.is_some() {
            dirs.push(run.critic_ckpt(s));
        }
        for dir in dirs {
            if !dir.is_dir() || !resume::resumable(&dir)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Goes back to the end of step `to`: its checkpoint (the initial model for 0) becomes the
    /// policy again, the sampler's cursor is replayed to where it stood, and the steps after
    /// it run again (deterministically: their seeds derive from the step).
    fn rewind(&mut self, to: u64, lost: u64) -> Result<()> {
        let (models, were) = match self.plan.spec.critic {
            Some(_) => ("policy and critic", "were"),
            None => ("policy", "was"),
        };
        let msg = format!(
            "pipeline: the {models} after step {lost} (weights and optimizer state) {were} only in the daemon's memory; going back to step {to}, the last checkpoint written as files"
        );
        self.console.say(&msg);
        let from = self.plan.policy_after(to);
        let args = SyncWeightsArgs {
            from,
            to: self.plan.run.policy(),
            policy_version: Some(to),
            daemon: None,
        };
        sync_weights::run(args, &mut InProcess::new(crate::stage::common::Device::Cpu))?;
        let drawn = self.plan.steps_drawn(to);
        self.state.sampler = dynamic::cursor_after(&self.plan, self.state.train_rows, drawn)?;
        self.state.steps_done = to;
        self.state.current = None;
        self.console.bar.set_position(to);
        self.plan.run.save_state(&self.state)
    }

    fn run_task(&mut self, step: u64, task: &Task) -> Result<()> {
        self.console
            .bar
            .set_message(format!("{} ({})", task.name, step_name(step)));
        let t0 = Instant::now();
        let plan = &self.plan;
        match &task.action {
            Action::Stage { bin, args } => self.run_stage(step, task.name, bin, args)?,
            Action::SamplePrompts { step: of } => self.sample_prompts(*of)?,
            Action::Agent {
                prompts,
                rollout,
                seed,
            } => {
                // commands.sh says what ran instead of the rollout stage.
                self.append_command(step, &self.plan.describe(step, task))?;
                let mut agent = |r: &mut Self| {
                    super::agent::run(&r.plan, &r.console, step, prompts, rollout, *seed)
                };
                match self.plan.spec.daemon {
                    // Its server generates on the daemon.
                    true => self.on_daemon(step, task.name, &[Side::Train], &mut agent)?,
                    false => agent(self)?,
                }
            }
            Action::DynamicSampling { step: of } => dynamic::run(
                self,
                dynamic::Target {
                    step: *of,
                    within: step,
                },
            )?,
            Action::CopyKlState => chores::copy_kl_state(plan, step)?,
            Action::PruneCheckpoints => chores::prune(plan, step)?,
            Action::EvalSummary => {
                if let Some(note) = chores::eval_summary(plan, &mut self.console, step)? {
                    self.eval_note = Some(note);
                }
            }
            Action::StepMetrics => chores::step_metrics(
                plan,
                &self.state,
                &mut self.console,
                &mut self.eval_note,
                step,
            )?,
            Action::Overlap(pair) => self.run_overlap(step, pair)?,
            Action::TakeGroups => {
                let shared = self.rounds.clone().expect("the rounds run");
                asynchronous::take(self, &shared, step)?
            }
        }
        self.finish_task(step, task, t0.elapsed().as_secs_f64())
    }

    /// Records `task` of step `step` as finished (a stage with its seconds), and the step as
    /// done after its last task; saves the state.
    fn finish_task(&mut self, step: u64, task: &Task, secs: f64) -> Result<()> {
        let last = self.plan.ends_step(step, task);
        let progress = self.state.progress(step);
        progress.done.push(task.name.to_string());
        match task.action {
            // Its parts' own seconds are in `inside` and `next` (`run_overlap`).
            Action::Overlap(_) => {
                progress.seconds.insert("overlap".into(), secs);
            }
            Action::Stage { .. } | Action::Agent { .. } | Action::TakeGroups => {
                progress.seconds.insert(task.name.to_string(), secs);
            }
            _ => {}
        }
        if last {
            self.state.end_step();
            if step == 0 {
                self.state.init_done = true;
            } else {
                self.state.steps_done = step;
                self.console.bar.set_position(step);
            }
        }
        self.plan.run.save_state(&self.state)
    }

    /// The opening of commands.sh: what it is, where to run it from, and the daemon its model
    /// stages need.
    fn commands_header(&self) -> String {
        let plan = &self.plan;
        let cwd = std::env::current_dir().unwrap_or_default();
        let mut text = format!(
            "#!/bin/sh\n# Stage commands of the tandem run in {}, in the order they ran\n# (a stage rerun after an interruption appears again). Run from {}.\nset -e\n",
            plan.run.root.display(),
            shell_quote(&cwd.display().to_string())
        );
        if plan.spec.daemon {
            text += &format!(
                "# The model stages are clients of the run's daemon (--daemon); to replay them start one\n# first: {} {}daemon --device {} --socket {} --policy {}\n",
                shell_quote(&path_arg(&plan.bins.join("tandem"))),
                plan.daemon_launch_prefix(Side::Train)
                    .iter()
                    .map(|a| shell_quote(a) + " ")
                    .collect::<String>(),
                plan.spec.device.as_str(),
                shell_quote(&path_arg(&plan.daemon_socket())),
                shell_quote(&path_arg(&plan.spec.model.path)),
            );
        }
        if plan.placement().is_some() {
            text += &format!(
                "# and the rollout group ([placement]) the rollouts go to, the same way at {} (the\n# transfers are `daemon-ctl transfer` jobs between the two).\n",
                shell_quote(&path_arg(&plan.socket_of(Side::Rollout)))
            );
        }
        text
    }

    fn append_command(&mut self, step: u64, line: &str) -> Result<()> {
        let path = self.plan.run.commands_path();
        let mut text = String::new();
        if !path.exists() {
            text += &self.commands_header();
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

    fn run_stage_once(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()> {
        let (line, mut cmd) = self.prepare_stage(step, task, bin, args)?;
        let out = self.console.run(&mut cmd);
        self.stage_result(step, bin, &line, out)
    }

    /// A stage command made ready to run: its line in commands.sh and the log, its output
    /// directories; returns the line and the process.
    fn prepare_stage(
        &mut self,
        step: u64,
        task: &str,
        bin: &str,
        args: &[String],
    ) -> Result<(String, std::process::Command)> {
        let line = self.plan.stage_line(bin, args);
        self.append_command(step, &line)?;
        make_output_dirs(args)?;
        let (_, cmd) = self.stage_command(bin, args);
        let header = if task == bin {
            format!("[{}] {bin}: {line}", step_name(step))
        } else {
            format!("[{}] {task}: {line}", step_name(step))
        };
        self.console.detail(&header);
        Ok((line, cmd))
    }

    /// What a stage command that ran (`out`) means for the run.
    fn stage_result(
        &self,
        step: u64,
        bin: &str,
        line: &str,
        out: std::io::Result<Captured>,
    ) -> Result<()> {
        let out =
            out.with_context(|| format!("starting {}", self.plan.bins.join(bin).display()))?;
        if out.status.success() {
            return Ok(());
        }
        Err(self.stage_failed(step, bin, line, &out))
    }

    /// `[placement] mode = "one-step-off"`: step `step`'s update and step `step` + 1's rollout
    /// (or its dynamic sampling, `run_beside_sampling`) at once, each on its side's daemon
    /// group. Each part's own wall time is recorded: the update's in this step's `inside`, the
    /// rollout's in its `next` (the next step's `time/rollout`). A part that failed with its
    /// daemon gone runs again alone on a new one (`run_stage`); any other failure stops the run.
    fn run_overlap(&mut self, step: u64, pair: &[Task; 2]) -> Result<()> {
        if let Action::DynamicSampling { step: of } = pair[1].action {
            return self.run_beside_sampling(step, &pair[0], of);
        }
        let mut ready = Vec::new();
        for (s, task) in [(step, &pair[0]), (step + 1, &pair[1])] {
            let Action::Stage { bin, args } = &task.action else {
                anyhow::bail!("an overlap runs stage commands");
            };
            self.ensure_side(s, self.plan.side_of(bin))?;
            if s == step {
                let note = "# pipeline: the next two commands run at once (one-step-off)";
                self.append_command(step, note)?;
            }
            let (line, cmd) = self.prepare_stage(step, task.name, bin, args)?;
            ready.push((s, task.name, *bin, args, line, cmd));
        }
        let console = &self.console;
        let outs: Vec<(std::io::Result<Captured>, f64)> = std::thread::scope(|scope| {
            let running: Vec<_> = ready
                .iter_mut()
                .map(|(.., cmd)| scope.spawn(move || timed(|| console.run(cmd))))
                .collect();
            running
                .into_iter()
                .map(|h| h.join().expect("a stage's runner thread"))
                .collect()
        });
        for ((s, name, bin, args, line, _), (out, secs)) in ready.into_iter().zip(outs) {
            let timing = match s == step {
                true => (name, secs, false),
                false => ("rollout", secs, true),
            };
            self.overlap_part(s, (name, bin, args), &line, out, timing)?;
        }
        Ok(())
    }

    /// One-step-off with dynamic sampling: step `step`'s update on the training group while
    /// this thread samples step `of`'s groups (its passes' rollouts on the rollout group, their
    /// scoring here, `dynamic::run`), recorded in this step's progress (`next/round-R/...`).
    fn run_beside_sampling(&mut self, step: u64, update: &Task, of: u64) -> Result<()> {
        let Action::Stage { bin, args } = &update.action else {
            anyhow::bail!("an overlap runs stage commands");
        };
        self.ensure_side(step, Side::Train)?;
        let note = format!(
            "# pipeline: the next command runs beside {}'s dynamic sampling (its passes follow; one-step-off)",
            step_name(of)
        );
        self.append_command(step, &note)?;
        let (line, mut cmd) = self.prepare_stage(step, update.name, bin, args)?;
        // The update's output goes to the log through a console of its own (the runner's is
        // the sampling's meanwhile).
        let beside = self.console.beside()?;
        let target = dynamic::Target {
            step: of,
            within: step,
        };
        let ((out, secs), sampled) = std::thread::scope(|scope| {
            let running = scope.spawn(|| timed(|| beside.run(&mut cmd)));
            let sampled = dynamic::run(self, target);
            (running.join().expect("the update's runner thread"), sampled)
        });
        let timing = (update.name, secs, false);
        self.overlap_part(step, (update.name, bin, args), &line, out, timing)?;
        sampled
    }

    /// The end of one part of an overlap: its seconds recorded (`timing`: the name, and
    /// whether they are the next step's), or its failure; a part that failed with its daemon
    /// gone runs again alone on a new one.
    fn overlap_part(
        &mut self,
        s: u64,
        (name, bin, args): (&str, &str, &[String]),
        line: &str,
        out: std::io::Result<Captured>,
        (key, secs, next): (&str, f64, bool),
    ) -> Result<()> {
        let t0 = Instant::now();
        if let Err(e) = self.stage_result(s, bin, line, out) {
            let side = self.plan.side_of(bin);
            if !self.daemon_of(side).gone() {
                return Err(e);
            }
            self.console.say(&format!(
                "pipeline: {name} failed with the daemon gone: {e:#}"
            ));
            self.run_stage(s, name, bin, args)?;
        }
        let secs = secs + t0.elapsed().as_secs_f64();
        let p = self.state.progress(s - u64::from(next));
        let into = match next {
            true => &mut p.next,
            false => &mut p.inside,
        };
        into.insert(key.to_string(), secs);
        Ok(())
    }

    /// The daemon (group) of `side`.
    fn daemon_of(&mut self, side: Side) -> &mut Daemon {
        match side {
            Side::Train => &mut self.daemon,
            Side::Rollout => &mut self.rollout_daemon,
        }
    }

    /// Makes sure `side`'s daemon runs (see `Daemon::ensure`); a rollout group started anew
    /// after the first update gets the current policy from the training group first. Returns
    /// whether it was (re)started.
    fn ensure_side(&mut self, step: u64, side: Side) -> Result<bool> {
        let mut restarts = 0;
        self.ensure_counted(step, side, &mut restarts)
    }

    fn ensure_counted(&mut self, step: u64, side: Side, restarts: &mut u32) -> Result<bool> {
        let (plan, console) = (&self.plan, &mut self.console);
        let daemon = match side {
            Side::Train => &mut self.daemon,
            Side::Rollout => &mut self.rollout_daemon,
        };
        let started = daemon.ensure(plan, console, restarts)?;
        // The group starts from the initial model (policy_version 0).
        let policy = self.plan.run.policy();
        let behind =
            policy.exists() && crate::stage::common::resolve_model(&policy)?.policy_version > 0;
        if started && side == Side::Rollout && behind {
            self.ensure_side(step, Side::Train)?;
            let task = self.plan.transfer_task(step).expect("a placed run");
            if let Action::Stage { bin, args } = &task.action {
                self.console.say(&format!(
                    "pipeline: the rollout group (re)started; sending it the current policy ({})",
                    policy.display()
                ));
                self.run_stage_once(step, task.name, bin, args)?;
            }
        }
        Ok(started)
    }

    /// Runs `work` (a stage, or the agent's step, that the daemon computes) with the daemon up.
    fn on_daemon(
        &mut self,
        step: u64,
        task: &str,
        sides: &[Side],
        work: &mut dyn FnMut(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let mut restarts = 0;
        loop {
            for side in sides {
                self.ensure_counted(step, *side, &mut restarts)?;
            }
            match work(self) {
                Ok(()) => return Ok(()),
                // A stage that failed because the daemon died runs again on a new daemon
                // (which loads the current policy); any other failure stops the run.
                Err(e) if sides.iter().any(|s| self.daemon_of(*s).gone()) => {
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

    /// The process of a stage command (under `tandem launch` for a stage its ranks share), and
    /// the stage's program.
    fn stage_command(&self, bin: &str, args: &[String]) -> (PathBuf, std::process::Command) {
        let program = self.plan.bins.join(bin);
        let launch = self.plan.launch_prefix(bin);
        let mut cmd = match launch.split_first() {
            Some((tandem, rest)) => {
                let mut c = std::process::Command::new(tandem);
                c.args(rest).arg(&program);
                c
            }
            None => std::process::Command::new(&program),
        };
        if self.plan.spec.batch_invariant {
            cmd.env("TANDEM_BATCH_INVARIANT", "1");
        }
        cmd.args(args).stdin(Stdio::null());
        die_with_parent(&mut cmd);
        (program, cmd)
    }

    /// The error of a stage that failed: its output's tail, its command, and how to continue
    /// (an input error when the stage refused its input).
    fn stage_failed(&self, step: u64, bin: &str, line: &str, out: &Captured) -> anyhow::Error {
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
                self.plan.run.spec_changes_path().display()
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
            input_error(msg)
        } else {
            anyhow::anyhow!(msg)
        }
    }

    /// The training set as `preflight::check` read it (sampled from without reading it again).
    pub(crate) fn set_train_set(&mut self, batch: Batch) {
        self.train = Some(batch);
    }

    fn train_batch(&mut self) -> Result<&Batch> {
        if self.train.is_none() {
            let train = &self.plan.spec.data.train;
            let b = Batch::read(train, &[])?;
            if b.num_rows() == 0 {
                bail_input!("{}: the training set has no rows", train.display());
            }
            self.train = Some(b);
        }
        Ok(self.train.as_ref().expect("read above"))
    }

    fn sample_prompts(&mut self, step: u64) -> Result<()> {
        let out = self.plan.run.batch(step, "prompts");
        let count = self.plan.spec.data.prompts_per_step;
        self.state.sampler = self.draw_prompts(step, self.state.sampler, count, &out)?;
        Ok(())
    }
}

/// `f`'s result, and its wall time in seconds.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t0 = Instant::now();
    let out = f();
    (out, t0.elapsed().as_secs_f64())
}

/// Stages write their outputs where they are told; the runner makes the directories.
fn make_output_dirs(args: &[String]) -> Result<()> {
    for pair in args.windows(2) {
        if ["--out", "--out-model", "--metrics", "--kl-state", "--to"].contains(&pair[0].as_str()) {
            if let Some(dir) = Path::new(&pair[1])
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
            {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
        }
    }
    Ok(())
}

impl Rounds for Runner {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn state(&mut self) -> &mut State {
        &mut self.state
    }

    fn save_state(&mut self) -> Result<()> {
        self.plan.run.save_state(&self.state)
    }

    fn console(&mut self) -> &mut Console {
        &mut self.console
    }

    fn run_stage(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()> {
        let via_daemon =
            self.plan.spec.daemon && stage::def(bin).is_some_and(|d| d.takes("daemon"));
        // A placed run's transfer needs both groups up.
        let sides = match (via_daemon, task) {
            (true, _) => vec![self.plan.side_of(bin)],
            (false, "transfer") => vec![Side::Train, Side::Rollout],
            (false, _) => return self.run_stage_once(step, task, bin, args),
        };
        self.on_daemon(step, task, &sides, &mut |r| {
            r.run_stage_once(step, task, bin, args)
        })
    }

    fn draw_prompts(
        &mut self,
        step: u64,
        cursor: Cursor,
        count: u64,
        out: &Path,
    ) -> Result<Cursor> {
        let sampler = self.plan.sampler(self.state.train_rows);
        let batch = self.train_batch()?;
        draw_into(batch, &sampler, (cursor, count), step, out)
    }
}

impl Steps for Runner {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn state(&mut self) -> &mut State {
        &mut self.state
    }

    fn console(&mut self) -> &mut Console {
        &mut self.console
    }

    fn run_task(&mut self, step: u64, task: &Task) -> Result<()> {
        Runner::run_task(self, step, task)
    }

    fn run_command(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()> {
        Rounds::run_stage(self, step, task, bin, args)
    }

    fn ensure_sides(&mut self, step: u64) -> Result<()> {
        self.ensure_side(step, Side::Train)?;
        self.ensure_side(step, Side::Rollout)?;
        Ok(())
    }

    fn train_set(&mut self) -> Result<Batch> {
        let b = self.train_batch()?;
        Ok(Batch {
            path: b.path.clone(),
            data: b.data.clone(),
            meta: b.meta.clone(),
        })
    }

    fn set_rounds(&mut self, rounds: Option<std::sync::Arc<asynchronous::Shared>>) {
        self.rounds = rounds;
    }

    fn rollout_gone(&mut self) -> Option<String> {
        // A rank's death can reach the group's health a moment after the round failed (its
        // launcher then stops the other ranks).
        let t0 = Instant::now();
        while !self.rollout_daemon.gone() {
            if t0.elapsed() > std::time::Duration::from_secs(3) {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let note = self.rollout_daemon.death_note(&self.plan);
        Some(note.unwrap_or_else(|| "its daemon ended".into()))
    }

    fn restart_rollout(&mut self, step: u64, restarts: &mut u32) -> Result<()> {
        self.ensure_counted(step, Side::Rollout, restarts)?;
        Ok(())
    }
}
