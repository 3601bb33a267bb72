//! The engine on top of the decoder: sampling and batched generation (`rollout`), micro-batched
//! scoring (`ref-logprob`), the training loop (`update`), and the stages' command lines.

pub mod generate;
pub mod sampling;
