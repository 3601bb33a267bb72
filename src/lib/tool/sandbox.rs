//! The built-in `python` tool: each call runs its `code` in a fresh `python3` process,
//! confined by the kernel ([`super::confine`]) and by an audit hook inside Python
//! (`sandbox.py`), in a temporary directory removed afterwards.
//!
//! The answer (`content`) is the program's stdout, then its stderr, cut at
//! [`Limits::output_bytes`]: a program that prints more is stopped as soon as it passes the
//! cap, so no more than the cap is ever held. A run past the wall-clock limit is killed and
//! its content ends with `error: timed out after N s`; a non-zero exit (an exception: its
//! traceback is the content) sets the result's `error` without changing the content.
//!
//! The process group (and with the PID namespace, every process the code started, in or out
//! of that group) is killed when the call ends, however it ends.

use super::confine::{Cgroup, Layers, Prepared, Rlimits};
use super::ToolResult;
use crate::process::{die_with_parent, GroupGuard};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// The Python side of the sandbox, run as `python3 -c SANDBOX_PY`.
const SANDBOX_PY: &str = include_str!("sandbox.py");

/// What one call may use.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Wall-clock time, from the start of `python3`.
    pub wall: Duration,
    /// CPU seconds of each process (`RLIMIT_CPU`).
    pub cpu_seconds: u64,
    /// Address space of each process, in bytes (`RLIMIT_AS`).
    pub memory_bytes: u64,
    /// Processes at once, Python included.
    pub processes: u64,
    /// Largest file a process may write, in bytes (`RLIMIT_FSIZE`).
    pub file_bytes: u64,
    /// stdout and stderr kept, together, in bytes.
    pub output_bytes: usize,
}

impl Limits {
    /// The defaults with a wall-clock limit of `wall` (and as many CPU seconds, rounded up).
    pub fn with_wall(wall: Duration) -> Limits {
        Limits {
            wall,
            cpu_seconds: wall.as_secs_f64().ceil().max(1.0) as u64,
            memory_bytes: 4 << 30,
            processes: 32,
            file_bytes: 16 << 20,
            output_bytes: 8192,
        }
    }
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::with_wall(Duration::from_secs(10))
    }
}

