//! Learning on a tiny random model through the real binaries: 20 `update` steps with
//! advantages favouring one response raise its probability; `--loss sft` lowers the NLL; every
//! registered loss runs by its name.

use crate::stage_util;

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{Field, Schema};
use stage_util::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file};

/// Rows (prompt, response, advantage); no advantages column when `adv` is None.
fn batch(path: &Path, rows: &[(Vec<i32>, Vec<i32>)], adv: Option<&[f32]>) {
    let (mut po, mut pi, mut ro, mut ri, mut a) = (vec![0], vec![], vec![0], vec![], vec![]);
    for (k, (prompt, resp)) in rows.iter().enumerate() {
        pi.extend_from_slice(prompt);
        po.push(pi.len());
        ri.extend_from_slice(resp);
        ro.push(ri.len());
        if let Some(adv) = adv {
            a.extend(std::iter::repeat_n(adv[k], resp.len()));
        }
    }
    let total = ri.len();
    let mut cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::PROMPT_IDS),
            list_array::<Int32Type>(&po, pi),
        ),
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(&ro, ri),
        ),
        (
            schema::field(schema::RESPONSE_MASK),
            list_array::<UInt8Type>(&ro, vec![1; total]),
        ),
    ];
    if adv.is_some() {
        cols.push((
            schema::field(schema::ADVANTAGES),
            list_array::<Float32Type>(&ro, a),
        ));
    }
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    write_file(path, &data, &BTreeMap::new()).unwrap();
}

/// Σ log p(response tokens) of each row under `model`, via the ref-logprob binary.
fn seq_logprobs(model: &Path, input: &Path, dir: &Path) -> Vec<f32> {
    let out = dir.join("scored.parquet");
    ok(
        "ref-logprob",
        &[
            "--model",
            p(model),
            "--in",
            p(input),
            "--out",
            p(&out),
            "--column",
            "ref_logprobs",
        ],
    );
    f32_rows(&read(&out), schema::REF_LOGPROBS)
        .iter()
        .map(|r| r.iter().sum())
        .collect()
}

fn updates(model: &Path, input: &Path, dir: &Path, steps: usize, extra: &[&str]) -> PathBuf {
    let mut current = model.to_path_buf();
    for s in 0..steps {
        let next = dir.join(format!("step-{s}"));
        let mut args = vec![
            "--model",
            p(&current),
            "--in",
            p(input),
            "--out-model",
            p(&next),
        ];
        args.extend_from_slice(extra);
        ok("update", &args);
        current = next;
    }
    current
}

/// A group of four samples of one prompt (rewarded by the tests' GRPO-like advantages: the
/// first one, not the three others).
fn group() -> Vec<(Vec<i32>, Vec<i32>)> {
    let prompt = vec![10, 11, 12, 13];
    vec![
        (prompt.clone(), vec![65, 66, 67, 68, 69]),
        (prompt.clone(), vec![70, 71, 72]),
        (prompt.clone(), vec![80, 81, 82, 83]),
        (prompt.clone(), vec![90, 91]),
    ]
}

#[test]
fn twenty_updates_raise_the_favoured_response() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 21);
    let input = dir.path().join("batch.parquet");
    batch(&input, &group(), Some(&[1.5, -0.5, -0.5, -0.5]));
    let before = seq_logprobs(&model, &input, dir.path());
    let last = updates(&model, &input, dir.path(), 20, &["--lr", "1e-3"]);
    let after = seq_logprobs(&last, &input, dir.path());
    eprintln!("log p before {before:?}\nlog p after  {after:?}");
    assert!(
        after[0] > before[0] + 2.0,
        "favoured: {} -> {}",
        before[0],
        after[0]
    );
    for k in 1..4 {
        assert!(
            after[k] < before[k],
            "row {k}: {} -> {}",
            before[k],
            after[k]
        );
    }
    let ts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(last.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(ts["optimizer_step"], 20);
}

#[test]
fn sft_lowers_the_nll() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 22);
    let input = dir.path().join("sft.parquet");
    let rows = vec![
        (vec![1, 2, 3], vec![104, 101, 108, 108, 111]),
        (vec![4, 5], vec![119, 111, 114, 108, 100, 33]),
    ];
    batch(&input, &rows, None);
    let nll = |m: &Path| -> f32 { -seq_logprobs(m, &input, dir.path()).iter().sum::<f32>() };
    let before = nll(&model);
    let last = updates(
        &model,
        &input,
        dir.path(),
        2,
        &[
            "--loss",
            "sft",
            "--lr",
            "1e-3",
            "--ppo-epochs",
            "4",
            "--mini-batch-size",
            "1",
        ],
    );
    let after = nll(&last);
    eprintln!("NLL {before} -> {after}");
    assert!(after < before * 0.8, "NLL {before} -> {after}");
    // 2 calls x 4 epochs x 2 mini-batches.
    let ts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(last.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(ts["optimizer_step"], 16);
}

/// Every loss of the registry runs through the `update` binary by its name and moves the
/// model the right way: the policy-gradient losses raise the favoured response, sft raises the
/// likelihood of all of them.
#[test]
fn every_registered_loss_runs_by_name() {
    use tandem::algo::policy_loss::LOSSES;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 23);
    let input = dir.path().join("batch.parquet");
    batch(&input, &group(), Some(&[1.5, -0.5, -0.5, -0.5]));
    let before = seq_logprobs(&model, &input, dir.path());
    for l in LOSSES {
        let work = dir.path().join(l.name);
        std::fs::create_dir_all(&work).unwrap();
        let last = updates(
            &model,
            &input,
            &work,
            3,
            &["--loss", l.name, "--lr", "1e-3"],
        );
        let after = seq_logprobs(&last, &input, &work);
        eprintln!("{}: log p {before:?} -> {after:?}", l.name);
        if l.policy_gradient {
            assert!(
                after[0] > before[0] + 0.1,
                "{}: {before:?} -> {after:?}",
                l.name
            );
            assert!(after[1] < before[1], "{}: {before:?} -> {after:?}", l.name);
        } else {
            let sum = |v: &[f32]| v.iter().sum::<f32>();
            assert!(sum(&after) > sum(&before) + 0.1, "{}", l.name);
        }
    }
}

/// An unknown `--loss` is refused (exit 2) with the registered names; `--help` gives each
/// name with its formula.
#[test]
fn loss_names_and_help_come_from_the_registry() {
    use tandem::algo::policy_loss::LOSSES;
    let err = input_error(
        "update",
        &[
            "--loss",
            "ppo",
            "--model",
            "m",
            "--in",
            "b",
            "--out-model",
            "o",
        ],
        "invalid value 'ppo' for '--loss",
    );
    for l in LOSSES {
        assert!(err.contains(l.name), "{err}");
    }
    let help = String::from_utf8(ok("update", &["--help"]).stdout).unwrap();
    for l in LOSSES {
        assert!(
            help.lines()
                .any(|s| s.trim().starts_with(&format!("- {}:", l.name)) && s.ends_with(l.about)),
            "{}: {help}",
            l.name
        );
    }
}
