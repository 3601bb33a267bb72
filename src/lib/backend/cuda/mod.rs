//! The CUDA backend: the op set on one GPU through cudarc 0.19 with dynamic loading (it builds
//! without CUDA and finds the driver, NVRTC and cuBLASLt at run time).
//!
//! - Buffers carry their element type ([`DType`]): weights and activations are bf16 where the
//!   caller allocates them so (`alloc_as`), master weights, gradients, Adam moments and
//!   statistics (rstd, lse) f32. Kernels widen every load to f32 and round every store, so any
//!   op takes any mix; GEMMs run on cuBLASLt with bf16 inputs when any operand is bf16 (f32
//!   operands are converted into a pooled temporary) and always accumulate in f32.
//! - Kernels are CUDA C in `kernels/`, one file per op family with forward and backward side by
//!   side, compiled by NVRTC at first use and cached on disk (`nvrtc.rs`).
//! - Memory comes from a caching pool (`pool.rs`); everything runs in order on one stream.
//! - Kernels never read or write out of bounds on bad indices (token ids, rows, cache ranges):
//!   they raise a bit in a device error word, which `synchronize` (and every download) reads
//!   and reports as an error naming the op.

mod draws;
pub mod gemm;
pub mod nvrtc;
pub mod parity;
pub mod pool;
pub mod timing;

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as dr, sys as dsys, CudaContext, CudaFunction, CudaGraph, CudaStream};
use half::bf16;

use self::gemm::{Gemm, GemmCall, Operand};
use self::nvrtc::{Family, KernelCache};
use self::pool::{Block, Pool};
use super::{
    AdamWStep, AttnShape, Backend, CachedAttnShape, DType, LogprobShape, MemoryStats,
    PagedAttnShape, Parts, PpoShape, PPO_STATS,
};
use crate::error::input_error;

/// Most context splits of one paged-attention row (the partial states a combine reads).
const MAX_PAGED_SPLITS: usize = 128;
/// Byte alignment of the parts of an `alloc_parts` (what the pool's blocks have): cuBLASLt
/// plans for 256-byte aligned operands and the kernels' 16-byte vector loads need 16.
pub const PART_ALIGN: usize = 256;
/// Logits per chunk of the greedy and plain sampling kernels (SCH in sample.cu).
const SAMPLE_CHUNK: usize = 4096;
/// Rows per block of `rmsnorm_fwd_k` (a warp each; the kernel derives it from blockDim).
const RMSNORM_ROWS_PER_BLOCK: usize = 4;
/// Tokens per block of `rope_store_kv_packed_k` (RPB in rope.cu).
const ROPE_TOKENS_PER_BLOCK: usize = 4;

/// The message a user sees on a machine without a usable GPU.
pub const NO_DRIVER: &str = "no CUDA driver found; use --device cpu";

/// A device buffer of `len` elements of `dtype`: its own block, or a part of a block shared
/// with the other parts of an `alloc_parts` (`ptr` then points into it).
pub struct CudaBuf {
    ptr: u64,
    len: usize,
    dtype: DType,
    _mem: Arc<Block>,
}

/// A device buffer of `len` u32 indices.
pub struct CudaIdx {
    ptr: u64,
    len: usize,
    _mem: Block,
}

impl CudaBuf {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device address of element 0, length in elements and element type, for handing the
    /// buffer to another library on another stream (NCCL in `dist`, ordered by events).
    pub fn raw(&self) -> (u64, usize, DType) {
        (self.ptr, self.len, self.dtype)
    }

    /// Device address of element `off`.
    fn at(&self, off: usize) -> u64 {
        self.ptr + (off * esize(self.dtype)) as u64
    }

    fn bf(&self) -> i32 {
        (self.dtype == DType::BF16) as i32
    }

    fn operand(&self, off: usize) -> Operand {
        Operand {
            ptr: self.at(off),
            dtype: self.dtype,
        }
    }
}

impl CudaIdx {
    fn at(&self, off: usize) -> u64 {
        self.ptr + (off * 4) as u64
    }
}

fn esize(t: DType) -> usize {
    match t {
        DType::F32 => 4,
        DType::BF16 => 2,
    }
}

/// A kernel argument: the address of a value whose bytes match the kernel's parameter.
/// Implemented only for the exact types the kernels take (no usize slips through).
trait KArg {
    fn addr(&self) -> *mut c_void;
}

