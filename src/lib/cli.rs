//! The command lines of every binary, in one table: the stage binaries and `pipeline` are
//! [`BINARIES`], each its clap command (the stage's own flags, `crate::stage::STAGES`) and the
//! code it runs. A stage binary's `main` is [`binary_main`]; `tandem` takes the same commands as
//! subcommands ([`with_binaries`]: `tandem rollout …` is `rollout …`), and generates shell
//! completions and man pages from them ([`completions`], [`man`]), so every flag is declared
//! once for the binary, `tandem`, the completions and the man pages.

use crate::daemon::run_stage;
use crate::error::input_error;
use crate::stage::{self, StageJob};
use crate::version::VERSION;
use anyhow::Result;
use clap::{ArgMatches, Args, Command, FromArgMatches};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// A binary of the package besides `tandem`.
pub struct Binary {
    pub name: &'static str,
    /// Its command line (flags, help, version).
    pub command: fn() -> Command,
    /// What it runs with the parsed flags.
    pub run: fn(&ArgMatches) -> Result<()>,
}

/// The stage binaries in the order of a step, then `pipeline`.
pub const BINARIES: &[Binary] = &[
    Binary {
        name: "rollout",
        command: || stage_command("rollout"),
        run: |m| run_stage(StageJob::Rollout(parse(m)?)),
    },
    Binary {
        name: "score",
        command: || stage_command("score"),
        run: |m| stage::score::run(parse(m)?),
    },
    Binary {
        name: "ref-logprob",
        command: || stage_command("ref-logprob"),
        run: |m| run_stage(StageJob::RefLogprob(parse(m)?)),
    },
    Binary {
        name: "values",
        command: || stage_command("values"),
        run: |m| run_stage(StageJob::Values(parse(m)?)),
    },
    Binary {
        name: "advantage",
        command: || stage_command("advantage"),
        run: |m| stage::advantage::run(&parse(m)?),
    },
    Binary {
        name: "update",
        command: || stage_command("update"),
        run: |m| run_stage(StageJob::Update(parse(m)?)),
    },
    Binary {
        name: "sync-weights",
        command: || stage_command("sync-weights"),
        run: |m| run_stage(StageJob::SyncWeights(parse(m)?)),
    },
    Binary {
        name: "pipeline",
        command: pipeline_command,
        run: |m| match m.subcommand() {
            Some(("run", run)) => crate::pipeline::run(parse(run)?),
            _ => unreachable!("clap requires the subcommand"),
        },
    },
];

/// The binary `name` of [`BINARIES`].
pub fn binary(name: &str) -> Option<&'static Binary> {
    BINARIES.iter().find(|b| b.name == name)
}

/// The `main` of the binary `name`: parses this process's arguments with its command (help,
/// version and parse errors print and exit as clap does, 2 for an error), then runs it (exit 2
/// for bad input, 1 for a failure).
pub fn binary_main(name: &str) -> ExitCode {
    let bin = binary(name).unwrap_or_else(|| panic!("{name} is not in BINARIES"));
    let matches = (bin.command)().get_matches();
    crate::error::run_main(|| (bin.run)(&matches))
}

fn stage_command(name: &str) -> Command {
    let def = stage::def(name).unwrap_or_else(|| panic!("{name} is not in STAGES"));
    (def.command)()
}

fn parse<A: FromArgMatches>(m: &ArgMatches) -> Result<A> {
    A::from_arg_matches(m).map_err(|e| input_error(stage::clap_message(&e)))
}

fn pipeline_command() -> Command {
    let run = crate::pipeline::RunArgs::augment_args(Command::new("run"));
    Command::new("pipeline")
        .version(VERSION)
        .about("Run an RL post-training pipeline (rollout, score, ref-logprob, advantage, update, sync-weights) step after step")
        .subcommand_required(true)
        .arg_required_else_help(true)
        .subcommand(run)
}

/// `tandem`'s own command (`tools`: its utility subcommands) with every binary of [`BINARIES`]
/// as a subcommand first, and `completions` and `man`.
pub fn with_binaries(tools: Command) -> Command {
    // The binaries first, in the order of a step, then the tools in their order.
    let names: Vec<String> = tools
        .get_subcommands()
        .map(|s| s.get_name().into())
        .collect();
    let mut cmd = tools;
    for (i, name) in names.iter().enumerate() {
        cmd = cmd.mut_subcommand(name, |s| s.display_order(BINARIES.len() + i));
    }
    let mut cmd = cmd.version(VERSION).after_help(
        "The stages and `pipeline` are also binaries of their own, installed next to \
             `tandem`: `tandem rollout ARGS` runs `rollout ARGS`.",
    );
    for (i, bin) in BINARIES.iter().enumerate() {
        cmd = cmd.subcommand((bin.command)().display_order(i));
    }
    cmd.subcommand(completions_command())
        .subcommand(man_command())
}

