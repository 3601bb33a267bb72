//! What the daemon keeps between jobs: the policy decoder (compute weights, f32 masters, AdamW
//! state; the policy store's `crate::engine::policy::kept`), PPO's critic in a slot of the same
//! kind (`values` scores with it, `update --critic` trains it), and the reference decoder, on
//! one backend, with each job's memory phases and metrics. It is the stages' `Exec` inside the
//! daemon: a stage asks for the model its `--model` names, and the daemon uses the one it holds
//! when that is the same checkpoint (same directory, same files), and loads it otherwise.
//!
//! Identical results to in-process mode follow from holding exactly the state a reload would
//! give: after `update` the decoder holds the f32 masters, moments and step that the stage
//! writes next to the model (f32, exactly), and the schedule position it writes.
//!
//! With `update --resident` nothing is written but a resident directory (config, tokenizer,
//! `resident.json`): the policy then exists only here, and the directory names it as long as
//! this daemon holds that state. `daemon-ctl save` writes it as the files `update` would have
//! ([`Hold::held_policy`]).
//!
//! A LoRA policy (a LoRA update's, or an adapter checkpoint's) is held as its adapters on the
//! frozen base (`Decoder::with_lora`: the base in the compute dtype with no master or moments,
//! the adapters' f32 masters and AdamW state kept between updates). It generates from a merged
//! copy built after each update on the device with the loaders' merge (`kept::lora_generation`:
//! a second whole copy of the weights while rollout runs; the base that trains is never
//! merged), so its rollouts are bit for bit those of the checkpoint loaded in process; a
//! reference job on its base's files scores with that base, the adapters off
//! (`Resident::score_base`), instead of loading the weights a second time.
//!
//! In a daemon group (one daemon per GPU) every rank keeps its part of the sharded training
//! state between updates ([`Resident::train_group`]): under zero2 the whole compute weights,
//! which the weight sync leaves on every rank, and its 1/N of the masters and moments; under
//! `--shard full` its 1/N of the compute weights too, plus a whole copy of the compute weights
//! for generation that each update drops before training and builds again after (all-gathered
//! from the ranks' shards). An update that writes a checkpoint gathers the state to rank 0,
//! which writes the files as `update` under a launcher does; `--resident` writes nothing but
//! the marked directory.

mod bridge;

use super::protocol::{Reply, Response};
use crate::backend::{Backend, DType, MemoryStats};
use crate::engine::policy::is_adapter_dir;
use crate::engine::policy::kept::PolicySlot;
use crate::engine::policy::kept::{lora_generation, park_optimizer, train_resident, unpark};
use crate::engine::policy::kept::{MakeComm, ModelKey};
use crate::engine::policy::{
    write_rank_shards, HeldPolicy, Holder, ModelRef, SavedShards, Sharding, Train, Trainable,
    Trained,
};
use crate::engine::resume::TrainerState;
use crate::engine::shard::{ShardMode, ShardedOptim};
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::{Decoder, OptimizerState, TokenStats};
use crate::model::lora::{LoraMode, LoraSpec};
use crate::model::peft;
use crate::model::{Config, Weights};
use crate::parallel::ProcessGroup;
use crate::stage::common::Device;
use crate::stage::ref_logprob::{LogprobColumn, Score, Scored};
use crate::stage::rollout::{Generate, Generated};
use crate::stage::{Compute, Console, Hold, Topology};
use anyhow::Result;
use bridge::KeptBridge;
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Env var of the restart test: when set to a path that does not exist yet, the daemon creates
/// it and kills itself with SIGKILL in the middle of its next `update` (after training, before
/// the checkpoint is written), as a crashed GPU process would; a daemon group's rank kills
/// itself before its part of the training, so that the other ranks' parts fail with it.
pub const KILL_IN_UPDATE_ENV: &str = "TANDEM_DAEMON_KILL_IN_UPDATE";
/// With [`KILL_IN_UPDATE_ENV`]: only in the update that makes this many update calls of the run
/// (the `schedule_step` it saves), i.e. training step N of a pipeline.
pub const KILL_AT_STEP_ENV: &str = "TANDEM_DAEMON_KILL_AT_STEP";
/// Env var of the daemon-group fault test: like [`KILL_IN_UPDATE_ENV`], in a `rollout` job
/// after this rank generated its share (before rank 0 writes anything); with
/// [`KILL_AT_STEP_ENV`] only in the rollout of training step N (the policy of version N - 1),
/// and with [`KILL_RANK_ENV`] only on that rank.
pub(crate) const KILL_IN_ROLLOUT_ENV: &str = "TANDEM_DAEMON_KILL_IN_ROLLOUT";
/// The rank (`RANK`, as the launcher sets it) that [`KILL_IN_ROLLOUT_ENV`] kills, and in a
/// daemon group [`KILL_IN_UPDATE_ENV`] too.
pub(crate) const KILL_RANK_ENV: &str = "TANDEM_DAEMON_KILL_RANK";

/// Env var of the kept-bridge test: a rank that holds a kept bridge drops it when the next
/// transfer starts, once (see [`fault_once`]), as if it broke between `daemon-ctl`'s status and
/// the transfer.
pub(crate) const BREAK_BRIDGE_ENV: &str = "TANDEM_DAEMON_BREAK_BRIDGE";

