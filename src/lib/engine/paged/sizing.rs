//! How big the engine makes itself for a set of requests: the seats, the KV pool (from the free
//! device memory, never more than every running sample at its longest needs), the workspace of
//! the largest step and the fixed table width of graph-replayed decode steps. The rollout stage
//! and `bench rollout` both size their engines here.

use anyhow::Result;

use super::request::{GenParams, Request};
use super::runner::PagedDecoder;
use super::{GraphMode, PagedConfig, DEFAULT_BLOCK_SIZE};
use crate::backend::Backend;
use crate::model::decoder::Decoder;

/// What a generation may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Samples running at once (vLLM's max_num_seqs).
    pub max_num_seqs: usize,
    /// Tokens run in one step.
    pub max_batched_tokens: usize,
    /// Fraction of the device memory still free after the weights and the workspace of the
    /// largest step that the pool takes; None: the pool is what every running sample needs at
    /// its longest, whatever the memory (benchmarks), and no workspace is reserved up front.
    pub gpu_memory_fraction: Option<f64>,
    /// Replay pure-decode steps as CUDA graphs (where the backend has them).
    pub graphs: bool,
    /// Overlap scheduling (see `PagedConfig::overlap`).
    pub overlap: bool,
}

/// What a set of requests asks of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    pub samples: usize,
    pub longest_prompt: usize,
    pub prompt_tokens: usize,
    pub max_new_tokens: usize,
}

impl Need {
    pub fn of(requests: &[Request], params: &GenParams) -> Need {
        Need {
            samples: requests.iter().map(|r| r.sample_keys.len()).sum(),
            longest_prompt: requests.iter().map(|r| r.prompt.len()).max().unwrap_or(1),
            prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
            max_new_tokens: params.max_new_tokens,
        }
    }
}

/// The engine's size for one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub config: PagedConfig,
    /// Samples that can run at once: --max-num-seqs, never more than there are (at least 1).
    pub seqs: usize,
    /// Blocks of the longest sequence: the fixed table width of a padded decode step.
    pub width: usize,
    /// Bytes of one block over every layer (keys and values).
    pub block_bytes: usize,
}

impl Plan {
    /// Bytes the KV pool takes.
    pub(crate) fn kv_pool_bytes(&self) -> usize {
        self.config.num_blocks * self.block_bytes
    }
}

/// Blocks every running sample needs at its longest, plus a copy of a partial prompt block each
/// (more could not be used).
fn cap_blocks(need: &Need, seqs: usize, block_size: usize) -> usize {
    seqs * (width(need, block_size) + 1)
}

/// Blocks of the longest sequence the requests can make.
fn width(need: &Need, block_size: usize) -> usize {
    (need.longest_prompt + need.max_new_tokens).div_ceil(block_size)
}

/// Samples that can run at once.
fn seats(need: &Need, limits: &Limits) -> usize {
    limits.max_num_seqs.min(need.samples).max(1)
}

/// Tokens of the largest step the engine can run: every prompt and every sample's tokens at
/// once, never more than --max-batched-tokens.
fn workspace_tokens(need: &Need, limits: &Limits) -> usize {
    let most = need.prompt_tokens + seats(need, limits) * (need.max_new_tokens + 1);
    limits.max_batched_tokens.min(most)
}

/// Blocks a pool gets: `fraction` of the free device memory when the backend reports it (the
/// GPU), divided by the bytes of one block over every layer, never more than `cap` (what every
/// sequence at its longest needs at once: more could not be used). Without device memory
/// figures (the CPU) the pool is `cap`.
fn pool_blocks(
    free_bytes: Option<usize>,
    fraction: f64,
    bytes_per_block: usize,
    cap: usize,
) -> usize {
    match free_bytes {
        Some(free) => (((free as f64) * fraction) as usize / bytes_per_block.max(1)).min(cap),
        None => cap,
    }
}

impl Plan {
    /// The plan for `need` within `limits`, with `free_bytes` of device memory left once the
    /// workspace is reserved (None: the backend does not say) and blocks of `block_bytes`.
    pub fn new(
        need: &Need,
        limits: &Limits,
        free_bytes: Option<usize>,
        block_bytes: usize,
    ) -> Plan {
        let bs = DEFAULT_BLOCK_SIZE;
        let seqs = seats(need, limits);
        let cap = cap_blocks(need, seqs, bs);
        let num_blocks = match limits.gpu_memory_fraction {
            Some(f) => pool_blocks(free_bytes, f, block_bytes, cap),
            None => cap,
        };
        Plan {
            config: PagedConfig {
                block_size: bs,
                num_blocks: num_blocks.max(1),
                max_num_seqs: limits.max_num_seqs,
                max_batched_tokens: limits.max_batched_tokens,
                overlap: limits.overlap,
            },
            seqs,
            width: width(need, bs),
            block_bytes,
        }
    }
}

