//! The OpenAI API's request and response bodies, as far as the server takes and gives them:
//! chat completions (messages, tools, n, temperature, top_p, max_tokens, stop, seed, user) and
//! text completions. Every response also carries the token ids and log-probs, as vLLM does
//! with `return_token_ids`: `prompt_token_ids` on the response, `token_ids` on each choice,
//! and the log-probs in `logprobs` (the chat shape or the completions shape).

use super::http::Error;
use crate::engine::paged::{Completion, FinishReason};
use crate::tokenizer::Tokenizer;
use crate::tool::{parse_calls, ToolCall};
use serde_json::{json, Map, Value};

/// The server's limits on what one request may ask.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    pub(crate) max_tokens: usize,
    pub(crate) max_n: usize,
}

/// The sampling fields of a request, checked.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Sampling {
    pub(crate) n: usize,
    pub(crate) temperature: f32,
    pub(crate) top_p: f32,
    pub(crate) top_k: i64,
    pub(crate) max_tokens: usize,
    pub(crate) stop: Vec<String>,
    pub(crate) seed: Option<u64>,
    /// vLLM's `ignore_eos`: do not stop at the model's EOS ids.
    pub(crate) ignore_eos: bool,
    /// Answer with server-sent events, a chunk per engine step (`super::stream`).
    pub(crate) stream: bool,
}

/// One message of a chat request: its role, its text, and (assistant) the calls it made.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    /// None: `content` was absent or null.
    pub(crate) content: Option<String>,
    pub(crate) tool_calls: Vec<ToolCall>,
}

impl ChatMessage {
    /// The message's text as the model writes it: its content, then each call in the
    /// Hermes form (`<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`) that Qwen2.5's
    /// template writes for `tool_calls`.
    pub(crate) fn text(&self) -> String {
        let mut text = self.content.clone().unwrap_or_default();
        for c in &self.tool_calls {
            // Name first, as the template and the model write it (serde_json sorts keys).
            let call = format!(
                "{{\"name\": {}, \"arguments\": {}}}",
                json!(c.name),
                c.arguments
            );
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
        }
        text
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug)]
pub(crate) struct ChatRequest {
    pub(crate) model: String,
    pub(crate) messages: Vec<ChatMessage>,
    pub(crate) tools: Vec<Value>,
    pub(crate) sampling: Sampling,
    pub(crate) user: Option<String>,
}

/// What `POST /v1/completions` continues: text, or token ids.
#[derive(Debug, PartialEq)]
pub(crate) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug)]
pub(crate) struct CompletionRequest {
    pub(crate) model: String,
    pub(crate) prompt: Prompt,
    pub(crate) sampling: Sampling,
}

fn bad(message: impl Into<String>) -> Error {
    Error::new(400, message)
}

fn object(body: &Value) -> Result<&Map<String, Value>, Error> {
    body.as_object()
        .ok_or_else(|| bad("the body must be a JSON object"))
}

fn string_field(o: &Map<String, Value>, key: &str) -> Result<Option<String>, Error> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(bad(format!("'{key}' must be a string, not {v}"))),
    }
}

fn number(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, Error> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| bad(format!("'{key}' must be a number, not {v}"))),
    }
}

fn count(o: &Map<String, Value>, key: &str) -> Result<Option<u64>, Error> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(format!("'{key}' must be a non-negative integer, not {v}"))),
    }
}

fn flag(o: &Map<String, Value>, key: &str) -> Result<bool, Error> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(format!("'{key}' must be true or false, not {v}"))),
    }
}

