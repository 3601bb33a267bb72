// The LM head's log-softmax and entropy over one chunk of logits (ops/logprob; the GEMM that
// makes the chunk runs in cuBLASLt just before). f32 math with f64 sums over the vocabulary,
// as the CPU backend does.
//
// Layout: logits (and dlogits, in place or into a bf16 copy) are [chunk rows, vocab];
// lp, lse, ent, dlp, dent are per row; targets are u32.
// Launch: one block of 256 threads per row of the chunk, threads striding over the vocabulary.
// Determinism: per-thread strides, then a block tree in a fixed order: the same bits on every
// run, and a row's values do not depend on the other rows.

// z = logit/T; lse = max z + log Σ exp(z − max z); lp = z[y] − lse; ent = lse − Σ p·z.
// A target past the vocabulary raises ERR_TARGET and writes NaN.
extern "C" __global__ void logprob_reduce_k(void* lp, int lpbf, void* ent, int entbf, void* lse, int lsebf,
                                            const void* logits, int zbf, const u32* targets, int rows,
                                            int vocab, float inv_t, u32* err) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    i64 base = (i64)r * vocab;
    // One pass: a running max per thread, sums rescaled when it grows (f64 sums, f32 exps).
    float mx = NEG_INF;
    double se = 0.0, sez = 0.0;
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        float z = ld(logits, zbf, base + c) * inv_t;
        if (z > mx) {
            double rs = (double)expf(mx - z);
            se *= rs;
            sez *= rs;
            mx = z;
        }
        double e = (double)expf(z - mx);
        se += e;
        sez += e * (double)z;
    }
    float bm = block_max(mx, shf);
    double rs = mx == NEG_INF ? 0.0 : (double)expf(mx - bm);
    se = block_sum_d(se * rs, shd);
    sez = block_sum_d(sez * rs, shd);
    mx = bm;
    if (threadIdx.x == 0) {
        u32 y = targets[r];
        double l = (double)mx + log(se);
        float out = __int_as_float(0x7fc00000);
        if ((i64)y >= vocab) atomicOr(err, ERR_TARGET);
        else out = (float)((double)(ld(logits, zbf, base + y) * inv_t) - l);
        st(lp, lpbf, r, out);
        st(lse, lsebf, r, (float)l);
        if (ent) st(ent, entbf, r, (float)(l - sez / se));
    }
}

// dz_v = glp(δ_{v,y} − p_v) − gent·p_v(log p_v + ent), dlogits = dz/T, with log p_v = z_v − lse
// recomputed from the chunk's logits. Written to dl (may alias logits: each element is read
// before it is written by the same thread).
extern "C" __global__ void logprob_dlogits_k(void* dl, int dlbf, const void* logits, int zbf,
                                             const u32* targets, const void* lse, int lsebf, const void* ent,
                                             int entbf, const void* dlp, int dlpbf, const void* dent,
                                             int dentbf, int rows, int vocab, float inv_t) {
    int r = blockIdx.x;
    if (r >= rows) return;
    i64 base = (i64)r * vocab;
    float glp = ld(dlp, dlpbf, r), l = ld(lse, lsebf, r), e = ld(ent, entbf, r);
    float gent = dent ? ld(dent, dentbf, r) : 0.0f;
    u32 y = targets[r];
    for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
        float logp = ld(logits, zbf, base + c) * inv_t - l;
        float p = expf(logp);
        float g = (-glp * p - gent * p * (logp + e)) * inv_t;
        if ((u32)c == y) g += glp * inv_t;
        st(dl, dlbf, base + c, g);
    }
}
