//! Token embedding: a lookup of rows of the `[vocab, hidden]` table, and its scatter-add
//! backward into the table's gradient.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `embedding.cu`, `check.rs` (the `embedding` GPU
//! case, with a token id past the vocabulary reported at the next synchronize).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// Embedding lookup and its backward.
pub trait EmbeddingOps: Device {
    /// out[t,:] = table[ids[t],:].
    fn embedding(
        &self,
        out: &mut Self::Buf,
        table: &Self::Buf,
        ids: &Self::Idx,
        tokens: usize,
        dim: usize,
    ) -> Result<()>;
    /// dtable[ids[t],:] += dout[t,:].
    fn embedding_backward(
        &self,
        dtable: &mut Self::Buf,
        dout: &Self::Buf,
        ids: &Self::Idx,
        tokens: usize,
        dim: usize,
    ) -> Result<()>;
}
