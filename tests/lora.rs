//! LoRA on the CPU backend: the adapters' gradients against finite differences, one AdamW
//! step against the same step computed by hand (the base untouched), and the merged model's
//! log-probs against the adapted decoder's.

use crate::common;

use common::{check_finite_differences, random_weights, tiny, tokens};
use tandem::backend::check::{randn, Rng};
use tandem::backend::cpu::Cpu;
use tandem::model::decoder::{AdamWParams, Decoder, SeqRef, TokenGrads, TokenStats};
use tandem::model::lora::{init_adapters, merge, LoraSpec, Target};
use tandem::model::{Arch, Config, Weights};

const ARCHS: [Arch; 3] = [Arch::Qwen2, Arch::Llama, Arch::Qwen3];

/// `rollout` of `model` (2 samples of 8 tokens, seed 3) into `out`: its ids and log-probs.
fn rollout(
    model: &std::path::Path,
    prompts: &std::path::Path,
    out: &std::path::Path,
) -> (Vec<Vec<i32>>, Vec<Vec<f32>>) {
    use crate::stage_util::{f32_rows, i32_rows, ok, p, read};
    use tandem::batch::schema;
    let args = ["--model", p(model), "--in", p(prompts), "--out", p(out)];
    let sampling = [
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--seed",
        "3",
        "--temperature",
        "1.0",
    ];
    ok("rollout", &[&args[..], &sampling].concat());
    let b = read(out);
    (
        i32_rows(&b, schema::RESPONSE_IDS),
        f32_rows(&b, schema::ROLLOUT_LOGPROBS),
    )
}

fn spec(targets: &str) -> LoraSpec {
    LoraSpec {
        rank: 3,
        alpha: 6.0,
        targets: LoraSpec::parse_targets(targets, "test").unwrap(),
    }
}

/// Fresh adapters with a non-zero B (so that A has a gradient too).
fn adapters(cfg: &Config, s: &LoraSpec, seed: u64) -> Weights {
    let mut ad = init_adapters(cfg, s, seed);
    let mut rng = Rng::new(seed + 1);
    for (name, t) in ad.iter_mut() {
        if name.ends_with("lora_B.weight") {
            t.data.iter_mut().for_each(|x| *x = 0.3 * rng.normal());
        }
    }
    ad
}

fn seqs(cfg: &Config) -> (Vec<SeqRef<'static>>, Vec<Vec<f32>>) {
    let toks = [tokens(6, cfg.vocab_size, 2), tokens(5, cfg.vocab_size, 3)];
    let seqs: Vec<SeqRef<'static>> = toks
        .iter()
        .zip([2, 1])
        .map(|(t, start)| SeqRef {
            tokens: Box::leak(t.clone().into_boxed_slice()),
            start,
        })
        .collect();
    let c = seqs
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s.tokens.len() - s.start, 10 + i as u64))
        .collect();
    (seqs, c)
}

/// L = Σ c·logprob.
fn loss(stats: &[TokenStats], c: &[Vec<f32>]) -> f64 {
    let pairs = stats
        .iter()
        .zip(c)
        .flat_map(|(s, c)| s.logprobs.iter().zip(c));
    pairs.map(|(lp, c)| *lp as f64 * *c as f64).sum()
}

fn backward(dec: &mut Decoder<Cpu>, seqs: &[SeqRef], c: &[Vec<f32>]) {
    dec.forward_backward(seqs, 1.0, &mut |_| {
        Ok(c.iter()
            .map(|c| TokenGrads {
                dlogprobs: c.clone(),
                dentropy: None,
            })
            .collect())
    })
    .unwrap();
}

fn lora(cfg: &Config, base: &Weights, ad: &Weights, s: &LoraSpec) -> Decoder<Cpu> {
    Decoder::with_lora(Cpu, cfg, base, ad, s).unwrap()
}

#[test]
fn adapter_gradients_match_finite_differences() {
    for arch in ARCHS {
        let cfg = tiny(arch);
        let base = random_weights(&cfg, 1);
        let s = spec("all-linear");
        let ad = adapters(&cfg, &s, 5);
        let (seqs, c) = seqs(&cfg);
        let mut dec = lora(&cfg, &base, &ad, &s);
        backward(&mut dec, &seqs, &c);
        let grads = dec.export_grads().unwrap();
        // Only the adapters have gradients: the base is frozen.
        assert_eq!(grads.len(), ad.len());
        assert!(grads.keys().eq(ad.keys()));
        let what = format!("{arch:?}");
        let worst = check_finite_differences(&what, &grads, &ad, |a| {
            let stats = lora(&cfg, &base, a, &s)
                .logprobs(&seqs, 1.0, false)
                .unwrap();
            loss(&stats, &c)
        });
        eprintln!(
            "{arch:?}: worst relative adapter gradient error {worst:.2e} over {} tensors",
            grads.len()
        );
    }
}

#[test]
fn fresh_adapters_leave_the_base_model_as_it_was() {
    let cfg = tiny(Arch::Qwen2);
    let base = random_weights(&cfg, 2);
    let s = spec("q,v,down");
    let (seqs, _) = seqs(&cfg);
    let want = Decoder::new(Cpu, &cfg, &base)
        .unwrap()
        .logprobs(&seqs, 1.0, true)
        .unwrap();
    let got = lora(&cfg, &base, &init_adapters(&cfg, &s, 3), &s)
        .logprobs(&seqs, 1.0, true)
        .unwrap();
    assert_eq!(got, want, "B = 0: the adapted model is the base");
}

#[test]
fn one_update_equals_adamw_by_hand_and_leaves_the_base() {
    let cfg = tiny(Arch::Qwen3);
    let base = random_weights(&cfg, 3);
    let s = spec("k,o,gate,up");
    let ad = adapters(&cfg, &s, 7);
    let (seqs, c) = seqs(&cfg);
    let mut dec = lora(&cfg, &base, &ad, &s);
    backward(&mut dec, &seqs, &c);
    let grads = dec.export_grads().unwrap();
    let hp = AdamWParams {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let report = dec.optimizer_step(&hp, None).unwrap();
    assert!(!report.skipped);
    // Step 1 from zero moments: m̂ = g, v̂ = g², p ← p(1 − lr·wd) − lr·g/(|g| + eps).
    let got = dec.export_adapters().unwrap();
    assert!(got.keys().eq(ad.keys()));
    let mut norm = 0f64;
    for (name, p0) in &ad {
        let g = &grads[name];
        norm += g.data.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
        for ((p0, g), p1) in p0.data.iter().zip(&g.data).zip(&got[name].data) {
            let want = p0 * (1.0 - hp.lr * hp.weight_decay) - hp.lr * g / (g.abs() + hp.eps);
            assert!((p1 - want).abs() <= 1e-6, "{name}: {p1} vs {want}");
        }
    }
    assert!((report.grad_norm as f64 - norm.sqrt()).abs() < 1e-4 * norm.sqrt());
    // The base is what it was, and the optimizer state holds the adapters only.
    let all = dec.export_weights().unwrap();
    for (name, t) in &base {
        if let Some(w) = all.get(name) {
            assert_eq!(w, t, "{name} moved");
        }
    }
    let st = dec.optimizer_state().unwrap();
    assert!(st.exp_avg.keys().eq(ad.keys()) && st.exp_avg_sq.keys().eq(ad.keys()));
}

#[test]
fn merged_weights_score_as_the_adapted_decoder() {
    for arch in ARCHS {
        let cfg = tiny(arch);
        let base = random_weights(&cfg, 4);
        let s = spec("all-linear");
        let ad = adapters(&cfg, &s, 9);
        let (seqs, _) = seqs(&cfg);
        let got = lora(&cfg, &base, &ad, &s)
            .logprobs(&seqs, 0.7, true)
            .unwrap();
        let mut merged = base.clone();
        merge(&cfg, &mut merged, &ad, &s).unwrap();
        let want = Decoder::new(Cpu, &cfg, &merged)
            .unwrap()
            .logprobs(&seqs, 0.7, true)
            .unwrap();
        let diff = got
            .iter()
            .zip(&want)
            .flat_map(|(a, b)| a.logprobs.iter().zip(&b.logprobs))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-4,
            "{arch:?}: merged vs adapted log-probs differ by {diff}"
        );
        let changed = base.iter().filter(|(n, t)| merged[*n] != **t).count();
        assert_eq!(changed, 7 * cfg.num_layers, "{arch:?}: every target merged");
        let _ = Target::ALL;
    }
}

