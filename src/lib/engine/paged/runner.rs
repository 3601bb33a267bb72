//! The model runner (nano-vllm's `ModelRunner`): the decoder over a KV pool of its own (`kv`:
//! keys and values of every block, per layer, plus one spare block, and the device side of a
//! step). It turns the scheduler's chunks and sample rows into the rows of a step (positions,
//! cache rows, table rows, context lengths), runs the decoder's forward and draw, and brings
//! the draws back behind the device (at most two steps in flight). Pure-decode steps may be
//! padded and replayed from CUDA graphs, captured here (`graphs` keeps their state and says
//! when).

use anyhow::{ensure, Result};
use std::time::Instant;

use super::blocks::cache_row;
use super::graphs::PaddedRun;
use super::kv::{grow_idx, PagedKv};
use super::{Chunk, GraphMode, GraphStats, PagedModel, SampleRow};
use crate::backend::ops::sample::{Sampled, SamplingParams};
use crate::backend::{Backend, DType, FEED_NONE, PAGED_TILE_ROWS};
use crate::model::decoder::{Decoder, StepRows};

/// The decoder over a paged cache of its own. Dropping it releases the decode graphs with the
/// cache (`release_graphs` does it and says how much they held).
pub struct PagedDecoder<'a, B: Backend> {
    pub decoder: &'a mut Decoder<B>,
    pub(crate) cache: PagedKv<B>,
}

impl<'a, B: Backend> PagedDecoder<'a, B> {
    pub fn new(decoder: &'a mut Decoder<B>, num_blocks: usize, block_size: usize) -> Result<Self> {
        let cache = PagedKv::new(decoder.backend(), decoder.config(), num_blocks, block_size)?;
        Ok(PagedDecoder { decoder, cache })
    }

    /// Bytes one KV block of `block_size` positions takes for `decoder` over every layer, keys
    /// and values in its compute dtype (to size a pool).
    pub(crate) fn block_bytes(decoder: &Decoder<B>, block_size: usize) -> usize {
        let cfg = decoder.config();
        let esize = match decoder.backend().compute_dtype() {
            DType::F32 => 4,
            DType::BF16 => 2,
        };
        2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * esize
    }

