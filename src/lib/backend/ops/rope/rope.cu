// Rotary position embedding (ops/rope), HF rotate_half layout: dimension i pairs with i + d/2.
// The inverse frequencies come from the host (the same f32 values the CPU backend uses), as a
// Freqs (common.cuh), passed by value.
//
// Layout: x, q, k, v are [tokens, heads, head_dim]; the packed input is [tokens, q | k | v];
// caches are [cache rows, kv_heads·head_dim], row rows[t] taking token t; pos and rows are u32.
// Launch: rope_k and rope_store_kv_k, one block per token, threads over the (head, pair) units
// (rounded up to a warp, at most 256); rope_store_kv_packed_k, RPB = 4 tokens per block.
// Determinism: every element is computed by one thread from its own inputs: exact, and the same
// bits whatever else is in the call. A cache row past the cache raises ERR_CACHE_ROW.

// In place on x[t,h,:]: (a,b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
// angle = pos[t]·inv_freq_i; sign = −1 rotates backwards (the backward pass).
extern "C" __global__ void rope_k(void* x, int xbf, const u32* pos, int tokens, int heads, int head_dim,
                                  float sign, Freqs fr) {
    int t = blockIdx.x;
    if (t >= tokens) return;
    int half = head_dim / 2;
    float p = (float)pos[t];
    i64 base = (i64)t * heads * head_dim;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float s, c;
        sincosf(p * fr.f[i], &s, &c);
        s *= sign;
        i64 ia = base + (i64)h * head_dim + i, ib = ia + half;
        float a = ld(x, xbf, ia), b = ld(x, xbf, ib);
        st(x, xbf, ia, a * c - b * s);
        st(x, xbf, ib, b * c + a * s);
    }
}

// A decode step's rope(q), rope(k) and kv_store in one launch, with the same values: q and k
// rotated in place, then cache[rows[t]] = (k_t, v_t) (k as rounded into its buffer).
extern "C" __global__ void rope_store_kv_k(void* q, int qbf, void* k, int kbf, const void* v, int vbf,
                                           const u32* pos, void* kc, int kcbf, void* vc, int vcbf,
                                           const u32* rows, int tokens, int heads, int kv_heads,
                                           int head_dim, i64 cache_rows, Freqs fr, u32* err) {
    int t = blockIdx.x;
    if (t >= tokens) return;
    int half = head_dim / 2, kd = kv_heads * head_dim;
    u32 r = rows[t];
    int ok = (i64)r < cache_rows;
    if (!ok && threadIdx.x == 0) atomicOr(err, ERR_CACHE_ROW);
    float p = (float)pos[t];
    for (int j = threadIdx.x; j < (heads + kv_heads) * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float s, c;
        sincosf(p * fr.f[i], &s, &c);
        int isk = h >= heads, hh = isk ? h - heads : h;
        void* x = isk ? k : q;
        int xbf = isk ? kbf : qbf;
        i64 ia = (i64)t * (isk ? kd : heads * head_dim) + (i64)hh * head_dim + i, ib = ia + half;
        float a = ld(x, xbf, ia), b = ld(x, xbf, ib);
        float ra = a * c - b * s, rb = b * c + a * s;
        st(x, xbf, ia, ra);
        st(x, xbf, ib, rb);
        if (isk && ok) {
            i64 ca = (i64)r * kd + (i64)hh * head_dim + i;
            st(kc, kcbf, ca, xbf ? bf2f(f2bf(ra)) : ra);
            st(kc, kcbf, ca + half, xbf ? bf2f(f2bf(rb)) : rb);
        }
    }
    if (ok)
        for (int c = threadIdx.x; c < kd; c += blockDim.x)
            st(vc, vcbf, (i64)r * kd + c, ld(v, vbf, (i64)t * kd + c));
}

// rope_store_kv_k on the parts of one fused q/k/v projection, row t of x being
// [q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]: the same arithmetic on the same values, so
// it is bit-identical to the split op given the parts. q_out[t] = rope(q_t),
// cache[rows[t]] = (rope(k_t) as rounded to x's type, v_t).
#define RPB 4 // tokens per block of rope_store_kv_packed_k

