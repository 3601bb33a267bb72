//! End-to-end runs of the model stages' real binaries on a tiny random model: rollout,
//! ref-logprob, update, sync-weights; their agreement, reproducibility, resume, and bad input.

use crate::stage_util;

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use stage_util::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file};
use tandem::tokenizer::Tokenizer;

const QUESTIONS: [&str; 3] = ["What is 2 + 3?", "Name a colour.", "Count to three."];

#[test]
fn rollout_writes_the_contract_and_its_logprobs_match_ref_logprob() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 1);
    let prompts_path = dir.path().join("prompts.parquet");
    prompts(&prompts_path, &QUESTIONS);
    let out = dir.path().join("rollout.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&prompts_path),
            "--out",
            p(&out),
            "--n",
            "3",
            "--max-new-tokens",
            "12",
            "--seed",
            "5",
            "--temperature",
            "0.8",
            "--step",
            "4",
        ],
    );
    let b = read(&out);
    assert_eq!(b.num_rows(), 9);
    // Rows: the 3 samples of a prompt side by side, grouped by prompt_uid.
    let puids = strings(&b, schema::PROMPT_UID);
    let uids = strings(&b, schema::UID);
    for i in 0..3 {
        assert!(puids[3 * i..3 * i + 3].iter().all(|u| u == &puids[3 * i]));
        for j in 0..3 {
            assert_eq!(uids[3 * i + j], format!("{}-{j}", puids[3 * i]));
        }
    }
    assert_ne!(puids[0], puids[3]);
    assert_eq!(strings(&b, schema::DATA_SOURCE), vec!["test/echo"; 9]);
    assert_eq!(strings(&b, schema::GROUND_TRUTH)[4], "answer 1");
    assert!(b.has(schema::PROMPT) && b.has(schema::EXTRA_INFO));
    // Prompt ids are the ChatML rendering of the question.
    let tok = Tokenizer::from_dir(&model).unwrap();
    let pids = i32_rows(&b, schema::PROMPT_IDS);
    let want = tok
        .encode("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    assert_eq!(pids[3], want.iter().map(|&t| t as i32).collect::<Vec<_>>());
    // Responses: mask all ones, logprobs aligned, finish reasons consistent with EOS / length.
    let rids = i32_rows(&b, schema::RESPONSE_IDS);
    let mask: Vec<Vec<u8>> = b
        .ragged_u8(schema::RESPONSE_MASK)
        .unwrap()
        .rows()
        .map(|r| r.to_vec())
        .collect();
    let lps = f32_rows(&b, schema::ROLLOUT_LOGPROBS);
    let reasons = strings(&b, schema::FINISH_REASON);
    let texts = strings(&b, schema::RESPONSE_TEXT);
    let eos = [
        tok.token_to_id("<|im_end|>").unwrap(),
        tok.token_to_id("<|endoftext|>").unwrap(),
    ];
    for r in 0..9 {
        assert!(!rids[r].is_empty());
        assert!(mask[r].iter().all(|&m| m == 1) && mask[r].len() == rids[r].len());
        assert!(lps[r].iter().all(|&l| l.is_finite() && l <= 0.0));
        let last = *rids[r].last().unwrap() as u32;
        match reasons[r].as_str() {
            "stop" => assert!(eos.contains(&last), "row {r}: {:?} eos {eos:?}", rids[r]),
            "length" => assert_eq!(rids[r].len(), 12),
            other => panic!("finish_reason {other}"),
        }
        let ids: Vec<u32> = rids[r].iter().map(|&t| t as u32).collect();
        assert_eq!(texts[r], tok.decode(&ids, true).unwrap());
    }
    // Samples of one prompt differ.
    assert!(rids[0] != rids[1] || rids[1] != rids[2]);
    assert_eq!(b.meta_u64("policy_version"), Some(0));
    assert_eq!(b.meta_u64("step"), Some(4));
    let params: serde_json::Value = serde_json::from_str(&b.meta["tandem.stage.rollout"]).unwrap();
    assert_eq!(params["n"], 3);
    assert_eq!(params["seed"], 5);

    // ref-logprob with the same weights and temperature gives the same numbers.
    let scored = dir.path().join("old.parquet");
    ok(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&out),
            "--out",
            p(&scored),
            "--column",
            "old_logprobs",
            "--temperature",
            "0.8",
            "--entropy",
            "--micro-batch-tokens",
            "40",
        ],
    );
    let s = read(&scored);
    let old = f32_rows(&s, schema::OLD_LOGPROBS);
    let mut worst = 0.0f32;
    for (a, b) in lps.iter().flatten().zip(old.iter().flatten()) {
        worst = worst.max((a - b).abs());
    }
    assert!(worst < 1e-5, "rollout vs ref-logprob max |diff| = {worst}");
    let ent = f32_rows(&s, "entropy");
    assert!(ent
        .iter()
        .flatten()
        .all(|&e| e > 0.0 && e <= (300f32).ln() + 1e-4));
    // Every input column is kept.
    assert_eq!(f32_rows(&s, schema::ROLLOUT_LOGPROBS), lps);
    assert_eq!(s.meta_u64("policy_version"), Some(0));
}

