//! The matmul launchers: cuBLASLt GEMMs through the device's helpers (`CudaBackend::gemm_*`,
//! operand types reconciled there), and the bias gradient's column sum (`matmul.cu`).

use anyhow::Result;

use super::{MatmulOps, MatmulShape};
use crate::backend::cuda::gemm::GemmCall;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, Args, CudaBackend, CudaBuf, THREADS};
use crate::backend::ops::memory::cuda::add_at;
use crate::backend::{DType, Device};

pub(crate) const KERNELS: Family = Family {
    name: "matmul",
    src: include_str!("matmul.cu"),
    per_head_dim: false,
    training_only: false,
};

/// dst[c] += Σ_r a[r,c] (deterministic: per-block partial sums, then a fixed-order sum).
fn colsum_add(
    be: &CudaBackend,
    dst: &CudaBuf,
    a: &CudaBuf,
    rows: usize,
    cols: usize,
) -> Result<()> {
    const ROWS_PER_BLOCK: usize = 64;
    let blocks = rows.div_ceil(ROWS_PER_BLOCK).max(1);
    let part = be.temp(blocks * cols, DType::F32)?;
    let c = i32_of(cols, "cols")?;
    let f = be.func(KERNELS, 0, "colsum_partial_k")?;
    let args = Args::new()
        .ptr(&part)
        .buf(a)
        .i32(i32_of(rows, "rows")?)
        .i32(c)
        .i32(ROWS_PER_BLOCK as i32);
    let gx = cols.div_ceil(THREADS as usize) as u32;
    be.launch(&f, (gx, blocks as u32, 1), THREADS, 0, &args)?;
    colsum_finish(be, dst, &part, blocks, c)
}

/// dst[c] += Σ_b part[b,c] in a fixed order (`colsum_finish_k`, which the RMSNorm weight
/// gradient's column sum ends with too).
pub(crate) fn colsum_finish(
    be: &CudaBackend,
    dst: &CudaBuf,
    part: &CudaBuf,
    blocks: usize,
    cols: i32,
) -> Result<()> {
    let f = be.func(KERNELS, 0, "colsum_finish_k")?;
    let args = Args::new().buf(dst).ptr(part).i32(blocks as i32).i32(cols);
    let gx = (cols as usize).div_ceil(THREADS as usize) as u32;
    be.launch(&f, (gx, 1, 1), THREADS, 0, &args)
}

impl MatmulOps for CudaBackend {
    fn matmul(
        &self,
        y: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        b: Option<&CudaBuf>,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        need(y.len, m * n, "matmul y")?;
        need(x.len, m * k, "matmul x")?;
        need(w.len, n * k, "matmul w")?;
        if let Some(b) = b {
            need(b.len, n, "matmul bias")?;
        }
        if k == 0 {
            // An empty sum: y = b (or y += b), which cuBLASLt does not do for k = 0.
            if !accumulate {
                self.fill(y, m * n, 0.0)?;
            }
            if let Some(b) = b {
                for r in 0..m {
                    add_at(self, y, r * n, b, n)?;
                }
            }
            return Ok(());
        }
        self.gemm_xwt(
            y.operand(0),
            x.operand(0),
            w.operand(0),
            b.map(|b| b.operand(0)),
            s,
            accumulate,
        )
    }

    fn matmul_residual(
        &self,
        y: &mut CudaBuf,
        r: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        s: MatmulShape,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        need(y.len, m * n, "matmul_residual y")?;
        need(r.len, m * n, "matmul_residual r")?;
        need(x.len, m * k, "matmul_residual x")?;
        need(w.len, n * k, "matmul_residual w")?;
        if k == 0 || r.dtype != y.dtype {
            // cuBLASLt reads C in D's type: copy (converting) and accumulate instead.
            self.copy(y, 0, r, 0, m * n)?;
            return self.matmul(y, x, w, None, s, true);
        }
        // One GEMM: D = y, C = r, beta 1 (no separate copy of the residual).
        let call = GemmCall {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            a: w.operand(0),
            lda: k,
            b: x.operand(0),
            ldb: k,
            d: y.operand(0),
            ldd: n,
            beta: 1.0,
            bias: None,
            c: Some(r.operand(0)),
        };
        self.gemm(call, n * k, m * k)
    }

    fn matmul_backward_x(
        &self,
        dx: &mut CudaBuf,
        dy: &CudaBuf,
        w: &CudaBuf,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        need(dx.len, m * k, "matmul dx")?;
        need(dy.len, m * n, "matmul dy")?;
        need(w.len, n * k, "matmul w")?;
        if n == 0 {
            return if accumulate {
                Ok(())
            } else {
                self.fill(dx, m * k, 0.0)
            };
        }
        self.gemm_dyw(dx.operand(0), dy.operand(0), w.operand(0), s, accumulate)
    }

    fn matmul_backward_w(
        &self,
        dw: &mut CudaBuf,
        db: Option<&mut CudaBuf>,
        dy: &CudaBuf,
        x: &CudaBuf,
        s: MatmulShape,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        need(dw.len, n * k, "matmul dw")?;
        need(dy.len, m * n, "matmul dy")?;
        need(x.len, m * k, "matmul x")?;
        if m == 0 {
            return Ok(());
        }
        if k > 0 {
            self.gemm_dytx(dw.operand(0), dy.operand(0), x.operand(0), s)?;
        }
        if let Some(db) = db {
            need(db.len, n, "matmul db")?;
            colsum_add(self, db, dy, m, n)?;
        }
        Ok(())
    }
}
