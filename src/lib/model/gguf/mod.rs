//! GGUF (llama.cpp) model files: reading, dequantizing, and importing them as HF model
//! directories with a rebuilt tokenizer.

pub mod import;
pub mod quant;
pub mod reader;
pub mod tokenizer;

pub use import::{run, ImportGgufArgs};
pub use reader::GgufFile;
