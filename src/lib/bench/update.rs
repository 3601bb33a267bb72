//! `tandem bench update`: the issue-6 training workload through the real `update` loop
//! (`engine::train::train`): a Qwen2.5-0.5B-shaped model with random weights, 640-token
//! sequences (128 prompt + 512 response), micro-batches of 8, 8 micro-batches per optimizer
//! step, PPO-clip (on-policy, token-mean), AdamW with grad clipping at 1.0. Warm-up steps, then
//! timed steps; tokens/s, MFU (6·params·tokens/s, 4·params·tokens/s with `--lora-rank`, over a
//! bf16 GEMM peak measured in the same process: cuBLASLt 8192³), peak memory (the pool's and
//! the device's) and the step's split.
//! `--shape tiny` (and the size flags) run it on the CPU in seconds, for CI.

use super::gpu_clock::ClockSampler;
use crate::algo::policy_loss::{LossConfig, LossMode};
use crate::backend::{Backend, DType, MatmulShape};
use crate::engine::logprob::PromptResponse;
use crate::engine::shard::{ShardedOptim, ShardedPolicy, DEFAULT_BUCKET_ELEMS};
use crate::engine::train::{train, LrConfig, TrainConfig, TrainData};
use crate::model::decoder::Decoder;
use crate::model::init::random_weights;
use crate::model::lora::{init_adapters, LoraSpec};
use crate::model::names::param_count;
use crate::model::Config;
use crate::parallel::{run_rank_job, Comm, DeviceKind, Options, ProcessGroup, RankJob, World};
use crate::rng::SplitMix64;
use crate::stage::common::{Device, LoraFlags};
use crate::stage::{on_device, Job};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

/// The workload flags `bench update` and `bench logprob` share.
#[derive(Args, Clone, Debug)]
pub(crate) struct Workload {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub(crate) device: Device,
    /// Model shape: qwen0.5b (the issue-6 shape), qwen1.5b, qwen7b, qwen14b, or tiny (2 layers,
    /// hidden 64, vocab 512).
    #[arg(long, default_value = "qwen0.5b")]
    pub(crate) shape: String,
    /// Tokens per sequence (prompt + response).
    #[arg(long, default_value_t = 640)]
    pub(crate) seq_len: usize,
    /// Prompt tokens per sequence (not scored).
    #[arg(long, default_value_t = 128)]
    pub(crate) prompt_len: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub(crate) micro_batch: usize,
    /// Micro-batches per optimizer step (bench logprob: per pass).
    #[arg(long, default_value_t = 8)]
    pub(crate) micro_batches: usize,
    /// Untimed steps first (kernel compiles, GEMM plans, pool growth).
    #[arg(long, default_value_t = 1)]
    pub(crate) warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 3)]
    pub(crate) steps: usize,
    /// Rows per LM-head chunk (default: the backend's choice).
    #[arg(long)]
    pub(crate) logprob_chunk: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Also write the JSON result here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct UpdateArgs {
    #[command(flatten)]
    pub(crate) w: Workload,
    // Train LoRA adapters on the frozen model (`update --lora-rank`); one process only.
    #[command(flatten)]
    pub(crate) lora: LoraFlags,
}

/// The benchmark model shapes.
pub fn shape(name: &str) -> Result<Config> {
    match name {
        "tiny" => {
            let mut c = super::cpu_engine::shape("small")?;
            c.num_layers = 2;
            c.hidden_size = 64;
            c.num_heads = 4;
            c.num_kv_heads = 2;
            c.head_dim = 16;
            c.intermediate_size = 128;
            c.vocab_size = 512;
            Ok(c)
        }
        // `small` is the CPU engine bench's shape, not one of these.
        other => super::cpu_engine::shape(other)
            .ok()
            .filter(|_| other != "small")
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown bench shape '{other}' (expected tiny, qwen0.5b, qwen1.5b, qwen7b or \
                     qwen14b)"
                )
            }),
    }
}

