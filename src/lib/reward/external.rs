//! Rewards computed by another program: `cmd:PROGRAM [ARGS]` and `python:FILE.py[:FUNC]`.
//!
//! Protocol: the program is started once per batch (argv, never a shell) and gets one JSON
//! line per row on stdin, `{"data_source", "solution_str", "ground_truth", "extra_info"}`.
//! It answers each with one line on stdout, in order: a number, or an object with a numeric
//! `score` and any other keys, each of which becomes a `score_<key>` column: float32 for a
//! number (or boolean), utf8 for a string, null, list or object (lists and objects as their
//! compact JSON text), as verl keeps every value of a reward's dict (`reward_extra_info`). Every
//! row must give the same keys, and a key numeric in one row must be numeric in all. Blank
//! output lines are skipped.
//!
//! Limits: each answer must come within the per-row timeout of the previous one (the first
//! within the timeout of the start, so it includes the program's start-up), and all of them
//! within the optional whole-run timeout. A program that exits, hangs, prints something that
//! is not an answer, or answers NaN/Infinity stops the stage with an error naming the row;
//! the program and everything it started (its process group) are killed first. stdin is fed
//! from a thread, so a program that answers before reading all its input cannot deadlock.
//! The program's stderr is passed through, and its last lines are quoted in the error.
//!
//! The program dies with `score`: it runs in its own process group with `PR_SET_PDEATHSIG`
//! (a `score` killed by any signal, SIGKILL included, takes it down), and that group is
//! killed when scoring ends in any way, and before `score` ends on SIGTERM, SIGINT or SIGHUP
//! ([`crate::process`]).
//!
//! `python:` runs the same protocol through `driver.py` (shipped inside the binary and given
//! to the interpreter as `python3 -c SOURCE`, so no file is written for it), which calls a
//! verl-style `compute_score(data_source, solution_str, ground_truth, extra_info)`.

use super::Scores;
use crate::error::input_error;
use crate::process::{die_with_parent, GroupGuard};
use anyhow::Result;
use serde_json::Value;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The Python driver, run as `python3 -c DRIVER_PY`.
pub(crate) const DRIVER_PY: &str = include_str!("driver.py");

/// How many lines of the program's stderr an error message quotes.
const STDERR_TAIL_LINES: usize = 20;
/// Longest stderr line kept for a message, in bytes.
const MAX_KEPT_LINE: usize = 4096;

/// Time limits for one run of the program.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Longest wait for one answer (from the previous answer, or from the start for row 0).
    pub(crate) row: Duration,
    /// Longest time for the whole run, if any.
    pub(crate) run: Option<Duration>,
}

/// One row's answer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Answer {
    pub(crate) score: f32,
    /// The other keys (sorted), without the `score_` prefix.
    pub(crate) subs: Vec<(String, SubValue)>,
}

/// A value of an answer's key other than `score`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SubValue {
    /// A number or boolean: a float32 sub-score.
    Number(f32),
    /// A string, or a list or object as its compact JSON text.
    Text(String),
    Null,
}

pub(crate) use crate::process::split_args;

/// Show at most 200 characters of a line in a message.
fn shown(line: &str) -> String {
    const MAX: usize = 200;
    match line.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &line[..i]),
        None => line.to_string(),
    }
}

fn as_number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        _ => None,
    }
}

fn finite_f32(x: f64, what: &str) -> Result<f32, String> {
    let y = x as f32;
    if y.is_finite() {
        Ok(y)
    } else {
        Err(format!("{what} {x} is not a finite float32"))
    }
}

