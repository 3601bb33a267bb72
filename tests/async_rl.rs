//! Disaggregated RL on CPU ranks (`[placement]`, docs/DISTRIBUTED.md): the weight transfer
//! from a training daemon (group) to a rollout daemon group leaves the rollout ranks with
//! exactly the weights a rollout loads from the trainer's checkpoint; a placed run in
//! synchronous mode writes the colocated run's files; one step off-policy is deterministic,
//! samples step k's rows with the policy one version behind (with dynamic sampling too), and
//! resumes after SIGKILL; bad
//! `[placement]` specs are refused naming the key.

use crate::dp::{ctl_with, same_rows, DaemonGroup};
use crate::stage_util::*;
use std::path::Path;
use tandem::model::safetensors::round_bf16;
use tandem::model::ModelDir;

/// One step of GRPO-shaped training data: a rollout of `model` over three prompts with
/// advantages (+1/−1 rows), in `d/adv.parquet`; the prompts in `d/prompts.parquet`.
fn batch_to_train(d: &Path) {
    prompts(
        &d.join("prompts.parquet"),
        &["What is 2 + 3?", "Name a colour.", "Say hello."],
    );
    let r = d.join("r.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&d.join("model")),
            "--in",
            p(&d.join("prompts.parquet")),
            "--out",
            p(&r),
            "--n",
            "2",
            "--max-new-tokens",
            "5",
            "--raw-prompt",
            "--seed",
            "4",
        ],
    );
    add_advantages(&r, &d.join("adv.parquet"));
}

/// `tandem daemon-ctl --socket SOCKET ARGS` that must succeed; its stderr.
fn ctl_ok(socket: &Path, args: &[&str]) -> String {
    let o = ctl_with(socket, args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "daemon-ctl {args:?}: {err}");
    err
}

/// `update --daemon SOCKET` of `model` on `d/adv.parquet` into `out`.
fn update_on(socket: &Path, model: &Path, d: &Path, out: &Path) {
    ok(
        "update",
        &[
            "--model",
            p(model),
            "--in",
            p(&d.join("adv.parquet")),
            "--out-model",
            p(out),
            "--lr",
            "0.01",
            "--daemon",
            p(socket),
        ],
    );
}

/// `daemon-ctl transfer` of `model` from the group at `from` to the `receivers` ranks at
/// `to`: its log and metrics.
fn transfer(from: &Path, to: &Path, model: &Path, receivers: usize) -> (String, serde_json::Value) {
    transfer_with(from, to, model, receivers, &[])
}

/// [`transfer`] with more flags.
fn transfer_with(
    from: &Path,
    to: &Path,
    model: &Path,
    receivers: usize,
    extra: &[&str],
) -> (String, serde_json::Value) {
    let metrics = model.with_extension("transfer.json");
    let receivers = receivers.to_string();
    let mut args = vec![
        "transfer",
        "--to",
        p(to),
        "--model",
        p(model),
        "--receivers",
        &receivers,
        "--bucket-mb",
        "1",
        "--metrics",
        p(&metrics),
    ];
    args.extend_from_slice(extra);
    let log = ctl_ok(from, &args);
    assert!(log.contains("transfer: received"), "{log}");
    let m = serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    (log, m)
}

/// The rollout group at `socket` holds `ck`'s weights (saved by `daemon-ctl save`) as a
/// rollout loads them: every tensor bf16-rounded, bit for bit. Returns the elements.
fn holds_checkpoint(d: &Path, socket: &Path, ck: &Path) -> usize {
    let saved = d.join("saved");
    let _ = std::fs::remove_dir_all(&saved);
    ctl_ok(socket, &["save", "--out", p(&saved), "--model", p(ck)]);
    let (_, want) = ModelDir::load(ck).unwrap();
    let (_, got) = ModelDir::load(&saved).unwrap();
    assert_eq!(want.len(), got.len());
    let mut elements = 0;
    for (name, t) in &want {
        let bits = |v: &[f32], round: bool| -> Vec<u32> {
            v.iter()
                .map(|x| if round { round_bf16(*x) } else { *x }.to_bits())
                .collect()
        };
        assert!(
            bits(&got[name].data, false) == bits(&t.data, true),
            "{name} differs from {}'s bf16 weights",
            ck.display()
        );
        elements += t.data.len();
    }
    elements
}

/// The training daemon (one rank, or a group of `train` ranks) trains a checkpoint; the
/// transfer sends it to a rollout group of `rollout` ranks; their weights (saved by
/// `daemon-ctl save`) are the checkpoint's as a rollout loads them (bf16-rounded, bit for
/// bit), their rollout is an in-process rollout of the checkpoint (no reload), and the
/// metrics say what moved. The next transfer goes over the bridge the first one made; one over
/// a kept bridge that broke runs again on a new one; one to a new rollout group meets on a new
/// one.
fn transfer_case(train: usize, rollout: usize) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    batch_to_train(d);
    let model = d.join("model");
    let (ts, rs) = (d.join("t.sock"), d.join("r.sock"));
    // Each group loses its kept bridge once, when armed (below), as if it broke.
    let (broken, broken_t) = (d.join("broke-bridge"), d.join("broke-bridge-t"));
    for marker in [&broken, &broken_t] {
        std::fs::write(marker, "not yet\n").unwrap();
    }
    let env = [("TANDEM_DAEMON_BREAK_BRIDGE", broken_t.as_path())];
    let _train = DaemonGroup::start_with_env(d, (train, &ts), &model, &[], &env);
    let env = [("TANDEM_DAEMON_BREAK_BRIDGE", broken.as_path())];
    let roll = DaemonGroup::start_with_env(d, (rollout, &rs), &model, &[], &env);
    let ck = d.join("ck");
    update_on(&ts, &model, d, &ck);
    let (log, m) = transfer(&ts, &rs, &ck, rollout);
    assert!(log.contains("over a new bridge"), "{log}");
    let elements = holds_checkpoint(d, &rs, &ck);
    // The trainer's own tensors moved: it did change them.
    let (_, initial) = ModelDir::load(&model).unwrap();
    let (_, want) = ModelDir::load(&ck).unwrap();
    assert!(want.iter().any(|(n, t)| t.data != initial[n].data));
    assert_eq!(m["policy_version"], 0, "{m}");
    assert_eq!(m["receivers"], rollout, "{m}");
    assert_eq!(m["bridge_reused"], 0, "{m}");
    assert!(m["bridge_seconds"].as_f64().unwrap() > 0.0, "{m}");
    // On the CPU an element travels as f32.
    let moved = m["elements"].as_u64().unwrap() as usize;
    assert!(moved >= elements - 64 * 300, "{m}: {elements}");
    assert_eq!(m["bytes"].as_u64().unwrap() as usize, 4 * moved, "{m}");
    assert!(m["buckets"].as_u64().unwrap() >= 1, "{m}");
    assert!(m["gb_per_s"].as_f64().unwrap() > 0.0, "{m}");
    // The rollout group generates with what it received: the rows of an in-process rollout
    // of the checkpoint, with no load.
    let args = |out: &Path| {
        vec![
            "--model".to_string(),
            p(&ck).to_string(),
            "--in".into(),
            p(&d.join("prompts.parquet")).into(),
            "--out".into(),
            p(out).into(),
            "--n".into(),
            "2".into(),
            "--max-new-tokens".into(),
            "5".into(),
            "--raw-prompt".into(),
            "--seed".into(),
            "9".into(),
        ]
    };
    let (here, there) = (d.join("here.parquet"), d.join("there.parquet"));
    ok("rollout", &args(&here));
    let mut remote = args(&there);
    let rm = d.join("there.json");
    remote.extend([
        "--daemon".into(),
        p(&rs).into(),
        "--metrics".into(),
        p(&rm).into(),
    ]);
    ok("rollout", &remote);
    same_rows(&read(&here), &read(&there), "rollout after the transfer");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rm).unwrap()).unwrap();
    assert_eq!(m["daemon"]["reloaded"], false, "{m}");
    // The next step's weights go over the kept bridge, with the same result.
    let ck2 = d.join("ck2");
    update_on(&ts, &ck, d, &ck2);
    let (log, m) = transfer(&ts, &rs, &ck2, rollout);
    assert!(log.contains("over the kept bridge"), "{log}");
    assert_eq!(
        (&m["bridge_reused"], &m["bridge_seconds"]),
        (&1.into(), &0.0.into()),
        "{m}"
    );
    holds_checkpoint(d, &rs, &ck2);
    // A kept bridge that breaks after `daemon-ctl` saw it working, at a receiver and then at
    // the sender: the transfer over it fails at once (neither end waits at a rendezvous the
    // other will not come to), and runs again on a new one.
    for marker in [&broken, &broken_t] {
        std::fs::remove_file(marker).unwrap();
        let t = std::time::Instant::now();
        let (log, m) = transfer(&ts, &rs, &ck2, rollout);
        assert!(marker.exists(), "{}: {log}", marker.display());
        assert!(
            log.contains("over the kept bridge: ") && log.contains("again on a new one"),
            "{log}"
        );
        assert!(t.elapsed().as_secs() < 20, "{:?}: {log}", t.elapsed());
        assert_eq!(m["bridge_reused"], 0, "{m}");
        holds_checkpoint(d, &rs, &ck2);
    }
    // --fresh-bridge: a new bridge, ended after the transfer (no group keeps one).
    let (log, m) = transfer_with(&ts, &rs, &ck2, rollout, &["--fresh-bridge"]);
    assert!(log.contains("over a new bridge"), "{log}");
    assert_eq!(m["bridge_reused"], 0, "{m}");
    holds_checkpoint(d, &rs, &ck2);
    for socket in [&ts, &rs] {
        let o = ctl_with(socket, &["status"]);
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(st["resident"]["bridge"].is_null(), "{st}");
    }
    // A new rollout group (the old one gone, as after a restart) meets the trainer on a new
    // bridge.
    drop(roll);
    let rs2 = d.join("r2.sock");
    let _roll = DaemonGroup::start(d, rollout, &rs2, &model, &[]);
    let (log, m) = transfer(&ts, &rs2, &ck2, rollout);
    assert!(
        log.contains("over a new bridge") && !log.contains("again on a new one"),
        "{log}"
    );
    assert_eq!(m["bridge_reused"], 0, "{m}");
    holds_checkpoint(d, &rs2, &ck2);
}

