//! GPU checks of paged attention: `attention_paged` (one split and flash-decoding splits, scalar
//! and tensor-core paths), `attention_paged_rope` (the decode attention with rope + kv_store
//! fused in, against the CPU and bit for bit against the two ops), `attention_invariance` (the
//! packed training forward and the batch-invariant paged and tiled prefill kernels give a token
//! the same bits). Timing of a decode step's paged attention: plain, batch-invariant, and with
//! the rope and the cache store fused in.

use anyhow::Result;

use super::PagedAttnShape;
use crate::backend::check::gpu::{bits, tols, Case, Ctx};
use crate::backend::check::timing::{shape, Timer, Timing};
use crate::backend::ops::rope::check::{decode_kv, DecodeKv};
use crate::backend::prelude::*;

pub const CASES: &[Case] = &[
    Case {
        name: "attention_paged",
        run: paged_attention,
    },
    Case {
        name: "attention_paged_rope",
        run: attention_paged_rope,
    },
    Case {
        name: "attention_invariance",
        run: attention_invariance,
    },
];

pub(crate) const TIMINGS: &[Timing] = &[Timing {
    name: "decode attention_paged",
    run: time_decode,
}];

/// 256 sequences of context 256 in blocks of 16 (graph-replayed); bytes are the K and V read.
fn time_decode(t: &mut Timer) -> Result<()> {
    use shape::*;
    let gpu = t.gpu;
    let (rows, ctx, heads, kv, hd) = (DECODE_ROWS, DECODE_CTX, HEADS, KV_HEADS, HEAD_DIM);
    let kd = kv * hd;
    let tag = format!("{rows} rows");
    let DecodeKv {
        qkv,
        mut q,
        mut kc,
        mut vc,
        pos,
        rows: crow,
        per,
    } = decode_kv(t)?;
    let blocks = rows * per;
    let tables: Vec<u32> = (0..blocks as u32).collect();
    let tab = t.idx(&tables)?;
    let seq = t.idx(&(0..rows as u32).collect::<Vec<_>>())?;
    let len = t.idx(&vec![ctx as u32; rows])?;
    let mut o = t.buf(rows * heads * hd, DType::BF16, 1.0)?;
    let shape = PagedAttnShape {
        queries: rows,
        heads,
        kv_heads: kv,
        head_dim: hd,
        block_size: BLOCK,
        max_blocks: per,
    };
    let was = gpu.batch_invariant();
    for inv in [false, true] {
        gpu.set_batch_invariant(inv);
        t.time_graph(
            if inv {
                "decode attention_paged (invariant)"
            } else {
                "decode attention_paged"
            },
            format!("{tag}, ctx {ctx}"),
            (rows * ctx * kd * 2 * 2) as f64,
            "GB/s",
            || {
                gpu.attention_paged(
                    &mut o,
                    &q,
                    KvCache { k: &kc, v: &vc },
                    BlockTables {
                        tables: &tab,
                        seq: &seq,
                        len: &len,
                    },
                    shape,
                )
            },
        )?;
    }
    gpu.set_batch_invariant(was);
    // A decode step's attention: the rope and the cache store of the new token fused in.
    t.time_graph(
        "decode attention_paged_rope",
        format!("{tag}, ctx {ctx}"),
        (rows * ctx * kd * 2 * 2) as f64,
        "GB/s",
        || {
            gpu.attention_paged_rope(
                &mut o,
                PackedQkv {
                    qkv: &qkv,
                    q: &mut q,
                },
                Slots {
                    pos: &pos,
                    rows: &crow,
                },
                KvCache {
                    k: &mut kc,
                    v: &mut vc,
                },
                BlockTables {
                    tables: &tab,
                    seq: &seq,
                    len: &len,
                },
                PagedRopeShape {
                    attn: shape,
                    theta: ROPE_THETA,
                },
            )
        },
    )
}

fn paged_attention(c: &mut Ctx, d: DType) -> Result<()> {
    // bf16 runs both paths: tensor cores (the default) and the scalar kernels.
    if d == DType::BF16 {
        c.gpu.set_tensor_core_attention(false);
        let r = paged_attention_cases(c, d, "scalar");
        c.gpu.set_tensor_core_attention(true);
        r?;
        return paged_attention_cases(c, d, "mma");
    }
    paged_attention_cases(c, d, "scalar")
}

