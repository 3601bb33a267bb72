//! Model files against the HF fixtures (tests/fixtures/hf/, written by transformers, see
//! make_hf_fixtures.py), save/load round trips, and the `tandem init-model` / `model-info` CLI.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::error::is_input_error;
use tandem::model::names::{expected_tensors, LM_HEAD};
use tandem::model::safetensors::{self as st, round_bf16, INDEX_FILE};
use tandem::model::{Arch, Config, ModelDir, SaveOptions, Tensor, Weights};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn expected_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A writable copy of a fixture directory.
fn copy_fixture(name: &str, into: &Path) -> PathBuf {
    let dst = into.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn bf16_rounded(t: &Tensor) -> Vec<f32> {
    t.data.iter().map(|x| round_bf16(*x)).collect()
}

fn fixture_config(name: &str) -> Config {
    let base = Config {
        arch: Arch::Qwen2,
        vocab_size: 320,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rope_theta: 1e6,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        max_position_embeddings: 512,
        bos_token_id: None,
        // config.json's 258 (<|im_end|>) then generation_config.json's 256 (<|endoftext|>).
        eos_token_ids: vec![258, 256],
        value_head: false,
    };
    match name {
        "qwen2" => Config {
            vocab_size: 336,
            qkv_bias: true,
            ..base
        },
        "llama" => Config {
            arch: Arch::Llama,
            rope_theta: 1e4,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            bos_token_id: Some(256),
            ..base
        },
        "qwen3" => Config {
            arch: Arch::Qwen3,
            head_dim: 32,
            qk_norm: true,
            ..base
        },
        _ => unreachable!(),
    }
}

const FIXTURES: [&str; 3] = ["qwen2", "llama", "qwen3"];

#[test]
fn fixture_configs_load_exactly() {
    for name in FIXTURES {
        let (cfg, _) = ModelDir::load(&fixture(name)).unwrap();
        assert_eq!(cfg, fixture_config(name), "{name}");
    }
}

#[test]
fn fixture_weights_are_what_torch_reads() {
    for name in FIXTURES {
        let info = ModelDir::inspect(&fixture(name)).unwrap();
        let weights = &info.loaded.weights;
        let exp = expected_json(name);
        let dtype = format!("{:?}", info.loaded.dtypes[tandem::model::names::EMBED]);
        let want_dtype = match exp["stored_dtype"].as_str().unwrap() {
            "bfloat16" => "BF16",
            "float16" => "F16",
            "float32" => "F32",
            other => panic!("{other}"),
        };
        assert_eq!(dtype, want_dtype, "{name}");
        let tensors = exp["tensors"].as_object().unwrap();
        for (tname, check) in tensors {
            // HF's state dict lists a tied lm_head; it is the embedding.
            let key = if tname == LM_HEAD && info.config.tie_word_embeddings {
                tandem::model::names::EMBED
            } else {
                tname.as_str()
            };
            let t = &weights[key];
            let shape: Vec<usize> = check["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(t.shape, shape, "{name} {tname}");
            let vals = |k: &str| -> Vec<f32> {
                check[k]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect()
            };
            assert_eq!(&t.data[..4], &vals("head")[..], "{name} {tname}");
            assert_eq!(
                &t.data[t.numel() - 4..],
                &vals("tail")[..],
                "{name} {tname}"
            );
            let sum: f64 = t.data.iter().map(|&x| x as f64).sum();
            let abs_sum: f64 = t.data.iter().map(|&x| (x as f64).abs()).sum();
            let want_abs = check["abs_sum"].as_f64().unwrap();
            assert!(
                (abs_sum - want_abs).abs() <= 1e-9 * want_abs,
                "{name} {tname}"
            );
            assert!(
                (sum - check["sum"].as_f64().unwrap()).abs() <= 1e-9 * want_abs,
                "{name} {tname}"
            );
        }
        // Every tensor torch has, we have (a tied lm_head aside), and no more.
        let ours: BTreeSet<&String> = weights.keys().collect();
        let theirs: BTreeSet<&String> = tensors
            .keys()
            .filter(|k| !(info.config.tie_word_embeddings && *k == LM_HEAD))
            .collect();
        assert_eq!(ours, theirs, "{name}");
    }
}

#[test]
fn tensor_names_follow_hf_state_dict_order() {
    for name in FIXTURES {
        let exp = expected_json(name);
        let cfg = fixture_config(name);
        let hf: Vec<&str> = exp["state_dict_order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .filter(|n| !(cfg.tie_word_embeddings && *n == LM_HEAD))
            .collect();
        let ours: Vec<String> = expected_tensors(&cfg).into_iter().map(|s| s.name).collect();
        assert_eq!(ours, hf, "{name}");
    }
}

#[test]
fn sharded_save_writes_the_index_transformers_writes() {
    // The llama fixture was saved by transformers with max_shard_size="60KB" (60,000 bytes) in
    // f16; bf16 has the same size, so our save with the same limit must split identically.
    let (cfg, weights) = ModelDir::load(&fixture("llama")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let src = fixture("llama");
    let opts = SaveOptions {
        tokenizer_from: Some(&src),
        config_base: Some(&src),
        max_shard_bytes: 60_000,
        extra_files: &[],
        move_in: &[],
    };
    ModelDir::save_with(&out, &cfg, &weights, &opts).unwrap();
    let ours = std::fs::read_to_string(out.join(INDEX_FILE)).unwrap();
    let theirs = std::fs::read_to_string(fixture("llama").join(INDEX_FILE)).unwrap();
    assert_eq!(ours, theirs);
    let (cfg2, back) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg2, cfg);
    for (k, t) in &weights {
        assert_eq!(back[k].data, bf16_rounded(t), "{k}");
    }
    assert!(!tmp.path().join("out.tmp").exists());
}

#[test]
fn save_load_round_trip_is_exact_up_to_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let (cfg, weights) = ModelDir::load(&fixture(name)).unwrap();
        let out = tmp.path().join(name);
        ModelDir::save(&out, &cfg, &weights, Some(&fixture(name))).unwrap();
        let (cfg2, back) = ModelDir::load(&out).unwrap();
        assert_eq!(cfg2, cfg, "{name}");
        assert_eq!(back.len(), weights.len());
        for (k, t) in &weights {
            assert_eq!(back[k].shape, t.shape, "{name} {k}");
            assert_eq!(back[k].data, bf16_rounded(t), "{name} {k}");
        }
        // bf16 fixtures come back bit for bit.
        if name == "qwen2" {
            assert_eq!(back, weights);
        }
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            assert_eq!(
                std::fs::read(out.join(f)).unwrap(),
                std::fs::read(fixture(name).join(f)).unwrap(),
                "{name} {f}"
            );
        }
        // Foreign keys of the source config survive; ours are rewritten in 4.x form.
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["transformers_version"], "5.23.0");
        assert_eq!(written["torch_dtype"], "bfloat16");
        assert!(written.get("rope_parameters").is_none());
    }
}

