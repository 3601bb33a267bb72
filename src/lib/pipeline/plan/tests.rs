//! The planner's tests: the tasks and command lines of a step, written out by hand, for the
//! spec variants the runner plans differently; no process runs.

use super::*;

#[test]
fn quoting() {
    assert_eq!(shell_quote("a/b.parquet"), "a/b.parquet");
    assert_eq!(shell_quote("cmd:python3 r.py"), "'cmd:python3 r.py'");
    assert_eq!(shell_quote("it's"), "'it'\\''s'");
    assert_eq!(shell_quote(""), "''");
}

const SPEC: &str = "steps = 2\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nval = \"v.parquet\"\nprompts-per-step = 4\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n[eval]\nevery = 1\n";

fn plan(text: &str) -> Plan {
    let spec = Spec::parse(text, "t.toml").unwrap_or_else(|e| panic!("{e:#}"));
    Plan::new(spec, RunDir::new("r"), PathBuf::from("bin")).unwrap()
}

#[test]
fn what_a_step_runs_comes_from_the_parsed_flags() {
    let r = plan(SPEC);
    assert!(!r.needs_ref() && !r.needs_old());
    // Mini-batches and epochs: update computes the old log-probs itself, no stage.
    let r = plan(&format!("{SPEC}[update]\nmini-batch-size = 16\n"));
    assert!(!r.needs_old());
    let r = plan(&format!(
        "{SPEC}[update]\nuse-kl-loss = true\nppo-epochs = 2\n"
    ));
    assert!(r.needs_ref() && !r.needs_old());
    let r = plan(&format!(
        "{SPEC}[update]\nrollout-rs = \"token\"\nmini-batch-size = 16\n"
    ));
    assert!(r.needs_old());
    let text = SPEC.replace(
        "estimator = \"grpo\"",
        "estimator = \"grpo\"\nkl-in-reward = true\nkl-ctrl = \"adaptive\"",
    );
    let r = plan(&text);
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
    r.check_commands(1).unwrap();
}

/// Which updates write files: every one in-process; with the daemon (one, or a group at
/// `gpus > 1`, under either shard mode) the cadence and the last step.
#[test]
fn updates_write_files_on_the_cadence_with_a_daemon() {
    let steps = |top: &str, update: &str| -> Vec<bool> {
        let text = SPEC.replace("steps = 2", &format!("steps = 5\n{top}"));
        let r = plan(&format!("{text}[checkpoint]\nevery = 2\n{update}"));
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
    plan(SPEC).check_commands(1).unwrap();
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
        let r = plan(&text);
        let err = r.check_commands(1).unwrap_err();
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
            let r = plan(&text);
            r.check_commands(1)
                .unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            // Their rewards resolve (a python: file imports and has its function).
            let score = &r.stages.score.args;
            let reward = crate::reward::RewardSpec::parse(&score.reward).unwrap();
            crate::pipeline::preflight::check_reward(&reward, &score.config().unwrap().options, "")
                .unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 3);
}

#[test]
fn round_seeds() {
    assert_eq!(round_seed(7, 3, 1), derive_seed(7, &[3, 1]));
    assert_ne!(round_seed(7, 3, 2), round_seed(7, 3, 1));
    assert_ne!(round_seed(7, 3, 2), round_seed(7, 4, 2));
}

/// Step `step`'s tasks as the dry run shows them: a stage's command line, or the runner's own
/// task as a comment.
fn lines(p: &Plan, step: u64) -> Vec<String> {
    p.step_tasks(step)
        .iter()
        .map(|t| format!("{}: {}", t.name, p.describe(step, t)))
        .collect()
}

/// The seeds of a step's rollout, evaluation and update (`[step, 1]`, `[step, 2]`, `[step, 3]`).
fn seeds(p: &Plan, step: u64) -> [u64; 3] {
    [1, 2, 3].map(|k| derive_seed(p.spec.seed, &[step, k]))
}

