//! `rollout --model DIR --in PROMPTS --out B`: render each prompt with the model's chat
//! template, tokenize, sample n responses per prompt, and write one row per sample.
//!
//! Reproducibility: the random stream of a sample is keyed by (seed, prompt tokens, which
//! repeat of that prompt in the file, sample index), so a prompt gets the same samples whatever
//! other prompts share the file, the `--limit`, the `--batch-size`, or the number of ranks.
//!
//! Several ranks: every rank tokenizes every prompt (the keys count repeats over the whole
//! file), generates the n samples of its contiguous block of prompts, and rank 0 gathers the
//! samples in rank order, which is prompt order, and writes the file and the metrics.

use super::common::{
    at_least, gather_results, my_block, negative_numbers, range, resolve_model, writes_files,
    Device, ModelRef,
};
use super::lengths::ResponseLengths;
use super::turns::{observation, stage_tools, ToolText, TurnColumns};
use super::{Exec, Job};
use crate::backend::ops::sample::{sample_key, SamplingParams};
use crate::backend::Backend;
use crate::bail_input;
use crate::batch::schema::{self, meta};
use crate::batch::{list_array, stage_meta, write_file, write_json, StageInfo};
use crate::data::dataset::repeat_each;
use crate::data::{ChatTemplate, PromptDataset};
use crate::engine::paged::{
    generate_turns, Agent, Completion, Detokenize, FinishReason, GenParams, GraphStats, Limits,
    Observe, PagedDecoder, PagedStats, Request, TurnLimits,
};
use crate::engine::policy::load_policy_as;
use crate::error::input_error;
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use crate::model::lora::LoraMode;
use crate::model::Config;
use crate::parallel::exchange::{Reader, Writer};
use crate::tokenizer::Tokenizer;
use crate::tool::code::CODE_TOOL;
use crate::tool::{ToolFormat, Tools};
use anyhow::Result;
use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, BooleanArray, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to do with a prompt longer than --max-prompt-tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncate {
    /// Keep the last --max-prompt-tokens tokens (the end of the prompt, with the generation
    /// prompt, is what the model continues).
    Left,
    /// Stop with an error naming the row (the default).
    Error,
}

/// An extra sample per prompt that is not trained on but stands for its group's baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// One greedy (temperature 0) response per prompt, ReMax's baseline.
    Greedy,
}

/// How prompts are rendered and cut to fit (shared by rollout and sft-batch): the tools'
/// schemas go to the chat template.
pub(crate) struct PromptLimits<'a> {
    pub(crate) prompt_key: &'a str,
    pub(crate) max_prompt_tokens: usize,
    pub(crate) truncate: Truncate,
    pub(crate) tools: &'a [serde_json::Value],
}

/// The first `n` prompts of a dataset as token ids: rendered with the chat template (or raw
/// text when `template` is None), truncated or refused when too long, checked against the
/// vocabulary. Returns the ids and how many prompts were truncated.
pub(crate) fn tokenize_prompts(
    dataset: &PromptDataset,
    n: usize,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    vocab_size: usize,
    limits: &PromptLimits,
) -> Result<(Vec<Vec<u32>>, usize)> {
    let at = dataset.batch().at(limits.prompt_key);
    let mut prompts: Vec<Vec<u32>> = Vec::with_capacity(n);
    let mut truncated = 0usize;
    for i in 0..n {
        // Raw text gets the tokenizer's own special tokens (BOS for Llama), as HF's
        // tokenizer(text) does; a rendered template already holds them.
        let text = dataset.prompt_text(i, template, limits.tools)?;
        let mut ids = tokenizer.encode_with_special(&text, template.is_none())?;
        if ids.is_empty() {
            bail_input!("{at}, row {i}: the prompt is empty after tokenization");
        }
        if ids.len() > limits.max_prompt_tokens {
            match limits.truncate {
                Truncate::Left => {
                    ids.drain(..ids.len() - limits.max_prompt_tokens);
                    truncated += 1;
                }
                Truncate::Error => bail_input!(
                    "{at}, row {i}: the prompt has {} tokens, more than --max-prompt-tokens {} (raise it, or pass --truncate left to keep the end)",
                    ids.len(),
                    limits.max_prompt_tokens
                ),
            }
        }
        if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab_size) {
            bail_input!(
                "{at}, row {i}: token id {t} from the tokenizer is outside the model's vocabulary ({vocab_size}): tokenizer and model do not match"
            );
        }
        prompts.push(ids);
    }
    Ok((prompts, truncated))
}

/// Says which dataset columns the output leaves out (named like columns the stages write for
/// each response), so that no column disappears silently.
pub(crate) fn log_left_out(dataset: &PromptDataset, stage: &str, log: &mut dyn FnMut(&str)) {
    let left_out = dataset.left_out_columns();
    if !left_out.is_empty() {
        log(&format!(
            "{stage}: {}: left out the dataset's columns {} (the stages write columns of those names for each response)",
            dataset.path().display(),
            left_out.join(", ")
        ));
    }
}

