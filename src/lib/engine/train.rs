//! The training loop of `update` (verl's `dp_actor.update_policy`): `ppo_epochs` passes over
//! the batch, each split into mini-batches of sequences (one optimizer step each), each split
//! into micro-batches by a token budget whose gradients accumulate. The loss of every
//! micro-batch is normalised by its mini-batch's totals, so the accumulated gradient equals the
//! unsplit mini-batch's gradient.
//!
//! Choices, as verl makes them:
//! - Without `old_logprobs`, a single mini-batch and a single epoch is on-policy: the current
//!   log-probs stand in for the old ones (ratio 1, gradient −A). Otherwise the old log-probs
//!   are computed with the current weights before the first step.
//! - The learning rate follows the schedule position of the *training step* (one `update`
//!   call), not of the optimizer step: every mini-batch of one call uses the same lr, and the
//!   position advances by one per call (verl steps its LR scheduler once per update_actor).
//! - A non-finite loss or gradient norm skips that optimizer step (weights and Adam moments
//!   unchanged) and is reported.
//! - With `rollout_logprobs` in the batch, the mismatch between the rollout's and the trainer's
//!   log-probs of the same tokens is measured where the trainer's are known before any
//!   optimizer step: the recomputed old log-probs (every row), else the forward of the first
//!   optimizer step (its mini-batch: the whole batch when on-policy).

use super::balance::{balance, micro_schedule};
use super::logprob::{micro_batches, score, PromptResponse};
use super::Policy;
use crate::algo::agg::{AggMode, LossNorm};
use crate::algo::policy_loss::{
    policy_loss, LossConfig, LossInputs, LossMetrics, LossMode, LossOutput,
};
use crate::algo::rollout_corr::Mismatch;
use crate::algo::value_loss::{value_loss, ValueInputs, ValueLoss};
use crate::backend::ops::sample::uniform;
use crate::backend::PpoShape;
use crate::model::decoder::{AdamWParams, PpoTokens, SeqRef, TokenGrads, TokenStats};
use crate::rng::mix_key;
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::time::Instant;

/// Shape of the learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    Cosine,
}

impl FromStr for LrSchedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "constant" => Ok(LrSchedule::Constant),
            "cosine" => Ok(LrSchedule::Cosine),
            _ => Err(format!(
                "unknown lr schedule '{s}' (expected constant or cosine)"
            )),
        }
    }
}

impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LrSchedule::Constant => "constant",
            LrSchedule::Cosine => "cosine",
        })
    }
}

/// The learning rate as a function of the training step (verl's schedules).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrConfig {
    pub lr: f64,
    pub warmup_steps: u64,
    pub schedule: LrSchedule,
    /// Horizon of the cosine decay (training steps); required for cosine.
    pub total_steps: Option<u64>,
    /// Cosine floor (and warmup start) as a fraction of lr.
    pub min_lr_ratio: f64,
}

impl LrConfig {
    pub fn constant(lr: f64) -> LrConfig {
        LrConfig {
            lr,
            warmup_steps: 0,
            schedule: LrSchedule::Constant,
            total_steps: None,
            min_lr_ratio: 0.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            bail!("--lr must be a finite number >= 0, got {}", self.lr);
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            bail!(
                "--min-lr-ratio must be in [0, 1], got {}",
                self.min_lr_ratio
            );
        }
        if self.schedule == LrSchedule::Cosine {
            match self.total_steps {
                None => bail!("--lr-schedule cosine needs --total-steps (its horizon)"),
                Some(t) if t <= self.warmup_steps => bail!(
                    "--total-steps ({t}) must exceed --lr-warmup-steps ({})",
                    self.warmup_steps
                ),
                _ => {}
            }
        }
        Ok(())
    }

    /// The lr of training step `s` (0 = the first update):
    /// constant: lr·min(1, s/W) (HF constant_with_warmup);
    /// cosine: warmup lr·(r + (1−r)·s/W), then lr·(r + (1−r)·½(1 + cos(π·p))),
    /// p = (s−W)/(T−W) clamped to 1, r = min_lr_ratio (verl's get_cosine_schedule_with_warmup).
    pub fn at(&self, s: u64) -> f64 {
        let w = self.warmup_steps;
        let factor = match self.schedule {
            LrSchedule::Constant => {
                if s < w {
                    s as f64 / w.max(1) as f64
                } else {
                    1.0
                }
            }
            LrSchedule::Cosine => {
                let r = self.min_lr_ratio;
                if s < w {
                    r + (1.0 - r) * s as f64 / w.max(1) as f64
                } else {
                    let total = self.total_steps.unwrap_or(s + 1).max(w + 1);
                    let p = ((s - w) as f64 / (total - w) as f64).min(1.0);
                    r + (1.0 - r) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
                }
            }
        };
        self.lr * factor
    }
}

/// Everything `update` decides about one call.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub loss: LossConfig,
    /// Divisor of seq-mean-token-sum-norm (default: the longest response of the mini-batch).
    pub loss_scale_factor: Option<f64>,
    pub ppo_epochs: usize,
    /// Sequences per optimizer step; None = the whole batch.
    pub mini_batch_size: Option<usize>,
    pub micro_batch_tokens: usize,
    pub temperature: f32,
    pub lr: LrConfig,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub grad_clip: Option<f32>,
    /// Shuffle rows before splitting into mini-batches (a permutation keyed by seed, training
    /// step and epoch).
    pub shuffle: bool,
    pub seed: u64,
    /// Run the PPO-clip loss on the device where the loss and the policy allow (no host round
    /// trip per micro-batch); false: always on the host ([`TrainConfig::device_loss_from_env`]).
    pub device_loss: bool,
    /// Train a critic (a value model) with this value loss instead of the policy loss
    /// (`update --critic`): the model's "log-probs" are its values, `old` the batch's
    /// `values`, and [`TrainData::returns`] the targets; `loss` is not used.
    pub critic: Option<ValueLoss>,
    /// Train LoRA adapters of this spec on the frozen model (`update --lora-rank`).
    pub lora: Option<crate::model::lora::LoraSpec>,
}

impl TrainConfig {
    /// The default of [`TrainConfig::device_loss`]: on, unless the environment sets
    /// `TANDEM_HOST_LOSS` (to compare the two paths, or to measure the host one).
    pub(crate) fn device_loss_from_env() -> bool {
        std::env::var_os("TANDEM_HOST_LOSS").is_none()
    }
}

/// The batch, one entry per row; per-token columns are aligned with the response.
pub struct TrainData<'a> {
    pub rows: Vec<PromptResponse<'a>>,
    pub mask: Vec<&'a [u8]>,
    pub advantages: Option<Vec<&'a [f32]>>,
    pub old: Option<Vec<&'a [f32]>>,
    pub ref_lp: Option<Vec<&'a [f32]>>,
    pub rollout: Option<Vec<&'a [f32]>>,
    /// The critic's targets (GAE's returns), when training a critic.
    pub returns: Option<Vec<&'a [f32]>>,
}

/// One optimizer step's numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    pub epoch: usize,
    pub sequences: usize,
    pub loss: f64,
    pub metrics: LossMetrics,
    pub grad_norm: f32,
    pub skipped: bool,
    /// Wall seconds of the step: its micro-batches' forward/loss/backward calls (with the loss
    /// on a GPU: the time to queue them; data-parallel: the last one's gradient reduce-scatter
    /// overlapped with its backward), the wait for the device to finish them (reading the
    /// loss metrics) and for the other ranks (data-parallel: the reduce-scatter of gradients
    /// not started during a backward, the sum of the metrics), and the optimizer step.
    pub micro_seconds: f64,
    pub wait_seconds: f64,
    pub optimizer_seconds: f64,
    /// The loss ran on the device (no host round trip per micro-batch).
    pub device_loss: bool,
}

/// What one call did.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainReport {
    pub steps: Vec<StepMetrics>,
    pub lr: f64,
    pub tokens: usize,
    pub seconds: f64,
    pub on_policy: bool,
    /// The old log-probs were computed here (absent from the batch, not on-policy).
    pub recomputed_old: bool,
    /// Rollout importance sampling weighted the loss (its metrics are reported).
    pub rollout_is: bool,
    /// Rollout vs trainer log-probs (when the batch has rollout_logprobs), and over which
    /// tokens: "recomputed_old" or "first_step".
    pub mismatch: Option<(Mismatch, &'static str)>,
    /// The data-parallel optimizer's numbers, when it trained as one of several ranks.
    pub shard: Option<ShardStats>,
    /// A critic was trained (the value loss's metrics are reported, not the policy's).
    pub critic: bool,
}

