//! A step's rollout done by the user's own agent (`[rollout] agent = "cmd:PROGRAM ARGS…"`):
//! the runner serves the step's policy with `tandem serve` (127.0.0.1, a port of its own, an
//! API key it makes up; with daemon = true, generating on the warm daemon), runs the program
//! with the served API and the step's prompts in its
//! environment, collects the trajectories the program recorded into the step's
//! rollout.parquet, and stops the server. The later stages run on that file unchanged.
//!
//! The program names each episode's trajectory `PROMPT_UID-K` (the `prompt_uid` of its row in
//! `$TANDEM_PROMPTS`, K from 0 to `$TANDEM_N` − 1): the collected rows then carry their
//! prompt's `prompt_uid` (so the episodes of a question form one group), and its ground truth
//! and data source unless the program posted its own.

use super::agent_spec::AgentCmd;
use super::console::{Captured, Console, TAIL_LINES};
use super::plan::{path_arg, Plan};
use super::rundir::step_name;
use super::sampler::derive_seed;
use super::spec::Source;
use crate::bail_input;
use crate::batch::{write_file, Batch, NewColumns, StageInfo};
use crate::error::input_error;
use crate::process::{die_with_parent, GroupGuard};
use crate::stage::rollout::RolloutArgs;
use anyhow::{Context, Result};
use arrow_array::{ArrayRef, StringArray};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the server may take to load the policy and listen.
const SERVE_START: Duration = Duration::from_secs(1200);

/// The name the server gives the policy in the API (`model` of requests).
const MODEL_NAME: &str = "policy";

/// The agent of a loaded spec (checked when it was loaded), if it has one.
pub(crate) fn agent_of(plan: &Plan) -> Result<Option<AgentCmd>> {
    let src = Source {
        origin: "the spec",
        text: None,
    };
    plan.spec.agent(&plan.stages, &src)
}

/// The step's prompts as the agent gets them: `uids` their prompt_uids, `truths` and `sources`
/// their ground truths and data sources (as rollout carries them).
struct Prompts {
    uids: Vec<String>,
    truths: Vec<Option<String>>,
    sources: Vec<Option<String>>,
}

/// Writes the step's prompts with a `prompt_uid` column to `dir/prompts.parquet`, and as JSON
/// lines (every column of a row, for programs that cannot read parquet) to `prompts.jsonl`.
fn write_prompts(prompts: &Path, dir: &Path, step: u64, seed: u64) -> Result<Prompts> {
    let batch = Batch::read(prompts, &[])?;
    let rows = batch.num_rows();
    let uids: Vec<String> = (0..rows as u64)
        .map(|i| format!("{:016x}", derive_seed(seed, &[step, i])))
        .collect();
    let truths: Vec<Option<String>> = match batch.ground_truths() {
        Ok(t) => t.into_iter().map(Some).collect(),
        Err(_) => vec![None; rows],
    };
    let sources: Vec<Option<String>> = match batch.strings(crate::batch::schema::DATA_SOURCE) {
        Ok(s) => s.into_iter().map(|s| Some(s.to_string())).collect(),
        Err(_) => vec![None; rows],
    };
    let mut new = NewColumns::new();
    new.add(
        crate::batch::schema::PROMPT_UID,
        Arc::new(StringArray::from(uids.clone())),
    );
    let info = StageInfo {
        stage: "agent-prompts",
        params: json!({"prompts": prompts, "step": step}),
        policy_version: None,
        step: Some(step),
    };
    batch.write_derived(&dir.join("prompts.parquet"), new, &info)?;
    let names: Vec<String> = batch
        .data
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    let columns: Vec<Vec<Value>> = names.iter().map(|n| batch.json_rows(n)).collect();
    let mut text = String::new();
    for i in 0..rows {
        let mut row = Map::new();
        row.insert("prompt_uid".into(), json!(uids[i]));
        for (name, col) in names.iter().zip(&columns) {
            row.insert(name.clone(), col[i].clone());
        }
        if let Some(t) = &truths[i] {
            row.entry("ground_truth").or_insert(json!(t));
        }
        text += &Value::Object(row).to_string();
        text.push('\n');
    }
    crate::batch::write::write_atomic(&dir.join("prompts.jsonl"), text.as_bytes())?;
    Ok(Prompts {
        uids,
        truths,
        sources,
    })
}

