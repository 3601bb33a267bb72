//! `tandem bench dist`: the communicator's bandwidth (each collective at sizes up to 1 GiB,
//! algorithm and bus bandwidth as nccl-tests computes them) and the bucketed weight sync of the
//! Qwen2.5 shapes, at whatever world size it runs (`tandem launch --nproc-per-node N -- tandem
//! bench dist`, srun, or alone). The measurements are `parallel::bench`'s; this file picks the
//! sizes and shapes and prints rank 0's table and JSON.

use super::cpu_engine::shape;
use super::report;
use crate::backend::{Backend, DType};
use crate::error::input_error;
use crate::model::names::expected_tensors;
use crate::parallel::bench::{
    time_collective, time_weight_sync, CollectiveTiming, SyncTiming, OPS,
};
use crate::parallel::{run_job, Comm, DeviceKind, Job, ProcessGroup};
use anyhow::Result;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub(crate) struct DistBenchArgs {
    /// Backend of every rank: cuda (NCCL; the GPU of the rank's local rank) or cpu.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cuda)]
    pub(crate) device: DeviceKind,
    /// Element type, bf16 or f32 (default: bf16 on cuda, f32 on cpu).
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// Collectives to time.
    #[arg(long, value_delimiter = ',', default_values_t = OPS.map(String::from))]
    pub(crate) ops: Vec<String>,
    /// Smallest buffer, in bytes (suffixes KiB, MiB, GiB).
    #[arg(long, default_value = "1MiB")]
    pub(crate) min_size: String,
    /// Largest buffer (default 1GiB on cuda, 64MiB on cpu).
    #[arg(long)]
    pub(crate) max_size: Option<String>,
    /// Each size is this many times the one before.
    #[arg(long, default_value_t = 4)]
    pub(crate) factor: usize,
    /// Untimed runs before the timed ones, per size.
    #[arg(long, default_value_t = 5)]
    pub(crate) warmup: usize,
    /// Timed runs per size (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub(crate) iters: usize,
    /// Model shapes whose weight sync to time (qwen0.5b, qwen1.5b, qwen7b, qwen14b, small),
    /// or none (default: qwen0.5b,qwen1.5b,qwen7b on cuda, small on cpu).
    #[arg(long, value_delimiter = ',')]
    pub(crate) shapes: Vec<String>,
    /// Bucket sizes of the weight sync, in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [32usize, 128, 512])]
    pub(crate) bucket_mb: Vec<usize>,
    /// Also write everything as JSON to this file (rank 0).
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

/// Bytes from "4096", "512KiB", "64MiB", "1GiB" (K/M/G and KB/MB/GB mean the same powers of 2).
pub(crate) fn parse_bytes(s: &str) -> Option<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b.is_multiple_of(1 << 30) => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{:.0} MiB", b as f64 / (1 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.0} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

struct Plan {
    dtype: DType,
    ops: Vec<String>,
    sizes: Vec<usize>,
    shapes: Vec<(String, Vec<usize>)>,
    bucket_mb: Vec<usize>,
    warmup: usize,
    iters: usize,
}

struct Measured {
    comm: &'static str,
    collectives: Vec<CollectiveTiming>,
    syncs: Vec<(String, SyncTiming)>,
}

impl Job for Plan {
    type Out = Measured;

    fn run<B: Backend>(self, backend: &B, comm: &dyn Comm<B>) -> Result<Measured> {
        let mut collectives = Vec::new();
        for op in &self.ops {
            for &size in &self.sizes {
                collectives.push(time_collective(
                    backend,
                    comm,
                    op,
                    size,
                    self.dtype,
                    self.warmup,
                    self.iters,
                )?);
            }
        }
        let mut syncs = Vec::new();
        for (name, sizes) in &self.shapes {
            for &mb in &self.bucket_mb {
                let t = time_weight_sync(
                    backend,
                    comm,
                    sizes,
                    mb << 20,
                    self.dtype,
                    self.warmup.min(2),
                    self.iters.clamp(1, 5),
                )?;
                syncs.push((name.clone(), t));
            }
        }
        Ok(Measured {
            comm: comm.name(),
            collectives,
            syncs,
        })
    }
}

pub fn run(a: DistBenchArgs) -> Result<()> {
    let plan = Plan::of(&a)?;
    let pg = ProcessGroup::init()?;
    let m = run_job(a.device, &pg, plan)?;
    if pg.rank() == 0 {
        m.report(&a, pg.world_size())?;
    }
    pg.finish()
}

impl Plan {
    /// The plan of the flags, checked (input errors name the flag).
    fn of(a: &DistBenchArgs) -> Result<Plan> {
        let cuda = a.device == DeviceKind::Cuda;
        let dtype = match a.dtype.as_deref() {
            None if cuda => DType::BF16,
            None => DType::F32,
            Some("bf16") => DType::BF16,
            Some("f32") => DType::F32,
            Some(other) => {
                return Err(input_error(format!(
                    "--dtype '{other}': expected bf16 or f32"
                )))
            }
        };
        let sizes = sizes(a, cuda)?;
        for op in &a.ops {
            if !OPS.contains(&op.as_str()) {
                return Err(input_error(format!(
                    "--ops: unknown collective '{op}' (expected {})",
                    OPS.join(", ")
                )));
            }
        }
        let shapes = shapes(a, cuda)?;
        if a.bucket_mb.contains(&0) {
            return Err(input_error("--bucket-mb: sizes must be at least 1"));
        }
        Ok(Plan {
            dtype,
            ops: a.ops.clone(),
            sizes,
            shapes,
            bucket_mb: a.bucket_mb.clone(),
            warmup: a.warmup,
            iters: a.iters,
        })
    }
}

/// The buffer sizes: from --min-size to --max-size, each --factor times the one before.
fn sizes(a: &DistBenchArgs, cuda: bool) -> Result<Vec<usize>> {
    let bytes = |flag: &str, v: &str| {
        parse_bytes(v).filter(|&b| b > 0).ok_or_else(|| {
            input_error(format!(
                "{flag} '{v}' is not a size (e.g. 4096, 64MiB, 1GiB)"
            ))
        })
    };
    let min = bytes("--min-size", &a.min_size)?;
    let max_default = if cuda { "1GiB" } else { "64MiB" };
    let max = bytes("--max-size", a.max_size.as_deref().unwrap_or(max_default))?;
    if a.factor < 2 {
        return Err(input_error("--factor must be at least 2"));
    }
    if a.iters == 0 {
        return Err(input_error("--iters must be at least 1"));
    }
    let mut sizes = Vec::new();
    let mut s = min;
    while s <= max {
        sizes.push(s);
        s = s.saturating_mul(a.factor);
    }
    Ok(sizes)
}

/// The model shapes of --shapes: each name with its tensors' element counts.
fn shapes(a: &DistBenchArgs, cuda: bool) -> Result<Vec<(String, Vec<usize>)>> {
    let names: Vec<String> = match a.shapes.as_slice() {
        [] if cuda => vec!["qwen0.5b".into(), "qwen1.5b".into(), "qwen7b".into()],
        [] => vec!["small".into()],
        [one] if one == "none" => Vec::new(),
        list => list.to_vec(),
    };
    let mut shapes = Vec::new();
    for name in names {
        let cfg = shape(&name).map_err(|e| input_error(format!("--shapes: {e:#}")))?;
        let tensors = expected_tensors(&cfg)
            .iter()
            .map(|t| t.shape.iter().product())
            .collect();
        shapes.push((name, tensors));
    }
    Ok(shapes)
}

impl Measured {
    /// Rank 0's tables (collectives, then weight syncs) and the --json file; `n` ranks.
    fn report(&self, a: &DistBenchArgs, n: usize) -> Result<()> {
        self.report_collectives(a, n);
        if !self.syncs.is_empty() {
            self.report_syncs(n);
        }
        if let Some(path) = &a.json {
            let all = json!({
                "bench": "dist",
                "world": n,
                "device": a.device,
                "comm": self.comm,
                "collectives": self.collectives,
                "weight_sync": self.syncs.iter().map(|(name, t)| json!({"shape": name, "timing": t})).collect::<Vec<_>>(),
            });
            std::fs::write(path, serde_json::to_string_pretty(&all)?)?;
        }
        Ok(())
    }

    fn report_collectives(&self, a: &DistBenchArgs, n: usize) {
        let title = format!(
            "bench dist: {} ranks, {} ({} communicator), median of {} runs",
            n, a.device, self.comm, a.iters
        );
        let rows: Vec<Vec<String>> = self
            .collectives
            .iter()
            .map(|c| {
                vec![
                    c.op.clone(),
                    c.dtype.into(),
                    human(c.bytes),
                    format!("{:.1}", c.median_us),
                    format!("{:.2}", c.algbw_gbs),
                    format!("{:.2}", c.busbw_gbs),
                ]
            })
            .collect();
        let header = [
            "collective",
            "dtype",
            "size",
            "time us",
            "algbw GB/s",
            "busbw GB/s",
        ];
        report(
            &title,
            &header,
            &rows,
            &json!({"collectives": self.collectives}),
        );
    }

    fn report_syncs(&self, n: usize) {
        let rows: Vec<Vec<String>> = self
            .syncs
            .iter()
            .map(|(name, t)| {
                vec![
                    name.clone(),
                    format!("{}", t.bucket_mb),
                    t.buckets.to_string(),
                    human(t.model_bytes),
                    human(t.staging_bytes),
                    format!("{:.2}", t.median_ms),
                    format!("{:.2}", t.algbw_gbs),
                    format!("{:.2}", t.busbw_gbs),
                ]
            })
            .collect();
        let header = [
            "shape",
            "bucket MiB",
            "buckets",
            "model",
            "extra",
            "sync ms",
            "algbw GB/s",
            "busbw GB/s",
        ];
        let json: Vec<_> = self
            .syncs
            .iter()
            .map(|(name, t)| json!({"shape": name, "timing": t}))
            .collect();
        report(
            &format!("weight sync (bucketed all-gather of every tensor, {n} ranks)"),
            &header,
            &rows,
            &json!({"weight_sync": json}),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("64MiB"), Some(64 << 20));
        assert_eq!(parse_bytes("1GiB"), Some(1 << 30));
        assert_eq!(parse_bytes("512k"), Some(512 << 10));
        assert_eq!(parse_bytes("1.5MiB"), None);
        assert_eq!(parse_bytes("MiB"), None);
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(64 << 20), "64 MiB");
    }
}
