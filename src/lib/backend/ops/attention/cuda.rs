//! The attention launchers (kernels in `attention.cu`): the tensor-core kernels for bf16 with
//! head_dim a multiple of 16 up to 128 (unless `set_tensor_core_attention(false)`), the scalar
//! tiled kernels otherwise.

use anyhow::{bail, Result};

use super::{AttentionOps, AttnOut, AttnShape, Qkv};
use crate::backend::cuda::nvrtc::{attention_tile, Family};
use crate::backend::cuda::{i32_of, need, ArgGroup, Args, CudaBackend, CudaBuf, CudaIdx, THREADS};
use crate::backend::{DType, Device};

/// The forward kernels (packed, tensor-core and paged): what generation and scoring run.
pub(crate) const KERNELS: Family = Family {
    name: "attention",
    src: concat!("#define ATTN_PART 1\n", include_str!("attention.cu")),
    per_head_dim: true,
    training_only: false,
};

/// The backward kernels, a program of their own: a process that only generates never waits
/// for them to compile (they take most of the file's NVRTC time).
pub(crate) const BWD_KERNELS: Family = Family {
    name: "attention_bwd",
    src: concat!("#define ATTN_PART 2\n", include_str!("attention.cu")),
    per_head_dim: true,
    training_only: true,
};

/// Bytes of dynamic shared memory of the attention kernels for a head dim.
pub(crate) fn attention_smem(head_dim: usize) -> (u32, u32, u32) {
    let tile = attention_tile(head_dim);
    let (lds, ldp) = (head_dim + 1, tile + 1);
    let f = |tiles: usize, ptiles: usize| ((tiles * tile * lds + ptiles * tile * ldp) * 4) as u32;
    // forward: Q, K, V + P; dK/dV: K, V, Q, dO + P, dS; dQ: Q, dO, K, V + dS.
    (f(3, 1), f(4, 2), f(4, 1))
}

/// Bytes of dynamic shared memory of the tensor-core attention kernels (bf16 tiles with rows
/// padded by 8 elements; see the TQ/TK/TKB/TQB/TKQ tiles in attention.cu).
pub(crate) fn attention_mma_smem(head_dim: usize) -> (u32, u32, u32) {
    let kst = head_dim + 8;
    let tst = |n: usize| n + 8;
    let fwd = 64 * kst + 64 * kst + head_dim * tst(64);
    let dkdv = 2 * 64 * kst + 2 * 32 * kst + 2 * head_dim * tst(32);
    let dq = 2 * 64 * kst + 2 * 32 * kst + head_dim * tst(32);
    ((fwd * 2) as u32, (dkdv * 2) as u32, (dq * 2) as u32)
}

/// Dynamic shared memory of `paged_attn_inv_k`: the group's query rows, then two buffers of
/// a key tile and its value tile transposed (TK = 64 keys, bf16; attention.cu).
pub(crate) fn paged_inv_smem(head_dim: usize) -> u32 {
    let kst = head_dim + 8;
    ((16 * kst + 2 * (64 * kst + head_dim * (64 + 8))) * 2) as u32
}

/// Validates heads/kv_heads/head_dim for the attention kernels; returns (head_dim, group).
pub(crate) fn check_attn(heads: usize, kv_heads: usize, head_dim: usize) -> Result<(usize, usize)> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("attention: {heads} query heads cannot be grouped over {kv_heads} kv heads");
    }
    if head_dim == 0 || head_dim > 256 {
        bail!("attention: head_dim {head_dim} is not supported by the cuda kernels (1..=256)");
    }
    Ok((head_dim, heads / kv_heads))
}

/// The arguments every training attention kernel ends with: `const u32* cu, int tokens,
/// int seqs, int heads, int kv_heads, float scale`.
struct Seqs<'a> {
    cu: &'a CudaIdx,
    tokens: i32,
    seqs: i32,
    heads: i32,
    kv_heads: i32,
    scale: f32,
}

impl<'a> Seqs<'a> {
    fn new(s: AttnShape, cu: &'a CudaIdx) -> Result<Self> {
        Ok(Seqs {
            cu,
            tokens: i32_of(s.tokens, "tokens")?,
            seqs: i32_of(s.seqs, "seqs")?,
            heads: i32_of(s.heads, "heads")?,
            kv_heads: i32_of(s.kv_heads, "kv_heads")?,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
        })
    }
}

impl ArgGroup for Seqs<'_> {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a> {
        a.idx(self.cu)
            .i32(self.tokens)
            .i32(self.seqs)
            .i32(self.heads)
            .i32(self.kv_heads)
            .f32(self.scale)
    }
}

