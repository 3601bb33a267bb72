//! The data-parallel optimizer's state (ZeRO-2-like): every rank keeps the compute weights in
//! full, and 1/N of the f32 master weights, Adam moments and reduced gradients, over the flat
//! bucket layout of [`BucketPlan`]. The backward passes of a step add the gradients up in full;
//! the backward of the rank's last pass of the step ([`ShardedOptim::arm_overlap`])
//! reduce-scatters each bucket as soon as all its gradients are final, while the rest of the
//! backward runs (`overlap`, DeepSpeed ZeRO-2's `overlap_comm` under gradient accumulation;
//! earlier passes do not communicate). The step (`step`) then reduces any bucket not started
//! yet, clips by the global norm (the shards' sums of squares, all-reduced), updates this
//! rank's shard with AdamW and all-gathers the compute weights back into every rank's decoder
//! ([`WeightSync`], the weight sync).
//!
//! Every rank starts the same reduce-scatters in the same order ([`ShardedOptim`]'s `order`,
//! fixed by the model), whatever its passes: a rank with fewer passes starts them in its own
//! last backward (no other collective runs between the passes under zero2), a rank with no
//! rows (or whose last pass scored nothing) at `ShardedOptim::reduce_grads`, which every rank
//! calls after its passes, before any other collective of the step.
//!
//! AdamW is elementwise, so a rank's shard gets exactly the update the unsharded optimizer
//! gives those elements from the same summed gradients.
//!
//! `shard = "full"` (FSDP / ZeRO-3, `full`) shards the compute weights too, one bucket per
//! unit: the passes' hooks (`Holding`) all-gather each unit before its forward and its
//! backward, with the next unit's all-gather prefetched while it computes (into a second
//! staging buffer), free it after, and reduce-scatter its gradients as soon as its backward
//! is done; the step then has no weight sync.
//!
//! This file: the state, cut from a decoder; the other files add the overlap, full sharding,
//! the step and the host shards.

use anyhow::{ensure, Result};

use crate::backend::{Backend, DType};
use crate::engine::train::ShardStats;
use crate::model::decoder::{Decoder, Moments, Unit};
use crate::parallel::bucket::{BucketPlan, WeightSync};
use crate::parallel::comm::dtype_bytes;
use crate::parallel::Comm;

/// This rank's optimizer shards (one buffer per bucket) and the staging buffers.
pub struct ShardedOptim<B: Backend> {
    pub(super) rank: usize,
    pub(super) plan: BucketPlan,
    /// f32 master weights, reduced gradients and Adam moments of this rank's shard.
    pub(super) master: Vec<B::Buf>,
    pub(super) grad: Vec<B::Buf>,
    pub(super) m: Vec<B::Buf>,
    pub(super) v: Vec<B::Buf>,
    /// The shard in the compute dtype (what the weight sync gathers); empty when that is f32
    /// (then it gathers the masters).
    pub(super) compute: Vec<B::Buf>,
    /// `shard = "full"`: the compute weights are sharded too (one bucket per unit, see
    /// [`super::Holding`]); the decoder holds a unit's weights and gradients only while it runs.
    pub(super) full: Option<FullShard<B>>,
    /// Two f32 buffers of the largest padded bucket: one is packed while the other is reduced.
    pub(super) pack: [B::Buf; 2],
    /// zero2: the order every rank starts the buckets' reduce-scatters in (as their gradients
    /// become final in the backward: the head's first, the embedding's last), the backward
    /// step ([`backward_step`]) after which each bucket's gradients are final, how many of
    /// `order` this step has started, and whether the next pass is the step's last here.
    pub(super) order: Vec<usize>,
    pub(super) ready: Vec<usize>,
    pub(super) started: usize,
    pub(super) armed: bool,
    /// The decoder's layers (for [`backward_step`]).
    pub(super) layers: usize,
    /// The weight sync (zero2); None under `shard = "full"` (the units are gathered instead).
    pub(super) sync: Option<WeightSync<B>>,
    /// Whether the moments hold a state (loaded, or a step was taken).
    pub(super) moments: bool,
    pub stats: ShardStats,
}

impl<B: Backend> ShardedOptim<B> {
    /// Shards `dec`'s optimizer over `comm`'s ranks in buckets of about `bucket_elems`
    /// elements (zero2): this rank keeps its part of the masters and moments (loaded ones
    /// included) and the decoder frees its full copies. `ShardedOptim::unshard` undoes it.
    /// A frozen parameter (a LoRA decoder's base) takes no element of the buckets: the plan
    /// gives it size 0, so that only the adapters are reduced, updated and synced, and the
    /// base stays whole and untouched on every rank.
    pub fn zero2(dec: &mut Decoder<B>, comm: &dyn Comm<B>, bucket_elems: usize) -> Result<Self> {
        let plan = BucketPlan::new(&dec.trained_sizes(), bucket_elems, comm.world_size())?;
        Self::cut(dec, comm, plan, false)
    }

