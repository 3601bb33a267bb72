//! Partial rollouts (AReaL's interruptible generation, slime's partial rollout): sequences
//! generated in rounds of at most `round_tokens` new tokens each, so that new weights can be
//! taken between two rounds while sequences are still in flight. A sequence in flight keeps
//! its prompt, the tokens it sampled so far, their log-probs and, per token, the policy
//! version that sampled it; the next round continues it from those tokens (prompt and
//! response so far are prefilled again, as a sequence preempted by recompute is: its KV is
//! not kept between rounds) under whatever weights the engine holds then.
//!
//! Each round draws with a key of its own (the sequence's key mixed with its length), so a
//! continuation does not replay the uniforms of the round before; stop strings are not
//! applied (they need the text across rounds): stop token ids and the length limit end a
//! sequence.

use anyhow::{ensure, Result};

use super::engine::generate_paged;
use super::request::{Completion, FinishReason, GenParams, Request};
use super::{PagedConfig, PagedModel, PagedStats};
use crate::rng::mix_key;

/// One sequence across rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub prompt: Vec<u32>,
    /// The sample's random key (`backend::ops::sample::sample_key`).
    pub key: u64,
    /// The response so far, its log-probs, and the policy version of each token.
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u64>,
    /// Set once the sequence has ended (stop token, or `max_new_tokens` in all).
    pub finish: Option<FinishReason>,
}

impl InFlight {
    /// A sequence not started yet.
    pub fn new(prompt: Vec<u32>, key: u64) -> InFlight {
        InFlight {
            prompt,
            key,
            tokens: vec![],
            logprobs: vec![],
            versions: vec![],
            finish: None,
        }
    }

    /// The oldest version among its tokens (None before its first token).
    pub fn oldest_version(&self) -> Option<u64> {
        self.versions.iter().copied().min()
    }

    /// Whether its tokens come from two versions or more (continued under new weights).
    pub fn is_mixed(&self) -> bool {
        self.versions.windows(2).any(|w| w[0] != w[1])
    }

    /// The random key of the round that continues it from its current length.
    fn round_key(&self) -> u64 {
        match self.tokens.len() {
            0 => self.key,
            n => mix_key(&[self.key, n as u64]),
        }
    }
}

/// Runs one round on `model` (the weights of policy `version`): every unfinished sequence of
/// `seqs` gets up to `round_tokens` new tokens, never more than `params.max_new_tokens` in all;
/// those that end are marked finished. Returns the engine's counters.
pub fn round(
    model: &mut dyn PagedModel,
    cfg: &PagedConfig,
    seqs: &mut [InFlight],
    params: &GenParams,
    round_tokens: usize,
    version: u64,
) -> Result<PagedStats> {
    let (live, requests, this_round) = round_requests(seqs, params, round_tokens)?;
    let (done, stats) = generate_paged(model, cfg, &requests, &this_round, None, &mut |_| {})?;
    let done: Vec<Completion> = done
        .into_iter()
        .map(|mut s| s.pop().expect("one sample per request"))
        .collect();
    absorb(seqs, &live, done, params, version);
    Ok(stats)
}

/// What a round generates: the unfinished sequences of `seqs` (their indices), a request for
/// each (prompt and response so far, the round's key, one sample), and the round's parameters
/// (at most `round_tokens` new tokens). The engine that runs them may be any (`round` above,
/// or a rollout stage's own generation on its ranks).
pub fn round_requests(
    seqs: &[InFlight],
    params: &GenParams,
    round_tokens: usize,
) -> Result<(Vec<usize>, Vec<Request>, GenParams)> {
    ensure!(round_tokens > 0, "a round needs at least one new token");
    ensure!(
        params.stop_strings.is_empty(),
        "partial rollouts end sequences on stop token ids only"
    );
    let live: Vec<usize> = (0..seqs.len())
        .filter(|&i| seqs[i].finish.is_none() && seqs[i].tokens.len() < params.max_new_tokens)
        .collect();
    let requests: Vec<Request> = live
        .iter()
        .map(|&i| Request {
            prompt: [&seqs[i].prompt[..], &seqs[i].tokens[..]].concat(),
            sample_keys: vec![seqs[i].round_key()],
        })
        .collect();
    let this_round = GenParams {
        max_new_tokens: round_tokens.min(params.max_new_tokens),
        ..params.clone()
    };
    Ok((live, requests, this_round))
}

