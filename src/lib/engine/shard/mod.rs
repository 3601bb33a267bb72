//! Data-parallel training with a sharded optimizer (ZeRO-2-like; see docs/DISTRIBUTED.md).
//!
//! Every rank holds the whole decoder and the whole batch. [`train_sharded`] runs the ordinary
//! training loop ([`crate::engine::train::train`]) on a [`ShardedPolicy`]: each mini-batch's
//! rows are shared out to the ranks by token count ([`crate::engine::balance`]), the loss is
//! normalised by the whole mini-batch's counts (every rank computes them from the batch), the
//! ranks' loss metrics are summed, and the optimizer step is [`ShardedOptim::step`]: gradients
//! reduce-scattered (during the backward of each rank's last pass of the step:
//! [`Policy::last_pass_next`], [`Policy::passes_done`]), global-norm clipping, AdamW on this
//! rank's 1/N of the f32 masters and moments, weights all-gathered. The result is the one-rank
//! result up to the order of the floating-point sums.
//! [`ShardMode::Full`] (FSDP / ZeRO-3) shards the compute weights too: the optimizer from
//! [`ShardedOptim::full`] or [`ShardedOptim::new_full`] makes the policy's passes gather each
//! unit before it runs and reduce-scatter its gradients as soon as its backward is done
//! ([`Holding`]); every rank then runs the same passes ([`Policy::lockstep`]).
//!
//! The decoder knows nothing of the ranks: the passes reach the communicator through their
//! per-unit hooks ([`crate::model::decoder::UnitHooks`]), which [`Holding`] (full sharding) and
//! [`Overlap`] (zero2's last pass of a step) implement.
//!
//! The entry points for a caller that holds a rank's decoder (the `update` stage under
//! `tandem launch`, a per-rank daemon): [`train_sharded`] for one update call, or
//! [`ShardedOptim::zero2`] / [`ShardedPolicy`] / [`ShardedOptim::unshard`] to keep the shards
//! between calls.
//!
//! Files: `optim` (the sharded state and its cut), `overlap` (zero2's reduce-scatter during
//! the backward), `full` (full sharding's hold and prefetch), `step` (the optimizer step, the
//! weights brought back whole), `layout` (the shards on the hosts).

pub mod check;
pub(crate) mod files;
mod full;
mod layout;
mod optim;
mod overlap;
mod step;

pub use super::train::ShardStats;
pub use full::Holding;
pub use layout::{Buckets, HostShard, ShardLayout};
pub use optim::ShardedOptim;

use super::train::{train, TrainConfig, TrainData, TrainReport};
use super::Policy;
use crate::backend::{Backend, PpoShape, PPO_STATS};
use crate::model::decoder::{
    AdamWParams, Decoder, NoHooks, OptimizerState, PpoTokens, SeqRef, StepReport, TokenGrads,
    TokenStats, UnitHooks,
};
use crate::model::Weights;
use crate::parallel::comm::sum_f64;
use crate::parallel::Comm;
use anyhow::Result;
use std::time::Instant;

/// Default bucket size of the reduce-scatter and the weight sync, in elements (25 M, as
/// PyTorch DDP's 25 MB buckets are counted in bytes; the flag takes MB of f32).
pub const DEFAULT_BUCKET_ELEMS: usize = 25 << 20;

/// What a data-parallel update shards (`update --shard`, a pipeline's `[update] shard`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardMode {
    /// ZeRO-2: the f32 masters, Adam moments and gradients 1/N; the compute weights whole on
    /// every rank (all-gathered after each step: the weight sync).
    #[default]
    Zero2,
    /// FSDP / ZeRO-3: the compute weights 1/N too, each unit (embedding, layer, head)
    /// gathered before its forward and its backward and freed after; gradients reduce-scattered
    /// unit by unit during the backward.
    Full,
}

impl ShardMode {
    pub(crate) const NAMES: [&'static str; 2] = ["zero2", "full"];
}

impl std::str::FromStr for ShardMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zero2" => Ok(ShardMode::Zero2),
            "full" => Ok(ShardMode::Full),
            _ => Err(format!("unknown shard mode '{s}' (zero2, full)")),
        }
    }
}

/// One rank's decoder with its optimizer shards and the communicator of the ranks.
pub struct ShardedPolicy<'a, B: Backend> {
    pub decoder: &'a mut Decoder<B>,
    pub comm: &'a dyn Comm<B>,
    pub optim: ShardedOptim<B>,
}

