//! `tandem launch --nproc-per-node N -- COMMAND...`: starts N ranks of COMMAND on this
//! machine, like `torchrun --standalone`. Each child gets RANK, WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT (a free port unless given), and
//! NCCL_NVLS_ENABLE=0 (unless set), plus TANDEM_DIST_TIMEOUT with `--timeout`. The children
//! inherit stdout and stderr.
//!
//! When a rank fails (non-zero exit or a signal), the others are told by the rendezvous store
//! and normally stop within moments; the launcher gives them a second, then sends SIGTERM, and
//! SIGKILL after `--grace`. Each rank writes the failure as it saw it, and the error its `main`
//! ended with, to its error file (TANDEM_DIST_ERROR_FILE, like torchrun's error files), so the
//! launcher can name the rank at fault even when another rank exited first (a hung rank is the
//! last to go), and print its error once, as the last line (the ranks do not print theirs). It exits 2 when
//! that rank exited with 2 (bad input), else 1. SIGINT or SIGTERM to the launcher stops every
//! rank the same way; the children die with the launcher if it is killed (Linux).

use super::group::{parse_seconds, TIMEOUT_ENV};
use crate::error::input_error;
use crate::error::ERROR_FILE_ENV;
use crate::process::die_with_parent;
use anyhow::{anyhow, Result};
use clap::Args;
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Ranks to start on this machine (one per GPU for CUDA ranks).
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Address at which the ranks reach rank 0's rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store (default: a free port).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds a rank waits for another (in a collective, at the rendezvous) before the job
    /// fails; sets TANDEM_DIST_TIMEOUT for the ranks (default 50).
    #[arg(long)]
    pub timeout: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping the remaining ranks.
    #[arg(long, default_value = "5")]
    pub grace: String,
    /// The command every rank runs, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// The signal that asked the launcher to stop (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// A port nobody listens on now (the store binds it a moment later, like torchrun does).
pub(crate) fn free_port(addr: &str) -> Result<u16> {
    let l = TcpListener::bind((addr, 0))
        .or_else(|_| TcpListener::bind(("0.0.0.0", 0)))
        .map_err(|e| anyhow!("cannot find a free port: {e}"))?;
    Ok(l.local_addr()?.port())
}

/// A bare program name found neither on PATH nor elsewhere resolves to the binary of that
/// name next to this one, so `tandem launch -- tandem ...` works from target/release.
fn resolve(program: &str) -> PathBuf {
    if program.contains('/') {
        return PathBuf::from(program);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false);
    if !on_path {
        if let Some(sibling) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join(program)))
            .filter(|p| p.is_file())
        {
            return sibling;
        }
    }
    PathBuf::from(program)
}

/// "exited with code 3" / "was killed by signal 9 (SIGKILL)".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => {
            let name = match s {
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGINT => " (SIGINT)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGBUS => " (SIGBUS)",
                _ => "",
            };
            format!("was killed by signal {s}{name}")
        }
        _ => "ended".into(),
    }
}

struct Rank {
    child: Child,
    done: bool,
    status: Option<ExitStatus>,
    error_file: PathBuf,
}

impl Rank {
    /// Reaps the child if it has ended.
    fn poll(&mut self) -> std::io::Result<()> {
        if !self.done {
            if let Some(s) = self.child.try_wait()? {
                self.done = true;
                self.status = Some(s);
            }
        }
        Ok(())
    }
}

/// A failure as one rank recorded it (see `error::ERROR_FILE_ENV`).
#[derive(serde::Deserialize)]
struct Record {
    suspect: Option<usize>,
    reporter: usize,
    reason: String,
    time: f64,
    /// The error the rank's `main` ended with (else a failure of the job it noticed or was
    /// told of).
    #[serde(default)]
    exit: bool,
}

