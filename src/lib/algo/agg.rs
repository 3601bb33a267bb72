//! Loss aggregation (verl's `agg_loss`): how per-token losses of a mini-batch become one scalar.
//!
//! Every mode is a weighted sum Σ_i Σ_t mask·w_i·ℓ_it whose per-row weight w_i depends only on
//! the row's own valid-token count and on mini-batch totals ([`LossNorm`]). Passing the totals of
//! the whole mini-batch makes the sum over micro-batches equal the mini-batch loss, however the
//! rows are split.

use crate::bail_input;
use anyhow::Result;
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AggMode {
    /// Σ mask·ℓ / (valid tokens of the mini-batch)
    TokenMean,
    /// Σ_i (Σ_t mask·ℓ) / (sequences with a valid token)
    SeqMeanTokenSum,
    /// Σ_i (Σ_t mask·ℓ / n_i) / (sequences with a valid token)
    SeqMeanTokenMean,
    /// Σ_i Σ_t mask·ℓ / norm (Dr.GRPO: a constant, by default the longest response)
    SeqMeanTokenSumNorm,
}

pub(crate) const AGG_MODE_NAMES: &str =
    "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm";

impl FromStr for AggMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "token-mean" => AggMode::TokenMean,
            "seq-mean-token-sum" => AggMode::SeqMeanTokenSum,
            "seq-mean-token-mean" => AggMode::SeqMeanTokenMean,
            "seq-mean-token-sum-norm" => AggMode::SeqMeanTokenSumNorm,
            _ => {
                return Err(format!(
                    "unknown loss aggregation '{s}' (expected one of {AGG_MODE_NAMES})"
                ))
            }
        })
    }
}

impl fmt::Display for AggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AggMode::TokenMean => "token-mean",
            AggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            AggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            AggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        })
    }
}

/// The denominators of a mini-batch, computed once over all its rows and passed to every
/// micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LossNorm {
    /// Valid (mask = 1) tokens in the mini-batch.
    pub(crate) tokens: f64,
    /// Sequences with at least one valid token (fully masked ones are left out, as in verl).
    pub(crate) seqs: f64,
    /// The seq-mean-token-sum-norm divisor.
    pub(crate) norm: f64,
}

impl LossNorm {
    /// Totals over the rows of a whole mini-batch. `loss_scale_factor` is the
    /// seq-mean-token-sum-norm divisor (verl's `loss_scale_factor`; Dr.GRPO uses the generation
    /// budget); without it the longest response of the mini-batch stands in for verl's padded
    /// width.
    pub(crate) fn of_rows<'a>(
        rows: impl IntoIterator<Item = &'a [u8]>,
        loss_scale_factor: Option<f64>,
    ) -> LossNorm {
        let (mut tokens, mut seqs, mut longest) = (0usize, 0usize, 0usize);
        for mask in rows {
            let n = mask.iter().filter(|&&m| m != 0).count();
            tokens += n;
            seqs += (n > 0) as usize;
            longest = longest.max(mask.len());
        }
        LossNorm {
            tokens: tokens as f64,
            seqs: seqs as f64,
            norm: loss_scale_factor.unwrap_or(longest as f64),
        }
    }

    /// Totals of a ragged mask (offsets + values).
    #[cfg(test)]
    pub(crate) fn of_mask(
        offsets: &[usize],
        mask: &[u8],
        loss_scale_factor: Option<f64>,
    ) -> LossNorm {
        Self::of_rows(
            offsets.windows(2).map(|w| &mask[w[0]..w[1]]),
            loss_scale_factor,
        )
    }

    /// The weight of each valid token of a row with `n_valid` valid tokens.
    pub(crate) fn row_weight(&self, mode: AggMode, n_valid: usize) -> Result<f64> {
        if n_valid == 0 {
            return Ok(0.0);
        }
        let denom = match mode {
            AggMode::TokenMean => self.tokens,
            AggMode::SeqMeanTokenSum => self.seqs,
            AggMode::SeqMeanTokenMean => self.seqs * n_valid as f64,
            AggMode::SeqMeanTokenSumNorm => self.norm,
        };
        if !(denom.is_finite() && denom > 0.0) {
            bail_input!(
                "loss aggregation {mode}: denominator {denom} for a row with {n_valid} valid tokens \
                 (the mini-batch totals must count every row of every micro-batch)"
            );
        }
        Ok(1.0 / denom)
    }
}

