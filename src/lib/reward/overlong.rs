//! DAPO's soft overlong punishment (Yu et al. 2025, section 3.4): a response that runs into
//! the last `buffer` tokens before the length limit `L_max` loses reward linearly, one past
//! the limit loses the whole factor:
//!
//! ```text
//! r_len(|y|) = 0                              |y| <= L_max - L_cache
//!            = (L_max - L_cache - |y|) / L_cache   L_max - L_cache < |y| <= L_max
//!            = -1                             |y| > L_max
//! score += factor * r_len
//! ```
//!
//! The penalty is written as the sub-score `score_overlong`, and the correctness before it as
//! `score_acc` (1 when the unshaped score is >= 1) unless the reward returns its own `acc`, so
//! that accuracy (train and eval) still counts right answers, as verl's DAPO reward manager
//! keeps `acc` apart from the shaped reward.

use super::summary::ACC_KEY;
use super::Scores;
use crate::bail_input;
use anyhow::Result;

/// The sub-score key of the penalty (`score_overlong`).
pub(crate) const KEY: &str = "overlong";

/// The shaping's parameters, with the limit resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Overlong {
    /// L_max: the response length limit in tokens.
    pub(crate) max_len: usize,
    /// L_cache: the tokens before the limit over which the penalty grows (>= 1, <= max_len).
    pub(crate) buffer: usize,
    /// The penalty at the limit (>= 0).
    pub(crate) factor: f32,
}

impl Overlong {
    /// Checks the parameters (`what` names where L_max came from, for messages).
    pub fn new(max_len: usize, buffer: usize, factor: f32, what: &str) -> Result<Overlong> {
        if buffer == 0 {
            bail_input!("--overlong-buffer-len must be >= 1 to shape (0 turns the penalty off)");
        }
        if buffer > max_len {
            bail_input!(
                "--overlong-buffer-len {buffer} is longer than the response length limit {max_len} ({what})"
            );
        }
        check_factor(factor)?;
        Ok(Overlong {
            max_len,
            buffer,
            factor,
        })
    }

    /// factor * r_len for a response of `len` tokens (0 or negative).
    pub(crate) fn penalty(&self, len: usize) -> f32 {
        let expected = self.max_len - self.buffer;
        let r_len = if len <= expected {
            0.0
        } else if len <= self.max_len {
            (expected as f64 - len as f64) / self.buffer as f64
        } else {
            -1.0
        };
        (self.factor as f64 * r_len) as f32
    }

    /// Adds the penalty of each row (response lengths `lens`) to `scores`, records it as the
    /// `overlong` sub-score and keeps the unshaped correctness as `acc`.
    pub(crate) fn apply(&self, scores: &mut Scores, lens: &[usize]) -> Result<()> {
        assert_eq!(scores.score.len(), lens.len(), "one length per row");
        if scores.sub(KEY).is_some() {
            bail_input!(
                "the reward returned a sub-score \"{KEY}\", which --overlong-buffer-len writes (score_{KEY}); rename the reward's key"
            );
        }
        if scores.sub(ACC_KEY).is_none() {
            let acc = scores
                .score
                .iter()
                .map(|&s| f32::from(u8::from(s >= 1.0)))
                .collect();
            scores.subs.push((ACC_KEY.to_string(), acc));
        }
        let pen: Vec<f32> = lens.iter().map(|&l| self.penalty(l)).collect();
        for (s, p) in scores.score.iter_mut().zip(&pen) {
            *s += p;
        }
        scores.subs.push((KEY.to_string(), pen));
        Ok(())
    }
}

/// `--overlong-penalty-factor` must be a finite number >= 0.
pub(crate) fn check_factor(factor: f32) -> Result<()> {
    if !factor.is_finite() || factor < 0.0 {
        bail_input!("--overlong-penalty-factor must be a finite number >= 0, got {factor}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalty_values_by_hand() {
        // L_max 10, L_cache 4: free up to 6 tokens, then -1/4 per token, -1 past 10; factor 0.5.
        let o = Overlong::new(10, 4, 0.5, "test").unwrap();
        let got: Vec<f32> = (0..=12).map(|l| o.penalty(l)).collect();
        let want = [
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5, -0.5,
        ];
        assert_eq!(got, want);
        // A buffer as long as the limit punishes from the first token.
        let o = Overlong::new(4, 4, 1.0, "test").unwrap();
        assert_eq!(o.penalty(0), 0.0);
        assert_eq!(o.penalty(1), -0.25);
        assert_eq!(o.penalty(4), -1.0);
        // verl's DAPO GSM8K-sized setting: 512 new tokens, buffer 128, factor 1.
        let o = Overlong::new(512, 128, 1.0, "test").unwrap();
        assert_eq!(o.penalty(384), 0.0);
        assert_eq!(o.penalty(448), -0.5);
        assert_eq!(o.penalty(512), -1.0);
    }

    #[test]
    fn apply_adds_the_penalty_and_keeps_accuracy() {
        let o = Overlong::new(10, 4, 1.0, "test").unwrap();
        let mut s = Scores {
            score: vec![1.0, 1.0, 0.5, 0.0],
            subs: Vec::new(),
            texts: Vec::new(),
        };
        o.apply(&mut s, &[3, 8, 10, 12]).unwrap();
        assert_eq!(s.score, [1.0, 0.5, -0.5, -1.0]);
        assert_eq!(s.sub("overlong").unwrap(), [0.0, -0.5, -1.0, -1.0]);
        assert_eq!(s.sub("acc").unwrap(), [1.0, 1.0, 0.0, 0.0]);
        // A reward's own acc is kept as it is.
        let mut s = Scores {
            score: vec![0.25],
            subs: vec![("acc".into(), vec![1.0])],
            texts: Vec::new(),
        };
        o.apply(&mut s, &[9]).unwrap();
        assert_eq!(s.sub("acc").unwrap(), [1.0]);
        assert_eq!(s.score, [-0.5]);
        // A reward's own "overlong" would be overwritten: refused.
        let mut s = Scores {
            score: vec![0.0],
            subs: vec![("overlong".into(), vec![1.0])],
            texts: Vec::new(),
        };
        let err = o.apply(&mut s, &[1]).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("sub-score \"overlong\""), "{err}");
    }

    #[test]
    fn bad_parameters_are_input_errors() {
        for (max, buf, f, want) in [
            (10, 0, 1.0, "must be >= 1"),
            (
                10,
                11,
                1.0,
                "longer than the response length limit 10 (test)",
            ),
            (10, 4, -1.0, "finite number >= 0, got -1"),
            (10, 4, f32::NAN, "finite number >= 0, got NaN"),
        ] {
            let err = Overlong::new(max, buf, f, "test").unwrap_err();
            assert!(crate::error::is_input_error(&err));
            assert!(err.to_string().contains(want), "{err}");
        }
    }
}
