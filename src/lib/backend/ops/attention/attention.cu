// Causal GQA attention over packed variable-length sequences (ops/attention), flash style: tiles of TILE query
// rows against tiles of TILE keys in shared memory, online softmax, never a T×T matrix. Only
// lse = log Σ exp(s) per (row, head) is kept; the backward recomputes P from it.
//
// Packed rows are tiled without regard to sequence boundaries; each row masks keys outside
// [start of its sequence, itself]. A tile that straddles a boundary does at most one extra
// tile of masked work. HD (head dim) and TILE are compile-time: the host compiles this file
// once per head_dim. Math is f32; q/k/v/o may each be f32 or bf16.
//
// Layout: q, o, dq, dout are [tokens, heads, HD] and k, v, dk, dv [tokens, kv_heads, HD], packed
// sequences back to back (cu_seqlens: n_seqs + 1 u32 offsets); lse is [tokens, heads] f32. The
// paged kernels at the end (paged_attn_inv_k, paged_prefill_mma_k, launched by
// ops/paged_attention) read keys and values through block tables as paged_attention.cu does.
// Launch (grids are noted above each kernel): the scalar kernels, NT = 256 threads over tiles of
// TILE rows (64, or 32 past head_dim 128); the tensor-core kernels, 128 threads (4 warps of 16
// rows). The tiled kernels take dynamic shared memory (sizes in ops/attention/cuda.rs).
// Determinism: no atomics; every sum runs in a fixed order (keys in tile order, dK/dV per key
// tile over the queries in order, the per-head dK/dV of the tensor-core path summed over each
// group in order): the same bits on every run. A row's result depends on its own sequence only.

#ifndef HD
#define HD 64
#endif
#ifndef TILE
#define TILE 64
#endif
// ATTN_PART 1: the forward kernels only (generation and scoring), 2: the backward only, 0: all.
#ifndef ATTN_PART
#define ATTN_PART 0
#endif
#define NT 256               // threads per block: a 16×16 grid (ty, tx)
#define RPT (TILE / 16)      // tile rows per thread
#define CPT ((HD + 15) / 16) // head-dim columns per thread
#define LDS (HD + 1)         // padded row stride of [TILE][HD] tiles (no bank conflicts)
#define LDP (TILE + 1)       // padded row stride of [TILE][TILE] tiles

// Max (or sum) over the 16 lanes that share ty (xor offsets below 16 stay inside the half-warp).
DEVI float max16(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
DEVI float sum16(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// dst[r][d] = src[(row0 + r)·stride + off + d] for r < n, 0 beyond.
DEVI void load_tile(float* dst, const void* src, int bf, int row0, int n, i64 stride, i64 off) {
    for (int e = threadIdx.x; e < TILE * HD; e += NT) {
        int r = e / HD, d = e - r * HD;
        dst[r * LDS + d] = r < n ? ld(src, bf, (i64)(row0 + r) * stride + off + d) : 0.0f;
    }
}

// s[a][b] = Σ_d A[ty+16a][d]·B[tx+16b][d] over two [TILE][LDS] tiles.
DEVI void tile_dot(float s[RPT][RPT], const float* A, const float* B) {
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
    for (int a = 0; a < RPT; a++)
#pragma unroll
        for (int b = 0; b < RPT; b++) s[a][b] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HD; d++) {
        float av[RPT], bv[RPT];
#pragma unroll
        for (int a = 0; a < RPT; a++) av[a] = A[(ty + 16 * a) * LDS + d];
#pragma unroll
        for (int b = 0; b < RPT; b++) bv[b] = B[(tx + 16 * b) * LDS + d];
#pragma unroll
        for (int a = 0; a < RPT; a++)
#pragma unroll
            for (int b = 0; b < RPT; b++) s[a][b] += av[a] * bv[b];
    }
}

// acc[a][c] += Σ_j W[ty+16a][j]·M[j][tx+16c] for j < n (W a [TILE][LDP] tile read row-wise,
// or column-wise when trans: W[j][ty+16a]).
DEVI void tile_acc(float acc[RPT][CPT], const float* W, const float* M, int n, bool trans) {
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    for (int j = 0; j < n; j++) {
        float w[RPT];
#pragma unroll
        for (int a = 0; a < RPT; a++) w[a] = trans ? W[j * LDP + ty + 16 * a] : W[(ty + 16 * a) * LDP + j];
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            int col = tx + 16 * c;
            float mv = col < HD ? M[j * LDS + col] : 0.0f;
#pragma unroll
            for (int a = 0; a < RPT; a++) acc[a][c] += w[a] * mv;
        }
    }
}

