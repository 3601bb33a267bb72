//! What `update` keeps next to the model it writes so that the next `update` continues
//! exactly where this one stopped:
//! - `optimizer.safetensors` (f32): Adam's `exp_avg.NAME` and `exp_avg_sq.NAME` for every
//!   parameter, and `master.NAME`, the f32 weights (the model files are bf16, so without them
//!   every save would round the weights and the next update would start from a different
//!   point);
//! - `trainer_state.json`: Adam's step count, the learning-rate schedule position (training
//!   steps done) and its settings, the seed.
//!
//! `update` on N > 1 ranks writes no `optimizer.safetensors`: each rank writes its own shard
//! of the masters and moments (the flat bucket layout it owns) as
//! `optimizer.rankRRRRR-of-NNNNN.safetensors` ([`shard_file_name`]; the file format is
//! `crate::engine::shard::files`), and `trainer_state.json`
//! records `optimizer_shards: N`. Such a checkpoint is complete only with every shard. It
//! loads with any number of ranks and any layout: with the same N and layout each rank reads
//! its own file ([`load_rank`]), otherwise each rank cuts its shard from the files, reading
//! only the spans that hold its elements ([`reshard`]), and one process puts the whole state back together
//! ([`whole_from_shards`]). `tandem merge-shards` ([`merge_shards`]) makes it one
//! `optimizer.safetensors`.
//!
//! A model directory without these files starts a fresh optimizer (e.g. a downloaded base
//! model). Master weights are used only when they round to exactly the model's bf16 weights,
//! so a model edited by someone else is never silently replaced by stale master weights.

pub(crate) use super::shard::files::read_shard;
use super::shard::files::{f32_view, shard_path, ShardSet, EXP_AVG, EXP_AVG_SQ, MASTER};
pub use super::shard::files::{shard_file_name, write_shard};
use super::train::LrConfig;
use crate::batch::write::write_atomic;
use crate::engine::shard::{HostShard, ShardLayout};
use crate::error::input_error;
use crate::model::decoder::OptimizerState;
use crate::model::safetensors::{self as st, load_file, round_bf16};
use crate::model::{Tensor, Weights};
use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub(crate) const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub(crate) const TRAINER_STATE_FILE: &str = "trainer_state.json";

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
    /// The optimizer state is in this many per-rank shard files instead of
    /// `optimizer.safetensors` (0: not sharded).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub optimizer_shards: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The whole masters and optimizer state put back together from every rank's shard file of a
/// sharded checkpoint (for checks and `tandem merge-shards`: `update` itself never gathers
/// them). Every shard must be there, at the trainer state's optimizer step.
pub fn whole_from_shards(dir: &Path) -> Result<(Weights, OptimizerState)> {
    let ts_path = dir.join(TRAINER_STATE_FILE);
    let trainer = read_trainer_state(&ts_path)?;
    if trainer.optimizer_shards == 0 {
        crate::bail_input!(
            "{}: its optimizer state is not sharded (optimizer_shards is 0 in {}): it loads with any number of ranks as it is",
            dir.display(),
            ts_path.display()
        );
    }
    shard_set(dir, &trainer, &ts_path).whole()
}

/// The shard files of sharded checkpoint `dir` as its trainer state (read from `ts_path`)
/// describes them.
fn shard_set<'a>(dir: &'a Path, trainer: &TrainerState, ts_path: &'a Path) -> ShardSet<'a> {
    ShardSet {
        dir,
        n: trainer.optimizer_shards,
        step: trainer.optimizer_step,
        told_by: ts_path,
    }
}

/// Writes the optimizer file (moments and master weights, f32) to `path`, streamed from the
/// tensors (at the 7B shape it is 91 GB: no copy of it is made in memory).
pub fn write_optimizer(path: &Path, state: &OptimizerState, master: &Weights) -> Result<()> {
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for (prefix, w) in [
        (EXP_AVG, &state.exp_avg),
        (EXP_AVG_SQ, &state.exp_avg_sq),
        (MASTER, master),
    ] {
        for (name, t) in w {
            views.push((
                format!("{prefix}{name}"),
                f32_view(&t.data, t.shape.clone())?,
            ));
        }
    }
    let meta = HashMap::from([("optimizer_step".to_string(), state.step.to_string())]);
    st::write_file(path, views, Some(meta))
}

