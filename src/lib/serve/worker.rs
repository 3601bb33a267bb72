//! The generator behind the server: one thread holds the policy and runs the requests through
//! rollout's generation (`stage::rollout::Generate`, the paged engine). Requests that arrive
//! while a batch runs wait in the queue and go together into the next batch (those with the
//! same sampling parameters in one engine pass: the engine samples a pass under one set).
//!
//! A client that goes away marks its job `gone`; a batch whose clients are all gone is
//! cancelled between engine steps (`engine::cancel`), and a gone client's samples in a batch
//! that others still wait for are dropped.

use super::http::Error;
use crate::backend::Backend;
use crate::engine::cancel::{self, Cancel};
use crate::engine::paged::{Completion, GenParams, Limits, Request};
use crate::error::is_input_error;
use crate::stage::common::Device;
use crate::stage::rollout::Generate;
use crate::stage::{load_policy, on_device, Job};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use indicatif::ProgressBar;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

/// What a job's client gets back: the samples, or why there are none.
pub(crate) type Answer = Result<Vec<Completion>, Error>;

/// One request's samples to generate.
pub(crate) struct GenJob {
    pub(crate) request: Request,
    pub(crate) params: GenParams,
    /// Set by the connection when its client went away.
    pub(crate) gone: Arc<AtomicBool>,
    pub(crate) reply: Sender<Answer>,
}

/// Starts the generator thread on `device` with the policy of `dir`; returns the queue once
/// the policy is loaded (or the load's error).
pub(crate) fn start(
    device: Device,
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
) -> Result<Sender<GenJob>> {
    let (tx, rx) = channel::<GenJob>();
    let (ready_tx, ready_rx) = channel::<Result<()>>();
    let worker = Worker {
        dir,
        tokenizer,
        limits,
        jobs: rx,
        ready: ready_tx.clone(),
    };
    std::thread::Builder::new()
        .name("serve-generate".into())
        .spawn(move || {
            if let Err(e) = on_device(device, worker) {
                // A load error goes to the caller; one after it ends the thread (the queue's
                // senders then see a closed channel and answer 503).
                let _ = ready_tx.send(Err(e));
            }
        })?;
    ready_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the generator thread ended before loading the model"))??;
    Ok(tx)
}

struct Worker {
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
    jobs: Receiver<GenJob>,
    ready: Sender<Result<()>>,
}

impl Job for Worker {
    type Out = ();
    fn run<B: Backend>(self, backend: B) -> Result<()> {
        let mut policy = load_policy(backend, &self.dir)?;
        let _ = self.ready.send(Ok(()));
        while let Ok(first) = self.jobs.recv() {
            let mut batch = vec![first];
            batch.extend(self.jobs.try_iter());
            for group in by_params(batch) {
                self.run_group(&mut policy, group);
            }
        }
        Ok(())
    }
}

/// Jobs grouped by their generation parameters, in arrival order of each group's first job.
fn by_params(jobs: Vec<GenJob>) -> Vec<Vec<GenJob>> {
    let mut groups: Vec<(String, Vec<GenJob>)> = Vec::new();
    for j in jobs {
        let key = format!("{:?}", j.params);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(j),
            None => groups.push((key, vec![j])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

impl Worker {
    /// One engine pass over a group's live jobs; each gets its samples or the error.
    fn run_group<B: Backend>(
        &self,
        policy: &mut crate::model::decoder::Decoder<B>,
        group: Vec<GenJob>,
    ) {
        let group: Vec<GenJob> = group
            .into_iter()
            .filter(|j| !j.gone.load(Ordering::SeqCst))
            .collect();
        if group.is_empty() {
            return;
        }
        let requests: Vec<Request> = group.iter().map(|j| j.request.clone()).collect();
        let params = group[0].params.clone();
        let tokenizer = &self.tokenizer;
        let detok = |ids: &[u32]| tokenizer.decode(ids, true);
        let bar = ProgressBar::hidden();
        let job = Generate::plain(&self.dir, &requests, &params, &detok, &bar, self.limits);
        let flag = Cancel::new();
        let done = AtomicBool::new(false);
        let result = std::thread::scope(|s| {
            // Cancels the pass once every client of the group went away.
            s.spawn(|| {
                while !done.load(Ordering::SeqCst) {
                    if group.iter().all(|j| j.gone.load(Ordering::SeqCst)) {
                        flag.cancel();
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
            let r = flag.install(|| job.generate_on(policy));
            done.store(true, Ordering::SeqCst);
            r
        });
        match result {
            Ok(out) => {
                for (j, samples) in group.iter().zip(out.completions) {
                    let _ = j.reply.send(Ok(samples));
                }
            }
            Err(e) => {
                let error = match (cancel::is_cancelled(&e), is_input_error(&e)) {
                    (true, _) => {
                        eprintln!(
                            "serve: cancelled a batch of {} requests: every client went away",
                            group.len()
                        );
                        Error::new(499, "cancelled: every client of the batch went away")
                    }
                    (_, true) => Error::new(400, format!("{e:#}")),
                    _ => Error::new(500, format!("generation failed: {e:#}")),
                };
                for j in &group {
                    let _ = j.reply.send(Err(error.clone()));
                }
            }
        }
    }
}