/// True the first time `when` holds while the marker file `marker_env` names does not exist
/// yet (it is created then, so that a test's fault happens once).
fn fault_once(marker_env: &str, when: bool) -> bool {
    let Some(marker) = std::env::var_os(marker_env).map(PathBuf::from) else {
        return false;
    };
    when && !marker.exists() && std::fs::write(&marker, b"done\n").is_ok()
}

/// SIGKILLs this process once when `when` holds (`fault_once`): the restart tests' crash.
fn kill_once(marker_env: &str, when: bool) {
    if fault_once(marker_env, when) {
        // SAFETY: kill(2) of this very process; nothing after it runs.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok())
}

/// Flags of `tandem daemon` that shape what stays in device memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Keep the AdamW moments in host memory between updates.
    pub offload_optimizer: bool,
    /// Keep the reference weights in host memory; build the reference decoder for each
    /// ref-logprob job and drop it after.
    pub offload_ref: bool,
}

struct RefSlot<B: Backend> {
    key: ModelKey,
    cfg: Config,
    /// Resident decoder, or None with `--offload-ref` (then `host` holds the weights).
    decoder: Option<Decoder<B>>,
    host: Option<Weights>,
}

/// Which trained model a slot holds: the policy, or PPO's critic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Policy,
    Critic,
}

impl Role {
    fn of(job: &Train<'_>) -> Role {
        match job.train.critic {
            Some(_) => Role::Critic,
            None => Role::Policy,
        }
    }
}

/// What a job needs of the policy slot: the policy as its files give it (to generate or
/// score with), a full policy to train every weight, or LoRA adapters (with their spec and
/// `update --seed`, which draws fresh ones) on a frozen base.
#[derive(Clone, Copy, Debug)]
enum Want<'a> {
    Any,
    Full,
    Lora(&'a LoraSpec, u64),
}

impl<'a> Want<'a> {
    fn of(job: &'a Train<'_>) -> Want<'a> {
        match (&job.train.critic, &job.train.lora) {
            (Some(_), _) => Want::Any,
            (None, Some(spec)) => Want::Lora(spec, job.train.seed),
            (None, None) => Want::Full,
        }
    }

    /// Whether the policy held in `p` serves the job: its adapters (None: none) are those
    /// asked, and fresh ones were drawn with the update's seed.
    fn served_by<B: Backend>(self, p: &PolicySlot<B>) -> bool {
        let lora = p.decoder.lora_spec();
        match self {
            Want::Any => true,
            Want::Full => lora.is_none(),
            Want::Lora(spec, seed) => {
                lora == Some(spec) && p.fresh_seed.is_none_or(|fresh| fresh == seed)
            }
        }
    }
}

/// Peak and end-of-phase device memory of one kind of job.
#[derive(Clone, Copy, Debug, Default)]
struct Phase {
    runs: u64,
    peak_in_use: usize,
    last_peak_in_use: usize,
    held_after: usize,
    in_use_after: usize,
}

/// The daemon's models and per-job bookkeeping.
pub struct Resident<B: Backend> {
    make: Box<dyn Fn() -> Result<B>>,
    /// In a daemon group: the communicator of a sharded update (None: a lone daemon).
    make_comm: Option<MakeComm<B>>,
    /// The communicator of a weight transfer between groups (`[placement]`), on any daemon.
    make_bridge: Option<MakeComm<B>>,
    /// The last weight transfer's bridge, kept for the next one (dropped by a failed one).
    bridge: Option<KeptBridge<B>>,
    pub device: Device,
    /// The socket the daemon serves (named in resident directories).
    socket: Option<PathBuf>,
    opts: Options,
    policy: Option<PolicySlot<B>>,
    /// PPO's critic (a value model), kept as the policy is: `values` scores with it and
    /// `update --critic` trains it.
    critic: Option<PolicySlot<B>>,
    /// The slot the running job trained: the one its `Hold::saved` names.
    trained: Role,
    reference: Option<RefSlot<B>>,
    /// The version `sync-weights` last published (0 until then).
    pub policy_version: u64,
    phases: BTreeMap<&'static str, Phase>,
    /// Where log and progress lines of the running job go.
    reply: Option<Reply>,
    /// Progress bars of the running job, polled by the server's ticker.
    pub bars: Arc<Mutex<Vec<(String, ProgressBar)>>>,
    /// The running job's metrics for its `done` line.
    job: Map<String, Value>,
    /// How a LoRA policy generates: the last rollout's `--lora-mode` (merged until one asks).
    lora_mode: LoraMode,
}

impl<B: Backend> Resident<B> {
    pub fn new(make: Box<dyn Fn() -> Result<B>>, device: Device, opts: Options) -> Self {
        Resident {
            make,
            make_comm: None,
            make_bridge: None,
            bridge: None,
            device,
            socket: None,
            opts,
            policy: None,
            critic: None,
            trained: Role::Policy,
            reference: None,
            policy_version: 0,
            phases: BTreeMap::new(),
            reply: None,
            bars: Arc::new(Mutex::new(Vec::new())),
            job: Map::new(),
            lora_mode: LoraMode::Merged,
        }
    }

    /// A rank of a daemon group: its updates keep their optimizer shards, made over
    /// communicators from `make_comm`.
    pub(crate) fn set_comm_maker(&mut self, make_comm: MakeComm<B>) {
        self.make_comm = Some(make_comm);
    }

    /// How the daemon makes the communicator of a weight transfer (every daemon can be an end
    /// of one).
    pub(crate) fn set_bridge_maker(&mut self, make: MakeComm<B>) {
        self.make_bridge = Some(make);
    }

