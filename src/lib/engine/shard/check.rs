//! The sharded optimizer against the plain one on the same gradients: the `sharded_update`
//! case of `tandem gpu-test` (world size 1 through NCCL), and the same comparison on the CPU
//! with 1 and 2 ranks of the CPU communicator in the unit tests, where full sharding's passes
//! with the next unit's all-gather prefetched are also checked against the same passes without,
//! and LoRA adapters sharded alone on a frozen base against the unsharded LoRA update.

use anyhow::{ensure, Result};

use super::{Holding, ShardedOptim};
use crate::backend::check::gpu::{dname, Case, Ctx, Row};
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, DType};
use crate::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads, TokenStats};
use crate::model::lora::{init_adapters, LoraSpec};
use crate::model::safetensors::round_bf16;
use crate::model::{init, Config, Weights};
use crate::parallel::{Comm, NcclComm, Options, ProcessGroup, World};

/// The gpu-test case.
pub const CASES: &[Case] = &[Case {
    name: "sharded_update",
    run: sharded_update,
}];

/// How [`sharded_vs_plain`] shards the optimizer.
pub(crate) enum Sharded<B> {
    /// zero2, in buckets of this many elements.
    Zero2(usize),
    /// `shard = "full"`; with a backend, the generation copy of a daemon group's rank is then
    /// built on it from the shards ([`ShardedOptim::gather_generation`]) and compared too.
    Full(Option<B>),
}

/// Trains `plain` with the ordinary optimizer and `sharded` with the optimizer sharded over
/// `comm` as `how` says for 3 clipped AdamW steps on `seqs`, with fixed upstream gradients
/// `up` of the log-probs (this rank adds 1/world of them, so the sum over the ranks is the
/// plain gradient). Returns the relative errors of the sharded masters, exp_avg and exp_avg_sq
/// against the plain ones, and of the generation copy against the bf16 rounding of the plain
/// weights (NaN where none is built). Full sharding's passes gather each unit; zero2's pass of
/// the first and last steps reduce-scatters the buckets during its backward
/// ([`super::Overlap`]), the middle step's after the pass.
pub(crate) fn sharded_vs_plain<B: Backend>(
    plain: &mut Decoder<B>,
    sharded: &mut Decoder<B>,
    comm: &dyn Comm<B>,
    seqs: &[SeqRef],
    up: &[Vec<f32>],
    how: Sharded<B>,
) -> Result<[f64; 4]> {
    let hp = AdamWParams {
        lr: 1e-3,
        ..AdamWParams::default()
    };
    let clip = Some(0.5);
    let share = 1.0 / comm.world_size() as f32;
    let (mut optim, full, gen) = match how {
        Sharded::Zero2(bucket_elems) => (
            ShardedOptim::zero2(sharded, comm, bucket_elems)?,
            false,
            None,
        ),
        Sharded::Full(gen) => (ShardedOptim::full(sharded, comm)?, true, gen),
    };
    let grads = |scale: f32| {
        move |_: &[TokenStats]| -> Result<Vec<TokenGrads>> {
            Ok(up
                .iter()
                .map(|u| TokenGrads {
                    dlogprobs: u.iter().map(|x| x * scale).collect(),
                    dentropy: None,
                })
                .collect())
        }
    };
    for step in 0..3 {
        plain.zero_grads()?;
        plain.forward_backward(seqs, 1.0, &mut grads(1.0))?;
        if full {
            optim.zero_grads(sharded.backend())?;
            let mut hold = Holding::new(comm, &mut optim);
            sharded.forward_backward_with(seqs, 1.0, &mut grads(share), &mut hold)?;
        } else if step != 1 {
            sharded.zero_grads()?;
            optim.begin_step();
            let mut ov = optim.overlap(comm);
            sharded.forward_backward_with(seqs, 1.0, &mut grads(share), &mut ov)?;
            ov.finish()?;
        } else {
            sharded.zero_grads()?;
            optim.begin_step();
            sharded.forward_backward(seqs, 1.0, &mut grads(share))?;
        }
        plain.optimizer_step(&hp, clip)?;
        optim.step(sharded, comm, &hp, clip)?;
    }
    let gen_err = match gen {
        Some(backend) => {
            let copy = optim.gather_generation(sharded, comm, backend)?;
            let mut want = plain.export_weights()?;
            for t in want.values_mut() {
                t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
            }
            rel_err(&copy.export_weights()?, &want)
        }
        None => f64::NAN,
    };
    let stats = optim.unshard(sharded, comm)?;
    let overlapped = if full { 0 } else { 2 * stats.buckets as u64 };
    ensure!(
        stats.overlapped_buckets == overlapped,
        "{} buckets reduced during the backward, expected {overlapped}",
        stats.overlapped_buckets
    );
    let (a, b) = (sharded.optimizer_state()?, plain.optimizer_state()?);
    Ok([
        rel_err(&sharded.export_weights()?, &plain.export_weights()?),
        rel_err(&a.exp_avg, &b.exp_avg),
        rel_err(&a.exp_avg_sq, &b.exp_avg_sq),
        gen_err,
    ])
}

