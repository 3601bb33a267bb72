//! The integration tests, one module per file of tests/, built as one test binary: each test
//! binary links every dependency, and one link instead of one per file is most of a fresh
//! `make test`'s build time. Cargo.toml turns off the discovery of one binary per file
//! (`autotests = false`); `every_test_file_is_built` below fails on a file left out.
//!
//! Run one file's tests with `cargo test --test integration FILE::` (e.g. `stages::`), one test
//! with `cargo test --test integration NAME`.
//!
//! tests/shard_memory.rs stays a binary of its own: it counts the allocations of its whole
//! process, which the tests of the other files would add to.

mod common;
mod stage_util;

mod advantage;
mod agent;
mod agent_cmd;
mod agent_compare;
mod async_rl;
mod batch;
mod bench_decoder;
mod bench_rollout;
mod cli;
mod critic;
mod daemon;
mod dapo;
mod decoder;
mod demo;
mod dist;
mod docs;
mod dp;
mod gguf;
mod gradcheck;
mod gsm8k_placed;
mod hf_logprobs;
mod layers;
mod learning;
mod lora;
mod lora_unmerged;
mod model_files;
mod pipeline;
mod prepare;
mod remax;
mod rollout_corr;
mod rollout_paged;
mod score;
mod serve;
mod shard;
mod stages;
mod tensorboard;
mod tools;

/// Every tests/*.rs file is a module above or a `[[test]]` of Cargo.toml: with discovery off,
/// a new file named nowhere would silently never run.
#[test]
fn every_test_file_is_built() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let (this, manifest) = (read("tests/integration.rs"), read("Cargo.toml"));
    let mut left_out = Vec::new();
    for e in std::fs::read_dir(root.join("tests")).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        let as_module = this.lines().any(|l| l == format!("mod {module};"));
        let as_target = manifest.contains(&format!("path = \"tests/{name}\""));
        if !as_module && !as_target {
            left_out.push(name);
        }
    }
    assert!(
        left_out.is_empty(),
        "not built (add `mod NAME;` to tests/integration.rs): {left_out:?}"
    );
}
