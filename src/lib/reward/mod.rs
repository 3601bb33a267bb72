//! Rewards: the `score` stage's rules and its entry points.
//!
//! `--reward SPEC` is one of:
//! - `gsm8k`: verl's GSM8K rule ([`gsm8k`]), `--gsm8k-method strict|flexible`.
//! - `math`: the last `\boxed{}` compared after verl's normalisation ([`math`]).
//! - `exact`, `regex:PATTERN` ([`rules`]).
//! - `cmd:PROGRAM [ARGS]`, `python:FILE.py[:FUNC]` ([`external`]).
//! - `agent`: the rewards an agent posted to `tandem serve` (the `score` column of the
//!   collected trajectories, `[rollout] agent`), kept as they are; a row without one is an
//!   error.
//!
//! Scores: 1.0 for a correct answer; `--format-score` (default 0.0) when an answer was found
//! but is wrong (gsm8k, math, regex); 0.0 when none was found.
//!
//! Columns read: `response_text` always. The ground truth (`ground_truth`, or verl's
//! `reward_model.ground_truth`; non-string values are compared as their JSON text) is
//! required by the built-in rules, where a null one is an error; external programs get it as
//! the JSON value it is, or null when the batch has none. `data_source` is required by the
//! external modes (verl passes it to every reward function, and dispatches on it); for the
//! built-in rules it is optional and, when present, gives the per-source accuracy.
//! `extra_info` is passed to external programs as a JSON object (`{}` when absent, as verl);
//! the Python driver also sets `num_turns: None` and `rollout_reward_scores: {}` in it when
//! missing, as verl's NaiveRewardManager does for single-turn rollouts.
//!
//! Columns written: `score` (float32) and `score_<key>` for each other key of the dicts an
//! external reward returns: float32 for numbers (sub-scores), utf8 for strings and other
//! values (verl keeps them all in `reward_extra_info`; a string is never dropped). Accuracy in
//! the summary is the fraction of rows with score >= 1.0, or the mean of the `acc` sub-score
//! when the reward returns one (verl's math_dapo does). Scoring a batch that already has a
//! `score` column replaces it; `score_<key>` columns of an earlier run that this reward does
//! not return are kept as they are.
//!
//! Overlong shaping ([`overlong`], DAPO's soft overlong punishment, `--overlong-buffer-len`)
//! adds a length penalty to `score` after the rule, written as `score_overlong`, with the
//! unshaped correctness as `score_acc`.

pub(crate) mod external;
pub(crate) mod gsm8k;
pub(crate) mod math;
pub(crate) mod overlong;
pub(crate) mod rules;
pub(crate) mod summary;

use crate::bail_input;
use crate::batch::schema::{self, Kind};
use crate::batch::{Batch, NewColumns, StageInfo};
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, Float32Array, StringArray};
use arrow_schema::{DataType, Field};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use gsm8k::Method as Gsm8kMethod;
pub(crate) use summary::Summary;
pub(crate) use summary::Timings;

/// A parsed `--reward SPEC`.
#[derive(Clone, Debug)]
pub(crate) enum RewardSpec {
    Gsm8k,
    Math,
    Exact,
    Regex(rules::RegexRule),
    /// `cmd:PROGRAM [ARGS]` as an argv, and the text it came from.
    Cmd {
        argv: Vec<String>,
        line: String,
    },
    /// `python:FILE.py[:FUNC]`.
    Python {
        file: PathBuf,
        func: String,
    },
    /// `agent`: the `score` column the agent posted, kept.
    Agent,
}

fn is_identifier(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(f) if f == '_' || f.is_alphabetic())
        && c.all(|ch| ch == '_' || ch.is_alphanumeric())
}

