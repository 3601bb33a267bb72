//! Throughput of the CPU decoder (not a timed test: run it by hand with a release build)
//!
//!     cargo test --release --test integration bench_decoder:: -- --ignored --nocapture
//!
//! Random weights; a ~12M-parameter config and the Qwen2.5-0.5B shape (24 layers, hidden 896,
//! 14/2 heads, ffn 4864, vocab 151,936, tied). Forward = packed scoring of `batch` sequences;
//! decode = one greedy token per sequence per step of the paged engine's runner (forward over
//! the paged KV cache and the draw), after a short prefill.

use crate::common;

use std::time::Instant;

use common::{config, random_weights, tokens, Dims};
use tandem::backend::cpu::Cpu;
use tandem::backend::ops::sample::SamplingParams;
use tandem::engine::paged::{Chunk, PagedDecoder, SampleRow, DEFAULT_BLOCK_SIZE};
use tandem::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads};
use tandem::model::{Arch, Config};

/// CPU seconds this process has used (user + system), from /proc/self/stat.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // After the ")" that closes the command name come state, ppid, ...: utime and stime are
    // the 12th and 13th of those (fields 14 and 15 of proc(5)), in clock ticks of 1/100 s.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.len() < 13 {
        return f64::NAN;
    }
    let field = |i: usize| f[i].parse::<f64>().unwrap_or(f64::NAN);
    (field(11) + field(12)) / 100.0
}

/// Tokens per second of wall time, and per second of CPU time divided by the thread count
/// (what the same work would reach with every thread on an otherwise idle core; the dev
/// machine is shared, so the second number is the one that does not depend on the neighbours).
struct Rate(f64, f64);

fn timed(tokens: usize, f: impl FnOnce()) -> Rate {
    let (t, c) = (Instant::now(), cpu_seconds());
    f();
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - c);
    let threads = rayon::current_num_threads() as f64;
    Rate(tokens as f64 / wall, tokens as f64 / (cpu / threads))
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{:8.1} tok/s ({:8.1} per core-time)", self.0, self.1)
    }
}

fn bench(name: &str, cfg: &Config, seq_len: usize, decode_steps: usize, train: bool) {
    let t0 = Instant::now();
    let w = random_weights(cfg, 1);
    let mut dec = Decoder::new(Cpu, cfg, &w).unwrap();
    drop(w);
    eprintln!(
        "{name}: {:.1}M params, {} threads, built in {:.1}s",
        dec.num_params() as f64 / 1e6,
        rayon::current_num_threads(),
        t0.elapsed().as_secs_f64()
    );
    for batch in [1usize, 16] {
        let toks: Vec<Vec<u32>> = (0..batch)
            .map(|i| tokens(seq_len, cfg.vocab_size, 100 + i as u64))
            .collect();
        let seqs: Vec<SeqRef> = toks
            .iter()
            .map(|t| SeqRef {
                tokens: t,
                start: 1,
            })
            .collect();
        // Warm-up sizes the workspace; the timed run reuses it.
        dec.logprobs(&seqs[..1], 1.0, false).unwrap();
        let fwd = timed(batch * seq_len, || {
            dec.logprobs(&seqs, 1.0, true).unwrap();
        });

        let prompt = 16;
        let bs = DEFAULT_BLOCK_SIZE;
        let per = (prompt + decode_steps).div_ceil(bs);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| (s * per..(s + 1) * per).map(|b| b as u32).collect())
            .collect();
        let rows: Vec<SampleRow> = (0..batch)
            .map(|chunk| SampleRow {
                chunk,
                key: 0,
                position: 0,
            })
            .collect();
        let greedy = SamplingParams::greedy();
        let dec_tps = {
            let mut paged = PagedDecoder::new(&mut dec, batch * per, bs).unwrap();
            let chunks: Vec<Chunk> = (0..batch)
                .map(|s| Chunk {
                    tokens: &toks[s][..prompt],
                    start: 0,
                    table: &tables[s],
                })
                .collect();
            let first = paged.run_step(&chunks, &rows, &greedy).unwrap();
            let mut next: Vec<u32> = first.iter().map(|d| d.token).collect();
            timed(batch * decode_steps, || {
                for i in 0..decode_steps {
                    let chunks: Vec<Chunk> = (0..batch)
                        .map(|s| Chunk {
                            tokens: &next[s..s + 1],
                            start: prompt + i,
                            table: &tables[s],
                        })
                        .collect();
                    let drawn = paged.run_step(&chunks, &rows, &greedy).unwrap();
                    next = drawn.iter().map(|d| d.token).collect();
                }
            })
        };
        let mut line =
            format!("{name} batch {batch:2}: forward {fwd} (seq {seq_len}), decode {dec_tps}");
        if train {
            let hp = AdamWParams::default();
            let step = |dec: &mut Decoder<Cpu>| {
                dec.zero_grads().unwrap();
                dec.forward_backward(&seqs, 1.0, &mut |st| {
                    Ok(st
                        .iter()
                        .map(|s| TokenGrads {
                            dlogprobs: vec![-1.0 / s.logprobs.len() as f32; s.logprobs.len()],
                            dentropy: None,
                        })
                        .collect())
                })
                .unwrap();
                dec.optimizer_step(&hp, Some(1.0)).unwrap();
            };
            step(&mut dec);
            let upd = timed(batch * seq_len, || step(&mut dec));
            line += &format!(", update {upd}");
        }
        eprintln!("{line}");
    }
}

#[test]
#[ignore]
fn bench_small_12m() {
    let cfg = config(
        Arch::Qwen2,
        Dims {
            vocab: 8192,
            hidden: 384,
            ffn: 1024,
            layers: 6,
            heads: 6,
            kv_heads: 2,
            head_dim: 64,
        },
        true,
    );
    bench("12M", &cfg, 256, 64, true);
}

#[test]
#[ignore]
fn bench_qwen25_05b_shape() {
    let cfg = config(
        Arch::Qwen2,
        Dims {
            vocab: 151936,
            hidden: 896,
            ffn: 4864,
            layers: 24,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
        },
        true,
    );
    bench("0.5B", &cfg, 64, 16, false);
}

/// Where a batch-16 decode step of the 0.5B shape spends its time: each GEMM of one layer and
/// the LM head, timed alone (GFLOP/s per wall second and per core-second).
#[test]
#[ignore]
fn bench_gemms_05b_decode16() {
    use tandem::backend::check::randn;
    use tandem::backend::prelude::*;
    let b = Cpu;
    let m = 16;
    let shapes = [
        ("q_proj", 896, 896),
        ("k_proj", 896, 128),
        ("o_proj", 896, 896),
        ("gate_proj", 896, 4864),
        ("down_proj", 4864, 896),
        ("lm_head", 896, 151936),
    ];
    for (name, k, n) in shapes {
        let (x, w) = (randn(m * k, 1), randn(n * k, 2));
        let mut y = vec![0.0; m * n];
        let reps = (2_000_000_000 / (2 * m * k * n)).clamp(3, 500);
        b.matmul(&mut y, &x, &w, None, MatmulShape { m, k, n }, false)
            .unwrap();
        let r = timed(2 * m * k * n * reps, || {
            for _ in 0..reps {
                b.matmul(&mut y, &x, &w, None, MatmulShape { m, k, n }, false)
                    .unwrap();
            }
        });
        eprintln!(
            "{name:10} m={m} k={k:5} n={n:6}: {:6.1} GFLOP/s ({:6.1} per core-time)",
            r.0 / 1e9,
            r.1 / 1e9
        );
    }
}
