//! `tandem serve --daemon`'s generation batch as a job of the warm daemon: not a stage binary.
//! The server writes the batch (the requests as token ids and their keys, the generation
//! parameters, the engine's limits) to a file, the daemon generates it with the policy it
//! holds through rollout's `Generate` (a daemon group: each rank its block of the requests,
//! as rollout's prompts), and writes the samples to the job's `out` file, in the ranks'
//! payload format (`Generated::encode`), log-probs bit for bit.

use super::common::{gather_results, my_block, resolve_model, Device};
use super::rollout::{Generate, Generated};
use super::Exec;
use crate::backend::ops::sample::SamplingParams;
use crate::batch::write::write_atomic;
use crate::engine::paged::{Completion, GenParams, Limits, Request};
use crate::engine::policy::kept::ModelKey;
use crate::error::input_error;
use crate::parallel::exchange::{Reader, Writer};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The job: the policy to generate with, the batch file, where the samples go.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateArgs {
    /// The policy (a directory or a sync-weights pointer): the daemon's held one when the same.
    pub model: PathBuf,
    /// The batch, as [`write_batch`] writes it.
    pub input: PathBuf,
    /// The samples, as [`read_samples`] reads them.
    pub out: PathBuf,
    /// The device the server asked for: the daemon's own, or the job is refused.
    pub device: Device,
}

/// One batch of the server: requests generated together under one set of parameters.
pub struct Batch {
    pub requests: Vec<Request>,
    pub params: GenParams,
    pub limits: Limits,
}

/// Writes `batch` to `path` (atomically).
pub fn write_batch(path: &Path, batch: &Batch) -> Result<()> {
    let mut w = Writer::default();
    w.u64(batch.requests.len() as u64);
    for r in &batch.requests {
        w.u32s(&r.prompt).u64(r.sample_keys.len() as u64);
        for &k in &r.sample_keys {
            w.u64(k);
        }
        w.u64(r.max_new.len() as u64);
        for &m in &r.max_new {
            w.u64(m as u64);
        }
    }
    let (p, l) = (&batch.params, &batch.limits);
    let s = &p.sampling;
    w.f32s(&[s.temperature, s.top_p])
        .u64(s.top_k as u64)
        .u64(p.max_new_tokens as u64)
        .u32s(&p.stop_token_ids)
        .u64(p.stop_strings.len() as u64);
    for s in &p.stop_strings {
        w.str(s);
    }
    w.u64(l.max_num_seqs as u64)
        .u64(l.max_batched_tokens as u64)
        .f64(l.gpu_memory_fraction.unwrap_or(-1.0))
        .u64(l.graphs as u64)
        .u64(l.overlap as u64);
    write_atomic(path, &w.finish())
}

fn read_batch(path: &Path) -> Result<Batch> {
    let bytes = std::fs::read(path).map_err(|e| input_error(format!("{}: {e}", path.display())))?;
    let mut r = Reader::new(&bytes);
    let n = r.u64()? as usize;
    let mut requests = Vec::with_capacity(n.min(1 << 20));
    for _ in 0..n {
        let prompt = r.u32s()?;
        let keys = r.u64()? as usize;
        let sample_keys = (0..keys).map(|_| r.u64()).collect::<Result<_>>()?;
        let limits = r.u64()? as usize;
        let max_new = (0..limits)
            .map(|_| Ok(r.u64()? as usize))
            .collect::<Result<_>>()?;
        requests.push(Request {
            prompt,
            sample_keys,
            max_new,
        });
    }
    let (temp_top_p, top_k) = (r.f32s()?, r.u64()? as i64);
    let (max_new_tokens, stop_token_ids) = (r.u64()? as usize, r.u32s()?);
    let stops = r.u64()? as usize;
    let stop_strings = (0..stops).map(|_| r.str()).collect::<Result<_>>()?;
    let sampling = SamplingParams {
        temperature: *temp_top_p.first().context("no temperature")?,
        top_p: *temp_top_p.get(1).context("no top_p")?,
        top_k,
    };
    let limits = Limits {
        max_num_seqs: r.u64()? as usize,
        max_batched_tokens: r.u64()? as usize,
        gpu_memory_fraction: Some(r.f64()?).filter(|f| *f > 0.0),
        graphs: r.u64()? != 0,
        overlap: r.u64()? != 0,
    };
    Ok(Batch {
        requests,
        params: GenParams {
            sampling,
            max_new_tokens,
            stop_token_ids,
            stop_strings,
        },
        limits,
    })
}

