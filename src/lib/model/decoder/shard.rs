//! The data-parallel optimizer (ZeRO-2-like): every rank keeps the compute weights in full, and
//! 1/N of the f32 master weights, Adam moments and reduced gradients, over the flat bucket
//! layout of [`BucketPlan`]. The backward passes of a step add the gradients up in full; the
//! backward of the rank's last pass of the step ([`ShardedOptim::arm_overlap`]) reduce-scatters
//! each bucket as soon as all its gradients are final, while the rest of the backward runs
//! ([`Overlap`], DeepSpeed ZeRO-2's `overlap_comm` under gradient accumulation; earlier passes
//! do not communicate). The step then reduces any bucket not started yet, clips by the global
//! norm (the shards' sums of squares, all-reduced), updates this rank's shard with AdamW and
//! all-gathers the compute weights back into every rank's decoder ([`WeightSync`], the weight
//! sync).
//!
//! Every rank starts the same reduce-scatters in the same order ([`ShardedOptim`]'s `order`,
//! fixed by the model), whatever its passes: a rank with fewer passes starts them in its own
//! last backward (no other collective runs between the passes under zero2), a rank with no
//! rows (or whose last pass scored nothing) at [`Decoder::reduce_grads`], which every rank
//! calls after its passes, before any other collective of the step.
//!
//! AdamW is elementwise, so a rank's shard gets exactly the update the unsharded optimizer
//! gives those elements from the same summed gradients.
//!
//! `shard = "full"` (FSDP / ZeRO-3, [`Decoder::shard_full`]) shards the compute weights too,
//! one bucket per unit: the passes ([`Holding`]) all-gather each unit before its forward and
//! its backward, with the next unit's all-gather prefetched while it computes (into a second
//! staging buffer), free it after, and reduce-scatter its gradients as soon as its backward
//! is done; the step then has no weight sync.

use anyhow::{ensure, Context, Result};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::Instant;

use super::optim::{adamw_step, check_hyper, clip_scale};
use super::{AdamWParams, Decoder, OptimizerState, StepReport};
use crate::backend::{Backend, DType, Device};
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Tensor, Weights};
use crate::parallel::bucket::{BucketPlan, WeightSync};
use crate::parallel::comm::{dtype_bytes, sum_f64};
use crate::parallel::{Collective, Comm, ReduceOp, Work};

