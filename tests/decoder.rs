//! The decoder on the CPU backend: gradients against finite differences, packing and chunking
//! invariance, steps over the paged KV cache against packed scoring, the optimizer (clipping,
//! skipping, exact resume), and the errors of bad input.

use crate::common;

use common::{check_finite_differences, random_weights, tiny, tokens};
use tandem::backend::check::randn;
use tandem::backend::cpu::Cpu;
use tandem::backend::ops::sample::SamplingParams;
use tandem::engine::paged::{Chunk, PagedDecoder, PagedModel, SampleRow};
use tandem::error::is_input_error;
use tandem::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads, TokenStats};
use tandem::model::{Arch, Config, Weights};

const ARCHS: [Arch; 3] = [Arch::Qwen2, Arch::Llama, Arch::Qwen3];

fn decoder(cfg: &Config, w: &Weights) -> Decoder<Cpu> {
    Decoder::new(Cpu, cfg, w).unwrap()
}

fn seqs_of(toks: &[Vec<u32>], starts: &[usize]) -> Vec<SeqRef<'static>> {
    toks.iter()
        .zip(starts)
        .map(|(t, &s)| SeqRef {
            tokens: Box::leak(t.clone().into_boxed_slice()),
            start: s,
        })
        .collect()
}

fn max_abs_diff(a: &[TokenStats], b: &[TokenStats]) -> f32 {
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.logprobs.len(), y.logprobs.len());
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            m = m.max((p - q).abs());
        }
        if let (Some(e), Some(f)) = (&x.entropy, &y.entropy) {
            for (p, q) in e.iter().zip(f) {
                m = m.max((p - q).abs());
            }
        }
    }
    m
}

/// L = Σ c·logprob + Σ e·entropy with fixed random weights c, e.
fn loss_value(stats: &[TokenStats], c: &[Vec<f32>], e: &[Vec<f32>]) -> f64 {
    let mut l = 0f64;
    for ((s, c), e) in stats.iter().zip(c).zip(e) {
        for (lp, c) in s.logprobs.iter().zip(c) {
            l += *lp as f64 * *c as f64;
        }
        for (h, e) in s.entropy.as_ref().unwrap().iter().zip(e) {
            l += *h as f64 * *e as f64;
        }
    }
    l
}

#[test]
fn decoder_gradients_match_finite_differences() {
    for arch in ARCHS {
        check_gradients(&tiny(arch));
    }
}

/// A 1-layer model trains: the workspace once counted its residual snapshots by
/// `saved_layers > 1`, kept one buffer for it, and the training forward indexed past it.
#[test]
fn a_one_layer_models_gradients_match_finite_differences() {
    let mut cfg = tiny(Arch::Qwen2);
    cfg.num_layers = 1;
    check_gradients(&cfg);
}

/// Every gradient of a forward-backward pass of two packed sequences against central finite
/// differences of the log-prob and entropy loss, one random direction per tensor.
fn check_gradients(cfg: &Config) {
    let arch = cfg.arch;
    let w0 = random_weights(cfg, 1);
    let toks = vec![tokens(5, cfg.vocab_size, 2), tokens(7, cfg.vocab_size, 3)];
    let seqs = seqs_of(&toks, &[2, 1]);
    let temp = 0.8;
    let counts: Vec<usize> = seqs.iter().map(|s| s.tokens.len() - s.start).collect();
    let c: Vec<Vec<f32>> = counts
        .iter()
        .enumerate()
        .map(|(i, &n)| randn(n, 10 + i as u64))
        .collect();
    let e: Vec<Vec<f32>> = counts
        .iter()
        .enumerate()
        .map(|(i, &n)| randn(n, 20 + i as u64))
        .collect();

    let mut dec = decoder(cfg, &w0);
    dec.logprob_chunk = 3; // several chunks, the last one short
    dec.forward_backward(&seqs, temp, &mut |_stats| {
        Ok(c.iter()
            .zip(&e)
            .map(|(c, e)| TokenGrads {
                dlogprobs: c.clone(),
                dentropy: Some(e.clone()),
            })
            .collect())
    })
    .unwrap();
    let grads = dec.export_grads().unwrap();

    let what = format!("{arch:?}");
    let worst = check_finite_differences(&what, &grads, &w0, |w| {
        let stats = decoder(cfg, w).logprobs(&seqs, temp, true).unwrap();
        loss_value(&stats, &c, &e)
    });
    eprintln!(
        "{arch:?}: worst relative gradient error {worst:.2e} over {} tensors",
        grads.len()
    );
}