#[test]
fn a_transfer_gives_one_rollout_rank_the_trainers_weights() {
    transfer_case(1, 1);
}

#[test]
fn a_transfer_from_a_group_of_two_gives_every_rollout_rank_the_weights() {
    transfer_case(2, 2);
}

const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");

/// A three-step GRPO spec on the warm daemon(s), every step's checkpoint written as files (so
/// a rerun after a kill loses only the step in flight), with `top` at its top level and
/// `tables` at its end.
fn spec(top: &str, tables: &str) -> String {
    format!(
        r#"
seed = 5
steps = 3
daemon = true
{top}
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 3
[rollout]
n = 2
max-new-tokens = 6
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.001
rollout-is = "token"
[checkpoint]
every = 1
keep-last = 3
{tables}"#
    )
}

/// `[placement]` with `rollout` and `train` GPUs and `mode`.
fn placed(rollout: &str, train: &str, mode: &str) -> String {
    spec(
        "gpus = 3",
        &format!(
            "[placement]\nrollout-gpus = {rollout}\ntrain-gpus = {train}\nmode = \"{mode}\"\n"
        ),
    )
}

/// `pipeline run NAME.toml --run-dir NAME` in `d`, the spec `text` written first (when given).
fn pipeline(
    d: &Path,
    name: &str,
    text: Option<&str>,
    env: &[(&str, &str)],
) -> std::process::Command {
    if let Some(text) = text {
        std::fs::write(d.join(format!("{name}.toml")), text).unwrap();
    }
    let bins = Path::new(PIPELINE).parent().unwrap();
    let mut c = std::process::Command::new(PIPELINE);
    c.current_dir(d)
        .args(["run", &format!("{name}.toml"), "--run-dir", name])
        .env("TANDEM_BIN_DIR", bins)
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("TANDEM_DAEMON")
        .envs(env.iter().copied());
    c
}

/// The pipeline `name` with spec `text` is refused before anything runs: exit 2, no run
/// directory. Returns its stderr.
fn refused(d: &Path, name: &str, text: &str) -> String {
    let o = pipeline(d, name, Some(text), &[]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!d.join(name).exists(), "{err}");
    err
}

/// Runs the pipeline to its end; its stderr.
fn pipeline_ok(d: &Path, name: &str, text: Option<&str>, env: &[(&str, &str)]) -> String {
    let o = pipeline(d, name, text, env).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{name}: {err}");
    err
}

/// Two runs sampled the same rows at every step and ended with the same checkpoints, bit for
/// bit.
fn same_run(d: &Path, a: &str, b: &str) {
    for step in 1..=3 {
        let f = |run: &str| read(&d.join(format!("{run}/step-000{step}/rollout.parquet")));
        same_rows(&f(a), &f(b), &format!("step {step}: {a} and {b}"));
    }
    let (ca, cb) = (
        crate::pipeline::checkpoint_files(&d.join(a)),
        crate::pipeline::checkpoint_files(&d.join(b)),
    );
    assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
    assert_eq!(ca.len(), 3 * ca.len() / 3);
    for (k, v) in &ca {
        assert!(v == &cb[k], "{k} differs between {a} and {b}");
    }
}

/// The `policy_version` each step's rollout was sampled with.
fn versions(d: &Path, run: &str) -> Vec<Option<u64>> {
    (1..=3)
        .map(|s| {
            read(&d.join(format!("{run}/step-000{s}/rollout.parquet"))).meta_u64("policy_version")
        })
        .collect()
}

/// The metrics.jsonl lines of a run.
fn metrics(d: &Path, run: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(d.join(run).join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Synchronous placement (1 rollout + 1 training daemon) is the colocated run on two daemons:
/// the same samples at every step and the same checkpoints, bit for bit (the rollout group
/// generates with the bf16 weights the colocated daemon generates with). Each step's transfer
/// is in its metrics (the bridge kept after the first), and the rollouts went to the rollout
/// group's socket.
#[test]
fn synchronous_placement_writes_the_colocated_runs_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    pipeline_ok(d, "colocated", Some(&spec("", "")), &[]);
    pipeline_ok(d, "placed", Some(&placed("[0]", "[1]", "sync")), &[]);
    same_run(d, "colocated", "placed");
    assert_eq!(versions(d, "placed"), [Some(0), Some(1), Some(2)]);
    // The first step's transfer made the bridge; the later ones went over it.
    for (i, m) in metrics(d, "placed").iter().enumerate() {
        assert!(m["transfer/gb_per_s"].as_f64().unwrap() > 0.0, "{m}");
        assert_eq!(m["transfer/receivers"], 1, "{m}");
        assert!(m["transfer/bytes"].as_u64().unwrap() > 0, "{m}");
        assert_eq!(m["transfer/bridge_reused"], u8::from(i > 0), "{m}");
    }
    let commands = std::fs::read_to_string(d.join("placed/commands.sh")).unwrap();
    let rollouts: Vec<&str> = commands
        .lines()
        .filter(|l| l.contains("/rollout "))
        .collect();
    assert_eq!(rollouts.len(), 3, "{commands}");
    assert!(
        rollouts.iter().all(|l| l.contains("placed/rollout.sock")),
        "{commands}"
    );
    let transfers = commands
        .lines()
        .filter(|l| l.contains(" daemon-ctl ") && l.contains(" transfer "))
        .count();
    assert_eq!(transfers, 3, "{commands}");
    // A bad [placement] is refused before anything runs: exit 2 naming the key and its line.
    let bad = placed("[0, 1]", "[1, 2]", "sync");
    let err = refused(d, "bad", &bad);
    assert!(
        err.contains("bad.toml:28:")
            && err.contains("[placement] train-gpus: GPU 1 is in rollout-gpus too"),
        "{err}"
    );
}

/// GRPO-LoRA placed (1 rollout + 1 training rank): the transfer carries the policy's merged
/// generation weights, so the synchronous run writes the colocated daemon run's rollouts and
/// adapter checkpoints bit for bit; one step off samples with the policy one version behind
/// (0, 0, 1) and two runs write the same files; async mode trains its steps within the
/// staleness bound; `lora-mode = "unmerged"` is refused.
#[test]
fn lora_runs_placed_in_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let lora =
        |text: String| text.replace("[update]\n", "[update]\nlora-rank = 4\nlora-alpha = 8\n");
    pipeline_ok(d, "colocated", Some(&lora(spec("", ""))), &[]);
    pipeline_ok(d, "sync", Some(&lora(placed("[0]", "[1]", "sync"))), &[]);
    same_run(d, "colocated", "sync");
    // The rollout group generates with the merged weights the transfer carries: unmerged
    // generation is refused before anything runs.
    let um = lora(placed("[0]", "[1]", "sync"))
        .replace("[rollout]\n", "[rollout]\nlora-mode = \"unmerged\"\n");
    let err = refused(d, "um", &um);
    assert!(
        err.contains("[placement] does not take [rollout] lora-mode = \"unmerged\""),
        "{err}"
    );
    let adapters = crate::pipeline::checkpoint_files(&d.join("sync"));
    assert!(
        adapters
            .keys()
            .any(|k| k.ends_with("adapter_model.safetensors")),
        "{:?}",
        adapters.keys()
    );
    let off = lora(placed("[0]", "[1]", "one-step-off"));
    pipeline_ok(d, "a", Some(&off), &[]);
    assert_eq!(versions(d, "a"), [Some(0), Some(0), Some(1)]);
    pipeline_ok(d, "b", Some(&off), &[]);
    same_run(d, "a", "b");
    let text = format!(
        "{}max-staleness = 1\nround-tokens = 2\n",
        placed("[0]", "[1]", "async")
    );
    pipeline_ok(d, "async", Some(&lora(text)), &[]);
    for (i, m) in metrics(d, "async").iter().enumerate() {
        let trained = i as u64;
        let rows = token_versions(&read(
            &d.join(format!("async/step-000{}/rollout.parquet", i + 1)),
        ));
        assert!(
            rows.iter()
                .flatten()
                .all(|&v| v <= trained && v + 1 >= trained),
            "step {}: {rows:?} {m}",
            i + 1
        );
    }
}

