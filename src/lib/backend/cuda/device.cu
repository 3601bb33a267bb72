// The device's own kernels (backend/cuda): element type conversion and the token feed of a
// queued decode step. Fills are cuMemsetD32/D16 and same-type copies cuMemcpy on the host side.
//
// Layout: flat buffers; `dbf`/`sbf` tag each pointer as bf16 (1) or f32 (0) (common.cuh).
// Launch: convert_k is a grid-stride loop over i64 n (256 threads, up to 8 blocks per SM);
// feed_tokens_k is one thread per row, 256 per block.
// Determinism: every element is written by one thread from its own inputs: exact and
// independent of the launch.

// dst[i] = src[i] (f32 <-> bf16 conversion where the types differ).
extern "C" __global__ void convert_k(void* dst, int dbf, const void* src, int sbf, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        st(dst, dbf, i, ld(src, sbf, i));
}

// ids[i] = prev[src[i]] where src[i] != 0xffffffff (a queued decode step's tokens: the draws of
// the step before it); a source past prev_n raises ERR_ROW and leaves ids[i] alone.
extern "C" __global__ void feed_tokens_k(u32* ids, const u32* prev, const u32* src, int n, i64 prev_n,
                                         u32* err) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 s = src[i];
    if (s == 0xffffffffu) return;
    if ((i64)s >= prev_n) {
        atomicOr(err, ERR_ROW);
        return;
    }
    ids[i] = prev[s];
}
