//! A model directory as a whole (HF layout): config.json, generation_config.json, safetensors
//! weights, tokenizer files. Loading checks that the weights are exactly what the config implies;
//! saving writes `DIR.tmp` and renames it, so a crash never leaves a half-written model.
//!
//! A *resident* directory (`update --resident` on the warm daemon) has the config and tokenizer
//! files but no weights: they stay in the daemon's memory, and [`RESIDENT_FILE`] says where.
//! Loading its weights is refused with a message that says how to get them.

use super::config::{Config, CONFIG_FILE};
use super::names::{self, expected_tensors};
use super::safetensors::{self as st, Loaded, DEFAULT_MAX_SHARD_BYTES};
use super::tensor::Weights;
use super::{lora, peft};
use crate::error::input_error;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The marker of a resident directory (see [`ResidentMarker`]).
pub const RESIDENT_FILE: &str = "resident.json";

/// `resident.json`: the directory's weights (and optimizer state) are not in files but in the
/// memory of a process, the warm daemon that trained them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResidentMarker {
    /// The socket of the daemon that holds the weights (None: a process without one, e.g.
    /// `tandem bench grpo-step`).
    pub socket: Option<PathBuf>,
    /// That process's id.
    pub pid: u32,
    /// Update calls that made these weights (the trainer's schedule step).
    pub step: u64,
    /// The policy_version of the policy the update started from.
    pub from_policy_version: u64,
}

impl ResidentMarker {
    /// Why `dir`'s weights cannot be read from files, and what to do.
    pub fn refusal(&self, dir: &Path) -> String {
        let holder = match &self.socket {
            Some(s) => format!("the daemon at {} (pid {})", s.display(), self.pid),
            None => format!("process {}", self.pid),
        };
        let how = match &self.socket {
            Some(s) => format!(
                "run the stage with --daemon {s}, or write them to files first with `tandem daemon-ctl save --socket {s} --out DIR`",
                s = s.display()
            ),
            None => "they are gone with that process; use a checkpoint written as files".into(),
        };
        format!(
            "{}: holds no weight files: the weights of update step {} (trained from policy_version {}) stay in the memory of {holder} ({}); {how}",
            dir.display(),
            self.step,
            self.from_policy_version,
            dir.join(RESIDENT_FILE).display()
        )
    }
}

/// Tokenizer files HF keeps next to a model (`chat_template.jinja` is where transformers 5 puts
/// the chat template, `chat_template.json` where processors kept it).
pub const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
];

/// Folders of tokenizer files: transformers 5's named chat templates (`tool_use.jinja`, ...).
pub const TOKENIZER_DIRS: [&str; 1] = ["additional_chat_templates"];

/// An HF model directory.
pub struct ModelDir;

/// How [`ModelDir::save_with`] writes a model.
#[derive(Clone, Copy, Debug)]
pub struct SaveOptions<'a> {
    /// Copy the tokenizer files of this directory.
    pub tokenizer_from: Option<&'a Path>,
    /// Keep the foreign keys of this directory's config.json and generation_config.json.
    pub config_base: Option<&'a Path>,
    /// Shard the weights above this many bytes per file.
    pub max_shard_bytes: u64,
    /// More files to write into the directory (name, contents), e.g. a generated tokenizer.
    pub extra_files: &'a [(String, Vec<u8>)],
    /// Files written elsewhere (by other processes) that are moved into the directory under
    /// their names before it is put in place: it is never there without them.
    pub move_in: &'a [PathBuf],
}

/// Everything [`ModelDir::inspect`] learns about a directory.
pub struct Inspected {
    pub config: Config,
    pub loaded: Loaded,
}

/// The base model directory of a PEFT adapter directory (one with adapter_config.json and no
/// config.json of its own); None for any other directory.
fn adapter_base(path: &Path) -> Result<Option<PathBuf>> {
    if path.join(CONFIG_FILE).is_file() || !peft::is_adapter_dir(path) {
        return Ok(None);
    }
    let (_, base) = peft::read_config(path)?;
    let dir = peft::base_dir(path, &base)?;
    if peft::is_adapter_dir(&dir) && !dir.join(CONFIG_FILE).is_file() {
        crate::bail_input!(
            "{}: the base model {} is itself an adapter; merge it first (tandem merge-lora)",
            path.join(peft::ADAPTER_CONFIG).display(),
            dir.display()
        );
    }
    Ok(Some(dir))
}

impl ModelDir {
    /// Reads the config and the weights, checked against each other.
    pub fn load(path: &Path) -> Result<(Config, Weights)> {
        let Inspected { config, loaded } = Self::inspect(path)?;
        Ok((config, loaded.weights))
    }

    /// Reads only the config (and generation_config) of a model directory.
    pub fn load_config(path: &Path) -> Result<Config> {
        check_is_dir(path)?;
        if let Some(base) = adapter_base(path)? {
            return Config::load(&base);
        }
        Config::load(path)
    }

