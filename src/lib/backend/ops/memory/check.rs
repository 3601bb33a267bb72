//! GPU checks of the memory ops (and of the device's transfers, copies and `alloc_parts`
//! views), and the timing of the f32 → bf16 weight copy.

use anyhow::{anyhow, Result};

use crate::backend::check::gpu::{round, tols, Case, Ctx, TAIL};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::cuda::PART_ALIGN;
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[
    Case {
        name: "memory",
        run: memory,
    },
    Case {
        name: "gather_rows",
        run: gather,
    },
    Case {
        name: "kv_store",
        run: kv_store,
    },
    Case {
        name: "alloc_parts",
        run: alloc_parts,
    },
];

pub(crate) const TIMINGS: &[Timing] = &[Timing {
    name: "memory",
    run: time,
}];

/// Transfers, fill, copies (offsets, type conversion, within one buffer) and add_assign.
fn memory(c: &mut Ctx, d: DType) -> Result<()> {
    let n = 10_007;
    let x = c.randn(n, 1.0, d);
    let g = c.dev(&x, d)?;
    c.check("upload/download", d, &g, &x, false, 0.0)?;

    let mut f = c.poisoned(n, d)?;
    c.gpu.fill(&mut f, n, -1.75)?;
    c.check("fill", d, &f, &vec![-1.75; n], true, 0.0)?;

    // copy: offsets within one type, then conversion to the other type and back.
    let mut cp = c.poisoned(n - 100, d)?;
    c.gpu.copy(&mut cp, 7, &g, 93, n - 107)?;
    c.gpu.fill(&mut cp, 7, 0.5)?;
    let mut want = vec![0.5f32; 7];
    want.extend_from_slice(&x[93..n - 14]);
    c.check("copy (offsets)", d, &cp, &want, true, 0.0)?;
    let other = if d == DType::F32 {
        DType::BF16
    } else {
        DType::F32
    };
    let mut o = c.dev(&vec![f32::NAN; n + TAIL], other)?;
    c.gpu.copy(&mut o, 0, &g, 0, n)?;
    let conv: Vec<f32> = x.iter().map(|&v| round(v, other)).collect();
    c.check("copy (convert)", d, &o, &conv, true, 0.0)?;

    let mut cw = c.dev(&x, d)?;
    c.gpu.copy_within(&mut cw, 5000, 17, 4000)?;
    let mut cwc = x.clone();
    c.cpu.copy_within(&mut cwc, 5000, 17, 4000)?;
    c.check("copy_within", d, &cw, &cwc, false, 0.0)?;

    let y0 = c.randn(n, 1.0, d);
    let mut y = c.dev(&y0, d)?;
    c.gpu.add_assign(&mut y, &g, n - 3)?;
    let mut yc = y0.clone();
    c.cpu.add_assign(&mut yc, &x, n - 3)?;
    let yc: Vec<f32> = yc.iter().map(|&v| round(v, d)).collect();
    c.check("add_assign", d, &y, &yc, false, tols(d).0)
}

/// gather_rows of a random sample of rows, then scatter_add_rows back onto random values.
fn gather(c: &mut Ctx, d: DType) -> Result<()> {
    let (xrows, dim, n) = (300, 96, 150);
    let x = c.randn(xrows * dim, 1.0, d);
    let rows = c.rng.distinct(n, xrows);
    let mut oc = vec![0.0; n * dim];
    c.cpu.gather_rows(&mut oc, &x, &rows, n, dim)?;
    let (gx, gr) = (c.dev(&x, d)?, c.idx(&rows)?);
    let mut go = c.poisoned(n * dim, d)?;
    c.gpu.gather_rows(&mut go, &gx, &gr, n, dim)?;
    c.check("gather_rows", d, &go, &oc, true, 0.0)?;
    let dout = c.randn(n * dim, 1.0, d);
    let dx0 = c.randn(xrows * dim, 1.0, d);
    let mut dxc = dx0.clone();
    c.cpu.scatter_add_rows(&mut dxc, &dout, &rows, n, dim)?;
    let dxc: Vec<f32> = dxc.iter().map(|&v| round(v, d)).collect();
    let mut gdx = c.dev(&dx0, d)?;
    c.gpu
        .scatter_add_rows(&mut gdx, &c.dev(&dout, d)?, &gr, n, dim)?;
    c.check("scatter_add_rows", d, &gdx, &dxc, false, tols(d).0)
}