/// The sampling fields shared by both routes, checked against `caps`.
fn sampling(o: &Map<String, Value>, caps: &Caps) -> Result<Sampling, Error> {
    for key in ["presence_penalty", "frequency_penalty"] {
        if number(o, key)?.is_some_and(|x| x != 0.0) {
            return Err(bad(format!("'{key}' is not supported (only 0)")));
        }
    }
    if count(o, "top_logprobs")?.is_some_and(|k| k > 0) {
        return Err(bad(
            "'top_logprobs' is not supported: each token's own log-prob is always returned",
        ));
    }
    let n = count(o, "n")?.unwrap_or(1) as usize;
    if n == 0 || n > caps.max_n {
        return Err(bad(format!(
            "'n' must be in 1..={} (--max-n), not {n}",
            caps.max_n
        )));
    }
    let temperature = number(o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=100.0).contains(&temperature) {
        return Err(bad(format!(
            "'temperature' must be >= 0, not {temperature}"
        )));
    }
    let top_p = number(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(format!("'top_p' must be in (0, 1], not {top_p}")));
    }
    let top_k = match o.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(v) => match v.as_i64() {
            Some(k) if k == -1 || k >= 1 => k,
            _ => {
                return Err(bad(format!(
                    "'top_k' must be -1 or an integer >= 1, not {v}"
                )))
            }
        },
    };
    let max_tokens = match count(o, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => count(o, "max_tokens")?,
    };
    let max_tokens = max_tokens.map_or(caps.max_tokens, |m| m as usize);
    if max_tokens == 0 || max_tokens > caps.max_tokens {
        return Err(bad(format!(
            "'max_tokens' must be in 1..={} (the server's --max-tokens), not {max_tokens}",
            caps.max_tokens
        )));
    }
    let stop = match o.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("'stop' must be a string or an array of strings"))?,
        Some(_) => return Err(bad("'stop' must be a string or an array of strings")),
    };
    if stop.iter().any(String::is_empty) {
        return Err(bad("'stop': stop strings must not be empty"));
    }
    Ok(Sampling {
        n,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        max_tokens,
        stop,
        seed: count(o, "seed")?,
        ignore_eos: flag(o, "ignore_eos")?,
        stream: flag(o, "stream")?,
    })
}

/// A message's content: a string, null, or an array of `{"type": "text", "text": …}` parts.
fn content(i: usize, v: Option<&Value>) -> Result<Option<String>, Error> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(bad(format!(
                            "messages[{i}].content: only text parts are supported, not {p}"
                        )))
                    }
                }
            }
            Ok(Some(text))
        }
        Some(v) => Err(bad(format!(
            "messages[{i}].content must be a string or an array of text parts, not {v}"
        ))),
    }
}

/// An assistant message's `tool_calls` (`[{"type": "function", "function": {"name",
/// "arguments": JSON text}}]`).
fn tool_calls(i: usize, v: Option<&Value>) -> Result<Vec<ToolCall>, Error> {
    let Some(Value::Array(calls)) = v else {
        return match v {
            None | Some(Value::Null) => Ok(vec![]),
            Some(v) => Err(bad(format!(
                "messages[{i}].tool_calls must be an array, not {v}"
            ))),
        };
    };
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let at = format!("messages[{i}].tool_calls[{k}]");
            let f = c
                .get("function")
                .ok_or_else(|| bad(format!("{at} has no 'function'")))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{at}.function has no string 'name'")))?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => json!({}),
                Some(Value::String(s)) => serde_json::from_str(s)
                    .map_err(|e| bad(format!("{at}.function.arguments is not JSON: {e}")))?,
                Some(v) => v.clone(),
            };
            Ok(ToolCall {
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

pub(crate) fn parse_chat(body: &Value, caps: &Caps) -> Result<ChatRequest, Error> {
    let o = object(body)?;
    let model = string_field(o, "model")?.ok_or_else(|| bad("'model' is missing"))?;
    let Some(Value::Array(raw)) = o.get("messages") else {
        return Err(bad("'messages' must be an array of messages"));
    };
    if raw.is_empty() {
        return Err(bad("'messages' is empty"));
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("messages[{i}] has no string 'role'")))?;
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(bad(format!(
                "messages[{i}].role {role:?} is not system, user, assistant or tool"
            )));
        }
        messages.push(ChatMessage {
            role: if role == "developer" { "system" } else { role }.to_string(),
            content: content(i, m.get("content"))?,
            tool_calls: tool_calls(i, m.get("tool_calls"))?,
        });
    }
    let tools = match o.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(t)) if t.iter().all(Value::is_object) => t.clone(),
        Some(_) => return Err(bad("'tools' must be an array of function schemas")),
    };
    Ok(ChatRequest {
        model,
        messages,
        tools,
        sampling: sampling(o, caps)?,
        user: string_field(o, "user")?,
    })
}

