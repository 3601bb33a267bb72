//! Chat templates: the Jinja template of a model's `tokenizer_config.json` (or
//! `chat_template.jinja`) rendered with minijinja the way HF transformers'
//! `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)` renders it.
//!
//! What transformers sets up, and so do we: `trim_blocks` and `lstrip_blocks`; the globals
//! `messages`, `add_generation_prompt`, `tools` and `documents` (None), the named special tokens
//! (`bos_token`, `eos_token`, ...), `raise_exception`, `strftime_now`; a `tojson` filter that is
//! Python's `json.dumps` (", " and ": " separators, no HTML escaping, `indent`, `sort_keys`,
//! `ensure_ascii`); loop controls; Python's str/dict/list methods (minijinja-contrib's
//! pycompat). Printed values follow Python's `str()` (`None`, `True`, `1.0`, `['a']`), and the
//! `{% generation %}` block transformers uses for assistant masks renders its body as is.

use super::Message;
use crate::bail_input;
use crate::error::input_error;
use anyhow::Result;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

pub(crate) const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// transformers >= 4.43 saves the default template in its own file; it wins over the config.
pub(crate) const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// ...and named extra templates as `additional_chat_templates/NAME.jinja`.
pub(crate) const CHAT_TEMPLATE_DIR: &str = "additional_chat_templates";
/// transformers' named special tokens, passed to the template when set.
pub(crate) const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];
const NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The model directory (or file) it came from, for messages.
    origin: PathBuf,
    /// (name, token text) for each special token the tokenizer config sets.
    special: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("special", &self.special)
            .finish()
    }
}

impl ChatTemplate {
    /// The default chat template of a model directory.
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate> {
        Self::from_dir_named(dir, None)
    }

    /// A chat template of a model directory by name (`tool_use`, ...), or its default one.
    /// Templates in `chat_template.jinja` / `additional_chat_templates/` take priority over
    /// `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}`).
    pub(crate) fn from_dir_named(dir: &Path, name: Option<&str>) -> Result<ChatTemplate> {
        let shown = dir.display();
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config: Json = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| input_error(format!("{}: cannot read: {e}", config_path.display())))?;
            serde_json::from_str(&text).map_err(|e| {
                input_error(format!("{}: not valid JSON: {e}", config_path.display()))
            })?
        } else {
            Json::Object(Default::default())
        };
        let mut templates = template_files(dir)?;
        if templates.is_empty() {
            templates = config_templates(&config_path, config.get("chat_template"))?;
        }
        if templates.is_empty() {
            bail_input!(
                "{shown}: the model has no chat template (neither {CHAT_TEMPLATE_FILE} nor 'chat_template' in {TOKENIZER_CONFIG_FILE}); pass --raw-prompt to feed prompts as plain text"
            );
        }
        let want = name.unwrap_or("default");
        let Some((_, source)) = templates.iter().find(|(n, _)| n == want) else {
            let names: Vec<&str> = templates.iter().map(|(n, _)| n.as_str()).collect();
            bail_input!(
                "{shown}: no chat template named '{want}' (available: {})",
                names.join(", ")
            );
        };
        let special = special_tokens(&config_path, &config)?;
        Self::new(source, special, dir)
    }

    /// Compile a template source. `special` holds (name, token) pairs such as
    /// ("eos_token", "<|im_end|>"); `origin` names the template in messages.
    pub fn new(
        source: &str,
        special: Vec<(String, String)>,
        origin: &Path,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, generation_blocks_as_plain(source))
            .map_err(|e| {
                input_error(format!(
                    "{}: chat template does not compile: {}",
                    origin.display(),
                    describe(&e)
                ))
            })?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_path_buf(),
            special,
        })
    }

    /// The special tokens the template sees, as (name, token).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special
    }

    /// `apply_chat_template(messages, add_generation_prompt=..., tokenize=False)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// As [`render`](Self::render), with extra template variables (transformers' `**kwargs`,
    /// e.g. `{"enable_thinking": false}` for Qwen3).
    pub(crate) fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        self.render_tools(messages, add_generation_prompt, extra, &[])
    }

    /// As [`render_with`](Self::render_with), offering `tools` (OpenAI function schemas, as
    /// transformers' `tools=`; none: the template sees `tools` = None).
    pub(crate) fn render_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
        tools: &[Json],
    ) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = self
            .special
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.extend(
            extra
                .iter()
                .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
        );
        ctx.push(("messages".into(), Value::from_serialize(messages)));
        ctx.push((
            "tools".into(),
            match tools.is_empty() {
                true => Value::from(()),
                false => Value::from_iter(tools.iter().map(schema_value)),
            },
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let template = self.env.get_template(NAME)?;
        template.render(Value::from_iter(ctx)).map_err(|e| {
            input_error(format!(
                "{}: chat template failed: {}",
                self.origin.display(),
                describe(&e)
            ))
        })
    }
}

