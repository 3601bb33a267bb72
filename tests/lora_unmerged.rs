//! Unmerged LoRA in the rollout engine (`rollout --lora-mode unmerged`): the adapters applied
//! at each step on the untouched base generate what the merged weights generate, on the CPU
//! backend (f32, the oracle) through the paged engine and through the binary, and a bad mode
//! is an input error.

use crate::common;

use common::{random_weights, tiny};
use tandem::backend::check::Rng;
use tandem::backend::cpu::Cpu;
use tandem::backend::ops::sample::SamplingParams;
use tandem::engine::paged::{
    generate_paged, Completion, GenParams, PagedConfig, PagedDecoder, Request,
};
use tandem::model::decoder::{Decoder, SeqRef};
use tandem::model::lora::{init_adapters, merge, LoraSpec};
use tandem::model::safetensors::round_bf16;
use tandem::model::{Arch, Config, Weights};

/// Greedy paged rollouts of 4 prompts, 12 tokens each (no EOS), on `dec`.
fn greedy(dec: &mut Decoder<Cpu>, cfg: &Config) -> Vec<Completion> {
    let mut rng = Rng::new(9);
    let reqs: Vec<Request> = (0..4u64)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + 2 * i)
                .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                .collect();
            Request {
                max_new: Vec::new(),
                sample_keys: vec![i],
                prompt,
            }
        })
        .collect();
    let params = GenParams {
        sampling: SamplingParams::greedy(),
        max_new_tokens: 12,
        stop_token_ids: vec![],
        stop_strings: vec![],
    };
    // Prompts split over steps (4 tokens a step): prefill chunks and decodes mixed.
    let pc = PagedConfig {
        block_size: 4,
        num_blocks: 32,
        max_num_seqs: 4,
        max_batched_tokens: 4,
        overlap: true,
    };
    let mut eng = PagedDecoder::new(dec, pc.num_blocks, pc.block_size).unwrap();
    let (done, _) = generate_paged(&mut eng, &pc, &reqs, &params, None, &mut |_| {}).unwrap();
    done.into_iter().flatten().collect()
}

fn tokens(c: &[Completion]) -> Vec<Vec<u32>> {
    c.iter().map(|c| c.tokens.clone()).collect()
}

/// The largest |Δ| between the rollout log-probs of `a` and `b` (same tokens).
fn max_diff(a: &[Completion], b: &[Completion]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.logprobs.iter().zip(&y.logprobs))
        .fold(0.0, |m, (p, q)| m.max((p - q).abs()))
}

/// Adapters on every projection with B ≠ 0 (PEFT starts B at zero: the base model).
fn adapters(cfg: &Config, s: &LoraSpec, seed: u64) -> Weights {
    let mut ad = init_adapters(cfg, s, seed);
    let mut rng = Rng::new(seed + 1);
    for (name, t) in ad.iter_mut() {
        if name.ends_with("lora_B.weight") {
            t.data.iter_mut().for_each(|x| *x = 0.5 * rng.normal());
        }
    }
    ad
}

