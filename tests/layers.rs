//! The library's modules import only downward (docs/ARCHITECTURE.md): every `crate::NAME` path
//! in the code of `src/lib/MODULE/` (comments left out) names a module of a lower layer. This
//! also rules out import cycles between modules.

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, bottom first. A module may use the modules of the layers below its own.
const LAYERS: &[&[&str]] = &[
    &["error", "rng"],
    &["batch", "process"],
    &["backend"],
    &["dist"],
    &["model", "data", "reward", "algo"],
    &["engine"],
    &["stage"],
    &["daemon"],
    &["pipeline"],
    &["bench"],
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