impl Workload {
    pub(crate) fn check(&self) -> Result<()> {
        if self.prompt_len == 0 || self.prompt_len >= self.seq_len {
            bail!(
                "--prompt-len must be in 1..{} (--seq-len), got {}",
                self.seq_len,
                self.prompt_len
            );
        }
        if self.micro_batch == 0 || self.micro_batches == 0 || self.steps == 0 {
            bail!("--micro-batch, --micro-batches and --steps must be at least 1");
        }
        Ok(())
    }

    pub(crate) fn sequences(&self) -> usize {
        self.micro_batch * self.micro_batches
    }

    pub(crate) fn tokens_per_step(&self) -> usize {
        self.sequences() * self.seq_len
    }
}

/// Random prompts and responses (uniform token ids), one advantage per sequence (standard
/// normal, as GRPO gives one per response), all response tokens valid.
pub(crate) struct Synth {
    pub(crate) prompts: Vec<Vec<u32>>,
    pub(crate) responses: Vec<Vec<u32>>,
    pub(crate) masks: Vec<Vec<u8>>,
    pub(crate) adv: Vec<Vec<f32>>,
}

impl Synth {
    pub(crate) fn new(w: &Workload, vocab: usize) -> Synth {
        let mut rng = SplitMix64(w.seed ^ 0x5eed_ba7c);
        let resp = w.seq_len - w.prompt_len;
        let mut ids =
            |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(vocab as u64) as u32).collect() };
        let n = w.sequences();
        let prompts: Vec<Vec<u32>> = (0..n).map(|_| ids(w.prompt_len)).collect();
        let responses: Vec<Vec<u32>> = (0..n).map(|_| ids(resp)).collect();
        let mut rng = SplitMix64(w.seed ^ 0xadd);
        Synth {
            prompts,
            responses,
            masks: vec![vec![1; resp]; n],
            adv: (0..n).map(|_| vec![rng.normal(); resp]).collect(),
        }
    }

    pub(crate) fn rows(&self) -> Vec<PromptResponse<'_>> {
        self.prompts
            .iter()
            .zip(&self.responses)
            .map(|(p, r)| PromptResponse {
                prompt: p,
                response: r,
            })
            .collect()
    }
}

/// Memory and the MFU denominator, measured the same way by both benchmarks.
pub(crate) struct Meter {
    /// Device bytes in use before the model was loaded (context, other processes).
    pub(crate) device_base: Option<usize>,
    pub(crate) device_peak: Option<usize>,
    /// Measured bf16 GEMM FLOP/s (GPU only).
    pub(crate) peak_flops: Option<f64>,
}

impl Meter {
    pub(crate) fn new<B: Backend>(b: &B, gpu: bool) -> Result<Meter> {
        let used = b.device_memory()?.map(|(free, total)| total - free);
        let peak_flops = if gpu { Some(gemm_peak(b)?) } else { None };
        Ok(Meter {
            device_base: used,
            device_peak: used,
            peak_flops,
        })
    }

    /// Samples the device's used memory (the pool keeps what it took, so a sample after a
    /// step sees the step's peak holding).
    pub(crate) fn sample<B: Backend>(&mut self, b: &B) {
        if let Ok(Some((free, total))) = b.device_memory() {
            let used = total - free;
            self.device_peak = Some(self.device_peak.map_or(used, |p| p.max(used)));
        }
    }

    pub(crate) fn json<B: Backend>(&self, b: &B) -> Value {
        let m = b.memory_stats();
        let gib = |x: usize| x as f64 / (1u64 << 30) as f64;
        json!({
            "pool_peak_in_use_gib": gib(m.peak_in_use),
            "pool_held_gib": gib(m.held),
            "device_peak_used_gib": self.device_peak.map(gib),
            "device_used_before_model_gib": self.device_base.map(gib),
            "gemm_peak_tflops": self.peak_flops.map(|f| f / 1e12),
        })
    }
}

