//! The decoder's workspace: every activation, gradient scratch and step input buffer, sized for
//! the largest call so far. It grows all at once at the start of a call, never inside the
//! layer loop; each growth bumps `Decoder::ws_epoch` (CUDA graphs read fixed addresses).

use anyhow::Result;

use super::Decoder;
use crate::backend::{Backend, DType};
use crate::model::Config;

/// What the workspace must hold.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Caps {
    pub(super) tokens: usize,
    pub(super) seqs: usize,
    pub(super) rows: usize,
    /// 1 for inference, num_layers for training.
    pub(super) saved_layers: usize,
    pub(super) backward: bool,
    /// The fused projections' outputs (`Work::qkv`, `Work::gu`).
    pub(super) fused: bool,
    /// `Work::lora`'s columns: the LoRA rank, or a stacked group's (0 without adapters).
    pub(super) lora_rank: usize,
}

impl Caps {
    pub(super) fn covers(&self, o: &Caps) -> bool {
        self.tokens >= o.tokens
            && self.seqs >= o.seqs
            && self.rows >= o.rows
            && self.saved_layers >= o.saved_layers
            && (self.backward || !o.backward)
            && (self.fused || !o.fused)
            && self.lora_rank >= o.lora_rank
    }

    pub(super) fn max(&self, o: &Caps) -> Caps {
        Caps {
            tokens: self.tokens.max(o.tokens),
            seqs: self.seqs.max(o.seqs),
            rows: self.rows.max(o.rows),
            saved_layers: self.saved_layers.max(o.saved_layers),
            backward: self.backward || o.backward,
            fused: self.fused || o.fused,
            lora_rank: self.lora_rank.max(o.lora_rank),
        }
    }
}

/// Activations of one layer (training keeps one per layer; inference reuses one).
pub(super) struct Acts<B: Backend> {
    pub(super) xn1: B::Buf,
    pub(super) rstd1: B::Buf,
    pub(super) q_raw: B::Buf,
    pub(super) k_raw: B::Buf,
    pub(super) rstd_q: B::Buf,
    pub(super) rstd_k: B::Buf,
    pub(super) q: B::Buf,
    pub(super) k: B::Buf,
    pub(super) v: B::Buf,
    pub(super) o: B::Buf,
    pub(super) lse: B::Buf,
    pub(super) xn2: B::Buf,
    pub(super) rstd2: B::Buf,
    pub(super) g: B::Buf,
    pub(super) u: B::Buf,
    /// swiglu(g, u), kept for the backward pass when training (empty otherwise).
    pub(super) h: B::Buf,
}

/// Gradient scratch of the backward pass (one set, reused by every layer).
pub(super) struct GradWork<B: Backend> {
    pub(super) d_resid: B::Buf,
    /// d_resid rounded to the compute dtype once for the two GEMMs that read it (empty when
    /// the compute dtype is f32).
    pub(super) d_resid_c: B::Buf,
    pub(super) d_xn: B::Buf,
    pub(super) d_o: B::Buf,
    pub(super) dq: B::Buf,
    pub(super) dk: B::Buf,
    pub(super) dv: B::Buf,
    pub(super) dq_raw: B::Buf,
    pub(super) dk_raw: B::Buf,
    pub(super) dg: B::Buf,
    pub(super) du: B::Buf,
    pub(super) dh: B::Buf,
    pub(super) dxf: B::Buf,
    pub(super) dxg: B::Buf,
    pub(super) dlp: B::Buf,
    pub(super) dent: B::Buf,
    /// Inputs of the device-side PPO loss: old log-probs, advantages, weights (3 per row).
    pub(super) old: B::Buf,
    pub(super) adv: B::Buf,
    pub(super) lw: B::Buf,
    /// Where a frozen norm's weight gradient goes (the op computes one; LoRA reads none).
    pub(super) sink: B::Buf,
}

