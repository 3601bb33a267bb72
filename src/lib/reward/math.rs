//! MATH-style boxed answers: a port of verl's `verl/utils/reward_score/math_reward.py`
//! (the `math_verify`-free rule, from lm-evaluation-harness' hendrycks_math), plus the extra
//! normalisations issue 2 asks for.
//!
//! The answer is the last `\boxed{...}` of the response (nested braces counted), or what
//! follows the last `\boxed ` up to a `$`. [`verl_strip`] is verl's `strip_string` step by
//! step. A response is correct when verl's rule says so, OR when both sides are equal and
//! not empty after [`strip`], which also drops a plain `$` and `%`, unwraps `\text{...}` and
//! removes a trailing `.0` (`5.0` = `5`). The OR keeps every answer verl accepts accepted.
//! Where verl's `strip_string` raises (e.g. `\frac` or `\sqrt` at the very end, two
//! `\text{ ` units), verl compares the raw strings; so do we.

use regex::Regex;
use std::sync::OnceLock;

/// Where verl's Python code raises (IndexError, AssertionError) while normalising.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Raises;

/// verl's `last_boxed_only_string` then `remove_boxed`: the content of the last box.
/// None when there is no box or verl's `remove_boxed` would assert (e.g. `\fbox{..}`).
pub(crate) fn last_boxed(text: &str) -> Option<&str> {
    const SPACED: &str = "\\boxed ";
    if let Some(pos) = text.rfind(SPACED) {
        // `\boxed 5$`: up to the next dollar.
        let rest = &text[pos + SPACED.len()..];
        return Some(rest.split('$').next().unwrap_or(""));
    }
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let mut depth = 0i64;
    let mut end = None;
    for (i, b) in text.bytes().enumerate().skip(start) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(i);
                    break;
                }
            }
            _ => {}
        }
    }
    let boxed = &text[start..=end?];
    // remove_boxed asserts the box opens with `\boxed{` (so `\fbox{}` and `\boxed x{}` fail).
    boxed.strip_prefix("\\boxed{")?.strip_suffix('}')
}

/// Python's `s[0]` and `s[1:]` on a string: the first character and the rest.
fn first_char(s: &str) -> Option<(char, &str)> {
    let c = s.chars().next()?;
    Some((c, &s[c.len_utf8()..]))
}

/// The opening brace as a char (named: one spelling for the comparisons below).
const OPEN: char = '{';

/// `{c}` onto `out`.
fn push_braced(out: &mut String, c: char) {
    out.extend([OPEN, c, '}']);
}

/// verl's `fix_fracs`: `\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`.
/// Err where Python raises IndexError (`\frac` at the end).
fn fix_fracs(s: &str) -> Result<String, Raises> {
    let mut parts = s.split("\\frac");
    let mut out = String::with_capacity(s.len() + 8);
    out.push_str(parts.next().unwrap_or(""));
    for sub in parts {
        out.push_str("\\frac");
        let (a, rest) = first_char(sub).ok_or(Raises)?;
        if a == OPEN {
            out.push_str(sub);
            continue;
        }
        let Some((b, post)) = first_char(rest) else {
            // verl: `assert len(substr) >= 2` fails -> the input comes back unchanged.
            return Ok(s.to_string());
        };
        push_braced(&mut out, a);
        if b != OPEN {
            push_braced(&mut out, b);
        } else {
            out.push(b);
        }
        out.push_str(post);
    }
    Ok(out)
}

/// Python's `int(x)` round-trips to `x` exactly when `x` is a canonical integer literal.
fn is_canonical_int(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && s != "-0"
}

/// verl's `fix_a_slash_b`: `3/4` -> `\frac{3}{4}` for plain integers.
fn fix_a_slash_b(s: &str) -> String {
    let mut it = s.split('/');
    match (it.next(), it.next(), it.next()) {
        (Some(a), Some(b), None) if is_canonical_int(a) && is_canonical_int(b) => {
            format!("\\frac{{{a}}}{{{b}}}")
        }
        _ => s.to_string(),
    }
}

/// verl's `remove_right_units`: drop `\text{ units}`. Err where verl's assert fails.
fn remove_right_units(s: &str) -> Result<&str, Raises> {
    const UNIT: &str = "\\text{ ";
    match s.find(UNIT) {
        None => Ok(s),
        Some(i) if s[i + UNIT.len()..].contains(UNIT) => Err(Raises),
        Some(i) => Ok(&s[..i]),
    }
}

