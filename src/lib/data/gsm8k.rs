//! GSM8K import: the jsonl of openai/gsm8k (`{"question", "answer"}` per line) into verl's
//! prompt schema, row for row what verl's `examples/data_preprocess/gsm8k.py` writes.

use super::{jsonl_lines, parse_object, ExtraInfo, Message, VerlRow};
use crate::bail_input;
use anyhow::Result;
use regex::Regex;
use std::path::Path;
use std::sync::OnceLock;

/// verl's `data_source` for GSM8K (its reward dispatch keys on it).
pub const DATA_SOURCE: &str = "openai/gsm8k";
pub(crate) const ABILITY: &str = "math";
/// Appended to each question after one space, as verl does.
pub(crate) const INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// The final answer of a GSM8K solution: the FIRST `#### NUMBER` (verl uses `re.search`), with
/// thousands separators removed. None when the solution has no such line.
pub(crate) fn extract_solution(answer: &str) -> Option<String> {
    static RE: OnceLock<Regex> = OnceLock::new();
    let re = RE.get_or_init(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("valid regex"));
    re.captures(answer).map(|c| c[1].replace(',', ""))
}

/// Read a GSM8K jsonl file into verl rows. `index` counts records (blank lines skipped) from 0,
/// as `datasets.map(with_indices=True)` does.
pub fn read(path: &Path, split: &str) -> Result<Vec<VerlRow>> {
    let shown = path.display();
    let mut rows = Vec::new();
    for (line_no, line) in jsonl_lines(path)? {
        let obj = parse_object(path, line_no, &line)?;
        let field = |key: &str| -> Result<String> {
            match obj.get(key) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(v) => bail_input!(
                    "{shown}:{line_no}: field '{key}' must be a string, found {}",
                    super::json_kind(v)
                ),
                None => bail_input!("{shown}:{line_no}: field '{key}' is missing"),
            }
        };
        let question = field("question")?;
        let answer = field("answer")?;
        let Some(ground_truth) = extract_solution(&answer) else {
            bail_input!("{shown}:{line_no}: field 'answer' has no final answer line '#### NUMBER'");
        };
        rows.push(VerlRow {
            data_source: DATA_SOURCE.to_string(),
            prompt: vec![Message::new("user", format!("{question} {INSTRUCTION}"))],
            ability: Some(ABILITY.to_string()),
            ground_truth,
            extra_info: ExtraInfo {
                split: split.to_string(),
                index: rows.len() as i64,
                answer,
                question,
            },
        });
    }
    if rows.is_empty() {
        bail_input!("{shown}: no records (the file is empty)");
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solution_is_first_final_answer_without_commas() {
        assert_eq!(extract_solution("a\n#### 72").as_deref(), Some("72"));
        assert_eq!(
            extract_solution("x = 1,234\n#### 1,234").as_deref(),
            Some("1234")
        );
        assert_eq!(extract_solution("#### -3.5").as_deref(), Some("-3.5"));
        // verl takes the first match, not the last.
        assert_eq!(extract_solution("#### 1\n#### 2").as_deref(), Some("1"));
        // No space after ####, or no number: no answer.
        assert_eq!(extract_solution("####72"), None);
        assert_eq!(extract_solution("#### seventy"), None);
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("{\"question\": \"q\"}\n", "field 'answer' is missing"),
            (
                "{\"question\": 3, \"answer\": \"#### 1\"}\n",
                "field 'question' must be a string, found a number",
            ),
            ("[1]\n", "expected a JSON object, found an array"),
            (
                "{\"question\": \"q\", \"answer\": \"no number\"}\n",
                "no final answer line",
            ),
        ];
        for (i, (text, want)) in cases.iter().enumerate() {
            let path = dir.path().join(format!("bad{i}.jsonl"));
            let good = "{\"question\": \"q\", \"answer\": \"#### 1\"}\n";
            std::fs::write(&path, format!("{good}\n{text}")).unwrap();
            let err = read(&path, "train").unwrap_err();
            let msg = format!("{err:#}");
            assert!(crate::error::is_input_error(&err), "{msg}");
            assert!(msg.contains(&format!("bad{i}.jsonl:3:")), "{msg}");
            assert!(msg.contains(want), "{msg}");
        }
    }

    #[test]
    fn indices_count_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"question\": \"a\", \"answer\": \"#### 1\"}\n\n{\"question\": \"b\", \"answer\": \"so\\n#### 2,000\"}\n",
        )
        .unwrap();
        let rows = read(&path, "test").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].extra_info.index, 1);
        assert_eq!(rows[1].extra_info.split, "test");
        assert_eq!(rows[1].ground_truth, "2000");
        assert_eq!(rows[1].prompt[0].content, format!("b {INSTRUCTION}"));
    }
}
