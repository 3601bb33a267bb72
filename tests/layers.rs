//! The library's modules import only downward (docs/ARCHITECTURE.md): every `crate::NAME` path
//! in the code of `src/lib/MODULE/` (comments left out) names a module of a lower layer. This
//! also rules out import cycles between modules.

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, bottom first. A module may use the modules of the layers below its own.
const LAYERS: &[&[&str]] = &[
    &["error", "rng", "version"],
    &["batch", "process"],
    &["backend"],
    &["parallel"],
    &["tokenizer"],
    &["model", "data", "reward", "algo", "tool"],
    &["engine"],
    &["stage"],
    &["daemon"],
    &["serve"],
    &["pipeline"],
    &["bench"],
    &["cli"],
];

/// Macros exported at the crate root, and the module that defines them.
const MACROS: &[(&str, &str)] = &[("bail_input", "error")];

fn layer(module: &str) -> Option<usize> {
    let module = MACROS
        .iter()
        .find(|(m, _)| *m == module)
        .map_or(module, |(_, home)| home);
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The modules a file's code names as `crate::NAME` (also inside `use crate::{a, b::c}`).
fn used_modules(code: &str) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    let code: String = code
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let name = ident(item.trim());
                if !name.is_empty() {
                    used.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                used.insert(name);
            }
        }
    }
    used
}

#[test]
fn modules_import_only_downward() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut wrong = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap();
        let first = rel.iter().next().unwrap().to_string_lossy().to_string();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let Some(own) = layer(&module) else {
            wrong.push(format!(
                "src/lib/{}: module '{module}' has no layer: add it to LAYERS in tests/layers.rs and docs/ARCHITECTURE.md",
                rel.display()
            ));
            continue;
        };
        for used in used_modules(&std::fs::read_to_string(f).unwrap()) {
            if used == module {
                continue;
            }
            match layer(&used) {
                Some(l) if l < own => {}
                Some(_) => wrong.push(format!(
                    "src/lib/{}: '{module}' uses crate::{used}, which is not below it",
                    rel.display()
                )),
                None => wrong.push(format!(
                    "src/lib/{}: crate::{used} is not a known module",
                    rel.display()
                )),
            }
        }
    }
    assert!(files.len() > 50, "only {} files found", files.len());
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_scan_sees_paths_groups_and_skips_comments() {
    let code = "use crate::backend::Backend;\nuse crate::{batch, engine::paged::Request};\n\
                // crate::daemon in a comment\n/// [`crate::stage::X`]\nlet x = crate::rng::f(); // crate::bench\n";
    let got: Vec<String> = used_modules(code).into_iter().collect();
    assert_eq!(got, ["backend", "batch", "engine", "rng"]);
    assert_eq!(layer("bail_input"), layer("error"));
    assert!(layer("stage") < layer("daemon"));
}

/// The code of a Rust file with `//` comments (and so `///` docs) removed, line by line.
fn code_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or("").to_string())
        .collect()
}

/// `text` up to its test module (`#[cfg(test)]` then `mod …`), if it has one.
fn non_test(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim_start().starts_with("#[cfg(test)]")
                && lines
                    .get(i + 1)
                    .is_some_and(|n| n.trim_start().starts_with("mod "))
        })
        .unwrap_or(lines.len());
    lines[..end].join("\n")
}

/// The files under `src/lib/` with their paths relative to it.
fn lib_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(&root).unwrap().display().to_string();
            (rel, std::fs::read_to_string(f).unwrap())
        })
        .collect()
}

