//! `tandem daemon-ctl`: ask a running daemon for its health or status, have it write the policy
//! it holds to files (`save`, the way out of `update --resident`), move the policy it holds to
//! another daemon group (`transfer`, a `[placement]` run's weight sync), or stop it.

use super::client::{request, run_job};
use super::protocol::{Request, Response};
use crate::stage::save::SavePolicyArgs;
use crate::stage::transfer::{Side, TransferArgs};
use crate::stage::StageJob;
use anyhow::Result;
use clap::{Args, ValueEnum};
use serde_json::Value;
use std::path::{Path, PathBuf};

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
    /// Send the policy --model that this daemon (group) holds to every rank of the daemon
    /// (group) at --to, in buckets over a communicator between them; the receivers generate
    /// with it from then on (a queued job on both).
    Transfer,
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
    #[arg(long, required_if_eq("command", "transfer"))]
    pub model: Option<PathBuf>,
    /// transfer: the receiving daemon's socket (rank 0's of its group).
    #[arg(long, required_if_eq("command", "transfer"))]
    pub to: Option<PathBuf>,
    /// transfer: ranks of the receiving group.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub receivers: u64,
    /// transfer: MiB of a bucket, counted at 4 bytes an element (the CPU's f32; a GPU's bf16
    /// buckets take half).
    #[arg(long, default_value_t = 256)]
    pub bucket_mb: u64,
    /// transfer: the rendezvous port of the two groups on 127.0.0.1 [default: a free one].
    #[arg(long)]
    pub port: Option<u16>,
    /// transfer: write its metrics here (JSON: seconds, bytes, GB/s).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// transfer: meet on a new bridge and end it after the transfer, rather than reuse the one
    /// both groups kept from their last transfer and keep it.
    #[arg(long)]
    pub fresh_bridge: bool,
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
        CtlCommand::Transfer => return transfer(&args),
    };
    match request(&args.socket, &req)? {
        Response::Status { status } => println!("{}", serde_json::to_string_pretty(&status)?),
        Response::ShuttingDown => eprintln!("daemon at {}: shutting down", args.socket.display()),
        Response::Error { message, .. } => anyhow::bail!("{message}"),
        other => anyhow::bail!("unexpected answer: {other:?}"),
    }
    Ok(())
}

/// `daemon-ctl transfer`: both groups' parts at once (each waits for the other at the bridge's
/// rendezvous); fails naming the side that failed. The bridge both groups kept from their last
/// transfer carries it when every end still holds it; if that transfer fails (an end went away
/// between the status and the job), it runs once more on a new bridge.
fn transfer(args: &DaemonCtlArgs) -> Result<()> {
    let to = args.to.clone().expect("clap requires --to with transfer");
    if args.bucket_mb == 0 {
        crate::bail_input!("--bucket-mb must be at least 1");
    }
    let new_port = || match args.port {
        Some(p) => Ok(p),
        None => crate::parallel::launch::free_port("127.0.0.1"),
    };
    let port = new_port()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let fresh = format!(
        "{}-{port}-{}",
        std::process::id(),
        now.map_or(0, |d| d.as_nanos())
    );
    let kept = match args.fresh_bridge {
        true => None,
        false => kept_bridge(&args.socket, &to, args.receivers as usize),
    };
    match kept {
        Some(id) => transfer_on(args, &to, port, &id, true).or_else(|e| {
            eprintln!("daemon-ctl transfer: over the kept bridge: {e:#}; again on a new one");
            // A new port: the failed attempt's ends may still hold the first one.
            transfer_on(args, &to, new_port()?, &fresh, false)
        }),
        None => transfer_on(args, &to, port, &fresh, false),
    }
}

/// One transfer on the bridge `id`: the one every end kept (`reuse`), or a new one met at
/// `port`.
fn transfer_on(args: &DaemonCtlArgs, to: &Path, port: u16, id: &str, reuse: bool) -> Result<()> {
    let model = args
        .model
        .clone()
        .expect("clap requires --model with transfer");
    let job = |side: Side| {
        StageJob::Transfer(TransferArgs {
            model: model.clone(),
            side,
            port,
            bridge: id.to_string(),
            reuse,
            keep: !args.fresh_bridge,
            receivers: args.receivers as usize,
            bucket_elems: (args.bucket_mb as usize) << 18,
            metrics: (side == Side::Receive)
                .then(|| args.metrics.clone())
                .flatten(),
        })
    };
    let (sent, received) = std::thread::scope(|s| {
        let send = s.spawn(|| run_job(&args.socket, job(Side::Send)));
        let received = run_job(to, job(Side::Receive));
        (send.join(), received)
    });
    let sent = sent.unwrap_or_else(|_| Err(anyhow::anyhow!("the sending client panicked")));
    match (sent, received) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), _) => Err(e.context(format!("transfer: the sender {}", args.socket.display()))),
        (_, Err(e)) => Err(e.context(format!("transfer: the receiver {}", to.display()))),
    }
}

/// The id of the bridge the groups at `from` and `to` kept from their last transfer, when
/// every end holds that one, working, in its place: the sending group's rank 0 (the one that
/// sends) and each of the `receivers` ranks at `to` (from its rank 0's status of every rank).
fn kept_bridge(from: &Path, to: &Path, receivers: usize) -> Option<String> {
    let bridges = |socket: &Path, every_rank: bool| -> Option<Vec<Value>> {
        let Ok(Response::Status { status }) = request(socket, &Request::Status) else {
            return None;
        };
        let ranks = match (every_rank, status.get("ranks")) {
            (true, Some(Value::Array(r))) => r.clone(),
            _ => vec![status],
        };
        Some(
            ranks
                .iter()
                .map(|r| r["resident"]["bridge"].clone())
                .collect(),
        )
    };
    let sender = bridges(from, false)?;
    let takers = bridges(to, true)?;
    let id = sender.first()?["id"].as_str()?.to_string();
    let place = |b: &Value, rank: usize| {
        b["id"] == id.as_str()
            && b["healthy"] == true
            && b["rank"] == rank
            && b["world"] == 1 + receivers
    };
    let all = takers.len() == receivers
        && place(&sender[0], 0)
        && takers.iter().enumerate().all(|(r, b)| place(b, 1 + r));
    all.then_some(id)
}
