//! The Qwen2 / Llama / Qwen3 decoder, written once against the [`Backend`] op set: the model
//! math only (no KV pool, no scheduling: the generation engine in `engine::paged` owns those).
//!
//! ```text
//! h = embed(tokens)
//! for each layer:
//!     a = rmsnorm(h)                         input_layernorm
//!     q, k, v = a·Wqᵀ (+bq), a·Wkᵀ (+bk), a·Wvᵀ (+bv)        bias: Qwen2 (`qkv_bias`)
//!     q, k = rmsnorm_head(q), rmsnorm_head(k)                 Qwen3 (`qk_norm`)
//!     q, k = rope(q), rope(k)
//!     h = h + attention(q, k, v)·Woᵀ         causal, grouped-query, per packed sequence
//!     m = rmsnorm(h)                         post_attention_layernorm
//!     h = h + (silu(m·Wgᵀ) ∘ m·Wuᵀ)·Wdᵀ
//! logprob(y | h) = log_softmax(rmsnorm(h)·Wheadᵀ / T)[y]      Whead = embed when tied
//! ```
//!
//! Three ways in: packed scoring ([`Decoder::logprobs`]), packed training
//! ([`Decoder::forward_backward`], which keeps every layer's activations for the backward
//! pass), and a step over a paged KV cache ([`Decoder::forward_paged`]: the engine's runner
//! describes the step, its rows, block tables and draws, with the types of `step`).
//! Activations live in a workspace sized for the largest call so far; it grows at the start of
//! a call, never inside the layer loop.
//!
//! Where the backend can share memory between buffers (`Backend::alloc_parts`, CUDA), the
//! q/k/v weights (and biases) and the gate/up weights of a layer are parts of one buffer each,
//! so paged steps run x·[Wq; Wk; Wv]ᵀ and x·[Wg; Wu]ᵀ as one GEMM each (fewer, wider GEMMs at
//! decode batch sizes). Packed calls (training, scoring) keep the split GEMMs.
//!
//! The passes go unit by unit (embedding, layers, head) and tell a caller's [`UnitHooks`] as
//! they go; the decoder knows nothing of other ranks: the engine's sharded training brings a
//! unit's weights and sends its gradients through the hooks (`hooks`).
//!
//! Files: `forward` (the layer loop, packing, scoring), `attn` (packed or paged keys), `head`
//! (final norm, LM head, fused log-prob), `backward` (training passes), `hooks` (the per-unit
//! hooks), `optim` (AdamW and its state), `step` (paged steps), `workspace` (activation and
//! gradient buffers).

mod attn;
mod backward;
mod forward;
mod head;
mod hooks;
mod lora;
mod optim;
mod step;
mod workspace;

pub use attn::PagedAttn;
pub use hooks::{NoHooks, Pass, Unit, UnitBufs, UnitHooks};
pub(crate) use optim::{adamw_step, check_hyper, clip_scale};
pub use optim::{AdamWParams, OptimizerState, StepReport};
pub use step::StepRows;

use anyhow::{bail, ensure, Result};

use crate::backend::{Backend, DType, Device, Parts};
use crate::error::input_error;
use crate::model::lora::{check_adapters, LoraSpec};
use crate::model::names;
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Tensor, Weights};
use lora::LoraState;
use workspace::Work;

/// One sequence to score: the log-prob of `tokens[t]` given `tokens[..t]` is computed for every
/// `t in start..tokens.len()` (`start >= 1`).
#[derive(Clone, Copy, Debug)]
pub struct SeqRef<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
}

/// Per-sequence results, one value per scored token (`tokens.len() - start` of them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenStats {
    pub logprobs: Vec<f32>,
    pub entropy: Option<Vec<f32>>,
}

/// Per-sequence loss gradients returned by the training callback: dL/dlogprob for every
/// scored token, and optionally dL/dentropy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenGrads {
    pub dlogprobs: Vec<f32>,
    pub dentropy: Option<Vec<f32>>,
}

