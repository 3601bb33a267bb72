//! GEMMs through cuBLASLt: bf16 (or f32) inputs, fp32 accumulation and scaling, f32 or bf16
//! output, and the bias add fused into the epilogue. A plan (descriptor, layouts, heuristic
//! algorithm) is made once per shape and reused, so a training step costs no heuristic calls.
//!
//! cuBLASLt is column-major. A row-major matrix `x[rows, cols]` is the column-major matrix
//! `xᵀ[cols, rows]` with leading dimension `cols`; the callers in `mod.rs` do that bookkeeping.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lr, sys as ls};
use cudarc::driver::CudaStream;

use super::pool::{Block, Pool};
use crate::backend::DType;

mod tune;

/// Bytes of cuBLASLt workspace (NVIDIA's recommendation for Hopper).
const WORKSPACE: usize = 32 << 20;

/// A device matrix operand: its address and element type.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) dtype: DType,
}

/// One column-major GEMM: D[m,n] = op(A)·op(B) + beta·C (+ bias[m] along the rows of D), where
/// C is D unless `c` names another matrix of D's type and layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmCall {
    pub(crate) transa: bool,
    pub(crate) transb: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: Operand,
    pub(crate) lda: usize,
    pub(crate) b: Operand,
    pub(crate) ldb: usize,
    pub(crate) d: Operand,
    pub(crate) ldd: usize,
    pub(crate) beta: f32,
    pub(crate) bias: Option<Operand>,
    pub(crate) c: Option<Operand>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    transa: bool,
    transb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldd: usize,
    ab: DType,
    d: DType,
    bias: bool,
    align: [u32; 3],
    /// Batch-invariant plan (see `Gemm::set_batch_invariant`).
    invariant: bool,
}

struct Plan {
    desc: ls::cublasLtMatmulDesc_t,
    a: ls::cublasLtMatrixLayout_t,
    b: ls::cublasLtMatrixLayout_t,
    d: ls::cublasLtMatrixLayout_t,
    algo: ls::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: the plan owns its descriptor and layouts and frees each once (a null one, left
        // by a failed build, is passed as is and the error ignored); cuBLASLt reads them only
        // during the calls that take them, so queued GEMMs do not need them.
        unsafe {
            let _ = lr::destroy_matmul_desc(self.desc);
            let _ = lr::destroy_matrix_layout(self.a);
            let _ = lr::destroy_matrix_layout(self.b);
            let _ = lr::destroy_matrix_layout(self.d);
        }
    }
}

struct State {
    handle: ls::cublasLtHandle_t,
    plans: HashMap<Key, Plan>,
}

// SAFETY: the handle and descriptors are only used under the mutex, on one stream.
unsafe impl Send for State {}

pub(crate) struct Gemm {
    state: Mutex<State>,
    workspace: Block,
    pool: Arc<Pool>,
    /// Whether new decode-sized plans time the heuristic's candidates (`tune`).
    tune: tune::Mode,
    stream: Arc<CudaStream>,
    invariant: std::sync::atomic::AtomicBool,
    /// Plans made and the time their heuristic queries took (`planning`).
    plans_made: std::sync::atomic::AtomicU64,
    planning_ns: std::sync::atomic::AtomicU64,
}

/// Token count the batch-invariant plans are chosen for (see `Gemm::set_batch_invariant`):
/// a decode step's, since generation is most of an RL step and the algorithms picked for a
/// few hundred rows still fill the GPU at a training micro-batch's thousands (an algorithm
/// picked for thousands of rows runs a 256-row decode GEMM on a dozen blocks).
const INVARIANT_TOKENS: usize = 256;

fn cuda_type(t: DType) -> ls::cudaDataType {
    match t {
        DType::F32 => ls::cudaDataType::CUDA_R_32F,
        DType::BF16 => ls::cudaDataType::CUDA_R_16BF,
    }
}

/// Largest power of two (up to 256) that divides the address: what the heuristic may assume.
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

fn err(what: &str) -> impl Fn(lr::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {what}: {e:?}")
}

/// Sets one attribute of a matmul descriptor to `v`.
///
/// # Safety
/// `desc` is a live descriptor not used by another thread meanwhile, and `T` is the type
/// cuBLASLt documents for `attr` (it reads `size_of::<T>()` bytes at `v`).
unsafe fn set_desc<T>(
    desc: ls::cublasLtMatmulDesc_t,
    attr: ls::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<()> {
    lr::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>())
        .map_err(err("set descriptor attribute"))
}

