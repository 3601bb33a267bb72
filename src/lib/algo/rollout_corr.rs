//! Rollout correction (verl's `rollout_corr_helper`), on host arrays: how far the rollout
//! engine's log-probs are from the trainer's for the same tokens ([`Mismatch`], measured every
//! step), and masked importance sampling ([`RolloutRs`], verl's `rollout_rs`): tokens or
//! sequences whose importance weight falls outside the bounds are dropped from the loss. The
//! truncated weights (TIS, verl's `rollout_is`) are part of the policy loss
//! (`policy_loss::RolloutIs`).
//!
//! Notation: Δ_t = log π_train(t) − log π_rollout(t) on a valid token (response_mask 1);
//! π_train is the trainer's policy at the same weights (the old-logprob pass, or `update`'s
//! first forward before any optimizer step).

use crate::bail_input;
use anyhow::{ensure, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Bounds of the importance ratio exp(Δ) within which a token counts as matching (verl's and
/// the engine docs' 1% band).
pub(crate) const RATIO_BAND: (f64, f64) = (0.99, 1.01);

/// Safety bound of a log importance ratio before exponentiating (verl's ±20).
const LOG_RATIO_BOUND: f64 = 20.0;

/// Sums of the mismatch between trainer and rollout log-probs; rows are added one at a time
/// (micro-batch by micro-batch) and [`Mismatch::to_json`] gives the means.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mismatch {
    tokens: usize,
    seqs: usize,
    sum_abs: f64,
    max_abs: f64,
    outside: usize,
    sum_k1: f64,
    sum_k3: f64,
    sum_ratio_sq: f64,
    seq_sum_abs: f64,
    seq_max_abs: f64,
    seq_sum_k3: f64,
}

impl Mismatch {
    /// Adds one sequence: the trainer's and the rollout's log-probs of its response tokens and
    /// its response_mask (tokens with mask 0 are not counted; a row without valid tokens adds
    /// nothing).
    pub(crate) fn add_row(&mut self, trainer: &[f32], rollout: &[f32], mask: &[u8]) -> Result<()> {
        ensure!(
            trainer.len() == mask.len() && rollout.len() == mask.len(),
            "mismatch: {} trainer and {} rollout log-probs for {} tokens",
            trainer.len(),
            rollout.len(),
            mask.len()
        );
        let mut seq = 0.0;
        let mut n = 0;
        for t in (0..mask.len()).filter(|&t| mask[t] != 0) {
            let d = trainer[t] as f64 - rollout[t] as f64;
            let r = d.exp();
            self.sum_abs += d.abs();
            self.max_abs = self.max_abs.max(d.abs());
            self.outside += usize::from(!(RATIO_BAND.0..=RATIO_BAND.1).contains(&r));
            // k1 of KL(π_rollout ‖ π_train) on rollout samples: −Δ; k3: e^Δ − Δ − 1
            self.sum_k1 -= d;
            self.sum_k3 += r - d - 1.0;
            self.sum_ratio_sq += r * r;
            seq += d;
            n += 1;
        }
        if n > 0 {
            self.tokens += n;
            self.seqs += 1;
            // The sequence's log ratio S = Σ_t Δ_t; k3 of the sequence ratio e^S.
            self.seq_sum_abs += seq.abs();
            self.seq_max_abs = self.seq_max_abs.max(seq.abs());
            let s = seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND);
            self.seq_sum_k3 += s.exp() - s - 1.0;
        }
        Ok(())
    }

    /// The mismatch of whole columns (one row per sequence).
    pub(crate) fn of_rows(
        trainer: &[&[f32]],
        rollout: &[&[f32]],
        mask: &[&[u8]],
    ) -> Result<Mismatch> {
        ensure!(
            trainer.len() == mask.len() && rollout.len() == mask.len(),
            "mismatch: {} trainer rows, {} rollout rows, {} mask rows",
            trainer.len(),
            rollout.len(),
            mask.len()
        );
        let mut m = Mismatch::default();
        for i in 0..mask.len() {
            m.add_row(trainer[i], rollout[i], mask[i])?;
        }
        Ok(m)
    }

    /// Valid tokens measured.
    #[cfg(test)]
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// The metrics (means over valid tokens, `seq_*` over sequences with a valid token):
    /// `abs_diff_mean|max` of |Δ|, `ratio_outside_frac` (e^Δ outside [0.99, 1.01]), `kl_k1`
    /// = mean(−Δ) and `kl_k3` = mean(e^Δ − Δ − 1) (estimates of KL(π_rollout ‖ π_train)),
    /// `chi2_token` = mean(e^{2Δ}) − 1, and per sequence of S = Σ_t Δ_t:
    /// `seq_log_ratio_abs_mean|max` of |S| and `seq_kl_k3` = mean(e^S − S − 1) (S within ±20).
    pub(crate) fn to_json(&self) -> Value {
        let t = self.tokens.max(1) as f64;
        let s = self.seqs.max(1) as f64;
        json!({
            "tokens": self.tokens,
            "sequences": self.seqs,
            "abs_diff_mean": self.sum_abs / t,
            "abs_diff_max": self.max_abs,
            "ratio_outside_frac": self.outside as f64 / t,
            "kl_k1": self.sum_k1 / t,
            "kl_k3": self.sum_k3 / t,
            "chi2_token": if self.tokens > 0 { self.sum_ratio_sq / t - 1.0 } else { 0.0 },
            "seq_log_ratio_abs_mean": self.seq_sum_abs / s,
            "seq_log_ratio_abs_max": self.seq_max_abs,
            "seq_kl_k3": self.seq_sum_k3 / s,
        })
    }
}

