//! `values`: see `tandem::stage::values`; its command line and what it runs (here or on the warm
//! daemon) are `tandem::cli::BINARIES`' entry.

fn main() -> std::process::ExitCode {
    tandem::cli::binary_main("values")
}