/// The decoder is math: no file of `model` names the communication module (sharding schedules
/// reach the decoder's passes through its per-unit hooks, from the engine).
#[test]
fn the_model_imports_no_communication() {
    let wrong: Vec<String> = lib_files()
        .into_iter()
        .filter(|(rel, _)| rel.starts_with("model/"))
        .filter(|(_, text)| used_modules(text).contains("parallel"))
        .map(|(rel, _)| format!("src/lib/{rel}: the model uses crate::parallel"))
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Whether the comment block right above line `i` (attributes and other comment lines between)
/// or line `i` itself carries a SAFETY note.
fn has_safety_note(lines: &[&str], i: usize) -> bool {
    let note = |l: &str| l.contains("SAFETY:") || l.contains("# Safety");
    if note(lines[i]) {
        return true;
    }
    let mut j = i;
    while j > 0 {
        j -= 1;
        let t = lines[j].trim();
        if note(t) {
            return true;
        }
        // A statement that wraps an `unsafe` block may start a line or two above it.
        let continues = t.ends_with('=') || t.ends_with('(') || t.ends_with(',') && j + 1 == i;
        if !(t.starts_with("//") || t.starts_with("#[") || continues) {
            return false;
        }
    }
    false
}

/// The lines of `text` that open an `unsafe` block, `unsafe fn` or `unsafe impl` with no SAFETY
/// note (`// SAFETY: …` above it or on its line; `/// # Safety` for an `unsafe fn`).
fn unsafe_without_note(text: &str) -> Vec<usize> {
    let raw: Vec<&str> = text.lines().collect();
    let code = code_lines(text);
    let mut out = Vec::new();
    for (i, l) in code.iter().enumerate() {
        let mut rest = l.as_str();
        let mut open = false;
        while let Some(k) = rest.find("unsafe") {
            let before = rest[..k].chars().last();
            let after = &rest[k + "unsafe".len()..];
            let word = before.is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == '"'))
                && after
                    .chars()
                    .next()
                    .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            let after = after.trim_start();
            if word
                && (after.starts_with('{')
                    || after.starts_with("fn ")
                    || after.starts_with("impl")
                    || after.is_empty())
            {
                open = true;
            }
            rest = &rest[k + "unsafe".len()..];
        }
        if open && !has_safety_note(&raw, i) {
            out.push(i + 1);
        }
    }
    out
}

