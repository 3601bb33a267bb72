//! Multi-turn generation with tools on the real decoder (CPU): a test model wraps the paged
//! decoder and forces the tokens of a tool call as a turn's sample (their log-probs are the
//! decoder's own, from the step's logits), so every other part is the engine's real path:
//! the turn's end, the parked sample, the tool runner, the observation prefilled as an
//! extension of the sample's blocks, the next turn sampled.

use super::turns::{Agent, TurnLimits};
use super::*;
use crate::backend::cpu::Cpu;
use crate::backend::ops::sample::sample_key;
use crate::engine::logprob::{score, PromptResponse};
use crate::model::decoder::Decoder;
use crate::model::init::random_weights;
use crate::model::Config;
use crate::tool::{code, Side, ToolCall, ToolFormat, ToolResult, Tools};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const IM_START: u32 = 257;
const IM_END: u32 = 258;

fn config() -> Config {
    Config {
        vocab_size: 300,
        hidden_size: 32,
        intermediate_size: 64,
        head_dim: 8,
        eos_token_ids: vec![],
        ..Config::small_qwen2()
    }
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

/// Bytes are ids 0..256; the specials decode to nothing (as with `skip_special`).
fn detok(ids: &[u32]) -> Result<String> {
    let b: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// Qwen2.5's markers around tool responses; the turn's own `<|im_end|>` is not repeated.
fn observe(turn: &[u32], contents: &[String]) -> Result<Vec<u32>> {
    let mut ids = vec![];
    if turn.last() != Some(&IM_END) {
        ids.push(IM_END);
    }
    ids.extend(bytes("\n"));
    ids.push(IM_START);
    ids.extend(bytes("user"));
    for c in contents {
        ids.extend(bytes("\n<tool_response>\n"));
        ids.extend(bytes(c));
        ids.extend(bytes("\n</tool_response>"));
    }
    ids.push(IM_END);
    ids.extend(bytes("\n"));
    ids.push(IM_START);
    ids.extend(bytes("assistant\n"));
    Ok(ids)
}

fn call_turn(body: &str) -> Vec<u32> {
    let mut ids = bytes(&format!("<tool_call>\n{body}\n</tool_call>"));
    ids.push(IM_END);
    ids
}

/// `add` sums a, b and its row's `execute_kwargs.c` (0 without); `fail` fails; `sleep` sleeps `ms` (and notes when it started).
struct TestTools {
    started: Mutex<Vec<Instant>>,
}

impl Tools for TestTools {
    fn schemas(&self) -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "add"}})]
    }
    fn call(&self, call: &ToolCall, kwargs: &Value) -> ToolResult {
        let arg = |k: &str| call.arguments[k].as_i64().unwrap_or(0);
        let c = kwargs["add"]["execute_kwargs"]["c"].as_i64().unwrap_or(0);
        match call.name.as_str() {
            "add" => ToolResult {
                content: (arg("a") + arg("b") + c).to_string(),
                seconds: 0.0,
                error: None,
            },
            "sleep" => {
                self.started.lock().unwrap().push(Instant::now());
                std::thread::sleep(Duration::from_millis(arg("ms") as u64));
                ToolResult {
                    content: "slept".into(),
                    seconds: 0.0,
                    error: None,
                }
            }
            "fail" => ToolResult::failed("the tool crashed", 0.0),
            // Stands for the sandbox: answers how long the code is.
            "python" => ToolResult {
                content: format!("{} bytes\n", call.arguments["code"].as_str().unwrap().len()),
                seconds: 0.0,
                error: None,
            },
            other => ToolResult::failed(format!("unknown tool {other}"), 0.0),
        }
    }
}

/// The paged decoder with some draws forced: `script(key, position)` names the token a sample
/// draws there (its log-prob is the decoder's, from the step's logits at temperature 1).
/// Notes the time and keys of every step.
struct Scripted<'a, 'd> {
    inner: PagedDecoder<'d, Cpu>,
    script: &'a dyn Fn(u64, u64) -> Option<u32>,
    steps: Vec<(Instant, Vec<u64>)>,
}

