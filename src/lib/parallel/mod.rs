//! Several ranks (processes) working as one job: who is who, how they meet, how they talk.
//!
//! - [`world`]: a rank's place in the job, from `tandem launch` / torchrun / Slurm variables.
//! - [`store`]: the rendezvous store rank 0 serves over TCP (hand-outs such as the NCCL id,
//!   heartbeats, failure relay, finish); [`health`]: the first failure and what it stops.
//! - [`group`]: a [`ProcessGroup`] ties them together and makes communicators; [`job`]:
//!   [`run_job`] runs a computation on the CPU or a GPU with the matching one.
//! - [`comm`]: the [`Comm`] trait (all-reduce, all-gather, reduce-scatter, broadcast, barrier
//!   on backend buffers, grouped and asynchronous); [`host`]: the CPU implementation over TCP
//!   (deterministic rank-order reductions); [`nccl`]: NCCL for CUDA ranks.
//! - [`exchange`]: byte payloads among the ranks of one job through the store (rank 0
//!   gathers the rows each rank generated or scored), and the block of rows each rank takes.
//! - [`bucket`]: flattened buckets of tensors, sharded over the ranks, and the bucketed
//!   all-gather of a weight sync; [`bench`]: collective and weight-sync timings
//!   (`tandem bench dist`); [`check`]: every collective against host-computed values
//!   (`tandem dist-test`, and the GPU checks).
//! - [`launch`]: `tandem launch`, the single-machine launcher.
//!
//! This module imports only `backend`, `error` and `rng`. See docs/DISTRIBUTED.md.

pub mod bench;
pub mod bucket;
pub mod check;
pub(crate) mod comm;
pub mod exchange;
pub(crate) mod group;
pub(crate) mod health;
pub(crate) mod host;
pub(crate) mod job;
pub mod launch;
pub(crate) mod nccl;
pub(crate) mod store;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod world;

pub use comm::{Collective, Comm, ReduceOp, Work};
pub use exchange::Exchange;
pub use group::{Options, ProcessGroup};
pub use host::HostComm;
pub use job::{run_job, run_rank_job, DeviceKind, Job, RankJob};
pub use nccl::NcclComm;
pub use world::World;

/// Writes one line to stderr in a single write, so that lines of ranks sharing a terminal do
/// not interleave.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
