//! `score`: add a reward to every row of a batch (`score` and `score_<key>` columns).
//! The rules, the external-program protocol and the summary live in `tandem::reward`.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tandem::reward::{Gsm8kMethod, Options, StageConfig};

#[derive(Parser)]
#[command(
    name = "score",
    version,
    about = "Score the responses of a batch file with a reward rule or program",
    after_help = "SPEC: gsm8k | math | exact | regex:PATTERN | cmd:PROGRAM [ARGS] | python:FILE.py[:FUNC]"
)]
struct Args {
    /// Input batch (Parquet) with response_text and the ground truth.
    #[arg(long = "in", value_name = "B")]
    input: PathBuf,
    /// Output batch: the input plus `score` (and `score_<key>` sub-scores).
    #[arg(long = "out", value_name = "B2")]
    output: PathBuf,
    /// The reward: gsm8k, math, exact, regex:PATTERN, cmd:PROGRAM [ARGS], python:FILE.py[:FUNC].
    #[arg(long, value_name = "SPEC")]
    reward: String,
    /// Score of an answer that was found but is wrong (gsm8k, math, regex).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    format_score: f32,
    /// gsm8k: `strict` takes the last "#### N", `flexible` the last number.
    #[arg(long, value_enum, default_value_t = Gsm8kMethod::Strict)]
    gsm8k_method: Gsm8kMethod,
    /// cmd/python: longest wait for one answer (the first includes the program's start-up).
    #[arg(long, default_value_t = 30_000, value_name = "N")]
    timeout_ms: u64,
    /// cmd/python: longest time for the whole batch (0 = no limit).
    #[arg(long, default_value_t = 0, value_name = "N")]
    run_timeout_ms: u64,
    /// python: the interpreter that runs the driver.
    #[arg(long, default_value = "python3", value_name = "PATH")]
    python: String,
    /// python: extra keyword arguments for the function, as a JSON object (verl's reward_kwargs).
    #[arg(long, default_value = "{}", value_name = "JSON")]
    reward_kwargs: String,
    /// Also write the summary as one JSON object to FILE.
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tandem::error::run_main(|| {
        let reward_kwargs = serde_json::from_str(&args.reward_kwargs)
            .map_err(|e| tandem::error::input_error(format!("--reward-kwargs: not JSON: {e}")))?;
        let cfg = StageConfig {
            input: args.input,
            output: args.output,
            reward: args.reward,
            options: Options {
                format_score: args.format_score,
                gsm8k_method: args.gsm8k_method,
                timeout: Duration::from_millis(args.timeout_ms),
                run_timeout: (args.run_timeout_ms > 0)
                    .then(|| Duration::from_millis(args.run_timeout_ms)),
                python: args.python,
                reward_kwargs,
            },
            metrics: args.metrics,
        };
        tandem::reward::run_stage(&cfg).map(|_| ())
    })
}
