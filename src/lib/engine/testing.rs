//! A closed-form policy for unit tests of the scoring and training loops: a bigram table
//! θ[prev, next] of logits, with exact gradients and a plain (clipped) SGD step.

use super::Policy;
use crate::model::decoder::{AdamWParams, SeqRef, StepReport, TokenGrads, TokenStats};
use anyhow::{ensure, Result};

pub struct Bigram {
    pub vocab: usize,
    pub theta: Vec<f64>,
    pub grad: Vec<f64>,
    /// forward_backward calls and the sequences each saw.
    pub fb_calls: Vec<usize>,
    /// Sequences scored without a backward pass (logprobs calls).
    pub scored: usize,
    pub steps: usize,
    /// Make every log-prob NaN (to exercise the skip path).
    pub poison: bool,
}

impl Bigram {
    pub fn random(vocab: usize, seed: u64) -> Bigram {
        let theta = (0..vocab * vocab)
            .map(|i| {
                let u = crate::backend::ops::sample::uniform(seed, i as u64);
                (u - 0.5) * 2.0
            })
            .collect();
        Bigram {
            vocab,
            theta,
            grad: vec![0.0; vocab * vocab],
            fb_calls: vec![],
            scored: 0,
            steps: 0,
            poison: false,
        }
    }

    /// p(· | prev) under softmax(θ[prev] / T).
    pub fn probs(&self, prev: u32, t: f32) -> Vec<f64> {
        let row = &self.theta[prev as usize * self.vocab..][..self.vocab];
        let max = row.iter().cloned().fold(f64::MIN, f64::max) / t as f64;
        let e: Vec<f64> = row.iter().map(|&z| (z / t as f64 - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// (log p(next | prev), entropy of p(· | prev)) under temperature t.
    pub fn token_stats(&self, prev: u32, next: u32, t: f32) -> (f32, f32) {
        let p = self.probs(prev, t);
        let ent: f64 = -p.iter().map(|&q| q * q.ln()).sum::<f64>();
        (p[next as usize].ln() as f32, ent as f32)
    }

    fn stats(&self, seqs: &[SeqRef], t: f32, entropy: bool) -> Vec<TokenStats> {
        seqs.iter()
            .map(|s| {
                let (mut lp, mut ent) = (vec![], vec![]);
                for i in s.start..s.tokens.len() {
                    let (l, e) = self.token_stats(s.tokens[i - 1], s.tokens[i], t);
                    lp.push(if self.poison { f32::NAN } else { l });
                    ent.push(e);
                }
                TokenStats {
                    logprobs: lp,
                    entropy: entropy.then_some(ent),
                }
            })
            .collect()
    }
}

impl Policy for Bigram {
    fn logprobs(&mut self, seqs: &[SeqRef], t: f32, entropy: bool) -> Result<Vec<TokenStats>> {
        self.scored += seqs.len();
        Ok(self.stats(seqs, t, entropy))
    }

    fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        t: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        self.fb_calls.push(seqs.len());
        let stats = self.stats(seqs, t, true);
        let grads = loss(&stats)?;
        ensure!(grads.len() == seqs.len());
        for (s, g) in seqs.iter().zip(&grads) {
            for (j, i) in (s.start..s.tokens.len()).enumerate() {
                let (prev, y) = (s.tokens[i - 1] as usize, s.tokens[i] as usize);
                let p = self.probs(prev as u32, t);
                let ent: f64 = -p.iter().map(|&q| q * q.ln()).sum::<f64>();
                let dlp = g.dlogprobs[j] as f64;
                let dent = g.dentropy.as_ref().map_or(0.0, |d| d[j] as f64);
                // dz_v = dlp(δ_vy − p_v) − dent·p_v(log p_v + H); dθ = dz / T.
                for (v, &pv) in p.iter().enumerate() {
                    let dz = dlp * ((v == y) as u8 as f64 - pv) - dent * pv * (pv.ln() + ent);
                    self.grad[prev * self.vocab + v] += dz / t as f64;
                }
            }
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.grad.iter_mut().for_each(|g| *g = 0.0);
        Ok(())
    }

    fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        let norm = self.grad.iter().map(|g| g * g).sum::<f64>().sqrt() as f32;
        if !norm.is_finite() {
            return Ok(StepReport {
                grad_norm: norm,
                skipped: true,
            });
        }
        let coef = match max_grad_norm {
            Some(m) if norm > m => m / (norm + 1e-6),
            _ => 1.0,
        } as f64;
        for (p, g) in self.theta.iter_mut().zip(&self.grad) {
            *p = *p * (1.0 - hp.lr as f64 * hp.weight_decay as f64) - hp.lr as f64 * coef * g;
        }
        self.steps += 1;
        Ok(StepReport {
            grad_norm: norm,
            skipped: false,
        })
    }
}