#[test]
fn samples_do_not_depend_on_the_other_prompts_or_the_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 2);
    let alone = dir.path().join("alone.parquet");
    let many = dir.path().join("many.parquet");
    prompts(&alone, &[QUESTIONS[1]]);
    prompts(
        &many,
        &[QUESTIONS[0], QUESTIONS[1], QUESTIONS[2], QUESTIONS[1]],
    );
    let run_it = |input: &Path, out: &Path, batch: &str| {
        ok(
            "rollout",
            &[
                "--model",
                p(&model),
                "--in",
                p(input),
                "--out",
                p(out),
                "--n",
                "4",
                "--max-new-tokens",
                "10",
                "--seed",
                "11",
                "--batch-size",
                batch,
            ],
        );
        read(out)
    };
    let a = run_it(&alone, &dir.path().join("a.parquet"), "64");
    let m = run_it(&many, &dir.path().join("m.parquet"), "3");
    let (ra, rm) = (
        i32_rows(&a, schema::RESPONSE_IDS),
        i32_rows(&m, schema::RESPONSE_IDS),
    );
    assert_eq!(ra, rm[4..8].to_vec());
    assert_eq!(
        strings(&a, schema::PROMPT_UID)[0],
        strings(&m, schema::PROMPT_UID)[4]
    );
    let (la, lm) = (
        f32_rows(&a, schema::ROLLOUT_LOGPROBS),
        f32_rows(&m, schema::ROLLOUT_LOGPROBS),
    );
    for (x, y) in la.iter().flatten().zip(lm[4..8].iter().flatten()) {
        assert!((x - y).abs() < 1e-5);
    }
    // The repeat of the same prompt (row 3) gets its own samples and uid.
    assert_ne!(rm[4..8].to_vec(), rm[12..16].to_vec());
    assert_ne!(
        strings(&m, schema::PROMPT_UID)[4],
        strings(&m, schema::PROMPT_UID)[12]
    );
    // --limit does not change the samples either.
    let lim = dir.path().join("lim.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&many),
            "--out",
            p(&lim),
            "--n",
            "4",
            "--max-new-tokens",
            "10",
            "--seed",
            "11",
            "--limit",
            "2",
        ],
    );
    let l = read(&lim);
    assert_eq!(l.num_rows(), 8);
    assert_eq!(i32_rows(&l, schema::RESPONSE_IDS), rm[..8].to_vec());
}

#[test]
fn stop_strings_cut_the_text_and_greedy_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    let input = dir.path().join("p.parquet");
    prompts(&input, &[QUESTIONS[0]]);
    let greedy = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(out),
            "--n",
            "2",
            "--temperature",
            "0",
            "--max-new-tokens",
            "24",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        ok("rollout", &args);
        read(out)
    };
    let full = greedy(&dir.path().join("full.parquet"), &[]);
    let ids = i32_rows(&full, schema::RESPONSE_IDS);
    assert_eq!(ids[0], ids[1], "greedy samples are identical");
    assert_eq!(ids[0].len(), 24);
    let text = strings(&full, schema::RESPONSE_TEXT)[0].clone();
    // A stop string made of one clean character a few characters in.
    let (cut, ch) = text
        .char_indices()
        .skip(3)
        .find(|(_, c)| *c != '\u{FFFD}')
        .expect("a decodable character in the greedy text");
    let stop = ch.to_string();
    let first = text.find(&stop).unwrap();
    assert!(first <= cut);
    let stopped = greedy(&dir.path().join("stop.parquet"), &["--stop", &stop]);
    assert_eq!(
        strings(&stopped, schema::FINISH_REASON),
        vec!["stop", "stop"]
    );
    assert_eq!(strings(&stopped, schema::RESPONSE_TEXT)[0], text[..first]);
    let sids = i32_rows(&stopped, schema::RESPONSE_IDS);
    assert!(sids[0].len() < 24 && ids[0].starts_with(&sids[0]));
    assert_eq!(
        f32_rows(&stopped, schema::ROLLOUT_LOGPROBS)[0],
        f32_rows(&full, schema::ROLLOUT_LOGPROBS)[0][..sids[0].len()].to_vec()
    );
}

