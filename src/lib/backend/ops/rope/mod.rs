//! Rotary position embedding in HF's `rotate_half` layout (dimension i pairs with i + d/2), its
//! backward (the inverse rotation), and the step before cached or paged attention: rope on q
//! and k, then the store of k and v into cache rows (`rope_store_kv`, and `_packed` on the parts
//! of one fused q/k/v projection).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `rope.cu`, `check.rs` (the GPU cases `rope`,
//! `rope_store_kv` and `rope_store_kv_packed`; timed on the training micro-batch's q and on a
//! decode step's packed store).

pub mod check;
pub mod cpu;
pub mod cuda;

use anyhow::Result;

use crate::backend::MemoryOps;

/// Largest head_dim the rope kernels and the CPU's stack buffers take.
pub const MAX_HEAD_DIM: usize = 1024;

/// inv_freq_i = 1 / theta^(2i/d), in f32 exactly as HF builds it (both backends use these bits).
pub fn inv_freq(i: usize, head_dim: usize, theta: f32) -> f32 {
    1.0 / theta.powf((2 * i) as f32 / head_dim as f32)
}

/// Greatest common divisor (gcd(a, 0) = a).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// RoPE, and RoPE fused with the KV-cache store.
pub trait RopeOps: MemoryOps {
    /// In place on x[t,h,:]: (a,b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
    /// angle = pos[t] · theta^(−2i/d).
    fn rope(
        &self,
        x: &mut Self::Buf,
        pos: &Self::Idx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()>;
    /// In place on dx: the transpose of the rotation, i.e. rotation by −angle.
    fn rope_backward(
        &self,
        dx: &mut Self::Buf,
        pos: &Self::Idx,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()>;
    /// rope on q (`heads`) and k (`kv_heads`) in place, then `kv_store` of k and v: what a
    /// cached or paged step runs before attention, one launch where a backend fuses it.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        self.rope(q, pos, tokens, heads, head_dim, theta)?;
        self.rope(k, pos, tokens, kv_heads, head_dim, theta)?;
        self.kv_store(k_cache, v_cache, k, v, rows, tokens, kv_heads * head_dim)
    }
    /// `rope_store_kv` on the parts of one fused projection, row t of `qkv` being
    /// [q (heads·head_dim) | k (kv_heads·head_dim) | v (kv_heads·head_dim)]:
    /// q_out[t] = rope(q_t); cache[rows[t]] = (rope(k_t) rounded to qkv's type, v_t).
    #[allow(clippy::too_many_arguments)]
    fn rope_store_kv_packed(
        &self,
        qkv: &Self::Buf,
        q_out: &mut Self::Buf,
        pos: &Self::Idx,
        k_cache: &mut Self::Buf,
        v_cache: &mut Self::Buf,
        rows: &Self::Idx,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f32,
    ) -> Result<()> {
        let (qd, kd) = (heads * head_dim, kv_heads * head_dim);
        if tokens == 0 || kd == 0 {
            return Ok(());
        }
        // Each row of qkv as whole units of gcd(qd, kd) floats: every part is a run of units,
        // gathered out as rows of one unit.
        let unit = gcd(qd, kd);
        let per = (qd + 2 * kd) / unit;
        let dt = self.dtype(qkv);
        let mut k = self.alloc_as(tokens * kd, dt)?;
        let mut v = self.alloc_as(tokens * kd, dt)?;
        for (dst, first, count) in [
            (&mut *q_out, 0, qd / unit),
            (&mut k, qd / unit, kd / unit),
            (&mut v, (qd + kd) / unit, kd / unit),
        ] {
            let src = (0..tokens)
                .flat_map(|t| (0..count).map(move |j| t * per + first + j))
                .map(|r| u32::try_from(r).map_err(|_| anyhow::anyhow!("qkv row {r} overflows u32")))
                .collect::<Result<Vec<u32>>>()?;
            let mut idx = self.alloc_idx(src.len())?;
            self.upload_idx(&mut idx, &src)?;
            self.gather_rows(dst, qkv, &idx, src.len(), unit)?;
        }
        self.rope_store_kv(
            q_out, &mut k, &v, pos, k_cache, v_cache, rows, tokens, heads, kv_heads, head_dim,
            theta,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frequencies_by_hand() {
        // inv_freq_0 = 1, and the last of head_dim 4 is theta^(-1/2).
        assert_eq!(inv_freq(0, 4, 10000.0), 1.0);
        assert!((inv_freq(1, 4, 10000.0) - 0.01).abs() < 1e-9);
    }

    #[test]
    fn gcd_of_projection_widths() {
        assert_eq!(gcd(896, 128), 128);
        assert_eq!(gcd(48, 32), 16);
        assert_eq!(gcd(24, 24), 24);
        assert_eq!(gcd(0, 24), 24);
    }
}
