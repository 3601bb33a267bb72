//! The pipeline spec: `pipelines/NAME.toml`.
//!
//! Top-level keys (`seed`, `steps`, `device`, `daemon`) come first, then one table per concern:
//! `[model]`, `[data]`, one table per stage (`[rollout]`, `[score]`, `[ref-logprob]`,
//! `[advantage]`, `[update]`) whose keys are exactly that stage's flags without the leading
//! `--`, then `[eval]` and `[checkpoint]`. Flags the runner owns (`--model`, `--in`, `--out`,
//! `--seed`, `--metrics`, `--out-model`, `--kl-state`, `--column`, `--device`) are not keys.
//! An unknown key is an error naming the line and the closest valid key.

use crate::bail_input;
use crate::error::input_error;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How one spec value is passed on a stage's command line.
pub trait FlagValue {
    /// The arguments for `--name` with this value (empty when a switch is off).
    fn flag_args(&self, name: &str) -> Vec<String>;
}

macro_rules! impl_flag_value {
    ($($t:ty),*) => {$(
        impl FlagValue for $t {
            fn flag_args(&self, name: &str) -> Vec<String> {
                vec![format!("--{name}"), self.to_string()]
            }
        }
    )*};
}
impl_flag_value!(f64, i64, u64, String, bool);

/// A repeatable flag (`stop = ["a", "b"]` gives `--stop a --stop b`).
impl FlagValue for Vec<String> {
    fn flag_args(&self, name: &str) -> Vec<String> {
        self.iter()
            .flat_map(|v| [format!("--{name}"), v.clone()])
            .collect()
    }
}

/// A comma-separated list flag (`stop-token-ids = [1, 2]` gives `--stop-token-ids 1,2`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CommaList(pub Vec<u64>);

impl FlagValue for CommaList {
    fn flag_args(&self, name: &str) -> Vec<String> {
        if self.0.is_empty() {
            return Vec::new();
        }
        let items: Vec<String> = self.0.iter().map(u64::to_string).collect();
        vec![format!("--{name}"), items.join(",")]
    }
}

/// A flag that takes no value (`--kl-in-reward`): present when true.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Switch(pub bool);

impl FlagValue for Switch {
    fn flag_args(&self, name: &str) -> Vec<String> {
        if self.0 {
            vec![format!("--{name}")]
        } else {
            Vec::new()
        }
    }
}

/// A struct of optional stage flags: the TOML key is the flag name, and `args()` gives the
/// command-line arguments of the keys that were set, in declaration order.
macro_rules! stage_flags {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "kebab-case", deny_unknown_fields)]
        pub struct $name {
            $($(#[$fm])* #[serde(default, skip_serializing_if = "Option::is_none")]
            pub $field: Option<$ty>,)*
        }

        impl $name {
            /// Command-line arguments for the keys that are set.
            pub fn args(&self) -> Vec<String> {
                let mut out = Vec::new();
                $(if let Some(v) = &self.$field {
                    out.extend(v.flag_args(&stringify!($field).replace('_', "-")));
                })*
                out
            }
        }
    };
}

stage_flags!(
    /// `[rollout]`: flags of the `rollout` stage for training rollouts.
    RolloutFlags {
        n: u64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        max_new_tokens: u64,
        max_prompt_tokens: u64,
        truncate: String,
        raw_prompt: Switch,
        stop: Vec<String>,
        stop_token_ids: CommaList,
        ignore_eos: Switch,
        prompt_key: String,
        batch_size: u64,
        max_num_seqs: u64,
        max_batched_tokens: u64,
        gpu_memory_fraction: f64,
    }
);

impl RolloutFlags {
    /// The flags that are not sampling parameters (prompt handling, stops, batch size): the
    /// eval rollout uses them as they are.
    pub fn shared(&self) -> RolloutFlags {
        RolloutFlags {
            n: None,
            temperature: None,
            top_p: None,
            top_k: None,
            max_new_tokens: None,
            max_prompt_tokens: None,
            ..self.clone()
        }
    }
}

