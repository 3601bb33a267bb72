//! Policy losses for `update` (verl's `compute_policy_loss_*`, `agg_loss`, entropy bonus and KL
//! loss): the scalar loss of one micro-batch AND its exact gradient with respect to every token's
//! log-prob and entropy, plus metrics.
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
use crate::bail_input;
use anyhow::{ensure, Result};
use std::fmt;
use std::str::FromStr;

/// Which policy-gradient surrogate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossMode {
    /// PPO clip with dual clip for negative advantages.
    Vanilla,
    /// Sequence-level ratio (arXiv:2507.18071), always aggregated seq-mean-token-mean.
    Gspo,
    /// Clipped, detached ratio times log-prob (arXiv:2506.13585).
    Cispo,
    /// Negative log-likelihood of the valid tokens (warm starts); needs no advantages.
    Sft,
}

pub const LOSS_MODE_NAMES: &str = "vanilla, gspo, cispo, sft";

impl FromStr for LossMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "vanilla" => LossMode::Vanilla,
            "gspo" => LossMode::Gspo,
            "cispo" => LossMode::Cispo,
            "sft" => LossMode::Sft,
            _ => {
                return Err(format!(
                    "unknown loss '{s}' (expected one of {LOSS_MODE_NAMES})"
                ))
            }
        })
    }
}

impl fmt::Display for LossMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossMode::Vanilla => "vanilla",
            LossMode::Gspo => "gspo",
            LossMode::Cispo => "cispo",
            LossMode::Sft => "sft",
        })
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
pub struct RolloutIs {
    pub level: RolloutIsLevel,
    /// Weights are truncated to at most this (verl's rollout_is_threshold, default 2.0).
    pub threshold: f64,
}

/// KL loss against the reference model (verl's use_kl_loss).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlLoss {
    pub coef: f64,
    pub penalty: KlPenalty,
}

/// The loss knobs, named as in verl's actor config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossConfig {
    pub mode: LossMode,
    pub clip_ratio: f64,
    /// Defaults to clip_ratio.
    pub clip_ratio_low: Option<f64>,
    /// Defaults to clip_ratio.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages (vanilla), > 1.
    pub clip_ratio_c: f64,
    pub agg: AggMode,
    /// loss −= entropy_coeff · agg(entropy)
    pub entropy_coeff: f64,
    pub kl_loss: Option<KlLoss>,
    pub rollout_is: Option<RolloutIs>,
}

impl LossConfig {
    /// verl's defaults: clip 0.2, dual clip 3.0, token-mean, no entropy bonus, no KL loss.
    pub fn new(mode: LossMode) -> LossConfig {
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

    pub fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    pub fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }

    /// Check the knobs; errors name the flag.
    pub fn validate(&self) -> Result<()> {
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
                bail_input!("--kl-loss-coef must be a finite number >= 0, got {}", k.coef);
            }
        }
        if let Some(r) = self.rollout_is {
            if !(r.threshold.is_finite() && r.threshold > 0.0) {
                bail_input!(
                    "--rollout-is-threshold must be a finite number > 0, got {}",
                    r.threshold
                );
            }
            if self.mode == LossMode::Sft {
                bail_input!("--rollout-is weights a policy-gradient loss; --loss sft has none");
            }
        }
        Ok(())
    }

    /// GSPO aggregates its policy loss per sequence whatever loss_agg_mode says (as verl).
    fn pg_agg(&self) -> AggMode {
        match self.mode {
            LossMode::Gspo => AggMode::SeqMeanTokenMean,
            _ => self.agg,
        }
    }
}

/// One micro-batch: ragged rows (one per sequence) of per-token values.
pub struct LossInputs<'a, T> {
    pub offsets: &'a [usize],
    pub mask: &'a [u8],
    /// Current log-probs (what the gradient is taken with respect to).
    pub lp: &'a [T],
    /// Log-probs of the policy that sampled (for on-policy, the current ones).
    pub old: Option<&'a [T]>,
    pub advantages: Option<&'a [T]>,
    pub ref_lp: Option<&'a [T]>,
    pub rollout: Option<&'a [T]>,
    pub entropy: Option<&'a [T]>,
}

/// This micro-batch's share of each mini-batch metric: add them up over micro-batches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossMetrics {
    pub pg_loss: f64,
    pub pg_clipfrac: f64,
    pub pg_clipfrac_lower: f64,
    pub ppo_kl: f64,
    pub entropy: f64,
    pub kl_loss: f64,
}

