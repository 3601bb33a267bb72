//! LoRA on the GPU against the CPU (`lora`): a decoder training rank-8 adapters on every
//! projection of a tiny model, B random rather than PEFT's zero so that the adapters change
//! the forward: its log-probs, the adapters' gradients (and no other), one AdamW step of them.
//! `lora_merge`: the generation copy merged on the GPU (`Decoder::lora_generation`) against
//! the host's f64 merge (`merge_rounded`, what `tandem merge-lora` writes). `lora_unmerged`:
//! the adapters applied at each step of the rollout engine against the CPU and the merge.

use anyhow::Result;

use super::{backward_both, flat, random_requests, tiny_config, values_row, worst_tensor};
use crate::backend::check::gpu::{compare, dname, tols, Ctx, Row};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::ops::sample::SamplingParams;
use crate::backend::DType;
use crate::engine::paged::{
    generate_paged, Completion, GenParams, PagedConfig, PagedDecoder, Request,
};
use crate::model::decoder::{AdamWParams, Decoder, SeqRef};
use crate::model::lora::{init_adapters, merge_rounded, LoraSpec, Target};
use crate::model::safetensors::round_bf16;
use crate::model::{init, Arch, Config, Weights};

/// Rank-8 adapters on every projection, B random (not PEFT's zero) so that they change W.
fn rank8(s: &mut Ctx, cfg: &Config) -> (LoraSpec, Weights) {
    let spec = LoraSpec {
        rank: 8,
        alpha: 16.0,
        targets: Target::ALL.to_vec(),
    };
    let adapters = random_adapters(s, cfg, &spec);
    (spec, adapters)
}

fn random_adapters(s: &mut Ctx, cfg: &Config, spec: &LoraSpec) -> Weights {
    let mut adapters = init_adapters(cfg, spec, s.rng.next_u64());
    for (_, t) in adapters.iter_mut().filter(|(k, _)| k.contains("lora_B")) {
        t.data.iter_mut().for_each(|v| *v = 0.05 * s.rng.normal());
    }
    adapters
}

/// |a − b| in bf16 steps at magnitude `m`: the spacing of bf16 numbers there (2^(e − 7) for
/// m in [2^e, 2^(e+1))). Measured at the larger of the merge's terms, not at the result, whose
/// step shrinks where W and (α/r)·B·A cancel while the sum's rounding does not.
fn bf16_steps_at(a: f32, b: f32, m: f32) -> f64 {
    let m = f64::from(m.abs()).max(f64::from(f32::MIN_POSITIVE));
    let step = 2f64.powi(m.log2().floor() as i32 - 7);
    f64::from((a - b).abs()) / step
}

