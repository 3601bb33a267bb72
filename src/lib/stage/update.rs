//! `update --model DIR --in B --out-model DIR2`: policy-gradient (or SFT) training on one batch
//! with verl's knobs; writes the new model (HF layout, bf16) with its optimizer state and
//! trainer state next to it, so the next `update --model DIR2` resumes exactly.
//!
//! On the warm daemon, `--resident` keeps the new weights and optimizer state in the daemon's
//! memory instead: DIR2 then holds the config, the tokenizer and `resident.json` (the daemon's
//! socket, the step), which only that daemon serves; `tandem daemon-ctl save` writes the files
//! ([`save_policy`]) as this stage would have.
//!
//! Rollout correction (verl's `rollout_corr`): the mismatch between the rollout's and the
//! trainer's log-probs is measured on every call that has rollout_logprobs (`mismatch` in the
//! metrics); `--rollout-is` truncates and `--rollout-rs` masks by the importance weight
//! exp(old − rollout); `--bypass-mode` takes the rollout's log-probs as the old ones.

use super::common::{
    above, after_rank0, at_least, between, check_token_ids, finite, logprob_temperature,
    negative_numbers, range, require_tokenizer, resolve_model, same_path, Device, ModelRef,
    DEFAULT_TEMPERATURE,
};
use super::ref_logprob::to_u32;
use super::{Exec, Job};
use crate::algo::agg::{AggMode, AGG_MODE_NAMES};
use crate::algo::kl::KlPenalty;
use crate::algo::policy_loss::{KlLoss, LossConfig, LossMode, RolloutIs, RolloutIsLevel};
use crate::algo::rollout_corr::{Mismatch, RolloutRs, RsLevel};
use crate::backend::Backend;
use crate::bail_input;
use crate::batch::{schema, schema::meta, write_json, Batch, Ragged};
use crate::engine::logprob::PromptResponse;
use crate::engine::resume::{
    self, RankResume, ShardSource, TrainerState, OPTIMIZER_FILE, TRAINER_STATE_FILE,
};
use crate::engine::shard::{HostShard, ShardedOptim};
use crate::engine::shard::{ShardMode, ShardedPolicy, StateTo, ToHost, DEFAULT_BUCKET_ELEMS};
use crate::engine::train::{train, LrConfig, LrSchedule, TrainConfig, TrainData, TrainReport};
use crate::error::input_error;
use crate::model::checkpoint::{ModelDir, ResidentMarker, SaveOptions};
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::safetensors::DEFAULT_MAX_SHARD_BYTES;
use crate::model::{Config, Weights};
use crate::parallel::comm::sum_f64;
use crate::parallel::{run_rank_job, Comm, DeviceKind, ProcessGroup, RankJob};
use anyhow::Result;
use clap::builder::PossibleValuesParser;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[command(
    about = "Train the policy on one batch (PPO/GRPO-style losses or SFT)",
    mut_args = negative_numbers
)]
pub struct UpdateArgs {
    /// Model directory (HF layout) or a pointer file written by sync-weights. Optimizer state
    /// found next to it (optimizer.safetensors, trainer_state.json) is resumed.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Batch with prompt_ids, response_ids, response_mask, advantages (old_logprobs,
    /// ref_logprobs, rollout_logprobs as the options need).
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write the updated model, with the tokenizer and chat template files of --model
    /// (may equal --model's directory).
    #[arg(long, value_name = "DIR")]
    pub out_model: PathBuf,
    /// Policy loss (verl's policy_loss.loss_mode).
    #[arg(long, default_value = "vanilla")]
    #[serde(with = "crate::stage::common::as_text")]
    pub loss: LossMode,
    /// PPO clip range ε, >= 0: ratios outside [1 − ε, 1 + ε] are clipped (both sides unless
    /// --clip-ratio-low/-high are given).
    #[arg(long, default_value_t = 0.2, value_parser = at_least(0.0f64))]
    pub clip_ratio: f64,
    /// Lower clip range ε_low, >= 0: ratios below 1 − ε_low are clipped (default: the
    /// --clip-ratio value).
    #[arg(long, value_parser = at_least(0.0f64))]
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range ε_high, >= 0: ratios above 1 + ε_high are clipped, DAPO's clip-higher
    /// (default: the --clip-ratio value).
    #[arg(long, value_parser = at_least(0.0f64))]
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages, > 1.
    #[arg(long, default_value_t = 3.0, value_parser = above(1.0f64))]
    pub clip_ratio_c: f64,
    /// How per-token losses become one number (verl's loss_agg_mode).
    #[arg(long, default_value = "token-mean", value_parser = agg_mode())]
    #[serde(with = "crate::stage::common::as_text")]
    pub loss_agg_mode: AggMode,
    /// Divisor of seq-mean-token-sum-norm, > 0 (default: the longest response of the
    /// mini-batch).
    #[arg(long, value_parser = above(0.0f64))]
    pub loss_scale_factor: Option<f64>,
    /// Entropy bonus: loss −= coeff · agg(entropy); any finite number.
    #[arg(long, default_value_t = 0.0, value_parser = finite::<f64>())]
    pub entropy_coeff: f64,
    /// Add coef · KL(policy ‖ ref) to the loss (needs ref_logprobs).
    #[arg(long)]
    pub use_kl_loss: bool,
    /// Coefficient of the KL loss, >= 0 (with --use-kl-loss).
    #[arg(long, default_value_t = 0.001, value_parser = at_least(0.0f64))]
    pub kl_loss_coef: f64,
    /// KL estimator: k1 (kl), abs, k2 (mse), k3 (low_var_kl), optionally with '+'.
    #[arg(long, default_value = "k3")]
    #[serde(with = "crate::stage::common::as_text")]
    pub kl_loss_type: KlPenalty,
    /// Truncated importance weights exp(old − rollout), per token or per sequence (needs
    /// rollout_logprobs).
    #[arg(long, value_name = "token|sequence")]
    #[serde(with = "crate::stage::common::rollout_is_level")]
    pub rollout_is: Option<RolloutIsLevel>,
    /// Truncation of the --rollout-is weights, > 0.
    #[arg(long, default_value_t = 2.0, value_parser = above(0.0f64))]
    pub rollout_is_threshold: f64,
    /// Masked importance sampling (MIS, verl's rollout_rs): drop from the loss every token
    /// (token) or whole sequence (sequence: the product of its ratios; geometric: their
    /// geometric mean) whose weight exp(old − rollout) is outside [--rollout-rs-threshold-lower,
    /// --rollout-rs-threshold] (needs old_logprobs and rollout_logprobs).
    #[arg(long, value_enum)]
    #[serde(default)]
    pub rollout_rs: Option<RsLevel>,
    /// Upper bound of the MIS weights, > 0 (default: --rollout-is-threshold).
    #[arg(long, value_parser = above(0.0f64))]
    #[serde(default)]
    pub rollout_rs_threshold: Option<f64>,
    /// Lower bound of the MIS weights, > 0 (default: 1 / the upper bound).
    #[arg(long, value_parser = above(0.0f64))]
    #[serde(default)]
    pub rollout_rs_threshold_lower: Option<f64>,
    /// verl's bypass_mode: the rollout's log-probs are the old ones (no old_logprobs column,
    /// no old-logprob pass). Only for a batch whose rollout ran batch-invariant (metadata
    /// tandem.old_logprobs = rollout) with the very policy --model names (same
    /// policy_version); anything else is refused.
    #[arg(long)]
    #[serde(default)]
    pub bypass_mode: bool,
    /// Passes over the batch (>= 1).
    #[arg(long, default_value_t = 1, value_parser = at_least(1usize))]
    pub ppo_epochs: usize,
    /// Sequences per optimizer step, >= 1 (default: the whole batch, one step per epoch).
    #[arg(long, value_parser = at_least(1usize))]
    pub mini_batch_size: Option<usize>,
    /// Tokens (prompt + response) per forward/backward pass, >= 1; gradients accumulate.
    #[arg(long, default_value_t = 8192, value_parser = at_least(1usize))]
    pub micro_batch_tokens: usize,
    /// Logits are divided by this, > 0 (default: the temperature `rollout` recorded in the
    /// batch, else 1); one that differs from the recorded one is refused.
    #[arg(long, value_name = "T", value_parser = above(0.0f32))]
    pub temperature: Option<f32>,
    /// Peak learning rate of AdamW, >= 0.
    #[arg(long, default_value_t = 1e-6, value_parser = at_least(0.0f64))]
    pub lr: f64,
    /// Training steps (update calls) of linear warmup from 0 to --lr.
    #[arg(long, default_value_t = 0, value_parser = at_least(0u64))]
    pub lr_warmup_steps: u64,
    /// Learning-rate schedule after the warmup: constant (--lr), or cosine down to
    /// --min-lr-ratio · --lr at --total-steps.
    #[arg(long, default_value = "constant", value_parser = lr_schedule())]
    pub lr_schedule: LrSchedule,
    /// Horizon of the cosine schedule, in training steps (update calls), >= 1.
    #[arg(long, value_parser = at_least(1u64))]
    pub total_steps: Option<u64>,
    /// Cosine floor as a fraction of --lr, in [0, 1].
    #[arg(long, default_value_t = 0.0, value_parser = between(0.0f64, 1.0))]
    pub min_lr_ratio: f64,
    /// AdamW decoupled weight decay, >= 0.
    #[arg(long, default_value_t = 0.01, value_parser = at_least(0.0f32))]
    pub weight_decay: f32,
    /// Clip the global gradient norm to this, >= 0 (0 = no clipping).
    #[arg(long, default_value_t = 1.0, value_parser = at_least(0.0f32))]
    pub grad_clip: f32,
    /// AdamW β1,β2: two numbers in [0, 1), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.999", value_name = "B1,B2", value_parser = range(Bound::Included(0.0f32), Bound::Excluded(1.0)))]
    pub betas: Vec<f32>,
    /// AdamW ε, > 0.
    #[arg(long, default_value_t = 1e-8, value_parser = above(0.0f32))]
    pub adam_eps: f32,
    /// Shuffle the rows before splitting them into mini-batches.
    #[arg(long)]
    pub shuffle: bool,
    /// Seed of the shuffle (and of anything random in training).
    #[arg(long, default_value_t = 0, value_parser = at_least(0u64))]
    pub seed: u64,
    /// Write the metrics JSON here.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// Where to compute: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Send the job to the warm daemon listening on this socket instead of loading the model
    /// here (default: $TANDEM_DAEMON).
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
    /// Write the weights and trainer state but not optimizer.safetensors (the f32 masters and
    /// Adam moments, ~12 bytes per parameter): for the warm daemon, which keeps them in memory
    /// between checkpoints (verl's save_freq). Only that daemon can continue from such a
    /// checkpoint; `update` elsewhere refuses it.
    #[arg(long)]
    #[serde(default)]
    pub skip_optimizer_state: bool,
    /// With --daemon: keep the new weights and optimizer state in the daemon's memory only;
    /// --out-model gets the config, the tokenizer and resident.json (which daemon, which step)
    /// instead of weight files. Only that daemon can use it; `tandem daemon-ctl save` writes
    /// the files. The pipeline runner passes it between [checkpoint] steps.
    #[arg(long)]
    #[serde(default)]
    pub resident: bool,
    /// Under `tandem launch`: elements per bucket of the data-parallel trainer's gradient
    /// reduce-scatter and weight sync (>= 1; default 26214400, 100 MB of f32).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    #[serde(default)]
    pub bucket_elems: Option<usize>,
    /// Under `tandem launch`: what the data-parallel trainer shards: zero2 (the optimizer
    /// state and gradients; default) or full (FSDP / ZeRO-3: the compute weights too, each
    /// unit gathered before its forward and its backward; for a model whose training state
    /// does not fit one device).
    #[arg(long, value_name = "MODE", value_parser = shard_mode())]
    #[serde(default)]
    pub shard: Option<ShardMode>,
}

