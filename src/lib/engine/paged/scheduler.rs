//! Continuous batching over the paged KV cache.
//!
//! Every step the scheduler gives each running sequence (oldest first) the tokens it still has
//! to run, within `max_batched_tokens`: one token for a decoding sequence, a chunk of its prompt
//! for a prefilling one (chunked prefill, so a long prompt does not stall the decodes). It then
//! admits waiting work while seats (`max_num_seqs`) and blocks are free: first sequences that
//! were preempted, then prompts in input order. A prompt runs once as a "prompt sequence" that
//! holds the seats of its samples; when its last chunk has run, every sample draws its first
//! token from the prompt's last logits and the prompt's blocks are shared: the full blocks by
//! reference, the partial last block copied once per extra sample.
//!
//! When a decoding sequence needs a new block and none is free, the newest running sequences
//! are preempted (their blocks released, their tokens kept) and recomputed later by a prefill of
//! prompt + generated tokens. The random draws are counter-based (key, position), so a
//! recomputed sample continues exactly as it would have. The oldest sequence can always take
//! the blocks of every newer one, and one sequence alone always fits (checked up front), so
//! the loop never deadlocks.

use super::blocks::BlockPool;
use super::{Chunk, PagedConfig, PagedModel, PagedStats, SampleRow};
use crate::engine::generate::{Completion, Detokenize, FinishReason, GenParams, Request};
use crate::engine::sampling::{Sampled, SamplingParams};
use crate::error::input_error;
use anyhow::{bail, ensure, Result};
use std::collections::VecDeque;
use std::ops::Range;

