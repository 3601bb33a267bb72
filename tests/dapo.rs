//! DAPO on CPU with the real binaries: overlong shaping in `score` (values by hand), dynamic
//! sampling in the runner (groups dropped, extra rounds, the cap, a resume in the middle of a
//! step), the shipped CPU DAPO spec end to end, and spec errors before anything runs.

use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file, Batch};

const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");
const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");
const SCORE: &str = env!("CARGO_BIN_EXE_score");
const UPDATE: &str = env!("CARGO_BIN_EXE_update");

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn run_ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{cmd:?} failed:\n{}", text(&o));
    text(&o)
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

// ---------------------------------------------------------------------------------------------
// Overlong shaping in `score`

/// A scored-to-be batch: responses of the given token lengths with their texts and truths,
/// and (when `max_new_tokens` is set) the rollout parameters a rollout records.
fn lengths_batch(path: &Path, lens: &[usize], texts: &[&str], max_new_tokens: Option<usize>) {
    let mut offsets = vec![0usize];
    for l in lens {
        offsets.push(offsets.last().unwrap() + l);
    }
    let ids = vec![5i32; *offsets.last().unwrap()];
    let cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(&offsets, ids),
        ),
        (
            schema::field(schema::RESPONSE_TEXT),
            Arc::new(StringArray::from(texts.to_vec())),
        ),
        (
            Field::new(schema::GROUND_TRUTH, arrow_schema::DataType::Utf8, false),
            Arc::new(StringArray::from(vec!["7"; texts.len()])),
        ),
    ];
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    let mut meta = BTreeMap::new();
    if let Some(m) = max_new_tokens {
        meta.insert(
            "tandem.stage.rollout".to_string(),
            format!("{{\"n\": 2, \"max_new_tokens\": {m}}}"),
        );
    }
    write_file(path, &data, &meta).unwrap();
}

fn col(path: &Path, name: &str) -> Vec<f32> {
    Batch::read(path, &[name]).unwrap().f32s(name).unwrap()
}

