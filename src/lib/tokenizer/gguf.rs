//! An HF `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF file's `tokenizer.ggml.*`
//! keys: byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with the vocabulary, merges and token
//! types of the file, and the pre-tokenizer of the model family (`tokenizer.ggml.pre`) written as
//! the family's own HF tokenizer.json writes it. `model::gguf` reads the keys of the file
//! ([`GgufVocab`]); this module checks them and writes the files.

use anyhow::Result;
use serde_json::{json, Map, Value as Json};

/// llama.cpp's token types (`enum llama_token_type`).
mod token_type {
    pub(crate) const NORMAL: i64 = 1;
    pub(crate) const UNKNOWN: i64 = 2;
    pub(crate) const CONTROL: i64 = 3;
    pub(crate) const USER_DEFINED: i64 = 4;
    pub(crate) const UNUSED: i64 = 5;
    pub(crate) const BYTE: i64 = 6;
}

/// The type of a token when the file gives none.
pub(crate) const NORMAL_TOKEN: i64 = token_type::NORMAL;

/// Qwen2's split regex (its tokenizer.json; llama.cpp's `qwen2` pre-tokenizer).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split regex (llama.cpp's `llama-bpe`): as Qwen2's with digits in runs of up to 3.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer families we can rebuild (values of `tokenizer.ggml.pre`).
const SUPPORTED_PRE: [&str; 5] = ["qwen2", "smollm", "llama-bpe", "gpt-2", "default"];

/// The rebuilt tokenizer files.
pub(crate) struct RebuiltTokenizer {
    pub(crate) tokenizer_json: Map<String, Json>,
    pub(crate) tokenizer_config: Map<String, Json>,
}

/// The `tokenizer.*` metadata of a GGUF file, read and type-checked by `model::gguf`.
pub(crate) struct GgufVocab<'a> {
    /// The file, for messages.
    pub(crate) file: &'a str,
    pub(crate) family: Family,
    pub(crate) tokens: Vec<&'a str>,
    /// llama.cpp's token type of each token.
    pub(crate) types: Vec<i64>,
    /// "a b" per merge, unchecked.
    pub(crate) merges: Vec<&'a str>,
    pub(crate) add_bos: bool,
    /// The ids the file names (each below `tokens.len()`).
    pub(crate) bos: Option<usize>,
    pub(crate) eos: Option<usize>,
    pub(crate) pad: Option<usize>,
    pub(crate) unk: Option<usize>,
    pub(crate) chat_template: Option<&'a str>,
}

/// A tokenizer family: its normalizer and pre-tokenizer as its HF tokenizer.json has them, and
/// its HF class.
pub(crate) struct Family {
    normalizer: Json,
    pre_tokenizer: Json,
    class: &'static str,
}

fn byte_level(trim_offsets: bool, use_regex: bool) -> Json {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex
    })
}

/// The family of a file whose `tokenizer.ggml.model` is `model` and `tokenizer.ggml.pre` is
/// `pre`, or an input error when we cannot rebuild it.
pub(crate) fn family(file: &str, model: &str, pre: &str) -> Result<Family> {
    if model != "gpt2" {
        crate::bail_input!(
            "{file}: tokenizer.ggml.model '{model}' is not supported (only 'gpt2', byte-level BPE)"
        );
    }
    let split = |regex: &str| {
        json!({
            "type": "Split",
            "pattern": {"Regex": regex},
            "behavior": "Isolated",
            "invert": false
        })
    };
    let (normalizer, pre_tokenizer) = match pre {
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
        _ => crate::bail_input!(
            "{file}: tokenizer.ggml.pre '{pre}' is not supported (supported: {})",
            SUPPORTED_PRE.join(", ")
        ),
    };
    let class = if pre == "qwen2" {
        "Qwen2Tokenizer"
    } else {
        "GPT2Tokenizer"
    };
    Ok(Family {
        normalizer,
        pre_tokenizer,
        class,
    })
}

/// Rebuilds the tokenizer files; `max_length` is the model's context length.
pub(crate) fn rebuild(v: &GgufVocab, max_length: usize) -> Result<RebuiltTokenizer> {
    let vocab = Vocab::of(v)?;
    check_merges(v)?;
    let post_processor = post_processor(v)?;
    let tokenizer_config = tokenizer_config(v, vocab.added_decoder, max_length);
    let merges: Vec<Json> = v.merges.iter().map(|m| Json::from(*m)).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": vocab.added,
        "normalizer": v.family.normalizer,
        "pre_tokenizer": v.family.pre_tokenizer,
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
            "vocab": vocab.model,
            "merges": merges
        }
    });
    let Json::Object(tokenizer_json) = tokenizer else {
        unreachable!("json! of an object literal")
    };
    Ok(RebuiltTokenizer {
        tokenizer_json,
        tokenizer_config,
    })
}

