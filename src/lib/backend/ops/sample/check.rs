//! GPU check of sampling: greedy, full softmax, top-k, top-p and both, against the host sampler
//! per row (the CPU op), over a peaked 151,936-token vocabulary.

use anyhow::Result;

use super::{Draws, SamplingParams};
use crate::backend::check::gpu::{Case, Ctx};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "sample",
    run: sample,
}];

fn sample(c: &mut Ctx, d: DType) -> Result<()> {
    let (rows, vocab) = (64usize, 151_936usize);
    // Logits of a peaked distribution (a few large values) over a large vocabulary, as a
    // model's are; f32 as the decoder's logits buffer is.
    let mut logits = c.randn(rows * vocab, 2.0, DType::F32);
    for r in 0..rows {
        for _ in 0..20 {
            let v = c.rng.below(vocab);
            logits[r * vocab + v] += 8.0;
        }
    }
    let keys: Vec<u32> = (0..2 * rows).map(|_| c.rng.next_u64() as u32).collect();
    let pos: Vec<u32> = (0..rows).map(|_| c.rng.below(1000) as u32).collect();
    let gl = c.dev(&logits, DType::F32)?;
    let (gk, gp) = (c.idx(&keys)?, c.idx(&pos)?);
    let settings = [
        ("greedy", SamplingParams::greedy()),
        (
            "T=1",
            SamplingParams {
                temperature: 1.0,
                top_k: -1,
                top_p: 1.0,
            },
        ),
        (
            "T=0.7 top-k 50",
            SamplingParams {
                temperature: 0.7,
                top_k: 50,
                top_p: 1.0,
            },
        ),
        (
            "T=1 top-p 0.9",
            SamplingParams {
                temperature: 1.0,
                top_k: -1,
                top_p: 0.9,
            },
        ),
        (
            "T=0.8 top-k 100 top-p 0.8",
            SamplingParams {
                temperature: 0.8,
                top_k: 100,
                top_p: 0.8,
            },
        ),
    ];
    for (tag, p) in settings {
        let (mut ct, mut cl) = (vec![0u32; rows], vec![0f32; rows]);
        c.cpu.sample(
            &logits,
            vocab,
            Draws {
                tokens: &mut ct,
                logprobs: &mut cl,
                keys: &keys,
                positions: &pos,
                rows,
                sampling: &p,
            },
        )?;
        let mut gt = c.gpu.alloc_idx(rows)?;
        let mut glp = c.gpu.alloc(rows)?;
        c.gpu.sample(
            &gl,
            vocab,
            Draws {
                tokens: &mut gt,
                logprobs: &mut glp,
                keys: &gk,
                positions: &gp,
                rows,
                sampling: &p,
            },
        )?;
        let (mut ht, mut hl) = (vec![0u32; rows], vec![0f32; rows]);
        c.gpu.download_idx(&gt, &mut ht)?;
        c.gpu.download(&glp, &mut hl)?;
        let same = ht.iter().zip(&ct).filter(|(a, b)| a == b).count();
        let lp_err = ht
            .iter()
            .zip(&ct)
            .zip(hl.iter().zip(&cl))
            .filter(|((a, b), _)| a == b)
            .map(|(_, (x, y))| (x - y).abs() as f64)
            .fold(0.0, f64::max);
        // Tokens must agree (a draw within ~1e-7 of a CDF boundary could flip: allow one);
        // log-probs of agreeing tokens to f32 rounding.
        let pass = same + 1 >= rows && lp_err <= 1e-4;
        c.flag(
            &format!("sample {tag}"),
            d,
            pass,
            format!("{same}/{rows} tokens equal, max |Δ logprob| {lp_err:.2e}"),
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