/// The columns every batch of sequences starts with, in contract order: uid, prompt_uid, the
/// dataset's columns, prompt_ids, response_ids, response_mask (all 1 unless given), response_text.
/// Ragged ids come as (offsets, values). Shared by rollout and sft-batch.
pub(crate) fn sequence_columns(
    uids: Vec<String>,
    prompt_uids: Vec<String>,
    dataset_columns: Vec<(Field, ArrayRef)>,
    prompts: (&[usize], Vec<i32>),
    responses: (&[usize], Vec<i32>, Option<Vec<u8>>),
    texts: Vec<String>,
) -> Vec<(Field, ArrayRef)> {
    let mask = responses.2.unwrap_or_else(|| vec![1u8; responses.1.len()]);
    let mut cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::UID),
            Arc::new(StringArray::from(uids)),
        ),
        (
            schema::field(schema::PROMPT_UID),
            Arc::new(StringArray::from(prompt_uids)),
        ),
    ];
    cols.extend(dataset_columns);
    cols.extend([
        (
            schema::field(schema::PROMPT_IDS),
            list_array::<Int32Type>(prompts.0, prompts.1),
        ),
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(responses.0, responses.1),
        ),
        (
            schema::field(schema::RESPONSE_MASK),
            list_array::<UInt8Type>(responses.0, mask),
        ),
        (
            schema::field(schema::RESPONSE_TEXT),
            Arc::new(StringArray::from(texts)) as ArrayRef,
        ),
    ]);
    cols
}

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[command(
    about = "Sample responses to a prompt dataset",
    mut_args = negative_numbers
)]
pub struct RolloutArgs {
    /// Model directory (HF layout) or a pointer file written by sync-weights.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Prompt dataset (parquet in verl's schema, or any parquet with a prompt column); every
    /// column is carried into the output.
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Output batch: one row per sample.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Samples per prompt (verl's rollout.n).
    #[arg(long, default_value_t = 8, value_parser = at_least(1usize))]
    pub n: usize,
    /// Sampling temperature, >= 0; 0 = greedy.
    #[arg(long, default_value_t = 1.0, value_parser = at_least(0.0f32))]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to this, in
    /// (0, 1]; 1 = all.
    #[arg(long, default_value_t = 1.0, value_parser = range(Bound::Excluded(0.0f32), Bound::Included(1.0)))]
    pub top_p: f32,
    /// Keep the k most likely tokens, >= 1; -1 = all.
    #[arg(long, default_value_t = -1, value_parser = top_k)]
    pub top_k: i64,
    /// Longest response, in tokens (>= 1).
    #[arg(long, default_value_t = 512, value_parser = at_least(1usize))]
    pub max_new_tokens: usize,
    /// Longest prompt after the chat template, in tokens (>= 1); see --truncate.
    #[arg(long, default_value_t = 512, value_parser = at_least(1usize))]
    pub max_prompt_tokens: usize,
    /// Seed of the samples' random streams (a prompt's samples depend only on it and the
    /// prompt).
    #[arg(long, default_value_t = 0, value_parser = at_least(0u64))]
    pub seed: u64,
    /// Only the first N prompts (>= 1).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    pub limit: Option<usize>,
    /// Feed the prompt text as is (no chat template).
    #[arg(long)]
    pub raw_prompt: bool,
    /// A system message put before every prompt that has none (e.g. to say when to call the
    /// tools); a prompt's own system message is kept. Needs the chat template.
    #[arg(long, value_name = "TEXT")]
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Prompts over --max-prompt-tokens: `left` keeps their end, `error` stops.
    #[arg(long, value_enum, default_value_t = Truncate::Error)]
    pub truncate: Truncate,
    /// Stop string (repeatable); the text is cut before the stop string, its tokens are kept.
    #[arg(long = "stop", value_name = "TEXT")]
    pub stop: Vec<String>,
    /// More stop token ids besides the model's EOS ids, comma-separated (e.g. 151643,151645).
    #[arg(long, value_delimiter = ',', value_name = "IDS", value_parser = at_least(0u32))]
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the model's EOS ids.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Each sample ends after a length drawn by its random key from this recorded
    /// distribution (a text file of lengths, one per line, or a rollout's Parquet output: its
    /// responses' lengths), at most --max-new-tokens: the long tail of a real model's
    /// responses for a model that does not stop by itself (random weights, --ignore-eos).
    #[arg(long, value_name = "FILE")]
    pub response_lengths: Option<PathBuf>,
    /// The prompt column of the dataset (verl's data.prompt_key).
    #[arg(long, default_value = "prompt", value_name = "COLUMN")]
    pub prompt_key: String,
    /// Samples decoded together at most, >= 1 (vLLM's max_num_seqs; `--batch-size` is an
    /// alias).
    #[arg(long = "max-num-seqs", alias = "batch-size", default_value_t = 256, value_parser = at_least(1usize))]
    pub max_num_seqs: usize,
    /// Tokens run in one step, at least --max-num-seqs: one per decoding sample plus chunks of
    /// prompts being prefilled (long prompts are split so they do not stall the decodes).
    #[arg(long, default_value_t = 8192, value_parser = at_least(1usize))]
    pub max_batched_tokens: usize,
    /// Fraction in (0, 1] of the GPU memory still free after the weights and the workspace
    /// that the KV cache pool takes (never more than --max-num-seqs full-length samples need).
    /// On the CPU the pool is always that full size.
    #[arg(long, default_value_t = 0.9, value_parser = range(Bound::Excluded(0.0f64), Bound::Included(1.0)))]
    pub gpu_memory_fraction: f64,
    /// Replay pure-decode steps as CUDA graphs, one per batch-size bucket (the default on
    /// cuda; no effect on the CPU).
    #[arg(long = "cuda-graphs", overrides_with = "no_cuda_graphs")]
    #[serde(default)]
    pub cuda_graphs: bool,
    /// Run every step eagerly (kernel by kernel), e.g. to compare with the graphs.
    #[arg(long = "no-cuda-graphs", overrides_with = "cuda_graphs")]
    #[serde(default)]
    pub no_cuda_graphs: bool,
    /// Wait for each step's tokens before scheduling the next (by default the next decode
    /// step is queued while the device runs the current one: overlap scheduling). The samples
    /// are the same either way.
    #[arg(long)]
    #[serde(default)]
    pub no_overlap: bool,
    /// ReMax's baseline: `greedy` adds one greedy (temperature 0) response per prompt after
    /// its n samples, with the same prompt_uid and `is_baseline` = true; `advantage --estimator
    /// remax` takes its score as the group's baseline and leaves the row out of training.
    #[arg(long, value_enum, value_name = "KIND")]
    #[serde(default)]
    pub baseline: Option<Baseline>,
    /// A tool the model may call (repeatable): `python`, `NAME=cmd:PROGRAM` or
    /// `NAME=python:FILE.py:CLASS` (docs/AGENTS.md). With tools, a turn that ends in
    /// `<tool_call>`s continues after their results (multi-turn rollout).
    #[arg(long = "tool", value_name = "SPEC")]
    #[serde(default)]
    pub tool: Vec<String>,
    /// With tools: how the model calls them: `hermes` (`<tool_call>{…}</tool_call>`, results
    /// in the template's tool turn) or `code` (a closed ```python block runs in the `python`
    /// tool, its output follows inline in a ```output block; needs --tool python).
    #[arg(long, value_enum, default_value = "hermes", value_name = "FORMAT")]
    #[serde(default)]
    pub tool_format: ToolFormat,
    /// With tools: assistant turns per sample at most (>= 1; the last one's calls are not run).
    #[arg(long, default_value_t = 8, value_parser = at_least(1usize))]
    pub max_turns: usize,
    /// With tools: tool calls per sample at most (>= 1); calls past it are not run.
    #[arg(long, default_value_t = 8, value_parser = at_least(1usize))]
    pub max_tool_calls: usize,
    /// With tools: new tokens of one assistant turn at most (>= 1; default
    /// --max-response-tokens).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    pub max_turn_tokens: Option<usize>,
    /// With tools: response tokens at most, sampled and tool observations together (>= 1;
    /// default --max-new-tokens); the length overlong shaping sees.
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    pub max_response_tokens: Option<usize>,
    /// With tools: tool calls of one turn at most (>= 1; verl's `max_parallel_calls`); the
    /// turn's further calls are not run.
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    #[serde(default)]
    pub max_parallel_calls: Option<usize>,
    /// With tools: a tool result longer than this many characters is cut before the model
    /// reads it (verl's `max_tool_response_length`; default: not cut).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    #[serde(default)]
    pub max_tool_response_chars: Option<usize>,
    /// With tools: the part of a long result kept (verl's `tool_response_truncate_side`):
    /// left (its start), right (its end) or middle (both ends).
    #[arg(long, value_enum, default_value = "middle", value_name = "SIDE")]
    pub tool_response_truncate_side: crate::tool::Side,
    /// With tools: calls running at once (>= 1).
    #[arg(long, default_value_t = 16, value_parser = at_least(1usize))]
    pub tool_concurrency: usize,
    /// With tools: seconds a call may take before its result is `error: tool timed out after
    /// SECS s` (> 0).
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = range(Bound::Excluded(0.0f64), Bound::Unbounded))]
    pub tool_timeout: f64,
    /// Partial rollouts (`[placement] mode = "async"`): generate one round of at most N new
    /// tokens per sequence, continuing the sequences of --carry and starting those of --in's
    /// prompts; groups whose samples all ended go to --out, the others to --carry-out. Each
    /// token's policy version is recorded (`token_policy_version`). With --tool, episodes of
    /// turns are carried across rounds (a turn's calls run at the end of the round that ends
    /// it). Refuses --baseline.
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    #[serde(default)]
    pub round_tokens: Option<usize>,
    /// With --round-tokens: the sequences in flight, as the round before wrote them to its
    /// --carry-out (none in the first round).
    #[arg(long, value_name = "FILE")]
    #[serde(default)]
    pub carry: Option<PathBuf>,
    /// With --round-tokens: where the groups still in flight after this round go.
    #[arg(long, value_name = "FILE")]
    #[serde(default)]
    pub carry_out: Option<PathBuf>,
    /// Training step, recorded in the output's metadata (`step`).
    #[arg(long, value_parser = at_least(0u64))]
    pub step: Option<u64>,
    /// Write generation metrics as JSON here.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// With a LoRA adapter as --model: `merged` samples from W + (α/r)·B·A merged once per
    /// policy version (a copy of the weights), `unmerged` adds (α/r)·(x·Aᵀ)·Bᵀ at each step on
    /// the untouched base (no copy); docs/LORA.md. No effect on a plain model.
    #[arg(long, value_enum, default_value_t = LoraMode::Merged, value_name = "MODE")]
    #[serde(default)]
    pub lora_mode: LoraMode,
    /// Where to compute: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Send the job to the warm daemon listening on this socket instead of loading the model
    /// here (default: $TANDEM_DAEMON).
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
}

