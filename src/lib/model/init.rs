//! Random models for tests and demos: `tandem init-model`.
//!
//! Initialisation follows HF's `_init_weights` for these classes: matrices and the embedding
//! ~ normal(0, 0.02), norms = 1, biases = 0. Each tensor draws from its own stream, seeded by
//! (seed, tensor name, chunk), so the same seed gives byte-identical files whatever the thread
//! count, and adding a layer does not change the others.

use super::checkpoint::{ModelDir, SaveOptions};
use super::config::{Arch, Config, CONFIG_FILE, GENERATION_CONFIG_FILE};
use super::names::{expected_tensors, param_count, Role};
use super::safetensors::DEFAULT_MAX_SHARD_BYTES;
use super::tensor::{Tensor, Weights};
use crate::error::input_error;
use crate::rng::{stream_seed, SplitMix64};
use anyhow::Result;
use clap::{ArgAction, Args, ValueEnum};
use rayon::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Uniform in (0, 1], never 0 (Box-Muller takes its log).
fn next_unit(rng: &mut SplitMix64) -> f64 {
    ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
}

const CHUNK: usize = 1 << 16;

/// Fills `out` with normal(0, std) draws from the stream of (seed, name).
pub(crate) fn fill_normal(out: &mut [f32], seed: u64, name: &str, std: f32) {
    let base = stream_seed(seed, name);
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(k, chunk)| {
            let mut rng = SplitMix64(base ^ (k as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            // Box-Muller: z0 = r cos(t), z1 = r sin(t), r = sqrt(-2 ln u1), t = 2 pi u2.
            for pair in chunk.chunks_mut(2) {
                let r = (-2.0 * next_unit(&mut rng).ln()).sqrt();
                let t = std::f64::consts::TAU * next_unit(&mut rng);
                pair[0] = (r * t.cos()) as f32 * std;
                if pair.len() > 1 {
                    pair[1] = (r * t.sin()) as f32 * std;
                }
            }
        });
}

/// Random weights for `cfg`: normal(0, `std`) matrices and embedding, unit norms, zero biases.
pub fn random_weights(cfg: &Config, seed: u64, std: f32) -> Weights {
    let mut weights = Weights::new();
    for spec in expected_tensors(cfg) {
        let mut t = Tensor::zeros(spec.shape.clone());
        match spec.role {
            Role::Embedding | Role::Matrix => fill_normal(&mut t.data, seed, &spec.name, std),
            Role::Norm => t.data.fill(1.0),
            Role::Bias => {}
        }
        weights.insert(spec.name, t);
    }
    weights
}

/// Which HF architecture to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Like {
    Qwen2,
    Llama,
    Qwen3,
}

impl From<Like> for Arch {
    fn from(like: Like) -> Arch {
        match like {
            Like::Qwen2 => Arch::Qwen2,
            Like::Llama => Arch::Llama,
            Like::Qwen3 => Arch::Qwen3,
        }
    }
}

/// `tandem init-model`: write a randomly initialised model in HF layout.
#[derive(Args, Debug, Clone)]
pub struct InitModelArgs {
    /// Architecture to imitate (config.json `architectures`).
    #[arg(long, value_enum)]
    pub like: Like,
    /// Number of decoder layers.
    #[arg(long)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long)]
    pub hidden: usize,
    /// Attention heads.
    #[arg(long)]
    pub heads: usize,
    /// Key/value heads (GQA); defaults to --heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Per-head dimension; defaults to hidden / heads.
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// MLP intermediate size.
    #[arg(long)]
    pub ffn: usize,
    /// Vocabulary size (rows of the embedding); defaults to the tokenizer's size with --tokenizer.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Copy this directory's tokenizer files; without it a byte-level BPE tokenizer is generated.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tie lm_head to the embedding (default: true for qwen2/qwen3, false for llama).
    #[arg(long, action = ArgAction::Set)]
    pub tie: Option<bool>,
    /// RoPE base (default: 1000000 for qwen2/qwen3, 500000 for llama).
    #[arg(long)]
    pub rope_theta: Option<f32>,
    /// RMSNorm epsilon (default: 1e-6 for qwen2/qwen3, 1e-5 for llama).
    #[arg(long)]
    pub rms_norm_eps: Option<f32>,
    /// max_position_embeddings written to config.json.
    #[arg(long, default_value_t = 32768)]
    pub max_position: usize,
    /// Standard deviation of the normal init of matrices and embedding.
    #[arg(long, default_value_t = 0.02)]
    pub init_std: f32,
    /// Seed: the same seed and flags give byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (written as OUT.tmp, then renamed).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace OUT if it already exists.
    #[arg(long)]
    pub force: bool,
}

