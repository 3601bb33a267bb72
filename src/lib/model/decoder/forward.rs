//! The forward pass: sequences packed for scoring and training, the layer loop shared with
//! paged steps, and scoring (`logprobs`).

use anyhow::{bail, ensure, Result};

use super::attn::{AttnMode, PagedAttn};
use super::hooks::{NoHooks, Pass, Unit, UnitHooks};
use super::lora::{self, Adapt, Stacked};
use super::workspace::{Acts, Caps, Work};
use super::{check_temperature, pair, Decoder, Layer, SeqRef, TokenStats};
use crate::backend::{
    AttnOut, AttnShape, Backend, BlockTables, KvCache, MatmulShape, PackedQkv, PagedAttnShape,
    PagedRopeShape, PrefillTiles, Qkv, RmsNormShape, RopeKvShape, Slots,
};
use crate::error::input_error;
use crate::model::lora::Target;
use crate::model::Config;

/// The shapes of a layer's ops over `n` rows (the forward and backward passes share them).
#[derive(Clone, Copy, Debug)]
pub(super) struct LayerShapes {
    /// The pre-attention and pre-MLP norms, and the q/k norms (per head).
    pub norm: RmsNormShape,
    pub q_norm: RmsNormShape,
    pub k_norm: RmsNormShape,
    /// The rotation of the queries and keys.
    pub rope: RopeKvShape,
    n: usize,
}

impl LayerShapes {
    pub fn new(cfg: &Config, n: usize) -> Self {
        let (hh, kh, hd, eps) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
        );
        let norm = |rows, dim| RmsNormShape { rows, dim, eps };
        LayerShapes {
            norm: norm(n, cfg.hidden_size),
            q_norm: norm(n * hh, hd),
            k_norm: norm(n * kh, hd),
            rope: RopeKvShape {
                tokens: n,
                heads: hh,
                kv_heads: kh,
                head_dim: hd,
                theta: cfg.rope_theta,
            },
            n,
        }
    }

    /// A projection of the n rows from `k` to `out` features.
    pub fn gemm(&self, k: usize, out: usize) -> MatmulShape {
        MatmulShape {
            m: self.n,
            k,
            n: out,
        }
    }

    /// Packed attention of the n rows in `seqs` sequences.
    pub fn attn(&self, seqs: usize) -> AttnShape {
        let r = self.rope;
        AttnShape {
            tokens: self.n,
            seqs,
            heads: r.heads,
            kv_heads: r.kv_heads,
            head_dim: r.head_dim,
        }
    }
}

impl<B: Backend> Decoder<B> {
    /// Packs `seqs` and uploads ids, positions, offsets, scored rows and targets. Returns
    /// (tokens, scored rows).
    pub(super) fn pack(&mut self, seqs: &[SeqRef], train: bool) -> Result<(usize, usize)> {
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        let mut cu = vec![0u32];
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        for (s, seq) in seqs.iter().enumerate() {
            if seq.start == 0 || seq.start > seq.tokens.len() {
                bail!(input_error(format!(
                    "sequence {s}: scoring starts at {} but must be in 1..={} (its length)",
                    seq.start,
                    seq.tokens.len()
                )));
            }
            self.check_tokens(seq.tokens, &format!("sequence {s}"))?;
            let off = ids.len() as u32;
            for (t, &id) in seq.tokens.iter().enumerate() {
                ids.push(id);
                pos.push(t as u32);
            }
            for t in seq.start..seq.tokens.len() {
                rows.push(off + t as u32 - 1);
                targets.push(seq.tokens[t]);
            }
            cu.push(ids.len() as u32);
        }
        let (n, r) = (ids.len(), rows.len());
        self.reserve(Caps {
            tokens: n,
            seqs: seqs.len(),
            rows: r,
            saved_layers: if train { self.cfg.num_layers.max(1) } else { 1 },
            backward: train,
            fused: false,
            lora_rank: self.lora_rank(),
        })?;
        if r > 0 {
            self.reserve_logprob_scratch()?;
        }
        let (b, ws) = (&self.backend, &mut self.ws);
        b.upload_idx(&mut ws.ids, &ids)?;
        b.upload_idx(&mut ws.pos, &pos)?;
        b.upload_idx(&mut ws.cu, &cu)?;
        b.upload_idx(&mut ws.rows, &rows)?;
        b.upload_idx(&mut ws.targets, &targets)?;
        Ok((n, r))
    }