#[test]
fn packing_and_chunking_do_not_change_logprobs() {
    for arch in ARCHS {
        let cfg = tiny(arch);
        let w = random_weights(&cfg, 4);
        let toks = vec![
            tokens(9, cfg.vocab_size, 5),
            tokens(3, cfg.vocab_size, 6),
            tokens(12, cfg.vocab_size, 7),
        ];
        let seqs = seqs_of(&toks, &[4, 1, 6]);
        let mut dec = decoder(&cfg, &w);
        let together = dec.logprobs(&seqs, 1.0, true).unwrap();
        let mut alone = Vec::new();
        for s in &seqs {
            alone.extend(dec.logprobs(std::slice::from_ref(s), 1.0, true).unwrap());
        }
        let d = max_abs_diff(&together, &alone);
        assert!(d <= 1e-5, "{arch:?}: packed vs one by one differ by {d}");
        dec.release_workspace().unwrap();
        dec.logprob_chunk = 1;
        let chunked = dec.logprobs(&seqs, 1.0, true).unwrap();
        let d = max_abs_diff(&together, &chunked);
        assert!(d <= 1e-5, "{arch:?}: chunk size changed log-probs by {d}");
        let counts: Vec<usize> = together.iter().map(|s| s.logprobs.len()).collect();
        assert_eq!(counts, [5, 2, 6]);
        for s in &together {
            assert!(s.logprobs.iter().all(|&p| p < 0.0 && p.is_finite()));
            let max_h = (cfg.vocab_size as f32).ln();
            assert!(s
                .entropy
                .as_ref()
                .unwrap()
                .iter()
                .all(|&h| h > 0.0 && h <= max_h));
        }
    }
}

fn log_softmax_at(logits: &[f32], y: u32, temp: f32) -> f32 {
    let z: Vec<f64> = logits.iter().map(|&l| (l / temp) as f64).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    (z[y as usize] - lse) as f32
}

#[test]
fn paged_kv_path_matches_packed_scoring() {
    for arch in ARCHS {
        let cfg = tiny(arch);
        let w = random_weights(&cfg, 8);
        let mut dec = decoder(&cfg, &w);
        let temp = 0.7;
        let prompt = tokens(6, cfg.vocab_size, 9);
        // Two continuations of the prompt, each fed one token per step after the prompt's
        // step, through a pool of 4 blocks of 4 positions.
        let conts = [tokens(5, cfg.vocab_size, 10), tokens(5, cfg.vocab_size, 11)];
        let mut got = [vec![], vec![]];
        {
            let mut paged = PagedDecoder::new(&mut dec, 4, 4).unwrap();
            for (k, c) in conts.iter().enumerate() {
                let logits = paged.forced_logits(&prompt, &c[..4]).unwrap();
                assert_eq!(logits.len(), 5 * cfg.vocab_size);
                for (row, &t) in logits.chunks(cfg.vocab_size).zip(c) {
                    got[k].push(log_softmax_at(row, t, temp));
                }
            }
            // 6 + 11 positions do not fit 4 blocks of 4.
            let err = paged.forced_logits(&prompt, &[1; 11]).unwrap_err();
            assert!(err.to_string().contains("needs 5 blocks"), "{err}");
        }
        for k in 0..2 {
            let full: Vec<u32> = prompt.iter().chain(&conts[k]).copied().collect();
            let packed = dec
                .logprobs(
                    &[SeqRef {
                        tokens: &full,
                        start: prompt.len(),
                    }],
                    temp,
                    false,
                )
                .unwrap();
            let d = packed[0]
                .logprobs
                .iter()
                .zip(&got[k])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                d <= 1e-5,
                "{arch:?} continuation {k}: paged KV path vs packed differ by {d}"
            );
        }
    }
}

