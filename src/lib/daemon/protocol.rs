//! The daemon's wire format: one JSON object per line in each direction over a unix socket.
//!
//! A client sends one request line; for a `job` the daemon answers with any number of
//! `progress` and `log` lines, then exactly one `done` or `error` line. `health`, `status` and
//! `shutdown` get one line back. Batch data never crosses the socket: requests name files.
//!
//! ```text
//! > {"type":"job","cwd":"/runs/a","job":{"stage":"update","args":{"model":"policy",...}}}
//! < {"type":"progress","what":"update","pos":3,"len":8}
//! < {"type":"log","line":"update: 8 rows, 1 optimizer steps ..."}
//! < {"type":"done","metrics":{"phase":"update","seconds":0.41,...}}
//! ```

use crate::stage::StageJob;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A request line.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Request {
    /// Run a stage. Relative paths in its arguments are relative to `cwd` (the client's working
    /// directory), as they would be in-process.
    Job { cwd: PathBuf, job: Box<StageJob> },
    /// Is the daemon up? Answered at once, even while a job runs.
    Health,
    /// What the daemon holds: models, policy_version, memory per phase, uptime.
    Status,
    /// Finish the running job, refuse the queued ones, remove the socket, exit.
    Shutdown,
}

/// A response line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Response {
    /// `pos` of `len` steps of the part `what` are done.
    Progress { what: String, pos: u64, len: u64 },
    /// A message line of the stage (what it prints on stderr in-process).
    Log { line: String },
    /// The job finished; the daemon's own metrics (phase, memory, load and queue time).
    Done { metrics: Value },
    /// The job (or the request) failed. `input_error`: bad input, the client exits 2.
    Error { message: String, input_error: bool },
    /// Answer to `health` and `status`.
    Status { status: Value },
    /// Answer to `shutdown`.
    ShuttingDown,
}

/// The write half of a client connection, shared by a job's log and progress lines.
#[derive(Clone)]
pub(crate) struct Reply(pub Arc<Mutex<UnixStream>>);

impl Reply {
    /// Sends one line; a client that went away is not an error of the job.
    pub fn send(&self, r: &Response) {
        let mut line = serde_json::to_string(r).expect("responses serialize");
        line.push('\n');
        if let Ok(mut s) = self.0.lock() {
            let _ = s.write_all(line.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::update::UpdateArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: UpdateArgs,
    }

    #[test]
    fn stage_args_round_trip_through_json() {
        let cli = Cli::parse_from([
            "update",
            "--model",
            "m",
            "--in",
            "b.parquet",
            "--out-model",
            "o",
            "--loss",
            "gspo",
            "--loss-agg-mode",
            "seq-mean-token-sum",
            "--kl-loss-type",
            "low_var_kl+",
            "--rollout-is",
            "sequence",
            "--lr-schedule",
            "cosine",
            "--betas",
            "0.8,0.95",
            "--device",
            "cuda:1",
            "--daemon",
            "/tmp/s",
        ]);
        let req = Request::Job {
            cwd: "/x".into(),
            job: Box::new(StageJob::Update(cli.args.clone())),
        };
        let line = serde_json::to_string(&req).unwrap();
        assert!(line.contains(r#""stage":"update""#), "{line}");
        let back: Request = serde_json::from_str(&line).unwrap();
        let Request::Job { job, .. } = back else {
            panic!("{line}")
        };
        let StageJob::Update(a) = *job else {
            panic!("{line}")
        };
        assert_eq!(format!("{a:?}"), format!("{:?}", cli.args));
    }

    #[test]
    fn malformed_lines_are_refused() {
        for bad in [
            "",
            "{",
            r#"{"type":"job"}"#,
            r#"{"type":"job","cwd":"/","job":{"stage":"rollout","args":{}}}"#,
            r#"{"type":"nap"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        let r: Request = serde_json::from_str(r#"{"type":"health"}"#).unwrap();
        assert!(matches!(r, Request::Health));
    }
}
