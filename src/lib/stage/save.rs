//! `tandem daemon-ctl save`: the policy a daemon holds written as the files `update` writes
//! (the way out of `update --resident`). Not a stage binary: a job only a daemon runs, on its
//! [`Hold`] (and, in a daemon group, on every rank: [`Topology`]).

use super::common::{after_rank0, resolve_model};
use super::{Console, Hold, Topology};
use crate::engine::policy::{shard_staging, write_checkpoint, write_lora_checkpoint, SavedShards};
use crate::engine::resume::TrainerState;
use crate::model::checkpoint::ModelDir;
use anyhow::Result;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

/// `tandem daemon-ctl save`: the policy a daemon holds, written as the files `update` writes.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct SavePolicyArgs {
    /// The directory to write (HF layout, with optimizer and trainer state); may be the
    /// resident directory itself, which it replaces.
    #[arg(long)]
    pub out: PathBuf,
    /// Write only if the daemon holds this checkpoint (a directory, resident or not, or a
    /// sync-weights pointer) [default: whatever policy it holds].
    #[arg(long)]
    pub model: Option<PathBuf>,
}

/// The sharded policy of a daemon group as files, as a checkpointing update of the group writes
/// them: rank 0 the model files from the gathered masters and `trainer_state.json`, every
/// rank its `optimizer.rankRRRRR-of-NNNNN.safetensors` (moved in by rank 0).
fn save_group_shards<E: Hold + Console + Topology + ?Sized>(
    args: &SavePolicyArgs,
    exec: &mut E,
    s: SavedShards,
    started: Instant,
) -> Result<()> {
    let trainer = TrainerState {
        optimizer_not_saved: false,
        optimizer_shards: s.shard_files.len(),
        ..s.trainer
    };
    if let (Some(masters), Some((spec, base))) = (&s.masters, &s.lora) {
        let state = s.state.as_ref();
        write_lora_checkpoint(&args.out, base, spec, masters, state, &trainer)?;
    } else if let Some(masters) = &s.masters {
        let cfg = ModelDir::load_config(&s.files)?;
        write_checkpoint(
            &args.out,
            &s.files,
            &cfg,
            masters,
            None,
            &s.shard_files,
            &trainer,
        )?;
    }
    after_rank0(exec)?;
    exec.saved(&args.out, Some(&trainer))?;
    if s.masters.is_some() {
        exec.log(&format!(
            "save: the daemon group's policy ({} optimizer shards) -> {} in {:.2}s",
            s.shard_files.len(),
            args.out.display(),
            started.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

/// Writes the policy `exec` holds to `args.out`.
pub(crate) fn save_policy<E: Hold + Console + Topology + ?Sized>(
    args: SavePolicyArgs,
    exec: &mut E,
) -> Result<()> {
    let started = Instant::now();
    let model = args.model.as_deref().map(resolve_model).transpose()?;
    if exec.ranks().is_some() {
        // A daemon group: every rank runs this job.
        let staging = shard_staging(&args.out);
        if let Some(s) = exec.save_sharded(model.as_ref(), &staging)? {
            return save_group_shards(&args, exec, s, started);
        }
        if exec.ranks().is_some_and(|x| !x.is_root()) {
            // Not sharded: rank 0 holds all of it and saves it alone.
            return Ok(());
        }
    }
    let held = exec.held_policy(model.as_ref())?;
    let cfg = ModelDir::load_config(&held.files)?;
    // The files written are all there is: never the shards of another checkpoint.
    let trainer = held.trainer.as_ref().map(|t| TrainerState {
        optimizer_not_saved: held.state.is_none(),
        optimizer_shards: 0,
        ..t.clone()
    });
    let state = held.state.as_ref();
    match (&trainer, &held.lora) {
        (Some(t), Some((spec, base))) => {
            write_lora_checkpoint(&args.out, base, spec, &held.weights, state, t)?
        }
        (None, Some(_)) => crate::bail_input!(
            "the daemon's policy is the LoRA adapter {} as loaded (no update since): that directory is its checkpoint",
            held.files.display()
        ),
        (Some(t), None) => {
            write_checkpoint(&args.out, &held.files, &cfg, &held.weights, state, &[], t)?
        }
        // Never trained nor resumed: the model as it was loaded.
        (None, None) => ModelDir::save(&args.out, &cfg, &held.weights, Some(&held.files))?,
    }
    exec.saved(&args.out, None)?;
    exec.log(&format!(
        "save: the daemon's policy -> {} in {:.2}s",
        args.out.display(),
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
