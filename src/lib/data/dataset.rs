//! Reading a prompt dataset for `rollout`: a parquet file in verl's schema, written by
//! `tandem prepare` or by verl's own preprocessing scripts (pandas / HF datasets), or any parquet
//! with a `prompt` column of text or chat messages.

use super::jsonl::messages_from_json;
use super::{ChatTemplate, Message};
use crate::bail_input;
use crate::batch::json::{value, value_text};
use crate::batch::{schema, Batch};
use crate::error::input_error;
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, StringArray, UInt32Array};
use arrow_schema::{DataType, Field};
use std::path::Path;
use std::sync::Arc;

/// One prompt: what rollout renders and what it copies into its output.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptRow {
    pub data_source: String,
    /// The chat messages; a plain-text prompt is one user message.
    pub messages: Vec<Message>,
    /// The prompt as given when the column holds plain text (used as is by `--raw-prompt`).
    pub(crate) text: Option<String>,
    /// `ground_truth`, or verl's `reward_model.ground_truth` (non-strings as JSON text); None
    /// when the dataset has neither or the cell is null.
    pub ground_truth: Option<String>,
    /// `extra_info` as JSON (null when the dataset has none).
    pub extra_info: serde_json::Value,
}

/// A prompt dataset in memory: the parsed rows plus the original Arrow columns, so that the
/// columns rollout copies keep the dataset's exact types.
pub struct PromptDataset {
    batch: Batch,
    prompt_key: String,
    rows: Vec<PromptRow>,
}

impl PromptDataset {
    /// Open a prompt parquet whose prompt column is `prompt` (verl's default `data.prompt_key`).
    pub fn open(path: &Path) -> Result<PromptDataset> {
        Self::open_with_key(path, schema::PROMPT)
    }

    /// Open a prompt parquet whose prompt is in column `prompt_key`.
    pub(crate) fn open_with_key(path: &Path, prompt_key: &str) -> Result<PromptDataset> {
        let is_json = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("jsonl" | "json")
        );
        if is_json && path.exists() {
            bail_input!(
                "{}: prompt datasets are parquet files; import this one first with `tandem prepare jsonl --in {} --out FILE.parquet --prompt-key KEY --answer-key KEY`",
                path.display(),
                path.display()
            );
        }
        let batch = Batch::read(path, &[prompt_key])?;
        let rows = parse_rows(&batch, prompt_key)?;
        if rows.is_empty() {
            bail_input!("{}: the dataset has no rows", path.display());
        }
        Ok(PromptDataset {
            batch,
            prompt_key: prompt_key.to_string(),
            rows,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.batch.path
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn rows(&self) -> &[PromptRow] {
        &self.rows
    }

    pub fn row(&self, i: usize) -> &PromptRow {
        &self.rows[i]
    }

    /// The file's columns and metadata as read.
    pub(crate) fn batch(&self) -> &Batch {
        &self.batch
    }

    /// Whether the dataset carries reference answers.
    pub(crate) fn has_ground_truth(&self) -> bool {
        has_ground_truth(&self.batch)
    }

    /// Each row's tool arguments (verl's `tools_kwargs`, [`super::tools_kwargs::parse`]): the
    /// `tools_kwargs` column when the dataset has one, else `extra_info.tools_kwargs`. A
    /// malformed value is an input error naming the file, the column and the row.
    pub(crate) fn tools_kwargs(&self) -> Result<Vec<Option<serde_json::Value>>> {
        use super::tools_kwargs::{parse, COLUMN};
        let (column, values): (&str, Vec<serde_json::Value>) = match self.batch.has(COLUMN) {
            true => (COLUMN, self.batch.json_rows(COLUMN)),
            false => (
                schema::EXTRA_INFO,
                self.rows
                    .iter()
                    .map(|r| r.extra_info.get(COLUMN).cloned().unwrap_or_default())
                    .collect(),
            ),
        };
        let inner = if column == COLUMN {
            ""
        } else {
            " tools_kwargs"
        };
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                parse(v).map_err(|e| {
                    input_error(format!("{}, row {i}:{inner} {e}", self.batch.at(column)))
                })
            })
            .collect()
    }

