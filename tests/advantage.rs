//! End-to-end tests of the `advantage` binary on small batch files.

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, Float32Array, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file, Batch};

/// Columns of a test batch, as rows.
struct Rows {
    uids: Vec<&'static str>,
    masks: Vec<Vec<u8>>,
    scores: Vec<f32>,
    extra: Vec<(&'static str, ArrayRef)>,
}

impl Rows {
    /// Two prompts: "a" with scores 1, 0, 0.5 and "b" with one row of score -2.
    fn example() -> Rows {
        Rows {
            uids: vec!["a", "a", "a", "b"],
            masks: vec![vec![1, 1, 1], vec![1, 1], vec![1, 0, 1, 0], vec![1, 1]],
            scores: vec![1.0, 0.0, 0.5, -2.0],
            extra: vec![],
        }
    }

    fn offsets(&self) -> Vec<usize> {
        let mut o = vec![0];
        for m in &self.masks {
            o.push(o.last().unwrap() + m.len());
        }
        o
    }

    /// A per-token float column with the batch's shape.
    fn token_col(mut self, name: &'static str, values: Vec<f32>) -> Rows {
        let col = list_array::<Float32Type>(&self.offsets(), values);
        self.extra.push((name, col));
        self
    }

    fn write(&self, path: &Path) {
        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), "7".to_string());
        write_file(path, &self.record_batch(), &meta).unwrap();
    }

    fn record_batch(&self) -> RecordBatch {
        let offsets = self.offsets();
        let n: usize = *offsets.last().unwrap();
        let ids: Vec<i32> = (0..n as i32).collect();
        let mask: Vec<u8> = self.masks.concat();
        let mut cols: Vec<(Field, ArrayRef)> = vec![
            (
                schema::field(schema::PROMPT_UID),
                Arc::new(StringArray::from(self.uids.clone())),
            ),
            (
                schema::field(schema::RESPONSE_IDS),
                list_array::<Int32Type>(&offsets, ids),
            ),
            (
                schema::field(schema::RESPONSE_MASK),
                list_array::<UInt8Type>(&offsets, mask),
            ),
            (
                schema::field(schema::SCORE),
                Arc::new(Float32Array::from(self.scores.clone())),
            ),
        ];
        for (name, col) in &self.extra {
            cols.push((schema::field(name), col.clone()));
        }
        let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap()
    }

    /// Write the batch less one column.
    fn write_without(&self, path: &Path, skip: &str) {
        let data = self.record_batch();
        let schema = data.schema();
        let keep: Vec<usize> = (0..schema.fields().len())
            .filter(|&i| schema.field(i).name() != skip)
            .collect();
        write_file(path, &data.project(&keep).unwrap(), &BTreeMap::new()).unwrap();
    }
}

fn advantage(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_advantage"))
        .args(args)
        .output()
        .expect("running advantage")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol,
            "[{i}]: got {g}, want {w}\n{got:?}"
        );
    }
}

struct Dir {
    _tmp: tempfile::TempDir,
    path: PathBuf,
}

fn dir() -> Dir {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().to_path_buf();
    Dir { _tmp: tmp, path }
}

