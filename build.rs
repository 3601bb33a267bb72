//! Sets `TANDEM_COMMIT` for `--version`: the short git commit the binaries are built from, with
//! `-dirty` when tracked files differ from it, or `unknown` outside a git checkout (a tarball)
//! or without git.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    // GIT_OPTIONAL_LOCKS=0: `git status` must not refresh the index, which would make this
    // script (watching the index) run again on the next build.
    let out = Command::new("git")
        .args(args)
        .env("GIT_OPTIONAL_LOCKS", "0")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // Sources: their edits change the dirty flag (and rebuild the crate anyway); docs do not
    // rerun this script, so editing them does not rebuild the crate.
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let commit = git(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty());
    let Some(commit) = commit else {
        println!("cargo:rustc-env=TANDEM_COMMIT=unknown");
        return;
    };
    // A new commit, a checkout or `git add`: the files git keeps for them.
    let mut watched = vec![
        "HEAD".to_string(),
        "index".to_string(),
        "packed-refs".into(),
    ];
    if let Some(branch) = git(&["rev-parse", "--symbolic-full-name", "HEAD"]) {
        watched.push(branch);
    }
    for name in &watched {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            if Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=TANDEM_COMMIT={commit}{suffix}");
}
