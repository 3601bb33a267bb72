// Decode/prefill attention over a paged KV cache (ops/paged_attention, for engine::paged),
// flash-decoding style.
// Query i attends to positions p < len[i] of sequence seq[i]; position p lives in cache row
// tables[seq[i]·max_blocks + p/bs]·bs + p%bs. The context is split into chunks of split_len
// positions (grid z; see row_split): each block runs an online softmax over its chunk, then, with more than
// one split, paged_combine_k merges the partial states (m, l, acc) of the splits:
//   o = Σ_s acc_s·e^{m_s−M} / Σ_s l_s·e^{m_s−M},  M = max_s m_s.
// HD (head dim) is compile-time: the host compiles this file once per head_dim. Math is f32;
// q/k/v/o may each be f32 or bf16. A bad length or block raises ERR_PAGED and writes NaN.
//
// Layout: q and o are [queries, heads, HD]; the caches are [blocks·block_size, kv_heads·HD];
// tables are [sequences, max_blocks] u32, seq and len one u32 per query. The splits' partial
// states are f32: part_o [queries·heads·splits, HD] and part_ml [queries·heads·splits, 2].
// Launch: grid (queries, heads or kv heads, splits) of PNW = 4 warps: paged_attn_k one block
// per (query, head); paged_attn_gqa_k and the tensor-core kernels one per (query, kv head),
// serving the group; paged_combine_k one block per (query, head). The host picks the split
// count from the number of queries so that there are enough blocks to fill the GPU.
// Determinism: no atomics; each split sums its positions in a fixed order and the combine adds
// the splits in order: the same bits on every run, and (split_len 0) a row's bits do not
// depend on the table width of the step, so a graph-replayed step matches the eager one.

#ifndef HD
#define HD 64
#endif
#define PNW 4                 // warps per block: each takes every PNW-th position of the chunk
#define PCPW ((HD + 31) / 32) // head-dim columns per lane

// Positions per split of a row of length L: split_len, or with split_len = 0 the row's own
// context cut into `splits` even chunks (multiples of 32, at least 64), so that what a row
// computes depends on its length and the split count only, not on the widest table of the
// step (a decode step padded for a CUDA graph gives the same bits as the eager one).
DEVI i64 row_split(i64 L, int split_len, int splits) {
    if (split_len > 0) return split_len;
    i64 c = ((L + splits - 1) / splits + 31) / 32 * 32;
    return c < 64 ? 64 : c;
}

extern "C" __global__ void __launch_bounds__(PNW * 32) paged_attn_k(
    void* o, int obf, const void* q, int qbf, const void* kc, int kcbf, const void* vc, int vcbf,
    const u32* tables, const u32* seq, const u32* len, int heads, int kv_heads, int block_size,
    int max_blocks, i64 num_blocks, int split_len, float scale, float* part_o, float* part_ml,
    u32* err) {
    __shared__ float m_s[PNW], l_s[PNW], acc_s[PNW][HD];
    int i = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int kh = h / (heads / kv_heads);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    i64 L = len[i];
    const u32* table = tables + (i64)seq[i] * max_blocks;
    i64 qoff = ((i64)i * heads + h) * HD, kstride = (i64)kv_heads * HD;
    int bad = L == 0 || (L + block_size - 1) / block_size > max_blocks;
    i64 sl = row_split(L, split_len, splits), p0 = (i64)sp * sl, p1 = min(L, p0 + sl);
    float qr[PCPW], acc[PCPW];
#pragma unroll
    for (int c = 0; c < PCPW; c++) {
        int d = lane + 32 * c;
        qr[c] = d < HD ? ld(q, qbf, qoff + d) : 0.0f;
        acc[c] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (i64 p = p0 + w; !bad && p < p1; p += PNW) {
        u32 blk = table[p / block_size];
        if ((i64)blk >= num_blocks) {
            bad = 1;
            break;
        }
        i64 roff = ((i64)blk * block_size + p % block_size) * kstride + (i64)kh * HD;
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < PCPW; c++) {
            int d = lane + 32 * c;
            if (d < HD) s += qr[c] * ld(kc, kcbf, roff + d);
        }
        s = warp_sum(s) * scale;
        float mnew = fmaxf(m, s);
        float corr = expf(m - mnew), pr = expf(s - mnew);
        l = l * corr + pr;
#pragma unroll
        for (int c = 0; c < PCPW; c++) {
            int d = lane + 32 * c;
            acc[c] = acc[c] * corr + (d < HD ? pr * ld(vc, vcbf, roff + d) : 0.0f);
        }
        m = mnew;
    }
    if (lane == 0) {
        m_s[w] = m;
        l_s[w] = l;
    }
#pragma unroll
    for (int c = 0; c < PCPW; c++) {
        int d = lane + 32 * c;
        if (d < HD) acc_s[w][d] = acc[c];
    }
    bad = __syncthreads_or(bad);
    const float nan = __int_as_float(0x7fc00000);
    if (bad) {
        if (threadIdx.x == 0) atomicOr(err, ERR_PAGED);
        for (int d = threadIdx.x; d < HD; d += PNW * 32) {
            if (splits == 1) st(o, obf, qoff + d, nan);
            else part_o[(((i64)i * heads + h) * splits + sp) * HD + d] = nan;
        }
        if (splits > 1 && threadIdx.x == 0) {
            i64 pi = ((i64)i * heads + h) * splits + sp;
            part_ml[2 * pi] = nan;
            part_ml[2 * pi + 1] = nan;
        }
        return;
    }
    float mm = NEG_INF;
    for (int x = 0; x < PNW; x++) mm = fmaxf(mm, m_s[x]);
    float tot = 0.0f;
    for (int x = 0; x < PNW; x++) tot += m_s[x] == NEG_INF ? 0.0f : l_s[x] * expf(m_s[x] - mm);
    i64 pi = ((i64)i * heads + h) * splits + sp;
    for (int d = threadIdx.x; d < HD; d += PNW * 32) {
        float s = 0.0f;
        for (int x = 0; x < PNW; x++) s += m_s[x] == NEG_INF ? 0.0f : acc_s[x][d] * expf(m_s[x] - mm);
        if (splits == 1) st(o, obf, qoff + d, s / tot);
        else part_o[pi * HD + d] = s;
    }
    if (splits > 1 && threadIdx.x == 0) {
        part_ml[2 * pi] = mm;
        part_ml[2 * pi + 1] = tot;
    }
}

