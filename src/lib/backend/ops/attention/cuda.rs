//! The attention launchers (kernels in `attention.cu`): the tensor-core kernels for bf16 with
//! head_dim a multiple of 16 up to 128 (unless `set_tensor_core_attention(false)`), the scalar
//! tiled kernels otherwise.

use anyhow::{bail, Result};

use super::{AttentionOps, AttnOut, AttnShape, Qkv};
use crate::backend::cuda::nvrtc::{attention_tile, Family};
use crate::backend::cuda::{i32_of, need, CudaBackend, CudaBuf, CudaIdx, THREADS};
use crate::backend::{DType, Device};

pub const KERNELS: Family = Family {
    name: "attention",
    src: include_str!("attention.cu"),
    per_head_dim: true,
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

fn shape_args(s: AttnShape) -> Result<(i32, i32, i32, i32)> {
    Ok((
        i32_of(s.tokens, "tokens")?,
        i32_of(s.seqs, "seqs")?,
        i32_of(s.heads, "heads")?,
        i32_of(s.kv_heads, "kv_heads")?,
    ))
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
        let (hd, group) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let _ = group;
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
        let (obf, lbf, qbf, kbf, vbf) = (o.bf(), lse.bf(), q.bf(), k.bf(), v.bf());
        let (t, sq, h, kh) = shape_args(s)?;
        let scale = 1.0 / (hd as f32).sqrt();
        if self.use_mma(hd, &[o, q, k, v]) {
            let f = self.func_smem(KERNELS, hd, "attn_fwd_mma_k", attention_mma_smem(hd).0)?;
            return self.launch(
                &f,
                (s.tokens.div_ceil(64) as u32, s.heads as u32, 1),
                128,
                attention_mma_smem(hd).0,
                &[
                    &o.ptr,
                    &lse.ptr,
                    &lbf,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            );
        }
        let tile = attention_tile(hd);
        let (smem, _, _) = attention_smem(hd);
        let f = self.func_smem(KERNELS, hd, "attn_fwd_k", smem)?;
        self.launch(
            &f,
            (s.tokens.div_ceil(tile) as u32, s.heads as u32, 1),
            256,
            smem,
            &[
                &o.ptr,
                &obf,
                &lse.ptr,
                &lbf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )
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
        let Qkv {
            q: dq,
            k: dk,
            v: dv,
        } = dx;
        let (Qkv { q, k, v }, AttnOut { o, lse }) = (x, out);
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        need(dq.len, qn, "attention dq")?;
        need(dk.len, kn, "attention dk")?;
        need(dv.len, kn, "attention dv")?;
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
            self.fill(dq, qn, 0.0)?;
            self.fill(dk, kn, 0.0)?;
            return self.fill(dv, kn, 0.0);
        }
        let tile = attention_tile(hd);
        let (_, smem_dkdv, smem_dq) = attention_smem(hd);
        let (t, sq, h, kh) = shape_args(s)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let rows = s.tokens * s.heads;
        let dd = self.temp(rows, DType::F32)?;
        let (dobf, obf, qbf, kbf, vbf, lbf) = (dout.bf(), o.bf(), q.bf(), k.bf(), v.bf(), lse.bf());
        let f = self.func(KERNELS, hd, "attn_bwd_prep_k")?;
        self.launch(
            &f,
            ((rows * 32).div_ceil(THREADS as usize) as u32, 1, 1),
            THREADS,
            0,
            &[&dd.ptr, &dout.ptr, &dobf, &o.ptr, &obf, &t, &h],
        )?;
        if self.use_mma(hd, &[dq, dk, dv, dout, q, k, v]) {
            let (_, smem_dkdv, smem_dq) = attention_mma_smem(hd);
            let tiles = s.tokens.div_ceil(64) as u32;
            // Per query head dK/dV in f32, then summed over each kv head's group.
            let (dkp, dvp) = (self.temp(qn, DType::F32)?, self.temp(qn, DType::F32)?);
            let f = self.func_smem(KERNELS, hd, "attn_bwd_dkdv_mma_k", smem_dkdv)?;
            self.launch(
                &f,
                (tiles, s.heads as u32, 1),
                128,
                smem_dkdv,
                &[
                    &dkp.ptr,
                    &dvp.ptr,
                    &dout.ptr,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &lse.ptr,
                    &lbf,
                    &dd.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            )?;
            let f = self.func(KERNELS, hd, "attn_bwd_group_sum_k")?;
            let (dkbf, dvbf) = (dk.bf(), dv.bf());
            self.launch(
                &f,
                (self.stride_blocks(kn), 1, 1),
                THREADS,
                0,
                &[
                    &dk.ptr, &dkbf, &dv.ptr, &dvbf, &dkp.ptr, &dvp.ptr, &t, &h, &kh,
                ],
            )?;
            let f = self.func_smem(KERNELS, hd, "attn_bwd_dq_mma_k", smem_dq)?;
            return self.launch(
                &f,
                (tiles, s.heads as u32, 1),
                128,
                smem_dq,
                &[
                    &dq.ptr,
                    &dout.ptr,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &lse.ptr,
                    &lbf,
                    &dd.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            );
        }
        let tiles = s.tokens.div_ceil(tile) as u32;
        let f = self.func_smem(KERNELS, hd, "attn_bwd_dkdv_k", smem_dkdv)?;
        let (dkbf, dvbf, dqbf) = (dk.bf(), dv.bf(), dq.bf());
        self.launch(
            &f,
            (tiles, s.kv_heads as u32, 1),
            256,
            smem_dkdv,
            &[
                &dk.ptr,
                &dkbf,
                &dv.ptr,
                &dvbf,
                &dout.ptr,
                &dobf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &lse.ptr,
                &lbf,
                &dd.ptr,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )?;
        let f = self.func_smem(KERNELS, hd, "attn_bwd_dq_k", smem_dq)?;
        self.launch(
            &f,
            (tiles, s.heads as u32, 1),
            256,
            smem_dq,
            &[
                &dq.ptr,
                &dqbf,
                &dout.ptr,
                &dobf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &lse.ptr,
                &lbf,
                &dd.ptr,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )
    }
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
