//! Cancelling a running job from another thread: the warm daemon cancels a job whose client
//! went away (killed, or its connection closed), so it does not compute for minutes and write
//! files for nobody.
//!
//! The daemon installs a [`Cancel`] flag on the thread that runs the job
//! ([`Cancel::install`]); the engine's loops call [`check`] between steps (a generation step, a
//! scoring or training micro-batch), which fails with [`Cancelled`] once the flag is set. A
//! thread with no flag installed (every stage run in its own process) is never cancelled.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A job's cancellation flag, shared between the thread that runs the job and the one that
/// watches its client.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

thread_local! {
    static CURRENT: RefCell<Option<Cancel>> = const { RefCell::new(None) };
}

impl Cancel {
    pub fn new() -> Cancel {
        Cancel::default()
    }

    /// Asks the job to stop at its next check.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Runs `f` with this flag as the current thread's: [`check`] inside it fails once the
    /// flag is set. The previous flag (if any) is restored after.
    pub(crate) fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Cancel>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let prev = self.0.take();
                CURRENT.with(|c| *c.borrow_mut() = prev);
            }
        }
        let prev = CURRENT.with(|c| c.borrow_mut().replace(self.clone()));
        let _restore = Restore(prev);
        f()
    }
}

/// Whether the current thread's job was asked to stop.
pub fn requested() -> bool {
    CURRENT.with(|c| c.borrow().as_ref().is_some_and(Cancel::is_cancelled))
}

/// `Err(Cancelled)` once the current thread's job was asked to stop; the loops of the engine
/// call it between steps.
pub fn check() -> anyhow::Result<()> {
    if requested() {
        return Err(Cancelled.into());
    }
    Ok(())
}

/// The error of a cancelled job.
#[derive(Debug)]
pub struct Cancelled;

impl fmt::Display for Cancelled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("cancelled: the job's client went away; nothing was written")
    }
}

impl std::error::Error for Cancelled {}

/// Whether an error (or anything in its chain) is a cancellation.
pub(crate) fn is_cancelled(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<Cancelled>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_cancels_only_the_thread_it_is_installed_on() {
        assert!(check().is_ok());
        let c = Cancel::new();
        c.install(|| {
            assert!(check().is_ok());
            c.cancel();
            let err = check().unwrap_err();
            assert!(is_cancelled(&err));
            assert!(err.to_string().contains("nothing was written"));
            // Another thread has no flag.
            std::thread::scope(|s| s.spawn(|| assert!(check().is_ok())).join().unwrap());
        });
        // Uninstalled after: the set flag no longer applies here.
        assert!(check().is_ok());
        // Nested flags restore the outer one.
        let outer = Cancel::new();
        outer.install(|| {
            Cancel::new().install(|| outer.cancel());
            assert!(requested());
        });
    }
}
