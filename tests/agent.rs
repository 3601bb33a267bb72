//! Multi-turn rollouts with tools, end to end on the CPU: a tiny model given a short SFT on
//! tool-call text calls a test tool; the rollout stage (run in this process with the test's
//! tools, as `rollout --tool` runs with the tools it builds) writes the trajectory rows, and the
//! later stages (the real binaries) honour their mask.

use crate::stage_util;
use crate::stage_util::u8_rows;

use clap::Parser;
use stage_util::{f32_rows, i32_rows, ok, p, read, strings, tiny_model};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem::data::{ExtraInfo, Message, VerlRow};
use tandem::tokenizer::Tokenizer;
use tandem::tool::{ToolCall, ToolResult, Tools};

const CALL: &str = r#"<tool_call>{"name": "add"}</tool_call>"#;

/// `add` answers 5; any other name is an unknown tool.
struct Add;

impl Tools for Add {
    fn schemas(&self) -> Vec<serde_json::Value> {
        vec![serde_json::json!({"type": "function", "function": {"name": "add"}})]
    }
    fn call(&self, call: &ToolCall, _kwargs: &serde_json::Value) -> ToolResult {
        match call.name.as_str() {
            "add" => ToolResult {
                content: "5".into(),
                seconds: 0.0,
                error: None,
            },
            other => ToolResult::failed(format!("unknown tool {other}"), 0.0),
        }
    }
}

#[derive(Parser)]
struct Rollout {
    #[command(flatten)]
    args: tandem::stage::rollout::RolloutArgs,
}

/// Prompts whose reference answer is the call (`n` of them).
fn call_prompts(path: &Path, n: usize) {
    answered_prompts(path, n, CALL)
}

/// `n` prompts whose reference answer is `answer`.
fn answered_prompts(path: &Path, n: usize, answer: &str) {
    let rows: Vec<VerlRow> = (0..n)
        .map(|i| VerlRow {
            data_source: "test/agent".into(),
            prompt: vec![Message::new(
                "user",
                format!("What is {} plus {}?", i % 7 + 1, i % 5 + 2),
            )],
            ability: None,
            ground_truth: answer.into(),
            extra_info: ExtraInfo {
                split: "train".into(),
                index: i as i64,
                answer: answer.into(),
                question: String::new(),
            },
        })
        .collect();
    let data = tandem::data::verl_record_batch(&rows).unwrap();
    tandem::batch::write_file(path, &data, &Default::default()).unwrap();
}

/// A tiny model that writes the call after a short SFT on it, in `d/sft`.
fn calling_model(d: &Path) -> PathBuf {
    model_trained_on(d, CALL)
}

/// A tiny model that writes `answer` after a short SFT on it, in `d/sft`.
fn model_trained_on(d: &Path, answer: &str) -> PathBuf {
    let base = tiny_model(d, 1);
    answered_prompts(&d.join("sft-prompts.parquet"), 8, answer);
    tandem::stage::sft_batch::run(tandem::stage::sft_batch::SftBatchArgs {
        model: base.clone(),
        input: d.join("sft-prompts.parquet"),
        out: d.join("sft.parquet"),
        raw_prompt: false,
        prompt_key: "prompt".into(),
        max_prompt_tokens: 512,
        truncate: tandem::stage::rollout::Truncate::Error,
        limit: None,
    })
    .unwrap();
    let sft = d.join("sft");
    ok(
        "update",
        &[
            "--model",
            p(&base),
            "--in",
            p(&d.join("sft.parquet")),
            "--out-model",
            p(&sft),
            "--loss",
            "sft",
            "--lr",
            "0.01",
            "--mini-batch-size",
            "8",
            "--ppo-epochs",
            "50",
        ],
    );
    sft
}

/// `rollout` of `model` on `d/prompts.parquet` into `out`, with the test's tool.
fn rollout(model: &Path, d: &Path, out: &str, extra: &[&str]) {
    let (input, out) = (d.join("prompts.parquet"), d.join(out));
    let mut argv = vec![
        "rollout",
        "--model",
        p(model),
        "--in",
        p(&input),
        "--out",
        p(&out),
        "--tool",
        "add=cmd:unused",
        "--n",
        "4",
        "--seed",
        "5",
        "--max-turns",
        "3",
        "--max-turn-tokens",
        "48",
        "--max-response-tokens",
        "200",
    ];
    argv.extend_from_slice(extra);
    let args = Rollout::parse_from(argv).args;
    let mut exec = tandem::stage::InProcess::new(tandem::stage::common::Device::Cpu);
    tandem::stage::rollout::run_with_tools(args, &mut exec, Some(Arc::new(Add))).unwrap();
}

/// The rows: the call's turn, the observation (template markers and the result, each tokenized
/// alone: mask 0, log-prob 0), the next turns; the inspection columns agree with the ids; the
/// last turn's text is the response text.
///
/// Then the later stages on those rows: `score` reads the last turn; `ref-logprob` scores every
/// token and, on the CPU's batch-invariant kernels, gives the rollout's log-probs on the model's
/// tokens; `advantage` leaves observation tokens at 0; and `update` (every loss-agg-mode, with a
/// KL loss, an entropy bonus, rollout correction and bypass mode) is the same, to the bit,
/// when every per-token value of the observation tokens is changed.
#[test]
fn trajectory_rows_hold_calls_observations_and_their_mask() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = calling_model(d);
    call_prompts(&d.join("prompts.parquet"), 3);
    rollout(&model, d, "r.parquet", &[]);
    check_rows(&d.join("r.parquet"), &model);
    later_stages(d, &model);
}