/// Sets one attribute of a matmul preference to `v`.
///
/// # Safety
/// `pref` is a live preference not used by another thread meanwhile, and `T` is the type
/// cuBLASLt documents for `attr` (it reads `size_of::<T>()` bytes at `v`).
unsafe fn set_pref<T>(
    pref: ls::cublasLtMatmulPreference_t,
    attr: ls::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    lr::set_matmul_pref_attribute(pref, attr, v as *const T as *const c_void, size_of::<T>())
        .map_err(err("set preference"))
}

/// A column-major layout of `r`×`c` elements of `t` with leading dimension `ld`.
fn layout(t: DType, r: usize, c: usize, ld: usize) -> Result<ls::cublasLtMatrixLayout_t> {
    lr::create_matrix_layout(cuda_type(t), r as u64, c as u64, ld as i64)
        .map_err(err("create layout"))
}

/// Sets a plan descriptor's transposes and epilogue (bias or none) for `key`.
///
/// # Safety
/// `desc` is a live matmul descriptor not used by another thread meanwhile.
unsafe fn set_operation(desc: ls::cublasLtMatmulDesc_t, key: &Key) -> Result<()> {
    use ls::cublasLtMatmulDescAttributes_t as A;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &(key.transa as i32))?;
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &(key.transb as i32))?;
    let epi = if key.bias {
        ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
    } else {
        ls::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT
    };
    set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
    if key.bias {
        // The heuristic needs a bias pointer set; the real one is set per call.
        let dummy: u64 = 256;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dummy)?;
    }
    Ok(())
}

