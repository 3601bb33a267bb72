//! The pipeline spec: `pipelines/NAME.toml`.
//!
//! Top-level keys (`seed`, `steps`, `device`, `gpus`, `nodes`, `daemon`, `batch-invariant`) come first, then one
//! table per concern: `[model]`, `[data]`, one table per stage (`[rollout]`, `[score]`,
//! `[ref-logprob]`, `[advantage]`, `[update]`, `[sync-weights]`), `[algorithm]` (what the runner
//! does between stages: DAPO's dynamic sampling), then `[eval]` and `[checkpoint]`.
//!
//! A stage table's keys are that stage's flags without the leading `--`, and nothing here lists
//! them: each key is looked up by long name in the stage's own clap command
//! (`crate::stage::STAGES`), its value becomes command-line arguments as the flag's definition
//! takes them (a switch for `true`, a value, a repeated flag or a comma-joined list for an
//! array), and the arguments are parsed by the stage's own parser when the spec is loaded. So a
//! new stage flag is a spec key with no edit here, a bad value is an error naming the spec key
//! before anything runs, and what the runner needs to know (samples per prompt, epochs, the KL
//! controller) it reads from the parsed flags ([`Stages`]). Flags the runner sets itself
//! (`--model`, `--in`, `--out`, `--seed`, `--metrics`, `--device`...) are not keys. An unknown
//! key is an error naming the line and the closest valid key.

use super::agent_spec::AgentCmd;
use crate::bail_input;
use crate::batch::schema::SCORE_PREFIX;
use crate::error::input_error;
use crate::stage::advantage::{AdvantageArgs, Ctrl};
use crate::stage::ref_logprob::RefLogprobArgs;
use crate::stage::rollout::RolloutArgs;
use crate::stage::score::ScoreArgs;
use crate::stage::sync_weights::SyncWeightsArgs;
use crate::stage::update::UpdateArgs;
use crate::stage::values::ValuesArgs;
use crate::stage::{self, clap_message, StageDef};
use anyhow::Result;
use clap::error::{ContextKind, ContextValue};
use clap::{Arg, ArgAction, Command, FromArgMatches};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl Device {
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// `[model]`: the initial policy and an optional separate reference model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct ModelSpec {
    /// HF model directory the run starts from (also the reference when `ref` is not set).
    pub(crate) path: PathBuf,
    /// A different reference model for `ref-logprob`.
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub(crate) reference: Option<PathBuf>,
}

/// `[data]`: prompt datasets and how many prompts each step takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct DataSpec {
    pub(crate) train: PathBuf,
    /// Validation prompts for `[eval]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) val: Option<PathBuf>,
    pub(crate) prompts_per_step: u64,
    /// Reshuffle the training prompts every epoch (seeded); false keeps the file's order.
    #[serde(default = "yes")]
    pub(crate) shuffle: bool,
}

/// `[eval]`: cadence of evaluation on `data.val`, and the evaluation rollout's flags: `limit`
/// and any `[rollout]` key. The sampling keys (`n`, `temperature`, `top-p`, `top-k`) default to
/// greedy decoding of one sample (`n = 1`, `top-k = 1`, or all tokens when a temperature is
/// set); the other keys default to `[rollout]`'s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct EvalSpec {
    /// Evaluate after every `every` steps (0: never).
    #[serde(default)]
    pub(crate) every: u64,
    /// Also evaluate the initial model (step 0) when `every` > 0.
    #[serde(default = "yes")]
    pub(crate) at_start: bool,
    /// The rollout flags (checked by [`Spec::stages`]).
    #[serde(flatten)]
    pub(crate) rollout: toml::Table,
}

impl Default for EvalSpec {
    fn default() -> Self {
        EvalSpec {
            every: 0,
            at_start: true,
            rollout: toml::Table::new(),
        }
    }
}

/// `[checkpoint]`: which step checkpoints stay on disk under `ckpt/`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct CheckpointSpec {
    /// Keep the checkpoint of every `every`-th step (0: only the current policy's).
    #[serde(default)]
    pub(crate) every: u64,
    /// How many of those to keep (the newest); the current policy is always kept.
    #[serde(default = "one")]
    pub(crate) keep_last: u64,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        CheckpointSpec {
            every: 0,
            keep_last: 1,
        }
    }
}

fn yes() -> bool {
    true
}

/// `[critic]`: a value model trained beside the policy (PPO with GAE, verl's critic). Each step
/// the runner runs `values` with the critic before `advantage`, and `update --critic` after
/// it; the other keys are `update` flags for the critic's update (`lr`, `lr-warmup-steps`,
/// `cliprange-value`, `loss-agg-mode`, `grad-clip`, `ppo-epochs`, ...).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct CriticSpec {
    /// The critic the run starts from: a value model's directory, or a policy's model whose
    /// critic starts with a zero value head (default: `[model] path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<PathBuf>,
    /// The first steps train the critic only; the policy's updates start after them (verl's
    /// `trainer.critic_warmup = N` starts the actor at step N: N − 1 here).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) critic_warmup: u64,
    /// `update --critic` flags.
    #[serde(flatten)]
    pub(crate) update: toml::Table,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// `[algorithm]`: DAPO's dynamic sampling (verl's `algorithm.filter_groups`), run by the runner
/// between `score` and the next stage (`super::dynamic`). Only what is written is kept, so a
/// spec without the table resolves as before.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct AlgorithmSpec {
    /// Drop the prompt groups whose `filter-metric` is equal over all their samples and sample
    /// more prompts until the step has `[data] prompts-per-step` groups.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) filter_groups: bool,
    /// `score` (default), `acc` (the accuracy as the metrics count it: `score_acc`, else
    /// score >= 1) or a sub-score column `score_<key>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) filter_metric: Option<String>,
    /// Rounds of generation a step may take, the first included (0: no cap). Default 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_num_gen_batches: Option<u64>,
    /// Prompts drawn per round (verl's gen_batch_size). Default: `[data] prompts-per-step`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) prompts_per_round: Option<u64>,
    /// At the cap with fewer groups than asked: `train` on the groups kept (default; none kept
    /// stops the run), or `fail` as verl does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) on_cap: Option<OnCap>,
}

impl AlgorithmSpec {
    fn is_empty(&self) -> bool {
        self == &AlgorithmSpec::default()
    }
}

/// What a step does when the generation cap is reached before it has its groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnCap {
    /// Train on the groups kept so far (fewer than asked).
    Train,
    /// Stop the run with an error (verl's behaviour).
    Fail,
}

/// The per-sample value whose spread decides whether a group is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FilterMetric {
    /// The `score` column (after any overlong shaping).
    Score,
    /// Correctness: `score_acc` when present, else score >= 1.
    Acc,
    /// A sub-score column `score_<key>`.
    Column(String),
}

impl FilterMetric {
    pub fn parse(s: &str) -> Result<FilterMetric, String> {
        match s {
            "score" => Ok(FilterMetric::Score),
            "acc" => Ok(FilterMetric::Acc),
            c if c.len() > SCORE_PREFIX.len() && c.starts_with(SCORE_PREFIX) => {
                Ok(FilterMetric::Column(c.to_string()))
            }
            other => Err(format!(
                "unknown metric \"{other}\": expected \"score\", \"acc\" or a sub-score column \"score_<key>\""
            )),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            FilterMetric::Score => "score",
            FilterMetric::Acc => "acc",
            FilterMetric::Column(c) => c,
        }
    }
}

/// Dynamic sampling as the runner runs it, the defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct FilterGroups {
    pub(crate) metric: FilterMetric,
    /// Generation rounds a step may take (0: no cap).
    pub(crate) max_rounds: u64,
    pub(crate) prompts_per_round: u64,
    pub(crate) on_cap: OnCap,
}

/// verl's DAPO recipe caps a step at 10 generation batches.
pub(crate) const DEFAULT_MAX_NUM_GEN_BATCHES: u64 = 10;

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

