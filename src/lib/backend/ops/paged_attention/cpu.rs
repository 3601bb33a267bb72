//! Attention over a block-table KV cache on the CPU: the oracle of `paged_attention.cu`.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{BlockTables, PagedAttentionOps, PagedAttnShape};
use crate::backend::cpu::{get, get_mut, Cpu};
use crate::backend::ops::attention::cpu::dot;
use crate::backend::KvCache;

/// Cache row of position `p` of a sequence whose block table is `table`.
#[inline]
fn row_of(table: &[u32], bs: usize, p: usize) -> usize {
    table[p / bs] as usize * bs + p % bs
}

/// o_i = Σ_{p<len[i]} softmax_p(q_i·K[row(p)]/√d) V[row(p)] (online softmax, the same
/// arithmetic in the same order as the packed training forward `attention::cpu::forward`, so a
/// token gets the same bits from a paged cache as from training).
pub fn forward(
    o: &mut [f32],
    q: &[f32],
    cache: KvCache<&[f32]>,
    blocks: BlockTables<&[u32]>,
    s: PagedAttnShape,
) -> Result<()> {
    let (
        KvCache {
            k: k_cache,
            v: v_cache,
        },
        BlockTables { tables, seq, len },
    ) = (cache, blocks);
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        bail!(
            "attention_paged: {} query heads cannot be grouped over {} kv heads",
            s.heads,
            s.kv_heads
        );
    }
    let group = s.heads / s.kv_heads;
    let (d, qrow, krow, bs) = (
        s.head_dim,
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.block_size,
    );
    if qrow == 0 {
        return Ok(());
    }
    let rows = k_cache.len().min(v_cache.len()) / krow.max(1);
    for i in 0..s.queries {
        let (sq, l) = (seq[i] as usize, len[i] as usize);
        let t0 = sq * s.max_blocks;
        if l == 0 || bs == 0 || l.div_ceil(bs) > s.max_blocks || t0 + l.div_ceil(bs) > tables.len()
        {
            bail!(
                "attention_paged: query {i} reads {l} positions of sequence {sq} ({} blocks of {bs} per table row, {} table entries)",
                s.max_blocks,
                tables.len()
            );
        }
        let table = &tables[t0..t0 + l.div_ceil(bs)];
        if let Some(&b) = table.iter().find(|&&b| (b as usize + 1) * bs > rows) {
            bail!("attention_paged: query {i}: block {b} is outside the cache ({rows} rows)");
        }
    }
    let scale = 1.0 / (d as f32).sqrt();
    o.par_chunks_mut(qrow).enumerate().for_each(|(i, orow)| {
        let (sq, l) = (seq[i] as usize, len[i] as usize);
        let table = &tables[sq * s.max_blocks..sq * s.max_blocks + l.div_ceil(bs)];
        for h in 0..s.heads {
            let qi = &q[i * qrow + h * d..i * qrow + (h + 1) * d];
            let out = &mut orow[h * d..(h + 1) * d];
            let off = (h / group) * d;
            out.fill(0.0);
            let (mut m, mut lsum) = (f32::NEG_INFINITY, 0f32);
            for p in 0..l {
                let j = row_of(table, bs, p);
                let kj = &k_cache[j * krow + off..j * krow + off + d];
                let sc = dot(qi, kj) * scale;
                if sc > m {
                    // A new maximum: rescale what was summed under the old one.
                    let c = (m - sc).exp();
                    lsum *= c;
                    out.iter_mut().for_each(|o| *o *= c);
                    m = sc;
                }
                let pr = (sc - m).exp();
                lsum += pr;
                let vj = &v_cache[j * krow + off..j * krow + off + d];
                out.iter_mut().zip(vj).for_each(|(y, x)| *y += pr * x);
            }
            let inv = 1.0 / lsum;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    });
    Ok(())
}

