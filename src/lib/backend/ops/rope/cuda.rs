//! The rope launchers (kernels in `rope.cu`): the inverse frequencies go to the kernels by
//! value, computed on the host as the CPU reference computes them.

use anyhow::{bail, Result};

use super::{inv_freq, PackedQkv, RopeKvShape, RopeOps, RopeShape, Slots, MAX_HEAD_DIM};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, ArgGroup, Args, ByValue, CudaBackend, CudaBuf, CudaIdx};
use crate::backend::KvCache;

pub(crate) const KERNELS: Family = Family {
    name: "rope",
    src: include_str!("rope.cu"),
    per_head_dim: false,
    training_only: false,
};

/// Tokens per block of `rope_store_kv_packed_k` (RPB in rope.cu).
const ROPE_TOKENS_PER_BLOCK: usize = 4;

/// The rope kernels' inverse frequencies, passed by value (`struct Freqs { float f[512]; }` in
/// common.cuh).
#[repr(C)]
pub(crate) struct Freqs([f32; MAX_HEAD_DIM / 2]);
impl ByValue for Freqs {}

/// The rope kernels' inverse frequencies for a head dim and base.
pub(crate) fn freqs(head_dim: usize, theta: f32) -> Freqs {
    let mut fr = Freqs([0.0; MAX_HEAD_DIM / 2]);
    for (i, f) in fr.0.iter_mut().take(head_dim / 2).enumerate() {
        *f = inv_freq(i, head_dim, theta);
    }
    fr
}

/// The rope kernels' head_dim limits: even (pairs i, i + d/2) and at most [`MAX_HEAD_DIM`].
fn check_head_dim(head_dim: usize) -> Result<()> {
    if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
        bail!("rope: head_dim {head_dim} must be even and at most {MAX_HEAD_DIM}");
    }
    Ok(())
}

/// The arguments both cache-storing rope kernels end with: `const u32* pos, void* kc, int
/// kcbf, void* vc, int vcbf, const u32* rows, int tokens, int heads, int kv_heads, int
/// head_dim, i64 cache_rows, Freqs fr, u32* err`.
struct Store<'a> {
    s: RopeKvShape,
    slots: Slots<&'a CudaIdx>,
    cache: KvCache<&'a CudaBuf>,
    dims: [i32; 4],
    cache_rows: i64,
    fr: Freqs,
    err: u64,
}

impl<'a> Store<'a> {
    fn new(
        be: &CudaBackend,
        slots: Slots<&'a CudaIdx>,
        cache: KvCache<&'a CudaBuf>,
        s: RopeKvShape,
    ) -> Result<Self> {
        let kd = s.kv_heads * s.head_dim;
        Ok(Store {
            s,
            slots,
            cache,
            dims: [
                i32_of(s.tokens, "tokens")?,
                i32_of(s.heads, "heads")?,
                i32_of(s.kv_heads, "kv_heads")?,
                s.head_dim as i32,
            ],
            cache_rows: (cache.k.len.min(cache.v.len) / kd) as i64,
            fr: freqs(s.head_dim, s.theta),
            err: be.err_ptr(),
        })
    }
}

impl Store<'_> {
    /// Launches the kernel `name` (one block per `tokens_per_block` tokens) with `head`'s
    /// arguments, then the store's.
    fn launch<'a>(
        &'a self,
        be: &CudaBackend,
        name: &'static str,
        tokens_per_block: usize,
        head: Args<'a>,
    ) -> Result<()> {
        let f = be.func(KERNELS, 0, name)?;
        let s = self.s;
        let grid = (s.tokens.div_ceil(tokens_per_block) as u32, 1, 1);
        let threads = CudaBackend::row_threads((s.heads + s.kv_heads) * s.head_dim / 2);
        be.launch(&f, grid, threads, 0, &head.with(self))
    }
}

impl ArgGroup for Store<'_> {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a> {
        let [t, h, kh, d] = self.dims;
        a.idx(self.slots.pos)
            .bufs(&[self.cache.k, self.cache.v])
            .idx(self.slots.rows)
            .i32(t)
            .i32(h)
            .i32(kh)
            .i32(d)
            .i64(self.cache_rows)
            .by_value(&self.fr)
            .raw(self.err)
    }
}

/// rope_k in place; `sign` −1 rotates backwards (the backward pass).
fn rope_dir(
    be: &CudaBackend,
    x: &mut CudaBuf,
    pos: &CudaIdx,
    s: RopeShape,
    sign: f32,
) -> Result<()> {
    let RopeShape {
        tokens,
        heads,
        head_dim,
        theta,
    } = s;
    check_head_dim(head_dim)?;
    need(x.len, tokens * heads * head_dim, "rope x")?;
    need(pos.len, tokens, "rope pos")?;
    if tokens == 0 || heads * head_dim == 0 {
        return Ok(());
    }
    let fr = freqs(head_dim, theta);
    let f = be.func(KERNELS, 0, "rope_k")?;
    let args = Args::new()
        .buf(x)
        .idx(pos)
        .i32(i32_of(tokens, "tokens")?)
        .i32(i32_of(heads, "heads")?)
        .i32(head_dim as i32)
        .f32(sign)
        .by_value(&fr);
    let threads = CudaBackend::row_threads(heads * head_dim / 2);
    be.launch(&f, (tokens as u32, 1, 1), threads, 0, &args)
}

impl RopeOps for CudaBackend {
    fn rope(&self, x: &mut CudaBuf, pos: &CudaIdx, s: RopeShape) -> Result<()> {
        rope_dir(self, x, pos, s, 1.0)
    }
    fn rope_backward(&self, dx: &mut CudaBuf, pos: &CudaIdx, s: RopeShape) -> Result<()> {
        rope_dir(self, dx, pos, s, -1.0)
    }
    fn rope_store_kv(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        slots: Slots<&CudaIdx>,
        cache: KvCache<&mut CudaBuf>,
        s: RopeKvShape,
    ) -> Result<()> {
        check_head_dim(s.head_dim)?;
        let (t, qd, kd) = (s.tokens, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        need(q.len, t * qd, "rope_store_kv q")?;
        need(k.len, t * kd, "rope_store_kv k")?;
        need(v.len, t * kd, "rope_store_kv v")?;
        need(slots.pos.len, t, "rope_store_kv pos")?;
        need(slots.rows.len, t, "rope_store_kv rows")?;
        if t == 0 || kd == 0 {
            return Ok(());
        }
        let store = Store::new(self, slots, cache.read(), s)?;
        store.launch(self, "rope_store_kv_k", 1, Args::new().bufs(&[q, k, v]))
    }
    fn rope_store_kv_packed(
        &self,
        x: PackedQkv<CudaBuf>,
        slots: Slots<&CudaIdx>,
        cache: KvCache<&mut CudaBuf>,
        s: RopeKvShape,
    ) -> Result<()> {
        let PackedQkv { qkv, q: q_out } = x;
        check_head_dim(s.head_dim)?;
        let (t, qd, kd) = (s.tokens, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        need(qkv.len, t * (qd + 2 * kd), "rope_store_kv_packed qkv")?;
        need(q_out.len, t * qd, "rope_store_kv_packed q")?;
        need(slots.pos.len, t, "rope_store_kv_packed pos")?;
        need(slots.rows.len, t, "rope_store_kv_packed rows")?;
        if t == 0 || kd == 0 {
            return Ok(());
        }
        let store = Store::new(self, slots, cache.read(), s)?;
        let head = Args::new().bufs(&[qkv, q_out]);
        store.launch(self, "rope_store_kv_packed_k", ROPE_TOKENS_PER_BLOCK, head)
    }
}
