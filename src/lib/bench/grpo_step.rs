//! `tandem bench grpo-step`: whole GRPO steps (rollout, reference and old log-probs, update in
//! mini-batches, sync; the workload of bench/peer_grpo_step.py) of a model on a prompt file, with the stages in-process (each loads the model) and on
//! the daemon's resident models (the hybrid engine, without the socket), printing seconds per
//! stage and, for the daemon, each phase's peak device memory. Advantages are ±1 by row (the
//! reward does not change the cost of a step).

use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::batch::{list_array, Batch, NewColumns, StageInfo};
use crate::daemon::resident::{Options, Resident};
use crate::stage::common::Device;
use crate::stage::{ref_logprob, rollout, sync_weights, update, Exec, InProcess};
use anyhow::{Context, Result};
use clap::{Args, Parser};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub(crate) struct GrpoStepArgs {
    /// The policy (and reference) model directory.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Prompt dataset (verl parquet).
    #[arg(long)]
    pub(crate) prompts: PathBuf,
    /// Scratch directory for batches and checkpoints (made if missing).
    #[arg(long)]
    pub(crate) work: PathBuf,
    #[arg(long, default_value = "cpu")]
    pub(crate) device: Device,
    #[arg(long, default_value_t = 64)]
    pub(crate) prompts_per_step: usize,
    #[arg(long, default_value_t = 8)]
    pub(crate) n: usize,
    #[arg(long, default_value_t = 512)]
    pub(crate) max_new_tokens: usize,
    /// Optimizer steps per update (mini-batches).
    #[arg(long, default_value_t = 4)]
    pub(crate) mini_batches: usize,
    /// Steps per mode (the first includes loading; the table reports each).
    #[arg(long, default_value_t = 2)]
    pub(crate) steps: u64,
    /// Feed the prompt text as is (no chat template).
    #[arg(long)]
    pub(crate) raw_prompt: bool,
    /// Which modes to run.
    #[arg(long, value_delimiter = ',', default_values_t = ["in-process".to_string(), "daemon".to_string()])]
    pub(crate) modes: Vec<String>,
    /// Daemon with --offload-optimizer and --offload-ref.
    #[arg(long)]
    pub(crate) offload: bool,
    /// In daemon mode, write the checkpoint (weights and optimizer state) only every this many
    /// steps, as a pipeline with a daemon does on its `[checkpoint] every` cadence (0: never
    /// within the bench); the other updates keep the policy resident (`update --resident`),
    /// except the last, which writes the weights (not the optimizer state) to compare modes.
    /// In-process steps always write everything: the next process needs it.
    #[arg(long, default_value_t = 0)]
    pub(crate) checkpoint_every: u64,
}