/// Per-token inputs of the PPO-clip loss computed on the device
/// ([`Decoder::forward_backward_ppo`]), concatenated over the scored tokens of the packed
/// sequences in order.
#[derive(Clone, Copy, Debug)]
pub struct PpoTokens<'a> {
    /// Log-probs of the sampling policy; None = on-policy (the current ones, detached).
    pub old: Option<&'a [f32]>,
    pub advantages: &'a [f32],
    /// `[w_pg | w_tok | w_agg]`, 3 × tokens: the aggregation weights of each token (see
    /// `algo::agg::LossNorm::row_weight`); w_tok = 0 masks a token.
    pub weights: &'a [f32],
    /// dL/dentropy per token (the entropy bonus), when there is one.
    pub dentropy: Option<&'a [f32]>,
}

/// What [`Decoder::build`] puts on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Nothing (the names and shapes only).
    Nothing,
    /// The compute weights.
    Compute,
    /// The compute weights and the f32 masters apart from them (when they are not f32).
    Trainable,
}

/// Parameter indices of one layer (into the decoder's parameter lists).
struct Layer {
    in_norm: usize,
    q: usize,
    k: usize,
    v: usize,
    q_b: Option<usize>,
    k_b: Option<usize>,
    v_b: Option<usize>,
    q_norm: Option<usize>,
    k_norm: Option<usize>,
    o: usize,
    post_norm: usize,
    gate: usize,
    up: usize,
    down: usize,
    /// Into `Decoder::fused`: [Wq; Wk; Wv] (and [bq; bk; bv]) and [Wg; Wu], whose parts are
    /// the buffers `q`, `k`, `v` (`q_b`...) and `gate`, `up` name; None where not fused.
    qkv: Option<usize>,
    qkv_b: Option<usize>,
    gate_up: Option<usize>,
    /// The adapters (A, B parameter indices) on each target, in `Target::ALL`'s order.
    lora: [Option<(usize, usize)>; 7],
}

impl Layer {
    /// The indices of every parameter of the layer.
    fn params(&self) -> impl Iterator<Item = usize> {
        let fixed = [
            self.in_norm,
            self.q,
            self.k,
            self.v,
            self.o,
            self.post_norm,
            self.gate,
            self.up,
            self.down,
        ];
        let optional = [self.q_b, self.k_b, self.v_b, self.q_norm, self.k_norm];
        let adapters = self.lora.into_iter().flatten().flat_map(|(a, b)| [a, b]);
        fixed
            .into_iter()
            .chain(optional.into_iter().flatten())
            .chain(adapters)
    }
}

/// The decoder: weights, gradients, optimizer state and workspaces on one backend.
pub struct Decoder<B: Backend> {
    backend: B,
    cfg: Config,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    /// Compute weights, in the backend's compute dtype.
    w: Vec<B::Buf>,
    /// f32 master weights the optimizer updates, when the compute dtype is not f32 (each step
    /// refreshes `w` from them); empty when `w` is f32 and is its own master.
    master: Vec<B::Buf>,
    /// Gradients, allocated on the first `forward_backward` (empty for frozen parameters).
    g: Vec<B::Buf>,
    /// Which parameters the optimizer trains: all, or under LoRA the adapters only (the base
    /// has no master, gradient or moments: empty buffers in those lists).
    trains: Vec<bool>,
    /// The LoRA adapters, when the decoder trains them on a frozen base.
    lora: Option<LoraState<B>>,
    /// Adam moments, allocated on the first optimizer step (or by loading a state).
    m: Vec<B::Buf>,
    v: Vec<B::Buf>,
    step: u64,
    embed: usize,
    final_norm: usize,
    /// The LM head: `embed` when the embeddings are tied; a value model's `score` [1, hidden].
    head: usize,
    /// A value model's head bias `score.bias` [1] (None for an LM head).
    head_bias: Option<usize>,
    layers: Vec<Layer>,
    ws: Work<B>,
    /// The PPO loss metrics summed on the device since the last `take_ppo_stats`.
    ppo_stats: Option<B::Buf>,
    /// Rows per chunk of the fused LM-head log-prob (bounds the logits held at once).
    pub logprob_chunk: usize,
    /// Bumped whenever a workspace buffer is reallocated: CUDA graphs captured before read
    /// the old addresses and must be captured again.
    ws_epoch: u64,
    /// The whole buffers of the fused projections (`Layer::qkv`...), each shared with the
    /// parameter buffers in `w` that are its parts. Not parameters: the optimizer, exports and
    /// checkpoints walk `w`.
    fused: Vec<B::Buf>,
    /// Whether paged steps use `fused` (`set_fused_projections`).
    fuse: bool,
    /// The passes' hooks hold the weights and gradients unit by unit (`hold_per_unit`): between
    /// passes the decoder holds none (empty buffers).
    per_unit: bool,
}

