//! Generic jsonl import: one JSON object per line, the prompt and the answer under keys the user
//! names, into verl's prompt schema (the same columns as the GSM8K import).

use super::{jsonl_lines, parse_object, ExtraInfo, Message, VerlRow};
use crate::bail_input;
use anyhow::Result;
use serde_json::Value;
use std::path::Path;

/// How to turn each record into a prompt row.
#[derive(Clone, Debug)]
pub(crate) struct JsonlOptions {
    /// Key of the prompt: a string (becomes one user message) or a list of `{role, content}`.
    /// A dotted path (`a.b`) reaches into nested objects when no key has the dotted name.
    pub(crate) prompt_key: String,
    /// Key of the reference answer (string; numbers and other values are kept as JSON text).
    pub(crate) answer_key: String,
    pub(crate) data_source: String,
    pub(crate) split: String,
    pub(crate) ability: Option<String>,
    /// A system message put before text prompts.
    pub(crate) system: Option<String>,
    /// Text appended to text prompts after one space (verl's scripts add their instruction so).
    pub(crate) instruction: Option<String>,
}

/// `key` in `obj`, or the dotted path `a.b.c` through nested objects.
fn lookup<'a>(obj: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    if let Some(v) = obj.get(key) {
        return Some(v);
    }
    let mut parts = key.split('.');
    let mut cur = obj.get(parts.next()?)?;
    for p in parts {
        cur = cur.as_object()?.get(p)?;
    }
    Some(cur)
}

/// Parse a JSON message list `[{role, content}, ...]`; `Err` holds what is wrong.
pub(crate) fn messages_from_json(items: &[Value]) -> std::result::Result<Vec<Message>, String> {
    if items.is_empty() {
        return Err("the message list is empty".into());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let get = |k: &str| match m.get(k) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(v) => Err(format!(
                    "message {i}: '{k}' must be a string, found {}",
                    super::json_kind(v)
                )),
                None => Err(format!("message {i}: '{k}' is missing")),
            };
            if !m.is_object() {
                return Err(format!(
                    "message {i} must be an object with 'role' and 'content', found {}",
                    super::json_kind(m)
                ));
            }
            Ok(Message {
                role: get("role")?,
                content: get("content")?,
            })
        })
        .collect()
}

/// Read a jsonl file into verl rows, with each row's tool arguments (verl's `tools_kwargs`, a
/// top-level key or `extra_info.tools_kwargs`; None when absent). Bad records are input errors
/// naming file and line.
pub(crate) fn read(path: &Path, opts: &JsonlOptions) -> Result<(Vec<VerlRow>, Vec<Option<Value>>)> {
    let shown = path.display();
    let mut rows = Vec::new();
    let mut kwargs = Vec::new();
    for (line_no, line) in jsonl_lines(path)? {
        let obj = parse_object(path, line_no, &line)?;
        let at = |key: &str| format!("{shown}:{line_no}: field '{key}'");
        kwargs.push(
            tools_kwargs(&obj)
                .map_err(|(key, e)| crate::error::input_error(format!("{}: {e}", at(key))))?,
        );
        let (prompt, question) = match lookup(&obj, &opts.prompt_key) {
            Some(Value::String(text)) => {
                let content = match &opts.instruction {
                    Some(ins) => format!("{text} {ins}"),
                    None => text.clone(),
                };
                let mut messages = Vec::new();
                if let Some(system) = &opts.system {
                    messages.push(Message::new("system", system.as_str()));
                }
                messages.push(Message::new("user", content));
                (messages, text.clone())
            }
            Some(Value::Array(items)) => {
                if opts.system.is_some() || opts.instruction.is_some() {
                    bail_input!(
                        "{}: --system and --instruction apply to text prompts, this one is a message list",
                        at(&opts.prompt_key)
                    );
                }
                let messages = messages_from_json(items).map_err(|e| {
                    crate::error::input_error(format!("{}: {e}", at(&opts.prompt_key)))
                })?;
                (messages, Value::Array(items.clone()).to_string())
            }
            Some(v) => bail_input!(
                "{}: expected a string or a list of {{role, content}} messages, found {}",
                at(&opts.prompt_key),
                super::json_kind(v)
            ),
            None => bail_input!("{} is missing", at(&opts.prompt_key)),
        };
        let answer = match lookup(&obj, &opts.answer_key) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => bail_input!(
                "{} is missing (every prompt needs a reference answer)",
                at(&opts.answer_key)
            ),
            Some(v) => v.to_string(),
        };
        rows.push(VerlRow {
            data_source: opts.data_source.clone(),
            prompt,
            ability: opts.ability.clone(),
            ground_truth: answer.clone(),
            extra_info: ExtraInfo {
                split: opts.split.clone(),
                index: rows.len() as i64,
                answer,
                question,
            },
        });
    }
    if rows.is_empty() {
        bail_input!("{shown}: no records (the file is empty)");
    }
    Ok((rows, kwargs))
}

