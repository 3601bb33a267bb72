//! Who this process is among the ranks of a job, read from the environment that started it:
//! `tandem launch` and `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT), Slurm's `srun` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the
//! first host of the step's node list), or nothing at all (one rank).

use crate::bail_input;
use crate::error::input_error;
use anyhow::Result;
use serde::Serialize;

/// Port of the rendezvous store when MASTER_PORT is not set (torchrun's default).
pub(crate) const DEFAULT_PORT: u16 = 29500;

/// What started the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// No launcher variables: one rank.
    Single,
    /// RANK / WORLD_SIZE: `tandem launch`, `torchrun` or anything that sets the same variables.
    Env,
    /// SLURM_PROCID / SLURM_NTASKS: one task per rank started by `srun`.
    Slurm,
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct World {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the ranks of this machine (the GPU it uses).
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Index of this machine among the job's machines.
    pub node_rank: usize,
    /// Where rank 0 serves the rendezvous store.
    pub master_addr: String,
    pub master_port: u16,
    pub launcher: Launcher,
}

impl World {
    /// One rank, no launcher.
    pub fn single() -> World {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_PORT,
            launcher: Launcher::Single,
        }
    }

    /// Rank `rank` of `world_size` ranks on this machine, the store at 127.0.0.1:`port` (what
    /// `tandem launch` sets up; also ranks that are threads of one process, in tests).
    pub fn local(rank: usize, world_size: usize, port: u16) -> World {
        World {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            launcher: Launcher::Env,
        }
    }

    /// The world this process's environment describes.
    pub fn from_env() -> Result<World> {
        World::from_vars(|k| std::env::var(k).ok())
    }

    /// The world that the variables `var` returns describe (RANK/WORLD_SIZE first, then
    /// SLURM_*, else one rank). Bad values are input errors naming the variable.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<World> {
        let get = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let world = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            from_torchrun_vars(&get)?
        } else if get("SLURM_PROCID").is_some() {
            from_slurm_vars(&get)?
        } else {
            World::single()
        };
        world.validate()?;
        Ok(world)
    }

    pub(crate) fn is_single(&self) -> bool {
        self.world_size == 1
    }

    /// Whether a launcher started this process (its variables are set), even as a world of
    /// one: such a process runs the data-parallel code paths.
    pub fn launched(&self) -> bool {
        self.launcher != Launcher::Single
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            bail_input!("the world size must be at least 1 (WORLD_SIZE / SLURM_NTASKS is 0)");
        }
        if self.rank >= self.world_size {
            bail_input!(
                "rank {} is outside a world of {} rank(s) (RANK / SLURM_PROCID must be below WORLD_SIZE / SLURM_NTASKS)",
                self.rank,
                self.world_size
            );
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            bail_input!(
                "local rank {} is outside the {} rank(s) of this machine (LOCAL_RANK / SLURM_LOCALID must be below LOCAL_WORLD_SIZE)",
                self.local_rank,
                self.local_world_size
            );
        }
        if self.master_port == 0 {
            bail_input!("MASTER_PORT must be a port number from 1 to 65535, not 0");
        }
        Ok(())
    }
}

fn number<T: std::str::FromStr>(get: &impl Fn(&str) -> Option<String>, key: &str) -> Result<T> {
    let v = get(key).ok_or_else(|| input_error(format!("{key} is not set")))?;
    v.trim().parse().map_err(|_| {
        input_error(format!(
            "{key}='{v}' is not a non-negative integer (from the launcher's environment)"
        ))
    })
}

fn optional<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    key: &str,
) -> Result<Option<T>> {
    match get(key) {
        None => Ok(None),
        Some(_) => number(get, key).map(Some),
    }
}

