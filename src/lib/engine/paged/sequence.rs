//! One sequence the scheduler runs: a prompt not yet forked into its samples (it holds their
//! seats), or one sample. Its tokens (prompt, then generated), how many of them are in the KV
//! cache, its block table, and what it drew.

use anyhow::{bail, Result};
use std::ops::Range;

use super::request::{Completion, Detokenize, FinishReason, StopRule};
use super::turns::{Trajectory, TurnLimits};
use crate::backend::ops::sample::Sampled;
use crate::tool::{code, ToolCall, ToolFormat};

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
    /// Where the current assistant turn starts in `tokens` (the prompt's end for the first).
    pub(super) turn_start: usize,
    /// A multi-turn sample's mask, turns and calls (None: one turn, no tools).
    pub(super) traj: Option<Box<Trajectory>>,
    /// The calls of the turn it ended with, to run once it is parked (a zombie parks when the
    /// step queued behind it has been applied).
    pub(super) calls_due: Option<Vec<Result<ToolCall, String>>>,
    /// Response tokens after which the sample ends by length, its own limit
    /// (`Request::max_new`; `usize::MAX`: none, or a prompt).
    pub(super) limit: usize,
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

    /// Appends a drawn token; returns why the turn is finished, if it is ([`turn_end`] over
    /// the current turn).
    pub(super) fn accept(&mut self, d: Sampled, rule: &StopRule) -> Result<Option<FinishReason>> {
        self.tokens.push(d.token);
        self.logprobs.push(d.logprob);
        if let Some(t) = &mut self.traj {
            t.mask.push(1);
        }
        if let Kind::Sample { sample, .. } = self.kind {
            crate::engine::stream::emit(self.req, sample, d.token, d.logprob);
        }
        let response = self.tokens.len() - self.prompt_len;
        let Some((reason, text)) = turn_end(&self.tokens[self.turn_start..], response, rule)?
        else {
            return Ok((response >= self.limit).then_some(FinishReason::Length));
        };
        if let (Some(t), Kind::Sample { stopped_text, .. }) = (text, &mut self.kind) {
            *stopped_text = Some(t);
        }
        Ok(Some(reason))
    }

    /// Sample `sample` of this prompt, the `k`-th forked from it, over `blocks`: the prompt's
    /// tokens, all in the cache; it ends by length after `limit` response tokens.
    pub(super) fn sample(
        &self,
        (sample, k): (usize, usize),
        blocks: Vec<u32>,
        turns: bool,
        limit: usize,
    ) -> Seq {
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
            turn_start: self.prompt_len,
            traj: turns.then(Box::default),
            calls_due: None,
            limit,
        }
    }

    /// The text of the current turn: cut before its stop string, or decoded.
    pub(super) fn turn_text(&self, detok: Option<Detokenize>) -> Result<String> {
        let Kind::Sample { stopped_text, .. } = &self.kind else {
            bail!("a prompt sequence has no turn");
        };
        Ok(match (stopped_text, detok) {
            (Some(t), _) => t.clone(),
            (None, Some(d)) => d(&self.tokens[self.turn_start..])?,
            (None, None) => String::new(),
        })
    }

    /// Appends an observation's tokens (mask 0, log-prob 0) and starts the next turn after
    /// them.
    pub(super) fn observe(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
        self.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        if let Some(t) = &mut self.traj {
            t.mask.extend(std::iter::repeat_n(0, ids.len()));
        }
        self.turn_start = self.tokens.len();
        if let Kind::Sample { stopped_text, .. } = &mut self.kind {
            *stopped_text = None;
        }
    }

    /// (request, sample index, completion) of a sample finished for `reason`; its tokens and
    /// log-probs are taken out (it keeps its blocks).
    pub(super) fn take_completion(
        &mut self,
        reason: FinishReason,
        detok: Option<Detokenize>,
    ) -> Result<(usize, usize, Completion)> {
        let Kind::Sample { sample, .. } = &self.kind else {
            bail!("a prompt sequence cannot finish");
        };
        let sample = *sample;
        // The last turn's text: what a reward reads (the whole response when single-turn). A
        // trajectory ended by its observation (no room left) has an empty last turn.
        let open_turn = self.turn_start < self.tokens.len();
        let text = match open_turn {
            true => self.turn_text(detok)?,
            false => String::new(),
        };
        let mut traj = self.traj.take();
        if let (Some(t), true) = (&mut traj, open_turn) {
            t.turns.push(text.clone());
        }
        let tokens = std::mem::take(&mut self.tokens);
        let completion = Completion {
            tokens: tokens[self.prompt_len..].to_vec(),
            logprobs: std::mem::take(&mut self.logprobs),
            finish: reason,
            text,
            trajectory: traj.map(|t| *t),
        };
        Ok((self.req, sample, completion))
    }
}

/// Why a turn ends after the token just drawn (the last of `turn`, the turn's tokens;
/// `response` tokens in the whole response), if it does, with the turn's text when it is cut
/// or kept whole: in the code format a closed ```` ```python ```` block first (the text kept
/// whole); then `GenParams::finish`, the one stop rule, over the turn; then the trajectory's
/// length limit. The engine's samples and the rounds of partial rollouts
/// (`super::partial`) end turns by it.
pub(super) fn turn_end(
    turn: &[u32],
    response: usize,
    rule: &StopRule,
) -> Result<Option<(FinishReason, Option<String>)>> {
    if let Some(text) = closed_code_block(turn, rule.detok, rule.turns.as_ref())? {
        return Ok(Some((FinishReason::Stop, Some(text))));
    }
    if let Some(end) = rule.params.finish(turn, rule.detok)? {
        return Ok(Some(end));
    }
    if rule
        .turns
        .is_some_and(|l| response >= l.max_response_tokens)
    {
        return Ok(Some((FinishReason::Length, None)));
    }
    Ok(None)
}

/// In the code format, the text of `turn` when its last token closed a ```` ```python ````
/// block in it (the turn then ends, its text kept whole).
fn closed_code_block(
    turn: &[u32],
    detok: Option<Detokenize>,
    limits: Option<&TurnLimits>,
) -> Result<Option<String>> {
    let (Some(d), Some(ToolFormat::Code), Some(last)) =
        (detok, limits.map(|l| l.format), turn.last())
    else {
        return Ok(None);
    };
    // Only a token holding a backtick can complete a fence: the turn is decoded again then
    // only.
    if !d(std::slice::from_ref(last))?.contains('`') {
        return Ok(None);
    }
    let text = d(turn)?;
    Ok(code::closed_block(&text).is_some().then_some(text))
}
