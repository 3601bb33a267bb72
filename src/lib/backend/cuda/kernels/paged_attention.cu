// Decode/prefill attention over a paged KV cache (engine::paged), flash-decoding style.
// Query i attends to positions p < len[i] of sequence seq[i]; position p lives in cache row
// tables[seq[i]·max_blocks + p/bs]·bs + p%bs. The context is split into chunks of split_len
// positions (grid z): each block runs an online softmax over its chunk, then, with more than
// one split, paged_combine_k merges the partial states (m, l, acc) of the splits:
//   o = Σ_s acc_s·e^{m_s−M} / Σ_s l_s·e^{m_s−M},  M = max_s m_s.
// HD (head dim) is compile-time: the host compiles this file once per head_dim. Math is f32;
// q/k/v/o may each be f32 or bf16. A bad length or block raises ERR_PAGED and writes NaN.

#ifndef HD
#define HD 64
#endif
#define PNW 4                 // warps per block: each takes every PNW-th position of the chunk
#define PCPW ((HD + 31) / 32) // head-dim columns per lane
#define ERR_PAGED (1u << 10)

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
    i64 p0 = (i64)sp * split_len, p1 = min(L, p0 + (i64)split_len);
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