/// `--top-k`: -1 (all tokens) or a count >= 1.
fn top_k(text: &str) -> Result<i64, String> {
    match text.trim() {
        "-1" => Ok(-1),
        _ => at_least(1i64)(text).map_err(|_| "must be -1 (all tokens) or an integer >= 1".into()),
    }
}

/// Load the model and generate every sample.
pub struct Generate<'a> {
    dir: &'a Path,
    requests: &'a [Request],
    params: &'a GenParams,
    /// Also one greedy response per request, appended to its samples (`--baseline greedy`).
    baseline: bool,
    detok: Detokenize<'a>,
    bar: &'a ProgressBar,
    limits: Limits,
    /// With tools: how a turn that calls them continues.
    agent: Option<&'a Agent<'a>>,
    /// How an adapter generates (`--lora-mode`).
    pub(crate) lora_mode: LoraMode,
}

/// What a generation did, for the metrics.
#[derive(Default)]
pub struct Generated {
    pub completions: Vec<Vec<Completion>>,
    pub stats: PagedStats,
    /// Seconds loading the model (0 when it was already resident).
    pub load_s: f64,
    pub gen_s: f64,
    pub kv_pool_bytes: usize,
    /// Free device memory with the KV pool held and after it was released (GPU only).
    pub free_with_pool: Option<usize>,
    pub free_after_release: Option<usize>,
    /// How the decode steps ran (graph replays, padding) and the graphs' memory.
    pub graphs: GraphStats,
    /// The kernels were batch-invariant: the log-probs are the trainer's for these weights.
    pub batch_invariant: bool,
    /// Seconds generating the greedy baselines (their responses are the last of each
    /// prompt's completions).
    pub baseline_s: f64,
}

impl Generated {
    /// This rank's samples and counters as a payload for rank 0 ([`Generated::decode`]).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.completions.len() as u64);
        for samples in &self.completions {
            w.u64(samples.len() as u64);
            for c in samples {
                let trajectory = match &c.trajectory {
                    Some(t) => serde_json::to_string(t).expect("a trajectory is JSON"),
                    None => String::new(),
                };
                w.u32s(&c.tokens)
                    .f32s(&c.logprobs)
                    .u64((c.finish == FinishReason::Stop) as u64)
                    .str(&c.text)
                    .str(&trajectory);
            }
        }
        let s = &self.stats;
        let g = &self.graphs;
        for v in [
            s.gen.prefill_tokens,
            s.gen.generated_tokens,
            s.gen.decode_steps,
            s.gen.prefills,
            s.preemptions,
            s.peak_blocks_in_use,
            s.blocks_in_use_at_end,
            s.overlapped_steps,
            s.overlap_discarded,
            s.num_blocks,
            s.block_size,
            self.kv_pool_bytes,
            g.replays,
            g.padded_steps,
            g.eager_steps,
            g.captures,
            g.padding_rows,
            g.graph_bytes,
            g.capture_us as usize,
            g.drops,
            self.batch_invariant as usize,
            s.tool_calls,
            s.tool_errors,
        ] {
            w.u64(v as u64);
        }
        for v in [self.free_with_pool, self.free_after_release] {
            w.u64(v.map_or(u64::MAX, |b| b as u64));
        }
        w.f64(self.load_s)
            .f64(self.gen_s)
            .f64(s.tool_wait_s)
            .f64(self.baseline_s);
        w.finish()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Generated> {
        let mut r = Reader::new(bytes);
        let prompts = r.u64()? as usize;
        let mut completions = Vec::with_capacity(prompts);
        for _ in 0..prompts {
            let n = r.u64()? as usize;
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                samples.push(Completion {
                    tokens: r.u32s()?,
                    logprobs: r.f32s()?,
                    finish: match r.u64()? {
                        1 => FinishReason::Stop,
                        _ => FinishReason::Length,
                    },
                    text: r.str()?,
                    trajectory: match r.str()? {
                        t if t.is_empty() => None,
                        t => Some(serde_json::from_str(&t)?),
                    },
                });
            }
            completions.push(samples);
        }
        let mut v = [0usize; 23];
        for x in v.iter_mut() {
            *x = r.u64()? as usize;
        }
        let mut free = [None; 2];
        for f in free.iter_mut() {
            let b = r.u64()?;
            *f = (b != u64::MAX).then_some(b as usize);
        }
        let (load_s, gen_s, tool_wait_s, baseline_s) = (r.f64()?, r.f64()?, r.f64()?, r.f64()?);
        let mut g = Generated {
            completions,
            load_s,
            gen_s,
            baseline_s,
            kv_pool_bytes: v[11],
            free_with_pool: free[0],
            free_after_release: free[1],
            batch_invariant: v[20] != 0,
            ..Generated::default()
        };
        let s = &mut g.stats;
        s.gen.prefill_tokens = v[0];
        s.gen.generated_tokens = v[1];
        s.gen.decode_steps = v[2];
        s.gen.prefills = v[3];
        s.preemptions = v[4];
        s.peak_blocks_in_use = v[5];
        s.blocks_in_use_at_end = v[6];
        s.overlapped_steps = v[7];
        s.overlap_discarded = v[8];
        s.num_blocks = v[9];
        s.block_size = v[10];
        (s.tool_calls, s.tool_errors, s.tool_wait_s) = (v[21], v[22], tool_wait_s);
        let gr = &mut g.graphs;
        gr.replays = v[12];
        gr.padded_steps = v[13];
        gr.eager_steps = v[14];
        gr.captures = v[15];
        gr.padding_rows = v[16];
        gr.graph_bytes = v[17];
        gr.capture_us = v[18] as u64;
        gr.drops = v[19];
        Ok(g)
    }

    /// The ranks' generations (in rank order) as one: the samples in order, work summed, the
    /// seconds and peaks of the slowest rank (they ran at the same time), the least memory any
    /// rank had free; batch-invariant only if every rank was.
    pub(crate) fn merge(parts: Vec<Generated>) -> Generated {
        let mut out = Generated {
            batch_invariant: true,
            ..Generated::default()
        };
        let min = |a: Option<usize>, b: Option<usize>| match (a, b) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        for p in parts {
            out.completions.extend(p.completions);
            let (s, t) = (&mut out.stats, &p.stats);
            s.gen.prefill_tokens += t.gen.prefill_tokens;
            s.gen.generated_tokens += t.gen.generated_tokens;
            s.gen.decode_steps += t.gen.decode_steps;
            s.gen.prefills += t.gen.prefills;
            s.preemptions += t.preemptions;
            s.peak_blocks_in_use = s.peak_blocks_in_use.max(t.peak_blocks_in_use);
            s.blocks_in_use_at_end += t.blocks_in_use_at_end;
            s.overlapped_steps += t.overlapped_steps;
            s.overlap_discarded += t.overlap_discarded;
            s.num_blocks = s.num_blocks.max(t.num_blocks);
            s.block_size = s.block_size.max(t.block_size);
            s.tool_calls += t.tool_calls;
            s.tool_errors += t.tool_errors;
            s.tool_wait_s = s.tool_wait_s.max(t.tool_wait_s);
            let (g, h) = (&mut out.graphs, &p.graphs);
            g.replays += h.replays;
            g.padded_steps += h.padded_steps;
            g.eager_steps += h.eager_steps;
            g.captures += h.captures;
            g.padding_rows += h.padding_rows;
            g.graph_bytes = g.graph_bytes.max(h.graph_bytes);
            g.capture_us = g.capture_us.max(h.capture_us);
            g.drops += h.drops;
            out.load_s = out.load_s.max(p.load_s);
            out.gen_s = out.gen_s.max(p.gen_s);
            out.baseline_s = out.baseline_s.max(p.baseline_s);
            out.kv_pool_bytes = out.kv_pool_bytes.max(p.kv_pool_bytes);
            out.free_with_pool = min(out.free_with_pool, p.free_with_pool);
            out.free_after_release = min(out.free_after_release, p.free_after_release);
            out.batch_invariant &= p.batch_invariant;
        }
        out
    }
}