/// bf16 GEMM FLOP/s of an 8192³ product through the backend's matmul (cuBLASLt on the GPU):
/// median of 10 after 3 warm-up runs, each timed to a synchronize.
pub(crate) fn gemm_peak<B: Backend>(b: &B) -> Result<f64> {
    let n = 8192;
    let mut rng = SplitMix64(7);
    let host: Vec<f32> = (0..n * n).map(|_| rng.normal()).collect();
    let mut x = b.alloc_as(n * n, DType::BF16)?;
    let mut w = b.alloc_as(n * n, DType::BF16)?;
    b.upload(&mut x, &host)?;
    b.upload(&mut w, &host)?;
    drop(host);
    let mut y = b.alloc_as(n * n, DType::BF16)?;
    let mut times = Vec::new();
    for i in 0..13 {
        b.synchronize()?;
        let t = Instant::now();
        b.matmul(&mut y, &x, &w, None, MatmulShape { m: n, k: n, n }, false)?;
        b.synchronize()?;
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / times[times.len() / 2])
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        f64::NAN
    } else {
        s[s.len() / 2]
    }
}

/// Builds the random-weight decoder of the workload's shape on `b` (with `lora`, fresh
/// adapters on the frozen random base).
pub(crate) fn build<B: Backend>(
    b: B,
    w: &Workload,
    lora: Option<&LoraSpec>,
) -> Result<(Decoder<B>, Config)> {
    w.check()?;
    let cfg = shape(&w.shape)?;
    let weights = random_weights(&cfg, w.seed, 0.02);
    let mut dec = match lora {
        Some(spec) => {
            let adapters = init_adapters(&cfg, spec, w.seed);
            Decoder::with_lora(b, &cfg, &weights, &adapters, spec)?
        }
        None => Decoder::new(b, &cfg, &weights)?,
    };
    if let Some(c) = w.logprob_chunk {
        dec.logprob_chunk = c.max(1);
    }
    Ok((dec, cfg))
}

struct UpdateJob(Workload, Option<LoraSpec>);

impl Job for UpdateJob {
    type Out = (Vec<Vec<String>>, Value);

    fn run<B: Backend>(self, b: B) -> Result<Self::Out> {
        bench_update(self.0, b, None, self.1)
    }
}

/// One rank of `bench update` under a launcher: the data-parallel trainer of `update`.
struct UpdateRankJob(Workload);

impl RankJob for UpdateRankJob {
    type Out = (Vec<Vec<String>>, Value);

    fn run<B: Backend>(self, b: B, comm: Box<dyn Comm<B>>) -> Result<Self::Out> {
        bench_update(self.0, b, Some(comm.as_ref()), None)
    }
}

