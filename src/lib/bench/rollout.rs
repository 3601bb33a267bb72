//! `tandem bench rollout`: tokens/s of the paged rollout engine (issue 7) on the Qwen2.5-0.5B
//! shape with random weights: forced lengths (batch 64 and 256 × prompt 128 × 256 new tokens,
//! no stop) and a GRPO-shaped batch (64 prompts × n = 8, prompts of ~150 tokens, up to 512 new
//! tokens, random stops). With `--model DIR --prompts FILE`, a real model's weights on a
//! dataset's prompts (rendered with its chat template, as `rollout` renders them), stopping at
//! its EOS ids: the cases report the length distribution of their samples too. Each case also
//! reports its fraction of the roofline:
//! - bandwidth: (weight bytes per engine step + KV bytes read by attention) / time, over the
//!   measured copy bandwidth of the device;
//! - compute: (2 · params · tokens + attention FLOPs) / time, over a measured big bf16 GEMM.

use super::cpu_engine::shape;
use super::gpu_clock::{ClockSampler, ClockSummary};
use super::report;
use crate::backend::ops::sample::{sample_key, uniform, Sampled, SamplingParams};
use crate::backend::{Backend, BlockTables, DType, Draws, KvCache, MatmulShape, PagedAttnShape};
use crate::bail_input;
use crate::data::{ChatTemplate, PromptDataset};
use crate::engine::paged::{
    generate_paged, Chunk, Completion, GenParams, GraphMode, GraphStats, Limits, PagedDecoder,
    PagedModel, PagedStats, Request, SampleRow, DEFAULT_BLOCK_SIZE,
};
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use crate::model::init::random_weights;
use crate::model::lora::{init_adapters, LoraMode, LoraSpec};
use crate::model::names::param_count;
use crate::model::Config;
use crate::rng::SplitMix64;
use crate::stage::common::{at_least, Device, LoraFlags};
use crate::stage::rollout::{keyed_requests, tokenize_prompts, PromptLimits, Truncate};
use crate::stage::{on_device, Job};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use clap::Args;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct RolloutBenchArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: Device,
    /// Model shape with random weights: small (~10M parameters, for a quick CPU run),
    /// qwen0.5b, qwen1.5b, qwen7b or qwen14b; or a model directory (config.json, safetensors,
    /// tokenizer.json) whose weights run.
    #[arg(long, default_value = "qwen0.5b")]
    pub model: String,
    /// Prompt cases instead of the forced-length and GRPO ones: the first --limit prompts of
    /// this dataset (verl's schema) rendered with the model's chat template, --n samples each
    /// (one case per value), temperature 1, up to --new-tokens, ending at the model's EOS ids
    /// (not with --fixed-lengths). Needs --model DIR.
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// Prompts of the --prompts cases.
    #[arg(long, default_value_t = 256, value_parser = at_least(1usize))]
    pub limit: usize,
    /// Samples per prompt of the --prompts cases, one case per value.
    #[arg(long, value_delimiter = ',', default_values_t = [8usize, 1], value_parser = at_least(1usize))]
    pub n: Vec<usize>,
    /// Longest --prompts prompt after the chat template, in tokens; a longer one is an error.
    #[arg(long, default_value_t = 1024, value_parser = at_least(1usize))]
    pub max_prompt_tokens: usize,
    /// Batch sizes of the forced-length cases.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 256])]
    pub batches: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// Skip the GRPO-shaped case.
    #[arg(long)]
    pub skip_grpo: bool,
    /// GRPO case: prompts, samples per prompt, mean prompt tokens, most new tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [64usize, 8, 150, 512])]
    pub grpo: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How the pure-decode steps run, each case once per mode: `graphs` (CUDA graphs, one per
    /// batch-size bucket; skipped on a backend without graphs) and/or `eager`.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [StepMode::Graphs, StepMode::Eager])]
    pub modes: Vec<StepMode>,
    /// Runs of each case per mode, one after the other in the same process: the first pays
    /// what a process's first rollout of a shape pays (GEMM plans, workspace growth); the
    /// later ones are what every later rollout of it costs (a daemon's RL steps). Each run
    /// captures its graphs anew and releases them with its KV pool, as a rollout does.
    #[arg(long, default_value_t = 2)]
    pub runs: usize,
    /// Wait for every step's tokens before scheduling the next (no overlap scheduling).
    #[arg(long)]
    pub no_overlap: bool,
    /// The GRPO-shaped case without its random stops, the --prompts cases without EOS: every
    /// sample runs to its max new tokens (how a peer engine with `ignore_eos` is compared).
    #[arg(long)]
    pub fixed_lengths: bool,
    /// Writes the model's HF config.json (and its directory, for --model DIR) and every case's
    /// prompt ids, samples per prompt, new tokens and stop ids to this JSON file, so a peer
    /// engine (bench/peer_vllm.py) runs the same work.
    #[arg(long)]
    pub cases_out: Option<std::path::PathBuf>,
    // Generate with random LoRA adapters (B ≠ 0) on the random base (rank 0: none).
    #[command(flatten)]
    pub lora: LoraFlags,
    /// With --lora-rank: `merged` (the adapters merged into the weights once, timed: the
    /// merge's seconds are in the title and the JSON) or `unmerged` (applied at each step).
    #[arg(long, value_enum, default_value_t = LoraMode::Merged)]
    pub lora_mode: LoraMode,
}

/// How a bench case runs its decode steps.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    Graphs,
    Eager,
}

struct Case {
    name: String,
    requests: Vec<Request>,
    params: GenParams,
    /// The stop ids are random ones standing for a random model's ends (a peer with other
    /// random weights cannot run the same lengths).
    random_stops: bool,
}

