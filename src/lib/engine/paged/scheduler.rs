//! Continuous batching over the paged KV cache: which sequences run in the next step, and how
//! many of their tokens.
//!
//! Every step the scheduler gives each running sequence (oldest first) the tokens it still has
//! to run, within `max_batched_tokens`: one token for a decoding sequence, a chunk of its prompt
//! for a prefilling one (chunked prefill, so a long prompt does not stall the decodes). It then
//! admits waiting work while seats (`max_num_seqs`) and blocks are free: first sequences that
//! were preempted, then prompts in input order. A prompt runs once as a "prompt sequence" that
//! holds the seats of its samples; when its last chunk has run, every sample draws its first
//! token from the prompt's last logits and the prompt's blocks are shared: the full blocks by
//! reference, the partial last block copied once per extra sample (`postprocess`, which also
//! appends the drawn tokens and releases the blocks of finished samples).
//!
//! When a decoding sequence needs a new block and none is free, the newest running sequences
//! are preempted (their blocks released, their tokens kept) and recomputed later by a prefill of
//! prompt + generated tokens. The random draws are counter-based (key, position), so a
//! recomputed sample continues exactly as it would have. The oldest sequence can always take
//! the blocks of every newer one, and one sequence alone always fits (checked up front by
//! `GenParams::check`), so the loop never deadlocks.
//!
//! With tools, a sample whose turn ends in tool calls is parked (out of `running`, seat free,
//! blocks kept) while they run; back with its observation appended it is admitted before
//! anything else, feeding the observation as an extension of its blocks. When nothing can run
//! and no call is out, the newest such sample gives its blocks up (`evict_resumed`), so the
//! guarantee above holds for trajectories too (the pool is checked for a whole one).

use anyhow::{anyhow, bail, ensure, Result};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use super::blocks::BlockPool;
use super::request::{Completion, FinishReason, Request, StopRule};
use super::sequence::{Kind, Seq};
use super::turns::{CallRecord, Calls, Observe};
use super::{Chunk, PagedConfig, PagedStats, SampleRow};
use crate::backend::ops::sample::Sampled;
use crate::tool::ToolCall;

/// The waiting and running sequences and the block pool they share.
pub(super) struct Scheduler<'r> {
    cfg: PagedConfig,
    requests: &'r [Request],
    pool: BlockPool,
    /// Admitted sequences, in the order their steps list them.
    running: Vec<Seq>,
    /// Samples of prompts not yet admitted: (request, sample range), in input order.
    waiting: VecDeque<(usize, Range<usize>)>,
    /// Preempted samples, oldest first (admitted before any waiting prompt).
    preempted: VecDeque<Seq>,
    admitted: u64,
    /// Samples whose tools run (out of the batch, holding their blocks), by parked id.
    parked: HashMap<usize, Seq>,
    next_park: usize,
    /// Samples back from their tools with the observation appended, waiting for a seat
    /// (admitted before anything else: their history is in the cache).
    resumed: VecDeque<Seq>,
    /// Calls of the samples parked since the engine last took them.
    pub(super) outbox: Vec<Calls>,
}

/// A step handed to the model whose draws are not applied yet; its vectors are aligned with
/// `running` as it was when the step was built.
pub(super) struct Flight {
    /// Tokens fed per sequence.
    want: Vec<usize>,
    /// Per sequence, the rows it drew.
    drawn_rows: Vec<Option<Range<usize>>>,
    rows: usize,
    /// Every fed sequence is a sample feeding one token and drawing one.
    pure_decode: bool,
}

impl Flight {
    /// The flight for the sequences `keep` says stay in `running`.
    pub(super) fn retain(self, keep: &[bool]) -> Flight {
        fn pick<T>(v: Vec<T>, keep: &[bool]) -> Vec<T> {
            v.into_iter()
                .zip(keep)
                .filter(|(_, &k)| k)
                .map(|(x, _)| x)
                .collect()
        }
        Flight {
            want: pick(self.want, keep),
            drawn_rows: pick(self.drawn_rows, keep),
            ..self
        }
    }
}

