//! The runtime half of a backend: buffers, transfers, synchronisation, memory statistics,
//! graphs and the host copies of a step's draws. Math lives in the op families
//! (`backend::ops`), each a trait over `Device`; [`crate::backend::Backend`] is all of them.

use anyhow::Result;

/// Element type a buffer stores. Ops always compute in f32 and convert on load and store, so
/// any op accepts buffers of either type; a backend without bf16 storage keeps f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
}

/// Device memory a backend holds (all zero on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes taken from the device allocator (live buffers plus the pool's cache).
    pub held: usize,
    /// Bytes in live buffers.
    pub in_use: usize,
    /// Largest `in_use` seen since the backend was made.
    pub peak_in_use: usize,
}

/// A buffer and the buffers that are its parts (`Device::alloc_parts`).
pub type Parts<T> = (T, Vec<T>);

/// `Device::feed_tokens`: this row keeps the token uploaded for it.
pub const FEED_NONE: u32 = u32::MAX;

/// Memory, transfers, synchronisation and graphs of one device.
pub trait Device: Send + Sync {
    /// A float buffer on the device (`Vec<f32>` on the CPU).
    type Buf: Send + Sync;
    /// An index buffer on the device (token ids, positions, offsets, row indices).
    type Idx: Send + Sync;

    /// Short name for messages ("cpu", "cuda:0").
    fn name(&self) -> String;

    // ---- buffers ------------------------------------------------------------------------

    /// A zero-filled buffer of `n` floats.
    fn alloc(&self, n: usize) -> Result<Self::Buf>;
    /// A zero-filled buffer of `n` elements stored as `dtype` (bf16 rounds to nearest even on
    /// store). Backends that only store f32 ignore `dtype`.
    fn alloc_as(&self, n: usize, dtype: DType) -> Result<Self::Buf> {
        let _ = dtype;
        self.alloc(n)
    }
    /// Zero-filled buffers of `sizes[i]` elements of `dtype` that are parts of one allocation:
    /// `(whole, parts)`, part i a view of `whole` starting where part i − 1 ends, rounded up to
    /// the backend's alignment (so `len(whole) == Σ sizes` exactly when no padding was needed,
    /// and then `whole` is the parts concatenated). Ops on a part touch only that part; the
    /// memory lives while any of them does. None where buffers cannot share memory (the CPU).
    fn alloc_parts(&self, sizes: &[usize], dtype: DType) -> Result<Option<Parts<Self::Buf>>> {
        let _ = (sizes, dtype);
        Ok(None)
    }
    /// A zero-filled index buffer of `n` entries.
    fn alloc_idx(&self, n: usize) -> Result<Self::Idx>;
    /// Length of a buffer in floats.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Length of an index buffer.
    fn len_idx(&self, buf: &Self::Idx) -> usize;
    /// Element type of the decoder's compute weights, activations and KV caches (docs/ARCHITECTURE.md,
    /// "Precision"). Master weights, gradients, optimizer moments, norm/softmax statistics and
    /// log-prob math stay f32 whatever this says.
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    /// The element type `buf` stores.
    fn dtype(&self, buf: &Self::Buf) -> DType {
        let _ = buf;
        DType::F32
    }

    // ---- transfers and copies -----------------------------------------------------------

    /// dst[..src.len()] = src (host to device).
    fn upload(&self, dst: &mut Self::Buf, src: &[f32]) -> Result<()>;
    /// dst[..src.len()] = src (host to device).
    fn upload_idx(&self, dst: &mut Self::Idx, src: &[u32]) -> Result<()>;
    /// dst = src[..dst.len()] (device to host).
    fn download(&self, src: &Self::Buf, dst: &mut [f32]) -> Result<()>;
    /// dst = src[..dst.len()] (device to host).
    fn download_idx(&self, src: &Self::Idx, dst: &mut [u32]) -> Result<()>;
    /// buf[..n] = value.
    fn fill(&self, buf: &mut Self::Buf, n: usize, value: f32) -> Result<()>;
    /// dst[dst_off..dst_off+n] = src[src_off..src_off+n] (converting between element types).
    fn copy(
        &self,
        dst: &mut Self::Buf,
        dst_off: usize,
        src: &Self::Buf,
        src_off: usize,
        n: usize,
    ) -> Result<()>;
    /// buf[dst_off..dst_off+n] = buf[src_off..src_off+n] (ranges must not overlap).
    fn copy_within(
        &self,
        buf: &mut Self::Buf,
        dst_off: usize,
        src_off: usize,
        n: usize,
    ) -> Result<()>;

