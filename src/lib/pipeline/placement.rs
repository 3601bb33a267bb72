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
//! `rollout-rs`) act as they do on any mismatch; with `[algorithm] filter-groups` step k + 1's
//! dynamic sampling (every pass) runs beside step k's update. `mode = "async"`: the rollout group
//! generates continuously in rounds of partial rollouts while the steps train, under the
//! staleness bound `max-staleness` (`super::asynchronous`).
//!
//! Without `[placement]` the run is colocated, as before. The spec's table and its checks are
//! here; what the runner plans from it is `plan::placed`'s.

use crate::bail_input;
use anyhow::Result;
use serde::{Deserialize, Serialize};

/// How the two sides take turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Mode {
    /// Rollout, then training, then the transfer: the colocated run's steps on two groups.
    #[default]
    Sync,
    /// The next step's rollout runs while this step trains, one policy version behind.
    OneStepOff,
    /// Continuous generation in rounds with partial rollouts and a staleness bound
    /// (`max-staleness`, `round-tokens`; `super::asynchronous`).
    Async,
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
    /// Keep the weight transfer's bridge between transfers (default); false makes one for
    /// each transfer and ends it after (`daemon-ctl transfer --fresh-bridge`).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub(crate) keep_bridge: bool,
    /// `mode = "async"`: how many versions the oldest token of a trained sample may lag the
    /// policy being trained (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_staleness: Option<u64>,
    /// `mode = "async"`: new tokens per sequence per round (a partial rollout takes new
    /// weights between rounds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) round_tokens: Option<u64>,
}

fn is_sync(m: &Mode) -> bool {
    *m == Mode::Sync
}

fn default_bucket_mb() -> u64 {
    256
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
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

/// `[placement]` `p` against the rest of the spec, before anything runs: both sides
/// non-empty, disjoint, no GPU twice, every GPU among the machine's `gpus`; the daemons it
/// needs (`daemon`), and none of the spec's features it does not take (`refused`: whether
/// the spec uses each, and what it is). `at(key)` places a key in the spec file.
pub(crate) fn check(
    p: &PlacementSpec,
    gpus: u64,
    daemon: bool,
    refused: &[(bool, &str)],
    at: &dyn Fn(&str) -> String,
) -> Result<()> {
    for (key, list) in [
        ("rollout-gpus", &p.rollout_gpus),
        ("train-gpus", &p.train_gpus),
    ] {
        if list.is_empty() {
            bail_input!(
                "{}: [placement] {key} is empty: each side needs at least one GPU",
                at(key)
            );
        }
        for (i, g) in list.iter().enumerate() {
            if *g >= gpus {
                bail_input!(
                    "{}: [placement] {key}: GPU {g} is not among the machine's gpus = {gpus} (GPUs 0 to {}); set gpus to the GPUs the run may use",
                    at(key),
                    gpus - 1
                );
            }
            if list[..i].contains(g) {
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
    check_async(p, at)?;
    if !daemon {
        bail_input!(
            "{}: [placement] needs daemon = true: each side is a daemon group that keeps its weights",
            at("rollout-gpus")
        );
    }
    if let Some((_, what)) = refused.iter().find(|(on, _)| *on) {
        bail_input!(
            "{}: [placement] does not take {what} yet",
            at("rollout-gpus")
        );
    }
    Ok(())
}

/// The keys of `mode = "async"`: only with it, each at least 1.
fn check_async(p: &PlacementSpec, at: &dyn Fn(&str) -> String) -> Result<()> {
    for (key, value) in [
        ("max-staleness", p.max_staleness),
        ("round-tokens", p.round_tokens),
    ] {
        match value {
            Some(_) if p.mode != Mode::Async => bail_input!(
                "{}: [placement] {key} is a key of mode = \"async\" (the mode here is another)",
                at(key)
            ),
            Some(0) => bail_input!("{}: [placement] {key} must be at least 1", at(key)),
            _ => {}
        }
    }
    Ok(())
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
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"async\"\nmax-staleness = 0\n",
                "[placement] max-staleness must be at least 1",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"async\"\nround-tokens = 0\n",
                "[placement] round-tokens must be at least 1",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"async\"\nmax-staleness = -1\n",
                "max-staleness",
            ),
            (
                "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"one-step-off\"\nround-tokens = 8\n",
                "[placement] round-tokens is a key of mode = \"async\"",
            ),
        ];
        for (placement, want) in cases {
            let e = err(placement, "");
            assert!(e.contains(want), "{placement}: {e}");
        }
        // The key's line in the file is named.
        let e = err("rollout-gpus = [0]\ntrain-gpus = [1, 3]\n", "");
        assert!(e.starts_with("s.toml:15:"), "{e}");
        let e = err(
            "rollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"async\"\nround-tokens = 0\n",
            "",
        );
        assert!(e.starts_with("s.toml:17:"), "{e}");
        let no_daemon = format!(
            "{}[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\n",
            BASE
        )
        .replace("daemon = true\n", "");
        let e = format!("{:#}", Spec::parse(&no_daemon, "s.toml").unwrap_err());
        assert!(e.contains("[placement] needs daemon = true"), "{e}");
        // One-step-off takes dynamic sampling: the next step's passes run beside the update.
        let dynamic = format!(
            "{BASE}[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"one-step-off\"\n[algorithm]\nfilter-groups = true\nmax-num-gen-batches = 2\n"
        );
        let spec = Spec::parse(&dynamic, "s.toml").unwrap();
        assert_eq!(spec.filter_groups().map(|f| f.max_rounds), Some(2));
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
