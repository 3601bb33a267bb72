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

use super::common::{gather_results, my_block, refuse_in_place, writes_files, ModelRef};
use super::rollout::RolloutArgs;
use super::rollout::{keyed_requests, sequence_columns, Generate, Generated, Output, Prepared};
use super::Exec;
use crate::bail_input;
use crate::batch::schema::{self, meta};
use crate::batch::{list_array, write_file, write_json, Batch, NewColumns};
use crate::data::dataset::repeat_each;
use crate::data::PromptDataset;
use crate::engine::paged::partial::{absorb, round_requests, Group, InFlight, Rounds};
use crate::engine::paged::{Completion, Detokenize, FinishReason, GenParams};
use crate::model::checkpoint::ModelDir;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, UInt64Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The carry file's column of each sequence's random key.
pub(crate) const SAMPLE_KEY: &str = "sample_key";

/// One round (see the module docs).
pub(super) fn run(args: RolloutArgs, exec: &mut dyn Exec) -> Result<()> {
    let started = Instant::now();
    let round_tokens = args.round_tokens.expect("a round has --round-tokens");
    args.check()?;
    let carry_out = args.carry_out.clone().expect("checked");
    refuse_in_place(&args.input, &args.out, "out")?;
    let sampling = args.sampling()?;
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
            let prep = Prepared::load(&args, d, d.len(), &[])?;
            let rows = fresh_rows(&args, d, &prep.prompts)?;
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
    let table = join(carry.as_ref(), fresh_rows, &args)?;
    let params = args.gen_params(sampling, &eos);
    let mut rounds = Rounds::new(usize::MAX);
    rounds.in_flight = groups_of(&table)?;
    let detok = |ids: &[u32]| tokenizer.decode(ids, true);
    let gen = RoundGen {
        model: &model,
        params: &params,
        round_tokens,
        detok: &detok,
        args: &args,
    };
    // Every new group is in flight already: the runner decides how many start.
    let done = rounds.round_with(&mut |_| None, &mut |seqs| gen.run(exec, seqs))?;
    let Some((live, new_tokens, gen_s)) = done else {
        return Ok(());
    };
    let written = Written::new(&table, &rounds, &tokenizer)?;
    let out = Output {
        args: &args,
        model: &model,
        sampling,
        stop_ids: &params.stop_token_ids,
        generated: &Generated::default(),
    };
    written.write(&args.out, &carry_out, out.meta(), model.policy_version)?;
    if let Some(path) = &args.metrics {
        let m = written.metrics(live, new_tokens, gen_s, &model, started);
        write_json(path, &m)?;
    }
    if writes_files(exec) {
        exec.log(&format!(
            "rollout round: {live} sequences x up to {round_tokens} tokens ({new_tokens} tokens) under policy_version {}: {} groups finished -> {}, {} in flight -> {}",
            model.policy_version,
            written.finished_groups,
            args.out.display(),
            written.carried_groups,
            carry_out.display()
        ));
    }
    Ok(())
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
    SAMPLE_KEY,
];

/// The rows of `prompts`' samples before their first token: n per prompt with their keys, as a
/// carry file holds them.
fn fresh_rows(
    args: &RolloutArgs,
    dataset: &PromptDataset,
    prompts: &[Vec<u32>],
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
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    Ok(RecordBatch::try_new(
        Arc::new(arrow_schema::Schema::new(fields)),
        arrays,
    )?)
}

fn key_field() -> Field {
    Field::new(SAMPLE_KEY, DataType::UInt64, false)
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

/// Each row as a sequence in flight.
fn in_flight(t: &Batch) -> Result<Vec<InFlight>> {
    let prompts = t.ragged_i32(schema::PROMPT_IDS)?;
    let tokens = t.ragged_i32(schema::RESPONSE_IDS)?;
    let logprobs = t.ragged_f32(schema::ROLLOUT_LOGPROBS)?;
    let versions = t.ragged_i32(schema::TOKEN_POLICY_VERSION)?;
    let finish = t.strings(schema::FINISH_REASON)?;
    let keys = t.column(SAMPLE_KEY)?;
    let Some(keys) = keys.as_primitive_opt::<UInt64Type>() else {
        bail_input!("{}: expected uint64", t.at(SAMPLE_KEY));
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
            Ok(InFlight {
                prompt: ids(prompts.row(i)),
                key: keys.value(i),
                tokens: ids(tokens.row(i)),
                logprobs: logprobs.row(i).to_vec(),
                versions: versions.row(i).iter().map(|&v| v as u64).collect(),
                finish,
            })
        })
        .collect()
}

