//! Optimizer ops: the squared L2 norm used for global grad-norm clipping, and AdamW.

use anyhow::Result;
use rayon::prelude::*;

use super::{AdamWOps, AdamWStep};
use crate::backend::cpu::{get, get_mut, Cpu, ELEMWISE_GRAIN};

/// Σ x² in f64.
pub(crate) fn sum_squares(x: &[f32]) -> f64 {
    x.par_chunks(ELEMWISE_GRAIN)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .sum()
}

/// AdamW as torch.optim.AdamW: g' = s·g; m = β1·m + (1−β1)·g'; v = β2·v + (1−β2)·g'²;
/// p = p·(1 − lr·wd) − (lr/bc1)·m / (√v/√bc2 + eps).
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], st: &AdamWStep) {
    let decay = 1.0 - st.lr * st.weight_decay;
    let step_size = st.lr / st.bias_correction1;
    let sqrt_bc2 = st.bias_correction2.sqrt();
    p.par_chunks_mut(ELEMWISE_GRAIN)
        .zip(g.par_chunks(ELEMWISE_GRAIN))
        .zip(
            m.par_chunks_mut(ELEMWISE_GRAIN)
                .zip(v.par_chunks_mut(ELEMWISE_GRAIN)),
        )
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let gi = g[i] * st.grad_scale;
                m[i] = st.beta1 * m[i] + (1.0 - st.beta1) * gi;
                v[i] = st.beta2 * v[i] + (1.0 - st.beta2) * gi * gi;
                p[i] = p[i] * decay - step_size * m[i] / (v[i].sqrt() / sqrt_bc2 + st.eps);
            }
        });
}

impl AdamWOps for Cpu {
    fn sum_squares(&self, x: &Vec<f32>, n: usize) -> Result<f64> {
        Ok(sum_squares(get(x, n, "sum_squares x")?))
    }
    fn adamw(
        &self,
        p: &mut Vec<f32>,
        g: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        n: usize,
        step: &AdamWStep,
    ) -> Result<()> {
        adamw(
            get_mut(p, n, "adamw p")?,
            get(g, n, "adamw g")?,
            get_mut(m, n, "adamw m")?,
            get_mut(v, n, "adamw v")?,
            step,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_two_steps_by_hand() {
        let st = |bc1: f32, bc2: f32| AdamWStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            bias_correction1: bc1,
            bias_correction2: bc2,
            grad_scale: 0.5,
        };
        let (mut p, mut m, mut v) = (vec![1.0f32], vec![0.0f32], vec![0.0f32]);
        // Step 1, g = 4 scaled to 2: m = 0.2, v = 0.004, m̂ = 2, √v̂ = 2 → p = 1·0.999 − 0.1.
        adamw(&mut p, &[4.0], &mut m, &mut v, &st(0.1, 0.001));
        assert!((m[0] - 0.2).abs() < 1e-6 && (v[0] - 0.004).abs() < 1e-7);
        assert!((p[0] - (0.999 - 0.1)).abs() < 1e-6, "{}", p[0]);
        // Step 2 with g' = 0: m = 0.18, v = 0.003996; m̂ = 0.18/0.19, √v̂ = √(0.003996/0.001999).
        let p1 = p[0];
        adamw(&mut p, &[0.0], &mut m, &mut v, &st(0.19, 0.001999));
        let want = p1 * 0.999 - 0.1 * (0.18 / 0.19) / ((0.003996f32 / 0.001999).sqrt() + 1e-8);
        assert!((p[0] - want).abs() < 1e-6, "{} vs {want}", p[0]);
    }

    #[test]
    fn sum_of_squares() {
        assert_eq!(sum_squares(&[3.0, 4.0]), 25.0);
    }
}
