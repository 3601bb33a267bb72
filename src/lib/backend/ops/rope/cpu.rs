//! Rotary position embedding in HF's `rotate_half` layout: dimension i pairs with i + d/2.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{inv_freq, RopeOps, RopeShape, MAX_HEAD_DIM};
use crate::backend::cpu::{get, get_mut, Cpu};

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

impl RopeOps for Cpu {
    fn rope(&self, x: &mut Vec<f32>, pos: &Vec<u32>, s: RopeShape) -> Result<()> {
        let RopeShape {
            tokens,
            heads,
            head_dim,
            theta,
        } = s;
        apply(
            get_mut(x, tokens * heads * head_dim, "rope x")?,
            get(pos, tokens, "rope positions")?,
            heads,
            head_dim,
            theta,
            false,
        )
    }
    fn rope_backward(&self, dx: &mut Vec<f32>, pos: &Vec<u32>, s: RopeShape) -> Result<()> {
        let RopeShape {
            tokens,
            heads,
            head_dim,
            theta,
        } = s;
        apply(
            get_mut(dx, tokens * heads * head_dim, "rope dx")?,
            get(pos, tokens, "rope positions")?,
            heads,
            head_dim,
            theta,
            true,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::randn;
    use crate::backend::{KvCache, PackedQkv, RopeKvShape, Slots};

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

    /// The packed op against `rope_store_kv` on the three parts split out by hand: q, the
    /// cache rows written and the rows left alone equal bit for bit. Buffers are longer than
    /// the op needs (a workspace), and GQA groups make the parts different unit counts.
    #[test]
    fn rope_store_kv_packed_equals_the_split_op() {
        // (tokens, heads, kv_heads, head_dim): Qwen2.5-0.5B's groups of 7, a group of 3
        // (qd = 48, kd = 32: parts of gcd 16), and MHA.
        for (seed, (tokens, heads, kv, hd)) in [
            (19usize, 14usize, 2usize, 16usize),
            (5, 6, 2, 8),
            (1, 4, 4, 6),
        ]
        .into_iter()
        .enumerate()
        {
            let (qd, kd) = (heads * hd, kv * hd);
            let w = qd + 2 * kd;
            let cache_rows = 3 * tokens + 4;
            let seed = seed as u64 * 10;
            let qkv = randn((tokens + 2) * w, seed);
            let pos: Vec<u32> = (0..tokens as u32).map(|t| 3 * t + 100).collect();
            // Rows scattered backwards through the cache.
            let rows: Vec<u32> = (0..tokens as u32)
                .map(|t| (cache_rows as u32 - 1) - 2 * t)
                .collect();
            let kc0 = randn(cache_rows * kd, seed + 1);
            let vc0 = randn(cache_rows * kd, seed + 2);

            let mut q = Vec::new();
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for r in qkv.chunks(w).take(tokens) {
                q.extend_from_slice(&r[..qd]);
                k.extend_from_slice(&r[qd..qd + kd]);
                v.extend_from_slice(&r[qd + kd..]);
            }
            let (mut kc, mut vc) = (kc0.clone(), vc0.clone());
            Cpu.rope_store_kv(
                &mut q,
                &mut k,
                &v,
                Slots {
                    pos: &pos,
                    rows: &rows,
                },
                KvCache {
                    k: &mut kc,
                    v: &mut vc,
                },
                RopeKvShape {
                    tokens,
                    heads,
                    kv_heads: kv,
                    head_dim: hd,
                    theta: 1e4,
                },
            )
            .unwrap();

            let mut q_out = vec![f32::NAN; tokens * qd + 5];
            let (mut pkc, mut pvc) = (kc0.clone(), vc0.clone());
            Cpu.rope_store_kv_packed(
                PackedQkv {
                    qkv: &qkv,
                    q: &mut q_out,
                },
                Slots {
                    pos: &pos,
                    rows: &rows,
                },
                KvCache {
                    k: &mut pkc,
                    v: &mut pvc,
                },
                RopeKvShape {
                    tokens,
                    heads,
                    kv_heads: kv,
                    head_dim: hd,
                    theta: 1e4,
                },
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&q_out[..tokens * qd]),
                bits(&q),
                "q, shape {heads}/{kv}"
            );
            assert!(
                q_out[tokens * qd..].iter().all(|v| v.is_nan()),
                "wrote past q"
            );
            assert_eq!(bits(&pkc), bits(&kc), "k cache, shape {heads}/{kv}");
            assert_eq!(bits(&pvc), bits(&vc), "v cache, shape {heads}/{kv}");
            // v went in as it was; a row no token names kept its value.
            let r0 = rows[0] as usize;
            assert_eq!(&pvc[r0 * kd..(r0 + 1) * kd], &qkv[qd + kd..w]);
            assert_eq!(pvc[..kd], vc0[..kd]);
        }
    }
}
