//! `rollout --round-tokens N --carry IN --carry-out OUT`: one round of partial rollouts
//! (`[placement] mode = "async"`, `engine::paged::partial`). The sequences in flight (the
//! rows of --carry, as the round before left them) continue from their tokens and --in's
//! prompts start their n samples; each gets at most N new tokens from the policy the stage
//! runs (on a rollout group: the weights it holds now), every token recorded with that
//! policy's version (`token_policy_version`). Groups whose samples have all ended go to --out
//! (rows as a plain rollout writes them, plus `token_policy_version`; the file's
//! `policy_version` is its oldest token's); the others, with their ended samples, go to
//! --carry-out for the next round.
//!
//! The state of a sequence between rounds is its row: prompt and response ids so far, their
//! log-probs and versions, `finish_reason` ("" while in flight) and its random key
//! (`sample_key`, a column of the carry file only). Several ranks split the round's sequences
//! as a rollout splits prompts; rank 0 writes the files.
//!
//! Stop strings (--stop) are searched in the whole current turn after every new token, so one
//! that straddles two rounds ends the sequence where it is completed. With --tool a sequence
//! is an episode of turns: the calls of a turn that ends in this round run on rank 0 at its
//! end (the tool runner of `rollout --tool`, with its limits, concurrency and timeout), and
//! their observation is appended (mask 0) before the next round; the episode's state between
//! rounds (its prompt's messages, tool arguments, turns and calls) is the carry file's
//! `episode` column (JSON). Finished rows have the columns of a `rollout --tool` run.

use super::common::{gather_results, my_block, refuse_in_place, writes_files, ModelRef};
use super::rollout::RolloutArgs;
use super::rollout::{keyed_requests, sequence_columns, Generate, Generated, Output, Prepared};
use super::turns::{observation, stage_tools, ToolText, TurnColumns};
use super::Exec;
use crate::bail_input;
use crate::batch::schema::{self, meta};
use crate::batch::{list_array, write_file, write_json, Batch, NewColumns};
use crate::data::dataset::repeat_each;
use crate::data::{ChatTemplate, Message, PromptDataset};
use crate::engine::paged::partial::{
    absorb, answer_calls, round_requests, Group, InFlight, Rounds,
};
use crate::engine::paged::{Agent, Completion, FinishReason, StopRule, Trajectory};
use crate::model::checkpoint::ModelDir;
use crate::tokenizer::Tokenizer;
use crate::tool::{ToolFormat, Tools};
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, UInt64Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The carry file's column of each sequence's random key.
pub(crate) const SAMPLE_KEY: &str = "sample_key";

/// With tools, the carry file's column of each episode's state (JSON of [`Episode`]).
pub(crate) const EPISODE: &str = "episode";

/// What a multi-turn sequence carries between rounds besides its tokens.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Episode {
    /// Its prompt's messages (the `messages` column starts with them).
    messages: Vec<Message>,
    /// Its row's tool arguments (verl's tools_kwargs; null: none).
    kwargs: Value,
    /// Turns and calls so far (the mask is the row's `response_mask`).
    turns: Vec<String>,
    calls: Vec<crate::engine::paged::CallRecord>,
}

