//! What `pipeline run` checks before anything runs, after every stage command went through its
//! stage's own flag checks ([`Plan::check_commands`]): that what the spec names is there and
//! holds what the stages will read, so a run does not load a model, start a daemon and evaluate
//! step 0 only to fail at its first `score` or `rollout`.
//!
//! - `[score] reward`: a `python:FILE[:FUNC]` file is imported by the reward driver and its
//!   function looked up (as `score` will, with `[score] python` and `reward-kwargs`); a `cmd:`
//!   program must be found (a path, or a name on `PATH`).
//! - `[model] path` (also on a resumed run: it is the reference unless `[model] ref` is set, and
//!   the tokenizer the prompts are checked with): config.json, weights, tokenizer.json, and the
//!   chat template when prompts are rendered with it (no `raw-prompt`); `[model] ref`: config
//!   and weights, when the spec needs reference log-probs.
//! - `[data] train` and, when evaluating, `[data] val` (its first `[eval] limit` rows): the
//!   prompt column (`prompt-key`) read and every prompt rendered and tokenized as `rollout`
//!   will (empty prompts, prompts over `max-prompt-tokens` without `truncate = "left"`, ids
//!   past the model's vocabulary), and a ground truth in every row when the reward is a
//!   built-in rule.
//!
//! - `[advantage] estimator = "remax"`: the training rollout adds the greedy baseline it
//!   subtracts (`[rollout] baseline = "greedy"`).
//! - `[advantage] estimator = "gae"` needs a `[critic]` (and a `[critic]` needs GAE); `[critic]
//!   model` (default `[model] path`): config and weights, of the policy's vocabulary.
//!
//! - `device = "cuda"` (or `--device cuda`): the CUDA driver loads and shows a GPU, and at
//!   least `gpus` of them.
//!
//! Every problem is an input error (exit 2) naming the spec key and the file, column or row.

use super::plan::Plan;
use super::spec::Device;
use crate::bail_input;
use crate::batch::Batch;
use crate::data::{ChatTemplate, PromptDataset};
use crate::error::input_error;
use crate::model::checkpoint::ModelDir;
use crate::model::safetensors::{INDEX_FILE, SINGLE_FILE};
use crate::parallel::nccl::visible_gpus;
use crate::reward::external::python_argv;
use crate::reward::{Options, RewardSpec};
use crate::stage::common::resolve_model;
use crate::stage::rollout::{tokenize_prompts, PromptLimits, RolloutArgs};
use crate::stage::turns::tools_from_specs;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

/// Lines of a failed import's stderr shown in the message.
const STDERR_TAIL: usize = 12;

/// Checks the reward, the models and the datasets of `plan`'s spec; returns the training set
/// (read once here, sampled from by the runner).
pub fn check(plan: &Plan) -> Result<Batch> {
    let spec = &plan.spec;
    let st = &plan.stages;
    check_device(spec.device, spec.gpus)?;
    check_baseline(plan)?;
    if let Some(agent) = super::agent::agent_of(plan)? {
        agent.check_program()?;
    }

    let score = &st.score.args;
    let reward = RewardSpec::parse(&score.reward)?;
    let at = format!("[score] reward = {:?}", score.reward);
    check_reward(&reward, &score.config()?.options, &at)?;

    let model = &spec.model.path;
    let key = "[model] path";
    let dir = model_dir(key, model)?;
    let cfg = ModelDir::load_config(&dir).with_context(|| key.to_string())?;
    let tokenizer = Tokenizer::from_dir(&dir).with_context(|| key.to_string())?;
    let evaluates = spec.eval.every > 0;
    let renders = !st.rollout.args.raw_prompt || (evaluates && !st.eval.args.raw_prompt);
    let template = match renders {
        true => Some(ChatTemplate::from_dir(&dir).with_context(|| {
            format!("{key} (its chat template renders the prompts; set raw-prompt = true in [rollout] to feed them as plain text)")
        })?),
        false => None,
    };
    if plan.needs_ref() {
        if let Some(r) = &spec.model.reference {
            let key = "[model] ref";
            let dir = model_dir(key, r)?;
            ModelDir::load_config(&dir).with_context(|| key.to_string())?;
        }
    }

    check_critic(plan, cfg.vocab_size)?;

    let prompts = |key: &str, path: &Path, table: &str, args: &RolloutArgs| {
        let template = (!args.raw_prompt).then_some(template.as_ref()).flatten();
        let tokens = Tokens {
            tokenizer: &tokenizer,
            template,
            vocab_size: cfg.vocab_size,
            table,
        };
        check_prompts(key, path, args, &tokens, &reward)
    };
    let train = prompts(
        "[data] train",
        &spec.data.train,
        "[rollout]",
        &st.rollout.args,
    )?;
    if evaluates {
        if let Some(val) = &spec.data.val {
            prompts("[data] val", val, "[eval]", &st.eval.args)?;
        }
    }
    let b = train.batch();
    Ok(Batch {
        path: b.path.clone(),
        data: b.data.clone(),
        meta: b.meta.clone(),
    })
}

