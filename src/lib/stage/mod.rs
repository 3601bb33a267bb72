//! The stages, one module per binary: `rollout`, `score`, `ref_logprob`, `values` (a critic's
//! values), `advantage`, `update` (the policy's, or with `--critic` the critic's), `sync_weights`,
//! and `sft_batch` (`tandem sft-batch`); `save` is the daemon's `daemon-ctl
//! save` job and `generate` its job of `tandem serve --daemon`; `common` holds what they share.
//!
//! Each stage declares its flags once, as a clap `Args` struct with their help: the binary's
//! command line, the pipeline spec's `[stage]` table (`crate::pipeline::spec` looks every key up
//! in the stage's command and parses it with the stage's own parser) and the daemon's job all
//! come from it. [`STAGES`] lists the stage binaries the pipeline runs, with the flags the runner
//! sets itself.
//!
//! The model stages (rollout, ref-logprob, update, sync-weights) read and check their input, run
//! their compute on an [`Exec`], and write their output. [`InProcess`] loads the model on
//! `--device` for the one call; the warm daemon is the other `Exec`, on the models it keeps.
//! The daemon imports the stages, never the reverse: `crate::daemon::run_stage` is the one place
//! that decides where a [`StageJob`] runs.
//!
//! Several ranks (`tandem launch`, torchrun, srun, or the daemons of `gpus = N`) run a stage
//! together: every rank reads and checks the same input, `rollout` and `ref-logprob` each
//! compute their block of the prompts ([`Topology::ranks`]), rank 0 gathers the rows and writes the
//! one output file, the same rows in the same order as one rank writes; `update` trains on
//! each rank's share of the rows with the sharded optimizer and rank 0 writes the model.
//! `sync-weights` runs on rank 0 alone ([`StageJob::splits_over_ranks`]).

pub mod advantage;
pub mod common;
pub mod generate;
pub(crate) mod lengths;
pub mod ref_logprob;
pub mod rollout;
mod rollout_round;
pub mod save;
pub mod score;
pub mod sft_batch;
pub mod sync_weights;
pub mod transfer;
pub(crate) mod turns;
pub mod update;
pub mod values;

use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::bail_input;
pub use crate::engine::policy::{load_policy, load_value_model};
use crate::engine::policy::{
    train_ranks_from_files, HeldPolicy, Holder, SavedShards, Sharding, Train, Trainable, Trained,
};
use crate::engine::resume::TrainerState;
use crate::error::input_error;
use crate::model::checkpoint::ModelDir;
use crate::parallel::Exchange;
use anyhow::Result;
use clap::{ArgMatches, Command, FromArgMatches};
use common::{Device, ModelRef};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A stage's compute, written once for any backend.
pub trait Job {
    type Out;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Out>;
}

/// Runs `job` on the CPU backend or on GPU N (no driver or GPU there: an input error that
/// says to use `--device cpu`).
pub fn on_device<J: Job>(device: Device, job: J) -> Result<J::Out> {
    match device {
        Device::Cpu => job.run(Cpu),
        Device::Cuda(n) => job.run(crate::backend::ops::open_cuda(n)?),
    }
}

/// Where a model stage's compute runs: [`InProcess`] on `--device` (the model is loaded for this
/// one call), or inside the warm daemon on the models it keeps between calls
/// (`crate::daemon`). Reading, checking and writing the batch files is the stage's own code
/// either way, so both give the same files.
///
/// An `Exec` is its four roles: [`Compute`] (the models' work), [`Hold`] (the policy kept
/// between calls), [`Console`] (the user's lines and bars) and [`Topology`] (the ranks). A
/// stage that needs only some of them asks for those (`sync-weights`: [`Hold`] and
/// [`Console`]); every type with all four is an `Exec`.
pub trait Exec: Compute + Hold + Console + Topology {}

impl<T: Compute + Hold + Console + Topology + ?Sized> Exec for T {}

