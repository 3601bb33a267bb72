//! The memory ops' launchers (kernels in `memory.cu`).

use anyhow::Result;

use super::{KvCache, MemoryOps};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, CudaBackend, CudaBuf, CudaIdx};

pub const KERNELS: Family = Family {
    name: "memory",
    src: include_str!("memory.cu"),
    per_head_dim: false,
};

/// y[..n] += x[..n] on device addresses (offsets into buffers; callers checked the sizes).
pub(crate) fn add_raw(
    be: &CudaBackend,
    y: u64,
    ybf: i32,
    x: u64,
    xbf: i32,
    n: usize,
) -> Result<()> {
    let n64 = n as i64;
    be.elementwise(KERNELS, "add_assign_k", n, &[&y, &ybf, &x, &xbf, &n64])
}

impl MemoryOps for CudaBackend {
    fn add_assign(&self, y: &mut CudaBuf, x: &CudaBuf, n: usize) -> Result<()> {
        need(y.len, n, "y")?;
        need(x.len, n, "x")?;
        add_raw(self, y.ptr, y.bf(), x.ptr, x.bf(), n)
    }

    fn gather_rows(
        &self,
        out: &mut CudaBuf,
        x: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        need(rows.len, n, "gather rows")?;
        need(out.len, n * dim, "gather out")?;
        if n == 0 || dim == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "gather_rows_k")?;
        let (obf, xbf) = (out.bf(), x.bf());
        let (nn, d, xr) = (i32_of(n, "n")?, i32_of(dim, "dim")?, (x.len / dim) as i64);
        let err = self.err_ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[&out.ptr, &obf, &x.ptr, &xbf, &rows.ptr, &nn, &d, &xr, &err],
        )
    }

    fn scatter_add_rows(
        &self,
        dx: &mut CudaBuf,
        dout: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        need(rows.len, n, "scatter rows")?;
        need(dout.len, n * dim, "scatter dout")?;
        if n == 0 || dim == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "scatter_add_rows_k")?;
        let (dbf, obf) = (dx.bf(), dout.bf());
        let (nn, d, xr) = (i32_of(n, "n")?, i32_of(dim, "dim")?, (dx.len / dim) as i64);
        let err = self.err_ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &dx.ptr, &dbf, &dout.ptr, &obf, &rows.ptr, &nn, &d, &xr, &err,
            ],
        )
    }

    fn kv_store(
        &self,
        cache: KvCache<&mut CudaBuf>,
        k: &CudaBuf,
        v: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        row_dim: usize,
    ) -> Result<()> {
        let KvCache {
            k: k_cache,
            v: v_cache,
        } = cache;
        need(rows.len, n, "kv_store rows")?;
        need(k.len, n * row_dim, "kv_store k")?;
        need(v.len, n * row_dim, "kv_store v")?;
        if n == 0 || row_dim == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "kv_store_k")?;
        let (kcbf, vcbf, kbf, vbf) = (k_cache.bf(), v_cache.bf(), k.bf(), v.bf());
        let (nn, rd) = (i32_of(n, "n")?, i32_of(row_dim, "row_dim")?);
        let cache_rows = (k_cache.len.min(v_cache.len) / row_dim) as i64;
        let err = self.err_ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(row_dim),
            0,
            &[
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &rows.ptr,
                &nn,
                &rd,
                &cache_rows,
                &err,
            ],
        )
    }
}
