//! The decoder's hyper-parameters, read from (and written to) an HF `config.json`.

use serde::{Deserialize, Serialize};

/// Which HF architecture a model directory holds. One decoder serves all three; the
/// differences are flags below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// `Qwen2ForCausalLM`: bias on q/k/v projections.
    Qwen2,
    /// `LlamaForCausalLM`: no biases.
    Llama,
    /// `Qwen3ForCausalLM`: RMSNorm on q and k per head, explicit head_dim.
    Qwen3,
}

/// Everything the decoder needs to know about the model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids (config.json and generation_config.json together).
    pub eos_token_ids: Vec<u32>,
    /// A value model (a critic): HF's `*ForTokenClassification` with one label, whose head
    /// `score` (hidden -> 1, with a bias) replaces the LM head.
    pub value_head: bool,
}

use crate::error::input_error;
use anyhow::{Context, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The HF architectures tandem can load, as written in config.json's `architectures`.
pub(crate) const SUPPORTED_ARCHITECTURES: [&str; 6] = [
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2ForTokenClassification",
    "LlamaForTokenClassification",
    "Qwen3ForTokenClassification",
];

pub(crate) const CONFIG_FILE: &str = "config.json";
pub(crate) const GENERATION_CONFIG_FILE: &str = "generation_config.json";

impl Arch {
    /// The `architectures` entry of config.json.
    pub(crate) fn hf_architecture(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The `architectures` entry of a value model's config.json (a token classifier).
    pub(crate) fn hf_value_architecture(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForTokenClassification",
            Arch::Llama => "LlamaForTokenClassification",
            Arch::Qwen3 => "Qwen3ForTokenClassification",
        }
    }

    /// The `model_type` of config.json.
    pub(crate) fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// The architecture of an `architectures` entry, and whether it is a value model.
    fn from_architecture(name: &str) -> Option<(Arch, bool)> {
        [Arch::Qwen2, Arch::Llama, Arch::Qwen3]
            .into_iter()
            .find_map(|a| match name {
                n if n == a.hf_architecture() => Some((a, false)),
                n if n == a.hf_value_architecture() => Some((a, true)),
                _ => None,
            })
    }

    fn from_model_type(name: &str) -> Option<Arch> {
        [Arch::Qwen2, Arch::Llama, Arch::Qwen3]
            .into_iter()
            .find(|a| a.model_type() == name)
    }
}

/// Reads the fields of one config.json, every error naming the file and the field.
struct Fields<'a> {
    file: &'a str,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    /// The value of `key`, treating JSON null as absent (HF writes `"head_dim": null`).
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(input_error(format!(
                    "{}: field '{key}' must be a positive integer, found {v}",
                    self.file
                ))),
            },
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| input_error(format!("{}: required field '{key}' is missing", self.file)))
    }

    fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x as f32)),
                _ => Err(input_error(format!(
                    "{}: field '{key}' must be a positive number, found {v}",
                    self.file
                ))),
            },
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(input_error(format!(
                "{}: field '{key}' must be true or false, found {v}",
                self.file
            ))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(input_error(format!(
                "{}: field '{key}' must be a string, found {v}",
                self.file
            ))),
        }
    }

    /// A token id field that HF writes as an int, a list of ints, or null.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| {
            input_error(format!(
                "{}: field '{key}' must be a token id or a list of token ids, found {v}",
                self.file
            ))
        };
        let one = |v: &Value| -> Result<u32> {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad(v))
        };
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }

    /// The architecture, from `architectures` (its first entry) or else `model_type`, and
    /// whether it is a value model (a token classifier, which must have one label).
    fn arch(&self) -> Result<(Arch, bool)> {
        let file = self.file;
        let supported = SUPPORTED_ARCHITECTURES.join(", ");
        let found = match self.get("architectures") {
            Some(Value::Array(list)) if !list.is_empty() => {
                let name = match &list[0] {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                Arch::from_architecture(&name).ok_or_else(|| {
                    input_error(format!(
                        "{file}: architecture '{name}' is not supported (supported: {supported})"
                    ))
                })?
            }
            Some(v) if !v.is_array() => {
                crate::bail_input!("{file}: field 'architectures' must be a list, found {v}")
            }
            _ => match self.str_opt("model_type")? {
                Some(mt) => Arch::from_model_type(mt)
                    .map(|a| (a, false))
                    .ok_or_else(|| {
                        input_error(format!(
                            "{file}: model_type '{mt}' is not supported (supported: {supported})"
                        ))
                    })?,
                None => crate::bail_input!(
                    "{file}: neither 'architectures' nor 'model_type' is set (supported: {supported})"
                ),
            },
        };
        if found.1 {
            self.one_label()?;
        }
        Ok(found)
    }

    /// A value model's labels: `num_labels` or the size of `id2label` must be 1 (HF's default
    /// without either is 2).
    fn one_label(&self) -> Result<()> {
        let file = self.file;
        let labels = match (self.usize_opt("num_labels")?, self.get("id2label")) {
            (Some(n), _) => n,
            (None, Some(Value::Object(m))) => m.len(),
            (None, _) => 2,
        };
        if labels != 1 {
            crate::bail_input!(
                "{file}: a token-classification model is read as a value model (critic) and needs num_labels = 1, found {labels}"
            );
        }
        Ok(())
    }

    /// Features HF supports for these classes that the decoder does not implement: refuse them
    /// rather than compute something else.
    fn refuse_unsupported(&self, arch: Arch) -> Result<()> {
        let file = self.file;
        if let Some(act) = self.str_opt("hidden_act")? {
            if act != "silu" {
                crate::bail_input!("{file}: hidden_act '{act}' is not supported (only 'silu')");
            }
        }
        if self.bool_opt("use_sliding_window")? == Some(true) {
            crate::bail_input!("{file}: use_sliding_window=true is not supported");
        }
        if let Some(Value::Array(types)) = self.get("layer_types") {
            if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
                crate::bail_input!(
                    "{file}: layer_types entry {t} is not supported (only \"full_attention\")"
                );
            }
        }
        if arch != Arch::Qwen2 && self.bool_opt("attention_bias")? == Some(true) {
            crate::bail_input!(
                "{file}: attention_bias=true is not supported for {}",
                arch.hf_architecture()
            );
        }
        if self.bool_opt("mlp_bias")? == Some(true) {
            crate::bail_input!("{file}: mlp_bias=true is not supported");
        }
        Ok(())
    }

    /// `rope_theta`, when set. Transformers 5 writes rope_parameters {rope_theta, rope_type};
    /// 4.x wrote rope_theta and rope_scaling at the top level. Only plain RoPE is accepted.
    fn rope_theta(&self) -> Result<Option<f32>> {
        let file = self.file;
        let mut rope_theta = self.f32_opt("rope_theta")?;
        for key in ["rope_parameters", "rope_scaling"] {
            let Some(v) = self.get(key) else { continue };
            let Some(obj) = v.as_object() else {
                crate::bail_input!("{file}: field '{key}' must be an object, found {v}");
            };
            let sub_file = format!("{file}: {key}");
            let sub = Fields {
                file: &sub_file,
                map: obj,
            };
            let kind = sub
                .str_opt("rope_type")?
                .or(sub.str_opt("type")?)
                .unwrap_or("default");
            if kind != "default" {
                crate::bail_input!(
                    "{file}: {key} of type '{kind}' is not supported (only plain RoPE)"
                );
            }
            if let Some(theta) = sub.f32_opt("rope_theta")? {
                rope_theta = Some(theta);
            }
        }
        Ok(rope_theta)
    }

    /// `head_dim`, or the architecture's default; checked against the head counts.
    fn head_dim(
        &self,
        arch: Arch,
        hidden_size: usize,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<usize> {
        let file = self.file;
        let head_dim = match self.usize_opt("head_dim")? {
            Some(d) => d,
            // Qwen3Config's default is 128; the others derive it.
            None if arch == Arch::Qwen3 => 128,
            None => {
                if !hidden_size.is_multiple_of(num_heads) {
                    crate::bail_input!(
                        "{file}: hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads} (set head_dim)"
                    );
                }
                hidden_size / num_heads
            }
        };
        if !num_heads.is_multiple_of(num_kv_heads) {
            crate::bail_input!(
                "{file}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            );
        }
        if head_dim % 2 != 0 {
            crate::bail_input!("{file}: head_dim {head_dim} must be even for RoPE");
        }
        Ok(head_dim)
    }
}

fn read_json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| input_error(format!("{}: cannot read: {e}", path.display())))?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(input_error(format!(
            "{}: expected a JSON object",
            path.display()
        ))),
        Err(e) => Err(input_error(format!(
            "{}: invalid JSON: {e}",
            path.display()
        ))),
    }
}