#if ATTN_PART != 2
// o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j; lse[i,h] = log Σ_j exp(q_i·k_j/√d).
// Grid: (query tiles, heads).
extern "C" __global__ void __launch_bounds__(NT) attn_fwd_k(
    void* o, int obf, void* lse, int lbf, const void* q, int qbf, const void* k, int kbf, const void* v,
    int vbf, const u32* cu, int tokens, int seqs, int heads, int kv_heads, float scale) {
    extern __shared__ float smem[];
    float* Qs = smem;
    float* Ks = Qs + TILE * LDS;
    float* Vs = Ks + TILE * LDS;
    float* Ps = Vs + TILE * LDS;
    __shared__ int start_s[TILE];
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    int q0 = blockIdx.x * TILE;
    if (q0 >= tokens) return;
    int qn = min(TILE, tokens - q0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_tile(Qs, q, qbf, q0, qn, qstride, (i64)h * HD);
    // Clamped to the row itself so a malformed cu_seqlens cannot send loads out of bounds.
    for (int r = threadIdx.x; r < TILE; r += NT)
        start_s[r] = r < qn ? (int)min(cu[seq_of(cu, seqs, q0 + r)], (u32)(q0 + r)) : 0;
    __syncthreads();
    int row[RPT], rstart[RPT];
    float m[RPT], l[RPT], acc[RPT][CPT];
#pragma unroll
    for (int a = 0; a < RPT; a++) {
        row[a] = ty + 16 * a;
        rstart[a] = start_s[row[a]];
        m[a] = NEG_INF;
        l[a] = 0.0f;
#pragma unroll
        for (int c = 0; c < CPT; c++) acc[a][c] = 0.0f;
    }
    int kend = q0 + qn;
    for (int k0 = start_s[0]; k0 < kend; k0 += TILE) {
        int kn = min(TILE, kend - k0);
        __syncthreads();
        load_tile(Ks, k, kbf, k0, kn, kstride, (i64)kh * HD);
        load_tile(Vs, v, vbf, k0, kn, kstride, (i64)kh * HD);
        __syncthreads();
        float s[RPT][RPT];
        tile_dot(s, Qs, Ks);
#pragma unroll
        for (int a = 0; a < RPT; a++) {
            int i = q0 + row[a];
            float mx = NEG_INF;
#pragma unroll
            for (int b = 0; b < RPT; b++) {
                int j = k0 + tx + 16 * b;
                bool ok = row[a] < qn && tx + 16 * b < kn && j >= rstart[a] && j <= i;
                s[a][b] = ok ? s[a][b] * scale : NEG_INF;
                mx = fmaxf(mx, s[a][b]);
            }
            mx = max16(mx);
            float mnew = fmaxf(m[a], mx);
            float corr = mnew == NEG_INF ? 1.0f : expf(m[a] - mnew);
            float ps = 0.0f;
#pragma unroll
            for (int b = 0; b < RPT; b++) {
                float p = s[a][b] == NEG_INF ? 0.0f : expf(s[a][b] - mnew);
                Ps[row[a] * LDP + tx + 16 * b] = p;
                ps += p;
            }
            ps = sum16(ps);
            l[a] = l[a] * corr + ps;
            m[a] = mnew;
#pragma unroll
            for (int c = 0; c < CPT; c++) acc[a][c] *= corr;
        }
        __syncthreads();
        tile_acc(acc, Ps, Vs, kn, false);
    }
#pragma unroll
    for (int a = 0; a < RPT; a++) {
        if (row[a] >= qn) continue;
        i64 i = q0 + row[a];
        float inv = 1.0f / l[a];
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            int col = tx + 16 * c;
            if (col < HD) st(o, obf, i * qstride + (i64)h * HD + col, acc[a][c] * inv);
        }
        if (tx == 0) st(lse, lbf, i * heads + h, m[a] + logf(l[a]));
    }
}
#endif

#if ATTN_PART != 1
// dd[i,h] = Σ_d dO[i,h,d]·O[i,h,d] (the rowsum(dO∘O) term of dS). One warp per (row, head).
extern "C" __global__ void attn_bwd_prep_k(float* dd, const void* dout, int dobf, const void* o, int obf,
                                           int tokens, int heads) {
    i64 w = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= (i64)tokens * heads) return;
    float s = 0.0f;
    for (int d = lane; d < HD; d += 32) s += ld(dout, dobf, w * HD + d) * ld(o, obf, w * HD + d);
    s = warp_sum(s);
    if (lane == 0) dd[w] = s;
}
#endif

// Per query-row statistics of a tile: lse, D = rowsum(dO∘O), and the start of the row's sequence.
DEVI void load_row_stats(float* lse_s, float* dd_s, int* start_s, const void* lse, int lbf, const float* dd,
                         const u32* cu, int seqs, int i0, int n, int heads, int h) {
    for (int r = threadIdx.x; r < TILE; r += NT) {
        bool in = r < n;
        lse_s[r] = in ? ld(lse, lbf, (i64)(i0 + r) * heads + h) : 0.0f;
        dd_s[r] = in ? dd[(i64)(i0 + r) * heads + h] : 0.0f;
        start_s[r] = in ? (int)min(cu[seq_of(cu, seqs, i0 + r)], (u32)(i0 + r)) : 0x7fffffff;
    }
}

// P = exp(S − lse), dP = dO Vᵀ, dS = P∘(dP − D) for query rows i0.. (n of them) against keys
// k0.. (kn of them), masked to start(i) ≤ j ≤ i; P and dS go to [TILE][LDP] tiles.
DEVI void tile_p_ds(float* Ps, float* dSs, const float* Qs, const float* dOs, const float* Ks,
                    const float* Vs, const float* lse_s, const float* dd_s, const int* start_s, int i0,
                    int n, int k0, int kn, float scale) {
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float s[RPT][RPT], dp[RPT][RPT];
    tile_dot(s, Qs, Ks);
    tile_dot(dp, dOs, Vs);
#pragma unroll
    for (int a = 0; a < RPT; a++) {
        int r = ty + 16 * a, i = i0 + r;
#pragma unroll
        for (int b = 0; b < RPT; b++) {
            int c = tx + 16 * b, j = k0 + c;
            bool ok = r < n && c < kn && j >= start_s[r] && j <= i;
            float p = ok ? expf(s[a][b] * scale - lse_s[r]) : 0.0f;
            if (Ps) Ps[r * LDP + c] = p;
            dSs[r * LDP + c] = p * (dp[a][b] - dd_s[r]);
        }
    }
}