/// What the sharded optimizer did so far (the update metrics' `shard` object).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardStats {
    pub world_size: usize,
    pub buckets: usize,
    /// Elements of this rank's shards (of every bucket together).
    pub shard_elems: usize,
    /// Wall seconds the host spent on the gradients' reduce-scatter outside its overlap with
    /// the backward: packing and reducing the buckets started after the backward (all of them
    /// on a rank with no rows), and waiting for those started during it (for a pack buffer, or
    /// at the end of the backward; a GPU's wait does not block the host). Under full sharding:
    /// the units' reduce-scatters in the backward, whole.
    pub reduce_scatter_seconds: f64,
    /// Buckets whose reduce-scatter this rank started during a backward (zero2's overlap).
    pub overlapped_buckets: u64,
    /// Wall seconds of the weight sync (the all-gather of the compute weights, copies
    /// included) and the bytes each rank received in it.
    pub sync_seconds: f64,
    pub sync_bytes: u64,
    /// Bytes of the staging buffers the reduce-scatter and the weight sync add.
    pub staging_bytes: u64,
    /// `shard = "full"`: the units' all-gathers (before each forward and backward), their
    /// wall seconds and the bytes each rank received.
    pub full: bool,
    pub unit_gathers: u64,
    pub unit_gather_seconds: f64,
    pub unit_gather_bytes: u64,
    /// `shard = "full"`: the units' all-gathers started ahead (prefetched), while the unit
    /// before them computes.
    pub unit_prefetches: u64,
    /// A checkpointing update: wall seconds of bringing the state to the hosts (the masters
    /// gathered on rank 0, and each rank's own shard downloaded), and of writing this rank's
    /// optimizer shard file.
    pub state_gather_seconds: f64,
    pub shard_write_seconds: f64,
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
            "overlapped_buckets": self.overlapped_buckets,
            "weight_sync_seconds": self.sync_seconds,
            "weight_sync_bytes": self.sync_bytes,
            "weight_sync_gb_per_s": gbs,
            "staging_bytes": self.staging_bytes,
            "mode": if self.full { "full" } else { "zero2" },
            "unit_gathers": self.unit_gathers,
            "unit_gather_seconds": self.unit_gather_seconds,
            "unit_gather_bytes": self.unit_gather_bytes,
            "unit_prefetches": self.unit_prefetches,
            "state_gather_seconds": self.state_gather_seconds,
            "shard_write_seconds": self.shard_write_seconds,
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
    /// `shard = "full"`: the compute weights are sharded too (one bucket per unit, see
    /// [`Holding`]); the decoder holds a unit's weights and gradients only while it runs.
    full: Option<FullShard<B>>,
    /// Two f32 buffers of the largest padded bucket: one is packed while the other is reduced.
    pack: [B::Buf; 2],
    /// zero2: the order every rank starts the buckets' reduce-scatters in (as their gradients
    /// become final in the backward: the head's first, the embedding's last), the backward
    /// step ([`backward_step`]) after which each bucket's gradients are final, how many of
    /// `order` this step has started, and whether the next pass is the step's last here.
    order: Vec<usize>,
    ready: Vec<usize>,
    started: usize,
    armed: bool,
    /// The decoder's layers (for [`backward_step`]).
    layers: usize,
    /// The weight sync (zero2); None under `shard = "full"` (the units are gathered instead).
    sync: Option<WeightSync<B>>,
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
        let sizes: Vec<usize> = self.shapes.iter().map(|s| s.iter().product()).collect();
        let plan = BucketPlan::new(&sizes, bucket_elems, comm.world_size())?;
        self.shard_over(comm, plan, false)
    }

    /// `shard = "full"` (FSDP / ZeRO-3): as [`Decoder::shard_optimizer`] with one bucket per
    /// unit (the embedding, each layer, the final norm and untied head), and the compute
    /// weights sharded too: the decoder frees its full weights and gradients; the passes of
    /// [`Holding`] gather each unit before its forward and its backward and reduce-scatter its
    /// gradients as soon as its backward is done. [`Decoder::unshard_optimizer`] undoes it.
    pub fn shard_full(&mut self, comm: &dyn Comm<B>) -> Result<ShardedOptim<B>> {
        let plan = self.unit_plan(comm.world_size())?;
        let st = self.shard_over(comm, plan, true)?;
        self.hold_units(st)
    }

    /// A decoder under `shard = "full"` built from host weights (and a loaded optimizer
    /// state) without ever holding them whole on the device: this rank's shards are cut on
    /// the host and uploaded; as [`Decoder::new`] then [`Decoder::shard_full`] otherwise.
    pub fn new_full(
        backend: B,
        cfg: &Config,
        weights: &Weights,
        state: Option<&OptimizerState>,
        comm: &dyn Comm<B>,
    ) -> Result<(Decoder<B>, ShardedOptim<B>)> {
        let mut dec = Decoder::build(backend, cfg, Some(weights), super::Hold::Nothing)?;
        let plan = dec.unit_plan(comm.world_size())?;
        let rank = comm.rank();
        let moments = match state {
            Some(st) => dec.state_moments(st)?,
            None => None,
        };
        let b = &dec.backend;
        let cut = |src: &[&[f32]]| -> Result<Vec<B::Buf>> {
            let mut out = Vec::with_capacity(plan.buckets.len());
            for (k, bucket) in plan.buckets.iter().enumerate() {
                let mut host = vec![0f32; bucket.shard];
                for t in bucket.tensors.clone() {
                    if let Some((toff, soff, n)) = plan.shard_part(k, t, rank) {
                        host[soff..soff + n].copy_from_slice(&src[t][toff..toff + n]);
                    }
                }
                let mut buf = b.alloc(bucket.shard)?;
                b.upload(&mut buf, &host)?;
                out.push(buf);
            }
            Ok(out)
        };
        // Every name was checked by `build`.
        let w: Vec<&[f32]> = dec.names.iter().map(|n| &weights[n].data[..]).collect();
        let master = cut(&w)?;
        let mv = match &moments {
            Some(mv) => {
                let m: Vec<&[f32]> = mv.iter().map(|p| &p.0.data[..]).collect();
                let v: Vec<&[f32]> = mv.iter().map(|p| &p.1.data[..]).collect();
                Some((cut(&m)?, cut(&v)?))
            }
            None => None,
        };
        dec.step = state.map_or(0, |s| s.step);
        let st = dec.assemble(rank, plan, master, mv, true)?;
        let st = dec.hold_units(st)?;
        Ok((dec, st))
    }

    /// One bucket per unit: the embedding, each layer, the final norm (and untied head).
    fn unit_plan(&self, world: usize) -> Result<BucketPlan> {
        let sizes: Vec<usize> = self.shapes.iter().map(|s| s.iter().product()).collect();
        let mut breaks: Vec<usize> = self.layers.iter().map(|l| l.in_norm).collect();
        breaks.push(self.final_norm);
        let plan = BucketPlan::with_breaks(&sizes, usize::MAX, world, &breaks)?;
        ensure!(
            plan.buckets.len() == self.layers.len() + 2,
            "full sharding: the parameters are not laid out unit by unit"
        );
        Ok(plan)
    }

    /// The staging of full sharding; the decoder drops its fused buffers and keeps empty
    /// gradient buffers (a unit's are allocated for its backward).
    fn hold_units(&mut self, mut st: ShardedOptim<B>) -> Result<ShardedOptim<B>> {
        let b = &self.backend;
        let cd = b.compute_dtype();
        let padded = st.plan.max_padded();
        let max_shard = st.plan.buckets.iter().map(|k| k.shard).max().unwrap_or(0);
        st.full = Some(FullShard {
            gathered: [
                Box::new(b.alloc_as(padded, cd)?),
                Box::new(b.alloc_as(padded, cd)?),
            ],
            reduced: b.alloc(max_shard)?,
            tied: self.head == self.embed,
        });
        st.stats.staging_bytes = (padded * 4 + 2 * padded * dtype_bytes(cd) + max_shard * 4) as u64;
        // The fused projections are parts of the full weights: training runs the split GEMMs.
        self.fused.clear();
        for ly in &mut self.layers {
            (ly.qkv, ly.qkv_b, ly.gate_up) = (None, None, None);
        }
        for w in &mut self.w {
            *w = b.alloc_as(0, cd)?;
        }
        self.g.clear();
        self.ensure_grads(true)?;
        self.ws_epoch += 1;
        Ok(st)
    }

    fn shard_over(
        &mut self,
        comm: &dyn Comm<B>,
        plan: BucketPlan,
        full: bool,
    ) -> Result<ShardedOptim<B>> {
        let rank = comm.rank();
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
        // Each full copy is freed as soon as its shard is cut, so the peak is the full state
        // plus one kind of shard, not plus all of them.
        self.master.clear();
        let mv = match self.m.is_empty() {
            false => {
                let m = cut(&self.m)?;
                self.m.clear();
                let v = cut(&self.v)?;
                self.v.clear();
                Some((m, v))
            }
            true => None,
        };
        self.assemble(rank, plan, master, mv, full)
    }

    /// This rank's optimizer from its master shards and its moments' (None: zeros); under
    /// `full`, the compute shards start from the masters.
    fn assemble(
        &mut self,
        rank: usize,
        plan: BucketPlan,
        master: Vec<B::Buf>,
        mv: Option<Moments<B>>,
        full: bool,
    ) -> Result<ShardedOptim<B>> {
        let b = &self.backend;
        let world = plan.world_size;
        let dtype = b.compute_dtype();
        let mut compute: Vec<B::Buf> = match dtype {
            DType::F32 => Vec::new(),
            _ => plan
                .buckets
                .iter()
                .map(|k| b.alloc_as(k.shard, dtype))
                .collect::<Result<_>>()?,
        };
        if full {
            // The passes gather the compute weights from these shards from the first one on.
            for (k, c) in compute.iter_mut().enumerate() {
                b.copy(c, 0, &master[k], 0, plan.buckets[k].shard)?;
            }
        }
        let moments = mv.is_some();
        let (m, v) = match mv {
            Some(mv) => mv,
            None => (cut_zeros(b, &plan)?, cut_zeros(b, &plan)?),
        };
        let grad = cut_zeros(b, &plan)?;
        let padded = plan.max_padded();
        let (pack, sync) = match full {
            false => (
                [b.alloc(padded)?, b.alloc(padded)?],
                Some(WeightSync::new(b, plan.clone(), dtype)?),
            ),
            true => ([b.alloc(padded)?, b.alloc(0)?], None),
        };
        let sync_elems = sync.as_ref().map_or(0, WeightSync::staging_elems);
        let ready = self.grads_final_at(&plan);
        let mut order: Vec<usize> = (0..plan.buckets.len()).rev().collect();
        order.sort_by_key(|&k| ready[k]);
        let stats = ShardStats {
            world_size: world,
            buckets: plan.buckets.len(),
            shard_elems: plan.shard_total(),
            staging_bytes: (2 * padded * 4 + sync_elems * dtype_bytes(dtype)) as u64,
            full,
            ..ShardStats::default()
        };
        Ok(ShardedOptim {
            rank,
            plan,
            master,
            grad,
            m,
            v,
            compute,
            full: None,
            pack,
            order,
            ready,
            started: 0,
            armed: false,
            layers: self.layers.len(),
            sync,
            moments,
            stats,
        })
    }

    /// For each bucket of `plan`, the backward step ([`backward_step`]) after which all its
    /// gradients are final: the final norm's and an untied head's after the head's, a layer's
    /// after its own, the embedding's (a tied head's) after the embedding's. A tensor of no
    /// unit would count as the embedding's (the last).
    fn grads_final_at(&self, plan: &BucketPlan) -> Vec<usize> {
        let layers = self.layers.len();
        let mut at = vec![backward_step(Unit::Embed, layers); plan.sizes.len()];
        at[self.final_norm] = backward_step(Unit::Head, layers);
        at[self.head] = backward_step(Unit::Head, layers);
        at[self.embed] = backward_step(Unit::Embed, layers);
        for (l, ly) in self.layers.iter().enumerate() {
            let step = backward_step(Unit::Layer(l), layers);
            let fixed = [
                ly.in_norm,
                ly.q,
                ly.k,
                ly.v,
                ly.o,
                ly.post_norm,
                ly.gate,
                ly.up,
                ly.down,
            ];
            let optional = [ly.q_b, ly.k_b, ly.v_b, ly.q_norm, ly.k_norm];
            for t in fixed.into_iter().chain(optional.into_iter().flatten()) {
                at[t] = step;
            }
        }
        plan.buckets
            .iter()
            .map(|k| k.tensors.clone().map(|t| at[t]).max().unwrap_or(0))
            .collect()
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
        if st.full.is_none() {
            // Those not started during the backward (or at `reduce_grads`); the next step's
            // accumulation starts with none started, skipped or not.
            let reduced = self.reduce_grads(st, comm);
            (st.started, st.armed) = (0, false);
            reduced?;
        }

        // ‖g‖² = Σ_ranks Σ shard².
        let b = &self.backend;
        let parts: Vec<(&B::Buf, usize)> = st.grad.iter().map(|g| (g, b.len(g))).collect();
        let mut sq = [b.sum_squares_all(&parts)?];
        sum_f64(b, comm, &mut sq)?;
        let grad_norm = sq[0].max(0.0).sqrt() as f32;
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
        let Some(sync) = st.sync.as_mut() else {
            // Full sharding: the next pass gathers the units from the new shards.
            return Ok(StepReport {
                grad_norm,
                skipped: false,
            });
        };
        let started = Instant::now();
        let shards = match st.compute.is_empty() {
            true => &st.master,
            false => &st.compute,
        };
        sync.run(b, comm, shards, &mut self.w)?;
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

    /// zero2: starts the reduce-scatters of the step's gradients that its backward did not
    /// start, in the ranks' common order, and waits for them: then `st.grad[k]` = this rank's
    /// shard of bucket k of the gradients summed over the ranks. Every rank calls it once its
    /// step's passes are done, before any other collective of the step (a rank with no rows
    /// reduces zeros); [`Decoder::sharded_step`] calls it too (then a no-op).
    pub fn reduce_grads(&mut self, st: &mut ShardedOptim<B>, comm: &dyn Comm<B>) -> Result<()> {
        ensure!(
            !st.is_full(),
            "reduce_grads: full sharding reduces unit by unit"
        );
        if st.started == st.order.len() {
            return Ok(());
        }
        let started = Instant::now();
        self.ensure_grads(false)?;
        let mut ov = st.overlap(comm);
        let done = ov.start_ready(&self.backend, &self.g, usize::MAX);
        let done = done.and_then(|()| ov.drain());
        let seconds = started.elapsed().as_secs_f64();
        // Its waits were counted already.
        ov.stats.reduce_scatter_seconds += seconds - std::mem::take(&mut ov.waited);
        done
    }

    /// The f32 masters and (with `moments`) the optimizer state, gathered bucket by bucket into
    /// rank `root`'s host memory (the other ranks take part and get None). Device memory grows by one
    /// staging bucket only, unlike [`Decoder::unshard_optimizer`]. Collective.
    pub fn gather_state(
        &self,
        st: &ShardedOptim<B>,
        comm: &dyn Comm<B>,
        root: usize,
        moments: bool,
    ) -> Result<Option<(Weights, Option<OptimizerState>)>> {
        let mine = comm.rank() == root;
        let gather = |shards: &[B::Buf]| self.gather_host(st, shards, comm, mine);
        let masters = gather(&st.master)?;
        let state = match (moments, st.moments) {
            (false, _) => None,
            (true, true) => Some(OptimizerState {
                step: self.step,
                exp_avg: gather(&st.m)?,
                exp_avg_sq: gather(&st.v)?,
            }),
            (true, false) => Some(OptimizerState {
                step: self.step,
                ..OptimizerState::default()
            }),
        };
        Ok(mine.then_some((masters, state)))
    }

    /// A decoder that generates with the policy, on `backend` (as [`Decoder::for_generation`]
    /// builds from the whole weights, fused projections included): its compute weights
    /// all-gathered from every rank's compute shards straight into its own buffers by the
    /// bucketed weight sync, without a trip through host memory; on a backend that computes
    /// in f32 (the masters are the shards there) then rounded to bf16, as the files store
    /// them. Device memory grows by the copy and the sync's two staging buckets. Collective.
    pub fn gather_generation(
        &self,
        st: &ShardedOptim<B>,
        comm: &dyn Comm<B>,
        backend: B,
    ) -> Result<Decoder<B>> {
        let mut gen = Decoder::build(backend, &self.cfg, None, super::Hold::Compute)?;
        ensure!(
            gen.names == self.names,
            "generation copy: its tensors differ from the trained decoder's"
        );
        let shards = match st.compute.is_empty() {
            true => &st.master,
            false => &st.compute,
        };
        let b = &self.backend;
        let cd = b.compute_dtype();
        ensure!(
            gen.backend.compute_dtype() == cd,
            "generation copy: its backend computes in another dtype"
        );
        // The copy's buffers were zeroed on its backend's stream, and the collectives are
        // ordered with this decoder's: the one finishes before the other writes them, and
        // the copy is complete before its own stream reads it.
        gen.backend.synchronize()?;
        WeightSync::new(b, st.plan.clone(), cd)?.run(b, comm, shards, &mut gen.w)?;
        b.synchronize()?;
        if cd == DType::F32 {
            let g = &gen.backend;
            for (w, &n) in gen.w.iter_mut().zip(&st.plan.sizes) {
                let mut host = vec![0f32; n];
                g.download(w, &mut host)?;
                host.iter_mut().for_each(|x| *x = round_bf16(*x));
                g.upload(w, &host)?;
            }
        }
        Ok(gen)
    }

    /// Whole tensors (by name) from every rank's f32 `shards` (one per bucket of `st`'s plan),
    /// all-gathered bucket by bucket through one staging buffer; downloaded only where `keep`
    /// (the other ranks take part and get an empty map). Collective.
    fn gather_host(
        &self,
        st: &ShardedOptim<B>,
        shards: &[B::Buf],
        comm: &dyn Comm<B>,
        keep: bool,
    ) -> Result<Weights> {
        let b = &self.backend;
        let plan = &st.plan;
        let mut staging = b.alloc(plan.max_padded())?;
        let mut out = Weights::new();
        for (k, bucket) in plan.buckets.iter().enumerate() {
            let c = Collective::all_gather(&shards[k], 0, &mut staging, 0, bucket.shard)
                .as_dtype(DType::F32);
            comm.run(vec![c])?;
            if !keep {
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
    }

    /// Gathers the masters and moments back into the decoder's full buffers (every rank), so
    /// that `export_weights` and `optimizer_state` give what the unsharded optimizer would.
    pub fn unshard_optimizer(
        &mut self,
        st: ShardedOptim<B>,
        comm: &dyn Comm<B>,
    ) -> Result<ShardStats> {
        let b = &self.backend;
        if st.full.is_some() {
            // Every rank gets the whole compute weights back (fresh buffers: no fused ones);
            // the gradients are allocated again by the next backward.
            let cd = b.compute_dtype();
            let mut w: Vec<B::Buf> = st
                .plan
                .sizes
                .iter()
                .map(|&n| b.alloc_as(n, cd))
                .collect::<Result<_>>()?;
            let shards = match st.compute.is_empty() {
                true => &st.master,
                false => &st.compute,
            };
            WeightSync::new(b, st.plan.clone(), cd)?.run(b, comm, shards, &mut w)?;
            self.w = w;
            self.g.clear();
            self.ws_epoch += 1;
        }
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

/// Where a rank's shard lies in the parameters: the bucket plan over the decoder's tensors
/// (names and shapes in its order). A shard file records it, so that one written with another
/// world size, bucket size, shard mode or model is refused rather than misread, and so that
/// the shards of all ranks can be put back together.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardLayout {
    pub world_size: usize,
    pub names: Vec<String>,
    pub shapes: Vec<Vec<usize>>,
    /// Per bucket: its first tensor, one past its last, each tensor's offset in it, its
    /// length and one rank's (padded) shard length.
    pub buckets: Vec<(usize, usize, Vec<usize>, usize, usize)>,
}

impl ShardLayout {
    /// Whole tensors (by name) from every rank's shard of every bucket (`shards[rank][bucket]`).
    pub fn unflatten(&self, shards: &[&[Vec<f32>]]) -> Result<Weights> {
        ensure!(
            shards.len() == self.world_size,
            "{} shards for a world of {}",
            shards.len(),
            self.world_size
        );
        let mut out = Weights::new();
        for (k, (first, end, offsets, len, shard)) in self.buckets.iter().enumerate() {
            let mut flat = Vec::with_capacity(shard * self.world_size);
            for s in shards {
                ensure!(
                    s.len() == self.buckets.len() && s[k].len() == *shard,
                    "bad shard size"
                );
                flat.extend_from_slice(&s[k]);
            }
            ensure!(flat.len() >= *len, "bucket {k} is short");
            for (t, &off) in (*first..*end).zip(offsets) {
                let shape = self.shapes[t].clone();
                let n: usize = shape.iter().product();
                let data = flat[off..off + n].to_vec();
                out.insert(self.names[t].clone(), Tensor { shape, data });
            }
        }
        Ok(out)
    }
}

/// One rank's optimizer shards on the host, bucket by bucket, as its shard file holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct HostShard {
    pub rank: usize,
    pub layout: ShardLayout,
    /// AdamW steps taken.
    pub step: u64,
    pub master: Vec<Vec<f32>>,
    /// Adam's moments (None before the first step).
    pub moments: Option<(Buckets, Buckets)>,
}

/// One host vector per bucket.
pub type Buckets = Vec<Vec<f32>>;

impl<B: Backend> Decoder<B> {
    /// The layout of `st`'s shards.
    pub fn shard_layout(&self, st: &ShardedOptim<B>) -> ShardLayout {
        ShardLayout {
            world_size: st.plan.world_size,
            names: self.names.clone(),
            shapes: self.shapes.clone(),
            buckets: st
                .plan
                .buckets
                .iter()
                .map(|k| {
                    let t = k.tensors.clone();
                    (t.start, t.end, k.offsets.clone(), k.len, k.shard)
                })
                .collect(),
        }
    }

    /// This rank's masters and moments brought to the host (no collective): what it writes
    /// as its shard of a checkpoint.
    pub fn download_shard(&self, st: &ShardedOptim<B>) -> Result<HostShard> {
        let b = &self.backend;
        let down = |bufs: &[B::Buf]| -> Result<Vec<Vec<f32>>> {
            let mut out = Vec::with_capacity(bufs.len());
            for (k, buf) in bufs.iter().enumerate() {
                let mut host = vec![0f32; st.plan.buckets[k].shard];
                b.download(buf, &mut host)?;
                out.push(host);
            }
            Ok(out)
        };
        Ok(HostShard {
            rank: st.rank,
            layout: self.shard_layout(st),
            step: self.step,
            master: down(&st.master)?,
            moments: match st.moments {
                true => Some((down(&st.m)?, down(&st.v)?)),
                false => None,
            },
        })
    }

    /// Puts a loaded shard (this rank's, of a checkpoint written with the same layout) in
    /// place of the shards `st` was cut with from `weights` (the model files' weights,
    /// widened). As one process does, the masters are taken only when every one rounds to the
    /// model's bf16 weight, on every rank (agreed by a collective, so that all ranks take the
    /// same choice); the moments and the step always. Returns whether the masters were taken.
    /// Collective.
    pub fn load_shard(
        &mut self,
        st: &mut ShardedOptim<B>,
        shard: &HostShard,
        weights: &Weights,
        comm: &dyn Comm<B>,
    ) -> Result<bool> {
        let layout = self.shard_layout(st);
        if shard.layout != layout || shard.rank != st.rank {
            crate::bail_input!(
                "the optimizer shard of rank {} was written with another shard layout than this update's (rank {}: another --shard mode or --bucket-elems); continue with the --shard, --bucket-elems and number of ranks that wrote it, or merge the checkpoint's shards first (`tandem merge-shards CKPT --out DIR`: loads with any layout), or start from the model files without its optimizer state",
                shard.rank,
                st.rank
            );
        }
        let plan = &st.plan;
        let mut differs = false;
        for (k, bucket) in plan.buckets.iter().enumerate() {
            for t in bucket.tensors.clone() {
                if let Some((toff, soff, n)) = plan.shard_part(k, t, st.rank) {
                    let w = &weights[&self.names[t]].data[toff..toff + n];
                    let m = &shard.master[k][soff..soff + n];
                    differs |= m
                        .iter()
                        .zip(w)
                        .any(|(&a, &b)| round_bf16(a).to_bits() != b.to_bits());
                }
            }
        }
        let b = &self.backend;
        let mut votes = [differs as u8 as f64];
        sum_f64(b, comm, &mut votes)?;
        let take = votes[0] == 0.0;
        let up = |host: &[Vec<f32>], bufs: &mut [B::Buf]| -> Result<()> {
            for (h, buf) in host.iter().zip(bufs.iter_mut()) {
                b.upload(buf, h)?;
            }
            Ok(())
        };
        if take {
            up(&shard.master, &mut st.master)?;
            for (k, c) in st.compute.iter_mut().enumerate() {
                b.copy(c, 0, &st.master[k], 0, plan.buckets[k].shard)?;
            }
            // zero2's compute weights are whole on every rank: they come from the masters
            // (on an f32 backend they are the masters, finer than the files' bf16).
            if let Some(sync) = st.sync.as_mut() {
                let shards = match st.compute.is_empty() {
                    true => &st.master,
                    false => &st.compute,
                };
                sync.run(b, comm, shards, &mut self.w)?;
            }
        }
        if let Some((m, v)) = &shard.moments {
            up(m, &mut st.m)?;
            up(v, &mut st.v)?;
            st.moments = true;
        }
        self.step = shard.step;
        Ok(take)
    }
}

impl<B: Backend> ShardedOptim<B> {
    /// Whether the compute weights are sharded too (`shard = "full"`).
    pub fn is_full(&self) -> bool {
        self.full.is_some()
    }

    /// Zeroes this rank's gradient shards (the start of a step's accumulation under full
    /// sharding, where the passes add into them).
    pub fn zero_grads(&mut self, b: &B) -> Result<()> {
        for (k, g) in self.grad.iter_mut().enumerate() {
            b.fill(g, self.plan.buckets[k].shard, 0.0)?;
        }
        Ok(())
    }

    /// zero2: a new step's accumulation (nothing reduced, no pass marked the last).
    pub fn begin_step(&mut self) {
        (self.started, self.armed) = (0, false);
    }

    /// zero2: the next pass is this rank's last of the step: its backward starts the
    /// reduce-scatters ([`ShardedOptim::take_pass`]). No-op under full sharding.
    pub fn arm_overlap(&mut self) {
        self.armed = !self.is_full();
    }

    /// zero2, before a pass: whether it is the step's last here (see
    /// [`ShardedOptim::arm_overlap`]; then it runs with [`ShardedOptim::overlap`]). Fails when
    /// the step's gradients were reduced already (a pass after [`Decoder::reduce_grads`]).
    pub fn take_pass(&mut self) -> Result<bool> {
        ensure!(
            self.started == 0,
            "a training pass after this step's gradients were reduced (start a step with begin_step)"
        );
        Ok(std::mem::take(&mut self.armed))
    }

    /// The reduce-scatters of this step's buckets not started yet, on `comm` (the one the
    /// optimizer was sharded over), for a pass's [`PassComm::Overlapped`]. Dropping it waits
    /// for those in flight.
    pub fn overlap<'a>(&'a mut self, comm: &'a dyn Comm<B>) -> Overlap<'a, B> {
        let ShardedOptim {
            plan,
            grad,
            pack: [p0, p1],
            order,
            ready,
            started,
            layers,
            stats,
            ..
        } = self;
        Overlap {
            comm,
            plan,
            order,
            ready,
            started,
            layers,
            stats,
            waited: 0.0,
            grad: grad.iter_mut().map(Some).collect(),
            pack: [NonNull::from(p0), NonNull::from(p1)],
            inflight: VecDeque::with_capacity(2),
            _pack: PhantomData,
        }
    }
}

/// The step of the backward after which unit `u`'s gradients are final (of a decoder of
/// `layers` layers): the head (final norm and LM head) 0, then the layers from the top, then
/// the embedding.
fn backward_step(u: Unit, layers: usize) -> usize {
    match u {
        Unit::Head => 0,
        Unit::Layer(l) => layers - l,
        Unit::Embed => layers + 1,
    }
}

/// zero2's reduce-scatter of a step's gradients overlapped with the backward of the rank's
/// last pass (from [`ShardedOptim::overlap`]): after each unit's backward, every bucket whose
/// gradients are all final (and all before it in the ranks' common order) is packed into a
/// free one of the two pack buffers and its reduce-scatter started on the communication
/// stream; it runs while the backward goes on. At most two are in flight (the staging memory
/// stays the two pack buffers): the third waits for the first. Everything started is waited
/// for before the pass returns (dropping the `Overlap` waits too): on a GPU that wait only
/// orders the compute stream after the collectives, which whatever follows the backward (the
/// step) needs anyway, and no collective outlives the borrows of the communicator and buffers.
pub struct Overlap<'a, B: Backend> {
    comm: &'a dyn Comm<B>,
    plan: &'a BucketPlan,
    order: &'a [usize],
    ready: &'a [usize],
    /// The optimizer's count of `order` started this step.
    started: &'a mut usize,
    layers: &'a usize,
    stats: &'a mut ShardStats,
    /// Seconds waited on collectives through this `Overlap` (also added to the stats).
    waited: f64,
    /// Each bucket's gradient shard, lent to its reduce-scatter (once a step).
    grad: Vec<Option<&'a mut B::Buf>>,
    /// The optimizer's two pack buffers, borrowed mutably for `'a` (`_pack`). Each is either
    /// free (no reference to it lives) or read by exactly one reduce-scatter of `inflight`
    /// through a shared reference made from it; see `start` for why that is sound.
    pack: [NonNull<B::Buf>; 2],
    /// Reduce-scatters in flight, oldest first, with the pack buffer each reads.
    inflight: VecDeque<(usize, Work<'a>)>,
    _pack: PhantomData<&'a mut [B::Buf; 2]>,
}

impl<'a, B: Backend> Overlap<'a, B> {
    /// After unit `u`'s backward (the gradients `g` of this pass added): starts the buckets
    /// whose gradients are now final.
    pub(super) fn done(&mut self, b: &B, g: &[B::Buf], u: Unit) -> Result<()> {
        let before = *self.started;
        let step = backward_step(u, *self.layers);
        let r = self.start_ready(b, g, step);
        self.stats.overlapped_buckets += (*self.started - before) as u64;
        r
    }

    /// Starts, in the common order, the buckets not started yet whose gradients are final
    /// after backward step `step` (`usize::MAX`: all of them).
    pub(super) fn start_ready(&mut self, b: &B, g: &[B::Buf], step: usize) -> Result<()> {
        while let Some(&k) = self.order.get(*self.started) {
            if self.ready[k] > step {
                break;
            }
            self.start(b, g, k)?;
        }
        Ok(())
    }

    /// Packs bucket `k` of `g` and starts its reduce-scatter into the rank's gradient shard.
    fn start(&mut self, b: &B, g: &[B::Buf], k: usize) -> Result<()> {
        if self.inflight.len() == 2 {
            self.wait_oldest()?;
        }
        let slot = match self.inflight.front() {
            Some(&(busy, _)) => 1 - busy,
            None => 0,
        };
        let bucket = &self.plan.buckets[k];
        // SAFETY: `pack[slot]` points into the optimizer, which `self` borrows mutably for
        // 'a, so it is valid and nothing else reaches it until 'a ends. No reference made from
        // it lives now: the only one ever made outside this function is the shared one a
        // reduce-scatter of `inflight` holds, and the one of this slot (if any) was waited for
        // and dropped (at most one other is in flight, and it uses the other slot). This
        // mutable one ends with the packing, before the shared one below is made.
        let buf = unsafe { self.pack[slot].as_mut() };
        b.fill(buf, bucket.padded(self.plan.world_size), 0.0)?;
        for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
            b.copy(buf, off, &g[t], 0, self.plan.sizes[t])?;
        }
        // SAFETY: as above, the slot stays valid for 'a; this shared reference goes into the
        // reduce-scatter's `Work`, which is waited for (consumed) before the slot is packed
        // again (`wait_oldest`, `drain`), or when `self` drops, within 'a. So the lifetime 'a
        // it claims is longer than its use, never than the buffer's.
        let src: &'a B::Buf = unsafe { self.pack[slot].as_ref() };
        let dst = self.grad[k]
            .take()
            .expect("each bucket is reduced once a step");
        let rs = Collective::reduce_scatter(src, 0, dst, 0, bucket.shard, ReduceOp::Sum)
            .as_dtype(DType::F32);
        let work = self.comm.start(vec![rs])?;
        self.inflight.push_back((slot, work));
        *self.started += 1;
        Ok(())
    }

    fn wait_oldest(&mut self) -> Result<()> {
        let Some((_, work)) = self.inflight.pop_front() else {
            return Ok(());
        };
        let started = Instant::now();
        let r = work.wait();
        let s = started.elapsed().as_secs_f64();
        self.waited += s;
        self.stats.reduce_scatter_seconds += s;
        r
    }

    /// Waits for every reduce-scatter in flight.
    pub(super) fn drain(&mut self) -> Result<()> {
        while !self.inflight.is_empty() {
            self.wait_oldest()?;
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Overlap<'_, B> {
    /// Waits for the reduce-scatters in flight (oldest first; after an error only, the pass
    /// drains them otherwise), so none outlives the borrows.
    fn drop(&mut self) {
        while let Some((_, work)) = self.inflight.pop_front() {
            drop(work);
        }
    }
}

/// How a training pass ([`Decoder::forward_backward_with`],
/// [`Decoder::forward_backward_ppo_with`]) talks to the other ranks: not at all (one process,
/// or a zero2 pass before the step's last), under full sharding through its [`Holding`], or as
/// zero2's last pass of a step through its [`Overlap`] (its reduce-scatters are waited for
/// before the pass returns).
pub enum PassComm<'s, 'a, B: Backend> {
    Local,
    Held(&'s mut Holding<'a, B>),
    Overlapped(&'s mut Overlap<'a, B>),
}

impl<'a, B: Backend> PassComm<'_, 'a, B> {
    /// The full-shard hold, if any (the forward gathers through it).
    pub(super) fn hold(&mut self) -> Option<&mut Holding<'a, B>> {
        match self {
            PassComm::Held(h) => Some(&mut **h),
            _ => None,
        }
    }

    /// After the pass: zero2's reduce-scatters in flight waited for.
    pub(super) fn finish(&mut self) -> Result<()> {
        match self {
            PassComm::Overlapped(o) => o.drain(),
            _ => Ok(()),
        }
    }

    /// Before unit `u`'s backward, under full sharding: its weights gathered (a layer's; the
    /// head stays gathered from the forward, and the embedding's backward reads none) and its
    /// gradient buffers made.
    pub(super) fn before_backward(
        &mut self,
        b: &B,
        w: &mut [B::Buf],
        g: &mut [B::Buf],
        u: Unit,
    ) -> Result<()> {
        match self {
            PassComm::Held(h) => h.before_backward(b, w, g, u),
            _ => Ok(()),
        }
    }

    /// After unit `u`'s backward: under full sharding its gradients reduce-scattered and its
    /// weights freed (the embedding has none gathered); as zero2's last pass, the buckets whose
    /// gradients are now final started.
    pub(super) fn after_backward(
        &mut self,
        b: &B,
        w: &mut [B::Buf],
        g: &mut [B::Buf],
        u: Unit,
    ) -> Result<()> {
        match self {
            PassComm::Local => Ok(()),
            PassComm::Held(h) => h.after_backward(b, w, g, u),
            PassComm::Overlapped(o) => o.done(b, g, u),
        }
    }
}

/// The shards of Adam's first and second moments, one buffer per bucket each.
type Moments<B> = (Vec<<B as Device>::Buf>, Vec<<B as Device>::Buf>);

/// Zero shards of every bucket of `plan`.
fn cut_zeros<B: Backend>(b: &B, plan: &BucketPlan) -> Result<Vec<B::Buf>> {
    plan.buckets.iter().map(|k| b.alloc(k.shard)).collect()
}

/// The staging buffers of `shard = "full"`.
struct FullShard<B: Backend> {
    /// Two buffers of one unit's bucket all-gathered (compute dtype, padded): a unit is copied
    /// out of one while the next unit's all-gather (its prefetch) lands in the other. Each is
    /// boxed, so that the buffer a pending prefetch writes is a heap allocation of its own
    /// that no access to this struct reaches (see the SAFETY notes at [`Holding`]).
    gathered: [Box<B::Buf>; 2],
    /// One bucket's reduced gradient shard, before it is added to the rank's.
    reduced: B::Buf,
    /// Whether the LM head is the embedding (the head unit gathers the embedding's bucket too,
    /// and the embedding's gradient is reduced after the embedding's backward only).
    tied: bool,
}

/// A unit of the full-shard passes: what is gathered, run and freed at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unit {
    Embed,
    Layer(usize),
    /// The final norm and the LM head.
    Head,
}

