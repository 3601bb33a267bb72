//! `advantage`: see `tandem::stage::advantage`; its command line is `tandem::cli::BINARIES`' entry.

fn main() -> std::process::ExitCode {
    tandem::cli::binary_main("advantage")
}
