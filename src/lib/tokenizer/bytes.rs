//! A tiny byte-level BPE tokenizer for random models, written as HF `tokenizer.json` +
//! `tokenizer_config.json` (ChatML chat template, Qwen-style special tokens).
//!
//! Ids 0..256 are the 256 bytes (GPT-2's byte-to-unicode alphabet, id = byte value), then the
//! three special tokens, then BPE merges learned from a small built-in English text, as many as
//! fit in the requested vocabulary. Every UTF-8 text encodes and decodes back unchanged.

use anyhow::Result;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

pub(crate) const ENDOFTEXT: &str = "<|endoftext|>";
pub(crate) const IM_START: &str = "<|im_start|>";
pub(crate) const IM_END: &str = "<|im_end|>";
/// The special tokens in id order, starting at [`FIRST_SPECIAL_ID`].
pub(crate) const SPECIALS: [&str; 3] = [ENDOFTEXT, IM_START, IM_END];
pub(crate) const FIRST_SPECIAL_ID: u32 = 256;
/// Bytes + specials: the smallest vocabulary this tokenizer can have.
pub(crate) const MIN_VOCAB: usize = 256 + SPECIALS.len();

/// ChatML, as Qwen2.5 writes it (without Qwen's default system prompt and tool calls).
pub(crate) const CHAT_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Text the merges are learned from: plain English in the style of the prompts tandem trains on
/// (word problems, chat turns), so common words become single tokens.
const CORPUS: &str = "\
system\nYou are a helpful assistant. Answer the question and explain your reasoning step by step.\n\
user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. \
How many clips did Natalia sell altogether in April and May?\n\
assistant\nIn May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips. The answer is 72.\n\
user\nWeng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. \
How much did she earn?\n\
assistant\nWeng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. The answer is 10.\n\
user\nBetty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. \
Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. \
How much more money does Betty need to buy the wallet?\n\
assistant\nIn the beginning, Betty has only 100 / 2 = $50. Betty's grandparents gave her 15 * 2 = $30. \
This means, Betty needs 100 - 50 - 30 - 15 = $5 more. The answer is 5.\n\
user\nJames writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?\n\
assistant\nHe writes each friend 3 * 2 = 6 pages a week. So he writes 6 * 2 = 12 pages every week. \
That means he writes 12 * 52 = 624 pages a year. The answer is 624.\n\
The model reads the question, thinks about the numbers, and then writes the final answer. \
When the answer is correct the reward is one, and when the answer is wrong the reward is zero. \
The policy is trained to make the correct answers more likely and the wrong answers less likely. \
Each step of training samples several responses for every prompt, scores them, and computes the \
advantage of each response relative to the other responses of the same prompt.\n";

/// GPT-2's reversible map from bytes to printable characters (so BPE tokens are strings).
pub fn byte_to_char() -> [char; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            next += 1;
            next - 1
        };
        map[b as usize] = char::from_u32(c).expect("valid code point");
    }
    map
}

