//! A run's plan: the tasks of each step (stage command lines with their inputs and outputs, and
//! the runner's own small tasks) derived from the spec and the run's state as plain data.
//! Nothing here starts a process; `runner` executes what this plans.

use super::placement::Side;
use super::rundir::{step_name, RunDir, State};
use super::sampler::{derive_seed, Sampler};
use super::spec::{Device, OnCap, Source, Spec, Stages};
use crate::bail_input;
use crate::model::lora::LoraMode;
use crate::stage;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// What a task does.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Action {
    /// Run a stage binary with these arguments.
    Stage {
        bin: &'static str,
        args: Vec<String>,
    },
    /// Draw step `step`'s prompts into its `step-000K/prompts.parquet` (the task's own step,
    /// or in one-step-off mode the next one).
    SamplePrompts { step: u64 },
    /// The rollout done by the user's agent against the served policy (`[rollout] agent`,
    /// `super::agent`): `prompts` in, the trajectories collected into `rollout`.
    Agent {
        prompts: PathBuf,
        rollout: PathBuf,
        seed: u64,
    },
    /// DAPO's dynamic sampling (`[algorithm] filter-groups`): rounds of prompts, rollout and
    /// score until enough groups vary, kept into the step's rollout and scored files
    /// (`super::dynamic`): step `step`'s (the task's own, or in one-step-off mode the next).
    DynamicSampling { step: u64 },
    /// Copy the previous step's adaptive-KL state so that a rerun of `advantage` starts from
    /// the same coefficient.
    CopyKlState,
    /// Delete checkpoints that the cadence does not keep.
    PruneCheckpoints,
    /// Append the evaluation's line to eval.jsonl.
    EvalSummary,
    /// Append the step's line to metrics.jsonl.
    StepMetrics,
    /// `[placement] mode = "async"`: the step's groups taken from those the rollout group
    /// finished in its rounds (`super::asynchronous`), into the step's rollout file.
    TakeGroups,
    /// Two stage tasks at once, on two daemon groups (`[placement] mode = "one-step-off"`:
    /// this step's update and the next step's rollout); done when both are.
    Overlap(Box<[Task; 2]>),
}

/// One unit of recorded progress.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Task {
    /// The name recorded in state.json (unique within a step).
    pub(crate) name: &'static str,
    pub(crate) action: Action,
}

impl Task {
    /// The task, or the two an overlap runs at once.
    pub(crate) fn parts(&self) -> Vec<&Task> {
        match &self.action {
            Action::Overlap(pair) => pair.iter().collect(),
            _ => vec![self],
        }
    }
}

/// Where one sampling pass (prompts -> rollout -> score) reads and writes.
pub(crate) struct SampleFiles {
    pub(crate) prompts: PathBuf,
    pub(crate) rollout: PathBuf,
    pub(crate) scored: PathBuf,
    pub(crate) rollout_metrics: PathBuf,
    pub(crate) score_metrics: PathBuf,
}

/// Quote an argument for a POSIX shell when it needs it.
pub(crate) fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=,+@%".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

pub(super) fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

fn stage_cmd(bin: &'static str, args: Vec<String>) -> Action {
    Action::Stage { bin, args }
}

/// The files of round `round` of step `step` of dynamic sampling: `step-000K/round-R/`.
pub(super) fn round_files(run: &RunDir, step: u64, round: u64) -> SampleFiles {
    let dir = run.step_dir(step).join(format!("round-{round}"));
    SampleFiles {
        prompts: dir.join("prompts.parquet"),
        rollout: dir.join("rollout.parquet"),
        scored: dir.join("scored.parquet"),
        rollout_metrics: dir.join("metrics").join("rollout.json"),
        score_metrics: dir.join("metrics").join("score.json"),
    }
}

/// The rollout seed of a round. Round 1 uses the plain step's seed, so a step whose first
/// round keeps enough groups samples exactly what a step without filtering would.
pub(super) fn round_seed(seed: u64, step: u64, round: u64) -> u64 {
    match round {
        1 => derive_seed(seed, &[step, 1]),
        r => derive_seed(seed, &[step, 1, r]),
    }
}

/// What a run's tasks derive from: the spec, its stages' flags, the run directory and where
/// the stage binaries are.
#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) spec: Spec,
    /// The stages' flags from the spec, parsed by the stages.
    pub(crate) stages: Stages,
    pub(crate) run: RunDir,
    pub(crate) bins: PathBuf,
}

