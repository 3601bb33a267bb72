//! The sampling launchers (kernels in `sample.cu`): greedy and plain sampling as one pass over
//! chunks of the vocabulary, then a pick per row; top-k / top-p in one block per row.

use anyhow::{bail, Result};

use super::{Draws, SampleOps};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, Args, CudaBackend, CudaBuf};
use crate::backend::DType;

pub(crate) const KERNELS: Family = Family {
    name: "sample",
    src: include_str!("sample.cu"),
    per_head_dim: false,
    training_only: false,
};

/// Logits per chunk of the greedy and plain sampling kernels (SCH in sample.cu).
const SAMPLE_CHUNK: usize = 4096;

impl SampleOps for CudaBackend {
    fn sample(&self, logits: &CudaBuf, vocab: usize, draws: Draws<Self>) -> Result<()> {
        let Draws {
            tokens,
            logprobs,
            keys,
            positions,
            rows,
            sampling: params,
        } = draws;
        params.validate()?;
        need(tokens.len, rows, "sample tokens")?;
        need(logprobs.len, rows, "sample logprobs")?;
        need(logits.len, rows * vocab, "sample logits")?;
        need(keys.len, 2 * rows, "sample keys")?;
        need(positions.len, rows, "sample positions")?;
        if logprobs.dtype != DType::F32 {
            bail!("sample: log-probs must be an f32 buffer");
        }
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            bail!("cannot sample from an empty vocabulary");
        }
        let v = i32_of(vocab, "vocab")?;
        let top_k = if params.top_k > 0 && (params.top_k as usize) < vocab {
            params.top_k as i32
        } else {
            -1
        };
        let err = self.err_ptr();
        if params.temperature == 0.0 || (top_k < 0 && params.top_p >= 1.0) {
            // Greedy or plain: one pass over chunks of the vocabulary, then the pick (see
            // sample.cu).
            let chunks = vocab.div_ceil(SAMPLE_CHUNK);
            let c = i32_of(chunks, "sample chunks")?;
            let cmax = self.temp(rows * chunks, DType::F32)?;
            let carg = self.temp(rows * chunks, DType::F32)?;
            // f64 segment sums, 8 per chunk, in a buffer of twice as many f32 words.
            let ssum = self.temp(rows * chunks * 8 * 2, DType::F32)?;
            let f = self.func(KERNELS, 0, "sample_chunk_k")?;
            let args = Args::new()
                .ptrs(&[&cmax, &carg, &ssum])
                .buf(logits)
                .i32(v)
                .f32(params.temperature);
            self.launch(&f, (chunks as u32, rows as u32, 1), 256, 0, &args)?;
            let f = self.func(KERNELS, 0, "sample_pick_k")?;
            let args = Args::new()
                .idx(tokens)
                .ptrs(&[logprobs, &cmax, &carg, &ssum])
                .buf(logits)
                .idx(keys)
                .idx(positions)
                .i32(v)
                .i32(c)
                .f32(params.temperature)
                .raw(err);
            return self.launch(&f, (rows as u32, 1, 1), 512, 0, &args);
        }
        let f = self.func(KERNELS, 0, "sample_k")?;
        let args = Args::new()
            .idx(tokens)
            .ptr(logprobs)
            .buf(logits)
            .idx(keys)
            .idx(positions)
            .i32(v)
            .f32(params.temperature)
            .i32(top_k)
            .f32(params.top_p)
            .raw(err);
        self.launch(&f, (rows as u32, 1, 1), 1024, 0, &args)
    }
}
