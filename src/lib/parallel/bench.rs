//! Timings of a communicator: each collective's algorithm and bus bandwidth as nccl-tests
//! reports them, and the bucketed weight sync ([`WeightSync`]) of a model's tensors. Every
//! result is checked against known values (all-reduce before its timed runs, the others after
//! them: their runs leave the same values); each timed run is one
//! collective between two device syncs, and the median over the runs is reported (the
//! slowest rank's, since a collective is as slow as its slowest rank).
//!
//! nccl-tests' definitions: S is the size of the whole buffer (all-reduce and broadcast: the
//! buffer; all-gather: the gathered result, n pieces; reduce-scatter: the input, n chunks);
//! algbw = S / t; busbw = algbw · 2(n−1)/n for all-reduce, algbw · (n−1)/n for all-gather and
//! reduce-scatter, algbw for broadcast: the bytes each rank's link carries per second, to
//! compare with the hardware's bandwidth whatever n is.

use super::bucket::{BucketPlan, WeightSync};
use super::comm::{dtype_bytes, dtype_name, Collective, Comm, ReduceOp};
use crate::backend::{Backend, DType};
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

/// The collectives `time_collective` knows.
pub(crate) const OPS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];

/// busbw / algbw for `op` on `n` ranks (nccl-tests).
pub(crate) fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// One row of the collective table.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct CollectiveTiming {
    pub(crate) op: String,
    pub(crate) dtype: &'static str,
    pub(crate) world: usize,
    /// S: bytes of the whole buffer (see the module docs).
    pub(crate) bytes: usize,
    pub(crate) median_us: f64,
    pub(crate) algbw_gbs: f64,
    pub(crate) busbw_gbs: f64,
}

/// The median of the slowest rank: every rank's median, gathered, the largest.
fn slowest_median<B: Backend>(backend: &B, comm: &dyn Comm<B>, mut times: Vec<f64>) -> Result<f64> {
    times.sort_by(f64::total_cmp);
    let mine = times[times.len() / 2];
    let n = comm.world_size();
    let mut one = backend.alloc(1)?;
    backend.upload(&mut one, &[mine as f32])?;
    let mut all = backend.alloc(n)?;
    comm.all_gather(&one, 0, &mut all, 0, 1)?;
    let mut host = vec![0.0; n];
    backend.download(&all, &mut host)?;
    Ok(host.into_iter().fold(0.0f64, |m, v| m.max(v as f64)))
}

/// Values of elements `at` of `buf` (copied one by one into a small buffer, then downloaded).
fn sample<B: Backend>(backend: &B, buf: &B::Buf, at: &[usize]) -> Result<Vec<f32>> {
    let mut small = backend.alloc(at.len())?;
    for (i, &p) in at.iter().enumerate() {
        backend.copy(&mut small, i, buf, p, 1)?;
    }
    let mut host = vec![0.0; at.len()];
    backend.download(&small, &mut host)?;
    Ok(host)
}

/// Seconds of each of `iters` runs of `run` after `warmup` untimed ones, each between two
/// device syncs.
fn time_runs<B: Backend>(
    backend: &B,
    warmup: usize,
    iters: usize,
    mut run: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    if iters == 0 {
        bail!("at least one timed run is needed");
    }
    let mut times = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        backend.synchronize()?;
        let t = Instant::now();
        run()?;
        backend.synchronize()?;
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

fn filled<B: Backend>(backend: &B, n: usize, d: DType, value: f32) -> Result<B::Buf> {
    let mut b = backend.alloc_as(n, d)?;
    backend.fill(&mut b, n, value)?;
    Ok(b)
}

/// Times `op` on a buffer of about `bytes` bytes of `d` (rounded down to n equal pieces):
/// `warmup` untimed runs, then `iters` timed ones. Rank r's input is r + 1 everywhere, so the
/// checked results are small integers, exact in bf16.
pub(crate) fn time_collective<B: Backend>(
    backend: &B,
    comm: &dyn Comm<B>,
    op: &str,
    bytes: usize,
    d: DType,
    warmup: usize,
    iters: usize,
) -> Result<CollectiveTiming> {
    let (n, r) = (comm.world_size(), comm.rank());
    let piece = (bytes / dtype_bytes(d) / n).max(1);
    let total = piece * n;
    let mine = r as f32 + 1.0;
    let sum = (n * (n + 1) / 2) as f32;
    // Each arm runs the collective once and reads the checked elements, then times it.
    let (checked, want, times): (Vec<f32>, Vec<f32>, Vec<f64>) = match op {
        "all_reduce" => {
            let mut buf = filled(backend, total, d, mine)?;
            let all_reduce = |buf: &mut B::Buf, op: ReduceOp| {
                comm.run(vec![Collective::all_reduce(buf, 0, total, op).as_dtype(d)])
            };
            all_reduce(&mut buf, ReduceOp::Sum)?;
            let got = sample(backend, &buf, &[0, total / 2, total - 1])?;
            // Timed as averages, so that repeated runs keep the values finite.
            let times = time_runs(backend, warmup, iters, || {
                all_reduce(&mut buf, ReduceOp::Avg)
            })?;
            (got, vec![sum; 3], times)
        }
        "all_gather" => {
            let send = filled(backend, piece, d, mine)?;
            let mut recv = filled(backend, total, d, 0.0)?;
            let mut run = || {
                comm.run(vec![
                    Collective::all_gather(&send, 0, &mut recv, 0, piece).as_dtype(d)
                ])
            };
            run()?;
            let times = time_runs(backend, warmup, iters, run)?;
            let at: Vec<usize> = (0..n)
                .flat_map(|p| [p * piece, p * piece + piece - 1])
                .collect();
            let want = (0..n).flat_map(|p| [p as f32 + 1.0; 2]).collect();
            (sample(backend, &recv, &at)?, want, times)
        }
        "reduce_scatter" => {
            let send = filled(backend, total, d, mine)?;
            let mut recv = filled(backend, piece, d, 0.0)?;
            let mut run = || {
                let c = Collective::reduce_scatter(&send, 0, &mut recv, 0, piece, ReduceOp::Sum);
                comm.run(vec![c.as_dtype(d)])
            };
            run()?;
            let times = time_runs(backend, warmup, iters, run)?;
            (
                sample(backend, &recv, &[0, piece - 1])?,
                vec![sum; 2],
                times,
            )
        }
        "broadcast" => {
            let mut buf = filled(backend, total, d, mine)?;
            let mut run = || {
                comm.run(vec![
                    Collective::broadcast(&mut buf, 0, total, 0).as_dtype(d)
                ])
            };
            run()?;
            let times = time_runs(backend, warmup, iters, run)?;
            (sample(backend, &buf, &[0, total - 1])?, vec![1.0; 2], times)
        }
        other => bail!(
            "unknown collective '{other}' (expected one of {})",
            OPS.join(", ")
        ),
    };
    if checked != want {
        bail!("{op} of {bytes} bytes on rank {r}: got {checked:?} at the checked elements, expected {want:?}");
    }
    let t = slowest_median(backend, comm, times)?;
    let s = (total * dtype_bytes(d)) as f64;
    let algbw = s / t / 1e9;
    Ok(CollectiveTiming {
        op: op.into(),
        dtype: dtype_name(d),
        world: n,
        bytes: total * dtype_bytes(d),
        median_us: t * 1e6,
        algbw_gbs: algbw,
        busbw_gbs: algbw * bus_factor(op, n),
    })
}

/// One row of the weight-sync table.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct SyncTiming {
    pub(crate) bucket_mb: f64,
    pub(crate) buckets: usize,
    pub(crate) world: usize,
    pub(crate) dtype: &'static str,
    /// Bytes of every tensor in full.
    pub(crate) model_bytes: usize,
    /// Bytes of this rank's shards.
    pub(crate) shard_bytes: usize,
    /// Extra memory of the sync: its two staging buckets.
    pub(crate) staging_bytes: usize,
    pub(crate) median_ms: f64,
    /// model_bytes / t.
    pub(crate) algbw_gbs: f64,
    /// algbw · (n−1)/n (an all-gather's bus bandwidth).
    pub(crate) busbw_gbs: f64,
}

