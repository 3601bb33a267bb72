//! `update --model DIR --in B --out-model DIR2`: policy-gradient (or SFT) training on one batch
//! with verl's knobs; writes the new model (HF layout, bf16) with its optimizer state and
//! trainer state next to it, so the next `update --model DIR2` resumes exactly.
//!
//! On the warm daemon, `--resident` keeps the new weights and optimizer state in the daemon's
//! memory instead: DIR2 then holds the config, the tokenizer and `resident.json` (the daemon's
//! socket, the step), which only that daemon serves; `tandem daemon-ctl save` writes the files
//! (`super::save`) as this stage would have. Loading, holding and writing the policy is the
//! policy store's (`crate::engine::policy`); this stage reads the batch, trains on its `Exec`
//! and reports.
//!
//! Rollout correction (verl's `rollout_corr`): the mismatch between the rollout's and the
//! trainer's log-probs is measured on every call that has rollout_logprobs (`mismatch` in the
//! metrics); `--rollout-is` truncates and `--rollout-rs` masks by the importance weight
//! exp(old − rollout); `--bypass-mode` takes the rollout's log-probs as the old ones.
//!
//! `--critic` trains a critic (a value model) instead, on the batch's `values` and `returns`
//! with verl's clipped value loss (`crate::algo::value_loss`): the same flags, loop and
//! checkpoints, so the pipeline's critic is this stage in a mode, not a stage of its own.

use super::common::{
    above, after_rank0, at_least, between, check_token_ids, finite, logprob_temperature,
    negative_numbers, range, require_tokenizer, resolve_model, same_path, Device, LoraFlags,
    ModelRef, DEFAULT_TEMPERATURE,
};
use super::ref_logprob::to_u32;
use super::{Exec, Job};
use crate::algo::agg::{AggMode, AGG_MODE_NAMES};
use crate::algo::kl::KlPenalty;
use crate::algo::policy_loss::{KlLoss, LossConfig, LossMode, RolloutIs, RolloutIsLevel};
use crate::algo::rollout_corr::{Mismatch, RolloutRs, RsLevel, RsStats};
use crate::algo::value_loss::{explained_variance, ValueLoss};
use crate::backend::Backend;
use crate::bail_input;
use crate::batch::{schema, schema::meta, write_json, Batch, Ragged};
use crate::engine::logprob::PromptResponse;
use crate::engine::policy::{
    is_adapter_dir, lora_base, shard_staging, write_checkpoint, write_lora_checkpoint,
    write_resident, Holder, Sharding, Train, Trainable, Trained,
};
use crate::engine::resume::TrainerState;
use crate::engine::shard::{ShardMode, DEFAULT_BUCKET_ELEMS};
use crate::engine::train::{LrConfig, LrSchedule, TrainConfig, TrainData};
use crate::error::input_error;
use crate::model::checkpoint::{ModelDir, ResidentMarker};
use crate::model::lora::LoraSpec;
use crate::model::Config;
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
    /// Train a critic (value model) instead of the policy, with verl's clipped value loss
    /// aggregated by --loss-agg-mode: --model is the critic's checkpoint, or the policy's model
    /// the first time (a critic from it with a zero value head); the batch needs `values`
    /// (the `values` stage) and `returns` (advantage --estimator gae); --out-model gets an
    /// HF token classifier with one label. The policy-loss flags do not apply.
    #[arg(long)]
    #[serde(default)]
    pub critic: bool,
    /// With --critic: verl's cliprange_value c, >= 0; the value may move c away from the
    /// batch's `values` before the clipped term takes over.
    #[arg(long, default_value_t = 0.5, value_parser = at_least(0.0f64))]
    #[serde(default = "default_cliprange_value")]
    pub cliprange_value: f64,
    #[command(flatten)]
    #[serde(flatten)]
    pub lora: LoraFlags,
}

