//! KL penalties between the policy and the reference model (verl's `kl_penalty`), and the
//! fixed / adaptive controllers of the penalty coefficient β, whose state persists between steps
//! in a small JSON file.
//!
//! The estimators follow J. Schulman, "Approximating KL divergence" (2020), with d = lp − ref:
//! k1 = d, abs = |d|, k2 = ½d², k3 = exp(−d) + d − 1 (clamped as verl does).

use crate::bail_input;
use crate::error::input_error;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// Which KL estimator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KlKind {
    K1,
    Abs,
    K2,
    K3,
}

/// A KL penalty as verl names it: `k1`/`kl`, `abs`, `k2`/`mse`, `k3`/`low_var_kl`, each with an
/// optional `+` suffix (straight-through: the value of the estimator, the gradient of k2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KlPenalty {
    pub(crate) kind: KlKind,
    pub(crate) straight_through: bool,
}

/// The names accepted on the command line, for help texts and errors.
pub(crate) const KL_PENALTY_NAMES: &str =
    "k1 (kl), abs, k2 (mse), k3 (low_var_kl), optionally with '+'";

impl FromStr for KlPenalty {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (base, straight_through) = match s.strip_suffix('+') {
            Some(b) => (b, true),
            None => (s, false),
        };
        let kind = match base {
            "k1" | "kl" => KlKind::K1,
            "abs" => KlKind::Abs,
            "k2" | "mse" => KlKind::K2,
            "k3" | "low_var_kl" => KlKind::K3,
            _ => {
                return Err(format!(
                    "unknown KL penalty '{s}' (expected {KL_PENALTY_NAMES})"
                ))
            }
        };
        Ok(KlPenalty {
            kind,
            straight_through,
        })
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.kind {
            KlKind::K1 => "k1",
            KlKind::Abs => "abs",
            KlKind::K2 => "k2",
            KlKind::K3 => "k3",
        };
        write!(f, "{name}{}", if self.straight_through { "+" } else { "" })
    }
}

impl KlPenalty {
    /// The penalty of one token with log-prob `lp` under the policy and `ref_lp` under the
    /// reference.
    pub(crate) fn value(self, lp: f64, ref_lp: f64) -> f64 {
        self.value_grad(lp, ref_lp).0
    }

    /// The penalty and its derivative with respect to `lp` (clamps pass the gradient on their
    /// closed interval and stop it outside, as torch.clamp does).
    pub(crate) fn value_grad(self, lp: f64, ref_lp: f64) -> (f64, f64) {
        let d = lp - ref_lp;
        let (v, g) = match self.kind {
            // k1 = lp − ref
            KlKind::K1 => (d, 1.0),
            // |lp − ref|, with torch's sign(0) = 0 as the derivative at 0
            KlKind::Abs => (d.abs(), sign(d)),
            // k2 = ½ (lp − ref)²
            KlKind::K2 => (0.5 * d * d, d),
            // x = clamp(ref − lp, ±20); k3 = clamp(exp(x) − x − 1, ±10)
            KlKind::K3 => {
                let x = -d;
                let (xc, dx) = if (-20.0..=20.0).contains(&x) {
                    (x, -1.0)
                } else {
                    (x.clamp(-20.0, 20.0), 0.0)
                };
                let e = xc.exp();
                let k = e - xc - 1.0;
                if (-10.0..=10.0).contains(&k) {
                    (k, (e - 1.0) * dx)
                } else {
                    (k.clamp(-10.0, 10.0), 0.0)
                }
            }
        };
        if self.straight_through {
            (v, d)
        } else {
            (v, g)
        }
    }
}

fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// How β moves between steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum KlCtrl {
    Fixed,
    /// Ziegler et al. 2019 (arXiv:1909.08593): β ← β·(1 + clip(kl/target − 1, ±0.2)·n/horizon).
    Adaptive {
        target: f64,
        horizon: f64,
    },
}

/// The β controller (verl's FixedKLController / AdaptiveKLController).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KlController {
    pub(crate) beta: f64,
    pub(crate) ctrl: KlCtrl,
}

impl KlController {
    /// Move β after a step whose mean KL was `current_kl`, over `n_steps` samples.
    pub(crate) fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let KlCtrl::Adaptive { target, horizon } = self.ctrl {
            // β ← β·(1 + clip(kl/target − 1, −0.2, 0.2)·n_steps/horizon)
            let err = (current_kl / target - 1.0).clamp(-0.2, 0.2);
            self.beta *= 1.0 + err * n_steps as f64 / horizon;
        }
    }
}

/// What `--kl-state` holds between steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct KlState {
    /// β for the next step.
    pub(crate) beta: f64,
    /// How many updates produced this β.
    pub(crate) updates: u64,
    /// The mean KL of the last step, and the β that step used.
    pub(crate) last_kl: Option<f64>,
    pub(crate) last_beta: Option<f64>,
}

