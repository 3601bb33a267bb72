//! The sharded optimizer's step (the gradients reduced, clipped by the global norm, AdamW on
//! this rank's shard, the weight sync), and the weights brought back whole: into a generation
//! copy, or into the decoder when the optimizer is unsharded.

use anyhow::{ensure, Result};
use std::time::Instant;

use super::optim::ShardedOptim;
use crate::backend::{Backend, DType};
use crate::engine::train::ShardStats;
use crate::model::decoder::{adamw_step, check_hyper, clip_scale};
use crate::model::decoder::{AdamWParams, Decoder, StepReport};
use crate::model::safetensors::round_bf16;
use crate::parallel::bucket::WeightSync;
use crate::parallel::comm::{dtype_bytes, sum_f64};
use crate::parallel::Comm;

impl<B: Backend> ShardedOptim<B> {
    /// One data-parallel optimizer step of `dec` (see the module docs of `optim`): the same
    /// result on every rank as `optimizer_step` on the gradients summed over the ranks. Every
    /// rank must call it.
    pub fn step(
        &mut self,
        dec: &mut Decoder<B>,
        comm: &dyn Comm<B>,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        check_hyper(hp, max_grad_norm)?;
        ensure!(
            comm.rank() == self.rank && comm.world_size() == self.plan.world_size,
            "sharded step: the communicator is not the one the optimizer was sharded over"
        );
        if self.full.is_none() {
            // Those not started during the backward (or at `reduce_grads`); the next step's
            // accumulation starts with none started, skipped or not.
            let reduced = self.reduce_grads(dec, comm);
            (self.started, self.armed) = (0, false);
            reduced?;
        }
        // ‖g‖² = Σ_ranks Σ shard².
        let b = dec.backend();
        let parts: Vec<(&B::Buf, usize)> = self.grad.iter().map(|g| (g, b.len(g))).collect();
        let mut sq = [b.sum_squares_all(&parts)?];
        sum_f64(b, comm, &mut sq)?;
        let grad_norm = sq[0].max(0.0).sqrt() as f32;
        if !grad_norm.is_finite() {
            return Ok(StepReport {
                grad_norm,
                skipped: true,
            });
        }
        let kernel = adamw_step(hp, dec.count_step(), clip_scale(grad_norm, max_grad_norm));
        let b = dec.backend();
        for k in 0..self.plan.buckets.len() {
            let n = self.plan.buckets[k].shard;
            let (master, grad) = (&mut self.master[k], &self.grad[k]);
            b.adamw(master, grad, &mut self.m[k], &mut self.v[k], n, &kernel)?;
            if let Some(c) = self.compute.get_mut(k) {
                b.copy(c, 0, &self.master[k], 0, n)?;
            }
        }
        self.moments = true;
        if self.sync.is_some() {
            self.sync_weights(dec, comm)?;
        }
        // Full sharding: the next pass gathers the units from the new shards.
        Ok(StepReport {
            grad_norm,
            skipped: false,
        })
    }

    /// zero2's weight sync: every rank's compute weights all-gathered from the shards.
    fn sync_weights(&mut self, dec: &mut Decoder<B>, comm: &dyn Comm<B>) -> Result<()> {
        let started = Instant::now();
        let sync = self.sync.as_mut().expect("zero2");
        let shards = match self.compute.is_empty() {
            true => &self.master,
            false => &self.compute,
        };
        let (b, w) = dec.weights_mut();
        sync.run(b, comm, shards, w)?;
        b.synchronize()?;
        self.stats.sync_seconds += started.elapsed().as_secs_f64();
        let dtype = b.compute_dtype();
        let world = self.plan.world_size;
        let padded: usize = self.plan.buckets.iter().map(|k| k.padded(world)).sum();
        self.stats.sync_bytes += (padded * dtype_bytes(dtype)) as u64;
        Ok(())
    }

    /// The shards of the compute weights (the masters where the compute dtype is f32).
    fn compute_shards(&self) -> &[B::Buf] {
        match self.compute.is_empty() {
            true => &self.master,
            false => &self.compute,
        }
    }

    /// A decoder that generates with the policy of `dec`, on `backend` (as
    /// [`Decoder::for_generation`] builds from the whole weights, fused projections included):
    /// its compute weights all-gathered from every rank's compute shards straight into its own
    /// buffers by the bucketed weight sync, without a trip through host memory; on a backend
    /// that computes in f32 (the masters are the shards there) then rounded to bf16, as the
    /// files store them. Device memory grows by the copy and the sync's two staging buckets.
    /// Collective.
    pub fn gather_generation(
        &self,
        dec: &Decoder<B>,
        comm: &dyn Comm<B>,
        backend: B,
    ) -> Result<Decoder<B>> {
        let mut gen = Decoder::unfilled_for_generation(backend, dec.config())?;
        ensure!(
            gen.param_names() == dec.param_names(),
            "generation copy: its tensors differ from the trained decoder's"
        );
        let b = dec.backend();
        let cd = b.compute_dtype();
        ensure!(
            gen.backend().compute_dtype() == cd,
            "generation copy: its backend computes in another dtype"
        );
        // The copy's buffers were zeroed on its backend's stream, and the collectives are
        // ordered with this decoder's: the one finishes before the other writes them, and
        // the copy is complete before its own stream reads it.
        gen.backend().synchronize()?;
        let shards = self.compute_shards();
        WeightSync::new(b, self.plan.clone(), cd)?.run(b, comm, shards, gen.weights_mut().1)?;
        b.synchronize()?;
        if cd == DType::F32 {
            let (g, w) = gen.weights_mut();
            for (w, &n) in w.iter_mut().zip(&self.plan.sizes) {
                let mut host = vec![0f32; n];
                g.download(w, &mut host)?;
                host.iter_mut().for_each(|x| *x = round_bf16(*x));
                g.upload(w, &host)?;
            }
        }
        Ok(gen)
    }

    /// Gathers the masters and moments back into `dec`'s full buffers (every rank), so that
    /// `export_weights` and `optimizer_state` give what the unsharded optimizer would.
    pub(crate) fn unshard(self, dec: &mut Decoder<B>, comm: &dyn Comm<B>) -> Result<ShardStats> {
        let b = dec.backend();
        let plan = &self.plan;
        let alloc = |dtype: DType| -> Result<Vec<B::Buf>> {
            plan.sizes.iter().map(|&n| b.alloc_as(n, dtype)).collect()
        };
        let whole = match self.full.is_some() {
            // Every rank gets the whole compute weights back (fresh buffers: no fused ones);
            // the gradients are allocated again by the next backward.
            true => {
                let cd = b.compute_dtype();
                let mut w = alloc(cd)?;
                WeightSync::new(b, plan.clone(), cd)?.run(
                    b,
                    comm,
                    self.compute_shards(),
                    &mut w,
                )?;
                Some(w)
            }
            false => None,
        };
        let mut gather = WeightSync::new(b, plan.clone(), DType::F32)?;
        let mut full = |shards: &[B::Buf]| -> Result<Vec<B::Buf>> {
            let mut out = alloc(DType::F32)?;
            gather.run(b, comm, shards, &mut out)?;
            Ok(out)
        };
        let master = match b.compute_dtype() != DType::F32 {
            true => Some(full(&self.master)?),
            false => None,
        };
        let moments = match self.moments {
            true => Some((full(&self.m)?, full(&self.v)?)),
            false => None,
        };
        if let Some(w) = whole {
            dec.hold_whole(w);
        }
        dec.put_state(master, moments);
        Ok(self.stats)
    }
}