#[test]
fn small_shard_limit_round_trips_and_indexes_every_tensor() {
    let (cfg, weights) = ModelDir::load(&fixture("qwen3")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let opts = SaveOptions {
        tokenizer_from: None,
        config_base: None,
        max_shard_bytes: 20_000,
        extra_files: &[],
        move_in: &[],
    };
    ModelDir::save_with(&out, &cfg, &weights, &opts).unwrap();
    let map = st::read_index(&out.join(INDEX_FILE)).unwrap();
    let listed: BTreeSet<&String> = map.keys().collect();
    let all: BTreeSet<&String> = weights.keys().collect();
    assert_eq!(listed, all);
    let shards: BTreeSet<&String> = map.values().collect();
    assert!(shards.len() > 5, "{} shards", shards.len());
    let n = shards.len();
    for (k, s) in shards.iter().enumerate() {
        assert_eq!(**s, format!("model-{:05}-of-{n:05}.safetensors", k + 1));
        // Within the limit, except a tensor over it alone (the 320x64 embedding, 40,960 bytes).
        let inside: Vec<&String> = map.iter().filter(|(_, f)| f == s).map(|(t, _)| t).collect();
        let bytes: usize = inside.iter().map(|t| 2 * weights[*t].numel()).sum();
        assert!(bytes <= 20_000 || inside.len() == 1, "{s}: {inside:?}");
    }
    assert!(!out.join("model.safetensors").exists());
    let (_, back) = ModelDir::load(&out).unwrap();
    for (k, t) in &weights {
        assert_eq!(back[k].data, bf16_rounded(t), "{k}");
    }
}

#[test]
fn save_replaces_an_existing_model_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let (cfg, weights) = ModelDir::load(&fixture("qwen3")).unwrap();
    let opts = SaveOptions {
        tokenizer_from: None,
        config_base: None,
        max_shard_bytes: 20_000,
        extra_files: &[],
        move_in: &[],
    };
    ModelDir::save_with(&out, &cfg, &weights, &opts).unwrap();
    // Saving unsharded over a sharded model leaves no stale shards behind.
    ModelDir::save(&out, &cfg, &weights, None).unwrap();
    let names: BTreeSet<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let want: BTreeSet<String> = ["config.json", "generation_config.json", "model.safetensors"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(names, want);
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("m")]);
}

