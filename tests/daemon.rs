//! The warm daemon on the CPU backend, with the real binaries: the same stage commands give
//! byte-identical batch files and checkpoints in-process and as clients of the daemon (with and
//! without the offload options), bad input fails the same way, and the daemon survives
//! malformed requests and stops cleanly on `shutdown` and SIGTERM.

use crate::stage_util;

use stage_util::{add_advantages, prompts, tiny_model};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

fn bin(name: &str) -> &'static str {
    match name {
        "rollout" => env!("CARGO_BIN_EXE_rollout"),
        "ref-logprob" => env!("CARGO_BIN_EXE_ref-logprob"),
        "update" => env!("CARGO_BIN_EXE_update"),
        "sync-weights" => env!("CARGO_BIN_EXE_sync-weights"),
        other => panic!("no binary {other}"),
    }
}

/// Runs a stage in `cwd`, as a client of `daemon` when given.
fn stage(cwd: &Path, name: &str, args: &[&str], daemon: Option<&Path>) -> Output {
    let mut cmd = Command::new(bin(name));
    cmd.current_dir(cwd)
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("TANDEM_DAEMON");
    if let Some(d) = daemon {
        cmd.arg("--daemon").arg(d);
    }
    cmd.output().expect("spawn")
}

fn ok(cwd: &Path, name: &str, args: &[&str], daemon: Option<&Path>) -> Output {
    let out = stage(cwd, name, args, daemon);
    assert!(
        out.status.success(),
        "{name} {args:?} (daemon {daemon:?}) failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A daemon process, stopped (SIGKILL as a last resort) when dropped.
pub(crate) struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    pub(crate) fn start(cwd: &Path, socket: &Path, policy: &str, extra: &[&str]) -> Daemon {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(TANDEM);
        // SAFETY: prctl only; a killed test binary takes its daemon down with it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .current_dir(cwd)
            .args(["daemon", "--device", "cpu", "--socket"])
            .arg(socket)
            .args(["--policy", policy])
            .args(extra)
            .env("RAYON_NUM_THREADS", "2")
            .spawn()
            .expect("spawn daemon");
        let mut d = Daemon {
            child,
            socket: socket.to_path_buf(),
        };
        d.wait_healthy();
        d
    }

    fn wait_healthy(&mut self) {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(120) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the daemon exited at start: {status}");
            }
            if let Ok(lines) = exchange(&self.socket, r#"{"type":"health"}"#, 1) {
                assert!(lines[0].contains(r#""ok":true"#), "{lines:?}");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("daemon at {} never became healthy", self.socket.display());
    }

    pub(crate) fn status(&self) -> serde_json::Value {
        let lines = exchange(&self.socket, r#"{"type":"status"}"#, 1).unwrap();
        let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        v["status"].clone()
    }

    /// Waits for the process to exit by itself; its exit code.
    fn wait_exit(&mut self) -> Option<i32> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("daemon did not stop");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends one raw line and reads `n` answer lines.
fn exchange(socket: &Path, line: &str, n: usize) -> std::io::Result<Vec<String>> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    let mut r = BufReader::new(s);
    let mut out = Vec::new();
    for _ in 0..n {
        let mut l = String::new();
        r.read_line(&mut l)?;
        out.push(l.trim_end().to_string());
    }
    Ok(out)
}

/// Files of the two-step flow whose bytes must not depend on where the compute ran.
const OUTPUTS: &[&str] = &[
    "r1.parquet",
    "ref1.parquet",
    "old1.parquet",
    "ckpt1/model.safetensors",
    "ckpt1/optimizer.safetensors",
    "ckpt1/trainer_state.json",
    "policy",
    "r2.parquet",
    "ref2.parquet",
    "old2.parquet",
    "ckpt2/model.safetensors",
    "ckpt2/optimizer.safetensors",
    "ckpt2/trainer_state.json",
];

/// Two GRPO-like steps (rollout, ref and old log-probs, update with a KL loss over several
/// mini-batches, sync) in `w`, with relative paths, optionally through a daemon.
fn two_steps(w: &Path, daemon: Option<&Path>) {
    ok(
        w,
        "sync-weights",
        &["--from", "model", "--to", "policy", "--policy-version", "0"],
        daemon,
    );
    for step in 1..=2 {
        let f = |n: &str| format!("{n}{step}.parquet");
        let seed = (10 + step).to_string();
        ok(
            w,
            "rollout",
            &[
                "--model",
                "policy",
                "--in",
                "prompts.parquet",
                "--out",
                &f("r"),
                "--n",
                "2",
                "--max-new-tokens",
                "6",
                // ref-logprob and update take their log-probs at it (recorded in the batch).
                "--temperature",
                "0.8",
                "--seed",
                &seed,
                "--step",
                &step.to_string(),
                "--metrics",
                &format!("r{step}.json"),
            ],
            daemon,
        );
        ok(
            w,
            "ref-logprob",
            &[
                "--model",
                "model",
                "--in",
                &f("r"),
                "--out",
                &f("ref"),
                "--column",
                "ref_logprobs",
            ],
            daemon,
        );
        ok(
            w,
            "ref-logprob",
            &[
                "--model",
                "policy",
                "--in",
                &f("ref"),
                "--out",
                &f("old"),
                "--column",
                "old_logprobs",
            ],
            daemon,
        );
        add_advantages(&w.join(f("old")), &w.join(f("adv")));
        let ckpt = format!("ckpt{step}");
        ok(
            w,
            "update",
            &[
                "--model",
                "policy",
                "--in",
                &f("adv"),
                "--out-model",
                &ckpt,
                "--use-kl-loss",
                "--kl-loss-coef",
                "0.1",
                "--lr",
                "0.01",
                "--mini-batch-size",
                "2",
                "--shuffle",
                "--seed",
                &seed,
                "--metrics",
                &format!("u{step}.json"),
            ],
            daemon,
        );
        ok(
            w,
            "sync-weights",
            &[
                "--from",
                &ckpt,
                "--to",
                "policy",
                "--policy-version",
                &step.to_string(),
            ],
            daemon,
        );
    }
}

/// Moves the flow's outputs of `w` into `w/to`.
fn stash(w: &Path, to: &str) {
    let dest = w.join(to);
    std::fs::create_dir_all(&dest).unwrap();
    for name in std::fs::read_dir(w).unwrap() {
        let name = name.unwrap().file_name().into_string().unwrap();
        let keep = ["model", "prompts.parquet", "a", "b", "c", "sock"];
        if keep.contains(&name.as_str()) {
            continue;
        }
        std::fs::rename(w.join(&name), dest.join(&name)).unwrap();
    }
}

/// The flow's outputs in `w` are byte for byte those in `w/a`.
fn same_as_in_process(w: &Path, what: &str) {
    for f in OUTPUTS {
        let a = std::fs::read(w.join("a").join(f)).unwrap();
        let b = std::fs::read(w.join(f)).unwrap();
        assert!(a == b, "{f}: in-process and {what} files differ");
    }
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn daemon_clients_write_the_same_files_as_in_process_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let model = tiny_model(w, 7);
    std::fs::rename(&model, w.join("model")).unwrap();
    prompts(
        &w.join("prompts.parquet"),
        &["one two", "three", "four five six", "seven"],
    );

    two_steps(w, None);
    stash(w, "a");

    // The daemon's socket lives in the work directory; the stages find it through --daemon.
    let sock = w.join("sock");
    let mut daemon = Daemon::start(w, &sock, "model", &[]);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    two_steps(w, Some(&sock));
    same_as_in_process(w, "daemon");

    // The daemon kept the policy across the steps: after the first load it never reloaded.
    for f in ["r2.json", "u1.json", "u2.json"] {
        let m = read_json(&w.join(f));
        assert_eq!(m["daemon"]["reloaded"], false, "{f}: {m}");
        assert!(m["daemon"]["phase_peak_in_use"].is_u64(), "{f}: {m}");
    }
    let status = daemon.status();
    assert_eq!(status["resident"]["policy_version"], 2, "{status}");
    assert_eq!(
        status["resident"]["policy"]["dir"],
        w.join("ckpt2")
            .canonicalize()
            .unwrap()
            .display()
            .to_string()
    );
    assert_eq!(status["resident"]["policy"]["schedule_step"], 2);
    assert!(
        status["resident"]["phases"]["update"]["runs"] == 2,
        "{status}"
    );

    // sync-weights reports the in-memory sync; a checkpoint rewritten behind the daemon's back
    // (here by an in-process update) is reloaded, not served stale.
    let sync = ok(
        w,
        "sync-weights",
        &["--from", "ckpt2", "--to", "policy", "--policy-version", "3"],
        Some(&sock),
    );
    let text = String::from_utf8_lossy(&sync.stderr);
    assert!(text.contains("daemon took the policy in memory"), "{text}");
    assert_eq!(daemon.status()["resident"]["policy_version"], 3);
    std::thread::sleep(Duration::from_millis(20));
    ok(
        w,
        "update",
        &[
            "--model",
            "ckpt1",
            "--in",
            "adv2.parquet",
            "--out-model",
            "ckpt2",
            "--lr",
            "0.5",
        ],
        None,
    );
    let args = [
        "--model",
        "ckpt2",
        "--in",
        "prompts.parquet",
        "--out",
        "r3.parquet",
        "--n",
        "1",
        "--max-new-tokens",
        "2",
        "--metrics",
        "r3.json",
    ];
    ok(w, "rollout", &args, Some(&sock));
    assert_eq!(read_json(&w.join("r3.json"))["daemon"]["reloaded"], true);
    ok(w, "rollout", &args, Some(&sock));
    assert_eq!(read_json(&w.join("r3.json"))["daemon"]["reloaded"], false);

    // shutdown: the daemon exits 0 and removes its socket.
    let lines = exchange(&sock, r#"{"type":"shutdown"}"#, 1).unwrap();
    assert!(lines[0].contains("shutting-down"), "{lines:?}");
    assert_eq!(daemon.wait_exit(), Some(0));
    assert!(!sock.exists());
    stash(w, "b");

    // With the optimizer and the reference parked in host memory: the same files again.
    let _daemon = Daemon::start(
        w,
        &sock,
        "model",
        &["--ref", "model", "--offload-optimizer", "--offload-ref"],
    );
    two_steps(w, Some(&sock));
    same_as_in_process(w, "daemon (offload)");
    let st = _daemon.status();
    assert_eq!(
        st["resident"]["policy"]["optimizer_offloaded"], true,
        "{st}"
    );
    assert_eq!(st["resident"]["reference"]["offloaded"], true, "{st}");
    stash(w, "c");

    // The flow did train: step 2's policy is not the initial model.
    let m0 = std::fs::read(w.join("model/model.safetensors")).unwrap();
    let m2 = std::fs::read(w.join("a/ckpt2/model.safetensors")).unwrap();
    assert_ne!(m0, m2);
}

#[test]
fn bad_input_fails_the_same_way_and_the_daemon_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let model = tiny_model(w, 3);
    std::fs::rename(&model, w.join("model")).unwrap();
    prompts(&w.join("prompts.parquet"), &["hello"]);
    let sock = w.join("sock");
    let mut daemon = Daemon::start(w, &sock, "model", &[]);

    // Input errors: exit 2 and the very message of in-process mode.
    let cases: [(&str, Vec<&str>); 3] = [
        (
            "update",
            vec![
                "--model",
                "model",
                "--in",
                "prompts.parquet",
                "--out-model",
                "o",
            ],
        ),
        (
            "rollout",
            vec![
                "--model",
                "nope",
                "--in",
                "prompts.parquet",
                "--out",
                "r.parquet",
            ],
        ),
        (
            "ref-logprob",
            vec![
                "--model",
                "model",
                "--in",
                "missing.parquet",
                "--out",
                "x.parquet",
                "--column",
                "ref_logprobs",
            ],
        ),
    ];
    for (name, args) in &cases {
        let here = stage(w, name, args, None);
        let there = stage(w, name, args, Some(&sock));
        assert_eq!(here.status.code(), Some(2), "{name}");
        assert_eq!(there.status.code(), Some(2), "{name}");
        assert_eq!(
            String::from_utf8_lossy(&here.stderr),
            String::from_utf8_lossy(&there.stderr),
            "{name}"
        );
    }
    assert!(!w.join("o").exists() && !w.join("r.parquet").exists());

    // A device the daemon does not have is refused as bad input.
    let wrong = stage(
        w,
        "rollout",
        &[
            "--model",
            "model",
            "--in",
            "prompts.parquet",
            "--out",
            "r.parquet",
            "--device",
            "cuda:1",
        ],
        Some(&sock),
    );
    assert_eq!(wrong.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("the daemon runs on cpu"));

    // Malformed requests get an error line; the daemon goes on serving.
    for bad in [
        "garbage",
        r#"{"type":"job","cwd":"/"}"#,
        r#"{"type":"nap"}"#,
    ] {
        let lines = exchange(&sock, bad, 1).unwrap();
        let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(v["type"], "error", "{bad}: {v}");
        assert!(v["message"].as_str().unwrap().contains("malformed request"));
    }
    // TANDEM_DAEMON works like --daemon.
    let out = Command::new(bin("rollout"))
        .current_dir(w)
        .args([
            "--model",
            "model",
            "--in",
            "prompts.parquet",
            "--out",
            "r.parquet",
            "--n",
            "1",
            "--max-new-tokens",
            "3",
        ])
        .env("TANDEM_DAEMON", &sock)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("rollout: 1 prompts x 1"));
    // A temperature other than the one rollout recorded is refused the same way.
    let args = [
        "--model",
        "model",
        "--in",
        "r.parquet",
        "--out",
        "lp.parquet",
        "--column",
        "old_logprobs",
        "--temperature",
        "0.5",
    ];
    let here = stage(w, "ref-logprob", &args, None);
    let there = stage(w, "ref-logprob", &args, Some(&sock));
    let msg = String::from_utf8_lossy(&there.stderr);
    assert_eq!(
        (here.status.code(), there.status.code()),
        (Some(2), Some(2))
    );
    assert_eq!(String::from_utf8_lossy(&here.stderr), msg);
    assert!(
        msg.contains("r.parquet: rollout sampled this batch at temperature 1"),
        "{msg}"
    );
    assert!(!w.join("lp.parquet").exists());
    let st = daemon.status();
    assert_eq!(st["jobs_done"], 1, "{st}");
    assert!(st["jobs_failed"].as_u64().unwrap() >= 4, "{st}");

    // The raw protocol: a job request streams progress and log lines, then `done`.
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: tandem::stage::rollout::RolloutArgs,
    }
    let cli = <Cli as clap::Parser>::parse_from([
        "rollout",
        "--model",
        "model",
        "--in",
        "prompts.parquet",
        "--out",
        "raw.parquet",
        "--n",
        "3",
        "--max-new-tokens",
        "2",
    ]);
    let req = tandem::daemon::protocol::Request::Job {
        cwd: w.to_path_buf(),
        job: Box::new(tandem::stage::StageJob::Rollout(cli.args)),
    };
    let mut s = UnixStream::connect(&sock).unwrap();
    writeln!(s, "{}", serde_json::to_string(&req).unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // The connection stays open for more requests: read up to the job's last line.
    let mut lines: Vec<serde_json::Value> = Vec::new();
    for l in BufReader::new(s).lines() {
        let v: serde_json::Value = serde_json::from_str(&l.unwrap()).unwrap();
        let end = v["type"] == "done" || v["type"] == "error";
        lines.push(v);
        if end {
            break;
        }
    }
    let kinds: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.last(), Some(&"done"), "{lines:?}");
    assert!(kinds.contains(&"log"), "{lines:?}");
    let last_progress = lines
        .iter()
        .rev()
        .find(|l| l["type"] == "progress")
        .unwrap();
    assert_eq!(
        (
            &last_progress["what"],
            &last_progress["pos"],
            &last_progress["len"]
        ),
        (
            &serde_json::json!("rollout"),
            &serde_json::json!(3),
            &serde_json::json!(3)
        ),
        "{lines:?}"
    );
    assert!(w.join("raw.parquet").exists());

    // Two clients at once: one job runs, the other waits its turn; both finish.
    let both: Vec<Child> = ["q1.parquet", "q2.parquet"]
        .iter()
        .map(|out| {
            Command::new(bin("rollout"))
                .current_dir(w)
                .args([
                    "--model",
                    "model",
                    "--in",
                    "prompts.parquet",
                    "--out",
                    out,
                    "--n",
                    "2",
                    "--max-new-tokens",
                    "4",
                    "--daemon",
                ])
                .arg(&sock)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in both {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // Same inputs and seed: the same samples, whichever ran first.
    assert_eq!(
        std::fs::read(w.join("q1.parquet")).unwrap(),
        std::fs::read(w.join("q2.parquet")).unwrap()
    );

    // Another user is refused by its peer credentials, even where the file mode would let it
    // connect (only testable as root: widen the modes, connect as `nobody`).
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        for p in [w, sock.as_path()] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        let other = Command::new(TANDEM)
            .args(["daemon-ctl", "--socket"])
            .arg(&sock)
            .arg("status")
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&other.stderr);
        assert!(!other.status.success(), "{err}");
        assert!(err.contains("serves only its own user"), "{err}");
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    // SIGTERM: clean stop, socket removed.
    unsafe {
        libc::kill(daemon.child.id() as i32, libc::SIGTERM);
    }
    assert_eq!(daemon.wait_exit(), Some(0));
    assert!(!sock.exists());

    // No daemon: a clear input error.
    let gone = stage(
        w,
        "rollout",
        &[
            "--model",
            "model",
            "--in",
            "prompts.parquet",
            "--out",
            "r.parquet",
        ],
        Some(&sock),
    );
    assert_eq!(gone.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("cannot connect"));
}

/// Every file of a directory, by name.
fn dir_files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|f| {
            let f = f.unwrap();
            (
                f.file_name().to_string_lossy().into_owned(),
                std::fs::read(f.path()).unwrap(),
            )
        })
        .collect()
}

/// Runs `tandem daemon-ctl ARGS` in `cwd`.
fn ctl(cwd: &Path, args: &[&str]) -> Output {
    Command::new(TANDEM)
        .current_dir(cwd)
        .arg("daemon-ctl")
        .args(args)
        .output()
        .unwrap()
}

/// `update --resident` on the daemon writes no weights, only a marked directory that the
/// daemon serves and in-process stages refuse (exit 2, saying to run `daemon-ctl save`);
/// `daemon-ctl save` writes exactly the files the in-process update writes; a daemon that does
/// not hold the weights refuses the directory.
#[test]
fn resident_weights_stay_on_the_daemon_and_save_writes_the_update_files() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let model = tiny_model(w, 11);
    std::fs::rename(&model, w.join("model")).unwrap();
    prompts(&w.join("prompts.parquet"), &["one two", "three", "four"]);
    ok(
        w,
        "rollout",
        &[
            "--model",
            "model",
            "--in",
            "prompts.parquet",
            "--out",
            "r.parquet",
            "--n",
            "2",
            "--max-new-tokens",
            "5",
            "--seed",
            "4",
        ],
        None,
    );
    add_advantages(&w.join("r.parquet"), &w.join("adv.parquet"));
    let update = |out: &str, extra: &[&str], daemon: Option<&Path>| {
        let mut args = vec![
            "--model",
            "model",
            "--in",
            "adv.parquet",
            "--out-model",
            out,
            "--lr",
            "0.01",
            "--mini-batch-size",
            "3",
            "--metrics",
            "u.json",
        ];
        args.extend_from_slice(extra);
        stage(w, "update", &args, daemon)
    };
    // The reference: the in-process update's files.
    let o = update("m1", &[], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = dir_files(&w.join("m1"));
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "tokenizer.json",
    ] {
        assert!(want.contains_key(f), "{f}: {:?}", want.keys());
    }

    // --resident needs a daemon.
    let o = update("nope", &["--resident"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(
            "--resident keeps the new weights in the warm daemon's memory: it needs --daemon"
        ),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!w.join("nope").exists());

    let sock = w.join("sock");
    let daemon = Daemon::start(w, &sock, "model", &[]);
    // In place, it would leave the model with no weight files: refused.
    let o = update("model", &["--resident"], Some(&sock));
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("would replace the model that --model names"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(w.join("model/model.safetensors").is_file());
    let o = update("r1", &["--resident"], Some(&sock));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = read_json(&w.join("u.json"));
    assert_eq!(
        (&m["weights_saved"], &m["optimizer_state_saved"]),
        (&serde_json::json!(false), &serde_json::json!(false)),
        "{m}"
    );
    // Config and tokenizer (what the next stages read), the marker, no weights.
    let r1 = dir_files(&w.join("r1"));
    assert!(r1.contains_key("resident.json") && r1.contains_key("tokenizer.json"));
    assert_eq!(r1["config.json"], want["config.json"]);
    assert!(
        !r1.keys().any(|k| k.ends_with(".safetensors")),
        "{:?}",
        r1.keys()
    );
    let marker: serde_json::Value = serde_json::from_slice(&r1["resident.json"]).unwrap();
    assert_eq!(marker["step"], 1, "{marker}");
    assert_eq!(marker["from_policy_version"], 0, "{marker}");
    assert_eq!(
        marker["socket"],
        sock.canonicalize().unwrap().display().to_string()
    );
    assert_eq!(daemon.status()["resident"]["policy"]["in_files"], false);

    // In-process stages refuse it: exit 2, nothing written, and the way out named.
    let refusals: [(&str, Vec<&str>); 3] = [
        (
            "rollout",
            vec![
                "--model",
                "r1",
                "--in",
                "prompts.parquet",
                "--out",
                "x.parquet",
            ],
        ),
        (
            "update",
            vec!["--model", "r1", "--in", "adv.parquet", "--out-model", "x"],
        ),
        ("sync-weights", vec!["--from", "r1", "--to", "xp"]),
    ];
    for (name, args) in &refusals {
        let o = stage(w, name, args, None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(
            err.contains("r1: holds no weight files")
                && err.contains("tandem daemon-ctl save --socket"),
            "{name}: {err}"
        );
    }
    assert!(!w.join("x.parquet").exists() && !w.join("x").exists() && !w.join("xp").exists());

    // The daemon serves it: publish, then generate without loading anything.
    ok(
        w,
        "sync-weights",
        &["--from", "r1", "--to", "policy", "--policy-version", "1"],
        Some(&sock),
    );
    let roll = [
        "--model",
        "policy",
        "--in",
        "prompts.parquet",
        "--out",
        "r2.parquet",
        "--n",
        "1",
        "--max-new-tokens",
        "3",
        "--metrics",
        "r2.json",
    ];
    ok(w, "rollout", &roll, Some(&sock));
    assert_eq!(read_json(&w.join("r2.json"))["daemon"]["reloaded"], false);

    // daemon-ctl save: the files of the in-process update, bit for bit.
    let o = ctl(w, &["save", "--socket", "sock", "--out", "s1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let saved = dir_files(&w.join("s1"));
    assert_eq!(
        saved.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, v) in &want {
        assert!(
            v == &saved[k],
            "{k}: daemon-ctl save differs from the in-process update"
        );
    }
    // --out without a command, and --model naming what the daemon does not hold.
    let o = ctl(w, &["save", "--socket", "sock"]);
    assert_eq!(o.status.code(), Some(2));
    std::fs::create_dir(w.join("stale")).unwrap();
    std::fs::write(w.join("stale/resident.json"), &r1["resident.json"]).unwrap();
    std::fs::write(w.join("stale/config.json"), &r1["config.json"]).unwrap();
    let o = ctl(
        w,
        &[
            "save", "--socket", "sock", "--model", "stale", "--out", "s2",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("this daemon does not hold them"), "{err}");
    assert!(!w.join("s2").exists());
    // Saved in place: the resident directory becomes the model, still the daemon's policy.
    let o = ctl(
        w,
        &["save", "--socket", "sock", "--model", "r1", "--out", "r1"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(dir_files(&w.join("r1")), want);
    assert_eq!(daemon.status()["resident"]["policy"]["in_files"], true);
    ok(w, "rollout", &roll, Some(&sock));
    assert_eq!(read_json(&w.join("r2.json"))["daemon"]["reloaded"], false);
    // ... and now loads in-process too.
    ok(w, "rollout", &roll, None);

    // A second resident step; a restarted daemon does not hold it and says so.
    let o = Command::new(bin("update"))
        .current_dir(w)
        .args([
            "--model",
            "r1",
            "--in",
            "adv.parquet",
            "--out-model",
            "r2",
            "--lr",
            "0.01",
            "--resident",
            "--daemon",
        ])
        .arg(&sock)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    drop(daemon);
    let _again = Daemon::start(w, &sock, "model", &[]);
    let o = stage(
        w,
        "rollout",
        &[
            "--model",
            "r2",
            "--in",
            "prompts.parquet",
            "--out",
            "x.parquet",
        ],
        Some(&sock),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("r2: its weights were kept in memory by update --resident (step 2")
            && err.contains("this daemon does not hold them"),
        "{err}"
    );
}

/// Every file of every checkpoint of a run, by content.
fn checkpoint_files(run: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    for ck in std::fs::read_dir(run.join("ckpt")).unwrap() {
        let ck = ck.unwrap();
        for f in std::fs::read_dir(ck.path()).unwrap() {
            let f = f.unwrap();
            let name = format!(
                "{}/{}",
                ck.file_name().to_string_lossy(),
                f.file_name().to_string_lossy()
            );
            out.insert(name, std::fs::read(f.path()).unwrap());
        }
    }
    out
}

/// `daemon = true`: the runner starts the daemon, routes the model stages through it, restarts
/// it when it is killed (SIGKILL in the middle of an update) and stops it at the end; the run
/// ends with the same checkpoints, bit for bit, as a run without a daemon. The daemon writes
/// checkpoints (weights and optimizer state) only on the cadence (steps 2 and 4) and at the
/// last step, keeping the policy resident in between; a daemon killed in step 4, or a runner
/// killed in step 4 (its daemon dies with it), while step 3's policy lived only in the
/// daemon's memory, sends the run back to step 2.
#[test]
fn pipeline_with_a_daemon_survives_its_death_and_matches_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 5);
    std::fs::rename(&model, d.join("model")).unwrap();
    let tandem = |args: &[&str]| {
        let o = Command::new(TANDEM)
            .args(args)
            .current_dir(d)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    for (n, seed, split, out) in [
        ("40", "1", "train", "train.parquet"),
        ("8", "2", "test", "val.parquet"),
    ] {
        tandem(&[
            "prepare", "synth", "--task", "add", "--digits", "1", "--n", n, "--seed", seed,
            "--split", split, "--out", out,
        ]);
    }
    let spec = r#"
seed = 3
steps = 5
daemon = DAEMON
[model]
path = "model"
[data]
train = "train.parquet"
val = "val.parquet"
prompts-per-step = 4
[rollout]
n = 4
temperature = 1.0
max-new-tokens = 12
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.01
use-kl-loss = true
ppo-epochs = 2
mini-batch-size = 8
[eval]
every = 2
[checkpoint]
every = 2
keep-last = 3
"#;
    std::fs::write(d.join("plain.toml"), spec.replace("DAEMON", "false")).unwrap();
    std::fs::write(d.join("warm.toml"), spec.replace("DAEMON", "true")).unwrap();
    let bins = Path::new(TANDEM).parent().unwrap();
    let run_steps = |spec: &str, run: &str, kill_marker: Option<(&Path, u64)>, steps: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_pipeline"));
        c.current_dir(d)
            .args(["run", spec, "--run-dir", run])
            .args(steps)
            .env("TANDEM_BIN_DIR", bins)
            .env("RAYON_NUM_THREADS", "2")
            .env_remove("TANDEM_DAEMON");
        if let Some((m, step)) = kill_marker {
            c.env(tandem::daemon::resident::KILL_IN_UPDATE_ENV, m)
                .env(tandem::daemon::resident::KILL_AT_STEP_ENV, step.to_string());
        }
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{run}: {err}");
        err
    };
    let run = |spec: &str, run: &str, kill_marker| run_steps(spec, run, kill_marker, &[]);
    run("plain.toml", "a", None);
    // b: killed in step 1's update (the policy is the initial model: the stage runs again on
    // a new daemon); c: killed in step 4's update (step 3's optimizer state is lost with it).
    let marker = d.join("killed-once");
    let log = run("warm.toml", "b", Some((&marker, 1)));
    assert!(marker.exists(), "the daemon was never killed");
    assert!(log.contains("the daemon died"), "{log}");
    assert!(!log.contains("going back"), "{log}");
    // The stage's client said what happened in the documented words (in the run's log, and in
    // the runner's line on the console).
    let plog = std::fs::read_to_string(d.join("b/pipeline.log")).unwrap();
    let said = "the daemon closed the connection before the update job finished";
    assert!(plog.contains(said) && log.contains(said), "{log}\n{plog}");
    assert!(
        !plog.contains("os error") && !log.contains("os error"),
        "{plog}"
    );
    let marker_c = d.join("killed-in-step-4");
    let log_c = run("warm.toml", "c", Some((&marker_c, 4)));
    assert!(marker_c.exists(), "the daemon of run c was never killed");
    assert!(
        log_c.contains("the policy after step 3 (weights and optimizer state) was only in the daemon's memory; going back to step 2"),
        "{log_c}"
    );

    // e: the runner itself SIGKILLed between checkpoints: step 4 under way, step 3's policy
    // resident (its directory holds only the marker), the daemon gone with the runner.
    // Resuming goes back to step 2.
    let e = d.join("e");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pipeline"))
        .current_dir(d)
        .args(["run", "warm.toml", "--run-dir", "e"])
        .env("TANDEM_BIN_DIR", bins)
        .env("RAYON_NUM_THREADS", "2")
        .env_remove("TANDEM_DAEMON")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let in_step_4 = || {
        let Ok(t) = std::fs::read_to_string(e.join("state.json")) else {
            return false;
        };
        serde_json::from_str::<serde_json::Value>(&t).is_ok_and(|s| {
            s["current"]["step"] == 4
                && s["current"]["done"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|x| x == "rollout"))
        })
    };
    let t0 = Instant::now();
    while !in_step_4() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "run e ended before step 4"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "run e never reached step 4"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let ck3 = e.join("ckpt/step-0003");
    assert!(ck3.join("resident.json").is_file());
    assert!(!ck3.join("model.safetensors").exists());
    assert!(
        !e.join("ckpt/step-0004").exists(),
        "step 4's update ran before the kill"
    );
    let log_e = run("warm.toml", "e", None);
    assert!(log_e.contains("going back to step 2"), "{log_e}");

    let a = d.join("a");
    let ca = checkpoint_files(&a);
    let kept: Vec<&String> = ca
        .keys()
        .filter(|k| k.ends_with("optimizer.safetensors"))
        .collect();
    assert_eq!(
        kept,
        [
            "step-0002/optimizer.safetensors",
            "step-0004/optimizer.safetensors",
            "step-0005/optimizer.safetensors"
        ]
    );
    for other in ["b", "c", "e"] {
        let cb = checkpoint_files(&d.join(other));
        assert_eq!(ca.keys().collect::<Vec<_>>(), cb.keys().collect::<Vec<_>>());
        for (k, v) in &ca {
            assert!(v == &cb[k], "{k} differs between the plain run and {other}");
        }
        assert_eq!(
            std::fs::read(a.join("policy")).unwrap(),
            std::fs::read(d.join(other).join("policy")).unwrap()
        );
        let metrics = std::fs::read_to_string(d.join(other).join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 5, "{metrics}");
    }
    // Between checkpoints the daemon run's update kept the policy resident.
    let commands = std::fs::read_to_string(d.join("b/commands.sh")).unwrap();
    let skipped: Vec<bool> = commands
        .lines()
        .filter(|l| l.contains("/update "))
        .map(|l| l.contains("--resident"))
        .collect();
    // Step 1 twice (killed, then again), 2 and 4 on the cadence, 5 the last.
    assert_eq!(
        skipped,
        [true, true, false, true, false, false],
        "{commands}"
    );
    let b = d.join("b");
    // The model stages went to the daemon, which two processes served; both are gone and the
    // socket is removed.
    let commands = std::fs::read_to_string(b.join("commands.sh")).unwrap();
    assert!(
        commands.contains("update --model b/policy") && commands.contains("--daemon b/daemon.sock")
    );
    assert!(
        commands.contains("clients of the run's daemon"),
        "{commands}"
    );
    let dlog = std::fs::read_to_string(b.join("daemon.log")).unwrap();
    let pids: Vec<u32> = dlog
        .lines()
        .filter_map(|l| l.split("(pid ").nth(1))
        .filter_map(|r| r.split(')').next()?.parse().ok())
        .collect();
    assert_eq!(pids.len(), 2, "{dlog}");
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "daemon {pid} outlived the run"
        );
    }
    assert!(dlog.contains("daemon: stopped"), "{dlog}");
    assert!(!b.join("daemon.sock").exists());
    // The step metrics carry the daemon's view (whether it reloaded, memory per phase).
    let metrics = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("update/daemon/reloaded"), "{metrics}");

    // `tandem bench grpo-step`: both modes train to the same weights; the daemon holds the
    // policy from step to step.
    let o = Command::new(TANDEM)
        .current_dir(d)
        .args([
            "bench",
            "grpo-step",
            "--model",
            "model",
            "--prompts",
            "train.parquet",
            "--work",
            "bench",
            "--prompts-per-step",
            "2",
            "--n",
            "2",
            "--max-new-tokens",
            "6",
            "--raw-prompt",
        ])
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), 4, "{json}");
    assert_eq!(results[3]["daemon"]["rollout"]["reloaded"], false, "{json}");
    assert_eq!(results[3]["daemon"]["update"]["reloaded"], false, "{json}");
    assert_eq!(
        std::fs::read(d.join("bench/in-process/ckpt-2/model.safetensors")).unwrap(),
        std::fs::read(d.join("bench/daemon/ckpt-2/model.safetensors")).unwrap()
    );
    // The daemon keeps the optimizer state in memory (no --checkpoint-every): not written.
    assert!(d
        .join("bench/in-process/ckpt-2/optimizer.safetensors")
        .is_file());
    assert!(!d.join("bench/daemon/ckpt-2/optimizer.safetensors").exists());
    assert_eq!(results[3]["optimizer_saved"], false, "{json}");
}

/// Polls the daemon's status until `cond` holds (at most 120 s).
fn wait_status(d: &Daemon, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let t0 = Instant::now();
    loop {
        let st = d.status();
        if cond(&st) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}: {st}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `kill -9` of a client mid-job: the daemon notices the closed connection, stops the job
/// within a step, writes nothing, and serves the next client with a policy untouched by the
/// cancelled training (its result equals an in-process update's, byte for byte). A daemon
/// killed mid-job gives its client the documented message.
#[test]
fn a_killed_clients_job_is_cancelled_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let model = tiny_model(w, 11);
    std::fs::rename(&model, w.join("model")).unwrap();
    let questions: Vec<String> = (0..8).map(|i| format!("question number {i}")).collect();
    let questions: Vec<&str> = questions.iter().map(String::as_str).collect();
    prompts(&w.join("prompts.parquet"), &questions);
    let rollout = |out: &str, n: &str, tokens: &str| {
        [
            "--model",
            "model",
            "--in",
            "prompts.parquet",
            "--out",
            out,
            "--n",
            n,
            "--max-new-tokens",
            tokens,
            "--ignore-eos",
        ]
        .map(String::from)
    };
    ok(
        w,
        "rollout",
        &rollout("r.parquet", "4", "16")
            .each_ref()
            .map(String::as_str),
        None,
    );
    add_advantages(&w.join("r.parquet"), &w.join("adv.parquet"));
    // Many small optimizer steps: long enough to be killed in the middle.
    let update = |out: &str| {
        [
            "--model",
            "model",
            "--in",
            "adv.parquet",
            "--out-model",
            out,
            "--lr",
            "0.001",
            "--ppo-epochs",
            "40",
            "--mini-batch-size",
            "4",
        ]
        .map(String::from)
    };
    let sock = w.join("sock");
    let daemon = Daemon::start(w, &sock, "model", &[]);

    let mut client = Command::new(bin("update"))
        .current_dir(w)
        .args(update("cancelled"))
        .arg("--daemon")
        .arg(&sock)
        .env("RAYON_NUM_THREADS", "2")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_status(&daemon, "the update to run", |st| st["running"] == "update");
    std::thread::sleep(Duration::from_millis(300));
    client.kill().unwrap();
    let killed = Instant::now();
    client.wait().unwrap();
    wait_status(&daemon, "the job to be cancelled", |st| {
        st["jobs_cancelled"] == 1 && st["running"].is_null()
    });
    let stopped = killed.elapsed();
    assert!(
        !w.join("cancelled").exists(),
        "the cancelled job wrote its model"
    );

    // The daemon serves the next client: the same job, to its end, gives what an in-process
    // update gives (the cancelled training left nothing behind in memory).
    let t0 = Instant::now();
    ok(
        w,
        "update",
        &update("next").each_ref().map(String::as_str),
        Some(&sock),
    );
    let full = t0.elapsed();
    ok(
        w,
        "update",
        &update("here").each_ref().map(String::as_str),
        None,
    );
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            std::fs::read(w.join("next").join(f)).unwrap()
                == std::fs::read(w.join("here").join(f)).unwrap(),
            "{f}: the daemon's update after a cancelled one differs from in-process"
        );
    }
    eprintln!("cancelled {stopped:?} after the kill; a whole job takes {full:?}");
    assert!(
        stopped * 3 < full,
        "the cancelled job ran on: stopped {stopped:?} after the kill, a whole job takes {full:?}"
    );
    let st = daemon.status();
    assert_eq!(
        (st["jobs_failed"].as_u64(), st["jobs_done"].as_u64()),
        (Some(0), Some(1)),
        "{st}"
    );
    drop(daemon);

    // A daemon that dies mid-job: its client says so in the documented words.
    let mut daemon = Daemon::start(w, &sock, "model", &[]);
    let client = Command::new(bin("rollout"))
        .current_dir(w)
        .args(rollout("long.parquet", "64", "200"))
        .arg("--daemon")
        .arg(&sock)
        .env("RAYON_NUM_THREADS", "2")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_status(&daemon, "the rollout to run", |st| {
        st["running"] == "rollout"
    });
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let out = client.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the daemon closed the connection before the rollout job finished"),
        "{err}"
    );
    assert!(!err.contains("os error"), "{err}");
    assert!(!w.join("long.parquet").exists());
}
