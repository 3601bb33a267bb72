//! The kernel's part of the Python sandbox: what a child sets up between `fork` and `exec`,
//! and which of those layers this machine's kernel allows (probed once per process).
//!
//! In the child, in this order (each layer the probe found working; a working layer that then
//! fails makes the spawn fail, so a call never runs with less than [`Layers::get`] reports):
//! 1. a **pids cgroup** of its own (v1 `pids` or v2 with the pids controller, writable: root
//!    on most hosts), `pids.max` = the process cap; every process in it is killed at the end;
//! 2. **rlimits**: CPU seconds, address space, file size, no core files;
//! 3. **namespaces**: `unshare(CLONE_NEWNET | CLONE_NEWPID)` (with `CLONE_NEWUSER` when not
//!    root): no network interface but a downed loopback, and a PID namespace whose first
//!    process is Python, so that when Python ends the kernel kills every process it left
//!    (even one that left the process group); the child forks once for that and relays
//!    Python's status. Then `RLIMIT_NPROC` (which the kernel does not apply to root; in a
//!    user namespace it counts that namespace's processes only);
//! 4. **Landlock** (Linux ≥ 5.13): no file may be written, created, removed or renamed
//!    outside the call's directory (and `/dev/null`); reading stays allowed;
//! 5. **seccomp**: `socket(2)` fails with EACCES for every family but `AF_UNIX`, and
//!    `io_uring_setup` (which could open sockets around it) with EPERM.
//!
//! Everything here runs in the forked child of a threaded process: only async-signal-safe
//! system calls, on memory prepared before the fork ([`Prepared`]).

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Which layers hold on this machine.
#[derive(Clone, Debug, Default)]
pub(crate) struct Layers {
    /// Network and PID namespaces can be made (user namespace included when not root).
    pub(crate) namespaces: bool,
    /// The Landlock ABI version, when the kernel has it.
    pub(crate) landlock: Option<u32>,
    /// A seccomp filter can be installed.
    pub(crate) seccomp: bool,
    /// Where per-call pids cgroups can be made.
    pub(crate) cgroup: Option<PathBuf>,
    /// Running as root: `RLIMIT_NPROC` is not enforced.
    pub(crate) root: bool,
}

impl Layers {
    /// The layers of this machine, probed on first use.
    pub(crate) fn get() -> &'static Layers {
        static LAYERS: OnceLock<Layers> = OnceLock::new();
        LAYERS.get_or_init(probe)
    }

    /// Whether the kernel both caps the number of processes and kills all of them at the
    /// end; when not, the Python layer refuses to start processes at all.
    pub(crate) fn processes_contained(&self) -> bool {
        self.cgroup.is_some() || (self.namespaces && !self.root)
    }

    /// One line for logs and docs: which layer enforces what here.
    pub(crate) fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        format!(
            "network+pid namespaces {}, landlock {}, seccomp socket filter {}, pids cgroup {}, \
             RLIMIT_NPROC {}, processes {}; the Python audit hook is always on",
            on(self.namespaces),
            self.landlock
                .map_or("off".to_string(), |v| format!("on (ABI {v})")),
            on(self.seccomp),
            on(self.cgroup.is_some()),
            if self.root {
                "not enforced (root)"
            } else {
                "on"
            },
            if self.processes_contained() {
                "allowed up to the cap"
            } else {
                "refused by the audit hook"
            },
        )
    }

    fn unshare_flags(&self) -> libc::c_int {
        let mut flags = libc::CLONE_NEWNET | libc::CLONE_NEWPID;
        if !self.root {
            flags |= libc::CLONE_NEWUSER;
        }
        flags
    }
}