#if ATTN_PART != 1
// dV_j = Σ_i P_ij dO_i, dK_j = Σ_i dS_ij Q_i / √d over the query heads of kv head kh and the
// query rows that see key j. Grid: (key tiles, kv heads); dk and dv are overwritten.
extern "C" __global__ void __launch_bounds__(NT) attn_bwd_dkdv_k(
    void* dk, int dkbf, void* dv, int dvbf, const void* dout, int dobf, const void* q, int qbf,
    const void* k, int kbf, const void* v, int vbf, const void* lse, int lbf, const float* dd, const u32* cu,
    int tokens, int seqs, int heads, int kv_heads, float scale) {
    extern __shared__ float smem[];
    float* Ks = smem;
    float* Vs = Ks + TILE * LDS;
    float* Qs = Vs + TILE * LDS;
    float* dOs = Qs + TILE * LDS;
    float* Ps = dOs + TILE * LDS;
    float* dSs = Ps + TILE * LDP;
    __shared__ float lse_s[TILE], dd_s[TILE];
    __shared__ int start_s[TILE];
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int kh = blockIdx.y, group = heads / kv_heads;
    int k0 = blockIdx.x * TILE;
    if (k0 >= tokens) return;
    int kn = min(TILE, tokens - k0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_tile(Ks, k, kbf, k0, kn, kstride, (i64)kh * HD);
    load_tile(Vs, v, vbf, k0, kn, kstride, (i64)kh * HD);
    // Queries that can see a key of this tile: from k0 to the end of the last key's sequence.
    int qend = (int)max(min(cu[seq_of(cu, seqs, k0 + kn - 1) + 1], (u32)tokens), (u32)(k0 + kn));
    float dk_acc[RPT][CPT], dv_acc[RPT][CPT];
#pragma unroll
    for (int a = 0; a < RPT; a++)
#pragma unroll
        for (int c = 0; c < CPT; c++) dk_acc[a][c] = dv_acc[a][c] = 0.0f;
    for (int h = kh * group; h < (kh + 1) * group; h++) {
        for (int i0 = k0; i0 < qend; i0 += TILE) {
            int n = min(TILE, qend - i0);
            __syncthreads();
            load_tile(Qs, q, qbf, i0, n, qstride, (i64)h * HD);
            load_tile(dOs, dout, dobf, i0, n, qstride, (i64)h * HD);
            load_row_stats(lse_s, dd_s, start_s, lse, lbf, dd, cu, seqs, i0, n, heads, h);
            __syncthreads();
            tile_p_ds(Ps, dSs, Qs, dOs, Ks, Vs, lse_s, dd_s, start_s, i0, n, k0, kn, scale);
            __syncthreads();
            tile_acc(dv_acc, Ps, dOs, n, true);
            tile_acc(dk_acc, dSs, Qs, n, true);
        }
    }
#pragma unroll
    for (int a = 0; a < RPT; a++) {
        int r = ty + 16 * a;
        if (r >= kn) continue;
        i64 base = (i64)(k0 + r) * kstride + (i64)kh * HD;
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            int col = tx + 16 * c;
            if (col < HD) {
                st(dk, dkbf, base + col, dk_acc[a][c] * scale);
                st(dv, dvbf, base + col, dv_acc[a][c]);
            }
        }
    }
}
#endif

#if ATTN_PART != 1
// dQ_i = Σ_j dS_ij K_j / √d over the keys row i sees. Grid: (query tiles, heads); dq is overwritten.
extern "C" __global__ void __launch_bounds__(NT) attn_bwd_dq_k(
    void* dq, int dqbf, const void* dout, int dobf, const void* q, int qbf, const void* k, int kbf,
    const void* v, int vbf, const void* lse, int lbf, const float* dd, const u32* cu, int tokens, int seqs,
    int heads, int kv_heads, float scale) {
    extern __shared__ float smem[];
    float* Qs = smem;
    float* dOs = Qs + TILE * LDS;
    float* Ks = dOs + TILE * LDS;
    float* Vs = Ks + TILE * LDS;
    float* dSs = Vs + TILE * LDS;
    __shared__ float lse_s[TILE], dd_s[TILE];
    __shared__ int start_s[TILE];
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    int q0 = blockIdx.x * TILE;
    if (q0 >= tokens) return;
    int qn = min(TILE, tokens - q0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_tile(Qs, q, qbf, q0, qn, qstride, (i64)h * HD);
    load_tile(dOs, dout, dobf, q0, qn, qstride, (i64)h * HD);
    load_row_stats(lse_s, dd_s, start_s, lse, lbf, dd, cu, seqs, q0, qn, heads, h);
    __syncthreads();
    float acc[RPT][CPT];
#pragma unroll
    for (int a = 0; a < RPT; a++)
#pragma unroll
        for (int c = 0; c < CPT; c++) acc[a][c] = 0.0f;
    int kend = q0 + qn;
    for (int k0 = start_s[0]; k0 < kend; k0 += TILE) {
        int kn = min(TILE, kend - k0);
        __syncthreads();
        load_tile(Ks, k, kbf, k0, kn, kstride, (i64)kh * HD);
        load_tile(Vs, v, vbf, k0, kn, kstride, (i64)kh * HD);
        __syncthreads();
        tile_p_ds(nullptr, dSs, Qs, dOs, Ks, Vs, lse_s, dd_s, start_s, q0, qn, k0, kn, scale);
        __syncthreads();
        tile_acc(acc, dSs, Ks, kn, false);
    }
#pragma unroll
    for (int a = 0; a < RPT; a++) {
        int r = ty + 16 * a;
        if (r >= qn) continue;
        i64 base = (i64)(q0 + r) * qstride + (i64)h * HD;
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            int col = tx + 16 * c;
            if (col < HD) st(dq, dqbf, base + col, acc[a][c] * scale);
        }
    }
}
#endif

// ---- tensor-core path (bf16 q/k/v/o, head_dim a multiple of 16 up to 128) -----------------
// The same math with mma.sync m16n8k16 (bf16 inputs, f32 accumulators). Each warp owns 16 rows
// of the matrix it produces (fragment layouts at mma16816 in common.cuh). A C tile of scores
// for 16 keys is exactly the A fragment of the next product, so P never leaves registers.
#if HD % 16 == 0 && HD <= 128

#define KST (HD + 8) // padded bf16 row stride of [rows][HD] tiles: conflict-free 32-bit reads
#define TQ 64        // query rows per block of the forward and dQ kernels (4 warps × 16)
#define TK 64        // keys per tile of the forward
#define TKB 64       // keys per block of the dK/dV kernel (4 warps × 16)
#define TQB 32       // query rows per tile of the dK/dV kernel
#define TKQ 32       // keys per tile of the dQ kernel
#define TST(n) ((n) + 8) // padded bf16 row stride of transposed [HD][n] tiles

DEVI u32 lds32(const bf16_t* p) { return *(const u32*)p; }

