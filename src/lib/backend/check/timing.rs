//! `tandem gpu-test --time`: each op timed alone with CUDA events after warm-up, median of the
//! runs, at the Qwen2.5-0.5B training shape (one micro-batch of 8 × 640 tokens, bf16 weights and
//! activations, f32 gradients) and at a decode step of 256 sequences. Each family's `check.rs`
//! holds its timing shapes ([`Timing`]); `backend::ops::timing_cases` lists them. A big bf16
//! GEMM gives the measured peak that MFU figures divide by. This tells where a step's time
//! goes; `tandem bench` measures whole steps.

use anyhow::{anyhow, Result};
use cudarc::driver::sys as dsys;
use serde::Serialize;

use crate::backend::cuda::{CudaBackend, CudaBuf, CudaIdx};
use crate::backend::{DType, Device};

/// The Qwen2.5-0.5B shapes the ops are timed at.
pub(crate) mod shape {
    /// Sequences and tokens per sequence of a training micro-batch.
    pub(crate) const SEQS: usize = 8;
    pub(crate) const LEN: usize = 640;
    pub(crate) const TOKENS: usize = SEQS * LEN;
    pub const HIDDEN: usize = 896;
    pub const HEADS: usize = 14;
    pub const KV_HEADS: usize = 2;
    pub const HEAD_DIM: usize = 64;
    pub const FFN: usize = 4864;
    pub(crate) const VOCAB: usize = 151_936;
    pub(crate) const ROPE_THETA: f32 = 1e6;
    /// Parameters (the optimizer's buffers).
    pub(crate) const PARAMS: usize = 494_032_768;
    /// A decode step: sequences, and the context each attends to.
    pub(crate) const DECODE_ROWS: usize = 256;
    pub(crate) const DECODE_CTX: usize = 256;
    /// Positions per block of the paged KV cache.
    pub(crate) const BLOCK: usize = 16;
}

/// One op family's timing shapes: `run` times its ops with `Timer::time` / `time_graph`.
#[derive(Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) name: &'static str,
    pub(crate) run: fn(&mut Timer<'_>) -> Result<()>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct TimeRow {
    pub(crate) op: String,
    pub(crate) shape: String,
    pub(crate) ms: f64,
    /// TFLOP/s for matrix work, GB/s for memory-bound ops.
    pub(crate) rate: f64,
    pub(crate) unit: &'static str,
}

/// Uniform values in [-scale, scale): cheap to make in the millions, and never zero runs.
fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Times ops on one GPU and keeps the table.
pub(crate) struct Timer<'a> {
    pub(crate) gpu: &'a CudaBackend,
    pub(crate) rows: Vec<TimeRow>,
    iters: usize,
    seed: u64,
    /// Time only the ops whose name contains this (gpu-test's --only).
    only: Option<&'a str>,
}

impl<'a> Timer<'a> {
    pub fn new(gpu: &'a CudaBackend, iters: usize, only: Option<&'a str>) -> Self {
        Timer {
            gpu,
            rows: Vec::new(),
            iters: iters.max(1),
            seed: 17,
            only,
        }
    }

    /// A buffer of n elements of type `d`, uniform in [-scale, scale).
    pub fn buf(&mut self, n: usize, d: DType, scale: f32) -> Result<CudaBuf> {
        self.seed += 1;
        let mut b = self.gpu.alloc_as(n, d)?;
        self.gpu.upload(&mut b, &uniform(n, self.seed, scale))?;
        Ok(b)
    }

    pub fn idx(&self, host: &[u32]) -> Result<CudaIdx> {
        let mut b = self.gpu.alloc_idx(host.len())?;
        self.gpu.upload_idx(&mut b, host)?;
        Ok(b)
    }

    /// Median milliseconds of `f` over `iters` runs after 3 warm-up runs; `work` is FLOPs
    /// (unit "TFLOP/s") or bytes moved ("GB/s").
    pub fn time(
        &mut self,
        op: &str,
        shape: String,
        work: f64,
        unit: &'static str,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        if self.only.is_some_and(|o| !op.contains(o)) {
            return Ok(());
        }
        let ctx = self.gpu.context();
        let stream = self.gpu.stream();
        let ev = |()| ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT));
        for _ in 0..3 {
            f()?;
        }
        self.gpu.synchronize()?;
        let mut ms = Vec::with_capacity(self.iters);
        for _ in 0..self.iters {
            let (a, b) = (
                ev(()).map_err(|e| anyhow!("{e:?}"))?,
                ev(()).map_err(|e| anyhow!("{e:?}"))?,
            );
            a.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            f()?;
            b.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            ms.push(a.elapsed_ms(&b).map_err(|e| anyhow!("{e:?}"))? as f64);
        }
        self.gpu.synchronize()?;
        ms.sort_by(|x, y| x.total_cmp(y));
        let med = ms[ms.len() / 2];
        let scale = if unit == "TFLOP/s" { 1e12 } else { 1e9 };
        self.rows.push(TimeRow {
            op: op.to_string(),
            shape,
            ms: med,
            rate: work / (med * 1e-3) / scale,
            unit,
        });
        Ok(())
    }

    /// Like `time`, for ops of a few microseconds: `GRAPH_REPS` calls captured as one CUDA
    /// graph and replayed, so the figure is GPU time without the host's launch gaps (as in a
    /// decode step, which replays a graph).
    pub(crate) fn time_graph(
        &mut self,
        op: &str,
        shape: String,
        work: f64,
        unit: &'static str,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        const GRAPH_REPS: usize = 20;
        if self.only.is_some_and(|o| !op.contains(o)) {
            return Ok(());
        }
        f()?;
        self.gpu.synchronize()?;
        let gpu = self.gpu;
        gpu.graph_begin()?;
        let captured = (0..GRAPH_REPS).try_for_each(|_| f());
        let res = gpu
            .graph_end()
            .and_then(|id| captured.map(|_| id))
            .and_then(|id| self.time(op, shape, work, unit, || gpu.graph_launch(id)));
        gpu.graph_release()?;
        res?;
        if let Some(r) = self.rows.last_mut() {
            r.ms /= GRAPH_REPS as f64;
            r.rate *= GRAPH_REPS as f64;
        }
        Ok(())
    }
}

/// Runs `timings` in order (only the ops whose name contains `only`, if given); prints the
/// table and returns its rows.
pub(crate) fn run(
    gpu: &CudaBackend,
    iters: usize,
    only: Option<&str>,
    timings: &[Timing],
) -> Result<Vec<TimeRow>> {
    let mut t = Timer::new(gpu, iters, only);
    for timing in timings {
        (timing.run)(&mut t).map_err(|e| e.context(format!("timing {}", timing.name)))?;
    }
    println!(
        "{:<32}  {:<40}  {:>9}  {:>10}",
        "op", "shape", "median ms", "rate"
    );
    for r in &t.rows {
        println!(
            "{:<32}  {:<40}  {:>9.3}  {:>6.1} {}",
            r.op, r.shape, r.ms, r.rate, r.unit
        );
    }
    Ok(t.rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_inputs_are_in_range_and_vary() {
        let v = uniform(10_000, 3, 0.5);
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        assert!(v.windows(2).all(|w| w[0] != w[1]));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.02, "{mean}");
        assert_eq!(v, uniform(10_000, 3, 0.5));
        assert_ne!(v, uniform(10_000, 4, 0.5));
    }
}
