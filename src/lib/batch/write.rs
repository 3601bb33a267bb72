//! Writing a batch file: keep every input column, add the stage's columns, record metadata,
//! zstd-compress, write to `NAME.tmp` and rename so a crash never leaves a half file.
//!
//! The key/value metadata goes both into the Parquet footer and into the Arrow schema embedded
//! in it (`ARROW:schema`), so readers that show only one of them (pyarrow's
//! `pq.read_table(f).schema.metadata`, arrow-rs, duckdb's `parquet_kv_metadata`) all see it.

use super::read::Batch;
use super::schema::{self, meta};
use anyhow::{Context, Result};
use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow_schema::{Field, Schema};
use parquet::arrow::arrow_writer::{compute_leaves, ArrowColumnChunk};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Columns a stage adds to a batch. A column already present with the same name is replaced
/// in place (re-running a stage overwrites its own output column).
#[derive(Default)]
pub struct NewColumns {
    cols: Vec<(Field, ArrayRef)>,
}

impl NewColumns {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a contract column (its type comes from the schema).
    pub fn add(&mut self, name: &str, array: ArrayRef) -> &mut Self {
        self.add_field(schema::field(name), array)
    }

    /// Add a column with an explicit field (for columns outside the contract).
    pub fn add_field(&mut self, field: Field, array: ArrayRef) -> &mut Self {
        assert_eq!(
            field.data_type(),
            array.data_type(),
            "column {}",
            field.name()
        );
        self.cols.retain(|(f, _)| f.name() != field.name());
        self.cols.push((field, array));
        self
    }

    /// The columns in the order they were added.
    pub fn into_parts(self) -> Vec<(Field, ArrayRef)> {
        self.cols
    }
}

/// What a stage records about itself in the output's metadata.
pub struct StageInfo<'a> {
    pub stage: &'a str,
    pub params: serde_json::Value,
    /// Overrides the inherited policy_version (rollout sets it; others inherit).
    pub policy_version: Option<u64>,
    pub step: Option<u64>,
}

impl Batch {
    /// The input's columns with `new` appended or replacing same-named ones.
    pub fn with_columns(&self, new: NewColumns) -> Result<RecordBatch> {
        let mut fields: Vec<Arc<Field>> = self.data.schema().fields().iter().cloned().collect();
        let mut arrays: Vec<ArrayRef> = self.data.columns().to_vec();
        for (field, array) in new.cols {
            anyhow::ensure!(
                array.len() == self.num_rows(),
                "column {} has {} rows, batch has {}",
                field.name(),
                array.len(),
                self.num_rows()
            );
            match fields.iter().position(|f| f.name() == field.name()) {
                Some(i) => {
                    fields[i] = Arc::new(field);
                    arrays[i] = array;
                }
                None => {
                    fields.push(Arc::new(field));
                    arrays.push(array);
                }
            }
        }
        Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
    }

    /// Metadata for an output derived from this batch.
    pub(crate) fn derived_meta(&self, info: &StageInfo) -> BTreeMap<String, String> {
        stage_meta(self.meta.clone(), info)
    }

    /// Write `self` plus `new` columns to `out`, with this stage's metadata.
    pub fn write_derived(&self, out: &Path, new: NewColumns, info: &StageInfo) -> Result<()> {
        let data = self.with_columns(new)?;
        write_file(out, &data, &self.derived_meta(info))
    }
}

/// Add the stage's keys to inherited metadata.
pub(crate) fn stage_meta(
    mut m: BTreeMap<String, String>,
    info: &StageInfo,
) -> BTreeMap<String, String> {
    m.remove(meta::ARROW_SCHEMA);
    m.insert(meta::SCHEMA.into(), schema::SCHEMA_VERSION.into());
    m.insert(
        format!("{}{}", meta::STAGE_PREFIX, info.stage),
        info.params.to_string(),
    );
    if let Some(v) = info.policy_version {
        m.insert(meta::POLICY_VERSION.into(), v.to_string());
    }
    if let Some(s) = info.step {
        m.insert(meta::STEP.into(), s.to_string());
    }
    m
}

/// The temporary name an output is written under before the rename.
pub fn temp_path(out: &Path) -> PathBuf {
    let mut name = out
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".tmp");
    out.with_file_name(name)
}

/// Write a file through `NAME.tmp` and a rename, so readers and a resumed run never see half
/// of it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = temp_path(path);
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))
}

/// Write `value` as pretty JSON to `path` atomically (`path.tmp`, then rename): metrics files,
/// controller state, run state. Creates the parent directory.
pub(crate) fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = temp_path(path);
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    let result = std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("writing {}", path.display()));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Rows per Parquet row group: small enough that readers can stream, large enough that
/// per-group overhead stays negligible.
const ROW_GROUP_ROWS: usize = 8192;

/// Columns worth dictionary-encoding: few distinct values repeated on every row.
const DICTIONARY_COLUMNS: &[&str] = &[schema::DATA_SOURCE, schema::FINISH_REASON, "ability"];