/// The models' work: generation, scoring, training.
pub trait Compute: Topology {
    /// Every sample of a rollout, with the policy `model`.
    fn generate(
        &mut self,
        model: &ModelRef,
        job: rollout::Generate<'_>,
    ) -> Result<rollout::Generated>;
    /// Log-probs of the rows under `model` (the reference, or the policy for old_logprobs), or
    /// a critic's values.
    fn score(
        &mut self,
        model: &ModelRef,
        job: ref_logprob::Score<'_>,
    ) -> Result<Vec<crate::model::decoder::TokenStats>>;
    /// One `update` call on the policy `model`, resuming the optimizer state next to it.
    fn train(&mut self, model: &ModelRef, job: Train<'_>) -> Result<Trained>;
    /// One rank's part of a data-parallel `update` among [`Topology::ranks`] (the sharded
    /// optimizer); rank 0's result carries what the job brings back. Here the policy is loaded
    /// from the model files for this call; a daemon group's rank trains the one it keeps.
    fn train_sharded(
        &mut self,
        model: &ModelRef,
        job: Train<'_>,
        sharding: Sharding,
    ) -> Result<Trained> {
        let pg = self
            .ranks()
            .expect("a data-parallel update runs among ranks")
            .group()
            .clone();
        train_ranks_from_files(&pg, model, job, sharding)
    }
}

/// The policy kept between calls (by the daemon; nothing in-process): who holds it, what was
/// written of it, and the policy itself for `daemon-ctl save`.
pub trait Hold {
    /// `update` (with its trainer state) or `daemon-ctl save` wrote the policy it holds to
    /// `dir` (as files, or as a resident directory).
    fn saved(&mut self, dir: &Path, trainer: Option<&TrainerState>) -> Result<()>;
    /// Who keeps the weights of `update --resident` (None: nobody here, in-process).
    fn holder(&self) -> Option<Holder>;
    /// The policy held (the one `model` names, when given), for `daemon-ctl save`.
    fn held_policy(&mut self, model: Option<&ModelRef>) -> Result<HeldPolicy>;
    /// `daemon-ctl save` on a rank of a daemon group whose policy keeps its optimizer state in
    /// shards over the ranks: writes this rank's shard into `staging` (and on rank 0 gathers
    /// the masters). None when the policy held is not sharded. Every rank calls it.
    fn save_sharded(
        &mut self,
        _model: Option<&ModelRef>,
        _staging: &Path,
    ) -> Result<Option<SavedShards>> {
        Ok(None)
    }
    /// `sync-weights` made the checkpoint `dir` the policy, as `policy_version`.
    fn publish(&mut self, dir: &Path, policy_version: u64) -> Result<()>;
    /// This rank's part of a weight transfer between two daemon groups (`[placement]`): on
    /// bridge rank 0 sends the policy `model` it holds, on the others receives it as the
    /// policy they generate with.
    fn transfer(
        &mut self,
        _model: &ModelRef,
        _bridge: &transfer::Bridge,
    ) -> Result<transfer::Transferred> {
        bail_input!(
            "the weight transfer runs between daemon groups (`tandem daemon-ctl transfer`, a [placement] run's)"
        )
    }
}

/// What the user sees of a stage while it runs.
pub trait Console {
    /// A progress bar of `len` steps.
    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar;
    /// A message line for the user (stderr of the stage).
    fn log(&mut self, line: &str);
}

/// The ranks that run a stage together.
pub trait Topology {
    /// The ranks that run this stage together, when there are several (None: this process
    /// alone, which then computes everything and writes the files).
    fn ranks(&self) -> Option<&Exchange> {
        None
    }
}

/// The stage computes here: loads the model onto `device`, computes, drops it. Among several
/// ranks (`ranks`), on this rank's share.
pub struct InProcess {
    pub device: Device,
    pub ranks: Option<Exchange>,
}

impl InProcess {
    /// This process alone on `device`.
    pub fn new(device: Device) -> InProcess {
        InProcess {
            device,
            ranks: None,
        }
    }
}

impl Compute for InProcess {
    fn generate(
        &mut self,
        _model: &ModelRef,
        job: rollout::Generate<'_>,
    ) -> Result<rollout::Generated> {
        on_device(self.device, job)
    }