/// Splits text the way GPT-2's pre-tokenizer roughly does: an optional leading space followed by
/// a run of letters, of digits, or of other symbols; whitespace runs alone. Merges never cross
/// these pieces, so any split is valid for learning; this one makes useful merges.
fn pieces(text: &str) -> Vec<&str> {
    #[derive(PartialEq)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class = |c: char| {
        if c.is_alphabetic() {
            Class::Letter
        } else if c.is_numeric() {
            Class::Digit
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let mut out = Vec::new();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut i = 0;
    while i < chars.len() {
        let (pos, c) = chars[i];
        let mut j = i + 1;
        let kind = if c == ' ' && j < chars.len() && class(chars[j].1) != Class::Space {
            j += 1;
            class(chars[j - 1].1)
        } else {
            class(c)
        };
        while j < chars.len() && class(chars[j].1) == kind {
            j += 1;
        }
        let end = chars.get(j).map(|x| x.0).unwrap_or(text.len());
        out.push(&text[pos..end]);
        i = j;
    }
    out
}

/// Learns up to `max_merges` BPE merges from [`CORPUS`]: repeatedly merge the most frequent
/// adjacent pair (ties: the smallest pair), until no pair occurs twice.
fn learn_merges(max_merges: usize) -> Vec<(String, String)> {
    let b2c = byte_to_char();
    let mut words: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for piece in pieces(CORPUS) {
        let symbols = piece.bytes().map(|b| b2c[b as usize].to_string()).collect();
        *words.entry(symbols).or_default() += 1;
    }
    let mut merges = Vec::new();
    while merges.len() < max_merges {
        let mut counts: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for (word, n) in &words {
            for pair in word.windows(2) {
                *counts.entry((&pair[0], &pair[1])).or_default() += n;
            }
        }
        // max_by_key keeps the last maximum; iterate in reverse so ties go to the smallest pair.
        let best = counts.iter().rev().max_by_key(|(_, n)| **n);
        let Some((&(a, b), &n)) = best else { break };
        if n < 2 {
            break;
        }
        let (a, b) = (a.to_string(), b.to_string());
        let joined = format!("{a}{b}");
        words = words
            .into_iter()
            .map(|(word, n)| {
                let mut out = Vec::with_capacity(word.len());
                let mut i = 0;
                while i < word.len() {
                    if i + 1 < word.len() && word[i] == a && word[i + 1] == b {
                        out.push(joined.clone());
                        i += 2;
                    } else {
                        out.push(word[i].clone());
                        i += 1;
                    }
                }
                (out, n)
            })
            .fold(BTreeMap::new(), |mut acc, (w, n)| {
                *acc.entry(w).or_default() += n;
                acc
            });
        merges.push((a, b));
    }
    merges
}

/// What a generated tokenizer holds.
#[derive(Clone, Debug)]
pub(crate) struct ByteTokenizer {
    /// Number of token ids it uses (bytes + specials + merges), at most the requested vocab.
    pub(crate) len: usize,
    pub(crate) endoftext_id: u32,
    pub(crate) im_end_id: u32,
    pub(crate) tokenizer_json: Map<String, Value>,
    pub(crate) tokenizer_config: Map<String, Value>,
}

/// Builds the tokenizer for a model of `vocab` ids (at least [`MIN_VOCAB`]).
pub(crate) fn build(vocab: usize) -> Result<ByteTokenizer> {
    if vocab < MIN_VOCAB {
        crate::bail_input!(
            "--vocab {vocab} is too small for the generated byte tokenizer (needs at least {MIN_VOCAB}: 256 bytes + {} special tokens)",
            SPECIALS.len()
        );
    }
    let b2c = byte_to_char();
    let mut vocab_map = Map::new();
    for (b, c) in b2c.iter().enumerate() {
        vocab_map.insert(c.to_string(), Value::from(b));
    }
    // The specials are in the BPE vocab too (as GPT-2 has `<|endoftext|>`): `tokenizers` keeps an
    // added token's id only when the model's vocab holds it, and would otherwise renumber it
    // past the model's vocab size.
    for (i, s) in SPECIALS.iter().enumerate() {
        vocab_map.insert(s.to_string(), Value::from(FIRST_SPECIAL_ID as usize + i));
    }
    let merges = learn_merges(vocab - MIN_VOCAB);
    let mut merge_strings = Vec::with_capacity(merges.len());
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab_map.insert(format!("{a}{b}"), Value::from(MIN_VOCAB + i));
        merge_strings.push(Value::from(format!("{a} {b}")));
    }
    let tokenizer = tokenizer_json(vocab_map, merge_strings);
    let config = tokenizer_config();
    let as_map = |v: Value| match v {
        Value::Object(m) => m,
        _ => unreachable!("json! object literal"),
    };
    Ok(ByteTokenizer {
        len: MIN_VOCAB + merges.len(),
        endoftext_id: FIRST_SPECIAL_ID,
        im_end_id: FIRST_SPECIAL_ID + 2,
        tokenizer_json: as_map(tokenizer),
        tokenizer_config: as_map(config),
    })
}