/// The backend merge (`Decoder::merge_adapters`, on the CPU backend) against the hand
/// formula round_bf16(W + (α/r)·B·A): adapters of multiples of 1/16 keep every sum exact in
/// f32, so the two agree to the bit; the weights not targeted are the base's, rounded to bf16
/// as every generation decoder holds them.
#[test]
fn backend_merge_is_the_hand_formula_rounded_to_bf16() {
    use tandem::model::safetensors::round_bf16;
    let cfg = tiny(Arch::Qwen2);
    let base = random_weights(&cfg, 5);
    let s = spec("q,down");
    let mut ad = init_adapters(&cfg, &s, 3);
    let mut rng = Rng::new(8);
    for t in ad.values_mut() {
        let sixteenths = |_| (rng.normal() * 8.0).round().clamp(-16.0, 16.0) / 16.0;
        t.data = (0..t.data.len()).map(sixteenths).collect();
    }
    let mut dec = Decoder::for_generation(Cpu, &cfg, base.clone()).unwrap();
    dec.merge_adapters(&s, &ad).unwrap();
    let got = dec.export_compute_weights().unwrap();
    let r = s.rank;
    for slot in s.adapters(&cfg) {
        let name = slot.target.weight_name(slot.layer);
        let (inp, out) = slot.target.dims(&cfg);
        let (a, b) = (&ad[&slot.a.0].data, &ad[&slot.b.0].data);
        for o in 0..out {
            for i in 0..inp {
                let ba: f64 = (0..r)
                    .map(|k| b[o * r + k] as f64 * a[k * inp + i] as f64)
                    .sum();
                let w = round_bf16(base[&name].data[o * inp + i]) as f64;
                let want = round_bf16((w + s.scale() as f64 * ba) as f32);
                assert_eq!(got[&name].data[o * inp + i], want, "{name}[{o}, {i}]");
            }
        }
    }
    let targets: Vec<String> = s
        .adapters(&cfg)
        .iter()
        .map(|t| t.target.weight_name(t.layer))
        .collect();
    for (name, t) in &base {
        if !targets.contains(name) {
            let want: Vec<f32> = t.data.iter().map(|&x| round_bf16(x)).collect();
            assert_eq!(got[name].data, want, "{name} is the base's");
        }
    }
    // A missing adapter tensor is refused, naming it.
    ad.remove("model.layers.0.mlp.down_proj.lora_B.weight");
    let e = dec.merge_adapters(&s, &ad).unwrap_err().to_string();
    assert!(
        e.contains("'model.layers.0.mlp.down_proj.lora_B.weight' is missing"),
        "{e}"
    );
}

mod files {
    use super::{adapters, rollout, spec, Cpu, Decoder};
    use crate::stage_util::{input_error, ok, p, prompts, tiny_model};
    use std::path::Path;
    use tandem::model::peft::{read_adapter, write_adapter};
    use tandem::model::ModelDir;