    /// Log-probs (and optionally entropies) of every scored token of every sequence, under
    /// softmax(logits / temperature). The sequences are packed into one pass; the caller
    /// bounds its size (micro-batches by token budget).
    pub fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        self.logprobs_with(seqs, temperature, entropy, &mut NoHooks)
    }

    /// [`Decoder::logprobs`] telling `hooks` of each unit (see [`UnitHooks`]); with no
    /// sequences the hooks of a pass over none are called all the same (a rank of a sharded
    /// group with no rows keeps its collectives in step with the others').
    pub fn logprobs_with(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<Vec<TokenStats>> {
        check_temperature(temperature)?;
        if seqs.is_empty() {
            self.idle_pass(hooks, false)?;
            return Ok(Vec::new());
        }
        let (n, r) = self.pack(seqs, false)?;
        let last = self.forward_to_head(n, seqs.len(), false, hooks)?;
        let stats = self.score_rows(last, seqs, r, temperature, entropy)?;
        hooks.after(Unit::Head, Pass::Forward, self.unit_bufs())?;
        Ok(stats)
    }

    /// Embedding and every layer for `n` tokens whose ids/positions (and offsets or cache rows)
    /// are uploaded. `train` keeps each layer's activations. Returns the index of the residual
    /// buffer that holds the last hidden state.
    pub(super) fn forward(
        &mut self,
        n: usize,
        seqs: usize,
        train: bool,
        mode: AttnMode<B>,
    ) -> Result<usize> {
        self.forward_in(n, seqs, train, mode, &mut NoHooks)
    }

    /// The packed forward of `n` tokens in `seqs` sequences with `hooks`, up to the head's
    /// `before` (its weights there for the scoring that follows).
    pub(super) fn forward_to_head(
        &mut self,
        n: usize,
        seqs: usize,
        train: bool,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<usize> {
        let last = self.forward_in(n, seqs, train, AttnMode::Packed, hooks)?;
        hooks.before(Unit::Head, Pass::Forward, self.unit_bufs())?;
        Ok(last)
    }

    /// [`Decoder::forward`] telling `hooks` before and after each unit (the embedding and the
    /// layers; the head is the caller's).
    fn forward_in(
        &mut self,
        n: usize,
        seqs: usize,
        train: bool,
        mut mode: AttnMode<B>,
        hooks: &mut dyn UnitHooks<B>,
    ) -> Result<usize> {
        // The rollout engine's (paged) steps run the fused projections; training
        // and scoring (packed) keep the split GEMMs, so `update` and `ref-logprob` agree.
        let fuse = self.fuses() && !matches!(mode, AttnMode::Packed);
        ensure!(
            !fuse || self.ws.caps.fused,
            "decoder: fused step without its workspace"
        );
        hooks.before(Unit::Embed, Pass::Forward, self.unit_bufs())?;
        let d = self.cfg.hidden_size;
        let (b, ws) = (&self.backend, &mut self.ws);
        b.embedding(&mut ws.resid[0], &self.w[self.embed], &ws.ids, n, d)?;
        hooks.after(Unit::Embed, Pass::Forward, self.unit_bufs())?;
        let ls = LayerShapes::new(&self.cfg, n);
        for l in 0..self.layers.len() {
            hooks.before(Unit::Layer(l), Pass::Forward, self.unit_bufs())?;
            let adapt = lora::view(&self.backend, &self.w, self.lora.as_ref(), n);
            let stacked = match fuse {
                true => lora::stacked(self.lora.as_ref(), l),
                false => None,
            };
            let run = LayerRun {
                lora: adapt.as_ref(),
                stacked,
                b: &self.backend,
                cfg: &self.cfg,
                w: &self.w,
                fused: &self.fused,
                ly: &self.layers[l],
                ls,
                l,
                train,
                fuse,
            };
            run.forward(&mut self.ws, &mut mode, seqs)?;
            hooks.after(Unit::Layer(l), Pass::Forward, self.unit_bufs())?;
        }
        Ok(if train { 2 * self.layers.len() } else { 0 })
    }
}

/// One layer's forward: what it reads besides the workspace.
struct LayerRun<'a, B: Backend> {
    b: &'a B,
    cfg: &'a Config,
    w: &'a [B::Buf],
    /// The fused projections' whole buffers (`Layer::qkv`...), read when `fuse`.
    fused: &'a [B::Buf],
    ly: &'a Layer,
    ls: LayerShapes,
    l: usize,
    /// Keep this layer's activations and residual snapshots (else one set, reused).
    train: bool,
    fuse: bool,
    /// The adapters, under LoRA.
    lora: Option<&'a Adapt<'a, B>>,
    /// The adapters of the fused q/k/v and gate/up projections, when the step fuses them.
    stacked: Option<&'a [Option<Stacked<B>>; 2]>,
}

