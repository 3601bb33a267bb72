//! The policy store: a policy read from its files or a pointer file ([`resolve_model`],
//! [`Trainable`], [`load_policy`]), trained in place for one update call ([`Train`]), kept in
//! memory between calls (`kept`, the warm daemon's; [`Holder`], [`HeldPolicy`],
//! [`SavedShards`]), and written back as a checkpoint ([`write_checkpoint`], [`write_resident`],
//! the ranks' shard files [`write_rank_shards`]).
//! The files' formats are below it: the model in `crate::model::checkpoint`, the optimizer and
//! trainer state in `crate::engine::resume`, the shard files in `crate::engine::shard::files`.
//!
//! The stages (`update`, `daemon-ctl save`) and the daemon use the store; it knows neither.

mod checkpoint;
mod held;
pub(crate) mod kept;
mod load;
mod pointer;
mod shards;
mod train;

pub use checkpoint::{shard_staging, write_checkpoint, write_lora_checkpoint, write_resident};
pub use held::{HeldPolicy, Holder, SavedShards};
pub use load::{
    is_adapter_dir, load_policy, load_policy_as, load_value_model, lora_base, LoraStart, Trainable,
};
pub use pointer::{resolve_model, ModelRef, Pointer};
pub use shards::write_rank_shards;
pub use train::{train_ranks_from_files, Sharding, Train, Trained};

#[cfg(test)]
mod tests;