impl KlState {
    /// Read a state file; `Ok(None)` when it does not exist yet (the first step).
    pub(crate) fn load(path: &Path) -> Result<Option<KlState>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => bail_input!("{}: cannot read KL state: {e}", path.display()),
        };
        let state: KlState = serde_json::from_str(&text).map_err(|e| {
            input_error(format!(
                "{}: not a KL state file ({e}); expected JSON like {{\"beta\": 0.001, \"updates\": 0}}. \
                 Delete it to start again from --kl-coef",
                path.display()
            ))
        })?;
        if !state.beta.is_finite() || state.beta < 0.0 {
            bail_input!(
                "{}: beta {} is not a finite number >= 0",
                path.display(),
                state.beta
            );
        }
        Ok(Some(state))
    }

    /// Write the state to `PATH.tmp`, then rename over `path`.
    pub(crate) fn save(&self, path: &Path) -> Result<()> {
        let tmp = crate::batch::write::temp_path(path);
        let text = serde_json::to_string_pretty(self)? + "\n";
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pen(s: &str) -> KlPenalty {
        s.parse().unwrap()
    }

    #[test]
    fn names_and_aliases() {
        assert_eq!(pen("kl"), pen("k1"));
        assert_eq!(pen("mse"), pen("k2"));
        assert_eq!(pen("low_var_kl"), pen("k3"));
        assert!(pen("k3+").straight_through);
        assert_eq!(pen("low_var_kl+").to_string(), "k3+");
        let err = "k4".parse::<KlPenalty>().unwrap_err();
        assert!(err.contains("unknown KL penalty 'k4'"), "{err}");
    }

    #[test]
    fn hand_values() {
        // lp = -1.0, ref = -1.5: d = 0.5
        let (lp, r) = (-1.0, -1.5);
        assert_eq!(pen("k1").value(lp, r), 0.5);
        assert_eq!(pen("abs").value(lp, r), 0.5);
        assert_eq!(pen("abs").value(r, lp), 0.5);
        // k2 = 0.5 * 0.25
        assert_eq!(pen("k2").value(lp, r), 0.125);
        // k3: x = -0.5, exp(-0.5) + 0.5 - 1 = 0.6065306597 - 0.5 = 0.1065306597
        assert!((pen("k3").value(lp, r) - 0.106_530_659_712_633_4).abs() < 1e-15);
        // k3 the other way: x = 0.5, exp(0.5) - 0.5 - 1 = 0.1487212707
        assert!((pen("k3").value(r, lp) - 0.148_721_270_700_128_1).abs() < 1e-15);
        // k3 clamps: d = -30 -> x = 30 clamped to 20, exp(20) - 21 >> 10 -> 10
        assert_eq!(pen("k3").value(-31.0, -1.0), 10.0);
        // d = 30 -> x = -30 clamped to -20: exp(-20) + 20 - 1 = 19.000000002 -> 10
        assert_eq!(pen("k3").value(29.0, -1.0), 10.0);
        // d = 2.5 -> x = -2.5: exp(-2.5) + 1.5 = 1.582084999 (inside the clamp)
        assert!((pen("k3").value(1.5, -1.0) - 1.582_084_998_623_898_8).abs() < 1e-15);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let h = 1e-6;
        for name in ["k1", "abs", "k2", "k3", "k1+", "k3+"] {
            let p = pen(name);
            for (lp, r) in [(-1.0, -1.5), (-2.0, -0.3), (0.1, -3.0), (-4.0, -1.0)] {
                let (_, g) = p.value_grad(lp, r);
                let fd = if p.straight_through {
                    // straight-through: the gradient is k2's
                    (pen("k2").value(lp + h, r) - pen("k2").value(lp - h, r)) / (2.0 * h)
                } else {
                    (p.value(lp + h, r) - p.value(lp - h, r)) / (2.0 * h)
                };
                assert!((g - fd).abs() < 1e-6, "{name} at ({lp}, {r}): {g} vs {fd}");
            }
        }
        // Outside the clamps the gradient stops.
        assert_eq!(pen("k3").value_grad(-31.0, -1.0).1, 0.0);
        assert_eq!(pen("abs").value_grad(-1.0, -1.0).1, 0.0);
    }

    #[test]
    fn adaptive_controller_hand_values() {
        let ctrl = KlCtrl::Adaptive {
            target: 0.1,
            horizon: 10_000.0,
        };
        // kl = 0.15: err = clip(0.5, ±0.2) = 0.2; beta = 0.001 * (1 + 0.2 * 256 / 10000) = 0.00100512
        let mut c = KlController { beta: 0.001, ctrl };
        c.update(0.15, 256);
        assert!((c.beta - 0.001_005_12).abs() < 1e-15, "{}", c.beta);
        // kl = 0.09: err = -0.1; beta = 0.00100512 * (1 - 0.1 * 256 / 10000) = 0.00100512 * 0.99744
        c.update(0.09, 256);
        assert!(
            (c.beta - 0.001_005_12 * 0.997_44).abs() < 1e-15,
            "{}",
            c.beta
        );
        // kl = 0: err = clip(-1) = -0.2; 1 - 0.2 * 1000 / 10000 = 0.98
        let mut c = KlController { beta: 0.5, ctrl };
        c.update(0.0, 1000);
        assert!((c.beta - 0.49).abs() < 1e-15);
        // Fixed never moves.
        let mut f = KlController {
            beta: 0.5,
            ctrl: KlCtrl::Fixed,
        };
        f.update(3.0, 1000);
        assert_eq!(f.beta, 0.5);
    }

    #[test]
    fn state_round_trip_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kl.json");
        assert_eq!(KlState::load(&path).unwrap(), None);
        let s = KlState {
            beta: 0.0123,
            updates: 4,
            last_kl: Some(0.2),
            last_beta: Some(0.012),
        };
        s.save(&path).unwrap();
        assert_eq!(KlState::load(&path).unwrap(), Some(s));
        assert!(!crate::batch::write::temp_path(&path).exists());
        std::fs::write(&path, "{\"beta\": -1, \"updates\": 0}").unwrap();
        let err = KlState::load(&path).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("beta -1"), "{err}");
        std::fs::write(&path, "not json").unwrap();
        let err = KlState::load(&path).unwrap_err();
        assert!(err.to_string().contains("not a KL state file"), "{err}");
    }
}