/// What applying a step's draws leaves to the engine: per running entry (aligned with the
/// flight) whether it stays running, and the block copies of the forks (`(src, dst)`, for the
/// model to make before the next step).
pub(super) struct Applied {
    pub(super) keep: Vec<bool>,
    pub(super) copies: Vec<(u32, u32)>,
}

/// One step's model inputs (they borrow the running sequences' tokens and tables): chunk c
/// takes its one token from row `feed[c]` of the step before's draws where that is given.
pub(super) struct Batch<'s> {
    pub(super) chunks: Vec<Chunk<'s>>,
    pub(super) feed: Vec<Option<u32>>,
    pub(super) rows: Vec<SampleRow>,
}

impl<'r> Scheduler<'r> {
    /// Every sample of every request waiting, none running.
    pub(super) fn new(cfg: &PagedConfig, requests: &'r [Request]) -> Self {
        Scheduler {
            cfg: *cfg,
            requests,
            pool: BlockPool::new(cfg.num_blocks, cfg.block_size),
            running: Vec::new(),
            waiting: requests
                .iter()
                .enumerate()
                .filter(|(_, r)| !r.sample_keys.is_empty())
                .map(|(i, r)| (i, 0..r.sample_keys.len()))
                .collect(),
            preempted: VecDeque::new(),
            admitted: 0,
            parked: HashMap::new(),
            next_park: 0,
            resumed: VecDeque::new(),
            outbox: Vec::new(),
        }
    }

    /// Drops every waiting sample (they are finished without running).
    pub(super) fn clear_waiting(&mut self) {
        self.waiting.clear();
    }

    /// Blocks held by the running sequences.
    pub(super) fn blocks_in_use(&self) -> usize {
        self.pool.in_use()
    }

    /// Nothing runs and nothing waits (for a seat or for its tools).
    pub(super) fn is_done(&self) -> bool {
        self.running.is_empty()
            && self.waiting.is_empty()
            && self.preempted.is_empty()
            && self.parked.is_empty()
            && self.resumed.is_empty()
    }

    /// Decides the next step: the tokens each running sequence feeds (aligned with `running`,
    /// which may shrink by preemption and grow by admission).
    pub(super) fn schedule(&mut self, stats: &mut PagedStats) -> Vec<usize> {
        let mut want: Vec<usize> = Vec::with_capacity(self.running.len());
        let budget = self.schedule_running(&mut want, stats);
        self.admit(&mut want, budget);
        debug_assert_eq!(want.len(), self.running.len());
        stats.peak_blocks_in_use = stats.peak_blocks_in_use.max(self.pool.in_use());
        want
    }

