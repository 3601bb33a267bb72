#![allow(unused)]
//! The Qwen2 / Llama / Qwen3 decoder, written once against the [`Backend`] op set.
//! INTERFACE DRAFT: signatures are fixed, bodies land in the next commits.

use anyhow::Result;

use crate::backend::Backend;
use crate::model::{Config, Weights};

/// One sequence to score: the log-prob of `tokens[t]` given `tokens[..t]` is computed for every
/// `t in start..tokens.len()` (`start >= 1`).
#[derive(Clone, Copy, Debug)]
pub struct SeqRef<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
}

/// Per-sequence results, one value per scored token (`tokens.len() - start` of them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenStats {
    pub logprobs: Vec<f32>,
    pub entropy: Option<Vec<f32>>,
}

/// Per-sequence loss gradients returned by the training callback: dL/dlogprob for every
/// scored token, and optionally dL/dentropy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenGrads {
    pub dlogprobs: Vec<f32>,
    pub dentropy: Option<Vec<f32>>,
}

/// AdamW hyper-parameters of one optimizer step (torch.optim.AdamW semantics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// What `optimizer_step` did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// True when the norm was not finite and the step was skipped (weights and moments kept).
    pub skipped: bool,
}

/// Adam moments by HF parameter name plus the step count, enough to resume exactly.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState {
    pub step: u64,
    pub exp_avg: Weights,
    pub exp_avg_sq: Weights,
}

/// A contiguous KV cache: `slots` sequences of up to `max_len` tokens each, per layer.
pub struct KvCache<B: Backend> {
    _b: std::marker::PhantomData<B>,
}

/// The decoder: weights, gradients, optimizer state and workspaces on one backend.
pub struct Decoder<B: Backend> {
    backend: B,
    /// Rows per chunk of the fused LM-head log-prob (bounds the logits held at once).
    pub logprob_chunk: usize,
}

impl<B: Backend> Decoder<B> {
    pub fn new(backend: B, cfg: &Config, weights: &Weights) -> Result<Self> {
        todo!()
    }
    pub fn export_weights(&self) -> Result<Weights> {
        todo!()
    }
    pub fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        todo!()
    }
    pub fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        todo!()
    }
    pub fn zero_grads(&mut self) -> Result<()> {
        todo!()
    }
    pub fn grad_norm(&self) -> Result<f32> {
        todo!()
    }
    pub fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        todo!()
    }
    pub fn optimizer_state(&self) -> Result<OptimizerState> {
        todo!()
    }
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> Result<()> {
        todo!()
    }
    pub fn new_cache(&self, slots: usize, max_len: usize) -> Result<KvCache<B>> {
        todo!()
    }
    /// Runs `tokens` into an empty (or freed) slot; returns the logits of the last position.
    pub fn prefill(
        &mut self,
        cache: &mut KvCache<B>,
        slot: usize,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        todo!()
    }
    /// One token per slot; returns logits `[slots.len(), vocab]` row-major.
    pub fn decode(
        &mut self,
        cache: &mut KvCache<B>,
        slots: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        todo!()
    }
    pub fn fork(&mut self, cache: &mut KvCache<B>, from_slot: usize, to_slot: usize) -> Result<()> {
        todo!()
    }
}

impl<B: Backend> KvCache<B> {
    /// Forget a slot's contents so it can be prefilled again.
    pub fn free(&mut self, slot: usize) {
        todo!()
    }
}
