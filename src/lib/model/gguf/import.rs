//! `tandem import-gguf`: a GGUF file to an HF model directory (config.json,
//! generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

use super::reader::{GgufFile, TensorInfo, Value};
use crate::error::input_error;
use crate::model::config::{write_json, Arch, Config};
use crate::model::names::{self, expected_tensors};
use crate::model::tensor::{Tensor, Weights};
use crate::tokenizer::gguf::{self as tokenizer, GgufVocab, RebuiltTokenizer};
use anyhow::{Context, Result};
use half::bf16;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, View};
use serde_json::{json, Map, Value as Json};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OutDtype {
    Bf16,
    F32,
}

#[derive(clap::Args, Debug)]
pub struct ImportGgufArgs {
    /// The GGUF file (llama.cpp format, v2 or v3).
    pub(crate) file: PathBuf,
    /// Model directory to write (HF layout); replaced if it exists.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Dtype of the written weights.
    #[arg(long, value_enum, default_value_t = OutDtype::Bf16)]
    pub(crate) dtype: OutDtype,
}

pub fn run(args: ImportGgufArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let g = GgufFile::open(&args.file)?;
    let model = convert(&g)?;
    write_model_dir(&args.out, &model, args.dtype)?;
    println!(
        "imported {} ({} {}, {} layers, {} parameters, tensor types {}) to {} in {:.1}s",
        args.file.display(),
        g.get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("?"),
        g.get("general.name").and_then(Value::as_str).unwrap_or(""),
        model.config.num_layers,
        names::param_count(&model.config),
        model.type_counts.join(", "),
        args.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A GGUF model in HF terms.
pub(crate) struct Imported {
    pub(crate) config: Config,
    pub(crate) weights: Weights,
    pub(crate) tokenizer: RebuiltTokenizer,
    /// "Q4_K x12" per tensor type, for the summary line.
    pub(crate) type_counts: Vec<String>,
}

/// The HF name of a llama.cpp tensor name (`blk.N.attn_q.weight` ...).
pub(crate) fn hf_name(gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some(names::EMBED.into()),
        "output_norm.weight" => return Some(names::FINAL_NORM.into()),
        "output.weight" => return Some(names::LM_HEAD.into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("{}{hf}.{kind}", names::layer_prefix(layer)))
}

/// Undoes llama.cpp's Q/K row order for `llama` (convert_hf_to_gguf's `permute`): within each head
/// of `rows / n_head` rows, GGUF row `2i + j` is HF row `j * rows_per_head / 2 + i`.
pub(crate) fn unpermute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let per_head = rows / n_head;
    let half = per_head / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * per_head + 2 * i + j;
                let dst = h * per_head + j * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn arch_of(name: &str) -> Option<Arch> {
    match name {
        "llama" => Some(Arch::Llama),
        "qwen2" => Some(Arch::Qwen2),
        "qwen3" => Some(Arch::Qwen3),
        _ => None,
    }
}

/// config.json of the file's `{arch}.*` keys, parsed by [`Config::from_hf_json`] (which checks it).
fn config_of(g: &GgufFile, file: &str) -> Result<(Config, Map<String, Json>)> {
    let arch_name = match g.get("general.architecture") {
        Some(Value::Str(s)) => s.as_str(),
        Some(v) => crate::bail_input!("{file}: general.architecture must be a string, found {v:?}"),
        None => crate::bail_input!("{file}: metadata 'general.architecture' is missing"),
    };
    let Some(arch) = arch_of(arch_name) else {
        crate::bail_input!(
            "{file}: architecture '{arch_name}' is not supported (supported: llama, qwen2, qwen3)"
        );
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| -> Result<Option<u64>> {
        match g.get(&key(k)) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                input_error(format!(
                    "{file}: metadata '{}' must be an integer, found {v:?}",
                    key(k)
                ))
            }),
        }
    };
    let req = |k: &str| -> Result<u64> {
        int(k)?.ok_or_else(|| input_error(format!("{file}: metadata '{}' is missing", key(k))))
    };
    let float = |k: &str| -> Result<Option<f64>> {
        match g.get(&key(k)) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                input_error(format!(
                    "{file}: metadata '{}' must be a number, found {v:?}",
                    key(k)
                ))
            }),
        }
    };
    refuse_scaled_rope(g, file, &key("rope.scaling.type"))?;
    let Some(embd) = g.tensor("token_embd.weight") else {
        crate::bail_input!("{file}: tensor 'token_embd.weight' is missing");
    };
    if embd.dims.len() != 2 {
        crate::bail_input!(
            "{file}: tensor 'token_embd.weight' must be 2-D, found dims {:?}",
            embd.dims
        );
    }
    let vocab = embd.dims[1];
    let heads = req("attention.head_count")?;
    let mut m = Map::new();
    m.insert("architectures".into(), json!([arch.hf_architecture()]));
    m.insert("model_type".into(), arch.model_type().into());
    m.insert("hidden_act".into(), "silu".into());
    m.insert("vocab_size".into(), vocab.into());
    m.insert("hidden_size".into(), req("embedding_length")?.into());
    m.insert(
        "intermediate_size".into(),
        req("feed_forward_length")?.into(),
    );
    m.insert("num_hidden_layers".into(), req("block_count")?.into());
    m.insert("num_attention_heads".into(), heads.into());
    m.insert(
        "num_key_value_heads".into(),
        int("attention.head_count_kv")?.unwrap_or(heads).into(),
    );
    if let Some(d) = int("attention.key_length")? {
        m.insert("head_dim".into(), d.into());
    }
    if let Some(ctx) = int("context_length")? {
        m.insert("max_position_embeddings".into(), ctx.into());
    }
    // f32 metadata widened through its shortest decimal (1e-6, not 9.99999997e-7), as HF writes it.
    let short = |x: f64| -> f64 { format!("{}", x as f32).parse().unwrap_or(x) };
    if let Some(t) = float("rope.freq_base")? {
        m.insert("rope_theta".into(), short(t).into());
    }
    if let Some(e) = float("attention.layer_norm_rms_epsilon")? {
        m.insert("rms_norm_eps".into(), short(e).into());
    }
    m.insert(
        "tie_word_embeddings".into(),
        g.tensor("output.weight").is_none().into(),
    );
    insert_special_ids(g, &mut m);
    let cfg = Config::from_hf_json(&m, file)?;
    Ok((cfg, m))
}

