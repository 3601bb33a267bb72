//! Tiny decoder configs and random weights (HF names) for the decoder tests and benchmarks.
#![allow(dead_code)]

use tandem::backend::check::Rng;
use tandem::model::{Arch, Config, Tensor, Weights};

/// The sizes of a test model.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// A config of the given architecture and sizes with the shape flags HF uses for it.
pub fn config(arch: Arch, dims: Dims, tied: bool) -> Config {
    Config {
        arch,
        vocab_size: dims.vocab,
        hidden_size: dims.hidden,
        intermediate_size: dims.ffn,
        num_layers: dims.layers,
        num_heads: dims.heads,
        num_kv_heads: dims.kv_heads,
        head_dim: dims.head_dim,
        rope_theta: if arch == Arch::Llama {
            500000.0
        } else {
            1000000.0
        },
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
        qkv_bias: arch == Arch::Qwen2,
        qk_norm: arch == Arch::Qwen3,
        max_position_embeddings: 4096,
        bos_token_id: None,
        eos_token_ids: vec![0],
        value_head: false,
    }
}

/// Tiny models of the three architectures: Qwen2 tied with qkv bias, Llama with a separate
/// head, Qwen3 with q/k norm and a head_dim that is not hidden/heads.
pub fn tiny(arch: Arch) -> Config {
    match arch {
        Arch::Qwen2 => config(
            arch,
            Dims {
                vocab: 37,
                hidden: 16,
                ffn: 24,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 4,
            },
            true,
        ),
        Arch::Llama => config(
            arch,
            Dims {
                vocab: 41,
                hidden: 12,
                ffn: 20,
                layers: 2,
                heads: 3,
                kv_heads: 1,
                head_dim: 4,
            },
            false,
        ),
        Arch::Qwen3 => config(
            arch,
            Dims {
                vocab: 29,
                hidden: 16,
                ffn: 20,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 6,
            },
            true,
        ),
    }
}

/// Random weights under HF names: normal(0, std) matrices, norms near 1.
pub fn random_weights(cfg: &Config, seed: u64) -> Weights {
    let mut rng = Rng::new(seed);
    let mut w = Weights::new();
    let mut put = |name: String, shape: Vec<usize>, std: f32, mean: f32| {
        let n = shape.iter().product();
        let data = (0..n).map(|_| mean + std * rng.normal()).collect();
        w.insert(name, Tensor::new(shape, data));
    };
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (qd, kd) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    put("model.embed_tokens.weight".into(), vec![v, d], 1.0, 0.0);
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}.");
        put(format!("{p}input_layernorm.weight"), vec![d], 0.1, 1.0);
        put(
            format!("{p}post_attention_layernorm.weight"),
            vec![d],
            0.1,
            1.0,
        );
        for (name, out) in [("q_proj", qd), ("k_proj", kd), ("v_proj", kd)] {
            put(
                format!("{p}self_attn.{name}.weight"),
                vec![out, d],
                lin(d),
                0.0,
            );
            if cfg.qkv_bias {
                put(format!("{p}self_attn.{name}.bias"), vec![out], 0.1, 0.0);
            }
        }
        if cfg.qk_norm {
            put(
                format!("{p}self_attn.q_norm.weight"),
                vec![cfg.head_dim],
                0.1,
                1.0,
            );
            put(
                format!("{p}self_attn.k_norm.weight"),
                vec![cfg.head_dim],
                0.1,
                1.0,
            );
        }
        put(
            format!("{p}self_attn.o_proj.weight"),
            vec![d, qd],
            lin(qd),
            0.0,
        );
        put(format!("{p}mlp.gate_proj.weight"), vec![f, d], lin(d), 0.0);
        put(format!("{p}mlp.up_proj.weight"), vec![f, d], lin(d), 0.0);
        put(format!("{p}mlp.down_proj.weight"), vec![d, f], lin(f), 0.0);
    }
    put("model.norm.weight".into(), vec![d], 0.1, 1.0);
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), vec![v, d], lin(d), 0.0);
    }
    w
}

/// `n` random token ids below `vocab`.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// Checks the gradients `grads` (by tensor name) against central finite differences of `loss`
/// at `params`, along one random direction u per tensor: (L(θ + εu) − L(θ − εu)) / 2ε against
/// ⟨∇L, u⟩, with a relative error (to max(|⟨∇L, u⟩|, 0.1)) under 2e-2. `what` names the case
/// in failures; returns the worst relative error.
pub fn check_finite_differences(
    what: &str,
    grads: &Weights,
    params: &Weights,
    loss: impl Fn(&Weights) -> f64,
) -> f64 {
    let eps = 1e-3f32;
    let mut rng = Rng::new(99);
    let mut worst = 0f64;
    for (name, g) in grads {
        let u: Vec<f32> = (0..g.numel()).map(|_| rng.normal()).collect();
        let an: f64 = g
            .data
            .iter()
            .zip(&u)
            .map(|(&g, &u)| g as f64 * u as f64)
            .sum();
        let eval = |sign: f32| {
            let mut w = params.clone();
            let t = w.get_mut(name).unwrap();
            t.data
                .iter_mut()
                .zip(&u)
                .for_each(|(x, u)| *x += sign * eps * u);
            loss(&w)
        };
        let fd = (eval(1.0) - eval(-1.0)) / (2.0 * eps as f64);
        let err = (fd - an).abs() / an.abs().max(0.1);
        worst = worst.max(err);
        assert!(
            err < 2e-2,
            "{what} {name}: analytic {an:.6} vs finite difference {fd:.6}"
        );
    }
    worst
}
