//! Training passes: forward with every layer's activations kept, the loss's gradients with
//! respect to the log-probs (a host callback, or the PPO-clip loss on the device), and the
//! backward pass that adds the parameter gradients up across micro-batches.

use anyhow::{ensure, Result};

use super::forward::LayerShapes;
use super::hooks::{NoHooks, Pass, Unit, UnitHooks};
use super::lora::{self, Adapt};
use super::workspace::{GradWork, Work};
use super::{
    check_temperature, two_mut, Decoder, Layer, PpoTokens, SeqRef, TokenGrads, TokenStats,
};
use crate::backend::{
    AttnOut, Backend, DType, LogprobGrad, LogprobInput, LogprobShape, PpoInputs, PpoShape, Qkv,
    RmsNormSaved, RmsNormShape, PPO_STATS,
};
use crate::model::lora::Target;
use crate::model::Config;

impl<B: Backend> Decoder<B> {
    /// The gradient buffers, after `release_grads` left none: whole f32 ones, or where the
    /// hooks hold the units (`Decoder::hold_per_unit`) empty ones, which the hooks make for
    /// each unit's backward and take away after (whole ones there would hold 4 bytes a
    /// parameter for nothing).
    pub(crate) fn ensure_grads(&mut self) -> Result<()> {
        if self.g.is_empty() {
            for (s, &trains) in self.shapes.iter().zip(&self.trains) {
                let n = if self.per_unit || !trains {
                    0
                } else {
                    s.iter().product()
                };
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
        self.forward_backward_with(seqs, temperature, loss, &mut NoHooks)
    }

    /// [`Decoder::forward_backward`] telling `hooks` of each unit (see [`UnitHooks`]); with no
    /// sequences the hooks of a pass over none are called all the same, and with no scored
    /// token those of the backward on no gradients.
    pub fn forward_backward_with(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads()?;
        if seqs.is_empty() {
            return self.idle_pass(hooks, true);
        }
        let (n, r) = self.pack(seqs, true)?;
        let last = self.forward_to_head(n, seqs.len(), true, hooks)?;
        let stats = self.score_rows(last, seqs, r, temperature, true)?;
        let grads = loss(&stats)?;
        ensure!(
            grads.len() == seqs.len(),
            "loss callback returned gradients for {} sequences, expected {}",
            grads.len(),
            seqs.len()
        );
        let (dlp, dent) = concat_grads(&grads, &stats, r)?;
        if r == 0 {
            // Nothing scored: the loss does not depend on the weights.
            return self.idle_backward(hooks);
        }
        {
            let gw = self.ws.grad.as_mut().expect("training workspace");
            self.backend.upload(&mut gw.dlp, &dlp)?;
            if let Some(dent) = &dent {
                self.backend.upload(&mut gw.dent, dent)?;
            }
        }
        self.backward(n, seqs.len(), r, temperature, dent.is_some(), hooks)
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
        self.forward_backward_ppo_with(seqs, temperature, tok, clip, logprobs, &mut NoHooks)
    }

    /// [`Decoder::forward_backward_ppo`] telling `hooks` of each unit (as
    /// [`Decoder::forward_backward_with`]).
    pub fn forward_backward_ppo_with(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tok: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        ensure!(
            !self.cfg.value_head,
            "the PPO-clip loss trains a policy, not a value model"
        );
        self.ensure_grads()?;
        if seqs.is_empty() {
            return self.idle_pass(hooks, true);
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
        let last = self.forward_to_head(n, seqs.len(), true, hooks)?;
        if r == 0 {
            return self.idle_backward(hooks);
        }
        self.score_device(last, r, temperature, true)?;
        if let Some(out) = logprobs {
            out.resize(r, 0.0);
            self.backend.download(&self.ws.lp, out)?;
        }
        self.ppo_loss(tok, clip, r)?;
        self.backward(n, seqs.len(), r, temperature, tok.dentropy.is_some(), hooks)
    }

    /// dL/dlp of the PPO-clip loss on the device, from the `r` scored tokens' log-probs of the
    /// forward, its metrics added to `ppo_stats`.
    fn ppo_loss(&mut self, tok: &PpoTokens, clip: PpoShape, r: usize) -> Result<()> {
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
        )
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
    /// telling `hooks` before each unit's backward, when its gradients are added and after
    /// (the head's weights are there from its forward).
    fn backward(
        &mut self,
        n: usize,
        seqs: usize,
        r: usize,
        temperature: f32,
        dent: bool,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<()> {
        hooks.before(Unit::Head, Pass::Backward, self.unit_bufs())?;
        self.head_backward(r, temperature, dent)?;
        hooks.grads_ready(Unit::Head, self.unit_bufs())?;
        hooks.after(Unit::Head, Pass::Backward, self.unit_bufs())?;
        let d = self.cfg.hidden_size;
        let (b, ws) = (&self.backend, &mut self.ws);
        let gw = ws.grad.as_mut().expect("training workspace");
        b.fill(&mut gw.d_resid, n * d, 0.0)?;
        b.scatter_add_rows(&mut gw.d_resid, &gw.dxg, &ws.rows, r, d)?;
        let ls = LayerShapes::new(&self.cfg, n);
        let lowp = self.backend.compute_dtype() != DType::F32;
        for l in (0..self.layers.len()).rev() {
            hooks.before(Unit::Layer(l), Pass::Backward, self.unit_bufs())?;
            let adapt = lora::view(&self.backend, &self.w, self.lora.as_ref(), n);
            let run = LayerBack {
                lora: adapt.as_ref(),
                b: &self.backend,
                cfg: &self.cfg,
                w: &self.w,
                ly: &self.layers[l],
                ls,
                n,
                l,
                seqs,
                lowp,
                trains: &self.trains,
            };
            run.backward(&mut self.g, &mut self.ws)?;
            hooks.grads_ready(Unit::Layer(l), self.unit_bufs())?;
            hooks.after(Unit::Layer(l), Pass::Backward, self.unit_bufs())?;
        }
        hooks.before(Unit::Embed, Pass::Backward, self.unit_bufs())?;
        let (b, ws) = (&self.backend, &self.ws);
        let gw = ws.grad.as_ref().expect("training workspace");
        if self.trains[self.embed] {
            b.embedding_backward(&mut self.g[self.embed], &gw.d_resid, &ws.ids, n, d)?;
        }
        hooks.grads_ready(Unit::Embed, self.unit_bufs())?;
        hooks.after(Unit::Embed, Pass::Backward, self.unit_bufs())
    }

    /// The head's backward over the `r` scored rows: the fused log-prob's (dxf, and the LM
    /// head's gradient) or the value head's, then the final norm's (dxg).
    fn head_backward(&mut self, r: usize, temperature: f32, dent: bool) -> Result<()> {
        match self.cfg.value_head {
            true => self.value_head_backward(r)?,
            false => self.logprob_head_backward(r, temperature, dent)?,
        }
        let Decoder {
            backend: b,
            cfg,
            w,
            g,
            ws,
            final_norm,
            trains,
            ..
        } = self;
        let gw = ws.grad.as_mut().expect("training workspace");
        b.rmsnorm_backward(
            &mut gw.dxg,
            grad_or_sink::<B>(g, &mut gw.sink, trains, *final_norm),
            &gw.dxf,
            RmsNormSaved {
                x: &ws.xg,
                w: &w[*final_norm],
                rstd: &ws.rstd_f,
            },
            RmsNormShape {
                rows: r,
                dim: cfg.hidden_size,
                eps: cfg.rms_norm_eps,
            },
            false,
        )
    }

    /// The fused log-prob's backward over the `r` scored rows: dxf, and the LM head's
    /// gradient.
    fn logprob_head_backward(&mut self, r: usize, temperature: f32, dent: bool) -> Result<()> {
        let chunk = self.chunk_rows(r);
        let Decoder {
            backend: b,
            cfg,
            w,
            g,
            ws,
            head,
            trains,
            ..
        } = self;
        let gw = ws.grad.as_mut().expect("training workspace");
        let shape = LogprobShape {
            rows: r,
            hidden: cfg.hidden_size,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        b.logprob_backward(
            &mut gw.dxf,
            trains[*head].then_some(&mut g[*head]),
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
        )
    }
}

/// The loss callback's per-sequence gradients laid end to end over the `r` scored tokens:
/// (dL/dlogprob, dL/dentropy where any sequence has one, zeros for the others).
fn concat_grads(
    grads: &[TokenGrads],
    stats: &[TokenStats],
    r: usize,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let mut dlp = Vec::with_capacity(r);
    let mut dent = Vec::with_capacity(r);
    let mut any_dent = false;
    for (s, (gr, st)) in grads.iter().zip(stats).enumerate() {
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
    Ok((dlp, any_dent.then_some(dent)))
}

/// Parameter `i`'s gradient buffer, or `sink` where it is frozen (an op that always computes
/// a weight gradient writes it there, and nothing reads it).
fn grad_or_sink<'a, B: Backend>(
    g: &'a mut [B::Buf],
    sink: &'a mut B::Buf,
    trains: &[bool],
    i: usize,
) -> &'a mut B::Buf {
    match trains[i] {
        true => &mut g[i],
        false => sink,
    }
}

/// One layer's backward: what it reads besides the gradients and the workspace.
struct LayerBack<'a, B: Backend> {
    /// The adapters, under LoRA (the base is frozen then: no weight gradient of its own).
    lora: Option<&'a Adapt<'a, B>>,
    trains: &'a [bool],
    b: &'a B,
    cfg: &'a Config,
    w: &'a [B::Buf],
    ly: &'a Layer,
    ls: LayerShapes,
    n: usize,
    l: usize,
    seqs: usize,
    /// The compute dtype is not f32: the residual's gradient is rounded to it for the GEMMs.
    lowp: bool,
}

impl<B: Backend> LayerBack<'_, B> {
    /// The MLP's, the attention's and the projections' backward, adding into `g` and leaving
    /// the residual's gradient at the layer's input in `ws`'s `d_resid`.
    fn backward(&self, g: &mut [B::Buf], ws: &mut Work<B>) -> Result<()> {
        self.mlp(g, ws)?;
        self.attention(g, ws)?;
        self.qkv(g, ws)
    }

    /// (hidden, intermediate, q features, k/v features).
    fn dims(&self) -> (usize, usize, usize, usize) {
        let c = self.cfg;
        let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        (c.hidden_size, c.intermediate_size, qd, kd)
    }

    /// dw (and db) += of projection `t`, weight `p` and bias `pb`, where it trains (a frozen
    /// base skips the GEMM).
    fn weight_grad(
        &self,
        g: &mut [B::Buf],
        (t, p, pb): (Target, usize, Option<usize>),
        dy: &B::Buf,
        x: &B::Buf,
    ) -> Result<()> {
        if !self.trains[p] {
            return Ok(());
        }
        let (k, out) = t.dims(self.cfg);
        let (gp, gb) = two_mut(g, p, pb);
        self.b
            .matmul_backward_w(gp, gb, dy, x, self.ls.gemm(k, out))
    }

    /// The adapter on `t`'s backward, where the layer has one: its gradients, dx += its part.
    fn adapt(
        &self,
        t: Target,
        g: &mut [B::Buf],
        dx: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        s: &mut [B::Buf; 2],
    ) -> Result<()> {
        match (self.lora, self.ly.lora[lora::slot(t)]) {
            (Some(ad), Some(ab)) => ad.backward(lora::Pair::of(ab, t, self.cfg), g, dx, dy, x, s),
            _ => Ok(()),
        }
    }

    /// The residual's gradient as the GEMMs read it: rounded to the compute dtype once (into
    /// `d_resid_c`) where that is not f32.
    fn round_resid_grad(&self, gw: &mut GradWork<B>) -> Result<()> {
        match self.lowp {
            true => {
                let n = self.n * self.cfg.hidden_size;
                self.b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n)
            }
            false => Ok(()),
        }
    }

    /// The MLP block (h kept from the forward pass) and its norm.
    fn mlp(&self, g: &mut [B::Buf], ws: &mut Work<B>) -> Result<()> {
        let (b, w, ly, ls) = (self.b, self.w, self.ly, self.ls);
        let (d, f, _, _) = self.dims();
        let a = &ws.acts[self.l];
        let gw = ws.grad.as_mut().expect("training workspace");
        self.round_resid_grad(gw)?;
        let dres = if self.lowp {
            &gw.d_resid_c
        } else {
            &gw.d_resid
        };
        let s = &mut ws.lora;
        self.weight_grad(g, (Target::Down, ly.down, None), dres, &a.h)?;
        b.matmul_backward_x(&mut gw.dh, dres, &w[ly.down], ls.gemm(f, d), false)?;
        self.adapt(Target::Down, g, &mut gw.dh, dres, &a.h, s)?;
        let n = self.n;
        b.swiglu_backward(&mut gw.dg, &mut gw.du, &gw.dh, &a.g, &a.u, n * f)?;
        self.weight_grad(g, (Target::Gate, ly.gate, None), &gw.dg, &a.xn2)?;
        self.weight_grad(g, (Target::Up, ly.up, None), &gw.du, &a.xn2)?;
        b.matmul_backward_x(&mut gw.d_xn, &gw.dg, &w[ly.gate], ls.gemm(d, f), false)?;
        b.matmul_backward_x(&mut gw.d_xn, &gw.du, &w[ly.up], ls.gemm(d, f), true)?;
        self.adapt(Target::Gate, g, &mut gw.d_xn, &gw.dg, &a.xn2, s)?;
        self.adapt(Target::Up, g, &mut gw.d_xn, &gw.du, &a.xn2, s)?;
        let saved = RmsNormSaved {
            x: &ws.resid[2 * self.l + 1],
            w: &w[ly.post_norm],
            rstd: &a.rstd2,
        };
        let gn = grad_or_sink::<B>(g, &mut gw.sink, self.trains, ly.post_norm);
        b.rmsnorm_backward(&mut gw.d_resid, gn, &gw.d_xn, saved, ls.norm, true)
    }

    /// The output projection, the attention and the rope: dq, dk, dv in the workspace.
    fn attention(&self, g: &mut [B::Buf], ws: &mut Work<B>) -> Result<()> {
        let (b, w, ly, ls) = (self.b, self.w, self.ly, self.ls);
        let (d, _, qd, _) = self.dims();
        let a = &ws.acts[self.l];
        let gw = ws.grad.as_mut().expect("training workspace");
        self.round_resid_grad(gw)?;
        let dres = if self.lowp {
            &gw.d_resid_c
        } else {
            &gw.d_resid
        };
        self.weight_grad(g, (Target::O, ly.o, None), dres, &a.o)?;
        b.matmul_backward_x(&mut gw.d_o, dres, &w[ly.o], ls.gemm(qd, d), false)?;
        self.adapt(Target::O, g, &mut gw.d_o, dres, &a.o, &mut ws.lora)?;
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
            ls.attn(self.seqs),
        )?;
        b.rope_backward(&mut gw.dq, &ws.pos, ls.rope.q())?;
        b.rope_backward(&mut gw.dk, &ws.pos, ls.rope.k())
    }

