// Sampling on the GPU (engine::paged): draws one token per row of logits exactly as
// engine::sampling::sample does on the host, with the row's counter-based uniform
// u = uniform(key, position) (the same SplitMix64 mixer), and reports its log-prob under
// softmax(z/T) (T = 1 when greedy) over the whole vocabulary:
//   lp = z_tok/T − lse,  lse = max(z)/T + log Σ_v exp(z_v/T − max(z)/T).
// - greedy (T = 0): the first index of the largest logit;
// - plain (T > 0, no truncation): the inverse CDF in vocabulary order;
// - top-k: weights of logits below the k-th largest are zeroed (ties at the threshold kept);
// - top-p: the nucleus is the shortest prefix of the weights sorted descending (ties by id)
//   whose mass reaches top_p of the total; the draw walks that order.
// Greedy and plain (what RL rollouts use) run as three kernels over chunks of the vocabulary
// so that every multiprocessor reads logits (sample_max_k, sample_sum_k, sample_pick_k); top-k
// and top-p run in one block per row (sample_k): nothing is sorted, thresholds are found by
// bisection over the order-preserving bit patterns of the values (32 counting passes), ties
// are resolved by rank in id order.
// A NaN or non-finite maximum raises ERR_SAMPLE and writes token 0 and a NaN log-prob.

#define ERR_SAMPLE (1u << 11)
#define SNT 1024 // threads per block (one block per row)

typedef unsigned long long u64;

DEVI u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

DEVI double uniform01(u64 key, u64 pos) {
    u64 bits = mix64(key ^ mix64(pos + 0x5851F42D4C957F2Dull));
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}

