//! The HF tensor names and shapes a [`Config`] implies, in one place.
//!
//! The order is the order of HF's `state_dict()` (module registration order), so that a sharded
//! save splits the tensors exactly where `save_pretrained` would.

use super::config::Config;

/// What a tensor is, which decides how it is initialised and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Token embedding table `[vocab, hidden]`.
    Embedding,
    /// A linear layer's weight `[out, in]` (HF/torch layout).
    Matrix,
    /// A linear layer's bias `[out]`.
    Bias,
    /// An RMSNorm scale.
    Norm,
}

/// One tensor a model must have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) role: Role,
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";
/// A value model's head (HF's token classifier with one label): `score.weight` [1, hidden] and
/// `score.bias` [1].
pub const VALUE_HEAD: &str = "score.weight";
pub const VALUE_BIAS: &str = "score.bias";

/// Prefix of layer `i`'s tensors: `model.layers.{i}.`
pub(crate) fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}.")
}

/// Every tensor a model with this config has, with its shape, in HF state-dict order.
/// A tied model has no `lm_head.weight` (HF does not save it either); a value model has its
/// `score` head instead.
pub fn expected_tensors(cfg: &Config) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let d = cfg.head_dim;
    let q = cfg.num_heads * d;
    let kv = cfg.num_kv_heads * d;
    let f = cfg.intermediate_size;
    let mut out = Vec::with_capacity(2 + cfg.num_layers * 15);
    let mut push =
        |name: String, shape: Vec<usize>, role: Role| out.push(TensorSpec { name, shape, role });
    push(EMBED.into(), vec![cfg.vocab_size, h], Role::Embedding);
    for i in 0..cfg.num_layers {
        let p = layer_prefix(i);
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            push(
                format!("{p}self_attn.{proj}.weight"),
                vec![rows, h],
                Role::Matrix,
            );
            if cfg.qkv_bias {
                push(format!("{p}self_attn.{proj}.bias"), vec![rows], Role::Bias);
            }
        }
        push(
            format!("{p}self_attn.o_proj.weight"),
            vec![h, q],
            Role::Matrix,
        );
        if cfg.qk_norm {
            push(format!("{p}self_attn.q_norm.weight"), vec![d], Role::Norm);
            push(format!("{p}self_attn.k_norm.weight"), vec![d], Role::Norm);
        }
        push(format!("{p}mlp.gate_proj.weight"), vec![f, h], Role::Matrix);
        push(format!("{p}mlp.up_proj.weight"), vec![f, h], Role::Matrix);
        push(format!("{p}mlp.down_proj.weight"), vec![h, f], Role::Matrix);
        push(format!("{p}input_layernorm.weight"), vec![h], Role::Norm);
        push(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            Role::Norm,
        );
    }
    push(FINAL_NORM.into(), vec![h], Role::Norm);
    if cfg.value_head {
        push(VALUE_HEAD.into(), vec![1, h], Role::Matrix);
        push(VALUE_BIAS.into(), vec![1], Role::Bias);
    } else if !cfg.tie_word_embeddings {
        push(LM_HEAD.into(), vec![cfg.vocab_size, h], Role::Matrix);
    }
    out
}

/// Tensors that HF checkpoints may carry but that no model needs: HF drops them on load too
/// (`lm_head.weight` of a tied model, old Llama checkpoints' rotary `inv_freq` buffers).
pub(crate) fn is_ignorable(cfg: &Config, name: &str) -> bool {
    (cfg.tie_word_embeddings && name == LM_HEAD) || name.ends_with(".rotary_emb.inv_freq")
}

/// Number of parameters the config implies (tied embeddings counted once).
pub(crate) fn param_count(cfg: &Config) -> usize {
    expected_tensors(cfg)
        .iter()
        .map(|t| t.shape.iter().product::<usize>())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Arch;

    fn tiny(arch: Arch, tie: bool) -> Config {
        Config {
            arch,
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 12,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 3,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: tie,
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch == Arch::Qwen3,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            value_head: false,
        }
    }

    #[test]
    fn llama_names_shapes_and_count() {
        let specs = expected_tensors(&tiny(Arch::Llama, false));
        // embed + 2 x (q,k,v,o, gate,up,down, 2 norms) + norm + lm_head
        assert_eq!(specs.len(), 1 + 2 * 9 + 2);
        let get = |n: &str| specs.iter().find(|s| s.name == n).unwrap().shape.clone();
        assert_eq!(get("model.layers.1.self_attn.q_proj.weight"), vec![12, 8]);
        assert_eq!(get("model.layers.1.self_attn.k_proj.weight"), vec![6, 8]);
        assert_eq!(get("model.layers.0.self_attn.o_proj.weight"), vec![8, 12]);
        assert_eq!(get("model.layers.0.mlp.down_proj.weight"), vec![8, 12]);
        assert_eq!(get(LM_HEAD), vec![10, 8]);
        // 80 embed + per layer (96 + 48 + 48 + 96 + 3*96 + 16) + 8 + 80
        assert_eq!(
            param_count(&tiny(Arch::Llama, false)),
            80 + 2 * 592 + 8 + 80
        );
    }

    #[test]
    fn arch_flags_add_biases_and_qk_norms() {
        let q2 = expected_tensors(&tiny(Arch::Qwen2, true));
        assert!(q2.iter().all(|s| s.name != LM_HEAD));
        let biases: Vec<_> = q2.iter().filter(|s| s.role == Role::Bias).collect();
        assert_eq!(biases.len(), 6);
        assert_eq!(biases[0].name, "model.layers.0.self_attn.q_proj.bias");
        assert_eq!(biases[1].shape, vec![6]);
        let q3 = expected_tensors(&tiny(Arch::Qwen3, true));
        let qn: Vec<_> = q3
            .iter()
            .filter(|s| s.name.contains("_norm.weight") && s.name.contains("self_attn"))
            .collect();
        assert_eq!(qn.len(), 4);
        assert!(qn
            .iter()
            .all(|s| s.shape == vec![3] && s.role == Role::Norm));
        assert!(is_ignorable(&tiny(Arch::Qwen3, true), LM_HEAD));
        assert!(!is_ignorable(&tiny(Arch::Qwen3, false), LM_HEAD));
    }
}
