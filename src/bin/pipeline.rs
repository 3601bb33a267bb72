//! `pipeline`: run an RL pipeline spec step after step (`tandem::pipeline`); its command line is
//! `tandem::cli::BINARIES`' entry.

fn main() -> std::process::ExitCode {
    tandem::cli::binary_main("pipeline")
}
