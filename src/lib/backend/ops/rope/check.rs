//! GPU checks of RoPE forward and backward and of the rope + cache store of a step (split parts,
//! and packed: against the CPU and bit for bit against the split op), and its timings.

use anyhow::Result;

use crate::backend::check::gpu::{bits, tols, Case, Ctx, TAIL};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::cuda::{CudaBuf, CudaIdx};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[
    Case {
        name: "rope",
        run: rope,
    },
    Case {
        name: "rope_store_kv",
        run: rope_store_kv,
    },
    Case {
        name: "rope_store_kv_packed",
        run: rope_store_kv_packed,
    },
];

pub(crate) const TIMINGS: &[Timing] = &[
    Timing {
        name: "rope",
        run: time_train,
    },
    Timing {
        name: "decode rope_store_kv_packed",
        run: time_decode,
    },
];

fn rope(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, _) = tols(d);
    let (tokens, heads, hd, theta) = (300, 6, 64, 1_000_000.0);
    let pos: Vec<u32> = (0..tokens).map(|_| c.rng.below(4096) as u32).collect();
    let gp = c.idx(&pos)?;
    let x = c.randn(tokens * heads * hd, 1.0, d);
    for back in [false, true] {
        let mut xc = x.clone();
        let mut gx = {
            let mut v = x.clone();
            v.extend([f32::NAN; TAIL]);
            c.dev(&v, d)?
        };
        if back {
            c.cpu.rope_backward(
                &mut xc,
                &pos,
                RopeShape {
                    tokens,
                    heads,
                    head_dim: hd,
                    theta,
                },
            )?;
            c.gpu.rope_backward(
                &mut gx,
                &gp,
                RopeShape {
                    tokens,
                    heads,
                    head_dim: hd,
                    theta,
                },
            )?;
        } else {
            c.cpu.rope(
                &mut xc,
                &pos,
                RopeShape {
                    tokens,
                    heads,
                    head_dim: hd,
                    theta,
                },
            )?;
            c.gpu.rope(
                &mut gx,
                &gp,
                RopeShape {
                    tokens,
                    heads,
                    head_dim: hd,
                    theta,
                },
            )?;
        }
        let label = if back { "rope_backward" } else { "rope" };
        c.check(label, d, &gx, &xc, true, t1)?;
    }
    Ok(())
}

/// RoPE on the q part of one micro-batch's fused projection (positions within sequences).
fn time_train(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (tok, heads, hd) = (TOKENS, HEADS, HEAD_DIM);
    let mut qkv = t.buf(tok * (HEADS + 2 * KV_HEADS) * hd, DType::BF16, 1.0)?;
    let pos: Vec<u32> = (0..tok as u32).map(|i| i % LEN as u32).collect();
    let gpos = t.idx(&pos)?;
    t.time(
        "rope (q)",
        format!("{tok}×{heads}×{hd}"),
        (tok * heads * hd * 2 * 2) as f64,
        "GB/s",
        || {
            gpu.rope(
                &mut qkv,
                &gpos,
                RopeShape {
                    tokens: tok,
                    heads,
                    head_dim: hd,
                    theta: ROPE_THETA,
                },
            )
        },
    )
}

/// A decode step's inputs at the timing shape: the fused q/k/v projection of each sequence's
/// new token, the q it is rotated into, and the bf16 paged caches (each sequence's blocks in
/// order, `per` blocks of `BLOCK` positions) with the token's position and cache row.
pub(crate) struct DecodeKv {
    pub(crate) qkv: CudaBuf,
    pub(crate) q: CudaBuf,
    pub(crate) kc: CudaBuf,
    pub(crate) vc: CudaBuf,
    pub(crate) pos: CudaIdx,
    pub(crate) rows: CudaIdx,
    pub(crate) per: usize,
}