// Rows [row0, row0+n) of a [*, stride] bf16 matrix (columns off..off+HD) into a [rows][KST]
// tile (unless dst is null) and, when tr is given, transposed into tr[d][r] (row stride trs).
// Zeros past n.
// 16-byte accesses: HD, the row stride and the column offset are multiples of 8 elements.
DEVI void load_bf_tile(bf16_t* dst, bf16_t* tr, int trs, const bf16_t* src, int row0, int n, int rows,
                       i64 stride, i64 off, int nthreads) {
    for (int e = threadIdx.x; e < rows * (HD / 8); e += nthreads) {
        int r = e / (HD / 8), d = (e - r * (HD / 8)) * 8;
        uint4 x = r < n ? *(const uint4*)(src + (i64)(row0 + r) * stride + off + d) : make_uint4(0, 0, 0, 0);
        if (dst) *(uint4*)(dst + r * KST + d) = x;
        if (tr) {
            u32 w4[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                tr[(d + 2 * j) * trs + r] = (bf16_t)(w4[j] & 0xffffu);
                tr[(d + 2 * j + 1) * trs + r] = (bf16_t)(w4[j] >> 16);
            }
        }
    }
}

// A fragments of 16 rows (base row r0 of a [rows][KST] tile) for k-step kk.
DEVI void afrag(u32 a[4], const bf16_t* t, int r0, int kk) {
    int lane = threadIdx.x & 31, g = lane >> 2, c = kk * 16 + 2 * (lane & 3);
    a[0] = lds32(t + (r0 + g) * KST + c);
    a[1] = lds32(t + (r0 + g + 8) * KST + c);
    a[2] = lds32(t + (r0 + g) * KST + c + 8);
    a[3] = lds32(t + (r0 + g + 8) * KST + c + 8);
}

// C tiles j, j+1 (16 columns) of a score block as the A fragment of the next product.
DEVI void c2a(u32 a[4], const float c0[4], const float c1[4]) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

// One key tile of the forward for a warp's 16 rows: scores of the tile's kn keys (key c is
// position k0 + c), row r keeps keys lo[r] <= j <= hi[r], online-softmax update of (m, l), and
// oc += P·V with P as hi + lo bf16 parts (split2: the output keeps f32-like probabilities).
// Shared by the packed forward and the batch-invariant paged kernel, so that a row sees the
// same tiles, the same operations in the same order, and rounds alike in both. A tile with no
// kept key for a row leaves that row's state bit for bit as it was.
DEVI void fwd_tile(const u32 qa[HD / 16][4], const bf16_t* Ks, const bf16_t* Vt, i64 k0, int kn,
                   const i64 lo[2], const i64 hi[2], float scale, float m[2], float l[2],
                   float oc[HD / 8][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float s[TK / 8][4];
#pragma unroll
    for (int n = 0; n < TK / 8; n++) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            const bf16_t* kp = Ks + (n * 8 + g) * KST + kk * 16 + 2 * t;
            mma16816(s[n], qa[kk], lds32(kp), lds32(kp + 8));
        }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < TK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = e >> 1, c = n * 8 + 2 * t + (e & 1);
            i64 j = k0 + c;
            bool ok = c < kn && j >= lo[r] && j <= hi[r];
            s[n][e] = ok ? s[n][e] * scale : NEG_INF;
            mx[r] = fmaxf(mx[r], s[n][e]);
        }
    float corr[2], ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        float mn = fmaxf(m[r], mx[r]);
        corr[r] = mn == NEG_INF ? 1.0f : expf(m[r] - mn);
        m[r] = mn;
    }
#pragma unroll
    for (int n = 0; n < TK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = e >> 1;
            float p = s[n][e] == NEG_INF ? 0.0f : expf(s[n][e] - m[r]);
            s[n][e] = p;
            ps[r] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 1);
        ps[r] += __shfl_xor_sync(0xffffffffu, ps[r], 2);
        l[r] = l[r] * corr[r] + ps[r];
    }
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        oc[n][0] *= corr[0];
        oc[n][1] *= corr[0];
        oc[n][2] *= corr[1];
        oc[n][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < TK / 16; kk++) {
        u32 pa[4], pl[4];
        split2(pa[0], pl[0], s[2 * kk][0], s[2 * kk][1]);
        split2(pa[1], pl[1], s[2 * kk][2], s[2 * kk][3]);
        split2(pa[2], pl[2], s[2 * kk + 1][0], s[2 * kk + 1][1]);
        split2(pa[3], pl[3], s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            const bf16_t* vp = Vt + (n * 8 + g) * TST(TK) + kk * 16 + 2 * t;
            u32 b0 = lds32(vp), b1 = lds32(vp + 8);
            mma16816(oc[n], pa, b0, b1);
            mma16816(oc[n], pl, b0, b1);
        }
    }
}

// A warp's rows rl[0], rl[1] of a query tile (those below qn) out: o[q0 + r, h, :] = oc / l.
DEVI void store_fwd_rows(bf16_t* o, i64 qstride, int h, i64 q0, int qn, const int rl[2], const float l[2],
                         const float oc[HD / 8][4]) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        if (rl[hi] >= qn) continue;
        i64 i = q0 + rl[hi];
        float inv = 1.0f / l[hi];
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
            *(u32*)(o + i * qstride + (i64)h * HD + n * 8 + 2 * t) =
                pack2(oc[n][2 * hi] * inv, oc[n][2 * hi + 1] * inv);
    }
}

