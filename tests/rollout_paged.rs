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

/// `rollout --ignore-eos --response-lengths FILE`: each sample ends after the length its key
/// draws from the file (finish `length`), its tokens those of the same rollout without the
/// file, cut there; 2 ranks draw the same; a Parquet file gives its responses' lengths; rounds
/// of partial rollouts (`--round-tokens`) end each sample at the same length; a bad file is
/// exit 2 naming its line, with nothing written.
#[test]
fn recorded_response_lengths_end_samples_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 4);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let lengths = d.join("lengths.txt");
    std::fs::write(&lengths, "# recorded\n2\n5\n9\n30\n").unwrap();
    let args = |out: &std::path::Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(out),
            "--n",
            "6",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--seed",
            "5",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let (free, cut) = (d.join("free.parquet"), d.join("cut.parquet"));
    ok("rollout", &args(&free, &[]));
    ok("rollout", &args(&cut, &["--response-lengths", p(&lengths)]));
    let (f, c) = (read(&free), read(&cut));
    let (fi, ci) = (
        i32_rows(&f, schema::RESPONSE_IDS),
        i32_rows(&c, schema::RESPONSE_IDS),
    );
    let mut seen = std::collections::BTreeSet::new();
    for (a, b) in fi.iter().zip(&ci) {
        assert_eq!(a.len(), 16);
        assert!([2, 5, 9, 16].contains(&b.len()), "{}", b.len());
        assert_eq!(b[..], a[..b.len()]);
        seen.insert(b.len());
    }
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(strings(&c, schema::FINISH_REASON)
        .iter()
        .all(|r| r == "length"));
    // Two ranks draw the same lengths.
    let two = d.join("two.parquet");
    crate::dp::launch_ok(
        2,
        "rollout",
        &args(&two, &["--response-lengths", p(&lengths)])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(i32_rows(&read(&two), schema::RESPONSE_IDS), ci);
    // A rollout's Parquet output as the recorded lengths: its responses' lengths.
    let again = d.join("again.parquet");
    let mut a = args(&again, &["--response-lengths", p(&cut)]);
    let i = a.iter().position(|x| x == "--seed").unwrap();
    a[i + 1] = "6".into();
    ok("rollout", &a);
    let lens: Vec<usize> = i32_rows(&read(&again), schema::RESPONSE_IDS)
        .iter()
        .map(Vec::len)
        .collect();
    assert!(lens.iter().all(|l| seen.contains(l)), "{lens:?}");
    // Rounds of 3 tokens, carried until none is in flight: the same length for each uid.
    let want: std::collections::BTreeMap<String, usize> = strings(&c, "uid")
        .into_iter()
        .zip(ci.iter().map(Vec::len))
        .collect();
    let none = d.join("none.parquet");
    prompts(&none, &[]);
    let mut got = std::collections::BTreeMap::new();
    let mut carry: Option<std::path::PathBuf> = None;
    for r in 1..20 {
        let (out, carry_out) = (
            d.join(format!("f{r}.parquet")),
            d.join(format!("c{r}.parquet")),
        );
        let mut a = args(
            &out,
            &[
                "--response-lengths",
                p(&lengths),
                "--round-tokens",
                "3",
                "--carry-out",
                p(&carry_out),
            ],
        );
        if r > 1 {
            let i = a.iter().position(|x| x == "--in").unwrap();
            a[i + 1] = p(&none).to_string();
        }
        if let Some(c) = &carry {
            a.extend(["--carry".to_string(), p(c).to_string()]);
        }
        ok("rollout", &a);
        let f = read(&out);
        for (uid, ids) in strings(&f, "uid")
            .into_iter()
            .zip(i32_rows(&f, schema::RESPONSE_IDS))
        {
            got.insert(uid, ids.len());
        }
        if read(&carry_out).num_rows() == 0 {
            break;
        }
        carry = Some(carry_out);
    }
    assert_eq!(got, want);
    // A length that is not a number: exit 2 naming the file and line, nothing written.
    std::fs::write(&lengths, "12\nlots\n").unwrap();
    let bad = d.join("bad.parquet");
    let err = input_error(
        "rollout",
        &args(&bad, &["--response-lengths", p(&lengths)]),
        "lengths.txt:2: \"lots\" is not a response length",
    );
    assert!(!bad.exists(), "{err}");
}