fn port(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>> {
    optional::<u16>(get, "MASTER_PORT").map_err(|_| {
        input_error(format!(
            "MASTER_PORT='{}' is not a port number (1 to 65535)",
            get("MASTER_PORT").unwrap_or_default()
        ))
    })
}

/// torchrun's variables (what `tandem launch` sets too). Without LOCAL_* the ranks are taken
/// to share one machine.
fn from_torchrun_vars(get: &impl Fn(&str) -> Option<String>) -> Result<World> {
    for key in ["RANK", "WORLD_SIZE"] {
        if get(key).is_none() {
            bail_input!(
                "{key} is not set, but {} is: set both (and MASTER_ADDR, MASTER_PORT), as torchrun or `tandem launch` do",
                if key == "RANK" { "WORLD_SIZE" } else { "RANK" }
            );
        }
    }
    let rank: usize = number(get, "RANK")?;
    let world_size: usize = number(get, "WORLD_SIZE")?;
    let local_world_size: usize = optional(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
    let local_rank: usize = optional(get, "LOCAL_RANK")?.unwrap_or(rank % local_world_size.max(1));
    let node_rank: usize = optional(get, "GROUP_RANK")?.unwrap_or(rank / local_world_size.max(1));
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a.trim().to_string(),
        None if local_world_size >= world_size => "127.0.0.1".into(),
        None => bail_input!(
            "MASTER_ADDR is not set and the {world_size} ranks span several machines: set it to the host of rank 0"
        ),
    };
    Ok(World {
        rank,
        world_size,
        local_rank,
        local_world_size,
        node_rank,
        master_addr,
        master_port: port(get)?.unwrap_or(DEFAULT_PORT),
        launcher: Launcher::Env,
    })
}

/// Slurm's task variables. Rank 0 runs on the first node of the step (block or cyclic
/// distribution both put task 0 there), which serves the store unless MASTER_ADDR says
/// otherwise. Without MASTER_PORT the port comes from the job id, so that two jobs sharing a
/// node do not collide.
fn from_slurm_vars(get: &impl Fn(&str) -> Option<String>) -> Result<World> {
    let rank: usize = number(get, "SLURM_PROCID")?;
    let world_size: usize = match get("SLURM_NTASKS") {
        Some(_) => number(get, "SLURM_NTASKS")?,
        None => number(get, "SLURM_NPROCS")?,
    };
    let local_rank: usize = optional(get, "SLURM_LOCALID")?.unwrap_or(0);
    let node_rank: usize = optional(get, "SLURM_NODEID")?.unwrap_or(0);
    let local_world_size = match get("SLURM_STEP_TASKS_PER_NODE").or(get("SLURM_TASKS_PER_NODE")) {
        Some(spec) => {
            let counts = expand_tasks_per_node(&spec)?;
            *counts.get(node_rank).ok_or_else(|| {
                input_error(format!(
                    "SLURM_TASKS_PER_NODE='{spec}' lists {} node(s), but SLURM_NODEID is {node_rank}",
                    counts.len()
                ))
            })?
        }
        None => optional(get, "SLURM_NTASKS_PER_NODE")?.unwrap_or(local_rank + 1),
    };
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a.trim().to_string(),
        None => {
            let (key, list) = [
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]
            .iter()
            .find_map(|k| get(k).map(|v| (*k, v)))
            .ok_or_else(|| {
                input_error(
                    "SLURM_PROCID is set but no node list (SLURM_JOB_NODELIST) nor MASTER_ADDR: \
                         cannot tell where rank 0 runs",
                )
            })?;
            first_host(&list).map_err(|e| input_error(format!("{key}: {e:#}")))?
        }
    };
    let job_port = match optional::<u64>(get, "SLURM_JOB_ID")? {
        Some(id) => 20000 + (id % 20000) as u16,
        None => DEFAULT_PORT,
    };
    Ok(World {
        rank,
        world_size,
        local_rank,
        local_world_size,
        node_rank,
        master_addr,
        master_port: port(get)?.unwrap_or(job_port),
        launcher: Launcher::Slurm,
    })
}

/// Splits at top-level commas (commas inside brackets belong to a range list).
fn split_top(s: &str) -> Result<Vec<&str>> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    bail_input!("node list '{s}': ']' without '['");
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        bail_input!("node list '{s}': '[' without ']'");
    }
    out.push(&s[start..]);
    Ok(out)
}

/// The values of one bracket: `03-05,7` -> 03 04 05 7 (a range keeps the width of its lower
/// bound, as Slurm pads it).
fn expand_ranges(body: &str, list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for part in body.split(',') {
        let bad = || input_error(format!("node list '{list}': bad range '{part}'"));
        match part.split_once('-') {
            Some((lo, hi)) => {
                let width = lo.len();
                let a: u64 = lo.parse().map_err(|_| bad())?;
                let b: u64 = hi.parse().map_err(|_| bad())?;
                if b < a || b - a > 1_000_000 {
                    return Err(bad());
                }
                out.extend((a..=b).map(|v| format!("{v:0width$}")));
            }
            None => {
                if part.is_empty() || !part.chars().all(|c| c.is_ascii_digit()) {
                    return Err(bad());
                }
                out.push(part.to_string());
            }
        }
    }
    Ok(out)
}