/// config.json's bos and eos ids from the tokenizer's keys.
fn insert_special_ids(g: &GgufFile, m: &mut Map<String, Json>) {
    let tok_id = |k: &str| g.get(k).and_then(Value::as_u64);
    if let Some(b) = tok_id("tokenizer.ggml.bos_token_id") {
        m.insert("bos_token_id".into(), b.into());
    }
    // EOS and end-of-turn ids both end a generation (llama.cpp stops at either).
    let mut eos: Vec<u64> = vec![];
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = tok_id(k) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    match eos.as_slice() {
        [] => {}
        [one] => {
            m.insert("eos_token_id".into(), (*one).into());
        }
        many => {
            m.insert("eos_token_id".into(), json!(many));
        }
    }
}

/// Only plain RoPE: no scaling type, no `rope_freqs.weight`.
fn refuse_scaled_rope(g: &GgufFile, file: &str, scaling_key: &str) -> Result<()> {
    if let Some(v) = g.get(scaling_key) {
        if !matches!(v.as_str(), Some("none") | Some("")) {
            crate::bail_input!("{file}: {scaling_key} = {v:?} is not supported (only plain RoPE)");
        }
    }
    if g.tensor("rope_freqs.weight").is_some() {
        crate::bail_input!("{file}: tensor 'rope_freqs.weight' (scaled RoPE) is not supported");
    }
    Ok(())
}

