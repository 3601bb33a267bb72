//! Advantage estimators, one small function each, registered by name in [`ESTIMATORS`]
//! (verl's `register_adv_est`). They follow verl's `verl/trainer/ppo/core_algos.py` formula by
//! formula, on ragged rows (one row per sampled sequence, no padding).
//!
//! Conventions shared by all of them:
//! - The sequence score sits on the last valid (mask = 1) token of its row ([`token_rewards`]);
//!   with a KL penalty in the reward every valid token also carries −β·kl.
//! - Outcome estimators use the row's outcome s_i = Σ_t token_rewards (verl's
//!   `token_level_rewards.sum(-1)`); a row without any valid token still has its score as
//!   outcome (verl puts it on the padding) so it counts in its group's statistics.
//! - Groups are the rows sharing a `prompt_uid`.
//! - Outputs are 0 on masked positions; whitening (verl's `masked_whiten`) uses valid tokens only.
//! - Observation tokens (mask 0 inside a response, e.g. tool output) are skipped by the
//!   recursions: gae carries V and A across them as verl does, and reinforce_plus_plus carries
//!   its discounted return across them the same way. (verl's reinforce_plus_plus resets the
//!   return at every mask-0 token, which is right for its right padding but would cut a
//!   multi-turn response's earlier turns off the final score; rows here have no padding, and on
//!   responses without observation tokens both agree.)

use super::kl::KlPenalty;
use super::rows_mut;
use crate::bail_input;
use crate::batch::schema;
use anyhow::Result;
use rayon::prelude::*;
use std::collections::HashMap;

/// The knobs estimators read (verl's `algorithm` config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdvParams {
    pub(crate) gamma: f64,
    pub(crate) lam: f64,
    /// GRPO divides by the group std (false = Dr.GRPO).
    pub(crate) norm_by_std: bool,
    pub(crate) epsilon: f64,
}

impl Default for AdvParams {
    fn default() -> Self {
        AdvParams {
            gamma: 1.0,
            lam: 1.0,
            norm_by_std: true,
            epsilon: 1e-6,
        }
    }
}

/// Rows grouped by key (the `prompt_uid` of the n samples of one prompt), groups numbered in
/// order of first appearance.
#[derive(Clone, Debug, PartialEq)]
pub struct Groups {
    pub(crate) of_row: Vec<usize>,
    pub(crate) count: usize,
}

impl Groups {
    pub(crate) fn from_keys<S: AsRef<str>>(keys: &[S]) -> Groups {
        let mut ids: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        let of_row = keys
            .iter()
            .map(|k| {
                let next = ids.len();
                *ids.entry(k.as_ref()).or_insert(next)
            })
            .collect();
        Groups {
            of_row,
            count: ids.len(),
        }
    }

    /// Group sizes.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        let mut n = vec![0usize; self.count];
        for &g in &self.of_row {
            n[g] += 1;
        }
        n
    }

    /// Per-group mean of `x` (n = 1 gives mean 0, as verl) and unbiased std (n = 1 gives 1).
    pub(crate) fn mean_std(&self, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let n = self.sizes();
        let mut sum = vec![0.0; self.count];
        for (&g, &v) in self.of_row.iter().zip(x) {
            sum[g] += v;
        }
        let mean: Vec<f64> = (0..self.count)
            .map(|g| if n[g] > 1 { sum[g] / n[g] as f64 } else { 0.0 })
            .collect();
        let mut sq = vec![0.0; self.count];
        for (&g, &v) in self.of_row.iter().zip(x) {
            sq[g] += (v - mean[g]) * (v - mean[g]);
        }
        let std = (0..self.count)
            .map(|g| {
                if n[g] > 1 {
                    (sq[g] / (n[g] - 1) as f64).sqrt()
                } else {
                    1.0
                }
            })
            .collect();
        (mean, std)
    }
}

/// What an estimator reads. `outcome` is the per-row sequence reward (see the module docs).
pub(crate) struct AdvInput<'a> {
    pub(crate) offsets: &'a [usize],
    pub(crate) mask: &'a [u8],
    pub(crate) token_rewards: &'a [f32],
    pub(crate) outcome: &'a [f64],
    pub(crate) groups: Option<&'a Groups>,
    /// The critic's value per token (gae).
    pub(crate) values: Option<&'a [f32]>,
    /// The greedy baseline's score per row (remax).
    pub(crate) baseline: Option<&'a [f32]>,
}

impl AdvInput<'_> {
    pub(crate) fn num_rows(&self) -> usize {
        self.offsets.len() - 1
    }

    fn groups(&self, who: &str) -> Result<&Groups> {
        match self.groups {
            Some(g) => Ok(g),
            None => bail_input!("--estimator {who} groups rows by '{}'", schema::PROMPT_UID),
        }
    }
}

