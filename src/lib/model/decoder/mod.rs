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
//! Files: `forward` (the layer loop, packing, scoring), `head` (final norm, LM head, fused
//! log-prob), `backward` (training passes), `optim` (AdamW and its state), `step` (paged
//! steps), `workspace` (activation and gradient buffers).

mod backward;
mod forward;
mod head;
mod optim;
mod shard;
mod step;
mod workspace;

pub use optim::{AdamWParams, OptimizerState, StepReport};
pub use shard::{
    Buckets, Holding, HostShard, Overlap, PassComm, ShardLayout, ShardStats, ShardedOptim,
};
pub use step::{PagedAttn, StepRows};

use anyhow::{bail, ensure, Result};

use crate::backend::{Backend, DType, Parts};
use crate::error::input_error;
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Tensor, Weights};
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
    /// Gradients, allocated on the first `forward_backward`.
    g: Vec<B::Buf>,
    /// Adam moments, allocated on the first optimizer step (or by loading a state).
    m: Vec<B::Buf>,
    v: Vec<B::Buf>,
    step: u64,
    embed: usize,
    final_norm: usize,
    /// The LM head: `embed` when the embeddings are tied.
    head: usize,
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

impl<B: Backend> Decoder<B> {
    /// Builds the decoder from weights keyed by HF name. Missing tensors, wrong shapes and
    /// non-finite values are input errors; tensors the config does not use are ignored (e.g. a
    /// saved `lm_head.weight` of a tied model, or old `rotary_emb.inv_freq` buffers).
    pub fn new(backend: B, cfg: &Config, weights: &Weights) -> Result<Self> {
        Self::build(backend, cfg, Some(weights), Hold::Trainable)
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
        Self::build(backend, cfg, Some(&weights), Hold::Compute)
    }

