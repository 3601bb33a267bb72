//! The critic (a value model, issue 36): the decoder with a value head on the CPU backend
//! (gradients against finite differences, the positions its values sit at, a zero head from
//! a policy), its checkpoint in HF's token-classification layout, the `values` stage and the
//! critic's update.

use crate::common;
use crate::stage_util::{f32_rows, input_error, ok, p, read, tiny_model, with_f32_rows};
use crate::stages::training_batch;

use common::{check_finite_differences, random_weights, tiny, tokens};
use tandem::backend::check::randn;
use tandem::backend::cpu::Cpu;
use tandem::model::critic::value_model_from;
use tandem::model::decoder::{Decoder, SeqRef, TokenGrads, TokenStats};
use tandem::model::names::{VALUE_BIAS, VALUE_HEAD};
use tandem::model::{Arch, Config, ModelDir, Tensor, Weights};

const ARCHS: [Arch; 3] = [Arch::Qwen2, Arch::Llama, Arch::Qwen3];

/// A value model of `arch`'s tiny shape with random weights, its head random too.
fn critic(arch: Arch, seed: u64) -> (Config, Weights) {
    let cfg = tiny(arch);
    let (cfg, mut w) = value_model_from(&cfg, random_weights(&cfg, seed));
    let d = cfg.hidden_size;
    w.insert(
        VALUE_HEAD.into(),
        Tensor::new(vec![1, d], randn(d, seed + 100)),
    );
    w.insert(VALUE_BIAS.into(), Tensor::new(vec![1], vec![0.3]));
    (cfg, w)
}

fn values(cfg: &Config, w: &Weights, seqs: &[SeqRef]) -> Vec<Vec<f32>> {
    let mut dec = Decoder::new(Cpu, cfg, w).unwrap();
    let stats = dec.logprobs(seqs, 1.0, true).unwrap();
    stats
        .into_iter()
        .map(|s| {
            assert_eq!(s.entropy, None, "a value model has no entropy");
            s.logprobs
        })
        .collect()
}

#[test]
fn value_head_gradients_match_finite_differences() {
    for arch in ARCHS {
        let (cfg, w0) = critic(arch, 1);
        let toks = [tokens(5, cfg.vocab_size, 2), tokens(7, cfg.vocab_size, 3)];
        let seqs = [
            SeqRef {
                tokens: &toks[0],
                start: 2,
            },
            SeqRef {
                tokens: &toks[1],
                start: 1,
            },
        ];
        // L = Σ c·V with fixed random c.
        let c: Vec<Vec<f32>> = vec![randn(3, 10), randn(6, 11)];
        let loss = |v: &[Vec<f32>]| -> f64 {
            v.iter()
                .zip(&c)
                .flat_map(|(v, c)| v.iter().zip(c).map(|(&a, &b)| a as f64 * b as f64))
                .sum()
        };
        let mut dec = Decoder::new(Cpu, &cfg, &w0).unwrap();
        dec.forward_backward(&seqs, 1.0, &mut |stats: &[TokenStats]| {
            assert_eq!(stats[0].logprobs.len(), 3);
            Ok(c.iter()
                .map(|c| TokenGrads {
                    dlogprobs: c.clone(),
                    dentropy: None,
                })
                .collect())
        })
        .unwrap();
        let grads = dec.export_grads().unwrap();
        assert!(grads.contains_key(VALUE_HEAD) && grads.contains_key(VALUE_BIAS));
        // The bias's gradient is Σ c exactly.
        let sum_c: f64 = c.iter().flatten().map(|&x| x as f64).sum();
        assert!((grads[VALUE_BIAS].data[0] as f64 - sum_c).abs() < 1e-4);
        check_finite_differences(&format!("{arch:?}"), &grads, &w0, |w| {
            loss(&values(&cfg, w, &seqs))
        });
    }
}

#[test]
fn each_value_sits_at_the_position_before_its_token() {
    // verl's critic takes values[:, -response_length-1:-1]: the value of response token t is
    // read at position t-1, so it cannot depend on token t itself.
    let (cfg, w) = critic(Arch::Qwen2, 4);
    let a = tokens(8, cfg.vocab_size, 5);
    let mut b = a.clone();
    b[7] = (b[7] + 1) % cfg.vocab_size as u32;
    let seq = |t| SeqRef {
        tokens: t,
        start: 3,
    };
    let (va, vb) = (values(&cfg, &w, &[seq(&a)]), values(&cfg, &w, &[seq(&b)]));
    assert_eq!(va[0].len(), 5);
    assert_eq!(va, vb, "changing the last token changed a value");
    // The value of token 3 is that of the prefix a[..4] whose only scored token is a[3].
    let short = values(
        &cfg,
        &w,
        &[SeqRef {
            tokens: &a[..4],
            start: 3,
        }],
    );
    assert!((short[0][0] - va[0][0]).abs() < 1e-5);
    // And the values are not all alike (the head reads the hidden state).
    assert!(va[0].iter().any(|&v| (v - va[0][0]).abs() > 1e-4));
}