/// A GRPO spec without KL: prompts, rollout, score, advantage, update, sync, then the chores,
/// each stage reading what the one before it wrote.
#[test]
fn a_grpo_step_is_these_command_lines() {
    let p = plan(SPEC);
    let [roll, eval, upd] = seeds(&p, 1);
    assert_eq!(
        lines(&p, 1),
        [
            "prompts: # pipeline: sample 4 prompts of t.parquet into r/step-0001/prompts.parquet".to_string(),
            format!("rollout: bin/rollout --model r/policy --in r/step-0001/prompts.parquet --out r/step-0001/rollout.parquet --seed {roll} --step 1 --metrics r/step-0001/metrics/rollout.json"),
            "score: bin/score --in r/step-0001/rollout.parquet --out r/step-0001/scored.parquet --reward exact --metrics r/step-0001/metrics/score.json".into(),
            "advantage: bin/advantage --in r/step-0001/scored.parquet --out r/step-0001/adv.parquet --estimator grpo --metrics r/step-0001/metrics/advantage.json".into(),
            format!("update: bin/update --model r/policy --in r/step-0001/adv.parquet --out-model r/ckpt/step-0001 --seed {upd} --metrics r/step-0001/metrics/update.json"),
            "sync: bin/sync-weights --from r/ckpt/step-0001 --to r/policy --policy-version 1".into(),
            "prune: # pipeline: prune r/ckpt (keep every 0, last 1)".into(),
            format!("eval-rollout: bin/rollout --model r/policy --in v.parquet --out r/eval/step-0001/rollout.parquet --n 1 --top-k 1 --seed {eval}"),
            "eval-score: bin/score --in r/eval/step-0001/rollout.parquet --out r/eval/step-0001/scored.parquet --reward exact --metrics r/eval/step-0001/score.json".into(),
            "eval-summary: # pipeline: summarise r/eval/step-0001/scored.parquet into r/eval.jsonl".into(),
            "metrics: # pipeline: write step 1 to r/metrics.jsonl".into(),
        ]
    );
    // Without an evaluation that step, no eval tasks.
    let p = plan(&SPEC.replace("every = 1", "every = 2"));
    let names: Vec<&str> = p.step_tasks(1).iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        [
            "prompts",
            "rollout",
            "score",
            "advantage",
            "update",
            "sync",
            "prune",
            "metrics"
        ]
    );
}

/// Step 0 publishes the initial model as policy version 0 and evaluates it; without
/// `[eval] at-start`, it only publishes.
#[test]
fn step_zero_publishes_the_model_and_evaluates_it() {
    let p = plan(SPEC);
    let init: Vec<String> = p
        .init_tasks()
        .iter()
        .map(|t| format!("{}: {}", t.name, p.describe(0, t)))
        .collect();
    let eval = seeds(&p, 0)[1];
    assert_eq!(
        init,
        [
            "sync: bin/sync-weights --from m --to r/policy --policy-version 0".to_string(),
            format!("eval-rollout: bin/rollout --model r/policy --in v.parquet --out r/eval/step-0000/rollout.parquet --n 1 --top-k 1 --seed {eval}"),
            "eval-score: bin/score --in r/eval/step-0000/rollout.parquet --out r/eval/step-0000/scored.parquet --reward exact --metrics r/eval/step-0000/score.json".into(),
            "eval-summary: # pipeline: summarise r/eval/step-0000/scored.parquet into r/eval.jsonl".into(),
        ]
    );
    assert!(p.ends_step(0, &p.init_tasks()[3]) && !p.ends_step(0, &p.init_tasks()[0]));
    let p = plan(&SPEC.replace("every = 1\n", "every = 1\nat-start = false\n"));
    let names: Vec<&str> = p.init_tasks().iter().map(|t| t.name).collect();
    assert_eq!(names, ["sync"]);
    assert!(p.ends_step(0, &p.init_tasks()[0]));
}

