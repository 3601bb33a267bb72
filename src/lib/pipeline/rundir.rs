//! The run directory: where every file of a run lives, `state.json` (what has finished), the
//! resolved spec, and atomic writes of the runner's own files.
//!
//! ```text
//! RUN/
//!   spec.resolved.toml     the spec the run continues under, the runner's defaults written out
//!   spec-changes.jsonl     each change of the spec continued under (--allow-spec-change)
//!   state.json             finished steps and stages, sampler cursor, policy
//!   commands.sh            every stage command line, in the order they ran
//!   pipeline.log           the stages' output after each command, the runner's lines
//!   metrics.jsonl eval.jsonl
//!   policy                 the pointer `sync-weights` maintains (what rollout loads)
//!   step-000K/{prompts,rollout,scored,ref,old,adv}.parquet, metrics/*.json
//!   eval/step-000K/{rollout,scored}.parquet
//!   ckpt/step-000K/        update's output model (cadence and keep-last prune the rest)
//! ```

use super::sampler::Cursor;
use super::spec::SpecChange;
use crate::bail_input;
use crate::error::input_error;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Version of the state.json layout.
pub(crate) const STATE_VERSION: u64 = 1;

/// What has finished in a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct State {
    pub(crate) version: u64,
    /// Steps whose every stage (and metrics line) is done; step 0 is initialisation.
    pub(crate) steps_done: u64,
    /// Whether step 0 (publishing the initial policy, the first eval) is done.
    pub(crate) init_done: bool,
    /// The step in progress and its finished stages.
    #[serde(default)]
    pub(crate) current: Option<StepProgress>,
    /// The sampler's cursor for the next draw.
    pub(crate) sampler: Cursor,
    /// Rows in the training set when the run began (a changed dataset is refused on resume).
    pub(crate) train_rows: u64,
}

impl State {
    /// Whether the state records task `name` of step `step` as finished (in the step in
    /// progress).
    pub(crate) fn is_done(&self, step: u64, name: &str) -> bool {
        self.current
            .as_ref()
            .is_some_and(|c| c.step == step && c.is_done(name))
    }

    /// The progress of step `step`, begun afresh when another step was in progress.
    pub fn progress(&mut self, step: u64) -> &mut StepProgress {
        if self.current.as_ref().map(|c| c.step) != Some(step) {
            self.current = Some(StepProgress {
                step,
                ..StepProgress::default()
            });
        }
        self.current.as_mut().expect("set above")
    }

    /// Ends the step in progress: what it timed of the next step's work (one-step-off: `next`)
    /// begins that step's progress, as its `inside`.
    pub(crate) fn end_step(&mut self) {
        self.current = self
            .current
            .take()
            .filter(|c| !c.next.is_empty())
            .map(|c| StepProgress {
                step: c.step + 1,
                inside: c.next,
                ..StepProgress::default()
            });
    }
}

/// The finished stages of the step in progress, and how long each took.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct StepProgress {
    pub(crate) step: u64,
    pub(crate) done: Vec<String>,
    pub(crate) seconds: BTreeMap<String, f64>,
    /// Seconds of work that ran inside this step's wall time without adding to it, or for this
    /// step in the step before (one-step-off: the update alone within `overlap`, and this
    /// step's rollout, which ran beside the update of the step before): `time/<name>` in the
    /// step's line, not part of `time/step`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) inside: BTreeMap<String, f64>,
    /// One-step-off: seconds of the next step's work done in this step (its rollout, or its
    /// dynamic sampling's passes); they become the next step's `inside` when this step ends.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) next: BTreeMap<String, f64>,
}

impl StepProgress {
    pub(crate) fn is_done(&self, stage: &str) -> bool {
        self.done.iter().any(|s| s == stage)
    }
}

/// Paths inside one run directory.
#[derive(Clone, Debug)]
pub(crate) struct RunDir {
    pub(crate) root: PathBuf,
}

impl RunDir {
    pub fn new(root: impl Into<PathBuf>) -> RunDir {
        RunDir { root: root.into() }
    }

