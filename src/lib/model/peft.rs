//! LoRA adapters in PEFT's files: `adapter_config.json` (peft_type LORA, r, lora_alpha,
//! target_modules, base_model_name_or_path) and `adapter_model.safetensors`, whose keys are
//! PEFT's (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), f32 as the
//! masters are. What HF PEFT's `save_pretrained` writes and `PeftModel.from_pretrained` reads.

use anyhow::Result;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

use crate::error::input_error;
use crate::model::config::write_json;
use crate::model::lora::LoraSpec;
use crate::model::safetensors::{load_file, write_file};
use crate::model::{Tensor, Weights};

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// What PEFT puts before the model's own tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Whether `dir` holds a PEFT adapter.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// An adapter read from its directory.
#[derive(Clone, Debug)]
pub struct Adapter {
    pub spec: LoraSpec,
    /// By the model's names (PEFT's less [`PEFT_PREFIX`]).
    pub weights: Weights,
    /// `base_model_name_or_path` as written.
    pub base: String,
}

/// The base model's directory: `base` (base_model_name_or_path) relative to the adapter's
/// directory (or absolute), else to the working directory (input error when neither is a
/// directory).
pub fn base_dir(adapter_dir: &Path, base: &str) -> Result<PathBuf> {
    let b = Path::new(base);
    let tries = [adapter_dir.join(b), b.to_path_buf()];
    tries.into_iter().find(|p| p.is_dir()).ok_or_else(|| {
        input_error(format!(
            "{}: base_model_name_or_path '{base}' is not a model directory here (tandem reads \
             a base model from a path, not from the hub)",
            adapter_dir.join(ADAPTER_CONFIG).display(),
        ))
    })
}

/// The adapter config's JSON, as PEFT writes it for a causal LM.
fn config_json(spec: &LoraSpec, base: &str) -> Map<String, Value> {
    let targets: Vec<Value> = spec.targets.iter().map(|t| t.module().into()).collect();
    let mut m = Map::new();
    m.insert("peft_type".into(), "LORA".into());
    m.insert("task_type".into(), "CAUSAL_LM".into());
    m.insert("r".into(), spec.rank.into());
    // A whole alpha as an integer, as PEFT's configs have it.
    let alpha = spec.alpha;
    let alpha = match alpha.fract() == 0.0 && alpha.abs() < 1e9 {
        true => Value::from(alpha as i64),
        false => Value::from(f64::from(alpha)),
    };
    m.insert("lora_alpha".into(), alpha);
    m.insert("target_modules".into(), targets.into());
    m.insert("base_model_name_or_path".into(), base.into());
    m.insert("lora_dropout".into(), 0.0.into());
    m.insert("bias".into(), "none".into());
    m.insert("fan_in_fan_out".into(), false.into());
    m.insert("use_rslora".into(), false.into());
    m.insert("inference_mode".into(), true.into());
    m
}

/// Writes the adapter config and weights into `dir` (an existing directory: the caller
/// writes the whole directory under a temporary name and renames it).
pub fn write_adapter(dir: &Path, spec: &LoraSpec, weights: &Weights, base: &str) -> Result<()> {
    write_json(&dir.join(ADAPTER_CONFIG), &config_json(spec, base))?;
    let tensors = weights
        .iter()
        .map(|(name, t)| (format!("{PEFT_PREFIX}{name}"), F32View(t)));
    write_file(&dir.join(ADAPTER_WEIGHTS), tensors, None)
}

/// Reads an adapter directory (input errors name the file and key or tensor).
pub fn read_adapter(dir: &Path) -> Result<Adapter> {
    let (spec, base) = read_config(dir)?;
    let weights = read_weights(&dir.join(ADAPTER_WEIGHTS))?;
    Ok(Adapter {
        spec,
        weights,
        base,
    })
}

