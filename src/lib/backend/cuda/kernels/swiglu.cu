// SwiGLU activation of the MLP, elementwise.

DEVI float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// h = silu(g)·u = g·σ(g)·u.
extern "C" __global__ void swiglu_fwd_k(void* h, int hbf, const void* g, int gbf, const void* u, int ubf,
                                        i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float gv = ld(g, gbf, i);
        st(h, hbf, i, gv * sigmoid(gv) * ld(u, ubf, i));
    }
}

// dg = dh·u·σ(g)·(1 + g·(1−σ(g))), du = dh·silu(g).
extern "C" __global__ void swiglu_bwd_k(void* dg, int dgbf, void* du, int dubf, const void* dh, int dhbf,
                                        const void* g, int gbf, const void* u, int ubf, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float gv = ld(g, gbf, i), uv = ld(u, ubf, i), d = ld(dh, dhbf, i);
        float s = sigmoid(gv);
        st(dg, dgbf, i, d * uv * s * (1.0f + gv * (1.0f - s)));
        st(du, dubf, i, d * gv * s);
    }
}