fn paged_attention_cases(c: &mut Ctx, d: DType, path: &str) -> Result<()> {
    let (t1, _) = tols(d);
    // Qwen2.5-0.5B heads (group 7): few long queries (split along the context) and many
    // short ones; a group of 16 at head_dim 128 (the per-head kernel when scalar); a
    // Llama-like group of 4 at head_dim 128 with blocks of 8 positions.
    for (tag, queries, max_len, heads, kv, hd, bs) in [
        ("split", 3usize, 900usize, 14usize, 2usize, 64usize, 16usize),
        ("decode", 200, 150, 14, 2, 64, 16),
        ("group16 hd128", 20, 300, 16, 1, 128, 16),
        ("group4 hd128 bs8", 64, 200, 32, 8, 128, 8),
    ] {
        let row = kv * hd;
        let max_blocks = max_len.div_ceil(bs);
        let seqs = queries.min(40);
        let num_blocks = seqs * max_blocks + 7;
        let kc = c.randn(num_blocks * bs * row, 1.0, d);
        let vc = c.randn(num_blocks * bs * row, 1.0, d);
        // Each sequence gets distinct random blocks (a shuffled pool).
        let pool = c.rng.distinct(num_blocks, num_blocks);
        let tables: Vec<u32> = pool[..seqs * max_blocks].to_vec();
        let (mut seq, mut len) = (vec![], vec![]);
        for _ in 0..queries {
            seq.push(c.rng.below(seqs) as u32);
            len.push(1 + c.rng.below(max_len) as u32);
        }
        let s = PagedAttnShape {
            queries,
            heads,
            kv_heads: kv,
            head_dim: hd,
            block_size: bs,
            max_blocks,
        };
        let q = c.randn(queries * heads * hd, 1.0, d);
        let mut oc = vec![0.0; queries * heads * hd];
        c.cpu.attention_paged(
            &mut oc,
            &q,
            KvCache { k: &kc, v: &vc },
            BlockTables {
                tables: &tables,
                seq: &seq,
                len: &len,
            },
            s,
        )?;
        let mut go = c.poisoned(oc.len(), d)?;
        c.gpu.attention_paged(
            &mut go,
            &c.dev(&q, d)?,
            KvCache {
                k: &c.dev(&kc, d)?,
                v: &c.dev(&vc, d)?,
            },
            BlockTables {
                tables: &c.idx(&tables)?,
                seq: &c.idx(&seq)?,
                len: &c.idx(&len)?,
            },
            s,
        )?;
        c.check(
            &format!("attention_paged {tag} [{path}]"),
            d,
            &go,
            &oc,
            true,
            t1,
        )?;
    }
    Ok(())
}

