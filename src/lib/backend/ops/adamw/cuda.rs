//! The optimizer launchers (kernels in `adamw.cu`).

use anyhow::Result;

use super::{AdamWOps, AdamWStep};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, CudaBackend, CudaBuf, THREADS};

pub const KERNELS: Family = Family {
    name: "adamw",
    src: include_str!("adamw.cu"),
    per_head_dim: false,
};

impl AdamWOps for CudaBackend {
    fn sum_squares(&self, x: &CudaBuf, n: usize) -> Result<f64> {
        need(x.len, n, "sum_squares x")?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = self.stride_blocks(n).min(1024);
        let part = self.pool().alloc(blocks as usize * 8)?;
        let out = self.pool().alloc(8)?;
        let (xbf, n64, b) = (x.bf(), n as i64, blocks as i32);
        let f = self.func(KERNELS, 0, "sumsq_partial_k")?;
        self.launch(
            &f,
            (blocks, 1, 1),
            THREADS,
            0,
            &[&part.ptr(), &x.ptr, &xbf, &n64],
        )?;
        let f = self.func(KERNELS, 0, "sumsq_finish_k")?;
        self.launch(&f, (1, 1, 1), THREADS, 0, &[&out.ptr(), &part.ptr(), &b])?;
        Ok(self.read_back::<f64>(out.ptr(), 1)?[0])
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
        let out = self.pool().alloc(8)?;
        let f = self.func(KERNELS, 0, "sumsq_partial_k")?;
        let mut off = 0usize;
        for (&(x, n), &b) in xs.iter().zip(&blocks) {
            need(x.len, n, "sum_squares x")?;
            if b == 0 {
                continue;
            }
            let (xbf, n64, at) = (x.bf(), n as i64, part.ptr() + (off * 8) as u64);
            self.launch(&f, (b, 1, 1), THREADS, 0, &[&at, &x.ptr, &xbf, &n64])?;
            off += b as usize;
        }
        let f = self.func(KERNELS, 0, "sumsq_finish_k")?;
        let t = i32_of(total, "partial sums")?;
        self.launch(&f, (1, 1, 1), THREADS, 0, &[&out.ptr(), &part.ptr(), &t])?;
        Ok(self.read_back::<f64>(out.ptr(), 1)?[0])
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
        let (pbf, gbf, mbf, vbf, n64) = (p.bf(), g.bf(), m.bf(), v.bf(), n as i64);
        self.elementwise(
            KERNELS,
            "adamw_k",
            n,
            &[
                &p.ptr,
                &pbf,
                &g.ptr,
                &gbf,
                &m.ptr,
                &mbf,
                &v.ptr,
                &vbf,
                &n64,
                &st.lr,
                &st.beta1,
                &st.beta2,
                &st.eps,
                &st.weight_decay,
                &st.bias_correction1,
                &st.bias_correction2,
                &st.grad_scale,
            ],
        )
    }
}
