// Optimizer ops: squared L2 norm (for global grad-norm clipping) and AdamW (fp32 master
// weights and moments in practice; any buffer type is accepted).

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

// max with torch's subgradient (derivative split at a tie): (value, d/dlp).
DEVI void ppo_max(double av, double ad, double bv, double bd, double* v, double* d) {
    if (av > bv) { *v = av; *d = ad; }
    else if (av < bv) { *v = bv; *d = bd; }
    else { *v = av; *d = 0.5 * (ad + bd); }
}

// PPO-clip per token (verl's vanilla loss, dual clip), f64 math as the CPU oracle:
// r = exp(clamp(lp − old, ±20)); ℓ = max(−A·r, −A·clip(r, lo, hi)), for A < 0 min(ℓ, −A·c);
// dlp = w_pg·∂ℓ/∂lp; stats += [Σ w_pg·ℓ, Σ w_tok·clipped, Σ w_tok·clipped_lower,
// Σ w_tok·(old − lp), Σ w_agg·ent, #non-finite]. w = [w_pg | w_tok | w_agg]; w_tok = 0 is
// masked. One block, so the sums do not depend on timing; old = 0 pointer means on-policy.
extern "C" __global__ void ppo_clip_k(void* dlp, int dlpbf, float* stats, const void* lp, int lpbf,
                                      const void* old, int oldbf, const void* adv, int advbf,
                                      const void* w, int wbf, const void* ent, int entbf, int n,
                                      double lo, double hi, double c) {
    __shared__ double sh[32];
    double acc[6] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        double w_pg = ld(w, wbf, t), w_tok = ld(w, wbf, (i64)n + t), w_agg = ld(w, wbf, 2 * (i64)n + t);
        if (w_tok == 0.0) {
            st(dlp, dlpbf, t, 0.0f);
            continue;
        }
        double l = ld(lp, lpbf, t);
        double o = old ? (double)ld(old, oldbf, t) : l;
        double a = ld(adv, advbf, t);
        double d = l - o, dc, ddc;
        if (d < -20.0) { dc = -20.0; ddc = 0.0; }
        else if (d > 20.0) { dc = 20.0; ddc = 0.0; }
        else { dc = d; ddc = 1.0; }
        double r = exp(dc), dr = r * ddc, rc, drc;
        if (r < lo) { rc = lo; drc = 0.0; }
        else if (r > hi) { rc = hi; drc = 0.0; }
        else { rc = r; drc = dr; }
        double p1 = -a * r, p2 = -a * rc, c1v, c1d;
        ppo_max(p1, -a * dr, p2, -a * drc, &c1v, &c1d);
        double p3 = -a * c, lv = c1v, ldv = c1d;
        if (a < 0.0) {
            double mv, md;
            ppo_max(-p3, 0.0, -c1v, -c1d, &mv, &md);
            lv = -mv;
            ldv = -md;
        }
        st(dlp, dlpbf, t, (float)(w_pg * ldv));
        double e = ent ? (double)ld(ent, entbf, t) : 0.0;
        acc[0] += w_pg * lv;
        acc[1] += p2 > p1 ? w_tok : 0.0;
        acc[2] += (a < 0.0 && c1v > p3) ? w_tok : 0.0;
        acc[3] -= w_tok * dc;
        acc[4] += w_agg * e;
        // x − x is 0 only for finite x (NaN and ±inf give NaN).
        acc[5] += (lv - lv == 0.0 && e - e == 0.0) ? 0.0 : 1.0;
    }
    for (int k = 0; k < 6; k++) {
        double s = block_sum_d(acc[k], sh);
        if (threadIdx.x == 0) stats[k] = (float)((double)stats[k] + s);
    }
}
