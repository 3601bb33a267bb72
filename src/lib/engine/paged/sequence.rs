//! One sequence the scheduler runs: a prompt not yet forked into its samples (it holds their
//! seats), or one sample. Its tokens (prompt, then generated), how many of them are in the KV
//! cache, its block table, and what it drew.

use anyhow::{bail, Result};
use std::ops::Range;

use super::request::{Completion, Detokenize, FinishReason, GenParams};
use crate::backend::ops::sample::Sampled;

pub(super) enum Kind {
    /// A prompt not yet forked: holds the seats of these samples and, when its last block is
    /// partial, one spare block per extra sample for the copies.
    Prompt {
        samples: Range<usize>,
        spare: Vec<u32>,
    },
    /// One sample.
    Sample {
        sample: usize,
        stopped_text: Option<String>,
    },
}

pub(super) struct Seq {
    pub(super) req: usize,
    pub(super) kind: Kind,
    /// Prompt then generated tokens.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    /// Positions whose keys and values are in the cache.
    pub(super) computed: usize,
    pub(super) blocks: Vec<u32>,
    pub(super) logprobs: Vec<f32>,
    /// Admission order (newer is larger); preemption takes the newest first.
    pub(super) order: (u64, usize),
    /// Finished (its completion is out) while a step that feeds it was already queued: it
    /// keeps its blocks, which that step writes, until the step's draws are applied.
    pub(super) zombie: bool,
}

impl Seq {
    /// Seats (running samples) it holds.
    pub(super) fn seats(&self) -> usize {
        match &self.kind {
            Kind::Prompt { samples, .. } => samples.len(),
            Kind::Sample { .. } => 1,
        }
    }

    /// Tokens not yet in the cache.
    pub(super) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether the tokens fed now are prefill work (prompt or recompute), not a decode.
    pub(super) fn prefix_is_prompt_or_resume(&self) -> bool {
        self.pending() > 1 || matches!(self.kind, Kind::Prompt { .. })
    }

    /// Appends a drawn token; returns why the sample is finished, if it is (`GenParams::finish`,
    /// the one stop rule).
    pub(super) fn accept(
        &mut self,
        d: Sampled,
        params: &GenParams,
        detok: Option<Detokenize>,
    ) -> Result<Option<FinishReason>> {
        self.tokens.push(d.token);
        self.logprobs.push(d.logprob);
        let Some((reason, text)) = params.finish(&self.tokens[self.prompt_len..], detok)? else {
            return Ok(None);
        };
        if let (Some(t), Kind::Sample { stopped_text, .. }) = (text, &mut self.kind) {
            *stopped_text = Some(t);
        }
        Ok(Some(reason))
    }

    /// Sample `sample` of this prompt, the `k`-th forked from it, over `blocks`: the prompt's
    /// tokens, all in the cache.
    pub(super) fn sample(&self, sample: usize, k: usize, blocks: Vec<u32>) -> Seq {
        Seq {
            req: self.req,
            kind: Kind::Sample {
                sample,
                stopped_text: None,
            },
            tokens: self.tokens.clone(),
            prompt_len: self.prompt_len,
            computed: self.computed,
            blocks,
            logprobs: vec![],
            order: (self.order.0, k),
            zombie: false,
        }
    }

    /// (request, sample index, completion) of a sample finished for `reason`; its tokens and
    /// log-probs are taken out (it keeps its blocks).
    pub(super) fn take_completion(
        &mut self,
        reason: FinishReason,
        detok: Option<Detokenize>,
    ) -> Result<(usize, usize, Completion)> {
        let (req, sample, text) = self.completion_text(detok)?;
        let tokens = std::mem::take(&mut self.tokens);
        let completion = Completion {
            tokens: tokens[self.prompt_len..].to_vec(),
            logprobs: std::mem::take(&mut self.logprobs),
            finish: reason,
            text,
        };
        Ok((req, sample, completion))
    }

    /// (request, sample index, response text) of a finished sample.
    fn completion_text(&self, detok: Option<Detokenize>) -> Result<(usize, usize, String)> {
        let Kind::Sample {
            sample,
            stopped_text,
        } = &self.kind
        else {
            bail!("a prompt sequence cannot finish");
        };
        let text = match (stopped_text, detok) {
            (Some(t), _) => t.clone(),
            (None, Some(d)) => d(&self.tokens[self.prompt_len..])?,
            (None, None) => String::new(),
        };
        Ok((self.req, *sample, text))
    }
}