#[test]
fn sync_weights_publishes_a_pointer_that_rollout_follows() {
    let dir = tempfile::tempdir().unwrap();
    let m1 = tiny_model(dir.path(), 4);
    let m2 = tiny_model(dir.path(), 5);
    let input = dir.path().join("p.parquet");
    prompts(&input, &[QUESTIONS[2]]);
    let ptr = dir.path().join("policy");
    ok("sync-weights", &["--from", p(&m1), "--to", p(&ptr)]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ptr).unwrap()).unwrap();
    assert_eq!(v["policy_version"], 1);
    assert_eq!(
        v["model"], "model-4",
        "a checkpoint under the pointer's directory is relative"
    );
    ok("sync-weights", &["--from", p(&m2), "--to", p(&ptr)]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ptr).unwrap()).unwrap();
    assert_eq!(v["policy_version"], 2);
    assert!(!dir.path().join("policy.tmp").exists());

    let via_ptr = dir.path().join("a.parquet");
    let direct = dir.path().join("b.parquet");
    for (model, out) in [(ptr.as_path(), &via_ptr), (m2.as_path(), &direct)] {
        ok(
            "rollout",
            &[
                "--model",
                p(model),
                "--in",
                p(&input),
                "--out",
                p(out),
                "--n",
                "2",
                "--max-new-tokens",
                "6",
            ],
        );
    }
    let (a, b) = (read(&via_ptr), read(&direct));
    assert_eq!(a.meta_u64("policy_version"), Some(2));
    assert_eq!(b.meta_u64("policy_version"), Some(0));
    assert_eq!(
        i32_rows(&a, schema::RESPONSE_IDS),
        i32_rows(&b, schema::RESPONSE_IDS)
    );

    ok(
        "sync-weights",
        &["--from", p(&m1), "--to", p(&ptr), "--policy-version", "10"],
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ptr).unwrap()).unwrap();
    assert_eq!(v["policy_version"], 10);
    input_error(
        "sync-weights",
        &["--from", p(&dir.path().join("nope")), "--to", p(&ptr)],
        "not a directory",
    );
    input_error(
        "sync-weights",
        &["--from", p(&m1), "--to", p(dir.path())],
        "is a directory",
    );
}

/// A training batch written by hand: two responses to one prompt, advantages +1 / −1.
pub fn training_batch(path: &Path, prompt: &[i32], responses: &[Vec<i32>], adv: &[f32]) {
    let n = responses.len();
    let mut p_off = vec![0];
    let mut p_ids = vec![];
    let mut r_off = vec![0];
    let mut r_ids = vec![];
    let mut a = vec![];
    for (r, &s) in responses.iter().zip(adv) {
        p_ids.extend_from_slice(prompt);
        p_off.push(p_ids.len());
        r_ids.extend_from_slice(r);
        r_off.push(r_ids.len());
        a.extend(std::iter::repeat_n(s, r.len()));
    }
    let total = r_ids.len();
    let cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::UID),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("u{i}")),
            )),
        ),
        (
            schema::field(schema::PROMPT_UID),
            Arc::new(StringArray::from(vec!["p"; n])),
        ),
        (
            schema::field(schema::PROMPT_IDS),
            list_array::<Int32Type>(&p_off, p_ids),
        ),
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(&r_off, r_ids),
        ),
        (
            schema::field(schema::RESPONSE_MASK),
            list_array::<UInt8Type>(&r_off, vec![1; total]),
        ),
        (
            schema::field(schema::ADVANTAGES),
            list_array::<Float32Type>(&r_off, a),
        ),
    ];
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    write_file(path, &data, &BTreeMap::new()).unwrap();
}

fn load_weights(dir: &Path) -> tandem::model::Weights {
    tandem::model::ModelDir::load(dir).unwrap().1
}

