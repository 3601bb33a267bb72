//! The backend op set: every op a Qwen2/Llama/Qwen3 decoder needs, forward and backward, behind
//! one trait so the decoder (`model::decoder`) is written once. `cpu` is the f32 reference
//! (the oracle every other backend is parity-tested against); a CUDA backend implements the
//! same trait with device buffers.
//!
//! Conventions, shared by every implementation:
//! - Buffers are flat. A buffer may be longer than an op needs (workspaces are sized for a token
//!   budget once and reused): an op reads and writes only the prefix its sizes describe.
//! - Matrices are row-major. Linear weights use the HF layout `[out, in]`, so a projection is
//!   `y = x · wᵀ`. Activations are `[tokens, features]`; attention tensors are
//!   `[tokens, heads, head_dim]`.
//! - Sequences are packed without padding: `cu_seqlens` holds `n_seqs + 1` offsets, sequence `s`
//!   owns rows `cu_seqlens[s]..cu_seqlens[s+1]`.
//! - Gradients of parameters always accumulate (`+=`), so micro-batches add up; gradients of
//!   activations either overwrite or accumulate as the `accumulate` flag says.
//! - Ops return `Result` because a device launch can fail; the CPU backend only fails on
//!   sizes that do not fit its buffers (a bug in the caller, reported rather than panicking).

pub mod check;
pub mod cpu;
pub mod cuda;
pub mod sample;

use anyhow::Result;

/// Shape of a packed attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Total query rows (packed tokens).
    pub tokens: usize,
    /// Number of packed sequences (`cu_seqlens` has `seqs + 1` entries).
    pub seqs: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Shape of an attention call against a KV cache: query `i` attends to cache rows
/// `base[i] .. base[i] + len[i]` (its own key is the last of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttnShape {
    /// Number of query rows.
    pub queries: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Shape of an attention call against a paged KV cache: query `i` attends to the first
/// `len[i]` positions of sequence `seq[i]`, whose block table is row `seq[i]` of `tables`
/// (`max_blocks` entries per row); position `p` is cache row
/// `tables[seq[i]·max_blocks + p / block_size]·block_size + p % block_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedAttnShape {
    pub queries: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

/// Most rows of one tile of [`Backend::attention_paged_tiled`] (the query tile of the GPU's
/// attention kernels).
pub const PAGED_TILE_ROWS: usize = 64;

/// Shape of the fused LM-head log-prob op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogprobShape {
    /// Rows to score (each row is the hidden state that predicts one target token).
    pub rows: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Logits are divided by this before the softmax.
    pub temperature: f32,
    /// Rows per chunk: the op never holds more than `chunk × vocab` logits; the scratch buffer
    /// must hold at least that many floats.
    pub chunk: usize,
}

/// One AdamW update with everything pre-folded that is the same for every parameter tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// `1 - beta1^step` and `1 - beta2^step` (step counts from 1).
    pub bias_correction1: f32,
    pub bias_correction2: f32,
    /// Multiplies the gradient first (global-norm clipping coefficient, 1 when not clipping).
    pub grad_scale: f32,
}

/// The fused PPO-clip loss of one micro-batch (verl's vanilla policy loss with dual clip).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PpoShape {
    /// Scored tokens.
    pub tokens: usize,
    /// 1 − ε_low and 1 + ε_high: the ratio's clip range.
    pub ratio_low: f64,
    pub ratio_high: f64,
    /// Dual-clip bound c (> 1) for negative advantages.
    pub dual_clip: f64,
}

/// Slots of the accumulator [`Backend::ppo_clip_loss`] adds to: Σ w_pg·ℓ, Σ w_tok·clipped,
/// Σ w_tok·clipped_lower, Σ w_tok·(old − lp), Σ w_agg·entropy, count of non-finite tokens.
pub const PPO_STATS: usize = 6;