fn check_rows(path: &Path, model: &Path) {
    let b = read(path);
    let tok = Tokenizer::from_dir(model).unwrap();
    let ids = i32_rows(&b, "response_ids");
    let masks = u8_rows(&b, "response_mask");
    let lps = f32_rows(&b, "rollout_logprobs");
    let turns = b.column("num_turns").unwrap();
    let turns = arrow_array::cast::AsArray::as_primitive::<arrow_array::types::Int32Type>(turns);
    let calls = strings(&b, "tool_calls");
    let messages = strings(&b, "messages");
    let texts = strings(&b, "response_text");
    // ChatML: the turn's own <|im_end|>, then the tool turn and the next assistant turn.
    let enc = |s: &str| tok.encode(s).unwrap();
    let obs: Vec<u32> = [
        enc("\n<|im_start|>tool\n"),
        enc("5"),
        enc("<|im_end|>\n<|im_start|>assistant\n"),
    ]
    .concat();
    let mut called = 0;
    for i in 0..ids.len() {
        let (ids, mask, lp) = (&ids[i], &masks[i], &lps[i]);
        let calls: Vec<serde_json::Value> = serde_json::from_str(&calls[i]).unwrap();
        let msgs: Vec<serde_json::Value> = serde_json::from_str(&messages[i]).unwrap();
        let n_turns = turns.value(i) as usize;
        assert_eq!(
            msgs.iter().filter(|m| m["role"] == "assistant").count(),
            n_turns
        );
        assert_eq!(msgs[0]["role"], "user");
        let last = msgs
            .iter()
            .rev()
            .find(|m| m["role"] == "assistant")
            .unwrap();
        assert_eq!(
            last["content"],
            texts[i].as_str(),
            "the last turn is the response text"
        );
        assert_eq!(
            calls.len(),
            n_turns - 1,
            "row {i}: one call per turn but the last"
        );
        for (m, &x) in mask.iter().zip(lp) {
            match m {
                0 => assert_eq!(x, 0.0),
                _ => assert!(x <= 0.0),
            }
        }
        // The observation spans, in order: each is exactly the template's markers around the
        // result, tokenized alone, after a turn that ended with <|im_end|>.
        let mut k = 0;
        let mut spans = 0;
        while k < ids.len() {
            if mask[k] == 1 {
                k += 1;
                continue;
            }
            let end = (k..ids.len()).find(|&j| mask[j] == 1).unwrap_or(ids.len());
            let span: Vec<u32> = ids[k..end].iter().map(|&t| t as u32).collect();
            let want = match calls[spans]["error"].is_null() {
                true => obs.clone(),
                false => {
                    let c = calls[spans]["result"].as_str().unwrap();
                    [
                        enc("\n<|im_start|>tool\n"),
                        enc(c),
                        enc("<|im_end|>\n<|im_start|>assistant\n"),
                    ]
                    .concat()
                }
            };
            assert_eq!(span, want, "row {i}, observation {spans}");
            assert_eq!(ids[k - 1] as u32, tok.require_id("<|im_end|>").unwrap());
            spans += 1;
            k = end;
        }
        assert_eq!(spans, calls.len());
        called += calls.len();
    }
    assert!(
        called >= 6,
        "the model calls its tool: {called} calls in {} rows",
        ids.len()
    );
    // A malformed call or an unknown tool is an observation the model read, not a failure.
    for c in calls
        .iter()
        .flat_map(|c| serde_json::from_str::<Vec<serde_json::Value>>(c).unwrap())
    {
        if let Some(e) = c["error"].as_str() {
            assert_eq!(c["result"], format!("error: {e}").as_str());
        }
    }
}

/// `(score, ref-logprob, advantage)` on `d/r.parquet`, then `update` on the batch and on a
/// copy whose observation tokens' values are all changed.
fn later_stages(d: &Path, model: &Path) {
    let f = |n: &str| d.join(n);
    ok(
        "score",
        &[
            "--in",
            p(&f("r.parquet")),
            "--out",
            p(&f("s.parquet")),
            "--reward",
            "exact",
        ],
    );
    // DAPO's overlong shaping measures the whole response (sampled and tool tokens) against
    // --max-response-tokens (200), not one turn's limit.
    ok(
        "score",
        &[
            "--in",
            p(&f("r.parquet")),
            "--out",
            p(&f("o.parquet")),
            "--reward",
            "exact",
        ]
        .into_iter()
        .chain(["--overlong-buffer-len", "100"])
        .collect::<Vec<_>>(),
    );
    let o = read(&f("o.parquet"));
    let lens = i32_rows(&o, "response_ids");
    let shaped = o.f32s("score_overlong").unwrap();
    assert!(
        lens.iter().any(|l| l.len() > 100),
        "some rows pass the free length"
    );
    for (l, &x) in lens.iter().zip(shaped.iter()) {
        let want = (100.0 - l.len() as f64).min(0.0) / 100.0;
        assert!(
            (x as f64 - want).abs() < 1e-6,
            "{} tokens: {x} vs {want}",
            l.len()
        );
    }
    let s = read(&f("s.parquet"));
    let texts = strings(&s, "response_text");
    let scores = s.f32s("score").unwrap();
    for (t, &x) in texts.iter().zip(scores.iter()) {
        assert_eq!(
            x,
            f32::from(t.trim() == CALL),
            "scored on the last turn: {t:?}"
        );
    }
    ok(
        "ref-logprob",
        &[
            "--model",
            p(model),
            "--in",
            p(&f("s.parquet")),
            "--out",
            p(&f("ref.parquet")),
            "--column",
            "ref_logprobs",
        ],
    );
    let r = read(&f("ref.parquet"));
    let masks = u8_rows(&r, "response_mask");
    let (roll, refs) = (
        f32_rows(&r, "rollout_logprobs"),
        f32_rows(&r, "ref_logprobs"),
    );
    let mut worst = 0f32;
    for ((m, a), b) in masks.iter().zip(&roll).zip(&refs) {
        for ((&m, &a), &b) in m.iter().zip(a).zip(b) {
            if m == 1 {
                worst = worst.max((a - b).abs());
            } else {
                assert!(b < 0.0, "ref-logprob scores observation tokens too");
            }
        }
    }
    eprintln!("ref-logprob vs rollout_logprobs on model tokens: max |diff| {worst:e}");
    assert!(
        worst < 2e-5,
        "ref-logprob vs rollout_logprobs on model tokens: {worst}"
    );
    // Scores that differ within every group (the tiny model's are often all alike).
    let n = masks.len();
    let varied = arrow_array::Float32Array::from_iter_values((0..n).map(|i| (i % 3) as f32));
    stage_util::with_column(
        &f("ref.parquet"),
        &f("varied.parquet"),
        "score",
        Arc::new(varied),
    );
    ok(
        "advantage",
        &[
            "--in",
            p(&f("varied.parquet")),
            "--out",
            p(&f("adv.parquet")),
            "--estimator",
            "grpo",
        ],
    );
    let adv = f32_rows(&read(&f("adv.parquet")), "advantages");
    assert!(
        adv.iter().flatten().any(|&a| a != 0.0),
        "the groups' scores differ"
    );
    for (m, a) in masks.iter().zip(&adv) {
        assert!(m.iter().zip(a).all(|(&m, &a)| m == 1 || a == 0.0));
    }
    // The same batch with other values on every observation token.
    let mut path = f("adv.parquet");
    for (k, col) in ["advantages", "ref_logprobs", "rollout_logprobs"]
        .into_iter()
        .enumerate()
    {
        let rows = f32_rows(&read(&path), col);
        let changed: Vec<Vec<f32>> = rows
            .iter()
            .zip(&masks)
            .map(|(r, m)| {
                r.iter()
                    .zip(m)
                    .map(|(&x, &m)| if m == 1 { x } else { -3.0 - k as f32 })
                    .collect()
            })
            .collect();
        let next = f(&format!("changed-{k}.parquet"));
        stage_util::with_f32_rows(&path, &next, col, &changed);
        path = next;
    }
    for (i, agg) in [
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ]
    .iter()
    .enumerate()
    {
        let run = |input: &Path, out: &str| {
            let mut a = vec!["--model", p(model), "--in", p(input), "--lr", "0.01"];
            a.extend([
                "--loss-agg-mode",
                agg,
                "--use-kl-loss",
                "--kl-loss-coef",
                "0.1",
            ]);
            a.extend(["--entropy-coeff", "0.01", "--mini-batch-size", "6"]);
            // Bypass mode takes the rollout's log-probs as the old ones; otherwise rollout
            // correction weighs by them.
            match i % 2 {
                1 => a.push("--bypass-mode"),
                _ => a.extend(["--rollout-is", "token"]),
            }
            let (dir, metrics) = (f(out), f(&format!("{out}.json")));
            let mut a: Vec<String> = a.into_iter().map(String::from).collect();
            a.extend([
                "--out-model".into(),
                p(&dir).into(),
                "--metrics".into(),
                p(&metrics).into(),
            ]);
            ok("update", &a);
            let m: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
            let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
            (m, weights)
        };
        let (m1, w1) = run(&f("adv.parquet"), &format!("u{i}"));
        let (m2, w2) = run(&path, &format!("v{i}"));
        for key in ["loss", "pg_loss", "kl_loss", "entropy", "grad_norm"] {
            assert!(m1[key].is_number(), "{agg}: {key} in {m1}");
            assert_eq!(m1[key], m2[key], "{agg}: {key}");
        }
        if i % 2 == 0 {
            assert!(m1["mismatch"].is_object(), "{agg}: {m1}");
        }
        assert_eq!(m1["mismatch"], m2["mismatch"], "{agg}: mismatch metrics");
        assert!(w1 == w2, "{agg}: the same weights");
    }
}

