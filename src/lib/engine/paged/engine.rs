//! The step loop (nano-vllm's `LLMEngine.step`): schedule, hand the step to the model, have the
//! scheduler apply its draws (`Scheduler::postprocess`: tokens appended, prompts forked into
//! their samples, finished samples released), write the finished samples out. With overlap
//! scheduling the next decode step is handed to the model before the draws of
//! the one running are applied (`Scheduler::lookahead`), so the host's work hides behind the
//! device's; the completions are the same either way.
//!
//! With tools (`generate_turns`), a sample whose turn ends in tool calls leaves the batch while
//! they run on the tool runner's threads (the others go on decoding); when they have answered,
//! the observation is appended to its tokens and it comes back first, its history still in its
//! KV blocks, so only the observation is prefilled.

use anyhow::{ensure, Result};
use std::collections::VecDeque;
use std::time::Instant;

use super::request::StopRule;
use super::request::{Completion, Detokenize, FinishReason, GenParams, Request};
use super::scheduler::{Batch, Flight, Scheduler};
use super::turns::{Agent, ToolRunner};
use super::{Chunk, PagedConfig, PagedModel, PagedStats, SampleRow};
use crate::backend::ops::sample::{Sampled, SamplingParams};

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
    generate_turns(model, cfg, requests, params, detok, None, progress)
}

/// [`generate_paged`] with tools: `params.max_new_tokens` is the limit of one turn, the
/// agent's limits those of the whole trajectory (the pool is checked for a whole one). Every
/// completion then has its trajectory.
pub fn generate_turns(
    model: &mut dyn PagedModel,
    cfg: &PagedConfig,
    requests: &[Request],
    params: &GenParams,
    detok: Option<Detokenize>,
    agent: Option<&Agent>,
    progress: &mut dyn FnMut(usize),
) -> Result<(Vec<Vec<Completion>>, PagedStats)> {
    cfg.validate()?;
    let whole = GenParams {
        max_new_tokens: agent.map_or(params.max_new_tokens, |a| a.limits.max_response_tokens),
        ..params.clone()
    };
    whole.check(requests, model.vocab(), cfg, detok.is_some())?;
    ensure!(
        agent.is_none() || detok.is_some(),
        "tool calls are read from the text: they need a detokenizer"
    );
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
        rule: StopRule {
            params,
            detok,
            turns: agent.map(|a| a.limits),
        },
        agent,
        tools: agent.map(ToolRunner::new),
    };
    if params.max_new_tokens == 0 {
        run.done.end_every_sample();
        run.sched.clear_waiting();
    }
    let mut pipe = Pipe {
        model,
        draws: VecDeque::new(),
    };
    run.drive(&mut pipe, cfg.overlap)?;
    Ok(run.finish())
}

/// One generation's state: the scheduler, the counters, the finished samples, and what every
/// draw is checked against (the stop rule's parameters and the detokenizer).
struct Run<'r, 'p> {
    sched: Scheduler<'r>,
    stats: PagedStats,
    done: Done<'p>,
    rule: StopRule<'r>,
    agent: Option<&'r Agent<'r>>,
    tools: Option<ToolRunner>,
}

impl Run<'_, '_> {
    /// The step loop: schedule, hand the step to the model, apply its draws, until nothing
    /// runs or waits.
    fn drive(&mut self, pipe: &mut Pipe, overlap: bool) -> Result<()> {
        // The step handed to the model whose draws have not been applied yet.
        let mut flight: Option<Flight> = None;
        loop {
            if crate::engine::cancel::requested() {
                // Let the step on the device finish before giving up, so nothing is left queued.
                if let Some(f) = flight.take() {
                    self.apply(f, None, pipe)?;
                }
                crate::engine::cancel::check()?;
            }
            if let Some(f) = flight.take() {
                flight = self.land(f, pipe, overlap)?;
                if flight.is_some() {
                    continue;
                }
            }
            self.take_observations(false)?;
            let want = self.sched.schedule(&mut self.stats);
            if want.iter().all(|&n| n == 0) {
                if self.sched.is_done() {
                    return Ok(());
                }
                if self.tools.as_ref().is_some_and(ToolRunner::busy) {
                    self.take_observations(true)?;
                    continue;
                }
                if self.sched.evict_resumed(&mut self.stats) {
                    continue;
                }
                return Err(self.sched.stalled());
            }
            let (batch, f) = self.sched.batch(want, &mut self.stats);
            pipe.submit(&batch, &self.rule.params.sampling)?;
            self.stats.gen.decode_steps += 1;
            flight = Some(f);
        }
    }

