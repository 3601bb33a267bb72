//! The `score` stage's summary: printed to stderr and, with `--metrics FILE`, written as one
//! flat JSON object (`score/mean`, `score/accuracy`, `score/accuracy/<data_source>`, ...).

use super::Scores;
use anyhow::Result;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Sub-score that, when a reward returns it, is the accuracy (verl's math_dapo returns `acc`).
pub(crate) const ACC_KEY: &str = "acc";

/// Wall time of the stage's parts, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Timings {
    pub(crate) read_s: f64,
    pub(crate) score_s: f64,
    pub(crate) write_s: f64,
}

impl Timings {
    pub(crate) fn total_s(&self) -> f64 {
        self.read_s + self.score_s + self.write_s
    }
}

/// Count, mean score and accuracy of a set of rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Group {
    pub(crate) rows: usize,
    pub(crate) mean: f64,
    pub(crate) accuracy: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Summary {
    pub(crate) all: Group,
    pub(crate) std: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    /// Whether accuracy is the mean of the `acc` sub-score (else: fraction of score >= 1).
    pub(crate) accuracy_from_acc: bool,
    /// Per data_source, sorted by name (empty when the batch has no data_source).
    pub(crate) per_source: BTreeMap<String, Group>,
    /// Mean of each sub-score.
    pub(crate) sub_means: Vec<(String, f64)>,
    /// The greedy baseline rows (`is_baseline`), counted apart from the samples above.
    pub(crate) baselines: Option<Group>,
}

fn mean(values: impl Iterator<Item = f64>) -> (usize, f64) {
    let (n, sum) = values.fold((0usize, 0.0f64), |(n, s), v| (n + 1, s + v));
    (n, if n == 0 { f64::NAN } else { sum / n as f64 })
}

impl Summary {
    /// The summary of the samples; rows marked in `is_baseline` (ReMax's greedy baselines)
    /// are not samples and are summarised apart.
    pub(crate) fn new(
        scores: &Scores,
        sources: Option<&[&str]>,
        is_baseline: Option<&[bool]>,
    ) -> Summary {
        let s = &scores.score;
        let acc_col = scores.sub(ACC_KEY);
        let correct = |i: usize| -> f64 {
            match acc_col {
                Some(a) => a[i] as f64,
                None => f64::from(u8::from(s[i] >= 1.0)),
            }
        };
        let group = |rows: &[usize]| -> Group {
            let (n, m) = mean(rows.iter().map(|&i| s[i] as f64));
            Group {
                rows: n,
                mean: m,
                accuracy: mean(rows.iter().map(|&i| correct(i))).1,
            }
        };
        let baseline = |i: usize| is_baseline.is_some_and(|b| b[i]);
        let (base_rows, all_rows): (Vec<usize>, Vec<usize>) =
            (0..s.len()).partition(|&i| baseline(i));
        let all = group(&all_rows);
        let of = |i: &usize| s[*i] as f64;
        let var = mean(all_rows.iter().map(|i| (of(i) - all.mean).powi(2))).1;
        let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        if let Some(src) = sources {
            for &i in &all_rows {
                by_source.entry(src[i]).or_default().push(i);
            }
        }
        Summary {
            all,
            std: var.sqrt(),
            min: all_rows.iter().fold(f64::NAN, |m, i| m.min(of(i))),
            max: all_rows.iter().fold(f64::NAN, |m, i| m.max(of(i))),
            accuracy_from_acc: acc_col.is_some(),
            per_source: by_source
                .into_iter()
                .map(|(k, rows)| (k.to_string(), group(&rows)))
                .collect(),
            sub_means: scores
                .subs
                .iter()
                .map(|(k, v)| (k.clone(), mean(all_rows.iter().map(|&i| v[i] as f64)).1))
                .collect(),
            baselines: (!base_rows.is_empty()).then(|| group(&base_rows)),
        }
    }

    /// The flat metrics object. Means of an empty batch are null.
    pub(crate) fn metrics(&self, t: &Timings) -> Map<String, Value> {
        let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        let mut m = Map::new();
        m.insert("score/rows".into(), json!(self.all.rows));
        m.insert("score/mean".into(), num(self.all.mean));
        m.insert("score/std".into(), num(self.std));
        m.insert("score/min".into(), num(self.min));
        m.insert("score/max".into(), num(self.max));
        m.insert("score/accuracy".into(), num(self.all.accuracy));
        for (src, g) in &self.per_source {
            m.insert(format!("score/rows/{src}"), json!(g.rows));
            m.insert(format!("score/mean/{src}"), num(g.mean));
            m.insert(format!("score/accuracy/{src}"), num(g.accuracy));
        }
        for (key, v) in &self.sub_means {
            m.insert(format!("score_{key}/mean"), num(*v));
        }
        if let Some(b) = &self.baselines {
            m.insert("score/baseline_rows".into(), json!(b.rows));
            m.insert("score/baseline_mean".into(), num(b.mean));
            m.insert("score/baseline_accuracy".into(), num(b.accuracy));
        }
        m.insert("score/read_s".into(), json!(t.read_s));
        m.insert("score/score_s".into(), json!(t.score_s));
        m.insert("score/write_s".into(), json!(t.write_s));
        m.insert("score/total_s".into(), json!(t.total_s()));
        m.insert(
            "score/rows_per_s".into(),
            num(self.all.rows as f64 / t.total_s()),
        );
        m
    }

