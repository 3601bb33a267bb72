//! The store on small random policies: what it writes it reads back exactly (weights, optimizer
//! and trainer state), a checkpoint appears whole or not at all, and bad input is refused with
//! the message that says what is wrong.

use super::*;
use crate::backend::cpu::Cpu;
use crate::engine::resume::{TrainerState, OPTIMIZER_FILE, TRAINER_STATE_FILE};
use crate::engine::train::{LrConfig, LrSchedule};
use crate::error::is_input_error;
use crate::model::checkpoint::{ModelDir, ResidentMarker};
use crate::model::decoder::OptimizerState;
use crate::model::init::random_weights;
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Weights};
use std::path::{Path, PathBuf};

fn config() -> Config {
    Config {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        head_dim: 8,
        ..Config::small_qwen2()
    }
}

/// Random f32 tensors of the model's shapes (none of them bf16 values).
fn like(w: &Weights, seed: u64, std: f32) -> Weights {
    let cfg = config();
    let r = random_weights(&cfg, seed, std);
    w.keys().map(|k| (k.clone(), r[k].clone())).collect()
}

fn bf16(w: &Weights) -> Weights {
    let mut out = w.clone();
    for t in out.values_mut() {
        t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    out
}

fn trainer(step: u64) -> TrainerState {
    TrainerState {
        optimizer_step: step,
        schedule_step: 3,
        lr: 2e-5,
        lr_schedule: LrConfig {
            lr: 2e-5,
            warmup_steps: 1,
            schedule: LrSchedule::Cosine,
            total_steps: Some(9),
            min_lr_ratio: 0.1,
        },
        seed: 5,
        optimizer_not_saved: false,
        optimizer_shards: 0,
    }
}

/// A trained policy: f32 masters, moments at step 7, and a base model directory (files_from).
struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    base: PathBuf,
    cfg: Config,
    master: Weights,
    state: OptimizerState,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let cfg = config();
    let master = random_weights(&cfg, 1, 0.3);
    let base = root.join("base");
    ModelDir::save(&base, &cfg, &master, None).unwrap();
    let state = OptimizerState {
        step: 7,
        exp_avg: like(&master, 2, 0.01),
        exp_avg_sq: like(&master, 3, 1e-4),
    };
    Fixture {
        _tmp: tmp,
        root,
        base,
        cfg,
        master,
        state,
    }
}

impl Fixture {
    fn write(&self, out: &Path, shard_files: &[PathBuf]) -> anyhow::Result<()> {
        write_checkpoint(
            out,
            &self.base,
            &self.cfg,
            &self.master,
            Some(&self.state),
            shard_files,
            &trainer(self.state.step),
        )
    }
}

#[test]
fn a_checkpoint_round_trips_the_policy_and_its_optimizer_state() {
    let f = fixture();
    let out = f.root.join("step-1");
    f.write(&out, &[]).unwrap();
    assert!(out.join(OPTIMIZER_FILE).is_file() && out.join(TRAINER_STATE_FILE).is_file());
    // The staging directory and the temporary name are gone.
    assert!(!shard_staging(&out).exists());
    assert!(!f.root.join("step-1.tmp").exists());
    let mut log = Vec::new();
    let t = Trainable::load(&out, &mut |m| log.push(m.to_string())).unwrap();
    assert!(log.is_empty(), "{log:?}");
    // The f32 masters, not the bf16 model files, exactly.
    assert!(t.from_master);
    assert_eq!(t.weights, f.master);
    assert_eq!(t.optimizer.as_ref(), Some(&f.state));
    assert_eq!(t.trainer, Some(trainer(7)));
    assert_eq!(t.schedule_step, 3);
    assert!(t.shard.is_none());
    // The model files are the masters rounded to bf16.
    let (cfg, files) = ModelDir::load(&out).unwrap();
    assert_eq!(cfg.hidden_size, f.cfg.hidden_size);
    assert_eq!(files, bf16(&f.master));
    // Built on a backend, the decoder holds that state.
    let decoder = t.build(Cpu).unwrap();
    assert_eq!(decoder.export_weights().unwrap(), f.master);
    assert_eq!(decoder.optimizer_state().unwrap(), f.state);
    assert_eq!(decoder.optimizer_steps(), 7);
    // A rank of an unsharded checkpoint gets the whole of it; so does a generating daemon.
    let r = Trainable::load_rank(&out, 1, 2, &mut |_| {}).unwrap();
    assert_eq!(
        (&r.weights, r.optimizer.as_ref()),
        (&f.master, Some(&f.state))
    );
    let w = Trainable::load_weights(&out, &mut |_| {}).unwrap();
    assert_eq!(w.optimizer.as_ref(), Some(&f.state));
}

