//! The forward pass: sequences packed for scoring and training, the layer loop shared with
//! paged steps, and scoring (`logprobs`).

use anyhow::{bail, ensure, Result};

use super::shard::{Holding, Pass, Unit};
use super::step::PagedAttn;
use super::workspace::{Acts, Caps};
use super::{check_temperature, pair, Decoder, SeqRef, TokenStats};
use crate::backend::{
    AttnOut, AttnShape, Backend, BlockTables, KvCache, MatmulShape, PackedQkv, PagedAttnShape,
    PagedRopeShape, PrefillTiles, Qkv, RmsNormShape, RopeKvShape, Slots,
};
use crate::error::input_error;
use crate::model::Config;

/// How the attention of a forward pass gets its keys.
pub(super) enum AttnMode<'a, B: Backend> {
    /// Packed sequences, keys from this call only.
    Packed,
    /// Keys and values are stored into a paged cache first, then read from it through block
    /// tables (`kv_rows` are the cache rows of the new tokens, `kv_base` the table row of each
    /// query, `kv_len` its context length).
    Paged(PagedAttn<'a, B>),
}

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
        check_temperature(temperature)?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (n, r) = self.pack(seqs, false)?;
        let last = self.forward(n, seqs.len(), false, AttnMode::Packed)?;
        self.score_rows(last, seqs, r, temperature, entropy)
    }

    /// [`Decoder::logprobs`] under full sharding (see [`Holding`]); every rank calls it the
    /// same number of times (with no sequences where it has none).
    pub fn logprobs_held(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
        hold: &mut Holding<B>,
    ) -> Result<Vec<TokenStats>> {
        check_temperature(temperature)?;
        if seqs.is_empty() {
            hold.idle(&self.backend, &mut self.w, &mut self.g, false)?;
            return Ok(Vec::new());
        }
        let (n, r) = self.pack(seqs, false)?;
        let last = self.forward_in(n, seqs.len(), false, AttnMode::Packed, Some(&mut *hold))?;
        let stats = self.score_rows(last, seqs, r, temperature, entropy)?;
        hold.release(&self.backend, &mut self.w, Unit::Head)?;
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
        self.forward_in(n, seqs, train, mode, None)
    }

    /// [`Decoder::forward`]; with `hold` (full sharding) each unit is gathered before it runs
    /// and freed after, and the head is left gathered for the scoring that follows.
    pub(super) fn forward_in(
        &mut self,
        n: usize,
        seqs: usize,
        train: bool,
        mut mode: AttnMode<B>,
        mut hold: Option<&mut Holding<B>>,
    ) -> Result<usize> {
        // The rollout engine's (paged) steps run the fused projections; training
        // and scoring (packed) keep the split GEMMs, so `update` and `ref-logprob` agree.
        let fuse = self.fuses() && !matches!(mode, AttnMode::Packed);
        let Decoder {
            backend: b,
            cfg,
            w,
            layers,
            ws,
            embed,
            fused,
            ..
        } = self;
        let (d, f, hh, kh, hd) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (qd, kd, theta) = (hh * hd, kh * hd, cfg.rope_theta);
        ensure!(
            !fuse || ws.caps.fused,
            "decoder: fused step without its workspace"
        );
        let ls = LayerShapes::new(cfg, n);
        if let Some(h) = hold.as_deref_mut() {
            h.gather(b, w, Unit::Embed, Pass::Forward)?;
        }
        b.embedding(&mut ws.resid[0], &w[*embed], &ws.ids, n, d)?;
        if let Some(h) = hold.as_deref_mut() {
            h.release(b, w, Unit::Embed)?;
        }
        for (l, ly) in layers.iter().enumerate() {
            if let Some(h) = hold.as_deref_mut() {
                h.gather(b, w, Unit::Layer(l), Pass::Forward)?;
            }
            let (ri, rm, ro) = if train {
                (2 * l, 2 * l + 1, 2 * l + 2)
            } else {
                (0, 0, 0)
            };
            let a = &mut ws.acts[if train { l } else { 0 }];
            let x = &ws.resid[ri];
            b.rmsnorm(&mut a.xn1, &mut a.rstd1, x, &w[ly.in_norm], ls.norm)?;
            // x·[Wq; Wk; Wv]ᵀ (+ [bq; bk; bv]) as one GEMM into ws.qkv, whose parts the
            // cache write reads; or the three GEMMs into a.q, a.k, a.v.
            let qkv = ly.qkv.filter(|_| fuse);
            if let Some(wi) = qkv {
                let bias = ly.qkv_b.map(|i| &fused[i]);
                let s = ls.gemm(d, qd + 2 * kd);
                b.matmul(&mut ws.qkv, &a.xn1, &fused[wi], bias, s, false)?;
            } else {
                let (q_dst, k_dst) = if cfg.qk_norm {
                    (&mut a.q_raw, &mut a.k_raw)
                } else {
                    (&mut a.q, &mut a.k)
                };
                let x = &a.xn1;
                b.matmul(
                    q_dst,
                    x,
                    &w[ly.q],
                    ly.q_b.map(|i| &w[i]),
                    ls.gemm(d, qd),
                    false,
                )?;
                b.matmul(
                    k_dst,
                    x,
                    &w[ly.k],
                    ly.k_b.map(|i| &w[i]),
                    ls.gemm(d, kd),
                    false,
                )?;
                b.matmul(
                    &mut a.v,
                    x,
                    &w[ly.v],
                    ly.v_b.map(|i| &w[i]),
                    ls.gemm(d, kd),
                    false,
                )?;
                if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
                    b.rmsnorm(&mut a.q, &mut a.rstd_q, &a.q_raw, &w[qn], ls.q_norm)?;
                    b.rmsnorm(&mut a.k, &mut a.rstd_k, &a.k_raw, &w[kn], ls.k_norm)?;
                }
            }
            match &mut mode {
                AttnMode::Packed => {
                    b.rope(&mut a.q, &ws.pos, ls.rope.q())?;
                    b.rope(&mut a.k, &ws.pos, ls.rope.k())?;
                    let shape = ls.attn(seqs);
                    let out = AttnOut {
                        o: &mut a.o,
                        lse: &mut a.lse,
                    };
                    let x = Qkv {
                        q: &a.q,
                        k: &a.k,
                        v: &a.v,
                    };
                    b.attention(out, x, &ws.cu, shape)?;
                }
                AttnMode::Paged(kv) => {
                    let mut cache = KvCache {
                        k: &mut kv.k[l],
                        v: &mut kv.v[l],
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
                        queries: n,
                        heads: hh,
                        kv_heads: kh,
                        head_dim: hd,
                        block_size: kv.block_size,
                        max_blocks: kv.max_blocks,
                    };
                    if qkv.is_some() && kv.n_tiles == 0 {
                        // A decode step: rope + kv_store + attention, one kernel on the GPU.
                        let x = PackedQkv {
                            qkv: &ws.qkv,
                            q: &mut a.q,
                        };
                        let s = PagedRopeShape { attn: shape, theta };
                        b.attention_paged_rope(&mut a.o, x, slots, cache, blocks, s)?;
                    } else {
                        let fused_qkv = qkv.map(|_| &ws.qkv);
                        rope_store(b, fused_qkv, a, slots, cache.reborrow(), ls.rope)?;
                        let tiles = PrefillTiles {
                            tiles: kv.tiles,
                            n_tiles: kv.n_tiles,
                            decode_rows: kv.decode_rows,
                        };
                        b.attention_paged_tiled(
                            &mut a.o,
                            &a.q,
                            cache.read(),
                            blocks,
                            tiles,
                            shape,
                        )?;
                    }
                }
            }
            if train {
                // Training keeps the block's input: the output goes to the next snapshot.
                let (src, dst) = pair(&mut ws.resid, ri, rm);
                b.matmul_residual(dst, src, &a.o, &w[ly.o], ls.gemm(qd, d))?;
            } else {
                b.matmul(
                    &mut ws.resid[rm],
                    &a.o,
                    &w[ly.o],
                    None,
                    ls.gemm(qd, d),
                    true,
                )?;
            }
            b.rmsnorm(
                &mut a.xn2,
                &mut a.rstd2,
                &ws.resid[rm],
                &w[ly.post_norm],
                ls.norm,
            )?;
            // x·[Wg; Wu]ᵀ as one GEMM into ws.gu, or the two GEMMs into a.g, a.u.
            if let Some(wi) = ly.gate_up.filter(|_| fuse) {
                b.matmul(
                    &mut ws.gu,
                    &a.xn2,
                    &fused[wi],
                    None,
                    ls.gemm(d, 2 * f),
                    false,
                )?;
                b.swiglu_packed(&mut ws.h, &ws.gu, n, f)?;
            } else {
                b.matmul(&mut a.g, &a.xn2, &w[ly.gate], None, ls.gemm(d, f), false)?;
                b.matmul(&mut a.u, &a.xn2, &w[ly.up], None, ls.gemm(d, f), false)?;
                let h = if train { &mut a.h } else { &mut ws.h };
                b.swiglu(h, &a.g, &a.u, n * f)?;
            }
            if train {
                let (src, dst) = pair(&mut ws.resid, rm, ro);
                b.matmul_residual(dst, src, &a.h, &w[ly.down], ls.gemm(f, d))?;
            } else {
                b.matmul(
                    &mut ws.resid[ro],
                    &ws.h,
                    &w[ly.down],
                    None,
                    ls.gemm(f, d),
                    true,
                )?;
            }
            if let Some(h) = hold.as_deref_mut() {
                h.release(b, w, Unit::Layer(l))?;
            }
        }
        if let Some(h) = hold {
            h.gather(b, w, Unit::Head, Pass::Forward)?;
        }
        Ok(if train { 2 * layers.len() } else { 0 })
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