/// The adapter config's spec and base_model_name_or_path.
pub fn read_config(dir: &Path) -> Result<(LoraSpec, String)> {
    let path = dir.join(ADAPTER_CONFIG);
    let file = path.display();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| input_error(format!("{file}: cannot read: {e}")))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| input_error(format!("{file}: invalid JSON: {e}")))?;
    let key = |k: &str| {
        v.get(k)
            .ok_or_else(|| input_error(format!("{file}: key '{k}' is missing")))
    };
    if key("peft_type")?.as_str() != Some("LORA") {
        crate::bail_input!(
            "{file}: peft_type must be \"LORA\", got {}",
            key("peft_type")?
        );
    }
    let Some(rank) = key("r")?.as_u64().filter(|r| *r > 0) else {
        crate::bail_input!("{file}: r must be a positive integer, got {}", key("r")?);
    };
    let Some(alpha) = key("lora_alpha")?.as_f64().filter(|a| *a > 0.0) else {
        crate::bail_input!(
            "{file}: lora_alpha must be positive, got {}",
            key("lora_alpha")?
        );
    };
    let targets = match key("target_modules")? {
        Value::String(s) => LoraSpec::parse_targets(s, &format!("{file}: target_modules"))?,
        Value::Array(a) => {
            let names: Option<Vec<&str>> = a.iter().map(Value::as_str).collect();
            let Some(names) = names else {
                crate::bail_input!("{file}: target_modules must be a list of names");
            };
            LoraSpec::parse_targets(&names.join(","), &format!("{file}: target_modules"))?
        }
        other => crate::bail_input!("{file}: target_modules must be a list, got {other}"),
    };
    for (k, off) in [("use_rslora", false), ("use_dora", false)] {
        if v.get(k).and_then(Value::as_bool).unwrap_or(off) {
            crate::bail_input!("{file}: {k} = true is not supported (plain LoRA only)");
        }
    }
    let base = key("base_model_name_or_path")?
        .as_str()
        .unwrap_or_default()
        .to_string();
    let spec = LoraSpec {
        rank: rank as usize,
        alpha: alpha as f32,
        targets,
    };
    Ok((spec, base))
}

/// The adapter tensors by the model's names.
fn read_weights(path: &Path) -> Result<Weights> {
    let mut out = Weights::new();
    for (name, t, _) in load_file(path)? {
        // PEFT writes `lora_A.weight`; with a named adapter some versions keep the name.
        let key = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name);
        let key = key
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.");
        if !(key.ends_with(".lora_A.weight") || key.ends_with(".lora_B.weight")) {
            crate::bail_input!(
                "{}: tensor '{name}' is not a LoRA A or B matrix (plain LoRA only: no bias, \
                 no modules_to_save)",
                path.display()
            );
        }
        out.insert(key, t);
    }
    Ok(out)
}

/// An f32 tensor as safetensors writes it.
struct F32View<'a>(&'a Tensor);

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let bytes: Vec<u8> = self.0.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes.into()
    }
    fn data_len(&self) -> usize {
        4 * self.0.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::init_adapters;
    use crate::model::Config;

    #[test]
    fn adapter_files_round_trip_with_peft_names() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::small_qwen2();
        let spec = LoraSpec {
            rank: 4,
            alpha: 8.0,
            targets: LoraSpec::parse_targets("q,v,down", "t").unwrap(),
        };
        let w = init_adapters(&cfg, &spec, 3);
        write_adapter(dir.path(), &spec, &w, "/models/base").unwrap();
        let back = read_adapter(dir.path()).unwrap();
        assert_eq!(back.spec, spec);
        assert_eq!(back.weights, w);
        assert_eq!(back.base, "/models/base");
        let names: Vec<String> = load_file(&dir.path().join(ADAPTER_WEIGHTS))
            .unwrap()
            .into_iter()
            .map(|(n, _, _)| n)
            .collect();
        assert!(names
            .contains(&"base_model.model.model.layers.1.mlp.down_proj.lora_B.weight".to_string()));
        let v: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(ADAPTER_CONFIG)).unwrap())
                .unwrap();
        assert_eq!(
            v["target_modules"],
            serde_json::json!(["q_proj", "v_proj", "down_proj"])
        );
        assert_eq!(
            (v["r"].as_u64(), v["peft_type"].as_str()),
            (Some(4), Some("LORA"))
        );
    }

    #[test]
    fn a_bad_adapter_config_names_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(ADAPTER_CONFIG);
        std::fs::write(&p, r#"{"peft_type": "LORA", "r": 0, "lora_alpha": 16}"#).unwrap();
        let e = read_adapter(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("adapter_config.json: r must be a positive integer"),
            "{e}"
        );
        std::fs::write(&p, r#"{"peft_type": "IA3"}"#).unwrap();
        let e = read_adapter(dir.path()).unwrap_err().to_string();
        assert!(e.contains("peft_type must be \"LORA\""), "{e}");
    }
}
