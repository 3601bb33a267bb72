//! The generation engine (vLLM-style, split as nano-vllm is): the KV cache is a pool of
//! fixed-size blocks with a block table per sequence (`blocks`); a continuous-batching
//! scheduler with chunked prefill, prefix sharing between the n samples of a prompt and
//! preemption by recompute (`scheduler`, over the sequences of `sequence`); the step loop
//! (`engine`); and the model runner (`runner`, `graphs`), whose step runs the decoder's forward
//! pass *and* the sampling on the backend, so only token ids and log-probs come back to the
//! host. `sizing` sizes the engine for a set of requests and limits; `request` holds what it
//! is asked for, the one check of it and the one stop rule.
//!
//! The same engine runs on every backend: on the CPU it is the reference that CI tests (against
//! toy models whose logits hash the context, and against the training forward's log-probs), on
//! the GPU it is what `rollout --device cuda` uses.

pub(crate) mod blocks;
mod engine;
mod graphs;
mod kv;
pub mod partial;
mod request;
mod runner;
mod scheduler;
mod sequence;
mod sizing;
mod turns;

pub use engine::{generate_paged, generate_turns};
pub use graphs::{GraphMode, GraphStats};
pub use request::{Completion, Detokenize, FinishReason, GenParams, Request, StopRule};
pub use runner::PagedDecoder;
pub use sizing::{Limits, Need, Plan};
pub use turns::{Agent, CallRecord, Observe, Trajectory, TurnLimits};

use crate::backend::ops::sample::{Sampled, SamplingParams};
use anyhow::{bail, Result};

/// Positions per KV block (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Size of the pool and limits of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Sequences (samples) running at once.
    pub max_num_seqs: usize,
    /// Tokens fed to the model in one step (decodes plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Overlap scheduling: while the device runs a decode step, the next one is queued behind
    /// it (fed with the draws it is making), so the host's work between steps hides behind
    /// the device's (SGLang's overlap scheduler, vLLM's async scheduling). The completions
    /// are the same either way.
    pub overlap: bool,
}

impl PagedConfig {
    /// Checks the limits; the messages name the flags.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.num_blocks == 0 {
            bail!(
                "the KV pool is empty ({} blocks of {} tokens)",
                self.num_blocks,
                self.block_size
            );
        }
        if self.max_num_seqs == 0 {
            bail!("--max-num-seqs must be >= 1");
        }
        if self.max_batched_tokens < self.max_num_seqs {
            bail!(
                "--max-batched-tokens ({}) must be >= --max-num-seqs ({}): every running sequence needs a token per step",
                self.max_batched_tokens,
                self.max_num_seqs
            );
        }
        Ok(())
    }
}

/// Generation counters, for logs and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenStats {
    pub prefill_tokens: usize,
    pub generated_tokens: usize,
    pub decode_steps: usize,
    pub prefills: usize,
}

/// Counters of one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PagedStats {
    /// Prefill tokens (prompts and recomputes), sampled tokens, steps (`decode_steps`), prompt
    /// prefills.
    pub gen: GenStats,
    pub preemptions: usize,
    pub peak_blocks_in_use: usize,
    pub blocks_in_use_at_end: usize,
    /// Steps queued behind the one before (overlap scheduling).
    pub overlapped_steps: usize,
    /// Tokens such steps computed for samples that had ended meanwhile (thrown away).
    pub overlap_discarded: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Tool calls run, and those that failed (a crash, a timeout, a malformed call).
    pub tool_calls: usize,
    pub tool_errors: usize,
    /// Seconds the engine had nothing to run but waited for tools.
    pub tool_wait_s: f64,
}

/// Tokens of one sequence fed in a step: `tokens` go at positions `start..` of the sequence
/// whose block table is `table` (it covers every position up to `start + tokens.len()`).
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub table: &'a [u32],
}

/// A token to draw from the logits after the last token of chunk `chunk`, with the uniform
/// `backend::ops::sample::uniform(key, position)`. Several rows may name the same chunk (the n samples of
/// a prompt draw their first tokens from its last logits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleRow {
    pub chunk: usize,
    pub key: u64,
    pub position: u64,
}

/// A model that runs sequences over a paged KV cache and samples on its own device.
pub trait PagedModel {
    fn vocab(&self) -> usize;
    /// Runs every chunk through the model (keys and values stored at their positions through
    /// the block tables), then draws one token per row; returns them in row order.
    fn step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>>;
    /// Copies whole blocks `(src, dst)` (the partial last prompt block of forked samples).
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()>;
    /// Whether the model queues steps (`submit`, then `collect`) instead of running each in
    /// `step`. The scheduler serves a model that does not (the default) itself, running each
    /// step as it is submitted.
    fn asynchronous(&self) -> bool {
        false
    }
    /// Queues a step: like `step`, except that a chunk with `feed[c] = Some(r)` feeds, as its
    /// one token, the token drawn for row `r` of the step submitted just before (which may
    /// still be running). At most two steps are queued; `collect` returns their draws in order.
    fn submit(
        &mut self,
        _chunks: &[Chunk],
        _feed: &[Option<u32>],
        _rows: &[SampleRow],
        _sampling: &SamplingParams,
    ) -> Result<()> {
        bail!("this paged model runs its steps in `step`")
    }
    /// The draws of the oldest queued step, waiting for it to finish.
    fn collect(&mut self) -> Result<Vec<Sampled>> {
        bail!("this paged model runs its steps in `step`")
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod turn_tests;