    /// The running sequences first, oldest first: each gets the tokens it still has to run
    /// within the budget, and the blocks for them, preempting the newest when none are free.
    /// Returns the budget left.
    fn schedule_running(&mut self, want: &mut Vec<usize>, stats: &mut PagedStats) -> usize {
        let mut budget = self.cfg.max_batched_tokens;
        let mut i = 0;
        while i < self.running.len() {
            let n = self.running[i].pending().min(budget);
            if n == 0 {
                want.push(0);
                i += 1;
                continue;
            }
            let s = &self.running[i];
            let need = self
                .pool
                .blocks_for(s.computed + n)
                .saturating_sub(s.blocks.len());
            if let Some(b) = self.pool.alloc(need) {
                self.running[i].blocks.extend(b);
                want.push(n);
                budget -= n;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest sequence not yet scheduled (maybe this one).
            let victim = (i..self.running.len())
                .max_by_key(|&j| self.running[j].order)
                .expect("i is in range");
            let v = self.running.remove(victim);
            stats.preemptions += 1;
            self.preempt(v);
        }
        budget
    }

    /// Admits waiting work while seats, `budget` and blocks allow: preempted sequences, then
    /// prompts in order.
    fn admit(&mut self, want: &mut Vec<usize>, mut budget: usize) {
        let mut seats: usize = self.running.iter().map(Seq::seats).sum();
        while budget > 0 && seats < self.cfg.max_num_seqs {
            let admitted = if !self.resumed.is_empty() {
                self.admit_resumed(budget)
            } else if !self.preempted.is_empty() {
                self.admit_preempted(budget)
            } else {
                self.admit_prompt(budget, seats)
            };
            let Some((n, taken)) = admitted else {
                break;
            };
            budget -= n;
            seats += taken;
            want.push(n);
        }
    }

    /// The oldest preempted sequence, if its blocks are free: (tokens it feeds, seats it takes).
    fn admit_preempted(&mut self, budget: usize) -> Option<(usize, usize)> {
        let s = self.preempted.front()?;
        let b = self.pool.alloc(self.pool.blocks_for(s.tokens.len()))?;
        let mut s = self.preempted.pop_front().expect("front");
        s.blocks = b;
        let n = s.pending().min(budget);
        self.running.push(s);
        Some((n, 1))
    }

    /// The oldest sample back from its tools, if the blocks for its next chunk are free (its
    /// history stays in its blocks: the observation is prefilled as their extension).
    fn admit_resumed(&mut self, budget: usize) -> Option<(usize, usize)> {
        let s = self.resumed.front()?;
        let n = s.pending().min(budget);
        let need = self
            .pool
            .blocks_for(s.computed + n)
            .saturating_sub(s.blocks.len());
        let b = self.pool.alloc(need)?;
        let mut s = self.resumed.pop_front().expect("front");
        s.blocks.extend(b);
        self.running.push(s);
        Some((n, 1))
    }

    /// When nothing can run: the newest sample back from its tools gives its blocks up and is
    /// recomputed later (as a preempted one). Returns whether there was one.
    pub(super) fn evict_resumed(&mut self, stats: &mut PagedStats) -> bool {
        let Some(at) = (0..self.resumed.len()).max_by_key(|&i| self.resumed[i].order) else {
            return false;
        };
        let s = self.resumed.remove(at).expect("in range");
        stats.preemptions += 1;
        self.preempt(s);
        true
    }

    /// The first waiting prompt with as many of its samples as fit `seats` taken and the free
    /// blocks: (tokens it feeds, seats it takes).
    fn admit_prompt(&mut self, budget: usize, seats: usize) -> Option<(usize, usize)> {
        let (req, range) = self.waiting.front().cloned()?;
        let prompt = &self.requests[req].prompt;
        let pb = self.pool.blocks_for(prompt.len());
        let partial = usize::from(!prompt.len().is_multiple_of(self.cfg.block_size));
        let mut take = range.len().min(self.cfg.max_num_seqs - seats);
        while take > 0 && pb + (take - 1) * partial > self.pool.num_free() {
            take -= 1;
        }
        // Part of a prompt's samples only when nothing else runs (n > seats, or a pool too
        // small for all): otherwise wait for the seats, since each part is prefilled again.
        if take == 0 || (take < range.len() && !self.running.is_empty()) {
            return None;
        }
        let blocks = self.pool.alloc(pb).expect("checked free blocks");
        let spare = self
            .pool
            .alloc((take - 1) * partial)
            .expect("checked free blocks");
        let samples = range.start..range.start + take;
        if take == range.len() {
            self.waiting.pop_front();
        } else {
            self.waiting.front_mut().expect("front").1.start = samples.end;
        }
        let n = prompt.len().min(budget);
        self.running.push(Seq {
            req,
            kind: Kind::Prompt { samples, spare },
            tokens: prompt.clone(),
            prompt_len: prompt.len(),
            computed: 0,
            blocks,
            logprobs: vec![],
            order: (self.admitted, 0),
            zombie: false,
            turn_start: prompt.len(),
            traj: None,
            calls_due: None,
            limit: usize::MAX,
        });
        self.admitted += 1;
        Some((n, take))
    }

    /// Why a schedule that runs nothing while work waits cannot go on.
    pub(super) fn stalled(&self) -> anyhow::Error {
        anyhow!(
            "paged scheduler: no progress possible ({} running, {} waiting prompts, {} preempted, {} of {} blocks free)",
            self.running.len(),
            self.waiting.len(),
            self.preempted.len(),
            self.pool.num_free(),
            self.pool.num_blocks()
        )
    }

    /// The chunks and sample rows of the step `want` decided: each sequence feeds its next
    /// `want` tokens, and draws when they reach its last token (every sample of a prompt from
    /// the prompt's last logits).
    pub(super) fn batch(&self, want: Vec<usize>, stats: &mut PagedStats) -> (Batch<'_>, Flight) {
        let mut chunks = Vec::new();
        let mut rows = Vec::new();
        // Per running sequence: the range of its sampled rows, if it samples this step.
        let mut drawn_rows: Vec<Option<Range<usize>>> = vec![None; self.running.len()];
        for (idx, (s, &n)) in self.running.iter().zip(&want).enumerate() {
            if n == 0 {
                continue;
            }
            let c = chunks.len();
            chunks.push(Chunk {
                tokens: &s.tokens[s.computed..s.computed + n],
                start: s.computed,
                table: &s.blocks,
            });
            if s.prefix_is_prompt_or_resume() {
                stats.gen.prefill_tokens += n;
            }
            if s.computed + n < s.tokens.len() {
                continue;
            }
            let keys = &self.requests[s.req].sample_keys;
            let first = rows.len();
            match &s.kind {
                Kind::Prompt { samples, .. } => {
                    for j in samples.clone() {
                        rows.push(SampleRow {
                            chunk: c,
                            key: keys[j],
                            position: 0,
                        });
                    }
                }
                Kind::Sample { sample, .. } => rows.push(SampleRow {
                    chunk: c,
                    key: keys[*sample],
                    position: (s.tokens.len() - s.prompt_len) as u64,
                }),
            }
            drawn_rows[idx] = Some(first..rows.len());
        }
        // A decode step: every fed sequence is a sample feeding its last token and drawing one.
        let pure_decode = self
            .running
            .iter()
            .zip(&want)
            .zip(&drawn_rows)
            .all(|((s, &n), r)| {
                n == 0 || (n == 1 && matches!(s.kind, Kind::Sample { .. }) && r.is_some())
            });
        let flight = Flight {
            want,
            drawn_rows,
            rows: rows.len(),
            pure_decode,
        };
        let feed = vec![None; chunks.len()];
        (Batch { chunks, feed, rows }, flight)
    }

    /// The next decode step queued behind flight `f` (overlap scheduling): every live sample
    /// of `f` feeds the token `f` draws for it and draws the next, as the scheduler would
    /// decide once `f`'s draws are back unless one of them ends the sample (then the step
    /// computes a token nobody reads). Only when nothing else would change: `f` is a decode
    /// step of every live sequence, the first waiting work could not be admitted into the seats
    /// free now, and the pool has the blocks. Work a finishing sample makes room for is
    /// admitted one step later.
    pub(super) fn lookahead(&mut self, f: &Flight, rule: &StopRule) -> Option<Flight> {
        if !f.pure_decode {
            return None;
        }
        // Seats the first waiting work needs before the scheduler would admit it (a prompt
        // waits for seats for all its samples while others run).
        let needs = if !self.preempted.is_empty() || !self.resumed.is_empty() {
            Some(1)
        } else {
            self.waiting.front().map(|(_, r)| r.len())
        };
        let running = &mut self.running;
        let live = || running.iter().zip(&f.want).filter(|(s, _)| !s.zombie);
        if live().any(|(_, &n)| n != 1) {
            return None;
        }
        let max_seqs = self.cfg.max_num_seqs;
        if needs.is_some_and(|n| n <= max_seqs - live().count().min(max_seqs)) {
            return None;
        }
        // A sample whose draw in `f` is its last by length is over whatever it draws.
        let total = rule.turns.map_or(usize::MAX, |l| l.max_response_tokens);
        let params = rule.params;
        let go: Vec<bool> = running
            .iter()
            .map(|s| {
                !s.zombie
                    && s.tokens.len() + 1 - s.turn_start < params.max_new_tokens
                    && s.tokens.len() + 1 - s.prompt_len < total.min(s.limit)
            })
            .collect();
        // Blocks each needs for the position the queued step feeds (computed + 1).
        let pool = &mut self.pool;
        let need: Vec<usize> = running
            .iter()
            .zip(&go)
            .map(|(s, &g)| {
                if g {
                    pool.blocks_for(s.computed + 2)
                        .saturating_sub(s.blocks.len())
                } else {
                    0
                }
            })
            .collect();
        if need.iter().sum::<usize>() > pool.num_free() || !go.contains(&true) {
            return None;
        }
        let mut want = Vec::with_capacity(running.len());
        let mut drawn_rows = Vec::with_capacity(running.len());
        let mut rows = 0;
        for ((s, &g), &n) in running.iter_mut().zip(&go).zip(&need) {
            if g {
                s.blocks.extend(pool.alloc(n).expect("checked free blocks"));
                drawn_rows.push(Some(rows..rows + 1));
                rows += 1;
            } else {
                drawn_rows.push(None);
            }
            want.push(usize::from(g));
        }
        Some(Flight {
            want,
            drawn_rows,
            rows,
            pure_decode: true,
        })
    }

    /// The chunks and rows of lookahead step `next` (aligned with `running`): the chunk of
    /// sequence i feeds the draw of its row in the step before, `prev` (aligned the same way).
    pub(super) fn lookahead_batch(&self, next: &Flight, prev: &Flight) -> Result<Batch<'_>> {
        let mut chunks = Vec::with_capacity(next.rows);
        let mut feed = Vec::with_capacity(next.rows);
        let mut rows = Vec::with_capacity(next.rows);
        for ((s, &n), p) in self.running.iter().zip(&next.want).zip(&prev.drawn_rows) {
            if n == 0 {
                continue;
            }
            let Kind::Sample { sample, .. } = &s.kind else {
                bail!("paged scheduler: a lookahead step feeds samples only");
            };
            let src = p
                .as_ref()
                .expect("a lookahead sequence drew in the step before");
            rows.push(SampleRow {
                chunk: chunks.len(),
                key: self.requests[s.req].sample_keys[*sample],
                position: (s.tokens.len() + 1 - s.prompt_len) as u64,
            });
            feed.push(Some(src.start as u32));
            chunks.push(Chunk {
                tokens: &FED,
                start: s.computed + 1,
                table: &s.blocks,
            });
        }
        Ok(Batch { chunks, feed, rows })
    }