pub(crate) fn trainer_state_bytes(s: &TrainerState) -> Result<Vec<u8>> {
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

/// The trainer state next to a model (None when there is none).
pub fn trainer_state(dir: &Path) -> Result<Option<TrainerState>> {
    let path = dir.join(TRAINER_STATE_FILE);
    match path.is_file() {
        true => read_trainer_state(&path).map(Some),
        false => Ok(None),
    }
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
    let ts = read_trainer_state(&ts_path)?;
    if ts.optimizer_shards > 0 {
        let n = ts.optimizer_shards;
        return Ok((0..n).all(|r| dir.join(shard_file_name(r, n)).is_file()));
    }
    Ok(!ts.optimizer_not_saved || dir.join(OPTIMIZER_FILE).is_file())
}

/// What one rank of a data-parallel update resumes from.
pub(crate) enum RankResume {
    /// An unsharded checkpoint (any number of ranks loads it).
    Whole(Resume),
    /// A sharded checkpoint: where this rank's shard comes from.
    Shard {
        source: ShardSource,
        trainer: TrainerState,
    },
}

/// The state next to a model for rank `rank` of `world` ranks (see [`load`]; None when the
/// directory has none). Of a sharded checkpoint written by as many ranks this rank reads only
/// its own shard file; written by another number, it reads none here: [`ShardSource`] cuts
/// its shard from the files once the update knows its layout.
pub(crate) fn load_rank(
    dir: &Path,
    weights: &Weights,
    rank: usize,
    world: usize,
) -> Result<Option<RankResume>> {
    let ts_path = dir.join(TRAINER_STATE_FILE);
    let trainer = match ts_path.is_file() {
        true => Some(read_trainer_state(&ts_path)?),
        false => None,
    };
    let Some(trainer) = trainer.filter(|t| t.optimizer_shards > 0) else {
        return Ok(load(dir, weights)?.map(RankResume::Whole));
    };
    let sharded = trainer.optimizer_shards;
    let own = match sharded == world {
        true => {
            let path = shard_path(dir, rank, sharded)?;
            let shard = read_shard(&path)?;
            if shard.rank != rank || shard.step != trainer.optimizer_step {
                crate::bail_input!(
                    "{}: is rank {} of {} at optimizer step {}, expected rank {rank} of {world} at step {} ({})",
                    path.display(),
                    shard.rank,
                    shard.layout.world_size,
                    shard.step,
                    trainer.optimizer_step,
                    ts_path.display()
                );
            }
            Some(shard)
        }
        false => None,
    };
    Ok(Some(RankResume::Shard {
        source: ShardSource {
            dir: dir.to_path_buf(),
            own,
        },
        trainer,
    }))
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
    let trainer = match ts_path.is_file() {
        true => Some(read_trainer_state(&ts_path)?),
        false => None,
    };
    let (trainer, master, optimizer, source) = match (trainer, opt_path.is_file()) {
        (None, false) => return Ok(None),
        // Written by N ranks: the whole state put back together from their files.
        (Some(t), _) if t.optimizer_shards > 0 => {
            let (master, optimizer) = whole_from_shards(dir)?;
            (t, master, optimizer, dir.display().to_string())
        }
        (Some(t), true) => {
            let (master, optimizer) = read_optimizer_file(&opt_path, t.optimizer_step)?;
            (t, master, optimizer, opt_path.display().to_string())
        }
        (Some(t), false) if t.optimizer_not_saved => crate::bail_input!(
            "{}: its optimizer state was kept in the memory of the daemon that trained it and not saved (update --skip-optimizer-state); continue from a checkpoint that has {OPTIMIZER_FILE} (a pipeline with a daemon saves one every [checkpoint] every steps)",
            dir.display()
        ),
        _ => crate::bail_input!(
            "{}: has only one of {OPTIMIZER_FILE} and {TRAINER_STATE_FILE}; both are needed to resume (remove the other to start a fresh optimizer)",
            dir.display()
        ),
    };
    for (what, w) in [
        ("exp_avg", &optimizer.exp_avg),
        ("exp_avg_sq", &optimizer.exp_avg_sq),
    ] {
        for (name, t) in weights {
            match w.get(name) {
                Some(m) if m.shape == t.shape => {}
                Some(m) => crate::bail_input!(
                    "{source}: {what} of '{name}' has shape {:?}, the model's is {:?}",
                    m.shape,
                    t.shape
                ),
                None => crate::bail_input!("{source}: {what} of '{name}' is missing"),
            }
        }
    }
    // The saved f32 masters are used only when they round to exactly the model's bf16 weights:
    // a model edited since is not replaced by stale masters.
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
        optimizer,
        trainer,
        master: matches.then_some(master),
    }))
}

