//! Decode graphs: pure-decode steps (every chunk one token) padded to a bucket of rows and a
//! fixed table width, so that their kernels have fixed shapes and read fixed buffers, and
//! captured once per (bucket, sampling) as a CUDA graph, then replayed. A padded step run
//! eagerly (`GraphMode::Padded`) is the reference a replay must equal bit for bit.

use anyhow::{ensure, Result};

use super::blocks::cache_row;
use super::runner::PagedDecoder;
use super::{Chunk, SampleRow};
use crate::backend::ops::sample::SamplingParams;
use crate::backend::{Backend, FEED_NONE};
use crate::model::decoder::StepRows;

/// How the pure-decode steps of a paged cache run (every chunk one token).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphMode {
    /// As every other step: the batch as it is.
    #[default]
    Eager,
    /// Padded exactly as for a graph (rows to the bucket, tables to the fixed width), run
    /// eagerly: the reference a graph replay must equal bit for bit.
    Padded,
    /// Padded, captured once per (bucket, sampling) as a graph and replayed (CUDA).
    Graphs,
}

/// Counters of the decode graphs of one paged cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Decode steps replayed from a graph, run padded eagerly, and run as they are.
    pub replays: usize,
    pub padded_steps: usize,
    pub eager_steps: usize,
    /// Graphs captured (a bucket again after a workspace reallocation counts again).
    pub captures: usize,
    /// Rows computed for padding (bucket − batch, summed over padded steps).
    pub padding_rows: usize,
    /// Device memory the graphs kept for their temporaries (given back on release).
    pub graph_bytes: usize,
    /// Wall time of the captures: each bucket's eager first run, the capture and the
    /// instantiation (microseconds).
    pub capture_us: u64,
    /// Times the graphs were dropped because a buffer they read moved.
    pub drops: usize,
}

/// Key of a captured graph: (bucket, temperature bits, top_k, top_p bits).
type GraphKey = (usize, u32, i64, u32);

/// The decode graphs of one paged cache and how its pure-decode steps run.
#[derive(Debug, Default)]
pub(super) struct DecodeGraphs {
    mode: GraphMode,
    /// Blocks per table of a padded step (longest sequence the engine may run).
    width: usize,
    /// Largest bucket: steps with more rows run eagerly.
    max_rows: usize,
    /// Captured graphs by key → graph id.
    pub(super) captured: Vec<(GraphKey, usize)>,
    /// Pure-decode steps run so far per key: a bucket is captured at its CAPTURE_AT-th step.
    uses: Vec<(GraphKey, usize)>,
    /// (workspace epoch, cache epoch) the fixed buffers were sized at (None: not yet).
    epochs: Option<(u64, u64)>,
    pub(super) stats: GraphStats,
}

/// The step of a bucket that is captured; the ones before run padded eagerly (the first also
/// compiles kernels and plans GEMMs). A capture costs ~15 ms on an H100, several eager steps:
/// the buckets a batch passes through only as it drains (a step or two each) stay eager.
const CAPTURE_AT: usize = 3;