/// The decode step's fused rope + kv_store + attention (`attention_paged_rope`) against
/// the two ops it replaces on the GPU (output and both caches bit for bit) and against the
/// CPU: each query its own sequence, its new token at position len − 1 of its shuffled
/// table; few long queries (context splits) and many short ones, Qwen2.5-0.5B's heads and
/// a group of 4 at head_dim 128.
fn attention_paged_rope(c: &mut Ctx, d: DType) -> Result<()> {
    let (t1, _) = tols(d);
    for (tag, queries, max_len, heads, kv, hd) in [
        ("split", 3usize, 900usize, 14usize, 2usize, 64usize),
        ("decode", 200, 150, 14, 2, 64),
        ("group4 hd128", 64, 200, 32, 8, 128),
    ] {
        let (bs, row) = (16usize, kv * hd);
        let (qd, width) = (heads * hd, heads * hd + 2 * kv * hd);
        let max_blocks = max_len.div_ceil(bs);
        let num_blocks = queries * max_blocks + 5;
        let kc = c.randn(num_blocks * bs * row, 1.0, d);
        let vc = c.randn(num_blocks * bs * row, 1.0, d);
        let pool = c.rng.distinct(num_blocks, num_blocks);
        let tables: Vec<u32> = pool[..queries * max_blocks].to_vec();
        let seq: Vec<u32> = (0..queries as u32).collect();
        let len: Vec<u32> = (0..queries)
            .map(|_| 1 + c.rng.below(max_len) as u32)
            .collect();
        let pos: Vec<u32> = len.iter().map(|l| l - 1).collect();
        let rows: Vec<u32> = (0..queries)
            .map(|i| {
                let p = pos[i] as usize;
                (tables[i * max_blocks + p / bs] as usize * bs + p % bs) as u32
            })
            .collect();
        let qkv = c.randn(queries * width, 1.0, d);
        let s = PagedAttnShape {
            queries,
            heads,
            kv_heads: kv,
            head_dim: hd,
            block_size: bs,
            max_blocks,
        };
        let theta = 1e6;
        // CPU: the two ops.
        let mut q = vec![0f32; queries * qd];
        let (mut ckc, mut cvc) = (kc.clone(), vc.clone());
        let mut co = vec![0f32; queries * qd];
        c.cpu.attention_paged_rope(
            &mut co,
            PackedQkv {
                qkv: &qkv,
                q: &mut q,
            },
            Slots {
                pos: &pos,
                rows: &rows,
            },
            KvCache {
                k: &mut ckc,
                v: &mut cvc,
            },
            BlockTables {
                tables: &tables,
                seq: &seq,
                len: &len,
            },
            PagedRopeShape { attn: s, theta },
        )?;
        let (gx, gpos, grows) = (c.dev(&qkv, d)?, c.idx(&pos)?, c.idx(&rows)?);
        let (gt, gs, gl) = (c.idx(&tables)?, c.idx(&seq)?, c.idx(&len)?);
        let gslots = Slots {
            pos: &gpos,
            rows: &grows,
        };
        let gblocks = BlockTables {
            tables: &gt,
            seq: &gs,
            len: &gl,
        };
        // GPU, two ops.
        let (mut akc, mut avc) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
        let mut aq = c.poisoned(queries * qd, d)?;
        let mut ao = c.poisoned(queries * qd, d)?;
        c.gpu.rope_store_kv_packed(
            PackedQkv {
                qkv: &gx,
                q: &mut aq,
            },
            gslots,
            KvCache {
                k: &mut akc,
                v: &mut avc,
            },
            s.rope(theta),
        )?;
        c.gpu
            .attention_paged(&mut ao, &aq, KvCache { k: &akc, v: &avc }, gblocks, s)?;
        // GPU, fused.
        let (mut fkc, mut fvc) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
        let mut fq = c.poisoned(queries * qd, d)?;
        let mut fo = c.poisoned(queries * qd, d)?;
        c.gpu.attention_paged_rope(
            &mut fo,
            PackedQkv {
                qkv: &gx,
                q: &mut fq,
            },
            gslots,
            KvCache {
                k: &mut fkc,
                v: &mut fvc,
            },
            gblocks,
            PagedRopeShape { attn: s, theta },
        )?;
        c.check(
            &format!("attention_paged_rope {tag}"),
            d,
            &fo,
            &co,
            true,
            t1,
        )?;
        c.check(
            &format!("attention_paged_rope {tag} k cache"),
            d,
            &fkc,
            &ckc,
            false,
            t1,
        )?;
        let g = c.gpu;
        let n = queries * qd;
        let same = [
            ("o", bits(g, &fo, n)? == bits(g, &ao, n)?),
            (
                "k cache",
                bits(g, &fkc, kc.len())? == bits(g, &akc, kc.len())?,
            ),
            (
                "v cache",
                bits(g, &fvc, vc.len())? == bits(g, &avc, vc.len())?,
            ),
        ];
        c.flag_same(
            &format!("attention_paged_rope {tag} vs two ops (gpu)"),
            d,
            &same,
        );
    }
    Ok(())
}

