//! The code format of tool calls (tool-integrated reasoning, as ToRL, SimpleTIR and rStar
//! prompt for it): the model writes a fenced block opened by ```` ```python ```` and closed by
//! ```` ``` ````; its code runs in the `python` tool, and the output follows inline, in the
//! same assistant message, as a ```` ```output ```` block.

use serde_json::json;

use super::ToolCall;

/// The tool a code block is a call of.
pub const CODE_TOOL: &str = "python";

/// The code of the first ```` ```python ```` (or ```` ```py ````) block of `text` that is
/// closed, if any. A block opens with the fence and its info string anywhere on a line and
/// holds the lines after it; it closes at the first line that starts (after spaces or tabs)
/// with ```` ``` ````, even before that line ends, so the check holds the moment the closing
/// fence is sampled. Blocks of other languages (or none) are skipped whole.
pub fn closed_block(text: &str) -> Option<&str> {
    // (start of the code in `text`, whether the open block is Python), while inside a block.
    let mut open: Option<(usize, bool)> = None;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let complete = line.ends_with('\n');
        match open {
            None => {
                if let (Some(k), true) = (line.find(FENCE), complete) {
                    let info = line[k..].trim_start_matches('`').trim();
                    let lang = info.split_whitespace().next().unwrap_or("");
                    open = Some((at + line.len(), matches!(lang, "python" | "py")));
                }
            }
            Some((start, python)) => {
                if line.trim_start_matches([' ', '\t']).starts_with(FENCE) {
                    if python {
                        // The code keeps its last newline's place: up to the fence's line.
                        return Some(text[start..at].trim_end_matches('\n'));
                    }
                    open = None;
                }
            }
        }
        at += line.len();
    }
    None
}

const FENCE: &str = "```";

/// The call a closed Python block of `text` makes: the `python` tool with `{"code": …}`.
pub fn parse_block(text: &str) -> Option<ToolCall> {
    closed_block(text).map(|code| ToolCall {
        name: CODE_TOOL.to_string(),
        arguments: json!({ "code": code }),
    })
}

/// The text appended after a block: its output in a ```` ```output ```` block, on a line of its
/// own (a newline first when the sampled text did not end with one); the result's trailing
/// newlines are dropped (the fence's line ends the output).
pub fn output_block(sampled_ends_with_newline: bool, result: &str) -> String {
    let lead = if sampled_ends_with_newline { "" } else { "\n" };
    format!("{lead}```output\n{}\n```\n", result.trim_end_matches('\n'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_python_block_is_a_call_once_its_closing_fence_is_written() {
        let open = "Let me compute.\n```python\nx = 48 / 2\nprint(x + 48)\n";
        assert_eq!(closed_block(open), None, "not closed yet");
        assert_eq!(closed_block(&format!("{open}``")), None, "half a fence");
        let closed = format!("{open}```");
        assert_eq!(closed_block(&closed), Some("x = 48 / 2\nprint(x + 48)"));
        let call = parse_block(&format!("{closed}\n")).unwrap();
        assert_eq!(call.name, "python");
        assert_eq!(call.arguments, json!({"code": "x = 48 / 2\nprint(x + 48)"}));
        // An opening fence mid-line and an indented closing one; `py` is Python too.
        assert_eq!(closed_block("So: ```py\n1+1\n  ```"), Some("1+1"));
        // An empty block is a call of empty code.
        assert_eq!(closed_block("```python\n```"), Some(""));
    }

    #[test]
    fn other_blocks_and_unfinished_openings_are_no_calls() {
        // A JSON block is skipped whole, also when it holds a python fence on a later line.
        let text = "```json\n{\"a\": 1}\n```\nthen\n```python\nprint(2)\n```";
        assert_eq!(closed_block(text), Some("print(2)"));
        assert_eq!(closed_block("```\n```python\nprint(1)\n```\n"), None);
        // The opening line must end before the block opens; a fence inside a line closes
        // nothing.
        assert_eq!(closed_block("```python"), None);
        assert_eq!(closed_block("```python\nprint('```')\n"), None);
        assert_eq!(closed_block("no code here"), None);
        assert_eq!(parse_block("```python\nprint(1)\n"), None);
    }

    #[test]
    fn the_output_follows_on_a_line_of_its_own() {
        assert_eq!(output_block(true, "72\n"), "```output\n72\n```\n");
        assert_eq!(output_block(false, "72"), "\n```output\n72\n```\n");
        assert_eq!(
            output_block(true, "error: boom\n\n"),
            "```output\nerror: boom\n```\n"
        );
        assert_eq!(output_block(true, ""), "```output\n\n```\n");
    }
}