    /// The marker of a resident directory (None for a model with weight files).
    pub fn resident(path: &Path) -> Result<Option<ResidentMarker>> {
        let file = path.join(RESIDENT_FILE);
        if !file.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| input_error(format!("{}: malformed: {e}", file.display())))
    }

    /// Like [`ModelDir::load`], keeping the on-disk dtypes and file of every tensor.
    pub fn inspect(path: &Path) -> Result<Inspected> {
        if let Some(base) = adapter_base(path)? {
            return Self::inspect_adapter(path, &base);
        }
        let config = Self::load_config(path)?;
        if let Some(marker) = Self::resident(path)? {
            crate::bail_input!("{}", marker.refusal(path));
        }
        let mut loaded = st::load_dir(path)?;
        check_weights(&config, &mut loaded, &path.join(CONFIG_FILE))?;
        Ok(Inspected { config, loaded })
    }

    /// A PEFT LoRA adapter's directory read as its base with the adapter merged on the host
    /// (f64 sums), each merged weight rounded to bf16 as `tandem merge-lora`'s files store it,
    /// so a reader never silently gets the base. The stages that generate or score from an
    /// adapter merge on their backend instead (`Decoder::merge_adapters`), as the daemon does;
    /// the two can differ by one bf16 step in rare elements.
    fn inspect_adapter(path: &Path, base: &Path) -> Result<Inspected> {
        let adapter = peft::read_adapter(path)?;
        let mut ins = Self::inspect(base)?;
        lora::merge_rounded(
            &ins.config,
            &mut ins.loaded.weights,
            &adapter.weights,
            &adapter.spec,
        )?;
        Ok(ins)
    }

    /// Writes a model directory (bf16 weights, HF's default shard limit).
    /// `tokenizer_from` names a directory (usually the model this one was trained from) whose
    /// tokenizer files are copied and whose config.json/generation_config.json keys that we do
    /// not own (e.g. `transformers_version`, sampling defaults) are kept.
    pub fn save(
        dir: &Path,
        cfg: &Config,
        weights: &Weights,
        tokenizer_from: Option<&Path>,
    ) -> Result<()> {
        let opts = SaveOptions {
            tokenizer_from,
            config_base: tokenizer_from,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            extra_files: &[],
            move_in: &[],
        };
        Self::save_with(dir, cfg, weights, &opts)
    }

    /// [`ModelDir::save`] with every choice explicit.
    pub fn save_with(
        dir: &Path,
        cfg: &Config,
        weights: &Weights,
        opts: &SaveOptions,
    ) -> Result<()> {
        let max_shard_bytes = opts.max_shard_bytes;
        let specs = expected_tensors(cfg);
        let mut ordered = Vec::with_capacity(specs.len());
        for spec in &specs {
            let Some(t) = weights.get(&spec.name) else {
                bail!(
                    "cannot save {}: tensor '{}' is missing",
                    dir.display(),
                    spec.name
                );
            };
            if t.shape != spec.shape {
                bail!(
                    "cannot save {}: tensor '{}' has shape {:?}, the config implies {:?}",
                    dir.display(),
                    spec.name,
                    t.shape,
                    spec.shape
                );
            }
            ordered.push((spec.name.as_str(), t));
        }
        if let Some(extra) = weights
            .keys()
            .find(|k| !specs.iter().any(|s| &s.name == *k) && !names::is_ignorable(cfg, k))
        {
            bail!(
                "cannot save {}: tensor '{extra}' is not part of the model",
                dir.display()
            );
        }
        Self::write_dir(dir, cfg, opts, &|tmp| {
            st::save_dir(tmp, &ordered, max_shard_bytes).map(|_| ())
        })
    }

    /// Writes a resident directory: config, generation config and tokenizer files as
    /// [`ModelDir::save_with`] does (its `max_shard_bytes` unused), no weights, and `marker`.
    pub fn save_resident(
        dir: &Path,
        cfg: &Config,
        marker: &ResidentMarker,
        opts: &SaveOptions,
    ) -> Result<()> {
        let mut text = serde_json::to_string_pretty(marker)?;
        text.push('\n');
        Self::write_dir(dir, cfg, opts, &|tmp| {
            let path = tmp.join(RESIDENT_FILE);
            std::fs::write(&path, text.as_bytes())
                .with_context(|| format!("writing {}", path.display()))
        })
    }

    /// Writes the directory `dir` through `DIR.tmp`: config, `body` (the weights, or the resident
    /// marker), tokenizer files and extra files.
    fn write_dir(
        dir: &Path,
        cfg: &Config,
        opts: &SaveOptions,
        body: &dyn Fn(&Path) -> Result<()>,
    ) -> Result<()> {
        let SaveOptions {
            tokenizer_from,
            config_base,
            extra_files,
            move_in,
            ..
        } = *opts;
        for src in tokenizer_from.iter().chain(config_base.iter()) {
            check_is_dir(src)?;
        }
        if dir.file_name().is_none() {
            crate::bail_input!(
                "{}: give the model a directory name of its own to be written to",
                dir.display()
            );
        }
        if dir.exists() && !dir.is_dir() {
            crate::bail_input!("{}: exists and is not a directory", dir.display());
        }
        let tmp = sibling(dir, "tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)
                .with_context(|| format!("removing stale {}", tmp.display()))?;
        }
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let write_all = || -> Result<()> {
            cfg.save(&tmp, config_base)?;
            body(&tmp)?;
            if let Some(src) = tokenizer_from {
                copy_tokenizer_files(src, &tmp)?;
            }
            for (name, bytes) in extra_files {
                let path = tmp.join(name);
                std::fs::write(&path, bytes)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            for from in move_in {
                let to = tmp.join(from.file_name().unwrap_or_default());
                std::fs::rename(from, &to)
                    .with_context(|| format!("moving {} to {}", from.display(), to.display()))?;
            }
            Ok(())
        };
        if let Err(e) = write_all() {
            // Leave nothing half-written behind; the error is what matters.
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        replace_dir(&tmp, dir)
    }
}

/// Copies the tokenizer files and folders of `src` that exist into `dst`.
fn copy_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to)
            .map(|_| ())
            .with_context(|| format!("copying {}", from.display()))
    };
    for name in TOKENIZER_FILES {
        let from = src.join(name);
        if from.is_file() {
            copy(&from, &dst.join(name))?;
        }
    }
    for name in TOKENIZER_DIRS {
        let from = src.join(name);
        if !from.is_dir() {
            continue;
        }
        let to = dst.join(name);
        std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
        for entry in
            std::fs::read_dir(&from).with_context(|| format!("listing {}", from.display()))?
        {
            let path = entry?.path();
            if path.is_file() {
                copy(&path, &to.join(path.file_name().unwrap_or_default()))?;
            }
        }
    }
    Ok(())
}

