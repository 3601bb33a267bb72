//! `sync-weights --from DIR --to POINTER` (file mode): publish a checkpoint as the policy the
//! next `rollout --model POINTER` uses. The pointer is a small JSON file
//! (`{"model": DIR, "policy_version": N}`) replaced atomically (write `POINTER.tmp`, rename), so
//! a reader sees the old or the new policy, never half of one; each sync bumps
//! `policy_version`, which rollout records in its output metadata. With `--daemon` the daemon
//! also makes the checkpoint its generation weights in memory (no file round trip), so the next
//! `rollout --daemon` does not load anything; the pointer is written all the same, so file mode
//! and resume keep working.

use super::common::{at_least, negative_numbers, require_tokenizer, Pointer};
use super::{Console, Hold};
use crate::bail_input;
use crate::batch::write_json;
use crate::model::checkpoint::ModelDir;
use anyhow::Result;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone, Serialize, Deserialize)]
#[command(
    about = "Publish a checkpoint as the current policy (atomic pointer swap)",
    mut_args = negative_numbers
)]
pub struct SyncWeightsArgs {
    /// The checkpoint directory (HF layout, e.g. written by `update --out-model`).
    #[arg(long, value_name = "DIR")]
    pub from: PathBuf,
    /// The pointer file to create or replace (e.g. RUN/policy).
    #[arg(long, value_name = "FILE")]
    pub to: PathBuf,
    /// Set this policy_version (>= 0) instead of the pointer's previous version + 1.
    #[arg(long, value_parser = at_least(0u64))]
    pub policy_version: Option<u64>,
    /// Also sync the warm daemon listening on this socket (default: $TANDEM_DAEMON).
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
}

/// What the pointer should name: relative to the pointer's directory when the checkpoint lies
/// beneath it (a run directory stays valid when moved), absolute otherwise.
fn pointer_target(from: &Path, to: &Path) -> Result<String> {
    let from_abs = from.canonicalize()?;
    let to_dir = match to.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d.canonicalize()?,
        None => std::env::current_dir()?,
    };
    let target = match from_abs.strip_prefix(&to_dir) {
        Ok(rel) if !rel.as_os_str().is_empty() => rel.to_path_buf(),
        _ => from_abs,
    };
    Ok(target.to_string_lossy().into_owned())
}

/// The stage; `exec` (the daemon) takes the new policy into memory.
pub fn run<E: Hold + Console + ?Sized>(args: SyncWeightsArgs, exec: &mut E) -> Result<()> {
    let started = Instant::now();
    if !args.from.is_dir() {
        bail_input!("--from {}: not a directory", args.from.display());
    }
    // A checkpoint that rollout could not load must not become the policy.
    ModelDir::load_config(&args.from)?;
    require_tokenizer(&args.from, "it would become the policy without a tokenizer")?;
    if args.to.is_dir() {
        bail_input!(
            "--to {}: is a directory; give the path of the pointer file to write (e.g. RUN/policy)",
            args.to.display()
        );
    }
    if let Some(dir) = args.to.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            bail_input!(
                "--to {}: directory {} does not exist",
                args.to.display(),
                dir.display()
            );
        }
    }
    let previous = if args.to.exists() {
        Some(Pointer::read(&args.to)?)
    } else {
        None
    };
    let version = match (args.policy_version, &previous) {
        (Some(v), _) => v,
        (None, Some(p)) => p.policy_version + 1,
        (None, None) => 1,
    };
    let ptr = Pointer {
        model: pointer_target(&args.from, &args.to)?,
        policy_version: version,
    };
    exec.publish(&args.from, version)?;
    write_json(&args.to, &ptr)?;
    exec.log(&format!(
        "sync-weights: {} -> {} (policy_version {}) in {:.3}s",
        args.to.display(),
        ptr.model,
        version,
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
