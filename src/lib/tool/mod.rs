//! Tools an agent calls during a multi-turn rollout: the call the model writes (Hermes / Qwen2.5
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, or a fenced Python block in the code
//! format, `code`), what comes back, and the `Tools` trait the engine calls them through. A failed call is never an error of the stage: it comes
//! back as content the model reads, with `error` set for the metrics.

use serde_json::Value;

pub mod code;
mod confine;
mod pool;
mod protocol;
pub mod sandbox;
pub mod serve;
pub mod toolbox;

pub use toolbox::Toolbox;

/// One call parsed from the model's text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

/// What a call gave: `content` is what the model reads next (on failure, the error's text,
/// e.g. `error: tool timed out after 10 s`); `error` is set when the call failed.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolResult {
    pub content: String,
    pub seconds: f64,
    pub error: Option<String>,
}

impl ToolResult {
    /// A failed call: the model reads `error: MESSAGE`.
    pub fn failed(message: impl Into<String>, seconds: f64) -> ToolResult {
        let message = message.into();
        ToolResult {
            content: format!("error: {message}"),
            seconds,
            error: Some(message),
        }
    }
}

/// The tools offered to a rollout. Called from several threads at once (`--tool-concurrency`).
pub trait Tools: Send + Sync {
    /// One OpenAI function schema per tool (`{"type": "function", "function": {…}}`), in the
    /// order the chat template's `tools` lists them.
    fn schemas(&self) -> Vec<Value>;
    /// Runs one call; never fails (an unknown tool, a crash or a timeout is a `ToolResult::failed`).
    /// `kwargs` is the trajectory's row's tool arguments, verl's `tools_kwargs`
    /// (`{TOOL: {"create_kwargs": {…}, "execute_kwargs": {…}, "release_kwargs": {…}}}`), or
    /// null when the row has none; the tool takes its own entry.
    fn call(&self, call: &ToolCall, kwargs: &Value) -> ToolResult;
}

/// Which part of a long tool result the model reads (verl's `tool_response_truncate_side`):
/// `Left` keeps the first characters, `Right` the last, `Middle` both ends.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Left,
    Right,
    Middle,
}

/// `content` cut to `max_chars` characters (Unicode scalar values, as Python's `len`) the way
/// verl's tool agent loop cuts a tool response, with its markers: `Left` keeps the first
/// `max_chars` and appends `...(truncated)`, `Right` keeps the last behind `(truncated)...`,
/// `Middle` keeps `max_chars / 2` of each end around `...(truncated)...`. Unchanged when it
/// fits.
pub fn truncate(content: &str, max_chars: usize, side: Side) -> String {
    let n = content.chars().count();
    if n <= max_chars {
        return content.to_string();
    }
    let head = |k: usize| content.chars().take(k).collect::<String>();
    let tail = |k: usize| content.chars().skip(n - k).collect::<String>();
    match side {
        Side::Left => format!("{}...(truncated)", head(max_chars)),
        Side::Right => format!("(truncated)...{}", tail(max_chars)),
        Side::Middle => {
            let half = max_chars / 2;
            format!("{}...(truncated)...{}", head(half), tail(half))
        }
    }
}

/// How the model's text calls tools (`--tool-format`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ToolFormat {
    /// Hermes / Qwen2.5: a turn that ends (at EOS) with `<tool_call>{…}</tool_call>` blocks
    /// calls them; the results come back as the chat template's tool turn.
    #[default]
    Hermes,
    /// Tool-integrated reasoning: a closed ```` ```python ```` block ends the turn and runs in
    /// the `python` tool; its output follows inline, in the same assistant message.
    Code,
}

impl ToolFormat {
    /// The calls in the text of a turn that ended (`code`: at most one, the closed block).
    pub fn parse(self, text: &str) -> Vec<Result<ToolCall, String>> {
        match self {
            ToolFormat::Hermes => parse_calls(text),
            ToolFormat::Code => code::parse_block(text).into_iter().map(Ok).collect(),
        }
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Every `<tool_call>…</tool_call>` in an assistant turn, in order: `Ok` for a call with a
/// string `name` and an object `arguments` (absent = `{}`), `Err` with the reason for one the
/// model wrote badly (the reason becomes the observation). An opening tag left unclosed is a
/// malformed call.
pub fn parse_calls(text: &str) -> Vec<Result<ToolCall, String>> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            calls.push(Err(format!("{OPEN} without {CLOSE}")));
            break;
        };
        calls.push(parse_one(after[..end].trim()));
        rest = &after[end + CLOSE.len()..];
    }
    calls
}

fn parse_one(body: &str) -> Result<ToolCall, String> {
    let value: Value =
        serde_json::from_str(body).map_err(|e| format!("tool call is not JSON: {e}"))?;
    let name = value
        .get("name")
        .and_then(Value::as_str)
        .ok_or("tool call has no string \"name\"")?;
    let arguments = match value.get("arguments") {
        None => Value::Object(Default::default()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        // Some models write the arguments as a JSON string; accept it when it holds an object.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Err("tool call \"arguments\" is not an object".into()),
        },
        Some(_) => return Err("tool call \"arguments\" is not an object".into()),
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_are_parsed_in_order_with_their_errors() {
        let text = "think\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(1)\"}}\n</tool_call>\
                    <tool_call>{\"name\": \"f\"}</tool_call><tool_call>{bad}</tool_call>\
                    <tool_call>{\"name\": \"g\", \"arguments\": \"{\\\"x\\\": 2}\"}</tool_call><tool_call>{\"name\"";
        let calls = parse_calls(text);
        assert_eq!(calls.len(), 5);
        assert_eq!(
            calls[0],
            Ok(ToolCall {
                name: "python".into(),
                arguments: json!({"code": "print(1)"})
            })
        );
        assert_eq!(
            calls[1],
            Ok(ToolCall {
                name: "f".into(),
                arguments: json!({})
            })
        );
        assert!(calls[2]
            .as_ref()
            .unwrap_err()
            .starts_with("tool call is not JSON"));
        assert_eq!(
            calls[3],
            Ok(ToolCall {
                name: "g".into(),
                arguments: json!({"x": 2})
            })
        );
        assert_eq!(calls[4], Err("<tool_call> without </tool_call>".into()));
        assert!(parse_calls("no calls here").is_empty());
    }

    #[test]
    fn long_results_are_cut_as_verl_cuts_them() {
        let s = "abcdefghij";
        assert_eq!(truncate(s, 10, Side::Middle), s);
        assert_eq!(truncate(s, 4, Side::Left), "abcd...(truncated)");
        assert_eq!(truncate(s, 4, Side::Right), "(truncated)...ghij");
        assert_eq!(truncate(s, 5, Side::Middle), "ab...(truncated)...ij");
        // Characters, not bytes.
        assert_eq!(truncate("ééééé", 2, Side::Left), "éé...(truncated)");
        assert_eq!(truncate("", 0, Side::Right), "");
    }

    #[test]
    fn a_failed_call_reads_as_an_error_observation() {
        let r = ToolResult::failed("tool timed out after 10 s", 10.0);
        assert_eq!(r.content, "error: tool timed out after 10 s");
        assert_eq!(r.error.as_deref(), Some("tool timed out after 10 s"));
    }
}
