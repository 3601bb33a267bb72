//! zero2's reduce-scatter of a step's gradients overlapped with the backward of the rank's last
//! pass ([`Overlap`], the hooks of that pass), and the reduce-scatter of what the passes did not
//! start ([`ShardedOptim::reduce_grads`]).

use anyhow::{ensure, Result};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::Instant;

use super::optim::{backward_step, ShardedOptim};
use crate::backend::{Backend, DType};
use crate::engine::train::ShardStats;
use crate::model::decoder::{Decoder, Unit, UnitBufs, UnitHooks};
use crate::parallel::bucket::BucketPlan;
use crate::parallel::{Collective, Comm, ReduceOp, Work};

impl<B: Backend> ShardedOptim<B> {
    /// optimizer was sharded over), for the hooks of a pass ([`Overlap`]). Dropping it waits
    /// for those in flight.
    pub(crate) fn overlap<'a>(&'a mut self, comm: &'a dyn Comm<B>) -> Overlap<'a, B> {
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

    /// zero2: starts the reduce-scatters of the step's gradients that its backward did not
    /// start, in the ranks' common order, and waits for them: then `grad[k]` = this rank's
    /// shard of bucket k of the gradients summed over the ranks. Every rank calls it once its
    /// step's passes are done, before any other collective of the step (a rank with no rows
    /// reduces zeros); [`ShardedOptim::step`] calls it too (then a no-op).
    pub(crate) fn reduce_grads(&mut self, dec: &mut Decoder<B>, comm: &dyn Comm<B>) -> Result<()> {
        ensure!(
            !self.is_full(),
            "reduce_grads: full sharding reduces unit by unit"
        );
        if self.started == self.order.len() {
            return Ok(());
        }
        let started = Instant::now();
        dec.ensure_grads()?;
        let mut ov = self.overlap(comm);
        let done = ov.start_ready(dec.backend(), dec.grads(), usize::MAX);
        let done = done.and_then(|()| ov.finish());
        let seconds = started.elapsed().as_secs_f64();
        // Its waits were counted already.
        ov.stats.reduce_scatter_seconds += seconds - std::mem::take(&mut ov.waited);
        done
    }
}

/// zero2's reduce-scatter of a step's gradients overlapped with the backward of the rank's
/// last pass (from [`ShardedOptim::overlap`]): after each unit's backward, every bucket whose
/// gradients are all final (and all before it in the ranks' common order) is packed into a
/// free one of the two pack buffers and its reduce-scatter started on the communication
/// stream; it runs while the backward goes on. At most two are in flight (the staging memory
/// stays the two pack buffers): the third waits for the first. Everything started is waited
/// for right after the pass returns ([`Overlap::finish`]; dropping the `Overlap` waits too): on
/// a GPU that wait only
/// orders the compute stream after the collectives, which whatever follows the backward (the
/// step) needs anyway, and no collective outlives the borrows of the communicator and buffers.
pub(crate) struct Overlap<'a, B: Backend> {
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
    fn done(&mut self, b: &B, g: &[B::Buf], u: Unit) -> Result<()> {
        let before = *self.started;
        let step = backward_step(u, *self.layers);
        let r = self.start_ready(b, g, step);
        self.stats.overlapped_buckets += (*self.started - before) as u64;
        r
    }

    /// Starts, in the common order, the buckets not started yet whose gradients are final
    /// after backward step `step` (`usize::MAX`: all of them).
    fn start_ready(&mut self, b: &B, g: &[B::Buf], step: usize) -> Result<()> {
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
        // again (`wait_oldest`, `finish`), or when `self` drops, within 'a. So the lifetime 'a
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

    /// Waits for every reduce-scatter in flight: the end of the pass (its caller's).
    pub fn finish(&mut self) -> Result<()> {
        while !self.inflight.is_empty() {
            self.wait_oldest()?;
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Overlap<'_, B> {
    /// Waits for the reduce-scatters in flight (oldest first; after an error only, the pass's
    /// caller finishes them otherwise), so none outlives the borrows.
    fn drop(&mut self) {
        while let Some((_, work)) = self.inflight.pop_front() {
            drop(work);
        }
    }
}

/// The hooks of zero2's last pass of a step: after each unit's backward, the buckets whose
/// gradients are now final are started.
impl<B: Backend> UnitHooks<B> for Overlap<'_, B> {
    fn grads_ready(&mut self, u: Unit, p: UnitBufs<B>) -> Result<()> {
        self.done(p.backend, p.grads, u)
    }
}