impl PagedModel for Scripted<'_, '_> {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        let mut out = self.inner.run_step(chunks, rows, sampling)?;
        let logits = self.inner.last_logits(rows.len())?;
        let vocab = self.vocab();
        for (i, r) in rows.iter().enumerate() {
            if let Some(t) = (self.script)(r.key, r.position) {
                let row = &logits[i * vocab..(i + 1) * vocab];
                let max = row.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
                let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                let lp = row[t as usize] as f64 - max - z.ln();
                out[i] = Sampled {
                    token: t,
                    logprob: lp as f32,
                };
            }
        }
        self.steps
            .push((Instant::now(), rows.iter().map(|r| r.key).collect()));
        Ok(out)
    }
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        self.inner.copy_blocks(pairs)
    }
}

fn request(seed: u64, prompt: Vec<u32>, n: u64) -> Request {
    let keys = (0..n).map(|s| sample_key(seed, &prompt, 0, s)).collect();
    Request {
        max_new: Vec::new(),
        prompt,
        sample_keys: keys,
    }
}

fn params(max_turn_tokens: usize) -> GenParams {
    GenParams {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
        },
        max_new_tokens: max_turn_tokens,
        stop_token_ids: vec![IM_END],
        stop_strings: vec![],
    }
}

fn agent(tools: Arc<dyn Tools>, limits: TurnLimits, timeout_ms: u64) -> Agent<'static> {
    Agent {
        tools,
        limits,
        concurrency: 2,
        timeout: Duration::from_millis(timeout_ms),
        observe: &observe,
        cut: None,
        kwargs: vec![],
    }
}

struct Ran {
    done: Vec<Vec<Completion>>,
    stats: PagedStats,
    steps: Vec<(Instant, Vec<u64>)>,
}