/// Write a record batch as a zstd Parquet file, atomically. Columns are encoded in parallel
/// (each leaf column of a row group on its own rayon task), since encoding dominates a stage's
/// wall time on large batches.
pub fn write_file(out: &Path, data: &RecordBatch, kv: &BTreeMap<String, String>) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = temp_path(out);
    let result = write_parallel(&tmp, data, kv).and_then(|()| {
        std::fs::rename(&tmp, out)
            .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", out.display()))
}

fn write_parallel(path: &Path, data: &RecordBatch, kv: &BTreeMap<String, String>) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    // The Arrow schema carries the same metadata as the footer (and only it: whatever the input
    // schema held is already in `kv` when it should be kept).
    let schema = Schema::new(data.schema().fields().clone()).with_metadata(
        kv.iter()
            .filter(|(k, _)| k.as_str() != meta::ARROW_SCHEMA)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<std::collections::HashMap<_, _>>(),
    );
    let data = RecordBatch::try_new_with_options(
        Arc::new(schema),
        data.columns().to_vec(),
        &RecordBatchOptions::new().with_row_count(Some(data.num_rows())),
    )?;
    let kvs = kv
        .iter()
        .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
        .collect();
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
        .set_dictionary_enabled(false)
        .set_key_value_metadata(Some(kvs));
    for name in DICTIONARY_COLUMNS {
        props = props.set_column_dictionary_enabled(ColumnPath::from(*name), true);
    }
    // ArrowWriter embeds the Arrow schema in the metadata; we then drive its lower-level
    // writers ourselves to encode columns in parallel.
    let writer = ArrowWriter::try_new(
        BufWriter::with_capacity(1 << 20, file),
        data.schema(),
        Some(props.build()),
    )?;
    let (mut file_writer, factory) = writer.into_serialized_writer()?;
    let fields = data.schema().fields().clone();
    let mut start = 0;
    let mut group = 0;
    while start < data.num_rows() || (group == 0 && data.num_rows() == 0) {
        let len = ROW_GROUP_ROWS.min(data.num_rows() - start);
        let part = data.slice(start, len);
        let mut jobs = Vec::new();
        for (field, col) in fields.iter().zip(part.columns()) {
            jobs.extend(compute_leaves(field, col)?);
        }
        let writers = factory.create_column_writers(group)?;
        anyhow::ensure!(writers.len() == jobs.len(), "parquet leaf count mismatch");
        let chunks: Vec<ArrowColumnChunk> = writers
            .into_par_iter()
            .zip(jobs.into_par_iter())
            .map(|(mut w, leaf)| -> Result<ArrowColumnChunk> {
                w.write(&leaf)?;
                Ok(w.close()?)
            })
            .collect::<Result<_>>()?;
        let mut rg = file_writer.next_row_group()?;
        for chunk in chunks {
            chunk.append_to_row_group(&mut rg)?;
        }
        rg.close()?;
        start += len;
        group += 1;
        if data.num_rows() == 0 {
            break;
        }
    }
    let mut inner = file_writer.into_inner()?;
    inner.flush()?;
    inner.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Float32Array;

    fn embedded_schema_metadata(path: &Path) -> BTreeMap<String, String> {
        Batch::embedded_schema_metadata(path).unwrap()
    }

    #[test]
    fn metadata_is_in_the_footer_and_in_the_arrow_schema() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("b.parquet");
        let data = RecordBatch::try_from_iter([(
            "score",
            Arc::new(Float32Array::from(vec![1.0, 0.0])) as ArrayRef,
        )])
        .unwrap();
        let info = StageInfo {
            stage: "score",
            params: serde_json::json!({"reward": "exact"}),
            policy_version: Some(3),
            step: Some(7),
        };
        let kv = stage_meta(BTreeMap::new(), &info);
        write_file(&out, &data, &kv).unwrap();
        let embedded = embedded_schema_metadata(&out);
        for (k, v) in [
            (meta::SCHEMA, schema::SCHEMA_VERSION),
            (meta::POLICY_VERSION, "3"),
            (meta::STEP, "7"),
            ("tandem.stage.score", r#"{"reward":"exact"}"#),
        ] {
            assert_eq!(embedded.get(k).map(String::as_str), Some(v), "{k}");
        }
        assert!(!embedded.contains_key(meta::ARROW_SCHEMA));
        // The footer holds the same pairs.
        let back = Batch::read(&out, &[]).unwrap();
        assert_eq!(back.meta, kv);
        // Derived files carry the derived metadata in both places, the input's schema
        // metadata not left stale.
        let out2 = dir.path().join("c.parquet");
        let info2 = StageInfo {
            stage: "advantage",
            params: serde_json::json!({}),
            policy_version: None,
            step: Some(8),
        };
        back.write_derived(&out2, NewColumns::new(), &info2)
            .unwrap();
        let embedded = embedded_schema_metadata(&out2);
        assert_eq!(embedded.get(meta::STEP).map(String::as_str), Some("8"));
        assert_eq!(
            embedded.get(meta::POLICY_VERSION).map(String::as_str),
            Some("3")
        );
        assert!(embedded.contains_key("tandem.stage.advantage"));
        // Zero rows still write a schema with its metadata.
        let empty = data.slice(0, 0);
        let out3 = dir.path().join("e.parquet");
        write_file(&out3, &empty, &kv).unwrap();
        assert_eq!(embedded_schema_metadata(&out3), kv);
    }
}
