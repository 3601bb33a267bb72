//! `values --model DIR --in B --out B2`: a critic's value of every response token (column
//! `values`), which `advantage --estimator gae` reads. The value of response token t is the
//! critic's output at the position before it (the last prompt token for the first one), as
//! verl's critic takes `values[:, -response_length-1:-1]`. DIR is a critic checkpoint (HF's
//! token classifier with one label, as `update --critic` writes), or a policy's model, whose
//! critic starts with a zero value head: every value 0. A token whose `response_mask` is 0 (an
//! observation) has value 0, as verl masks its critic's values.

use super::common::{at_least, negative_numbers, resolve_model, Device};
use super::ref_logprob::{score_batch, token_column, ScoreSpec, Scored};
use super::Exec;
use crate::batch::{schema, Batch, NewColumns, StageInfo};
use crate::model::checkpoint::ModelDir;
use anyhow::Result;
use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[command(
    about = "A critic's value of every response token (column `values`, for GAE)",
    mut_args = negative_numbers
)]
pub struct ValuesArgs {
    /// The critic: a value model's directory (HF token classifier, one label), or a policy's
    /// model directory or pointer file (a critic from it with a zero value head).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Input batch (needs prompt_ids and response_ids).
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Output batch: the input's columns plus `values`.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Tokens (prompt + response) per forward pass (>= 1).
    #[arg(long, default_value_t = 8192, value_parser = at_least(1usize))]
    pub micro_batch_tokens: usize,
    /// Where to compute: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Send the job to the warm daemon listening on this socket, which keeps the critic
    /// between steps, instead of loading it here (default: $TANDEM_DAEMON).
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
}

impl ValuesArgs {
    /// Checks the flags as the stage does before reading its input.
    /// (Each flag's range is checked by its parser; no two flags constrain each other.)
    pub fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// The stage with its compute on `exec`.
pub fn run(args: ValuesArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    args.check()?;
    super::common::refuse_in_place(&args.input, &args.out, "out")?;
    let batch = Batch::read(&args.input, &[schema::PROMPT_IDS, schema::RESPONSE_IDS])?;
    batch.require_rows()?;
    let model = resolve_model(&args.model)?;
    let cfg = ModelDir::load_config(&model.dir)?;
    let spec = ScoreSpec {
        scored: Scored::Values,
        temperature: 1.0,
        entropy: false,
        micro_batch_tokens: args.micro_batch_tokens,
        stage: "values",
    };
    let Some(stats) = score_batch(exec, &batch, &model, &cfg, spec)? else {
        return Ok(());
    };
    let mut values: Vec<f32> = stats
        .iter()
        .flat_map(|s| s.logprobs.iter().copied())
        .collect();
    // Only model tokens have values (verl's `values * response_mask`): an observation token's
    // is 0.
    if batch.has(schema::RESPONSE_MASK) {
        let mask = batch.ragged_u8(schema::RESPONSE_MASK)?;
        anyhow::ensure!(
            mask.values.len() == values.len(),
            "response_mask is not aligned"
        );
        for (v, &m) in values.iter_mut().zip(mask.values.iter()) {
            if m == 0 {
                *v = 0.0;
            }
        }
    }
    let (tokens, mean) = (values.len(), mean(&values));
    let mut cols = NewColumns::new();
    cols.add(schema::VALUES, token_column(&batch, values.into_iter())?);
    let info = StageInfo {
        stage: "values",
        params: json!({
            "model": model.dir.display().to_string(),
            "critic_from_policy": !cfg.value_head,
            "micro_batch_tokens": args.micro_batch_tokens,
            "device": args.device.to_string(),
            "architecture": cfg.arch.hf_value_architecture(),
        }),
        policy_version: None,
        step: None,
    };
    batch.write_derived(&args.out, cols, &info)?;
    exec.log(&format!(
        "values: {} rows, {tokens} response tokens (mean value {mean:.4}) -> {} in {:.2}s",
        stats.len(),
        args.out.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn mean(v: &[f32]) -> f64 {
    match v.len() {
        0 => 0.0,
        n => v.iter().map(|&x| x as f64).sum::<f64>() / n as f64,
    }
}
