//! The decoder on the GPU, whole: against the CPU decoder (`decoder`: log-probs, entropies,
//! gradients, an AdamW step; `value_model`: a critic's values and gradients) and against the
//! log-probs transformers computed for the tiny HF fixture models (`hf_fixtures`).

use anyhow::{bail, Result};

use super::{backward_both, flat, tiny_config, values_row, worst_tensor};
use crate::backend::check::gpu::{compare, dname, round, Ctx, Row};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::CudaBackend;
use crate::backend::DType;
use crate::model::critic::value_model_from;
use crate::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads, TokenStats};
use crate::model::names::{VALUE_BIAS, VALUE_HEAD};
use crate::model::{init, Arch, Tensor, Weights};

/// The decoder (written once against the op set) on both backends: log-probs and entropies
/// of packed sequences, the gradients of one forward/backward, one AdamW step, and the
/// log-probs after it. The f32 pass builds the GPU decoder with f32 compute (op-by-op
/// parity); the bf16 pass with the default bf16 compute weights and activations, f32
/// masters and optimizer state, so it checks the mixed-precision training path.
pub(super) fn decoder(s: &mut Ctx, d: DType) -> Result<()> {
    // (log-probs and entropies, gradients, update) relative to the CPU's scale.
    let (tol_lp, tol_g, tol_upd) = match d {
        DType::F32 => (1e-4, 1e-3, 1e-3),
        DType::BF16 => (2e-2, 5e-2, 5e-2),
    };
    for arch in [Arch::Qwen2, Arch::Llama, Arch::Qwen3] {
        let cfg = tiny_config(arch);
        let tag = format!("{arch:?}").to_lowercase();
        let mut w = init::random_weights(&cfg, s.rng.next_u64(), 0.05);
        // Norms start at one and biases at zero: move them so they are exercised too.
        for t in w.values_mut().filter(|t| t.shape.len() == 1) {
            for v in t.data.iter_mut() {
                *v += 0.1 * s.rng.normal();
            }
        }
        let mut cpu = Decoder::new(Cpu, &cfg, &w)?;
        let gb = CudaBackend::new(s.ordinal)?;
        gb.set_compute_dtype(d);
        let mut gpu = Decoder::new(gb, &cfg, &w)?;
        let lens = [50usize, 17, 120];
        let toks: Vec<Vec<u32>> = lens
            .iter()
            .map(|&l| (0..l).map(|_| s.rng.below(1000) as u32).collect())
            .collect();
        let seqs: Vec<SeqRef> = toks
            .iter()
            .zip([1usize, 5, 30])
            .map(|(t, start)| SeqRef { tokens: t, start })
            .collect();
        let (lc, lg) = (
            cpu.logprobs(&seqs, 0.8, true)?,
            gpu.logprobs(&seqs, 0.8, true)?,
        );
        let cat = |v: &[TokenStats], ent: bool| -> Vec<f32> {
            v.iter()
                .flat_map(|s| {
                    if ent {
                        s.entropy.clone().unwrap_or_default()
                    } else {
                        s.logprobs.clone()
                    }
                })
                .collect()
        };
        for (what, ent) in [("logprobs", false), ("entropy", true)] {
            let (g, c) = (cat(&lg, ent), cat(&lc, ent));
            let (a, r, p) = compare(&g, &c, &[]);
            let ok = g.len() == c.len() && !c.is_empty() && p.is_none() && r <= tol_lp;
            s.rows.push(Row {
                op: format!("decoder {what} [{tag}]"),
                dtype: dname(d),
                max_abs: a,
                max_rel: r,
                tol: tol_lp,
                pass: ok,
                note: p.unwrap_or_default(),
            });
        }
        // One training step with the same random upstream gradients on both sides.
        let ups: Vec<(Vec<f32>, Vec<f32>)> = lc
            .iter()
            .map(|st| {
                let n = st.logprobs.len();
                (
                    (0..n).map(|_| s.rng.normal()).collect(),
                    (0..n).map(|_| 0.1 * s.rng.normal()).collect(),
                )
            })
            .collect();
        let mut loss = |_: &[TokenStats]| -> Result<Vec<TokenGrads>> {
            Ok(ups
                .iter()
                .map(|(a, b)| TokenGrads {
                    dlogprobs: a.clone(),
                    dentropy: Some(b.clone()),
                })
                .collect())
        };
        cpu.forward_backward(&seqs, 0.8, &mut loss)?;
        gpu.forward_backward(&seqs, 0.8, &mut loss)?;
        let (gc, gg) = (cpu.export_grads()?, gpu.export_grads()?);
        let (name, r) = worst_tensor(&gg, &gc);
        let (a, _, p) = compare(&flat(&gg), &flat(&gc), &[]);
        s.rows.push(Row {
            op: format!("decoder grads, worst tensor [{tag}]"),
            dtype: dname(d),
            max_abs: a,
            max_rel: r,
            tol: tol_g,
            pass: gg.len() == gc.len() && p.is_none() && r <= tol_g,
            note: name,
        });
        // eps large next to the gradients keeps the update linear in g, so the check
        // compares updates (p_new − p_old) without sign flips of near-zero gradients.
        let hp = AdamWParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 0.1,
            weight_decay: 0.1,
        };
        let (sc, sg) = (
            cpu.optimizer_step(&hp, Some(0.5))?,
            gpu.optimizer_step(&hp, Some(0.5))?,
        );
        let (wc, wg) = (cpu.export_weights()?, gpu.export_weights()?);
        let delta = |x: &Weights| -> Weights {
            x.iter()
                .map(|(k, t)| {
                    let mut t = t.clone();
                    t.data.iter_mut().zip(&w[k].data).for_each(|(v, o)| *v -= o);
                    (k.clone(), t)
                })
                .collect()
        };
        let (dc, dg) = (delta(&wc), delta(&wg));
        let (name, r) = worst_tensor(&dg, &dc);
        let (a, _, p) = compare(&flat(&dg), &flat(&dc), &[]);
        let norm_rel = ((sg.grad_norm - sc.grad_norm) / sc.grad_norm).abs() as f64;
        s.rows.push(Row {
            op: format!("decoder AdamW update, worst tensor [{tag}]"),
            dtype: dname(d),
            max_abs: a,
            max_rel: r,
            tol: tol_upd,
            pass: p.is_none() && r <= tol_upd && norm_rel <= tol_lp && sg.skipped == sc.skipped,
            note: format!(
                "{name}; grad norm gpu {} cpu {}",
                sg.grad_norm, sc.grad_norm
            ),
        });
        // The compute weights were refreshed from the updated masters: each one is the
        // master rounded to the compute dtype, exactly.
        let wc = gpu.export_compute_weights()?;
        let mut bad = None;
        for (name, t) in &wg {
            let same = wc[name]
                .data
                .iter()
                .zip(&t.data)
                .all(|(c, m)| c.to_bits() == round(*m, d).to_bits());
            if !same && bad.is_none() {
                bad = Some(name.clone());
            }
        }
        s.flag(
            &format!("decoder compute weights = rounded masters [{tag}]"),
            d,
            bad.is_none() && wc.len() == wg.len(),
            bad.map(|n| format!("{n} differs")).unwrap_or_default(),
        );
    }
    Ok(())
}