    /// Applies the draws of flight `f` to the running sequences (nano-vllm's
    /// `Scheduler.postprocess`): tokens appended, prompts forked into their samples, finished
    /// samples handed to `done` as (request, sample, completion) and their blocks released,
    /// unless `queued` (the step handed to the model since, aligned the same way) feeds them:
    /// those become zombies until it is applied. When a step is queued nothing is forked, so
    /// the entries that stay keep their order.
    pub(super) fn postprocess(
        &mut self,
        f: Flight,
        drawn: &[Sampled],
        queued: Option<&Flight>,
        rule: &StopRule,
        stats: &mut PagedStats,
        done: &mut dyn FnMut(usize, usize, Completion),
    ) -> Result<Applied> {
        ensure!(
            drawn.len() == f.rows,
            "paged model drew {} tokens for {} rows",
            drawn.len(),
            f.rows
        );
        let running = std::mem::take(&mut self.running);
        let mut post = Post {
            rule,
            done,
            next: Vec::with_capacity(running.len()),
            copies: Vec::new(),
        };
        let mut keep = Vec::with_capacity(running.len());
        let entries = running.into_iter().zip(f.want).zip(f.drawn_rows);
        for (i, ((mut s, n), rows)) in entries.enumerate() {
            let fed_next = queued.is_some_and(|q| q.want[i] > 0);
            if s.zombie {
                // Its draw was computed for nobody; no later step feeds it. One whose turn
                // ended in tool calls parks now (the step wrote only into its own blocks).
                debug_assert!(!fed_next);
                stats.overlap_discarded += 1;
                match s.calls_due.is_some() {
                    true => {
                        s.zombie = false;
                        self.park(s);
                    }
                    false => self.pool.release(&s.blocks),
                }
                keep.push(false);
                continue;
            }
            s.computed += n;
            let Some(rows) = rows else {
                post.next.push(s);
                keep.push(true);
                continue;
            };
            stats.gen.generated_tokens += rows.len();
            let stays = match &mut s.kind {
                Kind::Prompt { samples, spare } => {
                    // A prompt's last chunk is no decode step: nothing was queued behind it.
                    debug_assert!(!fed_next);
                    stats.gen.prefills += 1;
                    let (samples, spare) = (samples.clone(), std::mem::take(spare));
                    self.fork(&s, samples, spare, &drawn[rows], &mut post)?;
                    false
                }
                Kind::Sample { .. } => self.settle(s, drawn[rows.start], fed_next, &mut post)?,
            };
            keep.push(stays);
        }
        self.running = post.next;
        Ok(Applied {
            keep,
            copies: post.copies,
        })
    }