pub(crate) fn parse_completion(body: &Value, caps: &Caps) -> Result<CompletionRequest, Error> {
    let o = object(body)?;
    let model = string_field(o, "model")?.ok_or_else(|| bad("'model' is missing"))?;
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Ids(
            a.iter()
                .map(|v| u32::try_from(v.as_u64().unwrap_or(u64::MAX)))
                .collect::<Result<_, _>>()
                .map_err(|_| bad("'prompt': a token id is out of range"))?,
        ),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or_default().to_string())
        }
        _ => return Err(bad(
            "'prompt' must be a non-empty string or an array of token ids (one prompt per request)",
        )),
    };
    Ok(CompletionRequest {
        model,
        prompt,
        sampling: sampling(o, caps)?,
    })
}

/// The assistant message a sampled text becomes: the calls it makes (`parse_calls`; a
/// malformed one stays in the text) as `tool_calls`, the text before them as `content`.
pub(crate) fn assistant_reply(text: &str) -> ChatMessage {
    let calls: Vec<ToolCall> = parse_calls(text)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let content = match calls.is_empty() {
        true => text.to_string(),
        false => text[..text.find("<tool_call>").unwrap_or(text.len())]
            .trim_end()
            .to_string(),
    };
    ChatMessage {
        role: "assistant".into(),
        content: (!content.is_empty() || calls.is_empty()).then_some(content),
        tool_calls: calls,
    }
}

/// A reply message as JSON, its calls with ids `call_{id}_{k}`.
pub(crate) fn message_json(m: &ChatMessage, id: &str) -> Value {
    let mut v = json!({"role": m.role, "content": m.content});
    if !m.tool_calls.is_empty() {
        v["tool_calls"] = Value::Array(
            m.tool_calls
                .iter()
                .enumerate()
                .map(|(k, c)| {
                    json!({"id": format!("call_{id}_{k}"), "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments.to_string()}})
                })
                .collect(),
        );
    }
    v
}

/// Each token's text (special tokens included), for the log-prob entries.
pub(crate) fn token_texts(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&t| tok.decode(&[t], false).unwrap_or_default())
        .collect()
}

fn usage(prompt: usize, samples: &[Completion]) -> Value {
    let completion: usize = samples.iter().map(|c| c.tokens.len()).sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// What both routes' responses share.
pub(crate) struct Reply<'a> {
    pub(crate) id: &'a str,
    pub(crate) model: &'a str,
    pub(crate) created: u64,
    pub(crate) prompt: &'a [u32],
    pub(crate) samples: &'a [Completion],
}

/// The `chat.completion` object of `samples`.
pub(crate) fn chat_response(r: &Reply, tok: &Tokenizer) -> Value {
    let choices: Vec<Value> = r
        .samples
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let m = assistant_reply(&c.text);
            let finish = match (c.finish, m.tool_calls.is_empty()) {
                (FinishReason::Stop, false) => "tool_calls",
                (f, _) => f.as_str(),
            };
            let content: Vec<Value> = token_texts(tok, &c.tokens)
                .into_iter()
                .zip(&c.logprobs)
                .map(|(t, &lp)| json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": []}))
                .collect();
            json!({
                "index": i,
                "message": message_json(&m, &format!("{}_{i}", r.id)),
                "finish_reason": finish,
                "logprobs": {"content": content},
                "token_ids": c.tokens,
            })
        })
        .collect();
    json!({
        "id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
        "choices": choices, "usage": usage(r.prompt.len(), r.samples),
        "prompt_token_ids": r.prompt,
    })
}

