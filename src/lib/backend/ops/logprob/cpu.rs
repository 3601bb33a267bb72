//! The LM head fused with a chunked log-softmax and entropy: logits are produced one chunk of
//! rows at a time into a scratch buffer, reduced to (log-prob of the target, log-sum-exp,
//! entropy), and dropped; the backward recomputes each chunk's logits and turns them into
//! dlogits in place. Full-vocabulary logits for the whole batch never exist.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{LogprobGrad, LogprobInput, LogprobOps, LogprobShape};
use crate::backend::cpu::{get, get_mut, Cpu};
use crate::backend::ops::matmul::cpu as matmul;

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
pub fn forward(
    lp: &mut [f32],
    mut ent: Option<&mut [f32]>,
    lse: &mut [f32],
    input: LogprobInput<&[f32], &[u32]>,
    s: LogprobShape,
    scratch: &mut [f32],
) -> Result<()> {
    let LogprobInput { x, w, targets } = input;
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
            s.gemm(cn),
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

/// dz_iv = glp_i(δ_{v,y_i} − p_iv) − gent_i·p_iv·(log p_iv + ent_i), dlogits = dz/T;
/// dx = dlogits·w (overwritten), dw += dlogitsᵀ·x.
pub fn backward(
    dx: &mut [f32],
    mut dw: Option<&mut [f32]>,
    input: LogprobInput<&[f32], &[u32]>,
    g: LogprobGrad<&[f32]>,
    s: LogprobShape,
    scratch: &mut [f32],
) -> Result<()> {
    let LogprobInput { x, w, targets } = input;
    check(&s, targets)?;
    let (d, vocab, inv_t) = (s.hidden, s.vocab, 1.0 / s.temperature);
    for c0 in (0..s.rows).step_by(s.chunk) {
        let cn = s.chunk.min(s.rows - c0);
        let xc = &x[c0 * d..(c0 + cn) * d];
        let logits = &mut scratch[..cn * vocab];
        matmul::forward(logits, xc, w, None, s.gemm(cn), false);
        logits
            .par_chunks_mut(vocab)
            .enumerate()
            .for_each(|(r, row)| {
                let i = c0 + r;
                let (glp, lse, ent) = (g.dlp[i], g.lse[i], g.ent[i]);
                let gent = g.dent.map_or(0.0, |g| g[i]);
                for z in row.iter_mut() {
                    let logp = *z * inv_t - lse;
                    let p = logp.exp();
                    *z = (-glp * p - gent * p * (logp + ent)) * inv_t;
                }
                row[targets[i] as usize] += glp * inv_t;
            });
        matmul::backward_x(&mut dx[c0 * d..(c0 + cn) * d], logits, w, s.gemm(cn), false);
        if let Some(dw) = dw.as_deref_mut() {
            matmul::backward_w(dw, None, logits, xc, s.gemm(cn));
        }
    }
    Ok(())
}

/// The inputs' prefixes the shape covers.
fn input_of<'a>(
    x: LogprobInput<&'a Vec<f32>, &'a Vec<u32>>,
    s: LogprobShape,
) -> Result<LogprobInput<&'a [f32], &'a [u32]>> {
    Ok(LogprobInput {
        x: get(x.x, s.rows * s.hidden, "logprob x")?,
        w: get(x.w, s.vocab * s.hidden, "logprob w")?,
        targets: get(x.targets, s.rows, "logprob targets")?,
    })
}

impl LogprobOps for Cpu {
    fn logprob(
        &self,
        lp: &mut Vec<f32>,
        ent: Option<&mut Vec<f32>>,
        lse: &mut Vec<f32>,
        x: LogprobInput<&Vec<f32>, &Vec<u32>>,
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
            input_of(x, s)?,
            s,
            get_mut(scratch, s.chunk * s.vocab, "logprob scratch")?,
        )
    }
    fn logprob_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: Option<&mut Vec<f32>>,
        x: LogprobInput<&Vec<f32>, &Vec<u32>>,
        g: LogprobGrad<&Vec<f32>>,
        s: LogprobShape,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let dent = match g.dent {
            Some(d) => Some(get(d, s.rows, "logprob dent")?),
            None => None,
        };
        backward(
            get_mut(dx, s.rows * s.hidden, "logprob dx")?,
            match dw {
                Some(dw) => Some(get_mut(dw, s.vocab * s.hidden, "logprob dw")?),
                None => None,
            },
            input_of(x, s)?,
            LogprobGrad {
                dlp: get(g.dlp, s.rows, "logprob dlp")?,
                dent,
                lse: get(g.lse, s.rows, "logprob lse")?,
                ent: get(g.ent, s.rows, "logprob entropy")?,
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
            LogprobInput {
                x: &[1.0, 1.0],
                w: &w,
                targets: &[0, 1],
            },
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
            LogprobInput {
                x: &[1.0, 1.0],
                w: &w,
                targets: &[0, 1],
            },
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
            LogprobInput {
                x: &[1.0],
                w: &[0.0; 2],
                targets: &[2],
            },
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
            LogprobInput {
                x: &[1.0],
                w: &[0.0; 2],
                targets: &[1]
            },
            s0,
            &mut b
        )
        .is_err());
    }
}