fn check_is_dir(path: &Path) -> Result<()> {
    if !path.exists() {
        crate::bail_input!("{}: model directory not found", path.display());
    }
    if !path.is_dir() {
        crate::bail_input!(
            "{}: not a directory (give the model directory that holds config.json)",
            path.display()
        );
    }
    Ok(())
}

/// `DIR.suffix` next to `DIR`.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".");
    name.push(suffix);
    dir.with_file_name(name)
}

/// Puts the finished `tmp` in place of `dir`. An existing `dir` is moved aside first and removed
/// only after the new one is in place: `dir` is never a half-written model, and a crash between
/// the two renames leaves the old model complete in `DIR.old` and the new one in `DIR.tmp`.
fn replace_dir(tmp: &Path, dir: &Path) -> Result<()> {
    if dir.exists() {
        let old = sibling(dir, "old");
        if old.exists() {
            std::fs::remove_dir_all(&old)
                .with_context(|| format!("removing stale {}", old.display()))?;
        }
        std::fs::rename(dir, &old).with_context(|| format!("moving {} aside", dir.display()))?;
        std::fs::rename(tmp, dir)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    } else {
        std::fs::rename(tmp, dir)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    }
    Ok(())
}

/// Every tensor the config implies is present with its shape, nothing else is (HF-ignored
/// leftovers are dropped).
fn check_weights(cfg: &Config, loaded: &mut Loaded, config_path: &Path) -> Result<()> {
    let where_of = |loaded: &Loaded, name: &str| -> String {
        loaded
            .file_of
            .get(name)
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    let specs = expected_tensors(cfg);
    for spec in &specs {
        match loaded.weights.get(&spec.name) {
            None => {
                let files: Vec<String> = loaded
                    .files
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                crate::bail_input!(
                    "{}: tensor '{}' is missing (the config {} implies it)",
                    files.join(", "),
                    spec.name,
                    config_path.display()
                );
            }
            Some(t) if t.shape != spec.shape => crate::bail_input!(
                "{}: tensor '{}' has shape {:?}, but {} implies {:?}",
                where_of(loaded, &spec.name),
                spec.name,
                t.shape,
                config_path.display(),
                spec.shape
            ),
            Some(_) => {}
        }
    }
    let extra: Vec<String> = loaded
        .weights
        .keys()
        .filter(|k| !specs.iter().any(|s| &s.name == *k))
        .cloned()
        .collect();
    for name in extra {
        if names::is_ignorable(cfg, &name) {
            loaded.weights.remove(&name);
            loaded.dtypes.remove(&name);
            loaded.file_of.remove(&name);
        } else {
            return Err(input_error(format!(
                "{}: unexpected tensor '{}' (not part of a {} with this config: {})",
                where_of(loaded, &name),
                name,
                cfg.arch.hf_architecture(),
                config_path.display()
            )));
        }
    }
    Ok(())
}