/// A whole pipeline spec, as written. Stage tables hold flag names and TOML values;
/// [`Spec::stages`] checks them against the stages and turns them into arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct Spec {
    /// Seed of the prompt sampler and of every stage's `--seed`.
    #[serde(default)]
    pub(crate) seed: u64,
    /// Number of training steps.
    pub(crate) steps: u64,
    #[serde(default)]
    pub(crate) device: Device,
    /// Run GPU stages as clients of a warm daemon.
    #[serde(default)]
    pub(crate) daemon: bool,
    /// Ranks of the model stages on this machine: with `gpus = N > 1` the runner runs rollout,
    /// ref-logprob and update under `tandem launch --nproc-per-node N` (one rank per GPU, or N
    /// CPU processes on the CPU), or, with `daemon = true`, starts N daemons under it (a
    /// daemon group) and sends those stages to it.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(crate) gpus: u64,
    /// Machines: 1 only for now.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(crate) nodes: u64,
    /// Batch-invariant GPU kernels in every stage and the daemon (TANDEM_BATCH_INVARIANT=1):
    /// rollout log-probs equal the training forward's for the same tokens, at a rollout
    /// throughput cost (docs/ROLLOUT.md).
    #[serde(default)]
    pub(crate) batch_invariant: bool,
    pub(crate) model: ModelSpec,
    pub(crate) data: DataSpec,
    #[serde(default)]
    pub(crate) rollout: toml::Table,
    pub(crate) score: toml::Table,
    #[serde(default)]
    pub(crate) ref_logprob: toml::Table,
    #[serde(default)]
    pub(crate) advantage: toml::Table,
    #[serde(default)]
    pub(crate) update: toml::Table,
    /// `values`' flags, when a `[critic]` runs it.
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub(crate) values: toml::Table,
    /// PPO with a value model: the critic the runner trains beside the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) critic: Option<CriticSpec>,
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub(crate) sync_weights: toml::Table,
    #[serde(default, skip_serializing_if = "AlgorithmSpec::is_empty")]
    pub(crate) algorithm: AlgorithmSpec,
    #[serde(default)]
    pub(crate) eval: EvalSpec,
    #[serde(default)]
    pub(crate) checkpoint: CheckpointSpec,
    /// Rollout and training on separate GPUs (`super::placement`); colocated without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) placement: Option<super::placement::PlacementSpec>,
}

/// A stage's flags from the spec: the arguments the runner passes it (in the stage's
/// declaration order; the runner's own flags come after) and what the stage's parser made of
/// them (the runner's own flags hold placeholders there).
#[derive(Clone, Debug)]
pub struct Flags<A> {
    pub argv: Vec<String>,
    pub args: A,
}

/// Every stage's flags from a spec, parsed by the stages' own parsers.
#[derive(Clone, Debug)]
pub struct Stages {
    pub rollout: Flags<RolloutArgs>,
    pub score: Flags<ScoreArgs>,
    /// With `--temperature` of the rollout when `[rollout]` sets one and `[ref-logprob]` not.
    pub ref_logprob: Flags<RefLogprobArgs>,
    pub advantage: Flags<AdvantageArgs>,
    /// With `--temperature` as for ref-logprob, and `--total-steps` = `steps` for a cosine
    /// schedule without one.
    pub update: Flags<UpdateArgs>,
    /// `values` and the critic's `update --critic`, when the spec has a `[critic]`.
    pub values: Flags<ValuesArgs>,
    pub critic: Option<Flags<UpdateArgs>>,
    pub sync_weights: Flags<SyncWeightsArgs>,
    /// The evaluation rollout: `[rollout]` without its sampling keys, the greedy defaults, then
    /// `[eval]`.
    pub eval: Flags<RolloutArgs>,
}

impl Stages {
    /// Whether `advantage` adapts its KL coefficient (kept in a state file from step to step).
    pub(crate) fn adaptive_kl(&self) -> bool {
        let a = &self.advantage.args;
        a.kl_in_reward && a.kl_ctrl == Ctrl::Adaptive
    }
}

/// The rollout flags the evaluation does not take from `[rollout]`: it decodes greedily unless
/// `[eval]` says otherwise, adds no ReMax baseline (its rows are what is evaluated), and ends
/// responses where the model does, not at recorded lengths (a benchmark's stand-in).
const EVAL_SAMPLING: [&str; 6] = [
    "n",
    "temperature",
    "top-p",
    "top-k",
    "baseline",
    "response-lengths",
];

/// Where a spec comes from, for messages: `FILE:LINE:COL` of a key when the text is at hand.
#[derive(Clone, Copy)]
pub(crate) struct Source<'a> {
    pub(crate) origin: &'a str,
    pub(crate) text: Option<&'a str>,
}

impl Source<'_> {
    /// `origin:LINE:COL` of `key` in `[table]`, or `origin` when it is not found.
    fn at(&self, table: &str, key: &str) -> String {
        match self.text.and_then(|t| key_position(t, table, key)) {
            Some((line, col)) => format!("{}:{line}:{col}", self.origin),
            None => self.origin.to_string(),
        }
    }
}

/// The line and column of `key = ...` under the header `[table]` (spec files write one key per
/// line, as every file in pipelines/ does).
fn key_position(text: &str, table: &str, key: &str) -> Option<(usize, usize)> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.split('#').next().unwrap_or_default();
        let t = code.trim();
        if let Some(name) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            current = name.trim().to_string();
            continue;
        }
        let Some((k, _)) = t.split_once('=') else {
            continue;
        };
        if current == table && k.trim().trim_matches('"') == key {
            return Some((i + 1, line.len() - line.trim_start().len() + 1));
        }
    }
    None
}

/// The key whose value starts at byte `offset`, as "[table] key" (bare at the top level): the
/// text before the first `=` of that line, under the last `[table]` header above it. None when
/// the offset is not on a `key = value` line (a missing key points at its table).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let before = text.get(..offset)?;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let (key, _) = before[start..].split_once('=')?;
    let key = key.trim().trim_matches('"');
    if key.is_empty() || key.starts_with('[') {
        return None;
    }
    let table = before[..start].lines().rev().find_map(|l| {
        let t = l.split('#').next().unwrap_or_default().trim();
        t.strip_prefix('[').and_then(|r| r.strip_suffix(']'))
    });
    Some(match table {
        Some(t) => format!("[{}] {key}", t.trim()),
        None => key.to_string(),
    })
}

/// The command-line arguments for `--long` with a spec value, as the flag takes it, and the
/// scalar values its parser reads. A value starting with `-` goes as `--long=VALUE` where the
/// flag does not take negative numbers, so that it is not read as a flag.
fn value_args(
    arg: &Arg,
    long: &str,
    v: &toml::Value,
) -> Result<(Vec<String>, Vec<String>), String> {
    let flag = format!("--{long}");
    if !arg.get_action().takes_values() {
        return match v {
            toml::Value::Boolean(true) => Ok((vec![flag], Vec::new())),
            toml::Value::Boolean(false) => Ok((Vec::new(), Vec::new())),
            _ => Err("the flag is a switch: write true or false".into()),
        };
    }
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        toml::Value::Float(f) => Ok(f.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err("takes a string, a number or true/false".to_string()),
    };
    // What clap takes as a value after the flag: any text with allow_hyphen_values, a negative
    // number with allow_negative_numbers; else `--flag=-x`.
    let hyphen_ok = |x: &str| {
        arg.is_allow_hyphen_values_set()
            || (arg.is_allow_negative_numbers_set()
                && x[1..].starts_with(|c: char| c.is_ascii_digit())
                && x.parse::<f64>().is_ok())
    };
    let pair = |x: &str| match x.starts_with('-') && !hyphen_ok(x) {
        true => vec![format!("{flag}={x}")],
        false => vec![flag.clone(), x.to_string()],
    };
    let toml::Value::Array(items) = v else {
        let x = scalar(v)?;
        return Ok((pair(&x), vec![x]));
    };
    let values = items.iter().map(scalar).collect::<Result<Vec<_>, _>>()?;
    let args = match (arg.get_value_delimiter(), arg.get_action()) {
        (None, ArgAction::Append) => values.iter().flat_map(|x| pair(x)).collect(),
        (None, _) => return Err("takes one value, not a list".into()),
        _ if values.is_empty() => Vec::new(),
        (Some(d), _) => pair(&values.join(&d.to_string())),
    };
    Ok((args, values))
}

/// What the parsed flags hold for a flag the runner sets per step (a path, a seed).
const RUNNER_SETS: &str = "(set by the runner)";

/// One flag set from the spec.
struct Entry {
    long: String,
    args: Vec<String>,
    /// `[table] key = value` that set it, for messages (None: derived by the runner).
    from: Option<String>,
    /// Where that key is (`FILE:LINE:COL`).
    at: String,
}

/// One stage's flags being assembled from spec tables.
struct FlagSet {
    def: &'static StageDef,
    cmd: Command,
    /// By the position of the flag in the stage's declaration (the order of the command line).
    set: BTreeMap<usize, Entry>,
}

