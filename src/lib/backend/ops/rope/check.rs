//! GPU checks of RoPE forward and backward, and its timings.

use anyhow::Result;

use crate::backend::check::gpu::{tols, Case, Ctx, TAIL};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::cuda::{CudaBuf, CudaIdx};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "rope",
    run: rope,
}];

pub const TIMINGS: &[Timing] = &[
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
            c.cpu
                .rope_backward(&mut xc, &pos, tokens, heads, hd, theta)?;
            c.gpu
                .rope_backward(&mut gx, &gp, tokens, heads, hd, theta)?;
        } else {
            c.cpu.rope(&mut xc, &pos, tokens, heads, hd, theta)?;
            c.gpu.rope(&mut gx, &gp, tokens, heads, hd, theta)?;
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
        || gpu.rope(&mut qkv, &gpos, tok, heads, hd, ROPE_THETA),
    )
}

/// A decode step's inputs at the timing shape: the fused q/k/v projection of each sequence's
/// new token, the q it is rotated into, and the bf16 paged caches (each sequence's blocks in
/// order, `per` blocks of `BLOCK` positions) with the token's position and cache row.
pub(crate) struct DecodeKv {
    pub qkv: CudaBuf,
    pub q: CudaBuf,
    pub kc: CudaBuf,
    pub vc: CudaBuf,
    pub pos: CudaIdx,
    pub rows: CudaIdx,
    pub per: usize,
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
                &s.qkv, &mut s.q, &s.pos, &mut s.kc, &mut s.vc, &s.rows, rows, heads, kv, hd,
                ROPE_THETA,
            )
        },
    )
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
