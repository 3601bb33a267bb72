//! The batch contract: every column a stage may read or write, with its Arrow type, in one place.
//! See docs/BATCH.md for the table a user reads.

use arrow_schema::{DataType, Field};
use std::sync::Arc;

/// Version of the column contract, written to every file as `tandem.schema`.
pub const SCHEMA_VERSION: &str = "1";

/// Metadata keys every stage writes.
pub mod meta {
    pub(crate) const SCHEMA: &str = "tandem.schema";
    pub const POLICY_VERSION: &str = "policy_version";
    pub(crate) const STEP: &str = "step";
    /// The temperature of the samples' log-probs, written by `rollout` (its `--temperature`, 1
    /// when greedy): `ref-logprob` and `update` take log-probs at it and refuse another one.
    pub const LOGPROB_TEMPERATURE: &str = "tandem.logprob_temperature";
    /// Written by `rollout` as [`OLD_LOGPROBS_ROLLOUT`] when its kernels were batch-invariant:
    /// its rollout_logprobs are then the trainer's log-probs of policy_version's weights, the
    /// old log-probs that `update --bypass-mode` takes.
    pub const OLD_LOGPROBS: &str = "tandem.old_logprobs";
    pub(crate) const OLD_LOGPROBS_ROLLOUT: &str = "rollout";
    /// The stage's parameters as JSON live under `tandem.stage.<name>`.
    pub(crate) const STAGE_PREFIX: &str = "tandem.stage.";
    /// Arrow's own schema blob; never copied from input to output by hand.
    pub const ARROW_SCHEMA: &str = "ARROW:schema";
}

pub const UID: &str = "uid";
pub const PROMPT_UID: &str = "prompt_uid";
pub const DATA_SOURCE: &str = "data_source";
pub const PROMPT: &str = "prompt";
pub const GROUND_TRUTH: &str = "ground_truth";
/// verl keeps the ground truth inside this struct column.
pub(crate) const REWARD_MODEL: &str = "reward_model";
pub const EXTRA_INFO: &str = "extra_info";
pub const PROMPT_IDS: &str = "prompt_ids";
pub const RESPONSE_IDS: &str = "response_ids";
pub const RESPONSE_MASK: &str = "response_mask";
pub const RESPONSE_TEXT: &str = "response_text";
pub const FINISH_REASON: &str = "finish_reason";
pub const ROLLOUT_LOGPROBS: &str = "rollout_logprobs";
/// Per response token, the policy version that sampled it (partial rollouts of
/// `[placement] mode = "async"`, continued under newer weights between rounds).
pub const TOKEN_POLICY_VERSION: &str = "token_policy_version";
/// Multi-turn rollouts (with tools): assistant turns, the calls (JSON list), the conversation
/// (JSON list of messages; untyped here, since datasets often have a `messages` column of
/// their own, which a rollout with tools leaves out).
pub const NUM_TURNS: &str = "num_turns";
pub const TOOL_CALLS: &str = "tool_calls";
pub const MESSAGES: &str = "messages";
pub const SCORE: &str = "score";
/// Sub-scores are `score_<name>`.
pub(crate) const SCORE_PREFIX: &str = "score_";
pub const OLD_LOGPROBS: &str = "old_logprobs";
pub const REF_LOGPROBS: &str = "ref_logprobs";
pub const TOKEN_REWARDS: &str = "token_rewards";
pub const ADVANTAGES: &str = "advantages";
pub const RETURNS: &str = "returns";
pub const VALUES: &str = "values";
/// ReMax's greedy-baseline score.
pub const BASELINE_SCORE: &str = "baseline_score";
/// True on the greedy sample `rollout --baseline greedy` adds to each prompt's group (ReMax's
/// baseline): scored like any row, then taken out by `advantage`; never a training sample.
pub const IS_BASELINE: &str = "is_baseline";

