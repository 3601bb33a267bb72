// Token embedding (ops/embedding): the lookup of table rows and its scatter-add backward.
//
// Layout: table and dtable are [vocab, dim], out and dout [tokens, dim], row-major; ids are u32.
// Launch: one block per token (grid = tokens), threads striding over the row's dim columns
// (dim rounded up to a warp, at most 256).
// Determinism: the lookup is exact. The backward adds with atomics (ids repeat), so the order in
// which a repeated id's rows add up depends on timing (f32 sums may differ in the last bits).
// An id past the vocabulary raises ERR_TOKEN_ID: the lookup writes NaN, the backward skips it.

// out[t,:] = table[ids[t],:]; ids past vocab raise ERR_TOKEN_ID and write NaN.
extern "C" __global__ void embedding_fwd_k(void* out, int obf, const void* table, int tbf, const u32* ids,
                                           int tokens, int dim, i64 vocab, u32* err) {
    int t = blockIdx.x;
    if (t >= tokens) return;
    u32 id = ids[t];
    bool bad = (i64)id >= vocab;
    if (bad && threadIdx.x == 0) atomicOr(err, ERR_TOKEN_ID);
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        st(out, obf, (i64)t * dim + c, bad ? __int_as_float(0x7fc00000) : ld(table, tbf, (i64)id * dim + c));
}

// dtable[ids[t],:] += dout[t,:] (atomic: ids repeat).
extern "C" __global__ void embedding_bwd_k(void* dtable, int dbf, const void* dout, int obf, const u32* ids,
                                           int tokens, int dim, i64 vocab, u32* err) {
    int t = blockIdx.x;
    if (t >= tokens) return;
    u32 id = ids[t];
    if ((i64)id >= vocab) {
        if (threadIdx.x == 0) atomicOr(err, ERR_TOKEN_ID);
        return;
    }
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        atomic_add(dtable, dbf, (i64)id * dim + c, ld(dout, obf, (i64)t * dim + c));
}