/// A record's tool arguments, checked: its `tools_kwargs`, else its `extra_info.tools_kwargs`;
/// Err names the key and what is wrong.
fn tools_kwargs(
    obj: &serde_json::Map<String, Value>,
) -> std::result::Result<Option<Value>, (&'static str, String)> {
    use super::tools_kwargs::{parse, COLUMN};
    let (key, value) = match obj.get(COLUMN) {
        Some(v) => (COLUMN, Some(v)),
        None => (
            "extra_info.tools_kwargs",
            obj.get("extra_info").and_then(|e| e.get(COLUMN)),
        ),
    };
    value.map_or(Ok(None), |v| parse(v).map_err(|e| (key, e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> JsonlOptions {
        JsonlOptions {
            prompt_key: "q".into(),
            answer_key: "meta.a".into(),
            data_source: "mine".into(),
            split: "train".into(),
            ability: None,
            system: None,
            instruction: None,
        }
    }

    fn write(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn text_and_chat_prompts_with_dotted_answer_key() {
        let (_d, path) = write(concat!(
            "{\"q\": \"What is 2+2?\", \"meta\": {\"a\": 4}}\n",
            "{\"q\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"U\"}], \"meta\": {\"a\": \"x\"}}\n",
        ));
        let (rows, _) = read(&path, &opts()).unwrap();
        assert_eq!(rows[0].prompt, vec![Message::new("user", "What is 2+2?")]);
        assert_eq!(rows[0].ground_truth, "4");
        assert_eq!(rows[0].extra_info.question, "What is 2+2?");
        assert_eq!(
            rows[1].prompt,
            vec![Message::new("system", "S"), Message::new("user", "U")]
        );
        assert_eq!(rows[1].ground_truth, "x");
        assert_eq!(rows[1].extra_info.index, 1);
        let question: Value = serde_json::from_str(&rows[1].extra_info.question).unwrap();
        assert_eq!(
            question,
            serde_json::json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
        );
    }

    #[test]
    fn system_and_instruction_wrap_text_prompts() {
        let (_d, path) = write("{\"q\": \"Q\", \"meta\": {\"a\": \"1\"}}\n");
        let mut o = opts();
        o.system = Some("Be brief.".into());
        o.instruction = Some("Answer with a number.".into());
        let (rows, _) = read(&path, &o).unwrap();
        assert_eq!(
            rows[0].prompt,
            vec![
                Message::new("system", "Be brief."),
                Message::new("user", "Q Answer with a number.")
            ]
        );
    }

    #[test]
    fn bad_records_name_line_and_field() {
        let cases = [
            ("{\"meta\": {\"a\": 1}}", "field 'q' is missing"),
            ("{\"q\": \"x\", \"meta\": {}}", "field 'meta.a' is missing"),
            (
                "{\"q\": 5, \"meta\": {\"a\": 1}}",
                "expected a string or a list",
            ),
            (
                "{\"q\": [{\"role\": \"user\"}], \"meta\": {\"a\": 1}}",
                "message 0: 'content' is missing",
            ),
            (
                "{\"q\": [], \"meta\": {\"a\": 1}}",
                "the message list is empty",
            ),
            ("{\"q\": \"x\", ", "not valid JSON"),
        ];
        for (line, want) in cases {
            let (_d, path) = write(&format!(
                "{{\"q\": \"ok\", \"meta\": {{\"a\": 1}}}}\n{line}\n"
            ));
            let err = read(&path, &opts()).unwrap_err();
            let msg = format!("{err:#}");
            assert!(crate::error::is_input_error(&err), "{msg}");
            assert!(msg.contains("in.jsonl:2:"), "{msg}");
            assert!(msg.contains(want), "{line}: {msg}");
        }
    }
}