/// `--shard`: its names listed to clap.
fn shard_mode() -> impl clap::builder::TypedValueParser<Value = ShardMode> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(ShardMode::NAMES)
        .map(|s| s.parse::<ShardMode>().expect("a listed name"))
}

/// `--loss-agg-mode`: its names listed to clap (help, errors, completions).
fn agg_mode() -> impl clap::builder::TypedValueParser<Value = AggMode> {
    use clap::builder::TypedValueParser;
    let names: Vec<&'static str> = AGG_MODE_NAMES.split(", ").collect();
    PossibleValuesParser::new(names).map(|s| s.parse::<AggMode>().expect("a listed name"))
}

/// `--lr-schedule`: constant or cosine, listed to clap.
fn lr_schedule() -> impl clap::builder::TypedValueParser<Value = LrSchedule> {
    use clap::builder::TypedValueParser;
    PossibleValuesParser::new(["constant", "cosine"])
        .map(|s| s.parse::<LrSchedule>().expect("a listed name"))
}

/// A policy as `update` starts from it: the f32 master weights when they sit next to the model
/// (else the model's weights), the optimizer state and the schedule position.
pub struct Trainable {
    pub cfg: Config,
    pub weights: Weights,
    /// Whether `weights` are the saved f32 masters rather than the model files' weights.
    pub from_master: bool,
    pub optimizer: Option<OptimizerState>,
    /// Training steps (update calls) done before this one.
    pub schedule_step: u64,
    /// The trainer state found next to the model.
    pub trainer: Option<TrainerState>,
    /// Where this rank's optimizer shard comes from (a data-parallel update resuming a sharded
    /// checkpoint; `weights` are then the model files' and `optimizer` is None).
    pub shard: Option<ShardSource>,
}