/// One step off-policy with 1 rollout + 2 training ranks: step k's rollout ran beside step
/// k − 1's update and sampled with the policy one version behind (versions 0, 0, 1 where the
/// synchronous run has 0, 1, 2); a second run writes the same files; a rollout rank killed in
/// step 3's rollout, and the runner killed during step 2's update, both end where the
/// undisturbed run ends, and say what they lost.
#[test]
fn one_step_off_is_one_version_behind_deterministic_and_resumable() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let text = placed("[0]", "[1, 2]", "one-step-off");
    pipeline_ok(d, "a", Some(&text), &[]);
    assert_eq!(versions(d, "a"), [Some(0), Some(0), Some(1)]);
    let commands = std::fs::read_to_string(d.join("a/commands.sh")).unwrap();
    // The update and the next step's rollout start together, then the runner waits for both.
    let lines: Vec<&str> = commands.lines().collect();
    let overlaps = lines
        .windows(3)
        .filter(|w| {
            w[0].contains("run at once (one-step-off)")
                && w[1].contains("/update ")
                && w[2].contains("/rollout ")
        })
        .count();
    assert_eq!(overlaps, 2, "{commands}");
    for m in metrics(d, "a") {
        assert!(m["transfer/gb_per_s"].as_f64().unwrap() > 0.0, "{m}");
    }
    overlap_times(&metrics(d, "a"));
    pipeline_ok(d, "b", Some(&text), &[]);
    same_run(d, "a", "b");

    // A rollout rank dies in step 3's rollout (sampled with version 1): the group is started
    // again, gets the current policy by a transfer, and the rollout runs again.
    rollout_rank_dies(d, &text, "rollout");

    // A training rank dies in step 2's update (beside step 3's rollout): the update runs again
    // alone on a new training group, from step 1's checkpoint files.
    let marker = d.join("killed-update");
    let log = pipeline_ok(
        d,
        "train-rank",
        Some(&text),
        &[
            ("TANDEM_DAEMON_KILL_IN_UPDATE", p(&marker)),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
        ],
    );
    assert!(marker.exists(), "the training rank was not killed: {log}");
    assert!(log.contains("update failed with the daemon gone"), "{log}");
    same_run(d, "a", "train-rank");

    // The runner SIGKILLed while step 2's update and step 3's rollout run: the rerun continues
    // after step 1 (step 2 is the step lost) and ends as the undisturbed run.
    runner_killed_after(d, &text, "step-0002/adv.parquet");
}

/// Run "rank" of `text` (3 steps, run "a" undisturbed): a rollout rank dies in the rollout
/// that samples step 3 (task `task` of the log); the group is started again and gets the
/// current policy by a transfer, the task runs again, and the run ends as "a".
fn rollout_rank_dies(d: &Path, text: &str, task: &str) {
    let marker = d.join("killed-rollout");
    let log = pipeline_ok(
        d,
        "rank",
        Some(text),
        &[
            ("TANDEM_DAEMON_KILL_IN_ROLLOUT", p(&marker)),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
        ],
    );
    assert!(marker.exists(), "the rollout rank was not killed: {log}");
    assert!(
        log.contains(&format!("{task} failed with the daemon gone")),
        "{log}"
    );
    assert!(
        log.contains("the rollout group (re)started; sending it the current policy"),
        "{log}"
    );
    same_run(d, "a", "rank");
}

/// Run "runner" of `text`, its runner SIGKILLed in step 2 once `file` of the run exists: the
/// rerun continues after step 1 and ends as the undisturbed run "a".
fn runner_killed_after(d: &Path, text: &str, file: &str) {
    std::fs::write(d.join("runner.toml"), text).unwrap();
    let at = d.join("runner").join(file);
    crate::pipeline::kill_when(pipeline(d, "runner", None, &[]), file, &mut |_| at.exists());
    let log = pipeline_ok(d, "runner", None, &[]);
    assert!(log.contains("continuing runner after step 1"), "{log}");
    same_run(d, "a", "runner");
}

/// `mode = "async"`'s keys are checked before anything runs: exit 2 naming the key and its
/// line, no run directory; dynamic sampling's `prompts-per-round` is refused in the mode.
#[test]
fn async_mode_keys_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases = [
        (
            "max-staleness = 0",
            "bad.toml:30:",
            "[placement] max-staleness must be at least 1",
        ),
        (
            "round-tokens = 0",
            "bad.toml:30:",
            "[placement] round-tokens must be at least 1",
        ),
        ("max-staleness = \"two\"", "bad.toml:", "max-staleness"),
        (
            "[algorithm]\nfilter-groups = true\nprompts-per-round = 4",
            "bad.toml:32:",
            "[algorithm] prompts-per-round has no meaning with [placement] mode = \"async\"",
        ),
    ];
    for (keys, at, want) in cases {
        let text = format!("{}{keys}\n", placed("[0]", "[1]", "async"));
        let err = refused(d, "bad", &text);
        assert!(err.contains(at) && err.contains(want), "{keys}: {err}");
    }
    // The keys belong to the mode.
    let text = format!("{}round-tokens = 4\n", placed("[0]", "[1]", "one-step-off"));
    let err = refused(d, "bad", &text);
    assert!(
        err.contains("[placement] round-tokens is a key of mode = \"async\""),
        "{err}"
    );
}

/// Versions of each row's tokens.
fn token_versions(b: &tandem::batch::Batch) -> Vec<Vec<u64>> {
    let v = b.ragged_i32("token_policy_version").unwrap();
    (0..b.num_rows())
        .map(|i| v.row(i).iter().map(|&x| x as u64).collect())
        .collect()
}

/// A four-step `mode = "async"` spec on `rollout` and `train` GPUs, rounds of 2 tokens,
/// responses up to 16 and max-staleness = 1.
fn async_spec(rollout: &str, train: &str) -> String {
    format!(
        "{}max-staleness = 1\nround-tokens = 2\n",
        placed(rollout, train, "async")
            .replace("steps = 3", "steps = 4")
            .replace("keep-last = 3", "keep-last = 4")
            // Rewards that vary within a group, so that each update moves the weights.
            .replace(
                "reward = \"exact\"",
                "reward = \"regex:[a-z]\"\nformat-score = 1.0"
            )
            .replace("lr = 0.001", "lr = 0.01")
            // Responses of up to 8 rounds: groups stay in flight across updates.
            .replace("max-new-tokens = 6", "max-new-tokens = 16")
    )
}

