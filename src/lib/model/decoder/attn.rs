//! How a forward pass's attention gets its keys: from the packed sequences of the call, or from
//! a paged KV cache as the engine's runner describes it for a step (the forward pass and the
//! paged steps of `step` both read these).

use crate::backend::Backend;

/// How the attention of a forward pass gets its keys.
pub(super) enum AttnMode<'a, B: Backend> {
    /// Packed sequences, keys from this call only.
    Packed,
    /// Keys and values are stored into a paged cache first, then read from it through block
    /// tables (`kv_rows` are the cache rows of the new tokens, `kv_base` the table row of each
    /// query, `kv_len` its context length).
    Paged(PagedAttn<'a, B>),
}

/// The paged KV cache as a step's attention reads and writes it: per layer, the keys and
/// values of every block (cache row `block · block_size + offset`); the step's block tables
/// (row s holds `max_blocks` entries, the blocks of table row s in order); and its prefill
/// tiles (`PagedAttentionOps::attention_paged_tiled`: `n_tiles` (first row, rows) pairs after the
/// `decode_rows` single-token rows).
pub struct PagedAttn<'a, B: Backend> {
    pub k: &'a mut [B::Buf],
    pub v: &'a mut [B::Buf],
    pub block_size: usize,
    pub tables: &'a B::Idx,
    pub max_blocks: usize,
    pub tiles: &'a B::Idx,
    pub n_tiles: usize,
    pub decode_rows: usize,
}