    /// This rank's shards of `dec`'s masters and moments over `plan`, the decoder's full
    /// copies freed (under `full`, the compute shards start from the masters).
    pub(super) fn cut(
        dec: &mut Decoder<B>,
        comm: &dyn Comm<B>,
        plan: BucketPlan,
        full: bool,
    ) -> Result<Self> {
        let rank = comm.rank();
        let master = cut_shards(dec.backend(), &plan, rank, dec.masters())?;
        // Each full copy is freed as soon as its shard is cut, so the peak is the full state
        // plus one kind of shard, not plus all of them.
        dec.release_masters();
        let mv = match dec.take_moments() {
            Some((full_m, full_v)) => {
                let m = cut_shards(dec.backend(), &plan, rank, &full_m)?;
                drop(full_m);
                let v = cut_shards(dec.backend(), &plan, rank, &full_v)?;
                drop(full_v);
                Some((m, v))
            }
            None => None,
        };
        Self::assemble(dec, rank, plan, master, mv, full)
    }

    /// This rank's optimizer from its master shards and its moments' (None: zeros); under
    /// `full`, the compute shards start from the masters.
    pub(super) fn assemble(
        dec: &Decoder<B>,
        rank: usize,
        plan: BucketPlan,
        master: Vec<B::Buf>,
        mv: Option<Moments<B>>,
        full: bool,
    ) -> Result<ShardedOptim<B>> {
        let b = dec.backend();
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
        let ready = grads_final_at(dec, &plan);
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
            layers: dec.config().num_layers,
            sync,
            moments,
            stats,
        })
    }

    /// Whether the compute weights are sharded too (`shard = "full"`).
    pub(crate) fn is_full(&self) -> bool {
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
    pub(crate) fn begin_step(&mut self) {
        (self.started, self.armed) = (0, false);
    }

    /// zero2: the next pass is this rank's last of the step: its backward starts the
    /// reduce-scatters ([`ShardedOptim::take_pass`]). No-op under full sharding.
    pub(crate) fn arm_overlap(&mut self) {
        self.armed = !self.is_full();
    }

    /// zero2, before a pass: whether it is the step's last here (see
    /// [`ShardedOptim::arm_overlap`]; then it runs with [`ShardedOptim::overlap`]). Fails when
    /// the step's gradients were reduced already (a pass after [`ShardedOptim::reduce_grads`]).
    pub(crate) fn take_pass(&mut self) -> Result<bool> {
        ensure!(
            self.started == 0,
            "a training pass after this step's gradients were reduced (start a step with begin_step)"
        );
        Ok(std::mem::take(&mut self.armed))
    }
}

/// For each bucket of `plan`, the backward step ([`backward_step`]) after which all its
/// gradients are final: the final norm's and an untied head's after the head's, a layer's
/// after its own, the embedding's (a tied head's) after the embedding's.
fn grads_final_at<B: Backend>(dec: &Decoder<B>, plan: &BucketPlan) -> Vec<usize> {
    let layers = dec.config().num_layers;
    let at: Vec<usize> = dec
        .param_units()
        .into_iter()
        .map(|u| backward_step(u, layers))
        .collect();
    plan.buckets
        .iter()
        .map(|k| {
            // A frozen tensor (size 0 in the plan) has no gradient to wait for.
            let trained = k.tensors.clone().filter(|&t| plan.sizes[t] > 0);
            trained.map(|t| at[t]).max().unwrap_or(0)
        })
        .collect()
}

/// This rank's shard of each bucket of `plan`, copied out of the whole tensors `full`.
fn cut_shards<B: Backend>(
    b: &B,
    plan: &BucketPlan,
    rank: usize,
    full: &[B::Buf],
) -> Result<Vec<B::Buf>> {
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
}

/// The step of the backward after which unit `u`'s gradients are final (of a decoder of
/// `layers` layers): the head (final norm and LM head) 0, then the layers from the top, then
/// the embedding.
pub(super) fn backward_step(u: Unit, layers: usize) -> usize {
    match u {
        Unit::Head => 0,
        Unit::Layer(l) => layers - l,
        Unit::Embed => layers + 1,
    }
}

/// Zero shards of every bucket of `plan`.
pub(super) fn cut_zeros<B: Backend>(b: &B, plan: &BucketPlan) -> Result<Vec<B::Buf>> {
    plan.buckets.iter().map(|k| b.alloc(k.shard)).collect()
}

/// The staging buffers of `shard = "full"`.
pub(super) struct FullShard<B: Backend> {
    /// Two buffers of one unit's bucket all-gathered (compute dtype, padded): a unit is copied
    /// out of one while the next unit's all-gather (its prefetch) lands in the other. Each is
    /// boxed, so that the buffer a pending prefetch writes is a heap allocation of its own
    /// that no access to this struct reaches (see the SAFETY notes at [`super::Holding`]).
    pub(super) gathered: [Box<B::Buf>; 2],
    /// One bucket's reduced gradient shard, before it is added to the rank's.
    pub(super) reduced: B::Buf,
    /// Whether the LM head is the embedding (the head unit gathers the embedding's bucket too,
    /// and the embedding's gradient is reduced after the embedding's backward only).
    pub(super) tied: bool,
}
