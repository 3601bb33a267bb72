//! The generator behind the server: one thread runs the requests through rollout's generation
//! (`stage::rollout::Generate`, the paged engine), on the policy it loaded itself or, with
//! `--daemon`, as jobs of the warm daemon on the policy the daemon holds. Requests that arrive
//! while a batch runs wait in the queue and go together into the next batch (those with the
//! same sampling parameters in one engine pass: the engine samples a pass under one set).
//!
//! A client that goes away marks its job `gone`; a batch whose clients are all gone is
//! cancelled between engine steps (`engine::cancel`; on the daemon, by closing the job's
//! connection, which the daemon cancels), and a gone client's samples in a batch that others
//! still wait for are dropped.

use super::http::Error;
use crate::backend::Backend;
use crate::daemon::client;
use crate::daemon::protocol::{Request as DaemonRequest, Response as DaemonResponse};
use crate::engine::cancel::{self, Cancel};
use crate::engine::paged::{Completion, GenParams, Limits, Request};
use crate::engine::stream;
use crate::error::is_input_error;
use crate::stage::common::Device;
use crate::stage::generate::{self, GenerateArgs};
use crate::stage::rollout::Generate;
use crate::stage::{load_policy, on_device, Job, StageJob};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use indicatif::ProgressBar;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// A streamed request's tokens as they are drawn: (sample, token, log-prob).
    pub(crate) tokens: Option<Sender<(usize, u32, f32)>>,
}

/// Where the batches run.
pub(crate) enum Engine {
    /// A copy of the policy this process loads on the device.
    Local(Device),
    /// The warm daemon at `socket`, with the policy `model` names (the daemon's held one).
    Daemon {
        socket: PathBuf,
        model: PathBuf,
        device: Device,
    },
}

/// Starts the generator thread with the policy of `dir`; returns the queue once the policy is
/// loaded or the daemon answers (or the error).
pub(crate) fn start(
    engine: Engine,
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
) -> Result<Sender<GenJob>> {
    let (tx, rx) = channel::<GenJob>();
    let (socket, model, device) = match engine {
        Engine::Local(device) => {
            start_local(device, dir, tokenizer, limits, rx)?;
            return Ok(tx);
        }
        Engine::Daemon {
            socket,
            model,
            device,
        } => (socket, model, device),
    };
    match client::request(&socket, &DaemonRequest::Health)? {
        DaemonResponse::Status { .. } => {}
        other => anyhow::bail!(
            "--daemon {}: answered {other:?} to health",
            socket.display()
        ),
    }
    let daemon = OnDaemon {
        socket,
        model,
        device,
        limits,
        batches: AtomicU64::new(0),
    };
    std::thread::Builder::new()
        .name("serve-generate".into())
        .spawn(move || {
            while let Some(batch) = next_batch(&rx) {
                for group in by_params(batch) {
                    daemon.run_group(group);
                }
            }
        })?;
    Ok(tx)
}

fn start_local(
    device: Device,
    dir: PathBuf,
    tokenizer: Arc<Tokenizer>,
    limits: Limits,
    jobs: Receiver<GenJob>,
) -> Result<()> {
    let (ready_tx, ready_rx) = channel::<Result<()>>();
    let worker = Worker {
        dir,
        tokenizer,
        limits,
        jobs,
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
        .map_err(|_| anyhow::anyhow!("the generator thread ended before loading the model"))?
}

/// How long the next batch waits for one more request while requests keep coming, and at most
/// in all: an agent's episodes, started together, arrive over some milliseconds (a Python
/// client sends its requests one after the other), and those that missed a batch would wait
/// for all of it.
const GATHER_GAP: Duration = Duration::from_millis(20);
const GATHER_MAX: Duration = Duration::from_secs(2);

/// The jobs waiting now and those that follow closely (at least one; None once the server is
/// gone).
fn next_batch(jobs: &Receiver<GenJob>) -> Option<Vec<GenJob>> {
    let first = jobs.recv().ok()?;
    let until = std::time::Instant::now() + GATHER_MAX;
    let mut batch = vec![first];
    while std::time::Instant::now() < until {
        match jobs.recv_timeout(GATHER_GAP) {
            Ok(j) => batch.push(j),
            Err(_) => break,
        }
    }
    Some(batch)
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
        while let Some(batch) = next_batch(&self.jobs) {
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
        let group = live(group);
        if group.is_empty() {
            return;
        }
        let requests: Vec<Request> = group.iter().map(|j| j.request.clone()).collect();
        let params = group[0].params.clone();
        let tokenizer = &self.tokenizer;
        let detok = |ids: &[u32]| tokenizer.decode(ids, true);
        let bar = ProgressBar::hidden();
        let job = Generate::plain(&self.dir, &requests, &params, &detok, &bar, self.limits);
        // Each streamed request's tokens to its connection.
        let senders: Vec<_> = group.iter().map(|j| j.tokens.clone()).collect();
        let watch: stream::Watch = Arc::new(move |req, sample, token, logprob| {
            if let Some(Some(tx)) = senders.get(req) {
                let _ = tx.send((sample, token, logprob));
            }
        });
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
            let r = flag.install(|| stream::install(watch, || job.generate_on(policy)));
            done.store(true, Ordering::SeqCst);
            r
        });
        answer(&group, result.map(|out| Some(out.completions)));
    }
}

