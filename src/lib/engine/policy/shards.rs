//! The ranks' optimizer shard files of a checkpoint, written by every rank together.

use crate::backend::Backend;
use crate::engine::shard::files::{shard_file_name, write_shard};
use crate::engine::shard::HostShard;
use crate::engine::shard::ToHost;
use crate::parallel::comm::sum_f64;
use crate::parallel::Comm;
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Every rank writes its optimizer shard into `staging`, then all learn whether all did (so
/// that no rank goes on to a checkpoint with a shard missing). Returns every rank's file.
pub fn write_rank_shards<B: Backend>(
    b: &B,
    comm: &dyn Comm<B>,
    staging: &Path,
    shard: &HostShard,
) -> Result<Vec<PathBuf>> {
    let written = write_shard(staging, shard);
    let mut failed = [written.is_err() as u8 as f64];
    sum_f64(b, comm, &mut failed)?;
    written?;
    if failed[0] != 0.0 {
        anyhow::bail!("update: another rank failed to write its optimizer shard");
    }
    let world = comm.world_size();
    Ok((0..world)
        .map(|r| staging.join(shard_file_name(r, world)))
        .collect())
}

/// [`write_rank_shards`] of the shard a checkpointing update brought to this rank's host (no
/// files where it brought none), timed into the update's shard metrics.
pub(super) fn write_own_shard<B: Backend>(
    out: &mut ToHost,
    b: &B,
    comm: &dyn Comm<B>,
    staging: &Path,
) -> Result<Vec<PathBuf>> {
    let Some(shard) = &out.shard else {
        return Ok(Vec::new());
    };
    let started = Instant::now();
    let files = write_rank_shards(b, comm, staging, shard)?;
    if let Some(stats) = &mut out.report.shard {
        stats.shard_write_seconds = started.elapsed().as_secs_f64();
    }
    Ok(files)
}
