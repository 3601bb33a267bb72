// Sampling on the GPU (ops/sample, for engine::paged): draws one token per row of logits exactly as
// backend::ops::sample::sample does on the host, with the row's counter-based uniform
// u = uniform(key, position) (the same SplitMix64 mixer), and reports its log-prob under
// softmax(z/T) (T = 1 when greedy) over the whole vocabulary:
//   lp = z_tok/T − lse,  lse = max(z)/T + log Σ_v exp(z_v/T − max(z)/T).
// - greedy (T = 0): the first index of the largest logit;
// - plain (T > 0, no truncation): the inverse CDF in vocabulary order;
// - top-k: weights of logits below the k-th largest are zeroed (ties at the threshold kept);
// - top-p: the nucleus is the shortest prefix of the weights sorted descending (ties by id)
//   whose mass reaches top_p of the total; the draw walks that order.
// Greedy and plain (what RL rollouts use) run as one pass over chunks of the vocabulary, so that
// every multiprocessor reads logits and each logit is read once (sample_chunk_k: chunk maxima and
// segment sums of exp(z/T − chunk max)), then one block per row rescales the segment sums to the
// row's max and picks (sample_pick_k). Top-k and top-p run in one block per row (sample_k):
// nothing is sorted, thresholds are found by bisection over the order-preserving bit patterns of
// the values (32 counting passes), ties are resolved by rank in id order.
// A NaN or non-finite maximum raises ERR_SAMPLE and writes token 0 and a NaN log-prob.
//
// Layout: logits are [rows, vocab] (f32 or bf16); keys are two u32 per row (the 64-bit key, low
// word first), positions one per row; tokens (u32) and log-probs (f32) one per row.
// Launch: sample_chunk_k, grid (⌈vocab/SCH⌉, rows) of SNT2 = 256 threads; sample_pick_k, one
// block of SNP = 512 threads per row; sample_k, one block of SNT = 1024 threads per row.
// Determinism: the sums (f64 segment sums, block trees) have a fixed order and the atomics only
// take minima/maxima of indices: the same draw and log-prob on every run, and a row's draw does
// not depend on the other rows.

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

// Exclusive prefix sum of one double per thread over the block in a fixed order (warp scans,
// then a scan of the warp totals); *total gets the block's sum.
DEVI double block_scan_d(double v, double* sh, double* total) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double x = v;
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    double ex = __shfl_up_sync(0xffffffffu, x, 1);
    if (lane == 0) ex = 0.0;
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
    *total = sh[nw - 1];
    return (w > 0 ? sh[w - 1] : 0.0) + ex;
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
    double all, before = block_scan_d(cnt, shd, &all);
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
// One pass (sample_chunk_k, grid: chunks, rows) reads each logit once: a block keeps its chunk
// in registers, takes its max M_c, the first index of it and a NaN flag, then sums the weights
// exp(z/T − m_c), m_c = M_c·(1/T), in f64 per warp segment of SSEG consecutive logits. The pick
// (sample_pick_k, one block per row) takes the row's max m = max M_c·(1/T), rescales each segment
// sum by exp(m_c − m) in f64, and gets the total, lse and the drawn segment from them in a fixed
// order; inside that segment the host's exact weights exp(z/T − m) pick the token. The rescaled
// sums differ from Σ exp(z/T − m) by f32 roundings (~1e-7 relative), so a draw can differ from
// the host's only when its uniform lies that close to a CDF boundary. The chunking depends on
// the vocabulary only, so a row's bits do not depend on the other rows of the batch.
#define SCH 4096
#define SNT2 256
#define SPC (SNT2 / 32)  // segments per chunk, one per warp
#define SSEG (SCH / SPC) // logits per segment
#define SLN (SSEG / 32)  // logits per lane
#define SNP SSEG         // pick threads per row: one logit of a segment each

