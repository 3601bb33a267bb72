//! `tandem bench cpu-engine`: generation tokens/s (the paged rollout engine: prefill, batched
//! decode over the paged KV cache, sampling) and update tokens/s (forward + backward + AdamW through the
//! training loop) on random-weight models: a ~10M-parameter one and the Qwen2.5-0.5B shape
//! (24 layers, hidden 896, 14/2 heads, ffn 4864, vocab 151,936, tied), at batch 1 and 16.

use crate::algo::policy_loss::{LossConfig, LossMode};
use crate::backend::cpu::Cpu;
use crate::backend::ops::sample::{sample_key, uniform, SamplingParams};
use crate::engine::logprob::PromptResponse;
use crate::engine::paged::{
    generate_paged, GenParams, PagedConfig, PagedDecoder, Request, DEFAULT_BLOCK_SIZE,
};
use crate::engine::train::{train, LrConfig, TrainConfig, TrainData};
use crate::model::decoder::Decoder;
use crate::model::init::random_weights;
use crate::model::names::param_count;
use crate::model::{Arch, Config};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct CpuEngineArgs {
    /// Model shapes to run: small (~10M parameters), qwen0.5b.
    #[arg(long, value_delimiter = ',', default_values_t = ["small".to_string(), "qwen0.5b".to_string()])]
    pub models: Vec<String>,
    /// Batch sizes (sequences generated or trained together).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16])]
    pub batches: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// New tokens per sequence when generating.
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Response tokens per sequence when training (after the prompt tokens).
    #[arg(long, default_value_t = 32)]
    pub train_tokens: usize,
    /// Skip the update measurement (it needs ~4x the weights' memory for grads and Adam).
    #[arg(long)]
    pub skip_update: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The benchmark shapes: `small` (~10M parameters) and the Qwen2.5 0.5B / 1.5B / 7B / 14B shapes.
pub fn shape(name: &str) -> Result<Config> {
    let base = |layers, hidden, heads, kv, ffn, vocab| Config {
        arch: Arch::Qwen2,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hidden / heads,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        qkv_bias: true,
        qk_norm: false,
        max_position_embeddings: 32768,
        bos_token_id: None,
        eos_token_ids: vec![],
        value_head: false,
    };
    // Qwen2.5-7B and -14B have their own LM head.
    let untied = |c: Config| Config {
        tie_word_embeddings: false,
        ..c
    };
    Ok(match name {
        "small" => base(4, 256, 4, 2, 768, 32_000),
        "qwen0.5b" => base(24, 896, 14, 2, 4864, 151_936),
        "qwen1.5b" => base(28, 1536, 12, 2, 8960, 151_936),
        "qwen7b" => untied(base(28, 3584, 28, 4, 18_944, 152_064)),
        "qwen14b" => untied(base(48, 5120, 40, 8, 13_824, 152_064)),
        other => bail!(
            "unknown bench model '{other}' (expected small, qwen0.5b, qwen1.5b, qwen7b or qwen14b)"
        ),
    })
}

struct GenResult {
    tokens: usize,
    seconds: f64,
    prefill_seconds: f64,
}

fn random_ids(n: usize, vocab: usize, key: u64) -> Vec<u32> {
    (0..n)
        .map(|i| (uniform(key, i as u64) * vocab as f64) as u32)
        .collect()
}

fn bench_generate(
    dec: &mut Decoder<Cpu>,
    cfg: &Config,
    a: &CpuEngineArgs,
    batch: usize,
) -> Result<GenResult> {
    let requests: Vec<Request> = (0..batch)
        .map(|b| {
            let prompt = random_ids(a.prompt_tokens, cfg.vocab_size, a.seed ^ ((b as u64) << 20));
            let keys = vec![sample_key(a.seed, &prompt, 0, 0)];
            Request {
                max_new: Vec::new(),
                prompt,
                sample_keys: keys,
            }
        })
        .collect();
    let params = GenParams {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
        },
        max_new_tokens: a.new_tokens,
        stop_token_ids: vec![],
        stop_strings: vec![],
    };
    // Every sequence at once, its prompt prefilled in one step, a pool that fits them all.
    let bs = DEFAULT_BLOCK_SIZE;
    let pc = PagedConfig {
        block_size: bs,
        num_blocks: batch * (a.prompt_tokens + a.new_tokens).div_ceil(bs),
        max_num_seqs: batch,
        max_batched_tokens: batch * a.prompt_tokens.max(1),
        overlap: true,
    };
    let mut engine = PagedDecoder::new(dec, pc.num_blocks, bs)?;
    // Prefill alone (and the first token of each sequence), to split its time from the
    // decode steps'.
    let one = GenParams {
        max_new_tokens: 1,
        ..params.clone()
    };
    let t = Instant::now();
    generate_paged(&mut engine, &pc, &requests, &one, None, &mut |_| {})?;
    let prefill_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (out, _) = generate_paged(&mut engine, &pc, &requests, &params, None, &mut |_| {})?;
    let seconds = t.elapsed().as_secs_f64();
    Ok(GenResult {
        tokens: out.iter().flatten().map(|c| c.tokens.len()).sum(),
        seconds,
        prefill_seconds,
    })
}