#if ATTN_PART != 2
// o_i = Σ_{j≤i, same seq} softmax_j(q_i·k_j/√d) v_j; lse[i,h] (tensor cores). Grid: (query tiles
// of TQ, heads), 128 threads, dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128) attn_fwd_mma_k(
    bf16_t* o, void* lse, int lbf, const bf16_t* q, const bf16_t* k, const bf16_t* v, const u32* cu,
    int tokens, int seqs, int heads, int kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* Qs = (bf16_t*)smem_raw; // [TQ][KST]
    bf16_t* Ks = Qs + TQ * KST;     // [TK][KST]
    bf16_t* Vt = Ks + TK * KST;     // [HD][TST(TK)]
    __shared__ int start_s[TQ];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    // Last tiles first: they see the most keys, so the grid's tail is short.
    int q0 = (gridDim.x - 1 - blockIdx.x) * TQ;
    if (q0 >= tokens) return;
    int qn = min(TQ, tokens - q0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_bf_tile(Qs, nullptr, 0, q, q0, qn, TQ, qstride, (i64)h * HD, 128);
    for (int r = threadIdx.x; r < TQ; r += 128)
        start_s[r] = r < qn ? (int)min(cu[seq_of(cu, seqs, q0 + r)], (u32)(q0 + r)) : 0;
    __syncthreads();
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) afrag(qa[kk], Qs, w * 16, kk);
    int rl[2] = {w * 16 + g, w * 16 + g + 8};
    int rs[2] = {start_s[rl[0]], start_s[rl[1]]};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float oc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) oc[n][0] = oc[n][1] = oc[n][2] = oc[n][3] = 0.0f;
    // Row i keeps keys rs <= j <= i (rows past the tile keep none). Key tiles start at each
    // sequence's first token, one pass per sequence in the query tile: a row's tiles do not
    // depend on which other sequences share its query tile (or on the packing at all), and a
    // pass over another sequence's keys leaves the row untouched.
    i64 klo[2] = {rs[0], rs[1]};
    i64 khi[2] = {rl[0] < qn ? (i64)(q0 + rl[0]) : -1, rl[1] < qn ? (i64)(q0 + rl[1]) : -1};
    for (int r0 = 0; r0 < qn;) {
        int seg = start_s[r0], r1 = r0 + 1;
        while (r1 < qn && start_s[r1] == seg) r1++;
        int kend = q0 + r1;
        for (int k0 = seg; k0 < kend; k0 += TK) {
            int kn = min(TK, kend - k0);
            __syncthreads();
            load_bf_tile(Ks, nullptr, 0, k, k0, kn, TK, kstride, (i64)kh * HD, 128);
            // V is only needed transposed (the B operand of P·V).
            load_bf_tile(nullptr, Vt, TST(TK), v, k0, kn, TK, kstride, (i64)kh * HD, 128);
            __syncthreads();
            fwd_tile(qa, Ks, Vt, k0, kn, klo, khi, scale, m, l, oc);
        }
        r0 = r1;
    }
    store_fwd_rows(o, qstride, h, q0, qn, rl, l, oc);
#pragma unroll
    for (int hi = 0; hi < 2; hi++)
        if (rl[hi] < qn && t == 0) st(lse, lbf, (i64)(q0 + rl[hi]) * heads + h, m[hi] + logf(l[hi]));
}
#endif

#define PGU 4 // 16-byte pieces of K and V each thread has in flight while gathering a tile

// Threads tid = 0..nthr-1 gather key tile [k0, k0 + kn) of a paged sequence: K rows into Ks,
// V transposed into Vt, zeros past kn (as load_bf_tile). Sets *bad on a block id past the pool.
DEVI void gather_paged_tile(bf16_t* Ks, bf16_t* Vt, const bf16_t* kc, const bf16_t* vc, const u32* table,
                            int block_size, i64 num_blocks, i64 kstride, int kh, int k0, int kn, int tid,
                            int nthr, int* bad) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int e0 = tid; e0 < TK * (HD / 8); e0 += nthr * PGU) {
        uint4 kx[PGU], vx[PGU];
        // PGU pieces per thread are loaded before any is stored, so their latencies overlap.
#pragma unroll
        for (int u = 0; u < PGU; u++) {
            int e = e0 + nthr * u, r = e / (HD / 8), d = (e - r * (HD / 8)) * 8;
            kx[u] = zero;
            vx[u] = zero;
            if (e < TK * (HD / 8) && r < kn) {
                // 32-bit positions (contexts of 2^30 are refused): 64-bit divisions cost ~20×.
                int p = k0 + r, bi = p / block_size;
                u32 blk = table[bi];
                if ((i64)blk >= num_blocks) {
                    *bad = 1;
                } else {
                    i64 off = ((i64)blk * block_size + (p - bi * block_size)) * kstride + (i64)kh * HD + d;
                    kx[u] = *(const uint4*)(kc + off);
                    vx[u] = *(const uint4*)(vc + off);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < PGU; u++) {
            int e = e0 + nthr * u, r = e / (HD / 8), d = (e - r * (HD / 8)) * 8;
            if (e >= TK * (HD / 8)) continue;
            *(uint4*)(Ks + r * KST + d) = kx[u];
            u32 w4[4] = {vx[u].x, vx[u].y, vx[u].z, vx[u].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                Vt[(d + 2 * j) * TST(TK) + r] = (bf16_t)(w4[j] & 0xffffu);
                Vt[(d + 2 * j + 1) * TST(TK) + r] = (bf16_t)(w4[j] >> 16);
            }
        }
    }
}

#if ATTN_PART != 2
// Batch-invariant decode/prefill attention over a paged KV cache (engine::paged; the host uses
// it when batch invariance is on): query i of sequence seq[i] attends to its positions p <
// len[i] (cache row tables[seq[i]·max_blocks + p/bs]·bs + p%bs). One warp per (query, kv head)
// with the group's query heads as its rows (zero past the group, at most 16), key tiles of TK
// from position 0, and fwd_tile for the math: each (query, head) computes exactly what
// attn_fwd_mma_k computes for that token of the packed sequence, bit for bit, so rollout
// log-probs equal the training forward's. The context is not split across warps (that would
// change the order of the sums): the first warp computes tile k while the other three gather
// tile k + 1 into the second of two buffers.
// Grid: (queries, kv heads), 128 threads, dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128) paged_attn_inv_k(
    bf16_t* o, const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* tables,
    const u32* seq, const u32* len, int heads, int kv_heads, int block_size, int max_blocks,
    i64 num_blocks, float scale, u32* err) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* Qs = (bf16_t*)smem_raw; // [16][KST]
    bf16_t* Kb = Qs + 16 * KST;     // two buffers of K [TK][KST] then V transposed [HD][TST(TK)]
    const int BUF = TK * KST + HD * TST(TK);
    int i = blockIdx.x, kh = blockIdx.y;
    int group = heads / kv_heads, h0 = kh * group;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    i64 L = len[i];
    const u32* table = tables + (i64)seq[i] * max_blocks;
    i64 kstride = (i64)kv_heads * HD;
    int bad = L == 0 || L >= (1ll << 30) || (L + block_size - 1) / block_size > max_blocks;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int e = threadIdx.x; e < 16 * (HD / 8); e += 128) {
        int r = e / (HD / 8), d = (e - r * (HD / 8)) * 8;
        *(uint4*)(Qs + r * KST + d) =
            r < group ? *(const uint4*)(q + ((i64)i * heads + h0 + r) * HD + d) : zero;
    }
    int tiles = bad ? 0 : (int)((L + TK - 1) / TK);
    if (tiles > 0)
        gather_paged_tile(Kb, Kb + TK * KST, kc, vc, table, block_size, num_blocks, kstride, kh, 0,
                          (int)min((i64)TK, L), threadIdx.x, 128, &bad);
    bad = __syncthreads_or(bad);
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) afrag(qa[kk], Qs, 0, kk);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float oc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) oc[n][0] = oc[n][1] = oc[n][2] = oc[n][3] = 0.0f;
    i64 klo[2] = {0, 0}, khi[2] = {L - 1, L - 1};
    for (int kt = 0; !bad && kt < tiles; kt++) {
        // Buffer kt & 1 holds tile kt; the other was last read in iteration kt − 1.
        bf16_t* cur = Kb + (kt & 1) * BUF;
        if (w == 0) {
            i64 k0 = (i64)kt * TK;
            fwd_tile(qa, cur, cur + TK * KST, k0, (int)min((i64)TK, L - k0), klo, khi, scale, m, l, oc);
        } else if (kt + 1 < tiles) {
            bf16_t* nxt = Kb + ((kt + 1) & 1) * BUF;
            int k1 = (kt + 1) * TK;
            gather_paged_tile(nxt, nxt + TK * KST, kc, vc, table, block_size, num_blocks, kstride, kh, k1,
                              (int)min((i64)TK, L - k1), threadIdx.x - 32, 96, &bad);
        }
        bad = __syncthreads_or(bad);
    }
    if (bad) {
        if (threadIdx.x == 0) atomicOr(err, ERR_PAGED);
        for (int x = threadIdx.x; x < group * HD; x += 128)
            o[((i64)i * heads + h0) * HD + x] = (bf16_t)0x7fc0;
        return;
    }
    if (w != 0) return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = g + 8 * r;
        if (row >= group) continue;
        float inv = 1.0f / l[r];
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
            *(u32*)(o + ((i64)i * heads + h0 + row) * HD + n * 8 + 2 * t) =
                pack2(oc[n][2 * r] * inv, oc[n][2 * r + 1] * inv);
    }
}
#endif

