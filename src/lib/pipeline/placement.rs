//! `[placement]`: rollout and training on separate GPUs of the machine (docs/DISTRIBUTED.md,
//! "Placement"). Each side is a daemon group of its own: the training group (`train-gpus`)
//! runs ref-logprob, values and update at the run's usual socket; the rollout group
//! (`rollout-gpus`) runs every rollout at `rollout.sock`. After each update the new policy goes
//! from the training group to the rollout group in buckets (`tandem daemon-ctl transfer`,
//! `stage::transfer`), with its time and bandwidth in the step's metrics (`transfer/...`).
//!
//! `mode = "sync"` (the default) keeps the colocated run's order: the same samples, the same
//! files. `mode = "one-step-off"` (verl's `one_step_off_policy`): the rollout of step k + 1
//! runs on the rollout group while step k trains on the training group, so it samples with
//! the policy one version behind the synchronous run's (step k's rows have `policy_version`
//! k − 2, step 1's and 2's the initial model's 0); the rows keep their behaviour log-probs
//! (`rollout_logprobs`), on which the rollout-correction options (`[update] rollout-is`,
//! `rollout-rs`) act as they do on any mismatch.
//!
//! Without `[placement]` the run is colocated, as before.

use super::plan::{path_arg, Action, Plan, Task};
use super::rundir::State;
use super::spec::{Device, Source, Spec, Stages};
use crate::bail_input;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How the two sides take turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Mode {
    /// Rollout, then training, then the transfer: the colocated run's steps on two groups.
    #[default]
    Sync,
    /// The next step's rollout runs while this step trains, one policy version behind.
    OneStepOff,
}

/// `[placement]` as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct PlacementSpec {
    /// The GPUs (indices among the machine's `gpus`) of the rollout group.
    pub(crate) rollout_gpus: Vec<u64>,
    /// The GPUs of the training group.
    pub(crate) train_gpus: Vec<u64>,
    #[serde(default, skip_serializing_if = "is_sync")]
    pub(crate) mode: Mode,
    /// MiB of a bucket of the weight transfer (at 4 bytes an element; bf16 buckets on a GPU
    /// take half).
    #[serde(default = "default_bucket_mb")]
    pub(crate) bucket_mb: u64,
}

fn is_sync(m: &Mode) -> bool {
    *m == Mode::Sync
}

fn default_bucket_mb() -> u64 {
    256
}

/// Which daemon group a stage goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Side {
    /// The run's daemon (group): every model stage when colocated; all but rollout placed.
    #[default]
    Train,
    /// The rollout group of a placed run.
    Rollout,
}

/// `[placement]` against the rest of the spec, before anything runs: both sides non-empty,
/// disjoint, no GPU twice, every GPU among the machine's `gpus`; the daemons it needs, and the
/// spec's features it does not take.
pub(crate) fn check(spec: &Spec, stages: &Stages, src: &Source) -> Result<()> {
    let Some(p) = &spec.placement else {
        return Ok(());
    };
    let at = |key: &str| src.at("placement", key);
    for (key, gpus) in [
        ("rollout-gpus", &p.rollout_gpus),
        ("train-gpus", &p.train_gpus),
    ] {
        if gpus.is_empty() {
            bail_input!(
                "{}: [placement] {key} is empty: each side needs at least one GPU",
                at(key)
            );
        }
        for (i, g) in gpus.iter().enumerate() {
            if *g >= spec.gpus {
                bail_input!(
                    "{}: [placement] {key}: GPU {g} is not among the machine's gpus = {} (GPUs 0 to {}); set gpus to the GPUs the run may use",
                    at(key),
                    spec.gpus,
                    spec.gpus - 1
                );
            }
            if gpus[..i].contains(g) {
                bail_input!("{}: [placement] {key}: GPU {g} is listed twice", at(key));
            }
        }
    }
    if let Some(g) = p.train_gpus.iter().find(|g| p.rollout_gpus.contains(g)) {
        bail_input!(
            "{}: [placement] train-gpus: GPU {g} is in rollout-gpus too; the two sides take disjoint GPUs",
            at("train-gpus")
        );
    }
    if p.bucket_mb == 0 {
        bail_input!(
            "{}: [placement] bucket-mb must be at least 1",
            at("bucket-mb")
        );
    }
    if !spec.daemon {
        bail_input!(
            "{}: [placement] needs daemon = true: each side is a daemon group that keeps its weights",
            at("rollout-gpus")
        );
    }
    let refused = [
        (
            spec.rollout.contains_key("agent"),
            "[rollout] agent (its rollout is the user's program against tandem serve)",
        ),
        (
            stages.update.args.lora_rank > 0,
            "[update] lora-rank (the transfer carries whole weights, not adapters)",
        ),
        (
            p.mode == Mode::OneStepOff && spec.filter_groups().is_some(),
            "mode = \"one-step-off\" with [algorithm] filter-groups (its rounds sample in the step itself)",
        ),
    ];
    if let Some((_, what)) = refused.iter().find(|(on, _)| *on) {
        bail_input!(
            "{}: [placement] does not take {what} yet",
            at("rollout-gpus")
        );
    }
    Ok(())
}