/// Row counts a decode step is padded to: powers of two up to 16, then also 1.5× each power
/// of two (at most a third of a step is padding past 16 rows).
pub fn decode_bucket(rows: usize) -> usize {
    let p = rows.max(1).next_power_of_two();
    if p >= 32 && rows <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

impl DecodeGraphs {
    /// The bucket a step of these chunks and rows is padded to, or None when it runs as it
    /// is (a prefill chunk in it, too many rows, a table wider than the fixed width, or
    /// padding off).
    pub(super) fn bucket(&self, chunks: &[Chunk], rows: &[SampleRow]) -> Option<usize> {
        if self.mode == GraphMode::Eager
            || rows.is_empty()
            || chunks
                .iter()
                .any(|c| c.tokens.len() != 1 || c.table.len() > self.width)
        {
            return None;
        }
        let b = decode_bucket(chunks.len().max(rows.len()));
        (b <= self.max_rows).then_some(b)
    }
}

impl<B: Backend> PagedDecoder<'_, B> {
    /// Pure-decode steps of up to `max_rows` sequences whose tables have at most
    /// `max_blocks` blocks run as `mode` says: `max_blocks` is the longest block table the
    /// engine will build (the fixed width of a padded step). `Graphs` on a backend without
    /// graphs is `Eager`. Graphs captured before are released.
    pub fn set_graphs(
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
        let g = &mut self.cache.graphs;
        g.mode = mode;
        g.max_rows = decode_bucket(max_rows.max(1));
        g.width = max_blocks.max(1);
        g.epochs = None;
        Ok(())
    }

    /// Destroys the decode graphs and gives their memory back to the pool (to the driver on
    /// the next `trim`); the stats with the bytes the graphs held.
    pub fn release_graphs(&mut self) -> Result<GraphStats> {
        self.release_graph_memory()?;
        Ok(self.cache.graph_stats())
    }

    /// Destroys the decode graphs; returns the bytes they held.
    pub(super) fn release_graph_memory(&mut self) -> Result<usize> {
        let g = &mut self.cache.graphs;
        if g.captured.is_empty() {
            return Ok(0);
        }
        g.captured.clear();
        let bytes = self.decoder.backend().graph_release()?;
        g.stats.graph_bytes = g.stats.graph_bytes.max(bytes);
        Ok(bytes)
    }

    /// Sizes every buffer a padded step reads or writes for the largest bucket, once; when
    /// any of them moved since the graphs were captured, the graphs are released (they would
    /// read the old addresses) and get captured again.
    fn prepare_padded(&mut self) -> Result<()> {
        let (rows, width) = (self.cache.graphs.max_rows, self.cache.graphs.width);
        self.decoder.reserve_paged(rows, rows)?;
        self.cache
            .grow_step_buffers(self.decoder.backend(), rows, rows * width)?;
        let now = (self.decoder.workspace_epoch(), self.cache.epoch);
        if self.cache.graphs.epochs != Some(now) {
            if !self.cache.graphs.captured.is_empty() {
                self.cache.graphs.stats.drops += 1;
            }
            self.release_graph_memory()?;
            self.cache.graphs.epochs = Some(now);
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

    /// A pure-decode step padded to `bucket` rows: padding rows feed token 0 at position 0
    /// into the spare block and sample from their own logits; every table is `width` wide
    /// (the rest pointing at the spare block). With `GraphMode::Graphs` the device part is a
    /// graph replay (captured at the bucket's CAPTURE_AT-th step, after eager runs that
    /// compile the kernels, plan the GEMMs and cache the temporaries).
    pub(super) fn submit_padded(
        &mut self,
        chunks: &[Chunk],
        feed: &[Option<u32>],
        rows: &[SampleRow],
        sampling: &SamplingParams,
        bucket: usize,
    ) -> Result<()> {
        let cache = &self.cache;
        let (bs, width) = (cache.block_size(), cache.graphs.width);
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
        let mut out = seq.clone();
        let mut keys = vec![0u32; 2 * bucket];
        let mut positions = vec![0u32; bucket];
        for (i, r) in rows.iter().enumerate() {
            ensure!(r.chunk < n, "sample row names chunk {}", r.chunk);
            out[i] = r.chunk as u32;
            keys[2 * i] = r.key as u32;
            keys[2 * i + 1] = (r.key >> 32) as u32;
            positions[i] = r.position as u32;
        }
        self.prepare_padded()?;
        self.decoder.upload_step(&StepRows {
            ids: &ids,
            positions: &pos,
            cache_rows: &kv_rows,
            table_rows: &seq,
            context: &len,
            sample: &out,
        })?;
        {
            let (b, cache) = (self.decoder.backend(), &mut self.cache);
            b.upload_idx(&mut cache.tables, &tables)?;
            b.upload_idx(&mut cache.keys, &keys)?;
            b.upload_idx(&mut cache.positions, &positions)?;
            cache.upload_feed(b, &fed)?;
        }
        let cache = &mut self.cache;
        cache.max_blocks = width;
        cache.n_tiles = 0;
        cache.decode_rows = bucket;
        let g = &mut cache.graphs;
        g.stats.padding_rows += bucket - n.max(rows.len());
        if g.mode == GraphMode::Graphs {
            let key = (
                bucket,
                sampling.temperature.to_bits(),
                sampling.top_k,
                sampling.top_p.to_bits(),
            );
            let found = g
                .captured
                .iter()
                .find(|(k, _)| *k == key)
                .map(|&(_, id)| id);
            let uses = match g.uses.iter_mut().find(|(k, _)| *k == key) {
                Some((_, u)) => {
                    *u += 1;
                    *u
                }
                None => {
                    g.uses.push((key, 1));
                    1
                }
            };
            if found.is_none() && uses < CAPTURE_AT {
                self.decode_body(bucket, sampling)?;
                self.cache.graphs.stats.padded_steps += 1;
                return self.cache.start_draws(self.decoder.backend(), rows.len());
            }
            let id = match found {
                Some(id) => id,
                None => {
                    let t0 = std::time::Instant::now();
                    let b = self.decoder.backend();
                    b.synchronize()?;
                    b.graph_begin()?;
                    let body = self.decode_body(bucket, sampling);
                    let id = self.decoder.backend().graph_end();
                    body?;
                    let id = id?;
                    let g = &mut self.cache.graphs;
                    g.captured.push((key, id));
                    g.stats.captures += 1;
                    g.stats.capture_us += t0.elapsed().as_micros() as u64;
                    id
                }
            };
            self.decoder.backend().graph_launch(id)?;
            self.cache.graphs.stats.replays += 1;
        } else {
            self.decode_body(bucket, sampling)?;
            self.cache.graphs.stats.padded_steps += 1;
        }
        self.cache.start_draws(self.decoder.backend(), rows.len())
    }
}