impl TrainReport {
    /// The metrics JSON of `update --metrics` (means over optimizer steps; grad_norm over the
    /// steps taken).
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let n = self.steps.len().max(1) as f64;
        let mut sum = LossMetrics::default();
        let mut loss = 0.0;
        for s in &self.steps {
            sum.add(&s.metrics);
            loss += s.loss;
        }
        let taken: Vec<&StepMetrics> = self.steps.iter().filter(|s| !s.skipped).collect();
        let grad_norm = if taken.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::json!(
                taken.iter().map(|s| s.grad_norm as f64).sum::<f64>() / taken.len() as f64
            )
        };
        let mean = |x: f64| x / n;
        if self.critic {
            return self.critic_json(&sum, mean(loss), grad_norm);
        }
        let mut out = serde_json::json!({
            "loss": mean(loss),
            "pg_loss": mean(sum.pg_loss),
            "pg_clipfrac": mean(sum.pg_clipfrac),
            "pg_clipfrac_lower": mean(sum.pg_clipfrac_lower),
            "ppo_kl": mean(sum.ppo_kl),
            "entropy": mean(sum.entropy),
            "kl_loss": mean(sum.kl_loss),
            "grad_norm": grad_norm,
            "lr": self.lr,
            "tokens_per_s": if self.seconds > 0.0 { self.tokens as f64 / self.seconds } else { 0.0 },
            "tokens": self.tokens,
            "optimizer_steps": taken.len(),
            "skipped_steps": self.steps.len() - taken.len(),
            "seconds": self.seconds,
        });
        if let Some(s) = &self.shard {
            out["shard"] = s.to_json();
        }
        if self.rollout_is {
            out["rollout_is"] = serde_json::json!({
                "weight_mean": mean(sum.is_weight),
                "truncated_frac": mean(sum.is_truncated),
            });
        }
        out
    }
}

impl TrainReport {
    /// [`TrainReport::to_json`] of a critic's update: verl's `critic/…` metrics (means over
    /// the optimizer steps; `critic/vf_explained_var` is the stage's, from the batch) and the
    /// loop's counts.
    fn critic_json(
        &self,
        sum: &LossMetrics,
        loss: f64,
        grad_norm: serde_json::Value,
    ) -> serde_json::Value {
        let n = self.steps.len().max(1) as f64;
        let taken = self.steps.iter().filter(|s| !s.skipped).count();
        serde_json::json!({
            "critic": {
                "vf_loss": sum.vf_loss / n,
                "vf_clipfrac": sum.vf_clipfrac / n,
                "vpred_mean": sum.vpred_mean / n,
                "grad_norm": grad_norm,
                "lr": self.lr,
            },
            "loss": loss,
            "tokens_per_s": if self.seconds > 0.0 { self.tokens as f64 / self.seconds } else { 0.0 },
            "tokens": self.tokens,
            "optimizer_steps": taken,
            "skipped_steps": self.steps.len() - taken,
            "seconds": self.seconds,
        })
    }
}

/// What the sharded optimizer did so far (the update metrics' `shard` object).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardStats {
    pub world_size: usize,
    pub buckets: usize,
    /// Elements of this rank's shards (of every bucket together).
    pub shard_elems: usize,
    /// Wall seconds the host spent on the gradients' reduce-scatter outside its overlap with
    /// the backward: packing and reducing the buckets started after the backward (all of them
    /// on a rank with no rows), and waiting for those started during it (for a pack buffer, or
    /// at the end of the backward; a GPU's wait does not block the host). Under full sharding:
    /// the units' reduce-scatters in the backward, whole.
    pub reduce_scatter_seconds: f64,
    /// Buckets whose reduce-scatter this rank started during a backward (zero2's overlap).
    pub overlapped_buckets: u64,
    /// Wall seconds of the weight sync (the all-gather of the compute weights, copies
    /// included) and the bytes each rank received in it.
    pub sync_seconds: f64,
    pub sync_bytes: u64,
    /// Bytes of the staging buffers the reduce-scatter and the weight sync add.
    pub staging_bytes: u64,
    /// `shard = "full"`: the units' all-gathers (before each forward and backward), their
    /// wall seconds and the bytes each rank received.
    pub full: bool,
    pub unit_gathers: u64,
    pub unit_gather_seconds: f64,
    pub unit_gather_bytes: u64,
    /// `shard = "full"`: the units' all-gathers started ahead (prefetched), while the unit
    /// before them computes.
    pub unit_prefetches: u64,
    /// A checkpointing update: wall seconds of bringing the state to the hosts (the masters
    /// gathered on rank 0, and each rank's own shard downloaded), and of writing this rank's
    /// optimizer shard file.
    pub state_gather_seconds: f64,
    pub shard_write_seconds: f64,
}

impl ShardStats {
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let gbs = match self.sync_seconds > 0.0 {
            true => self.sync_bytes as f64 / self.sync_seconds / 1e9,
            false => 0.0,
        };
        serde_json::json!({
            "world_size": self.world_size,
            "buckets": self.buckets,
            "shard_elems": self.shard_elems,
            "reduce_scatter_seconds": self.reduce_scatter_seconds,
            "overlapped_buckets": self.overlapped_buckets,
            "weight_sync_seconds": self.sync_seconds,
            "weight_sync_bytes": self.sync_bytes,
            "weight_sync_gb_per_s": gbs,
            "staging_bytes": self.staging_bytes,
            "mode": if self.full { "full" } else { "zero2" },
            "unit_gathers": self.unit_gathers,
            "unit_gather_seconds": self.unit_gather_seconds,
            "unit_gather_bytes": self.unit_gather_bytes,
            "unit_prefetches": self.unit_prefetches,
            "state_gather_seconds": self.state_gather_seconds,
            "shard_write_seconds": self.shard_write_seconds,
        })
    }
}

/// Runs one `update` call: `schedule_step` is the number of training steps before this one.
/// The PPO-clip loss runs on the device when the policy can and `cfg.device_loss` allows.
pub fn train(
    policy: &mut dyn Policy,
    data: &TrainData,
    cfg: &TrainConfig,
    schedule_step: u64,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    check_batch(data, cfg)?;
    let n = data.rows.len();
    let mbs = cfg.mini_batch_size.unwrap_or(n).clamp(1, n);
    let on_policy = data.old.is_none() && cfg.ppo_epochs == 1 && n.div_ceil(mbs) == 1;
    let started = Instant::now();
    let dp = policy.data_parallel();
    // Off-policy without old log-probs: freeze the current policy's before any step. With one
    // epoch the first mini-batch's are its own first forward (same weights: taken as
    // on-policy there, on every rank), so only the other rows are scored first.
    let first_own = data.old.is_none() && !on_policy && cfg.ppo_epochs == 1;
    let mut in_first = vec![false; n];
    if first_own {
        for &i in &epoch_order(cfg, n, schedule_step, 0)[..mbs] {
            in_first[i] = true;
        }
    }
    let recomputed = match data.old.is_none() && !on_policy {
        true => Some(recompute_old(policy, data, cfg, &in_first, log)?),
        false => None,
    };
    let mut mismatch = first_mismatch(data, recomputed.as_deref(), &in_first, dp, log)?;
    let old_rows: Option<Vec<&[f32]>> = match (&data.old, &recomputed) {
        (Some(o), _) => Some(o.clone()),
        (None, Some(r)) => Some(r.iter().map(Vec::as_slice).collect()),
        (None, None) => None,
    };
    let lr = cfg.lr.at(schedule_step);
    let mut t = Trainer::new(policy, data, cfg, lr, log)?;
    let mut steps = Vec::new();
    let mut tokens = 0usize;
    for epoch in 0..cfg.ppo_epochs {
        let order = epoch_order(cfg, n, schedule_step, epoch);
        for mb in order.chunks(mbs) {
            // The first mini-batch whose old log-probs were not recomputed: on-policy.
            let own = first_own && steps.is_empty();
            let old_mb = if own { None } else { old_rows.as_deref() };
            let measure = match &mut mismatch {
                Some((m, "first_step")) if steps.is_empty() => Some(m),
                // Data-parallel, each rank's first forward sees only its share: the mismatch
                // stays that of the recomputed rows, the same on every rank.
                Some((m, _)) if own && dp.is_none() => Some(m),
                _ => None,
            };
            let (step, step_tokens) = t.step(epoch, mb, old_mb, measure)?;
            tokens += step_tokens;
            steps.push(step);
        }
    }
    Ok(TrainReport {
        steps,
        lr,
        tokens,
        seconds: started.elapsed().as_secs_f64(),
        on_policy,
        recomputed_old: recomputed.is_some(),
        rollout_is: cfg.loss.rollout_is.is_some(),
        mismatch,
        shard: None,
        critic: cfg.critic.is_some(),
    })
}

/// Refuses a batch the loss cannot train on.
fn check_batch(data: &TrainData, cfg: &TrainConfig) -> Result<()> {
    let n = data.rows.len();
    ensure!(n > 0, "the batch has no rows");
    ensure!(cfg.ppo_epochs > 0, "ppo_epochs must be >= 1");
    ensure!(data.mask.len() == n, "mask rows");
    if cfg.critic.is_some() {
        ensure!(
            data.old.is_some() && data.returns.is_some(),
            "the value loss needs the batch's values and returns"
        );
        return Ok(());
    }
    let needs_adv = cfg.loss.mode != LossMode::Sft;
    ensure!(
        !needs_adv || data.advantages.is_some(),
        "advantages are required by this loss"
    );
    ensure!(
        cfg.loss.kl_loss.is_none() || data.ref_lp.is_some(),
        "the KL loss needs ref log-probs"
    );
    ensure!(
        cfg.loss.rollout_is.is_none() || data.rollout.is_some(),
        "rollout IS needs rollout log-probs"
    );
    Ok(())
}

