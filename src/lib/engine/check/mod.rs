//! The whole-decoder and whole-engine cases of `tandem gpu-test` (the op-level ones are in
//! `backend::cuda::parity`): each runs the decoder or the generation engine on the GPU and
//! records rows in the same suite and table. The runner (`bench::gpu_test`) walks [`cases`]
//! after the op cases; `--only` filters on the names below.

mod decoder;
mod paged;

use anyhow::Result;
use std::path::PathBuf;

use crate::backend::cuda::parity::{compare, Suite};
use crate::backend::sample::sample_key;
use crate::backend::DType;
use crate::engine::paged::Request;
use crate::model::{Arch, Config, Weights};

/// What the engine-level cases read besides the suite.
#[derive(Clone, Debug)]
pub struct Opts {
    /// The tiny HF models with transformers' log-probs (`hf_fixtures`).
    pub hf_fixtures: PathBuf,
}

/// An engine-level check: runs on the suite for one storage dtype and adds its rows.
pub type Case<'g> = fn(&mut Suite<'g>, &Opts, DType) -> Result<()>;

/// The engine-level checks by name, in table order.
pub fn cases<'g>() -> Vec<(&'static str, Case<'g>)> {
    vec![
        ("decoder", decoder::decoder),
        ("hf_fixtures", decoder::hf_fixtures),
        ("paged_generate", paged::paged_generate),
        ("paged_graphs", paged::paged_graphs),
        ("rollout_agreement", paged::rollout_agreement),
        ("fused_decode", paged::fused_decode),
    ]
}

/// The 2-layer model of the decoder-level checks (vocabulary 1000, hidden 256, 4/2 heads of 64),
/// with the architecture's own options.
fn tiny_config(arch: Arch) -> Config {
    Config {
        arch,
        vocab_size: 1000,
        hidden_size: 256,
        intermediate_size: 512,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: arch != Arch::Llama,
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: 4096,
        bos_token_id: None,
        eos_token_ids: vec![0],
    }
}

/// `prompts` requests of `min_len..min_len + span` random tokens (ids below 1000, the tiny
/// models' vocabulary), `samples` sampling keys each.
fn random_requests(
    s: &mut Suite,
    prompts: usize,
    min_len: usize,
    span: usize,
    samples: u64,
) -> Vec<Request> {
    (0..prompts as u64)
        .map(|i| {
            let len = min_len + s.rng.below(span);
            let prompt: Vec<u32> = (0..len).map(|_| s.rng.below(1000) as u32).collect();
            Request {
                sample_keys: (0..samples).map(|k| sample_key(i, &prompt, 0, k)).collect(),
                prompt,
            }
        })
        .collect()
}

/// All tensors of a weight map, in name order, as one vector.
fn flat(w: &Weights) -> Vec<f32> {
    w.values().flat_map(|t| t.data.iter().copied()).collect()
}

/// The tensor whose relative error is worst, and that error.
fn worst_tensor(gpu: &Weights, cpu: &Weights) -> (String, f64) {
    let mut worst = (String::new(), 0.0);
    for (name, c) in cpu {
        if let Some(g) = gpu.get(name) {
            let (_, r, _) = compare(&g.data, &c.data, &[]);
            if r > worst.1 || r.is_nan() {
                worst = (name.clone(), r);
            }
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_are_unique_and_distinct_from_the_op_cases() {
        let ops: Vec<&str> = crate::backend::cuda::parity::op_cases()
            .iter()
            .map(|c| c.0)
            .collect();
        let mut names: Vec<&str> = cases().iter().map(|c| c.0).collect();
        assert_eq!(names.len(), 6);
        names.extend(&ops);
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a check name appears twice");
    }

    #[test]
    fn worst_tensor_names_the_largest_relative_error() {
        use crate::model::Tensor;
        let t = |v: Vec<f32>| Tensor {
            shape: vec![v.len()],
            data: v,
        };
        let cpu: Weights = [
            ("a".to_string(), t(vec![1.0, 2.0])),
            ("b".into(), t(vec![10.0])),
        ]
        .into_iter()
        .collect();
        let gpu: Weights = [
            ("a".to_string(), t(vec![1.0, 2.2])),
            ("b".into(), t(vec![10.5])),
        ]
        .into_iter()
        .collect();
        let (name, r) = worst_tensor(&gpu, &cpu);
        // a: 0.2 / 2 = 0.1; b: 0.5 / 10 = 0.05.
        assert_eq!(name, "a");
        assert!((r - 0.1).abs() < 1e-6, "{r}");
        assert_eq!(flat(&cpu), vec![1.0, 2.0, 10.0]);
    }
}
