//! `update`: see `tandem::stage::update`; `tandem::daemon::run_stage` decides whether it
//! computes here or on the warm daemon.

fn main() -> std::process::ExitCode {
    let args = tandem::stage::parse_cli("update");
    tandem::error::run_main(|| tandem::daemon::run_stage(tandem::stage::StageJob::Update(args)))
}