struct Measured {
    name: String,
    mode: &'static str,
    /// 1 for a case's first run in the process, 2.. for the runs after it.
    run: usize,
    /// Decode steps replayed from graphs, graphs captured.
    replays: usize,
    captures: usize,
    capture_s: f64,
    drops: usize,
    samples: usize,
    new_tokens: usize,
    seconds: f64,
    steps: usize,
    preemptions: usize,
    /// Bytes the roofline says a step must read, summed over the run.
    bytes: f64,
    flops: f64,
    lengths: Lengths,
    split: StepSplit,
    /// GEMM plans made during the run and the seconds they took.
    planning: (u64, f64),
    /// The GPU's SM clock and power during the run (CUDA, with `nvidia-smi`).
    clocks: Option<ClockSummary>,
}

struct Bench<'a> {
    args: &'a RolloutBenchArgs,
    cfg: Config,
    /// The model directory whose weights run; None: random weights of the shape.
    dir: Option<PathBuf>,
    cases: Vec<Case>,
    lora: Option<LoraSpec>,
}

/// The bench's decoder on `backend`: the base (--model DIR's weights, or the shape's random
/// ones) alone, or with random adapters (B ≠ 0)
/// merged (the merge timed, seconds returned) or unmerged, as `--lora-mode` says.
fn bench_decoder<B: Backend>(
    backend: B,
    cfg: &Config,
    dir: Option<&Path>,
    seed: u64,
    lora: Option<(&LoraSpec, LoraMode)>,
) -> Result<(Decoder<B>, Option<f64>)> {
    // Generation only: no f32 masters beside the bf16 weights (the 14B shape's would take
    // 59 GB of the device).
    let (cfg, weights) = match dir {
        Some(dir) => ModelDir::load(dir)?,
        None => (cfg.clone(), random_weights(cfg, seed, 0.02)),
    };
    let cfg = &cfg;
    let Some((spec, mode)) = lora else {
        return Ok((Decoder::for_generation(backend, cfg, weights)?, None));
    };
    let mut adapters = init_adapters(cfg, spec, seed);
    let mut rng = SplitMix64(seed ^ 0x10_4a);
    for (_, t) in adapters
        .iter_mut()
        .filter(|(k, _)| k.ends_with("lora_B.weight"))
    {
        t.data.iter_mut().for_each(|x| *x = 0.02 * rng.normal());
    }
    if mode == LoraMode::Unmerged {
        let d = Decoder::for_generation_unmerged(backend, cfg, weights, &adapters, spec)?;
        return Ok((d, None));
    }
    let mut d = Decoder::for_generation(backend, cfg, weights)?;
    d.backend().synchronize()?;
    let started = Instant::now();
    // Synchronizes at its end.
    d.merge_adapters(spec, &adapters)?;
    Ok((d, Some(started.elapsed().as_secs_f64())))
}

/// What every case samples with: temperature 1, no top-k or top-p cut.
fn full_distribution() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: -1,
        top_p: 1.0,
    }
}

/// Measured device limits: copy bandwidth (bytes/s, read + write) and bf16 GEMM FLOP/s.
fn peaks<B: Backend>(b: &B) -> Result<(f64, f64)> {
    let big = b.device_memory()?.is_some();
    let (n_copy, n_gemm) = if big {
        (256usize << 20, 8192usize)
    } else {
        (16 << 20, 1024)
    };
    let src = b.alloc_as(n_copy, DType::BF16)?;
    let mut dst = b.alloc_as(n_copy, DType::BF16)?;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        b.synchronize()?;
        let t = Instant::now();
        let reps = 5;
        for _ in 0..reps {
            f()?;
        }
        b.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };
    let s = time(&mut || b.copy(&mut dst, 0, &src, 0, n_copy))?;
    let bw = (2 * n_copy * 2) as f64 / s;
    drop((src, dst));
    let x = b.alloc_as(n_gemm * n_gemm, DType::BF16)?;
    let w = b.alloc_as(n_gemm * n_gemm, DType::BF16)?;
    let mut y = b.alloc_as(n_gemm * n_gemm, DType::BF16)?;
    b.fill(&mut y, 0, 0.0)?;
    let s = time(&mut || {
        b.matmul(
            &mut y,
            &x,
            &w,
            None,
            MatmulShape {
                m: n_gemm,
                k: n_gemm,
                n: n_gemm,
            },
            false,
        )
    })?;
    Ok((bw, 2.0 * (n_gemm as f64).powi(3) / s))
}

/// Milliseconds per call of `f` (mean of 10 after one warm-up; synchronized).
fn ms<B: Backend>(b: &B, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    b.synchronize()?;
    let t = Instant::now();
    for _ in 0..10 {
        f()?;
    }
    b.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 100.0)
}

/// Where one decode step of `rows` sequences at context `ctx` goes: the whole step (forward,
/// sampling, ids back), then the sampling op, one layer's paged attention and the LM head
/// alone.
fn breakdown<B: Backend>(
    dec: &mut Decoder<B>,
    rows: usize,
    ctx: usize,
) -> Result<Vec<(String, f64)>> {
    let per = ctx.div_ceil(DEFAULT_BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..rows)
        .map(|r| (0..per).map(|j| (r * per + j) as u32).collect())
        .collect();
    let sampling = full_distribution();
    let mut out = decode_steps(dec, ctx, &tables, &sampling)?;
    let (b, cfg) = (dec.backend(), dec.config());
    out.push(sample_op(b, cfg, rows, &sampling)?);
    out.push(paged_attention(b, cfg, ctx, &tables)?);
    out.extend(gemms(b, cfg, rows)?);
    Ok(out)
}

