//! `[rollout] agent = "cmd:PROGRAM …"`: a pipeline step whose rollout is the user's agent
//! against `tandem serve` (the real binaries, a tiny model, CPU, loopback only). The agent is
//! tests/fixtures/agent_cmd/agent.py (standard library only): two-turn episodes, a reward
//! posted per episode.

use crate::pipeline::{assert_ok, real_bins, text, PIPELINE};
use crate::stage_util::{f32_rows, i32_rows, model_and_train_set, read, strings, u8_rows};
use arrow_array::{Array, Int32Array};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SPEC: &str = r#"
seed = 7
steps = 2
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 3
[rollout]
agent = "cmd:python3 AGENT"
n = 2
temperature = 1.0
max-new-tokens = 6
[score]
# A reward the random model earns now and then, so that the advantages are not all zero.
reward = "regex:[a-z]"
format-score = 0.5
[advantage]
estimator = "grpo"
[update]
lr = 0.01
"#;

fn agent_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent_cmd/agent.py")
}

/// A work directory with the model, the training set and `spec` (AGENT: the test agent).
fn work(spec: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    model_and_train_set(dir.path(), 64, 128, 12);
    let spec = spec.replace("AGENT", &agent_script().display().to_string());
    std::fs::write(dir.path().join("spec.toml"), spec).unwrap();
    dir
}

fn pipeline(d: &Path, env: &[(&str, &str)]) -> Output {
    pipeline_of(d, "spec.toml", "r", env)
}

