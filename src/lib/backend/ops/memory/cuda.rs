//! The memory ops' launchers (kernels in `memory.cu`).

use anyhow::Result;

use super::{KvCache, MemoryOps};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, Args, CudaBackend, CudaBuf, CudaIdx};

pub(crate) const KERNELS: Family = Family {
    name: "memory",
    src: include_str!("memory.cu"),
    per_head_dim: false,
    training_only: false,
};

/// y[y_off..y_off + n] += x[..n] (callers checked the sizes).
pub(crate) fn add_at(
    be: &CudaBackend,
    y: &CudaBuf,
    y_off: usize,
    x: &CudaBuf,
    n: usize,
) -> Result<()> {
    let args = Args::new().buf_at(y, y_off).buf(x).i64(n as i64);
    be.elementwise(KERNELS, "add_assign_k", n, &args)
}

/// The tail of the row kernels (here and the embedding's): `const u32* rows, int n, int dim,
/// i64 buffer_rows, u32* err`.
pub(crate) fn rows_args<'a>(
    be: &CudaBackend,
    a: Args<'a>,
    rows: &CudaIdx,
    n: usize,
    dim: usize,
    buf_rows: usize,
) -> Result<Args<'a>> {
    Ok(a.idx(rows)
        .i32(i32_of(n, "n")?)
        .i32(i32_of(dim, "dim")?)
        .i64(buf_rows as i64)
        .raw(be.err_ptr()))
}

impl MemoryOps for CudaBackend {
    fn add_assign(&self, y: &mut CudaBuf, x: &CudaBuf, n: usize) -> Result<()> {
        need(y.len, n, "y")?;
        need(x.len, n, "x")?;
        add_at(self, y, 0, x, n)
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
        let args = rows_args(self, Args::new().bufs(&[out, x]), rows, n, dim, x.len / dim)?;
        self.launch(&f, (n as u32, 1, 1), Self::row_threads(dim), 0, &args)
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
        let args = rows_args(
            self,
            Args::new().bufs(&[dx, dout]),
            rows,
            n,
            dim,
            dx.len / dim,
        )?;
        self.launch(&f, (n as u32, 1, 1), Self::row_threads(dim), 0, &args)
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
        let cache_rows = k_cache.len.min(v_cache.len) / row_dim;
        let args = Args::new().bufs(&[k_cache, v_cache, k, v]);
        let args = rows_args(self, args, rows, n, row_dim, cache_rows)?;
        self.launch(&f, (n as u32, 1, 1), Self::row_threads(row_dim), 0, &args)
    }
}
