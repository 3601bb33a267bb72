//! Trajectories: the turns of one agent episode, recorded token in, token out. A chat request
//! tagged with a trajectory id renders its conversation with each earlier assistant message
//! the server returned standing for the ids it sampled (not its text re-tokenized), and the
//! new prompt must extend the previous prompt + completion token for token; otherwise the
//! request is refused (409) with the first differing position. Collected, the trajectories
//! are a batch in the multi-turn contract (docs/BATCH.md): the first prompt as `prompt_ids`,
//! every later token as the response, `response_mask` 0 on what the client added.

use super::api::{assistant_reply, ChatMessage};
use super::http::Error;
use crate::backend::ops::sample::sample_key;
use crate::batch::schema::{self, meta};
use crate::batch::{list_array, stage_meta, write_file, StageInfo};
use crate::data::{ChatTemplate, Message};
use crate::engine::paged::{Completion, FinishReason};
use crate::stage::rollout::sequence_columns;
use crate::stage::turns::sampled_overlap;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use arrow_array::types::Float32Type;
use arrow_array::{ArrayRef, Float32Array, Int32Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// One turn: the prompt it was asked, the ids and log-probs sampled, and the reply returned.
#[derive(Clone, Debug)]
pub(crate) struct Turn {
    pub(crate) prompt: Vec<u32>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) text: String,
    pub(crate) finish: FinishReason,
    pub(crate) reply: ChatMessage,
}

impl Turn {
    pub(crate) fn new(prompt: Vec<u32>, c: &Completion) -> Turn {
        Turn {
            prompt,
            tokens: c.tokens.clone(),
            logprobs: c.logprobs.clone(),
            text: c.text.clone(),
            finish: c.finish,
            reply: assistant_reply(&c.text),
        }
    }

    /// Whether a message the client sent back is this turn's reply: same text, same calls
    /// (arguments compared as JSON values).
    fn is_reply(&self, m: &ChatMessage) -> bool {
        m.role == "assistant"
            && m.content.as_deref().unwrap_or("") == self.reply.content.as_deref().unwrap_or("")
            && m.tool_calls == self.reply.tool_calls
    }
}

/// A trajectory being recorded.
#[derive(Debug, Default)]
pub(crate) struct Trajectory {
    pub(crate) turns: Vec<Turn>,
    /// A turn is being generated (a second one at once is refused).
    pub(crate) busy: bool,
    pub(crate) reward: Option<f32>,
    pub(crate) ground_truth: Option<String>,
    pub(crate) data_source: Option<String>,
    /// The last request's messages with the last reply.
    pub(crate) messages: Value,
    pub(crate) logprob_temperature: f32,
}

fn marker(i: usize) -> String {
    format!("\u{E000}turn{i}\u{E000}")
}

/// The prompt ids of a chat: the template's text, with the assistant messages that are the
/// replies of `turns` (the k-th assistant message for turn k) replaced by the ids sampled for
/// them; every other piece of text tokenized alone. Without turns: the rendered text tokenized.
pub(crate) fn chat_prompt(
    template: &ChatTemplate,
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: &[Value],
    turns: &[Turn],
) -> Result<Vec<u32>, Error> {
    let mut rendered = Vec::with_capacity(messages.len());
    let mut sampled: Vec<&Turn> = Vec::new();
    let mut k = 0usize;
    for m in messages {
        let content = match m.role.as_str() {
            "assistant" => {
                let turn = turns.get(k).filter(|t| t.is_reply(m));
                k += 1;
                match turn {
                    Some(t) => {
                        sampled.push(t);
                        marker(sampled.len() - 1)
                    }
                    None => m.text(),
                }
            }
            _ => m.text(),
        };
        rendered.push(Message::new(&m.role, content));
    }
    let text = template
        .render_tools(&rendered, true, &serde_json::Map::new(), tools)
        .map_err(|e| Error::new(400, format!("messages: {e:#}")))?;
    let encode = |s: &str| tok.encode(s).map_err(|e| Error::new(400, format!("{e:#}")));
    let mut rest = text.as_str();
    let mut ids = Vec::new();
    let mut prev: Option<&[u32]> = None;
    for (i, t) in sampled.iter().enumerate() {
        let m = marker(i);
        let Some(at) = rest.find(&m) else {
            return Err(Error::new(
                500,
                "the chat template dropped an assistant message",
            ));
        };
        push_piece(&mut ids, encode(&rest[..at])?, prev);
        ids.extend_from_slice(&t.tokens);
        prev = Some(&t.tokens);
        rest = &rest[at + m.len()..];
    }
    push_piece(&mut ids, encode(rest)?, prev);
    Ok(ids)
}

