//! The warm daemon (docs/DAEMON.md, docs/ARCHITECTURE.md): one process per device that keeps
//! the policy (compute weights, f32 masters, AdamW state) and the reference model in memory
//! between stages. Stages started with `--daemon PATH` send their job over a unix socket
//! instead of loading the model; the daemon runs the very same stage code against the models
//! it holds, so the files written are the same as in-process.
//!
//! The daemon sits above the stages: `protocol` carries their [`StageJob`]s, `resident` is their
//! [`crate::stage::Exec`] inside the daemon, and [`run_stage`] decides where a stage runs;
//! `ctl` is `tandem daemon-ctl`.

pub(crate) mod client;
pub mod ctl;
pub mod protocol;
pub mod resident;
pub mod server;

use crate::parallel::exchange::as_local;
use crate::parallel::{group, Exchange, ProcessGroup, World};
use crate::stage::common::{after_rank0, Device};
use crate::stage::{InProcess, StageJob};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::Arc;

/// Runs a model stage where its flags say: as a job of the warm daemon(s) that `--daemon`
/// (else `TANDEM_DAEMON`) names, or in this process on `--device`, as one rank of several when
/// a launcher started it (`tandem launch`, torchrun, srun). The one place that decides; the
/// stage binaries call it.
pub fn run_stage(job: StageJob) -> Result<()> {
    match daemon_socket(job.daemon()) {
        Some(socket) => {
            // Every rank would send the same job: one client per daemon.
            let world = World::from_env()?;
            if !world.is_single() {
                crate::bail_input!(
                    "{}: --daemon {} under a launcher (rank {} of {}): run one client, without tandem launch",
                    job.name(),
                    socket.display(),
                    world.rank,
                    world.world_size
                );
            }
            client::run_job(&socket, job)
        }
        None => run_here(job),
    }
}

/// The stage in this process; among several ranks, on this rank's share and its GPU.
fn run_here(job: StageJob) -> Result<()> {
    let device = job.device().unwrap_or(Device::Cpu);
    let world = World::from_env()?;
    // A launched world of one runs the data-parallel path too (through NCCL on a GPU).
    if !world.launched() {
        return job.run(&mut InProcess::new(device));
    }
    if !job.splits_over_ranks() {
        // Rank 0 runs it as one process would; the other ranks have nothing to do.
        return match world.rank {
            0 => job.run(&mut InProcess::new(device.for_rank(&world)?)),
            r => {
                eprintln!(
                    "{}: runs on rank 0 alone; rank {r} of {} has nothing to do",
                    job.name(),
                    world.world_size
                );
                Ok(())
            }
        };
    }
    let pg = Arc::new(ProcessGroup::new(world, group::Options::from_env()?)?);
    let mut here = InProcess {
        device: device.for_rank(pg.world())?,
        ranks: Some(Exchange::new(pg.clone(), job.name())),
    };
    // The other ranks wait (as long as it takes, a failure aside) until rank 0 has written the
    // output: the group's finish only allows its timeout between the ranks' ends.
    let done = job.run(&mut here).and_then(|()| after_rank0(&here));
    if let Err(e) = done {
        // The ranks waiting for this one stop with its message.
        here.ranks.as_ref().expect("set above").fail(&e);
        return Err(as_local(e));
    }
    pg.finish_shared()
}

/// The socket rank `rank` of a daemon group listens on (`tandem daemon` under a launcher, one
/// per GPU): rank 0 on `socket` itself, which is what the stages' `--daemon` names, and rank
/// r > 0 on `SOCKET.rank<r>` (for `daemon-ctl`; jobs go to rank 0, which hands them on).
pub(crate) fn rank_socket(socket: &std::path::Path, rank: usize) -> PathBuf {
    match rank {
        0 => socket.to_path_buf(),
        r => {
            let mut s = socket.as_os_str().to_os_string();
            s.push(format!(".rank{r}"));
            PathBuf::from(s)
        }
    }
}

/// The daemon socket a stage should use: `--daemon`, else `TANDEM_DAEMON` when set and not
/// empty.
pub(crate) fn daemon_socket(flag: Option<&std::path::Path>) -> Option<PathBuf> {
    flag.map(PathBuf::from).or_else(|| {
        std::env::var_os("TANDEM_DAEMON")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
}