/// A whole decode step of one sequence per table at context `ctx`, eager and (where the
/// backend has them) replayed from a graph, and the replay alone.
fn decode_steps<B: Backend>(
    dec: &mut Decoder<B>,
    ctx: usize,
    tables: &[Vec<u32>],
    sampling: &SamplingParams,
) -> Result<Vec<(String, f64)>> {
    let (rows, bs) = (tables.len(), DEFAULT_BLOCK_SIZE);
    let per = ctx.div_ceil(bs);
    let tokens = vec![1u32; rows];
    let mut out = Vec::new();
    let graphs = dec.backend().graphs_supported();
    for mode in [GraphMode::Eager, GraphMode::Graphs] {
        if mode == GraphMode::Graphs && !graphs {
            continue;
        }
        let mut engine = PagedDecoder::new(dec, rows * per, bs)?;
        engine.set_graphs(mode, rows, per)?;
        let chunks: Vec<Chunk> = (0..rows)
            .map(|r| Chunk {
                tokens: &tokens[r..r + 1],
                start: ctx - 1,
                table: &tables[r],
            })
            .collect();
        let srows: Vec<SampleRow> = (0..rows)
            .map(|r| SampleRow {
                chunk: r,
                key: r as u64,
                position: 0,
            })
            .collect();
        // The first steps plan the GEMMs and capture the graph (at the bucket's third step).
        for _ in 0..3 {
            engine.run_step(&chunks, &srows, sampling)?;
        }
        let t = Instant::now();
        for _ in 0..10 {
            engine.run_step(&chunks, &srows, sampling)?;
        }
        let how = if mode == GraphMode::Graphs {
            "graph replay"
        } else {
            "eager"
        };
        out.push((
            format!("decode step ({rows} seqs, ctx {ctx}, {how})"),
            t.elapsed().as_secs_f64() * 100.0,
        ));
        // The replay alone, back to back: the step's device time; the difference to the
        // row above is what the host adds to each step (inputs, launch, tokens back).
        if let Some(id) = engine.cache.first_graph() {
            let b = engine.decoder.backend();
            out.push((
                format!("decode step ({rows} seqs, ctx {ctx}), graph replay alone"),
                ms(b, || b.graph_launch(id))?,
            ));
        }
    }
    Ok(out)
}

/// The sampling op alone over `rows` rows of logits.
fn sample_op<B: Backend>(
    b: &B,
    cfg: &Config,
    rows: usize,
    sampling: &SamplingParams,
) -> Result<(String, f64)> {
    let v = cfg.vocab_size;
    let logits = b.alloc(rows * v)?;
    let keys = b.alloc_idx(2 * rows)?;
    let pos = b.alloc_idx(rows)?;
    let mut toks = b.alloc_idx(rows)?;
    let mut lps = b.alloc(rows)?;
    Ok((
        format!("sample op [{rows} x {v}]"),
        ms(b, || {
            b.sample(
                &logits,
                v,
                Draws {
                    tokens: &mut toks,
                    logprobs: &mut lps,
                    keys: &keys,
                    positions: &pos,
                    rows,
                    sampling,
                },
            )
        })?,
    ))
}

/// One layer's paged attention over the tables at context `ctx`.
fn paged_attention<B: Backend>(
    b: &B,
    cfg: &Config,
    ctx: usize,
    tables: &[Vec<u32>],
) -> Result<(String, f64)> {
    let (rows, bs) = (tables.len(), DEFAULT_BLOCK_SIZE);
    let per = ctx.div_ceil(bs);
    let cd = b.compute_dtype();
    let kvd = cfg.num_kv_heads * cfg.head_dim;
    let kc = b.alloc_as(rows * per * bs * kvd, cd)?;
    let vc = b.alloc_as(rows * per * bs * kvd, cd)?;
    let q = b.alloc_as(rows * cfg.num_heads * cfg.head_dim, cd)?;
    let mut o = b.alloc_as(rows * cfg.num_heads * cfg.head_dim, cd)?;
    let mut tab = b.alloc_idx(rows * per)?;
    b.upload_idx(&mut tab, &tables.concat())?;
    let mut seq = b.alloc_idx(rows)?;
    b.upload_idx(&mut seq, &(0..rows as u32).collect::<Vec<_>>())?;
    let mut len = b.alloc_idx(rows)?;
    b.upload_idx(&mut len, &vec![ctx as u32; rows])?;
    let shape = PagedAttnShape {
        queries: rows,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        block_size: bs,
        max_blocks: per,
    };
    Ok((
        "attention_paged, one layer".into(),
        ms(b, || {
            b.attention_paged(
                &mut o,
                &q,
                KvCache { k: &kc, v: &vc },
                BlockTables {
                    tables: &tab,
                    seq: &seq,
                    len: &len,
                },
                shape,
            )
        })?,
    ))
}

/// The step's GEMMs alone: LM head, MLP up, and the projections as they are and fused.
fn gemms<B: Backend>(b: &B, cfg: &Config, rows: usize) -> Result<Vec<(String, f64)>> {
    let (v, d) = (cfg.vocab_size, cfg.hidden_size);
    let cd = b.compute_dtype();
    let mut out = Vec::new();
    let x = b.alloc_as(rows * d, cd)?;
    let w = b.alloc_as(v * d, cd)?;
    // A GEMM of the step's rows from the hidden size to `n` outputs.
    let gemm = |n| MatmulShape { m: rows, k: d, n };
    let mut y = b.alloc(rows * v)?;
    out.push((
        format!("LM head GEMM [{rows} x {d}] x [{d} x {v}]"),
        ms(b, || b.matmul(&mut y, &x, &w, None, gemm(v), false))?,
    ));
    let f = cfg.intermediate_size;
    let wu = b.alloc_as(2 * f * d, cd)?;
    let mut h = b.alloc_as(rows * 2 * f, cd)?;
    out.push((
        format!("MLP up GEMM [{rows} x {d}] x [{d} x {f}]"),
        ms(b, || b.matmul(&mut h, &x, &wu, None, gemm(f), false))?,
    ));
    // What fusing the projections that share an input would give (weights side by side).
    out.push((
        format!("gate+up as one GEMM [{rows} x {d}] x [{d} x {}]", 2 * f),
        ms(b, || b.matmul(&mut h, &x, &wu, None, gemm(2 * f), false))?,
    ));
    let (qd, kd) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    out.push((
        format!("q, k, v GEMMs [{rows} x {d}] x [{d} x {qd}|{kd}|{kd}]"),
        ms(b, || {
            b.matmul(&mut h, &x, &wu, None, gemm(qd), false)?;
            b.matmul(&mut h, &x, &wu, None, gemm(kd), false)?;
            b.matmul(&mut h, &x, &wu, None, gemm(kd), false)
        })?,
    ));
    out.push((
        format!("qkv as one GEMM [{rows} x {d}] x [{d} x {}]", qd + 2 * kd),
        ms(b, || {
            b.matmul(&mut h, &x, &wu, None, gemm(qd + 2 * kd), false)
        })?,
    ));
    Ok(out)
}

