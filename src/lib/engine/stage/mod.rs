//! The model stages' command lines: each module holds a stage's clap `Args` and its `run`;
//! `src/bin/<stage>.rs` only parses and calls it. A stage reads and checks its input, runs its
//! compute as a [`Job`] on the device `--device` names, and writes its output.

pub mod common;
pub mod ref_logprob;
pub mod rollout;
pub mod sft_batch;
pub mod sync_weights;
pub mod update;

use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use anyhow::Result;
use common::Device;
use std::path::Path;

/// A stage's compute, written once for any backend.
pub trait Job {
    type Out;
    fn run<B: Backend>(self, backend: B) -> Result<Self::Out>;
}

/// Runs `job` on the CPU backend or on GPU N (no driver or GPU there: an input error that
/// says to use `--device cpu`).
pub fn on_device<J: Job>(device: Device, job: J) -> Result<J::Out> {
    match device {
        Device::Cpu => job.run(Cpu),
        Device::Cuda(n) => job.run(CudaBackend::new(n)?),
    }
}

/// Loads a model directory onto a backend.
pub fn load_policy<B: Backend>(backend: B, dir: &Path) -> Result<Decoder<B>> {
    let (cfg, weights) = ModelDir::load(dir)?;
    Decoder::new(backend, &cfg, &weights)
}
