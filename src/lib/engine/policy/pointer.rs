//! `--model`: a model directory, or the pointer file `sync-weights` writes (which checkpoint is
//! the current policy, and its version).

use crate::bail_input;
use crate::error::input_error;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The file `sync-weights` writes: which checkpoint is the current policy, and its version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pointer {
    /// The checkpoint directory; relative paths are relative to the pointer file's directory.
    pub model: String,
    pub policy_version: u64,
}

impl Pointer {
    pub fn read(path: &Path) -> Result<Pointer> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            input_error(format!("{}: cannot read pointer file: {e}", path.display()))
        })?;
        serde_json::from_str(&text).map_err(|e| {
            input_error(format!(
                "{}: not a model directory nor a sync-weights pointer file (JSON with 'model' and 'policy_version'): {e}",
                path.display()
            ))
        })
    }

    /// The checkpoint directory this pointer names, as a usable path.
    pub fn target(&self, pointer_path: &Path) -> PathBuf {
        let p = PathBuf::from(&self.model);
        if p.is_absolute() {
            p
        } else {
            pointer_path.parent().unwrap_or(Path::new("")).join(p)
        }
    }
}

/// A resolved `--model`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRef {
    pub dir: PathBuf,
    /// From the pointer, or 0 for a plain directory.
    pub policy_version: u64,
    pub pointer: Option<PathBuf>,
}

/// `--model` is a model directory or a pointer file written by `sync-weights`.
pub fn resolve_model(path: &Path) -> Result<ModelRef> {
    if path.is_dir() {
        return Ok(ModelRef {
            dir: path.to_path_buf(),
            policy_version: 0,
            pointer: None,
        });
    }
    if !path.exists() {
        bail_input!(
            "--model {}: no such model directory or pointer file",
            path.display()
        );
    }
    let ptr = Pointer::read(path)?;
    let dir = ptr.target(path);
    if !dir.is_dir() {
        bail_input!(
            "{}: the pointer names {}, which is not a directory",
            path.display(),
            dir.display()
        );
    }
    Ok(ModelRef {
        dir,
        policy_version: ptr.policy_version,
        pointer: Some(path.to_path_buf()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_paths_resolve_relative_to_the_pointer() {
        let p = Pointer {
            model: "ckpt/step-3".into(),
            policy_version: 3,
        };
        assert_eq!(
            p.target(Path::new("/runs/a/policy")),
            PathBuf::from("/runs/a/ckpt/step-3")
        );
        let abs = Pointer {
            model: "/models/x".into(),
            policy_version: 1,
        };
        assert_eq!(
            abs.target(Path::new("/runs/a/policy")),
            PathBuf::from("/models/x")
        );
    }

    #[test]
    fn model_refs() {
        let dir = tempfile::tempdir().unwrap();
        let m = resolve_model(dir.path()).unwrap();
        assert_eq!((m.policy_version, m.pointer), (0, None));
        let ptr = dir.path().join("policy");
        std::fs::create_dir(dir.path().join("ck")).unwrap();
        std::fs::write(&ptr, br#"{"model": "ck", "policy_version": 7}"#).unwrap();
        let m = resolve_model(&ptr).unwrap();
        assert_eq!(m.dir, dir.path().join("ck"));
        assert_eq!(m.policy_version, 7);
        assert_eq!(m.pointer.as_deref(), Some(ptr.as_path()));
        let missing = resolve_model(&dir.path().join("nope")).unwrap_err();
        assert!(crate::error::is_input_error(&missing));
        assert_eq!(
            missing.to_string(),
            format!(
                "--model {}: no such model directory or pointer file",
                dir.path().join("nope").display()
            )
        );
        // A pointer to a directory that is gone.
        std::fs::write(&ptr, br#"{"model": "gone", "policy_version": 2}"#).unwrap();
        let gone = resolve_model(&ptr).unwrap_err();
        assert!(crate::error::is_input_error(&gone));
        assert!(
            gone.to_string().contains("which is not a directory"),
            "{gone}"
        );
        std::fs::write(&ptr, b"garbage").unwrap();
        let bad = resolve_model(&ptr).unwrap_err();
        assert!(crate::error::is_input_error(&bad));
        assert!(bad.to_string().contains("pointer file"), "{bad}");
    }
}
