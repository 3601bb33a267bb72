//! Causal grouped-query attention over packed variable-length sequences (no padding) and its
//! backward. Like flash attention, the forward keeps only the log-sum-exp per query and head
//! (online softmax, never a T×T matrix), and the backward recomputes the probabilities from it.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{AttentionOps, AttnOut, AttnShape, Qkv};
use crate::backend::cpu::{get, get_mut, Cpu, SharedMut};

/// Σ a·b with independent partial sums so the loop vectorises.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// y += a·x.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

fn check_heads(heads: usize, kv_heads: usize) -> Result<usize> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("attention: {heads} query heads cannot be grouped over {kv_heads} kv heads");
    }
    Ok(heads / kv_heads)
}

fn check_cu(cu: &[u32], tokens: usize) -> Result<()> {
    if cu.first() != Some(&0) || cu.last().map(|&c| c as usize) != Some(tokens) {
        bail!("attention: cu_seqlens must run from 0 to {tokens}, got {cu:?}");
    }
    if cu.windows(2).any(|w| w[0] > w[1]) {
        bail!("attention: cu_seqlens must not decrease, got {cu:?}");
    }
    Ok(())
}

/// The sequence that owns packed row i.
fn seq_of(cu: &[u32], i: usize) -> usize {
    cu.partition_point(|&c| c as usize <= i) - 1
}

/// One query against keys/values rows `rows` (row j at `j·stride` of `k` and `v`, which start
/// at the head's columns): out = Σ_j softmax_j(q·k_j·scale) v_j by online softmax; returns
/// log Σ_j exp(q·k_j·scale).
#[inline]
fn attend_one(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    rows: std::ops::Range<usize>,
    stride: usize,
    scale: f32,
) -> f32 {
    let d = out.len();
    out.fill(0.0);
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    for j in rows {
        let kj = &k[j * stride..j * stride + d];
        let s = dot(q, kj) * scale;
        if s > m {
            // A new maximum: rescale what was summed under the old one.
            let c = (m - s).exp();
            l *= c;
            out.iter_mut().for_each(|o| *o *= c);
            m = s;
        }
        let p = (s - m).exp();
        l += p;
        axpy(out, p, &v[j * stride..j * stride + d]);
    }
    let inv = 1.0 / l;
    out.iter_mut().for_each(|o| *o *= inv);
    m + l.ln()
}