/// On the three architectures: the unmerged decoder's greedy rollout has the tokens of the
/// f32 merged weights W + (α/r)·B·A and their log-probs to f32 rounding; the log-probs of
/// the bf16-rounded merge (what `--lora-mode merged` samples from) score its tokens within
/// bf16 rounding; it differs from the base, and with the adapters switched off it is the base,
/// bit for bit.
#[test]
fn unmerged_rollout_is_the_merged_model_and_not_the_base() {
    for arch in [Arch::Qwen2, Arch::Llama, Arch::Qwen3] {
        let cfg = Config {
            eos_token_ids: vec![],
            ..tiny(arch)
        };
        let mut base = random_weights(&cfg, 31);
        for t in base.values_mut() {
            t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
        }
        let s = LoraSpec {
            rank: 3,
            alpha: 6.0,
            targets: LoraSpec::parse_targets("all-linear", "test").unwrap(),
        };
        let ad = adapters(&cfg, &s, 5);
        let mut unmerged = Decoder::for_generation_unmerged(Cpu, &cfg, base.clone(), &ad, &s)
            .expect("unmerged decoder");
        let got = greedy(&mut unmerged, &cfg);
        let mut merged_w = base.clone();
        merge(&cfg, &mut merged_w, &ad, &s).unwrap();
        let want = greedy(&mut Decoder::new(Cpu, &cfg, &merged_w).unwrap(), &cfg);
        assert_eq!(
            tokens(&got),
            tokens(&want),
            "{arch:?}: the f32 merge's tokens"
        );
        let d = max_diff(&got, &want);
        assert!(
            d <= 1e-4,
            "{arch:?}: max |Δ logprob| {d} against the f32 merge"
        );
        // The merge rollout runs by default (bf16-rounded W'), scoring the unmerged tokens.
        let mut bf16 = Decoder::for_generation(Cpu, &cfg, base.clone()).unwrap();
        bf16.merge_adapters(&s, &ad).unwrap();
        let seqs: Vec<Vec<u32>> = got.iter().map(|c| c.tokens.clone()).collect();
        let mut rng = Rng::new(9);
        let full: Vec<Vec<u32>> = (0..4u64)
            .zip(&seqs)
            .map(|(i, t)| {
                let mut p: Vec<u32> = (0..3 + 2 * i)
                    .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                    .collect();
                p.extend(t);
                p
            })
            .collect();
        let refs: Vec<SeqRef> = full
            .iter()
            .zip(&seqs)
            .map(|(f, t)| SeqRef {
                tokens: f,
                start: f.len() - t.len(),
            })
            .collect();
        let scored = bf16.logprobs(&refs, 1.0, false).unwrap();
        let worst = scored
            .iter()
            .zip(&got)
            .flat_map(|(a, b)| a.logprobs.iter().zip(&b.logprobs))
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(worst <= 5e-2, "{arch:?}: {worst} from the bf16 merge");
        let plain = greedy(&mut Decoder::for_generation(Cpu, &cfg, base).unwrap(), &cfg);
        assert_ne!(tokens(&got), tokens(&plain), "{arch:?}: the adapters apply");
        unmerged.set_adapters_on(false);
        let off = greedy(&mut unmerged, &cfg);
        assert_eq!(tokens(&off), tokens(&plain), "{arch:?}: off = the base");
        assert_eq!(max_diff(&off, &plain), 0.0, "{arch:?}: off = the base");
    }
}

/// `rollout` of `model` greedy (2 prompts, 10 tokens) with `extra` flags: ids, log-probs.
fn greedy_rollout(
    model: &std::path::Path,
    pr: &std::path::Path,
    out: &std::path::Path,
    extra: &[&str],
) -> (Vec<Vec<i32>>, Vec<f32>) {
    use crate::stage_util::{f32_rows, i32_rows, ok, p, read};
    let args = ["--model", p(model), "--in", p(pr), "--out", p(out)];
    let sampling = ["--n", "1", "--max-new-tokens", "10", "--temperature", "0"];
    ok("rollout", &[&args[..], &sampling, extra].concat());
    let b = read(out);
    let lp = f32_rows(&b, tandem::batch::schema::ROLLOUT_LOGPROBS).concat();
    (i32_rows(&b, tandem::batch::schema::RESPONSE_IDS), lp)
}

mod binary {
    use super::greedy_rollout as rollout;
    use crate::stage_util::{input_error, p, prompts, tiny_model};
    use tandem::model::lora::LoraSpec;
    use tandem::model::peft::write_adapter;
    use tandem::model::ModelDir;

