//! The data-parallel optimizer (ZeRO-2-like): every rank keeps the compute weights in full, and
//! 1/N of the f32 master weights, Adam moments and reduced gradients, over the flat bucket
//! layout of [`BucketPlan`]. A step reduce-scatters the gradients the backward passes added up
//! (bucket by bucket, after the last backward of the step: no overlap with the backward yet),
//! clips by the global norm (the shards' sums of squares, all-reduced), updates this rank's
//! shard with AdamW and all-gathers the compute weights back into every rank's decoder
//! ([`WeightSync`], the weight sync).
//!
//! AdamW is elementwise, so a rank's shard gets exactly the update the unsharded optimizer
//! gives those elements from the same summed gradients.

use anyhow::{ensure, Result};
use std::time::Instant;

use super::optim::{adamw_step, check_hyper, clip_scale};
use super::{AdamWParams, Decoder, OptimizerState, StepReport};
use crate::backend::{Backend, DType};
use crate::dist::bucket::{BucketPlan, WeightSync};
use crate::dist::comm::dtype_bytes;
use crate::dist::{Collective, Comm, ReduceOp};
use crate::model::{Tensor, Weights};

/// What the sharded optimizer did so far (the update metrics' `shard` object).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardStats {
    pub world_size: usize,
    pub buckets: usize,
    /// Elements of this rank's shards (of every bucket together).
    pub shard_elems: usize,
    /// Wall seconds of the gradients' reduce-scatter (packing the buckets included).
    pub reduce_scatter_seconds: f64,
    /// Wall seconds of the weight sync (the all-gather of the compute weights, copies
    /// included) and the bytes each rank received in it.
    pub sync_seconds: f64,
    pub sync_bytes: u64,
    /// Bytes of the staging buffers the reduce-scatter and the weight sync add.
    pub staging_bytes: u64,
}

impl ShardStats {
    pub fn to_json(&self) -> serde_json::Value {
        let gbs = match self.sync_seconds > 0.0 {
            true => self.sync_bytes as f64 / self.sync_seconds / 1e9,
            false => 0.0,
        };
        serde_json::json!({
            "world_size": self.world_size,
            "buckets": self.buckets,
            "shard_elems": self.shard_elems,
            "reduce_scatter_seconds": self.reduce_scatter_seconds,
            "weight_sync_seconds": self.sync_seconds,
            "weight_sync_bytes": self.sync_bytes,
            "weight_sync_gb_per_s": gbs,
            "staging_bytes": self.staging_bytes,
        })
    }
}

/// This rank's optimizer shards (one buffer per bucket) and the staging buffers.
pub struct ShardedOptim<B: Backend> {
    rank: usize,
    plan: BucketPlan,
    /// f32 master weights, reduced gradients and Adam moments of this rank's shard.
    master: Vec<B::Buf>,
    grad: Vec<B::Buf>,
    m: Vec<B::Buf>,
    v: Vec<B::Buf>,
    /// The shard in the compute dtype (what the weight sync gathers); empty when that is f32
    /// (then it gathers the masters).
    compute: Vec<B::Buf>,
    /// Two f32 buffers of the largest padded bucket: one is packed while the other is reduced.
    pack: [B::Buf; 2],
    sync: WeightSync<B>,
    /// Whether the moments hold a state (loaded, or a step was taken).
    moments: bool,
    pub stats: ShardStats,
}

