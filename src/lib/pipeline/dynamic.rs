//! DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl's `algorithm.filter_groups`).
//!
//! A prompt group whose samples all get the same reward has zero GRPO advantage and gives no
//! gradient. With `[algorithm] filter-groups = true` a step samples in rounds: each round
//! draws `prompts-per-round` prompts from the run's sampler (the same seeded cursor as a plain
//! step, so a resume draws the same prompts), rolls them out and scores them, and keeps the
//! groups whose `filter-metric` is not the same for every sample. Rounds go on until
//! `[data] prompts-per-step` groups are kept; the step then trains on the first that many in
//! round order (the surplus of the last round is dropped, as verl truncates). At
//! `max-num-gen-batches` rounds with fewer groups, `on-cap = "train"` (the default) trains on
//! the groups kept, and `on-cap = "fail"` stops the run as verl does; a step that kept no group
//! at all stops the run either way (there is nothing to train on).
//!
//! Files: every round in `step-000K/round-R/` (`prompts`, `rollout`, `scored` and the stages'
//! `metrics/`); the kept groups in the step's `rollout.parquet` and `scored.parquet`, which the
//! rest of the step reads as usual; the step's sampling summary in `metrics/sampling.json`
//! (`sampling/…` in metrics.jsonl) and `metrics/score.json` (the score summary of the kept
//! rows); the sampler's cursor after the step in `step-000K/sampling.json`. Each finished
//! round stage is recorded in `state.json` (`round-R/rollout`...), so a run killed in the
//! middle of a step continues with the round it was in.
//!
//! In one-step-off mode (`[placement]`) step k + 1's rounds run in step k, beside its update
//! (`runner::run_beside_sampling`): all of them before step k's sync, so they sample with one
//! policy, the one before step k's update. They are recorded in step k's progress, as
//! `next/round-R/…`, their seconds as the next step's ([`Target`]).

use super::console::Console;
use super::metrics;
use super::plan::{round_files, round_seed, Action, Plan, SampleFiles};
use super::rundir::{step_name, RunDir, State};
use super::sampler::Cursor;
use super::spec::{FilterGroups, FilterMetric, OnCap};
use crate::algo::advantage::Groups;
use crate::bail_input;
use crate::batch::{schema, write_file, write_json, Batch, StageInfo};
use anyhow::{Context, Result};
use arrow_array::{RecordBatch, UInt32Array};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the rounds need from the step loop (`runner::Runner` implements it): the plan, the
/// run's state and console, and running a stage and drawing prompts as the loop does.
pub(super) trait Rounds {
    fn plan(&self) -> &Plan;
    fn state(&mut self) -> &mut State;
    /// Writes the state to state.json.
    fn save_state(&mut self) -> Result<()>;
    fn console(&mut self) -> &mut Console;
    /// Runs a stage command as task `task` of step `step` (on a restarted daemon when the
    /// daemon died under it).
    fn run_stage(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()>;
    /// Writes `count` prompts drawn from `cursor` to `out`; returns the cursor after them.
    fn draw_prompts(&mut self, step: u64, cursor: Cursor, count: u64, out: &Path)
        -> Result<Cursor>;
}

/// Which groups are kept: those whose value is not the same for every sample. A group of one
/// sample is kept, as verl does (its spread is undefined, not zero). Rows marked in
/// `is_baseline` (ReMax's greedy baselines) are not samples: they go with their group but do
/// not count.
pub(crate) fn varied_groups(groups: &Groups, values: &[f64], is_baseline: &[bool]) -> Vec<bool> {
    assert_eq!(groups.of_row.len(), values.len(), "one value per row");
    let mut first: Vec<Option<f64>> = vec![None; groups.count];
    let mut varied = vec![false; groups.count];
    let mut samples = vec![0usize; groups.count];
    for ((&g, &v), _) in groups
        .of_row
        .iter()
        .zip(values)
        .zip(is_baseline)
        .filter(|(_, &b)| !b)
    {
        samples[g] += 1;
        match first[g] {
            None => first[g] = Some(v),
            Some(f) if f != v => varied[g] = true,
            Some(_) => {}
        }
    }
    varied
        .into_iter()
        .zip(samples)
        .map(|(v, n)| v || n == 1)
        .collect()
}

/// The per-row values of `metric` in a scored batch.
pub(crate) fn metric_values(batch: &Batch, metric: &FilterMetric) -> Result<Vec<f64>> {
    // `f32s` refuses NaN and infinities (naming the row), so the values compare exactly.
    Ok(match metric {
        FilterMetric::Score => batch
            .f32s(schema::SCORE)?
            .iter()
            .map(|&x| x as f64)
            .collect(),
        FilterMetric::Acc => metrics::correct(batch, &batch.f32s(schema::SCORE)?)?,
        FilterMetric::Column(c) => {
            if !batch.has(c) {
                bail_input!(
                    "{}: [algorithm] filter-metric = \"{c}\": the scored batch has no column '{c}' (the reward returns no sub-score \"{}\")",
                    batch.path.display(),
                    &c[schema::SCORE_PREFIX.len()..]
                );
            }
            batch.f32s(c)?.iter().map(|&x| x as f64).collect()
        }
    })
}

/// One finished round.
pub(super) struct Round {
    files: SampleFiles,
    scored: Batch,
    groups: Groups,
    /// Per group (in order of appearance): whether it is kept.
    pub(super) keep: Vec<bool>,
}

/// Which step's groups a sampling run draws (`step`), and the step whose task runs it
/// (`within`): the same step, or in one-step-off mode the step before (beside its update).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Target {
    pub(crate) step: u64,
    pub(crate) within: u64,
}