stage_flags!(
    /// `[score]`: flags of the `score` stage (used for eval too).
    ScoreFlags {
        reward: String,
        format_score: f64,
        gsm8k_method: String,
        timeout_ms: u64,
        run_timeout_ms: u64,
        python: String,
        reward_kwargs: String,
    }
);

stage_flags!(
    /// `[ref-logprob]`: flags of the `ref-logprob` stage (the runner sets `--model` and
    /// `--column`).
    RefLogprobFlags {
        temperature: f64,
        entropy: Switch,
        micro_batch_tokens: u64,
    }
);

stage_flags!(
    /// `[advantage]`: flags of the `advantage` stage (the runner sets `--kl-state` when the
    /// adaptive controller is on).
    AdvantageFlags {
        estimator: String,
        gamma: f64,
        lam: f64,
        norm_by_std: bool,
        epsilon: f64,
        kl_in_reward: Switch,
        kl_penalty: String,
        kl_coef: f64,
        kl_ctrl: String,
        kl_target: f64,
        kl_horizon: u64,
    }
);

stage_flags!(
    /// `[update]`: flags of the `update` stage.
    UpdateFlags {
        loss: String,
        clip_ratio: f64,
        clip_ratio_low: f64,
        clip_ratio_high: f64,
        clip_ratio_c: f64,
        loss_agg_mode: String,
        entropy_coeff: f64,
        use_kl_loss: Switch,
        kl_loss_coef: f64,
        kl_loss_type: String,
        rollout_is: String,
        rollout_is_threshold: f64,
        ppo_epochs: u64,
        mini_batch_size: u64,
        micro_batch_tokens: u64,
        temperature: f64,
        lr: f64,
        lr_warmup_steps: u64,
        lr_schedule: String,
        total_steps: u64,
        min_lr_ratio: f64,
        weight_decay: f64,
        grad_clip: f64,
        betas: String,
        adam_eps: f64,
        loss_scale_factor: f64,
        shuffle: Switch,
    }
);

stage_flags!(
    /// The sampling flags of the evaluation rollout (inside `[eval]`).
    EvalSampling {
        n: u64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        max_new_tokens: u64,
        max_prompt_tokens: u64,
    }
);

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
pub struct ModelSpec {
    /// HF model directory the run starts from (also the reference when `ref` is not set).
    pub path: PathBuf,
    /// A different reference model for `ref-logprob`.
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<PathBuf>,
}

/// `[data]`: prompt datasets and how many prompts each step takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DataSpec {
    pub train: PathBuf,
    /// Validation prompts for `[eval]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val: Option<PathBuf>,
    pub prompts_per_step: u64,
    /// Reshuffle the training prompts every epoch (seeded); false keeps the file's order.
    #[serde(default = "yes")]
    pub shuffle: bool,
}

/// `[eval]`: cadence and sampling of evaluation on `data.val`. The sampling keys are the
/// `rollout` flags; unset ones default to greedy decoding of one sample (`n = 1`,
/// `top-k = 1`), with `max-new-tokens` and `max-prompt-tokens` taken from `[rollout]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct EvalSpec {
    /// Evaluate after every `every` steps (0: never).
    #[serde(default)]
    pub every: u64,
    /// Also evaluate the initial model (step 0) when `every` > 0.
    #[serde(default = "yes")]
    pub at_start: bool,
    /// Evaluate only the first `limit` validation prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<u64>,
}

impl Default for EvalSpec {
    fn default() -> Self {
        EvalSpec {
            every: 0,
            at_start: true,
            limit: None,
            n: None,
            temperature: None,
            top_p: None,
            top_k: None,
            max_new_tokens: None,
            max_prompt_tokens: None,
        }
    }
}