impl Trainable {
    /// Reads a model directory and the optimizer state next to it.
    pub fn load(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        let (cfg, weights) = ModelDir::load(dir)?;
        let Some(r) = resume::load(dir, &weights)? else {
            return Ok(Self::without_optimizer(cfg, weights, None, None));
        };
        Ok(Self::resumed(dir, cfg, weights, r, log))
    }

    /// The model files' weights with no optimizer state here: a fresh optimizer, or (with
    /// `trainer`) a sharded checkpoint's, whose state is in the ranks' files (`shard`: where
    /// this rank's comes from).
    fn without_optimizer(
        cfg: Config,
        weights: Weights,
        trainer: Option<TrainerState>,
        shard: Option<ShardSource>,
    ) -> Trainable {
        Trainable {
            cfg,
            weights,
            from_master: false,
            optimizer: None,
            schedule_step: trainer.as_ref().map_or(0, |t| t.schedule_step),
            trainer,
            shard,
        }
    }

    /// As [`Trainable::load`] for a process that only generates or scores with the policy (a
    /// daemon of a group, which trains from the files under the ranks): a sharded checkpoint
    /// gives its model files' weights, no optimizer state, and its trainer state (whose
    /// `optimizer_shards` says so) instead of being refused.
    pub fn load_weights(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        match resume::trainer_state(dir)? {
            Some(t) if t.optimizer_shards > 0 => {
                let (cfg, weights) = ModelDir::load(dir)?;
                Ok(Self::without_optimizer(cfg, weights, Some(t), None))
            }
            _ => Self::load(dir, log),
        }
    }

    /// Rank `rank` of `world` reads a model directory and its part of the optimizer state
    /// next to it: a sharded checkpoint's own shard file (written by as many ranks; by
    /// another number, the shard is cut from the files once the layout is known), or the
    /// whole state of an unsharded one.
    pub fn load_rank(
        dir: &Path,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trainable> {
        let (cfg, weights) = ModelDir::load(dir)?;
        Ok(match resume::load_rank(dir, &weights, rank, world)? {
            None => Self::without_optimizer(cfg, weights, None, None),
            Some(RankResume::Whole(r)) => Self::resumed(dir, cfg, weights, r, log),
            Some(RankResume::Shard { source, trainer }) => {
                Self::without_optimizer(cfg, weights, Some(trainer), Some(source))
            }
        })
    }

    fn resumed(
        dir: &Path,
        cfg: Config,
        weights: Weights,
        r: resume::Resume,
        log: &mut dyn FnMut(&str),
    ) -> Trainable {
        if r.master.is_none() {
            log(&format!(
                "update: {}: f32 master weights absent or not matching the model files; continuing from the bf16 weights",
                dir.display()
            ));
        }
        let from_master = r.master.is_some();
        Trainable {
            cfg,
            weights: r.master.unwrap_or(weights),
            from_master,
            optimizer: Some(r.optimizer),
            schedule_step: r.trainer.schedule_step,
            trainer: Some(r.trainer),
            shard: None,
        }
    }

    /// The decoder, with the optimizer state loaded.
    pub fn build<B: Backend>(&self, backend: B) -> Result<Decoder<B>> {
        let mut policy = Decoder::new(backend, &self.cfg, &self.weights)?;
        if let Some(state) = &self.optimizer {
            policy.load_optimizer_state(state)?;
        }
        Ok(policy)
    }
}

/// What one update call trains on.
pub struct Train<'a> {
    data: &'a TrainData<'a>,
    train: &'a TrainConfig,
    /// Bring the weights back to the host (they are written as the new model).
    export_weights: bool,
    /// Bring the optimizer state back to the host (it is written next to the model).
    export_state: bool,
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
}