impl Target {
    fn ahead(&self) -> bool {
        self.within != self.step
    }

    /// The name a part of the sampling is recorded under in `within`'s progress.
    fn part(&self, name: &str) -> String {
        match self.ahead() {
            true => format!("next/{name}"),
            false => name.to_string(),
        }
    }

    /// Where the sampling's seconds go: the step's own, or the next step's (`next`).
    fn seconds<'a>(&self, state: &'a mut State) -> &'a mut BTreeMap<String, f64> {
        let ahead = self.ahead();
        let p = state.progress(self.within);
        match ahead {
            true => &mut p.next,
            false => &mut p.seconds,
        }
    }
}

/// What `step-000K/sampling.json` records: the rounds a step took and where the sampler stood
/// after them (a rewind to this step continues from there).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Record {
    rounds: u64,
    groups: usize,
    capped: bool,
    cursor: Cursor,
}

fn record_path(run: &RunDir, step: u64) -> PathBuf {
    run.step_dir(step).join("sampling.json")
}

/// Records a finished part of the task in state.json, adding its seconds to `key`'s.
fn record(r: &mut impl Rounds, t: Target, name: &str, secs: Option<(&str, f64)>) -> Result<()> {
    r.state().progress(t.within).done.push(t.part(name));
    if let Some((key, s)) = secs {
        *t.seconds(r.state()).entry(key.to_string()).or_default() += s;
    }
    r.save_state()
}

/// The rounds a step sampled, and where the sampler stands after them.
struct Sampled {
    rounds: Vec<Round>,
    cursor: Cursor,
    /// Groups kept over all rounds (the surplus of the last round included).
    varied: usize,
    /// Whether the rounds stopped at `max-num-gen-batches` with fewer than wanted.
    capped: bool,
}

/// Runs the rounds of step `t.step` and writes its kept batch (see the module docs).
pub(super) fn run(r: &mut impl Rounds, t: Target) -> Result<()> {
    let step = t.step;
    let fg = r
        .plan()
        .spec
        .filter_groups()
        .expect("a step samples dynamically");
    let want = r.plan().spec.data.prompts_per_step as usize;
    let sampled = sample_rounds(r, t, &fg, want)?;
    let t0 = Instant::now();
    if sampled.capped {
        at_cap(r, step, &fg, &sampled, want)?;
    }
    let taken = assemble(&r.plan().run, step, &sampled.rounds, (want, None), &fg)?;
    write_summary(r, t, &fg, &sampled, taken)?;
    write_rollout_metrics(&r.plan().run, step, &sampled.rounds)?;
    r.state().sampler = sampled.cursor;
    *t.seconds(r.state()).entry("filter".into()).or_default() += t0.elapsed().as_secs_f64();
    Ok(())
}

