//! `score`: see `tandem::stage::score`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "score", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::stage::score::ScoreArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::stage::score::run(cli.args))
}
