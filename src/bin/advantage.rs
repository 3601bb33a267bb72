//! `advantage`: see `tandem::stage::advantage`.

fn main() -> std::process::ExitCode {
    let args = tandem::stage::parse_cli("advantage");
    tandem::error::run_main(|| tandem::stage::advantage::run(&args))
}