/// The samples of the job's `out` file, per request in the batch's order.
pub fn read_samples(path: &Path) -> Result<Vec<Vec<Completion>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Generated::decode(&bytes)
        .with_context(|| path.display().to_string())?
        .completions)
}

/// The tokenizer of `dir`, kept in the daemon's process from one batch to the next while the
/// directory's files stay the same: reading a large vocabulary's tokenizer.json (Qwen2.5's
/// 151k entries) takes longer than generating a small batch.
fn kept_tokenizer(dir: &Path) -> Result<Arc<Tokenizer>> {
    static KEPT: Mutex<Option<(ModelKey, Arc<Tokenizer>)>> = Mutex::new(None);
    let key = ModelKey::of(dir)?;
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = kept.as_ref().filter(|(k, _)| *k == key) {
        return Ok(t.clone());
    }
    let t = Arc::new(Tokenizer::from_dir(dir)?);
    *kept = Some((key, t.clone()));
    Ok(t)
}

/// Runs the job on `exec` (the daemon).
pub fn run(args: GenerateArgs, exec: &mut dyn Exec) -> Result<()> {
    let batch = read_batch(&args.input).with_context(|| args.input.display().to_string())?;
    let model = resolve_model(&args.model)?;
    // The engine decodes the samples (their text, stop strings) as rollout's does.
    let tokenizer = kept_tokenizer(&model.dir)?;
    let detok = |ids: &[u32]| tokenizer.decode(ids, true);
    let block = my_block(exec, batch.requests.len());
    let bar = ProgressBar::hidden();
    let job = Generate::plain(
        &model.dir,
        &batch.requests[block.clone()],
        &batch.params,
        &detok,
        &bar,
        batch.limits,
    );
    let generated = match block.is_empty() {
        // A rank with no request (fewer than ranks) generates nothing.
        true => Generated {
            batch_invariant: true,
            ..Generated::default()
        },
        false => exec.generate(&model, job)?,
    };
    let Some(mut parts) = gather_results(exec, generated, Generated::encode, Generated::decode)?
    else {
        return Ok(());
    };
    let generated = match parts.len() {
        1 => parts.pop().expect("one part"),
        _ => Generated::merge(parts),
    };
    write_atomic(&args.out, &generated.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_round_trips_through_its_file() {
        let d = tempfile::tempdir().unwrap();
        let batch = Batch {
            requests: vec![
                Request {
                    max_new: vec![3, 5],
                    prompt: vec![1, 2, 3],
                    sample_keys: vec![7, u64::MAX],
                },
                Request {
                    max_new: Vec::new(),
                    prompt: vec![4],
                    sample_keys: vec![9],
                },
            ],
            params: GenParams {
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_k: -1,
                    top_p: 0.95,
                },
                max_new_tokens: 5,
                stop_token_ids: vec![2],
                stop_strings: vec!["\n\n".into(), "Q:".into()],
            },
            limits: Limits {
                max_num_seqs: 8,
                max_batched_tokens: 64,
                gpu_memory_fraction: Some(0.5),
                graphs: false,
                overlap: true,
            },
        };
        let path = d.path().join("b.bin");
        write_batch(&path, &batch).unwrap();
        let back = read_batch(&path).unwrap();
        assert_eq!(back.requests.len(), 2);
        assert_eq!(back.requests[0].prompt, [1, 2, 3]);
        assert_eq!(back.requests[0].sample_keys, [7, u64::MAX]);
        assert_eq!(back.requests[1].sample_keys, [9]);
        assert_eq!(back.requests[0].max_new, [3, 5]);
        assert!(back.requests[1].max_new.is_empty());
        assert_eq!(format!("{:?}", back.params), format!("{:?}", batch.params));
        assert_eq!(back.limits, batch.limits);
        std::fs::write(&path, &std::fs::read(&path).unwrap()[..20]).unwrap();
        assert!(read_batch(&path).is_err());
    }
}
