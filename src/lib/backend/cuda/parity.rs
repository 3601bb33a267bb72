//! The op-level cases of `tandem gpu-test`: every op of the CUDA backend against the CPU
//! backend (the oracle) on fresh random inputs, in f32 and in bf16 storage. The runner
//! (`bench::gpu_test`) walks these cases ([`op_cases`]) and the whole-decoder and whole-engine
//! ones (`engine::check`), which use this suite's inputs, comparisons and table.
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

use anyhow::Result;
use half::bf16;
use serde::Serialize;

use super::{CudaBackend, CudaBuf, CudaIdx};
use crate::backend::cpu::Cpu;
use crate::backend::{
    AdamWStep, AttnShape, Backend, CachedAttnShape, DType, LogprobShape, PpoShape, PPO_STATS,
};
use crate::rng::SplitMix64;

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
const TAIL: usize = 5;

pub fn dname(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    }
}

pub fn round(v: f32, d: DType) -> f32 {
    match d {
        DType::F32 => v,
        DType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

/// Inputs come from the shared SplitMix64; ranges are usize here.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    pub fn normal(&mut self) -> f32 {
        self.0.normal()
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n.max(1) as u64) as usize
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

/// The state of one `gpu-test` run: the backend under test, the input generator and the rows
/// of the table so far.
pub struct Suite<'a> {
    cpu: Cpu,
    pub gpu: &'a CudaBackend,
    pub rng: Rng,
    pub rows: Vec<Row>,
    /// Whether the backend routes bf16 attention to the tensor-core kernels.
    mma: bool,
    /// GPU ordinal of `gpu` (whole-model checks open backends of their own on it).
    pub ordinal: usize,
}

/// Tolerances by dtype: (single-pass op, op with a longer chain of roundings).
pub fn tols(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (1e-4, 3e-4),
        DType::BF16 => (1e-2, 2e-2),
    }
}

impl<'a> Suite<'a> {
    /// A suite over `gpu` (device ordinal `ordinal`) with inputs from `seed`; it starts with
    /// the tensor-core attention kernels on, as the backend runs by default.
    pub fn new(gpu: &'a CudaBackend, ordinal: usize, seed: u64) -> Self {
        gpu.set_tensor_core_attention(true);
        Suite {
            cpu: Cpu,
            gpu,
            rng: Rng(SplitMix64(seed)),
            rows: Vec::new(),
            mma: true,
            ordinal,
        }
    }

    fn randn(&mut self, n: usize, scale: f32, d: DType) -> Vec<f32> {
        (0..n)
            .map(|_| round(self.rng.normal() * scale, d))
            .collect()
    }

    fn dev(&self, host: &[f32], d: DType) -> Result<CudaBuf> {
        let mut b = self.gpu.alloc_as(host.len(), d)?;
        self.gpu.upload(&mut b, host)?;
        Ok(b)
    }

    fn idx(&self, host: &[u32]) -> Result<CudaIdx> {
        let mut b = self.gpu.alloc_idx(host.len())?;
        self.gpu.upload_idx(&mut b, host)?;
        Ok(b)
    }

    /// A GPU output of n elements (plus the poisoned tail), all NaN.
    fn poisoned(&self, n: usize, d: DType) -> Result<CudaBuf> {
        self.dev(&vec![f32::NAN; n + TAIL], d)
    }