/// Samples rounds until `want` groups vary, or the cap on rounds.
fn sample_rounds(
    r: &mut impl Rounds,
    t: Target,
    fg: &FilterGroups,
    want: usize,
) -> Result<Sampled> {
    let step = t.step;
    let train_rows = r.state().train_rows;
    let sampler = r.plan().sampler(train_rows);
    let mut cursor = r.state().sampler;
    let mut rounds: Vec<Round> = Vec::new();
    let mut varied = 0usize;
    let capped = loop {
        let round = rounds.len() as u64 + 1;
        let next = sampler.draw(cursor, fg.prompts_per_round).1;
        let done = run_round(r, t, round, cursor, fg)?;
        let kept = done.keep.iter().filter(|&&k| k).count();
        varied += kept;
        r.console().detail(&format!(
            "{} round {round}: {kept} of {} groups have a varying {} ({varied} of {want} kept so far)",
            step_name(step),
            done.groups.count,
            fg.metric.name()
        ));
        rounds.push(done);
        cursor = next;
        if varied >= want {
            break false;
        }
        if fg.max_rounds > 0 && round >= fg.max_rounds {
            break true;
        }
    };
    Ok(Sampled {
        rounds,
        cursor,
        varied,
        capped,
    })
}

/// Round `round`: its prompts drawn from `cursor`, rolled out and scored (each part skipped
/// when the state records it done), and the groups it keeps. Its stage commands run as tasks
/// of the step that runs the sampling (`t.within`).
fn run_round(
    r: &mut impl Rounds,
    t: Target,
    round: u64,
    cursor: Cursor,
    fg: &FilterGroups,
) -> Result<Round> {
    let step = t.step;
    let files = round_files(&r.plan().run, step, round);
    let name = format!("round-{round}/prompts");
    if !r.state().is_done(t.within, &t.part(&name)) {
        r.draw_prompts(step, cursor, fg.prompts_per_round, &files.prompts)?;
        record(r, t, &name, None)?;
    }
    let seed = round_seed(r.plan().spec.seed, step, round);
    let tasks = r.plan().sample_tasks(step, &files, seed);
    for task in tasks {
        let name = format!("round-{round}/{}", task.name);
        if r.state().is_done(t.within, &t.part(&name)) {
            continue;
        }
        let Action::Stage { bin, args } = &task.action else {
            unreachable!("a sampling pass is stage commands");
        };
        let t0 = Instant::now();
        r.run_stage(t.within, &t.part(&name), bin, args)?;
        record(r, t, &name, Some((task.name, t0.elapsed().as_secs_f64())))?;
    }
    Round::read(files, fg)
}

impl Round {
    /// A scored pass (`files.scored`) and the groups it keeps under `fg`.
    pub(super) fn read(files: SampleFiles, fg: &FilterGroups) -> Result<Round> {
        let scored = Batch::read(
            &files.scored,
            &[schema::PROMPT_UID, schema::SCORE, schema::RESPONSE_IDS],
        )?;
        let groups = Groups::from_keys(&scored.strings(schema::PROMPT_UID)?);
        let values = metric_values(&scored, &fg.metric)?;
        let keep = varied_groups(&groups, &values, &scored.baseline_rows()?);
        Ok(Round {
            files,
            scored,
            groups,
            keep,
        })
    }
}