    /// Applies flight `f`. With overlap, first queues the next decode step behind it while the
    /// device runs it (its tokens are the draws of `f`, which the model feeds itself), and
    /// returns that step.
    fn land(&mut self, f: Flight, pipe: &mut Pipe, overlap: bool) -> Result<Option<Flight>> {
        // Samples back from their tools wait for a seat: they stop the lookahead when one is free.
        self.take_observations(false)?;
        let next = if overlap {
            self.sched.lookahead(&f, &self.rule)
        } else {
            None
        };
        if let Some(n) = &next {
            pipe.submit(
                &self.sched.lookahead_batch(n, &f)?,
                &self.rule.params.sampling,
            )?;
            let st = &mut self.stats;
            st.gen.decode_steps += 1;
            st.overlapped_steps += 1;
            st.peak_blocks_in_use = st.peak_blocks_in_use.max(self.sched.blocks_in_use());
        }
        let keep = self.apply(f, next.as_ref(), pipe)?;
        Ok(next.map(|n| n.retain(&keep)))
    }

    /// Collects flight `f`'s draws and has the scheduler apply them (`Scheduler::postprocess`;
    /// `queued` is the step handed to the model since, if any), writing the finished samples
    /// out and copying the blocks the forks need. Returns which running entries stay.
    fn apply(&mut self, f: Flight, queued: Option<&Flight>, pipe: &mut Pipe) -> Result<Vec<bool>> {
        let drawn = pipe.collect()?;
        let done = &mut self.done;
        let applied = self.sched.postprocess(
            f,
            &drawn,
            queued,
            &self.rule,
            &mut self.stats,
            &mut |req, sample, c| done.put(req, sample, c),
        )?;
        if !applied.copies.is_empty() {
            pipe.model.copy_blocks(&applied.copies)?;
        }
        if let Some(tools) = &mut self.tools {
            for calls in self.sched.outbox.drain(..) {
                tools.submit(calls);
            }
        }
        Ok(applied.keep)
    }

    /// Brings back the samples whose calls have all answered (`wait`: first waits for an
    /// answer, counted as tool wait), their observations appended.
    fn take_observations(&mut self, wait: bool) -> Result<()> {
        let (Some(tools), Some(agent)) = (&mut self.tools, self.agent) else {
            return Ok(());
        };
        let started = Instant::now();
        let answered = tools.poll(wait);
        if wait {
            self.stats.tool_wait_s += started.elapsed().as_secs_f64();
        }
        let done = &mut self.done;
        for (id, records) in answered {
            self.stats.tool_calls += records.len();
            self.stats.tool_errors += records.iter().filter(|r| r.error.is_some()).count();
            self.sched
                .resume(id, records, agent.observe, &self.rule, &mut |r, s, c| {
                    done.put(r, s, c)
                })?;
        }
        Ok(())
    }

    /// The completions in request and sample order, and the counters.
    fn finish(self) -> (Vec<Vec<Completion>>, PagedStats) {
        let Run {
            sched,
            mut stats,
            done,
            ..
        } = self;
        debug_assert_eq!(sched.blocks_in_use(), 0, "every block returned");
        stats.blocks_in_use_at_end = sched.blocks_in_use();
        let out = done
            .out
            .into_iter()
            .map(|v| {
                v.into_iter()
                    .map(|c| c.expect("every sample finished"))
                    .collect()
            })
            .collect();
        (out, stats)
    }
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

impl Done<'_> {
    /// Sample `sample` of request `req` is finished.
    fn put(&mut self, req: usize, sample: usize, c: Completion) {
        self.out[req][sample] = Some(c);
        self.finished += 1;
        (self.progress)(self.finished);
    }

    /// Every sample finished empty, by length (no token may be generated).
    fn end_every_sample(&mut self) {
        for o in self.out.iter_mut().flatten() {
            *o = Some(Completion {
                tokens: vec![],
                logprobs: vec![],
                finish: FinishReason::Length,
                text: String::new(),
                trajectory: None,
            });
            self.finished += 1;
        }
        (self.progress)(self.finished);
    }
}
