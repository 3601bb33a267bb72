//! What `update` keeps next to the model it writes so that the next `update` continues
//! exactly where this one stopped:
//! - `optimizer.safetensors` (f32): Adam's `exp_avg.NAME` and `exp_avg_sq.NAME` for every
//!   parameter, and `master.NAME`, the f32 weights (the model files are bf16, so without them
//!   every save would round the weights and the next update would start from a different
//!   point);
//! - `trainer_state.json`: Adam's step count, the learning-rate schedule position (training
//!   steps done) and its settings, the seed.
//!
//! A model directory without these files starts a fresh optimizer (e.g. a downloaded base
//! model). Master weights are used only when they round to exactly the model's bf16 weights,
//! so a model edited by someone else is never silently replaced by stale master weights.

use super::train::LrConfig;
use crate::error::input_error;
use crate::model::decoder::OptimizerState;
use crate::model::safetensors::{load_file, round_bf16};
use crate::model::{Tensor, Weights};
use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
const EXP_AVG: &str = "exp_avg.";
const EXP_AVG_SQ: &str = "exp_avg_sq.";
const MASTER: &str = "master.";

/// `trainer_state.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// AdamW steps taken (bias correction continues from here).
    pub optimizer_step: u64,
    /// `update` calls done: the position in the learning-rate schedule.
    pub schedule_step: u64,
    /// The lr the last call used.
    pub lr: f64,
    pub lr_schedule: LrConfig,
    pub seed: u64,
    /// The optimizer file was left out (`update --skip-optimizer-state`): the state lives only
    /// in the daemon that trained this checkpoint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_not_saved: bool,
}

