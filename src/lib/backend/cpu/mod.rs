//! The f32 CPU backend: the reference every other backend is checked against, and the path CI
//! runs. Buffers are `Vec<f32>` / `Vec<u32>`; every op family lives in its own file as plain
//! functions over slices (forward and backward side by side), multithreaded with rayon; GEMMs
//! go through the `gemm` crate. This file only checks sizes and dispatches.

pub mod attention;
pub mod embedding;
pub mod logprob;
pub mod loss;
pub mod matmul;
pub mod optim;
pub mod paged;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{
    AdamWStep, AttnShape, Backend, CachedAttnShape, LogprobShape, PagedAttnShape, PpoShape,
    PPO_STATS,
};

/// The CPU backend. It holds no state: threads come from rayon's global pool
/// (`RAYON_NUM_THREADS` sets their number).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// Elements per rayon task in elementwise loops: large enough that scheduling is noise.
pub(crate) const ELEMWISE_GRAIN: usize = 1 << 14;

/// A raw pointer that rayon tasks share when each task writes a region no other task touches.
/// Used where the disjoint regions are not contiguous chunks (attention heads, column blocks).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointer is only dereferenced through `slice`, whose callers guarantee that
// concurrent tasks access disjoint ranges while the owning `&mut [f32]` is borrowed.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(s: &mut [f32]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// # Safety
    /// No other live reference (from any thread) may overlap `off..off + len`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, off: usize, len: usize) -> &mut [f32] {
        assert!(off + len <= self.len, "SharedMut out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(off), len)
    }
}

fn get<'a, T>(buf: &'a [T], n: usize, what: &str) -> Result<&'a [T]> {
    if buf.len() < n {
        bail!(
            "cpu backend: {what} holds {} elements, the op needs {n}",
            buf.len()
        );
    }
    Ok(&buf[..n])
}

