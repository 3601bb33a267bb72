//! `tandem prepare` end to end: the real binary on GSM8K lines, compared value by value with
//! what verl's own preprocessing writes (tests/fixtures/verl_gsm8k, made by make_fixture.py), and
//! both read back through `PromptDataset`.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::batch::json::value;
use tandem::batch::Batch;
use tandem::data::{Message, PromptDataset};

const INSTRUCTION: &str = "Let's think step by step and output the final answer after \"####\".";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures/verl_gsm8k").join(name)
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("run tandem")
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every cell of a file as JSON, column by column.
fn cells(path: &Path) -> Vec<(String, Vec<Value>)> {
    let b = Batch::read(path, &[]).unwrap();
    b.data
        .schema()
        .fields()
        .iter()
        .zip(b.data.columns())
        .map(|(f, c)| {
            (
                f.name().clone(),
                (0..c.len()).map(|i| value(c.as_ref(), i)).collect(),
            )
        })
        .collect()
}

/// An Arrow type spelled without list-item names, nullability or string width, which
/// differ between writers (pyarrow "element" vs arrow-rs "item", pandas' large_string).
fn shape(dt: &arrow_schema::DataType) -> String {
    use arrow_schema::DataType::*;
    match dt {
        Utf8 | LargeUtf8 | Utf8View => "string".into(),
        List(f) | LargeList(f) => format!("list<{}>", shape(f.data_type())),
        Struct(fs) => format!(
            "struct<{}>",
            fs.iter()
                .map(|f| format!("{}: {}", f.name(), shape(f.data_type())))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

fn shapes(path: &Path) -> Vec<(String, String)> {
    let b = Batch::read(path, &[]).unwrap();
    b.data
        .schema()
        .fields()
        .iter()
        .map(|f| (f.name().clone(), shape(f.data_type())))
        .collect()
}

#[test]
fn gsm8k_output_equals_verls_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("train.parquet");
    ok(&tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&fixture("input.jsonl")),
        "--out",
        s(&out),
        "--split",
        "train",
    ]));
    assert!(!dir.path().join("train.parquet.tmp").exists());
    let verl = fixture("train.parquet");
    let want_shape = [
        ("data_source", "string"),
        ("prompt", "list<struct<role: string, content: string>>"),
        ("ability", "string"),
        (
            "reward_model",
            "struct<style: string, ground_truth: string>",
        ),
        (
            "extra_info",
            "struct<split: string, index: Int64, answer: string, question: string>",
        ),
    ];
    let want_shape: Vec<(String, String)> = want_shape
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(shapes(&verl), want_shape);
    assert_eq!(shapes(&out), want_shape);
    assert_eq!(shapes(&fixture("pandas.parquet")), want_shape);
    // Same value in every cell as verl's datasets-written file and the pandas-written one.
    assert_eq!(cells(&out), cells(&verl));
    assert_eq!(cells(&out), cells(&fixture("pandas.parquet")));
    let meta = Batch::read(&out, &[]).unwrap().meta;
    assert_eq!(meta.get("tandem.schema").map(String::as_str), Some("1"));
    assert!(meta["tandem.stage.prepare"].contains("\"gsm8k\""));
}

