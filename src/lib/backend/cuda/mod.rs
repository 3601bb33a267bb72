//! The CUDA device: one GPU through cudarc 0.19 with dynamic loading (it builds without CUDA
//! and finds the driver, NVRTC and cuBLASLt at run time). This module is the runtime (buffers,
//! transfers, the stream, kernel loading and launching, cuBLASLt GEMMs, graphs, draws); the
//! ops' launchers live with their families (`backend::ops::<family>::cuda`).
//!
//! - Buffers carry their element type ([`DType`]): weights and activations are bf16 where the
//!   caller allocates them so (`alloc_as`), master weights, gradients, Adam moments and
//!   statistics (rstd, lse) f32. Kernels widen every load to f32 and round every store, so any
//!   op takes any mix; GEMMs run on cuBLASLt with bf16 inputs when any operand is bf16 (f32
//!   operands are converted into a pooled temporary) and always accumulate in f32.
//! - Kernels are CUDA C, one `.cu` file per op family beside its launchers (and `device.cu`
//!   here for the runtime's own), compiled by NVRTC at first use and cached on disk
//!   (`nvrtc.rs`).
//! - Memory comes from a caching pool (`pool.rs`); everything runs in order on one stream.
//! - Kernels never read or write out of bounds on bad indices (token ids, rows, cache ranges):
//!   they raise a bit in a device error word, which `synchronize` (and every download) reads
//!   and reports as an error naming the op.

mod args;
mod draws;
pub(crate) mod gemm;
pub(crate) mod nvrtc;
pub(crate) mod pool;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as dr, sys as dsys, CudaContext, CudaFunction, CudaGraph, CudaStream};
use half::bf16;
use rayon::prelude::*;

pub(crate) use self::args::{ArgGroup, Args, ByValue};
use self::gemm::{Gemm, GemmCall, Operand};
use self::nvrtc::{Family, KernelCache};
use self::pool::{Block, Pool};
use super::{DType, Device, MatmulShape, MemoryStats, Parts};
use crate::error::input_error;

/// The device's own kernels: type conversion (copies between f32 and bf16, GEMM operands) and
/// the token feed of queued decode steps.
pub(crate) const KERNELS: Family = Family {
    name: "device",
    src: include_str!("device.cu"),
    per_head_dim: false,
    training_only: false,
};

/// Byte alignment of the parts of an `alloc_parts` (what the pool's blocks have): cuBLASLt
/// plans for 256-byte aligned operands and the kernels' 16-byte vector loads need 16.
pub(crate) const PART_ALIGN: usize = 256;

/// The message a user sees on a machine without a usable GPU.
pub(crate) const NO_DRIVER: &str = "no CUDA driver found; use --device cpu";

/// A device buffer of `len` elements of `dtype`: its own block, or a part of a block shared
/// with the other parts of an `alloc_parts` (`ptr` then points into it).
pub struct CudaBuf {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _mem: Arc<Block>,
}

/// A device buffer of `len` u32 indices.
pub struct CudaIdx {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _mem: Block,
}

impl CudaBuf {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device address of element 0, length in elements and element type, for handing the
    /// buffer to another library on another stream (NCCL in `parallel`, ordered by events).
    pub fn raw(&self) -> (u64, usize, DType) {
        (self.ptr, self.len, self.dtype)
    }

    /// Device address of element `off`.
    pub(crate) fn at(&self, off: usize) -> u64 {
        self.ptr + (off * esize(self.dtype)) as u64
    }

    /// The kernels' type tag: 1 for bf16, 0 for f32.
    pub(crate) fn bf(&self) -> i32 {
        (self.dtype == DType::BF16) as i32
    }

    pub(crate) fn operand(&self, off: usize) -> Operand {
        Operand {
            ptr: self.at(off),
            dtype: self.dtype,
        }
    }
}

impl CudaIdx {
    pub(crate) fn at(&self, off: usize) -> u64 {
        self.ptr + (off * 4) as u64
    }
}

/// Bytes per element.
pub(crate) fn esize(t: DType) -> usize {
    match t {
        DType::F32 => 4,
        DType::BF16 => 2,
    }
}

/// Threads per block of the row and elementwise kernels.
pub(crate) const THREADS: u32 = 256;

/// Shorthand for size arguments: checked to fit the kernels' i32.
pub(crate) fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow!("cuda backend: {what} = {n} does not fit in 32 bits"))
}