#[test]
fn overlong_shaping_values_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let input = d.join("in.parquet");
    // Lengths 2, 6, 7, 8 and 9 tokens (9 is past the limit); right answers in rows 0, 2, 4.
    lengths_batch(
        &input,
        &[2, 6, 7, 8, 9],
        &["7", "8", "7", "x", "7"],
        Some(8),
    );
    let out = d.join("out.parquet");
    let metrics = d.join("m.json");
    let args = |out: &Path, extra: &[&str]| {
        let mut c = Command::new(SCORE);
        c.arg("--in")
            .arg(&input)
            .arg("--out")
            .arg(out)
            .args(["--reward", "exact"])
            .args(extra);
        c
    };
    let log = run_ok(
        args(
            &out,
            &[
                "--overlong-buffer-len",
                "4",
                "--overlong-penalty-factor",
                "0.5",
            ],
        )
        .arg("--metrics")
        .arg(&metrics),
    );
    // L_max 8 (the rollout's), buffer 4: free up to 4 tokens, then -1/4 per token, times 0.5.
    let pen = [0.0, -0.25, -0.375, -0.5, -0.5];
    let acc = [1.0, 0.0, 1.0, 0.0, 1.0];
    assert_eq!(col(&out, "score_overlong"), pen);
    assert_eq!(col(&out, "score_acc"), acc);
    assert_eq!(col(&out, "score"), [1.0, -0.25, 0.625, -0.5, 0.5]);
    let m = json(&metrics);
    assert_eq!(f(&m, "score/overlong_fraction"), 0.8);
    assert!((f(&m, "score_overlong/mean") - (-1.625 / 5.0)).abs() < 1e-7);
    // Accuracy counts right answers, not the shaped score.
    assert_eq!(f(&m, "score/accuracy"), 0.6);
    assert!(
        log.contains("overlong: 4 of 5 responses past 4 tokens (L_max 8 - buffer 4)"),
        "{log}"
    );
    let meta = Batch::read(&out, &[]).unwrap().meta;
    let params: Value = serde_json::from_str(&meta["tandem.stage.score"]).unwrap();
    assert_eq!(params["overlong_buffer_len"], 4);
    assert_eq!(params["max_response_length"], Value::Null);

    // An explicit L_max of 6 (buffer 4, factor 1): free up to 2 tokens.
    let out2 = d.join("out2.parquet");
    run_ok(&mut args(
        &out2,
        &["--overlong-buffer-len", "4", "--max-response-length", "6"],
    ));
    assert_eq!(col(&out2, "score_overlong"), [0.0, -1.0, -1.0, -1.0, -1.0]);

    // Without shaping nothing changes: no penalty column, the plain rule's scores.
    let out3 = d.join("out3.parquet");
    run_ok(&mut args(&out3, &[]));
    assert_eq!(col(&out3, "score"), acc);
    assert!(!Batch::read(&out3, &[]).unwrap().has("score_overlong"));

    // Bad input: exit 2 naming the problem, no output.
    let plain = d.join("plain.parquet");
    lengths_batch(&plain, &[1, 2], &["7", "7"], None);
    for (input, extra, want) in [
        (
            &plain,
            vec!["--overlong-buffer-len", "4"],
            format!(
                "{}: --overlong-buffer-len needs the response length limit: the batch records no rollout max_new_tokens",
                plain.display()
            ),
        ),
        (
            &input,
            vec!["--overlong-buffer-len", "9"],
            "--overlong-buffer-len 9 is longer than the response length limit 8".to_string(),
        ),
        (
            &input,
            vec!["--max-response-length", "6"],
            "--max-response-length is the length limit of the overlong penalty: it needs --overlong-buffer-len N".to_string(),
        ),
        (
            &input,
            vec!["--overlong-buffer-len", "4", "--max-response-length", "3"],
            "--overlong-buffer-len 4 is longer than the response length limit 3 (--max-response-length)".to_string(),
        ),
        (
            &input,
            vec!["--overlong-buffer-len", "4", "--overlong-penalty-factor=-1"],
            "invalid value '-1' for '--overlong-penalty-factor <F>': must be a finite number >= 0".to_string(),
        ),
    ] {
        let bad = d.join("bad.parquet");
        let o = Command::new(SCORE)
            .arg("--in")
            .arg(input)
            .arg("--out")
            .arg(&bad)
            .args(["--reward", "exact"])
            .args(&extra)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", text(&o));
        assert!(text(&o).contains(&want), "{want:?} not in {}", text(&o));
        assert!(!bad.exists());
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamic sampling in the runner

/// The demo's data, random model and SFT warm start (pipelines/demo.sh, with a smaller eval
/// set): what the DAPO specs below run on. Paths as in pipelines/demo-dapo.toml.
fn demo_work(d: &Path) {
    let tandem = |args: &[&str]| run_ok(Command::new(TANDEM).args(args).current_dir(d));
    tandem(&[
        "prepare",
        "synth",
        "--task",
        "add",
        "--digits",
        "1",
        "--n",
        "2000",
        "--seed",
        "1",
        "--out",
        "data/add-train.parquet",
    ]);
    tandem(&[
        "prepare",
        "synth",
        "--task",
        "add",
        "--digits",
        "1",
        "--n",
        "32",
        "--seed",
        "2",
        "--split",
        "test",
        "--out",
        "data/add-val.parquet",
    ]);
    tandem(&[
        "init-model",
        "--like",
        "qwen2",
        "--layers",
        "2",
        "--hidden",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "384",
        "--vocab",
        "512",
        "--seed",
        "0",
        "--out",
        "models/base",
    ]);
    tandem(&[
        "sft-batch",
        "--model",
        "models/base",
        "--in",
        "data/add-train.parquet",
        "--raw-prompt",
        "--out",
        "models/sft.parquet",
    ]);
    run_ok(Command::new(UPDATE).current_dir(d).args([
        "--model",
        "models/base",
        "--in",
        "models/sft.parquet",
        "--out-model",
        "models/sft",
        "--loss",
        "sft",
        "--lr",
        "0.001",
        "--mini-batch-size",
        "64",
    ]));
}

/// A DAPO spec on the demo's files; `algorithm` and `extra` are appended.
fn spec(steps: u64, prompts: u64, algorithm: &str, extra: &str) -> String {
    format!(
        r#"
seed = 4
steps = {steps}
[model]
path = "models/sft"
[data]
train = "data/add-train.parquet"
val = "data/add-val.parquet"
prompts-per-step = {prompts}
[rollout]
n = 8
temperature = 1.0
max-new-tokens = 8
max-prompt-tokens = 32
raw-prompt = true
[score]
reward = "exact"
overlong-buffer-len = 4
overlong-penalty-factor = 0.5
[advantage]
estimator = "grpo"
[update]
lr = 0.002
clip-ratio-low = 0.2
clip-ratio-high = 0.28
ppo-epochs = 2
[algorithm]
filter-groups = true
{algorithm}
{extra}"#
    )
}

fn pipeline(d: &Path, spec_file: &str, run: &str) -> Command {
    let mut c = Command::new(PIPELINE);
    c.current_dir(d)
        .args(["run", spec_file, "--run-dir", run])
        .env("TANDEM_BIN_DIR", Path::new(PIPELINE).parent().unwrap());
    c
}

/// Rows per prompt_uid and whether the group's scores vary.
fn groups(path: &Path) -> BTreeMap<String, (usize, bool)> {
    let b = Batch::read(path, &[schema::PROMPT_UID, schema::SCORE]).unwrap();
    let mut scores: HashMap<String, Vec<f32>> = HashMap::new();
    for (u, s) in b
        .strings(schema::PROMPT_UID)
        .unwrap()
        .iter()
        .zip(b.f32s(schema::SCORE).unwrap())
    {
        scores.entry(u.to_string()).or_default().push(s);
    }
    scores
        .into_iter()
        .map(|(u, s)| (u, (s.len(), s.iter().any(|&x| x != s[0]))))
        .collect()
}

/// DAPO's penalty for the spec above: L_max 8, buffer 4, factor 0.5.
fn penalty(len: usize) -> f32 {
    match len {
        0..=4 => 0.0,
        5..=8 => 0.5 * (4.0 - len as f32) / 4.0,
        _ => -0.5,
    }
}

/// Every round of a finished step: groups dropped and kept as the rule says, the step's files
/// holding the first `want` kept groups, shaping applied to every sample. Returns the rounds
/// and the penalised samples.
fn check_step(step_dir: &Path, want: usize, metrics: &Value) -> (u64, usize) {
    let rounds = f(metrics, "sampling/rounds") as u64;
    let mut varied_uids = Vec::new();
    let (mut total_groups, mut penalised) = (0, 0);
    for r in 1..=rounds {
        let scored = step_dir.join(format!("round-{r}/scored.parquet"));
        assert!(step_dir.join(format!("round-{r}/prompts.parquet")).exists());
        let b = Batch::read(&scored, &[]).unwrap();
        // score = exact (0/1, kept as score_acc) + the overlong penalty of the length.
        let lens: Vec<usize> = b
            .ragged_i32(schema::RESPONSE_IDS)
            .unwrap()
            .rows()
            .map(<[i32]>::len)
            .collect();
        let (s, acc, pen) = (
            b.f32s("score").unwrap(),
            b.f32s("score_acc").unwrap(),
            b.f32s("score_overlong").unwrap(),
        );
        for i in 0..lens.len() {
            assert_eq!(pen[i], penalty(lens[i]), "{}: row {i}", scored.display());
            assert_eq!(s[i], acc[i] + pen[i], "{}: row {i}", scored.display());
            penalised += usize::from(pen[i] < 0.0);
        }
        // Groups in order of appearance; a group is kept when its score varies.
        let mut order = Vec::new();
        for u in b.strings(schema::PROMPT_UID).unwrap() {
            if order.last() != Some(&u.to_string()) {
                order.push(u.to_string());
            }
        }
        let g = groups(&scored);
        total_groups += g.len();
        varied_uids.extend(order.into_iter().filter(|u| g[u].1));
    }
    let taken: Vec<String> = varied_uids.iter().take(want).cloned().collect();
    let kept = groups(&step_dir.join("scored.parquet"));
    assert_eq!(
        kept.keys().cloned().collect::<BTreeSet<_>>(),
        taken.iter().cloned().collect()
    );
    assert!(kept.values().all(|&(n, varies)| n == 8 && varies));
    // The step's rollout and advantages hold the same rows.
    for name in ["rollout", "adv"] {
        let b = Batch::read(&step_dir.join(format!("{name}.parquet")), &[]).unwrap();
        assert_eq!(b.num_rows(), taken.len() * 8, "{name}");
    }
    assert_eq!(f(metrics, "sampling/groups") as usize, taken.len());
    assert_eq!(
        f(metrics, "sampling/groups_dropped") as usize,
        total_groups - varied_uids.len()
    );
    assert_eq!(
        f(metrics, "sampling/groups_surplus") as usize,
        varied_uids.len() - taken.len()
    );
    assert_eq!(f(metrics, "sampling/samples") as usize, total_groups * 8);
    // The step's rollout metrics count every round's samples, not only the last round's.
    assert_eq!(f(metrics, "rollout/samples") as usize, total_groups * 8);
    (rounds, penalised)
}

/// pipelines/demo-dapo.toml as `make demo-dapo` runs it (pipelines/demo.sh), for a few steps.
#[test]
fn dapo_demo_spec_runs_end_to_end() {
    let bin = Path::new(PIPELINE).parent().unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.sh");
    let o = Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(work.path())
        .args(["--steps", "4"])
        .env("DEMO_SPEC", "demo-dapo.toml")
        .output()
        .unwrap();
    assert!(o.status.success(), "demo-dapo failed:\n{}", text(&o));
    let run = work.path().join("run");
    let lines = jsonl(&run.join("metrics.jsonl"));
    assert_eq!(lines.len(), 4);
    let (mut prompts, mut extra_rounds, mut dropped, mut penalised) = (0, 0, 0, 0);
    for (i, m) in lines.iter().enumerate() {
        let step_dir = run.join(format!("step-{:04}", i + 1));
        let (rounds, p) = check_step(&step_dir, 64, m);
        assert_eq!(f(m, "sampling/groups"), 64.0, "step {}: {m}", i + 1);
        assert_eq!(f(m, "sampling/prompts") as u64, rounds * 64);
        assert_eq!(f(m, "sampling/capped"), 0.0);
        // The step's metrics describe the kept rows, the penalty among them.
        assert!(
            m.get("score_overlong/mean").is_some() && m.get("score/overlong_fraction").is_some()
        );
        assert_eq!(f(m, "accuracy"), f(m, "score/accuracy"));
        prompts += rounds * 64;
        extra_rounds += rounds - 1;
        dropped += f(m, "sampling/groups_dropped") as u64;
        penalised += p;
    }
    assert!(extra_rounds > 0, "no step needed a second round");
    assert!(dropped > 0);
    assert!(penalised > 0, "no response was long enough to be penalised");
    // The sampler moved past every prompt the rounds drew (2000 rows: still epoch 0).
    let state = json(&run.join("state.json"));
    assert_eq!(state["sampler"]["epoch"], 0);
    assert_eq!(state["sampler"]["position"], prompts);
    let evals = jsonl(&run.join("eval.jsonl"));
    assert!(evals.len() >= 2 && evals.iter().all(|e| e["accuracy"].is_number()));
    assert!(run.join("plot.png").exists());
    // The starting point docs/PIPELINE.md ("DAPO") quotes: the SFT model's greedy accuracy on
    // the 128 held-out prompts at step 0 (the same with 1 or 2 threads).
    assert_eq!(evals[0]["step"], 0);
    let start = format!("from {:.1}% to", 100.0 * f(&evals[0], "accuracy"));
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/PIPELINE.md"))
            .unwrap();
    assert!(
        doc.contains(&start),
        "docs/PIPELINE.md does not say {start:?}"
    );
}

#[test]
fn the_cap_trains_on_what_there_is_or_fails() {
    let work = tempfile::tempdir().unwrap();
    let d = work.path();
    demo_work(d);
    // Rounds of 6 prompts, at most 2: never the 32 groups asked for.
    let algo = "prompts-per-round = 6\nmax-num-gen-batches = 2";
    std::fs::write(d.join("train.toml"), spec(2, 32, algo, "")).unwrap();
    run_ok(&mut pipeline(d, "train.toml", "t"));
    for (i, m) in jsonl(&d.join("t/metrics.jsonl")).iter().enumerate() {
        let (rounds, _) = check_step(&d.join(format!("t/step-{:04}", i + 1)), 32, m);
        assert_eq!(rounds, 2);
        assert_eq!(f(m, "sampling/capped"), 1.0);
        assert_eq!(f(m, "sampling/prompts"), 12.0);
        assert!(f(m, "sampling/groups") < 32.0 && f(m, "sampling/groups") > 0.0);
        assert_eq!(f(m, "sampling/groups_surplus"), 0.0);
    }
    assert_eq!(json(&d.join("t/state.json"))["sampler"]["position"], 24);

    // on-cap = "fail": verl's behaviour, the run stops at step 1 before training.
    std::fs::write(
        d.join("fail.toml"),
        spec(2, 32, &format!("{algo}\non-cap = \"fail\""), ""),
    )
    .unwrap();
    let o = pipeline(d, "fail.toml", "f").output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = text(&o);
    assert!(
        msg.contains("step-0001: dynamic sampling kept")
            && msg.contains("of 32 groups in 2 rounds (12 prompts;")
            && msg.contains("on-cap = \"fail\" stops the run here, as verl does"),
        "{msg}"
    );
    assert!(!d.join("f/step-0001/scored.parquet").exists());
    assert_eq!(json(&d.join("f/state.json"))["steps_done"], 0);

    // No group varies at all (the reward never matches): nothing to train on, whatever on-cap.
    let none = spec(1, 4, "max-num-gen-batches = 2", "")
        .replace("reward = \"exact\"", "reward = \"regex:(never)\"")
        .replace("overlong-buffer-len = 4\n", "");
    std::fs::write(d.join("none.toml"), none).unwrap();
    let o = pipeline(d, "none.toml", "n").output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("dynamic sampling kept 0 of 4 groups in 2 rounds (8 prompts; every other group had the same score for all its samples; [algorithm] max-num-gen-batches = 2): nothing to train on"),
        "{}",
        text(&o)
    );
}

