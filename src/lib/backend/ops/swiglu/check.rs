//! GPU checks of SwiGLU forward and backward (scalar and 8-wide kernels) and of the packed form
//! (against the CPU and bit for bit against the split op), and its timings.

use anyhow::Result;

use crate::backend::check::gpu::{bits, tols, Case, Ctx};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[
    Case {
        name: "swiglu",
        run: swiglu,
    },
    Case {
        name: "swiglu_packed",
        run: swiglu_packed,
    },
];

pub(crate) const TIMINGS: &[Timing] = &[
    Timing {
        name: "swiglu",
        run: time_train,
    },
    Timing {
        name: "decode swiglu_packed",
        run: time_decode,
    },
];

fn swiglu(c: &mut Ctx, d: DType) -> Result<()> {
    // 50,001: the scalar kernels; 49,992 (a multiple of 8): the vectorized ones in bf16.
    swiglu_n(c, d, 50_001, "")?;
    swiglu_n(c, d, 49_992, " [n % 8 = 0]")
}

fn swiglu_n(c: &mut Ctx, d: DType, n: usize, tag: &str) -> Result<()> {
    let (t1, _) = tols(d);
    let g = c.randn(n, 2.0, d);
    let u = c.randn(n, 1.0, d);
    let mut hc = vec![0.0; n];
    c.cpu.swiglu(&mut hc, &g, &u, n)?;
    let (gg, gu) = (c.dev(&g, d)?, c.dev(&u, d)?);
    let mut gh = c.poisoned(n, d)?;
    c.gpu.swiglu(&mut gh, &gg, &gu, n)?;
    c.check(&format!("swiglu{tag}"), d, &gh, &hc, true, t1)?;
    let dh = c.randn(n, 1.0, d);
    let (mut dgc, mut duc) = (vec![0.0; n], vec![0.0; n]);
    c.cpu.swiglu_backward(&mut dgc, &mut duc, &dh, &g, &u, n)?;
    let (mut gdg, mut gdu) = (c.poisoned(n, d)?, c.poisoned(n, d)?);
    c.gpu
        .swiglu_backward(&mut gdg, &mut gdu, &c.dev(&dh, d)?, &gg, &gu, n)?;
    c.check(&format!("swiglu_backward dg{tag}"), d, &gdg, &dgc, true, t1)?;
    c.check(&format!("swiglu_backward du{tag}"), d, &gdu, &duc, true, t1)
}

/// The MLP activation of one micro-batch (separate gate and up buffers).
fn time_train(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (tok, ffn) = (TOKENS, FFN);
    let mut h = t.buf(tok * ffn, DType::BF16, 1.0)?;
    let (g, u) = (
        t.buf(tok * ffn, DType::BF16, 1.0)?,
        t.buf(tok * ffn, DType::BF16, 1.0)?,
    );
    t.time(
        "swiglu",
        format!("{tok}×{ffn}"),
        (tok * ffn * 3 * 2) as f64,
        "GB/s",
        || gpu.swiglu(&mut h, &g, &u, tok * ffn),
    )
}

/// A decode step's activation on the fused gate/up projection (graph-replayed).
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (rows, ffn) = (DECODE_ROWS, FFN);
    let gu = t.buf(rows * 2 * ffn, DType::BF16, 1.0)?;
    let mut h = t.buf(rows * ffn, DType::BF16, 1.0)?;
    t.time_graph(
        "decode swiglu_packed",
        format!("{rows} rows × {ffn}"),
        (rows * ffn * 3 * 2) as f64,
        "GB/s",
        || gpu.swiglu_packed(&mut h, &gu, rows, ffn),
    )
}

/// SwiGLU of a fused gate/up projection [n, 2f]: against the CPU op, and bit for bit
/// against the GPU's `swiglu` of the two halves. f a multiple of 8 (the bf16 vector
/// kernels on both sides), f odd (the scalar kernels), and 8 rows of an odd f (the split
/// op vectorised, the packed one scalar).
fn swiglu_packed(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, _) = tols(d);
    for (tag, n, f) in [
        ("f 512", 37usize, 512usize),
        ("f 37", 29, 37),
        ("8 rows, f 37", 8, 37),
    ] {
        let gu = c.randn(n * 2 * f, 2.0, d);
        let mut want = vec![0f32; n * f];
        c.cpu.swiglu_packed(&mut want, &gu, n, f)?;
        let ggu = c.dev(&gu, d)?;
        let mut gh = c.poisoned(n * f, d)?;
        c.gpu.swiglu_packed(&mut gh, &ggu, n, f)?;
        c.check(&format!("swiglu_packed {tag}"), d, &gh, &want, true, t1)?;
        let (mut g, mut u) = (Vec::new(), Vec::new());
        for r in gu.chunks(2 * f) {
            g.extend_from_slice(&r[..f]);
            u.extend_from_slice(&r[f..]);
        }
        let (gg, gu_) = (c.dev(&g, d)?, c.dev(&u, d)?);
        let mut sh = c.gpu.alloc_as(n * f, d)?;
        c.gpu.swiglu(&mut sh, &gg, &gu_, n * f)?;
        let same = bits(c.gpu, &gh, n * f)? == bits(c.gpu, &sh, n * f)?;
        c.flag(
            &format!("swiglu_packed {tag} vs split op (gpu)"),
            d,
            same,
            if same { "bit-identical" } else { "DIFFERENT" }.into(),
        );
    }
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