/// The old log-probs of the rows not `in_first`, with the current weights (one entry per row
/// of the batch; those of the first mini-batch stay empty): scored here, or data-parallel
/// each rank its share ([`score_shared`]).
fn recompute_old(
    policy: &mut dyn Policy,
    data: &TrainData,
    cfg: &TrainConfig,
    in_first: &[bool],
    log: &mut dyn FnMut(&str),
) -> Result<Vec<Vec<f32>>> {
    log("old_logprobs absent and several optimizer steps: computing them with the current weights first");
    let n = data.rows.len();
    let rest: Vec<usize> = (0..n).filter(|&i| !in_first[i]).collect();
    if let Some((rank, world)) = policy.data_parallel() {
        return score_shared(policy, data, &rest, cfg, rank, world);
    }
    let rows: Vec<PromptResponse> = rest.iter().map(|&i| data.rows[i]).collect();
    let t = cfg.temperature;
    let stats = score(policy, &rows, t, false, cfg.micro_batch_tokens, &mut |_| {})?;
    let mut out = vec![Vec::new(); n];
    for (&i, s) in rest.iter().zip(stats) {
        out[i] = s.logprobs;
    }
    Ok(out)
}

/// Where the rollout-vs-trainer mismatch is measured (the batch has rollout log-probs): the
/// trainer's log-probs before any step are the recomputed old ones (measured here, every row
/// outside the first mini-batch), else those of the first optimizer step's forward (measured
/// there, not when data-parallel).
fn first_mismatch(
    data: &TrainData,
    recomputed: Option<&[Vec<f32>]>,
    in_first: &[bool],
    dp: Option<(usize, usize)>,
    log: &mut dyn FnMut(&str),
) -> Result<Option<(Mismatch, &'static str)>> {
    Ok(match (&data.rollout, recomputed) {
        (None, _) => None,
        (Some(roll), Some(old)) => {
            let mut m = Mismatch::default();
            for i in (0..data.rows.len()).filter(|&i| !in_first[i]) {
                m.add_row(&old[i], roll[i], data.mask[i])?;
            }
            Some((m, "recomputed_old"))
        }
        (Some(_), None) if dp.is_some() => {
            log("rollout mismatch: not measured on the first step's forward when data-parallel (each rank sees only its rows); give old_logprobs to measure it from the columns");
            None
        }
        (Some(_), None) => Some((Mismatch::default(), "first_step")),
    })
}

/// The training loop's state across its optimizer steps.
struct Trainer<'a, 'd> {
    policy: &'a mut dyn Policy,
    data: &'a TrainData<'d>,
    cfg: &'a TrainConfig,
    log: &'a mut dyn FnMut(&str),
    dp: Option<(usize, usize)>,
    hp: AdamWParams,
    want_entropy: bool,
    /// The PPO-clip loss runs on the device (metrics summed there, read once per step):
    /// vanilla mode without KL loss or rollout IS, while the policy has the path.
    device_loss: bool,
    clip: PpoShape,
}

/// What one optimizer step's micro-batches add up.
#[derive(Default)]
struct StepSums {
    metrics: LossMetrics,
    loss: f64,
    nonfinite: bool,
    /// A pass ran the loss on the device (its metrics are read after the passes).
    device_loss: bool,
    tokens: usize,
}

