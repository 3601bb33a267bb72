//! The pipeline runner: `pipeline run pipelines/NAME.toml` runs the stages step after step
//! in a run directory, resumes after a crash, and records metrics; `tandem plot` and
//! `tandem inspect` look at what it wrote.
//!
//! - `spec`: the TOML spec (stage keys are the stage flags).
//! - `preflight`: what is checked before anything runs (reward, models, datasets).
//! - `rundir`: the run directory's layout, `state.json`, spec changes, atomic writes.
//! - `agent`, `agent_spec`: a step whose rollout is the user's agent against `tandem serve`.
//! - `sampler`: the seeded prompt sampler whose cursor is part of the state.
//! - `plan`: a step's tasks (stage command lines, the runner's own tasks) from the spec and
//!   the state, as plain data.
//! - `runner`: the step loop with its state (stage commands, `commands.sh`, resume, rewinds).
//! - `daemons`: the run's warm daemon or daemon group (`daemon = true`).
//! - `placement`: rollout and training on separate GPUs (`[placement]`), the weight transfer
//!   between them and one step off-policy.
//! - `chores`: pruning checkpoints, the adaptive-KL state, the eval and step lines.
//! - `dynamic`: DAPO's dynamic sampling, the rounds of a step that keeps only varied groups.
//! - `console`: one line per step on the console, the stages' output in `pipeline.log`.
//! - `metrics`: `metrics.jsonl` and `eval.jsonl` lines.
//! - `tensorboard`: the same numbers as TensorBoard event files in the run directory.
//! - `plot`, `inspect`: looking at a run.
//! - `from_verl`: `tandem spec from-verl`, a spec from a verl config and its overrides.

pub(crate) mod agent;
pub(crate) mod agent_spec;
pub(crate) mod asynchronous;
pub(crate) mod chores;
pub(crate) mod console;
pub(crate) mod daemons;
pub(crate) mod dynamic;
pub mod from_verl;
pub mod inspect;
pub mod metrics;
pub(crate) mod placement;
pub(crate) mod plan;
pub mod plot;
pub(crate) mod preflight;
pub(crate) mod rundir;
pub(crate) mod runner;
pub mod sampler;
pub(crate) mod spec;
pub mod staleness;
pub mod tensorboard;

use crate::bail_input;
use anyhow::Result;
use clap::Args;
use plan::shell_quote;
use rundir::{RunDir, State, STATE_VERSION};
use runner::Runner;
use spec::{Spec, SpecChange};
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
#[command(about = "Run (or continue) an RL pipeline described by a spec file")]
pub struct RunArgs {
    /// The spec, e.g. pipelines/demo.toml.
    pub spec: PathBuf,
    /// Run directory [default: runs/<spec file name>]. An existing run continues where it
    /// stopped.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Number of training steps, overriding the spec's `steps` (a finished run can be extended).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Device of the model stages, overriding the spec's `device`.
    #[arg(long, value_enum)]
    pub device: Option<spec::Device>,
    /// Print the stage commands that would run, run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Insist on continuing an existing run (fail when the run directory has none).
    #[arg(long)]
    pub resume: bool,
    /// Continue an existing run under a spec that changed since it began (a fixed value, a
    /// new flag); the change is recorded in RUN/spec-changes.jsonl. The prompt sampler's keys
    /// (`seed`, `[data] prompts-per-step`, `shuffle`) cannot change.
    #[arg(long)]
    pub allow_spec_change: bool,
    /// Also show every stage's command and output on the console (they always go to
    /// RUN/pipeline.log).
    #[arg(short, long)]
    pub verbose: bool,
}

/// Spec keys a run cannot change: the prompt sampler's position depends on them.
const SAMPLER_KEYS: [&str; 3] = ["seed", "data.prompts-per-step", "data.shuffle"];