    /// The socket the daemon listens on, named in the resident directories it writes.
    pub(crate) fn set_socket(&mut self, socket: &Path) {
        self.socket = Some(socket.to_path_buf());
    }

    /// Loads the policy at startup (`--policy`, a directory or a pointer file); with `lora`
    /// (a LoRA run's spec and its first update's seed) as adapters on the frozen base, so that
    /// no f32 master or optimizer state of the base is ever allocated.
    pub(crate) fn preload_policy(
        &mut self,
        model: &ModelRef,
        lora: Option<(&LoraSpec, u64)>,
    ) -> Result<()> {
        let want = match lora {
            Some((spec, seed)) => Want::Lora(spec, seed),
            None => Want::Any,
        };
        self.slot(Role::Policy, model, want)?;
        self.policy_version = model.policy_version;
        Ok(())
    }

    /// Loads the reference at startup (`--ref`), unless it is the base a LoRA policy held
    /// here trains on (its reference jobs score with that base, [`Resident::score_base`]).
    pub(crate) fn preload_ref(&mut self, dir: &Path) -> Result<()> {
        if self.holds_lora_base(dir) {
            return Ok(());
        }
        self.ref_decoder(dir).map(|_| ())
    }

    fn backends(&self) -> Vec<&B> {
        let mut backends: Vec<&B> = Vec::new();
        for p in [&self.policy, &self.critic].into_iter().flatten() {
            backends.push(p.decoder.backend());
            if let Some(g) = &p.gen {
                backends.push(g.backend());
            }
        }
        if let Some(d) = self.reference.as_ref().and_then(|r| r.decoder.as_ref()) {
            backends.push(d.backend());
        }
        backends
    }

    /// Device memory of every decoder held (all zero on the CPU backend). `peak_in_use` sums
    /// the backends' peaks since the phase began: exact when one of them moves in a phase (the
    /// others hold their resident weights), an upper bound otherwise.
    pub fn memory(&self) -> MemoryStats {
        let mut m = MemoryStats::default();
        for b in self.backends() {
            let s = b.memory_stats();
            m.held += s.held;
            m.in_use += s.in_use;
            m.peak_in_use += s.peak_in_use;
        }
        m
    }

    /// Starts a job of kind `phase`: its output lines go to `reply` (to stderr without one).
    pub(crate) fn begin(&mut self, phase: &'static str, reply: Option<Reply>) {
        self.reply = reply;
        self.job = Map::new();
        self.job.insert("phase".into(), phase.into());
        self.job.insert("reloaded".into(), false.into());
        self.job.insert("load_seconds".into(), 0.0.into());
        for b in self.backends() {
            b.reset_peak_memory();
        }
        let m = self.memory();
        self.job
            .insert("memory_in_use_before".into(), m.in_use.into());
        self.job
            .insert("phase_peak_in_use".into(), m.peak_in_use.into());
        self.bars.lock().expect("bars").clear();
    }

    /// Folds the current peak into the phase's (before a backend of the phase is dropped).
    fn observe(&mut self) {
        let now = self.memory().peak_in_use as u64;
        let seen = self
            .job
            .get("phase_peak_in_use")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        self.job
            .insert("phase_peak_in_use".into(), now.max(seen).into());
    }

    /// Ends the running job (ok or not) and returns its metrics. A failed job may have left
    /// the policy half-trained: it is then forgotten and reloaded from files on the next job.
    pub fn end(&mut self, phase: &'static str, ok: bool) -> Value {
        self.observe();
        if !ok && phase == "transfer" {
            // This rank's part may have gone through where another's failed: every rank of
            // the group drops the bridge, so the next transfer meets on a new one.
            self.bridge = None;
        }
        if !ok {
            for slot in [&mut self.policy, &mut self.critic] {
                if slot.as_ref().is_some_and(|p| p.keys.is_empty()) {
                    *slot = None;
                }
            }
        }
        let m = self.memory();
        let peak = self
            .job
            .get("phase_peak_in_use")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        let ph = self.phases.entry(phase).or_default();
        ph.runs += 1;
        ph.last_peak_in_use = peak;
        ph.peak_in_use = ph.peak_in_use.max(ph.last_peak_in_use);
        ph.held_after = m.held;
        ph.in_use_after = m.in_use;
        self.job
            .insert("memory_in_use_after".into(), m.in_use.into());
        self.job.insert("memory_held_after".into(), m.held.into());
        self.job
            .insert("policy_version".into(), self.policy_version.into());
        if let Some(c) = &self.critic {
            self.job
                .insert("critic_memory_held".into(), slot_memory_held(c).into());
        }
        self.job
            .insert("device".into(), self.device.to_string().into());
        self.reply = None;
        self.bars.lock().expect("bars").clear();
        Value::Object(std::mem::take(&mut self.job))
    }

    /// What `status` reports about the models and memory.
    pub fn status(&self) -> Value {
        let phases: Map<String, Value> = self
            .phases
            .iter()
            .map(|(k, p)| {
                (
                    k.to_string(),
                    json!({
                        "runs": p.runs,
                        "peak_in_use": p.peak_in_use,
                        "last_peak_in_use": p.last_peak_in_use,
                        "held_after": p.held_after,
                        "in_use_after": p.in_use_after,
                    }),
                )
            })
            .collect();
        let m = self.memory();
        json!({
            "device": self.device.to_string(),
            "policy_version": self.policy_version,
            "policy": self.policy.as_ref().map(slot_status),
            "critic": self.critic.as_ref().map(slot_status),
            "reference": self.reference.as_ref().map(|r| json!({
                "dir": r.key.dir.display().to_string(),
                "offloaded": r.decoder.is_none(),
            })),
            "memory": {"held": m.held, "in_use": m.in_use, "peak_in_use": m.peak_in_use},
            "phases": phases,
            "bridge": self.bridge.as_ref().map(KeptBridge::status),
            "options": {
                "offload_optimizer": self.opts.offload_optimizer,
                "offload_ref": self.opts.offload_ref,
            },
        })
    }