    // ---- synchronisation and memory -----------------------------------------------------

    /// Waits for all queued work and reports device-side faults of earlier ops (token ids or
    /// rows out of range). A no-op on the CPU, where ops fail at once.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Device memory held and in use.
    fn memory_stats(&self) -> MemoryStats {
        MemoryStats::default()
    }
    /// Makes `peak_in_use` start again from the current use, so that a phase of the hybrid
    /// engine reports its own peak.
    fn reset_peak_memory(&self) {}
    /// Returns cached free device memory to the driver (between phases of the hybrid engine).
    fn trim(&self) -> Result<()> {
        Ok(())
    }
    /// (free, total) bytes of device memory as the driver reports them (cuMemGetInfo); None
    /// where there is no device memory to size a KV pool from (the CPU).
    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        Ok(None)
    }

    // ---- modes --------------------------------------------------------------------------

    /// Whether kernels run in batch-invariant mode (a row's result does not depend on the
    /// other rows of the call; the CUDA backend's TANDEM_BATCH_INVARIANT). The CPU backend is
    /// batch-invariant by construction (always true, no mode).
    fn batch_invariant(&self) -> bool {
        false
    }
    /// GEMM plans made so far and the seconds their algorithm searches took (None where
    /// GEMMs need no plan).
    fn gemm_planning(&self) -> Option<(u64, f64)> {
        None
    }

    /// Starts compiling, in the background, the kernels a decoder of head dim `head_dim` runs
    /// (with `training`, the backward's too), so that their first use does not wait for each
    /// in turn (the CUDA backend; nothing to do elsewhere).
    fn prepare_kernels(&self, _head_dim: usize, _training: bool) {}

    // ---- graphs -------------------------------------------------------------------------

    /// Whether steps can be captured and replayed as graphs (CUDA graphs; not the CPU).
    fn graphs_supported(&self) -> bool {
        false
    }
    /// Starts recording the ops issued from here on into a graph instead of running them.
    /// Between `graph_begin` and `graph_end` no op may read data back or synchronize, and the
    /// temporaries the ops take stay reserved for the graphs until `graph_release`.
    fn graph_begin(&self) -> Result<()> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Ends the recording; returns the id of the graph (for `graph_launch`).
    fn graph_end(&self) -> Result<usize> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Replays graph `id` with whatever its buffers hold now.
    fn graph_launch(&self, _id: usize) -> Result<()> {
        anyhow::bail!("{} cannot capture graphs", self.name())
    }
    /// Destroys every graph and gives their private memory back to the pool; returns its bytes.
    fn graph_release(&self) -> Result<usize> {
        Ok(0)
    }

    // ---- queued decode steps (engine::paged) ----------------------------------------------

    /// ids[i] = prev[src[i]] for i < n where src[i] != FEED_NONE: the tokens of a decode step
    /// queued behind another, which drew them into `prev` and may still be running.
    fn feed_tokens(
        &self,
        ids: &mut Self::Idx,
        prev: &Self::Idx,
        src: &Self::Idx,
        n: usize,
    ) -> Result<()>;
    /// Starts bringing the first `rows` tokens and log-probs of a step to the host, behind the
    /// work queued so far, through `slot` (0 or 1: two steps' draws may be on their way).
    /// Returns them at once where nothing runs behind the host's back (the default), else
    /// `draws_wait(slot, rows)` does.
    #[allow(clippy::type_complexity)]
    fn draws_start(
        &self,
        _slot: usize,
        tokens: &Self::Idx,
        logprobs: &Self::Buf,
        rows: usize,
    ) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        let (mut t, mut l) = (vec![0u32; rows], vec![0f32; rows]);
        self.download_idx(tokens, &mut t)?;
        self.download(logprobs, &mut l)?;
        Ok(Some((t, l)))
    }
    /// The draws `draws_start(slot, ..)` set on their way, once they are on the host.
    fn draws_wait(&self, slot: usize, _rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        anyhow::bail!("{}: no draws on their way through slot {slot}", self.name())
    }
}
