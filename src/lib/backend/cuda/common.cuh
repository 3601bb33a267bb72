// Shared by every kernel family (prepended to each source before NVRTC compiles it).
// No CUDA headers: bf16 is handled as raw 16-bit words so the sources compile with any NVRTC.
//
// Buffers are tagged at run time: a pointer comes with `bf` (1 = bf16, 0 = f32). Every load
// widens to f32 and every store rounds back, so one kernel serves f32 and bf16 buffers; the
// branch is uniform across a launch and costs nothing next to the memory traffic.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

#define DEVI __device__ __forceinline__
#define NEG_INF __int_as_float(0xff800000)

// Error bits a kernel raises instead of touching memory out of bounds; the host reads and
// clears the word at the next synchronize.
#define ERR_TOKEN_ID 1u
#define ERR_ROW 2u
#define ERR_CACHE_ROW 4u
#define ERR_TARGET 16u
#define ERR_PAGED (1u << 10)

// RoPE inverse frequencies by value (rope.cu, and the decode attention that rotates its own q/k).
struct Freqs {
    float f[512];
};

DEVI float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, as half::bf16::from_f32 does on the host.
DEVI bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// c += a·b on the tensor cores, mma.sync m16n8k16 (bf16 inputs, f32 accumulators). Fragment
// layouts (PTX ISA), with g = lane/4, t = lane%4: A regs hold (row g | g+8, cols 2t,2t+1 |
// 2t+8,2t+9), B regs hold (k 2t,2t+1 | 2t+8,2t+9, col g), C holds (row g | g+8, cols 2t, 2t+1).
DEVI void mma16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, the first in the low half (the lower column of a fragment).
DEVI u32 pack2(float lo, float hi) { return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16); }

// (a, b) = hi + lo with both bf16 pairs (a − hi_a is exact in f32): an operand kept to ~16 bits
// through two tensor-core products, e.g. attention probabilities.
DEVI void split2(u32& hi, u32& lo, float a, float b) {
    hi = pack2(a, b);
    lo = pack2(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

// Eight bf16 (one 16-byte load) to f32 and back (round to nearest even, as f2bf).
DEVI void unpack8(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

DEVI uint4 pack8(const float* f) {
    uint4 v;
    v.x = (u32)f2bf(f[0]) | ((u32)f2bf(f[1]) << 16);
    v.y = (u32)f2bf(f[2]) | ((u32)f2bf(f[3]) << 16);
    v.z = (u32)f2bf(f[4]) | ((u32)f2bf(f[5]) << 16);
    v.w = (u32)f2bf(f[6]) | ((u32)f2bf(f[7]) << 16);
    return v;
}

// Elements 8i..8i+7 of a bf16 (bf = 1) or f32 buffer whose base is 16-byte aligned.
DEVI void ld8(const void* p, int bf, i64 i, float* f) {
    if (bf) {
        unpack8(((const uint4*)p)[i], f);
        return;
    }
    float4 a = ((const float4*)p)[2 * i], b = ((const float4*)p)[2 * i + 1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

DEVI void st8(void* p, int bf, i64 i, const float* f) {
    if (bf) {
        ((uint4*)p)[i] = pack8(f);
        return;
    }
    ((float4*)p)[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
    ((float4*)p)[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
}

DEVI float ld(const void* p, int bf, i64 i) {
    return bf ? bf2f(((const bf16_t*)p)[i]) : ((const float*)p)[i];
}

DEVI void st(void* p, int bf, i64 i, float v) {
    if (bf) ((bf16_t*)p)[i] = f2bf(v);
    else ((float*)p)[i] = v;
}

// p[i] += v atomically; bf16 through a compare-and-swap on the aligned 32-bit word.
DEVI void atomic_add(void* p, int bf, i64 i, float v) {
    if (!bf) {
        atomicAdd(((float*)p) + i, v);
        return;
    }
    bf16_t* h = ((bf16_t*)p) + i;
    u32* word = (u32*)((unsigned long long)h & ~3ull);
    u32 shift = ((unsigned long long)h & 2ull) ? 16u : 0u;
    u32 old = *word, assumed;
    do {
        assumed = old;
        float cur = bf2f((bf16_t)((assumed >> shift) & 0xffffu));
        u32 nv = (assumed & ~(0xffffu << shift)) | (((u32)f2bf(cur + v)) << shift);
        old = atomicCAS(word, assumed, nv);
    } while (old != assumed);
}

DEVI float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

DEVI double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

DEVI float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
DEVI float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}

DEVI double block_sum_d(double v, double* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0;
    return warp_sum_d(v);
}

DEVI float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : NEG_INF;
    return warp_max(v);
}

// Index of the packed sequence that owns row i: the last s with cu[s] <= i.
DEVI int seq_of(const u32* cu, int seqs, int i) {
    int lo = 0, hi = seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if ((int)cu[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
