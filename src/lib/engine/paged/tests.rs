//! The paged engine against the contiguous-cache generator: a toy model whose logits hash the
//! whole context *as read back through the block tables* (a wrong table, a missing fork copy
//! or a stale block changes the tokens), random workloads with small pools (preemption,
//! chunked prefill), and the real decoder on the CPU backend.

use super::*;
use crate::backend::cpu::Cpu;
use crate::engine::generate::{
    generate, CachedDecoder, Completion, FinishReason, GenParams, Request, StepModel,
};
use crate::engine::sampling::{sample, sample_key, uniform, Scratch};
use crate::model::init::random_weights;
use crate::model::{Arch, Config};
use crate::rng::SplitMix64;

fn toy_logits(vocab: usize, ctx: &[u32]) -> Vec<f32> {
    let mut h = 1469598103934665603u64;
    for &t in ctx {
        h = (h ^ t as u64).wrapping_mul(1099511628211);
    }
    (0..vocab)
        .map(|v| {
            let x = (h ^ v as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Paged toy: the cache holds the token at each (block, offset).
struct PagedToy {
    vocab: usize,
    bs: usize,
    cache: Vec<Option<u32>>,
    steps: Vec<(usize, usize)>, // (chunks, tokens) per step
}

impl PagedToy {
    fn new(vocab: usize, cfg: &PagedConfig) -> Self {
        PagedToy {
            vocab,
            bs: cfg.block_size,
            cache: vec![None; cfg.num_blocks * cfg.block_size],
            steps: vec![],
        }
    }
}

impl PagedModel for PagedToy {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn step(
        &mut self,
        chunks: &[Chunk],
        rows: &[SampleRow],
        sampling: &SamplingParams,
    ) -> Result<Vec<Sampled>> {
        self.steps
            .push((chunks.len(), chunks.iter().map(|c| c.tokens.len()).sum()));
        let row = |t: &[u32], p: usize| blocks::cache_row(t, self.bs, p);
        for c in chunks {
            for (i, &t) in c.tokens.iter().enumerate() {
                let r = row(c.table, c.start + i);
                self.cache[r] = Some(t);
            }
        }
        let mut out = vec![];
        for r in rows {
            let c = &chunks[r.chunk];
            let len = c.start + c.tokens.len();
            let ctx: Vec<u32> = (0..len)
                .map(|p| self.cache[row(c.table, p)].expect("a position never written"))
                .collect();
            let logits = toy_logits(self.vocab, &ctx);
            out.push(sample(
                &logits,
                sampling,
                uniform(r.key, r.position),
                &mut Scratch::default(),
            )?);
        }
        Ok(out)
    }
    fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        for &(s, d) in pairs {
            for o in 0..self.bs {
                self.cache[d as usize * self.bs + o] = self.cache[s as usize * self.bs + o];
            }
        }
        Ok(())
    }
}

/// The contiguous toy for the reference generator.
struct SlotToy {
    vocab: usize,
    slots: Vec<Vec<u32>>,
    max_len: usize,
}

impl StepModel for SlotToy {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn capacity(&self) -> (usize, usize) {
        (self.slots.len(), self.max_len)
    }
    fn prefill(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.slots[slot] = tokens.to_vec();
        Ok(toy_logits(self.vocab, tokens))
    }
    fn decode(&mut self, slots: &[usize], tokens: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![];
        for (&s, &t) in slots.iter().zip(tokens) {
            self.slots[s].push(t);
            out.extend(toy_logits(self.vocab, &self.slots[s]));
        }
        Ok(out)
    }
    fn fork(&mut self, from: usize, to: usize) -> Result<()> {
        self.slots[to] = self.slots[from].clone();
        Ok(())
    }
    fn free(&mut self, slot: usize) {
        self.slots[slot].clear();
    }
}

fn reference(vocab: usize, reqs: &[Request], p: &GenParams) -> Vec<Vec<Completion>> {
    let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap_or(1);
    let mut toy = SlotToy {
        vocab,
        slots: vec![vec![]; 4],
        max_len: longest + p.max_new_tokens,
    };
    generate(&mut toy, reqs, p, None, &mut |_| {}).unwrap().0
}

fn request(seed: u64, prompt: Vec<u32>, n: u64) -> Request {
    let keys = (0..n).map(|s| sample_key(seed, &prompt, 0, s)).collect();
    Request {
        prompt,
        sample_keys: keys,
    }
}

fn params(max_new: usize, stop: Vec<u32>) -> GenParams {
    GenParams {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
        },
        max_new_tokens: max_new,
        stop_token_ids: stop,
        stop_strings: vec![],
    }
}

#[test]
fn random_workloads_match_the_contiguous_generator_and_return_every_block() {
    let mut g = SplitMix64(7);
    let mut preempted_cases = 0;
    let mut chunked_cases = 0;
    let mut overlapped_cases = 0;
    let mut discarded_cases = 0;
    for case in 0..60 {
        let vocab = 20 + g.below(30) as usize;
        let n_req = 1 + g.below(6) as usize;
        let max_new = 1 + g.below(24) as usize;
        let reqs: Vec<Request> = (0..n_req)
            .map(|i| {
                let len = 1 + g.below(40) as usize;
                let prompt = (0..len).map(|_| g.below(vocab as u64) as u32).collect();
                request(case * 100 + i as u64, prompt, 1 + g.below(5))
            })
            .collect();
        // Stop ids on some cases: random stops shorten some samples.
        let stop = if g.below(2) == 0 {
            vec![g.below(vocab as u64) as u32]
        } else {
            vec![]
        };
        let p = params(max_new, stop);
        let bs = [1usize, 2, 4, 16][g.below(4) as usize];
        let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap();
        // The smallest legal pool (the longest sample alone) up to plenty.
        let min_blocks = (longest + max_new - 1).div_ceil(bs);
        let cfg = PagedConfig {
            block_size: bs,
            num_blocks: min_blocks + g.below(3 * min_blocks as u64 + 1) as usize,
            max_num_seqs: 1 + g.below(12) as usize,
            max_batched_tokens: 0,
            overlap: true,
        };
        let cfg = PagedConfig {
            max_batched_tokens: cfg.max_num_seqs + g.below(48) as usize,
            overlap: true,
            ..cfg
        };
        let want = reference(vocab, &reqs, &p);
        // With and without overlap scheduling: the same completions.
        let mut stats_of = Vec::new();
        for overlap in [false, true] {
            let cfg = PagedConfig { overlap, ..cfg };
            let mut toy = PagedToy::new(vocab, &cfg);
            let mut seen = 0;
            let (got, stats) = generate_paged(&mut toy, &cfg, &reqs, &p, None, &mut |n| seen = n)
                .unwrap_or_else(|e| panic!("case {case} {cfg:?}: {e:#}"));
            assert_eq!(got, want, "case {case}: {cfg:?}");
            let total: usize = reqs.iter().map(|r| r.sample_keys.len()).sum();
            assert_eq!(seen, total, "progress reached every sample");
            assert_eq!(stats.blocks_in_use_at_end, 0, "case {case}: blocks leaked");
            assert!(stats.peak_blocks_in_use <= cfg.num_blocks);
            for &(chunks, tokens) in &toy.steps {
                assert!(
                    tokens <= cfg.max_batched_tokens,
                    "case {case}: {tokens} tokens"
                );
                assert!(
                    chunks <= cfg.max_num_seqs,
                    "case {case}: {chunks} sequences"
                );
            }
            stats_of.push(stats);
        }
        assert_eq!(stats_of[0].overlapped_steps, 0);
        overlapped_cases += usize::from(stats_of[1].overlapped_steps > 0);
        discarded_cases += usize::from(stats_of[1].overlap_discarded > 0);
        let stats = stats_of[0];
        preempted_cases += usize::from(stats.preemptions > 0);
        chunked_cases += usize::from(longest > cfg.max_batched_tokens);
    }
    // The random cases do exercise the hard paths.
    assert!(preempted_cases >= 3, "{preempted_cases} cases preempted");
    assert!(chunked_cases >= 3, "{chunked_cases} cases chunked a prompt");
    assert!(
        overlapped_cases >= 20,
        "{overlapped_cases} cases queued steps ahead"
    );
    // ... including steps queued for samples that a stop id then ended.
    assert!(
        discarded_cases >= 3,
        "{discarded_cases} cases threw queued tokens away"
    );
}

#[test]
fn n_samples_share_one_prefill_and_the_prompt_blocks() {
    let cfg = PagedConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 16,
        max_batched_tokens: 64,
        overlap: false,
    };
    // Prompt of 10 tokens: 2 full blocks shared by all 8 samples, the partial one copied 7x.
    let reqs = [request(1, (0..10).collect(), 8), request(2, vec![3; 4], 4)];
    let p = params(6, vec![]);
    let mut toy = PagedToy::new(30, &cfg);
    let (got, stats) = generate_paged(&mut toy, &cfg, &reqs, &p, None, &mut |_| {}).unwrap();
    assert_eq!(got, reference(30, &reqs, &p));
    assert_eq!(stats.gen.prefills, 2);
    assert_eq!(stats.gen.prefill_tokens, 14);
    assert_eq!(stats.preemptions, 0);
    // 3 prompt blocks + 7 copies + the second prompt's block, then decode growth: 12 samples.
    // Each sample of the first prompt grows from 10 to 15 positions (4 blocks: 2 shared + 2
    // own), each of the second from 4 to 9 (3 blocks: 1 shared + 2 own).
    assert_eq!(stats.peak_blocks_in_use, 2 + 8 * 2 + 1 + 4 * 2);
    assert_eq!(stats.blocks_in_use_at_end, 0);
    // The first step prefills both prompts together, then 12 samples decode together.
    assert_eq!(toy.steps[0], (2, 14));
    assert_eq!(toy.steps[1], (12, 12));
}

#[test]
fn a_prompt_waits_for_seats_for_all_its_samples_while_others_run() {
    // 6 seats, 4 samples per prompt: the second prompt must not start with the 2 free seats
    // (its other samples would need a prefill of their own later).
    let cfg = PagedConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 6,
        max_batched_tokens: 64,
        overlap: true,
    };
    let reqs = [
        request(1, (0..7).collect(), 4),
        request(2, vec![5; 9], 4),
        request(3, vec![2, 9, 4], 4),
    ];
    let p = params(8, vec![3, 11, 17]);
    let mut toy = PagedToy::new(30, &cfg);
    let (got, stats) = generate_paged(&mut toy, &cfg, &reqs, &p, None, &mut |_| {}).unwrap();
    assert_eq!(got, reference(30, &reqs, &p));
    assert_eq!(stats.gen.prefills, 3);
    assert_eq!(stats.gen.prefill_tokens, 7 + 9 + 3);
    assert_eq!(stats.blocks_in_use_at_end, 0);
    // More samples than seats: the prompt starts with what fits, the rest follow.
    let cfg = PagedConfig {
        max_num_seqs: 3,
        ..cfg
    };
    let mut toy = PagedToy::new(30, &cfg);
    let (got, stats) = generate_paged(&mut toy, &cfg, &reqs[..1], &p, None, &mut |_| {}).unwrap();
    assert_eq!(got, reference(30, &reqs[..1], &p));
    assert_eq!(stats.gen.prefills, 2);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_beside_the_decodes() {
    let cfg = PagedConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 4,
        max_batched_tokens: 8,
        overlap: false,
    };
    let reqs = [request(1, vec![1, 2], 1), request(2, (0..30).collect(), 1)];
    let p = params(10, vec![]);
    let mut toy = PagedToy::new(30, &cfg);
    let (got, _) = generate_paged(&mut toy, &cfg, &reqs, &p, None, &mut |_| {}).unwrap();
    assert_eq!(got, reference(30, &reqs, &p));
    // Step 0: prompt 1 (2) + 6 of prompt 2; then 1 decode + 7 prompt tokens per step.
    assert_eq!(toy.steps[0], (2, 8));
    assert_eq!(toy.steps[1], (2, 8));
    assert!(toy.steps.iter().all(|&(_, t)| t <= 8));
}