/// One round (see the module docs).
pub(super) fn run(args: RolloutArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    let round_tokens = args.round_tokens.expect("a round has --round-tokens");
    args.check()?;
    let carry_out = args.carry_out.clone().expect("checked");
    refuse_in_place(&args.input, &args.out, "out")?;
    let sampling = args.sampling()?;
    let tools = stage_tools(&args.tool, Duration::from_secs_f64(args.tool_timeout))?;
    let setup = Setup::load(&args, tools.as_deref())?;
    let params = args.gen_params(sampling, &setup.eos);
    let tokenizer = &setup.tokenizer;
    let mut rounds = Rounds::new(usize::MAX);
    rounds.in_flight = groups_of(&setup.table, tools.is_some())?;
    if let Some(lengths) = args.recorded_lengths()? {
        // Drawn by key: the length a whole rollout of the same sample draws.
        for s in rounds.in_flight.iter_mut().flat_map(|g| g.seqs.iter_mut()) {
            s.limit = Some(lengths.limit(s.key, params.max_new_tokens));
        }
    }
    let episodes = episodes_of(&setup.table)?;
    let detok = |ids: &[u32]| tokenizer.decode(ids, true);
    let text = setup.template.as_ref().map(|template| ToolText {
        template,
        tokenizer,
    });
    let observe = |turn: &[u32], contents: &[String]| {
        observation(text.as_ref(), args.tool_format, &detok, (turn, contents))
    };
    // Per sequence of the round: its row's tool arguments.
    let kwargs = || episodes.iter().map(|e| e.kwargs.clone()).collect();
    let agent = tools.map(|tools| args.agent(tools, &observe, kwargs()));
    let gen = RoundGen {
        model: &setup.model,
        rule: StopRule {
            params: &params,
            detok: Some(&detok),
            turns: agent.as_ref().map(|a| a.limits),
        },
        agent: agent.as_ref(),
        round_tokens,
        args: &args,
    };
    // Every new group is in flight already: the runner decides how many start.
    let done = rounds.round_with(&mut |_| None, &mut |seqs| gen.run(exec, seqs))?;
    let Some(done) = done else {
        return Ok(());
    };
    let written = Written::new(
        &setup.table,
        &rounds,
        tokenizer,
        (&episodes, args.tool_format),
    )?;
    let model = &setup.model;
    let out = Output {
        args: &args,
        model,
        sampling,
        stop_ids: &params.stop_token_ids,
        generated: &Generated::default(),
    };
    written.write(&args.out, &carry_out, out.meta(), model.policy_version)?;
    if let Some(path) = &args.metrics {
        let m = written.metrics(&done, model, started);
        write_json(path, &m)?;
    }
    if writes_files(exec) {
        exec.log(&format!(
            "rollout round: {} sequences x up to {round_tokens} tokens ({} tokens, {} tool calls) under policy_version {}: {} groups finished -> {}, {} in flight -> {}",
            done.live,
            done.new_tokens,
            done.calls,
            model.policy_version,
            written.finished_groups,
            args.out.display(),
            written.carried_groups,
            carry_out.display()
        ));
    }
    Ok(())
}

/// What a round reads before it generates: the model, its stop ids, tokenizer and (with
/// tools) chat template, and the round's rows (the carried ones, then the new prompts').
struct Setup {
    model: ModelRef,
    eos: Vec<u32>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    table: Batch,
}

impl Setup {
    fn load(args: &RolloutArgs, tools: Option<&dyn Tools>) -> Result<Setup> {
        let fresh = Batch::read(&args.input, &[])?;
        let dataset = match fresh.num_rows() {
            0 => None,
            _ => Some(
                PromptDataset::open_with_key(&args.input, &args.prompt_key)?
                    .with_system(args.system_prompt.as_deref()),
            ),
        };
        let carry = match &args.carry {
            Some(p) => Some(Batch::read(p, CARRY_COLUMNS)?),
            None => None,
        };
        let (model, eos, tokenizer, fresh_rows) = match &dataset {
            Some(d) => {
                let prep = Prepared::load(args, d, d.len(), &args.prompt_schemas(tools))?;
                let rows = fresh_rows(args, d, &prep.prompts, tools.is_some())?;
                (
                    prep.model,
                    prep.cfg.eos_token_ids,
                    prep.tokenizer,
                    Some(rows),
                )
            }
            None => {
                let model = super::common::resolve_model(&args.model)?;
                let cfg = ModelDir::load_config(&model.dir)?;
                let tok = Tokenizer::from_dir(&model.dir)?;
                (model, cfg.eos_token_ids, tok, None)
            }
        };
        let template = match tools {
            Some(_) => Some(ChatTemplate::from_dir(&model.dir)?),
            None => None,
        };
        let table = join(carry.as_ref(), fresh_rows, args)?;
        if tools.is_some() != table.has(EPISODE) {
            bail_input!(
                "{}: a round with --tool continues episodes (an `{EPISODE}` column), one without continues plain sequences: the carry file comes from a round with other flags",
                table.path.display()
            );
        }
        Ok(Setup {
            model,
            eos,
            tokenizer,
            template,
            table,
        })
    }
}

/// The columns a carry file must have.
const CARRY_COLUMNS: &[&str] = &[
    schema::UID,
    schema::PROMPT_UID,
    schema::PROMPT_IDS,
    schema::RESPONSE_IDS,
    schema::ROLLOUT_LOGPROBS,
    schema::TOKEN_POLICY_VERSION,
    schema::FINISH_REASON,
    schema::RESPONSE_TEXT,
    SAMPLE_KEY,
];

