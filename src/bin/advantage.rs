//! `advantage`: token rewards, advantages and returns of a scored batch (see `tandem::algo`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = tandem::stage::advantage::AdvantageArgs::parse();
    tandem::error::run_main(|| tandem::stage::advantage::run(&args))
}
