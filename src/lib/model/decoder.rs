//! The Qwen2 / Llama / Qwen3 decoder, written once against the [`Backend`] op set.
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
//! pass), and generation against a KV cache ([`Decoder::prefill`], [`Decoder::decode`]).
//! Activations live in a workspace sized for the largest call so far; it grows at the start of
//! a call, never inside the layer loop.
//!
//! Where the backend can share memory between buffers (`Backend::alloc_parts`, CUDA), the
//! q/k/v weights (and biases) and the gate/up weights of a layer are parts of one buffer each,
//! so cached and paged steps run x·[Wq; Wk; Wv]ᵀ and x·[Wg; Wu]ᵀ as one GEMM each (fewer,
//! wider GEMMs at decode batch sizes). Packed calls (training, scoring) keep the split GEMMs.

use anyhow::{bail, ensure, Result};

use std::collections::VecDeque;

use crate::backend::{
    AdamWStep, AttnShape, Backend, CachedAttnShape, DType, LogprobShape, PagedAttnShape, Parts,
    PpoShape, FEED_NONE, PAGED_TILE_ROWS, PPO_STATS,
};
use crate::engine::paged::{Chunk, SampleRow};
use crate::engine::sampling::{Sampled, SamplingParams};
use crate::error::input_error;
use crate::model::{Config, Tensor, Weights};

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

/// A contiguous KV cache: `slots` sequences of up to `max_len` tokens each, per layer. Row
/// `slot · max_len + pos` of a layer's buffer holds the key (value) of that position.
pub struct KvCache<B: Backend> {
    k: Vec<B::Buf>,
    v: Vec<B::Buf>,
    lens: Vec<usize>,
    max_len: usize,
}

impl<B: Backend> KvCache<B> {
    /// Forget a slot's contents so it can be prefilled again.
    pub fn free(&mut self, slot: usize) {
        assert!(slot < self.lens.len(), "KV cache has no slot {slot}");
        self.lens[slot] = 0;
    }

    /// Tokens held in a slot.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    /// Whether a slot holds no tokens.
    pub fn is_empty(&self, slot: usize) -> bool {
        self.lens[slot] == 0
    }

    pub fn slots(&self) -> usize {
        self.lens.len()
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }
}

/// A paged KV cache: `num_blocks` blocks of `block_size` positions per layer; row
/// `block · block_size + offset` of a layer's buffer holds the key (value) of one position.
/// It also holds the device-side inputs and outputs of a paged step (block tables, sampling
/// keys, drawn tokens), so a step allocates nothing once they have grown.
pub struct PagedKv<B: Backend> {
    /// One block more than `num_blocks`: the last one is where the padding rows of a
    /// graph-replayed decode step write and read (never given to a sequence).
    k: Vec<B::Buf>,
    v: Vec<B::Buf>,
    num_blocks: usize,
    block_size: usize,
    tables: B::Idx,
    max_blocks: usize,
    /// The step's prefill tiles (see `Backend::attention_paged_tiled`): `n_tiles` pairs (first
    /// row, rows) after its `decode_rows` single-token rows; none in a pure-decode step.
    tiles: B::Idx,
    n_tiles: usize,
    decode_rows: usize,
    keys: B::Idx,
    positions: B::Idx,
    /// Per row of a step, the row of the step before whose draw it feeds (`FEED_NONE`: the
    /// token uploaded for it); see `Decoder::submit_paged`.
    feed: B::Idx,
    tokens: B::Idx,
    logprobs: B::Buf,
    /// Bumped whenever one of the buffers above is reallocated (see `Decoder::ws_epoch`).
    epoch: u64,
    graphs: DecodeGraphs,
    /// Draws of submitted steps not yet collected, oldest first (at most two).
    pending: VecDeque<Pending>,
    /// Steps submitted so far (their draws alternate between two landing slots).
    submitted: usize,
}

/// A submitted step's draws: already on the host, or on their way through a slot.
enum Pending {
    Ready(Vec<Sampled>),
    Slot(usize, usize),
}

/// How the pure-decode steps of a paged cache run (every chunk one token).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphMode {
    /// As every other step: the batch as it is.
    #[default]
    Eager,
    /// Padded exactly as for a graph (rows to the bucket, tables to the fixed width), run
    /// eagerly: the reference a graph replay must equal bit for bit.
    Padded,
    /// Padded, captured once per (bucket, sampling) as a graph and replayed (CUDA).
    Graphs,
}

/// Counters of the decode graphs of one paged cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Decode steps replayed from a graph, run padded eagerly, and run as they are.
    pub replays: usize,
    pub padded_steps: usize,
    pub eager_steps: usize,
    /// Graphs captured (a bucket again after a workspace reallocation counts again).
    pub captures: usize,
    /// Rows computed for padding (bucket − batch, summed over padded steps).
    pub padding_rows: usize,
    /// Device memory the graphs kept for their temporaries (given back on release).
    pub graph_bytes: usize,
    /// Wall time of the captures: each bucket's eager first run, the capture and the
    /// instantiation (microseconds).
    pub capture_us: u64,
    /// Times the graphs were dropped because a buffer they read moved.
    pub drops: usize,
}

/// Pure-decode steps padded to a bucket of rows and a fixed table width, so that their
/// kernels have fixed shapes and read fixed buffers: captured once per bucket as a graph.
#[derive(Debug, Default)]
struct DecodeGraphs {
    mode: GraphMode,
    /// Blocks per table of a padded step (longest sequence the engine may run).
    width: usize,
    /// Largest bucket: steps with more rows run eagerly.
    max_rows: usize,
    /// (bucket, temperature bits, top_k, top_p bits) → graph id.
    captured: Vec<((usize, u32, i64, u32), usize)>,
    /// Pure-decode steps run so far per key: a bucket is captured at its CAPTURE_AT-th step.
    uses: Vec<((usize, u32, i64, u32), usize)>,
    /// (workspace epoch, cache epoch) the fixed buffers were sized at (None: not yet).
    epochs: Option<(u64, u64)>,
    stats: GraphStats,
}

/// The step of a bucket that is captured; the ones before run padded eagerly (the first also
/// compiles kernels and plans GEMMs). A capture costs ~15 ms on an H100, several eager steps:
/// the buckets a batch passes through only as it drains (a step or two each) stay eager.
const CAPTURE_AT: usize = 3;

/// Row counts a decode step is padded to: powers of two up to 16, then also 1.5× each power
/// of two (at most a third of a step is padding past 16 rows).
pub fn decode_bucket(rows: usize) -> usize {
    let p = rows.max(1).next_power_of_two();
    if p >= 32 && rows <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

impl<B: Backend> PagedKv<B> {
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }
    /// The graph of a decode step captured first, if any (for timing its replay alone).
    pub fn first_graph(&self) -> Option<usize> {
        self.graphs.captured.first().map(|&(_, id)| id)
    }

    /// Chunk `c` must feed positions its table covers, through blocks of this cache.
    fn check_chunk(&self, c: usize, ch: &Chunk) -> Result<()> {
        let end = ch.start + ch.tokens.len();
        ensure!(
            !ch.tokens.is_empty() && end <= ch.table.len() * self.block_size,
            "paged step: chunk {c} feeds positions {}..{end} but its table covers {}",
            ch.start,
            ch.table.len() * self.block_size
        );
        if let Some(&b) = ch.table.iter().find(|&&b| b as usize >= self.num_blocks) {
            bail!(
                "paged step: chunk {c} names block {b} of {}",
                self.num_blocks
            );
        }
        Ok(())
    }

    /// Grows the step's device inputs and outputs to `rows` sample rows and `table_entries`
    /// block-table entries; a reallocation bumps `epoch` (graphs read the old addresses).
    fn grow_step_buffers(&mut self, b: &B, rows: usize, table_entries: usize) -> Result<()> {
        let mut moved = grow_idx(b, &mut self.tables, table_entries)?;
        moved |= grow_idx(b, &mut self.keys, 2 * rows)?;
        moved |= grow_idx(b, &mut self.positions, rows)?;
        moved |= grow_idx(b, &mut self.feed, rows)?;
        moved |= grow_idx(b, &mut self.tokens, rows)?;
        if b.len(&self.logprobs) < rows {
            self.logprobs = b.alloc(rows.next_power_of_two())?;
            moved = true;
        }
        if moved {
            self.epoch += 1;
        }
        Ok(())
    }

    /// Sets the draws of the step just run (its first `rows` sample rows) on their way to the
    /// host, behind it; `collect` returns them.
    fn start_draws(&mut self, b: &B, rows: usize) -> Result<()> {
        let slot = self.submitted % 2;
        self.submitted += 1;
        let p = match b.draws_start(slot, &self.tokens, &self.logprobs, rows)? {
            Some((t, l)) => Pending::Ready(sampled(t, l)),
            None => Pending::Slot(slot, rows),
        };
        self.pending.push_back(p);
        Ok(())
    }

    /// The draws of the oldest submitted step not yet collected.
    fn collect(&mut self, b: &B) -> Result<Vec<Sampled>> {
        match self.pending.pop_front() {
            Some(Pending::Ready(d)) => Ok(d),
            Some(Pending::Slot(slot, rows)) => {
                let (t, l) = b.draws_wait(slot, rows)?;
                Ok(sampled(t, l))
            }
            None => bail!("paged step: nothing submitted to collect"),
        }
    }

    /// The per-row feed sources of a step (`FEED_NONE` where a row keeps its own token).
    fn upload_feed(&mut self, b: &B, feed: &[u32]) -> Result<()> {
        b.upload_idx(&mut self.feed, feed)
    }
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

/// What the workspace must hold.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Caps {
    tokens: usize,
    seqs: usize,
    rows: usize,
    /// 1 for inference, num_layers for training.
    saved_layers: usize,
    backward: bool,
    /// The fused projections' outputs (`Work::qkv`, `Work::gu`).
    fused: bool,
}