/// o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j; lse[i,h] = log Σ_j exp(q_i·k_j/√d).
pub fn forward(out: AttnOut<&mut [f32]>, x: Qkv<&[f32]>, cu: &[u32], s: AttnShape) -> Result<()> {
    let (AttnOut { o, lse }, Qkv { q, k, v }) = (out, x);
    let group = check_heads(s.heads, s.kv_heads)?;
    check_cu(cu, s.tokens)?;
    let (d, qrow, krow) = (s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    if qrow == 0 {
        return Ok(());
    }
    let scale = 1.0 / (d as f32).sqrt();
    o.par_chunks_mut(qrow)
        .zip(lse.par_chunks_mut(s.heads))
        .enumerate()
        .for_each(|(i, (orow, lrow))| {
            let start = cu[seq_of(cu, i)] as usize;
            for h in 0..s.heads {
                let qi = &q[i * qrow + h * d..i * qrow + (h + 1) * d];
                let out = &mut orow[h * d..(h + 1) * d];
                let off = (h / group) * d;
                lrow[h] = attend_one(out, qi, &k[off..], &v[off..], start..i + 1, krow, scale);
            }
        });
    Ok(())
}

/// P = exp(S − lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)), dQ = dS K/√d,
/// dK = dSᵀ Q/√d. One task per (sequence, kv head): it owns dK and dV of that head in that
/// sequence and dQ of the query heads grouped on it, so tasks never write the same floats.
pub fn backward(
    g: Qkv<&mut [f32]>,
    dout: &[f32],
    x: Qkv<&[f32]>,
    out: AttnOut<&[f32]>,
    cu: &[u32],
    s: AttnShape,
) -> Result<()> {
    let (Qkv { q, k, v }, AttnOut { o, lse }) = (x, out);
    let group = check_heads(s.heads, s.kv_heads)?;
    check_cu(cu, s.tokens)?;
    let (d, qrow, krow) = (s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    g.q.fill(0.0);
    g.k.fill(0.0);
    g.v.fill(0.0);
    let scale = 1.0 / (d as f32).sqrt();
    let (dq, dk, dv) = (
        SharedMut::new(g.q),
        SharedMut::new(g.k),
        SharedMut::new(g.v),
    );
    (0..s.seqs * s.kv_heads).into_par_iter().for_each(|task| {
        let (seq, kh) = (task / s.kv_heads, task % s.kv_heads);
        let (start, end) = (cu[seq] as usize, cu[seq + 1] as usize);
        for h in kh * group..(kh + 1) * group {
            for i in start..end {
                let qo = i * qrow + h * d;
                let (qi, doi, oi) = (&q[qo..qo + d], &dout[qo..qo + d], &o[qo..qo + d]);
                let l = lse[i * s.heads + h];
                let di = dot(doi, oi);
                // SAFETY: row i, head h of dq belongs to this task only (h is in kh's group).
                let dqi = unsafe { dq.slice(qo, d) };
                for j in start..=i {
                    let ko = j * krow + kh * d;
                    let (kj, vj) = (&k[ko..ko + d], &v[ko..ko + d]);
                    let p = (dot(qi, kj) * scale - l).exp();
                    let ds = p * (dot(doi, vj) - di) * scale;
                    // SAFETY: row j, kv head kh of dk/dv belongs to this task only.
                    let (dkj, dvj) = unsafe { (dk.slice(ko, d), dv.slice(ko, d)) };
                    axpy(dvj, p, doi);
                    axpy(dqi, ds, kj);
                    axpy(dkj, ds, qi);
                }
            }
        }
    });
    Ok(())
}

impl AttentionOps for Cpu {
    fn attention(
        &self,
        out: AttnOut<&mut Vec<f32>>,
        x: Qkv<&Vec<f32>>,
        cu_seqlens: &Vec<u32>,
        s: AttnShape,
    ) -> Result<()> {
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        forward(
            AttnOut {
                o: get_mut(out.o, qn, "attention o")?,
                lse: get_mut(out.lse, s.tokens * s.heads, "attention lse")?,
            },
            Qkv {
                q: get(x.q, qn, "attention q")?,
                k: get(x.k, kn, "attention k")?,
                v: get(x.v, kn, "attention v")?,
            },
            get(cu_seqlens, s.seqs + 1, "attention cu_seqlens")?,
            s,
        )
    }
    fn attention_backward(
        &self,
        dx: Qkv<&mut Vec<f32>>,
        dout: &Vec<f32>,
        x: Qkv<&Vec<f32>>,
        out: AttnOut<&Vec<f32>>,
        cu_seqlens: &Vec<u32>,
        s: AttnShape,
    ) -> Result<()> {
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        backward(
            Qkv {
                q: get_mut(dx.q, qn, "attention dq")?,
                k: get_mut(dx.k, kn, "attention dk")?,
                v: get_mut(dx.v, kn, "attention dv")?,
            },
            get(dout, qn, "attention dout")?,
            Qkv {
                q: get(x.q, qn, "attention q")?,
                k: get(x.k, kn, "attention k")?,
                v: get(x.v, kn, "attention v")?,
            },
            AttnOut {
                o: get(out.o, qn, "attention o")?,
                lse: get(out.lse, s.tokens * s.heads, "attention lse")?,
            },
            get(cu_seqlens, s.seqs + 1, "attention cu_seqlens")?,
            s,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_equal_scores_average() {
        // Two sequences packed: [a] and [b, c]. head_dim 2, one head.
        let q = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let k = [5.0, 5.0, 1.0, 2.0, 3.0, 4.0];
        let v = [7.0, 8.0, 1.0, 1.0, 3.0, 5.0];
        let (mut o, mut lse) = ([0.0; 6], [0.0; 3]);
        let s = AttnShape {
            tokens: 3,
            seqs: 2,
            heads: 1,
            kv_heads: 1,
            head_dim: 2,
        };
        forward(
            AttnOut {
                o: &mut o,
                lse: &mut lse,
            },
            Qkv {
                q: &q,
                k: &k,
                v: &v,
            },
            &[0, 1, 3],
            s,
        )
        .unwrap();
        // Row 0 sees only itself; row 1 is the first of seq 2; row 2 (q = 0) averages rows 1, 2.
        assert_eq!(&o[..2], &[7.0, 8.0]);
        assert_eq!(&o[2..4], &[1.0, 1.0]);
        assert!((o[4] - 2.0).abs() < 1e-6 && (o[5] - 3.0).abs() < 1e-6);
        assert!((lse[0] - 5.0 / 2f32.sqrt()).abs() < 1e-6);
        assert!((lse[2] - 2f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn bad_offsets_and_heads_are_refused() {
        let s = AttnShape {
            tokens: 2,
            seqs: 1,
            heads: 3,
            kv_heads: 2,
            head_dim: 2,
        };
        let err = forward(
            AttnOut {
                o: &mut [0.0; 12],
                lse: &mut [0.0; 6],
            },
            Qkv {
                q: &[0.0; 12],
                k: &[0.0; 8],
                v: &[0.0; 8],
            },
            &[0, 2],
            s,
        );
        assert!(err.unwrap_err().to_string().contains("cannot be grouped"));
        let s = AttnShape { heads: 2, ..s };
        let err = forward(
            AttnOut {
                o: &mut [0.0; 8],
                lse: &mut [0.0; 4],
            },
            Qkv {
                q: &[0.0; 8],
                k: &[0.0; 8],
                v: &[0.0; 8],
            },
            &[0, 1],
            s,
        );
        assert!(err.unwrap_err().to_string().contains("cu_seqlens"));
    }
}
