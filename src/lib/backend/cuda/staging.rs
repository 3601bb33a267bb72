//! Large device-to-host copies through a pinned host buffer. A copy into pageable memory
//! (a fresh `Vec`) goes through the driver's own small staging and page faults, about 1 GB/s
//! here; exporting the 0.5B model's f32 masters and Adam moments (~7.5 GB) after an update
//! took seconds. Pinned chunks of 64 MiB copy at PCIe speed; a host memcpy then moves each
//! chunk into place.

use anyhow::{anyhow, Result};
use cudarc::driver::result as dr;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::Arc;

/// Bytes of the pinned buffer (allocated on the first large download, kept for the backend's
/// life).
pub const CHUNK_BYTES: usize = 64 << 20;

/// Downloads at least this large go through the staging buffer; smaller ones (sampled tokens,
/// log-probs of one decode step) copy directly.
pub const MIN_STAGED_BYTES: usize = 4 << 20;

pub struct Staging {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
}

// SAFETY: the buffer is only touched under the backend's mutex around `Staging`.
unsafe impl Send for Staging {}

impl Staging {
    pub fn new(ctx: Arc<CudaContext>) -> Result<Staging> {
        ctx.bind_to_thread()
            .map_err(|e| anyhow!("cuda: bind context: {e:?}"))?;
        // SAFETY: a plain pinned allocation; freed in Drop.
        let ptr = unsafe { dr::malloc_host(CHUNK_BYTES, 0) }
            .map_err(|e| anyhow!("cuda: pinned host buffer of {CHUNK_BYTES} bytes: {e:?}"))?;
        Ok(Staging {
            ctx,
            ptr: ptr as *mut u8,
        })
    }

    /// Copies `count` elements of `T` from device address `src` into `out`, chunk by chunk:
    /// `take(chunk, offset)` receives each chunk as it lands (in order) with its first element's
    /// index.
    pub fn download<T: Copy>(
        &mut self,
        stream: &CudaStream,
        src: u64,
        count: usize,
        take: &mut dyn FnMut(&[T], usize),
    ) -> Result<()> {
        let per = CHUNK_BYTES / std::mem::size_of::<T>();
        let mut done = 0;
        while done < count {
            let n = per.min(count - done);
            // SAFETY: the pinned buffer holds CHUNK_BYTES, n·size_of::<T>() ≤ CHUNK_BYTES, it is
            // aligned for any T (page aligned) and only this call uses it until the sync below.
            let chunk = unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) };
            let at = src + (done * std::mem::size_of::<T>()) as u64;
            unsafe { dr::memcpy_dtoh_async(chunk, at, stream.cu_stream()) }
                .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
            stream
                .synchronize()
                .map_err(|e| anyhow!("cuda: download: {e:?}"))?;
            take(chunk, done);
            done += n;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in `new`, freed once.
            let _ = unsafe { dr::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}
