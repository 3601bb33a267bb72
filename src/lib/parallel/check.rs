//! Checks of a communicator against values computed on the host: every collective, f32 and
//! bf16, on views with offsets (the elements around a view must keep their values), grouped
//! and overlapped with compute, and identical results on every rank. `tandem dist-test` runs
//! them on each rank of a job (CPU in CI; CUDA ranks under `tandem launch` on a GPU machine),
//! [`gpu_rows`] at world size 1 for `gpu-test`.
//!
//! Inputs are a function of (seed, case, rank), so every rank computes every rank's input and
//! the expected result. With rank-order reductions (the CPU communicator) results must equal
//! the host loop bit for bit; NCCL reduces in its own order, so its sums are compared within
//! 2·n·ε·Σ|terms| (ε = 2⁻²³ for f32, 2⁻⁷ for bf16, whose partial sums NCCL rounds).
//! Gathers and broadcasts move values unchanged and are always compared bit for bit.
//!
//! `dist-test` also prints a few small cases with hand-checkable values (the tests compare
//! them with numbers worked out by hand) and can inject a failure on one rank (exit, SIGKILL,
//! hang) to test that every other rank stops, naming it.

use super::comm::{dtype_name, round_to, Collective, Comm, ReduceOp};
use super::group::{Options, ProcessGroup};
use super::job::{run_job, DeviceKind, Job};
use super::nccl::NcclComm;
use super::world::World;
use crate::backend::check::gpu::{Case, Ctx, Row};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, DType};
use crate::rng::SplitMix64;
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One check's outcome.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct CheckRow {
    pub(crate) name: String,
    pub(crate) dtype: &'static str,
    pub(crate) world: usize,
    /// Largest |got − expected| over the checked elements.
    pub(crate) max_abs: f64,
    pub(crate) pass: bool,
    pub(crate) note: String,
}

/// Value outside every view: a view's neighbours must keep it.
const SENTINEL: f32 = -7.25;
/// Elements before and after each view.
const MARGIN: usize = 3;

/// Rank `rank`'s input of `len` values for `case`: normal numbers rounded to `d`.
fn input(seed: u64, case: &str, rank: usize, len: usize, d: DType) -> Vec<f32> {
    let h = case.bytes().fold(seed ^ 0xD157, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    });
    let mut rng = SplitMix64(h ^ ((rank as u64 + 1) << 40));
    (0..len).map(|_| round_to(rng.normal(), d)).collect()
}

/// Rank-order reduction of `xs` (what the CPU communicator computes; see `host`).
fn reduce(xs: &[Vec<f32>], op: ReduceOp, d: DType) -> Vec<f32> {
    let s = op.premul(xs.len());
    let mul = |v: f32| s.map_or(v, |s| s * v);
    let mut acc: Vec<f32> = xs[0].iter().map(|&v| mul(v)).collect();
    for x in &xs[1..] {
        acc.iter_mut().zip(x).for_each(|(a, &v)| *a += mul(v));
    }
    acc.into_iter().map(|v| round_to(v, d)).collect()
}

/// Σ_p |s·x_p| per element: the scale of a reduction's rounding error.
fn magnitude(xs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let s = op.premul(xs.len()).unwrap_or(1.0).abs();
    (0..xs[0].len())
        .map(|i| xs.iter().map(|x| s * x[i].abs()).sum())
        .collect()
}

/// A check in progress on one backend and communicator.
struct Checker<'c, B: Backend> {
    backend: &'c B,
    comm: &'c dyn Comm<B>,
    seed: u64,
    rows: Vec<CheckRow>,
}

/// What a view of a result buffer must hold: `want` at element `off`, within `tol` per element
/// (None: bit for bit).
#[derive(Clone, Copy)]
struct Expected<'a> {
    off: usize,
    want: &'a [f32],
    tol: Option<&'a [f32]>,
}

