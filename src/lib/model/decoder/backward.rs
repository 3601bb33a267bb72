//! Training passes: forward with every layer's activations kept, the loss's gradients with
//! respect to the log-probs (a host callback, or the PPO-clip loss on the device), and the
//! backward pass that adds the parameter gradients up across micro-batches.

use anyhow::{ensure, Result};

use super::forward::{AttnMode, LayerShapes};
use super::shard::{PassComm, Unit};
use super::{check_temperature, two_mut, Decoder, PpoTokens, SeqRef, TokenGrads, TokenStats};
use crate::backend::{
    AttnOut, Backend, DType, LogprobGrad, LogprobInput, LogprobShape, PpoInputs, PpoShape, Qkv,
    RmsNormSaved, RmsNormShape, PPO_STATS,
};

impl<B: Backend> Decoder<B> {
    /// The gradient buffers, after `release_grads` left none: whole f32 ones, or under full
    /// sharding (`per_unit`) empty ones, which each unit's backward fills and its
    /// reduce-scatter frees (whole ones there would hold 4 bytes a parameter for nothing).
    pub(super) fn ensure_grads(&mut self, per_unit: bool) -> Result<()> {
        if self.g.is_empty() {
            for s in &self.shapes {
                let n = if per_unit { 0 } else { s.iter().product() };
                self.g.push(self.backend.alloc(n)?);
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
        self.forward_backward_with(seqs, temperature, loss, PassComm::Local)
    }

    /// [`Decoder::forward_backward`] with `comm`'s communication (see [`PassComm`]): under
    /// full sharding the gradients go to the rank's gradient shards, and every rank calls it
    /// the same number of times (with no sequences where it has none); as zero2's last pass
    /// of a step its backward starts each bucket's reduce-scatter as soon as the bucket's
    /// gradients are final (a pass with no backward starts none).
    pub fn forward_backward_with(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
        mut comm: PassComm<B>,
    ) -> Result<()> {
        self.forward_backward_in(seqs, temperature, loss, &mut comm)?;
        comm.finish()
    }

    fn forward_backward_in(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
        comm: &mut PassComm<B>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads(comm.hold().is_some())?;
        if seqs.is_empty() {
            if let Some(h) = comm.hold() {
                h.idle(&self.backend, &mut self.w, &mut self.g, true)?;
            }
            return Ok(());
        }
        let (n, r) = self.pack(seqs, true)?;
        let last = self.forward_in(n, seqs.len(), true, AttnMode::Packed, comm.hold())?;
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
            if let Some(h) = comm.hold() {
                h.skip_backward(&self.backend, &mut self.w, &mut self.g)?;
            }
            return Ok(());
        }
        {
            let gw = self.ws.grad.as_mut().expect("training workspace");
            self.backend.upload(&mut gw.dlp, &dlp)?;
            if any_dent {
                self.backend.upload(&mut gw.dent, &dent)?;
            }
        }
        self.backward(n, seqs.len(), r, temperature, any_dent, comm)
    }

    /// Forward, the PPO-clip loss on the device ([`crate::backend::PpoLossOps::ppo_clip_loss`], knobs in `clip`;
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
        self.forward_backward_ppo_with(seqs, temperature, tok, clip, logprobs, PassComm::Local)
    }

    /// [`Decoder::forward_backward_ppo`] with `comm`'s communication (see
    /// [`Decoder::forward_backward_with`]).
    pub fn forward_backward_ppo_with(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tok: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
        mut comm: PassComm<B>,
    ) -> Result<()> {
        self.forward_backward_ppo_in(seqs, temperature, tok, clip, logprobs, &mut comm)?;
        comm.finish()
    }