    /// The slot of `role`.
    fn slot_of(&mut self, role: Role) -> &mut Option<PolicySlot<B>> {
        match role {
            Role::Policy => &mut self.policy,
            Role::Critic => &mut self.critic,
        }
    }

    fn send(&self, r: &Response) {
        match (&self.reply, r) {
            (Some(reply), _) => reply.send(r),
            (None, Response::Log { line }) => eprintln!("{line}"),
            (None, _) => {}
        }
    }

    fn note(&mut self, key: &str, v: impl Into<Value>) {
        self.job.insert(key.into(), v.into());
    }

    /// The policy `model` names (loaded if need be), or the one held: what `daemon-ctl save`
    /// writes.
    fn held_slot(&mut self, model: Option<&ModelRef>) -> Result<&mut PolicySlot<B>> {
        match model {
            Some(m) => self.slot(Role::Policy, m, Want::Any),
            None => match self.policy.as_mut() {
                Some(p) => Ok(p),
                None => crate::bail_input!("the daemon holds no policy"),
            },
        }
    }

    /// The slot of `role` for `model`, loading it when the daemon holds another checkpoint (or
    /// a state newer than any file) there, or one that does not serve `want` (a LoRA update on
    /// a policy held without its adapters). The critic loads as `update --critic` does: a
    /// policy's model becomes a critic with a zero value head.
    fn slot(&mut self, role: Role, model: &ModelRef, want: Want) -> Result<&mut PolicySlot<B>> {
        let key = ModelKey::of(&model.dir)?;
        let held = self
            .slot_of(role)
            .as_ref()
            .is_some_and(|p| p.keys.contains(&key) && want.served_by(p));
        if !held && key.resident() {
            let marker = ModelDir::resident(&model.dir)?.expect("resident key");
            crate::bail_input!(
                "{}: its weights were kept in memory by update --resident (step {}, resident.json), and this daemon does not hold them (it was restarted, or the policy was trained or loaded past them); continue from a checkpoint written as files",
                model.dir.display(),
                marker.step
            );
        }
        if !held {
            // Free the old model before loading the new one: peak memory is one of them.
            self.observe();
            *self.slot_of(role) = None;
            let started = Instant::now();
            let reply = self.reply.clone();
            let mut log = |m: &str| log_to(&reply, m);
            // A group's rank reads its optimizer shard at its first update; a lone daemon holds
            // the whole state (a sharded checkpoint's put back together from its files). A
            // LoRA checkpoint (or a model a LoRA update starts on) loads as its adapters on the
            // frozen base (not merged: the next update trains them), whose state is one file
            // that a group's ranks cut their shards from at their first update.
            let group = self.make_comm.is_some();
            let lora = match role {
                Role::Policy => lora_wanted(want, &model.dir)?,
                Role::Critic => None,
            };
            let fresh_seed = match &lora {
                Some((_, seed)) if !is_adapter_dir(&model.dir) => Some(*seed),
                _ => None,
            };
            let loaded = match (role, group, lora) {
                (_, _, Some((spec, seed))) => Trainable::load_lora(&model.dir, &spec, seed)?,
                (Role::Critic, true, _) => Trainable::load_critic_weights(&model.dir, &mut log)?,
                (Role::Policy, true, _) => Trainable::load_weights(&model.dir, &mut log)?,
                (role, false, None) => {
                    let mut t = match role {
                        Role::Critic => Trainable::load_critic(&model.dir, &mut log)?,
                        Role::Policy => Trainable::load(&model.dir, &mut log)?,
                    };
                    if let Some(tr) = t.trainer.as_mut() {
                        tr.optimizer_shards = 0;
                    }
                    t
                }
            };
            let decoder = loaded.build((self.make)()?)?;
            self.note("reloaded", true);
            self.note("load_seconds", started.elapsed().as_secs_f64());
            let mut slot = PolicySlot {
                keys: vec![key],
                files: model.dir.clone(),
                trainer: loaded.trainer.clone(),
                decoder,
                schedule_step: loaded.schedule_step,
                from_master: loaded.from_master,
                gen: None,
                parked: None,
                sharded: None,
                comm: None,
                lora_base: loaded.lora.as_ref().map(|l| l.base.clone()),
                lora_base_key: match &loaded.lora {
                    Some(l) => Some(ModelKey::of(&l.base)?),
                    None => None,
                },
                fresh_seed,
            };
            if self.opts.offload_optimizer {
                park_optimizer(&mut slot, None, None)?;
            }
            *self.slot_of(role) = Some(slot);
        }
        Ok(self.slot_of(role).as_mut().expect("set above"))
    }