impl FlagSet {
    fn new(name: &str) -> FlagSet {
        let def = stage::def(name).unwrap_or_else(|| panic!("{name} is not in stage::STAGES"));
        FlagSet {
            def,
            cmd: (def.command)(),
            set: BTreeMap::new(),
        }
    }

    /// The flag a key names (its long name or an alias) and its position.
    fn find(&self, key: &str) -> Option<(usize, &Arg)> {
        self.cmd.get_arguments().enumerate().find(|(_, a)| {
            a.get_long() == Some(key) || a.get_all_aliases().is_some_and(|al| al.contains(&key))
        })
    }

    fn runner_owned(&self, long: &str, allow: &[&str]) -> bool {
        self.def.runner_owned.contains(&long) && !allow.contains(&long)
    }

    /// Adds every key of the table `[name]`. `allow` are runner-owned flags this table may set
    /// (`limit` in `[eval]`), `others` the table's keys that are not flags (for suggestions).
    fn add_table(
        &mut self,
        table: &toml::Table,
        name: &str,
        allow: &[&str],
        others: &[&str],
        src: &Source,
    ) -> Result<()> {
        let mut mine: BTreeMap<usize, &str> = BTreeMap::new();
        for (key, value) in table {
            let at = src.at(name, key);
            let Some((index, arg)) = self.find(key) else {
                let mut valid: Vec<String> = others.iter().map(|s| s.to_string()).collect();
                valid.extend(self.cmd.get_arguments().filter_map(|a| {
                    let long = a.get_long()?;
                    (!self.runner_owned(long, allow)).then(|| long.to_string())
                }));
                let hint = match closest(key, &valid) {
                    Some(best) => format!("did you mean `{best}`?"),
                    None => format!("valid keys here: {}", valid.join(", ")),
                };
                bail_input!("{at}: unknown key `{key}`: {hint}");
            };
            let long = arg.get_long().expect("found by its long name").to_string();
            if self.runner_owned(&long, allow) {
                bail_input!(
                    "{at}: unknown key `{key}`: [{name}] cannot set --{long}: the pipeline runner sets it for `{}`",
                    self.def.name
                );
            }
            if let Some(other) = mine.insert(index, key) {
                bail_input!("{at}: [{name}] sets --{long} twice (`{other}` and `{key}`)");
            }
            let from = format!("[{name}] {key} = {value}");
            let (args, _) = value_args(arg, &long, value)
                .map_err(|e| input_error(format!("{at}: {from}: {e}")))?;
            self.set.insert(
                index,
                Entry {
                    long,
                    args,
                    from: Some(from),
                    at,
                },
            );
        }
        Ok(())
    }

    /// Sets `--long` to `value` (a value the runner derives; it replaces the tables'); a
    /// switch to "true".
    fn set(&mut self, long: &str, value: &str) {
        let (index, arg) = self.find(long).expect("a flag of the stage");
        let value = match arg.get_action().takes_values() {
            true => toml::Value::String(value.into()),
            false => toml::Value::Boolean(value == "true"),
        };
        let (args, _) = value_args(arg, long, &value).expect("a value the flag takes");
        let entry = Entry {
            long: long.to_string(),
            args,
            from: None,
            at: String::new(),
        };
        self.set.insert(index, entry);
    }

    fn has(&self, long: &str) -> bool {
        self.set.values().any(|e| e.long == long)
    }

    fn remove(&mut self, long: &str) {
        self.set.retain(|_, e| e.long != long);
    }

    fn argv(&self) -> Vec<String> {
        self.set.values().flat_map(|e| e.args.clone()).collect()
    }

    /// A parse error as a message naming the spec key of the flag it is about, when one set it.
    fn describe(&self, e: &clap::Error, name: &str, src: &Source) -> anyhow::Error {
        let flag = match e.get(ContextKind::InvalidArg) {
            Some(ContextValue::String(s)) => s
                .strip_prefix("--")
                .map(|s| s.split([' ', '=']).next().unwrap_or_default().to_string()),
            _ => None,
        };
        let entry = flag.and_then(|f| self.set.values().find(|e| e.long == f));
        match entry {
            Some(Entry {
                from: Some(from),
                at,
                ..
            }) => input_error(format!("{at}: {from}: {}", clap_message(e))),
            _ => input_error(format!("{}: [{name}]: {}", src.origin, clap_message(e))),
        }
    }

    /// Parses the arguments with the stage's own parser (the runner's required flags get
    /// placeholders); `name` is the table named in messages.
    fn parse<A: FromArgMatches>(&self, name: &str, src: &Source) -> Result<Flags<A>> {
        let mut line = vec![self.def.name.to_string()];
        for arg in self.cmd.get_arguments().filter(|a| a.is_required_set()) {
            let long = arg.get_long().unwrap_or_default();
            if self.def.runner_owned.contains(&long) {
                let value = match arg.get_possible_values().first() {
                    Some(v) => v.get_name().to_string(),
                    None => RUNNER_SETS.to_string(),
                };
                line.extend([format!("--{long}"), value]);
            } else if !self.has(long) {
                bail_input!(
                    "{}: [{name}] needs `{long}` (--{long} of `{}` has no default)",
                    src.origin,
                    self.def.name
                );
            }
        }
        let argv = self.argv();
        line.extend(argv.iter().cloned());
        let m = self
            .cmd
            .clone()
            .try_get_matches_from(line)
            .map_err(|e| self.describe(&e, name, src))?;
        let args = A::from_arg_matches(&m).map_err(|e| self.describe(&e, name, src))?;
        Ok(Flags { argv, args })
    }
}

