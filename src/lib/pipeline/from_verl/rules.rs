//! The one table of verl config keys and what each becomes in a tandem spec ([`RULES`]): the
//! converter applies it and docs/FROM_VERL.md's table is generated from it (a test keeps the
//! two equal).
//!
//! A rule's `verl` is a dotted key or a pattern of segments: `*` is any one segment, a last
//! `*` any rest (`critic.*`). The first rule that matches a key is its rule, so exact keys come
//! before the patterns that would also match them.

use super::config::Config;
use super::multi_turn as mt;
use serde_json::Value;
use std::cell::RefCell;
use std::path::Path;

/// What the converter knows besides the key's own value.
pub(crate) struct Ctx<'a> {
    pub(crate) config: &'a Config,
    /// Rows of `data.train_files`, when that file could be read here.
    pub(crate) train_rows: Option<usize>,
    /// What a conversion could not carry, by verl key: reported with the keys left out.
    pub(crate) notes: RefCell<Vec<(String, String)>>,
}

impl Ctx<'_> {
    /// A key's value, interpolations resolved (an unresolvable one reads as absent).
    pub(crate) fn get(&self, key: &str) -> Option<Value> {
        self.config.get(key).ok().flatten().filter(|v| !v.is_null())
    }

    /// Notes what the conversion of `key` left out.
    pub(crate) fn note(&self, key: &str, why: String) {
        self.notes.borrow_mut().push((key.to_string(), why));
    }

    fn is_true(&self, key: &str) -> bool {
        self.get(key).and_then(|v| v.as_bool()).unwrap_or(false)
    }
}

/// A verl value as the tandem value to write, or None for nothing to write.
pub(crate) type Conv = fn(&Value, &Ctx) -> Result<Option<toml::Value>, String>;

pub(crate) enum To {
    /// Written as the tandem spec key `key` (`table.key`, or a top-level key), `how` says how
    /// (for the doc; empty: the same value).
    Key {
        key: &'static str,
        how: &'static str,
        conv: Conv,
    },
    /// tandem always does what the key asks (or it does not apply): nothing to write, nothing
    /// to report.
    Builtin(&'static str),
    /// No tandem counterpart: reported with the reason.
    None(&'static str),
    /// No counterpart, but only reported when the switch key (`""`: the key itself) is on
    /// (true, a non-zero number, a non-empty text or list): off, tandem behaves the same.
    WhenOn {
        switch: &'static str,
        why: &'static str,
    },
}

pub(crate) struct Rule {
    pub(crate) verl: &'static str,
    pub(crate) to: To,
}

impl Rule {
    pub(crate) fn matches(&self, key: &str) -> bool {
        let pat: Vec<&str> = self.verl.split('.').collect();
        let segs: Vec<&str> = key.split('.').collect();
        let rest = pat.last() == Some(&"*") && pat.len() > 1;
        let fixed = if rest {
            &pat[..pat.len() - 1]
        } else {
            &pat[..]
        };
        let len_ok = if rest {
            segs.len() > fixed.len()
        } else {
            segs.len() == fixed.len()
        };
        len_ok && fixed.iter().zip(&segs).all(|(p, s)| segment_matches(p, s))
    }
}

/// One segment against a pattern segment: `*` is any segment, `a*b` any that starts with `a`
/// and ends with `b`.
fn segment_matches(pat: &str, seg: &str) -> bool {
    match pat.split_once('*') {
        None => pat == seg,
        Some((pre, post)) => {
            seg.len() >= pre.len() + post.len() && seg.starts_with(pre) && seg.ends_with(post)
        }
    }
}

/// Whether a value turns a feature on (verl writes -1, 0, null, false or empty for off).
pub(crate) fn is_on(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x > 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn kind(v: &Value) -> &'static str {
    crate::data::json_kind(v)
}

/// A JSON value as TOML (null: nothing to write).
fn toml_of(v: &Value) -> Result<Option<toml::Value>, String> {
    Ok(match v {
        Value::Null => None,
        Value::Bool(b) => Some(toml::Value::Boolean(*b)),
        Value::Number(n) => Some(match n.as_i64() {
            Some(i) => toml::Value::Integer(i),
            None => toml::Value::Float(n.as_f64().ok_or("not a number")?),
        }),
        Value::String(s) => Some(toml::Value::String(s.clone())),
        Value::Array(items) => {
            let mut out = Vec::new();
            for x in items {
                match toml_of(x)? {
                    Some(t) => out.push(t),
                    None => return Err("a list with a null in it".into()),
                }
            }
            Some(toml::Value::Array(out))
        }
        Value::Object(_) => return Err("a mapping where a single value is expected".into()),
    })
}

/// The same value.
fn same(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    toml_of(v)
}

fn int(v: &Value) -> Result<i64, String> {
    v.as_i64()
        .ok_or_else(|| format!("expected a whole number, got {} {v}", kind(v)))
}

/// A whole number, with verl's "-1 (or 0): off" as 0.
fn off_is_zero(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    Ok(Some(toml::Value::Integer(int(v)?.max(0))))
}

/// A switch: `true` writes it, `false` leaves it out.
fn switch(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v {
        Value::Bool(true) => Ok(Some(toml::Value::Boolean(true))),
        Value::Bool(false) | Value::Null => Ok(None),
        _ => Err(format!("expected true or false, got {} {v}", kind(v))),
    }
}

/// Whether verl's LoRA is on (`actor_rollout_ref.model.lora_rank` > 0).
fn lora_is_on(ctx: &Ctx) -> bool {
    let rank = ctx.get("actor_rollout_ref.model.lora_rank");
    rank.and_then(|r| r.as_i64()).is_some_and(|r| r > 0)
}

/// verl's lora_rank: 0 (off) writes nothing.
fn lora_rank(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match int(v)? {
        0 => Ok(None),
        r if r > 0 => Ok(Some(toml::Value::Integer(r))),
        r => Err(format!("expected a rank >= 0, got {r}")),
    }
}

/// A LoRA key's value as it is, when LoRA is on.
fn lora_on(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match lora_is_on(ctx) {
        true => same(v, ctx),
        false => Ok(None),
    }
}

/// verl's target_modules (a list of module names, or "all-linear") as a comma list, when LoRA
/// is on.
fn lora_targets(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    if !lora_is_on(ctx) {
        return Ok(None);
    }
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => {
            let names: Option<Vec<&str>> = a.iter().map(Value::as_str).collect();
            names.ok_or("expected a list of module names")?.join(",")
        }
        _ => {
            return Err(format!(
                "expected a list of module names, got {} {v}",
                kind(v)
            ))
        }
    };
    Ok(Some(toml::Value::String(text)))
}

fn nothing(_: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    Ok(None)
}

/// A file path: `~/` is the home directory; a list must have one file.
fn path(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().into(),
        Value::Array(a) => {
            return Err(format!(
                "{} files: a tandem spec takes one parquet file per split (join them first, e.g. with duckdb or pandas)",
                a.len()
            ))
        }
        Value::Null => return Ok(None),
        _ => return Err(format!("expected a file path, got {} {v}", kind(v))),
    };
    Ok(Some(toml::Value::String(expand_home(&s))))
}