    /// The decoder that generates (and scores) with the policy `model`: the training decoder
    /// itself, whose compute weights are the bf16 rounding of the masters, exactly the weights
    /// a rollout loads from the checkpoint files. Only on a backend that computes in f32 are
    /// the compute weights the unrounded masters; there a bf16-rounded copy is built once per
    /// policy (the CPU oracle path, where memory is not the constraint). A group rank under
    /// `--shard full` holds 1/N of the compute weights: it generates with the whole copy its
    /// last update built ([`Resident::train_group`]). A LoRA policy generates from a merged
    /// copy, or under `--lora-mode unmerged` from the training decoder, its adapters applied
    /// at each step.
    fn generation(&mut self, role: Role, model: &ModelRef) -> Result<&mut Decoder<B>> {
        let mode = self.lora_mode;
        let make_copy = {
            let slot = self.slot(role, model, Want::Any)?;
            let lora = slot.decoder.lora_spec().is_some();
            if lora && mode == LoraMode::Unmerged {
                // The training decoder generates, its adapters applied at each step: no copy
                // (a merged one from an earlier rollout is dropped).
                slot.gen = None;
            } else if slot.gen.is_none() && gen_built_by_group(slot) {
                // Every such update builds it (train_group); only a failed one has not, and
                // that one forgot the policy.
                anyhow::bail!(
                    "the daemon group's policy is sharded (--shard full, or LoRA adapters) and has no generation copy"
                );
            }
            let f32_master =
                slot.from_master && slot.decoder.backend().compute_dtype() == DType::F32;
            slot.gen.is_none()
                && match lora {
                    true => mode == LoraMode::Merged,
                    false => f32_master,
                }
        };
        if make_copy {
            let started = Instant::now();
            let backend = (self.make)()?;
            let slot = self.slot_of(role).as_mut().expect("loaded above");
            slot.gen = Some(match slot.decoder.lora_spec() {
                Some(_) => lora_generation(slot, backend)?,
                None => {
                    let w = slot.decoder.export_weights()?;
                    let cfg = slot.decoder.config().clone();
                    Decoder::for_generation(backend, &cfg, w)?
                }
            });
            self.note("generation_copy_seconds", started.elapsed().as_secs_f64());
        }
        let slot = self.slot_of(role).as_mut().expect("loaded above");
        Ok(match &mut slot.gen {
            Some(g) => g,
            None => &mut slot.decoder,
        })
    }

    /// The reference decoder for `dir` (built from host weights with `--offload-ref`).
    fn ref_decoder(&mut self, dir: &Path) -> Result<&mut Decoder<B>> {
        let key = ModelKey::of(dir)?;
        if self.reference.as_ref().map(|r| &r.key) != Some(&key) {
            self.observe();
            self.reference = None;
            let started = Instant::now();
            let (cfg, weights) = ModelDir::load(dir)?;
            let (decoder, host) = if self.opts.offload_ref {
                (None, Some(weights))
            } else {
                (Some(Decoder::new((self.make)()?, &cfg, &weights)?), None)
            };
            self.reference = Some(RefSlot {
                key,
                cfg,
                decoder,
                host,
            });
            self.note("reloaded", true);
            self.note("load_seconds", started.elapsed().as_secs_f64());
        }
        let r = self.reference.as_mut().expect("set above");
        if r.decoder.is_none() {
            let started = Instant::now();
            let host = r
                .host
                .as_ref()
                .expect("offloaded reference keeps host weights");
            r.decoder = Some(Decoder::new((self.make)()?, &r.cfg, host)?);
            self.job.insert(
                "ref_upload_seconds".into(),
                started.elapsed().as_secs_f64().into(),
            );
        }
        Ok(r.decoder.as_mut().expect("set above"))
    }

    /// Frees what the next phase does not need and returns cached memory to the driver.
    fn trim(&mut self) -> Result<()> {
        for p in [&mut self.policy, &mut self.critic].into_iter().flatten() {
            p.decoder.release_workspace()?;
            if let Some(g) = &mut p.gen {
                g.release_workspace()?;
            }
            p.decoder.backend().trim()?;
        }
        if let Some(r) = &mut self.reference {
            if let Some(d) = &mut r.decoder {
                d.release_workspace()?;
                d.backend().trim()?;
            }
        }
        Ok(())
    }

    /// Refuses a job whose `--device` is not the daemon's.
    pub(crate) fn check_device(&self, asked: Device) -> Result<()> {
        if asked != self.device {
            crate::bail_input!(
                "--device {asked}: the daemon runs on {}; pass --device {} (or drop --daemon to compute in this process)",
                self.device,
                self.device
            );
        }
        Ok(())
    }

    /// The update phase (no generation copy of the policy or the critic, no idle reference on
    /// the device, no cached free blocks) with the model `model` loaded in the slot of `role`;
    /// returns the seconds its load took. The other model's copy stays under `--shard full`:
    /// only its own update can build it again (every rank gathers it).
    fn update_phase(&mut self, role: Role, model: &ModelRef, want: Want) -> Result<f64> {
        self.observe();
        for r in [Role::Policy, Role::Critic] {
            if let Some(p) = self.slot_of(r) {
                if r == role || !gen_built_by_group(p) {
                    p.gen = None;
                }
            }
        }
        if self.opts.offload_ref {
            if let Some(r) = &mut self.reference {
                r.decoder = None;
            }
        }
        self.trim()?;
        self.slot(role, model, want)?;
        Ok(self
            .job
            .get("load_seconds")
            .and_then(Value::as_f64)
            .unwrap_or(0.0))
    }

