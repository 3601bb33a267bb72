//! The f32 CPU device: the reference every other backend is checked against, and the path CI
//! runs. Buffers are `Vec<f32>` / `Vec<u32>`; this file is the runtime (allocation, copies,
//! size checks) and the helpers the ops' CPU references share. The ops themselves are plain
//! functions over slices in `backend::ops::<family>::cpu` (forward and backward side by side),
//! multithreaded with rayon; GEMMs go through the `gemm` crate.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{Device, FEED_NONE};

/// The CPU backend. It holds no state: threads come from rayon's global pool
/// (`RAYON_NUM_THREADS` sets their number).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// Elements per rayon task in elementwise loops: large enough that scheduling is noise.
pub(crate) const ELEMWISE_GRAIN: usize = 1 << 14;

/// A raw pointer that rayon tasks share when each task writes a region no other task touches.
/// Used where the disjoint regions are not contiguous chunks (attention heads, column blocks).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointer is only dereferenced through `slice`, whose callers guarantee that
// concurrent tasks access disjoint ranges while the owning `&mut [f32]` is borrowed.
unsafe impl Send for SharedMut {}
// SAFETY: as for Send: a shared `SharedMut` reaches the memory only through `slice`, under the
// same rule of disjoint ranges.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(s: &mut [f32]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// # Safety
    /// No other live reference (from any thread) may overlap `off..off + len`.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, off: usize, len: usize) -> &mut [f32] {
        assert!(off + len <= self.len, "SharedMut out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(off), len)
    }
}

/// The first `n` elements of `buf`, or an error naming it when it is shorter.
pub(crate) fn get<'a, T>(buf: &'a [T], n: usize, what: &str) -> Result<&'a [T]> {
    if buf.len() < n {
        bail!(
            "cpu backend: {what} holds {} elements, the op needs {n}",
            buf.len()
        );
    }
    Ok(&buf[..n])
}

/// The first `n` elements of `buf` to write, or an error naming it when it is shorter.
pub(crate) fn get_mut<'a, T>(buf: &'a mut [T], n: usize, what: &str) -> Result<&'a mut [T]> {
    if buf.len() < n {
        bail!(
            "cpu backend: {what} holds {} elements, the op needs {n}",
            buf.len()
        );
    }
    Ok(&mut buf[..n])
}

impl Device for Cpu {
    type Buf = Vec<f32>;
    type Idx = Vec<u32>;

    fn name(&self) -> String {
        "cpu".into()
    }

    /// Always: every row is computed on its own, in the same order whatever shares the call.
    fn batch_invariant(&self) -> bool {
        true
    }

    fn alloc(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn alloc_idx(&self, n: usize) -> Result<Vec<u32>> {
        Ok(vec![0; n])
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn len_idx(&self, buf: &Vec<u32>) -> usize {
        buf.len()
    }

    fn upload(&self, dst: &mut Vec<f32>, src: &[f32]) -> Result<()> {
        get_mut(dst, src.len(), "upload destination")?.copy_from_slice(src);
        Ok(())
    }

    fn upload_idx(&self, dst: &mut Vec<u32>, src: &[u32]) -> Result<()> {
        get_mut(dst, src.len(), "upload destination")?.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(get(src, dst.len(), "download source")?);
        Ok(())
    }

    fn download_idx(&self, src: &Vec<u32>, dst: &mut [u32]) -> Result<()> {
        dst.copy_from_slice(get(src, dst.len(), "download source")?);
        Ok(())
    }

    fn fill(&self, buf: &mut Vec<f32>, n: usize, value: f32) -> Result<()> {
        get_mut(buf, n, "fill")?
            .par_chunks_mut(ELEMWISE_GRAIN)
            .for_each(|c| c.fill(value));
        Ok(())
    }

    fn copy(
        &self,
        dst: &mut Vec<f32>,
        dst_off: usize,
        src: &Vec<f32>,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        let s = &get(src, src_off + n, "copy source")?[src_off..];
        let d = &mut get_mut(dst, dst_off + n, "copy destination")?[dst_off..];
        d.par_chunks_mut(ELEMWISE_GRAIN)
            .zip(s.par_chunks(ELEMWISE_GRAIN))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    }

    fn copy_within(
        &self,
        buf: &mut Vec<f32>,
        dst_off: usize,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        if dst_off.max(src_off) + n > buf.len() || (dst_off < src_off + n && src_off < dst_off + n)
        {
            bail!(
                "cpu backend: copy_within {src_off}..+{n} to {dst_off} in a buffer of {} floats",
                buf.len()
            );
        }
        buf.copy_within(src_off..src_off + n, dst_off);
        Ok(())
    }

    fn feed_tokens(
        &self,
        ids: &mut Vec<u32>,
        prev: &Vec<u32>,
        src: &Vec<u32>,
        n: usize,
    ) -> Result<()> {
        let ids = get_mut(ids, n, "feed_tokens ids")?;
        for (i, (id, &s)) in ids
            .iter_mut()
            .zip(get(src, n, "feed_tokens src")?)
            .enumerate()
        {
            if s != FEED_NONE {
                *id = *prev.get(s as usize).ok_or_else(|| {
                    anyhow::anyhow!("feed_tokens: row {i} feeds draw {s} of {}", prev.len())
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DType;

    #[test]
    fn the_cpu_has_no_shared_parts() {
        assert!(Cpu.alloc_parts(&[4, 8], DType::F32).unwrap().is_none());
    }

    #[test]
    fn copies_check_their_ranges() {
        let src = vec![1.0, 2.0, 3.0, 4.0];
        let mut dst = vec![0.0; 5];
        Cpu.copy(&mut dst, 2, &src, 1, 3).unwrap();
        assert_eq!(dst, [0.0, 0.0, 2.0, 3.0, 4.0]);
        let err = Cpu.copy(&mut dst, 3, &src, 0, 3).unwrap_err();
        assert!(
            err.to_string().contains("copy destination holds 5"),
            "{err}"
        );
        let mut buf = vec![1.0, 2.0, 3.0, 4.0, 5.0];
        Cpu.copy_within(&mut buf, 3, 0, 2).unwrap();
        assert_eq!(buf, [1.0, 2.0, 3.0, 1.0, 2.0]);
        assert!(Cpu.copy_within(&mut buf, 1, 0, 2).is_err(), "overlap");
        Cpu.fill(&mut buf, 2, -1.0).unwrap();
        assert_eq!(buf, [-1.0, -1.0, 3.0, 1.0, 2.0]);
    }

    #[test]
    fn fed_rows_take_the_draws_of_the_step_before() {
        let prev = vec![40u32, 41, 42];
        let mut ids = vec![7u32, 0, 9, 0, 5];
        let src = vec![FEED_NONE, 2, FEED_NONE, 0, FEED_NONE];
        Cpu.feed_tokens(&mut ids, &prev, &src, 4).unwrap();
        // Rows past n keep their tokens whatever their source says.
        assert_eq!(ids, [7, 42, 9, 40, 5]);
        let err = Cpu
            .feed_tokens(&mut ids, &prev, &vec![3, FEED_NONE], 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("row 0 feeds draw 3 of 3"), "{err}");
    }
}