#[test]
fn a_pool_too_small_for_one_sample_is_refused_up_front() {
    let cfg = PagedConfig {
        block_size: 4,
        num_blocks: 3,
        max_num_seqs: 4,
        max_batched_tokens: 16,
        overlap: true,
    };
    // 10 + 4 − 1 = 13 positions need 4 blocks.
    let reqs = [request(1, (0..10).collect(), 2)];
    let mut toy = PagedToy::new(30, &cfg);
    let err = generate_paged(&mut toy, &cfg, &reqs, &params(4, vec![]), None, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("needs 4 KV blocks of 4 tokens, the pool has 3"),
        "{err}"
    );
    // 3 new tokens fit exactly (12 positions), even for 2 samples: they take turns.
    let (got, stats) =
        generate_paged(&mut toy, &cfg, &reqs, &params(3, vec![]), None, &mut |_| {}).unwrap();
    assert_eq!(got, reference(30, &reqs, &params(3, vec![])));
    assert_eq!(stats.blocks_in_use_at_end, 0);
    let bad = PagedConfig {
        max_batched_tokens: 2,
        overlap: true,
        ..cfg
    };
    let err = generate_paged(&mut toy, &bad, &reqs, &params(3, vec![]), None, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--max-batched-tokens (2) must be >= --max-num-seqs (4)"),
        "{err}"
    );
}

