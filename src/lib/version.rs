//! The version every binary prints with `--version`: the package version and the git commit it
//! was built from (`build.rs` sets `TANDEM_COMMIT`: a short hash, `-dirty` when the tracked files
//! differed from it, or `unknown` when built outside a git checkout).

/// `0.1.0 (1a2b3c4)`, `0.1.0 (1a2b3c4-dirty)` or `0.1.0 (unknown)`.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TANDEM_COMMIT"), ")");
