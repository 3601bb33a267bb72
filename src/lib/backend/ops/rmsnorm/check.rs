//! GPU checks of RMSNorm forward and backward (dx overwritten and accumulated), and its
//! timings.

use anyhow::Result;

use crate::backend::check::gpu::{bits, tols, Case, Ctx, TAIL};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[
    Case {
        name: "rmsnorm",
        run: rmsnorm,
    },
    Case {
        name: "rmsnorm long rows",
        run: rmsnorm_long,
    },
];

pub(crate) const TIMINGS: &[Timing] = &[
    Timing {
        name: "rmsnorm",
        run: time_train,
    },
    Timing {
        name: "decode rmsnorm",
        run: time_decode,
    },
];

fn rmsnorm(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, t2) = tols(d);
    let (rows, dim, eps) = (150, 896, 1e-6);
    let x = c.randn(rows * dim, 1.0, d);
    let w = c.randn(dim, 1.0, d);
    let (mut yc, mut rc) = (vec![0.0; rows * dim], vec![0.0; rows]);
    c.cpu
        .rmsnorm(&mut yc, &mut rc, &x, &w, RmsNormShape { rows, dim, eps })?;
    let (gx, gw) = (c.dev(&x, d)?, c.dev(&w, d)?);
    let (mut gy, mut gr) = (c.poisoned(rows * dim, d)?, c.poisoned(rows, DType::F32)?);
    c.gpu
        .rmsnorm(&mut gy, &mut gr, &gx, &gw, RmsNormShape { rows, dim, eps })?;
    c.check("rmsnorm y", d, &gy, &yc, true, t1)?;
    c.check("rmsnorm rstd", d, &gr, &rc, true, 1e-5)?;
    let dy = c.randn(rows * dim, 1.0, d);
    let gdy = c.dev(&dy, d)?;
    for acc in [false, true] {
        let dx0 = c.randn(rows * dim, 1.0, d);
        let dw0 = c.randn(dim, 1.0, DType::F32);
        let (mut dxc, mut dwc) = (
            if acc {
                dx0.clone()
            } else {
                vec![0.0; rows * dim]
            },
            dw0.clone(),
        );
        c.cpu.rmsnorm_backward(
            &mut dxc,
            &mut dwc,
            &dy,
            RmsNormSaved {
                x: &x,
                w: &w,
                rstd: &rc,
            },
            RmsNormShape { rows, dim, eps },
            acc,
        )?;
        let mut gdx = if acc {
            let mut v = dx0.clone();
            v.extend([f32::NAN; TAIL]);
            c.dev(&v, d)?
        } else {
            c.poisoned(rows * dim, d)?
        };
        let mut gdw = c.dev(&dw0, DType::F32)?;
        c.gpu.rmsnorm_backward(
            &mut gdx,
            &mut gdw,
            &gdy,
            RmsNormSaved {
                x: &gx,
                w: &gw,
                rstd: &gr,
            },
            RmsNormShape { rows, dim, eps },
            acc,
        )?;
        let sfx = if acc { " (+=)" } else { "" };
        c.check(
            &format!("rmsnorm_backward dx{sfx}"),
            d,
            &gdx,
            &dxc,
            true,
            t2,
        )?;
        c.check(
            &format!("rmsnorm_backward dw{sfx}"),
            d,
            &gdw,
            &dwc,
            false,
            t1,
        )?;
    }
    Ok(())
}

/// Rows past what a warp keeps in registers (the 1.5B, 7B and 14B hidden sizes take the
/// block-per-row kernel; 1,100 is not a multiple of 8 and takes the warp's loop), with x in the
/// case's dtype and in f32 (the decoder's residual stream), against the CPU; and a row's output
/// does not depend on how many rows the call has.
fn rmsnorm_long(c: &mut Ctx, d: DType) -> Result<()> {
    for dim in [1536, 3584, 5120, 1100] {
        let xds: &[DType] = if d == DType::F32 {
            &[d]
        } else {
            &[d, DType::F32]
        };
        for &xd in xds {
            rmsnorm_long_one(c, d, xd, dim)?;
        }
    }
    Ok(())
}

