//! verl's multi-turn rollout keys (`actor_rollout_ref.rollout.multi_turn.*`) as `[rollout]`
//! keys: the turn limits, the per-turn call cap, the cut of long tool results, and the tools
//! of verl's tool YAML (`tool_config_path`) as `NAME=python:FILE.py:CLASS` values. Every one
//! applies only with `multi_turn.enable`.

use super::config::read_yaml;
use super::rules::{Conv, Ctx};
use serde_json::Value;
use std::path::{Path, PathBuf};

const ENABLE: &str = "actor_rollout_ref.rollout.multi_turn.enable";
const MAX_USER_TURNS: &str = "actor_rollout_ref.rollout.multi_turn.max_user_turns";
const TOOL_CONFIG: &str = "actor_rollout_ref.rollout.multi_turn.tool_config_path";

/// `conv` when `multi_turn.enable` is on; nothing otherwise.
pub(super) fn when_on(v: &Value, ctx: &Ctx, conv: Conv) -> Result<Option<toml::Value>, String> {
    match ctx.get(ENABLE).and_then(|e| e.as_bool()) {
        Some(true) => conv(v, ctx),
        _ => Ok(None),
    }
}

/// A whole number >= `min`, or None for null and verl's 0 ("no limit").
fn limit(v: &Value, min: i64) -> Result<Option<i64>, String> {
    match v {
        Value::Null => Ok(None),
        _ => match v.as_i64() {
            Some(0) => Ok(None),
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(format!(
                "expected a whole number >= {min} (0 or null: no limit)"
            )),
        },
    }
}

/// `max_user_turns` U as `max-turns` U + 1: U tool rounds, then the assistant turn after the
/// last (tandem counts assistant turns, and the last one's calls are not run).
pub(super) fn user_turns(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    Ok(limit(v, 1)?.map(|u| toml::Value::Integer(u + 1)))
}

/// `max_assistant_turns` as `max-turns`, the smaller of it and `max_user_turns` + 1.
pub(super) fn assistant_turns(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    let Some(a) = limit(v, 1)? else {
        return Ok(None);
    };
    let users = ctx.get(MAX_USER_TURNS).map(|u| limit(&u, 1));
    let u = users.transpose().ok().flatten().flatten();
    Ok(Some(toml::Value::Integer(u.map_or(a, |u| a.min(u + 1)))))
}

/// A count >= 1 (`max_parallel_calls`, `max_tool_response_length`).
pub(super) fn count(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_i64() {
        Some(n) if n >= 1 => Ok(Some(toml::Value::Integer(n))),
        _ if v.is_null() => Ok(None),
        _ => Err("expected a whole number >= 1".into()),
    }
}

/// `tool_response_truncate_side`: left, right or middle.
pub(super) fn side(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v.as_str() {
        Some(s @ ("left" | "right" | "middle")) => Ok(Some(toml::Value::String(s.into()))),
        _ if v.is_null() => Ok(None),
        _ => Err("expected left, right or middle".into()),
    }
}

/// `format`: tandem reads Hermes calls (`<tool_call>{…}</tool_call>`, Qwen2.5's), verl's
/// `hermes`; any other is refused.
pub(super) fn format(v: &Value, _: &Ctx) -> Result<Option<toml::Value>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if s == "hermes" => Ok(None),
        _ => Err("tandem reads tool calls in the hermes format only (`<tool_call>{\"name\": …, \"arguments\": {…}}</tool_call>`, Qwen2.5's)".into()),
    }
}

/// `tool_config_path`: verl's tool YAML (`tools: - class_name: pkg.mod.Class, config: …,
/// tool_schema: {function: {name: …}}`) as `[rollout] tool`, one `NAME=python:FILE.py:CLASS`
/// per tool whose `pkg/mod.py` is found; a tool that is not, and what a class is not given
/// (its `config`, its `tool_schema`), are noted.
pub(super) fn tools(v: &Value, ctx: &Ctx) -> Result<Option<toml::Value>, String> {
    let Some(given) = v.as_str() else {
        return match v {
            Value::Null => Ok(None),
            _ => Err("expected the path of verl's tool YAML".into()),
        };
    };
    let Some(yaml) = find(Path::new(given), ctx, Path::is_file) else {
        ctx.note(TOOL_CONFIG, format!("{given} is not in the working directory, next to the config or in its parent folders: add [rollout] tool yourself (docs/AGENTS.md)"));
        return Ok(None);
    };
    let doc = read_yaml(&yaml).map_err(|e| format!("{e:#}"))?;
    let Some(list) = doc.get("tools").and_then(Value::as_array) else {
        return Err(format!("{}: no `tools:` list", yaml.display()));
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match tool(t, &yaml, ctx) {
            Ok(Some(value)) => out.push(toml::Value::String(value)),
            Ok(None) => {}
            Err(e) => return Err(format!("{}: tool {i}: {e}", yaml.display())),
        }
    }
    Ok((!out.is_empty()).then_some(toml::Value::Array(out)))
}

/// One tool of the YAML as a `--tool` value, or None (noted) when its file is not found.
fn tool(t: &Value, yaml: &Path, ctx: &Ctx) -> Result<Option<String>, String> {
    let class_name = t
        .get("class_name")
        .and_then(Value::as_str)
        .ok_or("no `class_name`")?;
    let name = t
        .pointer("/tool_schema/function/name")
        .and_then(Value::as_str)
        .ok_or("no `tool_schema.function.name`")?;
    let (module, class) = class_name
        .rsplit_once('.')
        .ok_or_else(|| format!("`class_name: {class_name}` is not `package.module.Class`"))?;
    let file = PathBuf::from(format!("{}.py", module.replace('.', "/")));
    let Some(found) = find(&file, ctx, Path::is_file).or_else(|| near(yaml, &file)) else {
        ctx.note(TOOL_CONFIG, format!("tool `{name}`: {} (of `{class_name}`) is not in the working directory or next to the config or the tool YAML or in their parent folders: add `{name}=python:FILE.py:{class}` to [rollout] tool yourself", file.display()));
        return Ok(None);
    };
    let found = found.canonicalize().unwrap_or(found);
    if t.get("config").is_some_and(super::rules::is_on) || t.get("tool_schema").is_some() {
        ctx.note(TOOL_CONFIG, format!("tool `{name}`: tandem makes `{class}(config={{}}, tool_schema=None)` and reads the schema from its get_openai_tool_schema(): the YAML's `config` and `tool_schema` are not passed (a class that needs them, as verl's Gsm8kTool needs its schema, needs defaults of its own)"));
    }
    Ok(Some(format!("{name}=python:{}:{class}", found.display())))
}

/// `path` as is when absolute, else the first that `ok` accepts of it under the working
/// directory, the config's folder and that folder's parents.
fn find(path: &Path, ctx: &Ctx, ok: fn(&Path) -> bool) -> Option<PathBuf> {
    if path.is_absolute() {
        return ok(path).then(|| path.to_path_buf());
    }
    let mut roots = vec![PathBuf::from(".")];
    if let Some(dir) = &ctx.config.dir {
        roots.extend(dir.ancestors().map(Path::to_path_buf));
    }
    roots.into_iter().map(|r| r.join(path)).find(|p| ok(p))
}

/// `file` under the tool YAML's folder or one of its parents.
fn near(yaml: &Path, file: &Path) -> Option<PathBuf> {
    let dir = yaml.parent()?;
    dir.ancestors().map(|d| d.join(file)).find(|p| p.is_file())
}
