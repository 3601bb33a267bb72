//! The GPU parity harness: each op family's `check.rs` compares the CUDA backend against the
//! CPU backend (the oracle) on fresh random inputs, in f32 and in bf16 storage, through a
//! [`Ctx`]; `tandem gpu-test` walks the registry (`backend::ops::op_cases`), and each family's
//! cases also run from `cargo test` where a GPU is present ([`run_for_test`]).
//!
//! - Inputs are random normals (never zeros), from a seed printed at the start (`--seed` replays
//!   a run). In bf16 runs the inputs are rounded to bf16 first, so both backends see the same
//!   numbers and only the GPU's bf16 stores and its summation order differ.
//! - Every output buffer of the GPU is poisoned with NaN before the op and is longer than the
//!   op's extent: an element the op should write but did not shows up as NaN, and a write past
//!   the extent shows up as a tail that is no longer NaN.
//! - Ops that accumulate into their output (parameter gradients, `+=` variants) start from the
//!   same random values on both sides instead.
//! - Error: `max abs` = max |gpu − cpu|; `max rel` = max abs / max |cpu| (error relative to the
//!   scale of the reference tensor). A check passes when max rel ≤ tol and nothing is NaN.
//! - Device-side input faults (token id or target outside the vocabulary) must surface as an
//!   error at the next `synchronize`, and leave the backend usable.

use std::path::PathBuf;

use anyhow::Result;
use half::bf16;
use serde::Serialize;

use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaBackend, CudaBuf, CudaIdx};
use crate::backend::{DType, Device};
use crate::rng::SplitMix64;

/// One GPU parity case: compares the GPU with the CPU in one storage type and adds its rows to
/// the table. `name` is what `gpu-test --only` matches.
#[derive(Clone, Copy)]
pub struct Case {
    pub name: &'static str,
    pub run: fn(&mut Ctx<'_>, DType) -> Result<()>,
}

/// One line of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub op: String,
    pub dtype: &'static str,
    pub max_abs: f64,
    pub max_rel: f64,
    pub tol: f64,
    pub pass: bool,
    pub note: String,
}

/// Extra elements past each GPU output's extent, poisoned, that must stay NaN.
pub(crate) const TAIL: usize = 5;

/// The storage types every case runs in, in order.
pub(crate) const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

pub(crate) fn dname(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    }
}

