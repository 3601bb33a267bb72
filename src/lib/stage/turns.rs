//! What `rollout --tool` adds to the stage: the tools built from their specs, the tokens an
//! observation becomes (the chat template's text around tool responses, each piece and each
//! result tokenized alone; in the code format the inline ```` ```output ```` block), and the
//! inspection columns of multi-turn rows (`num_turns`, `tool_calls`, `messages`).

use crate::batch::schema;
use crate::data::{ChatTemplate, Message};
use crate::engine::paged::{Completion, Detokenize, Trajectory};
use crate::tokenizer::Tokenizer;
use crate::tool::{code, ToolFormat, Tools};
use anyhow::Result;
use arrow_array::{ArrayRef, Int32Array, StringArray};
use arrow_schema::{DataType, Field};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// The tools of `--tool` specs (None without any).
pub(crate) fn tools_from_specs(
    specs: &[String],
    timeout: Duration,
) -> Result<Option<Arc<dyn Tools>>> {
    if specs.is_empty() {
        return Ok(None);
    }
    let tools: Arc<dyn Tools> =
        Arc::new(crate::tool::toolbox::Toolbox::from_specs(specs, timeout)?);
    Ok(Some(tools))
}

/// The tools of a stage's `--tool` specs, kept by the process for the next job with the same
/// specs and timeout: a warm daemon's jobs (every round of an asynchronous rollout, every
/// step's rollout) then do not start the tool programs again (a round took ~2 s of program
/// start-ups against 0.2 s of generation). Other specs replace them (their programs stop). A
/// program's file is read when it starts: an edit reaches a warm daemon only with other specs
/// or a new daemon.
pub(crate) fn stage_tools(specs: &[String], timeout: Duration) -> Result<Option<Arc<dyn Tools>>> {
    static LAST: LastTools = LastTools(std::sync::Mutex::new(None));
    if specs.is_empty() {
        return Ok(None);
    }
    LAST.get(specs, timeout, || {
        Ok(Arc::new(crate::tool::toolbox::Toolbox::from_specs(
            specs, timeout,
        )?))
    })
    .map(Some)
}

type Kept = (Vec<String>, Duration, Arc<dyn Tools>);

/// The last tools built, with the specs and timeout they were built for.
struct LastTools(std::sync::Mutex<Option<Kept>>);

impl LastTools {
    fn get(
        &self,
        specs: &[String],
        timeout: Duration,
        build: impl FnOnce() -> Result<Arc<dyn Tools>>,
    ) -> Result<Arc<dyn Tools>> {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, t, tools)) = last.as_ref() {
            if s == specs && *t == timeout {
                return Ok(tools.clone());
            }
        }
        // The old programs stop before the new ones start.
        *last = None;
        let tools = build()?;
        *last = Some((specs.to_vec(), timeout, tools.clone()));
        Ok(tools)
    }
}

/// The tokens of the observations that follow a turn: the template's text around the tool
/// responses (`ChatTemplate::tool_response_text`) and the responses, each tokenized alone.
pub(crate) struct ToolText<'a> {
    pub(crate) template: &'a ChatTemplate,
    pub(crate) tokenizer: &'a Tokenizer,
}

impl ToolText<'_> {
    /// The ids appended after `turn` (the turn's sampled ids) for the call results
    /// `contents`. The template's text begins with the end of the assistant turn; the part of it
    /// the model already sampled (its `<|im_end|>`) is not repeated.
    pub(crate) fn observe(&self, turn: &[u32], contents: &[String]) -> Result<Vec<u32>> {
        let pieces = self.template.tool_response_text(contents.len())?;
        let first = self.tokenizer.encode(&pieces[0])?;
        let mut ids = first[sampled_overlap(turn, &first)..].to_vec();
        for (content, piece) in contents.iter().zip(&pieces[1..]) {
            ids.extend(self.tokenizer.encode(content)?);
            ids.extend(self.tokenizer.encode(piece)?);
        }
        Ok(ids)
    }

    /// The code format's observation after a turn whose sampled text is `sampled`: the output
    /// block of its one call's result (`code::output_block`), tokenized alone. No turn marker:
    /// the assistant message goes on.
    pub(crate) fn observe_inline(&self, sampled: &str, contents: &[String]) -> Result<Vec<u32>> {
        let [result] = contents else {
            anyhow::bail!("a code block is one call, not {}", contents.len());
        };
        self.tokenizer
            .encode(&code::output_block(sampled.ends_with('\n'), result))
    }
}

