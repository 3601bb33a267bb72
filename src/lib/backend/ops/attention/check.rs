//! GPU checks of the training attention (forward and backward, tensor-core and scalar paths,
//! awkward sequence lengths and head layouts), and its timings.

use anyhow::Result;

use crate::backend::check::gpu::{round, tols, Case, Ctx};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "attention",
    run: attention,
}];

pub(crate) const TIMINGS: &[Timing] = &[Timing {
    name: "attention",
    run: time_train,
}];

fn attention_case(
    c: &mut Ctx,
    d: DType,
    mma: bool,
    lens: &[usize],
    heads: usize,
    kv: usize,
    hd: usize,
) -> Result<()> {
    let (t1, t2) = tols(d);
    let tokens: usize = lens.iter().sum();
    let mut cu = vec![0u32];
    for l in lens {
        cu.push(cu.last().unwrap() + *l as u32);
    }
    let s = AttnShape {
        tokens,
        seqs: lens.len(),
        heads,
        kv_heads: kv,
        head_dim: hd,
    };
    let path = if d == DType::BF16 && mma && hd.is_multiple_of(16) && hd <= 128 {
        "mma"
    } else {
        "fma"
    };
    let tag = format!("{path} h{heads}/kv{kv} d{hd} T{tokens}");
    let (qn, kn) = (tokens * heads * hd, tokens * kv * hd);
    let q = c.randn(qn, 1.0, d);
    let k = c.randn(kn, 1.0, d);
    let v = c.randn(kn, 1.0, d);
    let (mut oc, mut lc) = (vec![0.0; qn], vec![0.0; tokens * heads]);
    c.cpu.attention(
        AttnOut {
            o: &mut oc,
            lse: &mut lc,
        },
        Qkv {
            q: &q,
            k: &k,
            v: &v,
        },
        &cu,
        s,
    )?;
    let (gq, gk, gv, gcu) = (c.dev(&q, d)?, c.dev(&k, d)?, c.dev(&v, d)?, c.idx(&cu)?);
    let (mut go, mut gl) = (c.poisoned(qn, d)?, c.poisoned(tokens * heads, DType::F32)?);
    c.gpu.attention(
        AttnOut {
            o: &mut go,
            lse: &mut gl,
        },
        Qkv {
            q: &gq,
            k: &gk,
            v: &gv,
        },
        &gcu,
        s,
    )?;
    c.check(&format!("attention o [{tag}]"), d, &go, &oc, true, t1)?;
    c.check(&format!("attention lse [{tag}]"), d, &gl, &lc, true, t1)?;
    // The backward takes the CPU's o and lse (stored as the GPU would) so it is tested alone.
    let oc_d: Vec<f32> = oc.iter().map(|&x| round(x, d)).collect();
    let dout = c.randn(qn, 1.0, d);
    let (mut dqc, mut dkc, mut dvc) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
    c.cpu.attention_backward(
        Qkv {
            q: &mut dqc,
            k: &mut dkc,
            v: &mut dvc,
        },
        &dout,
        Qkv {
            q: &q,
            k: &k,
            v: &v,
        },
        AttnOut { o: &oc_d, lse: &lc },
        &cu,
        s,
    )?;
    let (gdo, go2, gl2) = (c.dev(&dout, d)?, c.dev(&oc_d, d)?, c.dev(&lc, DType::F32)?);
    let (mut gdq, mut gdk, mut gdv) = (c.poisoned(qn, d)?, c.poisoned(kn, d)?, c.poisoned(kn, d)?);
    c.gpu.attention_backward(
        Qkv {
            q: &mut gdq,
            k: &mut gdk,
            v: &mut gdv,
        },
        &gdo,
        Qkv {
            q: &gq,
            k: &gk,
            v: &gv,
        },
        AttnOut { o: &go2, lse: &gl2 },
        &gcu,
        s,
    )?;
    c.check(
        &format!("attention_backward dq [{tag}]"),
        d,
        &gdq,
        &dqc,
        true,
        t2,
    )?;
    c.check(
        &format!("attention_backward dk [{tag}]"),
        d,
        &gdk,
        &dkc,
        true,
        t2,
    )?;
    c.check(
        &format!("attention_backward dv [{tag}]"),
        d,
        &gdv,
        &dvc,
        true,
        t2,
    )
}

fn attention(c: &mut Ctx, d: DType) -> Result<()> {
    // bf16 runs both kernels: tensor cores (the default) and the scalar fallback.
    if d == DType::BF16 {
        c.gpu.set_tensor_core_attention(false);
        let r = attention_cases(c, d, false);
        c.gpu.set_tensor_core_attention(true);
        r?;
    }
    attention_cases(c, d, true)
}

fn attention_cases(c: &mut Ctx, d: DType, mma: bool) -> Result<()> {
    // Packed sequences of awkward lengths (1, a partial tile, tiles that straddle bounds).
    attention_case(c, d, mma, &[1, 37, 64, 129, 200, 5], 4, 2, 64)?;
    // The Qwen2.5-0.5B head layout (14 query heads over 2 kv heads) at the bench length.
    attention_case(c, d, mma, &[640, 3], 14, 2, 64)?;
    attention_case(c, d, mma, &[100, 77], 8, 8, 128)?;
    attention_case(c, d, mma, &[50, 21], 3, 1, 96)?;
    attention_case(c, d, mma, &[70], 2, 1, 256)
}

/// Forward and backward over 8 packed sequences of 640, on the tensor cores and on the scalar
/// kernels.
fn time_train(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let bf = DType::BF16;
    let (seqs, len, tok, heads, kv, hd) = (SEQS, LEN, TOKENS, HEADS, KV_HEADS, HEAD_DIM);
    let cu: Vec<u32> = (0..=seqs as u32).map(|s| s * len as u32).collect();
    let gcu = t.idx(&cu)?;
    let s = AttnShape {
        tokens: tok,
        seqs,
        heads,
        kv_heads: kv,
        head_dim: hd,
    };
    let (q, k, v) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
    );
    let (mut o, mut lse) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * heads, DType::F32, 1.0)?,
    );
    let dout = t.buf(tok * heads * hd, bf, 1.0)?;
    let (mut dq, mut dk, mut dv) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
    );
    // Causal: half of the L×L scores; forward 2 products, backward 5 (2.5× the forward).
    let fwd_flop = 2.0 * 2.0 * (seqs * len * len) as f64 / 2.0 * (hd * heads) as f64;
    let shape = format!("{seqs}×{len}, {heads}/{kv} heads, d{hd}");
    for mma in [true, false] {
        gpu.set_tensor_core_attention(mma);
        let tag = if mma { "mma" } else { "fma" };
        t.time(
            &format!("attention fwd ({tag})"),
            shape.clone(),
            fwd_flop,
            "TFLOP/s",
            || {
                gpu.attention(
                    AttnOut {
                        o: &mut o,
                        lse: &mut lse,
                    },
                    Qkv {
                        q: &q,
                        k: &k,
                        v: &v,
                    },
                    &gcu,
                    s,
                )
            },
        )?;
        t.time(
            &format!("attention bwd ({tag})"),
            shape.clone(),
            2.5 * fwd_flop,
            "TFLOP/s",
            || {
                gpu.attention_backward(
                    Qkv {
                        q: &mut dq,
                        k: &mut dk,
                        v: &mut dv,
                    },
                    &dout,
                    Qkv {
                        q: &q,
                        k: &k,
                        v: &v,
                    },
                    AttnOut { o: &o, lse: &lse },
                    &gcu,
                    s,
                )
            },
        )?;
    }
    gpu.set_tensor_core_attention(true);
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
