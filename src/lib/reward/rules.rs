//! Simple rules: `exact` and `regex:PATTERN`.
//!
//! - `exact`: the response, with leading and trailing whitespace trimmed, equals the trimmed
//!   ground truth: 1.0, otherwise 0.0 (there is no "found but wrong" case, so no format score).
//! - `regex:PATTERN`: the LAST match of PATTERN in the response is the answer: its group named
//!   `answer` if the pattern has one, else its first capture group, else the whole match.
//!   The trimmed answer equal to the trimmed ground truth gives 1.0, a different answer the
//!   format score, no match 0.0. Patterns use Rust `regex` syntax (no look-around or
//!   back-references); `(?s)` makes `.` match newlines.

use regex::Regex;

/// `exact`: trimmed equality.
pub(crate) fn exact(text: &str, ground_truth: &str) -> f32 {
    if text.trim() == ground_truth.trim() {
        1.0
    } else {
        0.0
    }
}

/// A compiled `regex:PATTERN` rule.
#[derive(Clone, Debug)]
pub(crate) struct RegexRule {
    re: Regex,
    group: usize,
}

impl RegexRule {
    /// Compile the pattern; the error text is the regex crate's explanation.
    pub(crate) fn new(pattern: &str) -> Result<RegexRule, String> {
        let re = Regex::new(pattern).map_err(|e| e.to_string())?;
        let group = re
            .capture_names()
            .position(|n| n == Some("answer"))
            .unwrap_or(if re.captures_len() > 1 { 1 } else { 0 });
        Ok(RegexRule { re, group })
    }

    pub(crate) fn as_str(&self) -> &str {
        self.re.as_str()
    }

    /// The answer the rule extracts from `text`, if any.
    pub(crate) fn extract<'t>(&self, text: &'t str) -> Option<&'t str> {
        if self.group == 0 {
            return self.re.find_iter(text).last().map(|m| m.as_str());
        }
        // A last match whose group did not take part counts as an empty answer.
        self.re
            .captures_iter(text)
            .last()
            .map(|c| c.get(self.group).map_or("", |m| m.as_str()))
    }

    pub(crate) fn score(&self, text: &str, ground_truth: &str, format_score: f32) -> f32 {
        match self.extract(text) {
            None => 0.0,
            Some(a) if a.trim() == ground_truth.trim() => 1.0,
            Some(_) => format_score,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_trims_whitespace_only() {
        assert_eq!(exact("  Paris\n", "Paris"), 1.0);
        assert_eq!(exact("paris", "Paris"), 0.0);
        assert_eq!(exact("Paris.", "Paris"), 0.0);
        assert_eq!(exact("", ""), 1.0);
    }

    #[test]
    fn regex_groups() {
        let r = RegexRule::new(r"Answer: (\w+)").unwrap();
        assert_eq!(r.extract("Answer: a ... Answer: b"), Some("b"));
        assert_eq!(r.score("Answer: a ... Answer: b", "b", 0.1), 1.0);
        assert_eq!(r.score("Answer: a ... Answer: b", "a", 0.1), 0.1);
        assert_eq!(r.score("no answer line", "a", 0.1), 0.0);

        // Named group `answer` wins over the first group.
        let r = RegexRule::new(r"(Final|Answer): (?P<answer>-?\d+)").unwrap();
        assert_eq!(r.extract("Final: 12"), Some("12"));

        // No group: the whole match.
        let r = RegexRule::new(r"-?\d+").unwrap();
        assert_eq!(r.extract("3 then 4 then -5"), Some("-5"));

        // Optional group that did not take part in the last match.
        let r = RegexRule::new(r"x(\d)?").unwrap();
        assert_eq!(r.extract("x1 x"), Some(""));
        assert_eq!(r.score("x1 x", "", 0.1), 1.0);
    }

    #[test]
    fn bad_pattern_is_explained() {
        let err = RegexRule::new("(unclosed").unwrap_err();
        assert!(err.contains("unclosed group"), "{err}");
    }
}