impl Train<'_> {
    /// Trains `policy` (whose schedule position is `schedule_step`) in place and brings back the
    /// new weights and optimizer state.
    pub fn train_on<B: Backend>(
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
    pub fn train_sharded_on<B: Backend>(
        self,
        policy: &mut ShardedPolicy<'_, B>,
        schedule_step: u64,
        staging: &Path,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trained> {
        let mut log = |msg: &str| log(&format!("update: {msg}"));
        let (report, weights, state, shard_files) = match self.export_weights || self.export_state {
            true => {
                let to = match (self.export_state, policy.comm.world_size()) {
                    (false, _) => StateTo::Nowhere,
                    (true, 1) => StateTo::Root,
                    (true, _) => StateTo::EachRank,
                };
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
        })
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
            weights: match self.export_weights {
                true => Some(policy.export_weights()?),
                false => None,
            },
            state: match self.export_state {
                true => Some(policy.optimizer_state()?),
                false => None,
            },
            optimizer_step: policy.optimizer_steps(),
            schedule_step,
            load_seconds: 0.0,
            shard_files: Vec::new(),
        })
    }
}

/// In-process update: build the loaded policy on the backend and train it.
pub(crate) struct TrainFresh<'a> {
    pub loaded: Trainable,
    pub job: Train<'a>,
}