    /// This rank's part of a daemon group's sharded update (every rank runs it, on the ranks
    /// of `pg`): the policy this rank holds trains with the optimizer shards it keeps (cut
    /// from the loaded state at the first update: zero2's masters and moments, or under
    /// `--shard full` the compute weights too), so no file is read; rank 0 gets the gathered
    /// state when the job writes a checkpoint. Under `--shard full` the rank then builds the
    /// whole decoder that generates until the next update ([`Resident::generation`]).
    pub(crate) fn train_group(
        &mut self,
        pg: &ProcessGroup,
        model: &ModelRef,
        job: Train<'_>,
        sharding: Sharding,
    ) -> Result<Trained> {
        // Every rank of a group has the maker (server.rs), and only a group runs this.
        let make_comm = self.make_comm.clone().expect("a daemon group's rank");
        let full = sharding.mode == ShardMode::Full;
        let role = Role::of(&job);
        let load_s = self.update_phase(role, model, Want::of(&job))?;
        self.trained = role;
        let reply = self.reply.clone();
        let make = &self.make;
        let slot = match role {
            Role::Policy => self.policy.as_mut(),
            Role::Critic => self.critic.as_mut(),
        }
        .expect("loaded above");
        // Before this rank's part: the others then fail in their collectives with it, where
        // after it they could finish the job first.
        kill_once(
            KILL_IN_UPDATE_ENV,
            env_u64(KILL_AT_STEP_ENV).is_none_or(|s| s == slot.schedule_step + 1)
                && env_u64(KILL_RANK_ENV).is_none_or(|r| Some(r) == env_u64("RANK")),
        );
        let fresh = slot.comm.is_none();
        let mut copy_s = None;
        let trained = train_resident(slot, pg, &make_comm, model, job, sharding, &mut |m| {
            log_to(&reply, m)
        })
        .and_then(|out| {
            if gen_built_by_group(slot) {
                // Built here, where every rank runs the job, rather than at the first
                // rollout or score: a rank with no rows of those does not reach the
                // policy, and sync-weights runs on rank 0 alone. Training's workspace and
                // gradients are gone by now; the copy lives with the shards until the next
                // update drops it (update_phase).
                let started = Instant::now();
                let held = slot.sharded.as_ref().expect("kept by the update");
                let comm = slot.comm.as_deref().expect("made by the update");
                let backend = make()?;
                slot.gen = Some(match full {
                    true => held.gather_generation(&slot.decoder, comm, backend)?,
                    // The adapters' f32 masters, whole on every rank, merged into a copy
                    // of the base as a lone daemon merges them (`lora_generation`).
                    false => {
                        let adapters = held.gather_masters_everywhere(&slot.decoder, comm)?;
                        slot.decoder.lora_generation(backend, &adapters)?
                    }
                });
                copy_s = Some(started.elapsed().as_secs_f64());
            }
            Ok(out)
        });
        if trained.is_err() {
            slot.comm = None;
        }
        let mut out = trained?;
        out.lora_base = slot.lora_base.clone();
        if let Some(secs) = copy_s {
            self.note("generation_copy_seconds", secs);
        }
        self.note("new_communicator", fresh);
        out.load_seconds = load_s;
        Ok(out)
    }
}

impl<B: Backend> Resident<B> {
    /// This rank's part of `daemon-ctl save` on a daemon group (every rank runs it, on the
    /// ranks of `pg`): when the policy held keeps its optimizer in shards (zero2 resident
    /// updates), rank 0 gathers the f32 masters and every rank writes its shard into `staging`,
    /// as a checkpointing update does. None when it keeps none (rank 0 then saves it alone).
    pub(crate) fn save_group(
        &mut self,
        pg: &ProcessGroup,
        model: Option<&ModelRef>,
        staging: &Path,
    ) -> Result<Option<SavedShards>> {
        let Some(make_comm) = self.make_comm.clone() else {
            return Ok(None);
        };
        let slot = self.held_slot(model)?;
        if slot.sharded.is_none() {
            return Ok(None);
        }
        let Some(trainer) = slot.trainer.clone() else {
            anyhow::bail!("the daemon group's sharded policy has no trainer state");
        };
        let optim = slot.sharded.take().expect("checked above");
        // LoRA adapters' state (small) is gathered whole to rank 0: one optimizer file.
        let lora = match (slot.decoder.lora_spec(), &slot.lora_base) {
            (Some(spec), Some(base)) => Some((spec.clone(), base.clone())),
            _ => None,
        };
        type Saved = (Option<(Weights, Option<OptimizerState>)>, Vec<PathBuf>);
        let saved = (|| -> Result<Saved> {
            if slot.comm.is_none() {
                slot.comm = Some(make_comm(slot.decoder.backend(), pg)?);
            }
            let comm = slot.comm.as_deref().expect("made above");
            let whole = lora.is_some();
            let masters = optim.gather_state(&slot.decoder, comm, 0, whole)?;
            if whole {
                return Ok((masters, Vec::new()));
            }
            let shard = optim.download(&slot.decoder)?;
            let files = write_rank_shards(slot.decoder.backend(), comm, staging, &shard)?;
            Ok((masters, files))
        })();
        slot.sharded = Some(optim);
        if saved.is_err() {
            slot.comm = None;
        }
        let (gathered, shard_files) = saved?;
        let (masters, state) = match gathered {
            Some((w, s)) => (Some(w), s),
            None => (None, None),
        };
        Ok(Some(SavedShards {
            files: slot.files.clone(),
            masters,
            shard_files,
            trainer,
            lora,
            state,
        }))
    }
}