// Merge of the splits of one (query, head): o = Σ_s acc_s·e^{m_s−M} / Σ_s l_s·e^{m_s−M}.
// Splits past the query's length hold m = −∞, l = 0 and drop out.
extern "C" __global__ void paged_combine_k(void* o, int obf, const float* part_o,
                                           const float* part_ml, int heads, int splits) {
    int i = blockIdx.x, h = blockIdx.y;
    i64 base = ((i64)i * heads + h) * splits, qoff = ((i64)i * heads + h) * HD;
    float mm = NEG_INF, tot = 0.0f;
    int nan = 0;
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[2 * (base + s)];
        nan |= ms != ms;
        mm = fmaxf(mm, ms);
    }
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[2 * (base + s)];
        if (ms != NEG_INF) tot += part_ml[2 * (base + s) + 1] * expf(ms - mm);
    }
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++) {
            float ms = part_ml[2 * (base + s)];
            if (ms != NEG_INF) acc += part_o[(base + s) * HD + d] * expf(ms - mm);
        }
        st(o, obf, qoff + d, nan ? __int_as_float(0x7fc00000) : acc / tot);
    }
}

// The same attention with the GQA group in one block (grid: queries, kv_heads, splits): every
// key and value row is read once for the `group` query heads that share it. Each warp takes
// tiles of 32 positions: lanes over positions for the scores (the row read as 16-byte
// vectors), one online-softmax update per tile, then lanes over head dims for P·V. Needs
// HD % 8 == 0 and group <= GMAX (the host falls back to paged_attn_k otherwise).
#define GMAX 8
#if HD % 8 == 0