/// Every `unsafe` block, `unsafe fn` and `unsafe impl` says why it holds.
#[test]
fn every_unsafe_says_why_it_holds() {
    let mut wrong = Vec::new();
    for (rel, text) in lib_files() {
        for line in unsafe_without_note(&text) {
            wrong.push(format!(
                "src/lib/{rel}:{line}: unsafe without a SAFETY note"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} sites:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn the_safety_scan_sees_blocks_fns_and_impls() {
    let code = "fn a() {\n    let p = unsafe { f() };\n}\n\
                // SAFETY: the pointer outlives the call.\nlet q = unsafe { g() };\n\
                unsafe impl Send for X {}\n/// Reads raw memory.\n///\n/// # Safety\n/// `p` is valid.\n\
                #[inline]\nunsafe fn h(p: *const u8) {}\n// not_unsafe { }\nlet s = \"unsafe {\";\n\
                let r = {\n    // SAFETY: checked above.\n    unsafe { k() }\n};\n";
    assert_eq!(unsafe_without_note(code), [2, 6]);
}

/// Functions in `text` (test modules left out) longer than `limit` lines: (line, name, length).
/// The code is rustfmt'd, so a body ends at the first `}` at its `fn`'s indentation.
fn long_functions(text: &str, limit: usize) -> Vec<(usize, String, usize)> {
    let lines = code_lines(&non_test(text));
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let Some(k) = t.find("fn ") else { continue };
        let head = &t[..k];
        let is_fn = head
            .split_whitespace()
            .all(|w| w.starts_with("pub") || ["async", "unsafe", "const", "extern"].contains(&w));
        if !is_fn {
            continue;
        }
        let name: String = t[k + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let indent = &l[..l.len() - t.len()];
        let Some(open) = (i..lines.len())
            .find(|&j| lines[j].contains('{') || lines[j].trim_end().ends_with(';'))
        else {
            continue;
        };
        if !lines[open].contains('{') || lines[open].trim_end().ends_with("{}") {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open..lines.len()).find(|&j| lines[j].trim_end() == close) {
            if end - i + 1 > limit {
                out.push((i + 1, name, end - i + 1));
            }
        }
    }
    out
}

/// A reader holds a function at once: none outside test code is longer than 120 lines. Test code
/// is the test modules, `tests.rs`/`testing.rs`, and the GPU checks of `tandem gpu-test`
/// (`check.rs`, `check/`); the CUDA kernels in `.cu` files are not Rust and not counted.
#[test]
fn no_function_is_longer_than_120_lines() {
    let mut wrong = Vec::new();
    for (rel, text) in lib_files() {
        let test_code = ["tests.rs", "testing.rs", "check.rs"]
            .iter()
            .any(|f| rel.ends_with(f));
        if test_code || rel.contains("/check/") {
            continue;
        }
        for (line, name, len) in long_functions(&text, 120) {
            wrong.push(format!("src/lib/{rel}:{line}: fn {name} is {len} lines"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} functions:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn the_length_scan_measures_bodies_and_skips_tests() {
    let mut code = String::from("pub(crate) fn long(\n    a: u8,\n) -> u8 {\n");
    code += &"    a;\n".repeat(10);
    code += "}\nfn decl(x: u8);\nfn short() {}\n    pub fn inner() {\n        1\n    }\n";
    code += "#[cfg(test)]\nmod tests {\n    fn t() {\n";
    code += &"        1;\n".repeat(50);
    code += "    }\n}\n";
    assert_eq!(long_functions(&code, 5), [(1, "long".to_string(), 14)]);
    assert!(long_functions(&code, 14).is_empty());
}

/// The module path of a file under `src/lib/` (`engine/paged/runner.rs` → `engine::paged::runner`).
fn module_path(rel: &str) -> String {
    let p = rel.trim_end_matches(".rs").trim_end_matches("/mod");
    p.replace('/', "::")
}

/// The sibling files a file names: `super::NAME` from a leaf file, `crate::…::NAME` anywhere.
fn sibling_uses(rel: &str, text: &str, siblings: &BTreeSet<String>) -> BTreeSet<String> {
    let own = module_path(rel);
    let parent = own.rsplit_once("::").map_or("", |(p, _)| p).to_string();
    let code = code_lines(&non_test(text)).join("\n");
    let mut out = BTreeSet::new();
    for s in siblings {
        let name = s.rsplit("::").next().unwrap();
        let full = format!("crate::{s}");
        let by_super = [format!("super::{name}::"), format!("super::{name};")];
        let in_group = code.match_indices("super::{").any(|(i, _)| {
            let g = &code[i + 8..];
            let g = &g[..g.find('}').unwrap_or(g.len())];
            g.split(',')
                .any(|it| it.trim().split("::").next() == Some(name))
        });
        let named = code.contains(&format!("{full}::"))
            || code.contains(&format!("{full};"))
            || by_super.iter().any(|p| code.contains(p.as_str()))
            || in_group;
        if named && s != &own && s.starts_with(&parent) {
            out.insert(s.clone());
        }
    }
    out
}

/// No two files of a folder import each other, directly or round a longer loop (test modules
/// left out).
#[test]
fn no_file_level_cycles() {
    let files = lib_files();
    let mut folders: std::collections::BTreeMap<String, Vec<(String, String)>> = Default::default();
    for (rel, text) in files {
        if rel.ends_with("mod.rs") || !rel.contains('/') {
            continue;
        }
        let folder = rel.rsplit_once('/').unwrap().0.to_string();
        folders.entry(folder).or_default().push((rel, text));
    }
    let mut cycles = Vec::new();
    for leaves in folders.values() {
        let names: BTreeSet<String> = leaves.iter().map(|(r, _)| module_path(r)).collect();
        let edges: Vec<(String, BTreeSet<String>)> = leaves
            .iter()
            .map(|(r, t)| (module_path(r), sibling_uses(r, t, &names)))
            .collect();
        for (a, uses) in &edges {
            // a reaches itself through its siblings?
            let mut seen = BTreeSet::new();
            let mut stack: Vec<String> = uses.iter().cloned().collect();
            while let Some(n) = stack.pop() {
                if n == *a {
                    cycles.push(format!("{a} is reached again through its siblings"));
                    break;
                }
                if seen.insert(n.clone()) {
                    if let Some((_, next)) = edges.iter().find(|(m, _)| *m == n) {
                        stack.extend(next.iter().cloned());
                    }
                }
            }
        }
    }
    assert!(cycles.is_empty(), "{}", cycles.join("\n"));
}

#[test]
fn the_cycle_scan_follows_super_and_crate_paths() {
    let sib: BTreeSet<String> = ["x::a", "x::b", "x::c"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let got = sibling_uses("x/a.rs", "use super::{b::B, d};\nuse crate::x::c;\n", &sib);
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["x::b", "x::c"]);
    assert!(sibling_uses("x/a.rs", "// super::b::B\nuse super::bb::X;\n", &sib).is_empty());
}