impl Job for TrainFresh<'_> {
    type Out = Trained;
    fn run<B: Backend>(self, backend: B) -> Result<Trained> {
        let mut policy = self.loaded.build(backend)?;
        let step = self.loaded.schedule_step;
        drop(self.loaded);
        self.job
            .train_on(&mut policy, step, &mut |msg| eprintln!("{msg}"))
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
        let (rank, world) = (comm.rank(), comm.world_size());
        let (mut policy, mut optim) = match self.mode {
            ShardMode::Zero2 => {
                let mut policy = self.loaded.build(backend)?;
                let optim = ShardedOptim::zero2(&mut policy, comm, self.bucket_elems)?;
                (policy, optim)
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
        let state_to = match (self.job.export_state, world) {
            (false, _) => StateTo::Nowhere,
            (true, 1) => StateTo::Root,
            (true, _) => StateTo::EachRank,
        };
        let mut out = sharded.train_to_host(
            self.job.data,
            self.job.train,
            step,
            &mut |msg| {
                if rank == 0 {
                    eprintln!("update: {msg}")
                }
            },
            0,
            state_to,
        )?;
        let shard_files = write_own_shard(&mut out, policy.backend(), comm, &self.staging)?;
        Ok(Trained {
            report: out.report,
            weights: out.weights.filter(|_| self.job.export_weights),
            state: out.state.filter(|_| self.job.export_state),
            optimizer_step: policy.optimizer_steps(),
            schedule_step: step,
            load_seconds: 0.0,
            shard_files,
        })
    }
}

/// How the ranks of a data-parallel update shard the training state (`--shard`,
/// `--bucket-elems`) and where they compute (`--device`).
#[derive(Clone, Debug)]
pub struct Sharding {
    pub mode: ShardMode,
    pub bucket_elems: usize,
    pub device: Device,
    /// Where the ranks write their optimizer shards before rank 0 moves them into the
    /// checkpoint (`shard_staging` of the output directory).
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
    let loaded = Trainable::load_rank(&model.dir, pg.rank(), pg.world_size(), &mut |m| {
        if pg.rank() == 0 {
            eprintln!("{m}")
        }
    })?;
    let load_seconds = started.elapsed().as_secs_f64();
    let device = match sharding.device {
        Device::Cpu => DeviceKind::Cpu,
        Device::Cuda(_) => DeviceKind::Cuda,
    };
    let rank_job = TrainRank {
        loaded,
        job,
        mode: sharding.mode,
        bucket_elems: sharding.bucket_elems,
        staging: sharding.staging,
    };
    let mut out = run_rank_job(device, pg, rank_job)?;
    out.load_seconds = load_seconds;
    Ok(out)
}

impl UpdateArgs {
    /// Checks the flags as the stage does before reading its input.
    pub fn check(&self) -> Result<()> {
        let t = self.temperature.unwrap_or(DEFAULT_TEMPERATURE);
        let cfg = self.train_config(t)?;
        self.rejection()?;
        if self.bypass_mode {
            if !cfg.loss.mode.loss().policy_gradient {
                bail_input!(
                    "--bypass-mode: --loss {} reads no old log-probs",
                    cfg.loss.mode
                );
            }
            if self.rollout_is.is_some() || self.rollout_rs.is_some() {
                bail_input!(
                    "--rollout-is and --rollout-rs weigh by exp(old − rollout), which is 1 under --bypass-mode (the old log-probs are the rollout's): drop them, or drop --bypass-mode"
                );
            }
        }
        Ok(())
    }

    /// Masked importance sampling as the flags configure it.
    pub fn rejection(&self) -> Result<Option<RolloutRs>> {
        let Some(level) = self.rollout_rs else {
            return Ok(None);
        };
        if !self.loss.loss().policy_gradient {
            bail_input!(
                "--rollout-rs masks a policy-gradient loss; --loss {} has none",
                self.loss
            );
        }
        let upper = self
            .rollout_rs_threshold
            .unwrap_or(self.rollout_is_threshold);
        RolloutRs::new(level, upper, self.rollout_rs_threshold_lower).map(Some)
    }

    fn loss_config(&self) -> Result<LossConfig> {
        let mut c = LossConfig::new(self.loss);
        c.clip_ratio = self.clip_ratio;
        c.clip_ratio_low = self.clip_ratio_low;
        c.clip_ratio_high = self.clip_ratio_high;
        c.clip_ratio_c = self.clip_ratio_c;
        c.agg = self.loss_agg_mode;
        c.entropy_coeff = self.entropy_coeff;
        c.kl_loss = self.use_kl_loss.then_some(KlLoss {
            coef: self.kl_loss_coef,
            penalty: self.kl_loss_type,
        });
        c.rollout_is = self.rollout_is.map(|level| RolloutIs {
            level,
            threshold: self.rollout_is_threshold,
        });
        c.validate()?;
        Ok(c)
    }

    /// The training configuration the flags describe, with log-probs at `temperature` (flag
    /// errors are input errors).
    pub fn train_config(&self, temperature: f32) -> Result<TrainConfig> {
        let loss = self.loss_config()?;
        // Each flag's range is checked by its parser; the recorded temperature is checked here.
        if !(temperature > 0.0 && temperature.is_finite()) {
            bail_input!("--temperature must be > 0, got {temperature}");
        }
        if self.betas.len() != 2 {
            bail_input!(
                "--betas takes two numbers in [0, 1), e.g. 0.9,0.999; got {:?}",
                self.betas
            );
        }
        let lr = LrConfig {
            lr: self.lr,
            warmup_steps: self.lr_warmup_steps,
            schedule: self.lr_schedule,
            total_steps: self.total_steps,
            min_lr_ratio: self.min_lr_ratio,
        };
        lr.validate().map_err(|e| input_error(e.to_string()))?;
        Ok(TrainConfig {
            loss,
            loss_scale_factor: self.loss_scale_factor,
            ppo_epochs: self.ppo_epochs,
            mini_batch_size: self.mini_batch_size,
            micro_batch_tokens: self.micro_batch_tokens,
            temperature,
            lr,
            beta1: self.betas[0],
            beta2: self.betas[1],
            eps: self.adam_eps,
            weight_decay: self.weight_decay,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            shuffle: self.shuffle,
            seed: self.seed,
            device_loss: TrainConfig::device_loss_from_env(),
        })
    }
}

/// Columns the options need, with the flag that needs each (for the error message).
fn required_columns(args: &UpdateArgs, cfg: &TrainConfig) -> Vec<(&'static str, &'static str)> {
    let mut cols = vec![
        (schema::PROMPT_IDS, "update"),
        (schema::RESPONSE_IDS, "update"),
        (schema::RESPONSE_MASK, "update"),
    ];
    if cfg.loss.mode != LossMode::Sft {
        cols.push((schema::ADVANTAGES, "--loss (run the advantage stage first)"));
    }
    if cfg.loss.kl_loss.is_some() {
        cols.push((
            schema::REF_LOGPROBS,
            "--use-kl-loss (run ref-logprob --column ref_logprobs first)",
        ));
    }
    if cfg.loss.rollout_is.is_some() {
        cols.push((schema::ROLLOUT_LOGPROBS, "--rollout-is"));
    }
    if args.rollout_rs.is_some() {
        cols.push((
            schema::OLD_LOGPROBS,
            "--rollout-rs (run ref-logprob --column old_logprobs first)",
        ));
        cols.push((schema::ROLLOUT_LOGPROBS, "--rollout-rs"));
    }
    if args.bypass_mode {
        cols.push((
            schema::ROLLOUT_LOGPROBS,
            "--bypass-mode (the rollout's log-probs are the old ones)",
        ));
    }
    cols
}

fn rows_of<'a>(r: &'a Option<Ragged<'static, f32>>) -> Option<Vec<&'a [f32]>> {
    r.as_ref().map(|r| r.rows().collect())
}

/// The columns of a batch that training reads, owned.
pub struct OwnedData {
    prompts: Vec<Vec<u32>>,
    responses: Vec<Vec<u32>>,
    mask: Ragged<'static, u8>,
    advantages: Option<Ragged<'static, f32>>,
    old: Option<Ragged<'static, f32>>,
    ref_lp: Option<Ragged<'static, f32>>,
    rollout: Option<Ragged<'static, f32>>,
}

impl OwnedData {
    /// Reads what `cfg` needs (and old_logprobs and rollout_logprobs when present) from a batch
    /// that holds the required columns.
    pub fn from_batch(batch: &Batch, cfg: &TrainConfig) -> Result<OwnedData> {
        let opt = |name: &str, wanted: bool| -> Result<Option<Ragged<'static, f32>>> {
            if wanted && batch.has(name) {
                Ok(Some(batch.ragged_f32(name)?))
            } else {
                Ok(None)
            }
        };
        let prompts: Vec<Vec<u32>> = batch
            .ragged_i32(schema::PROMPT_IDS)?
            .rows()
            .map(to_u32)
            .collect();
        if let Some(row) = prompts.iter().position(|p| p.is_empty()) {
            bail_input!(
                "{}, row {row}: prompt is empty",
                batch.at(schema::PROMPT_IDS)
            );
        }
        Ok(OwnedData {
            prompts,
            responses: batch
                .ragged_i32(schema::RESPONSE_IDS)?
                .rows()
                .map(to_u32)
                .collect(),
            mask: batch.ragged_u8(schema::RESPONSE_MASK)?,
            advantages: opt(schema::ADVANTAGES, cfg.loss.mode != LossMode::Sft)?,
            old: opt(schema::OLD_LOGPROBS, true)?,
            ref_lp: opt(schema::REF_LOGPROBS, cfg.loss.kl_loss.is_some())?,
            rollout: opt(schema::ROLLOUT_LOGPROBS, true)?,
        })
    }

    pub fn view(&self) -> TrainData<'_> {
        TrainData {
            rows: self
                .prompts
                .iter()
                .zip(&self.responses)
                .map(|(p, r)| PromptResponse {
                    prompt: p,
                    response: r,
                })
                .collect(),
            mask: self.mask.rows().collect(),
            advantages: rows_of(&self.advantages),
            old: rows_of(&self.old),
            ref_lp: rows_of(&self.ref_lp),
            rollout: rows_of(&self.rollout),
        }
    }
}

