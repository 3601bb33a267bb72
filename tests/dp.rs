//! Data-parallel rollout and ref-logprob through the real binaries under `tandem launch` (CPU
//! ranks): every rank generates or scores its contiguous block of prompts (the n samples of a
//! prompt on one rank) and rank 0 writes one file with the same rows in the same order as one
//! process writes, for 1, 2 and 3 ranks; one rank under the launcher is the plain path; bad
//! input under the launcher is exit 2 naming a rank, with no output file; a pipeline with
//! `gpus = 2` runs end to end on CPU ranks.

mod stage_util;

use stage_util::*;
use std::path::Path;
use std::process::{Command, Output};
use tandem::batch::{schema, Batch};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// Five prompts: 3 ranks take 2, 2 and 1 of them.
const QUESTIONS: [&str; 5] = [
    "What is 2 + 3?",
    "Name a colour.",
    "Count to three.",
    "Spell cat.",
    "Say hello.",
];

/// `stage args` under `tandem launch --nproc-per-node n`, without the launcher variables of
/// the environment the tests run in.
fn launch(n: usize, stage: &str, args: &[&str]) -> Output {
    let mut c = Command::new(TANDEM);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_JOB_ID",
        "TANDEM_DAEMON",
    ] {
        c.env_remove(k);
    }
    c.env("RAYON_NUM_THREADS", "1")
        .args([
            "launch",
            "--nproc-per-node",
            &n.to_string(),
            "--",
            bin(stage),
        ])
        .args(args)
        .output()
        .unwrap()
}

fn launch_ok(n: usize, stage: &str, args: &[&str]) -> Output {
    let out = launch(n, stage, args);
    assert!(
        out.status.success(),
        "{stage} on {n} ranks failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every column of `b` equal to `a`'s: the integer and text columns exactly, the float lists
/// to 1e-5 (the CPU GEMM blocks rows by the row count of a step, which the split changes).
fn same_rows(a: &Batch, b: &Batch, what: &str) {
    let (ra, rb) = (&a.data, &b.data);
    assert_eq!(
        ra.schema().fields(),
        rb.schema().fields(),
        "{what}: columns"
    );
    assert_eq!(ra.num_rows(), rb.num_rows(), "{what}: rows");
    for field in ra.schema().fields() {
        let name = field.name();
        let close = matches!(
            name.as_str(),
            schema::ROLLOUT_LOGPROBS | "ref_logprobs" | "old_logprobs" | "entropy"
        );
        if close {
            for (i, (x, y)) in f32_rows(a, name).iter().zip(f32_rows(b, name)).enumerate() {
                assert_eq!(x.len(), y.len(), "{what}: {name}, row {i}");
                for (u, v) in x.iter().zip(&y) {
                    assert!((u - v).abs() < 1e-5, "{what}: {name}, row {i}: {u} vs {v}");
                }
            }
        } else {
            assert_eq!(
                ra.column_by_name(name).unwrap().to_data(),
                rb.column_by_name(name).unwrap().to_data(),
                "{what}: column {name}"
            );
        }
    }
}

fn rollout_args<'a>(model: &'a Path, input: &'a Path, out: &'a Path, m: &'a Path) -> Vec<&'a str> {
    vec![
        "--model",
        p(model),
        "--in",
        p(input),
        "--out",
        p(out),
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--seed",
        "11",
        "--metrics",
        p(m),
    ]
}

fn ref_args<'a>(model: &'a Path, input: &'a Path, out: &'a Path) -> Vec<&'a str> {
    vec![
        "--model",
        p(model),
        "--in",
        p(input),
        "--out",
        p(out),
        "--column",
        "ref_logprobs",
        "--entropy",
    ]
}