impl RewardSpec {
    /// Parse a `--reward` value. Errors are input errors that list the accepted forms.
    pub(crate) fn parse(spec: &str) -> Result<RewardSpec> {
        const FORMS: &str =
            "expected gsm8k, math, exact, regex:PATTERN, cmd:PROGRAM [ARGS], python:FILE.py[:FUNC] or agent";
        Ok(match spec {
            "gsm8k" => RewardSpec::Gsm8k,
            "math" => RewardSpec::Math,
            "exact" => RewardSpec::Exact,
            "agent" => RewardSpec::Agent,
            _ => {
                if let Some(p) = spec.strip_prefix("regex:") {
                    match rules::RegexRule::new(p) {
                        Ok(r) => RewardSpec::Regex(r),
                        Err(e) => bail_input!("--reward regex: invalid pattern: {e}"),
                    }
                } else if let Some(c) = spec.strip_prefix("cmd:") {
                    match external::split_args(c) {
                        Ok(argv) if !argv.is_empty() => RewardSpec::Cmd {
                            argv,
                            line: c.trim().to_string(),
                        },
                        Ok(_) => bail_input!("--reward cmd: needs a program, e.g. cmd:./reward.sh"),
                        Err(e) => bail_input!("--reward cmd:{c}: {e}"),
                    }
                } else if let Some(p) = spec.strip_prefix("python:") {
                    let (file, func) = match p.rsplit_once(':') {
                        Some((f, func)) if is_identifier(func) => (f, func),
                        _ => (p, "compute_score"),
                    };
                    if file.is_empty() {
                        bail_input!("--reward python: needs a file, e.g. python:my_reward.py");
                    }
                    let file = PathBuf::from(file);
                    if !file.is_file() {
                        bail_input!(
                            "--reward python:{}: no such file (the path is relative to the current directory)",
                            file.display()
                        );
                    }
                    RewardSpec::Python {
                        file,
                        func: func.to_string(),
                    }
                } else {
                    bail_input!("--reward '{spec}': unknown reward; {FORMS}")
                }
            }
        })
    }

    /// The spec as shown in messages and the summary.
    pub(crate) fn label(&self, o: &Options) -> String {
        match self {
            RewardSpec::Gsm8k => format!("gsm8k ({:?})", o.gsm8k_method).to_lowercase(),
            RewardSpec::Math => "math".into(),
            RewardSpec::Exact => "exact".into(),
            RewardSpec::Regex(r) => format!("regex:{}", r.as_str()),
            RewardSpec::Cmd { line, .. } => format!("cmd:{line}"),
            RewardSpec::Python { file, func } => format!("python:{}:{func}", file.display()),
            RewardSpec::Agent => "agent".into(),
        }
    }

    pub(crate) fn is_external(&self) -> bool {
        matches!(self, RewardSpec::Cmd { .. } | RewardSpec::Python { .. })
    }

    /// Columns `Batch::read` must find (the ground truth is checked separately: it may live
    /// inside `reward_model`).
    pub(crate) fn required_columns(&self) -> Vec<&'static str> {
        match self {
            // A missing `score` is `posted_rewards`' error, which says where rewards come from.
            RewardSpec::Agent => vec![schema::RESPONSE_TEXT],
            s if s.is_external() => vec![schema::RESPONSE_TEXT, schema::DATA_SOURCE],
            _ => vec![schema::RESPONSE_TEXT],
        }
    }

    /// Whether the rule compares the responses with a ground truth in every row.
    pub(crate) fn needs_ground_truth(&self) -> bool {
        !self.is_external() && !matches!(self, RewardSpec::Agent)
    }
}

/// Options that tune the rules and the external programs.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) format_score: f32,
    pub(crate) gsm8k_method: gsm8k::Method,
    /// gsm8k strict: the score of a response without `#### N` whose last number is right.
    pub(crate) flexible_score: f32,
    /// Per-row answer timeout of external programs.
    pub(crate) timeout: Duration,
    /// Whole-run timeout of external programs.
    pub(crate) run_timeout: Option<Duration>,
    /// Interpreter for `python:`.
    pub(crate) python: String,
    /// Extra keyword arguments for a `python:` function (verl's `reward_kwargs`).
    pub(crate) reward_kwargs: Value,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            format_score: 0.0,
            gsm8k_method: gsm8k::Method::Strict,
            flexible_score: 0.0,
            timeout: Duration::from_secs(30),
            run_timeout: None,
            python: "python3".into(),
            reward_kwargs: json!({}),
        }
    }
}