impl Job for Bench<'_> {
    /// The runs, copy bandwidth, GEMM peak, device, step breakdown, merge seconds.
    type Out = (
        Vec<Measured>,
        f64,
        f64,
        String,
        Vec<(String, f64)>,
        Option<f64>,
    );
    fn run<B: Backend>(self, backend: B) -> Result<Self::Out> {
        let name = backend.name();
        let (bw, peak) = peaks(&backend)?;
        let cfg = &self.cfg;
        let lora = self.lora.as_ref().map(|l| (l, self.args.lora_mode));
        let (mut dec, merge_s) =
            bench_decoder(backend, cfg, self.dir.as_deref(), self.args.seed, lora)?;
        let roof = Roofline::new(cfg, dec.backend().compute_dtype());
        let mut out = Vec::new();
        // Warm-up: kernel compilation and the workspace, outside the timings.
        let warm = warm_up();
        let graphs = dec.backend().graphs_supported();
        let reps = self.args.runs.max(1);
        let runs = self.args.modes.iter().flat_map(|&m| {
            std::iter::once((&warm, m, 1)).chain(
                self.cases
                    .iter()
                    .flat_map(move |c| (1..=reps).map(move |r| (c, m, r))),
            )
        });
        let sampler = ClockSampler::on(self.args.device);
        for (case, mode, run) in runs {
            if mode == StepMode::Graphs && !graphs {
                continue;
            }
            let t0 = Instant::now();
            let timed = self.time_case(&mut dec, case, mode)?;
            if case.name == warm.name {
                continue;
            }
            let mut m = roof.measured(case, mode, run, timed);
            m.clocks = sampler.as_ref().and_then(|s| s.summary(t0, Instant::now()));
            out.push(m);
        }
        let parts = breakdown(&mut dec, self.breakdown_rows(), 256)?;
        Ok((out, bw, peak, name, parts, merge_s))
    }
}

/// The case that runs first in each mode, untimed: kernel compilation and the workspace.
fn warm_up() -> Case {
    Case {
        name: "warm-up".into(),
        requests: vec![Request {
            max_new: Vec::new(),
            prompt: vec![1; 16],
            sample_keys: vec![1, 2],
        }],
        params: GenParams {
            sampling: full_distribution(),
            max_new_tokens: 4,
            stop_token_ids: vec![],
            stop_strings: vec![],
        },
        random_stops: false,
    }
}

/// One run of a case: what it generated and how long it took.
struct CaseRun {
    done: Vec<Vec<Completion>>,
    stats: PagedStats,
    graphs: GraphStats,
    seconds: f64,
    split: StepSplit,
    planning: (u64, f64),
}

impl Bench<'_> {
    /// Generates `case` once with its decode steps run as `mode` says, on an engine sized for
    /// it (a pool where every running sample fits at its longest: no preemption).
    fn time_case<B: Backend>(
        &self,
        dec: &mut Decoder<B>,
        case: &Case,
        mode: StepMode,
    ) -> Result<CaseRun> {
        let limits = Limits {
            max_num_seqs: self.args.max_num_seqs,
            max_batched_tokens: self.args.max_batched_tokens,
            gpu_memory_fraction: None,
            graphs: mode == StepMode::Graphs,
            overlap: !self.args.no_overlap,
        };
        let (mut engine, plan) = PagedDecoder::sized(dec, &case.requests, &case.params, &limits)?;
        engine.decoder.backend().synchronize()?;
        let plans0 = engine.decoder.backend().gemm_planning();
        let t = Instant::now();
        let mut timed = Timed {
            inner: &mut engine,
            split: StepSplit::default(),
            queued: Default::default(),
        };
        let (done, stats) = generate_paged(
            &mut timed,
            &plan.config,
            &case.requests,
            &case.params,
            None,
            &mut |_| {},
        )?;
        let split = timed.split;
        engine.decoder.backend().synchronize()?;
        let seconds = t.elapsed().as_secs_f64();
        let planning = match (plans0, engine.decoder.backend().gemm_planning()) {
            (Some((n0, s0)), Some((n1, s1))) => (n1 - n0, s1 - s0),
            _ => (0, 0.0),
        };
        let graphs = engine.release_graphs()?;
        Ok(CaseRun {
            done,
            stats,
            graphs,
            seconds,
            split,
            planning,
        })
    }
}

/// What the roofline counts per unit of work for one model.
struct Roofline {
    params: f64,
    /// Bytes of one element of the compute dtype.
    esize: f64,
    /// Bytes of the keys and values of one position over every layer.
    kv_per_pos: f64,
    /// Attention FLOPs per position of context over every layer.
    attn_per_pos: f64,
}

impl Roofline {
    fn new(cfg: &Config, dtype: DType) -> Roofline {
        let esize = match dtype {
            DType::F32 => 4.0,
            DType::BF16 => 2.0,
        };
        Roofline {
            params: param_count(cfg) as f64,
            esize,
            kv_per_pos: (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim) as f64 * esize,
            attn_per_pos: (4 * cfg.num_layers * cfg.num_heads * cfg.head_dim) as f64,
        }
    }

