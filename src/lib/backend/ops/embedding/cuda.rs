//! The embedding launchers (kernels in `embedding.cu`).

use anyhow::Result;

use super::EmbeddingOps;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{need, Args, CudaBackend, CudaBuf, CudaIdx};
use crate::backend::ops::memory::cuda::rows_args;

pub(crate) const KERNELS: Family = Family {
    name: "embedding",
    src: include_str!("embedding.cu"),
    per_head_dim: false,
    training_only: false,
};

impl EmbeddingOps for CudaBackend {
    fn embedding(
        &self,
        out: &mut CudaBuf,
        table: &CudaBuf,
        ids: &CudaIdx,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        need(out.len, tokens * dim, "embedding out")?;
        need(ids.len, tokens, "embedding ids")?;
        if dim == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "embedding_fwd_k")?;
        let args = Args::new().bufs(&[out, table]);
        let args = rows_args(self, args, ids, tokens, dim, table.len / dim)?;
        self.launch(&f, (tokens as u32, 1, 1), Self::row_threads(dim), 0, &args)
    }
    fn embedding_backward(
        &self,
        dtable: &mut CudaBuf,
        dout: &CudaBuf,
        ids: &CudaIdx,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        need(dout.len, tokens * dim, "embedding dout")?;
        need(ids.len, tokens, "embedding ids")?;
        if dim == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "embedding_bwd_k")?;
        let args = Args::new().bufs(&[dtable, dout]);
        let args = rows_args(self, args, ids, tokens, dim, dtable.len / dim)?;
        self.launch(&f, (tokens as u32, 1, 1), Self::row_threads(dim), 0, &args)
    }
}
