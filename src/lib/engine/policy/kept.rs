//! A policy kept in memory between calls, as the warm daemon keeps it: the decoder with its
//! f32 masters and AdamW state (optionally parked in host memory between updates), the
//! checkpoints it equals ([`ModelKey`]), and in a daemon group this rank's optimizer shards and
//! communicator, trained in place by [`train_resident`].

use super::load::Trainable;
use super::pointer::ModelRef;
use super::train::{Sharding, Train, Trained};
use crate::backend::{Backend, DType};
use crate::engine::resume::TrainerState;
use crate::engine::shard::{ShardMode, ShardedPolicy};
use crate::engine::shard::{ShardStats, ShardedOptim};
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::Weights;
use crate::parallel::{Comm, ProcessGroup};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::SystemTime;

/// A checkpoint as the daemon recognises it: its canonical directory and the size and
/// modification time of each file in it, so a directory rewritten by someone else is reloaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelKey {
    pub(crate) dir: PathBuf,
    files: Vec<(String, u64, Option<SystemTime>)>,
}

impl ModelKey {
    pub fn of(dir: &Path) -> Result<ModelKey> {
        let dir = dir.canonicalize()?;
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_file() {
                files.push((
                    entry.file_name().to_string_lossy().into_owned(),
                    meta.len(),
                    meta.modified().ok(),
                ));
            }
        }
        files.sort();
        Ok(ModelKey { dir, files })
    }

    /// Whether the directory is a resident one (weights in a daemon's memory).
    pub fn resident(&self) -> bool {
        self.files
            .iter()
            .any(|(name, _, _)| name == crate::model::checkpoint::RESIDENT_FILE)
    }
}

/// A policy kept in memory between calls (the warm daemon's): its decoder with the optimizer
/// state, which checkpoints it equals, and what a daemon group's rank keeps of its shards.
pub(crate) struct PolicySlot<B: Backend> {
    /// The checkpoints (files or resident directories) this state equals; empty while it is
    /// ahead of every file (after training, until `update` has saved it).
    pub(crate) keys: Vec<ModelKey>,
    /// A directory with the policy's config and tokenizer files (the last one it was loaded
    /// from or saved to).
    pub(crate) files: PathBuf,
    /// The trainer state of its last update (or the one it was loaded with).
    pub(crate) trainer: Option<TrainerState>,
    pub(crate) decoder: Decoder<B>,
    /// Update calls done (the learning-rate schedule position).
    pub(crate) schedule_step: u64,
    /// The decoder's weights are f32 masters (resumed or trained) rather than the files'.
    pub(crate) from_master: bool,
    /// The whole bf16 weights that generate, where the decoder's compute weights are not
    /// them (a backend that computes in f32, or `--shard full`); the daemon builds it
    /// (`Resident::generation`).
    pub(crate) gen: Option<Decoder<B>>,
    /// Optimizer state parked in host memory (`--offload-optimizer`).
    pub(crate) parked: Option<Parked>,
    /// In a daemon group: this rank's optimizer shards, kept between updates; the decoder
    /// then holds no whole masters or moments (zero2), nor whole compute weights (`--shard
    /// full`: `gen` is the whole copy that generates).
    pub(crate) sharded: Option<ShardedOptim<B>>,
    /// In a daemon group: the group's communicator on this decoder's backend, made at the first
    /// sharded job and kept: an NCCL init for every update was the likely part of the 1.0-1.5 s
    /// a group's update spent outside training at 2-4 ranks. A failed job drops it on every
    /// rank, so the next job starts from a fresh one.
    pub(crate) comm: Option<Box<dyn Comm<B>>>,
    /// LoRA: the base model directory under the adapters the decoder trains (its base weights
    /// frozen in the compute dtype; `gen` is then the merged model, [`lora_generation`]).
    pub(crate) lora_base: Option<PathBuf>,
    /// The base's files as they were when it was loaded: a reference job on the same files
    /// scores with the base held here, the adapters off (no second copy of the weights).
    pub(crate) lora_base_key: Option<ModelKey>,
    /// LoRA: the `update --seed` of fresh adapters not trained yet (drawn at load), so that an
    /// update with another seed loads its own; None once trained or when read from files.
    pub(crate) fresh_seed: Option<u64>,
}

impl<B: Backend> PolicySlot<B> {
    /// A policy that arrived by a weight transfer (`stage::transfer`): the checkpoint `key`'s
    /// generation weights in `decoder`, with `files`' config and tokenizer; no trainer state.
    pub(crate) fn received(key: ModelKey, files: &Path, decoder: Decoder<B>) -> Self {
        PolicySlot {
            keys: vec![key],
            files: files.to_path_buf(),
            trainer: None,
            decoder,
            schedule_step: 0,
            from_master: false,
            gen: None,
            parked: None,
            sharded: None,
            comm: None,
            lora_base: None,
            lora_base_key: None,
            fresh_seed: None,
        }
    }
}

/// What `--offload-optimizer` keeps in host memory between updates.
pub(crate) struct Parked {
    pub(crate) state: OptimizerState,
    /// The f32 masters, where the decoder keeps them apart from its compute weights.
    pub(crate) masters: Option<Weights>,
}

/// Makes the group's communicator on the backend a rank's policy lives on.
pub(crate) type MakeComm<B> = Rc<dyn Fn(&B, &ProcessGroup) -> Result<Box<dyn Comm<B>>>>;