fn generate(
    weights: &crate::model::Weights,
    pc: &PagedConfig,
    reqs: &[Request],
    p: &GenParams,
    agent: &Agent,
    script: &dyn Fn(u64, u64) -> Option<u32>,
) -> Ran {
    let mut dec = Decoder::new(Cpu, &config(), weights).unwrap();
    let inner = PagedDecoder::new(&mut dec, pc.num_blocks, pc.block_size).unwrap();
    let mut model = Scripted {
        inner,
        script,
        steps: vec![],
    };
    let (done, stats) = generate_turns(
        &mut model,
        pc,
        reqs,
        p,
        Some(&detok),
        Some(agent),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(stats.blocks_in_use_at_end, 0);
    Ran {
        done,
        stats,
        steps: model.steps,
    }
}

fn limits(max_turns: usize, max_tool_calls: usize, max_response_tokens: usize) -> TurnLimits {
    TurnLimits {
        max_turns,
        max_tool_calls,
        max_parallel_calls: usize::MAX,
        max_response_tokens,
        format: ToolFormat::Hermes,
    }
}

/// Every sample's first turn is forced to call `add(2, 3)`: the row holds the call, the
/// observation with its markers (mask 0, log-prob 0) and the sampled second turn; the
/// observation is prefilled alone (the history stays in the cache) and every model token's
/// log-prob, continued from the cache, is the training forward's over the whole final ids.
#[test]
fn a_tool_call_continues_from_the_cache_as_a_whole_prefill_scores_it() {
    let weights = random_weights(&config(), 5, 0.3);
    let call = call_turn(r#"{"name": "add", "arguments": {"a": 2, "b": 3}}"#);
    let obs = observe(&call, &["5".to_string()]).unwrap();
    let script = |_: u64, p: u64| call.get(p as usize).copied();
    let reqs = [
        request(1, bytes("<|im_start|>user\nadd 2 and 3"), 3),
        request(2, bytes("hi"), 2),
    ];
    let p = params(80);
    let tools: Arc<dyn Tools> = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let lim = limits(3, 4, 220);
    let ag = agent(tools, lim, 5_000);
    let mut runs = vec![];
    for (overlap, blocks) in [(false, 400), (true, 400), (true, 70)] {
        let pc = PagedConfig {
            block_size: 4,
            num_blocks: blocks,
            max_num_seqs: 5,
            max_batched_tokens: 64,
            overlap,
        };
        runs.push(generate(&weights, &pc, &reqs, &p, &ag, &script));
    }
    let ran = &runs[0];
    assert_eq!(ran.stats.tool_calls, 5);
    assert_eq!(ran.stats.tool_errors, 0);
    // No history prefilled again: the prompts once, then per sample its turn's last token
    // (its im_end, never fed) and the observation.
    let prompts: usize = reqs.iter().map(|r| r.prompt.len()).sum();
    assert_eq!(ran.stats.gen.prefill_tokens, prompts + 5 * (1 + obs.len()));
    assert!(runs[1].stats.overlapped_steps > 0);
    // With overlap, a turn's last draw already has a step queued behind it: the sample parks
    // once that step is applied (its draw thrown away).
    assert!(runs[1].stats.overlap_discarded > 0, "{:?}", runs[1].stats);
    assert!(runs[2].stats.preemptions > 0, "the small pool preempts");
    for cs in &ran.done {
        for c in cs {
            let t = c.trajectory.as_ref().expect("a trajectory");
            let n = call.len() + obs.len();
            assert_eq!(&c.tokens[..call.len()], &call[..]);
            assert_eq!(&c.tokens[call.len()..n], &obs[..]);
            assert!(c.tokens.len() > n, "a second turn was sampled");
            let want: Vec<u8> = (0..c.tokens.len())
                .map(|i| u8::from(i < call.len() || i >= n))
                .collect();
            assert_eq!(t.mask, want);
            assert!(c.logprobs[call.len()..n].iter().all(|&x| x == 0.0));
            assert_eq!(t.calls.len(), 1);
            let rec = &t.calls[0];
            assert_eq!((rec.turn, rec.name.as_str()), (0, "add"));
            assert_eq!(rec.arguments, json!({"a": 2, "b": 3}));
            assert_eq!((rec.result.as_str(), &rec.error), ("5", &None));
            assert_eq!(t.turns.len(), 2);
            assert!(t.turns[0].starts_with("<tool_call>"));
            assert_eq!(t.turns[1], c.text);
            assert_eq!(c.text, detok(&c.tokens[n..]).unwrap());
            assert!(c.tokens.len() - n <= 80, "--max-turn-tokens holds per turn");
            assert!(c.tokens.len() <= 220, "--max-response-tokens holds");
        }
    }
    // The same trajectories with overlap scheduling and with preemptions.
    for other in &runs[1..] {
        for (a, b) in ran.done.iter().flatten().zip(other.done.iter().flatten()) {
            // The same but for the calls' seconds.
            let timeless = |c: &Completion| {
                let mut t = c.trajectory.clone().unwrap();
                t.calls.iter_mut().for_each(|r| r.seconds = 0.0);
                t
            };
            assert_eq!((&a.tokens, timeless(a)), (&b.tokens, timeless(b)));
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-5, "{x} vs {y}");
            }
        }
    }
    let compared = assert_continued_as_whole_prefill(&weights, &reqs, &ran.done);
    assert!(compared > 5 * call.len(), "{compared} tokens compared");
}

/// Every model token's log-prob, continued from the cache across observations, is the one
/// teacher forcing gives over the whole final ids (as ref-logprob runs it,
/// `engine::logprob::score`). Returns how many tokens were compared.
fn assert_continued_as_whole_prefill(
    weights: &crate::model::Weights,
    reqs: &[Request],
    done: &[Vec<Completion>],
) -> usize {
    let rows: Vec<(Vec<u32>, &Request)> = reqs
        .iter()
        .zip(done)
        .flat_map(|(r, cs)| {
            cs.iter()
                .map(move |c| ([&r.prompt[..], &c.tokens].concat(), r))
        })
        .collect();
    let scored_rows: Vec<PromptResponse> = rows
        .iter()
        .map(|(t, r)| PromptResponse {
            prompt: &r.prompt,
            response: &t[r.prompt.len()..],
        })
        .collect();
    let mut dec = Decoder::new(Cpu, &config(), weights).unwrap();
    let scored = score(&mut dec, &scored_rows, 1.0, false, 4096, &mut |_| {}).unwrap();
    let mut compared = 0;
    for (c, s) in done.iter().flatten().zip(&scored) {
        let mask = &c.trajectory.as_ref().unwrap().mask;
        for ((a, b), &m) in c.logprobs.iter().zip(&s.logprobs).zip(mask) {
            if m == 1 {
                assert!((a - b).abs() < 2e-5, "continued {a} vs whole prefill {b}");
                compared += 1;
            }
        }
    }
    compared
}

