//! The SwiGLU activation of the MLP, h = silu(g)·u elementwise, on two buffers or on the two
//! halves of each row of one fused gate/up projection, and its backward.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `swiglu.cu`, `check.rs` (the `swiglu` GPU case,
//! scalar and vectorized kernels, and `swiglu_packed`; timed on the training micro-batch and a
//! decode step).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::MemoryOps;

/// SwiGLU and its backward.
pub trait SwigluOps: MemoryOps {
    /// h = silu(g)·u = g·σ(g)·u, elementwise over n.
    fn swiglu(&self, h: &mut Self::Buf, g: &Self::Buf, u: &Self::Buf, n: usize) -> Result<()>;
    /// h[i,j] = silu(gu[i,j])·gu[i,f+j] for i < n, j < f: `swiglu` on the two halves of each
    /// row of one fused gate/up projection [n, 2f].
    fn swiglu_packed(&self, h: &mut Self::Buf, gu: &Self::Buf, n: usize, f: usize) -> Result<()> {
        if n == 0 || f == 0 {
            return Ok(());
        }
        let dt = self.dtype(gu);
        let mut g = self.alloc_as(n * f, dt)?;
        let mut u = self.alloc_as(n * f, dt)?;
        // gu viewed as 2n rows of f: gate rows are the even ones, up rows the odd ones.
        for (dst, half) in [(&mut g, 0), (&mut u, 1)] {
            let src: Vec<u32> = (0..n).map(|i| (2 * i + half) as u32).collect();
            let mut idx = self.alloc_idx(n)?;
            self.upload_idx(&mut idx, &src)?;
            self.gather_rows(dst, gu, &idx, n, f)?;
        }
        self.swiglu(h, &g, &u, n * f)
    }
    /// dg = dh·u·σ(g)·(1 + g·(1−σ(g))), du = dh·silu(g) (overwritten).
    fn swiglu_backward(
        &self,
        dg: &mut Self::Buf,
        du: &mut Self::Buf,
        dh: &Self::Buf,
        g: &Self::Buf,
        u: &Self::Buf,
        n: usize,
    ) -> Result<()>;
}