    fn score(
        &mut self,
        _model: &ModelRef,
        job: ref_logprob::Score<'_>,
    ) -> Result<Vec<crate::model::decoder::TokenStats>> {
        on_device(self.device, job)
    }

    fn train(&mut self, model: &ModelRef, job: Train<'_>) -> Result<Trained> {
        let started = std::time::Instant::now();
        let loaded = Trainable::for_update(&model.dir, job.train, None, &mut |m| self.log(m))?;
        let load_seconds = started.elapsed().as_secs_f64();
        let lora_base = loaded.lora.as_ref().map(|l| l.base.clone());
        let mut out = on_device(self.device, update::TrainFresh { loaded, job })?;
        out.load_seconds = load_seconds;
        out.lora_base = lora_base;
        Ok(out)
    }
}

impl Hold for InProcess {
    fn saved(&mut self, _dir: &Path, _trainer: Option<&TrainerState>) -> Result<()> {
        Ok(())
    }

    fn holder(&self) -> Option<Holder> {
        None
    }

    fn held_policy(&mut self, _model: Option<&ModelRef>) -> Result<HeldPolicy> {
        bail_input!(
            "saving the policy a daemon holds needs the daemon: `tandem daemon-ctl save --socket SOCKET --out DIR`"
        )
    }

    fn publish(&mut self, dir: &Path, _policy_version: u64) -> Result<()> {
        // Only the daemon that holds a resident directory's weights can publish it.
        if let Some(marker) = ModelDir::resident(dir)? {
            bail_input!("--from {}", marker.refusal(dir));
        }
        Ok(())
    }
}

impl Console for InProcess {
    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar {
        common::progress_bar(len, what)
    }

    fn log(&mut self, line: &str) {
        eprintln!("{line}");
    }
}

impl Topology for InProcess {
    fn ranks(&self) -> Option<&Exchange> {
        self.ranks.as_ref()
    }
}

/// A model stage with the flags its command line parsed: what its binary runs, here or sent as
/// a job to the warm daemon (the wire format of `crate::daemon::protocol` carries it as is).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "stage", content = "args", rename_all = "kebab-case")]
pub enum StageJob {
    Rollout(rollout::RolloutArgs),
    RefLogprob(ref_logprob::RefLogprobArgs),
    Values(values::ValuesArgs),
    Update(update::UpdateArgs),
    SyncWeights(sync_weights::SyncWeightsArgs),
    /// `tandem daemon-ctl save`: not a stage binary, a job only a daemon runs.
    SavePolicy(save::SavePolicyArgs),
    /// A generation batch of `tandem serve --daemon`: also a job only a daemon runs.
    Generate(generate::GenerateArgs),
    /// One group's part of `tandem daemon-ctl transfer` (`[placement]`): a daemon job too.
    Transfer(transfer::TransferArgs),
}

impl StageJob {
    pub fn name(&self) -> &'static str {
        match self {
            StageJob::Rollout(_) => "rollout",
            StageJob::RefLogprob(_) => "ref-logprob",
            StageJob::Values(_) => "values",
            StageJob::Update(_) => "update",
            StageJob::SyncWeights(_) => "sync-weights",
            StageJob::SavePolicy(_) => "save",
            StageJob::Generate(_) => "generate",
            StageJob::Transfer(_) => "transfer",
        }
    }

    /// Whether the stage shares its work among several ranks ([`Topology::ranks`]): rollout and
    /// ref-logprob (old-logprob is ref-logprob on the policy) by prompts, update by rows with
    /// the sharded optimizer, `daemon-ctl save` by optimizer shards (a daemon group's), a
    /// served batch (`generate`) by requests, the weight transfer by bridge ranks.
    /// `sync-weights` runs on rank 0 alone.
    pub(crate) fn splits_over_ranks(&self) -> bool {
        StageJob::stage_splits_over_ranks(self.name())
    }

