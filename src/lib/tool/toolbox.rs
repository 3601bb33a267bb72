//! The tools of a rollout, built from its `--tool` values ([`Toolbox::from_specs`]):
//! - `python`: the built-in sandboxed Python tool ([`super::sandbox`]), argument `code`;
//! - `NAME=cmd:PROGRAM [ARGS]`: a program speaking the JSON-lines protocol
//!   ([`super::protocol`]), started as argv (split as a shell would, nothing expanded) and
//!   kept as a pool of processes ([`super::pool`]);
//! - `NAME=python:FILE.py:CLASS`: a class shaped like verl's `BaseTool`, run by `basetool.py`
//!   (shipped in the binary, given to `python3 -c`), which speaks the same protocol.
//!
//! Every program is started once while the toolbox is built, to read its schema: a bad
//! value (unknown form, missing program or file, class not found, a schema that is not an
//! object) is an input error naming it, before anything is generated. After that nothing
//! fails: an unknown tool, a crash, a timeout or a malformed answer is a failed
//! [`ToolResult`] the model reads.

use super::pool::Program;
use super::sandbox::{self, Limits};
use super::{ToolCall, ToolResult, Tools};
use crate::error::input_error;
use crate::process::split_args;
use anyhow::Result;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// The driver of `python:FILE.py:CLASS` tools, run as `python3 -c BASETOOL_PY FILE CLASS`.
const BASETOOL_PY: &str = include_str!("basetool.py");

const FORMS: &str = "expected `python`, `NAME=cmd:PROGRAM [ARGS]` or `NAME=python:FILE.py:CLASS`";

enum Tool {
    Python(Limits),
    Program(Program),
}

/// The tools offered to a rollout, in the order of their `--tool` values.
pub struct Toolbox {
    tools: Vec<(String, Tool)>,
}

impl Toolbox {
    /// Builds the tools (starting each program once); `timeout` is the wall-clock limit of
    /// one call (and of a program's start-up).
    pub fn from_specs(specs: &[String], timeout: Duration) -> Result<Toolbox> {
        let mut tools: Vec<(String, Tool)> = Vec::new();
        for spec in specs {
            let (name, tool) =
                parse(spec, timeout).map_err(|e| input_error(format!("--tool `{spec}`: {e}")))?;
            if tools.iter().any(|(n, _)| *n == name) {
                crate::bail_input!("--tool `{spec}`: a tool named `{name}` is given twice");
            }
            tools.push((name, tool));
        }
        Ok(Toolbox { tools })
    }

    /// The tools' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tools.iter().map(|(n, _)| n.as_str()).collect()
    }
}

impl Tools for Toolbox {
    fn schemas(&self) -> Vec<Value> {
        let schema = |tool: &Tool| match tool {
            Tool::Python(_) => sandbox::schema(),
            Tool::Program(p) => p.schema().clone(),
        };
        self.tools.iter().map(|(_, t)| schema(t)).collect()
    }

    fn call(&self, call: &ToolCall, kwargs: &Value) -> ToolResult {
        let start = Instant::now();
        let seconds = || start.elapsed().as_secs_f64();
        let Some((name, tool)) = self.tools.iter().find(|(n, _)| *n == call.name) else {
            let names = self.names().join(", ");
            return ToolResult::failed(
                format!("unknown tool `{}`; the tools are: {names}", call.name),
                0.0,
            );
        };
        match tool {
            Tool::Python(limits) => match call.arguments.get("code") {
                Some(Value::String(code)) => sandbox::run(code, limits),
                _ => ToolResult::failed(
                    format!("tool `{name}` needs a string argument \"code\""),
                    0.0,
                ),
            },
            // The built-in tool takes no per-row arguments; a program gets its own entry.
            Tool::Program(p) => match p.call(&call.arguments, kwargs.get(name)) {
                Ok(Ok(content)) => ToolResult {
                    content,
                    seconds: seconds(),
                    error: None,
                },
                Ok(Err(e)) => ToolResult::failed(e, seconds()),
                Err(e) => ToolResult::failed(format!("tool `{name}` {e}"), seconds()),
            },
        }
    }
}

