//! Sharing rows out to the ranks of a data-parallel step by their token counts.

use std::ops::Range;

use crate::engine::logprob::micro_batches;

/// Shares items of `lens` tokens out to `world` ranks so that the ranks' token sums are about
/// equal: the longest first, each to the rank with the fewest tokens so far (ties to the lower
/// rank; items of equal length in their order). Each rank's items (indices into `lens`) keep
/// their original order, so consecutive micro-batches cut from them are as on one rank. Every
/// rank computes the same shares from the same lengths; a world of one keeps every item in
/// order.
pub(crate) fn balance(lens: &[usize], world: usize) -> Vec<Vec<usize>> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by(|&a, &b| lens[b].cmp(&lens[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; world];
    let mut shares = vec![Vec::new(); world];
    for i in order {
        let r = (0..world).min_by_key(|&r| (load[r], r)).expect("a rank");
        load[r] += lens[i];
        shares[r].push(i);
    }
    for s in &mut shares {
        s.sort_unstable();
    }
    shares
}

/// The micro-batches of every rank for items of `lens` tokens shared out as
/// [`balance`] does, each cut by `budget` tokens ([`micro_batches`]), as ranges into the rank's
/// share; every rank's list is padded with empty ranges to the longest, so that every rank runs
/// the same number of passes. Returns (shares, micro-batches per rank).
pub(crate) fn micro_schedule(
    lens: &[usize],
    world: usize,
    budget: usize,
) -> (Vec<Vec<usize>>, Vec<Vec<Range<usize>>>) {
    let shares = balance(lens, world);
    let mut micro: Vec<Vec<Range<usize>>> = shares
        .iter()
        .map(|s| {
            let l: Vec<usize> = s.iter().map(|&i| lens[i]).collect();
            micro_batches(&l, budget.max(1))
        })
        .collect();
    let most = micro.iter().map(Vec::len).max().unwrap_or(0);
    for m in &mut micro {
        let end = m.last().map_or(0, |r| r.end);
        m.resize(most, end..end);
    }
    (shares, micro)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_balanced_ordered_and_complete() {
        // 10, 9, ..., 1 over 3 ranks, longest first to the emptiest rank (ties to the lower):
        // 10 r0, 9 r1, 8 r2, 7 r2, 6 r1, 5 r0 (all at 15), 4 r0, 3 r1, 2 r2, 1 r2.
        let lens: Vec<usize> = (1..=10).rev().collect();
        let s = balance(&lens, 3);
        assert_eq!(s, vec![vec![0, 5, 6], vec![1, 4, 7], vec![2, 3, 8, 9]]);
        let sums: Vec<usize> = s.iter().map(|r| r.iter().map(|&i| lens[i]).sum()).collect();
        assert_eq!(sums, vec![19, 18, 18]);
        let mut all: Vec<usize> = s.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        for r in &s {
            assert!(r.windows(2).all(|w| w[0] < w[1]), "in order: {r:?}");
        }
        assert_eq!(balance(&lens, 1), vec![(0..10).collect::<Vec<_>>()]);
        // More ranks than items: the rest get none.
        assert_eq!(balance(&[5, 7], 3), vec![vec![1], vec![0], vec![]]);
    }

    #[test]
    fn every_rank_runs_as_many_micro_batches() {
        // One long row and three short ones on 2 ranks, budget 10: rank 0 gets the long row
        // (one pass), rank 1 the three short ones (two passes): rank 0 is padded.
        let (shares, micro) = micro_schedule(&[12, 4, 4, 4], 2, 10);
        assert_eq!(shares, vec![vec![0], vec![1, 2, 3]]);
        assert_eq!(micro[1], vec![0..2, 2..3]);
        assert_eq!(micro[0], vec![0..1, 1..1]);
        let (_, none) = micro_schedule(&[], 2, 10);
        assert_eq!(none, vec![Vec::<Range<usize>>::new(), vec![]]);
    }
}