/// Every rank's records, as (rank, its records in the order written).
fn read_records(ranks: &[Rank]) -> Vec<(usize, Vec<Record>)> {
    let lines = |r: &Rank| {
        let text = std::fs::read_to_string(&r.error_file).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    ranks
        .iter()
        .enumerate()
        .map(|(i, r)| (i, lines(r)))
        .collect()
}

/// The rank at fault and why: the earliest first failure of a rank that it noticed itself
/// (its own error, or another rank's death or silence); a relayed one, which repeats it, only
/// when there is none. A rank's later lines follow from its first and are not causes. When
/// the rank blamed had itself recorded a failure earlier (it was stopping because of another
/// rank: a connection it closed on its way out), the blame follows to that one. When the rank
/// blamed ended with an error of its own, that error is the reason: it writes it after its
/// connections have closed, so another rank may have noticed it go first.
fn culprit(records: &[(usize, Vec<Record>)]) -> Option<(usize, String)> {
    let mut firsts: Vec<(usize, &Record)> = records
        .iter()
        .filter_map(|(i, rs)| Some((*i, rs.first()?)))
        .collect();
    firsts.sort_by(|a, b| {
        let relayed = |(i, r): &(usize, &Record)| (r.reporter != *i) as u8;
        relayed(a)
            .cmp(&relayed(b))
            .then(a.1.time.total_cmp(&b.1.time))
    });
    let mut blame = firsts.iter().find(|(_, r)| r.suspect.is_some())?.1;
    for _ in 0..firsts.len() {
        let suspect = blame.suspect?;
        let earlier = firsts.iter().find(|(i, r)| {
            *i == suspect && r.time < blame.time && r.suspect.is_some_and(|s| s != suspect)
        });
        match earlier {
            Some((_, r)) => blame = r,
            None => break,
        }
    }
    let suspect = blame.suspect?;
    let own = firsts.iter().find(|(i, r)| {
        *i == suspect && r.exit && r.reporter == suspect && r.suspect == Some(suspect)
    });
    Some((
        suspect,
        own.map_or(&blame.reason, |(_, r)| &r.reason).clone(),
    ))
}

/// The errors the ranks' `main`s ended with, once each, leaving out `shown` (printed last).
fn exit_errors<'a>(records: &'a [(usize, Vec<Record>)], shown: &str) -> Vec<(usize, &'a str)> {
    let mut out: Vec<(usize, &str)> = Vec::new();
    for (i, rs) in records {
        for r in rs.iter().filter(|r| r.exit && r.reason != shown) {
            if !out.iter().any(|(_, seen)| *seen == r.reason) {
                out.push((*i, &r.reason));
            }
        }
    }
    out
}