/// The ids an observation adds after `turn` for the results `contents`, in `format`: the
/// template's tool turn (`ToolText::observe`) or, in the code format, the inline output block
/// after the turn's text (decoded by `detok`). Without a chat template (`text` None) there is
/// none.
pub(crate) fn observation(
    text: Option<&ToolText>,
    format: ToolFormat,
    detok: Detokenize,
    (turn, contents): (&[u32], &[String]),
) -> Result<Vec<u32>> {
    match (text, format) {
        (Some(t), ToolFormat::Hermes) => t.observe(turn, contents),
        (Some(t), ToolFormat::Code) => t.observe_inline(&detok(turn)?, contents),
        (None, _) => anyhow::bail!("tool results need the chat template"),
    }
}

/// How many of the first ids of `next` (the template's text after an assistant turn, tokenized)
/// the turn's sampled ids already end with (its `<|im_end|>`): they are not repeated.
pub(crate) fn sampled_overlap(turn: &[u32], next: &[u32]) -> usize {
    (1..=next.len().min(turn.len()))
        .rev()
        .find(|&k| turn.ends_with(&next[..k]))
        .unwrap_or(0)
}

/// The conversation of a trajectory: the prompt's messages, then each assistant turn (its text
/// as sampled, calls included) followed by one `tool` message per call it made. In the code
/// format the response is one assistant message: the turns' text with each call's output
/// block inline, as the model read it.
fn conversation(prompt: &[Message], t: &Trajectory, format: ToolFormat) -> Value {
    let mut out: Vec<Value> = prompt.iter().map(|m| json!(m)).collect();
    if format == ToolFormat::Code {
        let mut content = String::new();
        for (i, text) in t.turns.iter().enumerate() {
            content.push_str(text);
            for c in t.calls.iter().filter(|c| c.turn == i) {
                content.push_str(&code::output_block(text.ends_with('\n'), &c.result));
            }
        }
        out.push(json!({"role": "assistant", "content": content}));
        return Value::Array(out);
    }
    for (i, text) in t.turns.iter().enumerate() {
        out.push(json!({"role": "assistant", "content": text}));
        for c in t.calls.iter().filter(|c| c.turn == i) {
            out.push(json!({"role": "tool", "name": c.name, "content": c.result}));
        }
    }
    Value::Array(out)
}

/// The calls of a trajectory as the `tool_calls` column holds them.
fn calls_json(t: &Trajectory) -> Value {
    Value::Array(
        t.calls
            .iter()
            .map(|c| {
                json!({"turn": c.turn, "name": c.name, "arguments": c.arguments,
                       "result": c.result, "seconds": c.seconds, "error": c.error})
            })
            .collect(),
    )
}

/// The columns of multi-turn rows, one entry per sample in output order.
pub(crate) struct TurnColumns {
    format: ToolFormat,
    pub(crate) mask: Vec<u8>,
    num_turns: Vec<i32>,
    tool_calls: Vec<String>,
    messages: Vec<String>,
    pub(crate) calls: usize,
    pub(crate) errors: usize,
    /// Wall seconds of the calls, summed.
    pub(crate) call_seconds: f64,
}