/// [`DecodeKv`] for `DECODE_ROWS` sequences at context `DECODE_CTX`.
pub(crate) fn decode_kv(t: &mut Timer) -> Result<DecodeKv> {
    use shape::*;
    let bf = DType::BF16;
    let (rows, ctx) = (DECODE_ROWS, DECODE_CTX);
    let (qd, kd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let per = ctx.div_ceil(BLOCK);
    let cache = rows * per * BLOCK * kd;
    let crow: Vec<u32> = (0..rows)
        .map(|r| (r * per * BLOCK + ctx - 1) as u32)
        .collect();
    Ok(DecodeKv {
        qkv: t.buf(rows * (qd + 2 * kd), bf, 1.0)?,
        q: t.buf(rows * qd, bf, 1.0)?,
        kc: t.buf(cache, bf, 1.0)?,
        vc: t.buf(cache, bf, 1.0)?,
        pos: t.idx(&vec![(ctx - 1) as u32; rows])?,
        rows: t.idx(&crow)?,
        per,
    })
}

/// A decode step's rope of q and k from the fused projection with the store of k and v into
/// the paged cache (graph-replayed).
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (rows, heads, kv, hd) = (DECODE_ROWS, HEADS, KV_HEADS, HEAD_DIM);
    let (qd, kd) = (heads * hd, kv * hd);
    let mut s = decode_kv(t)?;
    t.time_graph(
        "decode rope_store_kv_packed",
        format!("{rows} rows, {heads}/{kv} heads, d{hd}"),
        // Reads the q/k/v rows, writes as many bytes (q out, k and v into the cache).
        (2 * rows * (qd + 2 * kd) * 2) as f64,
        "GB/s",
        || {
            gpu.rope_store_kv_packed(
                PackedQkv {
                    qkv: &s.qkv,
                    q: &mut s.q,
                },
                Slots {
                    pos: &s.pos,
                    rows: &s.rows,
                },
                KvCache {
                    k: &mut s.kc,
                    v: &mut s.vc,
                },
                RopeKvShape {
                    tokens: rows,
                    heads,
                    kv_heads: kv,
                    head_dim: hd,
                    theta: ROPE_THETA,
                },
            )
        },
    )
}

/// The fused rope + kv_store of cached and paged steps against the CPU's three ops.
fn rope_store_kv(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, _) = tols(d);
    let (tokens, heads, kv, hd, cache_rows) = (37usize, 14usize, 2usize, 64usize, 80usize);
    let shape = RopeKvShape {
        tokens,
        heads,
        kv_heads: kv,
        head_dim: hd,
        theta: 1e6,
    };
    let kd = kv * hd;
    let mut q = c.randn(tokens * heads * hd, 1.0, d);
    let mut k = c.randn(tokens * kd, 1.0, d);
    let v = c.randn(tokens * kd, 1.0, d);
    let mut kc = c.randn(cache_rows * kd, 1.0, d);
    let mut vc = c.randn(cache_rows * kd, 1.0, d);
    let pos: Vec<u32> = (0..tokens).map(|_| c.rng.below(5000) as u32).collect();
    let rows = c.rng.distinct(tokens, cache_rows);
    let (mut gq, mut gk, gv) = (c.dev(&q, d)?, c.dev(&k, d)?, c.dev(&v, d)?);
    let (mut gkc, mut gvc) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
    let (gpos, grows) = (c.idx(&pos)?, c.idx(&rows)?);
    let gslots = Slots {
        pos: &gpos,
        rows: &grows,
    };
    c.cpu.rope_store_kv(
        &mut q,
        &mut k,
        &v,
        Slots {
            pos: &pos,
            rows: &rows,
        },
        KvCache {
            k: &mut kc,
            v: &mut vc,
        },
        shape,
    )?;
    c.gpu.rope_store_kv(
        &mut gq,
        &mut gk,
        &gv,
        gslots,
        KvCache {
            k: &mut gkc,
            v: &mut gvc,
        },
        shape,
    )?;
    c.check("rope_store_kv q", d, &gq, &q, false, t1)?;
    c.check("rope_store_kv k", d, &gk, &k, false, t1)?;
    c.check("rope_store_kv k cache", d, &gkc, &kc, false, t1)?;
    c.check("rope_store_kv v cache", d, &gvc, &vc, false, t1)
}