impl LossMetrics {
    pub fn add(&mut self, o: &LossMetrics) {
        self.pg_loss += o.pg_loss;
        self.pg_clipfrac += o.pg_clipfrac;
        self.pg_clipfrac_lower += o.pg_clipfrac_lower;
        self.ppo_kl += o.ppo_kl;
        self.entropy += o.entropy;
        self.kl_loss += o.kl_loss;
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "pg_loss": self.pg_loss,
            "pg_clipfrac": self.pg_clipfrac,
            "pg_clipfrac_lower": self.pg_clipfrac_lower,
            "ppo_kl": self.ppo_kl,
            "entropy": self.entropy,
            "kl_loss": self.kl_loss,
        })
    }
}

/// The micro-batch's loss (scaled), d loss / d lp per token, d loss / d entropy per token (when
/// entropies were given), and metrics.
#[derive(Clone, Debug, PartialEq)]
pub struct LossOutput<T> {
    pub loss: f64,
    pub grad_lp: Vec<T>,
    pub grad_entropy: Option<Vec<T>>,
    pub metrics: LossMetrics,
}

/// Compute the loss of one micro-batch and its gradient.
pub fn policy_loss<T: Real>(
    cfg: &LossConfig,
    x: &LossInputs<T>,
    norm: &LossNorm,
    scale: f64,
) -> Result<LossOutput<T>> {
    compute(cfg, x, x.lp, norm, scale)
}

/// A value and its derivative with respect to one token's log-prob (forward mode). max/min
/// split the derivative at ties and clamps pass it on their closed interval, as torch does.
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
        D { v: e, d: e * self.d }
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
    fn minimum(self, o: D) -> D {
        self.mul(-1.0).maximum(o.mul(-1.0)).mul(-1.0)
    }
}