impl TurnColumns {
    /// No rows yet, of trajectories whose calls are written in `format`.
    pub(crate) fn new(format: ToolFormat) -> TurnColumns {
        TurnColumns {
            format,
            mask: vec![],
            num_turns: vec![],
            tool_calls: vec![],
            messages: vec![],
            calls: 0,
            errors: 0,
            call_seconds: 0.0,
        }
    }

    /// Adds sample `c` of a prompt whose messages are `prompt`.
    pub(crate) fn push(&mut self, c: &Completion, prompt: &[Message]) -> Result<()> {
        let Some(t) = &c.trajectory else {
            anyhow::bail!("a rollout with tools has a sample without its trajectory");
        };
        self.mask.extend_from_slice(&t.mask);
        self.num_turns.push(t.turns.len() as i32);
        self.tool_calls.push(calls_json(t).to_string());
        self.messages
            .push(conversation(prompt, t, self.format).to_string());
        self.calls += t.calls.len();
        self.errors += t.calls.iter().filter(|c| c.error.is_some()).count();
        self.call_seconds += t.calls.iter().map(|c| c.seconds).sum::<f64>();
        Ok(())
    }

    /// `num_turns`, `tool_calls` and `messages`.
    pub(crate) fn columns(self) -> Vec<(Field, ArrayRef)> {
        vec![
            (
                schema::field(schema::NUM_TURNS),
                Arc::new(Int32Array::from(self.num_turns)) as ArrayRef,
            ),
            (
                schema::field(schema::TOOL_CALLS),
                Arc::new(StringArray::from(self.tool_calls)),
            ),
            (
                Field::new(schema::MESSAGES, DataType::Utf8, false),
                Arc::new(StringArray::from(self.messages)),
            ),
        ]
    }