/// The timed loop; with `comm`, each rank trains on its share of a batch of `world` times the
/// workload's sequences (so each GPU does the 1-GPU work) with the sharded optimizer.
fn bench_update<B: Backend>(
    w: Workload,
    b: B,
    comm: Option<&dyn Comm<B>>,
    lora: Option<LoraSpec>,
) -> Result<(Vec<Vec<String>>, Value)> {
    let gpu = matches!(w.device, Device::Cuda(_));
    let world = comm.map_or(1, |c| c.world_size());
    let mut meter = Meter::new(&b, gpu)?;
    let (mut dec, cfg) = build(b, &w, lora.as_ref())?;
    let params = param_count(&cfg);
    let global = Workload {
        micro_batches: w.micro_batches * world,
        ..w.clone()
    };
    let synth = Synth::new(&global, cfg.vocab_size);
    let mut optim = match comm {
        Some(c) => Some(ShardedOptim::zero2(&mut dec, c, DEFAULT_BUCKET_ELEMS)?),
        None => None,
    };
    let data = TrainData {
        rows: synth.rows(),
        mask: synth.masks.iter().map(Vec::as_slice).collect(),
        advantages: Some(synth.adv.iter().map(Vec::as_slice).collect()),
        old: None,
        ref_lp: None,
        rollout: None,
        returns: None,
    };
    let tc = TrainConfig {
        lora: lora.clone(),
        ..train_config(&w)
    };
    let mut times = Times::default();
    let rank0 = comm.is_none_or(|c| c.rank() == 0);
    let mut log = |m: &str| {
        if rank0 {
            eprintln!("{m}")
        }
    };
    let (clocks, mut timed_from) = (ClockSampler::on(w.device), None);
    for i in 0..w.warmup + w.steps {
        let t = Instant::now();
        let timed = i >= w.warmup;
        timed_from = timed_from.or(timed.then_some(t));
        let report = match (comm, optim.take()) {
            (Some(comm), Some(o)) => {
                let before = o.stats.clone();
                let mut p = ShardedPolicy {
                    decoder: &mut dec,
                    comm,
                    optim: o,
                };
                let r = train(&mut p, &data, &tc, i as u64, &mut log)?;
                let after = &p.optim.stats;
                if timed {
                    times.sync_s.push(after.sync_seconds - before.sync_seconds);
                    times.sync_bytes = after.sync_bytes - before.sync_bytes;
                    times
                        .rs_s
                        .push(after.reduce_scatter_seconds - before.reduce_scatter_seconds);
                    times.overlapped = after.overlapped_buckets - before.overlapped_buckets;
                }
                optim = Some(p.optim);
                r
            }
            _ => train(&mut dec, &data, &tc, i as u64, &mut log)?,
        };
        dec.backend().synchronize()?;
        let secs = t.elapsed().as_secs_f64();
        meter.sample(dec.backend());
        let s = &report.steps[0];
        if report.steps.len() != 1 || report.tokens != global.tokens_per_step() || s.skipped {
            bail!(
                    "bench update: expected one optimizer step over {} tokens, got {} steps over {} (skipped: {})",
                    global.tokens_per_step(),
                    report.steps.len(),
                    report.tokens,
                    s.skipped
                );
        }
        log(&format!(
                "step {i}{}: {secs:.3} s (queue micro-batches {:.3} s, wait {:.3} s, optimizer {:.3} s), loss {:.6}, grad norm {:.4}",
                if timed { "" } else { " (warm-up)" },
                s.micro_seconds,
                s.wait_seconds,
                s.optimizer_seconds,
                s.loss,
                s.grad_norm
            ));
        if timed {
            times.step_s.push(secs);
            times.micro_s.push(s.micro_seconds);
            times.wait_s.push(s.wait_seconds);
            times.opt_s.push(s.optimizer_seconds);
            times.device_loss = s.device_loss;
            times.last = report.to_json();
        }
    }
    let sharded = comm.is_some();
    let (rows, mut out) = times.summary(&w, world, params, &meter, &dec, sharded);
    // The GPU's clock and power over the timed steps (a GEMM-bound step may run at the power cap).
    let clock = clocks
        .zip(timed_from)
        .and_then(|(c, t0)| c.summary(t0, Instant::now()));
    if let Some(c) = &clock {
        log(&format!("gpu clocks over the timed steps: SM {:.0} MHz (median), {:.0} W mean, {:.0}% of samples at the power cap", c.sm_mhz_median, c.power_w_mean, 100.0 * c.power_capped_fraction));
    }
    out["gpu_clocks"] = serde_json::json!(clock);
    if let Some(spec) = &lora {
        out["lora"] = lora_json(spec, &cfg);
    }
    Ok((rows, out))
}

/// A LoRA run's record: the spec and the trained parameters.
fn lora_json(spec: &LoraSpec, cfg: &Config) -> Value {
    let trained: usize = spec
        .adapters(cfg)
        .iter()
        .map(|s| s.a.1.iter().product::<usize>() + s.b.1.iter().product::<usize>())
        .sum();
    json!({
        "rank": spec.rank,
        "alpha": spec.alpha,
        "targets": spec.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
        "trained_params": trained,
    })
}