    /// [`StageJob::splits_over_ranks`] by the stage's name: the one list of the stages the
    /// ranks (of a launch or of a daemon group) share; the others run on rank 0 alone.
    pub(crate) fn stage_splits_over_ranks(name: &str) -> bool {
        matches!(
            name,
            "rollout" | "ref-logprob" | "values" | "update" | "save" | "generate" | "transfer"
        )
    }

    /// The `--metrics` file the stage writes, if any.
    pub(crate) fn metrics_path(&self) -> Option<&PathBuf> {
        match self {
            StageJob::Rollout(a) => a.metrics.as_ref(),
            StageJob::Update(a) => a.metrics.as_ref(),
            StageJob::RefLogprob(_)
            | StageJob::Values(_)
            | StageJob::SyncWeights(_)
            | StageJob::SavePolicy(_)
            | StageJob::Generate(_)
            | StageJob::Transfer(_) => None,
        }
    }

    /// `--daemon`: the socket of the warm daemon to send the job to.
    pub fn daemon(&self) -> Option<&Path> {
        match self {
            StageJob::Rollout(a) => a.daemon.as_deref(),
            StageJob::RefLogprob(a) => a.daemon.as_deref(),
            StageJob::Update(a) => a.daemon.as_deref(),
            StageJob::SyncWeights(a) => a.daemon.as_deref(),
            StageJob::Values(a) => a.daemon.as_deref(),
            StageJob::SavePolicy(_) | StageJob::Generate(_) | StageJob::Transfer(_) => None,
        }
    }

    /// `--device`; None for sync-weights, save and transfer, which compute nothing.
    pub fn device(&self) -> Option<Device> {
        match self {
            StageJob::Rollout(a) => Some(a.device),
            StageJob::RefLogprob(a) => Some(a.device),
            StageJob::Values(a) => Some(a.device),
            StageJob::Update(a) => Some(a.device),
            StageJob::Generate(a) => Some(a.device),
            StageJob::SyncWeights(_) | StageJob::SavePolicy(_) | StageJob::Transfer(_) => None,
        }
    }

    /// Runs the stage with its compute on `exec`.
    pub fn run(self, exec: &mut dyn Exec) -> Result<()> {
        match self {
            StageJob::Rollout(a) if a.round_tokens.is_some() => rollout_round::run(a, exec),
            StageJob::Rollout(a) => rollout::run(a, exec),
            StageJob::RefLogprob(a) => ref_logprob::run(a, exec),
            StageJob::Values(a) => values::run(a, exec),
            StageJob::Update(a) => update::run(a, exec),
            StageJob::SyncWeights(a) => sync_weights::run(a, exec),
            StageJob::SavePolicy(a) => save::save_policy(a, exec),
            StageJob::Generate(a) => generate::run(a, exec),
            StageJob::Transfer(a) => transfer::run(a, exec),
        }
    }
}

/// A stage binary as the pipeline runner sees it.
pub struct StageDef {
    /// The binary's name, also the name of its spec table (`[ref-logprob]`).
    pub name: &'static str,
    /// Its command line: every flag with its help and parser, from the stage's `Args`.
    pub command: fn() -> Command,
    /// Long names of the flags the pipeline runner sets itself (paths, seeds, device, daemon):
    /// not spec keys.
    pub runner_owned: &'static [&'static str],
    /// Checks parsed flags as the stage does before it reads any input (ranges, combinations);
    /// the errors are input errors naming the flag.
    pub check: fn(&ArgMatches) -> Result<()>,
}

impl StageDef {
    /// Parses `argv` (the arguments without the program name) with the stage's own command.
    pub fn matches(&self, argv: &[String]) -> Result<ArgMatches> {
        (self.command)()
            .try_get_matches_from(std::iter::once(self.name.to_string()).chain(argv.to_vec()))
            .map_err(|e| input_error(format!("{}: {}", self.name, clap_message(&e))))
    }

    /// Parses and checks `argv` as the stage binary would before reading its input.
    pub(crate) fn check_args(&self, argv: &[String]) -> Result<()> {
        (self.check)(&self.matches(argv)?)
    }

