//! Tokenizers, below the model and the data that use them.
//!
//! - `hf`: [`Tokenizer`], a model's HF `tokenizer.json` through the `tokenizers` crate (what
//!   rollout, the SFT batch and the preflight encode and decode with).
//! - `bytes`: the byte-level BPE generated for random models (`tandem init-model`).
//! - `gguf`: `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF file's
//!   `tokenizer.ggml.*` keys (`tandem import-gguf`).

pub mod bytes;
pub mod gguf;
pub(crate) mod hf;

pub use hf::Tokenizer;
pub(crate) use hf::TOKENIZER_FILE;
