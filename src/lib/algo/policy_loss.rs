//! Policy losses for `update` (verl's `compute_policy_loss_*`, `agg_loss`, entropy bonus and KL
//! loss): the scalar loss of one micro-batch AND its exact gradient with respect to every token's
//! log-prob and entropy, plus metrics.
//!
//! Each policy loss is one small per-token function with its formula and paper above it,
//! registered by name in [`LOSSES`] (verl's `register_policy_loss`); [`policy_loss`] adds what
//! all of them share: aggregation weights, rollout importance weights, entropy bonus, KL loss
//! and metrics. PPO clip (`vanilla`) is the backend's `ppo_token`, the same host definition the
//! fused CPU op runs and the CUDA kernel is checked against.
//!
//! Micro-batches: the caller computes [`LossNorm`] once over the whole mini-batch and passes it
//! to every micro-batch; losses, gradients and metrics of the micro-batches then add up to those
//! of the unsplit mini-batch. `scale` multiplies loss and gradients (e.g. for data-parallel
//! averaging); metrics are not scaled.
//!
//! Stop-gradients: GSPO's sequence ratio, CISPO's clipped ratio and the rollout importance
//! weights are constants of the surrogate (verl detaches them). The gradient returned is the
//! exact gradient of the surrogate with those constants frozen at the current point; for GSPO
//! with advantages and importance weights constant along each sequence (what every outcome
//! estimator produces) it is also the gradient of the loss value itself.

use super::agg::{AggMode, LossNorm};
use super::kl::KlPenalty;
use super::Real;
use crate::backend::ops::ppo_loss::ppo_token;
use crate::backend::PpoShape;
use crate::bail_input;
use anyhow::{ensure, Result};
use clap::builder::PossibleValue;
use clap::ValueEnum;
use std::fmt;
use std::str::FromStr;

/// Which policy-gradient surrogate: the key of its [`LOSSES`] entry, which holds the name, the
/// formula and the function. Parsed from (`--loss`) and printed as the registered name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossMode {
    Vanilla,
    Gspo,
    Cispo,
    Sft,
}

/// What a policy loss sees of one valid token.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenIn {
    /// Current log-prob: the derivative is taken with respect to it.
    pub(crate) lp: f64,
    /// Log-prob under the policy that sampled (NaN when the batch has none: sft).
    pub(crate) old: f64,
    /// Advantage (NaN when the batch has none: sft).
    pub(crate) adv: f64,
    /// The log-prob at which stop-gradient terms are evaluated (`lp`, except in gradient checks).
    pub(crate) anchor: f64,
    /// The row's mean of (anchor − old) over its valid tokens: GSPO's log sequence ratio.
    pub(crate) seq_log_ratio: f64,
}

/// The clip knobs as bounds of the ratio.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clip {
    /// 1 − ε_low
    pub(crate) low: f64,
    /// 1 + ε_high
    pub(crate) high: f64,
    /// Dual-clip bound c (> 1) for negative advantages.
    pub(crate) dual: f64,
}

/// One token's loss ℓ, dℓ/d lp, whether it was clipped (upper, lower), and the log-ratio
/// lp − old that the `ppo_kl` metric averages (clamped where the loss clamps it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TokenLoss {
    pub(crate) loss: f64,
    pub(crate) dloss: f64,
    pub(crate) clipped: bool,
    pub(crate) clipped_lower: bool,
    pub(crate) log_ratio: f64,
}

pub(crate) type TokenLossFn = fn(&TokenIn, &Clip) -> TokenLoss;

/// One registered policy loss (verl's `register_policy_loss`).
pub struct PolicyLoss {
    pub(crate) mode: LossMode,
    pub name: &'static str,
    /// Its formula in one line (shown by `update --help`).
    pub about: &'static str,
    /// A policy-gradient loss reads old log-probs and advantages, and rollout importance
    /// weights can weight it.
    pub policy_gradient: bool,
    /// The aggregation it always uses, whatever --loss-agg-mode says.
    pub(crate) agg: Option<AggMode>,
    pub(crate) token: TokenLossFn,
}

/// The registry, by name: `--loss`'s values, its help and its error come from here.
pub const LOSSES: &[PolicyLoss] = &[
    PolicyLoss {
        mode: LossMode::Vanilla,
        name: "vanilla",
        about:
            "PPO clip: max(−A·r, −A·clip(r, 1−εl, 1+εh)), and for A < 0 at most −A·c (dual clip)",
        policy_gradient: true,
        agg: None,
        token: vanilla,
    },
    PolicyLoss {
        mode: LossMode::Gspo,
        name: "gspo",
        about: "GSPO: PPO clip of the sequence ratio exp(mean(lp − old)), aggregated per sequence",
        policy_gradient: true,
        agg: Some(AggMode::SeqMeanTokenMean),
        token: gspo,
    },
    PolicyLoss {
        mode: LossMode::Cispo,
        name: "cispo",
        about: "CISPO: −sg[clip(r, 1−εl, 1+εh)]·A·lp (clipped tokens keep their gradient)",
        policy_gradient: true,
        agg: None,
        token: cispo,
    },
    PolicyLoss {
        mode: LossMode::Sft,
        name: "sft",
        about: "negative log-likelihood −lp of the valid tokens (warm starts; no advantages)",
        policy_gradient: false,
        agg: None,
        token: sft,
    },
];

/// The registered names, in table order.
pub(crate) fn names() -> Vec<&'static str> {
    LOSSES.iter().map(|l| l.name).collect()
}

/// The loss registered as `name`.
pub(crate) fn by_name(name: &str) -> Option<&'static PolicyLoss> {
    LOSSES.iter().find(|l| l.name == name)
}

impl LossMode {
    /// Its registry entry.
    pub(crate) fn loss(self) -> &'static PolicyLoss {
        LOSSES
            .iter()
            .find(|l| l.mode == self)
            .expect("every LossMode is registered in LOSSES (checked by a test)")
    }
}

impl FromStr for LossMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match by_name(s) {
            Some(l) => Ok(l.mode),
            None => Err(format!(
                "unknown loss '{s}' (expected one of {})",
                names().join(", ")
            )),
        }
    }
}

impl fmt::Display for LossMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.loss().name)
    }
}

/// Every registered mode in table order: clap's value list.
const MODES: [LossMode; LOSSES.len()] = {
    let mut m = [LossMode::Vanilla; LOSSES.len()];
    let mut i = 0;
    while i < m.len() {
        m[i] = LOSSES[i].mode;
        i += 1;
    }
    m
};

/// `--loss` parses through the table: its possible values, their help lines and the error for
/// an unknown name (exit 2) list the registered losses.
impl ValueEnum for LossMode {
    fn value_variants<'a>() -> &'a [Self] {
        &MODES
    }
    fn to_possible_value(&self) -> Option<PossibleValue> {
        let l = self.loss();
        Some(PossibleValue::new(l.name).help(l.about))
    }
}

/// PPO clip (Schulman et al. 2017, arXiv:1707.06347) with clip-higher (εl ≠ εh, DAPO,
/// arXiv:2503.14476) and dual clip for negative advantages (Ye et al. 2020, arXiv:1912.09729),
/// verl's `vanilla`: r = exp(clamp(lp − old, ±20)); ℓ = max(−A·r, −A·clip(r, 1−εl, 1+εh)), and
/// for A < 0 min(ℓ, −A·c). The math is the backend's [`ppo_token`], the one definition the CPU
/// op uses and the CUDA kernel is checked against (`gpu-test ppo_loss`).
fn vanilla(x: &TokenIn, c: &Clip) -> TokenLoss {
    let shape = PpoShape {
        tokens: 1,
        ratio_low: c.low,
        ratio_high: c.high,
        dual_clip: c.dual,
    };
    let k = ppo_token(x.lp, x.old, x.adv, &shape);
    TokenLoss {
        loss: k.loss,
        dloss: k.dloss,
        clipped: k.clipped,
        clipped_lower: k.clipped_lower,
        log_ratio: k.log_ratio,
    }
}