impl<B: Backend> Decoder<B> {
    /// Shards the optimizer over `comm`'s ranks in buckets of about `bucket_elems` elements:
    /// this rank keeps its part of the masters and moments (loaded ones included) and the
    /// decoder frees its full copies. [`Decoder::unshard_optimizer`] undoes it.
    pub fn shard_optimizer(
        &mut self,
        comm: &dyn Comm<B>,
        bucket_elems: usize,
    ) -> Result<ShardedOptim<B>> {
        let (rank, world) = (comm.rank(), comm.world_size());
        let sizes: Vec<usize> = self.shapes.iter().map(|s| s.iter().product()).collect();
        let plan = BucketPlan::new(&sizes, bucket_elems, world)?;
        let b = &self.backend;
        let cut = |full: &[B::Buf]| -> Result<Vec<B::Buf>> {
            let mut out = Vec::with_capacity(plan.buckets.len());
            for (k, bucket) in plan.buckets.iter().enumerate() {
                let mut s = b.alloc(bucket.shard)?;
                for t in bucket.tensors.clone() {
                    if let Some((toff, soff, n)) = plan.shard_part(k, t, rank) {
                        b.copy(&mut s, soff, &full[t], toff, n)?;
                    }
                }
                out.push(s);
            }
            Ok(out)
        };
        let master = cut(if self.master.is_empty() {
            &self.w
        } else {
            &self.master
        })?;
        let moments = !self.m.is_empty();
        let (m, v) = match moments {
            true => (cut(&self.m)?, cut(&self.v)?),
            false => (cut_zeros(b, &plan)?, cut_zeros(b, &plan)?),
        };
        let grad = cut_zeros(b, &plan)?;
        let dtype = b.compute_dtype();
        let compute = match dtype {
            DType::F32 => Vec::new(),
            _ => plan
                .buckets
                .iter()
                .map(|k| b.alloc_as(k.shard, dtype))
                .collect::<Result<_>>()?,
        };
        let padded = plan.max_padded();
        let pack = [b.alloc(padded)?, b.alloc(padded)?];
        let sync = WeightSync::new(b, plan.clone(), dtype)?;
        let stats = ShardStats {
            world_size: world,
            buckets: plan.buckets.len(),
            shard_elems: plan.shard_total(),
            staging_bytes: (2 * padded * 4 + sync.staging_elems() * dtype_bytes(dtype)) as u64,
            ..ShardStats::default()
        };
        self.master.clear();
        self.m.clear();
        self.v.clear();
        Ok(ShardedOptim {
            rank,
            plan,
            master,
            grad,
            m,
            v,
            compute,
            pack,
            sync,
            moments,
            stats,
        })
    }

    /// One data-parallel optimizer step (see the module docs): the same result on every rank
    /// as `optimizer_step` on the gradients summed over the ranks. Every rank must call it.
    pub fn sharded_step(
        &mut self,
        st: &mut ShardedOptim<B>,
        comm: &dyn Comm<B>,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        check_hyper(hp, max_grad_norm)?;
        ensure!(
            comm.rank() == st.rank && comm.world_size() == st.plan.world_size,
            "sharded step: the communicator is not the one the optimizer was sharded over"
        );
        // A rank without rows this step has no gradients yet: it adds zeros.
        self.ensure_grads()?;
        let started = Instant::now();
        self.reduce_scatter_grads(st, comm)?;
        st.stats.reduce_scatter_seconds += started.elapsed().as_secs_f64();

        // ‖g‖² = Σ_ranks Σ shard², in f64 carried as two f32 (hi + lo) through the sum.
        let b = &self.backend;
        let parts: Vec<(&B::Buf, usize)> = st.grad.iter().map(|g| (g, b.len(g))).collect();
        let local = b.sum_squares_all(&parts)?;
        let hi = local as f32;
        let mut both = b.alloc(2)?;
        b.upload(&mut both, &[hi, (local - hi as f64) as f32])?;
        comm.all_reduce(&mut both, 0, 2, ReduceOp::Sum)?;
        let mut sums = [0f32; 2];
        b.download(&both, &mut sums)?;
        let grad_norm = (sums[0] as f64 + sums[1] as f64).max(0.0).sqrt() as f32;
        if !grad_norm.is_finite() {
            return Ok(StepReport {
                grad_norm,
                skipped: true,
            });
        }
        self.step += 1;
        let kernel = adamw_step(hp, self.step, clip_scale(grad_norm, max_grad_norm));
        for k in 0..st.plan.buckets.len() {
            let n = st.plan.buckets[k].shard;
            b.adamw(
                &mut st.master[k],
                &st.grad[k],
                &mut st.m[k],
                &mut st.v[k],
                n,
                &kernel,
            )?;
            if let Some(c) = st.compute.get_mut(k) {
                b.copy(c, 0, &st.master[k], 0, n)?;
            }
        }
        st.moments = true;
        let started = Instant::now();
        let shards = match st.compute.is_empty() {
            true => &st.master,
            false => &st.compute,
        };
        st.sync.run(b, comm, shards, &mut self.w)?;
        b.synchronize()?;
        st.stats.sync_seconds += started.elapsed().as_secs_f64();
        let dtype = b.compute_dtype();
        st.stats.sync_bytes += (st
            .plan
            .buckets
            .iter()
            .map(|k| k.padded(st.plan.world_size))
            .sum::<usize>()
            * dtype_bytes(dtype)) as u64;
        Ok(StepReport {
            grad_norm,
            skipped: false,
        })
    }