impl<B: Backend> Resident<B> {
    /// Whether `dir` holds the base a LoRA policy held here trains on (the same files): a
    /// reference job on it scores with that base, the adapters off ([`Resident::score_base`]).
    fn holds_lora_base(&self, dir: &Path) -> bool {
        let Ok(key) = ModelKey::of(dir) else {
            return false;
        };
        self.policy
            .as_ref()
            .is_some_and(|p| p.lora_base_key.as_ref() == Some(&key))
    }

    /// Scores with the LoRA policy's base, the adapters off; a reference decoder of the same
    /// files is dropped (no second copy of the weights).
    fn score_base(&mut self, job: Score<'_>) -> Result<Vec<TokenStats>> {
        let p = self.policy.as_mut().expect("holds_lora_base");
        let key = p.lora_base_key.clone();
        if self.reference.as_ref().map(|r| &r.key) == key.as_ref() {
            self.observe();
            self.reference = None;
        }
        let p = self.policy.as_mut().expect("holds_lora_base");
        p.decoder.set_adapters_on(false);
        let out = job.score_on(&mut p.decoder);
        p.decoder.set_adapters_on(true);
        self.note("reference_is_lora_base", true);
        out
    }
}

impl<B: Backend> Compute for Resident<B> {
    fn generate(&mut self, model: &ModelRef, job: Generate<'_>) -> Result<Generated> {
        self.lora_mode = job.lora_mode;
        let decoder = self.generation(Role::Policy, model)?;
        let mut out = job.generate_on(decoder)?;
        kill_once(
            KILL_IN_ROLLOUT_ENV,
            env_u64(KILL_AT_STEP_ENV).is_none_or(|s| s == model.policy_version + 1)
                && env_u64(KILL_RANK_ENV).is_none_or(|r| Some(r) == env_u64("RANK")),
        );
        out.load_s = self
            .job
            .get("load_seconds")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        Ok(out)
    }

    fn score(&mut self, model: &ModelRef, job: Score<'_>) -> Result<Vec<TokenStats>> {
        if job.scored() == Scored::Values {
            return job.score_on(self.generation(Role::Critic, model)?);
        }
        let is_policy = job.scored() == Scored::Logprobs(LogprobColumn::OldLogprobs)
            || self
                .policy
                .as_ref()
                .is_some_and(|p| ModelKey::of(&model.dir).is_ok_and(|k| p.keys.contains(&k)));
        if is_policy {
            return job.score_on(self.generation(Role::Policy, model)?);
        }
        if self.holds_lora_base(&model.dir) {
            return self.score_base(job);
        }
        let out = job.score_on(self.ref_decoder(&model.dir)?);
        if self.opts.offload_ref {
            self.observe();
            // Drop the device copy; the host weights stay for the next call.
            if let Some(r) = &mut self.reference {
                if let Some(d) = r.decoder.take() {
                    let backend_trim = d.backend().trim();
                    drop(d);
                    backend_trim?;
                }
            }
        }
        out
    }

    fn train(&mut self, model: &ModelRef, job: Train<'_>) -> Result<Trained> {
        let role = Role::of(&job);
        let load_s = self.update_phase(role, model, Want::of(&job))?;
        self.trained = role;
        let reply = self.reply.clone();
        let offload = self.opts.offload_optimizer;
        let slot = self.slot_of(role).as_mut().expect("loaded above");
        // A lone daemon loads a sharded checkpoint's whole state (update_phase).
        anyhow::ensure!(
            slot.trainer
                .as_ref()
                .is_none_or(|t| t.optimizer_shards == 0),
            "{}: the model held has no optimizer state of its sharded checkpoint",
            model.dir.display()
        );
        unpark(slot)?;
        // From here the decoder is ahead of every file until `saved`.
        slot.keys.clear();
        slot.from_master = true;
        slot.fresh_seed = None;
        let step = slot.schedule_step;
        let mut out = job.train_on(&mut slot.decoder, step, &mut |m| log_to(&reply, m))?;
        slot.schedule_step = step + 1;
        slot.decoder.release_workspace()?;
        slot.decoder.release_grads();
        if offload {
            let masters = match slot.decoder.backend().compute_dtype() {
                DType::F32 => None,
                _ => out.weights.clone(),
            };
            park_optimizer(slot, out.state.clone(), masters)?;
        }
        slot.decoder.backend().trim()?;
        kill_once(
            KILL_IN_UPDATE_ENV,
            env_u64(KILL_AT_STEP_ENV).is_none_or(|s| s == slot.schedule_step),
        );
        out.lora_base = slot.lora_base.clone();
        out.load_seconds = load_s;
        Ok(out)
    }
}

impl<B: Backend> Hold for Resident<B> {
    fn saved(&mut self, dir: &Path, trainer: Option<&TrainerState>) -> Result<()> {
        let key = ModelKey::of(dir)?;
        let role = self.trained;
        if let Some(p) = self.slot_of(role) {
            // A directory rewritten in place names this state now, not what it held before.
            p.keys.retain(|k| k.dir != key.dir);
            p.keys.push(key);
            p.files = dir.to_path_buf();
            if let Some(t) = trainer {
                p.trainer = Some(t.clone());
            }
        }
        Ok(())
    }

    fn holder(&self) -> Option<Holder> {
        Some(Holder {
            socket: self.socket.clone(),
            pid: std::process::id(),
        })
    }

