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
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::{KvCache, PackedQkv, RopeKvShape, RopeOps, Slots};

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

impl PagedAttnShape {
    /// The rope + cache store of the same heads (one new token per query), base `theta`.
    pub fn rope(&self, theta: f32) -> RopeKvShape {
        RopeKvShape {
            tokens: self.queries,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            theta,
        }
    }
}

/// A decode step's fused rope + store + attention: the attention's shape and the rope's base.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedRopeShape {
    pub attn: PagedAttnShape,
    pub theta: f32,
}

/// What each query reads of a paged cache (see [`PagedAttnShape`]): the block tables, and per
/// query its sequence (row of `tables`) and its context length.
#[derive(Clone, Copy, Debug)]
pub struct BlockTables<I> {
    pub tables: I,
    pub seq: I,
    pub len: I,
}

/// The prefill tiles of a step (see [`PagedAttentionOps::attention_paged_tiled`]): `n_tiles`
/// (first row, rows) pairs in `tiles`, after `decode_rows` single-query rows.
#[derive(Clone, Copy, Debug)]
pub struct PrefillTiles<I> {
    pub tiles: I,
    pub n_tiles: usize,
    pub decode_rows: usize,
}

/// Most rows of one tile of [`PagedAttentionOps::attention_paged_tiled`] (the query tile of the
/// GPU's attention kernels).
pub const PAGED_TILE_ROWS: usize = 64;

/// Paged attention.
pub trait PagedAttentionOps: RopeOps {
    /// Paged attention (see [`PagedAttnShape`] for the row of position p):
    /// o_i = Σ_{p<len[i]} softmax_p(q_i·K[row_i(p)]/√d) V[row_i(p)], kv head h/(heads/kv_heads).
    fn attention_paged(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        cache: KvCache<&Self::Buf>,
        blocks: BlockTables<&Self::Idx>,
        shape: PagedAttnShape,
    ) -> Result<()>;
    /// A decode step's `rope_store_kv_packed` then `attention_paged` (`x.q` receives the
    /// rotated queries where a backend runs them as two ops; the CUDA tensor-core path does both
    /// in one kernel, with the same bits, and leaves it alone).
    fn attention_paged_rope(
        &self,
        o: &mut Self::Buf,
        x: PackedQkv<Self::Buf>,
        slots: Slots<&Self::Idx>,
        mut cache: KvCache<&mut Self::Buf>,
        blocks: BlockTables<&Self::Idx>,
        shape: PagedRopeShape,
    ) -> Result<()> {
        let s = shape.attn;
        let q = x.q;
        self.rope_store_kv_packed(
            PackedQkv {
                qkv: x.qkv,
                q: &mut *q,
            },
            slots,
            cache.reborrow(),
            s.rope(shape.theta),
        )?;
        self.attention_paged(o, q, cache.read(), blocks, s)
    }
    /// `attention_paged` for a step with prefill chunks: rows `decode_rows..queries` come in
    /// `n_tiles` tiles, `tiles[2j]` its first row and `tiles[2j+1]` its rows (at most
    /// [`PAGED_TILE_ROWS`]), each a run of one sequence's consecutive positions, which a backend
    /// may attend as one block of queries; the rows before `decode_rows` are single queries.
    /// The result is `attention_paged`'s (the CPU runs exactly that).
    fn attention_paged_tiled(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        cache: KvCache<&Self::Buf>,
        blocks: BlockTables<&Self::Idx>,
        tiles: PrefillTiles<&Self::Idx>,
        shape: PagedAttnShape,
    ) -> Result<()> {
        let _ = tiles;
        self.attention_paged(o, q, cache, blocks, shape)
    }
}