impl Job for Generate<'_> {
    type Out = Generated;
    fn run<B: Backend>(self, backend: B) -> Result<Generated> {
        let started = Instant::now();
        let mut policy = load_policy_as(backend, self.dir, self.lora_mode)?;
        let load_s = started.elapsed().as_secs_f64();
        let mut out = self.generate_on(&mut policy)?;
        out.load_s = load_s;
        Ok(out)
    }
}

impl<'a> Generate<'a> {
    /// One pass over `requests` with no tools and no baseline (`tandem serve`'s batches).
    pub(crate) fn plain(
        dir: &'a Path,
        requests: &'a [Request],
        params: &'a GenParams,
        detok: Detokenize<'a>,
        bar: &'a ProgressBar,
        limits: Limits,
    ) -> Generate<'a> {
        Generate {
            dir,
            requests,
            params,
            baseline: false,
            detok,
            bar,
            limits,
            agent: None,
            lora_mode: LoraMode::Merged,
        }
    }
}

impl Generate<'_> {
    /// Generates with a policy already loaded (the load time it reports is 0).
    pub(crate) fn generate_on<B: Backend>(self, policy: &mut Decoder<B>) -> Result<Generated> {
        let bar = self.bar;
        let mut out = self.pass(policy, self.requests, self.params, &mut |done| {
            bar.set_position(done as u64)
        })?;
        if self.baseline {
            // A pass of its own: the engine samples a whole batch under one set of parameters.
            // Greedy decoding draws nothing, so the requests' keys do not matter.
            let started = Instant::now();
            let greedy = GenParams {
                sampling: SamplingParams::greedy(),
                ..self.params.clone()
            };
            let one: Vec<Request> = self
                .requests
                .iter()
                .map(|r| Request {
                    max_new: Vec::new(),
                    prompt: r.prompt.clone(),
                    sample_keys: r.sample_keys[..1].to_vec(),
                })
                .collect();
            let b = self.pass(policy, &one, &greedy, &mut |_| {})?;
            for (samples, mut greedy) in out.completions.iter_mut().zip(b.completions) {
                samples.push(greedy.pop().expect("one greedy response per prompt"));
            }
            out.baseline_s = started.elapsed().as_secs_f64();
        }
        out.free_after_release = policy.backend().device_memory()?.map(|(f, _)| f);
        out.batch_invariant = policy.backend().batch_invariant();
        Ok(out)
    }

    /// One generation of `requests` under `params` (with tools, whole trajectories), its KV
    /// pool and graphs released after.
    fn pass<B: Backend>(
        &self,
        policy: &mut Decoder<B>,
        requests: &[Request],
        params: &GenParams,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Generated> {
        // With tools the pool is sized for whole trajectories.
        let whole = GenParams {
            max_new_tokens: self
                .agent
                .map_or(params.max_new_tokens, |a| a.limits.max_response_tokens),
            ..params.clone()
        };
        let (mut engine, plan) = PagedDecoder::sized(policy, requests, &whole, &self.limits)?;
        let gen_started = Instant::now();
        let (completions, stats) = generate_turns(
            &mut engine,
            &plan.config,
            requests,
            params,
            Some(self.detok),
            self.agent,
            progress,
        )?;
        let gen_s = gen_started.elapsed().as_secs_f64();
        let free_with_pool = engine.decoder.backend().device_memory()?.map(|(f, _)| f);
        // Give the pool and the graphs back (what a colocated engine does before the update).
        let graphs = engine.release_graphs()?;
        drop(engine);
        policy.backend().trim()?;
        Ok(Generated {
            completions,
            stats,
            gen_s,
            kv_pool_bytes: plan.kv_pool_bytes(),
            free_with_pool,
            graphs,
            ..Generated::default()
        })
    }
}

impl RolloutArgs {
    /// Checks the flags as the stage does before reading its input.
    pub fn check(&self) -> Result<()> {
        if self.round_tokens.is_some() {
            self.check_round_flags()?;
        } else if self.carry.is_some() || self.carry_out.is_some() {
            bail_input!(
                "--carry and --carry-out go with --round-tokens N (a round of partial rollouts)"
            );
        }
        self.sampling().map(|_| ())
    }

