//! SwiGLU activation of the MLP: h = silu(gate) · up.

use anyhow::Result;
use rayon::prelude::*;

use super::SwigluOps;
use crate::backend::cpu::{get, get_mut, Cpu, ELEMWISE_GRAIN};

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// h = silu(g)·u = g·σ(g)·u.
pub fn forward(h: &mut [f32], g: &[f32], u: &[f32]) {
    h.par_chunks_mut(ELEMWISE_GRAIN)
        .zip(g.par_chunks(ELEMWISE_GRAIN))
        .zip(u.par_chunks(ELEMWISE_GRAIN))
        .for_each(|((h, g), u)| {
            for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
                *h = g * sigmoid(g) * u;
            }
        });
}

/// dg = dh·u·σ(g)·(1 + g·(1−σ(g))),  du = dh·silu(g).
pub fn backward(dg: &mut [f32], du: &mut [f32], dh: &[f32], g: &[f32], u: &[f32]) {
    dg.par_chunks_mut(ELEMWISE_GRAIN)
        .zip(du.par_chunks_mut(ELEMWISE_GRAIN))
        .zip(dh.par_chunks(ELEMWISE_GRAIN))
        .zip(
            g.par_chunks(ELEMWISE_GRAIN)
                .zip(u.par_chunks(ELEMWISE_GRAIN)),
        )
        .for_each(|(((dg, du), dh), (g, u))| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                dg[i] = dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                du[i] = dh[i] * g[i] * s;
            }
        });
}

impl SwigluOps for Cpu {
    fn swiglu(&self, h: &mut Vec<f32>, g: &Vec<f32>, u: &Vec<f32>, n: usize) -> Result<()> {
        forward(
            get_mut(h, n, "swiglu h")?,
            get(g, n, "swiglu g")?,
            get(u, n, "swiglu u")?,
        );
        Ok(())
    }
    fn swiglu_backward(
        &self,
        dg: &mut Vec<f32>,
        du: &mut Vec<f32>,
        dh: &Vec<f32>,
        g: &Vec<f32>,
        u: &Vec<f32>,
        n: usize,
    ) -> Result<()> {
        backward(
            get_mut(dg, n, "swiglu dg")?,
            get_mut(du, n, "swiglu du")?,
            get(dh, n, "swiglu dh")?,
            get(g, n, "swiglu g")?,
            get(u, n, "swiglu u")?,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::randn;

    #[test]
    fn values_at_zero_and_large_inputs() {
        let (g, u) = ([0.0f32, 30.0, -30.0], [2.0f32, 3.0, 5.0]);
        let mut h = [0.0; 3];
        forward(&mut h, &g, &u);
        // silu(0) = 0, silu(30) ≈ 30, silu(−30) ≈ −30·e⁻³⁰ ≈ 0.
        assert_eq!(h[0], 0.0);
        assert!((h[1] - 90.0).abs() < 1e-4 && h[2].abs() < 1e-10);
        let (mut dg, mut du) = ([0.0; 3], [0.0; 3]);
        backward(&mut dg, &mut du, &[1.0; 3], &g, &u);
        // d silu/dg at 0 is σ(0) = 1/2, so dg = u/2; du = silu(g).
        assert!((dg[0] - 1.0).abs() < 1e-7 && du[0] == 0.0);
        assert!((dg[1] - 3.0).abs() < 1e-4 && (du[1] - 30.0).abs() < 1e-4);
    }

    #[test]
    fn swiglu_packed_equals_swiglu_of_the_halves() {
        let (n, f) = (7usize, 37usize);
        let gu = randn((n + 1) * 2 * f, 3);
        let (mut g, mut u) = (Vec::new(), Vec::new());
        for r in gu.chunks(2 * f).take(n) {
            g.extend_from_slice(&r[..f]);
            u.extend_from_slice(&r[f..]);
        }
        let mut want = vec![0.0; n * f];
        Cpu.swiglu(&mut want, &g, &u, n * f).unwrap();
        let mut h = vec![f32::NAN; n * f + 3];
        Cpu.swiglu_packed(&mut h, &gu, n, f).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&h[..n * f]), bits(&want));
        assert!(h[n * f..].iter().all(|v| v.is_nan()), "wrote past h");
        // Row 1, column 2 by hand: silu(g)·u.
        let (a, b) = (gu[2 * f + 2], gu[2 * f + f + 2]);
        assert_eq!(h[f + 2], a * (1.0 / (1.0 + (-a).exp())) * b);
    }
}
