//! Per-step metrics (`metrics.jsonl`) and evaluation summaries (`eval.jsonl`).
//!
//! One flat JSON object per line. The runner computes the keys it can read off the batch files
//! itself, so they mean the same whatever the stages print:
//! Every count is over the samples: rows marked `is_baseline` (ReMax's greedy baselines) are
//! left out.
//! - `reward/mean`, `reward/std` (population), `accuracy` (rows with score >= 1, or the mean
//!   of a `score_acc` sub-score, as `score` counts it), `accuracy/<data_source>`;
//! - `response_length/mean|max|min` (response tokens), `prompt_length/mean`,
//!   `response_clip_ratio` (finish_reason "length");
//! - `kl`: mean over model tokens of rollout_logprobs − ref_logprobs (the k1 estimate of
//!   KL(policy ‖ ref)), when reference log-probs were computed;
//! - `entropy`, `grad_norm`, `pg_clipfrac`: copied from the update's metrics when it reports them;
//! - `mismatch/…`: the rollout-vs-trainer log-prob mismatch `update` measured (moved from
//!   `update/mismatch/…`);
//! - `time/<stage>` and `time/step` (seconds), `perf/tokens_per_s` (prompt + response tokens
//!   of the batch over the step's seconds), `perf/rollout_tokens_per_s`. In one-step-off mode
//!   `time/overlap` is the wall time of the update and the next step's rollout together,
//!   `time/update` the update's alone, and `time/rollout` the rollout of the step's own rows
//!   (it ran in the step before): neither is added into `time/step` again.
//!
//! Each stage's `--metrics` JSON is merged in under `<stage>/<key>` (nested objects flattened
//! with `/`).
//!
//! [`put_line`] writes a line: into its JSON-lines file and, as scalars, into the run's
//! TensorBoard event files ([`super::tensorboard`]).

use super::rundir::put_jsonl_step;
use super::tensorboard;
use crate::batch::schema;
use crate::batch::Batch;
use anyhow::Result;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Flatten a JSON value into `prefix/key` entries (numbers, strings, booleans kept as they are).
pub fn flatten(prefix: &str, v: &Value, out: &mut Map<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}/{k}")
                };
                flatten(&key, x, out);
            }
        }
        Value::Array(_) | Value::Null => {}
        x => {
            out.insert(prefix.to_string(), x.clone());
        }
    }
}

/// A stage's `--metrics` file flattened under its name, or nothing when the stage wrote none.
pub(crate) fn stage_file(stage: &str, path: &Path, out: &mut Map<String, Value>) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{}: stage metrics are not JSON: {e}", path.display()))?;
    let mut flat = Map::new();
    flatten("", &v, &mut flat);
    // Keys a stage already files under its own name (`score/mean`, `score_acc/mean`) stay as
    // they are; others (`advantage_max` of the advantage stage) get the prefix.
    for (k, x) in flat {
        let own = k
            .strip_prefix(stage)
            .is_some_and(|r| r.starts_with('/') || (r.starts_with('_') && r.contains('/')));
        let key = if own { k } else { format!("{stage}/{k}") };
        out.insert(key, x);
    }
    Ok(())
}

fn mean(xs: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for x in xs {
        sum += x;
        n += 1;
    }
    (n > 0).then(|| sum / n as f64)
}