fn check_config(cfg: &Config) -> Result<()> {
    let bad = |msg: String| Err(input_error(format!("config.json: {msg}")));
    if cfg.vocab_size == 0 || cfg.hidden_size == 0 || cfg.intermediate_size == 0 {
        return bad("vocab_size, hidden_size and intermediate_size must be positive".into());
    }
    if cfg.num_heads == 0
        || cfg.num_kv_heads == 0
        || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads)
    {
        return bad(format!(
            "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
            cfg.num_heads, cfg.num_kv_heads
        ));
    }
    let max_hd = crate::backend::ops::rope::MAX_HEAD_DIM;
    if cfg.head_dim == 0 || !cfg.head_dim.is_multiple_of(2) || cfg.head_dim > max_hd {
        return bad(format!(
            "head_dim {} must be even and at most {max_hd}",
            cfg.head_dim
        ));
    }
    if !(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0) {
        return bad(format!("rope_theta {} must be positive", cfg.rope_theta));
    }
    if !(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps >= 0.0) {
        return bad(format!("rms_norm_eps {} must be >= 0", cfg.rms_norm_eps));
    }
    Ok(())
}

fn check_temperature(t: f32) -> Result<()> {
    if !(t.is_finite() && t > 0.0) {
        bail!(input_error(format!(
            "temperature must be positive and finite, got {t}"
        )));
    }
    Ok(())
}

/// Buffers of `sizes` as parts of one allocation laid end to end, `(whole, parts)`: None where
/// the backend cannot share memory between buffers or had to pad between the parts (then the
/// whole is not the parts concatenated).
fn contiguous_parts<B: Backend>(
    b: &B,
    sizes: &[usize],
    dtype: DType,
) -> Result<Option<Parts<B::Buf>>> {
    Ok(b.alloc_parts(sizes, dtype)?
        .filter(|(whole, _)| b.len(whole) == sizes.iter().sum::<usize>()))
}

/// The whole of `contiguous_parts` and its N parts, or None and N Nones.
fn split_parts<T, const N: usize>(p: Option<Parts<T>>) -> (Option<T>, [Option<T>; N]) {
    match p {
        Some((whole, parts)) => {
            let mut it = parts.into_iter();
            (Some(whole), std::array::from_fn(|_| it.next()))
        }
        None => (None, std::array::from_fn(|_| None)),
    }
}

/// `(&v[i], &mut v[j])` for i ≠ j.
fn pair<T>(v: &mut [T], i: usize, j: usize) -> (&T, &mut T) {
    assert_ne!(i, j);
    if i < j {
        let (a, b) = v.split_at_mut(j);
        (&a[i], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(i);
        (&b[0], &mut a[j])
    }
}

/// `(&mut v[i], Option<&mut v[j]>)` for i ≠ j.
fn two_mut<T>(v: &mut [T], i: usize, j: Option<usize>) -> (&mut T, Option<&mut T>) {
    match j {
        None => (&mut v[i], None),
        Some(j) => {
            assert_ne!(i, j);
            if i < j {
                let (a, b) = v.split_at_mut(j);
                (&mut a[i], Some(&mut b[0]))
            } else {
                let (a, b) = v.split_at_mut(i);
                (&mut b[0], Some(&mut a[j]))
            }
        }
    }
}

/// The parameters as [`Decoder::build`] checks, allocates and uploads them, in order.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    weights: Option<&'a Weights>,
    hold: Hold,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    bufs: Vec<B::Buf>,
    masters: Vec<B::Buf>,
    /// The whole buffers of the fused projections (`Decoder::fused`).
    fused: Vec<B::Buf>,
    /// The parameters added now are frozen (a LoRA decoder's base): no master.
    frozen: bool,
    trains: Vec<bool>,
    /// No fused projections (a LoRA decoder that trains).
    no_fuse: bool,
}

