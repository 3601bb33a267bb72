//! What the runner shows and what it logs.
//!
//! The console (stderr) gets one line per step (`step N/total`, the key metrics, the step's
//! time, the ETA), the runner's own events (resume, daemon restarts, rewinds) and every error;
//! on a terminal a progress bar sits under them. Piped, the per-step lines are the progress.
//! Everything the stages print goes to `RUN/pipeline.log` after the command that ran them, as
//! do the runner's lines; `pipeline run -v` also shows the stages' output on the console. A
//! stage that fails has the last lines of its output in the error message.

use crate::process::GroupGuard;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Output lines of a stage kept for its error message.
pub(crate) const TAIL_LINES: usize = 12;

/// The runner's console and log file.
pub struct Console {
    /// The progress bar (hidden when stderr is not a terminal).
    pub bar: ProgressBar,
    /// `-v`: show the stages' output on the console too.
    pub verbose: bool,
    /// `RUN/pipeline.log`, once the run directory exists.
    log: Option<(PathBuf, Mutex<File>)>,
    /// When this process began its first step and how many steps were done then (for the ETA).
    since: Option<(Instant, u64)>,
}

/// What a captured stage command did.
pub(crate) struct Captured {
    pub(crate) status: ExitStatus,
    /// Its last output lines (stdout and stderr, in the order they came).
    pub(crate) tail: Vec<String>,
    /// Killed at its time limit (`run_in_group`).
    pub(crate) timed_out: bool,
}

impl Console {
    pub fn new(verbose: bool) -> Console {
        Console {
            bar: ProgressBar::hidden(),
            verbose,
            log: None,
            since: None,
        }
    }

    /// Appends to `path` from now on, starting with a line saying who runs.
    pub(crate) fn open_log(&mut self, path: &Path) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let argv: Vec<String> = std::env::args().collect();
        writeln!(
            f,
            "# {} pid {}: {}",
            chrono::Local::now().format("%Y-%m-%d %H:%M:%S"),
            std::process::id(),
            argv.join(" ")
        )?;
        self.log = Some((path.to_path_buf(), Mutex::new(f)));
        Ok(())
    }

    /// A console for a thread that runs a stage beside the runner's own work (one-step-off's
    /// update beside dynamic sampling): the same log, opened again for appending (whole
    /// lines, so the two interleave by line), and the same progress bar.
    pub(crate) fn beside(&self) -> Result<Console> {
        let log = match &self.log {
            Some((path, _)) => {
                let f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                Some((path.clone(), Mutex::new(f)))
            }
            None => None,
        };
        Ok(Console {
            bar: self.bar.clone(),
            verbose: self.verbose,
            log,
            since: None,
        })
    }

    pub(crate) fn log_path(&self) -> Option<&Path> {
        self.log.as_ref().map(|(p, _)| p.as_path())
    }

    /// Whether the console is a terminal (a progress bar is drawn).
    pub(crate) fn is_terminal() -> bool {
        std::io::stderr().is_terminal()
    }

    fn to_log(&self, line: &str) {
        if let Some((_, f)) = &self.log {
            if let Ok(mut f) = f.lock() {
                let _ = writeln!(f, "{line}");
            }
        }
    }

    fn to_console(&self, line: &str) {
        self.bar.suspend(|| eprintln!("{line}"));
    }

    /// A line for the console and the log: a step line, an event of the run.
    pub fn say(&self, line: &str) {
        self.to_console(line);
        self.to_log(line);
    }

    /// A line for the log, and the console with `-v`: a stage's command and output.
    pub(crate) fn detail(&self, line: &str) {
        if self.verbose {
            self.to_console(line);
        }
        self.to_log(line);
    }

    /// Runs `cmd` with its stdout and stderr captured line by line into the log (and the
    /// console with `-v`). A program the stage left behind holding the pipe does not hold the
    /// runner: once the stage has exited, what is still unread after a short wait is dropped.
    pub fn run(&self, cmd: &mut Command) -> std::io::Result<Captured> {
        self.capture(cmd, None)
    }

    /// `run` for a program of the user's (an agent): in a process group of its own, killed
    /// with everything it started when it exits, when this process ends on a signal, or after
    /// `limit` (then `timed_out`).
    pub(crate) fn run_in_group(
        &self,
        cmd: &mut Command,
        limit: Option<Duration>,
    ) -> std::io::Result<Captured> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        self.capture(cmd, Some(limit))
    }

    /// `group`: the command leads a process group to guard, with its time limit.
    fn capture(
        &self,
        cmd: &mut Command,
        group: Option<Option<Duration>>,
    ) -> std::io::Result<Captured> {
        let (reader, writer) = std::io::pipe()?;
        cmd.stdout(writer.try_clone()?).stderr(writer);
        let spawned = cmd.spawn();
        // The command holds the write end until its stdio is replaced: without this the
        // reader would never see the end of the output.
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        let mut child = spawned?;
        let mut guard = group.map(|_| GroupGuard::new(child.id()));
        let deadline = group.flatten().map(|d| Instant::now() + d);
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut r = BufReader::new(reader);
            let mut buf = Vec::new();
            while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                let line = String::from_utf8_lossy(&buf);
                if tx
                    .send(line.trim_end_matches(['\n', '\r']).to_string())
                    .is_err()
                {
                    return;
                }
                buf.clear();
            }
        });
        let mut tail = VecDeque::with_capacity(TAIL_LINES);
        let mut keep = |line: String| {
            self.detail(&line);
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line);
        };
        let tick = Duration::from_millis(50);
        let mut exited: Option<(ExitStatus, Instant)> = None;
        let mut checked = Instant::now();
        let mut timed_out = false;
        loop {
            match rx.recv_timeout(tick) {
                Ok(line) => keep(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            if exited.is_none() && checked.elapsed() >= tick {
                exited = child.try_wait()?.map(|s| (s, Instant::now()));
                checked = Instant::now();
            }
            if exited.is_none() && deadline.is_some_and(|d| Instant::now() >= d) {
                timed_out = true;
                guard.as_mut().map(GroupGuard::kill);
                exited = Some((child.wait()?, Instant::now()));
            }
            if exited.is_some_and(|(_, at)| at.elapsed() > Duration::from_millis(500)) {
                break;
            }
        }
        let status = match exited {
            Some((s, _)) => s,
            None => child.wait()?,
        };
        Ok(Captured {
            status,
            tail: tail.into(),
            timed_out,
        })
    }

    /// Notes that step `done` has just finished (`total` in the run) and returns the expected
    /// time to the end, from the pace of the steps this process ran.
    pub(crate) fn eta(&mut self, done: u64, total: u64) -> Option<Duration> {
        let (t0, first) = *self.since.get_or_insert((Instant::now(), done));
        let ran = done.checked_sub(first).filter(|&n| n > 0)?;
        let left = total.checked_sub(done).filter(|&n| n > 0)?;
        Some(t0.elapsed().mul_f64(left as f64 / ran as f64))
    }

    /// Starts the ETA clock at `done` finished steps (when the first step of this process
    /// begins), unless it runs already.
    pub(crate) fn start_clock(&mut self, done: u64) {
        self.since.get_or_insert((Instant::now(), done));
    }
}