/// One rank's part of a daemon group's sharded update on the policy kept in `slot`, with the
/// optimizer shards it keeps (cut from its state at the first update; read from its shard
/// file when it was loaded for generation only), over the communicator it keeps.
pub(crate) fn train_resident<B: Backend>(
    slot: &mut PolicySlot<B>,
    pg: &ProcessGroup,
    make_comm: &MakeComm<B>,
    model: &ModelRef,
    job: Train<'_>,
    sharding: Sharding,
    log: &mut dyn FnMut(&str),
) -> Result<Trained> {
    unpark(slot)?;
    if slot.comm.is_none() {
        slot.comm = Some(make_comm(slot.decoder.backend(), pg)?);
    }
    let comm = slot.comm.as_deref().expect("made above");
    let full = sharding.mode == ShardMode::Full;
    let mut optim = match slot.sharded.take() {
        Some(o) if o.is_full() == full => o,
        held => {
            let loaded = held.is_none();
            if let Some(o) = held {
                // Another --shard than the last update's: the state comes back together on
                // every rank (from memory, not from the files) and is sharded as asked.
                o.unshard(&mut slot.decoder, comm)?;
            }
            let mut o = match full {
                true => ShardedOptim::full(&mut slot.decoder, comm)?,
                false => ShardedOptim::zero2(&mut slot.decoder, comm, sharding.bucket_elems)?,
            };
            if loaded
                && slot
                    .trainer
                    .as_ref()
                    .is_some_and(|t| t.optimizer_shards > 0)
            {
                // Loaded for generation (the weights only): this rank's part of the
                // optimizer state is in its own shard file of the checkpoint, read as a
                // launched update's rank reads it.
                let files =
                    Trainable::load_rank(&model.dir, pg.rank(), pg.world_size(), &mut |_| {})?;
                let Some(source) = &files.shard else {
                    anyhow::bail!(
                            "{}: trainer_state.json says the optimizer state is sharded, but rank {} found no shard of it",
                            model.dir.display(),
                            pg.rank()
                        );
                };
                let shard = source.for_layout(&o.layout(&slot.decoder), pg.rank())?;
                o.load(&mut slot.decoder, &shard, &files.weights, comm)?;
            }
            o
        }
    };
    // The metrics are this update's (the shard layout stays; the timings start over).
    optim.stats = ShardStats {
        world_size: optim.stats.world_size,
        buckets: optim.stats.buckets,
        shard_elems: optim.stats.shard_elems,
        staging_bytes: optim.stats.staging_bytes,
        full: optim.stats.full,
        ..ShardStats::default()
    };
    // From here the decoder is ahead of every file until `saved`.
    slot.keys.clear();
    slot.from_master = true;
    slot.fresh_seed = None;
    let step = slot.schedule_step;
    let mut policy = ShardedPolicy {
        decoder: &mut slot.decoder,
        comm,
        optim,
    };
    let trained = job.train_sharded_on(&mut policy, step, &sharding.staging, log);
    slot.sharded = Some(policy.optim);
    let out = trained?;
    slot.schedule_step = step + 1;
    slot.decoder.release_workspace()?;
    slot.decoder.release_grads();
    slot.decoder.backend().trim()?;
    Ok(out)
}

/// Moves the AdamW moments and the f32 masters (where they are apart from the compute weights)
/// to host memory; `unpark` brings them back for the next optimizer step. `state` and
/// `masters` are the host copies when the caller has them already.
pub(crate) fn park_optimizer<B: Backend>(
    slot: &mut PolicySlot<B>,
    state: Option<OptimizerState>,
    masters: Option<Weights>,
) -> Result<()> {
    if slot.parked.is_some() {
        return Ok(());
    }
    let state = match state {
        Some(s) => s,
        None => slot.decoder.optimizer_state()?,
    };
    let separate = slot.decoder.backend().compute_dtype() != DType::F32;
    let masters = match (separate, masters) {
        (false, _) => None,
        (true, Some(m)) => Some(m),
        // A LoRA decoder's masters are the adapters' (the base has none).
        (true, None) => Some(match slot.decoder.lora_spec() {
            Some(_) => slot.decoder.export_adapters()?,
            None => slot.decoder.export_weights()?,
        }),
    };
    slot.decoder.release_optimizer_state();
    if masters.is_some() {
        slot.decoder.release_masters();
    }
    slot.parked = Some(Parked { state, masters });
    Ok(())
}

/// Brings back what [`park_optimizer`] moved to host memory.
pub(crate) fn unpark<B: Backend>(slot: &mut PolicySlot<B>) -> Result<()> {
    if let Some(p) = slot.parked.take() {
        if let Some(m) = &p.masters {
            slot.decoder.restore_masters(m)?;
        }
        slot.decoder.load_optimizer_state(&p.state)?;
    }
    Ok(())
}

/// The decoder a LoRA policy generates with: its frozen base copied on the device with
/// W + (α/r)·B·A merged into each target from the adapters' f32 masters
/// ([`Decoder::lora_generation`]), the merge every in-process loader of an adapter
/// checkpoint runs on its backend (`load_policy`), so the daemon generates from the model a
/// stage in process loads from the checkpoint, bit for bit. The adapters (small) come to
/// the host to be scaled; the base stays on the device.
pub(crate) fn lora_generation<B: Backend>(slot: &PolicySlot<B>, backend: B) -> Result<Decoder<B>> {
    let d = &slot.decoder;
    // Parked (--offload-optimizer): the adapters' masters are the host copy.
    let adapters = match slot.parked.as_ref().and_then(|p| p.masters.as_ref()) {
        Some(m) => m.clone(),
        None => d.export_adapters()?,
    };
    d.lora_generation(backend, &adapters)
}
