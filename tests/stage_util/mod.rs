//! Helpers shared by the stage and learning tests: tiny random models, prompt files, and
//! running the real binaries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::batch::{write_file, Batch};
use tandem::data::{ExtraInfo, Message, VerlRow};
use tandem::model::init::{InitModelArgs, Like};

/// A tiny random Qwen2 model (2 layers, hidden 64, 4/2 heads, vocab 300) with the generated
/// byte-level tokenizer and its ChatML template.
pub fn tiny_model(dir: &Path, seed: u64) -> PathBuf {
    tiny_model_like(dir, seed, Like::Qwen2, 0.02)
}

pub fn tiny_model_like(dir: &Path, seed: u64, like: Like, init_std: f32) -> PathBuf {
    let out = dir.join(format!("model-{seed}"));
    tandem::model::init::run(InitModelArgs {
        like,
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: Some(2),
        head_dim: None,
        ffn: 128,
        vocab: Some(300),
        tokenizer: None,
        tie: None,
        rope_theta: None,
        rms_norm_eps: None,
        max_position: 4096,
        init_std,
        seed,
        out: out.clone(),
        force: false,
    })
    .expect("init-model");
    out
}

/// A prompt file in verl's schema, one user message per prompt.
pub fn prompts(path: &Path, questions: &[&str]) {
    let rows: Vec<VerlRow> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| VerlRow {
            data_source: "test/echo".into(),
            prompt: vec![Message::new("user", *q)],
            ability: Some("echo".into()),
            ground_truth: format!("answer {i}"),
            extra_info: ExtraInfo {
                split: "train".into(),
                index: i as i64,
                answer: format!("answer {i}"),
                question: q.to_string(),
            },
        })
        .collect();
    let data = tandem::data::verl_record_batch(&rows).unwrap();
    write_file(path, &data, &Default::default()).unwrap();
}

pub fn bin(name: &str) -> &'static str {
    match name {
        "rollout" => env!("CARGO_BIN_EXE_rollout"),
        "ref-logprob" => env!("CARGO_BIN_EXE_ref-logprob"),
        "values" => env!("CARGO_BIN_EXE_values"),
        "update" => env!("CARGO_BIN_EXE_update"),
        "sync-weights" => env!("CARGO_BIN_EXE_sync-weights"),
        "score" => env!("CARGO_BIN_EXE_score"),
        "advantage" => env!("CARGO_BIN_EXE_advantage"),
        "tandem" => env!("CARGO_BIN_EXE_tandem"),
        other => panic!("no binary {other}"),
    }
}

/// Runs a stage binary with arguments (paths given as &Path or &str).
pub fn run<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> Output {
    Command::new(bin(name))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("spawn")
}

/// Runs and asserts success, echoing stderr on failure.
pub fn ok<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> Output {
    let out = run(name, args);
    assert!(
        out.status.success(),
        "{name} failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs and asserts exit code 2 with a message containing `needle`; returns stderr.
pub fn input_error<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S], needle: &str) -> String {
    let out = run(name, args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{name}: expected exit 2, stderr:\n{err}"
    );
    assert!(
        err.contains(needle),
        "{name}: stderr lacks {needle:?}:\n{err}"
    );
    err
}

pub fn read(path: &Path) -> Batch {
    Batch::read(path, &[]).unwrap()
}

/// Rows of a list<float32> column.
pub fn f32_rows(b: &Batch, col: &str) -> Vec<Vec<f32>> {
    b.ragged_f32(col)
        .unwrap()
        .rows()
        .map(|r| r.to_vec())
        .collect()
}

/// Rows of a list<uint8> column.
pub fn u8_rows(b: &Batch, col: &str) -> Vec<Vec<u8>> {
    b.ragged_u8(col)
        .unwrap()
        .rows()
        .map(|r| r.to_vec())
        .collect()
}

/// Rows of a list<int32> column.
pub fn i32_rows(b: &Batch, col: &str) -> Vec<Vec<i32>> {
    b.ragged_i32(col)
        .unwrap()
        .rows()
        .map(|r| r.to_vec())
        .collect()
}

pub fn strings(b: &Batch, col: &str) -> Vec<String> {
    b.strings(col)
        .unwrap()
        .into_iter()
        .map(String::from)
        .collect()
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Writes `input` with the column `col` set to `array` (added, or replacing the input's),
/// keeping the other columns and the metadata, as a stage would.
pub fn with_column(input: &Path, out: &Path, col: &str, array: arrow_array::ArrayRef) {
    let mut cols = tandem::batch::NewColumns::new();
    cols.add(col, array);
    read(input)
        .write_derived(
            out,
            cols,
            &tandem::batch::StageInfo {
                stage: "test",
                params: serde_json::json!({}),
                policy_version: None,
                step: None,
            },
        )
        .unwrap();
}

/// [`with_column`] for a list<float32> column given by rows.
pub fn with_f32_rows(input: &Path, out: &Path, col: &str, rows: &[Vec<f32>]) {
    let offsets: Vec<usize> = std::iter::once(0)
        .chain(rows.iter().scan(0, |n, r| {
            *n += r.len();
            Some(*n)
        }))
        .collect();
    let values: Vec<f32> = rows.concat();
    let array = tandem::batch::list_array::<arrow_array::types::Float32Type>(&offsets, values);
    with_column(input, out, col, array);
}

/// Adds advantages (+1 for even rows, −1 for odd ones, on every response token), as the
/// advantage stage would.
pub fn add_advantages(input: &Path, out: &Path) {
    let rows: Vec<Vec<f32>> = i32_rows(&read(input), "response_ids")
        .iter()
        .enumerate()
        .map(|(i, r)| vec![if i % 2 == 0 { 1.0 } else { -1.0 }; r.len()])
        .collect();
    with_f32_rows(input, out, "advantages", &rows);
}

/// `d/model`: a random 2-layer Qwen2-shaped model of this width (4 heads, 2 kv heads, vocab 300,
/// seed 0); and `d/train.parquet`: `n` one-digit additions (seed 1).
pub fn model_and_train_set(d: &Path, hidden: usize, ffn: usize, n: usize) {
    let (h, f, n) = (hidden.to_string(), ffn.to_string(), n.to_string());
    let model = [
        "init-model",
        "--like",
        "qwen2",
        "--layers",
        "2",
        "--hidden",
        &h,
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        &f,
        "--vocab",
        "300",
        "--seed",
        "0",
        "--out",
        "model",
    ];
    let train = [
        "prepare",
        "synth",
        "--task",
        "add",
        "--digits",
        "1",
        "--n",
        &n,
        "--seed",
        "1",
        "--out",
        "train.parquet",
    ];
    for args in [&model[..], &train[..]] {
        let o = Command::new(bin("tandem"))
            .args(args)
            .current_dir(d)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "tandem {}: {err}", args[0]);
    }
}