/// `optimizer.safetensors`: the f32 masters and Adam's moments, at optimizer step `step`.
fn read_optimizer_file(path: &Path, step: u64) -> Result<(Weights, OptimizerState)> {
    let mut groups: [BTreeMap<String, Tensor>; 3] = Default::default();
    for (name, t, dtype) in load_file(path)? {
        if dtype != Dtype::F32 {
            crate::bail_input!(
                "{}: tensor '{name}' is {dtype:?}, expected F32",
                path.display()
            );
        }
        let (g, rest) = if let Some(r) = name.strip_prefix(EXP_AVG_SQ) {
            (1, r)
        } else if let Some(r) = name.strip_prefix(EXP_AVG) {
            (0, r)
        } else if let Some(r) = name.strip_prefix(MASTER) {
            (2, r)
        } else {
            crate::bail_input!("{}: unexpected tensor '{name}'", path.display());
        };
        groups[g].insert(rest.to_string(), t);
    }
    let [exp_avg, exp_avg_sq, master] = groups;
    Ok((
        master,
        OptimizerState {
            step,
            exp_avg,
            exp_avg_sq,
        },
    ))
}

/// Rank `rank`'s shard in `layout` of the optimizer state of sharded checkpoint `dir`, written
/// with another layout (another number of ranks, `--shard` mode or `--bucket-elems`); see
/// [`ShardSet::reshard`].
pub(crate) fn reshard(dir: &Path, layout: &ShardLayout, rank: usize) -> Result<HostShard> {
    let ts_path = dir.join(TRAINER_STATE_FILE);
    let trainer = read_trainer_state(&ts_path)?;
    anyhow::ensure!(
        trainer.optimizer_shards > 0,
        "{}: not a sharded checkpoint",
        dir.display()
    );
    shard_set(dir, &trainer, &ts_path).reshard(layout, rank)
}

/// Where a rank of a data-parallel update takes its optimizer shard from: a sharded
/// checkpoint's files.
pub(crate) struct ShardSource {
    pub(crate) dir: std::path::PathBuf,
    /// The rank's own shard file, when the checkpoint was written by as many ranks.
    pub(crate) own: Option<HostShard>,
}

impl ShardSource {
    /// This rank's shard in `layout`: its own file when that was written with this layout,
    /// else cut from every shard file of the checkpoint ([`reshard`]).
    pub(crate) fn for_layout(
        &self,
        layout: &ShardLayout,
        rank: usize,
    ) -> Result<std::borrow::Cow<'_, HostShard>> {
        Ok(match &self.own {
            Some(s) if s.layout == *layout && s.rank == rank => std::borrow::Cow::Borrowed(s),
            _ => std::borrow::Cow::Owned(reshard(&self.dir, layout, rank)?),
        })
    }
}

/// `tandem merge-shards`: a sharded checkpoint as one that loads with any number of ranks.
#[derive(clap::Args, Debug)]
pub struct MergeShardsArgs {
    /// The checkpoint whose optimizer state is in per-rank shard files (written by `update`
    /// on N > 1 ranks).
    pub checkpoint: std::path::PathBuf,
    /// The new checkpoint: the same model files, the optimizer state as one
    /// optimizer.safetensors (must not exist).
    #[arg(long = "out", value_name = "DIR")]
    pub out: std::path::PathBuf,
}

