//! `tandem bench ...`: benchmarks that print a table and JSON. Never timed tests. Also
//! `tandem gpu-test` (`gpu_test`), the GPU parity suite, which sits up here because its
//! whole-engine checks do.

pub(crate) mod cpu_engine;
pub(crate) mod cpu_stages;
pub(crate) mod dist;
pub(crate) mod gpu_clock;
pub mod gpu_test;
pub(crate) mod grpo_step;
pub(crate) mod logprob;
pub(crate) mod rollout;
pub(crate) mod synth;
pub(crate) mod update;

use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub(crate) which: Which,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Which {
    /// `score --reward gsm8k` and `advantage --estimator grpo` on a large synthetic batch.
    CpuStages(cpu_stages::CpuStagesArgs),
    /// Generation and update tokens/s of the CPU engine on a ~10M model and the Qwen2.5-0.5B shape.
    CpuEngine(cpu_engine::CpuEngineArgs),
    /// The issue-6 update workload (PPO-clip + AdamW, Qwen2.5-0.5B shape) through `update`'s loop.
    Update(update::UpdateArgs),
    /// The same workload's forward-only scoring (what `ref-logprob` does).
    Logprob(logprob::LogprobArgs),
    /// Tokens/s of the paged rollout engine (Qwen2.5-0.5B shape, random weights) and its
    /// fraction of the roofline.
    Rollout(rollout::RolloutBenchArgs),
    /// Whole GRPO steps in-process and on the daemon's resident models: seconds per stage and
    /// peak device memory per phase.
    GrpoStep(grpo_step::GrpoStepArgs),
    /// Bandwidth of every collective (nccl-tests' bus bandwidth) and the bucketed weight sync
    /// of the Qwen2.5 shapes, at any world size (under `tandem launch`, srun, or alone).
    Dist(dist::DistBenchArgs),
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.which {
        Which::CpuStages(a) => cpu_stages::run(a),
        Which::CpuEngine(a) => cpu_engine::run(a),
        Which::Update(a) => update::run(a),
        Which::Logprob(a) => logprob::run(a),
        Which::Rollout(a) => rollout::run(a),
        Which::GrpoStep(a) => grpo_step::run(a),
        Which::Dist(a) => dist::run(a),
    }
}

/// Print a result table (aligned columns) and then the same rows as one JSON line.
pub(crate) fn report(title: &str, header: &[&str], rows: &[Vec<String>], json: &serde_json::Value) {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{s:>w$}", w = widths[c]))
            .collect::<Vec<_>>()
            .join("  ")
    };
    println!("{title}");
    println!("{}", line(header.to_vec()));
    for r in rows {
        println!("{}", line(r.iter().map(|s| s.as_str()).collect()));
    }
    println!("{json}");
}