impl ChatTemplate {
    /// The text the template writes around `n` tool responses that follow an assistant turn:
    /// `n + 1` pieces, from the end of the assistant's content to the first response, between
    /// the responses, and from the last one to where the next assistant content begins (the
    /// generation prompt). Rendered as transformers renders [user, assistant, tool × n] with
    /// the generation prompt, split at the contents. Qwen2.5: `<|im_end|>\n<|im_start|>user\n
    /// <tool_response>\n`, `\n</tool_response>\n<tool_response>\n`, ...,
    /// `\n</tool_response><|im_end|>\n<|im_start|>assistant\n`.
    pub fn tool_response_text(&self, n: usize) -> Result<Vec<String>> {
        let mark = |i: usize| format!("\u{E000}{i}\u{E000}");
        let mut messages = vec![Message::new("user", "\u{E000}u\u{E000}")];
        messages.extend(
            (0..=n).map(|i| Message::new(if i == 0 { "assistant" } else { "tool" }, mark(i))),
        );
        let text = self.render(&messages, true)?;
        let mut pieces = Vec::with_capacity(n + 1);
        let mut rest = text.as_str();
        for i in 0..=n {
            let m = mark(i);
            let Some(at) = rest.find(&m) else {
                bail_input!(
                    "{}: the chat template does not write tool messages' content (needed for tool calls)",
                    self.origin.display()
                );
            };
            if i > 0 {
                pieces.push(rest[..at].to_string());
            }
            rest = &rest[at + m.len()..];
        }
        pieces.push(rest.to_string());
        Ok(pieces)
    }
}

/// Keys of an OpenAI function schema in the order its writers use (and transformers renders,
/// keeping dict order); serde_json's maps sort their keys, which would render another prompt.
const SCHEMA_KEY_ORDER: [&str; 8] = [
    "type",
    "function",
    "name",
    "description",
    "parameters",
    "properties",
    "required",
    "enum",
];

/// A tool schema as a template value: objects' keys in [`SCHEMA_KEY_ORDER`], then the others
/// in name order.
fn schema_value(v: &Json) -> Value {
    match v {
        Json::Object(m) => {
            let rank = |k: &str| {
                SCHEMA_KEY_ORDER
                    .iter()
                    .position(|o| *o == k)
                    .unwrap_or(usize::MAX)
            };
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_by_key(|k| rank(k));
            Value::from_iter(keys.into_iter().map(|k| (k.clone(), schema_value(&m[k]))))
        }
        Json::Array(a) => Value::from_iter(a.iter().map(schema_value)),
        other => Value::from_serialize(other),
    }
}

/// A minijinja error with its causes on one line.
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

/// `chat_template.jinja` as "default" plus `additional_chat_templates/NAME.jinja`.
fn template_files(dir: &Path) -> Result<Vec<(String, String)>> {
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .map_err(|e| input_error(format!("{}: cannot read: {e}", p.display())))
    };
    let mut out = Vec::new();
    let main = dir.join(CHAT_TEMPLATE_FILE);
    if main.is_file() {
        out.push(("default".to_string(), read(&main)?));
    }
    let extra_dir = dir.join(CHAT_TEMPLATE_DIR);
    if extra_dir.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&extra_dir)
            .map_err(|e| input_error(format!("{}: cannot list: {e}", extra_dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        files.sort();
        for f in files {
            let name = f
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            out.push((name, read(&f)?));
        }
    }
    Ok(out)
}

/// `chat_template` of tokenizer_config.json: a string (the default) or a list of
/// `{name, template}`.
fn config_templates(path: &Path, value: Option<&Json>) -> Result<Vec<(String, String)>> {
    let at = || format!("{}: 'chat_template'", path.display());
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![("default".into(), s.clone())]),
        Some(Json::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                match (
                    item.get("name").and_then(Json::as_str),
                    item.get("template").and_then(Json::as_str),
                ) {
                    (Some(n), Some(t)) => Ok((n.to_string(), t.to_string())),
                    _ => Err(input_error(format!(
                        "{}: entry {i} must be an object with string 'name' and 'template'",
                        at()
                    ))),
                }
            })
            .collect(),
        Some(v) => bail_input!(
            "{}: expected a string or a list of {{name, template}}, found {}",
            at(),
            super::json_kind(v)
        ),
    }
}