/// ReMax subtracts the score of each prompt's greedy response, which only the rollout can add
/// (without it the run would stop at step 1's `advantage`).
fn check_baseline(plan: &Plan) -> Result<()> {
    let estimator = &plan.stages.advantage.args.estimator;
    if estimator == "remax" && plan.stages.rollout.args.baseline.is_none() {
        bail_input!(
            "[advantage] estimator = \"remax\" subtracts the score of each prompt's greedy response, which the rollout adds as a baseline row: add baseline = \"greedy\" to [rollout]"
        );
    }
    Ok(())
}

/// The critic against the estimator: GAE reads a critic's values and needs a `[critic]`; a
/// `[critic]` is only read by GAE; its model is there, of the policy's vocabulary; it trains
/// on one device (no `gpus = N` yet).
fn check_critic(plan: &Plan, vocab: usize) -> Result<()> {
    let spec = &plan.spec;
    let estimator = plan.stages.advantage.args.estimator.as_str();
    let Some(model) = spec.critic_model() else {
        if estimator == "gae" {
            bail_input!(
                "[advantage] estimator = \"gae\" needs a critic's values, and the spec has no [critic]: add a [critic] table (its model defaults to the policy's, with a zero value head; e.g. `[critic]` with `lr = 1e-5`), or choose another estimator"
            );
        }
        return Ok(());
    };
    if estimator != "gae" {
        bail_input!(
            "[critic]: only [advantage] estimator = \"gae\" reads a critic's values, not \"{estimator}\"; set estimator = \"gae\" or remove [critic]"
        );
    }
    let key = "[critic] model";
    let dir = model_dir(key, model)?;
    let cfg = ModelDir::load_config(&dir).with_context(|| key.to_string())?;
    if cfg.vocab_size != vocab {
        bail_input!(
            "{key} = {}: vocabulary of {} tokens, the policy's has {vocab}",
            model.display(),
            cfg.vocab_size
        );
    }
    Ok(())
}

/// With `device = "cuda"`, the GPUs the model stages will open are there (the driver is asked
/// for its device count only: no context is made in the runner).
fn check_device(device: Device, gpus: u64) -> Result<()> {
    if device != Device::Cuda {
        return Ok(());
    }
    let key = "device = \"cuda\"";
    let n = visible_gpus().map_err(|e| input_error(format!("{key}: {e:#}")))?;
    if n == 0 {
        bail_input!("{key}: the CUDA driver shows no GPU; use --device cpu");
    }
    if (n as u64) < gpus {
        bail_input!("{key} with gpus = {gpus}: only {n} GPU(s) visible");
    }
    Ok(())
}

/// A model directory (or sync-weights pointer) the stages will load: it resolves to a
/// directory with config.json and weights (a full load is left to the stages). Returns the
/// directory.
fn model_dir(key: &str, path: &Path) -> Result<std::path::PathBuf> {
    if !path.exists() {
        bail_input!("{key} = {}: no such file or directory", path.display());
    }
    let dir = resolve_model(path).with_context(|| key.to_string())?.dir;
    if !dir.join(SINGLE_FILE).is_file() && !dir.join(INDEX_FILE).is_file() {
        bail_input!(
            "{key} = {}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} in {}",
            path.display(),
            dir.display()
        );
    }
    Ok(dir)
}

/// How prompts become tokens: the policy's tokenizer and chat template (None: raw prompts),
/// and the spec table whose flags rollout takes (for messages).
struct Tokens<'a> {
    tokenizer: &'a Tokenizer,
    template: Option<&'a ChatTemplate>,
    vocab_size: usize,
    table: &'a str,
}

/// The prompt dataset `rollout` will read with `args`, opened and checked as rollout does it
/// (its first `--limit` rows), plus the ground truth a built-in reward compares with.
fn check_prompts(
    key: &str,
    path: &Path,
    args: &RolloutArgs,
    t: &Tokens,
    reward: &RewardSpec,
) -> Result<PromptDataset> {
    if !path.exists() {
        bail_input!("{key} = {}: no such file or directory", path.display());
    }
    let ds = PromptDataset::open_with_key(path, &args.prompt_key)
        .with_context(|| {
            format!(
                "{key} (prompts in column `{}`; the {} prompt-key)",
                args.prompt_key, t.table
            )
        })?
        .with_system(args.system_prompt.as_deref());
    let n = args.limit.unwrap_or(ds.len()).min(ds.len());
    // The tools start as rollout starts them (a missing program or class stops here); their
    // schemas go into the prompts.
    let timeout = std::time::Duration::from_secs_f64(args.tool_timeout);
    let tools = tools_from_specs(&args.tool, timeout)
        .with_context(|| format!("{key}: {} tool = {:?}", t.table, args.tool))?;
    if tools.is_some() {
        // The rows' tool arguments, as rollout reads them.
        ds.tools_kwargs().with_context(|| key.to_string())?;
    }
    let schemas = args.prompt_schemas(tools.as_deref());
    let limits = PromptLimits {
        prompt_key: &args.prompt_key,
        max_prompt_tokens: args.max_prompt_tokens,
        truncate: args.truncate,
        tools: &schemas,
    };
    tokenize_prompts(&ds, n, t.tokenizer, t.template, t.vocab_size, &limits)
        .with_context(|| format!("{key} (tokenized with the {} flags)", t.table))?;
    if reward.needs_ground_truth() {
        let label = reward.label(&Options::default());
        if !ds.has_ground_truth() {
            bail_input!(
                "{key} = {}: no ground truth (a column 'ground_truth' or verl's reward_model.ground_truth), which the reward `{label}` compares the responses with",
                path.display()
            );
        }
        if let Some(i) = (0..n).find(|&i| ds.row(i).ground_truth.is_none()) {
            bail_input!(
                "{key} = {}, row {i}: the ground truth is null; the reward `{label}` needs one in every row",
                path.display()
            );
        }
    }
    Ok(ds)
}