/// Where `update --resident` leaves the weights: the process that keeps them.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    /// The daemon's socket (None: a process without one, e.g. `tandem bench grpo-step`).
    pub socket: Option<PathBuf>,
    pub pid: u32,
}

/// The policy a daemon holds, as `tandem daemon-ctl save` writes it.
pub struct HeldPolicy {
    /// A directory with the policy's config and tokenizer files.
    pub files: PathBuf,
    /// The f32 (master) weights.
    pub weights: Weights,
    /// The optimizer state (None when the policy has none yet).
    pub state: Option<OptimizerState>,
    /// The trainer state of its last update (or the one it was loaded with).
    pub trainer: Option<TrainerState>,
}

/// What one rank of a daemon group brings to `daemon-ctl save` of a policy whose optimizer
/// state is sharded over the group ([`Exec::save_sharded`]).
pub struct SavedShards {
    /// A directory with the policy's config and tokenizer files.
    pub files: PathBuf,
    /// The f32 masters, gathered on rank 0 (None on the other ranks).
    pub masters: Option<Weights>,
    /// Every rank's optimizer shard file, written into the staging directory.
    pub shard_files: Vec<PathBuf>,
    /// The trainer state of its last update.
    pub trainer: TrainerState,
}

/// Every rank writes its optimizer shard into `staging`, then all learn whether all did (so
/// that no rank goes on to a checkpoint with a shard missing). Returns every rank's file.
pub fn write_rank_shards<B: Backend>(
    b: &B,
    comm: &dyn Comm<B>,
    staging: &Path,
    shard: &HostShard,
) -> Result<Vec<PathBuf>> {
    let written = resume::write_shard(staging, shard);
    let mut failed = [written.is_err() as u8 as f64];
    sum_f64(b, comm, &mut failed)?;
    written?;
    if failed[0] != 0.0 {
        anyhow::bail!("update: another rank failed to write its optimizer shard");
    }
    let world = comm.world_size();
    Ok((0..world)
        .map(|r| staging.join(resume::shard_file_name(r, world)))
        .collect())
}

/// [`write_rank_shards`] of the shard a checkpointing update brought to this rank's host (no
/// files where it brought none), timed into the update's shard metrics.
fn write_own_shard<B: Backend>(
    out: &mut ToHost,
    b: &B,
    comm: &dyn Comm<B>,
    staging: &Path,
) -> Result<Vec<PathBuf>> {
    let Some(shard) = &out.shard else {
        return Ok(Vec::new());
    };
    let started = Instant::now();
    let files = write_rank_shards(b, comm, staging, shard)?;
    if let Some(stats) = &mut out.report.shard {
        stats.shard_write_seconds = started.elapsed().as_secs_f64();
    }
    Ok(files)
}

/// Where the ranks of a data-parallel update write their optimizer shards before rank 0
/// moves them into `out` (a sibling: the same file system, and `out` itself is replaced
/// whole).
fn shard_staging(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".shards");
    out.with_file_name(name)
}

/// Writes a trained policy as `update --out-model` does: the weights (bf16 files) with the
/// config and tokenizer files of `files_from`, `trainer_state.json`, and
/// `optimizer.safetensors` when `state` is given; `shard_files` (the ranks' optimizer shards)
/// are moved in.
pub fn write_checkpoint(
    out: &Path,
    files_from: &Path,
    cfg: &Config,
    weights: &Weights,
    state: Option<&OptimizerState>,
    shard_files: &[PathBuf],
    trainer: &TrainerState,
) -> Result<()> {
    let extra = [(
        TRAINER_STATE_FILE.to_string(),
        resume::trainer_state_bytes(trainer)?,
    )];
    // The optimizer file is streamed to the staging directory beside `out` (where the ranks'
    // shards are written) and moved in with them.
    let staging = shard_staging(out);
    let mut move_in = shard_files.to_vec();
    let saved = (|| -> Result<()> {
        if let Some(state) = state {
            let path = staging.join(OPTIMIZER_FILE);
            resume::write_optimizer(&path, state, weights)?;
            move_in.push(path);
        }
        ModelDir::save_with(
            out,
            cfg,
            weights,
            &SaveOptions {
                tokenizer_from: Some(files_from),
                config_base: Some(files_from),
                max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
                extra_files: &extra,
                move_in: &move_in,
            },
        )
    })();
    // Emptied by the move; anything left is a stale shard of another world size.
    let _ = std::fs::remove_dir_all(&staging);
    saved
}

/// Checks that the rollout's log-probs may stand in for the old ones (`--bypass-mode`): the
/// rollout ran batch-invariant and with the policy `model` (its policy_version).
fn check_bypass(batch: &Batch, model: &ModelRef, model_flag: &Path) -> Result<()> {
    let file = batch.path.display();
    if batch.has(schema::OLD_LOGPROBS) {
        bail_input!(
            "{file}: has an old_logprobs column, but --bypass-mode takes the rollout's log-probs as the old ones; drop --bypass-mode to train against the column (or drop the old-logprob pass)"
        );
    }
    let source = batch.meta.get(meta::OLD_LOGPROBS).map(String::as_str);
    if source != Some(meta::OLD_LOGPROBS_ROLLOUT) {
        bail_input!(
            "{file}: --bypass-mode needs a rollout whose log-probs are the trainer's (batch-invariant kernels: the CPU backend, or TANDEM_BATCH_INVARIANT=1, `batch-invariant = true` in a spec, on the GPU), but this batch's metadata {} is {}; run rollout batch-invariant, or drop --bypass-mode and compute old_logprobs",
            meta::OLD_LOGPROBS,
            source.map_or("absent".to_string(), |s| format!("{s:?}"))
        );
    }
    let recorded = batch.meta.get(meta::POLICY_VERSION);
    let version = recorded.and_then(|v| v.parse::<u64>().ok());
    if version != Some(model.policy_version) {
        bail_input!(
            "{file}: rollout sampled this batch with policy_version {}, but --model {} is policy_version {}; under --bypass-mode the rollout's log-probs are the old ones only for the very policy the update starts from: update from that policy, or drop --bypass-mode and compute old_logprobs",
            recorded.map_or("(none recorded)", String::as_str),
            model_flag.display(),
            model.policy_version
        );
    }
    Ok(())
}

