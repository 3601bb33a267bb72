//! `score`: see `tandem::stage::score`.

fn main() -> std::process::ExitCode {
    let args = tandem::stage::parse_cli("score");
    tandem::error::run_main(|| tandem::stage::score::run(args))
}