    /// An adapter directory on `base`: the PEFT files, and the base's tokenizer files (what a
    /// LoRA checkpoint holds besides), no config.json.
    fn adapter_dir(base: &Path, out: &Path) {
        let (cfg, _) = ModelDir::load(base).unwrap();
        let s = spec("q,v,o,down");
        let mut ad = adapters(&cfg, &s, 21);
        for t in ad.values_mut() {
            t.data.iter_mut().for_each(|x| *x *= 8.0);
        }
        std::fs::create_dir_all(out).unwrap();
        write_adapter(out, &s, &ad, base.to_str().unwrap()).unwrap();
        assert_eq!(
            read_adapter(out).unwrap().weights,
            ad,
            "the files round-trip"
        );
        for e in std::fs::read_dir(base).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.starts_with("tokenizer") || name == "special_tokens_map.json" {
                std::fs::copy(base.join(&name), out.join(&name)).unwrap();
            }
        }
    }

    #[test]
    fn rollout_from_an_adapter_is_the_merged_model_and_not_the_base() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 41);
        let adapter = d.join("adapter");
        adapter_dir(&base, &adapter);
        let merged = d.join("merged");
        ok(
            "tandem",
            &[
                "merge-lora",
                "--base",
                p(&base),
                "--adapter",
                p(&adapter),
                "--out",
                p(&merged),
            ],
        );
        assert!(merged.join("config.json").is_file() && !d.join("merged.tmp").exists());
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        // The rollout merges on its backend: a model saved from that merge rolls out the
        // same, to the bit; merge-lora's f64 merge is at most one bf16 step from it.
        let (cfg, base_w) = ModelDir::load(&base).unwrap();
        let ad = read_adapter(&adapter).unwrap();
        let mut dec = Decoder::for_generation(Cpu, &cfg, base_w).unwrap();
        dec.merge_adapters(&ad.spec, &ad.weights).unwrap();
        let on_backend = dec.export_compute_weights().unwrap();
        let device_merged = d.join("device-merged");
        ModelDir::save(&device_merged, &cfg, &on_backend, Some(&base)).unwrap();
        let (_, files) = ModelDir::load(&merged).unwrap();
        let (mut differ, mut total) = (0, 0);
        for (name, t) in &files {
            for (&x, &y) in t.data.iter().zip(&on_backend[name].data) {
                let step = (f32::from_bits(y.to_bits() + 0x1_0000) - y).abs();
                assert!((x - y).abs() <= step, "{name}: {x} vs {y}");
                differ += usize::from(x != y);
                total += 1;
            }
        }
        assert!(differ * 100 < total, "{differ} of {total} weights differ");
        let from_adapter = rollout(&adapter, &pr, &d.join("a.parquet"));
        let from_device = rollout(&device_merged, &pr, &d.join("m.parquet"));
        let from_base = rollout(&base, &pr, &d.join("b.parquet"));
        assert_eq!(
            from_adapter, from_device,
            "adapter directory = the model merged on the backend, to the bit"
        );
        assert_ne!(from_adapter.1, from_base.1, "the adapter is applied");
        // A bad adapter: exit 2 naming the file and key.
        let bad = d.join("bad");
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(
            bad.join("adapter_config.json"),
            r#"{"peft_type": "LORA", "r": 4}"#,
        )
        .unwrap();
        input_error(
            "tandem",
            &[
                "merge-lora",
                "--base",
                p(&base),
                "--adapter",
                p(&bad),
                "--out",
                p(&d.join("x")),
            ],
            "adapter_config.json: key 'lora_alpha' is missing",
        );
        assert!(!d.join("x").exists());
    }

    /// HF PEFT reads our adapter files as we do: its `PeftModel` over the base computes the
    /// logits of our `merge-lora` directory (bf16) opened in transformers. Skipped with a
    /// message where python has no peft, transformers or torch.
    #[test]
    fn hf_peft_reads_the_adapter_where_python_has_it() {
        let has_peft = std::process::Command::new("python3")
            .args(["-c", "import peft, transformers, torch"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_peft {
            eprintln!("skipped: python3 has no peft/transformers/torch here");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let base = tiny_model(dir.path(), 42);
        let adapter = dir.path().join("adapter");
        adapter_dir(&base, &adapter);
        let merged = dir.path().join("merged");
        let args = ["merge-lora", "--base", p(&base), "--adapter", p(&adapter)];
        ok("tandem", &[&args[..], &["--out", p(&merged)]].concat());
        // The adapter changes the logits by far more than the bf16 rounding of the merge.
        let script = format!(
            "import torch\nfrom transformers import AutoModelForCausalLM\nfrom peft import PeftModel\n\
             f32 = dict(torch_dtype=torch.float32)\n\
             base = AutoModelForCausalLM.from_pretrained('{b}', **f32).eval()\n\
             ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 64]])\n\
             with torch.no_grad(): plain = base(ids).logits\n\
             m = PeftModel.from_pretrained(base, '{a}').eval()\n\
             assert m.peft_config['default'].r == 3\n\
             ours = AutoModelForCausalLM.from_pretrained('{m}', **f32).eval()\n\
             with torch.no_grad(): lp, lo = m(ids).logits, ours(ids).logits\n\
             d, moved = (lp - lo).abs().max().item(), (lp - plain).abs().max().item()\n\
             print(d, moved)\n\
             assert moved > 20 * d, (d, moved)\n",
            b = base.display(),
            a = adapter.display(),
            m = merged.display()
        );
        let o = std::process::Command::new("python3")
            .args(["-c", &script])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        eprintln!(
            "PEFT against merge-lora, largest logit difference and the adapter's largest change: {}",
            String::from_utf8_lossy(&o.stdout).trim()
        );
    }
}

mod update {
    use super::rollout;
    use crate::stage_util::{add_advantages, input_error, ok, p, prompts, tiny_model};
    use std::path::Path;
    use tandem::model::peft::read_adapter;

    fn update(from: &Path, batch: &Path, to: &Path, extra: &[&str]) {
        let mut args = vec![
            "--model",
            p(from),
            "--in",
            p(batch),
            "--out-model",
            p(to),
            "--lr",
            "1e-2",
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "q,v,down",
        ];
        args.extend_from_slice(extra);
        ok("update", &args);
    }

    #[test]
    fn a_lora_update_writes_peft_files_resumes_and_rolls_out_merged() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 43);
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        let base_rollout = rollout(&base, &pr, &d.join("r.parquet"));
        let batch = d.join("adv.parquet");
        add_advantages(&d.join("r.parquet"), &batch);
        let ck1 = d.join("ck1");
        update(&base, &batch, &ck1, &[]);
        for f in [
            "adapter_config.json",
            "adapter_model.safetensors",
            "optimizer.safetensors",
            "trainer_state.json",
            "tokenizer.json",
        ] {
            assert!(ck1.join(f).is_file(), "{f} missing");
        }
        assert!(!ck1.join("config.json").exists() && !d.join("ck1.tmp").exists());
        let ad = read_adapter(&ck1).unwrap();
        assert_eq!(Path::new(&ad.base), std::path::absolute(&base).unwrap());
        assert_eq!(ad.weights.len(), 2 * 3 * 2);
        let b = &ad.weights["model.layers.0.self_attn.q_proj.lora_B.weight"];
        assert!(
            b.data.iter().any(|x| *x != 0.0),
            "one step moved B off zero"
        );

        // Resume: the second step reads the adapters' moments (a fresh optimizer differs) and
        // counts on from the first.
        let ck2 = d.join("ck2");
        update(&ck1, &batch, &ck2, &[]);
        let fresh = d.join("fresh");
        std::fs::create_dir_all(&fresh).unwrap();
        for f in [
            "adapter_config.json",
            "adapter_model.safetensors",
            "tokenizer.json",
        ] {
            std::fs::copy(ck1.join(f), fresh.join(f)).unwrap();
        }
        let ck2f = d.join("ck2f");
        update(&fresh, &batch, &ck2f, &[]);
        let (a2, a2f) = (read_adapter(&ck2).unwrap(), read_adapter(&ck2f).unwrap());
        assert_ne!(a2.weights, a2f.weights, "the saved moments were used");
        let ts: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ck2.join("trainer_state.json")).unwrap())
                .unwrap();
        assert_eq!(ts["optimizer_step"], 2, "{ts}");
        let ck2b = d.join("ck2b");
        update(&ck1, &batch, &ck2b, &[]);
        let bytes = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        assert_eq!(
            bytes(&ck2),
            bytes(&ck2b),
            "the resumed step is deterministic"
        );

        // Rollout from the checkpoint: not the base's, the merged model's to the bit.
        let merged = d.join("merged");
        ok(
            "tandem",
            &[
                "merge-lora",
                "--base",
                p(&base),
                "--adapter",
                p(&ck1),
                "--out",
                p(&merged),
            ],
        );
        let from_ck = rollout(&ck1, &pr, &d.join("c.parquet"));
        assert_ne!(from_ck, base_rollout, "the adapter is applied at rollout");
        assert_eq!(from_ck, rollout(&merged, &pr, &d.join("m.parquet")));

        // Bad flags: exit 2 naming what is wrong.
        let bad = |args: &[&str], needle: &str| {
            let mut a = vec!["--model", p(&ck1), "--in", p(&batch), "--out-model", "x"];
            a.extend_from_slice(args);
            input_error("update", &a, needle);
        };
        bad(
            &["--lora-rank", "4", "--lora-targets", "q,lm_head"],
            "--lora-targets: unknown target 'lm_head'",
        );
        bad(
            &[
                "--lora-rank",
                "8",
                "--lora-alpha",
                "8",
                "--lora-targets",
                "q,v,down",
            ],
            "the adapter has r 4",
        );
        bad(&[], "is a LoRA adapter: continue it with --lora-rank");
        let full = [
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "q,v,down",
        ];
        bad(
            &[&full[..], &["--shard", "full"]].concat(),
            "--shard full with --lora-rank: the frozen base has no optimizer state",
        );
    }
}

mod pipeline {
    use crate::pipeline::{
        assert_ok, checkpoint_files_in, children, jsonl_sans_time, kill_when, real_bins,
        running_child, stage_done, text, PIPELINE,
    };
    use crate::shard::rel_err;
    use crate::stage_util::{i32_rows, read};
    use std::path::Path;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    use tandem::batch::schema;
    use tandem::model::peft::read_adapter;
    use tandem::model::Weights;

