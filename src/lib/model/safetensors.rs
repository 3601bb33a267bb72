//! HF safetensors files: load `model.safetensors` or the sharded `model-0000k-of-0000n.safetensors`
//! set with its `model.safetensors.index.json`; save as bf16, sharded above a size limit, with
//! the index written exactly as `save_pretrained` writes it.

use super::config::write_json;
use super::tensor::{Tensor, Weights};
use crate::error::input_error;
use anyhow::{Context, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// `save_pretrained`'s default `max_shard_size` in transformers 4.x ("5GB" = 5e9 bytes).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The weights of a model directory, with where each tensor came from.
#[derive(Debug, Default)]
pub struct Loaded {
    pub weights: Weights,
    /// The dtype each tensor had on disk.
    pub dtypes: BTreeMap<String, Dtype>,
    /// The file each tensor came from (for error messages that name it).
    pub file_of: BTreeMap<String, PathBuf>,
    /// The weight files read, in order.
    pub files: Vec<PathBuf>,
}

/// Converts one stored tensor to f32. bf16 and f16 widen exactly.
fn to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    // Elements are little-endian; chunks of 2/4 bytes need no alignment.
    match dtype {
        Dtype::F32 => Some(
            bytes
                .par_chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::BF16 => Some(
            bytes
                .par_chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::F16 => Some(
            bytes
                .par_chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// Reads every tensor of one safetensors file as f32, in the file's order.
pub fn load_file(path: &Path) -> Result<Vec<(String, Tensor, Dtype)>> {
    let bytes = std::fs::read(path)
        .map_err(|e| input_error(format!("{}: cannot read: {e}", path.display())))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        input_error(format!(
            "{}: not a valid safetensors file: {e}",
            path.display()
        ))
    })?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let dtype = view.dtype();
        let data = to_f32(view.data(), dtype).ok_or_else(|| {
            input_error(format!(
                "{}: tensor '{name}' has dtype {dtype:?}; supported: BF16, F16, F32",
                path.display()
            ))
        })?;
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            crate::bail_input!(
                "{}: tensor '{name}' has a non-finite value ({}) at flat index {i}",
                path.display(),
                data[i]
            );
        }
        out.push((
            name.to_string(),
            Tensor::new(view.shape().to_vec(), data),
            dtype,
        ));
    }
    Ok(out)
}

/// Loads `dir/model.safetensors`, or the shards that `dir/model.safetensors.index.json` lists.
pub fn load_dir(dir: &Path) -> Result<Loaded> {
    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    let mut loaded = Loaded::default();
    if single.is_file() {
        add_file(&mut loaded, &single)?;
        return Ok(loaded);
    }
    if !index.is_file() {
        crate::bail_input!(
            "{}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} with its shards",
            dir.display()
        );
    }
    let weight_map = read_index(&index)?;
    // Shards in the order of their names, each read once.
    let shards: std::collections::BTreeSet<&String> = weight_map.values().collect();
    for shard in shards {
        let path = dir.join(shard);
        if !path.is_file() {
            crate::bail_input!(
                "{}: lists shard '{shard}', which is missing from {}",
                index.display(),
                dir.display()
            );
        }
        add_file(&mut loaded, &path)?;
    }
    for (tensor, shard) in &weight_map {
        match loaded.file_of.get(tensor) {
            Some(p) if p.file_name().and_then(|n| n.to_str()) == Some(shard.as_str()) => {}
            Some(p) => crate::bail_input!(
                "{}: tensor '{tensor}' is listed in shard '{shard}' but found in {}",
                index.display(),
                p.display()
            ),
            None => crate::bail_input!(
                "{}: tensor '{tensor}' is listed in {} but that file does not contain it",
                dir.join(shard).display(),
                index.display()
            ),
        }
    }
    Ok(loaded)
}

fn add_file(loaded: &mut Loaded, path: &Path) -> Result<()> {
    for (name, tensor, dtype) in load_file(path)? {
        if let Some(first) = loaded.file_of.get(&name) {
            crate::bail_input!(
                "{}: tensor '{name}' is also in {}",
                path.display(),
                first.display()
            );
        }
        loaded.dtypes.insert(name.clone(), dtype);
        loaded.file_of.insert(name.clone(), path.to_path_buf());
        loaded.weights.insert(name, tensor);
    }
    loaded.files.push(path.to_path_buf());
    Ok(())
}

/// The `weight_map` of an index file: tensor name -> shard file name.
pub fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| input_error(format!("{}: cannot read: {e}", path.display())))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| input_error(format!("{}: invalid JSON: {e}", path.display())))?;
    let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
        crate::bail_input!("{}: field 'weight_map' is missing", path.display());
    };
    let mut out = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().filter(|f| {
            !f.is_empty() && !f.contains('/') && !f.contains('\\') && *f != ".." && *f != "."
        });
        let Some(file) = file else {
            crate::bail_input!(
                "{}: weight_map entry for '{tensor}' must be a file name in the same directory",
                path.display()
            );
        };
        out.insert(tensor.clone(), file.to_string());
    }
    Ok(out)
}