pub(super) struct Work<B: Backend> {
    pub(super) caps: Caps,
    pub(super) ids: B::Idx,
    pub(super) pos: B::Idx,
    pub(super) cu: B::Idx,
    pub(super) rows: B::Idx,
    pub(super) targets: B::Idx,
    pub(super) kv_rows: B::Idx,
    pub(super) kv_base: B::Idx,
    pub(super) kv_len: B::Idx,
    /// Residual stream: one buffer updated in place (inference) or 2L+1 snapshots (training:
    /// layer l reads `2l`, its attention writes `2l+1`, its MLP writes `2l+2`).
    pub(super) resid: Vec<B::Buf>,
    pub(super) acts: Vec<Acts<B>>,
    /// Outputs of the fused projections of a paged step: [tokens, qd + 2·kd] and
    /// [tokens, 2·intermediate] (empty unless `caps.fused`).
    pub(super) qkv: B::Buf,
    pub(super) gu: B::Buf,
    pub(super) h: B::Buf,
    pub(super) xg: B::Buf,
    pub(super) xf: B::Buf,
    pub(super) rstd_f: B::Buf,
    pub(super) lp: B::Buf,
    pub(super) ent: B::Buf,
    pub(super) lse_lp: B::Buf,
    pub(super) grad: Option<GradWork<B>>,
    /// One chunk of logits for the fused log-prob (`logprob_chunk × vocab`).
    pub(super) scratch: B::Buf,
    /// Logits of a paged step's sampled rows (`rows × vocab`, grown on demand).
    pub(super) logits: B::Buf,
    /// The adapters' two [tokens, rank] intermediates (`decoder::lora`).
    pub(super) lora: [B::Buf; 2],
}

impl<B: Backend> Work<B> {
    /// A workspace that holds nothing yet.
    pub(super) fn empty(b: &B, cfg: &Config) -> Result<Self> {
        Self::new(b, cfg, Caps::default())
    }

    pub(super) fn new(b: &B, d: &Config, c: Caps) -> Result<Self> {
        let (t, n) = (c.tokens, c.rows);
        let (hd, qd, kd, f) = (
            d.hidden_size,
            d.num_heads * d.head_dim,
            d.num_kv_heads * d.head_dim,
            d.intermediate_size,
        );
        let qk = d.qk_norm;
        // Activations and the gradients that only feed GEMMs take the backend's compute dtype;
        // statistics (rstd, lse), log-probs and the gradients that accumulate stay f32.
        let cd = b.compute_dtype();
        let ac = |n: usize| b.alloc_as(n, cd);
        let mut acts = Vec::with_capacity(c.saved_layers);
        for _ in 0..c.saved_layers {
            acts.push(Acts {
                xn1: ac(t * hd)?,
                rstd1: b.alloc(t)?,
                q_raw: ac(if qk { t * qd } else { 0 })?,
                k_raw: ac(if qk { t * kd } else { 0 })?,
                rstd_q: b.alloc(if qk { t * d.num_heads } else { 0 })?,
                rstd_k: b.alloc(if qk { t * d.num_kv_heads } else { 0 })?,
                q: ac(t * qd)?,
                k: ac(t * kd)?,
                v: ac(t * kd)?,
                o: ac(t * qd)?,
                lse: b.alloc(t * d.num_heads)?,
                xn2: ac(t * hd)?,
                rstd2: b.alloc(t)?,
                g: ac(t * f)?,
                u: ac(t * f)?,
                h: ac(if c.backward { t * f } else { 0 })?,
            });
        }
        // Training keeps each block's input: 2 snapshots a layer and the last hidden state.
        // Ask `backward`, not `saved_layers > 1`: a 1-layer model trains with saved_layers 1.
        let n_resid = if c.backward {
            2 * c.saved_layers + 1
        } else {
            1
        };
        // The residual stream stays f32 whatever the compute dtype (as under torch autocast):
        // rounding it to bf16 after every block was over a third of the bf16 log-prob error
        // (docs/BENCHMARKS.md, "Where the bf16 log-prob error comes from").
        let mut resid = Vec::with_capacity(n_resid);
        for _ in 0..n_resid {
            resid.push(b.alloc(t * hd)?);
        }
        let grad = if c.backward {
            Some(GradWork {
                d_resid: b.alloc(t * hd)?,
                d_resid_c: ac(if cd == DType::F32 { 0 } else { t * hd })?,
                d_xn: b.alloc(t * hd)?,
                d_o: ac(t * qd)?,
                dq: ac(t * qd)?,
                dk: ac(t * kd)?,
                dv: ac(t * kd)?,
                dq_raw: ac(if qk { t * qd } else { 0 })?,
                dk_raw: ac(if qk { t * kd } else { 0 })?,
                dg: ac(t * f)?,
                du: ac(t * f)?,
                dh: ac(t * f)?,
                dxf: b.alloc(n * hd)?,
                dxg: b.alloc(n * hd)?,
                dlp: b.alloc(n)?,
                dent: b.alloc(n)?,
                old: b.alloc(n)?,
                adv: b.alloc(n)?,
                lw: b.alloc(3 * n)?,
                sink: b.alloc(if c.lora_rank > 0 {
                    hd.max(d.head_dim)
                } else {
                    0
                })?,
            })
        } else {
            None
        };
        Ok(Work {
            caps: c,
            ids: b.alloc_idx(t)?,
            pos: b.alloc_idx(t)?,
            cu: b.alloc_idx(c.seqs + 1)?,
            rows: b.alloc_idx(n)?,
            targets: b.alloc_idx(n)?,
            kv_rows: b.alloc_idx(t)?,
            kv_base: b.alloc_idx(t)?,
            kv_len: b.alloc_idx(t)?,
            resid,
            acts,
            qkv: ac(if c.fused { t * (qd + 2 * kd) } else { 0 })?,
            gu: ac(if c.fused { t * 2 * f } else { 0 })?,
            h: ac(t * f)?,
            xg: ac(n * hd)?,
            xf: ac(n * hd)?,
            rstd_f: b.alloc(n)?,
            lp: b.alloc(n)?,
            ent: b.alloc(n)?,
            lse_lp: b.alloc(n)?,
            grad,
            scratch: b.alloc(0)?,
            logits: b.alloc(0)?,
            lora: [ac(t * c.lora_rank)?, ac(t * c.lora_rank)?],
        })
    }
}