/// At the cap on rounds with fewer groups than wanted: stops the run (`on-cap = "fail"`, or
/// no group kept at all), or says that the step trains on the groups kept.
fn at_cap(
    r: &mut impl Rounds,
    step: u64,
    fg: &FilterGroups,
    sampled: &Sampled,
    want: usize,
) -> Result<()> {
    let n_rounds = sampled.rounds.len() as u64;
    let varied = sampled.varied;
    let what = format!(
        "{}: dynamic sampling kept {varied} of {want} groups in {n_rounds} round{} ({} prompts; every other group had the same {} for all its samples; [algorithm] max-num-gen-batches = {})",
        step_name(step),
        if n_rounds == 1 { "" } else { "s" },
        n_rounds * fg.prompts_per_round,
        fg.metric.name(),
        fg.max_rounds
    );
    cap_reached(r.console(), fg, &what, varied)
}

/// `on-cap` once the cap is reached with `varied` groups kept (`what` says how): an error
/// (`fail`, or nothing kept), or a note that the step trains on those.
pub(super) fn cap_reached(
    console: &mut Console,
    fg: &FilterGroups,
    what: &str,
    varied: usize,
) -> Result<()> {
    if fg.on_cap == OnCap::Fail {
        anyhow::bail!(
            "{what}; on-cap = \"fail\" stops the run here, as verl does (on-cap = \"train\" trains on the groups kept; a higher max-num-gen-batches samples more)"
        );
    }
    if varied == 0 {
        anyhow::bail!(
            "{what}: nothing to train on. The prompts are all too easy or too hard for the policy under this reward: check the reward, or raise max-num-gen-batches"
        );
    }
    console.say(&format!("{what}: training on those {varied}"));
    Ok(())
}

/// Writes the step's sampling summary (over every sample the rounds drew) and its record
/// (`sampling.json`: the rounds, and the sampler's cursor after them).
fn write_summary(
    r: &mut impl Rounds,
    t: Target,
    fg: &FilterGroups,
    sampled: &Sampled,
    taken: usize,
) -> Result<()> {
    let rounds = &sampled.rounds;
    let n_rounds = rounds.len() as u64;
    let (mut rows, mut score_sum, mut correct_sum, mut tokens) = (0usize, 0.0, 0.0, 0usize);
    for round in rounds {
        // Over the samples: baseline rows (ReMax) are not counted.
        let b = &round.scored;
        let s = b.f32s(schema::SCORE)?;
        let ok = metrics::correct(b, &s)?;
        let ids = b.ragged_i32(schema::RESPONSE_IDS)?;
        for (i, base) in b.baseline_rows()?.into_iter().enumerate() {
            if !base {
                rows += 1;
                score_sum += s[i] as f64;
                correct_sum += ok[i];
                tokens += ids.row(i).len();
            }
        }
    }
    let groups_all: usize = rounds.iter().map(|r| r.groups.count).sum();
    let step = t.step;
    let rollout_s = t.seconds(r.state()).get("rollout").copied().unwrap_or(0.0);
    let mut m = json!({
        "rounds": n_rounds,
        "prompts": n_rounds * fg.prompts_per_round,
        "groups": taken,
        "groups_dropped": groups_all - sampled.varied,
        "groups_surplus": sampled.varied - taken,
        "capped": u8::from(sampled.capped),
        "samples": rows,
        "response_tokens": tokens,
        "score_mean": score_sum / rows.max(1) as f64,
        "accuracy": correct_sum / rows.max(1) as f64,
    });
    if rollout_s > 0.0 {
        m["rollout_tokens_per_s"] = json!(tokens as f64 / rollout_s);
    }
    let run = &r.plan().run;
    write_json(&run.stage_metrics(step, "sampling"), &m)?;
    write_json(
        &record_path(run, step),
        &Record {
            rounds: n_rounds,
            groups: taken,
            capped: sampled.capped,
            cursor: sampled.cursor,
        },
    )
}

