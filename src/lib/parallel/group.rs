//! A process group: this rank's [`World`], its connection to the rendezvous store (and, on
//! rank 0, the store itself), the job's [`Health`], and the options every communicator of the
//! group shares. Communicators are made from it ([`HostComm::new`], [`NcclComm::new`]), and
//! [`run_job`] runs a computation on the backend `--device` names with the matching one.

use super::comm::Comm;
use super::health::Health;
use super::host::HostComm;
use super::nccl::NcclComm;
use super::store::{StoreClient, StoreServer};
use super::world::World;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::error::input_error;
use anyhow::Result;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Seconds a collective (or the rendezvous) may wait for another rank before the job fails;
/// `tandem launch --timeout` sets it for its ranks.
pub const TIMEOUT_ENV: &str = "TANDEM_DIST_TIMEOUT";
/// The default of [`TIMEOUT_ENV`]: with the grace period below, every rank is gone within a
/// minute of a rank hanging.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(50);
/// How long a rank may take to end itself after a failure before it is ended.
pub const EXIT_GRACE: Duration = Duration::from_secs(3);

/// What every communicator of a group shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub timeout: Duration,
    /// End the process this long after a failure (None: leave it to the caller; in-process
    /// tests, where ranks are threads).
    pub exit_grace: Option<Duration>,
}

impl Options {
    /// The timeout from [`TIMEOUT_ENV`] (default [`DEFAULT_TIMEOUT`]); failures end the process.
    pub fn from_env() -> Result<Options> {
        let timeout = match std::env::var(TIMEOUT_ENV) {
            Ok(v) => parse_seconds(&v).ok_or_else(|| {
                input_error(format!(
                    "{TIMEOUT_ENV}='{v}' is not a positive number of seconds"
                ))
            })?,
            Err(_) => DEFAULT_TIMEOUT,
        };
        Ok(Options {
            timeout,
            exit_grace: Some(EXIT_GRACE),
        })
    }

    /// Ranks that are threads of one process (tests): failures are reported, never `exit`.
    pub fn in_process(timeout: Duration) -> Options {
        Options {
            timeout,
            exit_grace: None,
        }
    }
}

/// Positive seconds, fractions allowed ("2.5").
pub fn parse_seconds(s: &str) -> Option<Duration> {
    let v: f64 = s.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then(|| Duration::from_secs_f64(v))
}

/// One rank's membership in the job (see the module docs).
pub struct ProcessGroup {
    world: World,
    opts: Options,
    health: Arc<Health>,
    /// Collectives started by any communicator of the group (sent with the heartbeats).
    seq: Arc<AtomicU64>,
    next_comm: AtomicU64,
    // Dropped in this order: the client closes its connection before the server goes.
    client: Option<StoreClient>,
    _server: Option<StoreServer>,
}

impl ProcessGroup {
    /// The group the environment describes (`tandem launch`, torchrun, srun, or one rank).
    pub fn init() -> Result<ProcessGroup> {
        ProcessGroup::new(World::from_env()?, Options::from_env()?)
    }

    /// Joins the group of `world`: rank 0 starts the store; everyone connects and waits for
    /// the others. A world of one needs no store.
    pub fn new(world: World, opts: Options) -> Result<ProcessGroup> {
        let health = Health::new(world.rank, opts.exit_grace);
        let seq = Arc::new(AtomicU64::new(0));
        let (mut client, mut server) = (None, None);
        if !world.is_single() {
            if world.rank == 0 {
                server = Some(StoreServer::start(
                    bind_address(&world)?,
                    world.world_size,
                    opts.timeout,
                )?);
            }
            client = Some(StoreClient::connect(
                &world,
                health.clone(),
                seq.clone(),
                opts.timeout,
            )?);
        }
        Ok(ProcessGroup {
            world,
            opts,
            health,
            seq,
            next_comm: AtomicU64::new(0),
            client,
            _server: server,
        })
    }

    pub fn world(&self) -> &World {
        &self.world
    }

    pub fn rank(&self) -> usize {
        self.world.rank
    }

    pub fn world_size(&self) -> usize {
        self.world.world_size
    }

    pub fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// The connection to the rendezvous store (None in a world of one).
    pub fn store(&self) -> Option<&StoreClient> {
        self.client.as_ref()
    }

    /// The count of collectives started (communicators add to it).
    pub fn seq(&self) -> &Arc<AtomicU64> {
        &self.seq
    }

    /// Numbers the communicators made from this group (the same on every rank, since every
    /// rank makes them in the same order): keeps their store keys apart.
    pub fn next_comm_id(&self) -> u64 {
        self.next_comm.fetch_add(1, Ordering::Relaxed)
    }

    /// A value rank 0 makes and every rank receives (an NCCL unique id, a run name).
    pub fn share(&self, key: &str, make: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
        match &self.client {
            None => make(),
            Some(store) if self.world.rank == 0 => {
                let v = make()?;
                store.set(key, &v)?;
                Ok(v)
            }
            Some(store) => store.get(key),
        }
    }

    /// Waits until every rank has finished (so that no rank's exit looks like a crash).
    pub fn finish(self) -> Result<()> {
        self.finish_shared()
    }

    /// [`ProcessGroup::finish`] for a group shared behind an `Arc` (a daemon's, a stage's
    /// exchanges'): the group ends when its last holder drops it.
    pub fn finish_shared(&self) -> Result<()> {
        match &self.client {
            Some(store) => store.finish(),
            None => Ok(()),
        }
    }
}

/// Where rank 0 listens: loopback when MASTER_ADDR is this machine's loopback, else every
/// interface (other machines dial MASTER_ADDR).
fn bind_address(world: &World) -> Result<SocketAddr> {
    let loopback = (world.master_addr.as_str(), world.master_port)
        .to_socket_addrs()
        .map(|mut a| a.all(|a| a.ip().is_loopback()))
        .unwrap_or(false);
    let ip = if loopback { "127.0.0.1" } else { "0.0.0.0" };
    Ok(format!("{ip}:{}", world.master_port).parse()?)
}

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
            let backend = CudaBackend::new(gpu_for_rank(pg.world())?)?;
            let comm = NcclComm::new(&backend, pg)?;
            job.run(backend, Box::new(comm))
        }
    }
}

/// The GPU a rank uses: its local rank, or GPU 0 where the launcher shows each rank only its
/// own GPU (Slurm's `--gpus-per-task=1` sets CUDA_VISIBLE_DEVICES per task).
pub fn gpu_for_rank(world: &World) -> Result<usize> {
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
