//! `advantage --in B --out B2 --estimator NAME`: token rewards (score on the last valid token,
//! optionally minus β·KL), advantages and returns of a scored batch. The math lives in
//! `crate::algo`; this file reads flags and columns and writes the result.

use super::common::{above, at_least, between, negative_numbers};
use crate::algo::advantage::{self as adv, AdvInput, AdvParams, Groups, KlInReward};
use crate::algo::kl::{KlController, KlCtrl, KlPenalty, KlState};
use crate::bail_input;
use crate::batch::{list_array, schema, Batch, NewColumns, Ragged, StageInfo};
use anyhow::Result;
use arrow_array::types::Float32Type;
use arrow_array::Float32Array;
use clap::builder::PossibleValuesParser;
use clap::{ArgAction, Args, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// How β moves between steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Ctrl {
    Fixed,
    Adaptive,
}

#[derive(Args, Debug, Clone)]
#[command(
    about = "Compute token rewards, advantages and returns of a scored batch (verl's estimators)",
    mut_args = negative_numbers
)]
pub struct AdvantageArgs {
    /// Input batch (needs response_mask and score, plus what the options below name).
    #[arg(long = "in", value_name = "BATCH")]
    pub input: PathBuf,
    /// Output batch: the input's columns plus token_rewards, advantages, returns.
    #[arg(long, value_name = "BATCH")]
    pub out: PathBuf,
    /// Advantage estimator (verl's adv_estimator).
    #[arg(long, value_parser = PossibleValuesParser::new(adv::names()))]
    pub estimator: String,
    /// Discount factor γ in [0, 1] (reinforce_plus_plus, gae).
    #[arg(long, default_value_t = 1.0, value_parser = between(0.0f64, 1.0))]
    pub gamma: f64,
    /// GAE λ in [0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = between(0.0f64, 1.0))]
    pub lam: f64,
    /// GRPO: divide by the group's std (false = Dr.GRPO).
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_name = "true|false")]
    pub norm_by_std: bool,
    /// GRPO: added to the std before dividing, >= 0.
    #[arg(long, default_value_t = 1e-6, value_parser = at_least(0.0f64))]
    pub epsilon: f64,
    /// Subtract β·kl(old_logprobs, ref_logprobs) from every valid token's reward.
    #[arg(long)]
    pub kl_in_reward: bool,
    /// KL estimator: k1 (kl), abs, k2 (mse), k3 (low_var_kl).
    #[arg(long, default_value = "k1", requires = "kl_in_reward")]
    pub kl_penalty: KlPenalty,
    /// β, the KL coefficient, >= 0 (the starting β of the adaptive controller).
    #[arg(long, default_value_t = 0.001, requires = "kl_in_reward", value_parser = at_least(0.0f64))]
    pub kl_coef: f64,
    /// Keep β fixed, or adapt it towards --kl-target (state kept in --kl-state).
    #[arg(long, value_enum, default_value_t = Ctrl::Fixed, requires = "kl_in_reward")]
    pub kl_ctrl: Ctrl,
    /// Adaptive controller: the KL it steers to, > 0.
    #[arg(long, default_value_t = 0.1, requires = "kl_in_reward", value_parser = above(0.0f64))]
    pub kl_target: f64,
    /// Adaptive controller: horizon in samples, > 0.
    #[arg(long, default_value_t = 10000.0, requires = "kl_in_reward", value_parser = above(0.0f64))]
    pub kl_horizon: f64,
    /// Adaptive controller: JSON file holding β between steps (read if present, then updated).
    #[arg(long, value_name = "FILE", requires = "kl_in_reward")]
    pub kl_state: Option<PathBuf>,
    /// Write metrics (advantage mean/std/min/max, KL, β, timings) as JSON here.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

impl AdvantageArgs {
    /// Checks the flags as the stage does before reading its input.
    /// (Each flag's range is checked by its parser; this checks what spans flags.)
    pub fn check(&self) -> Result<()> {
        if self.kl_in_reward && self.kl_ctrl == Ctrl::Adaptive && self.kl_state.is_none() {
            bail_input!(
                "--kl-ctrl adaptive needs --kl-state FILE to carry beta from one step to the next"
            );
        }
        Ok(())
    }
}

/// Per-token columns must have one entry per mask entry in every row (the reader checks this
/// against response_ids, which a batch may lack).
fn aligned(batch: &Batch, col: &str, x: &Ragged<f32>, mask: &Ragged<u8>) -> Result<()> {
    for row in 0..mask.num_rows() {
        let (got, want) = (x.row(row).len(), mask.row(row).len());
        if got != want {
            bail_input!(
                "{}, row {row}: has {got} entries but {} has {want}",
                batch.at(col),
                schema::RESPONSE_MASK
            );
        }
    }
    Ok(())
}

