//! `rollout`: see `tandem::stage::rollout`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "rollout", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::stage::rollout::RolloutArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::stage::rollout::run(cli.args))
}
