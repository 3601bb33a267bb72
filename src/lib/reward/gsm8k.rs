//! GSM8K answer check, a port of verl's `verl/utils/reward_score/gsm8k.py`.
//!
//! Only the last 300 characters of the response are looked at (Python slices code points, so
//! we count `char`s, never bytes). `strict` takes the LAST match of `#### (\-?[0-9\.\,]+)` and
//! drops `,` and `$`; `flexible` takes the last match of `(\-?[0-9\.\,]+)` that is not `.`
//! (verl's quirk kept: when every match is `.`, the answer is `.`). The answer is compared to
//! the ground truth as a string: equal gives 1.0, found but different gives the format score,
//! nothing found gives 0.0. [`score_with_fallback`] adds one tier to `strict`: no `#### N`, but
//! the last number is right, gives a fallback score (pays a model for the right number before
//! it learns the format).

use regex::Regex;
use std::sync::OnceLock;

/// verl's `_SOLUTION_CLIP_CHARS`.
pub(crate) const CLIP_CHARS: usize = 300;

/// How the answer is pulled out of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// The last `#### NUMBER` (the format the GSM8K prompt asks for).
    Strict,
    /// The last number anywhere in the clipped text.
    Flexible,
}

fn strict_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("gsm8k strict pattern"))
}

fn number_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"\-?[0-9\.\,]+").expect("gsm8k flexible pattern"))
}

/// The last `CLIP_CHARS` characters of `s` (all of it when shorter).
pub(crate) fn clip(s: &str) -> &str {
    // Walking back from the end touches at most 300 chars, whatever the length of `s`.
    match s.char_indices().rev().nth(CLIP_CHARS - 1) {
        Some((i, _)) => &s[i..],
        None => s,
    }
}

/// The extracted answer as it sits in the text (strict: still holding any `,` that
/// [`answer_matches`] and [`extract`] drop), or None when there is none.
fn raw_answer(text: &str, method: Method) -> Option<&str> {
    let text = clip(text);
    match method {
        Method::Strict => strict_re()
            .captures_iter(text)
            .last()
            .map(|c| c.get(1).expect("group 1").as_str()),
        Method::Flexible => {
            let mut last = None;
            let mut last_valid = None;
            for m in number_re().find_iter(text) {
                last.get_or_insert(m.as_str());
                if m.as_str() != "." {
                    last_valid = Some(m.as_str());
                }
            }
            // verl loops over the matches in reverse and breaks on the first valid one; with
            // none valid the loop variable ends on the first match.
            last_valid.or(last)
        }
    }
}

/// The answer verl's `extract_solution` returns.
#[cfg(test)]
fn extract(text: &str, method: Method) -> Option<String> {
    raw_answer(text, method).map(|a| match method {
        Method::Strict => a.replace([',', '$'], ""),
        Method::Flexible => a.to_string(),
    })
}

/// Whether the extracted answer equals the ground truth, without allocating.
fn answer_matches(answer: &str, method: Method, ground_truth: &str) -> bool {
    match method {
        Method::Strict => answer
            .bytes()
            .filter(|&b| b != b',' && b != b'$')
            .eq(ground_truth.bytes()),
        Method::Flexible => answer == ground_truth,
    }
}

/// verl's `compute_score(solution_str, ground_truth, method, format_score, score=1.0)`.
#[cfg(test)]
pub(crate) fn score(text: &str, ground_truth: &str, method: Method, format_score: f32) -> f32 {
    score_with_fallback(text, ground_truth, method, format_score, 0.0)
}

