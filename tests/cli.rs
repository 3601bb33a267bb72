//! The command lines of the real binaries: `tandem --help` lists every binary, `tandem STAGE`
//! runs the stage, completions and man pages come from the stages' flags, and `--version` names
//! the git commit.

use crate::stage_util;

use stage_util::*;
use std::path::Path;
use std::process::{Command, Output};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// Every binary of the package but `tandem`: the files of src/bin.
fn binaries() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/bin");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
        .filter(|n| n != "tandem")
        .collect();
    names.sort();
    names
}

fn bin_path(name: &str) -> &'static str {
    match name {
        "pipeline" => env!("CARGO_BIN_EXE_pipeline"),
        "tandem" => TANDEM,
        stage => bin(stage),
    }
}

fn tandem(args: &[&str]) -> Output {
    Command::new(TANDEM)
        .args(args)
        .output()
        .expect("spawn tandem")
}

fn stdout_ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {:?}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn help_lists_every_binary_with_its_line() {
    let help = stdout_ok(&tandem(&["--help"]), "tandem --help");
    let names = binaries();
    assert!(names.len() >= 7, "{names:?}");
    for name in names {
        let line = help
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("tandem --help has no line for {name}:\n{help}"));
        // The line carries the binary's own description, as its --help shows it.
        let own = stdout_ok(
            &Command::new(bin_path(&name))
                .arg("--help")
                .output()
                .unwrap(),
            &name,
        );
        let about = own.lines().next().unwrap().trim_end_matches('.');
        assert!(line.contains(about), "{name}: {line:?} vs {about:?}");
    }
    for tool in ["completions", "man", "plot", "daemon-ctl"] {
        assert!(help.contains(&format!("\n  {tool} ")), "{tool}:\n{help}");
    }
}