/// Adds a round's completions (`done`, one per index of `live`, sampled by policy `version`)
/// to their sequences, and marks those that ended.
pub fn absorb(
    seqs: &mut [InFlight],
    live: &[usize],
    done: Vec<Completion>,
    params: &GenParams,
    version: u64,
) {
    for (&i, c) in live.iter().zip(done) {
        let s = &mut seqs[i];
        // A sequence with fewer tokens left than a round keeps only those.
        let room = params.max_new_tokens - s.tokens.len();
        let take = c.tokens.len().min(room);
        s.tokens.extend_from_slice(&c.tokens[..take]);
        s.logprobs.extend_from_slice(&c.logprobs[..take]);
        s.versions.extend(std::iter::repeat_n(version, take));
        s.finish = match (c.finish, take < c.tokens.len()) {
            (FinishReason::Stop, false) => Some(FinishReason::Stop),
            _ if s.tokens.len() >= params.max_new_tokens => Some(FinishReason::Length),
            _ => None,
        };
    }
}

/// The n samples of one prompt, in flight together (a group is trained whole).
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    /// The prompt's place in the stream of prompts.
    pub id: u64,
    pub seqs: Vec<InFlight>,
}

impl Group {
    fn finished(&self) -> bool {
        self.seqs.iter().all(|s| s.finish.is_some())
    }
}

/// The rollout side across rounds: the groups in flight (at most `seats` sequences), and the
/// finished groups waiting, in the order they finished, for the trainer to take them.
#[derive(Debug, Default)]
pub struct Rounds {
    pub seats: usize,
    pub in_flight: Vec<Group>,
    pub finished: std::collections::VecDeque<Group>,
}

impl Rounds {
    /// Rounds over `seats` sequences at once.
    pub fn new(seats: usize) -> Rounds {
        Rounds {
            seats,
            ..Rounds::default()
        }
    }

    /// One round under policy `version`: free seats are filled with whole groups from `next`
    /// (told the free seats; None when its next group does not fit or none is left), every
    /// sequence in flight gets up to `round_tokens` new tokens, and the groups that finished
    /// join the queue.
    pub fn round(
        &mut self,
        model: &mut dyn PagedModel,
        cfg: &PagedConfig,
        (params, round_tokens, version): (&GenParams, usize, u64),
        next: &mut dyn FnMut(usize) -> Option<Group>,
    ) -> Result<PagedStats> {
        self.round_with(next, &mut |seqs| {
            round(model, cfg, seqs, params, round_tokens, version)
        })
    }

    /// `round` with the generation `generate` (over every sequence in flight, the groups'
    /// sequences one after the other): a rollout stage generates on its ranks or daemon
    /// (`stage::rollout_round`). Returns what `generate` returned.
    pub fn round_with<T>(
        &mut self,
        next: &mut dyn FnMut(usize) -> Option<Group>,
        generate: &mut dyn FnMut(&mut [InFlight]) -> Result<T>,
    ) -> Result<T> {
        let mut used: usize = self.in_flight.iter().map(|g| g.seqs.len()).sum();
        while let Some(g) = next(self.seats - used) {
            ensure!(
                used + g.seqs.len() <= self.seats,
                "a group of {} samples does not fit the {} free seats",
                g.seqs.len(),
                self.seats - used
            );
            used += g.seqs.len();
            self.in_flight.push(g);
        }
        // One call over every group's sequences, then each group gets its own back.
        let sizes: Vec<usize> = self.in_flight.iter().map(|g| g.seqs.len()).collect();
        let mut seqs: Vec<InFlight> = self
            .in_flight
            .iter_mut()
            .flat_map(|g| std::mem::take(&mut g.seqs))
            .collect();
        let out = generate(&mut seqs)?;
        let mut it = seqs.into_iter();
        for (g, n) in self.in_flight.iter_mut().zip(sizes) {
            g.seqs = it.by_ref().take(n).collect();
        }
        let (done, going): (Vec<Group>, Vec<Group>) =
            self.in_flight.drain(..).partition(Group::finished);
        self.in_flight = going;
        self.finished.extend(done);
        Ok(out)
    }

