//! RMSNorm (as HF computes it: in f32, weight applied after normalising).

use anyhow::Result;
use rayon::prelude::*;

use super::{RmsNormOps, RmsNormSaved, RmsNormShape};
use crate::backend::cpu::{get, get_mut, Cpu};

/// Columns per task of the weight-gradient reduction.
const COL_BLOCK: usize = 64;

/// y[r,:] = x[r,:] · rstd[r] · w,  rstd[r] = 1/√(mean(x[r,:]²) + eps).
pub fn forward(y: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], dim: usize, eps: f32) {
    if dim == 0 {
        return;
    }
    y.par_chunks_mut(dim)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(dim))
        .for_each(|((y, r), x)| {
            let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dim as f64;
            let rs = 1.0 / ((ms as f32) + eps).sqrt();
            *r = rs;
            y.iter_mut()
                .zip(x)
                .zip(w)
                .for_each(|((y, &x), &w)| *y = w * (x * rs));
        });
}

/// dx (= or +=) rstd·(w·dy − x̂·mean(x̂·w·dy)), x̂ = x·rstd;  dw += Σ_r dy·x̂.
pub fn backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dy: &[f32],
    saved: RmsNormSaved<&[f32]>,
    dim: usize,
    accumulate: bool,
) {
    let RmsNormSaved { x, w, rstd } = saved;
    if dim == 0 {
        return;
    }
    dx.par_chunks_mut(dim)
        .zip(dy.par_chunks(dim))
        .zip(x.par_chunks(dim))
        .zip(rstd.par_iter())
        .for_each(|(((dx, dy), x), &rs)| {
            let dot = dy
                .iter()
                .zip(x)
                .zip(w)
                .map(|((&g, &x), &w)| (g * w) as f64 * (x * rs) as f64)
                .sum::<f64>()
                / dim as f64;
            let dot = dot as f32;
            for (((d, &g), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                let v = rs * (g * w - x * rs * dot);
                if accumulate {
                    *d += v;
                } else {
                    *d = v;
                }
            }
        });
    // Column blocks in parallel so each task owns its slice of dw; rows in order within it.
    dw.par_chunks_mut(COL_BLOCK)
        .enumerate()
        .for_each(|(b, dwb)| {
            let c0 = b * COL_BLOCK;
            for ((dy, x), &rs) in dy.chunks_exact(dim).zip(x.chunks_exact(dim)).zip(rstd) {
                for (j, d) in dwb.iter_mut().enumerate() {
                    *d += dy[c0 + j] * x[c0 + j] * rs;
                }
            }
        });
}

impl RmsNormOps for Cpu {
    fn rmsnorm(
        &self,
        y: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        s: RmsNormShape,
    ) -> Result<()> {
        let RmsNormShape { rows, dim, eps } = s;
        forward(
            get_mut(y, rows * dim, "rmsnorm y")?,
            get_mut(rstd, rows, "rmsnorm rstd")?,
            get(x, rows * dim, "rmsnorm x")?,
            get(w, dim, "rmsnorm w")?,
            dim,
            eps,
        );
        Ok(())
    }
    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dy: &Vec<f32>,
        saved: RmsNormSaved<&Vec<f32>>,
        s: RmsNormShape,
        accumulate: bool,
    ) -> Result<()> {
        let RmsNormShape { rows, dim, .. } = s;
        backward(
            get_mut(dx, rows * dim, "rmsnorm dx")?,
            get_mut(dw, dim, "rmsnorm dw")?,
            get(dy, rows * dim, "rmsnorm dy")?,
            RmsNormSaved {
                x: get(saved.x, rows * dim, "rmsnorm x")?,
                w: get(saved.w, dim, "rmsnorm w")?,
                rstd: get(saved.rstd, rows, "rmsnorm rstd")?,
            },
            dim,
            accumulate,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_row() {
        // x = [3, 4]: mean(x²) = 12.5, rstd = 1/√12.5; w = [1, 2].
        let (x, w) = ([3.0f32, 4.0], [1.0f32, 2.0]);
        let (mut y, mut rs) = ([0.0; 2], [0.0; 1]);
        forward(&mut y, &mut rs, &x, &w, 2, 0.0);
        let r = 1.0 / 12.5f32.sqrt();
        assert!((rs[0] - r).abs() < 1e-7);
        assert!((y[0] - 3.0 * r).abs() < 1e-6 && (y[1] - 8.0 * r).abs() < 1e-6);
    }
}