/// Rollout metrics that add up over rounds (counts and seconds).
const SUMMED: &[&str] = &[
    "samples",
    "prompts",
    "prompt_tokens",
    "response_tokens",
    "response_model_tokens",
    "engine_steps",
    "prefills",
    "prefill_tokens",
    "preemptions",
    "truncated_prompts",
    "overlap_discarded_tokens",
    "overlapped_steps",
    "tool_calls",
    "tool_errors",
    "baseline_samples",
    "seconds",
    "load_seconds",
    "generation_seconds",
    "tool_wait_seconds",
    "tool_call_seconds",
    "baseline_seconds",
];
/// Rollout metrics that are means over samples: weighted by each round's samples.
const PER_SAMPLE: &[&str] = &[
    "response_length_mean",
    "turns_mean",
    "tool_calls_per_sample",
    "finish_stop_fraction",
];
/// Rollout metrics that are the largest of the rounds'.
const LARGEST: &[&str] = &["response_length_max", "kv_blocks_peak"];

/// The step's rollout metrics (`metrics/rollout.json`, `rollout/…` in metrics.jsonl) over every
/// round it sampled: counts and seconds summed, per-sample means weighted by samples, rates
/// weighted by generation seconds, the rest as the last round reported them.
fn write_rollout_metrics(run: &RunDir, step: u64, rounds: &[Round]) -> Result<()> {
    let mut parts = Vec::new();
    for round in rounds {
        let path = &round.files.rollout_metrics;
        let Ok(text) = std::fs::read_to_string(path) else {
            // A rollout run without --metrics wrote none: neither does the step.
            return Ok(());
        };
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: stage metrics are not JSON", path.display()))?;
        parts.push(v);
    }
    write_json(&run.stage_metrics(step, "rollout"), &merge_rounds(&parts))
}

/// [`write_rollout_metrics`]'s merge of the rounds' metrics objects.
fn merge_rounds(parts: &[serde_json::Value]) -> serde_json::Value {
    let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    let Some(mut out) = parts.last().cloned() else {
        return json!({});
    };
    let total = |k: &str| parts.iter().filter_map(|p| num(p, k)).sum::<f64>();
    let weighted = |k: &str, w: &str| {
        let den: f64 = parts.iter().filter_map(|p| num(p, k).and(num(p, w))).sum();
        let sum: f64 = parts
            .iter()
            .filter_map(|p| Some(num(p, k)? * num(p, w)?))
            .sum();
        (den > 0.0).then(|| sum / den)
    };
    let Some(o) = out.as_object_mut() else {
        return out;
    };
    let keys: Vec<String> = o.keys().cloned().collect();
    for k in keys {
        let value = if SUMMED.contains(&k.as_str()) {
            Some(total(&k))
        } else if PER_SAMPLE.contains(&k.as_str()) {
            weighted(&k, "samples")
        } else if k == "baseline_response_length_mean" {
            weighted(&k, "baseline_samples")
        } else if LARGEST.contains(&k.as_str()) {
            parts.iter().filter_map(|p| num(p, &k)).reduce(f64::max)
        } else if k.ends_with("_per_s") {
            weighted(&k, "generation_seconds")
        } else {
            None
        };
        if let Some(x) = value {
            // Counts stay integers in the file.
            o[&k] = match o[&k].is_u64() || o[&k].is_i64() {
                true => json!(x.round() as i64),
                false => json!(x),
            };
        }
    }
    out
}