/// Every host of a Slurm node list, in order: `gpu[03-05,7],cpu1` -> gpu03 gpu04 gpu05 gpu7
/// cpu1. Several brackets in one name expand to their product (`r[1-2]n[1-2]`).
pub(crate) fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let mut hosts = Vec::new();
    for item in split_top(list.trim())? {
        if item.is_empty() {
            bail_input!("node list '{list}': empty host name");
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while let Some(open) = rest.find('[') {
            let close = rest[open..]
                .find(']')
                .map(|c| open + c)
                .ok_or_else(|| input_error(format!("node list '{list}': '[' without ']'")))?;
            let values = expand_ranges(&rest[open + 1..close], list)?;
            let prefix = &rest[..open];
            names = names
                .iter()
                .flat_map(|n| values.iter().map(move |v| format!("{n}{prefix}{v}")))
                .collect();
            rest = &rest[close + 1..];
        }
        hosts.extend(names.into_iter().map(|n| n + rest));
    }
    Ok(hosts)
}

/// The first host of a Slurm node list (where task 0 runs).
pub(crate) fn first_host(list: &str) -> Result<String> {
    expand_nodelist(list)?
        .into_iter()
        .next()
        .ok_or_else(|| input_error(format!("node list '{list}' is empty")))
}

/// Slurm's tasks-per-node list: `2(x3),1` -> [2, 2, 2, 1].
pub(crate) fn expand_tasks_per_node(spec: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.trim().split(',') {
        let bad = || input_error(format!("tasks per node '{spec}': bad entry '{part}'"));
        let (count, times) = match part.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let times: usize = times.parse().map_err(|_| bad())?;
        out.extend(std::iter::repeat_n(count, times));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<World> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn nodelists_expand_like_slurm() {
        assert_eq!(
            expand_nodelist("gpu[03-05,7],cpu1").unwrap(),
            ["gpu03", "gpu04", "gpu05", "gpu7", "cpu1"]
        );
        assert_eq!(first_host("gpu[03-05,7],cpu1").unwrap(), "gpu03");
        assert_eq!(expand_nodelist("node1").unwrap(), ["node1"]);
        assert_eq!(
            expand_nodelist("a[8-10]-ib").unwrap(),
            ["a8-ib", "a9-ib", "a10-ib"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[01-02]").unwrap(),
            ["r1n01", "r1n02", "r2n01", "r2n02"]
        );
        for bad in ["gpu[1-", "gpu]1", "gpu[3-1]", "gpu[x]", "a,,b", "gpu[]"] {
            let err = expand_nodelist(bad).unwrap_err();
            assert!(crate::error::is_input_error(&err), "{bad}: {err:#}");
        }
    }

    #[test]
    fn tasks_per_node_expand() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert!(expand_tasks_per_node("2(x3").is_err());
    }

    #[test]
    fn no_variables_is_one_rank() {
        assert_eq!(world(&[]).unwrap(), World::single());
    }

    #[test]
    fn torchrun_variables() {
        let w = world(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            w,
            World {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: "node0".into(),
                master_port: 1234,
                launcher: Launcher::Env,
            }
        );
        // One machine: local values and the address default.
        let w = world(&[("RANK", "2"), ("WORLD_SIZE", "3")]).unwrap();
        assert_eq!((w.local_rank, w.local_world_size), (2, 3));
        assert_eq!(
            (w.master_addr.as_str(), w.master_port),
            ("127.0.0.1", 29500)
        );
    }

    #[test]
    fn torchrun_variables_errors_name_the_variable() {
        let msg = |v: &[(&str, &str)]| format!("{:#}", world(v).unwrap_err());
        assert!(msg(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK='x'"));
        assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("rank 2 is outside"));
        assert!(
            msg(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")])
                .contains("MASTER_PORT='99999'")
        );
        assert!(msg(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2")
        ])
        .contains("MASTER_ADDR is not set"));
        assert!(crate::error::is_input_error(
            &world(&[("RANK", "0")]).unwrap_err()
        ));
    }

    #[test]
    fn slurm_variables() {
        let w = world(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4,3"),
            ("SLURM_JOB_NODELIST", "gpu[03-05,7],cpu1"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap();
        assert_eq!(
            w,
            World {
                rank: 5,
                world_size: 7,
                local_rank: 1,
                local_world_size: 3,
                node_rank: 1,
                master_addr: "gpu03".into(),
                master_port: 20000 + 3456,
                launcher: Launcher::Slurm,
            }
        );
        // The step's node list wins over the job's; MASTER_ADDR/PORT over both.
        let w = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_NODELIST", "b[2-3]"),
            ("SLURM_JOB_NODELIST", "b[1-3]"),
        ])
        .unwrap();
        assert_eq!(w.master_addr, "b2");
        let w = world(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "b[1-3]"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.0.0.1", 4000));
        // RANK/WORLD_SIZE (torchrun inside an allocation) take precedence over SLURM_*.
        let w = world(&[("SLURM_PROCID", "3"), ("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
        assert_eq!((w.rank, w.launcher), (1, Launcher::Env));
        let err = world(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).unwrap_err();
        assert!(format!("{err:#}").contains("no node list"), "{err:#}");
    }
}