/// The tokens sorted by type: the BPE model's vocabulary, the added tokens (tokenizer.json's
/// `added_tokens`, and tokenizer_config.json's `added_tokens_decoder` by id).
struct Vocab {
    model: Map<String, Json>,
    added: Vec<Json>,
    added_decoder: Map<String, Json>,
}

impl Vocab {
    fn of(v: &GgufVocab) -> Result<Vocab> {
        let file = v.file;
        let mut out = Vocab {
            model: Map::new(),
            added: Vec::new(),
            added_decoder: Map::new(),
        };
        for (id, (tok, &ty)) in v.tokens.iter().zip(&v.types).enumerate() {
            match ty {
                token_type::NORMAL | token_type::UNKNOWN | token_type::BYTE => {
                    out.insert_model(file, tok, id)?
                }
                token_type::CONTROL | token_type::USER_DEFINED => {
                    // In the model's vocabulary too: `tokenizers` gives an added token that the
                    // model does not know the next free id, not the id written beside it
                    // (SmolLM's specials are ids 0..17, before the BPE tokens).
                    out.insert_model(file, tok, id)?;
                    out.insert_added(tok, id, ty == token_type::CONTROL);
                }
                // Padding rows of the embedding (`[PAD151665]`...): no text maps to them.
                token_type::UNUSED => {}
                other => crate::bail_input!(
                    "{file}: token {id} ({tok:?}) has type {other}, which llama.cpp does not define"
                ),
            }
        }
        Ok(out)
    }

    fn insert_model(&mut self, file: &str, tok: &str, id: usize) -> Result<()> {
        if self.model.insert(tok.to_string(), Json::from(id)).is_some() {
            crate::bail_input!("{file}: token {tok:?} appears twice in tokenizer.ggml.tokens");
        }
        Ok(())
    }

    fn insert_added(&mut self, tok: &str, id: usize, special: bool) {
        let entry = json!({
            "content": tok,
            "lstrip": false,
            "normalized": false,
            "rstrip": false,
            "single_word": false,
            "special": special
        });
        self.added_decoder.insert(id.to_string(), entry.clone());
        let mut with_id = Map::new();
        with_id.insert("id".into(), Json::from(id));
        with_id.extend(entry.as_object().cloned().unwrap_or_default());
        self.added.push(Json::Object(with_id));
    }
}

fn check_merges(v: &GgufVocab) -> Result<()> {
    for (i, m) in v.merges.iter().enumerate() {
        let mut parts = m.split(' ');
        let ok = matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty());
        if !ok {
            crate::bail_input!(
                "{}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space",
                v.file
            );
        }
    }
    Ok(())
}

/// The token of an id the file names, or null.
fn name_of(v: &GgufVocab, id: Option<usize>) -> Json {
    match id {
        Some(id) => Json::from(v.tokens[id]),
        None => Json::Null,
    }
}

/// BOS before every sequence when the file asks for it, else the byte-level post-processor.
fn post_processor(v: &GgufVocab) -> Result<Json> {
    let bos = name_of(v, v.bos);
    Ok(match (v.add_bos, bos.as_str()) {
        (true, Some(b)) => {
            let id = v.bos.unwrap_or(0);
            let special = |seq: &str| json!([{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": seq, "type_id": 0}}]);
            json!({
                "type": "TemplateProcessing",
                "single": special("A"),
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}}
            })
        }
        (true, None) => crate::bail_input!(
            "{}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing",
            v.file
        ),
        (false, _) => byte_level(false, false),
    })
}

fn tokenizer_config(
    v: &GgufVocab,
    added_decoder: Map<String, Json>,
    max_length: usize,
) -> Map<String, Json> {
    let mut config = Map::new();
    config.insert("add_bos_token".into(), v.add_bos.into());
    config.insert("add_prefix_space".into(), false.into());
    config.insert("added_tokens_decoder".into(), Json::Object(added_decoder));
    config.insert("bos_token".into(), name_of(v, v.bos));
    if let Some(t) = v.chat_template {
        config.insert("chat_template".into(), t.into());
    }
    config.insert("clean_up_tokenization_spaces".into(), false.into());
    config.insert("eos_token".into(), name_of(v, v.eos));
    config.insert("errors".into(), "replace".into());
    config.insert("model_max_length".into(), max_length.into());
    config.insert("pad_token".into(), name_of(v, v.pad));
    config.insert("split_special_tokens".into(), false.into());
    config.insert("tokenizer_class".into(), v.family.class.into());
    config.insert("unk_token".into(), name_of(v, v.unk));
    config
}