/// n / 8 when every buffer is bf16 and 16-byte aligned and 8 divides n: the elementwise
/// kernels' vectorized form applies (TANDEM_NO_VEC=1 keeps the scalar kernels, for checks).
pub(crate) fn vec8(n: usize, bufs: &[&CudaBuf]) -> Option<i64> {
    let ok = n.is_multiple_of(8)
        && bufs
            .iter()
            .all(|b| b.dtype == DType::BF16 && b.ptr.is_multiple_of(16))
        && std::env::var_os("TANDEM_NO_VEC").is_none();
    ok.then_some((n / 8) as i64)
}

/// `n / 8` when 8-element pieces of every buffer are whole 16-byte-aligned loads: `n` a
/// multiple of 8, each buffer bf16 or f32 with a 16-byte-aligned base (kernels read them with
/// `ld8` / `st8`); `TANDEM_NO_VEC` turns it off.
pub(crate) fn pieces8(n: usize, bufs: &[&CudaBuf]) -> Option<i64> {
    let ok = n.is_multiple_of(8)
        && bufs
            .iter()
            .all(|b| matches!(b.dtype, DType::BF16 | DType::F32) && b.ptr.is_multiple_of(16))
        && std::env::var_os("TANDEM_NO_VEC").is_none();
    ok.then_some((n / 8) as i64)
}

/// Host-side bf16 conversions of at least this many elements run on all cores.
const PAR_CONVERT: usize = 1 << 20;

/// An error unless a buffer of `have` elements holds the `n` an op needs.
pub(crate) fn need(have: usize, n: usize, what: &str) -> Result<()> {
    if have < n {
        bail!("cuda backend: {what} holds {have} elements, the op needs {n}");
    }
    Ok(())
}

/// Turns the error word's bits into a message.
fn describe_errors(bits: u32) -> String {
    let mut parts = Vec::new();
    if bits & 1 != 0 {
        parts.push("embedding: a token id is outside the vocabulary");
    }
    if bits & 2 != 0 {
        parts.push("gather/scatter: a row index is outside the buffer");
    }
    if bits & 4 != 0 {
        parts.push("kv_store: a cache row is outside the cache");
    }
    if bits & 16 != 0 {
        parts.push("logprob: a target token is outside the vocabulary");
    }
    if bits & (1 << 10) != 0 {
        parts.push("attention_paged: a query reads an empty range or a block outside the cache");
    }
    if bits & (1 << 11) != 0 {
        parts.push("sample: a row of logits holds NaN or is not finite");
    }
    format!("cuda backend: {}", parts.join("; "))
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Arc<Pool>,
    gemm: Gemm,
    kernels: Arc<KernelCache>,
    funcs: Mutex<HashMap<(&'static str, usize, &'static str), CudaFunction>>,
    err_word: Block,
    /// Route bf16 attention with head_dim % 16 == 0 (≤ 128) to the tensor-core kernels.
    tensor_cores: AtomicBool,
    /// The decoder's compute dtype: bf16 unless a test asks for f32 (exact CPU parity).
    compute_bf16: AtomicBool,
    ordinal: usize,
    device_name: String,
    sms: u32,
    /// Captured graphs by id (`Device::graph_*`); None once released.
    graphs: Mutex<Vec<Option<Graph>>>,
    /// Page-locked landing places of steps' draws (`Device::draws_start`), made on first use.
    draw_slots: Mutex<[Option<draws::Slot>; 2]>,
    /// The kernel families `prepare_kernels` compiles ahead (set by `ops::open_cuda`).
    families: OnceLock<&'static [Family]>,
    /// Head dims (and whether for training) whose programs were started ahead.
    prepared: Mutex<Vec<(usize, bool)>>,
    /// Threads compiling programs ahead; joined when the backend is dropped.
    prefetching: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// A lock that survives a panic of another holder (the data are plain lists).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // A process that exits while NVRTC compiles on another thread corrupts the heap; the
        // compiles still running finish here (each program is one NVRTC call).
        for t in lock(&self.prefetching).drain(..) {
            let _ = t.join();
        }
    }
}

/// A captured and instantiated graph. cudarc's handle is not `Send`; every use goes through
/// the backend's mutex and the one stream.
struct Graph(CudaGraph);
// SAFETY: the graph is only touched under `CudaBackend::graphs`' lock (serialised access, as
// the driver requires for graph objects).
unsafe impl Send for Graph {}