/// Writes the step's rollout and scored files from the first `want` kept groups, in round
/// order, with the score summary of those rows, and `policy_version` in their metadata when
/// given (else the first round's). Returns the number of groups.
pub(super) fn assemble(
    run: &RunDir,
    step: u64,
    rounds: &[Round],
    (want, policy_version): (usize, Option<u64>),
    fg: &FilterGroups,
) -> Result<usize> {
    let mut left = want;
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut scored_parts: Vec<(&Path, RecordBatch)> = Vec::new();
    let mut rollout_parts: Vec<(PathBuf, RecordBatch)> = Vec::new();
    let mut meta_from: Option<(usize, Batch)> = None;
    let mut sources = Vec::new();
    for (i, round) in rounds.iter().enumerate() {
        let (rows, groups) = kept_rows(round, left);
        left -= groups;
        if rows.is_empty() {
            continue;
        }
        check_uids(round, i as u64 + 1, &rows, &mut seen)?;
        let rows = UInt32Array::from(rows);
        let rollout = round_rollout(round)?;
        scored_parts.push((
            &round.files.scored,
            arrow_select::take::take_record_batch(&round.scored.data, &rows)?,
        ));
        rollout_parts.push((
            rollout.path.clone(),
            arrow_select::take::take_record_batch(&rollout.data, &rows)?,
        ));
        sources.push(round.files.scored.display().to_string());
        if meta_from.is_none() {
            meta_from = Some((i, rollout));
        }
    }
    let taken = want - left;
    let (first, first_rollout) = meta_from.expect("at least one group is kept");
    let info = StageInfo {
        stage: "filter-groups",
        params: json!({
            "metric": fg.metric.name(),
            "rounds": rounds.len(),
            "prompts_per_round": fg.prompts_per_round,
            "groups": taken,
            "from": sources,
        }),
        policy_version,
        step: Some(step),
    };
    let scored_out = run.batch(step, "scored");
    let data = concat(scored_parts.iter().map(|(p, b)| (*p, b)))?;
    write_file(
        &scored_out,
        &data,
        &rounds[first].scored.derived_meta(&info),
    )?;
    let data = concat(rollout_parts.iter().map(|(p, b)| (p.as_path(), b)))?;
    write_file(
        &run.batch(step, "rollout"),
        &data,
        &first_rollout.derived_meta(&info),
    )?;
    let kept = Batch::read(&scored_out, &[schema::SCORE])?;
    write_json(
        &run.stage_metrics(step, "score"),
        &crate::reward::scored_metrics(&kept)?,
    )?;
    Ok(taken)
}

/// The rows of the first `left` kept groups of a round (groups numbered in order of
/// appearance), and how many groups that is.
fn kept_rows(round: &Round, left: usize) -> (Vec<u32>, usize) {
    let mut take_group = vec![false; round.groups.count];
    for (g, _) in round.keep.iter().enumerate().filter(|(_, &k)| k).take(left) {
        take_group[g] = true;
    }
    let groups = take_group.iter().filter(|&&t| t).count();
    let rows = (0..round.scored.num_rows())
        .filter(|&row| take_group[round.groups.of_row[row]])
        .map(|row| row as u32)
        .collect();
    (rows, groups)
}

/// Refuses a prompt uid of round `round_no`'s `rows` that an earlier round kept too (their
/// groups would merge); records the round's uids in `seen`.
fn check_uids(
    round: &Round,
    round_no: u64,
    rows: &[u32],
    seen: &mut HashMap<String, u64>,
) -> Result<()> {
    let uids = round.scored.strings(schema::PROMPT_UID)?;
    for &row in rows {
        let uid = uids[row as usize];
        if let Some(&other) = seen.get(uid) {
            if other != round_no {
                anyhow::bail!(
                    "{}: prompt_uid {uid} is also in round {other}: two rounds' groups would merge",
                    round.files.scored.display()
                );
            }
        }
        seen.insert(uid.to_string(), round_no);
    }
    Ok(())
}

/// The round's rollout file, which must hold a row for each of its scored rows.
fn round_rollout(round: &Round) -> Result<Batch> {
    let rollout = Batch::read(&round.files.rollout, &[])?;
    if rollout.num_rows() != round.scored.num_rows() {
        bail_input!(
            "{}: {} rows, but {} has {}: a round's scored file must hold its rollout's rows",
            round.files.scored.display(),
            round.scored.num_rows(),
            rollout.path.display(),
            rollout.num_rows()
        );
    }
    Ok(rollout)
}

