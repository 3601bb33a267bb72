//! The whole-decoder and whole-engine cases of `tandem gpu-test` (the op-level ones are in the
//! op families' `check.rs`, `backend::ops::op_cases`): each runs the decoder or the generation
//! engine on the GPU and records rows on the same harness context ([`Ctx`]) and table. The
//! runner (`bench::gpu_test`) walks [`CASES`] after the op cases; `--only` filters on the names
//! below.

mod decoder;
mod lora;
mod paged;

use anyhow::Result;

use crate::backend::check::gpu::{compare, dname, Case, Ctx, Row};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::ops::sample::sample_key;
use crate::backend::DType;
use crate::engine::paged::Request;
use crate::model::decoder::{Decoder, SeqRef, TokenGrads, TokenStats};
use crate::model::{Arch, Config, Weights};

/// The engine-level checks, in table order.
pub const CASES: &[Case] = &[
    Case {
        name: "decoder",
        run: decoder::decoder,
    },
    Case {
        name: "value_model",
        run: decoder::value_model,
    },
    Case {
        name: "lora",
        run: lora::lora,
    },
    Case {
        name: "lora_merge",
        run: lora::lora_merge,
    },
    Case {
        name: "lora_unmerged",
        run: lora::lora_unmerged,
    },
    Case {
        name: "hf_fixtures",
        run: decoder::hf_fixtures,
    },
    Case {
        name: "paged_generate",
        run: paged::paged_generate,
    },
    Case {
        name: "paged_graphs",
        run: paged::paged_graphs,
    },
    Case {
        name: "rollout_agreement",
        run: paged::rollout_agreement,
    },
    Case {
        name: "fused_decode",
        run: paged::fused_decode,
    },
];

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
        value_head: false,
    }
}

/// `prompts` requests of `min_len..min_len + span` random tokens (ids below 1000, the tiny
/// models' vocabulary), `samples` sampling keys each.
fn random_requests(
    s: &mut Ctx,
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
                max_new: Vec::new(),
                sample_keys: (0..samples).map(|k| sample_key(i, &prompt, 0, k)).collect(),
                prompt,
            }
        })
        .collect()
}

/// The row of per-token values (`logprobs` of `TokenStats`) computed on the GPU against the CPU:
/// it passes when both have the same non-zero count and the relative error is within `tol`.
fn values_row(s: &mut Ctx, op: String, d: DType, gpu: &[TokenStats], cpu: &[TokenStats], tol: f64) {
    let cat = |v: &[TokenStats]| -> Vec<f32> {
        v.iter().flat_map(|t| t.logprobs.iter().copied()).collect()
    };
    let (g, c) = (cat(gpu), cat(cpu));
    let (a, r, p) = compare(&g, &c, &[]);
    s.rows.push(Row {
        op,
        dtype: dname(d),
        max_abs: a,
        max_rel: r,
        tol,
        pass: g.len() == c.len() && !c.is_empty() && p.is_none() && r <= tol,
        note: p.unwrap_or_default(),
    });
}

/// One backward of both decoders from the same random upstream gradients of the values in
/// `stats` (no entropy term); their gradients, (CPU, GPU).
fn backward_both(
    s: &mut Ctx,
    cpu: &mut Decoder<Cpu>,
    gpu: &mut Decoder<CudaBackend>,
    seqs: &[SeqRef],
    stats: &[TokenStats],
) -> Result<(Weights, Weights)> {
    let ups: Vec<Vec<f32>> = stats
        .iter()
        .map(|st| (0..st.logprobs.len()).map(|_| s.rng.normal()).collect())
        .collect();
    let mut loss = |_: &[TokenStats]| -> Result<Vec<TokenGrads>> {
        Ok(ups
            .iter()
            .map(|u| TokenGrads {
                dlogprobs: u.clone(),
                dentropy: None,
            })
            .collect())
    };
    cpu.forward_backward(seqs, 1.0, &mut loss)?;
    gpu.forward_backward(seqs, 1.0, &mut loss)?;
    Ok((cpu.export_grads()?, gpu.export_grads()?))
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
        let ops: Vec<&str> = crate::backend::ops::op_cases()
            .iter()
            .map(|c| c.name)
            .collect();
        let mut names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
        assert_eq!(names.len(), 10);
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
