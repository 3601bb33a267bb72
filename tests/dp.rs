//! Data-parallel rollout and ref-logprob through the real binaries under `tandem launch` (CPU
//! ranks): every rank generates or scores its contiguous block of prompts (the n samples of a
//! prompt on one rank) and rank 0 writes one file with the same rows in the same order as one
//! process writes, for 1, 2 and 3 ranks; one rank under the launcher is the plain path; bad
//! input under the launcher is exit 2 naming a rank, with no output file; a pipeline with
//! `gpus = 2` runs end to end on CPU ranks.

use crate::stage_util;

use stage_util::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::batch::{schema, Batch};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// Five prompts: 3 ranks take 2, 2 and 1 of them.
const QUESTIONS: [&str; 5] = [
    "What is 2 + 3?",
    "Name a colour.",
    "Count to three.",
    "Spell cat.",
    "Say hello.",
];

/// `stage args` under `tandem launch --nproc-per-node n`, without the launcher variables of
/// the environment the tests run in.
fn launch(n: usize, stage: &str, args: &[&str]) -> Output {
    let mut c = Command::new(TANDEM);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_JOB_ID",
        "TANDEM_DAEMON",
    ] {
        c.env_remove(k);
    }
    c.env("RAYON_NUM_THREADS", "1")
        .args([
            "launch",
            "--nproc-per-node",
            &n.to_string(),
            "--",
            bin(stage),
        ])
        .args(args)
        .output()
        .unwrap()
}

pub(crate) fn launch_ok(n: usize, stage: &str, args: &[&str]) -> Output {
    let out = launch(n, stage, args);
    assert!(
        out.status.success(),
        "{stage} on {n} ranks failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every column of `b` equal to `a`'s: the integer and text columns exactly, the float lists
/// to 1e-5 (the CPU GEMM blocks rows by the row count of a step, which the split changes).
pub(crate) fn same_rows(a: &Batch, b: &Batch, what: &str) {
    let (ra, rb) = (&a.data, &b.data);
    assert_eq!(
        ra.schema().fields(),
        rb.schema().fields(),
        "{what}: columns"
    );
    assert_eq!(ra.num_rows(), rb.num_rows(), "{what}: rows");
    for field in ra.schema().fields() {
        let name = field.name();
        let close = matches!(
            name.as_str(),
            schema::ROLLOUT_LOGPROBS | "ref_logprobs" | "old_logprobs" | "entropy"
        );
        if close {
            for (i, (x, y)) in f32_rows(a, name).iter().zip(f32_rows(b, name)).enumerate() {
                assert_eq!(x.len(), y.len(), "{what}: {name}, row {i}");
                for (u, v) in x.iter().zip(&y) {
                    assert!((u - v).abs() < 1e-5, "{what}: {name}, row {i}: {u} vs {v}");
                }
            }
        } else {
            assert_eq!(
                ra.column_by_name(name).unwrap().to_data(),
                rb.column_by_name(name).unwrap().to_data(),
                "{what}: column {name}"
            );
        }
    }
}

fn rollout_args<'a>(model: &'a Path, input: &'a Path, out: &'a Path, m: &'a Path) -> Vec<&'a str> {
    vec![
        "--model",
        p(model),
        "--in",
        p(input),
        "--out",
        p(out),
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--seed",
        "11",
        "--metrics",
        p(m),
    ]
}

fn ref_args<'a>(model: &'a Path, input: &'a Path, out: &'a Path) -> Vec<&'a str> {
    vec![
        "--model",
        p(model),
        "--in",
        p(input),
        "--out",
        p(out),
        "--column",
        "ref_logprobs",
        "--entropy",
    ]
}

#[test]
fn rollout_and_ref_logprob_rows_do_not_depend_on_the_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let input = dir.path().join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let d = dir.path();

    // One process, no launcher: the reference rows.
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let one_rows = read(&one);
    assert_eq!(one_rows.num_rows(), 2 * QUESTIONS.len());
    let one_ref = d.join("one-ref.parquet");
    ok("ref-logprob", &ref_args(&model, &one, &one_ref));
    let one_ref_rows = read(&one_ref);

    for n in [1, 2, 3] {
        let (out, m) = (
            d.join(format!("r{n}.parquet")),
            d.join(format!("r{n}.json")),
        );
        launch_ok(n, "rollout", &rollout_args(&model, &input, &out, &m));
        same_rows(&one_rows, &read(&out), &format!("rollout, {n} ranks"));
        let metrics: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
        assert_eq!(metrics["ranks"], n, "{metrics}");
        // The work of every rank is counted once.
        let one_metrics: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&one_m).unwrap()).unwrap();
        assert_eq!(metrics["prefills"], one_metrics["prefills"], "{metrics}");
        // Only rank 0 wrote: no other file beside the output.
        let written: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|f| f.starts_with(&format!("r{n}")))
            .collect();
        assert_eq!(written.len(), 2, "{written:?}");

        // Scoring the one-process rollout on n ranks gives the one-process scores.
        let scored = d.join(format!("ref{n}.parquet"));
        launch_ok(n, "ref-logprob", &ref_args(&model, &one, &scored));
        same_rows(
            &one_ref_rows,
            &read(&scored),
            &format!("ref-logprob, {n} ranks"),
        );
    }
}

/// Fewer prompts than ranks: a rank with no prompt loads nothing and hands over no rows.
#[test]
fn ranks_without_a_prompt_take_part_all_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS[..2]);
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let (three, m) = (d.join("three.parquet"), d.join("three.json"));
    launch_ok(3, "rollout", &rollout_args(&model, &input, &three, &m));
    same_rows(&read(&one), &read(&three), "rollout, 2 prompts on 3 ranks");
    let (ref1, ref3) = (d.join("ref1.parquet"), d.join("ref3.parquet"));
    ok("ref-logprob", &ref_args(&model, &one, &ref1));
    launch_ok(3, "ref-logprob", &ref_args(&model, &one, &ref3));
    same_rows(
        &read(&ref1),
        &read(&ref3),
        "ref-logprob, 2 prompts on 3 ranks",
    );
}