/// Appends a piece of template text after a sampled turn, less what the turn already ends with.
fn push_piece(ids: &mut Vec<u32>, piece: Vec<u32>, after: Option<&[u32]>) {
    let skip = after.map_or(0, |t| sampled_overlap(t, &piece));
    ids.extend_from_slice(&piece[skip..]);
}

/// Checks that `prompt` extends the last turn's prompt + completion token for token.
pub(crate) fn check_extends(id: &str, turns: &[Turn], prompt: &[u32]) -> Result<(), Error> {
    let Some(last) = turns.last() else {
        return Ok(());
    };
    let earlier: Vec<u32> = [&last.prompt[..], &last.tokens[..]].concat();
    let differs = earlier
        .iter()
        .zip(prompt)
        .position(|(a, b)| a != b)
        .or((prompt.len() < earlier.len()).then_some(prompt.len()));
    match differs {
        None => Ok(()),
        Some(p) => Err(Error::new(
            409,
            format!(
                "trajectory '{id}': the prompt of turn {} does not extend the earlier prompt + completion ({} tokens) token for token: first difference at position {p} (prompt has {}, expected {}); send the earlier assistant messages back as they were returned",
                turns.len(),
                earlier.len(),
                prompt.get(p).map_or("nothing".into(), |t| t.to_string()),
                earlier[p]
            ),
        )),
    }
}

/// The rows of collected trajectories (in the order given), as the multi-turn contract's columns.
pub(crate) fn batch_of(trajs: &[(String, Trajectory)]) -> Result<RecordBatch> {
    let mut uids = Vec::new();
    let mut puids = Vec::new();
    let (mut p_off, mut p_ids) = (vec![0usize], Vec::new());
    let (mut r_off, mut r_ids, mut mask, mut lps) =
        (vec![0usize], Vec::new(), Vec::new(), Vec::new());
    let (mut texts, mut reasons, mut turns, mut calls, mut messages) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut sources, mut truths) = (vec![], vec![]);
    for (id, t) in trajs {
        let first = &t.turns[0].prompt;
        uids.push(id.clone());
        puids.push(format!("{:016x}", sample_key(0, first, 0, u64::MAX)));
        p_ids.extend(first.iter().map(|&x| x as i32));
        p_off.push(p_ids.len());
        let mut end = first.len();
        let mut row_calls = Vec::new();
        for (k, turn) in t.turns.iter().enumerate() {
            // What the client added since the last completion (tool results, a user turn).
            let added = &turn.prompt[end..];
            r_ids.extend(added.iter().map(|&x| x as i32));
            mask.extend(std::iter::repeat_n(0u8, added.len()));
            lps.extend(std::iter::repeat_n(0f32, added.len()));
            r_ids.extend(turn.tokens.iter().map(|&x| x as i32));
            mask.extend(std::iter::repeat_n(1u8, turn.tokens.len()));
            lps.extend_from_slice(&turn.logprobs);
            end = turn.prompt.len() + turn.tokens.len();
            row_calls.extend(
                turn.reply
                    .tool_calls
                    .iter()
                    .map(|c| json!({"turn": k, "name": c.name, "arguments": c.arguments})),
            );
        }
        r_off.push(r_ids.len());
        let last = t.turns.last().expect("a collected trajectory has a turn");
        texts.push(last.text.clone());
        reasons.push(last.finish.as_str());
        turns.push(t.turns.len() as i32);
        calls.push(Value::Array(row_calls).to_string());
        messages.push(t.messages.to_string());
        sources.push(t.data_source.clone().unwrap_or_else(|| "serve".into()));
        truths.push(t.ground_truth.clone().unwrap_or_default());
    }
    let dataset: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::DATA_SOURCE),
            Arc::new(StringArray::from(sources)),
        ),
        (
            Field::new(schema::GROUND_TRUTH, DataType::Utf8, false),
            Arc::new(StringArray::from(truths)),
        ),
    ];
    let mut cols = sequence_columns(
        uids,
        puids,
        dataset,
        (&p_off, p_ids),
        (&r_off, r_ids, Some(mask)),
        texts,
    );
    cols.extend([
        (
            schema::field(schema::FINISH_REASON),
            Arc::new(StringArray::from(reasons)) as ArrayRef,
        ),
        (
            schema::field(schema::ROLLOUT_LOGPROBS),
            list_array::<Float32Type>(&r_off, lps),
        ),
        (
            schema::field(schema::NUM_TURNS),
            Arc::new(Int32Array::from(turns)),
        ),
        (
            schema::field(schema::TOOL_CALLS),
            Arc::new(StringArray::from(calls)),
        ),
        (
            Field::new(schema::MESSAGES, DataType::Utf8, false),
            Arc::new(StringArray::from(messages)),
        ),
    ]);
    // Null where the client posted no reward: `score --reward agent` names those rows.
    let rewards: Vec<Option<f32>> = trajs.iter().map(|(_, t)| t.reward).collect();
    if rewards.iter().any(Option::is_some) {
        let nullable = rewards.iter().any(Option::is_none);
        cols.push((
            Field::new(schema::SCORE, DataType::Float32, nullable),
            Arc::new(Float32Array::from(rewards)),
        ));
    }
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)?)
}

