//! `tandem prepare synth`: built-in synthetic tasks whose answers a rule checks, for runs that
//! need no download (`make demo`, CI).
//!
//! - `add`: "12+34=" -> "46" (operands of `--digits` digits);
//! - `copy`: "copy: kqzt" -> "kqzt";
//! - `reverse`: "reverse: kqzt" -> "tzqk" (strings of `--min-len`..=`--max-len` letters).
//!
//! Rows are in verl's prompt schema: `data_source` "synth/<task>", `prompt` one user message,
//! `ability` "synth", `reward_model.ground_truth` the answer, `extra_info` {split, index,
//! answer (the reference response, for an SFT warm start), question}. With `--answer-format
//! plain` (default) the `exact` reward checks a response; with `gsm8k` the prompt asks for the
//! answer after "####", the reference response is "#### 46", and the `gsm8k` reward checks it
//! (numeric answers only: `add`).

use super::{ExtraInfo, Message, VerlRow};
use crate::bail_input;
use crate::batch::{stage_meta, write_file, StageInfo};
use crate::rng::SplitMix64;
use anyhow::Result;
use clap::{Args, ValueEnum};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Task {
    Add,
    Copy,
    Reverse,
}

impl Task {
    fn name(self) -> &'static str {
        match self {
            Task::Add => "add",
            Task::Copy => "copy",
            Task::Reverse => "reverse",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AnswerFormat {
    /// The answer alone (checked by `--reward exact`).
    Plain,
    /// The answer after "#### " (checked by `--reward gsm8k`).
    Gsm8k,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct SynthArgs {
    #[arg(long, value_enum)]
    pub(crate) task: Task,
    /// Number of rows.
    #[arg(long)]
    pub(crate) n: usize,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Output parquet file.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Digits of each operand (add).
    #[arg(long, default_value_t = 2)]
    pub(crate) digits: u32,
    /// Shortest string (copy, reverse).
    #[arg(long, default_value_t = 3)]
    pub(crate) min_len: usize,
    /// Longest string (copy, reverse).
    #[arg(long, default_value_t = 6)]
    pub(crate) max_len: usize,
    /// Split recorded in extra_info.split.
    #[arg(long, default_value = "train")]
    pub(crate) split: String,
    #[arg(long, value_enum, default_value_t = AnswerFormat::Plain)]
    pub(crate) answer_format: AnswerFormat,
}

/// One problem: the question text and its answer.
pub(crate) fn problem(task: Task, rng: &mut SplitMix64, args: &SynthArgs) -> (String, String) {
    match task {
        Task::Add => {
            let lo = if args.digits == 1 {
                0
            } else {
                10u64.pow(args.digits - 1)
            };
            let hi = 10u64.pow(args.digits);
            let a = lo + rng.below(hi - lo);
            let b = lo + rng.below(hi - lo);
            (format!("{a}+{b}="), (a + b).to_string())
        }
        Task::Copy | Task::Reverse => {
            let len = args.min_len + rng.below((args.max_len - args.min_len + 1) as u64) as usize;
            let s: String = (0..len)
                .map(|_| (b'a' + rng.below(26) as u8) as char)
                .collect();
            if task == Task::Copy {
                (format!("copy: {s}"), s)
            } else {
                let r: String = s.chars().rev().collect();
                (format!("reverse: {s}"), r)
            }
        }
    }
}

/// The rows of a synthetic dataset.
pub(crate) fn rows(args: &SynthArgs) -> Result<Vec<VerlRow>> {
    if args.n == 0 {
        bail_input!("--n must be at least 1");
    }
    if args.task == Task::Add && !(1..=9).contains(&args.digits) {
        bail_input!("--digits {} must be between 1 and 9", args.digits);
    }
    if args.task != Task::Add && (args.min_len == 0 || args.min_len > args.max_len) {
        bail_input!(
            "--min-len {} --max-len {}: need 1 <= min-len <= max-len",
            args.min_len,
            args.max_len
        );
    }
    if args.task != Task::Add && args.answer_format == AnswerFormat::Gsm8k {
        bail_input!(
            "--answer-format gsm8k needs a numeric answer (--task add): the gsm8k rule reads a number after \"####\""
        );
    }
    let mut rng = SplitMix64(args.seed);
    let source = format!("synth/{}", args.task.name());
    Ok((0..args.n)
        .map(|i| {
            let (question, answer) = problem(args.task, &mut rng, args);
            let (content, reference) = match args.answer_format {
                AnswerFormat::Plain => (question.clone(), answer.clone()),
                AnswerFormat::Gsm8k => (
                    format!("{question} Output the final answer after \"####\"."),
                    format!("#### {answer}"),
                ),
            };
            VerlRow {
                data_source: source.clone(),
                prompt: vec![Message::new("user", content)],
                ability: Some("synth".into()),
                ground_truth: answer,
                extra_info: ExtraInfo {
                    split: args.split.clone(),
                    index: i as i64,
                    answer: reference,
                    question,
                },
            }
        })
        .collect())
}

/// `tandem prepare synth`.
pub(crate) fn run(args: SynthArgs) -> Result<()> {
    let rows = rows(&args)?;
    let data = super::verl_record_batch(&rows)?;
    let meta = stage_meta(
        BTreeMap::new(),
        &StageInfo {
            stage: "prepare",
            params: json!({
                "dataset": "synth", "task": args.task.name(), "n": args.n, "seed": args.seed,
                "digits": args.digits, "min_len": args.min_len, "max_len": args.max_len,
                "split": args.split, "answer_format": format!("{:?}", args.answer_format).to_lowercase(),
            }),
            policy_version: None,
            step: None,
        },
    );
    write_file(&args.out, &data, &meta)?;
    eprintln!(
        "prepare: wrote {} synth/{} rows to {}",
        rows.len(),
        args.task.name(),
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(task: Task) -> SynthArgs {
        SynthArgs {
            task,
            n: 50,
            seed: 1,
            out: PathBuf::new(),
            digits: 2,
            min_len: 3,
            max_len: 5,
            split: "train".into(),
            answer_format: AnswerFormat::Plain,
        }
    }

    #[test]
    fn answers_are_right() {
        for r in rows(&args(Task::Add)).unwrap() {
            let q = &r.extra_info.question;
            let (a, b) = q.trim_end_matches('=').split_once('+').unwrap();
            let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
            assert!((10..100).contains(&a) && (10..100).contains(&b), "{q}");
            assert_eq!(r.ground_truth, (a + b).to_string());
            assert_eq!(r.extra_info.answer, r.ground_truth);
            assert_eq!(r.prompt, vec![Message::new("user", q.clone())]);
            assert_eq!(r.data_source, "synth/add");
        }
        for r in rows(&args(Task::Reverse)).unwrap() {
            let s = r.extra_info.question.strip_prefix("reverse: ").unwrap();
            assert!((3..=5).contains(&s.len()));
            assert_eq!(r.ground_truth, s.chars().rev().collect::<String>());
        }
        for r in rows(&args(Task::Copy)).unwrap() {
            assert_eq!(r.extra_info.question, format!("copy: {}", r.ground_truth));
        }
    }

    #[test]
    fn seeded_and_gsm8k_format() {
        let a = rows(&args(Task::Add)).unwrap();
        assert_eq!(a, rows(&args(Task::Add)).unwrap());
        let mut other = args(Task::Add);
        other.seed = 2;
        assert_ne!(a, rows(&other).unwrap());
        other.answer_format = AnswerFormat::Gsm8k;
        let g = rows(&other).unwrap();
        assert_eq!(
            g[0].extra_info.answer,
            format!("#### {}", g[0].ground_truth)
        );
        assert!(g[0].prompt[0].content.ends_with("after \"####\"."));
    }

    #[test]
    fn bad_flags_are_input_errors() {
        let mut a = args(Task::Add);
        a.digits = 0;
        assert!(format!("{:#}", rows(&a).unwrap_err()).contains("--digits 0"));
        let mut a = args(Task::Copy);
        a.min_len = 7;
        assert!(crate::error::is_input_error(&rows(&a).unwrap_err()));
        let mut a = args(Task::Reverse);
        a.answer_format = AnswerFormat::Gsm8k;
        assert!(format!("{:#}", rows(&a).unwrap_err()).contains("needs a numeric answer"));
        let mut a = args(Task::Copy);
        a.n = 0;
        assert!(format!("{:#}", rows(&a).unwrap_err()).contains("--n must be at least 1"));
    }
}
