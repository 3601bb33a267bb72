//! `score`: see `tandem::stage::score`; its command line is `tandem::cli::BINARIES`' entry.

fn main() -> std::process::ExitCode {
    tandem::cli::binary_main("score")
}