#[test]
fn a_model_without_optimizer_state_starts_fresh_from_its_files() {
    let f = fixture();
    let t = Trainable::load(&f.base, &mut |_| {}).unwrap();
    assert!(!t.from_master && t.optimizer.is_none() && t.trainer.is_none());
    assert_eq!(t.schedule_step, 0);
    assert_eq!(t.weights, bf16(&f.master));
    // Masters that do not round to the model files (edited since) are not used.
    let out = f.root.join("edited");
    f.write(&out, &[]).unwrap();
    let mut edited = bf16(&f.master);
    let name = edited.keys().next().unwrap().clone();
    edited.get_mut(&name).unwrap().data[0] = 4.0;
    ModelDir::save_with(
        &out,
        &f.cfg,
        &edited,
        &crate::model::checkpoint::SaveOptions {
            tokenizer_from: None,
            config_base: None,
            max_shard_bytes: crate::model::safetensors::DEFAULT_MAX_SHARD_BYTES,
            extra_files: &[],
            move_in: &[],
        },
    )
    .unwrap();
    // save_with replaced the directory: put the optimizer state back beside the edited model.
    crate::engine::resume::write_optimizer(&out.join(OPTIMIZER_FILE), &f.state, &f.master).unwrap();
    std::fs::write(
        out.join(TRAINER_STATE_FILE),
        crate::engine::resume::trainer_state_bytes(&trainer(7)).unwrap(),
    )
    .unwrap();
    let mut log = Vec::new();
    let t = Trainable::load(&out, &mut |m| log.push(m.to_string())).unwrap();
    assert!(!t.from_master);
    assert_eq!(t.weights, edited);
    assert_eq!(t.optimizer.as_ref(), Some(&f.state));
    assert_eq!(log.len(), 1);
    assert!(
        log[0].contains("f32 master weights absent or not matching"),
        "{log:?}"
    );
}

#[test]
fn a_failed_checkpoint_leaves_the_old_one_and_nothing_half_written() {
    let f = fixture();
    let out = f.root.join("ckpt");
    f.write(&out, &[]).unwrap();
    // A shard file that is not there: the write fails after the temporary directory was made.
    let missing = shard_staging(&out).join("optimizer.rank00000-of-00002.safetensors");
    let err = f.write(&out, std::slice::from_ref(&missing)).unwrap_err();
    assert!(format!("{err:#}").contains("moving"), "{err:#}");
    assert!(!f.root.join("ckpt.tmp").exists());
    assert!(!shard_staging(&out).exists());
    // The checkpoint that was there is intact.
    let t = Trainable::load(&out, &mut |_| {}).unwrap();
    assert_eq!(t.weights, f.master);
    assert_eq!(t.optimizer.as_ref(), Some(&f.state));
    // A new one that fails does not appear at all.
    let fresh = f.root.join("fresh");
    f.write(&fresh, &[missing]).unwrap_err();
    assert!(!fresh.exists() && !f.root.join("fresh.tmp").exists());
    // Weights that are not the config's model: refused before anything is written.
    let mut short = f.master.clone();
    let name = short.keys().next().unwrap().clone();
    short.remove(&name);
    let err = write_checkpoint(
        &fresh,
        &f.base,
        &f.cfg,
        &short,
        Some(&f.state),
        &[],
        &trainer(7),
    )
    .unwrap_err();
    assert!(err.to_string().contains("is missing"), "{err}");
    assert!(!fresh.exists() && !shard_staging(&fresh).exists());
}

