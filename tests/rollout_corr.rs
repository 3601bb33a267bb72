//! Rollout correction with the real binaries on the CPU (whose kernels are batch-invariant):
//! bypass mode (the rollout's log-probs as the old ones, refused for another policy_version,
//! a batch with old_logprobs, or a rollout that was not batch-invariant), the mismatch metrics
//! `update` writes against values computed from the columns, truncated (TIS) and masked (MIS)
//! importance sampling.

use crate::stage_util;

use stage_util::{
    add_advantages, f32_rows, i32_rows, input_error, ok, p, prompts, read, run, tiny_model,
    with_column, with_f32_rows,
};
use std::path::Path;
use tandem::batch::schema::meta;

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Every file of a model directory, by name.
fn files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|f| {
            let f = f.unwrap();
            let name = f.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(f.path()).unwrap())
        })
        .collect()
}

fn close(got: &serde_json::Value, want: f64, what: &str) {
    let g = got.as_f64().unwrap_or_else(|| panic!("{what}: {got}"));
    assert!(
        (g - want).abs() <= 1e-9 * want.abs().max(1.0),
        "{what}: got {g}, want {want}"
    );
}

/// `update` arguments: `model`, `d/input`, `d/out`, lr 0.01, metrics to `d/out.json`, `extra`.
fn update_args(model: &Path, d: &Path, input: &str, out: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--model", p(model), "--in", p(&d.join(input))]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["--out-model".into(), p(&d.join(out)).into()]);
    a.extend(["--lr".into(), "0.01".into(), "--metrics".into()]);
    a.push(p(&d.join(format!("{out}.json"))).into());
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// A tiny model and a CPU rollout of it (r.parquet, policy_version 0) in `d`.
fn rollout(d: &Path) -> std::path::PathBuf {
    let model = tiny_model(d, 21);
    prompts(
        &d.join("prompts.parquet"),
        &["one two", "three", "four five six"],
    );
    ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&d.join("prompts.parquet")),
            "--out",
            p(&d.join("r.parquet")),
            "--n",
            "2",
            "--max-new-tokens",
            "6",
            "--seed",
            "3",
        ],
    );
    model
}