/// A fused group's whole buffer and its N parts (Nones where not fused).
type Group<B, const N: usize> = (Option<<B as Device>::Buf>, [Option<<B as Device>::Buf>; N]);

/// A layer's fused groups: q/k/v weights, q/k/v biases, gate/up weights.
type Groups<B> = (Group<B, 3>, Group<B, 3>, Group<B, 2>);

/// Adam's first and second moments, one buffer per parameter (or per bucket) each.
pub(crate) type Moments<B> = (Vec<<B as Device>::Buf>, Vec<<B as Device>::Buf>);

impl<B: Backend> Loader<'_, B> {
    /// Checks tensor `name` of the weights (present, of `shape`, finite), then adds the next
    /// parameter: uploaded into `into` (a part of a fused buffer) or a buffer of its own, with
    /// its f32 master apart where the decoder is trainable and computes in another dtype.
    /// Returns its index.
    fn add(&mut self, name: String, shape: Vec<usize>, into: Option<B::Buf>) -> Result<usize> {
        let b = self.backend;
        let cd = b.compute_dtype();
        let t = match self.weights {
            Some(weights) => Some(check_tensor(weights, &name, &shape)?),
            None => None,
        };
        let buf = if self.hold == Hold::Nothing {
            b.alloc_as(0, cd)?
        } else {
            let n = shape.iter().product();
            let mut buf = match into {
                Some(b) => b,
                None => b.alloc_as(n, cd)?,
            };
            if let Some(t) = t {
                b.upload(&mut buf, &t.data)?;
                if cd != DType::F32 && self.hold == Hold::Trainable {
                    let m = match self.frozen {
                        true => b.alloc(0)?,
                        false => {
                            let mut m = b.alloc(n)?;
                            b.upload(&mut m, &t.data)?;
                            m
                        }
                    };
                    self.masters.push(m);
                }
            }
            buf
        };
        self.names.push(name);
        self.shapes.push(shape);
        self.bufs.push(buf);
        self.trains.push(!self.frozen);
        Ok(self.bufs.len() - 1)
    }

    /// Keeps a fused group's whole buffer; its index into `fused`.
    fn keep(&mut self, whole: Option<B::Buf>) -> Option<usize> {
        whole.map(|b| {
            self.fused.push(b);
            self.fused.len() - 1
        })
    }

    /// The fused q/k/v weights (and biases) and gate/up weights of a layer, where the backend
    /// can share memory (paged steps run each group as one GEMM). Qwen3's per-head norm sits
    /// between the projections and rope: q/k/v stay apart there.
    fn fused_groups(&self, cfg: &Config) -> Result<Groups<B>> {
        let b = self.backend;
        let cd = b.compute_dtype();
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (qd, kd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let upload = self.hold != Hold::Nothing && !self.no_fuse;
        let qkv_w = if cfg.qk_norm || !upload {
            None
        } else {
            contiguous_parts(b, &[qd * d, kd * d, kd * d], cd)?
        };
        let qkv_b = match (&qkv_w, cfg.qkv_bias) {
            (Some(_), true) => contiguous_parts(b, &[qd, kd, kd], cd)?,
            _ => None,
        };
        let qkv_w = if cfg.qkv_bias && qkv_b.is_none() {
            None
        } else {
            qkv_w
        };
        let gu = match upload {
            true => contiguous_parts(b, &[f * d, f * d], cd)?,
            false => None,
        };
        Ok((split_parts(qkv_w), split_parts(qkv_b), split_parts(gu)))
    }

    /// Adds layer `l`'s parameters.
    fn layer(&mut self, cfg: &Config, l: usize) -> Result<Layer> {
        let (d, f, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
        let (qd, kd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let p = format!("model.layers.{l}.");
        let ((qkv_all, [wq, wk, wv]), (qkv_b_all, [bq, bk, bv]), (gu_all, [wg, wu])) =
            self.fused_groups(cfg)?;
        let bias = |me: &mut Self, name: &str, n: usize, into: Option<B::Buf>| {
            let name = format!("{p}self_attn.{name}.bias");
            cfg.qkv_bias
                .then(|| me.add(name, vec![n], into))
                .transpose()
        };
        let in_norm = self.add(format!("{p}input_layernorm.weight"), vec![d], None)?;
        let q = self.add(format!("{p}self_attn.q_proj.weight"), vec![qd, d], wq)?;
        let q_b = bias(self, "q_proj", qd, bq)?;
        let k = self.add(format!("{p}self_attn.k_proj.weight"), vec![kd, d], wk)?;
        let k_b = bias(self, "k_proj", kd, bk)?;
        let v = self.add(format!("{p}self_attn.v_proj.weight"), vec![kd, d], wv)?;
        let v_b = bias(self, "v_proj", kd, bv)?;
        let norm = |me: &mut Self, name: &str| {
            let name = format!("{p}self_attn.{name}.weight");
            cfg.qk_norm
                .then(|| me.add(name, vec![hd], None))
                .transpose()
        };
        let q_norm = norm(self, "q_norm")?;
        let k_norm = norm(self, "k_norm")?;
        let o = self.add(format!("{p}self_attn.o_proj.weight"), vec![d, qd], None)?;
        let post_norm = self.add(format!("{p}post_attention_layernorm.weight"), vec![d], None)?;
        let gate = self.add(format!("{p}mlp.gate_proj.weight"), vec![f, d], wg)?;
        let up = self.add(format!("{p}mlp.up_proj.weight"), vec![f, d], wu)?;
        let down = self.add(format!("{p}mlp.down_proj.weight"), vec![d, f], None)?;
        Ok(Layer {
            in_norm,
            q,
            k,
            v,
            q_b,
            k_b,
            v_b,
            q_norm,
            k_norm,
            o,
            post_norm,
            gate,
            up,
            down,
            qkv: self.keep(qkv_all),
            qkv_b: self.keep(qkv_b_all),
            gate_up: self.keep(gu_all),
            lora: [None; 7],
        })
    }
}

/// Tensor `name` of `weights`, checked: present, of `shape`, finite (input errors).
fn check_tensor<'w>(weights: &'w Weights, name: &str, shape: &[usize]) -> Result<&'w Tensor> {
    let t = weights
        .get(name)
        .ok_or_else(|| input_error(format!("model weights: tensor '{name}' is missing")))?;
    if t.shape != shape {
        bail!(input_error(format!(
            "model weights: tensor '{name}' has shape {:?}, config.json implies {shape:?}",
            t.shape
        )));
    }
    if let Some(i) = t.data.iter().position(|x| !x.is_finite()) {
        bail!(input_error(format!(
            "model weights: tensor '{name}' holds a non-finite value at flat index {i}"
        )));
    }
    Ok(t)
}

