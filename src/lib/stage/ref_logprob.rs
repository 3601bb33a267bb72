//! `ref-logprob --model DIR --in B --out B2 --column ref_logprobs|old_logprobs`: the log-prob of
//! every response token under a model (the reference for a KL term, or the policy before an
//! off-policy update), optionally with per-token entropy.

use super::common::{
    above, at_least, check_token_ids, gather_results, logprob_temperature, my_block,
    negative_numbers, resolve_model, Device, ModelRef,
};
use super::{load_policy, load_value_model, Exec, Job};
use crate::backend::Backend;
use crate::bail_input;
use crate::batch::{list_array, schema, Batch, NewColumns, StageInfo};
use crate::engine::logprob::{score, PromptResponse};
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use crate::model::decoder::TokenStats;
use crate::model::Config;
use crate::parallel::exchange::{Reader, Writer};
use anyhow::Result;
use arrow_array::types::Float32Type;
use arrow_array::ArrayRef;
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Which column the log-probs go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobColumn {
    #[value(name = "ref_logprobs")]
    RefLogprobs,
    #[value(name = "old_logprobs")]
    OldLogprobs,
}

impl LogprobColumn {
    pub fn name(self) -> &'static str {
        match self {
            LogprobColumn::RefLogprobs => schema::REF_LOGPROBS,
            LogprobColumn::OldLogprobs => schema::OLD_LOGPROBS,
        }
    }
}

/// Name of the per-token entropy column `--entropy` adds.
pub(crate) const ENTROPY: &str = "entropy";

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[command(
    about = "Log-probs of the response tokens under a model (reference or old policy)",
    mut_args = negative_numbers
)]
pub struct RefLogprobArgs {
    /// Model directory (HF layout) or a pointer file written by sync-weights.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Input batch (needs prompt_ids and response_ids).
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Output batch: the input's columns plus the log-prob column.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Column to write: ref_logprobs (reference model, for a KL term) or old_logprobs (the
    /// policy before the update).
    #[arg(long, value_enum)]
    pub column: LogprobColumn,
    /// Log-probs under softmax(logits / T), T > 0 (default: the temperature `rollout` recorded
    /// in the batch, else 1); one that differs from the recorded one is refused.
    #[arg(long, value_name = "T", value_parser = above(0.0f32))]
    pub temperature: Option<f32>,
    /// Also write the per-token entropy (column `entropy`).
    #[arg(long)]
    pub entropy: bool,
    /// Tokens (prompt + response) per forward pass (>= 1).
    #[arg(long, default_value_t = 8192, value_parser = at_least(1usize))]
    pub micro_batch_tokens: usize,
    /// Where to compute: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Send the job to the warm daemon listening on this socket instead of loading the model
    /// here (default: $TANDEM_DAEMON).
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
}

/// What the rows are scored for: the log-probs of a reference or of the policy (the column
/// they go to), or a critic's values (`values`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scored {
    Logprobs(LogprobColumn),
    Values,
}

/// How a stage scores its batch's rows (`ref-logprob`, `values`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreSpec {
    pub(crate) scored: Scored,
    /// The log-probs' temperature (a value model ignores it).
    pub(crate) temperature: f32,
    pub(crate) entropy: bool,
    pub(crate) micro_batch_tokens: usize,
    /// The stage's name, on its progress bar.
    pub(crate) stage: &'static str,
}

/// Load the model and score the rows.
pub struct Score<'a> {
    dir: &'a Path,
    rows: &'a [PromptResponse<'a>],
    spec: ScoreSpec,
    bar: &'a ProgressBar,
}

impl Job for Score<'_> {
    type Out = Vec<TokenStats>;
    fn run<B: Backend>(self, backend: B) -> Result<Vec<TokenStats>> {
        let mut model = match self.spec.scored {
            Scored::Values => load_value_model(backend, self.dir)?,
            Scored::Logprobs(_) => load_policy(backend, self.dir)?,
        };
        self.score_on(&mut model)
    }
}

impl Score<'_> {
    /// What the rows are scored for (the daemon picks the reference, the policy or the
    /// critic by it).
    pub fn scored(&self) -> Scored {
        self.spec.scored
    }

    /// Scores with a model already loaded.
    pub(crate) fn score_on<B: Backend>(self, model: &mut Decoder<B>) -> Result<Vec<TokenStats>> {
        score(
            model,
            self.rows,
            self.spec.temperature,
            self.spec.entropy,
            self.spec.micro_batch_tokens,
            &mut |done| self.bar.set_position(done as u64),
        )
    }
}