/// The optimizer file's bytes: moments and master weights, f32. The views borrow the f32 data
/// as bytes (safetensors is little-endian, as every target we build for): at the 0.5B shape
/// this is ~6 GB, so no intermediate byte copy is made.
pub fn optimizer_bytes(state: &OptimizerState, master: &Weights) -> Result<Vec<u8>> {
    const _: () = assert!(cfg!(target_endian = "little"));
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for (prefix, w) in [
        (EXP_AVG, &state.exp_avg),
        (EXP_AVG_SQ, &state.exp_avg_sq),
        (MASTER, master),
    ] {
        for (name, t) in w {
            let bytes: &[u8] = bytemuck::cast_slice(&t.data);
            views.push((
                format!("{prefix}{name}"),
                TensorView::new(Dtype::F32, t.shape.clone(), bytes)?,
            ));
        }
    }
    let meta = HashMap::from([("optimizer_step".to_string(), state.step.to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

pub fn trainer_state_bytes(s: &TrainerState) -> Result<Vec<u8>> {
    let mut text = serde_json::to_string_pretty(s)?;
    text.push('\n');
    Ok(text.into_bytes())
}

fn read_trainer_state(path: &Path) -> Result<TrainerState> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| input_error(format!("{}: malformed: {e}", path.display())))
}

/// Whether a training run can continue from `dir` on a fresh process: the directory holds no
/// trainer state (a fresh optimizer starts, as it did the first time) or holds the optimizer
/// file beside it; false for a checkpoint whose optimizer (or, in a resident directory, whose
/// weights too) stayed in a daemon's memory.
pub fn resumable(dir: &Path) -> Result<bool> {
    if dir.join(crate::model::checkpoint::RESIDENT_FILE).is_file() {
        return Ok(false);
    }
    let ts_path = dir.join(TRAINER_STATE_FILE);
    if !ts_path.is_file() {
        return Ok(true);
    }
    Ok(!read_trainer_state(&ts_path)?.optimizer_not_saved || dir.join(OPTIMIZER_FILE).is_file())
}

/// The state found next to a model.
pub struct Resume {
    pub optimizer: OptimizerState,
    pub trainer: TrainerState,
    /// Present when they match the model's bf16 weights.
    pub master: Option<Weights>,
}

/// Reads the state next to a model whose (bf16-widened) weights are `weights`; None when the
/// directory has no optimizer state.
pub fn load(dir: &Path, weights: &Weights) -> Result<Option<Resume>> {
    let (opt_path, ts_path) = (dir.join(OPTIMIZER_FILE), dir.join(TRAINER_STATE_FILE));
    match (opt_path.is_file(), ts_path.is_file()) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (false, true) if read_trainer_state(&ts_path)?.optimizer_not_saved => crate::bail_input!(
            "{}: its optimizer state was kept in the memory of the daemon that trained it and not saved (update --skip-optimizer-state); continue from a checkpoint that has {OPTIMIZER_FILE} (a pipeline with a daemon saves one every [checkpoint] every steps)",
            dir.display()
        ),
        _ => crate::bail_input!(
            "{}: has only one of {OPTIMIZER_FILE} and {TRAINER_STATE_FILE}; both are needed to resume (remove the other to start a fresh optimizer)",
            dir.display()
        ),
    }
    let trainer = read_trainer_state(&ts_path)?;
    let mut groups: [BTreeMap<String, Tensor>; 3] = Default::default();
    for (name, t, dtype) in load_file(&opt_path)? {
        if dtype != Dtype::F32 {
            crate::bail_input!(
                "{}: tensor '{name}' is {dtype:?}, expected F32",
                opt_path.display()
            );
        }
        let (g, rest) = if let Some(r) = name.strip_prefix(EXP_AVG_SQ) {
            (1, r)
        } else if let Some(r) = name.strip_prefix(EXP_AVG) {
            (0, r)
        } else if let Some(r) = name.strip_prefix(MASTER) {
            (2, r)
        } else {
            crate::bail_input!("{}: unexpected tensor '{name}'", opt_path.display());
        };
        groups[g].insert(rest.to_string(), t);
    }
    let [exp_avg, exp_avg_sq, master] = groups;
    for (what, w) in [("exp_avg", &exp_avg), ("exp_avg_sq", &exp_avg_sq)] {
        for (name, t) in weights {
            match w.get(name) {
                Some(m) if m.shape == t.shape => {}
                Some(m) => crate::bail_input!(
                    "{}: {what} of '{name}' has shape {:?}, the model's is {:?}",
                    opt_path.display(),
                    m.shape,
                    t.shape
                ),
                None => crate::bail_input!("{}: {what} of '{name}' is missing", opt_path.display()),
            }
        }
    }
    let matches = !master.is_empty()
        && master.len() == weights.len()
        && weights.iter().all(|(name, t)| {
            master.get(name).is_some_and(|m| {
                m.shape == t.shape
                    && m.data
                        .iter()
                        .zip(&t.data)
                        .all(|(&a, &b)| round_bf16(a).to_bits() == b.to_bits())
            })
        });
    Ok(Some(Resume {
        optimizer: OptimizerState {
            step: trainer.optimizer_step,
            exp_avg,
            exp_avg_sq,
        },
        trainer,
        master: matches.then_some(master),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::train::LrSchedule;

    fn w(vals: &[f32]) -> Tensor {
        Tensor::new(vec![vals.len()], vals.to_vec())
    }

    #[test]
    fn round_trip_and_master_matching() {
        let dir = tempfile::tempdir().unwrap();
        let master: Weights = [
            ("a".to_string(), w(&[1.0001, -2.5])),
            ("b".to_string(), w(&[0.3])),
        ]
        .into();
        let bf: Weights = master
            .iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    w(&t.data.iter().map(|&x| round_bf16(x)).collect::<Vec<_>>()),
                )
            })
            .collect();
        let state = OptimizerState {
            step: 12,
            exp_avg: [
                ("a".to_string(), w(&[0.1, 0.2])),
                ("b".to_string(), w(&[0.3])),
            ]
            .into(),
            exp_avg_sq: [
                ("a".to_string(), w(&[1e-3, 2e-3])),
                ("b".to_string(), w(&[3e-3])),
            ]
            .into(),
        };
        let ts = TrainerState {
            optimizer_step: 12,
            schedule_step: 3,
            lr: 1e-5,
            lr_schedule: LrConfig {
                lr: 1e-5,
                warmup_steps: 2,
                schedule: LrSchedule::Cosine,
                total_steps: Some(10),
                min_lr_ratio: 0.1,
            },
            seed: 9,
            optimizer_not_saved: false,
        };
        std::fs::write(
            dir.path().join(OPTIMIZER_FILE),
            optimizer_bytes(&state, &master).unwrap(),
        )
        .unwrap();
        std::fs::write(
            dir.path().join(TRAINER_STATE_FILE),
            trainer_state_bytes(&ts).unwrap(),
        )
        .unwrap();
        let r = load(dir.path(), &bf).unwrap().unwrap();
        assert_eq!(r.optimizer, state);
        assert_eq!(r.trainer, ts);
        assert_eq!(r.master.as_ref(), Some(&master));
        // Weights edited elsewhere: master is not used.
        let mut edited = bf.clone();
        edited.get_mut("b").unwrap().data[0] = 0.5;
        assert!(load(dir.path(), &edited).unwrap().unwrap().master.is_none());
        // A parameter the optimizer does not know: input error.
        let mut more = bf.clone();
        more.insert("c".into(), w(&[0.0]));
        let err = load(dir.path(), &more).err().unwrap();
        assert!(
            err.to_string().contains("exp_avg of 'c' is missing"),
            "{err}"
        );
        // Half the state: input error.
        std::fs::remove_file(dir.path().join(TRAINER_STATE_FILE)).unwrap();
        assert!(crate::error::is_input_error(
            &load(dir.path(), &bf).err().unwrap()
        ));
        assert!(load(tempfile::tempdir().unwrap().path(), &bf)
            .unwrap()
            .is_none());
    }
}
