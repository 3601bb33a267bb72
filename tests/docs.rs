//! Docs that run: the shell blocks of README.md, docs/BATCH.md, docs/PIPELINE.md,
//! docs/DAEMON.md and docs/SERVING.md (curl over loopback) marked with the line `<!-- runs in tests/docs.rs -->` just above their ```sh
//! fence run here, as written, on the test's binaries and a tiny model, with no network.
//!
//! Each document gets a fresh temporary directory, as a reader's checkout would be: the blocks
//! run there one after the other (`bash -euo pipefail`), so a later block may use what an
//! earlier one made. `target/release/` holds links to the binaries cargo built for this test
//! and `pipelines/` is the repository's, so `B=target/release`, `$B/rollout` and
//! `pipelines/demo.sh` work as typed. Blocks that are not run (they need duckdb, pandas, make,
//! a GPU or a download) may only read files that the run blocks made: every `*.parquet`,
//! `*.json`, `*.jsonl` or `*.png` path they name must exist afterwards, so an example command
//! cannot point at a path the runner does not write.

use std::path::{Path, PathBuf};
use std::process::Command;

const MARK: &str = "<!-- runs in tests/docs.rs -->";

/// The binaries the docs call, as `target/release/NAME`.
const BINARIES: [(&str, &str); 8] = [
    ("tandem", env!("CARGO_BIN_EXE_tandem")),
    ("pipeline", env!("CARGO_BIN_EXE_pipeline")),
    ("rollout", env!("CARGO_BIN_EXE_rollout")),
    ("score", env!("CARGO_BIN_EXE_score")),
    ("ref-logprob", env!("CARGO_BIN_EXE_ref-logprob")),
    ("advantage", env!("CARGO_BIN_EXE_advantage")),
    ("update", env!("CARGO_BIN_EXE_update")),
    ("sync-weights", env!("CARGO_BIN_EXE_sync-weights")),
];

/// One fenced shell block: where it starts (1-based line of the fence), whether it is marked
/// to run, and its text.
#[derive(Debug)]
struct Block {
    line: usize,
    runs: bool,
    text: String,
}

/// The ```sh blocks of a markdown text.
fn shell_blocks(markdown: &str) -> Vec<Block> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim_start();
        if fence == "```sh" || fence == "```bash" {
            let runs = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .is_some_and(|l| l.trim() == MARK);
            let start = i;
            let mut text = String::new();
            i += 1;
            while i < lines.len() && lines[i].trim_start() != "```" {
                text.push_str(lines[i]);
                text.push('\n');
                i += 1;
            }
            out.push(Block {
                line: start + 1,
                runs,
                text,
            });
        }
        i += 1;
    }
    out
}

/// Relative paths of data files a command line names (`'runs/x/scored.parquet'`, `adv.json`),
/// not Python modules (`import pyarrow.parquet`).
fn file_paths(text: &str) -> Vec<String> {
    let exts = [".parquet", ".json", ".jsonl", ".png"];
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "._/-".contains(c);
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(found) = text[at..].find(is_path_char) {
        let start = at + found;
        let len = text[start..]
            .find(|c| !is_path_char(c))
            .unwrap_or(text.len() - start);
        let word = &text[start..start + len];
        let before = &text[..start];
        let module = before.ends_with("import ") || before.ends_with("from ");
        if exts.iter().any(|e| word.ends_with(e)) && !word.starts_with('/') && !module {
            out.push(word.to_string());
        }
        at = start + len;
    }
    out
}

/// A reader's checkout: the binaries under target/release and the repository's pipelines/.
fn checkout() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("target/release");
    std::fs::create_dir_all(&bin).unwrap();
    for (name, path) in BINARIES {
        std::os::unix::fs::symlink(path, bin.join(name)).unwrap();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::os::unix::fs::symlink(repo.join("pipelines"), dir.path().join("pipelines")).unwrap();
    dir
}