impl EvalSpec {
    /// The eval rollout's sampling, defaults filled in from greedy and from `[rollout]`.
    pub fn sampling(&self, train: &RolloutFlags) -> EvalSampling {
        EvalSampling {
            n: Some(self.n.unwrap_or(1)),
            temperature: self.temperature,
            top_p: self.top_p,
            // Greedy unless the user asked for sampling: top-k 1 is greedy at any temperature.
            top_k: Some(
                self.top_k
                    .unwrap_or(if self.temperature.is_some() { -1 } else { 1 }),
            ),
            max_new_tokens: self.max_new_tokens.or(train.max_new_tokens),
            max_prompt_tokens: self.max_prompt_tokens.or(train.max_prompt_tokens),
        }
    }
}

/// `[checkpoint]`: which step checkpoints stay on disk under `ckpt/`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Keep the checkpoint of every `every`-th step (0: only the current policy's).
    #[serde(default)]
    pub every: u64,
    /// How many of those to keep (the newest); the current policy is always kept.
    #[serde(default = "one")]
    pub keep_last: u64,
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

fn one() -> u64 {
    1
}

/// A whole pipeline spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Spec {
    /// Seed of the prompt sampler and of every stage's `--seed`.
    #[serde(default)]
    pub seed: u64,
    /// Number of training steps.
    pub steps: u64,
    #[serde(default)]
    pub device: Device,
    /// Run GPU stages as clients of a warm daemon.
    #[serde(default)]
    pub daemon: bool,
    /// Batch-invariant GPU kernels in every stage and the daemon (TANDEM_BATCH_INVARIANT=1):
    /// rollout log-probs equal the training forward's for the same tokens, at a rollout
    /// throughput cost (docs/ROLLOUT.md).
    #[serde(default)]
    pub batch_invariant: bool,
    pub model: ModelSpec,
    pub data: DataSpec,
    #[serde(default)]
    pub rollout: RolloutFlags,
    pub score: ScoreFlags,
    #[serde(default)]
    pub ref_logprob: RefLogprobFlags,
    #[serde(default)]
    pub advantage: AdvantageFlags,
    #[serde(default)]
    pub update: UpdateFlags,
    #[serde(default)]
    pub eval: EvalSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
}

impl Spec {
    /// Read and check a spec file.
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| input_error(format!("{}: cannot read spec: {e}", path.display())))?;
        Spec::parse(&text, &path.display().to_string())
    }

    /// Parse spec text; `origin` names it in messages.
    pub fn parse(text: &str, origin: &str) -> Result<Spec> {
        let spec: Spec = match toml::from_str(text) {
            Ok(s) => s,
            Err(e) => return Err(input_error(describe_toml_error(text, origin, &e))),
        };
        spec.validate(origin)?;
        Ok(spec)
    }

    fn validate(&self, origin: &str) -> Result<()> {
        if self.steps == 0 {
            bail_input!("{origin}: steps must be at least 1");
        }
        if self.data.prompts_per_step == 0 {
            bail_input!("{origin}: [data] prompts-per-step must be at least 1");
        }
        if self.score.reward.is_none() {
            bail_input!("{origin}: [score] needs `reward` (e.g. reward = \"gsm8k\")");
        }
        if self.eval.every > 0 && self.data.val.is_none() {
            bail_input!(
                "{origin}: [eval] every = {} needs [data] val = \"FILE.parquet\"",
                self.eval.every
            );
        }
        for (key, v) in [
            ("[rollout] temperature", self.rollout.temperature),
            ("[rollout] top-p", self.rollout.top_p),
            ("[update] lr", self.update.lr),
        ] {
            if let Some(v) = v {
                if !v.is_finite() || v < 0.0 {
                    bail_input!("{origin}: {key} = {v} must be a finite number >= 0");
                }
            }
        }
        Ok(())
    }

    /// Whether the step needs reference log-probs: a KL term in the reward or the loss, or a
    /// separate reference model.
    pub fn needs_ref(&self) -> bool {
        self.advantage.kl_in_reward.unwrap_or_default().0
            || self.update.use_kl_loss.unwrap_or_default().0
            || self.model.reference.is_some()
    }

    /// Whether `update` takes more than one optimizer step per batch (several epochs or
    /// mini-batches), or the reward's KL needs them: then the policy's own log-probs before
    /// the update are computed as `old_logprobs`, as verl does.
    pub fn needs_old(&self) -> bool {
        let rows = self.data.prompts_per_step * self.rollout.n.unwrap_or(1);
        self.update.ppo_epochs.unwrap_or(1) > 1
            || self.update.mini_batch_size.is_some_and(|m| m < rows)
            || self.advantage.kl_in_reward.unwrap_or_default().0
    }

    /// Whether `advantage` keeps its adaptive KL coefficient in a state file.
    pub fn adaptive_kl(&self) -> bool {
        self.advantage.kl_ctrl.as_deref() == Some("adaptive")
    }

    /// The reference model: `[model] ref`, else the initial policy.
    pub fn reference_model(&self) -> &Path {
        self.model.reference.as_deref().unwrap_or(&self.model.path)
    }

    /// The spec as TOML, every runner default written out.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a spec always serializes")
    }
}

