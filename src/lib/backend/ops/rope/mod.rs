//! Rotary position embedding in HF's `rotate_half` layout (dimension i pairs with i + d/2), its
//! backward (the inverse rotation), and the step before paged attention: rope on q and k,
//! then the store of k and v into cache rows (`rope_store_kv`, and `_packed` on the parts
//! of one fused q/k/v projection).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs`, `rope.cu`, `check.rs` (the GPU cases `rope`,
//! `rope_store_kv` and `rope_store_kv_packed`; timed on the training micro-batch's q and on a
//! decode step's packed store).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::{KvCache, MemoryOps};

/// Largest head_dim the rope kernels and the CPU's stack buffers take.
pub(crate) const MAX_HEAD_DIM: usize = 1024;

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

/// Sizes of a rotation: `tokens` rows of `heads` heads of `head_dim`, base `theta`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeShape {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub theta: f32,
}

/// Sizes of a step's rope + cache store: `tokens` new tokens of `heads` query heads and
/// `kv_heads` key/value heads of `head_dim`, rotated with base `theta`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeKvShape {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub theta: f32,
}

impl RopeKvShape {
    /// The rotation of the queries.
    pub fn q(&self) -> RopeShape {
        RopeShape {
            tokens: self.tokens,
            heads: self.heads,
            head_dim: self.head_dim,
            theta: self.theta,
        }
    }

    /// The rotation of the keys.
    pub fn k(&self) -> RopeShape {
        RopeShape {
            heads: self.kv_heads,
            ..self.q()
        }
    }
}

/// Where a step's new tokens go: the position each is rotated by, and the cache row its key
/// and value are stored at.
#[derive(Clone, Copy, Debug)]
pub struct Slots<I> {
    pub pos: I,
    pub rows: I,
}

/// A fused q/k/v projection, row t = [q (heads·head_dim) | k (kv_heads·head_dim) |
/// v (kv_heads·head_dim)], and the buffer its rotated queries go to.
#[derive(Debug)]
pub struct PackedQkv<'a, T> {
    pub qkv: &'a T,
    pub q: &'a mut T,
}

/// RoPE, and RoPE fused with the KV-cache store.
pub trait RopeOps: MemoryOps {
    /// In place on x[t,h,:]: (a,b) = (x_i, x_{i+d/2}) → (a·cos − b·sin, b·cos + a·sin),
    /// angle = pos[t] · theta^(−2i/d).
    fn rope(&self, x: &mut Self::Buf, pos: &Self::Idx, shape: RopeShape) -> Result<()>;
    /// In place on dx: the transpose of the rotation, i.e. rotation by −angle.
    fn rope_backward(&self, dx: &mut Self::Buf, pos: &Self::Idx, shape: RopeShape) -> Result<()>;
    /// rope on q (`heads`) and k (`kv_heads`) in place at `slots.pos`, then `kv_store` of k and
    /// v at `slots.rows`: what a paged step runs before attention, one launch where a backend
    /// fuses it.
    fn rope_store_kv(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        slots: Slots<&Self::Idx>,
        cache: KvCache<&mut Self::Buf>,
        shape: RopeKvShape,
    ) -> Result<()> {
        self.rope(q, slots.pos, shape.q())?;
        self.rope(k, slots.pos, shape.k())?;
        let kd = shape.kv_heads * shape.head_dim;
        self.kv_store(cache, k, v, slots.rows, shape.tokens, kd)
    }
    /// `rope_store_kv` on the parts of one fused projection `x.qkv`:
    /// x.q[t] = rope(q_t); cache[rows[t]] = (rope(k_t) rounded to qkv's type, v_t).
    fn rope_store_kv_packed(
        &self,
        x: PackedQkv<Self::Buf>,
        slots: Slots<&Self::Idx>,
        cache: KvCache<&mut Self::Buf>,
        shape: RopeKvShape,
    ) -> Result<()> {
        let RopeKvShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            ..
        } = shape;
        let (qkv, q_out) = (x.qkv, x.q);
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
        self.rope_store_kv(q_out, &mut k, &v, slots, cache, shape)
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