#[test]
fn update_saves_state_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 6);
    let batch = dir.path().join("batch.parquet");
    training_batch(
        &batch,
        &[10, 20, 30],
        &[vec![40, 41, 42], vec![50, 51]],
        &[1.0, -1.0],
    );
    let step = |from: &Path, to: &Path, metrics: &Path| {
        ok(
            "update",
            &[
                "--model",
                p(from),
                "--in",
                p(&batch),
                "--out-model",
                p(to),
                "--lr",
                "1e-3",
                "--lr-warmup-steps",
                "1",
                "--lr-schedule",
                "cosine",
                "--total-steps",
                "4",
                "--metrics",
                p(metrics),
            ],
        );
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(metrics).unwrap()).unwrap()
    };
    let (m1, m2) = (dir.path().join("m1"), dir.path().join("m2"));
    let j1 = step(&model, &m1, &dir.path().join("1.json"));
    let j2 = step(&m1, &m2, &dir.path().join("2.json"));
    // Warmup from 0: step 0 has lr 0 (HF/verl), step 1 the full lr.
    assert_eq!(j1["lr"], 0.0);
    assert!((j2["lr"].as_f64().unwrap() - 1e-3).abs() < 1e-12);
    for k in [
        "pg_loss",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "entropy",
        "kl_loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
    ] {
        assert!(j2.get(k).is_some(), "metric {k} missing: {j2}");
    }
    assert_eq!(j2["optimizer_steps"], 1);
    let ts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m2.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(ts["optimizer_step"], 2);
    assert_eq!(ts["schedule_step"], 2);
    assert!(m2.join("optimizer.safetensors").is_file());
    assert!(m2.join("tokenizer.json").is_file() && m2.join("config.json").is_file());

    // The same two steps in one process, optimizer state kept in memory.
    use tandem::engine::train::train;
    let args = <UpdateArgsCli as clap::Parser>::parse_from([
        "update",
        "--model",
        p(&model),
        "--in",
        p(&batch),
        "--out-model",
        "unused",
        "--lr",
        "1e-3",
        "--lr-warmup-steps",
        "1",
        "--lr-schedule",
        "cosine",
        "--total-steps",
        "4",
    ])
    .args;
    let cfg = args.train_config(1.0).unwrap();
    let (mcfg, w0) = tandem::model::ModelDir::load(&model).unwrap();
    let mut dec =
        tandem::model::decoder::Decoder::new(tandem::backend::cpu::Cpu, &mcfg, &w0).unwrap();
    let b = read(&batch);
    let owned = tandem::stage::update::OwnedData::from_batch(&b, &cfg).unwrap();
    for s in 0..2 {
        train(&mut dec, &owned.view(), &cfg, s, &mut |_| {}).unwrap();
    }
    let want = dec.export_weights().unwrap();
    let got = load_weights(&m2);
    for (name, t) in &want {
        let g = &got[name];
        for (a, b) in t.data.iter().zip(&g.data) {
            assert_eq!(
                tandem::model::safetensors::round_bf16(*a).to_bits(),
                b.to_bits(),
                "{name}: in-process {a} vs resumed {b}"
            );
        }
    }

    // --skip-optimizer-state (the daemon's mode between checkpoints): the same weights, no
    // optimizer file, and a later update in another process refuses to continue from it.
    let m2s = dir.path().join("m2-skip");
    ok(
        "update",
        &[
            "--model",
            p(&m1),
            "--in",
            p(&batch),
            "--out-model",
            p(&m2s),
            "--lr",
            "1e-3",
            "--lr-warmup-steps",
            "1",
            "--lr-schedule",
            "cosine",
            "--total-steps",
            "4",
            "--skip-optimizer-state",
        ],
    );
    assert!(!m2s.join("optimizer.safetensors").exists());
    assert_eq!(
        std::fs::read(m2s.join("model.safetensors")).unwrap(),
        std::fs::read(m2.join("model.safetensors")).unwrap()
    );
    let m3 = dir.path().join("m3");
    input_error(
        "update",
        &["--model", p(&m2s), "--in", p(&batch), "--out-model", p(&m3)],
        "kept in the memory of the daemon that trained it",
    );
    assert!(!m3.exists());
}

#[derive(clap::Parser)]
struct UpdateArgsCli {
    #[command(flatten)]
    args: tandem::stage::update::UpdateArgs,
}