impl Options {
    pub(crate) fn validate(&self) -> Result<()> {
        if !self.format_score.is_finite() {
            bail_input!(
                "--format-score {}: must be a finite number",
                self.format_score
            );
        }
        if !self.flexible_score.is_finite() {
            bail_input!(
                "--flexible-score {}: must be a finite number",
                self.flexible_score
            );
        }
        if self.flexible_score != 0.0 && self.gsm8k_method != gsm8k::Method::Strict {
            bail_input!(
                "--flexible-score is the tier below --gsm8k-method strict (no `#### N`, but the last number is right); --gsm8k-method flexible already scores the last number"
            );
        }
        if self.timeout.is_zero() {
            bail_input!("--timeout-ms must be > 0");
        }
        if !self.reward_kwargs.is_object() {
            bail_input!(
                "--reward-kwargs {}: must be a JSON object, e.g. '{{\"format_score\": 0.1}}'",
                self.reward_kwargs
            );
        }
        Ok(())
    }
}

/// Per-row scores, named sub-scores and text values (keys without the `score_` prefix).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Scores {
    pub(crate) score: Vec<f32>,
    pub(crate) subs: Vec<(String, Vec<f32>)>,
    /// Keys whose values are text (a predicted answer, a judge's reason), null where a row
    /// gave null.
    pub(crate) texts: Vec<(String, Vec<Option<String>>)>,
}

impl Scores {
    pub(crate) fn sub(&self, key: &str) -> Option<&[f32]> {
        self.subs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }
}

/// The ground-truth array (top level, or verl's struct field) and its name for messages.
fn ground_truth_array(batch: &Batch) -> Option<(ArrayRef, Option<ArrayRef>, String)> {
    if let Some(col) = batch.data.column_by_name(schema::GROUND_TRUTH) {
        return Some((col.clone(), None, batch.at(schema::GROUND_TRUTH)));
    }
    let rm = batch.data.column_by_name(schema::REWARD_MODEL)?;
    if let DataType::Struct(_) = rm.data_type() {
        let gt = rm.as_struct().column_by_name("ground_truth")?;
        let name = format!("{}.ground_truth", schema::REWARD_MODEL);
        return Some((gt.clone(), Some(rm.clone()), batch.at(&name)));
    }
    None
}

/// Ground truths as text for the built-in rules; nulls are an error.
fn ground_truth_texts(batch: &Batch) -> Result<Vec<String>> {
    let texts = batch.ground_truths()?;
    if let Some((gt, parent, at)) = ground_truth_array(batch) {
        let null = |i: usize| gt.is_null(i) || parent.as_ref().is_some_and(|p| p.is_null(i));
        if let Some(row) = (0..batch.num_rows()).find(|&i| null(i)) {
            bail_input!("{at}, row {row}: ground truth is null");
        }
    }
    Ok(texts)
}

/// Ground truths as JSON values for external programs (null when the batch has none).
fn ground_truth_values(batch: &Batch) -> Vec<Value> {
    match ground_truth_array(batch) {
        Some((gt, parent, _)) => (0..batch.num_rows())
            .map(|i| match &parent {
                Some(p) if p.is_null(i) => Value::Null,
                _ => crate::batch::json::value(gt.as_ref(), i),
            })
            .collect(),
        None => vec![Value::Null; batch.num_rows()],
    }
}

/// Rows per rayon task: big enough that scheduling costs nothing next to the regexes.
const MIN_ROWS_PER_TASK: usize = 256;

fn par_score(texts: &[&str], gts: &[String], f: impl Fn(&str, &str) -> f32 + Sync) -> Vec<f32> {
    texts
        .par_iter()
        .zip(gts.par_iter())
        .with_min_len(MIN_ROWS_PER_TASK)
        .map(|(t, g)| f(t, g))
        .collect()
}

