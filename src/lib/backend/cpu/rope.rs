//! Rotary position embedding in HF's `rotate_half` layout: dimension i pairs with i + d/2.

use anyhow::{bail, Result};
use rayon::prelude::*;

/// Largest head_dim the stack buffers below hold.
pub const MAX_HEAD_DIM: usize = 1024;

/// inv_freq_i = 1 / theta^(2i/d), in f32 exactly as HF builds it.
pub fn inv_freq(i: usize, head_dim: usize, theta: f32) -> f32 {
    1.0 / theta.powf((2 * i) as f32 / head_dim as f32)
}

/// In place on x[t,h,:]: (a, b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
/// angle = pos[t]·inv_freq_i. `inverse` rotates by −angle (the backward pass: the transpose
/// of a rotation is its inverse).
pub fn apply(
    x: &mut [f32],
    pos: &[u32],
    heads: usize,
    head_dim: usize,
    theta: f32,
    inverse: bool,
) -> Result<()> {
    if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        bail!("rope: head_dim {head_dim} must be even and at most {MAX_HEAD_DIM}");
    }
    let half = head_dim / 2;
    let row = heads * head_dim;
    if row == 0 {
        return Ok(());
    }
    let mut freqs = [0f32; MAX_HEAD_DIM / 2];
    for (i, f) in freqs.iter_mut().take(half).enumerate() {
        *f = inv_freq(i, head_dim, theta);
    }
    let sign = if inverse { -1.0 } else { 1.0 };
    x.par_chunks_mut(row)
        .zip(pos.par_iter())
        .for_each(|(xr, &p)| {
            let (mut cos, mut sin) = ([0f32; MAX_HEAD_DIM / 2], [0f32; MAX_HEAD_DIM / 2]);
            for i in 0..half {
                // f32 product then f32 cos/sin, like HF's `freqs = inv_freq @ position_ids`.
                let (s, c) = (p as f32 * freqs[i]).sin_cos();
                cos[i] = c;
                sin[i] = sign * s;
            }
            for head in xr.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_by_hand_and_inverse() {
        // head_dim 2, theta irrelevant for i = 0 (inv_freq = 1): angle = pos.
        let mut x = vec![1.0f32, 0.0, 0.0, 2.0];
        apply(&mut x, &[0, 1], 1, 2, 10000.0, false).unwrap();
        assert_eq!(&x[..2], &[1.0, 0.0]);
        let (s, c) = 1f32.sin_cos();
        assert!((x[2] - (-2.0 * s)).abs() < 1e-6 && (x[3] - 2.0 * c).abs() < 1e-6);
        apply(&mut x, &[0, 1], 1, 2, 10000.0, true).unwrap();
        assert!((x[2]).abs() < 1e-6 && (x[3] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn odd_head_dim_is_refused() {
        assert!(apply(&mut [0.0; 3], &[0], 1, 3, 1e4, false).is_err());
    }
}