/// Every step of an async run `run` trained 6 rows whose tokens lie within max-staleness = 1
/// of the policy trained; the metrics.jsonl lines.
fn within_bound(d: &Path, run: &str) -> Vec<serde_json::Value> {
    let lines = metrics(d, run);
    assert_eq!(lines.len(), 4, "{run}: {lines:?}");
    for step in 1..=4u64 {
        let rollout = read(&d.join(format!("{run}/step-000{step}/rollout.parquet")));
        let rows = token_versions(&rollout);
        assert_eq!(rows.len(), 6);
        let trained = step - 1;
        assert!(
            rows.iter()
                .flatten()
                .all(|&v| v <= trained && v + 1 >= trained),
            "{run} step {step}: {rows:?}"
        );
    }
    lines
}

/// `mode = "async"`, a rank dying in the middle of the run: a rollout rank SIGKILLed in a
/// round (2 rollout + 1 training ranks) makes the runner start the rollout group again and
/// send it the current policy; the rounds go on and the run trains its 4 steps without a
/// rerun, saying what it lost; `async/rollout_restarts` adds up to 1. A training rank (rank 0,
/// so that the update fails rather than the transfer after it) SIGKILLed in step 2's update
/// (1 + 2 ranks): the update runs again on a new training group while the rounds go on; with
/// resident updates the run goes back to the last checkpoint files and starts the rounds
/// afresh. Every trained row lies within the staleness bound. A rollout rank that dies in
/// every round stops the run after 3 restarts.
#[test]
fn async_mode_survives_a_dead_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let marker = d.join("killed-rollout");
    let log = pipeline_ok(
        d,
        "rollout",
        Some(&async_spec("[0, 1]", "[2]")),
        &[
            ("TANDEM_DAEMON_KILL_IN_ROLLOUT", p(&marker)),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
        ],
    );
    assert!(marker.exists(), "the rollout rank was not killed: {log}");
    let said = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        said("failed with the rollout group gone (rank 1 (pid "),
        1,
        "{log}"
    );
    assert_eq!(said("that round's new tokens are lost: "), 1, "{log}");
    assert_eq!(
        said("the rollout group (re)started; sending it the current policy"),
        1,
        "{log}"
    );
    // The round after the failed one continued the sequences the failed one was given.
    let rounds = std::fs::read_to_string(d.join("rollout/async/rounds.sh")).unwrap();
    let carries: Vec<Option<&str>> = rounds
        .lines()
        .map(|l| l.split(" --carry ").nth(1)?.split(' ').next())
        .collect();
    let failed: usize = log
        .split("pipeline: async: round ")
        .nth(1)
        .and_then(|r| r.split(' ').next()?.parse().ok())
        .unwrap();
    assert!(carries.len() > failed, "{rounds}");
    assert_eq!(carries[failed - 1], carries[failed], "{rounds}");
    if log.contains("that round's new tokens are lost: its ") {
        assert!(carries[failed].is_some(), "{rounds}");
    }
    let lines = within_bound(d, "rollout");
    let restarts: Vec<u64> = lines
        .iter()
        .map(|m| m["async/rollout_restarts"].as_u64().unwrap())
        .collect();
    assert_eq!(restarts.iter().sum::<u64>(), 1, "{restarts:?}");
    for (m, n) in lines.iter().zip(&restarts) {
        let lost = m["async/restart_sequences"].as_u64().unwrap();
        assert_eq!(lost > 0, *n > 0, "{m}");
    }

    let marker = d.join("killed-update");
    let log = pipeline_ok(
        d,
        "train",
        Some(&async_spec("[0]", "[1, 2]")),
        &[
            ("TANDEM_DAEMON_KILL_IN_UPDATE", p(&marker)),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
            ("TANDEM_DAEMON_KILL_RANK", "0"),
        ],
    );
    assert!(marker.exists(), "the training rank was not killed: {log}");
    assert!(log.contains("update failed with the daemon gone"), "{log}");
    for m in within_bound(d, "train") {
        assert_eq!(m["async/rollout_restarts"], 0, "{m}");
    }

    // With resident updates (files every 2 steps) the training rank that dies in step 2's
    // update held step 1's policy only in memory: the run goes back to step 0 and starts the
    // rounds afresh, on a new rollout group.
    let marker = d.join("killed-resident");
    let resident = async_spec("[0]", "[1, 2]").replace("every = 1", "every = 2");
    let log = pipeline_ok(
        d,
        "resident",
        Some(&resident),
        &[
            ("TANDEM_DAEMON_KILL_IN_UPDATE", p(&marker)),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
            ("TANDEM_DAEMON_KILL_RANK", "0"),
        ],
    );
    assert!(marker.exists(), "the training rank was not killed: {log}");
    assert!(
        log.contains("going back to step 0")
            && log.contains("the rollout side's work when its rounds stopped is lost:"),
        "{log}"
    );
    within_bound(d, "resident");

    // A rollout rank that dies in every round (its marker removed as soon as it appears): the
    // group is restarted 3 times, then the run stops naming the round and the rank.
    let marker = d.join("killed-always");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (marker, done) = (marker.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::remove_file(&marker);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let o = pipeline(
        d,
        "always",
        Some(&async_spec("[0, 1]", "[2]")),
        &[
            ("TANDEM_DAEMON_KILL_IN_ROLLOUT", p(&marker)),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
        ],
    )
    .output()
    .unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let restarts = err
        .lines()
        .filter(|l| l.contains("restarting it from the initial model"))
        .count();
    assert_eq!(restarts, 4, "{err}");
    assert!(
        err.contains("async: round 4 (always/async/round-4) failed with the rollout group gone (rank 1 (pid ")
            && err.contains("the last of 4 rounds in a row")
            && err.contains("the rollout group died 4 times; giving up"),
        "{err}"
    );
}

/// Rank 1 of a 2-rank rollout group SIGKILLed from outside (its pid from the group's log)
/// once step 1 took its groups, wherever the rollout side then is (a round, a transfer or
/// idle): the group is replaced and the run trains its 4 steps within the staleness bound;
/// `async/rollout_restarts` counts the rounds that failed with it.
#[test]
fn async_mode_replaces_a_rollout_rank_killed_from_outside() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let err_path = d.join("ext.err");
    let mut child = pipeline(d, "ext", Some(&async_spec("[0, 1]", "[2]")), &[])
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let (taken, dlog) = (
        d.join("ext/step-0001/rollout.parquet"),
        d.join("ext/rollout-daemon.log"),
    );
    let t0 = std::time::Instant::now();
    let rank1 = loop {
        assert!(child.try_wait().unwrap().is_none(), "the run ended first");
        assert!(t0.elapsed().as_secs() < 120, "step 1 took no groups");
        let text = std::fs::read_to_string(&dlog).unwrap_or_default();
        let pid = text
            .lines()
            .filter(|l| l.contains("(rank 1 of 2)"))
            .find_map(|l| {
                l.split("(pid ")
                    .nth(1)?
                    .split(')')
                    .next()?
                    .parse::<i32>()
                    .ok()
            });
        match pid {
            Some(pid) if taken.exists() => break pid,
            _ => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
    };
    // SAFETY: a plain kill(2) of a rank this test's pipeline started.
    assert_eq!(unsafe { libc::kill(rank1, libc::SIGKILL) }, 0);
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(&err_path).unwrap();
    assert!(status.success(), "{log}");
    assert!(log.contains("pipeline: the rollout group died ("), "{log}");
    let failed = log
        .lines()
        .filter(|l| l.contains("failed with the rollout group gone"))
        .count() as u64;
    let restarts: u64 = within_bound(d, "ext")
        .iter()
        .map(|m| m["async/rollout_restarts"].as_u64().unwrap())
        .sum();
    assert_eq!(restarts, failed, "{log}");
}

