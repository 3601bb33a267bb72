//! `ref-logprob`: see `tandem::stage::ref_logprob`; its command line and what it runs (here or on the warm
//! daemon) are `tandem::cli::BINARIES`' entry.

fn main() -> std::process::ExitCode {
    tandem::cli::binary_main("ref-logprob")
}
