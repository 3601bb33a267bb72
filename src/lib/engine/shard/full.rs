//! `shard = "full"` (FSDP / ZeRO-3): the compute weights sharded too, one bucket per unit
//! (the embedding, each layer, the final norm and untied head). The passes' hooks
//! ([`Holding`]) all-gather each unit before its forward and its backward, with the next
//! unit's all-gather prefetched while it computes, free it after, and reduce-scatter its
//! gradients as soon as its backward is done.

use anyhow::{ensure, Context, Result};
use std::time::Instant;

use super::optim::{FullShard, ShardedOptim};
use crate::backend::{Backend, DType};
use crate::model::decoder::{Decoder, OptimizerState, Pass, Unit, UnitBufs, UnitHooks};
use crate::model::{Config, Weights};
use crate::parallel::bucket::BucketPlan;
use crate::parallel::comm::dtype_bytes;
use crate::parallel::{Collective, Comm, ReduceOp, Work};

impl<B: Backend> ShardedOptim<B> {
    /// `shard = "full"`: as [`ShardedOptim::zero2`] with one bucket per unit, and the compute
    /// weights sharded too: the decoder frees its full weights and gradients; the passes'
    /// hooks ([`Holding`]) gather each unit before its forward and its backward and
    /// reduce-scatter its gradients as soon as its backward is done.
    /// [`ShardedOptim::unshard`] undoes it.
    pub fn full(dec: &mut Decoder<B>, comm: &dyn Comm<B>) -> Result<Self> {
        ensure!(
            dec.lora_spec().is_none(),
            "full sharding cuts every weight; a LoRA decoder's frozen base is not sharded (zero2)"
        );
        let plan = unit_plan(dec, comm.world_size())?;
        let st = Self::cut(dec, comm, plan, true)?;
        st.hold_units(dec)
    }

    /// A decoder under `shard = "full"` built from host weights (and a loaded optimizer
    /// state) without ever holding them whole on the device: this rank's shards are cut on
    /// the host and uploaded; as [`Decoder::new`] then [`ShardedOptim::full`] otherwise.
    pub(crate) fn new_full(
        backend: B,
        cfg: &Config,
        weights: &Weights,
        state: Option<&OptimizerState>,
        comm: &dyn Comm<B>,
    ) -> Result<(Decoder<B>, Self)> {
        let mut dec = Decoder::unloaded(backend, cfg, weights)?;
        let plan = unit_plan(&dec, comm.world_size())?;
        let rank = comm.rank();
        let moments = match state {
            Some(st) => dec.state_moments(st)?,
            None => None,
        };
        let b = dec.backend();
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
        // Every name was checked by `unloaded`.
        let names = dec.param_names();
        let w: Vec<&[f32]> = names.iter().map(|n| &weights[n].data[..]).collect();
        let master = cut(&w)?;
        let mv = match &moments {
            Some(mv) => {
                let m: Vec<&[f32]> = mv.iter().map(|p| &p.0.data[..]).collect();
                let v: Vec<&[f32]> = mv.iter().map(|p| &p.1.data[..]).collect();
                Some((cut(&m)?, cut(&v)?))
            }
            None => None,
        };
        dec.set_optimizer_steps(state.map_or(0, |s| s.step));
        let st = Self::assemble(&dec, rank, plan, master, mv, true)?;
        let st = st.hold_units(&mut dec)?;
        Ok((dec, st))
    }

    /// The staging of full sharding; the decoder holds its weights and gradients unit by unit
    /// from now on.
    fn hold_units(mut self, dec: &mut Decoder<B>) -> Result<Self> {
        let b = dec.backend();
        let cd = b.compute_dtype();
        let padded = self.plan.max_padded();
        let max_shard = self.plan.buckets.iter().map(|k| k.shard).max().unwrap_or(0);
        self.full = Some(FullShard {
            gathered: [
                Box::new(b.alloc_as(padded, cd)?),
                Box::new(b.alloc_as(padded, cd)?),
            ],
            reduced: b.alloc(max_shard)?,
            tied: dec.config().tie_word_embeddings,
        });
        self.stats.staging_bytes =
            (padded * 4 + 2 * padded * dtype_bytes(cd) + max_shard * 4) as u64;
        dec.hold_per_unit()?;
        Ok(self)
    }
}

