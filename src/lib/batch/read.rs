//! Reading a batch file and checking it against the contract.

use super::ragged::Ragged;
use super::schema::{self, Kind};
use crate::bail_input;
use crate::error::input_error;
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int32Type, Int64Type, Int8Type, UInt8Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// One batch file in memory: all its rows as one Arrow record batch, plus its key/value metadata.
pub struct Batch {
    pub path: PathBuf,
    pub data: RecordBatch,
    pub meta: BTreeMap<String, String>,
}

impl Batch {
    /// Read `path` and check that every column in `required` is present with the contract's
    /// type. Whatever the stage needs or not, list columns aligned with `response_ids` must
    /// agree in length row by row and token ids must be >= 0.
    pub fn read(path: &Path, required: &[&str]) -> Result<Batch> {
        let shown = path.display();
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) => bail_input!("{shown}: cannot open batch file: {e}"),
        };
        let not_parquet = |e: parquet::errors::ParquetError| {
            input_error(format!("{shown}: not a readable Parquet file: {e}"))
        };
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(not_parquet)?;
        let meta: BTreeMap<String, String> = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .map(|kvs| {
                kvs.iter()
                    .filter(|kv| kv.key != schema::meta::ARROW_SCHEMA)
                    .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let arrow_schema = builder.schema().clone();
        let reader = builder
            .with_batch_size(64 * 1024)
            .build()
            .map_err(not_parquet)?;
        let mut parts = Vec::new();
        for part in reader {
            parts.push(
                part.map_err(|e| input_error(format!("{shown}: corrupt Parquet data: {e}")))?,
            );
        }
        let data = match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => arrow_select::concat::concat_batches(&arrow_schema, &parts)?,
        };
        let batch = Batch {
            path: path.to_path_buf(),
            data,
            meta,
        };
        batch.check(required)?;
        Ok(batch)
    }

    pub fn num_rows(&self) -> usize {
        self.data.num_rows()
    }

    /// Every stage refuses a batch without rows the same way: exit 2, this message, nothing
    /// written (an empty batch is a mistake upstream, not something to pass on).
    pub(crate) fn require_rows(&self) -> Result<()> {
        if self.num_rows() == 0 {
            bail_input!(
                "{}: the batch has no rows (stages need at least one)",
                self.path.display()
            );
        }
        Ok(())
    }

    pub fn has(&self, name: &str) -> bool {
        self.data.schema().column_with_name(name).is_some()
    }

    /// The raw Arrow column, or an input error naming the file.
    pub fn column(&self, name: &str) -> Result<&ArrayRef> {
        self.data.column_by_name(name).ok_or_else(|| {
            input_error(format!(
                "{}: column '{name}' is missing",
                self.path.display()
            ))
        })
    }

    /// "FILE: column 'NAME'" for messages.
    pub(crate) fn at(&self, name: &str) -> String {
        format!("{}: column '{name}'", self.path.display())
    }

    fn check(&self, required: &[&str]) -> Result<()> {
        for &name in required {
            let col = self.column(name).map_err(|_| {
                input_error(format!(
                    "{}: column '{name}' is missing (present: {})",
                    self.path.display(),
                    self.data
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            if let Some(kind) = schema::kind_of(name) {
                self.check_kind(name, col.data_type(), kind)?;
            }
        }
        // Types of contract columns present but not required are checked too: a wrong type
        // anywhere means the file was not written by a stage and should not be passed on.
        for field in self.data.schema().fields() {
            if let Some(kind) = schema::kind_of(field.name()) {
                self.check_kind(field.name(), field.data_type(), kind)?;
            }
        }
        if self.has(schema::RESPONSE_IDS) {
            let ids = self.ragged_i32(schema::RESPONSE_IDS)?;
            for field in self.data.schema().fields() {
                let name = field.name();
                if !schema::is_token_aligned(name) {
                    continue;
                }
                let offsets = self.offsets(name)?;
                for row in 0..self.num_rows() {
                    let (want, got) = (ids.row(row).len(), offsets[row + 1] - offsets[row]);
                    if want != got {
                        bail_input!(
                            "{}, row {row}: has {got} entries but response_ids has {want}",
                            self.at(name)
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn check_kind(&self, name: &str, dt: &DataType, kind: Kind) -> Result<()> {
        if !kind.accepts(dt) {
            bail_input!(
                "{}: expected {}, found {dt}",
                self.at(name),
                kind.describe()
            );
        }
        Ok(())
    }

    fn null_row(&self, name: &str, col: &dyn Array) -> Result<()> {
        if col.null_count() > 0 {
            let row = (0..col.len()).find(|&i| col.is_null(i)).unwrap_or(0);
            bail_input!("{}, row {row}: value is null", self.at(name));
        }
        Ok(())
    }

    /// A utf8 column as string slices (nulls are an error).
    pub fn strings(&self, name: &str) -> Result<Vec<&str>> {
        let col = self.column(name)?;
        self.null_row(name, col.as_ref())?;
        Ok(match col.data_type() {
            DataType::Utf8 => col
                .as_string::<i32>()
                .iter()
                .map(|s| s.unwrap_or(""))
                .collect(),
            DataType::LargeUtf8 => col
                .as_string::<i64>()
                .iter()
                .map(|s| s.unwrap_or(""))
                .collect(),
            DataType::Utf8View => col
                .as_string_view()
                .iter()
                .map(|s| s.unwrap_or(""))
                .collect(),
            dt => bail_input!("{}: expected utf8, found {dt}", self.at(name)),
        })
    }

    /// A float column, checked finite.
    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        let col = self.column(name)?;
        self.null_row(name, col.as_ref())?;
        let values: Vec<f32> = match col.data_type() {
            DataType::Float32 => col.as_primitive::<Float32Type>().values().to_vec(),
            DataType::Float64 => col
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .map(|&v| v as f32)
                .collect(),
            dt => bail_input!("{}: expected float32, found {dt}", self.at(name)),
        };
        self.check_finite(name, &values, None)?;
        Ok(values)
    }

    /// A bool column (nulls are an error).
    pub fn bools(&self, name: &str) -> Result<Vec<bool>> {
        let col = self.column(name)?;
        self.null_row(name, col.as_ref())?;
        match col.data_type() {
            DataType::Boolean => Ok(col.as_boolean().iter().map(|b| b == Some(true)).collect()),
            dt => bail_input!("{}: expected bool, found {dt}", self.at(name)),
        }
    }

    /// Which rows are ReMax baseline rows (`is_baseline`; none when the column is absent).
    pub fn baseline_rows(&self) -> Result<Vec<bool>> {
        match self.has(schema::IS_BASELINE) {
            true => self.bools(schema::IS_BASELINE),
            false => Ok(vec![false; self.num_rows()]),
        }
    }

    /// The batch without its baseline rows: the samples, which every count over samples
    /// (score means, accuracy, lengths, groups kept) is taken over.
    pub fn samples_only(self) -> Result<Batch> {
        let baseline = self.baseline_rows()?;
        if !baseline.contains(&true) {
            return Ok(self);
        }
        let keep: arrow_array::BooleanArray = baseline.iter().map(|&b| Some(!b)).collect();
        let data = arrow_select::filter::filter_record_batch(&self.data, &keep)?;
        Ok(Batch { data, ..self })
    }

    fn check_finite(&self, name: &str, values: &[f32], offsets: Option<&[usize]>) -> Result<()> {
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            let row = match offsets {
                Some(o) => o.partition_point(|&start| start <= i) - 1,
                None => i,
            };
            bail_input!(
                "{}, row {row}: value {} is not finite",
                self.at(name),
                values[i]
            );
        }
        Ok(())
    }

    /// Row offsets of a list column (length rows + 1, starting at 0).
    fn offsets(&self, name: &str) -> Result<Vec<usize>> {
        let col = self.column(name)?;
        self.null_row(name, col.as_ref())?;
        Ok(match col.data_type() {
            DataType::List(_) => {
                let o = col.as_list::<i32>().value_offsets();
                o.iter().map(|&x| (x - o[0]) as usize).collect()
            }
            DataType::LargeList(_) => {
                let o = col.as_list::<i64>().value_offsets();
                o.iter().map(|&x| (x - o[0]) as usize).collect()
            }
            dt => bail_input!("{}: expected a list, found {dt}", self.at(name)),
        })
    }

    /// The child values of a list column, sliced to the rows in use.
    fn list_values(&self, name: &str) -> Result<ArrayRef> {
        let col = self.column(name)?;
        let values = match col.data_type() {
            DataType::List(_) => {
                let l = col.as_list::<i32>();
                let o = l.value_offsets();
                l.values()
                    .slice(o[0] as usize, (o[o.len() - 1] - o[0]) as usize)
            }
            DataType::LargeList(_) => {
                let l = col.as_list::<i64>();
                let o = l.value_offsets();
                l.values()
                    .slice(o[0] as usize, (o[o.len() - 1] - o[0]) as usize)
            }
            dt => bail_input!("{}: expected a list, found {dt}", self.at(name)),
        };
        if values.null_count() > 0 {
            let offsets = self.offsets(name)?;
            let i = (0..values.len()).find(|&i| values.is_null(i)).unwrap_or(0);
            let row = offsets.partition_point(|&start| start <= i) - 1;
            bail_input!("{}, row {row}: list holds a null", self.at(name));
        }
        Ok(values)
    }

    /// A list<int32> column of token ids (checked >= 0).
    pub fn ragged_i32(&self, name: &str) -> Result<Ragged<'static, i32>> {
        let offsets = self.offsets(name)?;
        let values = self.list_values(name)?;
        let values: Vec<i32> = match values.data_type() {
            DataType::Int32 => values.as_primitive::<Int32Type>().values().to_vec(),
            DataType::Int64 => {
                let v = values.as_primitive::<Int64Type>().values();
                if let Some(i) = v.iter().position(|&x| x > i32::MAX as i64) {
                    let row = offsets.partition_point(|&s| s <= i) - 1;
                    bail_input!(
                        "{}, row {row}: token id {} does not fit in int32",
                        self.at(name),
                        v[i]
                    );
                }
                v.iter().map(|&x| x as i32).collect()
            }
            dt => bail_input!("{}: expected list<int32>, found list<{dt}>", self.at(name)),
        };
        if let Some(i) = values.iter().position(|&x| x < 0) {
            let row = offsets.partition_point(|&s| s <= i) - 1;
            bail_input!(
                "{}, row {row}: token id {} is negative",
                self.at(name),
                values[i]
            );
        }
        Ok(Ragged {
            offsets,
            values: Cow::Owned(values),
        })
    }

    /// A list<uint8> mask column; every entry must be 0 or 1.
    pub fn ragged_u8(&self, name: &str) -> Result<Ragged<'static, u8>> {
        let offsets = self.offsets(name)?;
        let values = self.list_values(name)?;
        let values: Vec<u8> = match values.data_type() {
            DataType::UInt8 => values.as_primitive::<UInt8Type>().values().to_vec(),
            DataType::Int8 => values
                .as_primitive::<Int8Type>()
                .values()
                .iter()
                .map(|&x| x as u8)
                .collect(),
            dt => bail_input!("{}: expected list<uint8>, found list<{dt}>", self.at(name)),
        };
        if let Some(i) = values.iter().position(|&x| x > 1) {
            let row = offsets.partition_point(|&s| s <= i) - 1;
            bail_input!(
                "{}, row {row}: mask value {} is not 0 or 1",
                self.at(name),
                values[i]
            );
        }
        Ok(Ragged {
            offsets,
            values: Cow::Owned(values),
        })
    }

    /// A list<float32> column, checked finite.
    pub fn ragged_f32(&self, name: &str) -> Result<Ragged<'static, f32>> {
        let offsets = self.offsets(name)?;
        let values = self.list_values(name)?;
        let values: Vec<f32> = match values.data_type() {
            DataType::Float32 => values.as_primitive::<Float32Type>().values().to_vec(),
            DataType::Float64 => values
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .map(|&x| x as f32)
                .collect(),
            dt => bail_input!(
                "{}: expected list<float32>, found list<{dt}>",
                self.at(name)
            ),
        };
        self.check_finite(name, &values, Some(&offsets))?;
        Ok(Ragged {
            offsets,
            values: Cow::Owned(values),
        })
    }

    /// The ground truth of each row: a top-level `ground_truth` column, or verl's
    /// `reward_model.ground_truth`. Non-string ground truths are given as JSON text.
    pub fn ground_truths(&self) -> Result<Vec<String>> {
        if self.has(schema::GROUND_TRUTH) {
            let col = self.column(schema::GROUND_TRUTH)?;
            return (0..col.len())
                .map(|i| Ok(super::json::value_text(col.as_ref(), i)))
                .collect();
        }
        if let Some(rm) = self.data.column_by_name(schema::REWARD_MODEL) {
            if let DataType::Struct(_) = rm.data_type() {
                if let Some(gt) = rm.as_struct().column_by_name("ground_truth") {
                    return Ok((0..gt.len())
                        .map(|i| super::json::value_text(gt.as_ref(), i))
                        .collect());
                }
            }
        }
        bail_input!(
            "{}: no ground truth: expected a column 'ground_truth' or a struct column 'reward_model' with a field 'ground_truth'",
            self.path.display()
        )
    }

    /// Per-row JSON of an arbitrary column (e.g. `extra_info`), or nulls when absent.
    pub fn json_rows(&self, name: &str) -> Vec<serde_json::Value> {
        match self.data.column_by_name(name) {
            Some(col) => (0..col.len())
                .map(|i| super::json::value(col.as_ref(), i))
                .collect(),
            None => vec![serde_json::Value::Null; self.num_rows()],
        }
    }

    /// The metadata of the Arrow schema embedded in the file's footer (`ARROW:schema`) alone,
    /// not merged with the footer's own key/value pairs: what readers that show only the
    /// schema (pyarrow's `pq.read_table(f).schema.metadata`) see. Empty when the file has no
    /// Arrow schema (it was not written through Arrow).
    pub fn embedded_schema_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let file = File::open(path)
            .map_err(|e| input_error(format!("{}: cannot open: {e}", path.display())))?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            input_error(format!(
                "{}: not a readable Parquet file: {e}",
                path.display()
            ))
        })?;
        let fm = reader.metadata().file_metadata();
        let arrow: Vec<_> = fm
            .key_value_metadata()
            .into_iter()
            .flatten()
            .filter(|kv| kv.key == schema::meta::ARROW_SCHEMA)
            .cloned()
            .collect();
        if arrow.is_empty() {
            return Ok(BTreeMap::new());
        }
        let embedded = parquet::arrow::parquet_to_arrow_schema(fm.schema_descr(), Some(&arrow))?;
        Ok(embedded
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    /// Parse a metadata entry as an integer, if present.
    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta.get(key).and_then(|v| v.parse().ok())
    }
}