#[test]
fn a_critic_made_from_a_policy_values_everything_at_zero() {
    let cfg = tiny(Arch::Llama);
    let (ccfg, w) = value_model_from(&cfg, random_weights(&cfg, 7));
    let t = tokens(6, cfg.vocab_size, 8);
    let v = values(
        &ccfg,
        &w,
        &[SeqRef {
            tokens: &t,
            start: 2,
        }],
    );
    assert_eq!(v, vec![vec![0.0; 4]]);
}

#[test]
fn a_critic_checkpoint_is_a_token_classifier_with_one_label() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, w) = critic(Arch::Qwen2, 9);
    let out = dir.path().join("critic");
    ModelDir::save(&out, &cfg, &w, None).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["architectures"][0], "Qwen2ForTokenClassification");
    assert_eq!(json["num_labels"], 1);
    assert_eq!(json["id2label"], serde_json::json!({"0": "LABEL_0"}));
    let (cfg2, w2) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg2, cfg);
    assert!(cfg2.value_head);
    assert_eq!(w2[VALUE_HEAD].shape, vec![1, cfg.hidden_size]);
    assert_eq!(w2[VALUE_BIAS].shape, vec![1]);
    assert!(!w2.contains_key("lm_head.weight"));
    // Two labels is a classifier, not a critic: refused, naming the file and the key.
    let mut j = json.clone();
    j["num_labels"] = 2.into();
    std::fs::write(out.join("config.json"), j.to_string()).unwrap();
    let err = ModelDir::load(&out).unwrap_err();
    assert!(tandem::error::is_input_error(&err), "{err}");
    assert!(err.to_string().contains("num_labels = 1"), "{err}");
    transformers_opens(&dir.path().join("critic2"), &cfg, &w);
}