/// Element type a buffer stores. Ops always compute in f32 and convert on load and store, so
/// any op accepts buffers of either type; a backend without bf16 storage keeps f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
}

/// Device memory a backend holds (all zero on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes taken from the device allocator (live buffers plus the pool's cache).
    pub held: usize,
    /// Bytes in live buffers.
    pub in_use: usize,
    /// Largest `in_use` seen since the backend was made.
    pub peak_in_use: usize,
}

/// A buffer and the buffers that are its parts (`Backend::alloc_parts`).
pub type Parts<T> = (T, Vec<T>);

/// `Backend::feed_tokens`: this row keeps the token uploaded for it.
pub const FEED_NONE: u32 = u32::MAX;

/// The op set. Every method documents its math in one line; shapes are passed explicitly.
pub trait Backend: Send + Sync {
    /// A float buffer on the device (`Vec<f32>` on the CPU).
    type Buf: Send + Sync;
    /// An index buffer on the device (token ids, positions, offsets, row indices).
    type Idx: Send + Sync;

    /// Short name for messages ("cpu", "cuda:0").
    fn name(&self) -> String;

    // ---- memory -------------------------------------------------------------------------

    /// A zero-filled buffer of `n` floats.
    fn alloc(&self, n: usize) -> Result<Self::Buf>;
    /// A zero-filled buffer of `n` elements stored as `dtype` (bf16 rounds to nearest even on
    /// store). Backends that only store f32 ignore `dtype`.
    fn alloc_as(&self, n: usize, dtype: DType) -> Result<Self::Buf> {
        let _ = dtype;
        self.alloc(n)
    }
    /// Element type of the decoder's compute weights, activations and KV caches (DESIGN.md
    /// section 4). Master weights, gradients, optimizer moments, norm/softmax statistics and
    /// log-prob math stay f32 whatever this says.
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    /// The element type `buf` stores.
    fn dtype(&self, buf: &Self::Buf) -> DType {
        let _ = buf;
        DType::F32
    }
    /// Waits for all queued work and reports device-side faults of earlier ops (token ids or
    /// rows out of range). A no-op on the CPU, where ops fail at once.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Device memory held and in use.
    fn memory_stats(&self) -> MemoryStats {
        MemoryStats::default()
    }
    /// Floats of logits the fused log-prob may hold per chunk: bigger chunks make bigger
    /// LM-head GEMMs and fewer read-modify-writes of the head's gradient.
    fn logprob_chunk_floats(&self) -> usize {
        16 << 20
    }
    /// Makes `peak_in_use` start again from the current use, so that a phase of the hybrid
    /// engine reports its own peak.
    fn reset_peak_memory(&self) {}
    /// Returns cached free device memory to the driver (between phases of the hybrid engine).
    fn trim(&self) -> Result<()> {
        Ok(())
    }
    /// Zero-filled buffers of `sizes[i]` elements of `dtype` that are parts of one allocation:
    /// `(whole, parts)`, part i a view of `whole` starting where part i − 1 ends, rounded up to
    /// the backend's alignment (so `len(whole) == Σ sizes` exactly when no padding was needed,
    /// and then `whole` is the parts concatenated). Ops on a part touch only that part; the
    /// memory lives while any of them does. None where buffers cannot share memory (the CPU).
    fn alloc_parts(&self, sizes: &[usize], dtype: DType) -> Result<Option<Parts<Self::Buf>>> {
        let _ = (sizes, dtype);
        Ok(None)
    }
    /// A zero-filled index buffer of `n` entries.
    fn alloc_idx(&self, n: usize) -> Result<Self::Idx>;
    /// Length of a buffer in floats.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Length of an index buffer.
    fn len_idx(&self, buf: &Self::Idx) -> usize;
    /// dst[..src.len()] = src (host to device).
    fn upload(&self, dst: &mut Self::Buf, src: &[f32]) -> Result<()>;
    /// dst[..src.len()] = src (host to device).
    fn upload_idx(&self, dst: &mut Self::Idx, src: &[u32]) -> Result<()>;
    /// dst = src[..dst.len()] (device to host).
    fn download(&self, src: &Self::Buf, dst: &mut [f32]) -> Result<()>;
    /// buf[..n] = value.
    fn fill(&self, buf: &mut Self::Buf, n: usize, value: f32) -> Result<()>;
    /// dst[dst_off..dst_off+n] = src[src_off..src_off+n].
    fn copy(
        &self,
        dst: &mut Self::Buf,
        dst_off: usize,
        src: &Self::Buf,
        src_off: usize,
        n: usize,
    ) -> Result<()>;
    /// buf[dst_off..dst_off+n] = buf[src_off..src_off+n] (ranges must not overlap).
    fn copy_within(
        &self,
        buf: &mut Self::Buf,
        dst_off: usize,
        src_off: usize,
        n: usize,
    ) -> Result<()>;
    /// y[..n] += x[..n].
    fn add_assign(&self, y: &mut Self::Buf, x: &Self::Buf, n: usize) -> Result<()>;