impl<B: Backend> Decoder<B> {
    /// What a paged step of `tokens` tokens and `rows` output rows needs.
    pub(super) fn step_caps(&self, tokens: usize, rows: usize) -> Caps {
        Caps {
            tokens,
            seqs: 1,
            rows,
            saved_layers: 1,
            backward: false,
            fused: self.fuses(),
            lora_rank: self.lora.as_ref().map_or(0, |l| l.cols()),
        }
    }

    /// The adapters' rank, 0 without LoRA.
    pub(super) fn lora_rank(&self) -> usize {
        self.lora.as_ref().map_or(0, |l| l.spec.rank)
    }

    /// Grows the workspace (all at once, before any layer runs) so it covers `need`.
    pub(super) fn reserve(&mut self, need: Caps) -> Result<()> {
        if !self.ws.caps.covers(&need) {
            let caps = self.ws.caps.max(&need);
            // Drop the old workspace first so peak memory is one workspace, not two.
            self.ws = Work::empty(&self.backend, &self.cfg)?;
            self.ws = Work::new(&self.backend, &self.cfg, caps)?;
            self.ws_epoch += 1;
        }
        Ok(())
    }

    /// Frees the activation workspace (it grows back on the next call): what a colocated
    /// engine does between phases, e.g. after an update and before generation.
    pub fn release_workspace(&mut self) -> Result<()> {
        self.ws = Work::empty(&self.backend, &self.cfg)?;
        self.ws_epoch += 1;
        Ok(())
    }

    /// Grows the f32 logits buffer to `n` values (the old one freed first, so the peak is
    /// one buffer); a reallocation bumps `ws_epoch`.
    pub(super) fn grow_logits(&mut self, n: usize) -> Result<()> {
        if self.backend.len(&self.ws.logits) < n {
            self.ws.logits = self.backend.alloc(0)?;
            self.ws.logits = self.backend.alloc(n)?;
            self.ws_epoch += 1;
        }
        Ok(())
    }
}
