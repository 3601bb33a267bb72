//! Timing cuBLASLt's candidate algorithms for the GEMMs of a decode step (`TANDEM_GEMM_TUNE`).
//!
//! cuBLASLt's heuristic picks an algorithm from a model of the GPU, without running anything.
//! At a decode step's few hundred rows its pick is often not the fastest of its own candidates
//! (a split-K with a separate reduce kernel, or a tile that leaves SMs idle). With tuning on, a
//! new forward plan of at most `MAX_TOKENS` rows runs each of the heuristic's first
//! `CANDIDATES` once to warm up and `REPS` times on the call's own operands (writing a scratch
//! D), and keeps the fastest by its median. A plan is made once per shape and process, eagerly
//! (a decode bucket is captured in a graph only at its third step), so the cost is paid at a
//! rollout's first steps: a few milliseconds per shape.
//!
//! Off by default: the algorithm then depends on timings, so two processes may round
//! differently (the batch-invariant plans are never tuned).

use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::cublaslt::sys as ls;
use cudarc::driver::sys as dsys;

use super::{Key, Launch, Plan};
use crate::backend::cuda::pool::Pool;

/// The heuristic's candidates a tuned plan times.
pub(super) const CANDIDATES: usize = 16;
/// Plans of more rows (training micro-batches, long prefill chunks) keep the heuristic's pick:
/// their GEMMs fill the GPU with any tile, and timing them would cost more.
const MAX_TOKENS: usize = 1024;
/// Timed runs per candidate.
const REPS: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Off,
    On,
    /// On, and a line per tuned shape on stderr: every candidate's time and what it is.
    Verbose,
}

impl Mode {
    /// `TANDEM_GEMM_TUNE`: unset or `0` off, `verbose` on with a report, anything else on.
    pub(super) fn from_env() -> Mode {
        Mode::parse(std::env::var("TANDEM_GEMM_TUNE").ok().as_deref())
    }

    fn parse(v: Option<&str>) -> Mode {
        match v {
            None | Some("") | Some("0") => Mode::Off,
            Some("verbose") => Mode::Verbose,
            Some(_) => Mode::On,
        }
    }

    /// Whether a new plan for `key` times its candidates: forward projections (y = x·Wᵀ) of a
    /// decode step's size, not the batch-invariant ones.
    pub(super) fn wanted(self, key: &Key) -> bool {
        self != Mode::Off && !key.invariant && key.transa && !key.transb && key.n <= MAX_TOKENS
    }
}

/// The fastest of `candidates` on the call's operands (D goes to a scratch block of its size,
/// so the call's C and D are read only). A candidate that fails to run is skipped; the first
/// (the heuristic's pick) must run.
pub(super) fn fastest(
    call: &Launch,
    plan: &Plan,
    key: &Key,
    candidates: &[ls::cublasLtMatmulHeuristicResult_t],
    pool: &Arc<Pool>,
    mode: Mode,
) -> Result<ls::cublasLtMatmulAlgo_t> {
    let elem = match key.d {
        crate::backend::DType::F32 => 4,
        crate::backend::DType::BF16 => 2,
    };
    let scratch = pool.alloc(key.ldd * key.n * elem)?;
    let mut times = Vec::with_capacity(candidates.len());
    for (i, cand) in candidates.iter().enumerate() {
        let t = if cand.workspaceSize > call.workspace.1 {
            None
        } else {
            median_ms(call.stream, || call.run(plan, &cand.algo, scratch.ptr()))
        };
        if i == 0 && t.is_none() {
            return Err(anyhow!(
                "cuBLASLt: the heuristic's algorithm for {key:?} failed to run"
            ));
        }
        times.push(t);
    }
    let best = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(0, |(i, _)| i);
    if mode == Mode::Verbose {
        report(key, candidates, &times, best);
    }
    // The scratch block returns to the pool only once the timed runs are done with it.
    call.stream
        .synchronize()
        .map_err(|e| anyhow!("GEMM tuning: {e:?}"))?;
    drop(scratch);
    Ok(candidates[best].algo)
}

