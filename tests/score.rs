//! The real `score` binary on small batch files made here.

use arrow_array::cast::AsArray;
use arrow_array::types::Float32Type;
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field, Schema};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem::batch::{schema, write_file, Batch};

fn strings(v: &[&str]) -> ArrayRef {
    Arc::new(StringArray::from(v.to_vec()))
}

fn write_batch(path: &Path, cols: Vec<(&str, ArrayRef)>) {
    let fields: Vec<Field> = cols
        .iter()
        .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
        .collect();
    let data = RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        cols.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap();
    write_file(path, &data, &BTreeMap::new()).unwrap();
}

/// A batch with response_text, ground_truth and data_source.
fn simple_batch(dir: &Path, texts: &[&str], gts: &[&str], sources: &[&str]) -> PathBuf {
    let path = dir.join("in.parquet");
    write_batch(
        &path,
        vec![
            (schema::RESPONSE_TEXT, strings(texts)),
            (schema::GROUND_TRUTH, strings(gts)),
            (schema::DATA_SOURCE, strings(sources)),
        ],
    );
    path
}

fn score(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_score"))
        .args(args)
        .output()
        .unwrap()
}

fn run_ok(input: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--in",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = score(&args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "score {extra:?} failed: {stderr}");
    stderr
}

/// Run expecting bad input: exit code 2, no output file; returns stderr.
fn run_bad(input: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--in",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = score(&args);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{extra:?}: {stderr}");
    assert!(!out.exists(), "an output was written despite: {stderr}");
    assert!(!tandem::batch::write::temp_path(out).exists());
    stderr
}

fn read_col(path: &Path, name: &str) -> Vec<f32> {
    let b = Batch::read(path, &[name]).unwrap();
    b.f32s(name).unwrap()
}

fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

