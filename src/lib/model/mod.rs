//! Model files and the decoder: config.json, safetensors load/save (HF layout), random init.

pub(crate) mod checkpoint;
pub(crate) mod config;
pub mod critic;
pub mod decoder;
pub mod gguf;
pub mod info;
pub mod init;
pub mod lora;
pub mod merge;
pub mod names;
pub mod peft;
pub mod safetensors;
pub(crate) mod tensor;

pub use checkpoint::{ModelDir, SaveOptions};
pub use config::{Arch, Config};
pub use tensor::{Tensor, Weights};
