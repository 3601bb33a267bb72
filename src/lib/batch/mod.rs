//! The batch contract: schema (column names and types), reader with validation, writer with
//! metadata and atomic rename. Every stage goes through this module to touch a batch file.

pub mod json;
pub mod ragged;
pub mod read;
pub mod schema;
pub mod write;

pub use ragged::{list_array, Ragged};
pub use read::Batch;
pub use write::{stage_meta, write_file, write_json, NewColumns, StageInfo};
