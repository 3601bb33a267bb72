//! The JSON-lines protocol between tandem and a tool program: one request per line on the
//! program's stdin, `{"id": …, "name": …, "arguments": {…}}`, one answer per line on its
//! stdout, `{"id": …, "content": "…"}`, with `"error": "…"` added when the call failed (then
//! `content` may be left out). Before its first answer the program prints its OpenAI
//! function schema as one line. A request for a row that carries arguments for the tool
//! (verl's `tools_kwargs`) has them as `"kwargs": {"create_kwargs": {…}, "execute_kwargs": {…}}`.

use super::ToolResult;
use serde_json::{json, Value};

/// A request line (`kwargs`: the row's arguments for this tool, when it has some).
pub(crate) fn request(id: u64, name: &str, arguments: &Value, kwargs: Option<&Value>) -> String {
    let mut r = json!({"id": id, "name": name, "arguments": arguments});
    if let Some(k) = kwargs {
        r["kwargs"] = k.clone();
    }
    r.to_string()
}

/// A request as a server reads it: (id, name, arguments), or (id, why it is malformed) where
/// id is null when the line did not give one.
pub(crate) fn parse_request(line: &str) -> Result<(Value, Option<String>, Value), (Value, String)> {
    let value: Value = serde_json::from_str(line)
        .map_err(|e| (Value::Null, format!("the request is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err((Value::Null, "the request is not a JSON object".into()));
    };
    let id = map.get("id").cloned().unwrap_or(Value::Null);
    let name = match map.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err((id, "the request's \"name\" is not a string".into())),
    };
    match map.get("arguments") {
        Some(args @ Value::Object(_)) => Ok((id, name, args.clone())),
        _ => Err((id, "the request has no \"arguments\" object".into())),
    }
}

/// The answer line to a request.
pub(crate) fn answer(id: &Value, result: &ToolResult) -> String {
    let mut a = json!({"id": id, "content": result.content});
    if let Some(e) = &result.error {
        a["error"] = json!(e);
    }
    a.to_string()
}

/// An answer as the client reads it: Ok(content) or Err(the tool's error) for a well-formed
/// answer to request `id`; the outer Err says what was malformed.
pub(crate) fn parse_answer(line: &str, id: u64) -> Result<Result<String, String>, String> {
    let shown = || {
        let mut s: String = line.chars().take(200).collect();
        if s.len() < line.len() {
            s.push_str("...");
        }
        s
    };
    let value: Value = serde_json::from_str(line)
        .map_err(|_| format!("answered `{}`, which is not JSON", shown()))?;
    if value.get("id").and_then(Value::as_u64) != Some(id) {
        return Err(format!(
            "answered `{}` to request {id}: the id differs",
            shown()
        ));
    }
    if let Some(e) = value.get("error").filter(|e| !e.is_null()) {
        return Ok(Err(match e {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }));
    }
    match value.get("content") {
        Some(Value::String(s)) => Ok(Ok(s.clone())),
        _ => Err(format!(
            "answered `{}` without a string \"content\" or \"error\"",
            shown()
        )),
    }
}

/// A schema line as a tool program printed it: `{"type": "function", "function": {…}}` or the
/// bare function object, returned wrapped, its `name` checked against (or set to) `name`.
pub(crate) fn parse_schema(line: &str, name: &str) -> Result<Value, String> {
    let value: Value = serde_json::from_str(line)
        .map_err(|e| format!("its schema line is not JSON ({e}): `{line}`"))?;
    let mut function = match value {
        Value::Object(mut m) if m.get("type").and_then(Value::as_str) == Some("function") => {
            match m.remove("function") {
                Some(f @ Value::Object(_)) => f,
                _ => return Err("its schema has no \"function\" object".into()),
            }
        }
        f @ Value::Object(_) => f,
        other => return Err(format!("its schema is {other}, not a JSON object")),
    };
    match function.get("name") {
        None | Some(Value::Null) => function["name"] = json!(name),
        Some(Value::String(n)) if n == name => {}
        Some(other) => {
            return Err(format!(
                "its schema names the function {other}, not \"{name}\" as the --tool value does"
            ))
        }
    }
    if !function.get("parameters").is_none_or(|p| p.is_object()) {
        return Err("its schema's \"parameters\" is not an object".into());
    }
    Ok(json!({"type": "function", "function": function}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip() {
        let line = request(7, "calc", &json!({"x": 1}), None);
        let (id, name, args) = parse_request(&line).unwrap();
        assert_eq!(
            (id, name.as_deref(), args),
            (json!(7), Some("calc"), json!({"x": 1}))
        );
        let kwargs = json!({"create_kwargs": {"ground_truth": "72"}});
        let line = request(8, "calc", &json!({}), Some(&kwargs));
        let sent: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(sent["kwargs"], kwargs);
        assert_eq!(parse_request(&line).unwrap().0, json!(8));
        let ok = ToolResult {
            content: "42\n".into(),
            seconds: 0.1,
            error: None,
        };
        assert_eq!(
            parse_answer(&answer(&json!(7), &ok), 7),
            Ok(Ok("42\n".into()))
        );
        let failed = ToolResult::failed("timed out after 2 s", 2.0);
        assert_eq!(
            parse_answer(&answer(&json!(7), &failed), 7),
            Ok(Err("timed out after 2 s".into()))
        );
    }

    #[test]
    fn malformed_lines_say_what_is_wrong() {
        assert_eq!(
            parse_request("[1]").unwrap_err(),
            (Value::Null, "the request is not a JSON object".into())
        );
        assert_eq!(
            parse_request(r#"{"id": 3, "arguments": 5}"#).unwrap_err(),
            (json!(3), "the request has no \"arguments\" object".into())
        );
        assert!(parse_request("{")
            .unwrap_err()
            .1
            .starts_with("the request is not JSON"));
        assert!(parse_answer("hello", 1).unwrap_err().contains("not JSON"));
        assert!(parse_answer(r#"{"id": 2, "content": "x"}"#, 1)
            .unwrap_err()
            .contains("the id differs"));
        assert!(parse_answer(r#"{"id": 1, "content": 5}"#, 1)
            .unwrap_err()
            .contains("without a string"));
    }

    #[test]
    fn schemas_are_wrapped_and_named() {
        let bare = r#"{"name": "calc", "parameters": {"type": "object"}}"#;
        let want = json!({"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}});
        assert_eq!(parse_schema(bare, "calc").unwrap(), want);
        let wrapped = want.to_string();
        assert_eq!(parse_schema(&wrapped, "calc").unwrap(), want);
        let unnamed = parse_schema(r#"{"description": "d"}"#, "f").unwrap();
        assert_eq!(unnamed["function"]["name"], "f");
        assert!(parse_schema("[1, 2]", "f")
            .unwrap_err()
            .contains("not a JSON object"));
        assert!(parse_schema(bare, "other")
            .unwrap_err()
            .contains("not \"other\""));
        assert!(parse_schema(r#"{"parameters": 3}"#, "f")
            .unwrap_err()
            .contains("parameters"));
    }
}