macro_rules! karg {
    ($($t:ty),*) => {$(
        impl KArg for $t {
            fn addr(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
karg!(u64, i32, i64, f32, f64);

/// The rope kernel's inverse frequencies, passed by value (`struct Freqs { float f[512]; }`).
#[repr(C)]
struct Freqs([f32; 512]);
karg!(Freqs);

/// The rope half of a fused decode attention (`paged_attn_mma_rope_k`): positions, cache rows
/// of the new tokens, the cache's row count and the inverse frequencies.
struct PagedRope<'a> {
    pos: &'a CudaIdx,
    rows: &'a CudaIdx,
    cache_rows: i64,
    fr: Freqs,
}

/// The rope kernels' inverse frequencies for a head dim and base.
fn freqs(head_dim: usize, theta: f32) -> Freqs {
    let mut fr = Freqs([0.0; 512]);
    for (i, f) in fr.0.iter_mut().take(head_dim / 2).enumerate() {
        *f = inv_freq(i, head_dim, theta);
    }
    fr
}

/// A paged attention's kernel arguments from its shape: the blocks in the pool, heads, kv
/// heads, block size and table width.
fn paged_dims(
    s: PagedAttnShape,
    k_cache: &CudaBuf,
    v_cache: &CudaBuf,
) -> Result<(i64, i32, i32, i32, i32)> {
    let row = s.kv_heads * s.head_dim;
    Ok((
        (k_cache.len.min(v_cache.len) / (row * s.block_size)) as i64,
        s.heads as i32,
        s.kv_heads as i32,
        i32_of(s.block_size, "block_size")?,
        i32_of(s.max_blocks, "max_blocks")?,
    ))
}

/// Threads per block of the row and elementwise kernels.
const THREADS: u32 = 256;

/// Shorthand for size arguments: checked to fit the kernels' i32.
fn i32_of(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow!("cuda backend: {what} = {n} does not fit in 32 bits"))
}

fn need(have: usize, n: usize, what: &str) -> Result<()> {
    if have < n {
        bail!("cuda backend: {what} holds {have} elements, the op needs {n}");
    }
    Ok(())
}

/// Inverse RoPE frequency exactly as the CPU backend computes it (same f32 expression).
fn inv_freq(i: usize, head_dim: usize, theta: f32) -> f32 {
    1.0 / theta.powf((2 * i) as f32 / head_dim as f32)
}

/// Bytes of dynamic shared memory of the attention kernels for a head dim.
fn attention_smem(head_dim: usize) -> (u32, u32, u32) {
    let tile = nvrtc::attention_tile(head_dim);
    let (lds, ldp) = (head_dim + 1, tile + 1);
    let f = |tiles: usize, ptiles: usize| ((tiles * tile * lds + ptiles * tile * ldp) * 4) as u32;
    // forward: Q, K, V + P; dK/dV: K, V, Q, dO + P, dS; dQ: Q, dO, K, V + dS.
    (f(3, 1), f(4, 2), f(4, 1))
}

/// Bytes of dynamic shared memory of the tensor-core attention kernels (bf16 tiles with rows
/// padded by 8 elements; see the TQ/TK/TKB/TQB/TKQ tiles in attention.cu).
fn attention_mma_smem(head_dim: usize) -> (u32, u32, u32) {
    let kst = head_dim + 8;
    let tst = |n: usize| n + 8;
    let fwd = 64 * kst + 64 * kst + head_dim * tst(64);
    let dkdv = 2 * 64 * kst + 2 * 32 * kst + 2 * head_dim * tst(32);
    let dq = 2 * 64 * kst + 2 * 32 * kst + head_dim * tst(32);
    ((fwd * 2) as u32, (dkdv * 2) as u32, (dq * 2) as u32)
}

/// Dynamic shared memory of `paged_attn_inv_k`: the group's query rows, then two buffers of
/// a key tile and its value tile transposed (TK = 64 keys, bf16; attention.cu).
fn paged_inv_smem(head_dim: usize) -> u32 {
    let kst = head_dim + 8;
    ((16 * kst + 2 * (64 * kst + head_dim * (64 + 8))) * 2) as u32
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
    if bits & 8 != 0 {
        parts.push("attention_cached: a query reads an empty or out-of-cache range");
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
    kernels: KernelCache,
    funcs: Mutex<HashMap<(&'static str, usize, &'static str), CudaFunction>>,
    err_word: Block,
    /// Route bf16 attention with head_dim % 16 == 0 (≤ 128) to the tensor-core kernels.
    tensor_cores: AtomicBool,
    /// The decoder's compute dtype: bf16 unless a test asks for f32 (exact CPU parity).
    compute_bf16: AtomicBool,
    ordinal: usize,
    device_name: String,
    sms: u32,
    /// Captured graphs by id (`Backend::graph_*`); None once released.
    graphs: Mutex<Vec<Option<Graph>>>,
    /// Page-locked landing places of steps' draws (`Backend::draws_start`), made on first use.
    draw_slots: Mutex<[Option<draws::Slot>; 2]>,
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
        let kernels = KernelCache::new(&format!("sm_{maj}{min}"), nvrtc::default_cache_dir())?;
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
        };
        be.memset(be.err_word.ptr(), 0, 4)?;
        Ok(be)
    }

    /// Whether bf16 attention may use the tensor-core kernels (default on; the environment
    /// variable TANDEM_ATTN_SCALAR turns them off). The parity suite tests both paths.
    pub fn set_tensor_core_attention(&self, on: bool) {
        self.tensor_cores.store(on, Ordering::Relaxed);
    }

    /// Batch-invariant forward GEMMs (see `Gemm::set_batch_invariant`).
    pub fn set_batch_invariant(&self, on: bool) {
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
    fn use_mma(&self, hd: usize, bufs: &[&CudaBuf]) -> bool {
        self.tensor_cores.load(Ordering::Relaxed)
            && hd.is_multiple_of(16)
            && hd <= 128
            && bufs.iter().all(|b| b.dtype == DType::BF16)
    }

    /// `attention_paged`, or with `rope` the decode step's rope + kv_store fused in (`q` is then
    /// the fused q/k/v projection; only the tensor-core kernel takes it).
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        tables: &CudaIdx,
        seq: &CudaIdx,
        len: &CudaIdx,
        s: PagedAttnShape,
        rope: Option<PagedRope>,
    ) -> Result<()> {
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let qn = s.queries * s.heads * s.head_dim;
        need(o.len, qn, "attention_paged o")?;
        if rope.is_none() {
            need(q.len, qn, "attention_paged q")?;
        }
        need(seq.len, s.queries, "attention_paged seq")?;
        need(len.len, s.queries, "attention_paged len")?;
        if s.queries == 0 {
            return Ok(());
        }
        if s.block_size == 0 || s.max_blocks == 0 {
            bail!(
                "attention_paged: block size {} and {} blocks per table",
                s.block_size,
                s.max_blocks
            );
        }
        // One block per (query, kv head) serving its whole GQA group when the group is small
        // enough (every key/value row read once): on the tensor cores when q and the cache are
        // bf16 and head_dim is 64 or 128, else with scalar math; otherwise one block per
        // (query, head).
        let group = s.heads / s.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let err = self.err_word.ptr();
        let (num_blocks, h, kh, bsz, mb) = paged_dims(s, k_cache, v_cache)?;
        if rope.is_none()
            && self.gemm.batch_invariant()
            && group <= 16
            && self.use_mma(hd, &[o, q, k_cache, v_cache])
        {
            // Batch invariance: the training forward's tiles and arithmetic per (query, head).
            let f = self.func(nvrtc::ATTENTION, hd, "paged_attn_inv_k")?;
            return self.launch(
                &f,
                (s.queries as u32, s.kv_heads as u32, 1),
                128,
                paged_inv_smem(hd),
                &[
                    &o.ptr,
                    &q.ptr,
                    &k_cache.ptr,
                    &v_cache.ptr,
                    &tables.ptr,
                    &seq.ptr,
                    &len.ptr,
                    &h,
                    &kh,
                    &bsz,
                    &mb,
                    &num_blocks,
                    &scale,
                    &err,
                ],
            );
        }
        let mma = group <= 16 && hd.is_multiple_of(64) && self.use_mma(hd, &[q, k_cache, v_cache]);
        if rope.is_some() && !mma {
            bail!("attention_paged: the fused rope needs the tensor-core kernel");
        }
        let gqa = hd.is_multiple_of(8) && group <= 8;
        let (name, blocks_y, threshold) = if mma {
            (
                // Fewer blocks before splitting than the scalar kernels: a split costs a merge
                // pass (at 256 queries, 23 µs per layer with 2·SMs against 33 µs with 4·SMs).
                if rope.is_some() {
                    "paged_attn_mma_rope_k"
                } else {
                    "paged_attn_mma_k"
                },
                s.kv_heads,
                2 * self.sms as usize,
            )
        } else if gqa {
            ("paged_attn_gqa_k", s.kv_heads, 4 * self.sms as usize)
        } else {
            ("paged_attn_k", s.heads, 2 * self.sms as usize)
        };
        let f = self.func(nvrtc::PAGED_ATTENTION, hd, name)?;
        // Flash-decoding: split the context when there are too few blocks to fill the GPU.
        // Each row cuts its own context into even splits of at least 64 positions (split_len
        // 0, see `row_split` in the kernel), so the split count depends on the number of
        // queries alone and a row's result does not depend on the table width: a decode step
        // replayed from a CUDA graph (tables padded to a fixed width) gives the eager bits.
        let pairs = s.queries * s.heads;
        let splits = threshold
            .div_ceil(s.queries * blocks_y)
            .clamp(1, MAX_PAGED_SPLITS);
        let split_len = 0usize;
        let (part_o, part_ml) = if splits > 1 {
            (
                self.temp(pairs * splits * hd, DType::F32)?,
                self.temp(pairs * splits * 2, DType::F32)?,
            )
        } else {
            (self.temp(1, DType::F32)?, self.temp(2, DType::F32)?)
        };
        let (obf, qbf, kbf, vbf) = (o.bf(), q.bf(), k_cache.bf(), v_cache.bf());
        let sl = i32_of(split_len, "split_len")?;
        let grid = (s.queries as u32, blocks_y as u32, splits as u32);
        if mma {
            let mut args: Vec<&dyn KArg> = vec![
                &o.ptr,
                &obf,
                &q.ptr,
                &k_cache.ptr,
                &v_cache.ptr,
                &tables.ptr,
                &seq.ptr,
                &len.ptr,
                &h,
                &kh,
                &bsz,
                &mb,
                &num_blocks,
                &sl,
                &scale,
                &part_o.ptr,
                &part_ml.ptr,
                &err,
            ];
            // paged_attn_mma_rope_k: the same, then the rope's.
            if let Some(r) = &rope {
                args.extend([&r.pos.ptr as &dyn KArg, &r.rows.ptr, &r.cache_rows, &r.fr]);
            }
            self.launch(&f, grid, 128, 0, &args)?;
        } else {
            self.launch(
                &f,
                grid,
                128,
                0,
                &[
                    &o.ptr,
                    &obf,
                    &q.ptr,
                    &qbf,
                    &k_cache.ptr,
                    &kbf,
                    &v_cache.ptr,
                    &vbf,
                    &tables.ptr,
                    &seq.ptr,
                    &len.ptr,
                    &h,
                    &kh,
                    &bsz,
                    &mb,
                    &num_blocks,
                    &sl,
                    &scale,
                    &part_o.ptr,
                    &part_ml.ptr,
                    &err,
                ],
            )?;
        }
        if splits > 1 {
            let c = self.func(nvrtc::PAGED_ATTENTION, hd, "paged_combine_k")?;
            let sp = splits as i32;
            self.launch(
                &c,
                (s.queries as u32, s.heads as u32, 1),
                Self::row_threads(hd),
                0,
                &[&o.ptr, &obf, &part_o.ptr, &part_ml.ptr, &h, &sp],
            )?;
        }
        Ok(())
    }

    /// The GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The NVRTC target, e.g. "sm_90".
    pub fn arch(&self) -> &str {
        self.kernels.arch()
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.kernels.nvrtc_version()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op runs on (for events and graphs).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("cuda: bind context: {e:?}"))
    }

    fn memset(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        unsafe { dr::memset_d8_async(ptr, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: memset: {e:?}"))
    }

    /// The kernel `name` of `fam` (attention: compiled for head dim `hd`), compiled on first use.
    fn func(&self, fam: Family, hd: usize, name: &'static str) -> Result<CudaFunction> {
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
            .map_err(|e| anyhow!("cuda: load kernels/{}.cu: {e:?}", fam.name))?;
        let f = module
            .load_function(name)
            .map_err(|e| anyhow!("cuda: kernel {name} in kernels/{}.cu: {e:?}", fam.name))?;
        if fam.name == nvrtc::ATTENTION.name {
            let (fwd, dkdv, dq) = attention_smem(hd);
            let (mfwd, mdkdv, mdq) = attention_mma_smem(hd);
            let bytes = match name {
                "attn_fwd_k" => fwd,
                "attn_bwd_dkdv_k" => dkdv,
                "attn_bwd_dq_k" => dq,
                "attn_fwd_mma_k" => mfwd,
                "attn_bwd_dkdv_mma_k" => mdkdv,
                "attn_bwd_dq_mma_k" => mdq,
                "paged_attn_inv_k" => paged_inv_smem(hd),
                "paged_prefill_mma_k" => mfwd,
                _ => 0,
            };
            if bytes > 0 {
                unsafe {
                    dr::function::set_function_attribute(
                        f.cu_function(),
                        dsys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                }
                .map_err(|e| anyhow!("cuda: {name}: {bytes} B of shared memory: {e:?}"))?;
            }
        }
        funcs.insert(key, f.clone());
        Ok(f)
    }

    fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KArg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.bind()?;
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.addr()).collect();
        unsafe {
            dr::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                smem,
                self.stream.cu_stream(),
                &mut ptrs,
            )
        }
        .map_err(|e| anyhow!("cuda: launch failed: {e:?}"))
    }

    /// Blocks for a grid-stride loop over n elements.
    fn stride_blocks(&self, n: usize) -> u32 {
        (n.div_ceil(THREADS as usize) as u64).clamp(1, self.sms as u64 * 8) as u32
    }

    fn elementwise(
        &self,
        fam: Family,
        name: &'static str,
        n: usize,
        args: &[&dyn KArg],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.func(fam, 0, name)?;
        self.launch(&f, (self.stride_blocks(n), 1, 1), THREADS, 0, args)
    }

    /// Threads for a one-block-per-row kernel over rows of `dim`.
    fn row_threads(dim: usize) -> u32 {
        (dim.div_ceil(32) * 32).clamp(32, THREADS as usize) as u32
    }

    /// A pooled temporary of n elements (uninitialised).
    fn temp(&self, n: usize, dtype: DType) -> Result<CudaBuf> {
        let mem = self.pool.alloc(n * esize(dtype))?;
        Ok(CudaBuf {
            ptr: mem.ptr(),
            len: n,
            dtype,
            _mem: Arc::new(mem),
        })
    }

    /// dst[..n] = src[..n] converting between types (the device pointers may be offsets).
    fn convert(&self, dst: u64, dbf: i32, src: u64, sbf: i32, n: usize) -> Result<()> {
        let n64 = n as i64;
        self.elementwise(
            nvrtc::MEMORY,
            "convert_k",
            n,
            &[&dst, &dbf, &src, &sbf, &n64],
        )
    }

    /// `op` as bf16: itself when it already is, else a converted pooled copy of n elements.
    fn as_bf16(&self, op: Operand, n: usize) -> Result<(Operand, Option<CudaBuf>)> {
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
    fn gemm(&self, mut c: GemmCall, a_n: usize, b_n: usize) -> Result<()> {
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
    #[allow(clippy::too_many_arguments)]
    fn gemm_xwt(
        &self,
        y: Operand,
        x: Operand,
        w: Operand,
        b: Option<Operand>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
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
    #[allow(clippy::too_many_arguments)]
    fn gemm_dyw(
        &self,
        dx: Operand,
        dy: Operand,
        w: Operand,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
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
    fn gemm_dytx(
        &self,
        dw: Operand,
        dy: Operand,
        x: Operand,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
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

    /// dst[c] += Σ_r a[r,c] (deterministic: per-block partial sums, then a fixed-order sum).
    fn colsum_add(&self, dst: &CudaBuf, a: u64, abf: i32, rows: usize, cols: usize) -> Result<()> {
        const ROWS_PER_BLOCK: usize = 64;
        let blocks = rows.div_ceil(ROWS_PER_BLOCK).max(1);
        let part = self.temp(blocks * cols, DType::F32)?;
        let (r, c, rpb, b) = (
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
            ROWS_PER_BLOCK as i32,
            blocks as i32,
        );
        let f = self.func(nvrtc::MEMORY, 0, "colsum_partial_k")?;
        let gx = cols.div_ceil(THREADS as usize) as u32;
        self.launch(
            &f,
            (gx, blocks as u32, 1),
            THREADS,
            0,
            &[&part.ptr, &a, &abf, &r, &c, &rpb],
        )?;
        let f = self.func(nvrtc::MEMORY, 0, "colsum_finish_k")?;
        let dbf = dst.bf();
        self.launch(
            &f,
            (gx, 1, 1),
            THREADS,
            0,
            &[&dst.ptr, &dbf, &part.ptr, &b, &c],
        )
    }

    /// Reads and clears the device error word; an error if a kernel raised one.
    fn check_errors(&self) -> Result<()> {
        let mut bits = [0u32];
        self.bind()?;
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

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Idx = CudaIdx;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
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

    fn logprob_chunk_floats(&self) -> usize {
        // 1 GiB of f32 logits (~1700 rows at vocab 151,936): the LM-head GEMMs run at full
        // size and the head's f32 gradient is read and written a few times per micro-batch
        // instead of once per ~100 rows.
        256 << 20
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
            DType::F32 => unsafe { dr::memcpy_htod_async(dst.ptr, src, self.stream.cu_stream()) },
            DType::BF16 => {
                let h: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
                // The staging copy of pageable memory is done when the call returns.
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
                unsafe { dr::memcpy_dtoh_async(dst, src.ptr, self.stream.cu_stream()) }
                    .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
                self.check_errors()
            }
            DType::BF16 => {
                let mut h = vec![bf16::ZERO; dst.len()];
                unsafe { dr::memcpy_dtoh_async(&mut h, src.ptr, self.stream.cu_stream()) }
                    .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
                self.check_errors()?;
                dst.iter_mut().zip(&h).for_each(|(d, s)| *d = s.to_f32());
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
            DType::F32 => unsafe {
                dsys::cuMemsetD32Async(buf.ptr, value.to_bits(), n, self.stream.cu_stream())
            },
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

    fn add_assign(&self, y: &mut CudaBuf, x: &CudaBuf, n: usize) -> Result<()> {
        need(y.len, n, "y")?;
        need(x.len, n, "x")?;
        let (ybf, xbf, n64) = (y.bf(), x.bf(), n as i64);
        self.elementwise(
            nvrtc::MEMORY,
            "add_assign_k",
            n,
            &[&y.ptr, &ybf, &x.ptr, &xbf, &n64],
        )
    }

    fn matmul(
        &self,
        y: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        b: Option<&CudaBuf>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        need(y.len, m * n, "matmul y")?;
        need(x.len, m * k, "matmul x")?;
        need(w.len, n * k, "matmul w")?;
        if let Some(b) = b {
            need(b.len, n, "matmul bias")?;
        }
        if k == 0 {
            // An empty sum: y = b (or y += b), which cuBLASLt does not do for k = 0.
            if !accumulate {
                self.fill_raw(y, m * n, 0.0)?;
            }
            if let Some(b) = b {
                for r in 0..m {
                    self.add_raw(y.at(r * n), y.bf(), b.ptr, b.bf(), n)?;
                }
            }
            return Ok(());
        }
        self.gemm_xwt(
            y.operand(0),
            x.operand(0),
            w.operand(0),
            b.map(|b| b.operand(0)),
            m,
            k,
            n,
            accumulate,
        )
    }

    fn matmul_residual(
        &self,
        y: &mut CudaBuf,
        r: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        need(y.len, m * n, "matmul_residual y")?;
        need(r.len, m * n, "matmul_residual r")?;
        need(x.len, m * k, "matmul_residual x")?;
        need(w.len, n * k, "matmul_residual w")?;
        if k == 0 || r.dtype != y.dtype {
            // cuBLASLt reads C in D's type: copy (converting) and accumulate instead.
            self.copy(y, 0, r, 0, m * n)?;
            return self.matmul(y, x, w, None, m, k, n, true);
        }
        // One GEMM: D = y, C = r, beta 1 (no separate copy of the residual).
        let call = GemmCall {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            a: w.operand(0),
            lda: k,
            b: x.operand(0),
            ldb: k,
            d: y.operand(0),
            ldd: n,
            beta: 1.0,
            bias: None,
            c: Some(r.operand(0)),
        };
        self.gemm(call, n * k, m * k)
    }

    fn matmul_backward_x(
        &self,
        dx: &mut CudaBuf,
        dy: &CudaBuf,
        w: &CudaBuf,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        need(dx.len, m * k, "matmul dx")?;
        need(dy.len, m * n, "matmul dy")?;
        need(w.len, n * k, "matmul w")?;
        if n == 0 {
            return if accumulate {
                Ok(())
            } else {
                self.fill_raw(dx, m * k, 0.0)
            };
        }
        self.gemm_dyw(
            dx.operand(0),
            dy.operand(0),
            w.operand(0),
            m,
            k,
            n,
            accumulate,
        )
    }

    fn matmul_backward_w(
        &self,
        dw: &mut CudaBuf,
        db: Option<&mut CudaBuf>,
        dy: &CudaBuf,
        x: &CudaBuf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        need(dw.len, n * k, "matmul dw")?;
        need(dy.len, m * n, "matmul dy")?;
        need(x.len, m * k, "matmul x")?;
        if m == 0 {
            return Ok(());
        }
        if k > 0 {
            self.gemm_dytx(dw.operand(0), dy.operand(0), x.operand(0), m, k, n)?;
        }
        if let Some(db) = db {
            need(db.len, n, "matmul db")?;
            self.colsum_add(db, dy.ptr, dy.bf(), m, n)?;
        }
        Ok(())
    }

    fn embedding(
        &self,
        out: &mut CudaBuf,
        table: &CudaBuf,
        ids: &CudaIdx,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        need(out.len, tokens * dim, "embedding out")?;
        need(ids.len, tokens, "embedding ids")?;
        if dim == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::EMBEDDING, 0, "embedding_fwd_k")?;
        let (obf, tbf) = (out.bf(), table.bf());
        let (t, d, vocab) = (
            i32_of(tokens, "tokens")?,
            i32_of(dim, "dim")?,
            (table.len / dim) as i64,
        );
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &out.ptr, &obf, &table.ptr, &tbf, &ids.ptr, &t, &d, &vocab, &err,
            ],
        )
    }

    fn embedding_backward(
        &self,
        dtable: &mut CudaBuf,
        dout: &CudaBuf,
        ids: &CudaIdx,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        need(dout.len, tokens * dim, "embedding dout")?;
        need(ids.len, tokens, "embedding ids")?;
        if dim == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::EMBEDDING, 0, "embedding_bwd_k")?;
        let (dbf, obf) = (dtable.bf(), dout.bf());
        let (t, d, vocab) = (
            i32_of(tokens, "tokens")?,
            i32_of(dim, "dim")?,
            (dtable.len / dim) as i64,
        );
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &dtable.ptr,
                &dbf,
                &dout.ptr,
                &obf,
                &ids.ptr,
                &t,
                &d,
                &vocab,
                &err,
            ],
        )
    }

    fn rmsnorm(
        &self,
        y: &mut CudaBuf,
        rstd: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        need(y.len, rows * dim, "rmsnorm y")?;
        need(rstd.len, rows, "rmsnorm rstd")?;
        need(x.len, rows * dim, "rmsnorm x")?;
        need(w.len, dim, "rmsnorm w")?;
        if dim == 0 {
            return Ok(());
        }
        // rstd is a statistic: kept in f32 whatever the caller allocated.
        let rs = if rstd.dtype == DType::F32 {
            None
        } else {
            Some(self.temp(rows, DType::F32)?)
        };
        let rs_ptr = rs.as_ref().map_or(rstd.ptr, |t| t.ptr);
        let (ybf, xbf, wbf) = (y.bf(), x.bf(), w.bf());
        let (r, d) = (i32_of(rows, "rows")?, i32_of(dim, "dim")?);
        let f = self.func(nvrtc::RMSNORM, 0, "rmsnorm_fwd_k")?;
        self.launch(
            &f,
            (rows.div_ceil(RMSNORM_ROWS_PER_BLOCK) as u32, 1, 1),
            32 * RMSNORM_ROWS_PER_BLOCK as u32,
            0,
            &[
                &y.ptr, &ybf, &rs_ptr, &x.ptr, &xbf, &w.ptr, &wbf, &r, &d, &eps,
            ],
        )?;
        if let Some(t) = rs {
            self.convert(rstd.ptr, rstd.bf(), t.ptr, 0, rows)?;
        }
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CudaBuf,
        dw: &mut CudaBuf,
        dy: &CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        rstd: &CudaBuf,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()> {
        need(dx.len, rows * dim, "rmsnorm dx")?;
        need(dw.len, dim, "rmsnorm dw")?;
        need(dy.len, rows * dim, "rmsnorm dy")?;
        need(x.len, rows * dim, "rmsnorm x")?;
        need(w.len, dim, "rmsnorm w")?;
        need(rstd.len, rows, "rmsnorm rstd")?;
        if dim == 0 || rows == 0 {
            return Ok(());
        }
        let rs = if rstd.dtype == DType::F32 {
            None
        } else {
            let t = self.temp(rows, DType::F32)?;
            self.convert(t.ptr, 0, rstd.ptr, 1, rows)?;
            Some(t)
        };
        let rs_ptr = rs.as_ref().map_or(rstd.ptr, |t| t.ptr);
        let (dxbf, dybf, xbf, wbf) = (dx.bf(), dy.bf(), x.bf(), w.bf());
        let (r, d, acc) = (
            i32_of(rows, "rows")?,
            i32_of(dim, "dim")?,
            accumulate as i32,
        );
        let f = self.func(nvrtc::RMSNORM, 0, "rmsnorm_bwd_dx_k")?;
        self.launch(
            &f,
            (rows as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &dx.ptr, &dxbf, &dy.ptr, &dybf, &x.ptr, &xbf, &w.ptr, &wbf, &rs_ptr, &r, &d, &acc,
            ],
        )?;
        const ROWS_PER_BLOCK: usize = 64;
        let blocks = rows.div_ceil(ROWS_PER_BLOCK);
        let part = self.temp(blocks * dim, DType::F32)?;
        let rpb = ROWS_PER_BLOCK as i32;
        let f = self.func(nvrtc::RMSNORM, 0, "rmsnorm_bwd_dw_partial_k")?;
        let gx = dim.div_ceil(THREADS as usize) as u32;
        self.launch(
            &f,
            (gx, blocks as u32, 1),
            THREADS,
            0,
            &[
                &part.ptr, &dy.ptr, &dybf, &x.ptr, &xbf, &rs_ptr, &r, &d, &rpb,
            ],
        )?;
        let f = self.func(nvrtc::MEMORY, 0, "colsum_finish_k")?;
        let (dwbf, b) = (dw.bf(), blocks as i32);
        self.launch(
            &f,
            (gx, 1, 1),
            THREADS,
            0,
            &[&dw.ptr, &dwbf, &part.ptr, &b, &d],
        )
    }

    fn rope(
        &self,
        x: &mut CudaBuf,
        pos: &CudaIdx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        self.rope_dir(x, pos, tokens, heads, head_dim, theta, 1.0)
    }

    fn rope_backward(
        &self,
        dx: &mut CudaBuf,
        pos: &CudaIdx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        self.rope_dir(dx, pos, tokens, heads, head_dim, theta, -1.0)
    }

    fn attention(
        &self,
        o: &mut CudaBuf,
        lse: &mut CudaBuf,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        cu_seqlens: &CudaIdx,
        s: AttnShape,
    ) -> Result<()> {
        let (hd, group) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let _ = group;
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        need(o.len, qn, "attention o")?;
        need(lse.len, s.tokens * s.heads, "attention lse")?;
        need(q.len, qn, "attention q")?;
        need(k.len, kn, "attention k")?;
        need(v.len, kn, "attention v")?;
        need(cu_seqlens.len, s.seqs + 1, "attention cu_seqlens")?;
        if s.tokens == 0 || s.seqs == 0 {
            return Ok(());
        }
        let (obf, lbf, qbf, kbf, vbf) = (o.bf(), lse.bf(), q.bf(), k.bf(), v.bf());
        let (t, sq, h, kh) = shape_args(s)?;
        let scale = 1.0 / (hd as f32).sqrt();
        if self.use_mma(hd, &[o, q, k, v]) {
            let f = self.func(nvrtc::ATTENTION, hd, "attn_fwd_mma_k")?;
            return self.launch(
                &f,
                (s.tokens.div_ceil(64) as u32, s.heads as u32, 1),
                128,
                attention_mma_smem(hd).0,
                &[
                    &o.ptr,
                    &lse.ptr,
                    &lbf,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            );
        }
        let tile = nvrtc::attention_tile(hd);
        let (smem, _, _) = attention_smem(hd);
        let f = self.func(nvrtc::ATTENTION, hd, "attn_fwd_k")?;
        self.launch(
            &f,
            (s.tokens.div_ceil(tile) as u32, s.heads as u32, 1),
            256,
            smem,
            &[
                &o.ptr,
                &obf,
                &lse.ptr,
                &lbf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )
    }

    fn attention_backward(
        &self,
        dq: &mut CudaBuf,
        dk: &mut CudaBuf,
        dv: &mut CudaBuf,
        dout: &CudaBuf,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        o: &CudaBuf,
        lse: &CudaBuf,
        cu_seqlens: &CudaIdx,
        s: AttnShape,
    ) -> Result<()> {
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let (qn, kn) = (
            s.tokens * s.heads * s.head_dim,
            s.tokens * s.kv_heads * s.head_dim,
        );
        need(dq.len, qn, "attention dq")?;
        need(dk.len, kn, "attention dk")?;
        need(dv.len, kn, "attention dv")?;
        need(dout.len, qn, "attention dout")?;
        need(q.len, qn, "attention q")?;
        need(k.len, kn, "attention k")?;
        need(v.len, kn, "attention v")?;
        need(o.len, qn, "attention o")?;
        need(lse.len, s.tokens * s.heads, "attention lse")?;
        need(cu_seqlens.len, s.seqs + 1, "attention cu_seqlens")?;
        if s.tokens == 0 {
            return Ok(());
        }
        if s.seqs == 0 {
            self.fill_raw(dq, qn, 0.0)?;
            self.fill_raw(dk, kn, 0.0)?;
            return self.fill_raw(dv, kn, 0.0);
        }
        let tile = nvrtc::attention_tile(hd);
        let (_, smem_dkdv, smem_dq) = attention_smem(hd);
        let (t, sq, h, kh) = shape_args(s)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let rows = s.tokens * s.heads;
        let dd = self.temp(rows, DType::F32)?;
        let (dobf, obf, qbf, kbf, vbf, lbf) = (dout.bf(), o.bf(), q.bf(), k.bf(), v.bf(), lse.bf());
        let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_prep_k")?;
        self.launch(
            &f,
            ((rows * 32).div_ceil(THREADS as usize) as u32, 1, 1),
            THREADS,
            0,
            &[&dd.ptr, &dout.ptr, &dobf, &o.ptr, &obf, &t, &h],
        )?;
        if self.use_mma(hd, &[dq, dk, dv, dout, q, k, v]) {
            let (_, smem_dkdv, smem_dq) = attention_mma_smem(hd);
            let tiles = s.tokens.div_ceil(64) as u32;
            // Per query head dK/dV in f32, then summed over each kv head's group.
            let (dkp, dvp) = (self.temp(qn, DType::F32)?, self.temp(qn, DType::F32)?);
            let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_dkdv_mma_k")?;
            self.launch(
                &f,
                (tiles, s.heads as u32, 1),
                128,
                smem_dkdv,
                &[
                    &dkp.ptr,
                    &dvp.ptr,
                    &dout.ptr,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &lse.ptr,
                    &lbf,
                    &dd.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            )?;
            let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_group_sum_k")?;
            let (dkbf, dvbf) = (dk.bf(), dv.bf());
            self.launch(
                &f,
                (self.stride_blocks(kn), 1, 1),
                THREADS,
                0,
                &[
                    &dk.ptr, &dkbf, &dv.ptr, &dvbf, &dkp.ptr, &dvp.ptr, &t, &h, &kh,
                ],
            )?;
            let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_dq_mma_k")?;
            return self.launch(
                &f,
                (tiles, s.heads as u32, 1),
                128,
                smem_dq,
                &[
                    &dq.ptr,
                    &dout.ptr,
                    &q.ptr,
                    &k.ptr,
                    &v.ptr,
                    &lse.ptr,
                    &lbf,
                    &dd.ptr,
                    &cu_seqlens.ptr,
                    &t,
                    &sq,
                    &h,
                    &kh,
                    &scale,
                ],
            );
        }
        let tiles = s.tokens.div_ceil(tile) as u32;
        let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_dkdv_k")?;
        let (dkbf, dvbf, dqbf) = (dk.bf(), dv.bf(), dq.bf());
        self.launch(
            &f,
            (tiles, s.kv_heads as u32, 1),
            256,
            smem_dkdv,
            &[
                &dk.ptr,
                &dkbf,
                &dv.ptr,
                &dvbf,
                &dout.ptr,
                &dobf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &lse.ptr,
                &lbf,
                &dd.ptr,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )?;
        let f = self.func(nvrtc::ATTENTION, hd, "attn_bwd_dq_k")?;
        self.launch(
            &f,
            (tiles, s.heads as u32, 1),
            256,
            smem_dq,
            &[
                &dq.ptr,
                &dqbf,
                &dout.ptr,
                &dobf,
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &lse.ptr,
                &lbf,
                &dd.ptr,
                &cu_seqlens.ptr,
                &t,
                &sq,
                &h,
                &kh,
                &scale,
            ],
        )
    }

    fn rope_store_kv(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        pos: &CudaIdx,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        rows: &CudaIdx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || head_dim > 1024 {
            bail!("rope: head_dim {head_dim} must be even and at most 1024");
        }
        let kd = kv_heads * head_dim;
        need(q.len, tokens * heads * head_dim, "rope_store_kv q")?;
        need(k.len, tokens * kd, "rope_store_kv k")?;
        need(v.len, tokens * kd, "rope_store_kv v")?;
        need(pos.len, tokens, "rope_store_kv pos")?;
        need(rows.len, tokens, "rope_store_kv rows")?;
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        let fr = freqs(head_dim, theta);
        let f = self.func(nvrtc::ROPE, 0, "rope_store_kv_k")?;
        let (qbf, kbf, vbf, kcbf, vcbf) = (q.bf(), k.bf(), v.bf(), k_cache.bf(), v_cache.bf());
        let (t, h, kh, d) = (
            i32_of(tokens, "tokens")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            head_dim as i32,
        );
        let cache_rows = (k_cache.len.min(v_cache.len) / kd) as i64;
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads((heads + kv_heads) * head_dim / 2),
            0,
            &[
                &q.ptr,
                &qbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &pos.ptr,
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &rows.ptr,
                &t,
                &h,
                &kh,
                &d,
                &cache_rows,
                &fr,
                &err,
            ],
        )
    }

    fn kv_store(
        &self,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        row_dim: usize,
    ) -> Result<()> {
        need(rows.len, n, "kv_store rows")?;
        need(k.len, n * row_dim, "kv_store k")?;
        need(v.len, n * row_dim, "kv_store v")?;
        if n == 0 || row_dim == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::MEMORY, 0, "kv_store_k")?;
        let (kcbf, vcbf, kbf, vbf) = (k_cache.bf(), v_cache.bf(), k.bf(), v.bf());
        let (nn, rd) = (i32_of(n, "n")?, i32_of(row_dim, "row_dim")?);
        let cache_rows = (k_cache.len.min(v_cache.len) / row_dim) as i64;
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(row_dim),
            0,
            &[
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &k.ptr,
                &kbf,
                &v.ptr,
                &vbf,
                &rows.ptr,
                &nn,
                &rd,
                &cache_rows,
                &err,
            ],
        )
    }

    fn rope_store_kv_packed(
        &self,
        qkv: &CudaBuf,
        q_out: &mut CudaBuf,
        pos: &CudaIdx,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        rows: &CudaIdx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || head_dim > 1024 {
            bail!("rope: head_dim {head_dim} must be even and at most 1024");
        }
        let (qd, kd) = (heads * head_dim, kv_heads * head_dim);
        need(qkv.len, tokens * (qd + 2 * kd), "rope_store_kv_packed qkv")?;
        need(q_out.len, tokens * qd, "rope_store_kv_packed q")?;
        need(pos.len, tokens, "rope_store_kv_packed pos")?;
        need(rows.len, tokens, "rope_store_kv_packed rows")?;
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        let fr = freqs(head_dim, theta);
        let f = self.func(nvrtc::ROPE, 0, "rope_store_kv_packed_k")?;
        let (xbf, qbf, kcbf, vcbf) = (qkv.bf(), q_out.bf(), k_cache.bf(), v_cache.bf());
        let (t, h, kh, d) = (
            i32_of(tokens, "tokens")?,
            i32_of(heads, "heads")?,
            i32_of(kv_heads, "kv_heads")?,
            head_dim as i32,
        );
        let cache_rows = (k_cache.len.min(v_cache.len) / kd) as i64;
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (tokens.div_ceil(ROPE_TOKENS_PER_BLOCK) as u32, 1, 1),
            Self::row_threads((heads + kv_heads) * head_dim / 2),
            0,
            &[
                &qkv.ptr,
                &xbf,
                &q_out.ptr,
                &qbf,
                &pos.ptr,
                &k_cache.ptr,
                &kcbf,
                &v_cache.ptr,
                &vcbf,
                &rows.ptr,
                &t,
                &h,
                &kh,
                &d,
                &cache_rows,
                &fr,
                &err,
            ],
        )
    }

    fn attention_cached(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        base: &CudaIdx,
        len: &CudaIdx,
        s: CachedAttnShape,
    ) -> Result<()> {
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let qn = s.queries * s.heads * s.head_dim;
        need(o.len, qn, "attention_cached o")?;
        need(q.len, qn, "attention_cached q")?;
        need(base.len, s.queries, "attention_cached base")?;
        need(len.len, s.queries, "attention_cached len")?;
        if s.queries == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::ATTENTION, hd, "attn_cached_k")?;
        let (obf, qbf, kbf, vbf) = (o.bf(), q.bf(), k_cache.bf(), v_cache.bf());
        let (nq, h, kh) = (
            i32_of(s.queries, "queries")?,
            s.heads as i32,
            s.kv_heads as i32,
        );
        let cache_rows = (k_cache.len.min(v_cache.len) / (s.kv_heads * hd)) as i64;
        let scale = 1.0 / (hd as f32).sqrt();
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (s.queries as u32, s.heads as u32, 1),
            128,
            0,
            &[
                &o.ptr,
                &obf,
                &q.ptr,
                &qbf,
                &k_cache.ptr,
                &kbf,
                &v_cache.ptr,
                &vbf,
                &base.ptr,
                &len.ptr,
                &nq,
                &h,
                &kh,
                &cache_rows,
                &scale,
                &err,
            ],
        )
    }

    fn swiglu(&self, h: &mut CudaBuf, g: &CudaBuf, u: &CudaBuf, n: usize) -> Result<()> {
        need(h.len, n, "swiglu h")?;
        need(g.len, n, "swiglu g")?;
        need(u.len, n, "swiglu u")?;
        if let Some(n8) = vec8(n, &[h, g, u]) {
            return self.elementwise(
                nvrtc::SWIGLU,
                "swiglu_fwd_v8_k",
                n8 as usize,
                &[&h.ptr, &g.ptr, &u.ptr, &n8],
            );
        }
        let (hbf, gbf, ubf, n64) = (h.bf(), g.bf(), u.bf(), n as i64);
        self.elementwise(
            nvrtc::SWIGLU,
            "swiglu_fwd_k",
            n,
            &[&h.ptr, &hbf, &g.ptr, &gbf, &u.ptr, &ubf, &n64],
        )
    }

    fn swiglu_packed(&self, h: &mut CudaBuf, gu: &CudaBuf, n: usize, f: usize) -> Result<()> {
        need(h.len, n * f, "swiglu_packed h")?;
        need(gu.len, 2 * n * f, "swiglu_packed gu")?;
        if n * f == 0 {
            return Ok(());
        }
        // Whole 8-element groups per half row: f a multiple of 8 (vec8 checks n·f and 2·n·f).
        if vec8(n * f, &[h, gu]).is_some() && f.is_multiple_of(8) {
            let (f8, rows) = (i32_of(f / 8, "f")?, i32_of(n, "rows")?);
            let threads = 128u32;
            let fn_ = self.func(nvrtc::SWIGLU, 0, "swiglu_packed_v8_k")?;
            return self.launch(
                &fn_,
                (
                    (f / 8).div_ceil(threads as usize) as u32,
                    n.min(65535) as u32,
                    1,
                ),
                threads,
                0,
                &[&h.ptr, &gu.ptr, &f8, &rows],
            );
        }
        let (hbf, gbf, ff, n64) = (h.bf(), gu.bf(), f as i64, (n * f) as i64);
        self.elementwise(
            nvrtc::SWIGLU,
            "swiglu_packed_k",
            n * f,
            &[&h.ptr, &hbf, &gu.ptr, &gbf, &ff, &n64],
        )
    }

    fn swiglu_backward(
        &self,
        dg: &mut CudaBuf,
        du: &mut CudaBuf,
        dh: &CudaBuf,
        g: &CudaBuf,
        u: &CudaBuf,
        n: usize,
    ) -> Result<()> {
        need(dg.len, n, "swiglu dg")?;
        need(du.len, n, "swiglu du")?;
        need(dh.len, n, "swiglu dh")?;
        need(g.len, n, "swiglu g")?;
        need(u.len, n, "swiglu u")?;
        if let Some(n8) = vec8(n, &[dg, du, dh, g, u]) {
            return self.elementwise(
                nvrtc::SWIGLU,
                "swiglu_bwd_v8_k",
                n8 as usize,
                &[&dg.ptr, &du.ptr, &dh.ptr, &g.ptr, &u.ptr, &n8],
            );
        }
        let (dgbf, dubf, dhbf, gbf, ubf, n64) =
            (dg.bf(), du.bf(), dh.bf(), g.bf(), u.bf(), n as i64);
        self.elementwise(
            nvrtc::SWIGLU,
            "swiglu_bwd_k",
            n,
            &[
                &dg.ptr, &dgbf, &du.ptr, &dubf, &dh.ptr, &dhbf, &g.ptr, &gbf, &u.ptr, &ubf, &n64,
            ],
        )
    }

    fn gather_rows(
        &self,
        out: &mut CudaBuf,
        x: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        need(rows.len, n, "gather rows")?;
        need(out.len, n * dim, "gather out")?;
        if n == 0 || dim == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::MEMORY, 0, "gather_rows_k")?;
        let (obf, xbf) = (out.bf(), x.bf());
        let (nn, d, xr) = (i32_of(n, "n")?, i32_of(dim, "dim")?, (x.len / dim) as i64);
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[&out.ptr, &obf, &x.ptr, &xbf, &rows.ptr, &nn, &d, &xr, &err],
        )
    }

    fn scatter_add_rows(
        &self,
        dx: &mut CudaBuf,
        dout: &CudaBuf,
        rows: &CudaIdx,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        need(rows.len, n, "scatter rows")?;
        need(dout.len, n * dim, "scatter dout")?;
        if n == 0 || dim == 0 {
            return Ok(());
        }
        let f = self.func(nvrtc::MEMORY, 0, "scatter_add_rows_k")?;
        let (dbf, obf) = (dx.bf(), dout.bf());
        let (nn, d, xr) = (i32_of(n, "n")?, i32_of(dim, "dim")?, (dx.len / dim) as i64);
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (n as u32, 1, 1),
            Self::row_threads(dim),
            0,
            &[
                &dx.ptr, &dbf, &dout.ptr, &obf, &rows.ptr, &nn, &d, &xr, &err,
            ],
        )
    }

    fn logprob(
        &self,
        lp: &mut CudaBuf,
        ent: Option<&mut CudaBuf>,
        lse: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        targets: &CudaIdx,
        s: LogprobShape,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        check_logprob(&s)?;
        need(lp.len, s.rows, "logprob lp")?;
        need(lse.len, s.rows, "logprob lse")?;
        if let Some(e) = &ent {
            need(e.len, s.rows, "logprob ent")?;
        }
        need(x.len, s.rows * s.hidden, "logprob x")?;
        need(w.len, s.vocab * s.hidden, "logprob w")?;
        need(targets.len, s.rows, "logprob targets")?;
        need(
            scratch.len,
            s.chunk.min(s.rows) * s.vocab,
            "logprob scratch",
        )?;
        if s.rows == 0 {
            return Ok(());
        }
        // Operand types are reconciled once for all chunks (w is the big one).
        let bf = [x.dtype, w.dtype, scratch.dtype].contains(&DType::BF16);
        let (xo, _tx) = self.operand_for(x, s.rows * s.hidden, bf)?;
        let (wo, _tw) = self.operand_for(w, s.vocab * s.hidden, bf)?;
        let f = self.func(nvrtc::LOGPROB, 0, "logprob_reduce_k")?;
        let inv_t = 1.0 / s.temperature;
        let v = i32_of(s.vocab, "vocab")?;
        let err = self.err_word.ptr();
        let (ent_ptr, ent_bf) = ent.as_ref().map_or((0u64, 0), |e| (e.ptr, e.bf()));
        let ent_esize = ent.as_ref().map_or(4, |e| esize(e.dtype));
        for c0 in (0..s.rows).step_by(s.chunk) {
            let cn = s.chunk.min(s.rows - c0);
            let xc = Operand {
                ptr: xo.ptr + (c0 * s.hidden * esize(xo.dtype)) as u64,
                dtype: xo.dtype,
            };
            self.gemm_xwt(
                scratch.operand(0),
                xc,
                wo,
                None,
                cn,
                s.hidden,
                s.vocab,
                false,
            )?;
            let (lpp, lsep, tp) = (lp.at(c0), lse.at(c0), targets.at(c0));
            let entp = if ent_ptr == 0 {
                0u64
            } else {
                ent_ptr + (c0 * ent_esize) as u64
            };
            let (lpbf, lsebf, zbf, rows) = (lp.bf(), lse.bf(), scratch.bf(), cn as i32);
            self.launch(
                &f,
                (cn as u32, 1, 1),
                THREADS,
                0,
                &[
                    &lpp,
                    &lpbf,
                    &entp,
                    &ent_bf,
                    &lsep,
                    &lsebf,
                    &scratch.ptr,
                    &zbf,
                    &tp,
                    &rows,
                    &v,
                    &inv_t,
                    &err,
                ],
            )?;
        }
        Ok(())
    }

    fn logprob_backward(
        &self,
        dx: &mut CudaBuf,
        dw: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        targets: &CudaIdx,
        lse: &CudaBuf,
        ent: &CudaBuf,
        dlp: &CudaBuf,
        dent: Option<&CudaBuf>,
        s: LogprobShape,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        check_logprob(&s)?;
        need(dx.len, s.rows * s.hidden, "logprob dx")?;
        need(dw.len, s.vocab * s.hidden, "logprob dw")?;
        need(x.len, s.rows * s.hidden, "logprob x")?;
        need(w.len, s.vocab * s.hidden, "logprob w")?;
        need(targets.len, s.rows, "logprob targets")?;
        need(lse.len, s.rows, "logprob lse")?;
        need(ent.len, s.rows, "logprob ent")?;
        need(dlp.len, s.rows, "logprob dlp")?;
        if let Some(d) = dent {
            need(d.len, s.rows, "logprob dent")?;
        }
        need(
            scratch.len,
            s.chunk.min(s.rows) * s.vocab,
            "logprob scratch",
        )?;
        if s.rows == 0 {
            return Ok(());
        }
        let bf = [x.dtype, w.dtype, scratch.dtype, dx.dtype, dw.dtype].contains(&DType::BF16);
        let (xo, _tx) = self.operand_for(x, s.rows * s.hidden, bf)?;
        let (wo, _tw) = self.operand_for(w, s.vocab * s.hidden, bf)?;
        // dlogits go where the next GEMMs can read them: in place, or a bf16 temporary when the
        // scratch is f32 but the GEMMs run in bf16.
        let dl_tmp = if bf && scratch.dtype == DType::F32 {
            Some(self.temp(s.chunk.min(s.rows) * s.vocab, DType::BF16)?)
        } else {
            None
        };
        let dl = dl_tmp.as_ref().map_or(scratch.operand(0), |t| t.operand(0));
        let f = self.func(nvrtc::LOGPROB, 0, "logprob_dlogits_k")?;
        let inv_t = 1.0 / s.temperature;
        let v = i32_of(s.vocab, "vocab")?;
        let (dent_ptr, dent_bf) = dent.map_or((0u64, 0), |d| (d.ptr, d.bf()));
        for c0 in (0..s.rows).step_by(s.chunk) {
            let cn = s.chunk.min(s.rows - c0);
            let xc = Operand {
                ptr: xo.ptr + (c0 * s.hidden * esize(xo.dtype)) as u64,
                dtype: xo.dtype,
            };
            self.gemm_xwt(
                scratch.operand(0),
                xc,
                wo,
                None,
                cn,
                s.hidden,
                s.vocab,
                false,
            )?;
            let dlbf = (dl.dtype == DType::BF16) as i32;
            let (zbf, lsebf, entbf, dlpbf, rows) =
                (scratch.bf(), lse.bf(), ent.bf(), dlp.bf(), cn as i32);
            let (tp, lsep, entp, dlpp) = (targets.at(c0), lse.at(c0), ent.at(c0), dlp.at(c0));
            let dentp = if dent_ptr == 0 {
                0u64
            } else {
                dent_ptr + (c0 * esize(dent.map_or(DType::F32, |d| d.dtype))) as u64
            };
            self.launch(
                &f,
                (cn as u32, 1, 1),
                THREADS,
                0,
                &[
                    &dl.ptr,
                    &dlbf,
                    &scratch.ptr,
                    &zbf,
                    &tp,
                    &lsep,
                    &lsebf,
                    &entp,
                    &entbf,
                    &dlpp,
                    &dlpbf,
                    &dentp,
                    &dent_bf,
                    &rows,
                    &v,
                    &inv_t,
                ],
            )?;
            self.gemm_dyw(
                dx.operand(c0 * s.hidden),
                dl,
                wo,
                cn,
                s.hidden,
                s.vocab,
                false,
            )?;
            self.gemm_dytx(dw.operand(0), dl, xc, cn, s.hidden, s.vocab)?;
        }
        Ok(())
    }

    fn ppo_clip_loss(
        &self,
        dlp: &mut CudaBuf,
        stats: &mut CudaBuf,
        lp: &CudaBuf,
        old: Option<&CudaBuf>,
        adv: &CudaBuf,
        w: &CudaBuf,
        ent: Option<&CudaBuf>,
        s: PpoShape,
    ) -> Result<()> {
        let n = s.tokens;
        need(dlp.len, n, "ppo_clip_loss dlp")?;
        need(stats.len, PPO_STATS, "ppo_clip_loss stats")?;
        if stats.dtype != DType::F32 {
            bail!("ppo_clip_loss: the stats accumulator must be f32");
        }
        need(lp.len, n, "ppo_clip_loss lp")?;
        need(adv.len, n, "ppo_clip_loss adv")?;
        need(w.len, 3 * n, "ppo_clip_loss w")?;
        if let Some(o) = old {
            need(o.len, n, "ppo_clip_loss old")?;
        }
        if let Some(e) = ent {
            need(e.len, n, "ppo_clip_loss ent")?;
        }
        if n == 0 {
            return Ok(());
        }
        let (old_ptr, old_bf) = old.map_or((0u64, 0), |o| (o.ptr, o.bf()));
        let (ent_ptr, ent_bf) = ent.map_or((0u64, 0), |e| (e.ptr, e.bf()));
        let (dlpbf, lpbf, advbf, wbf, n32) =
            (dlp.bf(), lp.bf(), adv.bf(), w.bf(), i32_of(n, "tokens")?);
        let f = self.func(nvrtc::OPTIM, 0, "ppo_clip_k")?;
        self.launch(
            &f,
            (1, 1, 1),
            1024,
            0,
            &[
                &dlp.ptr,
                &dlpbf,
                &stats.ptr,
                &lp.ptr,
                &lpbf,
                &old_ptr,
                &old_bf,
                &adv.ptr,
                &advbf,
                &w.ptr,
                &wbf,
                &ent_ptr,
                &ent_bf,
                &n32,
                &s.ratio_low,
                &s.ratio_high,
                &s.dual_clip,
            ],
        )
    }

    fn sum_squares(&self, x: &CudaBuf, n: usize) -> Result<f64> {
        need(x.len, n, "sum_squares x")?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = self.stride_blocks(n).min(1024);
        let part = self.pool.alloc(blocks as usize * 8)?;
        let out = self.pool.alloc(8)?;
        let (xbf, n64, b) = (x.bf(), n as i64, blocks as i32);
        let f = self.func(nvrtc::OPTIM, 0, "sumsq_partial_k")?;
        self.launch(
            &f,
            (blocks, 1, 1),
            THREADS,
            0,
            &[&part.ptr(), &x.ptr, &xbf, &n64],
        )?;
        let f = self.func(nvrtc::OPTIM, 0, "sumsq_finish_k")?;
        self.launch(&f, (1, 1, 1), THREADS, 0, &[&out.ptr(), &part.ptr(), &b])?;
        let mut host = [0f64];
        self.bind()?;
        unsafe { dr::memcpy_dtoh_async(&mut host, out.ptr(), self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
        self.check_errors()?;
        Ok(host[0])
    }

    fn sum_squares_all(&self, xs: &[(&CudaBuf, usize)]) -> Result<f64> {
        // Every buffer's partial sums go to one array (fixed order), reduced by one block.
        let blocks: Vec<u32> = xs
            .iter()
            .map(|&(_, n)| {
                if n == 0 {
                    0
                } else {
                    self.stride_blocks(n).min(1024)
                }
            })
            .collect();
        let total: usize = blocks.iter().map(|&b| b as usize).sum();
        if total == 0 {
            for &(x, n) in xs {
                need(x.len, n, "sum_squares x")?;
            }
            return Ok(0.0);
        }
        let part = self.pool.alloc(total * 8)?;
        let out = self.pool.alloc(8)?;
        let f = self.func(nvrtc::OPTIM, 0, "sumsq_partial_k")?;
        let mut off = 0usize;
        for (&(x, n), &b) in xs.iter().zip(&blocks) {
            need(x.len, n, "sum_squares x")?;
            if b == 0 {
                continue;
            }
            let (xbf, n64, at) = (x.bf(), n as i64, part.ptr() + (off * 8) as u64);
            self.launch(&f, (b, 1, 1), THREADS, 0, &[&at, &x.ptr, &xbf, &n64])?;
            off += b as usize;
        }
        let f = self.func(nvrtc::OPTIM, 0, "sumsq_finish_k")?;
        let t = i32_of(total, "partial sums")?;
        self.launch(&f, (1, 1, 1), THREADS, 0, &[&out.ptr(), &part.ptr(), &t])?;
        let mut host = [0f64];
        self.bind()?;
        unsafe { dr::memcpy_dtoh_async(&mut host, out.ptr(), self.stream.cu_stream()) }
            .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
        self.check_errors()?;
        Ok(host[0])
    }

    fn adamw(
        &self,
        p: &mut CudaBuf,
        g: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        n: usize,
        st: &AdamWStep,
    ) -> Result<()> {
        need(p.len, n, "adamw p")?;
        need(g.len, n, "adamw g")?;
        need(m.len, n, "adamw m")?;
        need(v.len, n, "adamw v")?;
        let (pbf, gbf, mbf, vbf, n64) = (p.bf(), g.bf(), m.bf(), v.bf(), n as i64);
        self.elementwise(
            nvrtc::OPTIM,
            "adamw_k",
            n,
            &[
                &p.ptr,
                &pbf,
                &g.ptr,
                &gbf,
                &m.ptr,
                &mbf,
                &v.ptr,
                &vbf,
                &n64,
                &st.lr,
                &st.beta1,
                &st.beta2,
                &st.eps,
                &st.weight_decay,
                &st.bias_correction1,
                &st.bias_correction2,
                &st.grad_scale,
            ],
        )
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
        let f = self.func(nvrtc::MEMORY, 0, "feed_tokens_k")?;
        let (nn, pn, err) = (
            i32_of(n, "feed rows")?,
            prev.len as i64,
            self.err_word.ptr(),
        );
        self.launch(
            &f,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[&ids.ptr, &prev.ptr, &src.ptr, &nn, &pn, &err],
        )
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

    fn attention_paged_tiled(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        tables: &CudaIdx,
        seq: &CudaIdx,
        len: &CudaIdx,
        tiles: &CudaIdx,
        n_tiles: usize,
        decode_rows: usize,
        s: PagedAttnShape,
    ) -> Result<()> {
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        if n_tiles == 0 || !self.use_mma(hd, &[o, q, k_cache, v_cache]) {
            return self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, s);
        }
        let qn = s.queries * s.heads * s.head_dim;
        need(o.len, qn, "attention_paged o")?;
        need(q.len, qn, "attention_paged q")?;
        need(seq.len, s.queries, "attention_paged seq")?;
        need(len.len, s.queries, "attention_paged len")?;
        need(tiles.len, 2 * n_tiles, "attention_paged tiles")?;
        if decode_rows > s.queries || s.block_size == 0 || s.max_blocks == 0 {
            bail!(
                "attention_paged: {decode_rows} decode rows of {}, block size {}, {} blocks per table",
                s.queries,
                s.block_size,
                s.max_blocks
            );
        }
        if decode_rows > 0 {
            let d = PagedAttnShape {
                queries: decode_rows,
                ..s
            };
            self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, d)?;
        }
        // The prefill tiles: each block's rows share its key tiles (and get the training
        // forward's bits, in either mode).
        let f = self.func(nvrtc::ATTENTION, hd, "paged_prefill_mma_k")?;
        let (num_blocks, h, kh, bsz, mb) = paged_dims(s, k_cache, v_cache)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let err = self.err_word.ptr();
        self.launch(
            &f,
            (n_tiles as u32, s.heads as u32, 1),
            128,
            attention_mma_smem(hd).0,
            &[
                &o.ptr,
                &q.ptr,
                &k_cache.ptr,
                &v_cache.ptr,
                &tables.ptr,
                &seq.ptr,
                &len.ptr,
                &tiles.ptr,
                &h,
                &kh,
                &bsz,
                &mb,
                &num_blocks,
                &scale,
                &err,
            ],
        )
    }

    fn attention_paged(
        &self,
        o: &mut CudaBuf,
        q: &CudaBuf,
        k_cache: &CudaBuf,
        v_cache: &CudaBuf,
        tables: &CudaIdx,
        seq: &CudaIdx,
        len: &CudaIdx,
        s: PagedAttnShape,
    ) -> Result<()> {
        self.paged_attention(o, q, k_cache, v_cache, tables, seq, len, s, None)
    }

    fn attention_paged_rope(
        &self,
        o: &mut CudaBuf,
        qkv: &CudaBuf,
        q: &mut CudaBuf,
        pos: &CudaIdx,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        rows: &CudaIdx,
        tables: &CudaIdx,
        seq: &CudaIdx,
        len: &CudaIdx,
        s: PagedAttnShape,
        theta: f32,
    ) -> Result<()> {
        let (hd, _) = check_attn(s.heads, s.kv_heads, s.head_dim)?;
        let fused = !self.gemm.batch_invariant()
            && s.heads / s.kv_heads <= 16
            && hd.is_multiple_of(64)
            && self.use_mma(hd, &[qkv, k_cache, v_cache]);
        if !fused {
            self.rope_store_kv_packed(
                qkv, q, pos, k_cache, v_cache, rows, s.queries, s.heads, s.kv_heads, hd, theta,
            )?;
            return self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, s);
        }
        let kd = s.kv_heads * hd;
        need(
            qkv.len,
            s.queries * (s.heads * hd + 2 * kd),
            "attention_paged_rope qkv",
        )?;
        need(pos.len, s.queries, "attention_paged_rope pos")?;
        need(rows.len, s.queries, "attention_paged_rope rows")?;
        let rope = PagedRope {
            pos,
            rows,
            cache_rows: (k_cache.len.min(v_cache.len) / kd) as i64,
            fr: freqs(hd, theta),
        };
        self.paged_attention(o, qkv, k_cache, v_cache, tables, seq, len, s, Some(rope))
    }

    fn sample(
        &self,
        tokens: &mut CudaIdx,
        logprobs: &mut CudaBuf,
        logits: &CudaBuf,
        keys: &CudaIdx,
        positions: &CudaIdx,
        rows: usize,
        vocab: usize,
        params: &crate::backend::sample::SamplingParams,
    ) -> Result<()> {
        params.validate()?;
        need(tokens.len, rows, "sample tokens")?;
        need(logprobs.len, rows, "sample logprobs")?;
        need(logits.len, rows * vocab, "sample logits")?;
        need(keys.len, 2 * rows, "sample keys")?;
        need(positions.len, rows, "sample positions")?;
        if logprobs.dtype != DType::F32 {
            bail!("sample: log-probs must be an f32 buffer");
        }
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            bail!("cannot sample from an empty vocabulary");
        }
        let lbf = logits.bf();
        let v = i32_of(vocab, "vocab")?;
        let top_k = if params.top_k > 0 && (params.top_k as usize) < vocab {
            params.top_k as i32
        } else {
            -1
        };
        let err = self.err_word.ptr();
        if params.temperature == 0.0 || (top_k < 0 && params.top_p >= 1.0) {
            // Greedy or plain: one pass over chunks of the vocabulary, then the pick (see
            // sample.cu).
            let chunks = vocab.div_ceil(SAMPLE_CHUNK);
            let c = i32_of(chunks, "sample chunks")?;
            let cmax = self.temp(rows * chunks, DType::F32)?;
            let carg = self.temp(rows * chunks, DType::F32)?;
            // f64 segment sums, 8 per chunk, in a buffer of twice as many f32 words.
            let ssum = self.temp(rows * chunks * 8 * 2, DType::F32)?;
            let f = self.func(nvrtc::SAMPLE, 0, "sample_chunk_k")?;
            self.launch(
                &f,
                (chunks as u32, rows as u32, 1),
                256,
                0,
                &[
                    &cmax.ptr,
                    &carg.ptr,
                    &ssum.ptr,
                    &logits.ptr,
                    &lbf,
                    &v,
                    &params.temperature,
                ],
            )?;
            let f = self.func(nvrtc::SAMPLE, 0, "sample_pick_k")?;
            return self.launch(
                &f,
                (rows as u32, 1, 1),
                512,
                0,
                &[
                    &tokens.ptr,
                    &logprobs.ptr,
                    &cmax.ptr,
                    &carg.ptr,
                    &ssum.ptr,
                    &logits.ptr,
                    &lbf,
                    &keys.ptr,
                    &positions.ptr,
                    &v,
                    &c,
                    &params.temperature,
                    &err,
                ],
            );
        }
        let f = self.func(nvrtc::SAMPLE, 0, "sample_k")?;
        self.launch(
            &f,
            (rows as u32, 1, 1),
            1024,
            0,
            &[
                &tokens.ptr,
                &logprobs.ptr,
                &logits.ptr,
                &lbf,
                &keys.ptr,
                &positions.ptr,
                &v,
                &params.temperature,
                &top_k,
                &params.top_p,
                &err,
            ],
        )
    }
}