/// Special token ids of a tokenizer directory: eos (and bos) from its generation_config.json or
/// config.json when present, else the `eos_token`/`bos_token` of tokenizer_config.json.
fn tokenizer_specials(dir: &Path, tok: &tokenizers::Tokenizer) -> Result<(Vec<u32>, Option<u32>)> {
    let read = |name: &str| -> Result<Option<Value>> {
        let p = dir.join(name);
        if !p.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&p)
            .map_err(|e| input_error(format!("{}: cannot read: {e}", p.display())))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| input_error(format!("{}: invalid JSON: {e}", p.display())))
    };
    let ids = |v: Option<&Value>| -> Vec<u32> {
        match v {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            None => vec![],
        }
    };
    let mut eos = Vec::new();
    let mut bos = None;
    for name in [GENERATION_CONFIG_FILE, CONFIG_FILE] {
        if let Some(v) = read(name)? {
            for id in ids(v.get("eos_token_id")) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
            bos = bos.or(ids(v.get("bos_token_id")).first().copied());
        }
    }
    if let Some(v) = read("tokenizer_config.json")? {
        // The token is a string, or an AddedToken object with a "content" field.
        let token = |key: &str| -> Option<u32> {
            let t = v.get(key)?;
            let s = t.as_str().or_else(|| t.get("content")?.as_str())?;
            tok.token_to_id(s)
        };
        if eos.is_empty() {
            eos.extend(token("eos_token"));
        }
        bos = bos.or(token("bos_token"));
    }
    Ok((eos, bos))
}

fn config_from_args(args: &InitModelArgs, vocab: usize) -> Result<Config> {
    let arch: Arch = args.like.into();
    let positive = [
        ("--layers", args.layers),
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--ffn", args.ffn),
        ("--max-position", args.max_position),
    ];
    for (flag, v) in positive {
        if v == 0 {
            crate::bail_input!("{flag} must be positive");
        }
    }
    let kv_heads = args.kv_heads.unwrap_or(args.heads);
    if kv_heads == 0 || !args.heads.is_multiple_of(kv_heads) {
        crate::bail_input!(
            "--kv-heads {kv_heads} must be positive and divide --heads {}",
            args.heads
        );
    }
    let head_dim = match args.head_dim {
        Some(d) => d,
        None if args.hidden.is_multiple_of(args.heads) => args.hidden / args.heads,
        None => crate::bail_input!(
            "--hidden {} is not divisible by --heads {} (give --head-dim)",
            args.hidden,
            args.heads
        ),
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        crate::bail_input!("--head-dim {head_dim} must be positive and even (RoPE rotates pairs)");
    }
    let qwen = arch != Arch::Llama;
    let rope_theta = args
        .rope_theta
        .unwrap_or(if qwen { 1_000_000.0 } else { 500_000.0 });
    let rms_norm_eps = args.rms_norm_eps.unwrap_or(if qwen { 1e-6 } else { 1e-5 });
    for (flag, v) in [
        ("--rope-theta", rope_theta),
        ("--rms-norm-eps", rms_norm_eps),
        ("--init-std", args.init_std),
    ] {
        if !(v.is_finite() && v > 0.0) {
            crate::bail_input!("{flag} must be a positive number, got {v}");
        }
    }
    Ok(Config {
        arch,
        vocab_size: vocab,
        hidden_size: args.hidden,
        intermediate_size: args.ffn,
        num_layers: args.layers,
        num_heads: args.heads,
        num_kv_heads: kv_heads,
        head_dim,
        rope_theta,
        rms_norm_eps,
        tie_word_embeddings: args.tie.unwrap_or(qwen),
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: args.max_position,
        bos_token_id: None,
        eos_token_ids: vec![],
        value_head: false,
    })
}

