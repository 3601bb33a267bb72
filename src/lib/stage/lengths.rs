//! `rollout --response-lengths FILE`: a recorded distribution of response lengths, played by a
//! model that does not stop by itself (random weights, `--ignore-eos`): each sample draws its
//! length from the file by its random key and ends there (`finish_reason` `length`), so that
//! benchmarks of a model shape without real weights see the long tail a real model's responses
//! have. The draw depends on the key alone: the same sample gets the same length in one
//! rollout, on any number of ranks, and across the rounds of partial rollouts.

use crate::bail_input;
use crate::batch::{schema, Batch};
use crate::engine::paged::Request;
use crate::rng::mix_key;
use anyhow::Result;
use std::path::Path;

/// The recorded lengths (each ≥ 1), in file order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ResponseLengths(Vec<usize>);

impl ResponseLengths {
    /// Reads `path`: a Parquet batch (the lengths of its `response_ids` rows: a rollout's
    /// output), or text with one length per line (blank lines and `#` comments skipped).
    pub(crate) fn read(path: &Path) -> Result<ResponseLengths> {
        let lengths = match path.extension().is_some_and(|e| e == "parquet") {
            true => Batch::read(path, &[schema::RESPONSE_IDS])?
                .ragged_i32(schema::RESPONSE_IDS)?
                .rows()
                .map(|r| r.len())
                .collect(),
            false => text_lengths(path)?,
        };
        if let Some(row) = lengths.iter().position(|&l| l == 0) {
            bail_input!(
                "{}: row {row}: a response of 0 tokens (every recorded length must be at least 1)",
                path.display()
            );
        }
        if lengths.is_empty() {
            bail_input!("{}: no response lengths in it", path.display());
        }
        Ok(ResponseLengths(lengths))
    }

    /// The length the sample of `key` draws, at most `max_new`.
    pub(crate) fn limit(&self, key: u64, max_new: usize) -> usize {
        let i = mix_key(&[key, 0x1e9_97a5]) % self.0.len() as u64;
        self.0[i as usize].min(max_new)
    }

    /// Gives every sample of `requests` its drawn length (`Request::max_new`), at most
    /// `max_new`.
    pub(crate) fn apply(&self, requests: &mut [Request], max_new: usize) {
        for r in requests {
            r.max_new = r
                .sample_keys
                .iter()
                .map(|&k| self.limit(k, max_new))
                .collect();
        }
    }
}

/// Lengths of a text file, one per line.
fn text_lengths(path: &Path) -> Result<Vec<usize>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => bail_input!("{}: cannot read the response lengths: {e}", path.display()),
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        match line.parse::<usize>() {
            Ok(l) if l > 0 => out.push(l),
            _ => bail_input!(
                "{}:{}: {line:?} is not a response length (a whole number of tokens, at least 1)",
                path.display(),
                i + 1
            ),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_files_are_read_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("l.txt");
        std::fs::write(&f, "# recorded\n12\n\n 300 \n7 # short\n").unwrap();
        assert_eq!(ResponseLengths::read(&f).unwrap().0, [12, 300, 7]);
        for (text, want) in [
            ("12\nabc\n", "l.txt:2: \"abc\" is not a response length"),
            ("0\n", "l.txt:1: \"0\" is not a response length"),
            ("-3\n", "l.txt:1: \"-3\""),
            ("# nothing\n", "l.txt: no response lengths in it"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = format!("{:#}", ResponseLengths::read(&f).unwrap_err());
            assert!(e.contains(want), "{e}");
        }
        let e = ResponseLengths::read(&d.path().join("none.txt")).unwrap_err();
        assert!(format!("{e:#}").contains("none.txt: cannot read"), "{e:#}");
    }

    #[test]
    fn every_key_draws_a_recorded_length_and_the_same_one_each_time() {
        let l = ResponseLengths(vec![5, 40, 900]);
        let drawn: Vec<usize> = (0..3000u64).map(|k| l.limit(k, 512)).collect();
        assert!(drawn.iter().all(|d| [5, 40, 512].contains(d)));
        // Each recorded length is drawn about a third of the time.
        for v in [5, 40, 512] {
            let n = drawn.iter().filter(|&&d| d == v).count();
            assert!((800..1200).contains(&n), "{v}: {n} of 3000");
        }
        assert_eq!(
            drawn,
            (0..3000u64).map(|k| l.limit(k, 512)).collect::<Vec<_>>()
        );
        let mut reqs = vec![Request {
            prompt: vec![1],
            sample_keys: vec![3, 4],
            max_new: vec![],
        }];
        l.apply(&mut reqs, 512);
        assert_eq!(reqs[0].max_new, [l.limit(3, 512), l.limit(4, 512)]);
    }
}
