//! The runner's own small tasks between the stages: pruning old checkpoints, carrying the
//! adaptive-KL state over, and the eval and step lines (metrics files and the console).

use super::console::{short_duration, Console};
use super::metrics::{self, StepFiles};
use super::plan::Plan;
use super::rundir::{parse_step_name, State};
use anyhow::{Context, Result};
use std::path::PathBuf;

/// Copies the previous step's adaptive-KL state to step `step`'s.
pub(super) fn copy_kl_state(plan: &Plan, step: u64) -> Result<()> {
    let dst = plan.kl_state(step);
    let src = plan.kl_state(step - 1);
    if src.exists() {
        let bytes = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
        super::rundir::write_atomic(&dst, &bytes)?;
    } else if dst.exists() {
        // First step: the controller starts from --kl-coef, so no state may linger from an
        // interrupted attempt.
        std::fs::remove_file(&dst)?;
    }
    Ok(())
}

/// Keep the current policy's checkpoint and the newest `keep-last` of the cadence ones.
pub(super) fn prune(plan: &Plan, step: u64) -> Result<()> {
    prune_under(plan, &plan.run.ckpt_root(), step)?;
    prune_under(plan, &plan.run.critic_root(), step)
}

/// [`prune`] of the checkpoints under `root` (the policy's or the critic's).
fn prune_under(plan: &Plan, root: &std::path::Path, step: u64) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    let mut steps: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            parse_step_name(&name).map(|s| (s, e.path()))
        })
        .collect();
    steps.sort();
    let keep = kept_checkpoints(
        steps.iter().map(|(s, _)| *s).filter(|&s| s <= step),
        step,
        plan.spec.checkpoint.every,
        plan.spec.checkpoint.keep_last,
    );
    for (s, path) in steps {
        if s <= step && !keep.contains(&s) {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Which checkpoint steps survive at `current`: the current one, and the newest `keep_last`
/// of those on the cadence (`every` > 0).
pub(crate) fn kept_checkpoints(
    present: impl Iterator<Item = u64>,
    current: u64,
    every: u64,
    keep_last: u64,
) -> Vec<u64> {
    let mut cadence: Vec<u64> = present
        .filter(|&s| every > 0 && s > 0 && s % every == 0)
        .collect();
    cadence.sort();
    let from = cadence.len().saturating_sub(keep_last as usize);
    let mut keep = cadence.split_off(from);
    if !keep.contains(&current) {
        keep.push(current);
    }
    keep
}

/// Appends step `step`'s evaluation to eval.jsonl. Returns the note for its step line; step 0
/// has no step line, so its evaluation is said on the console as its own line.
pub(super) fn eval_summary(
    plan: &Plan,
    console: &mut Console,
    step: u64,
) -> Result<Option<String>> {
    let run = &plan.run;
    let line = metrics::eval_line(step, &run.eval_dir(step).join("scored.parquet"))?;
    metrics::put_line(
        &run.eval_path(),
        step,
        &serde_json::Value::Object(line.clone()),
    )?;
    let acc = line.get("accuracy").and_then(|v| v.as_f64()).unwrap_or(0.0);
    let note = format!("eval acc {acc:.3} ({} rows)", line["rows"]);
    if step == 0 {
        let total = plan.spec.steps;
        console.say(&format!("step 0/{total}  {note} (the initial policy)"));
        return Ok(None);
    }
    Ok(Some(note))
}

/// Appends step `step`'s line to metrics.jsonl and says it on the console, with the step's
/// evaluation note (taken) and the ETA.
pub(super) fn step_metrics(
    plan: &Plan,
    state: &State,
    console: &mut Console,
    eval_note: &mut Option<String>,
    step: u64,
) -> Result<()> {
    let run = &plan.run;
    let (seconds, inside) = state
        .current
        .as_ref()
        .map(|c| (c.seconds.clone(), c.inside.clone()))
        .unwrap_or_default();
    let with_ref = if plan.needs_ref() {
        Some(run.batch(step, "ref"))
    } else {
        None
    };
    let line = metrics::step_line(&StepFiles {
        step,
        scored: &run.batch(step, "scored"),
        with_ref: with_ref.as_deref(),
        stage_metrics: vec![
            ("rollout", run.stage_metrics(step, "rollout")),
            ("score", run.stage_metrics(step, "score")),
            ("sampling", run.stage_metrics(step, "sampling")),
            ("advantage", run.stage_metrics(step, "advantage")),
            ("update", run.stage_metrics(step, "update")),
            ("critic", run.stage_metrics(step, "critic")),
            ("transfer", run.stage_metrics(step, "transfer")),
            ("async", run.stage_metrics(step, "async")),
        ],
        seconds: &seconds,
        inside: &inside,
    })?;
    let total = plan.spec.steps;
    let mut text = metrics::summary_text(&line, total);
    if let Some(note) = eval_note.take() {
        text += &format!("  {note}");
    }
    if let Some(eta) = console.eta(step, total) {
        text += &format!("  ETA {}", short_duration(eta));
    }
    metrics::put_line(&run.metrics_path(), step, &serde_json::Value::Object(line))?;
    console.say(&text);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_cadence() {
        // every 2, keep 2, now at step 7: 4 and 6 stay (2 is older), 7 is the policy.
        assert_eq!(kept_checkpoints(1..=7, 7, 2, 2), [4, 6, 7]);
        // current on the cadence is not listed twice
        assert_eq!(kept_checkpoints(1..=6, 6, 2, 2), [4, 6]);
        // no cadence: only the policy
        assert_eq!(kept_checkpoints(1..=5, 5, 0, 3), [5]);
    }
}
