// Optimizer ops (ops/adamw): the squared L2 norm (global grad-norm clipping) and AdamW (f32
// master weights and moments in practice; any buffer type is accepted).
//
// Layout: flat buffers of n elements.
// Launch: sumsq_partial_k: a grid-stride loop (256 threads, at most 1024 blocks) writing one f64
// partial sum per block; sumsq_finish_k: one block of 256 threads over the partials;
// adamw_k: a grid-stride loop over i64 n (256 threads, up to 8 blocks per SM).
// Determinism: the norm sums in f64 in a fixed order (per-thread strides, a block tree, the
// partials in block order): the same bits on every run for a given grid. AdamW is per element.

// part[b] = Σ_{i in block b's grid-stride share} x[i]², in f64.
extern "C" __global__ void sumsq_partial_k(double* part, const void* x, int xbf, i64 n) {
    __shared__ double sh[32];
    double s = 0.0;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        double v = (double)ld(x, xbf, i);
        s += v * v;
    }
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// out[0] = Σ_b part[b] (one block, fixed order: the result does not depend on timing).
extern "C" __global__ void sumsq_finish_k(double* out, const double* part, int blocks) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += part[b];
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) out[0] = s;
}

// AdamW (torch semantics): g' = s·g; m = β1·m + (1−β1)·g'; v = β2·v + (1−β2)·g'²;
// p = p·(1 − lr·wd) − (lr/bc1)·m / (√v/√bc2 + eps).
extern "C" __global__ void adamw_k(void* p, int pbf, const void* g, int gbf, void* m, int mbf, void* v, int vbf, i64 n,
                                   float lr, float beta1, float beta2, float eps, float weight_decay,
                                   float bc1, float bc2, float grad_scale) {
    float decay = 1.0f - lr * weight_decay;
    float step_size = lr / bc1;
    float sqrt_bc2 = sqrtf(bc2);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float gi = ld(g, gbf, i) * grad_scale;
        float mi = beta1 * ld(m, mbf, i) + (1.0f - beta1) * gi;
        float vi = beta2 * ld(v, vbf, i) + (1.0f - beta2) * gi * gi;
        st(m, mbf, i, mi);
        st(v, vbf, i, vi);
        st(p, pbf, i, ld(p, pbf, i) * decay - step_size * mi / (sqrtf(vi) / sqrt_bc2 + eps));
    }
}
