//! Sampling of the paged generation engine: one token per row of logits, drawn exactly as the
//! host sampler (`engine::sampling::sample`) draws it with the row's counter-based uniform,
//! with its log-prob under the tempered softmax.
//!
//! Files: `cpu.rs` (the reference: the host sampler per row), `cuda.rs`, `sample.cu`. The GPU
//! case (`sample`: greedy, full softmax, top-k, top-p, both) is in
//! `backend/cuda/parity_paged.rs` with the paged engine's.

pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// Token sampling.
pub trait SampleOps: Device {
    /// One token per row of logits[rows, vocab], drawn as `engine::sampling::sample` draws it
    /// with u = uniform(key_r, positions[r]), key_r = keys[2r] | keys[2r+1] << 32:
    /// tokens[r] = the id, logprobs[r] = log softmax(z_r / T)[id] (T = 1 when greedy).
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &self,
        tokens: &mut Self::Idx,
        logprobs: &mut Self::Buf,
        logits: &Self::Buf,
        keys: &Self::Idx,
        positions: &Self::Idx,
        rows: usize,
        vocab: usize,
        params: &crate::engine::sampling::SamplingParams,
    ) -> Result<()>;
}