#[test]
fn gsm8k_scores_metrics_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let texts = [
        "3 + 4 = 7\n#### 7",
        "#### 1,200",
        "#### 8",
        "I think it is 7",
        "#### 5 wait #### 6",
    ];
    let gts = ["7", "1200", "9", "7", "6"];
    let srcs = [
        "openai/gsm8k",
        "openai/gsm8k",
        "openai/gsm8k",
        "other",
        "other",
    ];
    let input = simple_batch(dir.path(), &texts, &gts, &srcs);
    let out = dir.path().join("out.parquet");
    let metrics = dir.path().join("m.json");
    let stderr = run_ok(
        &input,
        &out,
        &[
            "--reward",
            "gsm8k",
            "--format-score",
            "0.1",
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    assert_eq!(read_col(&out, schema::SCORE), [1.0, 1.0, 0.1, 0.0, 1.0]);

    // Input columns kept, stage parameters recorded.
    let b = Batch::read(&out, &[schema::RESPONSE_TEXT]).unwrap();
    assert_eq!(b.strings(schema::RESPONSE_TEXT).unwrap(), texts);
    let params: serde_json::Value = serde_json::from_str(&b.meta["tandem.stage.score"]).unwrap();
    assert_eq!(params["reward"], "gsm8k");
    assert_eq!(params["gsm8k_method"], "strict");
    assert!((params["format_score"].as_f64().unwrap() - 0.1).abs() < 1e-6);

    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(m["score/rows"], 5);
    assert_eq!(m["score/accuracy"], 0.6);
    assert!((m["score/mean"].as_f64().unwrap() - 0.62).abs() < 1e-6);
    assert!((m["score/accuracy/openai/gsm8k"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9);
    assert_eq!(m["score/accuracy/other"], 0.5);
    assert!(m["score/rows_per_s"].as_f64().unwrap() > 0.0);

    assert!(stderr.contains("score: 5 rows"), "{stderr}");
    assert!(stderr.contains("openai/gsm8k: 3 rows"), "{stderr}");
    assert!(stderr.contains("rows/s"), "{stderr}");
}

#[test]
fn gsm8k_flexible_on_a_verl_schema_batch() {
    // verl's layout: the ground truth inside `reward_model`, extra_info a struct.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("verl.parquet");
    let rm = StructArray::from(vec![
        (
            Arc::new(Field::new("style", DataType::Utf8, true)),
            strings(&["rule", "rule"]),
        ),
        (
            Arc::new(Field::new("ground_truth", DataType::Utf8, true)),
            strings(&["18", "3"]),
        ),
    ]);
    let extra = StructArray::from(vec![(
        Arc::new(Field::new("index", DataType::Int64, true)),
        Arc::new(Int64Array::from(vec![0, 1])) as ArrayRef,
    )]);
    write_batch(
        &input,
        vec![
            ("data_source", strings(&["openai/gsm8k", "openai/gsm8k"])),
            ("reward_model", Arc::new(rm)),
            ("extra_info", Arc::new(extra)),
            (
                schema::RESPONSE_TEXT,
                strings(&["She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18", "it is 4."]),
            ),
        ],
    );
    let out = dir.path().join("out.parquet");
    run_ok(
        &input,
        &out,
        &[
            "--reward",
            "gsm8k",
            "--gsm8k-method",
            "flexible",
            "--format-score",
            "-0.5",
        ],
    );
    assert_eq!(read_col(&out, schema::SCORE), [1.0, -0.5]);
}

#[test]
fn gsm8k_flexible_score_is_the_python_format_reward() {
    // `--flexible-score 0.5 --format-score 0.1` is the rule of
    // pipelines/rewards/gsm8k_format.py, built in: the same scores on the same rows.
    let dir = tempfile::tempdir().unwrap();
    let texts = [
        "3 + 4 = 7\n#### 7",
        "#### 1,200",
        "#### 8",
        "I think it is 7",
        "so \\boxed{9}.",
        "#### 5 and then 6",
        "it is 1,200 eggs",
        "nothing",
    ];
    let gts = ["7", "1200", "9", "7", "9", "6", "1200", "3"];
    let input = indexed_batch(dir.path(), &texts, &gts);
    let (ours, python) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
    let metrics = dir.path().join("m.json");
    let m = metrics.to_str().unwrap();
    let args = [
        "--reward",
        "gsm8k",
        "--format-score",
        "0.1",
        "--flexible-score",
        "0.5",
    ];
    run_ok(&input, &ours, &[&args[..], &["--metrics", m]].concat());
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/pipelines/rewards/gsm8k_format.py"
    );
    run_ok(&input, &python, &["--reward", &format!("python:{file}")]);
    let want = [1.0, 1.0, 0.1, 0.5, 0.5, 0.1, 0.0, 0.0];
    assert_eq!(read_col(&ours, schema::SCORE), want);
    assert_eq!(read_col(&python, schema::SCORE), want);
    // Accuracy (score >= 1) stays the strict one.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(m["score/accuracy"], 0.25);
    let b = Batch::read(&ours, &[schema::SCORE]).unwrap();
    let params: serde_json::Value = serde_json::from_str(&b.meta["tandem.stage.score"]).unwrap();
    assert!((params["flexible_score"].as_f64().unwrap() - 0.5).abs() < 1e-6);

    // It is a tier of the strict method only.
    let err = run_bad(
        &input,
        &dir.path().join("c.parquet"),
        &[
            "--reward",
            "gsm8k",
            "--gsm8k-method",
            "flexible",
            "--flexible-score",
            "0.5",
        ],
    );
    assert!(
        err.contains("--flexible-score is the tier below --gsm8k-method strict"),
        "{err}"
    );
    let err = run_bad(
        &input,
        &dir.path().join("c.parquet"),
        &["--reward", "gsm8k", "--flexible-score", "nan"],
    );
    assert!(err.contains("--flexible-score"), "{err}");
}

#[test]
fn math_exact_and_regex() {
    let dir = tempfile::tempdir().unwrap();
    let texts = [
        "so $\\boxed{\\dfrac{1}{2}}$",
        "\\boxed{90^\\circ}",
        "\\boxed{12.0}",
        "\\boxed{\\frac{\\sqrt{3}}{2}} is wrong, \\boxed{7}",
        "no box",
    ];
    let gts = ["\\frac12", "90", "12", "\\frac{\\sqrt{3}}{2}", "7"];
    let srcs = ["m"; 5];
    let input = simple_batch(dir.path(), &texts, &gts, &srcs);
    let out = dir.path().join("math.parquet");
    run_ok(&input, &out, &["--reward", "math", "--format-score", "0.1"]);
    assert_eq!(read_col(&out, schema::SCORE), [1.0, 1.0, 1.0, 0.1, 0.0]);

    let input = simple_batch(
        dir.path(),
        &[" Paris\n", "paris", "Answer: 12 ... Answer: 13", "nothing"],
        &["Paris", "Paris", "13", "13"],
        &["q"; 4],
    );
    let out = dir.path().join("exact.parquet");
    run_ok(&input, &out, &["--reward", "exact"]);
    assert_eq!(read_col(&out, schema::SCORE), [1.0, 0.0, 0.0, 0.0]);

    let out = dir.path().join("regex.parquet");
    run_ok(
        &input,
        &out,
        &["--reward", "regex:Answer: (\\d+)", "--format-score", "0.2"],
    );
    assert_eq!(read_col(&out, schema::SCORE), [0.0, 0.0, 1.0, 0.0]);
}

#[test]
fn cmd_program_with_sub_scores() {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        "judge.py",
        r#"import json, sys
for line in sys.stdin:
    r = json.loads(line)
    ok = r["solution_str"].strip() == r["ground_truth"]
    print(json.dumps({"score": 1.0 if ok else -1.0, "acc": ok, "len": len(r["solution_str"]),
                      "why": "a string is kept", "src_ok": r["data_source"] == "s"}), flush=True)
"#,
    );
    let input = simple_batch(
        dir.path(),
        &["a", "bb ", "c"],
        &["a", "bb", "x"],
        &["s", "s", "t"],
    );
    let out = dir.path().join("out.parquet");
    let metrics = dir.path().join("m.json");
    let spec = format!("cmd:python3 {}", script.display());
    run_ok(
        &input,
        &out,
        &["--reward", &spec, "--metrics", metrics.to_str().unwrap()],
    );
    assert_eq!(read_col(&out, schema::SCORE), [1.0, 1.0, -1.0]);
    assert_eq!(read_col(&out, "score_acc"), [1.0, 1.0, 0.0]);
    assert_eq!(read_col(&out, "score_len"), [1.0, 3.0, 1.0]);
    assert_eq!(read_col(&out, "score_src_ok"), [1.0, 1.0, 0.0]);
    // A string value becomes a text column (verl keeps it in reward_extra_info).
    let b = Batch::read(&out, &[]).unwrap();
    assert_eq!(b.strings("score_why").unwrap(), ["a string is kept"; 3]);
    // Accuracy comes from `acc`, not from score >= 1.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert!((m["score/accuracy"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9);
    assert_eq!(m["score/accuracy/t"], 0.0);
    assert_eq!(m["score_len/mean"], 5.0 / 3.0);
}

#[test]
fn cmd_program_that_crashes_names_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(
        dir.path(),
        "crash.sh",
        "read -r l; echo 1\nread -r l; echo 0.5\nread -r l; echo 'cannot parse row' >&2; exit 7\n",
    );
    let input = simple_batch(dir.path(), &["a", "b", "c", "d"], &["a"; 4], &["s"; 4]);
    let out = dir.path().join("out.parquet");
    let spec = format!("cmd:sh {}", script.display());
    let err = run_bad(&input, &out, &["--reward", &spec]);
    assert!(err.contains("in.parquet"), "{err}");
    assert!(err.contains("row 2"), "{err}");
    assert!(err.contains("exit status: 7"), "{err}");
    assert!(err.contains("cannot parse row"), "{err}");
}