/// A column an option needs, or an error naming the column, the option and what to do.
fn need(batch: &Batch, col: &str, why: &str) -> Result<()> {
    if !batch.has(col) {
        bail_input!("{} is missing: {why}", batch.at(col));
    }
    Ok(())
}

pub fn run(a: &AdvantageArgs) -> Result<()> {
    let t0 = Instant::now();
    a.check()?;
    super::common::refuse_in_place(&a.input, &a.out, "out")?;
    let est = adv::estimator(&a.estimator).expect("clap checked the name");
    let (mut ctrl, state) = a.controller()?;
    let inp = Inputs::read(a, est)?;
    let t_read = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mask = &inp.mask;
    let offsets = &mask.offsets;
    let kl = inp.kl_cols.as_ref().map(|(old, r)| KlInReward {
        old: &old.values,
        ref_lp: &r.values,
        penalty: a.kl_penalty,
        beta: ctrl.beta,
    });
    let rewards = adv::token_rewards(offsets, &mask.values, &inp.scores, kl.as_ref());
    let beta_used = ctrl.beta;
    if let Some(current_kl) = rewards.kl {
        ctrl.update(current_kl, inp.batch.num_rows());
    }
    let input = AdvInput {
        offsets,
        mask: &mask.values,
        token_rewards: &rewards.token_rewards,
        outcome: &rewards.outcome,
        groups: inp.groups.as_ref(),
        values: inp.values.as_ref().map(|v| &v.values[..]),
        baseline: inp.baseline.as_deref(),
    };
    let params = AdvParams {
        gamma: a.gamma,
        lam: a.lam,
        norm_by_std: a.norm_by_std,
        epsilon: a.epsilon,
    };
    let out = (est.run)(&input, &params)?;
    let stats = Stats {
        adv: adv::masked_stats(&mask.values, &out.advantages),
        ret: adv::masked_stats(&mask.values, &out.returns),
        score_mean: inp.scores.iter().map(|&s| s as f64).sum::<f64>() / inp.scores.len() as f64,
        kl: rewards.kl,
        beta_used,
        beta_next: ctrl.beta,
    };
    let t_compute = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let mut cols = columns(offsets, rewards.token_rewards, out);
    if let (Some(b), true) = (&inp.baseline, inp.baselines_dropped > 0) {
        // The baseline each row's advantage subtracted, taken from its group's baseline row.
        cols.add(
            schema::BASELINE_SCORE,
            Arc::new(Float32Array::from(b.clone())),
        );
    }
    let info = StageInfo {
        stage: "advantage",
        params: a.params_json(est, beta_used, inp.baselines_dropped),
        policy_version: None,
        step: None,
    };
    inp.batch.write_derived(&a.out, cols, &info)?;
    // The output is in place before β moves, so a crash in between leaves a step that re-runs
    // with the same β.
    if let (Some(path), true) = (&a.kl_state, a.adaptive()) {
        KlState {
            beta: ctrl.beta,
            updates: state.as_ref().map_or(0, |s| s.updates) + 1,
            last_kl: rewards.kl,
            last_beta: Some(beta_used),
        }
        .save(path)?;
    }
    let t_write = t2.elapsed().as_secs_f64();
    let times = [t_read, t_compute, t_write, t0.elapsed().as_secs_f64()];
    report(a, est.name, &inp, &stats, times)
}

/// The columns the stage adds: token rewards, advantages, returns.
fn columns(offsets: &[usize], token_rewards: Vec<f32>, out: adv::AdvOutput) -> NewColumns {
    let mut cols = NewColumns::new();
    cols.add(
        schema::TOKEN_REWARDS,
        list_array::<Float32Type>(offsets, token_rewards),
    );
    cols.add(
        schema::ADVANTAGES,
        list_array::<Float32Type>(offsets, out.advantages),
    );
    cols.add(
        schema::RETURNS,
        list_array::<Float32Type>(offsets, out.returns),
    );
    cols
}

/// The columns the estimator reads, checked against the mask.
struct Inputs {
    /// The input's samples: its baseline rows (`is_baseline`) are left out.
    batch: Batch,
    /// How many baseline rows the input had.
    baselines_dropped: usize,
    mask: Ragged<'static, u8>,
    scores: Vec<f32>,
    groups: Option<Groups>,
    values: Option<Ragged<'static, f32>>,
    baseline: Option<Vec<f32>>,
    /// (old, ref) log-probs, with --kl-in-reward.
    kl_cols: Option<(Ragged<'static, f32>, Ragged<'static, f32>)>,
}

