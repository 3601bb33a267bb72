//! The decoder's hyper-parameters, read from (and written to) an HF `config.json`.

use serde::{Deserialize, Serialize};

/// Which HF architecture a model directory holds. One decoder serves all three; the
/// differences are flags below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// `Qwen2ForCausalLM`: bias on q/k/v projections.
    Qwen2,
    /// `LlamaForCausalLM`: no biases.
    Llama,
    /// `Qwen3ForCausalLM`: RMSNorm on q and k per head, explicit head_dim.
    Qwen3,
}

/// Everything the decoder needs to know about the model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids (config.json and generation_config.json together).
    pub eos_token_ids: Vec<u32>,
}
