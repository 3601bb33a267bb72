//! Token sampling, the math of the `sample` op: temperature, top-k, top-p, greedy, and a
//! counter-based random stream per sample so that a sample's tokens depend only on (seed,
//! prompt, sample index, position), never on which other sequences share its batch. The host
//! sampler [`sample`] is the formula; [`SampleOps::sample`] draws one token per row of logits
//! exactly as it does, with the row's uniform and its log-prob under the tempered softmax.
//!
//! Files: `cpu.rs` (the reference: the host sampler per row), `cuda.rs`, `sample.cu`, `check.rs`
//! (the `sample` case: greedy, full softmax, top-k, top-p, both).

pub mod check;
pub mod cpu;
pub(crate) mod cuda;

use anyhow::{bail, Result};

use crate::backend::Device;
use crate::rng::mix;

/// Where a step's draws go: for each of the first `rows` rows r of the logits, `tokens[r]` and
/// `logprobs[r]`, drawn under `sampling` with the key `keys[2r] | keys[2r+1] << 32` at draw
/// position `positions[r]`.
pub struct Draws<'a, D: Device + ?Sized> {
    pub tokens: &'a mut D::Idx,
    pub logprobs: &'a mut D::Buf,
    pub keys: &'a D::Idx,
    pub positions: &'a D::Idx,
    pub rows: usize,
    pub sampling: &'a SamplingParams,
}

/// Token sampling.
pub trait SampleOps: Device {
    /// One token per row of logits[rows, vocab], drawn as [`sample`] draws it
    /// with u = uniform(key_r, positions[r]), key_r = keys[2r] | keys[2r+1] << 32:
    /// tokens[r] = the id, logprobs[r] = log softmax(z_r / T)[id] (T = 1 when greedy).
    fn sample(&self, logits: &Self::Buf, vocab: usize, draws: Draws<Self>) -> Result<()>;
}

/// How the next token is drawn (vLLM / verl names and conventions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by this; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; -1 (or any value <= 0) keeps all.
    pub top_k: i64,
    /// Keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all.
    pub top_p: f32,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: -1,
            top_p: 1.0,
        }
    }

    /// The temperature the reported log-prob is computed under: T itself, or 1 when greedy
    /// (softmax(logits / 0) has no finite log-probs, and 1 is what a scorer would use).
    pub fn logprob_temperature(&self) -> f32 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }

    /// Checks ranges; the message names the flag.
    pub(crate) fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!(
                "--temperature must be a finite number >= 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        if self.top_k == 0 {
            bail!("--top-k must be -1 (all tokens) or >= 1, got 0");
        }
        Ok(())
    }
}

/// One drawn token and its log-prob under softmax(logits / T) over the full vocabulary
/// (before top-k/top-p truncation, as vLLM reports it and as `ref-logprob` recomputes it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

/// The random key of one sample: a hash of the run seed, the prompt's tokens, which repeat of
/// that same prompt in the input this is (so duplicated prompts still differ), and the sample's
/// index among the n of its prompt.
pub(crate) fn sample_key(seed: u64, prompt: &[u32], occurrence: u64, sample: u64) -> u64 {
    let mut h = mix(seed ^ 0x7461_6e64_656d);
    for &t in prompt {
        h = mix(h ^ t as u64);
    }
    h = mix(h ^ prompt.len() as u64);
    h = mix(h ^ occurrence);
    mix(h ^ sample.wrapping_mul(0xD6E8_FEB8_6659_FD93))
}