impl<'a, B: Backend> PagedDecoder<'a, B> {
    /// The engine for `requests` within `limits` on `decoder`: the workspace of the largest
    /// step reserved first (when the pool is sized from the free memory, so it is sized from
    /// what is left), the pool allocated, the decode graphs switched on. Returns it with its
    /// plan (whose `config` the generation runs with).
    pub fn sized(
        decoder: &'a mut Decoder<B>,
        requests: &[Request],
        params: &GenParams,
        limits: &Limits,
    ) -> Result<(Self, Plan)> {
        let need = Need::of(requests, params);
        let mut free = None;
        if limits.gpu_memory_fraction.is_some() {
            decoder.reserve_paged(workspace_tokens(&need, limits), seats(&need, limits))?;
            free = decoder.backend().device_memory()?.map(|(f, _)| f);
        }
        let block_bytes = PagedDecoder::block_bytes(decoder, DEFAULT_BLOCK_SIZE);
        let plan = Plan::new(&need, limits, free, block_bytes);
        let c = &plan.config;
        let mut engine = PagedDecoder::new(decoder, c.num_blocks, c.block_size)?;
        if limits.graphs {
            engine.set_graphs(GraphMode::Graphs, plan.seqs, plan.width)?;
        }
        Ok((engine, plan))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEED: Need = Need {
        samples: 24,
        longest_prompt: 40,
        prompt_tokens: 100,
        max_new_tokens: 200,
    };

    fn limits(fraction: Option<f64>) -> Limits {
        Limits {
            max_num_seqs: 16,
            max_batched_tokens: 8192,
            gpu_memory_fraction: fraction,
            graphs: true,
            overlap: true,
        }
    }

    #[test]
    fn the_cap_is_every_running_sample_at_its_longest_plus_a_copy_block() {
        // 16 seats (of 24 samples); 40 + 200 = 240 positions = 15 blocks of 16, + 1 copy.
        let p = Plan::new(&NEED, &limits(None), Some(1 << 40), 1000);
        assert_eq!((p.seqs, p.width), (16, 15));
        assert_eq!(p.config.num_blocks, 16 * 16);
        assert_eq!(p.kv_pool_bytes(), 256_000);
        assert_eq!(p.config.max_num_seqs, 16, "the flag, not the seats");
        // Fewer samples than seats: the samples.
        let few = Need { samples: 3, ..NEED };
        assert_eq!(
            Plan::new(&few, &limits(None), None, 1).config.num_blocks,
            48
        );
    }

    #[test]
    fn the_pool_takes_its_fraction_of_the_free_memory_within_the_cap() {
        // 0.5 of 10,000 bytes in blocks of 1,000: 5 blocks.
        let p = Plan::new(&NEED, &limits(Some(0.5)), Some(10_000), 1000);
        assert_eq!(p.config.num_blocks, 5);
        // Plenty of memory: the cap.
        let p = Plan::new(&NEED, &limits(Some(0.9)), Some(1 << 40), 1000);
        assert_eq!(p.config.num_blocks, 256);
        // No memory figures (the CPU): the cap; less than a block: still one.
        assert_eq!(
            Plan::new(&NEED, &limits(Some(0.9)), None, 1000)
                .config
                .num_blocks,
            256
        );
        assert_eq!(
            Plan::new(&NEED, &limits(Some(0.9)), Some(999), 1000)
                .config
                .num_blocks,
            1
        );
        assert_eq!(
            pool_blocks(Some(1000), 1.0, 0, 7),
            7,
            "zero-byte blocks divide by 1"
        );
    }

    #[test]
    fn the_workspace_is_the_largest_step() {
        // Every prompt and 16 samples of 201 tokens: 100 + 3216, under 8192.
        assert_eq!(workspace_tokens(&NEED, &limits(None)), 3316);
        let tight = Limits {
            max_batched_tokens: 1000,
            ..limits(None)
        };
        assert_eq!(workspace_tokens(&NEED, &tight), 1000);
        // No samples: one seat.
        let none = Need { samples: 0, ..NEED };
        assert_eq!(Plan::new(&none, &limits(None), None, 1).seqs, 1);
    }
}