extern "C" __global__ void __launch_bounds__(PNW * 32) paged_attn_gqa_k(
    void* o, int obf, const void* q, int qbf, const void* kc, int kcbf, const void* vc, int vcbf,
    const u32* tables, const u32* seq, const u32* len, int heads, int kv_heads, int block_size,
    int max_blocks, i64 num_blocks, int split_len, float scale, float* part_o, float* part_ml,
    u32* err) {
    __shared__ float qs[GMAX][HD];
    __shared__ float ps[PNW][GMAX][32];
    __shared__ float m_s[PNW][GMAX], l_s[PNW][GMAX];
    __shared__ float acc_s[PNW][GMAX][HD];
    int i = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int group = heads / kv_heads, h0 = kh * group;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int x = threadIdx.x; x < group * HD; x += PNW * 32)
        qs[x / HD][x % HD] = ld(q, qbf, ((i64)i * heads + h0) * HD + x) * scale;
    __syncthreads();
    i64 L = len[i];
    const u32* table = tables + (i64)seq[i] * max_blocks;
    i64 kstride = (i64)kv_heads * HD;
    int bad = L == 0 || (L + block_size - 1) / block_size > max_blocks;
    i64 sl = row_split(L, split_len, splits), p0 = (i64)sp * sl, p1 = min(L, p0 + sl);
    float m[GMAX], l[GMAX], acc[GMAX][PCPW];
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < PCPW; c++) acc[g][c] = 0.0f;
    }
    for (i64 t0 = p0 + (i64)w * 32; !bad && t0 < p1; t0 += PNW * 32) {
        i64 p = t0 + lane;
        int valid = p < p1;
        i64 roff = 0;
        if (valid) {
            u32 blk = table[p / block_size];
            if ((i64)blk >= num_blocks) {
                bad = 1;
                valid = 0;
            }
            roff = ((i64)blk * block_size + p % block_size) * kstride + (i64)kh * HD;
        }
        float s[GMAX];
#pragma unroll
        for (int g = 0; g < GMAX; g++) s[g] = 0.0f;
        if (valid) {
            for (int d = 0; d < HD; d += 8) {
                float kv8[8];
                ld8(kc, kcbf, (roff + d) / 8, kv8); // roff and d are multiples of 8
#pragma unroll
                for (int g = 0; g < GMAX; g++) {
                    if (g < group) {
#pragma unroll
                        for (int j = 0; j < 8; j++) s[g] += qs[g][d + j] * kv8[j];
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= group) continue;
            float sv = valid ? s[g] : NEG_INF;
            float mnew = fmaxf(m[g], warp_max(sv));
            float corr = m[g] == NEG_INF ? 0.0f : expf(m[g] - mnew);
            float pr = valid ? expf(sv - mnew) : 0.0f;
            l[g] = l[g] * corr + warp_sum(pr);
            ps[w][g][lane] = pr;
#pragma unroll
            for (int c = 0; c < PCPW; c++) acc[g][c] *= corr;
            m[g] = mnew;
        }
        __syncwarp();
        int n = (int)min((i64)32, p1 - t0);
        // Lanes over head dims, PCPW consecutive dims each (one 32-bit load for bf16 pairs);
        // unrolled so several rows' loads are in flight at once.
#pragma unroll 8
        for (int j = 0; j < n; j++) {
            i64 rj = __shfl_sync(0xffffffffu, roff, j);
            float v[PCPW];
            int d0 = lane * PCPW;
            if (vcbf && PCPW % 2 == 0 && d0 < HD) {
#pragma unroll
                for (int c = 0; c < PCPW; c += 2) {
                    u32 wv = *(const u32*)((const bf16_t*)vc + rj + d0 + c);
                    v[c] = __uint_as_float(wv << 16);
                    v[c + 1] = __uint_as_float(wv & 0xffff0000u);
                }
            } else {
#pragma unroll
                for (int c = 0; c < PCPW; c++) v[c] = d0 + c < HD ? ld(vc, vcbf, rj + d0 + c) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= group) continue;
                float pj = ps[w][g][j];
#pragma unroll
                for (int c = 0; c < PCPW; c++) acc[g][c] += pj * v[c];
            }
        }
        __syncwarp();
    }
    bad = __syncthreads_or(bad);
    const float nan = __int_as_float(0x7fc00000);
    if (bad) {
        if (threadIdx.x == 0) atomicOr(err, ERR_PAGED);
        for (int x = threadIdx.x; x < group * HD; x += PNW * 32) {
            i64 hh = (i64)i * heads + h0 + x / HD;
            if (splits == 1) st(o, obf, hh * HD + x % HD, nan);
            else part_o[(hh * splits + sp) * HD + x % HD] = nan;
            if (splits > 1 && x % HD == 0) {
                part_ml[2 * (hh * splits + sp)] = nan;
                part_ml[2 * (hh * splits + sp) + 1] = nan;
            }
        }
        return;
    }
    if (lane == 0) {
        for (int g = 0; g < group; g++) {
            m_s[w][g] = m[g];
            l_s[w][g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        if (g >= group) continue;
#pragma unroll
        for (int c = 0; c < PCPW; c++) {
            int d = lane * PCPW + c;
            if (d < HD) acc_s[w][g][d] = acc[g][c];
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < group * HD; x += PNW * 32) {
        int g = x / HD, d = x % HD;
        float mm = NEG_INF;
        for (int y = 0; y < PNW; y++) mm = fmaxf(mm, m_s[y][g]);
        float tot = 0.0f, sum = 0.0f;
        for (int y = 0; y < PNW; y++) {
            if (m_s[y][g] == NEG_INF) continue;
            float e = expf(m_s[y][g] - mm);
            tot += l_s[y][g] * e;
            sum += acc_s[y][g][d] * e;
        }
        i64 hh = (i64)i * heads + h0 + g;
        if (splits == 1) {
            st(o, obf, hh * HD + d, sum / tot);
        } else {
            part_o[(hh * splits + sp) * HD + d] = sum;
            if (d == 0) {
                part_ml[2 * (hh * splits + sp)] = mm;
                part_ml[2 * (hh * splits + sp) + 1] = tot;
            }
        }
    }
}
#endif

// ---- tensor-core path: bf16 q and cache, HD 64 or 128, group <= 16 --------------------------
// One block per (query, kv head, split) as above, 4 warps taking tiles of 16 positions in turn.
// Per tile, on mma.sync m16n8k16 (mma16816): S[head × pos] = Q[16 heads (the group, zero-padded)
// × HD] · K^T, then O[head × d] += P · V with P split into two bf16 terms (hi + lo).
// Neither product needs shared memory: a dot product over d and a sum over positions do not care
// in which order their terms come, so each lane loads whole 16-byte pieces of K and V rows
// straight from the cache and the fragments use permuted indices:
// - q·k, k-step s: the lane with t = lane%4 holds dims 32·(s/2) + 8t + 4·(s%2) + {0,1 | 2,3}
//   of Q and K (logical columns 2t,2t+1 | 2t+8,2t+9): 16-byte pieces at dims 32x + 8t, so the
//   four lanes of a row read 64 contiguous bytes (whole sectors) per load (see ld_qk);
// - p·v, n-tile j: column n stands for dim n·HD/8 + j, so the lane with g = lane/4 reads dims
//   [g·HD/8, (g+1)·HD/8) of its four V rows, and its C values are dims [2t·HD/8, (2t+2)·HD/8).
#if HD % 64 == 0 && HD <= 128
#define PKS (HD / 16) // k-steps of q·k
#define PNT (HD / 8)  // n-tiles (8 dims each) of p·v
// HN (heads on n): the same with the MMA operands swapped, for GQA groups of at most 8 (every
// Qwen2.5 size): S^T[pos × head] = K · Q^T puts a tile's 16 positions on m and the group on
// n = 8 (m = 16 above pads a group of 7 to 16: half its MMAs and accumulators were padding), and
// O^T[dim × head] += V^T · P^T, 16 dims per m-tile. Lane (g, t): K rows g, g+8 and Q row
// (head) g, dims as in ld_qk; scores of heads 2t, 2t+1 at positions g, g+8; P moves from that C
// layout to the B layout of the second product by movmatrix (an 8 × 8 transpose in registers);
// V rows 2t, 2t+1, 2t+8, 2t+9 at dims [g·HD/8, (g+1)·HD/8) as above; m-tile j's rows g, g+8 are
// dims g·HD/8 + 2j and + 2j + 1.
// Blocks per SM the registers must allow: at HD 128 the kernels want ~172 registers, two
// blocks (8 warps) per SM, and a 7B decode step's attention was latency-bound at 81 µs a layer;
// 168 registers let three fit (no spills in the fused kernel; HD 64 fits four as it is).
#define PMINB (HD > 64 ? 3 : 1)
#define PMINB_HN 4 // HN at HD 128: 128 registers, four blocks (16 warps) per SM

// 8·n consecutive bf16 (16-byte aligned) into 32-bit words; zeros when !ok.
template <int N> DEVI void ld16(u32* w, const bf16_t* p, bool ok) {
#pragma unroll
    for (int x = 0; x < N; x++) {
        uint4 v = ok ? ((const uint4*)p)[x] : make_uint4(0, 0, 0, 0);
        w[4 * x] = v.x;
        w[4 * x + 1] = v.y;
        w[4 * x + 2] = v.z;
        w[4 * x + 3] = v.w;
    }
}

// This lane's dims of a Q or K row for q·k (see above): pieces x = 0..HD/32−1 of 8 bf16 at
// dims 32x + 8t, zeros when !ok.
DEVI void ld_qk(u32* w, const bf16_t* row, int t, bool ok) {
#pragma unroll
    for (int x = 0; x < HD / 32; x++) ld16<1>(w + 4 * x, row + 32 * x + 8 * t, ok);
}

// ROPE: the step's rope + kv_store as well (decode steps of a fused q/k/v projection): row i of
// x is [q | k | v] of the query's token; every block rotates its group's q rows and the kv
// head's k at position pos[i] exactly as rope_store_kv_packed_k does (same expressions, same
// rounding to bf16), uses the new key and value for position len − 1 from shared memory, and
// the first split's block stores them at cache row rows[i]. Without ROPE, q is rotated and the
// cache holds the new token already.
// An 8 × 8 bf16 matrix in the m8n8 fragment layout (lane l: row l/4, columns 2(l%4), +1),
// transposed.
DEVI u32 movtrans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// One tile of the HN kernel: S^T = K·Q^T (positions g, g+8 of the tile × heads 2t, 2t+1 in
// this lane), the online softmax per head over the tile's 16 positions (lanes of one t share a
// head: shuffles over g), then O^T += V^T·(P_hi + P_lo)^T.
DEVI void tile_hn(float acc[HD / 16][4], float m[2], float l[2], const u32* qw, const u32 kw[2][HD / 8],
                  const u32 vw[4][PNT / 2], const int* lr, int rem, float scale) {
    float st[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int ks = 0; ks < PKS; ks++) {
        u32 a[4] = {kw[0][2 * ks], kw[1][2 * ks], kw[0][2 * ks + 1], kw[1][2 * ks + 1]};
        mma16816(st, a, qw[2 * ks], qw[2 * ks + 1]);
    }
    // st: (position g, head 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
    float pr[4];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float x0 = lr[0] < rem ? st[hh] * scale : NEG_INF;
        float x1 = lr[1] < rem ? st[2 + hh] * scale : NEG_INF;
        float mx = fmaxf(x0, x1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        float mnew = fmaxf(m[hh], mx);
        float corr = m[hh] == NEG_INF ? 0.0f : expf(m[hh] - mnew);
        pr[hh] = x0 == NEG_INF ? 0.0f : expf(x0 - mnew);
        pr[2 + hh] = x1 == NEG_INF ? 0.0f : expf(x1 - mnew);
        l[hh] = l[hh] * corr + (pr[hh] + pr[2 + hh]);
        m[hh] = mnew;
#pragma unroll
        for (int j = 0; j < HD / 16; j++) {
            acc[j][hh] *= corr;
            acc[j][2 + hh] *= corr;
        }
    }
    // P^T's B fragments: the 8 × 8 blocks of positions 0..7 and 8..15, transposed.
    u32 h0, l0, h1, l1;
    split2(h0, l0, pr[0], pr[1]);
    split2(h1, l1, pr[2], pr[3]);
    u32 bh0 = movtrans(h0), bh1 = movtrans(h1), bl0 = movtrans(l0), bl1 = movtrans(l1);
#pragma unroll
    for (int j = 0; j < HD / 16; j++) {
        u32 a[4] = {__byte_perm(vw[0][j], vw[1][j], 0x5410u), __byte_perm(vw[0][j], vw[1][j], 0x7632u),
                    __byte_perm(vw[2][j], vw[3][j], 0x5410u), __byte_perm(vw[2][j], vw[3][j], 0x7632u)};
        mma16816(acc[j], a, bh0, bh1);
        mma16816(acc[j], a, bl0, bl1);
    }
}

// The HN kernel's per-warp state for the merge: l summed over the lanes of a head, m and l per
// head, and O^T's C values (m-tile j: dims g·HD/8 + 2j, + 1) as rows of heads.
DEVI void store_state_hn(float (*acc_s)[HD + 4], float* m_s, float* l_s, float acc[HD / 16][4],
                         const float m[2], float l[2], int group) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 4);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 8);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 16);
        int h = 2 * t + hh;
        if (h >= group) continue;
        if (g == 0) {
            m_s[h] = m[hh];
            l_s[h] = l[hh];
        }
