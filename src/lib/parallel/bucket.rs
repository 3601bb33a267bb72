//! Flattened buckets: a model's tensors, in order, packed into flat buckets of about a given
//! size, each split evenly over the ranks (the layout of verl's and slime's weight sync and of
//! ZeRO/FSDP flat parameters). Rank r owns elements `r·shard .. (r+1)·shard` of every bucket;
//! a bucket is padded at its end so that the shards are equal and `SHARD_ALIGN`-aligned.
//!
//! [`WeightSync`] is the weight sync of a sharded trainer: every rank holds its shard of each
//! bucket and ends with every tensor in full. It all-gathers bucket b into one of two staging
//! buffers while it copies bucket b − 1 out of the other into the tensors, so the extra memory
//! is two buckets.
//!
//! [`broadcast_buckets`] is the weight transfer between two groups (trainer to rollout ranks,
//! `[placement]`): the root packs each bucket of its tensors into a staging buffer and
//! broadcasts it; the others unpack it into theirs, bucket b − 1 while bucket b travels.

use super::comm::{Collective, Comm};
use crate::backend::{Backend, DType};
use anyhow::{bail, Result};
use std::ops::Range;

/// Elements a shard is a multiple of (256 bytes of bf16: aligned rows for the GPU kernels).
pub(crate) const SHARD_ALIGN: usize = 128;

/// One bucket: consecutive tensors laid end to end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// Indices of its tensors in the model's order.
    pub(crate) tensors: Range<usize>,
    /// Offset of each of those tensors in the bucket.
    pub(crate) offsets: Vec<usize>,
    /// Elements of the tensors.
    pub(crate) len: usize,
    /// Elements of each rank's shard (`shard · world_size ≥ len`).
    pub(crate) shard: usize,
}

impl Bucket {
    pub fn padded(&self, world_size: usize) -> usize {
        self.shard * world_size
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    pub world_size: usize,
    /// Elements of each tensor.
    pub sizes: Vec<usize>,
    pub(crate) buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// Packs tensors of `sizes` in order: a bucket is closed before a tensor that would take
    /// it past `bucket_elems` (a larger tensor gets a bucket of its own).
    pub fn new(sizes: &[usize], bucket_elems: usize, world_size: usize) -> Result<BucketPlan> {
        Self::with_breaks(sizes, bucket_elems, world_size, &[])
    }

    /// [`BucketPlan::new`] where a bucket also starts at each tensor index in `breaks` (the
    /// first tensor of each layer, say: then no bucket holds parts of two layers).
    pub fn with_breaks(
        sizes: &[usize],
        bucket_elems: usize,
        world_size: usize,
        breaks: &[usize],
    ) -> Result<BucketPlan> {
        if world_size == 0 || bucket_elems == 0 {
            bail!("a bucket plan needs a world size and a bucket size above 0");
        }
        let mut buckets = Vec::new();
        let mut start = 0;
        let mut offsets = Vec::new();
        let mut len = 0usize;
        let close = |start: usize, end: usize, offsets: Vec<usize>, len: usize| {
            let per = len.div_ceil(world_size).max(1);
            Bucket {
                tensors: start..end,
                offsets,
                len,
                shard: per.div_ceil(SHARD_ALIGN) * SHARD_ALIGN,
            }
        };
        for (i, &s) in sizes.iter().enumerate() {
            if !offsets.is_empty() && (len + s > bucket_elems || breaks.contains(&i)) {
                buckets.push(close(start, i, std::mem::take(&mut offsets), len));
                start = i;
                len = 0;
            }
            offsets.push(len);
            len += s;
        }
        if !offsets.is_empty() {
            buckets.push(close(start, sizes.len(), offsets, len));
        }
        Ok(BucketPlan {
            world_size,
            sizes: sizes.to_vec(),
            buckets,
        })
    }

    /// Elements of every tensor together.
    pub fn total(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// The largest padded bucket (what a staging buffer holds).
    pub(crate) fn max_padded(&self) -> usize {
        self.buckets
            .iter()
            .map(|b| b.padded(self.world_size))
            .max()
            .unwrap_or(0)
    }

    /// Elements of all of one rank's shards.
    pub(crate) fn shard_total(&self) -> usize {
        self.buckets.iter().map(|b| b.shard).sum()
    }

    /// The bucket that holds tensor `t`.
    #[cfg(test)]
    pub(crate) fn bucket_of(&self, t: usize) -> usize {
        self.buckets.partition_point(|b| b.tensors.end <= t)
    }

    /// The part of rank `rank`'s shard of bucket `b` that tensor `t` covers:
    /// (offset in the tensor, offset in the shard, elements); None when the shard holds none
    /// of it.
    pub(crate) fn shard_part(
        &self,
        b: usize,
        t: usize,
        rank: usize,
    ) -> Option<(usize, usize, usize)> {
        let bucket = &self.buckets[b];
        let k = t.checked_sub(bucket.tensors.start)?;
        let start = *bucket.offsets.get(k)?;
        let (lo, hi) = (rank * bucket.shard, (rank + 1) * bucket.shard);
        let (a, z) = (start.max(lo), (start + self.sizes[t]).min(hi));
        (a < z).then(|| (a - start, a - lo, z - a))
    }
}

/// The bucketed all-gather of every tensor from the ranks' shards (see the module docs).
pub struct WeightSync<B: Backend> {
    plan: BucketPlan,
    staging: [B::Buf; 2],
    dtype: DType,
}

impl<B: Backend> WeightSync<B> {
    /// Two staging buffers of the largest bucket, of `dtype`.
    pub fn new(backend: &B, plan: BucketPlan, dtype: DType) -> Result<WeightSync<B>> {
        let n = plan.max_padded();
        let staging = [backend.alloc_as(n, dtype)?, backend.alloc_as(n, dtype)?];
        Ok(WeightSync {
            plan,
            staging,
            dtype,
        })
    }

    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Elements of the two staging buffers (the sync's extra memory).
    pub(crate) fn staging_elems(&self) -> usize {
        2 * self.plan.max_padded()
    }

    /// `dests[t]` = tensor t in full, gathered from `shards[b]` (this rank's shard of bucket b)
    /// of every rank.
    pub fn run(
        &mut self,
        backend: &B,
        comm: &dyn Comm<B>,
        shards: &[B::Buf],
        dests: &mut [B::Buf],
    ) -> Result<()> {
        let plan = &self.plan;
        if shards.len() != plan.buckets.len() || dests.len() != plan.sizes.len() {
            bail!(
                "weight sync: {} shards and {} tensors for a plan of {} buckets and {} tensors",
                shards.len(),
                dests.len(),
                plan.buckets.len(),
                plan.sizes.len()
            );
        }
        let copy_out = |b: usize, staging: &B::Buf, dests: &mut [B::Buf]| -> Result<()> {
            let bucket = &plan.buckets[b];
            for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
                backend.copy(&mut dests[t], 0, staging, off, plan.sizes[t])?;
            }
            Ok(())
        };
        let [even, odd] = &mut self.staging;
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let (cur, prev): (&mut B::Buf, &B::Buf) = if b % 2 == 0 {
                (&mut *even, &*odd)
            } else {
                (&mut *odd, &*even)
            };
            let c =
                Collective::all_gather(&shards[b], 0, cur, 0, bucket.shard).as_dtype(self.dtype);
            let work = comm.start(vec![c])?;
            if b > 0 {
                copy_out(b - 1, prev, dests)?;
            }
            work.wait()?;
        }
        if let Some(last) = plan.buckets.len().checked_sub(1) {
            let staging = if last % 2 == 0 { &*even } else { &*odd };
            copy_out(last, staging, dests)?;
        }
        Ok(())
    }
}

/// What one bucketed broadcast moved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Moved {
    pub buckets: usize,
    pub elements: usize,
    /// Bytes on the wire: elements times the size of the transfer's dtype.
    pub bytes: usize,
}

