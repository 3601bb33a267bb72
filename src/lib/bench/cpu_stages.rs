//! `tandem bench cpu-stages`: the two model-free stages on a batch of 32,768 sequences x 1,024
//! response tokens. Runs the real binaries as a user would and, separately, times the Parquet
//! read and write of the same files to show their share.

use super::synth::{rollout_batch, SynthSpec};
use crate::batch::{write_file, Batch};
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Args, Debug)]
pub(crate) struct CpuStagesArgs {
    #[arg(long, default_value_t = 32_768)]
    pub(crate) rows: usize,
    #[arg(long, default_value_t = 1_024)]
    pub(crate) tokens: usize,
    /// Samples per prompt (GRPO group size).
    #[arg(long, default_value_t = 8)]
    pub(crate) group: usize,
    /// Where the batch files go (default: a temp dir, removed afterwards).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
}

/// A sibling binary of the running one (target/release/score next to target/release/tandem).
pub(crate) fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} not found next to {}: build all binaries (make build)",
        name,
        exe.display()
    );
    Ok(path)
}

fn timed_run(cmd: &mut Command) -> Result<f64> {
    let t = Instant::now();
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(status.success(), "{cmd:?} failed with {status}");
    Ok(t.elapsed().as_secs_f64())
}

/// Time reading `input` and writing it back (the I/O any stage pays on this batch).
fn io_seconds(input: &Path, scratch: &Path) -> Result<(f64, f64)> {
    let t = Instant::now();
    let b = Batch::read(input, &[])?;
    let read = t.elapsed().as_secs_f64();
    let t = Instant::now();
    write_file(scratch, &b.data, &BTreeMap::new())?;
    let write = t.elapsed().as_secs_f64();
    std::fs::remove_file(scratch)?;
    Ok((read, write))
}

pub fn run(a: CpuStagesArgs) -> Result<()> {
    let tmp;
    let dir = match &a.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            tmp = TempDir::new()?;
            tmp.0.clone()
        }
    };
    let rollout = dir.join("rollout.parquet");
    let scored = dir.join("scored.parquet");
    let adv = dir.join("adv.parquet");
    eprintln!(
        "generating {} rows x {} tokens in {}",
        a.rows,
        a.tokens,
        dir.display()
    );
    let data = rollout_batch(&SynthSpec {
        rows: a.rows,
        response_tokens: a.tokens,
        prompt_tokens: 128,
        group: a.group,
        seed: 7,
    });
    write_file(&rollout, &data, &BTreeMap::new())?;
    drop(data);

    let score_s = timed_run(
        Command::new(sibling_binary("score")?)
            .args(["--in"])
            .arg(&rollout)
            .arg("--out")
            .arg(&scored)
            .args(["--reward", "gsm8k"]),
    )?;
    let adv_s = timed_run(
        Command::new(sibling_binary("advantage")?)
            .arg("--in")
            .arg(&scored)
            .arg("--out")
            .arg(&adv)
            .args(["--estimator", "grpo"]),
    )?;
    let (score_read, score_write) = io_seconds(&rollout, &dir.join("io-check.parquet"))?;
    let (adv_read, adv_write) = io_seconds(&scored, &dir.join("io-check.parquet"))?;

    let tokens = (a.rows * a.tokens) as f64;
    let mut rows = Vec::new();
    let mut js = Vec::new();
    for (stage, secs, read, write) in [
        ("score --reward gsm8k", score_s, score_read, score_write),
        ("advantage --estimator grpo", adv_s, adv_read, adv_write),
    ] {
        let share = (read + write) / secs;
        rows.push(vec![
            stage.to_string(),
            format!("{secs:.2}"),
            format!("{:.0}", a.rows as f64 / secs),
            format!("{:.2}M", tokens / secs / 1e6),
            format!("{read:.2}"),
            format!("{write:.2}"),
            format!("{:.0}%", 100.0 * share.min(1.0)),
        ]);
        js.push(json!({"stage": stage, "seconds": secs, "rows_per_s": a.rows as f64 / secs, "tokens_per_s": tokens / secs,
            "parquet_read_s": read, "parquet_write_s": write, "parquet_share": share}));
    }
    super::report(
        &format!(
            "bench cpu-stages: {} rows x {} response tokens, {} threads",
            a.rows,
            a.tokens,
            rayon::current_num_threads()
        ),
        &[
            "stage",
            "seconds",
            "rows/s",
            "tokens/s",
            "read s",
            "write s",
            "parquet share",
        ],
        &rows,
        &json!({"bench": "cpu-stages", "rows": a.rows, "tokens": a.tokens, "results": js}),
    );
    Ok(())
}

/// A temp directory removed on drop (benchmarks only; tests use the tempfile crate).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        let p = std::env::temp_dir().join(format!("tandem-bench-{}", std::process::id()));
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
