//! The weight transfer of a disaggregated run (`[placement]`, docs/DISTRIBUTED.md): the policy
//! the training group holds goes to every rank of the rollout group, in buckets over a
//! communicator of its own (the *bridge*: the training group's rank 0 and the rollout group's
//! ranks, met at a rendezvous port). Not a stage binary: a job only daemons run, sent to both
//! groups at once by `tandem daemon-ctl transfer`; every rank of each group runs its part.

use super::common::{resolve_model, ModelRef};
use super::{Console, Hold, Topology};
use crate::bail_input;
use crate::batch::write_json;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which end of the transfer a group is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Side {
    /// The training group: its rank 0 sends the weights it generates with.
    Send,
    /// The rollout group: every rank receives them and generates with them from then on.
    Receive,
}

/// One group's part of a transfer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TransferArgs {
    /// The policy checkpoint that moves (a directory, resident or not, or a sync-weights
    /// pointer): the sender must hold it; the receivers hold it under that name afterwards.
    pub model: PathBuf,
    pub side: Side,
    /// The bridge's rendezvous port on 127.0.0.1 (the groups share one machine), where a
    /// new bridge meets.
    pub port: u16,
    /// The bridge's id: a new one, met at `port`, or (`reuse`) the one every end kept.
    pub bridge: String,
    /// Every end reported holding the bridge `bridge`, working (`daemon-ctl` asked their
    /// `status`): each sends over it, and an end that lost it since fails at once rather than
    /// wait at a rendezvous that the others, holding it, would not come to.
    pub reuse: bool,
    /// Keep the bridge for the next transfer (else it ends with this one).
    pub keep: bool,
    /// Ranks of the receiving group.
    pub receivers: usize,
    /// Elements of a bucket.
    pub bucket_elems: usize,
    /// Where the receiving group's rank 0 writes the transfer's metrics (JSON).
    pub metrics: Option<PathBuf>,
}

/// This rank's place on the bridge: rank `rank` of `world` (sender 0, receivers 1..).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bridge {
    pub rank: usize,
    pub world: usize,
    pub port: u16,
    pub id: String,
    pub bucket_elems: usize,
    /// Kept for the next transfer (else ended after this one).
    pub keep: bool,
    /// Goes over the bridge every end kept (`TransferArgs::reuse`).
    pub reuse: bool,
}

/// What one rank's part of a transfer did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Transferred {
    pub buckets: usize,
    pub elements: usize,
    pub bytes: usize,
    /// From the job's start (a new bridge's rendezvous included) to the last bucket unpacked
    /// (or sent).
    pub seconds: f64,
    /// The broadcasts alone (the bridge's rendezvous and communicator set-up excluded).
    pub broadcast_seconds: f64,
    /// The bridge was kept from an earlier transfer (no rendezvous, no communicator set-up).
    pub bridge_reused: bool,
    /// A new bridge's rendezvous and communicator set-up (0 when reused).
    pub bridge_seconds: f64,
}

/// This rank's bridge rank: the training group's rank 0 sends (0), its other ranks sit it out
/// (None); rollout rank r receives as 1 + r.
pub fn bridge_rank(side: Side, group_rank: usize) -> Option<usize> {
    match side {
        Side::Send => (group_rank == 0).then_some(0),
        Side::Receive => Some(1 + group_rank),
    }
}

/// Runs this rank's part of the transfer on `exec` (a daemon's `Hold`).
pub(crate) fn run<E: Hold + Console + Topology + ?Sized>(
    args: TransferArgs,
    exec: &mut E,
) -> Result<()> {
    if args.receivers == 0 || args.bucket_elems == 0 {
        bail_input!("transfer: needs at least one receiving rank and a bucket size above 0");
    }
    let model = resolve_model(&args.model)?;
    let group_rank = exec.ranks().map_or(0, |x| x.rank());
    let moved = match bridge_rank(args.side, group_rank) {
        None => None,
        Some(rank) => {
            let bridge = Bridge {
                rank,
                world: 1 + args.receivers,
                port: args.port,
                id: args.bridge.clone(),
                bucket_elems: args.bucket_elems,
                keep: args.keep,
                reuse: args.reuse,
            };
            Some((rank, exec.transfer(&model, &bridge)?))
        }
    };
    // Rank 0 answers once every rank's part is done, or with the failed part's error: a
    // receiving rank can fail after rank 0 got its weights.
    if let Some(x) = exec.ranks() {
        x.gather(&[])?;
    }
    match moved {
        Some((rank, moved)) => report(&args, &model, rank, &moved, exec),
        None => Ok(()),
    }
}

/// The metrics (written by the first receiver) and log line of this rank's part.
fn report<E: Console + ?Sized>(
    args: &TransferArgs,
    model: &ModelRef,
    rank: usize,
    moved: &Transferred,
    exec: &mut E,
) -> Result<()> {
    let gb_per_s = moved.bytes as f64 / moved.broadcast_seconds.max(1e-9) / 1e9;
    if rank == 1 {
        if let Some(path) = &args.metrics {
            let metrics = serde_json::json!({
                "policy_version": model.policy_version,
                "receivers": args.receivers,
                "buckets": moved.buckets,
                "elements": moved.elements,
                "bytes": moved.bytes,
                "seconds": moved.seconds,
                "broadcast_seconds": moved.broadcast_seconds,
                "gb_per_s": gb_per_s,
                "bridge_reused": u8::from(moved.bridge_reused),
                "bridge_seconds": moved.bridge_seconds,
            });
            write_json(path, &metrics)?;
        }
    }
    let what = match args.side {
        Side::Send => "sent",
        Side::Receive => "received",
    };
    let over = match moved.bridge_reused {
        true => "the kept bridge".to_string(),
        false => format!("a new bridge ({:.3}s to set up)", moved.bridge_seconds),
    };
    exec.log(&format!(
        "transfer: {what} {} (policy_version {}) over {over}: {} buckets, {:.1} MB in {:.3}s ({:.3}s broadcasting, {gb_per_s:.2} GB/s)",
        model.dir.display(),
        model.policy_version,
        moved.buckets,
        moved.bytes as f64 / 1e6,
        moved.seconds,
        moved.broadcast_seconds
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trainers_rank_0_sends_and_every_rollout_rank_receives() {
        assert_eq!(bridge_rank(Side::Send, 0), Some(0));
        assert_eq!(bridge_rank(Side::Send, 1), None);
        assert_eq!(bridge_rank(Side::Receive, 0), Some(1));
        assert_eq!(bridge_rank(Side::Receive, 2), Some(3));
    }
}