    /// The logits the last step drew its first `rows` rows from, `[rows, vocab]` (checks).
    pub(crate) fn last_logits(&self, rows: usize) -> Result<Vec<f32>> {
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
            self.cache.in_flight() == 0,
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
            cache.in_flight() < 2,
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
                    chunks[c].tokens.len() == 1 && cache.in_flight() > 0,
                    "paged step: chunk {c} feeds draw {r} of no step before it"
                );
            }
        }
        if let Some(bucket) = cache.graphs.bucket(chunks, rows) {
            return self.submit_padded(chunks, feed, rows, sampling, bucket);
        }
        cache.graphs.stats.eager_steps += 1;
        let step = HostStep::eager(cache, chunks, feed, rows)?;
        self.upload_eager(&step)?;
        let (decoder, cache) = (&mut *self.decoder, &mut self.cache);
        let r = step.sample.len();
        let (kv, draws) = cache.step_views(r, sampling);
        decoder.forward_paged(step.ids.len(), kv, (r > 0).then_some(draws))?;
        cache.start_draws(decoder.backend(), r)
    }

    /// Uploads the rows of an eager step and sets the cache's view of it; the fed rows take
    /// their tokens from the draws of the step before.
    fn upload_eager(&mut self, step: &HostStep) -> Result<()> {
        self.decoder.upload_step(&step.rows())?;
        let (decoder, cache) = (&mut *self.decoder, &mut self.cache);
        let b = decoder.backend();
        cache.grow_step_buffers(b, step.sample.len(), step.tables.len())?;
        b.upload_idx(&mut cache.tables, &step.tables)?;
        cache.max_blocks = step.width;
        if !step.tiles.is_empty() {
            // Not read by graphs: a reallocation need not bump the epoch.
            grow_idx(b, &mut cache.tiles, step.tiles.len())?;
            b.upload_idx(&mut cache.tiles, &step.tiles)?;
        }
        cache.n_tiles = step.tiles.len() / 2;
        cache.decode_rows = step.decode_rows;
        b.upload_idx(&mut cache.keys, &step.keys)?;
        b.upload_idx(&mut cache.positions, &step.positions)?;
        let fed = &step.fed;
        if fed.iter().any(|&f| f != FEED_NONE) {
            // Fed rows are single tokens, which come first: `fed` covers them. The graphs
            // read this buffer too: a reallocation must drop them (the epoch).
            if grow_idx(b, &mut cache.feed, fed.len())? {
                cache.epoch += 1;
            }
            cache.upload_feed(b, fed)?;
            decoder.feed_tokens(&cache.tokens, &cache.feed, fed.len())?;
        }
        Ok(())
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

    /// Pure-decode steps of up to `max_rows` sequences whose tables have at most
    /// `max_blocks` blocks run as `mode` says: `max_blocks` is the longest block table the
    /// engine will build (the fixed width of a padded step). `Graphs` on a backend without
    /// graphs is `Eager`. Graphs captured before are released.
    pub(crate) fn set_graphs(
        &mut self,
        mode: GraphMode,
        max_rows: usize,
        max_blocks: usize,
    ) -> Result<()> {
        self.release_graph_memory()?;
        let mode = if mode == GraphMode::Graphs && !self.decoder.backend().graphs_supported() {
            GraphMode::Eager
        } else {
            mode
        };
        self.cache.graphs.configure(mode, max_rows, max_blocks);
        Ok(())
    }

    /// Destroys the decode graphs and gives their memory back to the pool (to the driver on
    /// the next `trim`); the stats with the bytes the graphs held.
    pub(crate) fn release_graphs(&mut self) -> Result<GraphStats> {
        self.release_graph_memory()?;
        Ok(self.cache.graph_stats())
    }

    /// Destroys the decode graphs; returns the bytes they held.
    fn release_graph_memory(&mut self) -> Result<usize> {
        if !self.cache.graphs.forget() {
            return Ok(0);
        }
        let bytes = self.decoder.backend().graph_release()?;
        let g = &mut self.cache.graphs;
        g.stats.graph_bytes = g.stats.graph_bytes.max(bytes);
        Ok(bytes)
    }

    /// Sizes every buffer a padded step reads or writes for the largest bucket, once; when
    /// any of them moved since the graphs were captured, the graphs are released (they would
    /// read the old addresses) and get captured again.
    fn prepare_padded(&mut self) -> Result<()> {
        let (rows, width) = (self.cache.graphs.max_rows(), self.cache.graphs.width());
        self.decoder.reserve_paged(rows, rows)?;
        self.cache
            .grow_step_buffers(self.decoder.backend(), rows, rows * width)?;
        let now = (self.decoder.workspace_epoch(), self.cache.epoch);
        if self.cache.graphs.moved(now) {
            self.release_graph_memory()?;
        }
        Ok(())
    }

    /// The part of a padded decode step that runs on the device (and is captured): the fed
    /// tokens, the forward of `rows` tokens, final norm and LM head of every row, the draws.
    fn decode_body(&mut self, rows: usize, sampling: &SamplingParams) -> Result<()> {
        let PagedDecoder { decoder, cache } = self;
        // Rows of a queued step take their tokens from the draws of the step before.
        decoder.feed_tokens(&cache.tokens, &cache.feed, rows)?;
        let (kv, draws) = cache.step_views(rows, sampling);
        decoder.forward_paged(rows, kv, Some(draws))
    }

    /// A pure-decode step padded to `bucket` rows (`HostStep::padded`). With
    /// `GraphMode::Graphs` the device part is a graph replay (captured at the bucket's
    /// CAPTURE_AT-th step, after eager runs that compile the kernels, plan the GEMMs and cache
    /// the temporaries).
    fn submit_padded(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
        bucket: usize,
    ) -> Result<()> {
        let step = HostStep::padded(&self.cache, chunks, feed, rows, bucket)?;
        self.prepare_padded()?;
        self.decoder.upload_step(&step.rows())?;
        {
            let (b, cache) = (self.decoder.backend(), &mut self.cache);
            b.upload_idx(&mut cache.tables, &step.tables)?;
            b.upload_idx(&mut cache.keys, &step.keys)?;
            b.upload_idx(&mut cache.positions, &step.positions)?;
            cache.upload_feed(b, &step.fed)?;
        }
        let cache = &mut self.cache;
        cache.max_blocks = step.width;
        cache.n_tiles = 0;
        cache.decode_rows = bucket;
        let g = &mut cache.graphs;
        g.stats.padding_rows += bucket - chunks.len().max(rows.len());
        match g.next_run(bucket, sampling) {
            PaddedRun::Eager => {
                self.decode_body(bucket, sampling)?;
                self.cache.graphs.stats.padded_steps += 1;
            }
            PaddedRun::Capture(key) => {
                let t0 = Instant::now();
                let id = self.capture(bucket, sampling)?;
                let us = t0.elapsed().as_micros() as u64;
                self.cache.graphs.captured_as(key, id, us);
                self.replay(id)?;
            }
            PaddedRun::Replay(id) => self.replay(id)?,
        }
        self.cache.start_draws(self.decoder.backend(), rows.len())
    }

    /// Captures the device part of a padded step of `bucket` rows as a graph; its id.
    fn capture(&mut self, bucket: usize, sampling: &SamplingParams) -> Result<usize> {
        let b = self.decoder.backend();
        b.synchronize()?;
        b.graph_begin()?;
        let body = self.decode_body(bucket, sampling);
        let id = self.decoder.backend().graph_end();
        body?;
        id
    }

    /// Launches graph `id`.
    fn replay(&mut self, id: usize) -> Result<()> {
        self.decoder.backend().graph_launch(id)?;
        self.cache.graphs.stats.replays += 1;
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

/// The host side of a step: per token row its id, position, cache row, table row (its chunk)
/// and context length; the block tables, `width` entries per chunk; per sample row the token
/// row it draws from, its key (two words) and its position; the fed rows' sources (`FEED_NONE`
/// where a row keeps its own token); the prefill tiles (first row, rows) after the
/// `decode_rows` single-token rows.
struct HostStep {
    ids: Vec<u32>,
    pos: Vec<u32>,
    kv_rows: Vec<u32>,
    seq: Vec<u32>,
    len: Vec<u32>,
    tables: Vec<u32>,
    width: usize,
    sample: Vec<u32>,
    keys: Vec<u32>,
    positions: Vec<u32>,
    fed: Vec<u32>,
    tiles: Vec<u32>,
    decode_rows: usize,
}

impl HostStep {
    fn rows(&self) -> StepRows<'_> {
        StepRows {
            ids: &self.ids,
            positions: &self.pos,
            cache_rows: &self.kv_rows,
            table_rows: &self.seq,
            context: &self.len,
            sample: &self.sample,
        }
    }

    /// A step as it is: single-token chunks first, then the prefill chunks in tiles of
    /// consecutive rows (the attention runs those as blocks of queries); tables as wide as the
    /// widest.
    fn eager<B: Backend>(
        cache: &PagedKv<B>,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
    ) -> Result<HostStep> {
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
        let sample: Vec<u32> = rows
            .iter()
            .map(|r| {
                last.get(r.chunk)
                    .copied()
                    .ok_or_else(|| anyhow::anyhow!("sample row names chunk {}", r.chunk))
            })
            .collect::<Result<_>>()?;
        let keys: Vec<u32> = rows
            .iter()
            .flat_map(|s| [s.key as u32, (s.key >> 32) as u32])
            .collect();
        let positions: Vec<u32> = rows.iter().map(|s| s.position as u32).collect();
        Ok(HostStep {
            ids,
            pos,
            kv_rows,
            seq,
            len,
            tables,
            width: max_blocks,
            sample,
            keys,
            positions,
            fed,
            tiles,
            decode_rows: single.len(),
        })
    }

    /// A pure-decode step padded to `bucket` rows: padding rows feed token 0 at position 0
    /// into the spare block and sample from their own logits; every table is the graphs' fixed
    /// width (the rest pointing at the spare block).
    fn padded<B: Backend>(
        cache: &PagedKv<B>,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        bucket: usize,
    ) -> Result<HostStep> {
        let (bs, width) = (cache.block_size(), cache.graphs.width());
        let spare = cache.num_blocks() as u32;
        let n = chunks.len();
        let mut fed = vec![FEED_NONE; bucket];
        for (f, &s) in fed.iter_mut().zip(feed) {
            *f = s.unwrap_or(FEED_NONE);
        }
        let mut ids = vec![0u32; bucket];
        let mut pos = vec![0u32; bucket];
        let mut kv_rows = vec![spare * bs as u32; bucket];
        let seq: Vec<u32> = (0..bucket as u32).collect();
        let mut len = vec![1u32; bucket];
        let mut tables = vec![spare; bucket * width];
        for (c, ch) in chunks.iter().enumerate() {
            cache.check_chunk(c, ch)?;
            let p = ch.start;
            tables[c * width..c * width + ch.table.len()].copy_from_slice(ch.table);
            ids[c] = ch.tokens[0];
            pos[c] = p as u32;
            kv_rows[c] = cache_row(ch.table, bs, p) as u32;
            len[c] = p as u32 + 1;
        }
        let mut sample = seq.clone();
        let mut keys = vec![0u32; 2 * bucket];
        let mut positions = vec![0u32; bucket];
        for (i, r) in rows.iter().enumerate() {
            ensure!(r.chunk < n, "sample row names chunk {}", r.chunk);
            sample[i] = r.chunk as u32;
            keys[2 * i] = r.key as u32;
            keys[2 * i + 1] = (r.key >> 32) as u32;
            positions[i] = r.position as u32;
        }
        Ok(HostStep {
            ids,
            pos,
            kv_rows,
            seq,
            len,
            tables,
            width,
            sample,
            keys,
            positions,
            fed,
            tiles: Vec::new(),
            decode_rows: bucket,
        })
    }
}