    /// Through the binary on an adapter directory: `--lora-mode unmerged` samples the tokens of
    /// `--lora-mode merged` (the default) with log-probs within bf16 rounding, not the base's;
    /// a bad mode exits 2 naming the flag.
    #[test]
    fn rollout_lora_mode_unmerged_on_an_adapter_dir() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 41);
        let (cfg, _) = ModelDir::load(&base).unwrap();
        let s = LoraSpec {
            rank: 4,
            alpha: 8.0,
            targets: LoraSpec::parse_targets("all-linear", "test").unwrap(),
        };
        let adapter = d.join("adapter");
        std::fs::create_dir_all(&adapter).unwrap();
        let ad = super::adapters(&cfg, &s, 17);
        write_adapter(&adapter, &s, &ad, base.to_str().unwrap()).unwrap();
        for e in std::fs::read_dir(&base).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.starts_with("tokenizer") || name == "special_tokens_map.json" {
                std::fs::copy(base.join(&name), adapter.join(&name)).unwrap();
            }
        }
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        let merged = rollout(&adapter, &pr, &d.join("m.parquet"), &[]);
        let unmerged = rollout(
            &adapter,
            &pr,
            &d.join("u.parquet"),
            &["--lora-mode", "unmerged"],
        );
        let from_base = rollout(&base, &pr, &d.join("b.parquet"), &[]);
        assert_eq!(merged.0, unmerged.0, "the merged model's tokens");
        let worst = merged
            .1
            .iter()
            .zip(&unmerged.1)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 5e-2, "max |Δ logprob| {worst}");
        assert_ne!(unmerged.0, from_base.0, "the adapter is applied");
        let out = d.join("x.parquet");
        let args = [
            "--model",
            p(&adapter),
            "--in",
            p(&pr),
            "--out",
            p(&out),
            "--lora-mode",
            "sideways",
        ];
        input_error("rollout", &args, "--lora-mode");
        assert!(!out.exists());
    }
}

/// `tandem bench rollout --lora-rank` on the CPU's small shape: merged reports the merge's
/// seconds, unmerged none; both report tok/s and the adapters in the JSON.
#[test]
fn bench_rollout_reports_both_lora_modes() {
    use crate::stage_util::ok;
    for mode in ["merged", "unmerged"] {
        let flags = "bench rollout --device cpu --model small --batches 2 --prompt-tokens 4 \
                     --new-tokens 3 --skip-grpo --modes eager --runs 1 --lora-rank 4 \
                     --lora-alpha 8 --lora-targets q,v,gate,down --lora-mode";
        let args: Vec<&str> = flags.split_whitespace().chain([mode]).collect();
        let out = String::from_utf8(ok("tandem", &args).stdout).unwrap();
        let title = out
            .lines()
            .find(|l| l.starts_with("bench rollout"))
            .unwrap();
        assert!(
            title.contains(&format!("LoRA rank 4 on q,v,gate,down {mode}")),
            "{title}"
        );
        let js: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        let lora = &js["lora"];
        assert_eq!(lora["mode"], mode);
        assert_eq!(lora["rank"], 4);
        let merge = lora["merge_seconds"].as_f64();
        assert_eq!(merge.is_some(), mode == "merged", "{lora}");
        assert!(merge.is_none_or(|s| s > 0.0));
        let tps = js["cases"][0]["tokens_per_s"].as_f64();
        assert!(tps.is_some_and(|t| t > 0.0), "{}", js["cases"][0]);
    }
}