impl Plan {
    /// The plan of `spec` (the stage tables are parsed again here: `--steps` may have changed
    /// what the runner derives from them).
    pub(crate) fn new(spec: Spec, run: RunDir, bins: PathBuf) -> Result<Plan> {
        let stages = spec.stages(&Source {
            origin: "the spec",
            text: None,
        })?;
        Ok(Plan {
            spec,
            stages,
            run,
            bins,
        })
    }

    /// Whether the step needs reference log-probs: a KL term in the reward or the loss, or a
    /// separate reference model.
    pub(crate) fn needs_ref(&self) -> bool {
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
    pub(crate) fn needs_old(&self) -> bool {
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
        // A merged rollout samples from bf16(W + (α/r)·B·A), which the trainer (base + adapters
        // unmerged) does not compute: its log-probs are not the trainer's (docs/LORA.md).
        let lora = self.stages.update.args.lora.lora_rank > 0;
        if lora && self.stages.rollout.args.lora_mode != LoraMode::Unmerged {
            bail_input!(
                "[update] bypass-mode = true takes the rollout's log-probs as the old ones, which with lora-rank holds only when the rollout applies the adapters as the trainer does: set [rollout] lora-mode = \"unmerged\" (merged weights are rounded to bf16), or drop bypass-mode"
            );
        }
        if self.stages.advantage.args.kl_in_reward {
            bail_input!(
                "[update] bypass-mode = true skips the old-logprob pass, which [advantage] kl-in-reward needs; drop one of them"
            );
        }
        Ok(())
    }

    /// Checks every stage command of step `step` (with step 0's and an evaluation's) with the
    /// stage's own parser and flag checks, before anything runs: a value the stage would refuse
    /// stops the run here, not at its stage.
    pub(crate) fn check_commands(&self, step: u64) -> Result<()> {
        self.check_bypass()?;
        let tasks = self
            .init_tasks()
            .into_iter()
            .map(|t| (0, t))
            .chain(self.step_tasks(step).into_iter().map(|t| (step, t)))
            // One-step-off's step samples in the step before: its rollout is checked here too.
            .chain(self.sampling_tasks(step).into_iter().map(|t| (step, t)))
            .chain(self.first_round_tasks(step).into_iter().map(|t| (step, t)))
            .chain(
                (self.spec.eval.every > 0)
                    .then(|| self.eval_tasks(step))
                    .into_iter()
                    .flatten()
                    .map(|t| (step, t)),
            );
        let tasks: Vec<(u64, Task)> = tasks.collect();
        let parts = tasks
            .iter()
            .flat_map(|(s, t)| t.parts().into_iter().map(move |t| (*s, t)));
        for (step, task) in parts {
            let Action::Stage { bin, args } = &task.action else {
                continue;
            };
            // `tandem daemon-ctl transfer` is no stage: the runner's own command line.
            let Some(def) = stage::def(bin) else {
                continue;
            };
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

    /// The prompt sampler over the training set of `train_rows` rows.
    pub(crate) fn sampler(&self, train_rows: u64) -> Sampler {
        Sampler {
            seed: self.spec.seed,
            len: train_rows,
            shuffle: self.spec.data.shuffle,
        }
    }

    /// The socket of the run's daemon.
    pub(crate) fn daemon_socket(&self) -> PathBuf {
        self.run.root.join("daemon.sock")
    }

    /// `--daemon SOCKET` for the model stages when the spec asks for the warm daemon.
    pub(super) fn daemon_args(&self) -> Vec<String> {
        self.daemon_args_of(Side::Train)
    }

    /// `--daemon SOCKET` of `side`'s daemon (group) when the spec asks for daemons.
    fn daemon_args_of(&self, side: Side) -> Vec<String> {
        if self.spec.daemon {
            vec!["--daemon".into(), path_arg(&self.socket_of(side))]
        } else {
            Vec::new()
        }
    }

    /// Every rank's socket of `side`'s daemon: its socket, and in a group the other ranks'.
    pub(super) fn daemon_sockets(&self, side: Side) -> Vec<PathBuf> {
        (0..self.ranks_of(side).max(1) as usize)
            .map(|r| crate::daemon::rank_socket(&self.socket_of(side), r))
            .collect()
    }

    /// `tandem launch --nproc-per-node N --` before `tandem daemon` when `side` has N > 1
    /// ranks: one daemon per GPU, a daemon group that serves the stages together.
    pub(super) fn daemon_launch_prefix(&self, side: Side) -> Vec<String> {
        let n = self.ranks_of(side);
        if n <= 1 {
            return Vec::new();
        }
        vec![
            "launch".into(),
            "--nproc-per-node".into(),
            n.to_string(),
            "--".into(),
            path_arg(&self.bins.join("tandem")),
        ]
    }

    /// `--device` for the model stages when not on the CPU (the stages' default), and
    /// `--daemon` with the warm daemon.
    fn device_args(&self) -> Vec<String> {
        self.device_args_of(Side::Train)
    }

    /// [`Plan::device_args`] with the daemon of `side`.
    pub(super) fn device_args_of(&self, side: Side) -> Vec<String> {
        let mut a = match self.spec.device {
            Device::Cpu => Vec::new(),
            d => vec!["--device".into(), d.as_str().into()],
        };
        a.extend(self.daemon_args_of(side));
        a
    }

    /// The tasks of step 0: publish the initial model as the policy, then evaluate it.
    pub(crate) fn init_tasks(&self) -> Vec<Task> {
        let mut t = vec![self.sync_task(&self.spec.model.path, 0)];
        if self.spec.eval.every > 0 && self.spec.eval.at_start {
            t.extend(self.eval_tasks(0));
        }
        t
    }

    /// `sync-weights` publishing `from` as the policy of version `version` (explicit, so that
    /// a sync rerun after an interruption sets the same version).
    fn sync_task(&self, from: &Path, version: u64) -> Task {
        let args = vec![
            "--from".into(),
            path_arg(from),
            "--to".into(),
            path_arg(&self.run.policy()),
            "--policy-version".into(),
            version.to_string(),
        ];
        Task {
            name: "sync",
            action: stage_cmd(
                "sync-weights",
                args.into_iter()
                    .chain(self.stages.sync_weights.argv.iter().cloned())
                    .chain(self.daemon_args())
                    .collect(),
            ),
        }
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
        rollout.extend(self.device_args_of(self.side_of("rollout")));
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
                action: stage_cmd("rollout", rollout),
            },
            Task {
                name: "eval-score",
                action: stage_cmd("score", score),
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

    /// The tasks of training step `step` (1-based): sampling, the log-prob passes, advantage,
    /// update, sync, then the chores (prune, an evaluation, the metrics line).
    pub(crate) fn step_tasks(&self, step: u64) -> Vec<Task> {
        // In one-step-off mode the step before drew the prompts and ran the rollout (or the
        // dynamic sampling).
        let own = match self.samples_own(step) {
            true => 0,
            false => self.own_sampling(step).len(),
        };
        let mut tasks: Vec<Task> = self.sampling_tasks(step).into_iter().skip(own).collect();
        let mut last = self.logprob_tasks(step, &mut tasks);
        if self.spec.critic.is_some() {
            tasks.push(self.values_task(step, last));
            last = "values";
        }
        self.advantage_tasks(step, last, &mut tasks);
        tasks.extend(self.critic_task(step));
        let trains = self.trains_policy(step);
        self.update_tasks(step, trains.then(|| self.update_task(step)), &mut tasks);
        if trains {
            tasks.push(self.sync_task(&self.run.ckpt(step), step));
            tasks.extend(self.transfer_task(step));
        }
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

    /// The step's scored samples: prompts, rollout and score, or dynamic sampling's rounds.
    pub(super) fn sampling_tasks(&self, step: u64) -> Vec<Task> {
        if self.asynchronous() {
            return self.take_tasks(step);
        }
        if self.spec.filter_groups().is_some() {
            return vec![Task {
                name: "sample",
                action: Action::DynamicSampling { step },
            }];
        }
        let files = self.step_files(step);
        let mut tasks = vec![Task {
            name: "prompts",
            action: Action::SamplePrompts { step },
        }];
        tasks.extend(self.sample_tasks(step, &files, derive_seed(self.spec.seed, &[step, 1])));
        tasks
    }

    /// A plain step's sampling files.
    pub(super) fn step_files(&self, step: u64) -> SampleFiles {
        let run = &self.run;
        SampleFiles {
            prompts: run.batch(step, "prompts"),
            rollout: run.batch(step, "rollout"),
            scored: run.batch(step, "scored"),
            rollout_metrics: run.stage_metrics(step, "rollout"),
            score_metrics: run.stage_metrics(step, "score"),
        }
    }

    /// The reference and old log-prob passes the step needs, each reading the batch before
    /// it; returns the name of the step's last batch (`scored`, `ref` or `old`).
    fn logprob_tasks(&self, step: u64, tasks: &mut Vec<Task>) -> &'static str {
        let mut last = "scored";
        if self.needs_ref() {
            let model = path_arg(self.spec.reference_model());
            tasks.push(self.logprob_task(step, "ref", model, last));
            last = "ref";
        }
        if self.needs_old() {
            let model = path_arg(&self.run.policy());
            tasks.push(self.logprob_task(step, "old", model, last));
            last = "old";
        }
        last
    }

    /// `ref-logprob` of `model` over batch `from` into batch `name` (column `NAME_logprobs`).
    fn logprob_task(&self, step: u64, name: &'static str, model: String, from: &str) -> Task {
        let b = |name: &str| path_arg(&self.run.batch(step, name));
        let mut args = vec![
            "--model".into(),
            model,
            "--in".into(),
            b(from),
            "--out".into(),
            b(name),
            "--column".into(),
            format!("{name}_logprobs"),
        ];
        // Log-probs are taken at the sampling temperature (the spec's stage flags carry it).
        args.extend(self.stages.ref_logprob.argv.iter().cloned());
        args.extend(self.device_args());
        Task {
            name,
            action: stage_cmd("ref-logprob", args),
        }
    }

    /// `advantage` over batch `last`, after copying the adaptive-KL state when there is one.
    fn advantage_tasks(&self, step: u64, last: &str, tasks: &mut Vec<Task>) {
        let run = &self.run;
        let mut adv = vec![
            "--in".into(),
            path_arg(&run.batch(step, last)),
            "--out".into(),
            path_arg(&run.batch(step, "adv")),
        ];
        adv.extend(self.stages.advantage.argv.iter().cloned());
        if self.stages.adaptive_kl() {
            tasks.push(Task {
                name: "kl-state",
                action: Action::CopyKlState,
            });
            adv.extend(["--kl-state".into(), path_arg(&self.kl_state(step))]);
        }
        adv.extend([
            "--metrics".into(),
            path_arg(&run.stage_metrics(step, "advantage")),
        ]);
        tasks.push(Task {
            name: "advantage",
            action: stage_cmd("advantage", adv),
        });
    }

    /// The `--seed` of step `step`'s update (it draws a LoRA run's fresh adapters).
    pub(crate) fn update_seed(&self, step: u64) -> u64 {
        derive_seed(self.spec.seed, &[step, 3])
    }

    fn update_task(&self, step: u64) -> Task {
        let run = &self.run;
        let mut update = vec![
            "--model".into(),
            path_arg(&run.policy()),
            "--in".into(),
            path_arg(&run.batch(step, "adv")),
            "--out-model".into(),
            path_arg(&run.ckpt(step)),
        ];
        // With the sampling temperature and a cosine schedule's horizon (see `Stages`).
        update.extend(self.stages.update.argv.iter().cloned());
        update.extend([
            "--seed".into(),
            self.update_seed(step).to_string(),
            "--metrics".into(),
            path_arg(&run.stage_metrics(step, "update")),
        ]);
        if !self.writes_checkpoint(step) {
            update.push("--resident".into());
        }
        update.extend(self.device_args());
        Task {
            name: "update",
            action: stage_cmd("update", update),
        }
    }

    /// Whether step `step` updates the policy: not in the critic's warm-up (`[critic]
    /// critic-warmup` steps that train the critic only).
    pub(crate) fn trains_policy(&self, step: u64) -> bool {
        self.spec
            .critic
            .as_ref()
            .is_none_or(|c| step > c.critic_warmup)
    }

    /// The policy after step `step`: its checkpoint, or the initial model at step 0 and in the
    /// critic's warm-up (no update of the policy yet).
    pub(crate) fn policy_after(&self, step: u64) -> PathBuf {
        match step > 0 && self.trains_policy(step) {
            true => self.run.ckpt(step),
            false => self.spec.model.path.clone(),
        }
    }

    /// The critic step `step` starts from: the previous step's, or the initial one.
    pub(crate) fn critic_in(&self, step: u64) -> PathBuf {
        match step {
            0 | 1 => self
                .spec
                .critic_model()
                .expect("a spec with a critic")
                .to_path_buf(),
            s => self.run.critic_ckpt(s - 1),
        }
    }

    /// `values` with the step's critic over batch `from` into batch `values`.
    fn values_task(&self, step: u64, from: &str) -> Task {
        let b = |name: &str| path_arg(&self.run.batch(step, name));
        let mut args = vec![
            "--model".into(),
            path_arg(&self.critic_in(step)),
            "--in".into(),
            b(from),
            "--out".into(),
            b("values"),
        ];
        args.extend(self.stages.values.argv.iter().cloned());
        args.extend(self.device_args());
        Task {
            name: "values",
            action: stage_cmd("values", args),
        }
    }

    /// `update --critic` on the advantage batch (its `values` and `returns`), from the step's
    /// critic into `critic/step-000K` (kept in the daemon's memory, as the policy's update,
    /// between checkpoints); none without a `[critic]`.
    fn critic_task(&self, step: u64) -> Option<Task> {
        let flags = self.stages.critic.as_ref()?;
        let run = &self.run;
        let mut args = vec![
            "--model".into(),
            path_arg(&self.critic_in(step)),
            "--in".into(),
            path_arg(&run.batch(step, "adv")),
            "--out-model".into(),
            path_arg(&run.critic_ckpt(step)),
        ];
        args.extend(flags.argv.iter().cloned());
        args.extend([
            "--seed".into(),
            derive_seed(self.spec.seed, &[step, 4]).to_string(),
            "--metrics".into(),
            path_arg(&run.stage_metrics(step, "critic")),
        ]);
        if !self.writes_checkpoint(step) {
            args.push("--resident".into());
        }
        args.extend(self.device_args());
        Some(Task {
            name: "critic",
            action: stage_cmd("update", args),
        })
    }

    /// The rollout and score of one sampling pass: `files.prompts` to `files.scored`, the
    /// rollout seeded with `seed`.
    pub(crate) fn sample_tasks(&self, step: u64, files: &SampleFiles, seed: u64) -> [Task; 2] {
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
        rollout.extend(self.device_args_of(self.side_of("rollout")));
        let mut score = vec![
            "--in".into(),
            path_arg(&files.rollout),
            "--out".into(),
            path_arg(&files.scored),
        ];
        score.extend(self.stages.score.argv.iter().cloned());
        score.extend(["--metrics".into(), path_arg(&files.score_metrics)]);
        let rollout = match self.spec.rollout.contains_key("agent") {
            true => Action::Agent {
                prompts: files.prompts.clone(),
                rollout: files.rollout.clone(),
                seed,
            },
            false => stage_cmd("rollout", rollout),
        };
        [
            Task {
                name: "rollout",
                action: rollout,
            },
            Task {
                name: "score",
                action: stage_cmd("score", score),
            },
        ]
    }

    /// The stage commands of dynamic sampling's round 1, for the checks before a run starts
    /// and the dry run (nothing without filter-groups: the plain step's own commands are
    /// checked then).
    pub(super) fn first_round_tasks(&self, step: u64) -> Vec<Task> {
        if self.asynchronous() {
            return vec![self.first_async_round()];
        }
        if self.spec.filter_groups().is_none() {
            return Vec::new();
        }
        let files = round_files(&self.run, step, 1);
        self.sample_tasks(step, &files, round_seed(self.spec.seed, step, 1))
            .into()
    }

    /// Whether step `step`'s update writes its checkpoint as files (weights and optimizer
    /// state). Stages run as processes need them every step (the next `update` reads them);
    /// the daemon keeps the policy in memory (`update --resident`: no weight write, no read
    /// back) and writes it on the checkpoint cadence and at the last step, as verl's save_freq
    /// does (the optimizer state alone is ~12 bytes per parameter: 6 GB at 0.5B). A dead
    /// daemon is restarted from the newest checkpoint written as files (the runner's rewind).
    /// A daemon group (`gpus > 1`) does the same, each rank keeping its shards of the state
    /// (under `[update] shard = "full"` its shards of the compute weights too).
    pub(crate) fn writes_checkpoint(&self, step: u64) -> bool {
        let every = self.spec.checkpoint.every;
        !self.spec.daemon || step == self.spec.steps || (every > 0 && step.is_multiple_of(every))
    }

    /// The adaptive-KL controller's state of step `step`.
    pub(crate) fn kl_state(&self, step: u64) -> PathBuf {
        self.run.step_dir(step).join("kl-state.json")
    }

    /// A task as the shell line a user could type (stage commands) or a comment saying what
    /// the runner does itself.
    pub(crate) fn describe(&self, step: u64, task: &Task) -> String {
        match &task.action {
            Action::Stage { bin, args } => self.stage_line(bin, args),
            Action::SamplePrompts { step } => format!(
                "# pipeline: sample {} prompts of {} into {}",
                self.spec.data.prompts_per_step,
                self.spec.data.train.display(),
                self.run.batch(*step, "prompts").display()
            ),
            Action::Agent {
                prompts, rollout, ..
            } => super::agent_spec::describe(
                &self.spec.rollout,
                &self.run.policy(),
                self.spec.daemon.then(|| self.daemon_socket()).as_deref(),
                prompts,
                self.stages.rollout.args.n,
                rollout,
            ),
            Action::DynamicSampling { step } => self.describe_rounds(*step),
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
            Action::TakeGroups => self.describe_take(step),
            Action::Overlap(pair) => format!(
                "{} &\n{}\nwait",
                self.describe(step, &pair[0]),
                self.describe(step + 1, &pair[1])
            ),
        }
    }

    /// The dry-run text of dynamic sampling: what it does, and round 1's stage commands.
    fn describe_rounds(&self, step: u64) -> String {
        let fg = self
            .spec
            .filter_groups()
            .expect("a step samples dynamically");
        let cap = match fg.max_rounds {
            0 => "no cap on rounds".to_string(),
            n => format!(
                "at most {n} rounds, then {}",
                match fg.on_cap {
                    OnCap::Train => "train on the groups kept",
                    OnCap::Fail => "fail",
                }
            ),
        };
        let mut text = format!(
            "# pipeline: dynamic sampling: rounds of {} prompts of {} into {}/round-R/ until {} groups have a varying {} ({cap}); the kept groups go to {} and {}. Round 1:",
            fg.prompts_per_round,
            self.spec.data.train.display(),
            self.run.step_dir(step).display(),
            self.spec.data.prompts_per_step,
            fg.metric.name(),
            self.run.batch(step, "rollout").display(),
            self.run.batch(step, "scored").display(),
        );
        for task in self.first_round_tasks(step) {
            if let Action::Stage { bin, args } = &task.action {
                text.push('\n');
                text.push_str(&self.stage_line(bin, args));
            }
        }
        text
    }

    /// A stage command as a shell line.
    pub(crate) fn stage_line(&self, bin: &str, args: &[String]) -> String {
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
    pub(super) fn launch_prefix(&self, bin: &str) -> Vec<String> {
        let model_stage = matches!(bin, "rollout" | "ref-logprob" | "values" | "update");
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

    /// Every remaining task of the run after `state`, in order, with its step: step 0's until
    /// it is done, then every step up to the spec's last, less the tasks the state records as
    /// finished in the step in progress.
    pub(super) fn remaining(&self, state: &State) -> Vec<(u64, Task)> {
        let init = (!state.init_done).then(|| (0, self.init_tasks()));
        let steps = (state.steps_done + 1..=self.spec.steps).map(|s| {
            let mut tasks = self.step_tasks(s);
            self.catch_up(state, s, &mut tasks);
            (s, tasks)
        });
        init.into_iter()
            .chain(steps)
            .flat_map(|(step, tasks)| tasks.into_iter().map(move |t| (step, t)))
            .filter(|(step, t)| !state.is_done(*step, t.name))
            .collect()
    }

    /// Whether `task` of step `step` is the last of its step (its end is recorded then).
    pub(super) fn ends_step(&self, step: u64, task: &Task) -> bool {
        matches!(task.action, Action::StepMetrics)
            || (step == 0 && self.init_tasks().last().map(|t| t.name) == Some(task.name))
    }

    /// The binaries the tasks run (`tandem` too for the daemon).
    pub(super) fn bins_needed<'a>(&self, tasks: &'a [(u64, Task)]) -> Vec<&'a str> {
        // The daemon, and the server of an agent step, are `tandem`'s.
        let daemon =
            (self.spec.daemon || self.spec.rollout.contains_key("agent")).then_some("tandem");
        tasks
            .iter()
            .flat_map(|(_, t)| t.parts())
            .filter_map(|t| match &t.action {
                Action::Stage { bin, .. } => Some(*bin),
                _ => None,
            })
            .chain(daemon)
            .collect()
    }
}

pub(crate) mod placed;
#[cfg(test)]
mod tests;