/// Parse one answer line. The error says what was wrong, without the row.
pub(crate) fn parse_answer(line: &str) -> Result<Answer, String> {
    const EXPECTED: &str = "expected a number or an object with a numeric \"score\"";
    let value: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(_) => {
            // Python's json.dumps writes NaN and Infinity, which are not JSON.
            let non_finite = |t: &str| matches!(t, "NaN" | "nan" | "Infinity" | "inf");
            if line
                .split(|c: char| !c.is_ascii_alphanumeric())
                .any(non_finite)
            {
                return Err(format!(
                    "answered `{}`: the score is NaN or infinite",
                    shown(line)
                ));
            }
            return Err(format!(
                "answered `{}`, which is not JSON ({EXPECTED})",
                shown(line)
            ));
        }
    };
    match &value {
        Value::Number(_) | Value::Bool(_) => Ok(Answer {
            score: finite_f32(as_number(&value).unwrap_or(f64::NAN), "score")?,
            subs: Vec::new(),
        }),
        Value::Object(map) => {
            let score = match map.get("score") {
                None => {
                    return Err(format!(
                        "answered `{}` without a \"score\" key",
                        shown(line)
                    ))
                }
                Some(v) => match as_number(v) {
                    Some(x) => finite_f32(x, "score")?,
                    None => {
                        return Err(format!(
                            "answered `{}`: \"score\" is {v}, not a number",
                            shown(line)
                        ))
                    }
                },
            };
            let mut subs = Vec::new();
            for (key, v) in map {
                if key == "score" {
                    continue;
                }
                if key.is_empty() {
                    return Err("answered a key that is empty".into());
                }
                let sub = match (as_number(v), v) {
                    (Some(x), _) => SubValue::Number(finite_f32(x, &format!("\"{key}\""))?),
                    (None, Value::Null) => SubValue::Null,
                    (None, Value::String(t)) => SubValue::Text(t.clone()),
                    (None, other) => SubValue::Text(other.to_string()),
                };
                subs.push((key.clone(), sub));
            }
            Ok(Answer { score, subs })
        }
        _ => Err(format!("answered `{}` ({EXPECTED})", shown(line))),
    }
}

/// Scores and `score_<key>` columns from per-row answers. Every row must carry the same keys;
/// a key is a numeric column when some row gives it a number (then every row must), else a
/// text column (nulls allowed).
pub(crate) fn collate(answers: &[Answer], ctx: &str, label: &str) -> Result<Scores> {
    let score = answers.iter().map(|a| a.score).collect();
    let Some(first) = answers.first() else {
        return Ok(Scores {
            score,
            ..Scores::default()
        });
    };
    let keys: Vec<&str> = first.subs.iter().map(|(k, _)| k.as_str()).collect();
    // A key is numeric when any row gives it a number; then every row must.
    let numeric: Vec<bool> = (0..keys.len())
        .map(|j| {
            answers
                .iter()
                .any(|a| matches!(a.subs.get(j), Some((_, SubValue::Number(_)))))
        })
        .collect();
    let mut nums: Vec<Vec<f32>> = vec![Vec::with_capacity(answers.len()); keys.len()];
    let mut texts: Vec<Vec<Option<String>>> = vec![Vec::new(); keys.len()];
    for (row, a) in answers.iter().enumerate() {
        if a.subs.len() != keys.len() || a.subs.iter().zip(&keys).any(|((k, _), want)| k != want) {
            let got: Vec<&str> = a.subs.iter().map(|(k, _)| k.as_str()).collect();
            crate::bail_input!(
                "{ctx}, row {row}: reward `{label}` gave the keys {got:?} but {keys:?} for row 0; every row must return the same keys"
            );
        }
        for (j, (key, v)) in a.subs.iter().enumerate() {
            match (numeric[j], v) {
                (true, SubValue::Number(x)) => nums[j].push(*x),
                (true, other) => crate::bail_input!(
                    "{ctx}, row {row}: reward `{label}` gave \"{key}\" = {} where other rows give a number; a key is a number in every row (a float32 column score_{key}) or text in every row",
                    match other {
                        SubValue::Text(t) => format!("{t:?}"),
                        _ => "null".to_string(),
                    }
                ),
                (false, SubValue::Text(t)) => texts[j].push(Some(t.clone())),
                (false, _) => texts[j].push(None),
            }
        }
    }
    let mut out = Scores {
        score,
        ..Scores::default()
    };
    for (j, key) in keys.into_iter().enumerate() {
        match numeric[j] {
            true => out
                .subs
                .push((key.to_string(), std::mem::take(&mut nums[j]))),
            false => out
                .texts
                .push((key.to_string(), std::mem::take(&mut texts[j]))),
        }
    }
    Ok(out)
}