    // ---- matmul (linear layers) ---------------------------------------------------------

    /// y[m,n] (= or +=) x[m,k] · w[n,k]ᵀ + b[n].
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        y: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        b: Option<&Self::Buf>,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// y[m,n] = r[m,n] + x[m,k] · w[n,k]ᵀ (y and r distinct): a residual block's output next to
    /// its input, which training keeps. A GPU backend does it as one GEMM reading r as C.
    #[allow(clippy::too_many_arguments)]
    fn matmul_residual(
        &self,
        y: &mut Self::Buf,
        r: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.copy(y, 0, r, 0, m * n)?;
        self.matmul(y, x, w, None, m, k, n, true)
    }
    /// dx[m,k] (= or +=) dy[m,n] · w[n,k].
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_x(
        &self,
        dx: &mut Self::Buf,
        dy: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// dw[n,k] += dy[m,n]ᵀ · x[m,k];  db[n] += Σ_m dy[m,n].
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_w(
        &self,
        dw: &mut Self::Buf,
        db: Option<&mut Self::Buf>,
        dy: &Self::Buf,
        x: &Self::Buf,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()>;

    // ---- embedding ----------------------------------------------------------------------

    /// out[t,:] = table[ids[t],:].
    fn embedding(
        &self,
        out: &mut Self::Buf,
        table: &Self::Buf,
        ids: &Self::Idx,
        tokens: usize,
        dim: usize,
    ) -> Result<()>;
    /// dtable[ids[t],:] += dout[t,:].
    fn embedding_backward(
        &self,
        dtable: &mut Self::Buf,
        dout: &Self::Buf,
        ids: &Self::Idx,
        tokens: usize,
        dim: usize,
    ) -> Result<()>;

    // ---- RMSNorm ------------------------------------------------------------------------

    /// y[r,:] = x[r,:] · rstd[r] · w, rstd[r] = 1/√(mean(x[r,:]²) + eps) (rstd saved for backward).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        y: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// dx (= or +=) rstd·(w·dy − x̂·mean(x̂·w·dy)), x̂ = x·rstd;  dw += Σ_r dy·x̂.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        dy: &Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        rstd: &Self::Buf,
        rows: usize,
        dim: usize,
        accumulate: bool,
    ) -> Result<()>;

    // ---- RoPE (HF rotate_half layout) -----------------------------------------------------

    /// In place on x[t,h,:]: (a,b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
    /// angle = pos[t] · theta^(−2i/d).
    fn rope(
        &self,
        x: &mut Self::Buf,
        pos: &Self::Idx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()>;
    /// In place on dx: the transpose of the rotation, i.e. rotation by −angle.
    fn rope_backward(
        &self,
        dx: &mut Self::Buf,
        pos: &Self::Idx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()>;

    // ---- attention ----------------------------------------------------------------------

    /// Packed causal GQA: o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j, with kv head
    /// h / (heads/kv_heads); lse[i,h] = log Σ_j exp(q_i·k_j/√d) saved for backward.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        o: &mut Self::Buf,
        lse: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
    /// P = exp(S − lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P∘(dP − rowsum(dO∘O)),
    /// dQ = dS K/√d, dK = dSᵀ Q/√d. dq, dk, dv are overwritten.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dq: &mut Self::Buf,
        dk: &mut Self::Buf,
        dv: &mut Self::Buf,
        dout: &Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        o: &Self::Buf,
        lse: &Self::Buf,
        cu_seqlens: &Self::Idx,
        shape: AttnShape,
    ) -> Result<()>;
    /// KV-cache write: cache[rows[i], :] = x[i, :] for k and v (rows of kv_heads·head_dim).
    #[allow(clippy::too_many_arguments)]
    fn kv_store(
        &self,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        row_dim: usize,
    ) -> Result<()>;
    /// rope on q (`heads`) and k (`kv_heads`) in place, then `kv_store` of k and v: what a
    /// cached or paged step runs before attention, one launch where a backend fuses it.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        self.rope(q, pos, tokens, heads, head_dim, theta)?;
        self.rope(k, pos, tokens, kv_heads, head_dim, theta)?;
        self.kv_store(k_cache, v_cache, k, v, rows, tokens, kv_heads * head_dim)
    }
    /// `rope_store_kv` on the parts of one fused projection, row t of `qkv` being
    /// [q (heads·head_dim) | k (kv_heads·head_dim) | v (kv_heads·head_dim)]:
    /// q_out[t] = rope(q_t); cache[rows[t]] = (rope(k_t) rounded to qkv's type, v_t).
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv_packed(
        &self,
        qkv: &Self::Buf,
        q_out: &mut Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        let (qd, kd) = (heads * head_dim, kv_heads * head_dim);
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        // Each row of qkv as whole units of gcd(qd, kd) floats: every part is a run of units,
        // gathered out as rows of one unit.
        let unit = gcd(qd, kd);
        let per = (qd + 2 * kd) / unit;
        let dt = self.dtype(qkv);
        let mut k = self.alloc_as(tokens * kd, dt)?;
        let mut v = self.alloc_as(tokens * kd, dt)?;
        for (dst, first, count) in [
            (&mut *q_out, 0, qd / unit),
            (&mut k, qd / unit, kd / unit),
            (&mut v, (qd + kd) / unit, kd / unit),
        ] {
            let src = (0..tokens)
                .flat_map(|t| (0..count).map(move |j| t * per + first + j))
                .map(|r| u32::try_from(r).map_err(|_| anyhow::anyhow!("qkv row {r} overflows u32")))
                .collect::<Result<Vec<u32>>>()?;
            let mut idx = self.alloc_idx(src.len())?;
            self.upload_idx(&mut idx, &src)?;
            self.gather_rows(dst, qkv, &idx, src.len(), unit)?;
        }
        self.rope_store_kv(
            q_out, &mut k, &v, pos, k_cache, v_cache, rows, tokens, heads, kv_heads, head_dim,
            theta,
        )
    }
    /// Attention against a cache: o_i = Σ_{j<len[i]} softmax_j(q_i·K[base[i]+j]/√d) V[base[i]+j].
    #[allow(clippy::too_many_arguments)]
    fn attention_cached(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        base: &Self::Idx,
        len: &Self::Idx,
        shape: CachedAttnShape,
    ) -> Result<()>;

    // ---- SwiGLU -------------------------------------------------------------------------

    /// h = silu(g)·u = g·σ(g)·u, elementwise over n.
    fn swiglu(&self, h: &mut Self::Buf, g: &Self::Buf, u: &Self::Buf, n: usize) -> Result<()>;
    /// h[i,j] = silu(gu[i,j])·gu[i,f+j] for i < n, j < f: `swiglu` on the two halves of each
    /// row of one fused gate/up projection [n, 2f].
    fn swiglu_packed(&self, h: &mut Self::Buf, gu: &Self::Buf, n: usize, f: usize) -> Result<()> {
        if n == 0 || f == 0 {
            return Ok(());
        }
        let dt = self.dtype(gu);
        let mut g = self.alloc_as(n * f, dt)?;
        let mut u = self.alloc_as(n * f, dt)?;
        // gu viewed as 2n rows of f: gate rows are the even ones, up rows the odd ones.
        for (dst, half) in [(&mut g, 0), (&mut u, 1)] {
            let src: Vec<u32> = (0..n).map(|i| (2 * i + half) as u32).collect();
            let mut idx = self.alloc_idx(n)?;
            self.upload_idx(&mut idx, &src)?;
            self.gather_rows(dst, gu, &idx, n, f)?;
        }
        self.swiglu(h, &g, &u, n * f)
    }
    /// dg = dh·u·σ(g)·(1 + g·(1−σ(g))), du = dh·silu(g) (overwritten).
    #[allow(clippy::too_many_arguments)]
    fn swiglu_backward(
        &self,
        dg: &mut Self::Buf,
        du: &mut Self::Buf,
        dh: &Self::Buf,
        g: &Self::Buf,
        u: &Self::Buf,
        n: usize,
    ) -> Result<()>;

    // ---- row gather / scatter -----------------------------------------------------------

    /// out[i,:] = x[rows[i],:].
    fn gather_rows(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        dim: usize,
    ) -> Result<()>;
    /// dx[rows[i],:] += dout[i,:] (rows distinct).
    fn scatter_add_rows(
        &self,
        dx: &mut Self::Buf,
        dout: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        dim: usize,
    ) -> Result<()>;

    // ---- LM head fused with log-softmax and entropy ------------------------------------

    /// z = x·wᵀ/T per chunk of rows; lse_i = log Σ_v exp z_iv; lp_i = z_i[y_i] − lse_i;
    /// ent_i = lse_i − Σ_v p_iv z_iv. Scratch holds one chunk of logits.
    #[allow(clippy::too_many_arguments)]
    fn logprob(
        &self,
        lp: &mut Self::Buf,
        ent: Option<&mut Self::Buf>,
        lse: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        targets: &Self::Idx,
        shape: LogprobShape,
        scratch: &mut Self::Buf,
    ) -> Result<()>;
    /// dz_iv = glp_i(δ_{v,y_i} − p_iv) − gent_i·p_iv(log p_iv + ent_i), dlogits = dz/T;
    /// dx = dlogits·w (overwritten), dw += dlogitsᵀ·x. Logits are recomputed chunk by chunk.
    #[allow(clippy::too_many_arguments)]
    fn logprob_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        targets: &Self::Idx,
        lse: &Self::Buf,
        ent: &Self::Buf,
        dlp: &Self::Buf,
        dent: Option<&Self::Buf>,
        shape: LogprobShape,
        scratch: &mut Self::Buf,
    ) -> Result<()>;