/// The tool's OpenAI function schema.
pub fn schema() -> Value {
    json!({"type": "function", "function": {
        "name": "python",
        "description": "Run Python 3 code in a fresh sandboxed process and read what it prints \
            (stdout, then stderr; the value of a last expression is printed too). No network; \
            files can be written only in the working directory; time, memory and output are \
            limited.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    }})
}

/// Which layers of the sandbox hold on this machine, in one line.
pub fn layers_line() -> String {
    Layers::get().describe()
}

/// A duration as seconds for a message: `10`, `1.5`.
pub(crate) fn secs(d: Duration) -> String {
    let s = format!("{:.3}", d.as_secs_f64());
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The interpreter, found once as `python3` on PATH (its real path: a pyenv shim costs a
/// shell per call). An error says why it cannot be used.
pub(crate) fn python() -> Result<&'static Path, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = PYTHON.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot start python3: {e}"))?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || path.is_empty() {
            return Err(format!("python3 did not start ({})", out.status));
        }
        Ok(PathBuf::from(path))
    });
    found.as_deref().map_err(Clone::clone)
}

/// Runs `code` under `limits`. Never fails: a problem of the sandbox itself (no python3,
/// no temporary directory) is a failed result too.
pub fn run(code: &str, limits: &Limits) -> ToolResult {
    run_with(code, limits, true)
}

/// `run`, with the audit hook on or off (off: tests of the kernel's layers alone).
pub(crate) fn run_with(code: &str, limits: &Limits, hook: bool) -> ToolResult {
    let start = Instant::now();
    match Call::start(code, limits, hook) {
        Ok(call) => call.finish(limits, start),
        Err(e) => ToolResult::failed(e, start.elapsed().as_secs_f64()),
    }
}

/// The call's directory: created private, removed with everything in it on drop.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new(name: &str) -> std::io::Result<WorkDir> {
        let path = std::env::temp_dir().join(name);
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(WorkDir(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::fs::remove_dir_all(&self.0).is_err() {
            // The code may have taken its own permissions away: give them back, try again.
            let _ = Command::new("chmod")
                .args(["-R", "u+rwx"])
                .arg(&self.0)
                .status();
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// stdout and stderr as read so far.
#[derive(Default)]
struct Capture {
    out: Vec<u8>,
    err: Vec<u8>,
    /// More than the cap came.
    overflow: bool,
}

/// A started call.
struct Call {
    child: Child,
    group: GroupGuard,
    capture: Arc<Mutex<Capture>>,
    /// One message per stream at its end.
    ended: Receiver<()>,
    // Dropped last, in this order: the cgroup (its processes killed), then the directory.
    _cgroup: Option<Cgroup>,
    _dir: WorkDir,
}

impl Call {
    fn start(code: &str, limits: &Limits, hook: bool) -> Result<Call, String> {
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let python = python()?;
        let layers = Layers::get();
        let n = CALLS.fetch_add(1, Ordering::Relaxed);
        // The time too: a directory left by a killed process of the same pid cannot clash.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("tandem-python-{}-{n}-{nanos}", std::process::id());
        let dir =
            WorkDir::new(&name).map_err(|e| format!("cannot make the sandbox's directory: {e}"))?;
        // The process that relays Python's status (PID namespace) counts too.
        let cap = limits.processes + 1;
        let cgroup = match &layers.cgroup {
            Some(base) => Some(
                Cgroup::new(base, &name, cap)
                    .map_err(|e| format!("cannot make the sandbox's pids cgroup: {e}"))?,
            ),
            None => None,
        };
        let rlimits = Rlimits {
            cpu_seconds: limits.cpu_seconds,
            address_space: limits.memory_bytes,
            file_size: limits.file_bytes,
            processes: cap,
        };
        let prepared = Prepared::new(&dir.0, cgroup.as_ref().map(Cgroup::path), rlimits)
            .map_err(|e| format!("cannot prepare the sandbox: {e}"))?;
        let mut cmd = command(python, &dir.0, hook, layers.processes_contained());
        // Killed by the kernel if this process dies first.
        die_with_parent(&mut cmd);
        // SAFETY: `apply` makes only async-signal-safe system calls on memory prepared
        // before the fork (it may fork once more and `_exit`), as a pre_exec hook must.
        unsafe {
            cmd.pre_exec(move || prepared.apply());
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the sandbox: {e}"))?;
        let group = GroupGuard::new(child.id());
        let mut stdin = child.stdin.take().expect("piped stdin");
        let code = code.as_bytes().to_vec();
        // From a thread: code longer than the pipe's buffer waits for Python to start, which
        // the wall clock must bound too. A Python that died early is reported from its status.
        thread::spawn(move || {
            let _ = stdin.write_all(&code);
        });
        let capture = Arc::new(Mutex::new(Capture::default()));
        let (tx, ended) = mpsc::channel();
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let cap = limits.output_bytes;
        for (stream, is_err) in [
            (Box::new(out) as Box<dyn Read + Send>, false),
            (Box::new(err), true),
        ] {
            let (capture, tx) = (Arc::clone(&capture), tx.clone());
            thread::spawn(move || {
                read_capped(stream, &capture, is_err, cap);
                let _ = tx.send(());
            });
        }
        Ok(Call {
            child,
            group,
            capture,
            ended,
            _cgroup: cgroup,
            _dir: dir,
        })
    }

    /// Waits for the end (or the limit), kills what is left and makes the result.
    fn finish(mut self, limits: &Limits, start: Instant) -> ToolResult {
        let deadline = start + limits.wall;
        let mut timed_out = false;
        loop {
            if exited(&self.child) || self.capture.lock().unwrap().overflow {
                break;
            }
            if Instant::now() >= deadline {
                timed_out = true;
                break;
            }
            thread::sleep(Duration::from_millis(2));
        }
        // Before reaping: the group's id is Python's (or the relay's) pid until then.
        self.group.kill();
        let status = self.child.wait().ok();
        // Both pipes close once every process is gone; wait a moment for the readers.
        for _ in 0..2 {
            let _ = self.ended.recv_timeout(Duration::from_millis(500));
        }
        let capture = std::mem::take(&mut *self.capture.lock().unwrap());
        let seconds = start.elapsed().as_secs_f64();
        result(capture, status, timed_out, limits, seconds)
    }
}

/// `python3 -I -B -X utf8 -c SANDBOX_PY` in `dir`, with a small environment of its own.
fn command(python: &Path, dir: &Path, hook: bool, processes_contained: bool) -> Command {
    let mut cmd = Command::new(python);
    cmd.args(["-I", "-B", "-X", "utf8", "-c"]);
    cmd.arg(if hook {
        SANDBOX_PY
    } else {
        "import sys; exec(sys.stdin.read())"
    });
    if !processes_contained {
        cmd.arg("--no-processes");
    }
    cmd.env_clear()
        .envs([
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            ("LANG", "C.UTF-8"),
            // One thread per numeric library: each thread's stack counts in RLIMIT_AS.
            ("OPENBLAS_NUM_THREADS", "1"),
            ("OMP_NUM_THREADS", "1"),
            ("MKL_NUM_THREADS", "1"),
        ])
        .env("HOME", dir)
        .env("TMPDIR", dir)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group: the kill at the end reaches what it started.
        .process_group(0);
    cmd
}

/// Whether the child has ended, without reaping it (its pid stays the group's id).
pub(crate) fn exited(child: &Child) -> bool {
    // SAFETY: waitid with WNOWAIT on our own child writes only into `info`.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PID,
            child.id(),
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        r == 0 && info.si_pid() != 0
    }
}

/// Reads a stream to its end, keeping what fits under `cap` (both streams together).
fn read_capped(mut stream: impl Read, capture: &Mutex<Capture>, is_err: bool, cap: usize) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut c = capture.lock().unwrap();
        let room = cap.saturating_sub(c.out.len() + c.err.len());
        if n > room {
            c.overflow = true;
        }
        let keep = n.min(room);
        let sink = if is_err { &mut c.err } else { &mut c.out };
        sink.extend_from_slice(&buf[..keep]);
    }
}

/// Output as text; a character the cap cut in two is dropped, not shown as U+FFFD.
fn text(mut bytes: Vec<u8>) -> String {
    if let Err(e) = std::str::from_utf8(&bytes) {
        if e.error_len().is_none() {
            bytes.truncate(e.valid_up_to());
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The result of a finished call.
fn result(
    capture: Capture,
    status: Option<ExitStatus>,
    timed_out: bool,
    limits: &Limits,
    seconds: f64,
) -> ToolResult {
    let mut content = text(capture.out);
    content.push_str(&text(capture.err));
    let cap = limits.output_bytes;
    if capture.overflow {
        if !content.ends_with('\n') {
            content.push('\n');
        }
        content.push_str(&format!("[output truncated at {cap} bytes]"));
    }
    // sandbox.py ends with 128 + SIGXCPU on SIGXCPU (see there).
    let signal = match status.and_then(|s| s.code()) {
        Some(code) if code == 128 + libc::SIGXCPU => Some(libc::SIGXCPU),
        _ => status.and_then(|s| s.signal()),
    };
    let (error, shown) = if timed_out {
        (format!("timed out after {} s", secs(limits.wall)), true)
    } else if capture.overflow {
        (
            format!("printed more than {cap} bytes and was stopped"),
            true,
        )
    } else if signal == Some(libc::SIGXCPU) {
        let cpu = limits.cpu_seconds;
        (format!("stopped by the CPU time limit ({cpu} s)"), true)
    } else if signal == Some(libc::SIGKILL) {
        ("killed (CPU time or memory limit)".to_string(), true)
    } else if let Some(sig) = signal {
        (format!("python was killed by signal {sig}"), true)
    } else {
        match status.and_then(|s| s.code()) {
            Some(0) => {
                return ToolResult {
                    content,
                    seconds,
                    error: None,
                }
            }
            Some(code) => (format!("python exited with status {code}"), false),
            None => ("python's status is unknown".to_string(), true),
        }
    };
    if shown {
        if !content.is_empty() && !content.ends_with('\n') {
            content.push('\n');
        }
        content.push_str(&format!("error: {error}"));
    }
    ToolResult {
        content,
        seconds,
        error: Some(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(wall_ms: u64) -> Limits {
        let mut l = Limits::with_wall(Duration::from_millis(wall_ms));
        l.memory_bytes = 1 << 30;
        l.processes = 4;
        l.file_bytes = 1 << 20;
        l.output_bytes = 1000;
        l
    }

    /// A SIGCHLD handler of the process (the one `wait_timeout` installs, which the spec
    /// check's import of a reward uses) is not run by the relay when Python ends: it aborted
    /// the relay, and every call ended "killed by signal 6".
    #[test]
    fn a_sigchld_handler_of_the_process_does_not_reach_the_relay() {
        use wait_timeout::ChildExt;
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait_timeout(Duration::from_secs(10)).unwrap();
        let r = run("print(6 * 7)", &limits(5000));
        assert_eq!((r.content.as_str(), r.error), ("42\n", None));
    }

    #[test]
    fn output_is_stdout_then_stderr_cut_at_the_cap() {
        // Code longer than a pipe's buffer (64 KiB) goes in whole.
        let long = format!("{}print(x)", "x = 1\n".repeat(20_000));
        assert_eq!(run(&long, &limits(5000)).content, "1\n");
        let code = "import sys\nsys.stderr.write('err\\n')\nprint('out')";
        let r = run(
            "open('helper.py', 'w').write('X = 5')\nimport helper\nhelper.X",
            &limits(5000),
        );
        assert_eq!(
            r.content, "5\n",
            "a module written in the directory imports"
        );
        let r = run(code, &limits(5000));
        assert_eq!((r.content.as_str(), r.error), ("out\nerr\n", None));
        // 600 two-byte characters: the cap of 999 bytes falls inside the 500th, which goes.
        let mut l = limits(5000);
        l.output_bytes = 999;
        let r = run("print('é' * 600)", &l);
        let tail =
            "\n[output truncated at 999 bytes]\nerror: printed more than 999 bytes and was stopped";
        assert_eq!(r.content, format!("{}{tail}", "é".repeat(499)));
        let r = run("print(", &limits(5000));
        assert!(r.content.contains("SyntaxError"), "{}", r.content);
        assert!(
            !r.content.contains("<string>"),
            "the sandbox's own frames show: {}",
            r.content
        );
    }

    #[test]
    fn cpu_and_file_size_limits_hold() {
        let mut l = limits(8000);
        l.cpu_seconds = 1;
        let t = Instant::now();
        let r = run("while True:\n    pass", &l);
        assert_eq!(
            r.error.as_deref(),
            Some("stopped by the CPU time limit (1 s)")
        );
        // Well before the wall clock's 8 s, even on a loaded machine.
        assert!(t.elapsed() < Duration::from_secs(7), "{:?}", t.elapsed());
        let r = run("open('big', 'wb').write(b'x' * (2 << 20))", &limits(5000));
        assert!(
            r.content.contains("OSError: [Errno 27] File too large"),
            "{}",
            r.content
        );
    }

    /// The kernel's layers alone (no audit hook), each where this machine has it: what
    /// Python code could do through C is stopped there.
    #[test]
    fn the_kernel_layers_hold_without_the_audit_hook() {
        let layers = Layers::get();
        eprintln!("sandbox layers here: {}", layers.describe());
        let no_hook = |code: &str| run_with(code, &limits(5000), false);
        if layers.seccomp {
            let r = no_hook("import socket\nsocket.socket()");
            assert!(
                r.content.contains("PermissionError: [Errno 13]"),
                "{}",
                r.content
            );
            let r = no_hook("import socket\nprint(len(socket.socketpair()))");
            assert_eq!(r.content, "2\n", "AF_UNIX stays allowed");
        }
        if layers.namespaces {
            let code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\nexcept OSError as e:\n    print(type(e).__name__)";
            // Without seccomp the socket is made, but no interface leads anywhere.
            let r = no_hook(code);
            assert!(
                r.content == "PermissionError\n" || r.content == "OSError\n",
                "{}",
                r.content
            );
        }
        if layers.landlock.is_some() {
            let outside =
                std::env::temp_dir().join(format!("tandem-landlock-{}", std::process::id()));
            let code = format!(
                "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                 print(libc.open({:?}.encode(), 0o101, 0o644), ctypes.get_errno())\n\
                 open('inside', 'w').write('ok')\nprint(open('inside').read())",
                outside.display().to_string()
            );
            let r = no_hook(&code);
            assert_eq!(r.content, format!("-1 {}\nok\n", libc::EACCES));
            assert!(!outside.exists());
        }
        if layers.processes_contained() {
            // 4 processes at most: Python and 3 children (the relay is counted apart).
            let code = "import os, time\nn = 0\nfor i in range(20):\n    try:\n        if os.fork() == 0:\n            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint(n)";
            let t = Instant::now();
            let r = no_hook(code);
            assert_eq!(r.content, "3\n");
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "the sleeping children were not killed"
            );
        } else {
            let r = run("import os\nos.fork()", &limits(5000));
            assert!(
                r.content.contains("starting a process is not allowed"),
                "{}",
                r.content
            );
        }
    }
}