impl<B: Backend> Checker<'_, B> {
    fn n(&self) -> usize {
        self.comm.world_size()
    }

    fn r(&self) -> usize {
        self.comm.rank()
    }

    /// A buffer of `d` holding `SENTINEL × MARGIN, values, SENTINEL × MARGIN`.
    fn buffer(&self, values: &[f32], d: DType) -> Result<B::Buf> {
        let mut host = vec![SENTINEL; MARGIN];
        host.extend_from_slice(values);
        host.extend(std::iter::repeat_n(SENTINEL, MARGIN));
        let mut buf = self.backend.alloc_as(host.len(), d)?;
        self.backend.upload(&mut buf, &host)?;
        Ok(buf)
    }

    fn read(&self, buf: &B::Buf) -> Result<Vec<f32>> {
        let mut host = vec![0.0; self.backend.len(buf)];
        self.backend.download(buf, &mut host)?;
        Ok(host)
    }

    /// Compares `got` (a whole buffer with margins) with `exp.want` at `exp.off`; `exp.tol` per
    /// element (None: bitwise); the rest of the buffer must be `keep`.
    fn compare(
        &mut self,
        name: &str,
        d: DType,
        got: &[f32],
        exp: Expected,
        keep: &[f32],
        note: String,
    ) {
        let Expected { off, want, tol } = exp;
        let mut max_abs = 0.0f64;
        let mut pass = true;
        let mut first_bad = None;
        for (i, (&g, &w)) in got[off..off + want.len()].iter().zip(want).enumerate() {
            let diff = (g as f64 - w as f64).abs();
            max_abs = max_abs.max(diff);
            let ok = match tol {
                None => g.to_bits() == w.to_bits(),
                Some(t) => diff <= t[i] as f64 && g.is_finite(),
            };
            if !ok && first_bad.is_none() {
                first_bad = Some(format!("element {i}: got {g}, expected {w}"));
                pass = false;
            }
        }
        for (i, (&g, &k)) in got.iter().zip(keep).enumerate() {
            if (i < off || i >= off + want.len()) && g.to_bits() != k.to_bits() {
                pass = false;
                first_bad.get_or_insert(format!("element {i} outside the view changed to {g}"));
            }
        }
        let note = match first_bad {
            Some(b) => format!("{note}; {b}"),
            None => note,
        };
        self.rows.push(CheckRow {
            name: name.into(),
            dtype: dtype_name(d),
            world: self.n(),
            max_abs,
            pass,
            note,
        });
    }

    /// Tolerance per element of a reduction: none for rank-order reductions.
    fn tol(&self, xs: &[Vec<f32>], op: ReduceOp, d: DType) -> Option<Vec<f32>> {
        if self.comm.rank_order_reductions() {
            return None;
        }
        let eps = match d {
            DType::F32 => f32::EPSILON,
            DType::BF16 => 1.0 / 128.0,
        };
        let n = xs.len() as f32;
        Some(
            magnitude(xs, op)
                .into_iter()
                .map(|m| 2.0 * n * eps * m + f32::MIN_POSITIVE)
                .collect(),
        )
    }

    fn all_inputs(&self, case: &str, len: usize, d: DType) -> Vec<Vec<f32>> {
        (0..self.n())
            .map(|p| input(self.seed, case, p, len, d))
            .collect()
    }

    fn all_reduce(&mut self, d: DType, len: usize, op: ReduceOp) -> Result<()> {
        let case = format!("all_reduce {op:?} {len}");
        let xs = self.all_inputs(&case, len, d);
        let mut buf = self.buffer(&xs[self.r()], d)?;
        let keep = self.read(&buf)?;
        let c = Collective::all_reduce(&mut buf, MARGIN, len, op).as_dtype(d);
        self.comm.run(vec![c])?;
        let got = self.read(&buf)?;
        let tol = self.tol(&xs, op, d);
        self.compare(
            &case,
            d,
            &got,
            Expected {
                off: MARGIN,
                want: &reduce(&xs, op, d),
                tol: tol.as_deref(),
            },
            &keep,
            String::new(),
        );
        Ok(())
    }

    fn all_gather(&mut self, d: DType, count: usize, in_place: bool) -> Result<()> {
        let (n, r) = (self.n(), self.r());
        let case = format!(
            "all_gather{} {count}",
            if in_place { " in place" } else { "" }
        );
        let xs = self.all_inputs(&case, count, d);
        let want: Vec<f32> = xs.concat();
        let mut start = vec![SENTINEL; n * count];
        if in_place {
            start[r * count..(r + 1) * count].copy_from_slice(&xs[r]);
        }
        let mut recv = self.buffer(&start, d)?;
        let send = self.buffer(&xs[r], d)?;
        let keep = self.read(&recv)?;
        let c = if in_place {
            Collective::all_gather_in_place(&mut recv, MARGIN, count)
        } else {
            Collective::all_gather(&send, MARGIN, &mut recv, MARGIN, count)
        };
        self.comm.run(vec![c.as_dtype(d)])?;
        let got = self.read(&recv)?;
        self.compare(
            &case,
            d,
            &got,
            Expected {
                off: MARGIN,
                want: &want,
                tol: None,
            },
            &keep,
            String::new(),
        );
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        d: DType,
        count: usize,
        op: ReduceOp,
        in_place: bool,
    ) -> Result<()> {
        let (n, r) = (self.n(), self.r());
        let case = format!(
            "reduce_scatter{} {op:?} {count}",
            if in_place { " in place" } else { "" }
        );
        let xs = self.all_inputs(&case, n * count, d);
        let chunks: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| x[r * count..(r + 1) * count].to_vec())
            .collect();
        let want = reduce(&chunks, op, d);
        let tol = self.tol(&chunks, op, d);
        let send = self.buffer(&xs[r], d)?;
        let mut recv = if in_place {
            self.buffer(&xs[r], d)?
        } else {
            self.buffer(&vec![SENTINEL; count], d)?
        };
        let keep = self.read(&recv)?;
        let c = if in_place {
            Collective::reduce_scatter_in_place(&mut recv, MARGIN, count, op)
        } else {
            Collective::reduce_scatter(&send, MARGIN, &mut recv, MARGIN, count, op)
        };
        self.comm.run(vec![c.as_dtype(d)])?;
        let got = self.read(&recv)?;
        let off = MARGIN + if in_place { r * count } else { 0 };
        self.compare(
            &case,
            d,
            &got,
            Expected {
                off,
                want: &want,
                tol: tol.as_deref(),
            },
            &keep,
            String::new(),
        );
        Ok(())
    }

    fn broadcast(&mut self, d: DType, len: usize, root: usize) -> Result<()> {
        let case = format!("broadcast root {root} {len}");
        let xs = self.all_inputs(&case, len, d);
        let mut buf = self.buffer(&xs[self.r()], d)?;
        let keep = self.read(&buf)?;
        let c = Collective::broadcast(&mut buf, MARGIN, len, root).as_dtype(d);
        self.comm.run(vec![c])?;
        let got = self.read(&buf)?;
        self.compare(
            &case,
            d,
            &got,
            Expected {
                off: MARGIN,
                want: &xs[root],
                tol: None,
            },
            &keep,
            String::new(),
        );
        Ok(())
    }

    /// Four different collectives started as one group.
    fn group(&mut self, d: DType) -> Result<()> {
        let (n, r) = (self.n(), self.r());
        let (la, cg, cr, lb) = (777, 129, 65, 300);
        let xa = self.all_inputs("group a", la, d);
        let xg = self.all_inputs("group g", cg, d);
        let xr = self.all_inputs("group r", n * cr, d);
        let xb = self.all_inputs("group b", lb, d);
        let mut a = self.buffer(&xa[r], d)?;
        let sg = self.buffer(&xg[r], d)?;
        let mut g = self.buffer(&vec![SENTINEL; n * cg], d)?;
        let sr = self.buffer(&xr[r], d)?;
        let mut rr = self.buffer(&vec![SENTINEL; cr], d)?;
        let mut b = self.buffer(&xb[r], d)?;
        let keeps = [
            self.read(&a)?,
            self.read(&g)?,
            self.read(&rr)?,
            self.read(&b)?,
        ];
        let root = n - 1;
        let ops = vec![
            Collective::all_reduce(&mut a, MARGIN, la, ReduceOp::Sum).as_dtype(d),
            Collective::all_gather(&sg, MARGIN, &mut g, MARGIN, cg).as_dtype(d),
            Collective::reduce_scatter(&sr, MARGIN, &mut rr, MARGIN, cr, ReduceOp::Avg).as_dtype(d),
            Collective::broadcast(&mut b, MARGIN, lb, root).as_dtype(d),
        ];
        self.comm.start(ops)?.wait()?;
        let chunks: Vec<Vec<f32>> = xr
            .iter()
            .map(|x| x[r * cr..(r + 1) * cr].to_vec())
            .collect();
        let ta = self.tol(&xa, ReduceOp::Sum, d);
        let tr = self.tol(&chunks, ReduceOp::Avg, d);
        let got = [
            self.read(&a)?,
            self.read(&g)?,
            self.read(&rr)?,
            self.read(&b)?,
        ];
        self.compare(
            "group: all_reduce",
            d,
            &got[0],
            Expected {
                off: MARGIN,
                want: &reduce(&xa, ReduceOp::Sum, d),
                tol: ta.as_deref(),
            },
            &keeps[0],
            String::new(),
        );
        self.compare(
            "group: all_gather",
            d,
            &got[1],
            Expected {
                off: MARGIN,
                want: &xg.concat(),
                tol: None,
            },
            &keeps[1],
            String::new(),
        );
        self.compare(
            "group: reduce_scatter",
            d,
            &got[2],
            Expected {
                off: MARGIN,
                want: &reduce(&chunks, ReduceOp::Avg, d),
                tol: tr.as_deref(),
            },
            &keeps[2],
            String::new(),
        );
        self.compare(
            "group: broadcast",
            d,
            &got[3],
            Expected {
                off: MARGIN,
                want: &xb[root],
                tol: None,
            },
            &keeps[3],
            String::new(),
        );
        Ok(())
    }

    /// The caller computes while a collective runs: ranks other than 0 join `delay` late, so
    /// rank 0's `start` must return at once and its `wait` (plus a device sync) only after them.
    fn overlap(&mut self, delay: Duration) -> Result<()> {
        let (n, r) = (self.n(), self.r());
        let d = DType::F32;
        let len = 1 << 16;
        let xs = self.all_inputs("overlap", len, d);
        let mut buf = self.buffer(&xs[r], d)?;
        let keep = self.read(&buf)?;
        let x = self.buffer(&vec![0.5; 1000], d)?;
        let mut y = self.buffer(&vec![1.0; 1000], d)?;
        self.comm.barrier()?;
        if r != 0 {
            std::thread::sleep(delay);
        }
        let t0 = Instant::now();
        let work = self.comm.start(vec![Collective::all_reduce(
            &mut buf,
            MARGIN,
            len,
            ReduceOp::Sum,
        )])?;
        let started = t0.elapsed();
        for _ in 0..8 {
            self.backend.add_assign(&mut y, &x, 1000 + 2 * MARGIN)?;
        }
        work.wait()?;
        self.backend.synchronize()?;
        let total = t0.elapsed();
        let got = self.read(&buf)?;
        let tol = self.tol(&xs, ReduceOp::Sum, d);
        let timing_ok = n == 1 || r != 0 || (started < delay / 2 && total >= delay * 3 / 4);
        let note = format!(
            "start returned after {:.1} ms, done after {:.1} ms (other ranks joined {} ms late)",
            started.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3,
            if n > 1 { delay.as_millis() } else { 0 }
        );
        self.compare(
            "overlap: all_reduce",
            d,
            &got,
            Expected {
                off: MARGIN,
                want: &reduce(&xs, ReduceOp::Sum, d),
                tol: tol.as_deref(),
            },
            &keep,
            note,
        );
        // y += x eight times: 1 + 8·0.5 in the view, 9 × SENTINEL in the margins.
        let gy = self.read(&y)?;
        let mut want_y = vec![5.0f32; 1000 + 2 * MARGIN];
        for i in (0..MARGIN).chain(1000 + MARGIN..1000 + 2 * MARGIN) {
            want_y[i] = 9.0 * SENTINEL;
        }
        self.compare(
            "overlap: compute meanwhile",
            d,
            &gy,
            Expected {
                off: 0,
                want: &want_y,
                tol: None,
            },
            &gy.clone(),
            String::new(),
        );
        if !timing_ok {
            let last = self.rows.len() - 2;
            self.rows[last].pass = false;
            self.rows[last]
                .note
                .push_str("; start did not return before the other ranks joined");
        }
        Ok(())
    }

    /// Results are identical on every rank and from one run to the next.
    fn deterministic(&mut self, d: DType) -> Result<()> {
        let (n, r) = (self.n(), self.r());
        let len = 4099;
        let xs = self.all_inputs("deterministic", len, d);
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut buf = self.backend.alloc_as(len, d)?;
            self.backend.upload(&mut buf, &xs[r])?;
            let c = Collective::all_reduce(&mut buf, 0, len, ReduceOp::Sum).as_dtype(d);
            self.comm.run(vec![c])?;
            let mut all = self.backend.alloc_as(n * len, d)?;
            let c = Collective::all_gather(&buf, 0, &mut all, 0, len).as_dtype(d);
            self.comm.run(vec![c])?;
            runs.push(self.read(&all)?);
        }
        let mine = runs[0][r * len..(r + 1) * len].to_vec();
        let same_ranks = (0..n).all(|p| {
            runs[0][p * len..(p + 1) * len]
                .iter()
                .zip(&mine)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        let same_runs = runs[0]
            .iter()
            .zip(&runs[1])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let host = self
            .comm
            .rank_order_reductions()
            .then(|| reduce(&xs, ReduceOp::Sum, d));
        let same_host = host
            .as_ref()
            .is_none_or(|h| h.iter().zip(&mine).all(|(a, b)| a.to_bits() == b.to_bits()));
        self.rows.push(CheckRow {
            name: "deterministic: all_reduce".into(),
            dtype: dtype_name(d),
            world: n,
            max_abs: 0.0,
            pass: same_ranks && same_runs && same_host,
            note: format!(
                "same bits on every rank: {same_ranks}, in two runs: {same_runs}{}",
                if host.is_some() {
                    format!(", as the rank-order host loop: {same_host}")
                } else {
                    String::new()
                }
            ),
        });
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        let t = Instant::now();
        for _ in 0..3 {
            self.comm.barrier()?;
        }
        self.rows.push(CheckRow {
            name: "barrier".into(),
            dtype: "-",
            world: self.n(),
            max_abs: 0.0,
            pass: true,
            note: format!("3 barriers in {:.2} ms", t.elapsed().as_secs_f64() * 1e3),
        });
        Ok(())
    }
}

