//! An HF `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF file's `tokenizer.ggml.*`
//! keys: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with the vocabulary, merges and token
//! types of the file, and the pre-tokenizer of the model family (`tokenizer.ggml.pre`) written as
//! the family's own HF tokenizer.json writes it.

use super::reader::{GgufFile, Value};
use crate::error::input_error;
use anyhow::Result;
use serde_json::{json, Map, Value as Json};

/// llama.cpp's token types (`enum llama_token_type`).
pub mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// Qwen2's split regex (its tokenizer.json; llama.cpp's `qwen2` pre-tokenizer).
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split regex (llama.cpp's `llama-bpe`): as Qwen2's with digits in runs of up to 3.
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer families we can rebuild (values of `tokenizer.ggml.pre`).
pub const SUPPORTED_PRE: [&str; 5] = ["qwen2", "smollm", "llama-bpe", "gpt-2", "default"];

/// The rebuilt tokenizer files.
pub struct RebuiltTokenizer {
    pub tokenizer_json: Map<String, Json>,
    pub tokenizer_config: Map<String, Json>,
}

fn byte_level(trim_offsets: bool, use_regex: bool) -> Json {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex
    })
}

/// (normalizer, pre_tokenizer) of a family, as its HF tokenizer.json has them.
fn family(pre: &str) -> Option<(Json, Json)> {
    let split = |regex: &str| {
        json!({
            "type": "Split",
            "pattern": {"Regex": regex},
            "behavior": "Isolated",
            "invert": false
        })
    };
    Some(match pre {
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false, false)]}),
        ),
        "llama-bpe" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(true, false)]}),
        ),
        // StarCoder's tokenizer (SmolLM): single digits, then GPT-2's byte-level regex.
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true, true)
            ]}),
        ),
        "gpt-2" | "default" => (Json::Null, byte_level(true, true)),
        _ => return None,
    })
}

struct Keys<'a> {
    g: &'a GgufFile,
    file: String,
}

impl Keys<'_> {
    fn req(&self, key: &str) -> Result<&Value> {
        self.g.get(key).ok_or_else(|| {
            input_error(format!(
                "{}: metadata '{key}' is missing (needed to rebuild the tokenizer)",
                self.file
            ))
        })
    }

    fn strings(&self, key: &str) -> Result<Vec<&str>> {
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
}