/// ‖a − b‖ / ‖b‖ over every tensor (infinite when the names differ).
fn rel_err(a: &Weights, b: &Weights) -> f64 {
    if a.keys().ne(b.keys()) {
        return f64::INFINITY;
    }
    let (mut d, mut n) = (0f64, 0f64);
    for (k, t) in b {
        for (x, y) in a[k].data.iter().zip(&t.data) {
            d += ((x - y) as f64).powi(2);
            n += (*y as f64).powi(2);
        }
    }
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// Random sequences (ids below `vocab`) and upstream gradients of their scored tokens.
fn inputs(seed: u64, vocab: usize) -> (Vec<Vec<u32>>, Vec<usize>, Vec<Vec<f32>>) {
    let mut rng = crate::rng::SplitMix64(seed);
    let lens = [23usize, 9, 40];
    let starts = vec![3usize, 1, 10];
    let toks: Vec<Vec<u32>> = lens
        .iter()
        .map(|&l| (0..l).map(|_| rng.below(vocab as u64) as u32).collect())
        .collect();
    let up = lens
        .iter()
        .zip(&starts)
        .map(|(&l, &s)| (s..l).map(|_| rng.uniform() as f32 * 2.0 - 1.0).collect())
        .collect();
    (toks, starts, up)
}

fn seq_refs<'a>(toks: &'a [Vec<u32>], starts: &[usize]) -> Vec<SeqRef<'a>> {
    toks.iter()
        .zip(starts)
        .map(|(t, &start)| SeqRef { tokens: t, start })
        .collect()
}

/// Rank-4 LoRA adapters on q, v and down of `cfg` with a non-zero B (so that A has a gradient
/// from the first step on): (spec, adapters).
fn lora_adapters(cfg: &Config) -> (LoraSpec, Weights) {
    let targets = LoraSpec::parse_targets("q,v,down", "test").expect("known targets");
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        targets,
    };
    let mut ad = init_adapters(cfg, &spec, 3);
    for (name, t) in ad.iter_mut() {
        if name.ends_with("lora_B.weight") {
            let x = t.data.iter_mut().enumerate();
            x.for_each(|(i, x)| *x = ((i % 7) as f32 - 3.0) * 0.01);
        }
    }
    (spec, ad)
}