/// `mode = "async"` with 1 rollout + 1 training rank, rounds of 2 tokens (responses up to 6)
/// and max-staleness = 1: the run trains its 4 steps; every trained row's tokens come from
/// versions within [trained − 1, trained], the batch's `policy_version` is its oldest token's,
/// and the column goes through score and advantage unchanged; some rows carry two versions,
/// and each of their tokens has the log-prob that its version's checkpoint gives (and not
/// another's); the steps' metrics have the lag histogram, idle times and queue depth. A
/// runner SIGKILLed in step 2 is rerun: it completes and says what it lost.
#[test]
fn async_mode_trains_on_partial_rollouts_within_the_staleness_bound() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let text = async_spec("[0]", "[1]");
    pipeline_ok(d, "a", Some(&text), &[]);
    let lines = metrics(d, "a");
    assert_eq!(lines.len(), 4);
    let mut mixed = vec![];
    for (i, m) in lines.iter().enumerate() {
        let step = i as u64 + 1;
        for k in [
            "async/train_idle_s",
            "async/rollout_idle_s",
            "async/queue_depth",
            "async/partial_sequences",
            "async/dropped_stale_groups",
            "transfer/gb_per_s",
        ] {
            assert!(m[k].is_number(), "step {step}: no {k}: {m}");
        }
        // The histogram counts the 3 taken groups' rows and those of the dropped groups.
        let lagged: u64 = (0..=4)
            .map(|l| m[format!("async/lag_{l}")].as_u64().unwrap_or(0))
            .sum();
        let dropped = m["async/dropped_stale_rows"].as_u64().unwrap();
        assert_eq!(lagged, 6 + dropped, "step {step}: {m}");
        let rollout = read(&d.join(format!("a/step-000{step}/rollout.parquet")));
        let trained = step - 1;
        let rows = token_versions(&rollout);
        assert_eq!(rows.len(), 6);
        let oldest = rows.iter().flatten().min().copied().unwrap();
        assert_eq!(rollout.meta_u64("policy_version"), Some(oldest));
        for r in &rows {
            assert!(
                r.iter().all(|&v| v <= trained && v + 1 >= trained),
                "step {step}: {r:?}"
            );
        }
        let adv = read(&d.join(format!("a/step-000{step}/adv.parquet")));
        assert_eq!(
            token_versions(&adv),
            rows,
            "step {step}: advantage keeps the column"
        );
        for (row, r) in rows.iter().enumerate() {
            if r.windows(2).any(|w| w[0] != w[1]) {
                mixed.push((step, row, r.clone()));
            }
        }
    }
    assert!(!mixed.is_empty(), "no row was continued under new weights");
    // Each mixed row's tokens against the checkpoints of their versions (0: the initial model).
    let ckpt = |v: u64| match v {
        0 => d.join("model"),
        v => d.join(format!("a/ckpt/step-000{v}")),
    };
    let mut compared = 0;
    for (step, row, vers) in &mixed {
        let rollout = d.join(format!("a/step-000{step}/rollout.parquet"));
        let by: Vec<Vec<f32>> = (0..=*vers.iter().max().unwrap())
            .map(|v| {
                let out = d.join(format!("lp-{step}-{v}.parquet"));
                ok(
                    "ref-logprob",
                    &[
                        "--model",
                        p(&ckpt(v)),
                        "--in",
                        p(&rollout),
                        "--out",
                        p(&out),
                        "--column",
                        "ref_logprobs",
                    ],
                );
                let b = read(&out);
                b.ragged_f32("ref_logprobs").unwrap().row(*row).to_vec()
            })
            .collect();
        let got = read(&rollout);
        let lps = got.ragged_f32("rollout_logprobs").unwrap();
        for (j, &lp) in lps.row(*row).iter().enumerate() {
            let want = by[vers[j] as usize][j];
            assert!(
                (lp - want).abs() < 1e-4,
                "step {step} row {row} token {j}: {lp} vs {want}"
            );
            compared += 1;
        }
        let others = (0..lps.row(*row).len())
            .filter(|&j| {
                by.iter()
                    .enumerate()
                    .any(|(v, b)| v as u64 != vers[j] && (b[j] - lps.row(*row)[j]).abs() > 1e-4)
            })
            .count();
        assert!(others > 0, "another version's log-probs differ");
    }
    assert!(compared > 0);
    // Every round sampled with the weights the rollout group held (none loaded from files);
    // the last one may have been stopped at the end of the run, before the daemon's part of
    // its metrics was added.
    let (mut n_rounds, mut unfinished) = (0, 0);
    for e in std::fs::read_dir(d.join("a/async")).unwrap() {
        let path = e.unwrap().path().join("metrics.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let m: serde_json::Value = serde_json::from_str(&text).unwrap();
            match m.get("daemon") {
                Some(daemon) => assert_eq!(daemon["reloaded"], false, "{}", path.display()),
                None => unfinished += 1,
            }
            n_rounds += 1;
        }
    }
    assert!(
        n_rounds >= 8 && unfinished <= 1,
        "{n_rounds} rounds, {unfinished} unfinished"
    );
    let rounds = std::fs::read_to_string(d.join("a/async/rounds.sh")).unwrap();
    assert!(
        rounds.contains("--round-tokens 2") && rounds.contains("a/rollout.sock"),
        "{rounds}"
    );

    // SIGKILL of the runner once step 2 took its groups; the rerun completes and says what
    // was lost. Here the rollout group has two ranks, which split each round's sequences.
    let two = text.replace(
        "rollout-gpus = [0]\ntrain-gpus = [1]",
        "rollout-gpus = [0, 1]\ntrain-gpus = [2]",
    );
    assert_ne!(two, text);
    std::fs::write(d.join("k.toml"), &two).unwrap();
    let taken = d.join("k/step-0002/rollout.parquet");
    crate::pipeline::kill_when(pipeline(d, "k", None, &[]), "step 2's take", &mut |_| {
        taken.exists()
    });
    let log = pipeline_ok(d, "k", None, &[]);
    assert!(
        log.contains("the rollout side's work when its rounds stopped is lost:")
            && log.contains("groups in flight"),
        "{log}"
    );
    assert_eq!(metrics(d, "k").len(), 4, "{log}");
    for step in 1..=4 {
        let rows = token_versions(&read(&d.join(format!("k/step-000{step}/rollout.parquet"))));
        assert_eq!(rows.len(), 6);
        assert!(
            rows.iter()
                .flatten()
                .all(|&v| v < step && v + 1 >= step - 1),
            "{rows:?}"
        );
    }
}

/// Each group's scores in a scored file, in order of appearance.
fn group_scores(path: &Path) -> Vec<(String, Vec<f32>)> {
    let b = read(path);
    let mut out: Vec<(String, Vec<f32>)> = Vec::new();
    let scores = b.f32s("score").unwrap();
    for (u, s) in b.strings("prompt_uid").unwrap().into_iter().zip(scores) {
        match out.last_mut() {
            Some((last, v)) if last == u => v.push(s),
            _ => out.push((u.to_string(), vec![s])),
        }
    }
    out
}

/// `mode = "async"` with `[algorithm] filter-groups` (1 rollout + 1 training rank, groups of
/// 4, max-staleness = 1): a reward that scores every sample of an even answer 0 (those groups
/// never vary) and the others by their length. Each step trains on 3 groups, every one with
/// at least two distinct scores; the take's score passes dropped exactly the groups with one
/// score (`sampling/groups_dropped`), some in all; the staleness bound still holds and the
/// batch's `policy_version` is its oldest token's.
#[test]
fn async_mode_with_filter_groups_trains_only_on_groups_that_vary() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let text = format!(
        "{}max-staleness = 1\nround-tokens = 2\n[algorithm]\nfilter-groups = true\n",
        parity_spec(d, "async")
    );
    let log = pipeline_ok(d, "f", Some(&text), &[]);
    let lines = metrics(d, "f");
    assert_eq!(lines.len(), 3, "{log}");
    let mut dropped_all = 0;
    for (i, m) in lines.iter().enumerate() {
        let step = i as u64 + 1;
        let sd = d.join(format!("f/step-000{step}"));
        // The passes scored the groups once each: those kept, and those with one score.
        let passes = m["sampling/score_passes"].as_u64().unwrap();
        let (kept, scored, uniform) = kept_groups_vary(&sd, m, passes);
        assert_eq!(
            m["sampling/groups_scored"], scored as u64,
            "step {step}: {m}"
        );
        assert_eq!(scored, uniform + 3, "step {step}: {m}");
        // The passes' scoring is part of the take.
        let (score_s, take_s) = (m["time/score"].as_f64(), m["time/take"].as_f64());
        assert!(
            score_s.unwrap() > 0.0 && score_s < take_s,
            "step {step}: {m}"
        );
        dropped_all += uniform;
        // The step's rollout holds the same rows, within the staleness bound.
        let rollout = read(&sd.join("rollout.parquet"));
        let uids: Vec<String> = rollout
            .strings("prompt_uid")
            .unwrap()
            .iter()
            .map(|u| u.to_string())
            .collect();
        let want: Vec<String> = kept.iter().flat_map(|(u, _)| vec![u.clone(); 4]).collect();
        assert_eq!(uids, want, "step {step}");
        let rows = token_versions(&rollout);
        let trained = step - 1;
        assert!(
            rows.iter()
                .flatten()
                .all(|&v| v <= trained && v + 1 >= trained),
            "step {step}: {rows:?}"
        );
        let oldest = rows.iter().flatten().min().copied();
        assert_eq!(rollout.meta_u64("policy_version"), oldest, "step {step}");
        assert!(
            m["async/dropped_stale_groups"].is_number(),
            "step {step}: {m}"
        );
    }
    assert!(dropped_all > 0, "no group was dropped: {log}");
}