/// `pipeline run SPEC --run-dir RUN` in `d`.
fn pipeline_of(d: &Path, spec: &str, run: &str, env: &[(&str, &str)]) -> Output {
    Command::new(PIPELINE)
        .current_dir(d)
        .args(["run", spec, "--run-dir", run])
        .env("TANDEM_BIN_DIR", real_bins())
        .env("RAYON_NUM_THREADS", "2")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// Two steps driven by the agent end with a trained checkpoint; each step's rollout.parquet
/// holds the agent's two-turn episodes in the multi-turn contract, grouped by the step's
/// prompts, with their ground truths, sampled from the step's policy.
#[test]
fn an_agent_drives_two_steps_to_a_trained_checkpoint() {
    let dir = work(SPEC);
    let d = dir.path();
    let o = pipeline(d, &[]);
    assert_ok(&o);
    let run = d.join("r");
    let before = std::fs::read(d.join("model/model.safetensors")).unwrap();
    let after = std::fs::read(run.join("ckpt/step-0002/model.safetensors")).unwrap();
    assert!(before != after, "the policy did not change");
    let commands = std::fs::read_to_string(run.join("commands.sh")).unwrap();
    assert!(
        commands.contains(
            "# pipeline: serve r/policy with `tandem serve` on 127.0.0.1, run the agent `python3 "
        ),
        "{commands}"
    );
    for step in [1u64, 2] {
        let sd = run.join(format!("step-{step:04}"));
        let b = read(&sd.join("rollout.parquet"));
        assert_eq!(b.num_rows(), 6, "3 prompts x 2 episodes");
        assert_eq!(b.meta_u64("policy_version"), Some(step - 1));
        assert_eq!(b.meta_u64("step"), Some(step));
        let turns = b.column("num_turns").unwrap();
        let turns = turns.as_any().downcast_ref::<Int32Array>().unwrap();
        assert_eq!(turns.values().to_vec(), vec![2; 6]);
        // The user's "Check it." turn is in the response with mask 0 between sampled turns.
        for mask in b.ragged_u8("response_mask").unwrap().rows() {
            assert!(mask.contains(&0) && mask.contains(&1), "{mask:?}");
            assert_eq!(
                mask[0], 1,
                "the response starts with the first sampled turn"
            );
        }
        let messages = strings(&b, "messages");
        assert!(messages.iter().all(|m| m.contains("Check it.")));
        // Every prompt of the step, twice, with the prompt's ground truth.
        let given = read(&sd.join("agent/prompts.parquet"));
        let truth: BTreeMap<String, String> = strings(&given, "prompt_uid")
            .into_iter()
            .zip(given.ground_truths().unwrap())
            .collect();
        let mut count: BTreeMap<String, usize> = BTreeMap::new();
        for (uid, gt) in strings(&b, "prompt_uid")
            .into_iter()
            .zip(strings(&b, "ground_truth"))
        {
            assert_eq!(truth.get(&uid), Some(&gt), "{uid}");
            *count.entry(uid).or_default() += 1;
        }
        assert_eq!(count.len(), 3);
        assert!(count.values().all(|&c| c == 2), "{count:?}");
        assert!(read(&sd.join("scored.parquet")).has("score"));
    }
}

/// An agent that exits non-zero stops the step with its exit code and output, naming the step
/// and the program; one that names an episode after no prompt of the step is an input error.
#[test]
fn a_failing_agent_stops_its_step_with_a_clear_error() {
    let dir = work(SPEC);
    let d = dir.path();
    let o = pipeline(d, &[("AGENT_FAIL", "1")]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("step-0001: the agent `python3 ") && out.contains("failed (exit code 3)"),
        "{out}"
    );
    assert!(out.contains("agent: giving up after one episode"), "{out}");
    assert!(!d.join("r/step-0001/rollout.parquet").exists());

    let o = pipeline(d, &[("AGENT_BAD_ID", "1")]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("recorded trajectory 'nope0-0', which is not of the step's prompts"),
        "{out}"
    );
    assert!(!d.join("r/step-0001/rollout.parquet").exists());
}

/// A program still running at `agent-timeout` is killed, and the step fails saying so; one
/// that exits 0 having played nothing fails the step as well.
#[test]
fn an_agent_past_its_timeout_or_with_no_episode_fails_its_step() {
    let spec = SPEC.replace("cmd:python3 AGENT\"", "cmd:sleep 60\"\nagent-timeout = 1");
    let dir = work(&spec);
    let t0 = std::time::Instant::now();
    let o = pipeline(dir.path(), &[]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("the agent `sleep 60` failed (killed at agent-timeout = 1 s)"),
        "{out}"
    );
    assert!(t0.elapsed().as_secs() < 50);

    let dir = work(&SPEC.replace("cmd:python3 AGENT", "cmd:true"));
    let o = pipeline(dir.path(), &[]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("step-0001: the agent `true` exited 0 but recorded no trajectory"),
        "{out}"
    );
    assert!(!dir.path().join("r/step-0001/rollout.parquet").exists());
}

/// What an agent step cannot do is refused before anything runs, with the reason.
#[test]
fn preflight_refuses_what_an_agent_step_cannot_do() {
    let cases = [
        (
            "steps = 2",
            "steps = 2\ngpus = 2",
            "not with gpus = 2 without daemon = true",
        ),
        (
            "cmd:python3 AGENT",
            "cmd:./no-such-agent --x",
            "program `./no-such-agent` not found",
        ),
        (
            "cmd:python3 AGENT",
            "python3 AGENT",
            "write \"cmd:PROGRAM ARGS…\"",
        ),
        (
            "agent = \"cmd:python3 AGENT\"",
            "agent-timeout = 5",
            "agent-timeout has no effect without agent",
        ),
        (
            "n = 2",
            "n = 2\nagent-timeout = 0",
            "agent-timeout = 0: a whole number",
        ),
    ];
    for (from, to, needle) in cases {
        let dir = work(&SPEC.replace(from, to));
        let o = pipeline(dir.path(), &[]);
        let out = text(&o);
        assert_eq!(o.status.code(), Some(2), "{to}: {out}");
        assert!(out.contains(needle), "{to}: {out}");
        assert!(!dir.path().join("r/step-0001").exists(), "{to}");
    }
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.extend(e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()));
        }
    }
    out
}

/// Whether process `pid` still runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