mod daemon {
    use super::greedy_rollout as rollout;
    use crate::stage_util::{add_advantages, bin, ok, p, prompts};
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// On the warm daemon after a LoRA update: `--lora-mode unmerged` generates with the
    /// training decoder, its adapters applied at each step (no generation copy, per `status`),
    /// what an in-process unmerged rollout of the checkpoint generates, and not the base's;
    /// a merged rollout after it builds the copy again.
    #[test]
    fn the_daemon_rolls_out_unmerged_without_a_copy() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = crate::stage_util::tiny_model(d, 45);
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        let on_base = rollout(&base, &pr, &d.join("r.parquet"), &[]);
        let batch = d.join("adv.parquet");
        add_advantages(&d.join("r.parquet"), &batch);
        let sock = d.join("sock");
        let mut child = Command::new(bin("tandem"))
            .args(["daemon", "--device", "cpu", "--socket", p(&sock)])
            .args(["--policy", p(&base)])
            .env("RAYON_NUM_THREADS", "2")
            .spawn()
            .unwrap();
        let run = || {
            let t0 = Instant::now();
            while !sock.exists() {
                assert!(t0.elapsed() < Duration::from_secs(120), "no daemon socket");
                std::thread::sleep(Duration::from_millis(50));
            }
            let ck = d.join("ck");
            let mut args = vec![
                "--model",
                p(&base),
                "--in",
                p(&batch),
                "--out-model",
                p(&ck),
            ];
            args.extend(["--lr", "5e-2", "--lora-rank", "4", "--lora-alpha", "16"]);
            args.extend(["--seed", "9", "--daemon", p(&sock)]);
            ok("update", &args);
            let on_daemon = ["--daemon", p(&sock), "--lora-mode", "unmerged"];
            let unmerged = rollout(&ck, &pr, &d.join("du.parquet"), &on_daemon);
            let status = || -> serde_json::Value {
                let o = Command::new(bin("tandem"))
                    .args(["daemon-ctl", "status", "--socket", p(&sock)])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                serde_json::from_slice(&o.stdout).unwrap()
            };
            let copy_after_unmerged = status()["resident"]["policy"]["generation_copy"].clone();
            rollout(&ck, &pr, &d.join("dm.parquet"), &["--daemon", p(&sock)]);
            let copy_after_merged = status()["resident"]["policy"]["generation_copy"].clone();
            (ck, unmerged, copy_after_unmerged, copy_after_merged)
        };
        let out = std::panic::catch_unwind(run);
        let _ = child.kill();
        let _ = child.wait();
        let (ck, unmerged, copy_u, copy_m) = out.unwrap();
        assert_eq!(copy_u, false, "unmerged: no generation copy");
        assert_eq!(copy_m, true, "merged: the copy");
        let in_process = rollout(&ck, &pr, &d.join("u.parquet"), &["--lora-mode", "unmerged"]);
        assert_eq!(unmerged.0, in_process.0, "the in-process unmerged tokens");
        let worst = unmerged
            .1
            .iter()
            .zip(&in_process.1)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-4, "max |Δ logprob| {worst}");
        assert_ne!(unmerged.0, on_base.0, "the adapters apply");
    }
}

/// `[rollout] lora-mode` in a spec: a bad value stops before step 0 with exit 2 naming the
/// key; a good one reaches the rollout stage's command line.
#[test]
fn the_spec_key_is_checked_and_passed_on() {
    use crate::pipeline::{real_bins, text, PIPELINE};
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 8);
    let spec = |mode: &str| {
        format!(
            "seed = 3\nsteps = 1\n[model]\npath = \"model\"\n[data]\ntrain = \"train.parquet\"\n\
             prompts-per-step = 2\n[rollout]\nn = 2\nmax-new-tokens = 4\nraw-prompt = true\n\
             lora-mode = \"{mode}\"\n[score]\nreward = \"regex:[a-z]\"\n[advantage]\n\
             estimator = \"grpo\"\n[update]\nlr = 0.01\nlora-rank = 4\n"
        )
    };
    let run = |mode: &str, run_dir: &str| {
        std::fs::write(d.join("spec.toml"), spec(mode)).unwrap();
        std::process::Command::new(PIPELINE)
            .current_dir(d)
            .args(["run", "spec.toml", "--run-dir", run_dir])
            .env("TANDEM_BIN_DIR", &bins)
            .output()
            .unwrap()
    };
    let o = run("sideways", "bad");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("lora-mode"), "{}", text(&o));
    assert!(!d.join("bad").exists());
    let o = run("unmerged", "good");
    assert!(o.status.success(), "{}", text(&o));
    let log = std::fs::read_to_string(d.join("good/commands.sh")).unwrap();
    assert!(log.contains("--lora-mode unmerged"), "{log}");
}

/// What the trainer computes on a rollout of each `--lora-mode`, after a LoRA update.
mod trainer {
    use crate::stage_util::{add_advantages, ok, p, prompts, read, tiny_model};
    use std::path::Path;
    use tandem::batch::schema;