    /// Forks prompt sequence `p`, whose last chunk just ran, into its `samples`, each taking
    /// its first draw from `drawn`: the first takes the prompt's blocks, every other shares its
    /// full blocks and gets a copy of its partial last block (one of the `spare` blocks).
    fn fork(
        &mut self,
        p: &Seq,
        samples: Range<usize>,
        spare: Vec<u32>,
        drawn: &[Sampled],
        post: &mut Post,
    ) -> Result<()> {
        let full = p.prompt_len / self.pool.block_size();
        let mut spare = spare.into_iter();
        let mut ended = Vec::new();
        for (k, (j, d)) in samples.zip(drawn).enumerate() {
            let blocks = if k == 0 {
                p.blocks.clone()
            } else {
                for &b in &p.blocks[..full] {
                    self.pool.share(b);
                }
                let mut t = p.blocks[..full].to_vec();
                if full < p.blocks.len() {
                    let copy = spare.next().expect("a spare block per extra sample");
                    post.copies.push((p.blocks[full], copy));
                    t.push(copy);
                }
                t
            };
            let limit = self.requests[p.req].sample_limit(j).unwrap_or(usize::MAX);
            let mut c = p.sample((j, k), blocks, post.rule.turns.is_some(), limit);
            match c.accept(*d, post.rule)? {
                Some(reason) => ended.push((c, reason)),
                None => post.next.push(c),
            }
        }
        // Released once every sample holds its shares. The prompt leaves `running` (its
        // samples are new entries), and nothing is queued behind its step.
        for (c, reason) in ended {
            self.conclude(c, reason, false, post)?;
        }
        Ok(())
    }