    /// `st.grad[b]` = this rank's shard of bucket b of the gradients summed over the ranks.
    /// Bucket b + 1 is packed while bucket b is reduced.
    fn reduce_scatter_grads(&self, st: &mut ShardedOptim<B>, comm: &dyn Comm<B>) -> Result<()> {
        let b = &self.backend;
        let plan = &st.plan;
        let pack = |k: usize, buf: &mut B::Buf| -> Result<()> {
            let bucket = &plan.buckets[k];
            b.fill(buf, bucket.padded(plan.world_size), 0.0)?;
            for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
                b.copy(buf, off, &self.g[t], 0, plan.sizes[t])?;
            }
            Ok(())
        };
        let [even, odd] = &mut st.pack;
        if !plan.buckets.is_empty() {
            pack(0, even)?;
        }
        for (k, (bucket, grad)) in plan.buckets.iter().zip(st.grad.iter_mut()).enumerate() {
            let (cur, next): (&B::Buf, &mut B::Buf) = match k % 2 {
                0 => (&*even, &mut *odd),
                _ => (&*odd, &mut *even),
            };
            let rs = Collective::reduce_scatter(cur, 0, grad, 0, bucket.shard, ReduceOp::Sum)
                .as_dtype(DType::F32);
            let work = comm.start(vec![rs])?;
            if k + 1 < plan.buckets.len() {
                pack(k + 1, next)?;
            }
            work.wait()?;
        }
        Ok(())
    }

    /// The f32 masters and the optimizer state, gathered bucket by bucket into rank `root`'s
    /// host memory (the other ranks take part and get None). Device memory grows by one
    /// staging bucket only, unlike [`Decoder::unshard_optimizer`]. Collective.
    pub fn gather_state(
        &self,
        st: &ShardedOptim<B>,
        comm: &dyn Comm<B>,
        root: usize,
    ) -> Result<Option<(Weights, OptimizerState)>> {
        let b = &self.backend;
        let plan = &st.plan;
        let mut staging = b.alloc(plan.max_padded())?;
        let mine = comm.rank() == root;
        let mut gather = |shards: &[B::Buf]| -> Result<Weights> {
            let mut out = Weights::new();
            for (k, bucket) in plan.buckets.iter().enumerate() {
                comm.all_gather(&shards[k], 0, &mut staging, 0, bucket.shard)?;
                if !mine {
                    continue;
                }
                let mut host = vec![0f32; bucket.len];
                b.download(&staging, &mut host)?;
                for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
                    let data = host[off..off + plan.sizes[t]].to_vec();
                    let shape = self.shapes[t].clone();
                    out.insert(self.names[t].clone(), Tensor { shape, data });
                }
            }
            Ok(out)
        };
        let masters = gather(&st.master)?;
        let state = match st.moments {
            true => OptimizerState {
                step: self.step,
                exp_avg: gather(&st.m)?,
                exp_avg_sq: gather(&st.v)?,
            },
            false => OptimizerState {
                step: self.step,
                ..OptimizerState::default()
            },
        };
        Ok(mine.then_some((masters, state)))
    }

    /// Gathers the masters and moments back into the decoder's full buffers (every rank), so
    /// that `export_weights` and `optimizer_state` give what the unsharded optimizer would.
    pub fn unshard_optimizer(
        &mut self,
        st: ShardedOptim<B>,
        comm: &dyn Comm<B>,
    ) -> Result<ShardStats> {
        let b = &self.backend;
        let mut gather = WeightSync::new(b, st.plan.clone(), DType::F32)?;
        let mut full = |shards: &[B::Buf]| -> Result<Vec<B::Buf>> {
            let mut out: Vec<B::Buf> = st
                .plan
                .sizes
                .iter()
                .map(|&n| b.alloc(n))
                .collect::<Result<_>>()?;
            gather.run(b, comm, shards, &mut out)?;
            Ok(out)
        };
        if b.compute_dtype() != DType::F32 {
            self.master = full(&st.master)?;
        }
        if st.moments {
            self.m = full(&st.m)?;
            self.v = full(&st.v)?;
        }
        Ok(st.stats)
    }
}

/// Zero shards of every bucket of `plan`.
fn cut_zeros<B: Backend>(b: &B, plan: &BucketPlan) -> Result<Vec<B::Buf>> {
    plan.buckets.iter().map(|k| b.alloc(k.shard)).collect()
}
