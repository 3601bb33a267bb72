//! The LM head fused with a chunked log-softmax and entropy: logits are produced one chunk of
//! rows at a time into a scratch buffer, reduced to (log-prob of the target, log-sum-exp,
//! entropy), and dropped; the backward recomputes each chunk's logits and turns them into
//! dlogits in place. Full-vocabulary logits for the whole batch never exist.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{LogprobOps, LogprobShape};
use crate::backend::cpu::{get, get_mut, Cpu};
use crate::backend::ops::matmul::{cpu as matmul, MatmulShape};

fn check(s: &LogprobShape, targets: &[u32]) -> Result<()> {
    s.check()?;
    if let Some((i, &y)) = targets
        .iter()
        .enumerate()
        .find(|(_, &y)| y as usize >= s.vocab)
    {
        bail!(
            "logprob: target token {y} at row {i} is outside the vocabulary ({})",
            s.vocab
        );
    }
    Ok(())
}

/// Turns one row of logits into z = logits/T in place; returns (max z, Σ exp(z − max), Σ exp(z − max)·z).
fn scale_and_reduce(row: &mut [f32], inv_t: f32) -> (f32, f64, f64) {
    let mut m = f32::NEG_INFINITY;
    for z in row.iter_mut() {
        *z *= inv_t;
        m = m.max(*z);
    }
    let (mut se, mut sez) = (0f64, 0f64);
    for &z in row.iter() {
        let e = ((z - m) as f64).exp();
        se += e;
        sez += e * z as f64;
    }
    (m, se, sez)
}

/// z = x·wᵀ/T; lse_i = log Σ_v exp z_iv; lp_i = z_i[y_i] − lse_i; ent_i = lse_i − Σ_v p_iv z_iv.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    lp: &mut [f32],
    mut ent: Option<&mut [f32]>,
    lse: &mut [f32],
    x: &[f32],
    w: &[f32],
    targets: &[u32],
    s: LogprobShape,
    scratch: &mut [f32],
) -> Result<()> {
    check(&s, targets)?;
    let (d, vocab, inv_t) = (s.hidden, s.vocab, 1.0 / s.temperature);
    for c0 in (0..s.rows).step_by(s.chunk) {
        let cn = s.chunk.min(s.rows - c0);
        let logits = &mut scratch[..cn * vocab];
        matmul::forward(
            logits,
            &x[c0 * d..(c0 + cn) * d],
            w,
            None,
            MatmulShape {
                m: cn,
                k: d,
                n: vocab,
            },
            false,
        );
        let reduce = |row: &mut [f32], y: u32| {
            let (m, se, sez) = scale_and_reduce(row, inv_t);
            let l = m as f64 + se.ln();
            (
                (row[y as usize] as f64 - l) as f32,
                l as f32,
                (l - sez / se) as f32,
            )
        };
        let rows = logits
            .par_chunks_mut(vocab)
            .zip(&targets[c0..c0 + cn])
            .zip(lp[c0..c0 + cn].par_iter_mut().zip(&mut lse[c0..c0 + cn]));
        match ent.as_deref_mut() {
            Some(e) => rows
                .zip(&mut e[c0..c0 + cn])
                .for_each(|(((row, &y), (lp, lse)), e)| {
                    (*lp, *lse, *e) = reduce(row, y);
                }),
            None => rows.for_each(|((row, &y), (lp, lse))| {
                (*lp, *lse, _) = reduce(row, y);
            }),
        }
    }
    Ok(())
}

/// Inputs and outputs of [`backward`].
pub struct BackwardArgs<'a> {
    pub dx: &'a mut [f32],
    pub dw: &'a mut [f32],
    pub x: &'a [f32],
    pub w: &'a [f32],
    pub targets: &'a [u32],
    pub lse: &'a [f32],
    pub ent: &'a [f32],
    pub dlp: &'a [f32],
    pub dent: Option<&'a [f32]>,
}

/// dz_iv = glp_i(δ_{v,y_i} − p_iv) − gent_i·p_iv·(log p_iv + ent_i), dlogits = dz/T;
/// dx = dlogits·w (overwritten), dw += dlogitsᵀ·x.
pub fn backward(a: BackwardArgs, s: LogprobShape, scratch: &mut [f32]) -> Result<()> {
    check(&s, a.targets)?;
    let (d, vocab, inv_t) = (s.hidden, s.vocab, 1.0 / s.temperature);
    for c0 in (0..s.rows).step_by(s.chunk) {
        let cn = s.chunk.min(s.rows - c0);
        let xc = &a.x[c0 * d..(c0 + cn) * d];
        let logits = &mut scratch[..cn * vocab];
        matmul::forward(
            logits,
            xc,
            a.w,
            None,
            MatmulShape {
                m: cn,
                k: d,
                n: vocab,
            },
            false,
        );
        logits
            .par_chunks_mut(vocab)
            .enumerate()
            .for_each(|(r, row)| {
                let i = c0 + r;
                let (glp, lse, ent) = (a.dlp[i], a.lse[i], a.ent[i]);
                let gent = a.dent.map_or(0.0, |g| g[i]);
                for z in row.iter_mut() {
                    let logp = *z * inv_t - lse;
                    let p = logp.exp();
                    *z = (-glp * p - gent * p * (logp + ent)) * inv_t;
                }
                row[a.targets[i] as usize] += glp * inv_t;
            });
        matmul::backward_x(
            &mut a.dx[c0 * d..(c0 + cn) * d],
            logits,
            a.w,
            MatmulShape {
                m: cn,
                k: d,
                n: vocab,
            },
            false,
        );
        matmul::backward_w(
            a.dw,
            None,
            logits,
            xc,
            MatmulShape {
                m: cn,
                k: d,
                n: vocab,
            },
        );
    }
    Ok(())
}

