//! Prompt datasets and chat templates (the tokenizer is `crate::tokenizer`).
//!
//! - `prepare`: the `tandem prepare gsm8k|jsonl` imports, writing verl's prompt schema
//!   (`gsm8k`, `jsonl` hold the per-format parsing).
//! - `dataset`: [`PromptDataset`] reads a prompt file (ours, verl's, or a jsonl of prompts) for
//!   `rollout`.
//! - `chat`: `tokenizer_config.json`'s chat template rendered with minijinja the way HF
//!   transformers' `apply_chat_template` does.

pub mod chat;
pub mod dataset;
pub(crate) mod gsm8k;
pub(crate) mod jsonl;
pub mod prepare;
pub(crate) mod synth;
pub mod tools_kwargs;

pub(crate) use chat::ChatTemplate;
pub use dataset::{PromptDataset, PromptRow};

use arrow_array::builder::{Int64Builder, ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Fields, Schema};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// One chat message, as in HF `messages` and verl's `prompt` column.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub(crate) role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// One row of a prepared prompt dataset in verl's schema.
#[derive(Clone, Debug, PartialEq)]
pub struct VerlRow {
    pub data_source: String,
    pub prompt: Vec<Message>,
    pub ability: Option<String>,
    pub ground_truth: String,
    pub extra_info: ExtraInfo,
}

/// verl's `extra_info` struct as its GSM8K script writes it.
#[derive(Clone, Debug, PartialEq)]
pub struct ExtraInfo {
    pub split: String,
    pub index: i64,
    pub answer: String,
    pub question: String,
}

/// Field names of verl's nested columns, in the order verl's script creates them (pyarrow
/// keeps dict insertion order when it infers a struct).
pub(crate) const MESSAGE_FIELDS: [&str; 2] = ["role", "content"];
pub(crate) const REWARD_MODEL_FIELDS: [&str; 2] = ["style", "ground_truth"];
pub(crate) const EXTRA_INFO_FIELDS: [&str; 4] = ["split", "index", "answer", "question"];
/// verl's `reward_model.style` for answers checked by a rule (all of tandem's imports).
pub(crate) const STYLE_RULE: &str = "rule";

fn utf8_fields(names: &[&str]) -> Fields {
    names
        .iter()
        .map(|n| Field::new(*n, DataType::Utf8, true))
        .collect()
}

fn extra_info_fields() -> Fields {
    Fields::from(vec![
        Field::new(EXTRA_INFO_FIELDS[0], DataType::Utf8, true),
        Field::new(EXTRA_INFO_FIELDS[1], DataType::Int64, true),
        Field::new(EXTRA_INFO_FIELDS[2], DataType::Utf8, true),
        Field::new(EXTRA_INFO_FIELDS[3], DataType::Utf8, true),
    ])
}

/// The Arrow schema verl's GSM8K preprocessing produces: `data_source`, `prompt`
/// list<struct<role, content>>, `ability`, `reward_model` struct<style, ground_truth>,
/// `extra_info` struct<split, index: int64, answer, question>. Every field nullable, as pyarrow
/// writes them.
pub(crate) fn verl_schema() -> Schema {
    use crate::batch::schema as col;
    let message = DataType::Struct(utf8_fields(&MESSAGE_FIELDS));
    Schema::new(vec![
        Field::new(col::DATA_SOURCE, DataType::Utf8, true),
        Field::new(
            col::PROMPT,
            DataType::List(Arc::new(Field::new_list_field(message, true))),
            true,
        ),
        Field::new("ability", DataType::Utf8, true),
        Field::new(
            col::REWARD_MODEL,
            DataType::Struct(utf8_fields(&REWARD_MODEL_FIELDS)),
            true,
        ),
        Field::new(col::EXTRA_INFO, DataType::Struct(extra_info_fields()), true),
    ])
}

/// Rows in verl's schema as one record batch.
pub fn verl_record_batch(rows: &[VerlRow]) -> anyhow::Result<RecordBatch> {
    let schema = Arc::new(verl_schema());
    let mut data_source = StringBuilder::new();
    let message_fields = utf8_fields(&MESSAGE_FIELDS);
    let mut prompt = ListBuilder::new(StructBuilder::from_fields(message_fields.clone(), 0))
        .with_field(Arc::new(Field::new_list_field(
            DataType::Struct(message_fields),
            true,
        )));
    let mut ability = StringBuilder::new();
    let mut reward_model = StructBuilder::from_fields(utf8_fields(&REWARD_MODEL_FIELDS), 0);
    let mut extra_info = StructBuilder::from_fields(extra_info_fields(), 0);
    for row in rows {
        data_source.append_value(&row.data_source);
        let messages = prompt.values();
        for m in &row.prompt {
            string_field(messages, 0).append_value(&m.role);
            string_field(messages, 1).append_value(&m.content);
            messages.append(true);
        }
        prompt.append(true);
        ability.append_option(row.ability.as_deref());
        string_field(&mut reward_model, 0).append_value(STYLE_RULE);
        string_field(&mut reward_model, 1).append_value(&row.ground_truth);
        reward_model.append(true);
        let e = &row.extra_info;
        string_field(&mut extra_info, 0).append_value(&e.split);
        extra_info
            .field_builder::<Int64Builder>(1)
            .expect("extra_info.index is int64")
            .append_value(e.index);
        string_field(&mut extra_info, 2).append_value(&e.answer);
        string_field(&mut extra_info, 3).append_value(&e.question);
        extra_info.append(true);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(data_source.finish()),
        Arc::new(prompt.finish()),
        Arc::new(ability.finish()),
        Arc::new(reward_model.finish()),
        Arc::new(extra_info.finish()),
    ];
    Ok(RecordBatch::try_new(schema, columns)?)
}

fn string_field(b: &mut StructBuilder, i: usize) -> &mut StringBuilder {
    b.field_builder::<StringBuilder>(i)
        .expect("struct field built as utf8")
}

/// Lines of a jsonl file with their 1-based line numbers, blank lines skipped. Unreadable
/// files and invalid UTF-8 are input errors naming the file (and line).
pub(crate) fn jsonl_lines(path: &std::path::Path) -> anyhow::Result<Vec<(usize, String)>> {
    use std::io::BufRead;
    let shown = path.display();
    let file = std::fs::File::open(path)
        .map_err(|e| crate::error::input_error(format!("{shown}: cannot open: {e}")))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| {
            crate::error::input_error(format!("{shown}:{}: cannot read: {e}", i + 1))
        })?;
        if !line.trim().is_empty() {
            out.push((i + 1, line));
        }
    }
    Ok(out)
}

/// Parse one jsonl line as a JSON object, or an input error naming file and line.
pub(crate) fn parse_object(
    path: &std::path::Path,
    line_no: usize,
    line: &str,
) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let shown = path.display();
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(other) => crate::bail_input!(
            "{shown}:{line_no}: expected a JSON object, found {}",
            json_kind(&other)
        ),
        Err(e) => crate::bail_input!("{shown}:{line_no}: not valid JSON: {e}"),
    }
}

/// "a string", "a number"... for messages about JSON values.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