    /// Whether the stage has the flag `--long`.
    pub fn takes(&self, long: &str) -> bool {
        (self.command)()
            .get_arguments()
            .any(|a| a.get_long() == Some(long))
    }
}

/// The command of a stage whose flags are the `Args` type `A`.
fn command<A: clap::Args>(name: &'static str) -> Command {
    A::augment_args(Command::new(name).version(crate::version::VERSION))
}

/// The stage binaries the pipeline runs, in the order of a step.
pub const STAGES: &[StageDef] = &[
    StageDef {
        name: "rollout",
        command: || command::<rollout::RolloutArgs>("rollout"),
        runner_owned: &[
            "model",
            "in",
            "out",
            "limit",
            "seed",
            "step",
            "metrics",
            "device",
            "daemon",
            "round-tokens",
            "carry",
            "carry-out",
        ],
        check: |m| parse_args::<rollout::RolloutArgs>(m)?.check(),
    },
    StageDef {
        name: "score",
        command: || command::<score::ScoreArgs>("score"),
        runner_owned: &["in", "out", "metrics"],
        check: |m| parse_args::<score::ScoreArgs>(m)?.check(),
    },
    StageDef {
        name: "ref-logprob",
        command: || command::<ref_logprob::RefLogprobArgs>("ref-logprob"),
        runner_owned: &["model", "in", "out", "column", "device", "daemon"],
        check: |m| parse_args::<ref_logprob::RefLogprobArgs>(m)?.check(),
    },
    StageDef {
        name: "values",
        command: || command::<values::ValuesArgs>("values"),
        runner_owned: &["model", "in", "out", "device"],
        check: |m| parse_args::<values::ValuesArgs>(m)?.check(),
    },
    StageDef {
        name: "advantage",
        command: || command::<advantage::AdvantageArgs>("advantage"),
        runner_owned: &["in", "out", "kl-state", "metrics"],
        check: |m| parse_args::<advantage::AdvantageArgs>(m)?.check(),
    },
    StageDef {
        name: "update",
        command: || command::<update::UpdateArgs>("update"),
        runner_owned: &[
            "model",
            "in",
            "out-model",
            "seed",
            "metrics",
            "device",
            "daemon",
            "skip-optimizer-state",
            "resident",
            // The runner's `[critic]` table trains the critic.
            "critic",
        ],
        check: |m| parse_args::<update::UpdateArgs>(m)?.check(),
    },
    StageDef {
        name: "sync-weights",
        command: || command::<sync_weights::SyncWeightsArgs>("sync-weights"),
        runner_owned: &["from", "to", "policy-version", "daemon"],
        check: |m| parse_args::<sync_weights::SyncWeightsArgs>(m).map(|_| ()),
    },
];

/// The stage binary `name`.
pub fn def(name: &str) -> Option<&'static StageDef> {
    STAGES.iter().find(|d| d.name == name)
}

/// The typed flags of parsed matches (an input error when they do not fit).
pub(crate) fn parse_args<A: FromArgMatches>(m: &ArgMatches) -> Result<A> {
    A::from_arg_matches(m).map_err(|e| input_error(clap_message(&e)))
}

