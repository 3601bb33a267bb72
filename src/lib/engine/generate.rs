//! Batched generation over a KV cache with continuous batching: a fixed pool of cache slots,
//! prompts admitted as slots free up, the n samples of a prompt sharing one prefill (`fork`),
//! one batched decode step over every running sample at a time.
//!
//! Stopping, as vLLM does by default:
//! - a stop token id (EOS of config.json / generation_config.json, or given) ends the sample;
//!   the token is kept in `tokens` (and its log-prob), `finish_reason` is `stop`;
//! - a stop string is searched in the decoded text after every token; the sample ends, its
//!   `tokens` keep every sampled token up to the one that completed the stop string, and its
//!   `text` is cut just before the stop string (vLLM's `include_stop_str_in_output=False`);
//! - otherwise the sample ends after `max_new_tokens` tokens with `finish_reason` `length`.

use super::sampling::{sample, uniform, Sampled, SamplingParams, Scratch};
use crate::backend::Backend;
use crate::model::decoder::{Decoder, KvCache};
use anyhow::{bail, ensure, Result};
use rayon::prelude::*;
use std::collections::VecDeque;

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

/// A model that can run sequences incrementally in numbered cache slots. [`CachedDecoder`] is
/// the real one; tests use small closed-form models.
pub trait StepModel {
    fn vocab(&self) -> usize;
    /// Number of slots and tokens per slot the cache holds.
    fn capacity(&self) -> (usize, usize);
    /// Runs `tokens` into an empty slot; the logits of its last position.
    fn prefill(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Appends one token to each slot; logits `[slots.len(), vocab]`.
    fn decode(&mut self, slots: &[usize], tokens: &[u32]) -> Result<Vec<f32>>;
    /// Copies slot `from` (contents and length) into the empty slot `to`.
    fn fork(&mut self, from: usize, to: usize) -> Result<()>;
    /// Empties a slot.
    fn free(&mut self, slot: usize);
}

/// The decoder with a KV cache of its own.
pub struct CachedDecoder<'a, B: Backend> {
    pub decoder: &'a mut Decoder<B>,
    pub cache: KvCache<B>,
    vocab: usize,
    slots: usize,
    max_len: usize,
}

impl<'a, B: Backend> CachedDecoder<'a, B> {
    pub fn new(
        decoder: &'a mut Decoder<B>,
        vocab: usize,
        slots: usize,
        max_len: usize,
    ) -> Result<Self> {
        let cache = decoder.new_cache(slots, max_len)?;
        Ok(CachedDecoder {
            decoder,
            cache,
            vocab,
            slots,
            max_len,
        })
    }
}

impl<B: Backend> StepModel for CachedDecoder<'_, B> {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn capacity(&self) -> (usize, usize) {
        (self.slots, self.max_len)
    }
    fn prefill(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.decoder.prefill(&mut self.cache, slot, tokens)
    }
    fn decode(&mut self, slots: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
        self.decoder.decode(&mut self.cache, slots, tokens)
    }
    fn fork(&mut self, from: usize, to: usize) -> Result<()> {
        self.decoder.fork(&mut self.cache, from, to)
    }
    fn free(&mut self, slot: usize) {
        self.cache.free(slot)
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

/// One prompt and the random keys of its samples (`sampling::sample_key`), one per sample.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sample_keys: Vec<u64>,
}

/// One finished sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    /// log p(token) under softmax(logits / T) (T = 1 when greedy).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// Decoded response (stop string cut off); empty when no detokenizer was given.
    pub text: String,
}

/// Token ids to text, for stop strings and the response text.
pub type Detokenize<'a> = &'a (dyn Fn(&[u32]) -> Result<String> + Sync);

/// Generation counters, for logs and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenStats {
    pub prefill_tokens: usize,
    pub generated_tokens: usize,
    pub decode_steps: usize,
    pub prefills: usize,
}

struct Running {
    slot: usize,
    req: usize,
    sample: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    /// Set when a stop string ended the sample: the text before it.
    stopped_text: Option<String>,
}

