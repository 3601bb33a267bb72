//! Rewards: the `score` stage's rules (the stage itself follows).

pub mod gsm8k;
pub mod math;
pub mod rules;