/// verl's `fix_sqrt`: `\sqrt3` -> `\sqrt{3}`. Err where Python raises (`\sqrt` at the end).
fn fix_sqrt(s: &str) -> Result<String, Raises> {
    if !s.contains("\\sqrt") {
        return Ok(s.to_string());
    }
    let mut parts = s.split("\\sqrt");
    let mut out = String::with_capacity(s.len() + 8);
    out.push_str(parts.next().unwrap_or(""));
    for part in parts {
        let (a, rest) = first_char(part).ok_or(Raises)?;
        out.push_str("\\sqrt");
        if a == OPEN {
            out.push_str(part);
        } else {
            push_braced(&mut out, a);
            out.push_str(rest);
        }
    }
    Ok(out)
}

/// Which normalisation [`normalize`] applies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rules {
    /// verl's `strip_string`, nothing more.
    Verl,
    /// verl's steps plus plain `$`, plain `%`, `\text{..}` unwrapping and trailing `.0`.
    Extended,
}

fn text_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"\\text\{([^{}]*)\}").expect("text pattern"))
}

fn trailing_zero_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // `5.0`, `5.00` -> `5`, also before a non-digit: `\frac{10.0}{3}` -> `\frac{10}{3}`.
    RE.get_or_init(|| Regex::new(r"([0-9])\.0+([^0-9]|$)").expect("trailing zero pattern"))
}

fn normalize(s: &str, rules: Rules) -> Result<String, Raises> {
    let ext = rules == Rules::Extended;
    let mut s = s
        .replace('\n', "")
        .replace("\\!", "")
        .replace("\\\\", "\\")
        .replace("tfrac", "frac")
        .replace("dfrac", "frac")
        .replace("\\left", "")
        .replace("\\right", "")
        .replace("^{\\circ}", "")
        .replace("^\\circ", "")
        .replace("\\$", "");
    if ext {
        s = s.replace('$', "");
    }
    s = remove_right_units(&s)?.to_string();
    if ext {
        s = text_re().replace_all(&s, "$1").into_owned();
    }
    s = s.replace("\\\\%", "").replace("\\%", "");
    if ext {
        s = s.replace('%', "");
    }
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Ok(s);
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    // `k = 3` -> `3` when the left side is at most 2 characters.
    {
        let mut it = s.split('=');
        if let (Some(lhs), Some(rhs), None) = (it.next(), it.next(), it.next()) {
            if lhs.chars().count() <= 2 {
                s = rhs.to_string();
            }
        }
    }
    s = fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if ext {
        s = trailing_zero_re().replace_all(&s, "$1$2").into_owned();
    }
    if s == "0.5" {
        s = "\\frac{1}{2}".to_string();
    }
    Ok(fix_a_slash_b(&s))
}

/// verl's `strip_string` (Err where it raises).
pub(crate) fn verl_strip(s: &str) -> Result<String, Raises> {
    normalize(s, Rules::Verl)
}

/// verl's `strip_string` plus the extra normalisations (Err where verl's raises).
pub(crate) fn strip(s: &str) -> Result<String, Raises> {
    normalize(s, Rules::Extended)
}