/// What the backward kernels read after their outputs: dout, q, k, v (each with its type tag
/// for the scalar kernels, bf16 by address for the tensor-core ones), lse with its tag, dd,
/// then [`Seqs`].
struct Saved<'a> {
    dout: &'a CudaBuf,
    x: Qkv<&'a CudaBuf>,
    lse: &'a CudaBuf,
    dd: &'a CudaBuf,
    seqs: Seqs<'a>,
    mma: bool,
}

impl ArgGroup for Saved<'_> {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a> {
        let Qkv { q, k, v } = self.x;
        let ins = [self.dout, q, k, v];
        let a = if self.mma { a.ptrs(&ins) } else { a.bufs(&ins) };
        a.buf(self.lse).ptr(self.dd).with(&self.seqs)
    }
}

impl AttentionOps for CudaBackend {
    fn attention(
        &self,
        out: AttnOut<&mut CudaBuf>,
        x: Qkv<&CudaBuf>,
        cu_seqlens: &CudaIdx,
        s: AttnShape,
    ) -> Result<()> {
        let (AttnOut { o, lse }, Qkv { q, k, v }) = (out, x);
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        need(o.len, qn, "attention o")?;
        need(lse.len, s.tokens * s.heads, "attention lse")?;
        need(q.len, qn, "attention q")?;
        need(k.len, kn, "attention k")?;
        need(v.len, kn, "attention v")?;
        need(cu_seqlens.len, s.seqs + 1, "attention cu_seqlens")?;
        if s.tokens == 0 || s.seqs == 0 {
            return Ok(());
        }
        let seqs = Seqs::new(s, cu_seqlens)?;
        if self.use_mma(hd, &[o, q, k, v]) {
            let smem = attention_mma_smem(hd).0;
            let f = self.func_smem(KERNELS, hd, "attn_fwd_mma_k", smem)?;
            let args = Args::new().ptr(o).buf(lse).ptrs(&[q, k, v]).with(&seqs);
            let grid = (s.tokens.div_ceil(64) as u32, s.heads as u32, 1);
            return self.launch(&f, grid, 128, smem, &args);
        }
        let (smem, _, _) = attention_smem(hd);
        let f = self.func_smem(KERNELS, hd, "attn_fwd_k", smem)?;
        let args = Args::new().bufs(&[o, lse, q, k, v]).with(&seqs);
        let grid = (
            s.tokens.div_ceil(attention_tile(hd)) as u32,
            s.heads as u32,
            1,
        );
        self.launch(&f, grid, 256, smem, &args)
    }
    fn attention_backward(
        &self,
        dx: Qkv<&mut CudaBuf>,
        dout: &CudaBuf,
        x: Qkv<&CudaBuf>,
        out: AttnOut<&CudaBuf>,
        cu_seqlens: &CudaIdx,
        s: AttnShape,
    ) -> Result<()> {
        let (Qkv { q, k, v }, AttnOut { o, lse }) = (x, out);
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        need(dx.q.len, qn, "attention dq")?;
        need(dx.k.len, kn, "attention dk")?;
        need(dx.v.len, kn, "attention dv")?;
        need(dout.len, qn, "attention dout")?;
        need(q.len, qn, "attention q")?;
        need(k.len, kn, "attention k")?;
        need(v.len, kn, "attention v")?;
        need(o.len, qn, "attention o")?;
        need(lse.len, s.tokens * s.heads, "attention lse")?;
        need(cu_seqlens.len, s.seqs + 1, "attention cu_seqlens")?;
        if s.tokens == 0 {
            return Ok(());
        }
        if s.seqs == 0 {
            self.fill(dx.q, qn, 0.0)?;
            self.fill(dx.k, kn, 0.0)?;
            return self.fill(dx.v, kn, 0.0);
        }
        let seqs = Seqs::new(s, cu_seqlens)?;
        let dd = backward_prep(self, dout, o, s)?;
        let saved = Saved {
            dout,
            x: Qkv { q, k, v },
            lse,
            dd: &dd,
            seqs,
            mma: self.use_mma(hd, &[dx.q, dx.k, dx.v, dout, q, k, v]),
        };
        launch_backward(self, dx, &saved, s)
    }
}

/// dd = rowsum(dO∘O) per query and head (f32), which both backward kernels read.
fn backward_prep(be: &CudaBackend, dout: &CudaBuf, o: &CudaBuf, s: AttnShape) -> Result<CudaBuf> {
    let rows = s.tokens * s.heads;
    let dd = be.temp(rows, DType::F32)?;
    let f = be.func(BWD_KERNELS, s.head_dim, "attn_bwd_prep_k")?;
    let args = Args::new()
        .ptr(&dd)
        .buf(dout)
        .buf(o)
        .i32(i32_of(s.tokens, "tokens")?)
        .i32(i32_of(s.heads, "heads")?);
    let grid = ((rows * 32).div_ceil(THREADS as usize) as u32, 1, 1);
    be.launch(&f, grid, THREADS, 0, &args)?;
    Ok(dd)
}