/// [`score`], where for `strict` a response with no `#### N` whose last number (`flexible`) is
/// right scores `fallback_score` instead of 0.0. A fallback of 0.0 is verl's rule.
pub(crate) fn score_with_fallback(
    text: &str,
    ground_truth: &str,
    method: Method,
    format_score: f32,
    fallback_score: f32,
) -> f32 {
    match raw_answer(text, method) {
        Some(a) if answer_matches(a, method, ground_truth) => 1.0,
        Some(_) => format_score,
        None if method == Method::Strict && fallback_score != 0.0 => {
            match raw_answer(text, Method::Flexible) {
                Some(a) if answer_matches(a, Method::Flexible, ground_truth) => fallback_score,
                _ => 0.0,
            }
        }
        None => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Method::{Flexible, Strict};

    #[test]
    fn strict_table() {
        // (response, ground truth, expected score with format score 0.1)
        let cases: &[(&str, &str, f32)] = &[
            ("so the answer is\n#### 72", "72", 1.0),
            ("#### 1,234", "1234", 1.0),
            ("#### 1,234", "1,234", 0.1),
            ("#### -5", "-5", 1.0),
            ("#### -5", "5", 0.1),
            ("#### 3.50", "3.50", 1.0),
            ("#### 3.50", "3.5", 0.1),
            // The last #### wins.
            ("#### 10 wait, no: #### 12", "12", 1.0),
            ("#### 10 wait, no: #### 12", "10", 0.1),
            // No space after ####, or a $ before the number: no match at all.
            ("####72", "72", 0.0),
            ("#### $72", "72", 0.0),
            ("The answer is 72.", "72", 0.0),
            ("", "72", 0.0),
            // A trailing period is part of the number class.
            ("#### 72.", "72", 0.1),
        ];
        for &(text, gt, want) in cases {
            assert_eq!(score(text, gt, Strict, 0.1), want, "{text:?} vs {gt:?}");
        }
    }

    #[test]
    fn strict_extract_values() {
        assert_eq!(
            extract("#### 1,234,567", Strict).as_deref(),
            Some("1234567")
        );
        assert_eq!(
            extract("#### -0.5 and #### 7", Strict).as_deref(),
            Some("7")
        );
        assert_eq!(extract("no answer", Strict), None);
    }

    #[test]
    fn flexible_table() {
        let cases: &[(&str, &str, f32)] = &[
            ("She has 3 apples and buys 4, so 7", "7", 1.0),
            ("total: 1,000", "1,000", 1.0),
            // flexible keeps commas (verl does not strip them in this mode).
            ("total: 1,000", "1000", 0.1),
            ("it is -12 degrees", "-12", 1.0),
            ("#### 5\nso 6.", "6.", 1.0),
            ("no digits here", "7", 0.0),
        ];
        for &(text, gt, want) in cases {
            assert_eq!(score(text, gt, Flexible, 0.1), want, "{text:?} vs {gt:?}");
        }
        // A lone "." is skipped for an earlier number.
        assert_eq!(extract("42 is it . ", Flexible).as_deref(), Some("42"));
        // Only dots: verl's loop leaves the first match.
        assert_eq!(extract("well . then .", Flexible).as_deref(), Some("."));
    }

    #[test]
    fn only_the_last_300_characters_count() {
        let pad = "x".repeat(400);
        // Answer near the start, outside the clip.
        assert_eq!(score(&format!("#### 72{pad}"), "72", Strict, 0.1), 0.0);
        // Answer at the very end, inside the clip.
        assert_eq!(score(&format!("{pad}#### 72"), "72", Strict, 0.1), 1.0);
        // "#### 72" where the cut falls inside "####": 300 chars keep only "## 72...".
        let tail = "y".repeat(CLIP_CHARS - 5);
        assert_eq!(score(&format!("#### 72{tail}"), "72", Strict, 0.1), 0.0);
        let tail = "y".repeat(CLIP_CHARS - 7);
        assert_eq!(score(&format!("#### 72{tail}"), "72", Strict, 0.1), 1.0);
    }

    #[test]
    fn clip_counts_characters_not_bytes() {
        // 299 three-byte characters after the answer: 300 chars reach back to the "2" only
        // when counted as characters (in bytes the cut would fall far later).
        let tail = "€".repeat(CLIP_CHARS - 1);
        let text = format!("#### 72{tail}");
        assert_eq!(clip(&text).chars().count(), CLIP_CHARS);
        assert!(clip(&text).starts_with('2'));
        assert_eq!(extract(&text, Flexible).as_deref(), Some("2"));
        // 293 multi-byte chars: the whole "#### 72" fits in the 300.
        let tail = "日".repeat(CLIP_CHARS - 7);
        assert_eq!(score(&format!("#### 72{tail}"), "72", Strict, 0.1), 1.0);
        let tail = "日".repeat(CLIP_CHARS - 6);
        assert_eq!(score(&format!("#### 72{tail}"), "72", Strict, 0.1), 0.0);
        // Short strings are kept whole.
        assert_eq!(clip("añ"), "añ");
    }

    #[test]
    fn fallback_tier() {
        // The rule of pipelines/rewards/gsm8k_format.py: 1.0 / 0.1 on `#### N`, else 0.5 for a
        // right last number, else 0.0.
        let cases: &[(&str, &str, f32)] = &[
            ("so\n#### 72", "72", 1.0),
            ("#### 1,234", "1234", 1.0),
            ("#### 71", "72", 0.1),
            // A wrong `#### N` is not rescued by a right number after it.
            ("#### 71, so 72", "72", 0.1),
            ("The answer is \\boxed{72}.", "72", 0.5),
            ("The answer is 72.", "72", 0.0),
            ("It is 72 apples", "72", 0.5),
            ("It is 1,234 apples", "1234", 0.0),
            ("no number", "72", 0.0),
            ("", "72", 0.0),
        ];
        for &(text, gt, want) in cases {
            assert_eq!(
                score_with_fallback(text, gt, Strict, 0.1, 0.5),
                want,
                "{text:?} vs {gt:?}"
            );
            // A fallback of 0 is verl's strict rule.
            assert_eq!(
                score_with_fallback(text, gt, Strict, 0.1, 0.0),
                score(text, gt, Strict, 0.1)
            );
        }
        // flexible has no tier below it.
        assert_eq!(score_with_fallback("x 72", "72", Flexible, 0.1, 0.5), 1.0);
    }
}
