//! The client side: a stage run with `--daemon PATH` sends its job and relays what comes back
//! (progress bar, the stage's messages, the error with its exit code); `tandem daemon-ctl`
//! (`super::ctl`) uses [`request`] and [`run_job`].

use super::protocol::{Request, Response};
use crate::batch::write_json;
use crate::error::input_error;
use crate::stage::common::progress_bar;
use crate::stage::StageJob;
use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Connects to the daemon at `socket` (an input error that says what to do when nobody
/// listens there).
pub fn connect(socket: &Path) -> Result<UnixStream> {
    UnixStream::connect(socket).map_err(|e| {
        input_error(format!(
            "--daemon {}: cannot connect ({e}); start one with `tandem daemon --socket {} --policy MODEL`, or drop --daemon (and unset TANDEM_DAEMON) to compute in this process",
            socket.display(),
            socket.display()
        ))
    })
}

/// Sends the request. A daemon that refuses the connection (another user's) answers and closes
/// it at once, maybe before the request is written: writing then fails, and the answer is still
/// there to read, so a closed connection is not an error here (reading says what happened).
fn send(stream: &mut UnixStream, req: &Request) -> Result<()> {
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    match stream.write_all(line.as_bytes()) {
        Err(e) if peer_closed(&e) => Ok(()),
        r => Ok(r?),
    }
}

/// Whether an I/O error says the daemon's end of the connection is closed.
fn peer_closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
    )
}

fn parse(line: &str, socket: &Path) -> Result<Response> {
    serde_json::from_str(line).map_err(|e| {
        anyhow!(
            "{}: the daemon sent a line this client does not understand ({e}): {line}",
            socket.display()
        )
    })
}

/// One request with a one-line answer (`health`, `status`, `shutdown`).
pub fn request(socket: &Path, req: &Request) -> Result<Response> {
    let mut stream = connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    send(&mut stream, req)?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .with_context(|| format!("reading the answer of {}", socket.display()))?;
    if line.is_empty() {
        anyhow::bail!("{}: the daemon closed the connection", socket.display());
    }
    parse(line.trim_end(), socket)
}

/// Runs a stage's job on the daemon: the client's working directory goes with it so relative
/// paths mean what they mean here. Exits as the stage would in-process: the same message, and
/// an input error (exit 2) where the stage found bad input.
pub fn run_job(socket: &Path, job: StageJob) -> Result<()> {
    relay(connect(socket)?, socket, job)
}

/// [`run_job`] that gives up once `stop` says so (checked every 20 ms): it closes the
/// connection, and the daemon cancels a job whose client went away. Ok(false) when stopped.
pub(crate) fn run_job_until(
    socket: &Path,
    job: StageJob,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<bool> {
    let stream = connect(socket)?;
    let watch = stream.try_clone()?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let stopped = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            use std::sync::atomic::Ordering::SeqCst;
            while !done.load(SeqCst) {
                if stop() {
                    stopped.store(true, SeqCst);
                    let _ = watch.shutdown(std::net::Shutdown::Both);
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let r = relay(stream, socket, job);
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    });
    match stopped.into_inner() {
        true => Ok(false),
        false => result.map(|()| true),
    }
}

/// Sends `job` on `stream` and relays what comes back until its `done` or `error` line.
fn relay(mut stream: UnixStream, socket: &Path, job: StageJob) -> Result<()> {
    let cwd = std::env::current_dir()?;
    let name = job.name();
    let metrics_path = job.metrics_path().cloned();
    // A daemon that dies mid-job closes (or resets) the connection: one message for every way
    // that shows up, as docs/DAEMON.md gives it.
    let closed = || {
        anyhow!(
            "{}: the daemon closed the connection before the {name} job finished (did it die? see its log); nothing was written",
            socket.display()
        )
    };
    let req = Request::Job {
        cwd,
        job: Box::new(job),
    };
    send(&mut stream, &req)?;
    let mut bar: Option<ProgressBar> = None;
    for line in BufReader::new(stream).lines() {
        let line = match line {
            Err(e) if peer_closed(&e) => return Err(closed()),
            r => r.with_context(|| format!("reading from {}", socket.display()))?,
        };
        match parse(&line, socket)? {
            Response::Progress { what, pos, len } => {
                let b = bar.get_or_insert_with(|| progress_bar(len as usize, &what));
                b.set_length(len);
                b.set_position(pos);
            }
            Response::Log { line } => match &bar {
                Some(b) => b.suspend(|| eprintln!("{line}")),
                None => eprintln!("{line}"),
            },
            Response::Done { metrics } => {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                // The stage's metrics file gains what only the daemon knows (memory per phase,
                // whether it had to load the model).
                if let Some(path) = metrics_path {
                    add_daemon_metrics(&path, metrics.clone())?;
                }
                if name == "sync-weights" {
                    eprintln!(
                        "sync-weights: daemon took the policy in memory in {:.3} ms (extra device memory {} bytes)",
                        1e3 * metrics["sync_seconds"].as_f64().unwrap_or(0.0),
                        metrics["sync_extra_memory"]
                    );
                }
                return Ok(());
            }
            Response::Error {
                message,
                input_error: bad_input,
            } => {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                return Err(if bad_input {
                    input_error(message)
                } else {
                    anyhow!(message)
                });
            }
            Response::Status { .. } | Response::ShuttingDown => {}
        }
    }
    Err(closed())
}

fn add_daemon_metrics(path: &Path, daemon: Value) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} back", path.display()))?;
    let mut v: Value = serde_json::from_str(&text)?;
    if let Some(m) = v.as_object_mut() {
        m.insert("daemon".into(), daemon);
    }
    write_json(path, &v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::sync_weights::SyncWeightsArgs;
    use std::os::unix::net::UnixListener;

    fn job() -> StageJob {
        StageJob::SyncWeights(SyncWeightsArgs {
            from: "ckpt".into(),
            to: "policy".into(),
            policy_version: None,
            daemon: None,
        })
    }

    /// A daemon that dies mid-job, whether the client then reads a reset or the end of the
    /// stream, gives the one message docs/DAEMON.md documents.
    #[test]
    fn a_daemon_that_dies_mid_job_gives_the_documented_message() {
        let dir = tempfile::tempdir().unwrap();
        for read_request in [false, true] {
            let socket = dir.path().join(format!("d{read_request}.sock"));
            let listener = UnixListener::bind(&socket).unwrap();
            let server = std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                if read_request {
                    let mut line = String::new();
                    BufReader::new(s.try_clone().unwrap())
                        .read_line(&mut line)
                        .unwrap();
                    s.write_all(b"{\"type\":\"log\",\"line\":\"working\"}\n")
                        .unwrap();
                }
                // Dying with the request unread resets the client's connection
                // (ECONNRESET); after reading it, the client sees the end of the stream.
                std::thread::sleep(Duration::from_millis(200));
            });
            let err = run_job(&socket, job()).unwrap_err();
            server.join().unwrap();
            let msg = format!("{err:#}");
            assert!(
                msg.contains(
                    "the daemon closed the connection before the sync-weights job finished"
                ),
                "{msg}"
            );
            assert!(!msg.contains("os error"), "{msg}");
            assert!(!crate::error::is_input_error(&err));
        }
    }
}
