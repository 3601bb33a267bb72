//! `tandem bench logprob`: the forward-only half of the issue-6 workload, through the scoring
//! loop `ref-logprob` uses (`engine::logprob::score`): the same sequences and micro-batches as
//! `bench update`, log-probs (optionally entropies) of the response tokens, no gradients.
//! MFU counts 2·params FLOPs per token.

use super::update::{build, finish, median, Meter, Synth, Workload};
use crate::backend::Backend;
use crate::engine::logprob::score;
use crate::model::names::param_count;
use crate::stage::common::Device;
use crate::stage::{on_device, Job};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};
use std::time::Instant;

#[derive(Args, Debug)]
pub(crate) struct LogprobArgs {
    #[command(flatten)]
    pub(crate) w: Workload,
    /// Also compute per-token entropies (as `ref-logprob --entropy`).
    #[arg(long)]
    pub(crate) entropy: bool,
}

struct LogprobJob(Workload, bool);

impl Job for LogprobJob {
    type Out = (Vec<Vec<String>>, Value);

    fn run<B: Backend>(self, b: B) -> Result<Self::Out> {
        let (w, entropy) = (self.0, self.1);
        let gpu = matches!(w.device, Device::Cuda(_));
        let mut meter = Meter::new(&b, gpu)?;
        let (mut dec, cfg) = build(b, &w, None)?;
        let params = param_count(&cfg);
        let synth = Synth::new(&w, cfg.vocab_size);
        let rows = synth.rows();
        let mut pass_s = Vec::new();
        let mut checksum = 0f64;
        for i in 0..w.warmup + w.steps {
            let t = Instant::now();
            let stats = score(
                &mut dec,
                &rows,
                1.0,
                entropy,
                w.micro_batch * w.seq_len,
                &mut |_| {},
            )?;
            dec.backend().synchronize()?;
            let secs = t.elapsed().as_secs_f64();
            meter.sample(dec.backend());
            let scored: usize = stats.iter().map(|s| s.logprobs.len()).sum();
            if scored != w.sequences() * (w.seq_len - w.prompt_len) {
                bail!("bench logprob: scored {scored} tokens");
            }
            checksum = stats
                .iter()
                .flat_map(|s| s.logprobs.iter())
                .map(|&v| v as f64)
                .sum::<f64>()
                / scored as f64;
            if !checksum.is_finite() {
                bail!("bench logprob: non-finite log-probs");
            }
            eprintln!(
                "pass {i}{}: {secs:.3} s, mean log-prob {checksum:.5}",
                if i < w.warmup { " (warm-up)" } else { "" }
            );
            if i >= w.warmup {
                pass_s.push(secs);
            }
        }
        let tokens = w.tokens_per_step();
        let pass = median(&pass_s);
        let tps = tokens as f64 / pass;
        let mfu = meter.peak_flops.map(|p| 2.0 * params as f64 * tps / p);
        let mem = meter.json(dec.backend());
        let rows = vec![super::update::row(
            "logprob", &w, tps, mfu, pass, [None; 3], &mem,
        )];
        let out = json!({
            "bench": "logprob",
            "device": w.device.to_string(),
            "shape": w.shape,
            "params": params,
            "seq_len": w.seq_len,
            "prompt_len": w.prompt_len,
            "micro_batch": w.micro_batch,
            "micro_batches": w.micro_batches,
            "tokens_per_pass": tokens,
            "entropy": entropy,
            "warmup_passes": w.warmup,
            "timed_passes": w.steps,
            "logprob_chunk": dec.logprob_chunk,
            "pass_s": pass_s,
            "pass_median_s": pass,
            "tokens_per_s": tps,
            "mfu": mfu,
            "mean_logprob": checksum,
            "memory": mem,
        });
        Ok((rows, out))
    }
}

pub fn run(a: LogprobArgs) -> Result<()> {
    let w = a.w;
    w.check()?;
    let title = format!(
        "bench logprob: {} on {}, {} × {} tokens ({} prompt) per micro-batch, {} micro-batches per pass, {} warm-up + {} timed passes",
        w.shape, w.device, w.micro_batch, w.seq_len, w.prompt_len, w.micro_batches, w.warmup, w.steps
    );
    let json_path = w.json.clone();
    let (rows, out) = on_device(w.device, LogprobJob(w, a.entropy))?;
    finish(&title, rows, out, json_path.as_ref())
}
