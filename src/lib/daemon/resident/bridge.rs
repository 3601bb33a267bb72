//! A daemon's part of a weight transfer between daemon groups (`stage::transfer`): the
//! sender's or a receiver's side of the broadcast, over a bridge (a process group and
//! communicator of its own between the two groups) that each rank keeps for the next transfer.

use super::{fault_once, Resident, Role, BREAK_BRIDGE_ENV};
use crate::backend::Backend;
use crate::engine::policy::kept::{MakeComm, ModelKey, PolicySlot};
use crate::engine::policy::ModelRef;
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use crate::parallel::bucket::{broadcast_buckets, BucketPlan};
use crate::parallel::ProcessGroup;
use crate::parallel::World;
use crate::stage::transfer::{Bridge, Transferred};
use anyhow::Result;
use serde_json::{json, Value};
use std::time::Instant;

impl<B: Backend> Resident<B> {
    /// This rank's part of a weight transfer (`stage::transfer`) on the bridge `bridge`: rank 0
    /// sends the weights the policy `model` generates with (bf16 on a GPU; on the CPU the f32
    /// values of their bf16 rounding); every other rank receives them into a decoder for
    /// generation, which becomes its policy under `model`'s name and version (the old one is
    /// dropped first: peak memory is one policy). The bridge is a process group of its own,
    /// kept for the next transfer of the same id; its failure is this job's error (and the
    /// bridge's end), not the daemon's.
    pub(crate) fn transfer(&mut self, model: &ModelRef, bridge: &Bridge) -> Result<Transferred> {
        let started = Instant::now();
        if fault_once(BREAK_BRIDGE_ENV, self.bridge.is_some()) {
            // A test's bridge, lost between `daemon-ctl`'s status and this job.
            self.bridge = None;
        }
        // Taken out while it works: a failed transfer leaves no bridge behind.
        let mut kept = self.bridge.take().filter(|k| k.serves(bridge));
        if bridge.reuse && kept.is_none() {
            anyhow::bail!(
                "bridge rank {}: the kept bridge {} is gone or broken here",
                bridge.rank,
                bridge.id
            );
        }
        let reused = kept.is_some();
        let make = self.make_bridge.clone();
        let mut received = None;
        let dec = match bridge.rank == 0 {
            true => {
                let dec = self.generation(Role::Policy, model)?;
                if let Some(k) = &mut kept {
                    // Its generation decoder may be a new one since the last transfer.
                    k.comm.follow(dec.backend())?;
                }
                dec
            }
            false => {
                self.observe();
                self.policy = None;
                let cfg = ModelDir::load_config(&model.dir)?;
                let backend = (self.make)()?;
                if let Some(k) = &mut kept {
                    // Before the new weights are allocated: the old backend's memory goes.
                    k.comm.follow(&backend)?;
                }
                let dec = received.insert(Decoder::unfilled_for_generation(backend, &cfg)?);
                // Zeroed on its stream before the communicator writes into it.
                dec.backend().synchronize()?;
                dec
            }
        };
        let t0 = Instant::now();
        let k = match kept.as_mut() {
            Some(k) => k,
            None => kept.insert(KeptBridge::make(bridge, dec.backend(), make)?),
        };
        let bridge_seconds = t0.elapsed().as_secs_f64();
        let sizes: Vec<usize> = dec
            .param_shapes()
            .iter()
            .map(|s| s.iter().product())
            .collect();
        let plan = BucketPlan::new(&sizes, bridge.bucket_elems, 1)?;
        let dtype = dec.backend().compute_dtype();
        let t0 = Instant::now();
        let (backend, weights) = dec.weights_mut();
        let moved = broadcast_buckets(backend, k.comm.as_ref(), &plan, dtype, weights, 0)?;
        backend.synchronize()?;
        let broadcast_seconds = t0.elapsed().as_secs_f64();
        if let Some(decoder) = received {
            self.policy = Some(PolicySlot::received(
                ModelKey::of(&model.dir)?,
                &model.dir,
                decoder,
            ));
            self.policy_version = model.policy_version;
        }
        match (kept, bridge.keep) {
            (k, true) => self.bridge = k,
            // Every member ends it together, so that no end looks like a failure.
            (Some(k), false) => k.finish()?,
            (None, false) => {}
        }
        let out = Transferred {
            buckets: moved.buckets,
            elements: moved.elements,
            bytes: moved.bytes,
            seconds: started.elapsed().as_secs_f64(),
            broadcast_seconds,
            bridge_reused: reused,
            bridge_seconds: if reused { 0.0 } else { bridge_seconds },
        };
        self.note("transfer_bytes", out.bytes);
        self.note("transfer_seconds", out.seconds);
        self.note("bridge_reused", reused);
        Ok(out)
    }
}

/// A weight transfer's bridge, kept by each of its ranks between transfers (as a daemon group
/// keeps its own communicator): the next transfer with the same id skips the rendezvous and
/// the communicator's set-up (NCCL's init on a GPU).
pub(super) struct KeptBridge<B: Backend> {
    id: String,
    rank: usize,
    world: usize,
    // Dropped in this order: the communicator before its group.
    comm: Box<dyn crate::parallel::Comm<B>>,
    pg: ProcessGroup,
}

impl<B: Backend> KeptBridge<B> {
    /// Meets the other ranks at `bridge`'s port and makes the communicator on `backend`.
    fn make(bridge: &Bridge, backend: &B, make: Option<MakeComm<B>>) -> Result<Self> {
        let make = make.expect("every daemon sets its bridge maker");
        let timeout = crate::parallel::Options::from_env()?.timeout;
        let world = World::local(bridge.rank, bridge.world, bridge.port);
        let pg = ProcessGroup::new(world, crate::parallel::Options::side(timeout))?;
        let comm = make(backend, &pg)?;
        Ok(KeptBridge {
            id: bridge.id.clone(),
            rank: bridge.rank,
            world: bridge.world,
            comm,
            pg,
        })
    }

    /// True when the transfer `bridge` can go over this one: the same id and place, and no
    /// member gone since (a peer group's end is recorded on every member's group).
    fn serves(&self, bridge: &Bridge) -> bool {
        self.id == bridge.id
            && (self.rank, self.world) == (bridge.rank, bridge.world)
            && self.pg.health().failure().is_none()
    }

    /// Ends it with the other members (a bridge not kept).
    fn finish(self) -> Result<()> {
        let KeptBridge { comm, pg, .. } = self;
        drop(comm);
        pg.finish()
    }

    /// What `status` says of it: the id the next transfer names to reuse it.
    pub(super) fn status(&self) -> Value {
        json!({
            "id": self.id,
            "rank": self.rank,
            "world": self.world,
            "healthy": self.pg.health().failure().is_none(),
        })
    }
}