/// Token ids that are unique, in first-seen order.
fn push_unique(ids: &mut Vec<u32>, more: impl IntoIterator<Item = u32>) {
    for id in more {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
}

impl Config {
    /// A 2-layer Qwen2 shape (vocabulary 256, hidden 64, tied head, q/k/v biases): the model
    /// of the sharded optimizer's checks.
    pub(crate) fn small_qwen2() -> Config {
        Config {
            arch: Arch::Qwen2,
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            qkv_bias: true,
            qk_norm: false,
            max_position_embeddings: 512,
            bos_token_id: None,
            eos_token_ids: vec![0],
            value_head: false,
        }
    }

    /// Reads `DIR/config.json` and, when present, `DIR/generation_config.json` (whose eos ids are
    /// added to [`Config::eos_token_ids`], as HF generation uses both).
    pub(crate) fn load(dir: &Path) -> Result<Config> {
        let path = dir.join(CONFIG_FILE);
        if !path.is_file() {
            crate::bail_input!(
                "{}: not found (a model directory needs config.json)",
                path.display()
            );
        }
        let mut cfg = Config::from_hf_json(&read_json_object(&path)?, &path.display().to_string())?;
        let gen_path = dir.join(GENERATION_CONFIG_FILE);
        if gen_path.is_file() {
            let map = read_json_object(&gen_path)?;
            let file = gen_path.display().to_string();
            let fields = Fields {
                file: &file,
                map: &map,
            };
            push_unique(&mut cfg.eos_token_ids, fields.token_ids("eos_token_id")?);
            if cfg.bos_token_id.is_none() {
                cfg.bos_token_id = fields.token_ids("bos_token_id")?.first().copied();
            }
            cfg.check_special_ids(&file)?;
        }
        Ok(cfg)
    }

    /// Parses the object of an HF config.json; `file` names it in error messages.
    pub(crate) fn from_hf_json(map: &Map<String, Value>, file: &str) -> Result<Config> {
        let f = Fields { file, map };
        let (arch, value_head) = f.arch()?;
        f.refuse_unsupported(arch)?;
        let rope_theta = f.rope_theta()?;
        let hidden_size = f.usize_req("hidden_size")?;
        let num_heads = f.usize_req("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = f.head_dim(arch, hidden_size, num_heads, num_kv_heads)?;
        let max_position_default = if arch == Arch::Llama { 2048 } else { 32768 };
        let mut eos_token_ids = vec![];
        push_unique(&mut eos_token_ids, f.token_ids("eos_token_id")?);
        let cfg = Config {
            arch,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_layers: f.usize_req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: rope_theta.unwrap_or(10000.0),
            rms_norm_eps: f.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2,
            qk_norm: arch == Arch::Qwen3,
            max_position_embeddings: f
                .usize_opt("max_position_embeddings")?
                .unwrap_or(max_position_default),
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids,
            value_head,
        };
        cfg.check_special_ids(file)?;
        Ok(cfg)
    }

    /// Bos and eos ids must be inside the vocabulary.
    fn check_special_ids(&self, file: &str) -> Result<()> {
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                crate::bail_input!(
                    "{file}: special token id {id} is outside the vocabulary (vocab_size {})",
                    self.vocab_size
                );
            }
        }
        Ok(())
    }

    /// The config.json object HF writes for this model (keys sorted, as `save_pretrained` does).
    /// Keys of `base` (the config.json of the model this one came from) that we do not own are
    /// kept, so a checkpoint written after training still carries e.g. `transformers_version`.
    pub(crate) fn to_hf_json(&self, base: Option<&Map<String, Value>>) -> Map<String, Value> {
        let mut m = base.cloned().unwrap_or_default();
        // Replaced by rope_theta below; keeping a stale copy would contradict it.
        m.remove("rope_parameters");
        m.remove("rope_scaling");
        m.remove("dtype");
        if !self.value_head {
            // A policy written from its critic's config (or the other way) keeps no labels.
            for k in ["num_labels", "id2label", "label2id"] {
                m.remove(k);
            }
        }
        let mut set = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        let arch = match self.value_head {
            true => self.arch.hf_value_architecture(),
            false => self.arch.hf_architecture(),
        };
        set("architectures", Value::from(vec![arch]));
        if self.value_head {
            // transformers reads the label count from id2label (num_labels is derived).
            set("num_labels", 1.into());
            set("id2label", serde_json::json!({"0": "LABEL_0"}));
            set("label2id", serde_json::json!({"LABEL_0": 0}));
        }
        set("model_type", self.arch.model_type().into());
        set("vocab_size", self.vocab_size.into());
        set("hidden_size", self.hidden_size.into());
        set("intermediate_size", self.intermediate_size.into());
        set("num_hidden_layers", self.num_layers.into());
        set("num_attention_heads", self.num_heads.into());
        set("num_key_value_heads", self.num_kv_heads.into());
        set("head_dim", self.head_dim.into());
        set("hidden_act", "silu".into());
        set(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        set("rms_norm_eps", f32_json(self.rms_norm_eps));
        set("rope_theta", f32_json(self.rope_theta));
        set("tie_word_embeddings", self.tie_word_embeddings.into());
        set("torch_dtype", "bfloat16".into());
        set("use_cache", true.into());
        set("attention_dropout", 0.0.into());
        set(
            "bos_token_id",
            self.bos_token_id.map(Value::from).unwrap_or(Value::Null),
        );
        set("eos_token_id", ids_json(&self.eos_token_ids));
        match self.arch {
            Arch::Qwen2 | Arch::Qwen3 => {
                set("use_sliding_window", false.into());
                if self.arch == Arch::Qwen3 {
                    set("attention_bias", false.into());
                }
            }
            Arch::Llama => {
                set("attention_bias", false.into());
                set("mlp_bias", false.into());
            }
        }
        m
    }

    /// The generation_config.json object: eos/bos ids over the keys of `base`.
    pub(crate) fn to_generation_json(
        &self,
        base: Option<&Map<String, Value>>,
    ) -> Map<String, Value> {
        let mut m = base.cloned().unwrap_or_default();
        if let Some(bos) = self.bos_token_id {
            m.insert("bos_token_id".into(), bos.into());
        }
        m.insert("eos_token_id".into(), ids_json(&self.eos_token_ids));
        m
    }

    /// Writes `dir/config.json` and `dir/generation_config.json` (2-space indent, sorted keys,
    /// as HF does), keeping the foreign keys of `base_dir`'s files when given.
    pub(crate) fn save(&self, dir: &Path, base_dir: Option<&Path>) -> Result<()> {
        let base = |name: &str| -> Result<Option<Map<String, Value>>> {
            match base_dir.map(|d| d.join(name)) {
                Some(p) if p.is_file() => Ok(Some(read_json_object(&p)?)),
                _ => Ok(None),
            }
        };
        let base_cfg = base(CONFIG_FILE)?;
        // A base of another architecture has nothing to give (e.g. a tokenizer-only directory);
        // a critic's base may be its policy's.
        let base_cfg = base_cfg
            .filter(|m| Config::from_hf_json(m, "").map(|c| c.arch).ok() == Some(self.arch));
        write_json(&dir.join(CONFIG_FILE), &self.to_hf_json(base_cfg.as_ref()))?;
        let base_gen = base(GENERATION_CONFIG_FILE)?;
        write_json(
            &dir.join(GENERATION_CONFIG_FILE),
            &self.to_generation_json(base_gen.as_ref()),
        )
    }
}

/// An f32 as the JSON number a person would write (1e-6, not 9.999999974752427e-7).
fn f32_json(x: f32) -> Value {
    let shortest: f64 = format!("{x}").parse().unwrap_or(x as f64);
    Value::from(shortest)
}

fn ids_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => Value::from(*one),
        many => Value::from(many.to_vec()),
    }
}