impl<'a, 'd> Trainer<'a, 'd> {
    fn new(
        policy: &'a mut dyn Policy,
        data: &'a TrainData<'d>,
        cfg: &'a TrainConfig,
        lr: f64,
        log: &'a mut dyn FnMut(&str),
    ) -> Result<Self> {
        let device_loss = cfg.device_loss
            && cfg.critic.is_none()
            && cfg.loss.mode == LossMode::Vanilla
            && cfg.loss.kl_loss.is_none()
            && cfg.loss.rollout_is.is_none();
        if device_loss {
            cfg.loss.validate()?;
        }
        Ok(Trainer {
            dp: policy.data_parallel(),
            policy,
            data,
            cfg,
            log,
            hp: AdamWParams {
                lr: lr as f32,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
            want_entropy: cfg.loss.entropy_coeff != 0.0 && cfg.critic.is_none(),
            device_loss,
            clip: PpoShape {
                tokens: 0,
                ratio_low: 1.0 - cfg.loss.clip_low(),
                ratio_high: 1.0 + cfg.loss.clip_high(),
                dual_clip: cfg.loss.clip_ratio_c,
            },
        })
    }

    /// One optimizer step on mini-batch `mb` (rows of the batch): its micro-batches'
    /// passes, their sums (over the ranks too), the step. `measure`: the mismatch this step's
    /// forward adds to. Returns the step's metrics and its tokens.
    fn step(
        &mut self,
        epoch: usize,
        mb: &[usize],
        old_mb: Option<&[&[f32]]>,
        measure: Option<&mut Mismatch>,
    ) -> Result<(StepMetrics, usize)> {
        let (data, cfg) = (self.data, self.cfg);
        let norm = LossNorm::of_rows(mb.iter().map(|&i| data.mask[i]), cfg.loss_scale_factor);
        self.policy.zero_grads()?;
        let step_start = Instant::now();
        let mut sums = StepSums::default();
        let mut measure = measure.map(|m| (m, Vec::new()));
        let groups = self.groups(mb);
        for (g, idx) in groups.iter().enumerate() {
            super::cancel::check()?;
            if g + 1 == groups.len() {
                self.policy.last_pass_next();
            }
            self.pass(idx, old_mb, &norm, measure.as_mut(), &mut sums)?;
        }
        let micro_seconds = step_start.elapsed().as_secs_f64();
        // Data-parallel: the gradients not reduced during the last backward (all of them
        // on a rank without rows), before the collectives below.
        self.policy.passes_done()?;
        if sums.device_loss {
            self.add_device_metrics(&mut sums)?;
        }
        if self.dp.is_some() {
            self.sum_over_ranks(&mut sums)?;
        }
        let wait_seconds = step_start.elapsed().as_secs_f64() - micro_seconds;
        let opt_start = Instant::now();
        let (grad_norm, skipped) = self.optimizer_step(epoch, mb.len(), sums.nonfinite)?;
        let step = StepMetrics {
            epoch,
            sequences: mb.len(),
            loss: if sums.nonfinite { f64::NAN } else { sums.loss },
            metrics: sums.metrics,
            grad_norm,
            skipped,
            micro_seconds,
            wait_seconds,
            optimizer_seconds: opt_start.elapsed().as_secs_f64(),
            device_loss: sums.device_loss,
        };
        Ok((step, sums.tokens))
    }

    /// The rows of each micro-batch of mini-batch `mb` (those with a response), cut by the
    /// token budget; data-parallel: this rank's share of the mini-batch (by token count), cut
    /// the same way (empty ones kept where the passes run in lockstep).
    fn groups(&self, mb: &[usize]) -> Vec<Vec<usize>> {
        let data = self.data;
        let live: Vec<usize> = mb
            .iter()
            .copied()
            .filter(|&i| !data.rows[i].response.is_empty())
            .collect();
        let lens: Vec<usize> = live.iter().map(|&i| data.rows[i].len()).collect();
        let budget = self.cfg.micro_batch_tokens.max(1);
        match self.dp {
            None => micro_batches(&lens, budget)
                .into_iter()
                .map(|g| live[g].to_vec())
                .collect(),
            Some((rank, world)) => {
                let (shares, micro) = micro_schedule(&lens, world, budget);
                let mine = &shares[rank];
                let lockstep = self.policy.lockstep();
                micro[rank]
                    .iter()
                    .filter(|g| lockstep || !g.is_empty())
                    .map(|g| mine[g.clone()].iter().map(|&k| live[k]).collect())
                    .collect()
            }
        }
    }

    /// One micro-batch's forward, loss and backward (rows `idx`): the loss on the device where
    /// it can run, else on the host; its numbers added to `sums`, its log-probs to `measure`.
    fn pass(
        &mut self,
        idx: &[usize],
        old_mb: Option<&[&[f32]]>,
        norm: &LossNorm,
        mut measure: Option<&mut (&mut Mismatch, Vec<f32>)>,
        sums: &mut StepSums,
    ) -> Result<()> {
        let (data, cfg) = (self.data, self.cfg);
        let joined: Vec<Vec<u32>> = idx.iter().map(|&i| data.rows[i].joined()).collect();
        let seqs: Vec<SeqRef> = idx
            .iter()
            .zip(&joined)
            .map(|(&i, t)| SeqRef {
                tokens: t,
                start: data.rows[i].prompt.len(),
            })
            .collect();
        sums.tokens += joined.iter().map(Vec::len).sum::<usize>();
        if self.device_loss {
            let t = ppo_tokens(cfg, data, idx, old_mb, norm, self.want_entropy)?;
            let pt = PpoTokens {
                old: t.old.as_deref(),
                advantages: &t.adv,
                weights: &t.weights,
                dentropy: t.dent.as_deref(),
            };
            let lp_out = measure.as_mut().map(|m| &mut m.1);
            let temp = cfg.temperature;
            if self
                .policy
                .forward_backward_ppo(&seqs, temp, &pt, self.clip, lp_out)?
            {
                sums.device_loss = true;
                if let Some((m, buf)) = measure {
                    add_mismatch(m, data, idx, |_, off, len| &buf[off..off + len])?;
                }
                return Ok(());
            }
            // This policy has no device path: the host loss from here on.
            self.device_loss = false;
        }
        let want_entropy = self.want_entropy;
        self.policy
            .forward_backward(&seqs, cfg.temperature, &mut |stats| {
                if let Some((m, _)) = measure.as_mut() {
                    add_mismatch(m, data, idx, |k, _, _| &stats[k].logprobs[..])?;
                }
                let (out, offsets) = micro_loss(cfg, data, idx, stats, old_mb, norm, want_entropy)?;
                if !out.loss.is_finite() {
                    sums.nonfinite = true;
                } else {
                    sums.metrics.add(&out.metrics);
                    sums.loss += out.loss;
                }
                Ok(split_grads(
                    &out.grad_lp,
                    out.grad_entropy.as_deref(),
                    &offsets,
                    sums.nonfinite,
                ))
            })
    }

    /// The device loss's metric sums of the step's passes, added to `sums`.
    fn add_device_metrics(&mut self, sums: &mut StepSums) -> Result<()> {
        let s = self.policy.take_ppo_stats()?;
        let m = LossMetrics {
            pg_loss: s[0],
            pg_clipfrac: s[1],
            pg_clipfrac_lower: s[2],
            ppo_kl: s[3],
            entropy: s[4],
            ..LossMetrics::default()
        };
        let loss = m.pg_loss - self.cfg.loss.entropy_coeff * m.entropy;
        if s[5] > 0.0 || !loss.is_finite() {
            sums.nonfinite = true;
        } else {
            sums.metrics.add(&m);
            sums.loss += loss;
        }
        Ok(())
    }

    /// Data-parallel: the step's sums over the ranks. The loss was normalised by the whole
    /// mini-batch's counts (every rank has them), so the ranks' sums add up to the one-rank
    /// values.
    fn sum_over_ranks(&mut self, sums: &mut StepSums) -> Result<()> {
        let m = &mut sums.metrics;
        let mut fields = [
            &mut sums.loss,
            &mut m.pg_loss,
            &mut m.pg_clipfrac,
            &mut m.pg_clipfrac_lower,
            &mut m.ppo_kl,
            &mut m.entropy,
            &mut m.kl_loss,
            &mut m.is_weight,
            &mut m.is_truncated,
            &mut m.vf_loss,
            &mut m.vf_clipfrac,
            &mut m.vpred_mean,
        ];
        let k = fields.len();
        let mut v: Vec<f64> = fields.iter().map(|f| **f).collect();
        v.extend([sums.nonfinite as u8 as f64, sums.tokens as f64]);
        self.policy.sum_over_ranks(&mut v)?;
        for (f, x) in fields.iter_mut().zip(&v) {
            **f = *x;
        }
        sums.nonfinite = v[k] > 0.0;
        sums.tokens = v[k + 1].round() as usize;
        Ok(())
    }

    /// The optimizer step of a mini-batch of `seqs` sequences, skipped after a non-finite
    /// loss (the gradients zeroed) or gradient norm. Returns (gradient norm, skipped).
    fn optimizer_step(
        &mut self,
        epoch: usize,
        seqs: usize,
        nonfinite: bool,
    ) -> Result<(f32, bool)> {
        if nonfinite {
            self.policy.zero_grads()?;
            (self.log)(&format!(
                "epoch {epoch}, mini-batch of {seqs} sequences: non-finite loss, optimizer step skipped"
            ));
            return Ok((f32::NAN, true));
        }
        let r = self.policy.optimizer_step(&self.hp, self.cfg.grad_clip)?;
        if r.skipped {
            (self.log)(&format!(
                "epoch {epoch}, mini-batch of {seqs} sequences: gradient norm {} is not finite, optimizer step skipped",
                r.grad_norm
            ));
        }
        Ok((r.grad_norm, r.skipped))
    }
}

/// The rows of `epoch` in the order they are cut into mini-batches: as they come, or a
/// permutation keyed by seed, training step and epoch.
fn epoch_order(cfg: &TrainConfig, n: usize, schedule_step: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if cfg.shuffle {
        let key = mix_key(&[cfg.seed, schedule_step, epoch as u64]);
        let r: Vec<f64> = (0..n).map(|i| uniform(key, i as u64)).collect();
        order.sort_by(|&a, &b| r[a].total_cmp(&r[b]));
    }
    order
}

/// The log-probs of the responses of rows `rows`, data-parallel: each rank scores its share
/// (by token count, [`balance`]) and the shares are all-gathered (padded to the largest). One
/// entry per row of the batch; the rows not asked for stay empty.
fn score_shared(
    policy: &mut dyn Policy,
    data: &TrainData,
    rows: &[usize],
    cfg: &TrainConfig,
    rank: usize,
    world: usize,
) -> Result<Vec<Vec<f32>>> {
    let lens: Vec<usize> = rows.iter().map(|&i| data.rows[i].len()).collect();
    // Each rank's rows, as indices into the batch.
    let shares: Vec<Vec<usize>> = balance(&lens, world)
        .into_iter()
        .map(|s| s.into_iter().map(|k| rows[k]).collect())
        .collect();
    let mine: Vec<PromptResponse> = shares[rank].iter().map(|&i| data.rows[i]).collect();
    let stats = score(
        policy,
        &mine,
        cfg.temperature,
        false,
        cfg.micro_batch_tokens,
        &mut |_| {},
    )?;
    if policy.lockstep() {
        // Every rank runs as many scoring passes as the busiest: empty ones where it has none.
        let passes = |share: &[usize]| {
            let lens: Vec<usize> = share
                .iter()
                .filter(|&&i| !data.rows[i].response.is_empty())
                .map(|&i| data.rows[i].len())
                .collect();
            micro_batches(&lens, cfg.micro_batch_tokens.max(1)).len()
        };
        let most = shares.iter().map(|s| passes(s)).max().unwrap_or(0);
        for _ in passes(&shares[rank])..most {
            policy.logprobs(&[], cfg.temperature, false)?;
        }
    }
    let resp = |i: usize| data.rows[i].response.len();
    let most = shares
        .iter()
        .map(|s| s.iter().map(|&i| resp(i)).sum::<usize>())
        .max()
        .unwrap_or(0);
    let mut send = Vec::with_capacity(most);
    for s in &stats {
        send.extend_from_slice(&s.logprobs);
    }
    ensure!(send.len() <= most, "scored more tokens than the share has");
    send.resize(most, 0.0);
    let all = match most {
        0 => vec![0.0; 0],
        _ => policy.gather_over_ranks(&send)?,
    };
    let mut out = vec![Vec::new(); data.rows.len()];
    for (r, share) in shares.iter().enumerate() {
        let mut off = r * most;
        for &i in share {
            out[i] = all[off..off + resp(i)].to_vec();
            off += resp(i);
        }
    }
    Ok(out)
}

/// Adds the trainer's log-probs of rows `idx` (`lp(k, offset, len)`: the k-th row's, at
/// `offset` in the micro-batch's concatenation) against their rollout log-probs.
fn add_mismatch<'a>(
    m: &mut Mismatch,
    data: &TrainData,
    idx: &[usize],
    lp: impl Fn(usize, usize, usize) -> &'a [f32],
) -> Result<()> {
    let roll = data
        .rollout
        .as_ref()
        .expect("measured only with rollout log-probs");
    let mut off = 0;
    for (k, &i) in idx.iter().enumerate() {
        let len = data.rows[i].response.len();
        m.add_row(lp(k, off, len), roll[i], data.mask[i])?;
        off += len;
    }
    Ok(())
}

/// Per-token inputs of the device-side PPO loss for rows `idx` (owned; see [`PpoTokens`]).
struct OwnedPpoTokens {
    old: Option<Vec<f32>>,
    adv: Vec<f32>,
    weights: Vec<f32>,
    dent: Option<Vec<f32>>,
}