/// Uniform in [0, 1) for draw number `position` of the sample with `key` (counter-based: the
/// value is a pure function of its inputs, there is no generator state).
pub fn uniform(key: u64, position: u64) -> f64 {
    let bits = mix(key ^ mix(position.wrapping_add(0x5851_F42D_4C95_7F2D)));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Reusable buffers so sampling a large vocabulary allocates nothing per token.
#[derive(Default)]
pub struct Scratch {
    probs: Vec<f32>,
    order: Vec<u32>,
    select: Vec<f32>,
}

/// Draw one token from `logits` with uniform `u` in [0, 1).
pub fn sample(
    logits: &[f32],
    p: &SamplingParams,
    u: f64,
    scratch: &mut Scratch,
) -> Result<Sampled> {
    if logits.is_empty() {
        bail!("cannot sample from an empty vocabulary");
    }
    if let Some(i) = logits.iter().position(|x| x.is_nan()) {
        bail!("logit of token {i} is NaN");
    }
    let t = p.logprob_temperature();
    // log p_v = z_v/T − lse, lse = max + log Σ exp(z_v/T − max).
    let inv_t = 1.0 / t;
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * inv_t;
    if !max.is_finite() {
        bail!("logits are not finite (max {max})");
    }
    let probs = &mut scratch.probs;
    probs.clear();
    probs.extend(logits.iter().map(|&z| (z * inv_t - max).exp()));
    // The log-probs as the trainer's fused log-prob computes them (`logprob::cpu`): z = x/T in
    // f32, exp(z − max) in f64, so that a batch-invariant rollout reports its log-probs bit for
    // bit (the f32 weights above only draw the token).
    let sum: f64 = logits
        .iter()
        .map(|&z| ((z * inv_t - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let logprob_of = |tok: usize| ((logits[tok] * inv_t) as f64 - lse) as f32;

    if p.temperature == 0.0 {
        // Greedy: the first index of the largest logit.
        let mut best = 0;
        for (i, &z) in logits.iter().enumerate() {
            if z > logits[best] {
                best = i;
            }
        }
        return Ok(Sampled {
            token: best as u32,
            logprob: logprob_of(best),
        });
    }

    let vocab = logits.len();
    // Top-k: zero every weight below the k-th largest logit (ties at the threshold are kept,
    // as vLLM does).
    if p.top_k > 0 && (p.top_k as usize) < vocab {
        let k = p.top_k as usize;
        let sel = &mut scratch.select;
        sel.clear();
        sel.extend_from_slice(logits);
        let (_, kth, _) = sel.select_nth_unstable_by(vocab - k, |a, b| a.total_cmp(b));
        let threshold = *kth;
        for (w, &z) in probs.iter_mut().zip(logits) {
            if z < threshold {
                *w = 0.0;
            }
        }
    }

    let token = if p.top_p < 1.0 {
        sample_top_p(probs, p.top_p as f64, u, &mut scratch.order)
    } else {
        // Inverse CDF in vocabulary order over the (possibly top-k-masked) weights.
        let total: f64 = probs.iter().map(|&w| w as f64).sum();
        let target = u * total;
        let mut acc = 0.0f64;
        let mut chosen = None;
        let mut last_nonzero = 0;
        for (i, &w) in probs.iter().enumerate() {
            if w > 0.0 {
                last_nonzero = i;
                acc += w as f64;
                if acc > target {
                    chosen = Some(i);
                    break;
                }
            }
        }
        chosen.unwrap_or(last_nonzero)
    };
    Ok(Sampled {
        token: token as u32,
        logprob: logprob_of(token),
    })
}

/// Nucleus sampling over unnormalised weights: sort by weight (descending, ties by id), keep
/// the shortest prefix whose mass reaches `top_p` of the total, draw from it.
fn sample_top_p(weights: &[f32], top_p: f64, u: f64, order: &mut Vec<u32>) -> usize {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let need = top_p * total;
    let wmax = weights.iter().fold(0.0f32, |m, &w| m.max(w));
    // The nucleus is a prefix of the descending order, so it lies inside any set
    // {w >= eps} whose mass already reaches `need`: find such an eps to sort only a few
    // candidates instead of the whole vocabulary.
    let mut eps = wmax * 1e-3;
    loop {
        order.clear();
        let mut mass = 0.0f64;
        for (i, &w) in weights.iter().enumerate() {
            if w >= eps && w > 0.0 {
                order.push(i as u32);
                mass += w as f64;
            }
        }
        if mass >= need || eps == 0.0 {
            break;
        }
        eps = if eps < wmax * 1e-12 { 0.0 } else { eps * 1e-3 };
    }
    order.sort_unstable_by(|&a, &b| {
        weights[b as usize]
            .total_cmp(&weights[a as usize])
            .then(a.cmp(&b))
    });
    let mut kept = 0.0f64;
    let mut n = 0;
    for &i in order.iter() {
        kept += weights[i as usize] as f64;
        n += 1;
        if kept >= need {
            break;
        }
    }
    let target = u * kept;
    let mut acc = 0.0f64;
    for &i in &order[..n] {
        acc += weights[i as usize] as f64;
        if acc > target {
            return i as usize;
        }
    }
    order[n - 1] as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: i64, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    fn draw(logits: &[f32], p: &SamplingParams, u: f64) -> Sampled {
        sample(logits, p, u, &mut Scratch::default()).unwrap()
    }

    #[test]
    fn logprob_is_log_softmax_over_temperature() {
        let logits = [1.0f32, 2.0, 0.5];
        let t = 0.5f32;
        // z/T = [2, 4, 1]; lse = ln(e^2 + e^4 + e^1).
        let lse = (2f64.exp() + 4f64.exp() + 1f64.exp()).ln();
        for u in [0.0, 0.3, 0.99] {
            let s = draw(&logits, &params(t, -1, 1.0), u);
            let want = (logits[s.token as usize] as f64 / t as f64 - lse) as f32;
            assert!((s.logprob - want).abs() < 1e-6, "{s:?} vs {want}");
        }
    }

    #[test]
    fn inverse_cdf_follows_vocabulary_order() {
        // T = 1, weights ∝ [1, 1, 2] → probs [0.25, 0.25, 0.5]; cdf 0.25, 0.5, 1.
        let logits = [0.0f32, 0.0, 2f32.ln()];
        let p = params(1.0, -1, 1.0);
        assert_eq!(draw(&logits, &p, 0.10).token, 0);
        assert_eq!(draw(&logits, &p, 0.30).token, 1);
        assert_eq!(draw(&logits, &p, 0.51).token, 2);
        assert_eq!(draw(&logits, &p, 0.999_999).token, 2);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let logits = [0.1f32, 3.0, -1.0, 3.0];
        let s = draw(&logits, &SamplingParams::greedy(), 0.7);
        assert_eq!(s.token, 1);
        // Greedy log-prob is under T = 1.
        let lse = logits.iter().map(|&z| (z as f64).exp()).sum::<f64>().ln();
        assert!((s.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_only_the_k_largest() {
        let logits = [5.0f32, 1.0, 4.0, 3.0, 0.0];
        let p = params(1.0, 2, 1.0);
        // Kept: tokens 0 and 2 with weights e^5, e^4 → P(0) = e/(e+1) ≈ 0.731.
        let p0 = 1f64.exp() / (1f64.exp() + 1.0);
        assert_eq!(draw(&logits, &p, p0 - 1e-3).token, 0);
        assert_eq!(draw(&logits, &p, p0 + 1e-3).token, 2);
        for i in 0..100 {
            let t = draw(&logits, &p, i as f64 / 100.0).token;
            assert!(t == 0 || t == 2, "{t}");
        }
        // The reported log-prob is still over the full vocabulary.
        let s = draw(&logits, &p, 0.0);
        let lse = logits.iter().map(|&z| (z as f64).exp()).sum::<f64>().ln();
        assert!((s.logprob as f64 - (5.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // probs [0.1, 0.6, 0.3]; top_p 0.8 keeps tokens 1 (0.6) and 2 (0.3, reaches 0.9).
        let logits = [0.1f32.ln(), 0.6f32.ln(), 0.3f32.ln()];
        let p = params(1.0, -1, 0.8);
        // Draw order is descending probability: token 1 owns [0, 0.6/0.9), token 2 the rest.
        assert_eq!(draw(&logits, &p, 0.0).token, 1);
        assert_eq!(draw(&logits, &p, 0.66).token, 1);
        assert_eq!(draw(&logits, &p, 0.67).token, 2);
        for i in 0..100 {
            assert_ne!(draw(&logits, &p, i as f64 / 100.0).token, 0);
        }
        // top_p 0.5: only the top token.
        for i in 0..10 {
            assert_eq!(
                draw(&logits, &params(1.0, -1, 0.5), i as f64 / 10.0).token,
                1
            );
        }
    }

    #[test]
    fn top_p_on_a_long_flat_tail_matches_full_sort() {
        // One big token and many tiny ones: the candidate search must widen until it holds
        // the nucleus.
        let mut logits = vec![0.0f32; 5000];
        logits[17] = 6.0;
        let p = params(1.0, -1, 0.9);
        let w: Vec<f64> = logits.iter().map(|&z| (z as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        // Big token mass e^6/(e^6+4999) ≈ 0.0747 < 0.9, so the nucleus spans most tokens.
        let mut idx: Vec<usize> = (0..w.len()).collect();
        idx.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        let mut kept = 0.0;
        let mut n = 0;
        for &i in &idx {
            kept += w[i];
            n += 1;
            if kept >= 0.9 * total {
                break;
            }
        }
        for u in [0.0, 0.2, 0.5, 0.95] {
            let target = u * kept;
            let mut acc = 0.0;
            let mut want = idx[n - 1];
            for &i in &idx[..n] {
                acc += w[i];
                if acc > target {
                    want = i;
                    break;
                }
            }
            assert_eq!(draw(&logits, &p, u).token as usize, want, "u={u}");
        }
    }

    #[test]
    fn empirical_frequencies_match_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0];
        let t = 2.0f32;
        let w: Vec<f64> = logits
            .iter()
            .map(|&z| (z as f64 / t as f64).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let key = sample_key(7, &[1, 2, 3], 0, 0);
        let n = 20_000;
        let mut counts = [0usize; 3];
        let mut scratch = Scratch::default();
        for pos in 0..n {
            let s = sample(
                &logits,
                &params(t, -1, 1.0),
                uniform(key, pos),
                &mut scratch,
            )
            .unwrap();
            counts[s.token as usize] += 1;
        }
        for i in 0..3 {
            let freq = counts[i] as f64 / n as f64;
            // 4 standard deviations of a binomial proportion at n = 20k is < 0.015.
            assert!((freq - w[i] / total).abs() < 0.015, "{i}: {freq}");
        }
    }

    #[test]
    fn keys_and_uniforms_are_pure_functions() {
        let a = sample_key(1, &[5, 6], 0, 3);
        assert_eq!(a, sample_key(1, &[5, 6], 0, 3));
        assert_ne!(a, sample_key(2, &[5, 6], 0, 3));
        assert_ne!(a, sample_key(1, &[5, 7], 0, 3));
        assert_ne!(a, sample_key(1, &[5, 6], 1, 3));
        assert_ne!(a, sample_key(1, &[5, 6], 0, 4));
        assert_ne!(a, sample_key(1, &[5, 6, 0], 0, 3));
        assert_eq!(uniform(a, 9), uniform(a, 9));
        assert_ne!(uniform(a, 9), uniform(a, 10));
        let mean: f64 = (0..10_000).map(|i| uniform(a, i)).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!((0..10_000).all(|i| (0.0..1.0).contains(&uniform(a, i))));
    }

    #[test]
    fn bad_params_and_logits_are_rejected() {
        assert!(params(-1.0, -1, 1.0).validate().is_err());
        assert!(params(1.0, 0, 1.0).validate().is_err());
        assert!(params(1.0, -1, 0.0).validate().is_err());
        assert!(params(1.0, -1, 1.5).validate().is_err());
        assert!(params(0.0, 5, 0.9).validate().is_ok());
        let err = sample(
            &[0.0, f32::NAN],
            &params(1.0, -1, 1.0),
            0.5,
            &mut Scratch::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("token 1 is NaN"), "{err}");
    }
}
