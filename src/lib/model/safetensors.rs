//! HF safetensors files: load `model.safetensors` or the sharded `model-0000k-of-0000n.safetensors`
//! set with its `model.safetensors.index.json`; save as bf16, sharded above a size limit, with
//! the index written exactly as `save_pretrained` writes it.

use super::config::write_json;
use super::tensor::{Tensor, Weights};
use crate::error::input_error;
use anyhow::{Context, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, View};
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub(crate) const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// `save_pretrained`'s default `max_shard_size` in transformers 4.x ("5GB" = 5e9 bytes).
pub(crate) const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The weights of a model directory, with where each tensor came from.
#[derive(Debug, Default)]
pub struct Loaded {
    pub weights: Weights,
    /// The dtype each tensor had on disk.
    pub dtypes: BTreeMap<String, Dtype>,
    /// The file each tensor came from (for error messages that name it).
    pub(crate) file_of: BTreeMap<String, PathBuf>,
    /// The weight files read, in order.
    pub(crate) files: Vec<PathBuf>,
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
pub(crate) fn load_file(path: &Path) -> Result<Vec<(String, Tensor, Dtype)>> {
    Ok(load_file_with_meta(path)?.0)
}

/// [`load_file`] with the header's `__metadata__` (empty when there is none).
pub(crate) fn load_file_with_meta(path: &Path) -> Result<FileTensors> {
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
    let meta = SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, m)| m.metadata().clone())
        .unwrap_or_default();
    Ok((out, meta))
}

/// A file's tensors (name, f32 data, stored dtype) and its metadata.
pub(crate) type FileTensors = (Vec<(String, Tensor, Dtype)>, HashMap<String, String>);

/// One safetensors file opened for reading parts of its tensors: only the header is read at
/// open; [`PartialFile::read_f32`] reads a range of one tensor's elements (a rank resuming
/// from another layout's optimizer shards needs about 1/N of each file).
pub(crate) struct PartialFile {
    path: PathBuf,
    file: std::fs::File,
    /// Where the data starts: after the 8-byte length and the header.
    data_start: u64,
    /// Each tensor's dtype, shape and byte range in the data.
    tensors: HashMap<String, TensorInfo>,
    pub(crate) meta: HashMap<String, String>,
}

impl PartialFile {
    pub(crate) fn open(path: &Path) -> Result<PartialFile> {
        use std::io::Read;
        let cannot =
            |e: std::io::Error| input_error(format!("{}: cannot read: {e}", path.display()));
        let mut file = std::fs::File::open(path).map_err(cannot)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(cannot)?;
        let n = u64::from_le_bytes(len);
        let size = file.metadata().map_err(cannot)?.len();
        if n > size.saturating_sub(8) || n > 100 << 20 {
            crate::bail_input!(
                "{}: not a valid safetensors file: a header of {n} bytes in a file of {size}",
                path.display()
            );
        }
        let mut head = len.to_vec();
        head.resize(8 + n as usize, 0);
        file.read_exact(&mut head[8..]).map_err(cannot)?;
        // The header alone (SafeTensors::read_metadata wants the whole file); each tensor's
        // byte range is checked against its shape and the file's size here.
        let m: Metadata = serde_json::from_slice(&head[8..]).map_err(|e| {
            input_error(format!(
                "{}: not a valid safetensors file: {e}",
                path.display()
            ))
        })?;
        let data_len = size - 8 - n;
        let mut tensors = HashMap::new();
        for (name, info) in m.tensors() {
            let (a, b) = info.data_offsets;
            let bytes = info
                .shape
                .iter()
                .try_fold(info.dtype.bitsize(), |x, &d| x.checked_mul(d))
                .map(|bits| bits / 8);
            if a > b || b as u64 > data_len || bytes != Some(b - a) {
                crate::bail_input!(
                    "{}: not a valid safetensors file: tensor '{name}' has bytes [{a}, {b}) of {data_len} for shape {:?} of {:?}",
                    path.display(),
                    info.shape,
                    info.dtype
                );
            }
            tensors.insert(name, info.clone());
        }
        Ok(PartialFile {
            path: path.to_path_buf(),
            file,
            data_start: 8 + n,
            tensors,
            meta: m.metadata().clone().unwrap_or_default(),
        })
    }