/// transformers opens the critic as `AutoModelForTokenClassification` and computes the same
/// values, where python has transformers and torch (skipped with a message otherwise).
fn transformers_opens(out: &std::path::Path, cfg: &Config, w: &Weights) {
    let have = std::process::Command::new("python3")
        .args(["-c", "import transformers, torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !have {
        eprintln!(
            "skipped: python3 has no transformers/torch, the critic is not opened in transformers"
        );
        return;
    }
    ModelDir::save(out, cfg, w, None).unwrap();
    let toks = tokens(6, cfg.vocab_size, 12);
    let ours = values(
        cfg,
        w,
        &[SeqRef {
            tokens: &toks,
            start: 1,
        }],
    );
    let ids: Vec<String> = toks.iter().map(|t| t.to_string()).collect();
    let script = format!(
        "import torch, transformers\n\
         m = transformers.AutoModelForTokenClassification.from_pretrained('{}', torch_dtype=torch.float32)\n\
         m.eval()\n\
         with torch.no_grad():\n    v = m(torch.tensor([[{}]])).logits[0, :-1, 0]\n\
         print(' '.join(repr(float(x)) for x in v))\n",
        out.display(),
        ids.join(",")
    );
    let o = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<f32> = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(theirs.len(), ours[0].len());
    for (a, b) in theirs.iter().zip(&ours[0]) {
        // The checkpoint is bf16: our values are from the f32 weights.
        assert!(
            (a - b).abs() < 5e-2,
            "transformers {theirs:?} vs ours {ours:?}"
        );
    }
}

/// The `values` stage: a policy's directory gives a critic with a zero head (every value 0,
/// one per response token); a critic checkpoint gives the decoder's values at the positions
/// before each token; bad input exits 2 and writes nothing.
#[test]
fn values_stage_adds_one_value_per_response_token() {
    let dir = tempfile::tempdir().unwrap();
    let policy = tiny_model(dir.path(), 3);
    let batch = dir.path().join("batch.parquet");
    let prompt = [10, 20, 30];
    let responses = [vec![40, 41, 42], vec![50, 51], vec![]];
    training_batch(&batch, &prompt, &responses, &[1.0, -1.0, 0.5]);
    let out = dir.path().join("v0.parquet");
    let args = |model: &std::path::Path, out: &std::path::Path| {
        vec![
            "--model".to_string(),
            p(model).into(),
            "--in".into(),
            p(&batch).into(),
            "--out".into(),
            p(out).into(),
            "--micro-batch-tokens".into(),
            "7".into(),
        ]
    };
    ok("values", &args(&policy, &out));
    let zeros = f32_rows(&read(&out), "values");
    assert_eq!(zeros, vec![vec![0.0; 3], vec![0.0; 2], vec![]]);

    // A critic with a random head, saved as a checkpoint.
    let (cfg, w) = ModelDir::load(&policy).unwrap();
    let (ccfg, mut cw) = value_model_from(&cfg, w);
    let d = ccfg.hidden_size;
    cw.insert(VALUE_HEAD.into(), Tensor::new(vec![1, d], randn(d, 5)));
    cw.insert(VALUE_BIAS.into(), Tensor::new(vec![1], vec![-0.25]));
    let critic_dir = dir.path().join("critic");
    ModelDir::save(&critic_dir, &ccfg, &cw, Some(&policy)).unwrap();
    let out = dir.path().join("v1.parquet");
    ok("values", &args(&critic_dir, &out));
    let got = f32_rows(&read(&out), "values");
    // An observation token (response_mask 0) has value 0, as verl masks its critic's values.
    let masked = dir.path().join("masked.parquet");
    let mask = tandem::batch::list_array::<arrow_array::types::UInt8Type>(
        &[0, 3, 5, 5],
        vec![1, 0, 1, 1, 1],
    );
    crate::stage_util::with_column(&batch, &masked, "response_mask", mask);
    let mut a = args(&critic_dir, &dir.path().join("v2.parquet"));
    a[3] = p(&masked).into();
    ok("values", &a);
    let m = f32_rows(&read(&dir.path().join("v2.parquet")), "values");
    assert_eq!(m[0][1], 0.0);
    assert_eq!((m[0][0], m[0][2], &m[1]), (got[0][0], got[0][2], &got[1]));
    // The same values from the decoder (the saved bf16 weights), each read at the position
    // before its token.
    let (ccfg2, cw2) = ModelDir::load(&critic_dir).unwrap();
    let joined: Vec<Vec<u32>> = responses
        .iter()
        .map(|r| prompt.iter().chain(r).map(|&t| t as u32).collect())
        .collect();
    let seqs: Vec<SeqRef> = joined[..2]
        .iter()
        .map(|t| SeqRef {
            tokens: t,
            start: 3,
        })
        .collect();
    let want = values(&ccfg2, &cw2, &seqs);
    for (g, w) in got[..2].iter().zip(&want) {
        assert_eq!(g.len(), w.len());
        // Packed in other micro-batches: the sums round differently.
        assert!(
            g.iter().zip(w).all(|(a, b)| (a - b).abs() < 1e-4),
            "{got:?} vs {want:?}"
        );
    }
    assert!(got[2].is_empty());
    assert!(got[0].iter().all(|&v| v != 0.0));
    let meta: serde_json::Value =
        serde_json::from_str(&read(&out).meta["tandem.stage.values"]).unwrap();
    assert_eq!(meta["critic_from_policy"], false);

    // Bad input: exit 2, naming what is wrong, and no output.
    let none = dir.path().join("none.parquet");
    input_error(
        "values",
        &args(&dir.path().join("nowhere"), &none),
        "nowhere",
    );
    let nocol = dir.path().join("nocol.parquet");
    crate::stage_util::prompts(&nocol, &["q"]);
    let mut a = args(&policy, &none);
    a[3] = p(&nocol).into();
    input_error("values", &a, "column 'prompt_ids' is missing");
    assert!(!none.exists());
}

/// One `update --critic` call: the metrics JSON.
fn critic_update(
    model: &std::path::Path,
    batch: &std::path::Path,
    out: &std::path::Path,
    extra: &[&str],
) -> serde_json::Value {
    let metrics = out.with_extension("json");
    let mut args = vec![
        "--critic",
        "--model",
        p(model),
        "--in",
        p(batch),
        "--out-model",
        p(out),
        "--metrics",
        p(&metrics),
        "--weight-decay",
        "0",
        "--micro-batch-tokens",
        "6",
    ];
    args.extend_from_slice(extra);
    ok("update", &args);
    serde_json::from_slice(&std::fs::read(&metrics).unwrap()).unwrap()
}

/// `update --critic`: from a policy's model (a zero value head: every value 0), the first
/// step's loss is 0.5·mean(R²) and the head's bias moves by lr towards the returns (Adam's
/// first step is lr·sign(g)); the trunk does not move (the zero head passes it no gradient);
/// on a fixed batch the loss goes down step after step; the checkpoint is a token classifier
/// whose optimizer state the next call resumes.
#[test]
fn update_critic_learns_the_returns_of_a_fixed_batch() {
    let dir = tempfile::tempdir().unwrap();
    let policy = tiny_model(dir.path(), 4);
    let plain = dir.path().join("plain.parquet");
    let responses = [vec![40, 41, 42], vec![50, 51], vec![60, 61, 62, 63]];
    training_batch(&plain, &[10, 20, 30], &responses, &[1.0, -1.0, 1.0]);
    let returns: Vec<Vec<f32>> = vec![
        vec![1.0, 0.8, 0.6],
        vec![-0.5, -0.25],
        vec![0.9, 0.9, 1.0, 1.0],
    ];
    let with_ret = dir.path().join("ret.parquet");
    with_f32_rows(&plain, &with_ret, "returns", &returns);
    // V_old = 0 everywhere (what `values` gives with the policy's model).
    let batch = dir.path().join("batch.parquet");
    ok(
        "values",
        &[
            "--model",
            p(&policy),
            "--in",
            p(&with_ret),
            "--out",
            p(&batch),
        ],
    );

    let lr = "2e-3";
    let c1 = dir.path().join("critic-1");
    let m1 = critic_update(
        &policy,
        &batch,
        &c1,
        &["--lr", lr, "--cliprange-value", "100"],
    );
    let flat: Vec<f64> = returns.iter().flatten().map(|&r| r as f64).collect();
    let n = flat.len() as f64;
    let want = 0.5 * flat.iter().map(|r| r * r).sum::<f64>() / n;
    let got = m1["critic"]["vf_loss"].as_f64().unwrap();
    assert!(
        (got - want).abs() < 1e-6,
        "first vf_loss {got}, by hand {want}"
    );
    assert_eq!(m1["critic"]["vpred_mean"], 0.0);
    assert_eq!(m1["critic"]["vf_clipfrac"], 0.0);
    assert_eq!(m1["critic"]["lr"].as_f64().unwrap(), 2e-3);
    // Values all 0: Var(R − V) = Var(R), so the explained variance is ~0.
    assert!(m1["critic"]["vf_explained_var"].as_f64().unwrap().abs() < 1e-3);
    let (ccfg, cw) = ModelDir::load(&c1).unwrap();
    assert!(ccfg.value_head);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c1.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["architectures"][0], "Qwen2ForTokenClassification");
    assert!(c1.join("optimizer.safetensors").is_file() && c1.join("tokenizer.json").is_file());
    // The bias moved by lr (bf16 in the file) towards mean(R) > 0; the trunk is the policy's.
    let bias = cw[VALUE_BIAS].data[0];
    assert!((bias - 2e-3).abs() < 1e-5, "bias {bias}");
    let (_, pw) = ModelDir::load(&policy).unwrap();
    assert_eq!(
        cw["model.layers.0.mlp.down_proj.weight"],
        pw["model.layers.0.mlp.down_proj.weight"]
    );

    // Training on: the loss goes down call after call (the batch's values stay those of the
    // first critic, as verl's do within a step).
    let mut from = c1;
    let mut losses = vec![got];
    for k in 2..=8 {
        let to = dir.path().join(format!("critic-{k}"));
        let m = critic_update(
            &from,
            &batch,
            &to,
            &["--lr", lr, "--cliprange-value", "100"],
        );
        losses.push(m["critic"]["vf_loss"].as_f64().unwrap());
        from = to;
    }
    eprintln!("vf_loss over 8 calls: {losses:?}");
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "{losses:?}");
    assert!(losses[7] < 0.5 * losses[0], "{losses:?}");
    let ts: serde_json::Value =
        serde_json::from_slice(&std::fs::read(from.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(ts["optimizer_step"], 8);

    // The clip: with c = 0 the value cannot move from V_old = 0 through the clipped term,
    // which is then the larger wherever the new values moved away from the returns' side.
    let m = critic_update(
        &from,
        &batch,
        &dir.path().join("clipped"),
        &["--lr", lr, "--cliprange-value", "0"],
    );
    assert!(m["critic"]["vf_clipfrac"].as_f64().unwrap() > 0.0, "{m}");

    // Bad input: a batch without returns, a policy flag, a critic given to a policy update.
    let nowhere = dir.path().join("nowhere");
    let base = ["--model", p(&policy), "--out-model", p(&nowhere)];
    let mut a = base.to_vec();
    a.extend(["--critic", "--in", p(&plain)]);
    input_error(
        "update",
        &a,
        "column 'values' is missing; it is needed by --critic",
    );
    let mut a = base.to_vec();
    a.extend(["--critic", "--in", p(&batch), "--use-kl-loss"]);
    input_error("update", &a, "--use-kl-loss does not apply to --critic");
    input_error(
        "update",
        &[
            "--model",
            p(&from),
            "--in",
            p(&batch),
            "--out-model",
            p(&nowhere),
        ],
        "is a value model (a critic); train it with update --critic",
    );
    input_error(
        "ref-logprob",
        &[
            "--model",
            p(&from),
            "--in",
            p(&batch),
            "--out",
            p(&nowhere),
            "--column",
            "ref_logprobs",
        ],
        "is a value model (a critic)",
    );
    assert!(!nowhere.exists());
}

// ---------------------------------------------------------------------------------------------
// The pipeline with a [critic]

use crate::pipeline::{
    assert_ok, checkpoint_files_in, jsonl_sans_time, real_bins, running_child, stage_done, text,
    PIPELINE,
};
use std::process::Command;
use std::time::Duration;

const PPO_SPEC: &str = r#"
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
# A reward the random model earns now and then (a letter anywhere), so the critic has
# returns to learn.
reward = "regex:[a-z]"
format-score = 0.5
[advantage]
estimator = "gae"
lam = 0.95
[update]
lr = 0.001
[critic]
critic-warmup = 1
lr = 0.002
ppo-epochs = 2
mini-batch-size = 8
[checkpoint]
every = 2
keep-last = 1
"#;

/// PPO with a critic through the real stages: step 1 trains the critic only (critic-warmup),
/// every step writes `critic/step-K` (pruned as `ckpt/`), the metrics carry verl's
/// `critic/*` names; SIGKILL while `values` runs, after the critic's update, and while it
/// runs, then a rerun, ends with the critic's and the policy's checkpoints bit for bit as an
/// uninterrupted run's.
#[test]
fn ppo_with_a_critic_resumes_after_sigkill_to_identical_checkpoints() {
    let bins = real_bins();
    assert!(bins.join("values").is_file());
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 40);
    std::fs::write(d.join("spec.toml"), PPO_SPEC).unwrap();
    let cmd = |run: &str| {
        let mut c = Command::new(PIPELINE);
        c.current_dir(d)
            .args(["run", "spec.toml", "--run-dir", run])
            .env("TANDEM_BIN_DIR", &bins);
        c
    };
    let o = cmd("a").output().unwrap();
    assert_ok(&o);
    let (a, b) = (d.join("a"), d.join("b"));
    // Step 1 trained the critic only: no policy checkpoint, the critic's there.
    let rows = jsonl_sans_time(&a.join("metrics.jsonl"));
    assert_eq!(rows.len(), 3);
    assert!(rows[0].get("update/loss").is_none(), "{}", rows[0]);
    for r in &rows {
        for k in [
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/vf_explained_var",
            "critic/grad_norm",
            "critic/lr",
        ] {
            assert!(r[k].is_number(), "{k} missing: {r}");
        }
    }
    assert!(rows[1]["update/pg_loss"].is_number(), "{}", rows[1]);
    // The critic started at zero (step 1's values) and moved.
    let v1 = f32_rows(&read(&a.join("step-0001/values.parquet")), "values");
    assert!(v1.iter().flatten().all(|&v| v == 0.0) && !v1[0].is_empty());
    let v3 = f32_rows(&read(&a.join("step-0003/values.parquet")), "values");
    assert!(v3.iter().flatten().any(|&v| v != 0.0));
    let critics = checkpoint_files_in(&a, "critic");
    assert!(
        critics.contains_key("step-0002/optimizer.safetensors")
            && critics.contains_key("step-0003/model.safetensors")
    );
    assert!(
        !critics.keys().any(|k| k.starts_with("step-0001/")),
        "pruned: {:?}",
        critics.keys()
    );
    let log = std::fs::read_to_string(a.join("commands.sh")).unwrap();
    assert!(log.contains("values --model model"), "{log}");
    assert!(log.contains("update --model a/critic/step-0001 --in a/step-0002/adv.parquet --out-model a/critic/step-0002"), "{log}");

    let kill_when = |what: &str, cond: &mut dyn FnMut(u32) -> bool| {
        crate::pipeline::kill_when(cmd("b"), what, cond)
    };
    kill_when("step 2 values running", &mut |pid| {
        running_child(pid, "--out b/step-0002/values.parquet")
    });
    kill_when("step 2 critic recorded", &mut |_| {
        stage_done(&b, 2, "critic")
    });
    kill_when("step 3 critic update running", &mut |pid| {
        running_child(pid, "--out-model b/critic/step-0003")
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!b.join("critic/step-0003").exists());
    let o = cmd("b").output().unwrap();
    assert_ok(&o);
    assert!(
        text(&o).contains("pipeline: continuing b after step 2"),
        "{}",
        text(&o)
    );
    crate::pipeline::assert_runs_end_alike(&a, &b, &["critic", "ckpt"]);
}

/// Up front: `estimator = "gae"` without a `[critic]` stops before step 0 runs (exit 2, naming
/// the key and the fix), and so does a `[critic]` that GAE would not read.
#[test]
fn gae_without_a_critic_is_refused_before_anything_runs() {
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 40);
    let run = |spec: &str| {
        std::fs::write(d.join("spec.toml"), spec).unwrap();
        Command::new(PIPELINE)
            .current_dir(d)
            .args(["run", "spec.toml", "--run-dir", "r"])
            .env("TANDEM_BIN_DIR", &bins)
            .output()
            .unwrap()
    };
    let no_critic =
        PPO_SPEC.split("[critic]").next().unwrap().to_string() + "[checkpoint]\nevery = 2\n";
    let o = run(&no_critic);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("[advantage] estimator = \"gae\" needs a critic's values, and the spec has no [critic]: add a [critic] table"), "{}", text(&o));
    assert!(!d.join("r/step-0001").exists() && !d.join("r/policy").exists());
    let o = run(&PPO_SPEC.replace("estimator = \"gae\"\nlam = 0.95", "estimator = \"grpo\""));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("[critic]: only [advantage] estimator = \"gae\" reads a critic's values"),
        "{}",
        text(&o)
    );
}