/// Rewrites a fixture copy's weights with `edit` applied (as bf16, one file).
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut Weights)) {
    let (_, mut w) = ModelDir::load(dir).unwrap();
    edit(&mut w);
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let n = p.file_name().unwrap().to_string_lossy().into_owned();
        if n.ends_with(".safetensors") || n == INDEX_FILE {
            std::fs::remove_file(p).unwrap();
        }
    }
    let refs: Vec<(&str, &Tensor)> = w.iter().map(|(k, t)| (k.as_str(), t)).collect();
    st::save_dir(dir, &refs, u64::MAX).unwrap();
}

fn load_err(dir: &Path) -> String {
    let e = ModelDir::load(dir).unwrap_err();
    assert!(is_input_error(&e), "{e:#}");
    format!("{e:#}")
}

#[test]
fn weights_must_match_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("llama", tmp.path());
    rewrite_weights(&dir, |w| {
        w.remove("model.layers.1.mlp.up_proj.weight");
    });
    let msg = load_err(&dir);
    assert!(
        msg.contains("model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
        "{msg}"
    );

    let dir = copy_fixture("qwen2", &tmp.path().join("b"));
    rewrite_weights(&dir, |w| {
        w.insert(
            "model.layers.0.mlp.extra.weight".into(),
            Tensor::zeros(vec![2]),
        );
    });
    let msg = load_err(&dir);
    assert!(
        msg.contains("unexpected tensor 'model.layers.0.mlp.extra.weight'"),
        "{msg}"
    );

    // A config whose ffn disagrees with the weights: the message names tensor, file and shapes.
    let dir = copy_fixture("qwen3", &tmp.path().join("c"));
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        text.replace("\"intermediate_size\": 96", "\"intermediate_size\": 100"),
    )
    .unwrap();
    let msg = load_err(&dir);
    assert!(
        msg.contains("model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64], but")
            && msg.contains("config.json implies [100, 64]"),
        "{msg}"
    );

    // What HF itself ignores we ignore: a tied model's saved lm_head, rotary inv_freq buffers.
    let dir = copy_fixture("qwen2", &tmp.path().join("d"));
    rewrite_weights(&dir, |w| {
        let embed = w[tandem::model::names::EMBED].clone();
        w.insert(LM_HEAD.into(), embed);
        w.insert(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Tensor::zeros(vec![8]),
        );
    });
    let (_, w) = ModelDir::load(&dir).unwrap();
    assert!(!w.contains_key(LM_HEAD));
    assert_eq!(w.len(), expected_tensors(&fixture_config("qwen2")).len());
}

