//! What a run plans from its `[placement]` (`super::super::placement`): the side each stage
//! runs on, the sides' daemon groups, the transfer after each sync, and one-step-off's tasks
//! (the next step's prompts, and its rollout beside this step's update).

use super::super::placement::{Mode, PlacementSpec, Side};
use super::super::rundir::State;
use super::super::sampler::derive_seed;
use super::super::spec::Device;
use super::{path_arg, Action, Plan, Task};
use std::path::{Path, PathBuf};

/// New tokens per sequence per round when `round-tokens` is not set.
pub(crate) const DEFAULT_ROUND_TOKENS: u64 = 64;

/// The files of one rollout round (`RUN/async/round-R/`).
pub(crate) struct RoundFiles {
    pub(crate) prompts: PathBuf,
    pub(crate) carry: Option<PathBuf>,
    pub(crate) carry_out: PathBuf,
    pub(crate) finished: PathBuf,
    pub(crate) metrics: PathBuf,
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

    /// Whether the rollout group generates continuously in rounds (`mode = "async"`).
    pub(crate) fn asynchronous(&self) -> bool {
        self.placement().is_some_and(|p| p.mode == Mode::Async)
    }

    /// An asynchronous step's sampling: take the finished groups, then score them (with
    /// dynamic sampling the take scores them itself, to filter them).
    pub(super) fn take_tasks(&self, step: u64) -> Vec<Task> {
        let take = Task {
            name: "take",
            action: Action::TakeGroups,
        };
        if self.spec.filter_groups().is_some() {
            return vec![take];
        }
        let files = self.step_files(step);
        let [_, score] = self.sample_tasks(step, &files, 0);
        vec![take, score]
    }

    /// Where the rollout rounds of an asynchronous run keep their files.
    pub(crate) fn async_dir(&self) -> PathBuf {
        self.run.root.join("async")
    }

    /// The pointer to the policy the rollout group holds (an asynchronous run's rounds
    /// sample with it).
    pub(crate) fn rollout_policy(&self) -> PathBuf {
        self.async_dir().join("rollout-policy")
    }

    /// The files of rollout round `round`, continuing `carry`.
    pub(crate) fn round_files(&self, round: u64, carry: Option<PathBuf>) -> RoundFiles {
        let dir = self.async_dir().join(format!("round-{round}"));
        RoundFiles {
            prompts: dir.join("prompts.parquet"),
            carry,
            carry_out: dir.join("carry.parquet"),
            finished: dir.join("finished.parquet"),
            metrics: dir.join("metrics.json"),
        }
    }

    /// The first rollout round's command (for the checks before a run and the dry run).
    pub(super) fn first_async_round(&self) -> Task {
        let files = self.round_files(1, None);
        Task {
            name: "rollout",
            action: Action::Stage {
                bin: "rollout",
                args: self.round_args(1, &self.rollout_policy(), &files),
            },
        }
    }

    /// The dry-run text of an asynchronous step's `take`, with the first round's command.
    pub(super) fn describe_take(&self, step: u64) -> String {
        let p = self.placement().expect("a placed run");
        let mut text = format!(
            "# pipeline: the rollout group runs rounds of up to {} new tokens per sequence (commands in {}) beside the steps; take the first {} finished groups whose tokens lag the policy by at most max-staleness = {} versions into {}. Round 1:\n",
            p.round_tokens.unwrap_or(DEFAULT_ROUND_TOKENS),
            self.async_dir().join("rounds.sh").display(),
            self.spec.data.prompts_per_step,
            p.max_staleness.unwrap_or(1),
            self.run.batch(step, "rollout").display()
        );
        if let Some(fg) = self.spec.filter_groups() {
            text += &format!(
                "# pipeline: dynamic sampling: the take scores the groups it admits into {}/round-R/ and keeps those with a varying {} (at most {} groups scored a step, then on-cap).\n",
                self.run.step_dir(step).display(),
                fg.metric.name(),
                match fg.max_rounds {
                    0 => "no cap: any number of".to_string(),
                    b => (b * self.spec.data.prompts_per_step).to_string(),
                }
            );
        }
        if let Action::Stage { bin, args } = &self.first_async_round().action {
            text += &self.stage_line(bin, args);
        }
        text
    }