/// A failing tool, a malformed call and a call past its timeout come back as observations the
/// model reads (and are counted); calls past --max-tool-calls are not run; --max-turns ends
/// the trajectory at its last turn even when that turn calls a tool; the other samples keep
/// decoding while a tool runs.
#[test]
fn tool_errors_and_timeouts_are_observations_and_the_limits_hold() {
    let weights = random_weights(&config(), 6, 0.3);
    // One turn with three calls: the third is past --max-tool-calls 2.
    let turn1 = [
        bytes("<tool_call>{\"name\": \"fail\"}</tool_call>"),
        bytes("<tool_call>{\"name\": \"sleep\", \"arguments\": {\"ms\": 2000}}</tool_call>"),
        bytes("<tool_call>{bad}</tool_call>"),
        vec![IM_END],
    ]
    .concat();
    let tools = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let timeout_ms = 300;
    let contents = [
        "error: the tool crashed".to_string(),
        "error: tool timed out after 0.3 s".to_string(),
    ];
    let obs = observe(&turn1, &contents).unwrap();
    let turn2_at = (turn1.len() + obs.len()) as u64;
    let turn2 = call_turn(r#"{"name": "add", "arguments": {"a": 1, "b": 1}}"#);
    let calling = request(1, bytes("use tools"), 1);
    let free = request(2, bytes("no tools"), 1);
    let key = calling.sample_keys[0];
    // The free sample writes `x` up to --max-turn-tokens: it is still decoding when the sleep
    // starts.
    let script = |k: u64, p: u64| {
        if k != key {
            return Some(u32::from(b'x'));
        }
        turn1
            .get(p as usize)
            .or_else(|| turn2.get(p.checked_sub(turn2_at)? as usize))
            .copied()
    };
    let ag = agent(tools.clone(), limits(2, 2, 500), timeout_ms);
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 300,
        max_num_seqs: 4,
        max_batched_tokens: 64,
        overlap: true,
    };
    let started = Instant::now();
    let ran = generate(&weights, &pc, &[calling, free], &params(450), &ag, &script);
    assert!(
        started.elapsed() < Duration::from_millis(1900),
        "the sleep was given up"
    );
    let c = &ran.done[0][0];
    let t = c.trajectory.as_ref().unwrap();
    assert_eq!(t.calls.len(), 2, "--max-tool-calls 2: {:?}", t.calls);
    assert_eq!(t.calls[0].error.as_deref(), Some("the tool crashed"));
    assert_eq!(t.calls[0].result, contents[0]);
    assert_eq!(
        t.calls[1].error.as_deref(),
        Some("tool timed out after 0.3 s")
    );
    assert_eq!(t.calls[1].result, contents[1]);
    assert_eq!(&c.tokens[turn1.len()..turn2_at as usize], &obs[..]);
    // The second turn calls `add`, but it is the last turn (--max-turns 2): the sample ends.
    assert_eq!(&c.tokens[turn2_at as usize..], &turn2[..]);
    assert_eq!((c.finish, t.turns.len()), (FinishReason::Stop, 2));
    assert_eq!((ran.stats.tool_calls, ran.stats.tool_errors), (2, 2));
    // The free sample drew tokens while the sleep ran.
    let slept = tools.started.lock().unwrap()[0];
    assert!(
        ran.steps
            .iter()
            .any(|(at, keys)| *at > slept && keys.iter().any(|&k| k != key)),
        "the other sample decoded while the tool ran"
    );
}