    /// A run's measurements with its roofline work: every step reads all weights; each
    /// generated token after the first reads the keys and values of its context; every token
    /// fed costs 2·params FLOPs plus 4·context·heads·head_dim per layer of attention.
    fn measured(&self, case: &Case, mode: StepMode, run: usize, r: CaseRun) -> Measured {
        let (mut kv_bytes, mut attn_flops, mut fed, mut new_tokens) = (0f64, 0f64, 0f64, 0);
        for (req, cs) in case.requests.iter().zip(&r.done) {
            let p = req.prompt.len() as f64;
            // The prompt is prefilled once for its samples.
            attn_flops += self.attn_per_pos * p * (p + 1.0) / 2.0;
            fed += p;
            for c in cs {
                let l = c.tokens.len() as f64;
                new_tokens += c.tokens.len();
                // Decode steps feed tokens at positions p .. p+l−2, each reading ctx = pos+1.
                let ctx_sum = (l - 1.0).max(0.0) * p + (l - 1.0).max(0.0) * l / 2.0;
                kv_bytes += ctx_sum * self.kv_per_pos;
                attn_flops += ctx_sum * self.attn_per_pos;
                fed += (l - 1.0).max(0.0);
            }
        }
        let bytes = r.stats.gen.decode_steps as f64 * self.params * self.esize + kv_bytes;
        let gs = r.graphs;
        Measured {
            name: case.name.clone(),
            run,
            mode: match mode {
                StepMode::Graphs => "graphs",
                StepMode::Eager => "eager",
            },
            replays: gs.replays,
            captures: gs.captures,
            capture_s: gs.capture_us as f64 * 1e-6,
            drops: gs.drops,
            samples: case.requests.iter().map(|r| r.sample_keys.len()).sum(),
            new_tokens,
            seconds: r.seconds,
            steps: r.stats.gen.decode_steps,
            preemptions: r.stats.preemptions,
            bytes,
            flops: 2.0 * self.params * fed + attn_flops,
            lengths: Lengths::of(
                r.done.iter().flatten().map(|c| c.tokens.len()),
                case.params.max_new_tokens,
            ),
            split: r.split,
            planning: r.planning,
            clocks: None,
        }
    }
}

/// Wall time of a run's steps by kind: pure decode (every sequence feeds one token) and the
/// rest (prefill chunks, mixed steps). Each step waits for its drawn tokens, so wall time is
/// device time plus the host's share.
#[derive(Clone, Copy, Debug, Default)]
struct StepSplit {
    decode_s: f64,
    decode_steps: usize,
    other_s: f64,
    other_steps: usize,
    /// The slowest pure-decode step (a bucket's first, eager, step or its capture).
    slowest_decode_s: f64,
}

struct Timed<'a> {
    inner: &'a mut dyn PagedModel,
    split: StepSplit,
    /// Per submitted step not yet collected: whether it is a pure decode step. With overlap
    /// a step's time is what the host waits in its submit and its collect.
    queued: std::collections::VecDeque<(bool, f64)>,
}

impl Timed<'_> {
    fn record(&mut self, decode: bool, s: f64) {
        let sp = &mut self.split;
        if decode {
            sp.decode_s += s;
            sp.decode_steps += 1;
            sp.slowest_decode_s = sp.slowest_decode_s.max(s);
        } else {
            sp.other_s += s;
            sp.other_steps += 1;
        }
    }
}

impl PagedModel for Timed<'_> {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        let t = Instant::now();
        let out = self.inner.step(chunks, rows, sampling)?;
        let s = t.elapsed().as_secs_f64();
        self.record(chunks.iter().all(|c| c.tokens.len() == 1), s);
        Ok(out)
    }
    fn asynchronous(&self) -> bool {
        self.inner.asynchronous()
    }
    fn submit(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<()> {
        let t = Instant::now();
        self.inner.submit(chunks, feed, rows, sampling)?;
        let decode = chunks.iter().all(|c| c.tokens.len() == 1);
        self.queued.push_back((decode, t.elapsed().as_secs_f64()));
        Ok(())
    }
    fn collect(&mut self) -> Result<Vec<Sampled>> {
        let t = Instant::now();
        let out = self.inner.collect()?;
        let (decode, s) = self
            .queued
            .pop_front()
            .ok_or_else(|| anyhow::anyhow!("bench: collect without a submitted step"))?;
        self.record(decode, s + t.elapsed().as_secs_f64());
        Ok(out)
    }
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        self.inner.copy_blocks(pairs)
    }
}

fn random_prompt(len: usize, vocab: usize, key: u64) -> Vec<u32> {
    (0..len)
        .map(|i| (uniform(key, i as u64) * vocab as f64) as u32)
        .collect()
}

pub fn run(args: RolloutBenchArgs) -> Result<()> {
    let bench = Bench::new(&args)?;
    let lora = bench.lora.clone();
    if let Some(path) = &args.cases_out {
        write_cases(path, &bench)?;
    }
    let (rows, bw, peak, device, parts, merge_s) = on_device(args.device, bench)?;
    let lora = lora.map(|l| (l, merge_s));
    print_report(&args, &rows, (bw, peak), (&device, lora.as_ref()), &parts);
    Ok(())
}

/// The cases the flags ask for: the forced-length batches, then the GRPO-shaped one.
fn cases(args: &RolloutBenchArgs, vocab: usize) -> Result<Vec<Case>> {
    let sampling = full_distribution();
    let mut cases = Vec::new();
    for &b in &args.batches {
        let requests = (0..b)
            .map(|i| {
                let prompt = random_prompt(args.prompt_tokens, vocab, args.seed ^ (i as u64) << 20);
                let key = sample_key(args.seed, &prompt, i as u64, 0);
                Request {
                    max_new: Vec::new(),
                    prompt,
                    sample_keys: vec![key],
                }
            })
            .collect();
        cases.push(Case {
            name: format!(
                "batch {b} x prompt {} x {} new",
                args.prompt_tokens, args.new_tokens
            ),
            requests,
            params: GenParams {
                sampling,
                max_new_tokens: args.new_tokens,
                stop_token_ids: vec![],
                stop_strings: vec![],
            },
            random_stops: false,
        });
    }
    if !args.skip_grpo {
        cases.push(grpo_case(args, vocab, sampling)?);
    }
    Ok(cases)
}