/// A tensor rounded to bf16 (round to nearest even, as torch's `.to(torch.bfloat16)`).
struct Bf16Tensor {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Bf16Tensor {
    fn new(t: &Tensor) -> Self {
        let bytes = t
            .data
            .par_iter()
            .flat_map_iter(|x| bf16::from_f32(*x).to_le_bytes())
            .collect();
        Bf16Tensor {
            shape: t.shape.clone(),
            bytes,
        }
    }
}

impl View for &Bf16Tensor {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// HF's split (huggingface_hub `split_state_dict_into_shards_factory`): walk the tensors in order,
/// start a new shard when the next one would push the current shard over the limit; a tensor
/// larger than the limit gets a shard of its own.
pub fn plan_shards(sizes: &[u64], max_shard_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards = Vec::new();
    let mut current = Vec::new();
    let mut current_size = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if size > max_shard_bytes {
            shards.push(vec![i]);
            continue;
        }
        if current_size + size > max_shard_bytes {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current.push(i);
        current_size += size;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// Writes `tensors` (in HF state-dict order) into `dir` as bf16: one `model.safetensors`, or
/// `model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json` when they do not
/// fit in `max_shard_bytes`. Returns the files written.
pub fn save_dir(
    dir: &Path,
    tensors: &[(&str, &Tensor)],
    max_shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    let sizes: Vec<u64> = tensors.iter().map(|(_, t)| 2 * t.numel() as u64).collect();
    let shards = plan_shards(&sizes, max_shard_bytes);
    let n = shards.len();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut written = Vec::new();
    let mut weight_map = Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
        };
        // Convert one shard at a time so at most one shard's bf16 copy is in memory.
        let converted: Vec<(&str, Bf16Tensor)> = shard
            .iter()
            .map(|&i| (tensors[i].0, Bf16Tensor::new(tensors[i].1)))
            .collect();
        let path = dir.join(&file);
        safetensors::serialize_to_file(
            converted.iter().map(|(name, t)| (*name, t)),
            Some(metadata.clone()),
            &path,
        )
        .with_context(|| format!("writing {}", path.display()))?;
        for (name, _) in &converted {
            weight_map.insert(name.to_string(), Value::from(file.clone()));
        }
        written.push(path);
    }
    if n > 1 {
        let total_parameters: u64 = tensors.iter().map(|(_, t)| t.numel() as u64).sum();
        let total_size: u64 = sizes.iter().sum();
        let mut meta = Map::new();
        meta.insert("total_parameters".into(), total_parameters.into());
        meta.insert("total_size".into(), total_size.into());
        let mut index = Map::new();
        index.insert("metadata".into(), Value::Object(meta));
        index.insert("weight_map".into(), Value::Object(weight_map));
        let path = dir.join(INDEX_FILE);
        write_json(&path, &index)?;
        written.push(path);
    }
    Ok(written)
}

/// `x` as it reads back after a bf16 save.
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}
