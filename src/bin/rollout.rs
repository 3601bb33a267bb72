//! `rollout`: see `tandem::stage::rollout`; `tandem::daemon::run_stage` decides whether it
//! computes here or on the warm daemon.

fn main() -> std::process::ExitCode {
    let args = tandem::stage::parse_cli("rollout");
    tandem::error::run_main(|| tandem::daemon::run_stage(tandem::stage::StageJob::Rollout(args)))
}
