//! The paged attention launchers: `paged_attention.cu` (scalar, GQA and tensor-core decode
//! kernels with flash-decoding splits, and the fused rope), and the batch-invariant and
//! prefill-tile kernels of `ops/attention/attention.cu`.

use anyhow::{bail, Result};

use super::{BlockTables, PagedAttentionOps, PagedAttnShape, PagedRopeShape, PrefillTiles};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, ArgGroup, Args, CudaBackend, CudaBuf, CudaIdx};
use crate::backend::ops::attention::{
    self,
    cuda::{attention_mma_smem, check_attn, paged_inv_smem},
};
use crate::backend::ops::rope::cuda::{freqs, Freqs};
use crate::backend::{DType, Device, KvCache, PackedQkv, RopeOps, Slots};

pub(crate) const KERNELS: Family = Family {
    name: "paged_attention",
    src: include_str!("paged_attention.cu"),
    per_head_dim: true,
    training_only: false,
};

/// Most context splits of one paged-attention row (the partial states a combine reads).
const MAX_PAGED_SPLITS: usize = 128;

/// The rope half of a fused decode attention (`paged_attn_mma_rope_k`): positions, cache rows
/// of the new tokens, the cache's row count and the inverse frequencies.
struct PagedRope<'a> {
    pos: &'a CudaIdx,
    rows: &'a CudaIdx,
    cache_rows: i64,
    fr: Freqs,
}

/// The arguments the paged kernels take after the block tables: `int heads, int kv_heads,
/// int block_size, int max_blocks, i64 num_blocks` (the blocks in the pool).
struct PagedDims {
    heads: i32,
    kv_heads: i32,
    block_size: i32,
    max_blocks: i32,
    num_blocks: i64,
}

impl ArgGroup for PagedDims {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a> {
        a.i32(self.heads)
            .i32(self.kv_heads)
            .i32(self.block_size)
            .i32(self.max_blocks)
            .i64(self.num_blocks)
    }
}

/// `const u32* tables, const u32* seq, const u32* len`.
impl ArgGroup for BlockTables<&CudaIdx> {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a> {
        a.idx(self.tables).idx(self.seq).idx(self.len)
    }
}

/// What every paged attention kernel reads besides its queries and output: the cache, the
/// block tables, the dims, the scale and the error word.
struct Paged<'a> {
    k_cache: &'a CudaBuf,
    v_cache: &'a CudaBuf,
    blocks: BlockTables<&'a CudaIdx>,
    s: PagedAttnShape,
    dims: PagedDims,
    scale: f32,
    err: u64,
}

impl<'a> Paged<'a> {
    fn new(
        be: &CudaBackend,
        cache: KvCache<&'a CudaBuf>,
        blocks: BlockTables<&'a CudaIdx>,
        s: PagedAttnShape,
    ) -> Result<Self> {
        let KvCache { k, v } = cache;
        let row = s.kv_heads * s.head_dim;
        let dims = PagedDims {
            heads: s.heads as i32,
            kv_heads: s.kv_heads as i32,
            block_size: i32_of(s.block_size, "block_size")?,
            max_blocks: i32_of(s.max_blocks, "max_blocks")?,
            num_blocks: (k.len.min(v.len) / (row * s.block_size)) as i64,
        };
        Ok(Paged {
            k_cache: k,
            v_cache: v,
            blocks,
            s,
            dims,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            err: be.err_ptr(),
        })
    }
}

/// `attention_paged`, or with `rope` the decode step's rope + kv_store fused in (`q` is then
/// the fused q/k/v projection; only the tensor-core kernel takes it).
fn launch_paged(
    be: &CudaBackend,
    o: &mut CudaBuf,
    q: &CudaBuf,
    cache: KvCache<&CudaBuf>,
    blocks: BlockTables<&CudaIdx>,
    s: PagedAttnShape,
    rope: Option<PagedRope>,
) -> Result<()> {
    let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
    let qn = s.queries * s.heads * s.head_dim;
    need(o.len, qn, "attention_paged o")?;
    if rope.is_none() {
        need(q.len, qn, "attention_paged q")?;
    }
    need(blocks.seq.len, s.queries, "attention_paged seq")?;
    need(blocks.len.len, s.queries, "attention_paged len")?;
    if s.queries == 0 {
        return Ok(());
    }
    if s.block_size == 0 || s.max_blocks == 0 {
        bail!(
            "attention_paged: block size {} and {} blocks per table",
            s.block_size,
            s.max_blocks
        );
    }
    let p = Paged::new(be, cache, blocks, s)?;
    if rope.is_none()
        && be.batch_invariant()
        && s.heads / s.kv_heads <= 16
        && be.use_mma(hd, &[o, q, p.k_cache, p.v_cache])
    {
        // Batch invariance: the training forward's tiles and arithmetic per (query, head).
        let smem = paged_inv_smem(hd);
        let f = be.func_smem(attention::cuda::KERNELS, hd, "paged_attn_inv_k", smem)?;
        let args = Args::new()
            .ptrs(&[o, q, p.k_cache, p.v_cache])
            .with(&p.blocks)
            .with(&p.dims)
            .f32(p.scale)
            .raw(p.err);
        return be.launch(
            &f,
            (s.queries as u32, s.kv_heads as u32, 1),
            128,
            smem,
            &args,
        );
    }
    launch_decode(be, o, q, &p, rope)
}