#[test]
fn bypass_mode_takes_the_rollout_logprobs_as_the_old_ones() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = rollout(d);
    let f = |n: &str| d.join(n);
    // The CPU rollout says its log-probs are the trainer's, for policy_version 0.
    let r = read(&f("r.parquet"));
    assert_eq!(r.meta[meta::OLD_LOGPROBS], "rollout");
    assert_eq!(r.meta[meta::POLICY_VERSION], "0");
    // The old-logprob pass, then a batch whose rollout log-probs are exactly those.
    ok(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&f("r.parquet")),
            "--out",
            p(&f("old.parquet")),
            "--column",
            "old_logprobs",
        ],
    );
    let old = f32_rows(&read(&f("old.parquet")), "old_logprobs");
    with_f32_rows(
        &f("r.parquet"),
        &f("agree.parquet"),
        "rollout_logprobs",
        &old,
    );
    add_advantages(&f("old.parquet"), &f("adv-old.parquet"));
    add_advantages(&f("agree.parquet"), &f("adv-agree.parquet"));
    add_advantages(&f("r.parquet"), &f("adv-r.parquet"));
    let update = |input: &str, out: &str, extra: &[&str]| {
        let mut e = vec!["--mini-batch-size", "4"];
        e.extend_from_slice(extra);
        update_args(&model, d, input, out, &e)
    };
    // With the old-logprob pass, and in bypass mode on the same log-probs: the same update.
    ok("update", &update("adv-old.parquet", "with-pass", &[]));
    ok(
        "update",
        &update("adv-agree.parquet", "bypass", &["--bypass-mode"]),
    );
    let (a, b) = (files(&f("with-pass")), files(&f("bypass")));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in &a {
        assert!(v == &b[k], "{k}: bypass mode trained differently");
    }
    let m = json(&f("bypass.json"));
    assert_eq!(m["bypass_mode"], true);
    // Bypass: measured on the first mini-batch (4 rows), before any optimizer step.
    assert_eq!(m["mismatch"]["source"], "first_step", "{m}");
    assert_eq!(m["mismatch"]["sequences"], 4, "{m}");
    assert_eq!(
        json(&f("with-pass.json"))["mismatch"]["source"],
        "old_logprobs"
    );
    // The plain rollout batch trains in bypass mode too (no old_logprobs anywhere).
    ok(
        "update",
        &update("adv-r.parquet", "bypass-r", &["--bypass-mode"]),
    );
    // The rollout's log-probs are what the ratios are taken against: shifted ones train
    // differently.
    let shifted: Vec<Vec<f32>> = old
        .iter()
        .map(|r| r.iter().map(|&x| x - 0.3).collect())
        .collect();
    with_f32_rows(
        &f("adv-agree.parquet"),
        &f("adv-shift.parquet"),
        "rollout_logprobs",
        &shifted,
    );
    ok(
        "update",
        &update("adv-shift.parquet", "bypass-shift", &["--bypass-mode"]),
    );
    assert_ne!(
        std::fs::read(f("bypass-shift/model.safetensors")).unwrap(),
        a["model.safetensors"]
    );
    let ms = json(&f("bypass-shift.json"));
    // The trainer's first forward equals the old pass's log-probs up to f32 rounding.
    let shift = ms["mismatch"]["abs_diff_mean"].as_f64().unwrap();
    assert!((shift - 0.3).abs() < 1e-5, "{ms}");

    // Refusals: exit 2, the file and both versions named, nothing written.
    ok(
        "sync-weights",
        &[
            "--from",
            p(&model),
            "--to",
            p(&f("policy")),
            "--policy-version",
            "1",
        ],
    );
    let mut a = update("adv-r.parquet", "x", &["--bypass-mode"]);
    a[1] = p(&f("policy")).into();
    let err = input_error(
        "update",
        &a,
        "rollout sampled this batch with policy_version 0",
    );
    assert!(
        err.contains(&format!("--model {} is policy_version 1", p(&f("policy"))))
            && err.contains("adv-r.parquet"),
        "{err}"
    );
    input_error(
        "update",
        &update("adv-old.parquet", "x", &["--bypass-mode"]),
        "adv-old.parquet: has an old_logprobs column, but --bypass-mode",
    );
    // A rollout that was not batch-invariant records no tandem.old_logprobs.
    let b = read(&f("adv-r.parquet"));
    let mut kv = b.meta.clone();
    kv.remove(meta::OLD_LOGPROBS);
    tandem::batch::write_file(&f("adv-fast.parquet"), &b.data, &kv).unwrap();
    input_error(
        "update",
        &update("adv-fast.parquet", "x", &["--bypass-mode"]),
        "but this batch's metadata tandem.old_logprobs is absent",
    );
    input_error(
        "update",
        &update(
            "adv-r.parquet",
            "x",
            &["--bypass-mode", "--rollout-is", "token"],
        ),
        "which is 1 under --bypass-mode",
    );
    assert!(!f("x").exists());
}

