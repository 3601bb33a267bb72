//! `tandem spec from-verl CONFIG.yaml [key=value ...]`: a tandem spec from a verl
//! `ppo_trainer.yaml` and Hydra overrides.
//!
//! - `config`: the YAML as dotted keys, the overrides, the interpolations.
//! - `rules`: the one table of verl keys and what each becomes ([`rules::RULES`]), from which
//!   docs/FROM_VERL.md's table is generated too.
//!
//! The spec written passes the spec loader `pipeline run` uses ([`Spec::parse`]); a value that
//! does not (out of range, wrong type) is an input error naming the verl key it came from, and
//! nothing is written. Keys without a counterpart are listed on stderr by rule, with the reason.

mod config;
mod multi_turn;
mod rules;

use super::spec::Spec;
use crate::bail_input;
use crate::data::dataset::PromptDataset;
use anyhow::Result;
use clap::{Args, Subcommand};
use config::Config;
use rules::{Ctx, To, RULES};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
#[command(about = "Write tandem specs from other tools' configs")]
pub struct SpecArgs {
    #[command(subcommand)]
    pub cmd: SpecCmd,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SpecCmd {
    /// A tandem spec from a verl ppo_trainer.yaml and Hydra-style overrides; every verl key
    /// without a counterpart is named on stderr with the reason (docs/FROM_VERL.md).
    FromVerl(FromVerlArgs),
}

#[derive(Args, Debug, Clone)]
pub struct FromVerlArgs {
    /// verl's config (YAML), e.g. the one `python3 -m verl.trainer.main_ppo --cfg job` prints.
    pub config: PathBuf,
    /// Hydra overrides applied in order: `a.b=v` sets, `+a.b=v` adds a new key, `++a.b=v`
    /// adds or sets, `~a.b` deletes (values read as YAML: 1e-6, True, null, [a, b]).
    pub overrides: Vec<String>,
    /// Write the spec here (through FILE.tmp and a rename); default: stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// tandem's `[score] reward` (gsm8k, math, exact, regex:..., cmd:..., python:FILE[:FUNC]),
    /// in place of custom_reward_function and the data_source rule.
    #[arg(long, value_name = "SPEC")]
    pub reward: Option<String>,
}

/// `tandem spec ...`.
pub fn run(args: SpecArgs) -> Result<()> {
    match args.cmd {
        SpecCmd::FromVerl(a) => run_from_verl(a),
    }
}

fn run_from_verl(args: FromVerlArgs) -> Result<()> {
    let mut config = Config::load(&args.config)?;
    for o in &args.overrides {
        config.apply_override(o)?;
    }
    let origin = match &args.out {
        Some(p) => p.display().to_string(),
        None => "<stdout>".to_string(),
    };
    let converted = convert(&config, args.reward.as_deref(), &origin)
        .map_err(|e| e.context(args.config.display().to_string()))?;
    eprint!("{}", report(&converted.unmapped));
    match &args.out {
        Some(p) => {
            crate::batch::write::write_atomic(p, converted.text.as_bytes())?;
            eprintln!(
                "tandem spec from-verl: wrote {} ({} keys from verl)",
                p.display(),
                converted.keys
            );
        }
        None => print!("{}", converted.text),
    }
    Ok(())
}

/// A spec converted from a verl config.
#[derive(Debug)]
pub(crate) struct Converted {
    pub(crate) text: String,
    /// Spec keys written from verl keys.
    pub(crate) keys: usize,
    /// The verl keys left out, by rule.
    pub(crate) unmapped: Vec<Unmapped>,
}

/// verl keys left out for one reason.
#[derive(Debug, PartialEq)]
pub(crate) struct Unmapped {
    /// The rule's key or pattern (for unknown keys: their first two segments and `*`).
    pub(crate) pattern: String,
    pub(crate) keys: Vec<String>,
    pub(crate) why: String,
}

/// One spec key as written, and the verl key it came from.
struct Entry {
    value: toml::Value,
    from: String,
}

/// The spec being written: `table.key` (or a top-level key) -> entry; a later verl key that
/// maps to the same spec key replaces the earlier one (the rules list the winner last).
#[derive(Default)]
struct Out {
    entries: BTreeMap<String, Entry>,
}

/// The spec's tables in the order pipelines/*.toml write them.
const TABLES: [&str; 13] = [
    "model",
    "data",
    "rollout",
    "score",
    "ref-logprob",
    "values",
    "advantage",
    "update",
    "critic",
    "sync-weights",
    "algorithm",
    "eval",
    "checkpoint",
];

/// (table, key) of a spec key; the table is "" for a top-level key.
fn split_key(k: &str) -> (&str, &str) {
    match k.split_once('.') {
        Some((t, key)) if TABLES.contains(&t) => (t, key),
        _ => ("", k),
    }
}

impl Out {
    fn set(&mut self, key: &str, value: toml::Value, from: &str) {
        let from = from.to_string();
        self.entries.insert(key.to_string(), Entry { value, from });
    }