#[test]
fn cmd_program_that_hangs_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &["a", "b"], &["a"; 2], &["s"; 2]);
    let out = dir.path().join("out.parquet");
    let t = Instant::now();
    let err = run_bad(
        &input,
        &out,
        &[
            "--reward",
            "cmd:sh -c 'read -r l; echo 1; sleep 60'",
            "--timeout-ms",
            "300",
        ],
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(err.contains("row 1"), "{err}");
    assert!(err.contains("no answer within 300 ms"), "{err}");
}

#[test]
fn cmd_program_that_prints_garbage_or_nan() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &["a", "b"], &["a"; 2], &["s"; 2]);
    let out = dir.path().join("out.parquet");
    let err = run_bad(
        &input,
        &out,
        &[
            "--reward",
            "cmd:sh -c 'echo 1; echo \"Score: great\"; cat >/dev/null'",
        ],
    );
    assert!(err.contains("row 1"), "{err}");
    assert!(err.contains("`Score: great`, which is not JSON"), "{err}");

    let err = run_bad(
        &input,
        &out,
        &[
            "--reward",
            "cmd:sh -c 'echo \"{\\\"score\\\": NaN}\"; cat >/dev/null'",
        ],
    );
    assert!(err.contains("row 0"), "{err}");
    assert!(err.contains("NaN or infinite"), "{err}");

    let err = run_bad(
        &input,
        &out,
        &[
            "--reward",
            "cmd:sh -c 'echo \"{\\\"acc\\\": 1}\"; cat >/dev/null'",
        ],
    );
    assert!(err.contains("row 0"), "{err}");
    assert!(err.contains("without a \"score\" key"), "{err}");
}

