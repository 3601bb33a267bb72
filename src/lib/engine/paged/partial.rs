//! Partial rollouts (AReaL's interruptible generation, slime's partial rollout): sequences
//! generated in rounds of at most `round_tokens` new tokens each, so that new weights can be
//! taken between two rounds while sequences are still in flight. A sequence in flight keeps
//! its prompt, the tokens it sampled so far, their log-probs and, per token, the policy
//! version that sampled it; the next round continues it from those tokens (prompt and
//! response so far are prefilled again, as a sequence preempted by recompute is: its KV is
//! not kept between rounds) under whatever weights the engine holds then.
//!
//! Each round draws with a key of its own (the sequence's key mixed with its length), so a
//! continuation does not replay the uniforms of the round before. The round's new tokens are
//! added one by one under the engine's stop rule over the whole current turn
//! (`sequence::turn_end`: stop token ids, stop strings, the code format's closed block, the
//! length limits), so a stop string that straddles two rounds ends the sequence at the token
//! that completes it; the tokens the engine drew past it are dropped.
//!
//! With tools (an [`Agent`]) a sequence is an episode of turns: a turn that ends with calls
//! (`TurnLimits::may_call`, `calls_in`, as in the engine) has them run by the tool runner at
//! the end of the round that ended it, and the observation (mask 0, log-prob 0) is appended
//! before the next round starts the next turn; its tokens record the round's version.

use anyhow::{ensure, Result};

use super::engine::generate_paged;
use super::request::{Completion, FinishReason, GenParams, Request, StopRule};
use super::sequence::turn_end;
use super::turns::{Agent, ToolRunner, Trajectory};
use super::{PagedConfig, PagedModel, PagedStats};
use crate::rng::mix_key;
use crate::tool::ToolCall;

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
    /// Set once the sequence has ended (its turn ended under the stop rule without calls, or
    /// an observation left no room).
    pub finish: Option<FinishReason>,
    /// Once finished: its last turn's text (a stop string cut off), as a completion's.
    pub text: String,
    /// With tools: the episode's mask, turns and calls so far (None: one turn).
    pub trajectory: Option<Trajectory>,
    /// Its own limit of response tokens (`Request::max_new`: a recorded length drawn for its
    /// key), set by the stage that runs the rounds; it ends by length there.
    pub limit: Option<usize>,
}

/// A turn's calls waiting to run: (sequence index, calls).
pub type DueCalls = Vec<(usize, Vec<Result<ToolCall, String>>)>;

impl InFlight {
    /// A sequence not started yet (with tools: an episode with no turn yet).
    pub fn new(prompt: Vec<u32>, key: u64, tools: bool) -> InFlight {
        InFlight {
            prompt,
            key,
            tokens: vec![],
            logprobs: vec![],
            versions: vec![],
            finish: None,
            text: String::new(),
            trajectory: tools.then(Trajectory::default),
            limit: None,
        }
    }