#[test]
fn bad_input_under_the_launcher_is_exit_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let d = dir.path();
    let missing = d.join("missing.parquet");
    let (m, out) = (d.join("m.json"), d.join("out.parquet"));
    for (stage, args) in [
        ("ref-logprob", ref_args(&model, &missing, &out)),
        ("rollout", rollout_args(&model, &missing, &out, &m)),
    ] {
        // The cause once, as the last line, naming the rank (every rank fails on the file;
        // the launcher prints the error, the ranks do not).
        let r = launch(2, stage, &args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{err}");
        let cause = format!("{}: cannot open batch file", missing.display());
        assert_eq!(err.matches(&cause).count(), 1, "{err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("error: rank "), "{err}");
        assert!(last.contains(" failed (exited with code 2): "), "{err}");
        assert!(last.contains(&cause), "{err}");
        assert!(!out.exists() && !m.exists());
    }
    // A prompt file that is no Parquet file: every rank refuses it before generating.
    let no_prompts = d.join("no-prompts.parquet");
    std::fs::write(&no_prompts, "not parquet").unwrap();
    let (out, m) = (d.join("bad.parquet"), d.join("bad.json"));
    let r = launch(3, "rollout", &rollout_args(&model, &no_prompts, &out, &m));
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(err.contains("no-prompts.parquet"), "{err}");
    assert!(!out.exists() && !m.exists());
    // --daemon under a launcher: every rank would send the job; refused.
    let mut args = rollout_args(&model, &no_prompts, &out, &m);
    args.extend(["--daemon", "nowhere.sock"]);
    let r = launch(2, "rollout", &args);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--daemon nowhere.sock under a launcher"),
        "{err}"
    );
    assert!(!out.exists());
}

const PIPELINE: &str = env!("CARGO_BIN_EXE_pipeline");

/// Rank 0 of a group whose rank 1 died stopped naming it: from the launcher's word that rank
/// 1's process is gone, or from its own collective whose connection to rank 1 closed, whichever
/// it saw first.
fn stopped_naming_rank_1(log: &str) -> bool {
    log.lines().any(|l| {
        l.contains("rank 0: stopping: rank 1 (pid")
            || (l.contains("rank 0: stopping: ") && l.contains("the connection to rank 1 closed"))
    })
}

/// The client's message of a group whose rank 1 died names it (rank 0's first word of it,
/// either way, as above).
fn group_failure_names_rank_1(out: &str) -> bool {
    out.lines().any(|l| {
        l.contains("the daemon group failed: rank 1")
            || (l.contains("the daemon group failed: ")
                && l.contains("the connection to rank 1 closed"))
    })
}

/// A two-step GRPO pipeline (mini-batches: several optimizer steps a batch) at `gpus = 1` and
/// `gpus = 2` on the CPU: the `gpus = 2` run starts rollout and update under `tandem launch`
/// (update computes the old log-probs itself, its ranks sharing the rows: no old-logprob
/// stage), its rollouts are shared by 2 ranks, and its first step's samples are the 1-rank
/// run's. With `[update] rollout-rs` the old-logprob stage (ref-logprob) runs under the
/// launcher too. Bad `gpus` / `nodes` values are refused naming the key before anything runs.
/// The two-step GRPO spec of the pipeline tests, with `top` at its top level.
fn spec(top: &str) -> String {
    format!(
        r#"
seed = 3
steps = 2
{top}
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 3
[rollout]
n = 2
max-new-tokens = 6
max-prompt-tokens = 64
raw-prompt = true
[score]
reward = "exact"
[advantage]
estimator = "grpo"
[update]
lr = 0.001
mini-batch-size = 3
"#
    )
}