/// Every check on `comm` (a collective call: every rank runs it).
pub(crate) fn run_checks<B: Backend>(
    backend: &B,
    comm: &dyn Comm<B>,
    seed: u64,
) -> Result<Vec<CheckRow>> {
    let mut c = Checker {
        backend,
        comm,
        seed,
        rows: Vec::new(),
    };
    let n = comm.world_size();
    for d in [DType::F32, DType::BF16] {
        for len in [1, 1001, 65_539] {
            c.all_reduce(d, len, ReduceOp::Sum)?;
        }
        c.all_reduce(d, 1001, ReduceOp::Avg)?;
        c.all_reduce(d, 1001, ReduceOp::Scaled(0.5))?;
        for count in [1, 333, 16_384] {
            c.all_gather(d, count, false)?;
            c.reduce_scatter(d, count, ReduceOp::Sum, false)?;
        }
        c.all_gather(d, 333, true)?;
        c.reduce_scatter(d, 333, ReduceOp::Avg, true)?;
        c.broadcast(d, 1001, n - 1)?;
        c.broadcast(d, 1, 0)?;
        c.group(d)?;
        c.deterministic(d)?;
    }
    c.overlap(Duration::from_millis(500))?;
    c.barrier()?;
    Ok(c.rows)
}

/// Small cases whose results the tests work out by hand (`dist-test` prints them).
pub(crate) fn hand_cases<B: Backend>(
    backend: &B,
    comm: &dyn Comm<B>,
) -> Result<Vec<(String, Vec<f32>)>> {
    let (n, r) = (comm.world_size(), comm.rank());
    let rf = r as f32;
    let mut out = Vec::new();
    // Written out one by one: each case's buffers and call are plain to read.
    let f32s = |v: &[f32]| -> Result<B::Buf> {
        let mut b = backend.alloc_as(v.len(), DType::F32)?;
        backend.upload(&mut b, v)?;
        Ok(b)
    };
    let bf16s = |v: &[f32]| -> Result<B::Buf> {
        let mut b = backend.alloc_as(v.len(), DType::BF16)?;
        backend.upload(&mut b, v)?;
        Ok(b)
    };
    let read = |b: &B::Buf| -> Result<Vec<f32>> {
        let mut h = vec![0.0; backend.len(b)];
        backend.download(b, &mut h)?;
        Ok(h)
    };

    let mut a = f32s(&[rf + 1.0, -0.5 * (rf + 1.0), 1000.0 * rf, 0.25])?;
    comm.all_reduce(&mut a, 0, 4, ReduceOp::Sum)?;
    out.push(("all_reduce_sum".to_string(), read(&a)?));

    let mut a = f32s(&[rf + 1.0, 2.0 * (rf + 1.0)])?;
    comm.all_reduce(&mut a, 0, 2, ReduceOp::Avg)?;
    out.push(("all_reduce_avg".to_string(), read(&a)?));

    let s = f32s(&[10.0 * rf + 1.0, 10.0 * rf + 2.0])?;
    let mut g = f32s(&vec![0.0; 2 * n])?;
    comm.all_gather(&s, 0, &mut g, 0, 2)?;
    out.push(("all_gather".to_string(), read(&g)?));

    let x: Vec<f32> = (0..2 * n).map(|i| i as f32 + 100.0 * rf).collect();
    let s = f32s(&x)?;
    let mut g = f32s(&[0.0, 0.0])?;
    comm.reduce_scatter(&s, 0, &mut g, 0, 2, ReduceOp::Sum)?;
    out.push(("reduce_scatter_sum".to_string(), read(&g)?));

    let mut b = f32s(&[rf, rf + 0.5])?;
    comm.broadcast(&mut b, 0, 2, n - 1)?;
    out.push(("broadcast".to_string(), read(&b)?));

    // bf16: inputs round to nearest even (257 -> 256, 259 -> 260, 1 + 2^-8 -> 1), and so do
    // the sums.
    let mut a = bf16s(&[257.0 + rf, 1.0 + (rf + 1.0) / 256.0])?;
    comm.run(vec![
        Collective::all_reduce(&mut a, 0, 2, ReduceOp::Sum).as_dtype(DType::BF16)
    ])?;
    out.push(("all_reduce_sum_bf16".to_string(), read(&a)?));

    let s = bf16s(&[1.0 + 1.0 / 256.0 + rf])?;
    let mut g = bf16s(&vec![0.0; n])?;
    comm.run(vec![
        Collective::all_gather(&s, 0, &mut g, 0, 1).as_dtype(DType::BF16)
    ])?;
    out.push(("all_gather_bf16".to_string(), read(&g)?));
    Ok(out)
}