/// Writes collected trajectories to `out` (atomically) with the batch metadata: the policy
/// version and the log-prob temperature, which must be one for the whole batch.
pub(crate) fn write_batch(
    out: &Path,
    trajs: &[(String, Trajectory)],
    model: &Path,
    policy_version: u64,
) -> Result<(), Error> {
    let temperature = trajs[0].1.logprob_temperature;
    if let Some((id, t)) = trajs
        .iter()
        .find(|(_, t)| t.logprob_temperature != temperature)
    {
        return Err(Error::new(
            409,
            format!(
                "trajectory '{id}' was sampled at temperature {} and '{}' at {temperature}: a batch has one log-prob temperature; collect them apart",
                t.logprob_temperature, trajs[0].0
            ),
        ));
    }
    let info = StageInfo {
        stage: "serve",
        params: json!({"model": model.display().to_string(), "trajectories": trajs.len()}),
        policy_version: Some(policy_version),
        step: None,
    };
    let mut kv: BTreeMap<String, String> = stage_meta(BTreeMap::new(), &info);
    kv.insert(meta::LOGPROB_TEMPERATURE.into(), temperature.to_string());
    let data = batch_of(trajs).map_err(|e| Error::new(500, format!("{e:#}")))?;
    write_file(out, &data, &kv)
        .map_err(|e| Error::new(500, format!("writing {}: {e:#}", out.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bytes;

    fn chatml(dir: &Path) -> (ChatTemplate, Tokenizer) {
        for (name, bytes) in bytes::build(300).unwrap().files().unwrap() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        (
            ChatTemplate::from_dir(dir).unwrap(),
            Tokenizer::from_dir(dir).unwrap(),
        )
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: vec![],
        }
    }

    /// Token in, token out: the second prompt holds the sampled ids (not their text
    /// re-tokenized) and extends the first prompt + completion; the completion's `<|im_end|>`
    /// is not repeated. A reply the client changed is rendered as text and caught.
    #[test]
    fn a_second_turn_extends_the_first_token_for_token() {
        let d = tempfile::tempdir().unwrap();
        let (tpl, tok) = chatml(d.path());
        let im_end = tok.require_id("<|im_end|>").unwrap();
        let first = vec![msg("user", "hi")];
        let p1 = chat_prompt(&tpl, &tok, &first, &[], &[]).unwrap();
        assert_eq!(
            p1,
            tok.encode(&tpl.render(&[Message::new("user", "hi")], true).unwrap())
                .unwrap()
        );
        // A sampled reply whose ids are not what its text encodes to (the ids stand for it).
        let text = "ok";
        let tokens = [tok.encode("zz").unwrap(), vec![im_end]].concat();
        let c = Completion {
            tokens: tokens.clone(),
            logprobs: vec![-0.5; tokens.len()],
            finish: FinishReason::Stop,
            text: text.into(),
            trajectory: None,
        };
        let turns = vec![Turn::new(p1.clone(), &c)];
        let second = vec![
            msg("user", "hi"),
            msg("assistant", "ok"),
            msg("user", "more"),
        ];
        let p2 = chat_prompt(&tpl, &tok, &second, &[], &turns).unwrap();
        check_extends("t", &turns, &p2).unwrap();
        let tail = tok
            .encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
            .unwrap();
        assert_eq!(p2, [p1.clone(), tokens.clone(), tail].concat());
        // The client changed the reply: rendered as text, refused at the first reply token.
        let changed = vec![
            msg("user", "hi"),
            msg("assistant", "OK"),
            msg("user", "more"),
        ];
        let p3 = chat_prompt(&tpl, &tok, &changed, &[], &turns).unwrap();
        let e = check_extends("t", &turns, &p3).unwrap_err();
        assert_eq!(e.status, 409);
        assert!(
            e.message
                .contains(&format!("first difference at position {}", p1.len())),
            "{}",
            e.message
        );
        // A shorter prompt differs where it ends.
        let e = check_extends("t", &turns, &p1[..3]).unwrap_err();
        assert!(
            e.message.contains("position 3 (prompt has nothing"),
            "{}",
            e.message
        );
    }

    /// A reply with a tool call comes back in the OpenAI shape (`tool_calls`, arguments as a
    /// JSON string, content null) with the tool's result: it still stands for its sampled ids.
    #[test]
    fn a_tool_call_reply_sent_back_in_the_openai_shape_is_the_sampled_turn() {
        use super::super::api::{message_json, parse_chat, Caps};
        let d = tempfile::tempdir().unwrap();
        let (tpl, tok) = chatml(d.path());
        let im_end = tok.require_id("<|im_end|>").unwrap();
        let first = vec![msg("user", "6*7?")];
        let p1 = chat_prompt(&tpl, &tok, &first, &[], &[]).unwrap();
        let text = "<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(6*7)\"}}\n</tool_call>";
        let tokens = [tok.encode(text).unwrap(), vec![im_end]].concat();
        let c = Completion {
            tokens: tokens.clone(),
            logprobs: vec![-0.1; tokens.len()],
            finish: FinishReason::Stop,
            text: text.into(),
            trajectory: None,
        };
        let turns = vec![Turn::new(p1.clone(), &c)];
        let reply = message_json(&turns[0].reply, "x");
        assert!(reply["content"].is_null());
        let body = json!({"model": "m", "messages": [
            {"role": "user", "content": "6*7?"}, reply,
            {"role": "tool", "tool_call_id": "call_x_0", "content": "42"}]});
        let req = parse_chat(
            &body,
            &Caps {
                max_tokens: 8,
                max_n: 1,
            },
        )
        .unwrap();
        let p2 = chat_prompt(&tpl, &tok, &req.messages, &[], &turns).unwrap();
        check_extends("t", &turns, &p2).unwrap();
        assert_eq!(p2[..p1.len() + tokens.len()], [p1, tokens].concat()[..]);
        // The tool's result is what the client added.
        assert!(tok
            .decode(&p2, false)
            .unwrap()
            .ends_with("42<|im_end|>\n<|im_start|>assistant\n"));
    }

    #[test]
    fn collected_rows_mask_what_the_client_added() {
        let c = |t: Vec<u32>| Completion {
            logprobs: vec![-1.0; t.len()],
            tokens: t,
            finish: FinishReason::Stop,
            text: "x".into(),
            trajectory: None,
        };
        let t = Trajectory {
            turns: vec![
                Turn::new(vec![1, 2], &c(vec![3, 4])),
                Turn::new(vec![1, 2, 3, 4, 5, 6], &c(vec![7])),
            ],
            reward: Some(0.5),
            messages: json!([]),
            logprob_temperature: 1.0,
            ..Trajectory::default()
        };
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("t.parquet");
        write_batch(&out, &[("a".into(), t)], Path::new("m"), 3).unwrap();
        let b = crate::batch::Batch::read(&out, &[]).unwrap();
        assert_eq!(
            b.ragged_i32(schema::RESPONSE_IDS).unwrap().row(0),
            &[3, 4, 5, 6, 7]
        );
        assert_eq!(b.ragged_i32(schema::PROMPT_IDS).unwrap().row(0), &[1, 2]);
        assert_eq!(
            b.ragged_u8(schema::RESPONSE_MASK).unwrap().row(0),
            &[1, 1, 0, 0, 1]
        );
        assert_eq!(
            b.ragged_f32(schema::ROLLOUT_LOGPROBS).unwrap().row(0),
            &[-1.0, -1.0, 0.0, 0.0, -1.0]
        );
        assert_eq!(b.meta_u64(meta::POLICY_VERSION), Some(3));
        assert_eq!(b.f32s(schema::SCORE).unwrap(), vec![0.5]);
    }
}
