//! Parity checks of the paged generation engine's ops (cases on the harness's [`Ctx`], listed
//! in [`CASES`] after the op families'): `attention_paged` (one split and flash-decoding splits), `sample` (greedy, full
//! softmax, top-k, top-p, both). The fused projections of the engine's steps: `alloc_parts`
//! (views into one buffer), `rope_store_kv_packed` and `swiglu_packed` (against the CPU and bit
//! for bit against the split ops), `attention_paged_rope` (the decode attention with rope +
//! kv_store fused in, bit for bit against the two ops), `attention_paged_tiled` (prefill tiles,
//! inside `attention_invariance`). The engine itself on the GPU (`paged_generate`,
//! `paged_graphs`, `rollout_agreement`, `fused_decode`) is checked in `engine::check`.

use anyhow::{anyhow, Result};

use crate::backend::check::gpu::{tols, Case, Ctx};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{CudaBackend, CudaBuf, PART_ALIGN};
use crate::backend::ops::sample::SamplingParams;
use crate::backend::prelude::*;

/// The paged engine's op cases, in table order.
pub const CASES: &[Case] = &[
    Case {
        name: "attention_paged",
        run: |c, d| c.paged_attention(d),
    },
    Case {
        name: "rope_store_kv",
        run: |c, d| c.rope_store_kv(d),
    },
    Case {
        name: "rope_store_kv_packed",
        run: |c, d| c.rope_store_kv_packed(d),
    },
    Case {
        name: "attention_paged_rope",
        run: |c, d| c.attention_paged_rope(d),
    },
    Case {
        name: "swiglu_packed",
        run: |c, d| c.swiglu_packed(d),
    },
    Case {
        name: "alloc_parts",
        run: |c, d| c.alloc_parts(d),
    },
    Case {
        name: "gemm_invariance",
        run: |c, d| c.gemm_invariance(d),
    },
    Case {
        name: "attention_invariance",
        run: |c, d| c.attention_invariance(d),
    },
    Case {
        name: "sample",
        run: |c, d| c.sample(d),
    },
];

/// The first `n` elements of a GPU buffer as bit patterns (bf16 widens to f32 exactly).
fn bits(gpu: &CudaBackend, b: &CudaBuf, n: usize) -> Result<Vec<u32>> {
    let mut h = vec![0f32; n];
    gpu.download(b, &mut h)?;
    Ok(h.iter().map(|v| v.to_bits()).collect())
}