impl Inputs {
    /// Reads the batch and the columns `est` and the options need; a missing one is an error
    /// that says which stage writes it.
    fn read(a: &AdvantageArgs, est: &adv::Estimator) -> Result<Inputs> {
        let batch = Batch::read(&a.input, &[])?;
        batch.require_rows()?;
        let (batch, from_rows, baselines_dropped) = take_baselines(batch, est)?;
        need(
            &batch,
            schema::RESPONSE_MASK,
            "every estimator needs the mask of model tokens (written by rollout)",
        )?;
        need(
            &batch,
            schema::SCORE,
            "every estimator needs the sequence score; run `score` first",
        )?;
        for (col, why) in est.needs {
            if *col == schema::BASELINE_SCORE && from_rows.is_some() {
                continue;
            }
            need(
                &batch,
                col,
                &format!("--estimator {} needs it ({why})", est.name),
            )?;
        }
        if a.kl_in_reward {
            need(
                &batch,
                schema::OLD_LOGPROBS,
                "--kl-in-reward needs it; run `ref-logprob --column old_logprobs` with the policy first",
            )?;
            need(
                &batch,
                schema::REF_LOGPROBS,
                "--kl-in-reward needs it; run `ref-logprob --column ref_logprobs` with the reference model first",
            )?;
        }
        let mask = batch.ragged_u8(schema::RESPONSE_MASK)?;
        let scores = batch.f32s(schema::SCORE)?;
        // What the estimator reads besides mask and score comes from its registry entry.
        let needs = |col: &str| est.needs.iter().any(|(c, _)| *c == col);
        let groups = match needs(schema::PROMPT_UID) {
            true => Some(Groups::from_keys(&batch.strings(schema::PROMPT_UID)?)),
            false => None,
        };
        let values = match needs(schema::VALUES) {
            true => Some(batch.ragged_f32(schema::VALUES)?),
            false => None,
        };
        let baseline = match (needs(schema::BASELINE_SCORE), from_rows) {
            (true, Some(b)) => Some(b),
            (true, None) => Some(batch.f32s(schema::BASELINE_SCORE)?),
            (false, _) => None,
        };
        let kl_cols = match a.kl_in_reward {
            true => Some((
                batch.ragged_f32(schema::OLD_LOGPROBS)?,
                batch.ragged_f32(schema::REF_LOGPROBS)?,
            )),
            false => None,
        };
        if let Some(v) = &values {
            aligned(&batch, schema::VALUES, v, &mask)?;
        }
        if let Some((old, r)) = &kl_cols {
            aligned(&batch, schema::OLD_LOGPROBS, old, &mask)?;
            aligned(&batch, schema::REF_LOGPROBS, r, &mask)?;
        }
        Ok(Inputs {
            batch,
            baselines_dropped,
            mask,
            scores,
            groups,
            values,
            baseline,
            kl_cols,
        })
    }
}

/// The batch without its baseline rows (they are not samples: no advantage, no update), the
/// baseline of every sample row taken from them when `est` subtracts one and the batch has no
/// `baseline_score` column of its own, and how many baseline rows there were.
fn take_baselines(batch: Batch, est: &adv::Estimator) -> Result<(Batch, Option<Vec<f32>>, usize)> {
    let is_baseline = batch.baseline_rows()?;
    let dropped = is_baseline.iter().filter(|&&b| b).count();
    if dropped == 0 {
        return Ok((batch, None, 0));
    }
    let wants = est.needs.iter().any(|(c, _)| *c == schema::BASELINE_SCORE);
    let baseline = match wants && !batch.has(schema::BASELINE_SCORE) {
        true => {
            need(
                &batch,
                schema::PROMPT_UID,
                "the baseline rows' scores go to the samples of their prompt_uid",
            )?;
            need(
                &batch,
                schema::SCORE,
                "every estimator needs the sequence score; run `score` first",
            )?;
            let keys = batch.strings(schema::PROMPT_UID)?;
            let scores = batch.f32s(schema::SCORE)?;
            let b = adv::group_baselines(&keys, &scores, &is_baseline)
                .map_err(|e| e.context(batch.at(schema::PROMPT_UID)))?;
            Some(b)
        }
        false => None,
    };
    let samples = batch.samples_only()?;
    if samples.num_rows() == 0 {
        bail_input!(
            "{}: every row is a baseline row ({} = true): no sample to compute advantages for",
            samples.path.display(),
            schema::IS_BASELINE
        );
    }
    Ok((samples, baseline, dropped))
}