/// The GRPO-shaped case: prompts of random lengths around the mean, n samples each, random
/// stops.
fn grpo_case(args: &RolloutBenchArgs, vocab: usize, sampling: SamplingParams) -> Result<Case> {
    let [prompts, n, mean_len, max_new] = args.grpo[..] else {
        anyhow::bail!("--grpo takes 4 numbers: prompts, n, mean prompt tokens, max new tokens");
    };
    let requests = (0..prompts)
        .map(|i| {
            let key = args.seed.wrapping_add(1_000_003 * (i as u64 + 1));
            // Prompt lengths uniform in mean ± 20%.
            let spread = (mean_len / 5).max(1);
            let len = mean_len - spread + (uniform(key, u64::MAX) * (2 * spread) as f64) as usize;
            let prompt = random_prompt(len.max(1), vocab, key);
            let keys = (0..n as u64)
                .map(|s| sample_key(args.seed, &prompt, i as u64, s))
                .collect();
            Request {
                max_new: Vec::new(),
                prompt,
                sample_keys: keys,
            }
        })
        .collect();
    // Random stops: one id in 300 ends a sample (near-uniform random-weight logits: a mean
    // length of ~250 of the 512 allowed).
    let stop_token_ids = if args.fixed_lengths {
        vec![]
    } else {
        (0..vocab as u32).filter(|t| t % 300 == 7).collect()
    };
    Ok(Case {
        name: format!("GRPO {prompts} x n={n}, prompt ~{mean_len}, <= {max_new} new"),
        requests,
        params: GenParams {
            sampling,
            max_new_tokens: max_new,
            stop_token_ids,
            stop_strings: vec![],
        },
        random_stops: !args.fixed_lengths,
    })
}

impl<'a> Bench<'a> {
    /// The sequences of the decode step broken down: the last --batches, or with --prompts the
    /// most the cases decode at once.
    fn breakdown_rows(&self) -> usize {
        let samples = |c: &Case| {
            c.requests
                .iter()
                .map(|r| r.sample_keys.len())
                .sum::<usize>()
        };
        match self.args.prompts {
            Some(_) => self
                .cases
                .iter()
                .map(samples)
                .max()
                .unwrap_or(1)
                .min(self.args.max_num_seqs),
            None => self.args.batches.last().copied().unwrap_or(64),
        }
    }

    /// The model of --model and the cases the flags ask for.
    fn new(args: &'a RolloutBenchArgs) -> Result<Bench<'a>> {
        let (cfg, dir) = bench_model(&args.model)?;
        let cases = match (&args.prompts, &dir) {
            (Some(prompts), Some(dir)) => prompt_cases(args, prompts, dir, &cfg)?,
            (Some(_), None) => bail_input!(
                "--prompts needs --model DIR (a model directory: its tokenizer and chat template render the prompts), not the shape '{}'",
                args.model
            ),
            (None, _) => cases(args, cfg.vocab_size)?,
        };
        Ok(Bench {
            args,
            cfg,
            dir,
            cases,
            lora: args.lora.spec()?,
        })
    }
}

/// `--model`: a model directory (its config; the weights load on the device), or a shape
/// whose random weights the bench makes.
fn bench_model(model: &str) -> Result<(Config, Option<PathBuf>)> {
    let path = Path::new(model);
    if path.is_dir() {
        let dir = path.canonicalize()?;
        return Ok((ModelDir::load_config(&dir)?, Some(dir)));
    }
    match shape(model) {
        Ok(cfg) => Ok((cfg, None)),
        Err(e) => bail_input!("--model {model}: not a model directory; {e}"),
    }
}

/// The --prompts cases: the first --limit prompts rendered as `rollout` renders them (the
/// model's chat template), sampled as `rollout --seed` samples them, one case per --n.
fn prompt_cases(
    args: &RolloutBenchArgs,
    prompts: &Path,
    dir: &Path,
    cfg: &Config,
) -> Result<Vec<Case>> {
    let dataset = PromptDataset::open_with_key(prompts, "prompt")?;
    let n_prompts = args.limit.min(dataset.len());
    let tokenizer = Tokenizer::from_dir(dir)?;
    let template = ChatTemplate::from_dir(dir)?;
    let limits = PromptLimits {
        prompt_key: "prompt",
        max_prompt_tokens: args.max_prompt_tokens,
        truncate: Truncate::Error,
        tools: &[],
    };
    let (ids, _) = tokenize_prompts(
        &dataset,
        n_prompts,
        &tokenizer,
        Some(&template),
        cfg.vocab_size,
        &limits,
    )?;
    let stop_token_ids = match args.fixed_lengths {
        true => vec![],
        false => cfg.eos_token_ids.clone(),
    };
    if stop_token_ids.is_empty() && !args.fixed_lengths {
        bail_input!(
            "{}: the model names no eos_token_id (config.json, generation_config.json): nothing would end a sample; pass --fixed-lengths",
            dir.display()
        );
    }
    let ends = match args.fixed_lengths {
        true => "fixed",
        false => "EOS",
    };
    let case = |n: usize| Case {
        name: format!(
            "prompts {n_prompts} x n={n}, <= {} new, {ends}",
            args.new_tokens
        ),
        requests: keyed_requests(&ids, n, args.seed).1,
        params: GenParams {
            sampling: full_distribution(),
            max_new_tokens: args.new_tokens,
            stop_token_ids: stop_token_ids.clone(),
            stop_strings: vec![],
        },
        random_stops: false,
    };
    Ok(args.n.iter().map(|&n| case(n)).collect())
}

/// The length distribution of a run's samples (new tokens each, an ending stop id counted):
/// the mean, nearest-rank percentiles (the smallest length that at least q of the samples do
/// not exceed: what bench/peer_vllm.py computes too), the longest, and the share that reached
/// the cap.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Lengths {
    mean: f64,
    p50: usize,
    p90: usize,
    p99: usize,
    max: usize,
    at_cap: f64,
}

impl Lengths {
    fn of(lengths: impl Iterator<Item = usize>, cap: usize) -> Lengths {
        let mut s: Vec<usize> = lengths.collect();
        s.sort_unstable();
        let n = s.len();
        // The ceil(q·n)-th smallest, q in percent.
        let rank = |q: usize| match n {
            0 => 0,
            _ => s[(q * n).div_ceil(100).max(1) - 1],
        };
        Lengths {
            mean: s.iter().sum::<usize>() as f64 / n.max(1) as f64,
            p50: rank(50),
            p90: rank(90),
            p99: rank(99),
            max: s.last().copied().unwrap_or(0),
            at_cap: s.iter().filter(|&&l| l >= cap).count() as f64 / n.max(1) as f64,
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "mean": self.mean,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
            "at_cap_fraction": self.at_cap,
        })
    }
}

