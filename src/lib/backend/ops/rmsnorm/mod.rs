//! RMSNorm as HF computes it: f32 statistics, the weight applied after normalising; the
//! backward gives dx and accumulates dw.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `rmsnorm.cu`, `check.rs` (the `rmsnorm` GPU case;
//! timed at the training micro-batch and at a decode step).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// Sizes of an RMSNorm: `rows` rows of `dim` features, and the ε added to the mean square.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormShape {
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

/// What the backward reads of its forward: the input `x`, the weight `w` and the `rstd` the
/// forward saved.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormSaved<T> {
    pub x: T,
    pub w: T,
    pub rstd: T,
}

/// RMSNorm over rows of `dim`.
pub trait RmsNormOps: Device {
    /// y[r,:] = x[r,:] · rstd[r] · w, rstd[r] = 1/√(mean(x[r,:]²) + eps) (rstd saved for backward).
    fn rmsnorm(
        &self,
        y: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        shape: RmsNormShape,
    ) -> Result<()>;
    /// dx (= or +=) rstd·(w·dy − x̂·mean(x̂·w·dy)), x̂ = x·rstd;  dw += Σ_r dy·x̂.
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dy: &Self::Buf,
        saved: RmsNormSaved<&Self::Buf>,
        shape: RmsNormShape,
        accumulate: bool,
    ) -> Result<()>;
}
