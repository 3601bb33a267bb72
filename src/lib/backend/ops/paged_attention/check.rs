//! Timing of a decode step's paged attention: plain, batch-invariant, and with the rope and the
//! cache store fused in. (The GPU parity cases are in `backend/cuda/parity_paged.rs`.)

use anyhow::Result;

use super::PagedAttnShape;
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::ops::rope::check::{decode_kv, DecodeKv};
use crate::backend::prelude::*;

pub const TIMINGS: &[Timing] = &[Timing {
    name: "decode attention_paged",
    run: time_decode,
}];

/// 256 sequences of context 256 in blocks of 16 (graph-replayed); bytes are the K and V read.
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (rows, ctx, heads, kv, hd) = (DECODE_ROWS, DECODE_CTX, HEADS, KV_HEADS, HEAD_DIM);
    let kd = kv * hd;
    let tag = format!("{rows} rows");
    let DecodeKv {
        qkv,
        mut q,
        mut kc,
        mut vc,
        pos,
        rows: crow,
        per,
    } = decode_kv(t)?;
    let blocks = rows * per;
    let tables: Vec<u32> = (0..blocks as u32).collect();
    let tab = t.idx(&tables)?;
    let seq = t.idx(&(0..rows as u32).collect::<Vec<_>>())?;
    let len = t.idx(&vec![ctx as u32; rows])?;
    let mut o = t.buf(rows * heads * hd, DType::BF16, 1.0)?;
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
