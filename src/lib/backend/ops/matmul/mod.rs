//! Linear layers: y = x·wᵀ + b with w in the HF `[out, in]` layout, the residual form that writes
//! a block's output next to its kept input, and the two backward GEMMs.
//!
//! Files: `cpu.rs` (the reference, on the `gemm` crate), `cuda.rs` (cuBLASLt through the
//! device's GEMM helpers, `backend/cuda/gemm.rs`), `matmul.cu` (the bias gradient's column
//! sum), `check.rs` (the `matmul` GPU case and `gemm_invariance`, rows of a call against a
//! larger call bit for bit; the bf16 GEMM peak and the model's GEMMs timed).

pub mod check;
pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// GEMMs of a linear layer, row-major.
pub trait MatmulOps: Device {
    /// y[m,n] (= or +=) x[m,k] · w[n,k]ᵀ + b[n].
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        y: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// y[m,n] = r[m,n] + x[m,k] · w[n,k]ᵀ (y and r distinct): a residual block's output next to
    /// its input, which training keeps. A GPU backend does it as one GEMM reading r as C.
    #[allow(clippy::too_many_arguments)]
    fn matmul_residual(
        &self,
        y: &mut Self::Buf,
        r: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.copy(y, 0, r, 0, m * n)?;
        self.matmul(y, x, w, None, m, k, n, true)
    }
    /// dx[m,k] (= or +=) dy[m,n] · w[n,k].
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_x(
        &self,
        dx: &mut Self::Buf,
        dy: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// dw[n,k] += dy[m,n]ᵀ · x[m,k];  db[n] += Σ_m dy[m,n].
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_w(
        &self,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dy: &Self::Buf,
        x: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()>;
}
