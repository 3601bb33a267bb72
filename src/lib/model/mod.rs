//! Model files and the decoder: config.json, safetensors load/save (HF layout), random init.

pub mod config;
pub mod decoder;
pub mod tensor;

pub use config::{Arch, Config};
pub use tensor::{Tensor, Weights};
