//! A caching device memory pool. Freed blocks go to a free list keyed by their rounded size and
//! are handed out again without a driver call, so steady-state steps never hit `cuMemAlloc`
//! (which synchronises the device). `trim` gives the cached blocks back to the driver, e.g.
//! after rollout when training needs the memory. All work runs on one stream, so a block that
//! is freed on the host and reused by the next op is safe: the stream orders the two.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use cudarc::driver::{result as dr, sys as dsys, CudaContext};

use crate::backend::MemoryStats;

/// Rounds a request up to its size class: 512 B steps below 1 MiB, 1 MiB steps above.
fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 1 << 20;
    if bytes < LARGE {
        bytes.div_ceil(SMALL) * SMALL
    } else {
        bytes.div_ceil(LARGE) * LARGE
    }
}

#[derive(Default)]
struct Inner {
    free: HashMap<usize, Vec<dsys::CUdeviceptr>>,
    held: usize,
    in_use: usize,
    peak_in_use: usize,
    /// A CUDA graph is being captured: blocks handed out now belong to the graphs.
    capturing: bool,
    /// Generation of the graphs' private memory (bumped when the graphs are released); blocks
    /// of the current generation never go back to `free` while the graphs live, since a
    /// replay writes into them.
    graph_gen: u64,
    /// Graph blocks the capture freed again: only a later capture may take them.
    graph_free: HashMap<usize, Vec<dsys::CUdeviceptr>>,
    /// Bytes of blocks handed out during captures since the graphs were last released.
    graph_bytes: usize,
}

pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    inner: Mutex<Inner>,
}

/// One device allocation; returns to the pool when dropped.
pub struct Block {
    ptr: dsys::CUdeviceptr,
    bytes: usize,
    /// Graph generation the block belongs to (0: ordinary memory).
    graph_gen: u64,
    pool: Arc<Pool>,
}

impl Block {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.pool.release(self.ptr, self.bytes, self.graph_gen);
        }
    }
}

impl Pool {
    pub fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Pool {
            ctx,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// A block of at least `bytes` bytes (uninitialised; 256-byte aligned by the driver).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Block> {
        if bytes == 0 {
            return Ok(Block {
                ptr: 0,
                bytes: 0,
                graph_gen: 0,
                pool: self.clone(),
            });
        }
        let class = size_class(bytes);
        let graph_gen = {
            let mut g = self.lock();
            if g.capturing {
                // The graphs' own freed blocks first (still counted in use).
                if let Some(p) = g.graph_free.get_mut(&class).and_then(|v| v.pop()) {
                    return Ok(Block {
                        ptr: p,
                        bytes: class,
                        graph_gen: g.graph_gen,
                        pool: self.clone(),
                    });
                }
                g.graph_bytes += class;
                g.graph_gen
            } else {
                0
            }
        };
        let cached = {
            let mut g = self.lock();
            let p = g.free.get_mut(&class).and_then(|v| v.pop());
            if p.is_some() {
                g.in_use += class;
                g.peak_in_use = g.peak_in_use.max(g.in_use);
            }
            p
        };
        let ptr = match cached {
            Some(p) => p,
            None => {
                let p = match self.driver_alloc(class) {
                    Ok(p) => p,
                    // Out of memory with blocks cached: give them back and try once more.
                    Err(_) if self.cached_bytes() > 0 => {
                        self.trim()?;
                        self.driver_alloc(class)?
                    }
                    Err(e) => return Err(e),
                };
                let mut g = self.lock();
                g.held += class;
                g.in_use += class;
                g.peak_in_use = g.peak_in_use.max(g.in_use);
                p
            }
        };
        Ok(Block {
            ptr,
            bytes: class,
            graph_gen,
            pool: self.clone(),
        })
    }

    /// Starts or ends a capture: blocks handed out in between are kept for the graphs.
    pub(crate) fn set_capturing(&self, on: bool) {
        let mut g = self.lock();
        if on && g.graph_gen == 0 {
            g.graph_gen = 1;
        }
        g.capturing = on;
    }

    /// Whether a graph capture is under way (nothing may synchronize the stream then).
    pub(crate) fn capturing(&self) -> bool {
        self.lock().capturing
    }

    /// The graphs were destroyed: their private blocks return to the cache (and to the driver
    /// on the next `trim`). Returns the bytes the graphs held.
    pub(crate) fn release_graph_memory(&self) -> usize {
        let mut g = self.lock();
        let bytes = g.graph_bytes;
        let blocks: Vec<(usize, Vec<dsys::CUdeviceptr>)> = g.graph_free.drain().collect();
        for (class, ptrs) in blocks {
            g.in_use -= class * ptrs.len();
            g.free.entry(class).or_default().extend(ptrs);
        }
        g.graph_gen += 1;
        g.graph_bytes = 0;
        bytes
    }

    fn driver_alloc(&self, bytes: usize) -> Result<dsys::CUdeviceptr> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the context is bound to this thread (above); the new allocation is owned by the
        // returned pointer, which only a `Block` or `trim` frees.
        unsafe { dr::malloc_sync(bytes) }.map_err(|e| {
            let (free, total) = dr::mem_get_info().unwrap_or((0, 0));
            anyhow!(
                "cuda: cannot allocate {} MiB ({e:?}; {} MiB free of {} MiB, {} MiB held by tandem)",
                bytes >> 20,
                free >> 20,
                total >> 20,
                self.stats().held >> 20
            )
        })
    }

    fn release(&self, ptr: dsys::CUdeviceptr, bytes: usize, graph_gen: u64) {
        let mut g = self.lock();
        if graph_gen != 0 && graph_gen == g.graph_gen {
            g.graph_free.entry(bytes).or_default().push(ptr);
            return;
        }
        g.in_use -= bytes;
        g.free.entry(bytes).or_default().push(ptr);
    }

    fn cached_bytes(&self) -> usize {
        let g = self.lock();
        g.held - g.in_use
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent counters (no partial updates).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Frees every cached block. The caller has synchronised the stream (cuMemFree also waits).
    pub fn trim(&self) -> Result<()> {
        let blocks: Vec<(usize, Vec<dsys::CUdeviceptr>)> = self.lock().free.drain().collect();
        self.ctx.bind_to_thread()?;
        let mut freed = 0;
        let mut first_err = None;
        for (bytes, ptrs) in blocks {
            for p in ptrs {
                // SAFETY: `p` came from `malloc_sync` and sat in the free list, so no `Block`
                // refers to it; the caller has synchronised the stream, so no queued work reads it
                // (cuMemFree waits too).
                match unsafe { dr::free_sync(p) } {
                    Ok(()) => freed += bytes,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        self.lock().held -= freed;
        match first_err {
            None => Ok(()),
            Some(e) => Err(anyhow!(
                "cuda: cuMemFree failed while trimming the pool: {e:?}"
            )),
        }
    }

    /// Starts a new peak window at the current use (one phase of the hybrid engine).
    pub(crate) fn reset_peak(&self) {
        let mut g = self.lock();
        g.peak_in_use = g.in_use;
    }

    pub fn stats(&self) -> MemoryStats {
        let g = self.lock();
        MemoryStats {
            held: g.held,
            in_use: g.in_use,
            peak_in_use: g.peak_in_use,
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Every Block holds an Arc to the pool, so only cached blocks are left here.
        let _ = self.trim();
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) - 1), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class(3 << 20), 3 << 20);
    }
}
