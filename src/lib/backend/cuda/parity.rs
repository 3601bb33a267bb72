//! `tandem gpu-test`: every op of the CUDA backend against the CPU backend (the oracle) on
//! fresh random inputs, in f32 and in bf16 storage, then the whole decoder and the paged
//! engine on both. The op families' cases come from their `check.rs` files
//! (`backend::ops::op_cases`, harness in `backend::check::gpu`); the decoder- and engine-level
//! cases are here and in `parity_paged.rs`, on a [`Suite`] that extends the harness's context.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};

use super::CudaBackend;
use crate::backend::check::gpu::{compare, dname, print_table, round, tols, Ctx, Row, DTYPES};
use crate::backend::check::timing;
use crate::backend::cpu::Cpu;
use crate::backend::ops;
use crate::backend::prelude::*;
use crate::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads, TokenStats};
use crate::model::{init, Arch, Config, Weights};

#[derive(clap::Args, Debug, Clone)]
pub struct GpuTestArgs {
    /// GPU ordinal to test.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Run only the checks (and with --time, time only the ops) whose name contains this text.
    #[arg(long)]
    pub only: Option<String>,
    /// Seed of the random inputs (default: a fresh one, printed so a run can be replayed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Only compile every kernel with NVRTC for --arch (needs libnvrtc, not a GPU).
    #[arg(long)]
    pub compile_only: bool,
    /// Target of --compile-only.
    #[arg(long, default_value = "sm_90")]
    pub arch: String,
    /// Also write the table as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// After the checks, time each op at the Qwen2.5-0.5B training shape (CUDA events).
    #[arg(long)]
    pub time: bool,
    /// Timed runs per op (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// The tiny HF models with transformers' log-probs (the `hf_fixtures` check).
    #[arg(long, default_value = "tests/fixtures/hf")]
    pub hf_fixtures: PathBuf,
}

/// The harness's context with what the decoder-level cases need besides.
struct Suite<'a> {
    ctx: Ctx<'a>,
    /// The tiny HF models with transformers' log-probs (the `hf_fixtures` check).
    hf_fixtures: PathBuf,
}

impl<'a> Deref for Suite<'a> {
    type Target = Ctx<'a>;
    fn deref(&self) -> &Ctx<'a> {
        &self.ctx
    }
}

impl DerefMut for Suite<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ctx
    }
}

/// All tensors of a weight map, in name order, as one vector.
fn flat(w: &Weights) -> Vec<f32> {
    w.values().flat_map(|t| t.data.iter().copied()).collect()
}

/// The tensor whose relative error is worst, and that error.
fn worst_tensor(gpu: &Weights, cpu: &Weights) -> (String, f64) {
    let mut worst = (String::new(), 0.0);
    for (name, c) in cpu {
        if let Some(g) = gpu.get(name) {
            let (_, r, _) = compare(&g.data, &c.data, &[]);
            if r > worst.1 || r.is_nan() {
                worst = (name.clone(), r);
            }
        }
    }
    worst
}

