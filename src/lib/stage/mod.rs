//! The model stages' command lines: each module holds a stage's clap `Args` and its `run`;
//! `src/bin/<stage>.rs` only parses and calls it. A stage reads and checks its input, runs its
//! compute on an [`Exec`] (in this process as a [`Job`] on the device `--device` names, or in
//! the warm daemon that `--daemon` names, on the models it holds), and writes its output.

pub mod advantage;
pub mod common;
pub mod ref_logprob;
pub mod rollout;
pub mod score;
pub mod sft_batch;
pub mod sync_weights;
pub mod update;

use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::model::checkpoint::ModelDir;
use crate::model::decoder::Decoder;
use anyhow::Result;
use common::{Device, ModelRef};
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

/// Where a model stage's compute runs: [`InProcess`] on `--device` (the model is loaded for this
/// one call), or inside the warm daemon on the models it keeps between calls
/// (`crate::daemon`). Reading, checking and writing the batch files is the stage's own code
/// either way, so both give the same files.
pub trait Exec {
    /// Every sample of a rollout, with the policy `model`.
    fn generate(
        &mut self,
        model: &ModelRef,
        job: rollout::Generate<'_>,
    ) -> Result<rollout::Generated>;
    /// Log-probs of the rows under `model` (the reference, or the policy for old_logprobs).
    fn score(
        &mut self,
        model: &ModelRef,
        job: ref_logprob::Score<'_>,
    ) -> Result<Vec<crate::model::decoder::TokenStats>>;
    /// One `update` call on the policy `model`, resuming the optimizer state next to it.
    fn train(&mut self, model: &ModelRef, job: update::Train<'_>) -> Result<update::Trained>;
    /// `update` wrote the policy it trained to `dir`.
    fn saved(&mut self, dir: &Path) -> Result<()>;
    /// `sync-weights` made the checkpoint `dir` the policy, as `policy_version`.
    fn publish(&mut self, dir: &Path, policy_version: u64) -> Result<()>;
    /// A progress bar of `len` steps.
    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar;
    /// A message line for the user (stderr of the stage).
    fn log(&mut self, line: &str);
}

/// The stage computes here: loads the model onto `--device`, computes, drops it.
pub struct InProcess(pub Device);

impl Exec for InProcess {
    fn generate(
        &mut self,
        _model: &ModelRef,
        job: rollout::Generate<'_>,
    ) -> Result<rollout::Generated> {
        on_device(self.0, job)
    }

    fn score(
        &mut self,
        _model: &ModelRef,
        job: ref_logprob::Score<'_>,
    ) -> Result<Vec<crate::model::decoder::TokenStats>> {
        on_device(self.0, job)
    }

    fn train(&mut self, model: &ModelRef, job: update::Train<'_>) -> Result<update::Trained> {
        let started = std::time::Instant::now();
        let loaded = update::Trainable::load(&model.dir, &mut |m| self.log(m))?;
        let load_seconds = started.elapsed().as_secs_f64();
        let mut out = on_device(self.0, update::TrainFresh { loaded, job })?;
        out.load_seconds = load_seconds;
        Ok(out)
    }

    fn saved(&mut self, _dir: &Path) -> Result<()> {
        Ok(())
    }

    fn publish(&mut self, _dir: &Path, _policy_version: u64) -> Result<()> {
        Ok(())
    }

    fn progress_bar(&mut self, len: usize, what: &str) -> indicatif::ProgressBar {
        common::progress_bar(len, what)
    }

    fn log(&mut self, line: &str) {
        eprintln!("{line}");
    }
}

/// The daemon socket a stage should use: `--daemon`, else `TANDEM_DAEMON` when set and not
/// empty.
pub fn daemon_socket(flag: &Option<std::path::PathBuf>) -> Option<std::path::PathBuf> {
    flag.clone().or_else(|| {
        std::env::var_os("TANDEM_DAEMON")
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    })
}
