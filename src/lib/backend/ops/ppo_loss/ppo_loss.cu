// The fused PPO-clip loss (ops/ppo_loss): dL/dlp per token and the loss metric sums.
//
// Layout: lp, old, adv, ent, dlp are [n]; w is [3, n] = [w_pg | w_tok | w_agg]; stats is the
// 6-float f32 accumulator (PPO_STATS).
// Launch: one block of 1024 threads, each striding over the tokens.
// Determinism: one block, f64 math and sums (per-thread strides, then a block tree): the stats
// do not depend on timing.

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
