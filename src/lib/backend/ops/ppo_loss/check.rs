//! GPU check of the fused PPO-clip loss against the CPU reference.

use anyhow::Result;

use super::PPO_STATS;
use crate::backend::check::gpu::{round, Case, Ctx};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "ppo_loss",
    run: ppo_loss,
}];

/// The fused PPO-clip loss: on-policy (ties at r = 1), off-policy with both clip sides and
/// the dual clip hit, masked tokens, and the stats accumulating over two calls.
fn ppo_loss(c: &mut Ctx, d: DType) -> Result<()> {
    let n = 4099;
    let lp: Vec<f32> = c
        .randn(n, 1.0, d)
        .iter()
        .map(|v| round(v - 3.0, d))
        .collect();
    let noise = c.randn(n, 0.3, d);
    // Every 7th token has old = lp exactly (a ratio of 1 inside the clip range).
    let old: Vec<f32> = (0..n)
        .map(|t| match t % 13 {
            // A ratio of e^1.5 > c: the dual clip for negative advantages.
            5 => round(lp[t] - 1.5, d),
            _ if t % 7 == 0 => lp[t],
            _ => round(lp[t] + noise[t], d),
        })
        .collect();
    let adv = c.randn(n, 1.5, d);
    let ent: Vec<f32> = c
        .randn(n, 1.0, d)
        .iter()
        .map(|v| round(v.abs() + 0.5, d))
        .collect();
    let mut w = vec![0f32; 3 * n];
    for t in 0..n {
        if t % 11 != 3 {
            w[t] = round(1.0 / 4000.0 * (1.0 + (t % 5) as f32), d);
            w[n + t] = round(1.0 / 3700.0, d);
            w[2 * n + t] = round(1.0 / 3900.0 * (1.0 + (t % 3) as f32), d);
        }
    }
    let shape = PpoShape {
        tokens: n,
        ratio_low: 0.8,
        ratio_high: 1.28,
        dual_clip: 3.0,
    };
    let (glp, gold, gadv, gw, gent) = (
        c.dev(&lp, d)?,
        c.dev(&old, d)?,
        c.dev(&adv, d)?,
        c.dev(&w, d)?,
        c.dev(&ent, d)?,
    );
    let mut cstats = vec![0f32; PPO_STATS];
    let mut gstats = c.dev(&cstats, DType::F32)?;
    for (tag, off) in [("off-policy", true), ("on-policy", false)] {
        let mut cd = vec![0f32; n];
        c.cpu.ppo_clip_loss(
            &mut cd,
            &mut cstats,
            PpoInputs {
                lp: &lp,
                old: off.then_some(&old),
                adv: &adv,
                w: &w,
                ent: Some(&ent),
            },
            shape,
        )?;
        let mut gd = c.poisoned(n, DType::F32)?;
        c.gpu.ppo_clip_loss(
            &mut gd,
            &mut gstats,
            PpoInputs {
                lp: &glp,
                old: off.then_some(&gold),
                adv: &gadv,
                w: &gw,
                ent: Some(&gent),
            },
            shape,
        )?;
        c.check(
            &format!("ppo_clip_loss dlp [{tag}]"),
            d,
            &gd,
            &cd,
            true,
            1e-5,
        )?;
    }
    // Stats after both calls; the GPU sums in another order (f64), both store f32.
    c.check(
        "ppo_clip_loss stats (2 calls)",
        d,
        &gstats,
        &cstats,
        false,
        1e-5,
    )?;
    let clipped = cstats[1] > 0.0 && cstats[2] > 0.0;
    c.flag(
        "ppo_clip_loss: inputs hit both clips",
        d,
        clipped,
        format!("clipfrac {:.3}, lower {:.3}", cstats[1], cstats[2]),
    );
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