/// The tool flags are checked before anything runs (exit 2, the flag named).
#[test]
fn tool_flags_are_checked_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 2);
    call_prompts(&d.join("prompts.parquet"), 2);
    let (input, out) = (d.join("prompts.parquet"), d.join("r.parquet"));
    let base = [
        "--model",
        p(&model),
        "--in",
        p(&input),
        "--out",
        p(&out),
        "--tool",
        "calc=cmd:x",
    ];
    let cases: [(&[&str], &str); 8] = [
        (&["--tool-format", "code"], "add --tool python"),
        (
            &["--max-turn-tokens", "100", "--max-response-tokens", "50"],
            "--max-turn-tokens (100) must be <= --max-response-tokens (50)",
        ),
        (&["--raw-prompt"], "--tool needs the chat template"),
        (&["--tool-timeout", "0"], "--tool-timeout"),
        (&["--max-turns", "0"], "--max-turns"),
        (&["--max-parallel-calls", "0"], "--max-parallel-calls"),
        (
            &["--max-tool-response-chars", "0"],
            "--max-tool-response-chars",
        ),
        (
            &["--tool-response-truncate-side", "top"],
            "--tool-response-truncate-side",
        ),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        stage_util::input_error("rollout", &args, want);
        assert!(!out.exists());
    }
}

/// The code format: what a tiny model was taught to write, a ```python block then its output
/// then the answer, through `rollout --tool python --tool-format code` (the real sandbox).
const CODE_ANSWER: &str = "```python\nprint(2+3)\n```\n```output\n5\n```\n#### 5";

/// `rollout --tool-format code` (the binary, the sandboxed `python` tool): a turn ends at the
/// closing fence of its ```python block, the block's code is the call's `code`, the output
/// block (tokenized alone, mask 0, log-prob 0) follows inline with no turn marker, and the
/// model goes on to the answer; `messages` holds one assistant message, the response as the
/// model read it, and `response_text` is what follows the last output. The same holds for the
/// rows of rounds of 4 tokens (`--round-tokens`, async mode's partial rollouts).
#[test]
fn code_blocks_run_in_the_python_tool_and_their_output_follows_inline() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = model_trained_on(d, CODE_ANSWER);
    answered_prompts(&d.join("prompts.parquet"), 3, CODE_ANSWER);
    let out = d.join("r.parquet");
    #[rustfmt::skip]
    ok("rollout", &["--model", p(&model), "--in", p(&d.join("prompts.parquet")), "--out", p(&out),
        "--tool", "python", "--tool-format", "code", "--n", "4", "--seed", "5", "--max-turns", "3",
        "--max-turn-tokens", "48", "--max-response-tokens", "200"]);
    let tok = Tokenizer::from_dir(&model).unwrap();
    let (ran, answered) = check_code_rows(&read(&out), &tok);
    assert!(ran >= 6, "{ran} of 12 rows ran print(2+3)");
    assert!(answered >= 4, "{answered} rows answered after the output");
    // The same in rounds of 4 tokens (the rounds of `[placement] mode = "async"`): the fence
    // that ends a turn is written across rounds, the call runs at the end of the round that
    // closed it, and the rows are the same shape.
    let (mut carry, mut rows, mut ran, mut answered) = (None::<PathBuf>, 0, 0, 0);
    for r in 1.. {
        let (fin, next) = (
            d.join(format!("f{r}.parquet")),
            d.join(format!("c{r}.parquet")),
        );
        let input = match r {
            1 => d.join("prompts.parquet"),
            _ => d.join("none.parquet"),
        };
        let mut args = vec![
            "rollout",
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(&fin),
            "--carry-out",
            p(&next),
            "--round-tokens",
            "4",
            "--tool",
            "python",
            "--tool-format",
            "code",
            "--n",
            "4",
            "--seed",
            "5",
            "--max-turns",
            "3",
            "--max-turn-tokens",
            "48",
            "--max-response-tokens",
            "200",
        ];
        if let Some(c) = &carry {
            args.extend(["--carry", p(c)]);
        }
        if r == 1 {
            // An empty prompt file for the later rounds, with the prompts' columns.
            answered_prompts(&d.join("none.parquet"), 0, CODE_ANSWER);
        }
        ok(args[0], &args[1..]);
        let b = read(&fin);
        rows += b.num_rows();
        if b.num_rows() > 0 {
            let (x, y) = check_code_rows(&b, &tok);
            (ran, answered) = (ran + x, answered + y);
        }
        if read(&next).num_rows() == 0 {
            break;
        }
        carry = Some(next);
    }
    assert_eq!(rows, 12);
    assert!(ran >= 6, "{ran} of 12 rows ran print(2+3) in rounds");
    assert!(
        answered >= 4,
        "{answered} rows answered after the output in rounds"
    );
}