impl Spec {
    /// Read and check a spec file.
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| input_error(format!("{}: cannot read spec: {e}", path.display())))?;
        Spec::parse(&text, &path.display().to_string())
    }

    /// Parse spec text; `origin` names it in messages. Every stage table goes through its
    /// stage's parser here.
    pub fn parse(text: &str, origin: &str) -> Result<Spec> {
        let spec: Spec = match toml::from_str(text) {
            Ok(s) => s,
            Err(e) => return Err(input_error(describe_toml_error(text, origin, &e))),
        };
        spec.validate(origin)?;
        let src = Source {
            origin,
            text: Some(text),
        };
        let stages = spec.stages(&src)?;
        spec.check_dapo(&stages, &src)?;
        spec.agent(&stages, &src)?;
        spec.check_placement(&stages, &src)?;
        Ok(spec)
    }

    /// `[rollout] agent`, checked against the rest of the spec (`super::agent_spec`).
    pub(crate) fn agent(&self, stages: &Stages, src: &Source) -> Result<Option<AgentCmd>> {
        let around = super::agent_spec::Around {
            daemon: self.daemon,
            gpus: self.gpus,
            filter_groups: self.filter_groups().is_some(),
        };
        let agent = super::agent_spec::parse(&self.rollout, &around, &|k| src.at("rollout", k))?;
        super::agent_spec::check_reward(
            &stages.score.args.reward,
            agent.is_some(),
            self.eval.every,
            &src.at("score", "reward"),
        )?;
        Ok(agent)
    }

    /// Dynamic sampling as configured in `[algorithm]`, or None when `filter-groups` is off.
    pub(crate) fn filter_groups(&self) -> Option<FilterGroups> {
        let a = &self.algorithm;
        a.filter_groups.then(|| FilterGroups {
            metric: a
                .filter_metric
                .as_deref()
                .map(|m| FilterMetric::parse(m).expect("checked when the spec was loaded"))
                .unwrap_or(FilterMetric::Score),
            max_rounds: a.max_num_gen_batches.unwrap_or(DEFAULT_MAX_NUM_GEN_BATCHES),
            prompts_per_round: a.prompts_per_round.unwrap_or(self.data.prompts_per_step),
            on_cap: a.on_cap.unwrap_or(OnCap::Train),
        })
    }

    /// `[placement]` against the rest of the spec (`super::placement::check`).
    fn check_placement(&self, stages: &Stages, src: &Source) -> Result<()> {
        let Some(p) = &self.placement else {
            return Ok(());
        };
        let asynchronous = p.mode == super::placement::Mode::Async;
        let refused = [
            (
                self.rollout.contains_key("agent"),
                "[rollout] agent (its rollout is the user's program against tandem serve)",
            ),
            (
                stages.rollout.args.lora_mode == crate::model::lora::LoraMode::Unmerged,
                "[rollout] lora-mode = \"unmerged\" (the transfer carries the merged weights the rollout group generates with)",
            ),
        ];
        if asynchronous && self.algorithm.prompts_per_round.is_some() {
            bail_input!(
                "{}: [algorithm] prompts-per-round has no meaning with [placement] mode = \"async\": the rollout side starts groups as room frees, not in draws of a set size (max-num-gen-batches caps a step at that many times prompts-per-step scored groups)",
                src.at("algorithm", "prompts-per-round")
            );
        }
        let at = |key: &str| src.at("placement", key);
        super::placement::check(p, self.gpus, self.daemon, &refused, &at)
    }

    /// `[algorithm]` and the overlong shaping against the stages' flags.
    fn check_dapo(&self, stages: &Stages, src: &Source) -> Result<()> {
        let a = &self.algorithm;
        let set = [
            ("filter-metric", a.filter_metric.is_some()),
            ("max-num-gen-batches", a.max_num_gen_batches.is_some()),
            ("prompts-per-round", a.prompts_per_round.is_some()),
            ("on-cap", a.on_cap.is_some()),
        ];
        if !a.filter_groups {
            if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                bail_input!(
                    "{}: [algorithm] {key} has no effect without filter-groups = true",
                    src.at("algorithm", key)
                );
            }
        } else {
            if let Some(m) = &a.filter_metric {
                if let Err(e) = FilterMetric::parse(m) {
                    bail_input!(
                        "{}: [algorithm] filter-metric = \"{m}\": {e}",
                        src.at("algorithm", "filter-metric")
                    );
                }
            }
            if a.prompts_per_round == Some(0) {
                bail_input!(
                    "{}: [algorithm] prompts-per-round must be at least 1",
                    src.at("algorithm", "prompts-per-round")
                );
            }
            let n = stages.rollout.args.n;
            if n < 2 {
                bail_input!(
                    "{}: [algorithm] filter-groups = true needs [rollout] n >= 2 (a group of one sample is never dropped), got n = {n}",
                    src.at("algorithm", "filter-groups")
                );
            }
        }
        // The overlong buffer must fit in the length limit of every rollout it scores.
        let score = &stages.score.args;
        if score.overlong_buffer_len > 0 && score.max_response_length.is_none() {
            for (what, r) in [
                ("the training rollout", &stages.rollout),
                ("the evaluation", &stages.eval),
            ] {
                let max = r.args.max_new_tokens;
                if score.overlong_buffer_len > max {
                    bail_input!(
                        "{}: [score] overlong-buffer-len = {} is longer than max-new-tokens = {max} of {what} (the penalty's length limit)",
                        src.at("score", "overlong-buffer-len"),
                        score.overlong_buffer_len
                    );
                }
            }
        }
        Ok(())
    }

    fn validate(&self, origin: &str) -> Result<()> {
        if self.steps == 0 {
            bail_input!("{origin}: steps must be at least 1");
        }
        if self.data.prompts_per_step == 0 {
            bail_input!("{origin}: [data] prompts-per-step must be at least 1");
        }
        if self.gpus == 0 {
            bail_input!("{origin}: gpus must be at least 1");
        }
        if self.nodes != 1 {
            bail_input!(
                "{origin}: nodes = {}: a pipeline runs on one machine for now (nodes = 1); several machines need a launcher across them (srun or torchrun running the stages)",
                self.nodes
            );
        }
        if self.eval.every > 0 && self.data.val.is_none() {
            bail_input!(
                "{origin}: [eval] every = {} needs [data] val = \"FILE.parquet\"",
                self.eval.every
            );
        }
        Ok(())
    }

    /// The stage tables checked against the stages' commands and parsed by their parsers, with
    /// the values the runner derives from the spec (see [`Stages`]).
    pub fn stages(&self, src: &Source) -> Result<Stages> {
        let table = |name: &str, t: &toml::Table| -> Result<FlagSet> {
            let mut f = FlagSet::new(name);
            f.add_table(t, name, &[], &[], src)?;
            Ok(f)
        };
        // `agent` and `agent-timeout` are the runner's (`super::agent_spec`), not rollout's flags.
        let rollout_table = super::agent_spec::stage_keys(&self.rollout);
        let rollout = table("rollout", &rollout_table)?.parse::<RolloutArgs>("rollout", src)?;
        // ref-logprob and update take log-probs at the temperature the samples were drawn at
        // (rollout records it in the batch; a different explicit one is refused there, and
        // here before anything runs).
        let sampled = rollout.args.logprob_temperature();
        let same_temperature = |name: &str, given: f32| -> Result<()> {
            if given != sampled {
                bail_input!(
                    "{}: [{name}] temperature = {given} differs from the rollout's sampling temperature {sampled} ([rollout] temperature; 1 for greedy): log-probs at another temperature give wrong ratios; remove [{name}] temperature",
                    src.at(name, "temperature")
                );
            }
            Ok(())
        };
        let with_sampled = |mut f: FlagSet| {
            if !f.has("temperature") && self.rollout.contains_key("temperature") {
                f.set("temperature", &sampled.to_string());
            }
            f
        };
        let ref_logprob = with_sampled(table("ref-logprob", &self.ref_logprob)?)
            .parse::<RefLogprobArgs>("ref-logprob", src)?;
        if let Some(t) = ref_logprob.args.temperature {
            same_temperature("ref-logprob", t)?;
        }

        let update_flags =
            self.update_flags(with_sampled(table("update", &self.update)?), "update", src)?;
        if let Some(t) = update_flags.args.temperature {
            same_temperature("update", t)?;
        }
        let critic = match &self.critic {
            None => None,
            Some(c) => {
                let mut f = FlagSet::new("update");
                f.add_table(&c.update, "critic", &[], &["model", "critic-warmup"], src)?;
                f.set("critic", "true");
                Some(self.update_flags(f, "critic", src)?)
            }
        };

        let mut eval = table("rollout", &rollout_table)?;
        for key in EVAL_SAMPLING {
            eval.remove(key);
        }
        eval.add_table(
            &self.eval.rollout,
            "eval",
            &["limit"],
            &["every", "at-start"],
            src,
        )?;
        if !eval.has("n") {
            eval.set("n", "1");
        }
        // Greedy unless the user asked for sampling: top-k 1 is greedy at any temperature.
        if !eval.has("top-k") {
            eval.set("top-k", if eval.has("temperature") { "-1" } else { "1" });
        }
        Ok(Stages {
            rollout,
            score: table("score", &self.score)?.parse("score", src)?,
            ref_logprob,
            advantage: table("advantage", &self.advantage)?.parse("advantage", src)?,
            update: update_flags,
            values: table("values", &self.values)?.parse("values", src)?,
            critic,
            sync_weights: table("sync-weights", &self.sync_weights)?.parse("sync-weights", src)?,
            eval: eval.parse("eval", src)?,
        })
    }

    /// `update`'s flags of table `name` parsed, a cosine schedule spanning the run unless told
    /// otherwise.
    fn update_flags(&self, mut f: FlagSet, name: &str, src: &Source) -> Result<Flags<UpdateArgs>> {
        let flags = f.parse::<UpdateArgs>(name, src)?;
        let a = &flags.args;
        if a.lr_schedule == crate::engine::train::LrSchedule::Cosine && a.total_steps.is_none() {
            f.set("total-steps", &self.steps.to_string());
            return f.parse(name, src);
        }
        Ok(flags)
    }

    /// The critic's initial model: `[critic] model`, else the initial policy's.
    pub(crate) fn critic_model(&self) -> Option<&Path> {
        let c = self.critic.as_ref()?;
        Some(c.model.as_deref().unwrap_or(&self.model.path))
    }

    /// The reference model: `[model] ref`, else the initial policy.
    pub(crate) fn reference_model(&self) -> &Path {
        self.model.reference.as_deref().unwrap_or(&self.model.path)
    }

    /// The spec as TOML, every runner default written out.
    pub(crate) fn to_toml(&self) -> String {
        toml::to_string(self).expect("a spec always serializes")
    }
}