/// The demo's task (pipelines/demo.sh: one-digit addition, a random model after a short SFT)
/// with PPO and GAE (pipelines/demo-ppo.toml), shortened to 50 steps: the reward rises.
/// Measured: mean reward 0.086 over steps 1-10, 0.208 over steps 41-50 (+0.12); the test asks
/// for half of that rise.
#[test]
fn the_demo_task_learns_with_ppo_and_gae() {
    let bin = std::path::Path::new(PIPELINE).parent().unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(work.path())
        .args(["--steps", "50"])
        .env("DEMO_SPEC", "demo-ppo.toml")
        .output()
        .unwrap();
    assert_ok(&out);
    let rows = jsonl_sans_time(&work.path().join("run/metrics.jsonl"));
    assert_eq!(rows.len(), 50);
    let reward: Vec<f64> = rows
        .iter()
        .map(|r| r["reward/mean"].as_f64().unwrap())
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&reward[..10]), mean(&reward[40..]));
    eprintln!("PPO + GAE reward: first 10 steps {first:.3}, last 10 steps {last:.3}");
    assert!(
        last > first + 0.06,
        "reward did not rise: first 10 steps {first:.3}, last 10 {last:.3}"
    );
    // The critic learned something: its values are no longer the zero head's.
    assert!(
        rows[49]["critic/vpred_mean"].as_f64().unwrap().abs() > 0.01,
        "{}",
        rows[49]
    );
}

