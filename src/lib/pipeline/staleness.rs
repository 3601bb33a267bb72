//! The staleness bound of asynchronous RL (`[placement] mode = "async"`, `max-staleness = K`):
//! which finished groups a training step may take, and the step's staleness metrics.
//!
//! A row's lag is how many versions its oldest token is behind the policy being trained
//! (`token_policy_version`, one version per response token, from partial rollouts continued
//! under newer weights). A group whose rows all lag at most K is taken; a group with one row
//! lagging more is dropped whole and counted: GRPO-style advantages compare the rows of a
//! group, so a group cannot lose a row, and restarting the row would cost the same tokens as
//! sampling a fresh group (AReaL bounds staleness the same way, at the group; slime's partial
//! rollout keeps the tokens of an interrupted sequence and so needs the same bound).

use crate::bail_input;
use anyhow::Result;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// What the bound let through, for one training step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Admission {
    /// Per row: whether the step trains on it.
    pub keep: Vec<bool>,
    /// Rows per lag of their oldest token (taken and dropped rows alike).
    pub lags: BTreeMap<u64, usize>,
    /// Groups dropped for staleness, and the rows in them.
    pub dropped_groups: usize,
    pub dropped_rows: usize,
    /// Rows whose tokens come from two versions or more (partial rollouts carried over a
    /// weight update).
    pub mixed_rows: usize,
}

/// The admission of the rows `versions` (each row's `token_policy_version`), in the groups
/// `groups` (each row's group id, e.g. its `prompt_uid`), to the training of policy version
/// `trained` under the bound `k`. A token newer than the trained policy is an error naming its
/// row: such a batch did not come from this run's rollouts.
pub fn admit(groups: &[&str], versions: &[&[u64]], trained: u64, k: u64) -> Result<Admission> {
    assert_eq!(groups.len(), versions.len(), "one group per row");
    let mut a = Admission {
        keep: vec![true; groups.len()],
        ..Admission::default()
    };
    let mut stale: Vec<&str> = vec![];
    for (row, v) in versions.iter().enumerate() {
        let (Some(&oldest), Some(&newest)) = (v.iter().min(), v.iter().max()) else {
            // An empty response has no token to be stale.
            *a.lags.entry(0).or_default() += 1;
            continue;
        };
        if newest > trained {
            bail_input!(
                "row {row}: token_policy_version {newest} is newer than the policy being trained ({trained})"
            );
        }
        let lag = trained - oldest;
        *a.lags.entry(lag).or_default() += 1;
        a.mixed_rows += usize::from(oldest != newest);
        if lag > k && !stale.contains(&groups[row]) {
            stale.push(groups[row]);
        }
    }
    for (row, g) in groups.iter().enumerate() {
        if stale.contains(g) {
            a.keep[row] = false;
            a.dropped_rows += 1;
        }
    }
    a.dropped_groups = stale.len();
    Ok(a)
}

impl Admission {
    /// The step's metrics: `async/lag_L` rows per lag, the dropped groups and rows, the mixed
    /// rows.
    pub fn metrics(&self) -> Value {
        let mut m = Map::new();
        for (lag, rows) in &self.lags {
            m.insert(format!("async/lag_{lag}"), json!(rows));
        }
        m.insert(
            "async/dropped_stale_groups".into(),
            json!(self.dropped_groups),
        );
        m.insert("async/dropped_stale_rows".into(), json!(self.dropped_rows));
        m.insert("async/mixed_version_rows".into(), json!(self.mixed_rows));
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Training version 5 under K = 1: group "a" (oldest tokens 5 and 4) is taken, group "b"
    /// (one row from version 3, lag 2) is dropped whole, group "c" (one row carried from 4 to
    /// 5) is taken; the histogram counts each row once by its oldest token.
    #[test]
    fn groups_with_a_row_past_the_bound_are_dropped_whole() {
        let rows: [(&str, &[u64]); 6] = [
            ("a", &[5, 5]),
            ("a", &[4, 4, 4]),
            ("b", &[5]),
            ("b", &[3, 4, 5]),
            ("c", &[4, 5, 5]),
            ("c", &[]),
        ];
        let (groups, versions): (Vec<&str>, Vec<&[u64]>) = rows.into_iter().unzip();
        let a = admit(&groups, &versions, 5, 1).unwrap();
        assert_eq!(a.keep, [true, true, false, false, true, true]);
        assert_eq!(a.lags, BTreeMap::from([(0, 3), (1, 2), (2, 1)]));
        assert_eq!((a.dropped_groups, a.dropped_rows, a.mixed_rows), (1, 2, 2));
        let m = a.metrics();
        assert_eq!(m["async/lag_2"], 1);
        assert_eq!(m["async/dropped_stale_groups"], 1);
        // K = 2 takes everything; K = 0 only group "b"'s first row would pass, so "a" and "c"
        // go too.
        let all = admit(&groups, &versions, 5, 2).unwrap();
        assert!(all.keep.iter().all(|&k| k) && all.dropped_groups == 0);
        let none = admit(&groups, &versions, 5, 0).unwrap();
        assert_eq!(none.dropped_groups, 3);
        // A token from the future is refused, naming the row.
        let e = admit(&["a"], &[&[6]], 5, 1).unwrap_err().to_string();
        assert!(e.contains("row 0: token_policy_version 6 is newer"), "{e}");
    }
}