/// The rows of `prompts`' samples before their first token: n per prompt with their keys (and,
/// with `tools`, their episodes), as a carry file holds them.
fn fresh_rows(
    args: &RolloutArgs,
    dataset: &PromptDataset,
    prompts: &[Vec<u32>],
    tools: bool,
) -> Result<RecordBatch> {
    let (puids, requests) = keyed_requests(prompts, args.n, args.seed);
    let mut uids = Vec::new();
    let mut row_puids = Vec::new();
    let mut keys = Vec::new();
    let (mut p_off, mut p_ids) = (vec![0usize], Vec::new());
    for (puid, r) in puids.iter().zip(&requests) {
        for (j, &k) in r.sample_keys.iter().enumerate() {
            uids.push(format!("{puid}-{j}"));
            row_puids.push(puid.clone());
            keys.push(k);
            p_ids.extend(r.prompt.iter().map(|&t| t as i32));
            p_off.push(p_ids.len());
        }
    }
    let rows = uids.len();
    let take = repeat_each(&(0..prompts.len()).collect::<Vec<_>>(), args.n);
    let empty = vec![0usize; rows + 1];
    let mut cols = sequence_columns(
        uids,
        row_puids,
        dataset.take_columns(&take)?,
        (&p_off, p_ids),
        (&empty, vec![], None),
        vec![String::new(); rows],
    );
    cols.extend([
        (
            schema::field(schema::FINISH_REASON),
            Arc::new(StringArray::from(vec![""; rows])) as ArrayRef,
        ),
        (
            schema::field(schema::ROLLOUT_LOGPROBS),
            list_array::<Float32Type>(&empty, vec![]),
        ),
        (
            schema::field(schema::TOKEN_POLICY_VERSION),
            list_array::<Int32Type>(&empty, vec![]),
        ),
        (key_field(), Arc::new(UInt64Array::from(keys)) as ArrayRef),
    ]);
    if tools {
        let kwargs = dataset.tools_kwargs()?;
        let episodes = take.iter().map(|&i| Episode {
            messages: dataset.row(i).messages.clone(),
            kwargs: kwargs[i].clone().unwrap_or_default(),
            ..Episode::default()
        });
        cols.push(episode_column(episodes)?);
    }
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    Ok(RecordBatch::try_new(
        Arc::new(arrow_schema::Schema::new(fields)),
        arrays,
    )?)
}

fn key_field() -> Field {
    Field::new(SAMPLE_KEY, DataType::UInt64, false)
}

/// The `episode` column of `episodes`.
fn episode_column(episodes: impl Iterator<Item = Episode>) -> Result<(Field, ArrayRef)> {
    let texts = episodes
        .map(|e| serde_json::to_string(&e))
        .collect::<Result<Vec<String>, _>>()?;
    Ok((
        Field::new(EPISODE, DataType::Utf8, false),
        Arc::new(StringArray::from(texts)) as ArrayRef,
    ))
}

/// Each row's episode (none without the column: no tools). A malformed one is an input error
/// naming the row.
fn episodes_of(t: &Batch) -> Result<Vec<Episode>> {
    if !t.has(EPISODE) {
        return Ok(vec![]);
    }
    let texts = t.strings(EPISODE)?;
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            serde_json::from_str(text)
                .map_err(|e| crate::error::input_error(format!("{}, row {i}: {e}", t.at(EPISODE))))
        })
        .collect()
}

/// The round's rows: the carried ones, then the fresh ones (same columns: both come from the
/// run's training set). Neither is an input error.
fn join(carry: Option<&Batch>, fresh: Option<RecordBatch>, args: &RolloutArgs) -> Result<Batch> {
    let (data, path) = match (carry, fresh) {
        (None, None) => bail_input!(
            "{}: no prompt and no --carry: a round has nothing to generate",
            args.input.display()
        ),
        (Some(c), None) => (c.data.clone(), c.path.clone()),
        (None, Some(f)) => (f, args.input.clone()),
        (Some(c), Some(f)) => {
            if c.data.schema().fields() != f.schema().fields() {
                bail_input!(
                    "{}: its columns differ from the new prompts' rows ({}): a carry file continues rounds over the same dataset",
                    c.path.display(),
                    args.input.display()
                );
            }
            let all = arrow_select::concat::concat_batches(&c.data.schema(), [&c.data, &f])?;
            (all, c.path.clone())
        }
    };
    Ok(Batch {
        path,
        data,
        meta: Default::default(),
    })
}