/// GSPO (Zheng et al. 2025, arXiv:2507.18071): every token carries the sequence ratio
/// s_i = exp(mean_t(lp − old)) with its own gradient, clipped as PPO without dual clip:
/// s_it = exp(min(sg[log s_i] + lp − sg[lp], 10)); ℓ = max(−A·s_it, −A·clip(s_it, 1−εl, 1+εh)).
/// Aggregated seq-mean-token-mean whatever --loss-agg-mode says (as verl).
fn gspo(x: &TokenIn, c: &Clip) -> TokenLoss {
    let s = D::var(x.lp)
        .add(x.seq_log_ratio - x.anchor)
        .clamp(f64::NEG_INFINITY, 10.0)
        .exp();
    let pg1 = s.mul(-x.adv);
    let pg2 = s.clamp(c.low, c.high).mul(-x.adv);
    let loss = pg1.maximum(pg2);
    TokenLoss {
        loss: loss.v,
        dloss: loss.d,
        clipped: pg2.v > pg1.v,
        clipped_lower: false,
        log_ratio: x.lp - x.old,
    }
}

/// CISPO (MiniMax-M1, arXiv:2506.13585): the clipped ratio is a detached weight of the
/// REINFORCE term, so clipped tokens keep a gradient:
/// ℓ = −sg[clip(exp(clamp(lp − old, ±20)), 1−εl, 1+εh)]·A·lp.
fn cispo(x: &TokenIn, c: &Clip) -> TokenLoss {
    let r = (x.anchor - x.old).clamp(-20.0, 20.0).exp();
    let rc = r.clamp(c.low, c.high);
    let loss = D::var(x.lp).mul(-rc * x.adv);
    TokenLoss {
        loss: loss.v,
        dloss: loss.d,
        clipped: r != rc,
        clipped_lower: false,
        log_ratio: (x.lp - x.old).clamp(-20.0, 20.0),
    }
}

/// Supervised fine-tuning (warm starts): ℓ = −lp, the negative log-likelihood of the token.
fn sft(x: &TokenIn, _: &Clip) -> TokenLoss {
    TokenLoss {
        loss: -x.lp,
        dloss: -1.0,
        clipped: false,
        clipped_lower: false,
        log_ratio: x.lp - x.old,
    }
}

/// Level of the rollout importance weights exp(old − rollout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutIsLevel {
    Token,
    Sequence,
}

impl FromStr for RolloutIsLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "token" => Ok(RolloutIsLevel::Token),
            "sequence" => Ok(RolloutIsLevel::Sequence),
            _ => Err(format!(
                "unknown rollout importance sampling level '{s}' (expected token or sequence)"
            )),
        }
    }
}

/// Truncated importance sampling between the rollout engine and the trainer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RolloutIs {
    pub(crate) level: RolloutIsLevel,
    /// Weights are truncated to at most this (verl's rollout_is_threshold, default 2.0).
    pub(crate) threshold: f64,
}

/// KL loss against the reference model (verl's use_kl_loss).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KlLoss {
    pub(crate) coef: f64,
    pub(crate) penalty: KlPenalty,
}

/// The loss knobs, named as in verl's actor config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossConfig {
    pub(crate) mode: LossMode,
    pub(crate) clip_ratio: f64,
    /// Defaults to clip_ratio.
    pub(crate) clip_ratio_low: Option<f64>,
    /// Defaults to clip_ratio.
    pub(crate) clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages (vanilla), > 1.
    pub(crate) clip_ratio_c: f64,
    pub(crate) agg: AggMode,
    /// loss −= entropy_coeff · agg(entropy)
    pub(crate) entropy_coeff: f64,
    pub(crate) kl_loss: Option<KlLoss>,
    pub(crate) rollout_is: Option<RolloutIs>,
}

impl LossConfig {
    /// verl's defaults: clip 0.2, dual clip 3.0, token-mean, no entropy bonus, no KL loss.
    pub(crate) fn new(mode: LossMode) -> LossConfig {
        LossConfig {
            mode,
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            agg: AggMode::TokenMean,
            entropy_coeff: 0.0,
            kl_loss: None,
            rollout_is: None,
        }
    }

    pub(crate) fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    pub(crate) fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }

    /// Check the knobs; errors name the flag.
    pub(crate) fn validate(&self) -> Result<()> {
        for (flag, v) in [
            ("--clip-ratio", self.clip_ratio),
            ("--clip-ratio-low", self.clip_low()),
            ("--clip-ratio-high", self.clip_high()),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail_input!("{flag} must be a finite number >= 0, got {v}");
            }
        }
        if !(self.clip_ratio_c.is_finite() && self.clip_ratio_c > 1.0) {
            bail_input!(
                "--clip-ratio-c is the dual-clip bound and must be > 1.0, got {}",
                self.clip_ratio_c
            );
        }
        if !self.entropy_coeff.is_finite() {
            bail_input!("--entropy-coeff must be finite, got {}", self.entropy_coeff);
        }
        if let Some(k) = self.kl_loss {
            if !(k.coef.is_finite() && k.coef >= 0.0) {
                bail_input!(
                    "--kl-loss-coef must be a finite number >= 0, got {}",
                    k.coef
                );
            }
        }
        if let Some(r) = self.rollout_is {
            if !(r.threshold.is_finite() && r.threshold > 0.0) {
                bail_input!(
                    "--rollout-is-threshold must be a finite number > 0, got {}",
                    r.threshold
                );
            }
            if !self.mode.loss().policy_gradient {
                bail_input!(
                    "--rollout-is weights a policy-gradient loss; --loss {} has none",
                    self.mode
                );
            }
        }
        Ok(())
    }

    /// The policy term's aggregation: the loss's own (GSPO's per sequence, as verl) or
    /// loss_agg_mode.
    fn pg_agg(&self) -> AggMode {
        self.mode.loss().agg.unwrap_or(self.agg)
    }
}

/// One micro-batch: ragged rows (one per sequence) of per-token values.
pub(crate) struct LossInputs<'a, T> {
    pub(crate) offsets: &'a [usize],
    pub(crate) mask: &'a [u8],
    /// Current log-probs (what the gradient is taken with respect to).
    pub(crate) lp: &'a [T],
    /// Log-probs of the policy that sampled (for on-policy, the current ones).
    pub(crate) old: Option<&'a [T]>,
    pub(crate) advantages: Option<&'a [T]>,
    pub(crate) ref_lp: Option<&'a [T]>,
    pub(crate) rollout: Option<&'a [T]>,
    pub(crate) entropy: Option<&'a [T]>,
}

/// This micro-batch's share of each mini-batch metric: add them up over micro-batches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossMetrics {
    pub(crate) pg_loss: f64,
    pub(crate) pg_clipfrac: f64,
    pub(crate) pg_clipfrac_lower: f64,
    pub(crate) ppo_kl: f64,
    pub(crate) entropy: f64,
    pub(crate) kl_loss: f64,
    /// Rollout importance sampling (`--rollout-is`): the token mean of the truncated weight
    /// and the fraction of tokens whose weight the threshold truncated (0 without it).
    pub(crate) is_weight: f64,
    pub(crate) is_truncated: f64,
    /// The critic's value loss (`crate::algo::value_loss`; 0 for a policy loss): the loss,
    /// the token mean of its clipped terms being the larger, the token mean of the values.
    pub(crate) vf_loss: f64,
    pub(crate) vf_clipfrac: f64,
    pub(crate) vpred_mean: f64,
}

