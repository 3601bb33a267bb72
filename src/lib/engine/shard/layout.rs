//! The shards on the hosts: where a rank's shard lies in the parameters ([`ShardLayout`], what
//! a shard file records), a rank's shards downloaded ([`HostShard`]) or loaded back, and the
//! whole state gathered into one rank's host memory.

use anyhow::{ensure, Result};

use super::optim::ShardedOptim;
use crate::backend::{Backend, DType};
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::safetensors::round_bf16;
use crate::model::{Tensor, Weights};
use crate::parallel::comm::sum_f64;
use crate::parallel::{Collective, Comm};

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
    pub(crate) fn unflatten(&self, shards: &[&[Vec<f32>]]) -> Result<Weights> {
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

impl<B: Backend> ShardedOptim<B> {
    /// The layout of these shards of `dec`'s parameters.
    pub fn layout(&self, dec: &Decoder<B>) -> ShardLayout {
        ShardLayout {
            world_size: self.plan.world_size,
            names: dec.param_names().to_vec(),
            shapes: dec.param_shapes().to_vec(),
            buckets: self
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
    pub fn download(&self, dec: &Decoder<B>) -> Result<HostShard> {
        self.check_every_param_trained(dec)?;
        let b = dec.backend();
        let down = |bufs: &[B::Buf]| -> Result<Vec<Vec<f32>>> {
            let mut out = Vec::with_capacity(bufs.len());
            for (k, buf) in bufs.iter().enumerate() {
                let mut host = vec![0f32; self.plan.buckets[k].shard];
                b.download(buf, &mut host)?;
                out.push(host);
            }
            Ok(out)
        };
        Ok(HostShard {
            rank: self.rank,
            layout: self.layout(dec),
            step: dec.optimizer_steps(),
            master: down(&self.master)?,
            moments: match self.moments {
                true => Some((down(&self.m)?, down(&self.v)?)),
                false => None,
            },
        })
    }

    /// Puts a loaded shard (this rank's, of a checkpoint written with the same layout) in
    /// place of the shards these were cut with from `weights` (the model files' weights,
    /// widened). As one process does, the masters are taken only when every one rounds to the
    /// model's bf16 weight, on every rank (agreed by a collective, so that all ranks take the
    /// same choice); the moments and the step always. Returns whether the masters were taken.
    /// Collective.
    pub fn load(
        &mut self,
        dec: &mut Decoder<B>,
        shard: &HostShard,
        weights: &Weights,
        comm: &dyn Comm<B>,
    ) -> Result<bool> {
        self.check_every_param_trained(dec)?;
        let layout = self.layout(dec);
        if shard.layout != layout || shard.rank != self.rank {
            crate::bail_input!(
                "the optimizer shard of rank {} was written with another shard layout than this update's (rank {}: another --shard mode or --bucket-elems); continue with the --shard, --bucket-elems and number of ranks that wrote it, or merge the checkpoint's shards first (`tandem merge-shards CKPT --out DIR`: loads with any layout), or start from the model files without its optimizer state",
                shard.rank,
                self.rank
            );
        }
        let differs = self.masters_differ(dec, shard, weights);
        let mut votes = [differs as u8 as f64];
        sum_f64(dec.backend(), comm, &mut votes)?;
        let take = votes[0] == 0.0;
        if take {
            upload_shards(dec.backend(), &shard.master, &mut self.master)?;
            self.take_masters(dec, comm)?;
        }
        if let Some((m, v)) = &shard.moments {
            upload_shards(dec.backend(), m, &mut self.m)?;
            upload_shards(dec.backend(), v, &mut self.v)?;
            self.moments = true;
        }
        dec.set_optimizer_steps(shard.step);
        Ok(take)
    }

    /// A shard file's layout names every parameter of the decoder: a LoRA decoder's frozen
    /// base has no place in the buckets, and its adapters' state is written whole instead
    /// (gathered by [`ShardedOptim::gather_state`]).
    fn check_every_param_trained(&self, dec: &Decoder<B>) -> Result<()> {
        ensure!(
            self.plan.sizes == dec.param_sizes(),
            "optimizer shard files: the decoder has frozen parameters (LoRA); gather its state whole"
        );
        Ok(())
    }

    /// Whether any of `shard`'s masters does not round to the model's bf16 weight in `weights`.
    fn masters_differ(&self, dec: &Decoder<B>, shard: &HostShard, weights: &Weights) -> bool {
        let plan = &self.plan;
        let names = dec.param_names();
        let mut differs = false;
        for (k, bucket) in plan.buckets.iter().enumerate() {
            for t in bucket.tensors.clone() {
                if let Some((toff, soff, n)) = plan.shard_part(k, t, self.rank) {
                    let w = &weights[&names[t]].data[toff..toff + n];
                    let m = &shard.master[k][soff..soff + n];
                    differs |= m
                        .iter()
                        .zip(w)
                        .any(|(&a, &b)| round_bf16(a).to_bits() != b.to_bits());
                }
            }
        }
        differs
    }

    /// The compute shards from the masters just loaded, and zero2's whole compute weights on
    /// every rank from them (on an f32 backend they are the masters, finer than the files'
    /// bf16).
    fn take_masters(&mut self, dec: &mut Decoder<B>, comm: &dyn Comm<B>) -> Result<()> {
        let (b, w) = dec.weights_mut();
        for (k, c) in self.compute.iter_mut().enumerate() {
            b.copy(c, 0, &self.master[k], 0, self.plan.buckets[k].shard)?;
        }
        if let Some(sync) = self.sync.as_mut() {
            let shards = match self.compute.is_empty() {
                true => &self.master,
                false => &self.compute,
            };
            sync.run(b, comm, shards, w)?;
        }
        Ok(())
    }

    /// The f32 masters and (with `moments`) the optimizer state, gathered bucket by bucket into
    /// rank `root`'s host memory (the other ranks take part and get None). Device memory grows
    /// by one staging bucket only, unlike [`ShardedOptim::unshard`]. Collective.
    pub(crate) fn gather_state(
        &self,
        dec: &Decoder<B>,
        comm: &dyn Comm<B>,
        root: usize,
        moments: bool,
    ) -> Result<Option<(Weights, Option<OptimizerState>)>> {
        let mine = comm.rank() == root;
        let gather = |shards: &[B::Buf]| self.gather_host(dec, shards, comm, mine);
        let masters = gather(&self.master)?;
        let step = dec.optimizer_steps();
        let state = match (moments, self.moments) {
            (false, _) => None,
            (true, true) => Some(OptimizerState {
                step,
                exp_avg: gather(&self.m)?,
                exp_avg_sq: gather(&self.v)?,
            }),
            (true, false) => Some(OptimizerState {
                step,
                ..OptimizerState::default()
            }),
        };
        Ok(mine.then_some((masters, state)))
    }

    /// The f32 masters of the trained parameters (a LoRA decoder's adapters), whole on every
    /// rank: what a rank merges into its generation copy after a sharded LoRA update. Device
    /// memory grows by one staging bucket only. Collective.
    pub(crate) fn gather_masters_everywhere(
        &self,
        dec: &Decoder<B>,
        comm: &dyn Comm<B>,
    ) -> Result<Weights> {
        self.gather_host(dec, &self.master, comm, true)
    }

    /// Whole tensors (by name) from every rank's f32 `shards` (one per bucket of the plan),
    /// all-gathered bucket by bucket through one staging buffer; downloaded only where `keep`
    /// (the other ranks take part and get an empty map). Collective.
    fn gather_host(
        &self,
        dec: &Decoder<B>,
        shards: &[B::Buf],
        comm: &dyn Comm<B>,
        keep: bool,
    ) -> Result<Weights> {
        let b = dec.backend();
        let plan = &self.plan;
        let (names, shapes) = (dec.param_names(), dec.param_shapes());
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
            // A frozen tensor (size 0 in the plan: LoRA's base) is not the optimizer's.
            let trained = bucket.tensors.clone().zip(&bucket.offsets);
            for (t, &off) in trained.filter(|&(t, _)| plan.sizes[t] > 0) {
                let data = host[off..off + plan.sizes[t]].to_vec();
                let shape = shapes[t].clone();
                out.insert(names[t].clone(), Tensor { shape, data });
            }
        }
        Ok(out)
    }
}

/// Uploads one host vector per bucket into the shards `bufs`.
fn upload_shards<B: Backend>(b: &B, host: &[Vec<f32>], bufs: &mut [B::Buf]) -> Result<()> {
    for (h, buf) in host.iter().zip(bufs.iter_mut()) {
        b.upload(buf, h)?;
    }
    Ok(())
}