    /// The flags a round of partial rollouts (`--round-tokens`) does not take.
    fn check_round_flags(&self) -> Result<()> {
        if self.baseline.is_some() {
            bail_input!("--round-tokens: partial rollouts take no --baseline");
        }
        if self.carry_out.is_none() {
            bail_input!(
                "--round-tokens needs --carry-out FILE (where the groups still in flight go)"
            );
        }
        Ok(())
    }

    /// The temperature of the log-probs the rollout records: --temperature, or 1 when greedy.
    pub fn logprob_temperature(&self) -> f32 {
        self.params().logprob_temperature()
    }

    /// The recorded response lengths of --response-lengths.
    pub(super) fn recorded_lengths(&self) -> Result<Option<ResponseLengths>> {
        self.response_lengths
            .as_deref()
            .map(ResponseLengths::read)
            .transpose()
    }

    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }

    /// What to generate: the sampling, the length, the stop ids (the model's EOS ids `eos`
    /// unless --ignore-eos, then --stop-token-ids) and the stop strings.
    pub(super) fn gen_params(&self, sampling: SamplingParams, eos: &[u32]) -> GenParams {
        let mut stop_ids = if self.ignore_eos {
            vec![]
        } else {
            eos.to_vec()
        };
        for &t in &self.stop_token_ids {
            if !stop_ids.contains(&t) {
                stop_ids.push(t);
            }
        }
        GenParams {
            sampling,
            max_new_tokens: match self.tool.is_empty() {
                true => self.max_new_tokens,
                false => self.turn_limits().1,
            },
            stop_token_ids: stop_ids,
            stop_strings: self.stop.clone(),
        }
    }

    /// What a sample that calls `tools` is continued with: the limits, concurrency, timeout
    /// and result cut of the flags, the observations of `observe` and the tool arguments
    /// `kwargs` (one per request).
    pub(crate) fn agent<'a>(
        &self,
        tools: Arc<dyn Tools>,
        observe: Observe<'a>,
        kwargs: Vec<serde_json::Value>,
    ) -> Agent<'a> {
        Agent {
            tools,
            limits: self.turn_limits().0,
            concurrency: self.tool_concurrency,
            timeout: Duration::from_secs_f64(self.tool_timeout),
            observe,
            cut: self
                .max_tool_response_chars
                .map(|n| (n, self.tool_response_truncate_side)),
            kwargs,
        }
    }

    /// With tools: the trajectory's limits and the new tokens of one turn.
    pub(crate) fn turn_limits(&self) -> (TurnLimits, usize) {
        let total = self.max_response_tokens.unwrap_or(self.max_new_tokens);
        let limits = TurnLimits {
            max_turns: self.max_turns,
            max_tool_calls: self.max_tool_calls,
            max_parallel_calls: self.max_parallel_calls.unwrap_or(usize::MAX),
            max_response_tokens: total,
            format: self.tool_format,
        };
        (limits, self.max_turn_tokens.unwrap_or(total))
    }

    /// The tool schemas the chat template offers in the prompts: none in the code format, where
    /// the system prompt says how to write code (Hermes' schemas would ask for `<tool_call>`s).
    pub(crate) fn prompt_schemas(&self, tools: Option<&dyn Tools>) -> Vec<serde_json::Value> {
        match (tools, self.tool_format) {
            (Some(t), ToolFormat::Hermes) => t.schemas(),
            _ => vec![],
        }
    }

    /// What the engine may take.
    pub(super) fn limits(&self) -> Limits {
        Limits {
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            gpu_memory_fraction: Some(self.gpu_memory_fraction),
            graphs: !self.no_cuda_graphs,
            overlap: !self.no_overlap,
        }
    }

    /// The sampling parameters, and the checks that span flags (each flag's own range is
    /// checked by its parser).
    pub(super) fn sampling(&self) -> Result<SamplingParams> {
        let p = self.params();
        p.validate().map_err(|e| input_error(e.to_string()))?;
        if self.max_batched_tokens < self.max_num_seqs {
            bail_input!(
                "--max-batched-tokens ({}) must be >= --max-num-seqs ({}): every running sample needs a token per step",
                self.max_batched_tokens,
                self.max_num_seqs
            );
        }
        if self.stop.iter().any(String::is_empty) {
            bail_input!("--stop: stop strings must not be empty");
        }
        let (limits, turn) = self.turn_limits();
        if !self.tool.is_empty() && turn > limits.max_response_tokens {
            bail_input!(
                "--max-turn-tokens ({turn}) must be <= --max-response-tokens ({})",
                limits.max_response_tokens
            );
        }
        if self.tool_format == ToolFormat::Code && !self.tool.iter().any(|t| t == CODE_TOOL) {
            bail_input!("--tool-format code runs each ```python block in the `{CODE_TOOL}` tool: add --tool {CODE_TOOL}");
        }
        if !self.tool.is_empty() && self.raw_prompt {
            bail_input!("--tool needs the chat template (it offers the tools and wraps their results): drop --raw-prompt");
        }
        if self.system_prompt.is_some() && self.raw_prompt {
            bail_input!("--system-prompt needs the chat template (it writes the system message): drop --raw-prompt");
        }
        Ok(p)
    }
}

/// The stage with its compute on `exec`, offering the tools of --tool.
pub fn run(args: RolloutArgs, exec: &mut dyn Exec) -> Result<()> {
    // The flags first: a bad one is reported before any tool starts.
    args.check()?;
    let tools = stage_tools(&args.tool, Duration::from_secs_f64(args.tool_timeout))?;
    run_with_tools(args, exec, tools)
}