#[test]
fn ours_and_verls_open_as_the_same_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mine.parquet");
    ok(&tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&fixture("input.jsonl")),
        "--out",
        s(&out),
        "--split",
        "train",
    ]));
    let ours = PromptDataset::open(&out).unwrap();
    for file in ["train.parquet", "pandas.parquet"] {
        let verl = PromptDataset::open(&fixture(file)).unwrap();
        assert_eq!(verl.rows(), ours.rows(), "{file}");
        // Rollout's copy of the dataset columns works on verl's types too.
        let idx = tandem::data::dataset::repeat_each(&[2, 1], 3);
        let cols = verl.take_columns(&idx).unwrap();
        let names: Vec<&str> = cols.iter().map(|(f, _)| f.name().as_str()).collect();
        assert_eq!(
            &names[..3],
            ["data_source", "prompt", "ground_truth"],
            "{file}"
        );
        // Every other column of verl's file is carried too.
        for col in ["ability", "reward_model", "extra_info"] {
            assert!(names.contains(&col), "{file}: {names:?}");
        }
        let gt: Vec<Value> = (0..6).map(|i| value(cols[2].1.as_ref(), i)).collect();
        assert_eq!(
            gt,
            [
                json!("5"),
                json!("5"),
                json!("5"),
                json!("10"),
                json!("10"),
                json!("10")
            ]
            .to_vec()
        );
        assert_eq!(value(cols[1].1.as_ref(), 3), value(cols[1].1.as_ref(), 5));
    }
    let first = ours.row(0);
    assert_eq!(first.data_source, "openai/gsm8k");
    assert_eq!(first.ground_truth.as_deref(), Some("72"));
    assert_eq!(first.messages.len(), 1);
    assert!(first.messages[0].content.starts_with("Natalia sold clips"));
    assert!(first.messages[0].content.ends_with(INSTRUCTION));
    assert_eq!(first.extra_info["index"], json!(0));
}

/// The real GSM8K file beside the repo (../shared/data/gsm8k, or $TANDEM_SHARED/data/gsm8k).
fn shared_gsm8k() -> Option<PathBuf> {
    let root = std::env::var_os("TANDEM_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("../shared"));
    let dir = root.join("data/gsm8k");
    if dir.join("train.jsonl").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "skipping: no GSM8K data at {} (set TANDEM_SHARED to the shared/ folder)",
            dir.display()
        );
        None
    }
}

#[test]
fn gsm8k_first_lines_of_shared_data_every_column() {
    let Some(data) = shared_gsm8k() else { return };
    let text = std::fs::read_to_string(data.join("train.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().take(3).collect();
    let dir = tempfile::tempdir().unwrap();
    // Named train.jsonl so the split comes from the file name.
    let input = dir.path().join("train.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = dir.path().join("out.parquet");
    ok(&tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&input),
        "--out",
        s(&out),
    ]));

    let got = cells(&out);
    let col = |name: &str| &got.iter().find(|(n, _)| n == name).unwrap().1;
    // The final answers of GSM8K train records 0..3, read off the files by hand.
    let truths = ["72", "10", "5"];
    for (i, line) in lines.iter().enumerate() {
        let src: Value = serde_json::from_str(line).unwrap();
        let (q, a) = (
            src["question"].as_str().unwrap(),
            src["answer"].as_str().unwrap(),
        );
        assert_eq!(col("data_source")[i], json!("openai/gsm8k"));
        assert_eq!(
            col("prompt")[i],
            json!([{"role": "user", "content": format!("{q} {INSTRUCTION}")}])
        );
        assert_eq!(col("ability")[i], json!("math"));
        assert_eq!(
            col("reward_model")[i],
            json!({"style": "rule", "ground_truth": truths[i]})
        );
        assert_eq!(
            col("extra_info")[i],
            json!({"split": "train", "index": i, "answer": a, "question": q})
        );
        assert!(a.ends_with(&format!("#### {}", truths[i])));
    }
    assert!(lines[0].contains("Natalia sold clips"));

    // The whole test split: one row per record, every ground truth a number.
    let out = dir.path().join("test.parquet");
    ok(&tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&data.join("test.jsonl")),
        "--out",
        s(&out),
    ]));
    let records = std::fs::read_to_string(data.join("test.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();
    let ds = PromptDataset::open(&out).unwrap();
    assert_eq!(ds.len(), records);
    for r in ds.rows() {
        let gt = r.ground_truth.as_deref().unwrap();
        assert!(gt.parse::<f64>().is_ok(), "{gt}");
        assert_eq!(r.extra_info["split"], json!("test"));
    }
}

fn assert_input_error(out: &Output, wants: &[&str], no_output: &Path) {
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    for want in wants {
        assert!(err.contains(want), "stderr lacks {want:?}: {err}");
    }
    assert!(!no_output.exists(), "{} was written", no_output.display());
    let mut tmp = no_output.as_os_str().to_owned();
    tmp.push(".tmp");
    assert!(!Path::new(&tmp).exists());
}

#[test]
fn malformed_lines_exit_2_name_file_and_line_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(fixture("input.jsonl")).unwrap();
    let good: Vec<&str> = good.lines().collect();
    let out = dir.path().join("out.parquet");
    let cases: [(&str, String, &[&str]); 4] = [
        (
            "broken.jsonl",
            format!("{}\n{}\n{{\"question\": \"x\",\n", good[0], good[1]),
            &["broken.jsonl:3:", "not valid JSON"],
        ),
        (
            "noanswer.jsonl",
            format!("{}\n{{\"question\": \"x\"}}\n", good[0]),
            &["noanswer.jsonl:2:", "field 'answer' is missing"],
        ),
        (
            "nohash.jsonl",
            format!("{{\"question\": \"x\", \"answer\": \"42\"}}\n{}\n", good[0]),
            &["nohash.jsonl:1:", "no final answer line"],
        ),
        (
            "empty.jsonl",
            "\n".to_string(),
            &["empty.jsonl: no records"],
        ),
    ];
    for (name, text, wants) in cases {
        let input = dir.path().join(name);
        std::fs::write(&input, text).unwrap();
        let res = tandem(&[
            "prepare",
            "gsm8k",
            "--in",
            s(&input),
            "--out",
            s(&out),
            "--split",
            "train",
        ]);
        assert_input_error(&res, wants, &out);
    }
    let res = tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&dir.path().join("missing.jsonl")),
        "--out",
        s(&out),
        "--split",
        "test",
    ]);
    assert_input_error(&res, &["missing.jsonl: cannot open"], &out);
    // No split given and none in the file name.
    let res = tandem(&[
        "prepare",
        "gsm8k",
        "--in",
        s(&fixture("input.jsonl")),
        "--out",
        s(&out),
    ]);
    assert_input_error(&res, &["input.jsonl", "--split train|test"], &out);
}

