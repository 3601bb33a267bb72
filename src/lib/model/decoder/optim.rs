//! The optimizer: AdamW (torch.optim.AdamW semantics) with global gradient-norm clipping over
//! f32 master weights, its state for exact resume, and the release/restore calls a colocated
//! engine uses to park gradients, moments and masters between phases.

use anyhow::{bail, ensure, Result};

use super::Decoder;
use crate::backend::{AdamWStep, Backend, DType};
use crate::error::input_error;
use crate::model::{Tensor, Weights};

/// AdamW hyper-parameters of one optimizer step (torch.optim.AdamW semantics; the weight decay
/// applies to every parameter, as verl's FSDP actor does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWParams {
    fn default() -> Self {
        AdamWParams {
            lr: 1e-6,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// What `optimizer_step` did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// True when the norm was not finite and the step was skipped (weights and moments kept).
    pub skipped: bool,
}

/// Adam moments by HF parameter name plus the step count, enough to resume exactly. A state
/// with `step == 0` and no moments means "fresh optimizer".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState {
    pub step: u64,
    pub exp_avg: Weights,
    pub exp_avg_sq: Weights,
}

/// The AdamW kernel's arguments of step `step` (1-based).
pub(crate) fn adamw_step(hp: &AdamWParams, step: u64, grad_scale: f32) -> AdamWStep {
    let t = step as i32;
    AdamWStep {
        lr: hp.lr,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        weight_decay: hp.weight_decay,
        bias_correction1: (1.0 - (hp.beta1 as f64).powi(t)) as f32,
        bias_correction2: (1.0 - (hp.beta2 as f64).powi(t)) as f32,
        grad_scale,
    }
}

/// torch.nn.utils.clip_grad_norm_'s factor: max / (norm + 1e-6), clamped to 1.
pub(crate) fn clip_scale(grad_norm: f32, max_grad_norm: Option<f32>) -> f32 {
    max_grad_norm.map_or(1.0, |c| (c / (grad_norm + 1e-6)).min(1.0))
}

/// Refuses hyper-parameters AdamW or clipping cannot use (input errors).
pub(crate) fn check_hyper(hp: &AdamWParams, max_grad_norm: Option<f32>) -> Result<()> {
    let finite_nonneg = |x: f32| x.is_finite() && x >= 0.0;
    if !(finite_nonneg(hp.lr)
        && finite_nonneg(hp.weight_decay)
        && (0.0..1.0).contains(&hp.beta1)
        && (0.0..1.0).contains(&hp.beta2)
        && hp.eps.is_finite()
        && hp.eps > 0.0)
    {
        bail!(input_error(format!(
            "AdamW: need lr >= 0, weight_decay >= 0, betas in [0, 1) and eps > 0, got {hp:?}"
        )));
    }
    if let Some(c) = max_grad_norm {
        if !(c.is_finite() && c > 0.0) {
            bail!(input_error(format!("grad clip must be positive, got {c}")));
        }
    }
    Ok(())
}

impl<B: Backend> Decoder<B> {
    /// Sets every gradient to zero (start of an optimizer step's accumulation).
    pub fn zero_grads(&mut self) -> Result<()> {
        for g in &mut self.g {
            let n = self.backend.len(g);
            self.backend.fill(g, n, 0.0)?;
        }
        Ok(())
    }

    /// Global L2 norm of the accumulated gradients (0 before any backward pass).
    pub fn grad_norm(&self) -> Result<f32> {
        let all: Vec<(&B::Buf, usize)> = self.g.iter().map(|g| (g, self.backend.len(g))).collect();
        Ok(self.backend.sum_squares_all(&all)?.sqrt() as f32)
    }

    /// The gradients of the trained parameters by HF name (for tests and debugging).
    pub fn export_grads(&self) -> Result<Weights> {
        ensure!(
            !self.g.is_empty(),
            "no gradients yet: run forward_backward first"
        );
        self.export_where(&self.g, |i| self.trains[i])
    }

