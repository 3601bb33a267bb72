//! A policy read from its files: the model, and the optimizer and trainer state next to it
//! (`crate::engine::resume`), whole or one rank's part.

use crate::backend::Backend;
use crate::engine::resume::{self, RankResume, ShardSource, TrainerState};
use crate::engine::train::TrainConfig;
use crate::model::checkpoint::ModelDir;
use crate::model::config::CONFIG_FILE;
use crate::model::critic::value_model_from;
use crate::model::decoder::{Decoder, OptimizerState};
use crate::model::lora::{init_adapters, LoraMode, LoraSpec};
use crate::model::peft;
use crate::model::{Config, Weights};
use anyhow::Result;
use std::path::{Path, PathBuf};

/// Loads a model directory's weights onto a backend (to generate or score with: no optimizer
/// state). An adapter directory loads its base and merges the adapters on the backend
/// ([`Decoder::merge_adapters`]), as the daemon builds its generation copy.
pub fn load_policy<B: Backend>(backend: B, dir: &Path) -> Result<Decoder<B>> {
    load_policy_as(backend, dir, LoraMode::Merged)
}

/// [`load_policy`], an adapter directory loaded as `mode` says: merged, or its adapters kept
/// apart and applied at each step ([`Decoder::for_generation_unmerged`]).
pub fn load_policy_as<B: Backend>(backend: B, dir: &Path, mode: LoraMode) -> Result<Decoder<B>> {
    if is_adapter_dir(dir) {
        let adapter = peft::read_adapter(dir)?;
        let (cfg, weights) = ModelDir::load(&lora_base(dir)?)?;
        let (spec, ad) = (&adapter.spec, &adapter.weights);
        if mode == LoraMode::Unmerged {
            return Decoder::for_generation_unmerged(backend, &cfg, weights, ad, spec);
        }
        let mut d = Decoder::for_generation(backend, &cfg, weights)?;
        d.merge_adapters(spec, ad)?;
        return Ok(d);
    }
    let (cfg, weights) = ModelDir::load(dir)?;
    Decoder::new(backend, &cfg, &weights)
}

/// Loads a critic onto a backend (to compute values with): a value model's directory, or a
/// policy's, whose critic starts with a zero value head (`crate::model::critic`); an adapter
/// directory's base with the adapters merged on the backend, as [`load_policy`] merges them.
pub fn load_value_model<B: Backend>(backend: B, dir: &Path) -> Result<Decoder<B>> {
    let adapter = match is_adapter_dir(dir) {
        true => Some(peft::read_adapter(dir)?),
        false => None,
    };
    let (cfg, weights) = match &adapter {
        Some(_) => ModelDir::load(&lora_base(dir)?)?,
        None => ModelDir::load(dir)?,
    };
    let (cfg, weights) = value_model_from(&cfg, weights);
    let mut d = Decoder::new(backend, &cfg, &weights)?;
    if let Some(a) = adapter {
        d.merge_adapters(&a.spec, &a.weights)?;
    }
    Ok(d)
}

/// A policy as `update` starts from it: the f32 master weights when they sit next to the model
/// (else the model's weights), the optimizer state and the schedule position.
pub struct Trainable {
    pub cfg: Config,
    pub weights: Weights,
    /// Whether `weights` are the saved f32 masters rather than the model files' weights.
    pub from_master: bool,
    pub optimizer: Option<OptimizerState>,
    /// Training steps (update calls) done before this one.
    pub schedule_step: u64,
    /// The trainer state found next to the model.
    pub trainer: Option<TrainerState>,
    /// Where this rank's optimizer shard comes from (a data-parallel update resuming a sharded
    /// checkpoint; `weights` are then the model files' and `optimizer` is None).
    pub(crate) shard: Option<ShardSource>,
    /// LoRA: the adapters trained on the frozen `weights` (then the base's).
    pub lora: Option<LoraStart>,
}

/// Where a LoRA update starts: the spec, the adapters (f32) and the base model's directory.
pub struct LoraStart {
    pub spec: LoraSpec,
    pub adapters: Weights,
    pub base: PathBuf,
}

/// Whether `dir` is a LoRA adapter's directory (PEFT files, no config.json of its own).
pub fn is_adapter_dir(dir: &Path) -> bool {
    peft::is_adapter_dir(dir) && !dir.join(CONFIG_FILE).is_file()
}

