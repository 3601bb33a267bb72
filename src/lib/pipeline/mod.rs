//! The pipeline runner: `pipeline run pipelines/NAME.toml` runs the stages step after step
//! in a run directory, resumes after a crash, and records metrics; `tandem plot` and
//! `tandem inspect` look at what it wrote.
//!
//! - `spec`: the TOML spec (stage keys are the stage flags).
//! - `rundir`: the run directory's layout, `state.json`, atomic writes.
//! - `sampler`: the seeded prompt sampler whose cursor is part of the state.
//! - `runner`: the step loop (stage commands, `commands.sh`, resume).
//! - `dynamic`: DAPO's dynamic sampling, the rounds of a step that keeps only varied groups.
//! - `metrics`: `metrics.jsonl` and `eval.jsonl` lines.
//! - `tensorboard`: the same numbers as TensorBoard event files in the run directory.
//! - `plot`, `inspect`: looking at a run.

pub mod dynamic;
pub mod inspect;
pub mod metrics;
pub mod plot;
pub mod rundir;
pub mod runner;
pub mod sampler;
pub mod spec;
pub mod tensorboard;

use crate::bail_input;
use anyhow::Result;
use clap::Args;
use rundir::{RunDir, State, STATE_VERSION};
use runner::Runner;
use spec::Spec;
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
}

/// `pipeline run`.
pub fn run(args: RunArgs) -> Result<()> {
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
    let root = match &args.run_dir {
        Some(d) => d.clone(),
        None => {
            let stem = args.spec.file_stem().unwrap_or_default();
            Path::new("runs").join(stem)
        }
    };
    let run = RunDir::new(root);
    let existing = run.exists();
    if existing {
        check_same_spec(&run, &spec)?;
    } else {
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
    }
    let bins = runner::bin_dir()?;
    let spec_path = args.spec.display().to_string();

    if args.dry_run {
        let state = if existing {
            run.load_state()?
        } else {
            fresh_state(0)
        };
        let runner = Runner::new(spec, run, bins, state)?;
        runner.check_commands().map_err(|e| e.context(spec_path))?;
        for (step, task) in runner.plan() {
            println!("{}", runner.describe(step, &task));
        }
        return Ok(());
    }

    check_inputs(&spec)?;
    let state = if existing {
        run.load_state()?
    } else {
        let rows = crate::batch::Batch::read(&spec.data.train, &[])?.num_rows() as u64;
        if rows == 0 {
            bail_input!(
                "{}: the training set has no rows",
                spec.data.train.display()
            );
        }
        fresh_state(rows)
    };
    // Every stage command is checked by its stage before the run directory is touched.
    let mut runner = Runner::new(spec, run, bins, state)?;
    runner.check_commands().map_err(|e| e.context(spec_path))?;
    let (spec, run, state) = (&runner.spec, &runner.run, &runner.state);
    if !existing {
        std::fs::create_dir_all(&run.root)?;
        rundir::write_atomic(&run.spec_path(), spec_for_file(spec).as_bytes())?;
        run.save_state(state)?;
    }
    let _lock = run.lock()?;
    if existing {
        // Record the new step count when the run is being extended.
        rundir::write_atomic(&run.spec_path(), spec_for_file(spec).as_bytes())?;
    }
    let done_before = state.steps_done;
    if done_before >= spec.steps {
        eprintln!(
            "pipeline: {} already has {} of {} steps; nothing to do (pass --steps N to go further)",
            run.root.display(),
            done_before,
            spec.steps
        );
        return Ok(());
    }
    if existing {
        eprintln!(
            "pipeline: continuing {} after step {done_before}",
            run.root.display()
        );
    }
    runner.run()?;
    let run = &runner.run;
    eprintln!(
        "pipeline: finished {} steps in {}\n  metrics: {}\n  eval:    {}\n  plot:    tandem plot {}",
        runner.spec.steps,
        run.root.display(),
        run.metrics_path().display(),
        run.eval_path().display(),
        run.root.display()
    );
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

/// Files the spec names must exist before anything runs.
fn check_inputs(spec: &Spec) -> Result<()> {
    let mut need: Vec<(&str, &Path)> = vec![
        ("[model] path", &spec.model.path),
        ("[data] train", &spec.data.train),
    ];
    if let Some(r) = &spec.model.reference {
        need.push(("[model] ref", r));
    }
    if spec.eval.every > 0 {
        if let Some(v) = &spec.data.val {
            need.push(("[data] val", v));
        }
    }
    for (key, p) in need {
        if !p.exists() {
            bail_input!("{key} = {}: no such file or directory", p.display());
        }
    }
    Ok(())
}

/// A run continues only under the spec it began with (the step count may change).
fn check_same_spec(run: &RunDir, spec: &Spec) -> Result<()> {
    let path = run.spec_path();
    let old = Spec::load(&path)?;
    let as_table = |s: &Spec| {
        let mut s = s.clone();
        s.steps = 0;
        toml::Value::try_from(&s).expect("a spec serializes")
    };
    let (mut a, mut b) = (Vec::new(), Vec::new());
    spec::leaves(&as_table(&old), "", &mut a);
    spec::leaves(&as_table(spec), "", &mut b);
    let mut diffs = Vec::new();
    for (k, v) in &a {
        match b.iter().find(|(k2, _)| k2 == k) {
            Some((_, v2)) if v2 == v => {}
            Some((_, v2)) => diffs.push(format!("{k}: {v} -> {v2}")),
            None => diffs.push(format!("{k}: {v} -> (unset)")),
        }
    }
    for (k, v) in &b {
        if !a.iter().any(|(k2, _)| k2 == k) {
            diffs.push(format!("{k}: (unset) -> {v}"));
        }
    }
    if !diffs.is_empty() {
        bail_input!(
            "{}: the run began with a different spec ({}); a run continues only with the spec it began with: pick a new --run-dir",
            run.root.display(),
            diffs.join("; ")
        );
    }
    Ok(())
}
