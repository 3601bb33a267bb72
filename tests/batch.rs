//! The batch contract: round trips through Parquet and every validation error.

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, Float32Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file, Batch, NewColumns, StageInfo};
use tandem::error::is_input_error;

fn small_batch(ids: Vec<Vec<i32>>, lps: Vec<Vec<f32>>) -> RecordBatch {
    let offsets = |rows: &Vec<Vec<i32>>| -> Vec<usize> {
        let mut o = vec![0];
        for r in rows {
            o.push(o.last().unwrap() + r.len());
        }
        o
    };
    let id_off = offsets(&ids);
    let lp_off = offsets(&lps.iter().map(|r| vec![0; r.len()]).collect());
    let n = ids.len();
    let mut cols = NewColumns::new();
    cols.add(
        schema::UID,
        Arc::new(StringArray::from_iter_values(
            (0..n).map(|i| format!("u{i}")),
        )),
    )
    .add(
        schema::RESPONSE_TEXT,
        Arc::new(StringArray::from_iter_values(
            (0..n).map(|i| format!("answer #### {i}")),
        )),
    )
    .add(
        schema::RESPONSE_MASK,
        list_array::<UInt8Type>(&id_off, vec![1; *id_off.last().unwrap()]),
    )
    .add(
        schema::RESPONSE_IDS,
        list_array::<Int32Type>(&id_off, ids.concat()),
    )
    .add(
        schema::ROLLOUT_LOGPROBS,
        list_array::<Float32Type>(&lp_off, lps.concat()),
    );
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_parts().into_iter().unzip();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap()
}

fn write(path: &Path, b: &RecordBatch) {
    write_file(
        path,
        b,
        &BTreeMap::from([("policy_version".to_string(), "3".to_string())]),
    )
    .unwrap();
}

fn read_err(path: &Path, need: &[&str]) -> String {
    let err = Batch::read(path, need).err().expect("expected an error");
    assert!(is_input_error(&err), "not an input error: {err:#}");
    format!("{err:#}")
}

#[test]
fn round_trip_keeps_columns_values_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    write(
        &path,
        &small_batch(
            vec![vec![1, 2, 3], vec![4]],
            vec![vec![-0.5, -1.0, -2.0], vec![-0.25]],
        ),
    );
    let b = Batch::read(&path, &[schema::RESPONSE_IDS, schema::ROLLOUT_LOGPROBS]).unwrap();
    assert_eq!(b.num_rows(), 2);
    let ids = b.ragged_i32(schema::RESPONSE_IDS).unwrap();
    assert_eq!(ids.row(0), &[1, 2, 3]);
    assert_eq!(ids.row(1), &[4]);
    assert_eq!(
        b.ragged_f32(schema::ROLLOUT_LOGPROBS).unwrap().row(0),
        &[-0.5, -1.0, -2.0]
    );
    assert_eq!(b.strings(schema::UID).unwrap(), vec!["u0", "u1"]);
    assert_eq!(b.meta_u64("policy_version"), Some(3));

    // A stage adds a column and its metadata; everything else is kept.
    let out = dir.path().join("out.parquet");
    let mut cols = NewColumns::new();
    cols.add(schema::SCORE, Arc::new(Float32Array::from(vec![1.0, 0.0])));
    b.write_derived(
        &out,
        cols,
        &StageInfo {
            stage: "score",
            params: json!({"reward": "gsm8k"}),
            policy_version: None,
            step: Some(5),
        },
    )
    .unwrap();
    let o = Batch::read(&out, &[schema::SCORE]).unwrap();
    assert_eq!(o.f32s(schema::SCORE).unwrap(), vec![1.0, 0.0]);
    assert_eq!(o.ragged_i32(schema::RESPONSE_IDS).unwrap(), ids);
    assert_eq!(o.meta["tandem.schema"], schema::SCHEMA_VERSION);
    assert_eq!(o.meta["policy_version"], "3");
    assert_eq!(o.meta["step"], "5");
    assert_eq!(o.meta["tandem.stage.score"], r#"{"reward":"gsm8k"}"#);
    assert!(!dir.path().join("out.parquet.tmp").exists());

    // Re-running a stage replaces its column instead of adding a second one.
    let mut cols = NewColumns::new();
    cols.add(schema::SCORE, Arc::new(Float32Array::from(vec![0.5, 0.5])));
    let again = o.with_columns(cols).unwrap();
    assert_eq!(again.num_columns(), o.data.num_columns());
}