/// verl's `is_equiv`: compare normalised strings, or the raw ones when normalising fails.
fn equiv_with(a: &str, b: &str, norm: fn(&str) -> Result<String, Raises>) -> bool {
    match (norm(a), norm(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// Whether the boxed answer `answer` matches `ground_truth` (see the module doc).
pub(crate) fn is_equiv(answer: &str, ground_truth: &str) -> bool {
    // The extra rules may empty a string (`\boxed{%}`); nothing empty matches through them.
    let extended = || matches!((strip(answer), strip(ground_truth)), (Ok(a), Ok(b)) if a == b && !a.is_empty());
    equiv_with(answer, ground_truth, verl_strip) || extended()
}

/// 1.0 for a correct last box, the format score for a wrong one, 0.0 when there is no box.
pub(crate) fn score(text: &str, ground_truth: &str, format_score: f32) -> f32 {
    match last_boxed(text) {
        None => 0.0,
        Some(a) if is_equiv(a, ground_truth) => 1.0,
        Some(_) => format_score,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_extraction() {
        assert_eq!(last_boxed("so \\boxed{5}."), Some("5"));
        assert_eq!(last_boxed("\\boxed{1} then \\boxed{2}"), Some("2"));
        assert_eq!(
            last_boxed("x = \\boxed{\\frac{1}{\\sqrt{2}}} done"),
            Some("\\frac{1}{\\sqrt{2}}")
        );
        assert_eq!(last_boxed("$\\boxed 7$ end"), Some("7"));
        assert_eq!(last_boxed("no box here"), None);
        // Unclosed box.
        assert_eq!(last_boxed("\\boxed{3"), None);
        // verl's remove_boxed asserts on \fbox: no answer.
        assert_eq!(last_boxed("\\fbox{3}"), None);
        // Multi-byte text around the box.
        assert_eq!(last_boxed("答案是 \\boxed{五} 。"), Some("五"));
    }

    #[test]
    fn verl_strip_table() {
        let cases: &[(&str, &str)] = &[
            ("\\dfrac{1}{2}", "\\frac{1}{2}"),
            ("\\tfrac12", "\\frac{1}{2}"),
            ("\\frac1{72}", "\\frac{1}{72}"),
            ("\\left( 1, 2 \\right)", "(1,2)"),
            ("90^\\circ", "90"),
            ("90^{\\circ}", "90"),
            ("\\$5", "5"),
            ("10 \\text{ cm}", "10"),
            ("50\\%", "50"),
            (".5", "\\frac{1}{2}"),
            ("0.5", "\\frac{1}{2}"),
            ("x = 3", "3"),
            ("abc = 3", "abc=3"),
            ("\\sqrt2", "\\sqrt{2}"),
            ("3/4", "\\frac{3}{4}"),
            ("03/4", "03/4"),
            ("a/b", "a/b"),
            ("1 .5", "10.5"),
        ];
        for &(input, want) in cases {
            assert_eq!(verl_strip(input).as_deref(), Ok(want), "{input:?}");
        }
        // Where verl's Python raises.
        assert_eq!(verl_strip("2\\sqrt"), Err(Raises));
        assert_eq!(verl_strip("\\frac"), Err(Raises));
        assert_eq!(verl_strip("1\\text{ m}2\\text{ s}"), Err(Raises));
    }

    #[test]
    fn extended_strip_table() {
        let cases: &[(&str, &str)] = &[
            ("5.0", "5"),
            ("5.000", "5"),
            ("5.05", "5.05"),
            ("\\frac{10.0}{3}", "\\frac{10}{3}"),
            ("50%", "50"),
            ("$42$", "42"),
            ("\\text{(B)}", "(B)"),
            ("\\text{Monday}", "Monday"),
        ];
        for &(input, want) in cases {
            assert_eq!(strip(input).as_deref(), Ok(want), "{input:?}");
        }
    }

    #[test]
    fn score_table() {
        let cases: &[(&str, &str, f32)] = &[
            (
                "The answer is $\\boxed{\\dfrac{3}{4}}$.",
                "\\frac{3}{4}",
                1.0,
            ),
            ("$\\boxed{3/4}$", "\\frac{3}{4}", 1.0),
            ("\\boxed{\\left(2, 3\\right)}", "(2,3)", 1.0),
            ("\\boxed{30^\\circ}", "30", 1.0),
            ("\\boxed{25\\%}", "25", 1.0),
            ("\\boxed{25%}", "25", 1.0),
            ("\\boxed{12.0}", "12", 1.0),
            ("\\boxed{\\text{(C)}}", "(C)", 1.0),
            ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
            ("\\boxed{1} no wait \\boxed{2}", "2", 1.0),
            ("\\boxed{1} no wait \\boxed{2}", "1", 0.2),
            ("\\boxed{12.5}", "12", 0.2),
            ("the answer is 12", "12", 0.0),
            // Raw equality when verl's normalisation raises.
            ("\\boxed{\\frac}", "\\frac", 1.0),
            // The extra rules never make an empty answer right.
            ("\\boxed{}", "%", 0.2),
            ("\\boxed{$}", "%", 0.2),
        ];
        for &(text, gt, want) in cases {
            assert_eq!(score(text, gt, 0.2), want, "{text:?} vs {gt:?}");
        }
    }
}
