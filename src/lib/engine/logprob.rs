//! Scoring: the log-prob (and entropy) of every response token given its prompt and the
//! response tokens before it, packed into micro-batches by a token budget.

use super::Policy;
use crate::model::decoder::{SeqRef, TokenStats};
use anyhow::{bail, ensure, Result};
use std::ops::Range;

/// One sequence: the prompt, then the response whose tokens are scored.
#[derive(Clone, Copy, Debug)]
pub struct PromptResponse<'a> {
    pub prompt: &'a [u32],
    pub response: &'a [u32],
}

impl PromptResponse<'_> {
    pub fn len(&self) -> usize {
        self.prompt.len() + self.response.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// prompt ++ response.
    pub(crate) fn joined(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(self.prompt);
        v.extend_from_slice(self.response);
        v
    }
}

/// Splits items of the given token counts, in order, into consecutive groups of at most
/// `budget` tokens; an item larger than the budget forms a group of its own.
pub(crate) fn micro_batches(tokens: &[usize], budget: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (i, &n) in tokens.iter().enumerate() {
        if i > start && used + n > budget {
            groups.push(start..i);
            start = i;
            used = 0;
        }
        used += n;
    }
    if start < tokens.len() {
        groups.push(start..tokens.len());
    }
    groups
}

/// The log-probs of each row's response tokens under softmax(logits / temperature), with
/// entropies when asked. Rows with an empty response get empty stats. `progress` is told the
/// number of rows done.
pub fn score(
    policy: &mut dyn Policy,
    rows: &[PromptResponse],
    temperature: f32,
    entropy: bool,
    micro_batch_tokens: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<TokenStats>> {
    ensure!(
        temperature > 0.0 && temperature.is_finite(),
        "temperature must be > 0, got {temperature}"
    );
    for (i, r) in rows.iter().enumerate() {
        if r.prompt.is_empty() {
            bail!("row {i}: empty prompt (the first response token has no context)");
        }
    }
    let empty = TokenStats {
        logprobs: vec![],
        entropy: entropy.then(Vec::new),
    };
    let mut out = vec![empty; rows.len()];
    let todo: Vec<usize> = (0..rows.len())
        .filter(|&i| !rows[i].response.is_empty())
        .collect();
    let lens: Vec<usize> = todo.iter().map(|&i| rows[i].len()).collect();
    let mut done = rows.len() - todo.len();
    for group in micro_batches(&lens, micro_batch_tokens.max(1)) {
        super::cancel::check()?;
        let idx = &todo[group];
        let joined: Vec<Vec<u32>> = idx.iter().map(|&i| rows[i].joined()).collect();
        let seqs: Vec<SeqRef> = idx
            .iter()
            .zip(&joined)
            .map(|(&i, t)| SeqRef {
                tokens: t,
                start: rows[i].prompt.len(),
            })
            .collect();
        let stats = policy.logprobs(&seqs, temperature, entropy)?;
        ensure!(
            stats.len() == idx.len(),
            "scored {} of {} sequences",
            stats.len(),
            idx.len()
        );
        for (&i, s) in idx.iter().zip(stats) {
            let n = rows[i].response.len();
            ensure!(
                s.logprobs.len() == n && (!entropy || s.entropy.as_ref().map(Vec::len) == Some(n)),
                "row {i}: scoring returned {} log-probs for {n} tokens",
                s.logprobs.len()
            );
            out[i] = s;
        }
        done += idx.len();
        progress(done);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::testing::Bigram;

    #[test]
    fn micro_batches_respect_the_budget() {
        assert_eq!(micro_batches(&[3, 3, 3], 6), vec![0..2, 2..3]);
        assert_eq!(micro_batches(&[3, 3, 3], 100), vec![0..3]);
        assert_eq!(micro_batches(&[10, 2, 2, 10], 5), vec![0..1, 1..3, 3..4]);
        assert_eq!(micro_batches(&[1, 1], 1), vec![0..1, 1..2]);
        assert!(micro_batches(&[], 5).is_empty());
    }

    #[test]
    fn scores_match_the_model_whatever_the_packing() {
        let mut model = Bigram::random(12, 3);
        let data: Vec<(Vec<u32>, Vec<u32>)> = vec![
            (vec![1, 2], vec![3, 4, 5]),
            (vec![7], vec![]),
            (vec![0, 11, 4], vec![9]),
            (vec![5], vec![6, 6, 6, 6, 2]),
        ];
        let rows: Vec<PromptResponse> = data
            .iter()
            .map(|(p, r)| PromptResponse {
                prompt: p,
                response: r,
            })
            .collect();
        let t = 0.7;
        let all = score(&mut model, &rows, t, true, 1_000, &mut |_| {}).unwrap();
        for budget in [1, 4, 6, 9] {
            let mut calls = 0;
            let got = score(&mut model, &rows, t, true, budget, &mut |_| calls += 1).unwrap();
            assert_eq!(got, all, "budget {budget}");
            assert!(calls >= 2);
        }
        // Hand check against the bigram's closed form.
        for (r, s) in rows.iter().zip(&all) {
            let ctx = r.joined();
            for (j, &lp) in s.logprobs.iter().enumerate() {
                let pos = r.prompt.len() + j;
                let (want, ent) = model.token_stats(ctx[pos - 1], ctx[pos], t);
                assert!((lp - want).abs() < 1e-6);
                assert!((s.entropy.as_ref().unwrap()[j] - ent).abs() < 1e-6);
            }
        }
        assert!(all[1].logprobs.is_empty() && all[1].entropy == Some(vec![]));
    }

    #[test]
    fn empty_prompt_is_rejected() {
        let rows = [PromptResponse {
            prompt: &[],
            response: &[1],
        }];
        let err = score(
            &mut Bigram::random(4, 0),
            &rows,
            1.0,
            false,
            10,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(err.to_string().contains("row 0: empty prompt"), "{err}");
    }
}