/// An external reward can start: the `cmd:` program is found, the `python:` file imports and
/// has the function (run through the same driver `score` uses, on no rows).
pub(super) fn check_reward(reward: &RewardSpec, opts: &Options, at: &str) -> Result<()> {
    match reward {
        RewardSpec::Cmd { argv, .. } => {
            if !find_program(&argv[0]) {
                let place = match argv[0].contains('/') {
                    true => "no executable file there (relative to the current directory)",
                    false => "not found on PATH",
                };
                bail_input!("{at}: the program `{}`: {place}", argv[0]);
            }
            Ok(())
        }
        RewardSpec::Python { file, func } => import_python(file, func, opts, at),
        _ => Ok(()),
    }
}

/// Whether `program` names an executable file: a path (with a `/`), or a name on `PATH`.
fn find_program(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| executable(&d.join(program))))
}

/// Runs the reward driver on `file`/`func` with no rows: it imports the file and looks the
/// function up, then ends at once on its empty input.
fn import_python(file: &Path, func: &str, opts: &Options, at: &str) -> Result<()> {
    use wait_timeout::ChildExt;
    let argv = python_argv(&opts.python, file, func, &opts.reward_kwargs);
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            input_error(format!(
                "{at}: cannot start the interpreter `{}` ([score] python): {e}",
                argv[0]
            ))
        })?;
    // Read stderr aside, so that a chatty import cannot fill the pipe and stall.
    let mut stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let Some(status) = child.wait_timeout(opts.timeout)? else {
        let _ = child.kill();
        let _ = child.wait();
        bail_input!(
            "{at}: importing {} took longer than [score] timeout-ms ({} ms); it was stopped",
            file.display(),
            opts.timeout.as_millis()
        );
    };
    if status.success() {
        return Ok(());
    }
    let text = reader.join().unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail: Vec<String> = lines[lines.len().saturating_sub(STDERR_TAIL)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect();
    bail_input!(
        "{at}: `{}` could not load `{func}` from {} ({status}):\n{}",
        argv[0],
        file.display(),
        tail.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_on_path_or_by_path() {
        assert!(find_program("sh"));
        assert!(find_program("/bin/sh"));
        assert!(!find_program("tandem-no-such-program"));
        assert!(!find_program("./no/such/file"));
        // A file that is not executable is not a program.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.sh");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        assert!(!find_program(f.to_str().unwrap()));
    }

    #[test]
    fn python_rewards_are_imported_and_their_function_found() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.py");
        std::fs::write(
            &file,
            "import json\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
        )
        .unwrap();
        let opts = Options::default();
        let reward = |f: &str| RewardSpec::parse(&format!("python:{f}")).unwrap();
        let path = file.display().to_string();
        check_reward(&reward(&path), &opts, "at").unwrap();
        let err = check_reward(&reward(&format!("{path}:nope")), &opts, "at").unwrap_err();
        assert!(crate::error::is_input_error(&err));
        let msg = format!("{err:#}");
        assert!(
            msg.starts_with("at: `python3` could not load `nope`"),
            "{msg}"
        );
        assert!(msg.contains("has no function named 'nope'"), "{msg}");

        std::fs::write(&file, "import no_such_module_here\n").unwrap();
        let msg = format!(
            "{:#}",
            check_reward(&reward(&path), &opts, "at").unwrap_err()
        );
        assert!(
            msg.contains("No module named 'no_such_module_here'"),
            "{msg}"
        );

        let bad = Options {
            python: "no-such-python".into(),
            ..Options::default()
        };
        std::fs::write(&file, "def compute_score(**k):\n    return 0\n").unwrap();
        let msg = format!(
            "{:#}",
            check_reward(&reward(&path), &bad, "at").unwrap_err()
        );
        assert!(
            msg.contains("cannot start the interpreter `no-such-python`"),
            "{msg}"
        );

        let msg = format!(
            "{:#}",
            check_reward(
                &RewardSpec::parse("cmd:tandem-no-such-program --x").unwrap(),
                &opts,
                "at"
            )
            .unwrap_err()
        );
        assert_eq!(
            msg,
            "at: the program `tandem-no-such-program`: not found on PATH"
        );
    }
}