/// Whole-model log-probs and entropies of the tiny HF fixture models on the GPU against
/// the values transformers computed in f32 (`tests/fixtures/make_hf_fixtures.py`): f32
/// compute within 2e-4 nats (max |Δ|); bf16 compute (weights rounded to bf16 too, so this
/// is bf16 against an f32 model) within 1e-2 of the largest |value| (about 2.5 bf16 ulps).
pub(super) fn hf_fixtures(s: &mut Ctx, d: DType) -> Result<()> {
    let (tol, relative) = match d {
        DType::F32 => (2e-4, false),
        DType::BF16 => (1e-2, true),
    };
    for model in ["qwen2", "llama", "qwen3"] {
        let dir = s.fixtures.join(model);
        let op = format!("hf fixture {model}: logprobs+entropy vs transformers");
        let text = match std::fs::read_to_string(dir.join("expected.json")) {
            Ok(t) => t,
            Err(e) => {
                let note = format!("{}: {e} (run from the repo root)", dir.display());
                s.flag(&op, d, false, note);
                continue;
            }
        };
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let floats = |x: &serde_json::Value| -> Vec<f32> {
            x.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|f| f.as_f64())
                        .map(|f| f as f32)
                        .collect()
                })
                .unwrap_or_default()
        };
        let (cfg, weights) = crate::model::ModelDir::load(&dir)?;
        let gb = CudaBackend::new(s.ordinal)?;
        gb.set_compute_dtype(d);
        let mut dec = Decoder::new(gb, &cfg, &weights)?;
        let (mut worst, mut scale, mut n) = (0f64, 0f64, 0usize);
        for c in v["cases"].as_array().into_iter().flatten() {
            let tokens: Vec<u32> = c["tokens"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_u64())
                .map(|t| t as u32)
                .collect();
            let temp = c["temperature"].as_f64().unwrap_or(1.0) as f32;
            let got = dec.logprobs(
                &[SeqRef {
                    tokens: &tokens,
                    start: 1,
                }],
                temp,
                true,
            )?;
            let g = &got[0];
            let pairs = [
                (g.logprobs.clone(), floats(&c["logprobs"])),
                (g.entropy.clone().unwrap_or_default(), floats(&c["entropy"])),
            ];
            for (mine, theirs) in pairs {
                if mine.len() != theirs.len() || mine.is_empty() {
                    bail!(
                        "{op}: {} values, transformers has {}",
                        mine.len(),
                        theirs.len()
                    );
                }
                for (a, b) in mine.iter().zip(&theirs) {
                    worst = worst.max((a - b).abs() as f64);
                    scale = scale.max(b.abs() as f64);
                    n += 1;
                }
            }
        }
        let rel = worst / scale.max(f64::MIN_POSITIVE);
        let ok = n > 0 && if relative { rel <= tol } else { worst <= tol };
        s.rows.push(Row {
            op,
            dtype: dname(d),
            max_abs: worst,
            max_rel: rel,
            tol,
            pass: ok,
            note: format!(
                "{n} values; tol on max {}",
                if relative { "rel" } else { "abs" }
            ),
        });
    }
    Ok(())
}