    fn forward_backward_ppo_in(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tok: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
        comm: &mut PassComm<B>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads(comm.hold().is_some())?;
        if seqs.is_empty() {
            if let Some(h) = comm.hold() {
                h.idle(&self.backend, &mut self.w, &mut self.g, true)?;
            }
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
        let last = self.forward_in(n, seqs.len(), true, AttnMode::Packed, comm.hold())?;
        if r == 0 {
            if let Some(h) = comm.hold() {
                h.skip_backward(&self.backend, &mut self.w, &mut self.g)?;
            }
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
            PpoInputs {
                lp: &ws.lp,
                old: tok.old.map(|_| &gw.old),
                adv: &gw.adv,
                w: &gw.lw,
                ent: Some(&ws.ent),
            },
            PpoShape { tokens: r, ..clip },
        )?;
        self.backward(n, seqs.len(), r, temperature, tok.dentropy.is_some(), comm)
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

    /// Backward from dL/dlp (and dL/dentropy when `dent`) already in the gradient workspace,
    /// with `comm`'s hooks around each unit's backward ([`PassComm::before_backward`],
    /// [`PassComm::after_backward`]; under full sharding the head is gathered already).
    fn backward(
        &mut self,
        n: usize,
        seqs: usize,
        r: usize,
        temperature: f32,
        dent: bool,
        comm: &mut PassComm<B>,
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
        let (qd, kd) = (hh * hd, kh * hd);
        let ls = LayerShapes::new(cfg, n);
        let shape = LogprobShape {
            rows: r,
            hidden: d,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        comm.before_backward(b, w, g, Unit::Head)?;
        b.logprob_backward(
            &mut gw.dxf,
            &mut g[*head],
            LogprobInput {
                x: &ws.xf,
                w: &w[*head],
                targets: &ws.targets,
            },
            LogprobGrad {
                dlp: &gw.dlp,
                dent: dent.then_some(&gw.dent),
                lse: &ws.lse_lp,
                ent: &ws.ent,
            },
            shape,
            &mut ws.scratch,
        )?;
        b.rmsnorm_backward(
            &mut gw.dxg,
            &mut g[*final_norm],
            &gw.dxf,
            RmsNormSaved {
                x: &ws.xg,
                w: &w[*final_norm],
                rstd: &ws.rstd_f,
            },
            RmsNormShape { rows: r, ..ls.norm },
            false,
        )?;
        comm.after_backward(b, w, g, Unit::Head)?;
        b.fill(&mut gw.d_resid, n * d, 0.0)?;
        b.scatter_add_rows(&mut gw.d_resid, &gw.dxg, &ws.rows, r, d)?;
        let lowp = b.compute_dtype() != DType::F32;
        for (l, ly) in layers.iter().enumerate().rev() {
            comm.before_backward(b, w, g, Unit::Layer(l))?;
            let a = &ws.acts[l];
            // MLP (h kept from the forward pass).
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.down], None, dres, &a.h, ls.gemm(f, d))?;
            b.matmul_backward_x(&mut gw.dh, dres, &w[ly.down], ls.gemm(f, d), false)?;
            b.swiglu_backward(&mut gw.dg, &mut gw.du, &gw.dh, &a.g, &a.u, n * f)?;
            b.matmul_backward_w(&mut g[ly.gate], None, &gw.dg, &a.xn2, ls.gemm(d, f))?;
            b.matmul_backward_w(&mut g[ly.up], None, &gw.du, &a.xn2, ls.gemm(d, f))?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.dg, &w[ly.gate], ls.gemm(d, f), false)?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.du, &w[ly.up], ls.gemm(d, f), true)?;
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.post_norm],
                &gw.d_xn,
                RmsNormSaved {
                    x: &ws.resid[2 * l + 1],
                    w: &w[ly.post_norm],
                    rstd: &a.rstd2,
                },
                ls.norm,
                true,
            )?;
            // Attention.
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.o], None, dres, &a.o, ls.gemm(qd, d))?;
            b.matmul_backward_x(&mut gw.d_o, dres, &w[ly.o], ls.gemm(qd, d), false)?;
            b.attention_backward(
                Qkv {
                    q: &mut gw.dq,
                    k: &mut gw.dk,
                    v: &mut gw.dv,
                },
                &gw.d_o,
                Qkv {
                    q: &a.q,
                    k: &a.k,
                    v: &a.v,
                },
                AttnOut {
                    o: &a.o,
                    lse: &a.lse,
                },
                &ws.cu,
                ls.attn(seqs),
            )?;
            b.rope_backward(&mut gw.dq, &ws.pos, ls.rope.q())?;
            b.rope_backward(&mut gw.dk, &ws.pos, ls.rope.k())?;
            let (dq, dk) = if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
                b.rmsnorm_backward(
                    &mut gw.dq_raw,
                    &mut g[qn],
                    &gw.dq,
                    RmsNormSaved {
                        x: &a.q_raw,
                        w: &w[qn],
                        rstd: &a.rstd_q,
                    },
                    ls.q_norm,
                    false,
                )?;
                b.rmsnorm_backward(
                    &mut gw.dk_raw,
                    &mut g[kn],
                    &gw.dk,
                    RmsNormSaved {
                        x: &a.k_raw,
                        w: &w[kn],
                        rstd: &a.rstd_k,
                    },
                    ls.k_norm,
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
                b.matmul_backward_w(gp, gb, dy, &a.xn1, ls.gemm(d, m))?;
                b.matmul_backward_x(&mut gw.d_xn, dy, &w[p], ls.gemm(d, m), !first)?;
            }
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.in_norm],
                &gw.d_xn,
                RmsNormSaved {
                    x: &ws.resid[2 * l],
                    w: &w[ly.in_norm],
                    rstd: &a.rstd1,
                },
                ls.norm,
                true,
            )?;
            comm.after_backward(b, w, g, Unit::Layer(l))?;
        }
        comm.before_backward(b, w, g, Unit::Embed)?;
        b.embedding_backward(&mut g[*embed], &gw.d_resid, &ws.ids, n, d)?;
        comm.after_backward(b, w, g, Unit::Embed)
    }
}