/// Async dynamic sampling at its cap: a reward that never varies, `max-num-gen-batches = 2`
/// (3 groups a step: 6 scored at most). `on-cap = "train"` stops the run, nothing being kept,
/// and `on-cap = "fail"` stops it as verl does; each says how many groups it scored.
#[test]
fn async_dynamic_sampling_stops_at_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let reward = d.join("zero.sh");
    std::fs::write(&reward, "while read -r l; do echo 0; done\n").unwrap();
    let base = format!(
        "{}[algorithm]\nfilter-groups = true\nmax-num-gen-batches = 2\n",
        placed("[0]", "[1]", "async").replace(
            "reward = \"exact\"",
            &format!("reward = \"cmd:sh {}\"", reward.display())
        )
    );
    for (on_cap, want) in [
        ("", "nothing to train on"),
        (
            "on-cap = \"fail\"\n",
            "on-cap = \"fail\" stops the run here",
        ),
    ] {
        let o = pipeline(d, "c", Some(&format!("{base}{on_cap}")), &[])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{on_cap}: {err}");
        assert!(
            err.contains("step-0001: dynamic sampling kept 0 of 3 groups out of 6 scored")
                && err.contains(want),
            "{on_cap}: {err}"
        );
        std::fs::remove_dir_all(d.join("c")).unwrap();
    }
}

/// The placed spec of `mode` (1 rollout + 1 training rank) with groups of 4 and a reward
/// (`d/parity.py`) that scores every sample of an even answer 0 (those groups never vary) and
/// the others by their length.
fn parity_spec(d: &Path, mode: &str) -> String {
    let reward = d.join("parity.py");
    std::fs::write(
        &reward,
        "import json, sys\nfor line in sys.stdin:\n    r = json.loads(line)\n    even = int(str(r['ground_truth']).strip()) % 2 == 0\n    s = 0.0 if even else float(len(r['solution_str']) % 3)\n    print(json.dumps({'score': s}), flush=True)\n",
    )
    .unwrap();
    placed("[0]", "[1]", mode)
        .replace("n = 2", "n = 4")
        .replace(
            "reward = \"exact\"",
            &format!("reward = \"cmd:python3 {}\"", reward.display()),
        )
        .replace("max-new-tokens = 6", "max-new-tokens = 8")
}

/// A dynamic-sampling step's checks (step dir `sd`, metrics `m`, `passes` score passes): it
/// trains on 3 groups of 4 with at least two distinct scores each, and its passes dropped
/// exactly the groups with one score. Returns the kept groups, the groups scored and those
/// dropped.
fn kept_groups_vary(sd: &Path, m: &serde_json::Value, passes: u64) -> KeptGroups {
    let kept = group_scores(&sd.join("scored.parquet"));
    assert_eq!(kept.len(), 3, "{}", sd.display());
    for (u, s) in &kept {
        assert!(
            s.len() == 4 && s.iter().any(|&x| x != s[0]),
            "{}: group {u} has scores {s:?}",
            sd.display()
        );
    }
    let (mut uniform, mut scored) = (0, 0);
    for r in 1..=passes {
        for (_, s) in group_scores(&sd.join(format!("round-{r}/scored.parquet"))) {
            scored += 1;
            uniform += usize::from(s.iter().all(|&x| x == s[0]));
        }
    }
    assert_eq!(m["sampling/groups_dropped"], uniform as u64, "{m}");
    assert_eq!(m["sampling/groups"], 3, "{m}");
    assert_eq!(m["sampling/capped"], 0, "{m}");
    (kept, scored, uniform)
}

type KeptGroups = (Vec<(String, Vec<f32>)>, usize, usize);

/// One-step-off's timings (1 + 1 ranks or more, 3 steps): steps 1 and 2 ran their update
/// beside the next step's rollout (`time/overlap`, the wall time of both, holds the update's
/// own `time/update`), steps 2 and 3 report the rollout of their own rows (`time/rollout`,
/// timed in the step before, within its overlap); the last step's update ran alone.
fn overlap_times(lines: &[serde_json::Value]) {
    let t = |m: &serde_json::Value, k: &str| m[format!("time/{k}")].as_f64();
    for (i, m) in lines.iter().enumerate() {
        let (update, overlap) = (t(m, "update").unwrap(), t(m, "overlap"));
        assert!(update > 0.0, "step {}: {m}", i + 1);
        match lines.get(i + 1) {
            Some(next) => {
                let overlap = overlap.unwrap();
                let rollout = t(next, "rollout").unwrap();
                assert!(
                    rollout > 0.0 && overlap >= update && overlap >= rollout,
                    "{m}\n{next}"
                );
                assert!(t(m, "step").unwrap() >= overlap, "{m}");
            }
            None => assert_eq!(overlap, None, "the last step: {m}"),
        }
    }
}

/// One-step-off with `[algorithm] filter-groups` (1 rollout + 1 training rank, groups of 4,
/// the parity reward): step k + 1's dynamic sampling runs beside step k's update with the
/// policy one version behind (versions 0, 0, 1); each step trains on 3 groups with at least
/// two distinct scores, and its passes dropped exactly the one-score groups; the overlap's
/// parts are timed; a second run writes the same files, and so do a run whose rollout rank
/// dies in a pass and one whose runner is SIGKILLed in step 2 while step 3's passes run.
#[test]
fn one_step_off_with_filter_groups_trains_only_on_groups_that_vary() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let text = format!(
        "{}[algorithm]\nfilter-groups = true\n",
        parity_spec(d, "one-step-off")
    );
    let log = pipeline_ok(d, "a", Some(&text), &[]);
    assert_eq!(versions(d, "a"), [Some(0), Some(0), Some(1)]);
    let lines = metrics(d, "a");
    assert_eq!(lines.len(), 3, "{log}");
    let mut dropped_all = 0;
    for (i, m) in lines.iter().enumerate() {
        let step = i as u64 + 1;
        let sd = d.join(format!("a/step-000{step}"));
        let rounds = m["sampling/rounds"].as_u64().unwrap();
        let (_, scored, uniform) = kept_groups_vary(&sd, m, rounds);
        assert!(
            !sd.join(format!("round-{}", rounds + 1)).exists(),
            "step {step}"
        );
        assert!(scored >= uniform + 3, "step {step}: {m}");
        // Every pass of the step sampled with the step's one policy version.
        for r in 1..=rounds {
            let pass = read(&sd.join(format!("round-{r}/rollout.parquet")));
            assert_eq!(pass.meta_u64("policy_version"), Some(step.max(2) - 2));
        }
        dropped_all += uniform;
    }
    assert!(dropped_all > 0, "no group was dropped: {log}");
    overlap_times(&lines);
    let commands = std::fs::read_to_string(d.join("a/commands.sh")).unwrap();
    let beside = commands
        .lines()
        .filter(|l| l.contains("the next command runs beside step-000"))
        .count();
    assert_eq!(beside, 2, "{commands}");

    pipeline_ok(d, "b", Some(&text), &[]);
    same_run(d, "a", "b");

    // A rollout rank dies in a pass of step 3 (beside step 2's update, version 1): the group
    // is started again and gets version 1 by a transfer (queued on the training group behind
    // the update while that runs), and the pass runs again.
    rollout_rank_dies(d, &text, "next/round-1/rollout");

    // The runner SIGKILLed in step 2 once step 3's first pass is scored: the rerun continues
    // after step 1, skips the passes done, and ends as the undisturbed run.
    runner_killed_after(d, &text, "step-0003/round-1/scored.parquet");
    // The rerun did not roll out the finished pass again.
    let commands = std::fs::read_to_string(d.join("runner/commands.sh")).unwrap();
    let first_pass = commands
        .lines()
        .filter(|l| l.contains("/rollout ") && l.contains("step-0003/round-1/rollout.parquet"))
        .count();
    assert_eq!(first_pass, 1, "{commands}");
}

