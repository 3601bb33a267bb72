//! TensorBoard event files, read back with a decoder written here from the format's
//! documentation (TFRecord framing, masked CRC-32C, the `Event`/`Summary` protobufs), not with
//! the writer's code: tags, steps and values of written events, and a short real pipeline run
//! (the demo, shortened, then extended after a torn write) whose event files hold every number
//! of its metrics.jsonl and eval.jsonl.

use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tandem::pipeline::metrics::put_line;
use tandem::pipeline::tensorboard::EventFile;

/// CRC-32C bit by bit (the writer uses a table).
fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// The mask as the format documents it.
#[allow(clippy::manual_rotate)]
fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8)
}

#[derive(Debug, Default, PartialEq)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    values: Vec<(String, f32)>,
}

/// Protobuf fields of a message: (field number, wire type, payload bytes or varint value).
fn fields(mut b: &[u8]) -> Vec<(u64, u8, Vec<u8>, u64)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= ((byte & 0x7f) as u64) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = vec![];
    while !b.is_empty() {
        let k = varint(&mut b);
        let (field, wire) = (k >> 3, (k & 7) as u8);
        let n = match wire {
            0 => {
                let v = varint(&mut b);
                out.push((field, wire, vec![], v));
                continue;
            }
            1 => 8,
            5 => 4,
            2 => varint(&mut b) as usize,
            w => panic!("wire type {w}"),
        };
        out.push((field, wire, b[..n].to_vec(), 0));
        b = &b[n..];
    }
    out
}

fn decode_event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (field, wire, bytes, v) in fields(data) {
        match (field, wire) {
            (1, 1) => e.wall_time = f64::from_le_bytes(bytes.try_into().unwrap()),
            (2, 0) => e.step = v as i64,
            (3, 2) => e.file_version = Some(String::from_utf8(bytes).unwrap()),
            (5, 2) => {
                for (f, w, value, _) in fields(&bytes) {
                    assert_eq!((f, w), (1, 2), "Summary.value");
                    let (mut tag, mut x) = (None, None);
                    for (f, w, b, _) in fields(&value) {
                        match (f, w) {
                            (1, 2) => tag = Some(String::from_utf8(b).unwrap()),
                            (2, 5) => x = Some(f32::from_le_bytes(b.try_into().unwrap())),
                            other => panic!("unexpected Summary.Value field {other:?}"),
                        }
                    }
                    e.values.push((tag.unwrap(), x.unwrap()));
                }
            }
            other => panic!("unexpected Event field {other:?}"),
        }
    }
    e
}

/// The complete records of an event file (every CRC checked) and the length of an incomplete
/// tail (a record cut short by a kill).
fn read_events(path: &Path) -> (Vec<Event>, usize) {
    let b = std::fs::read(path).unwrap();
    let mut pos = 0;
    let mut out = vec![];
    while pos < b.len() {
        if b.len() - pos < 12 {
            break;
        }
        let len_bytes = &b[pos..pos + 8];
        let crc = u32::from_le_bytes(b[pos + 8..pos + 12].try_into().unwrap());
        assert_eq!(
            crc,
            masked(len_bytes),
            "{}: length CRC at {pos}",
            path.display()
        );
        let n = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        if b.len() - pos - 12 < n + 4 {
            break;
        }
        let data = &b[pos + 12..pos + 12 + n];
        let crc = u32::from_le_bytes(b[pos + 12 + n..pos + 16 + n].try_into().unwrap());
        assert_eq!(crc, masked(data), "{}: data CRC at {pos}", path.display());
        out.push(decode_event(data));
        pos += 16 + n;
    }
    (out, b.len() - pos)
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .contains("tfevents")
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_test_decoder_crc_matches_the_known_vector() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
}

#[test]
fn written_events_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let f = EventFile::create(dir.path()).unwrap();
    let steps: Vec<(u64, Vec<(String, f32)>)> = vec![
        (
            1,
            vec![("update/pg_loss".into(), -0.25), ("accuracy".into(), 0.5)],
        ),
        (
            2,
            vec![("update/pg_loss".into(), 1e-7), ("accuracy".into(), 0.75)],
        ),
        (300, vec![("time/step".into(), 12345.678)]),
    ];
    for (s, v) in &steps {
        f.append(*s, 1_700_000_000.5 + *s as f64, v).unwrap();
    }
    let files = event_files(dir.path());
    assert_eq!(files, std::slice::from_ref(&f.path));
    let (events, tail) = read_events(&files[0]);
    assert_eq!(tail, 0);
    assert_eq!(events.len(), 4);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].values.is_empty());
    for (e, (s, v)) in events[1..].iter().zip(&steps) {
        assert_eq!(e.step, *s as i64);
        assert_eq!(e.wall_time, 1_700_000_000.5 + *s as f64);
        assert_eq!(e.file_version, None);
        assert_eq!(&e.values, v);
    }
    // A second writer (a resumed run) gets its own file, sorted after the first.
    let g = EventFile::create(dir.path()).unwrap();
    assert_eq!(event_files(dir.path()), [f.path.clone(), g.path.clone()]);
}