#[test]
fn rollout_and_ref_logprob_rows_do_not_depend_on_the_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let input = dir.path().join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let d = dir.path();

    // One process, no launcher: the reference rows.
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let one_rows = read(&one);
    assert_eq!(one_rows.num_rows(), 2 * QUESTIONS.len());
    let one_ref = d.join("one-ref.parquet");
    ok("ref-logprob", &ref_args(&model, &one, &one_ref));
    let one_ref_rows = read(&one_ref);

    for n in [1, 2, 3] {
        let (out, m) = (
            d.join(format!("r{n}.parquet")),
            d.join(format!("r{n}.json")),
        );
        launch_ok(n, "rollout", &rollout_args(&model, &input, &out, &m));
        same_rows(&one_rows, &read(&out), &format!("rollout, {n} ranks"));
        let metrics: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
        assert_eq!(metrics["ranks"], n, "{metrics}");
        // The work of every rank is counted once.
        let one_metrics: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&one_m).unwrap()).unwrap();
        assert_eq!(metrics["prefills"], one_metrics["prefills"], "{metrics}");
        // Only rank 0 wrote: no other file beside the output.
        let written: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|f| f.starts_with(&format!("r{n}")))
            .collect();
        assert_eq!(written.len(), 2, "{written:?}");

        // Scoring the one-process rollout on n ranks gives the one-process scores.
        let scored = d.join(format!("ref{n}.parquet"));
        launch_ok(n, "ref-logprob", &ref_args(&model, &one, &scored));
        same_rows(
            &one_ref_rows,
            &read(&scored),
            &format!("ref-logprob, {n} ranks"),
        );
    }
}

/// Fewer prompts than ranks: a rank with no prompt loads nothing and hands over no rows.
#[test]
fn ranks_without_a_prompt_take_part_all_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS[..2]);
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let (three, m) = (d.join("three.parquet"), d.join("three.json"));
    launch_ok(3, "rollout", &rollout_args(&model, &input, &three, &m));
    same_rows(&read(&one), &read(&three), "rollout, 2 prompts on 3 ranks");
    let (ref1, ref3) = (d.join("ref1.parquet"), d.join("ref3.parquet"));
    ok("ref-logprob", &ref_args(&model, &one, &ref1));
    launch_ok(3, "ref-logprob", &ref_args(&model, &one, &ref3));
    same_rows(
        &read(&ref1),
        &read(&ref3),
        "ref-logprob, 2 prompts on 3 ranks",
    );
}

#[test]
fn bad_input_under_the_launcher_is_exit_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let d = dir.path();
    let missing = d.join("missing.parquet");
    let out = d.join("out.parquet");
    let r = launch(2, "ref-logprob", &ref_args(&model, &missing, &out));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("missing.parquet"), "{err}");
    assert!(err.contains("error: rank"), "{err}");
    assert!(!out.exists());
    // A prompt file that is no Parquet file: every rank refuses it before generating.
    let no_prompts = d.join("no-prompts.parquet");
    std::fs::write(&no_prompts, "not parquet").unwrap();
    let (out, m) = (d.join("bad.parquet"), d.join("bad.json"));
    let r = launch(3, "rollout", &rollout_args(&model, &no_prompts, &out, &m));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("no-prompts.parquet"), "{err}");
    assert!(!out.exists() && !m.exists());
    // --daemon under a launcher: every rank would send the job; refused.
    let mut args = rollout_args(&model, &no_prompts, &out, &m);
    args.extend(["--daemon", "nowhere.sock"]);
    let r = launch(2, "rollout", &args);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--daemon nowhere.sock under a launcher"),
        "{err}"
    );
    assert!(!out.exists());
}

