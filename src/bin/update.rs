//! `update`: see `tandem::stage::update`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "update", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::stage::update::UpdateArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::stage::update::run(cli.args))
}