#if ATTN_PART != 2
// Paged prefill: tile j is rows tiles[2j] .. tiles[2j] + tiles[2j+1] − 1 (at most TQ) of one
// sequence at consecutive positions (a chunk of the engine's step; row r sees len[r] positions,
// len rising by one per row). One block per (tile, query head), as attn_fwd_mma_k with the keys
// gathered through the block table: key tiles of TK from position 0 and fwd_tile for the math,
// so each (row, head) gets the training forward's bits, and the tile's rows share every key
// tile instead of reading the context once each. Grid: (tiles, heads), 128 threads, dynamic
// shared memory (as attn_fwd_mma_k).
extern "C" __global__ void __launch_bounds__(128) paged_prefill_mma_k(
    bf16_t* o, const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* tables,
    const u32* seq, const u32* len, const u32* tiles, int heads, int kv_heads, int block_size,
    int max_blocks, i64 num_blocks, float scale, u32* err) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* Qs = (bf16_t*)smem_raw; // [TQ][KST]
    bf16_t* Ks = Qs + TQ * KST;     // [TK][KST]
    bf16_t* Vt = Ks + TK * KST;     // [HD][TST(TK)]
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    int q0 = (int)tiles[2 * blockIdx.x], qn = (int)tiles[2 * blockIdx.x + 1];
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    int bad = qn < 1 || qn > TQ;
    qn = max(1, min(qn, TQ));
    u32 s0 = seq[q0];
    i64 L0 = len[q0];
    for (int r = threadIdx.x; r < qn; r += 128)
        if (seq[q0 + r] != s0 || (i64)len[q0 + r] != L0 + r) bad = 1;
    // The last row sees keys [0, kend).
    i64 kend = L0 + qn - 1;
    bad |= L0 == 0 || kend >= (1ll << 30) || (kend + block_size - 1) / block_size > max_blocks;
    const u32* table = tables + (i64)s0 * max_blocks;
    load_bf_tile(Qs, nullptr, 0, q, q0, qn, TQ, qstride, (i64)h * HD, 128);
    bad = __syncthreads_or(bad);
    u32 qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) afrag(qa[kk], Qs, w * 16, kk);
    int rl[2] = {w * 16 + g, w * 16 + g + 8};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float oc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) oc[n][0] = oc[n][1] = oc[n][2] = oc[n][3] = 0.0f;
    // Row r keeps keys 0 <= j <= its position; a warp skips the key tiles past its last row
    // (they would leave its rows' state bit for bit as it was).
    i64 klo[2] = {0, 0};
    i64 khi[2] = {rl[0] < qn ? L0 - 1 + rl[0] : -1, rl[1] < qn ? L0 - 1 + rl[1] : -1};
    i64 wlast = w * 16 < qn ? L0 - 1 + min(qn - 1, w * 16 + 15) : -1;
    for (int k0 = 0; !bad && k0 < kend; k0 += TK) {
        int kn = (int)min((i64)TK, kend - k0);
        __syncthreads();
        gather_paged_tile(Ks, Vt, kc, vc, table, block_size, num_blocks, kstride, kh, k0, kn, threadIdx.x, 128,
                          &bad);
        bad = __syncthreads_or(bad);
        if (!bad && k0 <= wlast) fwd_tile(qa, Ks, Vt, k0, kn, klo, khi, scale, m, l, oc);
    }
    if (bad) {
        if (threadIdx.x == 0) atomicOr(err, ERR_PAGED);
        for (int x = threadIdx.x; x < qn * HD; x += 128)
            o[(i64)(q0 + x / HD) * qstride + (i64)h * HD + x % HD] = (bf16_t)0x7fc0;
        return;
    }
    store_fwd_rows(o, qstride, h, q0, qn, rl, l, oc);
}
#endif