/// `tokenizer.json`: byte-level BPE over `vocab` and `merges`, the specials as added tokens.
fn tokenizer_json(vocab: Map<String, Value>, merges: Vec<Value>) -> Value {
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({
                "id": FIRST_SPECIAL_ID as usize + i,
                "content": s,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": true
            })
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": true,
            "use_regex": true
        },
        "post_processor": null,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": true,
            "use_regex": true
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    })
}

/// `tokenizer_config.json`: ChatML, `<|im_end|>` ends a turn, `<|endoftext|>` pads.
fn tokenizer_config() -> Value {
    let mut decoder = Map::new();
    for (i, s) in SPECIALS.iter().enumerate() {
        decoder.insert(
            (FIRST_SPECIAL_ID as usize + i).to_string(),
            json!({
                "content": s,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true
            }),
        );
    }
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": null
    })
}

impl ByteTokenizer {
    /// The files to put in a model directory: `tokenizer.json`, `tokenizer_config.json`.
    pub(crate) fn files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let mut out = Vec::new();
        for (name, obj) in [
            ("tokenizer.json", &self.tokenizer_json),
            ("tokenizer_config.json", &self.tokenizer_config),
        ] {
            let text = serde_json::to_string_pretty(obj)? + "\n";
            out.push((name.to_string(), text.into_bytes()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::Tokenizer;

    fn load(vocab: usize) -> (ByteTokenizer, Tokenizer) {
        let bt = build(vocab).unwrap();
        let text = serde_json::to_string(&bt.tokenizer_json).unwrap();
        let tok: Tokenizer = text.parse().unwrap();
        (bt, tok)
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let m = byte_to_char();
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        let distinct: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn loads_with_tokenizers_and_round_trips_utf8() {
        let (bt, tok) = load(MIN_VOCAB);
        assert_eq!(bt.len, MIN_VOCAB);
        assert_eq!(tok.get_vocab_size(true), MIN_VOCAB);
        let texts = [
            "",
            "hello world",
            "  leading and trailing spaces  \n\n\ttabs\r\n",
            "Grüße, naïve café — 数学 🦀🚀 \u{0}\u{7f}\u{200b}",
            "e\u{301} vs \u{e9} (not normalised)",
            "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
            "<|im_end <| im_start|> partial specials",
        ];
        for t in texts {
            let enc = tok.encode(t, false).unwrap();
            assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), t, "{t:?}");
            assert!(enc.get_ids().iter().all(|&id| (id as usize) < bt.len));
        }
        // Without merges a text is its bytes; specials are single ids.
        let ids = tok
            .encode("a\u{e9}<|im_end|>", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, vec![97, 0xC3, 0xA9, bt.im_end_id]);
        assert_eq!(tok.token_to_id(ENDOFTEXT), Some(256));
        assert_eq!(tok.token_to_id(IM_START), Some(257));
    }

    #[test]
    fn merges_fill_the_vocab_and_shorten_text() {
        let (bt, tok) = load(400);
        assert_eq!(bt.len, 400);
        assert_eq!(tok.get_vocab_size(true), 400);
        let text = "How many clips did Natalia sell? The answer is 72.";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() < text.len() / 2, "{} ids", ids.len());
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        // The corpus runs out of pairs seen twice long before 100k merges.
        let big = build(100_000).unwrap();
        assert!(big.len > 400 && big.len < 2000, "{}", big.len);
        // Same vocab, same files.
        assert_eq!(build(400).unwrap().files().unwrap(), bt.files().unwrap());
    }

    #[test]
    fn too_small_vocab_is_an_input_error() {
        let e = build(100).unwrap_err();
        assert!(crate::error::is_input_error(&e));
        assert!(e.to_string().contains("needs at least 259"), "{e}");
    }

    #[test]
    fn chat_template_renders_chatml() {
        let env = minijinja::Environment::new();
        let tmpl = env.template_from_str(CHAT_TEMPLATE).unwrap();
        let msgs = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"}
        ]);
        let out = tmpl
            .render(minijinja::context! { messages => msgs, add_generation_prompt => true })
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