    /// The text `--raw-prompt` feeds the model as is: a plain-text prompt, or the content of a
    /// chat prompt made of a single message.
    pub(crate) fn raw_prompt(&self, i: usize) -> Result<&str> {
        let row = &self.rows[i];
        match (&row.text, row.messages.as_slice()) {
            (Some(t), _) => Ok(t),
            (None, [only]) => Ok(&only.content),
            (None, msgs) => bail_input!(
                "{}, row {i}: --raw-prompt needs a text prompt or a single message, this one has {} messages (drop --raw-prompt to render it with the chat template)",
                self.batch.at(&self.prompt_key),
                msgs.len()
            ),
        }
    }

    /// The text rollout tokenizes for row `i`: the chat messages rendered by `template` with the
    /// generation prompt (`apply_chat_template(add_generation_prompt=True)`), or with no template
    /// (`--raw-prompt`) the prompt as is.
    /// The text rollout tokenizes for row `i`: the chat messages rendered by `template` with the
    /// generation prompt (`apply_chat_template(add_generation_prompt=True)`) and `tools` (their
    /// schemas, transformers' `tools=`), or with no template (`--raw-prompt`) the prompt as is.
    /// Puts a system message with `system` before the messages of every row that starts with
    /// none (rollout's `--system-prompt`); None leaves the rows as they are.
    pub(crate) fn with_system(mut self, system: Option<&str>) -> PromptDataset {
        if let Some(system) = system {
            for row in &mut self.rows {
                if row.messages.first().is_none_or(|m| m.role != "system") {
                    row.messages.insert(0, Message::new("system", system));
                }
            }
        }
        self
    }

    pub(crate) fn prompt_text(
        &self,
        i: usize,
        template: Option<&ChatTemplate>,
        tools: &[serde_json::Value],
    ) -> Result<String> {
        match template {
            Some(t) => t.render_tools(&self.rows[i].messages, true, &Default::default(), tools),
            None => self.raw_prompt(i).map(str::to_string),
        }
    }

    /// The dataset columns an output batch carries, for the given dataset rows (one entry per
    /// output row, e.g. each prompt's index repeated n times; see [`repeat_each`]): every
    /// column of the dataset, with its own type, except those the stages write for each
    /// response ([`PromptDataset::left_out_columns`]). First `data_source` (utf8; the file's
    /// stem when the dataset has none), `prompt` (the prompt column, under that name also when
    /// `--prompt-key` names another one and the dataset has no `prompt`), `ground_truth` (the
    /// dataset's own column, or utf8 text of verl's `reward_model.ground_truth`, which is kept
    /// as well), then the others (`ability`, `reward_model`, `extra_info`, any custom column)
    /// in the dataset's order.
    pub fn take_columns(&self, indices: &[usize]) -> Result<Vec<(Field, ArrayRef)>> {
        let n = self.rows.len();
        if let Some(&bad) = indices.iter().find(|&&i| i >= n) {
            anyhow::bail!("row index {bad} out of range for a dataset of {n} rows");
        }
        let idx = UInt32Array::from_iter_values(indices.iter().map(|&i| i as u32));
        let take = |col: &ArrayRef| arrow_select::take::take(col.as_ref(), &idx, None);
        let data = &self.batch.data;
        let mut out = Vec::new();
        let sources = StringArray::from_iter_values(
            indices.iter().map(|&i| self.rows[i].data_source.as_str()),
        );
        out.push((
            schema::field(schema::DATA_SOURCE),
            Arc::new(sources) as ArrayRef,
        ));
        let prompt_as = match self.batch.has(schema::PROMPT) {
            true => schema::PROMPT,
            false => self.prompt_key.as_str(),
        };
        let prompt = self.batch.column(prompt_as)?;
        out.push((
            Field::new(schema::PROMPT, prompt.data_type().clone(), true),
            take(prompt)?,
        ));
        match data.column_by_name(schema::GROUND_TRUTH) {
            Some(gt) => out.push((
                Field::new(schema::GROUND_TRUTH, gt.data_type().clone(), true),
                take(gt)?,
            )),
            None if self.has_ground_truth() => {
                let gts: StringArray = indices
                    .iter()
                    .map(|&i| self.rows[i].ground_truth.as_deref())
                    .collect();
                out.push((
                    Field::new(schema::GROUND_TRUTH, DataType::Utf8, true),
                    Arc::new(gts),
                ));
            }
            None => {}
        }
        let skip = self.left_out_columns();
        for (field, col) in data.schema().fields().iter().zip(data.columns()) {
            let name = field.name().as_str();
            let placed = [schema::DATA_SOURCE, schema::PROMPT, schema::GROUND_TRUTH];
            if placed.contains(&name) || skip.contains(&name) {
                continue;
            }
            out.push((
                Field::new(name, field.data_type().clone(), true)
                    .with_metadata(field.metadata().clone()),
                take(col)?,
            ));
        }
        Ok(out)
    }