// Larger float, larger key (total order for non-NaN values).
DEVI u32 okey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
DEVI float unokey(u32 k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// Exclusive prefix sum over the block of one double per thread; returns this thread's offset.
DEVI double block_excl_scan_d(double v, double* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double x = v;
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh[w] = x;
    __syncthreads();
    if (w == 0) {
        double t = lane < nw ? sh[lane] : 0.0;
        for (int o = 1; o < 32; o <<= 1) {
            double y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        if (lane < nw) sh[lane] = t;
    }
    __syncthreads();
    double before = w > 0 ? sh[w - 1] : 0.0;
    return before + x - v;
}

struct Row {
    const void* z;
    int bf;
    i64 base;
    int vocab;
    float inv_t, m;
    float thr; // top-k threshold (NEG_INF = none)
};

// The (top-k masked) weight exp(z/T − m) of token v.
DEVI float weight(const Row& r, int v) {
    float z = ld(r.z, r.bf, r.base + v);
    // No FMA contraction: the host computes z·(1/T) − m with two roundings.
    return z < r.thr ? 0.0f : expf(__fsub_rn(__fmul_rn(z, r.inv_t), r.m));
}

// Σ of weights with okey(weight) >= k (all when k = 0), over the block (every thread gets it).
DEVI double mass_ge(const Row& r, u32 k, double* shd) {
    double s = 0.0;
    for (int v = threadIdx.x; v < r.vocab; v += blockDim.x) {
        float w = weight(r, v);
        if (w > 0.0f && okey(w) >= k) s += (double)w;
    }
    return block_sum_d(s, shd);
}

// Index of the `rank`-th (0-based, id order) token whose weight equals `w`; -1 if none.
DEVI int nth_tie(const Row& r, float w, double rank, double* shd, int* shi) {
    int chunk = (r.vocab + blockDim.x - 1) / blockDim.x;
    int a = threadIdx.x * chunk, b = min(r.vocab, a + chunk);
    double cnt = 0.0;
    for (int v = a; v < b; v++) cnt += weight(r, v) == w ? 1.0 : 0.0;
    double before = block_excl_scan_d(cnt, shd);
    if (threadIdx.x == 0) *shi = -1;
    __syncthreads();
    if (cnt > 0.0 && before <= rank && rank < before + cnt) {
        double c = before;
        for (int v = a; v < b; v++) {
            if (weight(r, v) == w) {
                if (c == rank) {
                    *shi = v;
                    break;
                }
                c += 1.0;
            }
        }
    }
    __syncthreads();
    return *shi;
}

extern "C" __global__ void __launch_bounds__(SNT) sample_k(
    u32* tokens, float* logprobs, const void* logits, int lbf, const u32* keys,
    const u32* positions, int vocab, float temperature, int top_k, float top_p, u32* err) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    __shared__ int shi;
    int row = blockIdx.x;
    Row r;
    r.z = logits;
    r.bf = lbf;
    r.base = (i64)row * vocab;
    r.vocab = vocab;
    r.inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
    r.thr = NEG_INF;
    float mx = NEG_INF;
    int nan = 0;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
        float z = ld(logits, lbf, r.base + v);
        nan |= z != z;
        mx = fmaxf(mx, z);
    }
    nan = __syncthreads_or(nan);
    mx = block_max(mx, shf);
    r.m = __fmul_rn(mx, r.inv_t);
    if (nan || isinf(r.m)) {
        if (threadIdx.x == 0) {
            atomicOr(err, ERR_SAMPLE);
            tokens[row] = 0;
            logprobs[row] = __int_as_float(0x7fc00000);
        }
        return;
    }
    // lse over the unmasked softmax(z/T).
    double se = 0.0;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x)
        se += (double)expf(__fsub_rn(__fmul_rn(ld(logits, lbf, r.base + v), r.inv_t), r.m));
    double lse = (double)r.m + log(block_sum_d(se, shd));

    int tok;
    {
        u64 key = (u64)keys[2 * row] | ((u64)keys[2 * row + 1] << 32);
        double u = uniform01(key, (u64)positions[row]);
        if (top_k > 0 && top_k < vocab) {
            // Largest key t with count(okey(z) >= t) >= k: the key of the k-th largest logit.
            u32 lo = 0u, hi = 0xffffffffu;
            while (lo < hi) {
                u32 mid = lo + (u32)(((u64)hi - lo + 1) / 2);
                double c = 0.0;
                for (int v = threadIdx.x; v < vocab; v += blockDim.x)
                    c += okey(ld(logits, lbf, r.base + v)) >= mid ? 1.0 : 0.0;
                if (block_sum_d(c, shd) >= (double)top_k) lo = mid;
                else hi = mid - 1;
            }
            r.thr = unokey(lo);
        }
        // Without top-k the weights are the unmasked exponentials already summed for lse.
        double total = r.thr == NEG_INF ? block_sum_d(se, shd) : mass_ge(r, 0u, shd);
        if (top_p < 1.0f) {
            double need = (double)top_p * total;
            float wmax = 0.0f;
            for (int v = threadIdx.x; v < vocab; v += blockDim.x) wmax = fmaxf(wmax, weight(r, v));
            wmax = block_max(wmax, shf);
            // Threshold tw: the largest weight with mass(w >= tw) >= need.
            u32 lo = 0u, hi = okey(wmax);
            while (lo < hi) {
                u32 mid = lo + (u32)(((u64)hi - lo + 1) / 2);
                if (mass_ge(r, mid, shd) >= need) lo = mid;
                else hi = mid - 1;
            }
            float tw = unokey(lo);
            double above = lo < 0xffffffffu ? mass_ge(r, lo + 1, shd) : 0.0;
            double ties = 0.0;
            for (int v = threadIdx.x; v < vocab; v += blockDim.x) ties += weight(r, v) == tw ? 1.0 : 0.0;
            ties = block_sum_d(ties, shd);
            // Ties at the threshold join in id order until the mass is reached.
            double c = fmin(ties, fmax(1.0, ceil((need - above) / (double)tw)));
            double kept = above + c * (double)tw;
            double target = u * kept;
            float level;
            double rank, limit;
            if (above > target) {
                // The draw lands above the threshold: largest level with mass(w >= level) > target.
                u32 a = lo + 1, b = okey(wmax);
                while (a < b) {
                    u32 mid = a + (u32)(((u64)b - a + 1) / 2);
                    if (mass_ge(r, mid, shd) > target) a = mid;
                    else b = mid - 1;
                }
                level = unokey(a);
                double over = a < 0xffffffffu ? mass_ge(r, a + 1, shd) : 0.0;
                double n_level = 0.0;
                for (int v = threadIdx.x; v < vocab; v += blockDim.x) n_level += weight(r, v) == level ? 1.0 : 0.0;
                limit = block_sum_d(n_level, shd);
                rank = floor((target - over) / (double)level);
            } else {
                level = tw;
                limit = c;
                rank = floor((target - above) / (double)tw);
            }
            rank = fmin(fmax(rank, 0.0), limit - 1.0);
            tok = nth_tie(r, level, rank, shd, &shi);
        } else {
            // Inverse CDF in vocabulary order: the first v whose running mass exceeds u·total.
            // Each warp owns a contiguous segment read in coalesced strides of 32; the warp
            // whose segment holds the target scans it stride by stride (a warp prefix sum).
            double target = u * total;
            int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
            int seg = ((vocab + nw - 1) / nw + 31) / 32 * 32;
            int a = wid * seg, b = min(vocab, a + seg);
            double s = 0.0;
            int last_nz = -1;
            for (int v = a + lane; v < b; v += 32) {
                float w = weight(r, v);
                if (w > 0.0f) {
                    s += (double)w;
                    last_nz = v;
                }
            }
            double wsum = warp_sum_d(s);
            __syncthreads();
            if (lane == 0) shd[wid] = wsum;
            if (threadIdx.x == 0) shi = vocab;
            __syncthreads();
            double before = 0.0;
            for (int x = 0; x < wid; x++) before += shd[x];
            if (wsum > 0.0 && before <= target) {
                double acc = before;
                for (int v0 = a; v0 < b; v0 += 32) {
                    int v = v0 + lane;
                    float w = v < b ? weight(r, v) : 0.0f;
                    double inc = w > 0.0f ? (double)w : 0.0;
                    for (int o = 1; o < 32; o <<= 1) {
                        double y = __shfl_up_sync(0xffffffffu, inc, o);
                        if (lane >= o) inc += y;
                    }
                    unsigned hit = __ballot_sync(0xffffffffu, w > 0.0f && acc + inc > target);
                    if (hit) {
                        if (lane == 0) atomicMin(&shi, v0 + __ffs(hit) - 1);
                        break;
                    }
                    acc += __shfl_sync(0xffffffffu, inc, 31);
                }
            }
            __syncthreads();
            tok = shi;
            if (tok == vocab) {
                // Rounding left the target past the end: the last token with weight.
                __syncthreads();
                if (threadIdx.x == 0) shi = -1;
                __syncthreads();
                if (last_nz >= 0) atomicMax(&shi, last_nz);
                __syncthreads();
                tok = shi;
            }
        }
    }
    if (threadIdx.x == 0) {
        tok = tok < 0 ? 0 : tok;
        tokens[row] = (u32)tok;
        logprobs[row] = (float)((double)ld(logits, lbf, r.base + tok) * (double)r.inv_t - lse);
    }
}