/// `~/x` as `$HOME/x` (verl's paths are expanded by Python; a tandem spec's are not).
pub(crate) fn expand_home(s: &str) -> String {
    match (s.strip_prefix("~/"), std::env::var("HOME")) {
        (Some(rest), Ok(home)) if !home.is_empty() => {
            Path::new(&home).join(rest).display().to_string()
        }
        _ => s.to_string(),
    }
}

/// `total_epochs` × full batches of the training set (verl's dataloader drops the last partial
/// batch), unless `total_training_steps` is set.
fn epochs_to_steps(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    if ctx.get("trainer.total_training_steps").is_some() {
        return Ok(None);
    }
    let epochs = int(v)?;
    let batch = ctx
        .get("data.train_batch_size")
        .ok_or("needs data.train_batch_size to count the steps of an epoch")?;
    let batch = int(&batch).map_err(|e| format!("data.train_batch_size = {batch}: {e}"))?;
    let Some(rows) = ctx.train_rows else {
        return Err("trainer.total_training_steps is null and data.train_files cannot be read here to count an epoch's steps: set trainer.total_training_steps=N".into());
    };
    let rows = match ctx.get("data.train_max_samples").and_then(|m| m.as_i64()) {
        Some(m) if m > 0 => rows.min(m as usize),
        _ => rows,
    };
    if batch <= 0 || epochs <= 0 {
        return Err(format!(
            "total_epochs = {epochs} with data.train_batch_size = {batch}: both must be at least 1"
        ));
    }
    let per_epoch = rows as i64 / batch;
    if per_epoch == 0 {
        return Err(format!("data.train_files has {rows} rows, fewer than data.train_batch_size = {batch}: an epoch has no full batch"));
    }
    Ok(Some(toml::Value::Integer(epochs * per_epoch)))
}

/// verl's mini-batch counts prompts; tandem's counts sequences (× rollout.n, as verl's actor
/// does before splitting it over the ranks).
fn mini_batch(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    let prompts = int(v)?;
    let n = ctx
        .get("actor_rollout_ref.rollout.n")
        .map(|n| int(&n))
        .transpose()?
        .unwrap_or(1);
    Ok(Some(toml::Value::Integer(prompts * n)))
}