/// One-step-off dynamic sampling at its cap, in the passes that run beside the update: a
/// reward that varies in its first batch (step 1's own pass) and never after,
/// `max-num-gen-batches = 2`. Step 2's passes keep nothing: `on-cap = "train"` stops the run
/// (nothing to train on) and `on-cap = "fail"` stops it as verl does, as a colocated run.
#[test]
fn one_step_off_dynamic_sampling_stops_at_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let reward = d.join("once.sh");
    let flag = d.join("varied");
    std::fs::write(
        &reward,
        format!(
            "if [ -e {f} ]; then while read -r l; do echo 0; done; else touch {f}; i=0; while read -r l; do echo $((i % 2)); i=$((i + 1)); done; fi\n",
            f = flag.display()
        ),
    )
    .unwrap();
    let base = format!(
        "{}[algorithm]\nfilter-groups = true\nmax-num-gen-batches = 2\n",
        placed("[0]", "[1]", "one-step-off").replace(
            "reward = \"exact\"",
            &format!("reward = \"cmd:sh {}\"", reward.display())
        )
    );
    for (on_cap, want) in [
        ("", "nothing to train on"),
        (
            "on-cap = \"fail\"\n",
            "on-cap = \"fail\" stops the run here",
        ),
    ] {
        let _ = std::fs::remove_file(&flag);
        let o = pipeline(d, "c", Some(&format!("{base}{on_cap}")), &[])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{on_cap}: {err}");
        assert!(
            err.contains("step-0002: dynamic sampling kept 0 of 3 groups in 2 rounds (6 prompts")
                && err.contains(want),
            "{on_cap}: {err}"
        );
        // Step 1's pass kept its 3 groups; step 2's two passes were scored.
        let c = d.join("c");
        assert!(c.join("step-0001/round-1/scored.parquet").exists());
        assert!(!c.join("step-0001/round-2").exists());
        assert!(c.join("step-0002/round-2/scored.parquet").exists());
        assert!(!c.join("step-0002/round-3").exists());
        std::fs::remove_dir_all(&c).unwrap();
    }
}

/// `rollout --round-tokens` alone: rounds of 3 tokens (responses up to 7) over two prompt
/// files started one round apart and rounds with no new prompt, until nothing is in flight.
/// Every sample comes out once, in a finished group, with one version per token and its
/// behaviour log-probs; a carry file holds the groups in flight (ended samples with their
/// reason, the others with ""). Bad flags are exit 2 naming them, as are a carry file of plain
/// sequences continued with --tool (and one of episodes without it) and a malformed episode.
#[test]
fn rollout_rounds_carry_sequences_until_their_groups_finish() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    prompts(&d.join("a.parquet"), &["What is 2 + 3?", "Name a colour."]);
    prompts(&d.join("b.parquet"), &["Say hello."]);
    prompts(&d.join("none.parquet"), &[]);
    let model = d.join("model");
    let round = |r: usize, input: &str, carry: Option<&Path>| -> std::path::PathBuf {
        let (out, carry_out) = (
            d.join(format!("f{r}.parquet")),
            d.join(format!("c{r}.parquet")),
        );
        let seed = r.to_string();
        let mut args = vec![
            "--model",
            p(&model),
            "--in",
            input,
            "--out",
            p(&out),
            "--carry-out",
            p(&carry_out),
            "--round-tokens",
            "3",
            "--max-new-tokens",
            "7",
            "--n",
            "2",
            "--raw-prompt",
            "--ignore-eos",
            "--seed",
            &seed,
        ];
        if let Some(c) = carry {
            args.extend(["--carry", p(c)]);
        }
        ok("rollout", &args);
        carry_out
    };
    let (a, b, none) = (
        d.join("a.parquet"),
        d.join("b.parquet"),
        d.join("none.parquet"),
    );
    let c1 = round(1, p(&a), None);
    let first = read(&c1);
    assert_eq!(first.num_rows(), 4, "two groups of two in flight");
    assert!(first
        .strings("finish_reason")
        .unwrap()
        .iter()
        .all(|r| r.is_empty()));
    assert_eq!(token_versions(&first), vec![vec![0u64; 3]; 4]);
    let c2 = round(2, p(&b), Some(&c1));
    let c3 = round(3, p(&none), Some(&c2));
    let c4 = round(4, p(&none), Some(&c3));
    assert_eq!(
        read(&c4).num_rows(),
        0,
        "7 tokens in rounds of 3: done after 3 rounds"
    );
    let mut uids = vec![];
    for r in 1..=4 {
        let f = read(&d.join(format!("f{r}.parquet")));
        let lens: Vec<usize> = token_versions(&f).iter().map(Vec::len).collect();
        assert_eq!(
            f.ragged_f32("rollout_logprobs")
                .unwrap()
                .rows()
                .map(|x| x.len())
                .collect::<Vec<_>>(),
            lens
        );
        assert!(lens.iter().all(|&n| n == 7), "{lens:?}");
        assert!(f
            .strings("finish_reason")
            .unwrap()
            .iter()
            .all(|r| *r == "length"));
        assert!(!f.has("sample_key"));
        uids.extend(f.strings("uid").unwrap().iter().map(|s| s.to_string()));
    }
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), 6, "every sample once: {uids:?}");
    // Bad flags: exit 2 naming them.
    let base = ["--model", p(&model), "--in", p(&a), "--out", "x.parquet"];
    for (extra, want) in [
        (
            &["--round-tokens", "2"][..],
            "--round-tokens needs --carry-out",
        ),
        (
            &[
                "--round-tokens",
                "2",
                "--carry-out",
                "c.parquet",
                "--baseline",
                "greedy",
            ][..],
            "no --baseline",
        ),
        (
            &["--round-tokens", "0", "--carry-out", "c.parquet"][..],
            "--round-tokens",
        ),
        (&["--carry-out", "c.parquet"][..], "--round-tokens"),
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        input_error("rollout", &args, want);
    }
    // A carry of plain sequences continued with --tool (and the converse): exit 2 naming it.
    let tool_round = |carry: &Path, tool: bool| {
        let mut args = vec![
            "--model",
            p(&model),
            "--in",
            p(&none),
            "--out",
            "x.parquet",
            "--carry",
            p(carry),
            "--carry-out",
            "c.parquet",
            "--round-tokens",
            "2",
        ];
        if tool {
            args.extend(["--tool", "python"]);
        }
        let err = input_error("rollout", &args, "comes from a round with other flags");
        assert!(err.contains(p(carry)), "{err}");
    };
    tool_round(&c1, true);
    // An episode column that is not an episode: exit 2 naming the file, column and row.
    let bad = d.join("bad-episode.parquet");
    let c = read(&c1);
    let mut cols = tandem::batch::NewColumns::new();
    let junk = vec!["{\"turns\": 3}"; c.num_rows()];
    cols.add_field(
        arrow_schema::Field::new("episode", arrow_schema::DataType::Utf8, false),
        std::sync::Arc::new(arrow_array::StringArray::from(junk)),
    );
    tandem::batch::write_file(&bad, &c.with_columns(cols).unwrap(), &Default::default()).unwrap();
    let args = [
        "--model",
        p(&model),
        "--in",
        p(&none),
        "--out",
        "x.parquet",
        "--carry",
        p(&bad),
        "--carry-out",
        "c.parquet",
        "--round-tokens",
        "2",
        "--tool",
        "python",
    ];
    let err = input_error("rollout", &args, "column 'episode', row 0:");
    assert!(err.contains(p(&bad)), "{err}");
    // ...and the same carry without --tool: its episodes are not continued.
    tool_round(&bad, false);
}