/// Tries each layer once: the namespaces, Landlock and seccomp in a forked child that reports
/// what worked through its exit status, the cgroup from here.
fn probe() -> Layers {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let mut layers = Layers {
        root,
        cgroup: probe_cgroup(),
        ..Layers::default()
    };
    let abi = landlock_abi();
    let flags = layers.unshare_flags();
    let dir = CString::new(std::env::temp_dir().as_os_str().as_encoded_bytes()).ok();
    // SAFETY: the child makes only system calls on memory prepared before the fork, then
    // `_exit`s; the parent waits for it.
    let bits = unsafe {
        let pid = libc::fork();
        if pid == 0 {
            let mut bits = 0;
            if libc::unshare(flags) == 0 && fork_and_wait() {
                bits |= 1;
            }
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 {
                if let (Some(abi), Some(dir)) = (abi, &dir) {
                    if landlock(dir, abi).is_ok() {
                        bits |= 2;
                    }
                }
                if seccomp().is_ok() {
                    bits |= 4;
                }
            }
            libc::_exit(bits);
        }
        let mut status = 0;
        if pid < 0 || libc::waitpid(pid, &mut status, 0) != pid || !libc::WIFEXITED(status) {
            0
        } else {
            libc::WEXITSTATUS(status)
        }
    };
    layers.namespaces = bits & 1 != 0;
    layers.landlock = abi.filter(|_| bits & 2 != 0);
    layers.seccomp = bits & 4 != 0;
    layers
}

/// In the probe's child: whether a fork (into the new PID namespace) works.
///
/// # Safety
/// Only in a forked child.
unsafe fn fork_and_wait() -> bool {
    // SAFETY: as the caller's.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            libc::_exit(0);
        }
        let mut status = 0;
        pid > 0 && libc::waitpid(pid, &mut status, 0) == pid && status == 0
    }
}

/// A folder where this process may make pids cgroups and move a child into one: the v1
/// `pids` hierarchy, or the v2 root when it offers the pids controller.
fn probe_cgroup() -> Option<PathBuf> {
    let candidates = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"];
    candidates.into_iter().map(PathBuf::from).find(|base| {
        let name = format!("tandem-probe-{}", std::process::id());
        let Ok(cgroup) = Cgroup::new(base, &name, 8) else {
            return false;
        };
        let Ok(procs) = CString::new(
            cgroup
                .path
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        ) else {
            return false;
        };
        // SAFETY: the child only joins the cgroup (open, write, close) and `_exit`s.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                libc::_exit(if join_cgroup(&procs).is_ok() { 0 } else { 1 });
            }
            let mut status = 0;
            pid > 0 && libc::waitpid(pid, &mut status, 0) == pid && status == 0
        }
    })
}

/// The limits set in the child.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rlimits {
    pub(crate) cpu_seconds: u64,
    pub(crate) address_space: u64,
    pub(crate) file_size: u64,
    pub(crate) processes: u64,
}

/// What the child needs, made before the fork (no allocation after it).
pub(crate) struct Prepared {
    layers: Layers,
    rlimits: Rlimits,
    /// The call's directory, the one place it may write.
    dir: CString,
    /// `cgroup.procs` of the call's cgroup.
    cgroup_procs: Option<CString>,
}

impl Prepared {
    pub(crate) fn new(dir: &Path, cgroup: Option<&Path>, rlimits: Rlimits) -> io::Result<Prepared> {
        let c = |p: &Path| CString::new(p.as_os_str().as_encoded_bytes()).map_err(io::Error::other);
        Ok(Prepared {
            layers: Layers::get().clone(),
            rlimits,
            dir: c(dir)?,
            cgroup_procs: cgroup.map(|g| c(&g.join("cgroup.procs"))).transpose()?,
        })
    }

