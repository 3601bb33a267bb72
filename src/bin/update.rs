//! `update`: see `tandem::engine::stage::update`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "update", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::engine::stage::update::UpdateArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::engine::stage::update::run(cli.args))
}