extern "C" __global__ void __launch_bounds__(SNT2) sample_chunk_k(float* cmax, u32* carg, double* ssum,
                                                                const void* logits, int lbf, int vocab,
                                                                float temperature) {
    __shared__ float shf[32];
    __shared__ int shi;
    // Blocks run from the end of the logits, which the LM head wrote last and L2 may still hold
    // (a cheap guess, not measured; any order gives the same bits).
    int chunks = gridDim.x, c = chunks - 1 - blockIdx.x, row = gridDim.y - 1 - blockIdx.y;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    i64 base = (i64)row * vocab;
    int a = c * SCH + w * SSEG + lane; // this lane's logits: a + 32·k
    bool full = (c + 1) * SCH <= vocab; // no bounds checks between the loads
    float z[SLN];
#pragma unroll
    for (int k = 0; k < SLN; k++)
        z[k] = full || a + 32 * k < vocab ? ld(logits, lbf, base + a + 32 * k) : NEG_INF;
    // Indices increase with k: strict > keeps the first.
    float mx = NEG_INF;
    int arg = vocab, nan = 0;
#pragma unroll
    for (int k = 0; k < SLN; k++) {
        nan |= z[k] != z[k];
        if (z[k] > mx) {
            mx = z[k];
            arg = a + 32 * k;
        }
    }
    if (threadIdx.x == 0) shi = vocab;
    nan = __syncthreads_or(nan);
    float gm = block_max(mx, shf);
    if (mx == gm && arg < vocab) atomicMin(&shi, arg);
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
    float mc = __fmul_rn(gm, inv_t);
    double s = 0.0;
    // A non-finite m_c: a chunk of −inf (no mass) or a row the pick rejects.
    if (!nan && isfinite(mc)) {
        // No FMA contraction: the host computes z·(1/T) − m with two roundings.
#pragma unroll
        for (int k = 0; k < SLN; k++) s += (double)expf(__fsub_rn(__fmul_rn(z[k], inv_t), mc));
    }
    s = warp_sum_d(s);
    i64 o = (i64)row * chunks + c;
    if (lane == 0) ssum[o * SPC + w] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        cmax[o] = nan ? __int_as_float(0x7fc00000) : gm;
        carg[o] = (u32)shi;
    }
}


