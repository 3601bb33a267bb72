//! tandem: reinforcement-learning post-training of language models as composable stages that
//! pass Arrow/Parquet batch files. See docs/ARCHITECTURE.md for the picture.
//!
//! The library's API is what the binaries (`src/bin/`) and the integration tests call; an item
//! no user of the crate needs is `pub(crate)`. A user of the crate calls:
//! - `stage`: each stage's flags and `run` (`rollout`, `score`, `ref_logprob`, `advantage`,
//!   `update`, `sync_weights`, `sft_batch`); `daemon::run_stage` runs a stage
//!   in-process or on the warm daemon (`daemon::server`, `daemon::ctl`);
//! - `pipeline`: `run` of a spec, `plot`, `inspect`, the TensorBoard event file;
//! - `parallel`: `launch` and the process group of several ranks;
//! - `model`: model directories (`ModelDir`, `Config`, `Weights`, `safetensors`), `init`,
//!   `info`, GGUF import (`gguf`) and the decoder; `engine`: generation (`paged`), the training
//!   loop (`train`) and optimizer shard files (`resume`); `backend`: the CPU and CUDA backends;
//! - `batch`: batch files (`Batch`, `schema`, `write_file`); `data`: `tandem prepare`, prompt
//!   datasets and chat templates; `tokenizer`: a model's HF tokenizer;
//! - `cli`: every binary's command line (`BINARIES`, `binary_main`), completions and man
//!   pages; `version::VERSION`, what `--version` prints;
//! - `serve`: `tandem serve`, the policy over an OpenAI-compatible HTTP API;
//! - `bench`: `tandem bench` and `tandem gpu-test`; `error`: `run_main` and input errors (exit
//!   code 2); `algo::policy_loss::LOSSES`, the registered losses.
//!
//! `reward`, `rng` and `process` serve the stages and have no caller outside the crate.

pub mod algo;
pub mod backend;
pub mod batch;
pub mod bench;
pub mod cli;
pub mod daemon;
pub mod data;
pub mod engine;
pub mod error;
pub mod model;
pub mod parallel;
pub mod pipeline;
pub mod process;
pub mod reward;
pub mod rng;
pub mod serve;
pub mod stage;
pub mod tokenizer;
pub mod tool;
pub mod version;