#[test]
fn paged_steps_reject_bad_chunks() {
    let cfg = tiny(Arch::Qwen2);
    let w = random_weights(&cfg, 8);
    let mut dec = decoder(&cfg, &w);
    let mut paged = PagedDecoder::new(&mut dec, 2, 4).unwrap();
    let greedy = SamplingParams::greedy();
    let row = [SampleRow {
        chunk: 0,
        key: 0,
        position: 0,
    }];
    let step = |paged: &mut PagedDecoder<Cpu>, toks: &[u32], table: &[u32], rows: &[SampleRow]| {
        let chunk = Chunk {
            tokens: toks,
            start: 0,
            table,
        };
        paged.step(&[chunk], rows, &greedy).unwrap_err().to_string()
    };
    // 5 positions, one block of 4 in the table.
    let err = step(&mut paged, &[1; 5], &[0], &row);
    assert!(
        err.contains("feeds positions 0..5 but its table covers 4"),
        "{err}"
    );
    let err = step(&mut paged, &[1; 3], &[2], &row);
    assert!(err.contains("names block 2 of 2"), "{err}");
    let far = [SampleRow { chunk: 1, ..row[0] }];
    let err = step(&mut paged, &[1; 3], &[0], &far);
    assert!(err.contains("sample row names chunk 1"), "{err}");
    let v = cfg.vocab_size as u32;
    let chunk = Chunk {
        tokens: &[1, v],
        start: 0,
        table: &[0],
    };
    let err = paged.step(&[chunk], &row, &greedy).unwrap_err();
    assert!(is_input_error(&err), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("token id {v} at position 1")),
        "{err}"
    );
}

fn sum_logprob_grads(stats: &[TokenStats]) -> anyhow::Result<Vec<TokenGrads>> {
    Ok(stats
        .iter()
        .map(|s| TokenGrads {
            dlogprobs: vec![-1.0; s.logprobs.len()],
            dentropy: None,
        })
        .collect())
}

