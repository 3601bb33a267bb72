//! Causal GQA attention over packed variable-length sequences: the training forward and its
//! backward, flash style (never a T×T matrix).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `attention.cu` (scalar tiles, tensor-core tiles,
//! and the paged engine's batch-invariant and prefill kernels that reuse the training forward's
//! tiles, launched from `ops/paged_attention`), `check.rs` (the `attention` GPU
//! case; forward and backward timed at the training micro-batch).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

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

/// The three inputs of attention, `[tokens, heads, head_dim]` for q and `[tokens, kv_heads,
/// head_dim]` for k and v (or their gradients, `&mut`, in the backward).
#[derive(Clone, Copy, Debug)]
pub struct Qkv<T> {
    pub q: T,
    pub k: T,
    pub v: T,
}

/// The forward's outputs the backward reads again: o `[tokens, heads, head_dim]` and the
/// log-sum-exp per query and head, lse `[tokens, heads]`.
#[derive(Clone, Copy, Debug)]
pub struct AttnOut<T> {
    pub o: T,
    pub lse: T,
}

/// Attention ops.
pub trait AttentionOps: Device {
    /// Packed causal GQA: o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j, with kv head
    /// h / (heads/kv_heads); lse[i,h] = log Σ_j exp(q_i·k_j/√d) saved for backward.
    fn attention(
        &self,
        out: AttnOut<&mut Self::Buf>,
        x: Qkv<&Self::Buf>,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
    /// P = exp(S − lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)),
    /// dQ = dS K/√d, dK = dSᵀ Q/√d. dq, dk, dv are overwritten.
    fn attention_backward(
        &self,
        dx: Qkv<&mut Self::Buf>,
        dout: &Self::Buf,
        x: Qkv<&Self::Buf>,
        out: AttnOut<&Self::Buf>,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
}