#[test]
fn bad_input_exits_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let input = dir.path().join("p.parquet");
    prompts(&input, &[QUESTIONS[0], "word ".repeat(200).as_str()]);
    let out = dir.path().join("out.parquet");
    let rollout = |model: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--model",
            p(model),
            "--in",
            p(&input),
            "--out",
            p(&out),
            "--n",
            "1",
            "--max-new-tokens",
            "4",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let cut = ["--max-prompt-tokens", "64", "--truncate", "left"];
    // A prompt over the limit names its row; --truncate left keeps its end.
    input_error(
        "rollout",
        &rollout(&model, &["--max-prompt-tokens", "64"]),
        "row 1: the prompt has",
    );
    assert!(!out.exists());
    ok(
        "rollout",
        &rollout(&model, &["--max-prompt-tokens", "64", "--truncate", "left"]),
    );
    let b = read(&out);
    let pids = i32_rows(&b, schema::PROMPT_IDS);
    assert_eq!(pids[1].len(), 64);
    std::fs::remove_file(&out).unwrap();
    // Without a GPU (CI), --device cuda is an input error that points to the CPU; with one,
    // the stage runs there.
    let cuda = run(
        "rollout",
        &rollout(
            &model,
            &[
                "--device",
                "cuda",
                "--max-prompt-tokens",
                "64",
                "--truncate",
                "left",
            ],
        ),
    );
    if cuda.status.code() == Some(2) {
        let err = String::from_utf8_lossy(&cuda.stderr);
        assert!(err.contains("use --device cpu"), "{err}");
        assert!(!out.exists());
    } else {
        assert!(
            cuda.status.success(),
            "{}",
            String::from_utf8_lossy(&cuda.stderr)
        );
        assert_eq!(read(&out).num_rows(), 2);
        std::fs::remove_file(&out).unwrap();
    }
    input_error(
        "rollout",
        &rollout(&model, &["--device", "tpu"]),
        "unknown device 'tpu'",
    );
    input_error("rollout", &rollout(&model, &["--top-p", "0"]), "--top-p");

    // Missing weights file.
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model.join(f), broken.join(f)).unwrap();
    }
    let err = input_error("rollout", &rollout(&broken, &cut), "broken");
    assert!(err.contains("safetensors"), "{err}");
    assert!(!out.exists());
    // Unsupported architecture.
    let odd = dir.path().join("odd");
    std::fs::create_dir(&odd).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(model.join(f), odd.join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(model.join("config.json")).unwrap();
    std::fs::write(
        odd.join("config.json"),
        cfg.replace("Qwen2ForCausalLM", "MambaForCausalLM"),
    )
    .unwrap();
    input_error("rollout", &rollout(&odd, &cut), "MambaForCausalLM");
    assert!(!out.exists());
    input_error(
        "rollout",
        &rollout(&dir.path().join("nowhere"), &[]),
        "no such model directory",
    );

    // Token ids beyond the vocabulary.
    let batch = dir.path().join("batch.parquet");
    training_batch(&batch, &[1, 2], &[vec![3, 300], vec![4]], &[1.0, -1.0]);
    let scored = dir.path().join("scored.parquet");
    input_error(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out",
            p(&scored),
            "--column",
            "ref_logprobs",
        ],
        "column 'response_ids', row 0: token id 300",
    );
    assert!(!scored.exists());
    let new_model = dir.path().join("new");
    input_error(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out-model",
            p(&new_model),
        ],
        "row 0: token id 300",
    );
    assert!(!new_model.exists());
    // Columns an option needs.
    training_batch(&batch, &[1, 2], &[vec![3, 5], vec![4]], &[1.0, -1.0]);
    input_error(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out-model",
            p(&new_model),
            "--use-kl-loss",
        ],
        "'ref_logprobs' is missing",
    );
    input_error(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out-model",
            p(&new_model),
            "--lr-schedule",
            "cosine",
        ],
        "--total-steps",
    );
    input_error(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out",
            p(&scored),
            "--column",
            "ref_logprobs",
            "--temperature",
            "0",
        ],
        "--temperature",
    );
    assert!(!new_model.exists() && !scored.exists());
}