/// The update of the bench: vanilla PPO-clip, one optimizer step of the whole batch, AdamW.
fn train_config(w: &Workload) -> TrainConfig {
    TrainConfig {
        loss: LossConfig::new(LossMode::Vanilla),
        loss_scale_factor: None,
        ppo_epochs: 1,
        mini_batch_size: None,
        micro_batch_tokens: w.micro_batch * w.seq_len,
        temperature: 1.0,
        lr: LrConfig::constant(1e-6),
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: Some(1.0),
        shuffle: false,
        seed: w.seed,
        device_loss: TrainConfig::device_loss_from_env(),
        critic: None,
        lora: None,
    }
}

/// What the timed steps measured: seconds per step and per part, and with the sharded
/// optimizer its weight sync and reduce-scatter.
#[derive(Default)]
struct Times {
    step_s: Vec<f64>,
    micro_s: Vec<f64>,
    wait_s: Vec<f64>,
    opt_s: Vec<f64>,
    device_loss: bool,
    last: Value,
    sync_s: Vec<f64>,
    sync_bytes: u64,
    rs_s: Vec<f64>,
    overlapped: u64,
}

impl Times {
    /// The table's row and the JSON record; `sharded` adds the data-parallel numbers.
    fn summary<B: Backend>(
        self,
        w: &Workload,
        world: usize,
        params: usize,
        meter: &Meter,
        dec: &Decoder<B>,
        sharded: bool,
    ) -> (Vec<Vec<String>>, Value) {
        // Per GPU: each rank's share of the batch is the 1-GPU workload.
        let tokens = w.tokens_per_step();
        let step = median(&self.step_s);
        let tps = tokens as f64 / step;
        // FLOPs a token: 6·params in full training; 4·params under LoRA (the frozen weights'
        // gradient GEMMs are skipped; the adapters' are negligible).
        let flops = if dec.lora_spec().is_some() { 4.0 } else { 6.0 } * params as f64;
        let mfu = meter.peak_flops.map(|p| flops * tps / p);
        let mem = meter.json(dec.backend());
        let rows = vec![row(
            "update",
            w,
            tps,
            mfu,
            step,
            [
                median(&self.micro_s),
                median(&self.wait_s),
                median(&self.opt_s),
            ]
            .map(Some),
            &mem,
        )];
        let mut out = json!({
            "bench": "update",
            "device": w.device.to_string(),
            "world_size": world,
            "shape": w.shape,
            "params": params,
            "seq_len": w.seq_len,
            "prompt_len": w.prompt_len,
            "micro_batch": w.micro_batch,
            "micro_batches": w.micro_batches,
            "tokens_per_step": tokens,
            "warmup_steps": w.warmup,
            "timed_steps": w.steps,
            "logprob_chunk": dec.logprob_chunk,
            "device_loss": self.device_loss,
            "step_s": self.step_s,
            "micro_batches_s": self.micro_s,
            "wait_s": self.wait_s,
            "optimizer_s": self.opt_s,
            "step_median_s": step,
            "tokens_per_s": tps,
            "mfu": mfu,
            "memory": mem,
            "last_step_metrics": self.last,
        });
        if sharded {
            let sync = median(&self.sync_s);
            let sync_bytes = self.sync_bytes;
            out["data_parallel"] = json!({
                "tokens_per_s_per_gpu": tps,
                "tokens_per_s_all_gpus": tps * world as f64,
                "weight_sync_ms": 1e3 * sync,
                "weight_sync_bytes": sync_bytes,
                "weight_sync_gb_per_s": if sync > 0.0 { sync_bytes as f64 / sync / 1e9 } else { 0.0 },
                // Outside its overlap with the backward (see ShardStats::reduce_scatter_seconds).
                "reduce_scatter_ms": 1e3 * median(&self.rs_s),
                // The step's last backward starts the buckets' reduce-scatters (this rank's, in
                // the last timed step).
                "reduce_scatter_overlapped": self.overlapped > 0,
                "overlapped_buckets": self.overlapped,
                "bucket_elems": DEFAULT_BUCKET_ELEMS,
            });
        }
        (rows, out)
    }
}