impl Plan {
    /// The run's placement, when rollout and training sit on separate GPUs.
    pub(crate) fn placement(&self) -> Option<&PlacementSpec> {
        self.spec.placement.as_ref()
    }

    /// Whether the next step's rollout overlaps this step's update.
    pub(crate) fn one_step_off(&self) -> bool {
        self.placement().is_some_and(|p| p.mode == Mode::OneStepOff)
    }

    /// Ranks of a side's daemon group: the placed side's GPUs, or `gpus` colocated.
    pub(crate) fn ranks_of(&self, side: Side) -> u64 {
        match (self.placement(), side) {
            (None, _) => self.spec.gpus,
            (Some(p), Side::Train) => p.train_gpus.len() as u64,
            (Some(p), Side::Rollout) => p.rollout_gpus.len() as u64,
        }
    }

    /// The side a stage binary runs on.
    pub(crate) fn side_of(&self, bin: &str) -> Side {
        match self.placement().is_some() && bin == "rollout" {
            true => Side::Rollout,
            false => Side::Train,
        }
    }

    /// The socket of a side's daemon (rank 0's of its group).
    pub(crate) fn socket_of(&self, side: Side) -> PathBuf {
        match side {
            Side::Train => self.daemon_socket(),
            Side::Rollout => self.run.root.join("rollout.sock"),
        }
    }

    /// `CUDA_VISIBLE_DEVICES` of a placed side's group on the GPU (its GPUs, as entries of
    /// the visibility the runner itself was given): each rank then uses its local rank's.
    pub(crate) fn visible_gpus(&self, side: Side) -> Option<String> {
        let p = self
            .placement()
            .filter(|_| self.spec.device == Device::Cuda)?;
        let gpus = match side {
            Side::Train => &p.train_gpus,
            Side::Rollout => &p.rollout_gpus,
        };
        let outer: Option<Vec<String>> = std::env::var("CUDA_VISIBLE_DEVICES")
            .ok()
            .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
        let names: Vec<String> = gpus
            .iter()
            .map(|&g| match &outer {
                Some(o) if (g as usize) < o.len() => o[g as usize].clone(),
                _ => g.to_string(),
            })
            .collect();
        Some(names.join(","))
    }

    /// The transfer of the current policy (the pointer `RUN/policy`) from the training group
    /// to the rollout group, its metrics into step `step`'s `transfer.json`.
    pub(crate) fn transfer_task(&self, step: u64) -> Option<Task> {
        let p = self.placement()?;
        let args = vec![
            "daemon-ctl".into(),
            "--socket".into(),
            path_arg(&self.socket_of(Side::Train)),
            "transfer".into(),
            "--to".into(),
            path_arg(&self.socket_of(Side::Rollout)),
            "--model".into(),
            path_arg(&self.run.policy()),
            "--receivers".into(),
            p.rollout_gpus.len().to_string(),
            "--bucket-mb".into(),
            p.bucket_mb.to_string(),
            "--metrics".into(),
            path_arg(&self.run.stage_metrics(step, "transfer")),
        ];
        Some(Task {
            name: "transfer",
            action: Action::Stage {
                bin: "tandem",
                args,
            },
        })
    }

    /// Step `step`'s update, and in one-step-off mode before the last step the next step's
    /// prompts and its rollout beside the update (the rollout reads the policy pointer before
    /// this step's sync moves it: one version behind).
    pub(crate) fn update_tasks(&self, step: u64, update: Task, tasks: &mut Vec<Task>) {
        if !self.one_step_off() || step >= self.spec.steps {
            tasks.push(update);
            return;
        }
        let next = step + 1;
        let [prompts, rollout] = self.own_sampling(next);
        tasks.push(Task {
            name: "next-prompts",
            action: prompts.action,
        });
        tasks.push(Task {
            name: "update",
            action: Action::Overlap(Box::new([update, rollout])),
        });
    }

