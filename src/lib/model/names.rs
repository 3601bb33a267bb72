//! The HF tensor names and shapes a [`Config`] implies, in one place.
//!
//! The order is the order of HF's `state_dict()` (module registration order), so that a sharded
//! save splits the tensors exactly where `save_pretrained` would.

use super::config::Config;

/// What a tensor is, which decides how it is initialised and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
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
    pub shape: Vec<usize>,
    pub role: Role,
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// Prefix of layer `i`'s tensors: `model.layers.{i}.`
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}.")
}

/// Every tensor a model with this config has, with its shape, in HF state-dict order.
/// A tied model has no `lm_head.weight` (HF does not save it either).
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
    if !cfg.tie_word_embeddings {
        push(LM_HEAD.into(), vec![cfg.vocab_size, h], Role::Matrix);
    }
    out
}

/// Tensors that HF checkpoints may carry but that no model needs: HF drops them on load too
/// (`lm_head.weight` of a tied model, old Llama checkpoints' rotary `inv_freq` buffers).
pub fn is_ignorable(cfg: &Config, name: &str) -> bool {
    (cfg.tie_word_embeddings && name == LM_HEAD) || name.ends_with(".rotary_emb.inv_freq")
}

/// Number of parameters the config implies (tied embeddings counted once).
pub fn param_count(cfg: &Config) -> usize {
    expected_tensors(cfg)
        .iter()
        .map(|t| t.shape.iter().product::<usize>())
        .sum()
}
