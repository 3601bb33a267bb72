//! GPU checks of the embedding lookup and its backward (repeated ids add up).

use anyhow::Result;

use crate::backend::check::gpu::{Case, Ctx};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[Case {
    name: "embedding",
    run: embedding,
}];

fn embedding(c: &mut Ctx, d: DType) -> Result<()> {
    let (vocab, dim, tokens) = (1000, 96, 300);
    let table = c.randn(vocab * dim, 1.0, d);
    // Ids repeat (a small range) so the backward's atomics have collisions to add up.
    let ids: Vec<u32> = (0..tokens).map(|_| c.rng.below(120) as u32).collect();
    let mut oc = vec![0.0; tokens * dim];
    c.cpu.embedding(&mut oc, &table, &ids, tokens, dim)?;
    let (gt, gi) = (c.dev(&table, d)?, c.idx(&ids)?);
    let mut go = c.poisoned(tokens * dim, d)?;
    c.gpu.embedding(&mut go, &gt, &gi, tokens, dim)?;
    c.check("embedding", d, &go, &oc, true, 0.0)?;
    let dout = c.randn(tokens * dim, 1.0, d);
    let dt0 = c.randn(vocab * dim, 1.0, DType::F32);
    let mut dtc = dt0.clone();
    c.cpu
        .embedding_backward(&mut dtc, &dout, &ids, tokens, dim)?;
    let mut gdt = c.dev(&dt0, DType::F32)?;
    c.gpu
        .embedding_backward(&mut gdt, &c.dev(&dout, d)?, &gi, tokens, dim)?;
    c.check("embedding_backward", d, &gdt, &dtc, false, 1e-5)?;
    // A token id past the vocabulary is reported at the next synchronize, then cleared.
    let bad = c.idx(&[3, vocab as u32 + 5])?;
    let mut out2 = c.poisoned(2 * dim, d)?;
    c.gpu.embedding(&mut out2, &gt, &bad, 2, dim)?;
    let first = c.gpu.synchronize();
    let second = c.gpu.synchronize();
    let ok = matches!(&first, Err(e) if e.to_string().contains("token id")) && second.is_ok();
    c.flag(
        "embedding (id past vocab)",
        d,
        ok,
        match first {
            Err(e) => format!("reported: {e}"),
            Ok(()) => "not reported".into(),
        },
    );
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