impl<B: Backend> Decoder<B> {
    /// Builds the decoder from weights keyed by HF name. Missing tensors, wrong shapes and
    /// non-finite values are input errors; tensors the config does not use are ignored (e.g. a
    /// saved `lm_head.weight` of a tied model, or old `rotary_emb.inv_freq` buffers).
    pub fn new(backend: B, cfg: &Config, weights: &Weights) -> Result<Self> {
        Self::build(backend, cfg, Some(weights), Hold::Trainable, None)
    }

    /// A decoder that trains LoRA `adapters` (PEFT's names less `base_model.model.`, checked
    /// against `spec`) on the frozen `base`: the base in the compute dtype with no master,
    /// gradient or optimizer state; the adapters with f32 masters and AdamW. Not for a value
    /// model.
    pub fn with_lora(
        backend: B,
        cfg: &Config,
        base: &Weights,
        adapters: &Weights,
        spec: &LoraSpec,
    ) -> Result<Self> {
        spec.check()?;
        check_adapters(cfg, spec, adapters, "LoRA adapters")?;
        ensure!(!cfg.value_head, "LoRA trains a policy, not a value model");
        let lora = Some((spec, adapters));
        Self::build(backend, cfg, Some(base), Hold::Trainable, lora)
    }

    /// A decoder that only generates and scores: the compute weights of `weights` as a
    /// rollout from checkpoint files has them (bf16-rounded even where the backend computes
    /// in f32, as the files store them), and no f32 masters (where they would be apart from
    /// the compute weights: a bf16 model's f32 copy is twice its size).
    pub fn for_generation(backend: B, cfg: &Config, mut weights: Weights) -> Result<Self> {
        if backend.compute_dtype() == DType::F32 {
            for t in weights.values_mut() {
                t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
            }
        }
        Self::build(backend, cfg, Some(&weights), Hold::Compute, None)
    }