/// `rollout --round-tokens 1 --stop S` carried until nothing is in flight: every stop string
/// is begun in one round and completed in a later one. Against the same rounds without
/// `--stop` (the same keys draw the same tokens): a row whose text holds S ends at the token
/// that completes its first S (finish `stop`, its text cut before S, its tokens, log-probs and
/// versions those of the row without --stop up to there); the others are the same rows.
#[test]
fn rollout_rounds_stop_at_stop_strings_that_straddle_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    prompts(&d.join("a.parquet"), &["What is 2 + 3?", "Name a colour."]);
    prompts(&d.join("none.parquet"), &[]);
    let model = d.join("model");
    // Rounds until the carry is empty; the rows of every finished group, by uid.
    let rounds = |name: &str, stops: &[String]| {
        let mut rows = std::collections::BTreeMap::new();
        let mut carry: Option<std::path::PathBuf> = None;
        for r in 1.. {
            let (out, carry_out) = (
                d.join(format!("{name}-f{r}.parquet")),
                d.join(format!("{name}-c{r}.parquet")),
            );
            let input = match r {
                1 => d.join("a.parquet"),
                _ => d.join("none.parquet"),
            };
            let seed = r.to_string();
            let mut args = vec![
                "--model",
                p(&model),
                "--in",
                p(&input),
                "--out",
                p(&out),
                "--carry-out",
                p(&carry_out),
                "--round-tokens",
                "1",
                "--max-new-tokens",
                "12",
                "--n",
                "8",
                "--raw-prompt",
                "--ignore-eos",
                "--seed",
                &seed,
            ];
            if let Some(c) = &carry {
                args.extend(["--carry", p(c)]);
            }
            for s in stops {
                args.extend(["--stop", s.as_str()]);
            }
            ok("rollout", &args);
            let f = read(&out);
            let (uids, ids, texts) = (
                strings(&f, "uid"),
                i32_rows(&f, "response_ids"),
                strings(&f, "response_text"),
            );
            let (reasons, versions) = (strings(&f, "finish_reason"), token_versions(&f));
            let lps = f32_rows(&f, "rollout_logprobs");
            for i in 0..uids.len() {
                let row = (
                    ids[i].clone(),
                    texts[i].clone(),
                    reasons[i].clone(),
                    versions[i].clone(),
                    lps[i].clone(),
                );
                rows.insert(uids[i].clone(), row);
            }
            if read(&carry_out).num_rows() == 0 {
                return rows;
            }
            carry = Some(carry_out);
        }
        unreachable!()
    };
    let whole = rounds("whole", &[]);
    assert_eq!(whole.len(), 16);
    let tok = tandem::tokenizer::Tokenizer::from_dir(&model).unwrap();
    let decode = |ids: &[i32]| {
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        tok.decode(&ids, true).unwrap()
    };
    let rows: Vec<Vec<i32>> = whole.values().map(|r| r.0.clone()).collect();
    let stops = boundary_pairs(&rows, &decode, 4);
    let cut = rounds("cut", &stops);
    let first_stop = |text: &str| stops.iter().filter_map(|s| text.find(s.as_str())).min();
    assert_eq!(cut.len(), 16);
    let (mut stopped, mut straddled) = (0, 0);
    for (uid, (ids, text, reason, versions, lps)) in &whole {
        let got = &cut[uid];
        // The first token after which the text holds a stop string.
        let end = (1..=ids.len()).find(|&k| first_stop(&decode(&ids[..k])).is_some());
        match end {
            Some(k) => {
                let full = decode(&ids[..k]);
                let at = first_stop(&full).unwrap();
                assert_eq!(got.0, ids[..k], "{uid}");
                assert_eq!(got.1, full[..at], "{uid}");
                assert_eq!(got.2, "stop", "{uid}");
                assert_eq!(got.3, versions[..k], "{uid}");
                assert_eq!(got.4, lps[..k], "{uid}");
                // Rounds of one token: a string not inside its last token began in an earlier
                // round.
                straddled += usize::from(first_stop(&decode(&ids[k - 1..k])).is_none());
                stopped += 1;
            }
            None => {
                assert_eq!(
                    got,
                    &(
                        ids.clone(),
                        text.clone(),
                        reason.clone(),
                        versions.clone(),
                        lps.clone()
                    ),
                    "{uid}"
                );
            }
        }
    }
    assert!(
        stopped >= 2 && straddled >= 2,
        "{stopped} rows stopped at {stops:?}, {straddled} across rounds"
    );
}

/// Stop strings for tests: the last character of a token and the first of the next, the `k`
/// most frequent in the rows `ids` (past their first token), as `decode` writes them; none
/// that a token of the rows holds alone (so a row holds one only across tokens).
fn boundary_pairs(ids: &[Vec<i32>], decode: &dyn Fn(&[i32]) -> String, k: usize) -> Vec<String> {
    let alone: std::collections::HashSet<String> =
        ids.iter().flatten().map(|&t| decode(&[t])).collect();
    let mut counts = std::collections::HashMap::new();
    for ids in ids {
        for w in ids.windows(2).skip(1) {
            let (x, y) = (decode(&w[..1]), decode(&w[1..]));
            let pair: String = x
                .chars()
                .last()
                .into_iter()
                .chain(y.chars().next())
                .collect();
            let plain = pair.chars().count() == 2 && pair.chars().all(|c| c.is_ascii_graphic());
            if plain && !alone.iter().any(|t| t.contains(&pair)) {
                *counts.entry(pair).or_insert(0) += 1;
            }
        }
    }
    let mut counts: Vec<(String, i32)> = counts.into_iter().collect();
    counts.sort_by_key(|(s, n)| (-n, s.clone()));
    counts.into_iter().take(k).map(|(s, _)| s).collect()
}

/// `mode = "async"` with `[rollout] stop` (up to 16 pairs of characters the model writes
/// greedily across a token boundary; greedy, so that the trained rows write them too) and
/// rounds of one token (such a pair is begun in one round and completed in the next), 1 + 1
/// CPU ranks: the run trains its 3 steps; every trained row whose text holds a stop string
/// ends at the token that completes the first one (`finish_reason` stop, its text cut before
/// it), some rows did, across rounds, and the staleness bound holds.
#[test]
fn async_mode_stops_at_stop_strings_across_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 12);
    let model = d.join("model");
    let plain = d.join("plain.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&d.join("train.parquet")),
            "--out",
            p(&plain),
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "--raw-prompt",
        ],
    );
    let tok = tandem::tokenizer::Tokenizer::from_dir(&model).unwrap();
    let decode = |ids: &[i32]| {
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        tok.decode(&ids, true).unwrap()
    };
    let rows = i32_rows(&read(&plain), "response_ids");
    let stops = boundary_pairs(&rows, &decode, 16);
    let list: Vec<String> = stops.iter().map(|s| format!("{s:?}")).collect();
    let text = format!(
        "{}max-staleness = 1\nround-tokens = 1\n",
        placed("[0]", "[1]", "async").replace(
            "max-new-tokens = 6",
            &format!(
                "max-new-tokens = 12\ntemperature = 0.0\nstop = [{}]",
                list.join(", ")
            )
        )
    );
    pipeline_ok(d, "a", Some(&text), &[]);
    let first_stop = |text: &str| stops.iter().filter_map(|s| text.find(s.as_str())).min();
    let (mut stopped, mut straddled) = (0, 0);
    for step in 1..=3u64 {
        let b = read(&d.join(format!("a/step-000{step}/rollout.parquet")));
        let (ids, texts) = (i32_rows(&b, "response_ids"), strings(&b, "response_text"));
        let reasons = strings(&b, "finish_reason");
        for (i, v) in token_versions(&b).iter().enumerate() {
            assert!(v.iter().all(|&x| x < step && x + 1 >= step - 1), "{v:?}");
            let full = decode(&ids[i]);
            let Some(at) = first_stop(&full) else {
                continue;
            };
            let k = ids[i].len();
            assert!(
                first_stop(&decode(&ids[i][..k - 1])).is_none(),
                "row {i}: {full:?}"
            );
            assert_eq!(
                (reasons[i].as_str(), texts[i].as_str()),
                ("stop", &full[..at])
            );
            stopped += 1;
            // Rounds of one token: a string not inside the last token began in an earlier one.
            straddled += usize::from(first_stop(&decode(&ids[i][k - 1..])).is_none());
        }
    }
    assert!(
        stopped >= 2 && straddled >= 2,
        "{stopped} rows stopped at {stops:?}, {straddled} across rounds"
    );
}
