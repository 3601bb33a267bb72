//! `rollout` on the paged engine, through the real binary: the scheduler limits
//! (--max-num-seqs, --max-batched-tokens: few seats, prompts prefilled in chunks) and overlap
//! scheduling (--no-overlap) do not change the samples, the metrics report the KV pool and the
//! queued steps, and bad limits are input errors.

use crate::stage_util;

use stage_util::*;
use tandem::batch::{schema, Batch};

const QUESTIONS: [&str; 3] = ["What is 2 + 3?", "Name a colour.", "Count to three."];

/// The rollout log-probs of two runs agree to the CPU GEMM's rounding (it blocks rows by the
/// step's row count).
fn logprobs_close(a: &Batch, b: &Batch) {
    for (x, y) in f32_rows(a, schema::ROLLOUT_LOGPROBS)
        .iter()
        .flatten()
        .zip(f32_rows(b, schema::ROLLOUT_LOGPROBS).iter().flatten())
    {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}

#[test]
fn scheduler_limits_do_not_change_the_samples() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 4);
    let input = dir.path().join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let run_it = |name: &str, extra: &[&str]| {
        let out = dir.path().join(format!("{name}.parquet"));
        let metrics = dir.path().join(format!("{name}.json"));
        let mut args = vec![
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(&out),
            "--n",
            "3",
            "--max-new-tokens",
            "12",
            "--seed",
            "5",
            "--metrics",
            p(&metrics),
        ];
        args.extend_from_slice(extra);
        ok("rollout", &args);
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
        (read(&out), m)
    };
    let (a, ma) = run_it("default", &[]);
    // Two seats and 3 tokens a step: prompts split over steps, samples of a prompt in turns.
    let (b, mb) = run_it(
        "tight",
        &["--max-num-seqs", "2", "--max-batched-tokens", "3"],
    );
    assert_eq!(
        i32_rows(&a, schema::RESPONSE_IDS),
        i32_rows(&b, schema::RESPONSE_IDS)
    );
    logprobs_close(&a, &b);
    // Without overlap scheduling: the same samples, and no step queued behind another (the
    // log-probs to rounding: the CPU GEMM blocks rows by the step's row count).
    let (c, mc) = run_it("no-overlap", &["--no-overlap"]);
    assert_eq!(
        i32_rows(&a, schema::RESPONSE_IDS),
        i32_rows(&c, schema::RESPONSE_IDS)
    );
    logprobs_close(&a, &c);
    assert_eq!(mc["overlapped_steps"], 0);
    assert!(ma["overlapped_steps"].as_u64().unwrap() > 0, "{ma}");
    // One prefill per prompt with every seat free; more when the samples come in turns.
    assert_eq!(ma["prefills"], 3);
    assert!(mb["prefills"].as_u64().unwrap() > 3, "{mb}");
    assert!(mb["engine_steps"].as_u64().unwrap() > ma["engine_steps"].as_u64().unwrap());
    assert_eq!(ma["kv_block_size"], 16);
    assert!(ma["kv_blocks_peak"].as_u64().unwrap() <= ma["kv_blocks"].as_u64().unwrap());
}

#[test]
fn bad_scheduler_limits_are_input_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 4);
    let input = dir.path().join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let out = dir.path().join("out.parquet");
    let base = ["--model", p(&model), "--in", p(&input), "--out", p(&out)];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    }
    input_error(
        "rollout",
        &with(&base, &["--max-num-seqs", "8", "--max-batched-tokens", "4"]),
        "--max-batched-tokens (4) must be >= --max-num-seqs (8)",
    );
    input_error(
        "rollout",
        &with(&base, &["--gpu-memory-fraction", "0"]),
        "invalid value '0' for '--gpu-memory-fraction <GPU_MEMORY_FRACTION>': must be a finite number in (0, 1]",
    );
    input_error(
        "rollout",
        &with(&base, &["--max-num-seqs", "0"]),
        "invalid value '0' for '--max-num-seqs <MAX_NUM_SEQS>': must be an integer >= 1",
    );
    assert!(!out.exists());
}
