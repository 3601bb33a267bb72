//! Timing of a decode step's paged attention: plain, batch-invariant, and with the rope and the
//! cache store fused in. (The GPU parity cases are in `backend/cuda/parity_paged.rs`.)

use anyhow::Result;

use super::PagedAttnShape;
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const TIMINGS: &[Timing] = &[Timing {
    name: "decode attention_paged",
    run: time_decode,
}];

/// 256 sequences of context 256 in blocks of 16 (graph-replayed); bytes are the K and V read.
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let bf = DType::BF16;
    let (rows, ctx, heads, kv, hd) = (DECODE_ROWS, DECODE_CTX, HEADS, KV_HEADS, HEAD_DIM);
    let (qd, kd) = (heads * hd, kv * hd);
    let tag = format!("{rows} rows");
    let per = ctx.div_ceil(BLOCK);
    let blocks = rows * per;
    let qkv = t.buf(rows * (qd + 2 * kd), bf, 1.0)?;
    let mut q = t.buf(rows * qd, bf, 1.0)?;
    let mut kc = t.buf(blocks * BLOCK * kd, bf, 1.0)?;
    let mut vc = t.buf(blocks * BLOCK * kd, bf, 1.0)?;
    let pos = t.idx(&vec![(ctx - 1) as u32; rows])?;
    let crow: Vec<u32> = (0..rows)
        .map(|r| (r * per * BLOCK + ctx - 1) as u32)
        .collect();
    let crow = t.idx(&crow)?;
    let tables: Vec<u32> = (0..blocks as u32).collect();
    let tab = t.idx(&tables)?;
    let seq = t.idx(&(0..rows as u32).collect::<Vec<_>>())?;
    let len = t.idx(&vec![ctx as u32; rows])?;
    let mut o = t.buf(rows * qd, bf, 1.0)?;
    let shape = PagedAttnShape {
        queries: rows,
        heads,
        kv_heads: kv,
        head_dim: hd,
        block_size: BLOCK,
        max_blocks: per,
    };
    let was = gpu.batch_invariant();
    for inv in [false, true] {
        gpu.set_batch_invariant(inv);
        t.time_graph(
            if inv {
                "decode attention_paged (invariant)"
            } else {
                "decode attention_paged"
            },
            format!("{tag}, ctx {ctx}"),
            (rows * ctx * kd * 2 * 2) as f64,
            "GB/s",
            || gpu.attention_paged(&mut o, &q, &kc, &vc, &tab, &seq, &len, shape),
        )?;
    }
    gpu.set_batch_invariant(was);
    // A decode step's attention: the rope and the cache store of the new token fused in.
    t.time_graph(
        "decode attention_paged_rope",
        format!("{tag}, ctx {ctx}"),
        (rows * ctx * kd * 2 * 2) as f64,
        "GB/s",
        || {
            gpu.attention_paged_rope(
                &mut o, &qkv, &mut q, &pos, &mut kc, &mut vc, &crow, &tab, &seq, &len, shape,
                ROPE_THETA,
            )
        },
    )
}