#if ATTN_PART != 1
// dV_j = Σ_i P_ij dO_i, dK_j = Σ_i dS_ij Q_i / √d for one query head (tensor cores). Each warp
// owns 16 keys of the block's TKB; query tiles of TQB rows stream through shared memory.
// Transposed computation: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, so P and dS come out as A fragments of
// dV += Pᵀ dO and dK += dSᵀ Q. One block per (key tile, query head) keeps the GPU busy under
// GQA; the per-head f32 results [tokens, heads, HD] are summed over each kv head's group by
// attn_bwd_group_sum_k. Grid: (key tiles, heads), 128 threads, dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkdv_mma_k(
    float* dkp, float* dvp, const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v,
    const void* lse, int lbf, const float* dd, const u32* cu, int tokens, int seqs, int heads,
    int kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* Ks = (bf16_t*)smem_raw;            // [TKB][KST]
    bf16_t* Vs = Ks + TKB * KST;               // [TKB][KST]
    bf16_t* Qs = Vs + TKB * KST;               // [TQB][KST]
    bf16_t* dOs = Qs + TQB * KST;              // [TQB][KST]
    bf16_t* Qt = dOs + TQB * KST;              // [HD][TST(TQB)]
    bf16_t* dOt = Qt + HD * TST(TQB);          // [HD][TST(TQB)]
    __shared__ float lse_s[TQB], dd_s[TQB];
    __shared__ int start_s[TQB];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    int k0 = blockIdx.x * TKB;
    if (k0 >= tokens) return;
    int kn = min(TKB, tokens - k0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_bf_tile(Ks, nullptr, 0, k, k0, kn, TKB, kstride, (i64)kh * HD, 128);
    load_bf_tile(Vs, nullptr, 0, v, k0, kn, TKB, kstride, (i64)kh * HD, 128);
    int qend = (int)max(min(cu[seq_of(cu, seqs, k0 + kn - 1) + 1], (u32)tokens), (u32)(k0 + kn));
    // This warp's keys: rows w*16 + g and + 8 of the tile.
    int kl[2] = {w * 16 + g, w * 16 + g + 8};
    float dkc[HD / 8][4], dvc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dkc[n][e] = dvc[n][e] = 0.0f;
    for (int i0 = k0; i0 < qend; i0 += TQB) {
        int n = min(TQB, qend - i0);
        __syncthreads();
        load_bf_tile(Qs, Qt, TST(TQB), q, i0, n, TQB, qstride, (i64)h * HD, 128);
        load_bf_tile(dOs, dOt, TST(TQB), dout, i0, n, TQB, qstride, (i64)h * HD, 128);
        for (int r = threadIdx.x; r < TQB; r += 128) {
            bool in = r < n;
            lse_s[r] = in ? ld(lse, lbf, (i64)(i0 + r) * heads + h) : 0.0f;
            dd_s[r] = in ? dd[(i64)(i0 + r) * heads + h] : 0.0f;
            start_s[r] = in ? (int)min(cu[seq_of(cu, seqs, i0 + r)], (u32)(i0 + r)) : 0x7fffffff;
        }
        __syncthreads();
        // Sᵀ and dPᵀ: 16 keys × TQB queries per warp.
        float s[TQB / 8][4], dp[TQB / 8][4];
#pragma unroll
        for (int c = 0; c < TQB / 8; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[c][e] = dp[c][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 ka[4], va[4];
            afrag(ka, Ks, w * 16, kk);
            afrag(va, Vs, w * 16, kk);
#pragma unroll
            for (int c = 0; c < TQB / 8; c++) {
                const bf16_t* qp = Qs + (c * 8 + g) * KST + kk * 16 + 2 * t;
                const bf16_t* op = dOs + (c * 8 + g) * KST + kk * 16 + 2 * t;
                mma16816(s[c], ka, lds32(qp), lds32(qp + 8));
                mma16816(dp[c], va, lds32(op), lds32(op + 8));
            }
        }
#pragma unroll
        for (int c = 0; c < TQB / 8; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = c * 8 + 2 * t + (e & 1), i = i0 + r;  // query (column)
                int kr = kl[e >> 1], j = k0 + kr;             // key (row)
                bool ok = r < n && kr < kn && j >= start_s[r] && j <= i;
                float p = ok ? expf(s[c][e] * scale - lse_s[r]) : 0.0f;
                s[c][e] = p;
                dp[c][e] = p * (dp[c][e] - dd_s[r]);
            }
#pragma unroll
        for (int kk = 0; kk < TQB / 16; kk++) {
            u32 pa[4], da[4];
            c2a(pa, s[2 * kk], s[2 * kk + 1]);
            c2a(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int nn = 0; nn < HD / 8; nn++) {
                const bf16_t* op = dOt + (nn * 8 + g) * TST(TQB) + kk * 16 + 2 * t;
                const bf16_t* qp = Qt + (nn * 8 + g) * TST(TQB) + kk * 16 + 2 * t;
                mma16816(dvc[nn], pa, lds32(op), lds32(op + 8));
                mma16816(dkc[nn], da, lds32(qp), lds32(qp + 8));
            }
        }
    }
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        if (kl[hi] >= kn) continue;
        i64 base = ((i64)(k0 + kl[hi]) * heads + h) * HD;
#pragma unroll
        for (int nn = 0; nn < HD / 8; nn++) {
            int c = nn * 8 + 2 * t;
            *(float2*)(dkp + base + c) = make_float2(dkc[nn][2 * hi] * scale, dkc[nn][2 * hi + 1] * scale);
            *(float2*)(dvp + base + c) = make_float2(dvc[nn][2 * hi], dvc[nn][2 * hi + 1]);
        }
    }
}
#endif