/// The generation copy a LoRA daemon builds after an update, merged on the GPU, against the
/// host's f64 merge of the same adapters into the same (bf16) base: each merged element at
/// most one bf16 step away, a step taken at the larger of the merge's terms (the GEMM sums
/// (α/r)·B·A in f32, and the add rounds once); the note counts the elements that differ. The
/// weights not targeted are copied and must be equal.
pub(super) fn lora_merge(s: &mut Ctx, d: DType) -> Result<()> {
    let cfg = tiny_config(Arch::Qwen2);
    let mut base = init::random_weights(&cfg, s.rng.next_u64(), 0.05);
    for t in base.values_mut() {
        t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    let (spec, adapters) = rank8(s, &cfg);
    let gb = CudaBackend::new(s.ordinal)?;
    gb.set_compute_dtype(d);
    let policy = Decoder::with_lora(gb, &cfg, &base, &adapters, &spec)?;
    let gen_backend = CudaBackend::new(s.ordinal)?;
    gen_backend.set_compute_dtype(d);
    let got = policy
        .lora_generation(gen_backend, &adapters)?
        .export_compute_weights()?;
    let mut want = base.clone();
    merge_rounded(&cfg, &mut want, &adapters, &spec)?;
    let targets: Vec<String> = spec
        .adapters(&cfg)
        .iter()
        .map(|a| a.target.weight_name(a.layer))
        .collect();
    let (mut merged, mut differ, mut steps, mut max_abs) = (0usize, 0usize, 0f64, 0f64);
    let mut copies_equal = got.len() == want.len();
    for (name, w) in &want {
        let Some(g) = got.get(name) else {
            copies_equal = false;
            continue;
        };
        if !targets.contains(name) {
            copies_equal &= g.data == w.data;
            continue;
        }
        let b = &base[name].data;
        for ((&x, &y), &w0) in g.data.iter().zip(&w.data).zip(b) {
            let k = bf16_steps_at(x, y, w0.abs().max(y.abs()).max((y - w0).abs()));
            merged += 1;
            differ += usize::from(x != y);
            steps = steps.max(k);
            max_abs = max_abs.max(f64::from((x - y).abs()));
        }
    }
    s.rows.push(Row {
        op: "lora merge on device vs host f64, bf16 steps".into(),
        dtype: dname(d),
        max_abs,
        max_rel: steps,
        tol: 1.0,
        pass: copies_equal && merged > 0 && steps <= 1.0,
        note: format!(
            "{differ} of {merged} merged elements differ{}",
            if copies_equal {
                ""
            } else {
                "; the copied weights differ"
            }
        ),
    });
    Ok(())
}

pub(super) fn lora(s: &mut Ctx, d: DType) -> Result<()> {
    let (tol_lp, tol_g, tol_upd) = match d {
        DType::F32 => (1e-4, 1e-3, 1e-3),
        DType::BF16 => (2e-2, 5e-2, 5e-2),
    };
    let cfg = tiny_config(Arch::Qwen2);
    let base = init::random_weights(&cfg, s.rng.next_u64(), 0.05);
    let (spec, adapters) = rank8(s, &cfg);
    let mut cpu = Decoder::with_lora(Cpu, &cfg, &base, &adapters, &spec)?;
    let gb = CudaBackend::new(s.ordinal)?;
    gb.set_compute_dtype(d);
    let mut gpu = Decoder::with_lora(gb, &cfg, &base, &adapters, &spec)?;
    let toks: Vec<Vec<u32>> = [60usize, 13, 90]
        .iter()
        .map(|&l| (0..l).map(|_| s.rng.below(1000) as u32).collect())
        .collect();
    let seqs: Vec<SeqRef> = toks
        .iter()
        .zip([1usize, 4, 25])
        .map(|(t, start)| SeqRef { tokens: t, start })
        .collect();
    let (lc, lg) = (
        cpu.logprobs(&seqs, 1.0, false)?,
        gpu.logprobs(&seqs, 1.0, false)?,
    );
    let op = "lora logprobs [qwen2, all-linear r8]".to_string();
    values_row(s, op, d, &lg, &lc, tol_lp);
    let (gc, gg) = backward_both(s, &mut cpu, &mut gpu, &seqs, &lc)?;
    // Only the adapters train: every gradient is an adapter's, and every adapter has one.
    let only_adapters = gg.len() == adapters.len() && gg.keys().all(|k| adapters.contains_key(k));
    let (name, r) = worst_tensor(&gg, &gc);
    let (a, _, p) = compare(&flat(&gg), &flat(&gc), &[]);
    s.rows.push(Row {
        op: "lora adapter grads, worst tensor".into(),
        dtype: dname(d),
        max_abs: a,
        max_rel: r,
        tol: tol_g,
        pass: only_adapters && gg.len() == gc.len() && p.is_none() && r <= tol_g,
        note: if only_adapters {
            name
        } else {
            format!("{} gradients for {} adapters", gg.len(), adapters.len())
        },
    });
    // eps large next to the gradients keeps the update linear in g (as the decoder case).
    let hp = AdamWParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 0.1,
        weight_decay: 0.1,
    };
    cpu.optimizer_step(&hp, Some(0.5))?;
    gpu.optimizer_step(&hp, Some(0.5))?;
    let delta = |x: &Weights| -> Weights {
        x.iter()
            .map(|(k, t)| {
                let mut t = t.clone();
                t.data
                    .iter_mut()
                    .zip(&adapters[k].data)
                    .for_each(|(v, o)| *v -= o);
                (k.clone(), t)
            })
            .collect()
    };
    let (dc, dg) = (
        delta(&cpu.export_adapters()?),
        delta(&gpu.export_adapters()?),
    );
    let (name, r) = worst_tensor(&dg, &dc);
    let (a, _, p) = compare(&flat(&dg), &flat(&dc), &[]);
    s.rows.push(Row {
        op: "lora AdamW update, worst adapter".into(),
        dtype: dname(d),
        max_abs: a,
        max_rel: r,
        tol: tol_upd,
        pass: !dc.is_empty() && dg.len() == dc.len() && p.is_none() && r <= tol_upd,
        note: name,
    });
    Ok(())
}

