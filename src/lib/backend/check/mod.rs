//! Checking backends: helpers for the CPU-side tests and benchmarks (deterministic random
//! numbers, the same on every machine, and closeness measures), the GPU parity harness
//! (`gpu`: the context a family's parity case runs in, the comparison and the table) and the
//! CUDA-event timer (`timing`). The cases themselves live with their op families
//! (`backend::ops::<family>::check`), listed by `backend::ops::op_cases` / `timing_cases`.

pub mod gpu;
pub(crate) mod timing;

use crate::rng::SplitMix64;

/// Test-data generator: SplitMix64 seeded through a mixing constant.
#[derive(Clone, Debug)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64(seed ^ 0x9E37_79B9_7F4A_7C15))
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0.uniform()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        self.0.normal()
    }

    /// Uniform integer in 0..n.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n.max(1))
    }
}

/// `n` standard-normal floats from `seed`.
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.normal()).collect()
}

/// max_i |a_i − b_i| / max(1, max_i |b_i|): an error relative to the scale of the reference.
pub fn scaled_max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let scale = b.iter().fold(1.0f64, |m, &v| m.max(v.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    if a.iter().chain(b).any(|v| v.is_nan()) {
        return f64::INFINITY;
    }
    diff / scale
}

/// Panics with `what` when [`scaled_max_diff`] exceeds `tol`.
#[cfg(test)]
pub(crate) fn assert_close(a: &[f32], b: &[f32], tol: f64, what: &str) {
    let d = scaled_max_diff(a, b);
    assert!(d <= tol, "{what}: scaled max difference {d:e} > {tol:e}");
}