/// `pipeline run`.
pub fn run(args: RunArgs) -> Result<()> {
    let spec = load_spec(&args)?;
    let run = RunDir::new(run_root(&args));
    let existing = run.exists();
    let state = open_state(&args, &run, existing)?;
    let done = state.steps_done;
    if existing && done >= spec.steps {
        say_complete(&args, &run, done);
        return Ok(());
    }
    let changes = match existing {
        true => spec.changes_from(&Spec::load(&run.spec_path())?),
        false => Vec::new(),
    };
    if !changes.is_empty() {
        check_changes(&changes, &args, &run)?;
    }

    let bins = runner::bin_dir()?;
    let spec_path = args.spec.display().to_string();
    let mut runner = Runner::new(spec, run, bins, state)?;
    runner.rerun = command_line(&args, &runner.plan.run.root, true);
    runner.console = console::Console::new(args.verbose);
    // Every stage command is checked by its stage, then the files the spec names, before the
    // run directory is touched.
    runner
        .check_commands()
        .map_err(|e| e.context(spec_path.clone()))?;
    let train = preflight::check(&runner.plan).map_err(|e| e.context(spec_path))?;
    if args.dry_run {
        for (step, task) in runner.remaining() {
            println!("{}", runner.plan.describe(step, &task));
        }
        return Ok(());
    }

    if !existing {
        runner.state.train_rows = train.num_rows() as u64;
        let run = &runner.plan.run;
        std::fs::create_dir_all(&run.root)?;
        rundir::write_atomic(
            &run.spec_path(),
            spec_for_file(&runner.plan.spec).as_bytes(),
        )?;
        run.save_state(&runner.state)?;
    }
    runner.set_train_set(train);
    let run = runner.plan.run.clone();
    let _lock = run.lock()?;
    runner.console.open_log(&run.log_path())?;
    if !changes.is_empty() {
        record_changes(&runner, &args, &changes)?;
    }
    // The resolved spec is the one the run continues under (a new step count, a change).
    rundir::write_atomic(
        &run.spec_path(),
        spec_for_file(&runner.plan.spec).as_bytes(),
    )?;
    say_start(&runner, existing.then_some(done));
    let data = &runner.plan.spec.data;
    if let Some(w) = repeats_warning(data.prompts_per_step, runner.state.train_rows, &data.train) {
        runner.console.say(&w);
    }
    runner.run()?;
    runner
        .console
        .say(&finished_message(&run, runner.plan.spec.steps));
    Ok(())
}

/// A warning when a step asks for more prompts than the training set has: the sampler then
/// draws some prompts more than once in the same step.
fn repeats_warning(per_step: u64, rows: u64, train: &Path) -> Option<String> {
    (per_step > rows).then(|| {
        format!(
            "pipeline: warning: prompts-per-step = {per_step} but {} has {rows} rows: each step repeats prompts (about {:.1} times each)",
            train.display(),
            per_step as f64 / rows.max(1) as f64
        )
    })
}

/// The last words of a run: where its results are, naming only the files it wrote (a run
/// without `[eval]` has no eval.jsonl).
fn finished_message(run: &RunDir, steps: u64) -> String {
    let mut msg = format!("pipeline: finished {steps} steps in {}", run.root.display());
    let files = [
        ("metrics", run.metrics_path()),
        ("eval", run.eval_path()),
        ("log", run.log_path()),
    ];
    for (what, path) in files.iter().filter(|(_, p)| p.is_file()) {
        msg += &format!("\n  {:<8} {}", format!("{what}:"), path.display());
    }
    msg + &format!("\n  plot:    tandem plot {}", run.root.display())
}

/// The spec with the command line's overrides (`--steps`, `--device`).
fn load_spec(args: &RunArgs) -> Result<Spec> {
    let mut spec = Spec::load(&args.spec)?;
    if let Some(n) = args.steps {
        if n == 0 {
            bail_input!("--steps must be at least 1");
        }
        spec.steps = n;
    }
    if let Some(d) = args.device {
        spec.device = d;
    }
    Ok(spec)
}

/// The run directory: `--run-dir`, else `runs/<spec file name>`.
fn run_root(args: &RunArgs) -> PathBuf {
    match &args.run_dir {
        Some(d) => d.clone(),
        None => {
            let stem = args.spec.file_stem().unwrap_or_default();
            Path::new("runs").join(stem)
        }
    }
}

/// The state of an existing run, or a fresh one where a run may begin (no `--resume`, an empty
/// or missing directory).
fn open_state(args: &RunArgs, run: &RunDir, existing: bool) -> Result<State> {
    if existing {
        return run.load_state();
    }
    if args.resume {
        bail_input!(
            "--resume: {} holds no run (no state.json); leave out --resume to start one",
            run.root.display()
        );
    }
    if run.root.is_dir() && std::fs::read_dir(&run.root)?.next().is_some() {
        bail_input!(
            "{}: exists, is not empty and holds no run (no state.json); pick another --run-dir",
            run.root.display()
        );
    }
    Ok(fresh_state(0))
}

/// A run whose every step is done: nothing to do, and how to run more steps.
fn say_complete(args: &RunArgs, run: &RunDir, done: u64) {
    let asked = match args.steps {
        Some(n) if n < done => format!(" (--steps {n} asks for fewer)"),
        _ => String::new(),
    };
    eprintln!(
        "pipeline: {} is complete: {done} steps done{asked}; nothing to do. To run more steps: {} --steps N (N > {done})",
        run.root.display(),
        command_line(args, &run.root, false)
    );
}