/// `rollout` records the temperature of its log-probs in the batch; `ref-logprob` and
/// `update` take theirs at it when `--temperature` is not given and refuse another one. A batch
/// without the key (an older file, `sft-batch`'s) keeps the default of 1.
#[test]
fn downstream_stages_take_the_temperature_rollout_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 9);
    prompts(&d.join("prompts.parquet"), &QUESTIONS[..2]);
    let out = |n: &str| d.join(n);
    let rollout = |temperature: &str, to: &str| {
        ok(
            "rollout",
            &[
                "--model",
                p(&model),
                "--in",
                p(&out("prompts.parquet")),
                "--out",
                p(&out(to)),
                "--n",
                "2",
                "--max-new-tokens",
                "6",
                "--temperature",
                temperature,
            ],
        );
        read(&out(to))
    };
    let key = tandem::batch::schema::meta::LOGPROB_TEMPERATURE;
    let r = rollout("0.7", "r.parquet");
    assert_eq!(r.meta[key], "0.7");
    // Greedy sampling reports log-probs at temperature 1.
    assert_eq!(rollout("0", "greedy.parquet").meta[key], "1");

    let logprobs = |extra: &[&str], to: &str| {
        let mut args = vec![
            "--model".to_string(),
            p(&model).into(),
            "--in".into(),
            p(&out("r.parquet")).into(),
            "--out".into(),
            p(&out(to)).into(),
            "--column".into(),
            "old_logprobs".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        run("ref-logprob", &args)
    };
    // Without --temperature: the recorded one, so the policy's log-probs are the rollout's.
    assert!(logprobs(&[], "old.parquet").status.success());
    let old = read(&out("old.parquet"));
    let lps = f32_rows(&r, schema::ROLLOUT_LOGPROBS);
    let worst = lps
        .iter()
        .flatten()
        .zip(f32_rows(&old, schema::OLD_LOGPROBS).iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "rollout vs ref-logprob max |diff| = {worst}");
    let params: serde_json::Value =
        serde_json::from_str(&old.meta["tandem.stage.ref-logprob"]).unwrap();
    assert_eq!(params["temperature"].as_f64().unwrap() as f32, 0.7);
    assert_eq!(old.meta[key], "0.7");
    // The same temperature given explicitly writes the same file.
    assert!(logprobs(&["--temperature", "0.7"], "old2.parquet")
        .status
        .success());
    assert_eq!(
        std::fs::read(out("old.parquet")).unwrap(),
        std::fs::read(out("old2.parquet")).unwrap()
    );
    // Another one is refused, naming the file, both temperatures and what to do.
    let o = logprobs(&["--temperature", "1"], "bad.parquet");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{}: rollout sampled this batch at temperature 0.7 (metadata {key}), but --temperature 1 was given",
            out("r.parquet").display()
        )) && err.contains("drop --temperature (the recorded 0.7 is used) or pass --temperature 0.7"),
        "{err}"
    );
    assert!(!out("bad.parquet").exists());

    // update: advantages on the rollout's rows; the same rule.
    let rids = i32_rows(&r, schema::RESPONSE_IDS);
    let prompt = i32_rows(&r, schema::PROMPT_IDS)[0].clone();
    let adv: Vec<f32> = (0..rids.len())
        .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    // A batch without the key (as sft-batch and files from before it write them) ...
    training_batch(&out("plain.parquet"), &prompt, &rids, &adv);
    assert!(!read(&out("plain.parquet")).meta.contains_key(key));
    // ... and the same rows with the key rollout writes.
    let plain = read(&out("plain.parquet"));
    let mut kv = plain.meta.clone();
    kv.remove(tandem::batch::schema::meta::ARROW_SCHEMA);
    kv.insert(key.to_string(), "0.7".to_string());
    write_file(&out("sampled.parquet"), &plain.data, &kv).unwrap();
    let update = |input: &str, extra: &[&str], to: &str| {
        let mut args = vec![
            "--model".to_string(),
            p(&model).into(),
            "--in".into(),
            p(&out(input)).into(),
            "--out-model".into(),
            p(&out(to)).into(),
            "--lr".into(),
            "0.01".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        run("update", &args)
    };
    let weights = |m: &str| std::fs::read(out(m).join("model.safetensors")).unwrap();
    for (input, extra, to) in [
        ("sampled.parquet", &[][..], "m-recorded"),
        (
            "sampled.parquet",
            &["--temperature", "0.7"][..],
            "m-explicit",
        ),
        ("plain.parquet", &["--temperature", "0.7"][..], "m-plain-07"),
        ("plain.parquet", &[][..], "m-plain"),
        ("plain.parquet", &["--temperature", "1"][..], "m-plain-1"),
    ] {
        let o = update(input, extra, to);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(weights("m-recorded"), weights("m-explicit"));
    assert_eq!(weights("m-recorded"), weights("m-plain-07"));
    assert_eq!(weights("m-plain"), weights("m-plain-1"));
    assert_ne!(weights("m-recorded"), weights("m-plain"));
    let o = update("sampled.parquet", &["--temperature", "1.5"], "m-bad");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("rollout sampled this batch at temperature 0.7")
            && err.contains("but --temperature 1.5 was given"),
        "{err}"
    );
    assert!(!out("m-bad").exists());
}

/// The metadata of the Arrow schema embedded in a file (`ARROW:schema`), alone: what pyarrow
/// shows as `pq.read_table(f).schema.metadata`.
fn embedded_schema_metadata(path: &Path) -> BTreeMap<String, String> {
    tandem::batch::Batch::embedded_schema_metadata(path).unwrap()
}

/// `python3` with pyarrow, when this machine has it.
fn pyarrow() -> Option<&'static str> {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import pyarrow"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some("python3")
}

/// A verl prompt file with a custom `difficulty` column, and a `score` column (named like a
/// stage's own output).
fn prompts_with_custom_columns(path: &Path, questions: &[&str]) {
    use arrow_array::{Float32Array, Int64Array};
    prompts(path, questions);
    let b = read(path);
    let n = b.num_rows() as i64;
    let mut fields: Vec<Field> = b
        .data
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    let mut cols: Vec<ArrayRef> = b.data.columns().to_vec();
    fields.push(Field::new(
        "difficulty",
        arrow_schema::DataType::Int64,
        true,
    ));
    cols.push(Arc::new(Int64Array::from(
        (0..n).map(|i| 10 * i + 1).collect::<Vec<_>>(),
    )));
    fields.push(Field::new("score", arrow_schema::DataType::Float32, true));
    cols.push(Arc::new(Float32Array::from(vec![0.5; n as usize])));
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
    write_file(path, &data, &BTreeMap::new()).unwrap();
}