    /// The oldest `groups` finished groups, once that many are waiting.
    pub fn take(&mut self, groups: usize) -> Option<Vec<Group>> {
        (self.finished.len() >= groups).then(|| self.finished.drain(..groups).collect())
    }

    /// Sequences in flight that have sampled tokens already (partial rollouts carried to
    /// the next round).
    pub fn carried(&self) -> usize {
        let seqs = self.in_flight.iter().flat_map(|g| &g.seqs);
        seqs.filter(|s| s.finish.is_none() && !s.tokens.is_empty())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{params, tiny_config, toy_logits, PagedToy};
    use super::super::PagedDecoder;
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::ops::sample::{sample, uniform, SamplingParams, Scratch};
    use crate::model::decoder::{Decoder, SeqRef};
    use crate::model::init::random_weights;

    fn cfg() -> PagedConfig {
        PagedConfig {
            block_size: 4,
            num_blocks: 64,
            max_num_seqs: 3,
            max_batched_tokens: 16,
            overlap: false,
        }
    }

    /// log softmax of the version's toy logits after `ctx`, at `token` (temperature 1).
    fn logprob(vocab: usize, version: u64, ctx: &[u32], token: u32) -> f32 {
        let logits = toy_logits(vocab, &PagedToy::salted_ctx(Some(version as u32), ctx));
        let max = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&z| (z as f64 - max).exp())
                .sum::<f64>()
                .ln();
        (logits[token as usize] as f64 - lse) as f32
    }

    /// Rounds of 3 tokens under versions 1, 2, 3, ... up to 7 tokens: every token's log-prob
    /// is its recorded version's, and each round's tokens are what that version draws, one
    /// after the other with the round's key, from the sequence's context.
    #[test]
    fn rounds_continue_sequences_under_the_newest_version() {
        let vocab = 23;
        let p = params(7, vec![]);
        let mut seqs: Vec<InFlight> = (0..5u32)
            .map(|i| InFlight::new(vec![i + 1, 2 * i + 3, 5], 100 + i as u64))
            .collect();
        let mut version = 1;
        while seqs.iter().any(|s| s.finish.is_none()) {
            let mut toy = PagedToy::new(vocab, &cfg()).with_salt(version as u32);
            let before = seqs.clone();
            round(&mut toy, &cfg(), &mut seqs, &p, 3, version).unwrap();
            for (b, s) in before.iter().zip(&seqs) {
                // The reference: the round's draws one by one from the version's logits.
                let key = b.round_key();
                let mut ctx = [&b.prompt[..], &b.tokens[..]].concat();
                for pos in b.tokens.len()..s.tokens.len() {
                    let logits =
                        toy_logits(vocab, &PagedToy::salted_ctx(Some(version as u32), &ctx));
                    let u = uniform(key, (pos - b.tokens.len()) as u64);
                    let d = sample(&logits, &p.sampling, u, &mut Scratch::default()).unwrap();
                    assert_eq!(d.token, s.tokens[pos], "token {pos} of version {version}");
                    ctx.push(d.token);
                }
            }
            version += 1;
        }
        assert_eq!(version, 4, "7 tokens in rounds of 3: versions 1, 2, 3");
        for s in &seqs {
            assert_eq!(s.versions, [1, 1, 1, 2, 2, 2, 3]);
            assert_eq!(s.finish, Some(FinishReason::Length));
            assert!(s.is_mixed());
            assert_eq!(s.oldest_version(), Some(1));
            for (j, (&t, &lp)) in s.tokens.iter().zip(&s.logprobs).enumerate() {
                let ctx = [&s.prompt[..], &s.tokens[..j]].concat();
                let want = logprob(vocab, s.versions[j], &ctx, t);
                assert!((lp - want).abs() < 1e-5, "token {j}: {lp} vs {want}");
                // Another version's log-prob differs: the check can fail.
                let other = logprob(vocab, s.versions[j] + 10, &ctx, t);
                assert!((lp - other).abs() > 1e-6, "token {j}");
            }
        }
    }