/// `tandem`'s subcommands that are not tools: a binary's name, `completions` or `man`. Runs
/// it and returns its result, or None for a tool subcommand. `tandem` is the whole command
/// (from [`with_binaries`]), for the completions and man pages.
pub fn run_builtin(tandem: &Command, matches: &ArgMatches) -> Option<Result<()>> {
    let (name, sub) = matches.subcommand()?;
    if let Some(bin) = binary(name) {
        return Some((bin.run)(sub));
    }
    match name {
        "completions" => Some(completions(tandem, sub)),
        "man" => Some(man(tandem, sub)),
        _ => None,
    }
}

/// Every command to generate for: `tandem`, then each binary.
fn all_commands(tandem: &Command) -> Vec<Command> {
    std::iter::once(tandem.clone())
        .chain(BINARIES.iter().map(|b| (b.command)()))
        .collect()
}

const SHELLS: [&str; 3] = ["bash", "zsh", "fish"];

fn completions_command() -> Command {
    Command::new("completions")
        .about("Print shell completions for `tandem` and every stage binary")
        .long_about(
            "Print shell completions for `tandem` and every stage binary. bash: \
             `source <(tandem completions bash)` (or save it in \
             ~/.local/share/bash-completion/completions/tandem); zsh: save it as `_tandem` \
             in a directory of $fpath; fish: save it in ~/.config/fish/completions/tandem.fish.",
        )
        .arg(
            clap::Arg::new("shell")
                .required(true)
                .value_parser(SHELLS)
                .help("The shell to complete in"),
        )
}

/// `tandem completions SHELL`: the scripts of every command, one after the other (each
/// registers its own command, so the whole can be sourced or saved as one file).
fn completions(tandem: &Command, m: &ArgMatches) -> Result<()> {
    use clap_complete::Shell;
    let shell = match m.get_one::<String>("shell").map(String::as_str) {
        Some("bash") => Shell::Bash,
        Some("zsh") => Shell::Zsh,
        Some("fish") => Shell::Fish,
        other => unreachable!("clap checks the shell: {other:?}"),
    };
    let mut out = Vec::new();
    for mut cmd in all_commands(tandem) {
        let name = cmd.get_name().to_string();
        clap_complete::generate(shell, &mut cmd, name, &mut out);
    }
    std::io::Write::write_all(&mut std::io::stdout(), &out)?;
    Ok(())
}

fn man_command() -> Command {
    Command::new("man")
        .about("Print a man page, or write every one with --out")
        .arg(
            clap::Arg::new("name")
                .help("Whose page: `tandem` (the default), a binary (`rollout`) or a subcommand of tandem (`plot`)"),
        )
        .arg(
            clap::Arg::new("out")
                .long("out")
                .value_name("DIR")
                .value_parser(clap::value_parser!(PathBuf))
                .conflicts_with("name")
                .help("Write every page into DIR (`tandem.1`, `tandem-plot.1`, `rollout.1`, …) instead"),
        )
}

/// `tandem man [NAME] [--out DIR]`.
fn man(tandem: &Command, m: &ArgMatches) -> Result<()> {
    if let Some(dir) = m.get_one::<PathBuf>("out") {
        return write_man_pages(tandem, dir);
    }
    let name = m.get_one::<String>("name").map_or("tandem", String::as_str);
    let pages = man_pages(tandem)?;
    let wanted = [format!("{name}.1"), format!("tandem-{name}.1")];
    let Some((_, page)) = pages.iter().find(|(file, _)| wanted.contains(file)) else {
        let names: Vec<&str> = pages
            .iter()
            .map(|(f, _)| f.trim_end_matches(".1"))
            .collect();
        crate::bail_input!("man: no page '{name}'; the pages: {}", names.join(", "));
    };
    std::io::Write::write_all(&mut std::io::stdout(), page)?;
    Ok(())
}

/// Every man page as (file name, roff text): `tandem.1`, `tandem-TOOL.1` for each tool
/// subcommand of tandem, and `NAME.1` for each binary.
fn man_pages(tandem: &Command) -> Result<Vec<(String, Vec<u8>)>> {
    let mut tandem = tandem.clone();
    // Fills in what clap derives lazily (help and version flags of the subcommands, their
    // display names `tandem-plot`), as the pages show them.
    tandem.build();
    let mut pages = Vec::new();
    let mut render = |file: String, cmd: Command| -> Result<()> {
        let mut text = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut text)?;
        pages.push((file, text));
        Ok(())
    };
    render("tandem.1".into(), tandem.clone())?;
    // A binary's page is `rollout.1` (below), not also `tandem-rollout.1`.
    let tool = |s: &&Command| binary(s.get_name()).is_none() && s.get_name() != "help";
    for sub in tandem.get_subcommands().filter(tool) {
        let sub = sub.clone();
        let name = sub.get_display_name().unwrap_or(sub.get_name()).to_string();
        render(format!("{name}.1"), sub)?;
    }
    for bin in BINARIES {
        render(format!("{}.1", bin.name), (bin.command)())?;
    }
    Ok(pages)
}

fn write_man_pages(tandem: &Command, dir: &Path) -> Result<()> {
    let pages = man_pages(tandem)?;
    for (file, text) in &pages {
        crate::batch::write::write_atomic(&dir.join(file), text)?;
    }
    eprintln!("man: wrote {} pages to {}", pages.len(), dir.display());
    Ok(())
}