/// Records the spec's changes in RUN/spec-changes.jsonl (from the next step, after its
/// finished tasks) and says so.
fn record_changes(runner: &Runner, args: &RunArgs, changes: &[SpecChange]) -> Result<()> {
    let run = &runner.plan.run;
    let step = runner.state.steps_done + 1;
    let finished = runner
        .state
        .current
        .as_ref()
        .filter(|c| c.step == step)
        .map(|c| c.done.clone())
        .unwrap_or_default();
    run.record_spec_change(&args.spec, step, &finished, changes)?;
    runner.console.say(&format!(
        "pipeline: continuing {} under the changed spec from step {step} (recorded in {}): {}",
        run.root.display(),
        run.spec_changes_path().display(),
        spec::describe_changes(changes)
    ));
    Ok(())
}

/// The run's first line: how many steps (a new run) or after which step it continues, and
/// where the stages' output goes.
fn say_start(runner: &Runner, continued_after: Option<u64>) {
    let run = &runner.plan.run;
    let shown = match runner.console.verbose {
        true => "also shown here (-v)",
        false => "-v shows it here",
    };
    let log = run.log_path();
    if let Some(done) = continued_after {
        runner.console.say(&format!(
            "pipeline: continuing {} after step {done}; stage output in {} ({shown})",
            run.root.display(),
            log.display()
        ));
    } else {
        runner.console.say(&format!(
            "pipeline: {} steps in {}; stage output in {} ({shown})",
            runner.plan.spec.steps,
            run.root.display(),
            log.display()
        ));
    }
}

/// The `pipeline run` command line that continues this run (`with_steps`: with the `--steps`
/// given), as the user can paste it: the program as invoked, the spec, the run directory and
/// the overrides given.
fn command_line(args: &RunArgs, root: &Path, with_steps: bool) -> String {
    let program = std::env::args().next().unwrap_or_else(|| "pipeline".into());
    let mut words = vec![
        program,
        "run".into(),
        args.spec.display().to_string(),
        "--run-dir".into(),
        root.display().to_string(),
    ];
    if let Some(n) = args.steps.filter(|_| with_steps) {
        words.extend(["--steps".into(), n.to_string()]);
    }
    if let Some(d) = args.device {
        words.extend(["--device".into(), d.as_str().into()]);
    }
    let words: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
    words.join(" ")
}

/// A run continues under a changed spec only when asked (`--allow-spec-change`), and never with
/// another prompt sampler.
fn check_changes(changes: &[SpecChange], args: &RunArgs, run: &RunDir) -> Result<()> {
    let fixed: Vec<SpecChange> = changes
        .iter()
        .filter(|c| SAMPLER_KEYS.contains(&c.key.as_str()))
        .cloned()
        .collect();
    if !fixed.is_empty() {
        bail_input!(
            "{}: the spec changed since the run began ({}); the prompt sampler's position depends on {}, so this run cannot continue under another value: restore it, or start a new run with another --run-dir",
            run.root.display(),
            spec::describe_changes(&fixed),
            SAMPLER_KEYS.join(", ")
        );
    }
    if !args.allow_spec_change {
        bail_input!(
            "{}: the spec changed since the run began ({}). To continue this run under the new spec (the change is recorded in {}):\n  {} --allow-spec-change\nor restore the spec, or start a new run with another --run-dir",
            run.root.display(),
            spec::describe_changes(changes),
            run.spec_changes_path().display(),
            command_line(args, &run.root, true)
        );
    }
    Ok(())
}

fn fresh_state(train_rows: u64) -> State {
    State {
        version: STATE_VERSION,
        train_rows,
        ..State::default()
    }
}

fn spec_for_file(spec: &Spec) -> String {
    format!(
        "# The spec of this run with the runner's defaults written out (stage flags left out\n# here take the stage's own defaults).\n{}",
        spec.to_toml()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_prompts_per_step_than_rows_is_a_warning() {
        let train = Path::new("data/train.parquet");
        assert_eq!(repeats_warning(2000, 2000, train), None);
        assert_eq!(
            repeats_warning(5000, 2000, train).unwrap(),
            "pipeline: warning: prompts-per-step = 5000 but data/train.parquet has 2000 rows: each step repeats prompts (about 2.5 times each)"
        );
    }

    #[test]
    fn the_finished_message_names_only_files_that_exist() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::write(run.metrics_path(), "{}\n").unwrap();
        std::fs::write(run.log_path(), "").unwrap();
        let msg = finished_message(&run, 3);
        let root = dir.path().display();
        assert_eq!(
            msg,
            format!(
                "pipeline: finished 3 steps in {root}\n  metrics: {root}/metrics.jsonl\n  log:     {root}/pipeline.log\n  plot:    tandem plot {root}"
            )
        );
        std::fs::write(run.eval_path(), "{}\n").unwrap();
        assert!(finished_message(&run, 3).contains(&format!("\n  eval:    {root}/eval.jsonl\n")));
    }
}