/// Step metrics that do not depend on where the compute ran: not the timings, nor what only
/// the daemon reports, nor whether an update wrote its weights (resident between checkpoints).
fn comparable_metrics(run: &std::path::Path) -> Vec<serde_json::Value> {
    let mut rows = jsonl_sans_time(&run.join("metrics.jsonl"));
    for r in &mut rows {
        r.as_object_mut()
            .unwrap()
            .retain(|k, _| !(k.contains("daemon") || k.ends_with("_saved")));
    }
    rows
}

/// With `daemon = true` the critic's stages go to the warm daemon too, which keeps the critic
/// beside the policy (`update --critic --resident` at step 1; files at step 2, on the cadence,
/// and at step 3, the last): the run ends with the same checkpoints, values and metrics, bit
/// for bit, as in-process. A daemon SIGKILLed in step 2's critic update, while step 1's critic
/// lived only in its memory, sends the run back to step 0 and it ends the same; so does a
/// runner SIGKILLed in step 2 (its daemon dies with it).
#[test]
fn a_critic_on_the_warm_daemon_matches_in_process_and_survives_its_death() {
    use tandem::daemon::resident::{KILL_AT_STEP_ENV, KILL_IN_UPDATE_ENV};
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 40);
    std::fs::write(d.join("plain.toml"), PPO_SPEC).unwrap();
    let warm = PPO_SPEC.replace("steps = 3", "steps = 3\ndaemon = true");
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
    let line = |needle: &str| {
        commands
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle}: {commands}"))
            .to_string()
    };
    let critic1 = line("--out-model w/critic/step-0001");
    assert!(critic1.contains("--daemon") && critic1.contains("--resident"));
    assert!(!line("--out-model w/critic/step-0002").contains("--resident"));
    assert!(line("--out w/step-0002/values.parquet").contains("--daemon w/daemon.sock"));
    // The daemon held the critic: its job metrics say what it kept.
    let m: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(w.join("step-0003/metrics/critic.json")).unwrap(),
    )
    .unwrap();
    assert!(m.to_string().contains("critic_memory_held"), "{m}");

    // k: the daemon SIGKILLed in step 2's critic update (the critic's second update).
    let marker = d.join("killed");
    let o = cmd("warm.toml", "k")
        .env(KILL_IN_UPDATE_ENV, &marker)
        .env(KILL_AT_STEP_ENV, "2")
        .output()
        .unwrap();
    assert_ok(&o);
    assert!(marker.exists(), "the daemon was never killed");
    assert!(
        text(&o).contains("the policy and critic after step 1 (weights and optimizer state) were only in the daemon's memory; going back to step 0"),
        "{}",
        text(&o)
    );
    // r: the runner SIGKILLed in step 2, step 1's critic resident.
    let r = d.join("r");
    crate::pipeline::kill_when(cmd("warm.toml", "r"), "step 2 values recorded", &mut |_| {
        stage_done(&r, 2, "values")
    });
    assert!(r.join("critic/step-0001/resident.json").is_file());
    let o = cmd("warm.toml", "r").output().unwrap();
    assert_ok(&o);
    assert!(text(&o).contains("going back to step 0"), "{}", text(&o));

    let a = d.join("a");
    for run in [&w, &d.join("k"), &r] {
        for sub in ["critic", "ckpt"] {
            let (ca, cb) = (checkpoint_files_in(&a, sub), checkpoint_files_in(run, sub));
            assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
            for (k, v) in &ca {
                assert!(v == &cb[k], "{sub}/{k} differs in {}", run.display());
            }
        }
        for step in 1..=3 {
            let f = format!("step-{step:04}/values.parquet");
            assert_eq!(
                f32_rows(&read(&a.join(&f)), "values"),
                f32_rows(&read(&run.join(&f)), "values"),
                "{f} in {}",
                run.display()
            );
        }
        let (ma, mb) = (comparable_metrics(&a), comparable_metrics(run));
        assert_eq!(ma.len(), mb.len());
        for (ra, rb) in ma.iter().zip(&mb) {
            let (ra, rb) = (ra.as_object().unwrap(), rb.as_object().unwrap());
            assert_eq!(ra.keys().collect::<Vec<_>>(), rb.keys().collect::<Vec<_>>());
            for (k, va) in ra {
                let vb = &rb[k];
                // The weights are bit-identical (above), and so is every critic metric; the
                // policy's loss, a sum to ~1e-9 of terms of both signs, differs on the daemon
                // in its last bit at step 3 (1.6508533429160362e-9 against ...036e-9).
                let same = match (va.as_f64(), vb.as_f64(), k.ends_with("loss")) {
                    (Some(x), Some(y), true) if k.starts_with("update/") => {
                        (x - y).abs() <= 1e-12 * x.abs().max(1e-12)
                    }
                    _ => va == vb,
                };
                assert!(same, "{k}: {va} vs {vb} in {}", run.display());
            }
        }
    }
}