#[test]
fn stop_ids_and_strings_end_samples_as_in_the_generator() {
    let detok = |ids: &[u32]| -> Result<String> {
        Ok(ids
            .iter()
            .map(|&t| (b'a' + (t % 26) as u8) as char)
            .collect())
    };
    let reqs = [request(4, vec![1, 2, 3], 3), request(5, vec![7], 2)];
    let p = GenParams {
        stop_strings: vec!["b".into(), "zq".into()],
        ..params(30, vec![5])
    };
    let cfg = PagedConfig {
        block_size: 2,
        num_blocks: 40,
        max_num_seqs: 3,
        max_batched_tokens: 4,
        overlap: true,
    };
    let mut toy = PagedToy::new(26, &cfg);
    let (got, _) = generate_paged(&mut toy, &cfg, &reqs, &p, Some(&detok), &mut |_| {}).unwrap();
    let mut slot = SlotToy {
        vocab: 26,
        slots: vec![vec![]; 2],
        max_len: 40,
    };
    let want = generate(&mut slot, &reqs, &p, Some(&detok), &mut |_| {})
        .unwrap()
        .0;
    assert_eq!(got, want);
    assert!(got.iter().flatten().any(|c| c.finish == FinishReason::Stop));
}

fn tiny_config() -> Config {
    Config {
        arch: Arch::Qwen2,
        vocab_size: 97,
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        qkv_bias: true,
        qk_norm: false,
        max_position_embeddings: 512,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

#[test]
fn paged_decoder_on_the_cpu_equals_the_contiguous_decoder() {
    let cfg = tiny_config();
    let weights = random_weights(&cfg, 11, 0.2);
    let reqs = [
        request(1, vec![5, 9, 13, 2, 40, 41, 42], 3),
        request(2, vec![1; 19], 2),
        request(3, vec![88], 2),
    ];
    for sampling in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
        },
    ] {
        let p = GenParams {
            sampling,
            ..params(12, vec![3])
        };
        let mut old = Decoder::new(Cpu, &cfg, &weights).unwrap();
        let mut slots = CachedDecoder::new(&mut old, cfg.vocab_size, 3, 32).unwrap();
        let want = generate(&mut slots, &reqs, &p, None, &mut |_| {})
            .unwrap()
            .0;
        // A small pool (preemption) and prompts split over steps; with overlap scheduling the
        // decoder queues steps whose tokens it reads from the draws of the step before.
        for overlap in [false, true] {
            let pc = PagedConfig {
                block_size: 4,
                num_blocks: 12,
                max_num_seqs: 5,
                max_batched_tokens: 8,
                overlap,
            };
            let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
            let mut paged = PagedDecoder::new(&mut dec, pc.num_blocks, pc.block_size).unwrap();
            let (got, stats) =
                generate_paged(&mut paged, &pc, &reqs, &p, None, &mut |_| {}).unwrap();
            // The same tokens; log-probs to rounding (the CPU GEMM blocks rows differently for
            // a different number of rows per call, so the last bits of a logit may differ).
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert_eq!((&g.tokens, g.finish), (&w.tokens, w.finish), "{sampling:?}");
                for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
                    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
                }
            }
            assert_eq!(stats.blocks_in_use_at_end, 0);
            assert!(stats.preemptions > 0, "the small pool preempts");
            assert_eq!(stats.overlapped_steps > 0, overlap, "{stats:?}");
        }
    }
}