impl Suite<'_> {
    /// The decoder (written once against the op set) on both backends: log-probs and entropies
    /// of packed sequences, the gradients of one forward/backward, one AdamW step, and the
    /// log-probs after it. The f32 pass builds the GPU decoder with f32 compute (op-by-op
    /// parity); the bf16 pass with the default bf16 compute weights and activations, f32
    /// masters and optimizer state, so it checks the mixed-precision training path.
    fn decoder(&mut self, d: DType) -> Result<()> {
        // (log-probs and entropies, gradients, update) relative to the CPU's scale.
        let (tol_lp, tol_g, tol_upd) = match d {
            DType::F32 => (1e-4, 1e-3, 1e-3),
            DType::BF16 => (2e-2, 5e-2, 5e-2),
        };
        for arch in [Arch::Qwen2, Arch::Llama, Arch::Qwen3] {
            let cfg = tiny_config(arch);
            let tag = format!("{arch:?}").to_lowercase();
            let mut w = init::random_weights(&cfg, self.rng.next_u64(), 0.05);
            // Norms start at one and biases at zero: move them so they are exercised too.
            for t in w.values_mut().filter(|t| t.shape.len() == 1) {
                for v in t.data.iter_mut() {
                    *v += 0.1 * self.rng.normal();
                }
            }
            let mut cpu = Decoder::new(Cpu, &cfg, &w)?;
            let gb = CudaBackend::new(self.ordinal)?;
            gb.set_compute_dtype(d);
            let mut gpu = Decoder::new(gb, &cfg, &w)?;
            let lens = [50usize, 17, 120];
            let toks: Vec<Vec<u32>> = lens
                .iter()
                .map(|&l| (0..l).map(|_| self.rng.below(1000) as u32).collect())
                .collect();
            let seqs: Vec<SeqRef> = toks
                .iter()
                .zip([1usize, 5, 30])
                .map(|(t, start)| SeqRef { tokens: t, start })
                .collect();
            let (lc, lg) = (
                cpu.logprobs(&seqs, 0.8, true)?,
                gpu.logprobs(&seqs, 0.8, true)?,
            );
            let cat = |v: &[TokenStats], ent: bool| -> Vec<f32> {
                v.iter()
                    .flat_map(|s| {
                        if ent {
                            s.entropy.clone().unwrap_or_default()
                        } else {
                            s.logprobs.clone()
                        }
                    })
                    .collect()
            };
            for (what, ent) in [("logprobs", false), ("entropy", true)] {
                let (g, c) = (cat(&lg, ent), cat(&lc, ent));
                let (a, r, p) = compare(&g, &c, &[]);
                let ok = g.len() == c.len() && !c.is_empty() && p.is_none() && r <= tol_lp;
                self.rows.push(Row {
                    op: format!("decoder {what} [{tag}]"),
                    dtype: dname(d),
                    max_abs: a,
                    max_rel: r,
                    tol: tol_lp,
                    pass: ok,
                    note: p.unwrap_or_default(),
                });
            }
            // One training step with the same random upstream gradients on both sides.
            let ups: Vec<(Vec<f32>, Vec<f32>)> = lc
                .iter()
                .map(|s| {
                    let n = s.logprobs.len();
                    (
                        (0..n).map(|_| self.rng.normal()).collect(),
                        (0..n).map(|_| 0.1 * self.rng.normal()).collect(),
                    )
                })
                .collect();
            let mut loss = |_: &[TokenStats]| -> Result<Vec<TokenGrads>> {
                Ok(ups
                    .iter()
                    .map(|(a, b)| TokenGrads {
                        dlogprobs: a.clone(),
                        dentropy: Some(b.clone()),
                    })
                    .collect())
            };
            cpu.forward_backward(&seqs, 0.8, &mut loss)?;
            gpu.forward_backward(&seqs, 0.8, &mut loss)?;
            let (gc, gg) = (cpu.export_grads()?, gpu.export_grads()?);
            let (name, r) = worst_tensor(&gg, &gc);
            let (a, _, p) = compare(&flat(&gg), &flat(&gc), &[]);
            self.rows.push(Row {
                op: format!("decoder grads, worst tensor [{tag}]"),
                dtype: dname(d),
                max_abs: a,
                max_rel: r,
                tol: tol_g,
                pass: gg.len() == gc.len() && p.is_none() && r <= tol_g,
                note: name,
            });
            // eps large next to the gradients keeps the update linear in g, so the check
            // compares updates (p_new − p_old) without sign flips of near-zero gradients.
            let hp = AdamWParams {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 0.1,
                weight_decay: 0.1,
            };
            let (sc, sg) = (
                cpu.optimizer_step(&hp, Some(0.5))?,
                gpu.optimizer_step(&hp, Some(0.5))?,
            );
            let (wc, wg) = (cpu.export_weights()?, gpu.export_weights()?);
            let delta = |x: &Weights| -> Weights {
                x.iter()
                    .map(|(k, t)| {
                        let mut t = t.clone();
                        t.data.iter_mut().zip(&w[k].data).for_each(|(v, o)| *v -= o);
                        (k.clone(), t)
                    })
                    .collect()
            };
            let (dc, dg) = (delta(&wc), delta(&wg));
            let (name, r) = worst_tensor(&dg, &dc);
            let (a, _, p) = compare(&flat(&dg), &flat(&dc), &[]);
            let norm_rel = ((sg.grad_norm - sc.grad_norm) / sc.grad_norm).abs() as f64;
            self.rows.push(Row {
                op: format!("decoder AdamW update, worst tensor [{tag}]"),
                dtype: dname(d),
                max_abs: a,
                max_rel: r,
                tol: tol_upd,
                pass: p.is_none() && r <= tol_upd && norm_rel <= tol_lp && sg.skipped == sc.skipped,
                note: format!(
                    "{name}; grad norm gpu {} cpu {}",
                    sg.grad_norm, sc.grad_norm
                ),
            });
            // The compute weights were refreshed from the updated masters: each one is the
            // master rounded to the compute dtype, exactly.
            let wc = gpu.export_compute_weights()?;
            let mut bad = None;
            for (name, t) in &wg {
                let same = wc[name]
                    .data
                    .iter()
                    .zip(&t.data)
                    .all(|(c, m)| c.to_bits() == round(*m, d).to_bits());
                if !same && bad.is_none() {
                    bad = Some(name.clone());
                }
            }
            self.flag(
                &format!("decoder compute weights = rounded masters [{tag}]"),
                d,
                bad.is_none() && wc.len() == wg.len(),
                bad.map(|n| format!("{n} differs")).unwrap_or_default(),
            );
        }
        Ok(())
    }
}