    /// A stop token ends a sequence in the round that samples it; a stop that falls past the
    /// length limit does not count (the sequence ends by length, without it).
    #[test]
    fn stop_tokens_and_the_length_limit_end_sequences() {
        let vocab = 6;
        let p = params(5, vec![0, 1]);
        let mut seqs: Vec<InFlight> = (0..40u32)
            .map(|i| InFlight::new(vec![i % 4 + 2, 3], 7 * i as u64))
            .collect();
        let mut toy = PagedToy::new(vocab, &cfg());
        for v in 0..3 {
            round(&mut toy, &cfg(), &mut seqs, &p, 2, v).unwrap();
        }
        let mut stopped = 0;
        for s in &seqs {
            let f = s
                .finish
                .expect("5 tokens in rounds of 2: done after 3 rounds");
            let stops = s.tokens.iter().filter(|&&t| t <= 1).count();
            match f {
                FinishReason::Stop => {
                    stopped += 1;
                    assert_eq!(stops, 1, "{s:?}");
                    assert!(s.tokens.last().unwrap() <= &1, "{s:?}");
                }
                FinishReason::Length => {
                    assert_eq!(s.tokens.len(), 5, "{s:?}");
                    assert_eq!(stops, 0, "{s:?}");
                }
            }
            assert!(s.tokens.len() <= 5 && s.logprobs.len() == s.tokens.len());
        }
        assert!(stopped > 0 && stopped < seqs.len(), "{stopped}");
        // A finished sequence takes no more tokens.
        let before = seqs.clone();
        round(&mut toy, &cfg(), &mut seqs, &p, 2, 9).unwrap();
        assert_eq!(before, seqs);
        let e = round(&mut toy, &cfg(), &mut seqs, &p, 0, 9).unwrap_err();
        assert!(e.to_string().contains("at least one new token"), "{e}");
    }