/// `v` as a buffer of type `d` stores it (bf16: nearest even).
pub fn round(v: f32, d: DType) -> f32 {
    match d {
        DType::F32 => v,
        DType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

/// Tolerances by dtype: (single-pass op, op with a longer chain of roundings).
pub(crate) fn tols(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (1e-4, 3e-4),
        DType::BF16 => (1e-2, 2e-2),
    }
}

/// The cases' inputs: the shared SplitMix64 seeded with the run's seed; ranges are usize.
pub(crate) struct CaseRng(SplitMix64);

impl CaseRng {
    pub fn new(seed: u64) -> Self {
        CaseRng(SplitMix64(seed))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    pub fn normal(&mut self) -> f32 {
        self.0.normal()
    }

    /// Uniform in 0..n (0 when n is 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n.max(1) as u64) as usize
    }

    /// `n` distinct values of `0..of` in random order (a partial Fisher-Yates shuffle).
    pub fn distinct(&mut self, n: usize, of: usize) -> Vec<u32> {
        let mut all: Vec<u32> = (0..of as u32).collect();
        for i in 0..n {
            let j = i + self.below(of - i);
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}

/// Compares a GPU result with the CPU's; returns (max abs, max rel, first problem).
pub fn compare(gpu: &[f32], cpu: &[f32], tail: &[f32]) -> (f64, f64, Option<String>) {
    let mut problem = None;
    let mut max_abs = 0f64;
    let mut scale = 0f64;
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        if g.is_nan() && problem.is_none() {
            problem = Some(format!("NaN at element {i} (unwritten?)"));
        }
        max_abs = max_abs.max((g as f64 - c as f64).abs());
        scale = scale.max((c as f64).abs());
    }
    if problem.is_none() {
        if let Some(i) = tail.iter().position(|v| !v.is_nan()) {
            problem = Some(format!("wrote past its extent (element {})", gpu.len() + i));
        }
    }
    let rel = if scale > 0.0 {
        max_abs / scale
    } else {
        max_abs
    };
    (max_abs, rel, problem)
}

/// What a case works with: both backends, the inputs' generator and the table so far.
pub struct Ctx<'a> {
    pub cpu: Cpu,
    pub gpu: &'a CudaBackend,
    pub(crate) rng: CaseRng,
    pub rows: Vec<Row>,
    /// GPU ordinal (cases that build a second backend open it on the same GPU).
    pub ordinal: usize,
    /// Where cases find their fixture files (the tiny HF models with transformers' log-probs
    /// of the `hf_fixtures` case; `gpu-test --hf-fixtures`).
    pub fixtures: PathBuf,
}

impl<'a> Ctx<'a> {
    pub fn new(gpu: &'a CudaBackend, ordinal: usize, seed: u64) -> Self {
        Ctx {
            cpu: Cpu,
            gpu,
            rng: CaseRng::new(seed),
            rows: Vec::new(),
            ordinal,
            fixtures: PathBuf::from("tests/fixtures/hf"),
        }
    }

    /// `n` normals times `scale`, rounded to `d`.
    pub fn randn(&mut self, n: usize, scale: f32, d: DType) -> Vec<f32> {
        (0..n)
            .map(|_| round(self.rng.normal() * scale, d))
            .collect()
    }

    /// `host` uploaded to a new GPU buffer of type `d`.
    pub fn dev(&self, host: &[f32], d: DType) -> Result<CudaBuf> {
        let mut b = self.gpu.alloc_as(host.len(), d)?;
        self.gpu.upload(&mut b, host)?;
        Ok(b)
    }

    /// `host` uploaded to a new GPU index buffer.
    pub fn idx(&self, host: &[u32]) -> Result<CudaIdx> {
        let mut b = self.gpu.alloc_idx(host.len())?;
        self.gpu.upload_idx(&mut b, host)?;
        Ok(b)
    }

    /// A GPU output of n elements (plus the poisoned tail), all NaN.
    pub(crate) fn poisoned(&self, n: usize, d: DType) -> Result<CudaBuf> {
        self.dev(&vec![f32::NAN; n + TAIL], d)
    }

    /// Downloads `gpu` and records the comparison with `cpu` (and, when `tail`, that the
    /// poisoned tail past cpu.len() is still NaN).
    pub fn check(
        &mut self,
        op: &str,
        d: DType,
        gpu: &CudaBuf,
        cpu: &[f32],
        tail: bool,
        tol: f64,
    ) -> Result<()> {
        let n = cpu.len() + if tail { TAIL } else { 0 };
        let mut host = vec![0f32; n];
        self.gpu.download(gpu, &mut host)?;
        let (a, r, problem) = compare(&host[..cpu.len()], cpu, &host[cpu.len()..]);
        let pass = problem.is_none() && r <= tol;
        self.rows.push(Row {
            op: op.to_string(),
            dtype: dname(d),
            max_abs: a,
            max_rel: r,
            tol,
            pass,
            note: problem.unwrap_or_default(),
        });
        Ok(())
    }

    /// Records a pass/fail row without numbers.
    pub fn flag(&mut self, op: &str, d: DType, pass: bool, note: String) {
        self.rows.push(Row {
            op: op.to_string(),
            dtype: dname(d),
            max_abs: f64::NAN,
            max_rel: f64::NAN,
            tol: f64::NAN,
            pass,
            note,
        });
    }

    /// Flags `op` as passed when every named comparison held ("bit-identical"), else lists
    /// the ones that differ.
    pub(crate) fn flag_same(&mut self, op: &str, d: DType, same: &[(&str, bool)]) {
        let differ: Vec<&str> = same.iter().filter(|x| !x.1).map(|x| x.0).collect();
        let note = if differ.is_empty() {
            "bit-identical".into()
        } else {
            format!("differ: {}", differ.join(", "))
        };
        self.flag(op, d, differ.is_empty(), note);
    }

    /// Records a scalar result (a reduction) against the CPU's.
    pub fn scalar(&mut self, op: &str, d: DType, gpu: f64, cpu: f64, tol: f64) {
        let rel = (gpu - cpu).abs() / cpu.abs().max(1e-300);
        self.rows.push(Row {
            op: op.into(),
            dtype: dname(d),
            max_abs: (gpu - cpu).abs(),
            max_rel: rel,
            tol,
            pass: rel <= tol,
            note: String::new(),
        });
    }

    /// Runs `case` in `d`; an error becomes a failed row named after the case.
    pub fn run(&mut self, case: &Case, d: DType) {
        if let Err(e) = (case.run)(self, d) {
            self.flag(case.name, d, false, format!("error: {e:#}"));
        }
    }
}

/// The first `n` elements of a GPU buffer as bit patterns (bf16 widens to f32 exactly).
pub fn bits(gpu: &CudaBackend, b: &CudaBuf, n: usize) -> Result<Vec<u32>> {
    let mut h = vec![0f32; n];
    gpu.download(b, &mut h)?;
    Ok(h.iter().map(|v| v.to_bits()).collect())
}

fn fmt_err(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.2e}")
    }
}