/// Parses a stage's flags as its binary would.
fn parse<A: clap::Args>(argv: &[String]) -> Result<A> {
    #[derive(Parser)]
    struct Cli<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    let cli =
        Cli::<A>::try_parse_from(std::iter::once("stage".to_string()).chain(argv.iter().cloned()))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(cli.args)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// ±1 advantages on every response token, alternating by row.
fn add_advantages(input: &Path, out: &Path) -> Result<()> {
    let b = Batch::read(input, &[crate::batch::schema::RESPONSE_IDS])?;
    let resp = b.ragged_i32(crate::batch::schema::RESPONSE_IDS)?;
    let mut vals = Vec::new();
    for (i, r) in resp.rows().enumerate() {
        let a = if i % 2 == 0 { 1.0f32 } else { -1.0 };
        vals.extend(std::iter::repeat_n(a, r.len()));
    }
    let mut cols = NewColumns::new();
    cols.add(
        crate::batch::schema::ADVANTAGES,
        list_array::<arrow_array::types::Float32Type>(&resp.offsets, vals),
    );
    b.write_derived(
        out,
        cols,
        &StageInfo {
            stage: "bench-advantage",
            params: json!({}),
            policy_version: None,
            step: None,
        },
    )
}

/// Where the bench's jobs run, with the daemon's per-job bookkeeping (none in-process).
trait Phases {
    fn exec(&mut self) -> &mut dyn Exec;
    fn begin(&mut self, _phase: &'static str) {}
    fn end(&mut self, _phase: &'static str, _ok: bool) -> Value {
        Value::Null
    }
}

impl Phases for InProcess {
    fn exec(&mut self) -> &mut dyn Exec {
        self
    }
}

impl<B: Backend> Phases for Resident<B> {
    fn exec(&mut self) -> &mut dyn Exec {
        self
    }
    fn begin(&mut self, phase: &'static str) {
        Resident::begin(self, phase, None)
    }
    fn end(&mut self, phase: &'static str, ok: bool) -> Value {
        Resident::end(self, phase, ok)
    }
}

fn steps(a: &GrpoStepArgs, dir: &Path, t: &mut dyn Phases, mode: &str) -> Result<Vec<Value>> {
    std::fs::create_dir_all(dir)?;
    let b = Steps {
        a,
        dir,
        policy: dir.join("policy"),
        mode,
        dev: a.device.to_string(),
    };
    let args0 = b.sync_args(&a.model, 0)?;
    b.timed(t, "sync-weights", &mut |e| {
        sync_weights::run(args0.clone(), e)
    })?;
    (1..=a.steps).map(|step| b.step(t, step)).collect()
}

/// One mode's steps: the flags, its scratch directory and the policy it trains.
struct Steps<'a> {
    a: &'a GrpoStepArgs,
    dir: &'a Path,
    policy: PathBuf,
    mode: &'a str,
    dev: String,
}

impl Steps<'_> {
    /// Runs one job as phase `name`: its seconds and the daemon's bookkeeping of it.
    fn timed(
        &self,
        t: &mut dyn Phases,
        name: &'static str,
        f: &mut dyn FnMut(&mut dyn Exec) -> Result<()>,
    ) -> Result<(f64, Value)> {
        t.begin(name);
        let t0 = Instant::now();
        let r = f(t.exec());
        let secs = t0.elapsed().as_secs_f64();
        let m = t.end(name, r.is_ok());
        r.with_context(|| format!("{}: {name}", self.mode))?;
        Ok((secs, m))
    }

    fn sync_args(&self, from: &Path, v: u64) -> Result<sync_weights::SyncWeightsArgs> {
        parse(&[
            "--from".into(),
            s(from),
            "--to".into(),
            s(&self.policy),
            "--policy-version".into(),
            v.to_string(),
        ])
    }

    /// The batch file `NAME-STEP.parquet`.
    fn file(&self, name: &str, step: u64) -> String {
        s(&self.dir.join(format!("{name}-{step}.parquet")))
    }

    fn rollout_args(&self, step: u64) -> Result<rollout::RolloutArgs> {
        let a = self.a;
        let mut ro = vec![
            "--model".into(),
            s(&self.policy),
            "--in".into(),
            s(&a.prompts),
            "--out".into(),
            self.file("rollout", step),
            "--n".into(),
            a.n.to_string(),
            "--limit".into(),
            a.prompts_per_step.to_string(),
            "--max-new-tokens".into(),
            a.max_new_tokens.to_string(),
            "--seed".into(),
            step.to_string(),
            "--batch-size".into(),
            (a.prompts_per_step * a.n).to_string(),
            "--device".into(),
            self.dev.clone(),
        ];
        if a.raw_prompt {
            ro.push("--raw-prompt".into());
        }
        parse(&ro)
    }

    /// `ref-logprob` of `model` on `input`, adding `column` into `out`.
    fn logprob_args(
        &self,
        model: &Path,
        input: String,
        out: String,
        column: &str,
    ) -> Result<ref_logprob::RefLogprobArgs> {
        parse(&[
            "--model".into(),
            s(model),
            "--in".into(),
            input,
            "--out".into(),
            out,
            "--column".into(),
            column.into(),
            "--device".into(),
            self.dev.clone(),
        ])
    }

    fn update_args(&self, step: u64, ckpt: &Path) -> Result<update::UpdateArgs> {
        let rows = self.a.prompts_per_step * self.a.n;
        parse(&[
            "--model".into(),
            s(&self.policy),
            "--in".into(),
            self.file("adv", step),
            "--out-model".into(),
            s(ckpt),
            "--use-kl-loss".into(),
            "--lr".into(),
            "1e-6".into(),
            "--mini-batch-size".into(),
            rows.div_ceil(self.a.mini_batches.max(1)).to_string(),
            "--device".into(),
            self.dev.clone(),
        ])
    }

    /// One GRPO step: its seconds per stage and the daemon's bookkeeping, as a JSON record.
    fn step(&self, t: &mut dyn Phases, step: u64) -> Result<Value> {
        let (a, mode) = (self.a, self.mode);
        let f = |n: &str| self.file(n, step);
        let ro = self.rollout_args(step)?;
        let (t_roll, m_roll) = self.timed(t, "rollout", &mut |e| rollout::run(ro.clone(), e))?;
        let rl = self.logprob_args(&a.model, f("rollout"), f("ref"), "ref_logprobs")?;
        let (t_ref, m_ref) =
            self.timed(t, "ref-logprob", &mut |e| ref_logprob::run(rl.clone(), e))?;
        // Old log-probs of the policy (the update then runs its mini-batches off-policy
        // against them, as verl and the PyTorch peer do).
        let ol = self.logprob_args(&self.policy, f("ref"), f("old"), "old_logprobs")?;
        let (t_old, m_old) =
            self.timed(t, "ref-logprob", &mut |e| ref_logprob::run(ol.clone(), e))?;
        add_advantages(Path::new(&f("old")), Path::new(&f("adv")))?;
        let ckpt = self.dir.join(format!("ckpt-{step}"));
        let cadence = a.checkpoint_every > 0 && step.is_multiple_of(a.checkpoint_every);
        let save_optimizer = mode != "daemon" || cadence;
        let resident = mode == "daemon" && !cadence && step != a.steps;
        let mut up = self.update_args(step, &ckpt)?;
        up.skip_optimizer_state = !save_optimizer;
        up.resident = resident;
        let (t_up, m_up) = self.timed(t, "update", &mut |e| update::run(up.clone(), e))?;
        let sy = self.sync_args(&ckpt, step)?;
        let (t_sync, m_sync) =
            self.timed(t, "sync-weights", &mut |e| sync_weights::run(sy.clone(), e))?;
        let tokens: usize = Batch::read(Path::new(&f("rollout")), &[])?
            .ragged_i32(crate::batch::schema::RESPONSE_IDS)?
            .offsets
            .last()
            .copied()
            .unwrap_or(0);
        Ok(json!({
            "mode": mode,
            "step": step,
            "response_tokens": tokens,
            "optimizer_saved": save_optimizer && !resident,
            "weights_saved": !resident,
            "seconds": {"rollout": t_roll, "ref_logprob": t_ref, "old_logprob": t_old,
                        "update": t_up, "sync": t_sync,
                        "step": t_roll + t_ref + t_old + t_up + t_sync},
            "daemon": {"rollout": m_roll, "ref_logprob": m_ref, "old_logprob": m_old,
                       "update": m_up, "sync": m_sync},
        }))
    }
}