/// The JSON request lines sent to an external program, one per row.
fn request_lines(batch: &Batch) -> Result<Vec<u8>> {
    #[derive(serde::Serialize)]
    struct Request<'a> {
        data_source: &'a str,
        solution_str: &'a str,
        ground_truth: &'a Value,
        extra_info: &'a Value,
    }
    let texts = batch.strings(schema::RESPONSE_TEXT)?;
    let sources = batch.strings(schema::DATA_SOURCE)?;
    let gts = ground_truth_values(batch);
    let extra = batch.json_rows(schema::EXTRA_INFO);
    let empty = json!({});
    let mut out = Vec::with_capacity(texts.iter().map(|t| t.len() + 128).sum());
    for i in 0..batch.num_rows() {
        let req = Request {
            data_source: sources[i],
            solution_str: texts[i],
            ground_truth: &gts[i],
            extra_info: if extra[i].is_null() {
                &empty
            } else {
                &extra[i]
            },
        };
        serde_json::to_writer(&mut out, &req)?;
        out.push(b'\n');
    }
    Ok(out)
}

/// Score every row of `batch` with `spec`.
pub(crate) fn score_batch(batch: &Batch, spec: &RewardSpec, opts: &Options) -> Result<Scores> {
    opts.validate()?;
    let fs = opts.format_score;
    let score = match spec {
        RewardSpec::Gsm8k => {
            let texts = batch.strings(schema::RESPONSE_TEXT)?;
            let gts = ground_truth_texts(batch)?;
            let (m, flex) = (opts.gsm8k_method, opts.flexible_score);
            par_score(&texts, &gts, |t, g| {
                gsm8k::score_with_fallback(t, g, m, fs, flex)
            })
        }
        RewardSpec::Math => {
            let texts = batch.strings(schema::RESPONSE_TEXT)?;
            let gts = ground_truth_texts(batch)?;
            par_score(&texts, &gts, |t, g| math::score(t, g, fs))
        }
        RewardSpec::Exact => {
            let texts = batch.strings(schema::RESPONSE_TEXT)?;
            let gts = ground_truth_texts(batch)?;
            par_score(&texts, &gts, rules::exact)
        }
        RewardSpec::Regex(rule) => {
            let texts = batch.strings(schema::RESPONSE_TEXT)?;
            let gts = ground_truth_texts(batch)?;
            par_score(&texts, &gts, |t, g| rule.score(t, g, fs))
        }
        RewardSpec::Cmd { argv, .. } => {
            return score_external(batch, argv, &spec.label(opts), opts)
        }
        RewardSpec::Python { file, func } => {
            let argv = external::python_argv(&opts.python, file, func, &opts.reward_kwargs);
            return score_external(batch, &argv, &spec.label(opts), opts);
        }
        RewardSpec::Agent => posted_rewards(batch)?,
    };
    Ok(Scores {
        score,
        ..Scores::default()
    })
}

/// The rewards an agent posted: the `score` column of collected trajectories, where a null
/// is a trajectory the agent posted no reward for.
fn posted_rewards(batch: &Batch) -> Result<Vec<f32>> {
    const HOW: &str = "--reward agent keeps the rewards the agent posted to POST /trajectories/ID/reward, one for every trajectory";
    let Ok(col) = batch.column(schema::SCORE) else {
        bail_input!(
            "{}: no reward posted (column '{}' is missing); {HOW}",
            batch.path.display(),
            schema::SCORE
        );
    };
    if let Some(row) = (0..col.len()).find(|&i| col.is_null(i)) {
        let id = match batch.has(schema::UID) {
            true => format!(" (trajectory '{}')", batch.strings(schema::UID)?[row]),
            false => String::new(),
        };
        bail_input!(
            "{}, row {row}: no reward posted{id}; {HOW}",
            batch.at(schema::SCORE)
        );
    }
    batch.f32s(schema::SCORE)
}