/// Prints the pass/fail table; returns the number of failures.
pub(crate) fn print_table(rows: &[Row]) -> usize {
    let w = rows.iter().map(|r| r.op.len()).max().unwrap_or(2).max(2);
    println!(
        "{:<w$}  {:<5}  {:>11}  {:>11}  {:>8}  result",
        "op", "dtype", "max abs err", "max rel err", "tol"
    );
    let mut failed = 0;
    for r in rows {
        failed += !r.pass as usize;
        println!(
            "{:<w$}  {:<5}  {:>11}  {:>11}  {:>8}  {}{}",
            r.op,
            r.dtype,
            fmt_err(r.max_abs),
            fmt_err(r.max_rel),
            fmt_err(r.tol),
            if r.pass { "PASS" } else { "FAIL" },
            if r.note.is_empty() {
                String::new()
            } else {
                format!("  ({})", r.note)
            }
        );
    }
    failed
}

/// A family's cases from `cargo test`: on GPU 0 in f32 and bf16 (seed 1), failing on any
/// failed row; without a usable GPU it says so and passes.
#[cfg(test)]
pub(crate) fn run_for_test(cases: &[Case]) {
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("no GPU here ({e:#}): GPU parity cases skipped");
            return;
        }
    };
    let mut ctx = Ctx::new(&gpu, 0, 1);
    for d in DTYPES {
        for case in cases {
            ctx.run(case, d);
        }
    }
    let failed = print_table(&ctx.rows);
    assert!(!ctx.rows.is_empty(), "the cases recorded nothing");
    assert_eq!(
        failed,
        0,
        "{failed} of {} parity checks failed",
        ctx.rows.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_flags_unwritten_and_overrun_elements() {
        let (a, r, p) = compare(&[1.0, 2.5], &[1.0, 2.0], &[f32::NAN]);
        assert_eq!((a, r), (0.5, 0.25));
        assert!(p.is_none());
        let (_, _, p) = compare(&[1.0, f32::NAN], &[1.0, 2.0], &[]);
        assert!(p.unwrap().contains("element 1"));
        let (_, _, p) = compare(&[1.0], &[1.0], &[f32::NAN, 0.0]);
        assert!(p.unwrap().contains("past its extent (element 2)"));
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(round(1.0 + 1.0 / 256.0, DType::BF16), 1.0);
        assert_eq!(round(1.0 + 3.0 / 256.0, DType::BF16), 1.0 + 4.0 / 256.0);
        assert_eq!(round(0.1, DType::F32), 0.1);
    }

    #[test]
    fn the_rng_is_reproducible_and_never_all_zero() {
        let (mut a, mut b) = (CaseRng::new(7), CaseRng::new(7));
        let va: Vec<f32> = (0..100).map(|_| a.normal()).collect();
        let vb: Vec<f32> = (0..100).map(|_| b.normal()).collect();
        assert_eq!(va, vb);
        assert!(va.iter().all(|v| *v != 0.0 && v.is_finite()));
        let mean = va.iter().sum::<f32>() / 100.0;
        assert!(mean.abs() < 0.4, "{mean}");
        assert!((0..100).all(|_| a.below(3) < 3));
        assert_eq!(a.below(0), 0);
        let mut rows = a.distinct(40, 50);
        assert_eq!(rows.len(), 40);
        rows.sort();
        rows.dedup();
        assert!(rows.len() == 40 && rows[39] < 50);
    }

    #[test]
    fn the_table_counts_failures() {
        let row = |pass| Row {
            op: "x".into(),
            dtype: "f32",
            max_abs: 0.0,
            max_rel: 0.0,
            tol: 0.0,
            pass,
            note: String::new(),
        };
        assert_eq!(print_table(&[row(true), row(false), row(false)]), 2);
    }
}