/// `gpus = 2` (CPU ranks): PPO with the critic runs end to end in-process (`values`, the
/// critic's and the policy's updates under `tandem launch`, the rows split over the ranks)
/// and on a daemon group (the critic kept on both ranks, its optimizer state sharded as the
/// policy's, under zero2 and `--shard full`). The first step's values and returns are the
/// 1-process run's; the group ends with the 2-rank in-process run's checkpoints bit for bit,
/// also after rank 1 SIGKILLed itself in step 2's critic update (step 1's critic resident:
/// the run goes back to step 0).
#[test]
fn ppo_with_a_critic_runs_on_two_ranks_and_on_a_daemon_group() {
    use tandem::daemon::resident::{KILL_AT_STEP_ENV, KILL_IN_UPDATE_ENV};
    let bins = real_bins();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    crate::stage_util::model_and_train_set(d, 64, 128, 40);
    let spec = |extra: &str| PPO_SPEC.replace("steps = 3", &format!("steps = 3\n{extra}"));
    let run = |name: &str, spec: String, env: &[(&str, &std::path::Path)]| {
        std::fs::write(d.join(format!("{name}.toml")), spec).unwrap();
        let mut c = Command::new(PIPELINE);
        c.current_dir(d)
            .args(["run", &format!("{name}.toml"), "--run-dir", name])
            .env("TANDEM_BIN_DIR", &bins)
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("WORLD_SIZE")
            .env_remove("RANK")
            .env_remove("TANDEM_DAEMON");
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        assert_ok(&o);
        text(&o)
    };
    run("one", spec(""), &[]);
    run("two", spec("gpus = 2"), &[]);
    run("group", spec("gpus = 2\ndaemon = true"), &[]);
    // Both models' weights sharded too (`--shard full`).
    let full = spec("gpus = 2\ndaemon = true")
        .replace("lr = 0.001\n", "lr = 0.001\nshard = \"full\"\n")
        .replace(
            "critic-warmup = 1\n",
            "critic-warmup = 1\nshard = \"full\"\n",
        );
    run("full", full, &[]);
    let marker = d.join("kill-marker");
    let out = run(
        "killed",
        spec("gpus = 2\ndaemon = true"),
        &[
            (KILL_IN_UPDATE_ENV, &marker),
            ("TANDEM_DAEMON_KILL_RANK", std::path::Path::new("1")),
            (KILL_AT_STEP_ENV, std::path::Path::new("2")),
        ],
    );
    assert!(marker.exists(), "rank 1 was never killed");
    let log = std::fs::read_to_string(d.join("killed/pipeline.log")).unwrap();
    assert!(out.contains("going back to step 0"), "{out}\n{log}");

    let commands = std::fs::read_to_string(d.join("two/commands.sh")).unwrap();
    for needle in [
        "--out two/step-0001/values.parquet",
        "--out-model two/critic/step-0001",
    ] {
        let line = commands.lines().find(|l| l.contains(needle)).unwrap();
        assert!(line.contains("launch --nproc-per-node 2"), "{line}");
    }
    // Step 1's values (the zero head) and returns are the 1-process run's.
    for col in ["values", "returns"] {
        let f = "step-0001/adv.parquet";
        assert_eq!(
            f32_rows(&read(&d.join("one").join(f)), col),
            f32_rows(&read(&d.join("two").join(f)), col),
            "{col}"
        );
    }
    for other in ["group", "full", "killed"] {
        for sub in ["critic", "ckpt"] {
            let (ca, cb) = (
                checkpoint_files_in(&d.join("two"), sub),
                checkpoint_files_in(&d.join(other), sub),
            );
            let weights = |c: &std::collections::BTreeMap<String, Vec<u8>>| {
                c.iter()
                    .filter(|(k, _)| k.ends_with("model.safetensors"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Vec<_>>()
            };
            assert!(weights(&ca) == weights(&cb), "{other}: {sub} differs");
        }
    }
}

/// A warm daemon on the CPU, killed when dropped.
struct CpuDaemon(std::process::Child);

impl Drop for CpuDaemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tandem daemon-ctl --socket S CMD`.
fn daemon_ctl(socket: &std::path::Path, cmd: &str) -> std::process::Output {
    Command::new(crate::stage_util::bin("tandem"))
        .args(["daemon-ctl", "--socket", p(socket), cmd])
        .output()
        .unwrap()
}

/// `values` and `update --critic` sent to the warm daemon write the very files in-process
/// stages write (values batches, checkpoints byte for byte; the update's metrics but the
/// timings and the daemon's own): the daemon keeps the critic between the calls (loaded once,
/// from the policy's model with a zero head), and with `--resident` it serves the critic the
/// next `values` reads from memory, whose values are the ones of the in-process checkpoint.
/// `status` reports the critic it holds.
#[test]
fn values_and_the_critic_update_on_the_daemon_write_what_in_process_writes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let policy = tiny_model(d, 4);
    let plain = d.join("plain.parquet");
    let responses = [vec![40, 41, 42], vec![50, 51], vec![60, 61, 62, 63]];
    training_batch(&plain, &[10, 20, 30], &responses, &[1.0, -1.0, 1.0]);
    let returns = vec![
        vec![1.0, 0.8, 0.6],
        vec![-0.5, -0.25],
        vec![0.9, 0.9, 1.0, 1.0],
    ];
    let ret = d.join("ret.parquet");
    with_f32_rows(&plain, &ret, "returns", &returns);
    let w = d.join("w");
    let socket = d.join("daemon.sock");
    // Two critic steps (values, then the update on them), then the last values; with a
    // daemon, the third update keeps the critic resident.
    let flow = |socket: Option<&std::path::Path>| {
        std::fs::create_dir_all(&w).unwrap();
        let daemon = socket.is_some();
        let mut extra: Vec<&str> = Vec::new();
        if let Some(socket) = socket {
            extra.extend(["--daemon", p(socket)]);
        }
        let f = |name: &str| p(&w.join(name)).to_string();
        let mut model = p(&policy).to_string();
        for step in 1..=3 {
            let v = f(&format!("v{step}.parquet"));
            let mut a = vec!["--model", &model, "--in", p(&ret), "--out", &v];
            a.extend(&extra);
            ok("values", &a);
            let c = f(&format!("c{step}"));
            let m = f(&format!("u{step}.json"));
            let mut a = vec![
                "--critic",
                "--model",
                &model,
                "--in",
                &v,
                "--out-model",
                &c,
                "--metrics",
                &m,
                "--lr",
                "2e-3",
                "--mini-batch-size",
                "2",
                "--shuffle",
                "--seed",
                "7",
            ];
            a.extend(&extra);
            if daemon && step == 3 {
                a.push("--resident");
            }
            ok("update", &a);
            model = c;
        }
        let v4 = f("v4.parquet");
        let mut a = vec!["--model", &model, "--in", p(&ret), "--out", &v4];
        a.extend(&extra);
        ok("values", &a);
    };
    flow(None);
    std::fs::rename(&w, d.join("a")).unwrap();
    let daemon = cpu_daemon(&socket, &policy, &[]);
    flow(Some(&socket));
    let a = d.join("a");
    let same = |f: &str| {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(w.join(f)).unwrap(),
        );
        assert!(x == y, "{f}: in-process and daemon files differ");
    };
    for f in ["v1.parquet", "v2.parquet", "v3.parquet"] {
        same(f);
    }
    for c in ["c1", "c2"] {
        for f in [
            "model.safetensors",
            "optimizer.safetensors",
            "trainer_state.json",
            "config.json",
        ] {
            same(&format!("{c}/{f}"));
        }
    }
    // c3 stayed in the daemon's memory: a directory that names it, and the values read from it
    // are the in-process checkpoint's.
    assert!(w.join("c3/resident.json").is_file() && !w.join("c3/model.safetensors").exists());
    assert_eq!(
        f32_rows(&read(&a.join("v4.parquet")), "values"),
        f32_rows(&read(&w.join("v4.parquet")), "values")
    );
    assert!(f32_rows(&read(&w.join("v4.parquet")), "values")[0][0] != 0.0);
    for u in ["u1.json", "u2.json", "u3.json"] {
        let j = |dir: &std::path::Path| {
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join(u)).unwrap()).unwrap();
            let m = v.as_object_mut().unwrap();
            m.retain(|k, _| {
                !(k == "daemon"
                    || k.ends_with("_saved")
                    || k.ends_with("seconds")
                    || k.ends_with("_s")
                    || k.ends_with("per_s")
                    || k.starts_with("time"))
            });
            v
        };
        assert_eq!(j(&a), j(&w), "{u}");
    }
    let status = daemon_ctl(&socket, "status");
    assert!(status.status.success());
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let s = &s["resident"];
    let critic = &s["critic"];
    assert_eq!(critic["schedule_step"], 3, "{s}");
    assert_eq!(critic["in_files"], false, "{s}");
    assert!(critic["memory_held"].is_number(), "{s}");
    assert!(s["phases"]["values"]["runs"].as_u64() == Some(4), "{s}");
    drop(daemon);
    // With --offload-optimizer the critic's moments wait in host memory between its updates:
    // the same values and checkpoints.
    std::fs::remove_dir_all(&w).unwrap();
    let socket = d.join("offload.sock");
    let _offloaded = cpu_daemon(&socket, &policy, &["--offload-optimizer"]);
    flow(Some(&socket));
    for f in ["v1.parquet", "v2.parquet", "v3.parquet"] {
        same(f);
    }
    for c in ["c1", "c2"] {
        same(&format!("{c}/model.safetensors"));
        same(&format!("{c}/optimizer.safetensors"));
    }
    assert_eq!(
        f32_rows(&read(&a.join("v4.parquet")), "values"),
        f32_rows(&read(&w.join("v4.parquet")), "values")
    );
}

/// A CPU daemon on `socket` holding `policy`, started with `extra` flags, once it answers.
fn cpu_daemon(socket: &std::path::Path, policy: &std::path::Path, extra: &[&str]) -> CpuDaemon {
    let daemon = CpuDaemon(
        Command::new(crate::stage_util::bin("tandem"))
            .args(["daemon", "--device", "cpu", "--socket", p(socket)])
            .args(["--policy", p(policy)])
            .args(extra)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t0 = std::time::Instant::now();
    while !daemon_ctl(socket, "health").status.success() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the daemon never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    daemon
}
