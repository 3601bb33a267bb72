//! The adapters in the passes: y += (α/r)·(x·Aᵀ)·Bᵀ after a projection's GEMM, and in the
//! backward dB += dyᵀ·(α/r)(x·Aᵀ), dA += ((α/r)·dy·B)ᵀ·x, dx += (α/r)·(dy·B)·A. The scaling
//! is a GEMM by (α/r)·I [r, r], so the adapters run on the matmul ops alone (no kernel of
//! their own); x·Aᵀ is computed again in the backward instead of kept (r columns a token).

use anyhow::Result;

use crate::backend::{Backend, MatmulShape};
use crate::model::lora::{LoraSpec, Target};
use crate::model::Config;

/// A decoder's adapters: their spec and the scaling matrix.
pub(super) struct LoraState<B: Backend> {
    pub(super) spec: LoraSpec,
    /// (α/r)·I [r, r] in the compute dtype (α/r rounded to bf16 there, as torch would round
    /// a bf16 activation times the scale).
    pub(super) scale: B::Buf,
    /// Switched off: the passes compute the base model alone (the reference of a LoRA run,
    /// scored with the weights the adapters are trained on).
    pub(super) off: bool,
}

impl<B: Backend> LoraState<B> {
    pub(super) fn new(b: &B, spec: &LoraSpec) -> Result<Self> {
        let r = spec.rank;
        let mut diag = vec![0.0f32; r * r];
        for i in 0..r {
            diag[i * r + i] = spec.scale();
        }
        let mut scale = b.alloc_as(r * r, b.compute_dtype())?;
        b.upload(&mut scale, &diag)?;
        Ok(LoraState {
            spec: spec.clone(),
            scale,
            off: false,
        })
    }
}

/// One adapter in a pass: its A and B (parameter indices) and its projection's input and
/// output features.
#[derive(Clone, Copy)]
pub(super) struct Pair {
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) inp: usize,
    pub(super) out: usize,
}

impl Pair {
    /// The adapter `(a, b)` of target `t` in a model of `cfg`'s shape.
    pub(super) fn of((a, b): (usize, usize), t: Target, cfg: &Config) -> Pair {
        let (inp, out) = t.dims(cfg);
        Pair { a, b, inp, out }
    }
}

/// One pass's view of the adapters: the backend, the parameters, the scaling, the rank and
/// the rows of the call.
pub(super) struct Adapt<'a, B: Backend> {
    pub(super) b: &'a B,
    pub(super) w: &'a [B::Buf],
    pub(super) scale: &'a B::Buf,
    pub(super) rank: usize,
    pub(super) rows: usize,
}

impl<B: Backend> Adapt<'_, B> {
    fn shape(&self, k: usize, n: usize) -> MatmulShape {
        MatmulShape { m: self.rows, k, n }
    }

    /// ts = (α/r)·x·Aᵀ into `s[1]` (through `s[0]`).
    fn scaled_xa(&self, a: usize, x: &B::Buf, inp: usize, s: &mut [B::Buf; 2]) -> Result<()> {
        let (b, r) = (self.b, self.rank);
        let [t, ts] = s;
        b.matmul(t, x, &self.w[a], None, self.shape(inp, r), false)?;
        b.matmul(ts, t, self.scale, None, self.shape(r, r), false)
    }

    /// y += (α/r)·(x·Aᵀ)·Bᵀ for the adapter `p`.
    pub(super) fn forward(
        &self,
        p: Pair,
        y: &mut B::Buf,
        x: &B::Buf,
        s: &mut [B::Buf; 2],
    ) -> Result<()> {
        let Pair { a, b: bi, inp, out } = p;
        self.scaled_xa(a, x, inp, s)?;
        self.b.matmul(
            y,
            &s[1],
            &self.w[bi],
            None,
            self.shape(self.rank, out),
            true,
        )
    }

    /// The adapter `p`'s backward from dy: its gradients added into `g`, dx += its part.
    pub(super) fn backward(
        &self,
        p: Pair,
        g: &mut [B::Buf],
        dx: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        s: &mut [B::Buf; 2],
    ) -> Result<()> {
        let Pair { a, b: bi, inp, out } = p;
        let (b, r) = (self.b, self.rank);
        self.scaled_xa(a, x, inp, s)?;
        let [dts, dt] = s;
        // dB += dyᵀ·ts (ts is in dt's buffer until the next line overwrites it).
        b.matmul_backward_w(&mut g[bi], None, dy, dt, self.shape(r, out))?;
        b.matmul_backward_x(dts, dy, &self.w[bi], self.shape(r, out), false)?;
        b.matmul_backward_x(dt, dts, self.scale, self.shape(r, r), false)?;
        b.matmul_backward_w(&mut g[a], None, dt, x, self.shape(inp, r))?;
        b.matmul_backward_x(dx, dt, &self.w[a], self.shape(inp, r), true)
    }
}

/// The adapters' view for a pass over `rows` rows (None without LoRA, or with it off).
pub(super) fn view<'a, B: Backend>(
    b: &'a B,
    w: &'a [B::Buf],
    lora: Option<&'a LoraState<B>>,
    rows: usize,
) -> Option<Adapt<'a, B>> {
    lora.filter(|l| !l.off).map(|l| Adapt {
        b,
        w,
        scale: &l.scale,
        rank: l.spec.rank,
        rows,
    })
}

/// The targets in `Layer::lora`'s order.
pub(super) fn slot(t: Target) -> usize {
    Target::ALL.iter().position(|x| *x == t).expect("a target")
}