/// Whether state.json records `task` as finished in step `step`.
fn recorded(run: &Path, step: u64, task: &str) -> bool {
    let Ok(t) = std::fs::read_to_string(run.join("state.json")) else {
        return false;
    };
    let Ok(s) = serde_json::from_str::<Value>(&t) else {
        return false;
    };
    s["steps_done"].as_u64().unwrap_or(0) >= step
        || (s["current"]["step"] == step
            && s["current"]["done"]
                .as_array()
                .is_some_and(|d| d.iter().any(|x| x == task)))
}

/// Every batch file of a run (step and round files), by relative path, as Arrow data.
fn batches(run: &Path) -> BTreeMap<String, RecordBatch> {
    let mut out = BTreeMap::new();
    let mut stack = vec![run.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                let rel = p.strip_prefix(run).unwrap().display().to_string();
                out.insert(rel, Batch::read(&p, &[]).unwrap().data);
            }
        }
    }
    out
}

fn files_under(dir: &Path, name: &str) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir.join(name)).unwrap() {
        let e = e.unwrap();
        for f in std::fs::read_dir(e.path()).unwrap() {
            let f = f.unwrap();
            out.insert(
                format!(
                    "{}/{}",
                    e.file_name().to_string_lossy(),
                    f.file_name().to_string_lossy()
                ),
                std::fs::read(f.path()).unwrap(),
            );
        }
    }
    out
}