/// gpu-test: at world size 1 through NCCL, the sharded update equals the plain one on the
/// same GPU (relative error of masters and moments ≤ 1e-6 in f32, ≤ 1e-3 with bf16 compute),
/// under zero2 and full sharding, and under zero2 for LoRA adapters on a frozen base.
fn sharded_update(s: &mut Ctx, d: DType) -> Result<()> {
    let tol = match d {
        DType::F32 => 1e-6,
        DType::BF16 => 1e-3,
    };
    let cfg = Config::small_qwen2();
    let w = init::random_weights(&cfg, s.rng.next_u64(), 0.05);
    let (toks, starts, up) = inputs(s.rng.next_u64(), cfg.vocab_size);
    let seqs = seq_refs(&toks, &starts);
    let pg = ProcessGroup::new(World::single(), Options::from_env()?)?;
    let (ga, gb) = (CudaBackend::new(s.ordinal)?, CudaBackend::new(s.ordinal)?);
    ga.set_compute_dtype(d);
    gb.set_compute_dtype(d);
    let comm = NcclComm::new(&gb, &pg)?;
    let mut plain = Decoder::new(ga, &cfg, &w)?;
    let mut sharded = Decoder::new(gb, &cfg, &w)?;
    // Small buckets: several per tensor group, one tensor (the embeddings) alone.
    let [m, v1, v2, _] = sharded_vs_plain(
        &mut plain,
        &mut sharded,
        &comm,
        &seqs,
        &up,
        Sharded::Zero2(20_000),
    )?;
    let errs = [m, v1, v2];
    // Full sharding (FSDP): a fresh pair, each unit gathered before its passes.
    let (ga, gc) = (CudaBackend::new(s.ordinal)?, CudaBackend::new(s.ordinal)?);
    ga.set_compute_dtype(d);
    gc.set_compute_dtype(d);
    let mut plain = Decoder::new(ga, &cfg, &w)?;
    let comm = NcclComm::new(&gc, &pg)?;
    let mut sharded = Decoder::new(gc, &cfg, &w)?;
    // The generation copy a daemon group's rank builds from its shards after an update.
    let gd = CudaBackend::new(s.ordinal)?;
    gd.set_compute_dtype(d);
    let how = Sharded::Full(Some(gd));
    let full = sharded_vs_plain(&mut plain, &mut sharded, &comm, &seqs, &up, how)?;
    // LoRA: the adapters alone sharded, the base frozen in the compute dtype.
    let (spec, ad) = lora_adapters(&cfg);
    let lora = |d: DType| -> Result<Decoder<CudaBackend>> {
        let g = CudaBackend::new(s.ordinal)?;
        g.set_compute_dtype(d);
        Decoder::with_lora(g, &cfg, &w, &ad, &spec)
    };
    let (mut plain, mut sharded) = (lora(d)?, lora(d)?);
    let comm = NcclComm::new(sharded.backend(), &pg)?;
    let how = Sharded::Zero2(1_000);
    let adapters = sharded_vs_plain(&mut plain, &mut sharded, &comm, &seqs, &up, how)?;
    let names = ["masters", "exp_avg", "exp_avg_sq", "generation copy"];
    // The copy is the bf16 rounding of masters a hair from the plain ones: an element may
    // round to the neighbouring bf16 value (2^-8 relative), whatever the compute dtype.
    let tols = [tol, tol, tol, 1e-3];
    let rows = names
        .iter()
        .zip(errs)
        .zip(tols)
        .map(|((w, e), tol)| (format!("{w} (nccl, world 1)"), e, tol))
        .chain(
            names
                .iter()
                .zip(full)
                .zip(tols)
                .map(|((w, e), tol)| (format!("{w} (full, nccl, world 1)"), e, tol)),
        )
        .chain(
            names[..3]
                .iter()
                .zip(adapters)
                .map(|(w, e)| (format!("{w} (lora, nccl, world 1)"), e, tol)),
        );
    for (what, e, tol) in rows {
        s.rows.push(Row {
            op: format!("sharded_update {what}"),
            dtype: dname(d),
            max_abs: f64::NAN,
            max_rel: e,
            tol,
            pass: e <= tol,
            note: String::new(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::parallel::testing::ranks;
    use crate::parallel::HostComm;
    use std::time::Duration;

    #[test]
    fn sharded_update_equals_the_plain_one_on_one_and_two_ranks() {
        for (n, full) in [(1, false), (2, false), (1, true), (2, true)] {
            let errs = ranks(n, Duration::from_secs(60), move |pg| {
                let cfg = Config::small_qwen2();
                let w = init::random_weights(&cfg, 7, 0.05);
                let (toks, starts, up) = inputs(11, cfg.vocab_size);
                let seqs = seq_refs(&toks, &starts);
                let comm = HostComm::new(&pg).unwrap();
                let mut plain = Decoder::new(Cpu, &cfg, &w).unwrap();
                let mut sharded = Decoder::new(Cpu, &cfg, &w).unwrap();
                let e = sharded_vs_plain(
                    &mut plain,
                    &mut sharded,
                    &comm,
                    &seqs,
                    &up,
                    match full {
                        false => Sharded::Zero2(5_000),
                        true => Sharded::Full(Some(Cpu)),
                    },
                );
                drop(comm);
                pg.finish().unwrap();
                e.unwrap()
            });
            for (r, e) in errs.iter().enumerate() {
                for (what, x) in ["masters", "exp_avg", "exp_avg_sq"].iter().zip(e) {
                    assert!(
                        *x <= 1e-6,
                        "{n} ranks (full: {full}), rank {r}: {what} relative error {x}"
                    );
                }
                // The generation copy: the bf16 rounding of the weights (a master a hair
                // from the plain one may round to the neighbouring bf16 value).
                match full {
                    true => assert!(
                        e[3] <= 1e-4,
                        "{n} ranks, rank {r}: generation copy {}",
                        e[3]
                    ),
                    false => assert!(e[3].is_nan()),
                }
                // Every rank ends with the same state (NaN where no copy is built).
                assert_eq!(
                    e.map(f64::to_bits),
                    errs[0].map(f64::to_bits),
                    "{n} ranks, rank {r}"
                );
            }
        }
    }

    /// LoRA under zero2 on 1 and 2 ranks: the buckets hold the adapters alone (the frozen
    /// base has size 0 in the plan), each rank's shards are 1/N of them (up to the alignment
    /// padding of each bucket), and 3 clipped AdamW steps give the plain LoRA decoder's
    /// adapters and moments (to 1e-6: the ranks sum the gradients in another order) with the
    /// base untouched, bit for bit.
    #[test]
    fn lora_adapters_alone_are_sharded_and_train_as_unsharded() {
        for n in [1, 2] {
            let out = ranks(n, Duration::from_secs(60), move |pg| {
                let cfg = Config::small_qwen2();
                let w = init::random_weights(&cfg, 7, 0.05);
                let (spec, ad) = lora_adapters(&cfg);
                let adapter_elems: usize = ad.values().map(|t| t.data.len()).sum();
                let (toks, starts, up) = inputs(11, cfg.vocab_size);
                let seqs = seq_refs(&toks, &starts);
                let comm = HostComm::new(&pg).unwrap();
                let lora = || Decoder::with_lora(Cpu, &cfg, &w, &ad, &spec).unwrap();
                let mut probe = lora();
                let optim = ShardedOptim::zero2(&mut probe, &comm, 1_000).unwrap();
                let plan = (optim.plan.total(), optim.plan.buckets.len());
                let shard_elems = optim.stats.shard_elems;
                let (mut plain, mut sharded) = (lora(), lora());
                let how = Sharded::Zero2(1_000);
                let e = sharded_vs_plain(&mut plain, &mut sharded, &comm, &seqs, &up, how);
                let base_kept = sharded
                    .export_weights()
                    .unwrap()
                    .iter()
                    .filter(|(k, _)| w.contains_key(*k))
                    .all(|(k, t)| *t == w[k]);
                drop(comm);
                pg.finish().unwrap();
                (e.unwrap(), plan, shard_elems, adapter_elems, base_kept)
            });
            for (r, (e, (total, buckets), shard, adapters, base_kept)) in out.iter().enumerate() {
                assert_eq!(
                    *total, *adapters,
                    "{n} ranks: the plan holds the adapters only"
                );
                assert!(*buckets > 1, "{n} ranks: {buckets} buckets");
                // ⌈len / n⌉ rounded up to SHARD_ALIGN per bucket.
                let align = crate::parallel::bucket::SHARD_ALIGN;
                assert!(
                    n * shard >= *adapters && n * shard < adapters + n * align * buckets,
                    "{n} ranks, rank {r}: a shard of {shard} of {adapters} adapter elements"
                );
                for (what, x) in ["masters", "exp_avg", "exp_avg_sq"].iter().zip(e) {
                    assert!(*x <= 1e-6, "{n} ranks, rank {r}: {what} relative error {x}");
                }
                assert!(base_kept, "{n} ranks, rank {r}: the frozen base moved");
            }
        }
    }

    /// One rank's end of [`full_sharding_prefetches_and_trains_as_without`]: its shard
    /// metrics, its masters and moments (bits) and the log-probs it scored.
    type FullRun = (super::super::ShardStats, Vec<Vec<u32>>, Vec<u32>);

    /// 2 steps of 3 training passes and a scoring pass each under `shard = "full"` on 2 ranks,
    /// rank 1 with rows in the first pass only, none in the second (an empty pass) and rows
    /// that score no token in the third; with or without the prefetch.
    fn full_run(tied: bool, prefetch: bool) -> Vec<FullRun> {
        ranks(2, Duration::from_secs(60), move |pg| {
            let cfg = Config {
                tie_word_embeddings: tied,
                ..Config::small_qwen2()
            };
            let w = init::random_weights(&cfg, 7, 0.05);
            let (toks, starts, _) = inputs(11, cfg.vocab_size);
            let seqs = seq_refs(&toks, &starts);
            let unscored = [SeqRef {
                tokens: &toks[1],
                start: toks[1].len(),
            }];
            let comm = HostComm::new(&pg).unwrap();
            let rank = comm.rank();
            let mut dec = Decoder::new(Cpu, &cfg, &w).unwrap();
            let mut optim = ShardedOptim::full(&mut dec, &comm).unwrap();
            let hp = AdamWParams {
                lr: 1e-3,
                ..AdamWParams::default()
            };
            let mut loss = |stats: &[TokenStats]| -> Result<Vec<TokenGrads>> {
                Ok(stats
                    .iter()
                    .map(|s| TokenGrads {
                        dlogprobs: (0..s.logprobs.len())
                            .map(|i| (i % 5) as f32 * 0.1 - 0.2)
                            .collect(),
                        dentropy: None,
                    })
                    .collect())
            };
            let mut scored = Vec::new();
            for _ in 0..2 {
                optim.zero_grads(&Cpu).unwrap();
                for pass in 0..3 {
                    let mine: &[SeqRef] = match (rank, pass) {
                        (0, _) => &seqs,
                        (_, 0) => &seqs[..2],
                        (_, 1) => &[],
                        _ => &unscored,
                    };
                    let mut hold = Holding::new(&comm, &mut optim).with_prefetch(prefetch);
                    dec.forward_backward_with(mine, 1.0, &mut loss, &mut hold)
                        .unwrap();
                }
                let mut hold = Holding::new(&comm, &mut optim).with_prefetch(prefetch);
                let mine = if rank == 0 { &seqs[..] } else { &[] };
                for s in dec.logprobs_with(mine, 1.0, false, &mut hold).unwrap() {
                    scored.extend(s.logprobs.iter().map(|x| x.to_bits()));
                }
                drop(hold);
                optim.step(&mut dec, &comm, &hp, Some(0.5)).unwrap();
            }
            let shard = optim.download(&dec).unwrap();
            let (m, v) = shard.moments.expect("moments after a step");
            let bits = [shard.master, m, v]
                .concat()
                .iter()
                .map(|b| b.iter().map(|x| x.to_bits()).collect())
                .collect();
            drop(comm);
            pg.finish().unwrap();
            (optim.stats.clone(), bits, scored)
        })
    }

    /// The next unit's all-gather started while a unit computes changes no bit: on 2 ranks,
    /// one of them idle in some passes, the masters, moments and log-probs equal those of the
    /// same passes without the prefetch, with a tied and an untied head; each forward pass
    /// prefetches all units but its first (units − 1: 3 of the embedding, 2 layers, head) and
    /// each backward all layers but its first (1), on every rank, empty passes included.
    #[test]
    fn full_sharding_prefetches_and_trains_as_without() {
        for tied in [true, false] {
            let (with, without) = (full_run(tied, true), full_run(tied, false));
            for (r, (a, b)) in with.iter().zip(&without).enumerate() {
                // 2 steps × (3 training passes × (3 + 1) + 1 scoring pass × 3).
                assert_eq!(
                    a.0.unit_prefetches,
                    2 * (3 * 4 + 3),
                    "tied {tied}, rank {r}"
                );
                assert_eq!(b.0.unit_prefetches, 0, "tied {tied}, rank {r}");
                assert_eq!(a.0.unit_gathers, b.0.unit_gathers, "tied {tied}, rank {r}");
                assert_eq!(a.0.unit_gather_bytes, b.0.unit_gather_bytes);
                assert!(a.1 == b.1, "tied {tied}, rank {r}: the shards differ");
                assert!(a.2 == b.2, "tied {tied}, rank {r}: the log-probs differ");
            }
            assert!(!with[0].2.is_empty() && with[1].2.is_empty());
        }
    }
}
