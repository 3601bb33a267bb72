//! `[placement] mode = "async"`: fully asynchronous RL with partial rollouts (docs/DISTRIBUTED.md,
//! "Placement"). The rollout group generates continuously, in rounds (`rollout
//! --round-tokens`, `stage::rollout_round`), on a thread of the runner of its own; the step
//! loop trains on the training group at the same time. Between the two sits a queue of
//! finished groups:
//!
//! - A round continues the sequences in flight and starts new prompts' groups while fewer than
//!   (K + 1) × `prompts-per-step` groups are in flight or waiting (K = `max-staleness`); the
//!   groups it finishes join the queue, oldest first. With nothing to do (the queue full) or
//!   while weights move, the rollout side waits (its idle time is counted).
//! - A step's `take` task waits for the queue (the training side's idle time) and takes its
//!   groups one by one through `staleness::admit` against the policy being trained: a group
//!   whose oldest token lags more than K versions is dropped whole and counted; the first
//!   `prompts-per-step` admitted groups become the step's `rollout.parquet` (score, advantage,
//!   update read it as in any step).
//! - With `[algorithm] filter-groups` the take scores what it admits, in passes of the groups
//!   still missing (`take_varied`), and keeps the groups `dynamic`'s rule keeps, until it has
//!   `prompts-per-step`; the step's scored file is then the take's, and `max-num-gen-batches`
//!   caps the groups scored at that many times `prompts-per-step`.
//! - The transfer after the update pauses the rounds: it runs on the rollout group between two
//!   rounds (the group runs one job at a time), so the sequences in flight continue under the
//!   new weights in the next round; the rounds then use the policy the group holds
//!   (`RUN/async/rollout-policy`).
//! - A round that fails with the rollout group gone (a rank died) is handed to the training
//!   side, which restarts the group at its next wait or transfer (`restart`); the rounds go
//!   on from where the failed one started.
//!
//! The rounds' files are in `RUN/async/round-R/` and their commands in `RUN/async/rounds.sh`;
//! `RUN/async/in-flight.json` says after each round what is in flight. A runner killed loses
//! what was in flight and waiting (the rerun says how much) and starts rounds afresh from the
//! last finished step; this mode is not deterministic (which round a group finishes in
//! depends on timing).

mod restart;

use super::console::Console;
use super::dynamic::{self, Round};
use super::plan::placed::RoundFiles;
use super::plan::{round_files, Action, Plan, Task};
use super::rundir::step_name;
use super::rundir::State;
use super::sampler::{draw_into, Cursor, Sampler};
use super::spec::FilterGroups;
use super::staleness::{admit, Admission};
use crate::batch::schema::{self, meta};
use crate::batch::{stage_meta, write_file, write_json, Batch, StageInfo};
use crate::engine::policy::Pointer;
use crate::error::input_error;
use crate::process::die_with_parent;
use crate::stage::common::resolve_model;
use anyhow::{Context, Result};
use arrow_array::RecordBatch;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One finished group waiting for the trainer.
#[derive(Debug)]
struct Ready {
    puid: String,
    rows: RecordBatch,
    meta: BTreeMap<String, String>,
    /// Each row's `token_policy_version`.
    versions: Vec<Vec<u64>>,
}