    /// The most response tokens it may have: `limit` (the rule's response limit), or its own
    /// when lower.
    fn room(&self, limit: usize) -> usize {
        self.limit.map_or(limit, |l| l.min(limit))
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

    /// Where its current turn starts in `tokens`: after the last observation token.
    pub fn turn_start(&self) -> usize {
        let mask = self.trajectory.as_ref().map_or(&[][..], |t| &t.mask[..]);
        mask.iter().rposition(|&m| m == 0).map_or(0, |i| i + 1)
    }

    /// Appends one drawn token (sampled by `version`).
    fn push(&mut self, token: u32, logprob: f32, version: u64) {
        self.tokens.push(token);
        self.logprobs.push(logprob);
        self.versions.push(version);
        if let Some(t) = &mut self.trajectory {
            t.mask.push(1);
        }
    }

    /// Its current turn ended for `reason` with `text`: the calls it makes (recorded with the
    /// turn), or else the sequence is finished.
    fn end_turn(
        &mut self,
        reason: FinishReason,
        text: String,
        rule: &StopRule,
    ) -> Option<Vec<Result<ToolCall, String>>> {
        let response = self.tokens.len();
        if let (Some(l), Some(t), FinishReason::Stop) = (rule.turns, &mut self.trajectory, reason) {
            if l.may_call(t, response) {
                let calls = l.calls_in(&text, t.calls.len());
                if !calls.is_empty() {
                    t.turns.push(text);
                    return Some(calls);
                }
            }
        }
        if let Some(t) = &mut self.trajectory {
            t.turns.push(text.clone());
        }
        self.finish = Some(reason);
        self.text = text;
        None
    }

    /// Appends the observation `ids` of its calls' `records` (tokens of `version`, mask 0,
    /// log-prob 0), cut to the room `limit` response tokens leave; with no room left after it
    /// the sequence is finished by length (its last turn empty, as the engine ends one).
    fn observe(
        &mut self,
        ids: &[u32],
        records: Vec<super::CallRecord>,
        limit: usize,
        version: u64,
    ) {
        let room = limit.saturating_sub(self.tokens.len());
        let take = ids.len().min(room);
        self.tokens.extend_from_slice(&ids[..take]);
        self.logprobs.extend(std::iter::repeat_n(0.0, take));
        self.versions.extend(std::iter::repeat_n(version, take));
        let t = self.trajectory.as_mut().expect("an episode with calls");
        t.mask.extend(std::iter::repeat_n(0, take));
        t.calls.extend(records);
        if take == room {
            self.finish = Some(FinishReason::Length);
            self.text.clear();
        }
    }
}

/// Runs one round on `model` (the weights of policy `version`): every unfinished sequence of
/// `seqs` gets up to `round_tokens` new tokens, never more than the limits allow; turns that
/// end under `rule` run their calls on `agent`, those that end the sequence mark it finished.
/// Returns the engine's counters.
pub fn round(
    model: &mut dyn PagedModel,
    cfg: &PagedConfig,
    seqs: &mut [InFlight],
    (rule, agent): (&StopRule, Option<&Agent>),
    round_tokens: usize,
    version: u64,
) -> Result<PagedStats> {
    let (live, requests, this_round) = round_requests(seqs, rule, round_tokens)?;
    let (done, stats) =
        generate_paged(model, cfg, &requests, &this_round, rule.detok, &mut |_| {})?;
    let done: Vec<Completion> = done
        .into_iter()
        .map(|mut s| s.pop().expect("one sample per request"))
        .collect();
    let due = absorb(seqs, &live, done, rule, version)?;
    if let Some(agent) = agent {
        answer_calls(seqs, due, agent, version)?;
    }
    Ok(stats)
}

/// The most response tokens a sequence may have under `rule`.
fn response_limit(rule: &StopRule) -> usize {
    rule.turns
        .map_or(rule.params.max_new_tokens, |l| l.max_response_tokens)
}

/// What a round generates: the unfinished sequences of `seqs` (their indices), a request for
/// each (prompt and response so far, the round's key, one sample), and the round's parameters
/// (at most `round_tokens` new tokens). The engine that runs them may be any (`round` above,
/// or a rollout stage's own generation on its ranks).
pub fn round_requests(
    seqs: &[InFlight],
    rule: &StopRule,
    round_tokens: usize,
) -> Result<(Vec<usize>, Vec<Request>, GenParams)> {
    ensure!(round_tokens > 0, "a round needs at least one new token");
    ensure!(
        rule.params.stop_strings.is_empty() || rule.detok.is_some(),
        "stop strings need a detokenizer"
    );
    let limit = response_limit(rule);
    let live: Vec<usize> = (0..seqs.len())
        .filter(|&i| seqs[i].finish.is_none() && seqs[i].tokens.len() < seqs[i].room(limit))
        .collect();
    let this_round = GenParams {
        max_new_tokens: round_tokens.min(rule.params.max_new_tokens),
        ..rule.params.clone()
    };
    let requests: Vec<Request> = live
        .iter()
        .map(|&i| {
            let s = &seqs[i];
            // What is left of its own limit, where that ends it in this round.
            let left = s.limit.map(|l| l - s.tokens.len());
            Request {
                prompt: [&s.prompt[..], &s.tokens[..]].concat(),
                sample_keys: vec![s.round_key()],
                max_new: left
                    .filter(|&l| l < this_round.max_new_tokens)
                    .into_iter()
                    .collect(),
            }
        })
        .collect();
    Ok((live, requests, this_round))
}

/// Adds a round's completions (`done`, one per index of `live`, sampled by policy `version`)
/// to their sequences token by token, until a turn ends under `rule` (the tokens drawn past
/// its end are dropped): a sequence whose turn ends without calls is finished. Returns the
/// turns' calls to run (`answer_calls`).
pub fn absorb(
    seqs: &mut [InFlight],
    live: &[usize],
    done: Vec<Completion>,
    rule: &StopRule,
    version: u64,
) -> Result<DueCalls> {
    let mut due = Vec::new();
    for (&i, c) in live.iter().zip(done) {
        let s = &mut seqs[i];
        let start = s.turn_start();
        for (&t, &lp) in c.tokens.iter().zip(&c.logprobs) {
            s.push(t, lp, version);
            let over = s.tokens.len() >= s.room(usize::MAX);
            let Some((reason, text)) = turn_end(&s.tokens[start..], s.tokens.len(), rule)?
                .or(over.then_some((FinishReason::Length, None)))
            else {
                continue;
            };
            let text = match (text, rule.detok) {
                (Some(t), _) => t,
                (None, Some(d)) => d(&s.tokens[start..])?,
                (None, None) => String::new(),
            };
            if let Some(calls) = s.end_turn(reason, text, rule) {
                due.push((i, calls));
            }
            break;
        }
    }
    Ok(due)
}

/// Runs the `due` calls of the sequences' turns on `agent`'s tools (its runner: at most
/// `concurrency` at once, each given up after `timeout`; `agent.kwargs` per sequence index)
/// and appends each turn's observation (`agent.observe`) as tokens of `version`. Returns the
/// calls answered and how many of them failed.
pub fn answer_calls(
    seqs: &mut [InFlight],
    due: DueCalls,
    agent: &Agent,
    version: u64,
) -> Result<(usize, usize)> {
    let (mut calls, mut errors) = (0, 0);
    let mut runner = ToolRunner::new(agent);
    for (i, calls) in due {
        let turn = seqs[i].trajectory.as_ref().map_or(0, |t| t.turns.len() - 1);
        runner.submit((i, i, turn, calls));
    }
    loop {
        let busy = runner.busy();
        for (i, records) in runner.poll(busy) {
            let s = &mut seqs[i];
            let contents: Vec<String> = records.iter().map(|r| r.result.clone()).collect();
            calls += records.len();
            errors += records.iter().filter(|r| r.error.is_some()).count();
            let ids = (agent.observe)(&s.tokens[s.turn_start()..], &contents)?;
            let room = s.room(agent.limits.max_response_tokens);
            s.observe(&ids, records, room, version);
        }
        if !busy {
            return Ok((calls, errors));
        }
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
        let rule = StopRule {
            params,
            detok: None,
            turns: None,
        };
        self.round_with(next, &mut |seqs| {
            round(model, cfg, seqs, (&rule, None), round_tokens, version)
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
    use super::super::{PagedDecoder, TurnLimits};
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::ops::sample::{sample, uniform, SamplingParams, Scratch};
    use crate::model::decoder::{Decoder, SeqRef};
    use crate::model::init::random_weights;

    /// The stop rule of `p` alone (no detokenizer, no tools).
    fn plain(p: &GenParams) -> StopRule<'_> {
        StopRule {
            params: p,
            detok: None,
            turns: None,
        }
    }

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
            .map(|i| InFlight::new(vec![i + 1, 2 * i + 3, 5], 100 + i as u64, false))
            .collect();
        let mut version = 1;
        while seqs.iter().any(|s| s.finish.is_none()) {
            let mut toy = PagedToy::new(vocab, &cfg()).with_salt(version as u32);
            let before = seqs.clone();
            round(&mut toy, &cfg(), &mut seqs, (&plain(&p), None), 3, version).unwrap();
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
            .map(|i| InFlight::new(vec![i % 4 + 2, 3], 7 * i as u64, false))
            .collect();
        let mut toy = PagedToy::new(vocab, &cfg());
        for v in 0..3 {
            round(&mut toy, &cfg(), &mut seqs, (&plain(&p), None), 2, v).unwrap();
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
        round(&mut toy, &cfg(), &mut seqs, (&plain(&p), None), 2, 9).unwrap();
        assert_eq!(before, seqs);
        let e = round(&mut toy, &cfg(), &mut seqs, (&plain(&p), None), 0, 9).unwrap_err();
        assert!(e.to_string().contains("at least one new token"), "{e}");
    }

    /// Token t is the letter 'a' + t.
    fn letters(ids: &[u32]) -> Result<String> {
        Ok(ids.iter().map(|&t| char::from(b'a' + t as u8)).collect())
    }

    /// Rounds of `round_tokens` up to 12 tokens with the stop rule `rule`, under versions 0, 1,
    /// 2, ... until every sequence ends.
    fn rounds_of(seqs: &mut [InFlight], rule: &StopRule, round_tokens: usize) {
        let mut v = 0;
        while seqs.iter().any(|s| s.finish.is_none()) {
            let mut toy = PagedToy::new(6, &cfg()).with_salt(v);
            round(&mut toy, &cfg(), seqs, (rule, None), round_tokens, v as u64).unwrap();
            v += 1;
        }
    }

    /// A sequence's own length limit across rounds: rounds of 1, 3 and 5 tokens end each one at
    /// its limit (by length) or earlier at a stop id, with the tokens the same rounds draw
    /// without limits, cut there; a round never generates past a limit (its requests carry
    /// what is left of it).
    #[test]
    fn own_length_limits_end_sequences_across_rounds() {
        let p = params(12, vec![4]);
        let rule = StopRule {
            params: &p,
            detok: None,
            turns: None,
        };
        let fresh = |limits: bool| -> Vec<InFlight> {
            (0..30u32)
                .map(|i| InFlight {
                    limit: limits.then_some(1 + (i as usize * 7) % 12),
                    ..InFlight::new(vec![i % 5 + 1, 2], 13 * i as u64 + 1, false)
                })
                .collect()
        };
        let mut cut_short = 0;
        for round_tokens in [1, 3, 5] {
            let (mut own, mut free) = (fresh(true), fresh(false));
            rounds_of(&mut own, &rule, round_tokens);
            rounds_of(&mut free, &rule, round_tokens);
            for (o, f) in own.iter().zip(&free) {
                let limit = o.limit.unwrap();
                let n = f.tokens.len().min(limit);
                assert_eq!(o.tokens, f.tokens[..n], "{o:?}");
                let why = match f.tokens.len() <= limit {
                    true => f.finish,
                    false => Some(FinishReason::Length),
                };
                assert_eq!(o.finish, why, "{o:?}");
                cut_short += usize::from(f.tokens.len() > limit);
            }
            // What is left of a limit is each request's own cap in the round.
            let seqs = fresh(true);
            let (live, reqs, this) = round_requests(&seqs, &rule, round_tokens).unwrap();
            for (&i, r) in live.iter().zip(&reqs) {
                let want = seqs[i].limit.filter(|&l| l < this.max_new_tokens);
                assert_eq!(r.max_new, want.into_iter().collect::<Vec<_>>());
            }
        }
        assert!(cut_short >= 20, "{cut_short} sequences cut by their limit");
    }

    /// Stop strings across rounds: rounds of 1 and 2 tokens (so a stop string of 2 or 3
    /// letters is begun in one round and completed in a later one) end each sequence at the
    /// token that completes its first stop string, with the text cut before it: the same
    /// rounds without stop strings draw the same tokens, and cut there they are the sequences
    /// with them. One round of the whole length is the engine's own generation with the stop
    /// strings.
    #[test]
    fn stop_strings_that_straddle_rounds_end_sequences() {
        let stops = vec!["ca".to_string(), "fff".to_string()];
        let with = GenParams {
            stop_strings: stops.clone(),
            ..params(12, vec![])
        };
        let without = params(12, vec![]);
        let rule = |p| StopRule {
            params: p,
            detok: Some(&letters),
            turns: None,
        };
        let fresh = || -> Vec<InFlight> {
            (0..40u32)
                .map(|i| InFlight::new(vec![i % 5 + 1, 2], 11 * i as u64 + 3, false))
                .collect()
        };
        let mut straddled = 0;
        for round_tokens in [1, 2] {
            let (mut cut, mut whole) = (fresh(), fresh());
            rounds_of(&mut cut, &rule(&with), round_tokens);
            rounds_of(&mut whole, &rule(&without), round_tokens);
            for (c, w) in cut.iter().zip(&whole) {
                let text = letters(&w.tokens).unwrap();
                let first = stops
                    .iter()
                    .filter_map(|s| text.find(s.as_str()).map(|at| (at, at + s.len())))
                    .min_by_key(|&(_, end)| end);
                match first {
                    Some((at, end)) => {
                        assert_eq!(c.tokens, w.tokens[..end], "{c:?}");
                        assert_eq!(c.finish, Some(FinishReason::Stop));
                        assert_eq!(c.text, text[..at]);
                        assert_eq!(c.versions, w.versions[..end]);
                        // The string's first letter came in an earlier round than its last.
                        straddled += usize::from(c.versions[at] < c.versions[end - 1]);
                    }
                    None => {
                        assert_eq!(c, w);
                        assert_eq!(c.finish, Some(FinishReason::Length));
                    }
                }
            }
        }
        assert!(straddled > 10, "{straddled} stop strings straddled rounds");
        // One round of the whole length: the engine's generation with the stop strings.
        let mut one = fresh();
        rounds_of(&mut one, &rule(&with), 12);
        let requests: Vec<Request> = fresh()
            .iter()
            .map(|s| Request {
                max_new: Vec::new(),
                prompt: s.prompt.clone(),
                sample_keys: vec![s.key],
            })
            .collect();
        let mut toy = PagedToy::new(6, &cfg()).with_salt(0);
        let (done, _) = generate_paged(
            &mut toy,
            &cfg(),
            &requests,
            &with,
            Some(&letters),
            &mut |_| {},
        )
        .unwrap();
        for (s, d) in one.iter().zip(done) {
            assert_eq!(s.tokens, d[0].tokens);
            assert_eq!(s.text, d[0].text);
            assert_eq!(Some(d[0].finish), s.finish);
        }
    }

    /// Bytes are ids 0..256; 256 ends a turn and decodes to nothing.
    fn bytes_text(ids: &[u32]) -> Result<String> {
        let b: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    /// `add` answers a + b.
    struct Add;

    impl crate::tool::Tools for Add {
        fn schemas(&self) -> Vec<serde_json::Value> {
            vec![]
        }
        fn call(&self, call: &ToolCall, _: &serde_json::Value) -> crate::tool::ToolResult {
            let arg = |k: &str| call.arguments[k].as_i64().unwrap_or(0);
            crate::tool::ToolResult {
                content: (arg("a") + arg("b")).to_string(),
                seconds: 0.0,
                error: None,
            }
        }
    }

    /// The observation of results `r`: "[r1|r2]" in bytes.
    fn observe(_: &[u32], r: &[String]) -> Result<Vec<u32>> {
        Ok(bytes(&format!("[{}]", r.join("|"))))
    }

    /// An episode fed in rounds of 5 tokens (what an engine drew, past a turn's end too): the
    /// turn that ends (at token 256) with a call has it run at the end of its round and its
    /// observation appended (mask 0, log-prob 0, the round's version); the tokens drawn past
    /// the turn's end are dropped; the next turn starts in the next round; a turn without a
    /// call, or the last turn max-turns allows, ends the episode (its calls not run); and an
    /// observation with no room left under max-response-tokens is cut and ends it by length.
    #[test]
    fn episodes_run_their_calls_between_rounds() {
        let call = |a: i32| {
            let mut t = bytes(&format!(
                r#"<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": 1}}}}</tool_call>"#
            ));
            t.push(256);
            t
        };
        let p = params(100, vec![256]);
        let lim = |max_turns, max_response_tokens| TurnLimits {
            max_turns,
            max_tool_calls: 4,
            max_parallel_calls: 4,
            max_response_tokens,
            format: crate::tool::ToolFormat::Hermes,
        };
        // Turns to draw, in order; each round draws 5 more tokens of what is left (and junk
        // past a turn's end).
        let run = |turns: Vec<Vec<u32>>, limits: TurnLimits| -> (InFlight, Vec<u64>) {
            let agent = Agent {
                tools: std::sync::Arc::new(Add),
                limits,
                concurrency: 2,
                timeout: std::time::Duration::from_secs(5),
                observe: &observe,
                cut: None,
                kwargs: vec![],
            };
            let rule = StopRule {
                params: &p,
                detok: Some(&bytes_text),
                turns: Some(limits),
            };
            let mut seqs = vec![InFlight::new(vec![1, 2], 7, true)];
            let mut script: Vec<u32> = turns.concat();
            let (mut version, mut rounds) = (0, vec![]);
            while seqs[0].finish.is_none() {
                let (live, _, _) = round_requests(&seqs, &rule, 5).unwrap();
                let mut drawn: Vec<u32> = script.iter().take(5).copied().collect();
                drawn.resize(5, 65);
                let before = seqs[0].tokens.len();
                let c = Completion {
                    logprobs: vec![-0.5; 5],
                    tokens: drawn,
                    finish: FinishReason::Length,
                    text: String::new(),
                    trajectory: None,
                };
                let due = absorb(&mut seqs, &live, vec![c], &rule, version).unwrap();
                let sampled = seqs[0].trajectory.as_ref().unwrap().mask[before..]
                    .iter()
                    .filter(|&&m| m == 1)
                    .count();
                script.drain(..sampled.min(script.len()));
                let n = due.iter().map(|(_, c)| c.len()).sum::<usize>();
                assert_eq!(
                    answer_calls(&mut seqs, due, &agent, version).unwrap(),
                    (n, 0)
                );
                rounds.push(version);
                version += 1;
            }
            (seqs.pop().unwrap(), rounds)
        };
        let (c1, c2) = (call(2), call(40));
        let last = bytes("it is 3");
        // Two calls, then an answer.
        let (s, rounds) = run(
            vec![c1.clone(), c2.clone(), [&last[..], &[256]].concat()],
            lim(3, 200),
        );
        let t = s.trajectory.clone().unwrap();
        let (o1, o2) = (bytes("[3]"), bytes("[41]"));
        let want = [&c1[..], &o1, &c2, &o2, &last, &[256]].concat();
        assert_eq!(s.tokens, want);
        let mask: Vec<u8> = [
            (c1.len(), 1),
            (o1.len(), 0),
            (c2.len(), 1),
            (o2.len(), 0),
            (last.len() + 1, 1),
        ]
        .iter()
        .flat_map(|&(n, m)| std::iter::repeat_n(m, n))
        .collect();
        assert_eq!(t.mask, mask);
        for (j, (&m, &lp)) in t.mask.iter().zip(&s.logprobs).enumerate() {
            assert_eq!(lp, if m == 0 { 0.0 } else { -0.5 }, "token {j}");
        }
        let results: Vec<&str> = t.calls.iter().map(|c| c.result.as_str()).collect();
        assert_eq!(results, ["3", "41"]);
        assert_eq!(t.turns.len(), 3);
        assert_eq!(t.turns[2], "it is 3");
        assert_eq!(
            (s.finish, s.text.as_str()),
            (Some(FinishReason::Stop), "it is 3")
        );
        // A turn ends in the round of its 256; its observation carries that round's version
        // and the next turn starts in the next round.
        let end1 = c1.len() - 1;
        let round1 = end1 / 5;
        assert!(s.versions[..=end1].iter().all(|&v| v <= round1 as u64));
        assert!(s.versions[end1 + 1..end1 + 1 + o1.len()]
            .iter()
            .all(|&v| v == round1 as u64));
        assert_eq!(s.versions[end1 + 1 + o1.len()], round1 as u64 + 1);
        assert!(rounds.len() > 4, "the episode spans rounds");
        // max-turns = 2: the second turn's call is not run; the episode ends with it.
        let (s, _) = run(vec![c1.clone(), c2.clone(), last.clone()], lim(2, 200));
        let t = s.trajectory.unwrap();
        assert_eq!(t.calls.len(), 1);
        assert_eq!(s.tokens, [&c1[..], &o1, &c2].concat());
        assert_eq!(s.finish, Some(FinishReason::Stop));
        // No room for the whole observation: it is cut and the episode ends by length.
        let room = c1.len() + 2;
        let (s, _) = run(vec![c1.clone(), last.clone()], lim(3, room));
        assert_eq!(s.tokens, [&c1[..], &o1[..2]].concat());
        assert_eq!(
            (s.finish, s.text.as_str()),
            (Some(FinishReason::Length), "")
        );
        assert_eq!(s.trajectory.unwrap().mask[c1.len()..], [0, 0]);
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
            .map(|(i, prompt)| InFlight::new(prompt, 40 + i as u64, false))
            .collect();
        for (v, w) in weights.iter().enumerate() {
            let mut dec = Decoder::new(Cpu, &cfg, w).unwrap();
            let mut paged = PagedDecoder::new(&mut dec, pc.num_blocks, pc.block_size).unwrap();
            round(
                &mut paged,
                &pc,
                &mut seqs,
                (&plain(&p), None),
                4,
                v as u64 + 1,
            )
            .unwrap();
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
                    .map(|j| InFlight::new(vec![id as u32 % 7 + 1, 2], id * 10 + j, false))
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
            seqs: (0..6).map(|j| InFlight::new(vec![1], j, false)).collect(),
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
