//! Child processes that must not outlive the process that started them (stages of the runner,
//! ranks of the launcher, reward programs).

use std::process::Command;

/// Has the kernel kill the child when this process dies (Linux), so a killed parent leaves no
/// child running behind it (writing into a run directory, holding a GPU, or waiting on a rank).
pub fn die_with_parent(cmd: &mut Command) {
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
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}