/// The named special tokens a tokenizer config sets: strings, or `{"content": ...}` objects
/// (serialized `AddedToken`s).
fn special_tokens(path: &Path, config: &Json) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for name in SPECIAL_TOKEN_NAMES {
        match config.get(name) {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => out.push((name.to_string(), s.clone())),
            Some(obj @ Json::Object(_)) => match obj.get("content").and_then(Json::as_str) {
                Some(s) => out.push((name.to_string(), s.to_string())),
                None => bail_input!(
                    "{}: '{name}' is an object without a string 'content'",
                    path.display()
                ),
            },
            Some(v) => bail_input!(
                "{}: '{name}' must be a string or {{\"content\": ...}}, found {}",
                path.display(),
                super::json_kind(v)
            ),
        }
    }
    Ok(out)
}

/// transformers' `{% generation %}...{% endgeneration %}` (assistant-mask tracking) only marks
/// text; turned into an always-true `if` so the body renders the same, whitespace control
/// markers kept.
fn generation_blocks_as_plain(source: &str) -> String {
    use regex::Regex;
    use std::sync::OnceLock;
    static RE: OnceLock<Regex> = OnceLock::new();
    let re = RE.get_or_init(|| {
        Regex::new(r"\{%(-|\+)?\s*(end)?generation\s*(-|\+)?%\}").expect("valid regex")
    });
    re.replace_all(source, |c: &regex::Captures| {
        let (open, close) = (
            c.get(1).map_or("", |m| m.as_str()),
            c.get(3).map_or("", |m| m.as_str()),
        );
        let tag = if c.get(2).is_some() {
            "endif"
        } else {
            "if true"
        };
        format!("{{%{open} {tag} {close}%}}")
    })
    .into_owned()
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `datetime.now().strftime(format)`.
fn strftime_now(format: String) -> std::result::Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    if StrftimeItems::new(&format).any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        ));
    }
    Ok(chrono::Local::now().format(&format).to_string())
}

/// Printing `{{ x }}` as Python's `str(x)` does: None, True/False, 1.0, ['a', 1].
fn python_formatter(
    out: &mut Output,
    state: &State,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => out
            .write_str(&py_repr(value))
            .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string())),
        ValueKind::Number if !value.is_integer() => out
            .write_str(&py_repr(value))
            .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string())),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a template value (strings quoted, for use inside containers).
fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => match value.as_i64() {
            Some(i) if value.is_integer() => i.to_string(),
            _ => py_float(f64::try_from(value.clone()).unwrap_or(f64::NAN), false),
        },
        ValueKind::String => py_str_repr(value.as_str().unwrap_or("")),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = value
                .try_iter()
                .map(|it| it.map(|v| py_repr(&v)).collect())
                .unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let items: Vec<String> = value
                .try_iter()
                .map(|it| {
                    it.map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&v))
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => value.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text has ' and no ".
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `repr(float)` (shortest round-trip digits; scientific below 1e-4 and from 1e16),
/// or `json.dumps`' spelling of non-finite values when `json`.
fn py_float(f: f64, json: bool) -> String {
    if !f.is_finite() {
        return match (f.is_nan(), f > 0.0, json) {
            (true, _, true) => "NaN",
            (true, _, false) => "nan",
            (false, true, true) => "Infinity",
            (false, true, false) => "inf",
            (false, false, true) => "-Infinity",
            (false, false, false) => "-inf",
        }
        .into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.5e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let point = exp as usize + 1;
            let int_part = if digits.len() >= point {
                digits[..point].to_string()
            } else {
                format!("{digits}{}", "0".repeat(point - digits.len()))
            };
            let frac = if digits.len() > point {
                &digits[point..]
            } else {
                "0"
            };
            format!("{sign}{int_part}.{frac}")
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let rest = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{rest}e{esign}{:02}", &digits[..1], exp.abs())
    }
}