    /// Confines the calling process (the child, before `exec`). With the PID namespace it
    /// forks: the caller's process only waits and relays the status, and this returns in
    /// the new namespace's first process.
    ///
    /// # Safety
    /// Call only in a child between `fork` and `exec`: it may fork and `_exit`.
    pub(crate) unsafe fn apply(&self) -> io::Result<()> {
        if let Some(procs) = &self.cgroup_procs {
            join_cgroup(procs)?;
        }
        set_rlimits(&self.rlimits)?;
        if self.layers.namespaces {
            check(libc::unshare(self.layers.unshare_flags()))?;
        }
        // Only after `unshare`: a new user namespace takes the creator's RLIMIT_NPROC as the
        // cap of the user's processes outside it, and the count inside starts from zero.
        let nproc = self.rlimits.processes;
        set_rlimit(libc::RLIMIT_NPROC, nproc, nproc)?;
        if self.layers.namespaces {
            // SAFETY: the caller guarantees we are a child before exec.
            unsafe { fork_into_namespace()? };
        }
        check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        if let Some(abi) = self.layers.landlock {
            landlock(&self.dir, abi)?;
        }
        if self.layers.seccomp {
            seccomp()?;
        }
        Ok(())
    }
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn join_cgroup(procs: &CString) -> io::Result<()> {
    // SAFETY: open/write/close on a valid C string and a 1-byte buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // "0" moves the writing process.
        let n = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if n != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn set_rlimit(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads a valid struct.
    check(unsafe { libc::setrlimit(resource, &lim) })
}

/// Every limit but `RLIMIT_NPROC`.
fn set_rlimits(r: &Rlimits) -> io::Result<()> {
    // SIGXCPU at the soft limit, SIGKILL a second later.
    set_rlimit(libc::RLIMIT_CPU, r.cpu_seconds, r.cpu_seconds + 1)?;
    set_rlimit(libc::RLIMIT_AS, r.address_space, r.address_space)?;
    set_rlimit(libc::RLIMIT_FSIZE, r.file_size, r.file_size)?;
    set_rlimit(libc::RLIMIT_CORE, 0, 0)
}

/// After `unshare(CLONE_NEWPID)`: forks; the parent waits for the child (the namespace's
/// first process) and ends as it ended; the child returns.
///
/// # Safety
/// Only in a child before exec.
unsafe fn fork_into_namespace() -> io::Result<()> {
    // SAFETY: fork in a single-threaded child; both sides only make system calls.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // Python dies with the process that relays its status.
        // SAFETY: prctl takes no pointer here.
        check(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) })?;
        return Ok(());
    }
    // SAFETY: closes fds, waits and exits; no memory of the parent is touched.
    unsafe {
        // Close everything, std's exec-status pipe included: the parent's spawn must not wait
        // for this process to end.
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
            for fd in 0..1024 {
                libc::close(fd);
            }
        }
        // The handlers inherited from the parent (crate::process's, the SIGCHLD handler a
        // `wait_timeout` elsewhere in the process installed) are not ours to run: that one
        // ran on Python's exit, here where its pipe is closed, and aborted the relay.
        for sig in 1..libc::SIGRTMAX() {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let mut status = 0;
        loop {
            let r = libc::waitpid(pid, &mut status, 0);
            if r == pid {
                break;
            }
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                libc::_exit(1);
            }
        }
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            libc::signal(sig, libc::SIG_DFL);
            libc::kill(libc::getpid(), sig);
        }
        libc::_exit(libc::WEXITSTATUS(status));
    }
}

// Landlock: the kernel's ABI (linux/landlock.h).
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_RULE_PATH_BENEATH: u32 = 1;
const FS_WRITE_FILE: u64 = 1 << 1;
/// REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK,
/// MAKE_SYM (ABI 1).
const FS_CHANGE_TREE: u64 = 0x1ff0;
const FS_REFER: u64 = 1 << 13;
const FS_TRUNCATE: u64 = 1 << 14;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
}

#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// The Landlock ABI version, or None without Landlock.
fn landlock_abi() -> Option<u32> {
    // SAFETY: the version query takes no pointer.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then_some(v as u32)
}

/// The write rights of `abi`: (all handled, the ones a file rule may carry).
fn landlock_rights(abi: u32) -> (u64, u64) {
    let mut all = FS_WRITE_FILE | FS_CHANGE_TREE;
    let mut file = FS_WRITE_FILE;
    if abi >= 2 {
        all |= FS_REFER;
    }
    if abi >= 3 {
        all |= FS_TRUNCATE;
        file |= FS_TRUNCATE;
    }
    (all, file)
}