const VERL_FLOAT_REWARD: &str = r#"
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl reward files print freely; this must not break the protocol.
    print("[debug]", data_source, extra_info)
    m = re.findall(r"answer: (\S+)", solution_str)
    if not m:
        return 0
    return 1.0 if m[-1] == ground_truth else 0.25 * (extra_info["index"] + 1)
"#;

const VERL_DICT_REWARD: &str = r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.split()[-1]
    correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}

def judge_with_bonus(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str == ground_truth) + bonus

def broken(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "bad":
        raise ValueError("cannot judge " + solution_str)
    return 1
"#;

fn indexed_batch(dir: &Path, texts: &[&str], gts: &[&str]) -> PathBuf {
    let path = dir.join("in.parquet");
    let n = texts.len() as i64;
    let extra = StructArray::from(vec![(
        Arc::new(Field::new("index", DataType::Int64, true)),
        Arc::new(Int64Array::from((0..n).collect::<Vec<_>>())) as ArrayRef,
    )]);
    write_batch(
        &path,
        vec![
            (schema::RESPONSE_TEXT, strings(texts)),
            (schema::GROUND_TRUTH, strings(gts)),
            (schema::DATA_SOURCE, strings(&vec!["src"; texts.len()])),
            (schema::EXTRA_INFO, Arc::new(extra)),
        ],
    );
    path
}

#[test]
fn python_reward_returning_a_float() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_script(dir.path(), "my_reward.py", VERL_FLOAT_REWARD);
    let input = indexed_batch(
        dir.path(),
        &["answer: 4", "answer: 5", "no idea", "answer: x answer: 9"],
        &["4", "4", "4", "7"],
    );
    let out = dir.path().join("out.parquet");
    let spec = format!("python:{}", file.display());
    let stderr = run_ok(&input, &out, &["--reward", &spec]);
    assert_eq!(read_col(&out, schema::SCORE), [1.0, 0.5, 0.0, 1.0]);
    // What the function printed went to stderr, with extra_info as a dict.
    assert!(stderr.contains("[debug] src {'index': 3"), "{stderr}");
}