/// The policy-gradient loss of one token and whether it was clipped (upper, lower).
struct TokenPg {
    loss: D,
    clipped: bool,
    clipped_lower: bool,
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
            ensure!(len == n_tok, "loss: {name} has {len} tokens, offsets say {n_tok}");
        }
    }
    let mode = cfg.mode;
    let pg_needs = mode != LossMode::Sft;
    let need = |what: &str, why: &str| {
        crate::error::input_error(format!("policy loss: {why} needs {what}"))
    };
    let old = match (pg_needs, x.old) {
        (true, None) => return Err(need("old log-probs", &format!("--loss {mode}"))),
        (_, o) => o,
    };
    let adv = match (pg_needs, x.advantages) {
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

    let (lo, hi, c) = (1.0 - cfg.clip_low(), 1.0 + cfg.clip_high(), cfg.clip_ratio_c);
    let mut grad_lp = vec![T::from_f64(0.0); n_tok];
    let mut grad_entropy = x.entropy.map(|_| vec![T::from_f64(0.0); n_tok]);
    let mut m = LossMetrics::default();
    let at = |v: &[T], t: usize| v[t].to_f64();

    for w in x.offsets.windows(2) {
        let (a, b) = (w[0], w[1]);
        let valid: Vec<usize> = (a..b).filter(|&t| x.mask[t] != 0).collect();
        let n = valid.len();
        if n == 0 {
            continue;
        }
        let w_pg = norm.row_weight(cfg.pg_agg(), n)?;
        let w_agg = norm.row_weight(cfg.agg, n)?;
        let w_tok = norm.row_weight(AggMode::TokenMean, n)?;

        // Sequence-level quantities, constant within the row.
        let seq_is = match (cfg.rollout_is, rollout, old) {
            (Some(r), Some(roll), Some(old)) if r.level == RolloutIsLevel::Sequence => {
                // w_i = min(exp(clamp(Σ_t (old − rollout), ±20)), threshold)
                let s: f64 = valid.iter().map(|&t| at(old, t) - at(roll, t)).sum();
                s.clamp(-20.0, 20.0).exp().min(r.threshold)
            }
            _ => 1.0,
        };
        // GSPO: log s_i = mean_t (lp − old) at the anchor (detached)
        let gspo_log_s = match (mode, old) {
            (LossMode::Gspo, Some(old)) => {
                valid.iter().map(|&t| at(anchor, t) - at(old, t)).sum::<f64>() / n as f64
            }
            _ => 0.0,
        };

        for &t in &valid {
            let lp = D::var(at(x.lp, t));
            let pg = match mode {
                LossMode::Sft => TokenPg {
                    // ℓ = −lp
                    loss: lp.mul(-1.0),
                    clipped: false,
                    clipped_lower: false,
                },
                LossMode::Vanilla => {
                    let (o, a_t) = (at(old.unwrap(), t), at(adv.unwrap(), t));
                    // r = exp(clamp(lp − old, ±20)); ℓ = max(−A·r, −A·clip(r, 1−εl, 1+εh)),
                    // and for A < 0 the dual clip min(ℓ, −A·c)
                    let r = lp.add(-o).clamp(-20.0, 20.0).exp();
                    let pg1 = r.mul(-a_t);
                    let pg2 = r.clamp(lo, hi).mul(-a_t);
                    let c1 = pg1.maximum(pg2);
                    let pg3 = D::cst(-a_t * c);
                    let c2 = pg3.minimum(c1);
                    TokenPg {
                        loss: if a_t < 0.0 { c2 } else { c1 },
                        clipped: pg2.v > pg1.v,
                        clipped_lower: a_t < 0.0 && c1.v > pg3.v,
                    }
                }
                LossMode::Gspo => {
                    let a_t = at(adv.unwrap(), t);
                    // s_it = exp(min(sg[log s_i] + lp − sg[lp], 10));
                    // ℓ = max(−A·s_it, −A·clip(s_it, 1−εl, 1+εh))
                    let s = lp
                        .add(gspo_log_s - at(anchor, t))
                        .clamp(f64::NEG_INFINITY, 10.0)
                        .exp();
                    let pg1 = s.mul(-a_t);
                    let pg2 = s.clamp(lo, hi).mul(-a_t);
                    TokenPg {
                        loss: pg1.maximum(pg2),
                        clipped: pg2.v > pg1.v,
                        clipped_lower: false,
                    }
                }
                LossMode::Cispo => {
                    let (o, a_t) = (at(old.unwrap(), t), at(adv.unwrap(), t));
                    // ℓ = −sg[clip(exp(clamp(lp − old, ±20)), 1−εl, 1+εh)]·A·lp
                    let r = (at(anchor, t) - o).clamp(-20.0, 20.0).exp();
                    let rc = r.clamp(lo, hi);
                    TokenPg {
                        loss: lp.mul(-rc * a_t),
                        clipped: r != rc,
                        clipped_lower: false,
                    }
                }
            };
            // Truncated rollout importance weight (detached): token min(exp(clamp(old −
            // rollout, ±20)), threshold), or the row's sequence weight.
            let is_w = match (cfg.rollout_is, rollout, old) {
                (Some(r), Some(roll), Some(old)) if r.level == RolloutIsLevel::Token => {
                    (at(old, t) - at(roll, t))
                        .clamp(-20.0, 20.0)
                        .exp()
                        .min(r.threshold)
                }
                _ => seq_is,
            };
            let pg_loss = pg.loss.mul(is_w);
            m.pg_loss += w_pg * pg_loss.v;
            let mut g = w_pg * pg_loss.d;
            m.pg_clipfrac += w_tok * pg.clipped as u8 as f64;
            m.pg_clipfrac_lower += w_tok * pg.clipped_lower as u8 as f64;
            if let Some(old) = old {
                // ppo_kl = mean(old − lp); vanilla and cispo clamp the log ratio first
                let d = lp.v - at(old, t);
                let d = match mode {
                    LossMode::Vanilla | LossMode::Cispo => d.clamp(-20.0, 20.0),
                    _ => d,
                };
                m.ppo_kl += w_tok * -d;
            }
            if let (Some(ent), Some(ge)) = (x.entropy, grad_entropy.as_mut()) {
                // loss −= coeff·agg(H)
                m.entropy += w_agg * at(ent, t);
                ge[t] = T::from_f64(-scale * cfg.entropy_coeff * w_agg);
            }
            if let (Some(k), Some(r)) = (cfg.kl_loss, ref_lp) {
                // loss += coef·agg(kl(lp, ref))
                let (v, dv) = k.penalty.value_grad(lp.v, at(r, t));
                m.kl_loss += w_agg * v;
                g += k.coef * w_agg * dv;
            }
            grad_lp[t] = T::from_f64(scale * g);
        }
    }
    let kl_term = cfg.kl_loss.map_or(0.0, |k| k.coef * m.kl_loss);
    let loss = scale * (m.pg_loss - cfg.entropy_coeff * m.entropy + kl_term);
    Ok(LossOutput {
        loss,
        grad_lp,
        grad_entropy,
        metrics: m,
    })
}
