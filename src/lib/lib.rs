//! tandem: reinforcement-learning post-training of language models as composable stages that
//! pass Arrow/Parquet batch files. See docs/ARCHITECTURE.md for the picture.

pub mod algo;
pub mod backend;
pub mod batch;
pub mod bench;
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
pub mod stage;
pub mod tokenizer;
