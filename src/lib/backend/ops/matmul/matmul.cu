// The matmul family's own kernels (ops/matmul); the GEMMs themselves are cuBLASLt
// (backend/cuda/gemm.rs). Here: the deterministic column sum of a bias gradient,
// db[c] += Σ_r dy[r, c], in two passes (rmsnorm's dw reuses the second).
//
// Layout: a is [rows, cols] row-major; part is [blocks, cols] f32.
// Launch: colsum_partial_k: grid (⌈cols/256⌉, blocks), 256 threads, one column per thread over
// a block of rows_per_block rows; colsum_finish_k: grid ⌈cols/256⌉, one column per thread.
// Determinism: fixed summation order (rows in order within a block, then blocks in order):
// the same bits on every run.

// part[b, c] = Σ_{r in row block b} a[r, c]: the first pass of a deterministic column sum
// (bias gradients); colsum_finish_k adds the blocks in order.
extern "C" __global__ void colsum_partial_k(float* part, const void* a, int abf, int rows, int cols,
                                            int rows_per_block) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    int r0 = blockIdx.y * rows_per_block, r1 = min(rows, r0 + rows_per_block);
    float s = 0.0f;
    for (int r = r0; r < r1; r++) s += ld(a, abf, (i64)r * cols + c);
    part[(i64)blockIdx.y * cols + c] = s;
}

// dst[c] += Σ_b part[b, c].
extern "C" __global__ void colsum_finish_k(void* dst, int dbf, const float* part, int blocks, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int b = 0; b < blocks; b++) s += part[(i64)b * cols + c];
    st(dst, dbf, c, ld(dst, dbf, c) + s);
}