#pragma unroll
        for (int j = 0; j < HD / 16; j++) {
            acc_s[h][g * PNT + 2 * j] = acc[j][hh];
            acc_s[h][g * PNT + 2 * j + 1] = acc[j][2 + hh];
        }
    }
}

template <bool ROPE, bool HN>
DEVI void paged_mma(void* o, int obf, const bf16_t* q, bf16_t* kc, bf16_t* vc, const u32* tables,
                    const u32* seq, const u32* len, int heads, int kv_heads, int block_size, int max_blocks,
                    i64 num_blocks, int split_len, float scale, float* part_o, float* part_ml, u32* err,
                    const bf16_t* x, const u32* pos, const u32* rows, i64 cache_rows, const Freqs* fr) {
    __shared__ float m_s[PNW][16], l_s[PNW][16];
    // Rows padded by 4 floats: the lanes of a warp write columns 16t + j of rows g, which
    // would otherwise fall in two banks (16-way conflicts).
    constexpr int QR = HN ? 8 : 16; // q rows of the group (zero past it): n or m of q·k
    __shared__ float acc_s[PNW][QR][HD + 4];
    __shared__ __align__(16) bf16_t qr_s[ROPE ? QR : 1][HD];
    __shared__ __align__(16) bf16_t kn_s[ROPE ? HD : 1], vn_s[ROPE ? HD : 1];
    __shared__ float sn_s[ROPE ? HD / 2 : 1], cs_s[ROPE ? HD / 2 : 1];
    int i = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int group = heads / kv_heads, h0 = kh * group;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    i64 L = len[i];
    const u32* table = tables + (i64)seq[i] * max_blocks;
    i64 kstride = (i64)kv_heads * HD;
    int bad = L == 0 || (L + block_size - 1) / block_size > max_blocks;
    i64 sl = row_split(L, split_len, splits), p0 = (i64)sp * sl, p1 = min(L, p0 + sl);
    // Tiles start at multiples of 16 (p0 is a multiple of 32 or of split_len): with blocks of a
    // multiple of 16 positions a tile never straddles two blocks.
    int whole = block_size % 16 == 0 && p0 % 16 == 0 && L < (1ll << 30);
    // The cache block of the warp's next tile is read a tile ahead, so that the table's latency
    // overlaps the current tile's loads instead of preceding them.
    u32 next_blk = whole && !bad && p0 + 16 * w < p1 ? table[(int)(p0 + 16 * w) / block_size] : 0;
    // Q rows g and g+8 of the group (zero past it), this lane's HD/4 dims: A fragments per
    // k-step (HN: row g alone, B fragments).
    u32 qw[HN ? 1 : 2][HD / 8];
    if (ROPE) {
        const int half = HD / 2, qd = heads * HD;
        i64 row = (i64)i * (qd + 2 * kstride);
        float p = (float)pos[i];
        for (int e = threadIdx.x; e < half; e += PNW * 32) sincosf(p * fr->f[e], &sn_s[e], &cs_s[e]);
        __syncthreads();
        // Rows 0..QR−1: the group's q heads (zero past the group); row QR: the kv head's k.
        // A fixed trip count, unrolled: every load of x is issued before the first is used.
        constexpr int RU = ((QR + 1) * (HD / 2) + PNW * 32 - 1) / (PNW * 32);
#pragma unroll
        for (int u = 0; u < RU; u++) {
            int j = threadIdx.x + u * PNW * 32;
            if (j >= (QR + 1) * half) break;
            int r = j / half, e = j - r * half;
            float s = sn_s[e], c = cs_s[e];
            if (r < QR && r >= group) {
                qr_s[r][e] = qr_s[r][e + half] = 0;
                continue;
            }
            i64 ia = row + (r < QR ? (i64)(h0 + r) * HD : qd + (i64)kh * HD) + e;
            float a = bf2f(x[ia]), b = bf2f(x[ia + half]);
            float ra = a * c - b * s, rb = b * c + a * s;
            bf16_t* dst = r < QR ? qr_s[r] : kn_s;
            dst[e] = f2bf(ra);
            dst[e + half] = f2bf(rb);
        }
        for (int d = threadIdx.x; d < HD; d += PNW * 32) vn_s[d] = x[row + qd + kstride + (i64)kh * HD + d];
        __syncthreads();
        if (sp == 0) {
            u32 cr = rows[i];
            if ((i64)cr >= cache_rows) {
                if (threadIdx.x == 0) atomicOr(err, ERR_CACHE_ROW);
            } else {
                for (int d = threadIdx.x; d < HD; d += PNW * 32) {
                    kc[(i64)cr * kstride + (i64)kh * HD + d] = kn_s[d];
                    vc[(i64)cr * kstride + (i64)kh * HD + d] = vn_s[d];
                }
            }
        }
        ld_qk(qw[0], qr_s[g], t, true);
        if constexpr (!HN) ld_qk(qw[HN ? 0 : 1], qr_s[g + 8], t, true);
    } else {
        ld_qk(qw[0], q + ((i64)i * heads + h0 + g) * HD, t, g < group);
        if constexpr (!HN) ld_qk(qw[HN ? 0 : 1], q + ((i64)i * heads + h0 + g + 8) * HD, t, g + 8 < group);
    }
    // m, l: head rows g, g+8 (HN: heads 2t, 2t+1; l is this lane's part until the end).
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    constexpr int NACC = HN ? HD / 16 : PNT; // C fragments of the output
    float acc[NACC][4];
#pragma unroll
    for (int j = 0; j < NACC; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // This lane's rows of a tile (K: g, 8+g; V: 2t, 2t+1, 8+2t, 9+2t) and their offsets from
    // the tile's first cache row.
    const int lr[6] = {g, 8 + g, 2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
    for (i64 T = p0 + 16 * w; !bad && T < p1; T += 16 * PNW) {
        // Cache row offsets of rows T + lr[x]; a row past the split reads the tile's first row
        // instead (loads need no zero-fill: its score is masked to −∞, so its P is 0 and the
        // finite V it reads adds nothing). 32-bit row tests within the tile: rows below rem
        // exist, row last (if below 16) is the new token.
        i64 rk[2], rv[4];
        int rem = (int)min((i64)16, p1 - T), last = (int)min(L - 1 - T, (i64)16);
        if (whole) {
            // The tile's 16 positions share one cache block: one table read, no divisions.
            int bi = (int)T / block_size;
            u32 blk = next_blk;
            if (T + 16 * PNW < p1) next_blk = table[(int)(T + 16 * PNW) / block_size];
            if ((i64)blk >= num_blocks) bad = 1;
            i64 base = ((i64)blk * block_size + ((int)T - bi * block_size)) * kstride + (i64)kh * HD;
#pragma unroll
            for (int x = 0; x < 6; x++) {
                i64 r = lr[x] < rem ? base + (i64)(lr[x] * (int)kstride) : base;
                if (x < 2) rk[x] = r;
                else rv[x - 2] = r;
            }
        } else {
            u32 b0 = table[T / block_size];
            if ((i64)b0 >= num_blocks) bad = 1;
            i64 r0 = ((i64)b0 * block_size + T % block_size) * kstride + (i64)kh * HD;
#pragma unroll
            for (int x = 0; x < 6; x++) {
                i64 p = T + lr[x], r = r0;
                if (lr[x] < rem) {
                    u32 blk = table[p / block_size];
                    if ((i64)blk >= num_blocks) bad = 1;
                    else r = ((i64)blk * block_size + p % block_size) * kstride + (i64)kh * HD;
                }
                if (x < 2) rk[x] = r;
                else rv[x - 2] = r;
            }
        }
        bad = __any_sync(0xffffffffu, bad); // leave the tile loop together (mma.sync needs the warp)
        if (bad) break;
        u32 kw[2][HD / 8], vw[4][PNT / 2];
        // With ROPE the new token (position L − 1) comes from shared memory: the first split's
        // block may not have stored it yet.
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const bf16_t* kp = ROPE && lr[n] == last ? kn_s : kc + rk[n];
            ld_qk(kw[n], kp, t, true);
        }
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const bf16_t* vp = ROPE && lr[2 + x] == last ? vn_s : vc + rv[x];
            ld16<HD / 64>(vw[x], vp + g * PNT, true);
        }
        if constexpr (HN) {
            tile_hn(acc, m, l, qw[0], kw, vw, lr, rem, scale);
        } else {
            // S: two n-tiles of 8 positions (T+n, T+8+n); rows g, g+8 are heads h0+g, h0+g+8.
            float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    #pragma unroll
            for (int ks = 0; ks < PKS; ks++) {
                u32 a[4] = {qw[0][2 * ks], qw[1][2 * ks], qw[0][2 * ks + 1], qw[1][2 * ks + 1]};
    #pragma unroll
                for (int n = 0; n < 2; n++) mma16816(s[n], a, kw[n][2 * ks], kw[n][2 * ks + 1]);
            }
            // Online softmax per head row (this lane: positions T+2t, T+2t+1, T+8+2t, T+9+2t).
            float pr[2][4];
    #pragma unroll
            for (int r = 0; r < 2; r++) {
                float x[4] = {s[0][2 * r], s[0][2 * r + 1], s[1][2 * r], s[1][2 * r + 1]};
                float mx = NEG_INF;
    #pragma unroll
                for (int c = 0; c < 4; c++) {
                    x[c] = lr[2 + c] < rem ? x[c] * scale : NEG_INF;
                    mx = fmaxf(mx, x[c]);
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                float mnew = fmaxf(m[r], mx);
                float corr = m[r] == NEG_INF ? 0.0f : expf(m[r] - mnew);
                float sum = 0.0f;
    #pragma unroll
                for (int c = 0; c < 4; c++) {
                    pr[r][c] = x[c] == NEG_INF ? 0.0f : expf(x[c] - mnew);
                    sum += pr[r][c];
                }
                l[r] = l[r] * corr + sum;
                m[r] = mnew;
    #pragma unroll
                for (int j = 0; j < PNT; j++) {
                    acc[j][2 * r] *= corr;
                    acc[j][2 * r + 1] *= corr;
                }
            }
            // P = hi + lo, both bf16 (p − hi is exact in f32): two products keep P to ~16 bits, as
            // accurate as the scalar kernel's f32 P, so greedy decoding follows the CPU.
            u32 pa[4], pl[4];
    #pragma unroll
            for (int x = 0; x < 4; x++) split2(pa[x], pl[x], pr[x & 1][(x >> 1) * 2], pr[x & 1][(x >> 1) * 2 + 1]);
            // O += P·V: B of n-tile j = element j of this lane's V pieces, rows paired along k.
    #pragma unroll
            for (int j = 0; j < PNT; j++) {
                u32 sel = (j & 1) ? 0x7632u : 0x5410u;
                u32 b0 = __byte_perm(vw[0][j / 2], vw[1][j / 2], sel);
                u32 b1 = __byte_perm(vw[2][j / 2], vw[3][j / 2], sel);
                mma16816(acc[j], pa, b0, b1);
                mma16816(acc[j], pl, b0, b1);
            }
        }
    }
    bad = __syncthreads_or(bad);
    const float nan = __int_as_float(0x7fc00000);
    if (bad) {
        if (threadIdx.x == 0) atomicOr(err, ERR_PAGED);
        for (int x = threadIdx.x; x < group * HD; x += PNW * 32) {
            i64 hh = (i64)i * heads + h0 + x / HD;
            if (splits == 1) st(o, obf, hh * HD + x % HD, nan);
            else part_o[(hh * splits + sp) * HD + x % HD] = nan;
            if (splits > 1 && x % HD == 0) {
                part_ml[2 * (hh * splits + sp)] = nan;
                part_ml[2 * (hh * splits + sp) + 1] = nan;
            }
        }
        return;
    }
    if constexpr (HN) {
        store_state_hn(acc_s[w], m_s[w], l_s[w], acc, m, l, group);
    } else {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int gr = g + 8 * r;
        if (gr < group) {
            if (t == 0) {
                m_s[w][gr] = m[r];
                l_s[w][gr] = l[r];
            }
#pragma unroll
            for (int j = 0; j < PNT; j++) {
                acc_s[w][gr][2 * t * PNT + j] = acc[j][2 * r];
                acc_s[w][gr][(2 * t + 1) * PNT + j] = acc[j][2 * r + 1];
            }
        }
    }
    }
    __syncthreads();
    // Per head row, once (not per dim: that was a fifth of the kernel's instructions at HD 128):
    // M = max of the warps' maxima, each warp's weight e^{m_w − M} (0 for a warp that saw no
    // position) and the total l = Σ_w l_w·e^{m_w − M}.
    __shared__ float f_s[PNW][16], mm_s[16], tot_s[16];
    if (threadIdx.x < group) {
        int gr = threadIdx.x;
        float mm = NEG_INF, tot = 0.0f;
        for (int y = 0; y < PNW; y++) mm = fmaxf(mm, m_s[y][gr]);
        for (int y = 0; y < PNW; y++) {
            float e = m_s[y][gr] == NEG_INF ? 0.0f : expf(m_s[y][gr] - mm);
            f_s[y][gr] = e;
            tot += l_s[y][gr] * e;
        }
        mm_s[gr] = mm;
        tot_s[gr] = tot;
    }
    __syncthreads();
    // Four dims per thread: o[d..d+4] = Σ_w acc_w·f_w / l (rows of acc_s are 16-byte aligned).
    for (int x = threadIdx.x; x < group * HD / 4; x += PNW * 32) {
        int gr = x / (HD / 4), d = 4 * (x % (HD / 4));
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int y = 0; y < PNW; y++) {
            float4 a = *(const float4*)&acc_s[y][gr][d];
            float e = f_s[y][gr];
            sum.x += a.x * e, sum.y += a.y * e, sum.z += a.z * e, sum.w += a.w * e;
        }
        i64 hh = (i64)i * heads + h0 + gr;
        if (splits == 1) {
            float tot = tot_s[gr];
            st(o, obf, hh * HD + d, sum.x / tot);
            st(o, obf, hh * HD + d + 1, sum.y / tot);
            st(o, obf, hh * HD + d + 2, sum.z / tot);
            st(o, obf, hh * HD + d + 3, sum.w / tot);
        } else {
            *(float4*)&part_o[(hh * splits + sp) * HD + d] = sum;
            if (d == 0) {
                part_ml[2 * (hh * splits + sp)] = mm_s[gr];
                part_ml[2 * (hh * splits + sp) + 1] = tot_s[gr];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(PNW * 32, PMINB) paged_attn_mma_k(
    void* o, int obf, const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* tables,
    const u32* seq, const u32* len, int heads, int kv_heads, int block_size, int max_blocks,
    i64 num_blocks, int split_len, float scale, float* part_o, float* part_ml, u32* err) {
    paged_mma<false, false>(o, obf, q, (bf16_t*)kc, (bf16_t*)vc, tables, seq, len, heads, kv_heads, block_size,
                     max_blocks, num_blocks, split_len, scale, part_o, part_ml, err, nullptr, nullptr, nullptr, 0,
                     nullptr);
}

// paged_attn_mma_k's parameters (x, the fused projection, in q's place), then the rope's.
extern "C" __global__ void __launch_bounds__(PNW * 32, PMINB) paged_attn_mma_rope_k(
    void* o, int obf, const bf16_t* x, bf16_t* kc, bf16_t* vc, const u32* tables, const u32* seq,
    const u32* len, int heads, int kv_heads, int block_size, int max_blocks, i64 num_blocks,
    int split_len, float scale, float* part_o, float* part_ml, u32* err, const u32* pos,
    const u32* rows, i64 cache_rows, Freqs fr) {
    paged_mma<true, false>(o, obf, nullptr, kc, vc, tables, seq, len, heads, kv_heads, block_size, max_blocks,
                    num_blocks, split_len, scale, part_o, part_ml, err, x, pos, rows, cache_rows, &fr);
}
// The HN kernels (group <= 8): the same parameters as the two above.
extern "C" __global__ void __launch_bounds__(PNW * 32, PMINB_HN) paged_attn_mmat_k(
    void* o, int obf, const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* tables,
    const u32* seq, const u32* len, int heads, int kv_heads, int block_size, int max_blocks,
    i64 num_blocks, int split_len, float scale, float* part_o, float* part_ml, u32* err) {
    paged_mma<false, true>(o, obf, q, (bf16_t*)kc, (bf16_t*)vc, tables, seq, len, heads, kv_heads, block_size,
                           max_blocks, num_blocks, split_len, scale, part_o, part_ml, err, nullptr, nullptr,
                           nullptr, 0, nullptr);
}

extern "C" __global__ void __launch_bounds__(PNW * 32, PMINB_HN) paged_attn_mmat_rope_k(
    void* o, int obf, const bf16_t* x, bf16_t* kc, bf16_t* vc, const u32* tables, const u32* seq,
    const u32* len, int heads, int kv_heads, int block_size, int max_blocks, i64 num_blocks,
    int split_len, float scale, float* part_o, float* part_ml, u32* err, const u32* pos,
    const u32* rows, i64 cache_rows, Freqs fr) {
    paged_mma<true, true>(o, obf, nullptr, kc, vc, tables, seq, len, heads, kv_heads, block_size, max_blocks,
                          num_blocks, split_len, scale, part_o, part_ml, err, x, pos, rows, cache_rows, &fr);
}
#endif