// ---- greedy and plain sampling over chunks of SCH logits ------------------------------------
// Pass 1 (grid: chunks, rows): each chunk's max and the first index holding it (NaN if any logit
// is NaN). Pass 2: with the row's max m from pass 1, the exact weights exp(z/T − m) of the host,
// summed in f64 per warp segment of SSEG consecutive logits. Pass 3 (one warp per row): the
// total and lse from the segment sums in a fixed order, the drawn segment from their running
// sums, the token from a warp prefix sum inside it. The chunking depends on the vocabulary only,
// so a row's bits do not depend on the other rows of the batch.
#define SCH 4096
#define SNT2 256
#define SSEG (SCH / (SNT2 / 32))

extern "C" __global__ void __launch_bounds__(SNT2) sample_max_k(float* cmax, u32* carg,
                                                              const void* logits, int lbf, int vocab) {
    __shared__ float shf[32];
    __shared__ int shi;
    int c = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
    i64 base = (i64)row * vocab;
    int a = c * SCH, b = min(vocab, a + SCH);
    float mx = NEG_INF;
    int arg = vocab, nan = 0;
    // Each thread visits its indices in increasing order: strict > keeps the first.
    for (int v0 = a + threadIdx.x; v0 < b; v0 += 4 * SNT2) {
        float z[4];
#pragma unroll
        for (int u = 0; u < 4; u++) z[u] = v0 + u * SNT2 < b ? ld(logits, lbf, base + v0 + u * SNT2) : NEG_INF;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            nan |= z[u] != z[u];
            if (z[u] > mx) {
                mx = z[u];
                arg = v0 + u * SNT2;
            }
        }
    }
    nan = __syncthreads_or(nan);
    float gm = block_max(mx, shf);
    if (threadIdx.x == 0) shi = vocab;
    __syncthreads();
    if (mx == gm && arg < vocab) atomicMin(&shi, arg);
    __syncthreads();
    if (threadIdx.x == 0) {
        cmax[(i64)row * chunks + c] = nan ? __int_as_float(0x7fc00000) : gm;
        carg[(i64)row * chunks + c] = (u32)shi;
    }
}

// The row's max over the chunk maxima (NaN if any is NaN).
DEVI float row_max(const float* cmax, int chunks) {
    float m = NEG_INF;
    int nan = 0;
    for (int c = 0; c < chunks; c++) {
        float x = cmax[c];
        nan |= x != x;
        m = fmaxf(m, x);
    }
    return nan ? __int_as_float(0x7fc00000) : m;
}

extern "C" __global__ void __launch_bounds__(SNT2) sample_sum_k(double* ssum, const float* cmax,
                                                              const void* logits, int lbf, int vocab,
                                                              float temperature) {
    int c = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
    float mx = row_max(cmax + (i64)row * chunks, chunks);
    float m = __fmul_rn(mx, inv_t);
    i64 base = (i64)row * vocab;
    int a = c * SCH + w * SSEG, b = min(vocab, a + SSEG);
    double s = 0.0;
    if (mx == mx && !isinf(m)) {
        for (int v0 = a + lane; v0 < b; v0 += 128) {
            float z[4];
#pragma unroll
            for (int u = 0; u < 4; u++) z[u] = v0 + 32 * u < b ? ld(logits, lbf, base + v0 + 32 * u) : NEG_INF;
#pragma unroll
            for (int u = 0; u < 4; u++)
                // No FMA contraction: the host computes z·(1/T) − m with two roundings.
                if (z[u] != NEG_INF) s += (double)expf(__fsub_rn(__fmul_rn(z[u], inv_t), m));
        }
    }
    s = warp_sum_d(s);
    if (lane == 0) ssum[((i64)row * chunks + c) * (SNT2 / 32) + w] = s;
}

