//! `pipeline`: run an RL pipeline spec step after step, as stage subprocesses, resumable.
//! The options and the loop live in `tandem::pipeline`; this file only dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "pipeline",
    version,
    about = "Run an RL post-training pipeline (rollout, score, ref-logprob, advantage, update, sync-weights) step after step"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run or continue the pipeline of a spec file in a run directory.
    Run(tandem::pipeline::RunArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| match cli.cmd {
        Cmd::Run(a) => tandem::pipeline::run(a),
    })
}
