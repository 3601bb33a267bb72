//! `ref-logprob`: see `tandem::stage::ref_logprob`; `tandem::daemon::run_stage` decides whether it
//! computes here or on the warm daemon.

fn main() -> std::process::ExitCode {
    let args = tandem::stage::parse_cli("ref-logprob");
    tandem::error::run_main(|| tandem::daemon::run_stage(tandem::stage::StageJob::RefLogprob(args)))
}
