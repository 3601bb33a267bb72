//! The LM head fused with log-softmax and entropy: per chunk of rows, logits = x·wᵀ/T into a
//! scratch buffer, then each row's log-prob of its target, log-sum-exp and entropy; the
//! backward recomputes each chunk's logits and gives dx and dw.
//!
//! Files: `cpu.rs` (the reference), `cuda.rs` (cuBLASLt GEMMs and the row reductions),
//! `logprob.cu`, `check.rs` (the `logprob` GPU case, with a target past the vocabulary reported
//! at the next synchronize; forward and backward timed at the Qwen2.5-0.5B vocabulary).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::{bail, Result};

use crate::backend::{Device, MatmulShape};

/// Shape of the fused LM-head log-prob op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogprobShape {
    /// Rows to score (each row is the hidden state that predicts one target token).
    pub rows: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Logits are divided by this before the softmax.
    pub temperature: f32,
    /// Rows per chunk: the op never holds more than `chunk × vocab` logits; the scratch buffer
    /// must hold at least that many floats.
    pub chunk: usize,
}

impl LogprobShape {
    /// The head's GEMM over `rows` rows (one chunk): x `[rows, hidden]` against w
    /// `[vocab, hidden]`.
    pub fn gemm(&self, rows: usize) -> MatmulShape {
        MatmulShape {
            m: rows,
            k: self.hidden,
            n: self.vocab,
        }
    }

    /// The shape's own limits: a positive finite temperature and chunks of at least a row.
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            bail!(
                "logprob: temperature must be positive and finite, got {}",
                self.temperature
            );
        }
        if self.chunk == 0 {
            bail!("logprob: chunk must be at least 1 row");
        }
        Ok(())
    }
}

/// The LM head's inputs: the hidden rows `x` [rows, hidden], the head's weight `w`
/// [vocab, hidden] and each row's target token.
#[derive(Clone, Copy, Debug)]
pub struct LogprobInput<T, I> {
    pub x: T,
    pub w: T,
    pub targets: I,
}

/// What the backward reads per scored row: the gradient flowing in (dL/dlp, and dL/dentropy
/// when the loss has an entropy term) and what the forward kept (lse and entropy).
#[derive(Clone, Copy, Debug)]
pub struct LogprobGrad<T> {
    pub dlp: T,
    pub dent: Option<T>,
    pub lse: T,
    pub ent: T,
}

/// The fused LM head.
pub trait LogprobOps: Device {
    /// Floats of logits the fused log-prob may hold per chunk: bigger chunks make bigger
    /// LM-head GEMMs and fewer read-modify-writes of the head's gradient.
    fn logprob_chunk_floats(&self) -> usize {
        16 << 20
    }
    /// z = x·wᵀ/T per chunk of rows; lse_i = log Σ_v exp z_iv; lp_i = z_i[y_i] − lse_i;
    /// ent_i = lse_i − Σ_v p_iv z_iv. Scratch holds one chunk of logits.
    fn logprob(
        &self,
        lp: &mut Self::Buf,
        ent: Option<&mut Self::Buf>,
        lse: &mut Self::Buf,
        x: LogprobInput<&Self::Buf, &Self::Idx>,
        shape: LogprobShape,
        scratch: &mut Self::Buf,
    ) -> Result<()>;
    /// dz_iv = glp_i(δ_{v,y_i} − p_iv) − gent_i·p_iv(log p_iv + ent_i), dlogits = dz/T;
    /// dx = dlogits·w (overwritten), dw += dlogitsᵀ·x (skipped without dw: a frozen head).
    /// Logits are recomputed chunk by chunk.
    fn logprob_backward(
        &self,
        dx: &mut Self::Buf,
        dw: Option<&mut Self::Buf>,
        x: LogprobInput<&Self::Buf, &Self::Idx>,
        grad: LogprobGrad<&Self::Buf>,
        shape: LogprobShape,
        scratch: &mut Self::Buf,
    ) -> Result<()>;
}