impl Ctx<'_> {
    /// 0..n in a random order (a shuffled pool of cache blocks).
    fn shuffled(&mut self, n: usize) -> Vec<u32> {
        let mut pool: Vec<u32> = (0..n as u32).collect();
        for i in 0..pool.len() {
            let j = i + self.rng.below(pool.len() - i);
            pool.swap(i, j);
        }
        pool
    }

    /// Flags `op` as passed when every named comparison held ("bit-identical"), else lists
    /// the ones that differ.
    fn flag_same(&mut self, op: &str, d: DType, same: &[(&str, bool)]) {
        let differ: Vec<&str> = same.iter().filter(|x| !x.1).map(|x| x.0).collect();
        let note = if differ.is_empty() {
            "bit-identical".into()
        } else {
            format!("differ: {}", differ.join(", "))
        };
        self.flag(op, d, differ.is_empty(), note);
    }

    fn paged_attention(&mut self, d: DType) -> Result<()> {
        // bf16 runs both paths: tensor cores (the default) and the scalar kernels.
        if d == DType::BF16 {
            self.gpu.set_tensor_core_attention(false);
            let r = self.paged_attention_cases(d, "scalar");
            self.gpu.set_tensor_core_attention(true);
            r?;
            return self.paged_attention_cases(d, "mma");
        }
        self.paged_attention_cases(d, "scalar")
    }

    fn paged_attention_cases(&mut self, d: DType, path: &str) -> Result<()> {
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
            let kc = self.randn(num_blocks * bs * row, 1.0, d);
            let vc = self.randn(num_blocks * bs * row, 1.0, d);
            // Each sequence gets distinct random blocks (a shuffled pool).
            let pool = self.shuffled(num_blocks);
            let tables: Vec<u32> = pool[..seqs * max_blocks].to_vec();
            let (mut seq, mut len) = (vec![], vec![]);
            for _ in 0..queries {
                seq.push(self.rng.below(seqs) as u32);
                len.push(1 + self.rng.below(max_len) as u32);
            }
            let s = PagedAttnShape {
                queries,
                heads,
                kv_heads: kv,
                head_dim: hd,
                block_size: bs,
                max_blocks,
            };
            let q = self.randn(queries * heads * hd, 1.0, d);
            let mut oc = vec![0.0; queries * heads * hd];
            Cpu.attention_paged(&mut oc, &q, &kc, &vc, &tables, &seq, &len, s)?;
            let mut go = self.poisoned(oc.len(), d)?;
            self.gpu.attention_paged(
                &mut go,
                &self.dev(&q, d)?,
                &self.dev(&kc, d)?,
                &self.dev(&vc, d)?,
                &self.idx(&tables)?,
                &self.idx(&seq)?,
                &self.idx(&len)?,
                s,
            )?;
            self.check(
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

    /// Row invariance of the decoder's forward GEMMs (Qwen2.5-0.5B shapes): the first rows of
    /// a call of 4096 rows against calls of 1, 37 and 256 rows, bit for bit. With the default
    /// plans (the heuristic per row count) rows may round differently; with the batch-invariant
    /// plans they must not (what keeps rollout and training log-probs of a token together).
    fn gemm_invariance(&mut self, d: DType) -> Result<()> {
        let big = 4096usize;
        for invariant in [false, true] {
            self.gpu.set_batch_invariant(invariant);
            let mut notes = Vec::new();
            let mut differ_total = 0usize;
            for (name, n_out, k, f32_out) in [
                ("q", 896usize, 896usize, false),
                ("k", 128, 896, false),
                ("o", 896, 896, true),
                ("gate", 4864, 896, false),
                ("down", 896, 4864, true),
            ] {
                let x = self.randn(big * k, 1.0, d);
                let w = self.randn(n_out * k, 0.05, d);
                let (gx, gw) = (self.dev(&x, d)?, self.dev(&w, d)?);
                let od = if f32_out { DType::F32 } else { d };
                let mut full = self.gpu.alloc_as(big * n_out, od)?;
                self.gpu
                    .matmul(&mut full, &gx, &gw, None, big, k, n_out, false)?;
                let mut want = vec![0f32; big * n_out];
                self.gpu.download(&full, &mut want)?;
                let mut differ = 0usize;
                for rows in [1usize, 37, 256] {
                    let part = self.dev(&x[..rows * k], d)?;
                    let mut y = self.gpu.alloc_as(rows * n_out, od)?;
                    self.gpu
                        .matmul(&mut y, &part, &gw, None, rows, k, n_out, false)?;
                    let mut got = vec![0f32; rows * n_out];
                    self.gpu.download(&y, &mut got)?;
                    differ += got
                        .chunks(n_out)
                        .zip(want.chunks(n_out))
                        .filter(|(a, b)| a.iter().zip(*b).any(|(p, q)| p.to_bits() != q.to_bits()))
                        .count();
                }
                differ_total += differ;
                notes.push(format!("{name} {differ}/294"));
            }
            let mode = if invariant { "invariant" } else { "default" };
            self.flag(
                &format!("gemm rows vs 4096-row call [{mode}]"),
                d,
                !invariant || differ_total == 0,
                format!("rows that differ: {}", notes.join(", ")),
            );
        }
        self.gpu.set_batch_invariant(false);
        Ok(())
    }

    /// Batch invariance of attention (bf16, tensor cores): the packed training forward gives
    /// every token the same bits whatever the packing (the sequences in another order), and the
    /// paged kernel of the batch-invariant mode gives each token exactly the packed forward's
    /// bits (every token a query against its prefix, through shuffled block tables).
    fn attention_invariance(&mut self, d: DType) -> Result<()> {
        if d != DType::BF16 {
            return Ok(());
        }
        for (heads, kv, hd) in [(14usize, 2usize, 64usize), (16, 4, 128)] {
            let lens = [1usize, 37, 64, 129, 200, 5];
            let tokens: usize = lens.iter().sum();
            let q = self.randn(tokens * heads * hd, 1.0, d);
            let k = self.randn(tokens * kv * hd, 1.0, d);
            let v = self.randn(tokens * kv * hd, 1.0, d);
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
                let mut o = self.gpu.alloc_as(tokens * heads * hd, d)?;
                let mut lse = self.gpu.alloc(tokens * heads)?;
                self.gpu.attention(
                    &mut o,
                    &mut lse,
                    &self.dev(&permute(&q, &rows, heads * hd), d)?,
                    &self.dev(&permute(&k, &rows, kv * hd), d)?,
                    &self.dev(&permute(&v, &rows, kv * hd), d)?,
                    &self.idx(&cu)?,
                    s,
                )?;
                let mut host = vec![0f32; tokens * heads * hd];
                self.gpu.download(&o, &mut host)?;
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
            let pool = self.shuffled(num_blocks);
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
            self.gpu.set_batch_invariant(true);
            let mut go = self.gpu.alloc_as(tokens * heads * hd, d)?;
            let r = self.gpu.attention_paged(
                &mut go,
                &self.dev(&q, d)?,
                &self.dev(&kc, d)?,
                &self.dev(&vc, d)?,
                &self.idx(&tables)?,
                &self.idx(&seq)?,
                &self.idx(&len)?,
                ps,
            );
            self.gpu.set_batch_invariant(false);
            r?;
            let mut paged = vec![0f32; tokens * heads * hd];
            self.gpu.download(&go, &mut paged)?;
            let differ = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count()
            };
            let (dp, dg) = (differ(&outs[0], &outs[1]), differ(&outs[0], &paged));
            self.flag(
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
                    let r = if self.rng.below(4) == 0 {
                        1
                    } else {
                        (2 + self.rng.below(63)).min(l - p)
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
            let gq = self.dev(&permute(&q, &order, w), d)?;
            let (gk, gv) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
            let (gt, gs, gl, gtiles) = (
                self.idx(&tables)?,
                self.idx(&tseq)?,
                self.idx(&tlen)?,
                self.idx(&tiles)?,
            );
            for invariant in [true, false] {
                self.gpu.set_batch_invariant(invariant);
                let mut go = self.poisoned(tokens * w, d)?;
                let r = self.gpu.attention_paged_tiled(
                    &mut go,
                    &gq,
                    &gk,
                    &gv,
                    &gt,
                    &gs,
                    &gl,
                    &gtiles,
                    tiles.len() / 2,
                    single.len(),
                    ps,
                );
                self.gpu.set_batch_invariant(false);
                r?;
                let mut host = vec![0f32; tokens * w];
                self.gpu.download(&go, &mut host)?;
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
                self.flag(
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

    /// The fused rope + kv_store of cached and paged steps against the CPU's three ops.
    fn rope_store_kv(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        let (tokens, heads, kv, hd, cache_rows) = (37usize, 14usize, 2usize, 64usize, 80usize);
        let kd = kv * hd;
        let mut q = self.randn(tokens * heads * hd, 1.0, d);
        let mut k = self.randn(tokens * kd, 1.0, d);
        let v = self.randn(tokens * kd, 1.0, d);
        let mut kc = self.randn(cache_rows * kd, 1.0, d);
        let mut vc = self.randn(cache_rows * kd, 1.0, d);
        let pos: Vec<u32> = (0..tokens).map(|_| self.rng.below(5000) as u32).collect();
        let mut free: Vec<u32> = (0..cache_rows as u32).collect();
        let rows: Vec<u32> = (0..tokens)
            .map(|_| free.swap_remove(self.rng.below(free.len())))
            .collect();
        let (mut gq, mut gk, gv) = (self.dev(&q, d)?, self.dev(&k, d)?, self.dev(&v, d)?);
        let (mut gkc, mut gvc) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
        let (gpos, grows) = (self.idx(&pos)?, self.idx(&rows)?);
        Cpu.rope_store_kv(
            &mut q, &mut k, &v, &pos, &mut kc, &mut vc, &rows, tokens, heads, kv, hd, 1e6,
        )?;
        self.gpu.rope_store_kv(
            &mut gq, &mut gk, &gv, &gpos, &mut gkc, &mut gvc, &grows, tokens, heads, kv, hd, 1e6,
        )?;
        self.check("rope_store_kv q", d, &gq, &q, false, t1)?;
        self.check("rope_store_kv k", d, &gk, &k, false, t1)?;
        self.check("rope_store_kv k cache", d, &gkc, &kc, false, t1)?;
        self.check("rope_store_kv v cache", d, &gvc, &vc, false, t1)
    }

    /// The packed rope + kv_store of a fused q/k/v projection (Qwen2.5-0.5B heads): against
    /// the CPU op, and bit for bit against the GPU's split op on the same three parts (what an
    /// unfused step computes from the same projections).
    fn rope_store_kv_packed(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        let (tokens, heads, kv, hd, cache_rows) = (37usize, 14usize, 2usize, 64usize, 80usize);
        let (qd, kd) = (heads * hd, kv * hd);
        let width = qd + 2 * kd;
        let qkv = self.randn(tokens * width, 1.0, d);
        let kc = self.randn(cache_rows * kd, 1.0, d);
        let vc = self.randn(cache_rows * kd, 1.0, d);
        let pos: Vec<u32> = (0..tokens).map(|_| self.rng.below(5000) as u32).collect();
        let mut free: Vec<u32> = (0..cache_rows as u32).collect();
        let rows: Vec<u32> = (0..tokens)
            .map(|_| free.swap_remove(self.rng.below(free.len())))
            .collect();
        let (gpos, grows) = (self.idx(&pos)?, self.idx(&rows)?);

        let mut q = vec![0f32; tokens * qd];
        let (mut ckc, mut cvc) = (kc.clone(), vc.clone());
        Cpu.rope_store_kv_packed(
            &qkv, &mut q, &pos, &mut ckc, &mut cvc, &rows, tokens, heads, kv, hd, 1e6,
        )?;
        let gx = self.dev(&qkv, d)?;
        let mut gq = self.poisoned(tokens * qd, d)?;
        let (mut gkc, mut gvc) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
        self.gpu.rope_store_kv_packed(
            &gx, &mut gq, &gpos, &mut gkc, &mut gvc, &grows, tokens, heads, kv, hd, 1e6,
        )?;
        self.check("rope_store_kv_packed q", d, &gq, &q, true, t1)?;
        self.check("rope_store_kv_packed k cache", d, &gkc, &ckc, false, t1)?;
        self.check("rope_store_kv_packed v cache", d, &gvc, &cvc, false, t1)?;

        // The split op on the parts of the same rows.
        let (mut sq, mut sk, mut sv) = (Vec::new(), Vec::new(), Vec::new());
        for r in qkv.chunks(width) {
            sq.extend_from_slice(&r[..qd]);
            sk.extend_from_slice(&r[qd..qd + kd]);
            sv.extend_from_slice(&r[qd + kd..]);
        }
        let (mut gsq, mut gsk, gsv) = (self.dev(&sq, d)?, self.dev(&sk, d)?, self.dev(&sv, d)?);
        let (mut skc, mut svc) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
        self.gpu.rope_store_kv(
            &mut gsq, &mut gsk, &gsv, &gpos, &mut skc, &mut svc, &grows, tokens, heads, kv, hd, 1e6,
        )?;
        let g = self.gpu;
        let same = [
            (
                "q",
                bits(g, &gq, tokens * qd)? == bits(g, &gsq, tokens * qd)?,
            ),
            (
                "k cache",
                bits(g, &gkc, kc.len())? == bits(g, &skc, kc.len())?,
            ),
            (
                "v cache",
                bits(g, &gvc, vc.len())? == bits(g, &svc, vc.len())?,
            ),
        ];
        self.flag_same("rope_store_kv_packed vs split op (gpu)", d, &same);
        Ok(())
    }

    /// The decode step's fused rope + kv_store + attention (`attention_paged_rope`) against
    /// the two ops it replaces on the GPU (output and both caches bit for bit) and against the
    /// CPU: each query its own sequence, its new token at position len − 1 of its shuffled
    /// table; few long queries (context splits) and many short ones, Qwen2.5-0.5B's heads and
    /// a group of 4 at head_dim 128.
    fn attention_paged_rope(&mut self, d: DType) -> Result<()> {
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
            let kc = self.randn(num_blocks * bs * row, 1.0, d);
            let vc = self.randn(num_blocks * bs * row, 1.0, d);
            let pool = self.shuffled(num_blocks);
            let tables: Vec<u32> = pool[..queries * max_blocks].to_vec();
            let seq: Vec<u32> = (0..queries as u32).collect();
            let len: Vec<u32> = (0..queries)
                .map(|_| 1 + self.rng.below(max_len) as u32)
                .collect();
            let pos: Vec<u32> = len.iter().map(|l| l - 1).collect();
            let rows: Vec<u32> = (0..queries)
                .map(|i| {
                    let p = pos[i] as usize;
                    (tables[i * max_blocks + p / bs] as usize * bs + p % bs) as u32
                })
                .collect();
            let qkv = self.randn(queries * width, 1.0, d);
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
            Cpu.attention_paged_rope(
                &mut co, &qkv, &mut q, &pos, &mut ckc, &mut cvc, &rows, &tables, &seq, &len, s,
                theta,
            )?;
            let (gx, gpos, grows) = (self.dev(&qkv, d)?, self.idx(&pos)?, self.idx(&rows)?);
            let (gt, gs, gl) = (self.idx(&tables)?, self.idx(&seq)?, self.idx(&len)?);
            // GPU, two ops.
            let (mut akc, mut avc) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
            let mut aq = self.poisoned(queries * qd, d)?;
            let mut ao = self.poisoned(queries * qd, d)?;
            self.gpu.rope_store_kv_packed(
                &gx, &mut aq, &gpos, &mut akc, &mut avc, &grows, queries, heads, kv, hd, theta,
            )?;
            self.gpu
                .attention_paged(&mut ao, &aq, &akc, &avc, &gt, &gs, &gl, s)?;
            // GPU, fused.
            let (mut fkc, mut fvc) = (self.dev(&kc, d)?, self.dev(&vc, d)?);
            let mut fq = self.poisoned(queries * qd, d)?;
            let mut fo = self.poisoned(queries * qd, d)?;
            self.gpu.attention_paged_rope(
                &mut fo, &gx, &mut fq, &gpos, &mut fkc, &mut fvc, &grows, &gt, &gs, &gl, s, theta,
            )?;
            self.check(
                &format!("attention_paged_rope {tag}"),
                d,
                &fo,
                &co,
                true,
                t1,
            )?;
            self.check(
                &format!("attention_paged_rope {tag} k cache"),
                d,
                &fkc,
                &ckc,
                false,
                t1,
            )?;
            let g = self.gpu;
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
            self.flag_same(
                &format!("attention_paged_rope {tag} vs two ops (gpu)"),
                d,
                &same,
            );
        }
        Ok(())
    }

    /// SwiGLU of a fused gate/up projection [n, 2f]: against the CPU op, and bit for bit
    /// against the GPU's `swiglu` of the two halves. f a multiple of 8 (the bf16 vector
    /// kernels on both sides), f odd (the scalar kernels), and 8 rows of an odd f (the split
    /// op vectorised, the packed one scalar).
    fn swiglu_packed(&mut self, d: DType) -> Result<()> {
        let (t1, _) = tols(d);
        for (tag, n, f) in [
            ("f 512", 37usize, 512usize),
            ("f 37", 29, 37),
            ("8 rows, f 37", 8, 37),
        ] {
            let gu = self.randn(n * 2 * f, 2.0, d);
            let mut want = vec![0f32; n * f];
            Cpu.swiglu_packed(&mut want, &gu, n, f)?;
            let ggu = self.dev(&gu, d)?;
            let mut gh = self.poisoned(n * f, d)?;
            self.gpu.swiglu_packed(&mut gh, &ggu, n, f)?;
            self.check(&format!("swiglu_packed {tag}"), d, &gh, &want, true, t1)?;
            let (mut g, mut u) = (Vec::new(), Vec::new());
            for r in gu.chunks(2 * f) {
                g.extend_from_slice(&r[..f]);
                u.extend_from_slice(&r[f..]);
            }
            let (gg, gu_) = (self.dev(&g, d)?, self.dev(&u, d)?);
            let mut sh = self.gpu.alloc_as(n * f, d)?;
            self.gpu.swiglu(&mut sh, &gg, &gu_, n * f)?;
            let same = bits(self.gpu, &gh, n * f)? == bits(self.gpu, &sh, n * f)?;
            self.flag(
                &format!("swiglu_packed {tag} vs split op (gpu)"),
                d,
                same,
                if same { "bit-identical" } else { "DIFFERENT" }.into(),
            );
        }
        Ok(())
    }

    /// `alloc_parts`: each part a view at the previous part's end rounded up to 256 bytes
    /// (computed here), the whole buffer holding what was uploaded into the parts and zeros
    /// in the padding, an op on one part leaving its neighbours alone, the parts living on
    /// after the whole is dropped; sizes that need no padding give the parts concatenated.
    fn alloc_parts(&mut self, d: DType) -> Result<()> {
        let es = if d == DType::F32 { 4 } else { 2 };
        // Odd sizes (padding, an empty part) and the tiny model's q/k/v shapes (none).
        for (tag, sizes) in [
            ("padded", vec![1000usize, 37, 0, 300, 65]),
            ("q/k/v", vec![256 * 256, 128 * 256, 128 * 256]),
        ] {
            let (whole, mut parts) = self
                .gpu
                .alloc_parts(&sizes, d)?
                .ok_or_else(|| anyhow!("the CUDA backend gave no parts"))?;
            let data: Vec<Vec<f32>> = sizes.iter().map(|&n| self.randn(n, 1.0, d)).collect();
            let mut problems = Vec::new();
            let mut want: Vec<f32> = Vec::new();
            for (i, (p, x)) in parts.iter_mut().zip(&data).enumerate() {
                self.gpu.upload(p, x)?;
                let off = want.len().div_ceil(PART_ALIGN / es) * (PART_ALIGN / es);
                want.resize(off, 0.0);
                want.extend_from_slice(x);
                if p.ptr != whole.ptr + (off * es) as u64 || p.len != x.len() {
                    problems.push(format!(
                        "part {i}: {} elements at byte {}, expected {} at {}",
                        p.len,
                        p.ptr - whole.ptr,
                        x.len(),
                        off * es
                    ));
                }
                if !p.ptr.is_multiple_of(PART_ALIGN as u64) {
                    problems.push(format!("part {i} is not {PART_ALIGN}-byte aligned"));
                }
            }
            if whole.len != want.len() {
                problems.push(format!(
                    "whole holds {} elements, expected {}",
                    whole.len,
                    want.len()
                ));
            }
            if tag == "q/k/v" && whole.len != sizes.iter().sum::<usize>() {
                problems.push("padding between parts that need none".into());
            }
            self.check(
                &format!("alloc_parts {tag} (whole)"),
                d,
                &whole,
                &want,
                false,
                0.0,
            )?;
            // fill of part 1 only.
            let n1 = parts[1].len;
            self.gpu.fill(&mut parts[1], n1, -3.5)?;
            let off1 = ((parts[1].ptr - whole.ptr) as usize) / es;
            want[off1..off1 + n1].iter_mut().for_each(|v| *v = -3.5);
            self.check(
                &format!("alloc_parts {tag} (fill of one part)"),
                d,
                &whole,
                &want,
                false,
                0.0,
            )?;
            // Dropping the whole keeps the memory: a new buffer of its size must not get it.
            let last = parts.len() - 1;
            let (n_last, off_last) = (
                parts[last].len,
                ((parts[last].ptr - whole.ptr) as usize) / es,
            );
            drop(whole);
            let other = self.dev(&vec![9.0; want.len()], d)?;
            self.check(
                &format!("alloc_parts {tag} (part after the whole is dropped)"),
                d,
                &parts[last],
                &want[off_last..off_last + n_last],
                false,
                0.0,
            )?;
            drop(other);
            self.flag(
                &format!("alloc_parts {tag} layout"),
                d,
                problems.is_empty(),
                if problems.is_empty() {
                    format!("{} parts, {} elements in all", sizes.len(), want.len())
                } else {
                    problems.join("; ")
                },
            );
        }
        Ok(())
    }

    fn sample(&mut self, d: DType) -> Result<()> {
        let (rows, vocab) = (64usize, 151_936usize);
        // Logits of a peaked distribution (a few large values) over a large vocabulary, as a
        // model's are; f32 as the decoder's logits buffer is.
        let mut logits = self.randn(rows * vocab, 2.0, DType::F32);
        for r in 0..rows {
            for _ in 0..20 {
                let v = self.rng.below(vocab);
                logits[r * vocab + v] += 8.0;
            }
        }
        let keys: Vec<u32> = (0..2 * rows).map(|_| self.rng.next_u64() as u32).collect();
        let pos: Vec<u32> = (0..rows).map(|_| self.rng.below(1000) as u32).collect();
        let gl = self.dev(&logits, DType::F32)?;
        let (gk, gp) = (self.idx(&keys)?, self.idx(&pos)?);
        let settings = [
            ("greedy", SamplingParams::greedy()),
            (
                "T=1",
                SamplingParams {
                    temperature: 1.0,
                    top_k: -1,
                    top_p: 1.0,
                },
            ),
            (
                "T=0.7 top-k 50",
                SamplingParams {
                    temperature: 0.7,
                    top_k: 50,
                    top_p: 1.0,
                },
            ),
            (
                "T=1 top-p 0.9",
                SamplingParams {
                    temperature: 1.0,
                    top_k: -1,
                    top_p: 0.9,
                },
            ),
            (
                "T=0.8 top-k 100 top-p 0.8",
                SamplingParams {
                    temperature: 0.8,
                    top_k: 100,
                    top_p: 0.8,
                },
            ),
        ];
        for (tag, p) in settings {
            let (mut ct, mut cl) = (vec![0u32; rows], vec![0f32; rows]);
            Cpu.sample(&mut ct, &mut cl, &logits, &keys, &pos, rows, vocab, &p)?;
            let mut gt = self.gpu.alloc_idx(rows)?;
            let mut glp = self.gpu.alloc(rows)?;
            self.gpu
                .sample(&mut gt, &mut glp, &gl, &gk, &gp, rows, vocab, &p)?;
            let (mut ht, mut hl) = (vec![0u32; rows], vec![0f32; rows]);
            self.gpu.download_idx(&gt, &mut ht)?;
            self.gpu.download(&glp, &mut hl)?;
            let same = ht.iter().zip(&ct).filter(|(a, b)| a == b).count();
            let lp_err = ht
                .iter()
                .zip(&ct)
                .zip(hl.iter().zip(&cl))
                .filter(|((a, b), _)| a == b)
                .map(|(_, (x, y))| (x - y).abs() as f64)
                .fold(0.0, f64::max);
            // Tokens must agree (a draw within ~1e-7 of a CDF boundary could flip: allow one);
            // log-probs of agreeing tokens to f32 rounding.
            let pass = same + 1 >= rows && lp_err <= 1e-4;
            self.flag(
                &format!("sample {tag}"),
                d,
                pass,
                format!("{same}/{rows} tokens equal, max |Δ logprob| {lp_err:.2e}"),
            );
        }
        Ok(())
    }
}
