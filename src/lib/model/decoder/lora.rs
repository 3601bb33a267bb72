//! The adapters in the passes: y += (α/r)·(x·Aᵀ)·Bᵀ after a projection's GEMM, and in the
//! backward dB += dyᵀ·(α/r)(x·Aᵀ), dA += ((α/r)·dy·B)ᵀ·x, dx += (α/r)·(dy·B)·A. The scaling
//! is a GEMM by (α/r)·I [r, r], so the adapters run on the matmul ops alone (no kernel of
//! their own); x·Aᵀ is computed again in the backward instead of kept (r columns a token).

use std::collections::HashMap;

use anyhow::{ensure, Context, Result};

use super::Decoder;
use crate::backend::{Backend, DType, MatmulShape};
use crate::model::lora::{check_adapters, LoraSpec, Target};
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Weights};

/// A decoder's adapters: their spec and the scaling matrix.
pub(super) struct LoraState<B: Backend> {
    pub(super) spec: LoraSpec,
    /// (α/r)·I [r, r] in the compute dtype (α/r rounded to bf16 there, as torch would round
    /// a bf16 activation times the scale).
    pub(super) scale: B::Buf,
    /// Switched off: the passes compute the base model alone (the reference of a LoRA run,
    /// scored with the weights the adapters are trained on).
    pub(super) off: bool,
    /// A generation decoder's adapters of its fused projections, per layer ([q/k/v,
    /// gate/up]); empty where the decoder has no fused buffers (then every adapter runs on
    /// its projection's own output).
    pub(super) stacked: Vec<[Option<Stacked<B>>; 2]>,
}

/// The adapters of one fused projection (q/k/v or gate/up) as two GEMMs on its fused output
/// y [tokens, out]: t = x·Aᵀ with the group's targeted A's one under the other (A [c, in]),
/// then y += t·Bᵀ with each targeted (α/r)·B at its output rows and its r columns of
/// B [out, c], zero elsewhere (block-diagonal): the zeros add nothing, so each part of y gets
/// its own adapter, and the output needs no column slices.
pub(super) struct Stacked<B: Backend> {
    pub(super) a: B::Buf,
    pub(super) b: B::Buf,
    /// c: the rank times the group's targeted projections.
    pub(super) cols: usize,
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
            stacked: Vec::new(),
        })
    }

    /// The intermediate columns a pass needs (`Work::lora`): the rank, or the widest stacked
    /// group's.
    pub(super) fn cols(&self) -> usize {
        let widest = self.stacked.iter().flatten().flatten().map(|s| s.cols);
        widest.fold(self.spec.rank, usize::max)
    }
}

/// The fused groups' targets with their row offsets in the fused output, and its rows.
fn groups(cfg: &Config) -> [(Vec<(Target, usize)>, usize); 2] {
    let (qd, kd, f) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    let qkv = vec![(Target::Q, 0), (Target::K, qd), (Target::V, qd + kd)];
    let gu = vec![(Target::Gate, 0), (Target::Up, f)];
    [(qkv, qd + 2 * kd), (gu, 2 * f)]
}

/// The input features of target `t`'s adapter in `layer` (A is [r, in]; checked before).
fn spec_in(adapters: &Weights, t: Target, layer: usize) -> usize {
    adapters[&t.adapter_names(layer).0].shape[1]
}

