//! GPU checks of the fused LM head (f32 and bf16 scratch, with and without entropy, chunked)
//! and its timings.

use anyhow::Result;

use crate::backend::check::gpu::{dname, tols, Case, Ctx};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "logprob",
    run: logprob,
}];

pub(crate) const TIMINGS: &[Timing] = &[Timing {
    name: "logprob",
    run: time,
}];

/// The fused head against the CPU at shape `s`, in storage `d` with a scratch of type `sd`.
fn logprob_case(c: &mut Ctx, d: DType, sd: DType, entropy: bool, s: LogprobShape) -> Result<()> {
    let (_, t2) = tols(d);
    // A bf16 scratch rounds the logits themselves: a looser bound.
    let t = if sd == DType::BF16 { 3e-2 } else { t2 };
    let LogprobShape {
        rows,
        hidden,
        vocab,
        chunk,
        ..
    } = s;
    let tag = format!(
        "{}{} scratch {}",
        if entropy { "+ent " } else { "" },
        rows,
        dname(sd)
    );
    let x = c.randn(rows * hidden, 1.0, d);
    let w = c.randn(vocab * hidden, 0.2, d);
    let tg: Vec<u32> = (0..rows).map(|_| c.rng.below(vocab) as u32).collect();
    let (mut lpc, mut entc, mut lsec, mut sc) = (
        vec![0.0; rows],
        vec![0.0; rows],
        vec![0.0; rows],
        vec![0.0; chunk * vocab],
    );
    c.cpu.logprob(
        &mut lpc,
        entropy.then_some(&mut entc),
        &mut lsec,
        LogprobInput {
            x: &x,
            w: &w,
            targets: &tg,
        },
        s,
        &mut sc,
    )?;
    let (gx, gw, gt) = (c.dev(&x, d)?, c.dev(&w, d)?, c.idx(&tg)?);
    let (mut glp, mut gent, mut glse) = (
        c.poisoned(rows, DType::F32)?,
        c.poisoned(rows, DType::F32)?,
        c.poisoned(rows, DType::F32)?,
    );
    let mut gsc = c.gpu.alloc_as(chunk * vocab, sd)?;
    c.gpu.logprob(
        &mut glp,
        entropy.then_some(&mut gent),
        &mut glse,
        LogprobInput {
            x: &gx,
            w: &gw,
            targets: &gt,
        },
        s,
        &mut gsc,
    )?;
    c.check(&format!("logprob lp [{tag}]"), d, &glp, &lpc, true, t)?;
    c.check(&format!("logprob lse [{tag}]"), d, &glse, &lsec, true, t)?;
    if entropy {
        c.check(
            &format!("logprob entropy [{tag}]"),
            d,
            &gent,
            &entc,
            true,
            t,
        )?;
    }
    // Backward from the CPU's statistics, with random upstream gradients.
    let dlp = c.randn(rows, 1.0, DType::F32);
    let dent = c.randn(rows, 0.5, DType::F32);
    let entv = if entropy {
        entc.clone()
    } else {
        vec![0.0; rows]
    };
    let mut dxc = vec![0.0; rows * hidden];
    let dw0 = c.randn(vocab * hidden, 0.1, DType::F32);
    let mut dwc = dw0.clone();
    c.cpu.logprob_backward(
        &mut dxc,
        Some(&mut dwc),
        LogprobInput {
            x: &x,
            w: &w,
            targets: &tg,
        },
        LogprobGrad {
            dlp: &dlp,
            dent: entropy.then_some(&dent),
            lse: &lsec,
            ent: &entv,
        },
        s,
        &mut sc,
    )?;
    let (gl, ge, gdl, gde) = (
        c.dev(&lsec, DType::F32)?,
        c.dev(&entv, DType::F32)?,
        c.dev(&dlp, DType::F32)?,
        c.dev(&dent, DType::F32)?,
    );
    let mut gdx = c.poisoned(rows * hidden, d)?;
    let mut gdw = c.dev(&dw0, DType::F32)?;
    c.gpu.logprob_backward(
        &mut gdx,
        Some(&mut gdw),
        LogprobInput {
            x: &gx,
            w: &gw,
            targets: &gt,
        },
        LogprobGrad {
            dlp: &gdl,
            dent: entropy.then_some(&gde),
            lse: &gl,
            ent: &ge,
        },
        s,
        &mut gsc,
    )?;
    c.check(
        &format!("logprob_backward dx [{tag}]"),
        d,
        &gdx,
        &dxc,
        true,
        t,
    )?;
    c.check(
        &format!("logprob_backward dw [{tag}]"),
        d,
        &gdw,
        &dwc,
        false,
        t,
    )
}