impl LossMetrics {
    pub(crate) fn add(&mut self, o: &LossMetrics) {
        self.pg_loss += o.pg_loss;
        self.pg_clipfrac += o.pg_clipfrac;
        self.pg_clipfrac_lower += o.pg_clipfrac_lower;
        self.ppo_kl += o.ppo_kl;
        self.entropy += o.entropy;
        self.kl_loss += o.kl_loss;
        self.is_weight += o.is_weight;
        self.is_truncated += o.is_truncated;
        self.vf_loss += o.vf_loss;
        self.vf_clipfrac += o.vf_clipfrac;
        self.vpred_mean += o.vpred_mean;
    }
}

/// The micro-batch's loss (scaled), d loss / d lp per token, d loss / d entropy per token (when
/// entropies were given), and metrics.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LossOutput<T> {
    pub(crate) loss: f64,
    pub(crate) grad_lp: Vec<T>,
    pub(crate) grad_entropy: Option<Vec<T>>,
    pub(crate) metrics: LossMetrics,
}

/// Compute the loss of one micro-batch and its gradient.
pub(crate) fn policy_loss<T: Real>(
    cfg: &LossConfig,
    x: &LossInputs<T>,
    norm: &LossNorm,
    scale: f64,
) -> Result<LossOutput<T>> {
    compute(cfg, x, x.lp, norm, scale)
}

/// A value and its derivative with respect to one token's log-prob (forward mode). max splits
/// the derivative at ties and clamps pass it on their closed interval, as torch does.
#[derive(Clone, Copy, Debug)]
struct D {
    v: f64,
    d: f64,
}

impl D {
    fn var(v: f64) -> D {
        D { v, d: 1.0 }
    }
    fn cst(v: f64) -> D {
        D { v, d: 0.0 }
    }
    fn add(self, c: f64) -> D {
        D {
            v: self.v + c,
            d: self.d,
        }
    }
    fn mul(self, c: f64) -> D {
        D {
            v: self.v * c,
            d: self.d * c,
        }
    }
    fn exp(self) -> D {
        let e = self.v.exp();
        D {
            v: e,
            d: e * self.d,
        }
    }
    fn clamp(self, lo: f64, hi: f64) -> D {
        if self.v < lo {
            D::cst(lo)
        } else if self.v > hi {
            D::cst(hi)
        } else {
            self
        }
    }
    fn maximum(self, o: D) -> D {
        if self.v > o.v {
            self
        } else if self.v < o.v {
            o
        } else {
            D {
                v: self.v,
                d: 0.5 * (self.d + o.d),
            }
        }
    }
}

/// `anchor` holds the log-probs at which stop-gradient terms are evaluated (the current ones in
/// [`policy_loss`]; frozen separately in gradient checks).
fn compute<T: Real>(
    cfg: &LossConfig,
    x: &LossInputs<T>,
    anchor: &[T],
    norm: &LossNorm,
    scale: f64,
) -> Result<LossOutput<T>> {
    cfg.validate()?;
    let n_tok = check_lengths(x, anchor)?;
    let mut pass = Pass {
        cfg,
        x,
        anchor,
        inputs: Needed::of(cfg, x)?,
        token_loss: cfg.mode.loss().token,
        clip: Clip {
            low: 1.0 - cfg.clip_low(),
            high: 1.0 + cfg.clip_high(),
            dual: cfg.clip_ratio_c,
        },
        scale,
        grad_lp: vec![T::from_f64(0.0); n_tok],
        grad_entropy: x.entropy.map(|_| vec![T::from_f64(0.0); n_tok]),
        m: LossMetrics::default(),
    };
    for w in x.offsets.windows(2) {
        let valid: Vec<usize> = (w[0]..w[1]).filter(|&t| x.mask[t] != 0).collect();
        if !valid.is_empty() {
            pass.row(&valid, norm)?;
        }
    }
    let m = pass.m;
    let kl_term = cfg.kl_loss.map_or(0.0, |k| k.coef * m.kl_loss);
    let loss = scale * (m.pg_loss - cfg.entropy_coeff * m.entropy + kl_term);
    Ok(LossOutput {
        loss,
        grad_lp: pass.grad_lp,
        grad_entropy: pass.grad_entropy,
        metrics: m,
    })
}

fn at<T: Real>(v: &[T], t: usize) -> f64 {
    v[t].to_f64()
}

/// The number of tokens the offsets give, which every per-token input must have.
fn check_lengths<T>(x: &LossInputs<T>, anchor: &[T]) -> Result<usize> {
    let n_tok = *x.offsets.last().unwrap_or(&0);
    ensure!(
        x.offsets.first() == Some(&0) && x.offsets.windows(2).all(|w| w[0] <= w[1]),
        "loss offsets must start at 0 and not decrease"
    );
    for (name, len) in [
        ("response_mask", Some(x.mask.len())),
        ("log-probs", Some(x.lp.len())),
        ("anchor log-probs", Some(anchor.len())),
        ("old log-probs", x.old.map(|v| v.len())),
        ("advantages", x.advantages.map(|v| v.len())),
        ("reference log-probs", x.ref_lp.map(|v| v.len())),
        ("rollout log-probs", x.rollout.map(|v| v.len())),
        ("entropies", x.entropy.map(|v| v.len())),
    ] {
        if let Some(len) = len {
            ensure!(
                len == n_tok,
                "loss: {name} has {len} tokens, offsets say {n_tok}"
            );
        }
    }
    Ok(n_tok)
}

/// The optional inputs, each checked present when the configuration needs it.
struct Needed<'a, T> {
    old: Option<&'a [T]>,
    adv: Option<&'a [T]>,
    ref_lp: Option<&'a [T]>,
    rollout: Option<&'a [T]>,
}

impl<'a, T> Needed<'a, T> {
    fn of(cfg: &LossConfig, x: &LossInputs<'a, T>) -> Result<Needed<'a, T>> {
        let mode = cfg.mode;
        let pg = mode.loss();
        let need = |what: &str, why: &str| {
            crate::error::input_error(format!("policy loss: {why} needs {what}"))
        };
        let old = match (pg.policy_gradient, x.old) {
            (true, None) => return Err(need("old log-probs", &format!("--loss {mode}"))),
            (_, o) => o,
        };
        let adv = match (pg.policy_gradient, x.advantages) {
            (true, None) => return Err(need("advantages", &format!("--loss {mode}"))),
            (_, a) => a,
        };
        let ref_lp = match (cfg.kl_loss, x.ref_lp) {
            (Some(_), None) => return Err(need("reference log-probs", "--use-kl-loss")),
            (_, r) => r,
        };
        let rollout = match (cfg.rollout_is, x.rollout) {
            (Some(_), None) => return Err(need("rollout log-probs", "--rollout-is")),
            (_, r) => r,
        };
        if cfg.entropy_coeff != 0.0 && x.entropy.is_none() {
            return Err(need("per-token entropies", "--entropy-coeff"));
        }
        Ok(Needed {
            old,
            adv,
            ref_lp,
            rollout,
        })
    }
}

/// One micro-batch's pass: what its rows share, and the gradients and metrics they add to.
struct Pass<'a, T> {
    cfg: &'a LossConfig,
    x: &'a LossInputs<'a, T>,
    anchor: &'a [T],
    inputs: Needed<'a, T>,
    /// The loss's per-token function.
    token_loss: TokenLossFn,
    clip: Clip,
    scale: f64,
    grad_lp: Vec<T>,
    grad_entropy: Option<Vec<T>>,
    m: LossMetrics,
}