/// A TOML/serde error as "FILE:LINE:COL: [table] key = value: message" (the key where the
/// error points at one), with a suggestion for unknown keys.
fn describe_toml_error(text: &str, origin: &str, e: &toml::de::Error) -> String {
    let mut location = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
            format!("{origin}:{line}:{col}")
        }
        None => origin.to_string(),
    };
    if let Some(span) = e.span() {
        if let Some(key) = key_at(text, span.start) {
            let value = text.get(span).unwrap_or_default().trim();
            location = format!("{location}: {key} = {value}");
        }
    }
    let msg = e.message().trim();
    match unknown_field(msg) {
        Some((key, expected)) => {
            let hint = match closest(&key, &expected) {
                Some(best) => format!("did you mean `{best}`?"),
                None => format!("valid keys here: {}", expected.join(", ")),
            };
            format!("{location}: unknown key `{key}`: {hint}")
        }
        None => format!("{location}: {msg}"),
    }
}

/// Parse serde's "unknown field `x`, expected one of `a`, `b`" (or "expected `a`", "expected
/// `a` or `b`", "there are no fields") into the key and the valid keys.
fn unknown_field(msg: &str) -> Option<(String, Vec<String>)> {
    let rest = msg.strip_prefix("unknown field `")?;
    let end = rest.find('`')?;
    let key = rest[..end].to_string();
    let expected: Vec<String> = rest[end + 1..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some((key, expected))
}

/// Levenshtein distance over chars, with `_` and `-` taken as equal (TOML users write both).
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let norm = |c: char| {
        if c == '_' {
            '-'
        } else {
            c.to_ascii_lowercase()
        }
    };
    let a: Vec<char> = a.chars().map(norm).collect();
    let b: Vec<char> = b.chars().map(norm).collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The valid key closest to `key`, if it is close enough to be a likely typo (at most a third
/// of the longer name's letters differ).
pub(crate) fn closest<'a>(key: &str, valid: &'a [String]) -> Option<&'a str> {
    valid
        .iter()
        .map(|v| (edit_distance(key, v), v))
        .filter(|(d, v)| *d * 3 <= key.chars().count().max(v.chars().count()))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v.as_str())
}

/// One key whose value differs between two specs (`None`: not set).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct SpecChange {
    /// `table.key`, e.g. `update.lr` (top-level keys bare: `seed`).
    pub(crate) key: String,
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
}

impl Spec {
    /// What differs from `old`, key by key (TOML text of the values), ignoring `steps` (a run
    /// may be extended).
    pub(crate) fn changes_from(&self, old: &Spec) -> Vec<SpecChange> {
        let as_table = |s: &Spec| {
            let mut s = s.clone();
            s.steps = 0;
            toml::Value::try_from(&s).expect("a spec serializes")
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        leaves(&as_table(old), "", &mut a);
        leaves(&as_table(self), "", &mut b);
        let old: BTreeMap<String, String> = a.into_iter().collect();
        let new: BTreeMap<String, String> = b.into_iter().collect();
        let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .filter(|k| old.get(*k) != new.get(*k))
            .map(|k| SpecChange {
                key: k.clone(),
                from: old.get(k).cloned(),
                to: new.get(k).cloned(),
            })
            .collect()
    }
}

/// `update.lr: 0.001 -> 0.01; eval.limit: (unset) -> 8`.
pub(crate) fn describe_changes(changes: &[SpecChange]) -> String {
    let v = |x: &Option<String>| x.clone().unwrap_or_else(|| "(unset)".into());
    changes
        .iter()
        .map(|c| format!("{}: {} -> {}", c.key, v(&c.from), v(&c.to)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every `a.b.c = value` leaf of a TOML table, for comparing two specs key by key.
pub fn leaves(value: &toml::Value, prefix: &str, out: &mut Vec<(String, String)>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &key, out);
            }
        }
        v => out.push((prefix.to_string(), v.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_spec_parses() {
        // The specs a user copies from pipelines/ pass every check that needs no files.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                Spec::load(&path).unwrap_or_else(|e| panic!("{e:#}"));
                n += 1;
            }
        }
        assert!(n >= 8, "{n} specs in {}", dir.display());
    }
    use clap::ArgMatches;

    const MINIMAL: &str = r#"
steps = 3
[model]
path = "models/tiny"
[data]
train = "data/train.parquet"
prompts-per-step = 4
[score]
reward = "exact"
[advantage]
estimator = "grpo"
"#;

    fn src(text: &str) -> Source<'_> {
        Source {
            origin: "t.toml",
            text: Some(text),
        }
    }

    fn stages(text: &str) -> Stages {
        let s = Spec::parse(text, "t.toml").unwrap_or_else(|e| panic!("{e:#}"));
        s.stages(&src(text)).unwrap()
    }

    fn error(text: &str) -> String {
        let err = Spec::parse(text, "t.toml").unwrap_err();
        assert!(crate::error::is_input_error(&err), "{err:#}");
        format!("{err:#}")
    }

    #[test]
    fn minimal_spec_gets_runner_defaults() {
        let s = Spec::parse(MINIMAL, "t.toml").unwrap();
        assert_eq!(s.steps, 3);
        assert_eq!(s.seed, 0);
        assert_eq!(s.device, Device::Cpu);
        assert!(s.data.shuffle);
        assert_eq!(s.eval, EvalSpec::default());
        assert_eq!(s.checkpoint.keep_last, 1);
        assert_eq!(s.reference_model(), Path::new("models/tiny"));
        assert!(!s.batch_invariant);
        let s = Spec::parse(&format!("batch-invariant = true\n{MINIMAL}"), "t.toml").unwrap();
        assert!(s.batch_invariant);
        // Stage flags left out are the stages' own defaults, read from their parsers.
        let st = stages(MINIMAL);
        assert_eq!(st.rollout.args.n, 8);
        assert_eq!(st.update.args.ppo_epochs, 1);
        assert!(!st.adaptive_kl());
        assert_eq!(st.rollout.argv, Vec::<String>::new());
        assert_eq!(st.advantage.argv, ["--estimator", "grpo"]);
        assert_eq!(st.eval.argv, ["--n", "1", "--top-k", "1"]);
    }

    #[test]
    fn stage_keys_become_flags_in_declaration_order() {
        let text = MINIMAL.replace(
            "estimator = \"grpo\"",
            "kl-coef = 0.01\nkl-in-reward = true\nnorm-by-std = false\nestimator = \"grpo\"\nkl-ctrl = \"adaptive\"",
        ) + "[update]\nuse-kl-loss = false\nlr = 1e-5\nbetas = \"0.9,0.99\"\n";
        let st = stages(&text);
        assert_eq!(
            st.advantage.argv.join(" "),
            "--estimator grpo --norm-by-std false --kl-in-reward --kl-coef 0.01 --kl-ctrl adaptive"
        );
        // A switch set to false is left out; floats print in Rust's shortest round-trip form.
        assert_eq!(st.update.argv, ["--lr", "0.00001", "--betas", "0.9,0.99"]);
        assert!(st.adaptive_kl());
        assert!(!st.advantage.args.norm_by_std);
        assert_eq!(st.update.args.betas, [0.9, 0.99]);
        // A list for a comma-separated flag is joined.
        let st = stages(&format!("{MINIMAL}[update]\nbetas = [0.8, 0.9]\n"));
        assert_eq!(st.update.argv, ["--betas", "0.8,0.9"]);
    }

    #[test]
    fn unknown_key_suggests_the_closest() {
        let text = MINIMAL.replace("prompts-per-step", "prompt-per-step");
        let msg = error(&text);
        assert!(
            msg.starts_with("t.toml:7:1: unknown key `prompt-per-step`"),
            "{msg}"
        );
        assert!(msg.contains("did you mean `prompts-per-step`?"), "{msg}");

        // Underscores for dashes, in a stage table: the line and the closest flag.
        let msg = error(&format!("{MINIMAL}[rollout]\nn = 2\nmax_new_tokens = 8\n"));
        assert!(
            msg.starts_with(
                "t.toml:14:1: unknown key `max_new_tokens`: did you mean `max-new-tokens`?"
            ),
            "{msg}"
        );

        // Nothing close: list what is valid.
        let msg = error(&format!("{MINIMAL}[checkpoint]\nbananas = 1\n"));
        assert!(
            msg.contains("unknown key `bananas`: valid keys here: every, keep-last"),
            "{msg}"
        );

        // A runner-owned flag is not a spec key.
        for (table, key) in [
            ("rollout", "out"),
            ("rollout", "limit"),
            ("update", "out-model"),
            ("ref-logprob", "column"),
            ("advantage", "kl-state"),
            ("score", "metrics"),
            ("sync-weights", "policy-version"),
        ] {
            let header = format!("[{table}]\n");
            let line = format!("{key} = \"x\"\n");
            let text = match MINIMAL.contains(&header) {
                true => MINIMAL.replace(&header, &format!("{header}{line}")),
                false => format!("{MINIMAL}{header}{line}"),
            };
            let msg = error(&text);
            assert!(msg.contains(&format!("unknown key `{key}`")), "{msg}");
            assert!(msg.contains("the pipeline runner sets it"), "{msg}");
        }

        // [eval]: its own keys and the rollout's, `limit` included.
        let msg = error(&format!("{MINIMAL}[eval]\nevry = 2\n"));
        assert!(
            msg.contains("t.toml:13:1: unknown key `evry`: did you mean `every`?"),
            "{msg}"
        );

        // Top level.
        let msg = error(&format!("sed = 1\n{MINIMAL}"));
        assert!(
            msg.contains("t.toml:1:1: unknown key `sed`: did you mean `seed`?"),
            "{msg}"
        );
    }