#[test]
fn a_resident_directory_names_its_holder_and_has_no_weights() {
    let f = fixture();
    let out = f.root.join("resident");
    let marker = ResidentMarker {
        socket: Some(f.root.join("d.sock")),
        pid: 42,
        step: 4,
        from_policy_version: 3,
    };
    write_resident(&out, &f.base, &f.cfg, &marker).unwrap();
    assert_eq!(ModelDir::resident(&out).unwrap(), Some(marker));
    assert_eq!(ModelDir::load_config(&out).unwrap().hidden_size, 32);
    let err = Trainable::load(&out, &mut |_| {}).err().unwrap();
    assert!(is_input_error(&err));
    assert!(err.to_string().contains("holds no weight files"), "{err}");
    assert!(err.to_string().contains("daemon-ctl save"), "{err}");
}

#[test]
fn bad_checkpoints_are_refused_naming_what_is_wrong() {
    let f = fixture();
    let err = Trainable::load(&f.root.join("nope"), &mut |_| {})
        .err()
        .unwrap();
    assert!(is_input_error(&err));
    assert!(
        err.to_string().contains("model directory not found"),
        "{err}"
    );
    // Half the state.
    let half = f.root.join("half");
    f.write(&half, &[]).unwrap();
    std::fs::remove_file(half.join(TRAINER_STATE_FILE)).unwrap();
    let err = Trainable::load(&half, &mut |_| {}).err().unwrap();
    assert!(is_input_error(&err));
    assert!(
        err.to_string()
            .contains("has only one of optimizer.safetensors and trainer_state.json"),
        "{err}"
    );
    // The optimizer state stayed in a daemon's memory.
    let kept = f.root.join("kept");
    let t = TrainerState {
        optimizer_not_saved: true,
        ..trainer(7)
    };
    write_checkpoint(&kept, &f.base, &f.cfg, &f.master, None, &[], &t).unwrap();
    let err = Trainable::load(&kept, &mut |_| {}).err().unwrap();
    assert!(is_input_error(&err));
    assert!(
        err.to_string().contains("update --skip-optimizer-state"),
        "{err}"
    );
    // A sharded checkpoint with a shard missing.
    let sharded = f.root.join("sharded");
    let t = TrainerState {
        optimizer_shards: 2,
        ..trainer(7)
    };
    write_checkpoint(&sharded, &f.base, &f.cfg, &f.master, None, &[], &t).unwrap();
    let err = Trainable::load(&sharded, &mut |_| {}).err().unwrap();
    assert!(is_input_error(&err));
    assert!(
        err.to_string().contains("the checkpoint is incomplete"),
        "{err}"
    );
    // A generating daemon takes its weights and trainer state all the same.
    let w = Trainable::load_weights(&sharded, &mut |_| {}).unwrap();
    assert!(w.optimizer.is_none() && !w.from_master);
    assert_eq!(w.trainer.as_ref().map(|t| t.optimizer_shards), Some(2));
    assert_eq!(w.weights, bf16(&f.master));
}

#[test]
fn a_pointer_resolves_to_the_checkpoint_the_store_loads() {
    let f = fixture();
    let out = f.root.join("run").join("step-2");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    f.write(&out, &[]).unwrap();
    let ptr = f.root.join("run").join("policy");
    let p = Pointer {
        model: "step-2".into(),
        policy_version: 2,
    };
    std::fs::write(&ptr, serde_json::to_string(&p).unwrap()).unwrap();
    let m = resolve_model(&ptr).unwrap();
    assert_eq!((m.dir.clone(), m.policy_version), (out.clone(), 2));
    let t = Trainable::load(&m.dir, &mut |_| {}).unwrap();
    assert_eq!(t.weights, f.master);
}