/// Up to `count` of the heuristic's algorithms for `plan` (its estimate's best first) with B
/// and D laid out as `probe` (the plan's own, or the batch-invariant row count's, when the
/// first algorithm must also pass the check on the real shape).
///
/// # Safety
/// `handle`, the plan's descriptor and layouts and the probe layouts are live.
unsafe fn heuristic(
    handle: ls::cublasLtHandle_t,
    plan: &Plan,
    key: &Key,
    ws: usize,
    probe: (ls::cublasLtMatrixLayout_t, ls::cublasLtMatrixLayout_t),
    count: usize,
) -> Result<Vec<ls::cublasLtMatmulHeuristicResult_t>> {
    use ls::cublasLtMatmulPreferenceAttributes_t as P;
    let canonical = key.invariant && key.n != INVARIANT_TOKENS;
    let pref = lr::create_matmul_pref().map_err(err("create preference"))?;
    let res = (|| -> Result<Vec<ls::cublasLtMatmulHeuristicResult_t>> {
        let ws_pref = if key.invariant { 0 } else { ws as u64 };
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_pref)?;
        set_pref(
            pref,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &key.align[0],
        )?;
        set_pref(
            pref,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &key.align[1],
        )?;
        set_pref(
            pref,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &key.align[2],
        )?;
        set_pref(
            pref,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &key.align[2],
        )?;
        let (hb, hd) = probe;
        let mut out = vec![std::mem::zeroed::<ls::cublasLtMatmulHeuristicResult_t>(); count.max(1)];
        let mut found = 0i32;
        let st = ls::cublasLtMatmulAlgoGetHeuristic(
            handle,
            plan.desc,
            plan.a,
            hb,
            hd,
            hd,
            pref,
            out.len() as i32,
            out.as_mut_ptr(),
            &mut found,
        );
        if st != ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS || found <= 0 {
            bail!(
                "cuBLASLt found no algorithm for {key:?} ({st:?}); \
                 check the operand types and alignment"
            );
        }
        out.truncate(found as usize);
        out.retain(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
        let Some(first) = out.first() else {
            bail!("cuBLASLt found no usable algorithm for {key:?}");
        };
        if canonical {
            let mut check = std::mem::zeroed::<ls::cublasLtMatmulHeuristicResult_t>();
            let ok = ls::cublasLtMatmulAlgoCheck(
                handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                &first.algo,
                &mut check,
            );
            if ok != ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS || check.workspaceSize > ws {
                bail!(
                    "cuBLASLt: the batch-invariant algorithm for {key:?} cannot run \
                     {} rows ({ok:?})",
                    key.n
                );
            }
        }
        Ok(out)
    })();
    let _ = lr::destroy_matmul_pref(pref);
    res
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>, pool: &Arc<Pool>) -> Result<Self> {
        // SAFETY: is_culib_present only tries to load libcublasLt; it has no preconditions.
        if !unsafe { ls::is_culib_present() } {
            bail!("libcublasLt not found: install the CUDA toolkit's cuBLAS (libcublasLt.so.13)");
        }
        let handle = lr::create_handle().map_err(err("create handle"))?;
        let workspace = pool.alloc(WORKSPACE)?;
        Ok(Gemm {
            state: Mutex::new(State {
                handle,
                plans: HashMap::new(),
            }),
            workspace,
            pool: pool.clone(),
            tune: tune::Mode::from_env(),
            stream,
            invariant: std::sync::atomic::AtomicBool::new(
                std::env::var_os("TANDEM_BATCH_INVARIANT").is_some(),
            ),
            plans_made: Default::default(),
            planning_ns: Default::default(),
        })
    }

    /// Batch-invariant forward GEMMs: y = x·wᵀ (the decoder's projections and LM head) run
    /// the algorithm cuBLASLt picks for INVARIANT_TOKENS rows whatever the row count, so a
    /// row's result does not depend on how many rows share the call (a decode step of 256
    /// sequences and a training micro-batch of 5120 tokens round alike). Off by default: the
    /// heuristic's own choice is faster at small row counts. The environment variable
    /// TANDEM_BATCH_INVARIANT turns it on.
    pub(crate) fn set_batch_invariant(&self, on: bool) {
        self.invariant
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Plans made so far and the seconds they took (a new row count costs a heuristic query).
    pub(crate) fn planning(&self) -> (u64, f64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.plans_made.load(Relaxed),
            self.planning_ns.load(Relaxed) as f64 * 1e-9,
        )
    }

    pub(crate) fn batch_invariant(&self) -> bool {
        self.invariant.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The descriptor, layouts and heuristic algorithm of one GEMM shape, and up to `count` of
    /// the heuristic's candidates (the plan's algorithm first).
    fn plan(
        handle: ls::cublasLtHandle_t,
        key: &Key,
        ws: usize,
        count: usize,
    ) -> Result<(Plan, Vec<ls::cublasLtMatmulHeuristicResult_t>)> {
        let mut plan = Self::layouts(key)?;
        // Batch-invariant forward GEMMs (Aᵀ·B, n = tokens): the heuristic sees INVARIANT_TOKENS
        // columns; the algorithm must then also run the real shape (checked in `heuristic`).
        // No workspace: an algorithm picked with some (split-K) may need more than there is at
        // another row count.
        let canonical = key.invariant && key.n != INVARIANT_TOKENS;
        let probe = if canonical {
            (
                layout(key.ab, key.k, INVARIANT_TOKENS, key.ldb)?,
                layout(key.d, key.m, INVARIANT_TOKENS, key.ldd)?,
            )
        } else {
            (plan.b, plan.d)
        };
        // SAFETY: `plan.desc` is the live descriptor just made, and the probe layouts are live
        // (the plan's own, or the two made above, destroyed below and nowhere else).
        let res = unsafe {
            set_operation(plan.desc, key)
                .and_then(|()| heuristic(handle, &plan, key, ws, probe, count))
        };
        if canonical {
            // SAFETY: the two probe layouts were made above for this query alone, which is done.
            unsafe {
                let _ = lr::destroy_matrix_layout(probe.0);
                let _ = lr::destroy_matrix_layout(probe.1);
            }
        }
        let candidates = res?;
        plan.algo = candidates[0].algo;
        Ok((plan, candidates))
    }

    /// A plan's descriptor and the layouts of A, B and D (the algorithm still empty).
    fn layouts(key: &Key) -> Result<Plan> {
        let desc = lr::create_matmul_desc(
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ls::cudaDataType::CUDA_R_32F,
        )
        .map_err(err("create descriptor"))?;
        let (ar, ac) = if key.transa {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (br, bc) = if key.transb {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        // Build the plan piecewise so Drop frees whatever was made if a later step fails.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: ls::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.a = layout(key.ab, ar, ac, key.lda)?;
        plan.b = layout(key.ab, br, bc, key.ldb)?;
        plan.d = layout(key.d, key.m, key.n, key.ldd)?;
        Ok(plan)
    }

    /// Runs one GEMM on the stream. A and B share a type; f32 inputs need an f32 output.
    pub fn run(&self, c: &GemmCall) -> Result<()> {
        if c.a.dtype != c.b.dtype {
            bail!("cuBLASLt GEMM: A and B must share a type (caller converts first)");
        }
        if c.a.dtype == DType::F32 && c.d.dtype == DType::BF16 {
            bail!("cuBLASLt GEMM: f32 inputs with a bf16 output are not supported");
        }
        if let Some(b) = c.bias {
            if b.dtype != c.d.dtype {
                bail!("cuBLASLt GEMM: the bias must have the output's type");
            }
        }
        if let Some(cm) = c.c {
            if cm.dtype != c.d.dtype {
                bail!("cuBLASLt GEMM: C must have the output's type");
            }
        }
        if c.m == 0 || c.n == 0 {
            return Ok(());
        }
        let c_ptr = c.c.map_or(c.d.ptr, |m| m.ptr);
        let invariant = self.batch_invariant() && c.transa && !c.transb;
        // Batch-invariant plans assume 16-byte operands whatever the addresses (256-byte for
        // pool blocks, less for row offsets), so that every call of a shape gets one algorithm.
        let cap = if invariant { 16 } else { 256 };
        let key = Key {
            transa: c.transa,
            transb: c.transb,
            m: c.m,
            n: c.n,
            k: c.k,
            lda: c.lda,
            ldb: c.ldb,
            ldd: c.ldd,
            ab: c.a.dtype,
            d: c.d.dtype,
            bias: c.bias.is_some(),
            align: [
                alignment(c.a.ptr).min(cap),
                alignment(c.b.ptr).min(cap),
                alignment(c.d.ptr).min(alignment(c_ptr)).min(cap),
            ],
            invariant,
        };
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = st.handle;
        let ws = self.workspace.bytes();
        let (plan, candidates) = match st.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => (e.into_mut(), Vec::new()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let t = std::time::Instant::now();
                // A capture may not synchronize the stream: its plans keep the heuristic's pick.
                let tune = self.tune.wanted(&key) && !self.pool.capturing();
                let count = if tune { tune::CANDIDATES } else { 1 };
                let (plan, candidates) = Self::plan(handle, &key, ws, count)?;
                self.planning_ns.fetch_add(
                    t.elapsed().as_nanos() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                self.plans_made
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                (e.insert(plan), candidates)
            }
        };
        if let Some(b) = c.bias {
            // SAFETY: the plan's descriptor is live and used under the state's lock.
            unsafe {
                set_desc(
                    plan.desc,
                    ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &b.ptr,
                )?;
            }
        }
        let call = Launch {
            handle,
            c,
            c_ptr,
            workspace: (self.workspace.ptr(), ws),
            stream: &self.stream,
        };
        if candidates.len() > 1 {
            let t = std::time::Instant::now();
            plan.algo = tune::fastest(&call, plan, &key, &candidates, &self.pool, self.tune)?;
            self.planning_ns.fetch_add(
                t.elapsed().as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        call.run(plan, &plan.algo, c.d.ptr)
            .map_err(|e| anyhow!("cublasLtMatmul {key:?}: {e:?}"))
    }
}

/// What one cuBLASLt call needs besides its plan and algorithm.
struct Launch<'a> {
    handle: ls::cublasLtHandle_t,
    c: &'a GemmCall,
    c_ptr: u64,
    workspace: (u64, usize),
    stream: &'a Arc<CudaStream>,
}

impl Launch<'_> {
    /// Queues the GEMM with `algo`, writing D at `d` (the call's D, or a scratch matrix of its
    /// layout when timing candidates).
    fn run(
        &self,
        plan: &Plan,
        algo: &ls::cublasLtMatmulAlgo_t,
        d: u64,
    ) -> Result<(), lr::CublasError> {
        let (alpha, beta) = (1.0f32, self.c.beta);
        // SAFETY: the handle, the plan and the workspace are live and used under the Gemm's
        // state lock (a Launch lives inside `Gemm::run`); the operand addresses come from live
        // buffers of the types and layouts the plan was made for (its key holds them), `d` is
        // the call's D or a block of D's size, and the work is queued on the stream their
        // writers use.
        unsafe {
            lr::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                self.c.a.ptr as *const c_void,
                plan.a,
                self.c.b.ptr as *const c_void,
                plan.b,
                self.c_ptr as *const c_void,
                plan.d,
                d as *mut c_void,
                plan.d,
                algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                self.stream.cu_stream() as ls::cudaStream_t,
            )
        }
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        st.plans.clear();
        // SAFETY: no plan refers to the handle any more (cleared above) and nothing else uses it.
        unsafe {
            let _ = lr::destroy_handle(st.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x1000 + 16), 16);
        assert_eq!(alignment(0x1000 + 2), 2);
        assert_eq!(alignment(0x1000 + 1792), 256);
    }
}