/// Runs the marked blocks of `doc` (relative to the repository) and checks the paths the
/// other blocks name. Returns the checkout, for checks of what the blocks made.
fn run_doc(doc: &str, at_least: usize) -> tempfile::TempDir {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(repo.join(doc)).unwrap();
    let blocks = shell_blocks(&text);
    let run: Vec<&Block> = blocks.iter().filter(|b| b.runs).collect();
    assert!(
        run.len() >= at_least,
        "{doc}: {} blocks marked `{MARK}`, expected at least {at_least}",
        run.len()
    );
    let dir = checkout();
    for b in &run {
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &b.text])
            .current_dir(dir.path())
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{doc}:{}: the block failed ({:?}):\n{}\n--- stdout:\n{}\n--- stderr:\n{}",
            b.line,
            out.status,
            b.text,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for b in blocks.iter().filter(|b| !b.runs) {
        for path in file_paths(&b.text) {
            assert!(
                dir.path().join(&path).exists(),
                "{doc}:{}: names {path}, which the document's runnable blocks do not make:\n{}",
                b.line,
                b.text
            );
        }
    }
    dir
}

fn exists(dir: &Path, paths: &[&str]) {
    for p in paths {
        let full: PathBuf = dir.join(p);
        assert!(full.exists(), "{} was not made", full.display());
    }
}

#[test]
fn blocks_and_paths_are_found() {
    let md = "text\n<!-- runs in tests/docs.rs -->\n```sh\na b\n```\n\n```sh\nduckdb -c \"from 'x/y.parquet'\"\npython -c \"import pyarrow.parquet; pd.read_parquet('adv.parquet')\" > out.json\n```\n```\nnot sh\n```\n";
    let blocks = shell_blocks(md);
    assert_eq!(blocks.len(), 2);
    assert!(blocks[0].runs && !blocks[1].runs);
    assert_eq!((blocks[0].line, blocks[0].text.as_str()), (3, "a b\n"));
    assert_eq!(
        file_paths(&blocks[1].text),
        ["x/y.parquet", "adv.parquet", "out.json"]
    );
}

/// A model directory's bf16 weights, tensor by tensor.
fn weights(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.data().to_vec()))
        .collect();
    out.sort();
    out
}

#[test]
fn readme_blocks_run() {
    let dir = run_doc("README.md", 1);
    // "Stages by hand" works in its scratch directory and leaves nothing at the top.
    let hand = dir.path().join("runs/by-hand");
    exists(
        &hand,
        &[
            "rollout.parquet",
            "scored.parquet",
            "adv.parquet",
            "m1/tokenizer.json",
            "policy",
        ],
    );
    let top: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !["target", "pipelines", "runs"].contains(&n.as_str()))
        .collect();
    assert!(
        top.is_empty(),
        "the README's blocks left {top:?} at the top"
    );
    // Its update learns something: rewards that differ within a group, a gradient, new weights.
    let json = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(hand.join(f)).unwrap()).unwrap()
    };
    let grad_norm = json("update.json")["grad_norm"].as_f64().unwrap();
    assert!(grad_norm > 0.0, "grad norm {grad_norm}");
    let (m0, m1) = (weights(&hand.join("m0")), weights(&hand.join("m1")));
    assert_eq!(m0.len(), m1.len());
    let changed = m0.iter().zip(&m1).filter(|(a, b)| a.1 != b.1).count();
    assert!(changed > 0, "no tensor of m1 differs from m0's");
}

#[test]
fn batch_md_blocks_run() {
    let dir = run_doc("docs/BATCH.md", 1);
    exists(dir.path(), &["runs/demo/run/step-0003/adv.parquet"]);
}

#[test]
fn pipeline_md_blocks_run() {
    let dir = run_doc("docs/PIPELINE.md", 1);
    exists(
        dir.path(),
        &["runs/tiny/metrics.jsonl", "runs/tiny/commands.sh"],
    );
    // As the page says: without `lr-schedule` in the spec the learning rate stays at `lr`.
    let metrics = std::fs::read_to_string(dir.path().join("runs/tiny/metrics.jsonl")).unwrap();
    let lrs: Vec<f64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["update/lr"].as_f64().expect("update/lr in metrics.jsonl")
        })
        .collect();
    assert_eq!(lrs, [0.001, 0.001]);
}