/// A KL term in the reward with an adaptive controller: reference and old log-probs over the
/// scored batch in turn, the controller's state carried from the step before.
#[test]
fn kl_in_the_reward_adds_the_log_prob_passes() {
    let text = SPEC.replace(
        "estimator = \"grpo\"",
        "estimator = \"grpo\"\nkl-in-reward = true\nkl-ctrl = \"adaptive\"",
    );
    let p = plan(&text);
    assert_eq!(
        lines(&p, 2)[3..7],
        [
            "ref: bin/ref-logprob --model m --in r/step-0002/scored.parquet --out r/step-0002/ref.parquet --column ref_logprobs",
            "old: bin/ref-logprob --model r/policy --in r/step-0002/ref.parquet --out r/step-0002/old.parquet --column old_logprobs",
            "kl-state: # pipeline: copy r/step-0001/kl-state.json to r/step-0002/kl-state.json",
            "advantage: bin/advantage --in r/step-0002/old.parquet --out r/step-0002/adv.parquet --estimator grpo --kl-in-reward --kl-ctrl adaptive --kl-state r/step-0002/kl-state.json --metrics r/step-0002/metrics/advantage.json",
        ]
    );
    assert_eq!(
        lines(&p, 1)[5],
        "kl-state: # pipeline: start r/step-0001/kl-state.json afresh (the controller begins at --kl-coef)"
    );
}

/// A KL loss with a separate reference model: the ref pass reads that model, at the rollout's
/// temperature; `update` computes its old log-probs itself (no old pass).
#[test]
fn a_kl_loss_takes_the_reference_model() {
    let text = SPEC.replace("path = \"m\"", "path = \"m\"\nref = \"base\"");
    let p = plan(&format!(
        "{text}[rollout]\ntemperature = 0.7\n[update]\nuse-kl-loss = true\n"
    ));
    let names: Vec<&str> = p.step_tasks(1).iter().map(|t| t.name).collect();
    assert_eq!(
        names[..5],
        ["prompts", "rollout", "score", "ref", "advantage"]
    );
    assert_eq!(
        lines(&p, 1)[3..5],
        [
            "ref: bin/ref-logprob --model base --in r/step-0001/scored.parquet --out r/step-0001/ref.parquet --column ref_logprobs --temperature 0.7",
            "advantage: bin/advantage --in r/step-0001/ref.parquet --out r/step-0001/adv.parquet --estimator grpo --metrics r/step-0001/metrics/advantage.json",
        ]
    );
}

/// `gpus = 2` without the daemon: the model stages (the evaluation's rollout too) run under
/// `tandem launch`, the others as one process.
#[test]
fn gpus_run_the_model_stages_under_launch() {
    let p = plan(&SPEC.replace("steps = 2", "steps = 2\ngpus = 2\ndevice = \"cuda\""));
    let [roll, eval, upd] = seeds(&p, 1);
    let launch = "bin/tandem launch --nproc-per-node 2 --";
    assert_eq!(
        lines(&p, 1),
        [
            "prompts: # pipeline: sample 4 prompts of t.parquet into r/step-0001/prompts.parquet".to_string(),
            format!("rollout: {launch} bin/rollout --model r/policy --in r/step-0001/prompts.parquet --out r/step-0001/rollout.parquet --seed {roll} --step 1 --metrics r/step-0001/metrics/rollout.json --device cuda"),
            "score: bin/score --in r/step-0001/rollout.parquet --out r/step-0001/scored.parquet --reward exact --metrics r/step-0001/metrics/score.json".into(),
            "advantage: bin/advantage --in r/step-0001/scored.parquet --out r/step-0001/adv.parquet --estimator grpo --metrics r/step-0001/metrics/advantage.json".into(),
            format!("update: {launch} bin/update --model r/policy --in r/step-0001/adv.parquet --out-model r/ckpt/step-0001 --seed {upd} --metrics r/step-0001/metrics/update.json --device cuda"),
            "sync: bin/sync-weights --from r/ckpt/step-0001 --to r/policy --policy-version 1".into(),
            "prune: # pipeline: prune r/ckpt (keep every 0, last 1)".into(),
            format!("eval-rollout: {launch} bin/rollout --model r/policy --in v.parquet --out r/eval/step-0001/rollout.parquet --n 1 --top-k 1 --seed {eval} --device cuda"),
            "eval-score: bin/score --in r/eval/step-0001/rollout.parquet --out r/eval/step-0001/scored.parquet --reward exact --metrics r/eval/step-0001/score.json".into(),
            "eval-summary: # pipeline: summarise r/eval/step-0001/scored.parquet into r/eval.jsonl".into(),
            "metrics: # pipeline: write step 1 to r/metrics.jsonl".into(),
        ]
    );
    assert_eq!(
        p.bins_needed(&p.remaining(&State::default()))[0],
        "sync-weights"
    );
}

