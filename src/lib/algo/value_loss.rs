//! The critic's loss (verl's `compute_value_loss`): the clipped value loss
//!
//! ```text
//! vf_loss = 0.5 · agg( max((V − R)², (clip(V, V_old − c, V_old + c) − R)²) )
//! ```
//!
//! over the response tokens, where V is the critic's current value, V_old the batch's `values`
//! (the critic that valued the rollout), R the `returns` GAE wrote, c `cliprange_value`, and
//! `agg` a loss aggregation mode ([`super::agg`]). Its metrics are verl's: `vf_loss`,
//! `vf_clipfrac` (the token mean of "the clipped term is the larger"), `vpred_mean` (the token
//! mean of V); [`explained_variance`] is `critic/vf_explained_var`.

use super::agg::{AggMode, LossNorm};
use super::policy_loss::{LossMetrics, LossOutput};
use anyhow::{ensure, Result};

/// The value loss's knobs (verl's `critic.cliprange_value`, `critic.loss_agg_mode`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueLoss {
    /// c, >= 0: V moves at most c away from V_old before the clipped term takes over.
    pub cliprange: f64,
    pub agg: AggMode,
}

/// One micro-batch of the critic's loss: ragged rows (one per sequence) of per-token values.
pub(crate) struct ValueInputs<'a> {
    pub(crate) offsets: &'a [usize],
    pub(crate) mask: &'a [u8],
    /// The current values (what the gradient is taken with respect to).
    pub(crate) v: &'a [f32],
    pub(crate) old: &'a [f32],
    pub(crate) returns: &'a [f32],
}

/// The micro-batch's share of the mini-batch loss (normalised by the mini-batch's totals
/// `norm`, so the micro-batches add up to it), dL/dV per token, and the metrics' shares.
pub(crate) fn value_loss(
    cfg: &ValueLoss,
    x: &ValueInputs,
    norm: &LossNorm,
) -> Result<LossOutput<f32>> {
    let n = x.v.len();
    ensure!(
        x.mask.len() == n && x.old.len() == n && x.returns.len() == n,
        "value loss: {n} values, {} mask, {} old values, {} returns",
        x.mask.len(),
        x.old.len(),
        x.returns.len()
    );
    let c = cfg.cliprange;
    let mut grad = vec![0.0f32; n];
    let mut m = LossMetrics::default();
    let mut loss = 0.0;
    for w in x.offsets.windows(2) {
        let row = w[0]..w[1];
        let valid = x.mask[row.clone()].iter().filter(|&&k| k != 0).count();
        let (wa, wt) = (
            norm.row_weight(cfg.agg, valid)?,
            norm.row_weight(AggMode::TokenMean, valid)?,
        );
        for t in row.filter(|&t| x.mask[t] != 0) {
            let (v, old, r) = (x.v[t] as f64, x.old[t] as f64, x.returns[t] as f64);
            let clipped = v.clamp(old - c, old + c);
            let (l1, l2) = ((v - r).powi(2), (clipped - r).powi(2));
            loss += 0.5 * wa * l1.max(l2);
            // d/dV of 0.5·max(l1, l2): the unclipped term's (V − R) where it is the larger or
            // V is inside the range (both terms are V's there); none where the clipped
            // constant is larger; half of it on a tie (torch's max splits the gradient).
            let share = match (v - clipped == 0.0, l1.total_cmp(&l2)) {
                (true, _) | (false, std::cmp::Ordering::Greater) => 1.0,
                (false, std::cmp::Ordering::Less) => 0.0,
                (false, std::cmp::Ordering::Equal) => 0.5,
            };
            grad[t] = (wa * share * (v - r)) as f32;
            m.vf_clipfrac += wt * (l2 > l1) as u8 as f64;
            m.vpred_mean += wt * v;
        }
    }
    m.vf_loss = loss;
    Ok(LossOutput {
        loss,
        grad_lp: grad,
        grad_entropy: None,
        metrics: m,
    })
}

