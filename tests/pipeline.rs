//! End-to-end tests of the `pipeline` runner, `tandem plot` and `tandem inspect`.
//!
//! The runner logic (step loop, resume after SIGKILL, checkpoints, metrics) is tested with
//! stand-in stages: small shell scripts in a temp dir (found through `TANDEM_BIN_DIR`) that
//! re-enter this test binary at [`fake_stage`], which reads and writes real batch files with
//! the stages' flags. The stand-ins are deterministic functions of their inputs, like the real
//! stages on CPU: a "model" is a directory with one number in `weights.txt`, `update` mixes
//! the batch into it. So a resumed run must end with the same weights, checkpoints, metrics
//! and evaluations as an uninterrupted one, which is what the real stages are held to.

use crate::stage_util;

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, Float32Array, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem::batch::{list_array, schema, write_file, Batch, NewColumns, StageInfo};

pub(crate) const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");
const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");
const STAGES: [&str; 6] = [
    "rollout",
    "score",
    "ref-logprob",
    "advantage",
    "update",
    "sync-weights",
];

// ---------------------------------------------------------------------------------------------
// Stand-in stages

fn mix(mut h: u64, x: u64) -> u64 {
    h ^= x
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(h << 6)
        .wrapping_add(h >> 2);
    h = (h ^ (h >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^ (h >> 29)
}

/// `--model` is a model directory or a pointer file `{"model": DIR, "policy_version": N}`
/// (DIR relative to the pointer's directory), as sync-weights writes it.
fn resolve(model: &Path) -> (PathBuf, u64) {
    if model.is_dir() {
        return (model.to_path_buf(), 0);
    }
    let p: Value = serde_json::from_str(&std::fs::read_to_string(model).unwrap()).unwrap();
    let dir = model.parent().unwrap().join(p["model"].as_str().unwrap());
    (dir, p["policy_version"].as_u64().unwrap())
}

fn read_weights(model: &Path) -> u64 {
    let p = resolve(model).0.join("weights.txt");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .parse()
        .unwrap()
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .map(|i| args[i + 1].as_str())
}

fn no_meta(stage: &str) -> StageInfo<'_> {
    StageInfo {
        stage,
        params: Value::Null,
        policy_version: None,
        step: None,
    }
}

/// Entry point of the stand-in stages (run by the scripts [`fake_bins`] writes; does nothing
/// when run as a test).
#[test]
#[ignore = "entry point of the stand-in stages, not a test"]
fn fake_stage() {
    let Ok(stage) = std::env::var("FAKE_STAGE") else {
        return;
    };
    let args: Vec<String> = std::env::var("FAKE_ARGS")
        .unwrap()
        .split('\x1f')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let f = |n: &str| flag(&args, n).unwrap_or_else(|| panic!("{stage}: {n} missing"));
    // Where the run's marks go: one file per stage start, named after the stage and step.
    let step_of = |p: &str| {
        Path::new(p)
            .components()
            .rev()
            .find_map(|c| {
                let s = c.as_os_str().to_string_lossy();
                s.starts_with("step-").then(|| s.into_owned())
            })
            .unwrap_or_default()
    };
    let target = flag(&args, "--out")
        .or(flag(&args, "--out-model"))
        .or(flag(&args, "--from"))
        .unwrap_or("");
    let eval = if target.contains("/eval/") {
        "eval-"
    } else {
        ""
    };
    if let Ok(dir) = std::env::var("FAKE_MARKS") {
        let name = format!("{eval}{stage}-{}", step_of(target));
        std::fs::write(Path::new(&dir).join(name), "").unwrap();
    }
    if std::env::var("FAKE_FAIL").is_ok_and(|s| s == stage) {
        eprintln!("{stage}: refusing on purpose");
        // 2: bad input (the default), else another failure.
        let code = std::env::var("FAKE_FAIL_CODE").map_or(2, |c| c.parse().unwrap());
        std::process::exit(code);
    }
    if std::env::var("FAKE_SLOW").is_ok_and(|s| s.split(',').any(|x| x == stage)) {
        std::thread::sleep(Duration::from_millis(700));
    }
    match stage.as_str() {
        "rollout" => {
            let w = read_weights(Path::new(f("--model")));
            let seed: u64 = f("--seed").parse().unwrap();
            let n: usize = flag(&args, "--n").unwrap_or("1").parse().unwrap();
            let mut prompts = Batch::read(Path::new(f("--in")), &[]).unwrap();
            if let Some(l) = flag(&args, "--limit") {
                let l = l.parse::<usize>().unwrap().min(prompts.num_rows());
                prompts.data = prompts.data.slice(0, l);
            }
            let rows: Vec<u64> = (0..prompts.num_rows() as u64)
                .flat_map(|i| std::iter::repeat_n(i, n))
                .collect();
            let data = arrow_select::take::take_record_batch(
                &prompts.data,
                &UInt64Array::from(rows.clone()),
            )
            .unwrap();
            let repeated = Batch {
                path: prompts.path.clone(),
                data,
                meta: prompts.meta.clone(),
            };
            let (mut offs, mut ids, mut texts, mut uids, mut puids) =
                (vec![0usize], Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (k, &i) in rows.iter().enumerate() {
                let h = mix(mix(w, seed), k as u64);
                let len = 1 + (h % 3) as usize;
                let toks: Vec<i32> = (0..len).map(|t| (mix(h, t as u64) % 4) as i32).collect();
                texts.push(toks.iter().map(|t| t.to_string()).collect::<String>());
                ids.extend(&toks);
                offs.push(ids.len());
                uids.push(format!("{i}-{k}"));
                puids.push(format!("p{i}"));
            }
            let total = ids.len();
            let mut cols = NewColumns::new();
            cols.add(schema::UID, Arc::new(StringArray::from(uids)))
                .add(schema::PROMPT_UID, Arc::new(StringArray::from(puids)))
                .add(
                    schema::PROMPT_IDS,
                    list_array::<Int32Type>(
                        &(0..=rows.len()).collect::<Vec<_>>(),
                        vec![5; rows.len()],
                    ),
                )
                .add(schema::RESPONSE_IDS, list_array::<Int32Type>(&offs, ids))
                .add(
                    schema::RESPONSE_MASK,
                    list_array::<UInt8Type>(&offs, vec![1; total]),
                )
                .add(schema::RESPONSE_TEXT, Arc::new(StringArray::from(texts)))
                .add(
                    schema::FINISH_REASON,
                    Arc::new(StringArray::from(vec!["stop"; rows.len()])),
                )
                .add(
                    schema::ROLLOUT_LOGPROBS,
                    list_array::<Float32Type>(&offs, vec![-0.5; total]),
                );
            repeated
                .write_derived(Path::new(f("--out")), cols, &no_meta("rollout"))
                .unwrap();
            if let Some(m) = flag(&args, "--metrics") {
                let version = resolve(Path::new(f("--model"))).1;
                std::fs::write(m, format!("{{\"policy_version\": {version}}}")).unwrap();
            }
        }
        "score" => {
            let b = Batch::read(Path::new(f("--in")), &[schema::RESPONSE_TEXT]).unwrap();
            let gt = b.ground_truths().unwrap();
            let scores: Vec<f32> = b
                .strings(schema::RESPONSE_TEXT)
                .unwrap()
                .iter()
                .zip(&gt)
                .map(|(r, g)| {
                    if r.starts_with(g.as_str()) {
                        1.0
                    } else {
                        r.len() as f32 / 10.0
                    }
                })
                .collect();
            let mean = scores.iter().sum::<f32>() / scores.len() as f32;
            let mut cols = NewColumns::new();
            cols.add(schema::SCORE, Arc::new(Float32Array::from(scores)));
            b.write_derived(Path::new(f("--out")), cols, &no_meta("score"))
                .unwrap();
            if let Some(m) = flag(&args, "--metrics") {
                std::fs::write(m, format!("{{\"mean\": {mean}}}")).unwrap();
            }
        }
        "ref-logprob" => {
            let b = Batch::read(Path::new(f("--in")), &[schema::ROLLOUT_LOGPROBS]).unwrap();
            let w = read_weights(Path::new(f("--model")));
            let lp = b.ragged_f32(schema::ROLLOUT_LOGPROBS).unwrap();
            let shift = (w % 7) as f32 / 10.0;
            let values = lp.values.iter().map(|v| v - shift).collect();
            let mut cols = NewColumns::new();
            cols.add(
                f("--column"),
                list_array::<Float32Type>(&lp.offsets, values),
            );
            b.write_derived(Path::new(f("--out")), cols, &no_meta("ref-logprob"))
                .unwrap();
        }
        "advantage" => {
            let b = Batch::read(Path::new(f("--in")), &[schema::SCORE]).unwrap();
            let scores = b.f32s(schema::SCORE).unwrap();
            let groups = b.strings(schema::PROMPT_UID).unwrap();
            let mut sums: BTreeMap<&str, (f32, f32)> = BTreeMap::new();
            for (g, s) in groups.iter().zip(&scores) {
                let e = sums.entry(g).or_default();
                e.0 += s;
                e.1 += 1.0;
            }
            let mut beta = 0.1f64;
            if let Some(p) = flag(&args, "--kl-state") {
                if let Ok(t) = std::fs::read_to_string(p) {
                    beta = t.trim().parse().unwrap();
                }
                beta *= 1.5;
                std::fs::write(p, beta.to_string()).unwrap();
            }
            let ids = b.ragged_i32(schema::RESPONSE_IDS).unwrap();
            let mut values = Vec::new();
            for (r, (g, s)) in groups.iter().zip(&scores).enumerate() {
                let (sum, n) = sums[g];
                values.extend(std::iter::repeat_n(s - sum / n, ids.row(r).len()));
            }
            let mut cols = NewColumns::new();
            cols.add(
                schema::ADVANTAGES,
                list_array::<Float32Type>(&ids.offsets, values),
            );
            b.write_derived(Path::new(f("--out")), cols, &no_meta("advantage"))
                .unwrap();
            if let Some(m) = flag(&args, "--metrics") {
                std::fs::write(m, format!("{{\"kl_coef\": {beta}}}")).unwrap();
            }
        }
        "update" => {
            let w = read_weights(Path::new(f("--model")));
            let b = Batch::read(Path::new(f("--in")), &[schema::ADVANTAGES]).unwrap();
            let adv = b.ragged_f32(schema::ADVANTAGES).unwrap();
            let ids = b.ragged_i32(schema::RESPONSE_IDS).unwrap();
            let mut h = mix(w, f("--seed").parse().unwrap());
            for (a, t) in adv.values.iter().zip(ids.values.iter()) {
                h = mix(mix(h, a.to_bits() as u64), *t as u64);
            }
            let out = Path::new(f("--out-model"));
            std::fs::create_dir_all(out).unwrap();
            std::fs::write(out.join("weights.txt"), h.to_string()).unwrap();
            if let Some(m) = flag(&args, "--metrics") {
                let g = (h % 1000) as f64 / 1000.0;
                std::fs::write(m, format!("{{\"grad_norm\": {g}, \"entropy\": 1.5}}")).unwrap();
            }
        }
        "sync-weights" => {
            let from = std::fs::canonicalize(f("--from")).unwrap();
            let to = PathBuf::from(f("--to"));
            let tmp = to.with_extension("tmp");
            let version: u64 = f("--policy-version").parse().unwrap();
            let ptr = serde_json::json!({"model": from, "policy_version": version});
            std::fs::write(&tmp, ptr.to_string()).unwrap();
            std::fs::rename(&tmp, &to).unwrap();
        }
        other => panic!("no stand-in for {other}"),
    }
    // What a stage prints about its work (the runner logs it, and shows it with -v).
    eprintln!("{stage}: wrote {target}");
}

/// A directory of stand-in stage scripts that re-enter this test binary.
fn fake_bins(dir: &Path) -> PathBuf {
    let bins = dir.join("bin");
    std::fs::create_dir_all(&bins).unwrap();
    let exe = std::env::current_exe().unwrap();
    // The test's name as the harness knows it: its module path without the crate's name.
    let path = concat!(module_path!(), "::fake_stage");
    let test = path.split_once("::").unwrap().1;
    for stage in STAGES {
        let script = format!(
            "#!/bin/sh\nFAKE_STAGE={stage} FAKE_ARGS=\"$(printf '%s\\037' \"$@\")\" exec '{}' {test} --exact --ignored --nocapture --test-threads 1 >/dev/null\n",
            exe.display()
        );
        let p = bins.join(stage);
        std::fs::write(&p, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bins
}

// ---------------------------------------------------------------------------------------------
// Fixtures

/// A prompt set of `n` rows: data_source, prompt (text), ground_truth ("0".."3").
fn prompts_file(path: &Path, n: usize) {
    let schema = Schema::new(vec![
        Field::new(schema::DATA_SOURCE, DataType::Utf8, false),
        Field::new(schema::PROMPT, DataType::Utf8, false),
        Field::new(schema::GROUND_TRUTH, DataType::Utf8, false),
    ]);
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(
            (0..n)
                .map(|i| if i % 2 == 0 { "even" } else { "odd" })
                .collect::<Vec<_>>(),
        )),
        Arc::new(StringArray::from(
            (0..n).map(|i| format!("question {i}?")).collect::<Vec<_>>(),
        )),
        Arc::new(StringArray::from(
            (0..n).map(|i| (i % 4).to_string()).collect::<Vec<_>>(),
        )),
    ];
    let data = RecordBatch::try_new(Arc::new(schema), cols).unwrap();
    write_file(path, &data, &Default::default()).unwrap();
}

const SPEC: &str = r#"
seed = 5
steps = 4

[model]
path = "model"
ref = "model"

[data]
train = "train.parquet"
val = "val.parquet"
prompts-per-step = 3

[rollout]
n = 2
temperature = 1.0
max-new-tokens = 8

[score]
reward = "exact"

[advantage]
estimator = "grpo"
kl-in-reward = true
kl-ctrl = "adaptive"

[update]
lr = 0.001
use-kl-loss = true
ppo-epochs = 2

[eval]
every = 2
limit = 3

[checkpoint]
every = 2
keep-last = 1
"#;

/// A work dir with the stand-in stages, a model, train/val prompts and the spec.
struct Work {
    dir: tempfile::TempDir,
    bins: PathBuf,
}

impl Work {
    fn new(spec: &str) -> Work {
        Work::with_real(spec, &[])
    }

    /// Stand-ins except for `real` stages, which are this package's binaries.
    fn with_real(spec: &str, real: &[(&str, &str)]) -> Work {
        let dir = tempfile::tempdir().unwrap();
        let bins = fake_bins(dir.path());
        for (stage, exe) in real {
            std::fs::remove_file(bins.join(stage)).unwrap();
            std::os::unix::fs::symlink(exe, bins.join(stage)).unwrap();
        }
        // A real model directory (config, weights, tokenizer, chat template: the runner checks
        // them before anything runs); the stand-ins read their "weights" from weights.txt.
        let model = stage_util::tiny_model(dir.path(), 0);
        std::fs::rename(model, dir.path().join("model")).unwrap();
        std::fs::write(dir.path().join("model/weights.txt"), "12345").unwrap();
        prompts_file(&dir.path().join("train.parquet"), 7);
        prompts_file(&dir.path().join("val.parquet"), 5);
        std::fs::write(dir.path().join("spec.toml"), spec).unwrap();
        std::fs::create_dir_all(dir.path().join("marks")).unwrap();
        Work { dir, bins }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn cmd(&self, run: &str, extra: &[&str]) -> Command {
        let mut c = Command::new(PIPELINE);
        c.current_dir(self.dir.path())
            .args(["run", "spec.toml", "--run-dir", run])
            .args(extra)
            .env("TANDEM_BIN_DIR", &self.bins)
            .env("FAKE_MARKS", self.path("marks"))
            .env_remove("FAKE_FAIL")
            .env_remove("FAKE_FAIL_CODE")
            .env_remove("FAKE_SLOW");
        c
    }

    fn run(&self, run: &str, extra: &[&str]) -> Output {
        self.cmd(run, extra).output().unwrap()
    }

    /// Runs a shell command line (one the runner printed) as a user would, in the work dir.
    fn shell(&self, line: &str) -> Output {
        Command::new("sh")
            .args(["-c", line])
            .current_dir(self.dir.path())
            .env("TANDEM_BIN_DIR", &self.bins)
            .env("FAKE_MARKS", self.path("marks"))
            .env_remove("FAKE_FAIL")
            .env_remove("FAKE_FAIL_CODE")
            .env_remove("FAKE_SLOW")
            .output()
            .unwrap()
    }

    fn spawn(&self, run: &str, slow: &str) -> Child {
        self.cmd(run, &[])
            .env("FAKE_SLOW", slow)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }
}

pub(crate) fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub(crate) fn assert_ok(o: &Output) {
    assert!(o.status.success(), "{}", text(o));
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub(crate) fn state(run: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("state.json")).unwrap()).unwrap()
}

pub(crate) fn stage_done(run: &Path, step: u64, stage: &str) -> bool {
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
                .is_some_and(|d| d.iter().any(|x| x == stage)))
}

/// JSON-lines rows without the wall-clock keys, which differ between any two runs.
pub(crate) fn jsonl_sans_time(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            // The runner's and the stages' timings (`time/*`, `*_s`, `*seconds`, `*per_s`).
            m.retain(|k, _| {
                !(k.starts_with("time/")
                    || k.starts_with("perf/")
                    || k.ends_with("_s")
                    || k.ends_with("seconds"))
            });
            v
        })
        .collect()
}

