//! The SwiGLU launchers (kernels in `swiglu.cu`).

use anyhow::Result;

use super::SwigluOps;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, vec8, Args, CudaBackend, CudaBuf};

pub(crate) const KERNELS: Family = Family {
    name: "swiglu",
    src: include_str!("swiglu.cu"),
    per_head_dim: false,
    training_only: false,
};

impl SwigluOps for CudaBackend {
    fn swiglu(&self, h: &mut CudaBuf, g: &CudaBuf, u: &CudaBuf, n: usize) -> Result<()> {
        need(h.len, n, "swiglu h")?;
        need(g.len, n, "swiglu g")?;
        need(u.len, n, "swiglu u")?;
        let bufs = [&*h, g, u];
        if let Some(n8) = vec8(n, &bufs) {
            let args = Args::new().ptrs(&bufs).i64(n8);
            return self.elementwise(KERNELS, "swiglu_fwd_v8_k", n8 as usize, &args);
        }
        let args = Args::new().bufs(&bufs).i64(n as i64);
        self.elementwise(KERNELS, "swiglu_fwd_k", n, &args)
    }
    fn swiglu_packed(&self, h: &mut CudaBuf, gu: &CudaBuf, n: usize, f: usize) -> Result<()> {
        need(h.len, n * f, "swiglu_packed h")?;
        need(gu.len, 2 * n * f, "swiglu_packed gu")?;
        if n * f == 0 {
            return Ok(());
        }
        // Whole 8-element groups per half row: f a multiple of 8 (vec8 checks n·f and 2·n·f).
        if vec8(n * f, &[h, gu]).is_some() && f.is_multiple_of(8) {
            let args = Args::new()
                .ptrs(&[h, gu])
                .i32(i32_of(f / 8, "f")?)
                .i32(i32_of(n, "rows")?);
            let threads = 128u32;
            let fn_ = self.func(KERNELS, 0, "swiglu_packed_v8_k")?;
            let grid = (
                (f / 8).div_ceil(threads as usize) as u32,
                n.min(65535) as u32,
                1,
            );
            return self.launch(&fn_, grid, threads, 0, &args);
        }
        let args = Args::new().bufs(&[h, gu]).i64(f as i64).i64((n * f) as i64);
        self.elementwise(KERNELS, "swiglu_packed_k", n * f, &args)
    }
    fn swiglu_backward(
        &self,
        dg: &mut CudaBuf,
        du: &mut CudaBuf,
        dh: &CudaBuf,
        g: &CudaBuf,
        u: &CudaBuf,
        n: usize,
    ) -> Result<()> {
        need(dg.len, n, "swiglu dg")?;
        need(du.len, n, "swiglu du")?;
        need(dh.len, n, "swiglu dh")?;
        need(g.len, n, "swiglu g")?;
        need(u.len, n, "swiglu u")?;
        let bufs = [&*dg, &*du, dh, g, u];
        if let Some(n8) = vec8(n, &bufs) {
            let args = Args::new().ptrs(&bufs).i64(n8);
            return self.elementwise(KERNELS, "swiglu_bwd_v8_k", n8 as usize, &args);
        }
        let args = Args::new().bufs(&bufs).i64(n as i64);
        self.elementwise(KERNELS, "swiglu_bwd_k", n, &args)
    }
}
