//! What a process that keeps the policy between calls (the warm daemon) reports of it: who
//! holds the weights of `update --resident`, and the policy as `daemon-ctl save` writes it.

use crate::engine::resume::TrainerState;
use crate::model::decoder::OptimizerState;
use crate::model::lora::LoraSpec;
use crate::model::Weights;
use std::path::PathBuf;

/// Where `update --resident` leaves the weights: the process that keeps them.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    /// The daemon's socket (None: a process without one, e.g. `tandem bench grpo-step`).
    pub socket: Option<PathBuf>,
    pub pid: u32,
}

/// The policy a daemon holds, as `tandem daemon-ctl save` writes it.
pub struct HeldPolicy {
    /// A directory with the policy's config and tokenizer files.
    pub files: PathBuf,
    /// The f32 (master) weights.
    pub weights: Weights,
    /// The optimizer state (None when the policy has none yet).
    pub state: Option<OptimizerState>,
    /// The trainer state of its last update (or the one it was loaded with).
    pub trainer: Option<TrainerState>,
    /// LoRA: the adapters' spec and base model; `weights` and `state` are then the adapters'.
    pub lora: Option<(LoraSpec, PathBuf)>,
}

/// What one rank of a daemon group brings to `daemon-ctl save` of a policy whose optimizer
/// state is sharded over the group (a daemon group's `daemon-ctl save`).
pub struct SavedShards {
    /// A directory with the policy's config and tokenizer files.
    pub files: PathBuf,
    /// The f32 masters, gathered on rank 0 (None on the other ranks).
    pub masters: Option<Weights>,
    /// Every rank's optimizer shard file, written into the staging directory.
    pub shard_files: Vec<PathBuf>,
    /// The trainer state of its last update.
    pub trainer: TrainerState,
    /// LoRA: the adapters' spec and base model; `masters` are then the adapters' and their
    /// optimizer state is gathered whole on rank 0 (`state`), as a LoRA update writes it.
    pub lora: Option<(LoraSpec, PathBuf)>,
    pub state: Option<OptimizerState>,
}