    /// Appends draw `d` to sample `s`; one that goes on stays running, a finished one is
    /// finished (`finish`). Returns whether it stays.
    fn settle(&mut self, mut s: Seq, d: Sampled, fed_next: bool, post: &mut Post) -> Result<bool> {
        let rule = post.rule;
        match s.accept(d, rule)? {
            Some(reason) => self.conclude(s, reason, fed_next, post),
            None => {
                post.next.push(s);
                Ok(true)
            }
        }
    }

    /// A turn of sample `s` ended for `reason`: it calls tools (then it is parked while they
    /// run; a zombie first, when the queued step feeds it) or the sample is finished. Returns
    /// whether it stays in `running`.
    fn conclude(
        &mut self,
        mut s: Seq,
        reason: FinishReason,
        fed_next: bool,
        post: &mut Post,
    ) -> Result<bool> {
        let Some(calls) = tool_turn(&mut s, reason, post.rule)? else {
            return self.finish(s, reason, fed_next, post);
        };
        s.calls_due = Some(calls);
        if fed_next {
            s.zombie = true;
            post.next.push(s);
            return Ok(true);
        }
        self.park(s);
        Ok(false)
    }

    /// Takes sample `s` out of the batch while its calls run (it keeps its blocks).
    fn park(&mut self, mut s: Seq) {
        let calls = s.calls_due.take().expect("parked with its calls");
        let turn = s.traj.as_ref().map_or(0, |t| t.turns.len() - 1);
        let id = self.next_park;
        self.next_park += 1;
        self.outbox.push((id, s.req, turn, calls));
        self.parked.insert(id, s);
    }