#if ATTN_PART != 1
// dk[t, kh, :] = Σ_{h in kh's group} dkp[t, h, :] (same for dv), stored in dk's type.
extern "C" __global__ void attn_bwd_group_sum_k(void* dk, int dkbf, void* dv, int dvbf, const float* dkp,
                                                const float* dvp, int tokens, int heads, int kv_heads) {
    int group = heads / kv_heads;
    i64 n = (i64)tokens * kv_heads * HD;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        i64 t = e / ((i64)kv_heads * HD);
        int r = (int)(e - t * kv_heads * HD), kh = r / HD, d = r - kh * HD;
        float sk = 0.0f, sv = 0.0f;
        for (int h = kh * group; h < (kh + 1) * group; h++) {
            i64 i = (t * heads + h) * HD + d;
            sk += dkp[i];
            sv += dvp[i];
        }
        st(dk, dkbf, e, sk);
        st(dv, dvbf, e, sv);
    }
}
#endif

#if ATTN_PART != 1
// dQ_i = Σ_j dS_ij K_j / √d (tensor cores). Each warp owns 16 query rows; key tiles of TKQ.
// Grid: (query tiles of TQ, heads), 128 threads, dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_mma_k(
    bf16_t* dq, const bf16_t* dout, const bf16_t* q, const bf16_t* k, const bf16_t* v, const void* lse,
    int lbf, const float* dd, const u32* cu, int tokens, int seqs, int heads, int kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* Qs = (bf16_t*)smem_raw; // [TQ][KST]
    bf16_t* dOs = Qs + TQ * KST;    // [TQ][KST]
    bf16_t* Ks = dOs + TQ * KST;    // [TKQ][KST]
    bf16_t* Vs = Ks + TKQ * KST;    // [TKQ][KST]
    bf16_t* Kt = Vs + TKQ * KST;    // [HD][TST(TKQ)]
    __shared__ float lse_s[TQ], dd_s[TQ];
    __shared__ int start_s[TQ];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int h = blockIdx.y, kh = h / (heads / kv_heads);
    int q0 = (gridDim.x - 1 - blockIdx.x) * TQ; // last tiles (most keys) first
    if (q0 >= tokens) return;
    int qn = min(TQ, tokens - q0);
    i64 qstride = (i64)heads * HD, kstride = (i64)kv_heads * HD;
    load_bf_tile(Qs, nullptr, 0, q, q0, qn, TQ, qstride, (i64)h * HD, 128);
    load_bf_tile(dOs, nullptr, 0, dout, q0, qn, TQ, qstride, (i64)h * HD, 128);
    for (int r = threadIdx.x; r < TQ; r += 128) {
        bool in = r < qn;
        lse_s[r] = in ? ld(lse, lbf, (i64)(q0 + r) * heads + h) : 0.0f;
        dd_s[r] = in ? dd[(i64)(q0 + r) * heads + h] : 0.0f;
        start_s[r] = in ? (int)min(cu[seq_of(cu, seqs, q0 + r)], (u32)(q0 + r)) : 0x7fffffff;
    }
    __syncthreads();
    int rl[2] = {w * 16 + g, w * 16 + g + 8};
    float dqc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) dqc[n][0] = dqc[n][1] = dqc[n][2] = dqc[n][3] = 0.0f;
    int kend = q0 + qn;
    for (int k0 = min(start_s[0], kend); k0 < kend; k0 += TKQ) {
        int kn = min(TKQ, kend - k0);
        __syncthreads();
        load_bf_tile(Ks, Kt, TST(TKQ), k, k0, kn, TKQ, kstride, (i64)kh * HD, 128);
        load_bf_tile(Vs, nullptr, 0, v, k0, kn, TKQ, kstride, (i64)kh * HD, 128);
        __syncthreads();
        float s[TKQ / 8][4], dp[TKQ / 8][4];
#pragma unroll
        for (int c = 0; c < TKQ / 8; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[c][e] = dp[c][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            u32 qa[4], oa[4];
            afrag(qa, Qs, w * 16, kk);
            afrag(oa, dOs, w * 16, kk);
#pragma unroll
            for (int c = 0; c < TKQ / 8; c++) {
                const bf16_t* kp = Ks + (c * 8 + g) * KST + kk * 16 + 2 * t;
                const bf16_t* vp = Vs + (c * 8 + g) * KST + kk * 16 + 2 * t;
                mma16816(s[c], qa, lds32(kp), lds32(kp + 8));
                mma16816(dp[c], oa, lds32(vp), lds32(vp + 8));
            }
        }
#pragma unroll
        for (int c = 0; c < TKQ / 8; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = rl[e >> 1], i = q0 + r;           // query (row)
                int kc = c * 8 + 2 * t + (e & 1), j = k0 + kc; // key (column)
                bool ok = r < qn && kc < kn && j >= start_s[r] && j <= i;
                float p = ok ? expf(s[c][e] * scale - lse_s[r]) : 0.0f;
                dp[c][e] = p * (dp[c][e] - dd_s[r]);
            }
#pragma unroll
        for (int kk = 0; kk < TKQ / 16; kk++) {
            u32 da[4];
            c2a(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
            for (int nn = 0; nn < HD / 8; nn++) {
                const bf16_t* kp = Kt + (nn * 8 + g) * TST(TKQ) + kk * 16 + 2 * t;
                mma16816(dqc[nn], da, lds32(kp), lds32(kp + 8));
            }
        }
    }
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        if (rl[hi] >= qn) continue;
        i64 base = (i64)(q0 + rl[hi]) * qstride + (i64)h * HD;
#pragma unroll
        for (int nn = 0; nn < HD / 8; nn++)
            *(u32*)(dq + base + nn * 8 + 2 * t) = pack2(dqc[nn][2 * hi] * scale, dqc[nn][2 * hi + 1] * scale);
    }
}
#endif
#endif