/// The parts as one record batch; every part must have the first one's columns.
fn concat<'a>(mut parts: impl Iterator<Item = (&'a Path, &'a RecordBatch)>) -> Result<RecordBatch> {
    let (path0, first) = parts.next().expect("at least one part");
    let schema = first.schema();
    let mut all = vec![first.clone()];
    for (path, b) in parts {
        if b.schema().fields() != schema.fields() {
            let names = |s: &arrow_schema::Schema| {
                s.fields()
                    .iter()
                    .map(|f| format!("{} {}", f.name(), f.data_type()))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            bail_input!(
                "{}: its columns ({}) differ from {}'s ({}); the rounds of a step must have the same columns",
                path.display(),
                names(&b.schema()),
                path0.display(),
                names(&schema)
            );
        }
        all.push(b.clone());
    }
    Ok(arrow_select::concat::concat_batches(&schema, &all)?)
}

/// Whether step `step`'s dynamic sampling has finished (its record is written).
pub(super) fn sampled(run: &RunDir, step: u64) -> bool {
    record_path(run, step).exists()
}

/// The sampler's cursor after step `step`: a step that sampled dynamically recorded it (its
/// rounds drew a number of prompts known only once they ran); a plain step drew
/// `prompts-per-step` after the step before.
pub(super) fn cursor_after(plan: &Plan, train_rows: u64, step: u64) -> Result<Cursor> {
    let sampler = plan.sampler(train_rows);
    let mut cursor = Cursor::default();
    for s in 1..=step {
        let path = record_path(&plan.run, s);
        cursor = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let rec: Record = serde_json::from_str(&text).with_context(|| {
                    format!("{}: not a dynamic sampling record", path.display())
                })?;
                rec.cursor
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                sampler.draw(cursor, plan.spec.data.prompts_per_step).1
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
    }
    Ok(cursor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_with_equal_values_are_dropped() {
        // Groups a (3 rows, varied), b (equal), c (one row: kept), d (equal zeros), e (varied
        // only in its last row).
        let keys = ["a", "a", "a", "b", "b", "c", "d", "d", "e", "e", "e"];
        let values = [1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 0.9];
        let g = Groups::from_keys(&keys);
        let none = [false; 11];
        let want = [true, false, true, false, true];
        assert_eq!(varied_groups(&g, &values, &none), want);
        // Baseline rows go with their group but do not count: a's and b's samples are equal
        // (their baselines differ), c has one sample, e's differing row is its baseline.
        let keys = ["a", "a", "a", "b", "b", "b", "c", "c", "e", "e", "e"];
        let values = [9.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.3, 0.0, 1.0, 1.0, 0.9];
        let base = [
            true, false, false, false, false, true, false, true, false, false, true,
        ];
        let g = Groups::from_keys(&keys);
        assert_eq!(varied_groups(&g, &values, &none), [true; 4]);
        assert_eq!(
            varied_groups(&g, &values, &base),
            [false, false, true, false]
        );
    }

    fn batch(scores: &[f32], acc: Option<&[f32]>) -> Batch {
        use arrow_array::{ArrayRef, Float32Array};
        let mut fields = vec![schema::field(schema::SCORE)];
        let mut cols: Vec<ArrayRef> =
            vec![std::sync::Arc::new(Float32Array::from(scores.to_vec()))];
        if let Some(a) = acc {
            fields.push(schema::field("score_acc"));
            cols.push(std::sync::Arc::new(Float32Array::from(a.to_vec())));
        }
        let schema = std::sync::Arc::new(arrow_schema::Schema::new(fields));
        Batch {
            path: PathBuf::from("s.parquet"),
            data: RecordBatch::try_new(schema, cols).unwrap(),
            meta: Default::default(),
        }
    }

    #[test]
    fn metric_values_by_name() {
        let b = batch(&[1.0, 0.5, -0.25], None);
        assert_eq!(
            metric_values(&b, &FilterMetric::Score).unwrap(),
            [1.0, 0.5, -0.25]
        );
        // acc without a score_acc column: score >= 1.
        assert_eq!(
            metric_values(&b, &FilterMetric::Acc).unwrap(),
            [1.0, 0.0, 0.0]
        );
        let b = batch(&[0.75, 0.5, -0.25], Some(&[1.0, 1.0, 0.0]));
        assert_eq!(
            metric_values(&b, &FilterMetric::Acc).unwrap(),
            [1.0, 1.0, 0.0]
        );
        let col = FilterMetric::Column("score_acc".into());
        assert_eq!(metric_values(&b, &col).unwrap(), [1.0, 1.0, 0.0]);
        let err = metric_values(&b, &FilterMetric::Column("score_len".into())).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert_eq!(
            err.to_string(),
            "s.parquet: [algorithm] filter-metric = \"score_len\": the scored batch has no column 'score_len' (the reward returns no sub-score \"len\")"
        );
        let err = metric_values(&batch(&[0.0, f32::NAN], None), &FilterMetric::Score).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert_eq!(
            err.to_string(),
            "s.parquet: column 'score', row 1: value NaN is not finite"
        );
    }

    #[test]
    fn cursor_after_reads_the_records_of_dynamic_steps() {
        let dir = tempfile::tempdir().unwrap();
        let text = "steps = 3\n[model]\npath = \"m\"\n[data]\ntrain = \"t.parquet\"\nprompts-per-step = 4\n[score]\nreward = \"exact\"\n[advantage]\nestimator = \"grpo\"\n[algorithm]\nfilter-groups = true\n";
        let spec = super::super::spec::Spec::parse(text, "t.toml").unwrap();
        let run = RunDir::new(dir.path());
        let plan = Plan::new(spec, run.clone(), PathBuf::from("bin")).unwrap();
        let sampler = plan.sampler(10);
        let cursor_after = |step| cursor_after(&plan, 10, step);
        assert_eq!(cursor_after(0).unwrap(), Cursor::default());
        // Step 1 took three rounds of 4 prompts; step 2 has no record (a plain step).
        let after1 = Cursor {
            epoch: 1,
            position: 2,
        };
        let rec = Record {
            rounds: 3,
            groups: 4,
            capped: false,
            cursor: after1,
        };
        write_json(&record_path(&run, 1), &rec).unwrap();
        assert_eq!(cursor_after(1).unwrap(), after1);
        assert_eq!(cursor_after(2).unwrap(), sampler.draw(after1, 4).1);
        std::fs::write(record_path(&run, 1), "{").unwrap();
        let err = cursor_after(2).unwrap_err();
        assert!(
            format!("{err:#}").contains("not a dynamic sampling record"),
            "{err:#}"
        );
    }

    /// Two rounds' rollout metrics: counts and seconds add up, per-sample means are weighted by
    /// samples, rates by generation seconds, maxima are the largest, the rest is the last
    /// round's (hand-computed).
    #[test]
    fn rounds_rollout_metrics_merge_by_kind() {
        let a = json!({"samples": 100, "tool_calls": 30, "generation_seconds": 2.0,
            "turns_mean": 1.5, "generation_tokens_per_s": 1000.0, "response_length_max": 90,
            "policy_version": 4, "daemon": {"phase": "rollout", "seconds": 9.0}});
        let b = json!({"samples": 300, "tool_calls": 10, "generation_seconds": 6.0,
            "turns_mean": 2.5, "generation_tokens_per_s": 3000.0, "response_length_max": 70,
            "policy_version": 4, "daemon": {"phase": "rollout", "seconds": 1.0}});
        let m = merge_rounds(&[a.clone(), b.clone()]);
        assert_eq!(m["samples"], json!(400));
        assert_eq!(m["tool_calls"], json!(40));
        assert_eq!(m["generation_seconds"], json!(8.0));
        // (1.5 * 100 + 2.5 * 300) / 400
        assert_eq!(m["turns_mean"], json!(2.25));
        // (1000 * 2 + 3000 * 6) / 8: the tokens of both rounds over their seconds
        assert_eq!(m["generation_tokens_per_s"], json!(2500.0));
        assert_eq!(m["response_length_max"], json!(90));
        assert_eq!(m["policy_version"], json!(4));
        assert_eq!(m["daemon"], b["daemon"]);
        // One round is that round's metrics.
        assert_eq!(merge_rounds(std::slice::from_ref(&a)), a);
    }
}
