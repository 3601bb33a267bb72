//! The model stages' command lines: each module holds a stage's clap `Args` and its `run`;
//! `src/bin/<stage>.rs` only parses and calls it.

/// Runs `$body` with `$p` bound to `&mut Decoder<B>` inside an `AnyDecoder`, once per backend
/// (the body is generic code, monomorphized for each).
macro_rules! on_decoder {
    ($d:expr, $p:ident => $body:expr) => {
        match &mut $d {
            $crate::engine::stage::common::AnyDecoder::Cpu(d) => {
                let $p = &mut **d;
                $body
            }
            $crate::engine::stage::common::AnyDecoder::Cuda(d) => {
                let $p = &mut **d;
                $body
            }
        }
    };
}

pub mod common;
pub mod ref_logprob;
pub mod rollout;
pub mod sync_weights;
pub mod update;

use crate::model::checkpoint::ModelDir;
use crate::model::Config;
use anyhow::Result;
use common::{AnyDecoder, OpenDevice};
use std::path::Path;

/// Loads a model directory onto an opened backend. `check` sees the config before the weights
/// are read (cheap input checks such as token ids against the vocabulary come first).
pub fn load_policy(
    device: OpenDevice,
    dir: &Path,
    check: impl FnOnce(&Config) -> Result<()>,
) -> Result<(Config, AnyDecoder)> {
    let cfg = ModelDir::load_config(dir)?;
    check(&cfg)?;
    let (cfg, weights) = ModelDir::load(dir)?;
    let decoder = device.decoder(&cfg, &weights)?;
    Ok((cfg, decoder))
}
