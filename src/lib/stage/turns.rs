//! What `rollout --tool` adds to the stage: the tools built from their specs, the tokens an
//! observation becomes (the chat template's text around tool responses, each piece and each
//! result tokenized alone), and the inspection columns of multi-turn rows (`num_turns`,
//! `tool_calls`, `messages`).

use crate::bail_input;
use crate::batch::schema;
use crate::data::{ChatTemplate, Message};
use crate::engine::paged::{Completion, Trajectory};
use crate::tokenizer::Tokenizer;
use crate::tool::Tools;
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
    // The tools module's `Toolbox::from_specs(specs, timeout)` builds them.
    let _ = timeout;
    bail_input!("--tool needs the tools module")
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
        let sampled = (1..=first.len().min(turn.len()))
            .rev()
            .find(|&k| turn.ends_with(&first[..k]))
            .unwrap_or(0);
        let mut ids = first[sampled..].to_vec();
        for (content, piece) in contents.iter().zip(&pieces[1..]) {
            ids.extend(self.tokenizer.encode(content)?);
            ids.extend(self.tokenizer.encode(piece)?);
        }
        Ok(ids)
    }
}

/// The conversation of a trajectory: the prompt's messages, then each assistant turn (its text
/// as sampled, calls included) followed by one `tool` message per call it made.
fn conversation(prompt: &[Message], t: &Trajectory) -> Value {
    let mut out: Vec<Value> = prompt.iter().map(|m| json!(m)).collect();
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
#[derive(Default)]
pub(crate) struct TurnColumns {
    pub(crate) mask: Vec<u8>,
    num_turns: Vec<i32>,
    tool_calls: Vec<String>,
    messages: Vec<String>,
    pub(crate) calls: usize,
    pub(crate) errors: usize,
}

impl TurnColumns {
    /// Adds sample `c` of a prompt whose messages are `prompt`.
    pub(crate) fn push(&mut self, c: &Completion, prompt: &[Message]) -> Result<()> {
        let Some(t) = &c.trajectory else {
            anyhow::bail!("a rollout with tools has a sample without its trajectory");
        };
        self.mask.extend_from_slice(&t.mask);
        self.num_turns.push(t.turns.len() as i32);
        self.tool_calls.push(calls_json(t).to_string());
        self.messages.push(conversation(prompt, t).to_string());
        self.calls += t.calls.len();
        self.errors += t.calls.iter().filter(|c| c.error.is_some()).count();
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
