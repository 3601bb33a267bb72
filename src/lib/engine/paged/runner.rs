//! The model runner (nano-vllm's `ModelRunner`): the decoder over a KV pool of its own. It
//! allocates the pool (keys and values of every block, per layer, plus one spare block) and
//! the device side of a step (block tables, prefill tiles, sampling keys and positions, fed
//! rows, drawn tokens and log-probs); it turns the scheduler's chunks and sample rows into the
//! rows of a step (positions, cache rows, table rows, context lengths), runs the decoder's
//! forward and draw, and brings the draws back behind the device (at most two steps in
//! flight). Pure-decode steps may be padded and replayed from CUDA graphs (`graphs`).

use anyhow::{bail, ensure, Result};
use std::collections::VecDeque;

use super::blocks::cache_row;
use super::graphs::DecodeGraphs;
use super::{Chunk, GraphStats, PagedModel, SampleRow};
use crate::backend::ops::sample::{Sampled, SamplingParams};
use crate::backend::{Backend, DType, Draws, FEED_NONE, PAGED_TILE_ROWS};
use crate::model::decoder::{Decoder, PagedAttn, StepRows};
use crate::model::Config;

/// A paged KV cache: `num_blocks` blocks of `block_size` positions per layer; row
/// `block · block_size + offset` of a layer's buffer holds the key (value) of one position.
/// It also holds the device-side inputs and outputs of a paged step (block tables, sampling
/// keys, drawn tokens), so a step allocates nothing once they have grown.
pub struct PagedKv<B: Backend> {
    /// One block more than `num_blocks`: the last one is where the padding rows of a
    /// graph-replayed decode step write and read (never given to a sequence).
    k: Vec<B::Buf>,
    v: Vec<B::Buf>,
    num_blocks: usize,
    block_size: usize,
    pub(super) tables: B::Idx,
    pub(super) max_blocks: usize,
    /// The step's prefill tiles (see `PagedAttentionOps::attention_paged_tiled`): `n_tiles` pairs (first
    /// row, rows) after its `decode_rows` single-token rows; none in a pure-decode step.
    tiles: B::Idx,
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
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }
    /// The graph of a decode step captured first, if any (for timing its replay alone).
    pub fn first_graph(&self) -> Option<usize> {
        self.graphs.captured.first().map(|&(_, id)| id)
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

    /// The draws of the oldest submitted step not yet collected.
    fn collect(&mut self, b: &B) -> Result<Vec<Sampled>> {
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

/// The decoder over a paged cache of its own. Dropping it releases the decode graphs with the
/// cache (`release_graphs` does it and says how much they held).
pub struct PagedDecoder<'a, B: Backend> {
    pub decoder: &'a mut Decoder<B>,
    pub cache: PagedKv<B>,
}

impl<'a, B: Backend> PagedDecoder<'a, B> {
    pub fn new(decoder: &'a mut Decoder<B>, num_blocks: usize, block_size: usize) -> Result<Self> {
        let cache = PagedKv::new(decoder.backend(), decoder.config(), num_blocks, block_size)?;
        Ok(PagedDecoder { decoder, cache })
    }

    /// Bytes one KV block of `block_size` positions takes for `decoder` over every layer, keys
    /// and values in its compute dtype (to size a pool).
    pub fn block_bytes(decoder: &Decoder<B>, block_size: usize) -> usize {
        let cfg = decoder.config();
        let esize = match decoder.backend().compute_dtype() {
            DType::F32 => 4,
            DType::BF16 => 2,
        };
        2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * esize
    }

    /// How the decode steps ran so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.cache.graph_stats()
    }

    /// The logits the last step drew its first `rows` rows from, `[rows, vocab]` (checks).
    pub fn last_logits(&self, rows: usize) -> Result<Vec<f32>> {
        self.decoder.step_logits(rows)
    }

    /// Teacher forcing through the paged cache, for checks: `prompt` as one chunk, then each of
    /// `tokens` fed in a step of its own; the logits after the prompt and after each fed token,
    /// `[tokens.len() + 1, vocab]` row-major. The sequence takes the first blocks of the pool.
    pub fn forced_logits(&mut self, prompt: &[u32], tokens: &[u32]) -> Result<Vec<f32>> {
        let bs = self.cache.block_size;
        let blocks = (prompt.len() + tokens.len()).div_ceil(bs);
        ensure!(
            !prompt.is_empty() && blocks <= self.cache.num_blocks,
            "teacher forcing {} + {} tokens needs {blocks} blocks of the pool's {}",
            prompt.len(),
            tokens.len(),
            self.cache.num_blocks
        );
        let table: Vec<u32> = (0..blocks as u32).collect();
        let row = [SampleRow {
            chunk: 0,
            key: 0,
            position: 0,
        }];
        let greedy = SamplingParams::greedy();
        self.run_step(
            &[Chunk {
                tokens: prompt,
                start: 0,
                table: &table,
            }],
            &row,
            &greedy,
        )?;
        let mut out = self.last_logits(1)?;
        for (i, t) in tokens.iter().enumerate() {
            let chunk = Chunk {
                tokens: std::slice::from_ref(t),
                start: prompt.len() + i,
                table: &table,
            };
            self.run_step(&[chunk], &row, &greedy)?;
            out.extend(self.last_logits(1)?);
        }
        Ok(out)
    }

    /// One step run to the end: `submit` then `collect`.
    pub fn run_step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        ensure!(
            self.cache.pending.is_empty(),
            "paged step: a submitted step was not collected"
        );
        self.submit(chunks, &[], rows, sampling)?;
        self.collect()
    }

    /// The draws of the oldest step `submit` queued and nothing collected yet (waits for them
    /// to reach the host).
    pub fn collect(&mut self) -> Result<Vec<Sampled>> {
        self.cache.collect(self.decoder.backend())
    }

    /// Runs every chunk (its keys and values stored through its block table), then draws one
    /// token per sample row from the logits after the last token of the row's chunk, on the
    /// backend, without waiting for the draws (`collect` returns them, in order; at most two
    /// steps in flight). A chunk with `feed[c] = Some(r)` is one token: the token drawn for
    /// row r of the step submitted just before, read on the device (so this step can be queued
    /// before that one's draws are back); `feed` may be empty (no chunk fed).
    pub fn submit(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<()> {
        let cache = &mut self.cache;
        ensure!(
            cache.pending.len() < 2,
            "paged step: two steps are in flight already"
        );
        ensure!(
            feed.is_empty() || feed.len() == chunks.len(),
            "paged step: {} feeds for {} chunks",
            feed.len(),
            chunks.len()
        );
        for (c, f) in feed.iter().enumerate() {
            if let Some(r) = f {
                ensure!(
                    chunks[c].tokens.len() == 1 && !cache.pending.is_empty(),
                    "paged step: chunk {c} feeds draw {r} of no step before it"
                );
            }
        }
        if let Some(bucket) = cache.graphs.bucket(chunks, rows) {
            return self.submit_padded(chunks, feed, rows, sampling, bucket);
        }
        cache.graphs.stats.eager_steps += 1;
        let bs = cache.block_size;
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        ensure!(n > 0, "paged step without tokens");
        let max_blocks = chunks.iter().map(|c| c.table.len()).max().unwrap_or(0);
        let (mut ids, mut pos) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut kv_rows, mut seq, mut len) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut tables = vec![0u32; chunks.len() * max_blocks];
        let mut last = vec![0u32; chunks.len()];
        // Single-token chunks first, then the prefill chunks in tiles of consecutive rows
        // (the attention runs those as blocks of queries).
        let (single, multi): (Vec<usize>, Vec<usize>) =
            (0..chunks.len()).partition(|&c| chunks[c].tokens.len() == 1);
        let mut tiles = Vec::new();
        let mut fed = Vec::new();
        for &c in single.iter().chain(&multi) {
            let ch = &chunks[c];
            if !feed.is_empty() && ch.tokens.len() == 1 {
                fed.push(feed[c].unwrap_or(FEED_NONE));
            }
            cache.check_chunk(c, ch)?;
            tables[c * max_blocks..c * max_blocks + ch.table.len()].copy_from_slice(ch.table);
            if ch.tokens.len() > 1 {
                for t0 in (0..ch.tokens.len()).step_by(PAGED_TILE_ROWS) {
                    let rows = PAGED_TILE_ROWS.min(ch.tokens.len() - t0);
                    tiles.extend([(ids.len() + t0) as u32, rows as u32]);
                }
            }
            for (i, &t) in ch.tokens.iter().enumerate() {
                let p = ch.start + i;
                ids.push(t);
                pos.push(p as u32);
                kv_rows.push(cache_row(ch.table, bs, p) as u32);
                seq.push(c as u32);
                len.push(p as u32 + 1);
            }
            last[c] = ids.len() as u32 - 1;
        }
        let out: Vec<u32> = rows
            .iter()
            .map(|r| {
                last.get(r.chunk)
                    .copied()
                    .ok_or_else(|| anyhow::anyhow!("sample row names chunk {}", r.chunk))
            })
            .collect::<Result<_>>()?;
        let r = out.len();
        let keys: Vec<u32> = rows
            .iter()
            .flat_map(|s| [s.key as u32, (s.key >> 32) as u32])
            .collect();
        let positions: Vec<u32> = rows.iter().map(|s| s.position as u32).collect();
        self.decoder.upload_step(&StepRows {
            ids: &ids,
            positions: &pos,
            cache_rows: &kv_rows,
            table_rows: &seq,
            context: &len,
            sample: &out,
        })?;
        let (decoder, cache) = (&mut *self.decoder, &mut self.cache);
        let b = decoder.backend();
        cache.grow_step_buffers(b, r, tables.len())?;
        b.upload_idx(&mut cache.tables, &tables)?;
        cache.max_blocks = max_blocks;
        if !tiles.is_empty() {
            // Not read by graphs: a reallocation need not bump the epoch.
            grow_idx(b, &mut cache.tiles, tiles.len())?;
            b.upload_idx(&mut cache.tiles, &tiles)?;
        }
        cache.n_tiles = tiles.len() / 2;
        cache.decode_rows = single.len();
        b.upload_idx(&mut cache.keys, &keys)?;
        b.upload_idx(&mut cache.positions, &positions)?;
        if fed.iter().any(|&f| f != FEED_NONE) {
            // Fed rows are single tokens, which come first: `fed` covers them. The graphs
            // read this buffer too: a reallocation must drop them (the epoch).
            if grow_idx(b, &mut cache.feed, fed.len())? {
                cache.epoch += 1;
            }
            cache.upload_feed(b, &fed)?;
            decoder.feed_tokens(&cache.tokens, &cache.feed, fed.len())?;
        }
        let (kv, draws) = cache.step_views(r, sampling);
        decoder.forward_paged(n, kv, (r > 0).then_some(draws))?;
        cache.start_draws(decoder.backend(), r)
    }

    /// Copies whole blocks `(src, dst)` of every layer's keys and values.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        let cfg = self.decoder.config();
        let cache = &mut self.cache;
        let row = cache.block_size * cfg.num_kv_heads * cfg.head_dim;
        for &(src, dst) in pairs {
            ensure!(
                (src as usize) < cache.num_blocks
                    && (dst as usize) < cache.num_blocks
                    && src != dst,
                "paged cache: copy of block {src} to {dst} ({} blocks)",
                cache.num_blocks
            );
            for buf in cache.k.iter_mut().chain(cache.v.iter_mut()) {
                self.decoder.backend().copy_within(
                    buf,
                    dst as usize * row,
                    src as usize * row,
                    row,
                )?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Drop for PagedDecoder<'_, B> {
    fn drop(&mut self) {
        // The graphs read this cache's buffers: they go with it.
        let _ = self.release_graph_memory();
    }
}

impl<B: Backend> PagedModel for PagedDecoder<'_, B> {
    fn vocab(&self) -> usize {
        self.decoder.config().vocab_size
    }
    fn step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        self.run_step(chunks, rows, sampling)
    }
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        PagedDecoder::copy_blocks(self, pairs)
    }
    fn asynchronous(&self) -> bool {
        true
    }
    fn submit(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<()> {
        PagedDecoder::submit(self, chunks, feed, rows, sampling)
    }
    fn collect(&mut self) -> Result<Vec<Sampled>> {
        PagedDecoder::collect(self)
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
