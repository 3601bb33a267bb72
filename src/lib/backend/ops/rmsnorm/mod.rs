//! RMSNorm as HF computes it: f32 statistics, the weight applied after normalising; the
//! backward gives dx and accumulates dw.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `rmsnorm.cu`, `check.rs` (the `rmsnorm` GPU case;
//! timed at the training micro-batch and at a decode step).

pub mod check;
pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// RMSNorm over rows of `dim`.
pub trait RmsNormOps: Device {
    /// y[r,:] = x[r,:] · rstd[r] · w, rstd[r] = 1/√(mean(x[r,:]²) + eps) (rstd saved for backward).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        y: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// dx (= or +=) rstd·(w·dy − x̂·mean(x̂·w·dy)), x̂ = x·rstd;  dw += Σ_r dy·x̂.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()>;
}
