//! `tandem tool python`: the sandboxed Python tool as a program of its own, speaking the
//! tools' JSON-lines protocol ([`super::protocol`]) on stdin/stdout. It prints its schema
//! first, then answers each request in turn (arguments `{"code": "…"}`); a malformed request
//! gets an answer with `error` set, never a crash. It is thus a valid `cmd:` tool itself.

use super::protocol;
use super::sandbox::{self, Limits};
use super::ToolResult;
use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;
use std::io::{BufRead, Write};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ToolArgs {
    #[command(subcommand)]
    pub tool: ToolCommand,
}

#[derive(Subcommand, Debug)]
pub enum ToolCommand {
    /// Run Python code in a sandbox, one JSON request per line on stdin, one answer per line on
    /// stdout (see docs/AGENTS.md).
    Python(PythonArgs),
}

#[derive(Args, Debug)]
pub struct PythonArgs {
    /// Wall-clock limit of one call, in seconds.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub timeout: f64,
    /// CPU seconds of each process of a call [default: the timeout, rounded up].
    #[arg(long, value_name = "SECONDS")]
    pub cpu: Option<u64>,
    /// Address space of each process, in MiB.
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    pub memory_mib: u64,
    /// Processes a call may run at once, Python included.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub processes: u64,
    /// Largest file a call may write, in MiB.
    #[arg(long, default_value_t = 16, value_name = "MIB")]
    pub file_size_mib: u64,
    /// stdout and stderr kept, together, in bytes; a call that prints more is stopped.
    #[arg(long, default_value_t = 8192, value_name = "BYTES")]
    pub output_bytes: usize,
}

impl PythonArgs {
    /// The limits, checked.
    pub fn limits(&self) -> Result<Limits> {
        if !(self.timeout.is_finite() && self.timeout > 0.0 && self.timeout <= 86_400.0) {
            crate::bail_input!(
                "tool python: --timeout {} must be a number of seconds above 0 (at most a day)",
                self.timeout
            );
        }
        let positive = [
            ("--cpu", self.cpu.unwrap_or(1)),
            ("--processes", self.processes),
            ("--file-size-mib", self.file_size_mib),
            ("--output-bytes", self.output_bytes as u64),
        ];
        for (flag, v) in positive {
            if v == 0 {
                crate::bail_input!("tool python: {flag} must be at least 1");
            }
        }
        if self.memory_mib < 64 {
            crate::bail_input!(
                "tool python: --memory-mib {} is too small for Python to start (at least 64)",
                self.memory_mib
            );
        }
        let mut limits = Limits::with_wall(Duration::from_secs_f64(self.timeout));
        if let Some(cpu) = self.cpu {
            limits.cpu_seconds = cpu;
        }
        limits.memory_bytes = self.memory_mib << 20;
        limits.processes = self.processes;
        limits.file_bytes = self.file_size_mib << 20;
        limits.output_bytes = self.output_bytes;
        Ok(limits)
    }
}

/// `tandem tool …`.
pub fn run(args: ToolArgs) -> Result<()> {
    match args.tool {
        ToolCommand::Python(a) => serve_python(&a.limits()?),
    }
}

fn serve_python(limits: &Limits) -> Result<()> {
    sandbox::python().map_err(crate::error::input_error)?;
    eprintln!("tandem tool python: {}", sandbox::layers_line());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "{}", sandbox::schema())?;
    out.flush()?;
    for line in std::io::stdin().lock().split(b'\n') {
        let line = line?;
        let line = String::from_utf8_lossy(&line);
        if line.trim().is_empty() {
            continue;
        }
        writeln!(out, "{}", answer_python(&line, limits))?;
        out.flush()?;
    }
    Ok(())
}

/// The answer line to one request line.
fn answer_python(line: &str, limits: &Limits) -> String {
    let (id, code) = match python_request(line) {
        Ok(request) => request,
        Err((id, why)) => return protocol::answer(&id, &ToolResult::failed(why, 0.0)),
    };
    protocol::answer(&id, &sandbox::run(&code, limits))
}

fn python_request(line: &str) -> Result<(Value, String), (Value, String)> {
    let (id, name, args) = protocol::parse_request(line)?;
    if let Some(name) = name.filter(|n| n != "python") {
        return Err((
            id,
            format!("unknown tool `{name}`: this program serves `python`"),
        ));
    }
    match args.get("code") {
        Some(Value::String(code)) => Ok((id, code.clone())),
        _ => Err((id, "the arguments have no string \"code\"".into())),
    }
}