fn rows_u8<'a>(r: &'a Ragged<'static, u8>) -> Vec<&'a [u8]> {
    r.rows().collect()
}

/// The stage with its compute on `exec`.
pub fn run(args: UpdateArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    args.check()?;
    // Before anything is read: where resident weights would stay.
    let holder = match args.resident {
        false => None,
        true => Some(exec.holder().ok_or_else(|| {
            input_error(
                "--resident keeps the new weights in the warm daemon's memory: it needs --daemon SOCKET (or TANDEM_DAEMON)",
            )
        })?),
    };
    let batch = Batch::read(&args.input, &[])?;
    batch.require_rows()?;
    let cfg = args.train_config(logprob_temperature(&batch, args.temperature)?)?;
    let needs = required_columns(&args, &cfg);
    for (col, who) in &needs {
        if !batch.has(col) {
            bail_input!(
                "{}: column '{col}' is missing; it is needed by {who}",
                batch.path.display()
            );
        }
    }
    let names: Vec<&str> = needs.iter().map(|(c, _)| *c).collect();
    let batch = Batch::read(&args.input, &names)?;
    let model = resolve_model(&args.model)?;
    if args.resident && same_path(&model.dir, &args.out_model) {
        bail_input!(
            "--resident --out-model {}: would replace the model that --model names with a directory that holds no weights; give another --out-model",
            args.out_model.display()
        );
    }
    if args.bypass_mode {
        check_bypass(&batch, &model, &args.model)?;
    }
    let mcfg = ModelDir::load_config(&model.dir)?;
    // The model written carries --model's tokenizer files: refused before any training.
    require_tokenizer(
        &model.dir,
        "the model `update` writes would have no tokenizer",
    )?;
    check_token_ids(&batch, schema::PROMPT_IDS, mcfg.vocab_size)?;
    check_token_ids(&batch, schema::RESPONSE_IDS, mcfg.vocab_size)?;

    let owned = OwnedData::from_batch(&batch, &cfg)?;
    let mut data = owned.view();
    let rollout = rows_of(&owned.rollout);
    // Mismatch: measured here from the columns when the old-logprob pass ran; otherwise the
    // training loop measures it on its first forward (it gets the rollout's log-probs).
    let from_columns = match (&data.old, &rollout) {
        (Some(old), Some(roll)) => Some(Mismatch::of_rows(old, roll, &rows_u8(&owned.mask))?),
        _ => None,
    };
    if args.bypass_mode {
        data.old = rollout.clone();
    }
    if from_columns.is_some() && cfg.loss.rollout_is.is_none() {
        data.rollout = None;
    }
    // Masked importance sampling: the rejected tokens leave the response mask.
    let rejected = match (args.rejection()?, &data.old, &rollout) {
        (Some(rs), Some(old), Some(roll)) => Some(rs.apply(old, roll, &rows_u8(&owned.mask))?),
        _ => None,
    };
    if let Some((mask, _)) = &rejected {
        data.mask = mask.iter().map(Vec::as_slice).collect();
    }

    // The policy is loaded (and its optimizer resumed when its state sits next to the model)
    // by `exec`, or already held by the daemon.
    let job = Train {
        data: &data,
        train: &cfg,
        export_weights: !args.resident,
        export_state: !args.skip_optimizer_state && !args.resident,
    };
    let Trained {
        report,
        weights: new_weights,
        state,
        optimizer_step,
        schedule_step,
        load_seconds: loaded_s,
        shard_files,
    } = match exec.ranks() {
        None => exec.train(&model, job)?,
        Some(_) => {
            let sharding = Sharding {
                mode: args.shard.unwrap_or_default(),
                bucket_elems: args.bucket_elems.unwrap_or(DEFAULT_BUCKET_ELEMS),
                device: args.device,
                staging: shard_staging(&args.out_model),
            };
            exec.train_sharded(&model, job, sharding)?
        }
    };
    let trainer = TrainerState {
        optimizer_step,
        schedule_step: schedule_step + 1,
        lr: report.lr,
        lr_schedule: cfg.lr,
        seed: cfg.seed,
        optimizer_not_saved: state.is_none() && shard_files.is_empty(),
        optimizer_shards: shard_files.len(),
    };
    // Rank 0 writes the outputs. A daemon group's other ranks hold the same new state in
    // memory: they name it by the directory once rank 0 has written it.
    let group_holds = exec.ranks().is_some() && exec.holder().is_some();
    if exec.ranks().is_some_and(|x| !x.is_root()) {
        if group_holds {
            after_rank0(exec)?;
            // Rank 0 alone brings the state back; what it wrote is what the job asked.
            let trainer = TrainerState {
                optimizer_not_saved: args.skip_optimizer_state || args.resident,
                ..trainer
            };
            exec.saved(&args.out_model, Some(&trainer))?;
        }
        return Ok(());
    }
    let save_started = Instant::now();
    match (&holder, &new_weights) {
        (Some(h), _) => ModelDir::save_resident(
            &args.out_model,
            &mcfg,
            &ResidentMarker {
                socket: h.socket.clone(),
                pid: h.pid,
                step: trainer.schedule_step,
                from_policy_version: model.policy_version,
            },
            &SaveOptions {
                tokenizer_from: Some(&model.dir),
                config_base: Some(&model.dir),
                max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
                extra_files: &[],
                move_in: &[],
            },
        )?,
        (None, Some(w)) => {
            write_checkpoint(
                &args.out_model,
                &model.dir,
                &mcfg,
                w,
                state.as_ref(),
                &shard_files,
                &trainer,
            )?;
        }
        (None, None) => anyhow::bail!("update: the trained weights were not brought back"),
    }
    if group_holds {
        after_rank0(exec)?;
    }
    exec.saved(&args.out_model, Some(&trainer))?;
    let mut metrics = report.to_json();
    let m = metrics.as_object_mut().expect("object");
    m.insert("optimizer_step".into(), optimizer_step.into());
    m.insert(
        "optimizer_state_saved".into(),
        (state.is_some() || !shard_files.is_empty()).into(),
    );
    m.insert("optimizer_shards".into(), shard_files.len().into());
    m.insert("weights_saved".into(), holder.is_none().into());
    m.insert("schedule_step".into(), trainer.schedule_step.into());
    m.insert("on_policy".into(), report.on_policy.into());
    m.insert("bypass_mode".into(), args.bypass_mode.into());
    m.insert("device".into(), args.device.to_string().into());
    m.insert("load_seconds".into(), loaded_s.into());
    m.insert(
        "save_seconds".into(),
        save_started.elapsed().as_secs_f64().into(),
    );
    let mismatch = match (from_columns, &report.mismatch) {
        (Some(m), _) => Some((m.to_json(), "old_logprobs")),
        (None, Some((m, source))) => Some((m.to_json(), *source)),
        (None, None) => None,
    };
    if let Some((mut j, source)) = mismatch {
        j["source"] = source.into();
        m.insert("mismatch".into(), j);
    }
    if let Some((_, stats)) = &rejected {
        m.insert("rollout_rs".into(), stats.to_json());
    }
    if let Some(path) = &args.metrics {
        write_json(path, &metrics)?;
    }
    exec.log(&format!(
        "update: {} rows, {} optimizer steps ({} skipped), loss {:.5}, grad_norm {}, lr {:.3e}, {:.0} tokens/s -> {}{} in {:.2}s",
        batch.num_rows(),
        report.steps.len(),
        report.steps.iter().filter(|s| s.skipped).count(),
        metrics["loss"].as_f64().unwrap_or(f64::NAN),
        metrics["grad_norm"],
        report.lr,
        metrics["tokens_per_s"].as_f64().unwrap_or(0.0),
        args.out_model.display(),
        if holder.is_some() { " (weights resident in the daemon)" } else { "" },
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// `tandem daemon-ctl save`: the policy a daemon holds, written as the files `update` writes.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct SavePolicyArgs {
    /// The directory to write (HF layout, with optimizer and trainer state); may be the
    /// resident directory itself, which it replaces.
    #[arg(long)]
    pub out: PathBuf,
    /// Write only if the daemon holds this checkpoint (a directory, resident or not, or a
    /// sync-weights pointer) [default: whatever policy it holds].
    #[arg(long)]
    pub model: Option<PathBuf>,
}

/// The sharded policy of a daemon group as files, as a checkpointing update of the group writes
/// them: rank 0 the model files from the gathered masters and `trainer_state.json`, every
/// rank its `optimizer.rankRRRRR-of-NNNNN.safetensors` (moved in by rank 0).
fn save_group_shards(
    args: &SavePolicyArgs,
    exec: &mut dyn Exec,
    s: SavedShards,
    started: Instant,
) -> Result<()> {
    let trainer = TrainerState {
        optimizer_not_saved: false,
        optimizer_shards: s.shard_files.len(),
        ..s.trainer
    };
    if let Some(masters) = &s.masters {
        let cfg = ModelDir::load_config(&s.files)?;
        write_checkpoint(
            &args.out,
            &s.files,
            &cfg,
            masters,
            None,
            &s.shard_files,
            &trainer,
        )?;
    }
    after_rank0(exec)?;
    exec.saved(&args.out, Some(&trainer))?;
    if s.masters.is_some() {
        exec.log(&format!(
            "save: the daemon group's policy ({} optimizer shards) -> {} in {:.2}s",
            s.shard_files.len(),
            args.out.display(),
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// Writes the policy `exec` holds to `args.out`.
pub fn save_policy(args: SavePolicyArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    let model = args.model.as_deref().map(resolve_model).transpose()?;
    if exec.ranks().is_some() {
        // A daemon group: every rank runs this job.
        let staging = shard_staging(&args.out);
        if let Some(s) = exec.save_sharded(model.as_ref(), &staging)? {
            return save_group_shards(&args, exec, s, started);
        }
        if exec.ranks().is_some_and(|x| !x.is_root()) {
            // Not sharded: rank 0 holds all of it and saves it alone.
            return Ok(());
        }
    }
    let held = exec.held_policy(model.as_ref())?;
    let cfg = ModelDir::load_config(&held.files)?;
    match &held.trainer {
        Some(t) => {
            // The files written are all there is: never the shards of another checkpoint.
            let trainer = TrainerState {
                optimizer_not_saved: held.state.is_none(),
                optimizer_shards: 0,
                ..t.clone()
            };
            write_checkpoint(
                &args.out,
                &held.files,
                &cfg,
                &held.weights,
                held.state.as_ref(),
                &[],
                &trainer,
            )?;
        }
        // Never trained nor resumed: the model as it was loaded.
        None => ModelDir::save(&args.out, &cfg, &held.weights, Some(&held.files))?,
    }
    exec.saved(&args.out, None)?;
    exec.log(&format!(
        "save: the daemon's policy -> {} in {:.2}s",
        args.out.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