/// Which way a full-shard pass goes: it says which unit is gathered after which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// The embedding, the layers in order, the head.
    Forward,
    /// The layers in reverse order (the head stays gathered from the forward, and the
    /// embedding's backward reads no weight).
    Backward,
}

/// The all-gather of a unit's first bucket, started while the unit before it computes.
struct Ahead {
    bucket: usize,
    /// The staging buffer it writes (`FullShard::gathered[slot]`).
    slot: usize,
    /// The started group, its borrows (the communicator, the source shard, the staging
    /// buffer) erased to `'static`: see the SAFETY notes at [`Holding`].
    work: Work<'static>,
}

/// A full-shard pass's hold on this rank's shards: [`Decoder::logprobs_held`],
/// and the training passes ([`PassComm::Held`]) gather each
/// unit before its forward and its backward, free it after, and reduce-scatter each unit's
/// gradients into the rank's f32 gradient shard (added up over the step's passes) as soon as
/// its backward is done. Every rank runs the same passes (an empty one runs the same
/// collectives on no rows), in the same unit order.
///
/// Prefetch: the gather of a unit starts the all-gather of the next unit of its pass
/// (forward: embedding, layers, head; backward: the layers in reverse) into the other staging
/// buffer before it waits for its own (which the gather before started; a pass's first unit
/// is gathered first, then the next one started), so the next unit's all-gather runs on the
/// communication stream while this unit computes. Nothing is started after a pass's last unit (the head of the forward, layer 0 of
/// the backward), so no collective is left pending between passes and the empty passes'
/// collectives ([`Holding::idle`]) come in the same order as a real pass's.
///
/// SAFETY of the pending prefetch ([`Ahead`], a [`Work`] whose borrows are erased so that it
/// outlives the call that started it): it borrows `comm`, the source shard (an element of
/// `st.compute` or `st.master`) and one staging buffer (`st.full.gathered[slot]`, boxed).
/// - It never leaves this struct, and is waited for before the borrows of `'a` end: by the
///   gather of the unit it fetched, or when it is dropped (a [`Work`] waits on drop), at the
///   latest in `Holding`'s `Drop` (a pass that failed midway). Until then `comm` and `*st`
///   are borrowed by this struct (`st` exclusively), and its fields are private, so nothing
///   outside can move, replace, resize or free what the group reads and writes.
/// - Inside, nothing touches them meanwhile: no method writes or resizes `st.compute`,
///   `st.master` or `st.full`'s boxes, and the staging buffer of a pending prefetch is not
///   read or written (the gathers use the other one) until the prefetch is waited for. The
///   buffers do not move: `*st` cannot while it is borrowed, and each buffer is a heap
///   allocation of its own, which a move of the box pointers would not move either.
/// - Leaked (`mem::forget` of the `Holding`), the `Work` leaks with it and is never waited
///   for, so its erased borrows are never used from the host again (the CPU communicator
///   writes its results into the buffer only in `wait`; NCCL's pending group holds no
///   borrow, only events, and on the device the group still runs before any later collective
///   on the communication stream).
pub struct Holding<'a, B: Backend> {
    comm: &'a dyn Comm<B>,
    st: &'a mut ShardedOptim<B>,
    /// Whether gathers start the next unit's ahead (off only in tests, as their reference:
    /// the collectives then come in another order, so every rank must agree).
    prefetch: bool,
    ahead: Option<Ahead>,
}