    /// The stage command of rollout round `round` (`rollout --round-tokens`, on the rollout
    /// group): `prompts` start, `carry` (none in the first round) continues, the finished
    /// groups go to `out` and the rest to `carry_out`; the policy is `model` (what the rollout
    /// group holds).
    pub(crate) fn round_args(&self, round: u64, model: &Path, files: &RoundFiles) -> Vec<String> {
        let p = self.placement().expect("a placed run");
        let mut a = vec![
            "--model".into(),
            path_arg(model),
            "--in".into(),
            path_arg(&files.prompts),
            "--out".into(),
            path_arg(&files.finished),
        ];
        a.extend(self.stages.rollout.argv.iter().cloned());
        if let Some(c) = &files.carry {
            a.extend(["--carry".into(), path_arg(c)]);
        }
        a.extend([
            "--carry-out".into(),
            path_arg(&files.carry_out),
            "--round-tokens".into(),
            p.round_tokens.unwrap_or(DEFAULT_ROUND_TOKENS).to_string(),
            "--seed".into(),
            derive_seed(self.spec.seed, &[round, 3]).to_string(),
            "--metrics".into(),
            path_arg(&files.metrics),
        ]);
        a.extend(self.device_args_of(Side::Rollout));
        a
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
        let mut args = vec![
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
        if !p.keep_bridge {
            args.push("--fresh-bridge".into());
        }
        Some(Task {
            name: "transfer",
            action: Action::Stage {
                bin: "tandem",
                args,
            },
        })
    }

    /// Step `step`'s update (None in the critic's warm-up, which trains no policy), and in
    /// one-step-off mode before the last step the next step's prompts and its rollout beside
    /// the update (the rollout reads the policy pointer before this step's sync moves it: one
    /// version behind; alone when there is no update).
    pub(crate) fn update_tasks(&self, step: u64, update: Option<Task>, tasks: &mut Vec<Task>) {
        if !self.one_step_off() || step >= self.spec.steps {
            tasks.extend(update);
            return;
        }
        let mut own = self.own_sampling(step + 1);
        let rollout = own.pop().expect("a rollout or dynamic sampling");
        // Dynamic sampling draws its passes' prompts itself.
        if let Some(prompts) = own.pop() {
            tasks.push(Task {
                name: "next-prompts",
                action: prompts.action,
            });
        }
        let alone = match rollout.action {
            Action::DynamicSampling { .. } => "next-sample",
            _ => "next-rollout",
        };
        tasks.push(match update {
            Some(update) => Task {
                name: "update",
                action: Action::Overlap(Box::new([update, rollout])),
            },
            None => Task {
                name: alone,
                action: rollout.action,
            },
        });
    }

    /// Whether step `step` samples its own prompts and rollout: always, except in one-step-off
    /// mode, where the step before did it beside its update.
    pub(crate) fn samples_own(&self, step: u64) -> bool {
        !self.one_step_off() || step == 1
    }

    /// Step `step`'s prompt draw and rollout, or its dynamic sampling (their files are the
    /// step's own): the sampling one-step-off runs in the step before.
    pub(super) fn own_sampling(&self, step: u64) -> Vec<Task> {
        let mut t = self.sampling_tasks(step);
        if self.spec.filter_groups().is_none() {
            t.truncate(2);
        }
        t
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
        let drew = |s| {
            self.run.batch(s, "prompts").exists() || super::super::dynamic::sampled(&self.run, s)
        };
        let ahead = self.one_step_off() && to >= 1 && drew(to + 1);
        to + u64::from(ahead)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::rundir::RunDir;
    use super::super::super::spec::Spec;
    use super::*;

    fn plan(mode: &str) -> Plan {
        plan_with(mode, "")
    }

    /// A two-step placed plan in `mode`, with `keys` added to `[placement]`.
    fn plan_with(mode: &str, keys: &str) -> Plan {
        let text = format!(
            "steps = 2\ngpus = 3\ndaemon = true\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nprompts-per-step = 2\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n[placement]\nrollout-gpus = [0]\ntrain-gpus = [1, 2]\nmode = \"{mode}\"\n{keys}"
        );
        let spec = Spec::parse(&text, "s.toml").unwrap();
        Plan::new(spec, RunDir::new("r"), PathBuf::from("bin")).unwrap()
    }

    fn names(tasks: &[Task]) -> Vec<&'static str> {
        tasks.iter().map(|t| t.name).collect()
    }

    #[test]
    fn one_step_off_samples_the_next_step_beside_the_update() {
        let p = plan("one-step-off");
        assert_eq!(
            names(&p.step_tasks(1)),
            [
                "prompts",
                "rollout",
                "score",
                "advantage",
                "next-prompts",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        // The last step has no next step: its update runs alone.
        assert_eq!(
            names(&p.step_tasks(2)),
            [
                "score",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        let tasks = p.step_tasks(1);
        let Action::Overlap(pair) = &tasks[5].action else {
            panic!("{:?}", tasks[5]);
        };
        let args = |t: &Task| match &t.action {
            Action::Stage { bin, args } => (*bin, args.join(" ")),
            other => panic!("{other:?}"),
        };
        let (bin, update) = args(&pair[0]);
        assert_eq!(bin, "update");
        assert!(update.contains("--daemon r/daemon.sock"), "{update}");
        let (bin, rollout) = args(&pair[1]);
        assert_eq!(bin, "rollout");
        // Step 2's files, from the pointer as it stands before step 1's sync, on the rollout group.
        assert!(
            rollout.contains("--model r/policy --in r/step-0002/prompts.parquet --out r/step-0002/rollout.parquet"),
            "{rollout}"
        );
        assert!(
            rollout.contains("--step 2 ") && rollout.contains("--daemon r/rollout.sock"),
            "{rollout}"
        );
        assert_eq!(
            tasks[4].action,
            Action::SamplePrompts { step: 2 },
            "next-prompts draws step 2's"
        );
        let (bin, transfer) = args(&tasks[7]);
        assert_eq!(bin, "tandem");
        assert_eq!(
            transfer,
            "daemon-ctl --socket r/daemon.sock transfer --to r/rollout.sock --model r/policy --receivers 1 --bucket-mb 256 --metrics r/step-0001/metrics/transfer.json"
        );
    }

    /// `keep-bridge = false`: each transfer meets on a new bridge and ends it.
    #[test]
    fn a_bridge_not_kept_is_a_fresh_one_each_transfer() {
        let p = plan_with("sync", "keep-bridge = false\n");
        let Some(Task {
            action: Action::Stage { args, .. },
            ..
        }) = p.transfer_task(1)
        else {
            panic!("no transfer");
        };
        assert_eq!(args.last().map(String::as_str), Some("--fresh-bridge"));
        let again = Spec::parse(&p.spec.to_toml(), "resolved").unwrap();
        assert!(!again.placement.unwrap().keep_bridge);
        assert!(plan("sync").placement().unwrap().keep_bridge);
    }

    /// With dynamic sampling the next step's whole sampling (its passes draw their own
    /// prompts) runs beside the update; the next step samples nothing itself.
    #[test]
    fn one_step_off_runs_the_next_steps_dynamic_sampling_beside_the_update() {
        let p = plan_with("one-step-off", "[algorithm]\nfilter-groups = true\n");
        let tasks = p.step_tasks(1);
        assert_eq!(
            names(&tasks),
            [
                "sample",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        assert_eq!(tasks[0].action, Action::DynamicSampling { step: 1 });
        let Action::Overlap(pair) = &tasks[2].action else {
            panic!("{:?}", tasks[2]);
        };
        assert!(matches!(
            &pair[0].action,
            Action::Stage { bin: "update", .. }
        ));
        assert_eq!(pair[1].action, Action::DynamicSampling { step: 2 });
        // The dry run shows the update beside step 2's rounds.
        let text = p.describe(1, &tasks[2]);
        assert!(
            text.contains("r/step-0002/round-R/")
                && text.contains("--in r/step-0002/round-1/prompts.parquet"),
            "{text}"
        );
        assert_eq!(
            names(&p.step_tasks(2)),
            [
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
    }

    /// A run continued past its last step (which sampled no next step) samples its first new
    /// step itself; once a step's dynamic sampling finished beside the update, the sampler
    /// counts that step as drawn (a rewind replays its cursor).
    #[test]
    fn a_continued_dynamic_run_samples_its_first_step_itself() {
        let dir = tempfile::tempdir().unwrap();
        let text = "steps = 3\ngpus = 2\ndaemon = true\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nprompts-per-step = 2\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"one-step-off\"\n[algorithm]\nfilter-groups = true\n";
        let spec = Spec::parse(text, "s.toml").unwrap();
        let run = RunDir::new(dir.path());
        let p = Plan::new(spec, run.clone(), PathBuf::from("bin")).unwrap();
        let state = State {
            steps_done: 2,
            init_done: true,
            ..State::default()
        };
        let left: Vec<_> = p.remaining(&state).iter().map(|(_, t)| t.name).collect();
        assert_eq!(
            left,
            [
                "sample",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        assert_eq!(p.steps_drawn(2), 2);
        // Step 3's sampling ran beside step 2's update: its record is written.
        let record = run.step_dir(3).join("sampling.json");
        std::fs::create_dir_all(record.parent().unwrap()).unwrap();
        std::fs::write(&record, "{}").unwrap();
        assert_eq!(p.steps_drawn(2), 3);
    }

    #[test]
    fn a_critic_warm_up_step_still_samples_the_next_step() {
        let text = "steps = 2\ngpus = 2\ndaemon = true\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nprompts-per-step = 2\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"gae\"\n[critic]\ncritic-warmup = 1\n[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"one-step-off\"\n";
        let spec = Spec::parse(text, "s.toml").unwrap();
        let p = Plan::new(spec, RunDir::new("r"), PathBuf::from("bin")).unwrap();
        let names = names(&p.step_tasks(1));
        assert!(
            names.ends_with(&["critic", "next-prompts", "next-rollout", "prune", "metrics"]),
            "{names:?}"
        );
        assert!(
            !names.contains(&"update") && !names.contains(&"transfer"),
            "{names:?}"
        );
    }

    #[test]
    fn async_steps_take_their_groups_and_rounds_run_on_the_rollout_group() {
        let p = plan_with("async", "max-staleness = 2\nround-tokens = 3\n");
        assert_eq!(
            names(&p.step_tasks(1)),
            [
                "take",
                "score",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        let Action::Stage { bin, args } = &p.first_async_round().action else {
            panic!("a stage");
        };
        let line = args.join(" ");
        assert_eq!(*bin, "rollout");
        assert!(
            line.starts_with("--model r/async/rollout-policy --in r/async/round-1/prompts.parquet --out r/async/round-1/finished.parquet"),
            "{line}"
        );
        assert!(
            line.contains("--carry-out r/async/round-1/carry.parquet --round-tokens 3 --seed ")
                && line.ends_with("--daemon r/rollout.sock")
                && !line.contains("--carry "),
            "{line}"
        );
        let next = p.round_args(
            2,
            &p.rollout_policy(),
            &p.round_files(2, Some("c.parquet".into())),
        );
        assert!(next.join(" ").contains("--carry c.parquet"), "{next:?}");
        let take = p.describe(1, &p.step_tasks(1)[0]);
        assert!(
            take.contains("max-staleness = 2")
                && take.contains("Round 1:\n")
                && take.contains("--round-tokens 3"),
            "{take}"
        );
    }

    /// With dynamic sampling the take scores its groups itself: no `score` task follows, and
    /// the dry run says so with the cap (10 × 2 groups).
    #[test]
    fn async_steps_with_filter_groups_score_in_the_take() {
        let p = plan_with("async", "[algorithm]\nfilter-groups = true\n");
        assert_eq!(
            names(&p.step_tasks(1)),
            [
                "take",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        let take = p.describe(1, &p.step_tasks(1)[0]);
        assert!(
            take.contains("the take scores the groups it admits into r/step-0001/round-R/")
                && take.contains("at most 20 groups scored a step"),
            "{take}"
        );
    }

    #[test]
    fn sync_placement_keeps_the_colocated_order_and_adds_the_transfer() {
        let p = plan("sync");
        assert_eq!(
            names(&p.step_tasks(1)),
            [
                "prompts",
                "rollout",
                "score",
                "advantage",
                "update",
                "sync",
                "transfer",
                "prune",
                "metrics"
            ]
        );
        assert_eq!((p.ranks_of(Side::Train), p.ranks_of(Side::Rollout)), (2, 1));
        assert_eq!(p.side_of("rollout"), Side::Rollout);
        assert_eq!(p.side_of("ref-logprob"), Side::Train);
        assert_eq!(p.daemon_launch_prefix(Side::Rollout), Vec::<String>::new());
        assert_eq!(
            p.daemon_launch_prefix(Side::Train)[..3],
            ["launch", "--nproc-per-node", "2"]
        );
        // CPU ranks: no CUDA_VISIBLE_DEVICES.
        assert_eq!(p.visible_gpus(Side::Train), None);
    }
}
