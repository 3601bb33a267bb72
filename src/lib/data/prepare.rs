//! `tandem prepare`: import a dataset into verl's prompt parquet schema.

use super::jsonl::JsonlOptions;
use super::VerlRow;
use crate::bail_input;
use crate::batch::{stage_meta, write_file, StageInfo};
use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(about = "Import a dataset as a prompt parquet file in verl's schema")]
pub struct PrepareArgs {
    #[command(subcommand)]
    pub(crate) dataset: PrepareCmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum PrepareCmd {
    /// GSM8K jsonl (`{"question", "answer"}` per line) -> verl's GSM8K parquet.
    Gsm8k(Gsm8kArgs),
    /// Any jsonl with a prompt and an answer per line -> verl's prompt parquet.
    Jsonl(JsonlArgs),
    /// A built-in synthetic task (add, copy, reverse) whose answers a rule checks.
    Synth(super::synth::SynthArgs),
}

#[derive(Args, Debug)]
pub(crate) struct Gsm8kArgs {
    /// The openai/gsm8k jsonl file (e.g. ../shared/data/gsm8k/train.jsonl).
    #[arg(long = "in")]
    pub(crate) input: PathBuf,
    /// Output parquet file.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Split recorded in extra_info.split [default: the input's file stem when it is train or
    /// test].
    #[arg(long, value_parser = ["train", "test"])]
    pub(crate) split: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct JsonlArgs {
    /// Input jsonl file, one JSON object per line.
    #[arg(long = "in")]
    pub(crate) input: PathBuf,
    /// Output parquet file.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Key of the prompt: a string or a list of {role, content} messages (`a.b` for nested).
    #[arg(long)]
    pub(crate) prompt_key: String,
    /// Key of the reference answer, stored as reward_model.ground_truth (`a.b` for nested).
    #[arg(long)]
    pub(crate) answer_key: String,
    /// data_source of every row [default: the input's file stem].
    #[arg(long)]
    pub(crate) data_source: Option<String>,
    /// Split recorded in extra_info.split.
    #[arg(long, default_value = "train")]
    pub(crate) split: String,
    /// Value of the `ability` column (left null when not given).
    #[arg(long)]
    pub(crate) ability: Option<String>,
    /// System message put before each text prompt.
    #[arg(long)]
    pub(crate) system: Option<String>,
    /// Instruction appended to each text prompt after one space.
    #[arg(long)]
    pub(crate) instruction: Option<String>,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    match args.dataset {
        PrepareCmd::Gsm8k(a) => {
            let split = match a.split {
                Some(s) => s,
                None => match file_stem(&a.input).as_str() {
                    s @ ("train" | "test") => s.to_string(),
                    _ => bail_input!(
                        "{}: cannot tell the split from the file name: pass --split train|test",
                        a.input.display()
                    ),
                },
            };
            let rows = super::gsm8k::read(&a.input, &split)?;
            let params = json!({"dataset": "gsm8k", "in": a.input, "split": split});
            write_rows(&a.out, &rows, params)
        }
        PrepareCmd::Synth(a) => super::synth::run(a),
        PrepareCmd::Jsonl(a) => {
            let opts = JsonlOptions {
                data_source: a.data_source.unwrap_or_else(|| file_stem(&a.input)),
                prompt_key: a.prompt_key,
                answer_key: a.answer_key,
                split: a.split,
                ability: a.ability,
                system: a.system,
                instruction: a.instruction,
            };
            let (rows, kwargs) = super::jsonl::read(&a.input, &opts)?;
            let params = json!({
                "dataset": "jsonl", "in": a.input, "prompt_key": opts.prompt_key,
                "answer_key": opts.answer_key, "data_source": opts.data_source,
                "split": opts.split, "ability": opts.ability, "system": opts.system,
                "instruction": opts.instruction,
            });
            write_rows_with_kwargs(&a.out, &rows, &kwargs, params)
        }
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn write_rows(out: &Path, rows: &[VerlRow], params: serde_json::Value) -> Result<()> {
    write_rows_with_kwargs(out, rows, &[], params)
}

/// [`write_rows`] with the rows' tool arguments as a `tools_kwargs` column of JSON text, when
/// any row has some (verl's struct would need one shape for every row's arguments).
fn write_rows_with_kwargs(
    out: &Path,
    rows: &[VerlRow],
    kwargs: &[Option<serde_json::Value>],
    params: serde_json::Value,
) -> Result<()> {
    let mut data = super::verl_record_batch(rows)?;
    if kwargs.iter().any(Option::is_some) {
        let text: arrow_array::StringArray = kwargs
            .iter()
            .map(|k| k.as_ref().map(|v| v.to_string()))
            .collect();
        let mut fields: Vec<_> = data.schema().fields().iter().cloned().collect();
        fields.push(std::sync::Arc::new(arrow_schema::Field::new(
            super::tools_kwargs::COLUMN,
            arrow_schema::DataType::Utf8,
            true,
        )));
        let mut columns = data.columns().to_vec();
        columns.push(std::sync::Arc::new(text));
        let schema = arrow_schema::Schema::new(fields);
        data = arrow_array::RecordBatch::try_new(std::sync::Arc::new(schema), columns)?;
    }
    let meta = stage_meta(
        BTreeMap::new(),
        &StageInfo {
            stage: "prepare",
            params,
            policy_version: None,
            step: None,
        },
    );
    write_file(out, &data, &meta)?;
    eprintln!("prepare: wrote {} rows to {}", rows.len(), out.display());
    Ok(())
}