/// A malformed call is an observation too, and an observation longer than the room left is
/// cut to it: the sample ends by length at exactly --max-response-tokens.
#[test]
fn a_malformed_call_is_answered_and_a_long_observation_is_cut_to_the_budget() {
    let weights = random_weights(&config(), 7, 0.3);
    let turn1 = call_turn("{not json");
    let script = |_: u64, p: u64| turn1.get(p as usize).copied();
    let tools: Arc<dyn Tools> = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let budget = turn1.len() + 12;
    let ag = agent(tools, limits(4, 4, budget), 1000);
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 2,
        max_batched_tokens: 64,
        overlap: false,
    };
    let reqs = [request(3, bytes("q"), 2)];
    let ran = generate(&weights, &pc, &reqs, &params(60), &ag, &script);
    for c in &ran.done[0] {
        let t = c.trajectory.as_ref().unwrap();
        assert!(t.calls[0]
            .error
            .as_deref()
            .unwrap()
            .starts_with("tool call is not JSON"));
        assert!(t.calls[0]
            .result
            .starts_with("error: tool call is not JSON"));
        assert_eq!(c.tokens.len(), budget);
        assert_eq!(c.finish, FinishReason::Length);
        assert_eq!((t.turns.len(), c.text.as_str()), (1, ""));
        assert!(t.mask[turn1.len()..].iter().all(|&m| m == 0));
    }
}

/// Each request's tool arguments reach the calls of its own samples only: `add(2, 3)` answers
/// 15 for the row whose `execute_kwargs` has `c = 10`, 5 for the row without.
#[test]
fn each_requests_tool_arguments_reach_its_calls() {
    let weights = random_weights(&config(), 5, 0.3);
    let call = call_turn(r#"{"name": "add", "arguments": {"a": 2, "b": 3}}"#);
    let script = |_: u64, p: u64| call.get(p as usize).copied();
    let reqs = [
        request(1, bytes("first"), 2),
        request(2, bytes("second"), 2),
    ];
    let tools: Arc<dyn Tools> = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let mut ag = agent(tools, limits(2, 1, 220), 5_000);
    ag.kwargs = vec![json!({"add": {"execute_kwargs": {"c": 10}}})];
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 200,
        max_num_seqs: 4,
        max_batched_tokens: 64,
        overlap: true,
    };
    let ran = generate(&weights, &pc, &reqs, &params(80), &ag, &script);
    let results: Vec<Vec<&str>> = ran
        .done
        .iter()
        .map(|cs| {
            cs.iter()
                .map(|c| c.trajectory.as_ref().unwrap().calls[0].result.as_str())
                .collect()
        })
        .collect();
    assert_eq!(results, [["15", "15"], ["5", "5"]]);
}

/// verl's `max_parallel_calls` and `max_tool_response_length`: a turn with two calls runs the
/// first only, and its result reaches the model cut to 3 characters at the chosen side.
#[test]
fn a_turns_calls_are_capped_and_long_results_cut() {
    let weights = random_weights(&config(), 5, 0.3);
    let one = r#"{"name": "add", "arguments": {"a": 12345, "b": 1}}"#;
    let two = [call_turn(one), call_turn(one)].concat();
    let mut call = two[..two.len() / 2 - 1].to_vec();
    call.extend_from_slice(&two[two.len() / 2..]);
    let script = |_: u64, p: u64| call.get(p as usize).copied();
    let reqs = [request(1, bytes("first"), 2)];
    let tools: Arc<dyn Tools> = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 400,
        max_num_seqs: 4,
        max_batched_tokens: 64,
        overlap: false,
    };
    for (cap, cut, want) in [
        (usize::MAX, None, vec!["12346", "12346"]),
        (1, Some((3, Side::Left)), vec!["123...(truncated)"]),
        (1, Some((3, Side::Right)), vec!["(truncated)...346"]),
    ] {
        let mut ag = agent(tools.clone(), limits(2, 4, 500), 5_000);
        ag.limits.max_parallel_calls = cap;
        ag.cut = cut;
        let ran = generate(&weights, &pc, &reqs, &params(200), &ag, &script);
        for c in &ran.done[0] {
            let t = c.trajectory.as_ref().unwrap();
            let got: Vec<&str> = t.calls.iter().map(|r| r.result.as_str()).collect();
            assert_eq!(got, want, "cap {cap}, cut {cut:?}");
        }
    }
}