#[test]
fn decode_buckets_are_powers_of_two_and_their_three_quarters() {
    let got: Vec<usize> = [1, 2, 3, 5, 16, 17, 24, 25, 33, 48, 49, 200, 256, 257]
        .iter()
        .map(|&n| decode_bucket(n))
        .collect();
    assert_eq!(got, [1, 2, 4, 8, 16, 24, 24, 32, 48, 48, 64, 256, 256, 384]);
    for n in 1..2000 {
        let b = decode_bucket(n);
        assert!(b >= n && (n <= 16 || 2 * b < 3 * n), "{n} -> {b}");
    }
}

/// The decode steps padded as for a CUDA graph (rows to the bucket, padding rows in the
/// spare block, tables to a fixed width) sample what the unpadded steps sample; tables wider
/// than the fixed width and prefill steps run unpadded; `Graphs` on the CPU is eager.
#[test]
fn padded_decode_steps_sample_what_the_eager_steps_sample() {
    let cfg = tiny_config();
    let weights = random_weights(&cfg, 12, 0.2);
    let reqs: Vec<Request> = (0..5)
        .map(|i| {
            request(
                i,
                (0..3 + 7 * i as u32).map(|t| (t * 13 + 5) % 97).collect(),
                3,
            )
        })
        .collect();
    let p = params(40, vec![3, 50]);
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 60,
        max_num_seqs: 11,
        max_batched_tokens: 16,
        overlap: true,
    };
    let run = |mode: GraphMode, width: usize| {
        let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
        let mut eng = PagedDecoder::new(&mut dec, pc.num_blocks, pc.block_size).unwrap();
        eng.set_graphs(mode, pc.max_num_seqs, width).unwrap();
        let (done, stats) = generate_paged(&mut eng, &pc, &reqs, &p, None, &mut |_| {}).unwrap();
        assert_eq!(stats.blocks_in_use_at_end, 0);
        (done, eng.release_graphs().unwrap())
    };
    let (want, eager) = run(GraphMode::Eager, 0);
    assert_eq!((eager.padded_steps, eager.replays), (0, 0));
    let longest: usize = (3 + 7 * 4) + 40;
    let mut eager_at = Vec::new();
    for width in [longest.div_ceil(4), 12] {
        let (got, st) = run(GraphMode::Padded, width);
        assert!(st.padded_steps > 0 && st.padding_rows > 0, "{st:?}");
        assert!(st.eager_steps > 0, "prefill steps stay eager: {st:?}");
        assert_eq!(st.padded_steps + st.eager_steps, eager.eager_steps);
        eager_at.push(st.eager_steps);
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert_eq!((&g.tokens, g.finish), (&w.tokens, w.finish));
            for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }
    // Tables past 12 blocks (48 positions) cannot be padded to 12: those steps run eagerly.
    assert!(eager_at[1] > eager_at[0], "{eager_at:?}");
    let (got, st) = run(GraphMode::Graphs, longest.div_ceil(4));
    assert_eq!((st.replays, st.captures, st.padded_steps), (0, 0, 0));
    assert_eq!(got, want);
}