impl Caps {
    fn covers(&self, o: &Caps) -> bool {
        self.tokens >= o.tokens
            && self.seqs >= o.seqs
            && self.rows >= o.rows
            && self.saved_layers >= o.saved_layers
            && (self.backward || !o.backward)
            && (self.fused || !o.fused)
    }

    fn max(&self, o: &Caps) -> Caps {
        Caps {
            tokens: self.tokens.max(o.tokens),
            seqs: self.seqs.max(o.seqs),
            rows: self.rows.max(o.rows),
            saved_layers: self.saved_layers.max(o.saved_layers),
            backward: self.backward || o.backward,
            fused: self.fused || o.fused,
        }
    }
}

/// Activations of one layer (training keeps one per layer; inference reuses one).
struct Acts<B: Backend> {
    xn1: B::Buf,
    rstd1: B::Buf,
    q_raw: B::Buf,
    k_raw: B::Buf,
    rstd_q: B::Buf,
    rstd_k: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
    xn2: B::Buf,
    rstd2: B::Buf,
    g: B::Buf,
    u: B::Buf,
    /// swiglu(g, u), kept for the backward pass when training (empty otherwise).
    h: B::Buf,
}

/// Gradient scratch of the backward pass (one set, reused by every layer).
struct GradWork<B: Backend> {
    d_resid: B::Buf,
    /// d_resid rounded to the compute dtype once for the two GEMMs that read it (empty when
    /// the compute dtype is f32).
    d_resid_c: B::Buf,
    d_xn: B::Buf,
    d_o: B::Buf,
    dq: B::Buf,
    dk: B::Buf,
    dv: B::Buf,
    dq_raw: B::Buf,
    dk_raw: B::Buf,
    dg: B::Buf,
    du: B::Buf,
    dh: B::Buf,
    dxf: B::Buf,
    dxg: B::Buf,
    dlp: B::Buf,
    dent: B::Buf,
    /// Inputs of the device-side PPO loss: old log-probs, advantages, weights (3 per row).
    old: B::Buf,
    adv: B::Buf,
    lw: B::Buf,
}

struct Work<B: Backend> {
    caps: Caps,
    ids: B::Idx,
    pos: B::Idx,
    cu: B::Idx,
    rows: B::Idx,
    targets: B::Idx,
    kv_rows: B::Idx,
    kv_base: B::Idx,
    kv_len: B::Idx,
    /// Residual stream: one buffer updated in place (inference) or 2L+1 snapshots (training:
    /// layer l reads `2l`, its attention writes `2l+1`, its MLP writes `2l+2`).
    resid: Vec<B::Buf>,
    acts: Vec<Acts<B>>,
    /// Outputs of the fused projections of a cached or paged step: [tokens, qd + 2·kd] and
    /// [tokens, 2·intermediate] (empty unless `caps.fused`).
    qkv: B::Buf,
    gu: B::Buf,
    h: B::Buf,
    xg: B::Buf,
    xf: B::Buf,
    rstd_f: B::Buf,
    lp: B::Buf,
    ent: B::Buf,
    lse_lp: B::Buf,
    grad: Option<GradWork<B>>,
    /// One chunk of logits for the fused log-prob (`logprob_chunk × vocab`).
    scratch: B::Buf,
    /// Logits returned by prefill/decode (`rows × vocab`, grown on demand).
    logits: B::Buf,
}

impl<B: Backend> Work<B> {
    /// A workspace that holds nothing yet.
    fn empty(b: &B, cfg: &Config) -> Result<Self> {
        Self::new(b, cfg, Caps::default())
    }

    fn new(b: &B, d: &Config, c: Caps) -> Result<Self> {
        let (t, n) = (c.tokens, c.rows);
        let (hd, qd, kd, f) = (
            d.hidden_size,
            d.num_heads * d.head_dim,
            d.num_kv_heads * d.head_dim,
            d.intermediate_size,
        );
        let qk = d.qk_norm;
        // Activations and the gradients that only feed GEMMs take the backend's compute dtype;
        // statistics (rstd, lse), log-probs and the gradients that accumulate stay f32.
        let cd = b.compute_dtype();
        let ac = |n: usize| b.alloc_as(n, cd);
        let mut acts = Vec::with_capacity(c.saved_layers);
        for _ in 0..c.saved_layers {
            acts.push(Acts {
                xn1: ac(t * hd)?,
                rstd1: b.alloc(t)?,
                q_raw: ac(if qk { t * qd } else { 0 })?,
                k_raw: ac(if qk { t * kd } else { 0 })?,
                rstd_q: b.alloc(if qk { t * d.num_heads } else { 0 })?,
                rstd_k: b.alloc(if qk { t * d.num_kv_heads } else { 0 })?,
                q: ac(t * qd)?,
                k: ac(t * kd)?,
                v: ac(t * kd)?,
                o: ac(t * qd)?,
                lse: b.alloc(t * d.num_heads)?,
                xn2: ac(t * hd)?,
                rstd2: b.alloc(t)?,
                g: ac(t * f)?,
                u: ac(t * f)?,
                h: ac(if c.backward { t * f } else { 0 })?,
            });
        }
        let n_resid = if c.saved_layers > 1 {
            2 * c.saved_layers + 1
        } else {
            1
        };
        // The residual stream stays f32 whatever the compute dtype (as under torch autocast):
        // rounding it to bf16 after every block was over a third of the bf16 log-prob error
        // (docs/BENCHMARKS.md, "Where the bf16 log-prob error comes from").
        let mut resid = Vec::with_capacity(n_resid);
        for _ in 0..n_resid {
            resid.push(b.alloc(t * hd)?);
        }
        let grad = if c.backward {
            Some(GradWork {
                d_resid: b.alloc(t * hd)?,
                d_resid_c: ac(if cd == DType::F32 { 0 } else { t * hd })?,
                d_xn: b.alloc(t * hd)?,
                d_o: ac(t * qd)?,
                dq: ac(t * qd)?,
                dk: ac(t * kd)?,
                dv: ac(t * kd)?,
                dq_raw: ac(if qk { t * qd } else { 0 })?,
                dk_raw: ac(if qk { t * kd } else { 0 })?,
                dg: ac(t * f)?,
                du: ac(t * f)?,
                dh: ac(t * f)?,
                dxf: b.alloc(n * hd)?,
                dxg: b.alloc(n * hd)?,
                dlp: b.alloc(n)?,
                dent: b.alloc(n)?,
                old: b.alloc(n)?,
                adv: b.alloc(n)?,
                lw: b.alloc(3 * n)?,
            })
        } else {
            None
        };
        Ok(Work {
            caps: c,
            ids: b.alloc_idx(t)?,
            pos: b.alloc_idx(t)?,
            cu: b.alloc_idx(c.seqs + 1)?,
            rows: b.alloc_idx(n)?,
            targets: b.alloc_idx(n)?,
            kv_rows: b.alloc_idx(t)?,
            kv_base: b.alloc_idx(t)?,
            kv_len: b.alloc_idx(t)?,
            resid,
            acts,
            qkv: ac(if c.fused { t * (qd + 2 * kd) } else { 0 })?,
            gu: ac(if c.fused { t * 2 * f } else { 0 })?,
            h: ac(t * f)?,
            xg: ac(n * hd)?,
            xf: ac(n * hd)?,
            rstd_f: b.alloc(n)?,
            lp: b.alloc(n)?,
            ent: b.alloc(n)?,
            lse_lp: b.alloc(n)?,
            grad,
            scratch: b.alloc(0)?,
            logits: b.alloc(0)?,
        })
    }
}