    #[test]
    fn algorithm_table_is_checked_before_anything_runs() {
        // MINIMAL ends on line 11: [algorithm] is line 12, its first key line 13.
        let with = |keys: &str| format!("{MINIMAL}[algorithm]\n{keys}\n");
        let s = Spec::parse(&with("filter-groups = true"), "t.toml").unwrap();
        assert_eq!(
            s.filter_groups(),
            Some(FilterGroups {
                metric: FilterMetric::Score,
                max_rounds: DEFAULT_MAX_NUM_GEN_BATCHES,
                prompts_per_round: 4,
                on_cap: OnCap::Train,
            })
        );
        let s = Spec::parse(
            &with("filter-groups = true\nfilter-metric = \"score_acc\"\nmax-num-gen-batches = 0\nprompts-per-round = 12\non-cap = \"fail\""),
            "t.toml",
        )
        .unwrap();
        let fg = s.filter_groups().unwrap();
        assert_eq!(fg.metric, FilterMetric::Column("score_acc".into()));
        assert_eq!((fg.max_rounds, fg.prompts_per_round), (0, 12));
        assert_eq!(fg.on_cap, OnCap::Fail);
        // The table round-trips through the resolved spec; a spec without it resolves as before.
        assert_eq!(Spec::parse(&s.to_toml(), "resolved").unwrap(), s);
        let plain = Spec::parse(MINIMAL, "t.toml").unwrap();
        assert!(!plain.to_toml().contains("algorithm"));
        assert_eq!(plain.filter_groups(), None);
        let off = Spec::parse(&with("filter-groups = false"), "t.toml").unwrap();
        assert_eq!(off, plain);

        for (text, want) in [
            (
                with("filter-group = true"),
                "t.toml:13:1: unknown key `filter-group`: did you mean `filter-groups`?",
            ),
            (
                with("max-num-gen-batches = 3"),
                "t.toml:13:1: [algorithm] max-num-gen-batches has no effect without filter-groups = true",
            ),
            (
                with("filter-groups = true\nfilter-metric = \"reward\""),
                "t.toml:14:1: [algorithm] filter-metric = \"reward\": unknown metric \"reward\": expected \"score\", \"acc\" or a sub-score column \"score_<key>\"",
            ),
            (
                with("filter-groups = true\nfilter-metric = \"score_\""),
                "unknown metric \"score_\"",
            ),
            (
                with("filter-groups = true\nprompts-per-round = 0"),
                "t.toml:14:1: [algorithm] prompts-per-round must be at least 1",
            ),
            (
                with("filter-groups = true\non-cap = \"maybe\""),
                "t.toml:14:10: [algorithm] on-cap = \"maybe\": unknown variant `maybe`, expected `train` or `fail`",
            ),
            (
                with("filter-groups = true\nmax-num-gen-batches = -1"),
                "t.toml:14:23: [algorithm] max-num-gen-batches = -1: invalid value",
            ),
            (
                format!("{}[rollout]\nn = 1\n", with("filter-groups = true")),
                "t.toml:13:1: [algorithm] filter-groups = true needs [rollout] n >= 2 (a group of one sample is never dropped), got n = 1",
            ),
        ] {
            let msg = error(&text);
            assert!(msg.contains(want), "{want:?} not in {msg:?}");
        }
    }

    #[test]
    fn overlong_buffer_must_fit_every_rollout_it_scores() {
        let text = MINIMAL.replace(
            "reward = \"exact\"",
            "reward = \"exact\"\noverlong-buffer-len = 64",
        ) + "[rollout]\nmax-new-tokens = 128\n";
        let st = stages(&text);
        assert_eq!(st.score.args.overlong_buffer_len, 64);
        assert_eq!(
            st.score.argv,
            ["--reward", "exact", "--overlong-buffer-len", "64"]
        );
        let msg = error(&text.replace("max-new-tokens = 128", "max-new-tokens = 32"));
        assert!(
            msg.contains("t.toml:10:1: [score] overlong-buffer-len = 64 is longer than max-new-tokens = 32 of the training rollout"),
            "{msg}"
        );
        // The evaluation's own limit counts too.
        let msg = error(&format!("{text}[eval]\nmax-new-tokens = 16\n"));
        assert!(
            msg.contains("longer than max-new-tokens = 16 of the evaluation"),
            "{msg}"
        );
        // An explicit limit is the stage's to check (a shorter rollout is then fine).
        let text = text.replace(
            "overlong-buffer-len = 64",
            "overlong-buffer-len = 64\nmax-response-length = 100",
        );
        stages(&text.replace("max-new-tokens = 128", "max-new-tokens = 32"));
    }

    #[test]
    fn bad_values_are_input_errors_naming_the_key() {
        let cases = [
            (
                MINIMAL.replace("steps = 3", "steps = 0"),
                "steps must be at least 1",
            ),
            (
                MINIMAL.replace("steps = 3", "steps = \"3\""),
                "t.toml:2:9: steps = \"3\": invalid type: string \"3\", expected u64",
            ),
            (
                MINIMAL.replace("prompts-per-step = 4", "prompts-per-step = 4.5"),
                "t.toml:7:20: [data] prompts-per-step = 4.5: invalid type: floating point",
            ),
            (
                MINIMAL.replace("path = \"models/tiny\"", "path = 7"),
                "t.toml:4:8: [model] path = 7: invalid type: integer `7`",
            ),
            (
                MINIMAL.replace("reward = \"exact\"", ""),
                "t.toml: [score] needs `reward`",
            ),
            (
                MINIMAL.replace("estimator = \"grpo\"", ""),
                "t.toml: [advantage] needs `estimator`",
            ),
            (
                format!("device = \"tpu\"\n{MINIMAL}"),
                "t.toml:1:10: device = \"tpu\": unknown variant `tpu`",
            ),
            (format!("{MINIMAL}[eval]\nevery = 2\n"), "needs [data] val"),
            (
                MINIMAL.replace("[model]\npath = \"models/tiny\"", ""),
                "missing field `model`",
            ),
            (
                format!("{MINIMAL}[rollout]\ntemperature = \"x\"\n"),
                "t.toml:13:1: [rollout] temperature = \"x\": invalid value 'x' for '--temperature <TEMPERATURE>': invalid float literal",
            ),
            (
                format!("{MINIMAL}[update]\nloss = \"bogus\"\n"),
                "t.toml:13:1: [update] loss = \"bogus\": invalid value 'bogus' for '--loss <LOSS>'",
            ),
            (
                MINIMAL.replace("\"grpo\"", "\"ppo\""),
                "t.toml:11:1: [advantage] estimator = \"ppo\": invalid value 'ppo' for '--estimator <ESTIMATOR>' [possible values: ",
            ),
            (
                format!("{MINIMAL}[rollout]\nraw-prompt = \"yes\"\n"),
                "[rollout] raw-prompt = \"yes\": the flag is a switch: write true or false",
            ),
            (
                format!("{MINIMAL}[rollout]\ntop-k = [1, 2]\n"),
                "[rollout] top-k = [1, 2]: takes one value, not a list",
            ),
            (
                format!("{MINIMAL}[rollout]\nstop-token-ids = [1, \"a\"]\n"),
                "[rollout] stop-token-ids = [1, \"a\"]: invalid value 'a' for '--stop-token-ids",
            ),
            (
                format!("{MINIMAL}[rollout]\nstop = [{{ a = 1 }}]\n"),
                "takes a string, a number or true/false",
            ),
            (
                format!("{MINIMAL}[eval]\nn = -3\n"),
                "t.toml:13:1: [eval] n = -3: invalid value '-3' for '--n <N>'",
            ),
            (
                // clap's own rules between flags, after each value parsed.
                MINIMAL.replace("estimator = \"grpo\"", "estimator = \"grpo\"\nkl-coef = 0.1"),
                "t.toml: [advantage]: the following required arguments were not provided: --kl-in-reward",
            ),
            (
                format!("{MINIMAL}[rollout]\nbatch-size = 4\nmax-num-seqs = 8\n"),
                "[rollout] sets --max-num-seqs twice",
            ),
        ];
        for (text, want) in cases {
            let msg = error(&text);
            assert!(msg.contains(want), "{want:?} not in {msg:?}");
        }
    }

