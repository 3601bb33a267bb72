//! The rope launchers (kernels in `rope.cu`): the inverse frequencies go to the kernels by
//! value, computed on the host as the CPU reference computes them.

use anyhow::{bail, Result};

use super::{inv_freq, PackedQkv, RopeKvShape, RopeOps, RopeShape, Slots, MAX_HEAD_DIM};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, karg, need, CudaBackend, CudaBuf, CudaIdx};
use crate::backend::KvCache;

pub const KERNELS: Family = Family {
    name: "rope",
    src: include_str!("rope.cu"),
    per_head_dim: false,
};

/// Tokens per block of `rope_store_kv_packed_k` (RPB in rope.cu).
const ROPE_TOKENS_PER_BLOCK: usize = 4;

/// The rope kernels' inverse frequencies, passed by value (`struct Freqs { float f[512]; }` in
/// common.cuh).
#[repr(C)]
pub(crate) struct Freqs([f32; MAX_HEAD_DIM / 2]);
karg!(Freqs);

/// The rope kernels' inverse frequencies for a head dim and base.
pub(crate) fn freqs(head_dim: usize, theta: f32) -> Freqs {
    let mut fr = Freqs([0.0; MAX_HEAD_DIM / 2]);
    for (i, f) in fr.0.iter_mut().take(head_dim / 2).enumerate() {
        *f = inv_freq(i, head_dim, theta);
    }
    fr
}

/// The rope kernels' head_dim limits: even (pairs i, i + d/2) and at most [`MAX_HEAD_DIM`].
fn check_head_dim(head_dim: usize) -> Result<()> {
    if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        bail!("rope: head_dim {head_dim} must be even and at most {MAX_HEAD_DIM}");
    }
    Ok(())
}

/// rope_k in place; `sign` −1 rotates backwards (the backward pass).
fn rope_dir(
    be: &CudaBackend,
    x: &mut CudaBuf,
    pos: &CudaIdx,
    s: RopeShape,
    sign: f32,
) -> Result<()> {
    let RopeShape {
        tokens,
        heads,
        head_dim,
        theta,
    } = s;
    check_head_dim(head_dim)?;
    need(x.len, tokens * heads * head_dim, "rope x")?;
    need(pos.len, tokens, "rope pos")?;
    if tokens == 0 || heads * head_dim == 0 {
        return Ok(());
    }
    let fr = freqs(head_dim, theta);
    let f = be.func(KERNELS, 0, "rope_k")?;
    let xbf = x.bf();
    let (t, h, d) = (
        i32_of(tokens, "tokens")?,
        i32_of(heads, "heads")?,
        head_dim as i32,
    );
    be.launch(
        &f,
        (tokens as u32, 1, 1),
        CudaBackend::row_threads(heads * head_dim / 2),
        0,
        &[&x.ptr, &xbf, &pos.ptr, &t, &h, &d, &sign, &fr],
    )
}

impl RopeOps for CudaBackend {
    fn rope(&self, x: &mut CudaBuf, pos: &CudaIdx, s: RopeShape) -> Result<()> {
        rope_dir(self, x, pos, s, 1.0)
    }
    fn rope_backward(&self, dx: &mut CudaBuf, pos: &CudaIdx, s: RopeShape) -> Result<()> {
        rope_dir(self, dx, pos, s, -1.0)
    }
    fn rope_store_kv(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        slots: Slots<&CudaIdx>,
        cache: KvCache<&mut CudaBuf>,
        s: RopeKvShape,
    ) -> Result<()> {
        let (
            Slots { pos, rows },
            KvCache {
                k: k_cache,
                v: v_cache,
            },
        ) = (slots, cache);
        let RopeKvShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            theta,
        } = s;
        check_head_dim(head_dim)?;
        let kd = kv_heads * head_dim;
        need(q.len, tokens * heads * head_dim, "rope_store_kv q")?;
        need(k.len, tokens * kd, "rope_store_kv k")?;
        need(v.len, tokens * kd, "rope_store_kv v")?;
        need(pos.len, tokens, "rope_store_kv pos")?;
        need(rows.len, tokens, "rope_store_kv rows")?;
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        let fr = freqs(head_dim, theta);
        let f = self.func(KERNELS, 0, "rope_store_kv_k")?;
        let (qbf, kbf, vbf, kcbf, vcbf) = (q.bf(), k.bf(), v.bf(), k_cache.bf(), v_cache.bf());
        let (t, h, kh, d) = (
            i32_of(tokens, "tokens")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            head_dim as i32,
        );
        let cache_rows = (k_cache.len.min(v_cache.len) / kd) as i64;
        let err = self.err_ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads((heads + kv_heads) * head_dim / 2),
            0,
            &[
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &pos.ptr,
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &rows.ptr,
                &t,
                &h,
                &kh,
                &d,
                &cache_rows,
                &fr,
                &err,
            ],
        )
    }
    fn rope_store_kv_packed(
        &self,
        x: PackedQkv<CudaBuf>,
        slots: Slots<&CudaIdx>,
        cache: KvCache<&mut CudaBuf>,
        s: RopeKvShape,
    ) -> Result<()> {
        let (PackedQkv { qkv, q: q_out }, Slots { pos, rows }) = (x, slots);
        let KvCache {
            k: k_cache,
            v: v_cache,
        } = cache;
        let RopeKvShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            theta,
        } = s;
        check_head_dim(head_dim)?;
        let (qd, kd) = (heads * head_dim, kv_heads * head_dim);
        need(qkv.len, tokens * (qd + 2 * kd), "rope_store_kv_packed qkv")?;
        need(q_out.len, tokens * qd, "rope_store_kv_packed q")?;
        need(pos.len, tokens, "rope_store_kv_packed pos")?;
        need(rows.len, tokens, "rope_store_kv_packed rows")?;
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        let fr = freqs(head_dim, theta);
        let f = self.func(KERNELS, 0, "rope_store_kv_packed_k")?;
        let (xbf, qbf, kcbf, vcbf) = (qkv.bf(), q_out.bf(), k_cache.bf(), v_cache.bf());
        let (t, h, kh, d) = (
            i32_of(tokens, "tokens")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            head_dim as i32,
        );
        let cache_rows = (k_cache.len.min(v_cache.len) / kd) as i64;
        let err = self.err_ptr();
        self.launch(
            &f,
            (tokens.div_ceil(ROPE_TOKENS_PER_BLOCK) as u32, 1, 1),
            Self::row_threads((heads + kv_heads) * head_dim / 2),
            0,
            &[
                &qkv.ptr,
                &xbf,
                &q_out.ptr,
                &qbf,
                &pos.ptr,
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &rows.ptr,
                &t,
                &h,
                &kh,
                &d,
                &cache_rows,
                &fr,
                &err,
            ],
        )
    }
}