/// The packed rope + kv_store of a fused q/k/v projection (Qwen2.5-0.5B heads): against
/// the CPU op, and bit for bit against the GPU's split op on the same three parts (what an
/// unfused step computes from the same projections).
fn rope_store_kv_packed(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, _) = tols(d);
    let (tokens, heads, kv, hd, cache_rows) = (37usize, 14usize, 2usize, 64usize, 80usize);
    let shape = RopeKvShape {
        tokens,
        heads,
        kv_heads: kv,
        head_dim: hd,
        theta: 1e6,
    };
    let (qd, kd) = (heads * hd, kv * hd);
    let width = qd + 2 * kd;
    let qkv = c.randn(tokens * width, 1.0, d);
    let kc = c.randn(cache_rows * kd, 1.0, d);
    let vc = c.randn(cache_rows * kd, 1.0, d);
    let pos: Vec<u32> = (0..tokens).map(|_| c.rng.below(5000) as u32).collect();
    let rows = c.rng.distinct(tokens, cache_rows);
    let (gpos, grows) = (c.idx(&pos)?, c.idx(&rows)?);
    let gslots = Slots {
        pos: &gpos,
        rows: &grows,
    };

    let mut q = vec![0f32; tokens * qd];
    let (mut ckc, mut cvc) = (kc.clone(), vc.clone());
    c.cpu.rope_store_kv_packed(
        PackedQkv {
            qkv: &qkv,
            q: &mut q,
        },
        Slots {
            pos: &pos,
            rows: &rows,
        },
        KvCache {
            k: &mut ckc,
            v: &mut cvc,
        },
        shape,
    )?;
    let gx = c.dev(&qkv, d)?;
    let mut gq = c.poisoned(tokens * qd, d)?;
    let (mut gkc, mut gvc) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
    c.gpu.rope_store_kv_packed(
        PackedQkv {
            qkv: &gx,
            q: &mut gq,
        },
        gslots,
        KvCache {
            k: &mut gkc,
            v: &mut gvc,
        },
        shape,
    )?;
    c.check("rope_store_kv_packed q", d, &gq, &q, true, t1)?;
    c.check("rope_store_kv_packed k cache", d, &gkc, &ckc, false, t1)?;
    c.check("rope_store_kv_packed v cache", d, &gvc, &cvc, false, t1)?;

    // The split op on the parts of the same rows.
    let (mut sq, mut sk, mut sv) = (Vec::new(), Vec::new(), Vec::new());
    for r in qkv.chunks(width) {
        sq.extend_from_slice(&r[..qd]);
        sk.extend_from_slice(&r[qd..qd + kd]);
        sv.extend_from_slice(&r[qd + kd..]);
    }
    let (mut gsq, mut gsk, gsv) = (c.dev(&sq, d)?, c.dev(&sk, d)?, c.dev(&sv, d)?);
    let (mut skc, mut svc) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
    c.gpu.rope_store_kv(
        &mut gsq,
        &mut gsk,
        &gsv,
        gslots,
        KvCache {
            k: &mut skc,
            v: &mut svc,
        },
        shape,
    )?;
    let g = c.gpu;
    let same = [
        (
            "q",
            bits(g, &gq, tokens * qd)? == bits(g, &gsq, tokens * qd)?,
        ),
        (
            "k cache",
            bits(g, &gkc, kc.len())? == bits(g, &skc, kc.len())?,
        ),
        (
            "v cache",
            bits(g, &gvc, vc.len())? == bits(g, &svc, vc.len())?,
        ),
    ];
    c.flag_same("rope_store_kv_packed vs split op (gpu)", d, &same);
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