/// SIGKILL of the runner while its agent plays takes the agent and the server down with it;
/// the next `pipeline run` plays the step again and finishes the run.
#[test]
fn a_run_killed_while_its_agent_plays_goes_on_from_that_step() {
    let dir = work(SPEC);
    let d = dir.path();
    let mut cmd = Command::new(PIPELINE);
    cmd.current_dir(d)
        .args(["run", "spec.toml", "--run-dir", "r"])
        .env("TANDEM_BIN_DIR", real_bins())
        .env("AGENT_SLOW", "1");
    let mut kids = Vec::new();
    crate::pipeline::kill_when(cmd, "the agent playing", &mut |pid| {
        kids = children(pid);
        kids.len() == 2 && crate::pipeline::running_child(pid, "agent.py")
    });
    let t0 = std::time::Instant::now();
    while kids.iter().any(|&k| alive(k)) {
        assert!(t0.elapsed().as_secs() < 10, "{kids:?} outlived the runner");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(!d.join("r/step-0001/rollout.parquet").exists());
    let o = pipeline(d, &[]);
    assert_ok(&o);
    assert_eq!(read(&d.join("r/step-0001/rollout.parquet")).num_rows(), 6);
    assert!(d.join("r/ckpt/step-0002/model.safetensors").is_file());
}

/// `[score] reward = "agent"` keeps the rewards the agent posted (here each episode's index K,
/// whatever its replies): the scored file holds them and GRPO's advantages follow them, ±0.5
/// over the unbiased std of {0, 1} in every group. An episode without a posted reward stops
/// the step as an input error naming the file, the column and the row.
#[test]
fn the_agents_own_rewards_drive_the_advantages() {
    let spec = SPEC.replace("steps = 2", "steps = 1").replace(
        "reward = \"regex:[a-z]\"\nformat-score = 0.5",
        "reward = \"agent\"",
    );
    let dir = work(&spec);
    let d = dir.path();
    assert_ok(&pipeline(d, &[("AGENT_REWARD", "index")]));
    let sd = d.join("r/step-0001");
    let scored = read(&sd.join("scored.parquet"));
    let posted: Vec<f32> = strings(&scored, "uid")
        .iter()
        .map(|id| id.rsplit_once('-').unwrap().1.parse().unwrap())
        .collect();
    assert_eq!(scored.f32s("score").unwrap(), posted);
    let adv = read(&sd.join("adv.parquet"));
    let want = 0.5 / (0.5f32.sqrt() + 1e-6);
    let masks = adv.ragged_u8("response_mask").unwrap();
    let advs = adv.ragged_f32("advantages").unwrap();
    for (row, k) in posted.iter().enumerate() {
        let sign = if *k == 1.0 { 1.0 } else { -1.0 };
        for (a, m) in advs.row(row).iter().zip(masks.row(row)) {
            if *m == 1 {
                assert!((a - sign * want).abs() < 1e-5, "row {row}: {a}");
            }
        }
    }

    let dir = work(&spec);
    let d = dir.path();
    let o = pipeline(d, &[("AGENT_NO_REWARD", "1")]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    // The rows are in id order: find the one whose episode posted nothing.
    let rollout = read(&d.join("r/step-0001/rollout.parquet"));
    let score = rollout.column("score").unwrap();
    let row = (0..6).find(|&i| score.is_null(i)).unwrap();
    assert_eq!(score.null_count(), 1);
    let id = &strings(&rollout, "uid")[row];
    assert!(id.ends_with("-1"), "{id}");
    assert!(
        out.contains(&format!(
            "step-0001/rollout.parquet: column 'score', row {row}: no reward posted (trajectory '{id}')"
        )),
        "{out}"
    );
    assert!(!d.join("r/step-0001/scored.parquet").exists());
}

/// `reward = "agent"` without an agent to post the rewards, or with an evaluation (which runs
/// the rollout stage), is refused before anything runs.
#[test]
fn an_agent_reward_without_an_agent_is_refused() {
    let agent_reward = SPEC.replace("reward = \"regex:[a-z]\"", "reward = \"agent\"");
    let cases = [
        (
            agent_reward.replace("agent = \"cmd:python3 AGENT\"\n", ""),
            "reward = \"agent\" keeps the rewards your agent posts, which needs [rollout] agent",
        ),
        (
            agent_reward.replace(
                "prompts-per-step = 3",
                "prompts-per-step = 3\nval = \"train.parquet\"",
            ) + "[eval]\nevery = 1\n",
            "reward = \"agent\" with [eval] every = 1: the evaluation runs the rollout stage",
        ),
    ];
    for (spec, needle) in cases {
        let dir = work(&spec);
        let o = pipeline(dir.path(), &[]);
        let out = text(&o);
        assert_eq!(o.status.code(), Some(2), "{out}");
        assert!(out.contains(needle), "{out}");
        assert!(!dir.path().join("r/step-0001").exists());
    }
}

/// With `daemon = true` the agent's server generates on the warm daemon, with the policy the
/// daemon holds (the one after the last update, never written as files between checkpoints):
/// the two steps end with the files of the run without a daemon. On a daemon group (`gpus =
/// 2`, CPU ranks), which spreads each batch of the server over its ranks, an agent playing its
/// episodes at once samples the first step's trajectories of the one-process run.
#[test]
fn an_agent_on_the_daemon_ends_as_without_it() {
    let dir = work(SPEC);
    let d = dir.path();
    for (name, extra) in [
        ("warm", "daemon = true"),
        ("group", "daemon = true\ngpus = 2"),
    ] {
        let spec = std::fs::read_to_string(d.join("spec.toml")).unwrap();
        let spec = spec.replace("steps = 2", &format!("steps = 2\n{extra}"));
        std::fs::write(d.join(format!("{name}.toml")), spec).unwrap();
    }
    assert_ok(&pipeline(d, &[]));
    assert_ok(&pipeline_of(d, "warm.toml", "warm", &[]));
    let (a, b) = (d.join("r"), d.join("warm"));
    let log = std::fs::read_to_string(b.join("step-0002/agent/serve.log")).unwrap();
    assert!(log.contains("on the daemon at "), "{log}");
    let commands = std::fs::read_to_string(b.join("commands.sh")).unwrap();
    assert!(
        commands.contains("with `tandem serve` on 127.0.0.1 (generating on the daemon at "),
        "{commands}"
    );
    let (ca, cb) = (
        crate::pipeline::checkpoint_files(&a),
        crate::pipeline::checkpoint_files(&b),
    );
    assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
    for (k, v) in &ca {
        assert!(v == &cb[k], "{k} differs");
    }
    assert_eq!(crate::pipeline::state(&a), crate::pipeline::state(&b));
    let f =
        |r: &Path, step: u64, name: &str| read(&r.join(format!("step-{step:04}/{name}.parquet")));
    for step in [1, 2] {
        let (ra, rb) = (f(&a, step, "rollout"), f(&b, step, "rollout"));
        assert_eq!(strings(&ra, "uid"), strings(&rb, "uid"));
        assert_eq!(i32_rows(&ra, "response_ids"), i32_rows(&rb, "response_ids"));
        assert_eq!(u8_rows(&ra, "response_mask"), u8_rows(&rb, "response_mask"));
        assert_eq!(
            f32_rows(&ra, "rollout_logprobs"),
            f32_rows(&rb, "rollout_logprobs")
        );
        assert_eq!(ra.meta_u64("policy_version"), rb.meta_u64("policy_version"));
        let (aa, ab) = (f(&a, step, "adv"), f(&b, step, "adv"));
        assert_eq!(f32_rows(&aa, "advantages"), f32_rows(&ab, "advantages"));
    }

    assert_ok(&pipeline_of(
        d,
        "group.toml",
        "group",
        &[("AGENT_PARALLEL", "1")],
    ));
    let g = d.join("group");
    let (ra, rg) = (f(&a, 1, "rollout"), f(&g, 1, "rollout"));
    assert_eq!(strings(&ra, "uid"), strings(&rg, "uid"));
    assert_eq!(i32_rows(&ra, "response_ids"), i32_rows(&rg, "response_ids"));
    // Which requests decode together follows the timing: the log-probs by a few 1e-6.
    let (la, lg) = (
        f32_rows(&ra, "rollout_logprobs"),
        f32_rows(&rg, "rollout_logprobs"),
    );
    for (x, y) in la.iter().flatten().zip(lg.iter().flatten()) {
        assert!((x - y).abs() <= 2e-5, "{x} vs {y}");
    }
    assert!(g.join("ckpt/step-0002/model.safetensors").is_file());
}