extern "C" __global__ void __launch_bounds__(32) sample_pick_k(
    u32* tokens, float* logprobs, const float* cmax, const u32* carg, const double* ssum,
    const void* logits, int lbf, const u32* keys, const u32* positions, int vocab, int chunks,
    float temperature, u32* err) {
    int row = blockIdx.x, lane = threadIdx.x;
    const int nseg = chunks * (SNT2 / 32);
    const double* sg = ssum + (i64)row * nseg;
    i64 base = (i64)row * vocab;
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
    float mx = row_max(cmax + (i64)row * chunks, chunks);
    float m = __fmul_rn(mx, inv_t);
    if (mx != mx || isinf(m)) {
        if (lane == 0) {
            atomicOr(err, ERR_SAMPLE);
            tokens[row] = 0;
            logprobs[row] = __int_as_float(0x7fc00000);
        }
        return;
    }
    // Lane x owns segments [x·per, (x+1)·per): its sum, then an exclusive scan over lanes.
    int per = (nseg + 31) / 32, s0 = min(nseg, lane * per), s1 = min(nseg, s0 + per);
    double own = 0.0;
    for (int x = s0; x < s1; x++) own += sg[x];
    double inc = own;
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    double total = __shfl_sync(0xffffffffu, inc, 31);
    double lse = (double)m + log(total);
    int tok;
    if (temperature == 0.0f) {
        // Greedy: the first chunk reaching the max holds the first index of it.
        tok = 0;
        for (int c = 0; c < chunks; c++)
            if (cmax[(i64)row * chunks + c] == mx) {
                tok = (int)carg[(i64)row * chunks + c];
                break;
            }
    } else {
        u64 key = (u64)keys[2 * row] | ((u64)keys[2 * row + 1] << 32);
        double target = uniform01(key, (u64)positions[row]) * total;
        // The segment whose running mass first exceeds the target: each lane looks in its own
        // run, the lowest lane with a hit has it. If rounding leaves the target past the end,
        // the last segment with mass, and in it the last token with weight.
        double before = inc - own, seg_before = -1.0;
        int cand = -1;
        if (before <= target) {
            double acc = before;
            for (int x = s0; x < s1; x++) {
                if (sg[x] > 0.0 && acc + sg[x] > target) {
                    cand = x;
                    seg_before = acc;
                    break;
                }
                acc += sg[x];
            }
        }
        unsigned found = __ballot_sync(0xffffffffu, cand >= 0);
        int seg;
        if (found) {
            int src = __ffs(found) - 1;
            seg = __shfl_sync(0xffffffffu, cand, src);
            seg_before = __shfl_sync(0xffffffffu, seg_before, src);
        } else {
            int last = -1;
            for (int x = s0; x < s1; x++)
                if (sg[x] > 0.0) last = x;
            for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
            seg = max(last, 0);
            seg_before = -1.0;
        }
        int a = seg * SSEG, b = min(vocab, a + SSEG);
        tok = -1;
        int last_nz = -1;
        double acc = seg_before;
        for (int v0 = a; v0 < b; v0 += 32) {
            int v = v0 + lane;
            float z = v < b ? ld(logits, lbf, base + v) : NEG_INF;
            float w = z == NEG_INF ? 0.0f : expf(__fsub_rn(__fmul_rn(z, inv_t), m));
            double x = w > 0.0f ? (double)w : 0.0;
            for (int o = 1; o < 32; o <<= 1) {
                double y = __shfl_up_sync(0xffffffffu, x, o);
                if (lane >= o) x += y;
            }
            unsigned nz = __ballot_sync(0xffffffffu, w > 0.0f);
            if (nz) last_nz = v0 + 31 - __clz(nz);
            unsigned hit = seg_before >= 0.0 ? __ballot_sync(0xffffffffu, w > 0.0f && acc + x > target) : 0u;
            if (hit) {
                tok = v0 + __ffs(hit) - 1;
                break;
            }
            acc += __shfl_sync(0xffffffffu, x, 31);
        }
        if (tok < 0) tok = last_nz < 0 ? 0 : last_nz;
    }
    if (lane == 0) {
        tokens[row] = (u32)tok;
        logprobs[row] = (float)((double)ld(logits, lbf, base + tok) * (double)inv_t - lse);
    }
}
