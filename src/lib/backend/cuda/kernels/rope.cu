// Rotary position embedding, HF rotate_half layout: dimension i pairs with i + d/2.
// The inverse frequencies come from the host (the same f32 values the CPU backend uses).

struct Freqs {
    float f[512];
};

// In place on x[t,h,:]: (a,b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
// angle = pos[t]·inv_freq_i; sign = −1 rotates backwards (the backward pass).
extern "C" __global__ void rope_k(void* x, int xbf, const u32* pos, int tokens, int heads, int head_dim,
                                  float sign, Freqs fr) {
    int t = blockIdx.x;
    if (t >= tokens) return;
    int half = head_dim / 2;
    float p = (float)pos[t];
    i64 base = (i64)t * heads * head_dim;
    for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float s, c;
        sincosf(p * fr.f[i], &s, &c);
        s *= sign;
        i64 ia = base + (i64)h * head_dim + i, ib = ia + half;
        float a = ld(x, xbf, ia), b = ld(x, xbf, ib);
        st(x, xbf, ia, a * c - b * s);
        st(x, xbf, ib, b * c + a * s);
    }
}