#[test]
fn grpo_end_to_end() {
    let d = dir();
    let (inp, out, metrics) = (
        d.path.join("in.parquet"),
        d.path.join("out.parquet"),
        d.path.join("m.json"),
    );
    Rows::example().write(&inp);
    let o = advantage(&[
        "--in",
        s(&inp),
        "--out",
        s(&out),
        "--estimator",
        "grpo",
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let b = Batch::read(&out, &[schema::ADVANTAGES, schema::RETURNS]).unwrap();
    // Group a: mean 0.5, std 0.5 -> ±0.5/(0.5 + 1e-6) and 0; group b alone: -2/(1 + 1e-6).
    let (p, m) = (0.5 / (0.5 + 1e-6), -2.0 / (1.0 + 1e-6));
    #[rustfmt::skip]
    let want = [p, p, p,  -p, -p,  0.0, 0.0, 0.0, 0.0,  m, m];
    close(
        &b.ragged_f32(schema::ADVANTAGES).unwrap().values,
        &want,
        1e-6,
    );
    close(&b.ragged_f32(schema::RETURNS).unwrap().values, &want, 1e-6);
    #[rustfmt::skip]
    let rewards = [0.0, 0.0, 1.0,  0.0, 0.0,  0.0, 0.0, 0.5, 0.0,  0.0, -2.0];
    close(
        &b.ragged_f32(schema::TOKEN_REWARDS).unwrap().values,
        &rewards,
        0.0,
    );
    // Input columns and metadata are kept; the stage records its parameters.
    assert_eq!(
        b.strings(schema::PROMPT_UID).unwrap(),
        vec!["a", "a", "a", "b"]
    );
    assert_eq!(b.meta_u64("step"), Some(7));
    let params: serde_json::Value =
        serde_json::from_str(&b.meta["tandem.stage.advantage"]).unwrap();
    assert_eq!(params["estimator"], "grpo");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(j["rows"], 4);
    assert_eq!(j["valid_tokens"], 9);
    // valid advantages: 3p - 2p + 0 + 0 + 2m over 9 tokens
    let mean = (p + 2.0 * m) / 9.0;
    assert!((m_val(&j, "advantage_mean") - mean).abs() < 1e-6, "{j}");
    assert!((m_val(&j, "advantage_min") - m).abs() < 1e-6, "{j}");
    assert!((m_val(&j, "advantage_max") - p).abs() < 1e-6, "{j}");
    assert!(j["kl"].is_null());
    assert!(
        stderr(&o).contains("advantage grpo: 4 rows"),
        "{}",
        stderr(&o)
    );

    // Dr.GRPO
    let o = advantage(&[
        "--in",
        s(&inp),
        "--out",
        s(&out),
        "--estimator",
        "grpo",
        "--norm-by-std",
        "false",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let b = Batch::read(&out, &[]).unwrap();
    #[rustfmt::skip]
    let want = [0.5, 0.5, 0.5,  -0.5, -0.5,  0.0, 0.0, 0.0, 0.0,  -2.0, -2.0];
    close(
        &b.ragged_f32(schema::ADVANTAGES).unwrap().values,
        &want,
        0.0,
    );
}

fn m_val(m: &serde_json::Value, k: &str) -> f64 {
    m[k].as_f64().unwrap()
}

#[test]
fn adaptive_kl_in_reward_persists_beta() {
    let d = dir();
    let (inp, out, state) = (
        d.path.join("in.parquet"),
        d.path.join("out.parquet"),
        d.path.join("kl.json"),
    );
    // old − ref = 0.3 on every token: k1 = 0.3 everywhere, so every row's mean KL is 0.3.
    let n = 11;
    let old: Vec<f32> = (0..n).map(|i| -1.0 - 0.1 * i as f32).collect();
    let rf: Vec<f32> = old.iter().map(|o| o - 0.3).collect();
    Rows::example()
        .token_col(schema::OLD_LOGPROBS, old)
        .token_col(schema::REF_LOGPROBS, rf)
        .write(&inp);
    let run = || {
        advantage(&[
            "--in",
            s(&inp),
            "--out",
            s(&out),
            "--estimator",
            "grpo",
            "--norm-by-std",
            "false",
            "--kl-in-reward",
            "--kl-penalty",
            "kl",
            "--kl-coef",
            "0.1",
            "--kl-ctrl",
            "adaptive",
            "--kl-target",
            "0.2",
            "--kl-horizon",
            "40",
            "--kl-state",
            s(&state),
        ])
    };
    let o = run();
    assert!(o.status.success(), "{}", stderr(&o));
    // Step 1 uses beta 0.1: reward −0.03 per valid token, the score on the last one.
    let b = Batch::read(&out, &[]).unwrap();
    let k = -0.1 * 0.3;
    #[rustfmt::skip]
    let want = [k, k, 1.0 + k,  k, k,  k, 0.0, 0.5 + k, 0.0,  k, -2.0 + k];
    close(
        &b.ragged_f32(schema::TOKEN_REWARDS).unwrap().values,
        &want,
        1e-6,
    );
    // Outcomes 1 − 0.09, −0.06, 0.5 − 0.06 (group a, mean 0.43 − 0.09 + ... ) → Dr.GRPO:
    // a: s = [0.91, −0.06, 0.44], mean 0.43: [0.48, −0.49, 0.01]; b alone: −2.06
    #[rustfmt::skip]
    let adv = [0.48, 0.48, 0.48,  -0.49, -0.49,  0.01, 0.0, 0.01, 0.0,  -2.06, -2.06];
    close(
        &b.ragged_f32(schema::ADVANTAGES).unwrap().values,
        &adv,
        1e-6,
    );
    // kl = 0.3, target 0.2: err = clip(0.5, ±0.2) = 0.2, n = 4 rows, horizon 40:
    // beta = 0.1·(1 + 0.2·4/40) = 0.102
    let st: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert!((m_val(&st, "beta") - 0.102).abs() < 1e-12, "{st}");
    assert!((m_val(&st, "last_kl") - 0.3).abs() < 1e-6, "{st}");
    assert_eq!(st["updates"], 1);

    // Step 2 starts from the stored beta 0.102 and moves it to 0.102·1.02 = 0.10404.
    let o = run();
    assert!(o.status.success(), "{}", stderr(&o));
    let b = Batch::read(&out, &[]).unwrap();
    let r = b.ragged_f32(schema::TOKEN_REWARDS).unwrap();
    assert!(
        (r.values[0] as f64 - -0.102 * 0.3).abs() < 1e-7,
        "{:?}",
        r.values
    );
    let st: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert!((m_val(&st, "beta") - 0.102 * 1.02).abs() < 1e-12, "{st}");
    assert!((m_val(&st, "last_beta") - 0.102).abs() < 1e-12, "{st}");
    assert_eq!(st["updates"], 2);
}

#[test]
fn gae_and_remax_read_their_columns() {
    let d = dir();
    let (inp, out) = (d.path.join("in.parquet"), d.path.join("out.parquet"));
    // The rows of the gae unit test: mask [1,0,1] and [1,1], scores 1 and -1.
    let rows = Rows {
        uids: vec!["a", "b"],
        masks: vec![vec![1, 0, 1], vec![1, 1]],
        scores: vec![1.0, -1.0],
        extra: vec![],
    }
    .token_col(schema::VALUES, vec![0.5, 9.0, 0.25, 0.1, -0.2]);
    rows.write(&inp);
    let o = advantage(&[
        "--in",
        s(&inp),
        "--out",
        s(&out),
        "--estimator",
        "gae",
        "--gamma",
        "0.9",
        "--lam",
        "0.8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let b = Batch::read(&out, &[]).unwrap();
    // Hand values of the gae unit test: returns A + V = [0.765, -, 1.0], [-0.756, -1.0]
    close(
        &b.ragged_f32(schema::RETURNS).unwrap().values,
        &[0.765, 0.0, 1.0, -0.756, -1.0],
        1e-6,
    );
    let a = b.ragged_f32(schema::ADVANTAGES).unwrap();
    assert_eq!(a.values[1], 0.0);
    // whitened over the 4 valid tokens: mean 0
    let sum: f32 = a.values.iter().sum();
    assert!(sum.abs() < 1e-5, "{:?}", a.values);

    let baseline: ArrayRef = Arc::new(Float32Array::from(vec![0.25, 0.0]));
    let mut rows = rows;
    rows.extra.push((schema::BASELINE_SCORE, baseline));
    rows.write(&inp);
    let o = advantage(&["--in", s(&inp), "--out", s(&out), "--estimator", "remax"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let b = Batch::read(&out, &[]).unwrap();
    close(
        &b.ragged_f32(schema::ADVANTAGES).unwrap().values,
        &[0.75, 0.0, 0.75, -1.0, -1.0],
        0.0,
    );
}

/// Run with bad input: exit code 2, the message contains `want`, and no output is left.
fn rejects(d: &Dir, args: &[&str], want: &str) {
    let out = d.path.join("out.parquet");
    let metrics = d.path.join("m.json");
    let mut all = vec!["--out", s(&out), "--metrics", s(&metrics)];
    all.extend_from_slice(args);
    let o = advantage(&all);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    assert!(!out.exists(), "{args:?} left an output");
    assert!(!d.path.join("out.parquet.tmp").exists());
    assert!(!metrics.exists());
}

#[test]
fn bad_input_is_rejected_without_output() {
    let d = dir();
    let good = d.path.join("good.parquet");
    Rows::example().write(&good);
    let g = s(&good);

    rejects(
        &d,
        &[
            "--in",
            s(&d.path.join("nope.parquet")),
            "--estimator",
            "grpo",
        ],
        "cannot open batch file",
    );
    // Columns an option needs, named with the option.
    let p = d.path.join("no_score.parquet");
    Rows::example().write_without(&p, schema::SCORE);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "grpo"],
        "column 'score' is missing: every estimator needs the sequence score; run `score` first",
    );
    let p = d.path.join("no_uid.parquet");
    Rows::example().write_without(&p, schema::PROMPT_UID);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "rloo"],
        "column 'prompt_uid' is missing: --estimator rloo needs it",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "gae"],
        "column 'values' is missing: --estimator gae needs it",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "remax"],
        "column 'baseline_score' is missing: --estimator remax needs it",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "grpo", "--kl-in-reward"],
        "column 'old_logprobs' is missing: --kl-in-reward needs it",
    );
    let p = d.path.join("old_only.parquet");
    Rows::example()
        .token_col(schema::OLD_LOGPROBS, vec![-1.0; 11])
        .write(&p);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "grpo", "--kl-in-reward"],
        "column 'ref_logprobs' is missing: --kl-in-reward needs it",
    );
    // Bad values, named by file, column and row.
    let p = d.path.join("nan.parquet");
    let mut rows = Rows::example();
    rows.scores[2] = f32::NAN;
    rows.write(&p);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "grpo"],
        "column 'score', row 2: value NaN is not finite",
    );
    let p = d.path.join("mask.parquet");
    let mut rows = Rows::example();
    rows.masks[1][0] = 2;
    rows.write(&p);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "grpo"],
        "column 'response_mask', row 1: mask value 2 is not 0 or 1",
    );
    let p = d.path.join("short_values.parquet");
    let mut rows = Rows::example();
    let short = list_array::<Float32Type>(&[0, 3, 5, 9, 10], vec![0.0; 10]);
    rows.extra.push((schema::VALUES, short));
    rows.write(&p);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "gae"],
        "column 'values', row 3: has 1 entries but response_ids has 2",
    );
    // Without response_ids the stage checks per-token columns against the mask itself.
    let p = d.path.join("short_old_no_ids.parquet");
    let short = list_array::<Float32Type>(&[0, 3, 5, 9, 10], vec![0.0; 10]);
    let mut rows = Rows::example().token_col(schema::REF_LOGPROBS, vec![-1.0; 11]);
    rows.extra.push((schema::OLD_LOGPROBS, short));
    rows.write_without(&p, schema::RESPONSE_IDS);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "grpo", "--kl-in-reward"],
        "column 'old_logprobs', row 3: has 1 entries but response_mask has 2",
    );
    // A batch whose valid tokens cannot be whitened.
    let p = d.path.join("one_token.parquet");
    Rows {
        uids: vec!["a"],
        masks: vec![vec![0, 1]],
        scores: vec![1.0],
        extra: vec![],
    }
    .write(&p);
    rejects(
        &d,
        &["--in", s(&p), "--estimator", "reinforce_plus_plus"],
        "needs at least 2, found 1",
    );
    // Bad flags.
    rejects(
        &d,
        &["--in", g, "--estimator", "grpo", "--gamma", "1.5"],
        "invalid value '1.5' for '--gamma <GAMMA>': must be a finite number in [0, 1]",
    );
    // A negative number reaches the flag's range check (not "unexpected argument '-1'").
    rejects(
        &d,
        &[
            "--in",
            g,
            "--estimator",
            "grpo",
            "--kl-in-reward",
            "--kl-coef",
            "-1",
        ],
        "invalid value '-1' for '--kl-coef <KL_COEF>': must be a finite number >= 0",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "grpo", "--epsilon", "-1e-6"],
        "invalid value '-1e-6' for '--epsilon <EPSILON>': must be a finite number >= 0",
    );
    // An empty batch is refused like in every stage.
    let empty = d.path.join("empty.parquet");
    Rows {
        uids: vec![],
        masks: vec![],
        scores: vec![],
        extra: vec![],
    }
    .write(&empty);
    rejects(
        &d,
        &["--in", s(&empty), "--estimator", "grpo"],
        "empty.parquet: the batch has no rows",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "ppo"],
        "invalid value 'ppo' for '--estimator",
    );
    rejects(
        &d,
        &["--in", g, "--estimator", "grpo", "--kl-coef", "0.1"],
        "--kl-in-reward",
    );
    rejects(
        &d,
        &[
            "--in",
            g,
            "--estimator",
            "grpo",
            "--kl-in-reward",
            "--kl-penalty",
            "k9",
        ],
        "unknown KL penalty 'k9'",
    );
    rejects(
        &d,
        &[
            "--in",
            g,
            "--estimator",
            "grpo",
            "--kl-in-reward",
            "--kl-ctrl",
            "adaptive",
        ],
        "--kl-ctrl adaptive needs --kl-state FILE",
    );
    let state = d.path.join("kl.json");
    std::fs::write(&state, "{\"beta\": \"high\"}").unwrap();
    rejects(
        &d,
        &[
            "--in",
            g,
            "--estimator",
            "grpo",
            "--kl-in-reward",
            "--kl-ctrl",
            "adaptive",
            "--kl-state",
            s(&state),
        ],
        "kl.json: not a KL state file",
    );
    // A failed step leaves the state as it was.
    assert_eq!(
        std::fs::read_to_string(&state).unwrap(),
        "{\"beta\": \"high\"}"
    );
}

