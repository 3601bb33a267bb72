//! Helpers for tests and benchmarks of backends: deterministic random numbers (no dependency,
//! same numbers on every machine) and closeness measures.

/// SplitMix64: tiny, fast, and good enough for test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// Uniform integer in 0..n.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
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
pub fn assert_close(a: &[f32], b: &[f32], tol: f64, what: &str) {
    let d = scaled_max_diff(a, b);
    assert!(d <= tol, "{what}: scaled max difference {d:e} > {tol:e}");
}