/// `pipeline run NAME.toml --run-dir NAME` in `d` with `text` as the spec.
fn run_pipeline(d: &Path, name: &str, text: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let bins = Path::new(TANDEM).parent().unwrap();
    std::fs::write(d.join(format!("{name}.toml")), text).unwrap();
    Command::new(PIPELINE)
        .current_dir(d)
        .args(["run", &format!("{name}.toml"), "--run-dir", name])
        .args(extra)
        .env("TANDEM_BIN_DIR", bins)
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("TANDEM_DAEMON")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn pipeline_ok(d: &Path, name: &str, top: &str, env: &[(&str, &str)]) -> Output {
    let o = run_pipeline(d, name, &spec(top), &[], env);
    assert!(
        o.status.success(),
        "{name}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

#[test]
fn a_gpus_2_pipeline_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 20);
    for (name, top) in [("one", ""), ("two", "gpus = 2")] {
        pipeline_ok(d, name, top, &[]);
    }
    let commands = std::fs::read_to_string(d.join("two/commands.sh")).unwrap();
    for stage in ["/rollout ", "/update "] {
        let lines: Vec<&str> = commands.lines().filter(|l| l.contains(stage)).collect();
        assert_eq!(lines.len(), 2, "{stage}: {commands}");
        assert!(
            lines
                .iter()
                .all(|l| l.contains(" launch --nproc-per-node 2 -- ")),
            "{stage}: {commands}"
        );
    }
    // Mini-batches alone run no old-logprob stage: update computes the old log-probs.
    assert!(!commands.contains("/ref-logprob "), "{commands}");
    // score, advantage and sync-weights stay single processes.
    for stage in ["/score ", "/advantage ", "/sync-weights "] {
        assert!(
            commands
                .lines()
                .filter(|l| l.contains(stage))
                .all(|l| !l.contains(" launch ")),
            "{stage}: {commands}"
        );
    }
    let one_cmds = std::fs::read_to_string(d.join("one/commands.sh")).unwrap();
    assert!(!one_cmds.contains(" launch "), "{one_cmds}");
    for step in ["step-0001", "step-0002"] {
        let m: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(d.join("two").join(step).join("metrics/rollout.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(m["ranks"], 2, "{m}");
    }
    // The first step samples from the same model: the same rows.
    let (a, b) = (
        read(&d.join("one/step-0001/rollout.parquet")),
        read(&d.join("two/step-0001/rollout.parquet")),
    );
    same_rows(&a, &b, "step 1 rollout");
    assert!(!d.join("two/step-0002/old.parquet").exists());
    for step in 1..=2 {
        let m = update_metrics(d, "two", step);
        assert_eq!(m["on_policy"], false, "step {step}: {m}");
        assert_eq!(
            m["mismatch"]["source"], "recomputed_old",
            "step {step}: {m}"
        );
    }
    // [update] rollout-rs needs the old_logprobs column: the old-logprob stage runs, under
    // the launcher like the other model stages.
    let rs = spec("gpus = 2").replace(
        "mini-batch-size = 3",
        "mini-batch-size = 3\nrollout-rs = \"token\"",
    );
    let o = run_pipeline(d, "rs", &rs, &["--steps", "1"], &[]);
    assert!(
        o.status.success(),
        "rs: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let commands = std::fs::read_to_string(d.join("rs/commands.sh")).unwrap();
    let old: Vec<&str> = commands
        .lines()
        .filter(|l| l.contains("/ref-logprob "))
        .collect();
    assert_eq!(old.len(), 1, "{commands}");
    assert!(
        old[0].contains(" launch --nproc-per-node 2 -- ")
            && old[0].contains("--column old_logprobs"),
        "{commands}"
    );
    assert!(d.join("rs/step-0001/old.parquet").exists());
    assert_eq!(
        update_metrics(d, "rs", 1)["mismatch"]["source"],
        "old_logprobs"
    );

    for (top, want) in [
        (
            "nodes = 2",
            "nodes = 2: a pipeline runs on one machine for now (nodes = 1)",
        ),
        ("gpus = 0", "gpus must be at least 1"),
    ] {
        let o = run_pipeline(d, "refused", &spec(top), &["--dry-run"], &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{top}: {err}");
        assert!(err.contains(want), "{top}: {err}");
        assert!(!d.join("refused").exists());
    }
}

/// The ranks started by hand with torchrun's variables (no `tandem launch`) share the rollout
/// the same way: rank 0 writes the one-process rows; the other rank writes nothing.
#[test]
fn torchrun_variables_share_the_rollout() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let (out, m) = (d.join("two.parquet"), d.join("two.json"));
    let args = rollout_args(&model, &input, &out, &m);
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(bin("rollout"))
                .args(&args)
                .env("RAYON_NUM_THREADS", "1")
                .env_remove("TANDEM_DAEMON")
                .envs([
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_RANK", r.to_string()),
                    ("LOCAL_WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // Only rank 0 reports the rollout.
    assert!(String::from_utf8_lossy(&outs[0].stderr).contains("rollout: 5 prompts x 2"));
    assert!(!String::from_utf8_lossy(&outs[1].stderr).contains("rollout: 5 prompts"));
    same_rows(&read(&one), &read(&out), "rollout, torchrun variables");
}

/// A daemon group: `tandem launch --nproc-per-node n -- tandem daemon ...` on CPU ranks.
/// Dropping it stops the launcher (and with it every rank).
pub(crate) struct DaemonGroup {
    launcher: std::process::Child,
    socket: PathBuf,
}

impl DaemonGroup {
    pub(crate) fn start(
        cwd: &Path,
        n: usize,
        socket: &Path,
        policy: &Path,
        extra: &[&str],
    ) -> DaemonGroup {
        DaemonGroup::start_with_env(cwd, (n, socket), policy, extra, &[])
    }

    /// [`DaemonGroup::start`] of `n` ranks at `socket`, with `env` set in every rank.
    pub(crate) fn start_with_env(
        cwd: &Path,
        (n, socket): (usize, &Path),
        policy: &Path,
        extra: &[&str],
        env: &[(&str, &Path)],
    ) -> DaemonGroup {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(TANDEM);
        c.envs(env.iter().copied());
        for k in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            c.env_remove(k);
        }
        // SAFETY: prctl only; a killed test takes its daemons down with it.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let launcher = c
            .current_dir(cwd)
            .env("RAYON_NUM_THREADS", "1")
            .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
            .args(["tandem", "daemon", "--device", "cpu", "--socket"])
            .arg(socket)
            .arg("--policy")
            .arg(policy)
            .args(extra)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let g = DaemonGroup {
            launcher,
            socket: socket.to_path_buf(),
        };
        let t0 = std::time::Instant::now();
        while ctl(&g.socket, "health").status.code() != Some(0) {
            assert!(
                t0.elapsed().as_secs() < 60,
                "the daemon group did not come up"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        g
    }
}

impl Drop for DaemonGroup {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
    }
}

/// Polls `daemon-ctl status` of a group until its ranks' statuses satisfy `done` (30 s at
/// most); returns them.
fn wait_ranks(
    socket: &Path,
    what: &str,
    done: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let t0 = std::time::Instant::now();
    loop {
        let st = ctl(socket, "status");
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
        let status: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
        let ranks = status["ranks"].as_array().unwrap().clone();
        if done(&ranks) {
            return ranks;
        }
        assert!(t0.elapsed().as_secs() < 30, "waiting for {what}: {status}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn ctl(socket: &Path, what: &str) -> Output {
    ctl_with(socket, &[what])
}

/// `daemon-ctl --socket SOCKET ARGS...`.
pub(crate) fn ctl_with(socket: &Path, args: &[&str]) -> Output {
    Command::new(TANDEM)
        .args(["daemon-ctl", "--socket", p(socket)])
        .args(args)
        .output()
        .unwrap()
}

/// Two daemons under the launcher serve rollout and ref-logprob together: the same rows as
/// one process, rank 0 at the socket the stages name, rank 1 at SOCKET.rank1 (both 0600),
/// `status` shows both ranks and the jobs each ran, a job sent to rank 1 is refused, bad
/// input is exit 2 with no output, a client killed mid-rollout cancels the job on both ranks,
/// and `shutdown` on rank 1's socket ends the group with exit 0.
#[test]
fn a_daemon_group_serves_rollout_and_ref_logprob_data_parallel() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let (one, one_m) = (d.join("one.parquet"), d.join("one.json"));
    ok("rollout", &rollout_args(&model, &input, &one, &one_m));
    let one_ref = d.join("one-ref.parquet");
    ok("ref-logprob", &ref_args(&model, &one, &one_ref));

    let socket = d.join("g.sock");
    let mut group = DaemonGroup::start(d, 2, &socket, &model, &[]);
    for s in [socket.clone(), d.join("g.sock.rank1")] {
        let mode = std::fs::metadata(&s).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}: {mode:o}", s.display());
    }
    let (two, two_m) = (d.join("two.parquet"), d.join("two.json"));
    let mut args = rollout_args(&model, &input, &two, &two_m);
    args.extend(["--daemon", p(&socket)]);
    ok("rollout", &args);
    same_rows(&read(&one), &read(&two), "rollout on a 2-daemon group");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&two_m).unwrap()).unwrap();
    assert_eq!(m["ranks"], 2, "{m}");
    assert_eq!(m["daemon"]["phase"], "rollout", "{m}");
    let scored = d.join("two-ref.parquet");
    let mut args = ref_args(&model, &one, &scored);
    args.extend(["--daemon", p(&socket)]);
    ok("ref-logprob", &args);
    same_rows(
        &read(&one_ref),
        &read(&scored),
        "ref-logprob on a 2-daemon group",
    );

    // Bad input: refused by every rank, exit 2, nothing written; the group serves on.
    let missing = d.join("missing.parquet");
    let bad_out = d.join("bad.parquet");
    let mut args = ref_args(&model, &missing, &bad_out);
    args.extend(["--daemon", p(&socket)]);
    let err = input_error("ref-logprob", &args, "missing.parquet");
    assert!(!bad_out.exists(), "{err}");
    // Jobs go to rank 0; rank 1's socket takes status and shutdown only.
    let mut args = rollout_args(&model, &input, &bad_out, &two_m);
    let rank1 = d.join("g.sock.rank1");
    args.extend(["--daemon", p(&rank1)]);
    input_error("rollout", &args, "this daemon is rank 1 of a group of 2");

    // A client killed mid-rollout cancels the job on both ranks; nothing is written.
    let long = d.join("long.parquet");
    let mut client = Command::new(bin("rollout"))
        .args(["--model", p(&model), "--in", p(&input), "--out", p(&long)])
        .args(["--n", "16", "--max-new-tokens", "1500", "--ignore-eos"])
        .args(["--daemon", p(&socket)])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_ranks(&socket, "rank 1 to run the rollout", |r| {
        r[1]["running"] == "rollout"
    });
    client.kill().unwrap();
    client.wait().unwrap();
    let t0 = std::time::Instant::now();
    let ranks = wait_ranks(&socket, "both ranks to cancel the job", |r| {
        r.iter()
            .all(|s| s["running"].is_null() && s["jobs_cancelled"] == 1)
    });
    eprintln!("cancelled on both ranks {:?} after the kill", t0.elapsed());
    assert!(!long.exists());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    for (r, s) in ranks.iter().enumerate() {
        assert_eq!(s["rank"], r, "{ranks:?}");
        assert_eq!(s["world_size"], 2, "{ranks:?}");
        assert_eq!(s["jobs_done"], 2, "{ranks:?}");
        assert_eq!(s["jobs_failed"], 1, "{ranks:?}");
    }
    assert_ne!(ranks[0]["pid"], ranks[1]["pid"], "{ranks:?}");

    // shutdown on rank 1's socket ends the whole group, cleanly.
    assert!(ctl(&rank1, "shutdown").status.success());
    let t0 = std::time::Instant::now();
    let code = loop {
        if let Some(s) = group.launcher.try_wait().unwrap() {
            break s.code();
        }
        assert!(t0.elapsed().as_secs() < 30, "the group did not stop");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(code, Some(0));
    assert!(!socket.exists() && !rank1.exists());
}

/// Every file under `dir` (relative path, bytes), sorted.
pub(crate) fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let rel = path.strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// `gpus = 2` with `daemon = true`: the runner starts two daemons under the launcher and the
/// model stages are their clients; the run ends with the same checkpoint and batches as the
/// in-process `gpus = 2` run. Then the same run whose rank 1 daemon SIGKILLs itself in step
/// 2's rollout: rank 0 stops naming rank 1 within the bound, the client says the group
/// failed, the runner starts a new group and reruns the stage, and the run ends with the
/// undisturbed run's files.
#[test]
fn a_gpus_2_daemon_pipeline_runs_and_survives_a_killed_rank() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 20);
    pipeline_ok(d, "launch", "gpus = 2", &[]);
    let t0 = std::time::Instant::now();
    pipeline_ok(d, "group", "gpus = 2\ndaemon = true", &[]);
    let undisturbed = t0.elapsed();
    let commands = std::fs::read_to_string(d.join("group/commands.sh")).unwrap();
    assert!(
        commands.contains(" launch --nproc-per-node 2 -- "),
        "{commands}"
    );
    for stage in ["/rollout ", "/update "] {
        let lines: Vec<&str> = commands.lines().filter(|l| l.contains(stage)).collect();
        assert_eq!(lines.len(), 2, "{stage}: {commands}");
        // The stages are clients of the group: no launcher around them.
        assert!(
            lines
                .iter()
                .all(|l| l.contains("--daemon") && !l.contains(" launch ")),
            "{stage}: {commands}"
        );
    }
    for step in ["step-0001", "step-0002"] {
        let m: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(d.join("group").join(step).join("metrics/rollout.json"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(m["ranks"], 2, "{m}");
        assert!(m["daemon"].is_object(), "{m}");
    }
    // Between checkpoints (every = 0: the last step only) the group keeps the policy resident.
    let updates: Vec<&str> = commands
        .lines()
        .filter(|l| l.contains("/update "))
        .collect();
    assert!(updates[0].contains("--resident"), "{commands}");
    assert!(!updates[1].contains("--resident"), "{commands}");
    let log = std::fs::read_to_string(d.join("group/daemon.log")).unwrap();
    assert!(log.contains("(rank 1 of 2)"), "{log}");
    // Mini-batches alone run no old-logprob stage (update computes the old log-probs on the
    // group's ranks); with [update] rollout-rs it runs, a client of the group too.
    assert!(!commands.contains("/ref-logprob "), "{commands}");
    let rs = spec("gpus = 2\ndaemon = true").replace(
        "mini-batch-size = 3",
        "mini-batch-size = 3\nrollout-rs = \"token\"",
    );
    let o = run_pipeline(d, "rs", &rs, &["--dry-run"], &[]);
    let plan = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{plan}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let old: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains("/ref-logprob "))
        .collect();
    assert_eq!(old.len(), 2, "{plan}");
    assert!(
        old.iter().all(|l| l.contains("--column old_logprobs")
            && l.contains("--daemon")
            && !l.contains(" launch ")),
        "{plan}"
    );
    let final_files = |run: &str| files(&d.join(run).join("ckpt/step-0002"));
    assert_eq!(final_files("launch"), final_files("group"));
    for batch in ["rollout", "adv"] {
        let f = format!("step-0002/{batch}.parquet");
        same_rows(
            &read(&d.join("launch").join(&f)),
            &read(&d.join("group").join(&f)),
            &f,
        );
    }

    // Rank 1 dies in step 2's rollout.
    let marker = d.join("kill-marker");
    let t0 = std::time::Instant::now();
    let o = pipeline_ok(
        d,
        "killed",
        "gpus = 2\ndaemon = true",
        &[
            ("TANDEM_DAEMON_KILL_IN_ROLLOUT", p(&marker)),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
            ("TANDEM_DAEMON_KILL_AT_STEP", "2"),
        ],
    );
    let disturbed = t0.elapsed();
    assert!(marker.exists());
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let log = std::fs::read_to_string(d.join("killed/daemon.log")).unwrap();
    assert!(stopped_naming_rank_1(&log), "rank 0 names rank 1: {log}");
    assert!(
        log.contains("error: rank 1 failed (was killed by signal 9"),
        "{log}"
    );
    assert!(out.contains("rollout failed with the daemon gone"), "{out}");
    assert!(group_failure_names_rank_1(&out), "{out}");
    // The group went down and a new one came up well inside a minute.
    assert!(
        disturbed < undisturbed + std::time::Duration::from_secs(60),
        "{disturbed:?} vs {undisturbed:?}"
    );
    assert_eq!(final_files("group"), final_files("killed"));
    for batch in ["rollout", "adv"] {
        let f = format!("step-0002/{batch}.parquet");
        // Every column bit for bit (the files' metadata names their run directory).
        let (a, b) = (
            read(&d.join("group").join(&f)),
            read(&d.join("killed").join(&f)),
        );
        assert_eq!(a.data.schema().fields(), b.data.schema().fields(), "{f}");
        for (x, y) in a.data.columns().iter().zip(b.data.columns()) {
            assert_eq!(x.to_data(), y.to_data(), "{f}");
        }
    }
}

/// The JSON of `run/step-000K/metrics/update.json`.
fn update_metrics(d: &Path, run: &str, step: u64) -> serde_json::Value {
    let path = d
        .join(run)
        .join(format!("step-{step:04}/metrics/update.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The 4-step `gpus = 2` spec of the resident-group tests: a reward that varies within a
/// prompt's samples (any letter is a found answer), so every step has real gradients and the
/// moments matter; files every 2 steps; under `full`, `[update] shard = "full"`.
fn resident_spec(top: &str, full: bool) -> String {
    let mut s = spec(top).replace(
        "reward = \"exact\"",
        "reward = \"regex:[a-z]\"\nformat-score = 1.0",
    );
    if full {
        s = s.replace(
            "mini-batch-size = 3\n",
            "mini-batch-size = 3\nshard = \"full\"\n",
        );
    }
    format!("{s}[checkpoint]\nevery = 2\nkeep-last = 2\n")
}

/// The checkpoints a run left, sorted.
fn ckpts(d: &Path, run: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.join(run).join("ckpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Runs `files` (in-process stages) and `group` (a daemon group) of [`resident_spec`] in `d`
/// compared: the group updates with `--resident` in steps 1 and 3 and writes files in 2 and 4,
/// reads no file after it started, keeps its communicator from step 1 on, trains as the files
/// run step by step (shard mode `mode`), and ends with its checkpoint and step-4 batches.
fn same_as_files_with_resident_steps(d: &Path, mode: &str) {
    let commands = std::fs::read_to_string(d.join("group/commands.sh")).unwrap();
    let updates: Vec<&str> = commands
        .lines()
        .filter(|l| l.contains("/update "))
        .collect();
    assert_eq!(updates.len(), 4, "{commands}");
    for (i, line) in updates.iter().enumerate() {
        assert_eq!(
            line.contains("--resident"),
            i % 2 == 0,
            "step {}: {line}",
            i + 1
        );
    }
    for step in 1..=4u64 {
        let m = update_metrics(d, "group", step);
        let files = step % 2 == 0;
        assert_eq!(m["weights_saved"], files, "step {step}: {m}");
        assert_eq!(m["optimizer_state_saved"], files, "step {step}: {m}");
        assert_eq!(m["schedule_step"], step, "step {step}: {m}");
        assert_eq!(m["shard"]["world_size"], 2, "step {step}: {m}");
        assert_eq!(m["shard"]["mode"], mode, "step {step}: {m}");
        // No file is read after the group started: the ranks train what they hold.
        assert_eq!(m["daemon"]["reloaded"], false, "step {step}: {m}");
        // The group's communicator is made at the first update and kept with the policy.
        assert_eq!(
            m["daemon"]["new_communicator"],
            step == 1,
            "step {step}: {m}"
        );
        // The same training as the files run, step by step.
        let f = update_metrics(d, "files", step);
        for key in ["loss", "grad_norm", "optimizer_step"] {
            assert_eq!(m[key], f[key], "step {step}: {key}");
        }
        assert!(m["grad_norm"].as_f64().unwrap() > 0.1, "step {step}: {m}");
    }
    // Only the cadence's checkpoints are left; the resident steps left no weights anywhere.
    assert_eq!(ckpts(d, "group"), ["step-0002", "step-0004"]);
    let final_files = |run: &str| files(&d.join(run).join("ckpt/step-0004"));
    assert_eq!(final_files("files"), final_files("group"));
    for batch in ["rollout", "adv"] {
        let f = format!("step-0004/{batch}.parquet");
        same_rows(
            &read(&d.join("files").join(&f)),
            &read(&d.join("group").join(&f)),
            &f,
        );
    }
}

/// `gpus = 2`, `daemon = true`, 4 steps with `[checkpoint] every = 2`: the group keeps the
/// policy resident in steps 1 and 3 (every rank its shards: no weight or optimizer file
/// written, the ranks train on from memory) and writes files in steps 2 and 4 only; the
/// final checkpoint equals the in-process `gpus = 2` run's (which writes and reads files every
/// step) bit for bit. Then rank 1's daemon SIGKILLs itself in step 3's resident update: the
/// runner starts a new group, goes back to step 2 (the last checkpoint written as files) and
/// ends with the same final checkpoint.
#[test]
fn a_daemon_group_keeps_the_policy_resident_between_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 20);
    let run = |name: &str, top: &str, env: &[(&str, &str)]| {
        let o = run_pipeline(d, name, &resident_spec(top, false), &["--steps", "4"], env);
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "{name}: {out}");
        out
    };
    run("files", "gpus = 2", &[]);
    run("group", "gpus = 2\ndaemon = true", &[]);
    same_as_files_with_resident_steps(d, "zero2");
    for step in ["step-0002", "step-0004"] {
        let ck = d.join("group/ckpt").join(step);
        assert!(ck.join("model.safetensors").is_file(), "{step}");
        // Each rank wrote its optimizer shard; no rank gathered the whole state.
        for r in 0..2 {
            let f = format!("optimizer.rank{r:05}-of-00002.safetensors");
            assert!(ck.join(&f).is_file(), "{step}: {f}");
        }
        assert!(!ck.join("optimizer.safetensors").exists(), "{step}");
        assert!(!ck.join("resident.json").exists(), "{step}");
    }
    let final_files = |run: &str| files(&d.join(run).join("ckpt/step-0004"));

    // Rank 1 dies in step 3's update (resident): the group goes down, the run goes on from
    // step 2's files on a new group (the frontier is a file checkpoint: nothing to go back to).
    let marker = d.join("kill-update");
    let out = run(
        "killed-update",
        "gpus = 2\ndaemon = true",
        &[
            ("TANDEM_DAEMON_KILL_IN_UPDATE", p(&marker)),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
            ("TANDEM_DAEMON_KILL_AT_STEP", "3"),
        ],
    );
    assert!(marker.exists());
    let log = std::fs::read_to_string(d.join("killed-update/daemon.log")).unwrap();
    assert!(stopped_naming_rank_1(&log), "{log}");
    assert!(out.contains("update failed with the daemon gone"), "{out}");
    assert!(group_failure_names_rank_1(&out), "{out}");
    assert!(!out.contains("going back"), "{out}");
    assert_eq!(final_files("group"), final_files("killed-update"));

    // Rank 1 dies in step 4's rollout, whose policy (after step 3) was only in the group's
    // memory: the runner starts a new group, goes back to step 2 and runs steps 3 and 4 again.
    let marker = d.join("kill-rollout");
    let out = run(
        "killed",
        "gpus = 2\ndaemon = true",
        &[
            ("TANDEM_DAEMON_KILL_IN_ROLLOUT", p(&marker)),
            ("TANDEM_DAEMON_KILL_RANK", "1"),
            ("TANDEM_DAEMON_KILL_AT_STEP", "4"),
        ],
    );
    assert!(marker.exists());
    let log = std::fs::read_to_string(d.join("killed/daemon.log")).unwrap();
    assert!(stopped_naming_rank_1(&log), "{log}");
    assert!(out.contains("rollout failed with the daemon gone"), "{out}");
    assert!(
        out.contains("the policy after step 3 (weights and optimizer state) was only in the daemon's memory; going back to step 2"),
        "{out}"
    );
    let commands = std::fs::read_to_string(d.join("killed/commands.sh")).unwrap();
    let updates: Vec<&str> = commands
        .lines()
        .filter(|l| l.contains("/update "))
        .collect();
    assert_eq!(
        updates.len(),
        5,
        "steps 1-4, then 3 and 4 again: {commands}"
    );
    assert!(updates[3].contains("ckpt/step-0003 ") && updates[3].contains("--resident"));
    assert!(updates[4].contains("ckpt/step-0004 ") && !updates[4].contains("--resident"));
    assert_eq!(final_files("group"), final_files("killed"));
    assert_eq!(ckpts(d, "killed"), ["step-0002", "step-0004"]);
}

/// `gpus = 2`, `daemon = true` under `[update] shard = "full"`, 4 steps with `[checkpoint]
/// every = 2`: as under zero2, steps 1 and 3 update with `--resident` (no file written, none
/// read: the ranks keep their shards of the compute weights, masters and moments, and generate
/// from the copy gathered after each update), and the final checkpoint equals the in-process
/// `gpus = 2` run's (files written and read every step) bit for bit.
#[test]
fn a_daemon_group_keeps_full_shards_resident_between_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 20);
    for (name, top) in [("files", "gpus = 2"), ("group", "gpus = 2\ndaemon = true")] {
        let o = run_pipeline(d, name, &resident_spec(top, true), &["--steps", "4"], &[]);
        assert!(
            o.status.success(),
            "{name}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    same_as_files_with_resident_steps(d, "full");
}

/// The by-hand resident tests' setup: a tiny model, prompts and a rollout of them (the
/// batch the updates train on, with sft). Returns (model, prompts, batch).
fn sft_setup(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let model = tiny_model(d, 7);
    let input = d.join("prompts.parquet");
    prompts(&input, &QUESTIONS);
    let (batch, batch_m) = (d.join("batch.parquet"), d.join("batch.json"));
    ok("rollout", &rollout_args(&model, &input, &batch, &batch_m));
    (model, input, batch)
}

/// `update` arguments of the resident tests: sft on `batch` from `from` into `out`, then `extra`.
fn sft_update(batch: &Path, from: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a = [
        "--model",
        p(from),
        "--in",
        p(batch),
        "--out-model",
        p(out),
        "--loss",
        "sft",
        "--lr",
        "0.01",
        "--mini-batch-size",
        "4",
        "--seed",
        "5",
    ]
    .map(String::from)
    .to_vec();
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

/// `update ARGS` on 2 ranks under the launcher.
fn launch_update(args: &[String]) {
    launch_ok(
        2,
        "update",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
}

/// `daemon-ctl save --out OUT` on the group at `socket`: the files the group writes.
fn group_save(socket: &Path, out: &Path) {
    let o = ctl_with(socket, &["save", "--out", p(out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out
        .join("optimizer.rank00001-of-00002.safetensors")
        .is_file());
}

/// A rollout of `input` served by the group at `socket` for the policy `model` (into `out`,
/// metrics beside it) has `reference`'s rows, from the policy in memory; returns its metrics.
fn group_rollout_rows(
    socket: &Path,
    model: &Path,
    input: &Path,
    out: &Path,
    reference: &Path,
    what: &str,
) -> serde_json::Value {
    let m = out.with_extension("json");
    let mut a = rollout_args(model, input, out, &m);
    a.extend(["--daemon", p(socket)]);
    ok("rollout", &a);
    same_rows(&read(reference), &read(out), what);
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&m).unwrap()).unwrap();
    assert_eq!(m["daemon"]["reloaded"], false, "{m}");
    m
}

/// `update --resident` on a 2-daemon group, by hand: every rank keeps its optimizer shard
/// (status), the directory holds no weights, the group's rollout from it gives the rows of a
/// rollout from the files of the same update run in-process under the launcher, `daemon-ctl
/// save` writes that update's files (per-rank optimizer shards included) bit for bit, and the
/// next (non-resident) update trains on from memory and writes the in-process second
/// update's files bit for bit.
#[test]
fn update_resident_on_a_daemon_group_trains_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (model, input, batch) = sft_setup(d);
    let update = |from: &Path, out: &Path, extra: &[&str]| sft_update(&batch, from, out, extra);
    let (m1, m2) = (d.join("m1"), d.join("m2"));
    for (from, out) in [(&model, &m1), (&m1, &m2)] {
        launch_update(&update(from, out, &[]));
    }
    let (r1, r1_m) = (d.join("r1.parquet"), d.join("r1.json"));
    ok("rollout", &rollout_args(&m1, &input, &r1, &r1_m));
    // The update moved the policy: the initial model's rollout (same seed) differs from it.
    let moved = f32_rows(&read(&batch), schema::ROLLOUT_LOGPROBS)
        .iter()
        .flatten()
        .zip(
            f32_rows(&read(&r1), schema::ROLLOUT_LOGPROBS)
                .iter()
                .flatten(),
        )
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-2, "{moved}");

    let socket = d.join("g.sock");
    let _group = DaemonGroup::start(d, 2, &socket, &model, &[]);
    let kept = d.join("kept");
    ok(
        "update",
        &update(&model, &kept, &["--resident", "--daemon", p(&socket)]),
    );
    assert!(kept.join("resident.json").is_file());
    assert!(!kept.join("model.safetensors").exists());
    assert!(!kept.join("optimizer.safetensors").exists());
    let ranks = wait_ranks(&socket, "both ranks to hold the trained policy", |r| {
        r.iter()
            .all(|s| s["resident"]["policy"]["optimizer_sharded"] == true)
    });
    for s in &ranks {
        let policy = &s["resident"]["policy"];
        assert!(
            policy["dir"].as_str().unwrap().ends_with("/kept"),
            "{ranks:?}"
        );
        assert_eq!(policy["schedule_step"], 1, "{ranks:?}");
        assert_eq!(policy["in_files"], false, "{ranks:?}");
    }
    // The group generates from the weights in memory: the rows of a rollout from m1's files.
    group_rollout_rows(
        &socket,
        &kept,
        &input,
        &d.join("r1g.parquet"),
        &r1,
        "rollout from the resident policy",
    );

    // `daemon-ctl save` while the state is in shards: every rank writes its own shard, rank 0
    // the model files from the gathered masters: m1's files (the launched update) bit for bit.
    let saved = d.join("saved");
    group_save(&socket, &saved);
    assert_eq!(files(&m1), files(&saved));
    assert!(!d.join("saved.shards").exists());
    // Both ranks now name the policy by the saved directory.
    wait_ranks(&socket, "both ranks to name the saved directory", |r| {
        r.iter().all(|s| {
            s["resident"]["policy"]["dir"]
                .as_str()
                .is_some_and(|d| d.ends_with("/saved"))
        })
    });

    let m2g = d.join("m2g");
    ok("update", &update(&kept, &m2g, &["--daemon", p(&socket)]));
    assert_eq!(files(&m2), files(&m2g));

    // m2's optimizer state is in per-rank shards of zero2's layout: --shard full (another
    // layout) continues from them, each rank cutting its shard from the files (tests/shard.rs
    // compares such continuations with one process).
    launch_update(&update(&m2, &d.join("m2full"), &["--shard", "full"]));
    let ts = |dir: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join("trainer_state.json")).unwrap()).unwrap()
    };
    let (before, after) = (ts(&m2), ts(&d.join("m2full")));
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        n(&after, "schedule_step"),
        n(&before, "schedule_step") + 1,
        "{after}"
    );
    assert!(
        n(&after, "optimizer_step") > n(&before, "optimizer_step"),
        "{after}"
    );
    assert_eq!(after["optimizer_shards"], 2, "{after}");

    // An update of another checkpoint under --shard full (here the initial model's, whose
    // optimizer is fresh): the ranks load it, shard it unit by unit, rank 0 writes m3, and the
    // next rollout generates from the copy gathered from the ranks' shards.
    let (m3, m3g) = (d.join("m3"), d.join("m3g"));
    launch_update(&update(&model, &m3, &["--shard", "full"]));
    let a = update(&model, &m3g, &["--shard", "full", "--daemon", p(&socket)]);
    ok("update", &a);
    assert_eq!(files(&m3), files(&m3g));
    let (r3, r3_m) = (d.join("r3.parquet"), d.join("r3.json"));
    ok("rollout", &rollout_args(&m3, &input, &r3, &r3_m));
    group_rollout_rows(
        &socket,
        &m3g,
        &input,
        &d.join("r3g.parquet"),
        &r3,
        "rollout after a --shard full update",
    );
}

/// `update --resident --shard full` on a 2-daemon group, by hand: every rank keeps its shards
/// of the compute weights, masters and moments (status) and a whole copy for generation; the
/// group's rollout between the two updates gives the rows of a rollout from the files of the
/// first update run under the launcher; the second update reads no file; `daemon-ctl save`
/// writes the launched second update's files (per-rank optimizer shards of full sharding's
/// layout included) bit for bit; a non-resident update on the group writes its checkpoint
/// as the launched one does; and a zero2 update after them re-shards the state held in memory
/// and writes the launched zero2 update's files.
#[test]
fn update_resident_shard_full_on_a_daemon_group_trains_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (model, input, batch) = sft_setup(d);
    // `update --shard MODE` arguments, then `extra`.
    let update = |from: &Path, out: &Path, mode: &str, extra: &[&str]| {
        sft_update(&batch, from, out, &[&["--shard", mode], extra].concat())
    };
    let (m1, m2, m3) = (d.join("m1"), d.join("m2"), d.join("m3"));
    for (from, out) in [(&model, &m1), (&m1, &m2), (&m2, &m3)] {
        launch_update(&update(from, out, "full", &[]));
    }
    let (r1, r1_m) = (d.join("r1.parquet"), d.join("r1.json"));
    ok("rollout", &rollout_args(&m1, &input, &r1, &r1_m));

    let socket = d.join("g.sock");
    let _group = DaemonGroup::start(d, 2, &socket, &model, &[]);
    let metrics = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join(name)).unwrap()).unwrap()
    };
    let (k1, k2) = (d.join("k1"), d.join("k2"));
    let resident = ["--resident", "--daemon", p(&socket), "--metrics"];
    let k1m = d.join("k1.json");
    ok(
        "update",
        &update(&model, &k1, "full", &[&resident[..], &[p(&k1m)]].concat()),
    );
    assert!(k1.join("resident.json").is_file());
    assert!(!k1.join("model.safetensors").exists());
    let m = metrics("k1.json");
    assert_eq!(m["shard"]["mode"], "full", "{m}");
    assert_eq!(m["weights_saved"], false, "{m}");
    let ranks = wait_ranks(&socket, "both ranks to hold the trained shards", |r| {
        r.iter()
            .all(|s| s["resident"]["policy"]["weights_sharded"] == true)
    });
    for s in &ranks {
        let policy = &s["resident"]["policy"];
        assert_eq!(policy["optimizer_sharded"], true, "{ranks:?}");
        assert_eq!(policy["generation_copy"], true, "{ranks:?}");
        assert_eq!(policy["schedule_step"], 1, "{ranks:?}");
        assert_eq!(policy["in_files"], false, "{ranks:?}");
    }
    // The group generates from the gathered copy: the rows of a rollout from m1's files.
    group_rollout_rows(
        &socket,
        &k1,
        &input,
        &d.join("r1g.parquet"),
        &r1,
        "rollout from the resident full shards",
    );

    // The second resident update trains the shards in memory: no file read.
    let k2m = d.join("k2.json");
    ok(
        "update",
        &update(&k1, &k2, "full", &[&resident[..], &[p(&k2m)]].concat()),
    );
    let m = metrics("k2.json");
    assert_eq!(m["daemon"]["reloaded"], false, "{m}");
    assert_eq!(m["daemon"]["load_seconds"], 0.0, "{m}");
    assert_eq!(m["schedule_step"], 2, "{m}");
    assert!(m["shard"]["unit_gathers"].as_u64().unwrap() > 0, "{m}");

    // `daemon-ctl save`: rank 0 writes the model files from the gathered masters, every rank
    // its optimizer shard: m2's files (two launched updates) bit for bit.
    let saved = d.join("saved");
    group_save(&socket, &saved);
    assert_eq!(files(&m2), files(&saved));

    // A checkpointing update on the group trains on from memory and writes m3's files.
    let m3g = d.join("m3g");
    let m3gm = d.join("m3g.json");
    let a = update(
        &saved,
        &m3g,
        "full",
        &["--daemon", p(&socket), "--metrics", p(&m3gm)],
    );
    ok("update", &a);
    let m = metrics("m3g.json");
    assert_eq!(m["daemon"]["reloaded"], false, "{m}");
    assert_eq!(files(&m3), files(&m3g));

    // --shard zero2 next: the ranks put the state held in full shards back together (from
    // memory) and shard it as zero2, as a launched zero2 update cuts its shards from m3's files.
    let (m4, m4g) = (d.join("m4"), d.join("m4g"));
    launch_update(&update(&m3, &m4, "zero2", &[]));
    ok(
        "update",
        &update(&m3g, &m4g, "zero2", &["--daemon", p(&socket)]),
    );
    assert_eq!(files(&m4), files(&m4g));
    let ranks = wait_ranks(&socket, "both ranks to hold zero2 shards", |r| {
        r.iter()
            .all(|s| s["resident"]["policy"]["weights_sharded"] == false)
    });
    assert!(
        ranks
            .iter()
            .all(|s| s["resident"]["policy"]["optimizer_sharded"] == true),
        "{ranks:?}"
    );
}