/// The size of `tandem bench cpu-stages`: 32,768 rows x 1,024 response tokens, groups of 8.
/// A benchmark, not a timed test:
/// `cargo test --test integration advantage:: -- --ignored --nocapture` prints
/// the stage's own read/compute/write split.
#[test]
#[ignore]
fn bench_grpo_32768_rows_1024_tokens() {
    let d = dir();
    let (inp, out, metrics) = (
        d.path.join("in.parquet"),
        d.path.join("out.parquet"),
        d.path.join("m.json"),
    );
    let (rows, len) = (32_768usize, 1_024usize);
    let offsets: Vec<usize> = (0..=rows).map(|i| i * len).collect();
    let n = rows * len;
    let uids: Vec<String> = (0..rows).map(|i| format!("p{}", i / 8)).collect();
    let ids: Vec<i32> = (0..n).map(|i| ((i * 7919) % 151_936) as i32).collect();
    // Responses end at varying lengths: the tail of each row is masked.
    let mask: Vec<u8> = (0..n)
        .map(|i| ((i % len) < len - (i / len) % 300) as u8)
        .collect();
    let lps: Vec<f32> = (0..n).map(|i| -((i % 97) as f32) / 20.0).collect();
    let scores: Vec<f32> = (0..rows)
        .map(|i| ((i * 31) % 7 == 0) as u8 as f32)
        .collect();
    let cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::PROMPT_UID),
            Arc::new(StringArray::from(uids)),
        ),
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(&offsets, ids),
        ),
        (
            schema::field(schema::RESPONSE_MASK),
            list_array::<UInt8Type>(&offsets, mask),
        ),
        (
            schema::field(schema::ROLLOUT_LOGPROBS),
            list_array::<Float32Type>(&offsets, lps),
        ),
        (
            schema::field(schema::SCORE),
            Arc::new(Float32Array::from(scores)),
        ),
    ];
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    write_file(&inp, &data, &BTreeMap::new()).unwrap();
    if let Ok(keep) = std::env::var("TANDEM_BENCH_KEEP") {
        std::fs::copy(&inp, keep).unwrap();
    }
    let t = std::time::Instant::now();
    let o = advantage(&[
        "--in",
        s(&inp),
        "--out",
        s(&out),
        "--estimator",
        "grpo",
        "--metrics",
        s(&metrics),
    ]);
    let wall = t.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(j["rows"], rows);
    eprintln!(
        "advantage grpo {rows} x {len}: {wall:.2}s wall (read {:.2}s, compute {:.2}s, write {:.2}s)",
        m_val(&j, "read_s"),
        m_val(&j, "compute_s"),
        m_val(&j, "write_s")
    );
}