/// Reads and checks the whole model: config, every tensor dequantized under its HF name, the
/// tokenizer.
pub(crate) fn convert(g: &GgufFile) -> Result<Imported> {
    let file = g.path.display().to_string();
    let (config, _) = config_of(g, &file)?;
    let specs = expected_tensors(&config);
    let mut weights = Weights::new();
    let mut counts: Vec<(&'static str, usize)> = vec![];
    for t in &g.tensors {
        let Some(name) = hf_name(&t.name) else {
            crate::bail_input!(
                "{file}: tensor '{}' has no counterpart in a {} model",
                t.name,
                config.arch.hf_architecture()
            );
        };
        let Some(spec) = specs.iter().find(|s| s.name == name) else {
            crate::bail_input!(
                "{file}: tensor '{}' ({name}) is not part of this {} config",
                t.name,
                config.arch.hf_architecture()
            );
        };
        if t.shape() != spec.shape {
            crate::bail_input!(
                "{file}: tensor '{}' has shape {:?} (HF order), the metadata implies {:?}",
                t.name,
                t.shape(),
                spec.shape
            );
        }
        let data = load_tensor(g, t, &config, &file)?;
        match counts.iter_mut().find(|(n, _)| *n == t.ggml_type.name()) {
            Some(c) => c.1 += 1,
            None => counts.push((t.ggml_type.name(), 1)),
        }
        weights.insert(name, Tensor::new(spec.shape.clone(), data));
    }
    if let Some(missing) = specs.iter().find(|s| !weights.contains_key(&s.name)) {
        crate::bail_input!(
            "{file}: no tensor for {} (the metadata implies it)",
            missing.name
        );
    }
    let tokenizer = tokenizer::rebuild(&tokenizer_keys(g, &file)?, config.max_position_embeddings)?;
    Ok(Imported {
        config,
        weights,
        tokenizer,
        type_counts: counts.iter().map(|(n, c)| format!("{n} x{c}")).collect(),
    })
}

/// The file's `tokenizer.*` keys, read for [`tokenizer::rebuild`]: a missing key or a value of
/// the wrong type is an input error naming the key.
fn tokenizer_keys<'a>(g: &'a GgufFile, file: &'a str) -> Result<GgufVocab<'a>> {
    let k = Keys { g, file };
    let model = k.req("tokenizer.ggml.model")?.as_str().unwrap_or("");
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(v) => v.as_str().unwrap_or(""),
    };
    let family = tokenizer::family(file, model, pre)?;
    let tokens = k.strings("tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = k.token_types(n)?;
    let merges = k.strings("tokenizer.ggml.merges")?;
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(GgufVocab {
        file,
        family,
        types,
        merges,
        add_bos,
        bos: k.id("tokenizer.ggml.bos_token_id", n)?,
        chat_template: k.chat_template()?,
        eos: k.id("tokenizer.ggml.eos_token_id", n)?,
        pad: k.id("tokenizer.ggml.padding_token_id", n)?,
        unk: k.id("tokenizer.ggml.unknown_token_id", n)?,
        tokens,
    })
}

/// Typed access to the tokenizer's keys, with messages naming the file.
struct Keys<'a> {
    g: &'a GgufFile,
    file: &'a str,
}

impl<'a> Keys<'a> {
    fn req(&self, key: &str) -> Result<&'a Value> {
        self.g.get(key).ok_or_else(|| {
            input_error(format!(
                "{}: metadata '{key}' is missing (needed to rebuild the tokenizer)",
                self.file
            ))
        })
    }

    fn strings(&self, key: &str) -> Result<Vec<&'a str>> {
        let bad = || {
            input_error(format!(
                "{}: metadata '{key}' must be an array of strings",
                self.file
            ))
        };
        self.req(key)?
            .as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|v| v.as_str().ok_or_else(bad))
            .collect()
    }

    fn id(&self, key: &str, n_tokens: usize) -> Result<Option<usize>> {
        match self.g.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(id) if (id as usize) < n_tokens => Ok(Some(id as usize)),
                _ => Err(input_error(format!(
                    "{}: metadata '{key}' = {v:?} is not a token id (the vocabulary has {n_tokens})",
                    self.file
                ))),
            },
        }
    }

    /// `tokenizer.ggml.token_type`: one integer per token; all normal when absent.
    fn token_types(&self, n: usize) -> Result<Vec<i64>> {
        let Some(v) = self.g.get("tokenizer.ggml.token_type") else {
            return Ok(vec![tokenizer::NORMAL_TOKEN; n]);
        };
        let bad = || {
            input_error(format!(
                "{}: metadata 'tokenizer.ggml.token_type' must be {n} integers (one per token)",
                self.file
            ))
        };
        let arr = v.as_array().ok_or_else(bad)?;
        if arr.len() != n {
            return Err(bad());
        }
        arr.iter().map(|t| t.as_i64().ok_or_else(bad)).collect()
    }

    fn chat_template(&self) -> Result<Option<&'a str>> {
        match self.g.get("tokenizer.chat_template") {
            None => Ok(None),
            Some(t) => match t.as_str() {
                Some(t) => Ok(Some(t)),
                None => crate::bail_input!(
                    "{}: metadata 'tokenizer.chat_template' must be a string",
                    self.file
                ),
            },
        }
    }
}

fn load_tensor(g: &GgufFile, t: &TensorInfo, cfg: &Config, file: &str) -> Result<Vec<f32>> {
    let data = g
        .dequantize(t)
        .map_err(|e| input_error(format!("{file}: tensor '{}': {e}", t.name)))?;
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        crate::bail_input!(
            "{file}: tensor '{}' has a non-finite value ({}) at flat index {i}",
            t.name,
            data[i]
        );
    }
    if cfg.arch == Arch::Llama {
        let heads = match t.name.rsplit('.').nth(1) {
            Some("attn_q") => Some(cfg.num_heads),
            Some("attn_k") => Some(cfg.num_kv_heads),
            _ => None,
        };
        if let Some(h) = heads {
            let shape = t.shape();
            let cols = shape.get(1).copied().unwrap_or(1);
            return Ok(unpermute_rows(&data, shape[0], cols, h));
        }
    }
    Ok(data)
}

