//! A streamed answer (`"stream": true`): server-sent events in the OpenAI shape, `data:
//! {chunk}` lines and a last `data: [DONE]`. Each chunk carries a sample's tokens drawn since
//! the last one (`token_ids` and their log-probs, as the whole answer's fields) and the text
//! they add; the last chunk of a sample its `finish_reason` (and, in chat, its `tool_calls`).
//!
//! The text sent is always a prefix of the final text: what could still turn out to start a
//! stop string, or (chat) a `<tool_call>` block or the whitespace before one, and a character
//! not complete yet, wait for the tokens after them; the last chunk sends the rest.

use super::api::{assistant_reply, message_json, token_texts, Sampling};
use crate::engine::paged::{Completion, FinishReason};
use crate::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::io::Write;

/// Which object the chunks are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// One sample's progress: its tokens so far and the text sent.
#[derive(Default)]
struct Sample {
    tokens: Vec<u32>,
    sent_tokens: usize,
    sent_text: String,
}

/// The events of one streamed response, written to its connection.
pub(crate) struct Streamer<'a> {
    kind: Kind,
    id: &'a str,
    model: &'a str,
    created: u64,
    prompt: &'a [u32],
    tok: &'a Tokenizer,
    /// What must not be sent before it is known not to begin (stop strings, `<tool_call>`).
    guards: Vec<String>,
    samples: Vec<Sample>,
    /// The head and each sample's first chunk are written once.
    started: bool,
}

impl<'a> Streamer<'a> {
    /// The stream of response `id` (of `model`, `created`) to `prompt`, sampled with `s`.
    pub(crate) fn new(
        kind: Kind,
        id: &'a str,
        model: &'a str,
        created: u64,
        prompt: &'a [u32],
        tok: &'a Tokenizer,
        s: &Sampling,
    ) -> Streamer<'a> {
        let (stop, n) = (&s.stop, s.n);
        let mut guards = stop.to_vec();
        if kind == Kind::Chat {
            guards.push("<tool_call>".into());
        }
        Streamer {
            kind,
            id,
            model,
            created,
            prompt,
            tok,
            guards,
            samples: (0..n).map(|_| Sample::default()).collect(),
            started: false,
        }
    }

    fn head(&mut self, w: &mut impl Write) -> std::io::Result<()> {
        if !self.started {
            self.started = true;
            w.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n")?;
        }
        Ok(())
    }

    /// Tokens drawn since the last call, as `(sample, token, log-prob)`: a chunk for each
    /// sample they belong to.
    pub(crate) fn tokens(
        &mut self,
        w: &mut impl Write,
        drawn: &[(usize, u32, f32)],
    ) -> std::io::Result<()> {
        self.head(w)?;
        let mut logprobs: Vec<Vec<f32>> = vec![Vec::new(); self.samples.len()];
        for &(k, t, lp) in drawn {
            if let Some(s) = self.samples.get_mut(k) {
                s.tokens.push(t);
                logprobs[k].push(lp);
            }
        }
        for (k, lps) in logprobs.iter().enumerate().filter(|(_, l)| !l.is_empty()) {
            let s = &self.samples[k];
            let text = self.tok.decode(&s.tokens, true).unwrap_or_default();
            let safe = match self.kind {
                // Before a `<tool_call>` the reply's content ends trimmed (`assistant_reply`).
                Kind::Chat => safe_prefix(&text, &self.guards).trim_end(),
                Kind::Completion => safe_prefix(&text, &self.guards),
            };
            let delta = match safe.strip_prefix(s.sent_text.as_str()) {
                Some(d) => d.to_string(),
                None => String::new(),
            };
            let new = s.tokens[s.sent_tokens..].to_vec();
            let first = s.sent_tokens == 0 && s.sent_text.is_empty();
            let chunk = self.chunk(k, &delta, &new, lps, None, first);
            let s = &mut self.samples[k];
            s.sent_tokens = s.tokens.len();
            s.sent_text.push_str(&delta);
            write_event(w, &chunk)?;
        }
        Ok(())
    }

    /// The samples finished: each sample's last chunk (the tokens not sent yet, the rest of
    /// its text, its finish reason), then `[DONE]`.
    pub(crate) fn finish(
        &mut self,
        w: &mut impl Write,
        done: &[Completion],
    ) -> std::io::Result<()> {
        self.head(w)?;
        for (k, c) in done.iter().enumerate() {
            let s = &self.samples[k];
            let reply = assistant_reply(&c.text);
            let text = match self.kind {
                Kind::Chat => reply.content.clone().unwrap_or_default(),
                Kind::Completion => c.text.clone(),
            };
            let rest = text.strip_prefix(s.sent_text.as_str()).unwrap_or_default();
            let from = s.sent_tokens.min(c.tokens.len());
            let finish = match (c.finish, reply.tool_calls.is_empty(), self.kind) {
                (FinishReason::Stop, false, Kind::Chat) => "tool_calls",
                (f, _, _) => f.as_str(),
            };
            let first = s.sent_tokens == 0 && s.sent_text.is_empty();
            let mut chunk = self.chunk(
                k,
                rest,
                &c.tokens[from..],
                &c.logprobs[from..],
                Some(finish),
                first,
            );
            if self.kind == Kind::Chat && !reply.tool_calls.is_empty() {
                let mut calls =
                    message_json(&reply, &format!("{}_{k}", self.id))["tool_calls"].clone();
                for (i, call) in calls.as_array_mut().into_iter().flatten().enumerate() {
                    call["index"] = json!(i);
                }
                chunk["choices"][0]["delta"]["tool_calls"] = calls;
            }
            write_event(w, &chunk)?;
        }
        w.write_all(b"data: [DONE]\n\n")?;
        w.flush()
    }

    /// An error after the stream began: an event with the OpenAI error body, then the end.
    pub(crate) fn fail(&mut self, w: &mut impl Write, body: &Value) -> std::io::Result<()> {
        self.head(w)?;
        write_event(w, body)?;
        w.write_all(b"data: [DONE]\n\n")?;
        w.flush()
    }

    /// Whether the head was written (an error can then no longer be a status).
    pub(crate) fn started(&self) -> bool {
        self.started
    }

    /// Sample `k`'s chunk: `text` added, `tokens` and their `logprobs`.
    fn chunk(
        &self,
        k: usize,
        text: &str,
        tokens: &[u32],
        logprobs: &[f32],
        finish: Option<&str>,
        first: bool,
    ) -> Value {
        let texts = token_texts(self.tok, tokens);
        let choice = match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = texts
                    .iter()
                    .zip(logprobs)
                    .map(|(t, &lp)| json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": []}))
                    .collect();
                let mut delta = json!({"content": text});
                if first {
                    delta["role"] = json!("assistant");
                }
                json!({"index": k, "delta": delta, "logprobs": {"content": content},
                       "finish_reason": finish, "token_ids": tokens})
            }
            Kind::Completion => json!({
                "index": k, "text": text, "finish_reason": finish, "token_ids": tokens,
                "logprobs": {"tokens": texts, "token_logprobs": logprobs, "text_offset": [], "top_logprobs": null},
            }),
        };
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created,
                           "model": self.model, "choices": [choice]});
        if first {
            v["prompt_token_ids"] = json!(self.prompt);
        }
        v
    }
}