/// Rebuilds the tokenizer files; `max_length` is the model's context length.
pub fn rebuild(g: &GgufFile, max_length: usize) -> Result<RebuiltTokenizer> {
    let k = Keys {
        g,
        file: g.path.display().to_string(),
    };
    let file = &k.file;
    let model = k.req("tokenizer.ggml.model")?.as_str().unwrap_or("");
    if model != "gpt2" {
        crate::bail_input!(
            "{file}: tokenizer.ggml.model '{model}' is not supported (only 'gpt2', byte-level BPE)"
        );
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(v) => v.as_str().unwrap_or(""),
    };
    let Some((normalizer, pre_tokenizer)) = family(pre) else {
        crate::bail_input!(
            "{file}: tokenizer.ggml.pre '{pre}' is not supported (supported: {})",
            SUPPORTED_PRE.join(", ")
        );
    };
    let tokens = k.strings("tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![token_type::NORMAL; n],
        Some(v) => {
            let bad = || {
                input_error(format!(
                    "{file}: metadata 'tokenizer.ggml.token_type' must be {n} integers (one per token)"
                ))
            };
            let arr = v.as_array().ok_or_else(bad)?;
            if arr.len() != n {
                return Err(bad());
            }
            arr.iter()
                .map(|t| t.as_i64().ok_or_else(bad))
                .collect::<Result<_>>()?
        }
    };
    let merges = k.strings("tokenizer.ggml.merges")?;

    let mut vocab = Map::new();
    let mut added = Vec::new();
    let mut added_decoder = Map::new();
    for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        match ty {
            token_type::NORMAL | token_type::UNKNOWN | token_type::BYTE => {
                if vocab.insert(tok.to_string(), Json::from(id)).is_some() {
                    crate::bail_input!(
                        "{file}: token {tok:?} appears twice in tokenizer.ggml.tokens"
                    );
                }
            }
            token_type::CONTROL | token_type::USER_DEFINED => {
                // In the model's vocabulary too: `tokenizers` gives an added token that the model
                // does not know the next free id, not the id written beside it (SmolLM's specials
                // are ids 0..17, before the BPE tokens).
                if vocab.insert(tok.to_string(), Json::from(id)).is_some() {
                    crate::bail_input!(
                        "{file}: token {tok:?} appears twice in tokenizer.ggml.tokens"
                    );
                }
                let entry = json!({
                    "content": tok,
                    "lstrip": false,
                    "normalized": false,
                    "rstrip": false,
                    "single_word": false,
                    "special": ty == token_type::CONTROL
                });
                added_decoder.insert(id.to_string(), entry.clone());
                let mut with_id = Map::new();
                with_id.insert("id".into(), Json::from(id));
                with_id.extend(entry.as_object().cloned().unwrap_or_default());
                added.push(Json::Object(with_id));
            }
            // Padding rows of the embedding (`[PAD151665]`...): no text maps to them.
            token_type::UNUSED => {}
            other => crate::bail_input!(
                "{file}: token {id} ({tok:?}) has type {other}, which llama.cpp does not define"
            ),
        }
    }
    for (i, m) in merges.iter().enumerate() {
        let mut parts = m.split(' ');
        let ok = matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty());
        if !ok {
            crate::bail_input!(
                "{file}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
            );
        }
    }

    let name_of = |key: &str| -> Result<Json> {
        Ok(match k.id(key, n)? {
            Some(id) => Json::from(tokens[id]),
            None => Json::Null,
        })
    };
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let bos = name_of("tokenizer.ggml.bos_token_id")?;
    let post_processor = match (add_bos, bos.as_str()) {
        (true, Some(b)) => {
            let id = k.id("tokenizer.ggml.bos_token_id", n)?.unwrap_or(0);
            let special = |seq: &str| json!([{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": seq, "type_id": 0}}]);
            json!({
                "type": "TemplateProcessing",
                "single": special("A"),
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}}
            })
        }
        (true, None) => crate::bail_input!(
            "{file}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing"
        ),
        (false, _) => byte_level(false, false),
    };

    let merges: Vec<Json> = merges.iter().map(|m| Json::from(*m)).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level(false, false),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    });

    let mut config = Map::new();
    config.insert("add_bos_token".into(), add_bos.into());
    config.insert("add_prefix_space".into(), false.into());
    config.insert("added_tokens_decoder".into(), Json::Object(added_decoder));
    config.insert("bos_token".into(), bos);
    if let Some(t) = g.get("tokenizer.chat_template") {
        let Some(t) = t.as_str() else {
            crate::bail_input!("{file}: metadata 'tokenizer.chat_template' must be a string");
        };
        config.insert("chat_template".into(), t.into());
    }
    config.insert("clean_up_tokenization_spaces".into(), false.into());
    config.insert("eos_token".into(), name_of("tokenizer.ggml.eos_token_id")?);
    config.insert("errors".into(), "replace".into());
    config.insert("model_max_length".into(), max_length.into());
    config.insert(
        "pad_token".into(),
        name_of("tokenizer.ggml.padding_token_id")?,
    );
    config.insert("split_special_tokens".into(), false.into());
    let class = if pre == "qwen2" {
        "Qwen2Tokenizer"
    } else {
        "GPT2Tokenizer"
    };
    config.insert("tokenizer_class".into(), class.into());
    config.insert(
        "unk_token".into(),
        name_of("tokenizer.ggml.unknown_token_id")?,
    );

    let Json::Object(tokenizer_json) = tokenizer else {
        unreachable!("json! of an object literal")
    };
    Ok(RebuiltTokenizer {
        tokenizer_json,
        tokenizer_config: config,
    })
}
