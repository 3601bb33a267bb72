//! The fused PPO-clip loss (the oracle of the GPU kernel): verl's vanilla policy loss with dual
//! clip for one micro-batch, its gradient with respect to each log-prob, and the metric sums.
//! Aggregation is folded into per-token weights by the caller, so every agg mode is the same op.

use anyhow::Result;

use super::{PpoInputs, PpoLossOps, PpoShape, PPO_STATS};
use crate::backend::cpu::{get, get_mut, Cpu};

/// One token's loss, its derivative with respect to lp, and whether it was clipped
/// (upper, lower) and the clamped log-ratio.
pub(crate) struct PpoToken {
    pub(crate) loss: f64,
    pub(crate) dloss: f64,
    pub(crate) clipped: bool,
    pub(crate) clipped_lower: bool,
    pub(crate) log_ratio: f64,
}

/// max with torch's subgradient: the derivative is split at a tie.
fn maximum(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    if a.0 > b.0 {
        a
    } else if a.0 < b.0 {
        b
    } else {
        (a.0, 0.5 * (a.1 + b.1))
    }
}

/// PPO clip for one token, the one host definition: `algo::policy_loss`'s registered `vanilla`
/// loss calls it, [`ppo_clip_loss`] runs it, and the CUDA kernel is checked against that op.
/// PPO (Schulman et al. 2017, arXiv:1707.06347) with clip-higher (lo ≠ 2 − hi, DAPO,
/// arXiv:2503.14476) and dual clip (Ye et al. 2020, arXiv:1912.09729):
/// r = exp(clamp(lp − old, ±20)); ℓ = max(−A·r, −A·clip(r, lo, hi)), and for A < 0 the dual
/// clip min(ℓ, −A·c). dℓ/dlp splits at ties of max/min and passes clamps on their closed
/// interval (torch's subgradients).
pub(crate) fn ppo_token(lp: f64, old: f64, a: f64, s: &PpoShape) -> PpoToken {
    let d = lp - old;
    let (dc, ddc) = if d < -20.0 {
        (-20.0, 0.0)
    } else if d > 20.0 {
        (20.0, 0.0)
    } else {
        (d, 1.0)
    };
    let r = dc.exp();
    let dr = r * ddc;
    let (rc, drc) = if r < s.ratio_low {
        (s.ratio_low, 0.0)
    } else if r > s.ratio_high {
        (s.ratio_high, 0.0)
    } else {
        (r, dr)
    };
    let pg1 = (-a * r, -a * dr);
    let pg2 = (-a * rc, -a * drc);
    let c1 = maximum(pg1, pg2);
    let pg3 = -a * s.dual_clip;
    let loss = if a < 0.0 {
        // min(pg3, c1) = −max(−pg3, −c1)
        let m = maximum((-pg3, 0.0), (-c1.0, -c1.1));
        (-m.0, -m.1)
    } else {
        c1
    };
    PpoToken {
        loss: loss.0,
        dloss: loss.1,
        clipped: pg2.0 > pg1.0,
        clipped_lower: a < 0.0 && c1.0 > pg3,
        log_ratio: dc,
    }
}

/// The op over `s.tokens` tokens; `w` holds [w_pg | w_tok | w_agg]; stats gets the
/// [`PPO_STATS`] sums added (f64 sums, stored as f32).
pub fn ppo_clip_loss(dlp: &mut [f32], stats: &mut [f32], x: PpoInputs<&[f32]>, s: &PpoShape) {
    let PpoInputs {
        lp,
        old,
        adv,
        w,
        ent,
    } = x;
    let n = s.tokens;
    let mut acc = [0f64; PPO_STATS];
    for t in 0..n {
        let (w_pg, w_tok, w_agg) = (w[t] as f64, w[n + t] as f64, w[2 * n + t] as f64);
        if w_tok == 0.0 {
            dlp[t] = 0.0;
            continue;
        }
        let l = lp[t] as f64;
        let o = old.map_or(l, |o| o[t] as f64);
        let k = ppo_token(l, o, adv[t] as f64, s);
        dlp[t] = (w_pg * k.dloss) as f32;
        acc[0] += w_pg * k.loss;
        acc[1] += w_tok * k.clipped as u8 as f64;
        acc[2] += w_tok * k.clipped_lower as u8 as f64;
        acc[3] -= w_tok * k.log_ratio;
        let e = ent.map_or(0.0, |e| e[t] as f64);
        acc[4] += w_agg * e;
        acc[5] += !(k.loss.is_finite() && e.is_finite()) as u8 as f64;
    }
    for (st, a) in stats.iter_mut().zip(acc) {
        *st = (*st as f64 + a) as f32;
    }
}

impl PpoLossOps for Cpu {
    fn ppo_clip_loss(
        &self,
        dlp: &mut Vec<f32>,
        stats: &mut Vec<f32>,
        x: PpoInputs<&Vec<f32>>,
        s: PpoShape,
    ) -> Result<()> {
        let n = s.tokens;
        let old = match x.old {
            Some(o) => Some(get(o, n, "ppo_clip_loss old")?),
            None => None,
        };
        let ent = match x.ent {
            Some(e) => Some(get(e, n, "ppo_clip_loss ent")?),
            None => None,
        };
        ppo_clip_loss(
            get_mut(dlp, n, "ppo_clip_loss dlp")?,
            get_mut(stats, PPO_STATS, "ppo_clip_loss stats")?,
            PpoInputs {
                lp: get(x.lp, n, "ppo_clip_loss lp")?,
                old,
                adv: get(x.adv, n, "ppo_clip_loss adv")?,
                w: get(x.w, 3 * n, "ppo_clip_loss w")?,
                ent,
            },
            &s,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_token_is_counted_and_masked_ones_are_not() {
        let s = PpoShape {
            tokens: 3,
            ratio_low: 0.8,
            ratio_high: 1.2,
            dual_clip: 3.0,
        };
        let lp = [f32::NAN, -1.0, f32::NAN];
        // Token 2 is masked (w_tok = 0): its NaN is ignored and its gradient is 0.
        let w = [0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5];
        let mut dlp = [9.0f32; 3];
        let mut stats = [0f32; PPO_STATS];
        ppo_clip_loss(
            &mut dlp,
            &mut stats,
            PpoInputs {
                lp: &lp,
                old: None,
                adv: &[1.0, 2.0, 3.0],
                w: &w,
                ent: None,
            },
            &s,
        );
        assert_eq!(stats[5], 1.0);
        assert_eq!(dlp[2], 0.0);
        // On-policy token 1: ratio 1, ∂ℓ/∂lp = −A, times w_pg.
        assert_eq!(dlp[1], -1.0);
    }
}