DEVI int block_max_i(int v, int* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (int)0x80000000;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The host's weight exp(z/T − m) of token v (0 outside the vocabulary).
DEVI float pick_w(const void* lg, int bf, i64 base, int v, int vocab, float inv_t, float m) {
    // No FMA contraction: the host computes z·(1/T) − m with two roundings.
    return v >= 0 && v < vocab ? expf(__fsub_rn(__fmul_rn(ld(lg, bf, base + v), inv_t), m)) : 0.0f;
}

// The last token before b with weight, walking back a window per step (the max has weight 1).
DEVI int last_nz_before(int b, const void* lg, int bf, i64 base, int vocab, float inv_t, float m,
                        int* sh) {
    for (int b0 = b; b0 > 0; b0 -= blockDim.x) {
        int v = b0 - (int)blockDim.x + (int)threadIdx.x;
        int l = block_max_i(pick_w(lg, bf, base, v, vocab, inv_t, m) > 0.0f ? v : -1, sh);
        if (l >= 0) return l;
    }
    return 0;
}

extern "C" __global__ void __launch_bounds__(SNP) sample_pick_k(
    u32* tokens, float* logprobs, const float* cmax, const u32* carg, const double* ssum,
    const void* logits, int lbf, const u32* keys, const u32* positions, int vocab, int chunks,
    float temperature, u32* err) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    __shared__ int shi[32];
    __shared__ double shb;
    int row = blockIdx.x, t = threadIdx.x;
    const int nseg = chunks * SPC;
    const float* cm = cmax + (i64)row * chunks;
    const double* sg = ssum + (i64)row * nseg;
    i64 base = (i64)row * vocab;
    float inv_t = temperature > 0.0f ? 1.0f / temperature : 1.0f;
    // Thread t owns the segments [s0, s1) (one up to vocab SNP·SSEG); the loads of the first
    // are issued before the barriers of the row max.
    int per = (nseg + SNP - 1) / SNP, s0 = min(nseg, t * per), s1 = min(nseg, s0 + per);
    double sg0 = s0 < s1 ? sg[s0] : 0.0;
    float cm0 = s0 < s1 ? cm[s0 / SPC] : 0.0f;
    u64 key = (u64)keys[2 * row] | ((u64)keys[2 * row + 1] << 32);
    u64 pos = (u64)positions[row];
    float mx = NEG_INF;
    int nan = 0;
    for (int c = t; c < chunks; c += SNP) {
        float x = cm[c];
        nan |= x != x;
        mx = fmaxf(mx, x);
    }
    nan = __syncthreads_or(nan);
    mx = block_max(mx, shf);
    float m = __fmul_rn(mx, inv_t);
    if (nan || !isfinite(m)) {
        if (t == 0) {
            atomicOr(err, ERR_SAMPLE);
            tokens[row] = 0;
            logprobs[row] = __int_as_float(0x7fc00000);
        }
        return;
    }
    // Segment x's mass under the row's max: Σ exp(z/T − m_c) · exp(m_c − m); 0 when even the
    // chunk's max has weight 0 on the host (no token of it can be drawn there).
    auto mass = [&](int x) -> double {
        double s = x == s0 ? sg0 : sg[x];
        float mc = __fmul_rn(x == s0 ? cm0 : cm[x / SPC], inv_t);
        return expf(__fsub_rn(mc, m)) > 0.0f ? s * exp((double)mc - (double)m) : 0.0;
    };
    double own = 0.0;
    for (int x = s0; x < s1; x++) own += mass(x);
    double total, before = block_scan_d(own, shd, &total);
    double lse = (double)m + log(total);
    int tok;
    if (temperature == 0.0f) {
        // Greedy: the first chunk reaching the max holds the first index of it.
        int f = chunks;
        for (int c = t; c < chunks; c += SNP)
            if (cm[c] == mx) {
                f = c;
                break;
            }
        f = -block_max_i(-f, shi);
        tok = (int)carg[(i64)row * chunks + f];
    } else {
        double target = uniform01(key, pos) * total;
        // The segment whose running mass first exceeds the target (the lowest if rounding lets
        // two threads see a crossing).
        int cand = nseg;
        double cb = 0.0;
        if (before <= target) {
            double acc = before;
            for (int x = s0; x < s1; x++) {
                double r = mass(x);
                if (r > 0.0 && acc + r > target) {
                    cand = x;
                    cb = acc;
                    break;
                }
                acc += r;
            }
        }
        int seg = -block_max_i(-cand, shi);
        if (cand == seg && seg < nseg) shb = cb;
        __syncthreads();
        // The first token whose running weight exceeds the target, a window of SNP per step from
        // the drawn segment; past it only when the segment's exact weights fall short of its
        // rescaled sum (what the host then draws).
        tok = -1;
        if (seg < nseg) {
            double acc = shb;
            for (int v0 = seg * SSEG; v0 < vocab; v0 += SNP) {
                int v = v0 + t;
                float w = pick_w(logits, lbf, base, v, vocab, inv_t, m);
                double x = (double)w, wsum, ex = block_scan_d(x, shd, &wsum);
                int h = -block_max_i(w > 0.0f && acc + ex + x > target ? -v : -vocab, shi);
                if (h < vocab) {
                    tok = h;
                    break;
                }
                acc += wsum;
            }
        }
        // Rounding left the target past the end: the last token with weight, as the host does.
        if (tok < 0) tok = last_nz_before(vocab, logits, lbf, base, vocab, inv_t, m, shi);
    }
    if (t == 0) {
        tokens[row] = (u32)tok;
        logprobs[row] = (float)((double)ld(logits, lbf, base + tok) * (double)inv_t - lse);
    }
}
