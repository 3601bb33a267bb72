//! One rank's view of the job's health: the first failure anyone noticed (this rank's own
//! communicator, or the rendezvous store relaying another rank's report), what to tear down
//! when it happens, and the rule that no rank outlives a failure by more than a grace period.
//!
//! A failure is recorded once. Recording it prints one line naming the rank at fault, tells
//! the store (when this rank noticed it, so every other rank stops too), runs the abort hooks
//! (NCCL: `ncclCommAbort`; the CPU communicator: close its sockets) so that calls blocked on the
//! dead rank return, and, unless the process is a test harness, ends the process after the grace
//! period if the main thread has not ended it by then (it may be stuck inside a device sync).

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Exit code of a rank stopped because the job failed (the same as any other error).
pub(crate) const EXIT_FAILED: i32 = 1;

/// A failure of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The rank at fault, when known (the one that died, hung or reported bad input).
    pub(crate) suspect: Option<usize>,
    /// The rank that noticed it.
    pub(crate) reporter: usize,
    /// What happened, naming the suspect.
    pub(crate) reason: String,
}

type Hook = Box<dyn Fn() + Send + Sync>;
type Reporter = Box<dyn Fn(&Failure) + Send + Sync>;

/// Shared by the store client, the communicators and the process group of one rank.
pub(crate) struct Health {
    rank: usize,
    failure: Mutex<Option<Failure>>,
    hooks: Mutex<Vec<Hook>>,
    reporter: Mutex<Option<Reporter>>,
    /// End the process this long after a failure (None: never, for in-process tests).
    exit_after: Option<Duration>,
    /// A side group's health: a failure is only recorded here, for its caller to check.
    quiet: bool,
}

impl Health {
    pub fn new(rank: usize, exit_after: Option<Duration>) -> Arc<Health> {
        Health::make(rank, exit_after, false)
    }

    /// The health of a side group (`Options::side`): failures are recorded and reported to
    /// the group's store, but not printed nor written to the rank's error file, and never end
    /// the process.
    pub fn quiet(rank: usize) -> Arc<Health> {
        Health::make(rank, None, true)
    }

    fn make(rank: usize, exit_after: Option<Duration>, quiet: bool) -> Arc<Health> {
        Arc::new(Health {
            rank,
            failure: Mutex::new(None),
            hooks: Mutex::new(Vec::new()),
            reporter: Mutex::new(None),
            exit_after,
            quiet,
        })
    }

    /// The first failure, if any.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failure.lock().unwrap().clone()
    }

    /// Err with the failure's message once the job has failed.
    pub fn check(&self) -> anyhow::Result<()> {
        match self.failure() {
            None => Ok(()),
            Some(f) => Err(anyhow::anyhow!("{}", f.reason)),
        }
    }

    /// Runs `hook` when the job fails (at once if it already has).
    pub(crate) fn on_failure(&self, hook: impl Fn() + Send + Sync + 'static) {
        if self.failure().is_some() {
            hook();
        } else {
            self.hooks.lock().unwrap().push(Box::new(hook));
        }
    }

    /// Where a failure this rank notices is reported (the store client).
    pub(crate) fn set_reporter(&self, report: impl Fn(&Failure) + Send + Sync + 'static) {
        *self.reporter.lock().unwrap() = Some(Box::new(report));
    }

    /// Records a failure this rank noticed: reports it to the store, then stops.
    pub fn fail(&self, suspect: Option<usize>, reason: impl Into<String>) {
        let f = Failure {
            suspect,
            reporter: self.rank,
            reason: reason.into(),
        };
        if self.record(&f) {
            self.arm_exit();
            if let Some(report) = self.reporter.lock().unwrap().as_ref() {
                report(&f);
            }
            self.run_hooks();
        }
    }

    /// Records a failure another rank reported (through the store): stops without echoing it.
    pub(crate) fn relayed(&self, f: Failure) {
        if self.record(&f) {
            self.arm_exit();
            self.run_hooks();
        }
    }

    /// True when `f` is the first failure.
    fn record(&self, f: &Failure) -> bool {
        let mut slot = self.failure.lock().unwrap();
        if slot.is_some() {
            return false;
        }
        *slot = Some(f.clone());
        if !self.quiet {
            super::say(&format!(
                "tandem dist: rank {}: stopping: {}",
                self.rank, f.reason
            ));
            // Under `tandem launch`: the job's first failure as this rank saw it.
            crate::error::append_rank_error(f.suspect, f.reporter, &f.reason, false);
        }
        true
    }

    /// Ends the process after the grace period. Armed before the report and the hooks run:
    /// either may block (the store gone, ncclCommAbort while the main thread is inside NCCL).
    fn arm_exit(&self) {
        if let Some(grace) = self.exit_after {
            std::thread::spawn(move || {
                std::thread::sleep(grace);
                std::process::exit(EXIT_FAILED);
            });
        }
    }

    fn run_hooks(&self) {
        let hooks = std::mem::take(&mut *self.hooks.lock().unwrap());
        for h in hooks {
            h();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_first_failure_wins_and_runs_hooks_once() {
        let h = Health::new(2, None);
        let hits = Arc::new(AtomicUsize::new(0));
        let reported = Arc::new(AtomicUsize::new(0));
        let c = hits.clone();
        h.on_failure(move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        let r = reported.clone();
        h.set_reporter(move |_| {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert!(h.check().is_ok());
        h.fail(Some(1), "rank 1 hung");
        h.fail(Some(0), "rank 0 too");
        h.relayed(Failure {
            suspect: Some(3),
            reporter: 0,
            reason: "rank 3".into(),
        });
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(reported.load(Ordering::SeqCst), 1);
        let f = h.failure().unwrap();
        assert_eq!((f.suspect, f.reporter), (Some(1), 2));
        assert_eq!(format!("{}", h.check().unwrap_err()), "rank 1 hung");
        // A hook added after the failure runs at once.
        let c = hits.clone();
        h.on_failure(move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn relayed_failures_are_not_reported_back() {
        let h = Health::new(0, None);
        let reported = Arc::new(AtomicUsize::new(0));
        let r = reported.clone();
        h.set_reporter(move |_| {
            r.fetch_add(1, Ordering::SeqCst);
        });
        h.relayed(Failure {
            suspect: Some(1),
            reporter: 1,
            reason: "x".into(),
        });
        assert_eq!(reported.load(Ordering::SeqCst), 0);
        assert!(h.check().is_err());
    }
}