#[test]
fn every_dataset_column_survives_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    let prompts_path = dir.path().join("prompts.parquet");
    prompts_with_custom_columns(&prompts_path, &QUESTIONS);
    let f = |name: &str| dir.path().join(name);
    let (rollout, scored, refd, adv) = (
        f("rollout.parquet"),
        f("scored.parquet"),
        f("ref.parquet"),
        f("adv.parquet"),
    );
    let out = ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&prompts_path),
            "--out",
            p(&rollout),
            "--n",
            "2",
            "--max-new-tokens",
            "4",
            "--step",
            "9",
        ],
    );
    // The dataset's `score` column names a stage's output: left out, and said so.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("left out the dataset's columns score"),
        "{err}"
    );
    ok(
        "score",
        &[
            "--in",
            p(&rollout),
            "--out",
            p(&scored),
            "--reward",
            "exact",
        ],
    );
    ok(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&scored),
            "--out",
            p(&refd),
            "--column",
            "ref_logprobs",
        ],
    );
    ok(
        "advantage",
        &["--in", p(&refd), "--out", p(&adv), "--estimator", "grpo"],
    );

    let source = read(&prompts_path);
    for file in [&rollout, &scored, &refd, &adv] {
        let b = read(file);
        assert_eq!(b.num_rows(), 6, "{}", file.display());
        // Every dataset column, each row carrying its prompt's value (two samples a prompt).
        for col in [
            "data_source",
            "prompt",
            "ability",
            "reward_model",
            "extra_info",
            "difficulty",
        ] {
            let want = source.json_rows(col);
            let got = b.json_rows(col);
            let expected: Vec<_> = (0..6).map(|i| want[i / 2].clone()).collect();
            assert_eq!(got, expected, "{}: column {col}", file.display());
        }
        assert_eq!(strings(&b, schema::GROUND_TRUTH)[3], "answer 1");
        // The schema metadata is in the footer and in the embedded Arrow schema.
        let embedded = embedded_schema_metadata(file);
        for key in [
            "tandem.schema",
            "policy_version",
            "step",
            "tandem.stage.rollout",
        ] {
            assert_eq!(
                embedded.get(key),
                b.meta.get(key),
                "{}: {key}",
                file.display()
            );
            assert!(embedded.contains_key(key), "{}: {key}", file.display());
        }
        assert_eq!(embedded["step"], "9");
    }
    for (file, stage) in [
        (&scored, "score"),
        (&refd, "ref-logprob"),
        (&adv, "advantage"),
    ] {
        let key = format!("tandem.stage.{stage}");
        assert!(embedded_schema_metadata(file).contains_key(&key), "{key}");
    }
    // The scored file's `score` is the reward's, not the dataset's 0.5.
    assert!(read(&scored)
        .f32s(schema::SCORE)
        .unwrap()
        .iter()
        .all(|&s| s == 0.0 || s == 1.0));

    // pyarrow (when installed) shows the metadata as the schema's own.
    if let Some(python) = pyarrow() {
        let o = std::process::Command::new(python)
            .args([
                "-c",
                "import sys, pyarrow.parquet as pq; m = pq.read_table(sys.argv[1]).schema.metadata; print(m[b'tandem.schema'].decode(), m[b'policy_version'].decode(), m[b'step'].decode(), sorted(pq.read_table(sys.argv[1]).column_names))",
                p(&adv),
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(text.starts_with("1 0 9 "), "{text}");
        assert!(
            text.contains("'difficulty'") && text.contains("'reward_model'"),
            "{text}"
        );
    } else {
        eprintln!("pyarrow is not installed: the pyarrow view of the metadata is not checked");
    }
}

#[test]
fn a_batch_with_no_rows_is_refused_by_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 4);
    let empty = dir.path().join("empty.parquet");
    training_batch(&empty, &[1, 2], &[], &[]);
    // With every column the stages read, so that only the row count is wrong.
    let b = read(&empty);
    let mut cols = tandem::batch::NewColumns::new();
    cols.add(
        schema::RESPONSE_TEXT,
        Arc::new(StringArray::from(Vec::<&str>::new())),
    );
    cols.add(
        schema::SCORE,
        Arc::new(arrow_array::Float32Array::from(Vec::<f32>::new())),
    );
    cols.add_field(
        Field::new(schema::GROUND_TRUTH, arrow_schema::DataType::Utf8, true),
        Arc::new(StringArray::from(Vec::<&str>::new())),
    );
    write_file(&empty, &b.with_columns(cols).unwrap(), &BTreeMap::new()).unwrap();
    let out = dir.path().join("out.parquet");
    let new_model = dir.path().join("new");
    let want = "empty.parquet: the batch has no rows";
    input_error(
        "score",
        &["--in", p(&empty), "--out", p(&out), "--reward", "exact"],
        want,
    );
    input_error(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&empty),
            "--out",
            p(&out),
            "--column",
            "ref_logprobs",
        ],
        want,
    );
    input_error(
        "advantage",
        &["--in", p(&empty), "--out", p(&out), "--estimator", "grpo"],
        want,
    );
    input_error(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&empty),
            "--out-model",
            p(&new_model),
        ],
        want,
    );
    let no_prompts = dir.path().join("none.parquet");
    prompts(&no_prompts, &[]);
    input_error(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&no_prompts),
            "--out",
            p(&out),
        ],
        "none.parquet: the dataset has no rows",
    );
    assert!(!out.exists() && !new_model.exists());
}

