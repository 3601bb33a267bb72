//! The GGUF container (llama.cpp's model file), versions 2 and 3: header, metadata key/values,
//! tensor infos and the aligned data section. Every malformed or truncated file is an input error
//! naming the file and what was being read.

use super::quant::GgmlType;
use crate::error::input_error;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// "GGUF" read as a little-endian u32.
pub(crate) const MAGIC: u32 = 0x4655_4747;
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub(crate) const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer type that fits in u64 (GGUF writers disagree on u32 vs u64 vs i32).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(x) => Some(x as u64),
            Value::U16(x) => Some(x as u64),
            Value::U32(x) => Some(x as u64),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    pub(crate) fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(x) => Some(x as i64),
            Value::I16(x) => Some(x as i64),
            Value::I32(x) => Some(x as i64),
            Value::I64(x) => Some(x),
            _ => self.as_u64().and_then(|x| i64::try_from(x).ok()),
        }
    }

    pub(crate) fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x as f64),
            Value::F64(x) => Some(x),
            _ => self.as_i64().map(|x| x as f64),
        }
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub(crate) fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub(crate) name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension, the reverse of torch's shape.
    pub(crate) dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub(crate) offset: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The torch/HF shape (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file, its bytes in memory.
pub struct GgufFile {
    pub(crate) path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub alignment: u64,
    data_start: usize,
    bytes: Vec<u8>,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        if self.bytes.len() - self.pos < n {
            crate::bail_input!(
                "{}: truncated: {what} needs {n} bytes at offset {}, the file has {}",
                self.file,
                self.pos,
                self.bytes.len()
            );
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let raw = self.take(len, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => Err(input_error(format!(
                "{}: {what} is not valid UTF-8 ({e})",
                self.file
            ))),
        }
    }

    /// `n_kv` metadata key/values; a key may appear once.
    fn metadata(&mut self, n_kv: u64) -> Result<Vec<(String, Value)>> {
        let file = self.file;
        let mut metadata: Vec<(String, Value)> = Vec::new();
        for i in 0..n_kv {
            let key = self.string(&format!("metadata key #{i}"))?;
            let ty = self.u32(&format!("the type of metadata '{key}'"))?;
            let value = self.value(ty, &format!("metadata '{key}'"), 0)?;
            if metadata.iter().any(|(k, _)| k == &key) {
                crate::bail_input!("{file}: metadata key '{key}' appears twice");
            }
            metadata.push((key, value));
        }
        Ok(metadata)
    }

    /// `n_tensors` tensor infos; a name may appear once.
    fn tensor_infos(&mut self, n_tensors: u64) -> Result<Vec<TensorInfo>> {
        let file = self.file;
        let mut tensors: Vec<TensorInfo> = Vec::new();
        for i in 0..n_tensors {
            let name = self.string(&format!("the name of tensor #{i}"))?;
            let what = format!("tensor '{name}'");
            let n_dims = self.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                crate::bail_input!(
                    "{file}: {what} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
                );
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(self.u64(&what)?);
            }
            let type_id = self.u32(&what)?;
            let ggml_type = GgmlType::from_id(type_id)
                .map_err(|e| input_error(format!("{file}: {what}: {e}")))?;
            let offset = self.u64(&what)?;
            if tensors.iter().any(|t| t.name == name) {
                crate::bail_input!("{file}: tensor '{name}' appears twice");
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        Ok(tensors)
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => crate::bail_input!("{}: {what}: bool byte {b} is neither 0 nor 1", self.file),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth > 0 {
                    crate::bail_input!("{}: {what}: nested arrays are not supported", self.file);
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count past the end is a bad file, not
                // an allocation to attempt.
                if n > (self.bytes.len() - self.pos) as u64 {
                    crate::bail_input!(
                        "{}: truncated: {what} claims {n} array elements at offset {}, the file has {} bytes",
                        self.file,
                        self.pos,
                        self.bytes.len()
                    );
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            other => crate::bail_input!(
                "{}: {what} has value type {other}, which GGUF does not define",
                self.file
            ),
        })
    }
}

/// A tensor info against the data section of `data_len` bytes: no zero dimension, whole blocks
/// per row, aligned, and inside the section.
fn check_tensor(t: &TensorInfo, file: &str, alignment: u64, data_len: u64) -> Result<()> {
    if t.dims.contains(&0) {
        crate::bail_input!(
            "{file}: tensor '{}' has a zero dimension {:?}",
            t.name,
            t.dims
        );
    }
    let numel = t
        .dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| input_error(format!("{file}: tensor '{}' is too large", t.name)))?;
    let block = t.ggml_type.block_elems() as u64;
    if !t.dims[0].is_multiple_of(block) {
        crate::bail_input!(
            "{file}: tensor '{}' of type {} has rows of {} elements, not a multiple of its block size {block}",
            t.name,
            t.ggml_type.name(),
            t.dims[0]
        );
    }
    if !t.offset.is_multiple_of(alignment) {
        crate::bail_input!(
            "{file}: tensor '{}' starts at data offset {}, not a multiple of the alignment {alignment}",
            t.name,
            t.offset
        );
    }
    let size = numel / block * t.ggml_type.block_bytes() as u64;
    if t.offset.checked_add(size).is_none_or(|end| end > data_len) {
        crate::bail_input!(
            "{file}: truncated: tensor '{}' needs bytes {}..{} of the data section, which has {data_len}",
            t.name,
            t.offset,
            t.offset.saturating_add(size)
        );
    }
    Ok(())
}

impl GgufFile {
    /// Reads and parses a whole file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let bytes = std::fs::read(path)
            .map_err(|e| input_error(format!("{}: cannot read: {e}", path.display())))?;
        Self::parse(bytes, path)
    }

    /// Parses GGUF bytes; `path` names them in messages.
    pub fn parse(bytes: Vec<u8>, path: &Path) -> Result<GgufFile> {
        let file = path.display().to_string();
        let mut c = Cursor {
            bytes: &bytes,
            pos: 0,
            file: &file,
        };
        let magic = c.u32("the magic number")?;
        if magic != MAGIC {
            crate::bail_input!(
                "{file}: not a GGUF file (magic bytes {:02x?}, expected \"GGUF\")",
                magic.to_le_bytes()
            );
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            crate::bail_input!("{file}: GGUF version {version} is not supported (only 2 and 3)");
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        let metadata = c.metadata(n_kv)?;
        let tensors = c.tensor_infos(n_tensors)?;
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => crate::bail_input!(
                    "{file}: general.alignment must be a power of two, found {v:?}"
                ),
            },
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        for t in &tensors {
            check_tensor(t, &file, alignment, data_len)?;
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            data_start: data_start as usize,
            bytes,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The stored bytes of a tensor (bounds checked at parse time).
    pub(crate) fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let size = t.numel() as usize / t.ggml_type.block_elems() * t.ggml_type.block_bytes();
        let start = self.data_start + t.offset as usize;
        &self.bytes[start..start + size]
    }

    /// A tensor dequantized to f32, in ggml (= row-major torch) order.
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        super::quant::dequantize(t.ggml_type, self.tensor_bytes(t), t.numel() as usize)
    }
}