/// Value of element `i` of bucket `b` (small integers: exact in bf16).
fn sync_value(b: usize, i: usize) -> f32 {
    ((b * 131 + i) % 251) as f32 - 125.0
}

/// Times [`WeightSync`] of tensors of `sizes` with buckets of `bucket_bytes`: allocates every
/// rank's shards and the full tensors, checks the first and last elements of every tensor
/// after one sync, then times `iters` syncs after `warmup`.
pub(crate) fn time_weight_sync<B: Backend>(
    backend: &B,
    comm: &dyn Comm<B>,
    sizes: &[usize],
    bucket_bytes: usize,
    d: DType,
    warmup: usize,
    iters: usize,
) -> Result<SyncTiming> {
    let (n, r) = (comm.world_size(), comm.rank());
    let esize = dtype_bytes(d);
    let plan = BucketPlan::new(sizes, (bucket_bytes / esize).max(1), n)?;
    let mut shards = Vec::with_capacity(plan.buckets.len());
    for (b, bucket) in plan.buckets.iter().enumerate() {
        // In parallel: at world size 1 a 7B shape is 7.6 G values per bucket size.
        let host: Vec<f32> = (0..bucket.shard)
            .into_par_iter()
            .map(|i| sync_value(b, r * bucket.shard + i))
            .collect();
        let mut s = backend.alloc_as(bucket.shard, d)?;
        backend.upload(&mut s, &host)?;
        shards.push(s);
    }
    let mut dests = sizes
        .iter()
        .map(|&s| backend.alloc_as(s, d))
        .collect::<Result<Vec<_>>>()?;
    let mut sync = WeightSync::new(backend, plan.clone(), d)?;
    sync.run(backend, comm, &shards, &mut dests)?;
    for (b, bucket) in plan.buckets.iter().enumerate() {
        for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
            let last = sizes[t] - 1;
            let got = sample(backend, &dests[t], &[0, last])?;
            let want = [sync_value(b, off), sync_value(b, off + last)];
            if got != want {
                bail!("weight sync: tensor {t} (bucket {b}) has {got:?} at its ends, expected {want:?}");
            }
        }
    }
    let times = time_runs(backend, warmup, iters, || {
        sync.run(backend, comm, &shards, &mut dests)
    })?;
    let t = slowest_median(backend, comm, times)?;
    let model_bytes = plan.total() * esize;
    let algbw = model_bytes as f64 / t / 1e9;
    Ok(SyncTiming {
        bucket_mb: bucket_bytes as f64 / (1 << 20) as f64,
        buckets: plan.buckets.len(),
        world: n,
        dtype: dtype_name(d),
        model_bytes,
        shard_bytes: plan.shard_total() * esize,
        staging_bytes: sync.staging_elems() * esize,
        median_ms: t * 1e3,
        algbw_gbs: algbw,
        busbw_gbs: algbw * bus_factor("all_gather", n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 1), 0.0);
        assert_eq!(bus_factor("all_reduce", 4), 1.5);
        assert_eq!(bus_factor("all_gather", 4), 0.75);
        assert_eq!(bus_factor("reduce_scatter", 2), 0.5);
        assert_eq!(bus_factor("broadcast", 8), 1.0);
    }
}