    /// [`Decoder::new`] or [`Decoder::for_generation`] by `hold`; under [`Hold::Nothing`]
    /// the weights are checked but the decoder holds none (empty buffers, no fused ones): what
    /// full sharding starts from ([`Decoder::new_full`] cuts each rank's shards from the host
    /// weights).
    /// `weights` None: the buffers of `hold` are allocated (fused parts included) but not
    /// filled, for a caller that writes them on the device ([`Decoder::gather_generation`]).
    fn build(backend: B, cfg: &Config, weights: Option<&Weights>, hold: Hold) -> Result<Self> {
        let upload = hold != Hold::Nothing;
        // Masters are copies of the host weights: nothing to copy without them.
        ensure!(
            weights.is_some() || hold != Hold::Trainable,
            "a trainable decoder needs weights"
        );
        check_config(cfg)?;
        let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (qd, kd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let mut names = Vec::new();
        let mut shapes = Vec::new();
        let mut bufs = Vec::new();
        let mut masters = Vec::new();
        let cd = backend.compute_dtype();
        // `into`: the buffer to upload into (a part of a fused buffer); None allocates one.
        let mut add = |name: String, shape: Vec<usize>, into: Option<B::Buf>| -> Result<usize> {
            if let Some(weights) = weights {
                let t = weights.get(&name).ok_or_else(|| {
                    input_error(format!("model weights: tensor '{name}' is missing"))
                })?;
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
            }
            if !upload {
                names.push(name);
                shapes.push(shape);
                bufs.push(backend.alloc_as(0, cd)?);
                return Ok(bufs.len() - 1);
            }
            let n = shape.iter().product();
            let mut buf = match into {
                Some(b) => b,
                None => backend.alloc_as(n, cd)?,
            };
            if let Some(t) = weights.and_then(|w| w.get(&name)) {
                backend.upload(&mut buf, &t.data)?;
                if cd != DType::F32 && hold == Hold::Trainable {
                    let mut m = backend.alloc(n)?;
                    backend.upload(&mut m, &t.data)?;
                    masters.push(m);
                }
            }
            names.push(name);
            shapes.push(shape);
            bufs.push(buf);
            Ok(bufs.len() - 1)
        };
        let embed = add("model.embed_tokens.weight".into(), vec![v, d], None)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut fused = Vec::new();
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}.");
            // q/k/v (with their biases) and gate/up as parts of one buffer each where the
            // backend can share memory: paged steps run each group as one GEMM.
            // Qwen3's per-head norm sits between the projections and rope: q/k/v stay apart.
            let qkv_w = if cfg.qk_norm || !upload {
                None
            } else {
                contiguous_parts(&backend, &[qd * d, kd * d, kd * d], cd)?
            };
            let qkv_b = match (&qkv_w, cfg.qkv_bias) {
                (Some(_), true) => contiguous_parts(&backend, &[qd, kd, kd], cd)?,
                _ => None,
            };
            let qkv_w = if cfg.qkv_bias && qkv_b.is_none() {
                None
            } else {
                qkv_w
            };
            let (qkv_all, [wq, wk, wv]) = split_parts(qkv_w);
            let (qkv_b_all, [bq, bk, bv]) = split_parts(qkv_b);
            let gu = match upload {
                true => contiguous_parts(&backend, &[f * d, f * d], cd)?,
                false => None,
            };
            let (gu_all, [wg, wu]) = split_parts(gu);
            let bias =
                |add: &mut dyn FnMut(String, Vec<usize>, Option<B::Buf>) -> Result<usize>,
                 name: &str,
                 n: usize,
                 into: Option<B::Buf>| {
                    if cfg.qkv_bias {
                        add(format!("{p}self_attn.{name}.bias"), vec![n], into).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            let in_norm = add(format!("{p}input_layernorm.weight"), vec![d], None)?;
            let q = add(format!("{p}self_attn.q_proj.weight"), vec![qd, d], wq)?;
            let q_b = bias(&mut add, "q_proj", qd, bq)?;
            let k = add(format!("{p}self_attn.k_proj.weight"), vec![kd, d], wk)?;
            let k_b = bias(&mut add, "k_proj", kd, bk)?;
            let vv = add(format!("{p}self_attn.v_proj.weight"), vec![kd, d], wv)?;
            let v_b = bias(&mut add, "v_proj", kd, bv)?;
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(add(
                        format!("{p}self_attn.q_norm.weight"),
                        vec![cfg.head_dim],
                        None,
                    )?),
                    Some(add(
                        format!("{p}self_attn.k_norm.weight"),
                        vec![cfg.head_dim],
                        None,
                    )?),
                )
            } else {
                (None, None)
            };
            let o = add(format!("{p}self_attn.o_proj.weight"), vec![d, qd], None)?;
            let post_norm = add(format!("{p}post_attention_layernorm.weight"), vec![d], None)?;
            let gate = add(format!("{p}mlp.gate_proj.weight"), vec![f, d], wg)?;
            let up = add(format!("{p}mlp.up_proj.weight"), vec![f, d], wu)?;
            let down = add(format!("{p}mlp.down_proj.weight"), vec![d, f], None)?;
            let mut keep = |b: Option<B::Buf>| {
                b.map(|b| {
                    fused.push(b);
                    fused.len() - 1
                })
            };
            let (qkv, qkv_b, gate_up) = (keep(qkv_all), keep(qkv_b_all), keep(gu_all));
            layers.push(Layer {
                in_norm,
                q,
                k,
                v: vv,
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
                qkv,
                qkv_b,
                gate_up,
            });
        }
        let final_norm = add("model.norm.weight".into(), vec![d], None)?;
        let head = if cfg.tie_word_embeddings {
            embed
        } else {
            add("lm_head.weight".into(), vec![v, d], None)?
        };
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
            m: Vec::new(),
            v: Vec::new(),
            step: 0,
            embed,
            final_norm,
            head,
            layers,
            ws,
            ppo_stats: None,
            logprob_chunk,
            ws_epoch: 0,
            fused,
            fuse: true,
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

    /// The weights the forward pass reads, widened to f32 (the masters rounded to the backend's
    /// compute dtype); for checks.
    pub fn export_compute_weights(&self) -> Result<Weights> {
        self.export(&self.w)
    }

    /// The f32 weights the optimizer updates.
    fn masters(&self) -> &[B::Buf] {
        if self.master.is_empty() {
            &self.w
        } else {
            &self.master
        }
    }

    fn export(&self, bufs: &[B::Buf]) -> Result<Weights> {
        let mut out = Weights::new();
        for ((name, shape), buf) in self.names.iter().zip(&self.shapes).zip(bufs) {
            let mut t = Tensor::zeros(shape.clone());
            self.backend.download(buf, &mut t.data)?;
            out.insert(name.clone(), t);
        }
        Ok(out)
    }

    /// Whether paged steps run the fused projections.
    fn fuses(&self) -> bool {
        // Not in batch-invariant mode: training runs the split GEMMs, and a fused one rounds
        // differently (the point of the mode is that rollout and training round alike).
        self.fuse && !self.fused.is_empty() && !self.backend.batch_invariant()
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