    /// Dataset columns that [`PromptDataset::take_columns`] leaves out: those named like a
    /// column the stages write for each response (`uid`, `response_ids`, `score`,
    /// `advantages`, `*_logprobs`, ...), which would describe responses other than the new ones
    /// (the stage writes its own under that name).
    pub(crate) fn left_out_columns(&self) -> Vec<&str> {
        self.batch
            .data
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .filter(|&name| name != schema::DATA_SOURCE && schema::kind_of(name).is_some())
            .collect()
    }
}

/// `rows` with each entry repeated `n` times in place: [0, 1] with n = 2 gives [0, 0, 1, 1],
/// the layout of rollout's output (the n samples of a prompt side by side).
pub fn repeat_each(rows: &[usize], n: usize) -> Vec<usize> {
    rows.iter()
        .flat_map(|&r| std::iter::repeat_n(r, n))
        .collect()
}

fn has_ground_truth(batch: &Batch) -> bool {
    batch.has(schema::GROUND_TRUTH) || reward_model_ground_truth(batch).is_some()
}

fn reward_model_ground_truth(batch: &Batch) -> Option<&ArrayRef> {
    let rm = batch.data.column_by_name(schema::REWARD_MODEL)?;
    match rm.data_type() {
        DataType::Struct(_) => rm.as_struct().column_by_name("ground_truth"),
        _ => None,
    }
}

