//! `tandem daemon-ctl`: ask a running daemon for its health or status, have it write the policy
//! it holds to files (`save`, the way out of `update --resident`), or stop it.

use super::client::{request, run_job};
use super::protocol::{Request, Response};
use crate::stage::save::SavePolicyArgs;
use crate::stage::StageJob;
use anyhow::Result;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// What `tandem daemon-ctl` asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CtlCommand {
    /// Exit 0 and print the status when the daemon answers.
    Health,
    /// Print the status JSON (models held, policy_version, memory per phase, uptime).
    Status,
    /// Write the policy the daemon holds to --out: weights, optimizer and trainer state, as
    /// `update` writes them (a queued job: it runs after the running one).
    Save,
    /// Stop the daemon after its running job; the socket is removed.
    Shutdown,
}

#[derive(Args, Debug, Clone)]
#[command(about = "Ask a running daemon for its health or status, save its policy, or stop it")]
pub struct DaemonCtlArgs {
    /// The daemon's socket.
    #[arg(long)]
    pub socket: PathBuf,
    #[arg(value_enum)]
    pub command: CtlCommand,
    /// save: the model directory to write (may be the resident directory itself).
    #[arg(long, required_if_eq("command", "save"))]
    pub out: Option<PathBuf>,
    /// save: only if the daemon holds this checkpoint (a directory, resident or not, or a
    /// sync-weights pointer) [default: whatever policy it holds].
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn run_ctl(args: DaemonCtlArgs) -> Result<()> {
    let req = match args.command {
        CtlCommand::Health => Request::Health,
        CtlCommand::Status => Request::Status,
        CtlCommand::Shutdown => Request::Shutdown,
        CtlCommand::Save => {
            let out = args.out.expect("clap requires --out with save");
            let job = StageJob::SavePolicy(SavePolicyArgs {
                out,
                model: args.model,
            });
            return run_job(&args.socket, job);
        }
    };
    match request(&args.socket, &req)? {
        Response::Status { status } => println!("{}", serde_json::to_string_pretty(&status)?),
        Response::ShuttingDown => eprintln!("daemon at {}: shutting down", args.socket.display()),
        Response::Error { message, .. } => anyhow::bail!("{message}"),
        other => anyhow::bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}