    const LORA: [&str; 4] = ["--lora-rank", "4", "--lora-alpha", "16"];

    /// `rollout` of `model` (4 prompts × 2 samples, 12 tokens, temperature 1) with `extra`
    /// flags, its advantages added: the batch `update` reads.
    fn rollout(
        model: &Path,
        pr: &Path,
        d: &Path,
        name: &str,
        extra: &[&str],
    ) -> std::path::PathBuf {
        let (out, adv) = (
            d.join(format!("{name}.parquet")),
            d.join(format!("{name}-adv.parquet")),
        );
        let args = ["--model", p(model), "--in", p(pr), "--out", p(&out)];
        let sampling = [
            "--n",
            "2",
            "--max-new-tokens",
            "12",
            "--temperature",
            "1",
            "--seed",
            "5",
        ];
        ok("rollout", &[&args[..], &sampling, extra].concat());
        add_advantages(&out, &adv);
        adv
    }

    /// `update --bypass-mode` of the LoRA checkpoint `ck` on `batch`: its `mismatch` metrics
    /// (the rollout's log-probs against its first forward, before any optimizer step).
    fn mismatch(ck: &Path, batch: &Path, d: &Path, name: &str) -> serde_json::Value {
        let metrics = d.join(format!("{name}.json"));
        let out = d.join(format!("{name}-ck"));
        let args = ["--model", p(ck), "--in", p(batch), "--out-model", p(&out)];
        let more = [
            "--lr",
            "1e-2",
            "--seed",
            "9",
            "--bypass-mode",
            "--metrics",
            p(&metrics),
        ];
        ok("update", &[&args[..], &LORA, &more].concat());
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
        m["mismatch"].clone()
    }

    /// On the CPU (batch-invariant kernels), after a LoRA update (B ≠ 0): the trainer's
    /// log-probs of an unmerged rollout's tokens (update's first forward, base + adapters
    /// unmerged) are the rollout's bit for bit, so `--bypass-mode` trains on exactly the
    /// trainer's old log-probs; those of a merged rollout (bf16(W + (α/r)·B·A)) are not: they
    /// differ by the merged weights' bf16 rounding.
    #[test]
    fn unmerged_rollout_logprobs_are_the_trainers_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 47);
        let pr = d.join("prompts.parquet");
        let qs = ["Name a colour.", "Count to three.", "Say hi.", "Spell cat."];
        prompts(&pr, &qs);
        let first = rollout(&base, &pr, d, "base", &[]);
        let ck = d.join("ck");
        let args = [
            "--model",
            p(&base),
            "--in",
            p(&first),
            "--out-model",
            p(&ck),
        ];
        ok(
            "update",
            &[&args[..], &LORA, &["--lr", "5e-2", "--seed", "9"]].concat(),
        );
        let unmerged = rollout(&ck, &pr, d, "unmerged", &["--lora-mode", "unmerged"]);
        let merged = rollout(&ck, &pr, d, "merged", &["--lora-mode", "merged"]);
        let tokens: usize = read(&unmerged)
            .ragged_i32(schema::RESPONSE_IDS)
            .unwrap()
            .rows()
            .map(|r| r.len())
            .sum();
        let u = mismatch(&ck, &unmerged, d, "u");
        let m = mismatch(&ck, &merged, d, "m");
        eprintln!("unmerged: {u}\nmerged: {m}");
        for x in [&u, &m] {
            assert_eq!(x["source"], "first_step", "{x}");
        }
        assert_eq!(
            u["tokens"].as_u64(),
            Some(tokens as u64),
            "every token: {u}"
        );
        assert_eq!(u["abs_diff_max"].as_f64(), Some(0.0), "unmerged: {u}");
        assert_eq!(u["ratio_outside_frac"].as_f64(), Some(0.0), "unmerged: {u}");
        let worst = m["abs_diff_max"].as_f64().unwrap();
        assert!(worst > 0.0 && worst < 5e-2, "merged: {m}");
    }
}

