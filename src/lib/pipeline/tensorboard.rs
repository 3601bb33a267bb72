//! TensorBoard event files: every number of a run's `metrics.jsonl` and `eval.jsonl` lines also
//! goes to `RUN/events.out.tfevents.*`, so `tensorboard --logdir runs/` shows the runs. Tags
//! are the metrics keys (`update/pg_loss`, `accuracy`); eval.jsonl's go under `eval/`.
//!
//! The documented format, written by hand (no TensorFlow, no protobuf crate):
//! - a file is a sequence of TFRecords: u64 length (little-endian), u32 masked CRC32C of those
//!   8 bytes, the data, u32 masked CRC32C of the data, where mask(c) = ((c >> 15) | (c << 17)) +
//!   0xa282ead8;
//! - each record's data is an `Event` protobuf (tensorflow/core/util/event.proto): wall_time
//!   (field 1, double), step (2, int64), and file_version (3, string: "brain.Event:2", the first
//!   record of a file) or summary (5): a `Summary` of repeated `Value { tag (1, string),
//!   simple_value (2, float) }`.
//!
//! One step's line is one record, written with a single append. Each process that writes to a
//! run directory makes its own file (named so that files sort in the order they were made), so
//! a resumed run never appends after a record its killed predecessor left half-written. A step
//! that a resumed run computes again appears again, in the newer file.

use anyhow::{Context, Result};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// The first record of every event file says which format follows.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

/// Prefix of event file names (TensorBoard loads files whose name contains "tfevents").
pub(crate) const FILE_PREFIX: &str = "events.out.tfevents.";

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) table, built at compile time.
const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32C of `data` (crc32c("123456789") = 0xE3069283).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// TFRecord's masked CRC: ((c >> 15) | (c << 17)) + 0xa282ead8.
pub(crate) fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, data, the data's masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

// ---- protobuf encoding: only the wire types Event needs ----------------------------------------

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Field key: field number << 3 | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
fn key(field: u64, wire: u64, out: &mut Vec<u8>) {
    varint(field << 3 | wire, out);
}

fn bytes_field(field: u64, data: &[u8], out: &mut Vec<u8>) {
    key(field, 2, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// What an event carries besides its time and step.
pub(crate) enum Body<'a> {
    FileVersion(&'a str),
    /// (tag, simple_value) pairs of one Summary.
    Scalars(&'a [(String, f32)]),
}

/// An `Event` protobuf.
pub(crate) fn event(wall_time: f64, step: i64, body: &Body) -> Vec<u8> {
    let mut out = Vec::new();
    key(1, 1, &mut out);
    out.extend_from_slice(&wall_time.to_le_bytes());
    key(2, 0, &mut out);
    // int64 as varint: two's complement of a negative step takes 10 bytes, as protobuf says.
    varint(step as u64, &mut out);
    match body {
        Body::FileVersion(v) => bytes_field(3, v.as_bytes(), &mut out),
        Body::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, v) in values.iter() {
                let mut value = Vec::new();
                bytes_field(1, tag.as_bytes(), &mut value);
                key(2, 5, &mut value);
                value.extend_from_slice(&v.to_le_bytes());
                bytes_field(1, &value, &mut summary);
            }
            bytes_field(5, &summary, &mut out);
        }
    }
    out
}

/// The numbers of a metrics line as (tag, value), tags prefixed by `prefix`; `step`, strings,
/// booleans and nulls (non-finite numbers) are left out.
pub fn scalars(line: &Map<String, Value>, prefix: &str) -> Vec<(String, f32)> {
    line.iter()
        .filter(|(k, _)| k.as_str() != "step")
        .filter_map(|(k, v)| Some((format!("{prefix}{k}"), v.as_f64()? as f32)))
        .collect()
}

/// An event file of one process: created with its file_version record, then appended to.
pub struct EventFile {
    pub path: PathBuf,
}

impl EventFile {
    /// A new event file in `dir`, named to sort after every event file already there.
    pub fn create(dir: &Path) -> Result<EventFile> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut seq = 0u32;
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(FILE_PREFIX) && name.ends_with(".tandem") {
                seq = seq.max(
                    name.rsplit('.')
                        .nth(1)
                        .and_then(|s| s.parse::<u32>().ok())
                        .map_or(0, |s| s + 1),
                );
            }
        }
        loop {
            let path = dir.join(format!("{FILE_PREFIX}{secs:010}.{seq:06}.tandem"));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    let first = record(&event(now(), 0, &Body::FileVersion(FILE_VERSION)));
                    f.write_all(&first)
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(EventFile { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => seq += 1,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        }
    }

    /// Append one step's scalars as one record, in one write.
    pub fn append(&self, step: u64, wall_time: f64, values: &[(String, f32)]) -> Result<()> {
        let rec = record(&event(wall_time, step as i64, &Body::Scalars(values)));
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        f.write_all(&rec)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This process's event file of each run directory.
static FILES: Mutex<Option<HashMap<PathBuf, EventFile>>> = Mutex::new(None);

/// Append one line's numbers to this process's event file in `dir` (made on first use).
pub(crate) fn append_line(
    dir: &Path,
    step: u64,
    line: &Map<String, Value>,
    prefix: &str,
) -> Result<()> {
    let values = scalars(line, prefix);
    let mut files = FILES.lock().unwrap_or_else(|e| e.into_inner());
    let files = files.get_or_insert_with(HashMap::new);
    if !files.get(dir).is_some_and(|f| f.path.exists()) {
        files.insert(dir.to_path_buf(), EventFile::create(dir)?);
    }
    files[dir].append(step, now(), &values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xff
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn event_bytes_by_hand() {
        // wall_time 1.5: key 0x09 + f64 LE; step 300: key 0x10 + varint ac 02;
        // file_version: key 0x1a, length 13, the text.
        let e = event(1.5, 300, &Body::FileVersion(FILE_VERSION));
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02, 0x1a, 13]);
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(e, want);
        // summary (0x2a) { value (0x0a) { tag (0x0a) "a/b", simple_value (0x15) 0.5f32 } }
        let e = event(0.0, 1, &Body::Scalars(&[("a/b".into(), 0.5)]));
        let value = [&[0x0a, 3][..], b"a/b", &[0x15], &0.5f32.to_le_bytes()].concat();
        let summary = [&[0x0a, value.len() as u8][..], &value].concat();
        let tail = [&[0x2a, summary.len() as u8][..], &summary].concat();
        assert_eq!(&e[9..], &[&[0x10, 1][..], &tail].concat()[..]);
    }

    #[test]
    fn record_framing() {
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        // As the format documents the mask, not as the writer computes it.
        #[allow(clippy::manual_rotate)]
        let masked = |c: u32| ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8);
        assert_eq!(
            &r[8..12],
            &masked(crc32c(&3u64.to_le_bytes())).to_le_bytes()
        );
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(&r[15..], &masked(crc32c(b"abc")).to_le_bytes());
    }

    #[test]
    fn scalars_keep_numbers_only() {
        let line: Map<String, Value> = serde_json::from_str(
            r#"{"step": 3, "accuracy": 0.5, "update/lr": 1e-5, "score/x": "s", "kl": null, "b": true}"#,
        )
        .unwrap();
        let mut got = scalars(&line, "eval/");
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got,
            [
                ("eval/accuracy".into(), 0.5),
                ("eval/update/lr".into(), 1e-5)
            ]
        );
    }
}