#[test]
fn metrics_and_eval_lines_go_to_one_file_per_process() {
    let dir = tempfile::tempdir().unwrap();
    let line = |v: Value| v;
    let m = dir.path().join("metrics.jsonl");
    let e = dir.path().join("eval.jsonl");
    put_line(
        &e,
        0,
        &line(serde_json::json!({"step": 0, "accuracy": 0.125, "rows": 8})),
    )
    .unwrap();
    put_line(
        &m,
        1,
        &line(serde_json::json!({"step": 1, "reward/mean": 0.5, "stage": "x"})),
    )
    .unwrap();
    put_line(
        &m,
        2,
        &line(serde_json::json!({"step": 2, "reward/mean": 0.625, "kl": null})),
    )
    .unwrap();
    let files = event_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let (events, _) = read_events(&files[0]);
    let got: Vec<(i64, Vec<(String, f32)>)> = events[1..]
        .iter()
        .map(|e| (e.step, e.values.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                0,
                vec![("eval/accuracy".into(), 0.125), ("eval/rows".into(), 8.0)]
            ),
            (1, vec![("reward/mean".into(), 0.5)]),
            (2, vec![("reward/mean".into(), 0.625)]),
        ]
    );
}

/// Every number of every line of `jsonl` is an event of that step and tag in `events`.
fn assert_all_scalars(
    jsonl: &Path,
    prefix: &str,
    events: &BTreeMap<(i64, String), Vec<f32>>,
    at_least: usize,
) {
    let text = std::fs::read_to_string(jsonl).unwrap();
    let mut n = 0;
    for l in text.lines() {
        let m: Map<String, Value> = serde_json::from_str(l).unwrap();
        let step = m["step"].as_i64().unwrap();
        for (k, v) in &m {
            let Some(x) = v.as_f64().filter(|_| k != "step") else {
                continue;
            };
            let tag = format!("{prefix}{k}");
            let got = events.get(&(step, tag.clone()));
            assert!(
                got.is_some_and(|g| g.contains(&(x as f32))),
                "{}: step {step} {tag} = {x}: events have {got:?}",
                jsonl.display()
            );
            n += 1;
        }
    }
    assert!(n >= at_least, "{}: only {n} scalars", jsonl.display());
}

#[test]
fn a_short_pipeline_run_has_every_scalar_in_its_event_files() {
    let bin = Path::new(env!("CARGO_BIN_EXE_pipeline")).parent().unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(work.path())
        .args(["--steps", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "demo failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = work.path().join("run");
    let first = event_files(&run);
    assert_eq!(first.len(), 1, "{first:?}");
    // A killed writer's half record at the end of its file...
    let mut bytes = std::fs::read(&first[0]).unwrap();
    let whole = bytes.len();
    bytes.extend_from_slice(&[40, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
    std::fs::write(&first[0], &bytes).unwrap();
    // ...and the run extended by a new runner process.
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.toml");
    let out = Command::new(bin.join("pipeline"))
        .args([
            "run",
            spec.to_str().unwrap(),
            "--run-dir",
            "run",
            "--steps",
            "3",
        ])
        .current_dir(work.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "extend failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = event_files(&run);
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(files[0], first[0]);
    let mut events: BTreeMap<(i64, String), Vec<f32>> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        let (ev, tail) = read_events(f);
        // The first file reads up to its torn tail; the new file is whole.
        assert_eq!(tail, if i == 0 { bytes.len() - whole } else { 0 });
        assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
        for e in &ev[1..] {
            assert!(e.wall_time > 1.6e9, "{e:?}");
            for (tag, x) in &e.values {
                events.entry((e.step, tag.clone())).or_default().push(*x);
            }
        }
    }
    // Steps 1-2 in the first file, step 3 in the second.
    let steps_of = |f: &Path| {
        let mut s: Vec<i64> = read_events(f).0[1..].iter().map(|e| e.step).collect();
        s.dedup();
        s
    };
    assert_eq!(steps_of(&files[0]), [0, 1, 2]);
    assert_eq!(steps_of(&files[1]), [3]);
    assert_all_scalars(&run.join("metrics.jsonl"), "", &events, 3 * 40);
    assert_all_scalars(&run.join("eval.jsonl"), "eval/", &events, 4);
    for tag in ["update/pg_loss", "reward/mean", "accuracy", "time/step"] {
        for step in 1..=3 {
            assert!(
                events.contains_key(&(step, tag.to_string())),
                "{tag} @ {step}"
            );
        }
    }
    assert!(events.contains_key(&(0, "eval/accuracy".to_string())));
}