/// The communicator checks at world size 1 on GPU `ordinal` (NCCL, real calls), for
/// `gpu-test`.
pub(crate) fn gpu_rows(ordinal: usize, seed: u64) -> Result<Vec<CheckRow>> {
    let pg = ProcessGroup::new(World::single(), Options::from_env()?)?;
    let backend = CudaBackend::new(ordinal)?;
    let mut comm = NcclComm::new(&backend, &pg)?;
    let mut rows = run_checks(&backend, &comm, seed)?;
    let hand = hand_cases(&backend, &comm)?;
    hand_rows(&mut rows, &hand, "hand");
    // A communicator kept for a newer backend's buffers (a transfer's bridge), its first
    // backend gone.
    drop(backend);
    let newer = CudaBackend::new(ordinal)?;
    comm.follow(&newer)?;
    let hand = hand_cases(&newer, &comm)?;
    hand_rows(&mut rows, &hand, "hand, on a newer backend");
    Ok(rows)
}

/// Rows of the hand cases at n = 1, which are the inputs themselves (rounded for the bf16
/// ones).
fn hand_rows(rows: &mut Vec<CheckRow>, hand: &[(String, Vec<f32>)], what: &str) {
    let want: [(&str, Vec<f32>); 7] = [
        ("all_reduce_sum", vec![1.0, -0.5, 0.0, 0.25]),
        ("all_reduce_avg", vec![1.0, 2.0]),
        ("all_gather", vec![1.0, 2.0]),
        ("reduce_scatter_sum", vec![0.0, 1.0]),
        ("broadcast", vec![0.0, 0.5]),
        ("all_reduce_sum_bf16", vec![256.0, 1.0]),
        ("all_gather_bf16", vec![1.0]),
    ];
    for ((name, got), (wname, w)) in hand.iter().zip(want) {
        rows.push(CheckRow {
            name: format!("{what}: {name}"),
            dtype: if name.ends_with("bf16") {
                "bf16"
            } else {
                "f32"
            },
            world: 1,
            max_abs: 0.0,
            pass: *name == wname && *got == w,
            note: format!("{got:?}"),
        });
    }
}

