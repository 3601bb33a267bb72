//! GPU checks of the squared norm (one buffer and many) and of AdamW, and their timings.

use anyhow::Result;

use crate::backend::check::gpu::{Case, Ctx};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "optim",
    run: optim,
}];

pub(crate) const TIMINGS: &[Timing] = &[Timing {
    name: "adamw",
    run: time,
}];

fn optim(c: &mut Ctx, d: DType) -> Result<()> {
    let n = 1_000_017;
    let x = c.randn(n, 1.0, d);
    let cpu = c.cpu.sum_squares(&x, n)?;
    let gpu = c.gpu.sum_squares(&c.dev(&x, d)?, n)?;
    c.scalar("sum_squares", d, gpu, cpu, 1e-9);
    // Several buffers (one empty) summed before one read-back.
    let (y, z) = (c.randn(333, 2.0, d), c.randn(77_777, 0.5, d));
    let cpu_all = c
        .cpu
        .sum_squares_all(&[(&x, n), (&y, 0), (&y, 300), (&z, 77_777)])?;
    let (gx, gy, gz) = (c.dev(&x, d)?, c.dev(&y, d)?, c.dev(&z, d)?);
    let gpu_all = c
        .gpu
        .sum_squares_all(&[(&gx, n), (&gy, 0), (&gy, 300), (&gz, 77_777)])?;
    c.scalar("sum_squares_all", d, gpu_all, cpu_all, 1e-9);
    // AdamW on f32 master weights and moments; the gradient in the run's type.
    let n = 100_003;
    let p0 = c.randn(n, 1.0, DType::F32);
    let g = c.randn(n, 1.0, d);
    let m0 = c.randn(n, 0.1, DType::F32);
    let v0: Vec<f32> = c.randn(n, 0.1, DType::F32).iter().map(|v| v * v).collect();
    let step = 3;
    let st = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        bias_correction1: 1.0 - 0.9f32.powi(step),
        bias_correction2: 1.0 - 0.95f32.powi(step),
        grad_scale: 0.7,
    };
    let (mut pc, mut mc, mut vc) = (p0.clone(), m0.clone(), v0.clone());
    c.cpu.adamw(&mut pc, &g, &mut mc, &mut vc, n, &st)?;
    let (mut gp, mut gm, mut gv) = (
        c.dev(&p0, DType::F32)?,
        c.dev(&m0, DType::F32)?,
        c.dev(&v0, DType::F32)?,
    );
    c.gpu
        .adamw(&mut gp, &c.dev(&g, d)?, &mut gm, &mut gv, n, &st)?;
    c.check("adamw p", d, &gp, &pc, false, 1e-6)?;
    c.check("adamw m", d, &gm, &mc, false, 1e-6)?;
    c.check("adamw v", d, &gv, &vc, false, 1e-6)
}

/// AdamW and the squared norm over the Qwen2.5-0.5B parameters (f32 master, grads, moments).
fn time(t: &mut Timer) -> Result<()> {
    let gpu = t.gpu;
    let np = shape::PARAMS;
    let f32t = DType::F32;
    let (mut p, gr, mut m, mut vv) = (
        t.buf(np, f32t, 1.0)?,
        t.buf(np, f32t, 1e-3)?,
        t.buf(np, f32t, 1e-3)?,
        t.buf(np, f32t, 1e-6)?,
    );
    let st = AdamWStep {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
        grad_scale: 1.0,
    };
    t.time(
        "adamw (f32)",
        format!("{np} params"),
        (np * 4 * 7) as f64,
        "GB/s",
        || gpu.adamw(&mut p, &gr, &mut m, &mut vv, np, &st),
    )?;
    t.time(
        "sum_squares (f32)",
        format!("{np}"),
        (np * 4) as f64,
        "GB/s",
        || gpu.sum_squares(&gr, np).map(|_| ()),
    )
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