/// The device loss's inputs for rows `idx`: each token's aggregation weights (policy loss,
/// token-mean metrics, entropy) from the mini-batch totals, so the device sums over
/// micro-batches equal the host loss of the whole mini-batch.
fn ppo_tokens(
    cfg: &TrainConfig,
    data: &TrainData,
    idx: &[usize],
    old_rows: Option<&[&[f32]]>,
    norm: &LossNorm,
    want_entropy: bool,
) -> Result<OwnedPpoTokens> {
    let adv_rows = data
        .advantages
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("advantages are required by this loss"))?;
    let n: usize = idx.iter().map(|&i| data.rows[i].response.len()).sum();
    let (mut w_pg, mut w_tok, mut w_agg) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut adv = Vec::with_capacity(n);
    let mut old = old_rows.map(|_| Vec::with_capacity(n));
    for &i in idx {
        let len = data.rows[i].response.len();
        let mask = data.mask[i];
        ensure!(
            mask.len() == len && adv_rows[i].len() == len,
            "row {i}: response_mask and advantages must have one value per response token"
        );
        let valid = mask.iter().filter(|&&m| m != 0).count();
        // Vanilla PPO aggregates its policy loss with the configured mode (GSPO would not).
        let (pg, tok, ag) = (
            norm.row_weight(cfg.loss.agg, valid)? as f32,
            norm.row_weight(AggMode::TokenMean, valid)? as f32,
            norm.row_weight(cfg.loss.agg, valid)? as f32,
        );
        for &m in mask {
            let on = (m != 0) as u8 as f32;
            w_pg.push(pg * on);
            w_tok.push(tok * on);
            w_agg.push(ag * on);
        }
        adv.extend_from_slice(adv_rows[i]);
        if let (Some(o), Some(rows)) = (old.as_mut(), old_rows) {
            ensure!(
                rows[i].len() == len,
                "row {i}: {} old log-probs for {len} response tokens",
                rows[i].len()
            );
            o.extend_from_slice(rows[i]);
        }
    }
    // loss −= coeff·agg(H): a constant dL/dH per token.
    let dent = want_entropy.then(|| {
        w_agg
            .iter()
            .map(|&w| (-cfg.loss.entropy_coeff * w as f64) as f32)
            .collect()
    });
    w_pg.extend_from_slice(&w_tok);
    w_pg.extend_from_slice(&w_agg);
    Ok(OwnedPpoTokens {
        old,
        adv,
        weights: w_pg,
        dent,
    })
}

/// The loss of one micro-batch (rows `idx`, current stats `stats`) and the token offsets of
/// its rows.
fn micro_loss(
    cfg: &TrainConfig,
    data: &TrainData,
    idx: &[usize],
    stats: &[TokenStats],
    old_rows: Option<&[&[f32]]>,
    norm: &LossNorm,
    want_entropy: bool,
) -> Result<(LossOutput<f32>, Vec<usize>)> {
    ensure!(
        stats.len() == idx.len(),
        "forward returned {} sequences for {}",
        stats.len(),
        idx.len()
    );
    if let Some(vl) = &cfg.critic {
        return critic_loss(vl, data, idx, stats, old_rows, norm);
    }
    let mut offsets = vec![0usize];
    let mut mask = Vec::new();
    let mut lp = Vec::new();
    let mut entropy = Vec::new();
    for (&i, s) in idx.iter().zip(stats) {
        let n = data.rows[i].response.len();
        ensure!(
            s.logprobs.len() == n,
            "row {i}: {} log-probs for {n} tokens",
            s.logprobs.len()
        );
        mask.extend_from_slice(data.mask[i]);
        lp.extend_from_slice(&s.logprobs);
        match &s.entropy {
            Some(e) if e.len() == n => entropy.extend_from_slice(e),
            _ if want_entropy => {
                bail!("the entropy bonus needs per-token entropies from the forward pass")
            }
            _ => {}
        }
        offsets.push(lp.len());
    }
    // Entropies, when the forward pass gives them, feed the metric even without a bonus.
    let have_entropy = entropy.len() == lp.len();
    let gather = |col: &Option<Vec<&[f32]>>| -> Option<Vec<f32>> {
        col.as_ref()
            .map(|c| idx.iter().flat_map(|&i| c[i].iter().copied()).collect())
    };
    let old: Vec<f32> = match old_rows {
        Some(o) => idx.iter().flat_map(|&i| o[i].iter().copied()).collect(),
        // On-policy: the current log-probs, as constants.
        None => lp.clone(),
    };
    let adv = gather(&data.advantages);
    let ref_lp = gather(&data.ref_lp);
    let rollout = gather(&data.rollout);
    let inputs = LossInputs {
        offsets: &offsets,
        mask: &mask,
        lp: &lp,
        old: Some(&old),
        advantages: adv.as_deref(),
        ref_lp: ref_lp.as_deref(),
        rollout: rollout.as_deref(),
        entropy: have_entropy.then_some(entropy.as_slice()),
    };
    let mut out = policy_loss(&cfg.loss, &inputs, norm, 1.0)?;
    if !want_entropy {
        // No bonus: dL/dentropy is zero, spare the backward pass its term.
        out.grad_entropy = None;
    }
    Ok((out, offsets))
}

/// The value loss of one micro-batch (rows `idx`, the critic's current values in `stats`,
/// the batch's values in `old_rows`) and the token offsets of its rows.
fn critic_loss(
    vl: &ValueLoss,
    data: &TrainData,
    idx: &[usize],
    stats: &[TokenStats],
    old_rows: Option<&[&[f32]]>,
    norm: &LossNorm,
) -> Result<(LossOutput<f32>, Vec<usize>)> {
    let (old_rows, ret_rows) = match (old_rows, &data.returns) {
        (Some(o), Some(r)) => (o, r),
        _ => bail!("the value loss needs the batch's values and returns"),
    };
    let mut offsets = vec![0usize];
    let (mut mask, mut v, mut old, mut ret) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (&i, s) in idx.iter().zip(stats) {
        let n = data.rows[i].response.len();
        ensure!(
            s.logprobs.len() == n && old_rows[i].len() == n && ret_rows[i].len() == n,
            "row {i}: {} values, {} old values, {} returns for {n} response tokens",
            s.logprobs.len(),
            old_rows[i].len(),
            ret_rows[i].len()
        );
        mask.extend_from_slice(data.mask[i]);
        v.extend_from_slice(&s.logprobs);
        old.extend_from_slice(old_rows[i]);
        ret.extend_from_slice(ret_rows[i]);
        offsets.push(v.len());
    }
    let x = ValueInputs {
        offsets: &offsets,
        mask: &mask,
        v: &v,
        old: &old,
        returns: &ret,
    };
    Ok((value_loss(vl, &x, norm)?, offsets))
}