/// The physical kinds of column the contract uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Utf8,
    I32,
    F32,
    Bool,
    /// `score_<key>`: a float32 sub-score, or a reward's text value (utf8).
    SubScore,
    ListI32,
    ListU8,
    ListF32,
}

impl Kind {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Kind::Utf8 => "utf8",
            Kind::I32 => "int32",
            Kind::F32 => "float32",
            Kind::Bool => "bool",
            Kind::SubScore => "float32 or utf8",
            Kind::ListI32 => "list<int32>",
            Kind::ListU8 => "list<uint8>",
            Kind::ListF32 => "list<float32>",
        }
    }

    /// The Arrow type we write for this kind.
    pub(crate) fn data_type(self) -> DataType {
        let item = |t: DataType| DataType::List(Arc::new(Field::new_list_field(t, false)));
        match self {
            Kind::Utf8 => DataType::Utf8,
            Kind::I32 => DataType::Int32,
            Kind::F32 | Kind::SubScore => DataType::Float32,
            Kind::Bool => DataType::Boolean,
            Kind::ListI32 => item(DataType::Int32),
            Kind::ListU8 => item(DataType::UInt8),
            Kind::ListF32 => item(DataType::Float32),
        }
    }

    /// Whether an Arrow type found in a file is acceptable for this kind. Readers are lenient
    /// about representation (large/view strings, large lists, child names, nullability) since
    /// pandas, polars and pyarrow each pick their own.
    pub(crate) fn accepts(self, dt: &DataType) -> bool {
        let list_of = |want: &DataType| match dt {
            DataType::List(f) | DataType::LargeList(f) => f.data_type() == want,
            _ => false,
        };
        match self {
            Kind::Utf8 => matches!(
                dt,
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
            ),
            Kind::I32 => matches!(dt, DataType::Int32 | DataType::Int64),
            Kind::F32 => matches!(dt, DataType::Float32 | DataType::Float64),
            Kind::Bool => matches!(dt, DataType::Boolean),
            Kind::SubScore => Kind::F32.accepts(dt) || Kind::Utf8.accepts(dt),
            Kind::ListI32 => list_of(&DataType::Int32) || list_of(&DataType::Int64),
            Kind::ListU8 => list_of(&DataType::UInt8) || list_of(&DataType::Int8),
            Kind::ListF32 => list_of(&DataType::Float32) || list_of(&DataType::Float64),
        }
    }
}

/// The kind of a contract column, or None for columns the contract does not type
/// (dataset columns such as `prompt` or `extra_info`, which are kept as they come).
pub(crate) fn kind_of(name: &str) -> Option<Kind> {
    Some(match name {
        UID | PROMPT_UID | DATA_SOURCE | RESPONSE_TEXT | FINISH_REASON | TOOL_CALLS => Kind::Utf8,
        NUM_TURNS => Kind::I32,
        PROMPT_IDS | RESPONSE_IDS | TOKEN_POLICY_VERSION => Kind::ListI32,
        RESPONSE_MASK => Kind::ListU8,
        SCORE | BASELINE_SCORE => Kind::F32,
        IS_BASELINE => Kind::Bool,
        TOKEN_REWARDS | ADVANTAGES | RETURNS | VALUES => Kind::ListF32,
        n if n.ends_with("_logprobs") || n == "entropy" || n.ends_with("_entropy") => Kind::ListF32,
        n if n.starts_with(SCORE_PREFIX) => Kind::SubScore,
        _ => return None,
    })
}

/// Columns that hold one value per response token and must have as many entries as
/// `response_ids` in every row.
pub(crate) fn is_token_aligned(name: &str) -> bool {
    name == TOKEN_POLICY_VERSION
        || name != RESPONSE_IDS && matches!(kind_of(name), Some(Kind::ListF32 | Kind::ListU8))
}

/// The field we write for a contract column.
pub fn field(name: &str) -> Field {
    let kind =
        kind_of(name).unwrap_or_else(|| panic!("column {name} is not in the batch contract"));
    Field::new(name, kind.data_type(), false)
}