/// Only when `actor.use_dynamic_bsz` (tokens per micro-batch; else verl counts sequences).
fn actor_tokens(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("actor_rollout_ref.actor.use_dynamic_bsz") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

fn ref_tokens(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("actor_rollout_ref.ref.log_prob_use_dynamic_bsz") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

/// verl's `truncation`: error and left are tandem's; right and middle cut the wrong end.
fn truncation(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_str() {
        Some("error" | "left") => same(v, ctx),
        _ => Err(format!(
            "{v}: tandem's rollout truncates a long prompt on the left or stops (error, left)"
        )),
    }
}

/// vLLM's top_k: -1 and 0 both mean all tokens; tandem writes -1.
fn top_k(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    let k = int(v)?;
    Ok(Some(toml::Value::Integer(if k == 0 { -1 } else { k })))
}

fn greedy_unless_sampling(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v {
        Value::Bool(false) => Ok(Some(toml::Value::Float(0.0))),
        Value::Bool(true) => Ok(None),
        _ => Err(format!("expected true or false, got {} {v}", kind(v))),
    }
}

/// A validation sampling key, carried only when `val_kwargs.do_sample` (else tandem's
/// evaluation decodes greedily, as verl's does).
fn val_sampling(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("actor_rollout_ref.rollout.val_kwargs.do_sample") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

fn val_top_k(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("actor_rollout_ref.rollout.val_kwargs.do_sample") {
        true => top_k(v, ctx),
        false => Ok(None),
    }
}

fn python_reward(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    let Some(Value::String(file)) = (!v.is_null()).then_some(v) else {
        return match v {
            Value::Null => Ok(None),
            _ => Err(format!("expected a file path, got {} {v}", kind(v))),
        };
    };
    let func = ctx
        .get("custom_reward_function.name")
        .and_then(|f| f.as_str().map(str::to_string))
        .unwrap_or_else(|| "compute_score".into());
    Ok(Some(toml::Value::String(format!(
        "python:{}:{func}",
        expand_home(file)
    ))))
}

fn json_text(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v {
        Value::Object(o) if o.is_empty() => Ok(None),
        Value::Object(_) => Ok(Some(toml::Value::String(v.to_string()))),
        Value::Null => Ok(None),
        _ => Err(format!(
            "expected a mapping of keyword arguments, got {} {v}",
            kind(v)
        )),
    }
}

/// DAPO's overlong buffer keys, carried when `overlong_buffer.enable`.
fn when_overlong(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("reward_model.overlong_buffer.enable") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

/// The reward's KL keys, carried with `use_kl_in_reward` (advantage refuses them without).
fn when_kl_in_reward(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("algorithm.use_kl_in_reward") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

/// DAPO's dynamic-sampling keys, carried when `filter_groups.enable`.
fn when_filtering(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("algorithm.filter_groups.enable") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

fn when_filtering_cap(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("algorithm.filter_groups.enable") {
        true => off_is_zero(v, ctx),
        false => Ok(None),
    }
}

/// `lr_warmup_steps` when >= 0 (-1: from the ratio).
fn warmup_steps(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    let s = int(v)?;
    Ok((s >= 0).then_some(toml::Value::Integer(s)))
}

/// `int(ratio × total steps)` when the actor's `lr_warmup_steps` is -1, as verl's FSDP worker
/// computes it.
fn warmup_ratio(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    warmup_ratio_of("actor_rollout_ref.actor", v, ctx)
}

/// [`warmup_ratio`] of the optimizer under `owner` (the actor's or the critic's).
fn warmup_ratio_of(owner: &str, v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    let explicit = ctx
        .get(&format!("{owner}.optim.lr_warmup_steps"))
        .and_then(|s| s.as_i64())
        .is_some_and(|s| s >= 0);
    let ratio = v
        .as_f64()
        .ok_or_else(|| format!("expected a number, got {} {v}", kind(v)))?;
    if explicit || ratio == 0.0 {
        return Ok(None);
    }
    let Some(steps) = total_steps(ctx)? else {
        return Err(
            "needs the run's steps (trainer.total_training_steps) to turn the ratio into steps"
                .into(),
        );
    };
    Ok(Some(toml::Value::Integer((ratio * steps as f64) as i64)))
}

/// A critic key, carried when the estimator is `gae` (verl runs its critic for GAE; another
/// estimator's config still has every `critic.*` default, which tandem leaves out).
fn when_gae(v: &Value, ctx: &Ctx, conv: Conv) -> Result<Option<toml::Value>, String> {
    match ctx
        .get("algorithm.adv_estimator")
        .as_ref()
        .and_then(Value::as_str)
    {
        Some("gae") => conv(v, ctx),
        _ => Ok(None),
    }
}

/// verl updates the actor from the step `global_steps >= critic_warmup` on, counting from 1:
/// N − 1 critic-only steps, tandem's `critic-warmup`.
fn critic_warmup(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    Ok(Some(toml::Value::Integer((int(v)? - 1).max(0))))
}

/// Only when `critic.use_dynamic_bsz` (tokens per micro-batch).
fn critic_tokens(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match ctx.is_true("critic.use_dynamic_bsz") {
        true => same(v, ctx),
        false => Ok(None),
    }
}

/// The run's steps as the converter writes them.
pub(crate) fn total_steps(ctx: &Ctx) -> Result<Option<i64>, String> {
    if let Some(s) = ctx.get("trainer.total_training_steps") {
        return int(&s).map(Some);
    }
    match ctx.get("trainer.total_epochs") {
        Some(e) => Ok(epochs_to_steps(&e, ctx)?.and_then(|v| v.as_integer())),
        None => Ok(None),
    }
}

fn positive_total(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    let s = int(v)?;
    Ok((s > 0).then_some(toml::Value::Integer(s)))
}

fn lr_schedule(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_str() {
        Some("constant" | "cosine") => same(v, ctx),
        _ => Err(format!(
            "{v}: tandem's schedules are constant and cosine (after a linear warmup)"
        )),
    }
}

fn half_cycle(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_f64() {
        Some(0.5) => Ok(None),
        _ => Err(format!(
            "{v}: tandem's cosine decays over half a cycle (num_cycles = 0.5) only"
        )),
    }
}

fn adamw(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_str() {
        Some(s) if s.eq_ignore_ascii_case("adamw") => Ok(None),
        _ => Err(format!("{v}: tandem's optimizer is AdamW")),
    }
}

fn ppo_clip(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_str() {
        Some("ppo_clip") => Ok(None),
        _ => Err(format!(
            "{v}: tandem's bypass mode keeps the PPO-clip loss (ppo_clip)"
        )),
    }
}

fn keep_last(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    match v {
        Value::Null => Ok(None),
        _ => same(v, ctx),
    }
}

const fn key(key: &'static str) -> To {
    To::Key {
        key,
        how: "",
        conv: same,
    }
}

const fn key_how(key: &'static str, how: &'static str, conv: Conv) -> To {
    To::Key { key, how, conv }
}

const fn rule(verl: &'static str, to: To) -> Rule {
    Rule { verl, to }
}

/// Every verl key the converter knows, by section (the order of the doc's table).
pub(crate) static RULES: &[Rule] = &[
    // data.*
    rule("data.train_files", key_how("data.train", "one file; `~/` expanded", path)),
    rule("data.val_files", key_how("data.val", "one file; `~/` expanded", path)),
    rule("data.train_batch_size", key_how("data.prompts-per-step", "prompts per step (each gets `rollout.n` samples)", same)),
    rule("data.shuffle", key("data.shuffle")),
    rule("data.seed", key_how("seed", "null: tandem's 0", same)),
    rule("data.max_prompt_length", key("rollout.max-prompt-tokens")),
    rule("data.max_response_length", key("rollout.max-new-tokens")),
    rule("data.prompt_key", key("rollout.prompt-key")),
    rule("data.truncation", key_how("rollout.truncate", "`error` or `left` (right and middle: exit 2)", truncation)),
    rule("data.val_max_samples", key_how("eval.limit", "-1: all rows", |v, c| Ok(off_is_zero(v, c)?.filter(|x| x.as_integer() != Some(0))))),
    rule("data.gen_batch_size", key_how("algorithm.prompts-per-round", "with `algorithm.filter_groups.enable` (DAPO)", when_filtering)),
    rule("data.filter_overlong_prompts", To::WhenOn { switch: "", why: "tandem does not drop long prompts: `truncate` stops on them (error) or cuts their start (left); filter the dataset first" }),
    rule("data.train_max_samples", To::WhenOn { switch: "", why: "tandem trains on the whole file (cut it first); the epoch length above counts these rows" }),
    rule("data.tokenizer", To::WhenOn { switch: "", why: "tandem uses the model directory's tokenizer" }),
    rule("data.reward_fn_key", To::None("the reward reads `data_source` (verl's default key)")),
    rule("data.return_raw_chat", To::Builtin("rollout renders the chat template itself")),
    rule("data.return_raw_input_ids", To::Builtin("rollout renders the chat template itself")),
    rule("data.return_full_prompt", To::Builtin("rollout renders the chat template itself")),
    rule("data.apply_chat_template_kwargs", To::WhenOn { switch: "", why: "the chat template is rendered with its defaults" }),
    rule("data.*", To::None("verl's data loader (workers, shared memory, multi-modal keys, custom dataset classes): tandem reads one parquet file")),
    // actor_rollout_ref.model.*
    rule("actor_rollout_ref.model.path", key_how("model.path", "also the reference model, as in verl; `~/` expanded", path)),
    rule("actor_rollout_ref.model.lora_rank", key_how("update.lora-rank", "0 (off): nothing written", lora_rank)),
    rule("actor_rollout_ref.model.target_modules", key_how("update.lora-targets", "a comma list (or all-linear); only with lora_rank on", lora_targets)),
    rule("actor_rollout_ref.model.exclude_modules", To::WhenOn { switch: "actor_rollout_ref.model.lora_rank", why: "no exclusions: adapters sit on every target of every layer" }),
    rule("actor_rollout_ref.model.lora_alpha", key_how("update.lora-alpha", "only with lora_rank on", lora_on)),
    rule("actor_rollout_ref.model.lora_adapter_path", To::WhenOn { switch: "", why: "not converted: give the adapter directory as [model] path and its base as [model] ref (docs/LORA.md)" }),
    rule("actor_rollout_ref.model.custom_chat_template", To::WhenOn { switch: "", why: "rollout uses the model directory's chat template (edit tokenizer_config.json or chat_template.jinja there)" }),
    rule("actor_rollout_ref.model.*", To::None("model loading and memory options of verl's FSDP engine (remove padding, gradient checkpointing, liger, fused kernels, ...): tandem's engine packs sequences and picks its kernels itself")),
    // actor_rollout_ref.actor.*
    rule("actor_rollout_ref.actor.optim.lr", key("update.lr")),
    rule("actor_rollout_ref.actor.optim.betas", key("update.betas")),
    rule("actor_rollout_ref.actor.optim.weight_decay", key("update.weight-decay")),
    rule("actor_rollout_ref.actor.optim.clip_grad", key("update.grad-clip")),
    rule("actor_rollout_ref.actor.grad_clip", key_how("update.grad-clip", "the one verl's actor uses (wins over `optim.clip_grad`)", same)),
    rule("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", key_how("update.lr-warmup-steps", "int(ratio × steps) when `lr_warmup_steps` is -1", warmup_ratio)),
    rule("actor_rollout_ref.actor.optim.lr_warmup_steps", key_how("update.lr-warmup-steps", "-1: from the ratio", warmup_steps)),
    rule("actor_rollout_ref.actor.optim.lr_scheduler_type", key_how("update.lr-schedule", "constant or cosine", lr_schedule)),
    rule("actor_rollout_ref.actor.optim.warmup_style", key_how("update.lr-schedule", "verl's older name of `lr_scheduler_type`", |v, c| if v.is_null() { Ok(None) } else { lr_schedule(v, c) })),
    rule("actor_rollout_ref.actor.optim.min_lr_ratio", key("update.min-lr-ratio")),
    rule("actor_rollout_ref.actor.optim.num_cycles", key_how("update.lr-schedule", "0.5 only (half a cosine cycle)", half_cycle)),
    rule("actor_rollout_ref.actor.optim.total_training_steps", key_how("update.total-steps", "-1: the runner's `steps`", positive_total)),
    rule("actor_rollout_ref.actor.optim.optimizer", key_how("update", "AdamW only", adamw)),
    rule("actor_rollout_ref.actor.optim.optimizer_impl", To::Builtin("tandem's own AdamW")),
    rule("actor_rollout_ref.actor.optim.*", To::WhenOn { switch: "", why: "optimizer options tandem's AdamW does not have" }),
    rule("actor_rollout_ref.actor.ppo_mini_batch_size", key_how("update.mini-batch-size", "× `rollout.n`: tandem counts sequences", mini_batch)),
    rule("actor_rollout_ref.actor.ppo_epochs", key("update.ppo-epochs")),
    rule("actor_rollout_ref.actor.shuffle", key("update.shuffle")),
    rule("actor_rollout_ref.actor.clip_ratio", key("update.clip-ratio")),
    rule("actor_rollout_ref.actor.clip_ratio_low", key("update.clip-ratio-low")),
    rule("actor_rollout_ref.actor.clip_ratio_high", key("update.clip-ratio-high")),
    rule("actor_rollout_ref.actor.clip_ratio_c", key("update.clip-ratio-c")),
    rule("actor_rollout_ref.actor.loss_agg_mode", key("update.loss-agg-mode")),
    rule("actor_rollout_ref.actor.loss_scale_factor", key("update.loss-scale-factor")),
    rule("actor_rollout_ref.actor.entropy_coeff", key("update.entropy-coeff")),
    rule("actor_rollout_ref.actor.use_kl_loss", key_how("update.use-kl-loss", "true: also the reference pass", switch)),
    rule("actor_rollout_ref.actor.kl_loss_coef", key("update.kl-loss-coef")),
    rule("actor_rollout_ref.actor.kl_loss_type", key("update.kl-loss-type")),
    rule("actor_rollout_ref.actor.policy_loss.loss_mode", key_how("update.loss", "vanilla, gspo, cispo", same)),
    rule("actor_rollout_ref.actor.use_dynamic_bsz", key_how("update.micro-batch-tokens", "true: carries `ppo_max_token_len_per_gpu`", nothing)),
    rule("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", key_how("update.micro-batch-tokens", "with `use_dynamic_bsz` (tandem's micro-batches are always by tokens)", actor_tokens)),
    rule("actor_rollout_ref.actor.ppo_micro_batch_size", To::WhenOn { switch: "", why: "tandem's micro-batches are by tokens ([update] micro-batch-tokens); use_dynamic_bsz=True with ppo_max_token_len_per_gpu carries over" }),
    rule("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", To::WhenOn { switch: "", why: "tandem's micro-batches are by tokens ([update] micro-batch-tokens); use_dynamic_bsz=True with ppo_max_token_len_per_gpu carries over" }),
    rule("actor_rollout_ref.actor.calculate_entropy", To::Builtin("update always reports the entropy")),
    rule("actor_rollout_ref.actor.rollout_n", To::Builtin("the rollout's `n`")),
    rule("actor_rollout_ref.actor.policy_loss.*", To::None("options of verl's clip-cov and kl-cov losses, which tandem does not have (the loss modes above ignore them)")),
    rule("actor_rollout_ref.actor.checkpoint.*", To::Builtin("a checkpoint holds the weights, optimizer and trainer state")),
    rule("actor_rollout_ref.actor.*", To::None("verl's FSDP/Megatron actor (strategy, fsdp_config, sequence parallelism, offload, profiler, torch.compile): tandem's trainer runs data parallel over `gpus`, sharding with [update] shard = zero2|full")),
    // actor_rollout_ref.rollout.*
    rule("actor_rollout_ref.rollout.n", key("rollout.n")),
    rule("actor_rollout_ref.rollout.temperature", key("rollout.temperature")),
    rule("actor_rollout_ref.rollout.top_k", key_how("rollout.top-k", "0 and -1: all tokens (-1)", top_k)),
    rule("actor_rollout_ref.rollout.top_p", key("rollout.top-p")),
    rule("actor_rollout_ref.rollout.do_sample", key_how("rollout.temperature", "false: 0 (greedy)", greedy_unless_sampling)),
    rule("actor_rollout_ref.rollout.prompt_length", key_how("rollout.max-prompt-tokens", "wins over `data.max_prompt_length`", same)),
    rule("actor_rollout_ref.rollout.response_length", key_how("rollout.max-new-tokens", "wins over `data.max_response_length`", same)),
    rule("actor_rollout_ref.rollout.ignore_eos", key_how("rollout.ignore-eos", "", switch)),
    rule("actor_rollout_ref.rollout.max_num_seqs", key("rollout.max-num-seqs")),
    rule("actor_rollout_ref.rollout.max_num_batched_tokens", key("rollout.max-batched-tokens")),
    rule("actor_rollout_ref.rollout.enforce_eager", key_how("rollout.no-cuda-graphs", "", switch)),
    rule("actor_rollout_ref.rollout.val_kwargs.n", key("eval.n")),
    rule("actor_rollout_ref.rollout.val_kwargs.do_sample", key_how("eval", "false: greedy (tandem's evaluation default); true: carries the three below", nothing)),
    rule("actor_rollout_ref.rollout.val_kwargs.temperature", key_how("eval.temperature", "with `val_kwargs.do_sample`", val_sampling)),
    rule("actor_rollout_ref.rollout.val_kwargs.top_k", key_how("eval.top-k", "with `val_kwargs.do_sample`", val_top_k)),
    rule("actor_rollout_ref.rollout.val_kwargs.top_p", key_how("eval.top-p", "with `val_kwargs.do_sample`", val_sampling)),
    rule("actor_rollout_ref.rollout.calculate_log_probs", To::Builtin("rollout always writes `rollout_logprobs`")),
    rule("actor_rollout_ref.rollout.multi_turn.enable", To::Builtin("with tools (`tool_config_path`) the rollout is multi-turn; the keys below apply when it is true")),
    rule("actor_rollout_ref.rollout.multi_turn.tool_config_path", key_how("rollout.tool", "each tool of verl's tool YAML as `NAME=python:FILE.py:CLASS`, FILE the `class_name`'s module found from the working directory, the config's or the YAML's folder or their parents (else noted); the YAML's `config` and `tool_schema` are not passed to the class", |v, c| mt::when_on(v, c, mt::tools))),
    rule("actor_rollout_ref.rollout.multi_turn.max_user_turns", key_how("rollout.max-turns", "`max_user_turns` + 1 (tandem counts assistant turns); 0 or null: no limit (tandem's default 8)", |v, c| mt::when_on(v, c, mt::user_turns))),
    rule("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", key_how("rollout.max-turns", "the smaller of it and `max_user_turns` + 1; 0 or null: no limit (tandem's default 8)", |v, c| mt::when_on(v, c, mt::assistant_turns))),
    rule("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", key_how("rollout.max-parallel-calls", "with `multi_turn.enable`", |v, c| mt::when_on(v, c, mt::count))),
    rule("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", key_how("rollout.max-tool-response-chars", "with `multi_turn.enable`", |v, c| mt::when_on(v, c, mt::count))),
    rule("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", key_how("rollout.tool-response-truncate-side", "with `multi_turn.enable`: left, right or middle", |v, c| mt::when_on(v, c, mt::side))),
    rule("actor_rollout_ref.rollout.multi_turn.format", key_how("rollout", "hermes only (tandem reads `<tool_call>{…}</tool_call>`, Qwen2.5's); another: exit 2", |v, c| mt::when_on(v, c, mt::format))),
    rule("actor_rollout_ref.rollout.multi_turn.*", To::WhenOn { switch: "actor_rollout_ref.rollout.multi_turn.enable", why: "verl's interaction agents, chat-template and tokenization-check options: no counterpart (tandem never re-tokenizes the model's tokens: docs/AGENTS.md)" }),
    rule("actor_rollout_ref.rollout.agent.*", To::None("agent loops: tandem runs tools itself ([rollout] tool, docs/AGENTS.md); an agent written as a program of its own is not supported yet")),
    rule("actor_rollout_ref.rollout.name", To::None("tandem generates with its own paged engine (no vLLM or SGLang)")),
    rule("actor_rollout_ref.rollout.gpu_memory_utilization", To::None("vLLM's share of the whole GPU; tandem's [rollout] gpu-memory-fraction is the share of the memory left free after the weights (default 0.9): set it yourself")),
    rule("actor_rollout_ref.rollout.*_parallel_size", To::None("no model parallelism: the rollout runs data parallel over `gpus`")),
    rule("actor_rollout_ref.rollout.log_prob_*", To::None("the old-logprob pass takes [ref-logprob] micro-batch-tokens")),
    rule("actor_rollout_ref.rollout.*", To::None("options of vLLM/SGLang and verl's rollout workers (mode, dtype, chunked prefill, prefix caching, weight sync, tracing): tandem's engine has its own ([rollout] keys)")),
    // actor_rollout_ref.ref.*
    rule("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", key_how("ref-logprob.micro-batch-tokens", "true: carries `log_prob_max_token_len_per_gpu`", nothing)),
    rule("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", key_how("ref-logprob.micro-batch-tokens", "with `log_prob_use_dynamic_bsz`", ref_tokens)),
    rule("actor_rollout_ref.ref.rollout_n", To::Builtin("the rollout's `n`")),
    rule("actor_rollout_ref.ref.*", To::None("the reference worker's FSDP options and micro-batches in sequences: [ref-logprob] micro-batch-tokens sets its batching")),
    rule("actor_rollout_ref.*", To::None("verl's hybrid engine (one process group for actor, rollout and reference)")),
    // algorithm.*
    rule("algorithm.adv_estimator", key_how("advantage.estimator", "`remax` also writes `[rollout] baseline = \"greedy\"`", same)),
    rule("algorithm.gamma", key("advantage.gamma")),
    rule("algorithm.lam", key("advantage.lam")),
    rule("algorithm.norm_adv_by_std_in_grpo", key("advantage.norm-by-std")),
    rule("algorithm.use_kl_in_reward", key_how("advantage.kl-in-reward", "true: also the reference and old-logprob passes", switch)),
    rule("algorithm.kl_penalty", key_how("advantage.kl-penalty", "with `use_kl_in_reward`", when_kl_in_reward)),
    rule("algorithm.kl_ctrl.type", key_how("advantage.kl-ctrl", "with `use_kl_in_reward`", when_kl_in_reward)),
    rule("algorithm.kl_ctrl.kl_coef", key_how("advantage.kl-coef", "with `use_kl_in_reward`", when_kl_in_reward)),
    rule("algorithm.kl_ctrl.horizon", key_how("advantage.kl-horizon", "with `use_kl_in_reward`", when_kl_in_reward)),
    rule("algorithm.kl_ctrl.target_kl", key_how("advantage.kl-target", "with `use_kl_in_reward`", when_kl_in_reward)),
    rule("algorithm.filter_groups.enable", key_how("algorithm.filter-groups", "", switch)),
    rule("algorithm.filter_groups.metric", key_how("algorithm.filter-metric", "with `filter_groups.enable`", when_filtering)),
    rule("algorithm.filter_groups.max_num_gen_batches", key_how("algorithm.max-num-gen-batches", "with `filter_groups.enable`; <= 0: no cap (0)", when_filtering_cap)),
    rule("algorithm.rollout_correction.rollout_is", key("update.rollout-is")),
    rule("algorithm.rollout_correction.rollout_is_threshold", key_how("update.rollout-is-threshold", "with `rollout_is`", |v, c| if c.get("algorithm.rollout_correction.rollout_is").is_some() { same(v, c) } else { Ok(None) })),
    rule("algorithm.rollout_correction.rollout_rs", key_how("update.rollout-rs", "token, sequence, geometric", same)),
    rule("algorithm.rollout_correction.rollout_rs_threshold", key_how("update.rollout-rs-threshold", "with `rollout_rs`", |v, c| if c.get("algorithm.rollout_correction.rollout_rs").is_some() { same(v, c) } else { Ok(None) })),
    rule("algorithm.rollout_correction.bypass_mode", key_how("update.bypass-mode", "", switch)),
    rule("algorithm.rollout_correction.loss_type", key_how("update.loss", "ppo_clip only", ppo_clip)),
    rule("algorithm.rollout_correction.rollout_is_batch_normalize", To::WhenOn { switch: "", why: "the IS weights are not renormalised over the batch" }),
    rule("algorithm.use_pf_ppo", To::WhenOn { switch: "", why: "no preference-feedback PPO (sample reweighting)" }),
    rule("algorithm.pf_ppo.*", To::WhenOn { switch: "algorithm.use_pf_ppo", why: "no preference-feedback PPO" }),
    rule("algorithm.*", To::None("not an algorithm option tandem has")),
    // custom_reward_function.*, reward_model.*
    rule("custom_reward_function.path", key_how("score.reward", "`python:PATH:NAME` (verl's `compute_score` signature, unchanged); null: from `data_source` (below)", python_reward)),
    rule("custom_reward_function.name", key_how("score.reward", "the function of `python:PATH:NAME`", nothing)),
    rule("custom_reward_function.reward_kwargs", key_how("score.reward-kwargs", "as JSON", json_text)),
    rule("reward_model.overlong_buffer.enable", key_how("score.overlong-buffer-len", "true: carries `len` and `penalty_factor` (DAPO)", nothing)),
    rule("reward_model.overlong_buffer.len", key_how("score.overlong-buffer-len", "with `overlong_buffer.enable`", when_overlong)),
    rule("reward_model.overlong_buffer.penalty_factor", key_how("score.overlong-penalty-factor", "with `overlong_buffer.enable`", when_overlong)),
    rule("reward_model.overlong_buffer.log", To::Builtin("score always writes `score_overlong`")),
    rule("reward_model.enable", To::WhenOn { switch: "", why: "no reward model: rewards are rules or programs ([score] reward)" }),
    rule("reward_model.reward_manager", To::None("score calls the reward per row (verl's naive manager); batched managers have no counterpart")),
    rule("reward_model.*", To::WhenOn { switch: "reward_model.enable", why: "the reward model's worker: tandem has no reward model ([score] reward is a rule or a program)" }),
    rule("reward_manager.*", To::None("score calls the reward per row (verl's naive manager); a program reward (cmd:) can batch")),
    // critic.*
    rule("critic.model.path", key_how("critic.model", "with `adv_estimator=gae`; `~/` expanded (a policy's model: the critic starts from it with a zero value head)", |v, c| when_gae(v, c, path))),
    rule("critic.optim.lr", key_how("critic.lr", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.optim.betas", key_how("critic.betas", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.optim.weight_decay", key_how("critic.weight-decay", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.optim.clip_grad", key_how("critic.grad-clip", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.grad_clip", key_how("critic.grad-clip", "with `adv_estimator=gae` (wins over `optim.clip_grad`)", |v, c| when_gae(v, c, same))),
    rule("critic.optim.lr_warmup_steps_ratio", key_how("critic.lr-warmup-steps", "with `adv_estimator=gae`: int(ratio × steps) when `lr_warmup_steps` is -1", |v, c| when_gae(v, c, |v, c| warmup_ratio_of("critic", v, c)))),
    rule("critic.optim.lr_warmup_steps", key_how("critic.lr-warmup-steps", "with `adv_estimator=gae`; -1: from the ratio", |v, c| when_gae(v, c, warmup_steps))),
    rule("critic.optim.lr_scheduler_type", key_how("critic.lr-schedule", "with `adv_estimator=gae`: constant or cosine", |v, c| when_gae(v, c, lr_schedule))),
    rule("critic.optim.min_lr_ratio", key_how("critic.min-lr-ratio", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.optim.optimizer", key_how("critic", "AdamW only", |v, c| when_gae(v, c, adamw))),
    rule("critic.cliprange_value", key_how("critic.cliprange-value", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.loss_agg_mode", key_how("critic.loss-agg-mode", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.ppo_epochs", key_how("critic.ppo-epochs", "with `adv_estimator=gae`", |v, c| when_gae(v, c, same))),
    rule("critic.ppo_mini_batch_size", key_how("critic.mini-batch-size", "with `adv_estimator=gae`; × `rollout.n` (tandem counts sequences)", |v, c| when_gae(v, c, mini_batch))),
    rule("critic.ppo_max_token_len_per_gpu", key_how("critic.micro-batch-tokens", "with `adv_estimator=gae` and `critic.use_dynamic_bsz`", |v, c| when_gae(v, c, critic_tokens))),
    rule("critic.rollout_n", To::Builtin("the rollout's `n`")),
    rule("critic.checkpoint.*", To::Builtin("a critic checkpoint holds the weights, optimizer and trainer state")),
    rule("critic.*", To::None("verl's FSDP/Megatron critic worker (strategy, fsdp_config, offload, micro-batches in sequences, forward token budgets, profiler): tandem's critic is sharded as the policy over the spec's gpus ([critic] micro-batch-tokens sets its batching, shard its sharding)")),
    // trainer.*
    rule("trainer.total_training_steps", key_how("steps", "null: from `total_epochs`", same)),
    rule("trainer.total_epochs", key_how("steps", "`total_epochs` × (training rows ÷ `train_batch_size`, rounded down), when `total_training_steps` is null and the training file can be read", epochs_to_steps)),
    rule("trainer.n_gpus_per_node", key("gpus")),
    rule("trainer.nnodes", key_how("nodes", "1 only", same)),
    rule("trainer.device", key("device")),
    rule("trainer.test_freq", key_how("eval.every", "-1: 0 (never)", off_is_zero)),
    rule("trainer.val_before_train", key("eval.at-start")),
    rule("trainer.save_freq", key_how("checkpoint.every", "-1: 0 (only the current policy)", off_is_zero)),
    rule("trainer.max_actor_ckpt_to_keep", key_how("checkpoint.keep-last", "null (all): tandem's default, 1", keep_last)),
    rule("trainer.balance_batch", To::Builtin("update balances the rows over the ranks by tokens")),
    rule("trainer.logger", To::None("tandem logs to metrics.jsonl and TensorBoard event files in the run directory")),
    rule("trainer.project_name", To::None("the run directory names the run (pipeline run --run-dir)")),
    rule("trainer.experiment_name", To::None("the run directory names the run (pipeline run --run-dir)")),
    rule("trainer.rollout_data_dir", To::Builtin("every step's batches stay in RUN/step-K/")),
    rule("trainer.validation_data_dir", To::Builtin("every evaluation's batches stay in RUN/eval/step-K/")),
    rule("trainer.log_val_generations", To::Builtin("every evaluation's batches stay in RUN/eval/step-K/ (tandem inspect shows them)")),
    rule("trainer.default_local_dir", To::None("checkpoints go to RUN/ckpt/")),
    rule("trainer.resume_mode", To::None("running pipeline run again resumes the run in its directory")),
    rule("trainer.resume_from_path", To::WhenOn { switch: "", why: "running pipeline run again resumes the run in its directory" }),
    rule("trainer.critic_warmup", key_how("critic.critic-warmup", "with `adv_estimator=gae`: N − 1 (verl's actor starts at step N, its first step is 1)", |v, c| when_gae(v, c, critic_warmup))),
    rule("trainer.max_critic_ckpt_to_keep", To::WhenOn { switch: "", why: "the critic's checkpoints are kept as the policy's ([checkpoint] every and keep-last)" }),
    rule("trainer.val_only", To::WhenOn { switch: "", why: "no evaluation-only run: run rollout and score by hand" }),
    rule("trainer.*", To::None("verl's Ray trainer (HDFS, ESI, Ray registration, legacy workers)")),
    // the rest
    rule("defaults", To::None("Hydra's defaults list is not followed: keys only in the files it names take tandem's defaults (convert the config `python3 -m verl.trainer.main_ppo --cfg job` prints instead)")),
    rule("global_profiler.*", To::None("no profiler hooks (nsys works on the stage binaries as they are)")),
    rule("ray_kwargs.*", To::None("no Ray: the runner starts the stages as processes")),
    rule("ray_init.*", To::None("no Ray: the runner starts the stages as processes")),
    rule("transfer_queue.*", To::None("no transfer queue: stages pass parquet files")),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_segments() {
        let r = |verl| Rule {
            verl,
            to: To::Builtin(""),
        };
        assert!(r("critic.*").matches("critic.optim.lr"));
        assert!(r("critic.*").matches("critic.strategy"));
        assert!(!r("critic.*").matches("critic"));
        assert!(!r("critic.*").matches("critical.x"));
        assert!(r("a.*_parallel_size").matches("a.tensor_model_parallel_size"));
        assert!(!r("a.*_parallel_size").matches("a.tensor_model_parallel_size.x"));
        assert!(r("a.log_prob_*").matches("a.log_prob_micro_batch_size"));
        assert!(r("data.seed").matches("data.seed") && !r("data.seed").matches("data.seeds"));
        // Every rule's key is matched by itself first or by an earlier, more specific rule:
        // no exact rule is shadowed by a pattern listed before it.
        for (i, rule) in RULES
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.verl.contains('*'))
        {
            let first = RULES.iter().position(|r| r.matches(rule.verl)).unwrap();
            assert_eq!(
                first, i,
                "{} is shadowed by {}",
                rule.verl, RULES[first].verl
            );
        }
    }

    #[test]
    fn home_is_expanded_in_paths() {
        let home = std::env::var("HOME").unwrap();
        let want = Path::new(&home)
            .join("data/x.parquet")
            .display()
            .to_string();
        assert_eq!(expand_home("~/data/x.parquet"), want);
        assert_eq!(expand_home("data/~/x"), "data/~/x");
    }
}