/// On the CPU (batch-invariant kernels) a paged greedy rollout's log-probs (prompts in
/// chunks, decodes of several sequences at once) are the packed scoring's, bit for bit, of the
/// training decoder and of the generation decoder, all rows in one pass or one at a time.
#[test]
fn paged_rollout_logprobs_are_the_packed_scorings_bit_for_bit() {
    let cfg = Config {
        eos_token_ids: vec![],
        ..tiny(Arch::Qwen2)
    };
    let mut base = random_weights(&cfg, 31);
    for t in base.values_mut() {
        t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    let got = greedy(
        &mut Decoder::for_generation(Cpu, &cfg, base.clone()).unwrap(),
        &cfg,
    );
    let mut rng = Rng::new(9);
    let full: Vec<Vec<u32>> = (0..4u64)
        .zip(&got)
        .map(|(i, c)| {
            let mut p: Vec<u32> = (0..3 + 2 * i)
                .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                .collect();
            p.extend(&c.tokens);
            p
        })
        .collect();
    let refs: Vec<SeqRef> = full
        .iter()
        .zip(&got)
        .map(|(f, c)| SeqRef {
            tokens: f,
            start: f.len() - c.tokens.len(),
        })
        .collect();
    for (name, mut dec) in [
        ("train", Decoder::new(Cpu, &cfg, &base).unwrap()),
        (
            "gen",
            Decoder::for_generation(Cpu, &cfg, base.clone()).unwrap(),
        ),
    ] {
        let all = dec.logprobs(&refs, 1.0, false).unwrap();
        let one: Vec<_> = refs
            .iter()
            .map(|r| {
                dec.logprobs(std::slice::from_ref(r), 1.0, false)
                    .unwrap()
                    .remove(0)
            })
            .collect();
        for (label, s) in [("all", &all), ("one", &one)] {
            for (i, (a, c)) in s.iter().zip(&got).enumerate() {
                let diffs: Vec<(usize, f32)> = a
                    .logprobs
                    .iter()
                    .zip(&c.logprobs)
                    .enumerate()
                    .filter(|(_, (x, y))| x.to_bits() != y.to_bits())
                    .map(|(j, (x, y))| (j, x - y))
                    .collect();
                assert!(diffs.is_empty(), "{name} {label} seq {i}: {diffs:?}");
            }
        }
    }
}

/// `[update] bypass-mode = true` with `lora-rank` takes the rollout's log-probs as the
/// trainer's, which only an unmerged rollout gives: without `[rollout] lora-mode = "unmerged"`
/// the spec stops before anything runs with exit 2 naming the key; with it the plan passes.
#[test]
fn bypass_mode_with_lora_needs_the_unmerged_rollout() {
    use crate::pipeline::{real_bins, text, PIPELINE};
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 8);
    let run = |mode: &str, run_dir: &str| {
        let spec = format!(
            "seed = 3\nsteps = 1\n[model]\npath = \"model\"\n[data]\ntrain = \"train.parquet\"\n\
             prompts-per-step = 2\n[rollout]\nn = 2\nmax-new-tokens = 4\nraw-prompt = true\n\
             {mode}\n[score]\nreward = \"regex:[a-z]\"\n[advantage]\nestimator = \"grpo\"\n\
             [update]\nlr = 0.01\nlora-rank = 4\nbypass-mode = true\n"
        );
        std::fs::write(d.join("spec.toml"), spec).unwrap();
        std::process::Command::new(PIPELINE)
            .current_dir(d)
            .args(["run", "spec.toml", "--run-dir", run_dir, "--dry-run"])
            .env("TANDEM_BIN_DIR", &bins)
            .output()
            .unwrap()
    };
    for (mode, name) in [("", "default"), ("lora-mode = \"merged\"", "merged")] {
        let o = run(mode, name);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(
            text(&o).contains("set [rollout] lora-mode = \"unmerged\""),
            "{}",
            text(&o)
        );
        assert!(!d.join(name).exists());
    }
    let o = run("lora-mode = \"unmerged\"", "good");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("--lora-mode unmerged"), "{}", text(&o));
}