/// SIGTERM to the ranks still running, SIGKILL after `grace`; reaps them all.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    for r in ranks.iter_mut().filter(|r| !r.done) {
        // SAFETY: kill(2) of our own child, not yet reaped.
        unsafe {
            libc::kill(r.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let t = Instant::now();
    while ranks.iter().any(|r| !r.done) && t.elapsed() < grace {
        for r in ranks.iter_mut() {
            let _ = r.poll();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut().filter(|r| !r.done) {
        let _ = r.child.kill();
        r.status = r.child.wait().ok();
        r.done = true;
    }
}

/// Lets the other ranks stop by themselves for up to `wait` (they hear of the failure from
/// the store and say which rank failed), then stops the rest.
fn wind_down(ranks: &mut [Rank], wait: Duration, grace: Duration) {
    let t = Instant::now();
    while ranks.iter().any(|r| !r.done) && t.elapsed() < wait {
        for r in ranks.iter_mut() {
            let _ = r.poll();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop_all(ranks, grace);
}

pub fn run(a: LaunchArgs) -> Result<()> {
    let n = a.nproc_per_node;
    if n == 0 {
        return Err(input_error("--nproc-per-node must be at least 1"));
    }
    let grace = parse_seconds(&a.grace)
        .or((a.grace.trim() == "0").then_some(Duration::ZERO))
        .ok_or_else(|| input_error(format!("--grace '{}' is not a number of seconds", a.grace)))?;
    if let Some(t) = &a.timeout {
        if parse_seconds(t).is_none() {
            return Err(input_error(format!(
                "--timeout '{t}' is not a positive number of seconds"
            )));
        }
    }
    let port = match a.master_port {
        Some(0) => return Err(input_error("--master-port must be from 1 to 65535")),
        Some(p) => p,
        None => free_port(&a.master_addr)?,
    };
    let program = resolve(&a.command[0]);
    let errors = std::env::temp_dir().join(format!("tandem-launch-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&errors)?;
    let result = launch(&a, n, port, grace, &program, &errors);
    let _ = std::fs::remove_dir_all(&errors);
    result
}

fn launch(
    a: &LaunchArgs,
    n: usize,
    port: u16,
    grace: Duration,
    program: &std::path::Path,
    errors: &std::path::Path,
) -> Result<()> {
    // SAFETY: the handler only stores into an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    for i in 0..n {
        let error_file = errors.join(format!("rank-{i}.json"));
        let mut cmd = Command::new(program);
        cmd.args(&a.command[1..])
            .env("RANK", i.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", i.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(ERROR_FILE_ENV, &error_file);
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        if let Some(t) = &a.timeout {
            cmd.env(TIMEOUT_ENV, t.trim());
        }
        die_with_parent(&mut cmd);
        match cmd.spawn() {
            Ok(child) => ranks.push(Rank {
                child,
                done: false,
                status: None,
                error_file,
            }),
            Err(e) => {
                stop_all(&mut ranks, grace);
                return Err(input_error(format!(
                    "cannot start rank {i}: '{}': {e}",
                    program.display()
                )));
            }
        }
    }
    super::say(&format!(
        "tandem launch: {n} rank(s) of '{}', rendezvous at {}:{port}",
        a.command.join(" "),
        a.master_addr
    ));
    loop {
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            super::say(&format!(
                "tandem launch: got signal {sig}; stopping the ranks"
            ));
            stop_all(&mut ranks, grace);
            return Err(anyhow!("stopped by signal {sig}"));
        }
        for r in ranks.iter_mut() {
            r.poll()?;
        }
        if let Some(first) = ranks
            .iter()
            .position(|r| r.status.is_some_and(|s| !s.success()))
        {
            let status = ranks[first].status.unwrap();
            let left = ranks.iter().filter(|r| !r.done).count();
            let rest = match left {
                0 => "no other rank is running".to_string(),
                _ => format!("stopping the other {left} rank(s)"),
            };
            super::say(&format!(
                "tandem launch: rank {first} (pid {}) {}; {rest}",
                ranks[first].child.id(),
                describe(status)
            ));
            wind_down(&mut ranks, Duration::from_secs(1), grace);
            let records = read_records(&ranks);
            let (rank, reason, what) = match culprit(&records) {
                Some((s, reason)) if s < n => {
                    let how = ranks[s].status.map(describe).unwrap_or_default();
                    let what = format!("rank {s} failed ({how}): {reason}");
                    (s, reason, what)
                }
                _ => (
                    first,
                    String::new(),
                    format!(
                        "rank {first} (pid {}) {}",
                        ranks[first].child.id(),
                        describe(status)
                    ),
                ),
            };
            // The ranks' own errors were not printed (run_main wrote them to their files):
            // the cause comes last, once; any other rank's different error above it.
            for (i, e) in exit_errors(&records, &reason) {
                super::say(&format!("tandem launch: rank {i}: error: {e}"));
            }
            return Err(if ranks[rank].status.and_then(|s| s.code()) == Some(2) {
                input_error(what)
            } else {
                anyhow!(what)
            });
        }
        if ranks.iter().all(|r| r.done) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_described() {
        assert_eq!(describe(ExitStatus::from_raw(3 << 8)), "exited with code 3");
        assert_eq!(
            describe(ExitStatus::from_raw(libc::SIGKILL)),
            "was killed by signal 9 (SIGKILL)"
        );
    }

    #[test]
    fn the_cause_is_the_earliest_first_failure_and_printed_once() {
        let rec = |suspect: usize, reporter: usize, reason: &str, time: f64, exit: bool| Record {
            suspect: Some(suspect),
            reporter,
            reason: reason.into(),
            time,
            exit,
        };
        let cause = "in.parquet: cannot open batch file";
        // Rank 0 fails on its input; rank 1 sees rank 0 go, then ends with the same error.
        let records = vec![
            (0, vec![rec(0, 0, cause, 2.0, true)]),
            (
                1,
                vec![
                    rec(0, 1, "rank 0 stopped before finishing", 3.0, false),
                    rec(1, 1, cause, 4.0, true),
                ],
            ),
        ];
        assert_eq!(culprit(&records), Some((0, cause.to_string())));
        assert!(exit_errors(&records, cause).is_empty());
        // Another error than the cause is kept, once.
        let mut more = records;
        more.push((
            2,
            vec![rec(2, 2, "other", 5.0, true), rec(2, 2, "other", 6.0, true)],
        ));
        assert_eq!(exit_errors(&more, cause), [(2, "other")]);
        // A relayed failure counts only when nobody noticed one.
        let relayed = vec![(1, vec![rec(0, 0, "told", 1.0, false)])];
        assert_eq!(culprit(&relayed), Some((0, "told".to_string())));
        // Rank 1 exits without a record; rank 2 hears of it from the store (relayed) and
        // stops; rank 0, in a collective, sees rank 2's connection close first: the blame
        // follows from rank 2 to rank 1.
        let gone = "rank 1 exited or lost its connection to the rendezvous store";
        let chain = vec![
            (
                0,
                vec![rec(2, 0, "the connection to rank 2 closed", 2.0, true)],
            ),
            (
                2,
                vec![rec(1, 0, gone, 1.0, false), rec(2, 2, gone, 1.5, true)],
            ),
        ];
        assert_eq!(culprit(&chain), Some((1, gone.to_string())));
        // Rank 1 fails on its input; its connection closes as its `main` unwinds, rank 0
        // notices that before rank 1 has written its error: the error is the reason.
        let late = vec![
            (
                0,
                vec![rec(1, 0, gone, 1.0, false), rec(0, 0, cause, 1.2, true)],
            ),
            (1, vec![rec(1, 1, cause, 1.1, true)]),
        ];
        assert_eq!(culprit(&late), Some((1, cause.to_string())));
        assert!(exit_errors(&late, cause).is_empty());
    }

    #[test]
    fn bare_names_resolve_next_to_this_binary_only_when_not_on_path() {
        assert_eq!(resolve("./x"), PathBuf::from("./x"));
        assert_eq!(resolve("sh"), PathBuf::from("sh"));
        assert_eq!(
            resolve("no-such-program-xyz"),
            PathBuf::from("no-such-program-xyz")
        );
    }
}
