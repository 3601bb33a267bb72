//! `tandem gpu-test`: the CUDA parity suite. Every op of the CUDA backend against the CPU
//! backend (the op families' cases, `backend::ops::op_cases`), then the decoder and the
//! generation engine whole (`engine::check::CASES`), then the sharded optimizer against the
//! plain one (`engine::shard::check::CASES`), and the communicator at world size 1 through NCCL
//! (`parallel::check::GPU_CASES`), in f32 and in bf16 storage, as one table
//! (harness: `backend::check::gpu`); `--time` then times each op (the families' timing shapes,
//! `backend::check::timing`), `--compile-only` compiles every kernel with NVRTC and needs no
//! GPU (`make kernels-check`). It lives above the engine because its cases do.

use anyhow::{anyhow, bail, Result};
use std::path::PathBuf;
use std::time::Instant;

use crate::backend::check::gpu::{dname, print_table, Case, Ctx, DTYPES};
use crate::backend::check::timing;
use crate::backend::cuda::{nvrtc, CudaBackend};
use crate::backend::ops;
use crate::backend::Device;
use crate::engine::check;

#[derive(clap::Args, Debug, Clone)]
pub struct GpuTestArgs {
    /// GPU ordinal to test.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Run only the checks (and with --time, time only the ops) whose name contains this text.
    #[arg(long)]
    pub(crate) only: Option<String>,
    /// Seed of the random inputs (default: a fresh one, printed so a run can be replayed).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Only compile every kernel with NVRTC for --arch (needs libnvrtc, not a GPU).
    #[arg(long)]
    pub(crate) compile_only: bool,
    /// Target of --compile-only.
    #[arg(long, default_value = "sm_90")]
    pub(crate) arch: String,
    /// Also write the table as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// After the checks, time each op at the Qwen2.5-0.5B training shape (CUDA events).
    #[arg(long)]
    pub(crate) time: bool,
    /// Timed runs per op (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub(crate) iters: usize,
    /// The tiny HF models with transformers' log-probs (the `hf_fixtures` check).
    #[arg(long, default_value = "tests/fixtures/hf")]
    pub(crate) hf_fixtures: PathBuf,
}

/// Every check, op-level first, kept where `only` is in the name.
fn registry(only: Option<&str>) -> Vec<Case> {
    ops::op_cases()
        .into_iter()
        .chain(check::CASES.iter().copied())
        .chain(crate::engine::shard::check::CASES.iter().copied())
        .chain(crate::parallel::check::GPU_CASES.iter().copied())
        .filter(|c| only.is_none_or(|o| c.name.contains(o)))
        .collect()
}

/// `tandem gpu-test`.
pub fn run(a: GpuTestArgs) -> Result<()> {
    if a.compile_only {
        let (ma, mi) = nvrtc::version()?;
        println!(
            "NVRTC {ma}.{mi}: compiling every kernel family for {}",
            a.arch
        );
        let t = std::time::Instant::now();
        for (name, bytes, secs) in ops::compile_all(&a.arch)? {
            println!("  {name:<24} {bytes:>8} bytes of cubin  {secs:6.2} s");
        }
        println!("all in parallel: {:.2} s", t.elapsed().as_secs_f64());
        return Ok(());
    }
    let gpu = CudaBackend::new(a.device)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let (ma, mi) = gpu.nvrtc_version();
    println!(
        "tandem gpu-test: {} ({}, {}), NVRTC {ma}.{mi}, seed {seed} (replay with --seed {seed})",
        gpu.name(),
        gpu.device_name(),
        gpu.arch()
    );
    // The cases start with the tensor-core attention kernels on, as the backend runs by default.
    gpu.set_tensor_core_attention(true);
    let mut suite = Ctx::new(&gpu, a.device, seed);
    suite.fixtures = a.hf_fixtures.clone();
    let cases = registry(a.only.as_deref());
    let t0 = Instant::now();
    for d in DTYPES {
        for case in &cases {
            let t = Instant::now();
            suite.run(case, d);
            eprintln!(
                "  {} ({}) done in {:.2} s",
                case.name,
                dname(d),
                t.elapsed().as_secs_f64()
            );
        }
    }
    let failed = print_table(&suite.rows);
    let st = gpu.memory_stats();
    println!(
        "{} checks, {} failed, {:.1} s; pool: {} MiB held, peak {} MiB in use",
        suite.rows.len(),
        failed,
        t0.elapsed().as_secs_f64(),
        st.held >> 20,
        st.peak_in_use >> 20
    );
    let timing = if a.time && failed == 0 {
        println!();
        timing::run(&gpu, a.iters, a.only.as_deref(), &ops::timing_cases())?
    } else {
        Vec::new()
    };
    if let Some(p) = &a.json {
        let doc = serde_json::json!({
            "device": gpu.device_name(),
            "arch": gpu.arch(),
            "nvrtc": format!("{ma}.{mi}"),
            "seed": seed,
            "rows": suite.rows,
            "timing": timing,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)
            .map_err(|e| anyhow!("cannot write {}: {e}", p.display()))?;
    }
    if suite.rows.is_empty() {
        bail!("no parity check matched --only");
    }
    if failed > 0 {
        bail!("{failed} of {} parity checks failed", suite.rows.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(only: Option<&str>) -> Vec<&'static str> {
        registry(only).into_iter().map(|c| c.name).collect()
    }

    #[test]
    fn the_registry_holds_every_check_and_only_filters_by_name() {
        let all = names(None);
        assert_eq!(all.len(), 34);
        // Op-level checks come first, then the decoder and engine ones, then the sharded
        // trainer's, then the communicator's.
        assert_eq!((all[0], all[all.len() - 1]), ("memory", "communicator"));
        assert_eq!(names(Some("sharded")), ["sharded_update"]);
        assert_eq!(
            names(Some("paged")),
            [
                "attention_paged",
                "attention_paged_rope",
                "paged_generate",
                "paged_graphs"
            ]
        );
        assert_eq!(names(Some("decoder")), ["decoder"]);
        assert_eq!(names(Some("value")), ["value_model"]);
        assert_eq!(names(Some("lora")), ["lora", "lora_merge", "lora_unmerged"]);
        assert!(names(Some("no such check")).is_empty());
    }
}
