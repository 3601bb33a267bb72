//! One update call on a policy: trained in place (held by the caller, or loaded from its
//! files for the call, on one process or on the ranks of a launch), with what the job asks
//! brought back to be written (the weights, the optimizer state, the ranks' shard files).

use super::load::Trainable;
use super::pointer::ModelRef;
use super::shards::write_own_shard;
use crate::backend::Backend;
use crate::engine::shard::{ShardMode, ShardedOptim, ShardedPolicy, StateTo};
use crate::engine::train::{train, TrainConfig, TrainData, TrainReport};
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::Weights;
use crate::parallel::{run_rank_job, Comm, DeviceKind, ProcessGroup, RankJob};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What one update call trains on.
pub struct Train<'a> {
    pub data: &'a TrainData<'a>,
    pub train: &'a TrainConfig,
    /// Bring the weights back to the host (they are written as the new model).
    pub export_weights: bool,
    /// Bring the optimizer state back to the host (it is written next to the model).
    pub export_state: bool,
}

/// The trained policy as the stage writes it.
pub struct Trained {
    pub report: TrainReport,
    /// The f32 (master) weights, when the job asked for them.
    pub weights: Option<Weights>,
    /// The optimizer state, when the job asked for it.
    pub state: Option<OptimizerState>,
    /// AdamW steps taken so far.
    pub optimizer_step: u64,
    /// Training steps done before this call.
    pub schedule_step: u64,
    pub load_seconds: f64,
    /// The ranks' optimizer shard files (data-parallel, N > 1), staged beside the output
    /// directory: the writer moves them into it.
    pub shard_files: Vec<PathBuf>,
    /// LoRA: the base model the adapters were trained on (the caller that loaded the policy
    /// knows it; `--model` may be a resident directory that names no base).
    pub lora_base: Option<PathBuf>,
}

impl Train<'_> {
    /// Trains `policy` (whose schedule position is `schedule_step`) in place and brings back the
    /// new weights and optimizer state.
    pub(crate) fn train_on<B: Backend>(
        self,
        policy: &mut Decoder<B>,
        schedule_step: u64,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trained> {
        let report = train(policy, self.data, self.train, schedule_step, &mut |msg| {
            log(&format!("update: {msg}"))
        })?;
        self.finish(policy, report, schedule_step)
    }

    /// One rank's part of a sharded update on a policy whose optimizer shards stay with the
    /// caller (a daemon group's rank keeps them between calls): trains, and when the job
    /// writes a checkpoint, rank 0 gets the masters for the model files and every rank writes
    /// its optimizer shard into `staging`, as `update` under a launcher does. Every rank of
    /// `policy.comm` calls it.
    pub(crate) fn train_sharded_on<B: Backend>(
        self,
        policy: &mut ShardedPolicy<'_, B>,
        schedule_step: u64,
        staging: &Path,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trained> {
        let mut log = |msg: &str| log(&format!("update: {msg}"));
        let (report, weights, state, shard_files) = match self.export_weights || self.export_state {
            true => {
                let to = self.state_to(policy.comm.world_size());
                let mut out =
                    policy.train_to_host(self.data, self.train, schedule_step, &mut log, 0, to)?;
                let files =
                    write_own_shard(&mut out, policy.decoder.backend(), policy.comm, staging)?;
                (out.report, out.weights, out.state, files)
            }
            false => {
                let mut report =
                    train(&mut *policy, self.data, self.train, schedule_step, &mut log)?;
                report.shard = Some(policy.optim.stats.clone());
                (report, None, None, Vec::new())
            }
        };
        Ok(Trained {
            report,
            weights: weights.filter(|_| self.export_weights),
            state: state.filter(|_| self.export_state),
            optimizer_step: policy.decoder.optimizer_steps(),
            schedule_step,
            load_seconds: 0.0,
            shard_files,
            lora_base: None,
        })
    }

    /// Where a sharded update over `world` ranks brings the optimizer state: nowhere unless the
    /// job exports it; to the one rank's host, or each rank's shard to its own host. A LoRA
    /// update's state (the adapters': a few percent of the model's) is gathered to rank 0,
    /// so that its checkpoint is the one-process run's `optimizer.safetensors`.
    fn state_to(&self, world: usize) -> StateTo {
        match (self.export_state, world, &self.train.lora) {
            (false, _, _) => StateTo::Nowhere,
            (true, 1, _) | (true, _, Some(_)) => StateTo::Root,
            (true, _, None) => StateTo::EachRank,
        }
    }

    /// What `policy` holds after training, as the stage writes it.
    fn finish<B: Backend>(
        self,
        policy: &Decoder<B>,
        report: TrainReport,
        schedule_step: u64,
    ) -> Result<Trained> {
        Ok(Trained {
            report,
            // A LoRA policy's files are its adapters (the base stays where it is).
            weights: match (self.export_weights, policy.lora_spec()) {
                (true, None) => Some(policy.export_weights()?),
                (true, Some(_)) => Some(policy.export_adapters()?),
                (false, _) => None,
            },
            state: match self.export_state {
                true => Some(policy.optimizer_state()?),
                false => None,
            },
            optimizer_step: policy.optimizer_steps(),
            schedule_step,
            load_seconds: 0.0,
            shard_files: Vec::new(),
            lora_base: None,
        })
    }
}

/// One rank of a data-parallel update (under `tandem launch`): builds the loaded policy on
/// the rank's backend and trains it with the sharded optimizer over the rank's communicator.
/// Rank 0 brings the weights back to host memory (it writes the model). With N > 1 ranks each
/// rank writes its own optimizer shard into `staging` (no rank gathers the state), and all
/// wait for all before rank 0 moves the files into the new checkpoint; with one rank the
/// whole state comes to its host (an ordinary `optimizer.safetensors`).
struct TrainRank<'a> {
    loaded: Trainable,
    job: Train<'a>,
    mode: ShardMode,
    bucket_elems: usize,
    staging: PathBuf,
}