/// The backward's kernels: on the tensor cores dK/dV per query head in f32, summed over each
/// kv head's group, then dQ; with the scalar tiles dK/dV per kv head, then dQ.
fn launch_backward(
    be: &CudaBackend,
    dx: Qkv<&mut CudaBuf>,
    saved: &Saved,
    s: AttnShape,
) -> Result<()> {
    let hd = s.head_dim;
    if !saved.mma {
        let (_, smem_dkdv, smem_dq) = attention_smem(hd);
        let tiles = s.tokens.div_ceil(attention_tile(hd)) as u32;
        let f = be.func_smem(BWD_KERNELS, hd, "attn_bwd_dkdv_k", smem_dkdv)?;
        let args = Args::new().buf(dx.k).buf(dx.v).with(saved);
        be.launch(&f, (tiles, s.kv_heads as u32, 1), 256, smem_dkdv, &args)?;
        let f = be.func_smem(BWD_KERNELS, hd, "attn_bwd_dq_k", smem_dq)?;
        let args = Args::new().buf(dx.q).with(saved);
        return be.launch(&f, (tiles, s.heads as u32, 1), 256, smem_dq, &args);
    }
    let (_, smem_dkdv, smem_dq) = attention_mma_smem(hd);
    let grid = (s.tokens.div_ceil(64) as u32, s.heads as u32, 1);
    let qn = s.tokens * s.heads * hd;
    let (dkp, dvp) = (be.temp(qn, DType::F32)?, be.temp(qn, DType::F32)?);
    let f = be.func_smem(BWD_KERNELS, hd, "attn_bwd_dkdv_mma_k", smem_dkdv)?;
    let args = Args::new().ptr(&dkp).ptr(&dvp).with(saved);
    be.launch(&f, grid, 128, smem_dkdv, &args)?;
    let f = be.func(BWD_KERNELS, hd, "attn_bwd_group_sum_k")?;
    let Seqs {
        tokens,
        heads,
        kv_heads,
        ..
    } = saved.seqs;
    let args = Args::new()
        .buf(dx.k)
        .buf(dx.v)
        .ptr(&dkp)
        .ptr(&dvp)
        .i32(tokens)
        .i32(heads)
        .i32(kv_heads);
    let kn = s.tokens * s.kv_heads * hd;
    be.launch(&f, (be.stride_blocks(kn), 1, 1), THREADS, 0, &args)?;
    let f = be.func_smem(BWD_KERNELS, hd, "attn_bwd_dq_mma_k", smem_dq)?;
    be.launch(&f, grid, 128, smem_dq, &Args::new().ptr(dx.q).with(saved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_shared_memory_fits_hopper() {
        // 227 KiB of opt-in shared memory per block on sm_90, less the kernels' static arrays.
        for hd in [8, 64, 96, 128, 192, 256] {
            let (a, b, c) = attention_smem(hd);
            assert!(
                a.max(b).max(c) <= 227 * 1024 - 1024,
                "head_dim {hd}: {a} {b} {c}"
            );
        }
        // Forward with head_dim 64: Q, K, V tiles of 64×65 floats and P of 64×65.
        assert_eq!(attention_smem(64).0, (3 * 64 * 65 + 64 * 65) * 4);
    }

    #[test]
    fn tensor_core_attention_shared_memory_fits_hopper() {
        for hd in [16, 64, 96, 128] {
            let (a, b, c) = attention_mma_smem(hd);
            assert!(
                a.max(b).max(c) <= 227 * 1024 - 1024,
                "head_dim {hd}: {a} {b} {c}"
            );
        }
        // Forward, head_dim 64: Q and K tiles of 64×72 bf16 and Vᵀ of 64×72.
        assert_eq!(attention_mma_smem(64).0, 3 * 64 * 72 * 2);
        // The batch-invariant decode kernel: 16 query rows and two K/Vᵀ tile buffers.
        assert!(paged_inv_smem(128) <= 227 * 1024 - 1024);
        assert_eq!(
            paged_inv_smem(64),
            ((16 * 72 + 2 * (64 * 72 + 64 * 72)) * 2) as u32
        );
    }

    #[test]
    fn head_layouts_the_kernels_refuse() {
        assert_eq!(check_attn(14, 2, 64).unwrap(), (64, 7));
        assert!(check_attn(14, 4, 64).is_err(), "14 heads over 4 kv heads");
        assert!(check_attn(4, 0, 64).is_err());
        assert!(check_attn(4, 2, 0).is_err() && check_attn(4, 2, 512).is_err());
    }
}
