//! `tandem tool python` end to end: one tool process, fed one request at a time over stdin,
//! takes every attack of the sandbox's list (endless loop, fork bomb, 10 GB, a socket, a
//! write outside its directory, 100 MB of output) and answers `print(6*7)` right after each.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// A running `tandem tool python`, asked one request at a time.
struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    next_id: u64,
}

impl Server {
    fn start(args: &[&str]) -> (Server, Value) {
        let mut child = Command::new(TANDEM)
            .args(["tool", "python"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut s = Server {
            child,
            stdin,
            stdout,
            next_id: 0,
        };
        let schema = s.line();
        (s, schema)
    }

    fn line(&mut self) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    /// Sends a raw line, returns the answer and how long it took.
    fn raw(&mut self, line: &str) -> (Value, Duration) {
        let t = Instant::now();
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let answer = self.line();
        (answer, t.elapsed())
    }

    /// Runs `code`; returns (content, error, seconds), checking the answer's id.
    fn run(&mut self, code: &str) -> (String, Option<String>, f64) {
        self.next_id += 1;
        let id = self.next_id;
        let request = json!({"id": id, "name": "python", "arguments": {"code": code}});
        let (a, took) = self.raw(&request.to_string());
        assert_eq!(a["id"], json!(id), "{a}");
        let content = a["content"].as_str().unwrap().to_string();
        let error = a.get("error").map(|e| e.as_str().unwrap().to_string());
        (content, error, took.as_secs_f64())
    }

    /// The tool still works: `print(6*7)` gives `42`, quickly.
    fn still_answers(&mut self, after: &str) {
        let (content, error, s) = self.run("print(6*7)");
        assert_eq!((content.as_str(), error), ("42\n", None), "after {after}");
        assert!(s < 1.5, "after {after}: print(6*7) took {s} s");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A name no other run uses.
fn unique(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("tandem-test-{what}-{}-{nanos}", std::process::id())
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|c| String::from_utf8_lossy(c).contains(marker))
        .count()
}

fn server() -> Server {
    let limits = [
        "--timeout",
        "2",
        "--memory-mib",
        "1024",
        "--processes",
        "16",
    ];
    let (s, schema) = Server::start(&[&limits[..], &["--output-bytes", "4096"]].concat());
    assert_eq!(schema["function"]["name"], "python");
    assert_eq!(
        schema["function"]["parameters"]["required"],
        json!(["code"])
    );
    s
}

#[test]
fn python_runs_code_in_its_own_directory_and_shows_errors() {
    let mut s = server();
    let (c, e, _) = s.run("x = 3\nx * 2");
    assert_eq!(
        (c.as_str(), e),
        ("6\n", None),
        "a last expression is printed"
    );
    let (c, e, _) = s
        .run("import os\nopen('f.txt', 'w').write('ok')\nprint(open('f.txt').read())\nos.getcwd()");
    assert!(c.starts_with("ok\n'"), "{c}");
    assert_eq!(e, None);
    let dir = c.lines().nth(1).unwrap().trim_matches('\'').to_string();
    assert!(!Path::new(&dir).exists(), "{dir} is left after the call");
    let (c, e, _) = s.run("print('before')\n1 / 0");
    assert_eq!(
        c,
        "before\nTraceback (most recent call last):\n  File \"<code>\", line 2, in <module>\nZeroDivisionError: division by zero\n"
    );
    assert_eq!(e.as_deref(), Some("python exited with status 1"));
    s.still_answers("an exception");
}

#[test]
fn python_survives_every_attack_and_answers_the_next_request() {
    let mut s = server();

    let (c, e, took) = s.run("while True:\n    pass");
    assert_eq!(c, "error: timed out after 2 s");
    assert_eq!(e.as_deref(), Some("timed out after 2 s"));
    assert!((2.0..3.5).contains(&took), "the endless loop took {took} s");
    s.still_answers("an endless loop");

    // Every process forks until one second has passed; one child leaves the group first
    // and sleeps. The cap refuses forks (the top process says so), and nothing survives.
    let marker = format!("30.{}", std::process::id());
    let bomb = format!(
        "import os, time\ntry:\n    if os.fork() == 0:\n        os.setsid()\n        os.execvp('sleep', ['sleep', '{marker}'])\nexcept OSError:\n    pass\n\
         top, refused, end = os.getpid(), 0, time.time() + 1.0\nwhile time.time() < end:\n    try:\n        os.fork()\n    except OSError:\n        refused += 1\n\
         if os.getpid() == top:\n    print('fork refused' if refused else 'every fork worked')\nelse:\n    os._exit(0)"
    );
    let (c, _, took) = s.run(&bomb);
    assert_eq!(c, "fork refused\n");
    assert!(took < 3.0, "the fork bomb took {took} s");
    assert_eq!(
        processes_with(&format!("sleep\0{marker}")),
        0,
        "a process of the bomb survived"
    );
    s.still_answers("a fork bomb");

    let (c, e, took) = s.run("x = bytearray(10 * 1024**3)\nprint('allocated')");
    assert!(c.ends_with("MemoryError\n"), "{c}");
    assert_eq!(e.as_deref(), Some("python exited with status 1"));
    assert!(took < 1.5, "the 10 GB allocation took {took} s");
    s.still_answers("a 10 GB allocation");

    let (c, _, _) = s.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)");
    assert!(
        c.ends_with("PermissionError: tandem sandbox: network access is not allowed\n"),
        "{c}"
    );
    s.still_answers("a socket connection");

    let outside = std::env::temp_dir().join(unique("x"));
    let (c, _, _) = s.run(&format!(
        "open({:?}, 'w').write('x')",
        outside.display().to_string()
    ));
    assert!(
        c.contains("PermissionError: tandem sandbox: writing"),
        "{c}"
    );
    assert!(!outside.exists(), "{} was written", outside.display());
    s.still_answers("a write outside its directory");

    let (c, e, took) = s.run("import sys\nsys.stdout.write('x' * 100_000_000)");
    assert!(c.starts_with("xxxx"), "{}", &c[..100]);
    assert!(
        c.ends_with("\n[output truncated at 4096 bytes]\nerror: printed more than 4096 bytes and was stopped"),
        "{}",
        &c[c.len() - 200..]
    );
    assert_eq!(c.len(), 4096 + "\n[output truncated at 4096 bytes]\nerror: printed more than 4096 bytes and was stopped".len());
    assert_eq!(
        e.as_deref(),
        Some("printed more than 4096 bytes and was stopped")
    );
    assert!(took < 1.5, "printing 100 MB took {took} s");
    s.still_answers("printing 100 MB");
}

#[test]
fn malformed_requests_get_an_error_answer() {
    let mut s = server();
    let (a, _) = s.raw("not json");
    assert_eq!(a["id"], Value::Null);
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .starts_with("the request is not JSON"),
        "{a}"
    );
    assert!(
        a["content"]
            .as_str()
            .unwrap()
            .starts_with("error: the request is not JSON"),
        "{a}"
    );
    let (a, _) = s.raw(r#"{"id": "a", "arguments": {"code": 5}}"#);
    assert_eq!(
        a,
        json!({"id": "a", "content": "error: the arguments have no string \"code\"", "error": "the arguments have no string \"code\""})
    );
    let (a, _) = s.raw(r#"{"id": 9, "name": "calc", "arguments": {}}"#);
    assert_eq!(
        a["error"],
        "unknown tool `calc`: this program serves `python`"
    );
    s.still_answers("malformed requests");
}

#[test]
fn bad_limits_are_input_errors() {
    let out = Command::new(TANDEM)
        .args(["tool", "python", "--timeout", "0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--timeout 0 must be a number of seconds above 0"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn the_sandbox_dies_with_the_tool_process_and_stdin_closed_ends_it() {
    // A call whose program sleeps for half a minute; the tool process is killed (SIGKILL) under it.
    let marker = format!("29.{}", std::process::id());
    let (mut s, _) = Server::start(&["--timeout", "60"]);
    let request = json!({"id": 1, "arguments": {"code": format!("import os\nos.execvp('sleep', ['sleep', '{marker}'])")}});
    let stdin = s.stdin.as_mut().unwrap();
    writeln!(stdin, "{request}").unwrap();
    stdin.flush().unwrap();
    let needle = format!("sleep\0{marker}");
    let t = Instant::now();
    while processes_with(&needle) == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the call never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let server_pid = s.child.id();
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let t = Instant::now();
    while processes_with(&needle) > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the call outlived its tool process"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // What a SIGKILL leaves (docs/AGENTS.md): the call's directory, and its cgroup, if any.
    let prefix = format!("tandem-python-{server_pid}-");
    for base in [
        std::env::temp_dir(),
        "/sys/fs/cgroup/pids".into(),
        "/sys/fs/cgroup".into(),
    ] {
        for e in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ =
                    std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_dir(e.path()));
            }
        }
    }

    // Closing stdin ends the tool process, with success.
    let (mut s, _) = Server::start(&[]);
    s.still_answers("the start");
    drop(s.stdin.take());
    assert!(s.child.wait().unwrap().success());
}