pub fn run(a: GrpoStepArgs) -> Result<()> {
    let mut results = Vec::new();
    for mode in &a.modes {
        match mode.as_str() {
            "in-process" => {
                let mut exec = InProcess::new(a.device);
                results.extend(steps(
                    &a,
                    &a.work.join("in-process"),
                    &mut exec,
                    "in-process",
                )?);
            }
            "daemon" => {
                let opts = Options {
                    offload_optimizer: a.offload,
                    offload_ref: a.offload,
                };
                let dir = a.work.join("daemon");
                results.extend(match a.device {
                    Device::Cpu => {
                        let mut r = Resident::new(Box::new(|| Ok(Cpu)), a.device, opts);
                        steps(&a, &dir, &mut r, "daemon")?
                    }
                    Device::Cuda(n) => {
                        let mut r =
                            Resident::new(Box::new(move || CudaBackend::new(n)), a.device, opts);
                        steps(&a, &dir, &mut r, "daemon")?
                    }
                });
            }
            other => crate::bail_input!("--modes: unknown mode '{other}' (in-process, daemon)"),
        }
    }
    let mib = |v: &Value| {
        v["phase_peak_in_use"]
            .as_f64()
            .map_or("-".to_string(), |b| format!("{:.0}", b / (1 << 20) as f64))
    };
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let sec = &r["seconds"];
            let d = &r["daemon"];
            vec![
                r["mode"].as_str().unwrap_or("").to_string(),
                r["step"].to_string(),
                r["response_tokens"].to_string(),
                format!("{:.2}", sec["rollout"].as_f64().unwrap_or(0.0)),
                format!("{:.2}", sec["ref_logprob"].as_f64().unwrap_or(0.0)),
                format!("{:.2}", sec["old_logprob"].as_f64().unwrap_or(0.0)),
                format!("{:.2}", sec["update"].as_f64().unwrap_or(0.0)),
                match (r["weights_saved"].as_bool(), r["optimizer_saved"].as_bool()) {
                    (Some(false), _) => "resident",
                    (_, Some(true)) => "all",
                    _ => "weights",
                }
                .to_string(),
                format!("{:.4}", sec["sync"].as_f64().unwrap_or(0.0)),
                format!("{:.2}", sec["step"].as_f64().unwrap_or(0.0)),
                format!(
                    "{}/{}/{}",
                    mib(&d["rollout"]),
                    mib(&d["ref_logprob"]),
                    mib(&d["update"])
                ),
            ]
        })
        .collect();
    crate::bench::report(
        &format!("GRPO step on {} ({})", a.model.display(), a.device),
        &[
            "mode",
            "step",
            "resp tokens",
            "rollout s",
            "ref s",
            "old s",
            "update s",
            "saved",
            "sync s",
            "step s",
            "peak MiB roll/ref/upd",
        ],
        &rows,
        &json!({"bench": "grpo-step", "device": a.device.to_string(), "results": results}),
    );
    Ok(())
}