fn default_cliprange_value() -> f64 {
    0.5
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

/// In-process update: build the loaded policy on the backend and train it.
pub(crate) struct TrainFresh<'a> {
    pub(crate) loaded: Trainable,
    pub(crate) job: Train<'a>,
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

impl UpdateArgs {
    /// Checks the flags as the stage does before reading its input.
    pub fn check(&self) -> Result<()> {
        let t = self.temperature.unwrap_or(DEFAULT_TEMPERATURE);
        let cfg = self.train_config(t)?;
        self.check_critic()?;
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

    /// `--critic` trains with the value loss: the policy loss's own flags are refused.
    fn check_critic(&self) -> Result<()> {
        if !self.critic {
            return Ok(());
        }
        let policy_only = [
            ("--use-kl-loss", self.use_kl_loss),
            ("--rollout-is", self.rollout_is.is_some()),
            ("--rollout-rs", self.rollout_rs.is_some()),
            ("--bypass-mode", self.bypass_mode),
            ("--entropy-coeff", self.entropy_coeff != 0.0),
            ("--loss", self.loss != LossMode::Vanilla),
        ];
        if let Some((flag, _)) = policy_only.iter().find(|(_, set)| *set) {
            bail_input!(
                "{flag} does not apply to --critic (the critic trains with the value loss)"
            );
        }
        Ok(())
    }

    /// Masked importance sampling as the flags configure it.
    pub(crate) fn rejection(&self) -> Result<Option<RolloutRs>> {
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
            critic: self.critic.then_some(ValueLoss {
                cliprange: self.cliprange_value,
                agg: self.loss_agg_mode,
            }),
            lora: self.lora_spec()?,
        })
    }

    /// The LoRA spec the flags ask for (None: full fine-tuning).
    pub fn lora_spec(&self) -> Result<Option<LoraSpec>> {
        let Some(spec) = self.lora.spec()? else {
            return Ok(None);
        };
        if self.critic {
            bail_input!("--lora-rank trains a policy's adapters; it does not apply to --critic");
        }
        if self.shard == Some(ShardMode::Full) {
            bail_input!(
                "--shard full with --lora-rank: the frozen base has no optimizer state and stays whole on every rank, and the default --shard zero2 already shards all of the adapters' state; drop --shard full"
            );
        }
        Ok(Some(spec))
    }
}