/// One bucket per unit: the embedding, each layer, the final norm (and untied head).
fn unit_plan<B: Backend>(dec: &Decoder<B>, world: usize) -> Result<BucketPlan> {
    let units = dec.param_units();
    let breaks: Vec<usize> = (1..units.len())
        .filter(|&t| units[t] != units[t - 1])
        .collect();
    let plan = BucketPlan::with_breaks(&dec.param_sizes(), usize::MAX, world, &breaks)?;
    ensure!(
        plan.buckets.len() == dec.config().num_layers + 2,
        "full sharding: the parameters are not laid out unit by unit"
    );
    Ok(plan)
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

/// A full-shard pass's hold on this rank's shards, the hooks of its passes
/// ([`Decoder::logprobs_with`], [`Decoder::forward_backward_with`]...): they gather each
/// unit before its forward and its backward, free it after, and reduce-scatter each unit's
/// gradients into the rank's f32 gradient shard (added up over the step's passes) as soon as
/// its backward is done. Every rank runs the same passes (an empty one calls the same hooks
/// on no rows), in the same unit order.
///
/// Prefetch: the gather of a unit starts the all-gather of the next unit of its pass
/// (forward: embedding, layers, head; backward: the layers in reverse) into the other staging
/// buffer before it waits for its own (which the gather before started; a pass's first unit
/// is gathered first, then the next one started), so the next unit's all-gather runs on the
/// communication stream while this unit computes. Nothing is started after a pass's last unit (the head of the forward, layer 0 of
/// the backward), so no collective is left pending between passes and the empty passes'
/// collectives come in the same order as a real pass's.
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
    fn next_unit(&self, u: Unit, pass: Pass) -> Option<Unit> {
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
    fn gather(&mut self, b: &B, w: &mut [B::Buf], u: Unit, pass: Pass) -> Result<()> {
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
        if let Some(next) = self.next_unit(u, pass).filter(|_| self.prefetch) {
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

    /// Frees unit `u`'s gathered weights.
    fn release(&mut self, b: &B, w: &mut [B::Buf], u: Unit) -> Result<()> {
        for k in self.weight_buckets(u) {
            for t in self.st.plan.buckets[k].tensors.clone() {
                w[t] = b.alloc_as(0, b.compute_dtype())?;
            }
        }
        Ok(())
    }

    /// Zero gradient buffers for unit `u`'s backward (a tied head's, the embedding's, is
    /// already there at the embedding's backward and keeps what the head added).
    fn grads(&mut self, b: &B, g: &mut [B::Buf], u: Unit) -> Result<()> {
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
    fn reduce(&mut self, b: &B, g: &mut [B::Buf], u: Unit) -> Result<()> {
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
}

/// Before a unit's forward its weights are gathered, and freed after; before its backward a
/// layer's are gathered again (the head stays gathered from the forward, and the embedding's
/// backward reads none) and its gradient buffers made; once its gradients are added they are
/// reduce-scattered and freed, and after, its weights.
impl<B: Backend> UnitHooks<B> for Holding<'_, B> {
    fn before(&mut self, u: Unit, pass: Pass, p: UnitBufs<B>) -> Result<()> {
        if pass == Pass::Forward || matches!(u, Unit::Layer(_)) {
            self.gather(p.backend, p.weights, u, pass)?;
        }
        match pass {
            Pass::Forward => Ok(()),
            Pass::Backward => self.grads(p.backend, p.grads, u),
        }
    }

    fn grads_ready(&mut self, u: Unit, p: UnitBufs<B>) -> Result<()> {
        self.reduce(p.backend, p.grads, u)
    }

    fn after(&mut self, u: Unit, pass: Pass, p: UnitBufs<B>) -> Result<()> {
        match (pass, u) {
            (Pass::Backward, Unit::Embed) => Ok(()),
            _ => self.release(p.backend, p.weights, u),
        }
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
            let mut st = ShardedOptim::full(&mut dec, &comm).unwrap();
            let padded = st.plan.max_padded();
            let max_shard = st.plan.buckets.iter().map(|k| k.shard).max().unwrap();
            // The f32 pack buffer, two staging buffers of the compute dtype, the reduced shard.
            assert_eq!(
                st.stats.staging_bytes,
                (padded * 4 + 2 * padded * 4 + max_shard * 4) as u64
            );
            {
                let mut hold = Holding::new(&comm, &mut st);
                hold.gather(&Cpu, dec.weights_mut().1, Unit::Embed, Pass::Forward)
                    .unwrap();
                assert_eq!(hold.ahead.as_ref().map(|a| a.bucket), Some(1));
                // The pass stops here: the hold's drop waits for layer 0's all-gather.
            }
            assert_eq!(st.stats.unit_prefetches, 1);
            let err = {
                let mut hold = Holding::new(&comm, &mut st);
                hold.gather(&Cpu, dec.weights_mut().1, Unit::Embed, Pass::Forward)
                    .unwrap();
                hold.gather(&Cpu, dec.weights_mut().1, Unit::Layer(1), Pass::Forward)
                    .unwrap_err()
            };
            let got = {
                let mut hold = Holding::new(&comm, &mut st);
                dec.logprobs_with(&seqs, 1.0, false, &mut hold).unwrap()
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
