//! Decode graphs: pure-decode steps (every chunk one token) padded to a bucket of rows and a
//! fixed table width, so that their kernels have fixed shapes and read fixed buffers, and
//! captured once per (bucket, sampling) as a CUDA graph, then replayed. A padded step run
//! eagerly (`GraphMode::Padded`) is the reference a replay must equal bit for bit. This file
//! keeps the graphs' state and decides how each padded step runs; the runner builds, uploads,
//! captures and replays the steps (`runner::PagedDecoder::submit_padded`).

use super::{Chunk, SampleRow};
use crate::backend::ops::sample::SamplingParams;

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
pub(super) type GraphKey = (usize, u32, i64, u32);

/// The decode graphs of one paged cache and how its pure-decode steps run.
#[derive(Debug, Default)]
pub(super) struct DecodeGraphs {
    mode: GraphMode,
    /// Blocks per table of a padded step (longest sequence the engine may run).
    width: usize,
    /// Largest bucket: steps with more rows run eagerly.
    max_rows: usize,
    /// Captured graphs by key → graph id.
    captured: Vec<(GraphKey, usize)>,
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
pub(crate) fn decode_bucket(rows: usize) -> usize {
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

/// How the device part of a padded decode step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PaddedRun {
    /// Eagerly: padding only (`GraphMode::Padded`), or a bucket's steps before its capture.
    Eager,
    /// Captured now as the graph of this key, then replayed.
    Capture(GraphKey),
    /// Replayed from this graph.
    Replay(usize),
}

impl DecodeGraphs {
    /// Pure-decode steps of up to `max_rows` sequences whose tables have at most `max_blocks`
    /// blocks run as `mode` says (the graphs captured before must be released).
    pub(super) fn configure(&mut self, mode: GraphMode, max_rows: usize, max_blocks: usize) {
        self.mode = mode;
        self.max_rows = decode_bucket(max_rows.max(1));
        self.width = max_blocks.max(1);
        self.epochs = None;
    }

    /// Largest bucket and table width of a padded step.
    pub(super) fn max_rows(&self) -> usize {
        self.max_rows
    }
    pub(super) fn width(&self) -> usize {
        self.width
    }

    /// The graph captured first, if any.
    pub(super) fn first(&self) -> Option<usize> {
        self.captured.first().map(|&(_, id)| id)
    }

    /// Forgets the captured graphs (the caller gives their memory back); whether there were any.
    pub(super) fn forget(&mut self) -> bool {
        let any = !self.captured.is_empty();
        self.captured.clear();
        any
    }

    /// Whether the buffers a padded step reads moved since the graphs were captured (`now`:
    /// the workspace and cache epochs): then the graphs must be released, and are counted as
    /// dropped.
    pub(super) fn moved(&mut self, now: (u64, u64)) -> bool {
        if self.epochs == Some(now) {
            return false;
        }
        if !self.captured.is_empty() {
            self.stats.drops += 1;
        }
        self.epochs = Some(now);
        true
    }

    /// How the next padded step of `bucket` rows drawing with `sampling` runs; counts it.
    pub(super) fn next_run(&mut self, bucket: usize, sampling: &SamplingParams) -> PaddedRun {
        if self.mode != GraphMode::Graphs {
            return PaddedRun::Eager;
        }
        let key = (
            bucket,
            sampling.temperature.to_bits(),
            sampling.top_k,
            sampling.top_p.to_bits(),
        );
        let found = self
            .captured
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, id)| id);
        let uses = match self.uses.iter_mut().find(|(k, _)| *k == key) {
            Some((_, u)) => {
                *u += 1;
                *u
            }
            None => {
                self.uses.push((key, 1));
                1
            }
        };
        match found {
            Some(id) => PaddedRun::Replay(id),
            None if uses < CAPTURE_AT => PaddedRun::Eager,
            None => PaddedRun::Capture(key),
        }
    }

    /// Graph `id` was captured for `key` in `us` microseconds.
    pub(super) fn captured_as(&mut self, key: GraphKey, id: usize, us: u64) {
        self.captured.push((key, id));
        self.stats.captures += 1;
        self.stats.capture_us += us;
    }
}