/// The value model (PPO's critic: the decoder with a one-output `score` head) on both
/// backends: the values of packed sequences (the forward `values` runs), then one backward
/// from random upstream gradients of the values: the head's gradients (`score.weight`,
/// `score.bias`) and the trunk's worst tensor. The head is random (not the zero head a critic
/// starts from), so every gradient is exercised.
pub(super) fn value_model(s: &mut Ctx, d: DType) -> Result<()> {
    let (tol_v, tol_g) = match d {
        DType::F32 => (1e-4, 1e-3),
        DType::BF16 => (2e-2, 5e-2),
    };
    for arch in [Arch::Qwen2, Arch::Llama] {
        let tag = format!("{arch:?}").to_lowercase();
        let policy = tiny_config(arch);
        let w = init::random_weights(&policy, s.rng.next_u64(), 0.05);
        let (cfg, mut w) = value_model_from(&policy, w);
        let h = cfg.hidden_size;
        let head: Vec<f32> = (0..h).map(|_| 0.1 * s.rng.normal()).collect();
        w.insert(VALUE_HEAD.into(), Tensor::new(vec![1, h], head));
        w.insert(VALUE_BIAS.into(), Tensor::new(vec![1], vec![0.25]));
        let mut cpu = Decoder::new(Cpu, &cfg, &w)?;
        let gb = CudaBackend::new(s.ordinal)?;
        gb.set_compute_dtype(d);
        let mut gpu = Decoder::new(gb, &cfg, &w)?;
        let toks: Vec<Vec<u32>> = [40usize, 9, 75]
            .iter()
            .map(|&l| (0..l).map(|_| s.rng.below(1000) as u32).collect())
            .collect();
        let seqs: Vec<SeqRef> = toks
            .iter()
            .zip([1usize, 3, 20])
            .map(|(t, start)| SeqRef { tokens: t, start })
            .collect();
        let (vc, vg) = (
            cpu.logprobs(&seqs, 1.0, false)?,
            gpu.logprobs(&seqs, 1.0, false)?,
        );
        let op = format!("value model values [{tag}]");
        values_row(s, op, d, &vg, &vc, tol_v);
        let (gc, gg) = backward_both(s, &mut cpu, &mut gpu, &seqs, &vc)?;
        let part = |w: &Weights, head: bool| -> Weights {
            w.iter()
                .filter(|(k, _)| (k.as_str() == VALUE_HEAD || k.as_str() == VALUE_BIAS) == head)
                .map(|(k, t)| (k.clone(), t.clone()))
                .collect()
        };
        for (what, head) in [("head (score.weight, score.bias)", true), ("trunk", false)] {
            let (pg, pc) = (part(&gg, head), part(&gc, head));
            let (name, r) = worst_tensor(&pg, &pc);
            let (a, _, p) = compare(&flat(&pg), &flat(&pc), &[]);
            s.rows.push(Row {
                op: format!("value model grads, {what}, worst tensor [{tag}]"),
                dtype: dname(d),
                max_abs: a,
                max_rel: r,
                tol: tol_g,
                pass: !pc.is_empty() && pg.len() == pc.len() && p.is_none() && r <= tol_g,
                note: name,
            });
        }
    }
    Ok(())
}
