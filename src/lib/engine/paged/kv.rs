//! The paged KV cache of the model runner: keys and values of every block, per layer (plus
//! one spare block for the padding rows of graph-replayed steps), and the device side of a
//! step (block tables, prefill tiles, sampling keys and positions, fed rows, drawn tokens and
//! log-probs), which grows once and is then reused; the draws of up to two steps on their way
//! back to the host.

use anyhow::{bail, ensure, Result};
use std::collections::VecDeque;

use super::graphs::DecodeGraphs;
use super::{Chunk, GraphStats};
use crate::backend::ops::sample::{Sampled, SamplingParams};
use crate::backend::{Backend, Draws};
use crate::model::decoder::PagedAttn;
use crate::model::Config;

/// A paged KV cache: `num_blocks` blocks of `block_size` positions per layer; row
/// `block · block_size + offset` of a layer's buffer holds the key (value) of one position.
/// It also holds the device-side inputs and outputs of a paged step (block tables, sampling
/// keys, drawn tokens), so a step allocates nothing once they have grown.
pub(crate) struct PagedKv<B: Backend> {
    /// One block more than `num_blocks`: the last one is where the padding rows of a
    /// graph-replayed decode step write and read (never given to a sequence).
    pub(super) k: Vec<B::Buf>,
    pub(super) v: Vec<B::Buf>,
    pub(super) num_blocks: usize,
    pub(super) block_size: usize,
    pub(super) tables: B::Idx,
    pub(super) max_blocks: usize,
    /// The step's prefill tiles (see `PagedAttentionOps::attention_paged_tiled`): `n_tiles` pairs (first
    /// row, rows) after its `decode_rows` single-token rows; none in a pure-decode step.
    pub(super) tiles: B::Idx,
    pub(super) n_tiles: usize,
    pub(super) decode_rows: usize,
    pub(super) keys: B::Idx,
    pub(super) positions: B::Idx,
    /// Per row of a step, the row of the step before whose draw it feeds (`FEED_NONE`: the
    /// token uploaded for it); see `PagedDecoder::submit`.
    pub(super) feed: B::Idx,
    pub(super) tokens: B::Idx,
    logprobs: B::Buf,
    /// Bumped whenever one of the buffers above is reallocated (see
    /// `Decoder::workspace_epoch`).
    pub(super) epoch: u64,
    pub(super) graphs: DecodeGraphs,
    /// Draws of submitted steps not yet collected, oldest first (at most two).
    pending: VecDeque<Pending>,
    /// Steps submitted so far (their draws alternate between two landing slots).
    submitted: usize,
}

/// A submitted step's draws: already on the host, or on their way through a slot.
enum Pending {
    Ready(Vec<Sampled>),
    Slot(usize, usize),
}

impl<B: Backend> PagedKv<B> {
    /// A pool of `num_blocks` blocks of `block_size` positions for the decoder `cfg` on `b`.
    pub fn new(b: &B, cfg: &Config, num_blocks: usize, block_size: usize) -> Result<Self> {
        ensure!(
            num_blocks > 0 && block_size > 0,
            "paged cache: {num_blocks} blocks of {block_size}"
        );
        // One spare block for the padding rows of graph-replayed decode steps.
        let n = (num_blocks + 1) * block_size * cfg.num_kv_heads * cfg.head_dim;
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(b.alloc_as(n, b.compute_dtype())?);
            v.push(b.alloc_as(n, b.compute_dtype())?);
        }
        Ok(PagedKv {
            k,
            v,
            num_blocks,
            block_size,
            tables: b.alloc_idx(0)?,
            max_blocks: 0,
            tiles: b.alloc_idx(0)?,
            n_tiles: 0,
            decode_rows: 0,
            keys: b.alloc_idx(0)?,
            positions: b.alloc_idx(0)?,
            feed: b.alloc_idx(0)?,
            tokens: b.alloc_idx(0)?,
            logprobs: b.alloc(0)?,
            epoch: 0,
            graphs: DecodeGraphs::default(),
            pending: VecDeque::new(),
            submitted: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }
    pub(crate) fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }
    /// The graph of a decode step captured first, if any (for timing its replay alone).
    pub(crate) fn first_graph(&self) -> Option<usize> {
        self.graphs.first()
    }