/// Teacher-forced logits of `dec` through the paged engine: each request's prompt, then the
/// first 8 tokens of its completion, concatenated over the requests.
fn forced<B: crate::backend::Backend>(
    dec: &mut Decoder<B>,
    reqs: &[Request],
    done: &[Vec<Completion>],
) -> Result<Vec<f32>> {
    let mut eng = PagedDecoder::new(dec, 16, 16)?;
    let mut all = Vec::new();
    for (r, c) in reqs.iter().zip(done) {
        let fed: Vec<u32> = c[0].tokens.iter().take(8).copied().collect();
        all.extend(eng.forced_logits(&r.prompt, &fed)?);
    }
    Ok(all)
}

/// Unmerged LoRA in the rollout engine (`rollout --lora-mode unmerged`) on the GPU: rank-8
/// adapters (B random) on every projection of the tiny Qwen2 (q/k/v and gate/up fused, their
/// adapters stacked) and Qwen3 (qk_norm: gate/up fused only). A greedy paged rollout (CUDA
/// graphs where the backend has them), then the teacher-forced logits along it: against the
/// CPU's unmerged decoder (f32, the oracle), against the same GPU decoder with the split
/// projections, and against the GPU's merged weights (W' rounded to bf16: bf16 tolerance in
/// both dtypes); the base's logits must differ (the adapters apply).
pub(super) fn lora_unmerged(s: &mut Ctx, d: DType) -> Result<()> {
    let (t1, t2) = tols(d);
    for arch in [Arch::Qwen2, Arch::Qwen3] {
        let cfg = Config {
            eos_token_ids: vec![],
            ..tiny_config(arch)
        };
        let mut base = init::random_weights(&cfg, s.rng.next_u64(), 0.05);
        for t in base.values_mut() {
            t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
        }
        let (spec, ad) = rank8(s, &cfg);
        let reqs = random_requests(s, 6, 5, 40, 1);
        let params = GenParams {
            sampling: SamplingParams::greedy(),
            max_new_tokens: 24,
            stop_token_ids: vec![],
            stop_strings: vec![],
        };
        let pc = PagedConfig {
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 6,
            max_batched_tokens: 64,
            overlap: true,
        };
        let gpu_backend = || -> Result<CudaBackend> {
            let b = CudaBackend::new(s.ordinal)?;
            b.set_compute_dtype(d);
            Ok(b)
        };
        let mut gpu =
            Decoder::for_generation_unmerged(gpu_backend()?, &cfg, base.clone(), &ad, &spec)?;
        let fused = gpu.set_fused_projections(true);
        let done = {
            let mut eng = PagedDecoder::new(&mut gpu, pc.num_blocks, pc.block_size)?;
            generate_paged(&mut eng, &pc, &reqs, &params, None, &mut |_| {})?.0
        };
        let got = forced(&mut gpu, &reqs, &done)?;
        gpu.set_fused_projections(false);
        let split = forced(&mut gpu, &reqs, &done)?;
        drop(gpu);
        let mut cpu = Decoder::for_generation_unmerged(Cpu, &cfg, base.clone(), &ad, &spec)?;
        let want = forced(&mut cpu, &reqs, &done)?;
        let mut merged = Decoder::for_generation(gpu_backend()?, &cfg, base.clone())?;
        merged.merge_adapters(&spec, &ad)?;
        let from_merged = forced(&mut merged, &reqs, &done)?;
        drop(merged);
        let from_base = forced(
            &mut Decoder::for_generation(gpu_backend()?, &cfg, base)?,
            &reqs,
            &done,
        )?;
        let name = format!("{arch:?}").to_lowercase();
        // The merged W' is rounded to bf16 in both dtypes.
        let bf16_tol = tols(DType::BF16).1;
        let rows = [
            ("vs cpu", &want, if d == DType::F32 { t1 } else { t2 }),
            (
                "fused vs split",
                &split,
                if d == DType::F32 { t1 } else { t2 },
            ),
            ("vs merged", &from_merged, bf16_tol),
        ];
        for (what, other, tol) in rows {
            let (a, r, p) = compare(&got, other, &[]);
            s.rows.push(Row {
                op: format!("lora_unmerged {name} forced logits {what}"),
                dtype: dname(d),
                max_abs: a,
                max_rel: r,
                tol,
                pass: p.is_none() && r <= tol && !got.is_empty(),
                note: format!("fused buffers: {fused}"),
            });
        }
        let (_, r_base, _) = compare(&got, &from_base, &[]);
        s.flag(
            &format!("lora_unmerged {name} differs from the base"),
            d,
            r_base > 2.0 * bf16_tol,
            format!("forced logits max rel {r_base:.2e} from the base's"),
        );
    }
    Ok(())
}