    /// The tensors' names, dtypes and shapes.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&str, Dtype, &[usize])> {
        self.tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice()))
    }

    /// Elements [start, start + len) of f32 tensor `name`, checked finite.
    pub(crate) fn read_f32(&mut self, name: &str, start: usize, len: usize) -> Result<Vec<f32>> {
        use std::io::{Read, Seek, SeekFrom};
        let path = self.path.display();
        let Some(t) = self.tensors.get(name) else {
            crate::bail_input!("{path}: has no tensor '{name}'");
        };
        let (a, b) = t.data_offsets;
        if t.dtype != Dtype::F32 || start + len > (b - a) / 4 {
            crate::bail_input!(
                "{path}: tensor '{name}' is not an f32 tensor of at least {} elements",
                start + len
            );
        }
        let at = self.data_start + (a + 4 * start) as u64;
        let mut bytes = vec![0u8; 4 * len];
        self.file
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|e| input_error(format!("{path}: cannot read: {e}")))?;
        let data = to_f32(&bytes, Dtype::F32).expect("f32");
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            crate::bail_input!(
                "{path}: tensor '{name}' has a non-finite value ({}) at flat index {}",
                data[i],
                start + i
            );
        }
        Ok(data)
    }
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
        let hint = if dir.join("pytorch_model.bin").exists()
            || dir.join("pytorch_model.bin.index.json").exists()
        {
            " (pytorch_model.bin is not read: convert it to safetensors, e.g. by loading and \
             saving it with transformers' save_pretrained)"
        } else {
            ""
        };
        crate::bail_input!(
            "{}: no weights: expected {SINGLE_FILE} or {INDEX_FILE} with its shards{hint}",
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
        let mut bytes = vec![0u8; 2 * t.numel()];
        bytes
            .par_chunks_mut(2)
            .zip(t.data.par_iter())
            .for_each(|(out, x)| out.copy_from_slice(&bf16::from_f32(*x).to_le_bytes()));
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
pub(crate) fn plan_shards(sizes: &[u64], max_shard_bytes: u64) -> Vec<Vec<usize>> {
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

/// Writes `tensors` as one safetensors file at `path` (its directory made if missing), streamed
/// from their buffers: no copy of the whole file is made in memory (a 7B shape's optimizer
/// state is 91 GB). The crate writes a temporary file and renames it into place, so `path` is
/// either whole or untouched; the file gets the permissions a plainly created one does (umask),
/// as HF's files have, not the temporary file's 0600.
pub fn write_file<S, V, I>(
    path: &Path,
    tensors: I,
    metadata: Option<HashMap<String, String>>,
) -> Result<()>
where
    S: AsRef<str> + Ord + std::fmt::Display,
    V: View,
    I: IntoIterator<Item = (S, V)>,
{
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // A probe beside it learns the umask's permissions without touching `path` itself.
    let mut probe = path.as_os_str().to_owned();
    probe.push(".perms");
    let probe = PathBuf::from(probe);
    let perms = std::fs::File::create(&probe)
        .and_then(|f| f.metadata())
        .with_context(|| format!("creating {}", probe.display()))?
        .permissions();
    let _ = std::fs::remove_file(&probe);
    safetensors::serialize_to_file(tensors, metadata, path)
        .with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(path, perms)
        .with_context(|| format!("setting permissions of {}", path.display()))
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
        write_file(
            &path,
            converted.iter().map(|(name, t)| (*name, t)),
            Some(metadata.clone()),
        )?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::is_input_error;

    /// A raw safetensors file written with the crate directly (any dtype, as other tools do).
    struct Raw(Dtype, Vec<usize>, Vec<u8>);
    impl View for &Raw {
        fn dtype(&self) -> Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }

    fn write_raw(path: &Path, tensors: &[(&str, Raw)]) {
        safetensors::serialize_to_file(tensors.iter().map(|(n, r)| (*n, r)), None, path).unwrap();
    }

    #[test]
    fn reads_f32_f16_bf16_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let vals = [1.5f32, -0.25, 3.0e-3, 65504.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect();
        let bf16b: Vec<u8> = vals
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect();
        let path = dir.path().join("model.safetensors");
        write_raw(
            &path,
            &[
                ("a", Raw(Dtype::F32, vec![2, 2], f32b)),
                ("b", Raw(Dtype::F16, vec![4], f16b)),
                ("c", Raw(Dtype::BF16, vec![4, 1], bf16b)),
            ],
        );
        let l = load_dir(dir.path()).unwrap();
        assert_eq!(l.weights["a"], Tensor::new(vec![2, 2], vals.to_vec()));
        let f16_vals: Vec<f32> = vals.iter().map(|x| f16::from_f32(*x).to_f32()).collect();
        assert_eq!(l.weights["b"].data, f16_vals);
        let bf_vals: Vec<f32> = vals.iter().map(|x| round_bf16(*x)).collect();
        assert_eq!(l.weights["c"].data, bf_vals);
        assert_eq!(l.weights["c"].shape, vec![4, 1]);
        assert_eq!(l.dtypes["b"], Dtype::F16);
    }

    #[test]
    fn rejects_other_dtypes_and_non_finite_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write_raw(&path, &[("ids", Raw(Dtype::I64, vec![1], vec![0; 8]))]);
        let e = load_dir(dir.path()).unwrap_err();
        assert!(is_input_error(&e));
        assert!(e.to_string().contains("tensor 'ids' has dtype I64"), "{e}");
        let nan: Vec<u8> = [1.0f32, f32::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        write_raw(&path, &[("w", Raw(Dtype::F32, vec![2], nan))]);
        let e = load_dir(dir.path()).unwrap_err();
        assert!(
            e.to_string()
                .contains("tensor 'w' has a non-finite value (NaN) at flat index 1"),
            "{e}"
        );
        std::fs::write(&path, b"garbage").unwrap();
        let e = load_dir(dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("not a valid safetensors file"),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();
        let e = load_dir(dir.path()).unwrap_err();
        assert!(
            e.to_string()
                .contains("no weights: expected model.safetensors"),
            "{e}"
        );
    }

    #[test]
    fn plan_follows_huggingface_hub() {
        // The hub's docstring example: [6, 6, 2, 6, 2, 2] with limit 10 -> [6], [6+2], [6+2+2].
        assert_eq!(
            plan_shards(&[6, 6, 2, 6, 2, 2], 10),
            vec![vec![0], vec![1, 2], vec![3, 4, 5]]
        );
        // Oversized tensors get their own shard without closing the current one.
        assert_eq!(
            plan_shards(&[3, 12, 3, 5], 10),
            vec![vec![1], vec![0, 2], vec![3]]
        );
        assert_eq!(plan_shards(&[1, 2, 3], 100), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn sharded_save_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mk =
            |n: usize, s: f32| Tensor::new(vec![n], (0..n).map(|i| s * i as f32 + 0.1).collect());
        let ts = [
            ("x.w", mk(10, 1.0)),
            ("y.w", mk(30, -0.5)),
            ("z.w", mk(20, 0.25)),
        ];
        let refs: Vec<(&str, &Tensor)> = ts.iter().map(|(n, t)| (*n, t)).collect();
        // 20, 60, 40 bytes in bf16 with a 70-byte limit -> [x], [y], [z].
        let files = save_dir(dir.path(), &refs, 70).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                INDEX_FILE
            ]
        );
        let index = std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap();
        let want = "{\n  \"metadata\": {\n    \"total_parameters\": 60,\n    \"total_size\": 120\n  },\n  \"weight_map\": {\n    \"x.w\": \"model-00001-of-00003.safetensors\",\n    \"y.w\": \"model-00002-of-00003.safetensors\",\n    \"z.w\": \"model-00003-of-00003.safetensors\"\n  }\n}\n";
        assert_eq!(index, want);
        let l = load_dir(dir.path()).unwrap();
        for (n, t) in &ts {
            let rounded: Vec<f32> = t.data.iter().map(|x| round_bf16(*x)).collect();
            assert_eq!(l.weights[*n].data, rounded);
            assert_eq!(l.dtypes[*n], Dtype::BF16);
        }
        // A shard the index names but that is gone, or a tensor listed but absent.
        std::fs::remove_file(dir.path().join("model-00002-of-00003.safetensors")).unwrap();
        let e = load_dir(dir.path()).unwrap_err();
        assert!(is_input_error(&e));
        assert!(
            e.to_string()
                .contains("lists shard 'model-00002-of-00003.safetensors', which is missing"),
            "{e}"
        );
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map": {"x.w": "model-00001-of-00003.safetensors", "q.w": "model-00001-of-00003.safetensors"}}"#,
        )
        .unwrap();
        let e = load_dir(dir.path()).unwrap_err();
        assert!(e.to_string().contains("tensor 'q.w' is listed in"), "{e}");
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map": {"x.w": "../x"}}"#,
        )
        .unwrap();
        let e = load_dir(dir.path()).unwrap_err();
        assert!(
            e.to_string()
                .contains("must be a file name in the same directory"),
            "{e}"
        );
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(-2.5), -2.5);
    }
}