    const SPEC: &str = r#"
seed = 3
steps = 3
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 4
[rollout]
n = 4
temperature = 1.0
max-new-tokens = 16
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "regex:[a-z]"
format-score = 0.5
[advantage]
estimator = "grpo"
[update]
lr = 0.01
use-kl-loss = true
lora-rank = 4
lora-alpha = 8
lora-targets = "q,v,o,down"
[checkpoint]
every = 2
keep-last = 1
"#;

    /// GRPO-LoRA through the real stages: every checkpoint is an adapter in PEFT's files, the
    /// reference is the base model, and SIGKILL while rollout runs, after an update and while
    /// one runs, then a rerun, ends with the checkpoints bit for bit as an uninterrupted run's.
    #[test]
    fn a_lora_run_resumes_after_sigkill_to_identical_adapters() {
        let bins = real_bins();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        crate::stage_util::model_and_train_set(d, 64, 128, 40);
        std::fs::write(d.join("spec.toml"), SPEC).unwrap();
        let cmd = |run: &str| {
            let mut c = Command::new(PIPELINE);
            c.current_dir(d)
                .args(["run", "spec.toml", "--run-dir", run])
                .env("TANDEM_BIN_DIR", &bins);
            c
        };
        assert_ok(&cmd("a").output().unwrap());
        let (a, b) = (d.join("a"), d.join("b"));
        let ck = checkpoint_files_in(&a, "ckpt");
        assert!(
            ck.contains_key("step-0003/adapter_model.safetensors"),
            "{:?}",
            ck.keys()
        );
        assert!(ck.contains_key("step-0003/optimizer.safetensors"));
        assert!(
            !ck.contains_key("step-0003/config.json"),
            "no model files: {:?}",
            ck.keys()
        );
        let log = std::fs::read_to_string(a.join("commands.sh")).unwrap();
        assert!(
            log.contains("ref-logprob --model model "),
            "the reference is the base: {log}"
        );
        assert!(
            log.contains("--lora-rank 4 --lora-alpha 8 --lora-targets q,v,o,down"),
            "{log}"
        );

        let kill = |what: &str, cond: &mut dyn FnMut(u32) -> bool| kill_when(cmd("b"), what, cond);
        kill("step 2 rollout running", &mut |pid| {
            running_child(pid, "--out b/step-0002/rollout.parquet")
        });
        kill("step 2 update recorded", &mut |_| {
            stage_done(&b, 2, "update")
        });
        kill("step 3 update running", &mut |pid| {
            running_child(pid, "--out-model b/ckpt/step-0003")
        });
        std::thread::sleep(Duration::from_millis(500));
        let o = cmd("b").output().unwrap();
        assert_ok(&o);
        assert!(
            text(&o).contains("pipeline: continuing b after step 2"),
            "{}",
            text(&o)
        );
        crate::pipeline::assert_runs_end_alike(&a, &b, &["ckpt"]);
    }

    /// `SPEC` for 2 steps on `gpus` in-process ranks (each rank a CPU process under `tandem
    /// launch`), every step checkpointed and kept, with a reward that varies within a
    /// prompt's samples (a digit found scores 0.5, the sum 1), so that both steps have
    /// gradients.
    fn two_steps_on(gpus: usize) -> String {
        let spec = SPEC.replace("steps = 3", "steps = 2");
        let spec = spec.replace("regex:[a-z]", "regex:[0-9]");
        let spec = spec.replace("every = 2", "every = 1");
        format!(
            "gpus = {gpus}\n{}",
            spec.replace("keep-last = 1", "keep-last = 2")
        )
    }

