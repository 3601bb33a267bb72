// Memory ops (ops/memory): add, row gather/scatter, KV-cache store.
//
// Layout: buffers are flat, rows of `dim` (or `row_dim`) contiguous elements; `rows` are u32
// row indices; each pointer comes with its bf16 tag.
// Launch: add_assign_k is a grid-stride loop over i64 n (256 threads, up to 8 blocks per SM);
// the row kernels are one block per row i < n, threads striding over the row's columns.
// Determinism: add, gather and kv_store write each element from one thread: exact.
// scatter_add_rows_k adds with atomics, so repeated rows add up in a timing-dependent order
// (the decoder only scatters distinct rows, whose sums are exact).
// Bad indices (a row past the buffer or cache) raise ERR_ROW / ERR_CACHE_ROW and skip the row.

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