/// Builds the stacked A and B of a fused group on the host from the adapters (f32) and
/// uploads them in the compute dtype; None when the group has no targeted projection.
fn stack_group<B: Backend>(
    b: &B,
    spec: &LoraSpec,
    adapters: &Weights,
    layer: usize,
    (parts, rows): &(Vec<(Target, usize)>, usize),
) -> Result<Option<Stacked<B>>> {
    let r = spec.rank;
    let on: Vec<(Target, usize)> = parts
        .iter()
        .copied()
        .filter(|(t, _)| spec.targets.contains(t))
        .collect();
    if on.is_empty() {
        return Ok(None);
    }
    // Both groups read the hidden state.
    let (cols, inp) = (r * on.len(), spec_in(adapters, on[0].0, layer));
    let (mut a, mut bs) = (Vec::with_capacity(cols * inp), vec![0f32; rows * cols]);
    for (j, &(t, off)) in on.iter().enumerate() {
        let (an, bn) = t.adapter_names(layer);
        let (ta, tb) = (&adapters[&an], &adapters[&bn]);
        a.extend_from_slice(&ta.data);
        let out = tb.shape[0];
        for i in 0..out {
            let dst = &mut bs[(off + i) * cols + j * r..][..r];
            for (d, &v) in dst.iter_mut().zip(&tb.data[i * r..(i + 1) * r]) {
                *d = v * spec.scale();
            }
        }
    }
    let cd = b.compute_dtype();
    let mut da = b.alloc_as(cols * inp, cd)?;
    b.upload(&mut da, &a)?;
    let mut db = b.alloc_as(rows * cols, cd)?;
    b.upload(&mut db, &bs)?;
    Ok(Some(Stacked { a: da, b: db, cols }))
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

/// Layer `l`'s stacked adapters, when the decoder has them and they are on.
pub(super) fn stacked<B: Backend>(
    lora: Option<&LoraState<B>>,
    l: usize,
) -> Option<&[Option<Stacked<B>>; 2]> {
    lora.filter(|s| !s.off).and_then(|s| s.stacked.get(l))
}

/// The targets in `Layer::lora`'s order.
pub(super) fn slot(t: Target) -> usize {
    Target::ALL.iter().position(|x| *x == t).expect("a target")
}

impl<B: Backend> Decoder<B> {
    /// Merges `adapters` into this decoder's compute weights on its backend, W' = W +
    /// (α/r)·B·A rounded to the compute dtype: one GEMM per target, B·A accumulated in f32
    /// onto W (`matmul_backward_x` with C = W), A and (α/r)·B (scaled in f32 on the host,
    /// they are small) uploaded in the compute dtype. On a backend that computes in f32 the
    /// merged targets are then rounded to bf16, as the files and the GPU store them. Every
    /// loader of an adapter for rollout and the daemon's generation copy merge here, so that
    /// they generate from the same weights bit for bit.
    pub fn merge_adapters(&mut self, spec: &LoraSpec, adapters: &Weights) -> Result<()> {
        let cfg = self.cfg.clone();
        check_adapters(&cfg, spec, adapters, "merge")?;
        let index: HashMap<&str, usize> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let b = &self.backend;
        let cd = b.compute_dtype();
        let (s, r) = (spec.scale(), spec.rank);
        for slot in spec.adapters(&cfg) {
            let name = slot.target.weight_name(slot.layer);
            let i = *index
                .get(name.as_str())
                .with_context(|| format!("merge: the decoder has no weight '{name}'"))?;
            let (inp, out) = slot.target.dims(&cfg);
            // A and (α/r)·B stay f32 and their product lands in an f32 buffer, added to the
            // weight with one rounding: the host's f64 merge up to the GEMM's f32 sums (adapters
            // rounded to bf16 first, or B·A rounded before the add, put whole elements a step off).
            let scaled: Vec<f32> = adapters[&slot.b.0].data.iter().map(|x| x * s).collect();
            let mut bs = b.alloc(out * r)?;
            b.upload(&mut bs, &scaled)?;
            let mut a = b.alloc(r * inp)?;
            b.upload(&mut a, &adapters[&slot.a.0].data)?;
            let mut product = b.alloc(out * inp)?;
            // dx[m,k] = dy[m,n]·w[n,k] with m = out, k = in, n = r: (α/r)·B·A.
            let shape = MatmulShape {
                m: out,
                k: inp,
                n: r,
            };
            b.matmul_backward_x(&mut product, &bs, &a, shape, false)?;
            b.add_assign(&mut self.w[i], &product, out * inp)?;
            if cd == DType::F32 {
                round_on_host(b, &mut self.w[i], out * inp)?;
            }
        }
        b.synchronize()?;
        // Decode graphs captured before read the weights as they were.
        self.ws_epoch += 1;
        Ok(())
    }

    /// The decoder a LoRA policy generates with, on `backend`: a copy of this decoder's frozen
    /// base made on the device (as [`Decoder::for_generation`] builds it, fused projections
    /// included; on a backend that computes in f32 rounded to bf16 as `for_generation` rounds
    /// it) with `adapters` merged by [`Decoder::merge_adapters`]. No host round trip of the
    /// base; device memory grows by one copy of the weights in the compute dtype.
    pub fn lora_generation(&self, backend: B, adapters: &Weights) -> Result<Decoder<B>> {
        let spec = self.lora_spec().context("not a LoRA decoder")?.clone();
        let mut gen = Decoder::unfilled_for_generation(backend, &self.cfg)?;
        let cd = self.backend.compute_dtype();
        ensure!(
            gen.backend.compute_dtype() == cd,
            "generation copy: its backend computes in another dtype"
        );
        let index: HashMap<&str, usize> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        // The base's last writes and the copy's zero fills are done before the copies.
        self.backend.synchronize()?;
        gen.backend.synchronize()?;
        for (i, name) in gen.names.iter().enumerate() {
            let j = *index
                .get(name.as_str())
                .with_context(|| format!("generation copy: the policy has no '{name}'"))?;
            let n = self.shapes[j].iter().product();
            gen.backend.copy(&mut gen.w[i], 0, &self.w[j], 0, n)?;
            if cd == DType::F32 {
                round_on_host(&gen.backend, &mut gen.w[i], n)?;
            }
        }
        gen.merge_adapters(&spec, adapters)?;
        Ok(gen)
    }
}

impl<B: Backend> Decoder<B> {
    /// A decoder that generates with LoRA `adapters` unmerged on the frozen `base`: every
    /// projection a target adds (α/r)·(x·Aᵀ)·Bᵀ to its output at each step, the base
    /// untouched (no merged copy). The base is held as [`Decoder::for_generation`] holds a
    /// model (bf16-rounded on a backend that computes in f32, fused q/k/v and gate/up where
    /// the backend shares buffers, no masters); the adapters as the files have them, and
    /// where projections are fused also stacked per group ([`Stacked`]).
    pub fn for_generation_unmerged(
        backend: B,
        cfg: &Config,
        mut base: Weights,
        adapters: &Weights,
        spec: &LoraSpec,
    ) -> Result<Self> {
        spec.check()?;
        check_adapters(cfg, spec, adapters, "LoRA adapters")?;
        ensure!(
            !cfg.value_head,
            "LoRA generates with a policy, not a value model"
        );
        if backend.compute_dtype() == DType::F32 {
            for t in base.values_mut() {
                t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
            }
        }
        let lora = Some((spec, adapters));
        let mut d = Self::build(backend, cfg, Some(&base), super::Hold::Compute, lora)?;
        let mut stacked = Vec::new();
        if !d.fused.is_empty() {
            for (l, ly) in d.layers.iter().enumerate() {
                let [qkv, gu] = groups(cfg);
                let b = &d.backend;
                // Only the groups that are fused in this layer (q/k/v not under qk_norm).
                let q = match ly.qkv {
                    Some(_) => stack_group(b, spec, adapters, l, &qkv)?,
                    None => None,
                };
                let g = match ly.gate_up {
                    Some(_) => stack_group(b, spec, adapters, l, &gu)?,
                    None => None,
                };
                stacked.push([q, g]);
            }
        }
        d.lora.as_mut().expect("built with adapters").stacked = stacked;
        Ok(d)
    }
}

/// Rounds `buf[..n]` to bf16 through host memory (backends that compute in f32: the CPU).
fn round_on_host<B: Backend>(b: &B, buf: &mut B::Buf, n: usize) -> Result<()> {
    let mut host = vec![0f32; n];
    b.download(buf, &mut host)?;
    host.iter_mut().for_each(|x| *x = round_bf16(*x));
    b.upload(buf, &host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::{Device, MatmulOps};
    use crate::model::init::random_weights;
    use crate::model::lora::init_adapters;
    use crate::model::Arch;

    /// The stacked q/k/v adapters (targets q and v only, k left out) added to a fused output
    /// equal each target's (α/r)·(x·Aᵀ)·Bᵀ at its own columns, computed on the host; the
    /// untargeted k columns stay as they were. (The CPU has no fused buffers, so the engine's
    /// fused path runs on the GPU; this checks the stacking it reads.)
    #[test]
    fn stacked_adapters_add_each_target_at_its_columns() {
        let cfg = Config {
            arch: Arch::Qwen2,
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 12,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            value_head: false,
        };
        let spec = LoraSpec {
            rank: 2,
            alpha: 6.0,
            targets: vec![Target::Q, Target::V],
        };
        let mut ad = init_adapters(&cfg, &spec, 3);
        let noise = random_weights(&cfg, 4, 0.5);
        let src = &noise["model.layers.0.self_attn.q_proj.weight"].data;
        for (name, t) in ad.iter_mut().filter(|(k, _)| k.contains("lora_B")) {
            let off = name.len() % 7;
            t.data
                .iter_mut()
                .zip(&src[off..])
                .for_each(|(x, v)| *x = *v);
        }
        let [qkv, _] = groups(&cfg);
        let st = stack_group(&Cpu, &spec, &ad, 0, &qkv).unwrap().unwrap();
        assert_eq!(st.cols, 4);
        // q: columns 0..8, k: 8..12, v: 12..16.
        let (n, d, rows) = (3, 8, 16);
        let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let y0: Vec<f32> = (0..n * rows).map(|i| i as f32 * 0.01).collect();
        let b = Cpu;
        let (mut xb, mut yb, mut t) = (
            b.alloc(n * d).unwrap(),
            b.alloc(n * rows).unwrap(),
            b.alloc(n * 4).unwrap(),
        );
        b.upload(&mut xb, &x).unwrap();
        b.upload(&mut yb, &y0).unwrap();
        let sh = |k, n_out| MatmulShape { m: n, k, n: n_out };
        b.matmul(&mut t, &xb, &st.a, None, sh(d, 4), false).unwrap();
        b.matmul(&mut yb, &t, &st.b, None, sh(4, rows), true)
            .unwrap();
        let mut y = vec![0f32; n * rows];
        b.download(&yb, &mut y).unwrap();
        let mut want = y0.clone();
        for (tg, off, out) in [(Target::Q, 0, 8), (Target::V, 12, 4)] {
            let (an, bn) = tg.adapter_names(0);
            let (a, bm) = (&ad[&an].data, &ad[&bn].data);
            for row in 0..n {
                for o in 0..out {
                    let mut acc = 0f64;
                    for k in 0..2 {
                        let xa: f64 = (0..d).map(|i| (x[row * d + i] * a[k * d + i]) as f64).sum();
                        acc += xa * bm[o * 2 + k] as f64;
                    }
                    want[row * rows + off + o] += (3.0 * acc) as f32;
                }
            }
        }
        for (i, (g, w)) in y.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5, "element {i}: {g} vs {w}");
        }
        // k's columns untouched.
        for row in 0..n {
            let k = row * rows + 8..row * rows + 12;
            assert_eq!(y[k.clone()], y0[k]);
        }
    }
}