/// Every tensor of `tensors` (sizes as in `plan`, which must be a plan of world size 1: whole
/// buckets, no shards) sent from rank `root` to every rank of `comm`, bucket by bucket through
/// two staging buffers of `dtype`: the root packs bucket b + 1 while bucket b travels, the
/// others unpack bucket b − 1 meanwhile. The root's tensors are read, the others' written.
pub fn broadcast_buckets<B: Backend>(
    backend: &B,
    comm: &dyn Comm<B>,
    plan: &BucketPlan,
    dtype: DType,
    tensors: &mut [B::Buf],
    root: usize,
) -> Result<Moved> {
    if plan.world_size != 1 || tensors.len() != plan.sizes.len() {
        bail!(
            "bucketed broadcast: {} tensors for a plan of {} tensors over {} ranks (needs 1)",
            tensors.len(),
            plan.sizes.len(),
            plan.world_size
        );
    }
    let sender = comm.rank() == root;
    let n = plan.max_padded();
    let mut staging = [backend.alloc_as(n, dtype)?, backend.alloc_as(n, dtype)?];
    // Packs (root) or unpacks (the others) bucket `b` between `buf` and the tensors.
    let shuttle = |b: usize, buf: &mut B::Buf, tensors: &mut [B::Buf]| -> Result<()> {
        let bucket = &plan.buckets[b];
        for (t, &off) in bucket.tensors.clone().zip(&bucket.offsets) {
            match sender {
                true => backend.copy(buf, off, &tensors[t], 0, plan.sizes[t])?,
                false => backend.copy(&mut tensors[t], 0, buf, off, plan.sizes[t])?,
            }
        }
        Ok(())
    };
    let last = plan.buckets.len().checked_sub(1);
    if sender && last.is_some() {
        shuttle(0, &mut staging[0], tensors)?;
    }
    for (b, bucket) in plan.buckets.iter().enumerate() {
        let [even, odd] = &mut staging;
        let (cur, other) = match b % 2 {
            0 => (even, odd),
            _ => (odd, even),
        };
        let c = Collective::broadcast(cur, 0, bucket.len, root).as_dtype(dtype);
        let work = comm.start(vec![c])?;
        match sender {
            true if b + 1 < plan.buckets.len() => shuttle(b + 1, other, tensors)?,
            false if b > 0 => shuttle(b - 1, other, tensors)?,
            _ => {}
        }
        work.wait()?;
    }
    if let (false, Some(last)) = (sender, last) {
        shuttle(last, &mut staging[last % 2], tensors)?;
    }
    let elements = plan.total();
    Ok(Moved {
        buckets: plan.buckets.len(),
        elements,
        bytes: elements * super::comm::dtype_bytes(dtype),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_pack_in_order_and_shards_are_even_and_aligned() {
        let plan = BucketPlan::new(&[100, 300, 50, 1000, 10], 400, 3).unwrap();
        let tensors: Vec<Range<usize>> = plan.buckets.iter().map(|b| b.tensors.clone()).collect();
        // 100+300 fits 400; 50 opens a new bucket; 1000 is larger than a bucket: its own.
        assert_eq!(tensors, vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(plan.buckets[0].offsets, vec![0, 100]);
        assert_eq!(plan.buckets[0].len, 400);
        for b in &plan.buckets {
            assert!(b.shard * 3 >= b.len);
            assert_eq!(b.shard % SHARD_ALIGN, 0);
            assert!(b.shard - b.len.div_ceil(3) < SHARD_ALIGN);
        }
        assert_eq!(plan.total(), 1460);
        assert_eq!(plan.max_padded(), 3 * 384);
        assert!(BucketPlan::new(&[1], 0, 1).is_err());
        assert_eq!(plan.bucket_of(0), 0);
        assert_eq!(plan.bucket_of(1), 0);
        assert_eq!(plan.bucket_of(3), 2);
        assert_eq!(plan.bucket_of(4), 3);
        // Bucket 0 (400 elements) over 3 ranks of 256: tensor 1 (100..400) is elements
        // 100..256 of rank 0's shard and 0..144 of rank 1's.
        assert_eq!(plan.buckets[0].shard, 256);
        assert_eq!(plan.shard_part(0, 1, 0), Some((0, 100, 156)));
        assert_eq!(plan.shard_part(0, 1, 1), Some((156, 0, 144)));
        assert_eq!(plan.shard_part(0, 1, 2), None);
        assert_eq!(plan.shard_part(0, 0, 1), None);
        assert_eq!(
            plan.shard_part(1, 0, 0),
            None,
            "tensor 0 is not in bucket 1"
        );
        // A break starts a bucket even where the tensor would fit.
        let split = BucketPlan::with_breaks(&[100, 100, 100], 1000, 2, &[2]).unwrap();
        let t: Vec<Range<usize>> = split.buckets.iter().map(|b| b.tensors.clone()).collect();
        assert_eq!(t, vec![0..2, 2..3]);
        assert!(BucketPlan::new(&[], 10, 2).unwrap().buckets.is_empty());
    }

    #[test]
    fn a_bucketed_broadcast_gives_every_rank_the_roots_tensors() {
        use crate::backend::cpu::Cpu;
        use crate::parallel::testing::ranks;
        use crate::parallel::HostComm;
        let sizes = [5usize, 300, 7, 1000, 2];
        // Buckets [5, 300, 7], [1000] (its own), [2]: both staging buffers take turns.
        let plan = BucketPlan::new(&sizes, 400, 1).unwrap();
        assert_eq!(plan.buckets.len(), 3);
        let out = ranks(3, std::time::Duration::from_secs(20), move |pg| {
            let comm = HostComm::new(&pg).unwrap();
            let root = 1;
            let mut tensors: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(t, &n)| match pg.rank() == root {
                    true => (0..n).map(|i| (t * 10_000 + i) as f32 + 0.25).collect(),
                    false => vec![-1.0; n],
                })
                .collect();
            let moved =
                broadcast_buckets(&Cpu, &comm, &plan, DType::F32, &mut tensors, root).unwrap();
            drop(comm);
            pg.finish().unwrap();
            (tensors, moved)
        });
        let want: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(t, &n)| (0..n).map(|i| (t * 10_000 + i) as f32 + 0.25).collect())
            .collect();
        for (rank, (tensors, moved)) in out.iter().enumerate() {
            assert_eq!(tensors, &want, "rank {rank}");
            assert_eq!(
                *moved,
                Moved {
                    buckets: 3,
                    elements: 1314,
                    bytes: 1314 * 4
                }
            );
        }
        let bad = BucketPlan::new(&sizes, 400, 2).unwrap();
        let err = ranks(1, std::time::Duration::from_secs(5), move |pg| {
            let comm = HostComm::new(&pg).unwrap();
            let mut t: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
            broadcast_buckets(&Cpu, &comm, &bad, DType::F32, &mut t, 0)
                .unwrap_err()
                .to_string()
        });
        assert!(err[0].contains("over 2 ranks (needs 1)"), "{}", err[0]);
    }
}