/// Each row as a sequence in flight (with `tools`, an episode: its mask, turns and calls).
fn in_flight(t: &Batch, tools: bool) -> Result<Vec<InFlight>> {
    let prompts = t.ragged_i32(schema::PROMPT_IDS)?;
    let tokens = t.ragged_i32(schema::RESPONSE_IDS)?;
    let logprobs = t.ragged_f32(schema::ROLLOUT_LOGPROBS)?;
    let versions = t.ragged_i32(schema::TOKEN_POLICY_VERSION)?;
    let finish = t.strings(schema::FINISH_REASON)?;
    let texts = t.strings(schema::RESPONSE_TEXT)?;
    let keys = t.column(SAMPLE_KEY)?;
    let Some(keys) = keys.as_primitive_opt::<UInt64Type>() else {
        bail_input!("{}: expected uint64", t.at(SAMPLE_KEY));
    };
    let episodes = episodes_of(t)?;
    let masks = match tools {
        true => Some(t.ragged_u8(schema::RESPONSE_MASK)?),
        false => None,
    };
    let ids = |r: &[i32]| r.iter().map(|&x| x as u32).collect::<Vec<u32>>();
    (0..t.num_rows())
        .map(|i| {
            let finish = match finish[i] {
                "" => None,
                "stop" => Some(FinishReason::Stop),
                "length" => Some(FinishReason::Length),
                other => bail_input!(
                    "{}, row {i}: {other:?} is not stop, length or \"\" (in flight)",
                    t.at(schema::FINISH_REASON)
                ),
            };
            let trajectory = masks.as_ref().map(|m| Trajectory {
                mask: m.row(i).to_vec(),
                turns: episodes[i].turns.clone(),
                calls: episodes[i].calls.clone(),
            });
            Ok(InFlight {
                prompt: ids(prompts.row(i)),
                key: keys.value(i),
                tokens: ids(tokens.row(i)),
                logprobs: logprobs.row(i).to_vec(),
                versions: versions.row(i).iter().map(|&v| v as u64).collect(),
                text: finish.map_or(String::new(), |_| texts[i].to_string()),
                finish,
                trajectory,
                limit: None,
            })
        })
        .collect()
}

/// One round's generation on the stage's ranks (or daemon).
struct RoundGen<'a> {
    model: &'a ModelRef,
    rule: StopRule<'a>,
    /// With tools: runs the calls of the turns that end in the round (rank 0).
    agent: Option<&'a Agent<'a>>,
    round_tokens: usize,
    args: &'a RolloutArgs,
}

/// What a round did (rank 0).
struct Done {
    /// Sequences generated for, their new tokens, the generation's seconds.
    live: usize,
    new_tokens: usize,
    gen_s: f64,
    /// Tool calls answered at the round's end, failed ones, and their wall seconds.
    calls: usize,
    call_errors: usize,
    call_s: f64,
}

impl RoundGen<'_> {
    /// Generates the round's tokens of `seqs` (each rank its block) and, on rank 0, adds them
    /// to the sequences and runs the calls of the turns that ended; returns (rank 0 only) what
    /// it did.
    fn run(&self, exec: &mut dyn Exec, seqs: &mut [InFlight]) -> Result<Option<Done>> {
        let (live, requests, this_round) = round_requests(seqs, &self.rule, self.round_tokens)
            .map_err(|e| crate::error::input_error(format!("--round-tokens: {e:#}")))?;
        let block = my_block(exec, requests.len());
        let bar = exec.progress_bar(block.len(), "rollout round");
        let generated = match block.is_empty() {
            true => Generated::default(),
            false => {
                let job = Generate::plain(
                    &self.model.dir,
                    &requests[block.clone()],
                    &this_round,
                    self.rule.detok.expect("a round decodes"),
                    &bar,
                    self.args.limits(),
                );
                exec.generate(self.model, job)?
            }
        };
        bar.finish_and_clear();
        let Some(parts) = gather_results(exec, generated, Generated::encode, Generated::decode)?
        else {
            return Ok(None);
        };
        let generated = Generated::merge(parts);
        let done: Vec<Completion> = generated
            .completions
            .iter()
            .map(|s| s.last().expect("one sample per request").clone())
            .collect();
        let new_tokens = done.iter().map(|c| c.tokens.len()).sum();
        let version = self.model.policy_version;
        let due = absorb(seqs, &live, done, &self.rule, version)?;
        let t0 = Instant::now();
        let (calls, call_errors) = match self.agent {
            Some(agent) => answer_calls(seqs, due, agent, version)?,
            None => (0, 0),
        };
        Ok(Some(Done {
            live: live.len(),
            new_tokens,
            gen_s: generated.gen_s,
            calls,
            call_errors,
            call_s: t0.elapsed().as_secs_f64(),
        }))
    }
}