#[test]
fn serving_md_blocks_run() {
    // A server, two trajectories with rewards, a collect, and the batch through update.
    let dir = run_doc("docs/SERVING.md", 1);
    let work = dir.path().join("runs/serve-by-hand");
    exists(
        &work,
        &[
            "turn-0.json",
            "collected/step-0.parquet",
            "next/model.safetensors",
        ],
    );
    let turn: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("turn-0.json")).unwrap()).unwrap();
    assert!(turn["choices"][0]["token_ids"].is_array(), "{turn}");
    assert!(turn["prompt_token_ids"].is_array(), "{turn}");
}

#[test]
fn daemon_md_blocks_run() {
    // The first example: a daemon, every model stage as its client, save and shutdown.
    let dir = run_doc("docs/DAEMON.md", 1);
    let work = dir.path().join("runs/daemon-by-hand");
    let ckpt = work.join("run/ckpt/step-1");
    exists(
        &ckpt,
        &[
            "model.safetensors",
            "optimizer.safetensors",
            "trainer_state.json",
        ],
    );
    assert!(!ckpt.join("resident.json").exists(), "save wrote the files");
    assert!(!work.join("run/daemon.sock").exists(), "the daemon stopped");
}

/// The `bench/NAME.sh|py` paths a text names (not `src/lib/bench/…`).
fn bench_scripts(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("bench/") {
        let before = text[..i].chars().last();
        if before.is_some_and(|c| c == '/' || c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || "_./-".contains(*c))
            .collect();
        let name = name.trim_end_matches('.');
        if name.ends_with(".sh") || name.ends_with(".py") {
            out.push(name.to_string());
        }
    }
    out
}

/// The docs name only device scripts that exist: every `bench/….sh|py` path in README.md and
/// docs/*.md is a file of the tree.
#[test]
fn the_docs_name_only_bench_scripts_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md"), root.join("bench/README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            docs.push(p);
        }
    }
    let mut missing = Vec::new();
    for doc in &docs {
        for name in bench_scripts(&std::fs::read_to_string(doc).unwrap()) {
            if !root.join(&name).is_file() {
                missing.push(format!("{}: {name}", doc.display()));
            }
        }
    }
    assert!(docs.len() > 5);
    assert!(missing.is_empty(), "{}", missing.join("\n"));
    let got = bench_scripts("run `bench/gpu_bench.sh`, src/lib/bench/rollout.rs, bench/x.py.");
    assert_eq!(got, ["bench/gpu_bench.sh", "bench/x.py"]);
}

/// `bench/gsm8k_run.sh STEP=report` titles the report with the spec the run started with
/// (recorded by STEP=run in the run directory), not the default of the call, and with the model
/// that spec names (one wait call reports runs of both models).
#[test]
fn gsm8k_report_names_the_spec_that_ran() {
    for (spec, model) in [
        ("pipelines/my-spec.toml", "0.5B"),
        ("pipelines/gsm8k-qwen2.5-coder-1.5b-tools-cuda.toml", "1.5B"),
    ] {
        let first = gsm8k_report_title(spec);
        assert_eq!(
            first,
            format!("# GSM8K, Qwen2.5-Coder-{model}-Instruct: {spec}, 1 steps")
        );
    }
}

/// The first line of `STEP=report` for a one-step run that started with `spec`.
fn gsm8k_report_title(spec: &str) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let t = tempfile::tempdir().unwrap();
    let (r, out) = (t.path().join("r"), t.path().join("out"));
    std::fs::create_dir_all(r.join("runs/x")).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(r.join("runs/x/spec-source.txt"), format!("{spec}\n")).unwrap();
    std::fs::write(
        r.join("runs/x/metrics.jsonl"),
        "{\"step\": 1, \"time/step\": 1.0}\n",
    )
    .unwrap();
    std::fs::write(r.join("wall-x.tsv"), "").unwrap();
    std::fs::write(r.join("mem-x.csv"), "").unwrap();
    let o = Command::new("bash")
        .arg(repo.join("bench/gsm8k_run.sh"))
        .env("STEP", "report")
        .env("R", &r)
        .env("OUT", &out)
        .env("RUN", "x")
        .env_remove("SPEC")
        .env_remove("MODEL")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let first = text.lines().next().unwrap_or_default().to_string();
    assert!(
        first.starts_with("# GSM8K"),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    first
}
