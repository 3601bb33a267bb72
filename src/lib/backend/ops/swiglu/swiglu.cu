// The SwiGLU activation of the MLP (ops/swiglu), elementwise: h = silu(g)·u.
//
// Layout: flat buffers of n elements, or the fused projection gu = [rows, g (f) | u (f)].
// Launch: grid-stride loops over n (256 threads, up to 8 blocks per SM); the _v8 kernels take
// all-bf16, 16-byte-aligned buffers 8 elements per thread through 16-byte accesses;
// swiglu_packed_v8_k runs 128 threads over a row's f/8 groups, rows along grid y.
// Determinism: elementwise: exact, and the scalar and v8 kernels give the same bits.

DEVI float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// h = silu(g)·u = g·σ(g)·u.
extern "C" __global__ void swiglu_fwd_k(void* h, int hbf, const void* g, int gbf, const void* u, int ubf,
                                        i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float gv = ld(g, gbf, i);
        st(h, hbf, i, gv * sigmoid(gv) * ld(u, ubf, i));
    }
}

// The same on one fused gate/up projection gu[n, 2f]: h[i,j] = silu(gu[i,j])·gu[i,f+j]
// (e runs over the n·f outputs).
extern "C" __global__ void swiglu_packed_k(void* h, int hbf, const void* gu, int gbf, i64 f, i64 n) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        i64 i = e / f, j = e - i * f, gi = 2 * f * i + j;
        float gv = ld(gu, gbf, gi);
        st(h, hbf, e, gv * sigmoid(gv) * ld(gu, gbf, gi + f));
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

// The same two ops on all-bf16 buffers, 8 elements per thread through 16-byte loads and stores
// (the scalar kernels above move 2 bytes per access and reach about half the bandwidth).
// n8 = n / 8; every pointer is 16-byte aligned (checked on the host). unpack8/pack8: common.cuh.
extern "C" __global__ void swiglu_fwd_v8_k(uint4* h, const uint4* g, const uint4* u, i64 n8) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n8; i += (i64)gridDim.x * blockDim.x) {
        float gv[8], uv[8], hv[8];
        unpack8(g[i], gv);
        unpack8(u[i], uv);
        for (int k = 0; k < 8; k++) hv[k] = gv[k] * sigmoid(gv[k]) * uv[k];
        h[i] = pack8(hv);
    }
}

// swiglu_packed_k on bf16, 8 outputs per thread: f8 = f / 8 groups per half row. Row i is
// blockIdx.y (a grid-stride loop over rows past 65535), so no thread divides.
extern "C" __global__ void swiglu_packed_v8_k(uint4* h, const uint4* gu, int f8, int rows) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= f8) return;
    for (int i = blockIdx.y; i < rows; i += gridDim.y) {
        i64 gi = 2 * (i64)f8 * i + j;
        float gv[8], uv[8], hv[8];
        unpack8(gu[gi], gv);
        unpack8(gu[gi + f8], uv);
        for (int k = 0; k < 8; k++) hv[k] = gv[k] * sigmoid(gv[k]) * uv[k];
        h[(i64)f8 * i + j] = pack8(hv);
    }
}

extern "C" __global__ void swiglu_bwd_v8_k(uint4* dg, uint4* du, const uint4* dh, const uint4* g,
                                           const uint4* u, i64 n8) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n8; i += (i64)gridDim.x * blockDim.x) {
        float gv[8], uv[8], d[8], a[8], b[8];
        unpack8(g[i], gv);
        unpack8(u[i], uv);
        unpack8(dh[i], d);
        for (int k = 0; k < 8; k++) {
            float s = sigmoid(gv[k]);
            a[k] = d[k] * uv[k] * s * (1.0f + gv[k] * (1.0f - s));
            b[k] = d[k] * gv[k] * s;
        }
        dg[i] = pack8(a);
        du[i] = pack8(b);
    }
}