    /// `pipeline run NAME.toml --run-dir NAME` in `d` with `spec`, the environment clear of
    /// launcher variables.
    fn run(d: &Path, name: &str, spec: &str) -> Command {
        std::fs::write(d.join(format!("{name}.toml")), spec).unwrap();
        let mut c = Command::new(PIPELINE);
        c.current_dir(d)
            .args(["run", &format!("{name}.toml"), "--run-dir", name])
            .env("TANDEM_BIN_DIR", real_bins())
            .env("RAYON_NUM_THREADS", "1");
        for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "TANDEM_DAEMON"] {
            c.env_remove(k);
        }
        c
    }

    /// The adapters and their exp_avg and exp_avg_sq in checkpoint `ck`.
    fn adapter_state(ck: &Path) -> [Weights; 3] {
        let ad = read_adapter(ck).unwrap().weights;
        let r = tandem::engine::resume::load(ck, &ad).unwrap().unwrap();
        [ad, r.optimizer.exp_avg, r.optimizer.exp_avg_sq]
    }

    /// SIGKILLs rank 1 of the `tandem launch` the pipeline `pid` runs for step 2's update, as
    /// soon as that rank runs; false while there is none.
    fn kill_update_rank_1(pid: u32, run: &str) -> bool {
        let needle = format!("--out-model {run}/ckpt/step-0002");
        let launchers = children(pid)
            .into_iter()
            .filter(|(_, c)| c.contains(&needle));
        for (launcher, _) in launchers {
            for (rank, _) in children(launcher) {
                let env = std::fs::read(format!("/proc/{rank}/environ")).unwrap_or_default();
                if env.split(|&b| b == 0).any(|v| v == b"RANK=1") {
                    // SAFETY: a plain kill(2) of a process this test's pipeline started.
                    unsafe { libc::kill(rank as i32, libc::SIGKILL) };
                    return true;
                }
            }
        }
        false
    }

    /// GRPO-LoRA on 2 CPU ranks (`gpus = 2` in process: rollout and update under `tandem
    /// launch`, the update data parallel with the adapters' masters and moments sharded) and in
    /// one process, with the same global batch: every step samples the same rows, the
    /// checkpoints hold the same files, and the adapters and their moments after 2 steps are
    /// one process's up to the order of the gradient sums (the ranks add their own rows'
    /// gradients, then each other's; relative error ≤ 1e-5, as the full-weight 2-rank
    /// update's in tests/shard.rs is ≤ 1e-6 after one call). Each rank holds half the
    /// adapters' state. Then rank 1, SIGKILLed in step 2's update, stops the run; the rerun
    /// continues after step 1 and ends with the undisturbed 2-rank run's files, bit for bit.
    #[test]
    fn a_two_rank_lora_run_trains_as_one_and_resumes_after_rank_1_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        crate::stage_util::model_and_train_set(d, 64, 128, 40);
        assert_ok(&run(d, "one", &two_steps_on(1)).output().unwrap());
        assert_ok(&run(d, "two", &two_steps_on(2)).output().unwrap());
        let log = std::fs::read_to_string(d.join("two/commands.sh")).unwrap();
        let updates: Vec<&str> = log.lines().filter(|l| l.contains("/update ")).collect();
        assert_eq!(updates.len(), 2, "{log}");
        assert!(
            updates
                .iter()
                .all(|l| l.contains(" launch --nproc-per-node 2 -- ")),
            "{log}"
        );
        for step in ["step-0001", "step-0002"] {
            let f = format!("{step}/rollout.parquet");
            let (a, b) = (read(&d.join("one").join(&f)), read(&d.join("two").join(&f)));
            assert_eq!(
                i32_rows(&a, schema::RESPONSE_IDS),
                i32_rows(&b, schema::RESPONSE_IDS),
                "{f}: the same samples"
            );
        }
        let ck = |run: &str| d.join(run).join("ckpt/step-0002");
        let (one, two) = (ck("one"), ck("two"));
        let names = |dir: &Path| {
            let mut n: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(&one), names(&two));
        for f in ["adapter_config.json", "trainer_state.json"] {
            let read = |dir: &Path| std::fs::read(dir.join(f)).unwrap();
            assert_eq!(read(&one), read(&two), "{f}");
        }
        let (want, got) = (adapter_state(&one), adapter_state(&two));
        for (i, what) in ["adapters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            let e = rel_err(&got[i], &want[i]);
            eprintln!("2 ranks against one process, after 2 steps: {what} relative error {e:.2e}");
            assert!(e <= 1e-5, "{what}: relative error {e}");
        }
        // The adapters moved: the comparison is not of untouched ones.
        let first = adapter_state(&d.join("one/ckpt/step-0001"));
        assert!(
            rel_err(&want[0], &first[0]) > 1e-3,
            "step 2 moved the adapters"
        );
        let elems: usize = want[0].values().map(|t| t.data.len()).sum();
        let metrics = |run: &str, step: u64| -> serde_json::Value {
            let f = d.join(format!("{run}/step-{step:04}/metrics/update.json"));
            serde_json::from_slice(&std::fs::read(f).unwrap()).unwrap()
        };
        for step in [1, 2] {
            let (a, b) = (metrics("one", step), metrics("two", step));
            let (ga, gb) = (
                a["grad_norm"].as_f64().unwrap(),
                b["grad_norm"].as_f64().unwrap(),
            );
            assert!(
                ga > 0.0 && (ga - gb).abs() <= 1e-5 * ga,
                "step {step}: {a} vs {b}"
            );
        }
        let m = metrics("two", 2);
        let s = &m["shard"];
        assert_eq!(s["world_size"], 2, "{m}");
        // ⌈elements / 2⌉ per rank, each bucket's shard rounded up to 128 elements.
        let shard = s["shard_elems"].as_u64().unwrap() as usize;
        let buckets = s["buckets"].as_u64().unwrap() as usize;
        assert!(
            2 * shard >= elems && 2 * shard < elems + 2 * 128 * buckets,
            "a rank holds {shard} of {elems} adapter elements: {s}"
        );

        // Rank 1 dies in step 2's update; the rerun ends as the undisturbed run.
        let mut killed = run(d, "b", &two_steps_on(2));
        let mut child = killed
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while !kill_update_rank_1(child.id(), "b") {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the run ended before step 2's update"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "no rank 1 in step 2's update"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let o = child.wait_with_output().unwrap();
        assert!(!o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("rank 1"), "{}", text(&o));
        eprintln!("rank 1 killed in step 2's update:\n{}", text(&o));
        assert!(
            !d.join("b/ckpt/step-0002").exists(),
            "a killed update wrote"
        );
        let o = run(d, "b", &two_steps_on(2)).output().unwrap();
        assert_ok(&o);
        assert!(
            text(&o).contains("pipeline: continuing b after step 1"),
            "{}",
            text(&o)
        );
        crate::pipeline::assert_runs_end_alike(&d.join("two"), &d.join("b"), &["ckpt"]);
    }

    /// `daemon = true`: the LoRA run on the warm daemon (the adapters kept between updates,
    /// step 1's only in its memory under `--resident`, rollouts from the merged copy) ends with
    /// the in-process run's adapter checkpoints, rollout batches and metrics bit for bit; so
    /// does one whose daemon SIGKILLed itself in step 2's update, which goes back to step 0.
    #[test]
    fn a_lora_run_on_the_daemon_writes_what_in_process_writes_and_survives_its_death() {
        use tandem::daemon::resident::{KILL_AT_STEP_ENV, KILL_IN_UPDATE_ENV};
        let bins = real_bins();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        crate::stage_util::model_and_train_set(d, 64, 128, 40);
        let plain = SPEC.replace("keep-last = 1", "keep-last = 2");
        std::fs::write(d.join("plain.toml"), &plain).unwrap();
        let warm = plain.replace("steps = 3", "steps = 3\ndaemon = true");
        std::fs::write(d.join("warm.toml"), warm).unwrap();
        let cmd = |spec: &str, run: &str| {
            let mut c = Command::new(PIPELINE);
            c.current_dir(d)
                .args(["run", spec, "--run-dir", run])
                .env("TANDEM_BIN_DIR", &bins)
                .env_remove("TANDEM_DAEMON");
            c
        };
        assert_ok(&cmd("plain.toml", "a").output().unwrap());
        assert_ok(&cmd("warm.toml", "w").output().unwrap());
        let w = d.join("w");
        let commands = std::fs::read_to_string(w.join("commands.sh")).unwrap();
        let update1 = commands
            .lines()
            .find(|l| l.contains("--out-model w/ckpt/step-0001"))
            .unwrap_or_else(|| panic!("{commands}"));
        assert!(
            update1.contains("--daemon") && update1.contains("--resident"),
            "{update1}"
        );
        let marker = d.join("killed");
        let o = cmd("warm.toml", "k")
            .env(KILL_IN_UPDATE_ENV, &marker)
            .env(KILL_AT_STEP_ENV, "2")
            .output()
            .unwrap();
        assert_ok(&o);
        assert!(marker.exists(), "the daemon was never killed");
        assert!(text(&o).contains("going back to step 0"), "{}", text(&o));

        let a = d.join("a");
        let ck = checkpoint_files_in(&a, "ckpt");
        assert!(
            ck.contains_key("step-0002/adapter_model.safetensors"),
            "{:?}",
            ck.keys()
        );
        for run in [&w, &d.join("k")] {
            let cr = checkpoint_files_in(run, "ckpt");
            assert_eq!(ck.keys().collect::<Vec<_>>(), cr.keys().collect::<Vec<_>>());
            for (k, v) in &ck {
                assert!(v == &cr[k], "ckpt/{k} differs in {}", run.display());
            }
            // The batches' columns (the files' metadata say where each ran).
            for step in 1..=3 {
                let f = format!("step-{step:04}/rollout.parquet");
                let cols = |r: &std::path::Path| {
                    let b = crate::stage_util::read(&r.join(&f));
                    let ids = crate::stage_util::i32_rows(&b, schema::RESPONSE_IDS);
                    let lps = crate::stage_util::f32_rows(&b, schema::ROLLOUT_LOGPROBS);
                    format!("{ids:?} {lps:?}")
                };
                assert!(cols(&a) == cols(run), "{f} differs in {}", run.display());
            }
            let metrics = |r: &std::path::Path| {
                let mut rows = jsonl_sans_time(&r.join("metrics.jsonl"));
                for row in &mut rows {
                    let m = row.as_object_mut().unwrap();
                    m.retain(|k, _| !(k.contains("daemon") || k.ends_with("_saved")));
                }
                rows
            };
            assert_eq!(metrics(&a), metrics(run), "{}", run.display());
        }
    }

    /// The response ids and rollout log-probs of step `step`'s batch in `run`.
    fn rollout_rows(run: &Path, step: u64) -> String {
        let b = read(&run.join(format!("step-{step:04}/rollout.parquet")));
        let ids = i32_rows(&b, schema::RESPONSE_IDS);
        let lps = crate::stage_util::f32_rows(&b, schema::ROLLOUT_LOGPROBS);
        format!("{ids:?} {lps:?}")
    }

    /// `gpus = 2`, `daemon = true`: GRPO-LoRA on a daemon group (every rank keeps the frozen
    /// base, the adapters and its half of their AdamW state between updates; step 1's update
    /// resident, steps 2 and 3 checkpointed; rollouts from the merged copy every rank builds
    /// after each update) writes the adapter checkpoints and rollout batches of the same spec
    /// on in-process ranks (`daemon = false`, files written and read every step), bit for bit:
    /// both run the same zero2 code on the adapters, so the sums are in the same order. Every
    /// daemon of the group starts with the base frozen under fresh adapters (no f32 masters
    /// of it). Then rank 1's daemon SIGKILLs itself in step 2's update (the policy after step 1
    /// was only in the group's memory): the runner starts a new group, goes back to step 0 and
    /// ends with the same files.
    #[test]
    fn a_lora_run_on_a_daemon_group_writes_what_in_process_ranks_write_and_survives_rank_1s_death()
    {
        use tandem::daemon::resident::{KILL_AT_STEP_ENV, KILL_IN_UPDATE_ENV};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        crate::stage_util::model_and_train_set(d, 64, 128, 40);
        let spec = SPEC
            .replace("regex:[a-z]", "regex:[0-9]")
            .replace("keep-last = 1", "keep-last = 2");
        let files = format!("gpus = 2\n{spec}");
        let group = format!("gpus = 2\ndaemon = true\n{spec}");
        assert_ok(&run(d, "files", &files).output().unwrap());
        assert_ok(&run(d, "group", &group).output().unwrap());
        let marker = d.join("killed-marker");
        let o = run(d, "killed", &group)
            .env(KILL_IN_UPDATE_ENV, &marker)
            .env("TANDEM_DAEMON_KILL_RANK", "1")
            .env(KILL_AT_STEP_ENV, "2")
            .output()
            .unwrap();
        assert_ok(&o);
        assert!(marker.exists(), "rank 1 was never killed");
        assert!(text(&o).contains("going back to step 0"), "{}", text(&o));

        let g = d.join("group");
        let commands = std::fs::read_to_string(g.join("commands.sh")).unwrap();
        let updates: Vec<&str> = commands
            .lines()
            .filter(|l| l.contains("/update "))
            .collect();
        assert_eq!(updates.len(), 3, "{commands}");
        assert!(updates.iter().all(|l| l.contains("--daemon")), "{commands}");
        assert!(updates[0].contains("--resident") && !updates[1].contains("--resident"));
        let log = std::fs::read_to_string(g.join("daemon.log")).unwrap();
        for rank in ["rank 0 of 2", "rank 1 of 2"] {
            assert!(
                log.lines().any(|l| l.contains(rank)
                    && l.contains("as LoRA adapters (rank 4) on its frozen base")),
                "{log}"
            );
        }
        let want = checkpoint_files_in(&d.join("files"), "ckpt");
        assert!(
            want.contains_key("step-0003/adapter_model.safetensors")
                && want.contains_key("step-0003/optimizer.safetensors"),
            "{:?}",
            want.keys()
        );
        for name in ["group", "killed"] {
            let r = d.join(name);
            let got = checkpoint_files_in(&r, "ckpt");
            assert_eq!(
                want.keys().collect::<Vec<_>>(),
                got.keys().collect::<Vec<_>>()
            );
            for (k, v) in &want {
                assert!(v == &got[k], "ckpt/{k} differs in {name}");
            }
            for step in 1..=3 {
                assert!(
                    rollout_rows(&d.join("files"), step) == rollout_rows(&r, step),
                    "step {step}'s rollout differs in {name}"
                );
            }
        }
        // The adapters moved: the comparison is not of untouched ones.
        let (first, last) = (
            adapter_state(&d.join("files/ckpt/step-0002")),
            adapter_state(&d.join("files/ckpt/step-0003")),
        );
        assert!(
            rel_err(&last[0], &first[0]) > 1e-4,
            "step 3 moved the adapters"
        );
    }

    /// `[update] shard = "full"` with LoRA stops before step 0 (exit 2), naming the key.
    #[test]
    fn a_lora_spec_with_full_sharding_is_refused_before_anything_runs() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        crate::stage_util::model_and_train_set(d, 64, 128, 8);
        let spec = two_steps_on(2).replace("lora-rank = 4", "shard = \"full\"\nlora-rank = 4");
        let o = run(d, "r", &spec).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(
            text(&o).contains("[update]: --shard full with --lora-rank"),
            "{}",
            text(&o)
        );
        assert!(!d.join("r/step-0001").exists());
    }
}