/// Median milliseconds of `run` (one warm-up, then `REPS` runs, each between two events); None
/// when a run or the events fail.
fn median_ms<E>(
    stream: &Arc<cudarc::driver::CudaStream>,
    mut run: impl FnMut() -> Result<(), E>,
) -> Option<f32> {
    let ctx = stream.context();
    let event = || {
        ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()
    };
    run().ok()?;
    let mut ms = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let (a, b) = (event()?, event()?);
        a.record(stream).ok()?;
        run().ok()?;
        b.record(stream).ok()?;
        ms.push(a.elapsed_ms(&b).ok()?);
    }
    ms.sort_by(|x, y| x.total_cmp(y));
    Some(ms[ms.len() / 2])
}

/// One line per candidate on stderr: its time, and its configuration (algorithm id, tile,
/// split-K, reduction, stages), the kept one marked.
fn report(
    key: &Key,
    candidates: &[ls::cublasLtMatmulHeuristicResult_t],
    times: &[Option<f32>],
    best: usize,
) {
    eprintln!(
        "gemm tune m={} n={} k={} ({:?} -> {:?}{}): {} candidates",
        key.m,
        key.n,
        key.k,
        key.ab,
        key.d,
        if key.bias { ", bias" } else { "" },
        candidates.len()
    );
    for (i, (c, t)) in candidates.iter().zip(times).enumerate() {
        let t = t.map_or("failed".to_string(), |t| format!("{:8.1} us", t * 1e3));
        let mark = match (i == best, i == 0) {
            (true, true) => "  <- heuristic, kept",
            (true, false) => "  <- kept",
            (false, true) => "  <- heuristic",
            _ => "",
        };
        eprintln!("  #{i:<2} {t}  {}{mark}", describe(&c.algo));
    }
}

/// An algorithm's configuration in words.
fn describe(algo: &ls::cublasLtMatmulAlgo_t) -> String {
    use ls::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr| {
        let mut v = 0u32;
        let mut written = 0usize;
        // SAFETY: `algo` is a live algorithm struct; cuBLASLt writes at most 4 bytes (the
        // size given) for these attributes, all of them 32-bit.
        let st = unsafe {
            ls::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut v as *mut u32 as *mut std::ffi::c_void,
                std::mem::size_of::<u32>(),
                &mut written,
            )
        };
        if st == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            v.to_string()
        } else {
            "?".to_string()
        }
    };
    format!(
        "algo {} tile {} split-k {} reduction {} stages {} cluster {}",
        get(A::CUBLASLT_ALGO_CONFIG_ID),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
    )
}

#[cfg(test)]
mod tests {
    use super::{Mode, MAX_TOKENS};
    use crate::backend::DType;

    fn key(transa: bool, transb: bool, n: usize, invariant: bool) -> super::Key {
        super::Key {
            transa,
            transb,
            m: 3584,
            n,
            k: 18944,
            lda: 18944,
            ldb: 18944,
            ldd: 3584,
            ab: DType::BF16,
            d: DType::F32,
            bias: false,
            align: [256; 3],
            invariant,
        }
    }

    #[test]
    fn the_variable_turns_tuning_on_and_it_takes_decode_sized_projections_only() {
        assert_eq!(Mode::parse(None), Mode::Off);
        assert_eq!(Mode::parse(Some("0")), Mode::Off);
        assert_eq!(Mode::parse(Some("")), Mode::Off);
        assert_eq!(Mode::parse(Some("1")), Mode::On);
        assert_eq!(Mode::parse(Some("verbose")), Mode::Verbose);
        let on = Mode::On;
        assert!(on.wanted(&key(true, false, 256, false)));
        assert!(on.wanted(&key(true, false, MAX_TOKENS, false)));
        // A training micro-batch, a backward GEMM, a batch-invariant plan: the heuristic's pick.
        assert!(!on.wanted(&key(true, false, MAX_TOKENS + 1, false)));
        assert!(!on.wanted(&key(false, false, 256, false)));
        assert!(!on.wanted(&key(true, true, 256, false)));
        assert!(!on.wanted(&key(true, false, 256, true)));
        assert!(!Mode::Off.wanted(&key(true, false, 256, false)));
        assert!(Mode::Verbose.wanted(&key(true, false, 64, false)));
    }
}
