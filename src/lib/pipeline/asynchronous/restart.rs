//! A rollout round whose command failed in `mode = "async"`: when the rollout group is gone
//! (a rank died), the training side restarts it as the other modes do (`Steps::
//! restart_rollout`: a new group, the current policy sent to it by a transfer) and the rounds
//! go on from where the failed round started: its sequences in flight continue from the carry
//! the round before it wrote, its new prompts are drawn again; only the failed round's tokens
//! are lost. Any other failure (the group still up: the round refused its input) stops the
//! run with the round's output, as do more than `MAX_DAEMON_RESTARTS` failures in a row.

use super::{point_rollout, Ready, RoundLoop, Shared, Steps};
use crate::pipeline::daemons::MAX_DAEMON_RESTARTS;
use crate::pipeline::sampler::Cursor;
use anyhow::{Context, Result};
use std::path::PathBuf;

/// A round whose command failed, handed from the rounds thread to the training side.
#[derive(Debug)]
pub(super) struct RoundFailure {
    pub(super) round: u64,
    /// `RUN/async/round-R`, with the round's output in `log.txt`.
    pub(super) dir: PathBuf,
    pub(super) error: anyhow::Error,
    /// The groups the round started (drawn again after a restart).
    pub(super) started: usize,
    /// The sampler's cursor before the round drew its prompts.
    pub(super) cursor: Cursor,
}

impl RoundLoop {
    /// Hands a failed round to the training side and waits until the rollout group is back
    /// (true: the next round starts where the failed one did) or the run stops (false).
    pub(super) fn await_restart(&self, f: RoundFailure) -> bool {
        let mut q = self.shared.lock();
        q.cursor = f.cursor;
        q.failed = Some(f);
        q.running = false;
        self.shared.cv.notify_all();
        while (q.failed.is_some() || q.restarting) && !q.stop {
            q = self.shared.wait_idle(q);
        }
        !q.stop
    }
}

/// The next finished group for step `step`'s take, waiting for one; a failed round is
/// recovered from first.
pub(super) fn next_group(r: &mut impl Steps, shared: &Shared, step: u64) -> Result<Ready> {
    loop {
        match super::wait_for_group(shared)? {
            Some(g) => return Ok(g),
            None => recover(r, shared, step)?,
        }
    }
}

/// When a round failed: restarts the rollout group if it is gone (else the round's error),
/// says what was lost, and lets the rounds go on. Nothing to do when no round failed.
pub(super) fn recover(r: &mut impl Steps, shared: &Shared, step: u64) -> Result<()> {
    let (f, mut in_a_row, (groups, rows, partial)) = {
        let mut q = shared.lock();
        let Some(f) = q.failed.take() else {
            return Ok(());
        };
        q.restarting = true;
        let in_flight = (q.in_flight_groups, q.in_flight_rows, q.partial_rows);
        (f, q.failures_in_a_row, in_flight)
    };
    let Some(why) = r.rollout_gone() else {
        return Err(f.error);
    };
    let n = r.plan().stages.rollout.args.n;
    let lost_rows = rows + f.started * n;
    r.console().say(&format!(
        "pipeline: async: round {} failed with the rollout group gone ({why}); that round's new tokens are lost: {} (its output: {})",
        f.round,
        lost_note((groups, rows, partial), f.started, n),
        f.dir.join("log.txt").display()
    ));
    r.restart_rollout(step, &mut in_a_row).with_context(|| {
        format!(
            "async: round {} ({}) failed with the rollout group gone ({why}), the last of {in_a_row} rounds in a row (at most {MAX_DAEMON_RESTARTS} restarts)",
            f.round,
            f.dir.display()
        )
    })?;
    point_rollout(r.plan())?;
    shared.update(|q| {
        q.failures_in_a_row = in_a_row;
        q.restarts += 1;
        q.restart_rows += lost_rows as u64;
        q.restarting = false;
    });
    Ok(())
}

/// What a failed round's loss means for its sequences: those in flight before it (`groups`,
/// `rows`, `partial` of them with tokens) go on from where they stood, the `started` groups
/// of `n` sequences start again.
fn lost_note((groups, rows, partial): (usize, usize, usize), started: usize, n: usize) -> String {
    let mut parts = vec![];
    if groups > 0 {
        parts.push(format!(
            "its {groups} groups in flight ({rows} sequences, {partial} of them partial) go on from before it under the current policy"
        ));
    }
    if started > 0 {
        let seqs = started * n;
        parts.push(format!(
            "the {started} groups it started ({seqs} sequences) start again"
        ));
    }
    parts.join(", and ")
}

#[cfg(test)]
mod tests {
    use super::lost_note;

    #[test]
    fn the_loss_names_the_groups_in_flight_and_those_started_again() {
        assert_eq!(
            lost_note((3, 6, 4), 2, 2),
            "its 3 groups in flight (6 sequences, 4 of them partial) go on from before it under the current policy, and the 2 groups it started (4 sequences) start again"
        );
        assert_eq!(
            lost_note((0, 0, 0), 1, 4),
            "the 1 groups it started (4 sequences) start again"
        );
        assert_eq!(
            lost_note((2, 3, 3), 0, 2),
            "its 2 groups in flight (3 sequences, 3 of them partial) go on from before it under the current policy"
        );
    }
}
