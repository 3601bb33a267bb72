//! A verl config as flat dotted keys: the YAML file, then Hydra-style command-line overrides
//! (`a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b`, `~a.b=v`), then OmegaConf interpolations
//! (`${a.b}`, `${oc.select:a.b,default}`) resolved where a mapped key needs them.
//!
//! Values are JSON values (YAML's null, booleans, numbers, strings, lists); a mapping is
//! flattened into its leaves, an empty mapping is a leaf of its own (`engine_kwargs.vllm: {}`).

use crate::bail_input;
use anyhow::Result;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use yaml_rust2::{Yaml, YamlLoader};

/// A verl config: every leaf by its dotted key.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Config {
    pub(crate) leaves: BTreeMap<String, Value>,
    /// The folder of the config file (None for text not read from a file): where paths the
    /// config names are looked for besides the working directory.
    pub(crate) dir: Option<std::path::PathBuf>,
}

/// A YAML file (verl's tool config) as a JSON value; errors name the file.
pub(crate) fn read_yaml(path: &Path) -> Result<Value> {
    let shown = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse_yaml(&text, &shown),
        Err(e) => bail_input!("{shown}: cannot read: {e}"),
    }
}

/// YAML text as a JSON value; `what` names the text in messages.
fn parse_yaml(text: &str, what: &str) -> Result<Value> {
    let docs = match YamlLoader::load_from_str(text) {
        Ok(d) => d,
        Err(e) => bail_input!("{what}: not valid YAML: {e}"),
    };
    match docs.len() {
        0 => Ok(Value::Null),
        1 => to_json(&docs[0]).map_err(|e| crate::error::input_error(format!("{what}: {e}"))),
        n => bail_input!("{what}: {n} YAML documents; a verl config is one"),
    }
}

fn to_json(y: &Yaml) -> Result<Value, String> {
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(s) => {
            let f: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
            serde_json::Number::from_f64(f)
                .map(Value::Number)
                .ok_or_else(|| format!("`{s}`: not a finite number"))?
        }
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Hash(h) => {
            let mut map = serde_json::Map::new();
            for (k, v) in h {
                let key = match k {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    other => return Err(format!("a mapping key that is not a name: {other:?}")),
                };
                map.insert(key, to_json(v)?);
            }
            Value::Object(map)
        }
        Yaml::Alias(_) => return Err("YAML aliases (*name) are not supported".into()),
        Yaml::BadValue => return Err("a value YAML could not read".into()),
    })
}

/// Every leaf of `v` under `prefix` into `out`.
fn flatten(v: &Value, prefix: &str, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let key = match prefix {
                    "" => k.clone(),
                    p => format!("{p}.{k}"),
                };
                flatten(v, &key, out);
            }
        }
        v if !prefix.is_empty() => {
            out.insert(prefix.to_string(), v.clone());
        }
        _ => {}
    }
}

