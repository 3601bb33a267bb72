//! Issue 39's GPU comparison, the example agent through the API against the built-in
//! multi-turn rollout: its two specs are twins that differ in `[rollout] agent` only, the agent
//! one passes the pipeline's checks, and the runner hands the agent the rollout's multi-turn
//! settings (system prompt, tools, turn and token limits) so that it plays by the same rules.

use crate::pipeline::{gsm8k_checkout, real_bins, shipped_spec as spec, text, PIPELINE};
use crate::stage_util::model_and_train_set;
use std::path::Path;
use std::process::Command;

const AGENT: &str = "pipelines/gsm8k-qwen2.5-coder-1.5b-agent-cuda.toml";
const BUILTIN: &str = "pipelines/gsm8k-qwen2.5-coder-1.5b-agent-builtin-cuda.toml";

/// `pipeline run` of SPEC written into D, with the real stage binaries, into D/r.
fn run_spec(d: &Path, spec: &str) -> std::process::Output {
    std::fs::write(d.join("spec.toml"), spec).unwrap();
    Command::new(PIPELINE)
        .current_dir(d)
        .args(["run", "spec.toml", "--run-dir", "r"])
        .env("TANDEM_BIN_DIR", real_bins())
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

#[test]
fn the_comparison_specs_differ_in_the_agent_only() {
    let (mut agent, builtin) = (spec(AGENT), spec(BUILTIN));
    let rollout = agent["rollout"].as_table_mut().unwrap();
    let cmd = rollout.remove("agent").unwrap();
    assert_eq!(cmd.as_str(), Some("cmd:python3 pipelines/serve_agent.py"));
    assert_eq!(agent, builtin);
    // What makes the comparison fair, on both: the Python tool with its limits and system
    // prompt, the score stage's gsm8k reward, a greedy evaluation, no dynamic sampling.
    let r = builtin["rollout"].as_table().unwrap();
    assert_eq!(r["tool"].as_array().unwrap().len(), 1);
    for key in [
        "system-prompt",
        "max-turns",
        "max-turn-tokens",
        "max-response-tokens",
    ] {
        assert!(r.contains_key(key), "{key}");
    }
    assert_eq!(builtin["score"]["reward"].as_str(), Some("gsm8k"));
    assert!(builtin["eval"]["every"].as_integer().unwrap() > 0);
    assert!(!builtin.contains_key("algorithm"));
    assert_eq!(builtin["data"]["prompts-per-step"].as_integer(), Some(64));
    assert_eq!(r["n"].as_integer(), Some(8));
}

/// The agent spec as shipped passes `pipeline run --dry-run` (every check made before anything
/// runs but the device: the keys, `agent` with `tool`, the program on PATH), which prints the agent's
/// step in place of the rollout command and the built-in evaluation with the tool.
#[test]
fn the_agent_spec_passes_the_pipeline_checks() {
    // Stand-ins where the spec reads its model and data.
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    gsm8k_checkout(w, "qwen2.5-coder-1.5b");
    let o = Command::new(PIPELINE)
        .current_dir(w)
        .args([
            "run",
            AGENT,
            "--dry-run",
            "--steps",
            "10",
            "--device",
            "cpu",
        ])
        .args(["--run-dir", "r"])
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(
        out.contains("run the agent `python3 pipelines/serve_agent.py` on the prompts of"),
        "{out}"
    );
    let eval = out
        .lines()
        .find(|l| l.contains("/rollout ") && l.contains("--top-k 1"))
        .unwrap_or_else(|| panic!("no evaluation in {out}"));
    for flag in ["--tool python", "--max-turns 4", "--system-prompt"] {
        assert!(eval.contains(flag), "{flag}: {eval}");
    }
}

/// With `[rollout] tool`, the agent gets the rollout stage's multi-turn settings in its
/// environment, and `$TANDEM_MAX_TOKENS` is the per-turn cap (the server's --max-tokens).
#[test]
fn the_agent_gets_the_rollouts_multi_turn_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    // The agent writes its environment and fails: the step stops there, before any episode.
    let spec = r#"
seed = 1
steps = 1
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 2
[rollout]
agent = "cmd:sh -c 'env > agent-env.txt; exit 3'"
n = 2
tool = ["python"]
max-turns = 3
max-tool-calls = 2
max-turn-tokens = 5
max-response-tokens = 9
tool-concurrency = 7
tool-timeout = 2.5
system-prompt = "Use the tool."
[score]
reward = "gsm8k"
[advantage]
estimator = "grpo"
[update]
lr = 0.01
"#;
    let o = run_spec(d, spec);
    let out = text(&o);
    assert!(out.contains("failed (exit code 3)"), "{out}");
    let env = std::fs::read_to_string(d.join("agent-env.txt")).unwrap();
    let tandem = real_bins().join("tandem");
    for want in [
        "TANDEM_SYSTEM_PROMPT=Use the tool.".to_string(),
        "TANDEM_TOOLS=[\"python\"]".to_string(),
        "TANDEM_MAX_TURNS=3".to_string(),
        "TANDEM_MAX_TOOL_CALLS=2".to_string(),
        "TANDEM_MAX_TOKENS=5".to_string(),
        "TANDEM_MAX_RESPONSE_TOKENS=9".to_string(),
        "TANDEM_TOOL_CONCURRENCY=7".to_string(),
        "TANDEM_TOOL_TIMEOUT=2.5".to_string(),
        format!("TANDEM_BIN={}", tandem.display()),
    ] {
        assert!(env.lines().any(|l| l == want), "{want} not in\n{env}");
    }
    assert!(!env.contains("TANDEM_MAX_PARALLEL_CALLS"), "{env}");
}

/// An agent step's rollout records the response limit its agent was handed, which the score
/// stage's overlong shaping takes as its L_max, as from a rollout (the tools spec shapes).
#[test]
fn an_agent_steps_overlong_shaping_takes_the_limit_it_was_handed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    model_and_train_set(d, 64, 128, 4);
    let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent_cmd/agent.py");
    let spec = format!(
        r#"
seed = 3
steps = 1
[model]
path = "model"
[data]
train = "train.parquet"
prompts-per-step = 2
[rollout]
agent = "cmd:python3 {}"
n = 2
max-new-tokens = 6
[score]
reward = "regex:[a-z]"
overlong-buffer-len = 2
[advantage]
estimator = "grpo"
[update]
lr = 0.01
"#,
        agent.display()
    );
    let o = run_spec(d, &spec);
    crate::pipeline::assert_ok(&o);
    let b = crate::stage_util::read(&d.join("r/step-0001/rollout.parquet"));
    let params: serde_json::Value = serde_json::from_str(&b.meta["tandem.stage.agent"]).unwrap();
    assert_eq!(params["max_response_tokens"], 6);
    let scored = crate::stage_util::read(&d.join("r/step-0001/scored.parquet"));
    let score: serde_json::Value =
        serde_json::from_str(&scored.meta["tandem.stage.score"]).unwrap();
    assert!(score.to_string().contains("overlong"), "{score}");
}
