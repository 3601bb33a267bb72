//! A step's draws on their way to the host (`Device::draws_start` / `draws_wait`): the tokens,
//! log-probs and the error word are copied into page-locked host memory behind the step's
//! kernels and an event marks their arrival, so the host can queue the next step (overlap
//! scheduling) instead of waiting for this one. Two slots: a step's draws travel while the next
//! step runs.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as dr, sys as dsys, CudaEvent, PinnedHostSlice};

use super::{describe_errors, CudaBackend, CudaBuf, CudaIdx};

/// One slot: page-locked room for `cap` draws, the error word, and the arrival event.
pub(crate) struct Slot {
    tokens: PinnedHostSlice<u32>,
    logprobs: PinnedHostSlice<f32>,
    err: PinnedHostSlice<u32>,
    event: CudaEvent,
    cap: usize,
    /// Rows on their way (None: free).
    rows: Option<usize>,
}

// SAFETY: the slots live behind `CudaBackend::draw_slots`' mutex; the host reads a slot's memory
// only after its event says the copies into it are done.
unsafe impl Send for Slot {}

/// `n` elements of page-locked memory as a mutable slice (the copies write through it).
fn host<T>(p: &mut PinnedHostSlice<T>, n: usize) -> Result<&mut [T]>
where
    T: cudarc::driver::ValidAsZeroBits,
{
    let ptr = p
        .as_mut_ptr()
        .map_err(|e| anyhow!("cuda: pinned memory: {e:?}"))?;
    // SAFETY: `n` is at most the allocation's length (checked by the callers).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, n) })
}

impl CudaBackend {
    fn new_slot(&self, cap: usize) -> Result<Slot> {
        let cap = cap.max(256);
        // Plain page-locked memory (not write-combined): the host reads it.
        // SAFETY: flags 0 asks for plain page-locked memory (a valid flag set); the contents start
        // uninitialised, and are read only after copies into them (`wait_draws`).
        let (tokens, logprobs, err) = unsafe {
            (
                self.ctx.alloc_pinned_with_flags::<u32>(cap, 0),
                self.ctx.alloc_pinned_with_flags::<f32>(cap, 0),
                self.ctx.alloc_pinned_with_flags::<u32>(1, 0),
            )
        };
        let e = |e| anyhow!("cuda: page-locked memory for draws: {e:?}");
        Ok(Slot {
            tokens: tokens.map_err(e)?,
            logprobs: logprobs.map_err(e)?,
            err: err.map_err(e)?,
            event: self
                .ctx
                .new_event(Some(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| anyhow!("cuda: event: {e:?}"))?,
            cap,
            rows: None,
        })
    }

    pub(super) fn start_draws(
        &self,
        slot: usize,
        tokens: &CudaIdx,
        logprobs: &CudaBuf,
        rows: usize,
    ) -> Result<()> {
        if rows > tokens.len || rows > logprobs.len {
            bail!(
                "cuda: {rows} draws, the buffers hold {} tokens and {} log-probs",
                tokens.len,
                logprobs.len
            );
        }
        if logprobs.dtype != super::DType::F32 {
            bail!("cuda: draws: log-probs must be f32");
        }
        self.bind()?;
        let mut slots = self.draw_slots.lock().unwrap_or_else(|p| p.into_inner());
        let s = slots
            .get_mut(slot)
            .ok_or_else(|| anyhow!("cuda: no draw slot {slot}"))?;
        if let Some(old) = s.as_mut().filter(|s| s.rows.is_some()) {
            // Draws nobody collected (a generation that stopped on an error): let their copies
            // finish before the slot is written again.
            old.event
                .synchronize()
                .map_err(|e| anyhow!("cuda: a kernel failed: {e:?}"))?;
            old.rows = None;
        }
        if s.as_ref().is_none_or(|s| s.cap < rows) {
            *s = Some(self.new_slot(rows)?);
        }
        let s = s.as_mut().expect("made above");
        let stream = self.stream.cu_stream();
        let e = |e| anyhow!("cuda: draws to the host: {e:?}");
        // SAFETY: the slot holds at least `rows` (made or checked above) and the buffers as many
        // (checked above); these copies into page-locked memory run later on the stream, and the
        // host reads the slot only after its event (`wait_draws`), and writes it again only after
        // that event too (above). Device blocks freed meanwhile are reused only by later stream
        // work.
        unsafe {
            if rows > 0 {
                dr::memcpy_dtoh_async(host(&mut s.tokens, rows)?, tokens.ptr, stream).map_err(e)?;
                dr::memcpy_dtoh_async(host(&mut s.logprobs, rows)?, logprobs.ptr, stream)
                    .map_err(e)?;
            }
            dr::memcpy_dtoh_async(host(&mut s.err, 1)?, self.err_word.ptr(), stream).map_err(e)?;
        }
        s.event
            .record(&self.stream)
            .map_err(|e| anyhow!("cuda: record draws event: {e:?}"))?;
        s.rows = Some(rows);
        Ok(())
    }

    pub(super) fn wait_draws(&self, slot: usize, rows: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        let mut slots = self.draw_slots.lock().unwrap_or_else(|p| p.into_inner());
        let s = slots
            .get_mut(slot)
            .and_then(|s| s.as_mut())
            .ok_or_else(|| anyhow!("cuda: no draws on their way through slot {slot}"))?;
        match s.rows.take() {
            Some(r) if r == rows => {}
            other => bail!("cuda: slot {slot} carries {other:?} draws, {rows} asked"),
        }
        s.event
            .synchronize()
            .map_err(|e| anyhow!("cuda: a kernel failed: {e:?}"))?;
        let bits = host(&mut s.err, 1)?[0];
        if bits != 0 {
            drop(slots);
            // The word keeps the bits: clear it (behind whatever is queued) and report.
            self.memset(self.err_word.ptr(), 0, 4)?;
            bail!(describe_errors(bits));
        }
        Ok((
            host(&mut s.tokens, rows)?.to_vec(),
            host(&mut s.logprobs, rows)?.to_vec(),
        ))
    }
}