/// The stage offering `tools` (None: single-turn). `run` builds them from --tool; tests give
/// their own.
pub fn run_with_tools(
    args: RolloutArgs,
    exec: &mut dyn Exec,
    tools: Option<Arc<dyn Tools>>,
) -> Result<()> {
    if args.round_tokens.is_some() {
        // `stage::run_job` sends a round to `rollout_round`.
        anyhow::bail!("rollout: --round-tokens is one round of partial rollouts (rollout_round), not a rollout");
    }
    let started = Instant::now();
    super::common::refuse_in_place(&args.input, &args.out, "out")?;
    let sampling = args.sampling()?;
    if tools.is_some() == args.tool.is_empty() {
        anyhow::bail!("rollout: the tools given and --tool disagree");
    }
    let dataset = PromptDataset::open_with_key(&args.input, &args.prompt_key)?
        .with_system(args.system_prompt.as_deref());
    let n_prompts = args.limit.unwrap_or(dataset.len()).min(dataset.len());
    if n_prompts == 0 {
        bail_input!("--limit 0: nothing to generate");
    }
    if writes_files(exec) {
        log_left_out(&dataset, "rollout", &mut |m| exec.log(m));
    }
    // The rows' tool arguments (verl's tools_kwargs), checked before the model loads.
    let row_kwargs = match tools {
        Some(_) => dataset.tools_kwargs()?,
        None => vec![],
    };
    let schemas = args.prompt_schemas(tools.as_deref());
    let prep = Prepared::load(&args, &dataset, n_prompts, &schemas)?;
    let (prompt_uids, mut requests) = keyed_requests(&prep.prompts, args.n, args.seed);
    let params = args.gen_params(sampling, &prep.cfg.eos_token_ids);
    if let Some(lengths) = args.recorded_lengths()? {
        lengths.apply(&mut requests, params.max_new_tokens);
    }
    // Ids past the tokenizer's vocabulary (padded embedding rows) decode to nothing.
    let detok = |ids: &[u32]| prep.tokenizer.decode(ids, true);
    let text = prep.template.as_ref().map(|template| ToolText {
        template,
        tokenizer: &prep.tokenizer,
    });
    let observe = |turn: &[u32], contents: &[String]| {
        observation(text.as_ref(), args.tool_format, &detok, (turn, contents))
    };
    // This process's prompts (all of them alone, its block among several ranks).
    let block = my_block(exec, n_prompts);
    let agent = tools.map(|tools| {
        // With tools, one per dataset row.
        let kwargs = row_kwargs[block.clone()]
            .iter()
            .map(|k| k.clone().unwrap_or_default())
            .collect();
        args.agent(tools, &observe, kwargs)
    });
    let bar = exec.progress_bar(block.len() * args.n, "rollout");
    let job = Generate {
        dir: &prep.model.dir,
        requests: &requests[block.clone()],
        params: &params,
        baseline: args.baseline.is_some(),
        detok: &detok,
        bar: &bar,
        limits: args.limits(),
        agent: agent.as_ref(),
        lora_mode: args.lora_mode,
    };
    let generated = match block.is_empty() {
        // A rank with no prompt (fewer prompts than ranks) loads nothing.
        true => Generated {
            batch_invariant: true,
            ..Generated::default()
        },
        false => exec.generate(&prep.model, job)?,
    };
    bar.finish_and_clear();
    // Rank 0 gets every rank's samples, in prompt order; the other ranks are done.
    let Some(mut parts) = gather_results(exec, generated, Generated::encode, Generated::decode)?
    else {
        return Ok(());
    };
    let ranks = parts.len();
    let generated = match ranks {
        1 => parts.pop().expect("one part"),
        _ => Generated::merge(parts),
    };
    let out = Output {
        args: &args,
        model: &prep.model,
        sampling,
        stop_ids: &params.stop_token_ids,
        generated: &generated,
    };
    let written = out.write_all(&prep, &prompt_uids, &dataset, ranks, started)?;
    exec.log(&written);
    Ok(())
}

/// The model the stage runs and its prompts as token ids.
pub(super) struct Prepared {
    pub(super) model: ModelRef,
    pub(super) cfg: Config,
    pub(super) tokenizer: Tokenizer,
    pub(super) prompts: Vec<Vec<u32>>,
    /// Prompts cut to --max-prompt-tokens.
    truncated: usize,
    /// None with --raw-prompt.
    template: Option<ChatTemplate>,
}

impl Prepared {
    /// Resolves the model and tokenizes the first `n_prompts` prompts with its chat template
    /// (unless --raw-prompt), offering the tools of `schemas`.
    pub(super) fn load(
        args: &RolloutArgs,
        dataset: &PromptDataset,
        n_prompts: usize,
        schemas: &[serde_json::Value],
    ) -> Result<Prepared> {
        let model = resolve_model(&args.model)?;
        let cfg = ModelDir::load_config(&model.dir)?;
        let tokenizer = Tokenizer::from_dir(&model.dir)?;
        let template = if args.raw_prompt {
            None
        } else {
            Some(ChatTemplate::from_dir(&model.dir)?)
        };
        let (prompts, truncated) = tokenize_prompts(
            dataset,
            n_prompts,
            &tokenizer,
            template.as_ref(),
            cfg.vocab_size,
            &PromptLimits {
                prompt_key: &args.prompt_key,
                max_prompt_tokens: args.max_prompt_tokens,
                truncate: args.truncate,
                tools: schemas,
            },
        )?;
        Ok(Prepared {
            model,
            cfg,
            tokenizer,
            prompts,
            truncated,
            template,
        })
    }
}

/// The requests of the prompts, `n` samples each, with their random keys, and the prompts'
/// uids. A repeated prompt is told apart by its occurrence number.
pub(crate) fn keyed_requests(
    prompts: &[Vec<u32>],
    n: usize,
    seed: u64,
) -> (Vec<String>, Vec<Request>) {
    let mut seen: HashMap<&[u32], u64> = HashMap::new();
    let mut prompt_uids = Vec::with_capacity(prompts.len());
    let mut requests = Vec::with_capacity(prompts.len());
    for ids in prompts {
        let occ = seen.entry(ids).or_insert(0);
        let keys: Vec<u64> = (0..n as u64)
            .map(|s| sample_key(seed, ids, *occ, s))
            .collect();
        prompt_uids.push(format!("{:016x}", sample_key(seed, ids, *occ, u64::MAX)));
        *occ += 1;
        requests.push(Request {
            max_new: Vec::new(),
            prompt: ids.clone(),
            sample_keys: keys,
        });
    }
    (prompt_uids, requests)
}

/// The rows of the output, one per sample, the n samples of a prompt side by side (then its
/// greedy baseline, with --baseline): uids, prompt and response ids (ragged, as offsets and
/// values), log-probs, texts, finish reasons, and which rows are baselines (None without
/// --baseline: no column).
struct SampleRows {
    uids: Vec<String>,
    puids: Vec<String>,
    prompts: (Vec<usize>, Vec<i32>),
    responses: (Vec<usize>, Vec<i32>),
    logprobs: Vec<f32>,
    texts: Vec<String>,
    reasons: Vec<&'static str>,
    /// Multi-turn rows (with tools): their mask and inspection columns.
    turns: Option<TurnColumns>,
    baseline: Option<Vec<bool>>,
}