    /// Mean assistant turns per sample.
    pub(crate) fn mean_turns(&self) -> f64 {
        let n = self.num_turns.len().max(1) as f64;
        self.num_turns.iter().map(|&t| t as f64).sum::<f64>() / n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bytes;

    /// The generated byte-level tokenizer and ChatML template in a model directory.
    fn chatml(dir: &std::path::Path) -> (ChatTemplate, Tokenizer) {
        for (name, bytes) in bytes::build(300).unwrap().files().unwrap() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        (
            ChatTemplate::from_dir(dir).unwrap(),
            Tokenizer::from_dir(dir).unwrap(),
        )
    }

    /// A process builds the tools of a spec list once: the same specs and timeout get the same
    /// toolbox back; other specs or another timeout build anew and replace it.
    #[test]
    fn a_process_keeps_the_tools_of_its_last_specs() {
        struct NoTools;
        impl Tools for NoTools {
            fn schemas(&self) -> Vec<Value> {
                vec![]
            }
            fn call(&self, _: &crate::tool::ToolCall, _: &Value) -> crate::tool::ToolResult {
                unreachable!()
            }
        }
        let last = LastTools(std::sync::Mutex::new(None));
        let builds = std::cell::Cell::new(0);
        let build = || -> Result<Arc<dyn Tools>> {
            builds.set(builds.get() + 1);
            Ok(Arc::new(NoTools))
        };
        let (a, b) = (vec!["python".to_string()], vec!["x=cmd:prog".to_string()]);
        let sec = Duration::from_secs(1);
        let first = last.get(&a, sec, build).unwrap();
        let again = last.get(&a, sec, build).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(builds.get(), 1);
        let other = last.get(&b, sec, build).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        let slower = last.get(&b, 2 * sec, build).unwrap();
        assert!(!Arc::ptr_eq(&other, &slower));
        assert_eq!(builds.get(), 3);
        // A failed build keeps nothing: the next call builds again.
        assert!(last.get(&a, sec, || anyhow::bail!("no")).is_err());
        last.get(&a, sec, build).unwrap();
        assert_eq!(builds.get(), 4);
    }

    /// The observation after a turn: the template's markers and each result, tokenized alone;
    /// the turn's own `<|im_end|>` is not repeated, and a turn ended otherwise gets it.
    #[test]
    fn observations_are_the_templates_markers_around_each_result() {
        let dir = tempfile::tempdir().unwrap();
        let (template, tokenizer) = chatml(dir.path());
        let text = ToolText {
            template: &template,
            tokenizer: &tokenizer,
        };
        let enc = |s: &str| tokenizer.encode(s).unwrap();
        let im_end = tokenizer.require_id("<|im_end|>").unwrap();
        let eot = tokenizer.require_id("<|endoftext|>").unwrap();
        let results = ["72".to_string(), "error: boom".to_string()];
        let tail = [
            enc("\n<|im_start|>tool\n"),
            enc("72"),
            enc("<|im_end|>\n<|im_start|>tool\n"),
            enc("error: boom"),
            enc("<|im_end|>\n<|im_start|>assistant\n"),
        ]
        .concat();
        let turn = [enc("<tool_call>{}</tool_call>"), vec![im_end]].concat();
        assert_eq!(text.observe(&turn, &results).unwrap(), tail);
        let turn = [enc("<tool_call>{}</tool_call>"), vec![eot]].concat();
        assert_eq!(
            text.observe(&turn, &results).unwrap(),
            [vec![im_end], tail].concat()
        );
    }

    /// The code format's observation: the output block, tokenized alone, on a line of its own;
    /// its conversation is one assistant message with the output inline.
    #[test]
    fn code_blocks_get_their_output_inline() {
        let dir = tempfile::tempdir().unwrap();
        let (template, tokenizer) = chatml(dir.path());
        let text = ToolText {
            template: &template,
            tokenizer: &tokenizer,
        };
        let enc = |s: &str| tokenizer.encode(s).unwrap();
        let results = ["5\n".to_string()];
        let ids = text.observe_inline("```python\nprint(5)\n```", &results);
        assert_eq!(ids.unwrap(), enc("\n```output\n5\n```\n"));
        let ids = text.observe_inline("```python\nprint(5)\n```\n", &results);
        assert_eq!(ids.unwrap(), enc("```output\n5\n```\n"));
        let two = ["1".to_string(), "2".to_string()];
        assert!(text.observe_inline("x\n", &two).is_err());
        use crate::engine::paged::CallRecord;
        let t = Trajectory {
            mask: vec![],
            turns: vec!["```python\nprint(5)\n```".into(), "#### 5".into()],
            calls: vec![CallRecord {
                turn: 0,
                name: "python".into(),
                arguments: json!({"code": "print(5)"}),
                result: "5\n".into(),
                seconds: 0.1,
                error: None,
            }],
        };
        let prompt = [Message::new("user", "2+3?")];
        assert_eq!(
            conversation(&prompt, &t, ToolFormat::Code),
            json!([
                {"role": "user", "content": "2+3?"},
                {"role": "assistant",
                 "content": "```python\nprint(5)\n```\n```output\n5\n```\n#### 5"}
            ])
        );
    }

    /// The conversation and the calls of a trajectory as the columns hold them.
    #[test]
    fn conversation_and_calls_columns() {
        use crate::engine::paged::CallRecord;
        let t = Trajectory {
            mask: vec![1, 0, 1],
            turns: vec!["call".into(), "#### 5".into()],
            calls: vec![CallRecord {
                turn: 0,
                name: "add".into(),
                arguments: json!({"a": 2}),
                result: "5".into(),
                seconds: 0.5,
                error: None,
            }],
        };
        let prompt = [Message::new("user", "2+3?")];
        assert_eq!(
            conversation(&prompt, &t, ToolFormat::Hermes),
            json!([
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "call"},
                {"role": "tool", "name": "add", "content": "5"},
                {"role": "assistant", "content": "#### 5"}
            ])
        );
        assert_eq!(
            calls_json(&t),
            json!([{"turn": 0, "name": "add", "arguments": {"a": 2}, "result": "5",
                    "seconds": 0.5, "error": null}])
        );
    }
}