#[test]
fn jsonl_import_generic_keys() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("riddles.jsonl");
    std::fs::write(
        &input,
        concat!(
            "{\"problem\": \"What has keys but no locks?\", \"solution\": {\"final\": \"a piano\"}}\n",
            "{\"problem\": [{\"role\": \"system\", \"content\": \"Be terse.\"}, {\"role\": \"user\", \"content\": \"1+1?\"}], \"solution\": {\"final\": 2}}\n",
        ),
    )
    .unwrap();
    let out = dir.path().join("riddles.parquet");
    ok(&tandem(&[
        "prepare",
        "jsonl",
        "--in",
        s(&input),
        "--out",
        s(&out),
        "--prompt-key",
        "problem",
        "--answer-key",
        "solution.final",
        "--split",
        "test",
    ]));
    let ds = PromptDataset::open(&out).unwrap();
    assert_eq!(ds.len(), 2);
    let r0 = ds.row(0);
    assert_eq!(r0.data_source, "riddles");
    assert_eq!(
        r0.messages,
        vec![Message::new("user", "What has keys but no locks?")]
    );
    assert_eq!(r0.ground_truth.as_deref(), Some("a piano"));
    assert_eq!(
        r0.extra_info,
        json!({"split": "test", "index": 0, "answer": "a piano", "question": "What has keys but no locks?"})
    );
    let r1 = ds.row(1);
    assert_eq!(
        r1.messages,
        vec![
            Message::new("system", "Be terse."),
            Message::new("user", "1+1?")
        ]
    );
    assert_eq!(r1.ground_truth.as_deref(), Some("2"));
    let got = cells(&out);
    assert_eq!(
        got[2],
        ("ability".to_string(), vec![Value::Null, Value::Null])
    );

    // --data-source, --ability, --system and --instruction.
    let text_only = dir.path().join("q.jsonl");
    std::fs::write(&text_only, "{\"q\": \"Name a prime.\", \"a\": \"2\"}\n").unwrap();
    ok(&tandem(&[
        "prepare",
        "jsonl",
        "--in",
        s(&text_only),
        "--out",
        s(&out),
        "--prompt-key",
        "q",
        "--answer-key",
        "a",
        "--data-source",
        "primes",
        "--ability",
        "math",
        "--system",
        "You are a mathematician.",
        "--instruction",
        "Answer in one word.",
    ]));
    let got = cells(&out);
    assert_eq!(got[0].1, vec![json!("primes")]);
    assert_eq!(
        got[1].1,
        vec![json!([
            {"role": "system", "content": "You are a mathematician."},
            {"role": "user", "content": "Name a prime. Answer in one word."}
        ])]
    );
    assert_eq!(got[2].1, vec![json!("math")]);

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"q\": \"x\", \"a\": \"1\"}\n{\"q\": \"y\"}\n").unwrap();
    let out2 = dir.path().join("bad.parquet");
    let res = tandem(&[
        "prepare",
        "jsonl",
        "--in",
        s(&bad),
        "--out",
        s(&out2),
        "--prompt-key",
        "q",
        "--answer-key",
        "a",
    ]);
    assert_input_error(&res, &["bad.jsonl:2: field 'a' is missing"], &out2);
}