/// What the metrics and the log report of the result.
struct Stats {
    adv: adv::MaskedStats,
    ret: adv::MaskedStats,
    score_mean: f64,
    kl: Option<f64>,
    beta_used: f64,
    beta_next: f64,
}

impl AdvantageArgs {
    /// β moves between steps (the adaptive controller, with a KL term in the reward).
    fn adaptive(&self) -> bool {
        self.kl_in_reward && self.kl_ctrl == Ctrl::Adaptive
    }

    /// The KL controller, with β from --kl-state when adaptive (and the state read).
    fn controller(&self) -> Result<(KlController, Option<KlState>)> {
        let mut ctrl = KlController {
            beta: self.kl_coef,
            ctrl: match self.kl_ctrl {
                Ctrl::Fixed => KlCtrl::Fixed,
                Ctrl::Adaptive => KlCtrl::Adaptive {
                    target: self.kl_target,
                    horizon: self.kl_horizon,
                },
            },
        };
        let state = match (&self.kl_state, self.adaptive()) {
            (Some(p), true) => KlState::load(p)?,
            _ => None,
        };
        if let Some(s) = &state {
            ctrl.beta = s.beta;
        }
        Ok((ctrl, state))
    }

    /// The parameters recorded in the output's metadata (β as used on this batch).
    fn params_json(
        &self,
        est: &adv::Estimator,
        beta_used: f64,
        dropped: usize,
    ) -> serde_json::Value {
        serde_json::json!({
            "baseline_rows_dropped": dropped,
            "estimator": est.name,
            "gamma": self.gamma,
            "lam": self.lam,
            "norm_by_std": self.norm_by_std,
            "epsilon": self.epsilon,
            "kl_in_reward": self.kl_in_reward,
            "kl_penalty": self.kl_in_reward.then(|| self.kl_penalty.to_string()),
            "kl_ctrl": self.kl_in_reward.then(|| format!("{:?}", self.kl_ctrl).to_lowercase()),
            "kl_beta": self.kl_in_reward.then_some(beta_used),
        })
    }
}

/// Logs the result and writes the metrics; `times` are the read, compute, write and total
/// seconds.
fn report(a: &AdvantageArgs, name: &str, inp: &Inputs, s: &Stats, times: [f64; 4]) -> Result<()> {
    let [t_read, t_compute, t_write, total] = times;
    let (rows, tokens) = (inp.batch.num_rows(), inp.mask.values.len());
    let (adv_stats, ret_stats, beta_used) = (&s.adv, &s.ret, s.beta_used);
    let metrics = serde_json::json!({
        "stage": "advantage",
        "estimator": name,
        "rows": rows,
        "baseline_rows_dropped": inp.baselines_dropped,
        "tokens": tokens,
        "valid_tokens": adv_stats.count,
        "score_mean": s.score_mean,
        "advantage_mean": adv_stats.mean,
        "advantage_std": adv_stats.std,
        "advantage_min": adv_stats.min,
        "advantage_max": adv_stats.max,
        "returns_mean": ret_stats.mean,
        "returns_std": ret_stats.std,
        "returns_min": ret_stats.min,
        "returns_max": ret_stats.max,
        "kl": s.kl,
        "kl_beta": a.kl_in_reward.then_some(beta_used),
        "kl_beta_next": a.kl_in_reward.then_some(s.beta_next),
        "read_s": t_read,
        "compute_s": t_compute,
        "write_s": t_write,
        "total_s": total,
        "rows_per_s": rows as f64 / total,
        "tokens_per_s": tokens as f64 / total,
    });
    eprintln!(
        "advantage {}: {rows} rows, {} tokens; advantage mean {:.4} std {:.4} min {:.4} max {:.4}{}; \
         {:.0} rows/s (read {t_read:.2}s, compute {t_compute:.2}s, write {t_write:.2}s)",
        name,
        tokens,
        adv_stats.mean,
        adv_stats.std,
        adv_stats.min,
        adv_stats.max,
        match s.kl {
            Some(k) => format!("; kl {k:.5} beta {beta_used:.6} -> {:.6}", s.beta_next),
            None => String::new(),
        },
        rows as f64 / total,
    );
    if let Some(path) = &a.metrics {
        crate::batch::write_json(path, &metrics)?;
    }
    Ok(())
}
