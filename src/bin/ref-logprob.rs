//! `ref-logprob`: see `tandem::stage::ref_logprob`.

use clap::Parser;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ref-logprob", version)]
struct Cli {
    #[command(flatten)]
    args: tandem::stage::ref_logprob::RefLogprobArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tandem::error::run_main(|| tandem::stage::ref_logprob::run(cli.args))
}