impl CudaBackend {
    /// buf[..n] = value without the length check (callers checked).
    fn fill_raw(&self, buf: &mut CudaBuf, n: usize, value: f32) -> Result<()> {
        self.fill(buf, n, value)
    }

    /// y[..n] += x[..n] on device addresses.
    fn add_raw(&self, y: u64, ybf: i32, x: u64, xbf: i32, n: usize) -> Result<()> {
        let n64 = n as i64;
        self.elementwise(
            nvrtc::MEMORY,
            "add_assign_k",
            n,
            &[&y, &ybf, &x, &xbf, &n64],
        )
    }

    /// The operand of a whole buffer in the compute type: converted to a bf16 temporary when
    /// `bf` and it is f32.
    fn operand_for(&self, b: &CudaBuf, n: usize, bf: bool) -> Result<(Operand, Option<CudaBuf>)> {
        if bf {
            self.as_bf16(b.operand(0), n)
        } else {
            Ok((b.operand(0), None))
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_dir(
        &self,
        x: &mut CudaBuf,
        pos: &CudaIdx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
        sign: f32,
    ) -> Result<()> {
        if !head_dim.is_multiple_of(2) || head_dim > 1024 {
            bail!("rope: head_dim {head_dim} must be even and at most 1024");
        }
        need(x.len, tokens * heads * head_dim, "rope x")?;
        need(pos.len, tokens, "rope pos")?;
        if tokens == 0 || heads * head_dim == 0 {
            return Ok(());
        }
        let fr = freqs(head_dim, theta);
        let f = self.func(nvrtc::ROPE, 0, "rope_k")?;
        let xbf = x.bf();
        let (t, h, d) = (
            i32_of(tokens, "tokens")?,
            i32_of(heads, "heads")?,
            head_dim as i32,
        );
        self.launch(
            &f,
            (tokens as u32, 1, 1),
            Self::row_threads(heads * head_dim / 2),
            0,
            &[&x.ptr, &xbf, &pos.ptr, &t, &h, &d, &sign, &fr],
        )
    }
}

/// Validates heads/kv_heads/head_dim for the attention kernels; returns (head_dim, group).
fn check_attn(heads: usize, kv_heads: usize, head_dim: usize) -> Result<(usize, usize)> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("attention: {heads} query heads cannot be grouped over {kv_heads} kv heads");
    }
    if head_dim == 0 || head_dim > 256 {
        bail!("attention: head_dim {head_dim} is not supported by the cuda kernels (1..=256)");
    }
    Ok((head_dim, heads / kv_heads))
}

