//! `update --model DIR --in B --out-model DIR2`: policy-gradient (or SFT) training on one batch
//! with verl's knobs; writes the new model (HF layout, bf16) with its optimizer state and
//! trainer state next to it, so the next `update --model DIR2` resumes exactly.

use super::common::{
    above, at_least, between, check_token_ids, finite, logprob_temperature, negative_numbers,
    range, require_tokenizer, resolve_model, Device, DEFAULT_TEMPERATURE,
};
use super::ref_logprob::to_u32;
use super::{Exec, Job};
use crate::algo::agg::{AggMode, AGG_MODE_NAMES};
use crate::algo::kl::KlPenalty;
use crate::algo::policy_loss::{KlLoss, LossConfig, LossMode, RolloutIs, RolloutIsLevel};
use crate::backend::Backend;
use crate::bail_input;
use crate::batch::{schema, write_json, Batch, Ragged};
use crate::engine::logprob::PromptResponse;
use crate::engine::resume::{self, TrainerState, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use crate::engine::train::{train, LrConfig, LrSchedule, TrainConfig, TrainData, TrainReport};
use crate::error::input_error;
use crate::model::checkpoint::{ModelDir, SaveOptions};
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::safetensors::DEFAULT_MAX_SHARD_BYTES;
use crate::model::{Config, Weights};
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
}

impl Trainable {
    /// Reads a model directory and the optimizer state next to it.
    pub fn load(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        let (cfg, weights) = ModelDir::load(dir)?;
        let Some(r) = resume::load(dir, &weights)? else {
            return Ok(Trainable {
                cfg,
                weights,
                from_master: false,
                optimizer: None,
                schedule_step: 0,
            });
        };
        if r.master.is_none() {
            log(&format!(
                "update: {}: f32 master weights absent or not matching the model files; continuing from the bf16 weights",
                dir.display()
            ));
        }
        let from_master = r.master.is_some();
        Ok(Trainable {
            cfg,
            weights: r.master.unwrap_or(weights),
            from_master,
            optimizer: Some(r.optimizer),
            schedule_step: r.trainer.schedule_step,
        })
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
    /// Bring the optimizer state back to the host (it is written next to the model).
    export_state: bool,
}

/// The trained policy as the stage writes it.
pub struct Trained {
    pub report: TrainReport,
    /// The f32 (master) weights.
    pub weights: Weights,
    /// The optimizer state, when the job asked for it.
    pub state: Option<OptimizerState>,
    /// AdamW steps taken so far.
    pub optimizer_step: u64,
    /// Training steps done before this call.
    pub schedule_step: u64,
    pub load_seconds: f64,
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
        Ok(Trained {
            report,
            weights: policy.export_weights()?,
            state: match self.export_state {
                true => Some(policy.optimizer_state()?),
                false => None,
            },
            optimizer_step: policy.optimizer_steps(),
            schedule_step,
            load_seconds: 0.0,
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

impl UpdateArgs {
    /// Checks the flags as the stage does before reading its input.
    pub fn check(&self) -> Result<()> {
        let t = self.temperature.unwrap_or(DEFAULT_TEMPERATURE);
        self.train_config(t).map(|_| ())
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
        })
    }
}

/// Columns the options need, with the flag that needs each (for the error message).
fn required_columns(cfg: &TrainConfig) -> Vec<(&'static str, &'static str)> {
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
    /// Reads what `cfg` needs (and old_logprobs when present) from a batch that holds the
    /// required columns.
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
            rollout: opt(schema::ROLLOUT_LOGPROBS, cfg.loss.rollout_is.is_some())?,
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

/// The stage with its compute on `exec`.
pub fn run(args: UpdateArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    args.check()?;
    let batch = Batch::read(&args.input, &[])?;
    batch.require_rows()?;
    let cfg = args.train_config(logprob_temperature(&batch, args.temperature)?)?;
    let needs = required_columns(&cfg);
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
    let mcfg = ModelDir::load_config(&model.dir)?;
    // The model written carries --model's tokenizer files: refused before any training.
    require_tokenizer(
        &model.dir,
        "the model `update` writes would have no tokenizer",
    )?;
    check_token_ids(&batch, schema::PROMPT_IDS, mcfg.vocab_size)?;
    check_token_ids(&batch, schema::RESPONSE_IDS, mcfg.vocab_size)?;

    let owned = OwnedData::from_batch(&batch, &cfg)?;
    let data = owned.view();

    // The policy is loaded (and its optimizer resumed when its state sits next to the model)
    // by `exec`, or already held by the daemon.
    let job = Train {
        data: &data,
        train: &cfg,
        export_state: !args.skip_optimizer_state,
    };
    let Trained {
        report,
        weights: new_weights,
        state,
        optimizer_step,
        schedule_step,
        load_seconds: loaded_s,
    } = exec.train(&model, job)?;
    let trainer = TrainerState {
        optimizer_step,
        schedule_step: schedule_step + 1,
        lr: report.lr,
        lr_schedule: cfg.lr,
        seed: cfg.seed,
        optimizer_not_saved: state.is_none(),
    };
    let mut extra = vec![(
        TRAINER_STATE_FILE.to_string(),
        resume::trainer_state_bytes(&trainer)?,
    )];
    if let Some(state) = &state {
        extra.push((
            OPTIMIZER_FILE.to_string(),
            resume::optimizer_bytes(state, &new_weights)?,
        ));
    }
    let save_started = Instant::now();
    ModelDir::save_with(
        &args.out_model,
        &mcfg,
        &new_weights,
        &SaveOptions {
            tokenizer_from: Some(&model.dir),
            config_base: Some(&model.dir),
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            extra_files: &extra,
        },
    )?;
    exec.saved(&args.out_model)?;
    let mut metrics = report.to_json();
    let m = metrics.as_object_mut().expect("object");
    m.insert("optimizer_step".into(), optimizer_step.into());
    m.insert("optimizer_state_saved".into(), state.is_some().into());
    m.insert("schedule_step".into(), trainer.schedule_step.into());
    m.insert("on_policy".into(), report.on_policy.into());
    m.insert("device".into(), args.device.to_string().into());
    m.insert("load_seconds".into(), loaded_s.into());
    m.insert(
        "save_seconds".into(),
        save_started.elapsed().as_secs_f64().into(),
    );
    if let Some(path) = &args.metrics {
        write_json(path, &metrics)?;
    }
    exec.log(&format!(
        "update: {} rows, {} optimizer steps ({} skipped), loss {:.5}, grad_norm {}, lr {:.3e}, {:.0} tokens/s -> {} in {:.2}s",
        batch.num_rows(),
        report.steps.len(),
        report.steps.iter().filter(|s| s.skipped).count(),
        metrics["loss"].as_f64().unwrap_or(f64::NAN),
        metrics["grad_norm"],
        report.lr,
        metrics["tokens_per_s"].as_f64().unwrap_or(0.0),
        args.out_model.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