/// The `communicator` case of `tandem gpu-test`: [`gpu_rows`] as rows of its table. The rows
/// carry their own element types, so the case runs once (in the f32 pass).
pub(crate) const GPU_CASES: &[Case] = &[Case {
    name: "communicator",
    run: communicator_case,
}];

fn communicator_case(ctx: &mut Ctx<'_>, d: DType) -> Result<()> {
    if d != DType::F32 {
        return Ok(());
    }
    let seed = ctx.rng.next_u64();
    for r in gpu_rows(ctx.ordinal, seed)? {
        ctx.rows.push(Row {
            op: format!("communicator {} (nccl, world 1)", r.name),
            dtype: r.dtype,
            max_abs: r.max_abs,
            max_rel: f64::NAN,
            tol: f64::NAN,
            pass: r.pass,
            note: r.note,
        });
    }
    Ok(())
}

/// How `--fail-rank` fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FailMode {
    /// Exit with --fail-code without finishing.
    Exit,
    /// SIGKILL itself (as `kill -9`).
    Kill,
    /// Sleep instead of joining the next collective.
    Hang,
}

#[derive(Args, Debug, Clone)]
pub struct DistTestArgs {
    /// Backend of every rank: cpu, or cuda (the GPU of the rank's local rank, NCCL).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the world the environment describes (JSON) and exit without joining it.
    #[arg(long)]
    pub show_world: bool,
    /// After the checks, keep calling barriers for this many seconds (tests kill a rank
    /// meanwhile).
    #[arg(long, default_value_t = 0.0)]
    pub hold: f64,
    /// For tests of failure handling: this rank fails after the hand cases.
    #[arg(long)]
    pub fail_rank: Option<usize>,
    #[arg(long, value_enum, default_value_t = FailMode::Exit)]
    pub fail_mode: FailMode,
    /// Exit code of --fail-mode exit.
    #[arg(long, default_value_t = 1)]
    pub fail_code: i32,
    /// Also write rank 0's rows as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

struct TestJob(DistTestArgs);

/// What one rank of `dist-test` found.
struct Found {
    hand: Vec<(String, Vec<f32>)>,
    rows: Vec<CheckRow>,
    comm: &'static str,
}

impl Job for TestJob {
    type Out = Found;

