//! A tool program (`cmd:` or a `python:` class through its driver) as a pool of processes
//! speaking the JSON-lines protocol ([`super::protocol`]), each reused call after call.
//!
//! A call takes an idle process, or starts one (which first prints its schema line); one
//! request, one answer. A process that times out, exits, or answers something malformed is
//! killed (its whole process group) and left out of the pool, so the next call starts a
//! fresh one: a failure costs one call, never the stage. Processes run in their own process
//! group, die with tandem (`PR_SET_PDEATHSIG`, spawned from the pool's own thread so that
//! the caller's thread ending does not take them down) and are killed when the pool drops.
//! Their stderr is passed through.

use super::protocol::{parse_answer, parse_schema, request};
use super::sandbox::{exited, secs};
use crate::process::{die_with_parent, GroupGuard, Spawner};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

/// A tool program and its idle processes.
pub(crate) struct Program {
    name: String,
    argv: Vec<String>,
    timeout: Duration,
    schema: Value,
    idle: Mutex<Vec<Worker>>,
    next_id: AtomicU64,
    spawner: Spawner,
}

impl Program {
    /// Starts the first process and reads its schema. The error says why the program cannot
    /// serve as tool `name`.
    pub(crate) fn start(
        name: &str,
        argv: Vec<String>,
        timeout: Duration,
    ) -> Result<Program, String> {
        let spawner = Spawner::new();
        let (worker, line) = Worker::start(&spawner, &argv, timeout)?;
        let schema = parse_schema(&line, name).map_err(|e| format!("`{}`: {e}", argv[0]))?;
        Ok(Program {
            name: name.to_string(),
            argv,
            timeout,
            schema,
            idle: Mutex::new(vec![worker]),
            next_id: AtomicU64::new(0),
            spawner,
        })
    }

    pub(crate) fn schema(&self) -> &Value {
        &self.schema
    }

    /// One call (`kwargs`: the row's arguments for this tool, sent with the request): Ok(Ok(content))
    /// or Ok(Err(the tool's own error)) from a well-behaved process; Err says what went wrong
    /// with the process (it is then gone).
    pub(crate) fn call(
        &self,
        arguments: &Value,
        kwargs: Option<&Value>,
    ) -> Result<Result<String, String>, String> {
        let idle = self.idle.lock().unwrap().pop();
        let mut worker = match idle {
            Some(w) => w,
            None => Worker::start(&self.spawner, &self.argv, self.timeout)?.0,
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let answer = worker.ask(
            &request(id, &self.name, arguments, kwargs),
            id,
            self.timeout,
        )?;
        self.idle.lock().unwrap().push(worker);
        Ok(answer)
    }
}

/// One process of the program.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    /// Its stdout's lines; None at the end.
    lines: Receiver<Option<String>>,
    group: GroupGuard,
}

impl Worker {
    /// Starts a process; returns it with its schema line.
    fn start(
        spawner: &Spawner,
        argv: &[String],
        timeout: Duration,
    ) -> Result<(Worker, String), String> {
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0);
        die_with_parent(&mut cmd);
        let mut child = spawner
            .spawn(cmd)
            .map_err(|e| format!("cannot start `{}`: {e}", argv[0]))?;
        let group = GroupGuard::new(child.id());
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(Some(line)).is_err() {
                    break;
                }
            }
            let _ = tx.send(None);
        });
        let mut worker = Worker {
            child,
            stdin,
            lines,
            group,
        };
        let schema = worker
            .next_line(timeout)
            .map_err(|e| format!("`{}` {e} before printing its schema line", argv[0]))?;
        Ok((worker, schema))
    }

    /// Sends one request line, reads its answer.
    fn ask(
        &mut self,
        line: &str,
        id: u64,
        timeout: Duration,
    ) -> Result<Result<String, String>, String> {
        let sent = writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush());
        if sent.is_err() {
            return Err(self.end_message());
        }
        let answer = self.next_line(timeout)?;
        parse_answer(&answer, id)
    }

    /// The next non-blank line of stdout within `timeout`.
    fn next_line(&mut self, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some(l)) if l.trim().is_empty() => continue,
                Ok(Some(l)) => return Ok(l),
                Ok(None) | Err(RecvTimeoutError::Disconnected) => return Err(self.end_message()),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("timed out after {} s", secs(timeout)))
                }
            }
        }
    }

    /// What happened to a process whose stdout ended (it is killed if it has not ended).
    fn end_message(&mut self) -> String {
        for _ in 0..50 {
            if exited(&self.child) {
                break;
            }
            thread::sleep(Duration::from_millis(2));
        }
        // Kill before reaping: until then the group's id cannot be anyone else's.
        self.group.kill();
        match self.child.try_wait() {
            Ok(Some(status)) if exited_alone(&status) => format!("exited ({status})"),
            _ => "closed its stdout".to_string(),
        }
    }
}

/// Not ended by our own kill.
fn exited_alone(status: &std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() != Some(libc::SIGKILL)
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Kill before reaping: until then the group's id cannot be anyone else's.
        self.group.kill();
        let _ = self.child.wait();
    }
}