impl CudaBackend {
    /// Opens GPU `ordinal`. Without a driver, a device or NVRTC this is an input error that
    /// tells the user to pick the CPU; it never panics.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: is_culib_present only tries to load the driver library; it has no preconditions.
        if !unsafe { dsys::is_culib_present() } {
            return Err(input_error(NO_DRIVER));
        }
        // cudarc panics when a symbol is missing from an old driver: report it instead.
        let ctx = catch_unwind(AssertUnwindSafe(|| CudaContext::new(ordinal)))
            .map_err(|_| input_error(format!("{NO_DRIVER} (the driver library is unusable)")))?
            .map_err(|e| {
                let count = dr::device::get_count().unwrap_or(0);
                if count == 0 {
                    input_error(format!("{NO_DRIVER} (no usable GPU: {e:?})"))
                } else {
                    input_error(format!(
                        "cuda:{ordinal}: cannot open the device ({e:?}); {count} GPU(s) found, \
                         use --device cuda:N with N < {count} or --device cpu"
                    ))
                }
            })?;
        if !nvrtc::present() {
            return Err(input_error(
                "libnvrtc not found: the CUDA kernels are compiled at run time by NVRTC \
                 (CUDA toolkit or the nvidia-cuda-nvrtc wheel); or use --device cpu",
            ));
        }
        let (maj, min) = ctx
            .compute_capability()
            .map_err(|e| anyhow!("cuda: compute capability: {e:?}"))?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sms = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(1)
            .max(1) as u32;
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cuda: create stream: {e:?}"))?;
        let pool = Pool::new(ctx.clone());
        let gemm = Gemm::new(stream.clone(), &pool).map_err(|e| input_error(format!("{e:#}")))?;
        let kernels = Arc::new(KernelCache::new(
            &format!("sm_{maj}{min}"),
            nvrtc::default_cache_dir(),
        )?);
        let err_word = pool.alloc(4)?;
        let be = CudaBackend {
            ctx,
            stream,
            pool,
            gemm,
            kernels,
            funcs: Mutex::new(HashMap::new()),
            err_word,
            tensor_cores: AtomicBool::new(std::env::var_os("TANDEM_ATTN_SCALAR").is_none()),
            compute_bf16: AtomicBool::new(true),
            ordinal,
            device_name,
            sms,
            graphs: Mutex::new(Vec::new()),
            draw_slots: Mutex::new([None, None]),
            families: OnceLock::new(),
            prepared: Mutex::new(Vec::new()),
            prefetching: Mutex::new(Vec::new()),
        };
        be.memset(be.err_word.ptr(), 0, 4)?;
        Ok(be)
    }

    /// Whether bf16 attention may use the tensor-core kernels (default on; the environment
    /// variable TANDEM_ATTN_SCALAR turns them off). The parity suite tests both paths.
    pub(crate) fn set_tensor_core_attention(&self, on: bool) {
        self.tensor_cores.store(on, Ordering::Relaxed);
    }

    /// Batch-invariant forward GEMMs (see `Gemm::set_batch_invariant`).
    pub(crate) fn set_batch_invariant(&self, on: bool) {
        self.gemm.set_batch_invariant(on);
    }

    /// Whether a decoder built on this backend computes in bf16 (the default) or f32 (for
    /// checks that compare against the CPU op by op). Set it before building the decoder.
    pub fn set_compute_dtype(&self, dtype: DType) {
        self.compute_bf16
            .store(dtype == DType::BF16, Ordering::Relaxed);
    }

    /// The tensor-core attention kernels apply: all listed buffers bf16, head_dim a multiple
    /// of 16 up to 128.
    pub(crate) fn use_mma(&self, hd: usize, bufs: &[&CudaBuf]) -> bool {
        self.tensor_cores.load(Ordering::Relaxed)
            && hd.is_multiple_of(16)
            && hd <= 128
            && bufs.iter().all(|b| b.dtype == DType::BF16)
    }

    /// The GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub(crate) fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The NVRTC target, e.g. "sm_90".
    pub fn arch(&self) -> &str {
        self.kernels.arch()
    }

    pub(crate) fn nvrtc_version(&self) -> (i32, i32) {
        self.kernels.nvrtc_version()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op runs on (for events and graphs).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("cuda: bind context: {e:?}"))
    }

    pub(crate) fn memset(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `ptr..ptr + bytes` lies in a live pool block (callers pass a buffer's own range);
        // the memset is ordered on the stream before any later use of it.
        unsafe { dr::memset_d8_async(ptr, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: memset: {e:?}"))
    }

    /// Starts compiling the plain programs of `families` in the background (`ops::open_cuda`);
    /// `prepare_kernels` starts the per-head-dim ones of the same families.
    pub(crate) fn prefetch_kernels(&self, families: &'static [Family]) {
        let _ = self.families.set(families);
        self.spawn_prefetch(nvrtc::plain_programs(families));
    }

    fn spawn_prefetch(&self, programs: Vec<nvrtc::Program>) {
        let threads = self.kernels.prefetch(programs);
        lock(&self.prefetching).extend(threads);
    }

    /// The kernel `name` of `fam` (a per-head-dim family: compiled for head dim `hd`), compiled
    /// and loaded on first use.
    pub(crate) fn func(&self, fam: Family, hd: usize, name: &'static str) -> Result<CudaFunction> {
        self.func_smem(fam, hd, name, 0)
    }

    /// `func` for a kernel that takes `smem` bytes of dynamic shared memory: on first load its
    /// limit is raised to that (past the 48 KiB default; every launch of it passes the same).
    pub(crate) fn func_smem(
        &self,
        fam: Family,
        hd: usize,
        name: &'static str,
        smem: u32,
    ) -> Result<CudaFunction> {
        let key = (fam.name, hd, name);
        let mut funcs = self.funcs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = funcs.get(&key) {
            return Ok(f.clone());
        }
        let defines: Vec<(&str, usize)> = if hd > 0 {
            vec![("HD", hd), ("TILE", nvrtc::attention_tile(hd))]
        } else {
            vec![]
        };
        let (cubin, _) = self.kernels.get(fam, &defines)?;
        self.bind()?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| anyhow!("cuda: load {}.cu: {e:?}", fam.name))?;
        let f = module
            .load_function(name)
            .map_err(|e| anyhow!("cuda: kernel {name} in {}.cu: {e:?}", fam.name))?;
        if smem > 0 {
            // SAFETY: `f` was just loaded from a live module of this context; the attribute is a
            // plain integer setting of it.
            unsafe {
                dr::function::set_function_attribute(
                    f.cu_function(),
                    dsys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .map_err(|e| anyhow!("cuda: {name}: {smem} B of shared memory: {e:?}"))?;
        }
        funcs.insert(key, f.clone());
        Ok(f)
    }

    /// Launches `f` on the stream with `args` (nothing for an empty grid).
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &Args,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.bind()?;
        let (mut ptrs, n) = args.pointers()?;
        // SAFETY: `ptrs[..n]` address the values of `args` (borrowed for this call) in the order
        // and C widths of `f`'s parameters: each launcher builds them from its kernel's signature.
        // The driver copies them before it returns. The device buffers they name are held by the
        // launcher; one reused by the pool later is touched only by later work on this stream.
        unsafe {
            dr::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                smem,
                self.stream.cu_stream(),
                &mut ptrs[..n],
            )
        }
        .map_err(|e| anyhow!("cuda: launch failed: {e:?}"))
    }

    /// Blocks for a grid-stride loop over n elements.
    pub(crate) fn stride_blocks(&self, n: usize) -> u32 {
        (n.div_ceil(THREADS as usize) as u64).clamp(1, self.sms as u64 * 8) as u32
    }

    pub(crate) fn elementwise(
        &self,
        fam: Family,
        name: &'static str,
        n: usize,
        args: &Args,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.func(fam, 0, name)?;
        self.launch(&f, (self.stride_blocks(n), 1, 1), THREADS, 0, args)
    }

    /// Threads for a one-block-per-row kernel over rows of `dim`.
    pub(crate) fn row_threads(dim: usize) -> u32 {
        (dim.div_ceil(32) * 32).clamp(32, THREADS as usize) as u32
    }

    /// A pooled temporary of n elements (uninitialised).
    pub(crate) fn temp(&self, n: usize, dtype: DType) -> Result<CudaBuf> {
        let mem = self.pool.alloc(n * esize(dtype))?;
        Ok(CudaBuf {
            ptr: mem.ptr(),
            len: n,
            dtype,
            _mem: Arc::new(mem),
        })
    }

    /// dst[..n] = src[..n] converting between types (the device pointers may be offsets).
    pub(crate) fn convert(&self, dst: u64, dbf: i32, src: u64, sbf: i32, n: usize) -> Result<()> {
        let args = Args::new()
            .raw(dst)
            .i32(dbf)
            .raw(src)
            .i32(sbf)
            .i64(n as i64);
        self.elementwise(KERNELS, "convert_k", n, &args)
    }

    /// `op` as bf16: itself when it already is, else a converted pooled copy of n elements.
    pub(crate) fn as_bf16(&self, op: Operand, n: usize) -> Result<(Operand, Option<CudaBuf>)> {
        if op.dtype == DType::BF16 {
            return Ok((op, None));
        }
        let t = self.temp(n, DType::BF16)?;
        self.convert(t.ptr, 1, op.ptr, 0, n)?;
        Ok((t.operand(0), Some(t)))
    }

    /// A GEMM with operand types reconciled: bf16 compute when any of A, B, D is bf16 (an f32
    /// input is converted to a temporary), f32 compute otherwise. `a_n`, `b_n` are element
    /// counts of A and B for the conversion; a bias of the wrong type is converted too.
    pub(crate) fn gemm(&self, mut c: GemmCall, a_n: usize, b_n: usize) -> Result<()> {
        let bf = [c.a.dtype, c.b.dtype, c.d.dtype].contains(&DType::BF16);
        let (_ta, _tb, _tbias);
        if bf {
            (c.a, _ta) = self.as_bf16(c.a, a_n)?;
            (c.b, _tb) = self.as_bf16(c.b, b_n)?;
        }
        if let Some(b) = c.bias {
            if b.dtype != c.d.dtype {
                let t = self.temp(c.m, c.d.dtype)?;
                self.convert(t.ptr, t.bf(), b.ptr, (b.dtype == DType::BF16) as i32, c.m)?;
                c.bias = Some(t.operand(0));
                _tbias = Some(t);
            }
        }
        self.bind()?;
        self.gemm.run(&c)
    }

    /// y[m,n] (= or +=) x[m,k]·w[n,k]ᵀ (+ b[n]) on device addresses (row-major).
    pub(crate) fn gemm_xwt(
        &self,
        y: Operand,
        x: Operand,
        w: Operand,
        b: Option<Operand>,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        // Column-major: yᵀ[n,m] = (w as k×n)ᵀ · (x as k×m).
        let call = GemmCall {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            a: w,
            lda: k,
            b: x,
            ldb: k,
            d: y,
            ldd: n,
            beta: if accumulate { 1.0 } else { 0.0 },
            bias: b,
            c: None,
        };
        self.gemm(call, n * k, m * k)
    }

    /// dx[m,k] (= or +=) dy[m,n]·w[n,k] (row-major).
    pub(crate) fn gemm_dyw(
        &self,
        dx: Operand,
        dy: Operand,
        w: Operand,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        // Column-major: dxᵀ[k,m] = (w as k×n) · (dy as n×m).
        let call = GemmCall {
            transa: false,
            transb: false,
            m: k,
            n: m,
            k: n,
            a: w,
            lda: k,
            b: dy,
            ldb: n,
            d: dx,
            ldd: k,
            beta: if accumulate { 1.0 } else { 0.0 },
            bias: None,
            c: None,
        };
        self.gemm(call, n * k, m * n)
    }

    /// dw[n,k] += dy[m,n]ᵀ·x[m,k] (row-major).
    pub(crate) fn gemm_dytx(
        &self,
        dw: Operand,
        dy: Operand,
        x: Operand,
        s: MatmulShape,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        // Column-major: dwᵀ[k,n] = (x as k×m) · (dy as n×m)ᵀ.
        let call = GemmCall {
            transa: false,
            transb: true,
            m: k,
            n,
            k: m,
            a: x,
            lda: k,
            b: dy,
            ldb: n,
            d: dw,
            ldd: k,
            beta: 1.0,
            bias: None,
            c: None,
        };
        self.gemm(call, m * k, m * n)
    }

    /// The operand of a whole buffer in the compute type: converted to a bf16 temporary when
    /// `bf` and it is f32.
    pub(crate) fn operand_for(
        &self,
        b: &CudaBuf,
        n: usize,
        bf: bool,
    ) -> Result<(Operand, Option<CudaBuf>)> {
        if bf {
            self.as_bf16(b.operand(0), n)
        } else {
            Ok((b.operand(0), None))
        }
    }

    /// Device address of the error word kernels raise bits in (`describe_errors`).
    pub(crate) fn err_ptr(&self) -> u64 {
        self.err_word.ptr()
    }

    /// Streaming multiprocessors of the GPU (grid sizing).
    pub(crate) fn sms(&self) -> u32 {
        self.sms
    }

    /// The caching pool (for temporaries that are not float buffers).
    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Copies `n` values at device address `src` to the host, then checks the error word.
    pub(crate) fn read_back<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        src: u64,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut host = vec![T::default(); n];
        self.bind()?;
        // SAFETY: `host` holds `n` values of T and `src` addresses at least `n` of them in a live
        // block (the caller's buffer); a copy into pageable memory is complete when the call
        // returns.
        unsafe { dr::memcpy_dtoh_async(&mut host, src, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
        self.check_errors()?;
        Ok(host)
    }

    /// Reads and clears the device error word; an error if a kernel raised one.
    pub(crate) fn check_errors(&self) -> Result<()> {
        let mut bits = [0u32];
        self.bind()?;
        // SAFETY: `bits` is one u32 and the error word a live 4-byte block; a copy into pageable
        // memory is complete when the call returns.
        unsafe { dr::memcpy_dtoh_async(&mut bits, self.err_word.ptr(), self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: read error word: {e:?}"))?;
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: a kernel failed: {e:?}"))?;
        if bits[0] != 0 {
            self.memset(self.err_word.ptr(), 0, 4)?;
            bail!(describe_errors(bits[0]));
        }
        Ok(())
    }
}

impl Device for CudaBackend {
    type Buf = CudaBuf;
    type Idx = CudaIdx;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn prepare_kernels(&self, head_dim: usize, training: bool) {
        let Some(families) = self.families.get() else {
            return;
        };
        {
            let mut done = lock(&self.prepared);
            if done.contains(&(head_dim, training)) {
                return;
            }
            done.push((head_dim, training));
        }
        self.spawn_prefetch(nvrtc::head_dim_programs(families, head_dim, training));
    }

    fn alloc(&self, n: usize) -> Result<CudaBuf> {
        self.alloc_as(n, DType::F32)
    }

    fn alloc_as(&self, n: usize, dtype: DType) -> Result<CudaBuf> {
        let b = self.temp(n, dtype)?;
        self.memset(b.ptr, 0, n * esize(dtype))?;
        Ok(b)
    }

    fn dtype(&self, buf: &CudaBuf) -> DType {
        buf.dtype
    }

    fn compute_dtype(&self) -> DType {
        if self.compute_bf16.load(Ordering::Relaxed) {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.check_errors()
    }

    fn memory_stats(&self) -> MemoryStats {
        self.pool.stats()
    }

    fn reset_peak_memory(&self) {
        self.pool.reset_peak()
    }

    fn trim(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: synchronize: {e:?}"))?;
        self.pool.trim()
    }

    fn alloc_parts(&self, sizes: &[usize], dtype: DType) -> Result<Option<Parts<CudaBuf>>> {
        let es = esize(dtype);
        let offs = part_offsets(sizes, dtype);
        let end = offs.last().map_or(0, |&o| o + sizes[sizes.len() - 1]);
        let whole = self.alloc_as(end, dtype)?;
        let parts = sizes
            .iter()
            .zip(&offs)
            .map(|(&n, &o)| CudaBuf {
                ptr: whole.ptr + (o * es) as u64,
                len: n,
                dtype,
                _mem: whole._mem.clone(),
            })
            .collect();
        Ok(Some((whole, parts)))
    }

    fn alloc_idx(&self, n: usize) -> Result<CudaIdx> {
        let mem = self.pool.alloc(n * 4)?;
        self.memset(mem.ptr(), 0, n * 4)?;
        Ok(CudaIdx {
            ptr: mem.ptr(),
            len: n,
            _mem: mem,
        })
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn len_idx(&self, buf: &CudaIdx) -> usize {
        buf.len
    }

    fn upload(&self, dst: &mut CudaBuf, src: &[f32]) -> Result<()> {
        need(dst.len, src.len(), "upload destination")?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let r = match dst.dtype {
            // SAFETY: `dst` holds at least `src.len()` f32 (checked above); the pageable source is
            // staged before the call returns.
            DType::F32 => unsafe { dr::memcpy_htod_async(dst.ptr, src, self.stream.cu_stream()) },
            DType::BF16 => {
                // On all cores above a size: a 7B model is 7.6 G conversions per load.
                let h: Vec<bf16> = match src.len() >= PAR_CONVERT {
                    true => src.par_iter().map(|&v| bf16::from_f32(v)).collect(),
                    false => src.iter().map(|&v| bf16::from_f32(v)).collect(),
                };
                // SAFETY: `dst` holds at least `h.len()` bf16 (checked above); the staging copy
                // of pageable memory is done when the call returns, so `h` may drop after it.
                unsafe { dr::memcpy_htod_async(dst.ptr, &h, self.stream.cu_stream()) }
            }
        };
        r.map_err(|e| anyhow!("cuda: upload: {e:?}"))
    }

    fn upload_idx(&self, dst: &mut CudaIdx, src: &[u32]) -> Result<()> {
        need(dst.len, src.len(), "upload destination")?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds at least `src.len()` u32 (checked above); the pageable source is
        // staged before the call returns.
        unsafe { dr::memcpy_htod_async(dst.ptr, src, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: upload: {e:?}"))
    }

    fn download(&self, src: &CudaBuf, dst: &mut [f32]) -> Result<()> {
        need(src.len, dst.len(), "download source")?;
        if dst.is_empty() {
            return self.check_errors();
        }
        self.bind()?;
        match src.dtype {
            DType::F32 => {
                // SAFETY: `src` holds at least `dst.len()` f32 (checked above); a copy into
                // pageable memory is complete when the call returns.
                unsafe { dr::memcpy_dtoh_async(dst, src.ptr, self.stream.cu_stream()) }
                    .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
                self.check_errors()
            }
            DType::BF16 => {
                let mut h = vec![bf16::ZERO; dst.len()];
                // SAFETY: `src` holds at least `dst.len()` bf16 (checked above) and `h` as many; a
                // copy into pageable memory is complete when the call returns.
                unsafe { dr::memcpy_dtoh_async(&mut h, src.ptr, self.stream.cu_stream()) }
                    .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
                self.check_errors()?;
                match dst.len() >= PAR_CONVERT {
                    true => dst
                        .par_iter_mut()
                        .zip(h.par_iter())
                        .for_each(|(d, s)| *d = s.to_f32()),
                    false => dst.iter_mut().zip(&h).for_each(|(d, s)| *d = s.to_f32()),
                }
                Ok(())
            }
        }
    }

    fn fill(&self, buf: &mut CudaBuf, n: usize, value: f32) -> Result<()> {
        need(buf.len, n, "fill")?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let r = match buf.dtype {
            // SAFETY: `buf` holds at least `n` f32 (checked above); the memset is ordered on the
            // stream.
            DType::F32 => unsafe {
                dsys::cuMemsetD32Async(buf.ptr, value.to_bits(), n, self.stream.cu_stream())
            },
            // SAFETY: `buf` holds at least `n` bf16 (checked above); the memset is ordered on the
            // stream.
            DType::BF16 => unsafe {
                dsys::cuMemsetD16Async(
                    buf.ptr,
                    bf16::from_f32(value).to_bits(),
                    n,
                    self.stream.cu_stream(),
                )
            },
        };
        r.result().map_err(|e| anyhow!("cuda: fill: {e:?}"))
    }

    fn copy(
        &self,
        dst: &mut CudaBuf,
        dst_off: usize,
        src: &CudaBuf,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        need(src.len, src_off + n, "copy source")?;
        need(dst.len, dst_off + n, "copy destination")?;
        if n == 0 {
            return Ok(());
        }
        if dst.dtype == src.dtype {
            self.bind()?;
            // SAFETY: both ranges lie inside their buffers (checked above) and have one element
            // size; the copy is ordered on the stream after the writes of both.
            unsafe {
                dr::memcpy_dtod_async(
                    dst.at(dst_off),
                    src.at(src_off),
                    n * esize(dst.dtype),
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| anyhow!("cuda: copy: {e:?}"))
        } else {
            self.convert(dst.at(dst_off), dst.bf(), src.at(src_off), src.bf(), n)
        }
    }

    fn copy_within(
        &self,
        buf: &mut CudaBuf,
        dst_off: usize,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        need(buf.len, dst_off.max(src_off) + n, "copy_within buffer")?;
        if dst_off < src_off + n && src_off < dst_off + n && n > 0 && dst_off != src_off {
            bail!("cuda backend: copy_within ranges {src_off}+{n} and {dst_off}+{n} overlap");
        }
        if n == 0 || dst_off == src_off {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside the buffer (checked above) and do not overlap (refused
        // above).
        unsafe {
            dr::memcpy_dtod_async(
                buf.at(dst_off),
                buf.at(src_off),
                n * esize(buf.dtype),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| anyhow!("cuda: copy_within: {e:?}"))
    }

    fn graphs_supported(&self) -> bool {
        true
    }

    fn batch_invariant(&self) -> bool {
        self.gemm.batch_invariant()
    }

    fn gemm_planning(&self) -> Option<(u64, f64)> {
        Some(self.gemm.planning())
    }

    fn graph_begin(&self) -> Result<()> {
        self.bind()?;
        // Relaxed: the pool may still call cuMemAlloc for a temporary it has not cached.
        self.stream
            .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| anyhow!("cuda: begin graph capture: {e:?}"))?;
        self.pool.set_capturing(true);
        Ok(())
    }

    fn graph_end(&self) -> Result<usize> {
        self.pool.set_capturing(false);
        let g = self
            .stream
            .end_capture(dsys::CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow!("cuda: end graph capture: {e:?}"))?
            .ok_or_else(|| anyhow!("cuda: the graph capture recorded nothing"))?;
        g.upload()
            .map_err(|e| anyhow!("cuda: upload graph: {e:?}"))?;
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        graphs.push(Some(Graph(g)));
        Ok(graphs.len() - 1)
    }

    fn graph_launch(&self, id: usize) -> Result<()> {
        let graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let g = graphs
            .get(id)
            .and_then(|g| g.as_ref())
            .ok_or_else(|| anyhow!("cuda: no graph {id}"))?;
        g.0.launch()
            .map_err(|e| anyhow!("cuda: graph launch: {e:?}"))
    }

    fn graph_release(&self) -> Result<usize> {
        // A replay may still run: its memory must not be handed out before it is done.
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("cuda: synchronize: {e:?}"))?;
        self.graphs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(self.pool.release_graph_memory())
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        self.bind()?;
        let (free, total) = dr::mem_get_info().map_err(|e| anyhow!("cuda: cuMemGetInfo: {e:?}"))?;
        Ok(Some((free, total)))
    }

    fn download_idx(&self, src: &CudaIdx, dst: &mut [u32]) -> Result<()> {
        need(src.len, dst.len(), "download source")?;
        if dst.is_empty() {
            return self.check_errors();
        }
        self.bind()?;
        // SAFETY: `src` holds at least `dst.len()` u32 (checked above); a copy into pageable memory
        // is complete when the call returns.
        unsafe { dr::memcpy_dtoh_async(dst, src.ptr, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
        self.check_errors()
    }

    fn feed_tokens(
        &self,
        ids: &mut CudaIdx,
        prev: &CudaIdx,
        src: &CudaIdx,
        n: usize,
    ) -> Result<()> {
        need(ids.len, n, "feed_tokens ids")?;
        need(src.len, n, "feed_tokens src")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(KERNELS, 0, "feed_tokens_k")?;
        let args = Args::new()
            .idx(ids)
            .idx(prev)
            .idx(src)
            .i32(i32_of(n, "feed rows")?)
            .i64(prev.len as i64)
            .raw(self.err_ptr());
        self.launch(&f, (n.div_ceil(256) as u32, 1, 1), 256, 0, &args)
    }

    fn draws_start(
        &self,
        slot: usize,
        tokens: &CudaIdx,
        logprobs: &CudaBuf,
        rows: usize,
    ) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        self.start_draws(slot, tokens, logprobs, rows)?;
        Ok(None)
    }

    fn draws_wait(&self, slot: usize, rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        self.wait_draws(slot, rows)
    }
}

/// Element offsets of the parts of an `alloc_parts`: each starts where the previous one ends,
/// rounded up to [`PART_ALIGN`] bytes.
pub(crate) fn part_offsets(sizes: &[usize], dtype: DType) -> Vec<usize> {
    let step = PART_ALIGN / esize(dtype);
    let mut end = 0usize;
    sizes
        .iter()
        .map(|&n| {
            let o = end.next_multiple_of(step);
            end = o + n;
            o
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::is_input_error;

    /// On a machine without the NVIDIA driver (this one, CI) the constructor returns the
    /// input error that points the user at the CPU, and does not panic.
    #[test]
    fn no_driver_is_a_clear_input_error() {
        // SAFETY: is_culib_present only tries to load the driver library; it has no preconditions.
        if unsafe { dsys::is_culib_present() } {
            eprintln!("libcuda is present here: the no-driver path cannot be exercised");
            return;
        }
        let err = match CudaBackend::new(0) {
            Ok(_) => panic!("a backend without a driver"),
            Err(e) => e,
        };
        assert!(is_input_error(&err), "{err:#}");
        assert_eq!(err.to_string(), NO_DRIVER);
    }

    #[test]
    fn error_bits_name_the_op() {
        let m = describe_errors(1 | 16);
        assert!(m.contains("token id") && m.contains("target token"), "{m}");
        assert!(!m.contains("kv_store"));
    }

    #[test]
    fn parts_start_on_256_byte_boundaries() {
        // f32: 64 elements per 256 bytes; bf16: 128.
        assert_eq!(
            part_offsets(&[10, 64, 1, 0, 3], DType::F32),
            [0, 64, 128, 192, 192]
        );
        assert_eq!(part_offsets(&[128, 129, 5], DType::BF16), [0, 128, 384]);
        assert!(part_offsets(&[], DType::F32).is_empty());
    }
}