    /// Chunk `c` must feed positions its table covers, through blocks of this cache.
    pub(super) fn check_chunk(&self, c: usize, ch: &Chunk) -> Result<()> {
        let end = ch.start + ch.tokens.len();
        ensure!(
            !ch.tokens.is_empty() && end <= ch.table.len() * self.block_size,
            "paged step: chunk {c} feeds positions {}..{end} but its table covers {}",
            ch.start,
            ch.table.len() * self.block_size
        );
        if let Some(&b) = ch.table.iter().find(|&&b| b as usize >= self.num_blocks) {
            bail!(
                "paged step: chunk {c} names block {b} of {}",
                self.num_blocks
            );
        }
        Ok(())
    }

    /// Grows the step's device inputs and outputs to `rows` sample rows and `table_entries`
    /// block-table entries; a reallocation bumps `epoch` (graphs read the old addresses).
    pub(super) fn grow_step_buffers(
        &mut self,
        b: &B,
        rows: usize,
        table_entries: usize,
    ) -> Result<()> {
        let mut moved = grow_idx(b, &mut self.tables, table_entries)?;
        moved |= grow_idx(b, &mut self.keys, 2 * rows)?;
        moved |= grow_idx(b, &mut self.positions, rows)?;
        moved |= grow_idx(b, &mut self.feed, rows)?;
        moved |= grow_idx(b, &mut self.tokens, rows)?;
        if b.len(&self.logprobs) < rows {
            self.logprobs = b.alloc(rows.next_power_of_two())?;
            moved = true;
        }
        if moved {
            self.epoch += 1;
        }
        Ok(())
    }

    /// The cache as the step's attention reads it, and where its first `rows` draws go.
    pub(super) fn step_views<'s>(
        &'s mut self,
        rows: usize,
        sampling: &'s SamplingParams,
    ) -> (PagedAttn<'s, B>, Draws<'s, B>) {
        let PagedKv {
            k,
            v,
            block_size,
            tables,
            max_blocks,
            tiles,
            n_tiles,
            decode_rows,
            keys,
            positions,
            tokens,
            logprobs,
            ..
        } = self;
        (
            PagedAttn {
                k,
                v,
                block_size: *block_size,
                tables,
                max_blocks: *max_blocks,
                tiles,
                n_tiles: *n_tiles,
                decode_rows: *decode_rows,
            },
            Draws {
                tokens,
                logprobs,
                keys,
                positions,
                rows,
                sampling,
            },
        )
    }

    /// Sets the draws of the step just run (its first `rows` sample rows) on their way to the
    /// host, behind it; `collect` returns them.
    pub(super) fn start_draws(&mut self, b: &B, rows: usize) -> Result<()> {
        let slot = self.submitted % 2;
        self.submitted += 1;
        let p = match b.draws_start(slot, &self.tokens, &self.logprobs, rows)? {
            Some((t, l)) => Pending::Ready(sampled(t, l)),
            None => Pending::Slot(slot, rows),
        };
        self.pending.push_back(p);
        Ok(())
    }

    /// Steps submitted and not yet collected.
    pub(super) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The draws of the oldest submitted step not yet collected.
    pub(super) fn collect(&mut self, b: &B) -> Result<Vec<Sampled>> {
        match self.pending.pop_front() {
            Some(Pending::Ready(d)) => Ok(d),
            Some(Pending::Slot(slot, rows)) => {
                let (t, l) = b.draws_wait(slot, rows)?;
                Ok(sampled(t, l))
            }
            None => bail!("paged step: nothing submitted to collect"),
        }
    }

    /// The per-row feed sources of a step (`FEED_NONE` where a row keeps its own token).
    pub(super) fn upload_feed(&mut self, b: &B, feed: &[u32]) -> Result<()> {
        b.upload_idx(&mut self.feed, feed)
    }
}

/// Draws as `Sampled` rows.
fn sampled(tokens: Vec<u32>, logprobs: Vec<f32>) -> Vec<Sampled> {
    tokens
        .into_iter()
        .zip(logprobs)
        .map(|(token, logprob)| Sampled { token, logprob })
        .collect()
}

/// Grows an index buffer to hold at least `n` entries (to the next power of two, so that a
/// growing batch reallocates rarely); true when it was reallocated.
pub(super) fn grow_idx<B: Backend>(b: &B, buf: &mut B::Idx, n: usize) -> Result<bool> {
    if b.len_idx(buf) < n {
        *buf = b.alloc_idx(n.next_power_of_two())?;
        return Ok(true);
    }
    Ok(false)
}