/// The checks of code-format rows (see the test above); returns the rows that ran
/// `print(2+3)` and those that answered after its output.
fn check_code_rows(b: &tandem::batch::Batch, tok: &Tokenizer) -> (usize, usize) {
    let (ids, masks) = (i32_rows(b, "response_ids"), u8_rows(b, "response_mask"));
    let lps = f32_rows(b, "rollout_logprobs");
    let (calls, messages) = (strings(b, "tool_calls"), strings(b, "messages"));
    let texts = strings(b, "response_text");
    let (mut ran, mut answered) = (0, 0);
    for i in 0..ids.len() {
        let ids: Vec<u32> = ids[i].iter().map(|&t| t as u32).collect();
        let calls: Vec<serde_json::Value> = serde_json::from_str(&calls[i]).unwrap();
        let msgs: Vec<serde_json::Value> = serde_json::from_str(&messages[i]).unwrap();
        assert_eq!(
            msgs.len(),
            2,
            "row {i}: the prompt and one assistant message"
        );
        let whole = tok.decode(&ids, true).unwrap();
        // An output with no room left under --max-response-tokens is cut there and ends the
        // row (its call's result stays whole in the message).
        let cut = masks[i].last() == Some(&0) && strings(b, "finish_reason")[i] == "length";
        let content = msgs[1]["content"].as_str().unwrap();
        match cut {
            false => assert_eq!(content, whole.as_str(), "row {i}: the response inline"),
            true => assert!(content.starts_with(whole.trim_end_matches('\u{fffd}'))),
        }
        assert!(whole.ends_with(texts[i].as_str()));
        // Each mask-0 span is the output block of its call, after the block's closing fence.
        let mut k = 0;
        for c in &calls {
            let start = (k..ids.len()).find(|&j| masks[i][j] == 0).unwrap();
            let end = (start..ids.len())
                .find(|&j| masks[i][j] == 1)
                .unwrap_or(ids.len());
            let before = tok.decode(&ids[..start], true).unwrap();
            assert!(
                before.ends_with("```"),
                "row {i}: stopped at the fence: {before:?}"
            );
            let code = before.rsplit("```python\n").next().unwrap();
            assert_eq!(
                c["arguments"]["code"],
                code.trim_end_matches("```").trim_end()
            );
            assert_eq!(c["name"], "python");
            let result = c["result"].as_str().unwrap();
            let block = tandem::tool::code::output_block(false, result);
            let block = tok.encode(&block).unwrap();
            match cut && end == ids.len() {
                false => assert_eq!(ids[start..end], block[..], "row {i}"),
                true => assert_eq!(ids[start..end], block[..end - start], "row {i}"),
            }
            assert!(lps[i][start..end].iter().all(|&x| x == 0.0));
            ran += usize::from(result == "5\n" && c["error"].is_null());
            k = end;
        }
        assert!(masks[i][k..].iter().all(|&m| m == 1));
        answered += usize::from(calls.len() == 1 && texts[i] == "#### 5");
    }
    (ran, answered)
}

/// `--system-prompt` goes before each prompt: into the rendered prompt and the `messages`
/// column; with `--raw-prompt` it is refused.
#[test]
fn a_system_prompt_comes_before_each_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 4);
    call_prompts(&d.join("prompts.parquet"), 2);
    let system = "You may call add.";
    rollout(&model, d, "r.parquet", &["--system-prompt", system]);
    let b = read(&d.join("r.parquet"));
    let tok = Tokenizer::from_dir(&model).unwrap();
    for (ids, messages) in i32_rows(&b, "prompt_ids")
        .iter()
        .zip(strings(&b, "messages"))
    {
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        let text = tok.decode(&ids, false).unwrap();
        assert!(
            text.starts_with(&format!("<|im_start|>system\n{system}")),
            "{text}"
        );
        let m: Vec<serde_json::Value> = serde_json::from_str(&messages).unwrap();
        assert_eq!(
            m[0],
            serde_json::json!({"role": "system", "content": system})
        );
        assert_eq!(m[1]["role"], "user");
    }
    let (input, raw) = (d.join("prompts.parquet"), d.join("raw.parquet"));
    let args = [
        "--model",
        p(&model),
        "--in",
        p(&input),
        "--out",
        p(&raw),
        "--raw-prompt",
        "--system-prompt",
        system,
    ];
    stage_util::input_error("rollout", &args, "--system-prompt needs the chat template");
}