/// verl's `critic/vf_explained_var` over the valid tokens of a batch: 1 − Var(R − V) /
/// (Var(R) + 1e-5), unbiased variances (torch.var). None with fewer than two valid tokens.
pub(crate) fn explained_variance(
    returns: &[&[f32]],
    values: &[&[f32]],
    mask: &[&[u8]],
) -> Option<f64> {
    let mut r = Vec::new();
    let mut d = Vec::new();
    for ((ret, val), m) in returns.iter().zip(values).zip(mask) {
        for ((&a, &b), &k) in ret.iter().zip(val.iter()).zip(m.iter()) {
            if k != 0 {
                r.push(a as f64);
                d.push(a as f64 - b as f64);
            }
        }
    }
    let var = |x: &[f64]| {
        let mean = x.iter().sum::<f64>() / x.len() as f64;
        x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (x.len() - 1) as f64
    };
    (r.len() >= 2).then(|| 1.0 - var(&d) / (var(&r) + 1e-5))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        cfg: ValueLoss,
        v: &[f32],
        old: &[f32],
        ret: &[f32],
        mask: &[u8],
        offs: &[usize],
    ) -> LossOutput<f32> {
        let norm = LossNorm::of_mask(offs, mask, None);
        let x = ValueInputs {
            offsets: offs,
            mask,
            v,
            old,
            returns: ret,
        };
        value_loss(&cfg, &x, &norm).unwrap()
    }

    #[test]
    fn clipped_value_loss_by_hand() {
        // Token-mean over 3 valid tokens (the 4th is masked), c = 0.2:
        // t0: V 1.0, old 0.5 -> clip 0.7, R 0.0: l1 1.00, l2 0.49 -> 1.00 (unclipped, grad V−R)
        // t1: V 0.0, old 0.5 -> clip 0.3, R 1.0: l1 1.00, l2 0.49 -> 1.00 (unclipped)
        // t2: V 0.9, old 1.0 -> inside,   R 0.0: l1 = l2 = 0.81 (grad V−R)
        // t3: masked.
        let cfg = ValueLoss {
            cliprange: 0.2,
            agg: AggMode::TokenMean,
        };
        let out = run(
            cfg,
            &[1.0, 0.0, 0.9, 5.0],
            &[0.5, 0.5, 1.0, 0.0],
            &[0.0, 1.0, 0.0, 0.0],
            &[1, 1, 1, 0],
            &[0, 2, 4],
        );
        let want = 0.5 * (1.0 + 1.0 + 0.81) / 3.0;
        assert!((out.loss - want).abs() < 1e-6, "{}", out.loss);
        let g = [1.0 / 3.0, -1.0 / 3.0, 0.9 / 3.0, 0.0];
        for (a, b) in out.grad_lp.iter().zip(g) {
            assert!((*a as f64 - b).abs() < 1e-6, "{:?}", out.grad_lp);
        }
        assert_eq!(out.metrics.vf_clipfrac, 0.0);
        assert!((out.metrics.vpred_mean - 1.9 / 3.0).abs() < 1e-6);
        // The clipped term larger: V 0.0, old 0.5 -> clip 0.3, R -1.0: l1 1.0 < l2 1.69:
        // the loss is the clipped one and V gets no gradient.
        let out = run(cfg, &[0.0], &[0.5], &[-1.0], &[1], &[0, 1]);
        assert!((out.loss - 0.5 * 1.69).abs() < 1e-6);
        assert_eq!(out.grad_lp, vec![0.0]);
        assert_eq!(out.metrics.vf_clipfrac, 1.0);
    }

    #[test]
    fn gradient_matches_finite_differences_in_every_mode() {
        // Inside the range (t0, t4), outside with the unclipped term larger (t1, t2), outside
        // with the clipped one larger (t5: no gradient), masked (t3).
        let v = [0.25f32, -0.8, 1.7, 0.1, 0.45, -0.2];
        let old = [0.0f32, -0.1, 1.0, 0.9, 0.5, -0.6];
        let ret = [1.0f32, 0.4, -0.5, 0.2, 0.0, 0.3];
        let (mask, offs) = ([1u8, 1, 1, 0, 1, 1], [0usize, 3, 4, 6]);
        for agg in [
            AggMode::TokenMean,
            AggMode::SeqMeanTokenSum,
            AggMode::SeqMeanTokenMean,
            AggMode::SeqMeanTokenSumNorm,
        ] {
            let cfg = ValueLoss {
                cliprange: 0.3,
                agg,
            };
            let out = run(cfg, &v, &old, &ret, &mask, &offs);
            for t in 0..v.len() {
                let eps = 1e-3f32;
                let at = |d: f32| {
                    let mut x = v;
                    x[t] += d;
                    run(cfg, &x, &old, &ret, &mask, &offs).loss
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
                assert!(
                    (fd - out.grad_lp[t] as f64).abs() < 1e-3,
                    "{agg} token {t}: analytic {} vs finite difference {fd}",
                    out.grad_lp[t]
                );
            }
        }
    }

    #[test]
    fn explained_variance_by_hand() {
        // R = [1, 2, 3], V = [1, 2, 2]: R − V = [0, 0, 1], Var 1/3; Var(R) = 1.
        let ev = explained_variance(
            &[&[1.0, 2.0, 3.0, 9.0]],
            &[&[1.0, 2.0, 2.0, 0.0]],
            &[&[1, 1, 1, 0]],
        );
        assert!((ev.unwrap() - (1.0 - (1.0 / 3.0) / (1.0 + 1e-5))).abs() < 1e-9);
        assert_eq!(explained_variance(&[&[1.0]], &[&[0.0]], &[&[1]]), None);
    }
}
