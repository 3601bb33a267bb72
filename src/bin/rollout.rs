//! `rollout`: see `tandem::engine::stage::rollout`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "rollout", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::engine::stage::rollout::RolloutArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::engine::stage::rollout::run(cli.args))
}