    /// Qwen3's q/k norms, the q/k/v projections (and biases) and the input norm.
    fn qkv(&self, g: &mut [B::Buf], ws: &mut Work<B>) -> Result<()> {
        let (b, w, ly, ls) = (self.b, self.w, self.ly, self.ls);
        let (d, _, qd, kd) = self.dims();
        let a = &ws.acts[self.l];
        let gw = ws.grad.as_mut().expect("training workspace");
        let (dq, dk) = if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
            let saved = RmsNormSaved {
                x: &a.q_raw,
                w: &w[qn],
                rstd: &a.rstd_q,
            };
            let gq = grad_or_sink::<B>(g, &mut gw.sink, self.trains, qn);
            b.rmsnorm_backward(&mut gw.dq_raw, gq, &gw.dq, saved, ls.q_norm, false)?;
            let saved = RmsNormSaved {
                x: &a.k_raw,
                w: &w[kn],
                rstd: &a.rstd_k,
            };
            let gk = grad_or_sink::<B>(g, &mut gw.sink, self.trains, kn);
            b.rmsnorm_backward(&mut gw.dk_raw, gk, &gw.dk, saved, ls.k_norm, false)?;
            (&gw.dq_raw, &gw.dk_raw)
        } else {
            (&gw.dq, &gw.dk)
        };
        for (t, p, pb, dy, m, first) in [
            (Target::Q, ly.q, ly.q_b, dq, qd, true),
            (Target::K, ly.k, ly.k_b, dk, kd, false),
            (Target::V, ly.v, ly.v_b, &gw.dv, kd, false),
        ] {
            self.weight_grad(g, (t, p, pb), dy, &a.xn1)?;
            b.matmul_backward_x(&mut gw.d_xn, dy, &w[p], ls.gemm(d, m), !first)?;
        }
        for (t, dy) in [(Target::Q, dq), (Target::K, dk), (Target::V, &gw.dv)] {
            self.adapt(t, g, &mut gw.d_xn, dy, &a.xn1, &mut ws.lora)?;
        }
        let saved = RmsNormSaved {
            x: &ws.resid[2 * self.l],
            w: &w[ly.in_norm],
            rstd: &a.rstd1,
        };
        let gn = grad_or_sink::<B>(g, &mut gw.sink, self.trains, ly.in_norm);
        b.rmsnorm_backward(&mut gw.d_resid, gn, &gw.d_xn, saved, ls.norm, true)
    }
}