/// Options of Python's `json.dumps` that HF's `tojson` passes through.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF's `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` with those keyword arguments overridable.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().map(str::to_string).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                )
            })?),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair (item, key)",
            ))
        }
        // json.dumps drops the space after "," when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = JsonStyle {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &Value,
    st: &JsonStyle,
    depth: usize,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &st.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match v.as_i64() {
            Some(i) if v.is_integer() => out.push_str(&i.to_string()),
            _ if v.is_integer() => out.push_str(&v.to_string()),
            _ => out.push_str(&py_float(f64::try_from(v.clone())?, true)),
        },
        ValueKind::String => json_str(out, v.as_str().unwrap_or(""), st.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, st, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let val = v.get_item(&k)?;
                // json.dumps turns None/bool/number keys into their JSON text.
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or("").to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
                    ValueKind::Number if k.is_integer() => k.to_string(),
                    ValueKind::Number => py_float(f64::try_from(k.clone())?, true),
                    other => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {other}"
                            ),
                        ))
                    }
                };
                entries.push((key, val));
            }
            if st.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item_sep);
                }
                newline(out, depth + 1);
                json_str(out, k, st.ensure_ascii);
                out.push_str(&st.key_sep);
                write_json(out, val, st, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's json.dumps writes it.
fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
    }

    fn msgs(pairs: &[(&str, &str)]) -> Vec<Message> {
        pairs.iter().map(|(r, c)| Message::new(r, *c)).collect()
    }

    fn template(file: &str, special: &[(&str, &str)]) -> ChatTemplate {
        let path = fixtures().join(file);
        let source = std::fs::read_to_string(&path).unwrap();
        let special = special
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ChatTemplate::new(&source, special, &path).unwrap()
    }

    /// Every case of tests/fixtures/chat/expected.json (rendered by HF transformers with
    /// make_expected.py) renders to the same bytes here.
    #[test]
    fn matches_transformers_on_every_fixture_case() {
        let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
        let doc: Json = serde_json::from_str(&text).unwrap();
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 12);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let special: Vec<(String, String)> = case["special"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect();
            let path = fixtures().join(case["template"].as_str().unwrap());
            let source = std::fs::read_to_string(&path).unwrap();
            let t = ChatTemplate::new(&source, special, &path).unwrap();
            let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
            let got = t
                .render_with(
                    &messages,
                    case["add_generation_prompt"].as_bool().unwrap(),
                    case["kwargs"].as_object().unwrap(),
                )
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(got, case["expected"].as_str().unwrap(), "case {name}");
        }
    }

    /// Qwen2.5's tools block as transformers renders `apply_chat_template(messages,
    /// tools=[schema], add_generation_prompt=True)` (the schema's keys in its writer's order),
    /// and the text around tool responses.
    #[test]
    fn qwen_tools_block_and_tool_response_text() {
        let qwen25 = template("qwen2.5.jinja", &[("eos_token", "<|im_end|>")]);
        let schema = json!({"type": "function", "function": {"name": "python",
            "description": "Run Python", "parameters": {"type": "object",
            "properties": {"code": {"type": "string"}}, "required": ["code"]}}});
        let got = qwen25
            .render_tools(
                &msgs(&[("user", "2+2?")]),
                true,
                &Default::default(),
                &[schema],
            )
            .unwrap();
        assert_eq!(
            got,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n\
             You may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
             {\"type\": \"function\", \"function\": {\"name\": \"python\", \"description\": \"Run Python\", \
             \"parameters\": {\"type\": \"object\", \"properties\": {\"code\": {\"type\": \"string\"}}, \"required\": [\"code\"]}}}\n\
             </tools>\n\nFor each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n\
             </tool_call><|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            qwen25.tool_response_text(1).unwrap(),
            [
                "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ]
        );
        assert_eq!(
            qwen25.tool_response_text(2).unwrap(),
            [
                "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                "\n</tool_response>\n<tool_response>\n",
                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ]
        );
        // ChatML writes a tool message as a turn of its own role.
        let chatml = template("chatml.jinja", &[]);
        assert_eq!(
            chatml.tool_response_text(1).unwrap(),
            [
                "<|im_end|>\n<|im_start|>tool\n",
                "<|im_end|>\n<|im_start|>assistant\n"
            ]
        );
    }

    #[test]
    fn chatml_and_qwen_exact_text() {
        let su = msgs(&[("system", "You are terse."), ("user", "2+2?")]);
        let u = msgs(&[("user", "2+2?")]);
        let chatml = template("chatml.jinja", &[]);
        assert_eq!(
            chatml.render(&su, true).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            chatml.render(&u, false).unwrap(),
            "<|im_start|>user\n2+2?<|im_end|>\n"
        );
        let qwen25 = template("qwen2.5.jinja", &[("eos_token", "<|im_end|>")]);
        assert_eq!(
            qwen25.render(&u, true).unwrap(),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            qwen25.render(&su, false).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        );
        let qwen3 = template("qwen3.jinja", &[("eos_token", "<|im_end|>")]);
        assert_eq!(
            qwen3.render(&u, true).unwrap(),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_think = json!({"enable_thinking": false});
        assert_eq!(
            qwen3
                .render_with(&u, true, no_think.as_object().unwrap())
                .unwrap(),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
    }

    fn model_dir(config: Json) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(TOKENIZER_CONFIG_FILE),
            serde_json::to_string(&config).unwrap(),
        )
        .unwrap();
        dir
    }

    #[test]
    fn from_dir_reads_tokens_and_template_forms() {
        let t = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}";
        let dir = model_dir(json!({
            "chat_template": t,
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "unk_token": null,
        }));
        let ct = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(
            ct.special_tokens(),
            &[
                ("bos_token".to_string(), "<s>".to_string()),
                ("eos_token".to_string(), "</s>".to_string())
            ]
        );
        let u = msgs(&[("user", "hi")]);
        assert_eq!(ct.render(&u, true).unwrap(), "<s>hi</s>");

        // The list-of-named-templates form; "default" unless a name is asked for.
        let dir = model_dir(json!({
            "chat_template": [
                {"name": "tool_use", "template": "T:{{ messages[0].content }}"},
                {"name": "default", "template": "D:{{ messages[0].content }}"},
            ],
        }));
        assert_eq!(
            ChatTemplate::from_dir(dir.path())
                .unwrap()
                .render(&u, false)
                .unwrap(),
            "D:hi"
        );
        let named = ChatTemplate::from_dir_named(dir.path(), Some("tool_use")).unwrap();
        assert_eq!(named.render(&u, false).unwrap(), "T:hi");
        let err = ChatTemplate::from_dir_named(dir.path(), Some("rag")).unwrap_err();
        assert!(
            err.to_string()
                .contains("no chat template named 'rag' (available: tool_use, default)"),
            "{err}"
        );

        // chat_template.jinja wins over the config's template.
        std::fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "F:{{ messages[0].content }}\n",
        )
        .unwrap();
        assert_eq!(
            ChatTemplate::from_dir(dir.path())
                .unwrap()
                .render(&u, false)
                .unwrap(),
            "F:hi"
        );
    }

    #[test]
    fn template_problems_are_input_errors_naming_the_model() {
        let u = msgs(&[("user", "hi")]);
        let dir = model_dir(json!({"eos_token": "</s>"}));
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string().contains("the model has no chat template"),
            "{err}"
        );

        let dir = model_dir(json!({"chat_template": "{% for m in messages %}"}));
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        let shown = dir.path().display().to_string();
        assert!(
            err.to_string()
                .starts_with(&format!("{shown}: chat template does not compile")),
            "{err}"
        );

        let dir = model_dir(json!({
            "chat_template": "{% if messages[0].role != 'system' %}{{ raise_exception('a system message is required') }}{% endif %}ok"
        }));
        let shown = dir.path().display().to_string();
        let ct = ChatTemplate::from_dir(dir.path()).unwrap();
        let err = ct.render(&u, true).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("{shown}: chat template failed")),
            "{msg}"
        );
        assert!(msg.contains("a system message is required"), "{msg}");
        assert_eq!(ct.render(&msgs(&[("system", "s")]), true).unwrap(), "ok");

        let dir = model_dir(json!({"chat_template": 5}));
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(
            err.to_string()
                .contains("'chat_template': expected a string or a list"),
            "{err}"
        );
        let dir = model_dir(json!({"chat_template": "x", "eos_token": 7}));
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(
            err.to_string().contains("'eos_token' must be a string"),
            "{err}"
        );
    }

    #[test]
    fn messages_keep_python_dict_order() {
        // transformers passes {"role": ..., "content": ...} dicts; their key order shows in
        // tojson and items().
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}{% for k, v in messages[0].items() %}|{{ k }}{% endfor %}",
            vec![],
            Path::new("inline"),
        )
        .unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "hi")]), false).unwrap(),
            r#"{"role": "user", "content": "hi"}|role|content"#
        );
    }

    #[test]
    fn python_number_spelling() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e300, "-2.5e+300"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f, false), want, "{f}");
        }
        assert_eq!(py_float(f64::NAN, true), "NaN");
        assert_eq!(py_float(f64::NEG_INFINITY, false), "-inf");
    }

    #[test]
    fn strftime_now_is_local_time() {
        let t = ChatTemplate::new(
            "{{ strftime_now('%Y') }}|{{ strftime_now('%d %b %Y') }}",
            vec![],
            Path::new("inline"),
        )
        .unwrap();
        let got = t.render(&[], false).unwrap();
        let now = chrono::Local::now();
        // The two calls straddle midnight at most once in a test's lifetime.
        let want = format!("{}|{}", now.format("%Y"), now.format("%d %b %Y"));
        assert_eq!(got, want);
        let bad =
            ChatTemplate::new("{{ strftime_now('%Q') }}", vec![], Path::new("inline")).unwrap();
        assert!(bad
            .render(&[], false)
            .unwrap_err()
            .to_string()
            .contains("invalid format"));
    }
}