fn score_external(batch: &Batch, argv: &[String], label: &str, opts: &Options) -> Result<Scores> {
    let rows = batch.num_rows();
    if rows == 0 {
        return Ok(Scores::default());
    }
    let input = request_lines(batch)?;
    let ctx = batch.path.display().to_string();
    let limits = external::Limits {
        row: opts.timeout,
        run: opts.run_timeout,
    };
    let answers = external::run(argv, label, input, rows, limits, &ctx)?;
    let scores = external::collate(&answers, &ctx, label)?;
    let keys = scores.subs.iter().map(|(k, _)| k);
    for key in keys.chain(scores.texts.iter().map(|(k, _)| k)) {
        let name = format!("{}{key}", schema::SCORE_PREFIX);
        if schema::kind_of(&name) != Some(Kind::SubScore) {
            bail_input!(
                "{ctx}: reward `{label}`: key \"{key}\" would be written as column '{name}', which the batch contract reserves for another type; rename the key"
            );
        }
    }
    Ok(scores)
}

/// Everything one run of the `score` stage needs.
#[derive(Clone, Debug)]
pub struct StageConfig {
    pub(crate) input: PathBuf,
    pub(crate) output: PathBuf,
    /// The `--reward` text as given (recorded in the output's metadata).
    pub(crate) reward: String,
    pub(crate) options: Options,
    /// DAPO's overlong shaping, when asked for.
    pub(crate) overlong: Option<OverlongFlags>,
    pub(crate) metrics: Option<PathBuf>,
}

/// `--overlong-buffer-len`, `--overlong-penalty-factor` and `--max-response-length` as given;
/// the limit is resolved against the batch ([`OverlongFlags::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OverlongFlags {
    pub(crate) buffer: usize,
    pub(crate) factor: f32,
    /// L_max; None: the rollout's `max_response_tokens` (older batches: `max_new_tokens`)
    /// recorded in the batch.
    pub(crate) max_len: Option<usize>,
}

impl OverlongFlags {
    /// The shaping for `batch`: L_max from the flag, else from the rollout's parameters in the
    /// batch metadata (`tandem.stage.rollout`).
    pub(crate) fn resolve(&self, batch: &Batch) -> Result<overlong::Overlong> {
        if let Some(max) = self.max_len {
            return overlong::Overlong::new(max, self.buffer, self.factor, "--max-response-length");
        }
        let key = format!("{}rollout", crate::batch::schema::meta::STAGE_PREFIX);
        // A pipeline's agent step records the limit its agent was handed.
        let agent = format!("{}agent", crate::batch::schema::meta::STAGE_PREFIX);
        let recorded = [&key, &agent]
            .into_iter()
            .find_map(|k| batch.meta.get(k))
            .and_then(|p| serde_json::from_str::<Value>(p).ok())
            .and_then(|p| {
                // A multi-turn rollout's limit is its whole response's (sampled and tool tokens).
                let limit = p
                    .get("max_response_tokens")
                    .or_else(|| p.get("max_new_tokens"));
                limit.and_then(Value::as_u64)
            });
        match recorded {
            Some(max) => overlong::Overlong::new(
                max as usize,
                self.buffer,
                self.factor,
                &format!("{}: the rollout's max_new_tokens", batch.path.display()),
            ),
            None => bail_input!(
                "{}: --overlong-buffer-len needs the response length limit: the batch records no rollout max_new_tokens ({key}); pass --max-response-length",
                batch.path.display()
            ),
        }
    }
}

impl StageConfig {
    /// The stage's parameters as recorded under `tandem.stage.score`.
    pub(crate) fn params(&self) -> Value {
        let o = &self.options;
        json!({
            "reward": self.reward,
            "format_score": o.format_score,
            "gsm8k_method": o.gsm8k_method,
            "flexible_score": o.flexible_score,
            "timeout_ms": o.timeout.as_millis() as u64,
            "run_timeout_ms": o.run_timeout.map(|d| d.as_millis() as u64),
            "python": o.python,
            "reward_kwargs": o.reward_kwargs,
            "overlong_buffer_len": self.overlong.map(|f| f.buffer),
            "overlong_penalty_factor": self.overlong.map(|f| f.factor),
            "max_response_length": self.overlong.and_then(|f| f.max_len),
        })
    }
}

