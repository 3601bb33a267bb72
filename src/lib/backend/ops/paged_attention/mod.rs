//! Attention of the paged generation engine (`engine::paged`): queries against a KV cache held
//! in fixed-size blocks through per-sequence block tables, for decode steps (one query per
//! sequence), decode steps with the rope and cache store fused in, and steps with prefill
//! chunks (tiles of consecutive positions of one sequence).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs` (flash-decoding launchers; the batch-invariant
//! and prefill kernels are in `ops/attention/attention.cu`, sharing the training forward's
//! tiles), `paged_attention.cu`, `check.rs` (the GPU cases `attention_paged`, `attention_paged_rope`
//! and `attention_invariance`; a decode step's attention timed).

pub mod check;
pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::RopeOps;

/// Shape of an attention call against a paged KV cache: query `i` attends to the first
/// `len[i]` positions of sequence `seq[i]`, whose block table is row `seq[i]` of `tables`
/// (`max_blocks` entries per row); position `p` is cache row
/// `tables[seq[i]·max_blocks + p / block_size]·block_size + p % block_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedAttnShape {
    pub queries: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

/// Most rows of one tile of [`PagedAttentionOps::attention_paged_tiled`] (the query tile of the
/// GPU's attention kernels).
pub const PAGED_TILE_ROWS: usize = 64;

/// Paged attention.
pub trait PagedAttentionOps: RopeOps {
    /// Paged attention (see [`PagedAttnShape`] for the row of position p):
    /// o_i = Σ_{p<len[i]} softmax_p(q_i·K[row_i(p)]/√d) V[row_i(p)], kv head h/(heads/kv_heads).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        shape: PagedAttnShape,
    ) -> Result<()>;
    /// A decode step's `rope_store_kv_packed` then `attention_paged` (`q` receives the rotated
    /// queries where a backend runs them as two ops; the CUDA tensor-core path does both in one
    /// kernel, with the same bits, and leaves `q` alone).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged_rope(
        &self,
        o: &mut Self::Buf,
        qkv: &Self::Buf,
        q: &mut Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        shape: PagedAttnShape,
        theta: f32,
    ) -> Result<()> {
        let s = shape;
        self.rope_store_kv_packed(
            qkv, q, pos, k_cache, v_cache, rows, s.queries, s.heads, s.kv_heads, s.head_dim, theta,
        )?;
        self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, s)
    }
    /// `attention_paged` for a step with prefill chunks: rows `decode_rows..queries` come in
    /// `n_tiles` tiles, `tiles[2j]` its first row and `tiles[2j+1]` its rows (at most
    /// [`PAGED_TILE_ROWS`]), each a run of one sequence's consecutive positions, which a backend
    /// may attend as one block of queries; the rows before `decode_rows` are single queries.
    /// The result is `attention_paged`'s (the CPU runs exactly that).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged_tiled(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        tiles: &Self::Idx,
        n_tiles: usize,
        decode_rows: usize,
        shape: PagedAttnShape,
    ) -> Result<()> {
        let _ = (tiles, n_tiles, decode_rows);
        self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, shape)
    }
}
