//! A policy written as files: the model (bf16, HF layout) with its tokenizer and config, the
//! trainer state, and the optimizer state (one file, or the ranks' shards moved in); or a
//! resident directory, whose weights stay in the daemon that wrote it. The directory is
//! written under a temporary name and renamed into place (`ModelDir::save_with`).

use crate::engine::resume::{self, TrainerState, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use crate::model::checkpoint::{ModelDir, ResidentMarker, SaveOptions, TOKENIZER_FILES};
use crate::model::decoder::OptimizerState;
use crate::model::lora::LoraSpec;
use crate::model::peft;
use crate::model::safetensors::DEFAULT_MAX_SHARD_BYTES;
use crate::model::{Config, Weights};
use anyhow::Result;
use std::path::{Path, PathBuf};

/// Where the ranks of a data-parallel update write their optimizer shards before rank 0
/// moves them into `out` (a sibling: the same file system, and `out` itself is replaced
/// whole).
pub fn shard_staging(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".shards");
    out.with_file_name(name)
}

/// Writes a trained policy as `update --out-model` does: the weights (bf16 files) with the
/// config and tokenizer files of `files_from`, `trainer_state.json`, and
/// `optimizer.safetensors` when `state` is given; `shard_files` (the ranks' optimizer shards)
/// are moved in.
pub fn write_checkpoint(
    out: &Path,
    files_from: &Path,
    cfg: &Config,
    weights: &Weights,
    state: Option<&OptimizerState>,
    shard_files: &[PathBuf],
    trainer: &TrainerState,
) -> Result<()> {
    let extra = [(
        TRAINER_STATE_FILE.to_string(),
        resume::trainer_state_bytes(trainer)?,
    )];
    // The optimizer file is streamed to the staging directory beside `out` (where the ranks'
    // shards are written) and moved in with them.
    let staging = shard_staging(out);
    let mut move_in = shard_files.to_vec();
    let saved = (|| -> Result<()> {
        if let Some(state) = state {
            let path = staging.join(OPTIMIZER_FILE);
            resume::write_optimizer(&path, state, weights)?;
            move_in.push(path);
        }
        ModelDir::save_with(
            out,
            cfg,
            weights,
            &SaveOptions {
                tokenizer_from: Some(files_from),
                config_base: Some(files_from),
                max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
                extra_files: &extra,
                move_in: &move_in,
            },
        )
    })();
    // Emptied by the move; anything left is a stale shard of another world size.
    let _ = std::fs::remove_dir_all(&staging);
    saved
}

/// Writes a LoRA update's checkpoint: the adapters in PEFT's files (naming `base` as
/// base_model_name_or_path), the base's tokenizer files, `trainer_state.json` and the adapters'
/// `optimizer.safetensors` when `state` is given; no config.json (a model loader reads the
/// base's and merges the adapters). Written under a temporary name and renamed into place.
pub fn write_lora_checkpoint(
    out: &Path,
    base: &Path,
    spec: &LoraSpec,
    adapters: &Weights,
    state: Option<&OptimizerState>,
    trainer: &TrainerState,
) -> Result<()> {
    let name = out.file_name().ok_or_else(|| {
        crate::error::input_error(format!(
            "{}: give the checkpoint a directory name",
            out.display()
        ))
    })?;
    let tmp = out.with_file_name(format!("{}.tmp", name.to_string_lossy()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    let base_name = base.to_string_lossy();
    peft::write_adapter(&tmp, spec, adapters, &base_name)?;
    std::fs::write(
        tmp.join(TRAINER_STATE_FILE),
        resume::trainer_state_bytes(trainer)?,
    )?;
    if let Some(state) = state {
        resume::write_optimizer(&tmp.join(OPTIMIZER_FILE), state, adapters)?;
    }
    for f in TOKENIZER_FILES {
        if base.join(f).is_file() {
            std::fs::copy(base.join(f), tmp.join(f))?;
        }
    }
    if out.exists() {
        std::fs::remove_dir_all(out)?;
    }
    std::fs::rename(&tmp, out)?;
    Ok(())
}

/// Writes `out` as a resident directory (`update --resident`): the config and tokenizer files
/// of `files_from` and `resident.json` from `marker`, no weights.
pub fn write_resident(
    out: &Path,
    files_from: &Path,
    cfg: &Config,
    marker: &ResidentMarker,
) -> Result<()> {
    ModelDir::save_resident(
        out,
        cfg,
        marker,
        &SaveOptions {
            tokenizer_from: Some(files_from),
            config_base: Some(files_from),
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            extra_files: &[],
            move_in: &[],
        },
    )
}