fn rmsnorm_long_one(c: &mut Ctx, d: DType, xd: DType, dim: usize) -> Result<()> {
    let (t1, _) = tols(d);
    let (rows, eps) = (37, 1e-6);
    let x = c.randn(rows * dim, 1.0, xd);
    let w = c.randn(dim, 1.0, d);
    let (mut yc, mut rc) = (vec![0.0; rows * dim], vec![0.0; rows]);
    let s = RmsNormShape { rows, dim, eps };
    c.cpu.rmsnorm(&mut yc, &mut rc, &x, &w, s)?;
    let (gx, gw) = (c.dev(&x, xd)?, c.dev(&w, d)?);
    let (mut gy, mut gr) = (c.poisoned(rows * dim, d)?, c.poisoned(rows, DType::F32)?);
    c.gpu.rmsnorm(&mut gy, &mut gr, &gx, &gw, s)?;
    let x_is = format!("dim {dim}, x {xd:?}");
    c.check(&format!("rmsnorm y, {x_is}"), d, &gy, &yc, true, t1)?;
    c.check(&format!("rmsnorm rstd, {x_is}"), d, &gr, &rc, true, 1e-5)?;
    let few = RmsNormShape { rows: 5, ..s };
    let (mut gy5, mut gr5) = (c.poisoned(5 * dim, d)?, c.poisoned(5, DType::F32)?);
    c.gpu.rmsnorm(&mut gy5, &mut gr5, &gx, &gw, few)?;
    let y_same = bits(c.gpu, &gy, 5 * dim)? == bits(c.gpu, &gy5, 5 * dim)?;
    let r_same = bits(c.gpu, &gr, 5)? == bits(c.gpu, &gr5, 5)?;
    c.flag_same(
        &format!("rmsnorm {x_is}: 5 rows alone = the same rows of 37"),
        d,
        &[("y", y_same), ("rstd", r_same)],
    );
    Ok(())
}

/// One micro-batch: forward into bf16, then the backward (dx overwritten, dw accumulated).
fn time_train(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (tok, hid) = (TOKENS, HIDDEN);
    let x = t.buf(tok * hid, DType::BF16, 1.0)?;
    let mut y = t.buf(tok * hid, DType::BF16, 1.0)?;
    let wn = t.buf(hid, DType::BF16, 1.0)?;
    let mut rstd = t.buf(tok, DType::F32, 1.0)?;
    let s = RmsNormShape {
        rows: tok,
        dim: hid,
        eps: 1e-6,
    };
    t.time(
        "rmsnorm",
        format!("{tok}×{hid}"),
        (tok * hid * 4) as f64,
        "GB/s",
        || gpu.rmsnorm(&mut y, &mut rstd, &x, &wn, s),
    )?;
    let mut dx = t.buf(tok * hid, DType::BF16, 1.0)?;
    let mut dwn = t.buf(hid, DType::F32, 0.0)?;
    t.time(
        "rmsnorm_backward",
        format!("{tok}×{hid}"),
        (tok * hid * 2 * 4) as f64,
        "GB/s",
        || {
            gpu.rmsnorm_backward(
                &mut dx,
                &mut dwn,
                &y,
                RmsNormSaved {
                    x: &x,
                    w: &wn,
                    rstd: &rstd,
                },
                s,
                false,
            )
        },
    )
}

/// A decode step's norm: the f32 residual stream into bf16 (graph-replayed).
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (rows, hid) = (DECODE_ROWS, HIDDEN);
    let res = t.buf(rows * hid, DType::F32, 1.0)?;
    let wn = t.buf(hid, DType::BF16, 1.0)?;
    let mut xn = t.buf(rows * hid, DType::BF16, 1.0)?;
    let mut rstd = t.buf(rows, DType::F32, 1.0)?;
    t.time_graph(
        "decode rmsnorm (f32 → bf16)",
        format!("{rows} rows × {hid}"),
        (rows * hid * 6) as f64,
        "GB/s",
        || {
            gpu.rmsnorm(
                &mut xn,
                &mut rstd,
                &res,
                &wn,
                RmsNormShape {
                    rows,
                    dim: hid,
                    eps: 1e-6,
                },
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