/// What is constant within one row: its aggregation weights, its sequence-level rollout
/// importance weight (untruncated) with its threshold, and GSPO's log sequence ratio.
struct Row {
    w_pg: f64,
    w_agg: f64,
    w_tok: f64,
    seq_is: (f64, f64),
    seq_log_ratio: f64,
}

impl<T: Real> Pass<'_, T> {
    /// Adds the row of the `valid` (unmasked, at least one) tokens.
    fn row(&mut self, valid: &[usize], norm: &LossNorm) -> Result<()> {
        let cfg = self.cfg;
        let n = valid.len();
        let old = self.inputs.old;
        // Sequence-level quantities, constant within the row: the untruncated weight and its
        // threshold.
        let seq_is = match (cfg.rollout_is, self.inputs.rollout, old) {
            (Some(r), Some(roll), Some(old)) if r.level == RolloutIsLevel::Sequence => {
                // w_i = min(exp(clamp(Σ_t (old − rollout), ±20)), threshold)
                let s: f64 = valid.iter().map(|&t| at(old, t) - at(roll, t)).sum();
                (s.clamp(-20.0, 20.0).exp(), r.threshold)
            }
            _ => (1.0, f64::INFINITY),
        };
        // mean_t (lp − old) at the anchor (detached)
        let seq_log_ratio = match old {
            Some(old) => {
                valid
                    .iter()
                    .map(|&t| at(self.anchor, t) - at(old, t))
                    .sum::<f64>()
                    / n as f64
            }
            None => 0.0,
        };
        let row = Row {
            w_pg: norm.row_weight(cfg.pg_agg(), n)?,
            w_agg: norm.row_weight(cfg.agg, n)?,
            w_tok: norm.row_weight(AggMode::TokenMean, n)?,
            seq_is,
            seq_log_ratio,
        };
        for &t in valid {
            self.token(t, &row);
        }
        Ok(())
    }

    /// Adds token `t` of `row`: its policy loss (weighted by the rollout importance weight),
    /// entropy bonus and KL loss, their gradients and metrics.
    fn token(&mut self, t: usize, row: &Row) {
        let (cfg, x, m) = (self.cfg, self.x, &mut self.m);
        let Needed {
            old,
            adv,
            ref_lp,
            rollout,
        } = self.inputs;
        let tok = TokenIn {
            lp: at(x.lp, t),
            old: old.map_or(f64::NAN, |o| at(o, t)),
            adv: adv.map_or(f64::NAN, |v| at(v, t)),
            anchor: at(self.anchor, t),
            seq_log_ratio: row.seq_log_ratio,
        };
        let l = (self.token_loss)(&tok, &self.clip);
        // Truncated rollout importance weight (detached): token min(exp(clamp(old −
        // rollout, ±20)), threshold), or the row's sequence weight.
        let (raw_w, threshold) = match (cfg.rollout_is, rollout, old) {
            (Some(r), Some(roll), Some(old)) if r.level == RolloutIsLevel::Token => (
                (at(old, t) - at(roll, t)).clamp(-20.0, 20.0).exp(),
                r.threshold,
            ),
            _ => row.seq_is,
        };
        let is_w = raw_w.min(threshold);
        let (w_pg, w_agg, w_tok) = (row.w_pg, row.w_agg, row.w_tok);
        if cfg.rollout_is.is_some() {
            m.is_weight += w_tok * is_w;
            m.is_truncated += w_tok * f64::from(u8::from(raw_w > threshold));
        }
        m.pg_loss += w_pg * (l.loss * is_w);
        let mut g = w_pg * (l.dloss * is_w);
        m.pg_clipfrac += w_tok * l.clipped as u8 as f64;
        m.pg_clipfrac_lower += w_tok * l.clipped_lower as u8 as f64;
        if old.is_some() {
            // ppo_kl = mean(old − lp)
            m.ppo_kl += w_tok * -l.log_ratio;
        }
        if let (Some(ent), Some(ge)) = (x.entropy, self.grad_entropy.as_mut()) {
            // loss −= coeff·agg(H)
            m.entropy += w_agg * at(ent, t);
            ge[t] = T::from_f64(-self.scale * cfg.entropy_coeff * w_agg);
        }
        if let (Some(k), Some(r)) = (cfg.kl_loss, ref_lp) {
            // loss += coef·agg(kl(lp, ref))
            let (v, dv) = k.penalty.value_grad(tok.lp, at(r, t));
            m.kl_loss += w_agg * v;
            g += k.coef * w_agg * dv;
        }
        self.grad_lp[t] = T::from_f64(self.scale * g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backend's PPO-clip op (checked here, above it, against the one host definition).
    mod backend_op {
        use super::*;
        use crate::algo::agg::{AggMode, LossNorm};
        use crate::backend::ops::ppo_loss::cpu::ppo_clip_loss;
        use crate::backend::ops::ppo_loss::{PpoInputs, PpoShape, PPO_STATS};
        use crate::rng::SplitMix64;

        /// The backend op `ppo_clip_loss` (CPU reference of the fused kernel) with weights from
        /// `LossNorm` is this module's `policy_loss` (vanilla): same gradient,
        /// same metrics, for every aggregation, on-policy ties and masked tokens included.
        #[test]
        fn matches_the_host_policy_loss() {
            let mut rng = SplitMix64(5);
            let offsets = [0usize, 5, 6, 13, 13, 20];
            let n = 20;
            let mask: Vec<u8> = (0..n).map(|t| (t % 6 != 2) as u8).collect();
            let lp: Vec<f32> = (0..n).map(|_| rng.normal() - 2.0).collect();
            let mut off: Vec<f32> = (0..n)
                .map(|t| {
                    if t % 4 == 0 {
                        lp[t]
                    } else {
                        lp[t] + 0.4 * rng.normal()
                    }
                })
                .collect();
            let mut adv: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
            // Token 7: ratio e^1.5 > c with A < 0 (the dual clip); token 5: ratio e^0.5 > 1 + ε, A > 0.
            off[7] = lp[7] - 1.5;
            adv[7] = -1.0;
            off[5] = lp[5] - 0.5;
            adv[5] = 1.0;
            let ent: Vec<f32> = (0..n).map(|_| rng.normal().abs()).collect();
            for agg in [
                AggMode::TokenMean,
                AggMode::SeqMeanTokenSum,
                AggMode::SeqMeanTokenMean,
                AggMode::SeqMeanTokenSumNorm,
            ] {
                for on_policy in [true, false] {
                    let mut cfg = LossConfig::new(LossMode::Vanilla);
                    cfg.agg = agg;
                    cfg.clip_ratio_high = Some(0.28);
                    let old = if on_policy { &lp } else { &off };
                    let norm = LossNorm::of_mask(&offsets, &mask, None);
                    let host = policy_loss(
                        &cfg,
                        &LossInputs {
                            offsets: &offsets,
                            mask: &mask,
                            lp: &lp,
                            old: Some(old),
                            advantages: Some(&adv),
                            ref_lp: None,
                            rollout: None,
                            entropy: Some(&ent),
                        },
                        &norm,
                        1.0,
                    )
                    .unwrap();
                    let mut w = vec![0f32; 3 * n];
                    for r in offsets.windows(2) {
                        let valid = mask[r[0]..r[1]].iter().filter(|&&m| m != 0).count();
                        for t in r[0]..r[1] {
                            if mask[t] != 0 {
                                w[t] = norm.row_weight(agg, valid).unwrap() as f32;
                                w[n + t] =
                                    norm.row_weight(AggMode::TokenMean, valid).unwrap() as f32;
                                w[2 * n + t] = w[t];
                            }
                        }
                    }
                    let s = PpoShape {
                        tokens: n,
                        ratio_low: 1.0 - cfg.clip_low(),
                        ratio_high: 1.0 + cfg.clip_high(),
                        dual_clip: cfg.clip_ratio_c,
                    };
                    let mut dlp = vec![f32::NAN; n];
                    let mut stats = [1f32; PPO_STATS];
                    ppo_clip_loss(
                        &mut dlp,
                        &mut stats,
                        PpoInputs {
                            lp: &lp,
                            old: (!on_policy).then_some(&off[..]),
                            adv: &adv,
                            w: &w,
                            ent: Some(&ent),
                        },
                        &s,
                    );
                    let what = format!("{agg}, on-policy {on_policy}");
                    for (t, (&a, &b)) in dlp.iter().zip(&host.grad_lp).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                            "{what}: dlp[{t}] {a} vs {b}"
                        );
                    }
                    let m = &host.metrics;
                    // stats started at 1: the op adds.
                    for (k, want) in [
                        m.pg_loss,
                        m.pg_clipfrac,
                        m.pg_clipfrac_lower,
                        m.ppo_kl,
                        m.entropy,
                        0.0,
                    ]
                    .into_iter()
                    .enumerate()
                    {
                        let got = stats[k] as f64 - 1.0;
                        assert!(
                            (got - want).abs() < 1e-6,
                            "{what}: stat {k}: {got} vs {want}"
                        );
                    }
                    if !on_policy {
                        assert!(
                            m.pg_clipfrac > 0.0 && m.pg_clipfrac_lower > 0.0,
                            "{what}: {m:?}"
                        );
                    } else {
                        assert_eq!(m.pg_clipfrac, 0.0);
                    }
                }
            }
        }
    }

    /// A micro-batch in f64, built row by row.
    #[derive(Clone, Default)]
    struct Case {
        offsets: Vec<usize>,
        mask: Vec<u8>,
        lp: Vec<f64>,
        old: Vec<f64>,
        adv: Vec<f64>,
        ref_lp: Vec<f64>,
        rollout: Vec<f64>,
        entropy: Vec<f64>,
    }

    impl Case {
        fn new() -> Case {
            Case {
                offsets: vec![0],
                ..Case::default()
            }
        }
        /// One token: (mask, lp, old, advantage); ref, rollout and entropy get defaults.
        fn tok(mut self, m: u8, lp: f64, old: f64, adv: f64) -> Case {
            self.mask.push(m);
            self.lp.push(lp);
            self.old.push(old);
            self.adv.push(adv);
            self.ref_lp.push(lp);
            self.rollout.push(old);
            self.entropy.push(1.0);
            self
        }
        fn end_row(mut self) -> Case {
            self.offsets.push(self.mask.len());
            self
        }
        fn inputs(&self) -> LossInputs<'_, f64> {
            LossInputs {
                offsets: &self.offsets,
                mask: &self.mask,
                lp: &self.lp,
                old: Some(&self.old),
                advantages: Some(&self.adv),
                ref_lp: Some(&self.ref_lp),
                rollout: Some(&self.rollout),
                entropy: Some(&self.entropy),
            }
        }
        fn norm(&self) -> LossNorm {
            LossNorm::of_mask(&self.offsets, &self.mask, None)
        }
        fn run(&self, cfg: &LossConfig) -> LossOutput<f64> {
            policy_loss(cfg, &self.inputs(), &self.norm(), 1.0).unwrap()
        }
    }

    fn cfg(mode: &str, agg: &str) -> LossConfig {
        LossConfig {
            agg: agg.parse().unwrap(),
            ..LossConfig::new(mode.parse().unwrap())
        }
    }

    fn close(got: f64, want: f64, what: &str) {
        assert!(
            (got - want).abs() <= 1e-12 * want.abs().max(1.0),
            "{what}: got {got}, want {want}"
        );
    }

    fn close_all(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            close(g, w, &format!("{what}[{i}]"));
        }
    }

    /// Row 0: (A=1, r=1.5), (A=-1, r=0.5), (A=-1, r=4); row 1: (A=2, r=1), (A=-1, r=1.1) and a
    /// masked token. old = -1 everywhere, lp = -1 + ln r.
    fn vanilla_case() -> Case {
        let l = |r: f64| -1.0 + r.ln();
        Case::new()
            .tok(1, l(1.5), -1.0, 1.0)
            .tok(1, l(0.5), -1.0, -1.0)
            .tok(1, l(4.0), -1.0, -1.0)
            .end_row()
            .tok(1, l(1.0), -1.0, 2.0)
            .tok(1, l(1.1), -1.0, -1.0)
            .tok(0, 5.0, 0.0, 7.0)
            .end_row()
    }

    #[test]
    fn vanilla_hand_values() {
        let c = vanilla_case();
        // Per token, clip 0.2 and dual clip 3:
        // 1: max(-1.5, -1.2) = -1.2 (clipped, grad 0)
        // 2: max(0.5, 0.8) = 0.8 (clipped), min(3, 0.8) = 0.8 (grad 0)
        // 3: max(4, 1.2) = 4, min(3, 4) = 3 (dual clip, lower, grad 0)
        // 4: max(-2, -2) = -2 (tie, grad -A·r = -2)
        // 5: max(1.1, 1.1) = 1.1, min(3, 1.1) = 1.1 (grad -A·r = 1.1)
        let out = c.run(&cfg("vanilla", "token-mean"));
        close(out.loss, (-1.2 + 0.8 + 3.0 - 2.0 + 1.1) / 5.0, "loss");
        close_all(
            &out.grad_lp,
            &[0.0, 0.0, 0.0, -2.0 / 5.0, 1.1 / 5.0, 0.0],
            "grad",
        );
        close(out.metrics.pg_loss, out.loss, "pg_loss");
        close(out.metrics.pg_clipfrac, 2.0 / 5.0, "clipfrac");
        close(out.metrics.pg_clipfrac_lower, 1.0 / 5.0, "clipfrac_lower");
        // mean(old - lp) = -ln(1.5 * 0.5 * 4 * 1 * 1.1)/5
        close(out.metrics.ppo_kl, -(3.3f64).ln() / 5.0, "ppo_kl");
        // entropies are all 1; no coefficient so they only show in the metric
        close(out.metrics.entropy, 1.0, "entropy");
        assert_eq!(out.grad_entropy.unwrap(), vec![0.0; 6]);

        // seq-mean-token-mean: ((−1.2 + 0.8 + 3)/3 + (−2 + 1.1)/2) / 2
        let out = c.run(&cfg("vanilla", "seq-mean-token-mean"));
        close(out.loss, (2.6 / 3.0 - 0.45) / 2.0, "smtm loss");
        close_all(
            &out.grad_lp,
            &[0.0, 0.0, 0.0, -0.5, 0.275, 0.0],
            "smtm grad",
        );
        // seq-mean-token-sum: (2.6 + (−0.9)) / 2
        let out = c.run(&cfg("vanilla", "seq-mean-token-sum"));
        close(out.loss, 0.85, "smts loss");
        close_all(&out.grad_lp, &[0.0, 0.0, 0.0, -1.0, 0.55, 0.0], "smts grad");
        // seq-mean-token-sum-norm: 1.7 / 3 (the longest row has 3 tokens)
        let out = c.run(&cfg("vanilla", "seq-mean-token-sum-norm"));
        close(out.loss, 1.7 / 3.0, "smtsn loss");
        close_all(
            &out.grad_lp,
            &[0.0, 0.0, 0.0, -2.0 / 3.0, 1.1 / 3.0, 0.0],
            "smtsn grad",
        );
    }

    #[test]
    fn gspo_hand_values() {
        // Row 0: A = 1, lp − old = [0.1, 0.3]: s = e^0.2 = 1.2214 > 1.2: max(−1.2214, −1.2) = −1.2
        // (clipped, grad 0). Row 1: A = −1, lp − old = [−0.1, 0.1] (+ a masked token): s = 1,
        // loss 1, grad −A·s/(2 tokens · 2 sequences) = 0.25. GSPO aggregates seq-mean-token-mean
        // even when asked for token-mean.
        let c = Case::new()
            .tok(1, -0.9, -1.0, 1.0)
            .tok(1, -0.7, -1.0, 1.0)
            .end_row()
            .tok(1, -2.1, -2.0, -1.0)
            .tok(1, -1.9, -2.0, -1.0)
            .tok(0, 0.0, -9.0, 4.0)
            .end_row();
        let out = c.run(&cfg("gspo", "token-mean"));
        close(out.loss, (-1.2 + 1.0) / 2.0, "loss");
        close_all(&out.grad_lp, &[0.0, 0.0, 0.25, 0.25, 0.0], "grad");
        close(out.metrics.pg_clipfrac, 0.5, "clipfrac");
        close(out.metrics.ppo_kl, -(0.1 + 0.3 - 0.1 + 0.1) / 4.0, "ppo_kl");
    }

    #[test]
    fn cispo_hand_values() {
        // 1: A = 1, r = 1.5 -> sg clip 1.2: ℓ = −1.2·1·lp, grad −1.2
        // 2: A = −1, r = 0.9 (inside): ℓ = −0.9·(−1)·lp, grad 0.9
        let (lp1, lp2) = (-1.0 + 1.5f64.ln(), -2.0 + 0.9f64.ln());
        let c = Case::new()
            .tok(1, lp1, -1.0, 1.0)
            .tok(1, lp2, -2.0, -1.0)
            .end_row();
        let out = c.run(&cfg("cispo", "token-mean"));
        close(out.loss, (-1.2 * lp1 + 0.9 * lp2) / 2.0, "loss");
        close_all(&out.grad_lp, &[-0.6, 0.45], "grad");
        close(out.metrics.pg_clipfrac, 0.5, "clipfrac");
        close(out.metrics.pg_clipfrac_lower, 0.0, "clipfrac_lower");
    }

    #[test]
    fn sft_hand_values() {
        // NLL of the valid tokens: (0.5 + 2)/2; needs neither old log-probs nor advantages
        let offsets = [0, 3];
        let mask = [1, 1, 0];
        let lp = [-0.5, -2.0, -1.0];
        let x = LossInputs {
            offsets: &offsets,
            mask: &mask,
            lp: &lp,
            old: None,
            advantages: None,
            ref_lp: None,
            rollout: None,
            entropy: None,
        };
        let norm = LossNorm::of_mask(&offsets, &mask, None);
        let out = policy_loss(&cfg("sft", "token-mean"), &x, &norm, 1.0).unwrap();
        close(out.loss, 1.25, "loss");
        close_all(&out.grad_lp, &[-0.5, -0.5, 0.0], "grad");
        assert_eq!(out.grad_entropy, None);
        close(out.metrics.ppo_kl, 0.0, "ppo_kl");
    }

    #[test]
    fn entropy_and_kl_loss_hand_values() {
        // On-policy (old = lp) with A = 0: no policy-gradient term. H = [1, 3], coeff 0.01:
        // loss −0.01·2. k3 KL loss, coef 0.1, lp − ref = [0.5, −0.1]:
        // k3(d) = e^−d + d − 1 and d k3/d lp = 1 − e^−d
        let mut c = Case::new()
            .tok(1, -1.0, -1.0, 0.0)
            .tok(1, -2.0, -2.0, 0.0)
            .end_row();
        c.entropy = vec![1.0, 3.0];
        c.ref_lp = vec![-1.5, -1.9];
        let k3 = |d: f64| (-d).exp() + d - 1.0;
        let dk3 = |d: f64| 1.0 - (-d).exp();
        let mut config = cfg("vanilla", "token-mean");
        config.entropy_coeff = 0.01;
        config.kl_loss = Some(KlLoss {
            coef: 0.1,
            penalty: "low_var_kl".parse().unwrap(),
        });
        let out = c.run(&config);
        let kl = (k3(0.5) + k3(-0.1)) / 2.0;
        close(out.loss, -0.01 * 2.0 + 0.1 * kl, "loss");
        close(out.metrics.entropy, 2.0, "entropy");
        close(out.metrics.kl_loss, kl, "kl_loss");
        close(out.metrics.pg_loss, 0.0, "pg_loss");
        close_all(
            &out.grad_lp,
            &[0.05 * dk3(0.5), 0.05 * dk3(-0.1)],
            "grad lp",
        );
        close_all(
            &out.grad_entropy.unwrap(),
            &[-0.005, -0.005],
            "grad entropy",
        );
    }

    #[test]
    fn rollout_is_hand_values() {
        // On-policy, A = 1: ℓ = −1 per token. old − rollout = [ln 3, ln 0.5].
        let mut c = Case::new()
            .tok(1, -1.0, -1.0, 1.0)
            .tok(1, -2.0, -2.0, 1.0)
            .end_row();
        c.rollout = vec![-1.0 - 3f64.ln(), -2.0 - 0.5f64.ln()];
        let mut config = cfg("vanilla", "token-mean");
        // token: weights min(3, 2) = 2 and 0.5: (−2 − 0.5)/2; grads −w/2
        config.rollout_is = Some(RolloutIs {
            level: RolloutIsLevel::Token,
            threshold: 2.0,
        });
        let out = c.run(&config);
        close(out.loss, -1.25, "token loss");
        close_all(&out.grad_lp, &[-1.0, -0.25], "token grad");
        // Token mean of the truncated weights (2 + 0.5)/2; one of the two was truncated.
        close(out.metrics.is_weight, 1.25, "token is_weight");
        close(out.metrics.is_truncated, 0.5, "token is_truncated");
        // sequence: exp(ln 3 + ln 0.5) = 1.5 on both tokens
        config.rollout_is = Some(RolloutIs {
            level: RolloutIsLevel::Sequence,
            threshold: 2.0,
        });
        let out = c.run(&config);
        close(out.loss, -1.5, "seq loss");
        close_all(&out.grad_lp, &[-0.75, -0.75], "seq grad");
        close(out.metrics.is_weight, 1.5, "seq is_weight");
        close(out.metrics.is_truncated, 0.0, "seq is_truncated");
        // ...truncated at 1.2: both tokens of the sequence
        config.rollout_is = Some(RolloutIs {
            level: RolloutIsLevel::Sequence,
            threshold: 1.2,
        });
        let out = c.run(&config);
        close(out.loss, -1.2, "truncated loss");
        close(out.metrics.is_truncated, 1.0, "seq truncated");
        // Without --rollout-is the metrics stay 0.
        config.rollout_is = None;
        let out = c.run(&config);
        assert_eq!(
            (out.metrics.is_weight, out.metrics.is_truncated),
            (0.0, 0.0)
        );
    }

    /// xorshift64*: deterministic inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let u = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
            lo + (hi - lo) * u
        }
    }

    /// Rows of 1..7 tokens with ~20% masked, ratios around the clip range, mixed-sign
    /// advantages (constant along a row when `seq_adv`).
    fn random_case(seed: u64, rows: usize, seq_adv: bool) -> Case {
        let mut rng = Rng(seed);
        let mut c = Case::new();
        for _ in 0..rows {
            let n = 1 + (rng.uniform(0.0, 7.0) as usize);
            let row_adv = rng.uniform(-2.0, 2.0);
            for _ in 0..n {
                let m = (rng.uniform(0.0, 1.0) > 0.2) as u8;
                let old = rng.uniform(-4.0, -0.1);
                let lp = old + rng.uniform(-0.6, 0.6);
                let a = if seq_adv {
                    row_adv
                } else {
                    rng.uniform(-2.0, 2.0)
                };
                c = c.tok(m, lp, old, a);
                let last = c.lp.len() - 1;
                c.ref_lp[last] = lp + rng.uniform(-1.0, 1.0);
                c.rollout[last] = old + rng.uniform(-0.5, 0.5);
                c.entropy[last] = rng.uniform(0.0, 3.0);
            }
            c = c.end_row();
        }
        c
    }

    /// Every configuration the tests sweep: each loss × aggregation × extra term.
    fn configs() -> Vec<LossConfig> {
        let mut out = vec![];
        for mode in ["vanilla", "gspo", "cispo", "sft"] {
            for agg in AGG_MODES {
                // 0: nothing else, 1: entropy bonus, 2..=5: KL loss of each estimator,
                // 6, 7: token / sequence rollout importance weights
                for extra in 0..8 {
                    let mut c = cfg(mode, agg);
                    c.clip_ratio_low = Some(0.15);
                    c.clip_ratio_high = Some(0.28);
                    // a dual clip that the sampled ratios actually reach
                    c.clip_ratio_c = 1.4;
                    match extra {
                        1 => c.entropy_coeff = 0.03,
                        2..=5 => {
                            c.kl_loss = Some(KlLoss {
                                coef: 0.2,
                                penalty: ["k1", "abs", "k2", "k3"][extra - 2].parse().unwrap(),
                            })
                        }
                        6 | 7 if mode != "sft" => {
                            c.rollout_is = Some(RolloutIs {
                                level: if extra == 6 {
                                    RolloutIsLevel::Token
                                } else {
                                    RolloutIsLevel::Sequence
                                },
                                threshold: 1.3,
                            })
                        }
                        _ => {}
                    }
                    out.push(c);
                }
            }
        }
        out
    }

    const AGG_MODES: [&str; 4] = [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ];

    /// Central differences of the surrogate (stop-gradient terms frozen at `c.lp`) against the
    /// analytic gradient, for every token's log-prob and entropy.
    fn check_fd(config: &LossConfig, c: &Case) {
        let norm = c.norm();
        let got = compute(config, &c.inputs(), &c.lp, &norm, 1.0).unwrap();
        let h = 1e-6;
        let f = |lp: &[f64], ent: &[f64]| {
            let mut x = c.inputs();
            x.lp = lp;
            x.entropy = Some(ent);
            compute(config, &x, &c.lp, &norm, 1.0).unwrap().loss
        };
        for t in 0..c.lp.len() {
            let (mut up, mut down) = (c.lp.clone(), c.lp.clone());
            up[t] += h;
            down[t] -= h;
            let fd = (f(&up, &c.entropy) - f(&down, &c.entropy)) / (2.0 * h);
            let g = got.grad_lp[t];
            assert!(
                (g - fd).abs() < 1e-7 * g.abs().max(1.0),
                "{config:?}\nd loss/d lp[{t}]: analytic {g}, finite differences {fd}"
            );
            let (mut up, mut down) = (c.entropy.clone(), c.entropy.clone());
            up[t] += h;
            down[t] -= h;
            let fd = (f(&c.lp, &up) - f(&c.lp, &down)) / (2.0 * h);
            let g = got.grad_entropy.as_ref().unwrap()[t];
            assert!(
                (g - fd).abs() < 1e-7 * g.abs().max(1.0),
                "{config:?}\nd loss/d entropy[{t}]: analytic {g}, finite differences {fd}"
            );
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let c = random_case(7, 12, false);
        for config in configs() {
            check_fd(&config, &c);
        }
    }

    #[test]
    fn dual_clip_and_clip_branches_are_exercised() {
        // The finite-difference sweep only means something if the random ratios hit every
        // branch: clipped above, clipped below, dual-clipped and unclipped.
        let c = random_case(7, 12, false);
        let mut config = cfg("vanilla", "token-mean");
        config.clip_ratio_low = Some(0.15);
        config.clip_ratio_high = Some(0.28);
        config.clip_ratio_c = 1.4;
        let out = c.run(&config);
        let m = out.metrics;
        assert!(m.pg_clipfrac > 0.05 && m.pg_clipfrac < 0.8, "{m:?}");
        assert!(m.pg_clipfrac_lower > 0.0, "{m:?}");
        let zero = out
            .grad_lp
            .iter()
            .zip(&c.mask)
            .filter(|(&g, &k)| k != 0 && g == 0.0);
        let nonzero = out
            .grad_lp
            .iter()
            .zip(&c.mask)
            .filter(|(&g, &k)| k != 0 && g != 0.0);
        assert!(zero.count() > 0 && nonzero.count() > 0);
    }

    #[test]
    fn gspo_gradient_is_the_gradient_of_its_value() {
        // With advantages constant along each row and no token-level weights, GSPO's
        // stop-gradient surrogate has the same gradient as the loss value itself.
        let c = random_case(11, 10, true);
        let mut config = cfg("gspo", "token-mean");
        config.clip_ratio = 0.1;
        let got = c.run(&config);
        let h = 1e-6;
        for t in 0..c.lp.len() {
            let (mut up, mut down) = (c.clone(), c.clone());
            up.lp[t] += h;
            down.lp[t] -= h;
            let fd = (up.run(&config).loss - down.run(&config).loss) / (2.0 * h);
            let g = got.grad_lp[t];
            assert!((g - fd).abs() < 1e-7, "token {t}: analytic {g}, fd {fd}");
        }
    }

    #[test]
    fn micro_batches_add_up_to_the_mini_batch() {
        let c = random_case(3, 9, false);
        let norm = c.norm();
        for config in configs() {
            let whole = policy_loss(&config, &c.inputs(), &norm, 0.5).unwrap();
            // Split after rows 2 and 6: each part gets the mini-batch's norm.
            let mut loss = 0.0;
            let mut grad = vec![];
            let mut grad_ent = vec![];
            let mut metrics = LossMetrics::default();
            for (r0, r1) in [(0, 2), (2, 6), (6, 9)] {
                let (a, b) = (c.offsets[r0], c.offsets[r1]);
                let offsets: Vec<usize> = c.offsets[r0..=r1].iter().map(|o| o - a).collect();
                let x = LossInputs {
                    offsets: &offsets,
                    mask: &c.mask[a..b],
                    lp: &c.lp[a..b],
                    old: Some(&c.old[a..b]),
                    advantages: Some(&c.adv[a..b]),
                    ref_lp: Some(&c.ref_lp[a..b]),
                    rollout: Some(&c.rollout[a..b]),
                    entropy: Some(&c.entropy[a..b]),
                };
                let part = policy_loss(&config, &x, &norm, 0.5).unwrap();
                loss += part.loss;
                grad.extend(part.grad_lp);
                grad_ent.extend(part.grad_entropy.unwrap());
                metrics.add(&part.metrics);
            }
            assert!((loss - whole.loss).abs() < 1e-12, "{config:?}");
            for (g, w) in grad.iter().zip(&whole.grad_lp) {
                assert!((g - w).abs() < 1e-15, "{config:?}");
            }
            assert_eq!(grad_ent, whole.grad_entropy.unwrap());
            let (m, w) = (metrics, whole.metrics);
            for (got, want) in [
                (m.pg_loss, w.pg_loss),
                (m.pg_clipfrac, w.pg_clipfrac),
                (m.pg_clipfrac_lower, w.pg_clipfrac_lower),
                (m.ppo_kl, w.ppo_kl),
                (m.entropy, w.entropy),
                (m.kl_loss, w.kl_loss),
            ] {
                assert!((got - want).abs() < 1e-12, "{config:?}: {m:?} vs {w:?}");
            }
        }
    }

    #[test]
    fn f32_agrees_with_f64() {
        let c = random_case(5, 10, false);
        let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        // Round the f64 case through f32 first so both see the same numbers.
        let mut c64 = c.clone();
        for v in [
            &mut c64.lp,
            &mut c64.old,
            &mut c64.adv,
            &mut c64.ref_lp,
            &mut c64.rollout,
            &mut c64.entropy,
        ] {
            *v = v.iter().map(|&x| x as f32 as f64).collect();
        }
        let (lp, old, adv, rf, roll, ent) = (
            to32(&c.lp),
            to32(&c.old),
            to32(&c.adv),
            to32(&c.ref_lp),
            to32(&c.rollout),
            to32(&c.entropy),
        );
        let x32 = LossInputs {
            offsets: &c.offsets,
            mask: &c.mask,
            lp: &lp,
            old: Some(&old),
            advantages: Some(&adv),
            ref_lp: Some(&rf),
            rollout: Some(&roll),
            entropy: Some(&ent),
        };
        for config in configs() {
            let a = policy_loss(&config, &x32, &c64.norm(), 1.0).unwrap();
            let b = c64.run(&config);
            assert!((a.loss - b.loss).abs() < 1e-12, "{config:?}");
            for (g32, g64) in a.grad_lp.iter().zip(&b.grad_lp) {
                assert!(
                    (*g32 as f64 - g64).abs() <= 1e-7 * g64.abs().max(1e-3),
                    "{config:?}"
                );
            }
        }
    }

    #[test]
    fn every_mode_is_registered_once() {
        // A new LossMode variant fails to compile here until it is listed, then fails this test
        // until LOSSES registers it.
        let all = |m: LossMode| match m {
            LossMode::Vanilla | LossMode::Gspo | LossMode::Cispo | LossMode::Sft => m,
        };
        let modes = [
            LossMode::Vanilla,
            LossMode::Gspo,
            LossMode::Cispo,
            LossMode::Sft,
        ]
        .map(all);
        assert_eq!(LOSSES.len(), modes.len());
        for m in modes {
            assert_eq!(LOSSES.iter().filter(|l| l.mode == m).count(), 1, "{m:?}");
        }
        let mut names = names();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), LOSSES.len(), "duplicate names");
        assert_eq!(
            LossMode::value_variants(),
            &LOSSES.iter().map(|l| l.mode).collect::<Vec<_>>()[..]
        );
    }

    #[test]
    fn every_registered_loss_parses_and_runs() {
        let c = random_case(13, 8, false);
        for l in LOSSES {
            let mode: LossMode = l.name.parse().unwrap();
            assert_eq!(mode, l.mode);
            assert_eq!(mode.to_string(), l.name);
            assert_eq!(mode.loss().name, l.name);
            assert_eq!(<LossMode as ValueEnum>::from_str(l.name, false), Ok(mode));
            assert_eq!(mode.to_possible_value().unwrap().get_name(), l.name);
            // Through clap, as `update --loss NAME` parses it.
            let cmd = clap::Command::new("t").arg(
                clap::Arg::new("loss")
                    .long("loss")
                    .value_parser(clap::value_parser!(LossMode)),
            );
            let got = cmd.try_get_matches_from(["t", "--loss", l.name]).unwrap();
            assert_eq!(got.get_one::<LossMode>("loss"), Some(&mode));

            let mut config = cfg(l.name, "token-mean");
            config.clip_ratio_c = 1.4;
            let out = c.run(&config);
            assert!(
                out.loss.is_finite() && out.loss != 0.0,
                "{}: {out:?}",
                l.name
            );
            assert!(out.grad_lp.iter().any(|&g| g != 0.0), "{}", l.name);
            check_fd(&config, &c);
            // Needs old log-probs and advantages exactly when it is a policy-gradient loss.
            let mut x = c.inputs();
            x.advantages = None;
            x.old = None;
            let r = policy_loss(&config, &x, &c.norm(), 1.0);
            assert_eq!(r.is_err(), l.policy_gradient, "{}", l.name);
        }
    }

    #[test]
    fn an_unknown_loss_lists_every_registered_name() {
        let err = "ppo".parse::<LossMode>().unwrap_err();
        assert!(err.starts_with("unknown loss 'ppo'"), "{err}");
        for l in LOSSES {
            assert!(err.contains(l.name), "{err}");
        }
        let mut cmd = clap::Command::new("update").arg(
            clap::Arg::new("loss")
                .long("loss")
                .help("Policy loss.")
                .value_parser(clap::value_parser!(LossMode)),
        );
        let err = cmd
            .clone()
            .try_get_matches_from(["update", "--loss", "ppo"])
            .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
        assert_eq!(err.exit_code(), 2);
        let text = err.render().to_string();
        assert!(text.contains("'ppo'"), "{text}");
        for l in LOSSES {
            assert!(text.contains(l.name), "{text}");
        }
        // --help lists each name with its formula line.
        let help = cmd.render_long_help().to_string();
        for l in LOSSES {
            let line = help
                .lines()
                .find(|s| s.trim().starts_with(&format!("- {}:", l.name)));
            assert!(line.is_some_and(|s| s.ends_with(l.about)), "{help}");
        }
    }

    #[test]
    fn bad_knobs_and_missing_inputs() {
        let c = vanilla_case();
        let mut config = cfg("vanilla", "token-mean");
        config.clip_ratio_c = 1.0;
        let err = policy_loss(&config, &c.inputs(), &c.norm(), 1.0).unwrap_err();
        assert!(err.to_string().contains("--clip-ratio-c"), "{err}");
        assert!(crate::error::is_input_error(&err));

        let config = cfg("cispo", "token-mean");
        let mut x = c.inputs();
        x.advantages = None;
        let err = policy_loss(&config, &x, &c.norm(), 1.0).unwrap_err();
        assert!(
            err.to_string().contains("--loss cispo needs advantages"),
            "{err}"
        );

        let mut config = cfg("vanilla", "token-mean");
        config.kl_loss = Some(KlLoss {
            coef: 0.1,
            penalty: "k1".parse().unwrap(),
        });
        let mut x = c.inputs();
        x.ref_lp = None;
        let err = policy_loss(&config, &x, &c.norm(), 1.0).unwrap_err();
        assert!(
            err.to_string().contains("--use-kl-loss needs reference"),
            "{err}"
        );

        let mut config = cfg("sft", "token-mean");
        config.rollout_is = Some(RolloutIs {
            level: RolloutIsLevel::Token,
            threshold: 2.0,
        });
        assert!(policy_loss(&config, &c.inputs(), &c.norm(), 1.0).is_err());

        // A norm that does not count this micro-batch's tokens
        let config = cfg("vanilla", "token-mean");
        let empty = LossNorm {
            tokens: 0.0,
            seqs: 0.0,
            norm: 0.0,
        };
        assert!(policy_loss(&config, &c.inputs(), &empty, 1.0).is_err());
        assert!("ppo".parse::<LossMode>().is_err());
        assert!("tok".parse::<RolloutIsLevel>().is_err());
    }
}
