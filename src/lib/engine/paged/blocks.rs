//! The block pool of the paged KV cache: fixed-size blocks of `block_size` token positions,
//! handed out from a free list and reference-counted so that the n samples of a prompt share
//! the prompt's full blocks (the prompt is prefilled once).

/// Fixed-size KV blocks with reference counts.
#[derive(Clone, Debug)]
pub(crate) struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` positions each (both ≥ 1).
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be >= 1");
        // Popped from the back: block 0 goes out first (lower rows first, easier to read in logs).
        let free = (0..num_blocks as u32).rev().collect();
        BlockPool {
            block_size,
            refs: vec![0; num_blocks],
            free,
        }
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by at least one sequence.
    pub(crate) fn in_use(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// Blocks that `tokens` positions occupy.
    pub(crate) fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// `n` fresh blocks (reference count 1), or None (and nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let got = self.free.split_off(self.free.len() - n);
        for &b in &got {
            debug_assert_eq!(self.refs[b as usize], 0);
            self.refs[b as usize] = 1;
        }
        Some(got)
    }

    /// One more holder of `block` (a fork sharing it).
    pub fn share(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "sharing free block {block}");
        *r += 1;
    }

    /// Holders of `block`.
    #[cfg(test)]
    pub fn refs(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// Drops one holder of each block; a block whose last holder left is free again.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "releasing free block {b}");
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }
}

/// Cache row of position `pos` of a sequence with block table `table`.
pub(crate) fn cache_row(table: &[u32], block_size: usize, pos: usize) -> usize {
    table[pos / block_size] as usize * block_size + pos % block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_all_or_nothing_and_release_counts_holders() {
        let mut p = BlockPool::new(4, 16);
        assert_eq!(p.blocks_for(0), 0);
        assert_eq!(p.blocks_for(16), 1);
        assert_eq!(p.blocks_for(17), 2);
        let a = p.alloc(3).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(p.num_free(), 1);
        assert!(p.alloc(2).is_none());
        assert_eq!(p.num_free(), 1, "a failed alloc takes nothing");
        p.share(a[0]);
        assert_eq!(p.refs(a[0]), 2);
        p.release(&a);
        // a[0] still has one holder.
        assert_eq!(p.num_free(), 3);
        assert_eq!(p.in_use(), 1);
        p.release(&a[..1]);
        assert_eq!(p.in_use(), 0);
        let all = p.alloc(4).unwrap();
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
    }

    #[test]
    fn cache_rows_follow_the_table() {
        // Positions 0..3 in block 5, 4..7 in block 2 (block size 4).
        let t = [5, 2];
        assert_eq!(cache_row(&t, 4, 0), 20);
        assert_eq!(cache_row(&t, 4, 3), 23);
        assert_eq!(cache_row(&t, 4, 4), 8);
        assert_eq!(cache_row(&t, 4, 6), 10);
    }

    #[test]
    #[should_panic(expected = "releasing free block")]
    fn double_release_is_caught() {
        let mut p = BlockPool::new(2, 4);
        let a = p.alloc(1).unwrap();
        p.release(&a);
        p.release(&a);
    }
}