/// A started program and the threads that talk to it.
struct Running {
    child: Child,
    label: String,
    lines: Receiver<std::io::Result<String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    stderr_done: Receiver<()>,
    /// Kills the program's group on drop and before `score` ends on a signal.
    group: GroupGuard,
    /// Set once reaped: its pid (and group id) may then belong to someone else.
    status: Option<Option<ExitStatus>>,
}

impl Running {
    fn start(argv: &[String], label: &str, input: Vec<u8>, ctx: &str) -> Result<Running> {
        let label = label.to_string();
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that a kill also reaches what it started.
            .process_group(0);
        // Killed by the kernel if `score` dies without a chance to clean up (SIGKILL).
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| {
            input_error(format!(
                "{ctx}: reward `{label}`: cannot start `{}`: {e}",
                argv[0]
            ))
        })?;
        let group = GroupGuard::new(child.id());

        let mut stdin = child.stdin.take().expect("piped stdin");
        thread::spawn(move || {
            // A program that exits early closes the pipe; what it did is reported from stdout.
            let _ = stdin.write_all(&input);
        });

        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        thread::spawn(move || {
            let mut r = BufReader::with_capacity(1 << 16, stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match r.read_until(b'\n', &mut buf) {
                    Ok(0) => break,
                    Ok(_) => {
                        let line = String::from_utf8_lossy(&buf);
                        let line = line.trim_end_matches(['\n', '\r']).to_string();
                        if tx.send(Ok(line)).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        break;
                    }
                }
            }
        });

        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (done_tx, stderr_done) = mpsc::channel();
        let mut stderr = child.stderr.take().expect("piped stderr");
        let tail = Arc::clone(&stderr_tail);
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            let mut partial = Vec::new();
            // Pass everything through as it comes and keep the last lines for messages.
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = std::io::stderr().write_all(&buf[..n]);
                partial.extend_from_slice(&buf[..n]);
                while let Some(nl) = partial.iter().position(|&b| b == b'\n') {
                    let line = String::from_utf8_lossy(&partial[..nl]).into_owned();
                    partial.drain(..=nl);
                    push_tail(&tail, line);
                }
                // A line without end is kept only in part.
                if partial.len() > MAX_KEPT_LINE {
                    let head = String::from_utf8_lossy(&partial[..MAX_KEPT_LINE]);
                    push_tail(&tail, format!("{head}..."));
                    partial.clear();
                }
            }
            if !partial.is_empty() {
                push_tail(&tail, String::from_utf8_lossy(&partial).into_owned());
            }
            let _ = done_tx.send(());
        });

        Ok(Running {
            child,
            label,
            lines,
            stderr_tail,
            stderr_done,
            group,
            status: None,
        })
    }

    /// Whether the program has exited within `d`, without reaping it: a zombie leader keeps
    /// its process-group id reserved, so the group can still be killed safely afterwards.
    fn exited_within(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        loop {
            // SAFETY: waitid(2) writes only into `info`, a plain C struct we own.
            let (r, pid) = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                let r = libc::waitid(
                    libc::P_PID,
                    self.child.id() as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
                );
                (r, info.si_pid())
            };
            // r != 0: no such child any more, i.e. already reaped.
            if r != 0 || pid != 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kill the program's whole process group (what it started too) and reap it.
    fn kill(&mut self) -> Option<ExitStatus> {
        if let Some(status) = self.status {
            return status;
        }
        // The group first, while the unreaped leader still holds its id.
        self.group.kill();
        let _ = self.child.kill();
        let status = self.child.wait().ok();
        self.status = Some(status);
        status
    }

    /// The last stderr lines, for an error message ("" when it printed nothing).
    fn tail(&self) -> String {
        // The stderr thread may still hold the last lines of a program that just exited.
        let _ = self.stderr_done.recv_timeout(Duration::from_millis(500));
        let tail = self
            .stderr_tail
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default();
        if tail.is_empty() {
            return String::new();
        }
        let lines: Vec<String> = tail.iter().map(|l| format!("  | {l}")).collect();
        format!("\nlast lines of its stderr:\n{}", lines.join("\n"))
    }

    /// Kill the program and build the input error for `row`.
    fn fail(&mut self, ctx: &str, row: Option<usize>, what: String) -> anyhow::Error {
        self.kill();
        let at = match row {
            Some(r) => format!("{ctx}, row {r}"),
            None => ctx.to_string(),
        };
        input_error(format!(
            "{at}: reward program `{}` {what}{}",
            self.label,
            self.tail()
        ))
    }
}