    #[test]
    fn log_probs_are_taken_at_the_sampling_temperature() {
        // The runner passes the rollout's temperature on, as rollout records it in the batch.
        let st = stages(&format!("{MINIMAL}[rollout]\ntemperature = 0.7\n"));
        assert_eq!(st.ref_logprob.argv, ["--temperature", "0.7"]);
        assert_eq!(st.update.argv, ["--temperature", "0.7"]);
        assert_eq!(st.update.args.temperature, Some(0.7));
        // Greedy rollouts record log-probs at temperature 1.
        let st = stages(&format!("{MINIMAL}[rollout]\ntemperature = 0\n"));
        assert_eq!(st.update.argv, ["--temperature", "1"]);
        // The same temperature written twice is fine; another one is refused at its line.
        stages(&format!(
            "{MINIMAL}[rollout]\ntemperature = 0.7\n[update]\ntemperature = 0.7\n"
        ));
        let msg = error(&format!(
            "{MINIMAL}[rollout]\ntemperature = 0.7\n[update]\nlr = 0.1\ntemperature = 0.5\n"
        ));
        assert!(
            msg.starts_with("t.toml:16:1: [update] temperature = 0.5 differs from the rollout's sampling temperature 0.7"),
            "{msg}"
        );
        // ... also against rollout's default temperature (1).
        let msg = error(&format!("{MINIMAL}[ref-logprob]\ntemperature = 2.0\n"));
        assert!(
            msg.contains(
                "[ref-logprob] temperature = 2 differs from the rollout's sampling temperature 1"
            ),
            "{msg}"
        );
    }

    #[test]
    fn cosine_schedule_spans_the_run_unless_told_otherwise() {
        let st = stages(&format!("{MINIMAL}[update]\nlr-schedule = \"cosine\"\n"));
        assert_eq!(
            st.update.argv,
            ["--lr-schedule", "cosine", "--total-steps", "3"]
        );
        assert_eq!(st.update.args.total_steps, Some(3));
        let st = stages(&format!(
            "{MINIMAL}[update]\nlr-schedule = \"cosine\"\ntotal-steps = 10\n"
        ));
        assert_eq!(st.update.args.total_steps, Some(10));
    }

    #[test]
    fn values_that_look_like_flags_stay_values() {
        // Every flag with a value takes negative numbers (they reach the flag's range check);
        // a text that looks like a flag goes as --stop=-x.
        let st = stages(&format!(
            "{MINIMAL}[rollout]\ntop-k = -1\nstop = [\"-x\", \"y\"]\n"
        ));
        assert_eq!(st.rollout.argv.join(" "), "--top-k -1 --stop=-x --stop y");
        assert_eq!(st.rollout.args.stop, ["-x", "y"]);
        let err = error(&format!("{MINIMAL}[rollout]\ntemperature = -1\n"));
        assert!(
            err.contains("[rollout] temperature = -1: invalid value '-1' for '--temperature <TEMPERATURE>': must be a finite number >= 0"),
            "{err}"
        );
    }

    #[test]
    fn aliases_are_keys_and_eval_overrides_rollout() {
        let text = format!(
            "{MINIMAL}[rollout]\nn = 4\nbatch-size = 16\nmax-new-tokens = 7\nraw-prompt = true\n[eval]\nevery = 2\nlimit = 5\nmax-prompt-tokens = 9\n"
        )
        .replace("prompts-per-step = 4", "prompts-per-step = 4\nval = \"v.parquet\"");
        let st = stages(&text);
        assert_eq!(st.rollout.args.max_num_seqs, 16);
        assert_eq!(
            st.rollout.argv.join(" "),
            "--n 4 --max-new-tokens 7 --raw-prompt --max-num-seqs 16"
        );
        assert_eq!(
            st.eval.argv.join(" "),
            "--n 1 --top-k 1 --max-new-tokens 7 --max-prompt-tokens 9 --limit 5 --raw-prompt --max-num-seqs 16"
        );
        // A temperature in [eval] samples from all tokens.
        let st = stages(&text.replace("limit = 5", "temperature = 0.5"));
        assert_eq!(
            st.eval.argv[..6],
            ["--n", "1", "--temperature", "0.5", "--top-k", "-1"]
        );
    }

    #[test]
    fn resolved_spec_round_trips() {
        let text = format!(
            "{MINIMAL}[rollout]\nn = 4\ntop-k = -1\nmax-new-tokens = 7\n[eval]\nevery = 2\nmax-prompt-tokens = 9\n"
        )
        .replace("prompts-per-step = 4", "prompts-per-step = 4\nval = \"v.parquet\"");
        let s = Spec::parse(&text, "t.toml").unwrap();
        let again = Spec::parse(&s.to_toml(), "resolved").unwrap();
        assert_eq!(s, again);
        let st = stages(&text);
        assert_eq!(
            st.rollout.argv,
            ["--n", "4", "--top-k", "-1", "--max-new-tokens", "7"]
        );
        assert_eq!(
            st.eval.argv.join(" "),
            "--n 1 --top-k 1 --max-new-tokens 7 --max-prompt-tokens 9"
        );
    }

    #[test]
    fn list_flags_repeat_or_join() {
        let text = format!(
            "{MINIMAL}[rollout]\nn = 2\nstop = [\"\\n\", \"###\"]\nstop-token-ids = [7, 9]\nignore-eos = true\n"
        );
        let st = stages(&text);
        let args = [
            "--n",
            "2",
            "--stop",
            "\n",
            "--stop",
            "###",
            "--stop-token-ids",
            "7,9",
            "--ignore-eos",
        ];
        assert_eq!(st.rollout.argv, args);
        assert_eq!(st.rollout.args.stop_token_ids, [7, 9]);
        // The eval rollout keeps [rollout]'s stops, decoding greedily.
        assert_eq!(st.eval.argv[..4], ["--n", "1", "--top-k", "1"]);
        assert_eq!(st.eval.argv[4..], args[2..]);
        // Recorded response lengths are the training rollout's only.
        let st = stages(&format!(
            "{MINIMAL}[rollout]\nresponse-lengths = \"l.txt\"\nignore-eos = true\n"
        ));
        assert_eq!(
            st.rollout.argv,
            ["--ignore-eos", "--response-lengths", "l.txt"]
        );
        assert_eq!(st.eval.argv, ["--n", "1", "--top-k", "1", "--ignore-eos"]);
        let s = Spec::parse(&text, "t.toml").unwrap();
        assert_eq!(Spec::parse(&s.to_toml(), "resolved").unwrap(), s);
    }

    /// The typed flags a stage's parser makes of `m` (a new stage gets a line here).
    fn typed(name: &str, m: &ArgMatches) -> String {
        fn of<A: FromArgMatches + std::fmt::Debug>(m: &ArgMatches) -> String {
            format!("{:?}", A::from_arg_matches(m).unwrap())
        }
        match name {
            "rollout" => of::<RolloutArgs>(m),
            "score" => of::<ScoreArgs>(m),
            "ref-logprob" => of::<RefLogprobArgs>(m),
            "advantage" => of::<AdvantageArgs>(m),
            "update" => of::<UpdateArgs>(m),
            "values" => of::<ValuesArgs>(m),
            "sync-weights" => of::<SyncWeightsArgs>(m),
            other => panic!("no typed flags for {other}"),
        }
    }

    /// The spec's typed flags of stage `name`.
    fn typed_from_spec(name: &str, st: &Stages) -> String {
        match name {
            "rollout" => format!("{:?}", st.rollout.args),
            "score" => format!("{:?}", st.score.args),
            "ref-logprob" => format!("{:?}", st.ref_logprob.args),
            "advantage" => format!("{:?}", st.advantage.args),
            "update" => format!("{:?}", st.update.args),
            "values" => format!("{:?}", st.values.args),
            "sync-weights" => format!("{:?}", st.sync_weights.args),
            other => panic!("no table for {other}"),
        }
    }

