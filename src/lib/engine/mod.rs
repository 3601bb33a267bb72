//! The engine on top of the decoder: the paged generation engine (`rollout`), micro-batched
//! scoring (`ref-logprob`), the training loop (`update`), and the whole-decoder and whole-engine
//! GPU checks (`check`, run by `tandem gpu-test`); the stages' command lines are in `crate::stage`.
//! Their loops poll `cancel` between steps, so the daemon can stop a job whose client is gone.

pub(crate) mod balance;
pub mod cancel;
pub mod check;
pub mod logprob;
pub mod paged;
pub mod policy;
pub mod resume;
pub mod shard;
pub mod stream;
#[cfg(test)]
mod testing;
pub mod train;

use crate::backend::{Backend, PpoShape, PPO_STATS};
use crate::model::decoder::{
    AdamWParams, Decoder, PpoTokens, SeqRef, StepReport, TokenGrads, TokenStats,
};
use anyhow::Result;

/// The part of the decoder that scoring and training use. [`Decoder`] is the real one; unit
/// tests of the loops use small closed-form models.
pub trait Policy {
    /// Log-probs (and entropies) of `tokens[start..]` of each sequence, no gradients.
    fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>>;
    /// Forward, loss callback, backward; gradients accumulate across calls.
    fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()>;
    /// Forward, the PPO-clip loss computed where the log-probs are (no host round trip), and
    /// backward; its metric sums accumulate until [`Policy::take_ppo_stats`]. With `logprobs`,
    /// the forward's log-probs of the scored tokens are also brought back into it (one
    /// download; the rollout-mismatch measurement). Returns false when the policy has no such
    /// path (the caller then uses `forward_backward`).
    fn forward_backward_ppo(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tokens: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
    ) -> Result<bool> {
        let _ = (seqs, temperature, tokens, clip, logprobs);
        Ok(false)
    }
    /// The metric sums of `forward_backward_ppo` since the last call (slots as
    /// [`crate::backend::PPO_STATS`]), reset to zero.
    fn take_ppo_stats(&mut self) -> Result<[f64; PPO_STATS]> {
        Ok([0.0; PPO_STATS])
    }
    fn zero_grads(&mut self) -> Result<()>;
    /// The next pass (`forward_backward` or `forward_backward_ppo`) is the last of this
    /// optimizer step on this rank: a data-parallel policy starts reducing the gradients
    /// during its backward.
    fn last_pass_next(&mut self) {}
    /// This rank's passes of the step are done. Every rank of a data-parallel policy calls it
    /// before any other collective of the step: it reduces the gradients its passes did not
    /// (a rank with no rows: zeros), so that every rank starts the same collectives.
    fn passes_done(&mut self) -> Result<()> {
        Ok(())
    }
    /// Clips to `max_grad_norm`, steps AdamW, and skips the step when the norm is not finite.
    fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport>;
    /// (rank, world size) when this policy is one rank of a data-parallel trainer
    /// ([`shard::ShardedPolicy`]): the loop then trains on this rank's share of each
    /// mini-batch and sums its numbers over the ranks with [`Policy::sum_over_ranks`].
    fn data_parallel(&self) -> Option<(usize, usize)> {
        None
    }
    /// Whether every rank must run the same passes (`logprobs`, `forward_backward`...) in the
    /// same order, an empty one where it has no rows: the passes run collectives (full
    /// sharding gathers each unit's weights).
    fn lockstep(&self) -> bool {
        false
    }
    /// `v` = the sum of every rank's `v` (a single process: unchanged).
    fn sum_over_ranks(&mut self, v: &mut [f64]) -> Result<()> {
        let _ = v;
        Ok(())
    }
    /// Every rank's `v` (all of the same length), in rank order (a single process: `v`).
    fn gather_over_ranks(&mut self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }
}

impl<B: Backend> Policy for Decoder<B> {
    fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        Decoder::logprobs(self, seqs, temperature, entropy)
    }
    fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        Decoder::forward_backward(self, seqs, temperature, loss)
    }
    fn forward_backward_ppo(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tokens: &PpoTokens,
        clip: PpoShape,
        logprobs: Option<&mut Vec<f32>>,
    ) -> Result<bool> {
        Decoder::forward_backward_ppo(self, seqs, temperature, tokens, clip, logprobs)?;
        Ok(true)
    }
    fn take_ppo_stats(&mut self) -> Result<[f64; PPO_STATS]> {
        Decoder::take_ppo_stats(self)
    }
    fn zero_grads(&mut self) -> Result<()> {
        Decoder::zero_grads(self)
    }
    fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        Decoder::optimizer_step(self, hp, max_grad_norm)
    }
}