/// `1h02m`, `3m05s`, `12s`.
pub(crate) fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_short() {
        assert_eq!(short_duration(Duration::from_secs(12)), "12s");
        assert_eq!(short_duration(Duration::from_secs(185)), "3m05s");
        assert_eq!(short_duration(Duration::from_secs(3720)), "1h02m");
    }

    #[test]
    fn captured_output_goes_to_the_log_in_order_with_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("pipeline.log");
        let mut c = Console::new(false);
        c.open_log(&log).unwrap();
        let script = "for i in $(seq 1 20); do echo out $i; echo err $i >&2; done; exit 3";
        let got = c.run(Command::new("sh").args(["-c", script])).unwrap();
        assert_eq!(got.status.code(), Some(3));
        assert_eq!(got.tail.len(), TAIL_LINES);
        assert_eq!(got.tail.last().unwrap(), "err 20");
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(lines.len(), 40);
        assert_eq!(lines[0], "out 1");
        assert_eq!(lines[39], "err 20");
    }

    #[test]
    fn a_program_left_holding_the_pipe_does_not_hold_the_runner() {
        let c = Console::new(false);
        let t0 = Instant::now();
        // The shell exits at once; its background sleep keeps the pipe open for 30 s.
        let got = c
            .run(Command::new("sh").args(["-c", "echo hi; sleep 30 & exit 0"]))
            .unwrap();
        assert!(got.status.success());
        assert_eq!(got.tail, ["hi"]);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    #[test]
    fn the_eta_follows_the_pace_of_this_process() {
        let mut c = Console::new(false);
        c.start_clock(10);
        std::thread::sleep(Duration::from_millis(100));
        // 2 steps in ~0.1 s, 8 to go: ~0.4 s.
        let eta = c.eta(12, 20).unwrap();
        assert!(
            eta >= Duration::from_millis(380) && eta < Duration::from_secs(2),
            "{eta:?}"
        );
        assert!(c.eta(20, 20).is_none());
    }
}
