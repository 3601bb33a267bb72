//! The seeded prompt sampler. Each epoch visits every training prompt once, in an order that
//! depends only on (seed, epoch); its cursor (epoch, position) is saved in `state.json`, so a
//! resumed run draws exactly the prompts an uninterrupted one would.

use crate::bail_input;
use crate::batch::{Batch, StageInfo};
use anyhow::Result;
use arrow_array::UInt64Array;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::Path;

/// Where the sampler stands: the next prompt is `order(seed, epoch)[position]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Cursor {
    pub(crate) epoch: u64,
    pub(crate) position: u64,
}

use crate::rng::SplitMix64;

/// A seed derived from a base seed and labels (step, stage...), kept below 2^31 so every
/// stage's `--seed` accepts it.
pub fn derive_seed(base: u64, labels: &[u64]) -> u64 {
    let mut rng = SplitMix64(base);
    for &l in labels {
        rng.0 ^= rng.next_u64().wrapping_add(l);
    }
    rng.next_u64() & 0x7FFF_FFFF
}

/// The prompt sampler over a dataset of `len` rows.
#[derive(Clone, Debug)]
pub(crate) struct Sampler {
    pub(crate) seed: u64,
    pub(crate) len: u64,
    pub(crate) shuffle: bool,
}

impl Sampler {
    /// The visiting order of one epoch: a Fisher-Yates shuffle seeded by (seed, epoch), or the
    /// file's order when shuffling is off.
    pub fn order(&self, epoch: u64) -> Vec<u64> {
        let mut idx: Vec<u64> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64(derive_seed(self.seed, &[0x5A4D_504C, epoch]));
            for i in (1..idx.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                idx.swap(i, j);
            }
        }
        idx
    }

    /// Draw `count` row indices starting at `cursor`; an epoch that runs out continues into
    /// the next one. Returns the rows and the cursor after them.
    pub fn draw(&self, cursor: Cursor, count: u64) -> (Vec<u64>, Cursor) {
        assert!(self.len > 0, "sampling from an empty dataset");
        let mut out = Vec::with_capacity(count as usize);
        let mut cur = cursor;
        let mut order = self.order(cur.epoch);
        while (out.len() as u64) < count {
            if cur.position >= self.len {
                cur = Cursor {
                    epoch: cur.epoch + 1,
                    position: 0,
                };
                order = self.order(cur.epoch);
            }
            out.push(order[cur.position as usize]);
            cur.position += 1;
        }
        (out, cur)
    }
}

/// Draws `count` prompts of `batch` (the run's training set, as many rows as `sampler` was
/// made for) from `cursor` into `out`, tagged with step `step`; returns the cursor after them.
pub(crate) fn draw_into(
    batch: &Batch,
    sampler: &Sampler,
    (cursor, count): (Cursor, u64),
    step: u64,
    out: &Path,
) -> Result<Cursor> {
    if batch.num_rows() as u64 != sampler.len {
        bail_input!(
            "{}: has {} rows but had {} when the run began; a resumed run must sample from the same data",
            batch.path.display(),
            batch.num_rows(),
            sampler.len
        );
    }
    let (rows, next) = sampler.draw(cursor, count);
    let data = arrow_select::take::take_record_batch(&batch.data, &UInt64Array::from(rows))?;
    let meta = batch.derived_meta(&StageInfo {
        stage: "sample",
        params: json!({
            "dataset": batch.path,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "epoch": cursor.epoch,
            "position": cursor.position,
            "count": count,
        }),
        policy_version: None,
        step: Some(step),
    });
    crate::batch::write_file(out, &data, &meta)?;
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of SplitMix64 seeded with 0 (Vigna's reference implementation).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn each_epoch_is_a_permutation_and_epochs_differ() {
        let s = Sampler {
            seed: 7,
            len: 10,
            shuffle: true,
        };
        let (rows, cur) = s.draw(Cursor::default(), 25);
        assert_eq!(
            cur,
            Cursor {
                epoch: 2,
                position: 5
            }
        );
        for epoch in rows.chunks(10).take(2) {
            let mut sorted = epoch.to_vec();
            sorted.sort();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(rows[..10], rows[10..20]);
        assert_eq!(rows[20..], s.order(2)[..5]);
    }

    #[test]
    fn drawing_in_pieces_equals_drawing_at_once() {
        let s = Sampler {
            seed: 3,
            len: 7,
            shuffle: true,
        };
        let (all, end) = s.draw(Cursor::default(), 20);
        let mut cur = Cursor::default();
        let mut pieces = Vec::new();
        for n in [3, 4, 6, 7] {
            let (rows, next) = s.draw(cur, n);
            pieces.extend(rows);
            cur = next;
        }
        assert_eq!(pieces, all);
        assert_eq!(cur, end);
    }

    #[test]
    fn no_shuffle_keeps_file_order_and_seed_changes_order() {
        let s = Sampler {
            seed: 1,
            len: 4,
            shuffle: false,
        };
        assert_eq!(s.draw(Cursor::default(), 6).0, [0, 1, 2, 3, 0, 1]);
        let a = Sampler {
            seed: 1,
            len: 50,
            shuffle: true,
        }
        .order(0);
        let b = Sampler {
            seed: 2,
            len: 50,
            shuffle: true,
        }
        .order(0);
        assert_ne!(a, b);
    }

    #[test]
    fn derived_seeds_fit_31_bits_and_depend_on_labels() {
        let a = derive_seed(0, &[1, 2]);
        assert!(a < 1 << 31);
        assert_ne!(a, derive_seed(0, &[2, 1]));
        assert_ne!(a, derive_seed(1, &[1, 2]));
        assert_eq!(a, derive_seed(0, &[1, 2]));
    }
}
