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

/// The runs of equal neighbouring keys (a group's rows are contiguous by `prompt_uid`), as row
/// ranges in order.
pub(crate) fn runs<T: PartialEq>(keys: &[T]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for end in 1..=keys.len() {
        if end == keys.len() || keys[end] != keys[start] {
            out.push(start..end);
            start = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_are_the_neighbouring_equal_keys() {
        assert_eq!(super::runs(&["a", "a", "b", "a"]), [0..2, 2..3, 3..4]);
        assert!(super::runs::<u8>(&[]).is_empty());
    }
}
