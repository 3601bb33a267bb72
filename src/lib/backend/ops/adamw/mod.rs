//! The optimizer: the squared L2 norm of the gradients (global grad-norm clipping; many buffers
//! summed before one read-back) and the AdamW update of f32 master weights and moments.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `adamw.cu`, `check.rs` (the `optim` GPU case;
//! timed over the Qwen2.5-0.5B parameters).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// One AdamW update with everything pre-folded that is the same for every parameter tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - beta1^step` and `1 - beta2^step` (step counts from 1).
    pub bias_correction1: f32,
    pub bias_correction2: f32,
    /// Multiplies the gradient first (global-norm clipping coefficient, 1 when not clipping).
    pub grad_scale: f32,
}

/// The optimizer ops.
pub trait AdamWOps: Device {
    /// Σ x[..n]² (accumulated in f64 where the backend can).
    fn sum_squares(&self, x: &Self::Buf, n: usize) -> Result<f64>;
    /// Σ over (x, n) of Σ x[..n]² (the global grad norm): a device backend sums every buffer
    /// before its one read-back, instead of one sync per buffer.
    fn sum_squares_all(&self, xs: &[(&Self::Buf, usize)]) -> Result<f64> {
        xs.iter().map(|&(x, n)| self.sum_squares(x, n)).sum()
    }
    /// AdamW (torch semantics): g' = s·g; m = β1·m + (1−β1)·g'; v = β2·v + (1−β2)·g'²;
    /// p = p·(1 − lr·wd) − (lr/bc1)·m / (√v/√bc2 + eps).
    fn adamw(
        &self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        n: usize,
        step: &AdamWStep,
    ) -> Result<()>;
}