/// The `text_completion` object of `samples`.
pub(crate) fn completion_response(r: &Reply, tok: &Tokenizer) -> Value {
    let choices: Vec<Value> = r
        .samples
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i, "text": c.text, "finish_reason": c.finish.as_str(),
                "logprobs": {"tokens": token_texts(tok, &c.tokens), "token_logprobs": c.logprobs,
                             "text_offset": [], "top_logprobs": null},
                "token_ids": c.tokens,
            })
        })
        .collect();
    json!({
        "id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
        "choices": choices, "usage": usage(r.prompt.len(), r.samples),
        "prompt_token_ids": r.prompt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Caps = Caps {
        max_tokens: 64,
        max_n: 4,
    };

    fn chat(body: Value) -> Result<ChatRequest, Error> {
        parse_chat(&body, &CAPS)
    }

    #[test]
    fn a_chat_request_with_tool_calls_and_sampling() {
        let r = chat(json!({
            "model": "m", "n": 2, "temperature": 0.5, "top_p": 0.9, "max_tokens": 10,
            "stop": "END", "seed": 7, "user": "t1",
            "tools": [{"type": "function", "function": {"name": "python"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "python", "arguments": "{\"code\": \"1\"}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "1"},
            ]
        }))
        .unwrap();
        assert_eq!(r.messages[0].content.as_deref(), Some("ab"));
        assert_eq!(
            r.messages[1].text(),
            "<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\":\"1\"}}\n</tool_call>"
        );
        assert_eq!(r.tools.len(), 1);
        assert_eq!(r.user.as_deref(), Some("t1"));
        assert_eq!(
            r.sampling,
            Sampling {
                n: 2,
                temperature: 0.5,
                top_p: 0.9,
                top_k: -1,
                max_tokens: 10,
                stop: vec!["END".into()],
                seed: Some(7),
                ignore_eos: false,
                stream: false,
            }
        );
        // Defaults: one sample, temperature 1, the server's max_tokens.
        let d =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(
            (d.sampling.n, d.sampling.temperature, d.sampling.max_tokens),
            (1, 1.0, 64)
        );
    }

    #[test]
    fn bad_fields_name_themselves() {
        let m = json!([{"role": "user", "content": "x"}]);
        for (body, needle) in [
            (json!([]), "JSON object"),
            (json!({"messages": m}), "'model' is missing"),
            (json!({"model": "m"}), "'messages'"),
            (json!({"model": "m", "messages": []}), "empty"),
            (
                json!({"model": "m", "messages": [{"content": "x"}]}),
                "messages[0] has no string 'role'",
            ),
            (
                json!({"model": "m", "messages": [{"role": "bot", "content": "x"}]}),
                "\"bot\"",
            ),
            (
                json!({"model": "m", "messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                json!({"model": "m", "messages": m, "max_tokens": 65}),
                "1..=64",
            ),
            (
                json!({"model": "m", "messages": m, "max_tokens": 0}),
                "'max_tokens'",
            ),
            (json!({"model": "m", "messages": m, "n": 5}), "'n'"),
            (
                json!({"model": "m", "messages": m, "temperature": -1}),
                "'temperature'",
            ),
            (json!({"model": "m", "messages": m, "top_p": 0}), "'top_p'"),
            (json!({"model": "m", "messages": m, "stop": [1]}), "'stop'"),
            (json!({"model": "m", "messages": m, "seed": -3}), "'seed'"),
            (
                json!({"model": "m", "messages": m, "stream": "yes"}),
                "'stream' must be true or false",
            ),
            (
                json!({"model": "m", "messages": m, "tools": "x"}),
                "'tools'",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    #[test]
    fn completions_take_text_or_ids() {
        let p = |v: Value| parse_completion(&json!({"model": "m", "prompt": v}), &CAPS);
        assert_eq!(p(json!("hi")).unwrap().prompt, Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap().prompt, Prompt::Ids(vec![1, 2]));
        assert_eq!(p(json!(["hi"])).unwrap().prompt, Prompt::Text("hi".into()));
        for bad in [
            json!(""),
            json!([]),
            json!([-1]),
            json!(["a", "b"]),
            json!(3),
        ] {
            assert_eq!(p(bad.clone()).unwrap_err().status, 400, "{bad}");
        }
    }

    #[test]
    fn sampled_calls_become_tool_calls_and_render_back() {
        let text = "let me run it\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(2)\"}}\n</tool_call>";
        let m = assistant_reply(text);
        assert_eq!(m.content.as_deref(), Some("let me run it"));
        assert_eq!(m.tool_calls[0].name, "python");
        let v = message_json(&m, "x");
        assert_eq!(v["tool_calls"][0]["id"], "call_x_0");
        assert_eq!(
            v["tool_calls"][0]["function"]["arguments"],
            "{\"code\":\"print(2)\"}"
        );
        // A malformed call stays in the content.
        let m = assistant_reply("<tool_call>{bad}</tool_call>");
        assert!(m.tool_calls.is_empty());
        assert_eq!(m.content.as_deref(), Some("<tool_call>{bad}</tool_call>"));
    }
}