    /// The calls of parked sample `id` answered with `records`: their observation (`observe`)
    /// is appended and the sample waits for a seat to go on, or, when the observation leaves
    /// no room for a sampled token, it is cut to the room and the sample is finished (by
    /// length) into `done`.
    pub(super) fn resume(
        &mut self,
        id: usize,
        records: Vec<CallRecord>,
        observe: Observe,
        rule: &StopRule,
        done: &mut dyn FnMut(usize, usize, Completion),
    ) -> Result<()> {
        let mut s = self
            .parked
            .remove(&id)
            .ok_or_else(|| anyhow!("paged scheduler: no parked sample {id}"))?;
        let contents: Vec<String> = records.iter().map(|r| r.result.clone()).collect();
        let ids = observe(&s.tokens[s.turn_start..], &contents)?;
        s.traj
            .as_mut()
            .ok_or_else(|| anyhow!("paged scheduler: a parked sample without a trajectory"))?
            .calls
            .extend(records);
        let limit = rule.turns.map_or(usize::MAX, |l| l.max_response_tokens);
        let room = limit.saturating_sub(s.tokens.len() - s.prompt_len);
        if ids.len() < room {
            s.observe(&ids);
            self.resumed.push_back(s);
            return Ok(());
        }
        s.observe(&ids[..room]);
        let (req, sample, c) = s.take_completion(FinishReason::Length, rule.detok)?;
        done(req, sample, c);
        self.pool.release(&s.blocks);
        Ok(())
    }

    /// Hands finished sample `s` to `done` and releases its blocks, unless the queued step
    /// feeds it (`fed_next`): then it stays as a zombie until that step is applied. Returns
    /// whether it stays.
    fn finish(
        &mut self,
        mut s: Seq,
        reason: FinishReason,
        fed_next: bool,
        post: &mut Post,
    ) -> Result<bool> {
        let (req, sample, completion) = s.take_completion(reason, post.rule.detok)?;
        (post.done)(req, sample, completion);
        if fed_next {
            s.zombie = true;
            post.next.push(s);
            return Ok(true);
        }
        self.pool.release(&s.blocks);
        Ok(false)
    }

    /// Releases a sequence's blocks and queues it again: a prompt goes back to the front of
    /// the waiting prompts, a sample to the preempted queue (recomputed before new prompts are
    /// admitted).
    fn preempt(&mut self, mut s: Seq) {
        self.pool.release(&s.blocks);
        s.blocks.clear();
        s.computed = 0;
        match s.kind {
            Kind::Prompt { samples, spare } => {
                self.pool.release(&spare);
                self.waiting.push_front((s.req, samples));
            }
            Kind::Sample { .. } => {
                // Keep the preempted queue oldest first.
                let at = self
                    .preempted
                    .iter()
                    .position(|p| p.order > s.order)
                    .unwrap_or(self.preempted.len());
                self.preempted.insert(at, s);
            }
        }
    }
}

/// The calls a turn that ended for `reason` makes, if it goes on to tools: it stopped (not by
/// length), its text holds a call in the limits' format (a `<tool_call>`, or a closed
/// ```` ```python ```` block), and the trajectory is within its limits (the calls past
/// --max-tool-calls are dropped). The turn's text is recorded then.
fn tool_turn(
    s: &mut Seq,
    reason: FinishReason,
    rule: &StopRule,
) -> Result<Option<Vec<Result<ToolCall, String>>>> {
    let (Some(l), FinishReason::Stop) = (rule.turns, reason) else {
        return Ok(None);
    };
    let response = s.tokens.len() - s.prompt_len;
    let Some(t) = s.traj.as_deref() else {
        return Ok(None);
    };
    if !l.may_call(t, response) {
        return Ok(None);
    }
    let text = s.turn_text(rule.detok)?;
    let calls = l.calls_in(&text, t.calls.len());
    if calls.is_empty() {
        return Ok(None);
    }
    s.traj.as_mut().expect("checked").turns.push(text);
    Ok(Some(calls))
}

/// The placeholder token of a chunk whose token the model takes from the previous draws.
const FED: [u32; 1] = [0];

/// One `postprocess` as it is built: the rule and the sink of finished samples, the sequences
/// running after it, the block copies of the forks.
struct Post<'a, 'r> {
    rule: &'a StopRule<'r>,
    done: &'a mut dyn FnMut(usize, usize, Completion),
    next: Vec<Seq>,
    copies: Vec<(u32, u32)>,
}
