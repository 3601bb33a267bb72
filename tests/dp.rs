//! Data-parallel rollout and ref-logprob through the real binaries under `tandem launch` (CPU
//! ranks): every rank generates or scores its contiguous block of prompts (the n samples of a
//! prompt on one rank) and rank 0 writes one file with the same rows in the same order as one
//! process writes, for 1, 2 and 3 ranks; one rank under the launcher is the plain path; bad
//! input under the launcher is exit 2 naming a rank, with no output file.

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
}