/// `make demo-lora`, shortened: DEMO_SPEC=demo-lora.toml pipelines/demo.sh with 50 steps on the
/// debug binaries; the adapters raise the greedy accuracy of the frozen SFT model.
#[test]
fn shortened_lora_demo_raises_the_eval_accuracy() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_pipeline"))
        .parent()
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(work.path())
        .args(["--steps", "50"])
        .env("DEMO_SPEC", "demo-lora.toml")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo-lora failed:\n{text}");
    let run = work.path().join("run");
    let evals: Vec<(u64, f64)> = std::fs::read_to_string(run.join("eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["accuracy"].as_f64().unwrap())
        })
        .collect();
    let (first, last) = (evals[0], *evals.last().unwrap());
    eprintln!("demo-lora: eval accuracy {first:?} -> {last:?}");
    assert_eq!((first.0, last.0), (0, 50));
    assert!(
        last.1 > first.1 + 0.08,
        "eval accuracy did not rise: {evals:?}"
    );
    assert!(run.join("ckpt").read_dir().unwrap().all(|c| {
        let c = c.unwrap().path();
        c.join("adapter_model.safetensors").is_file() && !c.join("config.json").exists()
    }));
}

mod daemon {
    use crate::stage_util::{add_advantages, bin, ok, p, prompts, tiny_model};
    use std::path::Path;
    use std::process::Command;
    use std::time::{Duration, Instant};