#[test]
fn init_model_is_reproducible_and_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |seed: &str, out: &str| {
        let out = tmp.path().join(out);
        let o = tandem(&[
            "init-model",
            "--like",
            "qwen3",
            "--layers",
            "2",
            "--hidden",
            "48",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--ffn",
            "80",
            "--vocab",
            "400",
            "--seed",
            seed,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        out
    };
    let a = run("5", "a");
    let b = run("5", "b");
    let c = run("6", "c");
    let files = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    for f in files {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    assert_ne!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(c.join("model.safetensors")).unwrap()
    );
    assert_eq!(
        std::fs::read(a.join("config.json")).unwrap(),
        std::fs::read(c.join("config.json")).unwrap()
    );

    let (cfg, w) = ModelDir::load(&a).unwrap();
    assert_eq!(cfg.arch, Arch::Qwen3);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_kv_heads,
            cfg.vocab_size
        ),
        (48, 16, 2, 400)
    );
    assert_eq!(
        (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings),
        (1e6, 1e-6, true)
    );
    assert_eq!(cfg.eos_token_ids, vec![258, 256]);
    assert_eq!(
        w["model.layers.0.self_attn.q_proj.weight"].shape,
        vec![64, 48]
    );
    assert!(w["model.layers.1.self_attn.k_norm.weight"]
        .data
        .iter()
        .all(|&x| x == 1.0));
    let e = &w[tandem::model::names::EMBED].data;
    let std = (e.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / e.len() as f64).sqrt();
    assert!((std - 0.02).abs() < 0.001, "{std}");
    let tok = tokenizers::Tokenizer::from_file(a.join("tokenizer.json")).unwrap();
    assert_eq!(tok.get_vocab_size(true), 400);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(258));
}

#[test]
fn init_model_with_a_tokenizer_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let o = tandem(&[
        "init-model",
        "--like",
        "llama",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--ffn",
        "64",
        "--tokenizer",
        fixture("llama").to_str().unwrap(),
        "--tie",
        "true",
        "--rope-theta",
        "5000",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (cfg, w) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg.vocab_size, 320);
    assert_eq!(
        (
            cfg.arch,
            cfg.tie_word_embeddings,
            cfg.rope_theta,
            cfg.rms_norm_eps
        ),
        (Arch::Llama, true, 5000.0, 1e-5)
    );
    assert_eq!(cfg.eos_token_ids, vec![258, 256]);
    assert_eq!(cfg.bos_token_id, Some(256));
    assert!(!w.contains_key(LM_HEAD));
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(fixture("llama").join("tokenizer.json")).unwrap()
    );
    // The random model owes nothing to the tokenizer directory's config.
    let written = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(!written.contains("transformers_version"), "{written}");
}

#[test]
fn init_model_bad_flags_exit_2_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let o_s = out.to_str().unwrap();
    let base = [
        "init-model",
        "--like",
        "qwen2",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--ffn",
        "64",
    ];
    let llama = fixture("llama");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--kv-heads", "3", "--vocab", "300"],
            "--kv-heads 3 must be positive and divide --heads 4",
        ),
        (vec!["--vocab", "100"], "needs at least 259"),
        (vec![], "--vocab is required when no --tokenizer is given"),
        (
            vec!["--head-dim", "7", "--vocab", "300"],
            "--head-dim 7 must be positive and even",
        ),
        (
            vec!["--vocab", "300", "--rope-theta", "0"],
            "--rope-theta must be a positive number",
        ),
        (
            vec!["--tokenizer", "/nonexistent/tok"],
            "/nonexistent/tok/tokenizer.json: not found",
        ),
        (
            vec!["--tokenizer", llama.to_str().unwrap(), "--vocab", "300"],
            "smaller than the tokenizer",
        ),
        (
            vec!["--vocab", "300", "--tie", "maybe"],
            "invalid value 'maybe'",
        ),
    ];
    for (extra, want) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend(extra);
        args.extend(["--out", o_s]);
        let o = tandem(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(
            !out.exists() && !tmp.path().join("m.tmp").exists(),
            "{args:?}"
        );
    }
    let o = tandem(&[
        "init-model",
        "--like",
        "gpt2",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--ffn",
        "64",
        "--vocab",
        "300",
        "--out",
        o_s,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("possible values: qwen2, llama, qwen3"),
        "{}",
        stderr(&o)
    );
    // An existing directory is not replaced without --force.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "x").unwrap();
    let mut args = base.to_vec();
    args.extend(["--vocab", "300", "--out", o_s]);
    let o = tandem(&args);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("already exists (give --force to replace it)"),
        "{}",
        stderr(&o)
    );
    assert!(out.join("keep.txt").exists());
    args.push("--force");
    let o = tandem(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.join("keep.txt").exists() && out.join("model.safetensors").exists());
}