/// A verl multi-turn dataset (`extra_info.tools_kwargs`, `need_tools_kwargs`, an `agent_name`
/// column, as verl's gsm8k_multiturn_w_tool preprocessing writes) is read, and its columns are
/// carried into every sample's row.
#[test]
fn a_verl_multi_turn_dataset_is_accepted() {
    use arrow_array::{
        Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, StringArray, StructArray,
    };
    use arrow_schema::{DataType, Field, Fields, Schema};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 3);
    let utf8 = |v: Vec<&str>| Arc::new(StringArray::from(v)) as ArrayRef;
    let strukt = |cols: Vec<(&str, ArrayRef)>| {
        let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols
            .into_iter()
            .map(|(n, a)| (Field::new(n, a.data_type().clone(), true), a))
            .collect();
        Arc::new(StructArray::new(Fields::from(fields), arrays, None)) as ArrayRef
    };
    let create = strukt(vec![("ground_truth", utf8(vec!["72", "10"]))]);
    let tool = strukt(vec![("create_kwargs", create)]);
    let tools_kwargs = strukt(vec![("calc_gsm8k_reward", tool)]);
    let extra = strukt(vec![
        ("split", utf8(vec!["train", "train"])),
        ("index", Arc::new(Int64Array::from(vec![0, 1]))),
        (
            "need_tools_kwargs",
            Arc::new(BooleanArray::from(vec![true, true])),
        ),
        ("tools_kwargs", tools_kwargs),
    ]);
    // verl's columns, with its multi-turn extra_info and agent_name.
    let base = tandem::data::verl_record_batch(
        &["How many clips?", "How much did she earn?"]
            .iter()
            .zip(["72", "10"])
            .enumerate()
            .map(|(i, (q, gt))| VerlRow {
                data_source: "openai/gsm8k".into(),
                prompt: vec![Message::new("user", *q)],
                ability: Some("math".into()),
                ground_truth: gt.into(),
                extra_info: ExtraInfo {
                    split: "train".into(),
                    index: i as i64,
                    answer: gt.into(),
                    question: q.to_string(),
                },
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut fields: Vec<Field> = vec![];
    let mut arrays: Vec<ArrayRef> = vec![];
    for (f, a) in base.schema().fields().iter().zip(base.columns()) {
        let a = match f.name().as_str() {
            "extra_info" => extra.clone(),
            _ => a.clone(),
        };
        fields.push(Field::new(f.name(), a.data_type().clone(), true));
        arrays.push(a);
    }
    fields.insert(1, Field::new("agent_name", DataType::Utf8, true));
    arrays.insert(1, utf8(vec!["tool_agent", "tool_agent"]));
    let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    let input = d.join("multiturn.parquet");
    tandem::batch::write_file(&input, &data, &Default::default()).unwrap();
    let out = d.join("r.parquet");
    ok(
        "rollout",
        &[
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(&out),
            "--n",
            "2",
            "--max-new-tokens",
            "4",
        ],
    );
    let b = read(&out);
    assert_eq!(strings(&b, "agent_name"), ["tool_agent"; 4]);
    assert_eq!(strings(&b, "ground_truth"), ["72", "72", "10", "10"]);
    let extra = b.json_rows("extra_info");
    assert_eq!(
        extra[2]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"],
        "10"
    );
    assert_eq!(extra[0]["need_tools_kwargs"], true);
    assert!(matches!(
        b.column("extra_info").unwrap().data_type(),
        DataType::Struct(_)
    ));
}

/// verl's `Gsm8kTool` shape: `create` keeps the row's ground truth, `execute` answers it (with
/// the row's `execute_kwargs.prefix`).
const TRUTH_TOOL: &str = r#"
class Truth:
    def __init__(self, config, tool_schema):
        self.truth = {}

    def get_openai_tool_schema(self):
        return {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        self.truth[instance_id] = ground_truth
        return instance_id

    async def execute(self, instance_id, parameters, prefix="", **kwargs):
        return prefix + str(self.truth[instance_id]), 0.0, {}

    async def release(self, instance_id, **kwargs):
        del self.truth[instance_id]
"#;

/// A `cmd:` tool that answers the `kwargs` of each request, as JSON.
const KWARGS_TOOL: &str = r#"import json, sys
print(json.dumps({"name": "add"}), flush=True)
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"id": r["id"], "content": json.dumps(r.get("kwargs"), sort_keys=True)}), flush=True)
"#;

/// `input` with a utf8 column `tools_kwargs` of `values`, as `out`.
fn with_tools_kwargs(input: &Path, out: &Path, values: &[Option<&str>]) {
    let mut cols = tandem::batch::NewColumns::new();
    let field = arrow_schema::Field::new("tools_kwargs", arrow_schema::DataType::Utf8, true);
    let array = arrow_array::StringArray::from(values.to_vec());
    cols.add_field(field, Arc::new(array));
    let info = tandem::batch::StageInfo {
        stage: "test",
        params: serde_json::json!({}),
        policy_version: None,
        step: None,
    };
    read(input).write_derived(out, cols, &info).unwrap();
}

/// The results of the calls that answered (no error), per row of a rollout.
fn answered_results(out: &Path) -> Vec<Vec<String>> {
    strings(&read(out), "tool_calls")
        .iter()
        .map(|c| {
            let calls: Vec<serde_json::Value> = serde_json::from_str(c).unwrap();
            let answered = calls.iter().filter(|c| c["error"].is_null());
            answered
                .map(|c| c["result"].as_str().unwrap().to_string())
                .collect()
        })
        .collect()
}

/// A row's `tools_kwargs` (verl's per-row tool arguments) reaches its calls: a `python:` class
/// gets `create_kwargs` and `execute_kwargs` as keyword arguments, a `cmd:` program the entry
/// as the request's `kwargs`; a row without any gets none; a value that is not JSON stops the
/// rollout before the model loads (exit 2, naming the file, column and row).
#[test]
fn a_rows_tools_kwargs_reach_its_tool_calls() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = calling_model(d);
    call_prompts(&d.join("plain.parquet"), 3);
    let kwargs = [
        Some(
            r#"{"add": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": {"prefix": "A: "}}}"#,
        ),
        None,
        Some(
            r#"{"add": {"create_kwargs": {"ground_truth": "10"}}, "other": {"create_kwargs": {}}}"#,
        ),
    ];
    let input = d.join("prompts.parquet");
    with_tools_kwargs(&d.join("plain.parquet"), &input, &kwargs);
    std::fs::write(d.join("truth.py"), TRUTH_TOOL).unwrap();
    std::fs::write(d.join("kwargs.py"), KWARGS_TOOL).unwrap();
    // Each answered call of a prompt's 4 samples gave `want[prompt]`; every prompt had some.
    let rollout = |tool: String, out: &Path, want: [&str; 3]| {
        let args = [
            "--model",
            p(&model),
            "--in",
            p(&input),
            "--out",
            p(out),
            "--tool",
            &tool,
            "--n",
            "4",
            "--seed",
            "5",
            "--max-turns",
            "2",
            "--max-turn-tokens",
            "48",
            "--max-response-tokens",
            "200",
        ];
        ok("rollout", &args);
        let results = answered_results(out);
        assert_eq!(results.len(), 12);
        for (prompt, rows) in results.chunks(4).enumerate() {
            assert!(
                rows.iter().any(|r| !r.is_empty()),
                "prompt {prompt}: no call answered"
            );
            for r in rows.iter().flatten() {
                assert_eq!(r, want[prompt], "prompt {prompt}");
            }
        }
    };
    let truth = format!("add=python:{}:Truth", p(&d.join("truth.py")));
    rollout(truth, &d.join("a.parquet"), ["A: 72", "None", "10"]);
    let first = r#"{"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": {"prefix": "A: "}}"#;
    let third = r#"{"create_kwargs": {"ground_truth": "10"}}"#;
    let echo = format!("add=cmd:python3 {}", p(&d.join("kwargs.py")));
    rollout(echo.clone(), &d.join("b.parquet"), [first, "null", third]);

    let bad = d.join("bad.parquet");
    let kwargs = [kwargs[0], Some("{\"add\": "), kwargs[2]];
    with_tools_kwargs(&d.join("plain.parquet"), &bad, &kwargs);
    let out = d.join("c.parquet");
    let args = [
        "--model",
        p(&model),
        "--in",
        p(&bad),
        "--out",
        p(&out),
        "--tool",
        &echo,
    ];
    let want = format!(
        "{}: column 'tools_kwargs', row 1: not JSON (",
        bad.display()
    );
    stage_util::input_error("rollout", &args, &want);
    assert!(!out.exists(), "no partial output");
    // `pipeline run` refuses it before step 1.
    std::fs::copy(&bad, d.join("train.parquet")).unwrap();
    std::fs::copy(&input, d.join("val.parquet")).unwrap();
    std::fs::write(d.join("tool.py"), ADD_TOOL).unwrap();
    std::fs::write(d.join("reward.py"), LENGTH_REWARD).unwrap();
    write_tool_spec(d, "");
    let o = pipeline_cmd(d, "run").arg("--dry-run").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("train.parquet: column 'tools_kwargs', row 1: not JSON ("),
        "{err}"
    );
    assert!(!d.join("run").exists());
}