/// The base model of a LoRA run from `dir`: the base an adapter directory names, or `dir`
/// itself (a model, whose adapters start fresh), as an absolute path.
pub fn lora_base(dir: &Path) -> Result<PathBuf> {
    let base = match is_adapter_dir(dir) {
        true => peft::base_dir(dir, &peft::read_config(dir)?.1)?,
        false => dir.to_path_buf(),
    };
    Ok(std::path::absolute(&base)?)
}

impl Trainable {
    /// Reads a model directory and the optimizer state next to it.
    /// A LoRA adapter's directory gives its merged model and no optimizer state (its state is
    /// the adapters': [`Trainable::load_lora`] trains on).
    pub fn load(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        let (cfg, weights) = ModelDir::load(dir)?;
        if is_adapter_dir(dir) {
            return Ok(Self::without_optimizer(cfg, weights, None, None));
        }
        let Some(r) = resume::load(dir, &weights)? else {
            return Ok(Self::without_optimizer(cfg, weights, None, None));
        };
        Ok(Self::resumed(dir, cfg, weights, r, log))
    }

    /// What `update` trains with `train`'s settings from `dir`: a critic
    /// ([`Trainable::load_critic`]), LoRA adapters ([`Trainable::load_lora`]) or the policy
    /// ([`Trainable::load`]); on rank `rank` of `world` (`Some`), its part of a sharded
    /// checkpoint ([`Trainable::load_rank`]).
    pub fn for_update(
        dir: &Path,
        train: &TrainConfig,
        ranks: Option<(usize, usize)>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trainable> {
        match (&train.critic, &train.lora, ranks) {
            (Some(_), _, None) => Self::load_critic(dir, log),
            (Some(_), _, Some((rank, world))) => Self::load_rank_critic(dir, rank, world, log),
            // A LoRA checkpoint's adapter state is one file, whatever the number of ranks.
            (None, Some(spec), _) => Self::load_lora(dir, spec, train.seed),
            (None, None, None) => Self::load(dir, log),
            (None, None, Some((rank, world))) => Self::load_rank(dir, rank, world, log),
        }
    }

    /// [`Trainable::load`] for `update --lora-rank`: a LoRA checkpoint or PEFT adapter
    /// directory (the adapters, their optimizer and trainer state when there, the base it
    /// names), or a model, on which fresh adapters start (A random by `seed`, B zero). An
    /// adapter whose r, alpha or targets differ from `spec` is an input error.
    pub fn load_lora(dir: &Path, spec: &LoraSpec, seed: u64) -> Result<Trainable> {
        let base = lora_base(dir)?;
        let (cfg, weights) = ModelDir::load(&base)?;
        if !is_adapter_dir(dir) {
            let adapters = init_adapters(&cfg, spec, seed);
            let mut t = Self::without_optimizer(cfg, weights, None, None);
            t.lora = Some(LoraStart {
                spec: spec.clone(),
                adapters,
                base,
            });
            return Ok(t);
        }
        let ad = peft::read_adapter(dir)?;
        if ad.spec != *spec {
            crate::bail_input!(
                "{}: the adapter has r {}, alpha {}, targets {:?}; the flags ask for r {}, alpha {}, targets {:?}",
                dir.join(peft::ADAPTER_CONFIG).display(),
                ad.spec.rank, ad.spec.alpha, ad.spec.targets, spec.rank, spec.alpha, spec.targets
            );
        }
        let r = resume::load(dir, &ad.weights)?;
        let trainer = r.as_ref().map(|r| r.trainer.clone());
        let mut t = Self::without_optimizer(cfg, weights, trainer, None);
        t.optimizer = r.map(|r| r.optimizer);
        t.lora = Some(LoraStart {
            spec: ad.spec,
            adapters: ad.weights,
            base,
        });
        Ok(t)
    }

    /// [`Trainable::load`] for `update --critic`: a critic's directory as it is, or a policy's
    /// made into a critic with a zero value head and a fresh optimizer (the policy's optimizer
    /// state is not the critic's).
    pub fn load_critic(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        if ModelDir::load_config(dir)?.value_head {
            return Self::load(dir, log);
        }
        let (cfg, weights) = ModelDir::load(dir)?;
        let (cfg, weights) = value_model_from(&cfg, weights);
        log(&format!(
            "update: a new critic from the policy {} (its value head zero)",
            dir.display()
        ));
        Ok(Self::without_optimizer(cfg, weights, None, None))
    }

    /// [`Trainable::load_rank`] for `update --critic` among ranks: a critic's directory as it
    /// is, or a policy's made into a critic ([`Trainable::load_critic`]).
    pub(crate) fn load_rank_critic(
        dir: &Path,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trainable> {
        match ModelDir::load_config(dir)?.value_head {
            true => Self::load_rank(dir, rank, world, log),
            false => Self::load_critic(dir, log),
        }
    }

    /// As [`Trainable::load_weights`] for a critic: a critic's directory as `load_weights`
    /// reads it, or a policy's made into a critic ([`Trainable::load_critic`]).
    pub fn load_critic_weights(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        match ModelDir::load_config(dir)?.value_head {
            true => Self::load_weights(dir, log),
            false => Self::load_critic(dir, log),
        }
    }

    /// The model files' weights with no optimizer state here: a fresh optimizer, or (with
    /// `trainer`) a sharded checkpoint's, whose state is in the ranks' files (`shard`: where
    /// this rank's comes from).
    fn without_optimizer(
        cfg: Config,
        weights: Weights,
        trainer: Option<TrainerState>,
        shard: Option<ShardSource>,
    ) -> Trainable {
        Trainable {
            cfg,
            weights,
            from_master: false,
            optimizer: None,
            schedule_step: trainer.as_ref().map_or(0, |t| t.schedule_step),
            trainer,
            shard,
            lora: None,
        }
    }

    /// As [`Trainable::load`] for a process that only generates or scores with the policy (a
    /// daemon of a group, which trains from the files under the ranks): a sharded checkpoint
    /// gives its model files' weights, no optimizer state, and its trainer state (whose
    /// `optimizer_shards` says so) instead of being refused.
    pub fn load_weights(dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Trainable> {
        match resume::trainer_state(dir)? {
            Some(t) if t.optimizer_shards > 0 => {
                let (cfg, weights) = ModelDir::load(dir)?;
                Ok(Self::without_optimizer(cfg, weights, Some(t), None))
            }
            _ => Self::load(dir, log),
        }
    }

    /// Rank `rank` of `world` reads a model directory and its part of the optimizer state
    /// next to it: a sharded checkpoint's own shard file (written by as many ranks; by
    /// another number, the shard is cut from the files once the layout is known), or the
    /// whole state of an unsharded one.
    pub(crate) fn load_rank(
        dir: &Path,
        rank: usize,
        world: usize,
        log: &mut dyn FnMut(&str),
    ) -> Result<Trainable> {
        let (cfg, weights) = ModelDir::load(dir)?;
        Ok(match resume::load_rank(dir, &weights, rank, world)? {
            None => Self::without_optimizer(cfg, weights, None, None),
            Some(RankResume::Whole(r)) => Self::resumed(dir, cfg, weights, r, log),
            Some(RankResume::Shard { source, trainer }) => {
                Self::without_optimizer(cfg, weights, Some(trainer), Some(source))
            }
        })
    }

    fn resumed(
        dir: &Path,
        cfg: Config,
        weights: Weights,
        r: resume::Resume,
        log: &mut dyn FnMut(&str),
    ) -> Trainable {
        if r.master.is_none() {
            log(&format!(
                "update: {}: f32 master weights absent or not matching the model files; continuing from the bf16 weights",
                dir.display()
            ));
        }
        let from_master = r.master.is_some();
        Trainable {
            cfg,
            weights: r.master.unwrap_or(weights),
            from_master,
            optimizer: Some(r.optimizer),
            schedule_step: r.trainer.schedule_step,
            trainer: Some(r.trainer),
            shard: None,
            lora: None,
        }
    }

    /// The decoder, with the optimizer state loaded.
    pub fn build<B: Backend>(&self, backend: B) -> Result<Decoder<B>> {
        let mut policy = match &self.lora {
            Some(l) => Decoder::with_lora(backend, &self.cfg, &self.weights, &l.adapters, &l.spec)?,
            None => Decoder::new(backend, &self.cfg, &self.weights)?,
        };
        if let Some(state) = &self.optimizer {
            policy.load_optimizer_state(state)?;
        }
        Ok(policy)
    }
}