/// Writes `a.out`: `a.checkpoint`'s files with its shards merged into `optimizer.safetensors`
/// (the format of one process, which `update` loads on any number of ranks and slices into its
/// own layout). Written under a temporary name and renamed.
pub fn merge_shards(a: MergeShardsArgs) -> Result<()> {
    let (dir, out) = (&a.checkpoint, &a.out);
    let Some(mut trainer) = trainer_state(dir)? else {
        crate::bail_input!(
            "{}: has no {TRAINER_STATE_FILE}: not a checkpoint written by `update`",
            dir.display()
        );
    };
    if out.exists() {
        crate::bail_input!("--out {}: already exists", out.display());
    }
    let n = trainer.optimizer_shards;
    let (master, state) = whole_from_shards(dir)?;
    trainer.optimizer_shards = 0;
    let mut tmp = out.clone().into_os_string();
    tmp.push(".merging");
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<()> {
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let name = e.file_name();
            let s = name.to_string_lossy();
            if s.starts_with("optimizer.rank") || s == TRAINER_STATE_FILE || !e.path().is_file() {
                continue;
            }
            std::fs::copy(e.path(), tmp.join(&name))
                .with_context(|| format!("copying {}", e.path().display()))?;
        }
        write_optimizer(&tmp.join(OPTIMIZER_FILE), &state, &master)?;
        write_atomic(
            &tmp.join(TRAINER_STATE_FILE),
            &trainer_state_bytes(&trainer)?,
        )?;
        std::fs::rename(&tmp, out)
            .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written?;
    eprintln!(
        "merge-shards: {} ({n} shards, optimizer step {}) -> {} ({OPTIMIZER_FILE}: loads with any number of ranks)",
        dir.display(),
        state.step,
        out.display()
    );
    Ok(())
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
            optimizer_shards: 0,
        };
        write_optimizer(&dir.path().join(OPTIMIZER_FILE), &state, &master).unwrap();
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

    /// Two ranks' shards of a layout of two buckets: the files round-trip, give the same bytes
    /// each time, put the tensors back together, and the checkpoint is resumable only with
    /// both; another world size or a single process is refused naming the file.
    #[test]
    fn shard_files_round_trip_and_need_every_rank() {
        let dir = tempfile::tempdir().unwrap();
        // Tensors a (3 elements) and b (2) in bucket 0, c (1) in bucket 1; 2 ranks, shards of 3
        // and 1 (no alignment here: the layout is what it says).
        let layout = ShardLayout {
            world_size: 2,
            names: vec!["a".into(), "b".into(), "c".into()],
            shapes: vec![vec![3], vec![2], vec![1]],
            buckets: vec![(0, 2, vec![0, 3], 5, 3), (2, 3, vec![0], 1, 1)],
        };
        let shard = |rank: usize, base: f32| HostShard {
            rank,
            layout: layout.clone(),
            step: 4,
            master: vec![vec![base, base + 1.0, base + 2.0], vec![base + 3.0]],
            moments: Some((
                vec![vec![base * 10.0; 3], vec![base * 10.0]],
                vec![vec![base * 100.0; 3], vec![base * 100.0]],
            )),
        };
        let (s0, s1) = (shard(0, 1.0), shard(1, 5.0));
        // The same shard gives the same bytes.
        let again = tempfile::tempdir().unwrap();
        write_shard(dir.path(), &s0).unwrap();
        write_shard(again.path(), &s0).unwrap();
        let bytes = |d: &Path| std::fs::read(d.join(shard_file_name(0, 2))).unwrap();
        assert_eq!(bytes(dir.path()), bytes(again.path()));
        let ts = TrainerState {
            optimizer_step: 4,
            schedule_step: 2,
            lr: 1e-3,
            lr_schedule: LrConfig {
                lr: 1e-3,
                warmup_steps: 0,
                schedule: LrSchedule::Constant,
                total_steps: None,
                min_lr_ratio: 0.0,
            },
            seed: 1,
            optimizer_not_saved: false,
            optimizer_shards: 2,
        };
        std::fs::write(
            dir.path().join(TRAINER_STATE_FILE),
            trainer_state_bytes(&ts).unwrap(),
        )
        .unwrap();
        assert!(!resumable(dir.path()).unwrap(), "one shard of two");
        write_shard(dir.path(), &s1).unwrap();
        assert!(resumable(dir.path()).unwrap());
        let back = read_shard(&dir.path().join(shard_file_name(1, 2))).unwrap();
        assert_eq!(back, s1);
        let (master, state) = whole_from_shards(dir.path()).unwrap();
        // Bucket 0 is [1, 2, 3 | 5, 6, 7]: a = 1 2 3, b = 5 6; bucket 1 is [4 | 8]: c = 4.
        assert_eq!(master["a"].data, vec![1.0, 2.0, 3.0]);
        assert_eq!(master["b"].data, vec![5.0, 6.0]);
        assert_eq!(master["c"].data, vec![4.0]);
        assert_eq!(state.exp_avg["b"].data, vec![50.0, 50.0]);
        assert_eq!(state.exp_avg_sq["c"].data, vec![100.0]);
        assert_eq!(state.step, 4);
        let weights: Weights = master.clone();
        match load_rank(dir.path(), &weights, 1, 2).unwrap() {
            Some(RankResume::Shard { source, trainer }) => {
                assert_eq!(source.own.as_ref(), Some(&s1));
                assert_eq!(trainer, ts);
                // Its own layout: the file as read, no copy.
                let got = source.for_layout(&layout, 1).unwrap();
                assert!(matches!(got, std::borrow::Cow::Borrowed(_)));
            }
            _ => panic!("expected rank 1's shard"),
        }
        // 3 ranks, one bucket of a b c: flat 1 2 3 5 6 4, shards of 2.
        let three = ShardLayout {
            world_size: 3,
            names: layout.names.clone(),
            shapes: layout.shapes.clone(),
            buckets: vec![(0, 3, vec![0, 3, 5], 6, 2)],
        };
        let source = match load_rank(dir.path(), &weights, 2, 3).unwrap() {
            Some(RankResume::Shard { source, .. }) => source,
            _ => panic!("expected a shard source"),
        };
        assert!(
            source.own.is_none(),
            "another world size reads no file up front"
        );
        for (rank, master, m) in [
            (0, [1.0, 2.0], [10.0, 10.0]),
            (1, [3.0, 5.0], [10.0, 50.0]),
            (2, [6.0, 4.0], [50.0, 10.0]),
        ] {
            let got = reshard(dir.path(), &three, rank).unwrap();
            assert_eq!((got.rank, got.step), (rank, 4));
            assert_eq!(got.layout, three);
            assert_eq!(got.master, vec![master.to_vec()], "rank {rank}");
            let (gm, gv) = got.moments.clone().unwrap();
            assert_eq!(gm, vec![m.to_vec()], "rank {rank}");
            assert_eq!(gv, vec![m.map(|x| x * 10.0).to_vec()], "rank {rank}");
            assert_eq!(*source.for_layout(&three, rank).unwrap(), got);
        }
        // Another model's layout is refused naming the file.
        let mut other = three.clone();
        other.shapes[2] = vec![2];
        let err = reshard(dir.path(), &other, 0).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .contains("optimizer.rank00000-of-00002.safetensors")
                && err.to_string().contains("another model"),
            "{err}"
        );
        // Of each file only the span a rank needs is read: NaNs where rank 0 of three needs
        // nothing (file 1's bucket, file 0's last element) leave its shard as it was, and stop
        // rank 1, which needs them, naming the file and the tensor.
        let bad = tempfile::tempdir().unwrap();
        let (mut b0, mut b1) = (s0.clone(), s1.clone());
        b0.master[0][2] = f32::NAN;
        b1.master[0][0] = f32::NAN;
        write_shard(bad.path(), &b0).unwrap();
        write_shard(bad.path(), &b1).unwrap();
        std::fs::copy(
            dir.path().join(TRAINER_STATE_FILE),
            bad.path().join(TRAINER_STATE_FILE),
        )
        .unwrap();
        assert_eq!(
            reshard(bad.path(), &three, 0).unwrap(),
            reshard(dir.path(), &three, 0).unwrap()
        );
        let err = reshard(bad.path(), &three, 1).err().unwrap();
        assert!(crate::error::is_input_error(&err));
        let msg = err.to_string();
        assert!(
            msg.contains("optimizer.rank00000-of-00002.safetensors")
                && msg.contains("'master.00000'")
                && msg.contains("non-finite value (NaN) at flat index 2"),
            "{msg}"
        );
        // One process: the whole state, put back together.
        let r = load(dir.path(), &weights).unwrap().unwrap();
        assert_eq!(r.master.as_ref(), Some(&master));
        assert_eq!(r.optimizer.exp_avg["b"].data, vec![50.0, 50.0]);
        assert_eq!((r.optimizer.step, r.trainer.optimizer_shards), (4, 2));
    }
}