/// verl's per-row tool arguments survive the import: `extra_info.tools_kwargs` or a top-level
/// `tools_kwargs` becomes a `tools_kwargs` column of JSON text (null for a row without any),
/// which `rollout --tool` reads; a malformed value is an input error naming file, line and key.
#[test]
fn jsonl_import_keeps_tools_kwargs() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("multiturn.jsonl");
    std::fs::write(
        &input,
        concat!(
            "{\"q\": \"a\", \"a\": \"72\", \"extra_info\": {\"need_tools_kwargs\": true, \"tools_kwargs\": {\"calc_gsm8k_reward\": {\"create_kwargs\": {\"ground_truth\": \"72\"}}}}}\n",
            "{\"q\": \"b\", \"a\": \"1\"}\n",
            "{\"q\": \"c\", \"a\": \"10\", \"tools_kwargs\": {\"calc\": {\"execute_kwargs\": {\"x\": 1}, \"release_kwargs\": null}}}\n",
        ),
    )
    .unwrap();
    let out = dir.path().join("multiturn.parquet");
    let args = |input: &Path, out: &Path| {
        tandem(&[
            "prepare",
            "jsonl",
            "--in",
            s(input),
            "--out",
            s(out),
            "--prompt-key",
            "q",
            "--answer-key",
            "a",
        ])
    };
    ok(&args(&input, &out));
    let got = cells(&out);
    let (name, values) = got.last().unwrap();
    assert_eq!(name, "tools_kwargs");
    assert_eq!(
        values,
        &[
            json!(r#"{"calc_gsm8k_reward":{"create_kwargs":{"ground_truth":"72"}}}"#),
            Value::Null,
            json!(r#"{"calc":{"execute_kwargs":{"x":1}}}"#),
        ]
    );
    // Without any, no column.
    let plain = dir.path().join("plain.jsonl");
    std::fs::write(&plain, "{\"q\": \"a\", \"a\": \"72\"}\n").unwrap();
    ok(&args(&plain, &out));
    assert!(cells(&out).iter().all(|(name, _)| name != "tools_kwargs"));

    let bad = dir.path().join("bad.jsonl");
    let out2 = dir.path().join("bad.parquet");
    for (line, want) in [
        (
            r#"{"q": "x", "a": "1", "tools_kwargs": "{oops"}"#,
            "bad.jsonl:2: field 'tools_kwargs': not JSON (",
        ),
        (
            r#"{"q": "x", "a": "1", "extra_info": {"tools_kwargs": {"calc": {"create": {}}}}}"#,
            "bad.jsonl:2: field 'extra_info.tools_kwargs': tool `calc`: unknown key `create`",
        ),
    ] {
        std::fs::write(&bad, format!("{{\"q\": \"x\", \"a\": \"1\"}}\n{line}\n")).unwrap();
        assert_input_error(&args(&bad, &out2), &[want], &out2);
    }
}
