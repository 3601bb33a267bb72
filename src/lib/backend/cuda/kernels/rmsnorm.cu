// RMSNorm as HF computes it: f32 statistics, weight applied after normalising.
// Forward and dx: one block per row. dw: a deterministic two-pass column reduction.

#define RMS_HELD 16 // elements per thread kept in registers (rows up to 16·blockDim)

// y[r,:] = x[r,:]·rstd[r]·w, rstd[r] = 1/√(mean(x[r,:]²) + eps).
// A row of at most RMS_HELD·blockDim is read once, together with w, before the reduction: the
// loads of both overlap and the output needs no second read (same sums, same bits).
extern "C" __global__ void rmsnorm_fwd_k(void* y, int ybf, float* rstd, const void* x, int xbf,
                                         const void* w, int wbf, int rows, int dim, float eps) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    i64 base = (i64)r * dim;
    float ss = 0.0f;
    if (dim <= RMS_HELD * (int)blockDim.x) {
        float xv[RMS_HELD], wv[RMS_HELD];
#pragma unroll
        for (int k = 0; k < RMS_HELD; k++) {
            int c = threadIdx.x + k * blockDim.x;
            xv[k] = c < dim ? ld(x, xbf, base + c) : 0.0f;
            wv[k] = c < dim ? ld(w, wbf, c) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RMS_HELD; k++) ss += xv[k] * xv[k];
        ss = block_sum(ss, sh);
        float rs = 1.0f / sqrtf(ss / (float)dim + eps);
        if (threadIdx.x == 0) rstd[r] = rs;
#pragma unroll
        for (int k = 0; k < RMS_HELD; k++) {
            int c = threadIdx.x + k * blockDim.x;
            if (c < dim) st(y, ybf, base + c, wv[k] * (xv[k] * rs));
        }
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = ld(x, xbf, base + c);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float rs = 1.0f / sqrtf(ss / (float)dim + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        st(y, ybf, base + c, ld(w, wbf, c) * (ld(x, xbf, base + c) * rs));
}

// dx (= or +=) rstd·(w·dy − x̂·mean(x̂·w·dy)), x̂ = x·rstd.
extern "C" __global__ void rmsnorm_bwd_dx_k(void* dx, int dxbf, const void* dy, int dybf, const void* x,
                                            int xbf, const void* w, int wbf, const float* rstd, int rows,
                                            int dim, int accumulate) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    if (r >= rows) return;
    i64 base = (i64)r * dim;
    float rs = rstd[r];
    float dot = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        dot += (ld(dy, dybf, base + c) * ld(w, wbf, c)) * (ld(x, xbf, base + c) * rs);
    dot = block_sum(dot, sh) / (float)dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float g = ld(dy, dybf, base + c), xv = ld(x, xbf, base + c);
        float v = rs * (g * ld(w, wbf, c) - xv * rs * dot);
        if (accumulate) v += ld(dx, dxbf, base + c);
        st(dx, dxbf, base + c, v);
    }
}

// part[b, c] = Σ_{r in row block b} dy[r,c]·x[r,c]·rstd[r]; colsum_finish_k adds the blocks to dw.
extern "C" __global__ void rmsnorm_bwd_dw_partial_k(float* part, const void* dy, int dybf, const void* x,
                                                    int xbf, const float* rstd, int rows, int dim,
                                                    int rows_per_block) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    int r0 = blockIdx.y * rows_per_block, r1 = min(rows, r0 + rows_per_block);
    float s = 0.0f;
    for (int r = r0; r < r1; r++) {
        i64 i = (i64)r * dim + c;
        s += ld(dy, dybf, i) * ld(x, xbf, i) * rstd[r];
    }
    part[(i64)blockIdx.y * dim + c] = s;
}