impl<'a, B: Backend> Holding<'a, B> {
    /// The hold of a full-shard pass on `st` (sharded with `shard = "full"` over `comm`).
    pub fn new(comm: &'a dyn Comm<B>, st: &'a mut ShardedOptim<B>) -> Self {
        Holding {
            comm,
            st,
            prefetch: true,
            ahead: None,
        }
    }

    /// `false`: the same passes without the prefetch, each unit's all-gather started and
    /// waited for when the unit needs it (the tests' reference; every rank must agree).
    #[cfg(test)]
    pub(crate) fn with_prefetch(mut self, prefetch: bool) -> Self {
        self.prefetch = prefetch;
        self
    }
}

impl<B: Backend> Drop for Holding<'_, B> {
    fn drop(&mut self) {
        // A pass that failed after starting a prefetch: it is waited for (dropping a `Work`
        // waits and prints a failure) before the borrows it erased end.
        drop(self.ahead.take());
    }
}

impl<B: Backend> Holding<'_, B> {
    fn units(&self) -> usize {
        self.st.plan.buckets.len() - 2
    }

    /// The buckets whose weights unit `u` reads; the first is the one a prefetch gathers (a
    /// tied head's: the embedding's, much larger than the final norm's).
    fn weight_buckets(&self, u: Unit) -> Vec<usize> {
        let last = self.units() + 1;
        match u {
            Unit::Embed => vec![0],
            Unit::Layer(l) => vec![l + 1],
            Unit::Head if self.tied() => vec![0, last],
            Unit::Head => vec![last],
        }
    }

    /// The unit gathered after `u` in a pass of `pass` (None: `u` is its last).
    fn after(&self, u: Unit, pass: Pass) -> Option<Unit> {
        let layers = self.units();
        match (pass, u) {
            (Pass::Forward, Unit::Embed) if layers > 0 => Some(Unit::Layer(0)),
            (Pass::Forward, Unit::Layer(l)) if l + 1 < layers => Some(Unit::Layer(l + 1)),
            (Pass::Forward, Unit::Embed | Unit::Layer(_)) => Some(Unit::Head),
            (Pass::Backward, Unit::Layer(l)) if l > 0 => Some(Unit::Layer(l - 1)),
            _ => None,
        }
    }

    /// The buckets whose gradients are final once unit `u`'s backward is done.
    fn grad_bucket(&self, u: Unit) -> usize {
        match u {
            Unit::Embed => 0,
            Unit::Layer(l) => l + 1,
            Unit::Head => self.units() + 1,
        }
    }

    fn tied(&self) -> bool {
        self.st.full.as_ref().is_some_and(|f| f.tied)
    }

    /// All-gathers unit `u`'s compute weights into `w` (freshly allocated buffers). Before it
    /// waits for `u`'s all-gather it starts the next one of `pass`, for the next call to wait
    /// for (see the type's docs).
    pub(super) fn gather(&mut self, b: &B, w: &mut [B::Buf], u: Unit, pass: Pass) -> Result<()> {
        let started = Instant::now();
        let cd = b.compute_dtype();
        let buckets = self.weight_buckets(u);
        let ahead = self.ahead.take();
        if let Some(a) = &ahead {
            // Every pass starts with nothing pending, and gathers its units in order.
            let k = a.bucket;
            ensure!(
                k == buckets[0],
                "full sharding: bucket {k} was prefetched but unit {u:?} is gathered"
            );
        }
        // Without a pending prefetch both staging buffers are free.
        let slot = ahead.as_ref().map_or(0, |a| a.slot);
        if ahead.is_none() {
            self.start(buckets[0], slot, cd)?.wait()?;
        }
        if let Some(next) = self.after(u, pass).filter(|_| self.prefetch) {
            let k = self.weight_buckets(next)[0];
            let work = self.start(k, 1 - slot, cd)?;
            // SAFETY: kept in `self.ahead` and waited for before the borrows end; nothing
            // touches the source shard or staging buffer `1 - slot` meanwhile (see the
            // SAFETY notes at `Holding`).
            let work = unsafe { std::mem::transmute::<Work<'_>, Work<'static>>(work) };
            self.ahead = Some(Ahead {
                bucket: k,
                slot: 1 - slot,
                work,
            });
            self.st.stats.unit_prefetches += 1;
        }
        if let Some(a) = ahead {
            a.work
                .wait()
                .with_context(|| format!("the all-gather of {u:?} (prefetched)"))?;
        }
        self.copy_out(b, w, buckets[0], slot)?;
        for &k in &buckets[1..] {
            self.start(k, slot, cd)?.wait()?;
            self.copy_out(b, w, k, slot)?;
        }
        self.st.stats.unit_gather_seconds += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Starts the all-gather of bucket `k` of the compute shards into staging buffer `slot`.
    fn start(&mut self, k: usize, slot: usize, cd: DType) -> Result<Work<'_>> {
        let st = &mut *self.st;
        let full = st.full.as_mut().expect("full sharding");
        let shard = match st.compute.is_empty() {
            true => &st.master[k],
            false => &st.compute[k],
        };
        let count = st.plan.buckets[k].shard;
        let c = Collective::all_gather(shard, 0, &mut *full.gathered[slot], 0, count).as_dtype(cd);
        self.comm.start(vec![c])
    }

    /// Copies bucket `k`'s tensors out of staging buffer `slot` (waited for) into `w`.
    fn copy_out(&mut self, b: &B, w: &mut [B::Buf], k: usize, slot: usize) -> Result<()> {
        let cd = b.compute_dtype();
        let st = &mut *self.st;
        let full = st.full.as_ref().expect("full sharding");
        let bucket = &st.plan.buckets[k];
        for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
            let n = st.plan.sizes[t];
            w[t] = b.alloc_as(n, cd)?;
            b.copy(&mut w[t], 0, &full.gathered[slot], off, n)?;
        }
        st.stats.unit_gathers += 1;
        st.stats.unit_gather_bytes += (bucket.padded(st.plan.world_size) * dtype_bytes(cd)) as u64;
        Ok(())
    }

    /// Before unit `u`'s backward: a layer's weights gathered (the head stays gathered from
    /// the forward, and the embedding's backward reads none) and its gradient buffers made.
    fn before_backward(
        &mut self,
        b: &B,
        w: &mut [B::Buf],
        g: &mut [B::Buf],
        u: Unit,
    ) -> Result<()> {
        if let Unit::Layer(_) = u {
            self.gather(b, w, u, Pass::Backward)?;
        }
        self.grads(b, g, u)
    }

    /// After unit `u`'s backward: its gradients reduce-scattered and its weights freed (the
    /// embedding has none gathered).
    fn after_backward(&mut self, b: &B, w: &mut [B::Buf], g: &mut [B::Buf], u: Unit) -> Result<()> {
        self.reduce(b, g, u)?;
        match u {
            Unit::Embed => Ok(()),
            _ => self.release(b, w, u),
        }
    }

    /// Frees unit `u`'s gathered weights.
    pub(super) fn release(&mut self, b: &B, w: &mut [B::Buf], u: Unit) -> Result<()> {
        for k in self.weight_buckets(u) {
            for t in self.st.plan.buckets[k].tensors.clone() {
                w[t] = b.alloc_as(0, b.compute_dtype())?;
            }
        }
        Ok(())
    }

    /// Zero gradient buffers for unit `u`'s backward (a tied head's, the embedding's, is
    /// already there at the embedding's backward and keeps what the head added).
    pub(super) fn grads(&mut self, b: &B, g: &mut [B::Buf], u: Unit) -> Result<()> {
        for k in self.weight_buckets(u) {
            for t in self.st.plan.buckets[k].tensors.clone() {
                if b.len(&g[t]) == 0 {
                    g[t] = b.alloc(self.st.plan.sizes[t])?;
                }
            }
        }
        Ok(())
    }

    /// Reduce-scatters unit `u`'s gradients, adds this rank's part to its gradient shard and
    /// frees the full gradients.
    pub(super) fn reduce(&mut self, b: &B, g: &mut [B::Buf], u: Unit) -> Result<()> {
        let started = Instant::now();
        let k = self.grad_bucket(u);
        let st = &mut *self.st;
        let full = st.full.as_mut().expect("full sharding");
        let bucket = &st.plan.buckets[k];
        let pack = &mut st.pack[0];
        b.fill(pack, bucket.padded(st.plan.world_size), 0.0)?;
        for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
            b.copy(pack, off, &g[t], 0, st.plan.sizes[t])?;
        }
        let rs =
            Collective::reduce_scatter(pack, 0, &mut full.reduced, 0, bucket.shard, ReduceOp::Sum)
                .as_dtype(DType::F32);
        self.comm.start(vec![rs])?.wait()?;
        b.add_assign(&mut st.grad[k], &full.reduced, bucket.shard)?;
        for t in bucket.tensors.clone() {
            g[t] = b.alloc(0)?;
        }
        st.stats.reduce_scatter_seconds += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// The collectives of a pass over no rows (a rank with fewer micro-batches than another):
    /// every unit gathered (and the next prefetched) and freed, and with `train` zero
    /// gradients reduced, in the order of a real pass.
    pub(super) fn idle(
        &mut self,
        b: &B,
        w: &mut [B::Buf],
        g: &mut [B::Buf],
        train: bool,
    ) -> Result<()> {
        let layers = self.units();
        let forward = std::iter::once(Unit::Embed).chain((0..layers).map(Unit::Layer));
        for u in forward {
            self.gather(b, w, u, Pass::Forward)?;
            self.release(b, w, u)?;
        }
        self.gather(b, w, Unit::Head, Pass::Forward)?;
        match train {
            true => self.skip_backward(b, w, g),
            false => self.release(b, w, Unit::Head),
        }
    }

    /// The backward's collectives on zero gradients, from the gathered head on (a pass whose
    /// rows score no token).
    pub(super) fn skip_backward(
        &mut self,
        b: &B,
        w: &mut [B::Buf],
        g: &mut [B::Buf],
    ) -> Result<()> {
        self.before_backward(b, w, g, Unit::Head)?;
        self.after_backward(b, w, g, Unit::Head)?;
        self.idle_backward(b, w, g)
    }

    /// The backward's collectives after the head, on zero gradients.
    fn idle_backward(&mut self, b: &B, w: &mut [B::Buf], g: &mut [B::Buf]) -> Result<()> {
        let layers = self.units();
        let backward = (0..layers).rev().map(Unit::Layer).chain([Unit::Embed]);
        for u in backward {
            self.before_backward(b, w, g, u)?;
            self.after_backward(b, w, g, u)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::model::decoder::SeqRef;
    use crate::model::init;
    use crate::parallel::testing::ranks;
    use crate::parallel::HostComm;
    use std::time::Duration;

    /// A prefetch left pending by a pass that stopped midway is waited for when its hold is
    /// dropped, and one that is not the next unit's is refused, naming both: on every rank
    /// alike, the collectives stay in step, and the next pass scores as the unsharded
    /// decoder does. The second staging buffer is counted.
    #[test]
    fn a_pending_prefetch_is_waited_for_when_its_hold_ends() {
        let out = ranks(2, Duration::from_secs(60), |pg| {
            let cfg = Config::small_qwen2();
            let w = init::random_weights(&cfg, 5, 0.05);
            let toks: Vec<u32> = (0..17).map(|i| (i * 37 % 256) as u32).collect();
            let seqs = [SeqRef {
                tokens: &toks,
                start: 4,
            }];
            let mut plain = Decoder::new(Cpu, &cfg, &w).unwrap();
            let want = plain.logprobs(&seqs, 1.0, false).unwrap();
            let comm = HostComm::new(&pg).unwrap();
            let mut dec = Decoder::new(Cpu, &cfg, &w).unwrap();
            let mut st = dec.shard_full(&comm).unwrap();
            let padded = st.plan.max_padded();
            let max_shard = st.plan.buckets.iter().map(|k| k.shard).max().unwrap();
            // The f32 pack buffer, two staging buffers of the compute dtype, the reduced shard.
            assert_eq!(
                st.stats.staging_bytes,
                (padded * 4 + 2 * padded * 4 + max_shard * 4) as u64
            );
            {
                let mut hold = Holding::new(&comm, &mut st);
                hold.gather(&Cpu, &mut dec.w, Unit::Embed, Pass::Forward)
                    .unwrap();
                assert_eq!(hold.ahead.as_ref().map(|a| a.bucket), Some(1));
                // The pass stops here: the hold's drop waits for layer 0's all-gather.
            }
            assert_eq!(st.stats.unit_prefetches, 1);
            let err = {
                let mut hold = Holding::new(&comm, &mut st);
                hold.gather(&Cpu, &mut dec.w, Unit::Embed, Pass::Forward)
                    .unwrap();
                hold.gather(&Cpu, &mut dec.w, Unit::Layer(1), Pass::Forward)
                    .unwrap_err()
            };
            let got = {
                let mut hold = Holding::new(&comm, &mut st);
                dec.logprobs_held(&seqs, 1.0, false, &mut hold).unwrap()
            };
            drop(comm);
            pg.finish().unwrap();
            (format!("{err:#}"), got, want, st.stats.unit_prefetches)
        });
        for (err, got, want, prefetches) in out {
            assert!(
                err.contains("bucket 1 was prefetched") && err.contains("Layer(1)"),
                "{err}"
            );
            // 1 + 1 + the scoring pass's 3.
            assert_eq!(prefetches, 5);
            for (a, b) in got[0].logprobs.iter().zip(&want[0].logprobs) {
                assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
            }
        }
    }
}
