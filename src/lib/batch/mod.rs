//! The batch contract: schema (column names and types), reader with validation, writer with
//! metadata and atomic rename. Every stage goes through this module to touch a batch file.

pub mod json;
pub(crate) mod ragged;
pub(crate) mod read;
pub mod schema;
pub mod write;

pub use ragged::list_array;
pub(crate) use ragged::Ragged;
pub use read::Batch;
pub(crate) use write::{stage_meta, write_json};
pub use write::{write_file, NewColumns, StageInfo};
