//! The warm daemon (docs/DAEMON.md, docs/ARCHITECTURE.md): one process per device that keeps
//! the policy (compute weights, f32 masters, AdamW state) and the reference model in memory
//! between stages. Stages started with `--daemon PATH` send their job over a unix socket
//! instead of loading the model; the daemon runs the very same stage code against the models
//! it holds, so the files written are the same as in-process.
//!
//! The daemon sits above the stages: `protocol` carries their [`StageJob`]s, `resident` is their
//! [`crate::stage::Exec`] inside the daemon, and [`run_stage`] decides where a stage runs;
//! `ctl` is `tandem daemon-ctl`.

pub mod client;
pub mod ctl;
pub mod protocol;
pub mod resident;
pub mod server;

use crate::stage::{InProcess, StageJob};
use anyhow::Result;
use std::path::PathBuf;

/// Runs a model stage where its flags say: as a job of the warm daemon that `--daemon` (else
/// `TANDEM_DAEMON`) names, or in this process on `--device`. The one place that decides; the
/// stage binaries call it.
pub fn run_stage(job: StageJob) -> Result<()> {
    match daemon_socket(job.daemon()) {
        Some(socket) => client::run_job(&socket, job),
        None => {
            let mut here = InProcess(job.device().unwrap_or(crate::stage::common::Device::Cpu));
            job.run(&mut here)
        }
    }
}

/// The daemon socket a stage should use: `--daemon`, else `TANDEM_DAEMON` when set and not
/// empty.
pub fn daemon_socket(flag: Option<&std::path::Path>) -> Option<PathBuf> {
    flag.map(PathBuf::from).or_else(|| {
        std::env::var_os("TANDEM_DAEMON")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
}
