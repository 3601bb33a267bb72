//! Several ranks through the real binaries, on the CPU communicator: `tandem launch` starts
//! 2 and 3 ranks of `tandem dist-test`, whose checks compare every collective with values the
//! host computes, and whose small cases are compared here with values worked out by hand (f32,
//! and bf16 with its rounding). The same ranks start from torchrun's and Slurm's variables;
//! rank 0's store hands out one id; a rank killed with SIGKILL or hanging makes every other
//! rank exit, naming it, within the bound; the launcher stops the rest and exits non-zero
//! naming the rank.

use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A command without any launcher variables of the environment the tests run in.
fn clean(cmd: &mut Command) -> &mut Command {
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TANDEM_DIST_TIMEOUT",
        "TANDEM_DIST_ERROR_FILE",
        "NCCL_NVLS_ENABLE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST",
        "SLURM_NODELIST",
        "SLURM_TASKS_PER_NODE",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_JOB_ID",
    ] {
        cmd.env_remove(k);
    }
    cmd
}

fn launch(n: usize, extra: &[&str], cmd: &[&str]) -> Output {
    let mut c = Command::new(TANDEM);
    clean(&mut c)
        .args(["launch", "--nproc-per-node", &n.to_string()])
        .args(extra)
        .arg("--")
        .args(cmd)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Hand cases' results by (case, rank), and the ids by rank.
type Printed = (HashMap<(String, usize), Vec<f32>>, HashMap<usize, String>);

/// The JSON lines `dist-test` prints.
fn parse(stdout: &str) -> Printed {
    let (mut cases, mut ids) = (HashMap::new(), HashMap::new());
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let v: Value = serde_json::from_str(line).unwrap();
        let rank = v["rank"].as_u64().unwrap() as usize;
        if let Some(id) = v["id"].as_str() {
            ids.insert(rank, id.to_string());
        } else {
            let out = v["out"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            cases.insert((v["case"].as_str().unwrap().to_string(), rank), out);
        }
    }
    (cases, ids)
}

/// The hand-worked results of `dist-test`'s small cases on `n` ranks, for rank `r`.
fn hand(n: usize, r: usize) -> Vec<(&'static str, Vec<f32>)> {
    let nf = n as f32;
    // Avg is Σ_p (1/n)·x_p, added in rank order in f32 (the CPU communicator's contract).
    let s = 1.0 / nf;
    let avg = |f: &dyn Fn(f32) -> f32| (0..n).fold(0.0f32, |acc, p| acc + s * f(p as f32));
    let reduce_scatter: Vec<f32> = match (n, r) {
        // Rank r gets chunk r of x_q[i] = i + 100q, summed over q.
        (2, 0) => vec![0.0 + 100.0, 1.0 + 101.0],
        (2, 1) => vec![2.0 + 102.0, 3.0 + 103.0],
        (3, 0) => vec![300.0, 303.0],
        (3, 1) => vec![306.0, 309.0],
        (3, 2) => vec![312.0, 315.0],
        _ => unreachable!(),
    };
    let bf16_sum = match n {
        // 257 -> 256 and 258 stays: 514 -> 512 (ties to even); 1 + 2^-8 -> 1, 1 + 2^-7 stays:
        // 2.0078125 -> 2.
        2 => vec![512.0, 2.0],
        // 259 -> 260: 256 + 258 + 260 = 774 -> 776; 1 + 3·2^-8 -> 1.015625: 3.0234375 -> 3.03125.
        3 => vec![776.0, 3.03125],
        _ => unreachable!(),
    };
    vec![
        (
            "all_reduce_sum",
            match n {
                2 => vec![3.0, -1.5, 1000.0, 0.5],
                _ => vec![6.0, -3.0, 3000.0, 0.75],
            },
        ),
        (
            "all_reduce_avg",
            vec![avg(&|p| p + 1.0), avg(&|p| 2.0 * (p + 1.0))],
        ),
        (
            "all_gather",
            (0..n)
                .flat_map(|p| [10.0 * p as f32 + 1.0, 10.0 * p as f32 + 2.0])
                .collect(),
        ),
        ("reduce_scatter_sum", reduce_scatter),
        ("broadcast", vec![nf - 1.0, nf - 0.5]),
        ("all_reduce_sum_bf16", bf16_sum),
        // p + 1 + 2^-8 rounds to p + 1 in bf16.
        ("all_gather_bf16", (1..=n).map(|p| p as f32).collect()),
    ]
}

#[test]
fn launch_runs_every_collective_on_two_and_three_ranks() {
    for n in [2, 3] {
        let out = launch(n, &[], &[TANDEM, "dist-test"]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{n} ranks: {stdout}\n{stderr}");
        for r in 0..n {
            assert!(
                stdout.contains(&format!("dist-test: rank {r}: 43 checks passed")),
                "{n} ranks, rank {r}: {stdout}"
            );
        }
        // Rank 0's table lists every check: groups, overlap and determinism among them.
        for name in [
            "group: reduce_scatter",
            "overlap: all_reduce",
            "overlap: compute meanwhile",
            "deterministic: all_reduce",
            "reduce_scatter in place Avg 333",
            "all_gather in place 333",
        ] {
            assert!(stdout.contains(name), "{name}: {stdout}");
        }
        assert!(!stdout.contains("FAIL"), "{stdout}");
        let (cases, ids) = parse(&stdout);
        for r in 0..n {
            for (case, want) in hand(n, r) {
                let got = &cases[&(case.to_string(), r)];
                assert_eq!(got, &want, "{n} ranks, rank {r}, {case}");
            }
        }
        // Rank 0's store handed out one id to every rank.
        assert_eq!(ids.len(), n);
        assert!(
            ids.values().all(|id| id == &ids[&0] && id.len() == 32),
            "{ids:?}"
        );
    }
}

#[test]
fn one_rank_needs_no_launcher() {
    let out = clean(&mut Command::new(TANDEM))
        .arg("dist-test")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("dist-test: rank 0: 43 checks passed"));
    let (cases, _) = parse(&stdout);
    // One rank: every result is its own input (bf16 ones rounded).
    assert_eq!(
        cases[&("all_reduce_sum".into(), 0)],
        vec![1.0, -0.5, 0.0, 0.25]
    );
    assert_eq!(cases[&("all_reduce_sum_bf16".into(), 0)], vec![256.0, 1.0]);
    assert_eq!(cases[&("reduce_scatter_sum".into(), 0)], vec![0.0, 1.0]);
}

/// Starts `n` ranks of `dist-test` as separate processes with `env(rank)`, stderr piped.
fn spawn_ranks(
    n: usize,
    args: &[&str],
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<(Child, Receiver<String>)> {
    (0..n)
        .map(|r| {
            let mut c = Command::new(TANDEM);
            clean(&mut c)
                .arg("dist-test")
                .args(args)
                .envs(env(r))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = c.spawn().unwrap();
            let (tx, rx) = channel();
            let err = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            (child, rx)
        })
        .collect()
}

fn torchrun_env(n: usize, port: u16, timeout: &str) -> impl Fn(usize) -> Vec<(String, String)> {
    let timeout = timeout.to_string();
    move |r| {
        vec![
            ("RANK".into(), r.to_string()),
            ("WORLD_SIZE".into(), n.to_string()),
            ("LOCAL_RANK".into(), r.to_string()),
            ("LOCAL_WORLD_SIZE".into(), n.to_string()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.to_string()),
            ("TANDEM_DIST_TIMEOUT".into(), timeout.clone()),
        ]
    }
}

/// Waits until `child` exits (at most `limit`); its stderr lines so far.
fn finish(child: &mut Child, rx: &Receiver<String>, limit: Duration) -> (Option<i32>, String) {
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(50));
    let lines: Vec<String> = rx.try_iter().collect();
    let status = status.unwrap_or_else(|| panic!("still running after {limit:?}: {lines:?}"));
    (status.code(), lines.join("\n"))
}

#[test]
fn torchrun_variables_start_the_ranks_and_each_job_gets_a_fresh_id() {
    let mut ids = Vec::new();
    for _ in 0..2 {
        let n = 3;
        let mut ranks = spawn_ranks(n, &[], torchrun_env(n, free_port(), "30"));
        let mut job_ids = Vec::new();
        for (child, rx) in ranks.iter_mut() {
            let out = child.stdout.take().unwrap();
            let (code, err) = finish(child, rx, Duration::from_secs(120));
            let stdout = std::io::read_to_string(out).unwrap();
            assert_eq!(code, Some(0), "{stdout}\n{err}");
            let (_, id) = parse(&stdout);
            job_ids.extend(id.into_values());
        }
        assert!(job_ids.iter().all(|i| i == &job_ids[0]), "{job_ids:?}");
        ids.push(job_ids[0].clone());
    }
    assert_ne!(ids[0], ids[1], "rank 0 makes a new id for every job");
}

#[test]
fn slurm_variables_start_the_ranks() {
    let port = free_port();
    let n = 2;
    let mut ranks = spawn_ranks(n, &[], |r| {
        vec![
            ("SLURM_PROCID".into(), r.to_string()),
            ("SLURM_NTASKS".into(), n.to_string()),
            ("SLURM_LOCALID".into(), r.to_string()),
            ("SLURM_NODEID".into(), "0".into()),
            ("SLURM_TASKS_PER_NODE".into(), "2".into()),
            ("SLURM_JOB_NODELIST".into(), "localhost".into()),
            ("SLURM_JOB_ID".into(), "4242".into()),
            ("MASTER_PORT".into(), port.to_string()),
        ]
    });
    for (child, rx) in ranks.iter_mut() {
        let (code, err) = finish(child, rx, Duration::from_secs(120));
        assert_eq!(code, Some(0), "{err}");
    }
    // The brief's node list: rank 0 runs on its first host.
    let out = clean(&mut Command::new(TANDEM))
        .args(["dist-test", "--show-world"])
        .envs([
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[03-05,7],cpu1"),
            ("SLURM_JOB_ID", "1234"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let w: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(w["master_addr"], "gpu03");
    assert_eq!(w["master_port"], 21234);
    assert_eq!(
        (w["rank"].as_u64(), w["world_size"].as_u64()),
        (Some(5), Some(8))
    );
    assert_eq!(
        (w["local_rank"].as_u64(), w["local_world_size"].as_u64()),
        (Some(1), Some(4))
    );
    assert_eq!(w["launcher"], "slurm");
}

#[test]
fn bad_launcher_variables_are_input_errors_naming_them() {
    let out = clean(&mut Command::new(TANDEM))
        .arg("dist-test")
        .envs([("RANK", "one"), ("WORLD_SIZE", "2")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("RANK='one'"),
        "{}",
        text(&out.stderr)
    );
    let out = clean(&mut Command::new(TANDEM))
        .arg("dist-test")
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("TANDEM_DIST_TIMEOUT", "soon"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("TANDEM_DIST_TIMEOUT='soon'"));
}

#[test]
fn kill_9_of_one_rank_stops_the_others_naming_it() {
    let n = 3;
    // The timeout is far above what the test allows: a dead rank is noticed at once, not by
    // waiting for it.
    let mut ranks = spawn_ranks(n, &["--hold", "120"], torchrun_env(n, free_port(), "50"));
    let t = Instant::now();
    let mut holding = 0;
    let mut seen = Vec::new();
    while holding < n {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "ranks never held: {seen:?}"
        );
        for (_, rx) in &ranks {
            for line in rx.try_iter() {
                holding += line.contains("holding") as usize;
                seen.push(line);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks[1].0.kill().unwrap(); // SIGKILL
    ranks[1].0.wait().unwrap();
    let killed = Instant::now();
    for r in [0, 2] {
        let (child, rx) = &mut ranks[r];
        let (code, err) = finish(child, rx, Duration::from_secs(20));
        assert_ne!(code, Some(0), "rank {r}: {err}");
        assert!(err.contains("rank 1"), "rank {r}: {err}");
        assert!(err.contains("stopping"), "rank {r}: {err}");
    }
    assert!(killed.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_hanging_rank_times_out_and_every_rank_exits_naming_it() {
    let n = 3;
    let timeout = 2.0;
    let mut ranks = spawn_ranks(
        n,
        &["--fail-rank", "2", "--fail-mode", "hang"],
        torchrun_env(n, free_port(), "2"),
    );
    // Every rank, the hung one too, is gone within the timeout plus the exit grace (3 s).
    let bound = Duration::from_secs_f64(timeout + 3.0 + 10.0);
    let t = Instant::now();
    for (r, (child, rx)) in ranks.iter_mut().enumerate() {
        let (code, err) = finish(child, rx, Duration::from_secs(60));
        assert_ne!(code, Some(0), "rank {r}: {err}");
        if r != 2 {
            assert!(
                err.contains("timed out after 2s waiting for rank 2"),
                "rank {r}: {err}"
            );
        } else {
            assert!(
                err.contains("hangs") && err.contains("stopping"),
                "rank {r}: {err}"
            );
        }
    }
    assert!(t.elapsed() < bound, "took {:?}", t.elapsed());
}

#[test]
fn the_launcher_names_the_failed_rank_and_passes_on_its_exit_code() {
    let args = |mode: &str, code: &str| {
        vec![
            TANDEM.to_string(),
            "dist-test".into(),
            "--fail-rank".into(),
            "1".into(),
            "--fail-mode".into(),
            mode.into(),
            "--fail-code".into(),
            code.into(),
        ]
    };
    let run = |extra: &[&str], cmd: Vec<String>| {
        let cmd: Vec<&str> = cmd.iter().map(|s| s.as_str()).collect();
        let t = Instant::now();
        let out = launch(3, extra, &cmd);
        (out.status.code(), text(&out.stderr), t.elapsed())
    };
    // Bad input on a rank (exit 2) stays exit 2.
    let (code, err, _) = run(&[], args("exit", "2"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("error: rank 1 failed (exited with code 2)"),
        "{err}"
    );
    let (code, err, _) = run(&[], args("exit", "5"));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("error: rank 1 failed (exited with code 5)"),
        "{err}"
    );
    let (code, err, _) = run(&[], args("kill", "1"));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("error: rank 1 failed (was killed by signal 9 (SIGKILL))"),
        "{err}"
    );
    // A hang: the launcher's --timeout reaches the ranks; the hung rank is named although
    // another rank exits first.
    let (code, err, took) = run(&["--timeout", "2"], args("hang", "1"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("error: rank 1 failed"), "{err}");
    assert!(err.contains("waiting for rank 1"), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn the_launcher_sets_each_ranks_environment_and_rejects_bad_input() {
    let out = launch(
        2,
        &["--master-port", "29999"],
        &[
            "sh",
            "-c",
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE\"",
        ],
    );
    assert!(out.status.success());
    let mut lines: Vec<String> = text(&out.stdout).lines().map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        ["0 2 0 2 127.0.0.1 29999 0", "1 2 1 2 127.0.0.1 29999 0"]
    );
    let out = launch(0, &[], &["true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--nproc-per-node must be at least 1"));
    let out = launch(2, &[], &["/no/such/program"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot start rank 0"),
        "{}",
        text(&out.stderr)
    );
    let out = launch(2, &["--timeout", "-1"], &["true"]);
    assert_eq!(out.status.code(), Some(2));
    // A rank that fails alone (no dist at all) is named with its exit code.
    let out = launch(2, &[], &["sh", "-c", "exit $((RANK * 3))"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("rank 1 (pid"),
        "{}",
        text(&out.stderr)
    );
    assert!(text(&out.stderr).contains("exited with code 3"));
}

#[test]
fn bench_dist_reports_nccl_tests_bus_bandwidth_under_launch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("dist.json");
    let out = launch(
        3,
        &[],
        &[
            TANDEM,
            "bench",
            "dist",
            "--device",
            "cpu",
            "--min-size",
            "48KiB",
            "--max-size",
            "192KiB",
            "--warmup",
            "1",
            "--iters",
            "3",
            "--shapes",
            "small",
            "--bucket-mb",
            "8",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["world"], 3);
    let rows = v["collectives"].as_array().unwrap();
    assert_eq!(rows.len(), 4 * 2, "4 collectives at 48 and 192 KiB");
    for row in rows {
        let (alg, bus) = (
            row["algbw_gbs"].as_f64().unwrap(),
            row["busbw_gbs"].as_f64().unwrap(),
        );
        let factor = match row["op"].as_str().unwrap() {
            "all_reduce" => 2.0 * 2.0 / 3.0,
            "all_gather" | "reduce_scatter" => 2.0 / 3.0,
            _ => 1.0,
        };
        assert!(
            alg > 0.0 && (bus - alg * factor).abs() < 1e-9 * alg.max(1.0),
            "{row}"
        );
        let bytes = row["bytes"].as_u64().unwrap();
        let t = row["median_us"].as_f64().unwrap() * 1e-6;
        assert!((alg - bytes as f64 / t / 1e9).abs() < 1e-6 * alg, "{row}");
        // The buffer is the requested size rounded down to 3 equal f32 pieces.
        assert!(
            [48 << 10, 192 << 10]
                .iter()
                .any(|&s| bytes <= s && s - bytes < 12),
            "{row}"
        );
    }
    let sync = &v["weight_sync"].as_array().unwrap()[0];
    assert_eq!(sync["shape"], "small");
    assert_eq!(sync["timing"]["world"], 3);
    assert!(sync["timing"]["buckets"].as_u64().unwrap() >= 2);
    let text_out = text(&out.stdout);
    assert!(
        text_out.contains("busbw GB/s") && text_out.contains("weight sync"),
        "{text_out}"
    );
}
