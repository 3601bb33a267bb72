//! `tandem merge-lora`: a base model and a PEFT LoRA adapter written as one HF model
//! directory, W + (α/r)·B·A per target, in bf16 as every model tandem writes.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

use crate::model::checkpoint::ModelDir;
use crate::model::lora::merge;
use crate::model::peft::read_adapter;

/// `tandem merge-lora --base DIR --adapter DIR --out DIR`.
#[derive(Args, Debug, Clone)]
pub struct MergeLoraArgs {
    /// The base model directory (HF layout) the adapter was trained on.
    #[arg(long)]
    pub base: PathBuf,
    /// The adapter directory (adapter_config.json and adapter_model.safetensors, PEFT's
    /// layout; e.g. a LoRA `update`'s checkpoint).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Where to write the merged model (written under a temporary name and renamed).
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs `tandem merge-lora`.
pub fn run(args: MergeLoraArgs) -> Result<()> {
    let adapter = read_adapter(&args.adapter)?;
    let (cfg, mut weights) = ModelDir::load(&args.base)?;
    merge(&cfg, &mut weights, &adapter.weights, &adapter.spec)?;
    ModelDir::save(&args.out, &cfg, &weights, Some(&args.base))?;
    eprintln!(
        "merge-lora: {} + {} (r {}, alpha {}, {} adapters) -> {}",
        args.base.display(),
        args.adapter.display(),
        adapter.spec.rank,
        adapter.spec.alpha,
        adapter.weights.len() / 2,
        args.out.display()
    );
    Ok(())
}