enum Kind {
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

struct Seq {
    req: usize,
    kind: Kind,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    logprobs: Vec<f32>,
    /// Admission order (newer is larger); preemption takes the newest first.
    order: (u64, usize),
    /// Finished (its completion is out) while a step that feeds it was already queued: it
    /// keeps its blocks, which that step writes, until the step's draws are applied.
    zombie: bool,
}

impl Seq {
    fn seats(&self) -> usize {
        match &self.kind {
            Kind::Prompt { samples, .. } => samples.len(),
            Kind::Sample { .. } => 1,
        }
    }
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

/// Generates every sample of every request on a paged model. Returns, per request, its
/// completions in sample order, the same as `generate::generate` would.
pub fn generate_paged(
    model: &mut dyn PagedModel,
    cfg: &PagedConfig,
    requests: &[Request],
    params: &GenParams,
    detok: Option<Detokenize>,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<Vec<Completion>>, PagedStats)> {
    params.sampling.validate()?;
    cfg.validate()?;
    ensure!(
        params.stop_strings.is_empty() || detok.is_some(),
        "stop strings need a detokenizer"
    );
    ensure!(
        params.stop_strings.iter().all(|s| !s.is_empty()),
        "stop strings must not be empty"
    );
    let vocab = model.vocab();
    let mut pool = BlockPool::new(cfg.num_blocks, cfg.block_size);
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            bail!(input_error(format!("request {i}: empty prompt")));
        }
        if let Some(&t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!(input_error(format!(
                "request {i}: token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        // The last sampled token is never fed back, so a sample occupies prompt + new − 1
        // positions; alone it must fit the whole pool or it could never finish.
        let positions = r.prompt.len() + params.max_new_tokens.saturating_sub(1);
        let need = pool.blocks_for(positions);
        if need > cfg.num_blocks {
            // An input error: no schedule can ever finish this sample.
            bail!(input_error(format!(
                "request {i}: prompt of {} tokens + {} new tokens needs {need} KV blocks of {} tokens, the pool has {} (raise --gpu-memory-fraction or lower --max-new-tokens / --max-prompt-tokens)",
                r.prompt.len(),
                params.max_new_tokens,
                cfg.block_size,
                cfg.num_blocks
            )));
        }
    }

    let mut stats = PagedStats {
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
        ..PagedStats::default()
    };
    let mut out: Vec<Vec<Option<Completion>>> = requests
        .iter()
        .map(|r| vec![None; r.sample_keys.len()])
        .collect();
    let mut finished = 0usize;
    let mut pending: VecDeque<(usize, Range<usize>)> = requests
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.sample_keys.is_empty())
        .map(|(i, r)| (i, 0..r.sample_keys.len()))
        .collect();
    if params.max_new_tokens == 0 {
        for o in out.iter_mut().flatten() {
            *o = Some(Completion {
                tokens: vec![],
                logprobs: vec![],
                finish: FinishReason::Length,
                text: String::new(),
            });
            finished += 1;
        }
        progress(finished);
        pending.clear();
    }
    let mut preempted: VecDeque<Seq> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut admitted = 0u64;
    let mut pipe = Pipe {
        model,
        draws: VecDeque::new(),
    };
    let mut done = Done {
        out,
        finished,
        progress,
    };
    // The step handed to the model whose draws have not been applied yet.
    let mut flight: Option<Flight> = None;

    loop {
        if let Some(f) = flight.take() {
            // Queue the next decode step behind it while the device runs it (its tokens are
            // the draws of `f`, which the model feeds itself), then apply `f`.
            // Seats the first waiting work needs before the scheduler would admit it (a prompt
            // waits for seats for all its samples while others run).
            let needs = if !preempted.is_empty() {
                Some(1)
            } else {
                pending.front().map(|(_, r)| r.len())
            };
            let next = if cfg.overlap {
                lookahead(&f, &mut running, &mut pool, cfg, params, needs)
            } else {
                None
            };
            if let Some(n) = &next {
                n.submit_after(&f, &mut pipe, &running, requests, params)?;
                stats.gen.decode_steps += 1;
                stats.overlapped_steps += 1;
                stats.peak_blocks_in_use = stats.peak_blocks_in_use.max(pool.in_use());
            }
            let keep = apply(
                f,
                next.as_ref().map(|n| n.want.as_slice()),
                &mut running,
                &mut pipe,
                &mut pool,
                &mut stats,
                &mut done,
                cfg,
                params,
                detok,
            )?;
            if let Some(n) = next {
                flight = Some(n.retain(&keep));
                continue;
            }
        }

        // ---- schedule: running sequences first, oldest first -------------------------------
        let mut budget = cfg.max_batched_tokens;
        let mut want: Vec<usize> = Vec::with_capacity(running.len());
        let mut i = 0;
        while i < running.len() {
            let n = running[i].pending().min(budget);
            if n == 0 {
                want.push(0);
                i += 1;
                continue;
            }
            let s = &running[i];
            let need = pool
                .blocks_for(s.computed + n)
                .saturating_sub(s.blocks.len());
            if let Some(b) = pool.alloc(need) {
                running[i].blocks.extend(b);
                want.push(n);
                budget -= n;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest sequence not yet scheduled (maybe this one).
            let victim = (i..running.len())
                .max_by_key(|&j| running[j].order)
                .expect("i is in range");
            let v = running.remove(victim);
            stats.preemptions += 1;
            preempt(v, &mut pool, &mut pending, &mut preempted);
        }

        // ---- admit: preempted sequences, then prompts in order ------------------------------
        let mut seats: usize = running.iter().map(Seq::seats).sum();
        while budget > 0 && seats < cfg.max_num_seqs {
            if let Some(s) = preempted.front() {
                let Some(b) = pool.alloc(pool.blocks_for(s.tokens.len())) else {
                    break;
                };
                let mut s = preempted.pop_front().expect("front");
                s.blocks = b;
                let n = s.pending().min(budget);
                budget -= n;
                seats += 1;
                want.push(n);
                running.push(s);
                continue;
            }
            let Some((req, range)) = pending.front().cloned() else {
                break;
            };
            let prompt = &requests[req].prompt;
            let pb = pool.blocks_for(prompt.len());
            let partial = usize::from(!prompt.len().is_multiple_of(cfg.block_size));
            let mut take = range.len().min(cfg.max_num_seqs - seats);
            while take > 0 && pb + (take - 1) * partial > pool.num_free() {
                take -= 1;
            }
            // Part of a prompt's samples only when nothing else runs (n > seats, or a pool too
            // small for all): otherwise wait for the seats, since each part is prefilled again.
            if take == 0 || (take < range.len() && !running.is_empty()) {
                break;
            }
            let blocks = pool.alloc(pb).expect("checked free blocks");
            let spare = pool
                .alloc((take - 1) * partial)
                .expect("checked free blocks");
            let samples = range.start..range.start + take;
            if take == range.len() {
                pending.pop_front();
            } else {
                pending.front_mut().expect("front").1.start = samples.end;
            }
            let n = prompt.len().min(budget);
            budget -= n;
            seats += take;
            want.push(n);
            running.push(Seq {
                req,
                kind: Kind::Prompt { samples, spare },
                tokens: prompt.clone(),
                prompt_len: prompt.len(),
                computed: 0,
                blocks,
                logprobs: vec![],
                order: (admitted, 0),
                zombie: false,
            });
            admitted += 1;
        }
        debug_assert_eq!(want.len(), running.len());
        stats.peak_blocks_in_use = stats.peak_blocks_in_use.max(pool.in_use());

        if want.iter().all(|&n| n == 0) {
            if running.is_empty() && pending.is_empty() && preempted.is_empty() {
                break;
            }
            bail!(
                "paged scheduler: no progress possible ({} running, {} waiting prompts, {} preempted, {} of {} blocks free)",
                running.len(),
                pending.len(),
                preempted.len(),
                pool.num_free(),
                pool.num_blocks()
            );
        }

        // ---- run one step ---------------------------------------------------------------------
        let mut chunks = Vec::new();
        let mut rows = Vec::new();
        // Per running sequence: the range of its sampled rows, if it samples this step.
        let mut drawn_rows: Vec<Option<Range<usize>>> = vec![None; running.len()];
        for (idx, (s, &n)) in running.iter().zip(&want).enumerate() {
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
            let keys = &requests[s.req].sample_keys;
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
        let pure_decode = running
            .iter()
            .zip(&want)
            .zip(&drawn_rows)
            .all(|((s, &n), r)| {
                n == 0 || (n == 1 && matches!(s.kind, Kind::Sample { .. }) && r.is_some())
            });
        pipe.submit(&chunks, &vec![None; chunks.len()], &rows, &params.sampling)?;
        drop(chunks);
        stats.gen.decode_steps += 1;
        flight = Some(Flight {
            want,
            drawn_rows,
            rows: rows.len(),
            pure_decode,
        });
    }
    let Done { out, .. } = done;

    debug_assert_eq!(pool.in_use(), 0, "every block returned");
    stats.blocks_in_use_at_end = pool.in_use();
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

/// A step handed to the model whose draws are not applied yet; its vectors are aligned with
/// `running` as it was when the step was built.
struct Flight {
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
    fn retain(self, keep: &[bool]) -> Flight {
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

    /// Hands a lookahead step to the model: chunk of sequence i feeds the draw of its row in
    /// the step before (`prev`, aligned with `running` too).
    fn submit_after(
        &self,
        prev: &Flight,
        pipe: &mut Pipe,
        running: &[Seq],
        requests: &[Request],
        params: &GenParams,
    ) -> Result<()> {
        let mut chunks = Vec::with_capacity(self.rows);
        let mut feed = Vec::with_capacity(self.rows);
        let mut rows = Vec::with_capacity(self.rows);
        for ((s, &n), p) in running.iter().zip(&self.want).zip(&prev.drawn_rows) {
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
                key: requests[s.req].sample_keys[*sample],
                position: (s.tokens.len() + 1 - s.prompt_len) as u64,
            });
            feed.push(Some(src.start as u32));
            chunks.push(Chunk {
                tokens: &FED,
                start: s.computed + 1,
                table: &s.blocks,
            });
        }
        pipe.submit(&chunks, &feed, &rows, &params.sampling)
    }
}

/// The next decode step queued behind flight `f` (overlap scheduling): every live sample of
/// `f` feeds the token `f` draws for it and draws the next, as the scheduler would decide once
/// `f`'s draws are back unless one of them ends the sample (then the step computes a token
/// nobody reads). Only when nothing else would change: `f` is a decode step of every live
/// sequence, the first waiting work (needing `needs` seats) could not be admitted into the
/// seats free now, and the pool has the blocks. Work a finishing sample makes room for is
/// admitted one step later.
fn lookahead(
    f: &Flight,
    running: &mut [Seq],
    pool: &mut BlockPool,
    cfg: &PagedConfig,
    params: &GenParams,
    needs: Option<usize>,
) -> Option<Flight> {
    if !f.pure_decode {
        return None;
    }
    let live = || running.iter().zip(&f.want).filter(|(s, _)| !s.zombie);
    if live().any(|(_, &n)| n != 1) {
        return None;
    }
    if needs.is_some_and(|n| n <= cfg.max_num_seqs - live().count().min(cfg.max_num_seqs)) {
        return None;
    }
    // A sample whose draw in `f` is its last by length is over whatever it draws.
    let go: Vec<bool> = running
        .iter()
        .map(|s| !s.zombie && s.tokens.len() + 1 - s.prompt_len < params.max_new_tokens)
        .collect();
    // Blocks each needs for the position the queued step feeds (computed + 1).
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

/// The placeholder token of a chunk whose token the model takes from the previous draws.
const FED: [u32; 1] = [0];

/// The model behind the scheduler. A model without a queue of its own (`asynchronous` false:
/// the CPU, test models) runs each step when it is submitted; its draws wait here, and a fed
/// token is read from the draws of the step before.
struct Pipe<'m> {
    model: &'m mut dyn PagedModel,
    draws: VecDeque<Vec<Sampled>>,
}

impl Pipe<'_> {
    fn submit(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<()> {
        if self.model.asynchronous() {
            return self.model.submit(chunks, feed, rows, sampling);
        }
        let fed: Vec<u32> = match self.draws.back() {
            Some(prev) => feed
                .iter()
                .map(|f| f.map_or(Ok(0), |r| prev.get(r as usize).map(|d| d.token).ok_or(r)))
                .collect::<std::result::Result<_, u32>>()
                .map_err(|r| anyhow::anyhow!("paged scheduler: fed row {r} was not drawn"))?,
            None => {
                ensure!(
                    feed.iter().all(Option::is_none),
                    "paged scheduler: nothing to feed from"
                );
                vec![0; feed.len()]
            }
        };
        let chunks: Vec<Chunk> = chunks
            .iter()
            .zip(feed)
            .zip(&fed)
            .map(|((c, f), t)| match f {
                Some(_) => Chunk {
                    tokens: std::slice::from_ref(t),
                    ..*c
                },
                None => *c,
            })
            .collect();
        let d = self.model.step(&chunks, rows, sampling)?;
        self.draws.push_back(d);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<Sampled>> {
        if self.model.asynchronous() {
            return self.model.collect();
        }
        self.draws
            .pop_front()
            .ok_or_else(|| anyhow::anyhow!("paged scheduler: no step to collect"))
    }
}

/// Where finished samples go.
struct Done<'p> {
    out: Vec<Vec<Option<Completion>>>,
    finished: usize,
    progress: &'p mut dyn FnMut(usize),
}

/// Collects flight `f`'s draws and applies them to `running` (aligned with `f`): tokens
/// appended, prompts forked into their samples, finished samples written out and their blocks
/// released, unless `queued` (the step already handed to the model, aligned the same way)
/// feeds them: those become zombies until it is applied. Returns which entries of `running`
/// stay (when a step is queued nothing is forked, so the survivors keep their order).
#[allow(clippy::too_many_arguments)]
fn apply(
    f: Flight,
    queued: Option<&[usize]>,
    running: &mut Vec<Seq>,
    pipe: &mut Pipe,
    pool: &mut BlockPool,
    stats: &mut PagedStats,
    done: &mut Done,
    cfg: &PagedConfig,
    params: &GenParams,
    detok: Option<Detokenize>,
) -> Result<Vec<bool>> {
    let drawn = pipe.collect()?;
    ensure!(
        drawn.len() == f.rows,
        "paged model drew {} tokens for {} rows",
        drawn.len(),
        f.rows
    );
    let mut copies: Vec<(u32, u32)> = Vec::new();
    let mut next: Vec<Seq> = Vec::with_capacity(running.len());
    let mut keep = Vec::with_capacity(running.len());
    for (i, ((mut s, n), rows)) in running.drain(..).zip(f.want).zip(f.drawn_rows).enumerate() {
        let fed_next = queued.is_some_and(|q| q[i] > 0);
        if s.zombie {
            // Its draw was computed for nobody; no later step feeds it.
            debug_assert!(!fed_next);
            stats.overlap_discarded += 1;
            pool.release(&s.blocks);
            keep.push(false);
            continue;
        }
        s.computed += n;
        let Some(rows) = rows else {
            next.push(s);
            keep.push(true);
            continue;
        };
        stats.gen.generated_tokens += rows.len();
        let mut ended: Vec<(Seq, FinishReason)> = Vec::new();
        // Whether entry i stays in `running` (a prompt leaves: its samples are new entries).
        let mut stays = false;
        match s.kind {
            Kind::Prompt { samples, spare } => {
                stats.gen.prefills += 1;
                let full = s.prompt_len / cfg.block_size;
                let mut spare = spare.into_iter();
                for (k, (j, d)) in samples.zip(&drawn[rows]).enumerate() {
                    let blocks = if k == 0 {
                        s.blocks.clone()
                    } else {
                        for &b in &s.blocks[..full] {
                            pool.share(b);
                        }
                        let mut t = s.blocks[..full].to_vec();
                        if full < s.blocks.len() {
                            let copy = spare.next().expect("a spare block per extra sample");
                            copies.push((s.blocks[full], copy));
                            t.push(copy);
                        }
                        t
                    };
                    let mut c = Seq {
                        req: s.req,
                        kind: Kind::Sample {
                            sample: j,
                            stopped_text: None,
                        },
                        tokens: s.tokens.clone(),
                        prompt_len: s.prompt_len,
                        computed: s.computed,
                        blocks,
                        logprobs: vec![],
                        order: (s.order.0, k),
                        zombie: false,
                    };
                    match accept(&mut c, *d, params, detok)? {
                        Some(reason) => ended.push((c, reason)),
                        None => next.push(c),
                    }
                }
            }
            Kind::Sample { .. } => {
                let d = drawn[rows.start];
                match accept(&mut s, d, params, detok)? {
                    Some(reason) => ended.push((s, reason)),
                    None => {
                        next.push(s);
                        stays = true;
                    }
                }
            }
        }
        for (mut c, reason) in ended {
            let tokens = std::mem::take(&mut c.tokens);
            let logprobs = std::mem::take(&mut c.logprobs);
            let (req, sample, text) =
                completion_text(c.req, &c.kind, &tokens, c.prompt_len, detok)?;
            done.out[req][sample] = Some(Completion {
                tokens: tokens[c.prompt_len..].to_vec(),
                logprobs,
                finish: reason,
                text,
            });
            done.finished += 1;
            (done.progress)(done.finished);
            if fed_next {
                c.zombie = true;
                next.push(c);
                stays = true;
            } else {
                pool.release(&c.blocks);
            }
        }
        keep.push(stays);
    }
    *running = next;
    if !copies.is_empty() {
        pipe.model.copy_blocks(&copies)?;
    }
    Ok(keep)
}

impl Seq {
    /// Whether the tokens fed now are prefill work (prompt or recompute), not a decode.
    fn prefix_is_prompt_or_resume(&self) -> bool {
        self.pending() > 1 || matches!(self.kind, Kind::Prompt { .. })
    }
}

/// Releases a sequence's blocks and queues it again: a prompt goes back to the front of the
/// prompts, a sample to the preempted queue (recomputed before new prompts are admitted).
fn preempt(
    mut s: Seq,
    pool: &mut BlockPool,
    pending: &mut VecDeque<(usize, Range<usize>)>,
    preempted: &mut VecDeque<Seq>,
) {
    pool.release(&s.blocks);
    s.blocks.clear();
    s.computed = 0;
    match s.kind {
        Kind::Prompt { samples, spare } => {
            pool.release(&spare);
            pending.push_front((s.req, samples));
        }
        Kind::Sample { .. } => {
            // Keep the preempted queue oldest first.
            let at = preempted
                .iter()
                .position(|p| p.order > s.order)
                .unwrap_or(preempted.len());
            preempted.insert(at, s);
        }
    }
}

/// (request, sample index, response text) of a finished sample.
fn completion_text(
    req: usize,
    kind: &Kind,
    tokens: &[u32],
    prompt_len: usize,
    detok: Option<Detokenize>,
) -> Result<(usize, usize, String)> {
    let Kind::Sample {
        sample,
        stopped_text,
    } = kind
    else {
        bail!("a prompt sequence cannot finish");
    };
    let text = match (stopped_text, detok) {
        (Some(t), _) => t.clone(),
        (None, Some(d)) => d(&tokens[prompt_len..])?,
        (None, None) => String::new(),
    };
    Ok((req, *sample, text))
}

/// Appends a drawn token; returns why the sample is finished, if it is (the same rules as
/// `generate`: stop string, then stop id, then length).
fn accept(
    s: &mut Seq,
    d: Sampled,
    params: &GenParams,
    detok: Option<Detokenize>,
) -> Result<Option<FinishReason>> {
    s.tokens.push(d.token);
    s.logprobs.push(d.logprob);
    let generated = &s.tokens[s.prompt_len..];
    if let (Some(dt), false) = (detok, params.stop_strings.is_empty()) {
        // The whole response is decoded again: a token may complete a character (or a stop
        // string) begun by earlier tokens.
        let mut text = dt(generated)?;
        if let Some(cut) = params
            .stop_strings
            .iter()
            .filter_map(|st| text.find(st.as_str()))
            .min()
        {
            text.truncate(cut);
            if let Kind::Sample { stopped_text, .. } = &mut s.kind {
                *stopped_text = Some(text);
            }
            return Ok(Some(FinishReason::Stop));
        }
    }
    if params.stop_token_ids.contains(&d.token) {
        return Ok(Some(FinishReason::Stop));
    }
    if generated.len() >= params.max_new_tokens {
        return Ok(Some(FinishReason::Length));
    }
    Ok(None)
}