    fn held_policy(&mut self, model: Option<&ModelRef>) -> Result<HeldPolicy> {
        let slot = self.held_slot(model)?;
        if slot.sharded.is_some() {
            crate::bail_input!(
                "this daemon group's ranks hold the policy's optimizer state in shards (1/N each): every rank saves its own (`tandem daemon-ctl save` to the group's socket), not rank 0 alone"
            );
        }
        // Offloaded state is the host copy; otherwise it comes back from the device. A LoRA
        // policy's weights are its adapters (the base stays where it is).
        let lora = slot.decoder.lora_spec().is_some();
        let export = |d: &Decoder<B>| match lora {
            true => d.export_adapters(),
            false => d.export_weights(),
        };
        let (weights, state) = match &slot.parked {
            Some(p) => (
                match &p.masters {
                    Some(m) => m.clone(),
                    None => export(&slot.decoder)?,
                },
                p.state.clone(),
            ),
            None => (export(&slot.decoder)?, slot.decoder.optimizer_state()?),
        };
        let has_state = !state.exp_avg.is_empty();
        let lora = match (slot.decoder.lora_spec(), &slot.lora_base) {
            (Some(spec), Some(base)) => Some((spec.clone(), base.clone())),
            _ => None,
        };
        Ok(HeldPolicy {
            files: slot.files.clone(),
            weights,
            state: has_state.then_some(state),
            trainer: slot.trainer.clone(),
            lora,
        })
    }

    fn publish(&mut self, dir: &Path, policy_version: u64) -> Result<()> {
        let started = Instant::now();
        let before = self.memory();
        let model = ModelRef {
            dir: dir.to_path_buf(),
            policy_version,
            pointer: None,
        };
        // The trained decoder becomes the generation weights in place (a copy only where the
        // backend computes in f32, see `generation`); cached prefixes of the old policy go.
        self.generation(Role::Policy, &model)?;
        self.policy_version = policy_version;
        let after = self.memory();
        self.note("sync_seconds", started.elapsed().as_secs_f64());
        self.note(
            "sync_extra_memory",
            after.in_use.saturating_sub(before.in_use),
        );
        self.note("synced_dir", dir.display().to_string());
        Ok(())
    }
}

impl<B: Backend> Console for Resident<B> {
    fn progress_bar(&mut self, len: usize, what: &str) -> ProgressBar {
        let bar = ProgressBar::hidden();
        bar.set_length(len as u64);
        self.bars
            .lock()
            .expect("bars")
            .push((what.to_string(), bar.clone()));
        bar
    }

    fn log(&mut self, line: &str) {
        self.send(&Response::Log { line: line.into() });
    }
}

/// A daemon runs a stage alone; the ranks of a group's job are the server's (`Watched`).
impl<B: Backend> Topology for Resident<B> {}

/// Whether only a group's update (where every rank gathers) builds the slot's generation copy:
/// under `--shard full` (1/N of the compute weights here) and for LoRA adapters whose f32
/// masters are sharded (the copy merges them whole).
fn gen_built_by_group<B: Backend>(p: &PolicySlot<B>) -> bool {
    p.sharded
        .as_ref()
        .is_some_and(|o| o.is_full() || p.decoder.lora_spec().is_some())
}

/// Device memory a policy or critic slot holds (its decoder and its generation copy).
fn slot_memory_held<B: Backend>(p: &PolicySlot<B>) -> usize {
    p.decoder.backend().memory_stats().held
        + p.gen
            .as_ref()
            .map_or(0, |g| g.backend().memory_stats().held)
}

/// What `status` reports of a policy or critic slot.
fn slot_status<B: Backend>(p: &PolicySlot<B>) -> Value {
    json!({
        "dir": p.keys.last().map(|k| k.dir.display().to_string()),
        "dirs": p.keys.iter().map(|k| k.dir.display().to_string()).collect::<Vec<_>>(),
        "in_files": p.keys.iter().any(|k| !k.resident()),
        "schedule_step": p.schedule_step,
        "optimizer_step": p.decoder.optimizer_steps(),
        "generation_copy": p.gen.is_some(),
        "optimizer_offloaded": p.parked.is_some(),
        "optimizer_sharded": p.sharded.is_some(),
        "weights_sharded": p.sharded.as_ref().is_some_and(ShardedOptim::is_full),
        "memory_held": slot_memory_held(p),
        // Elements with f32 masters and AdamW state: a LoRA policy's adapters, not its base.
        "trained_elems": p.decoder.trained_sizes().iter().sum::<usize>(),
        "lora": p.decoder.lora_spec().map(|l| json!({
            "rank": l.rank,
            "alpha": l.alpha,
            "targets": l.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
            "base": p.lora_base.as_ref().map(|b| b.display().to_string()),
        })),
    })
}

/// Sends a log line of the running job to its client (to stderr without one).
fn log_to(reply: &Option<Reply>, line: &str) {
    match reply {
        Some(r) => r.send(&Response::Log { line: line.into() }),
        None => eprintln!("{line}"),
    }
}

/// The adapters a lone daemon loads the policy `dir` with: a LoRA update's (its spec and seed),
/// or, to generate or score, an adapter directory's own (its spec; the seed unused); None for
/// a full policy.
fn lora_wanted(want: Want, dir: &Path) -> Result<Option<(LoraSpec, u64)>> {
    Ok(match want {
        Want::Lora(spec, seed) => Some((spec.clone(), seed)),
        Want::Full => None,
        Want::Any => match is_adapter_dir(dir) {
            true => Some((peft::read_config(dir)?.0, 0)),
            false => None,
        },
    })
}
