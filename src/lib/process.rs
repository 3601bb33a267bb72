//! Child processes that never outlive the process that started them: the pipeline runner's
//! stages, `score`'s reward programs.
//!
//! - [`die_with_parent`]: the kernel sends the child SIGKILL when its parent dies, however it
//!   dies (SIGKILL included), through `PR_SET_PDEATHSIG` (Linux).
//! - [`Spawner`]: spawns from one long-lived thread, for children started from short-lived
//!   threads that must outlive them (the kernel's signal follows the spawning thread).
//! - [`split_args`]: a command line typed as one string (`cmd:PROGRAM ARGS`) split into argv.
//! - [`GroupGuard`]: while it lives, a SIGTERM, SIGINT or SIGHUP that ends this process first
//!   kills the guarded process group (what the child started too), which `PR_SET_PDEATHSIG`
//!   alone does not reach. Dropping the guard kills the group as well, so every way out of
//!   the code that holds it (return, error, panic) takes the group down.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Once;

/// Have the kernel kill the child started by `cmd` when this process dies (Linux).
///
/// The signal is sent when the thread that spawned the child exits: spawn from a thread that
/// outlives the child (the main thread, or the one that waits for it).
pub(crate) fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) run in the child.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
}

/// Process groups to kill when a terminating signal arrives (0 = free slot). A fixed array:
/// the signal handler may only read atomics.
static GROUPS: [AtomicI32; 64] = [const { AtomicI32::new(0) }; 64];

/// The signals after which this process ends (by default) and its guarded groups must go.
const FATAL: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

extern "C" fn on_fatal_signal(sig: libc::c_int) {
    for g in &GROUPS {
        let pgid = g.load(Ordering::SeqCst);
        if pgid > 0 {
            // SAFETY: kill(2) is async-signal-safe; a negative pid names the process group.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }
    // Then end as the signal would have: default action, raised again.
    // SAFETY: signal(2) and raise(3) are async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handler for each fatal signal whose action is still the default one (a
/// process that handles a signal itself, like the daemon, keeps its own handler).
fn install_handlers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for sig in FATAL {
            // SAFETY: sigaction with a zeroed struct and a handler that only uses atomics and
            // async-signal-safe calls; the old action is read back unchanged when not default.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                    || old.sa_sigaction != libc::SIG_DFL
                {
                    continue;
                }
                let mut new: libc::sigaction = std::mem::zeroed();
                new.sa_sigaction = on_fatal_signal as *const () as libc::sighandler_t;
                libc::sigemptyset(&mut new.sa_mask);
                libc::sigaction(sig, &new, std::ptr::null_mut());
            }
        }
    });
}

/// Kills the process group `pgid` when dropped, or before this process ends on SIGTERM,
/// SIGINT or SIGHUP.
pub(crate) struct GroupGuard {
    pgid: i32,
    slot: Option<usize>,
}

impl GroupGuard {
    /// Guards the group led by the child `pid` (started with `process_group(0)`).
    pub(crate) fn new(pid: u32) -> GroupGuard {
        install_handlers();
        let pgid = i32::try_from(pid).unwrap_or(0);
        let slot = GROUPS.iter().position(|g| {
            g.compare_exchange(0, pgid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        GroupGuard { pgid, slot }
    }

    /// Kills the group now (it may already be gone) and stops guarding it.
    pub(crate) fn kill(&mut self) {
        if let Some(i) = self.slot.take() {
            GROUPS[i].store(0, Ordering::SeqCst);
        }
        if self.pgid > 0 {
            // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
            unsafe {
                libc::kill(-self.pgid, libc::SIGKILL);
            }
            self.pgid = 0;
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Spawns children from a thread of its own, which lives as long as the `Spawner`: children
/// started with [`die_with_parent`] from short-lived threads (a pool of workers that any
/// caller's thread may grow) then die with this process or with the spawner, not with the
/// thread that asked for them.
pub(crate) struct Spawner {
    requests: Sender<(Command, Sender<std::io::Result<Child>>)>,
}

impl Spawner {
    pub(crate) fn new() -> Spawner {
        let (requests, rx) = mpsc::channel::<(Command, Sender<std::io::Result<Child>>)>();
        std::thread::spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        });
        Spawner { requests }
    }

    /// `cmd.spawn()`, run on the spawner's thread.
    pub(crate) fn spawn(&self, cmd: Command) -> std::io::Result<Child> {
        let gone = || std::io::Error::other("the spawner thread is gone");
        let (reply, rx) = mpsc::channel();
        self.requests.send((cmd, reply)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())?
    }
}

/// Split `PROGRAM ARGS...` into words, as a shell would without expanding anything:
/// whitespace separates, '...' is literal, "..." allows \" and \\, a backslash outside
/// quotes escapes the next character.
pub(crate) fn split_args(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err("unclosed single quote".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err("unclosed double quote".into()),
                        },
                        Some(c) => cur.push(c),
                        None => return Err("unclosed double quote".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => cur.push(c),
                    None => return Err("trailing backslash".into()),
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_args_like_a_shell_without_expansion() {
        let w = |s: &str| split_args(s).unwrap();
        assert_eq!(w("python3 r.py --k 1"), ["python3", "r.py", "--k", "1"]);
        assert_eq!(w("  a   b  "), ["a", "b"]);
        assert_eq!(w("a 'b c' \"d \\\"e\\\"\""), ["a", "b c", "d \"e\""]);
        assert_eq!(w("a\\ b $HOME *"), ["a b", "$HOME", "*"]);
        assert_eq!(w("''"), [""]);
        assert!(split_args("a 'b").is_err());
        assert!(split_args("a \"b").is_err());
    }
}
