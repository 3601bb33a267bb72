//! `tandem`: utilities around the stages (prepare datasets, make and inspect models, benchmarks),
//! and every other binary as a subcommand (`tandem rollout …`), shell completions and man pages
//! (`tandem::cli`). Each subcommand's options and logic live in the library; this file only
//! dispatches.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "tandem",
    about = "RL post-training of LLMs as Parquet stages: the stages, the pipeline and utilities"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    // One arm per subcommand, each a thin call into the library.
    /// Benchmarks: print a table and JSON.
    Bench(tandem::bench::BenchArgs),
    /// Import a dataset (GSM8K, any jsonl) as a prompt parquet file in verl's schema.
    Prepare(tandem::data::prepare::PrepareArgs),
    /// Write a randomly initialised model (HF layout) for tests and demos.
    InitModel(tandem::model::init::InitModelArgs),
    /// Merge a PEFT LoRA adapter into its base model: one HF model directory (bf16).
    MergeLora(tandem::model::merge::MergeLoraArgs),
    /// Convert a GGUF file (llama.cpp) to a model directory: weights, config, tokenizer.
    ImportGguf(tandem::model::gguf::ImportGgufArgs),
    /// Load a model directory with every check and print a summary.
    ModelInfo(tandem::model::info::ModelInfoArgs),
    /// CUDA parity suite: every op of the GPU backend against the CPU backend, as a table.
    GpuTest(tandem::bench::gpu_test::GpuTestArgs),
    /// Make a batch of reference answers (prompt + ground truth + EOS) for `update --loss sft`.
    SftBatch(tandem::stage::sft_batch::SftBatchArgs),
    /// Plot a run's metrics and evaluations into one PNG (several runs: overlaid).
    Plot(tandem::pipeline::plot::PlotArgs),
    /// Show a batch file as a table.
    Inspect(tandem::pipeline::inspect::InspectArgs),
    /// Write a pipeline spec from another tool's config (`spec from-verl CONFIG.yaml [key=value ...]`).
    Spec(tandem::pipeline::from_verl::SpecArgs),
    /// Keep a device's models warm; stages run with `--daemon SOCKET` send their jobs to it.
    Daemon(tandem::daemon::server::DaemonArgs),
    /// Ask a running daemon for its health or status, save its policy, or stop it.
    DaemonCtl(tandem::daemon::ctl::DaemonCtlArgs),
    /// Start N ranks of a command on this machine (like `torchrun --standalone`).
    Launch(tandem::parallel::launch::LaunchArgs),
    /// Communicator checks: every collective against host-computed values, on each rank.
    DistTest(tandem::parallel::check::DistTestArgs),
    /// Merge a checkpoint's per-rank optimizer shards into one file (loads with any N ranks).
    MergeShards(tandem::engine::resume::MergeShardsArgs),
    /// Serve a built-in tool over JSON lines on stdin/stdout (`tool python`: the sandboxed Python tool).
    Tool(tandem::tool::serve::ToolArgs),
    /// Serve the policy over an OpenAI-compatible HTTP API and record trajectories as batches.
    Serve(tandem::serve::ServeArgs),
}

fn main() -> ExitCode {
    let cmd = tandem::cli::with_binaries(Cli::command());
    let matches = cmd.clone().get_matches();
    if let Some(result) = tandem::cli::run_builtin(&cmd, &matches) {
        return tandem::error::run_main(|| result);
    }
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    tandem::error::run_main(|| match cli.cmd {
        Cmd::Bench(a) => tandem::bench::run(a),
        Cmd::Prepare(args) => tandem::data::prepare::run(args),
        Cmd::InitModel(args) => tandem::model::init::run(args),
        Cmd::MergeLora(args) => tandem::model::merge::run(args),
        Cmd::ImportGguf(args) => tandem::model::gguf::run(args),
        Cmd::ModelInfo(args) => tandem::model::info::run(args),
        Cmd::GpuTest(a) => tandem::bench::gpu_test::run(a),
        Cmd::SftBatch(a) => tandem::stage::sft_batch::run(a),
        Cmd::Plot(a) => tandem::pipeline::plot::run(a),
        Cmd::Inspect(a) => tandem::pipeline::inspect::run(a),
        Cmd::Spec(a) => tandem::pipeline::from_verl::run(a),
        Cmd::Daemon(a) => tandem::daemon::server::run(a),
        Cmd::DaemonCtl(a) => tandem::daemon::ctl::run_ctl(a),
        Cmd::Launch(a) => tandem::parallel::launch::run(a),
        Cmd::DistTest(a) => tandem::parallel::check::run(a),
        Cmd::MergeShards(a) => tandem::engine::resume::merge_shards(a),
        Cmd::Tool(a) => tandem::tool::serve::run(a),
        Cmd::Serve(a) => tandem::serve::run(a),
    })
}