fn shape_args(s: AttnShape) -> Result<(i32, i32, i32, i32)> {
    Ok((
        i32_of(s.tokens, "tokens")?,
        i32_of(s.seqs, "seqs")?,
        i32_of(s.heads, "heads")?,
        i32_of(s.kv_heads, "kv_heads")?,
    ))
}

/// n / 8 when every buffer is bf16 and 16-byte aligned and 8 divides n: the elementwise
/// kernels' vectorized form applies (TANDEM_NO_VEC=1 keeps the scalar kernels, for checks).
/// Element offsets of the parts of an `alloc_parts`: each starts where the previous one ends,
/// rounded up to [`PART_ALIGN`] bytes.
pub fn part_offsets(sizes: &[usize], dtype: DType) -> Vec<usize> {
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

fn vec8(n: usize, bufs: &[&CudaBuf]) -> Option<i64> {
    let ok = n.is_multiple_of(8)
        && bufs
            .iter()
            .all(|b| b.dtype == DType::BF16 && b.ptr.is_multiple_of(16))
        && std::env::var_os("TANDEM_NO_VEC").is_none();
    ok.then_some((n / 8) as i64)
}

fn check_logprob(s: &LogprobShape) -> Result<()> {
    if !(s.temperature.is_finite() && s.temperature > 0.0) {
        bail!(
            "logprob: temperature must be positive and finite, got {}",
            s.temperature
        );
    }
    if s.chunk == 0 {
        bail!("logprob: chunk must be at least 1 row");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::is_input_error;

    /// On a machine without the NVIDIA driver (this one, CI) the constructor returns the
    /// input error that points the user at the CPU, and does not panic.
    #[test]
    fn no_driver_is_a_clear_input_error() {
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
    fn attention_shared_memory_fits_hopper() {
        // 227 KiB of opt-in shared memory per block on sm_90, less the kernels' static arrays.
        for hd in [8, 64, 96, 128, 192, 256] {
            let (a, b, c) = attention_smem(hd);
            assert!(
                a.max(b).max(c) <= 227 * 1024 - 1024,
                "head_dim {hd}: {a} {b} {c}"
            );
        }
        // Forward with head_dim 64: Q, K, V tiles of 64×65 floats and P of 64×65.
        assert_eq!(attention_smem(64).0, (3 * 64 * 65 + 64 * 65) * 4);
    }

    #[test]
    fn tensor_core_attention_shared_memory_fits_hopper() {
        for hd in [16, 64, 96, 128] {
            let (a, b, c) = attention_mma_smem(hd);
            assert!(
                a.max(b).max(c) <= 227 * 1024 - 1024,
                "head_dim {hd}: {a} {b} {c}"
            );
        }
        // Forward, head_dim 64: Q and K tiles of 64×72 bf16 and Vᵀ of 64×72.
        assert_eq!(attention_mma_smem(64).0, 3 * 64 * 72 * 2);
    }

    #[test]
    fn rope_frequencies_match_the_cpu_formula() {
        // inv_freq_0 = 1, and the last of head_dim 4 is theta^(-1/2).
        assert_eq!(inv_freq(0, 4, 10000.0), 1.0);
        assert!((inv_freq(1, 4, 10000.0) - 0.01).abs() < 1e-9);
    }
}