/// One `--tool` value: its name and tool. The error says what is wrong, without the value.
fn parse(spec: &str, timeout: Duration) -> Result<(String, Tool), String> {
    if spec == "python" {
        sandbox::python()?;
        return Ok(("python".into(), Tool::Python(Limits::with_wall(timeout))));
    }
    let Some((name, form)) = spec.split_once('=') else {
        return Err(FORMS.into());
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > 64 || !name.chars().all(valid) {
        return Err(format!(
            "the name `{name}` must be 1 to 64 letters, digits, `_` or `-` (a function name of the OpenAI schema)"
        ));
    }
    let argv = if let Some(cmd) = form.strip_prefix("cmd:") {
        let argv = split_args(cmd)?;
        if argv.is_empty() {
            return Err("no program after `cmd:`".into());
        }
        argv
    } else if let Some(rest) = form.strip_prefix("python:") {
        python_argv(rest)?
    } else {
        return Err(FORMS.into());
    };
    let program = Program::start(name, argv, timeout)?;
    Ok((name.to_string(), Tool::Program(program)))
}

/// The argv that serves `FILE.py:CLASS` through the driver.
fn python_argv(file_class: &str) -> Result<Vec<String>, String> {
    let Some((file, class)) = file_class.rsplit_once(':') else {
        return Err("expected `NAME=python:FILE.py:CLASS` (the class is missing)".into());
    };
    let ident = |s: &str| {
        s.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_alphanumeric() || c == '_')
    };
    if !ident(class) {
        return Err(format!("`{class}` is not a Python class name"));
    }
    if !Path::new(file).is_file() {
        return Err(format!("{file} does not exist or is not a file"));
    }
    let argv = ["python3", "-c", BASETOOL_PY, file, class];
    Ok(argv.map(String::from).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;

    /// A `cmd:` tool: upper-cases `text` and adds its pid; some texts misbehave.
    const ECHO: &str = r#"
import json, os, sys, time
print(json.dumps({"name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}), flush=True)
for line in sys.stdin:
    r = json.loads(line)
    t = r["arguments"].get("text", "")
    if t == "crash":
        os._exit(3)
    if t == "slow":
        time.sleep(30)
    if t == "garbage":
        print("not json", flush=True)
        continue
    if t == "fail":
        print(json.dumps({"id": r["id"], "error": "bad text"}), flush=True)
        continue
    print(json.dumps({"id": r["id"], "content": t.upper() + " " + str(os.getpid())}), flush=True)
"#;

    /// verl-shaped classes: async methods and a ToolResponse, and a plain one.
    const CLASSES: &str = r#"
import json

class ToolResponse:
    def __init__(self, text):
        self.text = text

class Calc:
    def __init__(self, config, tool_schema):
        self.instances = {}

    def get_openai_tool_schema(self):
        return {"type": "function", "function": {"name": "calc", "description": "adds",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}

    async def create(self, instance_id=None, **kwargs):
        self.instances[instance_id] = True
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        assert instance_id in self.instances
        print("a print of the tool goes to stderr")
        if parameters.get("a") == "boom":
            raise ValueError("boom")
        return ToolResponse(str(parameters["a"] + parameters["b"])), 0.0, {}

    async def release(self, instance_id, **kwargs):
        del self.instances[instance_id]

class Plain:
    schema = {"name": "plain", "parameters": {"type": "object"}}

    def execute(self, instance_id, parameters):
        return "plain " + json.dumps(parameters)

class Truth:
    schema = {"name": "truth"}

    def __init__(self):
        self.truth = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        self.truth[instance_id] = ground_truth
        return instance_id, None

    def execute(self, instance_id, parameters, scale=1):
        return f"{self.truth[instance_id]} x{scale}"

    def release(self, instance_id, note=None):
        assert note in (None, "bye")
        del self.truth[instance_id]
"#;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn call(tools: &Toolbox, name: &str, arguments: Value) -> ToolResult {
        tools.call(
            &ToolCall {
                name: name.into(),
                arguments,
            },
            &Value::Null,
        )
    }

    /// The content of a good call, split into (text, pid) for the echo tool.
    fn echo(tools: &Toolbox, text: &str) -> (String, String) {
        let r = call(tools, "echo", json!({"text": text}));
        assert_eq!(r.error, None, "{}", r.content);
        let (t, pid) = r.content.split_once(' ').unwrap();
        (t.to_string(), pid.to_string())
    }

    #[test]
    fn programs_are_pooled_and_a_bad_process_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let echo_py = write(dir.path(), "echo.py", ECHO);
        let specs = [
            "python".to_string(),
            format!("echo=cmd:python3 {}", echo_py.display()),
        ];
        let tools = Toolbox::from_specs(&specs, Duration::from_secs(2)).unwrap();
        assert_eq!(tools.names(), ["python", "echo"]);
        let schemas = tools.schemas();
        assert_eq!(schemas[0]["function"]["name"], "python");
        assert_eq!(schemas[1]["type"], "function");
        assert_eq!(schemas[1]["function"]["name"], "echo");

        let (text, pid) = echo(&tools, "hi");
        assert_eq!(text, "HI");
        assert_eq!(echo(&tools, "again").1, pid, "the process is reused");
        let r = call(&tools, "echo", json!({"text": "fail"}));
        assert_eq!(
            (r.content.as_str(), r.error.as_deref()),
            ("error: bad text", Some("bad text"))
        );
        assert_eq!(
            echo(&tools, "x").1,
            pid,
            "a tool's own error keeps the process"
        );

        let mut last = pid;
        for (bad, why) in [
            ("crash", "tool `echo` exited (exit status: 3)"),
            ("slow", "tool `echo` timed out after 2 s"),
            (
                "garbage",
                "tool `echo` answered `not json`, which is not JSON",
            ),
        ] {
            let t = Instant::now();
            let r = call(&tools, "echo", json!({"text": bad}));
            assert_eq!(r.error.as_deref(), Some(why), "{bad}");
            assert_eq!(r.content, format!("error: {why}"));
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "{bad} took {:?}",
                t.elapsed()
            );
            let (text, pid) = echo(&tools, "next");
            assert_eq!(text, "NEXT", "after {bad}");
            assert_ne!(pid, last, "after {bad}, a new process serves");
            last = pid;
        }

        let r = call(&tools, "nope", json!({}));
        assert_eq!(
            r.error.as_deref(),
            Some("unknown tool `nope`; the tools are: python, echo")
        );
        let r = call(&tools, "python", json!({"code": "print(6*7)"}));
        assert_eq!((r.content.as_str(), r.error), ("42\n", None));
        let r = call(&tools, "python", json!({"source": "print(1)"}));
        assert_eq!(
            r.error.as_deref(),
            Some("tool `python` needs a string argument \"code\"")
        );
    }

    #[test]
    fn calls_from_many_threads_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let echo_py = write(dir.path(), "echo.py", ECHO);
        let specs = [format!("echo=cmd:python3 {}", echo_py.display())];
        let tools = Toolbox::from_specs(&specs, Duration::from_secs(10)).unwrap();
        let pids: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|i| {
                    let tools = &tools;
                    s.spawn(move || {
                        (0..4)
                            .map(|j| {
                                let (text, pid) = echo(tools, &format!("t{i}c{j}"));
                                assert_eq!(text, format!("T{i}C{j}"));
                                pid
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let distinct: std::collections::BTreeSet<_> = pids.iter().collect();
        // The processes outlive the threads whose calls started them (spawned from the pool's
        // own thread, they die with the process, not with those threads).
        for _ in 0..distinct.len() {
            let (_, pid) = echo(&tools, "later");
            assert!(
                distinct.contains(&pid),
                "a process started by an ended thread is gone"
            );
        }
        // The built-in tool too: each call its own sandbox, side by side.
        let python = Toolbox::from_specs(&["python".to_string()], Duration::from_secs(20)).unwrap();
        std::thread::scope(|s| {
            for i in 0..4 {
                let python = &python;
                s.spawn(move || {
                    let r = call(python, "python", json!({"code": format!("print({i} * 7)")}));
                    assert_eq!((r.content, r.error), (format!("{}\n", i * 7), None));
                });
            }
        });
        assert_eq!(pids.len(), 24);
        assert!(
            (1..=6).contains(&distinct.len()),
            "{} processes for 6 threads",
            distinct.len()
        );
    }

    #[test]
    fn python_classes_shaped_like_verl_tools() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), "my_tools.py", CLASSES);
        let specs = [
            format!("calc=python:{}:Calc", file.display()),
            format!("plain=python:{}:Plain", file.display()),
        ];
        let tools = Toolbox::from_specs(&specs, Duration::from_secs(10)).unwrap();
        let schemas = tools.schemas();
        assert_eq!(schemas[0]["function"]["description"], "adds");
        assert_eq!(
            schemas[1],
            json!({"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}})
        );
        let r = call(&tools, "calc", json!({"a": 2, "b": 3}));
        assert_eq!((r.content.as_str(), r.error), ("5", None));
        let r = call(&tools, "calc", json!({"a": "boom", "b": 1}));
        assert_eq!(r.error.as_deref(), Some("ValueError: boom"));
        let r = call(&tools, "calc", json!({"a": 1.5, "b": 1}));
        assert_eq!(r.content, "2.5", "the process serves on after an exception");
        let r = call(&tools, "plain", json!({"k": [1]}));
        assert_eq!(r.content, "plain {\"k\": [1]}");
    }

    /// A class in a package (verl's `verl/tools/gsm8k_tool.py`) is imported as a module of it,
    /// so that its relative imports work.
    #[test]
    fn a_class_in_a_package_has_its_relative_imports() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("mypkg/tools");
        std::fs::create_dir_all(&pkg).unwrap();
        write(&dir.path().join("mypkg"), "__init__.py", "");
        write(&pkg, "__init__.py", "");
        write(
            &pkg,
            "base_tool.py",
            "class BaseTool:\n    schema = {\"name\": \"rel\"}\n",
        );
        let file = write(
            &pkg,
            "rel_tool.py",
            "from .base_tool import BaseTool\n\nclass RelTool(BaseTool):\n    def execute(self, instance_id, parameters):\n        return __name__\n",
        );
        let specs = [format!("rel=python:{}:RelTool", file.display())];
        let tools = Toolbox::from_specs(&specs, Duration::from_secs(10)).unwrap();
        let r = call(&tools, "rel", json!({}));
        assert_eq!(
            (r.content.as_str(), r.error),
            ("mypkg.tools.rel_tool", None)
        );
    }

    /// A row's `tools_kwargs` entry reaches `create`, `execute` and `release` as keyword
    /// arguments, as verl's rollouts pass them; another tool's entry does not.
    #[test]
    fn a_rows_tool_arguments_reach_the_class() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), "my_tools.py", CLASSES);
        let specs = [format!("truth=python:{}:Truth", file.display())];
        let tools = Toolbox::from_specs(&specs, Duration::from_secs(10)).unwrap();
        let truth = ToolCall {
            name: "truth".into(),
            arguments: json!({}),
        };
        let kwargs = json!({"truth": {"create_kwargs": {"ground_truth": "72"},
                                      "execute_kwargs": {"scale": 2},
                                      "release_kwargs": {"note": "bye"}},
                            "other": {"create_kwargs": {"ground_truth": "1"}}});
        let r = tools.call(&truth, &kwargs);
        assert_eq!((r.content.as_str(), r.error), ("72 x2", None));
        let r = tools.call(
            &truth,
            &json!({"other": {"create_kwargs": {"ground_truth": "1"}}}),
        );
        assert_eq!((r.content.as_str(), r.error), ("None x1", None));
        let r = tools.call(&truth, &json!({"truth": {"execute_kwargs": {"nope": 1}}}));
        assert!(
            r.error.as_deref().unwrap().starts_with("TypeError: "),
            "{r:?}"
        );
    }

    #[test]
    fn bad_tool_values_are_input_errors_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), "my_tools.py", CLASSES);
        let list = write(dir.path(), "list.py", "print('[1, 2]', flush=True)\n");
        let other = write(
            dir.path(),
            "other.py",
            "print('{\"name\": \"other\"}', flush=True)\n",
        );
        let f = |p: &Path| p.display().to_string();
        let cases = [
            ("pyton".to_string(), FORMS.to_string()),
            ("x=foo:bar".into(), FORMS.into()),
            ("x=cmd:".into(), "no program after `cmd:`".into()),
            (
                "x=cmd:/nonexistent/prog --flag".into(),
                "cannot start `/nonexistent/prog`".into(),
            ),
            (
                "bad name=cmd:true".into(),
                "the name `bad name` must be".into(),
            ),
            (
                "x=python:missing.py:C".into(),
                "missing.py does not exist".into(),
            ),
            (
                format!("x=python:{}", f(&file)),
                "(the class is missing)".into(),
            ),
            (
                format!("x=python:{}:9a", f(&file)),
                "`9a` is not a Python class name".into(),
            ),
            (
                format!("x=python:{}:Nope", f(&file)),
                "`python3` exited (exit status: 1) before printing its schema line".into(),
            ),
            (
                format!("x=cmd:python3 {}", f(&list)),
                "its schema is [1,2], not a JSON object".into(),
            ),
            (
                format!("x=cmd:python3 {}", f(&other)),
                "names the function \"other\", not \"x\"".into(),
            ),
        ];
        for (spec, want) in cases {
            let err = Toolbox::from_specs(std::slice::from_ref(&spec), Duration::from_secs(10))
                .err()
                .unwrap_or_else(|| panic!("{spec} was accepted"));
            assert!(crate::error::is_input_error(&err), "{spec}: {err:#}");
            let msg = format!("{err:#}");
            assert!(msg.starts_with(&format!("--tool `{spec}`: ")), "{msg}");
            assert!(msg.contains(&want), "{spec}: {msg}");
        }
        let twice = ["python".to_string(), "python".to_string()];
        let err = Toolbox::from_specs(&twice, Duration::from_secs(10))
            .err()
            .unwrap();
        assert_eq!(
            format!("{err:#}"),
            "--tool `python`: a tool named `python` is given twice"
        );
    }
}