/// One round's generation on the stage's ranks (or daemon).
struct RoundGen<'a> {
    model: &'a ModelRef,
    params: &'a GenParams,
    round_tokens: usize,
    detok: Detokenize<'a>,
    args: &'a RolloutArgs,
}

impl RoundGen<'_> {
    /// Generates the round's tokens of `seqs` (each rank its block) and, on rank 0, adds them
    /// to the sequences; returns (rank 0 only) the sequences generated for, the new tokens and
    /// the generation's seconds.
    fn run(
        &self,
        exec: &mut dyn Exec,
        seqs: &mut [InFlight],
    ) -> Result<Option<(usize, usize, f64)>> {
        let (live, requests, this_round) = round_requests(seqs, self.params, self.round_tokens)
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
                    self.detok,
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
        absorb(seqs, &live, done, self.params, self.model.policy_version);
        Ok(Some((live.len(), new_tokens, generated.gen_s)))
    }
}

/// The rows as groups in flight (a group's rows are contiguous), each named by its first row.
fn groups_of(t: &Batch) -> Result<Vec<Group>> {
    let puids = t.strings(schema::PROMPT_UID)?;
    let mut seqs = in_flight(t)?.into_iter();
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
    /// The rows of `t` as `rounds` left their groups: the finished ones and those in flight.
    fn new(t: &Batch, rounds: &Rounds, tok: &Tokenizer) -> Result<Written> {
        let finished: Vec<&Group> = rounds.finished.iter().collect();
        let carried: Vec<&Group> = rounds.in_flight.iter().collect();
        let done_seqs = || finished.iter().flat_map(|g| &g.seqs);
        let mut finished_rows = rows_of(t, &finished, tok)?;
        let key = finished_rows.schema().index_of(SAMPLE_KEY)?;
        finished_rows.remove_column(key);
        Ok(Written {
            finished: finished_rows,
            carried: rows_of(t, &carried, tok)?,
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

    fn metrics(
        &self,
        live: usize,
        new_tokens: usize,
        gen_s: f64,
        model: &ModelRef,
        started: Instant,
    ) -> serde_json::Value {
        json!({
            "stage": "rollout-round",
            "sequences": live,
            "new_tokens": new_tokens,
            "finished_groups": self.finished_groups,
            "finished_rows": self.finished.num_rows(),
            "mixed_version_rows": self.mixed_rows,
            "carried_groups": self.carried_groups,
            "carried_rows": self.carried.num_rows(),
            "partial_rows": self.partial_rows,
            "policy_version": model.policy_version,
            "generation_seconds": gen_s,
            "seconds": started.elapsed().as_secs_f64(),
        })
    }
}

/// The rows of `groups` (named by their first row of `t`) with their sequences' response
/// columns as they stand.
fn rows_of(t: &Batch, groups: &[&Group], tok: &Tokenizer) -> Result<RecordBatch> {
    let rows = groups
        .iter()
        .flat_map(|g| (g.id as u32..).take(g.seqs.len()))
        .collect::<Vec<u32>>();
    let seqs: Vec<InFlight> = groups.iter().flat_map(|g| g.seqs.clone()).collect();
    let taken = Batch {
        path: t.path.clone(),
        data: arrow_select::take::take_record_batch(&t.data, &UInt32Array::from(rows))?,
        meta: Default::default(),
    };
    taken.with_columns(response_columns(&seqs, tok)?)
}

/// The response columns of `seqs` as they stand: ids, mask (all sampled), text, finish
/// reason ("" in flight), log-probs and versions.
fn response_columns(seqs: &[InFlight], tok: &Tokenizer) -> Result<NewColumns> {
    let mut off = vec![0usize];
    let (mut ids, mut lps, mut vers, mut texts, mut reasons) =
        (vec![], vec![], vec![], vec![], vec![]);
    for s in seqs {
        ids.extend(s.tokens.iter().map(|&t| t as i32));
        lps.extend_from_slice(&s.logprobs);
        vers.extend(s.versions.iter().map(|&v| v as i32));
        off.push(ids.len());
        texts.push(tok.decode(&s.tokens, true)?);
        reasons.push(s.finish.map_or("", FinishReason::as_str));
    }
    let n = ids.len();
    let mut cols = NewColumns::new();
    cols.add(schema::RESPONSE_IDS, list_array::<Int32Type>(&off, ids))
        .add(
            schema::RESPONSE_MASK,
            list_array::<UInt8Type>(&off, vec![1u8; n]),
        )
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
