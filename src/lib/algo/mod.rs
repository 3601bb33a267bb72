//! RL algorithm math on host arrays: advantage estimators, KL penalties and controllers,
//! loss aggregation, the policy losses, and rollout correction (mismatch metrics, masked
//! importance sampling), and the critic's value loss. Everything here is pure math over ragged rows (one row
//! per sequence, no padding); `crate::stage::advantage` reads and writes the batch for the
//! `advantage` binary.
//!
//! Estimators are registered by name in [`advantage::ESTIMATORS`] (verl's `register_adv_est`),
//! policy losses in [`policy_loss::LOSSES`] (verl's `register_policy_loss`).

pub(crate) mod advantage;
pub(crate) mod agg;
pub(crate) mod kl;
pub mod policy_loss;
pub(crate) mod rollout_corr;
pub mod value_loss;

/// The float types the loss math runs in: f32 for training, f64 for gradient checks.
pub(crate) trait Real: Copy + Send + Sync + 'static {
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Real for f32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// Split `values` into one mutable slice per row, so rows can be filled in parallel.
pub(crate) fn rows_mut<'a, T>(mut values: &'a mut [T], offsets: &[usize]) -> Vec<&'a mut [T]> {
    let mut rows = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (row, rest) = values.split_at_mut(w[1] - w[0]);
        rows.push(row);
        values = rest;
    }
    rows
}
