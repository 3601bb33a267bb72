//! Memory ops: whole elements added or moved between rows, no other math. `add_assign` is the
//! residual add; `gather_rows` / `scatter_add_rows` pick rows of a buffer (the scored rows of a
//! batch, the parts of a fused projection) and add gradients back; `kv_store` writes a step's
//! keys and values into cache rows. Fills and copies are the device's (`Device::fill`,
//! `Device::copy`).
//!
//! Files: `cpu.rs` (the reference), `cuda.rs` (launchers), `memory.cu`, `check.rs` (the
//! `memory`, `gather_rows` and `kv_store` GPU cases, which also cover the device's transfers
//! and copies, and `alloc_parts`, the device's views into one buffer).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::Result;

use crate::backend::Device;

/// The key and value buffers of a KV cache (rows of kv_heads·head_dim): `&mut` where an op
/// stores into them, `&` where it only reads.
#[derive(Clone, Copy, Debug)]
pub struct KvCache<T> {
    pub k: T,
    pub v: T,
}

impl<T> KvCache<&mut T> {
    /// The same buffers, read-only.
    pub fn read(&self) -> KvCache<&T> {
        KvCache {
            k: &*self.k,
            v: &*self.v,
        }
    }

    /// The same buffers, borrowed mutably for one call (the pair stays usable after it).
    pub(crate) fn reborrow(&mut self) -> KvCache<&mut T> {
        KvCache {
            k: &mut *self.k,
            v: &mut *self.v,
        }
    }
}

/// Elementwise add and row movement.
pub trait MemoryOps: Device {
    /// y[..n] += x[..n].
    fn add_assign(&self, y: &mut Self::Buf, x: &Self::Buf, n: usize) -> Result<()>;
    /// out[i,:] = x[rows[i],:].
    fn gather_rows(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        dim: usize,
    ) -> Result<()>;
    /// dx[rows[i],:] += dout[i,:] (rows distinct).
    fn scatter_add_rows(
        &self,
        dx: &mut Self::Buf,
        dout: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        dim: usize,
    ) -> Result<()>;
    /// KV-cache write: cache[rows[i], :] = x[i, :] for k and v (rows of kv_heads·head_dim).
    fn kv_store(
        &self,
        cache: KvCache<&mut Self::Buf>,
        k: &Self::Buf,
        v: &Self::Buf,
        rows: &Self::Idx,
        n: usize,
        row_dim: usize,
    ) -> Result<()>;
}