/// The work of every case as a peer engine needs it: the HF config of the shape (and the model
/// directory whose weights ran, or null), and per case its prompts' ids, samples per prompt,
/// most new tokens, whether random stops apply (a peer skips those) and otherwise the ids that
/// end a sample (empty: every sample runs to the cap).
fn write_cases(path: &std::path::Path, bench: &Bench) -> Result<()> {
    let cases: Vec<serde_json::Value> = bench
        .cases
        .iter()
        .map(|c| {
            json!({
                "case": c.name,
                "prompts": c.requests.iter().map(|r| &r.prompt).collect::<Vec<_>>(),
                "n": c.requests.first().map_or(1, |r| r.sample_keys.len()),
                "max_new_tokens": c.params.max_new_tokens,
                "random_stops": c.random_stops,
                "stop_token_ids": match c.random_stops {
                    true => &[][..],
                    false => &c.params.stop_token_ids[..],
                },
            })
        })
        .collect();
    let doc = json!({
        "model": bench.args.model,
        "model_dir": bench.dir,
        "config": bench.cfg.to_hf_json(None),
        "max_num_seqs": bench.args.max_num_seqs,
        "cases": cases,
    });
    crate::batch::write::write_atomic(path, serde_json::to_string(&doc)?.as_bytes())
}

/// Prints the breakdown and the table of runs, and writes the JSON report.
fn print_report(
    args: &RolloutBenchArgs,
    rows: &[Measured],
    (bw, peak): (f64, f64),
    (device, lora): (&str, Option<&(LoraSpec, Option<f64>)>),
    parts: &[(String, f64)],
) {
    for (what, t) in parts {
        println!("{what:>48}: {t:8.3} ms");
    }
    let (table, js): (Vec<Vec<String>>, Vec<serde_json::Value>) =
        rows.iter().map(|m| run_row(m, bw, peak)).unzip();
    let adapters = lora.map_or(String::new(), |(l, merge_s)| {
        let merge = merge_s.map_or(String::new(), |s| format!(", merge {s:.3} s"));
        let mode = format!("{:?}", args.lora_mode).to_lowercase();
        format!(
            ", LoRA rank {} on {} {mode}{merge}",
            l.rank, args.lora.lora_targets
        )
    });
    report(
        &format!(
            "bench rollout ({}{adapters}, {device}; measured copy {:.0} GB/s, bf16 GEMM {:.1} TFLOP/s)",
            args.model,
            bw / 1e9,
            peak / 1e12
        ),
        &[
            "case",
            "mode",
            "run",
            "samples",
            "new tok",
            "s",
            "tok/s",
            "steps",
            "MB/step",
            "%BW",
            "%GEMM",
            "preempt",
            "replay/capt",
            "decode/other ms",
            "ms/decode",
            "GEMM plans",
            "len mean/p50/p90/p99/max",
            "at cap",
            "SM MHz / W (power-capped), tok/J",
        ],
        &table,
        &json!({
            "bench": "rollout",
            "model": args.model,
            "device": device,
            "copy_bandwidth_bytes_per_s": bw,
            "gemm_bf16_flops_per_s": peak,
            "cases": js,
            "lora": lora.map(|(l, merge_s)| json!({
                "rank": l.rank,
                "alpha": l.alpha,
                "targets": l.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
                "mode": args.lora_mode,
                "merge_seconds": merge_s,
            })),
            "decode_step_breakdown_ms": parts.iter().map(|(w, t)| json!({"part": w, "ms": t})).collect::<Vec<_>>(),
        }),
    );
}