/// How the attention of a forward pass gets its keys.
enum AttnMode<'a, B: Backend> {
    /// Packed sequences, keys from this call only.
    Packed,
    /// Keys and values are stored into the cache first, then read from it.
    Cached(&'a mut KvCache<B>),
    /// The same through block tables (`kv_rows` are the cache rows of the new tokens,
    /// `kv_base` the table row of each query, `kv_len` its context length).
    Paged(&'a mut PagedKv<B>),
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
    /// Whether cached and paged steps use `fused` (`set_fused_projections`).
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
            let t = weights
                .get(&name)
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
            let mut buf = match into {
                Some(b) => b,
                None => backend.alloc_as(t.numel(), cd)?,
            };
            backend.upload(&mut buf, &t.data)?;
            if cd != DType::F32 {
                let mut m = backend.alloc(t.numel())?;
                backend.upload(&mut m, &t.data)?;
                masters.push(m);
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
            // backend can share memory: cached and paged steps run each group as one GEMM.
            // Qwen3's per-head norm sits between the projections and rope: q/k/v stay apart.
            let qkv_w = if cfg.qk_norm {
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
            let (gu_all, [wg, wu]) = split_parts(contiguous_parts(&backend, &[f * d, f * d], cd)?);
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

    /// Whether cached and paged steps run the fused projections.
    fn fuses(&self) -> bool {
        // Not in batch-invariant mode: training runs the split GEMMs, and a fused one rounds
        // differently (the point of the mode is that rollout and training round alike).
        self.fuse && !self.fused.is_empty() && !self.backend.batch_invariant()
    }

    /// What a cached or paged step of `tokens` tokens and `rows` output rows needs.
    fn step_caps(&self, tokens: usize, rows: usize) -> Caps {
        Caps {
            tokens,
            seqs: 1,
            rows,
            saved_layers: 1,
            backward: false,
            fused: self.fuses(),
        }
    }

    /// Turns the fused q/k/v and gate/up GEMMs of cached and paged steps on (the default) or
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

    /// Grows the workspace (all at once, before any layer runs) so it covers `need`.
    fn reserve(&mut self, need: Caps) -> Result<()> {
        if !self.ws.caps.covers(&need) {
            let caps = self.ws.caps.max(&need);
            // Drop the old workspace first so peak memory is one workspace, not two.
            self.ws = Work::empty(&self.backend, &self.cfg)?;
            self.ws = Work::new(&self.backend, &self.cfg, caps)?;
            self.ws_epoch += 1;
        }
        Ok(())
    }

    /// Frees the activation workspace (it grows back on the next call): what a colocated
    /// engine does between phases, e.g. after an update and before generation.
    /// ws.xf = final_norm(resid[last][rows]) for the `r` rows listed in ws.rows: the hidden
    /// states the LM head reads (scoring, cached decode and paged steps alike). The gather
    /// also rounds the f32 residual to the compute dtype, in every path: a decode step that
    /// normed its rows in place would round differently from training (measured: 1.3e-3 mean
    /// |Δ log-prob| against `ref-logprob` in batch-invariant mode).
    fn final_rows(&mut self, last: usize, r: usize) -> Result<()> {
        let Decoder {
            backend: b,
            cfg,
            w,
            ws,
            final_norm,
            ..
        } = self;
        let d = cfg.hidden_size;
        b.gather_rows(&mut ws.xg, &ws.resid[last], &ws.rows, r, d)?;
        b.rmsnorm(
            &mut ws.xf,
            &mut ws.rstd_f,
            &ws.xg,
            &w[*final_norm],
            r,
            d,
            cfg.rms_norm_eps,
        )
    }

    /// ws.logits[r, vocab] = ws.xf · headᵀ (full logits of the `r` final rows).
    fn head_logits(&mut self, r: usize) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let Decoder {
            backend: b,
            w,
            ws,
            head,
            ..
        } = self;
        b.matmul(&mut ws.logits, &ws.xf, &w[*head], None, r, d, v, false)
    }

    pub fn release_workspace(&mut self) -> Result<()> {
        self.ws = Work::empty(&self.backend, &self.cfg)?;
        self.ws_epoch += 1;
        Ok(())
    }

    /// Makes the fused log-prob's scratch hold one chunk of logits.
    fn reserve_logprob_scratch(&mut self) -> Result<()> {
        let n = self.logprob_chunk.max(1) * self.cfg.vocab_size;
        if self.backend.len(&self.ws.scratch) < n {
            self.ws.scratch = self.backend.alloc(0)?;
            self.ws.scratch = self.backend.alloc(n)?;
        }
        Ok(())
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

    /// Packs `seqs` and uploads ids, positions, offsets, scored rows and targets. Returns
    /// (tokens, scored rows).
    fn pack(&mut self, seqs: &[SeqRef], train: bool) -> Result<(usize, usize)> {
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        let mut cu = vec![0u32];
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        for (s, seq) in seqs.iter().enumerate() {
            if seq.start == 0 || seq.start > seq.tokens.len() {
                bail!(input_error(format!(
                    "sequence {s}: scoring starts at {} but must be in 1..={} (its length)",
                    seq.start,
                    seq.tokens.len()
                )));
            }
            self.check_tokens(seq.tokens, &format!("sequence {s}"))?;
            let off = ids.len() as u32;
            for (t, &id) in seq.tokens.iter().enumerate() {
                ids.push(id);
                pos.push(t as u32);
            }
            for t in seq.start..seq.tokens.len() {
                rows.push(off + t as u32 - 1);
                targets.push(seq.tokens[t]);
            }
            cu.push(ids.len() as u32);
        }
        let (n, r) = (ids.len(), rows.len());
        self.reserve(Caps {
            tokens: n,
            seqs: seqs.len(),
            rows: r,
            saved_layers: if train { self.cfg.num_layers.max(1) } else { 1 },
            backward: train,
            fused: false,
        })?;
        if r > 0 {
            self.reserve_logprob_scratch()?;
        }
        let (b, ws) = (&self.backend, &mut self.ws);
        b.upload_idx(&mut ws.ids, &ids)?;
        b.upload_idx(&mut ws.pos, &pos)?;
        b.upload_idx(&mut ws.cu, &cu)?;
        b.upload_idx(&mut ws.rows, &rows)?;
        b.upload_idx(&mut ws.targets, &targets)?;
        Ok((n, r))
    }

    /// Embedding and every layer for `n` tokens whose ids/positions (and offsets or cache rows)
    /// are uploaded. `train` keeps each layer's activations. Returns the index of the residual
    /// buffer that holds the last hidden state.
    fn forward(
        &mut self,
        n: usize,
        seqs: usize,
        train: bool,
        mut mode: AttnMode<B>,
    ) -> Result<usize> {
        // The rollout engine's steps (cached and paged) run the fused projections; training
        // and scoring (packed) keep the split GEMMs, so `update` and `ref-logprob` agree.
        let fuse = self.fuses() && !matches!(mode, AttnMode::Packed);
        let Decoder {
            backend: b,
            cfg,
            w,
            layers,
            ws,
            embed,
            fused,
            ..
        } = self;
        let (d, f, hh, kh, hd) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (qd, kd, eps, theta) = (hh * hd, kh * hd, cfg.rms_norm_eps, cfg.rope_theta);
        ensure!(
            !fuse || ws.caps.fused,
            "decoder: fused step without its workspace"
        );
        b.embedding(&mut ws.resid[0], &w[*embed], &ws.ids, n, d)?;
        for (l, ly) in layers.iter().enumerate() {
            let (ri, rm, ro) = if train {
                (2 * l, 2 * l + 1, 2 * l + 2)
            } else {
                (0, 0, 0)
            };
            let a = &mut ws.acts[if train { l } else { 0 }];
            b.rmsnorm(
                &mut a.xn1,
                &mut a.rstd1,
                &ws.resid[ri],
                &w[ly.in_norm],
                n,
                d,
                eps,
            )?;
            // x·[Wq; Wk; Wv]ᵀ (+ [bq; bk; bv]) as one GEMM into ws.qkv, whose parts the
            // cache write reads; or the three GEMMs into a.q, a.k, a.v.
            let qkv = ly.qkv.filter(|_| fuse);
            if let Some(wi) = qkv {
                b.matmul(
                    &mut ws.qkv,
                    &a.xn1,
                    &fused[wi],
                    ly.qkv_b.map(|i| &fused[i]),
                    n,
                    d,
                    qd + 2 * kd,
                    false,
                )?;
            } else {
                let (q_dst, k_dst) = if cfg.qk_norm {
                    (&mut a.q_raw, &mut a.k_raw)
                } else {
                    (&mut a.q, &mut a.k)
                };
                b.matmul(
                    q_dst,
                    &a.xn1,
                    &w[ly.q],
                    ly.q_b.map(|i| &w[i]),
                    n,
                    d,
                    qd,
                    false,
                )?;
                b.matmul(
                    k_dst,
                    &a.xn1,
                    &w[ly.k],
                    ly.k_b.map(|i| &w[i]),
                    n,
                    d,
                    kd,
                    false,
                )?;
                b.matmul(
                    &mut a.v,
                    &a.xn1,
                    &w[ly.v],
                    ly.v_b.map(|i| &w[i]),
                    n,
                    d,
                    kd,
                    false,
                )?;
                if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
                    b.rmsnorm(&mut a.q, &mut a.rstd_q, &a.q_raw, &w[qn], n * hh, hd, eps)?;
                    b.rmsnorm(&mut a.k, &mut a.rstd_k, &a.k_raw, &w[kn], n * kh, hd, eps)?;
                }
            }
            match &mut mode {
                AttnMode::Packed => {
                    b.rope(&mut a.q, &ws.pos, n, hh, hd, theta)?;
                    b.rope(&mut a.k, &ws.pos, n, kh, hd, theta)?;
                    let shape = AttnShape {
                        tokens: n,
                        seqs,
                        heads: hh,
                        kv_heads: kh,
                        head_dim: hd,
                    };
                    b.attention(&mut a.o, &mut a.lse, &a.q, &a.k, &a.v, &ws.cu, shape)?;
                }
                AttnMode::Cached(cache) => {
                    let (kc, vc) = (&mut cache.k[l], &mut cache.v[l]);
                    let heads = (n, hh, kh, hd);
                    rope_store(
                        b,
                        qkv.is_some(),
                        &ws.qkv,
                        a,
                        &ws.pos,
                        &ws.kv_rows,
                        kc,
                        vc,
                        heads,
                        theta,
                    )?;
                    let shape = CachedAttnShape {
                        queries: n,
                        heads: hh,
                        kv_heads: kh,
                        head_dim: hd,
                    };
                    b.attention_cached(&mut a.o, &a.q, kc, vc, &ws.kv_base, &ws.kv_len, shape)?;
                }
                AttnMode::Paged(cache) => {
                    let PagedKv {
                        k: ks,
                        v: vs,
                        tables,
                        block_size,
                        max_blocks,
                        tiles,
                        n_tiles,
                        decode_rows,
                        ..
                    } = &mut **cache;
                    let (kc, vc) = (&mut ks[l], &mut vs[l]);
                    let shape = PagedAttnShape {
                        queries: n,
                        heads: hh,
                        kv_heads: kh,
                        head_dim: hd,
                        block_size: *block_size,
                        max_blocks: *max_blocks,
                    };
                    if qkv.is_some() && *n_tiles == 0 {
                        // A decode step: rope + kv_store + attention, one kernel on the GPU.
                        b.attention_paged_rope(
                            &mut a.o,
                            &ws.qkv,
                            &mut a.q,
                            &ws.pos,
                            kc,
                            vc,
                            &ws.kv_rows,
                            tables,
                            &ws.kv_base,
                            &ws.kv_len,
                            shape,
                            theta,
                        )?;
                    } else {
                        let heads = (n, hh, kh, hd);
                        rope_store(
                            b,
                            qkv.is_some(),
                            &ws.qkv,
                            a,
                            &ws.pos,
                            &ws.kv_rows,
                            kc,
                            vc,
                            heads,
                            theta,
                        )?;
                        b.attention_paged_tiled(
                            &mut a.o,
                            &a.q,
                            kc,
                            vc,
                            tables,
                            &ws.kv_base,
                            &ws.kv_len,
                            tiles,
                            *n_tiles,
                            *decode_rows,
                            shape,
                        )?;
                    }
                }
            }
            if train {
                // Training keeps the block's input: the output goes to the next snapshot.
                let (src, dst) = pair(&mut ws.resid, ri, rm);
                b.matmul_residual(dst, src, &a.o, &w[ly.o], n, qd, d)?;
            } else {
                b.matmul(&mut ws.resid[rm], &a.o, &w[ly.o], None, n, qd, d, true)?;
            }
            b.rmsnorm(
                &mut a.xn2,
                &mut a.rstd2,
                &ws.resid[rm],
                &w[ly.post_norm],
                n,
                d,
                eps,
            )?;
            // x·[Wg; Wu]ᵀ as one GEMM into ws.gu, or the two GEMMs into a.g, a.u.
            if let Some(wi) = ly.gate_up.filter(|_| fuse) {
                b.matmul(&mut ws.gu, &a.xn2, &fused[wi], None, n, d, 2 * f, false)?;
                b.swiglu_packed(&mut ws.h, &ws.gu, n, f)?;
            } else {
                b.matmul(&mut a.g, &a.xn2, &w[ly.gate], None, n, d, f, false)?;
                b.matmul(&mut a.u, &a.xn2, &w[ly.up], None, n, d, f, false)?;
                let h = if train { &mut a.h } else { &mut ws.h };
                b.swiglu(h, &a.g, &a.u, n * f)?;
            }
            if train {
                let (src, dst) = pair(&mut ws.resid, rm, ro);
                b.matmul_residual(dst, src, &a.h, &w[ly.down], n, f, d)?;
            } else {
                b.matmul(&mut ws.resid[ro], &ws.h, &w[ly.down], None, n, f, d, true)?;
            }
        }
        Ok(if train { 2 * layers.len() } else { 0 })
    }

    /// Rows per LM-head chunk for `r` scored rows: at most `logprob_chunk`, the chunks of
    /// (nearly) equal size so the last GEMM is not a sliver.
    fn chunk_rows(&self, r: usize) -> usize {
        let max = self.logprob_chunk.max(1);
        r.div_ceil(r.div_ceil(max).max(1)).max(1)
    }

    /// Final norm of the scored rows and the fused log-prob; returns per-sequence stats.
    fn score_rows(
        &mut self,
        last: usize,
        seqs: &[SeqRef],
        r: usize,
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        if r == 0 {
            return Ok(seqs
                .iter()
                .map(|_| TokenStats {
                    logprobs: vec![],
                    entropy: entropy.then(Vec::new),
                })
                .collect());
        }
        self.score_device(last, r, temperature, entropy)?;
        let (b, ws) = (&self.backend, &self.ws);
        let mut lp = vec![0.0; r];
        b.download(&ws.lp, &mut lp)?;
        let mut ent = vec![0.0; if entropy { r } else { 0 }];
        if entropy {
            b.download(&ws.ent, &mut ent)?;
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut off = 0;
        for s in seqs {
            let c = s.tokens.len() - s.start;
            out.push(TokenStats {
                logprobs: lp[off..off + c].to_vec(),
                entropy: entropy.then(|| ent[off..off + c].to_vec()),
            });
            off += c;
        }
        Ok(out)
    }

    /// Final norm of the `r > 0` scored rows and the fused log-prob, left on the device
    /// (`ws.lp`, `ws.ent`, `ws.lse_lp`).
    fn score_device(
        &mut self,
        last: usize,
        r: usize,
        temperature: f32,
        entropy: bool,
    ) -> Result<()> {
        let chunk = self.chunk_rows(r);
        self.final_rows(last, r)?;
        let Decoder {
            backend: b,
            cfg,
            w,
            ws,
            head,
            ..
        } = self;
        let d = cfg.hidden_size;
        let shape = LogprobShape {
            rows: r,
            hidden: d,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        let ent = if entropy { Some(&mut ws.ent) } else { None };
        b.logprob(
            &mut ws.lp,
            ent,
            &mut ws.lse_lp,
            &ws.xf,
            &w[*head],
            &ws.targets,
            shape,
            &mut ws.scratch,
        )
    }

    /// Log-probs (and optionally entropies) of every scored token of every sequence, under
    /// softmax(logits / temperature). The sequences are packed into one pass; the caller
    /// bounds its size (micro-batches by token budget).
    pub fn logprobs(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        entropy: bool,
    ) -> Result<Vec<TokenStats>> {
        check_temperature(temperature)?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (n, r) = self.pack(seqs, false)?;
        let last = self.forward(n, seqs.len(), false, AttnMode::Packed)?;
        self.score_rows(last, seqs, r, temperature, entropy)
    }

    fn ensure_grads(&mut self) -> Result<()> {
        if self.g.is_empty() {
            for s in &self.shapes {
                self.g.push(self.backend.alloc(s.iter().product())?);
            }
        }
        Ok(())
    }

    /// One forward and backward pass over packed `seqs`: the callback gets the log-probs and
    /// entropies of the scored tokens and returns dL/dlogprob (and dL/dentropy) for each; the
    /// parameter gradients of L are added to the decoder's gradient buffers.
    pub fn forward_backward(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        loss: &mut dyn FnMut(&[TokenStats]) -> Result<Vec<TokenGrads>>,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads()?;
        if seqs.is_empty() {
            return Ok(());
        }
        let (n, r) = self.pack(seqs, true)?;
        let last = self.forward(n, seqs.len(), true, AttnMode::Packed)?;
        let stats = self.score_rows(last, seqs, r, temperature, true)?;
        let grads = loss(&stats)?;
        ensure!(
            grads.len() == seqs.len(),
            "loss callback returned gradients for {} sequences, expected {}",
            grads.len(),
            seqs.len()
        );
        let mut dlp = Vec::with_capacity(r);
        let mut dent = Vec::with_capacity(r);
        let mut any_dent = false;
        for (s, (gr, st)) in grads.iter().zip(&stats).enumerate() {
            let c = st.logprobs.len();
            ensure!(
                gr.dlogprobs.len() == c,
                "loss callback: sequence {s} has {c} scored tokens but {} dlogprobs",
                gr.dlogprobs.len()
            );
            dlp.extend_from_slice(&gr.dlogprobs);
            match &gr.dentropy {
                Some(de) => {
                    ensure!(
                        de.len() == c,
                        "loss callback: sequence {s} has {c} scored tokens but {} dentropy",
                        de.len()
                    );
                    any_dent = true;
                    dent.extend_from_slice(de);
                }
                None => dent.extend(std::iter::repeat_n(0.0, c)),
            }
        }
        if r == 0 {
            // Nothing scored: the loss does not depend on the weights.
            return Ok(());
        }
        {
            let gw = self.ws.grad.as_mut().expect("training workspace");
            self.backend.upload(&mut gw.dlp, &dlp)?;
            if any_dent {
                self.backend.upload(&mut gw.dent, &dent)?;
            }
        }
        self.backward(n, seqs.len(), r, temperature, any_dent)
    }

    /// Forward, the PPO-clip loss on the device ([`Backend::ppo_clip_loss`], knobs in `clip`;
    /// its `tokens` is set here) and backward over packed `seqs`, with no host round trip: the
    /// loss metrics add up on the device until [`Decoder::take_ppo_stats`].
    pub fn forward_backward_ppo(
        &mut self,
        seqs: &[SeqRef],
        temperature: f32,
        tok: &PpoTokens,
        clip: PpoShape,
    ) -> Result<()> {
        check_temperature(temperature)?;
        self.ensure_grads()?;
        if seqs.is_empty() {
            return Ok(());
        }
        let (n, r) = self.pack(seqs, true)?;
        ensure!(
            tok.advantages.len() == r
                && tok.weights.len() == 3 * r
                && tok.old.is_none_or(|o| o.len() == r)
                && tok.dentropy.is_none_or(|d| d.len() == r),
            "PPO loss inputs: {} advantages, {} weights, {:?} old, {:?} dentropy for {r} scored tokens",
            tok.advantages.len(),
            tok.weights.len(),
            tok.old.map(<[f32]>::len),
            tok.dentropy.map(<[f32]>::len)
        );
        let last = self.forward(n, seqs.len(), true, AttnMode::Packed)?;
        if r == 0 {
            return Ok(());
        }
        self.score_device(last, r, temperature, true)?;
        if self.ppo_stats.is_none() {
            self.ppo_stats = Some(self.backend.alloc(PPO_STATS)?);
        }
        let (b, ws) = (&self.backend, &mut self.ws);
        let gw = ws.grad.as_mut().expect("training workspace");
        b.upload(&mut gw.adv, tok.advantages)?;
        b.upload(&mut gw.lw, tok.weights)?;
        if let Some(o) = tok.old {
            b.upload(&mut gw.old, o)?;
        }
        if let Some(d) = tok.dentropy {
            b.upload(&mut gw.dent, d)?;
        }
        b.ppo_clip_loss(
            &mut gw.dlp,
            self.ppo_stats.as_mut().expect("allocated above"),
            &ws.lp,
            tok.old.map(|_| &gw.old),
            &gw.adv,
            &gw.lw,
            Some(&ws.ent),
            PpoShape { tokens: r, ..clip },
        )?;
        self.backward(n, seqs.len(), r, temperature, tok.dentropy.is_some())
    }

    /// The PPO loss metric sums ([`crate::backend::PPO_STATS`] slots) since the last call, and
    /// resets them (one device sync).
    pub fn take_ppo_stats(&mut self) -> Result<[f64; PPO_STATS]> {
        let mut out = [0f32; PPO_STATS];
        if let Some(s) = self.ppo_stats.as_mut() {
            self.backend.download(s, &mut out)?;
            self.backend.fill(s, PPO_STATS, 0.0)?;
        }
        Ok(out.map(f64::from))
    }

    /// Backward from dL/dlp (and dL/dentropy when `dent`) already in the gradient workspace.
    fn backward(
        &mut self,
        n: usize,
        seqs: usize,
        r: usize,
        temperature: f32,
        dent: bool,
    ) -> Result<()> {
        let chunk = self.chunk_rows(r);
        let Decoder {
            backend: b,
            cfg,
            w,
            g,
            layers,
            ws,
            embed,
            final_norm,
            head,
            ..
        } = self;
        let gw = ws
            .grad
            .as_mut()
            .expect("training workspace has gradient buffers");
        let (d, f, hh, kh, hd) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (qd, kd, theta) = (hh * hd, kh * hd, cfg.rope_theta);
        let shape = LogprobShape {
            rows: r,
            hidden: d,
            vocab: cfg.vocab_size,
            temperature,
            chunk,
        };
        b.logprob_backward(
            &mut gw.dxf,
            &mut g[*head],
            &ws.xf,
            &w[*head],
            &ws.targets,
            &ws.lse_lp,
            &ws.ent,
            &gw.dlp,
            dent.then_some(&gw.dent),
            shape,
            &mut ws.scratch,
        )?;
        b.rmsnorm_backward(
            &mut gw.dxg,
            &mut g[*final_norm],
            &gw.dxf,
            &ws.xg,
            &w[*final_norm],
            &ws.rstd_f,
            r,
            d,
            false,
        )?;
        b.fill(&mut gw.d_resid, n * d, 0.0)?;
        b.scatter_add_rows(&mut gw.d_resid, &gw.dxg, &ws.rows, r, d)?;
        let lowp = b.compute_dtype() != DType::F32;
        for (l, ly) in layers.iter().enumerate().rev() {
            let a = &ws.acts[l];
            // MLP (h kept from the forward pass).
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.down], None, dres, &a.h, n, f, d)?;
            b.matmul_backward_x(&mut gw.dh, dres, &w[ly.down], n, f, d, false)?;
            b.swiglu_backward(&mut gw.dg, &mut gw.du, &gw.dh, &a.g, &a.u, n * f)?;
            b.matmul_backward_w(&mut g[ly.gate], None, &gw.dg, &a.xn2, n, d, f)?;
            b.matmul_backward_w(&mut g[ly.up], None, &gw.du, &a.xn2, n, d, f)?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.dg, &w[ly.gate], n, d, f, false)?;
            b.matmul_backward_x(&mut gw.d_xn, &gw.du, &w[ly.up], n, d, f, true)?;
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.post_norm],
                &gw.d_xn,
                &ws.resid[2 * l + 1],
                &w[ly.post_norm],
                &a.rstd2,
                n,
                d,
                true,
            )?;
            // Attention.
            let dres = if lowp {
                b.copy(&mut gw.d_resid_c, 0, &gw.d_resid, 0, n * d)?;
                &gw.d_resid_c
            } else {
                &gw.d_resid
            };
            b.matmul_backward_w(&mut g[ly.o], None, dres, &a.o, n, qd, d)?;
            b.matmul_backward_x(&mut gw.d_o, dres, &w[ly.o], n, qd, d, false)?;
            let shape = AttnShape {
                tokens: n,
                seqs,
                heads: hh,
                kv_heads: kh,
                head_dim: hd,
            };
            b.attention_backward(
                &mut gw.dq, &mut gw.dk, &mut gw.dv, &gw.d_o, &a.q, &a.k, &a.v, &a.o, &a.lse,
                &ws.cu, shape,
            )?;
            b.rope_backward(&mut gw.dq, &ws.pos, n, hh, hd, theta)?;
            b.rope_backward(&mut gw.dk, &ws.pos, n, kh, hd, theta)?;
            let (dq, dk) = if let (Some(qn), Some(kn)) = (ly.q_norm, ly.k_norm) {
                b.rmsnorm_backward(
                    &mut gw.dq_raw,
                    &mut g[qn],
                    &gw.dq,
                    &a.q_raw,
                    &w[qn],
                    &a.rstd_q,
                    n * hh,
                    hd,
                    false,
                )?;
                b.rmsnorm_backward(
                    &mut gw.dk_raw,
                    &mut g[kn],
                    &gw.dk,
                    &a.k_raw,
                    &w[kn],
                    &a.rstd_k,
                    n * kh,
                    hd,
                    false,
                )?;
                (&gw.dq_raw, &gw.dk_raw)
            } else {
                (&gw.dq, &gw.dk)
            };
            for (p, pb, dy, m, first) in [
                (ly.q, ly.q_b, dq, qd, true),
                (ly.k, ly.k_b, dk, kd, false),
                (ly.v, ly.v_b, &gw.dv, kd, false),
            ] {
                let (gp, gb) = two_mut(g, p, pb);
                b.matmul_backward_w(gp, gb, dy, &a.xn1, n, d, m)?;
                b.matmul_backward_x(&mut gw.d_xn, dy, &w[p], n, d, m, !first)?;
            }
            b.rmsnorm_backward(
                &mut gw.d_resid,
                &mut g[ly.in_norm],
                &gw.d_xn,
                &ws.resid[2 * l],
                &w[ly.in_norm],
                &a.rstd1,
                n,
                d,
                true,
            )?;
        }
        b.embedding_backward(&mut g[*embed], &gw.d_resid, &ws.ids, n, d)
    }

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

    /// The gradients by HF name (for tests and debugging).
    pub fn export_grads(&self) -> Result<Weights> {
        ensure!(
            !self.g.is_empty(),
            "no gradients yet: run forward_backward first"
        );
        self.export(&self.g)
    }

    /// Clips the gradients to `max_grad_norm` (global L2, as torch's clip_grad_norm_) and takes
    /// one AdamW step. A non-finite norm skips the step and leaves weights, moments and the
    /// step count as they were. Gradients are not zeroed (call `zero_grads`).
    pub fn optimizer_step(
        &mut self,
        hp: &AdamWParams,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
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
        // torch.nn.utils.clip_grad_norm_: coef = max / (norm + 1e-6), clamped to 1.
        let grad_scale = max_grad_norm.map_or(1.0, |c| (c / (grad_norm + 1e-6)).min(1.0));
        if self.m.is_empty() {
            for s in &self.shapes {
                let n = s.iter().product();
                self.m.push(self.backend.alloc(n)?);
                self.v.push(self.backend.alloc(n)?);
            }
        }
        self.step += 1;
        let t = self.step as i32;
        let st = AdamWStep {
            lr: hp.lr,
            beta1: hp.beta1,
            beta2: hp.beta2,
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            bias_correction1: (1.0 - (hp.beta1 as f64).powi(t)) as f32,
            bias_correction2: (1.0 - (hp.beta2 as f64).powi(t)) as f32,
            grad_scale,
        };
        for i in 0..self.w.len() {
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
        Ok(OptimizerState {
            step: self.step,
            exp_avg: self.export(&self.m)?,
            exp_avg_sq: self.export(&self.v)?,
        })
    }

    /// Restores what `optimizer_state` returned, so training resumes exactly. Every parameter
    /// must have both moments with its shape (input errors otherwise).
    pub fn load_optimizer_state(&mut self, state: &OptimizerState) -> Result<()> {
        if state.exp_avg.is_empty() && state.exp_avg_sq.is_empty() {
            self.m.clear();
            self.v.clear();
            self.step = state.step;
            return Ok(());
        }
        let mut m = Vec::with_capacity(self.names.len());
        let mut v = Vec::with_capacity(self.names.len());
        for (name, shape) in self.names.iter().zip(&self.shapes) {
            for (map, what, out) in [
                (&state.exp_avg, "exp_avg", &mut m),
                (&state.exp_avg_sq, "exp_avg_sq", &mut v),
            ] {
                let t = map.get(name).ok_or_else(|| {
                    input_error(format!("optimizer state: {what} of '{name}' is missing"))
                })?;
                if &t.shape != shape {
                    bail!(input_error(format!(
                        "optimizer state: {what} of '{name}' has shape {:?}, the model's is {shape:?}",
                        t.shape
                    )));
                }
                let mut buf = self.backend.alloc(t.numel())?;
                self.backend.upload(&mut buf, &t.data)?;
                out.push(buf);
            }
        }
        for (what, map) in [
            ("exp_avg", &state.exp_avg),
            ("exp_avg_sq", &state.exp_avg_sq),
        ] {
            if let Some(extra) = map.keys().find(|k| !self.names.contains(k)) {
                bail!(input_error(format!(
                    "optimizer state: {what} has '{extra}', which the model does not have"
                )));
            }
        }
        self.m = m;
        self.v = v;
        self.step = state.step;
        Ok(())
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
        for (name, shape) in self.names.iter().zip(&self.shapes) {
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

    /// A KV cache of `slots` sequences of at most `max_len` tokens.
    pub fn new_cache(&self, slots: usize, max_len: usize) -> Result<KvCache<B>> {
        let n = slots * max_len * self.cfg.num_kv_heads * self.cfg.head_dim;
        let mut k = Vec::with_capacity(self.cfg.num_layers);
        let mut v = Vec::with_capacity(self.cfg.num_layers);
        for _ in 0..self.cfg.num_layers {
            k.push(self.backend.alloc_as(n, self.backend.compute_dtype())?);
            v.push(self.backend.alloc_as(n, self.backend.compute_dtype())?);
        }
        Ok(KvCache {
            k,
            v,
            lens: vec![0; slots],
            max_len,
        })
    }

    /// Runs `entries` (slot, token) through the model against the cache: each token goes at
    /// its slot's next position (tokens of one slot in order). Returns the logits of the
    /// entries listed in `out`, `[out.len(), vocab]` row-major.
    fn forward_cached(
        &mut self,
        cache: &mut KvCache<B>,
        entries: &[(usize, u32)],
        out: &[u32],
    ) -> Result<Vec<f32>> {
        let n = entries.len();
        let ml = cache.max_len;
        let mut lens = cache.lens.clone();
        let (mut ids, mut pos) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut rows, mut base, mut len) = (Vec::new(), Vec::new(), Vec::new());
        for &(slot, tok) in entries {
            ensure!(slot < lens.len(), "KV cache has no slot {slot}");
            let p = lens[slot];
            if p >= ml {
                bail!(input_error(format!(
                    "KV cache slot {slot} is full ({ml} tokens)"
                )));
            }
            lens[slot] += 1;
            ids.push(tok);
            pos.push(p as u32);
            rows.push((slot * ml + p) as u32);
            base.push((slot * ml) as u32);
            len.push(p as u32 + 1);
        }
        self.check_tokens(&ids, "generation input")?;
        self.reserve(self.step_caps(n, out.len()))?;
        let v = self.cfg.vocab_size;
        {
            let (b, ws) = (&self.backend, &mut self.ws);
            b.upload_idx(&mut ws.ids, &ids)?;
            b.upload_idx(&mut ws.pos, &pos)?;
            b.upload_idx(&mut ws.kv_rows, &rows)?;
            b.upload_idx(&mut ws.kv_base, &base)?;
            b.upload_idx(&mut ws.kv_len, &len)?;
            b.upload_idx(&mut ws.rows, out)?;
        }
        self.grow_logits(out.len() * v)?;
        let last = self.forward(n, 1, false, AttnMode::Cached(cache))?;
        cache.lens = lens;
        let r = out.len();
        self.final_rows(last, r)?;
        self.head_logits(r)?;
        let mut logits = vec![0.0; r * v];
        self.backend.download(&self.ws.logits, &mut logits)?;
        Ok(logits)
    }

    /// Appends `tokens` to a slot (a fresh or freed slot: the prompt) and returns the logits of
    /// the last position.
    pub fn prefill(
        &mut self,
        cache: &mut KvCache<B>,
        slot: usize,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        ensure!(!tokens.is_empty(), "prefill needs at least one token");
        let entries: Vec<(usize, u32)> = tokens.iter().map(|&t| (slot, t)).collect();
        self.forward_cached(cache, &entries, &[tokens.len() as u32 - 1])
    }

    /// One token per slot (slots distinct); returns logits `[slots.len(), vocab]` row-major.
    pub fn decode(
        &mut self,
        cache: &mut KvCache<B>,
        slots: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        ensure!(
            slots.len() == tokens.len(),
            "decode: {} slots but {} tokens",
            slots.len(),
            tokens.len()
        );
        let mut seen = vec![false; cache.slots()];
        for &s in slots {
            ensure!(s < seen.len(), "KV cache has no slot {s}");
            ensure!(!seen[s], "decode: slot {s} appears twice");
            seen[s] = true;
        }
        if slots.is_empty() {
            return Ok(Vec::new());
        }
        let entries: Vec<(usize, u32)> =
            slots.iter().copied().zip(tokens.iter().copied()).collect();
        let out: Vec<u32> = (0..slots.len() as u32).collect();
        self.forward_cached(cache, &entries, &out)
    }

    /// Copies slot `from_slot`'s keys and values into `to_slot`, so n samples share one prompt
    /// prefill.
    pub fn fork(&mut self, cache: &mut KvCache<B>, from_slot: usize, to_slot: usize) -> Result<()> {
        ensure!(
            from_slot < cache.slots() && to_slot < cache.slots(),
            "KV cache has {} slots, fork {from_slot} -> {to_slot}",
            cache.slots()
        );
        if from_slot == to_slot {
            return Ok(());
        }
        let row = self.cfg.num_kv_heads * self.cfg.head_dim;
        let (n, ml) = (cache.lens[from_slot] * row, cache.max_len * row);
        for buf in cache.k.iter_mut().chain(cache.v.iter_mut()) {
            self.backend
                .copy_within(buf, to_slot * ml, from_slot * ml, n)?;
        }
        cache.lens[to_slot] = cache.lens[from_slot];
        Ok(())
    }

    /// Bytes one KV block of `block_size` positions takes over every layer (keys and values).
    pub fn paged_block_bytes(&self, block_size: usize) -> usize {
        let esize = match self.backend.compute_dtype() {
            DType::F32 => 4,
            DType::BF16 => 2,
        };
        2 * self.cfg.num_layers * block_size * self.cfg.num_kv_heads * self.cfg.head_dim * esize
    }

    /// Grows the workspace for paged steps of up to `tokens` tokens and `rows` sampled rows
    /// (so a KV pool sized from the free memory afterwards leaves room for it).
    pub fn reserve_paged(&mut self, tokens: usize, rows: usize) -> Result<()> {
        self.reserve(self.step_caps(tokens, rows))?;
        self.grow_logits(rows * self.cfg.vocab_size)
    }

    /// Grows the f32 logits buffer to `n` values (the old one freed first, so the peak is
    /// one buffer); a reallocation bumps `ws_epoch`.
    fn grow_logits(&mut self, n: usize) -> Result<()> {
        if self.backend.len(&self.ws.logits) < n {
            self.ws.logits = self.backend.alloc(0)?;
            self.ws.logits = self.backend.alloc(n)?;
            self.ws_epoch += 1;
        }
        Ok(())
    }

    /// A paged KV cache of `num_blocks` blocks of `block_size` positions.
    pub fn new_paged_cache(&self, num_blocks: usize, block_size: usize) -> Result<PagedKv<B>> {
        ensure!(
            num_blocks > 0 && block_size > 0,
            "paged cache: {num_blocks} blocks of {block_size}"
        );
        let b = &self.backend;
        // One spare block for the padding rows of graph-replayed decode steps.
        let n = (num_blocks + 1) * block_size * self.cfg.num_kv_heads * self.cfg.head_dim;
        let mut k = Vec::with_capacity(self.cfg.num_layers);
        let mut v = Vec::with_capacity(self.cfg.num_layers);
        for _ in 0..self.cfg.num_layers {
            k.push(b.alloc_as(n, b.compute_dtype())?);
            v.push(b.alloc_as(n, b.compute_dtype())?);
        }
        Ok(PagedKv {
            k,
            v,
            num_blocks,
            block_size,
            tables: b.alloc_idx(0)?,
            max_blocks: 0,
            tiles: b.alloc_idx(0)?,
            n_tiles: 0,
            decode_rows: 0,
            keys: b.alloc_idx(0)?,
            positions: b.alloc_idx(0)?,
            feed: b.alloc_idx(0)?,
            tokens: b.alloc_idx(0)?,
            logprobs: b.alloc(0)?,
            epoch: 0,
            graphs: DecodeGraphs::default(),
            pending: VecDeque::new(),
            submitted: 0,
        })
    }

    /// Chooses how the pure-decode steps of `cache` run: `max_rows` is the most sequences a
    /// step holds, `max_blocks` the longest block table the engine will build (the fixed
    /// width of a padded step). `Graphs` on a backend without graphs is `Eager`. Graphs
    /// captured before are released.
    pub fn set_paged_graphs(
        &mut self,
        cache: &mut PagedKv<B>,
        mode: GraphMode,
        max_rows: usize,
        max_blocks: usize,
    ) -> Result<()> {
        self.release_paged_graphs(cache)?;
        let mode = if mode == GraphMode::Graphs && !self.backend.graphs_supported() {
            GraphMode::Eager
        } else {
            mode
        };
        let g = &mut cache.graphs;
        g.mode = mode;
        g.max_rows = decode_bucket(max_rows.max(1));
        g.width = max_blocks.max(1);
        g.epochs = None;
        Ok(())
    }

    /// Destroys the decode graphs of `cache` and gives their memory back to the backend's
    /// pool (to the driver on the next `trim`); returns the bytes they held.
    pub fn release_paged_graphs(&mut self, cache: &mut PagedKv<B>) -> Result<usize> {
        if cache.graphs.captured.is_empty() {
            return Ok(0);
        }
        cache.graphs.captured.clear();
        let bytes = self.backend.graph_release()?;
        cache.graphs.stats.graph_bytes = cache.graphs.stats.graph_bytes.max(bytes);
        Ok(bytes)
    }

    /// The bucket a step of these chunks and rows is padded to, or None when it runs as it
    /// is (a prefill chunk in it, too many rows, a table wider than the fixed width, or
    /// padding off).
    fn graph_bucket(cache: &PagedKv<B>, chunks: &[Chunk], rows: &[SampleRow]) -> Option<usize> {
        let g = &cache.graphs;
        if g.mode == GraphMode::Eager
            || rows.is_empty()
            || chunks
                .iter()
                .any(|c| c.tokens.len() != 1 || c.table.len() > g.width)
        {
            return None;
        }
        let b = decode_bucket(chunks.len().max(rows.len()));
        (b <= g.max_rows).then_some(b)
    }

    /// Sizes every buffer a padded step reads or writes for the largest bucket, once; when
    /// any of them moved since the graphs were captured, the graphs are released (they would
    /// read the old addresses) and get captured again.
    fn prepare_padded(&mut self, cache: &mut PagedKv<B>) -> Result<()> {
        let (rows, width) = (cache.graphs.max_rows, cache.graphs.width);
        self.reserve(self.step_caps(rows, rows))?;
        self.grow_logits(rows * self.cfg.vocab_size)?;
        cache.grow_step_buffers(&self.backend, rows, rows * width)?;
        let now = (self.ws_epoch, cache.epoch);
        if cache.graphs.epochs != Some(now) {
            if !cache.graphs.captured.is_empty() {
                cache.graphs.stats.drops += 1;
            }
            self.release_paged_graphs(cache)?;
            cache.graphs.epochs = Some(now);
        }
        Ok(())
    }

    /// The part of a padded decode step that runs on the device (and is captured): forward of
    /// `rows` tokens, final norm and LM head of every row, sampling.
    fn decode_body(
        &mut self,
        cache: &mut PagedKv<B>,
        rows: usize,
        sampling: &SamplingParams,
    ) -> Result<()> {
        // Rows of a queued step take their tokens from the draws of the step before.
        self.backend
            .feed_tokens(&mut self.ws.ids, &cache.tokens, &cache.feed, rows)?;
        let last = self.forward(rows, 1, false, AttnMode::Paged(cache))?;
        self.sample_rows(cache, last, rows, sampling)
    }

    /// Final norm and LM head of the `rows` hidden states `last` names, then the draw into the
    /// cache's token and log-prob buffers.
    fn sample_rows(
        &mut self,
        cache: &mut PagedKv<B>,
        last: usize,
        rows: usize,
        sampling: &SamplingParams,
    ) -> Result<()> {
        self.final_rows(last, rows)?;
        self.head_logits(rows)?;
        self.backend.sample(
            &mut cache.tokens,
            &mut cache.logprobs,
            &self.ws.logits,
            &cache.keys,
            &cache.positions,
            rows,
            self.cfg.vocab_size,
            sampling,
        )
    }

    /// A pure-decode step padded to `bucket` rows: padding rows feed token 0 at position 0
    /// into the spare block and sample from their own logits; every table is `width` wide
    /// (the rest pointing at the spare block). With `GraphMode::Graphs` the device part is a
    /// graph replay (captured on the bucket's first step, after one eager run that compiles
    /// the kernels, plans the GEMMs and caches the temporaries).
    #[allow(clippy::too_many_arguments)]
    fn forward_paged_padded(
        &mut self,
        cache: &mut PagedKv<B>,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
        bucket: usize,
    ) -> Result<()> {
        let (bs, width) = (cache.block_size, cache.graphs.width);
        let spare = cache.num_blocks as u32;
        let n = chunks.len();
        let mut fed = vec![FEED_NONE; bucket];
        for (f, &s) in fed.iter_mut().zip(feed) {
            *f = s.unwrap_or(FEED_NONE);
        }
        let mut ids = vec![0u32; bucket];
        let mut pos = vec![0u32; bucket];
        let mut kv_rows = vec![spare * bs as u32; bucket];
        let seq: Vec<u32> = (0..bucket as u32).collect();
        let mut len = vec![1u32; bucket];
        let mut tables = vec![spare; bucket * width];
        for (c, ch) in chunks.iter().enumerate() {
            cache.check_chunk(c, ch)?;
            let p = ch.start;
            tables[c * width..c * width + ch.table.len()].copy_from_slice(ch.table);
            ids[c] = ch.tokens[0];
            pos[c] = p as u32;
            kv_rows[c] = (ch.table[p / bs] as usize * bs + p % bs) as u32;
            len[c] = p as u32 + 1;
        }
        let mut out = seq.clone();
        let mut keys = vec![0u32; 2 * bucket];
        let mut positions = vec![0u32; bucket];
        for (i, r) in rows.iter().enumerate() {
            ensure!(r.chunk < n, "sample row names chunk {}", r.chunk);
            out[i] = r.chunk as u32;
            keys[2 * i] = r.key as u32;
            keys[2 * i + 1] = (r.key >> 32) as u32;
            positions[i] = r.position as u32;
        }
        self.check_tokens(&ids[..n], "generation input")?;
        self.prepare_padded(cache)?;
        {
            let (b, ws) = (&self.backend, &mut self.ws);
            b.upload_idx(&mut ws.ids, &ids)?;
            b.upload_idx(&mut ws.pos, &pos)?;
            b.upload_idx(&mut ws.kv_rows, &kv_rows)?;
            b.upload_idx(&mut ws.kv_base, &seq)?;
            b.upload_idx(&mut ws.kv_len, &len)?;
            b.upload_idx(&mut ws.rows, &out)?;
            b.upload_idx(&mut cache.tables, &tables)?;
            b.upload_idx(&mut cache.keys, &keys)?;
            b.upload_idx(&mut cache.positions, &positions)?;
            cache.upload_feed(b, &fed)?;
        }
        cache.max_blocks = width;
        cache.n_tiles = 0;
        cache.decode_rows = bucket;
        let g = &mut cache.graphs;
        g.stats.padding_rows += bucket - n.max(rows.len());
        if g.mode == GraphMode::Graphs {
            let key = (
                bucket,
                sampling.temperature.to_bits(),
                sampling.top_k,
                sampling.top_p.to_bits(),
            );
            let found = g
                .captured
                .iter()
                .find(|(k, _)| *k == key)
                .map(|&(_, id)| id);
            let uses = match g.uses.iter_mut().find(|(k, _)| *k == key) {
                Some((_, u)) => {
                    *u += 1;
                    *u
                }
                None => {
                    g.uses.push((key, 1));
                    1
                }
            };
            if found.is_none() && uses < CAPTURE_AT {
                self.decode_body(cache, bucket, sampling)?;
                cache.graphs.stats.padded_steps += 1;
                return cache.start_draws(&self.backend, rows.len());
            }
            let id = match found {
                Some(id) => id,
                None => {
                    let t0 = std::time::Instant::now();
                    self.backend.synchronize()?;
                    self.backend.graph_begin()?;
                    let body = self.decode_body(cache, bucket, sampling);
                    let id = self.backend.graph_end();
                    body?;
                    let id = id?;
                    cache.graphs.captured.push((key, id));
                    cache.graphs.stats.captures += 1;
                    cache.graphs.stats.capture_us += t0.elapsed().as_micros() as u64;
                    id
                }
            };
            self.backend.graph_launch(id)?;
            cache.graphs.stats.replays += 1;
        } else {
            self.decode_body(cache, bucket, sampling)?;
            cache.graphs.stats.padded_steps += 1;
        }
        cache.start_draws(&self.backend, rows.len())
    }

    /// One step of the paged engine: runs every chunk (its keys and values stored through its
    /// block table), then draws one token per sample row from the logits after the last token
    /// of the row's chunk, on the backend. Only the drawn ids and log-probs come back.
    pub fn forward_paged(
        &mut self,
        cache: &mut PagedKv<B>,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        ensure!(
            cache.pending.is_empty(),
            "paged step: a submitted step was not collected"
        );
        self.submit_paged(cache, chunks, &[], rows, sampling)?;
        self.collect_paged(cache)
    }

    /// The draws of the oldest step `submit_paged` queued and nothing collected yet (waits for
    /// them to reach the host).
    pub fn collect_paged(&mut self, cache: &mut PagedKv<B>) -> Result<Vec<Sampled>> {
        cache.collect(&self.backend)
    }

    /// `forward_paged` without waiting for the draws (`collect_paged` returns them, in order;
    /// at most two steps in flight). A chunk with `feed[c] = Some(r)` is one token: the token
    /// drawn for row r of the step submitted just before, read on the device (so this step can
    /// be queued before that one's draws are back); `feed` may be empty (no chunk fed).
    pub fn submit_paged(
        &mut self,
        cache: &mut PagedKv<B>,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<()> {
        ensure!(
            cache.pending.len() < 2,
            "paged step: two steps are in flight already"
        );
        ensure!(
            feed.is_empty() || feed.len() == chunks.len(),
            "paged step: {} feeds for {} chunks",
            feed.len(),
            chunks.len()
        );
        for (c, f) in feed.iter().enumerate() {
            if let Some(r) = f {
                ensure!(
                    chunks[c].tokens.len() == 1 && !cache.pending.is_empty(),
                    "paged step: chunk {c} feeds draw {r} of no step before it"
                );
            }
        }
        if let Some(bucket) = Self::graph_bucket(cache, chunks, rows) {
            return self.forward_paged_padded(cache, chunks, feed, rows, sampling, bucket);
        }
        cache.graphs.stats.eager_steps += 1;
        let bs = cache.block_size;
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        ensure!(n > 0, "paged step without tokens");
        let max_blocks = chunks.iter().map(|c| c.table.len()).max().unwrap_or(0);
        let (mut ids, mut pos) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut kv_rows, mut seq, mut len) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut tables = vec![0u32; chunks.len() * max_blocks];
        let mut last = vec![0u32; chunks.len()];
        // Single-token chunks first, then the prefill chunks in tiles of consecutive rows
        // (the attention runs those as blocks of queries).
        let (single, multi): (Vec<usize>, Vec<usize>) =
            (0..chunks.len()).partition(|&c| chunks[c].tokens.len() == 1);
        let mut tiles = Vec::new();
        let mut fed = Vec::new();
        for &c in single.iter().chain(&multi) {
            let ch = &chunks[c];
            if !feed.is_empty() && ch.tokens.len() == 1 {
                fed.push(feed[c].unwrap_or(FEED_NONE));
            }
            cache.check_chunk(c, ch)?;
            tables[c * max_blocks..c * max_blocks + ch.table.len()].copy_from_slice(ch.table);
            if ch.tokens.len() > 1 {
                for t0 in (0..ch.tokens.len()).step_by(PAGED_TILE_ROWS) {
                    let rows = PAGED_TILE_ROWS.min(ch.tokens.len() - t0);
                    tiles.extend([(ids.len() + t0) as u32, rows as u32]);
                }
            }
            for (i, &t) in ch.tokens.iter().enumerate() {
                let p = ch.start + i;
                ids.push(t);
                pos.push(p as u32);
                kv_rows.push((ch.table[p / bs] as usize * bs + p % bs) as u32);
                seq.push(c as u32);
                len.push(p as u32 + 1);
            }
            last[c] = ids.len() as u32 - 1;
        }
        let out: Vec<u32> = rows
            .iter()
            .map(|r| {
                last.get(r.chunk)
                    .copied()
                    .ok_or_else(|| anyhow::anyhow!("sample row names chunk {}", r.chunk))
            })
            .collect::<Result<_>>()?;
        self.check_tokens(&ids, "generation input")?;
        self.reserve(self.step_caps(n, out.len()))?;
        let v = self.cfg.vocab_size;
        let r = out.len();
        let keys: Vec<u32> = rows
            .iter()
            .flat_map(|s| [s.key as u32, (s.key >> 32) as u32])
            .collect();
        let positions: Vec<u32> = rows.iter().map(|s| s.position as u32).collect();
        {
            let (b, ws) = (&self.backend, &mut self.ws);
            b.upload_idx(&mut ws.ids, &ids)?;
            b.upload_idx(&mut ws.pos, &pos)?;
            b.upload_idx(&mut ws.kv_rows, &kv_rows)?;
            b.upload_idx(&mut ws.kv_base, &seq)?;
            b.upload_idx(&mut ws.kv_len, &len)?;
            b.upload_idx(&mut ws.rows, &out)?;
        }
        self.grow_logits(r * v)?;
        let b = &self.backend;
        cache.grow_step_buffers(b, r, tables.len())?;
        b.upload_idx(&mut cache.tables, &tables)?;
        cache.max_blocks = max_blocks;
        if !tiles.is_empty() {
            // Not read by graphs: a reallocation need not bump the epoch.
            grow_idx(b, &mut cache.tiles, tiles.len())?;
            b.upload_idx(&mut cache.tiles, &tiles)?;
        }
        cache.n_tiles = tiles.len() / 2;
        cache.decode_rows = single.len();
        b.upload_idx(&mut cache.keys, &keys)?;
        b.upload_idx(&mut cache.positions, &positions)?;
        if fed.iter().any(|&f| f != FEED_NONE) {
            // Fed rows are single tokens, which come first: `fed` covers them. The graphs
            // read this buffer too: a reallocation must drop them (the epoch).
            if grow_idx(b, &mut cache.feed, fed.len())? {
                cache.epoch += 1;
            }
            cache.upload_feed(b, &fed)?;
            b.feed_tokens(&mut self.ws.ids, &cache.tokens, &cache.feed, fed.len())?;
        }
        let last_buf = self.forward(n, 1, false, AttnMode::Paged(cache))?;
        if r > 0 {
            self.sample_rows(cache, last_buf, r, sampling)?;
        }
        cache.start_draws(&self.backend, r)
    }

    /// Copies whole blocks `(src, dst)` of every layer's keys and values.
    pub fn copy_paged_blocks(
        &mut self,
        cache: &mut PagedKv<B>,
        pairs: &[(u32, u32)],
    ) -> Result<()> {
        let row = cache.block_size * self.cfg.num_kv_heads * self.cfg.head_dim;
        for &(src, dst) in pairs {
            ensure!(
                (src as usize) < cache.num_blocks
                    && (dst as usize) < cache.num_blocks
                    && src != dst,
                "paged cache: copy of block {src} to {dst} ({} blocks)",
                cache.num_blocks
            );
            for buf in cache.k.iter_mut().chain(cache.v.iter_mut()) {
                self.backend
                    .copy_within(buf, dst as usize * row, src as usize * row, row)?;
            }
        }
        Ok(())
    }
}

/// Rope of a step's new queries and keys, and its keys and values stored at their cache rows:
/// from the fused q/k/v projection `qkv` when `fused`, else from `a`'s q, k and v.
/// `heads` = (tokens, heads, kv heads, head dim).
#[allow(clippy::too_many_arguments)]
fn rope_store<B: Backend>(
    b: &B,
    fused: bool,
    qkv: &B::Buf,
    a: &mut Acts<B>,
    pos: &B::Idx,
    rows: &B::Idx,
    kc: &mut B::Buf,
    vc: &mut B::Buf,
    heads: (usize, usize, usize, usize),
    theta: f32,
) -> Result<()> {
    let (n, hh, kh, hd) = heads;
    if fused {
        b.rope_store_kv_packed(qkv, &mut a.q, pos, kc, vc, rows, n, hh, kh, hd, theta)
    } else {
        b.rope_store_kv(
            &mut a.q, &mut a.k, &a.v, pos, kc, vc, rows, n, hh, kh, hd, theta,
        )
    }
}

/// Draws as `Sampled` rows.
fn sampled(tokens: Vec<u32>, logprobs: Vec<f32>) -> Vec<Sampled> {
    tokens
        .into_iter()
        .zip(logprobs)
        .map(|(token, logprob)| Sampled { token, logprob })
        .collect()
}

/// Grows an index buffer to hold at least `n` entries (to the next power of two, so that a
/// growing batch reallocates rarely); true when it was reallocated.
fn grow_idx<B: Backend>(b: &B, buf: &mut B::Idx, n: usize) -> Result<bool> {
    if b.len_idx(buf) < n {
        *buf = b.alloc_idx(n.next_power_of_two())?;
        return Ok(true);
    }
    Ok(false)
}