#[test]
fn impossible_flag_values_are_refused_with_their_range() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 5);
    let input = dir.path().join("p.parquet");
    prompts(&input, &QUESTIONS[..1]);
    let out = dir.path().join("out.parquet");
    let base = ["--model", p(&model), "--in", p(&input), "--out", p(&out)];
    for (flag, value, want) in [
        ("--max-new-tokens", "0", "must be an integer >= 1"),
        ("--temperature", "-1", "must be a finite number >= 0"),
        ("--top-p", "1.5", "must be a finite number in (0, 1]"),
        (
            "--top-k",
            "-3",
            "must be -1 (all tokens) or an integer >= 1",
        ),
        ("--limit", "0", "must be an integer >= 1"),
        ("--n", "0", "must be an integer >= 1"),
    ] {
        let mut args = base.to_vec();
        args.extend([flag, value]);
        let err = input_error("rollout", &args, want);
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag} <")),
            "{flag} {value}: {err}"
        );
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    assert!(!out.exists());
}

#[test]
fn update_carries_the_tokenizer_and_templates_and_refuses_a_model_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 8);
    // The files HF keeps next to a model besides the weights.
    let extra = [
        ("chat_template.jinja", "{{ messages[0].content }}"),
        ("chat_template.json", "{\"chat_template\": \"x\"}"),
        ("special_tokens_map.json", "{\"eos_token\": \"<|im_end|>\"}"),
        ("vocab.json", "{}"),
        ("merges.txt", "#version: 0.2\n"),
        ("additional_chat_templates/tool_use.jinja", "{{ tools }}"),
    ];
    std::fs::create_dir_all(model.join("additional_chat_templates")).unwrap();
    for (name, text) in extra {
        std::fs::write(model.join(name), text).unwrap();
    }
    let generation = model.join("generation_config.json");
    let mut g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&generation).unwrap()).unwrap();
    g["top_p"] = serde_json::json!(0.8);
    std::fs::write(&generation, g.to_string()).unwrap();
    let batch = dir.path().join("batch.parquet");
    training_batch(&batch, &[10, 20], &[vec![40, 41], vec![50]], &[1.0, -1.0]);
    let new_model = dir.path().join("new");
    ok(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out-model",
            p(&new_model),
        ],
    );
    for name in ["tokenizer.json", "tokenizer_config.json"]
        .into_iter()
        .chain(extra.iter().map(|(n, _)| *n))
    {
        assert_eq!(
            std::fs::read(new_model.join(name)).ok(),
            std::fs::read(model.join(name)).ok(),
            "{name}"
        );
    }
    let g2: serde_json::Value =
        serde_json::from_slice(&std::fs::read(new_model.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(g2["top_p"], 0.8);
    // The written model is usable by rollout as it is.
    let prompts_path = dir.path().join("p.parquet");
    prompts(&prompts_path, &QUESTIONS[..1]);
    let out = dir.path().join("r.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&new_model),
            "--in",
            p(&prompts_path),
            "--out",
            p(&out),
            "--n",
            "1",
            "--max-new-tokens",
            "2",
            "--raw-prompt",
        ],
    );

    // Without tokenizer.json: refused before training, nothing written.
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let other = dir.path().join("other");
    input_error(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&batch),
            "--out-model",
            p(&other),
        ],
        "no tokenizer.json; the model `update` writes would have no tokenizer",
    );
    assert!(!other.exists());
    // Nor does sync-weights publish such a checkpoint as the policy.
    let pointer = dir.path().join("policy");
    input_error(
        "sync-weights",
        &["--from", p(&model), "--to", p(&pointer)],
        "no tokenizer.json; it would become the policy without a tokenizer",
    );
    assert!(!pointer.exists());
}
