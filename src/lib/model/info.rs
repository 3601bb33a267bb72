//! `tandem model-info DIR`: load a model directory (with every check the stages make) and print
//! what it holds.

use super::checkpoint::ModelDir;
use super::names::{expected_tensors, param_count};
use anyhow::Result;
use clap::Args;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

/// `tandem model-info`: summary of an HF model directory.
#[derive(Args, Debug, Clone)]
pub struct ModelInfoArgs {
    /// The model directory (config.json, safetensors weights, tokenizer files).
    pub(crate) dir: PathBuf,
    /// List every tensor instead of one line per tensor kind.
    #[arg(long)]
    pub(crate) tensors: bool,
}

/// `model.layers.7.mlp.up_proj.weight` -> `model.layers.*.mlp.up_proj.weight`.
fn layer_pattern(name: &str) -> String {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return name.to_string();
    };
    match rest.split_once('.') {
        Some((n, tail)) if n.bytes().all(|b| b.is_ascii_digit()) => {
            format!("model.layers.*.{tail}")
        }
        _ => name.to_string(),
    }
}

/// The summary text of a model directory.
pub(crate) fn summary(args: &ModelInfoArgs) -> Result<String> {
    let info = ModelDir::inspect(&args.dir)?;
    let cfg = &info.config;
    let loaded = &info.loaded;
    let mut s = String::new();
    writeln!(s, "model: {}", args.dir.display())?;
    writeln!(
        s,
        "architecture: {} ({})",
        cfg.arch.hf_architecture(),
        cfg.arch.model_type()
    )?;
    writeln!(
        s,
        "layers {}, hidden {}, heads {} (kv {}, head_dim {}), ffn {}, vocab {}",
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size
    )?;
    writeln!(
        s,
        "tied embeddings: {}, qkv bias: {}, qk norm: {}, rope_theta {}, rms_norm_eps {:e}, max positions {}",
        cfg.tie_word_embeddings,
        cfg.qkv_bias,
        cfg.qk_norm,
        cfg.rope_theta,
        cfg.rms_norm_eps,
        cfg.max_position_embeddings
    )?;
    let bos = cfg
        .bos_token_id
        .map(|b| b.to_string())
        .unwrap_or_else(|| "none".into());
    writeln!(s, "bos: {bos}, eos: {:?}", cfg.eos_token_ids)?;
    let params = param_count(cfg);
    writeln!(s, "parameters: {params} ({:.2} M)", params as f64 / 1e6)?;

    let mut dtype_counts: BTreeMap<String, usize> = BTreeMap::new();
    for d in loaded.dtypes.values() {
        *dtype_counts.entry(format!("{d:?}")).or_default() += 1;
    }
    let dtypes: Vec<String> = dtype_counts
        .iter()
        .map(|(d, n)| format!("{d} ({n} tensors)"))
        .collect();
    let files: Vec<String> = loaded
        .files
        .iter()
        .map(|p| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    writeln!(s, "weights: {} [{}]", files.join(", "), dtypes.join(", "))?;

    let tok_path = args.dir.join("tokenizer.json");
    if tok_path.is_file() {
        match tokenizers::Tokenizer::from_file(&tok_path) {
            Ok(tok) => {
                let n = tok.get_vocab_size(true);
                let note = if n > cfg.vocab_size {
                    " -- more than vocab_size: ids past it cannot be embedded"
                } else {
                    ""
                };
                writeln!(s, "tokenizer: tokenizer.json ({n} tokens){note}")?;
            }
            Err(e) => writeln!(s, "tokenizer: tokenizer.json does not load: {e}")?,
        }
    } else {
        writeln!(s, "tokenizer: none")?;
    }

    writeln!(s, "tensors:")?;
    let mut seen = std::collections::HashSet::new();
    for spec in expected_tensors(cfg) {
        let shown = if args.tensors {
            spec.name.clone()
        } else {
            layer_pattern(&spec.name)
        };
        if !seen.insert(shown.clone()) {
            continue;
        }
        let dtype = loaded
            .dtypes
            .get(&spec.name)
            .map(|d| format!("{d:?}"))
            .unwrap_or_default();
        writeln!(s, "  {shown:<52} {:?} {dtype}", spec.shape)?;
    }
    Ok(s)
}

/// Runs `tandem model-info`.
pub fn run(args: ModelInfoArgs) -> Result<()> {
    print!("{}", summary(&args)?);
    Ok(())
}
