//! Per-row tool arguments in verl's `tools_kwargs` shape: `{TOOL: {"create_kwargs": {…},
//! "execute_kwargs": {…}, "release_kwargs": {…}, "calc_reward_kwargs": {…}}}`, found in a
//! `tools_kwargs` column or in `extra_info.tools_kwargs` (verl's multi-turn datasets), as an
//! object (a struct column) or as JSON text. `rollout --tool` hands each tool its entry.

use serde_json::{Map, Value};

/// The keys of a tool's entry; `calc_reward_kwargs` is accepted and dropped (tandem's reward
/// is the `score` stage's, not the tool's).
const KEYS: [&str; 4] = [
    "create_kwargs",
    "execute_kwargs",
    "release_kwargs",
    "calc_reward_kwargs",
];

/// The column a dataset may hold them in (else `extra_info.tools_kwargs`).
pub const COLUMN: &str = "tools_kwargs";

/// One row's value checked and normalized: None for null, an empty object or only null
/// entries; else an object of tool name -> `{create_kwargs, execute_kwargs, release_kwargs}`
/// (those given, each an object; null ones left out, as a struct column fills absent fields
/// with null). `Err` says what is malformed.
pub fn parse(value: &Value) -> Result<Option<Value>, String> {
    let parsed;
    let value = match value {
        Value::Null => return Ok(None),
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s).map_err(|e| format!("not JSON ({e})"))?;
            &parsed
        }
        v => v,
    };
    let Value::Object(tools) = value else {
        return Err(format!(
            "expected an object {{TOOL: {{\"create_kwargs\": {{…}}, \"execute_kwargs\": {{…}}}}}}, found {}",
            super::json_kind(value)
        ));
    };
    let mut out = Map::new();
    for (tool, entry) in tools {
        let entry = match entry {
            Value::Null => continue,
            Value::Object(m) => m,
            v => {
                return Err(format!(
                    "tool `{tool}`: expected an object with {}, found {}",
                    KEYS.join(", "),
                    super::json_kind(v)
                ))
            }
        };
        let mut kept = Map::new();
        for (key, v) in entry {
            if !KEYS.contains(&key.as_str()) {
                return Err(format!(
                    "tool `{tool}`: unknown key `{key}` (expected {})",
                    KEYS.join(", ")
                ));
            }
            match v {
                Value::Null => {}
                Value::Object(_) if key == "calc_reward_kwargs" => {}
                Value::Object(_) => {
                    kept.insert(key.clone(), v.clone());
                }
                v => {
                    return Err(format!(
                        "tool `{tool}`: `{key}` must be an object, found {}",
                        super::json_kind(v)
                    ))
                }
            }
        }
        if !kept.is_empty() {
            out.insert(tool.clone(), Value::Object(kept));
        }
    }
    Ok((!out.is_empty()).then_some(Value::Object(out)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn verl_shapes_are_normalized() {
        let v = json!({"calc": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": null,
                                "calc_reward_kwargs": {"x": 1}},
                       "other": null,
                       "empty": {"release_kwargs": null}});
        let want = json!({"calc": {"create_kwargs": {"ground_truth": "72"}}});
        assert_eq!(parse(&v), Ok(Some(want.clone())));
        assert_eq!(parse(&Value::String(v.to_string())), Ok(Some(want)));
        assert_eq!(parse(&Value::Null), Ok(None));
        assert_eq!(parse(&json!({})), Ok(None));
        assert_eq!(parse(&json!("{}")), Ok(None));
    }

    #[test]
    fn malformed_values_say_what_is_wrong() {
        let err = |v: Value| parse(&v).unwrap_err();
        assert!(err(json!("{bad")).starts_with("not JSON ("));
        assert!(err(json!([1])).ends_with("found an array"));
        assert_eq!(
            err(json!({"calc": 3})),
            "tool `calc`: expected an object with create_kwargs, execute_kwargs, release_kwargs, calc_reward_kwargs, found a number"
        );
        assert_eq!(
            err(json!({"calc": {"create": {}}})),
            "tool `calc`: unknown key `create` (expected create_kwargs, execute_kwargs, release_kwargs, calc_reward_kwargs)"
        );
        assert_eq!(
            err(json!({"calc": {"execute_kwargs": "x"}})),
            "tool `calc`: `execute_kwargs` must be an object, found a string"
        );
    }
}