/// What the two sides share.
#[derive(Default)]
struct Queue {
    ready: VecDeque<Ready>,
    stop: bool,
    /// Weights are moving to the rollout group: no round starts.
    paused: bool,
    /// A round is being prepared or runs (the transfer waits for it to end).
    running: bool,
    /// A round failed: the run stops with it.
    error: Option<anyhow::Error>,
    /// A round's command failed: the rounds wait for the training side to restart the
    /// rollout group (`restart::recover`) or stop the run with the round's error.
    failed: Option<restart::RoundFailure>,
    /// The training side restarts the rollout group.
    restarting: bool,
    /// Rounds failed with the group restarted since the last round that ended (bounded).
    failures_in_a_row: u32,
    /// Since the last take: the rollout group's restarts, and the sequences of their failed
    /// rounds (whose new tokens were lost and are generated again).
    restarts: u64,
    restart_rows: u64,
    /// Where the sampler stands after the prompts the rounds drew.
    cursor: Cursor,
    /// After the last round: groups and sequences in flight, and those with tokens already.
    in_flight_groups: usize,
    in_flight_rows: usize,
    partial_rows: usize,
    /// Since the last take: the rollout side's seconds waiting, rounds, new tokens.
    rollout_idle_s: f64,
    rounds: u64,
    new_tokens: u64,
    /// Since the last take: the tool calls the rounds ran, those that failed, their seconds.
    tool_calls: u64,
    tool_errors: u64,
    tool_s: f64,
}

#[derive(Default)]
pub(super) struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut Queue)) {
        f(&mut self.lock());
        self.cv.notify_all();
    }

    /// Waits for a change of the queue, 200 ms at most (a side polls what it waits for).
    fn wait<'a>(&self, q: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        self.cv
            .wait_timeout(q, Duration::from_millis(200))
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// `wait`, its time counted as the rollout side's idle time.
    fn wait_idle<'a>(&self, q: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        let t0 = Instant::now();
        let mut q = self.wait(q);
        q.rollout_idle_s += t0.elapsed().as_secs_f64();
        q
    }
}

/// The rollout side: the rounds, one after the other, until told to stop.
struct RoundLoop {
    plan: Plan,
    shared: Arc<Shared>,
    train: Batch,
    sampler: Sampler,
    /// Groups in flight and waiting at most.
    capacity: usize,
    n: usize,
}

impl RoundLoop {
    fn run(self) {
        if let Err(e) = self.rounds() {
            self.shared.update(|q| {
                q.error = Some(e);
                q.stop = true;
            });
        }
    }

    fn rounds(&self) -> Result<()> {
        let dir = async_dir(&self.plan);
        let mut carry: Option<PathBuf> = None;
        for round in 1.. {
            let Some(start) = self.wait_for_work(carry.is_some()) else {
                return Ok(());
            };
            let rdir = dir.join(format!("round-{round}"));
            let files = self.plan.round_files(round, carry.clone());
            std::fs::create_dir_all(&rdir)
                .with_context(|| format!("creating {}", rdir.display()))?;
            let cursor = self.shared.lock().cursor;
            let next = draw_into(
                &self.train,
                &self.sampler,
                (cursor, start as u64),
                round,
                &files.prompts,
            )?;
            self.shared.update(|q| q.cursor = next);
            let model = self.plan.rollout_policy();
            let args = self.plan.round_args(round, &model, &files);
            if let Err(error) = self.run_round(&rdir, &args) {
                let failure = restart::RoundFailure {
                    round,
                    dir: rdir,
                    error,
                    started: start,
                    cursor,
                };
                // After a restart the next round starts from where this one did.
                match self.await_restart(failure) {
                    true => continue,
                    false => return Ok(()),
                }
            }
            self.finish_round(&files)?;
            self.shared.update(|q| {
                q.running = false;
                q.failures_in_a_row = 0;
            });
            if let Some(old) = carry.replace(files.carry_out.clone()) {
                // The round's inputs are done with; its outputs stay for inspection.
                let _ = std::fs::remove_file(old);
            }
        }
        Ok(())
    }

    /// Waits until a round may run; returns the number of prompts it starts (None: stop).
    fn wait_for_work(&self, carrying: bool) -> Option<usize> {
        let mut q = self.shared.lock();
        loop {
            if q.stop {
                return None;
            }
            let free = self
                .capacity
                .saturating_sub(q.in_flight_groups + q.ready.len());
            if !q.paused && (free > 0 || (carrying && q.in_flight_groups > 0)) {
                q.running = true;
                return Some(free);
            }
            q = self.shared.wait_idle(q);
        }
    }