/// Per-row gradients for the backward pass (zeros when the loss was not finite, so the step
/// that is about to be skipped does not fill the buffers with NaN).
fn split_grads(
    dlp: &[f32],
    dent: Option<&[f32]>,
    offsets: &[usize],
    zero: bool,
) -> Vec<TokenGrads> {
    offsets
        .windows(2)
        .map(|w| {
            let r = w[0]..w[1];
            TokenGrads {
                dlogprobs: if zero {
                    vec![0.0; r.len()]
                } else {
                    dlp[r.clone()].to_vec()
                },
                dentropy: dent.map(|d| {
                    if zero {
                        vec![0.0; r.len()]
                    } else {
                        d[r].to_vec()
                    }
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::agg::AggMode;
    use crate::engine::testing::Bigram;

    fn cfg(mode: LossMode) -> TrainConfig {
        TrainConfig {
            loss: LossConfig::new(mode),
            loss_scale_factor: None,
            ppo_epochs: 1,
            mini_batch_size: None,
            micro_batch_tokens: 1 << 20,
            temperature: 1.0,
            lr: LrConfig::constant(0.5),
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: None,
            shuffle: false,
            seed: 0,
            device_loss: true,
            critic: None,
            lora: None,
        }
    }

    struct Owned {
        prompts: Vec<Vec<u32>>,
        responses: Vec<Vec<u32>>,
        masks: Vec<Vec<u8>>,
        adv: Vec<Vec<f32>>,
    }

    impl Owned {
        fn new(rows: &[(Vec<u32>, Vec<u32>, f32)]) -> Owned {
            Owned {
                prompts: rows.iter().map(|r| r.0.clone()).collect(),
                responses: rows.iter().map(|r| r.1.clone()).collect(),
                masks: rows.iter().map(|r| vec![1; r.1.len()]).collect(),
                adv: rows.iter().map(|r| vec![r.2; r.1.len()]).collect(),
            }
        }
        fn data(&self) -> TrainData<'_> {
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
                mask: self.masks.iter().map(Vec::as_slice).collect(),
                advantages: Some(self.adv.iter().map(Vec::as_slice).collect()),
                old: None,
                ref_lp: None,
                rollout: None,
                returns: None,
            }
        }
    }

    fn batch() -> Owned {
        Owned::new(&[
            (vec![0], vec![1, 2, 3], 1.0),
            (vec![0], vec![4, 4], -1.0),
            (vec![2, 1], vec![3], 0.5),
            (vec![5], vec![], 0.0),
            (vec![3], vec![0, 5, 1, 2], -0.25),
        ])
    }

    #[test]
    fn lr_schedules_match_hand_values() {
        let c = LrConfig {
            lr: 1.0,
            warmup_steps: 4,
            schedule: LrSchedule::Constant,
            total_steps: None,
            min_lr_ratio: 0.0,
        };
        // HF constant_with_warmup: s/W below W.
        assert_eq!(
            [c.at(0), c.at(1), c.at(3), c.at(4), c.at(100)],
            [0.0, 0.25, 0.75, 1.0, 1.0]
        );
        let cos = LrConfig {
            lr: 2.0,
            warmup_steps: 2,
            schedule: LrSchedule::Cosine,
            total_steps: Some(6),
            min_lr_ratio: 0.1,
        };
        // warmup: 2·(0.1 + 0.9·s/2); then p = (s−2)/4: s=4 → p=½, cos = 0 → 2·(0.1 + 0.45) = 1.1.
        assert!((cos.at(0) - 0.2).abs() < 1e-12);
        assert!((cos.at(1) - 1.1).abs() < 1e-12);
        assert!((cos.at(2) - 2.0).abs() < 1e-12);
        assert!((cos.at(4) - 1.1).abs() < 1e-12);
        assert!((cos.at(6) - 0.2).abs() < 1e-12);
        assert!(
            (cos.at(60) - 0.2).abs() < 1e-12,
            "clamped after the horizon"
        );
        assert!(LrConfig {
            total_steps: None,
            ..cos
        }
        .validate()
        .is_err());
        assert!(LrConfig {
            total_steps: Some(2),
            ..cos
        }
        .validate()
        .is_err());
        assert!(cos.validate().is_ok());
    }

    #[test]
    fn micro_batching_does_not_change_the_step() {
        for agg in [
            AggMode::TokenMean,
            AggMode::SeqMeanTokenMean,
            AggMode::SeqMeanTokenSumNorm,
        ] {
            let owned = batch();
            let mut c = cfg(LossMode::Vanilla);
            c.loss.agg = agg;
            let mut whole = Bigram::random(6, 1);
            let mut split = Bigram::random(6, 1);
            let r1 = train(&mut whole, &owned.data(), &c, 0, &mut |_| {}).unwrap();
            c.micro_batch_tokens = 4;
            let r2 = train(&mut split, &owned.data(), &c, 0, &mut |_| {}).unwrap();
            assert_eq!(whole.fb_calls, vec![4], "one call for the 4 non-empty rows");
            assert!(split.fb_calls.len() >= 3);
            for (a, b) in whole.theta.iter().zip(&split.theta) {
                assert!((a - b).abs() < 1e-6, "{agg}: {a} vs {b}");
            }
            assert!((r1.steps[0].loss - r2.steps[0].loss).abs() < 1e-6);
            assert!((r1.steps[0].grad_norm - r2.steps[0].grad_norm).abs() < 1e-5);
        }
    }

    #[test]
    fn on_policy_step_is_the_policy_gradient() {
        // One mini-batch, one epoch, no old log-probs: ratio 1, token-mean loss = −Σ A·1/N and
        // the gradient −Σ A ∇lp / N, N = valid tokens = 10.
        let owned = batch();
        let mut model = Bigram::random(6, 2);
        let before = model.theta.clone();
        let mut c = cfg(LossMode::Vanilla);
        c.lr = LrConfig::constant(0.1);
        let report = train(&mut model, &owned.data(), &c, 0, &mut |_| {}).unwrap();
        assert!(report.on_policy && !report.recomputed_old);
        let s = &report.steps[0];
        // Σ A over tokens: 3·1 + 2·(−1) + 1·0.5 + 4·(−0.25) = 0.5.
        let want_loss = -0.5 / 10.0;
        assert!((s.loss - want_loss).abs() < 1e-6, "{}", s.loss);
        assert_eq!(s.metrics.ppo_kl, 0.0);
        assert_eq!(s.metrics.pg_clipfrac, 0.0);
        // θ moved by −lr·g with g = −Σ A (δ − p) / N over the tokens.
        let mut g = vec![0.0f64; 36];
        let mut fresh = Bigram::random(6, 2);
        fresh.theta = before.clone();
        for (p, (r, a)) in owned
            .prompts
            .iter()
            .zip(owned.responses.iter().zip(&owned.adv))
        {
            let ctx: Vec<u32> = p.iter().chain(r).copied().collect();
            for (j, &aj) in a.iter().enumerate() {
                let pos = p.len() + j;
                let probs = fresh.probs(ctx[pos - 1], 1.0);
                for (v, &pv) in probs.iter().enumerate() {
                    let d = (v == ctx[pos] as usize) as u8 as f64 - pv;
                    g[ctx[pos - 1] as usize * 6 + v] += -(aj as f64) * d / 10.0;
                }
            }
        }
        for k in 0..36 {
            let want = before[k] - 0.1 * g[k];
            assert!((model.theta[k] - want).abs() < 1e-6, "{k}");
        }
    }

    #[test]
    fn several_steps_recompute_old_and_count_steps() {
        let owned = batch();
        let mut model = Bigram::random(6, 3);
        let mut c = cfg(LossMode::Vanilla);
        c.ppo_epochs = 2;
        c.mini_batch_size = Some(2);
        let mut notes = vec![];
        let r = train(&mut model, &owned.data(), &c, 0, &mut |m| {
            notes.push(m.to_string())
        })
        .unwrap();
        assert!(!r.on_policy && r.recomputed_old);
        assert!(notes[0].contains("old_logprobs absent"), "{notes:?}");
        // 5 rows in mini-batches of 2 → 3 steps per epoch.
        assert_eq!(r.steps.len(), 6);
        assert_eq!(
            r.steps.iter().map(|s| s.sequences).collect::<Vec<_>>(),
            [2, 2, 1, 2, 2, 1]
        );
        // The first step sees the weights the old log-probs came from.
        assert!(r.steps[0].metrics.ppo_kl.abs() < 1e-7);
        assert!(
            r.steps[3].metrics.ppo_kl.abs() > 1e-6,
            "later steps are off-policy"
        );
        assert_eq!(model.steps, 6);
        let j = r.to_json();
        assert_eq!(j["optimizer_steps"], 6);
        assert_eq!(j["skipped_steps"], 0);
    }

    #[test]
    fn one_epoch_scores_only_the_rows_after_the_first_mini_batch() {
        // One epoch, shuffled mini-batches of 2: the first mini-batch's old log-probs are its
        // own first forward, so only the other rows (3 of 5) are scored before the steps, and
        // every step equals the one given the starting weights' log-probs as a column.
        let owned = batch();
        let mut c = cfg(LossMode::Vanilla);
        c.mini_batch_size = Some(2);
        c.shuffle = true;
        c.seed = 11;
        let start = Bigram::random(6, 3);
        let mut a = Bigram::random(6, 3);
        let ra = train(&mut a, &owned.data(), &c, 4, &mut |_| {}).unwrap();
        assert!(ra.recomputed_old && !ra.on_policy);
        let first = epoch_order(&c, 5, 4, 0)[..2].to_vec();
        let first_tokens: usize = first.iter().map(|&i| owned.responses[i].len()).sum();
        assert!(
            first_tokens > 0,
            "the test needs a first mini-batch with tokens"
        );
        // Scored: the rows outside the first mini-batch that have a response (row 3 has none).
        let rest = (0..5)
            .filter(|i| !first.contains(i) && !owned.responses[*i].is_empty())
            .count();
        assert_eq!(a.scored, rest);
        let mut b = Bigram::random(6, 3);
        let d0 = owned.data();
        let old: Vec<Vec<f32>> = score(&mut b, &d0.rows, 1.0, false, 100, &mut |_| {})
            .unwrap()
            .into_iter()
            .map(|s| s.logprobs)
            .collect();
        let mut d = owned.data();
        d.old = Some(old.iter().map(Vec::as_slice).collect());
        let rb = train(&mut b, &d, &c, 4, &mut |_| {}).unwrap();
        assert!(!rb.recomputed_old);
        assert_eq!(ra.steps.len(), 3);
        for (x, y) in ra.steps.iter().zip(&rb.steps) {
            assert_eq!(x.sequences, y.sequences);
            assert!((x.loss - y.loss).abs() < 1e-9, "{} {}", x.loss, y.loss);
            assert!((x.metrics.ppo_kl - y.metrics.ppo_kl).abs() < 1e-9);
            assert!((x.grad_norm - y.grad_norm).abs() < 1e-6);
        }
        assert!(
            ra.steps[2].metrics.ppo_kl.abs() > 1e-6,
            "later steps are off-policy"
        );
        for (k, (x, y)) in a.theta.iter().zip(&b.theta).enumerate() {
            assert!((x - y).abs() < 1e-9, "θ[{k}]: {x} vs {y}");
        }
        assert_ne!(a.theta, start.theta);
        // Two epochs need the first mini-batch's old log-probs again later: every row scored.
        let mut e = Bigram::random(6, 3);
        c.ppo_epochs = 2;
        train(&mut e, &owned.data(), &c, 4, &mut |_| {}).unwrap();
        assert_eq!(e.scored, 4, "the four rows with a response");
    }

    #[test]
    fn a_cancelled_update_stops_before_its_next_micro_batch() {
        use crate::engine::cancel::{is_cancelled, Cancel};
        let owned = batch();
        let mut model = Bigram::random(6, 3);
        let before = model.theta.clone();
        let mut c = cfg(LossMode::Vanilla);
        c.mini_batch_size = Some(2);
        c.ppo_epochs = 2;
        let cancel = Cancel::new();
        // Cancelled while the old log-probs are computed: no optimizer step is taken.
        let err = cancel
            .install(|| train(&mut model, &owned.data(), &c, 0, &mut |_| cancel.cancel()))
            .unwrap_err();
        assert!(is_cancelled(&err), "{err:#}");
        assert_eq!(model.steps, 0);
        assert_eq!(model.theta, before);
    }

    #[test]
    fn shuffling_is_a_seeded_permutation() {
        let owned = batch();
        let mut c = cfg(LossMode::Vanilla);
        c.mini_batch_size = Some(2);
        c.shuffle = true;
        let run = |seed: u64| {
            let mut m = Bigram::random(6, 4);
            let mut c = c.clone();
            c.seed = seed;
            train(&mut m, &owned.data(), &c, 0, &mut |_| {}).unwrap();
            m.theta
        };
        assert_eq!(run(1), run(1));
        let (a, b) = (run(1), run(2));
        assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-9));
    }

    #[test]
    fn advantages_favouring_a_response_raise_its_probability() {
        // Two responses to one prompt: +1 for [1, 2], −1 for [3, 4].
        let owned = Owned::new(&[(vec![0], vec![1, 2], 1.0), (vec![0], vec![3, 4], -1.0)]);
        let mut model = Bigram::random(6, 5);
        let lp = |m: &Bigram| {
            let (a, _) = m.token_stats(0, 1, 1.0);
            let (b, _) = m.token_stats(1, 2, 1.0);
            a + b
        };
        let before = lp(&model);
        let c = cfg(LossMode::Vanilla);
        for step in 0..20 {
            train(&mut model, &owned.data(), &c, step, &mut |_| {}).unwrap();
        }
        assert!(lp(&model) > before + 1.0, "{before} -> {}", lp(&model));
    }

    #[test]
    fn non_finite_loss_skips_the_step() {
        let owned = batch();
        let mut model = Bigram::random(6, 6);
        model.poison = true;
        let before = model.theta.clone();
        let mut notes = vec![];
        let r = train(
            &mut model,
            &owned.data(),
            &cfg(LossMode::Vanilla),
            0,
            &mut |m| notes.push(m.to_string()),
        )
        .unwrap();
        assert!(r.steps[0].skipped);
        assert_eq!(model.theta, before);
        assert_eq!(model.steps, 0);
        assert!(
            notes.iter().any(|n| n.contains("optimizer step skipped")),
            "{notes:?}"
        );
        let j = r.to_json();
        assert_eq!(j["skipped_steps"], 1);
        assert!(j["grad_norm"].is_null());
    }

    #[test]
    fn device_loss_matches_the_host_loss() {
        use crate::backend::cpu::Cpu;
        use crate::model::decoder::Decoder;
        // A tiny decoder trained both ways: off-policy (old log-probs given, so ratios clip),
        // several micro-batches, a masked token, seq-mean-token-mean, an entropy bonus.
        // The `bench update --shape tiny` model (2 layers, hidden 64, 4/2 heads, vocab 512).
        let cfg = crate::model::Config {
            vocab_size: 512,
            rope_theta: 1_000_000.0,
            max_position_embeddings: 32768,
            eos_token_ids: vec![],
            ..crate::model::Config::small_qwen2()
        };
        let weights = crate::model::init::random_weights(&cfg, 3, 0.5);
        let mut owned = batch();
        owned.masks[0][1] = 0;
        let old: Vec<Vec<f32>> = owned
            .responses
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (0..r.len())
                    .map(|t| -6.5 + 0.4 * ((i + t) % 4) as f32)
                    .collect()
            })
            .collect();
        let mut c = cfg_for_decoder();
        c.loss.agg = AggMode::SeqMeanTokenMean;
        c.loss.entropy_coeff = 0.01;
        c.micro_batch_tokens = 6;
        let run = |device: bool| {
            let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
            let mut d = owned.data();
            d.old = Some(old.iter().map(Vec::as_slice).collect());
            let c = TrainConfig {
                device_loss: device,
                ..c.clone()
            };
            let r = train(&mut dec, &d, &c, 0, &mut |_| {}).unwrap();
            (r, dec.export_weights().unwrap())
        };
        let (rh, wh) = run(false);
        let (rd, wd) = run(true);
        assert!(rd.steps[0].device_loss && !rh.steps[0].device_loss);
        let (sh, sd) = (&rh.steps[0], &rd.steps[0]);
        assert!(
            sh.metrics.pg_clipfrac > 0.0,
            "the case clips: {:?}",
            sh.metrics
        );
        let close = |a: f64, b: f64, what: &str| {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1e-3),
                "{what}: host {a} device {b}"
            )
        };
        close(sh.loss, sd.loss, "loss");
        close(sh.metrics.pg_loss, sd.metrics.pg_loss, "pg_loss");
        close(sh.metrics.pg_clipfrac, sd.metrics.pg_clipfrac, "clipfrac");
        close(
            sh.metrics.pg_clipfrac_lower,
            sd.metrics.pg_clipfrac_lower,
            "clipfrac_lower",
        );
        close(sh.metrics.ppo_kl, sd.metrics.ppo_kl, "ppo_kl");
        close(sh.metrics.entropy, sd.metrics.entropy, "entropy");
        close(sh.grad_norm as f64, sd.grad_norm as f64, "grad_norm");
        for (name, t) in &wh {
            crate::backend::check::assert_close(&wd[name].data, &t.data, 1e-6, name);
        }
    }

    /// The critic through the loop (`TrainConfig::critic`): split into micro-batches of a few
    /// tokens it takes the same step as unsplit (the value loss is normalised by the
    /// mini-batch's totals, as the policy loss is), the masked token takes no part, and the
    /// loss is the value loss of the values before the step.
    #[test]
    fn the_critic_trains_the_same_whatever_the_micro_batches() {
        use crate::algo::value_loss::ValueLoss;
        use crate::backend::cpu::Cpu;
        use crate::model::decoder::Decoder;
        let pcfg = crate::model::Config {
            vocab_size: 512,
            eos_token_ids: vec![],
            ..crate::model::Config::small_qwen2()
        };
        let (cfg, mut weights) = crate::model::critic::value_model_from(
            &pcfg,
            crate::model::init::random_weights(&pcfg, 5, 0.5),
        );
        let head = crate::model::names::VALUE_HEAD;
        weights.get_mut(head).unwrap().data = (0..cfg.hidden_size)
            .map(|i| 0.05 * ((i % 7) as f32 - 3.0))
            .collect();
        let mut owned = batch();
        owned.masks[0][1] = 0;
        // Row 1's old values are far from its values and return: its clipped term is the larger.
        let old: Vec<Vec<f32>> = owned
            .responses
            .iter()
            .enumerate()
            .map(|(i, r)| vec![if i == 1 { 2.0 } else { 0.1 }; r.len()])
            .collect();
        let mut c = cfg_for_decoder();
        c.critic = Some(ValueLoss {
            cliprange: 0.2,
            agg: AggMode::SeqMeanTokenMean,
        });
        let run = |tokens: usize| {
            let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
            let mut d = owned.data();
            d.old = Some(old.iter().map(Vec::as_slice).collect());
            // The returns: the rows' advantages.
            d.returns = d.advantages.take();
            let c = TrainConfig {
                micro_batch_tokens: tokens,
                ..c.clone()
            };
            let r = train(&mut dec, &d, &c, 0, &mut |_| {}).unwrap();
            (r, dec.export_weights().unwrap())
        };
        let (whole, w1) = run(10_000);
        let (split, w2) = run(3);
        assert!(whole.critic && whole.steps.len() == 1);
        let (a, b) = (&whole.steps[0], &split.steps[0]);
        assert!(
            (a.loss - b.loss).abs() < 1e-6 * a.loss.abs().max(1.0),
            "{} {}",
            a.loss,
            b.loss
        );
        assert!((a.metrics.vf_loss - a.loss).abs() < 1e-12);
        assert!(
            a.metrics.vf_clipfrac > 0.0 && a.metrics.vf_clipfrac < 1.0,
            "{:?}",
            a.metrics
        );
        for (name, t) in &w1 {
            crate::backend::check::assert_close(&w2[name].data, &t.data, 1e-6, name);
        }
        let j = whole.to_json();
        assert_eq!(j["critic"]["vf_loss"], a.metrics.vf_loss);
        assert!(j.get("pg_loss").is_none());
    }

    /// Adam at lr 1e-3 on the tiny decoder (`cfg` uses lr 0.5 for the bigram).
    fn cfg_for_decoder() -> TrainConfig {
        let mut c = cfg(LossMode::Vanilla);
        c.lr = LrConfig::constant(1e-3);
        // Adam's first step is lr·g/(|g| + eps): a large eps keeps it proportional to g, so
        // rounding-level gradient differences cannot flip an element's step.
        c.eps = 1.0;
        c
    }

    /// Observation tokens (mask 0 inside a response: tool output, template markers) change
    /// nothing: for every policy loss and every loss-agg-mode, with a KL loss, an entropy bonus
    /// and rollout correction, other advantages and old/ref/rollout log-probs on them give the
    /// same losses, metrics and weights, to the bit.
    #[test]
    fn observation_tokens_change_no_loss() {
        use crate::algo::kl::{KlKind, KlPenalty};
        use crate::algo::policy_loss::{KlLoss, RolloutIs, RolloutIsLevel};
        use crate::backend::cpu::Cpu;
        use crate::model::decoder::Decoder;
        let cfg = crate::model::Config {
            vocab_size: 64,
            eos_token_ids: vec![],
            ..crate::model::Config::small_qwen2()
        };
        let weights = crate::model::init::random_weights(&cfg, 4, 0.5);
        let mut owned = batch();
        // Observations in the middle and at the end of rows.
        owned.masks[0][1] = 0;
        owned.masks[4][1] = 0;
        owned.masks[4][2] = 0;
        owned.masks[1][1] = 0;
        let per_token = |base: f32, masked: Option<f32>, owned: &Owned| -> Vec<Vec<f32>> {
            owned
                .masks
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    m.iter()
                        .enumerate()
                        .map(|(t, &v)| match (v, masked) {
                            (0, Some(x)) => x,
                            _ => base + 0.3 * ((i + t) % 3) as f32,
                        })
                        .collect()
                })
                .collect()
        };
        let run = |mode: LossMode, agg: AggMode, masked: Option<f32>| {
            let (old, rf, roll) = (
                per_token(-4.0, masked.map(|x| x - 1.0), &owned),
                per_token(-4.2, masked, &owned),
                per_token(-3.9, masked.map(|x| x + 2.0), &owned),
            );
            let adv: Vec<Vec<f32>> = owned
                .adv
                .iter()
                .zip(&owned.masks)
                .map(|(a, m)| {
                    a.iter()
                        .zip(m)
                        .map(|(&x, &v)| match (v, masked) {
                            (0, Some(y)) => y * 10.0,
                            _ => x,
                        })
                        .collect()
                })
                .collect();
            let mut c = cfg_for_decoder();
            c.loss = LossConfig::new(mode);
            c.loss.agg = agg;
            c.loss.entropy_coeff = 0.01;
            c.mini_batch_size = Some(3);
            if mode != LossMode::Sft {
                c.loss.kl_loss = Some(KlLoss {
                    coef: 0.1,
                    penalty: KlPenalty {
                        kind: KlKind::K3,
                        straight_through: false,
                    },
                });
                c.loss.rollout_is = Some(RolloutIs {
                    level: RolloutIsLevel::Token,
                    threshold: 2.0,
                });
            }
            let mut d = owned.data();
            d.advantages = Some(adv.iter().map(Vec::as_slice).collect());
            if mode != LossMode::Sft {
                d.old = Some(old.iter().map(Vec::as_slice).collect());
                d.ref_lp = Some(rf.iter().map(Vec::as_slice).collect());
                d.rollout = Some(roll.iter().map(Vec::as_slice).collect());
            }
            let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
            let r = train(&mut dec, &d, &c, 0, &mut |_| {}).unwrap();
            let steps: Vec<_> = r
                .steps
                .iter()
                .map(|s| (s.loss, s.metrics, s.grad_norm))
                .collect();
            (
                steps,
                r.mismatch.map(|m| m.0),
                dec.export_weights().unwrap(),
            )
        };
        for mode in [
            LossMode::Vanilla,
            LossMode::Gspo,
            LossMode::Cispo,
            LossMode::Sft,
        ] {
            for agg in [
                AggMode::TokenMean,
                AggMode::SeqMeanTokenSum,
                AggMode::SeqMeanTokenMean,
                AggMode::SeqMeanTokenSumNorm,
            ] {
                let a = run(mode, agg, None);
                let b = run(mode, agg, Some(-0.5));
                assert_eq!(a.0.len(), 2, "two mini-batches");
                assert!(a.0.iter().all(|s| s.0 != 0.0 && s.0.is_finite()));
                assert_eq!(a.0, b.0, "{mode:?} {agg:?}: losses and metrics");
                assert_eq!(a.1, b.1, "{mode:?} {agg:?}: mismatch");
                assert!(a.2 == b.2, "{mode:?} {agg:?}: weights");
                assert_eq!(a.1.is_some(), mode != LossMode::Sft);
            }
        }
    }

    #[test]
    fn sft_lowers_the_nll() {
        let owned = Owned::new(&[(vec![0], vec![1, 2, 3], 0.0), (vec![2], vec![5, 5], 0.0)]);
        let mut model = Bigram::random(6, 7);
        let nll = |m: &mut Bigram| -> f32 {
            let d = owned.data();
            let s = score(m, &d.rows, 1.0, false, 100, &mut |_| {}).unwrap();
            -s.iter().flat_map(|x| x.logprobs.iter()).sum::<f32>()
        };
        let before = nll(&mut model);
        let mut c = cfg(LossMode::Sft);
        c.lr = LrConfig::constant(0.2);
        for step in 0..5 {
            let mut d = owned.data();
            d.advantages = None;
            train(&mut model, &d, &c, step, &mut |_| {}).unwrap();
        }
        assert!(
            nll(&mut model) < before - 0.5,
            "{before} -> {}",
            nll(&mut model)
        );
    }

    /// The rollout-vs-trainer mismatch comes from the trainer's log-probs before any optimizer
    /// step: the whole batch when on-policy or when old log-probs are recomputed, the first
    /// mini-batch when the old ones are given (bypass mode: the rollout's).
    #[test]
    fn mismatch_is_measured_before_any_step() {
        let owned = batch();
        let d0 = owned.data();
        let lp: Vec<Vec<f32>> = score(
            &mut Bigram::random(6, 3),
            &d0.rows,
            1.0,
            false,
            100,
            &mut |_| {},
        )
        .unwrap()
        .into_iter()
        .map(|s| s.logprobs)
        .collect();
        // The rollout is off by 0.05 on even rows and agrees on odd ones.
        let rollout: Vec<Vec<f32>> = lp
            .iter()
            .enumerate()
            .map(|(i, r)| r.iter().map(|&x| x - 0.05 * ((i + 1) % 2) as f32).collect())
            .collect();
        let rows = |v: &[Vec<f32>], which: &[usize]| -> Vec<Vec<f32>> {
            which.iter().map(|&i| v[i].clone()).collect()
        };
        let expect = |which: &[usize]| {
            let (t, r) = (rows(&lp, which), rows(&rollout, which));
            let m: Vec<&[u8]> = which.iter().map(|&i| d0.mask[i]).collect();
            let t: Vec<&[f32]> = t.iter().map(Vec::as_slice).collect();
            let r: Vec<&[f32]> = r.iter().map(Vec::as_slice).collect();
            Mismatch::of_rows(&t, &r, &m).unwrap()
        };
        let run = |mbs: Option<usize>, old_is_rollout: bool| {
            let mut c = cfg(LossMode::Vanilla);
            c.mini_batch_size = mbs;
            let mut d = owned.data();
            d.rollout = Some(rollout.iter().map(Vec::as_slice).collect());
            if old_is_rollout {
                d.old = d.rollout.clone();
            }
            train(&mut Bigram::random(6, 3), &d, &c, 0, &mut |_| {})
                .unwrap()
                .mismatch
                .expect("measured")
        };
        let all = [0, 1, 2, 3, 4];
        let (m, src) = run(None, false);
        assert_eq!((&m, src), (&expect(&all), "first_step"));
        assert_eq!(m.tokens(), 10);
        let (m, src) = run(Some(2), false);
        assert_eq!((&m, src), (&expect(&all), "recomputed_old"));
        // Old given, two rows per mini-batch: rows 0 and 1 before the first step.
        let (m, src) = run(Some(2), true);
        assert_eq!((&m, src), (&expect(&[0, 1]), "first_step"));
        assert_eq!(m.tokens(), 5);
        let j = m.to_json();
        assert!(
            (j["abs_diff_mean"].as_f64().unwrap() - 0.03).abs() < 1e-6,
            "{j}"
        );
        // Without rollout log-probs nothing is measured.
        let d = owned.data();
        let r = train(
            &mut Bigram::random(6, 3),
            &d,
            &cfg(LossMode::Vanilla),
            0,
            &mut |_| {},
        );
        assert!(r.unwrap().mismatch.is_none());
    }
}