#[test]
fn python_reward_returning_a_dict_and_named_functions() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_script(dir.path(), "rewards.py", VERL_DICT_REWARD);
    let input = indexed_batch(dir.path(), &["so 12", "so 13", "bad"], &["12", "12", "bad"]);
    let out = dir.path().join("out.parquet");
    let metrics = dir.path().join("m.json");
    let spec = format!("python:{}", file.display());
    run_ok(
        &input,
        &out,
        &["--reward", &spec, "--metrics", metrics.to_str().unwrap()],
    );
    assert_eq!(read_col(&out, schema::SCORE), [1.0, -1.0, 1.0]);
    assert_eq!(read_col(&out, "score_acc"), [1.0, 0.0, 1.0]);
    // The predicted answer (a string) is kept as the text column score_pred, not dropped.
    assert_eq!(
        Batch::read(&out, &[])
            .unwrap()
            .strings("score_pred")
            .unwrap(),
        ["12", "13", "bad"]
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert!((m["score/accuracy/src"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9);

    // FILE:FUNC with keyword arguments (verl's reward_kwargs).
    let spec = format!("python:{}:judge_with_bonus", file.display());
    run_ok(
        &input,
        &out,
        &["--reward", &spec, "--reward-kwargs", r#"{"bonus": 0.5}"#],
    );
    assert_eq!(read_col(&out, schema::SCORE), [0.5, 0.5, 1.5]);
}

#[test]
fn python_reward_that_raises_names_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_script(dir.path(), "rewards.py", VERL_DICT_REWARD);
    let input = indexed_batch(dir.path(), &["ok", "fine", "bad", "ok"], &["x"; 4]);
    let out = dir.path().join("out.parquet");
    let spec = format!("python:{}:broken", file.display());
    let err = run_bad(&input, &out, &["--reward", &spec]);
    assert!(err.contains("row 2"), "{err}");
    assert!(err.contains("ValueError: cannot judge bad"), "{err}");

    let spec = format!("python:{}:no_such_fn", file.display());
    let err = run_bad(&input, &out, &["--reward", &spec]);
    assert!(err.contains("row 0"), "{err}");
    assert!(err.contains("has no function named 'no_such_fn'"), "{err}");
}

#[test]
fn bad_input_is_exit_2_with_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.parquet");

    let missing = dir.path().join("missing.parquet");
    let err = run_bad(&missing, &out, &["--reward", "gsm8k"]);
    assert!(err.contains("missing.parquet: cannot open"), "{err}");

    let no_text = dir.path().join("no_text.parquet");
    write_batch(&no_text, vec![(schema::GROUND_TRUTH, strings(&["1"]))]);
    let err = run_bad(&no_text, &out, &["--reward", "gsm8k"]);
    assert!(
        err.contains("no_text.parquet: column 'response_text' is missing"),
        "{err}"
    );

    let wrong_type = dir.path().join("wrong_type.parquet");
    write_batch(
        &wrong_type,
        vec![
            (
                schema::RESPONSE_TEXT,
                Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef,
            ),
            (schema::GROUND_TRUTH, strings(&["1", "2"])),
        ],
    );
    let err = run_bad(&wrong_type, &out, &["--reward", "gsm8k"]);
    assert!(
        err.contains("wrong_type.parquet: column 'response_text': expected utf8, found Int64"),
        "{err}"
    );

    let no_gt = dir.path().join("no_gt.parquet");
    write_batch(&no_gt, vec![(schema::RESPONSE_TEXT, strings(&["#### 1"]))]);
    let err = run_bad(&no_gt, &out, &["--reward", "math"]);
    assert!(err.contains("no_gt.parquet: no ground truth"), "{err}");

    let null_gt = dir.path().join("null_gt.parquet");
    write_batch(
        &null_gt,
        vec![
            (schema::RESPONSE_TEXT, strings(&["#### 1", "#### 2"])),
            (
                schema::GROUND_TRUTH,
                Arc::new(StringArray::from(vec![Some("1"), None])) as ArrayRef,
            ),
        ],
    );
    let err = run_bad(&null_gt, &out, &["--reward", "gsm8k"]);
    assert!(
        err.contains("column 'ground_truth', row 1: ground truth is null"),
        "{err}"
    );

    let null_text = dir.path().join("null_text.parquet");
    write_batch(
        &null_text,
        vec![
            (
                schema::RESPONSE_TEXT,
                Arc::new(StringArray::from(vec![Some("#### 1"), None])) as ArrayRef,
            ),
            (schema::GROUND_TRUTH, strings(&["1", "2"])),
        ],
    );
    let err = run_bad(&null_text, &out, &["--reward", "exact"]);
    assert!(
        err.contains("column 'response_text', row 1: value is null"),
        "{err}"
    );

    // External rewards need data_source.
    let err = run_bad(&no_gt, &out, &["--reward", "cmd:cat"]);
    assert!(err.contains("column 'data_source' is missing"), "{err}");

    // Bad flags.
    let ok = simple_batch(dir.path(), &["#### 1"], &["1"], &["s"]);
    let err = run_bad(&ok, &out, &["--reward", "gsm9k"]);
    assert!(err.contains("unknown reward"), "{err}");
    let err = run_bad(&ok, &out, &["--reward", "regex:(oops"]);
    assert!(err.contains("invalid pattern"), "{err}");
    let err = run_bad(&ok, &out, &["--reward", "cmd:/nonexistent/judge"]);
    assert!(err.contains("cannot start `/nonexistent/judge`"), "{err}");
    let err = run_bad(&ok, &out, &["--reward", "python:nope.py"]);
    assert!(err.contains("no such file"), "{err}");
    let err = run_bad(&ok, &out, &["--reward", "gsm8k", "--format-score", "nan"]);
    assert!(err.contains("--format-score"), "{err}");
    let err = run_bad(&ok, &out, &["--reward", "gsm8k", "--reward-kwargs", "{"]);
    assert!(err.contains("--reward-kwargs"), "{err}");
}

#[test]
fn rescoring_replaces_the_score_column() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &["#### 1", "#### 2"], &["1", "1"], &["s", "s"]);
    let once = dir.path().join("once.parquet");
    let twice = dir.path().join("twice.parquet");
    run_ok(&input, &once, &["--reward", "gsm8k"]);
    run_ok(
        &once,
        &twice,
        &["--reward", "gsm8k", "--format-score", "0.5"],
    );
    let b = Batch::read(&twice, &[schema::SCORE]).unwrap();
    let n_score = b
        .data
        .schema()
        .fields()
        .iter()
        .filter(|f| f.name() == schema::SCORE)
        .count();
    assert_eq!(n_score, 1);
    let col = b
        .column(schema::SCORE)
        .unwrap()
        .as_primitive::<Float32Type>();
    assert_eq!(col.values().to_vec(), [1.0, 0.5]);
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not count).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesized command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Waits up to `limit` for `pid` to stop running.
fn gone_within(pid: u32, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if !running(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A python reward that writes its own pid and the pid of a `sleep` it started to DIR, then
/// hangs.
fn hanging_reward(dir: &Path) -> PathBuf {
    let pids = dir.join("pids");
    write_script(
        dir,
        "hang.py",
        &format!(
            r#"
import os, subprocess, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    child = subprocess.Popen(["sleep", "1000"])
    with open({pids:?} + ".tmp", "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    os.rename({pids:?} + ".tmp", {pids:?})
    time.sleep(1000)
"#
        ),
    )
}

/// `score` with the hanging reward on `rows` rows, its temporary files going to `tmp`.
fn hanging_score(dir: &Path, tmp: &Path, rows: usize) -> Command {
    let file = hanging_reward(dir);
    let input = simple_batch(dir, &vec!["a"; rows], &vec!["a"; rows], &vec!["s"; rows]);
    let out = dir.join("out.parquet");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_score"));
    cmd.args([
        "--in",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .args(["--reward", &format!("python:{}", file.display())])
    .env("TMPDIR", tmp);
    cmd
}

/// The pids the hanging reward wrote: its own (the driver's) and its `sleep`'s.
fn reward_pids(dir: &Path) -> (u32, u32) {
    let pids = dir.join("pids");
    let t = Instant::now();
    while !pids.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the reward never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(&pids).unwrap();
    let (driver, sleeper) = text.split_once(' ').unwrap();
    (driver.parse().unwrap(), sleeper.parse().unwrap())
}

#[test]
fn a_killed_score_takes_its_reward_program_with_it() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, name) in [(libc::SIGKILL, "SIGKILL"), (libc::SIGTERM, "SIGTERM")] {
        let dir = tempfile::tempdir().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut child = hanging_score(dir.path(), tmp.path(), 2)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (driver, sleeper) = reward_pids(dir.path());
        assert!(running(driver) && running(sleeper));
        // SAFETY: kill(2) on the pid of a child we started and have not reaped.
        unsafe {
            libc::kill(child.id() as i32, signal);
        }
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(signal), "{name}");
        // The driver dies with score (PR_SET_PDEATHSIG) within a second or two.
        assert!(
            gone_within(driver, Duration::from_secs(2)),
            "{name}: the Python driver {driver} outlived score"
        );
        // On SIGTERM score kills the program's whole group first, what it started included.
        if signal == libc::SIGTERM {
            assert!(
                gone_within(sleeper, Duration::from_secs(2)),
                "SIGTERM: the reward's own child {sleeper} outlived score"
            );
        } else if running(sleeper) {
            // After SIGKILL nothing in score runs: what the reward started itself is its own
            // to end (the driver's stdin closed); do not leave it behind in the test.
            unsafe {
                libc::kill(sleeper as i32, libc::SIGKILL);
            }
        }
        // Nothing was written to the temporary directory (the driver is passed with -c), and
        // no output.
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(left.is_empty(), "{name}: {left:?} left in TMPDIR");
        assert!(!dir.path().join("out.parquet").exists());
    }
}

#[test]
fn a_reward_program_that_times_out_goes_with_what_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let o = hanging_score(dir.path(), tmp.path(), 1)
        .args(["--timeout-ms", "3000"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("gave no answer within 3000 ms"), "{err}");
    let (driver, sleeper) = reward_pids(dir.path());
    for pid in [driver, sleeper] {
        assert!(
            gone_within(pid, Duration::from_secs(2)),
            "{pid} outlived score"
        );
    }
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn a_batch_with_no_rows_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &[], &[], &[]);
    let out = dir.path().join("out.parquet");
    for reward in ["exact", "cmd:cat"] {
        let err = run_bad(&input, &out, &["--reward", reward]);
        assert!(
            err.contains("in.parquet: the batch has no rows"),
            "{reward}: {err}"
        );
    }
}

#[test]
fn numeric_flags_are_range_checked() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &["a"], &["a"], &["s"]);
    let out = dir.path().join("out.parquet");
    for (flag, value, want) in [
        ("--timeout-ms", "0", "must be an integer >= 1"),
        ("--timeout-ms", "-5", "must be an integer >= 1"),
        ("--run-timeout-ms", "-1", "must be an integer >= 0"),
        ("--format-score", "nan", "must be a finite number"),
    ] {
        let err = run_bad(&input, &out, &["--reward", "exact", flag, value]);
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag}")) && err.contains(want),
            "{flag} {value}: {err}"
        );
    }
    // A negative value where one is allowed is a number, not a flag.
    run_ok(&input, &out, &["--reward", "exact", "--format-score", "-1"]);
}

/// Stages never write in place: `--out` naming the `--in` file (also through another spelling
/// of the path) is refused with exit 2, and the input is left byte for byte as it was.
#[test]
fn an_output_that_names_the_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = simple_batch(dir.path(), &["#### 1"], &["1"], &["s"]);
    let before = std::fs::read(&input).unwrap();
    let other_spelling = dir.path().join(".").join(input.file_name().unwrap());
    for out in [&input, &other_spelling] {
        let o = score(&[
            "--in",
            input.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--reward",
            "gsm8k",
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--out names the --in file"), "{stderr}");
        assert_eq!(std::fs::read(&input).unwrap(), before);
    }
    let o = Command::new(env!("CARGO_BIN_EXE_advantage"))
        .args([
            "--in",
            input.to_str().unwrap(),
            "--out",
            input.to_str().unwrap(),
        ])
        .args(["--estimator", "grpo"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--out names the --in file"), "{stderr}");
    assert_eq!(std::fs::read(&input).unwrap(), before);
}
