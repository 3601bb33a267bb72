//! Linear layers: y = x·wᵀ + b with w in the HF `[out, in]` layout, the residual form that writes
//! a block's output next to its kept input, and the two backward GEMMs.
//!
//! Files: `cpu.rs` (the reference, on the `gemm` crate), `cuda.rs` (cuBLASLt through the
//! device's GEMM helpers, `backend/cuda/gemm.rs`), `matmul.cu` (the bias gradient's column
//! sum), `check.rs` (the `matmul` GPU case and `gemm_invariance`, rows of a call against a
//! larger call bit for bit; the bf16 GEMM peak and the model's GEMMs timed).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// Sizes of a linear layer's GEMM: `m` rows of `k` inputs against a weight of `n` outputs
/// (x `[m, k]`, w `[n, k]`, y `[m, n]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// GEMMs of a linear layer, row-major.
pub trait MatmulOps: Device {
    /// y[m,n] (= or +=) x[m,k] · w[n,k]ᵀ + b[n].
    fn matmul(
        &self,
        y: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()>;
    /// y[m,n] = r[m,n] + x[m,k] · w[n,k]ᵀ (y and r distinct): a residual block's output next to
    /// its input, which training keeps. A GPU backend does it as one GEMM reading r as C.
    fn matmul_residual(
        &self,
        y: &mut Self::Buf,
        r: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        s: MatmulShape,
    ) -> Result<()> {
        self.copy(y, 0, r, 0, s.m * s.n)?;
        self.matmul(y, x, w, None, s, true)
    }
    /// dx[m,k] (= or +=) dy[m,n] · w[n,k].
    fn matmul_backward_x(
        &self,
        dx: &mut Self::Buf,
        dy: &Self::Buf,
        w: &Self::Buf,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()>;
    /// dw[n,k] += dy[m,n]ᵀ · x[m,k];  db[n] += Σ_m dy[m,n].
    fn matmul_backward_w(
        &self,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dy: &Self::Buf,
        x: &Self::Buf,
        s: MatmulShape,
    ) -> Result<()>;
}