/// A clap error as one line: its message and hints without the usage block.
pub(crate) fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let text = text.split("\n\nUsage:").next().unwrap_or_default();
    let text = text
        .split("\n\nFor more information")
        .next()
        .unwrap_or_default();
    let text = text.trim().strip_prefix("error:").unwrap_or(text).trim();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runner_owned_flags_are_flags_of_their_stage() {
        for def in STAGES {
            for long in def.runner_owned {
                assert!(def.takes(long), "{}: no --{long}", def.name);
            }
            (def.command)().debug_assert();
        }
    }

    /// Every stage binary's command, and `tandem sft-batch`'s.
    fn all_commands() -> Vec<Command> {
        let mut cmds: Vec<Command> = STAGES.iter().map(|d| (d.command)()).collect();
        cmds.push(command::<sft_batch::SftBatchArgs>("sft-batch"));
        cmds
    }

    /// A command line that parses: every required flag with a value clap takes, and every
    /// switch on (so that flags that require one, like `--kl-coef`, may be given).
    fn base_argv(cmd: &Command) -> Vec<String> {
        base_argv_without(cmd, "")
    }

    /// [`base_argv`] without the flag `--skip` (to give it another value).
    fn base_argv_without(cmd: &Command, skip: &str) -> Vec<String> {
        let mut argv = vec![cmd.get_name().to_string()];
        for a in cmd.get_arguments() {
            let Some(long) = a.get_long() else { continue };
            if ["help", "version", skip].contains(&long) {
                continue;
            }
            if !a.get_action().takes_values() {
                argv.push(format!("--{long}"));
            } else if a.is_required_set() {
                let value = match a.get_possible_values().first() {
                    Some(p) => p.get_name().to_string(),
                    None if long == "reward" => "exact".to_string(),
                    None => "x".to_string(),
                };
                argv.extend([format!("--{long}"), value]);
            }
        }
        argv
    }

    fn raw(m: &ArgMatches, id: &str) -> Vec<String> {
        m.get_raw(id)
            .map(|v| v.map(|x| x.to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn every_flag_has_help_and_every_shown_default_parses_as_typed() {
        for mut cmd in all_commands() {
            let name = cmd.get_name().to_string();
            let help = cmd.render_help().to_string();
            let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
            let base = base_argv(&cmd);
            let plain = cmd
                .clone()
                .try_get_matches_from(&base)
                .unwrap_or_else(|e| panic!("{name}: {base:?} does not parse: {e}"));
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if ["help", "version"].contains(&long) {
                    continue;
                }
                let text = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                assert!(!text.trim().is_empty(), "{name} --{long} has no help");
                // `[default: X]` is what clap shows for a default one can type; a default
                // described in words is written "(default: ...)".
                assert!(
                    !text.contains("[default:"),
                    "{name} --{long}: write a described default as (default: ...)"
                );
                if !arg.get_action().takes_values() {
                    continue;
                }
                // A negative number reaches the flag's parser (and its range check), never
                // "unexpected argument '-1'"; for a numeric flag also in the forms clap does
                // not take for a number.
                let negative: &[&str] = match common::is_numeric(arg) {
                    true => &["-1", "-1e-6", "-.5"],
                    false => &["-1"],
                };
                for value in negative {
                    let mut neg = base_argv_without(&cmd, long);
                    neg.extend([format!("--{long}"), value.to_string()]);
                    if let Err(e) = cmd.clone().try_get_matches_from(&neg) {
                        use clap::error::ErrorKind;
                        assert!(
                            matches!(
                                e.kind(),
                                ErrorKind::ValueValidation | ErrorKind::InvalidValue
                            ),
                            "{name} --{long} {value}: {e}"
                        );
                    }
                }
                let defaults: Vec<String> = arg
                    .get_default_values()
                    .iter()
                    .map(|d| d.to_string_lossy().into_owned())
                    .collect();
                if defaults.is_empty() {
                    continue;
                }
                // The default as --help shows it, typed after the flag, gives the same values
                // as leaving the flag out.
                let shown = defaults.join(" ");
                assert!(
                    help.contains(&format!("[default: {shown}]")),
                    "{name} --{long}: [default: {shown}] not in the help"
                );
                let mut typed = base_argv_without(&cmd, long);
                typed.push(format!("--{long}"));
                typed.extend(crate::reward::external::split_args(&shown).unwrap());
                let m = cmd
                    .clone()
                    .try_get_matches_from(&typed)
                    .unwrap_or_else(|e| {
                        panic!("{name} --{long} {shown} (the default --help shows): {e}")
                    });
                let id = arg.get_id().as_str();
                assert_eq!(raw(&m, id), raw(&plain, id), "{name} --{long} {shown}");
            }
        }
    }

    #[test]
    fn impossible_values_are_refused_with_their_range() {
        let with = |name: &str, extra: &[&str]| {
            let mut cmd = all_commands()
                .into_iter()
                .find(|c| c.get_name() == name)
                .unwrap();
            let mut argv = base_argv(&cmd);
            argv.extend(extra.iter().map(|s| s.to_string()));
            let e = cmd.try_get_matches_from_mut(&argv).unwrap_err();
            assert_eq!(e.exit_code(), 2);
            clap_message(&e)
        };
        for (stage, flag, value, range) in [
            (
                "rollout",
                "--max-new-tokens",
                "0",
                "must be an integer >= 1",
            ),
            ("rollout", "--n", "-2", "must be an integer >= 1"),
            (
                "rollout",
                "--temperature",
                "-1",
                "must be a finite number >= 0",
            ),
            (
                "rollout",
                "--top-p",
                "0",
                "must be a finite number in (0, 1]",
            ),
            (
                "rollout",
                "--top-k",
                "0",
                "must be -1 (all tokens) or an integer >= 1",
            ),
            ("rollout", "--limit", "0", "must be an integer >= 1"),
            (
                "rollout",
                "--gpu-memory-fraction",
                "1.5",
                "must be a finite number in (0, 1]",
            ),
            (
                "ref-logprob",
                "--temperature",
                "0",
                "must be a finite number > 0",
            ),
            (
                "advantage",
                "--gamma",
                "1.5",
                "must be a finite number in [0, 1]",
            ),
            (
                "advantage",
                "--kl-horizon",
                "0",
                "must be a finite number > 0",
            ),
            (
                "update",
                "--betas",
                "1",
                "must be a finite number in [0, 1)",
            ),
            (
                "update",
                "--clip-ratio-c",
                "1",
                "must be a finite number > 1",
            ),
            ("update", "--lr", "nan", "must be a finite number >= 0"),
            ("update", "--ppo-epochs", "0", "must be an integer >= 1"),
            (
                "update",
                "--min-lr-ratio",
                "2",
                "must be a finite number in [0, 1]",
            ),
            ("score", "--timeout-ms", "0", "must be an integer >= 1"),
            (
                "sft-batch",
                "--max-prompt-tokens",
                "0",
                "must be an integer >= 1",
            ),
        ] {
            let msg = with(stage, &[flag, value]);
            assert!(
                msg.starts_with(&format!("invalid value '{value}' for '{flag} <")),
                "{stage}: {msg}"
            );
            assert!(msg.ends_with(range), "{stage} {flag} {value}: {msg}");
        }
        // Names listed to clap show in the error.
        let msg = with("update", &["--lr-schedule", "linear"]);
        assert!(msg.contains("[possible values: constant, cosine]"), "{msg}");
        let msg = with("update", &["--loss-agg-mode", "mean"]);
        assert!(msg.contains("token-mean, seq-mean-token-sum"), "{msg}");
    }

    #[test]
    fn check_args_parses_and_checks_like_the_binary() {
        let rollout = def("rollout").unwrap();
        let base = ["--model", "m", "--in", "p", "--out", "o"].map(String::from);
        rollout.check_args(&base).unwrap();
        let with = |extra: &[&str]| {
            let mut a = base.to_vec();
            a.extend(extra.iter().map(|s| s.to_string()));
            rollout.check_args(&a).unwrap_err()
        };
        let e = with(&["--temperature", "x"]);
        assert!(crate::error::is_input_error(&e));
        assert_eq!(
            e.to_string(),
            "rollout: invalid value 'x' for '--temperature <TEMPERATURE>': invalid float literal"
        );
        for t in [&["--temperature=-1"][..], &["--temperature", "-1"]] {
            let e = with(t);
            assert!(crate::error::is_input_error(&e));
            assert_eq!(
                e.to_string(),
                "rollout: invalid value '-1' for '--temperature <TEMPERATURE>': must be a finite number >= 0"
            );
        }
        let e = with(&["--max-num-seqs", "8", "--max-batched-tokens", "4"]);
        assert!(e
            .to_string()
            .contains("--max-batched-tokens (4) must be >= --max-num-seqs (8)"));
        let e = with(&["--truncate", "middle"]);
        assert!(
            e.to_string().contains("[possible values: left, error]"),
            "{e}"
        );
    }
}
