//! The backend: every op a Qwen2/Llama/Qwen3 decoder needs, forward and backward, behind one
//! trait so the decoder (`model::decoder`) is written once. Two halves:
//! - [`Device`] (`device.rs`): the runtime, buffers, transfers, synchronisation, memory
//!   statistics, graphs and draws. `cpu/` and `cuda/` are the two devices.
//! - The op families (`ops/<family>/`): each folder holds the op's shape and formula (`mod.rs`,
//!   with the family's trait), the f32 CPU reference (`cpu.rs`, the oracle every other backend
//!   is checked against), the CUDA launchers (`cuda.rs`), the kernels (`<family>.cu`) and the
//!   GPU checks and timing shapes (`check.rs`, run by `tandem gpu-test`).
//!
//! [`Backend`] is a device with every family; generic code takes `B: Backend` and calls any op.
//! Code that names a concrete backend (`Cpu`, `CudaBackend`) brings the traits into scope with
//! `use crate::backend::prelude::*`.
//!
//! Conventions, shared by every implementation:
//! - Buffers are flat. A buffer may be longer than an op needs (workspaces are sized for a token
//!   budget once and reused): an op reads and writes only the prefix its sizes describe.
//! - Matrices are row-major. Linear weights use the HF layout `[out, in]`, so a projection is
//!   `y = x · wᵀ`. Activations are `[tokens, features]`; attention tensors are
//!   `[tokens, heads, head_dim]`.
//! - Sequences are packed without padding: `cu_seqlens` holds `n_seqs + 1` offsets, sequence `s`
//!   owns rows `cu_seqlens[s]..cu_seqlens[s+1]`.
//! - Gradients of parameters always accumulate (`+=`), so micro-batches add up; gradients of
//!   activations either overwrite or accumulate as the `accumulate` flag says.
//! - Ops return `Result` because a device launch can fail; the CPU backend only fails on
//!   sizes that do not fit its buffers (a bug in the caller, reported rather than panicking).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;
pub(crate) mod device;
pub mod ops;

pub use device::{DType, Device, MemoryStats, Parts, FEED_NONE};
pub use ops::adamw::{AdamWOps, AdamWStep};
pub use ops::attention::{AttentionOps, AttnOut, AttnShape, Qkv};
pub use ops::embedding::EmbeddingOps;
pub use ops::logprob::{LogprobGrad, LogprobInput, LogprobOps, LogprobShape};
pub use ops::matmul::{MatmulOps, MatmulShape};
pub use ops::memory::{KvCache, MemoryOps};
pub use ops::paged_attention::{
    BlockTables, PagedAttentionOps, PagedAttnShape, PagedRopeShape, PrefillTiles, PAGED_TILE_ROWS,
};
pub use ops::ppo_loss::{PpoInputs, PpoLossOps, PpoShape, PPO_STATS};
pub use ops::rmsnorm::{RmsNormOps, RmsNormSaved, RmsNormShape};
pub use ops::rope::{PackedQkv, RopeKvShape, RopeOps, RopeShape, Slots};
pub use ops::sample::{Draws, SampleOps};
pub use ops::swiglu::SwigluOps;

/// A device with every op family: what the decoder and the engines are written against.
/// Implemented for every type that has them all (`Cpu`, `CudaBackend`).
pub trait Backend:
    Device
    + MemoryOps
    + MatmulOps
    + EmbeddingOps
    + RmsNormOps
    + RopeOps
    + SwigluOps
    + AttentionOps
    + PagedAttentionOps
    + LogprobOps
    + PpoLossOps
    + AdamWOps
    + SampleOps
{
}

impl<T> Backend for T where
    T: Device
        + MemoryOps
        + MatmulOps
        + EmbeddingOps
        + RmsNormOps
        + RopeOps
        + SwigluOps
        + AttentionOps
        + PagedAttentionOps
        + LogprobOps
        + PpoLossOps
        + AdamWOps
        + SampleOps
{
}

/// The traits and shapes, for code that calls ops on a concrete backend.
pub mod prelude {
    pub use super::{
        AdamWOps, AdamWStep, AttentionOps, AttnOut, AttnShape, Backend, BlockTables, DType, Device,
        Draws, EmbeddingOps, KvCache, LogprobGrad, LogprobInput, LogprobOps, LogprobShape,
        MatmulOps, MatmulShape, MemoryOps, PackedQkv, PagedAttentionOps, PagedAttnShape,
        PagedRopeShape, PpoInputs, PpoLossOps, PpoShape, PrefillTiles, Qkv, RmsNormOps,
        RmsNormSaved, RmsNormShape, RopeKvShape, RopeOps, RopeShape, SampleOps, Slots, SwigluOps,
    };
}
