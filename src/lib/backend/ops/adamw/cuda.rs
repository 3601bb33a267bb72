//! The optimizer launchers (kernels in `adamw.cu`).

use anyhow::Result;

use super::{AdamWOps, AdamWStep};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::pool::Block;
use crate::backend::cuda::{i32_of, need, Args, CudaBackend, CudaBuf, THREADS};

pub(crate) const KERNELS: Family = Family {
    name: "adamw",
    src: include_str!("adamw.cu"),
    per_head_dim: false,
    training_only: false,
};

/// The sum of `blocks` partial sums of squares in `part` (f64), by one block, read back.
fn sumsq_finish(be: &CudaBackend, part: &Block, blocks: i32) -> Result<f64> {
    let out = be.pool().alloc(8)?;
    let f = be.func(KERNELS, 0, "sumsq_finish_k")?;
    let args = Args::new().raw(out.ptr()).raw(part.ptr()).i32(blocks);
    be.launch(&f, (1, 1, 1), THREADS, 0, &args)?;
    Ok(be.read_back::<f64>(out.ptr(), 1)?[0])
}

impl AdamWOps for CudaBackend {
    fn sum_squares(&self, x: &CudaBuf, n: usize) -> Result<f64> {
        need(x.len, n, "sum_squares x")?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = self.stride_blocks(n).min(1024);
        let part = self.pool().alloc(blocks as usize * 8)?;
        let f = self.func(KERNELS, 0, "sumsq_partial_k")?;
        let args = Args::new().raw(part.ptr()).buf(x).i64(n as i64);
        self.launch(&f, (blocks, 1, 1), THREADS, 0, &args)?;
        sumsq_finish(self, &part, blocks as i32)
    }
    fn sum_squares_all(&self, xs: &[(&CudaBuf, usize)]) -> Result<f64> {
        // Every buffer's partial sums go to one array (fixed order), reduced by one block.
        let blocks: Vec<u32> = xs
            .iter()
            .map(|&(_, n)| {
                if n == 0 {
                    0
                } else {
                    self.stride_blocks(n).min(1024)
                }
            })
            .collect();
        let total: usize = blocks.iter().map(|&b| b as usize).sum();
        if total == 0 {
            for &(x, n) in xs {
                need(x.len, n, "sum_squares x")?;
            }
            return Ok(0.0);
        }
        let part = self.pool().alloc(total * 8)?;
        let f = self.func(KERNELS, 0, "sumsq_partial_k")?;
        let mut off = 0usize;
        for (&(x, n), &b) in xs.iter().zip(&blocks) {
            need(x.len, n, "sum_squares x")?;
            if b == 0 {
                continue;
            }
            let at = part.ptr() + (off * 8) as u64;
            let args = Args::new().raw(at).buf(x).i64(n as i64);
            self.launch(&f, (b, 1, 1), THREADS, 0, &args)?;
            off += b as usize;
        }
        sumsq_finish(self, &part, i32_of(total, "partial sums")?)
    }
    fn adamw(
        &self,
        p: &mut CudaBuf,
        g: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        n: usize,
        st: &AdamWStep,
    ) -> Result<()> {
        need(p.len, n, "adamw p")?;
        need(g.len, n, "adamw g")?;
        need(m.len, n, "adamw m")?;
        need(v.len, n, "adamw v")?;
        let args = Args::new()
            .bufs(&[p, g, m, v])
            .i64(n as i64)
            .f32(st.lr)
            .f32(st.beta1)
            .f32(st.beta2)
            .f32(st.eps)
            .f32(st.weight_decay)
            .f32(st.bias_correction1)
            .f32(st.bias_correction2)
            .f32(st.grad_scale);
        self.elementwise(KERNELS, "adamw_k", n, &args)
    }
}
