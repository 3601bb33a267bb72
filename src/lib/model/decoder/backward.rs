//! Training passes: forward with every layer's activations kept, the loss's gradients with
//! respect to the log-probs (a host callback, or the PPO-clip loss on the device), and the
//! backward pass that adds the parameter gradients up across micro-batches.

use anyhow::{ensure, Result};

use super::forward::AttnMode;
use super::{check_temperature, two_mut, Decoder, PpoTokens, SeqRef, TokenGrads, TokenStats};
use crate::backend::{AttnShape, Backend, DType, LogprobShape, PpoShape, PPO_STATS};

impl<B: Backend> Decoder<B> {
    fn ensure_grads(&mut self) -> Result<()> {
        if self.g.is_empty() {
            for s in &self.shapes {
                self.g.push(self.backend.alloc(s.iter().product())?);
            }
        }
        Ok(())
    }

    /// One forward and backward pass over packed `seqs`: the callback gets the log-probs and
    /// entropies of the scored tokens and returns dL/dlogprob (and dL/dentropy) for each; the
    /// parameter gradients of L are added to the decoder's gradient buffers.
    pub fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads()?;
        if seqs.is_empty() {
            return Ok(());
        }
        let (n, r) = self.pack(seqs, true)?;
        let last = self.forward(n, seqs.len(), true, AttnMode::Packed)?;
        let stats = self.score_rows(last, seqs, r, temperature, true)?;
        let grads = loss(&stats)?;
        ensure!(
            grads.len() == seqs.len(),
            "loss callback returned gradients for {} sequences, expected {}",
            grads.len(),
            seqs.len()
        );
        let mut dlp = Vec::with_capacity(r);
        let mut dent = Vec::with_capacity(r);
        let mut any_dent = false;
        for (s, (gr, st)) in grads.iter().zip(&stats).enumerate() {
            let c = st.logprobs.len();
            ensure!(
                gr.dlogprobs.len() == c,
                "loss callback: sequence {s} has {c} scored tokens but {} dlogprobs",
                gr.dlogprobs.len()
            );
            dlp.extend_from_slice(&gr.dlogprobs);
            match &gr.dentropy {
                Some(de) => {
                    ensure!(
                        de.len() == c,
                        "loss callback: sequence {s} has {c} scored tokens but {} dentropy",
                        de.len()
                    );
                    any_dent = true;
                    dent.extend_from_slice(de);
                }
                None => dent.extend(std::iter::repeat_n(0.0, c)),
            }
        }
        if r == 0 {
            // Nothing scored: the loss does not depend on the weights.
            return Ok(());
        }
        {
            let gw = self.ws.grad.as_mut().expect("training workspace");
            self.backend.upload(&mut gw.dlp, &dlp)?;
            if any_dent {
                self.backend.upload(&mut gw.dent, &dent)?;
            }
        }
        self.backward(n, seqs.len(), r, temperature, any_dent)
    }

    /// Forward, the PPO-clip loss on the device ([`Backend::ppo_clip_loss`], knobs in `clip`;
    /// its `tokens` is set here) and backward over packed `seqs`, with no host round trip: the
    /// loss metrics add up on the device until [`Decoder::take_ppo_stats`]. `logprobs`, when
    /// given, receives the forward's log-probs of the scored tokens (one download).
    pub fn forward_backward_ppo(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tok: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads()?;
        if seqs.is_empty() {
            return Ok(());
        }
        let (n, r) = self.pack(seqs, true)?;
        ensure!(
            tok.advantages.len() == r
                && tok.weights.len() == 3 * r
                && tok.old.is_none_or(|o| o.len() == r)
                && tok.dentropy.is_none_or(|d| d.len() == r),
            "PPO loss inputs: {} advantages, {} weights, {:?} old, {:?} dentropy for {r} scored tokens",
            tok.advantages.len(),
            tok.weights.len(),
            tok.old.map(<[f32]>::len),
            tok.dentropy.map(<[f32]>::len)
        );
        let last = self.forward(n, seqs.len(), true, AttnMode::Packed)?;
        if r == 0 {
            return Ok(());
        }
        self.score_device(last, r, temperature, true)?;
        if let Some(out) = logprobs {
            out.resize(r, 0.0);
            self.backend.download(&self.ws.lp, out)?;
        }
        if self.ppo_stats.is_none() {
            self.ppo_stats = Some(self.backend.alloc(PPO_STATS)?);
        }
        let (b, ws) = (&self.backend, &mut self.ws);
        let gw = ws.grad.as_mut().expect("training workspace");
        b.upload(&mut gw.adv, tok.advantages)?;
        b.upload(&mut gw.lw, tok.weights)?;
        if let Some(o) = tok.old {
            b.upload(&mut gw.old, o)?;
        }
        if let Some(d) = tok.dentropy {
            b.upload(&mut gw.dent, d)?;
        }
        b.ppo_clip_loss(
            &mut gw.dlp,
            self.ppo_stats.as_mut().expect("allocated above"),
            &ws.lp,
            tok.old.map(|_| &gw.old),
            &gw.adv,
            &gw.lw,
            Some(&ws.ent),
            PpoShape { tokens: r, ..clip },
        )?;
        self.backward(n, seqs.len(), r, temperature, tok.dentropy.is_some())
    }

    /// The PPO loss metric sums ([`crate::backend::PPO_STATS`] slots) since the last call, and
    /// resets them (one device sync).
    pub fn take_ppo_stats(&mut self) -> Result<[f64; PPO_STATS]> {
        let mut out = [0f32; PPO_STATS];
        if let Some(s) = self.ppo_stats.as_mut() {
            self.backend.download(s, &mut out)?;
            self.backend.fill(s, PPO_STATS, 0.0)?;
        }
        Ok(out.map(f64::from))
    }

    /// Backward from dL/dlp (and dL/dentropy when `dent`) already in the gradient workspace.
    fn backward(
        &mut self,
        n: usize,
        seqs: usize,
        r: usize,
        temperature: f32,
        dent: bool,
    ) -> Result<()> {
        let chunk = self.chunk_rows(r);
        let Decoder {
            backend: b,
            cfg,
            w,
            g,
            layers,
            ws,
            embed,
            final_norm,
            head,
            ..
        } = self;
        let gw = ws
            .grad
            .as_mut()
            .expect("training workspace has gradient buffers");
        let (d, f, hh, kh, hd) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (qd, kd, theta) = (hh * hd, kh * hd, cfg.rope_theta);
        let shape = LogprobShape {
            rows: r,
            hidden: d,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        b.logprob_backward(
            &mut gw.dxf,
            &mut g[*head],
            &ws.xf,
            &w[*head],
            &ws.targets,
            &ws.lse_lp,
            &ws.ent,
            &gw.dlp,
            dent.then_some(&gw.dent),
            shape,
            &mut ws.scratch,
        )?;
        b.rmsnorm_backward(
            &mut gw.dxg,
            &mut g[*final_norm],
            &gw.dxf,
            &ws.xg,
            &w[*final_norm],
            &ws.rstd_f,
            r,
            d,
            false,
        )?;
        b.fill(&mut gw.d_resid, n * d, 0.0)?;
        b.scatter_add_rows(&mut gw.d_resid, &gw.dxg, &ws.rows, r, d)?;
        let lowp = b.compute_dtype() != DType::F32;
        for (l, ly) in layers.iter().enumerate().rev() {
            let a = &ws.acts[l];
            // MLP (h kept from the forward pass).
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.down], None, dres, &a.h, n, f, d)?;
            b.matmul_backward_x(&mut gw.dh, dres, &w[ly.down], n, f, d, false)?;
            b.swiglu_backward(&mut gw.dg, &mut gw.du, &gw.dh, &a.g, &a.u, n * f)?;
            b.matmul_backward_w(&mut g[ly.gate], None, &gw.dg, &a.xn2, n, d, f)?;
            b.matmul_backward_w(&mut g[ly.up], None, &gw.du, &a.xn2, n, d, f)?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.dg, &w[ly.gate], n, d, f, false)?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.du, &w[ly.up], n, d, f, true)?;
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.post_norm],
                &gw.d_xn,
                &ws.resid[2 * l + 1],
                &w[ly.post_norm],
                &a.rstd2,
                n,
                d,
                true,
            )?;
            // Attention.
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.o], None, dres, &a.o, n, qd, d)?;
            b.matmul_backward_x(&mut gw.d_o, dres, &w[ly.o], n, qd, d, false)?;
            let shape = AttnShape {
                tokens: n,
                seqs,
                heads: hh,
                kv_heads: kh,
                head_dim: hd,
            };
            b.attention_backward(
                &mut gw.dq, &mut gw.dk, &mut gw.dv, &gw.d_o, &a.q, &a.k, &a.v, &a.o, &a.lse,
                &ws.cu, shape,
            )?;
            b.rope_backward(&mut gw.dq, &ws.pos, n, hh, hd, theta)?;
            b.rope_backward(&mut gw.dk, &ws.pos, n, kh, hd, theta)?;
            let (dq, dk) = if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
                b.rmsnorm_backward(
                    &mut gw.dq_raw,
                    &mut g[qn],
                    &gw.dq,
                    &a.q_raw,
                    &w[qn],
                    &a.rstd_q,
                    n * hh,
                    hd,
                    false,
                )?;
                b.rmsnorm_backward(
                    &mut gw.dk_raw,
                    &mut g[kn],
                    &gw.dk,
                    &a.k_raw,
                    &w[kn],
                    &a.rstd_k,
                    n * kh,
                    hd,
                    false,
                )?;
                (&gw.dq_raw, &gw.dk_raw)
            } else {
                (&gw.dq, &gw.dk)
            };
            for (p, pb, dy, m, first) in [
                (ly.q, ly.q_b, dq, qd, true),
                (ly.k, ly.k_b, dk, kd, false),
                (ly.v, ly.v_b, &gw.dv, kd, false),
            ] {
                let (gp, gb) = two_mut(g, p, pb);
                b.matmul_backward_w(gp, gb, dy, &a.xn1, n, d, m)?;
                b.matmul_backward_x(&mut gw.d_xn, dy, &w[p], n, d, m, !first)?;
            }
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.in_norm],
                &gw.d_xn,
                &ws.resid[2 * l],
                &w[ly.in_norm],
                &a.rstd1,
                n,
                d,
                true,
            )?;
        }
        b.embedding_backward(&mut g[*embed], &gw.d_resid, &ws.ids, n, d)
    }
}
