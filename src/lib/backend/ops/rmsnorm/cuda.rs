//! The RMSNorm launchers (kernels in `rmsnorm.cu`; dw's second pass is the matmul family's
//! column sum).

use anyhow::{bail, Result};

use super::{RmsNormOps, RmsNormSaved, RmsNormShape};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, pieces8, Args, CudaBackend, CudaBuf, THREADS};
use crate::backend::ops::matmul::cuda::colsum_finish;
use crate::backend::DType;

pub(crate) const KERNELS: Family = Family {
    name: "rmsnorm",
    src: include_str!("rmsnorm.cu"),
    per_head_dim: false,
    training_only: false,
};

/// Rows per block of `rmsnorm_fwd_k` (a warp each; the kernel derives it from blockDim).
const RMSNORM_ROWS_PER_BLOCK: usize = 4;

/// Longest row `rmsnorm_fwd_k` keeps in registers (32 lanes × RMS_LANE); longer rows go to
/// `rmsnorm_fwd_v8_k`, a block per row, when their buffers allow 16-byte loads.
const RMSNORM_WARP_DIM: usize = 32 * 32;

/// 16-byte pieces each thread of `rmsnorm_fwd_v8_k` keeps (RMS_V8 in rmsnorm.cu).
const RMSNORM_V8_PIECES: usize = 4;

impl CudaBackend {
    /// y = rmsnorm(x)·w with a warp per row (`rmsnorm_fwd_k`); `rstd` is f32.
    fn rmsnorm_warp(
        &self,
        y: &mut CudaBuf,
        rstd: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        s: RmsNormShape,
    ) -> Result<()> {
        let f = self.func(KERNELS, 0, "rmsnorm_fwd_k")?;
        let args = Args::new()
            .buf(y)
            .ptr(rstd)
            .bufs(&[x, w])
            .i32(i32_of(s.rows, "rows")?)
            .i32(i32_of(s.dim, "dim")?)
            .f32(s.eps);
        let grid = (s.rows.div_ceil(RMSNORM_ROWS_PER_BLOCK) as u32, 1, 1);
        self.launch(&f, grid, 32 * RMSNORM_ROWS_PER_BLOCK as u32, 0, &args)
    }

    /// The same with a block per row over 8-element pieces (`rmsnorm_fwd_v8_k`): bf16 or f32,
    /// 16-byte aligned, `dim8` = dim / 8 pieces a row; the block is as wide as the row needs.
    fn rmsnorm_v8(
        &self,
        y: &mut CudaBuf,
        rstd: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        (rows, dim8, eps): (usize, usize, f32),
    ) -> Result<()> {
        let threads = dim8.div_ceil(RMSNORM_V8_PIECES).next_multiple_of(32);
        if threads > 1024 {
            bail!(
                "cuda rmsnorm: rows of {} elements are longer than the kernel holds",
                8 * dim8
            );
        }
        let f = self.func(KERNELS, 0, "rmsnorm_fwd_v8_k")?;
        let args = Args::new()
            .buf(y)
            .ptr(rstd)
            .bufs(&[x, w])
            .i32(i32_of(dim8, "dim / 8")?)
            .f32(eps);
        self.launch(&f, (rows as u32, 1, 1), threads as u32, 0, &args)
    }
}

impl RmsNormOps for CudaBackend {
    fn rmsnorm(
        &self,
        y: &mut CudaBuf,
        rstd: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        s: RmsNormShape,
    ) -> Result<()> {
        let RmsNormShape { rows, dim, eps } = s;
        need(y.len, rows * dim, "rmsnorm y")?;
        need(rstd.len, rows, "rmsnorm rstd")?;
        need(x.len, rows * dim, "rmsnorm x")?;
        need(w.len, dim, "rmsnorm w")?;
        if dim == 0 {
            return Ok(());
        }
        // rstd is a statistic: kept in f32 whatever the caller allocated.
        let rs = if rstd.dtype == DType::F32 {
            None
        } else {
            Some(self.temp(rows, DType::F32)?)
        };
        if let Some(dim8) = pieces8(dim, &[y, x, w]).filter(|_| dim > RMSNORM_WARP_DIM) {
            self.rmsnorm_v8(
                y,
                rs.as_ref().unwrap_or(&*rstd),
                x,
                w,
                (rows, dim8 as usize, eps),
            )?;
        } else {
            self.rmsnorm_warp(y, rs.as_ref().unwrap_or(&*rstd), x, w, s)?;
        }
        if let Some(t) = rs {
            self.convert(rstd.ptr, rstd.bf(), t.ptr, 0, rows)?;
        }
        Ok(())
    }
    fn rmsnorm_backward(
        &self,
        dx: &mut CudaBuf,
        dw: &mut CudaBuf,
        dy: &CudaBuf,
        saved: RmsNormSaved<&CudaBuf>,
        s: RmsNormShape,
        accumulate: bool,
    ) -> Result<()> {
        let (RmsNormSaved { x, w, rstd }, RmsNormShape { rows, dim, .. }) = (saved, s);
        need(dx.len, rows * dim, "rmsnorm dx")?;
        need(dw.len, dim, "rmsnorm dw")?;
        need(dy.len, rows * dim, "rmsnorm dy")?;
        need(x.len, rows * dim, "rmsnorm x")?;
        need(w.len, dim, "rmsnorm w")?;
        need(rstd.len, rows, "rmsnorm rstd")?;
        if dim == 0 || rows == 0 {
            return Ok(());
        }
        let rs = if rstd.dtype == DType::F32 {
            None
        } else {
            let t = self.temp(rows, DType::F32)?;
            self.convert(t.ptr, 0, rstd.ptr, 1, rows)?;
            Some(t)
        };
        let rs = rs.as_ref().unwrap_or(rstd);
        let (r, d) = (i32_of(rows, "rows")?, i32_of(dim, "dim")?);
        let f = self.func(KERNELS, 0, "rmsnorm_bwd_dx_k")?;
        let args = Args::new()
            .bufs(&[dx, dy, x, w])
            .ptr(rs)
            .i32(r)
            .i32(d)
            .i32(accumulate as i32);
        self.launch(&f, (rows as u32, 1, 1), Self::row_threads(dim), 0, &args)?;
        // dw: per-block partial column sums, then their fixed-order sum.
        const ROWS_PER_BLOCK: usize = 64;
        let blocks = rows.div_ceil(ROWS_PER_BLOCK);
        let part = self.temp(blocks * dim, DType::F32)?;
        let f = self.func(KERNELS, 0, "rmsnorm_bwd_dw_partial_k")?;
        let args = Args::new()
            .ptr(&part)
            .bufs(&[dy, x])
            .ptr(rs)
            .i32(r)
            .i32(d)
            .i32(ROWS_PER_BLOCK as i32);
        let gx = dim.div_ceil(THREADS as usize) as u32;
        self.launch(&f, (gx, blocks as u32, 1), THREADS, 0, &args)?;
        colsum_finish(self, dw, &part, blocks, d)
    }
}
