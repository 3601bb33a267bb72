//! GGUF (llama.cpp) model files: reading, dequantizing, and importing them as HF model
//! directories (the tokenizer rebuilt by `tokenizer::gguf`).

pub(crate) mod import;
pub mod quant;
pub(crate) mod reader;

pub use import::{run, ImportGgufArgs};
pub use reader::GgufFile;
