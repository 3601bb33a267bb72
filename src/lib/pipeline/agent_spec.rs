//! The spec's `[rollout] agent = "cmd:PROGRAM ARGS…"` and `agent-timeout`: read and checked
//! against the rest of the spec here (below `spec`, which calls it); what the runner does with
//! them is `super::agent`'s.

use crate::bail_input;
use crate::error::input_error;
use crate::process::split_args;
use anyhow::Result;
use std::path::Path;
use std::time::Duration;

/// The `[rollout]` keys that are the agent's, not the rollout stage's flags.
pub(crate) const KEYS: [&str; 2] = ["agent", "agent-timeout"];

/// The user's program, as the spec gives it.
pub(crate) struct AgentCmd {
    /// `PROGRAM ARGS…` as written after `cmd:`.
    pub(crate) command: String,
    pub(crate) argv: Vec<String>,
    pub(crate) timeout: Option<Duration>,
}

/// What of the rest of the spec an agent step cannot go with.
pub(crate) struct Around {
    pub(crate) daemon: bool,
    pub(crate) gpus: u64,
    pub(crate) filter_groups: bool,
}

/// The `[rollout]` table less the agent's keys: the rollout stage's flags.
pub(crate) fn stage_keys(rollout: &toml::Table) -> toml::Table {
    let mut t = rollout.clone();
    for k in KEYS {
        t.remove(k);
    }
    t
}

/// The agent of the `[rollout]` table (None without `agent`); `at` places a key in the spec.
pub(crate) fn parse(
    rollout: &toml::Table,
    around: &Around,
    at: &dyn Fn(&str) -> String,
) -> Result<Option<AgentCmd>> {
    let Some(value) = rollout.get("agent") else {
        if rollout.contains_key("agent-timeout") {
            bail_input!(
                "{}: [rollout] agent-timeout has no effect without agent = \"cmd:PROGRAM …\"",
                at("agent-timeout")
            );
        }
        return Ok(None);
    };
    let key = format!("[rollout] agent = {value}");
    let command = match value.as_str().map(|s| s.strip_prefix("cmd:")) {
        Some(Some(c)) => c.trim().to_string(),
        _ => bail_input!(
            "{}: {key}: write \"cmd:PROGRAM ARGS…\" (the program that plays the step's episodes)",
            at("agent")
        ),
    };
    let argv =
        split_args(&command).map_err(|e| input_error(format!("{}: {key}: {e}", at("agent"))))?;
    if argv.is_empty() {
        bail_input!("{}: {key}: no program after `cmd:`", at("agent"));
    }
    let timeout = match rollout.get("agent-timeout") {
        None => None,
        Some(toml::Value::Integer(s)) if *s > 0 => Some(Duration::from_secs(*s as u64)),
        Some(v) => bail_input!(
            "{}: [rollout] agent-timeout = {v}: a whole number of seconds, at least 1",
            at("agent-timeout")
        ),
    };
    // Without a daemon the server loads its own copy of the policy, on one device; a daemon
    // group spreads the server's batches over its ranks.
    let why = if around.gpus > 1 && !around.daemon {
        Some(format!("not with gpus = {} without daemon = true: the agent's server loads the policy on one device; set daemon = true (its batches then run on the daemon group's ranks) or gpus = 1", around.gpus))
    } else if around.filter_groups {
        Some("not with [algorithm] filter-groups = true: dynamic sampling's rounds run the rollout stage; drop one of them".to_string())
    } else {
        None
    };
    if let Some(why) = why {
        bail_input!("{}: {key}: {why}", at("agent"));
    }
    Ok(Some(AgentCmd {
        command,
        argv,
        timeout,
    }))
}

/// `[score] reward = "agent"` (the rewards the agent posted) needs an agent to post them, and
/// no evaluation: `[eval]` runs the rollout stage, whose rows carry no posted reward.
pub(crate) fn check_reward(reward: &str, agent: bool, eval_every: u64, at: &str) -> Result<()> {
    if reward != "agent" {
        return Ok(());
    }
    if !agent {
        bail_input!(
            "{at}: [score] reward = \"agent\" keeps the rewards your agent posts, which needs [rollout] agent = \"cmd:PROGRAM …\"; without an agent, choose a reward that scores the responses"
        );
    }
    if eval_every > 0 {
        bail_input!(
            "{at}: [score] reward = \"agent\" with [eval] every = {eval_every}: the evaluation runs the rollout stage, whose rows carry no reward posted by the agent; set [eval] every = 0"
        );
    }
    Ok(())
}

impl AgentCmd {
    /// The program can be started: a path that is a file, or a name found on PATH.
    pub(crate) fn check_program(&self) -> Result<()> {
        let program = Path::new(&self.argv[0]);
        let found = match self.argv[0].contains('/') {
            true => program.is_file(),
            false => std::env::var_os("PATH")
                .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file())),
        };
        if !found {
            bail_input!(
                "[rollout] agent = \"cmd:{}\": program `{}` not found (a path from the directory the pipeline runs in, or a name on PATH)",
                self.command,
                self.argv[0]
            );
        }
        Ok(())
    }
}

/// The dry-run and commands.sh line of an agent step: serving `policy` (on the daemon at
/// `daemon`, if any), the agent on `prompts` with `n` episodes each, collected into `rollout`.
pub(crate) fn describe(
    rollout_table: &toml::Table,
    policy: &Path,
    daemon: Option<&Path>,
    prompts: &Path,
    n: usize,
    rollout: &Path,
) -> String {
    let command = rollout_table
        .get("agent")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let command = command.strip_prefix("cmd:").unwrap_or(command).trim();
    let on = daemon.map_or(String::new(), |d| {
        format!(" (generating on the daemon at {})", d.display())
    });
    format!(
        "# pipeline: serve {} with `tandem serve` on 127.0.0.1{on}, run the agent `{command}` on the prompts of {} ({n} episodes each), collect its trajectories into {}",
        policy.display(),
        prompts.display(),
        rollout.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_keys_are_not_rollout_flags() {
        let t: toml::Table =
            toml::from_str("agent = \"cmd:a\"\nagent-timeout = 3\nn = 2\n").unwrap();
        assert_eq!(stage_keys(&t).keys().collect::<Vec<_>>(), ["n"]);
        let around = Around {
            daemon: false,
            gpus: 1,
            filter_groups: false,
        };
        let a = parse(&t, &around, &|k| format!("at {k}")).unwrap().unwrap();
        assert_eq!(a.argv, ["a"]);
        assert_eq!(a.timeout, Some(Duration::from_secs(3)));
        let t: toml::Table = toml::from_str("agent = \"cmd: 'my agent.py' --k 1\"\n").unwrap();
        let a = parse(&t, &around, &|k| k.to_string()).unwrap().unwrap();
        assert_eq!(a.argv, ["my agent.py", "--k", "1"]);
        let t: toml::Table = toml::from_str("agent = \"cmd:   \"\n").unwrap();
        let e = parse(&t, &around, &|k| format!("s.toml [{k}]"))
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "s.toml [agent]: [rollout] agent = \"cmd:   \": no program after `cmd:`"
        );
    }
}