/// Live jobs of `group` (a gone client's job is dropped before it runs).
fn live(group: Vec<GenJob>) -> Vec<GenJob> {
    group
        .into_iter()
        .filter(|j| !j.gone.load(Ordering::SeqCst))
        .collect()
}

/// Each job of `group` gets its samples, or the error of the pass (None: cancelled, every
/// client went away).
fn answer(group: &[GenJob], result: Result<Option<Vec<Vec<Completion>>>>) {
    let error = match result {
        Ok(Some(out)) => {
            for (j, samples) in group.iter().zip(out) {
                let _ = j.reply.send(Ok(samples));
            }
            return;
        }
        Ok(None) => None,
        Err(e) if cancel::is_cancelled(&e) => None,
        Err(e) if is_input_error(&e) => Some(Error::new(400, format!("{e:#}"))),
        Err(e) => Some(Error::new(500, format!("generation failed: {e:#}"))),
    };
    let error = error.unwrap_or_else(|| {
        eprintln!(
            "serve: cancelled a batch of {} requests: every client went away",
            group.len()
        );
        Error::new(499, "cancelled: every client of the batch went away")
    });
    for j in group {
        let _ = j.reply.send(Err(error.clone()));
    }
}

/// The generator of `--daemon`: each group a `generate` job of the daemon.
struct OnDaemon {
    socket: PathBuf,
    model: PathBuf,
    device: Device,
    limits: Limits,
    batches: AtomicU64,
}

impl OnDaemon {
    fn run_group(&self, group: Vec<GenJob>) {
        let group = live(group);
        if group.is_empty() {
            return;
        }
        // The files of one batch, in the temp directory for as long as it runs.
        let n = self.batches.fetch_add(1, Ordering::SeqCst);
        let file = |what: &str| {
            std::env::temp_dir().join(format!(
                "tandem-serve-{}-{what}-{n}.bin",
                std::process::id()
            ))
        };
        let (input, out) = (file("batch"), file("samples"));
        let result = self.generate(&group, &input, &out);
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&out);
        answer(&group, result);
    }

    /// The group's samples from the daemon; None when every client went away first.
    fn generate(
        &self,
        group: &[GenJob],
        input: &Path,
        out: &Path,
    ) -> Result<Option<Vec<Vec<Completion>>>> {
        let batch = generate::Batch {
            requests: group.iter().map(|j| j.request.clone()).collect(),
            params: group[0].params.clone(),
            limits: self.limits,
        };
        generate::write_batch(input, &batch)?;
        let job = StageJob::Generate(GenerateArgs {
            model: self.model.clone(),
            input: input.to_path_buf(),
            out: out.to_path_buf(),
            device: self.device,
        });
        let all_gone = || group.iter().all(|j| j.gone.load(Ordering::SeqCst));
        match client::run_job_until(&self.socket, job, &all_gone)? {
            true => Ok(Some(generate::read_samples(out)?)),
            false => Ok(None),
        }
    }
}