    /// The human summary, a few lines for stderr.
    pub(crate) fn report(&self, reward: &str, t: &Timings) -> String {
        let acc_kind = if self.accuracy_from_acc {
            "mean of 'acc'"
        } else {
            "score >= 1"
        };
        let mut out = format!(
            "score: {} rows, reward {reward}: mean {:.4}, accuracy {:.4} ({acc_kind})\n",
            self.all.rows, self.all.mean, self.all.accuracy
        );
        for (src, g) in &self.per_source {
            let _ = writeln!(
                out,
                "  {src}: {} rows, mean {:.4}, accuracy {:.4}",
                g.rows, g.mean, g.accuracy
            );
        }
        for (key, v) in &self.sub_means {
            let _ = writeln!(out, "  score_{key}: mean {v:.4}");
        }
        if let Some(b) = &self.baselines {
            let _ = writeln!(
                out,
                "  and {} greedy baseline rows (not counted above): mean {:.4}, accuracy {:.4}",
                b.rows, b.mean, b.accuracy
            );
        }
        let _ = writeln!(
            out,
            "  {:.0} rows/s (read {:.3} s, score {:.3} s, write {:.3} s)",
            self.all.rows as f64 / t.total_s(),
            t.read_s,
            t.score_s,
            t.write_s
        );
        out
    }
}

/// Write the metrics object to `path` atomically (`path.tmp`, then rename).
pub(crate) fn write_metrics(path: &Path, metrics: &Map<String, Value>) -> Result<()> {
    crate::batch::write_json(path, metrics)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_per_source_by_threshold() {
        let scores = Scores {
            score: vec![1.0, 0.0, 0.1, 1.0],
            ..Scores::default()
        };
        let s = Summary::new(&scores, Some(&["a", "b", "a", "a"]), None);
        assert_eq!(s.all.rows, 4);
        assert!((s.all.mean - 0.525).abs() < 1e-6);
        assert_eq!(s.all.accuracy, 0.5);
        assert_eq!(s.min, 0.0);
        assert_eq!(s.max, 1.0);
        let a = &s.per_source["a"];
        assert_eq!((a.rows, a.accuracy), (3, 2.0 / 3.0));
        assert!((a.mean - 0.7).abs() < 1e-6);
        assert_eq!(s.per_source["b"].accuracy, 0.0);

        let m = s.metrics(&Timings {
            read_s: 1.0,
            score_s: 0.5,
            write_s: 0.5,
        });
        assert_eq!(m["score/accuracy/a"], json!(2.0 / 3.0));
        assert_eq!(m["score/rows/b"], json!(1));
        assert_eq!(m["score/rows_per_s"], json!(2.0));
    }

    #[test]
    fn acc_sub_score_is_the_accuracy() {
        // Scores of -1/1 (as DAPO gives) with acc saying which were right.
        let scores = Scores {
            score: vec![1.0, -1.0, -1.0],
            subs: vec![("acc".into(), vec![1.0, 0.0, 1.0])],
            ..Scores::default()
        };
        let s = Summary::new(&scores, None, None);
        assert!(s.accuracy_from_acc);
        assert!((s.all.accuracy - 2.0 / 3.0).abs() < 1e-12);
        assert!(s.per_source.is_empty());
        assert_eq!(s.sub_means, [("acc".to_string(), 2.0 / 3.0)]);
    }

    #[test]
    fn baseline_rows_are_summarised_apart() {
        // Rows 1 and 3 are greedy baselines: the samples are 1.0 (a), 0.0 (b), 0.25 (a).
        let scores = Scores {
            score: vec![1.0, 1.0, 0.0, 2.0, 0.25],
            subs: vec![("len".into(), vec![2.0, 9.0, 4.0, 9.0, 6.0])],
            ..Scores::default()
        };
        let is_b = [false, true, false, true, false];
        let s = Summary::new(&scores, Some(&["a", "a", "b", "b", "a"]), Some(&is_b));
        assert_eq!(s.all.rows, 3);
        assert!((s.all.mean - 1.25 / 3.0).abs() < 1e-12);
        assert!((s.all.accuracy - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!((s.min, s.max), (0.0, 1.0));
        assert_eq!(s.per_source["a"].rows, 2);
        assert_eq!(s.per_source["b"].rows, 1);
        assert_eq!(s.sub_means, [("len".to_string(), 4.0)]);
        let b = s.baselines.as_ref().unwrap();
        assert_eq!((b.rows, b.mean, b.accuracy), (2, 1.5, 1.0));
        let m = s.metrics(&Timings::default());
        assert_eq!(m["score/rows"], json!(3));
        assert_eq!(m["score/baseline_rows"], json!(2));
        assert_eq!(m["score/baseline_mean"], json!(1.5));
    }

    #[test]
    fn empty_batch_gives_null_means() {
        let s = Summary::new(&Scores::default(), Some(&[]), None);
        let m = s.metrics(&Timings::default());
        assert_eq!(m["score/rows"], json!(0));
        assert_eq!(m["score/mean"], Value::Null);
        assert_eq!(m["score/rows_per_s"], Value::Null);
    }

    #[test]
    fn metrics_file_is_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/m.json");
        let mut m = Map::new();
        m.insert("score/mean".into(), json!(0.5));
        write_metrics(&path, &m).unwrap();
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, json!({"score/mean": 0.5}));
        assert!(!crate::batch::write::temp_path(&path).exists());
    }
}
