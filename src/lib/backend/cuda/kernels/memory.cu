// Memory ops (fills are cuMemsetD32/D16 on the host side): copy with conversion, add, row gather/scatter, KV-cache store.
// Grid-stride loops over i64 element counts; rows are one block each.

// dst[i] = src[i] (f32 <-> bf16 conversion where the types differ).
extern "C" __global__ void convert_k(void* dst, int dbf, const void* src, int sbf, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        st(dst, dbf, i, ld(src, sbf, i));
}

// y[i] += x[i].
extern "C" __global__ void add_assign_k(void* y, int ybf, const void* x, int xbf, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        st(y, ybf, i, ld(y, ybf, i) + ld(x, xbf, i));
}

// out[i,:] = x[rows[i],:]; rows past x_rows raise ERR_ROW and leave out[i,:] untouched.
extern "C" __global__ void gather_rows_k(void* out, int obf, const void* x, int xbf, const u32* rows,
                                         int n, int dim, i64 x_rows, u32* err) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 r = rows[i];
    if ((i64)r >= x_rows) {
        if (threadIdx.x == 0) atomicOr(err, ERR_ROW);
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        st(out, obf, (i64)i * dim + c, ld(x, xbf, (i64)r * dim + c));
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

// dx[rows[i],:] += dout[i,:] (atomic, so repeated rows add up).
extern "C" __global__ void scatter_add_rows_k(void* dx, int dbf, const void* dout, int obf, const u32* rows,
                                              int n, int dim, i64 dx_rows, u32* err) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 r = rows[i];
    if ((i64)r >= dx_rows) {
        if (threadIdx.x == 0) atomicOr(err, ERR_ROW);
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        atomic_add(dx, dbf, (i64)r * dim + c, ld(dout, obf, (i64)i * dim + c));
}

// cache[rows[i],:] = x[i,:] for k and v.
extern "C" __global__ void kv_store_k(void* kc, int kcbf, void* vc, int vcbf, const void* k, int kbf,
                                      const void* v, int vbf, const u32* rows, int n, int row_dim,
                                      i64 cache_rows, u32* err) {
    int i = blockIdx.x;
    if (i >= n) return;
    u32 r = rows[i];
    if ((i64)r >= cache_rows) {
        if (threadIdx.x == 0) atomicOr(err, ERR_CACHE_ROW);
        return;
    }
    for (int c = threadIdx.x; c < row_dim; c += blockDim.x) {
        st(kc, kcbf, (i64)r * row_dim + c, ld(k, kbf, (i64)i * row_dim + c));
        st(vc, vcbf, (i64)r * row_dim + c, ld(v, vbf, (i64)i * row_dim + c));
    }
}

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