/// What one importance weight of masked importance sampling covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RsLevel {
    /// Each token's own ratio exp(old − rollout).
    Token,
    /// The sequence's ratio exp(Σ_t (old − rollout)).
    Sequence,
    /// The geometric mean exp(mean_t (old − rollout)) of the sequence's ratios.
    Geometric,
}

/// Masked importance sampling (MIS, verl's `rollout_rs`): a token (or every token of a
/// sequence) whose weight r is outside [lower, upper] gets response_mask 0, so it leaves the
/// loss, its denominators included (verl modifies the response mask the same way).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RolloutRs {
    pub(crate) level: RsLevel,
    pub(crate) lower: f64,
    pub(crate) upper: f64,
}

/// How many tokens and sequences [`RolloutRs::apply`] dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RsStats {
    pub(crate) tokens: usize,
    pub(crate) masked_tokens: usize,
    pub(crate) seqs: usize,
    /// Sequences with at least one valid token dropped.
    pub(crate) masked_seqs: usize,
}

impl RsStats {
    pub(crate) fn to_json(self) -> Value {
        json!({
            "masked_token_frac": self.masked_tokens as f64 / self.tokens.max(1) as f64,
            "masked_seq_frac": self.masked_seqs as f64 / self.seqs.max(1) as f64,
            "masked_tokens": self.masked_tokens,
            "masked_sequences": self.masked_seqs,
        })
    }
}

impl RolloutRs {
    /// `upper` and `lower` (default 1/upper, as verl) as the flags give them.
    pub(crate) fn new(level: RsLevel, upper: f64, lower: Option<f64>) -> Result<RolloutRs> {
        if !(upper.is_finite() && upper > 0.0) {
            bail_input!("--rollout-rs-threshold must be a finite number > 0, got {upper}");
        }
        let lower = lower.unwrap_or(1.0 / upper);
        if !(lower.is_finite() && lower >= 0.0 && lower <= upper) {
            bail_input!(
                "--rollout-rs-threshold-lower must be a finite number in [0, --rollout-rs-threshold = {upper}], got {lower}"
            );
        }
        Ok(RolloutRs {
            level,
            lower,
            upper,
        })
    }