    /// Clips the gradients to `max_grad_norm` (global L2, as torch's clip_grad_norm_) and takes
    /// one AdamW step. A non-finite norm skips the step and leaves weights, moments and the
    /// step count as they were. Gradients are not zeroed (call `zero_grads`).
    pub fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        check_hyper(hp, max_grad_norm)?;
        ensure!(
            !self.g.is_empty(),
            "optimizer_step before any forward_backward"
        );
        let grad_norm = self.grad_norm()?;
        if !grad_norm.is_finite() {
            return Ok(StepReport {
                grad_norm,
                skipped: true,
            });
        }
        let grad_scale = clip_scale(grad_norm, max_grad_norm);
        if self.m.is_empty() {
            for (s, &trains) in self.shapes.iter().zip(&self.trains) {
                let n = if trains { s.iter().product() } else { 0 };
                self.m.push(self.backend.alloc(n)?);
                self.v.push(self.backend.alloc(n)?);
            }
        }
        self.step += 1;
        let st = adamw_step(hp, self.step, grad_scale);
        for i in (0..self.w.len()).filter(|&i| self.trains[i]) {
            let n = self.backend.len(&self.w[i]);
            let p = if self.master.is_empty() {
                &mut self.w[i]
            } else {
                &mut self.master[i]
            };
            self.backend
                .adamw(p, &self.g[i], &mut self.m[i], &mut self.v[i], n, &st)?;
            if !self.master.is_empty() {
                // Refresh the compute copy (rounded to its dtype) from the updated master.
                self.backend
                    .copy(&mut self.w[i], 0, &self.master[i], 0, n)?;
            }
        }
        Ok(StepReport {
            grad_norm,
            skipped: false,
        })
    }

    /// Adam moments by parameter name and the step count.
    pub fn optimizer_state(&self) -> Result<OptimizerState> {
        if self.m.is_empty() {
            return Ok(OptimizerState {
                step: self.step,
                ..Default::default()
            });
        }
        let trains = |i: usize| self.trains[i];
        Ok(OptimizerState {
            step: self.step,
            exp_avg: self.export_where(&self.m, trains)?,
            exp_avg_sq: self.export_where(&self.v, trains)?,
        })
    }

    /// Restores what `optimizer_state` returned, so training resumes exactly. Every parameter
    /// must have both moments with its shape (input errors otherwise).
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> Result<()> {
        let Some(moments) = self.state_moments(state)? else {
            self.m.clear();
            self.v.clear();
            self.step = state.step;
            return Ok(());
        };
        let mut m = Vec::with_capacity(self.names.len());
        let mut v = Vec::with_capacity(self.names.len());
        let mut moments = moments.into_iter();
        for &trains in &self.trains {
            if !trains {
                m.push(self.backend.alloc(0)?);
                v.push(self.backend.alloc(0)?);
                continue;
            }
            let (tm, tv) = moments.next().expect("one pair per trained parameter");
            for (t, out) in [(tm, &mut m), (tv, &mut v)] {
                let mut buf = self.backend.alloc(t.numel())?;
                self.backend.upload(&mut buf, &t.data)?;
                out.push(buf);
            }
        }
        self.m = m;
        self.v = v;
        self.step = state.step;
        Ok(())
    }

    /// Each trained parameter's (exp_avg, exp_avg_sq) in `state`, checked against the model
    /// (input errors); None when the state has no moments (no step taken yet).
    pub(crate) fn state_moments<'s>(
        &self,
        state: &'s OptimizerState,
    ) -> Result<Option<Vec<(&'s Tensor, &'s Tensor)>>> {
        if state.exp_avg.is_empty() && state.exp_avg_sq.is_empty() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.names.len());
        let trained = self.names.iter().zip(&self.shapes).zip(&self.trains);
        for ((name, shape), _) in trained.filter(|(_, &t)| t) {
            let mut pair = [None, None];
            for (k, (map, what)) in [
                (&state.exp_avg, "exp_avg"),
                (&state.exp_avg_sq, "exp_avg_sq"),
            ]
            .into_iter()
            .enumerate()
            {
                let t = map.get(name).ok_or_else(|| {
                    input_error(format!("optimizer state: {what} of '{name}' is missing"))
                })?;
                if &t.shape != shape {
                    bail!(input_error(format!(
                        "optimizer state: {what} of '{name}' has shape {:?}, the model's is {shape:?}",
                        t.shape
                    )));
                }
                pair[k] = Some(t);
            }
            let [Some(m), Some(v)] = pair else {
                unreachable!("both moments were found")
            };
            out.push((m, v));
        }
        for (what, map) in [
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ] {
            let trained = |k: &String| {
                let i = self.names.iter().position(|n| n == k);
                i.is_some_and(|i| self.trains[i])
            };
            if let Some(extra) = map.keys().find(|k| !trained(k)) {
                bail!(input_error(format!(
                    "optimizer state: {what} has '{extra}', which the model does not have"
                )));
            }
        }
        Ok(Some(out))
    }

    /// Frees the gradients (the next backward pass allocates them again): the hybrid engine's
    /// step from the update phase to generation.
    pub fn release_grads(&mut self) {
        self.g.clear();
    }

    /// Frees the Adam moments on the device, keeping the step count: the daemon parks them in
    /// host memory between updates (`--offload-optimizer`) and brings them back with
    /// `load_optimizer_state` before the next step.
    pub fn release_optimizer_state(&mut self) {
        self.m.clear();
        self.v.clear();
    }

    /// Frees the f32 master weights where they are kept apart from the compute weights (compute
    /// dtype other than f32): the daemon's `--offload-optimizer` holds them in host memory
    /// between updates and calls `restore_masters` before the next optimizer step. Where the
    /// compute weights are the masters (f32) there is nothing to free.
    pub fn release_masters(&mut self) {
        self.master.clear();
    }

    /// Uploads the f32 masters (by HF name, as `export_weights` gave them) that
    /// `release_masters` freed. A no-op when the compute weights are f32.
    pub fn restore_masters(&mut self, weights: &Weights) -> Result<()> {
        if self.backend.compute_dtype() == DType::F32 || !self.master.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(self.names.len());
        for (i, (name, shape)) in self.names.iter().zip(&self.shapes).enumerate() {
            if !self.trains[i] {
                out.push(self.backend.alloc(0)?);
                continue;
            }
            let t = weights
                .get(name)
                .ok_or_else(|| anyhow::anyhow!("master weights: '{name}' is missing"))?;
            ensure!(
                &t.shape == shape,
                "master weights: '{name}' has shape {:?}, the model's is {shape:?}",
                t.shape
            );
            let mut m = self.backend.alloc(t.numel())?;
            self.backend.upload(&mut m, &t.data)?;
            out.push(m);
        }
        self.master = out;
        Ok(())
    }
}