/// `daemon = true`: the model stages and sync are clients of the run's daemon; update keeps
/// the policy resident except on the checkpoint cadence and at the last step. With `gpus = 2`
/// the daemon is a group under `tandem launch`, and the stages are not launched themselves.
#[test]
fn the_daemon_serves_the_model_stages() {
    let text = SPEC.replace("steps = 2", "steps = 3\ndaemon = true\ndevice = \"cuda\"");
    let p = plan(&format!("{text}[checkpoint]\nevery = 2\n"));
    let [roll, eval, upd] = seeds(&p, 1);
    let client = "--device cuda --daemon r/daemon.sock";
    assert_eq!(
        lines(&p, 1),
        [
            "prompts: # pipeline: sample 4 prompts of t.parquet into r/step-0001/prompts.parquet".to_string(),
            format!("rollout: bin/rollout --model r/policy --in r/step-0001/prompts.parquet --out r/step-0001/rollout.parquet --seed {roll} --step 1 --metrics r/step-0001/metrics/rollout.json {client}"),
            "score: bin/score --in r/step-0001/rollout.parquet --out r/step-0001/scored.parquet --reward exact --metrics r/step-0001/metrics/score.json".into(),
            "advantage: bin/advantage --in r/step-0001/scored.parquet --out r/step-0001/adv.parquet --estimator grpo --metrics r/step-0001/metrics/advantage.json".into(),
            format!("update: bin/update --model r/policy --in r/step-0001/adv.parquet --out-model r/ckpt/step-0001 --seed {upd} --metrics r/step-0001/metrics/update.json --resident {client}"),
            "sync: bin/sync-weights --from r/ckpt/step-0001 --to r/policy --policy-version 1 --daemon r/daemon.sock".into(),
            "prune: # pipeline: prune r/ckpt (keep every 2, last 1)".into(),
            format!("eval-rollout: bin/rollout --model r/policy --in v.parquet --out r/eval/step-0001/rollout.parquet --n 1 --top-k 1 --seed {eval} {client}"),
            "eval-score: bin/score --in r/eval/step-0001/rollout.parquet --out r/eval/step-0001/scored.parquet --reward exact --metrics r/eval/step-0001/score.json".into(),
            "eval-summary: # pipeline: summarise r/eval/step-0001/scored.parquet into r/eval.jsonl".into(),
            "metrics: # pipeline: write step 1 to r/metrics.jsonl".into(),
        ]
    );
    let update = |p: &Plan, step| p.describe(step, &p.step_tasks(step)[4]);
    // On the cadence (2) and at the last step (3), the update writes its checkpoint.
    for step in [2, 3] {
        let [_, _, upd] = seeds(&p, step);
        assert_eq!(
            update(&p, step),
            format!("bin/update --model r/policy --in r/step-000{step}/adv.parquet --out-model r/ckpt/step-000{step} --seed {upd} --metrics r/step-000{step}/metrics/update.json {client}")
        );
    }
    assert!(p.daemon_launch_prefix(Side::Train).is_empty());
    assert_eq!(
        p.daemon_sockets(Side::Train),
        [PathBuf::from("r/daemon.sock")]
    );
    assert_eq!(p.bins_needed(&[]), ["tandem"]);
    let text = text.replace("steps = 3", "steps = 3\ngpus = 2");
    let p = plan(&format!("{text}[checkpoint]\nevery = 2\n"));
    assert!(update(&p, 1).starts_with("bin/update --model r/policy"));
    assert!(update(&p, 1).ends_with(&format!("--resident {client}")));
    assert_eq!(
        p.daemon_launch_prefix(Side::Train),
        ["launch", "--nproc-per-node", "2", "--", "bin/tandem"]
    );
    assert_eq!(p.daemon_sockets(Side::Train).len(), 2);
    assert_eq!(
        p.daemon_sockets(Side::Train)[0],
        PathBuf::from("r/daemon.sock")
    );
}