impl<B: Backend> LayerRun<'_, B> {
    fn forward(&self, ws: &mut Work<B>, mode: &mut AttnMode<B>, seqs: usize) -> Result<()> {
        let fused_qkv = self.qkv(ws)?;
        match mode {
            AttnMode::Packed => self.attend_packed(ws, seqs)?,
            AttnMode::Paged(kv) => self.attend_paged(ws, kv, fused_qkv)?,
        }
        self.attn_out(ws)?;
        self.mlp(ws)
    }

    /// y += the adapter on `t` applied to x, where the layer has one.
    fn adapt(&self, t: Target, y: &mut B::Buf, x: &B::Buf, s: &mut [B::Buf; 2]) -> Result<()> {
        match (self.lora, self.ly.lora[lora::slot(t)]) {
            (Some(ad), Some(ab)) => ad.forward(lora::Pair::of(ab, t, self.cfg), y, x, s),
            _ => Ok(()),
        }
    }

    /// y += the stacked adapters of fused group `g` (0: q/k/v, 1: gate/up) applied to x.
    fn adapt_fused(&self, g: usize, y: &mut B::Buf, x: &B::Buf, t: &mut B::Buf) -> Result<()> {
        let Some(st) = self.stacked.and_then(|s| s[g].as_ref()) else {
            return Ok(());
        };
        let (b, ls, out) = (self.b, self.ls, self.b.len(&st.b) / st.cols);
        b.matmul(
            t,
            x,
            &st.a,
            None,
            ls.gemm(self.cfg.hidden_size, st.cols),
            false,
        )?;
        b.matmul(y, t, &st.b, None, ls.gemm(st.cols, out), true)
    }

    /// The activations this layer writes: its own when training, else the shared set.
    fn act(&self) -> usize {
        if self.train {
            self.l
        } else {
            0
        }
    }

    /// The residual snapshots the layer reads, its attention writes and its MLP writes:
    /// `2l`, `2l+1`, `2l+2` when training, else one buffer updated in place.
    fn resid(&self) -> (usize, usize, usize) {
        let l = self.l;
        if self.train {
            (2 * l, 2 * l + 1, 2 * l + 2)
        } else {
            (0, 0, 0)
        }
    }

    /// (hidden, intermediate, q features, k/v features).
    fn dims(&self) -> (usize, usize, usize, usize) {
        let c = self.cfg;
        let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        (c.hidden_size, c.intermediate_size, qd, kd)
    }

    /// xn1 = rmsnorm(x), then x·[Wq; Wk; Wv]ᵀ (+ [bq; bk; bv]) as one GEMM into ws.qkv, whose
    /// parts the cache write reads; or the three GEMMs into a.q, a.k, a.v (through Qwen3's
    /// q/k norms). Returns whether it ran the fused GEMM.
    fn qkv(&self, ws: &mut Work<B>) -> Result<bool> {
        let (b, w, ly, ls) = (self.b, self.w, self.ly, self.ls);
        let (d, _, qd, kd) = self.dims();
        let a = &mut ws.acts[self.act()];
        let x = &ws.resid[self.resid().0];
        b.rmsnorm(&mut a.xn1, &mut a.rstd1, x, &w[ly.in_norm], ls.norm)?;
        if let Some(wi) = ly.qkv.filter(|_| self.fuse) {
            let bias = ly.qkv_b.map(|i| &self.fused[i]);
            let s = ls.gemm(d, qd + 2 * kd);
            b.matmul(&mut ws.qkv, &a.xn1, &self.fused[wi], bias, s, false)?;
            self.adapt_fused(0, &mut ws.qkv, &a.xn1, &mut ws.lora[0])?;
            return Ok(true);
        }
        let (q_dst, k_dst) = if self.cfg.qk_norm {
            (&mut a.q_raw, &mut a.k_raw)
        } else {
            (&mut a.q, &mut a.k)
        };
        let x = &a.xn1;
        let bias = |i: Option<usize>| i.map(|i| &w[i]);
        let s = &mut ws.lora;
        b.matmul(q_dst, x, &w[ly.q], bias(ly.q_b), ls.gemm(d, qd), false)?;
        self.adapt(Target::Q, q_dst, x, s)?;
        b.matmul(k_dst, x, &w[ly.k], bias(ly.k_b), ls.gemm(d, kd), false)?;
        self.adapt(Target::K, k_dst, x, s)?;
        b.matmul(&mut a.v, x, &w[ly.v], bias(ly.v_b), ls.gemm(d, kd), false)?;
        self.adapt(Target::V, &mut a.v, x, s)?;
        if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
            b.rmsnorm(&mut a.q, &mut a.rstd_q, &a.q_raw, &w[qn], ls.q_norm)?;
            b.rmsnorm(&mut a.k, &mut a.rstd_k, &a.k_raw, &w[kn], ls.k_norm)?;
        }
        Ok(false)
    }

    /// Rope, then causal attention within each of the `seqs` packed sequences.
    fn attend_packed(&self, ws: &mut Work<B>, seqs: usize) -> Result<()> {
        let (b, ls) = (self.b, self.ls);
        let a = &mut ws.acts[self.act()];
        b.rope(&mut a.q, &ws.pos, ls.rope.q())?;
        b.rope(&mut a.k, &ws.pos, ls.rope.k())?;
        let out = AttnOut {
            o: &mut a.o,
            lse: &mut a.lse,
        };
        let x = Qkv {
            q: &a.q,
            k: &a.k,
            v: &a.v,
        };
        b.attention(out, x, &ws.cu, ls.attn(seqs))
    }

    /// Rope, the new keys and values stored at their cache rows, and attention through the
    /// step's block tables: one kernel for a decode step from the fused projection.
    fn attend_paged(&self, ws: &mut Work<B>, kv: &mut PagedAttn<B>, fused_qkv: bool) -> Result<()> {
        let (b, c, ls) = (self.b, self.cfg, self.ls);
        let a = &mut ws.acts[self.act()];
        let mut cache = KvCache {
            k: &mut kv.k[self.l],
            v: &mut kv.v[self.l],
        };
        let slots = Slots {
            pos: &ws.pos,
            rows: &ws.kv_rows,
        };
        let blocks = BlockTables {
            tables: kv.tables,
            seq: &ws.kv_base,
            len: &ws.kv_len,
        };
        let shape = PagedAttnShape {
            queries: ls.n,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: kv.block_size,
            max_blocks: kv.max_blocks,
        };
        if fused_qkv && kv.n_tiles == 0 {
            // A decode step: rope + kv_store + attention, one kernel on the GPU.
            let x = PackedQkv {
                qkv: &ws.qkv,
                q: &mut a.q,
            };
            let theta = c.rope_theta;
            let s = PagedRopeShape { attn: shape, theta };
            return b.attention_paged_rope(&mut a.o, x, slots, cache, blocks, s);
        }
        let qkv = fused_qkv.then_some(&ws.qkv);
        rope_store(b, qkv, a, slots, cache.reborrow(), ls.rope)?;
        let tiles = PrefillTiles {
            tiles: kv.tiles,
            n_tiles: kv.n_tiles,
            decode_rows: kv.decode_rows,
        };
        b.attention_paged_tiled(&mut a.o, &a.q, cache.read(), blocks, tiles, shape)
    }

    /// The attention's output projection added to the residual: into the next snapshot when
    /// training (which keeps the block's input), else in place.
    fn attn_out(&self, ws: &mut Work<B>) -> Result<()> {
        let (b, w, ls) = (self.b, self.w, self.ls);
        let (d, _, qd, _) = self.dims();
        let (ri, rm, _) = self.resid();
        let (a, wo) = (&ws.acts[self.act()], &w[self.ly.o]);
        let dst = if self.train {
            let (src, dst) = pair(&mut ws.resid, ri, rm);
            b.matmul_residual(dst, src, &a.o, wo, ls.gemm(qd, d))?;
            dst
        } else {
            let dst = &mut ws.resid[rm];
            b.matmul(dst, &a.o, wo, None, ls.gemm(qd, d), true)?;
            dst
        };
        self.adapt(Target::O, dst, &a.o, &mut ws.lora)
    }

    /// The MLP block added to the residual: x·[Wg; Wu]ᵀ as one GEMM into ws.gu, or the two
    /// GEMMs into a.g, a.u; swiglu; the down projection.
    fn mlp(&self, ws: &mut Work<B>) -> Result<()> {
        let (b, w, ly, ls) = (self.b, self.w, self.ly, self.ls);
        let (d, f, _, _) = self.dims();
        let (_, rm, ro) = self.resid();
        let a = &mut ws.acts[self.act()];
        b.rmsnorm(
            &mut a.xn2,
            &mut a.rstd2,
            &ws.resid[rm],
            &w[ly.post_norm],
            ls.norm,
        )?;
        if let Some(wi) = ly.gate_up.filter(|_| self.fuse) {
            let s = ls.gemm(d, 2 * f);
            b.matmul(&mut ws.gu, &a.xn2, &self.fused[wi], None, s, false)?;
            self.adapt_fused(1, &mut ws.gu, &a.xn2, &mut ws.lora[0])?;
            b.swiglu_packed(&mut ws.h, &ws.gu, ls.n, f)?;
        } else {
            b.matmul(&mut a.g, &a.xn2, &w[ly.gate], None, ls.gemm(d, f), false)?;
            self.adapt(Target::Gate, &mut a.g, &a.xn2, &mut ws.lora)?;
            b.matmul(&mut a.u, &a.xn2, &w[ly.up], None, ls.gemm(d, f), false)?;
            self.adapt(Target::Up, &mut a.u, &a.xn2, &mut ws.lora)?;
            let h = if self.train { &mut a.h } else { &mut ws.h };
            b.swiglu(h, &a.g, &a.u, ls.n * f)?;
        }
        let s = &mut ws.lora;
        if self.train {
            let (src, dst) = pair(&mut ws.resid, rm, ro);
            b.matmul_residual(dst, src, &a.h, &w[ly.down], ls.gemm(f, d))?;
            self.adapt(Target::Down, dst, &a.h, s)
        } else {
            let (dst, x) = (&mut ws.resid[ro], &ws.h);
            b.matmul(dst, x, &w[ly.down], None, ls.gemm(f, d), true)?;
            self.adapt(Target::Down, dst, x, s)
        }
    }
}

/// Rope of a step's new queries and keys, and its keys and values stored at their cache rows:
/// from the fused q/k/v projection `qkv` when there is one, else from `a`'s q, k and v.
fn rope_store<B: Backend>(
    b: &B,
    qkv: Option<&B::Buf>,
    a: &mut Acts<B>,
    slots: Slots<&B::Idx>,
    cache: KvCache<&mut B::Buf>,
    shape: RopeKvShape,
) -> Result<()> {
    match qkv {
        Some(qkv) => {
            let x = PackedQkv { qkv, q: &mut a.q };
            b.rope_store_kv_packed(x, slots, cache, shape)
        }
        None => b.rope_store_kv(&mut a.q, &mut a.k, &a.v, slots, cache, shape),
    }
}