impl SampleRows {
    /// The rows of `completions`, the samples of the prompts `prompts` (as ids, with their
    /// messages in `dataset`); with `baseline`, the last completion of each prompt is its
    /// greedy baseline.
    fn new(
        completions: &[Vec<Completion>],
        (prompts, prompt_uids): (&[Vec<u32>], &[String]),
        dataset: &PromptDataset,
        baseline: bool,
        format: ToolFormat,
    ) -> Result<Self> {
        let total = completions.iter().map(Vec::len).sum();
        let mut uids = Vec::with_capacity(total);
        let mut puids = Vec::with_capacity(total);
        let (mut p_off, mut p_ids) = (vec![0usize], Vec::new());
        let (mut r_off, mut r_ids, mut lps) = (vec![0usize], Vec::new(), Vec::new());
        let mut texts = Vec::with_capacity(total);
        let mut reasons = Vec::with_capacity(total);
        let multi_turn = completions.iter().flatten().any(|c| c.trajectory.is_some());
        let mut turns = multi_turn.then(|| TurnColumns::new(format));
        let mut is_baseline = Vec::with_capacity(total);
        for (i, samples) in completions.iter().enumerate() {
            for (j, c) in samples.iter().enumerate() {
                if let Some(t) = &mut turns {
                    t.push(c, &dataset.row(i).messages)?;
                }
                let b = baseline && j + 1 == samples.len();
                is_baseline.push(b);
                uids.push(match b {
                    true => format!("{}-greedy", prompt_uids[i]),
                    false => format!("{}-{j}", prompt_uids[i]),
                });
                puids.push(prompt_uids[i].clone());
                p_ids.extend(prompts[i].iter().map(|&t| t as i32));
                p_off.push(p_ids.len());
                r_ids.extend(c.tokens.iter().map(|&t| t as i32));
                lps.extend_from_slice(&c.logprobs);
                r_off.push(r_ids.len());
                texts.push(c.text.clone());
                reasons.push(c.finish.as_str());
            }
        }
        Ok(SampleRows {
            uids,
            puids,
            prompts: (p_off, p_ids),
            responses: (r_off, r_ids),
            logprobs: lps,
            texts,
            reasons,
            turns,
            baseline: baseline.then_some(is_baseline),
        })
    }
}

/// What the output's writing found, for the metrics and the log: counts over the samples
/// (baseline rows apart).
struct Summary {
    response_tokens: usize,
    response_length_max: usize,
    n_stop: usize,
    samples: usize,
    /// Greedy baselines: how many, and their response tokens.
    baselines: usize,
    baseline_tokens: usize,
    /// With tools: model tokens (mask 1), tool calls, failed calls, mean turns.
    model_tokens: usize,
    tool_calls: usize,
    tool_errors: usize,
    tool_seconds: f64,
    mean_turns: f64,
}

impl Summary {
    /// Over the rows of response offsets `r_off`, finish `reasons` and `mask` (None: every
    /// token is the model's), `baseline` rows apart; the tool counts from `turns`.
    fn new(
        (r_off, reasons): (&[usize], &[&str]),
        mask: Option<&[u8]>,
        baseline: Option<&[bool]>,
        turns: Option<&TurnColumns>,
    ) -> Summary {
        let mut s = Summary {
            response_tokens: 0,
            response_length_max: 0,
            n_stop: 0,
            samples: 0,
            baselines: 0,
            baseline_tokens: 0,
            model_tokens: 0,
            tool_calls: turns.map_or(0, |t| t.calls),
            tool_errors: turns.map_or(0, |t| t.errors),
            tool_seconds: turns.map_or(0.0, |t| t.call_seconds),
            mean_turns: turns.map_or(1.0, TurnColumns::mean_turns),
        };
        for (i, w) in r_off.windows(2).enumerate() {
            let len = w[1] - w[0];
            if baseline.is_some_and(|b| b[i]) {
                s.baselines += 1;
                s.baseline_tokens += len;
                continue;
            }
            s.samples += 1;
            s.response_tokens += len;
            s.response_length_max = s.response_length_max.max(len);
            s.n_stop += usize::from(reasons[i] == "stop");
            s.model_tokens += mask.map_or(len, |m| m[w[0]..w[1]].iter().map(|&x| x as usize).sum());
        }
        s
    }
}

/// The output of rank 0: the batch file with its metadata, and the metrics.
pub(super) struct Output<'a> {
    pub(super) args: &'a RolloutArgs,
    pub(super) model: &'a ModelRef,
    pub(super) sampling: SamplingParams,
    pub(super) stop_ids: &'a [u32],
    pub(super) generated: &'a Generated,
}