/// The `score` stage: read, score, write the batch (and the metrics file), print the summary.
pub(crate) fn run_stage(cfg: &StageConfig) -> Result<Summary> {
    let spec = RewardSpec::parse(&cfg.reward)?;
    cfg.options.validate()?;
    let t0 = Instant::now();
    let mut required = spec.required_columns();
    if cfg.overlong.is_some() {
        required.push(schema::RESPONSE_IDS);
    }
    let batch = Batch::read(&cfg.input, &required)?;
    batch.require_rows()?;
    let shaping = cfg.overlong.map(|f| f.resolve(&batch)).transpose()?;
    let t1 = Instant::now();
    let mut scores = score_batch(&batch, &spec, &cfg.options)?;
    if let Some(o) = &shaping {
        let lens: Vec<usize> = batch
            .ragged_i32(schema::RESPONSE_IDS)?
            .rows()
            .map(<[i32]>::len)
            .collect();
        o.apply(&mut scores, &lens)
            .map_err(|e| e.context(batch.path.display().to_string()))?;
    }
    let sources = if batch.has(schema::DATA_SOURCE) {
        Some(batch.strings(schema::DATA_SOURCE)?)
    } else {
        None
    };
    let is_baseline = batch.baseline_rows()?;
    let summary = Summary::new(&scores, sources.as_deref(), Some(&is_baseline));
    let overlong_rows = overlong_rows(&scores, &is_baseline);
    let t2 = Instant::now();

    let mut cols = NewColumns::new();
    for (key, values) in &scores.subs {
        let name = format!("{}{key}", schema::SCORE_PREFIX);
        cols.add(&name, Arc::new(Float32Array::from(values.clone())));
    }
    for (key, values) in &scores.texts {
        let name = format!("{}{key}", schema::SCORE_PREFIX);
        cols.add_field(
            Field::new(name, DataType::Utf8, true),
            Arc::new(StringArray::from(values.clone())),
        );
    }
    cols.add(schema::SCORE, Arc::new(Float32Array::from(scores.score)));
    let info = StageInfo {
        stage: "score",
        params: cfg.params(),
        policy_version: None,
        step: None,
    };
    batch.write_derived(&cfg.output, cols, &info)?;
    let timings = Timings {
        read_s: (t1 - t0).as_secs_f64(),
        score_s: (t2 - t1).as_secs_f64(),
        write_s: t2.elapsed().as_secs_f64(),
    };
    if let Some(path) = &cfg.metrics {
        let mut m = summary.metrics(&timings);
        insert_overlong_fraction(&mut m, overlong_rows, summary.all.rows);
        summary::write_metrics(path, &m)?;
    }
    eprint!("{}", summary.report(&spec.label(&cfg.options), &timings));
    if let (Some(o), Some(n)) = (&shaping, overlong_rows) {
        eprintln!(
            "  overlong: {n} of {} responses past {} tokens (L_max {} - buffer {}), penalty factor {}",
            summary.all.rows,
            o.max_len - o.buffer,
            o.max_len,
            o.buffer,
            o.factor
        );
    }
    Ok(summary)
}

/// Sample rows (baseline rows apart) the overlong shaping penalised, when it ran.
fn overlong_rows(scores: &Scores, is_baseline: &[bool]) -> Option<usize> {
    scores.sub(overlong::KEY).map(|p| {
        p.iter()
            .zip(is_baseline)
            .filter(|(&x, &b)| x < 0.0 && !b)
            .count()
    })
}

/// `score/overlong_fraction`: verl's `overlong` flag as a fraction of the rows.
fn insert_overlong_fraction(m: &mut Map<String, Value>, penalised: Option<usize>, rows: usize) {
    if let Some(n) = penalised {
        m.insert(
            "score/overlong_fraction".into(),
            json!(n as f64 / rows.max(1) as f64),
        );
    }
}

