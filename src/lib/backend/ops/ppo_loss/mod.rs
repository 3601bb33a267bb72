//! The fused PPO-clip policy loss (verl's vanilla loss with dual clip): dL/dlp for every token
//! of a micro-batch from the log-probs the LM head left on the device, and the loss metrics
//! added to a small accumulator, with no host round trip.
//!
//! Files: `cpu.rs` (the reference, checked against `algo::policy_loss`), `cuda.rs`,
//! `ppo_loss.cu`, `check.rs` (the `ppo_loss` GPU case).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

pub(crate) use cpu::ppo_token;

use anyhow::Result;

use crate::backend::Device;

/// The fused PPO-clip loss of one micro-batch (verl's vanilla policy loss with dual clip).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PpoShape {
    /// Scored tokens.
    pub tokens: usize,
    /// 1 − ε_low and 1 + ε_high: the ratio's clip range.
    pub ratio_low: f64,
    pub ratio_high: f64,
    /// Dual-clip bound c (> 1) for negative advantages.
    pub dual_clip: f64,
}

/// The per-token inputs of the loss: log-probs, the behaviour policy's (None: on-policy),
/// advantages, the weights w = [w_pg | w_tok | w_agg] (3·tokens) and, for the metric, entropies.
#[derive(Clone, Copy, Debug)]
pub struct PpoInputs<T> {
    pub lp: T,
    pub old: Option<T>,
    pub adv: T,
    pub w: T,
    pub ent: Option<T>,
}

/// Slots of the accumulator [`PpoLossOps::ppo_clip_loss`] adds to: Σ w_pg·ℓ, Σ w_tok·clipped,
/// Σ w_tok·clipped_lower, Σ w_tok·(old − lp), Σ w_agg·entropy, count of non-finite tokens.
pub const PPO_STATS: usize = 6;

/// The fused policy loss.
pub trait PpoLossOps: Device {
    /// Per token t with w_tok[t] > 0 (w = [w_pg | w_tok | w_agg], 3·tokens; 0 = masked):
    /// r = exp(clamp(lp − old, ±20)), ℓ = max(−A·r, −A·clip(r, lo, hi)), for A < 0 min(ℓ, −A·c);
    /// dlp = w_pg·∂ℓ/∂lp (torch's subgradients: ties split, clamps pass on their closed
    /// interval; 0 where masked), and [`PPO_STATS`] sums are added to `stats`. `old` None means
    /// on-policy (old = lp, detached). Math in f64, as `algo::policy_loss` does it.
    fn ppo_clip_loss(
        &self,
        dlp: &mut Self::Buf,
        stats: &mut Self::Buf,
        x: PpoInputs<&Self::Buf>,
        shape: PpoShape,
    ) -> Result<()>;
}