/// `d/model` (2 layers, hidden 64, vocab 300) and `d/train.parquet` (one-digit additions).
fn model_and_train_set(d: &Path) {
    for args in [
        &[
            "init-model",
            "--like",
            "qwen2",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "128",
            "--vocab",
            "300",
            "--seed",
            "0",
            "--out",
            "model",
        ][..],
        &[
            "prepare",
            "synth",
            "--task",
            "add",
            "--digits",
            "1",
            "--n",
            "20",
            "--seed",
            "1",
            "--out",
            "train.parquet",
        ],
    ] {
        let o = Command::new(TANDEM)
            .args(args)
            .current_dir(d)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");

/// A two-step GRPO pipeline (with the old-logprob pass) at `gpus = 1` and `gpus = 2` on the
/// CPU: the `gpus = 2` run starts rollout, ref-logprob and update under `tandem launch`, its
/// rollouts are shared by 2 ranks, and its first step's samples are the 1-rank run's. Bad
/// `gpus` / `nodes` values are refused naming the key before anything runs.
#[test]
fn a_gpus_2_pipeline_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d);
    let bins = Path::new(TANDEM).parent().unwrap();
    let spec = |top: &str| {
        format!(
            r#"
seed = 3
steps = 2
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
mini-batch-size = 3
"#
        )
    };
    let run = |name: &str, text: &str, extra: &[&str]| {
        std::fs::write(d.join(format!("{name}.toml")), text).unwrap();
        Command::new(PIPELINE)
            .current_dir(d)
            .args(["run", &format!("{name}.toml"), "--run-dir", name])
            .args(extra)
            .env("TANDEM_BIN_DIR", bins)
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("WORLD_SIZE")
            .env_remove("RANK")
            .output()
            .unwrap()
    };
    for (name, top) in [("one", ""), ("two", "gpus = 2")] {
        let o = run(name, &spec(top), &[]);
        assert!(
            o.status.success(),
            "{name}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let commands = std::fs::read_to_string(d.join("two/commands.sh")).unwrap();
    for stage in ["/rollout ", "/ref-logprob ", "/update "] {
        let lines: Vec<&str> = commands.lines().filter(|l| l.contains(stage)).collect();
        assert_eq!(lines.len(), 2, "{stage}: {commands}");
        assert!(
            lines
                .iter()
                .all(|l| l.contains(" launch --nproc-per-node 2 -- ")),
            "{stage}: {commands}"
        );
    }
    // score, advantage and sync-weights stay single processes.
    for stage in ["/score ", "/advantage ", "/sync-weights "] {
        assert!(
            commands
                .lines()
                .filter(|l| l.contains(stage))
                .all(|l| !l.contains(" launch ")),
            "{stage}: {commands}"
        );
    }
    let one_cmds = std::fs::read_to_string(d.join("one/commands.sh")).unwrap();
    assert!(!one_cmds.contains(" launch "), "{one_cmds}");
    for step in ["step-0001", "step-0002"] {
        let m: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(d.join("two").join(step).join("metrics/rollout.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(m["ranks"], 2, "{m}");
    }
    // The first step samples from the same model: the same rows.
    let (a, b) = (
        read(&d.join("one/step-0001/rollout.parquet")),
        read(&d.join("two/step-0001/rollout.parquet")),
    );
    same_rows(&a, &b, "step 1 rollout");
    assert!(d.join("two/step-0002/old.parquet").exists());

    for (top, want) in [
        (
            "nodes = 2",
            "nodes = 2: a pipeline runs on one machine for now (nodes = 1)",
        ),
        ("gpus = 0", "gpus must be at least 1"),
        (
            "gpus = 2\ndaemon = true",
            "gpus = 2 with daemon = true: one daemon per GPU is not there yet; set daemon = false",
        ),
    ] {
        let o = run("refused", &spec(top), &["--dry-run"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{top}: {err}");
        assert!(err.contains(want), "{top}: {err}");
        assert!(!d.join("refused").exists());
    }
}

/// The ranks started by hand with torchrun's variables (no `tandem launch`) share the rollout
/// the same way: rank 0 writes the one-process rows; the other rank writes nothing.
#[test]
fn torchrun_variables_share_the_rollout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let (out, m) = (d.join("two.parquet"), d.join("two.json"));
    let args = rollout_args(&model, &input, &out, &m);
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(bin("rollout"))
                .args(&args)
                .env("RAYON_NUM_THREADS", "1")
                .env_remove("TANDEM_DAEMON")
                .envs([
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_RANK", r.to_string()),
                    ("LOCAL_WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // Only rank 0 reports the rollout.
    assert!(String::from_utf8_lossy(&outs[0].stderr).contains("rollout: 5 prompts x 2"));
    assert!(!String::from_utf8_lossy(&outs[1].stderr).contains("rollout: 5 prompts"));
    same_rows(&read(&one), &read(&out), "rollout, torchrun variables");
}