    fn rollout(model: &Path, prompts: &Path, out: &Path, daemon: Option<&Path>) -> Vec<u8> {
        let mut args = vec![
            "--model",
            p(model),
            "--in",
            p(prompts),
            "--out",
            p(out),
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--seed",
            "5",
            "--temperature",
            "1.0",
        ];
        let metrics = out.with_extension("json");
        if let Some(s) = daemon {
            args.extend(["--daemon", p(s), "--metrics", p(&metrics)]);
        }
        ok("rollout", &args);
        if daemon.is_some() {
            let m: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&metrics).unwrap()).unwrap();
            assert!(m["daemon"].is_object(), "ran on the daemon: {m}");
        }
        let b = crate::stage_util::read(out);
        let ids = crate::stage_util::i32_rows(&b, tandem::batch::schema::RESPONSE_IDS);
        let lps = crate::stage_util::f32_rows(&b, tandem::batch::schema::ROLLOUT_LOGPROBS);
        format!("{ids:?} {lps:?}").into_bytes()
    }

    /// LoRA on the warm daemon, stage by stage: a LoRA update sent to it writes the in-process
    /// update's files byte for byte (PEFT adapters, optimizer and trainer state), and its next
    /// rollout, from the adapters it keeps, differs from the base model's and is the in-process
    /// rollout of `merge-lora`'s merged model: the adapter cannot be silently left out.
    /// `ref-logprob` on the base scores with the base the daemon holds under the adapters
    /// (adapters off), as in process. `status` reports the adapters held; `daemon-ctl save`
    /// writes them as the update did (here with the adapters' optimizer state parked in host
    /// memory between updates, `--offload-optimizer`).
    #[test]
    fn a_lora_update_on_the_daemon_writes_the_in_process_files_and_rolls_out_merged() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 44);
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        let on_base = rollout(&base, &pr, &d.join("r.parquet"), None);
        let batch = d.join("adv.parquet");
        add_advantages(&d.join("r.parquet"), &batch);
        let update = |out: &Path, daemon: Option<&Path>| {
            let mut args = vec![
                "--model",
                p(&base),
                "--in",
                p(&batch),
                "--out-model",
                p(out),
            ];
            args.extend(["--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8"]);
            args.extend(["--lora-targets", "all-linear", "--seed", "9"]);
            if let Some(s) = daemon {
                args.extend(["--daemon", p(s)]);
            }
            ok("update", &args);
        };
        let ck = d.join("ck");
        update(&ck, None);
        let merged = d.join("merged");
        let m = [
            "merge-lora",
            "--base",
            p(&base),
            "--adapter",
            p(&ck),
            "--out",
            p(&merged),
        ];
        ok("tandem", &m);

        let sock = d.join("sock");
        let mut child = Command::new(bin("tandem"))
            .args([
                "daemon",
                "--device",
                "cpu",
                "--socket",
                p(&sock),
                "--policy",
                p(&base),
                "--offload-optimizer",
            ])
            .env("RAYON_NUM_THREADS", "2")
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the daemon exited at start"
            );
            assert!(t0.elapsed() < Duration::from_secs(120), "no daemon socket");
            std::thread::sleep(Duration::from_millis(50));
        }
        let reference = |out: &Path, daemon: Option<&Path>| {
            let r = p(&d.join("r.parquet")).to_string();
            let mut args = vec!["--model", p(&base), "--in", &r, "--out", p(out)];
            args.extend(["--column", "ref_logprobs"]);
            if let Some(s) = daemon {
                args.extend(["--daemon", p(s)]);
            }
            ok("ref-logprob", &args);
            let b = crate::stage_util::read(out);
            crate::stage_util::f32_rows(&b, tandem::batch::schema::REF_LOGPROBS)
        };
        let run = || -> (Vec<u8>, Vec<u8>, serde_json::Value, Vec<u8>) {
            let base_on_daemon = rollout(&base, &pr, &d.join("db.parquet"), Some(&sock));
            let dk = d.join("dk");
            update(&dk, Some(&sock));
            let on_daemon = reference(&d.join("dref.parquet"), Some(&sock));
            assert_eq!(on_daemon, reference(&d.join("ref.parquet"), None));
            let after = rollout(&dk, &pr, &d.join("dr.parquet"), Some(&sock));
            let ctl = |args: &[&str]| {
                let o = Command::new(bin("tandem"))
                    .arg("daemon-ctl")
                    .args(args)
                    .args(["--socket", p(&sock)])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                o.stdout
            };
            let status: serde_json::Value = serde_json::from_slice(&ctl(&["status"])).unwrap();
            ctl(&["save", "--out", p(&d.join("saved"))]);
            let saved = std::fs::read(d.join("saved/adapter_model.safetensors")).unwrap();
            (base_on_daemon, after, status, saved)
        };
        let out = std::panic::catch_unwind(run);
        let _ = child.kill();
        let _ = child.wait();
        let (base_on_daemon, after, status, saved) = out.unwrap();
        assert_eq!(base_on_daemon, on_base);
        for f in [
            "adapter_model.safetensors",
            "adapter_config.json",
            "optimizer.safetensors",
            "trainer_state.json",
        ] {
            let (x, y) = (
                std::fs::read(ck.join(f)).unwrap(),
                std::fs::read(d.join("dk").join(f)),
            );
            assert!(
                x == y.unwrap(),
                "{f}: the daemon's update wrote other bytes"
            );
        }
        assert!(!d.join("dk/config.json").exists());
        assert_ne!(after, on_base, "the adapters change the rollout");
        assert_eq!(after, rollout(&merged, &pr, &d.join("mr.parquet"), None));
        assert_eq!(after, rollout(&ck, &pr, &d.join("cr.parquet"), None));
        let policy = &status["resident"]["policy"];
        assert_eq!(policy["lora"]["rank"], 4, "{status}");
        assert_eq!(policy["optimizer_offloaded"], true, "{status}");
        assert_eq!(policy["generation_copy"], true, "{status}");
        // The reference job scored with the base under the adapters: no reference loaded.
        assert!(status["resident"]["reference"].is_null(), "{status}");
        assert_eq!(
            saved,
            std::fs::read(ck.join("adapter_model.safetensors")).unwrap()
        );
    }

    /// `tandem daemon --policy BASE --lora-rank R ...` (what the runner starts for a LoRA
    /// spec) holds the base frozen under fresh adapters from the start: `status` counts only
    /// the adapters' elements as trained (f32 masters and AdamW state), no reference is loaded
    /// beside the base, and the first update with the seed the daemon was told (`--lora-seed`)
    /// trains those adapters without loading anything, writing the in-process update's files
    /// byte for byte. A daemon told another seed loads the update's own fresh adapters (the
    /// files again byte for byte).
    #[test]
    fn a_lora_daemon_preloads_the_base_frozen_and_its_first_update_trains_it_in_place() {
        use tandem::model::lora::{init_adapters, LoraSpec};
        use tandem::model::ModelDir;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 45);
        let pr = d.join("prompts.parquet");
        prompts(&pr, &["Name a colour.", "Count to three."]);
        rollout(&base, &pr, &d.join("r.parquet"), None);
        let batch = d.join("adv.parquet");
        add_advantages(&d.join("r.parquet"), &batch);
        let lora = [
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "q,v,down",
        ];
        let update = |out: &Path, daemon: Option<&Path>| {
            let mut args = vec![
                "--model",
                p(&base),
                "--in",
                p(&batch),
                "--out-model",
                p(out),
            ];
            args.extend(["--lr", "1e-2", "--seed", "9"]);
            args.extend(lora);
            let m = out.with_extension("json");
            if let Some(s) = daemon {
                args.extend(["--daemon", p(s), "--metrics", p(&m)]);
            }
            ok("update", &args);
            daemon.map(|_| {
                let m: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(&m).unwrap()).unwrap();
                m["daemon"]["reloaded"].as_bool().unwrap()
            })
        };
        let ck = d.join("ck");
        update(&ck, None);
        let (cfg, weights) = ModelDir::load(&base).unwrap();
        let spec = LoraSpec::from_flags(4, 8.0, "q,v,down").unwrap().unwrap();
        let adapter_elems: usize = init_adapters(&cfg, &spec, 0)
            .values()
            .map(|t| t.data.len())
            .sum();
        let model_elems: usize = weights.values().map(|t| t.data.len()).sum();

        let on_daemon = |name: &str, seed: &str| {
            let sock = d.join(format!("{name}.sock"));
            let mut args = vec!["daemon", "--device", "cpu", "--socket", p(&sock)];
            args.extend(["--policy", p(&base), "--ref", p(&base), "--lora-seed", seed]);
            args.extend(lora);
            let mut child = Command::new(bin("tandem"))
                .args(&args)
                .env("RAYON_NUM_THREADS", "2")
                .spawn()
                .unwrap();
            let t0 = Instant::now();
            while !sock.exists() {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "the daemon exited at start"
                );
                assert!(t0.elapsed() < Duration::from_secs(120), "no daemon socket");
                std::thread::sleep(Duration::from_millis(50));
            }
            let run = || {
                let o = Command::new(bin("tandem"))
                    .args(["daemon-ctl", "status", "--socket", p(&sock)])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                let out = d.join(name);
                (status, update(&out, Some(&sock)).unwrap(), out)
            };
            let out = std::panic::catch_unwind(run);
            let _ = child.kill();
            let _ = child.wait();
            out.unwrap()
        };
        for (name, seed, reloads) in [("told", "9", false), ("other", "10", true)] {
            let (status, reloaded, out) = on_daemon(name, seed);
            let policy = &status["resident"]["policy"];
            assert_eq!(policy["lora"]["rank"], 4, "{status}");
            assert_eq!(policy["trained_elems"], adapter_elems, "{status}");
            assert!(
                adapter_elems * 10 < model_elems,
                "{adapter_elems} of {model_elems}"
            );
            assert!(status["resident"]["reference"].is_null(), "{status}");
            assert_eq!(
                reloaded, reloads,
                "{name}: whether the update loaded the policy"
            );
            for f in [
                "adapter_model.safetensors",
                "optimizer.safetensors",
                "trainer_state.json",
            ] {
                let (x, y) = (
                    std::fs::read(ck.join(f)).unwrap(),
                    std::fs::read(out.join(f)),
                );
                assert!(
                    x == y.unwrap(),
                    "{name}: {f}: the daemon's update wrote other bytes"
                );
            }
        }
    }

    /// LoRA on a 2-daemon group by hand (`tandem launch --nproc-per-node 2 -- tandem daemon
    /// --lora-rank ...`): a resident update leaves every rank with the adapters' state in
    /// shards and a merged generation copy; the group's rollout from it samples the tokens of
    /// an in-process rollout from the files of the same update run on 2 launched ranks; a
    /// second resident update trains from memory (no load); `daemon-ctl save` then writes the
    /// second launched update's files bit for bit (the adapters' state gathered whole, one
    /// optimizer file, as a LoRA update on ranks writes it).
    #[test]
    fn resident_lora_updates_on_a_daemon_group_save_the_launched_updates_files() {
        use crate::dp::{ctl_with, files, launch_ok, same_rows, DaemonGroup};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = tiny_model(d, 46);
        let pr = d.join("prompts.parquet");
        prompts(
            &pr,
            &["Name a colour.", "Count to three.", "Say hi.", "Spell cat."],
        );
        rollout(&base, &pr, &d.join("r.parquet"), None);
        let batch = d.join("adv.parquet");
        add_advantages(&d.join("r.parquet"), &batch);
        let lora = [
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "all-linear",
        ];
        // `update` from `from` into `out` with `extra`: launched on 2 ranks, or a client.
        let update = |from: &Path, out: &Path, extra: &[&str], launched: bool| {
            let mut a = vec!["--model", p(from), "--in", p(&batch), "--out-model", p(out)];
            a.extend(["--lr", "1e-2", "--seed", "9", "--mini-batch-size", "2"]);
            a.extend(lora);
            a.extend(extra);
            match launched {
                true => launch_ok(2, "update", &a),
                false => ok("update", &a),
            };
        };
        let (m1, m2) = (d.join("m1"), d.join("m2"));
        update(&base, &m1, &[], true);
        update(&m1, &m2, &[], true);
        rollout(&m1, &pr, &d.join("m1.parquet"), None);

        let socket = d.join("g.sock");
        let mut extra = lora.to_vec();
        extra.extend(["--lora-seed", "9"]);
        let _group = DaemonGroup::start(d, 2, &socket, &base, &extra);
        let (k1, k2) = (d.join("k1"), d.join("k2"));
        let resident = ["--resident", "--daemon", p(&socket)];
        update(&base, &k1, &resident, false);
        assert!(k1.join("resident.json").is_file());
        // A rank publishes its status when its job ends, which may be just after rank 0
        // answered the update: ask until every rank shows its copy, for 10 s at most.
        let t0 = std::time::Instant::now();
        let status = loop {
            let st = ctl_with(&socket, &["status"]);
            let status: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
            let ranks = status["ranks"].as_array().unwrap();
            let built = ranks
                .iter()
                .all(|r| r["resident"]["policy"]["generation_copy"] == true);
            if built || t0.elapsed().as_secs() >= 10 {
                break status;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        for r in status["ranks"].as_array().unwrap() {
            let policy = &r["resident"]["policy"];
            assert_eq!(policy["lora"]["rank"], 4, "{status}");
            assert_eq!(policy["optimizer_sharded"], true, "{status}");
            assert_eq!(policy["generation_copy"], true, "{status}");
        }
        // The ranks generate 2 prompts each: the sampled tokens are one process's, the
        // log-probs to 1e-5 (the CPU GEMM blocks rows by a step's row count).
        rollout(&k1, &pr, &d.join("k1.parquet"), Some(&socket));
        let read = crate::stage_util::read;
        same_rows(
            &read(&d.join("m1.parquet")),
            &read(&d.join("k1.parquet")),
            "rollout",
        );
        // Unmerged, twice: the group generates with its training decoders (no copy needed,
        // the merged one dropped), the tokens of one process's unmerged rollout of the
        // launched update's files.
        let unmerged = |model: &Path, out: &Path, daemon: Option<&Path>| {
            let mut a = vec!["--model", p(model), "--in", p(&pr), "--out", p(out)];
            a.extend(["--n", "2", "--max-new-tokens", "8", "--seed", "5"]);
            a.extend(["--temperature", "1.0", "--lora-mode", "unmerged"]);
            if let Some(s) = daemon {
                a.extend(["--daemon", p(s)]);
            }
            ok("rollout", &a);
            read(out)
        };
        let alone = unmerged(&m1, &d.join("u1.parquet"), None);
        for k in 0..2 {
            let on_group = unmerged(&k1, &d.join(format!("u1g{k}.parquet")), Some(&socket));
            same_rows(&alone, &on_group, "unmerged rollout on the group");
        }
        let k2m = d.join("k2.json");
        update(
            &k1,
            &k2,
            &[&resident[..], &["--metrics", p(&k2m)]].concat(),
            false,
        );
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&k2m).unwrap()).unwrap();
        assert_eq!(m["daemon"]["reloaded"], false, "{m}");
        let saved = d.join("saved");
        let o = ctl_with(&socket, &["save", "--out", p(&saved)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(saved.join("optimizer.safetensors").is_file());
        assert!(
            files(&m2) == files(&saved),
            "daemon-ctl save wrote other files"
        );
    }
}