    pub(crate) fn state_path(&self) -> PathBuf {
        self.root.join("state.json")
    }
    pub(crate) fn spec_path(&self) -> PathBuf {
        self.root.join("spec.resolved.toml")
    }
    pub(crate) fn commands_path(&self) -> PathBuf {
        self.root.join("commands.sh")
    }
    pub(crate) fn log_path(&self) -> PathBuf {
        self.root.join("pipeline.log")
    }
    pub(crate) fn spec_changes_path(&self) -> PathBuf {
        self.root.join("spec-changes.jsonl")
    }
    pub(crate) fn metrics_path(&self) -> PathBuf {
        self.root.join("metrics.jsonl")
    }
    pub(crate) fn eval_path(&self) -> PathBuf {
        self.root.join("eval.jsonl")
    }
    pub fn policy(&self) -> PathBuf {
        self.root.join("policy")
    }
    pub(crate) fn lock_path(&self) -> PathBuf {
        self.root.join("lock")
    }
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }
    /// A batch file of a step: `step-000K/NAME.parquet`.
    pub fn batch(&self, step: u64, name: &str) -> PathBuf {
        self.step_dir(step).join(format!("{name}.parquet"))
    }
    /// A stage's `--metrics` file: `step-000K/metrics/NAME.json`.
    pub(crate) fn stage_metrics(&self, step: u64, name: &str) -> PathBuf {
        self.step_dir(step)
            .join("metrics")
            .join(format!("{name}.json"))
    }
    pub(crate) fn eval_dir(&self, step: u64) -> PathBuf {
        self.root.join("eval").join(step_name(step))
    }
    pub(crate) fn ckpt_root(&self) -> PathBuf {
        self.root.join("ckpt")
    }
    pub fn ckpt(&self, step: u64) -> PathBuf {
        self.ckpt_root().join(step_name(step))
    }
    /// The critic's checkpoints (`[critic]`): `critic/step-000K`, pruned as `ckpt/` is.
    pub(crate) fn critic_root(&self) -> PathBuf {
        self.root.join("critic")
    }
    pub fn critic_ckpt(&self, step: u64) -> PathBuf {
        self.critic_root().join(step_name(step))
    }

    pub fn exists(&self) -> bool {
        self.state_path().exists()
    }

    pub(crate) fn load_state(&self) -> Result<State> {
        let path = self.state_path();
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let state: State = serde_json::from_str(&text).map_err(|e| {
            input_error(format!(
                "{}: not a tandem run state ({e}); remove the run directory or pick another --run-dir",
                path.display()
            ))
        })?;
        if state.version != STATE_VERSION {
            bail_input!(
                "{}: state version {} (this tandem reads {STATE_VERSION})",
                path.display(),
                state.version
            );
        }
        Ok(state)
    }

    pub(crate) fn save_state(&self, state: &State) -> Result<()> {
        crate::batch::write_json(&self.state_path(), state)
    }

    /// Appends to spec-changes.jsonl that the run continues under a changed spec (read from
    /// `spec`) from step `step`, whose tasks `finished` are not run again.
    pub(crate) fn record_spec_change(
        &self,
        spec: &Path,
        step: u64,
        finished: &[String],
        changes: &[SpecChange],
    ) -> Result<()> {
        let path = self.spec_changes_path();
        let mut text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let line = serde_json::json!({
            "time": chrono::Local::now().to_rfc3339(),
            "step": step,
            "finished_in_step": finished,
            "spec": spec,
            "changes": changes,
        });
        text.push_str(&line.to_string());
        text.push('\n');
        write_atomic(&path, text.as_bytes())
    }

    /// Take the run directory for this process: refuse when another live runner holds it
    /// (a lock left by a killed runner is taken over).
    pub fn lock(&self) -> Result<RunLock> {
        let path = self.lock_path();
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(pid) = text.trim().parse::<u32>() {
                if pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists() {
                    bail_input!(
                        "{}: another pipeline (pid {pid}) is running in this run directory; wait for it or stop it",
                        self.root.display()
                    );
                }
            }
        }
        write_atomic(&path, format!("{}\n", std::process::id()).as_bytes())?;
        Ok(RunLock { path })
    }
}