/// Advantages and returns per token, 0 on masked positions.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AdvOutput {
    pub(crate) advantages: Vec<f32>,
    pub(crate) returns: Vec<f32>,
}

pub(crate) type AdvFn = fn(&AdvInput, &AdvParams) -> Result<AdvOutput>;

/// One registered estimator.
pub(crate) struct Estimator {
    pub(crate) name: &'static str,
    /// Columns it needs besides `response_mask` and `score`, and why (for error messages).
    pub(crate) needs: &'static [(&'static str, &'static str)],
    pub(crate) run: AdvFn,
}

const GROUPED: &[(&str, &str)] = &[(schema::PROMPT_UID, "it groups the samples of one prompt")];

/// The registry, by name.
pub(crate) const ESTIMATORS: &[Estimator] = &[
    Estimator {
        name: "grpo",
        needs: GROUPED,
        run: grpo,
    },
    Estimator {
        name: "rloo",
        needs: GROUPED,
        run: rloo,
    },
    Estimator {
        name: "reinforce_plus_plus",
        needs: &[],
        run: reinforce_plus_plus,
    },
    Estimator {
        name: "reinforce_plus_plus_baseline",
        needs: GROUPED,
        run: reinforce_plus_plus_baseline,
    },
    Estimator {
        name: "opo",
        needs: GROUPED,
        run: opo,
    },
    Estimator {
        name: "gpg",
        needs: GROUPED,
        run: gpg,
    },
    Estimator {
        name: "remax",
        needs: &[(
            schema::BASELINE_SCORE,
            "it subtracts the score of the prompt's greedy sample: run rollout with --baseline greedy, whose baseline rows give it",
        )],
        run: remax,
    },
    Estimator {
        name: "gae",
        needs: &[(schema::VALUES, "it needs the critic's value of every token")],
        run: gae,
    },
];

pub(crate) fn estimator(name: &str) -> Option<&'static Estimator> {
    ESTIMATORS.iter().find(|e| e.name == name)
}

pub(crate) fn names() -> Vec<&'static str> {
    ESTIMATORS.iter().map(|e| e.name).collect()
}

/// The KL penalty put into the reward: r_t −= β·kl(old_t, ref_t) on valid tokens.
pub(crate) struct KlInReward<'a> {
    pub(crate) old: &'a [f32],
    pub(crate) ref_lp: &'a [f32],
    pub(crate) penalty: KlPenalty,
    pub(crate) beta: f64,
}

/// Token rewards and per-row outcomes.
pub(crate) struct Rewards {
    pub(crate) token_rewards: Vec<f32>,
    pub(crate) outcome: Vec<f64>,
    /// With a KL penalty: the batch mean over rows of each row's mean KL on its valid tokens
    /// (verl's `current_kl`, what the adaptive controller sees).
    pub(crate) kl: Option<f64>,
}

/// Place each row's score on its last valid token and subtract β·kl on every valid token.
pub(crate) fn token_rewards(
    offsets: &[usize],
    mask: &[u8],
    scores: &[f32],
    kl: Option<&KlInReward>,
) -> Rewards {
    let mut out = vec![0f32; mask.len()];
    let rows = rows_mut(&mut out, offsets);
    // (outcome, row mean kl)
    let per_row: Vec<(f64, f64)> = rows
        .into_par_iter()
        .enumerate()
        .map(|(i, r)| {
            let (a, b) = (offsets[i], offsets[i + 1]);
            let m = &mask[a..b];
            let beta = kl.map_or(0.0, |k| k.beta);
            let (mut kl_sum, mut n, mut last) = (0.0f64, 0usize, None);
            for t in 0..r.len() {
                if m[t] != 0 {
                    let v = kl.map_or(0.0, |k| {
                        k.penalty.value(k.old[a + t] as f64, k.ref_lp[a + t] as f64)
                    });
                    kl_sum += v;
                    n += 1;
                    r[t] = (-beta * v) as f32;
                    last = Some((t, v));
                }
            }
            let score = scores[i] as f64;
            if let Some((t, v)) = last {
                r[t] = (score - beta * v) as f32;
            }
            // verl: masked_mean(kld, mask, axis=-1) = Σ mask·kl / (n + 1e-8)
            (score - beta * kl_sum, kl_sum / (n as f64 + 1e-8))
        })
        .collect();
    let outcome = per_row.iter().map(|p| p.0).collect();
    let kl_mean = kl.map(|_| {
        let n = per_row.len().max(1) as f64;
        per_row.iter().map(|p| p.1).sum::<f64>() / n
    });
    Rewards {
        token_rewards: out,
        outcome,
        kl: kl_mean,
    }
}