/// Columns the options need, with the flag that needs each (for the error message).
fn required_columns(args: &UpdateArgs, cfg: &TrainConfig) -> Vec<(&'static str, &'static str)> {
    let mut cols = vec![
        (schema::PROMPT_IDS, "update"),
        (schema::RESPONSE_IDS, "update"),
        (schema::RESPONSE_MASK, "update"),
    ];
    if args.critic {
        cols.push((schema::VALUES, "--critic (run the values stage first)"));
        cols.push((
            schema::RETURNS,
            "--critic (run advantage --estimator gae first)",
        ));
        return cols;
    }
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
    returns: Option<Ragged<'static, f32>>,
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
        let critic = cfg.critic.is_some();
        Ok(OwnedData {
            prompts,
            responses: batch
                .ragged_i32(schema::RESPONSE_IDS)?
                .rows()
                .map(to_u32)
                .collect(),
            mask: batch.ragged_u8(schema::RESPONSE_MASK)?,
            advantages: opt(
                schema::ADVANTAGES,
                !critic && cfg.loss.mode != LossMode::Sft,
            )?,
            // A critic's old values are the batch's `values`.
            old: match critic {
                true => opt(schema::VALUES, true)?,
                false => opt(schema::OLD_LOGPROBS, true)?,
            },
            ref_lp: opt(schema::REF_LOGPROBS, !critic && cfg.loss.kl_loss.is_some())?,
            rollout: opt(schema::ROLLOUT_LOGPROBS, !critic)?,
            returns: opt(schema::RETURNS, critic)?,
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
            returns: rows_of(&self.returns),
        }
    }
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
    if let Some(m) = &args.metrics {
        super::common::refuse_in_place(&args.input, m, "metrics")?;
    }
    // Before anything is read: where resident weights would stay.
    let holder = match args.resident {
        false => None,
        true => Some(exec.holder().ok_or_else(|| {
            input_error(
                "--resident keeps the new weights in the warm daemon's memory: it needs --daemon SOCKET (or TANDEM_DAEMON)",
            )
        })?),
    };
    let input = Input::read(&args)?;
    if input.cfg.lora.is_none() && is_adapter_dir(&input.model.dir) {
        bail_input!(
            "{}: is a LoRA adapter: continue it with --lora-rank (and its alpha and targets), or \
             train every weight from `tandem merge-lora`'s merged model",
            input.model.dir.display()
        );
    }
    let owned = OwnedData::from_batch(&input.batch, &input.cfg)?;
    let correction = Correction::of(&args, &owned)?;
    let data = correction.data(&args, &owned);
    // The policy is loaded (and its optimizer resumed when its state sits next to the model)
    // by `exec`, or already held by the daemon.
    let trained = train_on(&args, exec, &input, &data)?;
    let trainer = TrainerState {
        optimizer_step: trained.optimizer_step,
        schedule_step: trained.schedule_step + 1,
        lr: trained.report.lr,
        lr_schedule: input.cfg.lr,
        seed: input.cfg.seed,
        optimizer_not_saved: trained.state.is_none() && trained.shard_files.is_empty(),
        optimizer_shards: trained.shard_files.len(),
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
    write_outputs(&args, &input, holder.as_ref(), &trained, &trainer)?;
    if group_holds {
        after_rank0(exec)?;
    }
    exec.saved(&args.out_model, Some(&trainer))?;
    let save_seconds = save_started.elapsed().as_secs_f64();
    let mut metrics = metrics(&args, &trained, &trainer, &correction, save_seconds);
    if args.critic {
        // verl's critic/vf_explained_var: how much of the returns the batch's values explain.
        let (ret, val, mask) = (&data.returns, &data.old, &data.mask);
        let ev = match (ret, val) {
            (Some(r), Some(v)) => explained_variance(r, v, mask),
            _ => None,
        };
        metrics["critic"]["vf_explained_var"] = ev.into();
    }
    if let Some(path) = &args.metrics {
        write_json(path, &metrics)?;
    }
    let report = &trained.report;
    exec.log(&format!(
        "update: {} rows, {} optimizer steps ({} skipped), loss {:.5}, grad_norm {}, lr {:.3e}, {:.0} tokens/s -> {}{} in {:.2}s",
        input.batch.num_rows(),
        report.steps.len(),
        report.steps.iter().filter(|s| s.skipped).count(),
        metrics["loss"].as_f64().unwrap_or(f64::NAN),
        match args.critic {
            true => &metrics["critic"]["grad_norm"],
            false => &metrics["grad_norm"],
        },
        report.lr,
        metrics["tokens_per_s"].as_f64().unwrap_or(0.0),
        args.out_model.display(),
        if holder.is_some() { " (weights resident in the daemon)" } else { "" },
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// What the stage reads and checks before training: the batch (the columns the options
/// need), the training configuration, the policy `--model` names and its config.
struct Input {
    batch: Batch,
    cfg: TrainConfig,
    model: ModelRef,
    mcfg: Config,
}

impl Input {
    fn read(args: &UpdateArgs) -> Result<Input> {
        let batch = Batch::read(&args.input, &[])?;
        batch.require_rows()?;
        let cfg = args.train_config(logprob_temperature(&batch, args.temperature)?)?;
        let needs = required_columns(args, &cfg);
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
        if let Some(row) = batch.baseline_rows()?.iter().position(|&b| b) {
            bail_input!(
                "{}, row {row}: a greedy baseline row ({} = true) is not a sample to train on; `advantage` takes the baseline rows out of the batch it writes",
                batch.at(schema::IS_BASELINE),
                schema::IS_BASELINE
            );
        }
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
        let mut mcfg = ModelDir::load_config(&model.dir)?;
        match (args.critic, mcfg.value_head) {
            // A policy's model: the critic starts from it (`Trainable::load_critic`).
            (true, _) => mcfg.value_head = true,
            (false, true) => bail_input!(
                "--model {}: is a value model (a critic); train it with update --critic",
                args.model.display()
            ),
            (false, false) => {}
        }
        // The model written carries --model's tokenizer files: refused before any training.
        require_tokenizer(
            &model.dir,
            "the model `update` writes would have no tokenizer",
        )?;
        check_token_ids(&batch, schema::PROMPT_IDS, mcfg.vocab_size)?;
        check_token_ids(&batch, schema::RESPONSE_IDS, mcfg.vocab_size)?;
        Ok(Input {
            batch,
            cfg,
            model,
            mcfg,
        })
    }
}

/// Rollout correction before training: the mismatch measured from the columns, and the mask
/// with the tokens masked importance sampling rejects.
struct Correction {
    /// Measured here when the old-logprob pass ran; otherwise the training loop measures it on
    /// its first forward (it gets the rollout's log-probs).
    from_columns: Option<Mismatch>,
    /// `--rollout-rs`: the response mask without the rejected tokens, and what was rejected.
    rejected: Option<(Vec<Vec<u8>>, RsStats)>,
}

impl Correction {
    fn of(args: &UpdateArgs, owned: &OwnedData) -> Result<Correction> {
        let mask = rows_u8(&owned.mask);
        let (old, rollout) = (rows_of(&owned.old), rows_of(&owned.rollout));
        let from_columns = match (&old, &rollout) {
            (Some(old), Some(roll)) => Some(Mismatch::of_rows(old, roll, &mask)?),
            _ => None,
        };
        // Under --bypass-mode the rollout's log-probs are the old ones.
        let old = if args.bypass_mode { &rollout } else { &old };
        let rejected = match (args.rejection()?, old, &rollout) {
            (Some(rs), Some(old), Some(roll)) => Some(rs.apply(old, roll, &mask)?),
            _ => None,
        };
        Ok(Correction {
            from_columns,
            rejected,
        })
    }

    /// What training reads: `owned` with the old log-probs, the rollout's and the mask as the
    /// options and this correction make them.
    fn data<'a>(&'a self, args: &UpdateArgs, owned: &'a OwnedData) -> TrainData<'a> {
        let mut data = owned.view();
        if args.bypass_mode {
            data.old = data.rollout.clone();
        }
        // The loop needs the rollout's log-probs only to measure the mismatch or to weigh.
        if self.from_columns.is_some() && args.rollout_is.is_none() {
            data.rollout = None;
        }
        if let Some((mask, _)) = &self.rejected {
            data.mask = mask.iter().map(Vec::as_slice).collect();
        }
        data
    }
}

/// Trains on `exec`: alone, or this rank's part among the ranks with the sharded optimizer.
fn train_on(
    args: &UpdateArgs,
    exec: &mut dyn Exec,
    input: &Input,
    data: &TrainData<'_>,
) -> Result<Trained> {
    let job = Train {
        data,
        train: &input.cfg,
        export_weights: !args.resident,
        export_state: !args.skip_optimizer_state && !args.resident,
    };
    match exec.ranks() {
        None => exec.train(&input.model, job),
        Some(_) => {
            let sharding = Sharding {
                mode: args.shard.unwrap_or_default(),
                bucket_elems: args.bucket_elems.unwrap_or(DEFAULT_BUCKET_ELEMS),
                device: args.device.kind(),
                staging: shard_staging(&args.out_model),
            };
            exec.train_sharded(&input.model, job, sharding)
        }
    }
}

/// Rank 0 writes the trained policy to `--out-model`: a resident directory (the weights stay
/// with `holder`), or the checkpoint files.
fn write_outputs(
    args: &UpdateArgs,
    input: &Input,
    holder: Option<&Holder>,
    trained: &Trained,
    trainer: &TrainerState,
) -> Result<()> {
    if let (Some(spec), Some(w)) = (&input.cfg.lora, &trained.weights) {
        let base = match &trained.lora_base {
            Some(b) => b.clone(),
            None => lora_base(&input.model.dir)?,
        };
        let state = trained.state.as_ref();
        return write_lora_checkpoint(&args.out_model, &base, spec, w, state, trainer);
    }
    match (holder, &trained.weights) {
        (Some(h), _) => write_resident(
            &args.out_model,
            // A LoRA policy's config and tokenizer files are its base's.
            trained.lora_base.as_deref().unwrap_or(&input.model.dir),
            &input.mcfg,
            &ResidentMarker {
                socket: h.socket.clone(),
                pid: h.pid,
                step: trainer.schedule_step,
                from_policy_version: input.model.policy_version,
            },
        ),
        (None, Some(w)) => write_checkpoint(
            &args.out_model,
            &input.model.dir,
            &input.mcfg,
            w,
            trained.state.as_ref(),
            &trained.shard_files,
            trainer,
        ),
        (None, None) => anyhow::bail!("update: the trained weights were not brought back"),
    }
}

/// The `--metrics` JSON: the training report with what was saved and the rollout correction.
fn metrics(
    args: &UpdateArgs,
    trained: &Trained,
    trainer: &TrainerState,
    correction: &Correction,
    save_seconds: f64,
) -> serde_json::Value {
    let report = &trained.report;
    let mut metrics = report.to_json();
    let m = metrics.as_object_mut().expect("object");
    m.insert("optimizer_step".into(), trained.optimizer_step.into());
    m.insert(
        "optimizer_state_saved".into(),
        (trained.state.is_some() || !trained.shard_files.is_empty()).into(),
    );
    m.insert("optimizer_shards".into(), trained.shard_files.len().into());
    m.insert("weights_saved".into(), (!args.resident).into());
    m.insert("schedule_step".into(), trainer.schedule_step.into());
    m.insert("on_policy".into(), report.on_policy.into());
    m.insert("bypass_mode".into(), args.bypass_mode.into());
    m.insert("device".into(), args.device.to_string().into());
    m.insert("load_seconds".into(), trained.load_seconds.into());
    m.insert("save_seconds".into(), save_seconds.into());
    let mismatch = match (&correction.from_columns, &report.mismatch) {
        (Some(m), _) => Some((m.to_json(), "old_logprobs")),
        (None, Some((m, source))) => Some((m.to_json(), *source)),
        (None, None) => None,
    };
    if let Some((mut j, source)) = mismatch {
        j["source"] = source.into();
        m.insert("mismatch".into(), j);
    }
    if let Some((_, stats)) = &correction.rejected {
        m.insert("rollout_rs".into(), stats.to_json());
    }
    metrics
}
