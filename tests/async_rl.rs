//! Disaggregated RL on CPU ranks (`[placement]`, docs/DISTRIBUTED.md): the weight transfer
//! from a training daemon (group) to a rollout daemon group leaves the rollout ranks with
//! exactly the weights a rollout loads from the trainer's checkpoint; a placed run in
//! synchronous mode writes the colocated run's files; one step off-policy is deterministic,
//! samples step k's rows with the policy one version behind, and resumes after SIGKILL; bad
//! `[placement]` specs are refused naming the key.

use crate::dp::{ctl_with, same_rows, DaemonGroup};
use crate::stage_util::*;
use std::path::Path;
use tandem::model::safetensors::round_bf16;
use tandem::model::ModelDir;

/// One step of GRPO-shaped training data: a rollout of `model` over three prompts with
/// advantages (+1/−1 rows), in `d/adv.parquet`; the prompts in `d/prompts.parquet`.
fn batch_to_train(d: &Path) {
    prompts(
        &d.join("prompts.parquet"),
        &["What is 2 + 3?", "Name a colour.", "Say hello."],
    );
    let r = d.join("r.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&d.join("model")),
            "--in",
            p(&d.join("prompts.parquet")),
            "--out",
            p(&r),
            "--n",
            "2",
            "--max-new-tokens",
            "5",
            "--raw-prompt",
            "--seed",
            "4",
        ],
    );
    add_advantages(&r, &d.join("adv.parquet"));
}

/// `tandem daemon-ctl --socket SOCKET ARGS` that must succeed; its stderr.
fn ctl_ok(socket: &Path, args: &[&str]) -> String {
    let o = ctl_with(socket, args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "daemon-ctl {args:?}: {err}");
    err
}

/// The training daemon (one rank, or a group of `train` ranks) trains a checkpoint; the
/// transfer sends it to a rollout group of `rollout` ranks; their weights (saved by
/// `daemon-ctl save`) are the checkpoint's as a rollout loads them (bf16-rounded, bit for
/// bit), their rollout is an in-process rollout of the checkpoint (no reload), and the
/// metrics say what moved.
fn transfer_case(train: usize, rollout: usize) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    batch_to_train(d);
    let model = d.join("model");
    let (ts, rs) = (d.join("t.sock"), d.join("r.sock"));
    let _train = DaemonGroup::start(d, train, &ts, &model, &[]);
    let _roll = DaemonGroup::start(d, rollout, &rs, &model, &[]);
    let ck = d.join("ck");
    ok(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&d.join("adv.parquet")),
            "--out-model",
            p(&ck),
            "--lr",
            "0.01",
            "--daemon",
            p(&ts),
        ],
    );
    let metrics = d.join("transfer.json");
    let receivers = rollout.to_string();
    let log = ctl_ok(
        &ts,
        &[
            "transfer",
            "--to",
            p(&rs),
            "--model",
            p(&ck),
            "--receivers",
            &receivers,
            "--bucket-mb",
            "1",
            "--metrics",
            p(&metrics),
        ],
    );
    assert!(log.contains("transfer: received"), "{log}");
    // The rollout group's weights: every tensor is the checkpoint's, rounded to bf16.
    let saved = d.join("saved");
    ctl_ok(&rs, &["save", "--out", p(&saved), "--model", p(&ck)]);
    let (_, want) = ModelDir::load(&ck).unwrap();
    let (_, got) = ModelDir::load(&saved).unwrap();
    assert_eq!(want.len(), got.len());
    let mut elements = 0;
    for (name, t) in &want {
        let bits = |v: &[f32], round: bool| -> Vec<u32> {
            v.iter()
                .map(|x| if round { round_bf16(*x) } else { *x }.to_bits())
                .collect()
        };
        assert!(
            bits(&got[name].data, false) == bits(&t.data, true),
            "{name} differs from the checkpoint's bf16 weights"
        );
        elements += t.data.len();
    }
    // The trainer's own tensors moved: it did change them.
    let (_, initial) = ModelDir::load(&model).unwrap();
    assert!(want.iter().any(|(n, t)| t.data != initial[n].data));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
    assert_eq!(m["phase"], "transfer", "{m}");
    assert_eq!(m["receivers"], rollout, "{m}");
    // On the CPU an element travels as f32.
    let moved = m["elements"].as_u64().unwrap() as usize;
    assert!(moved >= elements - 64 * 300, "{m}: {elements}");
    assert_eq!(m["bytes"].as_u64().unwrap() as usize, 4 * moved, "{m}");
    assert!(m["buckets"].as_u64().unwrap() >= 1, "{m}");
    assert!(m["gb_per_s"].as_f64().unwrap() > 0.0, "{m}");
    // The rollout group generates with what it received: the rows of an in-process rollout
    // of the checkpoint, with no load.
    let args = |out: &Path| {
        vec![
            "--model".to_string(),
            p(&ck).to_string(),
            "--in".into(),
            p(&d.join("prompts.parquet")).into(),
            "--out".into(),
            p(out).into(),
            "--n".into(),
            "2".into(),
            "--max-new-tokens".into(),
            "5".into(),
            "--raw-prompt".into(),
            "--seed".into(),
            "9".into(),
        ]
    };
    let (here, there) = (d.join("here.parquet"), d.join("there.parquet"));
    ok("rollout", &args(&here));
    let mut remote = args(&there);
    let rm = d.join("there.json");
    remote.extend([
        "--daemon".into(),
        p(&rs).into(),
        "--metrics".into(),
        p(&rm).into(),
    ]);
    ok("rollout", &remote);
    same_rows(&read(&here), &read(&there), "rollout after the transfer");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rm).unwrap()).unwrap();
    assert_eq!(m["daemon"]["reloaded"], false, "{m}");
}

#[test]
fn a_transfer_gives_one_rollout_rank_the_trainers_weights() {
    transfer_case(1, 1);
}

#[test]
fn a_transfer_from_a_group_of_two_gives_every_rollout_rank_the_weights() {
    transfer_case(2, 2);
}