    /// Downloads `gpu` and records the comparison with `cpu` (and, when `tail`, that the
    /// poisoned tail past cpu.len() is still NaN).
    fn check(
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

    /// Records a check without an error measure (pass or fail, and why).
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

    // ---- cases -------------------------------------------------------------------------

    fn memory(&mut self, d: DType) -> Result<()> {
        let n = 10_007;
        let x = self.randn(n, 1.0, d);
        let g = self.dev(&x, d)?;
        self.check("upload/download", d, &g, &x, false, 0.0)?;

        let mut f = self.poisoned(n, d)?;
        self.gpu.fill(&mut f, n, -1.75)?;
        self.check("fill", d, &f, &vec![-1.75; n], true, 0.0)?;

        // copy: offsets within one type, then conversion to the other type and back.
        let mut c = self.poisoned(n - 100, d)?;
        self.gpu.copy(&mut c, 7, &g, 93, n - 107)?;
        self.gpu.fill(&mut c, 7, 0.5)?;
        let mut want = vec![0.5f32; 7];
        want.extend_from_slice(&x[93..n - 14]);
        self.check("copy (offsets)", d, &c, &want, true, 0.0)?;
        let other = if d == DType::F32 {
            DType::BF16
        } else {
            DType::F32
        };
        let mut o = self.dev(&vec![f32::NAN; n + TAIL], other)?;
        self.gpu.copy(&mut o, 0, &g, 0, n)?;
        let conv: Vec<f32> = x.iter().map(|&v| round(v, other)).collect();
        self.check("copy (convert)", d, &o, &conv, true, 0.0)?;

        let mut cw = self.dev(&x, d)?;
        self.gpu.copy_within(&mut cw, 5000, 17, 4000)?;
        let mut cwc = x.clone();
        self.cpu.copy_within(&mut cwc, 5000, 17, 4000)?;
        self.check("copy_within", d, &cw, &cwc, false, 0.0)?;

        let y0 = self.randn(n, 1.0, d);
        let mut y = self.dev(&y0, d)?;
        self.gpu.add_assign(&mut y, &g, n - 3)?;
        let mut yc = y0.clone();
        self.cpu.add_assign(&mut yc, &x, n - 3)?;
        let yc: Vec<f32> = yc.iter().map(|&v| round(v, d)).collect();
        self.check("add_assign", d, &y, &yc, false, tols(d).0)
    }

    #[allow(clippy::too_many_arguments)]
    fn one_matmul(
        &mut self,
        label: &str,
        d: DType,
        xd: DType,
        m: usize,
        k: usize,
        n: usize,
        bias: bool,
        acc: bool,
    ) -> Result<()> {
        let (t1, _) = tols(d);
        let x = self.randn(m * k, 1.0, xd);
        let w = self.randn(n * k, 0.05, d);
        let b = self.randn(n, 0.5, d);
        let y0 = self.randn(m * n, 1.0, d);
        let mut yc = if acc { y0.clone() } else { vec![0.0; m * n] };
        self.cpu
            .matmul(&mut yc, &x, &w, bias.then_some(&b), m, k, n, acc)?;
        let (gx, gw, gb) = (self.dev(&x, xd)?, self.dev(&w, d)?, self.dev(&b, d)?);
        let mut gy = if acc {
            let mut v = y0.clone();
            v.extend([f32::NAN; TAIL]);
            self.dev(&v, d)?
        } else {
            self.poisoned(m * n, d)?
        };
        self.gpu
            .matmul(&mut gy, &gx, &gw, bias.then_some(&gb), m, k, n, acc)?;
        self.check(label, d, &gy, &yc, true, t1)
    }

    fn matmul(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        self.one_matmul("matmul (+bias)", d, d, 200, 320, 384, true, false)?;
        self.one_matmul("matmul (+=)", d, d, 200, 320, 384, false, true)?;
        self.one_matmul(
            "matmul (odd sizes, +bias, +=)",
            d,
            d,
            37,
            53,
            71,
            true,
            true,
        )?;
        if d == DType::BF16 {
            self.one_matmul(
                "matmul (f32 x, bf16 w)",
                d,
                DType::F32,
                64,
                96,
                80,
                true,
                false,
            )?;
        }
        // y = r + x·wᵀ into an f32 output (the residual stream): one GEMM reading r as C; an r of
        // another type takes the copy-and-accumulate path.
        for (label, rd) in [
            ("matmul_residual (f32 y, r)", DType::F32),
            ("matmul_residual (r in the run's type)", d),
        ] {
            let (m, k, n) = (96, 160, 224);
            let r = self.randn(m * n, 1.0, rd);
            let x = self.randn(m * k, 1.0, d);
            let w = self.randn(n * k, 0.05, d);
            let mut yc = vec![0.0; m * n];
            self.cpu.matmul_residual(&mut yc, &r, &x, &w, m, k, n)?;
            let gr = self.dev(&r, rd)?;
            let mut gy = self.poisoned(m * n, DType::F32)?;
            self.gpu.matmul_residual(
                &mut gy,
                &gr,
                &self.dev(&x, d)?,
                &self.dev(&w, d)?,
                m,
                k,
                n,
            )?;
            self.check(label, d, &gy, &yc, true, t1)?;
            let mut back = vec![0f32; m * n];
            self.gpu.download(&gr, &mut back)?;
            self.flag(
                &format!("{label}: r unchanged"),
                d,
                back == r,
                String::new(),
            );
        }
        let (m, k, n) = (150, 256, 192);
        let dy = self.randn(m * n, 1.0, d);
        let w = self.randn(n * k, 0.05, d);
        let x = self.randn(m * k, 1.0, d);
        let (gdy, gw, gx) = (self.dev(&dy, d)?, self.dev(&w, d)?, self.dev(&x, d)?);
        for acc in [false, true] {
            let dx0 = self.randn(m * k, 1.0, d);
            let mut dxc = if acc { dx0.clone() } else { vec![0.0; m * k] };
            self.cpu
                .matmul_backward_x(&mut dxc, &dy, &w, m, k, n, acc)?;
            let mut gdx = if acc {
                let mut v = dx0.clone();
                v.extend([f32::NAN; TAIL]);
                self.dev(&v, d)?
            } else {
                self.poisoned(m * k, d)?
            };
            self.gpu
                .matmul_backward_x(&mut gdx, &gdy, &gw, m, k, n, acc)?;
            let label = if acc {
                "matmul_backward_x (+=)"
            } else {
                "matmul_backward_x"
            };
            self.check(label, d, &gdx, &dxc, true, t1)?;
        }
        // Parameter gradients are f32 and accumulate.
        let dw0 = self.randn(n * k, 1.0, DType::F32);
        let db0 = self.randn(n, 1.0, DType::F32);
        let (mut dwc, mut dbc) = (dw0.clone(), db0.clone());
        self.cpu
            .matmul_backward_w(&mut dwc, Some(&mut dbc), &dy, &x, m, k, n)?;
        let (mut gdw, mut gdb) = (self.dev(&dw0, DType::F32)?, self.dev(&db0, DType::F32)?);
        self.gpu
            .matmul_backward_w(&mut gdw, Some(&mut gdb), &gdy, &gx, m, k, n)?;
        self.check("matmul_backward_w dw", d, &gdw, &dwc, false, t1)?;
        self.check("matmul_backward_w db", d, &gdb, &dbc, false, t1)
    }

    fn embedding(&mut self, d: DType) -> Result<()> {
        let (vocab, dim, tokens) = (1000, 96, 300);
        let table = self.randn(vocab * dim, 1.0, d);
        // Ids repeat (a small range) so the backward's atomics have collisions to add up.
        let ids: Vec<u32> = (0..tokens).map(|_| self.rng.below(120) as u32).collect();
        let mut oc = vec![0.0; tokens * dim];
        self.cpu.embedding(&mut oc, &table, &ids, tokens, dim)?;
        let (gt, gi) = (self.dev(&table, d)?, self.idx(&ids)?);
        let mut go = self.poisoned(tokens * dim, d)?;
        self.gpu.embedding(&mut go, &gt, &gi, tokens, dim)?;
        self.check("embedding", d, &go, &oc, true, 0.0)?;
        let dout = self.randn(tokens * dim, 1.0, d);
        let dt0 = self.randn(vocab * dim, 1.0, DType::F32);
        let mut dtc = dt0.clone();
        self.cpu
            .embedding_backward(&mut dtc, &dout, &ids, tokens, dim)?;
        let mut gdt = self.dev(&dt0, DType::F32)?;
        self.gpu
            .embedding_backward(&mut gdt, &self.dev(&dout, d)?, &gi, tokens, dim)?;
        self.check("embedding_backward", d, &gdt, &dtc, false, 1e-5)?;
        // A token id past the vocabulary is reported at the next synchronize, then cleared.
        let bad = self.idx(&[3, vocab as u32 + 5])?;
        let mut out2 = self.poisoned(2 * dim, d)?;
        self.gpu.embedding(&mut out2, &gt, &bad, 2, dim)?;
        let first = self.gpu.synchronize();
        let second = self.gpu.synchronize();
        let ok = matches!(&first, Err(e) if e.to_string().contains("token id")) && second.is_ok();
        self.flag(
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

    fn rmsnorm(&mut self, d: DType) -> Result<()> {
        let (t1, t2) = tols(d);
        let (rows, dim, eps) = (150, 896, 1e-6);
        let x = self.randn(rows * dim, 1.0, d);
        let w = self.randn(dim, 1.0, d);
        let (mut yc, mut rc) = (vec![0.0; rows * dim], vec![0.0; rows]);
        self.cpu.rmsnorm(&mut yc, &mut rc, &x, &w, rows, dim, eps)?;
        let (gx, gw) = (self.dev(&x, d)?, self.dev(&w, d)?);
        let (mut gy, mut gr) = (
            self.poisoned(rows * dim, d)?,
            self.poisoned(rows, DType::F32)?,
        );
        self.gpu
            .rmsnorm(&mut gy, &mut gr, &gx, &gw, rows, dim, eps)?;
        self.check("rmsnorm y", d, &gy, &yc, true, t1)?;
        self.check("rmsnorm rstd", d, &gr, &rc, true, 1e-5)?;
        let dy = self.randn(rows * dim, 1.0, d);
        let gdy = self.dev(&dy, d)?;
        for acc in [false, true] {
            let dx0 = self.randn(rows * dim, 1.0, d);
            let dw0 = self.randn(dim, 1.0, DType::F32);
            let (mut dxc, mut dwc) = (
                if acc {
                    dx0.clone()
                } else {
                    vec![0.0; rows * dim]
                },
                dw0.clone(),
            );
            self.cpu
                .rmsnorm_backward(&mut dxc, &mut dwc, &dy, &x, &w, &rc, rows, dim, acc)?;
            let mut gdx = if acc {
                let mut v = dx0.clone();
                v.extend([f32::NAN; TAIL]);
                self.dev(&v, d)?
            } else {
                self.poisoned(rows * dim, d)?
            };
            let mut gdw = self.dev(&dw0, DType::F32)?;
            self.gpu
                .rmsnorm_backward(&mut gdx, &mut gdw, &gdy, &gx, &gw, &gr, rows, dim, acc)?;
            let sfx = if acc { " (+=)" } else { "" };
            self.check(
                &format!("rmsnorm_backward dx{sfx}"),
                d,
                &gdx,
                &dxc,
                true,
                t2,
            )?;
            self.check(
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

    fn rope(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        let (tokens, heads, hd, theta) = (300, 6, 64, 1_000_000.0);
        let pos: Vec<u32> = (0..tokens).map(|_| self.rng.below(4096) as u32).collect();
        let gp = self.idx(&pos)?;
        let x = self.randn(tokens * heads * hd, 1.0, d);
        for back in [false, true] {
            let mut xc = x.clone();
            let mut gx = {
                let mut v = x.clone();
                v.extend([f32::NAN; TAIL]);
                self.dev(&v, d)?
            };
            if back {
                self.cpu
                    .rope_backward(&mut xc, &pos, tokens, heads, hd, theta)?;
                self.gpu
                    .rope_backward(&mut gx, &gp, tokens, heads, hd, theta)?;
            } else {
                self.cpu.rope(&mut xc, &pos, tokens, heads, hd, theta)?;
                self.gpu.rope(&mut gx, &gp, tokens, heads, hd, theta)?;
            }
            let label = if back { "rope_backward" } else { "rope" };
            self.check(label, d, &gx, &xc, true, t1)?;
        }
        Ok(())
    }

    fn attention_case(
        &mut self,
        d: DType,
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
        let path = if d == DType::BF16 && self.mma && hd.is_multiple_of(16) && hd <= 128 {
            "mma"
        } else {
            "fma"
        };
        let tag = format!("{path} h{heads}/kv{kv} d{hd} T{tokens}");
        let (qn, kn) = (tokens * heads * hd, tokens * kv * hd);
        let q = self.randn(qn, 1.0, d);
        let k = self.randn(kn, 1.0, d);
        let v = self.randn(kn, 1.0, d);
        let (mut oc, mut lc) = (vec![0.0; qn], vec![0.0; tokens * heads]);
        self.cpu.attention(&mut oc, &mut lc, &q, &k, &v, &cu, s)?;
        let (gq, gk, gv, gcu) = (
            self.dev(&q, d)?,
            self.dev(&k, d)?,
            self.dev(&v, d)?,
            self.idx(&cu)?,
        );
        let (mut go, mut gl) = (
            self.poisoned(qn, d)?,
            self.poisoned(tokens * heads, DType::F32)?,
        );
        self.gpu
            .attention(&mut go, &mut gl, &gq, &gk, &gv, &gcu, s)?;
        self.check(&format!("attention o [{tag}]"), d, &go, &oc, true, t1)?;
        self.check(&format!("attention lse [{tag}]"), d, &gl, &lc, true, t1)?;
        // The backward takes the CPU's o and lse (stored as the GPU would) so it is tested alone.
        let oc_d: Vec<f32> = oc.iter().map(|&x| round(x, d)).collect();
        let dout = self.randn(qn, 1.0, d);
        let (mut dqc, mut dkc, mut dvc) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
        self.cpu.attention_backward(
            &mut dqc, &mut dkc, &mut dvc, &dout, &q, &k, &v, &oc_d, &lc, &cu, s,
        )?;
        let (gdo, go2, gl2) = (
            self.dev(&dout, d)?,
            self.dev(&oc_d, d)?,
            self.dev(&lc, DType::F32)?,
        );
        let (mut gdq, mut gdk, mut gdv) = (
            self.poisoned(qn, d)?,
            self.poisoned(kn, d)?,
            self.poisoned(kn, d)?,
        );
        self.gpu.attention_backward(
            &mut gdq, &mut gdk, &mut gdv, &gdo, &gq, &gk, &gv, &go2, &gl2, &gcu, s,
        )?;
        self.check(
            &format!("attention_backward dq [{tag}]"),
            d,
            &gdq,
            &dqc,
            true,
            t2,
        )?;
        self.check(
            &format!("attention_backward dk [{tag}]"),
            d,
            &gdk,
            &dkc,
            true,
            t2,
        )?;
        self.check(
            &format!("attention_backward dv [{tag}]"),
            d,
            &gdv,
            &dvc,
            true,
            t2,
        )
    }

    fn attention(&mut self, d: DType) -> Result<()> {
        // bf16 runs both kernels: tensor cores (the default) and the scalar fallback.
        if d == DType::BF16 {
            self.mma = false;
            self.gpu.set_tensor_core_attention(false);
            let r = self.attention_cases(d);
            self.mma = true;
            self.gpu.set_tensor_core_attention(true);
            r?;
        }
        self.attention_cases(d)
    }

    fn attention_cases(&mut self, d: DType) -> Result<()> {
        // Packed sequences of awkward lengths (1, a partial tile, tiles that straddle bounds).
        self.attention_case(d, &[1, 37, 64, 129, 200, 5], 4, 2, 64)?;
        // The Qwen2.5-0.5B head layout (14 query heads over 2 kv heads) at the bench length.
        self.attention_case(d, &[640, 3], 14, 2, 64)?;
        self.attention_case(d, &[100, 77], 8, 8, 128)?;
        self.attention_case(d, &[50, 21], 3, 1, 96)?;
        self.attention_case(d, &[70], 2, 1, 256)
    }

    fn cached(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        let (heads, kv, hd, cache_rows, n) = (8, 2, 64, 500, 40);
        let row = kv * hd;
        let kc0 = self.randn(cache_rows * row, 1.0, d);
        let vc0 = self.randn(cache_rows * row, 1.0, d);
        let knew = self.randn(n * row, 1.0, d);
        let vnew = self.randn(n * row, 1.0, d);
        // Distinct rows: a random sample of the cache.
        let mut all: Vec<u32> = (0..cache_rows as u32).collect();
        for i in 0..n {
            let j = i + self.rng.below(cache_rows - i);
            all.swap(i, j);
        }
        let rows = all[..n].to_vec();
        let (mut kcc, mut vcc) = (kc0.clone(), vc0.clone());
        self.cpu
            .kv_store(&mut kcc, &mut vcc, &knew, &vnew, &rows, n, row)?;
        let (mut gkc, mut gvc) = (self.dev(&kc0, d)?, self.dev(&vc0, d)?);
        let gr = self.idx(&rows)?;
        self.gpu.kv_store(
            &mut gkc,
            &mut gvc,
            &self.dev(&knew, d)?,
            &self.dev(&vnew, d)?,
            &gr,
            n,
            row,
        )?;
        self.check("kv_store k", d, &gkc, &kcc, false, 0.0)?;
        self.check("kv_store v", d, &gvc, &vcc, false, 0.0)?;
        let queries = 12;
        let (mut base, mut len) = (vec![], vec![]);
        for _ in 0..queries {
            let l = 1 + self.rng.below(300);
            base.push(self.rng.below(cache_rows - l + 1) as u32);
            len.push(l as u32);
        }
        let s = CachedAttnShape {
            queries,
            heads,
            kv_heads: kv,
            head_dim: hd,
        };
        let q = self.randn(queries * heads * hd, 1.0, d);
        let mut oc = vec![0.0; queries * heads * hd];
        self.cpu
            .attention_cached(&mut oc, &q, &kcc, &vcc, &base, &len, s)?;
        let mut go = self.poisoned(oc.len(), d)?;
        self.gpu.attention_cached(
            &mut go,
            &self.dev(&q, d)?,
            &gkc,
            &gvc,
            &self.idx(&base)?,
            &self.idx(&len)?,
            s,
        )?;
        self.check("attention_cached", d, &go, &oc, true, t1)
    }

    fn swiglu(&mut self, d: DType) -> Result<()> {
        // 50,001: the scalar kernels; 49,992 (a multiple of 8): the vectorized ones in bf16.
        self.swiglu_n(d, 50_001, "")?;
        self.swiglu_n(d, 49_992, " [n % 8 = 0]")
    }

    fn swiglu_n(&mut self, d: DType, n: usize, tag: &str) -> Result<()> {
        let (t1, _) = tols(d);
        let g = self.randn(n, 2.0, d);
        let u = self.randn(n, 1.0, d);
        let mut hc = vec![0.0; n];
        self.cpu.swiglu(&mut hc, &g, &u, n)?;
        let (gg, gu) = (self.dev(&g, d)?, self.dev(&u, d)?);
        let mut gh = self.poisoned(n, d)?;
        self.gpu.swiglu(&mut gh, &gg, &gu, n)?;
        self.check(&format!("swiglu{tag}"), d, &gh, &hc, true, t1)?;
        let dh = self.randn(n, 1.0, d);
        let (mut dgc, mut duc) = (vec![0.0; n], vec![0.0; n]);
        self.cpu
            .swiglu_backward(&mut dgc, &mut duc, &dh, &g, &u, n)?;
        let (mut gdg, mut gdu) = (self.poisoned(n, d)?, self.poisoned(n, d)?);
        self.gpu
            .swiglu_backward(&mut gdg, &mut gdu, &self.dev(&dh, d)?, &gg, &gu, n)?;
        self.check(&format!("swiglu_backward dg{tag}"), d, &gdg, &dgc, true, t1)?;
        self.check(&format!("swiglu_backward du{tag}"), d, &gdu, &duc, true, t1)
    }

    fn gather(&mut self, d: DType) -> Result<()> {
        let (xrows, dim, n) = (300, 96, 150);
        let x = self.randn(xrows * dim, 1.0, d);
        let mut perm: Vec<u32> = (0..xrows as u32).collect();
        for i in 0..n {
            let j = i + self.rng.below(xrows - i);
            perm.swap(i, j);
        }
        let rows = perm[..n].to_vec();
        let mut oc = vec![0.0; n * dim];
        self.cpu.gather_rows(&mut oc, &x, &rows, n, dim)?;
        let (gx, gr) = (self.dev(&x, d)?, self.idx(&rows)?);
        let mut go = self.poisoned(n * dim, d)?;
        self.gpu.gather_rows(&mut go, &gx, &gr, n, dim)?;
        self.check("gather_rows", d, &go, &oc, true, 0.0)?;
        let dout = self.randn(n * dim, 1.0, d);
        let dx0 = self.randn(xrows * dim, 1.0, d);
        let mut dxc = dx0.clone();
        self.cpu.scatter_add_rows(&mut dxc, &dout, &rows, n, dim)?;
        let dxc: Vec<f32> = dxc.iter().map(|&v| round(v, d)).collect();
        let mut gdx = self.dev(&dx0, d)?;
        self.gpu
            .scatter_add_rows(&mut gdx, &self.dev(&dout, d)?, &gr, n, dim)?;
        self.check("scatter_add_rows", d, &gdx, &dxc, false, tols(d).0)
    }

    #[allow(clippy::too_many_arguments)]
    fn logprob_case(
        &mut self,
        d: DType,
        sd: DType,
        entropy: bool,
        rows: usize,
        hidden: usize,
        vocab: usize,
        chunk: usize,
        temp: f32,
    ) -> Result<()> {
        let (_, t2) = tols(d);
        // A bf16 scratch rounds the logits themselves: a looser bound.
        let t = if sd == DType::BF16 { 3e-2 } else { t2 };
        let s = LogprobShape {
            rows,
            hidden,
            vocab,
            temperature: temp,
            chunk,
        };
        let tag = format!(
            "{}{} scratch {}",
            if entropy { "+ent " } else { "" },
            rows,
            dname(sd)
        );
        let x = self.randn(rows * hidden, 1.0, d);
        let w = self.randn(vocab * hidden, 0.2, d);
        let tg: Vec<u32> = (0..rows).map(|_| self.rng.below(vocab) as u32).collect();
        let (mut lpc, mut entc, mut lsec, mut sc) = (
            vec![0.0; rows],
            vec![0.0; rows],
            vec![0.0; rows],
            vec![0.0; chunk * vocab],
        );
        self.cpu.logprob(
            &mut lpc,
            entropy.then_some(&mut entc),
            &mut lsec,
            &x,
            &w,
            &tg,
            s,
            &mut sc,
        )?;
        let (gx, gw, gt) = (self.dev(&x, d)?, self.dev(&w, d)?, self.idx(&tg)?);
        let (mut glp, mut gent, mut glse) = (
            self.poisoned(rows, DType::F32)?,
            self.poisoned(rows, DType::F32)?,
            self.poisoned(rows, DType::F32)?,
        );
        let mut gsc = self.gpu.alloc_as(chunk * vocab, sd)?;
        self.gpu.logprob(
            &mut glp,
            entropy.then_some(&mut gent),
            &mut glse,
            &gx,
            &gw,
            &gt,
            s,
            &mut gsc,
        )?;
        self.check(&format!("logprob lp [{tag}]"), d, &glp, &lpc, true, t)?;
        self.check(&format!("logprob lse [{tag}]"), d, &glse, &lsec, true, t)?;
        if entropy {
            self.check(
                &format!("logprob entropy [{tag}]"),
                d,
                &gent,
                &entc,
                true,
                t,
            )?;
        }
        // Backward from the CPU's statistics, with random upstream gradients.
        let dlp = self.randn(rows, 1.0, DType::F32);
        let dent = self.randn(rows, 0.5, DType::F32);
        let entv = if entropy {
            entc.clone()
        } else {
            vec![0.0; rows]
        };
        let mut dxc = vec![0.0; rows * hidden];
        let dw0 = self.randn(vocab * hidden, 0.1, DType::F32);
        let mut dwc = dw0.clone();
        self.cpu.logprob_backward(
            &mut dxc,
            &mut dwc,
            &x,
            &w,
            &tg,
            &lsec,
            &entv,
            &dlp,
            entropy.then_some(&dent),
            s,
            &mut sc,
        )?;
        let (gl, ge, gdl, gde) = (
            self.dev(&lsec, DType::F32)?,
            self.dev(&entv, DType::F32)?,
            self.dev(&dlp, DType::F32)?,
            self.dev(&dent, DType::F32)?,
        );
        let mut gdx = self.poisoned(rows * hidden, d)?;
        let mut gdw = self.dev(&dw0, DType::F32)?;
        self.gpu.logprob_backward(
            &mut gdx,
            &mut gdw,
            &gx,
            &gw,
            &gt,
            &gl,
            &ge,
            &gdl,
            entropy.then_some(&gde),
            s,
            &mut gsc,
        )?;
        self.check(
            &format!("logprob_backward dx [{tag}]"),
            d,
            &gdx,
            &dxc,
            true,
            t,
        )?;
        self.check(
            &format!("logprob_backward dw [{tag}]"),
            d,
            &gdw,
            &dwc,
            false,
            t,
        )
    }

    fn logprob(&mut self, d: DType) -> Result<()> {
        self.logprob_case(d, DType::F32, true, 150, 128, 3001, 64, 0.7)?;
        self.logprob_case(d, DType::F32, false, 33, 96, 5000, 7, 1.0)?;
        if d == DType::BF16 {
            self.logprob_case(d, DType::BF16, true, 100, 128, 3001, 32, 1.0)?;
        }
        // A target past the vocabulary is reported at the next synchronize.
        let s = LogprobShape {
            rows: 2,
            hidden: 8,
            vocab: 10,
            temperature: 1.0,
            chunk: 2,
        };
        let (hx, hw) = (self.randn(16, 1.0, d), self.randn(80, 1.0, d));
        let (gx, gw) = (self.dev(&hx, d)?, self.dev(&hw, d)?);
        let gt = self.idx(&[1, 10])?;
        let (mut lp, mut lse, mut sc) =
            (self.gpu.alloc(2)?, self.gpu.alloc(2)?, self.gpu.alloc(20)?);
        self.gpu
            .logprob(&mut lp, None, &mut lse, &gx, &gw, &gt, s, &mut sc)?;
        let first = self.gpu.synchronize();
        let ok = matches!(&first, Err(e) if e.to_string().contains("target token"))
            && self.gpu.synchronize().is_ok();
        self.flag(
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

    /// The fused PPO-clip loss: on-policy (ties at r = 1), off-policy with both clip sides and
    /// the dual clip hit, masked tokens, and the stats accumulating over two calls.
    fn ppo_loss(&mut self, d: DType) -> Result<()> {
        let n = 4099;
        let lp: Vec<f32> = self
            .randn(n, 1.0, d)
            .iter()
            .map(|v| round(v - 3.0, d))
            .collect();
        let noise = self.randn(n, 0.3, d);
        // Every 7th token has old = lp exactly (a ratio of 1 inside the clip range).
        let old: Vec<f32> = (0..n)
            .map(|t| match t % 13 {
                // A ratio of e^1.5 > c: the dual clip for negative advantages.
                5 => round(lp[t] - 1.5, d),
                _ if t % 7 == 0 => lp[t],
                _ => round(lp[t] + noise[t], d),
            })
            .collect();
        let adv = self.randn(n, 1.5, d);
        let ent: Vec<f32> = self
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
            self.dev(&lp, d)?,
            self.dev(&old, d)?,
            self.dev(&adv, d)?,
            self.dev(&w, d)?,
            self.dev(&ent, d)?,
        );
        let mut cstats = vec![0f32; PPO_STATS];
        let mut gstats = self.dev(&cstats, DType::F32)?;
        for (tag, off) in [("off-policy", true), ("on-policy", false)] {
            let mut cd = vec![0f32; n];
            self.cpu.ppo_clip_loss(
                &mut cd,
                &mut cstats,
                &lp,
                off.then_some(&old),
                &adv,
                &w,
                Some(&ent),
                shape,
            )?;
            let mut gd = self.poisoned(n, DType::F32)?;
            self.gpu.ppo_clip_loss(
                &mut gd,
                &mut gstats,
                &glp,
                off.then_some(&gold),
                &gadv,
                &gw,
                Some(&gent),
                shape,
            )?;
            self.check(
                &format!("ppo_clip_loss dlp [{tag}]"),
                d,
                &gd,
                &cd,
                true,
                1e-5,
            )?;
        }
        // Stats after both calls; the GPU sums in another order (f64), both store f32.
        self.check(
            "ppo_clip_loss stats (2 calls)",
            d,
            &gstats,
            &cstats,
            false,
            1e-5,
        )?;
        let clipped = cstats[1] > 0.0 && cstats[2] > 0.0;
        self.flag(
            "ppo_clip_loss: inputs hit both clips",
            d,
            clipped,
            format!("clipfrac {:.3}, lower {:.3}", cstats[1], cstats[2]),
        );
        Ok(())
    }

    fn optim(&mut self, d: DType) -> Result<()> {
        let n = 1_000_017;
        let x = self.randn(n, 1.0, d);
        let cpu = self.cpu.sum_squares(&x, n)?;
        let gpu = self.gpu.sum_squares(&self.dev(&x, d)?, n)?;
        let rel = (gpu - cpu).abs() / cpu.abs().max(1e-300);
        self.rows.push(Row {
            op: "sum_squares".into(),
            dtype: dname(d),
            max_abs: (gpu - cpu).abs(),
            max_rel: rel,
            tol: 1e-9,
            pass: rel <= 1e-9,
            note: String::new(),
        });
        // Several buffers (one empty) summed before one read-back.
        let (y, z) = (self.randn(333, 2.0, d), self.randn(77_777, 0.5, d));
        let cpu_all = self
            .cpu
            .sum_squares_all(&[(&x, n), (&y, 0), (&y, 300), (&z, 77_777)])?;
        let (gx, gy, gz) = (self.dev(&x, d)?, self.dev(&y, d)?, self.dev(&z, d)?);
        let gpu_all = self
            .gpu
            .sum_squares_all(&[(&gx, n), (&gy, 0), (&gy, 300), (&gz, 77_777)])?;
        let rel = (gpu_all - cpu_all).abs() / cpu_all.abs().max(1e-300);
        self.rows.push(Row {
            op: "sum_squares_all".into(),
            dtype: dname(d),
            max_abs: (gpu_all - cpu_all).abs(),
            max_rel: rel,
            tol: 1e-9,
            pass: rel <= 1e-9,
            note: String::new(),
        });
        // AdamW on f32 master weights and moments; the gradient in the run's type.
        let n = 100_003;
        let p0 = self.randn(n, 1.0, DType::F32);
        let g = self.randn(n, 1.0, d);
        let m0 = self.randn(n, 0.1, DType::F32);
        let v0: Vec<f32> = self
            .randn(n, 0.1, DType::F32)
            .iter()
            .map(|v| v * v)
            .collect();
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
        self.cpu.adamw(&mut pc, &g, &mut mc, &mut vc, n, &st)?;
        let (mut gp, mut gm, mut gv) = (
            self.dev(&p0, DType::F32)?,
            self.dev(&m0, DType::F32)?,
            self.dev(&v0, DType::F32)?,
        );
        self.gpu
            .adamw(&mut gp, &self.dev(&g, d)?, &mut gm, &mut gv, n, &st)?;
        self.check("adamw p", d, &gp, &pc, false, 1e-6)?;
        self.check("adamw m", d, &gm, &mc, false, 1e-6)?;
        self.check("adamw v", d, &gv, &vc, false, 1e-6)
    }
}

#[path = "parity_paged.rs"]
mod paged;

/// A check: runs on the suite for one storage dtype and adds its rows.
pub type Case<'g> = fn(&mut Suite<'g>, DType) -> Result<()>;

/// The op-level checks by name (the names `gpu-test --only` filters on), in table order.
pub fn op_cases<'g>() -> Vec<(&'static str, Case<'g>)> {
    vec![
        ("memory", Suite::memory),
        ("matmul", Suite::matmul),
        ("embedding", Suite::embedding),
        ("rmsnorm", Suite::rmsnorm),
        ("rope", Suite::rope),
        ("attention", Suite::attention),
        ("attention_cached", Suite::cached),
        ("swiglu", Suite::swiglu),
        ("gather_rows", Suite::gather),
        ("logprob", Suite::logprob),
        ("ppo_loss", Suite::ppo_loss),
        ("optim", Suite::optim),
        ("attention_paged", Suite::paged_attention),
        ("rope_store_kv", Suite::rope_store_kv),
        ("rope_store_kv_packed", Suite::rope_store_kv_packed),
        ("attention_paged_rope", Suite::attention_paged_rope),
        ("swiglu_packed", Suite::swiglu_packed),
        ("alloc_parts", Suite::alloc_parts),
        ("gemm_invariance", Suite::gemm_invariance),
        ("attention_invariance", Suite::attention_invariance),
        ("sample", Suite::sample),
    ]
}

fn fmt_err(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.2e}")
    }
}

/// Prints the pass/fail table; returns the number of failures.
pub fn print_table(rows: &[Row]) -> usize {
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
        let (mut a, mut b) = (Rng(SplitMix64(7)), Rng(SplitMix64(7)));
        let va: Vec<f32> = (0..100).map(|_| a.normal()).collect();
        let vb: Vec<f32> = (0..100).map(|_| b.normal()).collect();
        assert_eq!(va, vb);
        assert!(va.iter().all(|v| *v != 0.0 && v.is_finite()));
        let mean = va.iter().sum::<f32>() / 100.0;
        assert!(mean.abs() < 0.4, "{mean}");
    }
}