fn logprob(c: &mut Ctx, d: DType) -> Result<()> {
    logprob_case(
        c,
        d,
        DType::F32,
        true,
        LogprobShape {
            rows: 150,
            hidden: 128,
            vocab: 3001,
            temperature: 0.7,
            chunk: 64,
        },
    )?;
    logprob_case(
        c,
        d,
        DType::F32,
        false,
        LogprobShape {
            rows: 33,
            hidden: 96,
            vocab: 5000,
            temperature: 1.0,
            chunk: 7,
        },
    )?;
    if d == DType::BF16 {
        logprob_case(
            c,
            d,
            DType::BF16,
            true,
            LogprobShape {
                rows: 100,
                hidden: 128,
                vocab: 3001,
                temperature: 1.0,
                chunk: 32,
            },
        )?;
    }
    // A target past the vocabulary is reported at the next synchronize.
    let s = LogprobShape {
        rows: 2,
        hidden: 8,
        vocab: 10,
        temperature: 1.0,
        chunk: 2,
    };
    let (hx, hw) = (c.randn(16, 1.0, d), c.randn(80, 1.0, d));
    let (gx, gw) = (c.dev(&hx, d)?, c.dev(&hw, d)?);
    let gt = c.idx(&[1, 10])?;
    let (mut lp, mut lse, mut sc) = (c.gpu.alloc(2)?, c.gpu.alloc(2)?, c.gpu.alloc(20)?);
    c.gpu.logprob(
        &mut lp,
        None,
        &mut lse,
        LogprobInput {
            x: &gx,
            w: &gw,
            targets: &gt,
        },
        s,
        &mut sc,
    )?;
    let first = c.gpu.synchronize();
    let ok = matches!(&first, Err(e) if e.to_string().contains("target token"))
        && c.gpu.synchronize().is_ok();
    c.flag(
        "logprob (target past vocab)",
        d,
        ok,
        match first {
            Err(e) => format!("reported: {e}"),
            Ok(()) => "not reported".into(),
        },
    );
    Ok(())
}

/// The LM head of one micro-batch tied to a [vocab, hidden] table, chunks of 1024 rows.
fn time(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (tok, hid, vocab) = (TOKENS, HIDDEN, VOCAB);
    let x = t.buf(tok * hid, DType::BF16, 1.0)?;
    let w = t.buf(vocab * hid, DType::BF16, 0.03)?;
    let chunk = 1024;
    let mut scratch = gpu.alloc(chunk * vocab)?;
    let targets: Vec<u32> = (0..tok as u32).map(|i| (i * 7919) % vocab as u32).collect();
    let gt = t.idx(&targets)?;
    let (mut lp, mut ent, mut lse) = (
        t.buf(tok, DType::F32, 0.0)?,
        t.buf(tok, DType::F32, 0.0)?,
        t.buf(tok, DType::F32, 0.0)?,
    );
    let ls = LogprobShape {
        rows: tok,
        hidden: hid,
        vocab,
        temperature: 1.0,
        chunk,
    };
    let head_flop = 2.0 * (tok * hid * vocab) as f64;
    t.time(
        "logprob (+entropy)",
        format!("{tok}×{hid}→{vocab}, chunk {chunk}"),
        head_flop,
        "TFLOP/s",
        || {
            gpu.logprob(
                &mut lp,
                Some(&mut ent),
                &mut lse,
                LogprobInput {
                    x: &x,
                    w: &w,
                    targets: &gt,
                },
                ls,
                &mut scratch,
            )
        },
    )?;
    let mut dx = t.buf(tok * hid, DType::BF16, 1.0)?;
    let mut dwh = gpu.alloc(vocab * hid)?;
    let dlp = t.buf(tok, DType::F32, 1.0)?;
    t.time(
        "logprob_backward",
        format!("{tok}×{hid}→{vocab}, chunk {chunk}"),
        3.0 * head_flop,
        "TFLOP/s",
        || {
            gpu.logprob_backward(
                &mut dx,
                Some(&mut dwh),
                LogprobInput {
                    x: &x,
                    w: &w,
                    targets: &gt,
                },
                LogprobGrad {
                    dlp: &dlp,
                    dent: None,
                    lse: &lse,
                    ent: &ent,
                },
                ls,
                &mut scratch,
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