#[test]
fn mismatch_metrics_truncated_and_masked_importance_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = rollout(d);
    let f = |n: &str| d.join(n);
    // Old log-probs that differ from the rollout's by ln 2 on even rows and agree on odd ones.
    let roll = f32_rows(&read(&f("r.parquet")), "rollout_logprobs");
    let old: Vec<Vec<f32>> = roll
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let shift = if i % 2 == 0 { 2f32.ln() } else { 0.0 };
            r.iter().map(|&x| x + shift).collect()
        })
        .collect();
    with_f32_rows(&f("r.parquet"), &f("old.parquet"), "old_logprobs", &old);
    add_advantages(&f("old.parquet"), &f("adv.parquet"));
    let update = |input: &str, out: &str, extra: &[&str]| {
        ok("update", &update_args(&model, d, input, out, extra));
        json(&f(&format!("{out}.json")))
    };

    // The mismatch from the columns: Δ = old − rollout over every response token.
    let deltas: Vec<Vec<f64>> = old
        .iter()
        .zip(&roll)
        .map(|(o, r)| {
            o.iter()
                .zip(r)
                .map(|(&a, &b)| a as f64 - b as f64)
                .collect()
        })
        .collect();
    let all: Vec<f64> = deltas.iter().flatten().copied().collect();
    let n = all.len() as f64;
    let even_tokens: usize = deltas.iter().step_by(2).map(Vec::len).sum();
    assert!(even_tokens > 0 && (even_tokens as f64) < n);
    let m = update("adv.parquet", "plain", &[]);
    let mm = &m["mismatch"];
    assert_eq!(mm["source"], "old_logprobs");
    assert_eq!(mm["tokens"], all.len());
    close(
        &mm["abs_diff_mean"],
        all.iter().map(|x| x.abs()).sum::<f64>() / n,
        "abs_diff_mean",
    );
    close(
        &mm["abs_diff_max"],
        all.iter().fold(0.0, |a, x| a.max(x.abs())),
        "abs_diff_max",
    );
    // ln 2 is far outside [0.99, 1.01], 0 inside.
    close(&mm["ratio_outside_frac"], even_tokens as f64 / n, "outside");
    close(
        &mm["kl_k3"],
        all.iter().map(|x| x.exp() - x - 1.0).sum::<f64>() / n,
        "kl_k3",
    );
    close(&mm["kl_k1"], -all.iter().sum::<f64>() / n, "kl_k1");

    // TIS: weights exp(old − rollout) = 2 on even rows, truncated at 1.5.
    let m = update(
        "adv.parquet",
        "tis",
        &["--rollout-is", "token", "--rollout-is-threshold", "1.5"],
    );
    close(
        &m["rollout_is"]["truncated_frac"],
        even_tokens as f64 / n,
        "truncated",
    );
    close(
        &m["rollout_is"]["weight_mean"],
        (1.5 * even_tokens as f64 + (n - even_tokens as f64)) / n,
        "weight mean",
    );

    // MIS: the even rows' tokens leave the loss; the update is the one of a batch whose even
    // rows are masked out.
    let m = update(
        "adv.parquet",
        "mis",
        &["--rollout-rs", "token", "--rollout-rs-threshold", "1.5"],
    );
    let rs = &m["rollout_rs"];
    close(
        &rs["masked_token_frac"],
        even_tokens as f64 / n,
        "masked tokens",
    );
    let rows = deltas.iter().filter(|r| !r.is_empty()).count();
    let even_rows = deltas.iter().step_by(2).filter(|r| !r.is_empty()).count();
    close(
        &rs["masked_seq_frac"],
        even_rows as f64 / rows as f64,
        "masked seqs",
    );
    let resp = i32_rows(&read(&f("adv.parquet")), "response_ids");
    let mut offsets = vec![0usize];
    let mut mask = Vec::new();
    for (i, r) in resp.iter().enumerate() {
        mask.extend(std::iter::repeat_n(u8::from(i % 2 == 1), r.len()));
        offsets.push(mask.len());
    }
    with_column(
        &f("adv.parquet"),
        &f("masked.parquet"),
        "response_mask",
        tandem::batch::list_array::<arrow_array::types::UInt8Type>(&offsets, mask),
    );
    update("masked.parquet", "by-hand", &[]);
    assert_eq!(
        std::fs::read(f("mis/model.safetensors")).unwrap(),
        std::fs::read(f("by-hand/model.safetensors")).unwrap(),
        "MIS is not the update without the rejected tokens"
    );
    assert_ne!(
        std::fs::read(f("mis/model.safetensors")).unwrap(),
        std::fs::read(f("plain/model.safetensors")).unwrap()
    );

    // MIS needs the old log-probs; bad bounds are refused by the flag checks.
    add_advantages(&f("r.parquet"), &f("adv-r.parquet"));
    let base = |input: &str| {
        vec![
            "--model".to_string(),
            p(&model).into(),
            "--in".into(),
            p(&f(input)).into(),
            "--out-model".into(),
            p(&f("x")).into(),
        ]
    };
    let mut a = base("adv-r.parquet");
    a.extend(["--rollout-rs".into(), "sequence".into()]);
    input_error(
        "update",
        &a,
        "column 'old_logprobs' is missing; it is needed by --rollout-rs",
    );
    let mut a = base("adv.parquet");
    a.extend(
        [
            "--rollout-rs",
            "geometric",
            "--rollout-rs-threshold-lower",
            "5",
        ]
        .map(String::from),
    );
    input_error("update", &a, "--rollout-rs-threshold-lower must be");
    assert!(!f("x").exists());
    let out = run("update", &["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--rollout-rs") && help.contains("--bypass-mode"));
}
