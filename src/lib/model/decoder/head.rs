//! The head of the decoder: the final norm of the rows that are scored or sampled, the LM head,
//! and the fused log-prob (the logits of a chunk of rows at a time, never the whole
//! `[rows, vocab]` matrix) that scoring and training read; or a value model's head (`score`,
//! hidden -> 1), whose value at each scored row stands where the log-prob would be.

use anyhow::Result;

use super::{Decoder, SeqRef, TokenStats};
use crate::backend::{Backend, LogprobInput, LogprobShape, MatmulShape, RmsNormShape};

impl<B: Backend> Decoder<B> {
    /// ws.xf = final_norm(resid[last][rows]) for the `r` rows listed in ws.rows: the hidden
    /// states the LM head reads (scoring, training and paged steps alike). The gather
    /// also rounds the f32 residual to the compute dtype, in every path: a decode step that
    /// normed its rows in place would round differently from training (measured: 1.3e-3 mean
    /// |Δ log-prob| against `ref-logprob` in batch-invariant mode).
    pub(super) fn final_rows(&mut self, last: usize, r: usize) -> Result<()> {
        let Decoder {
            backend: b,
            cfg,
            w,
            ws,
            final_norm,
            ..
        } = self;
        let d = cfg.hidden_size;
        b.gather_rows(&mut ws.xg, &ws.resid[last], &ws.rows, r, d)?;
        b.rmsnorm(
            &mut ws.xf,
            &mut ws.rstd_f,
            &ws.xg,
            &w[*final_norm],
            RmsNormShape {
                rows: r,
                dim: d,
                eps: cfg.rms_norm_eps,
            },
        )
    }

    /// ws.logits[r, vocab] = ws.xf · headᵀ (full logits of the `r` final rows).
    pub(super) fn head_logits(&mut self, r: usize) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let Decoder {
            backend: b,
            w,
            ws,
            head,
            ..
        } = self;
        b.matmul(
            &mut ws.logits,
            &ws.xf,
            &w[*head],
            None,
            MatmulShape { m: r, k: d, n: v },
            false,
        )
    }

    /// Makes the fused log-prob's scratch hold one chunk of logits.
    pub(super) fn reserve_logprob_scratch(&mut self) -> Result<()> {
        let n = self.logprob_chunk.max(1) * self.cfg.vocab_size;
        if self.backend.len(&self.ws.scratch) < n {
            self.ws.scratch = self.backend.alloc(0)?;
            self.ws.scratch = self.backend.alloc(n)?;
        }
        Ok(())
    }

    /// (nearly) equal size so the last GEMM is not a sliver.
    pub(super) fn chunk_rows(&self, r: usize) -> usize {
        let max = self.logprob_chunk.max(1);
        r.div_ceil(r.div_ceil(max).max(1)).max(1)
    }

    /// Final norm of the scored rows and the fused log-prob; returns per-sequence stats.
    pub(super) fn score_rows(
        &mut self,
        last: usize,
        seqs: &[SeqRef],
        r: usize,
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        if r == 0 {
            return Ok(seqs
                .iter()
                .map(|_| TokenStats {
                    logprobs: vec![],
                    entropy: entropy.then(Vec::new),
                })
                .collect());
        }
        // A value model has no distribution over tokens, so no entropy.
        let entropy = entropy && !self.cfg.value_head;
        self.score_device(last, r, temperature, entropy)?;
        let (b, ws) = (&self.backend, &self.ws);
        let mut lp = vec![0.0; r];
        b.download(&ws.lp, &mut lp)?;
        let mut ent = vec![0.0; if entropy { r } else { 0 }];
        if entropy {
            b.download(&ws.ent, &mut ent)?;
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for s in seqs {
            let c = s.tokens.len() - s.start;
            out.push(TokenStats {
                logprobs: lp[off..off + c].to_vec(),
                entropy: entropy.then(|| ent[off..off + c].to_vec()),
            });
            off += c;
        }
        Ok(out)
    }

    /// Final norm of the `r > 0` scored rows and the fused log-prob, left on the device
    /// (`ws.lp`, `ws.ent`, `ws.lse_lp`); a value model's values in `ws.lp` (the temperature
    /// does not apply to them).
    pub(super) fn score_device(
        &mut self,
        last: usize,
        r: usize,
        temperature: f32,
        entropy: bool,
    ) -> Result<()> {
        let chunk = self.chunk_rows(r);
        self.final_rows(last, r)?;
        if self.cfg.value_head {
            return self.values_device(r);
        }
        let Decoder {
            backend: b,
            cfg,
            w,
            ws,
            head,
            ..
        } = self;
        let d = cfg.hidden_size;
        let shape = LogprobShape {
            rows: r,
            hidden: d,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        let ent = if entropy { Some(&mut ws.ent) } else { None };
        b.logprob(
            &mut ws.lp,
            ent,
            &mut ws.lse_lp,
            LogprobInput {
                x: &ws.xf,
                w: &w[*head],
                targets: &ws.targets,
            },
            shape,
            &mut ws.scratch,
        )
    }
}

impl<B: Backend> Decoder<B> {
    /// ws.lp[r] = ws.xf · scoreᵀ + bias: a value model's values of the `r` final rows.
    fn values_device(&mut self, r: usize) -> Result<()> {
        let Decoder {
            backend: b,
            cfg,
            w,
            ws,
            head,
            head_bias,
            ..
        } = self;
        let shape = MatmulShape {
            m: r,
            k: cfg.hidden_size,
            n: 1,
        };
        let bias = head_bias.map(|i| &w[i]);
        b.matmul(&mut ws.lp, &ws.xf, &w[*head], bias, shape, false)
    }

    /// The value head's backward over the `r` scored rows from dL/dV in `dlp`: the head's
    /// weight and bias gradients (added) and dL/dxf.
    pub(super) fn value_head_backward(&mut self, r: usize) -> Result<()> {
        let Decoder {
            backend: b,
            cfg,
            w,
            g,
            ws,
            head,
            head_bias,
            ..
        } = self;
        let gw = ws.grad.as_mut().expect("training workspace");
        let shape = MatmulShape {
            m: r,
            k: cfg.hidden_size,
            n: 1,
        };
        let (gh, gb) = super::two_mut(g, *head, *head_bias);
        b.matmul_backward_w(gh, gb, &gw.dlp, &ws.xf, shape)?;
        b.matmul_backward_x(&mut gw.dxf, &gw.dlp, &w[*head], shape, false)
    }
}