/// The rows as groups in flight (a group's rows are contiguous), each named by its first row.
fn groups_of(t: &Batch, tools: bool) -> Result<Vec<Group>> {
    let puids = t.strings(schema::PROMPT_UID)?;
    let mut seqs = in_flight(t, tools)?.into_iter();
    let groups = crate::batch::runs(&puids)
        .into_iter()
        .map(|r| Group {
            id: r.start as u64,
            seqs: seqs.by_ref().take(r.len()).collect(),
        })
        .collect();
    Ok(groups)
}

/// The round's rows after it, split into the finished groups and those in flight.
struct Written {
    finished: RecordBatch,
    carried: RecordBatch,
    finished_groups: usize,
    carried_groups: usize,
    /// Finished rows whose tokens come from two versions or more; in-flight rows with tokens.
    mixed_rows: usize,
    partial_rows: usize,
    oldest: Option<u64>,
}

impl Written {
    /// The rows of `t` (with tools, of `episodes`) as `rounds` left their groups: the finished
    /// ones, with a `rollout --tool` run's columns, and those in flight.
    fn new(
        t: &Batch,
        rounds: &Rounds,
        tok: &Tokenizer,
        (episodes, format): (&[Episode], ToolFormat),
    ) -> Result<Written> {
        let finished: Vec<&Group> = rounds.finished.iter().collect();
        let carried: Vec<&Group> = rounds.in_flight.iter().collect();
        let done_seqs = || finished.iter().flat_map(|g| &g.seqs);
        let mut finished_rows = rows_of(t, &finished, tok, episodes)?;
        let key = finished_rows.schema().index_of(SAMPLE_KEY)?;
        finished_rows.remove_column(key);
        if !episodes.is_empty() {
            let at = finished_rows.schema().index_of(EPISODE)?;
            finished_rows.remove_column(at);
            let rows = Batch {
                path: t.path.clone(),
                data: finished_rows,
                meta: Default::default(),
            };
            finished_rows = rows.with_columns(turn_columns(&finished, episodes, format)?)?;
        }
        Ok(Written {
            finished: finished_rows,
            carried: rows_of(t, &carried, tok, episodes)?,
            finished_groups: finished.len(),
            carried_groups: carried.len(),
            mixed_rows: done_seqs().filter(|s| s.is_mixed()).count(),
            partial_rows: rounds.carried(),
            oldest: done_seqs().filter_map(InFlight::oldest_version).min(),
        })
    }

    /// Writes the finished groups (`policy_version`: their oldest token's, or `version` when
    /// none) and the carry.
    fn write(
        &self,
        out: &Path,
        carry_out: &Path,
        mut kv: std::collections::BTreeMap<String, String>,
        version: u64,
    ) -> Result<()> {
        kv.insert(
            meta::POLICY_VERSION.into(),
            self.oldest.unwrap_or(version).to_string(),
        );
        write_file(out, &self.finished, &kv)?;
        write_file(carry_out, &self.carried, &kv)
    }

    fn metrics(&self, done: &Done, model: &ModelRef, started: Instant) -> serde_json::Value {
        json!({
            "stage": "rollout-round",
            "sequences": done.live,
            "new_tokens": done.new_tokens,
            "finished_groups": self.finished_groups,
            "finished_rows": self.finished.num_rows(),
            "mixed_version_rows": self.mixed_rows,
            "carried_groups": self.carried_groups,
            "carried_rows": self.carried.num_rows(),
            "partial_rows": self.partial_rows,
            "policy_version": model.policy_version,
            "generation_seconds": done.gen_s,
            "tool_calls": done.calls,
            "tool_errors": done.call_errors,
            "tool_seconds": done.call_s,
            "seconds": started.elapsed().as_secs_f64(),
        })
    }
}