/// Batch invariance of attention (bf16, tensor cores): the packed training forward gives
/// every token the same bits whatever the packing (the sequences in another order), and the
/// paged kernel of the batch-invariant mode gives each token exactly the packed forward's
/// bits (every token a query against its prefix, through shuffled block tables).
fn attention_invariance(c: &mut Ctx, d: DType) -> Result<()> {
    if d != DType::BF16 {
        return Ok(());
    }
    for (heads, kv, hd) in [(14usize, 2usize, 64usize), (16, 4, 128)] {
        let lens = [1usize, 37, 64, 129, 200, 5];
        let tokens: usize = lens.iter().sum();
        let q = c.randn(tokens * heads * hd, 1.0, d);
        let k = c.randn(tokens * kv * hd, 1.0, d);
        let v = c.randn(tokens * kv * hd, 1.0, d);
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |a, &l| {
                *a += l;
                Some(*a - l)
            })
            .collect();
        // Packed in order, and in reverse order (rows permuted accordingly).
        let packed = |order: &[usize]| -> (Vec<usize>, Vec<u32>) {
            let mut rows = Vec::new();
            let mut cu = vec![0u32];
            for &s in order {
                rows.extend(starts[s]..starts[s] + lens[s]);
                cu.push(rows.len() as u32);
            }
            (rows, cu)
        };
        let permute = |x: &[f32], rows: &[usize], w: usize| -> Vec<f32> {
            rows.iter()
                .flat_map(|&r| x[r * w..(r + 1) * w].to_vec())
                .collect()
        };
        let mut outs = Vec::new();
        for order in [vec![0, 1, 2, 3, 4, 5], vec![5, 4, 3, 2, 1, 0]] {
            let (rows, cu) = packed(&order);
            let s = AttnShape {
                tokens,
                seqs: lens.len(),
                heads,
                kv_heads: kv,
                head_dim: hd,
            };
            let mut o = c.gpu.alloc_as(tokens * heads * hd, d)?;
            let mut lse = c.gpu.alloc(tokens * heads)?;
            c.gpu.attention(
                AttnOut {
                    o: &mut o,
                    lse: &mut lse,
                },
                Qkv {
                    q: &c.dev(&permute(&q, &rows, heads * hd), d)?,
                    k: &c.dev(&permute(&k, &rows, kv * hd), d)?,
                    v: &c.dev(&permute(&v, &rows, kv * hd), d)?,
                },
                &c.idx(&cu)?,
                s,
            )?;
            let mut host = vec![0f32; tokens * heads * hd];
            c.gpu.download(&o, &mut host)?;
            // Back to the original token order.
            let mut orig = vec![0f32; host.len()];
            for (i, &r) in rows.iter().enumerate() {
                let w = heads * hd;
                orig[r * w..(r + 1) * w].copy_from_slice(&host[i * w..(i + 1) * w]);
            }
            outs.push(orig);
        }
        // The paged cache: blocks of 16 in shuffled order.
        let bs = 16;
        let max_blocks = lens.iter().map(|l| l.div_ceil(bs)).max().unwrap_or(1);
        let num_blocks = lens.len() * max_blocks + 3;
        let pool = c.rng.distinct(num_blocks, num_blocks);
        let row = kv * hd;
        let mut kc = vec![0f32; num_blocks * bs * row];
        let mut vc = vec![0f32; num_blocks * bs * row];
        let mut tables = vec![0u32; lens.len() * max_blocks];
        let (mut seq, mut len) = (Vec::new(), Vec::new());
        for (sidx, &l) in lens.iter().enumerate() {
            for b in 0..max_blocks {
                tables[sidx * max_blocks + b] = pool[sidx * max_blocks + b];
            }
            for p in 0..l {
                let r = (tables[sidx * max_blocks + p / bs] as usize * bs + p % bs) * row;
                let src = (starts[sidx] + p) * row;
                kc[r..r + row].copy_from_slice(&k[src..src + row]);
                vc[r..r + row].copy_from_slice(&v[src..src + row]);
                seq.push(sidx as u32);
                len.push(p as u32 + 1);
            }
        }
        let ps = PagedAttnShape {
            queries: tokens,
            heads,
            kv_heads: kv,
            head_dim: hd,
            block_size: bs,
            max_blocks,
        };
        c.gpu.set_batch_invariant(true);
        let mut go = c.gpu.alloc_as(tokens * heads * hd, d)?;
        let r = c.gpu.attention_paged(
            &mut go,
            &c.dev(&q, d)?,
            KvCache {
                k: &c.dev(&kc, d)?,
                v: &c.dev(&vc, d)?,
            },
            BlockTables {
                tables: &c.idx(&tables)?,
                seq: &c.idx(&seq)?,
                len: &c.idx(&len)?,
            },
            ps,
        );
        c.gpu.set_batch_invariant(false);
        r?;
        let mut paged = vec![0f32; tokens * heads * hd];
        c.gpu.download(&go, &mut paged)?;
        let differ = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count()
        };
        let (dp, dg) = (differ(&outs[0], &outs[1]), differ(&outs[0], &paged));
        c.flag(
            &format!("attention invariance {heads}/{kv} hd{hd}"),
            d,
            dp == 0 && dg == 0,
            format!(
                "elements that differ of {}: packed in reverse order {dp}, paged (invariant) vs packed {dg}",
                paged.len()
            ),
        );
        // The tiled call of a step with prefill chunks: each sequence cut into runs of
        // 1..=64 positions; runs of one are single (decode) rows and go first, the others
        // are tiles. Tile rows must get the packed forward's bits in both modes, single rows
        // too when invariant (else within the tolerance).
        let w = heads * hd;
        let (mut single, mut runs) = (Vec::new(), Vec::new());
        for (sidx, &l) in lens.iter().enumerate() {
            let mut p = 0;
            while p < l {
                // A quarter of the runs are single rows.
                let r = if c.rng.below(4) == 0 {
                    1
                } else {
                    (2 + c.rng.below(63)).min(l - p)
                };
                if r == 1 {
                    single.push((sidx, p));
                } else {
                    runs.push((sidx, p, r));
                }
                p += r;
            }
        }
        // order[i] = the packed token row of tiled row i.
        let (mut order, mut tseq, mut tlen, mut tiles) = (vec![], vec![], vec![], vec![]);
        for &(sidx, p) in &single {
            order.push(starts[sidx] + p);
            tseq.push(sidx as u32);
            tlen.push(p as u32 + 1);
        }
        for &(sidx, p, r) in &runs {
            tiles.extend([order.len() as u32, r as u32]);
            for x in p..p + r {
                order.push(starts[sidx] + x);
                tseq.push(sidx as u32);
                tlen.push(x as u32 + 1);
            }
        }
        let gq = c.dev(&permute(&q, &order, w), d)?;
        let (gk, gv) = (c.dev(&kc, d)?, c.dev(&vc, d)?);
        let (gt, gs, gl, gtiles) = (
            c.idx(&tables)?,
            c.idx(&tseq)?,
            c.idx(&tlen)?,
            c.idx(&tiles)?,
        );
        for invariant in [true, false] {
            c.gpu.set_batch_invariant(invariant);
            let mut go = c.poisoned(tokens * w, d)?;
            let r = c.gpu.attention_paged_tiled(
                &mut go,
                &gq,
                KvCache { k: &gk, v: &gv },
                BlockTables {
                    tables: &gt,
                    seq: &gs,
                    len: &gl,
                },
                PrefillTiles {
                    tiles: &gtiles,
                    n_tiles: tiles.len() / 2,
                    decode_rows: single.len(),
                },
                ps,
            );
            c.gpu.set_batch_invariant(false);
            r?;
            let mut host = vec![0f32; tokens * w];
            c.gpu.download(&go, &mut host)?;
            let (mut tile_differ, mut single_differ, mut single_err) = (0usize, 0usize, 0f32);
            for (i, &row) in order.iter().enumerate() {
                let (got, want) = (&host[i * w..(i + 1) * w], &outs[0][row * w..(row + 1) * w]);
                if i < single.len() {
                    single_differ += differ(got, want);
                    for (a, b) in got.iter().zip(want) {
                        single_err = single_err.max((a - b).abs());
                    }
                } else {
                    tile_differ += differ(got, want);
                }
            }
            let (t1, _) = tols(d);
            let ok = tile_differ == 0
                && if invariant {
                    single_differ == 0
                } else {
                    single_err <= t1 as f32
                };
            let mode = if invariant { "invariant" } else { "default" };
            c.flag(
                &format!("attention_paged_tiled {heads}/{kv} hd{hd} [{mode}]"),
                d,
                ok,
                format!(
                    "{} tiles, {} single rows: elements that differ from packed: tiles {tile_differ}, single rows {single_differ} (max |Δ| {single_err:.2e})",
                    tiles.len() / 2,
                    single.len()
                ),
            );
        }
    }
    Ok(())
}

/// The family's cases from `cargo test` (skipped without a GPU).
#[cfg(test)]
#[test]
fn gpu_parity() {
    crate::backend::check::gpu::run_for_test(CASES);
}