/// Aggregate per-token values (e.g. entropies) under a mask: Σ_i Σ_t mask·w_i·x_it.
#[cfg(test)]
pub(crate) fn agg(
    mode: AggMode,
    offsets: &[usize],
    mask: &[u8],
    values: &[f64],
    norm: &LossNorm,
) -> Result<f64> {
    let mut total = 0.0;
    for w in offsets.windows(2) {
        let (m, x) = (&mask[w[0]..w[1]], &values[w[0]..w[1]]);
        let n = m.iter().filter(|&&v| v != 0).count();
        let weight = norm.row_weight(mode, n)?;
        let s: f64 = m
            .iter()
            .zip(x)
            .filter(|(&m, _)| m != 0)
            .map(|(_, &v)| v)
            .sum();
        total += weight * s;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Two rows: [1, 2, 3] with mask [1, 1, 0], and [4] with mask [1]; one fully masked row [5].
    const OFFSETS: [usize; 4] = [0, 3, 4, 5];
    const MASK: [u8; 5] = [1, 1, 0, 1, 0];
    const X: [f64; 5] = [1.0, 2.0, 3.0, 4.0, 5.0];

    fn run(mode: &str, lsf: Option<f64>) -> f64 {
        let norm = LossNorm::of_mask(&OFFSETS, &MASK, lsf);
        agg(mode.parse().unwrap(), &OFFSETS, &MASK, &X, &norm).unwrap()
    }

    #[test]
    fn hand_values() {
        let norm = LossNorm::of_mask(&OFFSETS, &MASK, None);
        assert_eq!(
            norm,
            LossNorm {
                tokens: 3.0,
                seqs: 2.0,
                norm: 3.0
            }
        );
        // (1 + 2 + 4) / 3 valid tokens
        assert!((run("token-mean", None) - 7.0 / 3.0).abs() < 1e-15);
        // ((1 + 2) + 4) / 2 sequences
        assert_eq!(run("seq-mean-token-sum", None), 3.5);
        // ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2
        assert_eq!(run("seq-mean-token-mean", None), 2.75);
        // (3 + 4) / longest row (3)
        assert!((run("seq-mean-token-sum-norm", None) - 7.0 / 3.0).abs() < 1e-15);
        // (3 + 4) / 10
        assert!((run("seq-mean-token-sum-norm", Some(10.0)) - 0.7).abs() < 1e-15);
    }

    #[test]
    fn split_rows_sum_to_the_whole() {
        let norm = LossNorm::of_mask(&OFFSETS, &MASK, None);
        for mode in [
            "token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
        ] {
            let m: AggMode = mode.parse().unwrap();
            let whole = agg(m, &OFFSETS, &MASK, &X, &norm).unwrap();
            let a = agg(m, &[0, 3], &MASK[..3], &X[..3], &norm).unwrap();
            let b = agg(m, &[0, 1, 2], &MASK[3..], &X[3..], &norm).unwrap();
            assert!((whole - (a + b)).abs() < 1e-15, "{mode}");
        }
    }

    #[test]
    fn names_and_bad_denominators() {
        for m in AGG_MODE_NAMES.split(", ") {
            assert_eq!(m.parse::<AggMode>().unwrap().to_string(), m);
        }
        assert!("mean".parse::<AggMode>().unwrap_err().contains("unknown"));
        let empty = LossNorm::of_mask(&[0, 1], &[0], None);
        assert_eq!(empty.row_weight(AggMode::TokenMean, 0).unwrap(), 0.0);
        let err = empty.row_weight(AggMode::TokenMean, 2).unwrap_err();
        assert!(err.to_string().contains("denominator 0"), "{err}");
    }
}