    /// [`Decoder::new`] or [`Decoder::for_generation`] by `hold`; under [`Hold::Nothing`]
    /// the weights are checked but the decoder holds none (empty buffers, no fused ones): what
    /// full sharding starts from (the engine cuts each rank's shards from the host weights).
    /// `weights` None: the buffers of `hold` are allocated (fused parts included) but not
    /// filled, for a caller that writes them on the device (a sharded group's generation copy).
    /// `lora`: the adapters' spec and weights, added after the base's parameters, which are
    /// then frozen.
    fn build(
        backend: B,
        cfg: &Config,
        weights: Option<&Weights>,
        hold: Hold,
        lora: Option<(&LoraSpec, &Weights)>,
    ) -> Result<Self> {
        // Masters are copies of the host weights: nothing to copy without them.
        ensure!(
            weights.is_some() || hold != Hold::Trainable,
            "a trainable decoder needs weights"
        );
        check_config(cfg)?;
        backend.prepare_kernels(cfg.head_dim, hold == Hold::Trainable);
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let mut p = Loader {
            backend: &backend,
            weights,
            hold,
            names: Vec::new(),
            shapes: Vec::new(),
            bufs: Vec::new(),
            masters: Vec::new(),
            fused: Vec::new(),
            frozen: lora.is_some(),
            trains: Vec::new(),
            // A LoRA decoder that trains runs the split GEMMs (its backward needs each
            // projection's own output); one that generates fuses, its adapters stacked.
            no_fuse: lora.is_some() && hold == Hold::Trainable,
        };
        let embed = p.add("model.embed_tokens.weight".into(), vec![v, d], None)?;
        let mut layers = (0..cfg.num_layers)
            .map(|l| p.layer(cfg, l))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = p.add("model.norm.weight".into(), vec![d], None)?;
        let (head, head_bias) = if cfg.value_head {
            let w = p.add(names::VALUE_HEAD.into(), vec![1, d], None)?;
            (w, Some(p.add(names::VALUE_BIAS.into(), vec![1], None)?))
        } else if cfg.tie_word_embeddings {
            (embed, None)
        } else {
            (p.add(names::LM_HEAD.into(), vec![v, d], None)?, None)
        };
        if let Some((spec, adapters)) = lora {
            (p.frozen, p.weights) = (false, Some(adapters));
            for slot in spec.adapters(cfg) {
                let a = p.add(slot.a.0, slot.a.1, None)?;
                let b = p.add(slot.b.0, slot.b.1, None)?;
                layers[slot.layer].lora[lora::slot(slot.target)] = Some((a, b));
            }
        }
        let lora = lora
            .map(|(spec, _)| LoraState::new(&backend, spec))
            .transpose()?;
        let Loader {
            names,
            shapes,
            bufs,
            masters,
            fused,
            trains,
            ..
        } = p;
        let ws = Work::empty(&backend, cfg)?;
        let logprob_chunk = (backend.logprob_chunk_floats() / v).clamp(1, 4096);
        Ok(Decoder {
            backend,
            cfg: cfg.clone(),
            names,
            shapes,
            w: bufs,
            master: masters,
            g: Vec::new(),
            trains,
            lora,
            m: Vec::new(),
            v: Vec::new(),
            step: 0,
            embed,
            final_norm,
            head,
            head_bias,
            layers,
            ws,
            ppo_stats: None,
            logprob_chunk,
            ws_epoch: 0,
            fused,
            fuse: true,
            per_unit: false,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Number of parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// Optimizer steps taken (or loaded).
    pub fn optimizer_steps(&self) -> u64 {
        self.step
    }

    /// The weights by HF name (a tied head is not repeated as `lm_head.weight`, as HF saves it):
    /// the f32 masters where the decoder keeps them.
    pub fn export_weights(&self) -> Result<Weights> {
        self.export(self.masters())
    }

    /// The LoRA spec, when the decoder trains adapters.
    pub fn lora_spec(&self) -> Option<&LoraSpec> {
        self.lora.as_ref().map(|l| &l.spec)
    }

    /// Switches the adapters off (the passes then compute the frozen base model alone, e.g.
    /// the reference of a LoRA run) or back on; a no-op without adapters.
    pub fn set_adapters_on(&mut self, on: bool) {
        if let Some(l) = &mut self.lora {
            if l.off == on {
                l.off = !on;
                // Decode graphs captured with the other setting would replay it.
                self.ws_epoch += 1;
            }
        }
    }

    /// The trained LoRA adapters (their f32 masters) by name, without the base; empty without
    /// LoRA.
    pub fn export_adapters(&self) -> Result<Weights> {
        let mut all = self.export_where(self.masters(), |i| self.trains[i])?;
        if self.lora.is_none() {
            all.clear();
        }
        Ok(all)
    }

    /// The weights the forward pass reads, widened to f32 (the masters rounded to the backend's
    /// compute dtype); for checks.
    pub fn export_compute_weights(&self) -> Result<Weights> {
        self.export(&self.w)
    }

    /// The f32 weights the optimizer updates.
    pub(crate) fn masters(&self) -> &[B::Buf] {
        if self.master.is_empty() {
            &self.w
        } else {
            &self.master
        }
    }

    fn export(&self, bufs: &[B::Buf]) -> Result<Weights> {
        self.export_where(bufs, |_| true)
    }

    /// The parameters `keep` picks, from `bufs` (a frozen parameter's empty buffer there: from
    /// the compute weights, its only copy).
    fn export_where(&self, bufs: &[B::Buf], keep: impl Fn(usize) -> bool) -> Result<Weights> {
        let mut out = Weights::new();
        for (i, (name, shape)) in self.names.iter().zip(&self.shapes).enumerate() {
            if !keep(i) {
                continue;
            }
            let mut t = Tensor::zeros(shape.clone());
            let buf = match self.trains[i] || self.backend.len(&bufs[i]) > 0 {
                true => &bufs[i],
                false => &self.w[i],
            };
            self.backend.download(buf, &mut t.data)?;
            out.insert(name.clone(), t);
        }
        Ok(out)
    }

    /// Whether paged steps run the fused projections.
    fn fuses(&self) -> bool {
        // Not in batch-invariant mode: training runs the split GEMMs, and a fused one rounds
        // differently (the point of the mode is that rollout and training round alike).
        self.fuse
            && !self.fused.is_empty()
            && !self.backend.batch_invariant()
            && self.lora.as_ref().is_none_or(|l| !l.stacked.is_empty())
    }

    /// Turns the fused q/k/v and gate/up GEMMs of paged steps on (the default) or
    /// off, e.g. to compare the two; returns whether this decoder has fused buffers (not on a
    /// backend without shared buffers, nor for q/k/v under Qwen3's qk_norm). Decode graphs
    /// captured before are captured again.
    pub fn set_fused_projections(&mut self, on: bool) -> bool {
        if on != self.fuse {
            self.fuse = on;
            self.ws_epoch += 1;
        }
        !self.fused.is_empty()
    }

    fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
        let vocab = self.cfg.vocab_size;
        if let Some((t, &id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab)
        {
            bail!(input_error(format!(
                "{what}: token id {id} at position {t} is outside the vocabulary ({vocab})"
            )));
        }
        Ok(())
    }
}

/// What the engine's sharded training (`engine::shard`) reaches of the decoder: the parameters'
/// names and shapes, their buffers (compute weights, masters, moments, gradients) and the step
/// count, and the holding of the weights unit by unit.
impl<B: Backend> Decoder<B> {
    /// A decoder that holds no weights (the names and shapes only), from checked `weights`.
    pub(crate) fn unloaded(backend: B, cfg: &Config, weights: &Weights) -> Result<Self> {
        Self::build(backend, cfg, Some(weights), Hold::Nothing, None)
    }

    /// [`Decoder::for_generation`]'s buffers (fused parts included), not filled.
    pub(crate) fn unfilled_for_generation(backend: B, cfg: &Config) -> Result<Self> {
        Self::build(backend, cfg, None, Hold::Compute, None)
    }

    /// The parameters' HF names, in order.
    pub(crate) fn param_names(&self) -> &[String] {
        &self.names
    }

    /// The parameters' shapes, in order.
    pub(crate) fn param_shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// The parameters' element counts, in order.
    pub(crate) fn param_sizes(&self) -> Vec<usize> {
        self.shapes.iter().map(|s| s.iter().product()).collect()
    }

    /// The elements the optimizer updates of each parameter, in order: its element count, or
    /// 0 for a frozen one (LoRA's base, which has no master, gradient or moments).
    pub(crate) fn trained_sizes(&self) -> Vec<usize> {
        let sizes = self.param_sizes();
        sizes
            .iter()
            .zip(&self.trains)
            .map(|(&n, &t)| if t { n } else { 0 })
            .collect()
    }

    /// The backend and the compute weights, for a caller that writes them whole (a weight
    /// sync).
    pub(crate) fn weights_mut(&mut self) -> (&B, &mut [B::Buf]) {
        (&self.backend, &mut self.w)
    }

    /// The gradient buffers.
    pub(crate) fn grads(&self) -> &[B::Buf] {
        &self.g
    }

    /// The Adam moments, taken out of the decoder (None before any step or load).
    pub(crate) fn take_moments(&mut self) -> Option<Moments<B>> {
        match self.m.is_empty() {
            true => None,
            false => Some((std::mem::take(&mut self.m), std::mem::take(&mut self.v))),
        }
    }

    /// Puts whole f32 masters (where the compute dtype is not f32) and moments back.
    pub(crate) fn put_state(&mut self, master: Option<Vec<B::Buf>>, moments: Option<Moments<B>>) {
        if let Some(master) = master {
            self.master = master;
        }
        if let Some((m, v)) = moments {
            (self.m, self.v) = (m, v);
        }
    }

    /// Counts one more optimizer step; returns the new count (AdamW's bias correction).
    pub(crate) fn count_step(&mut self) -> u64 {
        self.step += 1;
        self.step
    }

    pub(crate) fn set_optimizer_steps(&mut self, step: u64) {
        self.step = step;
    }

    /// From now on the passes' hooks hold the weights and gradients unit by unit: the
    /// decoder frees its compute weights, its fused projections (parts of the whole weights:
    /// the passes run the split GEMMs) and its gradients, and keeps empty buffers.
    pub(crate) fn hold_per_unit(&mut self) -> Result<()> {
        let cd = self.backend.compute_dtype();
        self.fused.clear();
        for ly in &mut self.layers {
            (ly.qkv, ly.qkv_b, ly.gate_up) = (None, None, None);
        }
        for w in &mut self.w {
            *w = self.backend.alloc_as(0, cd)?;
        }
        self.per_unit = true;
        self.g.clear();
        self.ensure_grads()?;
        self.ws_epoch += 1;
        Ok(())
    }

    /// The whole compute weights `w` back (fresh buffers: no fused ones), after
    /// [`Decoder::hold_per_unit`]; the next backward allocates the gradients again.
    pub(crate) fn hold_whole(&mut self, w: Vec<B::Buf>) {
        self.w = w;
        self.per_unit = false;
        self.g.clear();
        self.ws_epoch += 1;
    }
}
