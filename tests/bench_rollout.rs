//! `tandem bench rollout --model DIR --prompts FILE`: a real model directory on a dataset's
//! prompts, ending at its EOS ids (issue 35's EOS-on case against vLLM), on the CPU with a tiny
//! random model: the cases file holds what bench/peer_vllm.py reads, with the prompt ids
//! `rollout` feeds the model; the length distribution is that of `rollout`'s own samples; bad
//! --prompts and --model are refused with exit code 2.

use crate::stage_util::{self, input_error, ok, p, tiny_model};
use arrow_array::{RecordBatch, StringArray};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

const QUESTIONS: [&str; 3] = [
    "What is 2 + 3?",
    "Name a colour.",
    "Count to four, please, slowly.",
];

/// `bench rollout` of the tiny model on the three prompts, 2 and 1 samples each, writing the
/// cases to `cases`; returns the report's JSON line.
fn bench(model: &Path, prompts: &Path, cases: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "bench",
        "rollout",
        "--device",
        "cpu",
        "--model",
        p(model),
        "--prompts",
        p(prompts),
        "--limit",
        "3",
        "--n",
        "2,1",
        "--new-tokens",
        "12",
        "--modes",
        "eager",
        "--runs",
        "1",
        "--batches",
        "4",
        "--cases-out",
        p(cases),
    ];
    args.extend_from_slice(extra);
    let out = ok("tandem", &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// Gives the model 42 EOS ids (of 300) in config.json and generation_config.json: with its
/// near-uniform logits a sample then ends after ~7 tokens, so lengths differ.
fn many_eos(model: &Path) -> Vec<u32> {
    let eos: Vec<u32> = (0..40).chain([256, 258]).collect();
    for file in ["config.json", "generation_config.json"] {
        let path = model.join(file);
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["eos_token_id"] = serde_json::json!(eos);
        std::fs::write(&path, v.to_string()).unwrap();
    }
    eos
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn prompt_cases_run_rollouts_prompt_ids_and_report_its_lengths() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 5);
    let eos = many_eos(&model);
    let prompts = d.path().join("prompts.parquet");
    stage_util::prompts(&prompts, &QUESTIONS);
    let cases = d.path().join("cases.json");
    let report = bench(&model, &prompts, &cases, &[]);

    // What bench/peer_vllm.py reads: the model directory, its config, and per case the prompt
    // ids, n, the cap, no random stops and the model's EOS ids.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&cases).unwrap()).unwrap();
    let dir = model.canonicalize().unwrap();
    assert_eq!(doc["model_dir"], dir.to_str().unwrap());
    assert_eq!(doc["config"]["vocab_size"], 300);
    let cs = doc["cases"].as_array().unwrap();
    assert_eq!(cs.len(), 2);
    for (c, n) in cs.iter().zip([2, 1]) {
        assert_eq!(c["n"], n);
        assert_eq!(c["max_new_tokens"], 12);
        assert_eq!(c["random_stops"], false);
        assert_eq!(c["stop_token_ids"], serde_json::json!(eos));
        assert_eq!(c["prompts"].as_array().unwrap().len(), 3);
        assert!(c["case"].as_str().unwrap().ends_with("EOS"), "{c}");
    }

    // The same prompts and keys through `rollout`: the prompt ids are the ones it feeds (the
    // chat template's rendering), and its samples have the lengths the bench reports.
    let out = d.path().join("rollout.parquet");
    let flags = [
        "--n",
        "2",
        "--max-new-tokens",
        "12",
        "--seed",
        "0",
        "--device",
        "cpu",
    ];
    let mut args = vec!["--model", p(&model), "--in", p(&prompts), "--out", p(&out)];
    args.extend_from_slice(&flags);
    ok("rollout", &args);
    let batch = stage_util::read(&out);
    let fed = stage_util::i32_rows(&batch, "prompt_ids");
    for (i, prompt) in cs[0]["prompts"].as_array().unwrap().iter().enumerate() {
        let want: Vec<i64> = fed[2 * i].iter().map(|&t| t as i64).collect();
        assert_eq!(ids(prompt), want, "prompt {i}");
    }
    let mut lens: Vec<usize> = stage_util::i32_rows(&batch, "response_ids")
        .iter()
        .map(|r| r.len())
        .collect();
    lens.sort_unstable();
    assert!(lens[0] < lens[5], "every sample as long: {lens:?}");
    let run = &report["cases"][0];
    assert_eq!(run["samples"], 6);
    let got = &run["lengths"];
    assert_eq!(got["max"], *lens.last().unwrap());
    // Nearest rank of 6 samples: p50 is the 3rd, p90 and p99 the 6th.
    assert_eq!(
        (got["p50"].as_u64(), got["p99"].as_u64()),
        (Some(lens[2] as u64), Some(lens[5] as u64))
    );
    let mean = lens.iter().sum::<usize>() as f64 / 6.0;
    assert!(
        (got["mean"].as_f64().unwrap() - mean).abs() < 1e-9,
        "{got} vs {lens:?}"
    );
    let at_cap = lens.iter().filter(|&&l| l == 12).count() as f64 / 6.0;
    assert!((got["at_cap_fraction"].as_f64().unwrap() - at_cap).abs() < 1e-9);
    assert_eq!(run["new_tokens"], lens.iter().sum::<usize>());

    // --fixed-lengths: no stop ids, every sample at the cap.
    let report = bench(&model, &prompts, &cases, &["--fixed-lengths"]);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&cases).unwrap()).unwrap();
    assert_eq!(doc["cases"][0]["stop_token_ids"], Value::Array(vec![]));
    let l = &report["cases"][1]["lengths"];
    assert_eq!((l["p50"].as_u64(), l["max"].as_u64()), (Some(12), Some(12)));
    assert_eq!(l["at_cap_fraction"], 1.0);
}

#[test]
fn bad_prompts_and_models_exit_2_naming_them() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 6);
    let cases = d.path().join("cases.json");
    let run = |model: &str, prompts: &Path, needle: &str| {
        let args = [
            "bench",
            "rollout",
            "--device",
            "cpu",
            "--model",
            model,
            "--prompts",
            p(prompts),
            "--cases-out",
            p(&cases),
        ];
        input_error("tandem", &args, needle);
        assert!(!cases.exists(), "a refused bench wrote its cases");
    };
    let missing = d.path().join("missing.parquet");
    run(p(&model), &missing, "missing.parquet");

    // A parquet without the `prompt` column.
    let no_prompt = d.path().join("questions.parquet");
    let questions: Arc<StringArray> = Arc::new(StringArray::from(QUESTIONS.to_vec()));
    let data = RecordBatch::try_from_iter([("question", questions as _)]).unwrap();
    tandem::batch::write_file(&no_prompt, &data, &Default::default()).unwrap();
    let err = input_error(
        "tandem",
        &[
            "bench",
            "rollout",
            "--device",
            "cpu",
            "--model",
            p(&model),
            "--prompts",
            p(&no_prompt),
        ],
        "questions.parquet",
    );
    assert!(err.contains("prompt"), "{err}");

    // Prompts need a model directory's tokenizer and template, not a shape.
    let prompts = d.path().join("prompts.parquet");
    stage_util::prompts(&prompts, &QUESTIONS);
    run("qwen1.5b", &prompts, "--prompts needs --model DIR");
    run(
        "/no/such/model",
        &prompts,
        "--model /no/such/model: not a model directory",
    );
}
