//! A process group: this rank's [`World`], its connection to the rendezvous store (and, on
//! rank 0, the store itself), the job's [`Health`], and the options every communicator of the
//! group shares. Communicators are made from it (`HostComm::new`, `NcclComm::new`), and
//! `job::run_job` runs a computation on the backend `--device` names with the matching one.

use super::health::Health;
use super::store::{StoreClient, StoreServer};
use super::world::World;
use crate::error::input_error;
use anyhow::Result;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Seconds a collective (or the rendezvous) may wait for another rank before the job fails;
/// `tandem launch --timeout` sets it for its ranks.
pub(crate) const TIMEOUT_ENV: &str = "TANDEM_DIST_TIMEOUT";
/// The default of [`TIMEOUT_ENV`]: with the grace period below, every rank is gone within a
/// minute of a rank hanging.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(50);
/// How long a rank may take to end itself after a failure before it is ended.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(3);

/// What every communicator of a group shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub timeout: Duration,
    /// End the process this long after a failure (None: leave it to the caller; in-process
    /// tests, where ranks are threads).
    pub exit_grace: Option<Duration>,
    /// A side group (a weight transfer's bridge, kept between transfers): its failures are
    /// its caller's errors, neither printed nor recorded as the job's (the peer group going away
    /// between transfers is no failure of this one).
    pub quiet: bool,
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
            quiet: false,
        })
    }

    /// A side group's options (see `quiet`): `timeout`, and no process exit on a failure.
    pub fn side(timeout: Duration) -> Options {
        Options {
            timeout,
            exit_grace: None,
            quiet: true,
        }
    }

    /// Ranks that are threads of one process (tests): failures are reported, never `exit`.
    #[cfg(test)]
    pub(crate) fn in_process(timeout: Duration) -> Options {
        Options {
            timeout,
            exit_grace: None,
            quiet: false,
        }
    }
}

/// Positive seconds, fractions allowed ("2.5").
pub(crate) fn parse_seconds(s: &str) -> Option<Duration> {
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
        let health = match opts.quiet {
            true => Health::quiet(world.rank),
            false => Health::new(world.rank, opts.exit_grace),
        };
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

    pub(crate) fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// The connection to the rendezvous store (None in a world of one).
    pub(crate) fn store(&self) -> Option<&StoreClient> {
        self.client.as_ref()
    }

    /// The count of collectives started (communicators add to it).
    pub fn seq(&self) -> &Arc<AtomicU64> {
        &self.seq
    }

    /// Numbers the communicators made from this group (the same on every rank, since every
    /// rank makes them in the same order): keeps their store keys apart.
    pub(crate) fn next_comm_id(&self) -> u64 {
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
    pub(crate) fn finish_shared(&self) -> Result<()> {
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
