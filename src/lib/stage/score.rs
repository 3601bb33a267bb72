//! `score --in B --out B2 --reward SPEC`: add a reward to every row of a batch (`score` and
//! `score_<key>` columns). The rules, the external-program protocol and the summary live in
//! `crate::reward`; this file holds the stage's flags.

use super::common::{at_least, finite, negative_numbers};
use crate::bail_input;
use crate::error::input_error;
use crate::reward::{overlong, Gsm8kMethod, Options, OverlongFlags, RewardSpec, StageConfig};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
#[command(
    about = "Score the responses of a batch file with a reward rule or program",
    after_help = "SPEC: gsm8k | math | exact | regex:PATTERN | cmd:PROGRAM [ARGS] | python:FILE.py[:FUNC] | agent",
    mut_args = negative_numbers
)]
pub struct ScoreArgs {
    /// Input batch (Parquet) with response_text and the ground truth.
    #[arg(long = "in", value_name = "B")]
    pub input: PathBuf,
    /// Output batch: the input plus `score` (and `score_<key>` sub-scores).
    #[arg(long = "out", value_name = "B2")]
    pub output: PathBuf,
    /// The reward: gsm8k, math, exact, regex:PATTERN, cmd:PROGRAM [ARGS], python:FILE.py[:FUNC],
    /// or agent (keep the `score` the agent posted to `tandem serve`; every row needs one).
    #[arg(long, value_name = "SPEC")]
    pub reward: String,
    /// Score of an answer that was found but is wrong (gsm8k, math, regex); any finite number.
    #[arg(long, default_value_t = 0.0, value_parser = finite::<f32>())]
    pub format_score: f32,
    /// gsm8k: `strict` takes the last "#### N", `flexible` the last number.
    #[arg(long, value_enum, default_value_t = Gsm8kMethod::Strict)]
    pub gsm8k_method: Gsm8kMethod,
    /// gsm8k strict: the score of a response without "#### N" whose last number is right
    /// (e.g. 0.5 pays for the right number before the model learns the format; 0: verl's rule).
    #[arg(long, default_value_t = 0.0, value_parser = finite::<f32>())]
    pub flexible_score: f32,
    /// cmd/python: longest wait for one answer, in milliseconds (>= 1; the first includes the
    /// program's start-up).
    #[arg(long, default_value_t = 30_000, value_name = "MS", value_parser = at_least(1u64))]
    pub timeout_ms: u64,
    /// cmd/python: longest time for the whole batch, in milliseconds (0 = no limit).
    #[arg(long, default_value_t = 0, value_name = "MS", value_parser = at_least(0u64))]
    pub run_timeout_ms: u64,
    /// python: the interpreter that runs the driver.
    #[arg(long, default_value = "python3", value_name = "PATH")]
    pub python: String,
    /// python: extra keyword arguments for the function, as a JSON object (verl's reward_kwargs).
    #[arg(long, default_value = "{}", value_name = "JSON")]
    pub reward_kwargs: String,
    /// DAPO's soft overlong punishment: the last N tokens before the length limit over which
    /// the score loses up to --overlong-penalty-factor, linearly (past the limit: all of it).
    /// The penalty is written as `score_overlong`, the unshaped correctness as `score_acc`.
    /// In tokens, >= 0 (0: off).
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = at_least(0usize))]
    pub overlong_buffer_len: usize,
    /// The overlong penalty at (and past) the length limit, >= 0 (in score units).
    #[arg(long, default_value_t = 1.0, value_name = "F", value_parser = at_least(0.0f32))]
    pub overlong_penalty_factor: f32,
    /// The length limit L_max of the overlong penalty, in response tokens, >= 1 (default: the
    /// rollout's --max-new-tokens, recorded in the batch).
    #[arg(long, value_name = "N", value_parser = at_least(1usize))]
    pub max_response_length: Option<usize>,
    /// Also write the summary as one JSON object to FILE.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

impl ScoreArgs {
    /// The reward module's configuration the flags describe (flag errors are input errors).
    pub fn config(&self) -> Result<StageConfig> {
        let reward_kwargs = serde_json::from_str(&self.reward_kwargs)
            .map_err(|e| input_error(format!("--reward-kwargs: not JSON: {e}")))?;
        Ok(StageConfig {
            input: self.input.clone(),
            output: self.output.clone(),
            reward: self.reward.clone(),
            options: Options {
                format_score: self.format_score,
                gsm8k_method: self.gsm8k_method,
                flexible_score: self.flexible_score,
                timeout: Duration::from_millis(self.timeout_ms),
                run_timeout: (self.run_timeout_ms > 0)
                    .then(|| Duration::from_millis(self.run_timeout_ms)),
                python: self.python.clone(),
                reward_kwargs,
            },
            overlong: (self.overlong_buffer_len > 0).then_some(OverlongFlags {
                buffer: self.overlong_buffer_len,
                factor: self.overlong_penalty_factor,
                max_len: self.max_response_length,
            }),
            metrics: self.metrics.clone(),
        })
    }

    /// Checks the flags as the stage does before reading its input (a `python:` reward's file
    /// must exist).
    pub fn check(&self) -> Result<()> {
        let cfg = self.config()?;
        RewardSpec::parse(&cfg.reward)?;
        cfg.options.validate()?;
        overlong::check_factor(self.overlong_penalty_factor)?;
        match (self.max_response_length, cfg.overlong) {
            (Some(max), Some(f)) => {
                overlong::Overlong::new(max, f.buffer, f.factor, "--max-response-length")?;
            }
            (Some(_), None) => bail_input!(
                "--max-response-length is the length limit of the overlong penalty: it needs --overlong-buffer-len N"
            ),
            _ => {}
        }
        Ok(())
    }
}

pub fn run(args: ScoreArgs) -> Result<()> {
    args.check()?;
    super::common::refuse_in_place(&args.input, &args.output, "out")?;
    crate::reward::run_stage(&args.config()?).map(|_| ())
}
