//! A computation of one rank ([`Job`], [`RankJob`]) run on the backend `--device` names with
//! the group's matching communicator: the CPU with [`HostComm`], a GPU with [`NcclComm`].
//! Apart from `group.rs`, which the communicators import, so that the group does not import
//! them back.

use super::comm::Comm;
use super::group::ProcessGroup;
use super::host::HostComm;
use super::nccl::NcclComm;
use super::world::World;
use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::error::input_error;
use anyhow::Result;

/// The backend a rank computes on: every rank of a job uses the same kind; a CUDA rank uses
/// the GPU of its local rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// A computation of one rank, written once for any backend and its communicator.
pub trait Job {
    type Out;
    fn run<B: Backend>(self, backend: &B, comm: &dyn Comm<B>) -> Result<Self::Out>;
}

/// A computation of one rank that keeps its backend and communicator (a trainer that owns
/// them, a daemon that holds such a trainer between requests).
pub trait RankJob {
    type Out;
    fn run<B: Backend>(self, backend: B, comm: Box<dyn Comm<B>>) -> Result<Self::Out>;
}

/// Runs `job` on this rank's backend with the group's communicator of that backend: the CPU
/// with [`HostComm`], or GPU [`gpu_for_rank`] with [`NcclComm`].
pub fn run_job<J: Job>(device: DeviceKind, pg: &ProcessGroup, job: J) -> Result<J::Out> {
    struct Borrowed<J>(J);
    impl<J: Job> RankJob for Borrowed<J> {
        type Out = J::Out;
        fn run<B: Backend>(self, backend: B, comm: Box<dyn Comm<B>>) -> Result<J::Out> {
            self.0.run(&backend, comm.as_ref())
        }
    }
    run_rank_job(device, pg, Borrowed(job))
}

/// [`run_job`] for a job that takes its backend and communicator over. The communicator is
/// made from the backend (NCCL orders its stream against the backend's), before the job gets
/// both.
pub fn run_rank_job<J: RankJob>(device: DeviceKind, pg: &ProcessGroup, job: J) -> Result<J::Out> {
    match device {
        DeviceKind::Cpu => {
            let comm = HostComm::new(pg)?;
            job.run(Cpu, Box::new(comm))
        }
        DeviceKind::Cuda => {
            let backend = crate::backend::ops::open_cuda(gpu_for_rank(pg.world())?)?;
            let comm = NcclComm::new(&backend, pg)?;
            job.run(backend, Box::new(comm))
        }
    }
}

/// The GPU a rank uses: its local rank, or GPU 0 where the launcher shows each rank only its
/// own GPU (Slurm's `--gpus-per-task=1` sets CUDA_VISIBLE_DEVICES per task).
pub(crate) fn gpu_for_rank(world: &World) -> Result<usize> {
    let visible = super::nccl::visible_gpus()?;
    match visible {
        1 => Ok(0),
        n if world.local_rank < n => Ok(world.local_rank),
        n => Err(input_error(format!(
            "local rank {} has no GPU: {n} visible (start at most one rank per GPU: \
             --nproc-per-node {n})",
            world.local_rank
        ))),
    }
}
