//! Causal GQA attention over packed variable-length sequences: the training forward and its
//! backward, flash style (never a T×T matrix).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `attention.cu` (scalar tiles, tensor-core tiles,
//! and the paged engine's batch-invariant and prefill kernels that reuse the training forward's
//! tiles, launched from `ops/paged_attention`), `check.rs` (the `attention` GPU
//! case; forward and backward timed at the training micro-batch).

pub mod check;
pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// Shape of a packed attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Total query rows (packed tokens).
    pub tokens: usize,
    /// Number of packed sequences (`cu_seqlens` has `seqs + 1` entries).
    pub seqs: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Attention ops.
pub trait AttentionOps: Device {
    /// Packed causal GQA: o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j, with kv head
    /// h / (heads/kv_heads); lse[i,h] = log Σ_j exp(q_i·k_j/√d) saved for backward.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
    /// P = exp(S − lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)),
    /// dQ = dS K/√d, dK = dSᵀ Q/√d. dq, dk, dv are overwritten.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        dout: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &Self::Buf,
        lse: &Self::Buf,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
}