impl Suite<'_> {
    /// Whole-model log-probs and entropies of the tiny HF fixture models on the GPU against
    /// the values transformers computed in f32 (`tests/fixtures/make_hf_fixtures.py`): f32
    /// compute within 2e-4 nats (max |Δ|); bf16 compute (weights rounded to bf16 too, so this
    /// is bf16 against an f32 model) within 1e-2 of the largest |value| (about 2.5 bf16 ulps).
    fn hf_fixtures(&mut self, d: DType) -> Result<()> {
        let (tol, relative) = match d {
            DType::F32 => (2e-4, false),
            DType::BF16 => (1e-2, true),
        };
        for model in ["qwen2", "llama", "qwen3"] {
            let dir = self.hf_fixtures.join(model);
            let op = format!("hf fixture {model}: logprobs+entropy vs transformers");
            let text = match std::fs::read_to_string(dir.join("expected.json")) {
                Ok(t) => t,
                Err(e) => {
                    let note = format!("{}: {e} (run from the repo root)", dir.display());
                    self.flag(&op, d, false, note);
                    continue;
                }
            };
            let v: serde_json::Value = serde_json::from_str(&text)?;
            let floats = |x: &serde_json::Value| -> Vec<f32> {
                x.as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|f| f.as_f64())
                            .map(|f| f as f32)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let (cfg, weights) = crate::model::ModelDir::load(&dir)?;
            let gb = CudaBackend::new(self.ordinal)?;
            gb.set_compute_dtype(d);
            let mut dec = Decoder::new(gb, &cfg, &weights)?;
            let (mut worst, mut scale, mut n) = (0f64, 0f64, 0usize);
            for c in v["cases"].as_array().into_iter().flatten() {
                let tokens: Vec<u32> = c["tokens"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect();
                let temp = c["temperature"].as_f64().unwrap_or(1.0) as f32;
                let got = dec.logprobs(
                    &[SeqRef {
                        tokens: &tokens,
                        start: 1,
                    }],
                    temp,
                    true,
                )?;
                let g = &got[0];
                let pairs = [
                    (g.logprobs.clone(), floats(&c["logprobs"])),
                    (g.entropy.clone().unwrap_or_default(), floats(&c["entropy"])),
                ];
                for (mine, theirs) in pairs {
                    if mine.len() != theirs.len() || mine.is_empty() {
                        bail!(
                            "{op}: {} values, transformers has {}",
                            mine.len(),
                            theirs.len()
                        );
                    }
                    for (a, b) in mine.iter().zip(&theirs) {
                        worst = worst.max((a - b).abs() as f64);
                        scale = scale.max(b.abs() as f64);
                        n += 1;
                    }
                }
            }
            let rel = worst / scale.max(f64::MIN_POSITIVE);
            let ok = n > 0 && if relative { rel <= tol } else { worst <= tol };
            self.rows.push(Row {
                op,
                dtype: dname(d),
                max_abs: worst,
                max_rel: rel,
                tol,
                pass: ok,
                note: format!(
                    "{n} values; tol on max {}",
                    if relative { "rel" } else { "abs" }
                ),
            });
        }
        Ok(())
    }
}

#[path = "parity_paged.rs"]
mod paged;

/// A decoder- or engine-level case: it runs on the [`Suite`].
type SuiteCase<'g> = fn(&mut Suite<'g>, DType) -> Result<()>;