fn parse_rows(batch: &Batch, prompt_key: &str) -> Result<Vec<PromptRow>> {
    let n = batch.num_rows();
    let sources: Vec<String> = if batch.has(schema::DATA_SOURCE) {
        batch
            .strings(schema::DATA_SOURCE)?
            .into_iter()
            .map(str::to_string)
            .collect()
    } else {
        // Without a data_source every row gets the file's stem, so per-source metrics still
        // have a name to group by.
        let stem = batch
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        vec![stem; n]
    };
    let gt_col: Option<&ArrayRef> = match batch.data.column_by_name(schema::GROUND_TRUTH) {
        Some(c) => Some(c),
        None => reward_model_ground_truth(batch),
    };
    let extra = batch.json_rows(schema::EXTRA_INFO);
    let prompt = batch.column(prompt_key)?;
    let mut rows = Vec::with_capacity(n);
    for (i, (data_source, extra_info)) in sources.into_iter().zip(extra).enumerate() {
        let at = || format!("{}, row {i}", batch.at(prompt_key));
        let (messages, text) = match value(prompt.as_ref(), i) {
            serde_json::Value::String(t) => (vec![Message::new("user", t.as_str())], Some(t)),
            serde_json::Value::Array(items) => (
                messages_from_json(&items).map_err(|e| input_error(format!("{}: {e}", at())))?,
                None,
            ),
            serde_json::Value::Null => bail_input!("{}: prompt is null", at()),
            _ => bail_input!(
                "{}: expected text or a list of {{role, content}} messages, found {}",
                batch.at(prompt_key),
                prompt.data_type()
            ),
        };
        let ground_truth = gt_col
            .filter(|c| !c.is_null(i))
            .map(|c| value_text(c.as_ref(), i));
        rows.push(PromptRow {
            data_source,
            messages,
            text,
            ground_truth,
            extra_info,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{verl_record_batch, ExtraInfo, VerlRow};
    use arrow_array::RecordBatch;
    use arrow_schema::Schema;
    use std::collections::BTreeMap;

    fn verl_rows() -> Vec<VerlRow> {
        (0..3)
            .map(|i| VerlRow {
                data_source: format!("src{i}"),
                prompt: vec![
                    Message::new("system", "sys"),
                    Message::new("user", format!("question {i}")),
                ],
                ability: Some("math".into()),
                ground_truth: format!("{}", i * 10),
                extra_info: ExtraInfo {
                    split: "test".into(),
                    index: i,
                    answer: format!("#### {}", i * 10),
                    question: format!("question {i}"),
                },
            })
            .collect()
    }

    fn write(dir: &Path, name: &str, data: &RecordBatch) -> std::path::PathBuf {
        let path = dir.join(name);
        crate::batch::write_file(&path, data, &BTreeMap::new()).unwrap();
        path
    }

    /// `--system-prompt`: a row without a system message gets one first; a row's own is kept.
    #[test]
    fn with_system_adds_a_system_message_where_there_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = verl_rows();
        rows[1].prompt.remove(0);
        let path = write(dir.path(), "p.parquet", &verl_record_batch(&rows).unwrap());
        let ds = PromptDataset::open(&path).unwrap();
        let same = PromptDataset::open(&path).unwrap().with_system(None);
        assert_eq!(same.row(1).messages, ds.row(1).messages);
        let ds = ds.with_system(Some("Use the tools."));
        assert_eq!(
            ds.row(1).messages,
            vec![
                Message::new("system", "Use the tools."),
                Message::new("user", "question 1")
            ]
        );
        assert_eq!(ds.row(0).messages, rows[0].prompt);
        assert_eq!(ds.row(2).messages, rows[2].prompt);
    }

    #[test]
    fn verl_rows_round_trip_and_take() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "p.parquet",
            &verl_record_batch(&verl_rows()).unwrap(),
        );
        let ds = PromptDataset::open(&path).unwrap();
        assert_eq!(ds.len(), 3);
        let r = ds.row(2);
        assert_eq!(r.data_source, "src2");
        assert_eq!(
            r.messages,
            vec![
                Message::new("system", "sys"),
                Message::new("user", "question 2")
            ]
        );
        assert_eq!(r.text, None);
        assert_eq!(r.ground_truth.as_deref(), Some("20"));
        assert_eq!(
            r.extra_info,
            serde_json::json!({"split": "test", "index": 2, "answer": "#### 20", "question": "question 2"})
        );
        assert!(ds.raw_prompt(0).unwrap_err().to_string().contains("row 0"));
        let chatml = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            vec![],
            Path::new("chatml"),
        )
        .unwrap();
        assert_eq!(
            ds.prompt_text(1, Some(&chatml), &[]).unwrap(),
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nquestion 1<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(ds.prompt_text(1, None, &[]).is_err());

        let idx = repeat_each(&[2, 0], 2);
        assert_eq!(idx, vec![2, 2, 0, 0]);
        let cols = ds.take_columns(&idx).unwrap();
        let names: Vec<&str> = cols.iter().map(|(f, _)| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "data_source",
                "prompt",
                "ground_truth",
                "ability",
                "reward_model",
                "extra_info"
            ]
        );
        let fields: Vec<Field> = cols.iter().map(|(f, _)| f.clone()).collect();
        let arrays: Vec<ArrayRef> = cols.iter().map(|(_, a)| a.clone()).collect();
        // The taken columns form a valid batch that reads back as the same prompts.
        let out = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
        let back = write(dir.path(), "out.parquet", &out);
        let again = PromptDataset::open(&back).unwrap();
        let want: Vec<PromptRow> = idx.iter().map(|&i| ds.row(i).clone()).collect();
        assert_eq!(again.rows(), want.as_slice());
        assert!(ds.take_columns(&[3]).is_err());
    }

    #[test]
    fn text_prompts_and_missing_columns() {
        let dir = tempfile::tempdir().unwrap();
        let data = RecordBatch::try_from_iter([
            (
                "prompt",
                Arc::new(StringArray::from(vec!["Once upon", "a time"])) as ArrayRef,
            ),
            (
                "ground_truth",
                Arc::new(StringArray::from(vec![Some("x"), None])) as ArrayRef,
            ),
        ])
        .unwrap();
        let path = write(dir.path(), "stories.parquet", &data);
        let ds = PromptDataset::open(&path).unwrap();
        assert_eq!(ds.row(0).messages, vec![Message::new("user", "Once upon")]);
        assert_eq!(ds.raw_prompt(1).unwrap(), "a time");
        assert_eq!(ds.prompt_text(1, None, &[]).unwrap(), "a time");
        assert_eq!(ds.row(0).data_source, "stories");
        assert_eq!(ds.row(0).ground_truth.as_deref(), Some("x"));
        assert_eq!(ds.row(1).ground_truth, None);
        assert_eq!(ds.row(1).extra_info, serde_json::Value::Null);
        let cols = ds.take_columns(&[1, 0]).unwrap();
        assert_eq!(cols.len(), 3);
        assert_eq!(cols[2].1.as_string::<i32>().value(1), "x");
        assert!(cols[2].1.is_null(0));

        let no_prompt = RecordBatch::try_from_iter([(
            "question",
            Arc::new(StringArray::from(vec!["q"])) as ArrayRef,
        )])
        .unwrap();
        let path = write(dir.path(), "q.parquet", &no_prompt);
        let err = PromptDataset::open(&path).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .contains("q.parquet: column 'prompt' is missing (present: question)"),
            "{err}"
        );
        let by_key = PromptDataset::open_with_key(&path, "question").unwrap();
        assert_eq!(by_key.row(0).messages, vec![Message::new("user", "q")]);
        // The prompt column is also carried under its own name.
        let names: Vec<String> = by_key
            .take_columns(&[0])
            .unwrap()
            .iter()
            .map(|(f, _)| f.name().clone())
            .collect();
        assert_eq!(names, ["data_source", "prompt", "question"]);
    }

    #[test]
    fn every_column_is_taken_but_those_the_stages_write() {
        let dir = tempfile::tempdir().unwrap();
        let data = RecordBatch::try_from_iter([
            (
                "difficulty",
                Arc::new(arrow_array::Int64Array::from(vec![3, 7])) as ArrayRef,
            ),
            (
                "prompt",
                Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            (
                "ground_truth",
                Arc::new(arrow_array::Int64Array::from(vec![10, 20])) as ArrayRef,
            ),
            (
                "score",
                Arc::new(arrow_array::Float32Array::from(vec![0.5, 1.0])) as ArrayRef,
            ),
            (
                "uid",
                Arc::new(StringArray::from(vec!["x", "y"])) as ArrayRef,
            ),
            (
                "tags",
                Arc::new(StringArray::from(vec![Some("t"), None])) as ArrayRef,
            ),
        ])
        .unwrap();
        let path = write(dir.path(), "custom.parquet", &data);
        let ds = PromptDataset::open(&path).unwrap();
        assert_eq!(ds.left_out_columns(), ["score", "uid"]);
        let cols = ds.take_columns(&[1, 1, 0]).unwrap();
        let names: Vec<&str> = cols.iter().map(|(f, _)| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "data_source",
                "prompt",
                "ground_truth",
                "difficulty",
                "tags"
            ]
        );
        // Own types and values, rows taken in order, nulls kept.
        assert_eq!(cols[2].1.data_type(), &DataType::Int64);
        assert_eq!(value(cols[2].1.as_ref(), 0), serde_json::json!(20));
        assert_eq!(value(cols[3].1.as_ref(), 2), serde_json::json!(3));
        assert!(cols[4].1.is_null(0) && !cols[4].1.is_null(2));
    }

    #[test]
    fn jsonl_and_bad_messages_are_input_errors() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("p.jsonl");
        std::fs::write(&jsonl, "{\"prompt\": \"x\"}\n").unwrap();
        let err = PromptDataset::open(&jsonl).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("tandem prepare jsonl"), "{err}");

        let mut rows = verl_rows();
        rows[1].prompt.clear();
        let path = write(
            dir.path(),
            "empty.parquet",
            &verl_record_batch(&rows).unwrap(),
        );
        let err = PromptDataset::open(&path).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .contains("empty.parquet: column 'prompt', row 1: the message list is empty"),
            "{err}"
        );
    }
}