/// One tensor's bytes in the output dtype.
struct Encoded {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Encoded {
    fn new(t: &Tensor, dtype: OutDtype) -> Encoded {
        let (dt, width) = match dtype {
            OutDtype::Bf16 => (Dtype::BF16, 2),
            OutDtype::F32 => (Dtype::F32, 4),
        };
        let mut bytes = vec![0u8; width * t.numel()];
        bytes
            .par_chunks_mut(width)
            .zip(t.data.par_iter())
            .for_each(|(out, x)| match dtype {
                OutDtype::Bf16 => out.copy_from_slice(&bf16::from_f32(*x).to_le_bytes()),
                OutDtype::F32 => out.copy_from_slice(&x.to_le_bytes()),
            });
        Encoded {
            dtype: dt,
            shape: t.shape.clone(),
            bytes,
        }
    }
}

impl View for &Encoded {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn write_text(path: &Path, obj: &Map<String, Json>) -> Result<()> {
    write_json(path, obj)
}

/// Writes the model directory: everything into `OUT.tmp`, then renamed to `OUT` (an existing
/// `OUT` is replaced only once the new one is complete).
pub(crate) fn write_model_dir(out: &Path, m: &Imported, dtype: OutDtype) -> Result<()> {
    if out.file_name().is_none() {
        crate::bail_input!(
            "{}: give the model a directory name of its own",
            out.display()
        );
    }
    if out.exists() && !out.is_dir() {
        crate::bail_input!("{}: exists and is not a directory", out.display());
    }
    let sibling = |suffix: &str| {
        let mut name = out.file_name().unwrap_or_default().to_os_string();
        name.push(suffix);
        out.with_file_name(name)
    };
    let tmp = sibling(".tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .with_context(|| format!("removing stale {}", tmp.display()))?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let write_all = || -> Result<()> {
        m.config.save(&tmp, None)?;
        if dtype == OutDtype::F32 {
            // config.save writes bfloat16; the weights say otherwise here.
            let path = tmp.join(crate::model::config::CONFIG_FILE);
            let mut cfg: Map<String, Json> =
                serde_json::from_str(&std::fs::read_to_string(&path)?)?;
            cfg.insert("torch_dtype".into(), "float32".into());
            write_json(&path, &cfg)?;
        }
        let specs = expected_tensors(&m.config);
        let encoded: Vec<(&str, Encoded)> = specs
            .iter()
            .map(|s| (s.name.as_str(), Encoded::new(&m.weights[&s.name], dtype)))
            .collect();
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let st_path = tmp.join(crate::model::safetensors::SINGLE_FILE);
        // The crate writes a 0600 temp file and renames it; give the result the permissions a
        // plainly created file gets (umask), as save_dir does.
        let perms = std::fs::File::create(&st_path)
            .and_then(|f| f.metadata())
            .with_context(|| format!("creating {}", st_path.display()))?
            .permissions();
        safetensors::serialize_to_file(
            encoded.iter().map(|(n, t)| (*n, t)),
            Some(metadata),
            &st_path,
        )
        .with_context(|| format!("writing {}", st_path.display()))?;
        std::fs::set_permissions(&st_path, perms)
            .with_context(|| format!("setting permissions of {}", st_path.display()))?;
        let tok_path = tmp.join("tokenizer.json");
        let mut text = serde_json::to_string(&m.tokenizer.tokenizer_json)?;
        text.push('\n');
        std::fs::write(&tok_path, text)
            .with_context(|| format!("writing {}", tok_path.display()))?;
        write_text(
            &tmp.join("tokenizer_config.json"),
            &m.tokenizer.tokenizer_config,
        )?;
        Ok(())
    };
    if let Err(e) = write_all() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if out.exists() {
        let old = sibling(".old");
        if old.exists() {
            std::fs::remove_dir_all(&old)
                .with_context(|| format!("removing stale {}", old.display()))?;
        }
        std::fs::rename(out, &old).with_context(|| format!("moving {} aside", out.display()))?;
        std::fs::rename(&tmp, out).with_context(|| format!("renaming {}", tmp.display()))?;
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    } else {
        std::fs::rename(&tmp, out).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(())
}
