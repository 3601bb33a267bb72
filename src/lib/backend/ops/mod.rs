//! The op families. Each folder holds one family (after llm.c's `llmc/<op>.cuh` with its
//! `dev/cuda/<op>.cu` check beside it): `mod.rs` says what the ops do, their shapes and
//! formulas, and declares the family's trait (each op's math in a `///` line); `cpu.rs` is the
//! f32 reference with its unit tests; `cuda.rs` the launchers; `<family>.cu` the kernels (each
//! opening with its layout, launch geometry and determinism); `check.rs` the GPU parity cases
//! and timing shapes, registered below.
//!
//! | family | ops |
//! |---|---|
//! | `memory` | add_assign, gather_rows, scatter_add_rows, kv_store |
//! | `matmul` | matmul, matmul_residual, matmul_backward_x/_w |
//! | `embedding` | embedding, embedding_backward |
//! | `rmsnorm` | rmsnorm, rmsnorm_backward |
//! | `rope` | rope, rope_backward, rope_store_kv, rope_store_kv_packed |
//! | `swiglu` | swiglu, swiglu_packed, swiglu_backward |
//! | `attention` | attention, attention_backward |
//! | `paged_attention` | attention_paged, attention_paged_rope, attention_paged_tiled |
//! | `logprob` | logprob, logprob_backward |
//! | `ppo_loss` | ppo_clip_loss |
//! | `adamw` | sum_squares, sum_squares_all, adamw |
//! | `sample` | sample |

pub(crate) mod adamw;
pub(crate) mod attention;
pub(crate) mod embedding;
pub mod logprob;
pub(crate) mod matmul;
pub(crate) mod memory;
pub mod paged_attention;
pub(crate) mod ppo_loss;
pub(crate) mod rmsnorm;
pub(crate) mod rope;
pub mod sample;
pub(crate) mod swiglu;

use anyhow::Result;

use crate::backend::check::gpu::Case;
use crate::backend::check::timing::Timing;
use crate::backend::cuda::nvrtc::{self, Family};
use crate::backend::cuda::CudaBackend;

/// Every kernel source NVRTC compiles: the device's own and each family's.
pub(crate) const KERNELS: [Family; 14] = [
    crate::backend::cuda::KERNELS,
    memory::cuda::KERNELS,
    matmul::cuda::KERNELS,
    embedding::cuda::KERNELS,
    rmsnorm::cuda::KERNELS,
    rope::cuda::KERNELS,
    swiglu::cuda::KERNELS,
    attention::cuda::KERNELS,
    attention::cuda::BWD_KERNELS,
    paged_attention::cuda::KERNELS,
    logprob::cuda::KERNELS,
    ppo_loss::cuda::KERNELS,
    adamw::cuda::KERNELS,
    sample::cuda::KERNELS,
];

/// Compiles every kernel for `arch` (`tandem gpu-test --compile-only`, `make kernels-check`):
/// (program, cubin bytes, seconds) per program, compiled in parallel.
pub fn compile_all(arch: &str) -> Result<Vec<(String, usize, f64)>> {
    nvrtc::compile_all(&KERNELS, arch)
}

/// Opens GPU `ordinal` and starts compiling (or reading from the disk cache) every kernel
/// family without a head dim in the background; a decoder built on it starts those of its
/// head dim (`Device::prepare_kernels`). A fresh machine's first process then waits for the
/// slowest program while it loads its model, rather than for each program in turn at its
/// first use.
pub fn open_cuda(ordinal: usize) -> Result<CudaBackend> {
    let b = CudaBackend::new(ordinal)?;
    b.prefetch_kernels(&KERNELS);
    Ok(b)
}

/// The op families' GPU parity cases, in the order `gpu-test` runs them.
pub fn op_cases() -> Vec<Case> {
    [
        memory::check::CASES,
        matmul::check::CASES,
        embedding::check::CASES,
        rmsnorm::check::CASES,
        rope::check::CASES,
        attention::check::CASES,
        swiglu::check::CASES,
        logprob::check::CASES,
        ppo_loss::check::CASES,
        adamw::check::CASES,
        paged_attention::check::CASES,
        sample::check::CASES,
    ]
    .concat()
}

/// The op families' timing shapes, in the order `gpu-test --time` runs them.
pub(crate) fn timing_cases() -> Vec<Timing> {
    [
        matmul::check::TIMINGS,
        attention::check::TIMINGS,
        rmsnorm::check::TIMINGS,
        swiglu::check::TIMINGS,
        rope::check::TIMINGS,
        logprob::check::TIMINGS,
        adamw::check::TIMINGS,
        memory::check::TIMINGS,
        paged_attention::check::TIMINGS,
    ]
    .concat()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::Path;

    use super::*;

    /// Every `.cu` file under `src/lib/backend` is compiled by a family named after it (its
    /// text, after the defines a family may put first: the attention file is two programs),
    /// every family compiles one of the files, and the families have distinct names: a new
    /// kernel file cannot be forgotten.
    #[test]
    fn every_kernel_source_is_registered() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib/backend");
        let mut files = Vec::new();
        let mut dirs = vec![root];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "cu") {
                    files.push(p);
                }
            }
        }
        assert!(files.len() >= 13, "{files:?}");
        let texts: Vec<(String, String)> = files
            .iter()
            .map(|f| {
                let stem = f.file_stem().unwrap().to_str().unwrap().to_string();
                (stem, std::fs::read_to_string(f).unwrap())
            })
            .collect();
        for (stem, text) in &texts {
            let of_file =
                |k: &&Family| k.src.ends_with(text.as_str()) && k.name.starts_with(stem.as_str());
            assert!(
                KERNELS.iter().any(|k| of_file(&k)),
                "{stem}.cu is not in ops::KERNELS"
            );
        }
        for k in &KERNELS {
            let file = texts.iter().find(|(_, t)| k.src.ends_with(t.as_str()));
            assert!(file.is_some(), "family {} compiles no .cu file", k.name);
        }
        let names: HashSet<&str> = KERNELS.iter().map(|k| k.name).collect();
        assert_eq!(names.len(), KERNELS.len());
    }

    /// The registry: every case name once (the `--only` filters), the timings named.
    #[test]
    fn case_names_are_distinct() {
        let cases = op_cases();
        let names: HashSet<&str> = cases.iter().map(|c| c.name).collect();
        assert_eq!(names.len(), cases.len());
        for want in [
            "memory",
            "matmul",
            "embedding",
            "rmsnorm",
            "rope",
            "attention",
            "kv_store",
            "swiglu",
            "gather_rows",
            "logprob",
            "ppo_loss",
            "optim",
        ] {
            assert!(names.contains(want), "{want}");
        }
        assert!(timing_cases().len() >= 9);
    }

    /// Compiles every kernel when libnvrtc is on the library path (the device machine, or here
    /// with the nvidia-cuda-nvrtc wheel: `make kernels-check`); says so and passes otherwise.
    #[test]
    fn every_kernel_compiles_when_nvrtc_is_present() {
        if !nvrtc::present() {
            eprintln!("libnvrtc not on the library path: kernel compile check skipped");
            return;
        }
        let built = compile_all("sm_90").unwrap_or_else(|e| panic!("{e:#}"));
        let per_hd = KERNELS.iter().filter(|k| k.per_head_dim).count();
        assert_eq!(built.len(), KERNELS.len() + 2 * per_hd);
        assert!(built.iter().all(|(_, n, _)| *n > 0));
    }
}