    /// The real decoder on the CPU: rounds of 4 tokens under three weight versions (random
    /// weights of seeds 1, 2, 3), up to 10 tokens. Scoring each whole sequence with the
    /// training forward of every version, each token's rollout log-prob is the one its
    /// recorded version gives (and not another's): a partial rollout's log-probs are its
    /// versions'.
    #[test]
    fn real_decoder_log_probs_are_those_of_each_tokens_version() {
        let cfg = tiny_config();
        let weights: Vec<_> = (1..=3).map(|v| random_weights(&cfg, v, 0.2)).collect();
        let p = GenParams {
            sampling: SamplingParams {
                temperature: 0.9,
                top_k: -1,
                top_p: 1.0,
            },
            ..params(10, vec![])
        };
        let pc = PagedConfig {
            block_size: 4,
            num_blocks: 32,
            max_num_seqs: 4,
            max_batched_tokens: 16,
            overlap: false,
        };
        let mut seqs: Vec<InFlight> = [vec![5, 9, 13], vec![1; 7], vec![88]]
            .into_iter()
            .enumerate()
            .map(|(i, prompt)| InFlight::new(prompt, 40 + i as u64))
            .collect();
        for (v, w) in weights.iter().enumerate() {
            let mut dec = Decoder::new(Cpu, &cfg, w).unwrap();
            let mut paged = PagedDecoder::new(&mut dec, pc.num_blocks, pc.block_size).unwrap();
            round(&mut paged, &pc, &mut seqs, &p, 4, v as u64 + 1).unwrap();
        }
        let full: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| [&s.prompt[..], &s.tokens[..]].concat())
            .collect();
        let refs: Vec<SeqRef> = full
            .iter()
            .zip(&seqs)
            .map(|(t, s)| SeqRef {
                tokens: t,
                start: s.prompt.len(),
            })
            .collect();
        let scored: Vec<_> = weights
            .iter()
            .map(|w| {
                let mut dec = Decoder::new(Cpu, &cfg, w).unwrap();
                dec.logprobs(&refs, 0.9, false).unwrap()
            })
            .collect();
        let mut compared = 0;
        for (i, s) in seqs.iter().enumerate() {
            assert_eq!(s.versions, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]);
            assert_eq!(s.finish, Some(FinishReason::Length));
            for (j, &lp) in s.logprobs.iter().enumerate() {
                for (v, by) in scored.iter().enumerate() {
                    let d = (lp - by[i].logprobs[j]).abs();
                    match v as u64 + 1 == s.versions[j] {
                        true => assert!(d < 1e-5, "row {i} token {j}: {lp} vs version {v}"),
                        false => assert!(d > 1e-4, "row {i} token {j}: version {v} too"),
                    }
                }
                compared += 1;
            }
        }
        assert_eq!(compared, 30);
    }

    /// A stream of 9 prompts in groups of 2 over 7 seats (three groups at a time: a fourth
    /// does not fit the one seat left), rounds of 2
    /// tokens up to 6 (stops shorten some), the trainer taking 2 finished groups whenever
    /// they wait and publishing the next version: seats are never overfilled, groups finish
    /// whole and in the queue's order, every taken group's tokens come from versions no newer
    /// than the one in training when it was taken, and some groups were continued under a
    /// newer version than they started with.
    #[test]
    fn rounds_fill_seats_with_whole_groups_and_queue_the_finished() {
        let vocab = 9;
        let p = params(6, vec![0]);
        let mut prompts = (0..9u64)
            .map(|id| Group {
                id,
                seqs: (0..2)
                    .map(|j| InFlight::new(vec![id as u32 % 7 + 1, 2], id * 10 + j))
                    .collect(),
            })
            .peekable();
        // The next group, when its 2 samples fit the free seats.
        let mut next = move |free: usize| match prompts.peek() {
            Some(_) if free >= 2 => prompts.next(),
            _ => None,
        };
        let mut rounds = Rounds::new(7);
        let (mut version, mut taken, mut carried_max) = (0, vec![], 0);
        for _ in 0..40 {
            let mut toy = PagedToy::new(vocab, &cfg()).with_salt(version as u32);
            rounds
                .round(&mut toy, &cfg(), (&p, 2, version), &mut next)
                .unwrap();
            let seats: usize = rounds.in_flight.iter().map(|g| g.seqs.len()).sum();
            assert!(seats <= 6, "{seats} sequences in flight over 7 seats");
            carried_max = carried_max.max(rounds.carried());
            if let Some(groups) = rounds.take(2) {
                for g in &groups {
                    assert!(g.finished() && g.seqs.len() == 2, "{g:?}");
                    assert!(g
                        .seqs
                        .iter()
                        .flat_map(|s| &s.versions)
                        .all(|&v| v <= version));
                }
                taken.extend(groups);
                version += 1;
            }
        }
        assert_eq!(taken.len(), 8, "4 batches of 2; the 9th group waits");
        assert_eq!(rounds.finished.len(), 1);
        assert!(rounds.in_flight.is_empty());
        let mut ids: Vec<u64> = taken.iter().map(|g| g.id).collect();
        ids.sort();
        assert_eq!(ids.len(), 8);
        ids.dedup();
        assert_eq!(ids.len(), 8, "no group taken twice");
        assert!(carried_max > 0, "sequences were carried between rounds");
        let mixed = taken.iter().flat_map(|g| &g.seqs).filter(|s| s.is_mixed());
        assert!(mixed.count() > 0, "some sequences span two versions");
        // A group larger than the seats is an error, not a hang.
        let mut big = Some(Group {
            id: 99,
            seqs: (0..6).map(|j| InFlight::new(vec![1], j)).collect(),
        });
        let mut toy = PagedToy::new(vocab, &cfg());
        let e = Rounds::new(5)
            .round(&mut toy, &cfg(), (&p, 2, 0), &mut |_| big.take())
            .unwrap_err();
        assert!(
            e.to_string().contains("does not fit the 5 free seats"),
            "{e}"
        );
    }
}