// ---------------------------------------------------------------------------------------------
// The pipeline with tools

const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");

/// The `add` tool as a program speaking the JSON-lines protocol: it answers 5, a little slowly
/// (so that a rollout spends time in its calls), and appends a line to `calls.txt` in the
/// working directory per call (and to `starts.txt` when it starts).
const ADD_TOOL: &str = r#"import json, sys, time
with open("starts.txt", "a") as f:
    f.write("start\n")
print(json.dumps({"type": "function", "function": {"name": "add"}}), flush=True)
for line in sys.stdin:
    if line.strip():
        request = json.loads(line)
        time.sleep(0.05)
        with open("calls.txt", "a") as f:
            f.write("call\n")
        print(json.dumps({"id": request["id"], "content": "5"}), flush=True)
"#;

/// A reward that differs between the samples of a group, so that every step changes weights.
const LENGTH_REWARD: &str = r#"def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 3) / 2.0
"#;

/// `d/sft`, the calling model; `d/train.parquet` and `d/val.parquet`, prompts it answers with a
/// call; `d/tool.py` and `d/reward.py`.
fn tool_run_setup(d: &Path) {
    calling_model(d);
    call_prompts(&d.join("train.parquet"), 16);
    call_prompts(&d.join("val.parquet"), 4);
    std::fs::write(d.join("tool.py"), ADD_TOOL).unwrap();
    std::fs::write(d.join("reward.py"), LENGTH_REWARD).unwrap();
}

/// `d/spec.toml`: 3 steps of GRPO on [`tool_run_setup`]'s files with the tool, `top` at its
/// top level.
fn write_tool_spec(d: &Path, top: &str) {
    let spec = format!(
        r#"seed = 3
steps = 3
{top}
[model]
path = "sft"
[data]
train = "train.parquet"
val = "val.parquet"
prompts-per-step = 4
[rollout]
n = 4
temperature = 1.0
max-prompt-tokens = 1024
tool = ["add=cmd:python3 tool.py"]
max-turns = 3
max-tool-calls = 2
max-turn-tokens = 48
max-response-tokens = 160
[score]
reward = "python:reward.py"
[advantage]
estimator = "grpo"
[update]
lr = 0.001
use-kl-loss = true
ppo-epochs = 2
mini-batch-size = 8
[eval]
every = 2
[checkpoint]
every = 2
keep-last = 1
"#
    );
    std::fs::write(d.join("spec.toml"), spec).unwrap();
}

/// `pipeline run spec.toml --run-dir RUN` in `d` with the built stages.
fn pipeline_cmd(d: &Path, run: &str) -> std::process::Command {
    let mut c = std::process::Command::new(PIPELINE);
    c.current_dir(d)
        .args(["run", "spec.toml", "--run-dir", run])
        .env("TANDEM_BIN_DIR", Path::new(PIPELINE).parent().unwrap())
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("TANDEM_DAEMON");
    c
}