    // ---- policy loss --------------------------------------------------------------------

    /// Per token t with w_tok[t] > 0 (w = [w_pg | w_tok | w_agg], 3·tokens; 0 = masked):
    /// r = exp(clamp(lp − old, ±20)), ℓ = max(−A·r, −A·clip(r, lo, hi)), for A < 0 min(ℓ, −A·c);
    /// dlp = w_pg·∂ℓ/∂lp (torch's subgradients: ties split, clamps pass on their closed
    /// interval; 0 where masked), and [`PPO_STATS`] sums are added to `stats`. `old` None means
    /// on-policy (old = lp, detached). Math in f64, as `algo::policy_loss` does it.
    #[allow(clippy::too_many_arguments)]
    fn ppo_clip_loss(
        &self,
        dlp: &mut Self::Buf,
        stats: &mut Self::Buf,
        lp: &Self::Buf,
        old: Option<&Self::Buf>,
        adv: &Self::Buf,
        w: &Self::Buf,
        ent: Option<&Self::Buf>,
        shape: PpoShape,
    ) -> Result<()>;

    // ---- optimizer ----------------------------------------------------------------------

    /// Σ x[..n]² (accumulated in f64 where the backend can).
    fn sum_squares(&self, x: &Self::Buf, n: usize) -> Result<f64>;
    /// Σ over (x, n) of Σ x[..n]² (the global grad norm): a device backend sums every buffer
    /// before its one read-back, instead of one sync per buffer.
    fn sum_squares_all(&self, xs: &[(&Self::Buf, usize)]) -> Result<f64> {
        xs.iter().map(|&(x, n)| self.sum_squares(x, n)).sum()
    }
    /// AdamW (torch semantics): g' = s·g; m = β1·m + (1−β1)·g'; v = β2·v + (1−β2)·g'²;
    /// p = p·(1 − lr·wd) − (lr/bc1)·m / (√v/√bc2 + eps).
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &self,
        p: &mut Self::Buf,
        g: &Self::Buf,
        m: &mut Self::Buf,
        v: &mut Self::Buf,
        n: usize,
        step: &AdamWStep,
    ) -> Result<()>;

    // ---- paged generation (engine::paged) -----------------------------------------------

    /// (free, total) bytes of device memory as the driver reports them (cuMemGetInfo); None
    /// where there is no device memory to size a KV pool from (the CPU).
    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        Ok(None)
    }

    /// Whether kernels run in batch-invariant mode (a row's result does not depend on the
    /// other rows of the call; the CUDA backend's TANDEM_BATCH_INVARIANT). The CPU backend is
    /// batch-invariant by construction (always true, no mode).
    fn batch_invariant(&self) -> bool {
        false
    }

    /// GEMM plans made so far and the seconds their algorithm searches took (None where
    /// GEMMs need no plan).
    fn gemm_planning(&self) -> Option<(u64, f64)> {
        None
    }

    /// Whether steps can be captured and replayed as graphs (CUDA graphs; not the CPU).
    fn graphs_supported(&self) -> bool {
        false
    }
    /// Starts recording the ops issued from here on into a graph instead of running them.
    /// Between `graph_begin` and `graph_end` no op may read data back or synchronize, and the
    /// temporaries the ops take stay reserved for the graphs until `graph_release`.
    fn graph_begin(&self) -> Result<()> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Ends the recording; returns the id of the graph (for `graph_launch`).
    fn graph_end(&self) -> Result<usize> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Replays graph `id` with whatever its buffers hold now.
    fn graph_launch(&self, _id: usize) -> Result<()> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Destroys every graph and gives their private memory back to the pool; returns its bytes.
    fn graph_release(&self) -> Result<usize> {
        Ok(0)
    }

    /// dst = src[..dst.len()] (device to host).
    fn download_idx(&self, src: &Self::Idx, dst: &mut [u32]) -> Result<()>;
    /// ids[i] = prev[src[i]] for i < n where src[i] != FEED_NONE: the tokens of a decode step
    /// queued behind another, which drew them into `prev` and may still be running.
    fn feed_tokens(
        &self,
        ids: &mut Self::Idx,
        prev: &Self::Idx,
        src: &Self::Idx,
        n: usize,
    ) -> Result<()>;
    /// Starts bringing the first `rows` tokens and log-probs of a step to the host, behind the
    /// work queued so far, through `slot` (0 or 1: two steps' draws may be on their way).
    /// Returns them at once where nothing runs behind the host's back (the default), else
    /// `draws_wait(slot, rows)` does.
    #[allow(clippy::type_complexity)]
    fn draws_start(
        &self,
        _slot: usize,
        tokens: &Self::Idx,
        logprobs: &Self::Buf,
        rows: usize,
    ) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        let (mut t, mut l) = (vec![0u32; rows], vec![0f32; rows]);
        self.download_idx(tokens, &mut t)?;
        self.download(logprobs, &mut l)?;
        Ok(Some((t, l)))
    }
    /// The draws `draws_start(slot, ..)` set on their way, once they are on the host.
    fn draws_wait(&self, slot: usize, _rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        anyhow::bail!("{}: no draws on their way through slot {slot}", self.name())
    }
    /// Paged attention (see [`PagedAttnShape`] for the row of position p):
    /// o_i = Σ_{p<len[i]} softmax_p(q_i·K[row_i(p)]/√d) V[row_i(p)], kv head h/(heads/kv_heads).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        shape: PagedAttnShape,
    ) -> Result<()>;
    /// A decode step's `rope_store_kv_packed` then `attention_paged` (`q` receives the rotated
    /// queries where a backend runs them as two ops; the CUDA tensor-core path does both in one
    /// kernel, with the same bits, and leaves `q` alone).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged_rope(
        &self,
        o: &mut Self::Buf,
        qkv: &Self::Buf,
        q: &mut Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        shape: PagedAttnShape,
        theta: f32,
    ) -> Result<()> {
        let s = shape;
        self.rope_store_kv_packed(
            qkv, q, pos, k_cache, v_cache, rows, s.queries, s.heads, s.kv_heads, s.head_dim, theta,
        )?;
        self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, s)
    }
    /// `attention_paged` for a step with prefill chunks: rows `decode_rows..queries` come in
    /// `n_tiles` tiles, `tiles[2j]` its first row and `tiles[2j+1]` its rows (at most
    /// [`PAGED_TILE_ROWS`]), each a run of one sequence's consecutive positions, which a backend
    /// may attend as one block of queries; the rows before `decode_rows` are single queries.
    /// The result is `attention_paged`'s (the CPU runs exactly that).
    #[allow(clippy::too_many_arguments)]
    fn attention_paged_tiled(
        &self,
        o: &mut Self::Buf,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        tables: &Self::Idx,
        seq: &Self::Idx,
        len: &Self::Idx,
        tiles: &Self::Idx,
        n_tiles: usize,
        decode_rows: usize,
        shape: PagedAttnShape,
    ) -> Result<()> {
        let _ = (tiles, n_tiles, decode_rows);
        self.attention_paged(o, q, k_cache, v_cache, tables, seq, len, shape)
    }
    /// One token per row of logits[rows, vocab], drawn as [`sample::sample`] draws it
    /// with u = uniform(key_r, positions[r]), key_r = keys[2r] | keys[2r+1] << 32:
    /// tokens[r] = the id, logprobs[r] = log softmax(z_r / T)[id] (T = 1 when greedy).
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &self,
        tokens: &mut Self::Idx,
        logprobs: &mut Self::Buf,
        logits: &Self::Buf,
        keys: &Self::Idx,
        positions: &Self::Idx,
        rows: usize,
        vocab: usize,
        params: &sample::SamplingParams,
    ) -> Result<()>;
}