/// A `tandem serve` of the step's policy, killed (with its process group) when dropped.
struct Served {
    child: Child,
    _group: GroupGuard,
    addr: String,
    key: String,
    log: PathBuf,
}

impl Served {
    fn start(plan: &Plan, dir: &Path) -> Result<Served> {
        let log = dir.join("serve.log");
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let key = made_up_key();
        let r = &plan.stages.rollout.args;
        let mut cmd = Command::new(plan.bins.join("tandem"));
        cmd.arg("serve")
            .args(["--model", &path_arg(&plan.run.policy())])
            .args(["--host", "127.0.0.1", "--port", "0", "--api-key", &key])
            .args(["--served-model-name", MODEL_NAME])
            .args(["--device", plan.spec.device.as_str()])
            .args(["--collect-dir", &path_arg(dir)])
            .args(["--max-tokens", &request_cap(r).max(1).to_string()])
            .args(["--max-n", &r.n.max(16).to_string()])
            // The rollout stage's engine limits, so that a step's episodes batch as its would
            // (and a connection per episode in flight: the agent's client may hold one each).
            .args(["--max-num-seqs", &r.max_num_seqs.to_string()])
            .args(["--max-batched-tokens", &r.max_batched_tokens.to_string()])
            .args(["--gpu-memory-fraction", &r.gpu_memory_fraction.to_string()])
            .args([
                "--max-connections",
                &(r.max_num_seqs + 64).max(512).to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // With daemon = true it generates on the daemon, with the policy the daemon holds.
        cmd.args(plan.daemon_args());
        if plan.spec.batch_invariant {
            cmd.env("TANDEM_BATCH_INVARIANT", "1");
        }
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().context("starting tandem serve")?;
        let group = GroupGuard::new(child.id());
        let mut served = Served {
            child,
            _group: group,
            addr: String::new(),
            key,
            log,
        };
        served.addr = served.wait_listening()?;
        Ok(served)
    }

    /// The address from the server's `listening on http://ADDR` line, once /health answers.
    fn wait_listening(&mut self) -> Result<String> {
        let start = Instant::now();
        while start.elapsed() < SERVE_START {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some((_, rest)) = text.split_once("listening on http://") {
                let addr = rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                if matches!(http(&addr, "GET", "/health", "", None), Ok((200, _))) {
                    return Ok(addr);
                }
            }
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "tandem serve exited ({status}) before it listened; its output ended with:\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        anyhow::bail!(
            "tandem serve did not listen within {} s; its output ended with:\n{}",
            SERVE_START.as_secs(),
            self.log_tail()
        )
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(TAIL_LINES);
        lines[from..]
            .iter()
            .map(|l| format!("  | {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// POST /trajectories/collect as `name`: the batch file written, or None when the server
    /// held no finished trajectory.
    fn collect(&self, name: &str, dir: &Path) -> Result<Option<PathBuf>> {
        let body = json!({ "name": name });
        let (status, text) = http(
            &self.addr,
            "POST",
            "/trajectories/collect",
            &self.key,
            Some(&body),
        )?;
        match status {
            200 => Ok(Some(dir.join(format!("{name}.parquet")))),
            409 if text.contains("no finished trajectory") => Ok(None),
            s => anyhow::bail!("POST /trajectories/collect answered {s}: {text}"),
        }
    }
}

/// The new tokens one request may ask: the rollout stage's per-turn cap with tools
/// (`max-turn-tokens`, else `max-response-tokens`), else `max-new-tokens`.
fn request_cap(r: &RolloutArgs) -> usize {
    match r.tool.is_empty() {
        true => r.max_new_tokens,
        false => r.turn_limits().1,
    }
}

/// The response tokens an episode may take: `max-response-tokens` (else `max-new-tokens`)
/// with tools, `max-new-tokens` without.
fn response_limit(r: &RolloutArgs) -> usize {
    match r.tool.is_empty() {
        true => r.max_new_tokens,
        false => r.turn_limits().0.max_response_tokens,
    }
}

/// With `[rollout] tool`: the multi-turn settings the rollout stage plays by (and evaluates
/// with), for the agent to play its episodes by the same ones.
fn turn_env(r: &RolloutArgs) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if let Some(p) = &r.system_prompt {
        env.push(("TANDEM_SYSTEM_PROMPT", p.clone()));
    }
    if r.tool.is_empty() {
        return env;
    }
    let (limits, _) = r.turn_limits();
    env.push(("TANDEM_TOOLS", json!(r.tool).to_string()));
    env.push(("TANDEM_MAX_TURNS", limits.max_turns.to_string()));
    env.push(("TANDEM_MAX_TOOL_CALLS", limits.max_tool_calls.to_string()));
    env.push((
        "TANDEM_MAX_RESPONSE_TOKENS",
        limits.max_response_tokens.to_string(),
    ));
    if let Some(k) = r.max_parallel_calls {
        env.push(("TANDEM_MAX_PARALLEL_CALLS", k.to_string()));
    }
    env.push(("TANDEM_TOOL_CONCURRENCY", r.tool_concurrency.to_string()));
    env.push(("TANDEM_TOOL_TIMEOUT", r.tool_timeout.to_string()));
    env
}

/// A key no other program on the machine can guess.
fn made_up_key() -> String {
    let r = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        h.finish()
    };
    format!("tandem-{:016x}{:016x}", r(), r())
}

/// One HTTP/1.1 request to the server on loopback: the status and the body.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let auth = match key {
        "" => String::new(),
        k => format!("Authorization: Bearer {k}\r\n"),
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{method} {path}: no HTTP status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// The agent's step: serve, run the program, collect into `rollout` (see the module's doc).
pub(crate) fn run(
    plan: &Plan,
    console: &Console,
    step: u64,
    prompts: &Path,
    rollout: &Path,
    seed: u64,
) -> Result<()> {
    let agent = agent_of(plan)?.context("an agent step without [rollout] agent")?;
    let dir = plan.run.step_dir(step).join("agent");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = step_name(step);
    // A rerun of the step collects afresh.
    let collected = dir.join(format!("{name}.parquet"));
    let _ = std::fs::remove_file(&collected);
    let given = write_prompts(prompts, &dir, step, seed)?;
    let served = Served::start(plan, &dir).with_context(|| format!("{name}: agent step"))?;
    let r = &plan.stages.rollout.args;
    let mut cmd = Command::new(&agent.argv[0]);
    cmd.args(&agent.argv[1..])
        .env("OPENAI_BASE_URL", format!("http://{}/v1", served.addr))
        .env("OPENAI_API_KEY", &served.key)
        .env("TANDEM_MODEL", MODEL_NAME)
        .env("TANDEM_BIN", plan.bins.join("tandem"))
        .env("TANDEM_PROMPTS", dir.join("prompts.parquet"))
        .env("TANDEM_PROMPTS_JSONL", dir.join("prompts.jsonl"))
        .env("TANDEM_N", r.n.to_string())
        .env("TANDEM_STEP", step.to_string())
        .env("TANDEM_SEED", seed.to_string())
        .env("TANDEM_TEMPERATURE", r.logprob_temperature().to_string())
        .env("TANDEM_MAX_TOKENS", request_cap(r).to_string())
        .envs(turn_env(r))
        .stdin(Stdio::null());
    die_with_parent(&mut cmd);
    console.detail(&format!("[{name}] agent: {}", agent.command));
    let out = console.run_in_group(&mut cmd, agent.timeout).map_err(|e| {
        input_error(format!(
            "{name}: the agent `{}` did not start: {e}",
            agent.command
        ))
    })?;
    if !out.status.success() {
        return Err(agent_failed(&name, &agent, &out, &dir.join("serve.log")));
    }
    let file = served.collect(&name, &dir)?;
    drop(served);
    let Some(file) = file else {
        bail_input!(
            "{name}: the agent `{}` exited 0 but recorded no trajectory: tag its requests with X-Trajectory-Id (or `user`) as PROMPT_UID-K, and leave the collecting to the runner (the server's log: {})",
            agent.command,
            dir.join("serve.log").display()
        );
    };
    finish(&file, rollout, &given, step, &agent, response_limit(r))
}

/// The error of an agent that failed: its output's tail, the server's log, how to go on.
fn agent_failed(name: &str, agent: &AgentCmd, out: &Captured, log: &Path) -> anyhow::Error {
    let what = match (out.timed_out, out.status.code()) {
        (true, _) => format!(
            "killed at agent-timeout = {} s",
            agent.timeout.map_or(0, |t| t.as_secs())
        ),
        (false, Some(c)) => format!("exit code {c}"),
        (false, None) => "killed by a signal".to_string(),
    };
    let tail: Vec<String> = out.tail.iter().map(|l| format!("  | {l}")).collect();
    let msg = format!(
        "{name}: the agent `{}` failed ({what}); its output ended with:\n{}\nThe server's log: {}. Once the cause is fixed (or to retry), the same `pipeline run` command runs the step again.",
        agent.command,
        tail.join("\n"),
        log.display()
    );
    match out.status.code() {
        Some(2) => input_error(msg),
        _ => anyhow::anyhow!(msg),
    }
}

/// The collected trajectories as the step's rollout: each row's prompt_uid from its id
/// (`PROMPT_UID-K`, which must name one of the step's prompts), its prompt's ground truth and
/// data source where the agent posted none.
fn finish(
    collected: &Path,
    rollout: &Path,
    given: &Prompts,
    step: u64,
    agent: &AgentCmd,
    limit: usize,
) -> Result<()> {
    let b = Batch::read(collected, &[])?;
    let index: HashMap<&str, usize> = given
        .uids
        .iter()
        .enumerate()
        .map(|(i, u)| (u.as_str(), i))
        .collect();
    let ids = b.strings(crate::batch::schema::UID)?;
    let (mut puids, mut truths, mut sources) = (vec![], vec![], vec![]);
    let posted_truths = b.ground_truths()?;
    let posted_sources = b.strings(crate::batch::schema::DATA_SOURCE)?;
    for (row, id) in ids.iter().enumerate() {
        let prompt = id.rsplit_once('-').and_then(|(p, _)| index.get(p).copied());
        let Some(i) = prompt else {
            bail_input!(
                "{}: the agent `{}` recorded trajectory '{id}', which is not of the step's prompts: name each episode's trajectory PROMPT_UID-K, with the prompt_uid of its row in $TANDEM_PROMPTS",
                step_name(step),
                agent.command
            );
        };
        puids.push(given.uids[i].clone());
        let truth = &posted_truths[row];
        truths.push(match (truth.is_empty(), &given.truths[i]) {
            (true, Some(t)) => t.clone(),
            _ => truth.clone(),
        });
        let source = posted_sources[row];
        sources.push(match (source == "serve", &given.sources[i]) {
            (true, Some(s)) => s.clone(),
            _ => source.to_string(),
        });
    }
    let mut new = NewColumns::new();
    let col = |v: Vec<String>| Arc::new(StringArray::from(v)) as ArrayRef;
    new.add(crate::batch::schema::PROMPT_UID, col(puids));
    new.add_field(
        arrow_schema::Field::new(
            crate::batch::schema::GROUND_TRUTH,
            arrow_schema::DataType::Utf8,
            false,
        ),
        col(truths),
    );
    new.add(crate::batch::schema::DATA_SOURCE, col(sources));
    let info = StageInfo {
        stage: "agent",
        // The response limit the agent was handed: the overlong shaping's L_max, as a
        // rollout's.
        params: json!({"agent": agent.command, "trajectories": ids.len(),
                       "max_response_tokens": limit}),
        policy_version: None,
        step: Some(step),
    };
    let data = b.with_columns(new)?;
    write_file(rollout, &data, &b.derived_meta(&info))
}