    fn run<B: Backend>(self, backend: &B, comm: &dyn Comm<B>) -> Result<Found> {
        let a = self.0;
        let r = comm.rank();
        comm.barrier()?;
        super::say(&format!(
            "dist-test: rank {r} pid {} ready",
            std::process::id()
        ));
        let hand = hand_cases(backend, comm)?;
        if a.fail_rank == Some(r) {
            match a.fail_mode {
                FailMode::Exit => {
                    super::say(&format!(
                        "dist-test: rank {r} exits with code {} (--fail-mode exit)",
                        a.fail_code
                    ));
                    std::process::exit(a.fail_code);
                }
                FailMode::Kill => {
                    super::say(&format!(
                        "dist-test: rank {r} kills itself with SIGKILL (--fail-mode kill)"
                    ));
                    // SAFETY: kill(2) of this process.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
                FailMode::Hang => {
                    super::say(&format!("dist-test: rank {r} hangs (--fail-mode hang)"));
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        }
        let rows = run_checks(backend, comm, a.seed)?;
        if a.hold > 0.0 {
            super::say(&format!("dist-test: rank {r} holding for {} s", a.hold));
        }
        let hold = Instant::now();
        while hold.elapsed().as_secs_f64() < a.hold {
            comm.barrier()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Found {
            hand,
            rows,
            comm: comm.name(),
        })
    }
}

/// `tandem dist-test`.
pub fn run(a: DistTestArgs) -> Result<()> {
    if a.show_world {
        println!("{}", serde_json::to_string(&World::from_env()?)?);
        return Ok(());
    }
    let pg = ProcessGroup::init()?;
    let (r, n) = (pg.rank(), pg.world_size());
    let id = pg.share("dist-test/id", || {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut rng = SplitMix64(t ^ ((std::process::id() as u64) << 32));
        Ok((0..16)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .take(16)
            .collect())
    })?;
    let id: String = id.iter().map(|b| format!("{b:02x}")).collect();
    println!("{}", serde_json::json!({"rank": r, "world": n, "id": id}));
    let json = a.json.clone();
    let found = run_job(a.device, &pg, TestJob(a))?;
    for (name, out) in &found.hand {
        println!(
            "{}",
            serde_json::json!({"case": name, "rank": r, "world": n, "out": out})
        );
    }
    let failed: Vec<&CheckRow> = found.rows.iter().filter(|c| !c.pass).collect();
    if r == 0 {
        println!("dist-test: {} communicator, {n} rank(s)", found.comm);
        for c in &found.rows {
            println!(
                "  {:<4} {:<34} {:<4} max |err| {:<10.3e} {}",
                if c.pass { "ok" } else { "FAIL" },
                c.name,
                c.dtype,
                c.max_abs,
                c.note
            );
        }
        if let Some(path) = json {
            std::fs::write(&path, serde_json::to_string_pretty(&found.rows)?)?;
        }
    }
    for c in &failed {
        super::say(&format!(
            "dist-test: rank {r}: FAILED {} ({}): {}",
            c.name, c.dtype, c.note
        ));
    }
    pg.finish()?;
    if !failed.is_empty() {
        bail!(
            "rank {r}: {} of {} checks failed",
            failed.len(),
            found.rows.len()
        );
    }
    println!("dist-test: rank {r}: {} checks passed", found.rows.len());
    Ok(())
}