fn num(v: f64) -> Value {
    serde_json::Number::from_f64(v)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

/// Score summary of a scored batch: mean, std, accuracy overall and per data_source.
pub(crate) struct ScoreSummary {
    pub(crate) mean: f64,
    pub(crate) std: f64,
    pub(crate) accuracy: f64,
    pub(crate) by_source: BTreeMap<String, f64>,
    pub(crate) rows: usize,
}

/// Whether each row counts as correct: `score_acc` when the reward gives one, else score >= 1.
pub fn correct(batch: &Batch, scores: &[f32]) -> Result<Vec<f64>> {
    let acc_col = format!("{}acc", schema::SCORE_PREFIX);
    Ok(if batch.has(&acc_col) {
        batch.f32s(&acc_col)?.iter().map(|&a| a as f64).collect()
    } else {
        scores
            .iter()
            .map(|&s| if s >= 1.0 { 1.0 } else { 0.0 })
            .collect()
    })
}

pub(crate) fn score_summary(batch: &Batch) -> Result<ScoreSummary> {
    let scores = batch.f32s(schema::SCORE)?;
    let ok = correct(batch, &scores)?;
    let m = mean(scores.iter().map(|&s| s as f64)).unwrap_or(0.0);
    let var = mean(scores.iter().map(|&s| (s as f64 - m).powi(2))).unwrap_or(0.0);
    let mut groups: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    if batch.has(schema::DATA_SOURCE) {
        for (src, a) in batch.strings(schema::DATA_SOURCE)?.iter().zip(&ok) {
            let g = groups.entry(src.to_string()).or_default();
            g.0 += a;
            g.1 += 1;
        }
    }
    Ok(ScoreSummary {
        mean: m,
        std: var.sqrt(),
        accuracy: mean(ok.iter().copied()).unwrap_or(0.0),
        by_source: groups
            .into_iter()
            .map(|(k, (s, n))| (k, s / n as f64))
            .collect(),
        rows: scores.len(),
    })
}

/// Response and prompt lengths of a rollout batch, in tokens.
pub struct Lengths {
    pub response_mean: f64,
    pub response_max: usize,
    pub response_min: usize,
    pub prompt_mean: f64,
    pub response_tokens: usize,
    pub total_tokens: usize,
    pub clip_ratio: Option<f64>,
}

pub fn lengths(batch: &Batch) -> Result<Lengths> {
    let resp = batch.ragged_i32(schema::RESPONSE_IDS)?;
    let lens: Vec<usize> = resp.rows().map(|r| r.len()).collect();
    let prompt_lens: Vec<usize> = if batch.has(schema::PROMPT_IDS) {
        batch
            .ragged_i32(schema::PROMPT_IDS)?
            .rows()
            .map(|r| r.len())
            .collect()
    } else {
        Vec::new()
    };
    let clip_ratio = if batch.has(schema::FINISH_REASON) {
        mean(
            batch
                .strings(schema::FINISH_REASON)?
                .iter()
                .map(|r| f64::from(u8::from(*r == "length"))),
        )
    } else {
        None
    };
    let response_tokens: usize = lens.iter().sum();
    Ok(Lengths {
        response_mean: mean(lens.iter().map(|&l| l as f64)).unwrap_or(0.0),
        response_max: lens.iter().copied().max().unwrap_or(0),
        response_min: lens.iter().copied().min().unwrap_or(0),
        prompt_mean: mean(prompt_lens.iter().map(|&l| l as f64)).unwrap_or(0.0),
        response_tokens,
        total_tokens: response_tokens + prompt_lens.iter().sum::<usize>(),
        clip_ratio,
    })
}

/// Mean over model tokens (response_mask 1, or all tokens without a mask) of
/// `a − b` for two log-prob columns: with a = policy, b = reference, the k1 KL estimate.
pub(crate) fn masked_mean_diff(batch: &Batch, a: &str, b: &str) -> Result<Option<f64>> {
    if !batch.has(a) || !batch.has(b) {
        return Ok(None);
    }
    let (x, y) = (batch.ragged_f32(a)?, batch.ragged_f32(b)?);
    let mask = if batch.has(schema::RESPONSE_MASK) {
        Some(batch.ragged_u8(schema::RESPONSE_MASK)?)
    } else {
        None
    };
    let (mut sum, mut n) = (0.0f64, 0usize);
    for i in 0..x.values.len() {
        if mask.as_ref().is_none_or(|m| m.values[i] != 0) {
            sum += (x.values[i] - y.values[i]) as f64;
            n += 1;
        }
    }
    Ok((n > 0).then(|| sum / n as f64))
}

/// Mean of a per-token column over model tokens.
pub(crate) fn masked_mean(batch: &Batch, col: &str) -> Result<Option<f64>> {
    if !batch.has(col) {
        return Ok(None);
    }
    let x = batch.ragged_f32(col)?;
    let mask = if batch.has(schema::RESPONSE_MASK) {
        Some(batch.ragged_u8(schema::RESPONSE_MASK)?)
    } else {
        None
    };
    Ok(mean(
        x.values
            .iter()
            .enumerate()
            .filter(|(i, _)| mask.as_ref().is_none_or(|m| m.values[*i] != 0))
            .map(|(_, &v)| v as f64),
    ))
}

/// Everything the runner knows about one finished step.
pub(crate) struct StepFiles<'a> {
    pub(crate) step: u64,
    pub(crate) scored: &'a Path,
    /// The batch holding ref_logprobs, when computed.
    pub(crate) with_ref: Option<&'a Path>,
    /// Each stage's `--metrics` file.
    pub(crate) stage_metrics: Vec<(&'static str, std::path::PathBuf)>,
    pub(crate) seconds: &'a BTreeMap<String, f64>,
    /// Seconds of work inside the step's wall time, or done for it in the step before
    /// (`StepProgress::inside`): reported, not added into `time/step`.
    pub(crate) inside: &'a BTreeMap<String, f64>,
}

/// The flat metrics line of a step.
pub(crate) fn step_line(f: &StepFiles) -> Result<Map<String, Value>> {
    let mut m = Map::new();
    m.insert("step".into(), Value::from(f.step));

    // Counts over samples: ReMax's greedy baseline rows are not samples.
    let scored = Batch::read(f.scored, &[schema::SCORE, schema::RESPONSE_IDS])?.samples_only()?;
    let s = score_summary(&scored)?;
    m.insert("reward/mean".into(), num(s.mean));
    m.insert("reward/std".into(), num(s.std));
    m.insert("accuracy".into(), num(s.accuracy));
    for (src, a) in &s.by_source {
        m.insert(format!("accuracy/{src}"), num(*a));
    }
    let l = lengths(&scored)?;
    m.insert("response_length/mean".into(), num(l.response_mean));
    m.insert("response_length/max".into(), Value::from(l.response_max));
    m.insert("response_length/min".into(), Value::from(l.response_min));
    m.insert("prompt_length/mean".into(), num(l.prompt_mean));
    if let Some(c) = l.clip_ratio {
        m.insert("response_clip_ratio".into(), num(c));
    }
    if let Some(path) = f.with_ref {
        let b = Batch::read(path, &[])?.samples_only()?;
        if let Some(kl) = masked_mean_diff(&b, schema::ROLLOUT_LOGPROBS, schema::REF_LOGPROBS)? {
            m.insert("kl".into(), num(kl));
        }
        if let Some(e) = masked_mean(&b, "entropy")? {
            m.insert("entropy".into(), num(e));
        }
    }

    let mut stages = Map::new();
    for (name, path) in &f.stage_metrics {
        stage_file(name, path, &mut stages)?;
    }
    for (short, key) in [
        ("entropy", "update/entropy"),
        ("grad_norm", "update/grad_norm"),
        ("pg_clipfrac", "update/pg_clipfrac"),
    ] {
        if let Some(v) = stages.get(key) {
            m.insert(short.into(), v.clone());
        }
    }
    // The rollout-vs-trainer mismatch `update` measures is a step metric of its own.
    let mismatch: Vec<String> = stages
        .keys()
        .filter(|k| k.starts_with("update/mismatch/"))
        .cloned()
        .collect();
    for k in mismatch {
        if let Some(v) = stages.remove(&k) {
            m.insert(k["update/".len()..].to_string(), v);
        }
    }
    m.extend(stages);

    let mut total = 0.0;
    for (stage, secs) in f.seconds {
        m.insert(format!("time/{stage}"), num(*secs));
        total += secs;
    }
    m.insert("time/step".into(), num(total));
    for (name, secs) in f.inside {
        let t = m.entry(format!("time/{name}")).or_insert(num(0.0));
        *t = num(t.as_f64().unwrap_or(0.0) + secs);
    }
    if total > 0.0 {
        m.insert(
            "perf/tokens_per_s".into(),
            num(l.total_tokens as f64 / total),
        );
    }
    if let Some(r) = m
        .get("time/rollout")
        .and_then(Value::as_f64)
        .filter(|&r| r > 0.0)
    {
        m.insert(
            "perf/rollout_tokens_per_s".into(),
            num(l.response_tokens as f64 / r),
        );
    }
    Ok(m)
}

/// The eval.jsonl line of one evaluation.
pub(crate) fn eval_line(step: u64, scored: &Path) -> Result<Map<String, Value>> {
    let b = Batch::read(scored, &[schema::SCORE, schema::RESPONSE_IDS])?.samples_only()?;
    let s = score_summary(&b)?;
    let l = lengths(&b)?;
    let mut m = Map::new();
    m.insert("step".into(), Value::from(step));
    m.insert("accuracy".into(), num(s.accuracy));
    m.insert("score/mean".into(), num(s.mean));
    m.insert("response_length/mean".into(), num(l.response_mean));
    m.insert("rows".into(), Value::from(s.rows));
    for (src, a) in &s.by_source {
        m.insert(format!("accuracy/{src}"), num(*a));
    }
    Ok(m)
}

/// Record a finished step's (or evaluation's) line: in its JSON-lines file, replacing the line
/// of a step that runs again, and its numbers in the run directory's TensorBoard events, tagged
/// by key (eval.jsonl's under `eval/`, other files' under their name).
pub fn put_line(path: &Path, step: u64, line: &Value) -> Result<()> {
    put_jsonl_step(path, step, line)?;
    let Value::Object(m) = line else {
        return Ok(());
    };
    let prefix = match path.file_stem().and_then(|s| s.to_str()) {
        Some("metrics") | None => String::new(),
        Some(name) => format!("{name}/"),
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    tensorboard::append_line(dir, step, m, &prefix)
}

/// One console line for a finished step.
pub(crate) fn summary_text(m: &Map<String, Value>, steps: u64) -> String {
    let f = |k: &str| m.get(k).and_then(Value::as_f64);
    let mut s = format!(
        "step {}/{steps}",
        m.get("step").and_then(Value::as_u64).unwrap_or(0)
    );
    if let (Some(r), Some(sd)) = (f("reward/mean"), f("reward/std")) {
        s += &format!("  reward {r:.3}±{sd:.3}");
    }
    if let Some(a) = f("accuracy") {
        s += &format!("  acc {a:.3}");
    }
    if let Some(l) = f("response_length/mean") {
        s += &format!("  len {l:.1}");
    }
    if let Some(k) = f("kl") {
        s += &format!("  kl {k:.4}");
    }
    if let Some(g) = f("grad_norm") {
        s += &format!("  gnorm {g:.3}");
    }
    if let Some(t) = f("time/step") {
        s += &format!("  {t:.1}s");
    }
    if let Some(t) = f("perf/tokens_per_s") {
        s += &format!(" ({t:.0} tok/s)");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{list_array, write_file};
    use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
    use arrow_array::{ArrayRef, Float32Array, RecordBatch, StringArray};
    use arrow_schema::{Field, Schema};
    use serde_json::json;
    use std::sync::Arc;

    /// Three rows: two "a", one "b"; responses of 2, 3 and 1 tokens.
    fn scored_file(dir: &Path, with_acc: bool) -> std::path::PathBuf {
        let mut fields = vec![
            Field::new(schema::DATA_SOURCE, arrow_schema::DataType::Utf8, false),
            schema::field(schema::PROMPT_IDS),
            schema::field(schema::RESPONSE_IDS),
            schema::field(schema::RESPONSE_MASK),
            schema::field(schema::FINISH_REASON),
            schema::field(schema::ROLLOUT_LOGPROBS),
            schema::field(schema::REF_LOGPROBS),
            schema::field(schema::SCORE),
        ];
        let offs = [0, 2, 5, 6];
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec!["a", "a", "b"])),
            list_array::<Int32Type>(&[0, 1, 2, 6], vec![1, 2, 3, 4, 5, 6]),
            list_array::<Int32Type>(&offs, vec![7; 6]),
            list_array::<UInt8Type>(&offs, vec![1, 1, 1, 0, 1, 1]),
            Arc::new(StringArray::from(vec!["stop", "length", "stop"])),
            list_array::<Float32Type>(&offs, vec![-1.0, -2.0, -1.0, -9.0, -1.0, -0.5]),
            list_array::<Float32Type>(&offs, vec![-1.5, -2.0, -1.0, 0.0, -2.0, -0.5]),
            Arc::new(Float32Array::from(vec![1.0, 0.0, 0.5])),
        ];
        if with_acc {
            fields.push(schema::field("score_acc"));
            cols.push(Arc::new(Float32Array::from(vec![1.0, 0.0, 1.0])));
        }
        let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
        let path = dir.join(if with_acc { "acc.parquet" } else { "s.parquet" });
        write_file(&path, &data, &Default::default()).unwrap();
        path
    }

    /// One-step-off's timings: the overlap counts in `time/step`, the update inside it and
    /// the rollout done in the step before are reported but not counted again; the rollout's
    /// tokens per second are over its own seconds.
    #[test]
    fn work_inside_the_step_is_reported_not_counted() {
        let dir = tempfile::tempdir().unwrap();
        let scored = scored_file(dir.path(), false);
        let seconds: BTreeMap<String, f64> =
            [("score".into(), 1.0), ("overlap".into(), 4.0)].into();
        let inside: BTreeMap<String, f64> =
            [("update".into(), 3.0), ("rollout".into(), 1.5)].into();
        let m = step_line(&StepFiles {
            step: 2,
            scored: &scored,
            with_ref: None,
            stage_metrics: vec![],
            seconds: &seconds,
            inside: &inside,
        })
        .unwrap();
        let f = |k: &str| m[k].as_f64().unwrap();
        assert_eq!(
            (
                f("time/step"),
                f("time/overlap"),
                f("time/update"),
                f("time/rollout")
            ),
            (5.0, 4.0, 3.0, 1.5)
        );
        // 6 response tokens over 1.5 s
        assert!((f("perf/rollout_tokens_per_s") - 4.0).abs() < 1e-12);
    }

    #[test]
    fn step_line_hand_computed() {
        let dir = tempfile::tempdir().unwrap();
        let scored = scored_file(dir.path(), false);
        std::fs::write(
            dir.path().join("u.json"),
            r#"{"grad_norm": 0.5, "pg_clipfrac": 0.1, "inner": {"x": 2}}"#,
        )
        .unwrap();
        let seconds: BTreeMap<String, f64> =
            [("rollout".into(), 2.0), ("update".into(), 3.0)].into();
        let m = step_line(&StepFiles {
            step: 4,
            scored: &scored,
            with_ref: Some(&scored),
            stage_metrics: vec![
                ("update", dir.path().join("u.json")),
                ("score", dir.path().join("missing.json")),
            ],
            seconds: &seconds,
            inside: &Default::default(),
        })
        .unwrap();
        let f = |k: &str| m[k].as_f64().unwrap();
        assert_eq!(m["step"], 4);
        assert!((f("reward/mean") - 0.5).abs() < 1e-12);
        // population std of (1, 0, 0.5): sqrt(1/6)
        assert!((f("reward/std") - (1.0f64 / 6.0).sqrt()).abs() < 1e-7);
        assert!((f("accuracy") - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(f("accuracy/a"), 0.5);
        assert_eq!(f("accuracy/b"), 0.0);
        assert_eq!(f("response_length/mean"), 2.0);
        assert_eq!(m["response_length/max"], 3);
        assert_eq!(m["response_length/min"], 1);
        assert_eq!(f("prompt_length/mean"), 2.0);
        assert!((f("response_clip_ratio") - 1.0 / 3.0).abs() < 1e-12);
        // masked token diffs: 0.5, 0, 0, (masked), 1.0, 0 -> 1.5 / 5
        assert!((f("kl") - 0.3).abs() < 1e-7);
        assert_eq!(f("grad_norm"), 0.5);
        assert_eq!(f("update/inner/x"), 2.0);
        assert_eq!(f("time/step"), 5.0);
        // 6 prompt + 6 response tokens over 5 s; 6 response tokens over 2 s of rollout
        assert!((f("perf/tokens_per_s") - 12.0 / 5.0).abs() < 1e-12);
        assert!((f("perf/rollout_tokens_per_s") - 3.0).abs() < 1e-12);
        let text = summary_text(&m, 10);
        assert!(
            text.starts_with("step 4/10  reward 0.500±0.408  acc 0.333  len 2.0  kl 0.3000"),
            "{text}"
        );
    }

    #[test]
    fn accuracy_uses_score_acc_when_present() {
        let dir = tempfile::tempdir().unwrap();
        let scored = scored_file(dir.path(), true);
        let m = eval_line(7, &scored).unwrap();
        assert_eq!(m["step"], 7);
        assert!((m["accuracy"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(m["accuracy/b"].as_f64().unwrap(), 1.0);
        assert_eq!(m["rows"], 3);
    }

    #[test]
    fn bad_stage_metrics_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.json");
        std::fs::write(&p, "not json").unwrap();
        let mut out = Map::new();
        let err = stage_file("score", &p, &mut out).unwrap_err();
        assert!(format!("{err}").contains("stage metrics are not JSON"));
        let mut out = Map::new();
        flatten("a", &json!({"b": {"c": 1}, "d": [1], "e": "x"}), &mut out);
        assert_eq!(Value::Object(out), json!({"a/b/c": 1, "a/e": "x"}));
        std::fs::write(
            &p,
            r#"{"score/mean": 1, "score_acc/mean": 2, "score_max": 5, "rows": 3, "t": {"s": 4}}"#,
        )
        .unwrap();
        let mut out = Map::new();
        stage_file("score", &p, &mut out).unwrap();
        assert_eq!(
            Value::Object(out),
            json!({"score/mean": 1, "score_acc/mean": 2, "score/score_max": 5, "score/rows": 3, "score/t/s": 4})
        );
    }
}