/// The rows of each group's row indices in the table (a group is named by its first row).
fn row_indices(groups: &[&Group]) -> Vec<usize> {
    groups
        .iter()
        .flat_map(|g| (g.id as usize..).take(g.seqs.len()))
        .collect()
}

/// The rows of `groups` with their sequences' response columns as they stand (with tools,
/// and their `episodes` as they stand).
fn rows_of(
    t: &Batch,
    groups: &[&Group],
    tok: &Tokenizer,
    episodes: &[Episode],
) -> Result<RecordBatch> {
    let rows = row_indices(groups);
    let seqs: Vec<InFlight> = groups.iter().flat_map(|g| g.seqs.clone()).collect();
    let taken = Batch {
        path: t.path.clone(),
        data: arrow_select::take::take_record_batch(
            &t.data,
            &UInt32Array::from(rows.iter().map(|&r| r as u32).collect::<Vec<_>>()),
        )?,
        meta: Default::default(),
    };
    let mut cols = response_columns(&seqs, tok)?;
    if !episodes.is_empty() {
        let now = rows.iter().zip(&seqs).map(|(&r, s)| {
            let t = s.trajectory.clone().unwrap_or_default();
            Episode {
                turns: t.turns,
                calls: t.calls,
                ..episodes[r].clone()
            }
        });
        let (field, array) = episode_column(now)?;
        cols.add_field(field, array);
    }
    taken.with_columns(cols)
}

/// The inspection columns of a `rollout --tool` run (`num_turns`, `tool_calls`, `messages`)
/// for the finished `groups`.
fn turn_columns(groups: &[&Group], episodes: &[Episode], format: ToolFormat) -> Result<NewColumns> {
    let mut turns = TurnColumns::new(format);
    let seqs = groups.iter().flat_map(|g| &g.seqs);
    for (r, s) in row_indices(groups).into_iter().zip(seqs) {
        let c = Completion {
            tokens: s.tokens.clone(),
            logprobs: s.logprobs.clone(),
            finish: s.finish.unwrap_or(FinishReason::Length),
            text: s.text.clone(),
            trajectory: s.trajectory.clone(),
        };
        turns.push(&c, &episodes[r].messages)?;
    }
    let mut cols = NewColumns::new();
    for (field, array) in turns.columns() {
        cols.add_field(field, array);
    }
    Ok(cols)
}

/// The response columns of `seqs` as they stand: ids, mask (all sampled, or the episode's),
/// text (a finished sequence's, else the tokens decoded), finish reason ("" in flight),
/// log-probs and versions.
fn response_columns(seqs: &[InFlight], tok: &Tokenizer) -> Result<NewColumns> {
    let mut off = vec![0usize];
    let (mut ids, mut lps, mut vers, mut texts, mut reasons, mut mask) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for s in seqs {
        ids.extend(s.tokens.iter().map(|&t| t as i32));
        lps.extend_from_slice(&s.logprobs);
        vers.extend(s.versions.iter().map(|&v| v as i32));
        match &s.trajectory {
            Some(t) => mask.extend_from_slice(&t.mask),
            None => mask.extend(std::iter::repeat_n(1u8, s.tokens.len())),
        }
        off.push(ids.len());
        texts.push(match s.finish {
            Some(_) => s.text.clone(),
            None => tok.decode(&s.tokens, true)?,
        });
        reasons.push(s.finish.map_or("", FinishReason::as_str));
    }
    let mut cols = NewColumns::new();
    cols.add(schema::RESPONSE_IDS, list_array::<Int32Type>(&off, ids))
        .add(schema::RESPONSE_MASK, list_array::<UInt8Type>(&off, mask))
        .add(
            schema::RESPONSE_TEXT,
            Arc::new(StringArray::from(texts)) as ArrayRef,
        )
        .add(
            schema::FINISH_REASON,
            Arc::new(StringArray::from(reasons)) as ArrayRef,
        )
        .add(
            schema::ROLLOUT_LOGPROBS,
            list_array::<Float32Type>(&off, lps),
        )
        .add(
            schema::TOKEN_POLICY_VERSION,
            list_array::<Int32Type>(&off, vers),
        );
    Ok(cols)
}
