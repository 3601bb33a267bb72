//! The step loop (nano-vllm's `LLMEngine.step`): schedule, hand the step to the model, apply its
//! draws (tokens appended, prompts forked into their samples, finished samples written out).
//! With overlap scheduling the next decode step is handed to the model before the draws of
//! the one running are applied (`Scheduler::lookahead`), so the host's work hides behind the
//! device's; the completions are the same either way.

use anyhow::{ensure, Result};
use std::collections::VecDeque;

use super::request::{Completion, Detokenize, FinishReason, GenParams, Request};
use super::scheduler::{Batch, Flight, Scheduler};
use super::sequence::{Kind, Seq};
use super::{Chunk, PagedConfig, PagedModel, PagedStats, SampleRow};
use crate::backend::sample::{Sampled, SamplingParams};

/// Generates every sample of every request on a paged model. Returns, per request, its
/// completions in sample order; `progress` is told the number of samples finished so far.
pub fn generate_paged(
    model: &mut dyn PagedModel,
    cfg: &PagedConfig,
    requests: &[Request],
    params: &GenParams,
    detok: Option<Detokenize>,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<Vec<Completion>>, PagedStats)> {
    cfg.validate()?;
    params.check(requests, model.vocab(), cfg, detok.is_some())?;
    let mut run = Run {
        sched: Scheduler::new(cfg, requests),
        stats: PagedStats {
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            ..PagedStats::default()
        },
        done: Done {
            out: requests
                .iter()
                .map(|r| vec![None; r.sample_keys.len()])
                .collect(),
            finished: 0,
            progress,
        },
        params,
        detok,
    };
    if params.max_new_tokens == 0 {
        let done = &mut run.done;
        for o in done.out.iter_mut().flatten() {
            *o = Some(Completion {
                tokens: vec![],
                logprobs: vec![],
                finish: FinishReason::Length,
                text: String::new(),
            });
            done.finished += 1;
        }
        (done.progress)(done.finished);
        run.sched.clear_waiting();
    }
    let mut pipe = Pipe {
        model,
        draws: VecDeque::new(),
    };
    // The step handed to the model whose draws have not been applied yet.
    let mut flight: Option<Flight> = None;

    loop {
        if crate::engine::cancel::requested() {
            // Let the step on the device finish before giving up, so nothing is left queued.
            if let Some(f) = flight.take() {
                run.apply(f, None, &mut pipe)?;
            }
            crate::engine::cancel::check()?;
        }
        if let Some(f) = flight.take() {
            // Queue the next decode step behind it while the device runs it (its tokens are
            // the draws of `f`, which the model feeds itself), then apply `f`.
            let next = if cfg.overlap {
                run.sched.lookahead(&f, params)
            } else {
                None
            };
            if let Some(n) = &next {
                pipe.submit(&run.sched.lookahead_batch(n, &f)?, &params.sampling)?;
                let st = &mut run.stats;
                st.gen.decode_steps += 1;
                st.overlapped_steps += 1;
                st.peak_blocks_in_use = st.peak_blocks_in_use.max(run.sched.pool.in_use());
            }
            let keep = run.apply(f, next.as_ref().map(|n| n.want.as_slice()), &mut pipe)?;
            if let Some(n) = next {
                flight = Some(n.retain(&keep));
                continue;
            }
        }
        let want = run.sched.schedule(&mut run.stats);
        if want.iter().all(|&n| n == 0) {
            if run.sched.is_done() {
                break;
            }
            return Err(run.sched.stalled());
        }
        let (batch, f) = run.sched.batch(want, &mut run.stats);
        pipe.submit(&batch, &params.sampling)?;
        run.stats.gen.decode_steps += 1;
        flight = Some(f);
    }

    let Run {
        sched,
        mut stats,
        done,
        ..
    } = run;
    debug_assert_eq!(sched.pool.in_use(), 0, "every block returned");
    stats.blocks_in_use_at_end = sched.pool.in_use();
    let out = done
        .out
        .into_iter()
        .map(|v| {
            v.into_iter()
                .map(|c| c.expect("every sample finished"))
                .collect()
        })
        .collect();
    Ok((out, stats))
}