impl LogprobOps for Cpu {
    fn logprob(
        &self,
        lp: &mut Vec<f32>,
        ent: Option<&mut Vec<f32>>,
        lse: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        s: LogprobShape,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let ent = match ent {
            Some(e) => Some(get_mut(e, s.rows, "logprob entropy")?),
            None => None,
        };
        forward(
            get_mut(lp, s.rows, "logprob lp")?,
            ent,
            get_mut(lse, s.rows, "logprob lse")?,
            get(x, s.rows * s.hidden, "logprob x")?,
            get(w, s.vocab * s.hidden, "logprob w")?,
            get(targets, s.rows, "logprob targets")?,
            s,
            get_mut(scratch, s.chunk * s.vocab, "logprob scratch")?,
        )
    }
    fn logprob_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        lse: &Vec<f32>,
        ent: &Vec<f32>,
        dlp: &Vec<f32>,
        dent: Option<&Vec<f32>>,
        s: LogprobShape,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let dent = match dent {
            Some(d) => Some(get(d, s.rows, "logprob dent")?),
            None => None,
        };
        backward(
            BackwardArgs {
                dx: get_mut(dx, s.rows * s.hidden, "logprob dx")?,
                dw: get_mut(dw, s.vocab * s.hidden, "logprob dw")?,
                x: get(x, s.rows * s.hidden, "logprob x")?,
                w: get(w, s.vocab * s.hidden, "logprob w")?,
                targets: get(targets, s.rows, "logprob targets")?,
                lse: get(lse, s.rows, "logprob lse")?,
                ent: get(ent, s.rows, "logprob entropy")?,
                dlp: get(dlp, s.rows, "logprob dlp")?,
                dent,
            },
            s,
            get_mut(scratch, s.chunk * s.vocab, "logprob scratch")?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_two_token_vocab() {
        // hidden 1, x = 1, w = [0, ln 3] → logits [0, ln 3], p = [1/4, 3/4].
        let w = [0.0f32, 3f32.ln()];
        let s = LogprobShape {
            rows: 2,
            hidden: 1,
            vocab: 2,
            temperature: 1.0,
            chunk: 1,
        };
        let (mut lp, mut ent, mut lse, mut scratch) = ([0.0; 2], [0.0; 2], [0.0; 2], [0.0; 2]);
        forward(
            &mut lp,
            Some(&mut ent),
            &mut lse,
            &[1.0, 1.0],
            &w,
            &[0, 1],
            s,
            &mut scratch,
        )
        .unwrap();
        assert!((lp[0] - 0.25f32.ln()).abs() < 1e-6 && (lp[1] - 0.75f32.ln()).abs() < 1e-6);
        assert!((lse[0] - 4f32.ln()).abs() < 1e-6);
        let h = -(0.25f32 * 0.25f32.ln() + 0.75 * 0.75f32.ln());
        assert!((ent[0] - h).abs() < 1e-6 && (ent[1] - h).abs() < 1e-6);
        // Temperature 2 halves the logits: p ∝ [1, √3].
        let s2 = LogprobShape {
            temperature: 2.0,
            ..s
        };
        forward(
            &mut lp,
            None,
            &mut lse,
            &[1.0, 1.0],
            &w,
            &[0, 1],
            s2,
            &mut scratch,
        )
        .unwrap();
        let p0 = 1.0 / (1.0 + 3f32.sqrt());
        assert!((lp[0] - p0.ln()).abs() < 1e-6);
    }

    #[test]
    fn bad_target_and_temperature_are_refused() {
        let s = LogprobShape {
            rows: 1,
            hidden: 1,
            vocab: 2,
            temperature: 1.0,
            chunk: 1,
        };
        let mut b = [0.0; 2];
        let err = forward(
            &mut [0.0],
            None,
            &mut [0.0],
            &[1.0],
            &[0.0; 2],
            &[2],
            s,
            &mut b,
        )
        .unwrap_err();
        assert!(err.to_string().contains("target token 2 at row 0"), "{err}");
        let s0 = LogprobShape {
            temperature: 0.0,
            ..s
        };
        assert!(forward(
            &mut [0.0],
            None,
            &mut [0.0],
            &[1.0],
            &[0.0; 2],
            &[1],
            s0,
            &mut b
        )
        .is_err());
    }
}