/// Greatest common divisor (gcd(a, 0) = a).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::cpu::Cpu;
    use super::*;
    use crate::backend::check::randn;

    /// The packed op against `rope_store_kv` on the three parts split out by hand: q, the
    /// cache rows written and the rows left alone equal bit for bit. Buffers are longer than
    /// the op needs (a workspace), and GQA groups make the parts different unit counts.
    #[test]
    fn rope_store_kv_packed_equals_the_split_op() {
        // (tokens, heads, kv_heads, head_dim): Qwen2.5-0.5B's groups of 7, a group of 3
        // (qd = 48, kd = 32: parts of gcd 16), and MHA.
        for (seed, (tokens, heads, kv, hd)) in [
            (19usize, 14usize, 2usize, 16usize),
            (5, 6, 2, 8),
            (1, 4, 4, 6),
        ]
        .into_iter()
        .enumerate()
        {
            let (qd, kd) = (heads * hd, kv * hd);
            let w = qd + 2 * kd;
            let cache_rows = 3 * tokens + 4;
            let seed = seed as u64 * 10;
            let qkv = randn((tokens + 2) * w, seed);
            let pos: Vec<u32> = (0..tokens as u32).map(|t| 3 * t + 100).collect();
            // Rows scattered backwards through the cache.
            let rows: Vec<u32> = (0..tokens as u32)
                .map(|t| (cache_rows as u32 - 1) - 2 * t)
                .collect();
            let kc0 = randn(cache_rows * kd, seed + 1);
            let vc0 = randn(cache_rows * kd, seed + 2);

            let mut q = Vec::new();
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for r in qkv.chunks(w).take(tokens) {
                q.extend_from_slice(&r[..qd]);
                k.extend_from_slice(&r[qd..qd + kd]);
                v.extend_from_slice(&r[qd + kd..]);
            }
            let (mut kc, mut vc) = (kc0.clone(), vc0.clone());
            Cpu.rope_store_kv(
                &mut q, &mut k, &v, &pos, &mut kc, &mut vc, &rows, tokens, heads, kv, hd, 1e4,
            )
            .unwrap();

            let mut q_out = vec![f32::NAN; tokens * qd + 5];
            let (mut pkc, mut pvc) = (kc0.clone(), vc0.clone());
            Cpu.rope_store_kv_packed(
                &qkv, &mut q_out, &pos, &mut pkc, &mut pvc, &rows, tokens, heads, kv, hd, 1e4,
            )
            .unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&q_out[..tokens * qd]),
                bits(&q),
                "q, shape {heads}/{kv}"
            );
            assert!(
                q_out[tokens * qd..].iter().all(|v| v.is_nan()),
                "wrote past q"
            );
            assert_eq!(bits(&pkc), bits(&kc), "k cache, shape {heads}/{kv}");
            assert_eq!(bits(&pvc), bits(&vc), "v cache, shape {heads}/{kv}");
            // v went in as it was; a row no token names kept its value.
            let r0 = rows[0] as usize;
            assert_eq!(&pvc[r0 * kd..(r0 + 1) * kd], &qkv[qd + kd..w]);
            assert_eq!(pvc[..kd], vc0[..kd]);
        }
    }

    #[test]
    fn swiglu_packed_equals_swiglu_of_the_halves() {
        let (n, f) = (7usize, 37usize);
        let gu = randn((n + 1) * 2 * f, 3);
        let (mut g, mut u) = (Vec::new(), Vec::new());
        for r in gu.chunks(2 * f).take(n) {
            g.extend_from_slice(&r[..f]);
            u.extend_from_slice(&r[f..]);
        }
        let mut want = vec![0.0; n * f];
        Cpu.swiglu(&mut want, &g, &u, n * f).unwrap();
        let mut h = vec![f32::NAN; n * f + 3];
        Cpu.swiglu_packed(&mut h, &gu, n, f).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&h[..n * f]), bits(&want));
        assert!(h[n * f..].iter().all(|v| v.is_nan()), "wrote past h");
        // Row 1, column 2 by hand: silu(g)·u.
        let (a, b) = (gu[2 * f + 2], gu[2 * f + f + 2]);
        assert_eq!(h[f + 2], a * (1.0 / (1.0 + (-a).exp())) * b);
    }

    #[test]
    fn the_cpu_has_no_shared_parts() {
        assert!(Cpu.alloc_parts(&[4, 8], DType::F32).unwrap().is_none());
    }

    #[test]
    fn gcd_of_projection_widths() {
        assert_eq!(gcd(896, 128), 128);
        assert_eq!(gcd(48, 32), 16);
        assert_eq!(gcd(24, 24), 24);
        assert_eq!(gcd(0, 24), 24);
    }
}