fn get_mut<'a, T>(buf: &'a mut [T], n: usize, what: &str) -> Result<&'a mut [T]> {
    if buf.len() < n {
        bail!(
            "cpu backend: {what} holds {} elements, the op needs {n}",
            buf.len()
        );
    }
    Ok(&mut buf[..n])
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Idx = Vec<u32>;

    fn name(&self) -> String {
        "cpu".into()
    }

    /// Always: every row is computed on its own, in the same order whatever shares the call.
    fn batch_invariant(&self) -> bool {
        true
    }

    fn alloc(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn alloc_idx(&self, n: usize) -> Result<Vec<u32>> {
        Ok(vec![0; n])
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn len_idx(&self, buf: &Vec<u32>) -> usize {
        buf.len()
    }

    fn upload(&self, dst: &mut Vec<f32>, src: &[f32]) -> Result<()> {
        get_mut(dst, src.len(), "upload destination")?.copy_from_slice(src);
        Ok(())
    }

    fn upload_idx(&self, dst: &mut Vec<u32>, src: &[u32]) -> Result<()> {
        get_mut(dst, src.len(), "upload destination")?.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(get(src, dst.len(), "download source")?);
        Ok(())
    }

    fn fill(&self, buf: &mut Vec<f32>, n: usize, value: f32) -> Result<()> {
        get_mut(buf, n, "fill")?
            .par_chunks_mut(ELEMWISE_GRAIN)
            .for_each(|c| c.fill(value));
        Ok(())
    }

    fn copy(
        &self,
        dst: &mut Vec<f32>,
        dst_off: usize,
        src: &Vec<f32>,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        let s = &get(src, src_off + n, "copy source")?[src_off..];
        let d = &mut get_mut(dst, dst_off + n, "copy destination")?[dst_off..];
        d.par_chunks_mut(ELEMWISE_GRAIN)
            .zip(s.par_chunks(ELEMWISE_GRAIN))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    }

    fn copy_within(
        &self,
        buf: &mut Vec<f32>,
        dst_off: usize,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        if dst_off.max(src_off) + n > buf.len() || (dst_off < src_off + n && src_off < dst_off + n)
        {
            bail!(
                "cpu backend: copy_within {src_off}..+{n} to {dst_off} in a buffer of {} floats",
                buf.len()
            );
        }
        buf.copy_within(src_off..src_off + n, dst_off);
        Ok(())
    }

    fn add_assign(&self, y: &mut Vec<f32>, x: &Vec<f32>, n: usize) -> Result<()> {
        let x = get(x, n, "x")?;
        get_mut(y, n, "y")?
            .par_chunks_mut(ELEMWISE_GRAIN)
            .zip(x.par_chunks(ELEMWISE_GRAIN))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, x)| *y += x));
        Ok(())
    }

    fn matmul(
        &self,
        y: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: Option<&Vec<f32>>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let b = match b {
            Some(b) => Some(get(b, n, "bias")?),
            None => None,
        };
        matmul::forward(
            get_mut(y, m * n, "matmul y")?,
            get(x, m * k, "matmul x")?,
            get(w, n * k, "matmul w")?,
            b,
            m,
            k,
            n,
            accumulate,
        );
        Ok(())
    }

    fn matmul_backward_x(
        &self,
        dx: &mut Vec<f32>,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        matmul::backward_x(
            get_mut(dx, m * k, "matmul dx")?,
            get(dy, m * n, "matmul dy")?,
            get(w, n * k, "matmul w")?,
            m,
            k,
            n,
            accumulate,
        );
        Ok(())
    }

    fn matmul_backward_w(
        &self,
        dw: &mut Vec<f32>,
        db: Option<&mut Vec<f32>>,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let db = match db {
            Some(db) => Some(get_mut(db, n, "matmul db")?),
            None => None,
        };
        matmul::backward_w(
            get_mut(dw, n * k, "matmul dw")?,
            db,
            get(dy, m * n, "matmul dy")?,
            get(x, m * k, "matmul x")?,
            m,
            k,
            n,
        );
        Ok(())
    }

    fn embedding(
        &self,
        out: &mut Vec<f32>,
        table: &Vec<f32>,
        ids: &Vec<u32>,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        embedding::forward(
            get_mut(out, tokens * dim, "embedding out")?,
            table,
            get(ids, tokens, "embedding ids")?,
            dim,
        )
    }

    fn embedding_backward(
        &self,
        dtable: &mut Vec<f32>,
        dout: &Vec<f32>,
        ids: &Vec<u32>,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        embedding::backward(
            dtable,
            get(dout, tokens * dim, "embedding dout")?,
            get(ids, tokens, "embedding ids")?,
            dim,
        )
    }

    fn rmsnorm(
        &self,
        y: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        rmsnorm::forward(
            get_mut(y, rows * dim, "rmsnorm y")?,
            get_mut(rstd, rows, "rmsnorm rstd")?,
            get(x, rows * dim, "rmsnorm x")?,
            get(w, dim, "rmsnorm w")?,
            dim,
            eps,
        );
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        rmsnorm::backward(
            get_mut(dx, rows * dim, "rmsnorm dx")?,
            get_mut(dw, dim, "rmsnorm dw")?,
            get(dy, rows * dim, "rmsnorm dy")?,
            get(x, rows * dim, "rmsnorm x")?,
            get(w, dim, "rmsnorm w")?,
            get(rstd, rows, "rmsnorm rstd")?,
            dim,
            accumulate,
        );
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        pos: &Vec<u32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        rope::apply(
            get_mut(x, tokens * heads * head_dim, "rope x")?,
            get(pos, tokens, "rope positions")?,
            heads,
            head_dim,
            theta,
            false,
        )
    }

    fn rope_backward(
        &self,
        dx: &mut Vec<f32>,
        pos: &Vec<u32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        rope::apply(
            get_mut(dx, tokens * heads * head_dim, "rope dx")?,
            get(pos, tokens, "rope positions")?,
            heads,
            head_dim,
            theta,
            true,
        )
    }

    fn attention(
        &self,
        o: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        cu_seqlens: &Vec<u32>,
        s: AttnShape,
    ) -> Result<()> {
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        attention::forward(
            get_mut(o, qn, "attention o")?,
            get_mut(lse, s.tokens * s.heads, "attention lse")?,
            get(q, qn, "attention q")?,
            get(k, kn, "attention k")?,
            get(v, kn, "attention v")?,
            get(cu_seqlens, s.seqs + 1, "attention cu_seqlens")?,
            s,
        )
    }

    fn attention_backward(
        &self,
        dq: &mut Vec<f32>,
        dk: &mut Vec<f32>,
        dv: &mut Vec<f32>,
        dout: &Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        o: &Vec<f32>,
        lse: &Vec<f32>,
        cu_seqlens: &Vec<u32>,
        s: AttnShape,
    ) -> Result<()> {
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        attention::backward(
            attention::Grads {
                dq: get_mut(dq, qn, "attention dq")?,
                dk: get_mut(dk, kn, "attention dk")?,
                dv: get_mut(dv, kn, "attention dv")?,
            },
            get(dout, qn, "attention dout")?,
            get(q, qn, "attention q")?,
            get(k, kn, "attention k")?,
            get(v, kn, "attention v")?,
            get(o, qn, "attention o")?,
            get(lse, s.tokens * s.heads, "attention lse")?,
            get(cu_seqlens, s.seqs + 1, "attention cu_seqlens")?,
            s,
        )
    }

    fn kv_store(
        &self,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        row_dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "kv_store rows")?;
        attention::kv_store(k_cache, get(k, n * row_dim, "kv_store k")?, rows, row_dim)?;
        attention::kv_store(v_cache, get(v, n * row_dim, "kv_store v")?, rows, row_dim)
    }

    fn attention_cached(
        &self,
        o: &mut Vec<f32>,
        q: &Vec<f32>,
        k_cache: &Vec<f32>,
        v_cache: &Vec<f32>,
        base: &Vec<u32>,
        len: &Vec<u32>,
        s: CachedAttnShape,
    ) -> Result<()> {
        let qn = s.queries * s.heads * s.head_dim;
        attention::cached(
            get_mut(o, qn, "attention o")?,
            get(q, qn, "attention q")?,
            k_cache,
            v_cache,
            get(base, s.queries, "attention base")?,
            get(len, s.queries, "attention len")?,
            s,
        )
    }

    fn swiglu(&self, h: &mut Vec<f32>, g: &Vec<f32>, u: &Vec<f32>, n: usize) -> Result<()> {
        swiglu::forward(
            get_mut(h, n, "swiglu h")?,
            get(g, n, "swiglu g")?,
            get(u, n, "swiglu u")?,
        );
        Ok(())
    }

    fn swiglu_backward(
        &self,
        dg: &mut Vec<f32>,
        du: &mut Vec<f32>,
        dh: &Vec<f32>,
        g: &Vec<f32>,
        u: &Vec<f32>,
        n: usize,
    ) -> Result<()> {
        swiglu::backward(
            get_mut(dg, n, "swiglu dg")?,
            get_mut(du, n, "swiglu du")?,
            get(dh, n, "swiglu dh")?,
            get(g, n, "swiglu g")?,
            get(u, n, "swiglu u")?,
        );
        Ok(())
    }

    fn gather_rows(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "gather rows")?;
        let out = get_mut(out, n * dim, "gather out")?;
        if let Some(&r) = rows.iter().find(|&&r| (r as usize + 1) * dim > x.len()) {
            bail!(
                "cpu backend: gather row {r} outside a buffer of {} floats",
                x.len()
            );
        }
        out.par_chunks_mut(dim.max(1))
            .zip(rows.par_iter())
            .for_each(|(o, &r)| o.copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]));
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        dx: &mut Vec<f32>,
        dout: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "scatter rows")?;
        let dout = get(dout, n * dim, "scatter dout")?;
        // Serial: rows may repeat in general, and this is a memory-bound copy of n·dim floats.
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            if (r + 1) * dim > dx.len() {
                bail!(
                    "cpu backend: scatter row {r} outside a buffer of {} floats",
                    dx.len()
                );
            }
            dx[r * dim..(r + 1) * dim]
                .iter_mut()
                .zip(&dout[i * dim..(i + 1) * dim])
                .for_each(|(d, g)| *d += g);
        }
        Ok(())
    }

    fn logprob(
        &self,
        lp: &mut Vec<f32>,
        ent: Option<&mut Vec<f32>>,
        lse: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        s: LogprobShape,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let ent = match ent {
            Some(e) => Some(get_mut(e, s.rows, "logprob entropy")?),
            None => None,
        };
        logprob::forward(
            get_mut(lp, s.rows, "logprob lp")?,
            ent,
            get_mut(lse, s.rows, "logprob lse")?,
            get(x, s.rows * s.hidden, "logprob x")?,
            get(w, s.vocab * s.hidden, "logprob w")?,
            get(targets, s.rows, "logprob targets")?,
            s,
            get_mut(scratch, s.chunk * s.vocab, "logprob scratch")?,
        )
    }

    fn logprob_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        targets: &Vec<u32>,
        lse: &Vec<f32>,
        ent: &Vec<f32>,
        dlp: &Vec<f32>,
        dent: Option<&Vec<f32>>,
        s: LogprobShape,
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        let dent = match dent {
            Some(d) => Some(get(d, s.rows, "logprob dent")?),
            None => None,
        };
        logprob::backward(
            logprob::BackwardArgs {
                dx: get_mut(dx, s.rows * s.hidden, "logprob dx")?,
                dw: get_mut(dw, s.vocab * s.hidden, "logprob dw")?,
                x: get(x, s.rows * s.hidden, "logprob x")?,
                w: get(w, s.vocab * s.hidden, "logprob w")?,
                targets: get(targets, s.rows, "logprob targets")?,
                lse: get(lse, s.rows, "logprob lse")?,
                ent: get(ent, s.rows, "logprob entropy")?,
                dlp: get(dlp, s.rows, "logprob dlp")?,
                dent,
            },
            s,
            get_mut(scratch, s.chunk * s.vocab, "logprob scratch")?,
        )
    }

    fn ppo_clip_loss(
        &self,
        dlp: &mut Vec<f32>,
        stats: &mut Vec<f32>,
        lp: &Vec<f32>,
        old: Option<&Vec<f32>>,
        adv: &Vec<f32>,
        w: &Vec<f32>,
        ent: Option<&Vec<f32>>,
        s: PpoShape,
    ) -> Result<()> {
        let n = s.tokens;
        let old = match old {
            Some(o) => Some(get(o, n, "ppo_clip_loss old")?),
            None => None,
        };
        let ent = match ent {
            Some(e) => Some(get(e, n, "ppo_clip_loss ent")?),
            None => None,
        };
        loss::ppo_clip_loss(
            get_mut(dlp, n, "ppo_clip_loss dlp")?,
            get_mut(stats, PPO_STATS, "ppo_clip_loss stats")?,
            get(lp, n, "ppo_clip_loss lp")?,
            old,
            get(adv, n, "ppo_clip_loss adv")?,
            get(w, 3 * n, "ppo_clip_loss w")?,
            ent,
            &s,
        );
        Ok(())
    }

    fn sum_squares(&self, x: &Vec<f32>, n: usize) -> Result<f64> {
        Ok(optim::sum_squares(get(x, n, "sum_squares x")?))
    }

    fn adamw(
        &self,
        p: &mut Vec<f32>,
        g: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        n: usize,
        step: &AdamWStep,
    ) -> Result<()> {
        optim::adamw(
            get_mut(p, n, "adamw p")?,
            get(g, n, "adamw g")?,
            get_mut(m, n, "adamw m")?,
            get_mut(v, n, "adamw v")?,
            step,
        );
        Ok(())
    }

    fn download_idx(&self, src: &Vec<u32>, dst: &mut [u32]) -> Result<()> {
        dst.copy_from_slice(get(src, dst.len(), "download source")?);
        Ok(())
    }

    fn feed_tokens(
        &self,
        ids: &mut Vec<u32>,
        prev: &Vec<u32>,
        src: &Vec<u32>,
        n: usize,
    ) -> Result<()> {
        let ids = get_mut(ids, n, "feed_tokens ids")?;
        for (i, (id, &s)) in ids
            .iter_mut()
            .zip(get(src, n, "feed_tokens src")?)
            .enumerate()
        {
            if s != super::FEED_NONE {
                *id = *prev.get(s as usize).ok_or_else(|| {
                    anyhow::anyhow!("feed_tokens: row {i} feeds draw {s} of {}", prev.len())
                })?;
            }
        }
        Ok(())
    }

    fn attention_paged(
        &self,
        o: &mut Vec<f32>,
        q: &Vec<f32>,
        k_cache: &Vec<f32>,
        v_cache: &Vec<f32>,
        tables: &Vec<u32>,
        seq: &Vec<u32>,
        len: &Vec<u32>,
        s: PagedAttnShape,
    ) -> Result<()> {
        let qn = s.queries * s.heads * s.head_dim;
        paged::forward(
            get_mut(o, qn, "attention_paged o")?,
            get(q, qn, "attention_paged q")?,
            k_cache,
            v_cache,
            tables,
            get(seq, s.queries, "attention_paged seq")?,
            get(len, s.queries, "attention_paged len")?,
            s,
        )
    }

    fn sample(
        &self,
        tokens: &mut Vec<u32>,
        logprobs: &mut Vec<f32>,
        logits: &Vec<f32>,
        keys: &Vec<u32>,
        positions: &Vec<u32>,
        rows: usize,
        vocab: usize,
        params: &crate::backend::sample::SamplingParams,
    ) -> Result<()> {
        paged::sample_rows(
            get_mut(tokens, rows, "sample tokens")?,
            get_mut(logprobs, rows, "sample logprobs")?,
            get(logits, rows * vocab, "sample logits")?,
            get(keys, 2 * rows, "sample keys")?,
            get(positions, rows, "sample positions")?,
            vocab,
            params,
        )
    }
}