#[test]
fn large_batch_spans_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.parquet");
    let n = 20_000;
    let rows: Vec<Vec<i32>> = (0..n).map(|i| (0..(i % 7) as i32).collect()).collect();
    let lps: Vec<Vec<f32>> = rows
        .iter()
        .map(|r| r.iter().map(|&x| -(x as f32)).collect())
        .collect();
    write(&path, &small_batch(rows.clone(), lps));
    let b = Batch::read(&path, &[schema::RESPONSE_IDS]).unwrap();
    let ids = b.ragged_i32(schema::RESPONSE_IDS).unwrap();
    assert_eq!(ids.num_rows(), n);
    for i in [0, 1, 8191, 8192, 8193, 19_999] {
        assert_eq!(ids.row(i), rows[i].as_slice(), "row {i}");
    }
}

#[test]
fn missing_and_unreadable_files() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.parquet");
    assert!(read_err(&missing, &[]).contains("nope.parquet: cannot open"));
    let junk = dir.path().join("junk.parquet");
    std::fs::write(&junk, b"not parquet at all").unwrap();
    assert!(read_err(&junk, &[]).contains("junk.parquet: not a readable Parquet file"));
}

#[test]
fn missing_column_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    write(&path, &small_batch(vec![vec![1]], vec![vec![-1.0]]));
    let msg = read_err(&path, &[schema::SCORE]);
    assert!(
        msg.contains("b.parquet: column 'score' is missing"),
        "{msg}"
    );
}

#[test]
fn wrong_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    let schema_ = Schema::new(vec![Field::new(schema::SCORE, DataType::Utf8, false)]);
    let rb = RecordBatch::try_new(
        Arc::new(schema_),
        vec![Arc::new(StringArray::from(vec!["1.0"]))],
    )
    .unwrap();
    write(&path, &rb);
    let msg = read_err(&path, &[schema::SCORE]);
    assert!(
        msg.contains("column 'score': expected float32, found Utf8"),
        "{msg}"
    );
}

#[test]
fn length_mismatch_names_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    write(
        &path,
        &small_batch(
            vec![vec![1, 2], vec![3, 4]],
            vec![vec![-1.0, -1.0], vec![-1.0]],
        ),
    );
    let msg = read_err(&path, &[]);
    assert!(
        msg.contains("column 'rollout_logprobs', row 1: has 1 entries but response_ids has 2"),
        "{msg}"
    );
}

#[test]
fn negative_token_id_names_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    write(
        &path,
        &small_batch(
            vec![vec![1], vec![2], vec![3, -7]],
            vec![vec![-1.0], vec![-1.0], vec![-1.0, -1.0]],
        ),
    );
    let msg = read_err(&path, &[]);
    assert!(
        msg.contains("column 'response_ids', row 2: token id -7 is negative"),
        "{msg}"
    );
}

#[test]
fn non_finite_values_are_named_when_consumed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.parquet");
    write(
        &path,
        &small_batch(
            vec![vec![1], vec![2, 3]],
            vec![vec![-1.0], vec![-1.0, f32::NAN]],
        ),
    );
    let b = Batch::read(&path, &[]).unwrap();
    let err = b.ragged_f32(schema::ROLLOUT_LOGPROBS).unwrap_err();
    assert!(is_input_error(&err));
    assert!(
        format!("{err}").contains("column 'rollout_logprobs', row 1: value NaN is not finite"),
        "{err}"
    );
}

#[test]
fn failed_write_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // The output's parent is a file, so creating the directory fails.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let out = blocker.join("out.parquet");
    let b = small_batch(vec![vec![1]], vec![vec![-1.0]]);
    assert!(write_file(&out, &b, &BTreeMap::new()).is_err());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}