    /// Whether step `step` samples its own prompts and rollout: always, except in one-step-off
    /// mode, where the step before did it beside its update.
    pub(crate) fn samples_own(&self, step: u64) -> bool {
        !self.one_step_off() || step == 1
    }

    /// Step `step`'s prompt draw and rollout (their files are the step's own).
    fn own_sampling(&self, step: u64) -> [Task; 2] {
        let mut t = self.sampling_tasks(step).into_iter();
        let prompts = t.next().expect("prompts first");
        let rollout = t.next().expect("then the rollout");
        [prompts, rollout]
    }

    /// One-step-off's first step of a process (`state` before it) samples itself when the
    /// step before did not leave its rollout: a run continued past its old last step (which
    /// had no next step to sample for). Its draw and rollout go first.
    pub(crate) fn catch_up(&self, state: &State, step: u64, tasks: &mut Vec<Task>) {
        let first = step == state.steps_done + 1;
        if self.samples_own(step) || !first || self.run.batch(step, "rollout").exists() {
            return;
        }
        let own = self.own_sampling(step);
        tasks.splice(0..0, own);
    }

    /// The steps whose prompts the sampler has drawn once step `to` is done: one more in
    /// one-step-off mode, whose step `to` drew the next step's (when it did).
    pub(crate) fn steps_drawn(&self, to: u64) -> u64 {
        let ahead = self.one_step_off() && to >= 1 && self.run.batch(to + 1, "prompts").exists();
        to + u64::from(ahead)
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::Spec;

    const BASE: &str = "steps = 3\ngpus = 3\ndaemon = true\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nprompts-per-step = 2\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n";

    fn err(placement: &str, top: &str) -> String {
        let text = format!("{}{top}[placement]\n{placement}", BASE);
        format!("{:#}", Spec::parse(&text, "s.toml").unwrap_err())
    }

    #[test]
    fn bad_placements_are_refused_naming_the_key() {
        let cases = [
            (
                "rollout-gpus = []\ntrain-gpus = [1]\n",
                "[placement] rollout-gpus is empty",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = []\n",
                "[placement] train-gpus is empty",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1, 3]\n",
                "[placement] train-gpus: GPU 3 is not among the machine's gpus = 3 (GPUs 0 to 2)",
            ),
            (
                "rollout-gpus = [0, 0]\ntrain-gpus = [1]\n",
                "[placement] rollout-gpus: GPU 0 is listed twice",
            ),
            (
                "rollout-gpus = [0, 1]\ntrain-gpus = [1, 2]\n",
                "[placement] train-gpus: GPU 1 is in rollout-gpus too",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"two-steps-off\"\n",
                "unknown variant `two-steps-off`",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nbucket-mb = 0\n",
                "bucket-mb must be at least 1",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\ngpu = 2\n",
                "unknown key `gpu`",
            ),
        ];
        for (placement, want) in cases {
            let e = err(placement, "");
            assert!(e.contains(want), "{placement}: {e}");
        }
        // The key's line in the file is named.
        let e = err("rollout-gpus = [0]\ntrain-gpus = [1, 3]\n", "");
        assert!(e.starts_with("s.toml:15:"), "{e}");
        let no_daemon = format!(
            "{}[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\n",
            BASE
        )
        .replace("daemon = true\n", "");
        let e = format!("{:#}", Spec::parse(&no_daemon, "s.toml").unwrap_err());
        assert!(e.contains("[placement] needs daemon = true"), "{e}");
        let e = err(
            "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"one-step-off\"\n",
            "[algorithm]\nfilter-groups = true\n",
        );
        assert!(
            e.contains("does not take mode = \"one-step-off\" with [algorithm] filter-groups"),
            "{e}"
        );
        let ok = format!(
            "{BASE}[placement]\nrollout-gpus = [2]\ntrain-gpus = [0, 1]\nmode = \"one-step-off\"\n"
        );
        let spec = Spec::parse(&ok, "s.toml").unwrap();
        let p = spec.placement.as_ref().unwrap();
        assert_eq!(
            (p.rollout_gpus.clone(), p.train_gpus.clone(), p.bucket_mb),
            (vec![2], vec![0, 1], 256)
        );
        // The resolved spec keeps the table.
        assert!(spec.to_toml().contains("[placement]"), "{}", spec.to_toml());
    }
}
