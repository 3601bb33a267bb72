//! Sampling on the CPU: one token per row of logits, drawn with the row's counter-based
//! uniform by the host sampler ([`super::sample`]); the oracle of `sample.cu`.

use anyhow::Result;
use rayon::prelude::*;

use super::{sample, uniform, Draws, SampleOps, SamplingParams, Scratch};
use crate::backend::cpu::{get, get_mut, Cpu};

/// tokens[r], logprobs[r] = [`sample`](logits row r, u = uniform(key_r, pos_r)).
pub(crate) fn sample_rows(
    tokens: &mut [u32],
    logprobs: &mut [f32],
    logits: &[f32],
    keys: &[u32],
    positions: &[u32],
    vocab: usize,
    params: &SamplingParams,
) -> Result<()> {
    let drawn: Vec<_> = logits
        .par_chunks(vocab.max(1))
        .enumerate()
        .map_init(Scratch::default, |scratch, (r, row)| {
            let key = keys[2 * r] as u64 | (keys[2 * r + 1] as u64) << 32;
            sample(row, params, uniform(key, positions[r] as u64), scratch)
        })
        .collect::<Result<_>>()?;
    for (r, d) in drawn.into_iter().enumerate() {
        tokens[r] = d.token;
        logprobs[r] = d.logprob;
    }
    Ok(())
}

impl SampleOps for Cpu {
    fn sample(&self, logits: &Vec<f32>, vocab: usize, d: Draws<Self>) -> Result<()> {
        let rows = d.rows;
        sample_rows(
            get_mut(d.tokens, rows, "sample tokens")?,
            get_mut(d.logprobs, rows, "sample logprobs")?,
            get(logits, rows * vocab, "sample logits")?,
            get(d.keys, 2 * rows, "sample keys")?,
            get(d.positions, rows, "sample positions")?,
            vocab,
            d.sampling,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::randn;

    #[test]
    fn sample_rows_match_the_host_sampler() {
        let vocab = 50;
        let logits = randn(3 * vocab, 1);
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.9,
        };
        let keys64 = [7u64, u64::MAX - 3, 1 << 40];
        let keys: Vec<u32> = keys64
            .iter()
            .flat_map(|&k| [k as u32, (k >> 32) as u32])
            .collect();
        let pos = [0u32, 5, 9];
        let (mut t, mut lp) = (vec![0u32; 3], vec![0f32; 3]);
        sample_rows(&mut t, &mut lp, &logits, &keys, &pos, vocab, &p).unwrap();
        for r in 0..3 {
            let want = sample(
                &logits[r * vocab..(r + 1) * vocab],
                &p,
                uniform(keys64[r], pos[r] as u64),
                &mut Scratch::default(),
            )
            .unwrap();
            assert_eq!((t[r], lp[r]), (want.token, want.logprob));
        }
    }
}