/// One generation's state: the scheduler, the counters, the finished samples, and what every
/// draw is checked against (the stop rule's parameters and the detokenizer).
struct Run<'r, 'p> {
    sched: Scheduler<'r>,
    stats: PagedStats,
    done: Done<'p>,
    params: &'r GenParams,
    detok: Option<Detokenize<'r>>,
}

/// The model behind the loop. A model without a queue of its own (`asynchronous` false: the
/// toy models of tests, a bench wrapper) runs each step when it is submitted; its draws wait
/// here, and a fed token is read from the draws of the step before.
struct Pipe<'m> {
    model: &'m mut dyn PagedModel,
    draws: VecDeque<Vec<Sampled>>,
}

impl Pipe<'_> {
    fn submit(&mut self, b: &Batch, sampling: &SamplingParams) -> Result<()> {
        if self.model.asynchronous() {
            return self.model.submit(&b.chunks, &b.feed, &b.rows, sampling);
        }
        let fed: Vec<u32> = match self.draws.back() {
            Some(prev) => b
                .feed
                .iter()
                .map(|f| f.map_or(Ok(0), |r| prev.get(r as usize).map(|d| d.token).ok_or(r)))
                .collect::<std::result::Result<_, u32>>()
                .map_err(|r| anyhow::anyhow!("paged scheduler: fed row {r} was not drawn"))?,
            None => {
                ensure!(
                    b.feed.iter().all(Option::is_none),
                    "paged scheduler: nothing to feed from"
                );
                vec![0; b.feed.len()]
            }
        };
        let chunks: Vec<Chunk> = b
            .chunks
            .iter()
            .zip(&b.feed)
            .zip(&fed)
            .map(|((c, f), t)| match f {
                Some(_) => Chunk {
                    tokens: std::slice::from_ref(t),
                    ..*c
                },
                None => *c,
            })
            .collect();
        let rows: &[SampleRow] = &b.rows;
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

impl Run<'_, '_> {
    /// Collects flight `f`'s draws and applies them to the running sequences (aligned with `f`):
    /// tokens appended, prompts forked into their samples, finished samples written out and their
    /// blocks released, unless `queued` (the step already handed to the model, aligned the same
    /// way) feeds them: those become zombies until it is applied. Returns which running entries
    /// stay (when a step is queued nothing is forked, so the survivors keep their order).
    fn apply(&mut self, f: Flight, queued: Option<&[usize]>, pipe: &mut Pipe) -> Result<Vec<bool>> {
        let Run {
            sched,
            stats,
            done,
            params,
            detok,
        } = self;
        let (params, detok) = (*params, *detok);
        let drawn = pipe.collect()?;
        ensure!(
            drawn.len() == f.rows,
            "paged model drew {} tokens for {} rows",
            drawn.len(),
            f.rows
        );
        let block_size = sched.pool.block_size();
        let pool = &mut sched.pool;
        let mut copies: Vec<(u32, u32)> = Vec::new();
        let mut next: Vec<Seq> = Vec::with_capacity(sched.running.len());
        let mut keep = Vec::with_capacity(sched.running.len());
        let running = sched.running.drain(..).zip(f.want).zip(f.drawn_rows);
        for (i, ((mut s, n), rows)) in running.enumerate() {
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
                    let full = s.prompt_len / block_size;
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
                        match c.accept(*d, params, detok)? {
                            Some(reason) => ended.push((c, reason)),
                            None => next.push(c),
                        }
                    }
                }
                Kind::Sample { .. } => {
                    let d = drawn[rows.start];
                    match s.accept(d, params, detok)? {
                        Some(reason) => ended.push((s, reason)),
                        None => {
                            next.push(s);
                            stays = true;
                        }
                    }
                }
            }
            for (mut c, reason) in ended {
                let (req, sample, text) = c.completion_text(detok)?;
                let tokens = std::mem::take(&mut c.tokens);
                done.out[req][sample] = Some(Completion {
                    tokens: tokens[c.prompt_len..].to_vec(),
                    logprobs: std::mem::take(&mut c.logprobs),
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
        sched.running = next;
        if !copies.is_empty() {
            pipe.model.copy_blocks(&copies)?;
        }
        Ok(keep)
    }
}