/// Removes the lock file when the runner ends normally.
pub(crate) struct RunLock {
    path: PathBuf,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `step-000K`: four digits, more when a run is longer.
pub(crate) fn step_name(step: u64) -> String {
    format!("step-{step:04}")
}

/// The step of a `step-000K` name.
pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

pub use crate::batch::write::write_atomic;

/// Replace the lines of a JSON-lines file whose `step` is `step` (or later: a resumed run
/// rewrites them) by `line`, atomically, so a crash between writing and recording never
/// leaves a step twice.
pub(crate) fn put_jsonl_step(path: &Path, step: u64, line: &serde_json::Value) -> Result<()> {
    let mut out = String::new();
    if let Ok(text) = std::fs::read_to_string(path) {
        for l in text.lines().filter(|l| !l.trim().is_empty()) {
            let keep = serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s < step);
            if keep {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out.push_str(&line.to_string());
    out.push('\n');
    write_atomic(path, out.as_bytes())
}

/// Read a JSON-lines file into objects (a missing file is empty).
pub(crate) fn read_jsonl(path: &Path) -> Result<Vec<serde_json::Map<String, serde_json::Value>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => bail_input!("{}: cannot read: {e}", path.display()),
    };
    let mut rows = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(l) {
            Ok(serde_json::Value::Object(m)) => rows.push(m),
            _ => bail_input!("{}:{}: not a JSON object", path.display(), i + 1),
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A step's end drops its progress, except the seconds it timed of the next step's work,
    /// which begin that step's (as work done for it outside its wall time).
    #[test]
    fn a_steps_end_carries_the_next_steps_seconds() {
        let mut state = State::default();
        state.progress(2).seconds.insert("overlap".into(), 3.0);
        state.progress(2).next.insert("rollout".into(), 2.0);
        state.end_step();
        let want = StepProgress {
            step: 3,
            inside: [("rollout".to_string(), 2.0)].into(),
            ..StepProgress::default()
        };
        assert_eq!(state.current, Some(want));
        assert!(!state.is_done(3, "rollout"));
        // Step 3's tasks add to it; its end carries nothing.
        state.progress(3).done.push("score".into());
        assert_eq!(state.progress(3).inside.len(), 1);
        state.end_step();
        assert_eq!(state.current, None);
    }

    #[test]
    fn state_round_trips_and_bad_state_is_input_error() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let mut state = State {
            version: STATE_VERSION,
            steps_done: 2,
            init_done: true,
            sampler: Cursor {
                epoch: 1,
                position: 3,
            },
            train_rows: 10,
            ..State::default()
        };
        state.current = Some(StepProgress {
            step: 3,
            done: vec!["prompts".into(), "rollout".into()],
            seconds: [("rollout".to_string(), 1.5)].into(),
            inside: [("update".to_string(), 0.5)].into(),
            next: [("rollout".to_string(), 0.25)].into(),
        });
        run.save_state(&state).unwrap();
        assert_eq!(run.load_state().unwrap(), state);
        assert!(!run.state_path().with_extension("json.tmp").exists());

        std::fs::write(run.state_path(), "{").unwrap();
        let err = run.load_state().unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(format!("{err:#}").contains("state.json: not a tandem run state"));
    }

    #[test]
    fn jsonl_step_lines_are_replaced_not_duplicated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        put_jsonl_step(&path, 1, &json!({"step": 1, "x": 1})).unwrap();
        put_jsonl_step(&path, 2, &json!({"step": 2, "x": 2})).unwrap();
        // A resumed step 2 rewrites its line.
        put_jsonl_step(&path, 2, &json!({"step": 2, "x": 3})).unwrap();
        let rows = read_jsonl(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1]["x"], 3);
        // A rewritten earlier step drops the later ones it invalidates.
        put_jsonl_step(&path, 1, &json!({"step": 1, "x": 9})).unwrap();
        let rows = read_jsonl(&path).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["x"], 9);
    }

    #[test]
    fn lock_refuses_a_live_holder_and_takes_over_a_dead_one() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        // pid 1 is always alive.
        std::fs::write(run.lock_path(), "1\n").unwrap();
        let err = run.lock().err().expect("locked by pid 1");
        assert!(format!("{err:#}").contains("another pipeline (pid 1) is running"));
        // A pid that cannot exist (above the kernel's pid_max).
        std::fs::write(run.lock_path(), "99999999\n").unwrap();
        let lock = run.lock().unwrap();
        assert_eq!(
            std::fs::read_to_string(run.lock_path()).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(lock);
        assert!(!run.lock_path().exists());
    }

    #[test]
    fn step_names() {
        assert_eq!(step_name(3), "step-0003");
        assert_eq!(step_name(12345), "step-12345");
        assert_eq!(parse_step_name("step-0042"), Some(42));
        assert_eq!(parse_step_name("stepx"), None);
    }
}
