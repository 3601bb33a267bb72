//! What the engine is asked for and what it gives back: requests (a prompt and the random keys
//! of its samples), the generation parameters with the one check of both, the one stop rule,
//! and the finished samples.
//!
//! Stopping, as vLLM does by default:
//! - a stop string is searched in the decoded text after every token; the sample ends, its
//!   `tokens` keep every sampled token up to the one that completed the stop string, and its
//!   `text` is cut just before the stop string (vLLM's `include_stop_str_in_output=False`);
//! - a stop token id (EOS of config.json / generation_config.json, or given) ends the sample;
//!   the token is kept in `tokens` (and its log-prob), `finish_reason` is `stop`;
//! - otherwise the sample ends after `max_new_tokens` tokens with `finish_reason` `length`.

use anyhow::{bail, ensure, Result};

use super::turns::{Trajectory, TurnLimits};
use super::PagedConfig;
use crate::backend::ops::sample::SamplingParams;
use crate::error::input_error;

/// One prompt and the random keys of its samples (`backend::ops::sample::sample_key`), one per
/// sample.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sample_keys: Vec<u64>,
    /// Each sample's own limit of new tokens, below `GenParams::max_new_tokens` (empty: that
    /// limit for all): a sample ends at it with `finish_reason` `length`. A recorded length
    /// distribution played by a model that never stops by itself (`rollout
    /// --response-lengths`), and the rest of such a limit in a round of partial rollouts.
    pub max_new: Vec<usize>,
}

impl Request {
    /// Sample `j`'s limit of new tokens, if it has one of its own.
    pub(crate) fn sample_limit(&self, j: usize) -> Option<usize> {
        self.max_new.get(j).copied()
    }
}

/// What to generate for every request.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// Needs a detokenizer.
    pub stop_strings: Vec<String>,
}

/// Why a sample ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One finished sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    /// log p(token) under softmax(logits / T) (T = 1 when greedy).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// Decoded response (stop string cut off); empty when no detokenizer was given. With
    /// tools: the last assistant turn's text (what follows the last observation).
    pub text: String,
    /// With tools: the mask, turns and calls of the trajectory (None for one turn).
    pub trajectory: Option<Trajectory>,
}

/// Token ids to text, for stop strings and the response text.
pub type Detokenize<'a> = &'a (dyn Fn(&[u32]) -> Result<String> + Sync);

/// What every draw is checked against: the stop rule's parameters and the detokenizer, and
/// with tools the trajectory's limits.
pub struct StopRule<'a> {
    pub params: &'a GenParams,
    pub detok: Option<Detokenize<'a>>,
    /// With tools: the trajectory's limits.
    pub turns: Option<TurnLimits>,
}