impl<B: Backend> Policy for ShardedPolicy<'_, B> {
    fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        if self.optim.is_full() {
            let mut hold = Holding::new(self.comm, &mut self.optim);
            return self
                .decoder
                .logprobs_with(seqs, temperature, entropy, &mut hold);
        }
        self.decoder.logprobs(seqs, temperature, entropy)
    }
    fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        self.pass(|d, comm| d.forward_backward_with(seqs, temperature, loss, comm))
    }
    fn forward_backward_ppo(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tokens: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
    ) -> Result<bool> {
        self.pass(|d, comm| {
            d.forward_backward_ppo_with(seqs, temperature, tokens, clip, logprobs, comm)
        })?;
        Ok(true)
    }
    fn take_ppo_stats(&mut self) -> Result<[f64; PPO_STATS]> {
        self.decoder.take_ppo_stats()
    }
    fn zero_grads(&mut self) -> Result<()> {
        if self.optim.is_full() {
            // The passes add into the gradient shards; the decoder holds none.
            return self.optim.zero_grads(self.decoder.backend());
        }
        self.optim.begin_step();
        self.decoder.zero_grads()
    }
    fn last_pass_next(&mut self) {
        self.optim.arm_overlap();
    }
    fn passes_done(&mut self) -> Result<()> {
        match self.optim.is_full() {
            true => Ok(()),
            false => self.optim.reduce_grads(self.decoder, self.comm),
        }
    }
    fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        self.optim.step(self.decoder, self.comm, hp, max_grad_norm)
    }
    fn data_parallel(&self) -> Option<(usize, usize)> {
        Some((self.comm.rank(), self.comm.world_size()))
    }
    fn lockstep(&self) -> bool {
        self.optim.is_full()
    }
    fn sum_over_ranks(&mut self, v: &mut [f64]) -> Result<()> {
        sum_f64(self.decoder.backend(), self.comm, v)
    }
    fn gather_over_ranks(&mut self, v: &[f32]) -> Result<Vec<f32>> {
        let b = self.decoder.backend();
        let n = v.len();
        let mut send = b.alloc(n)?;
        b.upload(&mut send, v)?;
        let mut recv = b.alloc(n * self.comm.world_size())?;
        self.comm.all_gather(&send, 0, &mut recv, 0, n)?;
        let mut out = vec![0f32; n * self.comm.world_size()];
        b.download(&recv, &mut out)?;
        Ok(out)
    }
}

/// Where [`ShardedPolicy::train_to_host`] brings the optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StateTo {
    /// Nowhere (it is not written).
    Nowhere,
    /// Gathered whole on rank `root`.
    Root,
    /// Each rank its own shard (what it writes as its shard file).
    EachRank,
}

/// What [`ShardedPolicy::train_to_host`] brings back.
pub(crate) struct ToHost {
    pub(crate) report: TrainReport,
    /// The f32 masters (rank `root` only).
    pub(crate) weights: Option<Weights>,
    /// The whole optimizer state (rank `root` only, [`StateTo::Root`]).
    pub(crate) state: Option<OptimizerState>,
    /// This rank's shard of the masters and moments ([`StateTo::EachRank`]).
    pub(crate) shard: Option<HostShard>,
}

impl<B: Backend> ShardedPolicy<'_, B> {
    /// Runs training pass `f` with the hooks this rank's pass needs: the full-shard hold,
    /// zero2's overlap on the step's last pass (its reduce-scatters waited for when the pass
    /// returns), or none.
    fn pass<T>(
        &mut self,
        f: impl FnOnce(&mut Decoder<B>, &mut dyn UnitHooks<B>) -> Result<T>,
    ) -> Result<T> {
        if self.optim.is_full() {
            let mut hold = Holding::new(self.comm, &mut self.optim);
            return f(self.decoder, &mut hold);
        }
        if self.optim.take_pass()? {
            let mut ov = self.optim.overlap(self.comm);
            let out = f(self.decoder, &mut ov)?;
            ov.finish()?;
            return Ok(out);
        }
        f(self.decoder, &mut NoHooks)
    }

    /// One `update` call on this rank with the policy's optimizer (from
    /// [`ShardedOptim::zero2`], [`ShardedOptim::full`] or [`ShardedOptim::new_full`]), as
    /// [`train_sharded`], but the f32 masters come back to rank `root`'s host memory (bucket
    /// by bucket: no rank's device holds them whole) instead of into the decoder, and the
    /// optimizer state where `state` says: gathered there too, or each rank's own shard of
    /// masters and moments to its host (no gather: what a rank writes as its shard file).
    /// What `update` under a launcher runs: rank 0 writes the model.
    pub(crate) fn train_to_host(
        &mut self,
        data: &TrainData,
        cfg: &TrainConfig,
        schedule_step: u64,
        log: &mut dyn FnMut(&str),
        root: usize,
        state: StateTo,
    ) -> Result<ToHost> {
        let mut report = train(self, data, cfg, schedule_step, log)?;
        let started = Instant::now();
        let gathered =
            self.optim
                .gather_state(self.decoder, self.comm, root, state == StateTo::Root)?;
        let shard = match state {
            StateTo::EachRank => Some(self.optim.download(self.decoder)?),
            _ => None,
        };
        self.optim.stats.state_gather_seconds = started.elapsed().as_secs_f64();
        report.shard = Some(self.optim.stats.clone());
        let (weights, state) = match gathered {
            Some((w, s)) => (Some(w), s),
            None => (None, None),
        };
        Ok(ToHost {
            report,
            weights,
            state,
            shard,
        })
    }
}

/// One `update` call on this rank: shards the optimizer (over buckets of `bucket_elems`),
/// trains, and gathers the masters and moments back into `decoder`, so that every rank's
/// decoder then holds what one rank training on the whole batch would (its `export_weights`
/// and `optimizer_state` are the checkpoint's). Every rank of `comm` must call it.
pub fn train_sharded<B: Backend>(
    decoder: &mut Decoder<B>,
    comm: &dyn Comm<B>,
    bucket_elems: usize,
    data: &TrainData,
    cfg: &TrainConfig,
    schedule_step: u64,
    log: &mut dyn FnMut(&str),
) -> Result<TrainReport> {
    let optim = ShardedOptim::zero2(decoder, comm, bucket_elems)?;
    let mut policy = ShardedPolicy {
        decoder,
        comm,
        optim,
    };
    let trained = train(&mut policy, data, cfg, schedule_step, log);
    let ShardedPolicy { decoder, optim, .. } = policy;
    // Gathered even after a failed step, so the decoder is whole again; the first error wins.
    let stats: Result<ShardStats> = optim.unshard(decoder, comm);
    let mut report = trained?;
    report.shard = Some(stats?);
    Ok(report)
}