impl Config {
    /// Read a verl YAML config (a flattened one such as `--cfg job` prints, or ppo_trainer.yaml
    /// itself; Hydra's `defaults:` list is kept as a key, not followed).
    pub(crate) fn load(path: &Path) -> Result<Config> {
        let shown = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => bail_input!("{shown}: cannot read the verl config: {e}"),
        };
        let mut config = Config::parse(&text, &shown)?;
        config.dir = path.parent().map(Path::to_path_buf);
        Ok(config)
    }

    pub(crate) fn parse(text: &str, what: &str) -> Result<Config> {
        let v = parse_yaml(text, what)?;
        if !matches!(v, Value::Object(_) | Value::Null) {
            bail_input!("{what}: a verl config is a mapping of keys, not a single value");
        }
        let mut leaves = BTreeMap::new();
        flatten(&v, "", &mut leaves);
        Ok(Config { leaves, dir: None })
    }

    /// Whether `key` is a leaf or has leaves under it.
    fn has(&self, key: &str) -> bool {
        let below = format!("{key}.");
        self.leaves.contains_key(key) || self.leaves.keys().any(|k| k.starts_with(&below))
    }

    /// Remove `key` and everything under it.
    fn remove(&mut self, key: &str) {
        let below = format!("{key}.");
        self.leaves
            .retain(|k, _| k != key && !k.starts_with(&below));
    }

    fn set(&mut self, key: &str, v: &Value) {
        self.remove(key);
        let mut one = BTreeMap::new();
        flatten(v, key, &mut one);
        if one.is_empty() {
            // An empty mapping is a leaf.
            one.insert(key.to_string(), v.clone());
        }
        self.leaves.extend(one);
    }

    /// Apply one Hydra override: `key=value` sets, `+key=value` adds a key that is not there,
    /// `++key=value` sets whether there or not, `~key` (or `~key=value`, checked) deletes.
    pub(crate) fn apply_override(&mut self, arg: &str) -> Result<()> {
        let (lhs, value) = match arg.split_once('=') {
            Some((l, v)) => (l, Some(v)),
            None => (arg, None),
        };
        let (op, key) = if let Some(k) = lhs.strip_prefix("++") {
            ("++", k)
        } else if let Some(k) = lhs.strip_prefix('+') {
            ("+", k)
        } else if let Some(k) = lhs.strip_prefix('~') {
            ("~", k)
        } else {
            ("", lhs)
        };
        let valid = !key.is_empty()
            && key.split('.').all(|p| {
                !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || "_-@".contains(c))
            });
        if !valid {
            bail_input!("override `{arg}`: `{key}` is not a dotted key (expected key=value, +key=value, ++key=value or ~key)");
        }
        let parsed =
            match value {
                Some(v) => Some(override_value(v).map_err(|e| {
                    crate::error::input_error(format!("override `{arg}`: {key}: {e}"))
                })?),
                None => None,
            };
        match (op, parsed) {
            ("~", None) => {
                if !self.has(key) {
                    bail_input!("override `{arg}`: cannot delete {key}: the config has no such key");
                }
                self.remove(key);
            }
            ("~", Some(v)) => {
                if self.leaves.get(key) != Some(&v) {
                    bail_input!(
                        "override `{arg}`: cannot delete {key}: its value is {}, not {v}",
                        self.leaves.get(key).map_or("absent".into(), |x| x.to_string())
                    );
                }
                self.remove(key);
            }
            (_, None) => bail_input!("override `{arg}`: {key} needs a value (key=value)"),
            ("+", Some(_)) if self.has(key) => bail_input!(
                "override `{arg}`: {key} is already in the config: set it with `{key}=...` (or `++{key}=...`)"
            ),
            (_, Some(v)) => self.set(key, &v),
        }
        Ok(())
    }

    /// The value of `key` with interpolations resolved (None: not in the config).
    pub(crate) fn get(&self, key: &str) -> Result<Option<Value>, String> {
        match self.leaves.get(key) {
            None => Ok(None),
            Some(v) => self.resolve(v, 0).map(Some),
        }
    }

    /// `${a.b}` and `${oc.select:a.b,default}` (a whole value, as verl's configs write them).
    fn resolve(&self, v: &Value, depth: usize) -> Result<Value, String> {
        let Some(inner) = v
            .as_str()
            .and_then(|s| s.trim().strip_prefix("${"))
            .and_then(|s| s.strip_suffix('}'))
        else {
            return Ok(v.clone());
        };
        if depth > 16 {
            return Err(format!("{v}: interpolations nested too deep (a cycle?)"));
        }
        let (target, default) = match inner.strip_prefix("oc.select:") {
            Some(rest) => match rest.split_once(',') {
                Some((t, d)) => (t.trim(), Some(d.trim())),
                None => (rest.trim(), None),
            },
            None => (inner.trim(), None),
        };
        if target.starts_with('.') || target.contains(':') || target.contains("${") {
            return Err(format!(
                "{v}: only absolute interpolations (${{a.b}}, ${{oc.select:a.b,default}}) are resolved"
            ));
        }
        match (self.leaves.get(target), default) {
            (Some(t), _) => self.resolve(t, depth + 1),
            (None, Some(d)) => override_value(d),
            (None, None) => Err(format!("{v}: the config has no key {target}")),
        }
    }
}

