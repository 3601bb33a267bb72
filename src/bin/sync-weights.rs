//! `sync-weights`: see `tandem::stage::sync_weights`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "sync-weights", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::stage::sync_weights::SyncWeightsArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::stage::sync_weights::run(cli.args))
}
