//! The paged engine against a reference that generates each sample alone, token by token (the
//! definition of what a sample is: draws from the model's logits of its context with the
//! counter-based uniform of its position, until the stop rule ends it): a toy model whose
//! logits hash the whole context *as read back through the block tables* (a wrong table, a
//! missing fork copy or a stale block changes the tokens), random workloads with small pools
//! (preemption, chunked prefill), and the real decoder on the CPU backend against the training
//! forward's log-probs.

use super::graphs::decode_bucket;
use super::*;
use crate::backend::cpu::Cpu;
use crate::backend::ops::sample::{sample, sample_key, uniform, Scratch};
use crate::model::decoder::{Decoder, SeqRef};
use crate::model::init::random_weights;
use crate::model::Config;
use crate::rng::SplitMix64;

pub(super) fn toy_logits(vocab: usize, ctx: &[u32]) -> Vec<f32> {
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

/// Paged toy: the cache holds the token at each (block, offset). A salt stands for other
/// weights (another policy version): the logits hash it before the context.
pub(super) struct PagedToy {
    vocab: usize,
    bs: usize,
    cache: Vec<Option<u32>>,
    steps: Vec<(usize, usize)>, // (chunks, tokens) per step
    salt: Option<u32>,
}

impl PagedToy {
    pub(super) fn new(vocab: usize, cfg: &PagedConfig) -> Self {
        PagedToy {
            vocab,
            bs: cfg.block_size,
            cache: vec![None; cfg.num_blocks * cfg.block_size],
            steps: vec![],
            salt: None,
        }
    }

    pub(super) fn with_salt(self, salt: u32) -> Self {
        PagedToy {
            salt: Some(salt),
            ..self
        }
    }

    /// What the logits of a toy with `salt` hash: the salt, then the context.
    pub(super) fn salted_ctx(salt: Option<u32>, ctx: &[u32]) -> Vec<u32> {
        salt.into_iter().chain(ctx.iter().copied()).collect()
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
            let logits = toy_logits(self.vocab, &Self::salted_ctx(self.salt, &ctx));
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

/// Every sample of every request generated alone: draw after draw from the toy's logits of
/// the sample's context, with the uniform of its key and position, until `GenParams::finish`
/// or the sample's own limit.
fn reference(
    vocab: usize,
    reqs: &[Request],
    p: &GenParams,
    detok: Option<Detokenize>,
) -> Vec<Vec<Completion>> {
    reqs.iter()
        .map(|r| {
            r.sample_keys
                .iter()
                .enumerate()
                .map(|(j, &key)| {
                    let limit = r.sample_limit(j).unwrap_or(usize::MAX);
                    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
                    let (finish, cut) = loop {
                        if p.max_new_tokens == 0 {
                            break (FinishReason::Length, None);
                        }
                        let ctx: Vec<u32> = r.prompt.iter().chain(&tokens).copied().collect();
                        let u = uniform(key, tokens.len() as u64);
                        let d = sample(
                            &toy_logits(vocab, &ctx),
                            &p.sampling,
                            u,
                            &mut Scratch::default(),
                        )
                        .unwrap();
                        tokens.push(d.token);
                        logprobs.push(d.logprob);
                        if let Some(end) = p.finish(&tokens, detok).unwrap() {
                            break end;
                        }
                        if tokens.len() >= limit {
                            break (FinishReason::Length, None);
                        }
                    };
                    let text = match (cut, detok) {
                        (Some(t), _) => t,
                        (None, Some(d)) => d(&tokens).unwrap(),
                        (None, None) => String::new(),
                    };
                    Completion {
                        tokens,
                        logprobs,
                        finish,
                        text,
                        trajectory: None,
                    }
                })
                .collect()
        })
        .collect()
}

fn request(seed: u64, prompt: Vec<u32>, n: u64) -> Request {
    let keys = (0..n).map(|s| sample_key(seed, &prompt, 0, s)).collect();
    Request {
        max_new: Vec::new(),
        prompt,
        sample_keys: keys,
    }
}

pub(super) fn params(max_new: usize, stop: Vec<u32>) -> GenParams {
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
fn random_workloads_match_the_reference_and_return_every_block() {
    let mut g = SplitMix64(7);
    let mut preempted_cases = 0;
    let mut chunked_cases = 0;
    let mut overlapped_cases = 0;
    let mut discarded_cases = 0;
    let mut limited_cases = 0;
    for case in 0..60 {
        let vocab = 20 + g.below(30) as usize;
        let n_req = 1 + g.below(6) as usize;
        let max_new = 1 + g.below(24) as usize;
        let mut reqs: Vec<Request> = (0..n_req)
            .map(|i| {
                let len = 1 + g.below(40) as usize;
                let prompt = (0..len).map(|_| g.below(vocab as u64) as u32).collect();
                request(case * 100 + i as u64, prompt, 1 + g.below(5))
            })
            .collect();
        // Each sample's own length limit on a third of the cases (a generator of their own:
        // the other cases stay as they were).
        let mut h = SplitMix64(case + 991);
        if h.below(3) == 0 {
            limited_cases += 1;
            for r in &mut reqs {
                r.max_new = r
                    .sample_keys
                    .iter()
                    .map(|_| 1 + h.below(max_new as u64) as usize)
                    .collect();
            }
        }
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
        let want = reference(vocab, &reqs, &p, None);
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
    assert!(limited_cases >= 10, "{limited_cases} cases had limits");
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
    assert_eq!(got, reference(30, &reqs, &p, None));
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
    assert_eq!(got, reference(30, &reqs, &p, None));
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
    assert_eq!(got, reference(30, &reqs[..1], &p, None));
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
    assert_eq!(got, reference(30, &reqs, &p, None));
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
    assert_eq!(got, reference(30, &reqs, &params(3, vec![]), None));
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
fn stop_ids_and_strings_end_samples_as_in_the_reference() {
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
    let want = reference(26, &reqs, &p, Some(&detok));
    assert_eq!(got, want);
    assert!(got.iter().flatten().any(|c| c.finish == FinishReason::Stop));
}

/// A generous pool: every sample of `reqs` fits at once, `seats` run together.
fn roomy(reqs: &[Request], max_new: usize, seats: usize) -> PagedConfig {
    let per = reqs.iter().map(|r| r.prompt.len()).max().unwrap_or(1) + max_new;
    let samples: usize = reqs.iter().map(|r| r.sample_keys.len()).sum();
    PagedConfig {
        block_size: 4,
        num_blocks: (samples + 1) * per.div_ceil(4),
        max_num_seqs: seats,
        max_batched_tokens: 64,
        overlap: true,
    }
}

fn run(vocab: usize, reqs: &[Request], p: &GenParams, seats: usize) -> Vec<Vec<Completion>> {
    let cfg = roomy(reqs, p.max_new_tokens, seats);
    let mut toy = PagedToy::new(vocab, &cfg);
    generate_paged(&mut toy, &cfg, reqs, p, None, &mut |_| {})
        .unwrap()
        .0
}

#[test]
fn samples_do_not_depend_on_batch_composition() {
    let p = params(12, vec![]);
    let a = request(3, vec![1, 2, 3], 4);
    let alone = run(50, std::slice::from_ref(&a), &p, 8);
    let others = [request(3, vec![9, 9], 3), a.clone(), request(3, vec![4], 5)];
    // Few seats: requests are admitted in waves and split across refills.
    let mixed = run(50, &others, &p, 3);
    assert_eq!(alone[0], mixed[1]);
    // The n samples of a prompt differ from each other.
    assert_ne!(alone[0][0].tokens, alone[0][1].tokens);
}

#[test]
fn tokens_and_logprobs_follow_the_model() {
    let p = params(6, vec![]);
    let req = request(11, vec![5, 6], 2);
    let got = run(40, std::slice::from_ref(&req), &p, 4);
    for (s, c) in got[0].iter().enumerate() {
        assert_eq!(c.tokens.len(), 6);
        assert_eq!(c.finish, FinishReason::Length);
        // Replay: each token is the sample drawn from the model's logits of its context with
        // the counter-based uniform at its position.
        let mut ctx = req.prompt.clone();
        for (pos, (&t, &lp)) in c.tokens.iter().zip(&c.logprobs).enumerate() {
            let u = uniform(req.sample_keys[s], pos as u64);
            let want = sample(
                &toy_logits(40, &ctx),
                &p.sampling,
                u,
                &mut Scratch::default(),
            )
            .unwrap();
            assert_eq!((t, lp), (want.token, want.logprob));
            ctx.push(t);
        }
    }
}

#[test]
fn stop_token_ends_the_sample_and_is_kept() {
    let greedy = GenParams {
        sampling: SamplingParams::greedy(),
        ..params(20, vec![])
    };
    // Greedy path without stops, then stop on its third token.
    let free_run = run(25, &[request(0, vec![7], 1)], &greedy, 2);
    let path = free_run[0][0].tokens.clone();
    assert_eq!(path.len(), 20);
    let stop_tok = path[2];
    let first = path.iter().position(|&t| t == stop_tok).unwrap();
    let stopped = run(
        25,
        &[request(0, vec![7], 1)],
        &GenParams {
            stop_token_ids: vec![stop_tok],
            ..greedy.clone()
        },
        2,
    );
    let c = &stopped[0][0];
    assert_eq!(c.finish, FinishReason::Stop);
    assert_eq!(c.tokens, path[..=first].to_vec());
    assert_eq!(c.logprobs, free_run[0][0].logprobs[..=first].to_vec());
}

#[test]
fn stop_string_cuts_the_text_but_keeps_the_tokens() {
    // Token v decodes to the letter 'a' + v % 26.
    let detok = |ids: &[u32]| -> Result<String> {
        Ok(ids
            .iter()
            .map(|&t| (b'a' + (t % 26) as u8) as char)
            .collect())
    };
    let greedy = GenParams {
        sampling: SamplingParams::greedy(),
        ..params(20, vec![])
    };
    let reqs = [request(0, vec![1], 1)];
    let full = run(26, &reqs, &greedy, 2);
    let text = detok(&full[0][0].tokens).unwrap();
    // Stop on the two letters at positions 4..6.
    let stop = text[4..6].to_string();
    let first = text.find(&stop).unwrap();
    let p = GenParams {
        stop_strings: vec![stop.clone(), "zzzzzz".into()],
        ..greedy
    };
    let cfg = roomy(&reqs, 20, 2);
    let mut toy = PagedToy::new(26, &cfg);
    let (got, _) = generate_paged(&mut toy, &cfg, &reqs, &p, Some(&detok), &mut |_| {}).unwrap();
    let c = &got[0][0];
    assert_eq!(c.finish, FinishReason::Stop);
    assert_eq!(c.text, text[..first]);
    assert_eq!(c.tokens, full[0][0].tokens[..first + 2].to_vec());
}

#[test]
fn length_limits_and_empty_budget() {
    let reqs = [request(0, vec![1, 2], 3)];
    let got = run(10, &reqs, &params(0, vec![]), 2);
    assert!(got[0]
        .iter()
        .all(|c| c.tokens.is_empty() && c.finish == FinishReason::Length));
    // prompt 2 + 7 new tokens occupies 8 positions: two blocks of 4, exactly.
    let cfg = PagedConfig {
        block_size: 4,
        num_blocks: 2,
        max_num_seqs: 2,
        max_batched_tokens: 8,
        overlap: true,
    };
    let mut toy = PagedToy::new(10, &cfg);
    let (got, _) =
        generate_paged(&mut toy, &cfg, &reqs, &params(7, vec![]), None, &mut |_| {}).unwrap();
    assert!(got[0].iter().all(|c| c.tokens.len() == 7));
    let err =
        generate_paged(&mut toy, &cfg, &reqs, &params(8, vec![]), None, &mut |_| {}).unwrap_err();
    assert!(crate::error::is_input_error(&err));
    assert!(err.to_string().contains("needs 3 KV blocks"), "{err}");
}

#[test]
fn prompt_tokens_outside_the_vocabulary_are_rejected() {
    let reqs = [request(0, vec![1, 10], 1)];
    let cfg = roomy(&reqs, 2, 2);
    let mut toy = PagedToy::new(10, &cfg);
    let err =
        generate_paged(&mut toy, &cfg, &reqs, &params(2, vec![]), None, &mut |_| {}).unwrap_err();
    assert!(crate::error::is_input_error(&err));
    assert!(err.to_string().contains("request 0: token id 10"), "{err}");
}

pub(super) fn tiny_config() -> Config {
    Config {
        vocab_size: 97,
        hidden_size: 32,
        intermediate_size: 64,
        head_dim: 8,
        eos_token_ids: vec![],
        ..Config::small_qwen2()
    }
}

/// The engine over the real decoder on the CPU, with a small pool (preemption) and prompts
/// split over steps, with and without overlap scheduling (the decoder then queues steps whose
/// tokens it reads from the draws of the step before): the same samples either way; every
/// rollout log-prob is the log-prob the training forward (`Decoder::logprobs`, what
/// `ref-logprob` and `update` run) gives that token; and a greedy token is the argmax of its
/// prefix's logits computed alone (teacher forced through the paged cache).
#[test]
fn paged_decoder_rollouts_score_as_the_training_forward() {
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
        let mut runs = Vec::new();
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
            assert_eq!(stats.blocks_in_use_at_end, 0);
            assert!(stats.preemptions > 0, "the small pool preempts");
            assert_eq!(stats.overlapped_steps > 0, overlap, "{stats:?}");
            runs.push(got);
        }
        // The same tokens; log-probs to rounding (the CPU GEMM blocks rows differently for a
        // different number of rows per call, so the last bits of a logit may differ).
        for (g, w) in runs[1].iter().flatten().zip(runs[0].iter().flatten()) {
            assert_eq!((&g.tokens, g.finish), (&w.tokens, w.finish), "{sampling:?}");
            for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
        let done = &runs[1];
        let full: Vec<(Vec<u32>, usize)> = reqs
            .iter()
            .zip(done)
            .flat_map(|(r, cs)| {
                cs.iter().map(|c| {
                    let t: Vec<u32> = r.prompt.iter().chain(&c.tokens).copied().collect();
                    (t, r.prompt.len())
                })
            })
            .collect();
        let seqs: Vec<SeqRef> = full
            .iter()
            .map(|(t, start)| SeqRef {
                tokens: t,
                start: *start,
            })
            .collect();
        let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
        let scored = dec
            .logprobs(&seqs, p.sampling.logprob_temperature(), false)
            .unwrap();
        let mut n = 0;
        for (c, s) in done.iter().flatten().zip(&scored) {
            assert_eq!(c.logprobs.len(), s.logprobs.len());
            for (a, b) in c.logprobs.iter().zip(&s.logprobs) {
                assert!(
                    (a - b).abs() < 1e-5,
                    "{sampling:?}: rollout {a} vs training {b}"
                );
                n += 1;
            }
        }
        assert!(n > 40, "{n} tokens compared");
        if sampling.temperature == 0.0 {
            let mut alone = PagedDecoder::new(&mut dec, 16, 4).unwrap();
            for (r, c) in reqs
                .iter()
                .zip(done)
                .flat_map(|(r, cs)| cs.iter().map(move |c| (r, c)))
            {
                let fed = &c.tokens[..c.tokens.len() - 1];
                let logits = alone.forced_logits(&r.prompt, fed).unwrap();
                for (row, &t) in logits.chunks(cfg.vocab_size).zip(&c.tokens) {
                    let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
                    // A different token only at an exact tie up to rounding.
                    assert!(
                        best == t as usize || row[best] - row[t as usize] < 1e-5,
                        "greedy drew {t}, the argmax is {best}"
                    );
                }
            }
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

#[test]
fn a_cancelled_generation_stops_between_steps() {
    use crate::engine::cancel::{is_cancelled, Cancel};
    let reqs: Vec<Request> = (0..4).map(|i| request(i, vec![1, 2, 3], 2)).collect();
    let p = params(40, vec![]);
    for overlap in [true, false] {
        let cfg = PagedConfig {
            overlap,
            ..roomy(&reqs, 40, 2)
        };
        let mut full = PagedToy::new(16, &cfg);
        generate_paged(&mut full, &cfg, &reqs, &p, None, &mut |_| {}).unwrap();
        // Cancelled once the first sample has finished (two run at a time).
        let mut toy = PagedToy::new(16, &cfg);
        let cancel = Cancel::new();
        let err = cancel
            .install(|| {
                generate_paged(&mut toy, &cfg, &reqs, &p, None, &mut |done| {
                    if done > 0 {
                        cancel.cancel()
                    }
                })
            })
            .unwrap_err();
        assert!(is_cancelled(&err), "{err:#}");
        assert!(
            toy.steps.len() < full.steps.len() / 2,
            "overlap {overlap}: {} of {} steps ran",
            toy.steps.len(),
            full.steps.len()
        );
    }
}