#[test]
fn gradients_accumulate_across_micro_batches_and_zero() {
    let cfg = tiny(Arch::Qwen2);
    let w = random_weights(&cfg, 13);
    let toks = vec![tokens(8, cfg.vocab_size, 14)];
    let seqs = seqs_of(&toks, &[3]);
    let mut dec = decoder(&cfg, &w);
    dec.forward_backward(&seqs, 1.0, &mut sum_logprob_grads)
        .unwrap();
    let once = dec.export_grads().unwrap();
    let n1 = dec.grad_norm().unwrap();
    dec.forward_backward(&seqs, 1.0, &mut sum_logprob_grads)
        .unwrap();
    let twice = dec.export_grads().unwrap();
    for (name, g) in &once {
        for (a, b) in g.data.iter().zip(&twice[name].data) {
            assert!((2.0 * a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{name}");
        }
    }
    assert!((dec.grad_norm().unwrap() - 2.0 * n1).abs() < 1e-4 * n1);
    dec.zero_grads().unwrap();
    assert_eq!(dec.grad_norm().unwrap(), 0.0);
}

#[test]
fn adamw_steps_learn_and_resume_exactly() {
    let cfg = tiny(Arch::Llama);
    let w = random_weights(&cfg, 15);
    let toks = vec![tokens(10, cfg.vocab_size, 16)];
    let seqs = seqs_of(&toks, &[1]);
    let hp = AdamWParams {
        lr: 1e-2,
        ..Default::default()
    };
    let nll = |dec: &mut Decoder<Cpu>| -> f32 {
        -dec.logprobs(&seqs, 1.0, false).unwrap()[0]
            .logprobs
            .iter()
            .sum::<f32>()
    };
    let step = |dec: &mut Decoder<Cpu>| {
        dec.zero_grads().unwrap();
        dec.forward_backward(&seqs, 1.0, &mut sum_logprob_grads)
            .unwrap();
        dec.optimizer_step(&hp, Some(1.0)).unwrap()
    };
    // Three steps straight...
    let mut a = decoder(&cfg, &w);
    let before = nll(&mut a);
    let r1 = step(&mut a);
    assert!(!r1.skipped && r1.grad_norm > 1.0, "{r1:?}");
    step(&mut a);
    let state = a.optimizer_state().unwrap();
    assert_eq!(state.step, 2);
    let mid = a.export_weights().unwrap();
    step(&mut a);
    let after = nll(&mut a);
    assert!(
        after < before - 0.5,
        "SFT steps should lower the NLL: {before} -> {after}"
    );
    // ...equal two steps, a save, a fresh decoder, a load, and the third step.
    let mut b = decoder(&cfg, &mid);
    b.load_optimizer_state(&state).unwrap();
    step(&mut b);
    let (wa, wb) = (a.export_weights().unwrap(), b.export_weights().unwrap());
    for (name, t) in &wa {
        assert_eq!(t.data, wb[name].data, "{name} differs after resume");
    }
    assert_eq!(b.optimizer_steps(), 3);
}

#[test]
fn non_finite_gradients_skip_the_step() {
    let cfg = tiny(Arch::Qwen3);
    let w = random_weights(&cfg, 17);
    let toks = vec![tokens(6, cfg.vocab_size, 18)];
    let seqs = seqs_of(&toks, &[2]);
    let mut dec = decoder(&cfg, &w);
    dec.forward_backward(&seqs, 1.0, &mut |stats| {
        Ok(stats
            .iter()
            .map(|s| TokenGrads {
                dlogprobs: vec![f32::NAN; s.logprobs.len()],
                dentropy: None,
            })
            .collect())
    })
    .unwrap();
    let r = dec
        .optimizer_step(&AdamWParams::default(), Some(1.0))
        .unwrap();
    assert!(r.skipped && r.grad_norm.is_nan(), "{r:?}");
    assert_eq!(dec.optimizer_steps(), 0);
    assert_eq!(dec.export_weights().unwrap(), w);
}

#[test]
fn bad_input_is_an_input_error() {
    let cfg = tiny(Arch::Qwen2);
    let w = random_weights(&cfg, 19);
    let mut missing = w.clone();
    missing.remove("model.layers.1.self_attn.k_proj.bias");
    let err = Decoder::new(Cpu, &cfg, &missing).err().unwrap();
    assert!(
        is_input_error(&err) && err.to_string().contains("k_proj.bias' is missing"),
        "{err}"
    );
    let mut bad_shape = w.clone();
    bad_shape.get_mut("model.norm.weight").unwrap().shape = vec![4, 4];
    let err = Decoder::new(Cpu, &cfg, &bad_shape).err().unwrap();
    assert!(
        is_input_error(&err) && err.to_string().contains("model.norm.weight"),
        "{err}"
    );
    let mut nan = w.clone();
    nan.get_mut("model.embed_tokens.weight").unwrap().data[5] = f32::NAN;
    let err = Decoder::new(Cpu, &cfg, &nan).err().unwrap();
    assert!(
        is_input_error(&err) && err.to_string().contains("non-finite"),
        "{err}"
    );
    let bad_cfg = Config {
        num_kv_heads: 3,
        ..cfg.clone()
    };
    assert!(is_input_error(
        &Decoder::new(Cpu, &bad_cfg, &w).err().unwrap()
    ));

    let mut dec = decoder(&cfg, &w);
    let oov = [1u32, 2, cfg.vocab_size as u32];
    let err = dec
        .logprobs(
            &[SeqRef {
                tokens: &oov,
                start: 1,
            }],
            1.0,
            false,
        )
        .unwrap_err();
    assert!(
        is_input_error(&err) && err.to_string().contains("position 2"),
        "{err}"
    );
    let ok = [1u32, 2, 3];
    let err = dec
        .logprobs(
            &[SeqRef {
                tokens: &ok,
                start: 0,
            }],
            1.0,
            false,
        )
        .unwrap_err();
    assert!(is_input_error(&err), "{err}");
    let err = dec
        .logprobs(
            &[SeqRef {
                tokens: &ok,
                start: 1,
            }],
            0.0,
            false,
        )
        .unwrap_err();
    assert!(
        is_input_error(&err) && err.to_string().contains("temperature"),
        "{err}"
    );
    // An empty response scores nothing rather than failing.
    let none = dec
        .logprobs(
            &[SeqRef {
                tokens: &ok,
                start: 3,
            }],
            1.0,
            false,
        )
        .unwrap();
    assert!(none[0].logprobs.is_empty());
    dec.forward_backward(
        &[SeqRef {
            tokens: &ok,
            start: 3,
        }],
        1.0,
        &mut sum_logprob_grads,
    )
    .unwrap();
    assert_eq!(dec.grad_norm().unwrap(), 0.0);
}

#[test]
fn export_round_trips_the_weights() {
    for arch in ARCHS {
        let cfg = tiny(arch);
        let w = random_weights(&cfg, 20);
        assert_eq!(decoder(&cfg, &w).export_weights().unwrap(), w, "{arch:?}");
    }
}