/// metrics.jsonl without wall-clock keys.
fn sans_time(path: &Path) -> Vec<Value> {
    jsonl(path)
        .into_iter()
        .map(|mut v| {
            v.as_object_mut().unwrap().retain(|k, _| {
                !(k.starts_with("time/")
                    || k.starts_with("perf/")
                    || k.ends_with("_s")
                    || k.ends_with("seconds"))
            });
            v
        })
        .collect()
}

/// A run killed between the rounds of a step, and again inside the next round, continues
/// with the round it was in and ends with the same files as an uninterrupted run.
#[test]
fn resume_in_the_middle_of_a_step_gives_the_same_files() {
    let work = tempfile::tempdir().unwrap();
    let d = work.path();
    demo_work(d);
    let text_spec = spec(
        3,
        16,
        "max-num-gen-batches = 6",
        "[checkpoint]\nevery = 1\nkeep-last = 3\n",
    );
    std::fs::write(d.join("spec.toml"), text_spec).unwrap();
    run_ok(&mut pipeline(d, "spec.toml", "a"));
    let a = d.join("a");
    // A step that took several rounds.
    let step = (1..=3u64)
        .find(|s| json(&a.join(format!("step-{s:04}/sampling.json")))["rounds"].as_u64() >= Some(2))
        .expect("a step with two rounds or more");

    let b = d.join("b");
    let kill_when = |what: &str, cond: &dyn Fn() -> bool| {
        crate::pipeline::kill_when(pipeline(d, "spec.toml", "b"), what, &mut |_| cond())
    };
    kill_when("round 1 scored", &|| recorded(&b, step, "round-1/score"));
    let state = json(&b.join("state.json"));
    assert_eq!(state["current"]["step"], step, "{state}");
    kill_when("round 2 rolled out", &|| {
        recorded(&b, step, "round-2/rollout")
    });
    let o = pipeline(d, "spec.toml", "b").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    // Round 1 of that step ran once: the resumed runs continued after it.
    let commands = std::fs::read_to_string(b.join("commands.sh")).unwrap();
    let round1 = format!("--out b/step-{step:04}/round-1/rollout.parquet");
    assert_eq!(commands.matches(&round1).count(), 1, "{commands}");

    let (ba, bb) = (batches(&a), batches(&b));
    assert_eq!(ba.keys().collect::<Vec<_>>(), bb.keys().collect::<Vec<_>>());
    assert!(ba.contains_key(&format!("step-{step:04}/round-2/scored.parquet")));
    for (k, v) in &ba {
        assert!(v == &bb[k], "{k} differs after the resumed run");
    }
    assert_eq!(files_under(&a, "ckpt"), files_under(&b, "ckpt"));
    assert_eq!(
        sans_time(&a.join("metrics.jsonl")),
        sans_time(&b.join("metrics.jsonl"))
    );
    assert_eq!(json(&a.join("state.json")), json(&b.join("state.json")));
    for s in 1..=3u64 {
        let p = format!("step-{s:04}/sampling.json");
        assert_eq!(json(&a.join(&p)), json(&b.join(&p)));
    }
}