/// Writes a JSON object the way HF's `json.dumps(obj, indent=2, sort_keys=True) + "\n"` does.
pub(crate) fn write_json(path: &Path, obj: &Map<String, Value>) -> Result<()> {
    let mut text = serde_json::to_string_pretty(obj)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn qwen2_json() -> Value {
        // Qwen2.5-0.5B-Instruct's config.json (transformers 4.x form).
        json!({
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
            "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936
        })
    }

    fn err(v: Value) -> String {
        let e = Config::from_hf_json(&obj(v), "m/config.json").unwrap_err();
        assert!(crate::error::is_input_error(&e));
        e.to_string()
    }

    #[test]
    fn parses_qwen25_config() {
        let c = Config::from_hf_json(&obj(qwen2_json()), "x").unwrap();
        let want = Config {
            arch: Arch::Qwen2,
            vocab_size: 151936,
            hidden_size: 896,
            intermediate_size: 4864,
            num_layers: 24,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            qkv_bias: true,
            qk_norm: false,
            max_position_embeddings: 32768,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645],
            value_head: false,
        };
        assert_eq!(c, want);
    }

    #[test]
    fn transformers5_rope_parameters_and_defaults() {
        let c = Config::from_hf_json(
            &obj(json!({
                "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
                "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
                "head_dim": null, "eos_token_id": [3, 4, 3]
            })),
            "x",
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert_eq!(c.rope_theta, 5000.0);
        // Qwen3Config's head_dim default, kv heads default to heads, untied by default.
        assert_eq!((c.head_dim, c.num_kv_heads), (128, 4));
        assert!(!c.tie_word_embeddings && c.qk_norm && !c.qkv_bias);
        assert_eq!(c.eos_token_ids, vec![3, 4]);
        assert_eq!(c.bos_token_id, None);
        let l = Config::from_hf_json(
            &obj(json!({
                "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300
            })),
            "x",
        )
        .unwrap();
        assert_eq!(
            (l.head_dim, l.rope_theta, l.max_position_embeddings),
            (16, 10000.0, 2048)
        );
    }

    #[test]
    fn unsupported_architecture_names_file_and_supported_ones() {
        let mut v = qwen2_json();
        v["architectures"] = json!(["MistralForCausalLM"]);
        let msg = err(v);
        assert!(msg.contains("m/config.json"), "{msg}");
        assert!(
            msg.contains("'MistralForCausalLM' is not supported"),
            "{msg}"
        );
        for a in SUPPORTED_ARCHITECTURES {
            assert!(msg.contains(a), "{msg}");
        }
        let msg = err(json!({"model_type": "gemma"}));
        assert!(msg.contains("model_type 'gemma'"), "{msg}");
    }

    #[test]
    fn refuses_what_the_decoder_does_not_compute() {
        let cases = [
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0}),
                "rope_scaling of type 'llama3'",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 1e6}),
                "rope_parameters of type 'yarn'",
            ),
            ("use_sliding_window", json!(true), "use_sliding_window"),
            ("hidden_act", json!("gelu"), "hidden_act 'gelu'"),
            (
                "num_key_value_heads",
                json!(3),
                "not a multiple of num_key_value_heads 3",
            ),
            (
                "hidden_size",
                json!("896"),
                "field 'hidden_size' must be a positive integer",
            ),
            (
                "num_hidden_layers",
                json!(0),
                "field 'num_hidden_layers' must be a positive integer",
            ),
            (
                "eos_token_id",
                json!(200000),
                "special token id 200000 is outside the vocabulary",
            ),
            (
                "tie_word_embeddings",
                json!("yes"),
                "field 'tie_word_embeddings' must be true or false",
            ),
        ];
        for (key, value, want) in cases {
            let mut v = qwen2_json();
            v[key] = value;
            let msg = err(v);
            assert!(msg.starts_with("m/config.json"), "{msg}");
            assert!(msg.contains(want), "{key}: {msg}");
        }
        let mut v = qwen2_json();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(err(v).contains("required field 'vocab_size' is missing"));
        let mut v = qwen2_json();
        v["architectures"] = json!(["LlamaForCausalLM"]);
        v["attention_bias"] = json!(true);
        assert!(err(v).contains("attention_bias=true is not supported"));
    }

    #[test]
    fn hf_json_round_trip_keeps_foreign_keys() {
        let base = obj(qwen2_json());
        let c = Config::from_hf_json(&base, "x").unwrap();
        let written = c.to_hf_json(Some(&base));
        assert_eq!(Config::from_hf_json(&written, "x").unwrap(), c);
        assert_eq!(written["transformers_version"], json!("4.43.1"));
        assert_eq!(written["max_window_layers"], json!(21));
        assert_eq!(written["rms_norm_eps"], json!(1e-6));
        // Without a base the written config stands on its own.
        let bare = c.to_hf_json(None);
        assert_eq!(Config::from_hf_json(&bare, "x").unwrap(), c);
        assert_eq!(bare["architectures"], json!(["Qwen2ForCausalLM"]));
    }

    #[test]
    fn generation_config_eos_ids_are_merged() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), qwen2_json().to_string()).unwrap();
        std::fs::write(
            dir.path().join(GENERATION_CONFIG_FILE),
            r#"{"bos_token_id": 151643, "eos_token_id": [151645, 151643], "top_p": 0.8}"#,
        )
        .unwrap();
        let c = Config::load(dir.path()).unwrap();
        assert_eq!(c.eos_token_ids, vec![151645, 151643]);
        let bad = tempfile::tempdir().unwrap();
        std::fs::write(bad.path().join(CONFIG_FILE), qwen2_json().to_string()).unwrap();
        std::fs::write(
            bad.path().join(GENERATION_CONFIG_FILE),
            r#"{"eos_token_id": 151936}"#,
        )
        .unwrap();
        let e = Config::load(bad.path()).unwrap_err();
        assert!(
            e.to_string()
                .contains("generation_config.json: special token id 151936 is outside"),
            "{e}"
        );
        // Saving keeps the sampling defaults and writes both files back consistently.
        let out = tempfile::tempdir().unwrap();
        c.save(out.path(), Some(dir.path())).unwrap();
        assert_eq!(Config::load(out.path()).unwrap(), c);
        let gen: Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join(GENERATION_CONFIG_FILE)).unwrap(),
        )
        .unwrap();
        assert_eq!(gen["top_p"], json!(0.8));
        let text = std::fs::read_to_string(out.path().join(CONFIG_FILE)).unwrap();
        assert!(
            text.starts_with("{\n  \"architectures\": [\n") && text.ends_with("}\n"),
            "{text}"
        );
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = Config::load(dir.path()).unwrap_err();
        assert!(crate::error::is_input_error(&e));
        assert!(e.to_string().contains("config.json: not found"), "{e}");
        std::fs::write(dir.path().join(CONFIG_FILE), "{not json").unwrap();
        let e = Config::load(dir.path()).unwrap_err();
        assert!(e.to_string().contains("config.json: invalid JSON"), "{e}");
    }
}
