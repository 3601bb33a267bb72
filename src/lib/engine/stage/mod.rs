//! The model stages' command lines: each module holds a stage's clap `Args` and its `run`;
//! `src/bin/<stage>.rs` only parses and calls it.

pub mod common;
pub mod ref_logprob;
pub mod rollout;
pub mod sync_weights;
pub mod update;

use crate::backend::cpu::Cpu;
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use crate::model::Config;
use anyhow::Result;
use std::path::Path;

/// Loads a model directory onto the CPU backend. `check` sees the config before the weights
/// are read (cheap input checks such as token ids against the vocabulary come first).
pub fn load_policy(
    dir: &Path,
    check: impl FnOnce(&Config) -> Result<()>,
) -> Result<(Config, Decoder<Cpu>)> {
    let cfg = ModelDir::load_config(dir)?;
    check(&cfg)?;
    let (cfg, weights) = ModelDir::load(dir)?;
    let decoder = Decoder::new(Cpu, &cfg, &weights)?;
    Ok((cfg, decoder))
}