/// The rows of `batch` (prompt_ids, response_ids) scored under `model` as `spec` says: this
/// process's block of prompt groups among several ranks, gathered on rank 0 (None on the
/// other ranks, which are done). One entry per row, in order.
pub(crate) fn score_batch(
    exec: &mut dyn Exec,
    batch: &Batch,
    model: &ModelRef,
    cfg: &Config,
    spec: ScoreSpec,
) -> Result<Option<Vec<TokenStats>>> {
    if cfg.value_head && spec.scored != Scored::Values {
        bail_input!(
            "--model {}: is a value model (a critic), which has no log-probs; the `values` stage reads it",
            model.dir.display()
        );
    }
    check_token_ids(batch, schema::PROMPT_IDS, cfg.vocab_size)?;
    check_token_ids(batch, schema::RESPONSE_IDS, cfg.vocab_size)?;
    let prompts = batch.ragged_i32(schema::PROMPT_IDS)?;
    let responses = batch.ragged_i32(schema::RESPONSE_IDS)?;
    let p32: Vec<Vec<u32>> = prompts.rows().map(to_u32).collect();
    let r32: Vec<Vec<u32>> = responses.rows().map(to_u32).collect();
    if let Some(row) = p32.iter().position(|p| p.is_empty()) {
        bail_input!(
            "{}, row {row}: prompt is empty (the first response token needs a context)",
            batch.at(schema::PROMPT_IDS)
        );
    }
    let rows: Vec<PromptResponse> = p32
        .iter()
        .zip(&r32)
        .map(|(p, r)| PromptResponse {
            prompt: p,
            response: r,
        })
        .collect();
    // This process's rows: all of them alone, its block of prompt groups among several ranks.
    let groups = prompt_groups(&p32);
    let mine = my_block(exec, groups.len() - 1);
    let mine = groups[mine.start]..groups[mine.end];
    let bar = exec.progress_bar(mine.len(), spec.stage);
    let job = Score {
        dir: &model.dir,
        rows: &rows[mine.clone()],
        spec,
        bar: &bar,
    };
    let stats = match mine.is_empty() {
        true => Vec::new(),
        false => exec.score(model, job)?,
    };
    bar.finish_and_clear();
    // Rank 0 gets every rank's rows, in order; the other ranks are done.
    let Some(parts) = gather_results(exec, stats, |s| encode_stats(s), decode_stats)? else {
        return Ok(None);
    };
    Ok(Some(parts.into_iter().flatten().collect()))
}

/// The per-token values of `stats` as a list<float32> column of `batch`'s responses.
pub(crate) fn token_column(batch: &Batch, values: impl Iterator<Item = f32>) -> Result<ArrayRef> {
    let responses = batch.ragged_i32(schema::RESPONSE_IDS)?;
    Ok(list_array::<Float32Type>(
        &responses.offsets,
        values.collect(),
    ))
}

impl RefLogprobArgs {
    /// Checks the flags as the stage does before reading its input.
    /// (Each flag's range is checked by its parser; no two flags constrain each other.)
    pub fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// The stage with its compute on `exec`.
pub fn run(args: RefLogprobArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    args.check()?;
    super::common::refuse_in_place(&args.input, &args.out, "out")?;
    let batch = Batch::read(&args.input, &[schema::PROMPT_IDS, schema::RESPONSE_IDS])?;
    batch.require_rows()?;
    let temperature = logprob_temperature(&batch, args.temperature)?;
    let model = resolve_model(&args.model)?;
    let cfg = ModelDir::load_config(&model.dir)?;
    let spec = ScoreSpec {
        scored: Scored::Logprobs(args.column),
        temperature,
        entropy: args.entropy,
        micro_batch_tokens: args.micro_batch_tokens,
        stage: "ref-logprob",
    };
    let Some(stats) = score_batch(exec, &batch, &model, &cfg, spec)? else {
        return Ok(());
    };
    let mut cols = NewColumns::new();
    let lp = stats.iter().flat_map(|s| s.logprobs.iter().copied());
    cols.add(args.column.name(), token_column(&batch, lp)?);
    if args.entropy {
        let ent = stats
            .iter()
            .flat_map(|s| s.entropy.iter().flatten().copied());
        cols.add(ENTROPY, token_column(&batch, ent)?);
    }
    let rows = stats.len();
    let tokens: usize = stats.iter().map(|s| s.logprobs.len()).sum();
    let info = StageInfo {
        stage: "ref-logprob",
        params: json!({
            "model": model.dir.display().to_string(),
            "model_policy_version": model.policy_version,
            "column": args.column.name(),
            "temperature": temperature,
            "entropy": args.entropy,
            "micro_batch_tokens": args.micro_batch_tokens,
            "device": args.device.to_string(),
            "architecture": cfg.arch.hf_architecture(),
        }),
        policy_version: None,
        step: None,
    };
    batch.write_derived(&args.out, cols, &info)?;
    exec.log(&format!(
        "ref-logprob: {rows} rows, {tokens} response tokens -> {} in {:.2}s",
        args.out.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Where each run of rows with the same prompt starts, and the end: `[0, .., rows]`.
fn prompt_groups(prompts: &[Vec<u32>]) -> Vec<usize> {
    let mut starts: Vec<usize> = (0..prompts.len())
        .filter(|&i| i == 0 || prompts[i] != prompts[i - 1])
        .collect();
    starts.push(prompts.len());
    starts
}

fn encode_stats(stats: &[TokenStats]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(stats.len() as u64);
    for s in stats {
        w.f32s(&s.logprobs);
        match &s.entropy {
            Some(e) => w.u64(1).f32s(e),
            None => w.u64(0),
        };
    }
    w.finish()
}

fn decode_stats(bytes: &[u8]) -> Result<Vec<TokenStats>> {
    let mut r = Reader::new(bytes);
    (0..r.u64()?)
        .map(|_| {
            Ok(TokenStats {
                logprobs: r.f32s()?,
                entropy: match r.u64()? {
                    1 => Some(r.f32s()?),
                    _ => None,
                },
            })
        })
        .collect()
}

pub(crate) fn to_u32(row: &[i32]) -> Vec<u32> {
    row.iter().map(|&t| t as u32).collect()
}