    /// Runs the round's stage command on the rollout group; its output goes to `rdir/log.txt`.
    fn run_round(&self, rdir: &Path, args: &[String]) -> Result<()> {
        let line = self.plan.stage_line("rollout", args);
        append(&async_dir(&self.plan).join("rounds.sh"), &line)?;
        let log = rdir.join("log.txt");
        let out = std::fs::File::create(&log)?;
        let mut cmd = std::process::Command::new(self.plan.bins.join("rollout"));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().context("starting the rollout round")?;
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if self.shared.lock().stop {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.success() {
            return Ok(());
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(12).collect();
        let tail: Vec<String> = tail.iter().rev().map(|l| format!("  | {l}")).collect();
        let msg = format!(
            "a rollout round failed ({status}); its output ended with (all of it in {}):\n{}\nCommand:\n  {line}",
            log.display(),
            tail.join("\n")
        );
        Err(match status.code() {
            Some(2) => input_error(msg),
            _ => anyhow::anyhow!(msg),
        })
    }

    /// Queues the round's finished groups and records what is in flight.
    fn finish_round(&self, files: &RoundFiles) -> Result<()> {
        if self.shared.lock().stop {
            return Ok(());
        }
        let done = Batch::read(&files.finished, &[])?;
        let groups = split_groups(&done)?;
        let carry = Batch::read(&files.carry_out, &[schema::PROMPT_UID])?;
        let m: Value = serde_json::from_str(&std::fs::read_to_string(&files.metrics)?)?;
        let count = |k: &str| m[k].as_u64().unwrap_or(0) as usize;
        let mut q = self.shared.lock();
        q.ready.extend(groups);
        q.in_flight_groups = count("carried_groups");
        q.in_flight_rows = carry.num_rows();
        q.partial_rows = count("partial_rows");
        q.rounds += 1;
        q.new_tokens += count("new_tokens") as u64;
        q.tool_calls += count("tool_calls") as u64;
        q.tool_errors += count("tool_errors") as u64;
        q.tool_s += m["tool_seconds"].as_f64().unwrap_or(0.0);
        let written = write_record(&self.plan, &q, self.n);
        drop(q);
        self.shared.cv.notify_all();
        written
    }
}

/// Writes `in-flight.json`: what a runner killed now would lose. Called with the queue
/// locked, so that the two sides' writes do not cross.
fn write_record(plan: &Plan, q: &Queue, n: usize) -> Result<()> {
    let v = json!({
        "in_flight_groups": q.in_flight_groups,
        "in_flight_sequences": q.in_flight_rows,
        "partial_sequences": q.partial_rows,
        "waiting_groups": q.ready.len(),
        "waiting_sequences": q.ready.len() * n,
    });
    write_json(&async_dir(plan).join("in-flight.json"), &v)
}

/// The groups of a round's finished rows (a group's rows are contiguous), oldest first.
fn split_groups(b: &Batch) -> Result<Vec<Ready>> {
    if b.num_rows() == 0 {
        return Ok(vec![]);
    }
    let puids = b.strings(schema::PROMPT_UID)?;
    let versions = b.ragged_i32(schema::TOKEN_POLICY_VERSION)?;
    let out = crate::batch::runs(&puids)
        .into_iter()
        .map(|r| Ready {
            puid: puids[r.start].to_string(),
            rows: b.data.slice(r.start, r.len()),
            meta: b.meta.clone(),
            versions: r
                .map(|i| versions.row(i).iter().map(|&v| v as u64).collect())
                .collect(),
        })
        .collect();
    Ok(out)
}

fn append(path: &Path, line: &str) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{line}")?;
    Ok(())
}

fn async_dir(plan: &Plan) -> PathBuf {
    plan.async_dir()
}

/// Points `RUN/async/rollout-policy` at the current policy (which the rollout group holds
/// now), by its absolute directory.
fn point_rollout(plan: &Plan) -> Result<()> {
    let policy = resolve_model(&plan.run.policy())?;
    let dir = std::fs::canonicalize(&policy.dir)
        .with_context(|| format!("resolving {}", policy.dir.display()))?;
    let p = Pointer {
        model: dir.display().to_string(),
        policy_version: policy.policy_version,
    };
    let text = serde_json::to_string_pretty(&p)?;
    super::rundir::write_atomic(&plan.rollout_policy(), text.as_bytes())
}

/// What the asynchronous run needs from the step loop (`runner::Runner` implements it).
pub(super) trait Steps {
    fn plan(&self) -> &Plan;
    fn state(&mut self) -> &mut State;
    fn console(&mut self) -> &mut Console;
    fn run_task(&mut self, step: u64, task: &Task) -> Result<()>;
    /// Runs a stage command as part of task `task` of step `step` (dynamic sampling's score
    /// passes inside `take`).
    fn run_command(&mut self, step: u64, task: &str, bin: &str, args: &[String]) -> Result<()>;
    /// Both daemon groups up, the rollout group with the current policy.
    fn ensure_sides(&mut self, step: u64) -> Result<()>;
    fn train_set(&mut self) -> Result<Batch>;
    /// Where a step's `take` finds the queue (None once the rounds stopped).
    fn set_rounds(&mut self, rounds: Option<Arc<Shared>>);
    /// After a round failed: None when the rollout group is up, else what is known of the
    /// rank that ended it.
    fn rollout_gone(&mut self) -> Option<String>;
    /// Starts the rollout group again and sends it the current policy, counting `restarts`.
    fn restart_rollout(&mut self, step: u64, restarts: &mut u32) -> Result<()>;
}

/// The asynchronous run: step 0's tasks, then the rounds on their thread while the step loop
/// runs the other tasks.
pub(super) fn run(r: &mut impl Steps, tasks: Vec<(u64, Task)>) -> Result<()> {
    let (init, steps): (Vec<_>, Vec<_>) = tasks.into_iter().partition(|(s, _)| *s == 0);
    for (step, task) in &init {
        r.run_task(*step, task)?;
    }
    let Some(&(first, _)) = steps.first() else {
        return Ok(());
    };
    say_lost(r, first)?;
    r.ensure_sides(first)?;
    point_rollout(r.plan())?;
    let shared = Arc::new(Shared::default());
    let (cursor, train_rows) = (r.state().sampler, r.state().train_rows);
    shared.update(|q| q.cursor = cursor);
    let plan = r.plan();
    let k = plan.placement().and_then(|p| p.max_staleness);
    let per_step = plan.spec.data.prompts_per_step as usize;
    let rounds = RoundLoop {
        plan: plan.clone(),
        shared: shared.clone(),
        sampler: plan.sampler(train_rows),
        capacity: (k.unwrap_or(1) as usize + 1) * per_step,
        n: plan.stages.rollout.args.n,
        train: r.train_set()?,
    };
    let thread = std::thread::spawn(move || rounds.run());
    r.set_rounds(Some(shared.clone()));
    let result = train_side(r, steps, &shared);
    shared.update(|q| q.stop = true);
    let _ = thread.join();
    r.set_rounds(None);
    result
}

fn train_side(r: &mut impl Steps, steps: Vec<(u64, Task)>, shared: &Shared) -> Result<()> {
    for (step, task) in &steps {
        if task.name != "transfer" {
            r.run_task(*step, task)?;
            continue;
        }
        // The rounds wait while the weights move, and the one running ends first: a round
        // started before the transfer samples with the weights it was sent for.
        let moved = pause(shared)
            .and_then(|()| restart::recover(r, shared, *step))
            .and_then(|()| r.run_task(*step, task))
            .and_then(|()| point_rollout(r.plan()));
        shared.update(|q| q.paused = false);
        moved?;
    }
    Ok(())
}

/// A rerun after a runner that died, or the rounds after a rewind: says what was in flight
/// and waiting (lost), and clears the rounds' files.
fn say_lost(r: &mut impl Steps, first: u64) -> Result<()> {
    let dir = async_dir(r.plan());
    let record = dir.join("in-flight.json");
    if let Ok(text) = std::fs::read_to_string(&record) {
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not JSON", record.display()))?;
        let n = |k: &str| v[k].as_u64().unwrap_or(0);
        r.console().say(&format!(
                "pipeline: async: the rollout side's work when its rounds stopped is lost: {} groups in flight ({} sequences, {} of them partial) and {} finished groups waiting ({} sequences); rounds start afresh at {}",
                n("in_flight_groups"),
                n("in_flight_sequences"),
                n("partial_sequences"),
                n("waiting_groups"),
                n("waiting_sequences"),
                step_name(first)
            ));
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(())
}

/// `take`: step `step`'s groups from the queue, through the staleness bound (and dynamic
/// sampling's filter when `[algorithm] filter-groups` is on), into its rollout file; the
/// step's `async` metrics.
pub(super) fn take<R: Steps>(r: &mut R, shared: &Shared, step: u64) -> Result<()> {
    let plan = r.plan();
    let want = plan.spec.data.prompts_per_step as usize;
    let k = plan.placement().and_then(|p| p.max_staleness).unwrap_or(1);
    let trained = resolve_model(&plan.run.policy())?.policy_version;
    // The training side's idle time: its waits for groups (not the scoring passes), with the
    // rollout group's restarts.
    let mut train_idle_s = 0.0;
    let mut next = |r: &mut R| {
        let t0 = Instant::now();
        let g = restart::next_group(r, shared, step);
        train_idle_s += t0.elapsed().as_secs_f64();
        g
    };
    let (kept, a, filtered) = match r.plan().spec.filter_groups() {
        None => {
            let (kept, a) = select(&mut || next(r), want, trained, k)?;
            let out = r.plan().run.batch(step, "rollout");
            write_taken(&out, step, &kept, (trained, k))?;
            (kept.len(), a, None)
        }
        Some(fg) => {
            let f = take_varied(r, &mut next, step, &fg, (trained, k))?;
            (f.kept, f.admission, Some(f.dropped))
        }
    };
    let plan = r.plan();
    let mut m = a.metrics();
    let (q_depth, record, cursor) = {
        let mut q = shared.lock();
        let o = m.as_object_mut().expect("an object");
        o.insert("async/train_idle_s".into(), json!(train_idle_s));
        o.insert("async/rollout_idle_s".into(), json!(q.rollout_idle_s));
        o.insert("async/queue_depth".into(), json!(q.ready.len()));
        o.insert("async/in_flight_groups".into(), json!(q.in_flight_groups));
        o.insert("async/partial_sequences".into(), json!(q.partial_rows));
        o.insert("async/rounds".into(), json!(q.rounds));
        o.insert("async/new_tokens".into(), json!(q.new_tokens));
        o.insert("async/trained_version".into(), json!(trained));
        o.insert("async/rollout_restarts".into(), json!(q.restarts));
        o.insert("async/restart_sequences".into(), json!(q.restart_rows));
        o.insert("async/tool_calls".into(), json!(q.tool_calls));
        o.insert("async/tool_errors".into(), json!(q.tool_errors));
        o.insert("async/tool_seconds".into(), json!(q.tool_s));
        (q.rollout_idle_s, q.rounds, q.new_tokens) = (0.0, 0, 0);
        (q.tool_calls, q.tool_errors, q.tool_s) = (0, 0, 0.0);
        (q.restarts, q.restart_rows) = (0, 0);
        let n = plan.stages.rollout.args.n;
        (q.ready.len(), write_record(plan, &q, n), q.cursor)
    };
    record?;
    write_json(&plan.run.stage_metrics(step, "async"), &m)?;
    r.state().sampler = cursor;
    let filter = match filtered {
        Some(d) => format!(", {d} with no spread in their filter-metric"),
        None => String::new(),
    };
    r.console().detail(&format!(
            "{}: took {kept} groups (waited {train_idle_s:.2}s), dropped {} over max-staleness = {k}{filter}; {q_depth} finished groups wait",
            step_name(step),
            a.dropped_groups
        ));
    Ok(())
}

/// What dynamic sampling in `take` did.
struct Filtered {
    /// Groups trained on, and groups scored and dropped for their equal metric.
    kept: usize,
    dropped: usize,
    /// The staleness bound over every group looked at.
    admission: Admission,
}

/// `take` with dynamic sampling: passes of admitted groups, each written to
/// `step-000K/round-R/rollout.parquet` and scored there, until `prompts-per-step` groups have
/// a spread in `filter-metric` (`dynamic`'s rule); a pass takes only the groups still missing,
/// so every group scored is kept or dropped. At `max-num-gen-batches` × `prompts-per-step`
/// groups scored, `on-cap` applies. Writes the step's rollout and scored files and its
/// `sampling` metrics.
fn take_varied<R: Steps>(
    r: &mut R,
    next: &mut dyn FnMut(&mut R) -> Result<Ready>,
    step: u64,
    fg: &FilterGroups,
    (trained, k): (u64, u64),
) -> Result<Filtered> {
    let want = r.plan().spec.data.prompts_per_step as usize;
    // A take rerun after the runner died scores afresh: the passes it left go first.
    for pass in 1.. {
        let files = round_files(&r.plan().run, step, pass);
        let dir = files.rollout.parent().expect("a pass has a folder");
        if !dir.exists() {
            break;
        }
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let cap = (fg.max_rounds > 0).then(|| fg.max_rounds as usize * want);
    let (mut rounds, mut admitted, mut stale) = (Vec::new(), Vec::new(), Vec::new());
    let mut varied = 0;
    loop {
        let need = (want - varied).min(cap.map_or(usize::MAX, |c| c - admitted.len()));
        if need == 0 {
            break;
        }
        let (got, old) = pull(&mut || next(r), need, trained, k)?;
        stale.extend(old);
        let files = round_files(&r.plan().run, step, rounds.len() as u64 + 1);
        write_taken(&files.rollout, step, &got, (trained, k))?;
        let [_, score] = r.plan().sample_tasks(step, &files, 0);
        let Action::Stage { bin, args } = &score.action else {
            unreachable!("scoring is a stage command");
        };
        let t0 = Instant::now();
        r.run_command(step, "score", bin, args)?;
        let secs = t0.elapsed().as_secs_f64();
        *r.state()
            .progress(step)
            .seconds
            .entry("score".into())
            .or_default() += secs;
        let round = Round::read(files, fg)?;
        varied += round.keep.iter().filter(|&&k| k).count();
        admitted.extend(got.into_iter().zip(round.keep.clone()));
        rounds.push(round);
    }
    let scored = admitted.len();
    let capped = varied < want;
    if capped {
        let what = format!(
            "{}: dynamic sampling kept {varied} of {want} groups out of {scored} scored (every other group had the same {} for all its samples; [algorithm] max-num-gen-batches = {} allows {} × prompts-per-step scored groups a step)",
            step_name(step),
            fg.metric.name(),
            fg.max_rounds,
            fg.max_rounds
        );
        dynamic::cap_reached(r.console(), fg, &what, varied)?;
    }
    let oldest = admitted
        .iter()
        .filter(|(_, keep)| *keep)
        .flat_map(|(g, _)| g.versions.iter().flatten())
        .min()
        .copied();
    let plan = r.plan();
    let taken = dynamic::assemble(&plan.run, step, &rounds, (want, oldest), fg)?;
    let m = json!({
        "groups": taken,
        "groups_dropped": scored - varied,
        "groups_scored": scored,
        "score_passes": rounds.len(),
        "capped": u8::from(capped),
    });
    write_json(&plan.run.stage_metrics(step, "sampling"), &m)?;
    let looked: Vec<&Ready> = admitted.iter().map(|(g, _)| g).chain(&stale).collect();
    let (groups, versions) = rows_of(&looked);
    Ok(Filtered {
        kept: taken,
        dropped: scored - varied,
        admission: admit(&groups, &versions, trained, k)?,
    })
}

/// The first `want` groups from `next` that the staleness bound admits for training policy
/// version `trained` under `k` (the others are dropped), and the admission of every group
/// looked at (for the metrics).
fn select(
    next: &mut dyn FnMut() -> Result<Ready>,
    want: usize,
    trained: u64,
    k: u64,
) -> Result<(Vec<Ready>, Admission)> {
    let (kept, dropped) = pull(next, want, trained, k)?;
    let all: Vec<&Ready> = kept.iter().chain(&dropped).collect();
    let (groups, versions) = rows_of(&all);
    let a = admit(&groups, &versions, trained, k)?;
    Ok((kept, a))
}

/// The first `want` groups from `next` that the staleness bound admits, and those it dropped
/// on the way.
fn pull(
    next: &mut dyn FnMut() -> Result<Ready>,
    want: usize,
    trained: u64,
    k: u64,
) -> Result<(Vec<Ready>, Vec<Ready>)> {
    let (mut kept, mut dropped) = (vec![], vec![]);
    while kept.len() < want {
        let g = next()?;
        let (groups, versions) = rows_of(&[&g]);
        match admit(&groups, &versions, trained, k)?.dropped_groups {
            0 => kept.push(g),
            _ => dropped.push(g),
        }
    }
    Ok((kept, dropped))
}

/// Holds the rounds back and waits for the one running to end; a failed round's error.
fn pause(shared: &Shared) -> Result<()> {
    let mut q = shared.lock();
    q.paused = true;
    loop {
        if let Some(e) = q.error.take() {
            return Err(e);
        }
        if !q.running || q.stop {
            return Ok(());
        }
        q = shared.wait(q);
    }
}

/// The next finished group (waiting for one); a failed round's error; None when a round's
/// command failed (`restart::next_group` sees to it).
fn wait_for_group(shared: &Shared) -> Result<Option<Ready>> {
    let mut q = shared.lock();
    loop {
        if let Some(e) = q.error.take() {
            return Err(e);
        }
        if q.failed.is_some() {
            return Ok(None);
        }
        if let Some(g) = q.ready.pop_front() {
            drop(q);
            shared.cv.notify_all();
            return Ok(Some(g));
        }
        anyhow::ensure!(!q.stop, "the rollout rounds stopped");
        q = shared.wait(q);
    }
}

/// The groups' rows as `admit` takes them: each row's group id and versions.
fn rows_of<'a>(groups: &[&'a Ready]) -> (Vec<&'a str>, Vec<&'a [u64]>) {
    groups
        .iter()
        .flat_map(|g| g.versions.iter().map(|v| (g.puid.as_str(), v.as_slice())))
        .unzip()
}

/// Writes a rollout file of step `step` from the `kept` groups: `policy_version` is their
/// oldest token's version.
fn write_taken(out: &Path, step: u64, kept: &[Ready], (trained, k): (u64, u64)) -> Result<()> {
    let first = kept.first().expect("at least one group");
    let parts: Vec<RecordBatch> = kept.iter().map(|g| g.rows.clone()).collect();
    let schema = first.rows.schema();
    for g in kept {
        anyhow::ensure!(
            g.rows.schema().fields() == schema.fields(),
            "group {}: its columns differ from group {}'s",
            g.puid,
            first.puid
        );
    }
    let data = arrow_select::concat::concat_batches(&schema, &parts)?;
    let oldest = kept
        .iter()
        .flat_map(|g| g.versions.iter().flatten())
        .min()
        .copied()
        .unwrap_or(trained);
    let info = StageInfo {
        stage: "async",
        params: json!({
            "groups": kept.len(),
            "trained_version": trained,
            "max_staleness": k,
        }),
        policy_version: Some(oldest),
        step: Some(step),
    };
    let kv = stage_meta(first.meta.clone(), &info);
    debug_assert_eq!(kv.get(meta::POLICY_VERSION), Some(&oldest.to_string()));
    write_file(out, &data, &kv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::StringArray;

    fn group(puid: &str, versions: &[&[u64]]) -> Ready {
        let rows = RecordBatch::try_from_iter([(
            "uid",
            Arc::new(StringArray::from(vec![puid; versions.len()])) as arrow_array::ArrayRef,
        )])
        .unwrap();
        Ready {
            puid: puid.into(),
            rows,
            meta: BTreeMap::new(),
            versions: versions.iter().map(|v| v.to_vec()).collect(),
        }
    }

    /// Training version 4 under K = 1: groups are taken in order until 2 are admitted; "b"
    /// (a row from version 2) is dropped whole and counted; "d" is not looked at.
    #[test]
    fn select_takes_groups_in_order_and_drops_the_stale() {
        let mut queue: VecDeque<Ready> = [
            group("a", &[&[3, 4], &[4]]),
            group("b", &[&[2, 3, 4], &[4]]),
            group("c", &[&[3, 3], &[3]]),
            group("d", &[&[4]]),
        ]
        .into();
        let mut next = || queue.pop_front().ok_or_else(|| anyhow::anyhow!("empty"));
        let (kept, a) = select(&mut next, 2, 4, 1).unwrap();
        let names: Vec<&str> = kept.iter().map(|g| g.puid.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!((a.dropped_groups, a.dropped_rows, a.mixed_rows), (1, 2, 2));
        assert_eq!(a.lags, BTreeMap::from([(0, 2), (1, 3), (2, 1)]));
        assert_eq!(queue.len(), 1, "d waits for the next step");
        // Too few admissible groups: the wait's error comes through.
        let mut empty = || -> Result<Ready> { anyhow::bail!("the rollout rounds stopped") };
        let e = select(&mut empty, 1, 4, 1).unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
        // A token newer than the trained policy is an error.
        let mut future = vec![group("e", &[&[5]])].into_iter();
        let e = select(&mut || Ok(future.next().unwrap()), 1, 4, 1).unwrap_err();
        assert!(e.to_string().contains("newer than the policy"), "{e}");
    }

    /// A round's finished rows split into their groups (contiguous prompt_uids), each with its
    /// rows and versions.
    #[test]
    fn finished_rows_split_into_groups() {
        use crate::batch::list_array;
        use arrow_array::types::Int32Type;
        let data = RecordBatch::try_from_iter([
            (
                schema::PROMPT_UID,
                Arc::new(StringArray::from(vec!["x", "x", "y", "z", "z"])) as arrow_array::ArrayRef,
            ),
            (
                schema::TOKEN_POLICY_VERSION,
                list_array::<Int32Type>(&[0, 1, 3, 4, 4, 6], vec![1, 1, 2, 3, 2, 2]),
            ),
        ])
        .unwrap();
        let b = Batch {
            path: "f.parquet".into(),
            data,
            meta: BTreeMap::from([("k".to_string(), "v".to_string())]),
        };
        let groups = split_groups(&b).unwrap();
        let got: Vec<(&str, usize, Vec<Vec<u64>>)> = groups
            .iter()
            .map(|g| (g.puid.as_str(), g.rows.num_rows(), g.versions.clone()))
            .collect();
        assert_eq!(
            got,
            [
                ("x", 2, vec![vec![1], vec![1, 2]]),
                ("y", 1, vec![vec![3]]),
                ("z", 2, vec![vec![], vec![2, 2]]),
            ]
        );
        assert!(groups.iter().all(|g| g.meta["k"] == "v"));
    }
}