/// A per-row scalar on every valid token of its row, 0 elsewhere.
pub(crate) fn broadcast(offsets: &[usize], mask: &[u8], per_row: &[f64]) -> Vec<f32> {
    let mut out = vec![0f32; mask.len()];
    rows_mut(&mut out, offsets)
        .into_par_iter()
        .enumerate()
        .for_each(|(i, r)| {
            let m = &mask[offsets[i]..offsets[i + 1]];
            let v = per_row[i] as f32;
            for (x, &k) in r.iter_mut().zip(m) {
                if k != 0 {
                    *x = v;
                }
            }
        });
    out
}

/// Valid-token count and Σ f(x) over mask = 1, in parallel chunks.
fn masked_sum(mask: &[u8], x: &[f32], f: impl Fn(f64) -> f64 + Sync) -> (usize, f64) {
    const CHUNK: usize = 1 << 16;
    mask.par_chunks(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .map(|(m, v)| {
            let mut n = 0usize;
            let mut s = 0.0f64;
            for (&k, &y) in m.iter().zip(v) {
                if k != 0 {
                    n += 1;
                    s += f(y as f64);
                }
            }
            (n, s)
        })
        .reduce(|| (0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// verl's `masked_whiten`: x ← (x − mean)/sqrt(var + 1e-8) with mean = Σx/(n + 1e-8) and the
/// unbiased var = Σ(x − mean)²/(n + 1e-8)·n/(n − 1), over valid tokens; masked positions ← 0.
pub(crate) fn masked_whiten(x: &mut [f32], mask: &[u8], who: &str) -> Result<()> {
    let (n, sum) = masked_sum(mask, x, |y| y);
    if n < 2 {
        bail_input!(
            "--estimator {who} whitens over all valid tokens of the batch and needs at least 2, found {n}"
        );
    }
    let nf = n as f64;
    let mean = sum / (nf + 1e-8);
    let (_, sq) = masked_sum(mask, x, |y| (y - mean) * (y - mean));
    let var = sq / (nf + 1e-8) * (nf / (nf - 1.0));
    let inv = 1.0 / (var + 1e-8).sqrt();
    x.par_chunks_mut(1 << 16)
        .zip(mask.par_chunks(1 << 16))
        .for_each(|(v, m)| {
            for (y, &k) in v.iter_mut().zip(m) {
                *y = if k != 0 {
                    ((*y as f64 - mean) * inv) as f32
                } else {
                    0.0
                };
            }
        });
    Ok(())
}

/// Advantages equal returns: one scalar per row, broadcast over its valid tokens.
fn outcome_output(x: &AdvInput, per_row: &[f64]) -> AdvOutput {
    let advantages = broadcast(x.offsets, x.mask, per_row);
    AdvOutput {
        returns: advantages.clone(),
        advantages,
    }
}

// A_i = (s_i − mean_g)/(std_g + ε), std unbiased, a group of one has mean 0 and std 1;
// Dr.GRPO (norm_by_std = false): A_i = s_i − mean_g.
fn grpo(x: &AdvInput, p: &AdvParams) -> Result<AdvOutput> {
    let g = x.groups("grpo")?;
    let (mean, std) = g.mean_std(x.outcome);
    let a: Vec<f64> = (0..x.num_rows())
        .map(|i| {
            let k = g.of_row[i];
            let centered = x.outcome[i] - mean[k];
            if p.norm_by_std {
                centered / (std[k] + p.epsilon)
            } else {
                centered
            }
        })
        .collect();
    Ok(outcome_output(x, &a))
}

// A_i = n/(n−1)·(s_i − mean_g) for n > 1; a group of one keeps A_i = s_i (verl's `rloo`).
fn rloo(x: &AdvInput, _: &AdvParams) -> Result<AdvOutput> {
    let g = x.groups("rloo")?;
    let (mean, _) = g.mean_std(x.outcome);
    let n = g.sizes();
    let a: Vec<f64> = (0..x.num_rows())
        .map(|i| {
            let (k, s) = (g.of_row[i], x.outcome[i]);
            let c = n[k] as f64;
            if n[k] > 1 {
                s * c / (c - 1.0) - mean[k] * c / (c - 1.0)
            } else {
                s
            }
        })
        .collect();
    Ok(outcome_output(x, &a))
}

// G_t = r_t + γ·G_{t+1} over valid tokens (observation tokens pass G through); A = whiten(G).
fn reinforce_plus_plus(x: &AdvInput, p: &AdvParams) -> Result<AdvOutput> {
    let mut returns = vec![0f32; x.mask.len()];
    rows_mut(&mut returns, x.offsets)
        .into_par_iter()
        .enumerate()
        .for_each(|(i, out)| {
            let a = x.offsets[i];
            let mut running = 0.0f64;
            for t in (0..out.len()).rev() {
                if x.mask[a + t] != 0 {
                    running = x.token_rewards[a + t] as f64 + p.gamma * running;
                    out[t] = running as f32;
                }
            }
        });
    let mut advantages = returns.clone();
    masked_whiten(&mut advantages, x.mask, "reinforce_plus_plus")?;
    Ok(AdvOutput {
        advantages,
        returns,
    })
}

// A = whiten((s_i − mean_g) on every valid token), a group of one has mean 0.
fn reinforce_plus_plus_baseline(x: &AdvInput, _: &AdvParams) -> Result<AdvOutput> {
    let g = x.groups("reinforce_plus_plus_baseline")?;
    let (mean, _) = g.mean_std(x.outcome);
    let a: Vec<f64> = (0..x.num_rows())
        .map(|i| x.outcome[i] - mean[g.of_row[i]])
        .collect();
    let mut advantages = broadcast(x.offsets, x.mask, &a);
    masked_whiten(&mut advantages, x.mask, "reinforce_plus_plus_baseline")?;
    Ok(AdvOutput {
        returns: advantages.clone(),
        advantages,
    })
}

// A_i = s_i − Σ_g |y_j|·s_j / Σ_g |y_j| with |y| the valid-token count; a group of one has
// baseline 0.
fn opo(x: &AdvInput, _: &AdvParams) -> Result<AdvOutput> {
    let g = x.groups("opo")?;
    let n = g.sizes();
    let len: Vec<f64> = x
        .offsets
        .windows(2)
        .map(|w| x.mask[w[0]..w[1]].iter().filter(|&&m| m != 0).count() as f64)
        .collect();
    let (mut num, mut den) = (vec![0.0; g.count], vec![0.0; g.count]);
    for i in 0..x.num_rows() {
        num[g.of_row[i]] += len[i] * x.outcome[i];
        den[g.of_row[i]] += len[i];
    }
    let a: Vec<f64> = (0..x.num_rows())
        .map(|i| {
            let k = g.of_row[i];
            // A group whose rows are all fully masked has no valid token to weight; its
            // advantages are 0 on every (masked) position whatever the baseline.
            let bsl = if n[k] > 1 && den[k] > 0.0 {
                num[k] / den[k]
            } else {
                0.0
            };
            x.outcome[i] - bsl
        })
        .collect();
    Ok(outcome_output(x, &a))
}

// A_i = α·(s_i − mean_g)/f_norm with α = B / max(#rows with s ≠ 0, 1), f_norm = 1.
fn gpg(x: &AdvInput, _: &AdvParams) -> Result<AdvOutput> {
    let g = x.groups("gpg")?;
    let (mean, _) = g.mean_std(x.outcome);
    let nonzero = x.outcome.iter().filter(|&&s| s != 0.0).count();
    let alpha = x.num_rows() as f64 / nonzero.max(1) as f64;
    let a: Vec<f64> = (0..x.num_rows())
        .map(|i| alpha * (x.outcome[i] - mean[g.of_row[i]]))
        .collect();
    Ok(outcome_output(x, &a))
}

/// ReMax's baseline of every sample row: the score of its group's baseline row (verl scores one
/// greedy response per prompt and broadcasts it to the prompt's samples). `keys` are the rows'
/// prompt_uids; the result has one entry per row that is not a baseline, in order. A group of
/// samples without a baseline row, or with two, is an input error naming its prompt_uid.
pub(crate) fn group_baselines(
    keys: &[&str],
    scores: &[f32],
    is_baseline: &[bool],
) -> Result<Vec<f32>> {
    let mut of_group: HashMap<&str, (f32, usize)> = HashMap::new();
    for ((&k, &s), _) in keys.iter().zip(scores).zip(is_baseline).filter(|(_, &b)| b) {
        let e = of_group.entry(k).or_insert((s, 0));
        e.1 += 1;
        if e.1 > 1 {
            bail_input!(
                "prompt_uid {k} has {} baseline rows ({} = true); a group has one",
                e.1,
                schema::IS_BASELINE
            );
        }
    }
    let mut out = Vec::with_capacity(keys.len() - of_group.len());
    for (&k, _) in keys.iter().zip(is_baseline).filter(|(_, &b)| !b) {
        match of_group.get(k) {
            Some(&(s, _)) => out.push(s),
            None => bail_input!(
                "prompt_uid {k} has no baseline row ({} = true) among its rows: `rollout --baseline greedy` adds one to every prompt's group",
                schema::IS_BASELINE
            ),
        }
    }
    Ok(out)
}

// G_t = Σ_{u ≥ t} mask_u·r_u; A_t = G_t − b_i with b_i the greedy sample's score.
fn remax(x: &AdvInput, _: &AdvParams) -> Result<AdvOutput> {
    let Some(baseline) = x.baseline else {
        bail_input!("--estimator remax needs '{}'", schema::BASELINE_SCORE)
    };
    let mut returns = vec![0f32; x.mask.len()];
    let mut advantages = vec![0f32; x.mask.len()];
    rows_mut(&mut returns, x.offsets)
        .into_par_iter()
        .zip(rows_mut(&mut advantages, x.offsets))
        .enumerate()
        .for_each(|(i, (ret, adv))| {
            let a = x.offsets[i];
            let mut g = 0.0f64;
            for t in (0..ret.len()).rev() {
                if x.mask[a + t] != 0 {
                    g += x.token_rewards[a + t] as f64;
                    ret[t] = g as f32;
                    adv[t] = (g - baseline[i] as f64) as f32;
                }
            }
        });
    Ok(AdvOutput {
        advantages,
        returns,
    })
}

// δ_t = r_t + γ·V_next − V_t; A_t = δ_t + γλ·A_next, where observation tokens (mask 0) pass
// V_next and A_next through unchanged; returns = A + V; advantages = whiten(A).
fn gae(x: &AdvInput, p: &AdvParams) -> Result<AdvOutput> {
    let Some(values) = x.values else {
        bail_input!("--estimator gae needs '{}'", schema::VALUES)
    };
    let mut advantages = vec![0f32; x.mask.len()];
    let mut returns = vec![0f32; x.mask.len()];
    rows_mut(&mut advantages, x.offsets)
        .into_par_iter()
        .zip(rows_mut(&mut returns, x.offsets))
        .enumerate()
        .for_each(|(i, (adv, ret))| {
            let a = x.offsets[i];
            let (mut next_v, mut last) = (0.0f64, 0.0f64);
            for t in (0..adv.len()).rev() {
                if x.mask[a + t] == 0 {
                    continue;
                }
                let v = values[a + t] as f64;
                let delta = x.token_rewards[a + t] as f64 + p.gamma * next_v - v;
                last = delta + p.gamma * p.lam * last;
                next_v = v;
                adv[t] = last as f32;
                ret[t] = (last + v) as f32;
            }
        });
    masked_whiten(&mut advantages, x.mask, "gae")?;
    Ok(AdvOutput {
        advantages,
        returns,
    })
}

/// Mean, std (unbiased), min and max of `x` over valid tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct MaskedStats {
    pub(crate) count: usize,
    pub(crate) mean: f64,
    pub(crate) std: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

pub(crate) fn masked_stats(mask: &[u8], x: &[f32]) -> MaskedStats {
    let (count, sum) = masked_sum(mask, x, |y| y);
    let mean = if count > 0 { sum / count as f64 } else { 0.0 };
    let (_, sq) = masked_sum(mask, x, |y| (y - mean) * (y - mean));
    let (min, max) = mask
        .par_chunks(1 << 16)
        .zip(x.par_chunks(1 << 16))
        .map(|(m, v)| {
            m.iter()
                .zip(v)
                .filter(|(&k, _)| k != 0)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, &y)| {
                    (lo.min(y as f64), hi.max(y as f64))
                })
        })
        .reduce(
            || (f64::INFINITY, f64::NEG_INFINITY),
            |a, b| (a.0.min(b.0), a.1.max(b.1)),
        );
    MaskedStats {
        count,
        mean,
        std: if count > 1 {
            (sq / (count - 1) as f64).sqrt()
        } else {
            0.0
        },
        min: if count > 0 { min } else { 0.0 },
        max: if count > 0 { max } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Six rows in three groups:
    /// - "a": scores 1, 0, 0.5; masks [1,1,1], [1,1], [1,0,1,0] (valid lengths 3, 2, 2)
    /// - "b": one row, score -2, mask [1,1]
    /// - "c": scores 3, 3 (all equal); the first row fully masked [0,0], the second [1]
    struct Fixture {
        offsets: Vec<usize>,
        mask: Vec<u8>,
        scores: Vec<f32>,
        groups: Groups,
    }

    fn fixture() -> Fixture {
        let masks: [&[u8]; 6] = [&[1, 1, 1], &[1, 1], &[1, 0, 1, 0], &[1, 1], &[0, 0], &[1]];
        let mut offsets = vec![0];
        let mut mask = vec![];
        for m in masks {
            mask.extend_from_slice(m);
            offsets.push(mask.len());
        }
        Fixture {
            offsets,
            mask,
            scores: vec![1.0, 0.0, 0.5, -2.0, 3.0, 3.0],
            groups: Groups::from_keys(&["a", "a", "a", "b", "c", "c"]),
        }
    }

    fn run(name: &str, p: &AdvParams, baseline: Option<&[f32]>) -> (Rewards, AdvOutput) {
        let f = fixture();
        let r = token_rewards(&f.offsets, &f.mask, &f.scores, None);
        let x = AdvInput {
            offsets: &f.offsets,
            mask: &f.mask,
            token_rewards: &r.token_rewards,
            outcome: &r.outcome,
            groups: Some(&f.groups),
            values: None,
            baseline,
        };
        let out = (estimator(name).unwrap().run)(&x, p).unwrap();
        (r, out)
    }

    /// Expand one value per row onto the fixture's valid tokens.
    fn per_row(v: [f64; 6]) -> Vec<f32> {
        let f = fixture();
        broadcast(&f.offsets, &f.mask, &v)
    }

    fn close(got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol,
                "index {i}: got {g}, want {w}\n{got:?}\n{want:?}"
            );
        }
    }

    #[test]
    fn groups_and_token_rewards() {
        let f = fixture();
        assert_eq!(f.groups.of_row, vec![0, 0, 0, 1, 2, 2]);
        assert_eq!(f.groups.sizes(), vec![3, 1, 2]);
        let r = token_rewards(&f.offsets, &f.mask, &f.scores, None);
        // Each score on its row's last valid token; the fully masked row has nowhere to put it.
        #[rustfmt::skip]
        let want = [0., 0., 1.,  0., 0.,  0., 0., 0.5, 0.,  0., -2.,  0., 0.,  3.];
        close(&r.token_rewards, &want, 0.0);
        // ...but its outcome is still its score.
        assert_eq!(r.outcome, vec![1.0, 0.0, 0.5, -2.0, 3.0, 3.0]);
        assert_eq!(r.kl, None);
    }

    #[test]
    fn grpo_hand_values() {
        let (_, out) = run("grpo", &AdvParams::default(), None);
        // a: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0)/2) = 0.5 -> ±0.5/(0.5 + 1e-6), 0
        // b: a group of one: mean 0, std 1 -> -2/(1 + 1e-6)
        // c: all equal: 0/(0 + 1e-6) = 0
        let e = 1e-6;
        let want = per_row([
            0.5 / (0.5 + e),
            -0.5 / (0.5 + e),
            0.0,
            -2.0 / (1.0 + e),
            0.0,
            0.0,
        ]);
        close(&out.advantages, &want, 1e-7);
        assert_eq!(out.returns, out.advantages);
        // Dr.GRPO: no division by the std
        let p = AdvParams {
            norm_by_std: false,
            ..AdvParams::default()
        };
        let (_, out) = run("grpo", &p, None);
        close(
            &out.advantages,
            &per_row([0.5, -0.5, 0.0, -2.0, 0.0, 0.0]),
            0.0,
        );
    }

    #[test]
    fn rloo_hand_values() {
        let (_, out) = run("rloo", &AdvParams::default(), None);
        // a: n = 3: 3/2 * (s - 0.5) = 0.75, -0.75, 0; b: a group of one keeps its score -2;
        // c: 2 * (3 - 3) = 0
        close(
            &out.advantages,
            &per_row([0.75, -0.75, 0.0, -2.0, 0.0, 0.0]),
            1e-7,
        );
    }

    #[test]
    fn opo_hand_values() {
        let (_, out) = run("opo", &AdvParams::default(), None);
        // a: baseline (3*1 + 2*0 + 2*0.5) / (3 + 2 + 2) = 4/7; b: alone, baseline 0;
        // c: (0*3 + 1*3) / (0 + 1) = 3
        let b = 4.0 / 7.0;
        close(
            &out.advantages,
            &per_row([1.0 - b, -b, 0.5 - b, -2.0, 0.0, 0.0]),
            1e-7,
        );
    }

    #[test]
    fn gpg_hand_values() {
        let (_, out) = run("gpg", &AdvParams::default(), None);
        // 5 of 6 outcomes are nonzero: alpha = 6/5; group means 0.5, 0 (alone), 3
        close(
            &out.advantages,
            &per_row([0.6, -0.6, 0.0, -2.4, 0.0, 0.0]),
            1e-6,
        );
    }

    #[test]
    fn reinforce_plus_plus_baseline_hand_values() {
        let (_, out) = run("reinforce_plus_plus_baseline", &AdvParams::default(), None);
        // Before whitening, on valid tokens: 0.5 (x3), -0.5 (x2), 0 (x2), -2 (x2), 0 (x1).
        // n = 10, sum = 1.5 - 1 - 4 = -3.5, mean = -0.35;
        // Σ(x - mean)² = 3*0.85² + 2*0.15² + 2*0.35² + 2*1.65² + 0.35² = 8.025; var = 8.025/9
        let mean = -3.5 / (10.0 + 1e-8);
        let sd = (8.025 / 9.0 + 1e-8f64).sqrt();
        let w = |x: f64| (x - mean) / sd;
        let want = per_row([w(0.5), w(-0.5), w(0.0), w(-2.0), 0.0, w(0.0)]);
        close(&out.advantages, &want, 1e-6);
    }

    #[test]
    fn reinforce_plus_plus_hand_values() {
        let p = AdvParams {
            gamma: 0.5,
            ..AdvParams::default()
        };
        let (_, out) = run("reinforce_plus_plus", &p, None);
        // Discounted returns over valid tokens (gamma 0.5); the observation token of row 2
        // passes the return through (verl would cut it there, see the module docs):
        // [0.25, 0.5, 1], [0, 0], [0.25, -, 0.5, -], [-1, -2], [-, -], [3]
        #[rustfmt::skip]
        let returns: [f32; 14] = [0.25, 0.5, 1.0,  0.0, 0.0,  0.25, 0.0, 0.5, 0.0,  -1.0, -2.0,  0.0, 0.0,  3.0];
        close(&out.returns, &returns, 0.0);
        // n = 10, sum = 1.75 + 0 + 0.75 - 3 + 3 = 2.5, mean 0.25;
        // Σ(x - mean)² = 0 + .0625 + .5625 + .0625 + .0625 + 0 + .0625 + 1.5625 + 5.0625 + 7.5625
        // = 15, var = 15/9
        let mean = 2.5 / (10.0 + 1e-8);
        let sd = (15.0 / 9.0 + 1e-8f64).sqrt();
        let f = fixture();
        let want: Vec<f32> = returns
            .iter()
            .zip(&f.mask)
            .map(|(&g, &m)| {
                if m != 0 {
                    ((g as f64 - mean) / sd) as f32
                } else {
                    0.0
                }
            })
            .collect();
        close(&out.advantages, &want, 1e-6);
    }

    #[test]
    fn remax_hand_values() {
        let b = [0.5, 0.5, 0.5, -1.0, 0.0, 2.0];
        let (_, out) = run("remax", &AdvParams::default(), Some(&b));
        // Reward-to-go (no discount) over valid tokens, minus the row's greedy baseline.
        #[rustfmt::skip]
        let returns = [1.0, 1.0, 1.0,  0.0, 0.0,  0.5, 0.0, 0.5, 0.0,  -2.0, -2.0,  0.0, 0.0,  3.0];
        close(&out.returns, &returns, 0.0);
        #[rustfmt::skip]
        let adv = [0.5, 0.5, 0.5,  -0.5, -0.5,  0.0, 0.0, 0.0, 0.0,  -1.0, -1.0,  0.0, 0.0,  1.0];
        close(&out.advantages, &adv, 0.0);
    }

    #[test]
    fn group_baselines_take_each_groups_baseline_row() {
        // Groups a (two samples, baseline 0.5 written between them) and b (baseline first).
        let keys = ["a", "a", "b", "a", "b", "b"];
        let scores = [1.0, 0.5, 2.0, 0.0, -1.0, 7.0];
        let is_b = [false, true, true, false, false, false];
        let b = group_baselines(&keys, &scores, &is_b).unwrap();
        assert_eq!(b, vec![0.5, 0.5, 2.0, 2.0]);
        // A group without its baseline row, and a group with two, name their prompt_uid.
        let err = group_baselines(&["a", "c"], &[1.0, 0.0], &[true, false]).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .starts_with("prompt_uid c has no baseline row"),
            "{err}"
        );
        let err =
            group_baselines(&["a", "a", "a"], &[1.0, 0.0, 1.0], &[true, false, true]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "prompt_uid a has 2 baseline rows (is_baseline = true); a group has one"
        );
    }

    #[test]
    fn gae_hand_values() {
        // Row A: mask [1,0,1], score 1, values [0.5, 9 (observation, unused), 0.25]
        // Row B: mask [1,1], score -1, values [0.1, -0.2]; gamma 0.9, lambda 0.8
        let offsets = [0, 3, 5];
        let mask = [1, 0, 1, 1, 1];
        let values = [0.5, 9.0, 0.25, 0.1, -0.2];
        let r = token_rewards(&offsets, &mask, &[1.0, -1.0], None);
        let x = AdvInput {
            offsets: &offsets,
            mask: &mask,
            token_rewards: &r.token_rewards,
            outcome: &r.outcome,
            groups: None,
            values: Some(&values),
            baseline: None,
        };
        let p = AdvParams {
            gamma: 0.9,
            lam: 0.8,
            ..AdvParams::default()
        };
        let out = (estimator("gae").unwrap().run)(&x, &p).unwrap();
        // A t2: δ = 1 - 0.25 = 0.75, A = 0.75, ret 1.0
        // A t0: δ = 0.9*0.25 - 0.5 = -0.275, A = -0.275 + 0.72*0.75 = 0.265, ret 0.765
        // B t1: δ = -1 + 0.2 = -0.8, A = -0.8, ret -1.0
        // B t0: δ = 0.9*(-0.2) - 0.1 = -0.28, A = -0.28 + 0.72*(-0.8) = -0.856, ret -0.756
        close(&out.returns, &[0.765, 0.0, 1.0, -0.756, -1.0], 1e-6);
        let raw = [0.265, 0.75, -0.856, -0.8];
        let mean = raw.iter().sum::<f64>() / (4.0 + 1e-8);
        let var = raw.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 3.0;
        let w = |v: f64| ((v - mean) / (var + 1e-8).sqrt()) as f32;
        close(
            &out.advantages,
            &[w(0.265), 0.0, w(0.75), w(-0.856), w(-0.8)],
            1e-6,
        );
    }

    #[test]
    fn kl_in_reward_hand_values() {
        // Row 0: old [-1, -2, -0.5], ref [-1.5, -2, -1] (d = 0.5, 0, 0.5), score 1
        // Row 1: mask [1, 0], old [-1.2, -5], ref [-1.0, 0] (d = -0.2, masked), score 2
        let offsets = [0, 3, 5];
        let mask = [1, 1, 1, 1, 0];
        let old = [-1.0, -2.0, -0.5, -1.2, -5.0];
        let rf = [-1.5, -2.0, -1.0, -1.0, 0.0];
        let k3 = |d: f64| (-d).exp() + d - 1.0;
        // (name, kl of d = 0.5, kl of d = -0.2)
        let cases = [
            ("k1", 0.5, -0.2),
            ("abs", 0.5, 0.2),
            ("k2", 0.125, 0.02),
            ("k3", k3(0.5), k3(-0.2)),
        ];
        for (name, k05, k02) in cases {
            let kl = KlInReward {
                old: &old,
                ref_lp: &rf,
                penalty: name.parse().unwrap(),
                beta: 0.1,
            };
            let r = token_rewards(&offsets, &mask, &[1.0, 2.0], Some(&kl));
            let want = [-0.1 * k05, 0.0, 1.0 - 0.1 * k05, 2.0 - 0.1 * k02, 0.0];
            let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
            close(&r.token_rewards, &want, 1e-7);
            let o = [1.0 - 0.1 * 2.0 * k05, 2.0 - 0.1 * k02];
            // (inputs are f32, so -1.2 and friends are not exact)
            assert!((r.outcome[0] - o[0]).abs() < 1e-7 && (r.outcome[1] - o[1]).abs() < 1e-7);
            // current kl: mean over rows of each row's mean over valid tokens
            let current = (2.0 * k05 / 3.0 + k02) / 2.0;
            assert!((r.kl.unwrap() - current).abs() < 1e-7, "{name}: {:?}", r.kl);
        }
    }

    #[test]
    fn whitening_needs_two_tokens() {
        let r = token_rewards(&[0, 1], &[1], &[1.0], None);
        let x = AdvInput {
            offsets: &[0, 1],
            mask: &[1],
            token_rewards: &r.token_rewards,
            outcome: &r.outcome,
            groups: None,
            values: None,
            baseline: None,
        };
        let err =
            (estimator("reinforce_plus_plus").unwrap().run)(&x, &AdvParams::default()).unwrap_err();
        assert!(err.to_string().contains("at least 2, found 1"), "{err}");
        assert!(crate::error::is_input_error(&err));
    }

    #[test]
    fn stats_over_valid_tokens() {
        let s = masked_stats(&[1, 0, 1, 1], &[1.0, 100.0, 2.0, 6.0]);
        // mean 3, unbiased var ((4 + 1 + 9) / 2) = 7
        assert_eq!((s.count, s.mean, s.min, s.max), (3, 3.0, 1.0, 6.0));
        assert!((s.std - 7f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn registry_has_every_estimator_once() {
        let n = names();
        for want in [
            "grpo",
            "rloo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "opo",
            "gpg",
            "remax",
            "gae",
        ] {
            assert_eq!(n.iter().filter(|&&x| x == want).count(), 1, "{want}");
        }
        assert!(estimator("ppo").is_none());
    }
}