impl Drop for Running {
    /// Whatever way scoring ends (an error, a panic), the program and its group go.
    fn drop(&mut self) {
        self.kill();
    }
}

fn push_tail(tail: &Mutex<VecDeque<String>>, line: String) {
    if let Ok(mut t) = tail.lock() {
        if t.len() == STDERR_TAIL_LINES {
            t.pop_front();
        }
        t.push_back(line);
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// Run `argv` on `input` (one request line per row) and collect `rows` answers.
/// `ctx` starts every error message (the batch file); `label` names the program in them.
pub(crate) fn run(
    argv: &[String],
    label: &str,
    input: Vec<u8>,
    rows: usize,
    limits: Limits,
    ctx: &str,
) -> Result<Vec<Answer>> {
    assert!(!argv.is_empty(), "empty argv");
    let start = Instant::now();
    let run_deadline = limits.run.map(|d| start + d);
    let mut p = Running::start(argv, label, input, ctx)?;
    let mut answers = Vec::with_capacity(rows);
    let mut last = start;
    while answers.len() < rows {
        let row = answers.len();
        let row_deadline = last + limits.row;
        let (deadline, by_run) = match run_deadline {
            Some(d) if d < row_deadline => (d, true),
            _ => (row_deadline, false),
        };
        match p
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(Ok(line)) => {
                if line.trim().is_empty() {
                    continue;
                }
                match parse_answer(line.trim()) {
                    Ok(a) => answers.push(a),
                    Err(why) => return Err(p.fail(ctx, Some(row), why)),
                }
                last = Instant::now();
            }
            Ok(Err(e)) => {
                return Err(p.fail(ctx, Some(row), format!("could not be read from: {e}")));
            }
            Err(RecvTimeoutError::Timeout) => {
                let why = if by_run {
                    format!(
                        "did not finish within the whole-run timeout of {} ms (--run-timeout-ms) and was killed; {row} of {rows} rows were answered",
                        ms(limits.run.unwrap_or_default())
                    )
                } else {
                    format!(
                        "gave no answer within {} ms (--timeout-ms) and was killed",
                        ms(limits.row)
                    )
                };
                return Err(p.fail(ctx, Some(row), why));
            }
            Err(RecvTimeoutError::Disconnected) => {
                // Its stdout closed: it exited (or closed it) before answering this row.
                let exited = p.exited_within(Duration::from_millis(500));
                let status = p.kill();
                let how = match status {
                    Some(s) if exited => format!("exited ({s})"),
                    _ => "closed its stdout".to_string(),
                };
                return Err(p.fail(
                    ctx,
                    Some(row),
                    format!("{how} before answering this row ({row} of {rows} rows answered)"),
                ));
            }
        }
    }

    // Every row has its answer. Let the program finish on its own (its stdin is closed once
    // the feeder thread is done), but not longer than one row's wait.
    let mut wait = limits.row;
    if let Some(d) = run_deadline {
        wait = wait.min(d.saturating_duration_since(Instant::now()));
    }
    let exited = p.exited_within(wait);
    // Whatever it left running in its group goes too.
    let status = p.kill();
    if !exited {
        eprintln!(
            "warning: {ctx}: reward program `{}` answered every row but did not exit within {} ms of the end of its input; it was killed",
            p.label,
            ms(wait)
        );
    } else if let Some(s) = status.filter(|s| !s.success()) {
        return Err(p.fail(
            ctx,
            None,
            format!("answered every row but then exited ({s})"),
        ));
    }
    loop {
        match p.lines.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(line)) if line.trim().is_empty() => continue,
            Ok(Ok(line)) => {
                return Err(p.fail(
                    ctx,
                    None,
                    format!(
                        "printed more lines than there are rows ({rows}); the first extra one is `{}` (print debug output to stderr)",
                        shown(&line)
                    ),
                ));
            }
            _ => break,
        }
    }
    Ok(answers)
}