/// A step's keys and values stored into distinct random rows of a cache (bit for bit).
fn kv_store(c: &mut Ctx, d: DType) -> Result<()> {
    let (kv, hd, cache_rows, n) = (2, 64, 500, 40);
    let row = kv * hd;
    let kc0 = c.randn(cache_rows * row, 1.0, d);
    let vc0 = c.randn(cache_rows * row, 1.0, d);
    let knew = c.randn(n * row, 1.0, d);
    let vnew = c.randn(n * row, 1.0, d);
    let rows = c.rng.distinct(n, cache_rows);
    let (mut kcc, mut vcc) = (kc0.clone(), vc0.clone());
    c.cpu.kv_store(
        KvCache {
            k: &mut kcc,
            v: &mut vcc,
        },
        &knew,
        &vnew,
        &rows,
        n,
        row,
    )?;
    let (mut gkc, mut gvc) = (c.dev(&kc0, d)?, c.dev(&vc0, d)?);
    let gr = c.idx(&rows)?;
    c.gpu.kv_store(
        KvCache {
            k: &mut gkc,
            v: &mut gvc,
        },
        &c.dev(&knew, d)?,
        &c.dev(&vnew, d)?,
        &gr,
        n,
        row,
    )?;
    c.check("kv_store k", d, &gkc, &kcc, false, 0.0)?;
    c.check("kv_store v", d, &gvc, &vcc, false, 0.0)
}

/// The refresh of the bf16 compute weights from the f32 masters after an optimizer step.
fn time(t: &mut Timer) -> Result<()> {
    let gpu = t.gpu;
    let np = shape::PARAMS;
    let p = t.buf(np, DType::F32, 1.0)?;
    let mut pb = gpu.alloc_as(np, DType::BF16)?;
    t.time(
        "copy f32→bf16 (weights)",
        format!("{np}"),
        (np * 6) as f64,
        "GB/s",
        || gpu.copy(&mut pb, 0, &p, 0, np),
    )
}

/// `alloc_parts`: each part a view at the previous part's end rounded up to 256 bytes
/// (computed here), the whole buffer holding what was uploaded into the parts and zeros
/// in the padding, an op on one part leaving its neighbours alone, the parts living on
/// after the whole is dropped; sizes that need no padding give the parts concatenated.
fn alloc_parts(c: &mut Ctx, d: DType) -> Result<()> {
    let es = if d == DType::F32 { 4 } else { 2 };
    // Odd sizes (padding, an empty part) and the tiny model's q/k/v shapes (none).
    for (tag, sizes) in [
        ("padded", vec![1000usize, 37, 0, 300, 65]),
        ("q/k/v", vec![256 * 256, 128 * 256, 128 * 256]),
    ] {
        let (whole, mut parts) = c
            .gpu
            .alloc_parts(&sizes, d)?
            .ok_or_else(|| anyhow!("the CUDA backend gave no parts"))?;
        let data: Vec<Vec<f32>> = sizes.iter().map(|&n| c.randn(n, 1.0, d)).collect();
        let mut problems = Vec::new();
        let mut want: Vec<f32> = Vec::new();
        for (i, (p, x)) in parts.iter_mut().zip(&data).enumerate() {
            c.gpu.upload(p, x)?;
            let off = want.len().div_ceil(PART_ALIGN / es) * (PART_ALIGN / es);
            want.resize(off, 0.0);
            want.extend_from_slice(x);
            if p.ptr != whole.ptr + (off * es) as u64 || p.len != x.len() {
                problems.push(format!(
                    "part {i}: {} elements at byte {}, expected {} at {}",
                    p.len,
                    p.ptr - whole.ptr,
                    x.len(),
                    off * es
                ));
            }
            if !p.ptr.is_multiple_of(PART_ALIGN as u64) {
                problems.push(format!("part {i} is not {PART_ALIGN}-byte aligned"));
            }
        }
        if whole.len != want.len() {
            problems.push(format!(
                "whole holds {} elements, expected {}",
                whole.len,
                want.len()
            ));
        }
        if tag == "q/k/v" && whole.len != sizes.iter().sum::<usize>() {
            problems.push("padding between parts that need none".into());
        }
        c.check(
            &format!("alloc_parts {tag} (whole)"),
            d,
            &whole,
            &want,
            false,
            0.0,
        )?;
        // fill of part 1 only.
        let n1 = parts[1].len;
        c.gpu.fill(&mut parts[1], n1, -3.5)?;
        let off1 = ((parts[1].ptr - whole.ptr) as usize) / es;
        want[off1..off1 + n1].iter_mut().for_each(|v| *v = -3.5);
        c.check(
            &format!("alloc_parts {tag} (fill of one part)"),
            d,
            &whole,
            &want,
            false,
            0.0,
        )?;
        // Dropping the whole keeps the memory: a new buffer of its size must not get it.
        let last = parts.len() - 1;
        let (n_last, off_last) = (
            parts[last].len,
            ((parts[last].ptr - whole.ptr) as usize) / es,
        );
        drop(whole);
        let other = c.dev(&vec![9.0; want.len()], d)?;
        c.check(
            &format!("alloc_parts {tag} (part after the whole is dropped)"),
            d,
            &parts[last],
            &want[off_last..off_last + n_last],
            false,
            0.0,
        )?;
        drop(other);
        c.flag(
            &format!("alloc_parts {tag} layout"),
            d,
            problems.is_empty(),
            if problems.is_empty() {
                format!("{} parts, {} elements in all", sizes.len(), want.len())
            } else {
                problems.join("; ")
            },
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
