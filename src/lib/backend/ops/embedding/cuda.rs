//! The embedding launchers (kernels in `embedding.cu`).

use anyhow::Result;

use super::EmbeddingOps;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, CudaBackend, CudaBuf, CudaIdx};

pub const KERNELS: Family = Family {
    name: "embedding",
    src: include_str!("embedding.cu"),
    per_head_dim: false,
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
        let (obf, tbf) = (out.bf(), table.bf());
        let (t, d, vocab) = (
            i32_of(tokens, "tokens")?,
            i32_of(dim, "dim")?,
            (table.len / dim) as i64,
        );
        let err = self.err_ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &out.ptr, &obf, &table.ptr, &tbf, &ids.ptr, &t, &d, &vocab, &err,
            ],
        )
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
        let (dbf, obf) = (dtable.bf(), dout.bf());
        let (t, d, vocab) = (
            i32_of(tokens, "tokens")?,
            i32_of(dim, "dim")?,
            (dtable.len / dim) as i64,
        );
        let err = self.err_ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &dtable.ptr,
                &dbf,
                &dout.ptr,
                &obf,
                &ids.ptr,
                &t,
                &d,
                &vocab,
                &err,
            ],
        )
    }
}