/// An override's value as Hydra reads it: YAML scalars and flow collections (`1e-6`, `True`,
/// `null`, `'text'`, `[a, b]`); an empty value is the empty string.
fn override_value(text: &str) -> Result<Value, String> {
    if text.trim().is_empty() {
        return Ok(Value::String(String::new()));
    }
    let docs = YamlLoader::load_from_str(text).map_err(|e| format!("not a value: {e}"))?;
    match docs.as_slice() {
        [one] => to_json(one),
        _ => Err(format!("not one value: `{text}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const YAML: &str = "
data:
  train_batch_size: 1024
  max_response_length: 512
actor_rollout_ref:
  actor:
    optim:
      lr: 1.0e-06
      betas: [0.9, 0.999]
  rollout:
    'n': 1
    response_length: ${oc.select:data.max_response_length,512}
    prompt_length: ${data.max_prompt_length}
    engine_kwargs:
      vllm: {}
";

    fn config() -> Config {
        Config::parse(YAML, "t.yaml").unwrap()
    }

    #[test]
    fn yaml_becomes_dotted_leaves() {
        let c = config();
        assert_eq!(c.leaves["data.train_batch_size"], json!(1024));
        assert_eq!(c.leaves["actor_rollout_ref.actor.optim.lr"], json!(1e-6));
        assert_eq!(
            c.leaves["actor_rollout_ref.actor.optim.betas"],
            json!([0.9, 0.999])
        );
        assert_eq!(c.leaves["actor_rollout_ref.rollout.n"], json!(1));
        assert_eq!(
            c.leaves["actor_rollout_ref.rollout.engine_kwargs.vllm"],
            json!({})
        );
        assert_eq!(c.leaves.len(), 8);
    }

    #[test]
    fn overrides_set_add_and_delete() {
        let mut c = config();
        for o in [
            "data.train_batch_size=256",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "+trainer.logger=[console, wandb]",
            "++data.train_batch_size=128",
            "~actor_rollout_ref.rollout.engine_kwargs",
            "data.val_files='x.parquet'",
        ] {
            c.apply_override(o).unwrap_or_else(|e| panic!("{o}: {e:#}"));
        }
        assert_eq!(c.leaves["data.train_batch_size"], json!(128));
        assert_eq!(c.leaves["actor_rollout_ref.actor.optim.lr"], json!(3e-6));
        assert_eq!(c.leaves["actor_rollout_ref.actor.use_kl_loss"], json!(true));
        assert_eq!(c.leaves["trainer.logger"], json!(["console", "wandb"]));
        assert_eq!(c.leaves["data.val_files"], json!("x.parquet"));
        assert!(!c.has("actor_rollout_ref.rollout.engine_kwargs"));
        // `~key=value` deletes only when the value matches.
        c.apply_override("~data.train_batch_size=128").unwrap();
        assert!(!c.has("data.train_batch_size"));
    }

    #[test]
    fn bad_overrides_name_the_key() {
        let mut c = config();
        for (o, want) in [
            (
                "+data.max_response_length=1",
                "data.max_response_length is already in the config",
            ),
            ("~data.nope", "cannot delete data.nope"),
            ("~data.max_response_length=7", "its value is 512, not 7"),
            ("data..x=1", "`data..x` is not a dotted key"),
            (
                "data.train_batch_size",
                "data.train_batch_size needs a value",
            ),
            ("data.x=[1, 2", "data.x: not a value"),
        ] {
            let e = c.apply_override(o).unwrap_err();
            assert!(crate::error::is_input_error(&e));
            assert!(format!("{e:#}").contains(want), "{o}: {e:#}");
        }
    }

    #[test]
    fn interpolations_resolve_against_the_config() {
        let mut c = config();
        let key = "actor_rollout_ref.rollout.response_length";
        assert_eq!(c.get(key).unwrap(), Some(json!(512)));
        c.apply_override("data.max_response_length=1024").unwrap();
        assert_eq!(c.get(key).unwrap(), Some(json!(1024)));
        c.apply_override("~data.max_response_length").unwrap();
        assert_eq!(c.get(key).unwrap(), Some(json!(512)), "oc.select's default");
        let e = c
            .get("actor_rollout_ref.rollout.prompt_length")
            .unwrap_err();
        assert!(e.contains("no key data.max_prompt_length"), "{e}");
    }

    #[test]
    fn bad_yaml_is_an_input_error() {
        let e = Config::parse("a: [1, 2\n", "bad.yaml").unwrap_err();
        assert!(crate::error::is_input_error(&e));
        assert!(
            format!("{e:#}").starts_with("bad.yaml: not valid YAML"),
            "{e:#}"
        );
        let e = Config::parse("- 1\n- 2\n", "list.yaml").unwrap_err();
        assert!(format!("{e:#}").contains("a mapping of keys"), "{e:#}");
    }
}
