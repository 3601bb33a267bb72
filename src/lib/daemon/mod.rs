//! The warm daemon (DESIGN.md section 5, docs/DAEMON.md): one process per device that keeps
//! the policy (compute weights, f32 masters, AdamW state) and the reference model in memory
//! between stages. Stages started with `--daemon PATH` send their job over a unix socket
//! instead of loading the model; the daemon runs the very same stage code against the models
//! it holds, so the files written are the same as in-process.

pub mod client;
pub mod protocol;
pub mod resident;
pub mod server;