/// The table's columns (shared with `bench logprob`).
/// One row of the table under [`HEADER`]: tokens/s, MFU, the step (or pass) median and its
/// split where the bench has one, the memory peaks of [`Meter::json`].
pub(crate) fn row(
    bench: &str,
    w: &Workload,
    tps: f64,
    mfu: Option<f64>,
    secs: f64,
    split: [Option<f64>; 3],
    mem: &Value,
) -> Vec<String> {
    let gib = |k: &str| {
        mem[k]
            .as_f64()
            .map_or("-".to_string(), |v| format!("{v:.2}"))
    };
    let mut r = vec![
        bench.to_string(),
        w.device.to_string(),
        format!("{:.1}k", tps / 1e3),
        mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
        format!("{secs:.3}"),
    ];
    r.extend(split.map(|s| s.map_or("-".into(), |s| format!("{s:.3}"))));
    r.push(gib("pool_peak_in_use_gib"));
    r.push(gib("device_peak_used_gib"));
    r
}

pub(crate) const HEADER: [&str; 10] = [
    "bench",
    "device",
    "tok/s",
    "MFU",
    "step s",
    "queue s",
    "wait s",
    "optim s",
    "pool GiB",
    "device GiB",
];

pub(crate) fn finish(
    title: &str,
    rows: Vec<Vec<String>>,
    out: Value,
    json_path: Option<&PathBuf>,
) -> Result<()> {
    super::report(title, &HEADER, &rows, &out);
    if let Some(p) = json_path {
        std::fs::write(p, serde_json::to_string_pretty(&out)? + "\n")
            .map_err(|e| anyhow::anyhow!("{}: cannot write: {e}", p.display()))?;
    }
    Ok(())
}