/// Checkpoint dirs and their weights.
fn checkpoints(run: &Path) -> BTreeMap<String, String> {
    std::fs::read_dir(run.join("ckpt"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let w = std::fs::read_to_string(e.path().join("weights.txt")).unwrap();
            (e.file_name().to_string_lossy().into_owned(), w)
        })
        .collect()
}

fn policy_weights(run: &Path) -> String {
    std::fs::read_to_string(resolve(&run.join("policy")).0.join("weights.txt")).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn full_run_writes_the_run_directory() {
    let w = Work::new(SPEC);
    let o = w.run("runs/a", &[]);
    assert_ok(&o);
    let run = w.path("runs/a");
    let log = text(&o);
    assert!(log.contains("step 4/4  reward"), "{log}");
    assert!(
        log.contains("pipeline: finished 4 steps in runs/a"),
        "{log}"
    );
    // The console (piped: no progress bar): one line per step, with the ETA until the last;
    // the evaluations in the lines of their steps; the stages' output only in the log.
    let err = String::from_utf8_lossy(&o.stderr);
    let steps: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 5, "{err}");
    assert!(
        steps[0].starts_with("step 0/4  eval acc ")
            && steps[0].ends_with("(3 rows) (the initial policy)"),
        "{err}"
    );
    for (i, l) in steps[1..].iter().enumerate() {
        let step = i + 1;
        assert!(l.starts_with(&format!("step {step}/4  reward ")), "{l}");
        assert_eq!(l.contains("  ETA "), step < 4, "{l}");
        assert_eq!(l.contains("  eval acc "), step % 2 == 0, "{l}");
    }
    assert!(!err.contains("rollout: wrote"), "{err}");
    assert!(!err.contains("[step-0001]"), "{err}");
    assert!(err.lines().count() <= 12, "{err}");
    let plog = std::fs::read_to_string(run.join("pipeline.log")).unwrap();
    let command = plog
        .find("[step-0002] rollout: ")
        .expect("the command in the log");
    let output = plog
        .find("rollout: wrote runs/a/step-0002/rollout.parquet")
        .expect("the stage's output in the log");
    assert!(command < output, "{plog}");
    assert_eq!(plog.matches("update: wrote").count(), 4, "{plog}");
    assert!(plog.contains("step 4/4  reward"), "{plog}");

    for step in 1..=4 {
        for f in ["prompts", "rollout", "scored", "ref", "old", "adv"] {
            let p = run.join(format!("step-{step:04}/{f}.parquet"));
            assert!(p.exists(), "{}", p.display());
        }
    }
    // 3 prompts of 7, 2 samples each
    let adv = Batch::read(&run.join("step-0002/adv.parquet"), &[schema::ADVANTAGES]).unwrap();
    assert_eq!(adv.num_rows(), 6);
    assert!(adv.has(schema::REF_LOGPROBS) && adv.has(schema::OLD_LOGPROBS));

    // The sampler: steps 1..3 draw 9 prompts, so epoch 0 (7 prompts) is covered exactly once
    // before epoch 1 starts.
    let mut first_epoch: Vec<String> = Vec::new();
    for step in 1..=3 {
        let p = Batch::read(&run.join(format!("step-{step:04}/prompts.parquet")), &[]).unwrap();
        assert_eq!(p.num_rows(), 3);
        assert_eq!(
            p.meta.get("step").map(String::as_str),
            Some(step.to_string().as_str())
        );
        first_epoch.extend(
            p.strings(schema::PROMPT)
                .unwrap()
                .iter()
                .map(|s| s.to_string()),
        );
    }
    let mut seen = first_epoch[..7].to_vec();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 7);
    assert_eq!(
        state(&run)["sampler"],
        serde_json::json!({"epoch": 1, "position": 5})
    );

    // Checkpoints: every 2, keep 1 -> step 4 (also the policy); the policy points at it.
    assert_eq!(checkpoints(&run).keys().collect::<Vec<_>>(), ["step-0004"]);
    assert_eq!(policy_weights(&run), checkpoints(&run)["step-0004"]);

    // Metrics: one line per step, the stage metrics merged in.
    let m = jsonl_sans_time(&run.join("metrics.jsonl"));
    assert_eq!(m.len(), 4);
    for (i, line) in m.iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1);
        for k in [
            "reward/mean",
            "reward/std",
            "accuracy",
            "response_length/mean",
            "response_length/max",
            "kl",
            "grad_norm",
            "entropy",
            "update/grad_norm",
            "advantage/kl_coef",
            "score/mean",
        ] {
            assert!(line.get(k).is_some(), "step {}: no {k} in {line}", i + 1);
        }
    }
    // The adaptive KL state carried from step to step: 0.1 * 1.5^step.
    let beta = m[3]["advantage/kl_coef"].as_f64().unwrap();
    assert!((beta - 0.1 * 1.5f64.powi(4)).abs() < 1e-9, "{beta}");
    // kl = rollout − ref log-probs = (12345 % 7) / 10 for the initial model as reference
    let kl = m[0]["kl"].as_f64().unwrap();
    assert!((kl - (12345 % 7) as f64 / 10.0).abs() < 1e-6, "{kl}");
    let raw = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(raw.contains("\"time/rollout\"") && raw.contains("\"perf/tokens_per_s\""));

    // Evaluations at steps 0, 2 and 4, on the first 3 validation prompts, greedy.
    let e = jsonl_sans_time(&run.join("eval.jsonl"));
    assert_eq!(
        e.iter()
            .map(|l| l["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [0, 2, 4]
    );
    assert!(e
        .iter()
        .all(|l| l["rows"] == 3 && l.get("accuracy/even").is_some()));

    // commands.sh: the exact stage lines, in order.
    let cmds = std::fs::read_to_string(run.join("commands.sh")).unwrap();
    let bin = |s: &str| w.bins.join(s).display().to_string();
    assert!(cmds.starts_with("#!/bin/sh\n"));
    let first_rollout = format!(
        "{} --model runs/a/policy --in runs/a/step-0001/prompts.parquet --out runs/a/step-0001/rollout.parquet --n 2 --temperature 1 --max-new-tokens 8 --seed {} --step 1 --metrics runs/a/step-0001/metrics/rollout.json\n",
        bin("rollout"),
        tandem::pipeline::sampler::derive_seed(5, &[1, 1])
    );
    assert!(cmds.contains(&first_rollout), "{cmds}");
    assert!(cmds.contains(&format!(
        "{} --model runs/a/policy --in runs/a/step-0002/adv.parquet --out-model runs/a/ckpt/step-0002 --use-kl-loss --ppo-epochs 2 --temperature 1 --lr 0.001 --seed {} --metrics runs/a/step-0002/metrics/update.json\n",
        bin("update"),
        tandem::pipeline::sampler::derive_seed(5, &[2, 3])
    )), "{cmds}");
    assert!(cmds.contains(&format!(
        "{} --model model --in runs/a/step-0001/scored.parquet --out runs/a/step-0001/ref.parquet --column ref_logprobs --temperature 1\n",
        bin("ref-logprob")
    )), "{cmds}");
    assert!(cmds.contains(&format!(
        "{} --in runs/a/step-0003/old.parquet --out runs/a/step-0003/adv.parquet --estimator grpo --kl-in-reward --kl-ctrl adaptive --kl-state runs/a/step-0003/kl-state.json --metrics runs/a/step-0003/metrics/advantage.json\n",
        bin("advantage")
    )), "{cmds}");
    assert!(
        cmds.contains(&format!(
            "{} --from runs/a/ckpt/step-0002 --to runs/a/policy --policy-version 2\n",
            bin("sync-weights")
        )),
        "{cmds}"
    );
    assert!(cmds.contains(" --out runs/a/eval/step-0000/rollout.parquet --n 1 --top-k 1 --max-new-tokens 8 --limit 3 --seed "), "{cmds}");
    assert_eq!(cmds.matches(&bin("update")).count(), 4);
    assert!(!run.join("lock").exists());

    // Plot and inspect on the finished run.
    let o = Command::new(TANDEM)
        .args(["plot", "runs/a"])
        .current_dir(w.dir.path())
        .output()
        .unwrap();
    assert_ok(&o);
    let png = std::fs::read(run.join("plot.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    let o = Command::new(TANDEM)
        .args([
            "inspect",
            "runs/a/step-0004/adv.parquet",
            "--rows",
            "4",
            "--sort",
            "score",
        ])
        .current_dir(w.dir.path())
        .output()
        .unwrap();
    assert_ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("runs/a/step-0004/adv.parquet: 6 rows; columns: data_source"));
    assert_eq!(lines[1], "step=4");
    assert!(
        lines[2].split_whitespace().eq([
            "row",
            "source",
            "prompt",
            "response",
            "length",
            "score",
            "advantage",
            "logprob"
        ]),
        "{out}"
    );
    let scores: Vec<f64> = lines[3..7]
        .iter()
        .map(|l| l.split_whitespace().nth_back(2).unwrap().parse().unwrap())
        .collect();
    assert!(scores.windows(2).all(|p| p[0] >= p[1]), "{out}");
    let all = Batch::read(&run.join("step-0004/adv.parquet"), &[schema::SCORE]).unwrap();
    let best = all
        .f32s(schema::SCORE)
        .unwrap()
        .into_iter()
        .fold(f32::MIN, f32::max);
    assert_eq!(scores[0], (best as f64 * 1000.0).round() / 1000.0, "{out}");
    assert_eq!(lines[7], "(4 of 6 rows shown; --rows N for more)");
}

#[test]
fn sigkill_during_and_between_stages_resumes_to_the_same_end() {
    let w = Work::new(SPEC);
    assert_ok(&w.run("runs/a", &[]));
    let a = w.path("runs/a");
    let b = w.path("runs/b");
    let marks = w.path("marks");
    std::fs::remove_dir_all(&marks).unwrap();
    std::fs::create_dir_all(&marks).unwrap();

    // 1. Killed while step 2's rollout runs.
    let mut child = w.spawn("runs/b", "rollout");
    wait_for("step 2 rollout", || {
        marks.join("rollout-step-0002").exists()
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let s = state(&b);
    assert_eq!(s["steps_done"], 1);
    assert_eq!(s["current"]["done"], serde_json::json!(["prompts"]));
    // The stage died with the runner: it never wrote its output.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(!b.join("step-0002/rollout.parquet").exists());

    // 2. Killed between stages: right after step 2's score is recorded.
    let mut child = w.spawn("runs/b", "ref-logprob");
    wait_for("step 2 score recorded", || stage_done(&b, 2, "score"));
    child.kill().unwrap();
    child.wait().unwrap();

    // 3. Killed while step 3's update runs.
    let mut child = w.spawn("runs/b", "update");
    wait_for("step 3 update", || marks.join("update-step-0003").exists());
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(state(&b)["steps_done"], 2);
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !b.join("ckpt/step-0003/weights.txt").exists(),
        "update outlived the runner"
    );

    // 4. Killed during an evaluation's rollout (step 4).
    let mut child = w.spawn("runs/b", "rollout");
    wait_for("step 4 eval", || {
        marks.join("eval-rollout-step-0004").exists()
    });
    child.kill().unwrap();
    child.wait().unwrap();

    let o = w.run("runs/b", &[]);
    assert_ok(&o);
    assert!(
        text(&o).contains("pipeline: continuing runs/b after step 3"),
        "{}",
        text(&o)
    );

    assert_eq!(checkpoints(&a), checkpoints(&b));
    assert_eq!(policy_weights(&a), policy_weights(&b));
    assert_eq!(state(&a), state(&b));
    assert_eq!(
        jsonl_sans_time(&a.join("metrics.jsonl")),
        jsonl_sans_time(&b.join("metrics.jsonl"))
    );
    assert_eq!(
        jsonl_sans_time(&a.join("eval.jsonl")),
        jsonl_sans_time(&b.join("eval.jsonl"))
    );
    for step in 1..=4 {
        for f in ["prompts", "adv"] {
            let p = format!("step-{step:04}/{f}.parquet");
            let (x, y) = (
                Batch::read(&a.join(&p), &[]).unwrap(),
                Batch::read(&b.join(&p), &[]).unwrap(),
            );
            assert_eq!(x.data, y.data, "{p}");
        }
    }
    // The resumed stages appear again in commands.sh: the story of what ran.
    let cmds = std::fs::read_to_string(b.join("commands.sh")).unwrap();
    assert_eq!(
        cmds.matches("--out runs/b/step-0002/rollout.parquet")
            .count(),
        2
    );
    assert_eq!(
        cmds.matches("--out runs/b/step-0002/scored.parquet")
            .count(),
        1
    );
}

#[test]
fn real_score_and_advantage_take_the_runner_commands() {
    let spec = SPEC
        .replace(
            "kl-ctrl = \"adaptive\"",
            "kl-ctrl = \"adaptive\"\nkl-penalty = \"k3\"\nkl-coef = 0.01",
        )
        .replace("use-kl-loss = true\nppo-epochs = 2\n", "");
    let w = Work::with_real(
        &spec,
        &[
            ("score", env!("CARGO_BIN_EXE_score")),
            ("advantage", env!("CARGO_BIN_EXE_advantage")),
        ],
    );
    let o = w.run("r", &[]);
    assert_ok(&o);
    let run = w.path("r");
    // KL in the reward: ref and old log-probs computed, the controller's state carried on.
    let adv = Batch::read(&run.join("step-0004/adv.parquet"), &[schema::ADVANTAGES]).unwrap();
    assert!(adv.has(schema::REF_LOGPROBS) && adv.has(schema::OLD_LOGPROBS));
    assert!(adv.has(schema::TOKEN_REWARDS));
    for step in 1..=4 {
        assert!(run.join(format!("step-{step:04}/kl-state.json")).exists());
    }
    let m = jsonl_sans_time(&run.join("metrics.jsonl"));
    assert_eq!(m.len(), 4);
    let keys: Vec<&String> = m[0].as_object().unwrap().keys().collect();
    assert!(keys.iter().any(|k| k.starts_with("score/")), "{keys:?}");
    assert!(keys.iter().any(|k| k.starts_with("advantage/")), "{keys:?}");
    // The score stage's summary is merged in without repeating its name.
    assert!(m[0].get("score/mean").is_some(), "{}", m[0]);
    let mut matched = 0;
    for (i, line) in m.iter().enumerate() {
        // The runner's reward mean is the mean of the score stage's scores, and with `exact`
        // the accuracy is the share of responses equal to the ground truth.
        let scored = Batch::read(
            &run.join(format!("step-{:04}/scored.parquet", i + 1)),
            &[schema::SCORE],
        )
        .unwrap();
        let s = scored.f32s(schema::SCORE).unwrap();
        let mean = s.iter().map(|&x| x as f64).sum::<f64>() / s.len() as f64;
        assert!((line["reward/mean"].as_f64().unwrap() - mean).abs() < 1e-9);
        let gt = scored.ground_truths().unwrap();
        let texts = scored.strings(schema::RESPONSE_TEXT).unwrap();
        let hits = texts
            .iter()
            .zip(&gt)
            .filter(|(t, g)| t.trim() == g.as_str())
            .count();
        matched += hits;
        let acc = hits as f64 / s.len() as f64;
        assert!(
            (line["accuracy"].as_f64().unwrap() - acc).abs() < 1e-9,
            "{acc} {line}"
        );
        assert!(
            (line["score/accuracy"].as_f64().unwrap() - acc).abs() < 1e-6,
            "{line}"
        );
    }
    assert!(
        matched > 0,
        "no response matched: the accuracy check saw only zeros"
    );
}

#[test]
fn finished_run_extends_with_steps_and_refuses_another_spec() {
    let w = Work::new(&SPEC.replace("steps = 4", "steps = 2"));
    assert_ok(&w.run("r", &[]));
    let o = w.run("r", &[]);
    assert_ok(&o);
    let t = text(&o);
    assert!(
        t.contains(&format!(
            "pipeline: r is complete: 2 steps done; nothing to do. To run more steps: {PIPELINE} run spec.toml --run-dir r --steps N (N > 2)"
        )),
        "{t}"
    );
    // Fewer steps than done: complete as well, and the recorded spec keeps its step count.
    let o = w.run("r", &["--steps", "1"]);
    assert_ok(&o);
    assert!(
        text(&o).contains("r is complete: 2 steps done (--steps 1 asks for fewer); nothing to do"),
        "{}",
        text(&o)
    );
    let resolved = std::fs::read_to_string(w.path("r/spec.resolved.toml")).unwrap();
    assert!(resolved.contains("\nsteps = 2\n"), "{resolved}");

    let o = w.run("r", &["--steps", "3"]);
    assert_ok(&o);
    assert!(text(&o).contains("continuing r after step 2"));
    assert_eq!(state(&w.path("r"))["steps_done"], 3);
    assert_eq!(jsonl_sans_time(&w.path("r/metrics.jsonl")).len(), 3);
    // step 3 is the last step: evaluated even though eval.every is 2
    let e = jsonl_sans_time(&w.path("r/eval.jsonl"));
    assert_eq!(e.last().unwrap()["step"], 3);

    // The same run under a changed spec is refused, naming what changed and the flag that
    // continues under it.
    std::fs::write(w.path("spec.toml"), SPEC.replace("lr = 0.001", "lr = 0.01")).unwrap();
    let o = w.run("r", &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("update.lr: 0.001 -> 0.01"), "{t}");
    assert!(
        t.contains(&format!(
            "\n  {PIPELINE} run spec.toml --run-dir r --allow-spec-change\n"
        )),
        "{t}"
    );
    assert!(!w.path("r/spec-changes.jsonl").exists());
    // Asked for: the run continues under it, and the change is recorded.
    let o = w.run("r", &["--allow-spec-change"]);
    assert_ok(&o);
    assert!(
        text(&o).contains("continuing r under the changed spec from step 4"),
        "{}",
        text(&o)
    );
    assert_eq!(state(&w.path("r"))["steps_done"], 4);
    let changes = std::fs::read_to_string(w.path("r/spec-changes.jsonl")).unwrap();
    let lines: Vec<Value> = changes
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{changes}");
    assert_eq!(lines[0]["step"], 4);
    assert_eq!(lines[0]["spec"], "spec.toml");
    assert_eq!(
        lines[0]["changes"],
        serde_json::json!([{"key": "update.lr", "from": "0.001", "to": "0.01"}])
    );
    assert!(lines[0]["time"].as_str().unwrap().starts_with("20"));
    let resolved = std::fs::read_to_string(w.path("r/spec.resolved.toml")).unwrap();
    assert!(resolved.contains("lr = 0.01\n"), "{resolved}");
    let cmds = std::fs::read_to_string(w.path("r/commands.sh")).unwrap();
    let update_lr = |step: &str| {
        cmds.lines()
            .find(|l| l.contains(&format!("--out-model r/ckpt/{step} ")))
            .map(|l| {
                l.split("--lr ")
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .unwrap()
    };
    assert_eq!(update_lr("step-0003"), "0.001");
    assert_eq!(update_lr("step-0004"), "0.01");
    // The sampler's keys cannot change, asked or not.
    std::fs::write(
        w.path("spec.toml"),
        SPEC.replace("lr = 0.001", "lr = 0.01")
            .replace("prompts-per-step = 3", "prompts-per-step = 2"),
    )
    .unwrap();
    let o = w.run("r", &["--allow-spec-change", "--steps", "5"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("data.prompts-per-step: 3 -> 2"), "{t}");
    assert!(
        t.contains("the prompt sampler's position depends on"),
        "{t}"
    );
    assert_eq!(state(&w.path("r"))["steps_done"], 4);

    // --resume on a directory without a run
    let o = w.run("fresh", &["--resume"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("--resume: fresh holds no run"),
        "{}",
        text(&o)
    );
}

/// The line after the one ending with `marker` in a message: a command to paste.
fn printed_command(t: &str, marker: &str) -> String {
    let mut lines = t.lines();
    lines
        .find(|l| l.ends_with(marker))
        .unwrap_or_else(|| panic!("no {marker:?} in {t}"));
    lines.next().unwrap().trim().to_string()
}

#[test]
fn a_failed_stage_prints_the_command_that_continues_the_run() {
    let spec = SPEC.replace("steps = 4", "steps = 1");
    let w = Work::new(&spec);
    let o = w
        .cmd("r", &[])
        .env("FAKE_FAIL", "advantage")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let t = text(&o);
    // The stage's own message reaches the console (its output goes to the log), then the
    // command that failed and the one way forward.
    assert!(t.contains("  | advantage: refusing on purpose"), "{t}");
    assert!(
        t.contains("step-0001: stage `advantage` failed (exit code 2); its output ended with (all of it in r/pipeline.log):"),
        "{t}"
    );
    let next = printed_command(&t, "continue the run from this stage with:");
    assert_eq!(
        next,
        format!("{PIPELINE} run spec.toml --run-dir r --allow-spec-change")
    );
    assert!(!w.path("r/step-0001/adv.parquet").exists());
    let s = state(&w.path("r"));
    let finished = serde_json::json!(["prompts", "rollout", "score", "ref", "old", "kl-state"]);
    assert_eq!(s["current"]["done"], finished);

    // The fix is an edit of the spec. Rerun as before, the run refuses the edited spec and
    // names the flag; the printed command continues from the failed stage under it.
    let fixed = spec.replace(
        "estimator = \"grpo\"",
        "estimator = \"grpo\"\nnorm-by-std = false",
    );
    std::fs::write(w.path("spec.toml"), &fixed).unwrap();
    let o = w.run("r", &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("advantage.norm-by-std: (unset) -> false"),
        "{}",
        text(&o)
    );
    std::fs::remove_dir_all(w.path("marks")).unwrap();
    std::fs::create_dir_all(w.path("marks")).unwrap();
    assert_ok(&w.shell(&next));
    assert!(
        !w.path("marks/rollout-step-0001").exists(),
        "finished stages must not rerun"
    );
    assert!(w.path("marks/advantage-step-0001").exists());
    assert_eq!(state(&w.path("r"))["steps_done"], 1);
    let changes: Value = serde_json::from_str(
        std::fs::read_to_string(w.path("r/spec-changes.jsonl"))
            .unwrap()
            .trim(),
    )
    .unwrap();
    assert_eq!(changes["step"], 1);
    assert_eq!(changes["finished_in_step"], finished);
    assert_eq!(changes["changes"][0]["key"], "advantage.norm-by-std");
    let cmds = std::fs::read_to_string(w.path("r/commands.sh")).unwrap();
    assert!(
        cmds.contains("--estimator grpo --norm-by-std false --kl-in-reward"),
        "{cmds}"
    );

    // A failure that is not bad input (a crash, a kill): rerunning is the way forward.
    let w = Work::new(&spec);
    let o = w
        .cmd("r", &["--steps", "1"])
        .env("FAKE_FAIL", "update")
        .env("FAKE_FAIL_CODE", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let next = printed_command(&text(&o), "continue the run from this stage with:");
    assert_eq!(
        next,
        format!("{PIPELINE} run spec.toml --run-dir r --steps 1")
    );
    assert_ok(&w.shell(&next));
    assert_eq!(state(&w.path("r"))["steps_done"], 1);
    assert!(!w.path("r/spec-changes.jsonl").exists());
}

#[test]
fn verbose_shows_the_stages_and_a_terminal_gets_a_progress_bar() {
    let spec = SPEC.replace("steps = 4", "steps = 2");
    let w = Work::new(&spec);
    let o = w.run("r", &["-v"]);
    assert_ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("[step-0001] rollout: "), "{err}");
    assert!(err.contains("update: wrote r/ckpt/step-0002"), "{err}");
    assert!(err.contains("step 2/2  reward"), "{err}");

    // On a terminal (a pty from `script`) a progress bar names the task running; the step
    // lines are printed above it.
    let script = Path::new("/usr/bin/script");
    if !script.exists() {
        eprintln!("no /usr/bin/script: the terminal case is not checked here");
        return;
    }
    let line = format!("{PIPELINE} run spec.toml --run-dir t");
    let o = Command::new(script)
        .args(["-qec", &line, "/dev/null"])
        .current_dir(w.dir.path())
        .env("TANDEM_BIN_DIR", &w.bins)
        .env("TERM", "xterm")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_ok(&o);
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(tty.contains("step 2/2  reward"), "{tty}");
    assert!(tty.contains(" step 0/2 ["), "no progress bar: {tty}");
    assert!(tty.contains("(step-0001)"), "no progress bar: {tty}");
}

#[test]
fn the_whole_spec_is_checked_before_anything_runs() {
    let reward_py = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n";
    let no_gt = |w: &Work, file: &str| {
        let schema = Schema::new(vec![Field::new(schema::PROMPT, DataType::Utf8, false)]);
        let col: ArrayRef = Arc::new(StringArray::from(vec!["what is 1+1?"; 4]));
        let data = RecordBatch::try_new(Arc::new(schema), vec![col]).unwrap();
        write_file(&w.path(file), &data, &Default::default()).unwrap();
    };
    type Setup = Box<dyn Fn(&Work)>;
    let cases: Vec<(String, Setup, &str)> = vec![
        (
            SPEC.replace("reward = \"exact\"", "reward = \"python:reward.py:nope\""),
            Box::new(move |w: &Work| std::fs::write(w.path("reward.py"), reward_py).unwrap()),
            "[score] reward = \"python:reward.py:nope\": `python3` could not load `nope` from reward.py",
        ),
        (
            SPEC.replace("reward = \"exact\"", "reward = \"python:reward.py\""),
            Box::new(|w: &Work| {
                std::fs::write(w.path("reward.py"), "import tandem_no_such_module\n").unwrap()
            }),
            "No module named 'tandem_no_such_module'",
        ),
        (
            SPEC.replace("reward = \"exact\"", "reward = \"cmd:./no-such-reward --x\""),
            Box::new(|_: &Work| {}),
            "[score] reward = \"cmd:./no-such-reward --x\": the program `./no-such-reward`: no executable file there",
        ),
        (
            SPEC.to_string(),
            Box::new(|w: &Work| std::fs::remove_file(w.path("model/tokenizer.json")).unwrap()),
            "[model] path: model: no tokenizer.json",
        ),
        (
            SPEC.replace("ref = \"model\"", "ref = \"nope\""),
            Box::new(|_: &Work| {}),
            "[model] ref = nope: no such file or directory",
        ),
        (
            SPEC.replace("n = 2\n", "n = 2\nprompt-key = \"question\"\n"),
            Box::new(|_: &Work| {}),
            "[data] train (prompts in column `question`; the [rollout] prompt-key): train.parquet: column 'question' is missing",
        ),
        (
            SPEC.to_string(),
            Box::new(move |w: &Work| no_gt(w, "train.parquet")),
            "[data] train = train.parquet: no ground truth",
        ),
        (
            SPEC.to_string(),
            Box::new(move |w: &Work| no_gt(w, "val.parquet")),
            "[data] val = val.parquet: no ground truth",
        ),
        (
            SPEC.replace("n = 2\n", "n = 2\ntool = [\"calc=cmd:./no-such-tool\"]\n"),
            Box::new(|_: &Work| {}),
            "[data] train: [rollout] tool = [\"calc=cmd:./no-such-tool\"]",
        ),
        (
            SPEC.replace("max-new-tokens = 8", "max-new-tokens = 8\nmax-prompt-tokens = 4"),
            Box::new(|_: &Work| {}),
            "[data] train (tokenized with the [rollout] flags): train.parquet: column 'prompt', row 0: the prompt has 24 tokens, more than --max-prompt-tokens 4",
        ),
    ];
    for (spec, setup, want) in cases {
        let w = Work::new(&spec);
        setup(&w);
        for extra in [&[][..], &["--dry-run"]] {
            let o = w.run("r", extra);
            let t = text(&o);
            assert_eq!(o.status.code(), Some(2), "{want}: {t}");
            assert!(t.contains(want), "{want:?} not in {t}");
            assert!(!w.path("r").exists());
            assert!(std::fs::read_dir(w.path("marks")).unwrap().next().is_none());
        }
    }
    // A reward file that imports and has its function passes.
    let w = Work::new(&SPEC.replace("reward = \"exact\"", "reward = \"python:reward.py\""));
    std::fs::write(w.path("reward.py"), reward_py).unwrap();
    assert_ok(&w.run("r", &["--dry-run"]));
}

/// `device = "cuda"` (or `--device cuda`) where the driver shows no GPU is refused by the
/// up-front checks: exit 2 naming the key, no run directory, no stage started.
#[test]
fn cuda_without_a_gpu_is_refused_before_anything_runs() {
    // The NVIDIA kernel driver lists each GPU here; without one, CUDA cannot open a device.
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    if gpus > 0 {
        eprintln!("{gpus} GPU(s) here: the no-GPU refusal cannot be exercised");
        return;
    }
    let w = Work::new(&format!("device = \"cuda\"\n{SPEC}"));
    let w_flag = Work::new(SPEC);
    for (w, extra) in [
        (&w, &[][..]),
        (&w, &["--dry-run"][..]),
        (&w_flag, &["--device", "cuda"][..]),
    ] {
        let o = w.run("r", extra);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(
            t.contains("device = \"cuda\": no CUDA driver found; use --device cpu")
                || t.contains("device = \"cuda\": the CUDA driver shows no GPU; use --device cpu"),
            "{t}"
        );
        assert!(!w.path("r").exists());
        assert!(std::fs::read_dir(w.path("marks")).unwrap().next().is_none());
    }
}

#[test]
fn dry_run_prints_commands_and_writes_nothing() {
    let w = Work::new(
        &SPEC
            .replace("steps = 4", "steps = 2")
            .replace("ref = \"model\"\n", "")
            .replace("use-kl-loss = true", "")
            .replace("kl-in-reward = true\nkl-ctrl = \"adaptive\"\n", "")
            .replace("ppo-epochs = 2", ""),
    );
    let o = w.run("r", &["--dry-run"]);
    assert_ok(&o);
    assert!(!w.path("r").exists());
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().collect();
    // no KL and no reference: no ref-logprob; one mini-batch, one epoch: no old log-probs
    assert!(!out.contains("ref-logprob"), "{out}");
    assert!(
        lines[0].ends_with("sync-weights --from model --to r/policy --policy-version 0"),
        "{out}"
    );
    assert!(lines[1].contains(
        "rollout --model r/policy --in val.parquet --out r/eval/step-0000/rollout.parquet"
    ));
    assert_eq!(
        lines[4],
        "# pipeline: sample 3 prompts of train.parquet into r/step-0001/prompts.parquet"
    );
    assert_eq!(out.matches("update --model r/policy").count(), 2);
    assert!(lines
        .last()
        .unwrap()
        .starts_with("# pipeline: write step 2 to r/metrics.jsonl"));
}

#[test]
fn bad_spec_and_inputs_exit_2_before_anything_runs() {
    let w = Work::new(&SPEC.replace("[eval]\nevery = 2", "[eval]\nevry = 2"));
    let o = w.run("r", &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("spec.toml:33:1: unknown key `evry`: did you mean `every`?"),
        "{}",
        text(&o)
    );
    assert!(!w.path("r").exists());

    // Stage values are parsed by the stage's own parser when the spec is loaded, and every
    // stage command is checked by its stage before the run directory is made.
    for (from, to, want) in [
        (
            "temperature = 1.0",
            "temperature = \"x\"",
            "spec.toml:16:1: [rollout] temperature = \"x\": invalid value 'x' for '--temperature <TEMPERATURE>'",
        ),
        (
            "estimator = \"grpo\"",
            "estimator = \"ppo\"",
            "spec.toml:23:1: [advantage] estimator = \"ppo\": invalid value 'ppo' for '--estimator <ESTIMATOR>' [possible values: grpo,",
        ),
        (
            "lr = 0.001",
            "lr = 0.001\nloss = \"bogus\"",
            "spec.toml:29:1: [update] loss = \"bogus\": invalid value 'bogus' for '--loss <LOSS>' [possible values: vanilla, gspo, cispo, sft]",
        ),
        (
            "reward = \"exact\"",
            "reward = \"bogus\"",
            "spec.toml: [score]: --reward 'bogus': unknown reward",
        ),
        (
            "temperature = 1.0",
            "temperature = nan",
            "[rollout] temperature = nan: invalid value 'NaN' for '--temperature <TEMPERATURE>': must be a finite number >= 0",
        ),
        (
            "lr = 0.001",
            "lr = 0.001\ntemperature = 0.5",
            "spec.toml:29:1: [update] temperature = 0.5 differs from the rollout's sampling temperature 1",
        ),
    ] {
        let w = Work::new(&SPEC.replace(from, to));
        for extra in [&[][..], &["--dry-run"]] {
            let o = w.run("r", extra);
            assert_eq!(o.status.code(), Some(2), "{}", text(&o));
            assert!(text(&o).contains(want), "{want:?} not in {}", text(&o));
            assert!(!w.path("r").exists());
            assert!(std::fs::read_dir(w.path("marks")).unwrap().next().is_none());
        }
    }

    let w = Work::new(&SPEC.replace("path = \"model\"", "path = \"nope\""));
    let o = w.run("r", &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("[model] path = nope: no such file or directory"),
        "{}",
        text(&o)
    );
    assert!(!w.path("r").exists());

    let w = Work::new(SPEC);
    std::fs::write(w.path("train.parquet"), "not parquet").unwrap();
    let o = w.run("r", &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("train.parquet: not a readable Parquet file"),
        "{}",
        text(&o)
    );

    let w = Work::new(SPEC);
    let o = w
        .cmd("r", &[])
        .env("TANDEM_BIN_DIR", w.path("nowhere"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("stage binary `sync-weights` not found"),
        "{}",
        text(&o)
    );

    let o = Command::new(TANDEM)
        .args(["plot", "nowhere"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("nowhere: no metrics.jsonl or eval.jsonl lines"));
    let o = Command::new(TANDEM)
        .args(["inspect", "nowhere.parquet"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("nowhere.parquet: cannot open batch file"));
}

/// `tandem prepare synth` rows, answered with their reference answers, get full marks from the
/// real `score` stage (exact for the plain format, gsm8k for the `####` one).
#[test]
fn synth_reference_answers_score_full_marks() {
    let dir = tempfile::tempdir().unwrap();
    for (task, format, reward) in [
        ("add", "plain", "exact"),
        ("reverse", "plain", "exact"),
        ("copy", "plain", "exact"),
        ("add", "gsm8k", "gsm8k"),
    ] {
        let task_fmt = format!("{task}-{format}");
        let data = dir.path().join(format!("{task_fmt}.parquet"));
        let o = Command::new(TANDEM)
            .args([
                "prepare", "synth", "--task", task, "--n", "20", "--seed", "3",
            ])
            .args(["--answer-format", format, "--out"])
            .arg(&data)
            .output()
            .unwrap();
        assert_ok(&o);
        let b = Batch::read(&data, &[schema::DATA_SOURCE]).unwrap();
        assert_eq!(b.num_rows(), 20);
        assert!(b
            .strings(schema::DATA_SOURCE)
            .unwrap()
            .iter()
            .all(|s| *s == format!("synth/{task}")));
        let answers: Vec<String> = b
            .json_rows(schema::EXTRA_INFO)
            .iter()
            .map(|e| e["answer"].as_str().unwrap().to_string())
            .collect();
        let mut cols = NewColumns::new();
        cols.add(schema::RESPONSE_TEXT, Arc::new(StringArray::from(answers)));
        let answered = dir.path().join(format!("{task_fmt}-answered.parquet"));
        b.write_derived(&answered, cols, &no_meta("test")).unwrap();
        let scored = dir.path().join(format!("{task_fmt}-scored.parquet"));
        let o = Command::new(env!("CARGO_BIN_EXE_score"))
            .args([
                "--in",
                answered.to_str().unwrap(),
                "--out",
                scored.to_str().unwrap(),
            ])
            .args(["--reward", reward])
            .output()
            .unwrap();
        assert_ok(&o);
        let s = Batch::read(&scored, &[schema::SCORE])
            .unwrap()
            .f32s(schema::SCORE)
            .unwrap();
        assert!(s.iter().all(|&x| x == 1.0), "{task}: {s:?}");
    }
    let o = Command::new(TANDEM)
        .args([
            "prepare",
            "synth",
            "--task",
            "add",
            "--n",
            "0",
            "--out",
            "x.parquet",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("--n must be at least 1"));
    assert!(!dir.path().join("x.parquet").exists());
}

// ---------------------------------------------------------------------------------------------
// The real stages

/// The real stage binaries: next to `pipeline` (cargo builds every binary of the package).
/// Runs `tandem ARGS` in `d` and asserts success.
pub(crate) fn tandem_ok(d: &Path, args: &[&str]) {
    let o = Command::new(TANDEM)
        .args(args)
        .current_dir(d)
        .output()
        .unwrap();
    assert_ok(&o);
}

/// A stand-in of the repository where a shipped GSM8K spec looks: a tiny model at
/// `models/MODEL`, its train set as `data/gsm8k/{train,test}.parquet`, and `pipelines/` (the
/// real one, for the spec and its reward files), in `w`.
pub(crate) fn gsm8k_checkout(w: &Path, model: &str) {
    stage_util::model_and_train_set(w, 64, 128, 4);
    let link = |from: &str, to: &Path| {
        std::fs::create_dir_all(w.join(from).parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(to, w.join(from)).unwrap();
    };
    link(&format!("models/{model}"), &w.join("model"));
    link("data/gsm8k/train.parquet", &w.join("train.parquet"));
    link("data/gsm8k/test.parquet", &w.join("train.parquet"));
    link(
        "pipelines",
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines"),
    );
}

/// A spec shipped in `pipelines/`, parsed.
pub(crate) fn shipped_spec(name: &str) -> toml::Table {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    toml::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

pub(crate) fn real_bins() -> PathBuf {
    let dir = Path::new(PIPELINE).parent().unwrap().to_path_buf();
    for s in STAGES {
        assert!(dir.join(s).is_file(), "{s} is not built next to {PIPELINE}");
    }
    dir
}

/// Whether a child process of `parent` whose command line contains `needle` runs now.
pub(crate) fn running_child(parent: u32, needle: &str) -> bool {
    children(parent).iter().any(|(_, cmd)| cmd.contains(needle))
}

/// The child processes of `parent` that run now: (pid, command line with spaces between the
/// arguments).
pub(crate) fn children(parent: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so read after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let ppid: u32 = rest
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        if ppid != parent {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        out.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
    }
    out
}

/// Every file of every checkpoint, by content.
pub(crate) fn checkpoint_files(run: &Path) -> BTreeMap<String, Vec<u8>> {
    checkpoint_files_in(run, "ckpt")
}

/// Two runs of one spec ended alike: every checkpoint file under each of `subs` (`ckpt`,
/// `critic`) bit for bit, the state, and the metrics (timings aside).
pub(crate) fn assert_runs_end_alike(a: &Path, b: &Path, subs: &[&str]) {
    for sub in subs {
        let (ca, cb) = (checkpoint_files_in(a, sub), checkpoint_files_in(b, sub));
        assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
        for (k, v) in &ca {
            assert!(v == &cb[k], "{sub}/{k} differs between {a:?} and {b:?}");
        }
    }
    assert_eq!(state(a), state(b));
    assert_eq!(
        jsonl_sans_time(&a.join("metrics.jsonl")),
        jsonl_sans_time(&b.join("metrics.jsonl"))
    );
}

/// Every file of every checkpoint under `run/sub` (`ckpt`, or the critic's `critic`).
pub(crate) fn checkpoint_files_in(run: &Path, sub: &str) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for ck in std::fs::read_dir(run.join(sub)).unwrap() {
        let ck = ck.unwrap();
        for f in std::fs::read_dir(ck.path()).unwrap() {
            let f = f.unwrap();
            let name = format!(
                "{}/{}",
                ck.file_name().to_string_lossy(),
                f.file_name().to_string_lossy()
            );
            out.insert(name, std::fs::read(f.path()).unwrap());
        }
    }
    out
}

/// The whole loop with the real stages on a tiny random model: SIGKILL during rollout, between
/// stages and during update, then a rerun, ends with the same checkpoints (weights and
/// optimizer state bit for bit), policy, metrics and evaluations as an uninterrupted run.
#[test]
fn real_stages_resume_after_sigkill_to_identical_weights() {
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tandem = |args: &[&str]| tandem_ok(d, args);
    stage_util::model_and_train_set(d, 192, 512, 40);
    tandem(&[
        "prepare",
        "synth",
        "--task",
        "add",
        "--digits",
        "1",
        "--n",
        "8",
        "--seed",
        "2",
        "--split",
        "test",
        "--out",
        "val.parquet",
    ]);
    std::fs::write(
        d.join("spec.toml"),
        r#"
seed = 3
steps = 3
[model]
path = "model"
[data]
train = "train.parquet"
val = "val.parquet"
prompts-per-step = 4
[rollout]
n = 4
temperature = 1.0
max-new-tokens = 24
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.001
use-kl-loss = true
ppo-epochs = 2
mini-batch-size = 8
[eval]
every = 2
[checkpoint]
every = 2
keep-last = 1
"#,
    )
    .unwrap();
    let cmd = |run: &str| {
        let mut c = Command::new(PIPELINE);
        c.current_dir(d)
            .args(["run", "spec.toml", "--run-dir", run])
            .env("TANDEM_BIN_DIR", &bins);
        c
    };
    let o = cmd("a").output().unwrap();
    assert_ok(&o);
    let (a, b) = (d.join("a"), d.join("b"));
    // The real stages' output is in the log, not on the console: one line per step there.
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        err.lines().filter(|l| l.starts_with("step ")).count(),
        4,
        "{err}"
    );
    assert!(err.lines().count() <= 12, "{err}");
    assert!(
        !err.contains("rollout: 4 prompts x 4 = 16 samples"),
        "{err}"
    );
    let plog = std::fs::read_to_string(a.join("pipeline.log")).unwrap();
    assert_eq!(
        plog.matches("rollout: 4 prompts x 4 = 16 samples").count(),
        3,
        "{plog}"
    );

    let kill_when = |what: &str, cond: &mut dyn FnMut(u32) -> bool| kill_when(cmd("b"), what, cond);
    kill_when("step 2 rollout running", &mut |pid| {
        running_child(pid, "--out b/step-0002/rollout.parquet")
    });
    // The stage died with the runner (it would have finished well within this wait).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!b.join("step-0002/rollout.parquet").exists());
    kill_when("step 2 score recorded", &mut |_| stage_done(&b, 2, "score"));
    kill_when("step 3 update running", &mut |pid| {
        running_child(pid, "--out-model b/ckpt/step-0003")
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!b.join("ckpt/step-0003").exists());
    let o = cmd("b").output().unwrap();
    assert_ok(&o);
    assert!(
        text(&o).contains("pipeline: continuing b after step 2"),
        "{}",
        text(&o)
    );

    let (ca, cb) = (checkpoint_files(&a), checkpoint_files(&b));
    assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
    assert!(
        ca.contains_key("step-0003/model.safetensors")
            && ca.contains_key("step-0002/optimizer.safetensors")
    );
    for (k, v) in &ca {
        assert!(v == &cb[k], "{k} differs after the resumed run");
    }
    assert_eq!(
        std::fs::read(a.join("policy")).unwrap(),
        std::fs::read(b.join("policy")).unwrap()
    );
    assert_eq!(state(&a), state(&b));
    assert_eq!(
        jsonl_sans_time(&a.join("metrics.jsonl")),
        jsonl_sans_time(&b.join("metrics.jsonl"))
    );
    assert_eq!(
        jsonl_sans_time(&a.join("eval.jsonl")),
        jsonl_sans_time(&b.join("eval.jsonl"))
    );
}

/// `[update] bypass-mode = true` on the CPU (batch-invariant): `update` takes the rollout's
/// log-probs as the old ones and skips the old-logprob pass that the mini-batches would
/// otherwise need. Without bypass that pass is `update`'s own (no stage, no batch file: it
/// scores the rows outside the first mini-batch before the steps), or, with `[update]
/// rollout-rs` (which bypass refuses), the runner's old-logprob stage. Every step's metrics
/// line carries the rollout-vs-trainer mismatch: from update's recomputed old log-probs, from
/// the stage's column, or (bypass) from update's first forward. On the GPU the spec must ask
/// for the batch-invariant kernels.
#[test]
fn bypass_mode_skips_the_old_logprob_pass() {
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    stage_util::model_and_train_set(d, 64, 128, 40);
    let spec = |extra: &str| {
        format!(
            r#"
seed = 3
steps = 2
{extra}
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 4
[rollout]
n = 4
max-new-tokens = 8
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.001
mini-batch-size = 8
"#
        )
    };
    let run = |name: &str, text: &str, extra: &[&str]| {
        std::fs::write(d.join(format!("{name}.toml")), text).unwrap();
        Command::new(PIPELINE)
            .current_dir(d)
            .args(["run", &format!("{name}.toml"), "--run-dir", name])
            .args(extra)
            .env("TANDEM_BIN_DIR", &bins)
            .output()
            .unwrap()
    };
    let plain = spec("");
    let bypass = plain.replace(
        "mini-batch-size = 8",
        "mini-batch-size = 8\nbypass-mode = true",
    );
    let with_stage = plain.replace(
        "mini-batch-size = 8",
        "mini-batch-size = 8\nrollout-rs = \"token\"",
    );
    for (name, spec_text, source) in [
        ("in-update", &plain, "recomputed_old"),
        ("with-stage", &with_stage, "old_logprobs"),
        ("bypass", &bypass, "first_step"),
    ] {
        let o = run(name, spec_text, &[]);
        assert_ok(&o);
        let commands = std::fs::read_to_string(d.join(name).join("commands.sh")).unwrap();
        let updates: Vec<&str> = commands
            .lines()
            .filter(|l| l.contains("/update "))
            .collect();
        assert_eq!(updates.len(), 2, "{commands}");
        let bypassed = name == "bypass";
        let staged = name == "with-stage";
        // Mini-batches alone leave the old log-probs to update: the stage runs for
        // rollout-rs only.
        assert_eq!(
            commands.contains("--column old_logprobs"),
            staged,
            "{commands}"
        );
        assert!(updates
            .iter()
            .all(|l| l.contains("--bypass-mode") == bypassed));
        assert_eq!(d.join(name).join("step-0001/old.parquet").exists(), staged);
        // update scores the rows itself only where neither the column nor bypass gives them.
        let plog = std::fs::read_to_string(d.join(name).join("pipeline.log")).unwrap();
        assert_eq!(
            plog.contains("old_logprobs absent and several optimizer steps"),
            name == "in-update",
            "{plog}"
        );
        let lines = jsonl_sans_time(&d.join(name).join("metrics.jsonl"));
        let at = |i: usize, k: &str| lines[i][format!("mismatch/{k}")].as_f64().unwrap();
        eprintln!(
            "{name}: mismatch abs_diff_max step 1 {:.2e}, step 2 {:.2e}; ratio_outside_frac step 2 {:.4}",
            at(0, "abs_diff_max"),
            at(1, "abs_diff_max"),
            at(1, "ratio_outside_frac")
        );
        // The CPU rollout computes with the trainer's kernels; at step 1 both have the model's
        // weights and agree bit for bit. From step 2 the rollout samples with the bf16
        // checkpoint, the trainer computes with its f32 masters (docs/PIPELINE.md): the
        // difference is that rounding of the weights.
        assert_eq!(at(0, "abs_diff_max"), 0.0, "{:?}", lines[0]);
        if name != "with-stage" {
            assert!(at(1, "abs_diff_max") > 1e-6, "{:?}", lines);
        } else {
            // The old-logprob stage reads the bf16 checkpoint, as the rollout does.
            assert_eq!(at(1, "abs_diff_max"), 0.0, "{:?}", lines);
        }
        for line in lines {
            assert_eq!(line["mismatch/source"], source, "{line}");
            let mean = line["mismatch/abs_diff_mean"].as_f64().unwrap();
            assert!((0.0..1e-3).contains(&mean), "{line}");
            assert!(line["mismatch/tokens"].as_u64().unwrap() > 0, "{line}");
            assert!(
                line.get("update/mismatch/abs_diff_mean").is_none(),
                "{line}"
            );
        }
    }

    // Refused before anything runs: on the GPU without batch-invariant kernels, and with a
    // KL in the reward (which needs the skipped pass).
    for (spec_text, want) in [
        (
            bypass.replace("seed = 3", "seed = 3\ndevice = \"cuda\""),
            "[update] bypass-mode = true takes the rollout's log-probs as the old ones, which holds only when they are the trainer's: set batch-invariant = true",
        ),
        (
            bypass.replace("estimator = \"grpo\"", "estimator = \"grpo\"\nkl-in-reward = true"),
            "[update] bypass-mode = true skips the old-logprob pass, which [advantage] kl-in-reward needs",
        ),
    ] {
        let o = run("refused", &spec_text, &["--dry-run"]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(want), "{}", text(&o));
        assert!(!d.join("refused").exists());
    }
    // With batch-invariant kernels the GPU spec passes the spec's checks: a dry run prints
    // the plan where there is a GPU, and gets as far as the check of the device where there
    // is none (after the commands' checks that refuse bypass-mode).
    let gpu = bypass.replace(
        "seed = 3",
        "seed = 3\ndevice = \"cuda\"\nbatch-invariant = true",
    );
    let o = run("gpu", &gpu, &["--dry-run"]);
    if std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count()) > 0 {
        assert_ok(&o);
        assert!(!text(&o).contains("--column old_logprobs"), "{}", text(&o));
    } else {
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("device = \"cuda\": "), "{}", text(&o));
        assert!(!text(&o).contains("bypass-mode"), "{}", text(&o));
    }
}

// ---------------------------------------------------------------------------------------------
// The shipped specs

/// The Makefile's targets and each one's recipe.
fn make_targets(makefile: &str) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Vec<String> = Vec::new();
    for line in makefile.lines() {
        if let Some(cmd) = line.strip_prefix('\t') {
            for t in &current {
                let recipe = out.get_mut(t).unwrap();
                recipe.push_str(cmd);
                recipe.push('\n');
            }
            continue;
        }
        current.clear();
        let Some((names, _)) = line.split_once(':') else {
            continue;
        };
        if line.starts_with('#') || line.contains('=') || names.starts_with('.') {
            continue;
        }
        for t in names.split_whitespace() {
            out.entry(t.to_string()).or_default();
            current.push(t.to_string());
        }
    }
    out
}

/// The targets each `make ` of `text` names: the words after it up to the first that is no
/// target name, or that ends the command (a closing quote or bracket, a comma).
fn make_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("make ") {
        if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '-') {
            continue;
        }
        for word in text[i + 5..].split_whitespace() {
            let w = word.trim_end_matches([')', ',', '`', ';', ':', '.']);
            if w.is_empty()
                || !w
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                break;
            }
            out.push(w.to_string());
            if w.len() < word.len() {
                break;
            }
        }
    }
    out
}

/// Every spec in pipelines/ says in its header how to run it, and what it names exists: its
/// `make` targets in the Makefile (one of them, or a `pipeline run` of the spec, runs this very
/// spec), `tandem` subcommands in `tandem --help`, scripts in the tree. Then each runs through
/// `pipeline run --dry-run` (on the CPU: no GPU here) with tiny stand-ins at the model and data
/// paths it names, as the header's commands would have made them; a spec with tools offers them
/// in its evaluation too.
#[test]
fn every_shipped_spec_runs_after_the_command_its_header_names() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let targets = make_targets(&std::fs::read_to_string(repo.join("Makefile")).unwrap());
    let help = Command::new(TANDEM).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let subcommands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(subcommands.contains(&"init-model"), "{help}");

    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    std::os::unix::fs::symlink(repo.join("pipelines"), w.join("pipelines")).unwrap();
    let mut specs: Vec<PathBuf> = std::fs::read_dir(repo.join("pipelines"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    specs.sort();
    assert!(specs.len() >= 8, "{} specs", specs.len());
    for spec in &specs {
        let name = spec.file_name().unwrap().to_str().unwrap();
        let text = std::fs::read_to_string(spec).unwrap();
        let header: String = text
            .lines()
            .take_while(|l| l.starts_with('#'))
            .map(|l| format!("{}\n", l.trim_start_matches('#')))
            .collect();
        // What the header names exists.
        let makes = make_words(&header);
        for t in &makes {
            assert!(
                targets.contains_key(t),
                "{name}: `make {t}`: no such target"
            );
        }
        for (i, _) in header.match_indices("tandem ") {
            let sub = header[i + 7..].split_whitespace().next().unwrap_or("");
            let sub = sub.trim_end_matches(['`', ')', ',']);
            if sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !sub.is_empty() {
                assert!(
                    subcommands.contains(&sub),
                    "{name}: `tandem {sub}`: no such subcommand"
                );
            }
        }
        for word in header.split_whitespace() {
            let word = word.trim_matches(['`', '(', ')', ',', ':']);
            if let Some(at) = word.find("pipelines/") {
                let path = &word[at..];
                if path.ends_with(".sh") || path.ends_with(".py") {
                    assert!(repo.join(path).is_file(), "{name}: {path} does not exist");
                }
            }
        }
        // ...and one of its commands runs this spec.
        let runs_itself = header.lines().any(|l| {
            l.split_once("pipeline run ")
                .and_then(|(_, r)| r.split_whitespace().next())
                .is_some_and(|p| p.ends_with(&format!("pipelines/{name}")))
        }) || makes.iter().any(|t| {
            let recipe = &targets[t];
            recipe.contains(&format!("={name}"))
                || (name == "demo.toml"
                    && recipe.contains("pipelines/demo.sh")
                    && !recipe.contains("DEMO_SPEC="))
        });
        assert!(
            runs_itself,
            "{name}: the header names no command that runs it:\n{header}"
        );

        // Stand-ins where the header's commands put the model and the data.
        let t: toml::Table = toml::from_str(&text).unwrap();
        let model = t["model"]["path"].as_str().unwrap();
        if !w.join(model).exists() {
            tandem_ok(
                w,
                &[
                    "init-model",
                    "--like",
                    "qwen2",
                    "--layers",
                    "1",
                    "--hidden",
                    "32",
                    "--heads",
                    "2",
                    "--ffn",
                    "64",
                    "--vocab",
                    "300",
                    "--out",
                    model,
                ],
            );
        }
        for key in ["train", "val"] {
            let Some(p) = t["data"].get(key).and_then(|v| v.as_str()) else {
                continue;
            };
            if !w.join(p).exists() {
                tandem_ok(
                    w,
                    &[
                        "prepare",
                        "synth",
                        "--task",
                        "add",
                        "--digits",
                        "1",
                        "--n",
                        "16",
                        "--answer-format",
                        "gsm8k",
                        "--out",
                        p,
                    ],
                );
            }
        }
        let run = format!("r-{name}");
        let o = Command::new(PIPELINE)
            .current_dir(w)
            .args([
                "run",
                &format!("pipelines/{name}"),
                "--dry-run",
                "--device",
                "cpu",
            ])
            .args(["--run-dir", &run])
            .output()
            .unwrap();
        assert_ok(&o);
        let plan = String::from_utf8_lossy(&o.stdout);
        assert!(plan.contains("rollout --model"), "{name}");
        // A spec with tools offers them in its evaluation too.
        if text.contains("tool = [") {
            let eval = plan
                .lines()
                .filter(|l| l.contains("/rollout ") && l.contains(" --top-k 1 "));
            // ...in its call format.
            let format = match text.contains("tool-format = \"code\"") {
                true => " --tool-format code",
                false => " --tool ",
            };
            assert!(
                eval.clone().count() > 0
                    && eval
                        .into_iter()
                        .all(|l| l.contains(" --tool ") && l.contains(format)),
                "{name}: {plan}"
            );
        }
        assert!(!w.join(&run).exists(), "{name}: the dry run wrote {run}");
    }
}

#[test]
fn make_words_and_targets_are_read() {
    assert_eq!(
        make_words("run `make model-x data` first (or make demo-dapo), then make"),
        ["model-x", "data", "demo-dapo"]
    );
    let t = make_targets(".PHONY: a b\nV := 1\n# c: d\na: b\n\techo a\nb c: x\n\techo bc\n");
    assert_eq!(t.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(
        (t["a"].as_str(), t["c"].as_str()),
        ("echo a\n", "echo bc\n")
    );
}

// ---------------------------------------------------------------------------------------------
// tandem spec from-verl

/// verl's GRPO quick start (examples/grpo_trainer/run_qwen2-7b.sh) as command-line overrides,
/// on this machine: the CPU, one process, the files of `verl_dir`.
const VERL_GRPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "data.train_files=data/train.parquet",
    "data.val_files=data/test.parquet",
    "data.train_batch_size=2",
    "data.max_prompt_length=512",
    "data.max_response_length=64",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=models/tiny",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=3",
];

/// `d/models/tiny` (a random model with a chat template) and verl's GSM8K rows as
/// `d/data/{train,test}.parquet`.
fn verl_dir() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    tandem_ok(
        d,
        &[
            "init-model",
            "--like",
            "qwen2",
            "--layers",
            "1",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "128",
            "--vocab",
            "512",
            "--seed",
            "0",
            "--out",
            "models/tiny",
        ],
    );
    let gsm8k =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verl_gsm8k/train.parquet");
    std::fs::create_dir_all(d.join("data")).unwrap();
    for name in ["train", "test"] {
        std::fs::copy(&gsm8k, d.join(format!("data/{name}.parquet"))).unwrap();
    }
    t
}

fn from_verl(d: &Path, extra: &[&str]) -> Output {
    let yaml = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verl/ppo_trainer.yaml");
    Command::new(TANDEM)
        .args(["spec", "from-verl"])
        .arg(yaml)
        .args(VERL_GRPO)
        .args(extra)
        .current_dir(d)
        .output()
        .unwrap()
}

#[test]
fn a_verl_config_becomes_a_spec_that_pipeline_runs() {
    let t = verl_dir();
    let d = t.path();
    let o = from_verl(d, &["--out", "grpo.toml"]);
    assert_ok(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    // The keys without a counterpart, by rule, with the reason.
    assert!(err.contains("verl's FSDP/Megatron critic worker"), "{err}");
    assert!(
        err.contains("  trainer.logger: tandem logs to metrics.jsonl and TensorBoard"),
        "{err}"
    );
    assert!(
        err.contains("  actor_rollout_ref.rollout.gpu_memory_utilization: vLLM's share"),
        "{err}"
    );
    assert!(err.contains("wrote grpo.toml"), "{err}");
    assert!(o.stdout.is_empty());
    let spec: toml::Table =
        toml::from_str(&std::fs::read_to_string(d.join("grpo.toml")).unwrap()).unwrap();
    // 5 training rows, 2 prompts a step: 2 full batches an epoch, 3 epochs.
    assert_eq!(spec["steps"].as_integer(), Some(6));
    assert_eq!(spec["rollout"]["n"].as_integer(), Some(5));
    // verl's mini-batch of 1 prompt is its 5 samples.
    assert_eq!(spec["update"]["mini-batch-size"].as_integer(), Some(5));
    assert_eq!(
        spec["score"]["reward"].as_str(),
        Some("gsm8k"),
        "data_source openai/gsm8k"
    );
    // The spec passes every check `pipeline run` makes (the stages' flags, the model, the
    // datasets, the reward) and plans verl's step: rollout, score, reference, GRPO, update.
    let o = Command::new(PIPELINE)
        .args(["run", "grpo.toml", "--dry-run"])
        .current_dir(d)
        .output()
        .unwrap();
    assert_ok(&o);
    let plan = String::from_utf8_lossy(&o.stdout);
    for want in [
        "rollout --model runs/grpo/policy --in runs/grpo/step-0001/prompts.parquet",
        "--n 5",
        "--max-new-tokens 64",
        "--column ref_logprobs",
        "--estimator grpo",
        "--use-kl-loss",
        "--mini-batch-size 5",
    ] {
        assert!(plan.contains(want), "{want}: {plan}");
    }
    // Without --out the spec goes to stdout, the same text.
    let o = from_verl(d, &[]);
    assert_ok(&o);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        std::fs::read_to_string(d.join("grpo.toml")).unwrap()
    );
}

#[test]
fn from_verl_refuses_bad_values_and_writes_nothing() {
    let t = verl_dir();
    let d = t.path();
    for (extra, want) in [
        (
            &["actor_rollout_ref.rollout.n=0"][..],
            "actor_rollout_ref.rollout.n = 0: ",
        ),
        (
            &["data.train_batch_size=abc"][..],
            "data.train_batch_size = \"abc\": ",
        ),
        (
            &["algorithm.adv_estimator=ppo"][..],
            "algorithm.adv_estimator = \"ppo\": ",
        ),
        (&["data..x=1"][..], "override `data..x=1`"),
        (
            &["+data.train_batch_size=4"][..],
            "data.train_batch_size is already in the config",
        ),
        (
            &["data.train_batch_size=100"][..],
            "fewer than data.train_batch_size = 100",
        ),
    ] {
        let mut args = extra.to_vec();
        args.extend(["--out", "bad.toml"]);
        let o = from_verl(d, &args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{extra:?}: {}", text(&o));
        assert!(!d.join("bad.toml").exists() && !d.join("bad.toml.tmp").exists());
    }
    // Not YAML: the file named.
    std::fs::write(d.join("broken.yaml"), "data: [1, 2\n").unwrap();
    let o = Command::new(TANDEM)
        .args(["spec", "from-verl", "broken.yaml", "--out", "bad.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("broken.yaml: not valid YAML"),
        "{}",
        text(&o)
    );
    assert!(!d.join("bad.toml").exists());
}

/// Starts `cmd` (its output dropped) and SIGKILLs it once `cond(its pid)` holds; the run must
/// not end before, and the condition must come within 120 s.
pub(crate) fn kill_when(mut cmd: Command, what: &str, cond: &mut dyn FnMut(u32) -> bool) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let t0 = Instant::now();
    while !cond(pid) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before: {what}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}