/// A run's row of the table and its JSON record.
fn run_row(m: &Measured, bw: f64, peak: f64) -> (Vec<String>, serde_json::Value) {
    let tps = m.new_tokens as f64 / m.seconds;
    let bw_frac = m.bytes / m.seconds / bw;
    let fl_frac = m.flops / m.seconds / peak;
    let row = vec![
        m.name.clone(),
        m.mode.into(),
        m.run.to_string(),
        m.samples.to_string(),
        m.new_tokens.to_string(),
        format!("{:.2}", m.seconds),
        format!("{tps:.0}"),
        m.steps.to_string(),
        format!("{:.0}", m.bytes / m.steps.max(1) as f64 / 1e6),
        format!("{:.1}%", 100.0 * bw_frac),
        format!("{:.1}%", 100.0 * fl_frac),
        m.preemptions.to_string(),
        format!(
            "{}/{} ({:.0} ms, {} drops)",
            m.replays,
            m.captures,
            1e3 * m.capture_s,
            m.drops
        ),
        format!(
            "{:.0} / {:.0}",
            1e3 * m.split.decode_s,
            1e3 * m.split.other_s
        ),
        format!(
            "{:.2}",
            1e3 * m.split.decode_s / m.split.decode_steps.max(1) as f64
        ),
        format!("{} ({:.0} ms)", m.planning.0, 1e3 * m.planning.1),
        format!(
            "{:.0}/{}/{}/{}/{}",
            m.lengths.mean, m.lengths.p50, m.lengths.p90, m.lengths.p99, m.lengths.max
        ),
        format!("{:.1}%", 100.0 * m.lengths.at_cap),
        m.clocks.map_or("-".into(), |c| {
            format!(
                "{:.0} / {:.0} ({:.0}%), {}",
                c.sm_mhz_median,
                c.power_w_mean,
                100.0 * c.power_capped_fraction,
                c.per_joule(tps).map_or("-".into(), |j| format!("{j:.1}"))
            )
        }),
    ];
    let js = json!({
        "case": m.name,
        "run": m.run,
        "samples": m.samples,
        "new_tokens": m.new_tokens,
        "seconds": m.seconds,
        "tokens_per_s": tps,
        "steps": m.steps,
        "roofline_bytes": m.bytes,
        "bandwidth_fraction": bw_frac,
        "flops": m.flops,
        "gemm_peak_fraction": fl_frac,
        "preemptions": m.preemptions,
        "mode": m.mode,
        "graph_replays": m.replays,
        "graph_captures": m.captures,
        "graph_capture_s": m.capture_s,
        "graph_drops": m.drops,
        "decode_steps_s": m.split.decode_s,
        "decode_steps": m.split.decode_steps,
        "other_steps_s": m.split.other_s,
        "other_steps": m.split.other_steps,
        "slowest_decode_step_s": m.split.slowest_decode_s,
        "gemm_plans": m.planning.0,
        "gemm_planning_s": m.planning.1,
        "lengths": m.lengths.json(),
        "gpu_clocks": m.clocks,
        // The energy a token costs, at the run's mean power: what a power-capped GPU trades.
        "tokens_per_joule": m.clocks.and_then(|c| c.per_joule(tps)),
    });
    (row, js)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: RolloutBenchArgs,
    }

    /// `--cases-out` hands a peer the same work: the shape's HF config, and per case the prompt
    /// ids the engine runs, the samples per prompt and the new tokens; `--fixed-lengths` drops
    /// the GRPO case's random stops.
    #[test]
    fn cases_out_holds_the_cases_the_engine_runs() {
        let flags = "x --device cpu --model small --batches 3 --prompt-tokens 5 --new-tokens 7 \
                     --grpo 2,4,10,9 --fixed-lengths";
        let args = Cli::parse_from(flags.split_whitespace()).args;
        let cfg = shape(&args.model).unwrap();
        let bench = Bench {
            args: &args,
            cfg: cfg.clone(),
            dir: None,
            cases: cases(&args, cfg.vocab_size).unwrap(),
            lora: None,
        };
        let path = std::env::temp_dir().join(format!("cases-{}.json", std::process::id()));
        write_cases(&path, &bench).unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(doc["config"]["hidden_size"], 256);
        assert_eq!(doc["config"]["num_hidden_layers"], 4);
        let cs = doc["cases"].as_array().unwrap();
        assert_eq!(cs.len(), 2);
        let (batch, grpo) = (&cs[0], &cs[1]);
        assert_eq!(
            (batch["n"].as_u64(), batch["max_new_tokens"].as_u64()),
            (Some(1), Some(7))
        );
        let prompts = batch["prompts"].as_array().unwrap();
        assert_eq!(prompts.len(), 3);
        assert!(prompts.iter().all(|p| p.as_array().unwrap().len() == 5));
        let ids: Vec<u64> = prompts[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let want: Vec<u64> = bench.cases[0].requests[1]
            .prompt
            .iter()
            .map(|&t| t as u64)
            .collect();
        assert_eq!(ids, want);
        assert_eq!(
            (grpo["n"].as_u64(), grpo["max_new_tokens"].as_u64()),
            (Some(4), Some(9))
        );
        assert_eq!(grpo["prompts"].as_array().unwrap().len(), 2);
        assert_eq!(grpo["random_stops"], false);
        assert_eq!(grpo["stop_token_ids"], json!([]));
        assert_eq!(doc["model_dir"], serde_json::Value::Null);
        assert!(bench.cases[1].params.stop_token_ids.is_empty());
    }

    /// The length statistics of a small set, by hand: sorted 1 1 2 3 3 4 5 5 6 9, nearest
    /// rank (the ceil(q·10)-th): p50 the 5th, p90 the 9th, p99 the 10th.
    #[test]
    fn lengths_are_the_mean_nearest_rank_percentiles_and_the_share_at_the_cap() {
        let l = Lengths::of([3, 1, 4, 1, 5, 9, 2, 6, 5, 3].into_iter(), 9);
        let want = Lengths {
            mean: 3.9,
            p50: 3,
            p90: 6,
            p99: 9,
            max: 9,
            at_cap: 0.1,
        };
        assert_eq!(l, want);
        // One sample: every percentile is it; none: zeros, not NaN.
        let one = Lengths::of([7].into_iter(), 7);
        assert_eq!((one.p50, one.p99, one.max, one.at_cap), (7, 7, 7, 1.0));
        let none = Lengths::of(std::iter::empty(), 7);
        assert_eq!((none.mean, none.p50, none.at_cap), (0.0, 0, 0.0));
    }

    /// bench/vllm_lease.sh runs the 14B shape's GRPO case at 64 × 8: at 128 × 8 the pool the
    /// bench sizes (every sample's keys and values at its longest) and the bf16 weights are
    /// more than one H200's 139 GiB; at 64 × 8 they leave room for the workspace.
    #[test]
    fn the_14b_grpo_case_fits_one_h200_at_64_prompts_not_128() {
        let cfg = shape("qwen14b").unwrap();
        let weights = param_count(&cfg) * 2;
        let block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DEFAULT_BLOCK_SIZE * 2;
        let pool = |prompts: usize| {
            let flags = format!(
                "x --model qwen14b --grpo {prompts},8,131,512 --fixed-lengths --max-num-seqs 1024"
            );
            let args = Cli::parse_from(flags.split_whitespace()).args;
            let sampling = SamplingParams::greedy();
            let case = grpo_case(&args, cfg.vocab_size, sampling).unwrap();
            let limits = Limits {
                max_num_seqs: args.max_num_seqs,
                max_batched_tokens: args.max_batched_tokens,
                gpu_memory_fraction: None,
                graphs: true,
                overlap: true,
            };
            let need = crate::engine::paged::Need::of(&case.requests, &case.params);
            crate::engine::paged::Plan::new(&need, &limits, None, block).kv_pool_bytes()
        };
        let h200 = 139usize << 30;
        assert!(
            weights + pool(128) > h200,
            "{} GiB",
            (weights + pool(128)) >> 30
        );
        assert!(
            weights + pool(64) + (16 << 30) < h200,
            "{} GiB",
            (weights + pool(64)) >> 30
        );
    }
}