/// Generates every sample of every request. Returns, per request, its completions in sample
/// order. `progress` is told the number of samples finished so far.
pub fn generate(
    model: &mut dyn StepModel,
    requests: &[Request],
    params: &GenParams,
    detok: Option<Detokenize>,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<Vec<Completion>>, GenStats)> {
    params.sampling.validate()?;
    ensure!(
        params.stop_strings.is_empty() || detok.is_some(),
        "stop strings need a detokenizer"
    );
    ensure!(
        params.stop_strings.iter().all(|s| !s.is_empty()),
        "stop strings must not be empty"
    );
    let (slots, max_len) = model.capacity();
    ensure!(slots > 0, "the KV cache has no slots");
    let vocab = model.vocab();
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            bail!("request {i}: empty prompt");
        }
        // The last sampled token is never fed back, so a sample occupies prompt + new − 1 rows.
        let need = r.prompt.len() + params.max_new_tokens.saturating_sub(1);
        if need > max_len {
            bail!(
                "request {i}: prompt of {} tokens + {} new tokens does not fit the cache ({max_len} per slot)",
                r.prompt.len(),
                params.max_new_tokens
            );
        }
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("request {i}: token id {t} is outside the vocabulary ({vocab})");
        }
    }

    let mut out: Vec<Vec<Option<Completion>>> = requests
        .iter()
        .map(|r| vec![None; r.sample_keys.len()])
        .collect();
    let mut stats = GenStats::default();
    let mut finished = 0usize;
    // (request, next sample index) still to start, in request order.
    let mut pending: VecDeque<(usize, usize)> = requests
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.sample_keys.is_empty())
        .map(|(i, _)| (i, 0))
        .collect();
    if params.max_new_tokens == 0 {
        for (i, r) in requests.iter().enumerate() {
            for slot in out[i].iter_mut().take(r.sample_keys.len()) {
                *slot = Some(Completion {
                    tokens: vec![],
                    logprobs: vec![],
                    finish: FinishReason::Length,
                    text: String::new(),
                });
                finished += 1;
            }
        }
        progress(finished);
        pending.clear();
    }
    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut running: Vec<Running> = Vec::new();
    let mut scratch = Scratch::default();

    loop {
        // Admit prompts while slots are free: one prefill, forked to the other samples.
        while let (Some(&(req, first)), false) = (pending.front(), free.is_empty()) {
            let r = &requests[req];
            let take = (r.sample_keys.len() - first).min(free.len());
            let base = free.pop().expect("a free slot");
            let logits = model.prefill(base, &r.prompt)?;
            ensure!(
                logits.len() == vocab,
                "prefill returned {} logits",
                logits.len()
            );
            stats.prefills += 1;
            stats.prefill_tokens += r.prompt.len();
            let mut new = vec![base];
            for _ in 1..take {
                let s = free.pop().expect("a free slot");
                model.fork(base, s)?;
                new.push(s);
            }
            for (j, slot) in new.into_iter().enumerate() {
                let sample_idx = first + j;
                let u = uniform(r.sample_keys[sample_idx], 0);
                let s = sample(&logits, &params.sampling, u, &mut scratch)?;
                running.push(Running {
                    slot,
                    req,
                    sample: sample_idx,
                    tokens: vec![],
                    logprobs: vec![],
                    stopped_text: None,
                });
                let idx = running.len() - 1;
                stats.generated_tokens += 1;
                if let Some(reason) = accept(&mut running[idx], s, params, detok)? {
                    let done = running.swap_remove(idx);
                    finish(model, &mut free, &mut out, done, reason, detok)?;
                    finished += 1;
                    progress(finished);
                }
            }
            if first + take == r.sample_keys.len() {
                pending.pop_front();
            } else {
                pending.front_mut().expect("front").1 = first + take;
            }
        }
        if running.is_empty() {
            break;
        }

        let slot_ids: Vec<usize> = running.iter().map(|r| r.slot).collect();
        let last: Vec<u32> = running
            .iter()
            .map(|r| *r.tokens.last().expect("running samples have a token"))
            .collect();
        let logits = model.decode(&slot_ids, &last)?;
        ensure!(
            logits.len() == vocab * running.len(),
            "decode returned {} logits for {} slots",
            logits.len(),
            running.len()
        );
        stats.decode_steps += 1;
        stats.generated_tokens += running.len();
        let sampling = params.sampling;
        let drawn: Vec<Sampled> = running
            .par_iter()
            .zip(logits.par_chunks(vocab))
            .map_init(Scratch::default, |scratch, (r, row)| {
                let u = uniform(requests[r.req].sample_keys[r.sample], r.tokens.len() as u64);
                sample(row, &sampling, u, scratch)
            })
            .collect::<Result<_>>()?;
        let reasons: Vec<Option<FinishReason>> = running
            .par_iter_mut()
            .zip(drawn)
            .map(|(r, s)| accept(r, s, params, detok))
            .collect::<Result<_>>()?;
        // Remove finished samples from the back so indices stay valid.
        for i in (0..running.len()).rev() {
            if let Some(reason) = reasons[i] {
                let done = running.swap_remove(i);
                finish(model, &mut free, &mut out, done, reason, detok)?;
                finished += 1;
                progress(finished);
            }
        }
    }

    let out = out
        .into_iter()
        .map(|v| {
            v.into_iter()
                .map(|c| c.expect("every sample finished"))
                .collect()
        })
        .collect();
    Ok((out, stats))
}