fn bench_update(
    dec: &mut Decoder<Cpu>,
    cfg: &Config,
    a: &CpuEngineArgs,
    batch: usize,
) -> Result<(usize, f64)> {
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            random_ids(
                a.prompt_tokens,
                cfg.vocab_size,
                a.seed ^ 0xabc ^ ((b as u64) << 20),
            )
        })
        .collect();
    let responses: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            random_ids(
                a.train_tokens,
                cfg.vocab_size,
                a.seed ^ 0xdef ^ ((b as u64) << 20),
            )
        })
        .collect();
    let masks: Vec<Vec<u8>> = responses.iter().map(|r| vec![1; r.len()]).collect();
    let adv: Vec<Vec<f32>> = (0..batch)
        .map(|b| vec![if b % 2 == 0 { 1.0 } else { -1.0 }; a.train_tokens])
        .collect();
    let data = TrainData {
        rows: prompts
            .iter()
            .zip(&responses)
            .map(|(p, r)| PromptResponse {
                prompt: p,
                response: r,
            })
            .collect(),
        mask: masks.iter().map(Vec::as_slice).collect(),
        advantages: Some(adv.iter().map(Vec::as_slice).collect()),
        old: None,
        ref_lp: None,
        rollout: None,
        returns: None,
    };
    let tc = TrainConfig {
        loss: LossConfig::new(LossMode::Vanilla),
        loss_scale_factor: None,
        ppo_epochs: 1,
        mini_batch_size: None,
        micro_batch_tokens: 4096,
        temperature: 1.0,
        lr: LrConfig::constant(1e-6),
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        grad_clip: Some(1.0),
        shuffle: false,
        seed: a.seed,
        device_loss: TrainConfig::device_loss_from_env(),
        critic: None,
        lora: None,
    };
    let t = Instant::now();
    let report = train(dec, &data, &tc, 0, &mut |m| eprintln!("{m}"))?;
    Ok((report.tokens, t.elapsed().as_secs_f64()))
}

pub fn run(a: CpuEngineArgs) -> Result<()> {
    let threads = rayon::current_num_threads();
    let mut rows = Vec::new();
    let mut results = Vec::new();
    for name in &a.models {
        let cfg = shape(name)?;
        let params = param_count(&cfg);
        eprintln!("{name}: {params} parameters, building random weights");
        let weights = random_weights(&cfg, a.seed, 0.02);
        let mut dec = Decoder::new(Cpu, &cfg, &weights)?;
        drop(weights);
        for &batch in &a.batches {
            eprintln!("{name}: generating, batch {batch}");
            let g = bench_generate(&mut dec, &cfg, &a, batch)?;
            let gen_tps = g.tokens as f64 / g.seconds;
            let decode_tps = (g.tokens - batch) as f64 / (g.seconds - g.prefill_seconds).max(1e-9);
            let (upd_tokens, upd_s) = if a.skip_update {
                (0, f64::NAN)
            } else {
                eprintln!("{name}: one update step, batch {batch}");
                bench_update(&mut dec, &cfg, &a, batch)?
            };
            let upd_tps = upd_tokens as f64 / upd_s;
            rows.push(vec![
                name.clone(),
                format!("{:.1}M", params as f64 / 1e6),
                batch.to_string(),
                format!("{gen_tps:.1}"),
                format!("{decode_tps:.1}"),
                format!("{:.2}", g.prefill_seconds),
                if a.skip_update {
                    "-".into()
                } else {
                    format!("{upd_tps:.1}")
                },
                if a.skip_update {
                    "-".into()
                } else {
                    format!("{upd_s:.2}")
                },
            ]);
            results.push(json!({
                "model": name,
                "params": params,
                "batch": batch,
                "prompt_tokens": a.prompt_tokens,
                "new_tokens": a.new_tokens,
                "generated_tokens": g.tokens,
                "generation_tokens_per_s": gen_tps,
                "decode_tokens_per_s": decode_tps,
                "prefill_seconds": g.prefill_seconds,
                "generation_seconds": g.seconds,
                "update_tokens": upd_tokens,
                "update_tokens_per_s": if a.skip_update { None } else { Some(upd_tps) },
                "update_seconds": if a.skip_update { None } else { Some(upd_s) },
            }));
        }
    }
    super::report(
        &format!(
            "cpu-engine: {} prompt tokens, {} new tokens, update on {} + {} tokens per sequence, {threads} threads",
            a.prompt_tokens, a.new_tokens, a.prompt_tokens, a.train_tokens
        ),
        &["model", "params", "batch", "gen tok/s", "decode tok/s", "prefill s", "update tok/s", "update s"],
        &rows,
        &json!({ "bench": "cpu-engine", "threads": threads, "results": results }),
    );
    Ok(())
}