/// A resumed run plans what is left: step 0 only while it is not done, the step in progress
/// without its finished tasks, then the later steps; nothing once every step is done.
#[test]
fn a_resumed_run_skips_the_finished_tasks() {
    let p = plan(SPEC);
    let plan_of = |state: &State| -> Vec<(u64, &'static str)> {
        p.remaining(state)
            .iter()
            .map(|(s, t)| (*s, t.name))
            .collect()
    };
    let fresh = plan_of(&State::default());
    assert_eq!(fresh.len(), 4 + 2 * 11);
    assert_eq!(
        fresh[..5],
        [
            (0, "sync"),
            (0, "eval-rollout"),
            (0, "eval-score"),
            (0, "eval-summary"),
            (1, "prompts")
        ]
    );
    // Step 0 stopped after its sync.
    let mut state = State::default();
    state.progress(0).done = vec!["sync".into()];
    assert_eq!(plan_of(&state)[0], (0, "eval-rollout"));
    // Step 1 stopped after its score.
    let mut state = State {
        init_done: true,
        ..State::default()
    };
    state.progress(1).done = vec!["prompts".into(), "rollout".into(), "score".into()];
    let left = plan_of(&state);
    assert_eq!(left[..2], [(1, "advantage"), (1, "update")]);
    assert_eq!(left.len(), 8 + 11);
    assert_eq!(left[8], (2, "prompts"));
    // A record of another step than the next skips nothing of the next.
    state.progress(2).done = vec!["prompts".into()];
    assert_eq!(plan_of(&state)[0], (1, "prompts"));
    state.steps_done = 1;
    assert_eq!(plan_of(&state)[0], (2, "rollout"));
    state.steps_done = 2;
    state.current = None;
    assert!(plan_of(&state).is_empty());
}

/// `[algorithm] filter-groups`: sampling is one task of the runner (its rounds run inside
/// it); round 1's commands read and write `step-000K/round-1/` with the plain step's seed.
#[test]
fn dynamic_sampling_is_one_task_with_rounds() {
    let p = plan(&format!("{SPEC}[algorithm]\nfilter-groups = true\n"));
    let names: Vec<&str> = p.step_tasks(1).iter().map(|t| t.name).collect();
    assert_eq!(names[..3], ["sample", "advantage", "update"]);
    let roll = seeds(&p, 1)[0];
    let round1 = [
        format!("bin/rollout --model r/policy --in r/step-0001/round-1/prompts.parquet --out r/step-0001/round-1/rollout.parquet --seed {roll} --step 1 --metrics r/step-0001/round-1/metrics/rollout.json"),
        "bin/score --in r/step-0001/round-1/rollout.parquet --out r/step-0001/round-1/scored.parquet --reward exact --metrics r/step-0001/round-1/metrics/score.json".into(),
    ];
    let got: Vec<String> = p
        .first_round_tasks(1)
        .iter()
        .map(|t| p.describe(1, t))
        .collect();
    assert_eq!(got, round1);
    let described = p.describe(1, &p.step_tasks(1)[0]);
    assert!(
        described.starts_with("# pipeline: dynamic sampling: rounds of 4 prompts of t.parquet into r/step-0001/round-R/ until 4 groups have a varying"),
        "{described}"
    );
    assert!(described.ends_with(&format!("Round 1:\n{}\n{}", round1[0], round1[1])));
    // Round 2 on draws another seed.
    let files = round_files(&p.run, 1, 2);
    let [rollout, _] = p.sample_tasks(1, &files, round_seed(p.spec.seed, 1, 2));
    assert!(p
        .describe(1, &rollout)
        .contains("--in r/step-0001/round-2/prompts.parquet"));
    assert!(plan(SPEC).first_round_tasks(1).is_empty());
}