/// The code format's observation: the output block of the one result, after the turn's text.
fn observe_code(turn: &[u32], contents: &[String]) -> Result<Vec<u32>> {
    let sampled = detok(turn)?;
    Ok(bytes(&code::output_block(
        sampled.ends_with('\n'),
        &contents[0],
    )))
}

/// The code format: a turn ends the moment a ```python block's closing fence is sampled (the
/// script would go on writing); the block's code runs as a `python` call, and its output block
/// (mask 0, log-prob 0, no turn markers) is prefilled as an extension of the cache. A second
/// closed block past --max-tool-calls ends the trajectory without a call; an unclosed block is
/// no call. Every model token's log-prob equals one prefill of the whole final ids.
#[test]
fn a_closed_python_block_runs_and_its_output_follows_inline() {
    let weights = random_weights(&config(), 8, 0.3);
    let first = bytes("Compute it.\n```python\nprint(2 + 3)\n```");
    let obs = observe_code(&first, &["12 bytes\n".to_string()]).unwrap();
    assert_eq!(detok(&obs).unwrap(), "\n```output\n12 bytes\n```\n");
    let second_at = first.len() + obs.len();
    let second = bytes("So```py\nx\n```");
    // After each block the script would write on; a sample stopping late would show it.
    let calling = [first.clone(), bytes("\nlate")].concat();
    let after = [second.clone(), bytes("\nlate")].concat();
    let unclosed = [bytes("```python\nprint(1)\n"), vec![IM_END]].concat();
    let reqs = [
        request(1, bytes("compute"), 2),
        request(2, bytes("open"), 1),
    ];
    let key = reqs[1].sample_keys[0];
    let script = |k: u64, p: u64| {
        let p = p as usize;
        match k == key {
            true => unclosed.get(p).copied(),
            false => calling
                .get(p)
                .or_else(|| after.get(p.checked_sub(second_at)?))
                .copied(),
        }
    };
    let tools: Arc<dyn Tools> = Arc::new(TestTools {
        started: Mutex::new(vec![]),
    });
    let mut ag = agent(tools, limits(4, 1, 300), 5_000);
    ag.limits.format = ToolFormat::Code;
    ag.observe = &observe_code;
    for overlap in [false, true] {
        let pc = PagedConfig {
            block_size: 4,
            num_blocks: 400,
            max_num_seqs: 4,
            max_batched_tokens: 64,
            overlap,
        };
        let ran = generate(&weights, &pc, &reqs, &params(100), &ag, &script);
        assert_eq!((ran.stats.tool_calls, ran.stats.tool_errors), (2, 0));
        for c in &ran.done[0] {
            let t = c.trajectory.as_ref().unwrap();
            assert_eq!(&c.tokens[..first.len()], &first[..], "stopped at the fence");
            assert_eq!(&c.tokens[first.len()..second_at], &obs[..]);
            assert_eq!(
                &c.tokens[second_at..],
                &second[..],
                "no call past the limit"
            );
            let want: Vec<u8> = (0..c.tokens.len())
                .map(|i| u8::from(i < first.len() || i >= second_at))
                .collect();
            assert_eq!(t.mask, want);
            assert!(c.logprobs[first.len()..second_at].iter().all(|&x| x == 0.0));
            assert_eq!(t.calls.len(), 1);
            let rec = &t.calls[0];
            assert_eq!((rec.turn, rec.name.as_str()), (0, "python"));
            assert_eq!(rec.arguments, json!({"code": "print(2 + 3)"}));
            assert_eq!(
                t.turns,
                [
                    "Compute it.\n```python\nprint(2 + 3)\n```",
                    "So```py\nx\n```"
                ]
            );
            assert_eq!(
                (c.finish, c.text.as_str()),
                (FinishReason::Stop, "So```py\nx\n```")
            );
        }
        let c = &ran.done[1][0];
        assert_eq!(c.tokens, unclosed, "an unclosed block is no call");
        assert!(c.trajectory.as_ref().unwrap().calls.is_empty());
        let compared = assert_continued_as_whole_prefill(&weights, &reqs, &ran.done);
        assert_eq!(compared, 2 * (first.len() + second.len()) + unclosed.len());
    }
}