/// The rounds' stage commands go through the stages' own checks before the run starts (the
/// plain step's `score` task does not exist with filter-groups), and a dry run shows them.
#[test]
fn round_commands_are_checked_and_shown_before_anything_runs() {
    let work = tempfile::tempdir().unwrap();
    let d = work.path();
    demo_work(d);
    let good = spec(2, 4, "", "");
    std::fs::write(d.join("good.toml"), &good).unwrap();
    let out = run_ok(pipeline(d, "good.toml", "r").arg("--dry-run"));
    assert!(
        out.contains("# pipeline: dynamic sampling: rounds of 4 prompts of data/add-train.parquet into r/step-0001/round-R/ until 4 groups have a varying score (at most 10 rounds, then train on the groups kept)"),
        "{out}"
    );
    assert!(
        out.contains(
            "--out r/step-0001/round-1/scored.parquet --reward exact --overlong-buffer-len 4"
        ),
        "{out}"
    );
    assert!(!out.contains("step-0001/prompts.parquet"), "{out}");
    assert!(!d.join("r").exists());
    for (bad, want) in [
        (
            good.replace("overlong-penalty-factor = 0.5", "overlong-penalty-factor = -1"),
            "[score] overlong-penalty-factor = -1: invalid value '-1' for '--overlong-penalty-factor <F>': must be a finite number >= 0",
        ),
        (
            good.replace("filter-groups = true", "filter-groups = true\nfilter-metric = \"len\""),
            "[algorithm] filter-metric = \"len\": unknown metric",
        ),
        (
            good.replace("max-new-tokens = 8", "max-new-tokens = 3"),
            "[score] overlong-buffer-len = 4 is longer than max-new-tokens = 3 of the training rollout",
        ),
    ] {
        std::fs::write(d.join("bad.toml"), bad).unwrap();
        let o = pipeline(d, "bad.toml", "r").arg("--dry-run").output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(want), "{want:?} not in {}", text(&o));
        assert!(!d.join("r").exists());
    }
}