/// Appends a drawn token; returns why the sample is finished, if it is.
fn accept(
    r: &mut Running,
    s: Sampled,
    params: &GenParams,
    detok: Option<Detokenize>,
) -> Result<Option<FinishReason>> {
    r.tokens.push(s.token);
    r.logprobs.push(s.logprob);
    if let (Some(d), false) = (detok, params.stop_strings.is_empty()) {
        // The whole response is decoded again: a token may complete a character (or a stop
        // string) begun by earlier tokens.
        let mut text = d(&r.tokens)?;
        if let Some(cut) = earliest_stop(&text, &params.stop_strings) {
            text.truncate(cut);
            r.stopped_text = Some(text);
            return Ok(Some(FinishReason::Stop));
        }
    }
    if params.stop_token_ids.contains(&s.token) {
        return Ok(Some(FinishReason::Stop));
    }
    if r.tokens.len() >= params.max_new_tokens {
        return Ok(Some(FinishReason::Length));
    }
    Ok(None)
}

/// Byte offset of the first occurrence of any stop string.
fn earliest_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

fn finish(
    model: &mut dyn StepModel,
    free: &mut Vec<usize>,
    out: &mut [Vec<Option<Completion>>],
    done: Running,
    finish: FinishReason,
    detok: Option<Detokenize>,
) -> Result<()> {
    model.free(done.slot);
    free.push(done.slot);
    let text = match (done.stopped_text, detok) {
        (Some(t), _) => t,
        (None, Some(d)) => d(&done.tokens)?,
        (None, None) => String::new(),
    };
    out[done.req][done.sample] = Some(Completion {
        tokens: done.tokens,
        logprobs: done.logprobs,
        finish,
        text,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::sample_key;

    /// A toy model whose logits depend on the whole context of a slot: logit[v] is a hash of
    /// (context, v) scaled to [-2, 2]. It records calls to check prefill sharing.
    struct Toy {
        vocab: usize,
        slots: Vec<Option<Vec<u32>>>,
        max_len: usize,
        prefills: usize,
        forks: usize,
        max_batch_seen: usize,
    }

    impl Toy {
        fn new(vocab: usize, slots: usize, max_len: usize) -> Toy {
            Toy {
                vocab,
                slots: vec![None; slots],
                max_len,
                prefills: 0,
                forks: 0,
                max_batch_seen: 0,
            }
        }
        fn logits(&self, ctx: &[u32]) -> Vec<f32> {
            let mut h = 1469598103934665603u64;
            for &t in ctx {
                h = (h ^ t as u64).wrapping_mul(1099511628211);
            }
            (0..self.vocab)
                .map(|v| {
                    let x = (h ^ v as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 40;
                    (x as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect()
        }
    }

    impl StepModel for Toy {
        fn vocab(&self) -> usize {
            self.vocab
        }
        fn capacity(&self) -> (usize, usize) {
            (self.slots.len(), self.max_len)
        }
        fn prefill(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
            assert!(self.slots[slot].is_none(), "prefill into a busy slot");
            self.prefills += 1;
            self.slots[slot] = Some(tokens.to_vec());
            Ok(self.logits(tokens))
        }
        fn decode(&mut self, slots: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
            self.max_batch_seen = self.max_batch_seen.max(slots.len());
            let mut out = vec![];
            for (&s, &t) in slots.iter().zip(tokens) {
                let ctx = self.slots[s].as_mut().expect("decode of an empty slot");
                ctx.push(t);
                assert!(ctx.len() <= self.max_len, "slot overflow");
                let ctx = ctx.clone();
                out.extend(self.logits(&ctx));
            }
            Ok(out)
        }
        fn fork(&mut self, from: usize, to: usize) -> Result<()> {
            assert!(self.slots[to].is_none());
            self.forks += 1;
            self.slots[to] = self.slots[from].clone();
            Ok(())
        }
        fn free(&mut self, slot: usize) {
            self.slots[slot] = None;
        }
    }

    fn params(max_new: usize) -> GenParams {
        GenParams {
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: -1,
                top_p: 1.0,
            },
            max_new_tokens: max_new,
            stop_token_ids: vec![],
            stop_strings: vec![],
        }
    }

    fn request(seed: u64, prompt: Vec<u32>, n: u64) -> Request {
        let keys = (0..n).map(|s| sample_key(seed, &prompt, 0, s)).collect();
        Request {
            prompt,
            sample_keys: keys,
        }
    }

    fn run(
        toy: &mut Toy,
        reqs: &[Request],
        p: &GenParams,
        detok: Option<Detokenize>,
    ) -> Vec<Vec<Completion>> {
        generate(toy, reqs, p, detok, &mut |_| {}).unwrap().0
    }

    #[test]
    fn samples_do_not_depend_on_batch_composition() {
        let p = params(12);
        let a = request(3, vec![1, 2, 3], 4);
        let alone = run(&mut Toy::new(50, 8, 64), std::slice::from_ref(&a), &p, None);
        let others = [request(3, vec![9, 9], 3), a.clone(), request(3, vec![4], 5)];
        // Few slots: requests are admitted in waves and split across refills.
        let mixed = run(&mut Toy::new(50, 3, 64), &others, &p, None);
        assert_eq!(alone[0], mixed[1]);
        // The n samples of a prompt differ from each other.
        assert_ne!(alone[0][0].tokens, alone[0][1].tokens);
    }

    #[test]
    fn tokens_and_logprobs_follow_the_model() {
        let p = params(6);
        let req = request(11, vec![5, 6], 2);
        let mut toy = Toy::new(40, 4, 32);
        let got = run(&mut toy, std::slice::from_ref(&req), &p, None);
        for (s, c) in got[0].iter().enumerate() {
            assert_eq!(c.tokens.len(), 6);
            assert_eq!(c.finish, FinishReason::Length);
            // Replay: each token is the sample drawn from the model's logits of its context
            // with the counter-based uniform at its position.
            let mut ctx = req.prompt.clone();
            for (pos, (&t, &lp)) in c.tokens.iter().zip(&c.logprobs).enumerate() {
                let logits = toy.logits(&ctx);
                let u = uniform(req.sample_keys[s], pos as u64);
                let want = sample(&logits, &p.sampling, u, &mut Scratch::default()).unwrap();
                assert_eq!((t, lp), (want.token, want.logprob));
                ctx.push(t);
            }
        }
    }

    #[test]
    fn n_samples_share_one_prefill() {
        let p = params(3);
        let mut toy = Toy::new(30, 8, 16);
        let reqs = [request(0, vec![1, 2], 4), request(0, vec![3], 4)];
        run(&mut toy, &reqs, &p, None);
        assert_eq!(toy.prefills, 2);
        assert_eq!(toy.forks, 6);
        assert_eq!(toy.max_batch_seen, 8);
        assert!(toy.slots.iter().all(|s| s.is_none()), "slots freed");
        // With 3 slots, the 4 samples of a prompt need two prefills.
        let mut small = Toy::new(30, 3, 16);
        run(&mut small, &reqs[..1], &p, None);
        assert_eq!(small.prefills, 2);
        assert!(small.max_batch_seen <= 3);
    }

    #[test]
    fn stop_token_ends_the_sample_and_is_kept() {
        let greedy = GenParams {
            sampling: SamplingParams::greedy(),
            ..params(20)
        };
        // Greedy path without stops, then stop on its third token.
        let free_run = run(
            &mut Toy::new(25, 2, 64),
            &[request(0, vec![7], 1)],
            &greedy,
            None,
        );
        let path = free_run[0][0].tokens.clone();
        assert_eq!(path.len(), 20);
        let stop_tok = path[2];
        let first = path.iter().position(|&t| t == stop_tok).unwrap();
        let stopped = run(
            &mut Toy::new(25, 2, 64),
            &[request(0, vec![7], 1)],
            &GenParams {
                stop_token_ids: vec![stop_tok],
                ..greedy.clone()
            },
            None,
        );
        let c = &stopped[0][0];
        assert_eq!(c.finish, FinishReason::Stop);
        assert_eq!(c.tokens, path[..=first].to_vec());
        assert_eq!(c.logprobs, free_run[0][0].logprobs[..=first].to_vec());
    }

    #[test]
    fn stop_string_cuts_the_text_but_keeps_the_tokens() {
        // Token v decodes to the letter 'a' + v % 26.
        let detok = |ids: &[u32]| -> Result<String> {
            Ok(ids
                .iter()
                .map(|&t| (b'a' + (t % 26) as u8) as char)
                .collect())
        };
        let greedy = GenParams {
            sampling: SamplingParams::greedy(),
            ..params(20)
        };
        let full = run(
            &mut Toy::new(26, 2, 64),
            &[request(0, vec![1], 1)],
            &greedy,
            None,
        );
        let text = detok(&full[0][0].tokens).unwrap();
        // Stop on the two letters at positions 4..6.
        let stop = text[4..6].to_string();
        let first = text.find(&stop).unwrap();
        let got = run(
            &mut Toy::new(26, 2, 64),
            &[request(0, vec![1], 1)],
            &GenParams {
                stop_strings: vec![stop.clone(), "zzzzzz".into()],
                ..greedy
            },
            Some(&detok),
        );
        let c = &got[0][0];
        assert_eq!(c.finish, FinishReason::Stop);
        assert_eq!(c.text, text[..first]);
        assert_eq!(c.tokens, full[0][0].tokens[..first + 2].to_vec());
    }

    #[test]
    fn length_limits_and_empty_budget() {
        let got = run(
            &mut Toy::new(10, 2, 8),
            &[request(0, vec![1, 2], 3)],
            &params(0),
            None,
        );
        assert!(got[0]
            .iter()
            .all(|c| c.tokens.is_empty() && c.finish == FinishReason::Length));
        // prompt 2 + 7 new tokens occupies 8 rows: fits exactly.
        let got = run(
            &mut Toy::new(10, 2, 8),
            &[request(0, vec![1, 2], 2)],
            &params(7),
            None,
        );
        assert!(got[0].iter().all(|c| c.tokens.len() == 7));
        let err = generate(
            &mut Toy::new(10, 2, 8),
            &[request(0, vec![1, 2], 2)],
            &params(8),
            None,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }

    #[test]
    fn prompt_tokens_outside_the_vocabulary_are_rejected() {
        let err = generate(
            &mut Toy::new(10, 2, 8),
            &[request(0, vec![1, 10], 1)],
            &params(2),
            None,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("token id 10"), "{err}");
    }
}