    /// Every flag of every stage that the runner does not set is a key of the stage's spec
    /// table, with no edit of the spec: a sample value reaches the stage as the same parsed
    /// flags as typing the flag on the stage's command line.
    #[test]
    fn every_stage_flag_is_a_spec_key() {
        let value =
            |v: &str| toml::from_str::<toml::Table>(&format!("v = {v}")).unwrap()["v"].clone();
        let text = |v: &toml::Value| match v {
            toml::Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let mut checked = 0;
        for def in stage::STAGES {
            let cmd = (def.command)();
            let flag = |long: &str| {
                cmd.get_arguments()
                    .find(|a| a.get_long() == Some(long))
                    .unwrap()
            };
            // The stage's command line for spec keys, written here apart from `value_args`.
            let cli = |keys: &[(&str, String)]| {
                let mut line = vec![def.name.to_string()];
                for a in cmd.get_arguments().filter(|a| a.is_required_set()) {
                    let long = a.get_long().unwrap();
                    if def.runner_owned.contains(&long) {
                        let v = a
                            .get_possible_values()
                            .first()
                            .map(|v| v.get_name().to_string());
                        line.extend([format!("--{long}"), v.unwrap_or(RUNNER_SETS.into())]);
                    }
                }
                for (k, v) in keys {
                    match value(v) {
                        toml::Value::Boolean(true) if !flag(k).get_action().takes_values() => {
                            line.push(format!("--{k}"))
                        }
                        toml::Value::Array(items) => {
                            let items: Vec<String> = items.iter().map(text).collect();
                            match flag(k).get_value_delimiter() {
                                Some(d) => {
                                    line.extend([format!("--{k}"), items.join(&d.to_string())])
                                }
                                None => line.extend(
                                    items.iter().flat_map(|x| [format!("--{k}"), x.clone()]),
                                ),
                            }
                        }
                        v => line.push(format!("--{k}={}", text(&v))),
                    }
                }
                cmd.clone().try_get_matches_from(line)
            };
            // The spec: MINIMAL's tables, with this stage's table holding `keys`.
            let spec = |keys: &[(&str, String)], extra: &str| {
                let mut text = MINIMAL
                    .replace("[score]\nreward = \"exact\"\n", "")
                    .replace("[advantage]\nestimator = \"grpo\"\n", "");
                for (t, kv) in [
                    ("score", "reward = \"exact\""),
                    ("advantage", "estimator = \"grpo\""),
                ] {
                    if def.name != t {
                        text += &format!("[{t}]\n{kv}\n");
                    }
                }
                text += &format!("[{}]\n", def.name);
                for (k, v) in keys {
                    text += &format!("{k} = {v}\n");
                }
                text + extra
            };
            let required: Vec<(&str, String)> = match def.name {
                "score" => vec![("reward", "\"exact\"".into())],
                "advantage" => vec![("estimator", "\"grpo\"".into())],
                _ => vec![],
            };
            // Some flags only count with a switch (advantage's --kl-coef needs --kl-in-reward).
            let mut switched = required.clone();
            switched.extend(
                cmd.get_arguments()
                    .filter(|a| !a.get_action().takes_values())
                    .filter_map(|a| a.get_long())
                    .filter(|l| !def.runner_owned.contains(l))
                    .map(|l| (l, "true".to_string())),
            );
            for arg in cmd.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if def.runner_owned.contains(&long) {
                    continue;
                }
                let many = matches!(arg.get_action(), ArgAction::Append);
                let mut candidates: Vec<String> = if !arg.get_action().takes_values() {
                    vec!["true".into()]
                } else if !arg.get_possible_values().is_empty() {
                    arg.get_possible_values()
                        .iter()
                        .filter(|p| !p.is_hide_set())
                        .map(|p| format!("\"{}\"", p.get_name()))
                        .collect()
                } else if many {
                    ["[3, 3]", "[0.25, 0.25]", "[\"x\", \"y\"]"]
                        .map(String::from)
                        .to_vec()
                } else {
                    ["3", "0.25", "100000", "\"x\""].map(String::from).to_vec()
                };
                // A flag parsed by `FromStr` with no default: its values are not listed to clap.
                if long == "rollout-is" {
                    candidates.insert(0, "\"sequence\"".into());
                }
                // Last: the default, for flags whose values clap does not list (`--loss`).
                let defaults: Vec<String> = arg
                    .get_default_values()
                    .iter()
                    .map(|d| d.to_string_lossy().into_owned())
                    .collect();
                if !defaults.is_empty() {
                    candidates.push(match many {
                        true => format!("{defaults:?}"),
                        false => format!("{:?}", defaults.join(",")),
                    });
                }
                let mut found = None;
                'search: for context in [&required, &switched] {
                    let context: Vec<(&str, String)> = context
                        .iter()
                        .filter(|(k, _)| *k != long)
                        .cloned()
                        .collect();
                    // None for a flag without a default (score's --reward).
                    let defaults = cli(&context).ok().map(|m| typed(def.name, &m));
                    for v in &candidates {
                        let mut keys = context.clone();
                        // A cosine schedule needs its horizon (the runner would derive one).
                        if long == "lr-schedule" {
                            keys.push(("total-steps", "3".into()));
                        }
                        keys.push((long, v.clone()));
                        // ref-logprob and update take log-probs at the rollout's temperature.
                        let extra = match (long, def.name) {
                            ("temperature", "ref-logprob" | "update") => {
                                format!("[rollout]\ntemperature = {v}\n")
                            }
                            _ => String::new(),
                        };
                        let text = spec(&keys, &extra);
                        let (Ok(s), Ok(m)) = (Spec::parse(&text, "t.toml"), cli(&keys)) else {
                            continue;
                        };
                        let st = s.stages(&src(&text)).unwrap();
                        let parsed = typed_from_spec(def.name, &st);
                        assert_eq!(
                            parsed,
                            typed(def.name, &m),
                            "[{}] {long} = {v} parses unlike --{long} on the command line",
                            def.name
                        );
                        let argv = match def.name {
                            "rollout" => &st.rollout.argv,
                            "score" => &st.score.argv,
                            "ref-logprob" => &st.ref_logprob.argv,
                            "advantage" => &st.advantage.argv,
                            "update" => &st.update.argv,
                            "values" => &st.values.argv,
                            _ => &st.sync_weights.argv,
                        };
                        let dash = format!("--{long}");
                        assert!(
                            argv.iter()
                                .any(|a| *a == dash || a.starts_with(&format!("{dash}="))),
                            "{argv:?}"
                        );
                        // Prefer a value that differs from the stage's default.
                        let differs = defaults.as_ref() != Some(&parsed);
                        if found.is_none() || differs {
                            found = Some(v.clone());
                        }
                        if differs {
                            break 'search;
                        }
                    }
                }
                assert!(
                    found.is_some(),
                    "[{}] {long}: no sample value is accepted as a spec key",
                    def.name
                );
                checked += 1;
            }
        }
        assert!(checked > 60, "only {checked} flags checked");
    }

    #[test]
    fn shipped_specs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let s = Spec::load(&p).unwrap_or_else(|e| panic!("{e:#}"));
                assert!(s.steps > 0 && s.eval.every > 0, "{}", p.display());
                n += 1;
            }
        }
        assert!(n >= 3, "pipelines/ holds {n} specs");
    }

    #[test]
    fn edit_distance_values() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("max_new_tokens", "max-new-tokens"), 0);
        assert_eq!(edit_distance("", "abc"), 3);
        let valid = vec![
            "lr".to_string(),
            "loss".to_string(),
            "lr-schedule".to_string(),
        ];
        assert_eq!(closest("los", &valid), Some("loss"));
        assert_eq!(closest("zzzzzzz", &valid), None);
    }

    #[test]
    fn key_positions() {
        let text = "a = 1\n[x]\n  b = 2 # c = 3\n\"c\" = 4\n[y] # t\nb = 5\n";
        assert_eq!(key_position(text, "x", "b"), Some((3, 3)));
        assert_eq!(key_position(text, "x", "c"), Some((4, 1)));
        assert_eq!(key_position(text, "y", "b"), Some((6, 1)));
        assert_eq!(key_position(text, "", "a"), Some((1, 1)));
        assert_eq!(key_position(text, "y", "c"), None);
    }
}
