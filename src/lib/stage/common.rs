//! What the model stages share: `--device`, `--model` (a directory or a sync-weights pointer),
//! token-id checks against the vocabulary, progress bars, small atomic file writes, and which
//! share of the rows a rank computes when several run a stage together.

use crate::bail_input;
use crate::batch::schema::meta;
use crate::batch::Batch;
pub use crate::engine::policy::{resolve_model, ModelRef, Pointer};
use crate::error::input_error;
use crate::parallel::DeviceKind;
use crate::stage::Topology;
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::io::IsTerminal;
use std::ops::Bound;
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;

/// Where a stage computes: `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    /// The kind of device, as the launcher's ranks take it (each rank on its own GPU).
    pub fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device '{s}' (expected cpu, cuda or cuda:N)")),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    /// The device of one rank of several: a CUDA rank computes on the GPU of its local rank
    /// (or the one GPU the launcher shows it), whatever `cuda:N` says; the CPU stays the CPU.
    pub(crate) fn for_rank(self, world: &crate::parallel::World) -> Result<Device> {
        match self {
            Device::Cpu => Ok(Device::Cpu),
            Device::Cuda(_) => Ok(Device::Cuda(crate::parallel::job::gpu_for_rank(world)?)),
        }
    }
}

// As its flag text ("cpu", "cuda:1"), so stage arguments travel to the daemon as they are typed.
impl Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Serde of a flag value as its flag text, through `Display` and `FromStr` (the algorithm
/// enums), so stage arguments travel to the daemon as they are typed.
pub(crate) mod as_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::fmt::Display;
    use std::str::FromStr;

    pub(crate) fn serialize<T: Display, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub(crate) fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Serde of `--rollout-is` (`token` | `sequence`).
pub(crate) mod rollout_is_level {
    use crate::algo::policy_loss::RolloutIsLevel;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(
        v: &Option<RolloutIsLevel>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(RolloutIsLevel::Token) => s.serialize_some("token"),
            Some(RolloutIsLevel::Sequence) => s.serialize_some("sequence"),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<RolloutIsLevel>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// Refuses an output path that names the input file (`--OUT_FLAG` = `--in`): stages never
/// write in place (docs/BATCH.md), so a stage that fails leaves its input as it was.
pub(crate) fn refuse_in_place(input: &Path, out: &Path, out_flag: &str) -> Result<()> {
    let same = match (input.canonicalize(), out.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => input == out,
    };
    if same {
        bail_input!(
            "{}: --{out_flag} names the --in file; stages never write in place: write to a new file",
            out.display()
        );
    }
    Ok(())
}

/// Refuses a model directory without `tokenizer.json` that a stage is about to pass on (train
/// from, publish): `rollout` would refuse the model it leads to, later and further from the
/// cause. `what` says what the stage would do with it.
pub(crate) fn require_tokenizer(dir: &Path, what: &str) -> Result<()> {
    use crate::tokenizer::TOKENIZER_FILE;
    if !dir.join(TOKENIZER_FILE).is_file() {
        bail_input!(
            "{}: no {TOKENIZER_FILE}; {what}, and rollout would refuse it (copy the tokenizer files of the model it was made from into {})",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Checks that every id of a list<int32> token column is below `vocab`.
pub(crate) fn check_token_ids(batch: &Batch, column: &str, vocab: usize) -> Result<()> {
    let ids = batch.ragged_i32(column)?;
    for row in 0..ids.num_rows() {
        if let Some(&t) = ids.row(row).iter().find(|&&t| t as usize >= vocab) {
            bail_input!(
                "{}, row {row}: token id {t} is outside the model's vocabulary (vocab_size {vocab})",
                batch.at(column)
            );
        }
    }
    Ok(())
}

/// The log-prob temperature of a batch that records none (`sft-batch`'s, files from before the
/// key): softmax of the plain logits.
pub(crate) const DEFAULT_TEMPERATURE: f32 = 1.0;

/// The temperature to take a batch's log-probs at: the one `rollout` sampled it at (recorded in
/// the batch's metadata), which an explicit `--temperature` must equal, since log-probs at
/// another temperature than the samples' give wrong importance ratios; `--temperature`, else
/// [`DEFAULT_TEMPERATURE`], for a batch that records none.
pub fn logprob_temperature(batch: &Batch, flag: Option<f32>) -> Result<f32> {
    let key = meta::LOGPROB_TEMPERATURE;
    let recorded = match batch.meta.get(key) {
        None => None,
        Some(text) => Some(text.parse::<f32>().map_err(|_| {
            input_error(format!(
                "{}: metadata {key} = {text:?} is not a number",
                batch.path.display()
            ))
        })?),
    };
    match (recorded, flag) {
        (Some(r), Some(t)) if r != t => bail_input!(
            "{}: rollout sampled this batch at temperature {r} (metadata {key}), but --temperature {t} was given; log-probs at another temperature than the samples' give wrong ratios: drop --temperature (the recorded {r} is used) or pass --temperature {r}",
            batch.path.display()
        ),
        (Some(r), _) => Ok(r),
        (None, t) => Ok(t.unwrap_or(DEFAULT_TEMPERATURE)),
    }
}

/// The contiguous block of `items` (prompts, prompt groups) this process computes: all of them
/// alone, else its rank's balanced share (`parallel::exchange::block`).
pub(crate) fn my_block(exec: &(impl Topology + ?Sized), items: usize) -> Range<usize> {
    match exec.ranks() {
        Some(x) => x.block(items),
        None => 0..items,
    }
}

/// Whether this process writes the stage's files and metrics: the only one, or rank 0.
pub(crate) fn writes_files(exec: &(impl Topology + ?Sized)) -> bool {
    exec.ranks().is_none_or(|x| x.is_root())
}

/// Rank 0 gets every rank's result in rank order (its own `mine` first, the others decoded
/// from what `encode` made of theirs); the other ranks get None once theirs is handed over.
/// Alone: `[mine]`, nothing encoded.
pub(crate) fn gather_results<T>(
    exec: &(impl Topology + ?Sized),
    mine: T,
    encode: impl Fn(&T) -> Vec<u8>,
    decode: impl Fn(&[u8]) -> Result<T>,
) -> Result<Option<Vec<T>>> {
    let Some(x) = exec.ranks() else {
        return Ok(Some(vec![mine]));
    };
    let Some(parts) = x.gather(&encode(&mine))? else {
        return Ok(None);
    };
    let mut all = Vec::with_capacity(parts.len());
    all.push(mine);
    for p in &parts[1..] {
        all.push(decode(p)?);
    }
    Ok(Some(all))
}

/// Waits (on the ranks other than 0) until rank 0 has passed this point, e.g. written the
/// files that the next step reads; alone, nothing to wait for.
pub(crate) fn after_rank0(exec: &(impl Topology + ?Sized)) -> Result<()> {
    if let Some(x) = exec.ranks() {
        x.broadcast(x.is_root().then_some(&[][..]))?;
    }
    Ok(())
}

/// A progress bar on stderr, hidden when stderr is not a terminal (logs, tests, pipelines).
pub(crate) fn progress_bar(len: usize, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template(&format!(
        "{what} {{bar:40}} {{pos}}/{{len}} [{{elapsed_precise}} < {{eta_precise}}]"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

/// A number a flag takes, as its range check sees it.
pub(crate) trait FlagNumber:
    FromStr<Err: fmt::Display> + PartialOrd + Copy + fmt::Display + Send + Sync + 'static
{
    /// "a finite number" or "an integer", for messages.
    const KIND: &'static str;
    fn is_finite(self) -> bool;
}

macro_rules! flag_number {
    ($kind:literal, $finite:expr, $($t:ty),*) => {$(
        impl FlagNumber for $t {
            const KIND: &'static str = $kind;
            fn is_finite(self) -> bool {
                $finite(self)
            }
        }
    )*};
}
flag_number!("a finite number", |x: f32| x.is_finite(), f32);
flag_number!("a finite number", |x: f64| x.is_finite(), f64);
flag_number!("an integer", |_| true, u32, u64, usize, i64);

/// The clap value parser of a numeric flag: the number, finite, within `lo..hi`. Out of range
/// (a negative count, NaN, a fraction above 1) it is refused by clap, exit 2, with a message
/// that gives the range ("invalid value '0' for '--n <N>': must be an integer >= 1"). Every
/// numeric flag of every stage goes through it, so the range is declared with the flag, and the
/// pipeline spec, which parses keys with the stage's parsers, refuses the same values.
pub(crate) fn range<T: FlagNumber>(
    lo: Bound<T>,
    hi: Bound<T>,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |text: &str| {
        let wanted = || {
            format!("must be {} {}", T::KIND, describe(lo, hi))
                .trim_end()
                .to_string()
        };
        let x: T = match text.trim().parse() {
            Ok(x) => x,
            // A number of the wrong kind (-1 or 0.5 for a count) gets the range.
            Err(_) if text.trim().parse::<f64>().is_ok() => return Err(wanted()),
            Err(e) => return Err(e.to_string()),
        };
        let above = match lo {
            Bound::Included(l) => x >= l,
            Bound::Excluded(l) => x > l,
            Bound::Unbounded => true,
        };
        let below = match hi {
            Bound::Included(h) => x <= h,
            Bound::Excluded(h) => x < h,
            Bound::Unbounded => true,
        };
        match x.is_finite() && above && below {
            true => Ok(x),
            false => Err(wanted()),
        }
    }
}

/// `>= 1`, `> 0`, `in (0, 1]`; "" for no bound.
fn describe<T: fmt::Display>(lo: Bound<T>, hi: Bound<T>) -> String {
    match (lo, hi) {
        (Bound::Unbounded, Bound::Unbounded) => String::new(),
        (Bound::Included(l), Bound::Unbounded) => format!(">= {l}"),
        (Bound::Excluded(l), Bound::Unbounded) => format!("> {l}"),
        (Bound::Unbounded, Bound::Included(h)) => format!("<= {h}"),
        (Bound::Unbounded, Bound::Excluded(h)) => format!("< {h}"),
        (lo, hi) => {
            let (open, l) = match lo {
                Bound::Included(l) => ('[', l.to_string()),
                Bound::Excluded(l) => ('(', l.to_string()),
                Bound::Unbounded => ('(', "-inf".into()),
            };
            let (close, h) = match hi {
                Bound::Included(h) => (']', h.to_string()),
                Bound::Excluded(h) => (')', h.to_string()),
                Bound::Unbounded => (')', "inf".into()),
            };
            format!("in {open}{l}, {h}{close}")
        }
    }
}

/// A number `>= lo`.
pub(crate) fn at_least<T: FlagNumber>(
    lo: T,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    range(Bound::Included(lo), Bound::Unbounded)
}

/// A number `> lo`.
pub(crate) fn above<T: FlagNumber>(
    lo: T,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    range(Bound::Excluded(lo), Bound::Unbounded)
}

/// A number in `[lo, hi]`.
pub(crate) fn between<T: FlagNumber>(
    lo: T,
    hi: T,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    range(Bound::Included(lo), Bound::Included(hi))
}

/// Any finite number.
pub(crate) fn finite<T: FlagNumber>(
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    range(Bound::Unbounded, Bound::Unbounded)
}

/// Lets every flag that takes a value take a negative number (`--temperature -1`), so that it
/// reaches the flag's range check instead of being read as an unknown flag `-1`. A numeric
/// flag takes any value that starts with `-` (clap's own test for a negative number misses
/// `-1e-6`), which its number parser then judges; other flags take negative numbers. Every
/// stage's `Args` applies it: `#[command(mut_args = negative_numbers)]`.
pub(crate) fn negative_numbers(arg: clap::Arg) -> clap::Arg {
    if !arg.get_action().takes_values() {
        return arg;
    }
    match is_numeric(&arg) {
        true => arg.allow_hyphen_values(true),
        false => arg.allow_negative_numbers(true),
    }
}

/// Whether a flag's values parse to a number type.
pub(crate) fn is_numeric(arg: &clap::Arg) -> bool {
    use std::any::TypeId;
    let parsed = arg.get_value_parser().type_id();
    [
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i64>(),
    ]
    .iter()
    .any(|t| parsed == *t)
}

/// `--model` and `--out` must differ from each other for stages that write a directory.
pub(crate) fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_numbers_and_name_the_range() {
        assert_eq!(at_least(1usize)("3"), Ok(3));
        assert_eq!(
            at_least(1usize)("0").unwrap_err(),
            "must be an integer >= 1"
        );
        assert_eq!(
            at_least(1usize)("-1").unwrap_err(),
            "must be an integer >= 1"
        );
        assert_eq!(
            at_least(1usize)("0.5").unwrap_err(),
            "must be an integer >= 1"
        );
        assert_eq!(
            at_least(1usize)("x").unwrap_err(),
            "invalid digit found in string"
        );
        assert_eq!(at_least(0.0f32)("0"), Ok(0.0));
        assert_eq!(
            at_least(0.0f32)("-1").unwrap_err(),
            "must be a finite number >= 0"
        );
        assert_eq!(
            at_least(0.0f32)("inf").unwrap_err(),
            "must be a finite number >= 0"
        );
        assert_eq!(
            above(0.0f64)("0").unwrap_err(),
            "must be a finite number > 0"
        );
        let frac = range(Bound::Excluded(0.0f64), Bound::Included(1.0));
        assert_eq!(frac("1"), Ok(1.0));
        assert_eq!(frac("0").unwrap_err(), "must be a finite number in (0, 1]");
        assert_eq!(
            frac("NaN").unwrap_err(),
            "must be a finite number in (0, 1]"
        );
        assert_eq!(
            between(0.0f64, 1.0)("1.5").unwrap_err(),
            "must be a finite number in [0, 1]"
        );
        assert_eq!(finite::<f32>()("-3.5"), Ok(-3.5));
        assert_eq!(
            finite::<f32>()("nan").unwrap_err(),
            "must be a finite number"
        );
        assert_eq!(finite::<f32>()("x").unwrap_err(), "invalid float literal");
    }

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert!("gpu".parse::<Device>().is_err() && "cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }
}

/// The LoRA flags, as `update`, the daemon and the `bench update` / `bench rollout` benchmarks
/// take them (verl's lora_rank, lora_alpha, target_modules).
#[derive(clap::Args, Clone, Debug, Serialize, Deserialize)]
pub struct LoraFlags {
    /// Train LoRA adapters of this rank on the frozen --model instead of every weight (verl's
    /// lora_rank; 0: full fine-tuning). --model is then a model (fresh adapters, B zero) or a
    /// LoRA checkpoint / PEFT adapter directory; --out-model gets the adapters in PEFT's files.
    #[arg(long, default_value_t = 0, value_name = "R")]
    #[serde(default)]
    pub lora_rank: usize,
    /// LoRA alpha: the adapters' product B·A is scaled by alpha / rank (verl's lora_alpha).
    #[arg(long, default_value_t = 16.0, value_parser = above(0.0f32))]
    #[serde(default = "default_lora_alpha")]
    pub lora_alpha: f32,
    /// The projections that get adapters: a comma list of q, k, v, o, gate, up, down (or
    /// their *_proj names), or all-linear (verl's target_modules).
    #[arg(long, default_value = "all-linear")]
    #[serde(default = "default_lora_targets")]
    pub lora_targets: String,
}

fn default_lora_alpha() -> f32 {
    16.0
}

fn default_lora_targets() -> String {
    "all-linear".to_string()
}

impl LoraFlags {
    /// The adapters' spec, checked; None for rank 0 (every weight trains).
    pub fn spec(&self) -> Result<Option<crate::model::lora::LoraSpec>> {
        crate::model::lora::LoraSpec::from_flags(
            self.lora_rank,
            self.lora_alpha,
            &self.lora_targets,
        )
    }
}