/// A TOML/serde error as "FILE:LINE:COL: message", with a suggestion for unknown keys.
fn describe_toml_error(text: &str, origin: &str, e: &toml::de::Error) -> String {
    let location = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
            format!("{origin}:{line}:{col}")
        }
        None => origin.to_string(),
    };
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
pub fn edit_distance(a: &str, b: &str) -> usize {
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
pub fn closest<'a>(key: &str, valid: &'a [String]) -> Option<&'a str> {
    valid
        .iter()
        .map(|v| (edit_distance(key, v), v))
        .filter(|(d, v)| *d * 3 <= key.chars().count().max(v.chars().count()))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v.as_str())
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

    const MINIMAL: &str = r#"
steps = 3
[model]
path = "models/tiny"
[data]
train = "data/train.parquet"
prompts-per-step = 4
[score]
reward = "exact"
"#;

    #[test]
    fn minimal_spec_gets_runner_defaults() {
        let s = Spec::parse(MINIMAL, "t.toml").unwrap();
        assert_eq!(s.steps, 3);
        assert_eq!(s.seed, 0);
        assert_eq!(s.device, Device::Cpu);
        assert!(s.data.shuffle);
        assert_eq!(s.eval, EvalSpec::default());
        assert_eq!(s.checkpoint.keep_last, 1);
        assert!(!s.needs_ref());
        assert!(!s.needs_old());
        assert_eq!(s.reference_model(), Path::new("models/tiny"));
        assert!(!s.batch_invariant);
        let s = Spec::parse(&format!("batch-invariant = true\n{MINIMAL}"), "t.toml").unwrap();
        assert!(s.batch_invariant);
    }

    #[test]
    fn stage_keys_become_flags_in_declaration_order() {
        let text = format!(
            "{MINIMAL}\n[advantage]\nestimator = \"grpo\"\nnorm-by-std = false\nkl-in-reward = true\nkl-coef = 0.01\n[update]\nuse-kl-loss = false\nlr = 1e-5\nbetas = \"0.9,0.99\"\n"
        );
        let s = Spec::parse(&text, "t.toml").unwrap();
        assert_eq!(
            s.advantage.args(),
            [
                "--estimator",
                "grpo",
                "--norm-by-std",
                "false",
                "--kl-in-reward",
                "--kl-coef",
                "0.01"
            ]
        );
        // A switch set to false is left out; floats print in Rust's shortest round-trip form.
        assert_eq!(s.update.args(), ["--lr", "0.00001", "--betas", "0.9,0.99"]);
        assert!(s.needs_ref());
        assert!(s.needs_old());
    }

    #[test]
    fn unknown_key_suggests_the_closest() {
        let text = MINIMAL.replace("prompts-per-step", "prompt-per-step");
        let err = Spec::parse(&text, "t.toml").unwrap_err();
        let msg = format!("{err:#}");
        assert!(crate::error::is_input_error(&err));
        assert!(
            msg.starts_with("t.toml:7:1: unknown key `prompt-per-step`"),
            "{msg}"
        );
        assert!(msg.contains("did you mean `prompts-per-step`?"), "{msg}");

        // Underscores for dashes, in a stage table.
        let text = format!("{MINIMAL}[rollout]\nmax_new_tokens = 8\n");
        let msg = format!("{:#}", Spec::parse(&text, "t.toml").unwrap_err());
        assert!(
            msg.contains("unknown key `max_new_tokens`: did you mean `max-new-tokens`?"),
            "{msg}"
        );

        // Nothing close: list what is valid.
        let text = format!("{MINIMAL}[checkpoint]\nbananas = 1\n");
        let msg = format!("{:#}", Spec::parse(&text, "t.toml").unwrap_err());
        assert!(
            msg.contains("unknown key `bananas`: valid keys here: every, keep-last"),
            "{msg}"
        );

        // A runner-owned flag is not a spec key.
        let text = format!("{MINIMAL}[rollout]\nout = \"x\"\n");
        let msg = format!("{:#}", Spec::parse(&text, "t.toml").unwrap_err());
        assert!(msg.contains("unknown key `out`"), "{msg}");

        // Top level.
        let text = format!("sed = 1\n{MINIMAL}");
        let msg = format!("{:#}", Spec::parse(&text, "t.toml").unwrap_err());
        assert!(
            msg.contains("t.toml:1:1: unknown key `sed`: did you mean `seed`?"),
            "{msg}"
        );
    }

    #[test]
    fn bad_values_are_input_errors() {
        let cases = [
            (
                MINIMAL.replace("steps = 3", "steps = 0"),
                "steps must be at least 1",
            ),
            (
                MINIMAL.replace("steps = 3", "steps = \"3\""),
                "t.toml:2:9: invalid type",
            ),
            (
                MINIMAL.replace("reward = \"exact\"", ""),
                "[score] needs `reward`",
            ),
            (
                format!("device = \"tpu\"\n{MINIMAL}"),
                "unknown variant `tpu`",
            ),
            (format!("{MINIMAL}[eval]\nevery = 2\n"), "needs [data] val"),
            (
                format!("{MINIMAL}[rollout]\ntemperature = nan\n"),
                "must be a finite number",
            ),
            (
                MINIMAL.replace("[model]\npath = \"models/tiny\"", ""),
                "missing field `model`",
            ),
        ];
        for (text, want) in cases {
            let err = Spec::parse(&text, "t.toml").unwrap_err();
            assert!(crate::error::is_input_error(&err));
            let msg = format!("{err:#}");
            assert!(msg.contains(want), "{want:?} not in {msg:?}");
        }
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
        assert_eq!(
            s.rollout.args(),
            ["--n", "4", "--top-k", "-1", "--max-new-tokens", "7"]
        );
        assert_eq!(
            s.eval.sampling(&s.rollout).args(),
            [
                "--n",
                "1",
                "--top-k",
                "1",
                "--max-new-tokens",
                "7",
                "--max-prompt-tokens",
                "9"
            ]
        );
    }

    #[test]
    fn list_flags_repeat_or_join() {
        let text = format!(
            "{MINIMAL}[rollout]\nn = 2\nstop = [\"\\n\", \"###\"]\nstop-token-ids = [7, 9]\nignore-eos = true\n"
        );
        let s = Spec::parse(&text, "t.toml").unwrap();
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
        assert_eq!(s.rollout.args(), args);
        assert_eq!(s.rollout.shared().args(), args[2..]);
        assert_eq!(Spec::parse(&s.to_toml(), "resolved").unwrap(), s);
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
}