fn write_event(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    let mut line = b"data: ".to_vec();
    serde_json::to_writer(&mut line, v).expect("a JSON value serializes");
    line.extend_from_slice(b"\n\n");
    w.write_all(&line)?;
    w.flush()
}

/// The longest prefix of `text` that the tokens still to come cannot take back: before any
/// guard found in it, before a tail that a guard begins with, and without a trailing
/// incomplete character (decoded as U+FFFD).
fn safe_prefix<'t>(text: &'t str, guards: &[String]) -> &'t str {
    let mut end = text.len();
    for g in guards {
        if let Some(at) = text.find(g.as_str()) {
            end = end.min(at);
        }
        let from = text.len().saturating_sub(g.len());
        for (i, _) in text.char_indices().filter(|(i, _)| *i >= from) {
            if g.starts_with(&text[i..]) {
                end = end.min(i);
                break;
            }
        }
    }
    text[..end].trim_end_matches('\u{FFFD}')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bytes;

    /// A chat sample that ends in a tool call: the content streamed stops before the call's
    /// block (and the newline before it), the last chunk brings the call, with its index, and
    /// `tool_calls` as the finish reason.
    #[test]
    fn a_streamed_tool_call_comes_whole_in_the_last_chunk() {
        let d = tempfile::tempdir().unwrap();
        for (name, b) in bytes::build(300).unwrap().files().unwrap() {
            std::fs::write(d.path().join(name), b).unwrap();
        }
        let tok = Tokenizer::from_dir(d.path()).unwrap();
        let text = "Sure.\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"1\"}}\n</tool_call>";
        let ids = tok.encode(text).unwrap();
        let s = Sampling {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            max_tokens: 64,
            stop: vec![],
            seed: None,
            ignore_eos: false,
            stream: true,
        };
        let mut st = Streamer::new(Kind::Chat, "c1", "m", 0, &[1, 2], &tok, &s);
        let mut out = Vec::new();
        for &t in &ids {
            st.tokens(&mut out, &[(0, t, -0.5)]).unwrap();
        }
        let done = Completion {
            tokens: ids.clone(),
            logprobs: vec![-0.5; ids.len()],
            finish: FinishReason::Stop,
            text: text.into(),
            trajectory: None,
        };
        st.finish(&mut out, &[done]).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.ends_with("data: [DONE]\n\n"));
        let chunks: Vec<Value> = out
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|l| *l != "[DONE]")
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(chunks.len(), ids.len() + 1);
        let content: String = chunks
            .iter()
            .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(content, "Sure.");
        let ids_sent: usize = chunks
            .iter()
            .map(|c| c["choices"][0]["token_ids"].as_array().unwrap().len())
            .sum();
        assert_eq!(ids_sent, ids.len());
        let last = &chunks.last().unwrap()["choices"][0];
        assert_eq!(last["finish_reason"], "tool_calls");
        let call = &last["delta"]["tool_calls"][0];
        assert_eq!(call["index"], 0);
        assert_eq!(call["function"]["name"], "python");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[0]["prompt_token_ids"], json!([1, 2]));
    }

    #[test]
    fn what_may_still_change_is_held_back() {
        let g = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(safe_prefix("hello", &g(&[])), "hello");
        // "ST" may begin the stop string "STOP".
        assert_eq!(safe_prefix("hello ST", &g(&["STOP"])), "hello ");
        assert_eq!(safe_prefix("hello STOP and", &g(&["STOP"])), "hello ");
        assert_eq!(safe_prefix("a <tool", &g(&["<tool_call>"])), "a ");
        assert_eq!(safe_prefix("a <b>", &g(&["<tool_call>"])), "a <b>");
        assert_eq!(safe_prefix("caf\u{FFFD}", &g(&[])), "caf");
    }
}