/// The argv that runs `func` of `file` through the driver: `PYTHON -c DRIVER FILE FUNC KWARGS`.
/// The driver's source travels in the argv, so nothing is written to disk for it and nothing
/// is left behind however `score` ends.
pub(crate) fn python_argv(python: &str, file: &Path, func: &str, kwargs: &Value) -> Vec<String> {
    vec![
        python.to_string(),
        "-c".to_string(),
        DRIVER_PY.to_string(),
        file.display().to_string(),
        func.to_string(),
        kwargs.to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers() {
        assert_eq!(
            parse_answer("0.5").unwrap(),
            Answer {
                score: 0.5,
                subs: vec![]
            }
        );
        assert_eq!(
            parse_answer(
                r#"{"score": 1, "acc": true, "pred": "7", "len": 12, "why": null, "l": [1, "a"]}"#
            )
            .unwrap(),
            Answer {
                score: 1.0,
                subs: vec![
                    ("acc".into(), SubValue::Number(1.0)),
                    ("l".into(), SubValue::Text(r#"[1,"a"]"#.into())),
                    ("len".into(), SubValue::Number(12.0)),
                    ("pred".into(), SubValue::Text("7".into())),
                    ("why".into(), SubValue::Null),
                ]
            }
        );
        let e = |s: &str| parse_answer(s).unwrap_err();
        assert!(e("hello").contains("not JSON"), "{}", e("hello"));
        assert!(e("NaN").contains("NaN or infinite"));
        assert!(e(r#"{"score": NaN}"#).contains("NaN or infinite"));
        assert!(e(r#"{"acc": 1}"#).contains("without a \"score\""));
        assert!(e(r#"{"score": "high"}"#).contains("not a number"));
        assert!(e("[1, 2]").contains("expected a number"));
        assert!(e("1e300").contains("not a finite float32"));
    }

    #[test]
    fn collate_requires_the_same_keys() {
        let a = |s: &str| parse_answer(s).unwrap();
        let rows = [
            a(r#"{"score": 1, "acc": 1}"#),
            a(r#"{"score": 0, "acc": 0}"#),
        ];
        let got = collate(&rows, "f", "p").unwrap();
        assert_eq!(got.score, [1.0, 0.0]);
        assert_eq!(got.subs, [("acc".to_string(), vec![1.0, 0.0])]);
        let rows = [a(r#"{"score": 1, "acc": 1}"#), a("0")];
        let err = collate(&rows, "f", "p").unwrap_err().to_string();
        assert!(err.starts_with("f, row 1: "), "{err}");
        // Text values are kept as text columns, nulls as nulls.
        let rows = [
            a(r#"{"score": 1, "pred": "7", "acc": 1}"#),
            a(r#"{"score": 0, "pred": null, "acc": 0}"#),
        ];
        let got = collate(&rows, "f", "p").unwrap();
        assert_eq!(got.subs, [("acc".to_string(), vec![1.0, 0.0])]);
        assert_eq!(
            got.texts,
            [("pred".to_string(), vec![Some("7".to_string()), None])]
        );
        // A key numeric in one row and text in another names the key and the row.
        let rows = [
            a(r#"{"score": 1, "acc": 1}"#),
            a(r#"{"score": 0, "acc": "no"}"#),
        ];
        let err = collate(&rows, "f", "p").unwrap_err();
        assert!(crate::error::is_input_error(&err));
        let err = err.to_string();
        assert!(
            err.starts_with(
                "f, row 1: reward `p` gave \"acc\" = \"no\" where other rows give a number"
            ),
            "{err}"
        );
    }

    fn limits(row_ms: u64) -> Limits {
        Limits {
            row: Duration::from_millis(row_ms),
            run: None,
        }
    }

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn echoes_answers_in_order() {
        // Answers each request line with its length parity, reading line by line.
        let argv = sh("while read -r l; do echo \"{\\\"score\\\": ${#l}}\"; done");
        let input = b"{\"a\":1}\n{\"bb\":22}\n".to_vec();
        let got = run(&argv, "prog", input, 2, limits(5000), "t").unwrap();
        assert_eq!(got[0].score, 7.0);
        assert_eq!(got[1].score, 9.0);
    }

    #[test]
    fn hang_is_killed_and_names_the_row() {
        let argv = sh("read -r l; echo 1; sleep 30");
        let t = Instant::now();
        let err = run(&argv, "prog", b"{}\n{}\n".to_vec(), 2, limits(300), "t").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        let msg = err.to_string();
        assert!(msg.starts_with("t, row 1: "), "{msg}");
        assert!(msg.contains("no answer within 300 ms"), "{msg}");
    }

    #[test]
    fn run_timeout_stops_a_slow_program() {
        let argv = sh("while read -r l; do sleep 0.2; echo 1; done");
        let lim = Limits {
            row: Duration::from_secs(5),
            run: Some(Duration::from_millis(500)),
        };
        let err = run(&argv, "prog", b"{}\n".repeat(20), 20, lim, "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("whole-run timeout of 500 ms"), "{err}");
    }

    #[test]
    fn crash_reports_status_and_stderr() {
        let argv = sh("echo 1; echo 'boom: bad row' >&2; exit 3");
        let err = run(&argv, "prog", b"{}\n{}\n".to_vec(), 2, limits(5000), "t")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t, row 1: "), "{err}");
        assert!(err.contains("exit status: 3"), "{err}");
        assert!(err.contains("boom: bad row"), "{err}");
    }

    #[test]
    fn answering_before_reading_input_does_not_deadlock() {
        // 4 MB of requests and ~300 KB of answers, all printed before it reads any input: both
        // pipes fill up, which would deadlock if we wrote stdin and read stdout in turn.
        let rows = 2000;
        let line = format!("{{\"x\": \"{}\"}}\n", "a".repeat(2000));
        let input = line.repeat(rows).into_bytes();
        let answer = format!("{{\"score\": 0.25, \"pad\": \"{}\"}}", "p".repeat(120));
        let argv = sh(&format!(
            "i=0; while [ $i -lt {rows} ]; do echo '{answer}'; i=$((i+1)); done; cat >/dev/null"
        ));
        let got = run(&argv, "prog", input, rows, limits(10_000), "t").unwrap();
        assert_eq!(got.len(), rows);
        let pad = vec![("pad".to_string(), SubValue::Text("p".repeat(120)))];
        assert!(got.iter().all(|a| a.score == 0.25 && a.subs == pad));
    }

    #[test]
    fn extra_output_is_an_error() {
        let argv = sh("cat >/dev/null; echo 1; echo debug");
        let err = run(&argv, "prog", b"{}\n".to_vec(), 1, limits(5000), "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("more lines than there are rows"), "{err}");
    }

    #[test]
    fn missing_program_is_an_input_error() {
        let err = run(
            &["/nonexistent/reward-prog".to_string()],
            "prog",
            Vec::new(),
            1,
            limits(1000),
            "t",
        )
        .unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(err.to_string().contains("cannot start"), "{err}");
    }
}