pub fn run(a: UpdateArgs) -> Result<()> {
    let lora = a.lora.spec()?;
    let w = a.w;
    w.check()?;
    let title = format!(
        "bench update: {} on {}, {} × {} tokens ({} prompt) per micro-batch, {} micro-batches per step, {} warm-up + {} timed steps",
        w.shape, w.device, w.micro_batch, w.seq_len, w.prompt_len, w.micro_batches, w.warmup, w.steps
    );
    let json_path = w.json.clone();
    let world = World::from_env()?;
    if !world.launched() {
        let title = match &lora {
            Some(l) => format!("{title}, LoRA rank {} on {}", l.rank, a.lora.lora_targets),
            None => title,
        };
        let (rows, out) = on_device(w.device, UpdateJob(w, lora))?;
        return finish(&title, rows, out, json_path.as_ref());
    }
    if lora.is_some() {
        bail!("bench update --lora-rank: runs in one process (not under tandem launch)");
    }
    // Under a launcher: every rank trains its share; rank 0 reports (tokens/s per GPU).
    let pg = ProcessGroup::new(world, Options::from_env()?)?;
    let device = match w.device {
        Device::Cpu => DeviceKind::Cpu,
        Device::Cuda(_) => DeviceKind::Cuda,
    };
    let title = format!("{title}, {} ranks (tokens/s per GPU)", pg.world_size());
    let (rows, out) = run_rank_job(device, &pg, UpdateRankJob(w))?;
    let rank = pg.rank();
    pg.finish()?;
    match rank {
        0 => finish(&title, rows, out, json_path.as_ref()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(json: PathBuf) -> Workload {
        Workload {
            device: Device::Cpu,
            shape: "tiny".into(),
            seq_len: 24,
            prompt_len: 8,
            micro_batch: 2,
            micro_batches: 2,
            warmup: 1,
            steps: 2,
            logprob_chunk: Some(7),
            seed: 3,
            json: Some(json),
        }
    }

    #[test]
    fn update_bench_runs_end_to_end_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.json");
        run(UpdateArgs {
            w: tiny(path.clone()),
            lora: LoraFlags {
                lora_rank: 0,
                lora_alpha: 16.0,
                lora_targets: "all-linear".into(),
            },
        })
        .unwrap();
        let j: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(j["bench"], "update");
        assert_eq!(j["tokens_per_step"], 2 * 2 * 24);
        assert_eq!(j["step_s"].as_array().unwrap().len(), 2);
        assert_eq!(
            j["device_loss"], true,
            "the decoder takes the device-loss path"
        );
        let tps = j["tokens_per_s"].as_f64().unwrap();
        let step = j["step_median_s"].as_f64().unwrap();
        assert!(
            (tps * step - 96.0).abs() < 1e-6,
            "tokens/s = tokens / median step"
        );
        // No GEMM peak on the CPU, so no MFU; the step's metrics are real numbers.
        assert!(j["mfu"].is_null() && j["memory"]["gemm_peak_tflops"].is_null());
        assert!(j["last_step_metrics"]["grad_norm"].as_f64().unwrap() > 0.0);
        assert_eq!(
            j["last_step_metrics"]["pg_clipfrac"], 0.0,
            "on-policy: ratio 1"
        );
    }

    #[test]
    fn a_lora_update_bench_trains_the_adapters_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.json");
        run(UpdateArgs {
            w: tiny(path.clone()),
            lora: LoraFlags {
                lora_rank: 4,
                lora_alpha: 8.0,
                lora_targets: "q,v,down".into(),
            },
        })
        .unwrap();
        let j: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        // tiny: 2 layers, hidden 64, 4 heads and 2 kv heads of 16, ffn 128; r = 4:
        // q 4·(64 + 64), v 4·(64 + 32), down 4·(128 + 64), per layer.
        let per_layer = 4 * (64 + 64) + 4 * (64 + 32) + 4 * (128 + 64);
        assert_eq!(j["lora"]["trained_params"], 2 * per_layer);
        assert_eq!(
            j["lora"]["targets"],
            json!(["q_proj", "v_proj", "down_proj"])
        );
        assert_eq!(j["step_s"].as_array().unwrap().len(), 2);
        // B starts at zero, so only the B matrices have a gradient at first: still not 0.
        assert!(j["last_step_metrics"]["grad_norm"].as_f64().unwrap() > 0.0);
        let bad = UpdateArgs {
            w: tiny(path),
            lora: LoraFlags {
                lora_rank: 4,
                lora_alpha: 8.0,
                lora_targets: "q,mlp".into(),
            },
        };
        let e = format!("{:#}", run(bad).unwrap_err());
        assert!(e.contains("--lora-targets: unknown target 'mlp'"), "{e}");
    }

    #[test]
    fn logprob_bench_runs_end_to_end_on_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.json");
        super::super::logprob::run(super::super::logprob::LogprobArgs {
            w: tiny(path.clone()),
            entropy: true,
        })
        .unwrap();
        let j: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(j["bench"], "logprob");
        assert_eq!(j["pass_s"].as_array().unwrap().len(), 2);
        // Random weights of std 0.02 over 512 tokens: log-probs near −ln 512.
        let m = j["mean_logprob"].as_f64().unwrap();
        assert!((m + (512f64).ln()).abs() < 0.5, "{m}");
    }

    #[test]
    fn bad_workloads_are_refused() {
        let mut w = tiny(PathBuf::from("unused"));
        w.prompt_len = 24;
        assert!(w.check().unwrap_err().to_string().contains("--prompt-len"));
        assert!(shape("huge").is_err());
    }
}