extern "C" __global__ void rope_store_kv_packed_k(const void* x, int xbf, void* q, int qbf,
                                                  const u32* pos, void* kc, int kcbf, void* vc,
                                                  int vcbf, const u32* rows, int tokens, int heads,
                                                  int kv_heads, int head_dim, i64 cache_rows,
                                                  Freqs fr, u32* err) {
    // RPB tokens per block (a token alone is too little work for a block); their angles once
    // per block instead of once per head.
    __shared__ float sn[RPB][512], cs[RPB][512];
    int t0 = blockIdx.x * RPB;
    int half = head_dim / 2, qd = heads * head_dim, kd = kv_heads * head_dim;
    int pairs = (heads + kv_heads) * half;
    for (int j = threadIdx.x; j < RPB * half; j += blockDim.x) {
        int k = j / half, i = j - k * half, t = t0 + k;
        if (t < tokens) sincosf((float)pos[t] * fr.f[i], &sn[k][i], &cs[k][i]);
    }
    if (threadIdx.x < RPB && t0 + (int)threadIdx.x < tokens && (i64)rows[t0 + threadIdx.x] >= cache_rows)
        atomicOr(err, ERR_CACHE_ROW);
    __syncthreads();
    if (xbf && qbf && kcbf && vcbf && half % 2 == 0) {
        // All bf16 (a rollout's prefill): two adjacent dims per thread as 32-bit words, the
        // same expressions per element as below.
        const bf16_t* xb = (const bf16_t*)x;
        int hp = pairs / 2, h2 = half / 2;
        for (int j = threadIdx.x; j < RPB * hp; j += blockDim.x) {
            int k = j / hp, jj = j - k * hp, t = t0 + k;
            if (t >= tokens) break;
            int h = jj / h2, i = (jj - h * h2) * 2;
            int isk = h >= heads, hh = isk ? h - heads : h;
            i64 ia = (i64)t * (qd + 2 * kd) + (isk ? qd : 0) + (i64)hh * head_dim + i, ib = ia + half;
            u32 wa = *(const u32*)(xb + ia), wb = *(const u32*)(xb + ib), oa = 0, ob = 0;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float s = sn[k][i + e], c = cs[k][i + e];
                float a = bf2f((bf16_t)(wa >> (16 * e))), b = bf2f((bf16_t)(wb >> (16 * e)));
                float ra = a * c - b * s, rb = b * c + a * s;
                oa |= (u32)f2bf(ra) << (16 * e);
                ob |= (u32)f2bf(rb) << (16 * e);
            }
            if (isk) {
                u32 r = rows[t];
                if ((i64)r < cache_rows) {
                    i64 ca = (i64)r * kd + (i64)hh * head_dim + i;
                    *(u32*)((bf16_t*)kc + ca) = oa;
                    *(u32*)((bf16_t*)kc + ca + half) = ob;
                }
            } else {
                i64 qa = (i64)t * qd + (i64)hh * head_dim + i;
                *(u32*)((bf16_t*)q + qa) = oa;
                *(u32*)((bf16_t*)q + qa + half) = ob;
            }
        }
        for (int j = threadIdx.x; j < RPB * (kd / 2); j += blockDim.x) {
            int k = j / (kd / 2), c = (j - k * (kd / 2)) * 2, t = t0 + k;
            if (t >= tokens) break;
            u32 r = rows[t];
            if ((i64)r < cache_rows)
                *(u32*)((bf16_t*)vc + (i64)r * kd + c) = *(const u32*)(xb + (i64)t * (qd + 2 * kd) + qd + kd + c);
        }
        return;
    }
    for (int j = threadIdx.x; j < RPB * pairs; j += blockDim.x) {
        int k = j / pairs, jj = j - k * pairs, t = t0 + k;
        if (t >= tokens) break;
        i64 row = (i64)t * (qd + 2 * kd);
        u32 r = rows[t];
        int h = jj / half, i = jj - h * half;
        float s = sn[k][i], c = cs[k][i];
        int isk = h >= heads, hh = isk ? h - heads : h;
        i64 ia = row + (isk ? qd : 0) + (i64)hh * head_dim + i, ib = ia + half;
        float a = ld(x, xbf, ia), b = ld(x, xbf, ib);
        float ra = a * c - b * s, rb = b * c + a * s;
        if (isk) {
            if ((i64)r < cache_rows) {
                i64 ca = (i64)r * kd + (i64)hh * head_dim + i;
                st(kc, kcbf, ca, xbf ? bf2f(f2bf(ra)) : ra);
                st(kc, kcbf, ca + half, xbf ? bf2f(f2bf(rb)) : rb);
            }
        } else {
            i64 qa = (i64)t * qd + (i64)hh * head_dim + i;
            st(q, qbf, qa, ra);
            st(q, qbf, qa + half, rb);
        }
    }
    for (int j = threadIdx.x; j < RPB * kd; j += blockDim.x) {
        int k = j / kd, c = j - k * kd, t = t0 + k;
        if (t >= tokens) break;
        u32 r = rows[t];
        if ((i64)r < cache_rows)
            st(vc, vcbf, (i64)r * kd + c, ld(x, xbf, (i64)t * (qd + 2 * kd) + qd + kd + c));
    }
}
