//! `tandem sft-batch`: a batch of reference answers (prompt + ground truth + EOS) in the batch
//! contract, for `update --loss sft` warm starts. Prompts are tokenized exactly as `rollout`
//! does, so the warm-started model sees the same inputs it will be sampled on.

use super::common::{at_least, negative_numbers, resolve_model};
use super::rollout::{log_left_out, sequence_columns, tokenize_prompts, PromptLimits, Truncate};
use crate::bail_input;
use crate::batch::schema;
use crate::batch::{write_file, StageInfo};
use crate::data::{ChatTemplate, PromptDataset};
use crate::model::checkpoint::ModelDir;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{Field, Schema};
use clap::Args;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug, Clone)]
#[command(
    about = "Make a batch of reference answers for `update --loss sft`",
    mut_args = negative_numbers
)]
pub struct SftBatchArgs {
    /// Model directory (or sync-weights pointer): its tokenizer, chat template and EOS.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Prompt dataset with ground truths (ours or verl's parquet); every column is carried.
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Output batch.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Use the prompt text as is instead of rendering the chat template.
    #[arg(long)]
    pub raw_prompt: bool,
    /// The dataset's prompt column.
    #[arg(long, default_value = "prompt", value_name = "COLUMN")]
    pub prompt_key: String,
    /// Longest prompt after the chat template, in tokens (>= 1); see --truncate.
    #[arg(long, default_value_t = 512, value_parser = at_least(1usize))]
    pub max_prompt_tokens: usize,
    /// Prompts over --max-prompt-tokens: `left` keeps their end, `error` stops.
    #[arg(long, value_enum, default_value_t = Truncate::Error)]
    pub truncate: Truncate,
    /// Only the first N prompts (>= 1).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    pub limit: Option<usize>,
}

pub fn run(args: SftBatchArgs) -> Result<()> {
    super::common::refuse_in_place(&args.input, &args.out, "out")?;
    let dataset = PromptDataset::open_with_key(&args.input, &args.prompt_key)?;
    let n = args.limit.unwrap_or(dataset.len()).min(dataset.len());
    if n == 0 {
        bail_input!("{}: no prompts", args.input.display());
    }
    log_left_out(&dataset, "sft-batch", &mut |m| eprintln!("{m}"));
    let model = resolve_model(&args.model)?;
    let cfg = ModelDir::load_config(&model.dir)?;
    let tokenizer = Tokenizer::from_dir(&model.dir)?;
    let template = if args.raw_prompt {
        None
    } else {
        Some(ChatTemplate::from_dir(&model.dir)?)
    };
    let limits = PromptLimits {
        prompt_key: &args.prompt_key,
        max_prompt_tokens: args.max_prompt_tokens,
        truncate: args.truncate,
        tools: &[],
    };
    let (prompts, _) = tokenize_prompts(
        &dataset,
        n,
        &tokenizer,
        template.as_ref(),
        cfg.vocab_size,
        &limits,
    )?;
    let Some(&eos) = cfg.eos_token_ids.first() else {
        bail_input!(
            "{}: the model has no EOS token id (config.json / generation_config.json)",
            model.dir.display()
        );
    };

    let (mut p_off, mut p_ids) = (vec![0usize], Vec::new());
    let (mut r_off, mut r_ids) = (vec![0usize], Vec::new());
    let mut texts = Vec::with_capacity(n);
    for (i, prompt) in prompts.iter().enumerate() {
        let Some(answer) = dataset.row(i).ground_truth.as_deref() else {
            bail_input!(
                "{}, row {i}: no ground truth to train on",
                dataset.batch().at(schema::GROUND_TRUTH)
            );
        };
        let mut ids = tokenizer.encode_with_special(answer, false)?;
        ids.push(eos);
        p_ids.extend(prompt.iter().map(|&t| t as i32));
        p_off.push(p_ids.len());
        r_ids.extend(ids.iter().map(|&t| t as i32));
        r_off.push(r_ids.len());
        texts.push(answer.to_string());
    }
    let uids: Vec<String> = (0..n).map(|i| format!("sft-{i}")).collect();
    let tokens = r_ids.len();
    let cols = sequence_columns(
        uids.clone(),
        uids,
        dataset.take_columns(&(0..n).collect::<Vec<_>>())?,
        (&p_off, p_ids),
        (&r_off, r_ids, None),
        texts,
    );
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?;
    let info = StageInfo {
        stage: "sft-batch",
        params: json!({"model": model.dir.display().to_string(), "raw_prompt": args.raw_prompt}),
        policy_version: None,
        step: None,
    };
    write_file(
        &args.out,
        &data,
        &crate::batch::stage_meta(BTreeMap::new(), &info),
    )?;
    eprintln!(
        "sft-batch: {n} rows, {tokens} response tokens -> {}",
        args.out.display()
    );
    Ok(())
}