/// PPO with a critic: `values` before `advantage`, the critic's `update --critic` after it
/// (from the initial critic, then the previous step's), and the policy's update only after
/// `critic-warmup` steps; with `daemon = true` the critic's stages go to the daemon, which
/// keeps the critic resident between checkpoints (step 1) and writes it at the last step.
#[test]
fn a_critic_adds_values_and_its_update_and_warms_up_first() {
    let text = SPEC
        .replace("estimator = \"grpo\"", "estimator = \"gae\"")
        .replace("steps = 2", "steps = 2\ndaemon = true")
        + "[critic]\nmodel = \"c0\"\ncritic-warmup = 1\nlr = 1e-5\ncliprange-value = 0.2\n";
    let r = plan(&text);
    let names = |s: u64| -> Vec<&str> { r.step_tasks(s).iter().map(|t| t.name).collect() };
    let critic_steps = ["values", "advantage", "critic"];
    assert_eq!(names(1)[3..6], critic_steps);
    assert!(!names(1).contains(&"update") && !names(1).contains(&"sync"));
    assert_eq!(
        names(2)[3..8],
        ["values", "advantage", "critic", "update", "sync"]
    );
    let args = |s: u64, name: &str| -> Vec<String> {
        let t = r
            .step_tasks(s)
            .into_iter()
            .find(|t| t.name == name)
            .unwrap();
        match t.action {
            Action::Stage { args, .. } => args,
            _ => unreachable!(),
        }
    };
    let v1 = args(1, "values");
    assert_eq!(
        v1[..6],
        [
            "--model",
            "c0",
            "--in",
            "r/step-0001/scored.parquet",
            "--out",
            "r/step-0001/values.parquet"
        ]
    );
    assert!(v1.contains(&"--daemon".to_string()));
    let c1 = args(1, "critic");
    assert!(c1.contains(&"--daemon".to_string()) && c1.contains(&"--resident".to_string()));
    let a1 = args(1, "advantage");
    assert_eq!(a1[1], "r/step-0001/values.parquet");
    let c2 = args(2, "critic");
    assert_eq!(
        c2[..6],
        [
            "--model",
            "r/critic/step-0001",
            "--in",
            "r/step-0002/adv.parquet",
            "--out-model",
            "r/critic/step-0002"
        ]
    );
    for flag in [
        "--critic",
        "--lr",
        "0.00001",
        "--cliprange-value",
        "0.2",
        "--metrics",
    ] {
        assert!(c2.contains(&flag.to_string()), "{c2:?}");
    }
    assert!(c2.contains(&"--daemon".to_string()) && !c2.contains(&"--resident".to_string()));
    assert_eq!(args(2, "values")[1], "r/critic/step-0001");
    r.check_commands(1).unwrap();
    r.check_commands(2).unwrap();
    // The critic's model defaults to the policy's; `critic` itself is the runner's.
    let r = plan(
        &SPEC
            .replace("estimator = \"grpo\"", "estimator = \"gae\"")
            .replace("[eval]", "[critic]\n[eval]"),
    );
    assert_eq!(r.critic_in(1), PathBuf::from("m"));
    let e = Spec::parse(&format!("{text}critic = true\n"), "t.toml").unwrap_err();
    assert!(e.to_string().contains("the pipeline runner sets it"), "{e}");
}