    fn has(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// The spec text, and for each line the spec key written on it.
    fn render(&self, header: &str) -> (String, Vec<Option<String>>) {
        let mut lines: Vec<(String, Option<String>)> =
            header.lines().map(|l| (l.to_string(), None)).collect();
        let line = |k: &str, e: &Entry| {
            let (_, key) = split_key(k);
            format!("{key} = {}  # {}", e.value, e.from)
        };
        for (k, e) in self
            .entries
            .iter()
            .filter(|(k, _)| split_key(k).0.is_empty())
        {
            lines.push((line(k, e), Some(k.clone())));
        }
        for table in TABLES {
            let mine: Vec<_> = self
                .entries
                .iter()
                .filter(|(k, _)| split_key(k).0 == table)
                .collect();
            if mine.is_empty() {
                continue;
            }
            lines.push((String::new(), None));
            lines.push((format!("[{table}]"), None));
            for (k, e) in mine {
                lines.push((line(k, e), Some(k.clone())));
            }
        }
        let text = lines.iter().map(|(l, _)| format!("{l}\n")).collect();
        (text, lines.into_iter().map(|(_, k)| k).collect())
    }
}

const HEADER: &str = "\
# Written by `tandem spec from-verl` from a verl config: each key's comment names the verl key
# it came from; keys left out take tandem's defaults. See docs/FROM_VERL.md.
";

/// The training set, when `data.train_files` names a file that exists here.
fn training_set(ctx: &Ctx) -> Result<Option<PromptDataset>> {
    let Some(Value::String(p)) = ctx.get("data.train_files").map(|v| match v {
        Value::Array(a) if a.len() == 1 => a[0].clone(),
        v => v,
    }) else {
        return Ok(None);
    };
    let path = PathBuf::from(rules::expand_home(&p));
    if !path.is_file() {
        return Ok(None);
    }
    let key = ctx
        .get("data.prompt_key")
        .and_then(|k| k.as_str().map(str::to_string))
        .unwrap_or_else(|| "prompt".into());
    PromptDataset::open_with_key(&path, &key).map(Some)
}

/// verl's default reward for the data sources of the training set (its
/// `default_compute_score`), where it is one of tandem's rules.
fn reward_for_sources(ds: &PromptDataset) -> Result<String, String> {
    const MATH: [&str; 3] = [
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
    ];
    let mut sources: Vec<&str> = ds.rows().iter().map(|r| r.data_source.as_str()).collect();
    sources.sort_unstable();
    sources.dedup();
    if sources.iter().all(|s| *s == "openai/gsm8k") {
        Ok("gsm8k".into())
    } else if sources.iter().all(|s| MATH.contains(s)) {
        Ok("math".into())
    } else {
        Err(format!(
            "the training set's data_source values ({}) have no tandem rule verl would pick",
            sources.join(", ")
        ))
    }
}

/// The conversion: every key through its rule, the reward, the spec checked by the loader
/// `pipeline run` uses. `origin` names the spec in the loader's messages.
pub(crate) fn convert(config: &Config, reward: Option<&str>, origin: &str) -> Result<Converted> {
    let mut ctx = Ctx {
        config,
        train_rows: None,
        notes: Default::default(),
    };
    let train = training_set(&ctx)?;
    ctx.train_rows = train.as_ref().map(|d| d.len());
    let mut out = Out::default();
    let mut unmapped = apply_rules(&ctx, &mut out)?;
    // What a converted key could not carry (a tool whose file is not found, ...).
    for (key, why) in ctx.notes.take() {
        let (pattern, keys) = (key.clone(), vec![key]);
        unmapped.push(Unmapped { pattern, keys, why });
    }
    // verl's trainer generates ReMax's greedy baseline itself; in tandem the rollout does.
    let remax = out.entries.get("advantage.estimator");
    if remax.is_some_and(|e| e.value.as_str() == Some("remax")) {
        let greedy = toml::Value::String("greedy".into());
        out.set(
            "rollout.baseline",
            greedy,
            "algorithm.adv_estimator = remax",
        );
    }
    match reward {
        Some(r) => out.set("score.reward", toml::Value::String(r.into()), "--reward"),
        None if !out.has("score.reward") => {
            let found = match &train {
                Some(ds) => reward_for_sources(ds),
                None => Err("the training file cannot be read here to see its data_source".into()),
            };
            match found {
                Ok(r) => out.set("score.reward", toml::Value::String(r), "data_source (verl's default reward)"),
                Err(e) => bail_input!(
                    "custom_reward_function.path is null, so verl picks the reward by data_source, and {e}: give tandem's with --reward (gsm8k, math, exact, regex:..., cmd:..., python:FILE.py[:FUNC])"
                ),
            }
        }
        None => {}
    }
    require(&out)?;
    let (text, lines) = out.render(HEADER);
    if let Err(e) = Spec::parse(&text, origin) {
        return Err(blame(e, &out, &lines, config, origin));
    }
    Ok(Converted {
        text,
        keys: out.entries.len(),
        unmapped,
    })
}

/// Every key through its rule, in the rules' order (so a later rule's key wins a spec key).
fn apply_rules(ctx: &Ctx, out: &mut Out) -> Result<Vec<Unmapped>> {
    let mut by_rule: Vec<(usize, &String)> = Vec::new();
    let mut unknown: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for key in ctx.config.leaves.keys() {
        if key.ends_with("._target_") || key == "_target_" {
            continue; // Hydra's class names: nothing to carry.
        }
        match RULES.iter().position(|r| r.matches(key)) {
            Some(i) => by_rule.push((i, key)),
            None => {
                let group: Vec<&str> = key.split('.').take(2).collect();
                let group = match key.split('.').count() > 2 {
                    true => format!("{}.*", group.join(".")),
                    false => group.join("."),
                };
                unknown.entry(group).or_default().push(key.clone());
            }
        }
    }
    by_rule.sort();
    let mut unmapped: Vec<Unmapped> = Vec::new();
    let mut leave_out = |rule: &str, key: &str, why: &str| match unmapped.last_mut() {
        Some(u) if u.pattern == rule => u.keys.push(key.to_string()),
        _ => unmapped.push(Unmapped {
            pattern: rule.to_string(),
            keys: vec![key.to_string()],
            why: why.to_string(),
        }),
    };
    for (i, key) in by_rule {
        let rule = &RULES[i];
        let value = || -> Result<Value> {
            match ctx.config.get(key) {
                Ok(v) => Ok(v.unwrap_or(Value::Null)),
                Err(e) => bail_input!("{key}: {e}"),
            }
        };
        match &rule.to {
            To::Key { key: to, conv, .. } => {
                let v = value()?;
                match conv(&v, ctx) {
                    Ok(Some(t)) => out.set(to, t, key),
                    Ok(None) => {}
                    Err(e) => bail_input!("{key} = {v}: {e}"),
                }
            }
            To::Builtin(_) => {}
            To::None(why) => leave_out(rule.verl, key, why),
            To::WhenOn { switch, why } => {
                let on = match *switch {
                    "" => rules::is_on(&value()?),
                    s => ctx.get(s).is_some_and(|v| rules::is_on(&v)),
                };
                if on {
                    leave_out(rule.verl, key, why);
                }
            }
        }
    }
    for (group, keys) in unknown {
        unmapped.push(Unmapped {
            pattern: group,
            keys,
            why: "not a verl key this converter knows (another verl version, or a typo?)".into(),
        });
    }
    Ok(unmapped)
}

/// The spec keys that have no default, each with the verl keys that give it.
fn require(out: &Out) -> Result<()> {
    let needed = [
        ("steps", "trainer.total_training_steps (or trainer.total_epochs with a readable data.train_files)"),
        ("model.path", "actor_rollout_ref.model.path"),
        ("data.train", "data.train_files"),
        ("data.prompts-per-step", "data.train_batch_size"),
        ("advantage.estimator", "algorithm.adv_estimator"),
    ];
    for (key, verl) in needed {
        if !out.has(key) {
            let (table, k) = split_key(key);
            let shown = match table {
                "" => k.to_string(),
                t => format!("[{t}] {k}"),
            };
            bail_input!("{verl}: not set; the tandem spec needs it for {shown}");
        }
    }
    Ok(())
}

/// A spec loader error as one naming the verl key whose value the spec key holds.
fn blame(
    e: anyhow::Error,
    out: &Out,
    lines: &[Option<String>],
    config: &Config,
    origin: &str,
) -> anyhow::Error {
    let msg = format!("{e:#}");
    let by_line = msg
        .strip_prefix(origin)
        .and_then(|r| r.strip_prefix(':'))
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse::<usize>().ok())
        .and_then(|n| lines.get(n - 1).cloned().flatten());
    let by_name = || {
        out.entries.keys().find(|k| match split_key(k) {
            ("", key) => msg.contains(&format!("{origin}: {key} ")),
            (t, key) => msg.contains(&format!("[{t}] {key} ")),
        })
    };
    let Some(spec_key) = by_line.or_else(|| by_name().cloned()) else {
        return e;
    };
    let from = &out.entries[&spec_key].from;
    let shown = match config.leaves.get(from) {
        Some(v) => format!("{from} = {v}"),
        None => from.clone(),
    };
    crate::error::input_error(format!("{shown}: {msg}"))
}

/// The stderr lines naming the keys left out.
pub(crate) fn report(unmapped: &[Unmapped]) -> String {
    if unmapped.is_empty() {
        return String::new();
    }
    let n: usize = unmapped.iter().map(|u| u.keys.len()).sum();
    let mut s = format!(
        "tandem spec from-verl: {n} verl keys have no tandem counterpart and are left out:\n"
    );
    for u in unmapped {
        let what = match u.keys.as_slice() {
            [one] => one.clone(),
            keys if keys.len() <= 3 => keys.join(", "),
            keys => format!("{} ({} keys)", u.pattern, keys.len()),
        };
        s += &format!("  {what}: {}\n", u.why);
    }
    s
}

/// The tandem column of the doc: `[table] key`, a top-level key, or a table.
fn shown_key(k: &str) -> String {
    match split_key(k) {
        ("", key) if TABLES.contains(&key) => format!("`[{key}]`"),
        ("", key) => format!("`{key}`"),
        (t, key) => format!("`[{t}] {key}`"),
    }
}

/// docs/FROM_VERL.md's table of config keys, generated from [`RULES`].
pub fn doc_table() -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let mut s = String::from("| verl key | tandem | notes |\n|---|---|---|\n");
    for r in RULES {
        let (to, note) = match &r.to {
            To::Key { key, how, .. } => (shown_key(key), how.to_string()),
            To::Builtin(t) => ("(always)".to_string(), t.to_string()),
            To::None(why) => ("—".to_string(), why.to_string()),
            To::WhenOn { switch, why } => {
                let when = match *switch {
                    "" => "if on: ".to_string(),
                    s => format!("if `{s}` is on: "),
                };
                ("—".to_string(), format!("{when}{why}"))
            }
        };
        s += &format!("| `{}` | {} | {} |\n", r.verl, to, cell(&note));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// verl's defaults with `overrides` applied.
    fn verl(overrides: &[&str]) -> Config {
        let mut c = Config::load(&fixture("verl/ppo_trainer.yaml")).unwrap();
        for o in overrides {
            c.apply_override(o).unwrap_or_else(|e| panic!("{o}: {e:#}"));
        }
        c
    }

    /// The GRPO quick start's overrides (verl's examples/grpo_trainer/run_qwen2-7b.sh) with
    /// 256 prompts per step, and a step count (the training file is not here to count epochs).
    const GRPO: &[&str] = &[
        "algorithm.adv_estimator=grpo",
        "data.train_files=data/gsm8k/train.parquet",
        "data.val_files=data/gsm8k/test.parquet",
        "data.train_batch_size=256",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "actor_rollout_ref.model.path=models/qwen2-7b",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "algorithm.use_kl_in_reward=False",
        "trainer.logger=[console,wandb]",
        "trainer.n_gpus_per_node=8",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        "trainer.total_training_steps=100",
    ];

    fn spec_of(c: &Config, reward: Option<&str>) -> (toml::Table, Converted) {
        let conv = convert(c, reward, "t.toml").unwrap_or_else(|e| panic!("{e:#}"));
        (toml::from_str(&conv.text).unwrap(), conv)
    }

    fn at<'a>(t: &'a toml::Table, key: &str) -> &'a toml::Value {
        let (table, k) = split_key(key);
        let v = match table {
            "" => t.get(k),
            t2 => t.get(t2).and_then(|x| x.get(k)),
        };
        v.unwrap_or_else(|| panic!("{key} not in the spec"))
    }

    #[test]
    fn grpo_quick_start_maps_to_hand_checked_values() {
        let (s, conv) = spec_of(&verl(GRPO), Some("gsm8k"));
        let int = |k: &str| at(&s, k).as_integer().unwrap();
        // 256 prompts a step, each sampled 5 times: 1,280 sequences.
        assert_eq!(int("data.prompts-per-step"), 256);
        assert_eq!(int("rollout.n"), 5);
        // verl's mini-batch of 64 prompts is 64 × 5 = 320 sequences per optimizer step.
        assert_eq!(int("update.mini-batch-size"), 320);
        assert_eq!(int("steps"), 100);
        assert_eq!(int("gpus"), 8);
        assert_eq!(int("eval.every"), 5);
        assert_eq!(int("checkpoint.every"), 20);
        // rollout.response_length is `${oc.select:data.max_response_length,512}`.
        assert_eq!(int("rollout.max-new-tokens"), 1024);
        assert_eq!(int("rollout.max-prompt-tokens"), 512);
        assert_eq!(at(&s, "update.lr").as_float(), Some(1e-6));
        assert_eq!(at(&s, "update.use-kl-loss").as_bool(), Some(true));
        assert_eq!(at(&s, "update.kl-loss-type").as_str(), Some("low_var_kl"));
        assert_eq!(at(&s, "advantage.estimator").as_str(), Some("grpo"));
        assert_eq!(at(&s, "device").as_str(), Some("cuda"));
        assert_eq!(at(&s, "model.path").as_str(), Some("models/qwen2-7b"));
        assert_eq!(at(&s, "score.reward").as_str(), Some("gsm8k"));
        assert!(
            s["advantage"].get("kl-in-reward").is_none(),
            "false: left out"
        );
        // verl's top_k -1 (all tokens) and top_p 1 are tandem's too.
        assert_eq!(int("rollout.top-k"), -1);
        // Each key's comment names its verl key.
        assert!(
            conv.text.contains("n = 5  # actor_rollout_ref.rollout.n\n"),
            "{}",
            conv.text
        );
        // The spec passes the loader `pipeline run` uses.
        Spec::parse(&conv.text, "t.toml").unwrap();
    }

    /// verl's PPO (GAE with a critic): the critic's keys become the `[critic]` table, and the
    /// spec passes the loader.
    #[test]
    fn a_gae_config_gets_a_critic() {
        let mut overrides = GRPO.to_vec();
        overrides.retain(|o| !o.starts_with("algorithm.adv_estimator"));
        overrides.extend([
            "algorithm.adv_estimator=gae",
            "critic.model.path=models/qwen2-7b",
            "critic.optim.lr=2e-5",
            "critic.cliprange_value=0.3",
            "trainer.critic_warmup=3",
        ]);
        let (t, conv) = spec_of(&verl(&overrides), Some("gsm8k"));
        let critic = t["critic"].as_table().unwrap();
        assert_eq!(critic["lr"].as_float(), Some(2e-5));
        assert_eq!(critic["cliprange-value"].as_float(), Some(0.3));
        // verl's actor starts at step 3 (of 1, 2, 3, ...): two critic-only steps.
        assert_eq!(critic["critic-warmup"].as_integer(), Some(2));
        assert_eq!(critic["model"].as_str(), Some("models/qwen2-7b"));
        // verl's mini-batch of 64 prompts (the actor's, interpolated) × n = 5.
        assert_eq!(critic["mini-batch-size"].as_integer(), Some(320));
        assert_eq!(critic["loss-agg-mode"].as_str(), Some("token-mean"));
        assert_eq!(at(&t, "advantage.estimator").as_str(), Some("gae"));
        assert!(conv.text.contains("\n[critic]\n"), "{}", conv.text);
        Spec::parse(&conv.text, "t.toml").unwrap();
    }

    #[test]
    fn remax_brings_the_rollouts_greedy_baseline() {
        let mut keys = GRPO.to_vec();
        keys.retain(|k| !k.starts_with("algorithm.adv_estimator="));
        keys.push("algorithm.adv_estimator=remax");
        let (s, conv) = spec_of(&verl(&keys), Some("gsm8k"));
        assert_eq!(at(&s, "advantage.estimator").as_str(), Some("remax"));
        assert_eq!(at(&s, "rollout.baseline").as_str(), Some("greedy"));
        assert!(
            conv.text
                .contains("baseline = \"greedy\"  # algorithm.adv_estimator = remax\n"),
            "{}",
            conv.text
        );
        // GRPO has no baseline rows.
        let (s, _) = spec_of(&verl(GRPO), Some("gsm8k"));
        assert!(s["rollout"].get("baseline").is_none());
    }

    #[test]
    fn keys_without_counterpart_are_reported_by_rule() {
        let (_, conv) = spec_of(&verl(GRPO), Some("gsm8k"));
        let find = |p: &str| conv.unmapped.iter().find(|u| u.pattern == p);
        // GRPO runs no critic: its keys with a counterpart are not written, the others are
        // reported as verl's worker options.
        let critic = find("critic.*").expect("critic reported");
        assert!(critic.why.contains("critic worker"), "{}", critic.why);
        assert!(critic.keys.contains(&"critic.strategy".to_string()));
        assert!(!critic.keys.contains(&"critic.optim.lr".to_string()));
        assert!(!conv.text.contains("[critic]"), "{}", conv.text);
        assert!(find("trainer.logger")
            .unwrap()
            .why
            .contains("metrics.jsonl and TensorBoard"));
        assert!(
            find("data.filter_overlong_prompts").is_some(),
            "set to True by the overrides"
        );
        assert!(find("actor_rollout_ref.rollout.gpu_memory_utilization").is_some());
        assert!(find("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu").is_some());
        // Off in verl's defaults, so tandem does the same: not reported.
        for off in [
            "actor_rollout_ref.model.lora_rank",
            "actor_rollout_ref.model.lora_alpha",
            "actor_rollout_ref.rollout.multi_turn.*",
            "reward_model.enable",
        ] {
            assert!(find(off).is_none(), "{off} reported");
        }
        let text = report(&conv.unmapped);
        assert!(
            text.contains("  trainer.logger: tandem logs to metrics.jsonl"),
            "{text}"
        );
        let n = critic.keys.len();
        assert!(
            text.contains(&format!(
                "  critic.* ({n} keys): verl's FSDP/Megatron critic worker"
            )),
            "{text}"
        );
        // Every leaf is accounted for: written, built in, reported or a Hydra class name.
        let mut lora = verl(GRPO);
        lora.apply_override("actor_rollout_ref.model.lora_rank=32")
            .unwrap();
        lora.apply_override("actor_rollout_ref.model.target_modules=[q_proj,v_proj]")
            .unwrap();
        let (spec, conv) = spec_of(&lora, Some("gsm8k"));
        let reported: Vec<&str> = conv.unmapped.iter().map(|u| u.pattern.as_str()).collect();
        assert!(!reported.iter().any(|k| k.contains("lora")), "{reported:?}");
        assert_eq!(at(&spec, "update.lora-rank").as_integer(), Some(32));
        assert_eq!(at(&spec, "update.lora-alpha").as_integer(), Some(16));
        assert_eq!(
            at(&spec, "update.lora-targets").as_str(),
            Some("q_proj,v_proj")
        );
        // A key no rule knows is reported as such.
        lora.apply_override("+trainer.brand_new.knob=1").unwrap();
        let (_, conv) = spec_of(&lora, Some("gsm8k"));
        let u = conv
            .unmapped
            .iter()
            .find(|u| u.pattern == "trainer.*")
            .unwrap();
        assert!(
            u.keys.contains(&"trainer.brand_new.knob".to_string()),
            "{u:?}"
        );
    }

    /// verl's multi-turn GSM8K run (examples/sglang_multiturn: gsm8k_multiturn_grpo.yaml's
    /// `multi_turn` keys and its tool YAML, tool_config/gsm8k_tool_config.yaml, with the class
    /// at verl/tools/gsm8k_tool.py) in a folder laid out as verl's repository.
    fn multi_turn(extra: &[&str]) -> (tempfile::TempDir, Config) {
        let repo = tempfile::tempdir().unwrap();
        let config_dir = repo.path().join("examples/sglang_multiturn/config");
        std::fs::create_dir_all(config_dir.join("tool_config")).unwrap();
        std::fs::create_dir_all(repo.path().join("verl/tools")).unwrap();
        std::fs::write(
            repo.path().join("verl/tools/gsm8k_tool.py"),
            "class Gsm8kTool: ...\n",
        )
        .unwrap();
        let tools = "tools:\n  - class_name: \"verl.tools.gsm8k_tool.Gsm8kTool\"\n    config:\n      type: native\n    tool_schema:\n      type: \"function\"\n      function:\n        name: \"calc_gsm8k_reward\"\n        parameters:\n          type: \"object\"\n          properties:\n            answer:\n              type: \"string\"\n          required: [\"answer\"]\n  - class_name: \"my_pkg.search.SearchTool\"\n    config: {}\n    tool_schema:\n      function:\n        name: \"search\"\n";
        std::fs::write(config_dir.join("tool_config/gsm8k_tool_config.yaml"), tools).unwrap();
        let mut keys = GRPO.to_vec();
        keys.extend([
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
        ]);
        keys.extend(extra);
        let mut c = verl(&keys);
        c.dir = Some(config_dir);
        (repo, c)
    }

    #[test]
    fn verl_multi_turn_keys_become_the_rollouts_tool_keys() {
        let (repo, c) = multi_turn(&[]);
        let (s, conv) = spec_of(&c, Some("gsm8k"));
        let class = repo
            .path()
            .join("verl/tools/gsm8k_tool.py")
            .canonicalize()
            .unwrap();
        let tool = format!("calc_gsm8k_reward=python:{}:Gsm8kTool", class.display());
        assert_eq!(
            at(&s, "rollout.tool"),
            &toml::Value::Array(vec![tool.into()])
        );
        assert_eq!(at(&s, "rollout.max-turns").as_integer(), Some(5));
        // verl's defaults: one call per turn, results cut to 256 characters in the middle.
        assert_eq!(at(&s, "rollout.max-parallel-calls").as_integer(), Some(1));
        assert_eq!(
            at(&s, "rollout.max-tool-response-chars").as_integer(),
            Some(256)
        );
        assert_eq!(
            at(&s, "rollout.tool-response-truncate-side").as_str(),
            Some("middle")
        );
        let notes: Vec<&str> = conv
            .unmapped
            .iter()
            .filter(|u| u.pattern == "actor_rollout_ref.rollout.multi_turn.tool_config_path")
            .map(|u| u.why.as_str())
            .collect();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].starts_with(
                "tool `calc_gsm8k_reward`: tandem makes `Gsm8kTool(config={}, tool_schema=None)`"
            ),
            "{}",
            notes[0]
        );
        assert!(
            notes[1].starts_with(
                "tool `search`: my_pkg/search.py (of `my_pkg.search.SearchTool`) is not in"
            ),
            "{}",
            notes[1]
        );
        let other = conv
            .unmapped
            .iter()
            .find(|u| u.pattern == "actor_rollout_ref.rollout.multi_turn.*")
            .unwrap();
        assert!(other.keys.contains(
            &"actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode".to_string()
        ));

        // max_user_turns U allows U + 1 assistant turns; the smaller limit wins.
        let (_r, c) = multi_turn(&[
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=3",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1000",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
        ]);
        let (s, _) = spec_of(&c, Some("gsm8k"));
        assert_eq!(at(&s, "rollout.max-turns").as_integer(), Some(3));
        assert_eq!(at(&s, "rollout.max-parallel-calls").as_integer(), Some(3));
        assert_eq!(
            at(&s, "rollout.max-tool-response-chars").as_integer(),
            Some(1000)
        );
        assert_eq!(
            at(&s, "rollout.tool-response-truncate-side").as_str(),
            Some("left")
        );
        let (_r, c) = multi_turn(&[
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
        ]);
        assert_eq!(
            at(&spec_of(&c, Some("gsm8k")).0, "rollout.max-turns").as_integer(),
            Some(4)
        );

        // A tool YAML that is not here: no tools, and a note.
        let (_r, c) = multi_turn(&[
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=missing/tools.yaml",
        ]);
        let (s, conv) = spec_of(&c, Some("gsm8k"));
        assert!(s["rollout"].get("tool").is_none());
        let note = conv
            .unmapped
            .iter()
            .find(|u| u.pattern.ends_with("tool_config_path"))
            .unwrap();
        assert!(
            note.why
                .starts_with("missing/tools.yaml is not in the working directory"),
            "{}",
            note.why
        );
        // Off, nothing of it is written.
        let (_r, c) = multi_turn(&["actor_rollout_ref.rollout.multi_turn.enable=False"]);
        let (s, _) = spec_of(&c, Some("gsm8k"));
        for k in [
            "tool",
            "max-turns",
            "max-parallel-calls",
            "max-tool-response-chars",
        ] {
            assert!(s["rollout"].get(k).is_none(), "{k}");
        }
    }

    #[test]
    fn verl_multi_turn_values_tandem_cannot_take_are_refused() {
        for (o, want) in [
            ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss", "multi_turn.format = \"gpt-oss\": tandem reads tool calls in the hermes format only"),
            ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=-2", "multi_turn.max_parallel_calls = -2: expected a whole number >= 1"),
            ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top", "tool_response_truncate_side = \"top\": expected left, right or middle"),
            ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=-1", "max_assistant_turns = -1: expected a whole number >= 1 (0 or null: no limit)"),
        ] {
            let (_r, c) = multi_turn(&[o]);
            let err = convert(&c, Some("gsm8k"), "t.toml").unwrap_err();
            assert!(crate::error::is_input_error(&err), "{o}: {err:#}");
            assert!(format!("{err:#}").contains(want), "{o}: {err:#}");
        }
        let (repo, c) = multi_turn(&[]);
        let yaml = repo
            .path()
            .join("examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml");
        std::fs::write(&yaml, "tools:\n  - config: {}\n").unwrap();
        let err = format!("{:#}", convert(&c, Some("gsm8k"), "t.toml").unwrap_err());
        assert!(
            err.contains("gsm8k_tool_config.yaml: tool 0: no `class_name`"),
            "{err}"
        );
    }

    #[test]
    fn dapo_recipe_keys_map_to_the_dapo_spec_keys() {
        let mut o = GRPO.to_vec();
        o.extend([
            "+algorithm.filter_groups.enable=True",
            "+algorithm.filter_groups.metric=acc",
            "+algorithm.filter_groups.max_num_gen_batches=0",
            "+data.gen_batch_size=384",
            "+reward_model.overlong_buffer.enable=True",
            "+reward_model.overlong_buffer.len=256",
            "+reward_model.overlong_buffer.penalty_factor=1.0",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
        ]);
        let (s, conv) = spec_of(&verl(&o), Some("gsm8k"));
        assert_eq!(at(&s, "algorithm.filter-groups").as_bool(), Some(true));
        assert_eq!(at(&s, "algorithm.filter-metric").as_str(), Some("acc"));
        assert_eq!(
            at(&s, "algorithm.max-num-gen-batches").as_integer(),
            Some(0),
            "<= 0: no cap"
        );
        assert_eq!(
            at(&s, "algorithm.prompts-per-round").as_integer(),
            Some(384)
        );
        assert_eq!(at(&s, "score.overlong-buffer-len").as_integer(), Some(256));
        assert_eq!(
            at(&s, "score.overlong-penalty-factor").as_float(),
            Some(1.0)
        );
        assert_eq!(at(&s, "update.clip-ratio-high").as_float(), Some(0.28));
        assert_eq!(at(&s, "update.rollout-is").as_str(), Some("token"));
        assert_eq!(at(&s, "update.rollout-is-threshold").as_float(), Some(3.0));
        assert!(s["update"].get("use-kl-loss").is_none());
        // Off, the same keys write nothing.
        let (s, _) = spec_of(&verl(GRPO), Some("gsm8k"));
        assert!(s.get("algorithm").is_none() && s["score"].get("overlong-buffer-len").is_none());
        assert!(
            s["update"].get("rollout-is-threshold").is_none(),
            "without rollout_is"
        );
        Spec::parse(&conv.text, "t.toml").unwrap();
    }

    #[test]
    fn overrides_apply_in_order_over_the_yaml() {
        let mut o = GRPO.to_vec();
        o.extend([
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.rollout.n=8",
            "++actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=256",
        ]);
        let (s, _) = spec_of(&verl(&o), Some("gsm8k"));
        assert_eq!(at(&s, "update.lr").as_float(), Some(3e-6));
        assert_eq!(at(&s, "rollout.n").as_integer(), Some(4));
        assert_eq!(at(&s, "update.mini-batch-size").as_integer(), Some(64 * 4));
        // The rollout's own key wins over data.max_response_length.
        assert_eq!(at(&s, "rollout.max-new-tokens").as_integer(), Some(256));
        // Deleting a key leaves tandem's default.
        o.push("~actor_rollout_ref.actor.optim.lr");
        let (s, _) = spec_of(&verl(&o), Some("gsm8k"));
        assert!(s["update"].get("lr").is_none());
    }

    #[test]
    fn epochs_and_reward_come_from_the_training_file() {
        // 5 rows of verl's GSM8K (data_source openai/gsm8k), 2 prompts a step: 2 full batches
        // an epoch (verl drops the last partial one), 3 epochs: 6 steps.
        let train = fixture("verl_gsm8k/train.parquet");
        let mut o = GRPO.to_vec();
        let files = format!("data.train_files={}", train.display());
        o.extend([
            files.as_str(),
            "data.train_batch_size=2",
            "trainer.total_epochs=3",
            "trainer.total_training_steps=null",
        ]);
        let (s, conv) = spec_of(&verl(&o), None);
        assert_eq!(at(&s, "steps").as_integer(), Some(6));
        assert_eq!(at(&s, "score.reward").as_str(), Some("gsm8k"));
        assert!(conv
            .text
            .contains("reward = \"gsm8k\"  # data_source (verl's default reward)"));
        // A custom reward function is carried as a python: reward.
        let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/rewards/gsm8k_format.py");
        let path = format!("custom_reward_function.path={}", py.display());
        o.extend([path.as_str(), "custom_reward_function.name=compute_score"]);
        let (s, _) = spec_of(&verl(&o), None);
        let want = format!("python:{}:compute_score", py.display());
        assert_eq!(at(&s, "score.reward").as_str(), Some(want.as_str()));
        // Not readable (GRPO's own `data/gsm8k/train.parquet` is, after `make data`): the steps
        // and the reward must be given.
        let gone = "data.train_files=/nonexistent/gsm8k/train.parquet";
        let mut o = GRPO.to_vec();
        o.extend(["trainer.total_training_steps=null", gone]);
        let e = convert(&verl(&o), Some("gsm8k"), "t.toml").unwrap_err();
        assert!(
            format!("{e:#}")
                .contains("trainer.total_epochs = 15: trainer.total_training_steps is null"),
            "{e:#}"
        );
        let o = [GRPO, &[gone]].concat();
        let e = convert(&verl(&o), None, "t.toml").unwrap_err();
        assert!(
            format!("{e:#}").contains("custom_reward_function.path is null"),
            "{e:#}"
        );
        assert!(format!("{e:#}").contains("--reward"), "{e:#}");
    }

    #[test]
    fn values_tandem_refuses_name_the_verl_key() {
        for (bad, want) in [
            (
                "actor_rollout_ref.rollout.n=0",
                "actor_rollout_ref.rollout.n = 0: ",
            ),
            (
                "actor_rollout_ref.rollout.temperature=-1",
                "actor_rollout_ref.rollout.temperature = -1: ",
            ),
            (
                "data.train_batch_size=abc",
                "data.train_batch_size = \"abc\": ",
            ),
            ("data.train_batch_size=0", "data.train_batch_size = 0: "),
            (
                "algorithm.adv_estimator=grpo_passk",
                "algorithm.adv_estimator = \"grpo_passk\": ",
            ),
            (
                "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                "loss_mode = \"clip_cov\": ",
            ),
            (
                "actor_rollout_ref.actor.optim.lr=fast",
                "actor_rollout_ref.actor.optim.lr = \"fast\": ",
            ),
            ("trainer.nnodes=2", "trainer.nnodes = 2: "),
            ("data.truncation=middle", "data.truncation = \"middle\": "),
            (
                "actor_rollout_ref.actor.use_kl_loss=maybe",
                "actor_rollout_ref.actor.use_kl_loss = \"maybe\": expected true or false",
            ),
            (
                "data.train_files=[a.parquet,b.parquet]",
                "data.train_files = [\"a.parquet\",\"b.parquet\"]: 2 files",
            ),
            (
                "actor_rollout_ref.actor.optim.lr_scheduler_type=wsd",
                "lr_scheduler_type = \"wsd\": ",
            ),
        ] {
            let mut o = GRPO.to_vec();
            o.push(bad);
            let e = convert(&verl(&o), Some("gsm8k"), "t.toml").unwrap_err();
            assert!(crate::error::is_input_error(&e), "{bad}: {e:#}");
            assert!(format!("{e:#}").contains(want), "{bad}: {e:#}");
        }
        let mut o = GRPO.to_vec();
        o.push("~actor_rollout_ref.model.path");
        let e = convert(&verl(&o), Some("gsm8k"), "t.toml").unwrap_err();
        assert!(
            format!("{e:#}").starts_with("actor_rollout_ref.model.path: not set"),
            "{e:#}"
        );
    }

    #[test]
    fn the_doc_batch_table_names_real_columns() {
        use crate::batch::schema as c;
        let known = [
            c::UID,
            c::PROMPT_UID,
            c::DATA_SOURCE,
            c::PROMPT,
            c::GROUND_TRUTH,
            c::REWARD_MODEL,
            c::EXTRA_INFO,
            c::PROMPT_IDS,
            c::RESPONSE_IDS,
            c::RESPONSE_MASK,
            c::RESPONSE_TEXT,
            c::FINISH_REASON,
            c::ROLLOUT_LOGPROBS,
            c::SCORE,
            c::OLD_LOGPROBS,
            c::REF_LOGPROBS,
            c::TOKEN_REWARDS,
            c::ADVANTAGES,
            c::RETURNS,
            c::VALUES,
            c::BASELINE_SCORE,
            c::IS_BASELINE,
            c::NUM_TURNS,
            crate::stage::ref_logprob::ENTROPY,
            "score_<name>",
        ];
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/FROM_VERL.md"),
        )
        .unwrap();
        let table = doc
            .split("| verl (`batch[...]`")
            .nth(1)
            .expect("the batch table");
        let mut n = 0;
        for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
            let cells: Vec<&str> = row.split(" | ").collect();
            // Our column names in the second cell (the first backticked words of the third).
            let ours: Vec<&str> = cells[1].split('`').skip(1).step_by(2).collect();
            for name in ours {
                assert!(
                    known.contains(&name),
                    "docs/FROM_VERL.md names a column `{name}` that the contract has not"
                );
                n += 1;
            }
        }
        assert!(n >= 15, "{n} columns found");
    }

    #[test]
    fn the_doc_table_is_the_rules() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/FROM_VERL.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let (start, end) = (
            "<!-- config table: generated from src/lib/pipeline/from_verl/rules.rs -->\n",
            "<!-- end of the config table -->",
        );
        let a = doc.find(start).expect("the start marker") + start.len();
        let b = doc[a..].find(end).expect("the end marker") + a;
        let want = doc_table();
        if doc[a..b] != want {
            // TANDEM_BLESS=1 writes the table from the rules.
            if std::env::var_os("TANDEM_BLESS").is_some() {
                std::fs::write(&path, format!("{}{want}{}", &doc[..a], &doc[b..])).unwrap();
            }
            panic!("docs/FROM_VERL.md's table differs from the rules; rerun with TANDEM_BLESS=1 to rewrite it");
        }
    }
}