#[test]
fn tandem_stage_is_the_stage_binary() {
    // The same help, but for the usage line's program name.
    for name in binaries() {
        let via = stdout_ok(
            &tandem(&[&name, "--help"]),
            &format!("tandem {name} --help"),
        );
        let own = Command::new(bin_path(&name))
            .arg("--help")
            .output()
            .unwrap();
        let own = String::from_utf8(own.stdout).unwrap();
        assert_eq!(
            via.replace(&format!("tandem {name}"), &name),
            own,
            "tandem {name} --help"
        );
    }
    // Bad input: the stage's own error and exit code.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.parquet");
    let args = [
        "--model",
        "no-model",
        "--in",
        "no.parquet",
        "--out",
        p(&out),
    ];
    let via = Command::new(TANDEM)
        .arg("rollout")
        .args(args)
        .output()
        .unwrap();
    let own = run("rollout", &args);
    assert_eq!(via.status.code(), Some(2));
    assert_eq!(via.stderr, own.stderr);
    assert!(!out.exists());

    // A real rollout: the same samples as the binary's.
    let model = tiny_model(dir.path(), 1);
    let prompts_path = dir.path().join("prompts.parquet");
    prompts(&prompts_path, &["What is 2 + 3?", "Name a colour."]);
    let outs = [dir.path().join("a.parquet"), dir.path().join("b.parquet")];
    let argv = |out: &Path| {
        let flags = ["--n", "2", "--max-new-tokens", "6", "--seed", "3"];
        let mut a = vec!["--model", p(&model), "--in", p(&prompts_path), "--out"];
        a.push(p(out));
        a.extend(flags);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let via = Command::new(TANDEM)
        .arg("rollout")
        .args(argv(&outs[0]))
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap();
    stdout_ok(&via, "tandem rollout");
    ok("rollout", &argv(&outs[1]));
    let texts = |f: &Path| strings(&read(f), "response_text");
    assert_eq!(texts(&outs[0]).len(), 4);
    assert_eq!(texts(&outs[0]), texts(&outs[1]));
}

#[test]
fn completions_come_from_the_stage_flags() {
    for shell in ["bash", "zsh", "fish"] {
        let script = stdout_ok(&tandem(&["completions", shell]), shell);
        // A stage flag, under `tandem rollout` and under the `rollout` binary.
        assert!(script.contains("max-new-tokens"), "{shell}");
        assert!(script.contains("kl-coef"), "{shell}");
        for name in binaries() {
            let registered = match shell {
                "bash" => format!("-o default {name}\n"),
                "zsh" => format!("#compdef {name}\n"),
                _ => format!("complete -c {name} "),
            };
            assert!(script.contains(&registered), "{shell}: {registered:?}");
        }
    }
    // bash completes a stage flag after `tandem rollout` and after `ref-logprob`.
    let complete = |words: &str, function: &str| {
        let script = format!(
            "source <('{TANDEM}' completions bash); COMP_WORDS=({words}); \
             COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); COMP_LINE='{words}'; \
             COMP_POINT=${{#COMP_LINE}}; \
             {function} \"${{COMP_WORDS[0]}}\" \"${{COMP_WORDS[-1]}}\" \"${{COMP_WORDS[-2]}}\"; \
             printf '%s\\n' \"${{COMPREPLY[@]}}\""
        );
        let out = Command::new("bash").arg("-c").arg(script).output().unwrap();
        stdout_ok(&out, words)
    };
    assert_eq!(
        complete("tandem rollout --max-new", "_tandem"),
        "--max-new-tokens\n"
    );
    assert_eq!(
        complete("ref-logprob --tem", "_ref__logprob"),
        "--temperature\n"
    );
    let out = tandem(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn man_pages_name_the_stage_flags() {
    let page = stdout_ok(&tandem(&["man", "rollout"]), "man rollout");
    assert!(page.contains(".TH rollout 1"), "{page}");
    for flag in ["max\\-new\\-tokens", "temperature", "daemon"] {
        assert!(page.contains(&format!("\\fB\\-\\-{flag}\\fR")), "{flag}");
    }
    let tandem_page = stdout_ok(&tandem(&["man"]), "man");
    assert!(tandem_page.contains(".TH tandem 1"));
    assert!(tandem_page.contains("sync\\-weights"));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("man1");
    stdout_ok(&tandem(&["man", "--out", p(&out)]), "man --out");
    for name in binaries() {
        let page = std::fs::read_to_string(out.join(format!("{name}.1"))).unwrap();
        assert!(page.contains(&format!(".TH {name} 1")), "{name}");
    }
    let plot = std::fs::read_to_string(out.join("tandem-plot.1")).unwrap();
    assert!(plot.contains("\\-\\-out"), "{plot}");
    assert!(!out.join("tandem-rollout.1").exists());

    let bad = tandem(&["man", "nope"]);
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("no page 'nope'") && err.contains("rollout"),
        "{err}"
    );
}

#[test]
fn version_names_the_git_commit() {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    // Outside a git checkout (a tarball) the build says so.
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or("unknown".into());
    let version = env!("CARGO_PKG_VERSION");
    for name in binaries().iter().map(String::as_str).chain(["tandem"]) {
        let out = Command::new(bin_path(name))
            .arg("--version")
            .output()
            .unwrap();
        let line = stdout_ok(&out, name);
        let prefix = format!("{name} {version} ({commit}");
        assert!(line.starts_with(&prefix), "{name}: {line:?} vs {prefix:?}");
        let rest = line.trim_end().strip_prefix(&prefix).unwrap();
        assert!(["-dirty)", ")"].contains(&rest), "{name}: {line:?}");
    }
}

/// A run directory with `steps` metrics lines (no KL term) and an evaluation every 5 steps.
fn fake_run(dir: &Path, steps: u32, slope: f64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut metrics = String::new();
    let mut evals = String::new();
    for s in 1..=steps {
        let acc = (0.1 + slope * s as f64).min(1.0);
        metrics += &format!(
            "{{\"step\":{s},\"reward/mean\":{acc},\"accuracy\":{acc},\"entropy\":1.0,\"response_length/mean\":4.0,\"time/step\":0.5}}\n"
        );
        if s % 5 == 0 {
            evals += &format!("{{\"step\":{s},\"accuracy\":{acc}}}\n");
        }
    }
    std::fs::write(dir.join("metrics.jsonl"), metrics).unwrap();
    std::fs::write(dir.join("eval.jsonl"), evals).unwrap();
}

#[test]
fn plot_overlays_runs_and_refuses_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("runs/a"), dir.path().join("runs/b"));
    fake_run(&a, 20, 0.02);
    fake_run(&b, 30, 0.03);
    let out = dir.path().join("both.png");
    let o = tandem(&["plot", p(&a), p(&b), "--out", p(&out)]);
    assert_eq!(stdout_ok(&o, "plot a b").trim(), p(&out));
    assert_eq!(&std::fs::read(&out).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    // Without --out: plot.png in the current directory.
    let o = Command::new(TANDEM)
        .args(["plot", "runs/a", "runs/b"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    stdout_ok(&o, "plot runs/a runs/b");
    assert!(dir.path().join("plot.png").exists());

    // A directory that is not a run: exit 2 naming it, nothing written.
    let bad = dir.path().join("runs/typo");
    let out = dir.path().join("none.png");
    let o = tandem(&["plot", p(&a), p(&bad), "--out", p(&out)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "{}: no metrics.jsonl or eval.jsonl lines",
            p(&bad)
        )),
        "{err}"
    );
    assert!(!out.exists());
    let junk = dir.path().join("runs/junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("metrics.jsonl"), "{\"step\":1}\nnot json\n").unwrap();
    let o = tandem(&["plot", p(&junk), p(&a), "--out", p(&out)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("junk/metrics.jsonl:2: not a JSON object"),
        "{err}"
    );
    assert!(!out.exists());
}