impl Output<'_> {
    /// Writes the batch of `prep`'s prompts and the metrics; returns the log line.
    fn write_all(
        &self,
        prep: &Prepared,
        prompt_uids: &[String],
        dataset: &PromptDataset,
        ranks: usize,
        started: Instant,
    ) -> Result<String> {
        let (args, n_prompts) = (self.args, prep.prompts.len());
        let rows = SampleRows::new(
            &self.generated.completions,
            (&prep.prompts, prompt_uids),
            dataset,
            args.baseline.is_some(),
            args.tool_format,
        )?;
        // Each prompt's dataset row for its n samples and its baseline.
        let rows_per_prompt = args.n + usize::from(args.baseline.is_some());
        let take = repeat_each(&(0..n_prompts).collect::<Vec<_>>(), rows_per_prompt);
        let summary = self.write(rows, dataset.take_columns(&take)?)?;
        let total_s = started.elapsed().as_secs_f64();
        let metrics = self.metrics(&summary, &prep.prompts, prep.truncated, ranks, total_s);
        if let Some(path) = &args.metrics {
            write_json(path, &metrics)?;
        }
        let (total, response_tokens) = (n_prompts * args.n, summary.response_tokens);
        let tools = match args.tool.is_empty() {
            true => String::new(),
            false => format!(
                ", {:.2} turns and {:.2} tool calls per sample ({} failed)",
                summary.mean_turns,
                summary.tool_calls as f64 / total as f64,
                summary.tool_errors
            ),
        };
        let baselines = match summary.baselines {
            0 => String::new(),
            b => format!(
                " + {b} greedy baselines ({:.2}s)",
                self.generated.baseline_s
            ),
        };
        Ok(format!(
            "rollout: {n_prompts} prompts x {} = {total} samples{baselines}, {response_tokens} tokens ({:.1} tok/s), {:.0}% stopped{tools} -> {} in {total_s:.2}s",
            args.n,
            response_tokens as f64 / self.generated.gen_s.max(1e-9),
            100.0 * summary.n_stop as f64 / total as f64,
            args.out.display()
        ))
    }

    /// Writes the batch: the sequence columns (with the dataset's columns of each row's
    /// prompt), finish reasons and log-probs, and the metadata.
    fn write(&self, rows: SampleRows, dataset_columns: Vec<(Field, ArrayRef)>) -> Result<Summary> {
        let SampleRows {
            uids,
            puids,
            prompts,
            responses,
            logprobs,
            texts,
            reasons,
            turns,
            baseline,
        } = rows;
        let r_off = responses.0.clone();
        let mask = turns.as_ref().map(|t| t.mask.clone());
        let summary = Summary::new(
            (&r_off, &reasons),
            mask.as_deref(),
            baseline.as_deref(),
            turns.as_ref(),
        );
        // The inspection columns replace any dataset column of their names.
        let dataset_columns = match &turns {
            None => dataset_columns,
            Some(_) => dataset_columns
                .into_iter()
                .filter(|(f, _)| {
                    ![schema::NUM_TURNS, schema::TOOL_CALLS, schema::MESSAGES]
                        .contains(&f.name().as_str())
                })
                .collect(),
        };
        let mut cols = sequence_columns(
            uids,
            puids,
            dataset_columns,
            (&prompts.0, prompts.1),
            (&responses.0, responses.1, mask),
            texts,
        );
        cols.extend([
            (
                schema::field(schema::FINISH_REASON),
                Arc::new(StringArray::from(reasons)) as ArrayRef,
            ),
            (
                schema::field(schema::ROLLOUT_LOGPROBS),
                list_array::<Float32Type>(&r_off, logprobs),
            ),
        ]);
        if let Some(t) = turns {
            cols.extend(t.columns());
        }
        if let Some(b) = baseline {
            cols.push((
                schema::field(schema::IS_BASELINE),
                Arc::new(BooleanArray::from(b)) as ArrayRef,
            ));
        }
        let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
        let data = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?;
        write_file(&self.args.out, &data, &self.meta())?;
        Ok(summary)
    }

    /// The output's metadata: the stage's parameters, the model, the log-probs' temperature,
    /// and whether they may stand for the old log-probs.
    pub(super) fn meta(&self) -> BTreeMap<String, String> {
        let (args, model, sampling) = (self.args, self.model, self.sampling);
        let batch_invariant = self.generated.batch_invariant;
        let info = StageInfo {
            stage: "rollout",
            params: json!({
                "model": model.dir.display().to_string(),
                "input": args.input.display().to_string(),
                "n": args.n,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "max_new_tokens": args.max_new_tokens,
                "max_prompt_tokens": args.max_prompt_tokens,
                "seed": args.seed,
                "limit": args.limit,
                "raw_prompt": args.raw_prompt,
                "truncate": format!("{:?}", args.truncate).to_lowercase(),
                "stop": args.stop,
                "stop_token_ids": self.stop_ids,
                "logprob_temperature": sampling.logprob_temperature(),
                "device": args.device.to_string(),
                "batch_invariant": batch_invariant,
                "tool": args.tool,
                "tool_format": args.tool_format,
                "max_turns": args.max_turns,
                "max_tool_calls": args.max_tool_calls,
                "max_turn_tokens": args.turn_limits().1,
                "max_response_tokens": args.turn_limits().0.max_response_tokens,
                "max_parallel_calls": args.max_parallel_calls,
                "max_tool_response_chars": args.max_tool_response_chars,
                "tool_response_truncate_side": args.tool_response_truncate_side,
                "tool_concurrency": args.tool_concurrency,
                "tool_timeout": args.tool_timeout,
                "baseline": args.baseline.map(|_| "greedy"),
                "round_tokens": args.round_tokens,
            }),
            policy_version: Some(model.policy_version),
            step: args.step,
        };
        let mut kv = stage_meta(BTreeMap::new(), &info);
        kv.insert("model".into(), model.dir.display().to_string());
        kv.insert(
            meta::LOGPROB_TEMPERATURE.into(),
            sampling.logprob_temperature().to_string(),
        );
        if batch_invariant {
            // What update --bypass-mode checks before it takes these log-probs as the old ones.
            kv.insert(meta::OLD_LOGPROBS.into(), meta::OLD_LOGPROBS_ROLLOUT.into());
        }
        debug_assert!(kv.contains_key(meta::POLICY_VERSION));
        kv
    }

    /// The generation metrics.
    fn metrics(
        &self,
        s: &Summary,
        prompts: &[Vec<u32>],
        truncated: usize,
        ranks: usize,
        total_s: f64,
    ) -> serde_json::Value {
        let (args, g) = (self.args, self.generated);
        let (stats, graphs) = (&g.stats, &g.graphs);
        let total = s.samples;
        json!({
            "stage": "rollout",
            "prompts": prompts.len(),
            "samples": total,
            "truncated_prompts": truncated,
            "prompt_tokens": prompts.iter().map(Vec::len).sum::<usize>() * args.n,
            "prefill_tokens": stats.gen.prefill_tokens,
            "prefills": stats.gen.prefills,
            "engine_steps": stats.gen.decode_steps,
            "overlapped_steps": stats.overlapped_steps,
            "overlap_discarded_tokens": stats.overlap_discarded,
            "preemptions": stats.preemptions,
            "kv_block_size": stats.block_size,
            "kv_blocks": stats.num_blocks,
            "kv_blocks_peak": stats.peak_blocks_in_use,
            "kv_pool_bytes": g.kv_pool_bytes,
            "device_free_bytes_with_pool": g.free_with_pool,
            "device_free_bytes_after_release": g.free_after_release,
            "cuda_graphs": json!({
                "replays": graphs.replays,
                "captures": graphs.captures,
                "eager_steps": graphs.eager_steps,
                "padding_rows": graphs.padding_rows,
                "graph_bytes_released": graphs.graph_bytes,
            }),
            "response_tokens": s.response_tokens,
            "response_length_mean": s.response_tokens as f64 / total as f64,
            "response_length_max": s.response_length_max,
            "finish_stop_fraction": s.n_stop as f64 / total as f64,
            "generation_tokens_per_s": s.response_tokens as f64 / g.gen_s.max(1e-9),
            "generation_seconds": g.gen_s,
            "load_seconds": g.load_s,
            "seconds": total_s,
            "policy_version": self.model.policy_version,
            "batch_invariant": g.batch_invariant,
            "ranks": ranks,
            "response_model_tokens": s.model_tokens,
            "turns_mean": s.mean_turns,
            "tool_calls": s.tool_calls,
            "tool_calls_per_sample": s.tool_calls as f64 / total as f64,
            "tool_errors": s.tool_errors,
            "tool_wait_seconds": stats.tool_wait_s,
            "tool_call_seconds": s.tool_seconds,
            "baseline_samples": s.baselines,
            "baseline_response_length_mean": (s.baselines > 0)
                .then(|| s.baseline_tokens as f64 / s.baselines as f64),
            "baseline_seconds": g.baseline_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::paged::{CallRecord, Trajectory};

    /// A rank's samples reach rank 0 whole: multi-turn ones with their trajectory, and the
    /// tool counters.
    #[test]
    fn a_ranks_samples_and_trajectories_round_trip() {
        let traj = Trajectory {
            mask: vec![1, 1, 0, 0, 1],
            turns: vec!["<tool_call>{}</tool_call>".into(), "#### 5".into()],
            calls: vec![CallRecord {
                turn: 0,
                name: "add".into(),
                arguments: json!({"a": 2}),
                result: "error: tool timed out after 10 s".into(),
                seconds: 10.0,
                error: Some("tool timed out after 10 s".into()),
            }],
        };
        let c = |t: Option<Trajectory>| Completion {
            tokens: vec![1, 2, 3, 4, 5],
            logprobs: vec![-0.5, -1.0, 0.0, 0.0, -2.0],
            finish: FinishReason::Stop,
            text: "#### 5".into(),
            trajectory: t,
        };
        let mut g = Generated {
            completions: vec![vec![c(Some(traj)), c(None)]],
            ..Generated::default()
        };
        g.stats.tool_calls = 3;
        g.stats.tool_errors = 1;
        g.stats.tool_wait_s = 0.25;
        let back = Generated::decode(&g.encode()).unwrap();
        assert_eq!(back.completions, g.completions);
        assert_eq!(back.stats, g.stats);
    }
}
