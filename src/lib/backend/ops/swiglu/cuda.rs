//! The SwiGLU launchers (kernels in `swiglu.cu`).

use anyhow::Result;

use super::SwigluOps;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, CudaBackend, CudaBuf};
use crate::backend::DType;

pub const KERNELS: Family = Family {
    name: "swiglu",
    src: include_str!("swiglu.cu"),
    per_head_dim: false,
};

/// n / 8 when every buffer is bf16 and 16-byte aligned and 8 divides n: the elementwise
/// kernels' vectorized form applies (TANDEM_NO_VEC=1 keeps the scalar kernels, for checks).
fn vec8(n: usize, bufs: &[&CudaBuf]) -> Option<i64> {
    let ok = n.is_multiple_of(8)
        && bufs
            .iter()
            .all(|b| b.dtype == DType::BF16 && b.ptr.is_multiple_of(16))
        && std::env::var_os("TANDEM_NO_VEC").is_none();
    ok.then_some((n / 8) as i64)
}

impl SwigluOps for CudaBackend {
    fn swiglu(&self, h: &mut CudaBuf, g: &CudaBuf, u: &CudaBuf, n: usize) -> Result<()> {
        need(h.len, n, "swiglu h")?;
        need(g.len, n, "swiglu g")?;
        need(u.len, n, "swiglu u")?;
        if let Some(n8) = vec8(n, &[h, g, u]) {
            return self.elementwise(
                KERNELS,
                "swiglu_fwd_v8_k",
                n8 as usize,
                &[&h.ptr, &g.ptr, &u.ptr, &n8],
            );
        }
        let (hbf, gbf, ubf, n64) = (h.bf(), g.bf(), u.bf(), n as i64);
        self.elementwise(
            KERNELS,
            "swiglu_fwd_k",
            n,
            &[&h.ptr, &hbf, &g.ptr, &gbf, &u.ptr, &ubf, &n64],
        )
    }
    fn swiglu_packed(&self, h: &mut CudaBuf, gu: &CudaBuf, n: usize, f: usize) -> Result<()> {
        need(h.len, n * f, "swiglu_packed h")?;
        need(gu.len, 2 * n * f, "swiglu_packed gu")?;
        if n * f == 0 {
            return Ok(());
        }
        // Whole 8-element groups per half row: f a multiple of 8 (vec8 checks n·f and 2·n·f).
        if vec8(n * f, &[h, gu]).is_some() && f.is_multiple_of(8) {
            let (f8, rows) = (i32_of(f / 8, "f")?, i32_of(n, "rows")?);
            let threads = 128u32;
            let fn_ = self.func(KERNELS, 0, "swiglu_packed_v8_k")?;
            return self.launch(
                &fn_,
                (
                    (f / 8).div_ceil(threads as usize) as u32,
                    n.min(65535) as u32,
                    1,
                ),
                threads,
                0,
                &[&h.ptr, &gu.ptr, &f8, &rows],
            );
        }
        let (hbf, gbf, ff, n64) = (h.bf(), gu.bf(), f as i64, (n * f) as i64);
        self.elementwise(
            KERNELS,
            "swiglu_packed_k",
            n * f,
            &[&h.ptr, &hbf, &gu.ptr, &gbf, &ff, &n64],
        )
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
        if let Some(n8) = vec8(n, &[dg, du, dh, g, u]) {
            return self.elementwise(
                KERNELS,
                "swiglu_bwd_v8_k",
                n8 as usize,
                &[&dg.ptr, &du.ptr, &dh.ptr, &g.ptr, &u.ptr, &n8],
            );
        }
        let (dgbf, dubf, dhbf, gbf, ubf, n64) =
            (dg.bf(), du.bf(), dh.bf(), g.bf(), u.bf(), n as i64);
        self.elementwise(
            KERNELS,
            "swiglu_bwd_k",
            n,
            &[
                &dg.ptr, &dgbf, &du.ptr, &dubf, &dh.ptr, &dhbf, &g.ptr, &gbf, &u.ptr, &ubf, &n64,
            ],
        )
    }
}