impl RankJob for TrainRank<'_> {
    type Out = Trained;
    fn run<B: Backend>(self, backend: B, comm: Box<dyn Comm<B>>) -> Result<Trained> {
        let comm = comm.as_ref();
        let rank = comm.rank();
        let (mut policy, mut optim) = match self.mode {
            ShardMode::Zero2 => {
                let mut policy = self.loaded.build(backend)?;
                let optim = ShardedOptim::zero2(&mut policy, comm, self.bucket_elems)?;
                (policy, optim)
            }
            ShardMode::Full if self.loaded.lora.is_some() => {
                anyhow::bail!("--shard full with LoRA adapters (the stage refuses it)")
            }
            // The state is never whole on a device: each rank uploads its shards.
            ShardMode::Full => ShardedOptim::new_full(
                backend,
                &self.loaded.cfg,
                &self.loaded.weights,
                self.loaded.optimizer.as_ref(),
                comm,
            )?,
        };
        if let Some(source) = &self.loaded.shard {
            let shard = source.for_layout(&optim.layout(&policy), rank)?;
            let took = optim.load(&mut policy, &shard, &self.loaded.weights, comm)?;
            if !took && rank == 0 {
                eprintln!("update: the f32 master shards do not match the model files; continuing from the bf16 weights");
            }
        }
        let step = self.loaded.schedule_step;
        drop(self.loaded);
        let mut sharded = ShardedPolicy {
            decoder: &mut policy,
            comm,
            optim,
        };
        let log = &mut |msg: &str| {
            if rank == 0 {
                eprintln!("{msg}")
            }
        };
        self.job
            .train_sharded_on(&mut sharded, step, &self.staging, log)
    }
}

/// How the ranks of a data-parallel update shard the training state (`--shard`,
/// `--bucket-elems`) and where they compute (`--device`).
#[derive(Clone, Debug)]
pub struct Sharding {
    pub mode: ShardMode,
    pub bucket_elems: usize,
    /// Where the ranks compute (`--device`).
    pub device: DeviceKind,
    /// Where the ranks write their optimizer shards before rank 0 moves them into the
    /// checkpoint ([`super::shard_staging`] of the output directory).
    pub staging: PathBuf,
}

/// One rank's part of a data-parallel update whose policy is loaded from the model files for
/// this call on every rank (the ranks of `pg`); rank 0 gets the new weights and state to
/// write. What `update` under a launcher runs.
pub fn train_ranks_from_files(
    pg: &ProcessGroup,
    model: &ModelRef,
    job: Train<'_>,
    sharding: Sharding,
) -> Result<Trained> {
    let started = Instant::now();
    let mut log = |m: &str| {
        if pg.rank() == 0 {
            eprintln!("{m}")
        }
    };
    let (rank, world) = (pg.rank(), pg.world_size());
    let loaded = Trainable::for_update(&model.dir, job.train, Some((rank, world)), &mut log)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let rank_job = TrainRank {
        loaded,
        job,
        mode: sharding.mode,
        bucket_elems: sharding.bucket_elems,
        staging: sharding.staging,
    };
    let mut out = run_rank_job(sharding.device, pg, rank_job)?;
    out.load_seconds = load_seconds;
    Ok(out)
}
