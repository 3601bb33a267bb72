//! A step over a paged KV cache, as the engine's runner describes it (nano-vllm's per-step
//! context): the rows of the step on the host (`StepRows`: token, position, cache row, table
//! row, context length, which rows are drawn from), the cache and the step's block tables on
//! the device (`PagedAttn`), and where the draws go (`backend::Draws`, the `sample` op's
//! arguments). The decoder stores each new token's key and value at its cache row, attends
//! through the tables, and draws on the device: only token ids and log-probs leave it. The runner owns every buffer named here
//! except the workspace, and decides when a step is captured as a graph.

use anyhow::{ensure, Result};

use super::attn::{AttnMode, PagedAttn};
use super::Decoder;
use crate::backend::{Backend, Draws};

/// The rows of one step, one entry per token row except `sample`: token row i feeds `ids[i]`
/// at position `positions[i]` of the sequence whose block table is row `table_rows[i]` of the
/// step's tables; its key and value go to cache row `cache_rows[i]` (block · block_size +
/// offset), and it attends to the first `context[i]` positions of its sequence.
#[derive(Clone, Copy, Debug)]
pub struct StepRows<'a> {
    pub ids: &'a [u32],
    pub positions: &'a [u32],
    pub cache_rows: &'a [u32],
    pub table_rows: &'a [u32],
    pub context: &'a [u32],
    /// The token rows whose logits are drawn from, in draw order (a row may repeat).
    pub sample: &'a [u32],
}

impl<B: Backend> Decoder<B> {
    /// Grows the workspace for steps of up to `tokens` tokens and `rows` sampled rows (so a KV
    /// pool sized from the free memory afterwards leaves room for it).
    pub fn reserve_paged(&mut self, tokens: usize, rows: usize) -> Result<()> {
        self.reserve(self.step_caps(tokens, rows))?;
        self.grow_logits(rows * self.cfg.vocab_size)
    }

    /// Checks a step's rows and uploads them into the workspace (grown to fit them first).
    pub fn upload_step(&mut self, s: &StepRows) -> Result<()> {
        let n = s.ids.len();
        ensure!(
            [s.positions, s.cache_rows, s.table_rows, s.context]
                .iter()
                .all(|x| x.len() == n),
            "paged step: {n} tokens but {} positions, {} cache rows, {} table rows, {} context lengths",
            s.positions.len(),
            s.cache_rows.len(),
            s.table_rows.len(),
            s.context.len()
        );
        if let Some(&r) = s.sample.iter().find(|&&r| r as usize >= n) {
            anyhow::bail!("paged step: sampled row {r} of {n} token rows");
        }
        self.check_tokens(s.ids, "generation input")?;
        let r = s.sample.len();
        self.reserve(self.step_caps(n, r))?;
        let (b, ws) = (&self.backend, &mut self.ws);
        b.upload_idx(&mut ws.ids, s.ids)?;
        b.upload_idx(&mut ws.pos, s.positions)?;
        b.upload_idx(&mut ws.kv_rows, s.cache_rows)?;
        b.upload_idx(&mut ws.kv_base, s.table_rows)?;
        b.upload_idx(&mut ws.kv_len, s.context)?;
        b.upload_idx(&mut ws.rows, s.sample)?;
        self.grow_logits(r * self.cfg.vocab_size)
    }

    /// ids[i] = prev[src[i]] on the device for the first `rows` uploaded token rows whose
    /// `src[i]` is not `FEED_NONE`: the tokens of a step queued behind the one that draws
    /// them into `prev` (which may still be running).
    pub fn feed_tokens(&mut self, prev: &B::Idx, src: &B::Idx, rows: usize) -> Result<()> {
        self.backend.feed_tokens(&mut self.ws.ids, prev, src, rows)
    }

    /// The forward pass of the `n` uploaded token rows against the paged cache `kv`, then, with
    /// `draws`, the final norm and LM head of the first `draws.rows` sampled rows and one draw
    /// per row. Nothing comes back to the host.
    pub fn forward_paged(
        &mut self,
        n: usize,
        kv: PagedAttn<B>,
        draws: Option<Draws<B>>,
    ) -> Result<()> {
        ensure!(!self.cfg.value_head, "a value model does not generate");
        let last = self.forward(n, 1, false, AttnMode::Paged(kv))?;
        let Some(d) = draws else {
            return Ok(());
        };
        self.final_rows(last, d.rows)?;
        self.head_logits(d.rows)?;
        self.backend.sample(&self.ws.logits, self.cfg.vocab_size, d)
    }

    /// The logits the last paged step drew its first `rows` rows from, `[rows, vocab]`
    /// row-major (for checks: a step's draws are all that leaves the device otherwise).
    pub fn step_logits(&self, rows: usize) -> Result<Vec<f32>> {
        let n = rows * self.cfg.vocab_size;
        ensure!(
            n <= self.backend.len(&self.ws.logits),
            "no logits of {rows} rows: the last step drew fewer"
        );
        let mut out = vec![0.0; n];
        self.backend.download(&self.ws.logits, &mut out)?;
        Ok(out)
    }

    /// Bumped whenever a workspace buffer moves or the fused projections are turned on or off:
    /// CUDA graphs captured before read the old addresses (or the other GEMMs).
    pub fn workspace_epoch(&self) -> u64 {
        self.ws_epoch
    }
}