/// The decoder- and engine-level cases (and the paged engine's op cases), after the op
/// families' (`ops::op_cases`).
fn suite_cases<'g>() -> [(&'static str, SuiteCase<'g>); 15] {
    [
        ("decoder", Suite::decoder),
        ("hf_fixtures", Suite::hf_fixtures),
        ("attention_paged", Suite::paged_attention),
        ("rope_store_kv", Suite::rope_store_kv),
        ("rope_store_kv_packed", Suite::rope_store_kv_packed),
        ("attention_paged_rope", Suite::attention_paged_rope),
        ("swiglu_packed", Suite::swiglu_packed),
        ("alloc_parts", Suite::alloc_parts),
        ("gemm_invariance", Suite::gemm_invariance),
        ("attention_invariance", Suite::attention_invariance),
        ("sample", Suite::sample),
        ("paged_generate", Suite::paged_generate),
        ("paged_graphs", Suite::paged_graphs),
        ("rollout_agreement", Suite::rollout_agreement),
        ("fused_decode", Suite::fused_decode),
    ]
}

/// `tandem gpu-test`.
pub fn run(a: GpuTestArgs) -> Result<()> {
    if a.compile_only {
        let (ma, mi) = super::nvrtc::version()?;
        println!(
            "NVRTC {ma}.{mi}: compiling every kernel family for {}",
            a.arch
        );
        for (name, bytes) in ops::compile_all(&a.arch)? {
            println!("  {name:<22} {bytes:>8} bytes of cubin");
        }
        return Ok(());
    }
    let gpu = CudaBackend::new(a.device)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let (ma, mi) = gpu.nvrtc_version();
    println!(
        "tandem gpu-test: {} ({}, {}), NVRTC {ma}.{mi}, seed {seed} (replay with --seed {seed})",
        gpu.name(),
        gpu.device_name(),
        gpu.arch()
    );
    let mut suite = Suite {
        ctx: Ctx::new(&gpu, a.device, seed),
        hf_fixtures: a.hf_fixtures.clone(),
    };
    gpu.set_tensor_core_attention(true);
    let t0 = Instant::now();
    let selected = |name: &str| a.only.as_ref().is_none_or(|o| name.contains(o.as_str()));
    let done = |name: &str, d: DType, t: Instant| {
        eprintln!(
            "  {name} ({}) done in {:.2} s",
            dname(d),
            t.elapsed().as_secs_f64()
        )
    };
    for d in DTYPES {
        for case in ops::op_cases().iter().filter(|c| selected(c.name)) {
            let t = Instant::now();
            suite.ctx.run(case, d);
            done(case.name, d, t);
        }
        for (name, case) in suite_cases().into_iter().filter(|c| selected(c.0)) {
            let t = Instant::now();
            if let Err(e) = case(&mut suite, d) {
                suite.flag(name, d, false, format!("error: {e:#}"));
            }
            done(name, d, t);
        }
    }
    let failed = print_table(&suite.rows);
    let st = gpu.memory_stats();
    println!(
        "{} checks, {} failed, {:.1} s; pool: {} MiB held, peak {} MiB in use",
        suite.rows.len(),
        failed,
        t0.elapsed().as_secs_f64(),
        st.held >> 20,
        st.peak_in_use >> 20
    );
    let timing = if a.time && failed == 0 {
        println!();
        timing::run(&gpu, a.iters, a.only.as_deref(), &ops::timing_cases())?
    } else {
        Vec::new()
    };
    if let Some(p) = &a.json {
        let doc = serde_json::json!({
            "device": gpu.device_name(),
            "arch": gpu.arch(),
            "nvrtc": format!("{ma}.{mi}"),
            "seed": seed,
            "rows": suite.rows,
            "timing": timing,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)
            .map_err(|e| anyhow!("cannot write {}: {e}", p.display()))?;
    }
    if suite.rows.is_empty() {
        bail!("no parity check matched --only");
    }
    if failed > 0 {
        bail!("{failed} of {} parity checks failed", suite.rows.len());
    }
    Ok(())
}

/// The 2-layer model of the decoder-level checks (vocabulary 1000, hidden 256, 4/2 heads of 64),
/// with the architecture's own options.
pub(super) fn tiny_config(arch: Arch) -> Config {
    Config {
        arch,
        vocab_size: 1000,
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: arch != Arch::Llama,
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: 4096,
        bos_token_id: None,
        eos_token_ids: vec![0],
    }
}