/// The flash-decoding kernel of a paged attention: its name, the grid's y extent, and the
/// blocks below which the context is split.
fn decode_kernel(be: &CudaBackend, s: PagedAttnShape, mma: bool) -> (&'static str, usize, usize) {
    let gqa = s.head_dim.is_multiple_of(8) && s.heads / s.kv_heads <= 8;
    if mma {
        // Fewer blocks before splitting than the scalar kernels: a split costs a merge
        // pass (at 256 queries, 23 µs per layer with 2·SMs against 33 µs with 4·SMs).
        // Groups of at most 8 put the heads on the MMA's n side (`paged_attn_mmat_k`).
        let name = if gqa {
            "paged_attn_mmat_k"
        } else {
            "paged_attn_mma_k"
        };
        (name, s.kv_heads, 2 * be.sms() as usize)
    } else if gqa {
        ("paged_attn_gqa_k", s.kv_heads, 4 * be.sms() as usize)
    } else {
        ("paged_attn_k", s.heads, 2 * be.sms() as usize)
    }
}

/// One block per (query, kv head) serving its whole GQA group when the group is small enough
/// (every key/value row read once): on the tensor cores when q and the cache are bf16 and
/// head_dim is 64 or 128, else with scalar math; otherwise one block per (query, head). The
/// context is split when there are too few blocks to fill the GPU, and the splits combined.
fn launch_decode(
    be: &CudaBackend,
    o: &mut CudaBuf,
    q: &CudaBuf,
    p: &Paged,
    rope: Option<PagedRope>,
) -> Result<()> {
    let (s, hd) = (p.s, p.s.head_dim);
    let mma = s.heads / s.kv_heads <= 16
        && hd.is_multiple_of(64)
        && be.use_mma(hd, &[q, p.k_cache, p.v_cache]);
    if rope.is_some() && !mma {
        bail!("attention_paged: the fused rope needs the tensor-core kernel");
    }
    let (name, blocks_y, threshold) = decode_kernel(be, s, mma);
    // paged_attn_mma(t)_rope_k: paged_attn_mma(t)_k's arguments, then the rope's.
    let name = match (rope.is_some(), name) {
        (true, "paged_attn_mmat_k") => "paged_attn_mmat_rope_k",
        (true, _) => "paged_attn_mma_rope_k",
        (false, name) => name,
    };
    let f = be.func(KERNELS, hd, name)?;
    // Flash-decoding: each row cuts its own context into even splits of at least 64
    // positions (split_len 0, see `row_split` in the kernel), so the split count depends on
    // the number of queries alone and a row's result does not depend on the table width: a
    // decode step replayed from a CUDA graph (tables padded to a fixed width) gives the
    // eager bits.
    let pairs = s.queries * s.heads;
    let splits = threshold
        .div_ceil(s.queries * blocks_y)
        .clamp(1, MAX_PAGED_SPLITS);
    let split_len = 0i32;
    let (part_o, part_ml) = if splits > 1 {
        (
            be.temp(pairs * splits * hd, DType::F32)?,
            be.temp(pairs * splits * 2, DType::F32)?,
        )
    } else {
        (be.temp(1, DType::F32)?, be.temp(2, DType::F32)?)
    };
    let head = match mma {
        true => Args::new().buf(o).ptrs(&[q, p.k_cache, p.v_cache]),
        false => Args::new().bufs(&[o, q, p.k_cache, p.v_cache]),
    };
    let mut args = head
        .with(&p.blocks)
        .with(&p.dims)
        .i32(split_len)
        .f32(p.scale)
        .ptr(&part_o)
        .ptr(&part_ml)
        .raw(p.err);
    if let Some(r) = &rope {
        args = args
            .idx(r.pos)
            .idx(r.rows)
            .i64(r.cache_rows)
            .by_value(&r.fr);
    }
    let grid = (s.queries as u32, blocks_y as u32, splits as u32);
    be.launch(&f, grid, 128, 0, &args)?;
    if splits > 1 {
        let c = be.func(KERNELS, hd, "paged_combine_k")?;
        let args = Args::new()
            .buf(o)
            .ptr(&part_o)
            .ptr(&part_ml)
            .i32(p.dims.heads)
            .i32(splits as i32);
        let grid = (s.queries as u32, s.heads as u32, 1);
        be.launch(&c, grid, CudaBackend::row_threads(hd), 0, &args)?;
    }
    Ok(())
}