impl GenParams {
    /// Checks the parameters and every request before anything runs: prompts must be
    /// non-empty, inside the model's `vocab`, and one sample alone must fit the KV pool of
    /// `cfg` (or no schedule could ever finish it). The messages name the request and the flag
    /// to change.
    pub fn check(
        &self,
        requests: &[Request],
        vocab: usize,
        cfg: &PagedConfig,
        detok: bool,
    ) -> Result<()> {
        self.sampling.validate()?;
        ensure!(
            self.stop_strings.is_empty() || detok,
            "stop strings need a detokenizer"
        );
        ensure!(
            self.stop_strings.iter().all(|s| !s.is_empty()),
            "stop strings must not be empty"
        );
        for (i, r) in requests.iter().enumerate() {
            if r.prompt.is_empty() {
                bail!(input_error(format!("request {i}: empty prompt")));
            }
            if !r.max_new.is_empty() && r.max_new.len() != r.sample_keys.len() {
                bail!(
                    "request {i}: {} sample limits for {} samples",
                    r.max_new.len(),
                    r.sample_keys.len()
                );
            }
            if let Some(j) = r
                .max_new
                .iter()
                .position(|&m| m == 0 || m > self.max_new_tokens)
            {
                bail!(
                    "request {i}: sample {j}'s limit of {} new tokens is not in 1..={}",
                    r.max_new[j],
                    self.max_new_tokens
                );
            }
            if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
                bail!(input_error(format!(
                    "request {i}: token id {t} is outside the vocabulary ({vocab})"
                )));
            }
            // The last sampled token is never fed back, so a sample occupies prompt + new − 1
            // positions; alone it must fit the whole pool or it could never finish.
            let positions = r.prompt.len() + self.max_new_tokens.saturating_sub(1);
            let need = positions.div_ceil(cfg.block_size);
            if need > cfg.num_blocks {
                bail!(input_error(format!(
                    "request {i}: prompt of {} tokens + {} new tokens needs {need} KV blocks of {} tokens, the pool has {} (raise --gpu-memory-fraction or lower --max-new-tokens / --max-prompt-tokens)",
                    r.prompt.len(),
                    self.max_new_tokens,
                    cfg.block_size,
                    cfg.num_blocks
                )));
            }
        }
        Ok(())
    }

    /// The stop rule (module doc), after a token was drawn: `response` is the sample's
    /// response so far, ending with that token. Returns why the sample ends, if it does, and
    /// for a stop string the text cut just before it.
    pub fn finish(
        &self,
        response: &[u32],
        detok: Option<Detokenize>,
    ) -> Result<Option<(FinishReason, Option<String>)>> {
        let Some(&last) = response.last() else {
            bail!("the stop rule needs a drawn token");
        };
        if let (Some(d), false) = (detok, self.stop_strings.is_empty()) {
            // The whole response is decoded again: a token may complete a character (or a stop
            // string) begun by earlier tokens.
            let mut text = d(response)?;
            if let Some(cut) = self
                .stop_strings
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min()
            {
                text.truncate(cut);
                return Ok(Some((FinishReason::Stop, Some(text))));
            }
        }
        if self.stop_token_ids.contains(&last) {
            return Ok(Some((FinishReason::Stop, None)));
        }
        if response.len() >= self.max_new_tokens {
            return Ok(Some((FinishReason::Length, None)));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(max_new: usize, stop_ids: Vec<u32>, stop_strings: &[&str]) -> GenParams {
        GenParams {
            sampling: SamplingParams::greedy(),
            max_new_tokens: max_new,
            stop_token_ids: stop_ids,
            stop_strings: stop_strings.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Token v decodes to the letter 'a' + v % 26.
    fn letters(ids: &[u32]) -> Result<String> {
        Ok(ids
            .iter()
            .map(|&t| (b'a' + (t % 26) as u8) as char)
            .collect())
    }

    #[test]
    fn stop_string_then_stop_id_then_length() {
        let p = params(4, vec![7], &["cd", "zz"]);
        let d: Detokenize = &letters;
        // "ab": nothing yet; "abc" + 'd' completes "cd": the text is cut before it.
        assert_eq!(p.finish(&[0, 1], Some(d)).unwrap(), None);
        assert_eq!(
            p.finish(&[0, 1, 2, 3], Some(d)).unwrap(),
            Some((FinishReason::Stop, Some("ab".into())))
        );
        // A stop string wins over a stop id drawn with it (id 7 is 'h'; "gh" is no stop).
        let q = params(9, vec![7], &["h"]);
        assert_eq!(
            q.finish(&[6, 7], Some(d)).unwrap(),
            Some((FinishReason::Stop, Some("g".into())))
        );
        // The stop id ends the sample (the token is kept by the caller), also at the length.
        assert_eq!(
            p.finish(&[0, 1, 7], Some(d)).unwrap(),
            Some((FinishReason::Stop, None))
        );
        assert_eq!(
            p.finish(&[0, 1, 4, 7], None).unwrap(),
            Some((FinishReason::Stop, None))
        );
        // Without a detokenizer the stop strings are not searched.
        assert_eq!(
            p.finish(&[0, 1, 2, 3], None).unwrap(),
            Some((FinishReason::Length, None))
        );
        assert_eq!(p.finish(&[0, 1, 2], None).unwrap(), None);
    }

    #[test]
    fn requests_are_checked_against_the_vocabulary_and_the_pool() {
        let cfg = PagedConfig {
            block_size: 4,
            num_blocks: 3,
            max_num_seqs: 2,
            max_batched_tokens: 8,
            overlap: true,
        };
        let req = |prompt: Vec<u32>| Request {
            max_new: Vec::new(),
            prompt,
            sample_keys: vec![1],
        };
        let p = params(3, vec![], &[]);
        // 10 + 3 − 1 = 12 positions: exactly 3 blocks of 4.
        p.check(&[req((0..10).collect())], 20, &cfg, false).unwrap();
        let err = params(4, vec![], &[])
            .check(&[req((0..10).collect())], 20, &cfg, false)
            .unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .contains("request 0: prompt of 10 tokens + 4 new tokens needs 4 KV blocks"),
            "{err}"
        );
        let err = p
            .check(&[req(vec![1]), req(vec![1, 20])], 20, &cfg, false)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("request 1: token id 20 is outside the vocabulary (20)"),
            "{err}"
        );
        let err = p.check(&[req(vec![])], 20, &cfg, false).unwrap_err();
        assert!(err.to_string().contains("request 0: empty prompt"), "{err}");
        let err = params(3, vec![], &["x"])
            .check(&[req(vec![1])], 20, &cfg, false)
            .unwrap_err();
        assert!(err.to_string().contains("need a detokenizer"), "{err}");
        let err = params(3, vec![], &[""])
            .check(&[req(vec![1])], 20, &cfg, true)
            .unwrap_err();
        assert!(err.to_string().contains("must not be empty"), "{err}");
        let bad = GenParams {
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
            ..p
        };
        let err = bad.check(&[req(vec![1])], 20, &cfg, false).unwrap_err();
        assert!(err.to_string().contains("--top-k"), "{err}");
    }
}