/// What `score --metrics` reports about the rows of an already scored batch (its `score` and
/// `score_<key>` columns), without the timings: for a batch the runner assembled from scored
/// files (dynamic sampling).
pub(crate) fn scored_metrics(batch: &Batch) -> Result<Map<String, Value>> {
    let mut scores = Scores {
        score: batch.f32s(schema::SCORE)?,
        subs: Vec::new(),
        texts: Vec::new(),
    };
    for f in batch.data.schema().fields() {
        if let Some(key) = f.name().strip_prefix(schema::SCORE_PREFIX) {
            if matches!(f.data_type(), DataType::Utf8 | DataType::LargeUtf8) {
                let col = batch
                    .data
                    .column_by_name(f.name())
                    .expect("field of the schema");
                let text = col.as_string::<i32>();
                let vals = (0..text.len())
                    .map(|i| text.is_valid(i).then(|| text.value(i).to_string()))
                    .collect();
                scores.texts.push((key.to_string(), vals));
            } else {
                scores.subs.push((key.to_string(), batch.f32s(f.name())?));
            }
        }
    }
    let sources = if batch.has(schema::DATA_SOURCE) {
        Some(batch.strings(schema::DATA_SOURCE)?)
    } else {
        None
    };
    let is_baseline = batch.baseline_rows()?;
    let summary = Summary::new(&scores, sources.as_deref(), Some(&is_baseline));
    let mut m = summary.metrics(&Timings::default());
    m.retain(|k, _| !k.ends_with("_s"));
    insert_overlong_fraction(
        &mut m,
        overlong_rows(&scores, &is_baseline),
        summary.all.rows,
    );
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_specs() {
        assert!(matches!(
            RewardSpec::parse("gsm8k").unwrap(),
            RewardSpec::Gsm8k
        ));
        assert!(matches!(
            RewardSpec::parse("math").unwrap(),
            RewardSpec::Math
        ));
        assert!(matches!(
            RewardSpec::parse("exact").unwrap(),
            RewardSpec::Exact
        ));
        match RewardSpec::parse("regex:#### (\\d+)").unwrap() {
            RewardSpec::Regex(r) => assert_eq!(r.extract("#### 12"), Some("12")),
            other => panic!("{other:?}"),
        }
        match RewardSpec::parse("cmd:python3 'my reward.py' --k 1").unwrap() {
            RewardSpec::Cmd { argv, line } => {
                assert_eq!(argv, ["python3", "my reward.py", "--k", "1"]);
                assert_eq!(line, "python3 'my reward.py' --k 1");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parse_python_specs() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.py");
        std::fs::write(&f, "def compute_score(**k): return 1.0\n").unwrap();
        let shown = f.display().to_string();
        match RewardSpec::parse(&format!("python:{shown}")).unwrap() {
            RewardSpec::Python { file, func } => {
                assert_eq!(file, f);
                assert_eq!(func, "compute_score");
            }
            other => panic!("{other:?}"),
        }
        match RewardSpec::parse(&format!("python:{shown}:my_fn")).unwrap() {
            RewardSpec::Python { func, .. } => assert_eq!(func, "my_fn"),
            other => panic!("{other:?}"),
        }
        let err = RewardSpec::parse("python:/no/such/file.py").unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("no such file"), "{err}");
    }

    #[test]
    fn bad_specs_are_input_errors() {
        for (spec, needle) in [
            ("gsm8", "unknown reward"),
            ("regex:(", "invalid pattern"),
            ("cmd:", "needs a program"),
            ("cmd:a 'b", "unclosed single quote"),
            ("python:", "needs a file"),
        ] {
            let err = RewardSpec::parse(spec).unwrap_err();
            assert!(crate::error::is_input_error(&err), "{spec}");
            assert!(err.to_string().contains(needle), "{spec}: {err}");
        }
    }

    #[test]
    fn options_are_validated() {
        let bad = |o: Options| Options::validate(&o).unwrap_err().to_string();
        let o = Options {
            format_score: f32::NAN,
            ..Options::default()
        };
        assert!(bad(o).contains("--format-score"));
        let o = Options {
            timeout: Duration::ZERO,
            ..Options::default()
        };
        assert!(bad(o).contains("--timeout-ms"));
        let o = Options {
            reward_kwargs: json!([1]),
            ..Options::default()
        };
        assert!(bad(o).contains("--reward-kwargs"));
    }
}