fn pipeline_ok(d: &Path, run: &str) {
    let o = pipeline_cmd(d, run).output().unwrap();
    assert!(
        o.status.success(),
        "{run}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Calls answered so far (lines of `d/calls.txt`).
fn calls_answered(d: &Path) -> usize {
    std::fs::read_to_string(d.join("calls.txt")).map_or(0, |t| t.lines().count())
}

/// With dynamic sampling a step rolls out in rounds: its `rollout/…` metrics count the samples
/// and tool calls of every round's trajectories (they were missing from metrics.jsonl when each
/// round kept its own metrics).
#[test]
fn dynamic_sampling_steps_report_the_tool_calls_of_all_their_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tool_run_setup(d);
    write_tool_spec(
        d,
        "[algorithm]\nfilter-groups = true\nprompts-per-round = 2\nmax-num-gen-batches = 3\n",
    );
    pipeline_ok(d, "a");
    let run = d.join("a");
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let mut several = false;
    for (i, line) in text.lines().enumerate() {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        let rounds = m["sampling/rounds"].as_u64().unwrap();
        several |= rounds > 1;
        let (mut calls, mut samples) = (0, 0);
        for r in 1..=rounds {
            let b = read(&run.join(format!("step-{:04}/round-{r}/rollout.parquet", i + 1)));
            for c in strings(&b, "tool_calls") {
                calls += serde_json::from_str::<Vec<serde_json::Value>>(&c)
                    .unwrap()
                    .len();
                samples += 1;
            }
        }
        assert!(calls > 0, "step {}: the model calls its tool", i + 1);
        assert_eq!(m["rollout/tool_calls"].as_u64(), Some(calls as u64), "{m}");
        assert_eq!(m["rollout/samples"].as_u64(), Some(samples as u64), "{m}");
    }
    assert_eq!(text.lines().count(), 3);
    // Two prompts a round for four groups a step: every step takes two rounds or more.
    assert!(several, "{text}");
}

/// The calls of a run's step-1 rollout that the tool answered.
fn answered_calls(run: &Path) -> usize {
    let b = read(&run.join("step-0001/rollout.parquet"));
    strings(&b, "tool_calls")
        .iter()
        .flat_map(|c| serde_json::from_str::<Vec<serde_json::Value>>(c).unwrap())
        .filter(|c| c["result"] == "5")
        .count()
}

/// What must match between two runs of one spec: every checkpoint file (weights and optimizer
/// state, bit for bit), the policy, the state, the evaluations and the metrics (timings, and
/// the metrics named in `differ`, aside).
fn assert_same_runs(a: &Path, b: &Path, differ: &[&str]) {
    use crate::pipeline::{checkpoint_files, jsonl_sans_time, state};
    let (ca, cb) = (checkpoint_files(a), checkpoint_files(b));
    assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
    assert!(ca.contains_key("step-0003/model.safetensors"), "{ca:?}");
    for (k, v) in &ca {
        assert!(v == &cb[k], "{k} differs between {a:?} and {b:?}");
    }
    // Every step's trajectories: the same ids and mask; log-probs within a few 1e-6 (below).
    for step in 1..=3 {
        let f = format!("step-{step:04}/rollout.parquet");
        let (ra, rb) = (read(&a.join(&f)), read(&b.join(&f)));
        assert_eq!(
            i32_rows(&ra, "response_ids"),
            i32_rows(&rb, "response_ids"),
            "{f}"
        );
        assert_eq!(
            u8_rows(&ra, "response_mask"),
            u8_rows(&rb, "response_mask"),
            "{f}"
        );
        let (la, lb) = (
            f32_rows(&ra, "rollout_logprobs"),
            f32_rows(&rb, "rollout_logprobs"),
        );
        let diff = la
            .iter()
            .flatten()
            .zip(lb.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        eprintln!("{f}: rollout_logprobs differ by {diff:e} at most");
        assert!(diff <= 2e-5, "{f}: rollout_logprobs differ by {diff}");
    }
    let policy = |r: &Path| std::fs::read(r.join("policy")).unwrap();
    assert_eq!(policy(a), policy(b));
    assert_eq!(state(a), state(b));
    assert_eq!(
        jsonl_sans_time(&a.join("eval.jsonl")),
        jsonl_sans_time(&b.join("eval.jsonl"))
    );
    let (ma, mb) = (
        jsonl_sans_time(&a.join("metrics.jsonl")),
        jsonl_sans_time(&b.join("metrics.jsonl")),
    );
    assert_eq!(ma.len(), mb.len());
    for (x, y) in ma.iter().zip(&mb) {
        let (x, y) = (x.as_object().unwrap(), y.as_object().unwrap());
        // A daemon's stages add their memory and phase (`rollout/daemon/*`).
        let own = |m: &serde_json::Map<String, serde_json::Value>| {
            m.keys()
                .filter(|k| !k.contains("/daemon/"))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(own(x), own(y));
        for (k, v) in x.iter().filter(|(k, _)| !k.contains("/daemon/")) {
            // When a call answers decides which samples decode together: the engine's
            // counters follow the timing, and so, by a few 1e-6, do the sampled tokens'
            // log-probs (the same tokens; the metrics made from those log-probs differ as
            // little). Every other metric, and every weight above, is the same.
            let scheduled = ["engine_steps", "overlap", "kv_blocks_peak", "eager_steps"];
            if scheduled.iter().any(|s| k.contains(s)) || differ.contains(&k.as_str()) {
                continue;
            }
            match (v.as_f64(), y[k].as_f64()) {
                (Some(p), Some(q)) => assert!((p - q).abs() <= 1e-4, "{k}: {p} vs {q}"),
                _ => assert_eq!(v, &y[k], "{k}"),
            }
        }
    }
}

/// A run whose rollouts call a `cmd:` tool, SIGKILLed in step 2's rollout after the tool
/// answered a call of it (the rollout, its tool processes and the runner die), then rerun: it
/// continues after step 1 and ends with the uninterrupted run's checkpoints, policy, metrics and
/// evaluations.
#[test]
fn tool_rollouts_resume_after_sigkill_to_identical_weights() {
    use crate::pipeline::running_child;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tool_run_setup(d);
    write_tool_spec(d, "");
    pipeline_ok(d, "a");
    let a = d.join("a");
    let called = answered_calls(&a);
    assert!(called >= 4, "the model calls its tool: {called} calls");
    let m: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(a.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert!(m["grad_norm"].as_f64().unwrap() > 0.0, "{m}");

    let mut child = pipeline_cmd(d, "b")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (pid, t0) = (child.id(), Instant::now());
    let mut before = None;
    loop {
        assert!(child.try_wait().unwrap().is_none(), "b ended before");
        assert!(t0.elapsed() < Duration::from_secs(300), "timed out");
        if running_child(pid, "--out b/step-0002/rollout.parquet") {
            // The count when step 2's rollout was first seen; a call answered since is its own.
            let n0 = *before.get_or_insert(calls_answered(d));
            if calls_answered(d) > n0 {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let b = d.join("b");
    assert!(!b.join("step-0002/rollout.parquet").exists());
    let o = pipeline_cmd(d, "b").output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    assert!(
        text.contains("pipeline: continuing b after step 1"),
        "{text}"
    );
    assert_same_runs(&a, &b, &[]);
}

/// The same run with `daemon = true`: the tools run in the warm daemon's rollouts and the run
/// ends with the in-process run's checkpoints, policy, metrics and evaluations. With `gpus = 2`
/// (CPU ranks) the first rollout samples the 1-process run's trajectories, and on a daemon
/// group the run ends as the 2-rank run without daemons does.
#[test]
fn tool_rollouts_on_the_daemon_match_the_in_process_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tool_run_setup(d);
    write_tool_spec(d, "");
    pipeline_ok(d, "one");
    write_tool_spec(d, "daemon = true");
    pipeline_ok(d, "daemon");
    let (one, daemon) = (d.join("one"), d.join("daemon"));
    let commands = std::fs::read_to_string(daemon.join("commands.sh")).unwrap();
    assert!(commands.contains("--tool"), "{commands}");
    assert!(answered_calls(&daemon) >= 4);
    assert_eq!(
        read(&one.join("step-0001/rollout.parquet")).num_rows(),
        read(&daemon.join("step-0001/rollout.parquet")).num_rows()
    );
    // The daemon keeps the weights and the optimizer state between steps: it writes them at
    // checkpoints only.
    let kept = ["update/optimizer_state_saved", "update/weights_saved"];
    assert_same_runs(&one, &daemon, &kept);

    write_tool_spec(d, "gpus = 2");
    pipeline_ok(d, "two");
    write_tool_spec(d, "gpus = 2\ndaemon = true");
    pipeline_ok(d, "group");
    let (two, group) = (d.join("two"), d.join("group"));
    let first = |r: &Path| read(&r.join("step-0001/rollout.parquet"));
    assert_eq!(
        i32_rows(&first(&one), "response_ids"),
        i32_rows(&first(&two), "response_ids")
    );
    assert_eq!(strings(&first(&one), "uid"), strings(&first(&two), "uid"));
    // ...and the group writes the ranks' optimizer shards at checkpoints only.
    let kept = [kept[0], kept[1], "update/optimizer_shards"];
    assert_same_runs(&two, &group, &kept);
}

/// `[placement] mode = "async"` with the tool (1 rollout + 1 training rank, rounds of 8 new
/// tokens, turns of up to 48): episodes are carried across rounds, and the run trains its 3
/// steps on trajectories as a colocated tool run writes them: the same columns and types as
/// `rollout --tool`'s (plus `token_policy_version`), each observation exactly the template's
/// markers around what the tool returned (`check_rows`), mask 0 and log-prob 0; every call's
/// result is the tool's answer to it; turns, calls and lengths stay within max-turns,
/// max-tool-calls, max-turn-tokens and max-response-tokens; every token's version lies within
/// the staleness bound; and each row that called spent more than one round on its first turn
/// (longer than a round) and went on in a later round after the call.
#[test]
fn async_mode_carries_tool_episodes_across_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tool_run_setup(d);
    write_tool_spec(d, "gpus = 2\ndaemon = true");
    let placement = "[placement]\nrollout-gpus = [0]\ntrain-gpus = [1]\nmode = \"async\"\nmax-staleness = 1\nround-tokens = 8\n";
    let spec = std::fs::read_to_string(d.join("spec.toml")).unwrap() + placement;
    std::fs::write(d.join("spec.toml"), spec).unwrap();
    pipeline_ok(d, "a");
    let run = d.join("a");
    let starts = std::fs::read_to_string(d.join("starts.txt")).map_or(0, |t| t.lines().count());
    let model = d.join("sft");
    // The columns of a colocated tool rollout of the same model.
    call_prompts(&d.join("prompts.parquet"), 2);
    rollout(&model, d, "r.parquet", &[]);
    let colocated = read(&d.join("r.parquet"));
    let fields = |b: &tandem::batch::Batch| -> Vec<(String, String)> {
        b.data
            .schema()
            .fields()
            .iter()
            .filter(|f| f.name() != "token_policy_version")
            .map(|f| (f.name().clone(), format!("{:?}", f.data_type())))
            .collect()
    };
    let (mut spanned, mut trained_calls) = (0, 0);
    for step in 1..=3u64 {
        let path = run.join(format!("step-000{step}/rollout.parquet"));
        let b = read(&path);
        assert_eq!(b.num_rows(), 16, "step {step}");
        let (mut got, mut want) = (fields(&b), fields(&colocated));
        got.sort();
        want.sort();
        assert_eq!(
            got, want,
            "step {step}: the columns of a colocated tool run"
        );
        check_rows(&path, &model);
        let versions = b.ragged_i32("token_policy_version").unwrap();
        let masks = u8_rows(&b, "response_mask");
        let calls = strings(&b, "tool_calls");
        let turns = b.column("num_turns").unwrap();
        let turns =
            arrow_array::cast::AsArray::as_primitive::<arrow_array::types::Int32Type>(turns);
        for i in 0..b.num_rows() {
            let trained = step as i32 - 1;
            let v = versions.row(i);
            assert!(
                v.iter().all(|&x| x <= trained && x + 1 >= trained),
                "step {step} row {i}: {v:?}"
            );
            let mask = &masks[i];
            assert!(
                mask.len() <= 160 && turns.value(i) <= 3,
                "step {step} row {i}"
            );
            let calls: Vec<serde_json::Value> = serde_json::from_str(&calls[i]).unwrap();
            assert!(calls.len() <= 2, "step {step} row {i}: {calls:?}");
            trained_calls += calls.len();
            for c in &calls {
                if c["name"] == "add" {
                    assert_eq!(c["result"], "5", "{c}");
                    assert!(c["error"].is_null(), "{c}");
                }
            }
            // Each turn's model tokens (runs of mask 1) at most max-turn-tokens.
            let runs = mask.split(|&m| m == 0).filter(|r| !r.is_empty());
            assert!(runs.clone().all(|r| r.len() <= 48), "step {step} row {i}");
            if !calls.is_empty() {
                let first = mask.iter().position(|&m| m == 0).unwrap();
                spanned += usize::from(first > 8 && mask[first..].contains(&1));
            }
        }
    }
    assert!(spanned >= 6, "{spanned} episodes spanned rounds");
    // The rounds' metrics count the calls they ran: at least the trained rows', at most what
    // the tool answered (evaluations call it too).
    let (mut round_calls, mut round_errors) = (0, 0);
    for e in std::fs::read_dir(run.join("async")).unwrap() {
        let path = e.unwrap().path().join("metrics.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let m: serde_json::Value = serde_json::from_str(&text).unwrap();
            round_calls += m["tool_calls"].as_u64().unwrap() as usize;
            round_errors += m["tool_errors"].as_u64().unwrap() as usize;
        }
    }
    let answered = calls_answered(d);
    // The rollout daemon keeps the tool's programs between rounds: the run started them at
    // most 2 + 16 times (the preflight's check, the toolbox's schema read, a pool of at most
    // --tool-concurrency 16 processes), where building the tools in every round started them
    // about 2.5 times a round (76 in 30 rounds).
    let rounds = std::fs::read_dir(run.join("async"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().join("metrics.json").is_file())
        .count();
    assert!(
        rounds >= 6 && starts <= 2 + 16,
        "{starts} tool starts in {rounds} rounds"
    );
    assert!(
        round_calls >= trained_calls && round_calls - round_errors <= answered,
        "{round_calls} calls ({round_errors} failed) in the rounds, {trained_calls} trained, {answered} answered"
    );
    assert!(trained_calls >= 12, "{trained_calls} calls trained on");
    // Each step reports the rounds' calls since the step before: the trained rows' calls were
    // all made by then, and no more than the rounds ran.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let step_calls: u64 = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|m| m["async/tool_calls"].as_u64().unwrap())
        .sum();
    assert!(
        trained_calls as u64 <= step_calls && step_calls <= round_calls as u64,
        "steps report {step_calls} calls, {trained_calls} trained, {round_calls} in the rounds"
    );
}