fn landlock(dir: &CString, abi: u32) -> io::Result<()> {
    let (all, file) = landlock_rights(abi);
    let attr = RulesetAttr {
        handled_access_fs: all,
    };
    // SAFETY: raw Landlock system calls on valid structs and C strings; every fd is closed.
    unsafe {
        let ruleset = libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &attr as *const RulesetAttr,
            std::mem::size_of::<RulesetAttr>(),
            0u32,
        );
        if ruleset < 0 {
            return Err(io::Error::last_os_error());
        }
        let ruleset = ruleset as libc::c_int;
        let allow = |path: *const libc::c_char, rights: u64| -> io::Result<()> {
            let fd = libc::open(path, libc::O_PATH | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let rule = PathBeneathAttr {
                allowed_access: rights,
                parent_fd: fd,
            };
            let r = libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset,
                LANDLOCK_RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0u32,
            );
            libc::close(fd);
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        let done = allow(dir.as_ptr(), all)
            .and_then(|_| allow(c"/dev/null".as_ptr(), file))
            .and_then(|_| {
                let r = libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0u32);
                if r < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
        libc::close(ruleset);
        done
    }
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// The seccomp program: on a foreign architecture (x86's 32-bit entry) or the x32 ABI, every
/// system call fails; `socket` fails unless its family is `AF_UNIX`; `io_uring_setup` fails;
/// everything else is allowed.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn seccomp_program() -> [libc::sock_filter; 13] {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let op = |code: u32, k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let load = |offset: u32| op(BPF_LD | BPF_W | BPF_ABS, offset, 0, 0);
    let ret = |action: u32| op(BPF_RET | BPF_K, action, 0, 0);
    let eq = |k: u32, jt: u8, jf: u8| op(BPF_JMP | BPF_JEQ | BPF_K, k, jt, jf);
    let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    let eacces = libc::SECCOMP_RET_ERRNO | libc::EACCES as u32;
    // x32's system call numbers carry this bit; on aarch64 none does.
    const X32_BIT: u32 = 0x4000_0000;
    // seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low half: little endian). A jump's
    // targets count from the next instruction.
    [
        load(4),                                      // 0
        eq(AUDIT_ARCH, 1, 0),                         // 1: native -> 3
        ret(eperm),                                   // 2
        load(0),                                      // 3
        op(BPF_JMP | BPF_JGE | BPF_K, X32_BIT, 0, 1), // 4: x32 -> 5, else 6
        ret(eperm),                                   // 5
        eq(libc::SYS_io_uring_setup as u32, 0, 1),    // 6
        ret(eperm),                                   // 7
        eq(libc::SYS_socket as u32, 0, 3),            // 8: socket -> 9, else 12
        load(16),                                     // 9
        eq(libc::AF_UNIX as u32, 1, 0),               // 10: AF_UNIX -> 12
        ret(eacces),                                  // 11
        ret(libc::SECCOMP_RET_ALLOW),                 // 12
    ]
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn seccomp() -> io::Result<()> {
    let filter = seccomp_program();
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: the program outlives the call (the kernel copies it); no_new_privs is set.
    check(unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const libc::sock_fprog,
        )
    })
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn seccomp() -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// A call's pids cgroup: made with its cap, and on drop every process still in it killed
/// and the cgroup removed.
pub(crate) struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    pub(crate) fn new(base: &Path, name: &str, max: u64) -> io::Result<Cgroup> {
        let path = base.join(name);
        std::fs::create_dir(&path)?;
        let cgroup = Cgroup { path };
        std::fs::write(cgroup.path.join("pids.max"), max.to_string())?;
        Ok(cgroup)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // A process may still be exiting (or forking): kill and retry for a while.
        for _ in 0..200 {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) on a pid read from the cgroup; no memory involved.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            if std::fs::remove_dir(&self.path).is_ok() || !self.path.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