    /// The response mask with the out-of-bounds tokens (token level) or sequences (sequence
    /// and geometric levels) set to 0, given the old and the rollout log-probs:
    /// token r_t = exp(clamp(old_t − roll_t, ±20)); sequence r = exp(clamp(Σ_t, ±20));
    /// geometric r = exp(clamp(mean_t, ±20)); kept when lower ≤ r ≤ upper.
    pub(crate) fn apply(
        &self,
        old: &[&[f32]],
        rollout: &[&[f32]],
        mask: &[&[u8]],
    ) -> Result<(Vec<Vec<u8>>, RsStats)> {
        ensure!(
            old.len() == mask.len() && rollout.len() == mask.len(),
            "rejection: {} old rows, {} rollout rows, {} mask rows",
            old.len(),
            rollout.len(),
            mask.len()
        );
        let keep = |log_r: f64| {
            let r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp();
            (self.lower..=self.upper).contains(&r)
        };
        let mut stats = RsStats::default();
        let mut out = Vec::with_capacity(mask.len());
        for i in 0..mask.len() {
            let (o, r, m) = (old[i], rollout[i], mask[i]);
            ensure!(
                o.len() == m.len() && r.len() == m.len(),
                "rejection, row {i}: {} old and {} rollout log-probs for {} tokens",
                o.len(),
                r.len(),
                m.len()
            );
            let valid: Vec<usize> = (0..m.len()).filter(|&t| m[t] != 0).collect();
            let d = |t: usize| o[t] as f64 - r[t] as f64;
            let mut row = m.to_vec();
            match self.level {
                RsLevel::Token => {
                    for &t in &valid {
                        if !keep(d(t)) {
                            row[t] = 0;
                        }
                    }
                }
                RsLevel::Sequence | RsLevel::Geometric => {
                    let sum: f64 = valid.iter().map(|&t| d(t)).sum();
                    let log_r = match self.level {
                        RsLevel::Sequence => sum,
                        _ => sum / valid.len().max(1) as f64,
                    };
                    if !valid.is_empty() && !keep(log_r) {
                        valid.iter().for_each(|&t| row[t] = 0);
                    }
                }
            }
            let dropped = valid.iter().filter(|&&t| row[t] == 0).count();
            stats.tokens += valid.len();
            stats.masked_tokens += dropped;
            stats.seqs += usize::from(!valid.is_empty());
            stats.masked_seqs += usize::from(dropped > 0);
            out.push(row);
        }
        Ok((out, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, what: &str) {
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{what}: got {got}, want {want}"
        );
    }

    #[test]
    fn mismatch_hand_values() {
        // Row 0: Δ = [ln 1.005, ln 0.5, (masked)], row 1: Δ = [0.2], row 2: nothing valid.
        let d0 = [1.005f64.ln(), 0.5f64.ln()];
        let trainer: Vec<Vec<f32>> = vec![
            vec![-1.0 + d0[0] as f32, -2.0 + d0[1] as f32, -9.0],
            vec![-0.3],
            vec![-1.0],
        ];
        let rollout: Vec<Vec<f32>> = vec![vec![-1.0, -2.0, -1.0], vec![-0.5], vec![-4.0]];
        let mask: Vec<Vec<u8>> = vec![vec![1, 1, 0], vec![1], vec![0]];
        fn rows(v: &[Vec<f32>]) -> Vec<&[f32]> {
            v.iter().map(Vec::as_slice).collect()
        }
        let m = Mismatch::of_rows(
            &rows(&trainer),
            &rows(&rollout),
            &mask.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        )
        .unwrap();
        // The deltas as the f32 columns hold them.
        let d: Vec<f64> = [(0, 0), (0, 1), (1, 0)]
            .iter()
            .map(|&(i, t)| trainer[i][t] as f64 - rollout[i][t] as f64)
            .collect();
        close(d[0], 1.005f64.ln(), "delta 0");
        close(d[2], 0.2, "delta 2");
        let j = m.to_json();
        assert_eq!(j["tokens"], 3);
        assert_eq!(j["sequences"], 2);
        close(
            j["abs_diff_mean"].as_f64().unwrap(),
            (d[0].abs() + d[1].abs() + d[2].abs()) / 3.0,
            "abs mean",
        );
        close(j["abs_diff_max"].as_f64().unwrap(), 2f64.ln(), "abs max");
        // 1.005 is inside the band, 0.5 and e^0.2 are not.
        close(
            j["ratio_outside_frac"].as_f64().unwrap(),
            2.0 / 3.0,
            "outside",
        );
        close(
            j["kl_k1"].as_f64().unwrap(),
            -(d[0] + d[1] + d[2]) / 3.0,
            "k1",
        );
        let k3 = |x: f64| x.exp() - x - 1.0;
        close(
            j["kl_k3"].as_f64().unwrap(),
            (k3(d[0]) + k3(d[1]) + k3(d[2])) / 3.0,
            "k3",
        );
        // e^0.2 − 0.2 − 1 = 0.0214028
        close(k3(0.2), 0.021_402_758, "k3 of 0.2");
        close(
            j["chi2_token"].as_f64().unwrap(),
            (1.005f64.powi(2) + 0.25 + (0.4f64).exp()) / 3.0 - 1.0,
            "chi2",
        );
        let s0 = d[0] + d[1];
        close(
            j["seq_log_ratio_abs_mean"].as_f64().unwrap(),
            (s0.abs() + d[2].abs()) / 2.0,
            "seq abs mean",
        );
        close(
            j["seq_log_ratio_abs_max"].as_f64().unwrap(),
            s0.abs(),
            "seq max",
        );
        close(
            j["seq_kl_k3"].as_f64().unwrap(),
            (k3(s0) + k3(d[2])) / 2.0,
            "seq k3",
        );
        // Equal log-probs: no mismatch at all.
        let same = Mismatch::of_rows(&rows(&rollout), &rows(&rollout), &[&[1, 1, 1], &[1], &[1]])
            .unwrap()
            .to_json();
        for k in ["abs_diff_max", "ratio_outside_frac", "kl_k3", "chi2_token"] {
            assert_eq!(same[k].as_f64(), Some(0.0), "{k}: {same}");
        }
        assert!(Mismatch::default()
            .add_row(&[0.0], &[0.0, 1.0], &[1])
            .is_err());
    }

    #[test]
    fn masked_importance_sampling_hand_values() {
        // old − rollout per token: row 0 [ln 3, ln 0.9, (masked ln 10)], row 1 [ln 1.5, ln 1.5],
        // row 2 [ln 0.3].
        let lr = |x: f64| x.ln() as f32;
        let old: Vec<Vec<f32>> = vec![
            vec![lr(3.0), lr(0.9), lr(10.0)],
            vec![lr(1.5), lr(1.5)],
            vec![lr(0.3)],
        ];
        let roll: Vec<Vec<f32>> = vec![vec![0.0; 3], vec![0.0; 2], vec![0.0]];
        let mask: Vec<Vec<u8>> = vec![vec![1, 1, 0], vec![1, 1], vec![1]];
        let o: Vec<&[f32]> = old.iter().map(Vec::as_slice).collect();
        let r: Vec<&[f32]> = roll.iter().map(Vec::as_slice).collect();
        let m: Vec<&[u8]> = mask.iter().map(Vec::as_slice).collect();
        // Token level, bounds [0.5, 2]: 3 and 0.3 go; the masked token stays masked.
        let rs = RolloutRs::new(RsLevel::Token, 2.0, None).unwrap();
        assert_eq!((rs.lower, rs.upper), (0.5, 2.0));
        let (out, st) = rs.apply(&o, &r, &m).unwrap();
        assert_eq!(out, vec![vec![0, 1, 0], vec![1, 1], vec![0]]);
        assert_eq!(
            st,
            RsStats {
                tokens: 5,
                masked_tokens: 2,
                seqs: 3,
                masked_seqs: 2
            }
        );
        let j = st.to_json();
        close(j["masked_token_frac"].as_f64().unwrap(), 0.4, "token frac");
        close(
            j["masked_seq_frac"].as_f64().unwrap(),
            2.0 / 3.0,
            "seq frac",
        );
        // Sequence level: row 0 ratio 3·0.9 = 2.7 (out), row 1 2.25 (out), row 2 0.3 (out)
        // with upper 2; with upper 3 and lower 0.25 all stay.
        let (out, st) = RolloutRs::new(RsLevel::Sequence, 2.0, None)
            .unwrap()
            .apply(&o, &r, &m)
            .unwrap();
        assert_eq!(out, vec![vec![0, 0, 0], vec![0, 0], vec![0]]);
        assert_eq!((st.masked_tokens, st.masked_seqs), (5, 3));
        let (out, _) = RolloutRs::new(RsLevel::Sequence, 3.0, Some(0.25))
            .unwrap()
            .apply(&o, &r, &m)
            .unwrap();
        assert_eq!(out, mask);
        // Geometric: row 0 √2.7 = 1.64, row 1 1.5, row 2 0.3; bounds [1/1.6, 1.6]: rows 0
        // and 2 go.
        let (out, st) = RolloutRs::new(RsLevel::Geometric, 1.6, None)
            .unwrap()
            .apply(&o, &r, &m)
            .unwrap();
        assert_eq!(out, vec![vec![0, 0, 0], vec![1, 1], vec![0]]);
        assert_eq!((st.masked_tokens, st.masked_seqs), (3, 2));
        // Bad bounds are input errors naming the flag.
        for (u, l, flag) in [
            (0.0, None, "--rollout-rs-threshold must"),
            (f64::NAN, None, "--rollout-rs-threshold must"),
            (2.0, Some(3.0), "--rollout-rs-threshold-lower must"),
        ] {
            let e = RolloutRs::new(RsLevel::Token, u, l).unwrap_err();
            assert!(crate::error::is_input_error(&e));
            assert!(e.to_string().contains(flag), "{e}");
        }
    }
}