impl PagedAttentionOps for Cpu {
    fn attention_paged(
        &self,
        o: &mut Vec<f32>,
        q: &Vec<f32>,
        cache: KvCache<&Vec<f32>>,
        blocks: BlockTables<&Vec<u32>>,
        s: PagedAttnShape,
    ) -> Result<()> {
        let qn = s.queries * s.heads * s.head_dim;
        forward(
            get_mut(o, qn, "attention_paged o")?,
            get(q, qn, "attention_paged q")?,
            KvCache {
                k: cache.k,
                v: cache.v,
            },
            BlockTables {
                tables: blocks.tables,
                seq: get(blocks.seq, s.queries, "attention_paged seq")?,
                len: get(blocks.len, s.queries, "attention_paged len")?,
            },
            s,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::randn;
    use crate::backend::ops::attention::cpu as attention;
    use crate::backend::{AttnOut, AttnShape, Qkv};

    /// Each query against its paged prefix gets exactly the packed training forward's bits
    /// at that token (the same online softmax in the same order).
    #[test]
    fn paged_equals_the_packed_forward_bit_for_bit() {
        // 2 sequences of 7 and 3 positions, block size 4, GQA 4 heads over 2 kv heads.
        let (h, kh, d, bs) = (4, 2, 8, 4);
        let krow = kh * d;
        let lens = [7usize, 3];
        let starts = [0usize, 7];
        let tokens = 10;
        // Packed: sequence s at rows starts[s]..; paged: blocks scattered.
        let packed_k = randn(tokens * krow, 51);
        let packed_v = randn(tokens * krow, 52);
        let tables = [[3u32, 0], [1, 2]];
        let mut pk = vec![0.0; 4 * bs * krow];
        let mut pv = vec![0.0; 4 * bs * krow];
        for (s, &l) in lens.iter().enumerate() {
            for p in 0..l {
                let (src, dst) = (starts[s] + p, row_of(&tables[s], bs, p));
                pk[dst * krow..(dst + 1) * krow]
                    .copy_from_slice(&packed_k[src * krow..(src + 1) * krow]);
                pv[dst * krow..(dst + 1) * krow]
                    .copy_from_slice(&packed_v[src * krow..(src + 1) * krow]);
            }
        }
        // Queries: every token, against its prefix (in packed order).
        let (mut seq, mut len) = (vec![], vec![]);
        for (s, &l) in lens.iter().enumerate() {
            for p in 1..=l {
                seq.push(s as u32);
                len.push(p as u32);
            }
        }
        let nq = seq.len();
        let q = randn(nq * h * d, 53);
        let mut want = vec![0.0; nq * h * d];
        let mut lse = vec![0.0; nq * h];
        attention::forward(
            AttnOut {
                o: &mut want,
                lse: &mut lse,
            },
            Qkv {
                q: &q,
                k: &packed_k,
                v: &packed_v,
            },
            &[0, 7, 10],
            AttnShape {
                tokens,
                seqs: 2,
                heads: h,
                kv_heads: kh,
                head_dim: d,
            },
        )
        .unwrap();
        let mut got = vec![0.0; nq * h * d];
        let flat: Vec<u32> = tables.iter().flatten().copied().collect();
        let shape = PagedAttnShape {
            queries: nq,
            heads: h,
            kv_heads: kh,
            head_dim: d,
            block_size: bs,
            max_blocks: 2,
        };
        forward(
            &mut got,
            &q,
            KvCache { k: &pk, v: &pv },
            BlockTables {
                tables: &flat,
                seq: &seq,
                len: &len,
            },
            shape,
        )
        .unwrap();
        assert_eq!(got, want);
        // A query that reads past its table is refused.
        let err = forward(
            &mut got,
            &q,
            KvCache { k: &pk, v: &pv },
            BlockTables {
                tables: &flat,
                seq: &[0],
                len: &[9],
            },
            shape,
        )
        .unwrap_err();
        assert!(err.to_string().contains("reads 9 positions"), "{err}");
    }

    #[test]
    fn single_position_returns_its_value() {
        let (d, bs) = (2, 2);
        // Block 1 holds position 0 of the sequence.
        let k = [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0];
        let v = [0.0, 0.0, 0.0, 0.0, 7.0, 9.0, 0.0, 0.0];
        let mut o = [0.0; 2];
        let s = PagedAttnShape {
            queries: 1,
            heads: 1,
            kv_heads: 1,
            head_dim: d,
            block_size: bs,
            max_blocks: 1,
        };
        forward(
            &mut o,
            &[0.3, 0.1],
            KvCache { k: &k, v: &v },
            BlockTables {
                tables: &[1],
                seq: &[0],
                len: &[1],
            },
            s,
        )
        .unwrap();
        assert_eq!(o, [7.0, 9.0]);
    }
}