impl PagedAttentionOps for CudaBackend {
    fn attention_paged_tiled(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        cache: KvCache<&CudaBuf>,
        blocks: BlockTables<&CudaIdx>,
        prefill: PrefillTiles<&CudaIdx>,
        s: PagedAttnShape,
    ) -> Result<()> {
        let (
            KvCache {
                k: k_cache,
                v: v_cache,
            },
            BlockTables { seq, len, .. },
        ) = (cache, blocks);
        let PrefillTiles {
            tiles,
            n_tiles,
            decode_rows,
        } = prefill;
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        if n_tiles == 0 || !self.use_mma(hd, &[o, q, k_cache, v_cache]) {
            return self.attention_paged(o, q, cache, blocks, s);
        }
        let qn = s.queries * s.heads * s.head_dim;
        need(o.len, qn, "attention_paged o")?;
        need(q.len, qn, "attention_paged q")?;
        need(seq.len, s.queries, "attention_paged seq")?;
        need(len.len, s.queries, "attention_paged len")?;
        need(tiles.len, 2 * n_tiles, "attention_paged tiles")?;
        if decode_rows > s.queries || s.block_size == 0 || s.max_blocks == 0 {
            bail!(
                "attention_paged: {decode_rows} decode rows of {}, block size {}, {} blocks per table",
                s.queries,
                s.block_size,
                s.max_blocks
            );
        }
        if decode_rows > 0 {
            let d = PagedAttnShape {
                queries: decode_rows,
                ..s
            };
            self.attention_paged(o, q, cache, blocks, d)?;
        }
        // The prefill tiles: each block's rows share its key tiles (and get the training
        // forward's bits, in either mode).
        let smem = attention_mma_smem(hd).0;
        let f = self.func_smem(attention::cuda::KERNELS, hd, "paged_prefill_mma_k", smem)?;
        let p = Paged::new(self, cache, blocks, s)?;
        let args = Args::new()
            .ptrs(&[o, q, k_cache, v_cache])
            .with(&p.blocks)
            .idx(tiles)
            .with(&p.dims)
            .f32(p.scale)
            .raw(p.err);
        self.launch(&f, (n_tiles as u32, s.heads as u32, 1), 128, smem, &args)
    }
    fn attention_paged(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        cache: KvCache<&CudaBuf>,
        blocks: BlockTables<&CudaIdx>,
        s: PagedAttnShape,
    ) -> Result<()> {
        launch_paged(self, o, q, cache, blocks, s, None)
    }
    fn attention_paged_rope(
        &self,
        o: &mut CudaBuf,
        x: PackedQkv<CudaBuf>,
        slots: Slots<&CudaIdx>,
        mut cache: KvCache<&mut CudaBuf>,
        blocks: BlockTables<&CudaIdx>,
        shape: PagedRopeShape,
    ) -> Result<()> {
        let (s, theta) = (shape.attn, shape.theta);
        let (PackedQkv { qkv, q }, Slots { pos, rows }) = (x, slots);
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let fused = !self.batch_invariant()
            && s.heads / s.kv_heads <= 16
            && hd.is_multiple_of(64)
            && self.use_mma(hd, &[qkv, cache.k, cache.v]);
        if !fused {
            self.rope_store_kv_packed(
                PackedQkv { qkv, q: &mut *q },
                slots,
                cache.reborrow(),
                s.rope(theta),
            )?;
            return self.attention_paged(o, q, cache.read(), blocks, s);
        }
        let (k_cache, v_cache) = (&*cache.k, &*cache.v);
        let kd = s.kv_heads * hd;
        need(
            qkv.len,
            s.queries * (s.heads * hd + 2 * kd),
            "attention_paged_rope qkv",
        )?;
        need(pos.len, s.queries, "attention_paged_rope pos")?;
        need(rows.len, s.queries, "attention_paged_rope rows")?;
        let rope = PagedRope {
            pos,
            rows,
            cache_rows: (k_cache.len.min(v_cache.len) / kd) as i64,
            fr: freqs(hd, theta),
        };
        launch_paged(self, o, qkv, cache.read(), blocks, s, Some(rope))
    }
}
