//! Issue 40's 2-GPU GSM8K check (run on a lent machine with `bench/gsm8k_run.sh`): the
//! one-step-off spec is the on-policy run of one GPU with rollout and training placed on two,
//! plus the rollout correction that one step off needs, and it passes the pipeline's checks.

use crate::pipeline::{gsm8k_checkout, shipped_spec, text, PIPELINE};
use std::process::Command;

const ON_POLICY: &str = "pipelines/gsm8k-qwen2.5-coder-0.5b-onpolicy-cuda.toml";
const ONE_STEP_OFF: &str = "pipelines/gsm8k-qwen2.5-coder-0.5b-onestepoff-cuda.toml";

#[test]
fn the_one_step_off_spec_is_the_on_policy_run_placed_on_two_gpus() {
    let mut off = shipped_spec(ONE_STEP_OFF);
    let placement = off.remove("placement").unwrap();
    assert_eq!(off.remove("gpus").unwrap().as_integer(), Some(2));
    let update = off["update"].as_table_mut().unwrap();
    assert_eq!(update.remove("rollout-is").unwrap().as_str(), Some("token"));
    assert_eq!(off, shipped_spec(ON_POLICY));
    let p = placement.as_table().unwrap();
    assert_eq!(p["mode"].as_str(), Some("one-step-off"));
    assert_eq!(p["rollout-gpus"].as_array().unwrap().len(), 1);
    assert_eq!(p["train-gpus"].as_array().unwrap().len(), 1);
}

/// `pipeline run --dry-run` of the shipped spec on CPU "GPUs" (model and data stand-ins where it
/// reads them): every check passes, and the plan pairs step k's update with step k + 1's rollout
/// and sends the weights to the rollout group after each sync.
#[test]
fn the_one_step_off_spec_passes_the_pipeline_checks() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    gsm8k_checkout(w, "qwen2.5-coder-0.5b");
    let o = Command::new(PIPELINE)
        .current_dir(w)
        .args(["run", ONE_STEP_OFF, "--dry-run", "--steps", "3"])
        .args(["--device", "cpu", "--run-dir", "r"])
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("transfer --to r/rollout.sock"), "{out}");
    // Step 1's update runs in the background (`&`) beside step 2's rollout on the rollout group.
    let lines: Vec<&str> = out.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("/update ") && l.contains("step-0001/adv.parquet"))
        .unwrap_or_else(|| panic!("no step-1 update in {out}"));
    assert!(lines[at].ends_with(" &"), "{}", lines[at]);
    let next = lines[at + 1];
    assert!(
        next.contains("/rollout ") && next.contains("--out r/step-0002/rollout.parquet"),
        "{next}"
    );
    assert!(next.contains("--daemon r/rollout.sock"), "{next}");
}