#[test]
fn model_info_summarises_a_directory() {
    let o = tandem(&["model-info", fixture("qwen3").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    for want in [
        "architecture: Qwen3ForCausalLM (qwen3)",
        "layers 2, hidden 64, heads 4 (kv 2, head_dim 32), ffn 96, vocab 320",
        "eos: [258, 256]",
        "weights: model.safetensors [F32 (",
        "tokenizer: tokenizer.json (320 tokens)",
        "model.layers.*.self_attn.q_norm.weight",
        "[128, 64] F32",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    // 320x64 embed + 2 layers of (128+64+64)x64 q/k/v + 64x128 o + 2x32 qk norms + 3x96x64 mlp
    // + 2x64 norms, + final norm.
    let per_layer = 256 * 64 + 64 * 128 + 64 + 3 * 96 * 64 + 128;
    let params = 320 * 64 + 2 * per_layer + 64;
    assert!(text.contains(&format!("parameters: {params} ")), "{text}");
    let o = tandem(&[
        "model-info",
        "--tensors",
        fixture("llama").to_str().unwrap(),
    ]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(
        text.contains("model-00001-of-00004.safetensors, model-00002-of-00004.safetensors"),
        "{text}"
    );
    assert!(
        text.contains("model.layers.1.self_attn.k_proj.weight") && text.contains("F16"),
        "{text}"
    );
}

#[test]
fn model_info_bad_directories_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let check = |dir: &Path, want: &str| {
        let o = tandem(&["model-info", dir.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(want), "want {want:?}: {}", stderr(&o));
    };
    check(&tmp.path().join("nope"), "model directory not found");

    let dir = copy_fixture("qwen2", &tmp.path().join("a"));
    std::fs::remove_file(dir.join("config.json")).unwrap();
    check(&dir, "config.json: not found");

    let dir = copy_fixture("qwen2", &tmp.path().join("b"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    check(
        &dir,
        "no weights: expected model.safetensors or model.safetensors.index.json",
    );

    let dir = copy_fixture("llama", &tmp.path().join("c"));
    std::fs::remove_file(dir.join("model-00003-of-00004.safetensors")).unwrap();
    check(
        &dir,
        "lists shard 'model-00003-of-00004.safetensors', which is missing",
    );

    let dir = copy_fixture("qwen2", &tmp.path().join("d"));
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replace("Qwen2ForCausalLM", "GPT2LMHeadModel")).unwrap();
    check(&dir, "architecture 'GPT2LMHeadModel' is not supported (supported: Qwen2ForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForTokenClassification, LlamaForTokenClassification, Qwen3ForTokenClassification)");

    let dir = copy_fixture("llama", &tmp.path().join("e"));
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(
        &p,
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"),
    )
    .unwrap();
    check(
        &dir,
        "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [32, 64]",
    );
}

#[test]
fn failed_save_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, weights) = ModelDir::load(&fixture("qwen2")).unwrap();
    let src = copy_fixture("qwen2", &tmp.path().join("src"));
    std::fs::write(src.join("generation_config.json"), "{broken").unwrap();
    let out = tmp.path().join("out");
    let e = ModelDir::save(&out, &cfg, &weights, Some(&src)).unwrap_err();
    assert!(is_input_error(&e), "{e:#}");
    assert!(
        e.to_string()
            .contains("generation_config.json: invalid JSON"),
        "{e}"
    );
    assert!(!out.exists() && !tmp.path().join("out.tmp").exists());
    // A weight set that does not fit the config is refused before anything is written.
    let mut fewer = weights.clone();
    fewer.remove(tandem::model::names::FINAL_NORM);
    let e = ModelDir::save(&out, &cfg, &fewer, None).unwrap_err();
    assert!(
        e.to_string()
            .contains("tensor 'model.norm.weight' is missing"),
        "{e}"
    );
    assert!(!out.exists() && !tmp.path().join("out.tmp").exists());
}