/// Runs `tandem init-model`.
pub fn run(args: InitModelArgs) -> Result<()> {
    if args.out.exists() && !args.force {
        let empty = args.out.is_dir()
            && std::fs::read_dir(&args.out)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if !empty {
            crate::bail_input!(
                "{}: already exists (give --force to replace it)",
                args.out.display()
            );
        }
    }
    let mut generated = Vec::new();
    let (cfg, tok_note) = match &args.tokenizer {
        Some(dir) => {
            let path = dir.join("tokenizer.json");
            if !path.is_file() {
                crate::bail_input!(
                    "{}: not found (--tokenizer needs a directory with tokenizer.json)",
                    path.display()
                );
            }
            let tok = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
                input_error(format!("{}: cannot load tokenizer: {e}", path.display()))
            })?;
            let len = tok.get_vocab_size(true);
            let vocab = args.vocab.unwrap_or(len);
            if vocab < len {
                crate::bail_input!(
                    "--vocab {vocab} is smaller than the tokenizer in {} ({len} tokens)",
                    dir.display()
                );
            }
            let mut cfg = config_from_args(&args, vocab)?;
            let (eos, bos) = tokenizer_specials(dir, &tok)?;
            cfg.eos_token_ids = eos
                .into_iter()
                .filter(|&id| (id as usize) < vocab)
                .collect();
            cfg.bos_token_id = bos.filter(|&id| (id as usize) < vocab);
            (cfg, format!("copied from {} ({len} tokens)", dir.display()))
        }
        None => {
            let Some(vocab) = args.vocab else {
                crate::bail_input!("--vocab is required when no --tokenizer is given");
            };
            let tok = crate::tokenizer::bytes::build(vocab)?;
            let mut cfg = config_from_args(&args, vocab)?;
            cfg.eos_token_ids = vec![tok.im_end_id, tok.endoftext_id];
            generated = tok.files()?;
            (
                cfg,
                format!("generated byte-level BPE ({} tokens)", tok.len),
            )
        }
    };
    let weights = random_weights(&cfg, args.seed, args.init_std);
    let opts = SaveOptions {
        tokenizer_from: args.tokenizer.as_deref(),
        // A random model owes nothing to the tokenizer directory's config.
        config_base: None,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        extra_files: &generated,
        move_in: &[],
    };
    ModelDir::save_with(&args.out, &cfg, &weights, &opts)?;
    let params = param_count(&cfg);
    println!(
        "wrote {}: {} with {} layers, hidden {}, {} heads ({} kv, head_dim {}), ffn {}, vocab {}, {} parameters ({:.1} MB bf16); tokenizer {}",
        args.out.display(),
        cfg.arch.hf_architecture(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        params,
        params as f64 * 2.0 / 1e6,
        tok_note
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(arch: Arch) -> Config {
        Config {
            arch,
            vocab_size: 300,
            hidden_size: 32,
            intermediate_size: 48,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch == Arch::Qwen3,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            value_head: false,
        }
    }

    #[test]
    fn normal_draws_have_the_asked_moments_and_repeat() {
        let mut a = vec![0.0f32; 200_001];
        fill_normal(&mut a, 7, "w", 0.02);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        // Standard errors: mean 0.02/sqrt(n) = 4.5e-5, std about 3e-5.
        assert!(mean.abs() < 2e-4, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "{}", var.sqrt());
        // About 4.55% of normal draws lie beyond 2 sigma.
        let tail = a.iter().filter(|x| x.abs() > 0.04).count() as f64 / n;
        assert!((tail - 0.0455).abs() < 0.003, "{tail}");
        let mut b = vec![0.0f32; a.len()];
        fill_normal(&mut b, 7, "w", 0.02);
        assert_eq!(a, b);
        fill_normal(&mut b, 8, "w", 0.02);
        assert_ne!(a, b);
        fill_normal(&mut b, 7, "v", 0.02);
        assert_ne!(a, b);
    }

    #[test]
    fn random_weights_follow_roles() {
        let c = cfg(Arch::Qwen2);
        let w = random_weights(&c, 3, 0.02);
        assert_eq!(w.len(), expected_tensors(&c).len());
        assert!(w["model.norm.weight"].data.iter().all(|&x| x == 1.0));
        assert!(w["model.layers.1.self_attn.k_proj.bias"]
            .data
            .iter()
            .all(|&x| x == 0.0));
        let q = &w["model.layers.0.self_attn.q_proj.weight"].data;
        assert!(q.iter().any(|&x| x != 0.0) && q.iter().all(|x| x.abs() < 0.2));
        // Layers draw from their own streams.
        assert_ne!(q, &w["model.layers.1.self_attn.q_proj.weight"].data);
        // The same layer is the same whatever the depth of the model.
        let mut deeper = c.clone();
        deeper.num_layers = 3;
        assert_eq!(
            q,
            &random_weights(&deeper, 3, 0.02)["model.layers.0.self_attn.q_proj.weight"].data
        );
        let q3 = random_weights(&cfg(Arch::Qwen3), 3, 0.02);
        assert!(q3["model.layers.0.self_attn.q_norm.weight"]
            .data
            .iter()
            .all(|&x| x == 1.0));
    }
}
