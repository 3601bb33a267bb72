//! Run-time compilation of the kernel sources with NVRTC, straight to a cubin for the GPU's
//! architecture, cached on disk. The cache key is the source hash (which covers the defines,
//! since they are prepended to the source), the architecture and the NVRTC version, so a
//! changed kernel, another GPU or another CUDA never picks up a stale binary.
//!
//! Compiling needs only libnvrtc, not a GPU: `tandem gpu-test --compile-only` checks every
//! kernel on a machine without one.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nr, sys as ns};

/// Helpers every kernel file uses; prepended to each source.
pub(crate) const COMMON: &str = include_str!("common.cuh");

/// One kernel family: a name (for the cache file and messages), its CUDA C source, and whether
/// it is compiled once per attention head dim (`HD` and `TILE` defines).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Family {
    pub(crate) name: &'static str,
    pub(crate) src: &'static str,
    pub(crate) per_head_dim: bool,
    /// Only training runs it (the attention backward): a process that only generates or
    /// scores does not compile it ahead of use.
    pub(crate) training_only: bool,
}

/// The full source NVRTC sees: defines, the common helpers, the family.
pub(crate) fn full_source(fam: Family, defines: &[(&str, usize)]) -> String {
    let mut s = String::new();
    for (k, v) in defines {
        s.push_str(&format!("#define {k} {v}\n"));
    }
    let (common, src) = match dev_sources(fam.name) {
        Some((c, f)) => (std::borrow::Cow::Owned(c), std::borrow::Cow::Owned(f)),
        None => (COMMON.into(), fam.src.into()),
    };
    s.push_str(&common);
    s.push('\n');
    s.push_str(&src);
    s
}

/// Kernel development without a rebuild: with `TANDEM_KERNEL_SRC` naming a checkout of the
/// repository, the kernels are compiled from its `common.cuh` and `ops/<family>/<family>.cu`
/// instead of the copies built into the binary (a changed file is a new cache key, so the
/// cache cannot serve the old kernel). None when unset or a file is missing.
fn dev_sources(family: &str) -> Option<(String, String)> {
    dev_sources_in(
        &PathBuf::from(std::env::var_os("TANDEM_KERNEL_SRC")?),
        family,
    )
}

fn dev_sources_in(checkout: &std::path::Path, family: &str) -> Option<(String, String)> {
    let root = checkout.join("src/lib/backend");
    let common = std::fs::read_to_string(root.join("cuda/common.cuh")).ok()?;
    let fam = std::fs::read_to_string(root.join(format!("ops/{family}/{family}.cu"))).ok()?;
    Some((common, fam))
}

/// FNV-1a: a stable 64-bit hash (std's hasher may change between Rust releases).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether libnvrtc can be loaded (checked before the first call: cudarc panics otherwise).
pub fn present() -> bool {
    // SAFETY: is_culib_present only tries to load libnvrtc; it has no preconditions.
    unsafe { ns::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32)> {
    if !present() {
        bail!("libnvrtc not found (it ships with the CUDA toolkit or the nvidia-cuda-nvrtc wheel)");
    }
    let (mut ma, mut mi) = (0i32, 0i32);
    // SAFETY: libnvrtc is present (checked above); the two out-pointers are live locals.
    unsafe { ns::nvrtcVersion(&mut ma, &mut mi) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((ma, mi))
}

/// Compiles `src` to a cubin for `arch` ("sm_90").
pub(crate) fn compile_cubin(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    if !present() {
        bail!("libnvrtc not found: cannot compile the CUDA kernels");
    }
    let csrc = CString::new(src).context("kernel source holds a NUL byte")?;
    let cname = CString::new(format!("{name}.cu"))?;
    let opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    let res = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<u8>> {
        let prog = nr::create_program(&csrc, Some(&cname))
            .map_err(|e| anyhow!("nvrtcCreateProgram: {e:?}"))?;
        let out = (|| {
            // SAFETY: `prog` is a live program (created above, destroyed only after this closure)
            // and `opts` outlives the call.
            if let Err(e) = unsafe { nr::compile_program(prog, &opts) } {
                // SAFETY: `prog` is live and has been compiled (the log exists after a failed
                // compile).
                let log = unsafe { nr::get_program_log(prog) }
                    .map(|l| {
                        // SAFETY: NVRTC's log is NUL-terminated and `l` owns it for this
                        // expression.
                        unsafe { CStr::from_ptr(l.as_ptr()) }
                            .to_string_lossy()
                            .into_owned()
                    })
                    .unwrap_or_default();
                bail!("NVRTC failed to compile {name}.cu for {arch} ({e:?}):\n{log}");
            }
            let mut size = 0usize;
            // SAFETY: `prog` compiled (above); `size` is a live local.
            unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds the `size` bytes nvrtcGetCUBINSize reported for this program.
            unsafe { ns::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(cubin)
        })();
        // SAFETY: `prog` is live and not used after this; the closure that used it has returned.
        let _ = unsafe { nr::destroy_program(prog) };
        out
    }));
    res.unwrap_or_else(|_| Err(anyhow!("NVRTC panicked while compiling {name}.cu")))
}

/// Where compiled kernels are kept: `$TANDEM_CACHE/kernels`, else `~/.cache/tandem/kernels`.
pub(crate) fn default_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TANDEM_CACHE") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tandem/kernels"))
}

/// A program's cubin (and whether it came from the disk cache), or why it could not be had;
/// filled once, by whichever thread gets to it first.
type Slot = Arc<OnceLock<Result<(Vec<u8>, bool), String>>>;

/// Compiles on first use and keeps cubins on disk.
pub(crate) struct KernelCache {
    dir: Option<PathBuf>,
    arch: String,
    nvrtc: (i32, i32),
    /// One slot per program (family name and source hash): a caller that needs a program
    /// whose compilation `prefetch` started waits for it instead of compiling it again.
    slots: Mutex<HashMap<(&'static str, u64), Slot>>,
}

impl KernelCache {
    pub fn new(arch: &str, dir: Option<PathBuf>) -> Result<Self> {
        Ok(KernelCache {
            dir,
            arch: arch.to_string(),
            nvrtc: version()?,
            slots: Mutex::new(HashMap::new()),
        })
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub(crate) fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc
    }

    /// The cache file of a source: `NAME-HASH-ARCH-nvrtcMAJ.MIN.cubin`.
    pub(crate) fn path_for(&self, name: &str, src: &str) -> Option<PathBuf> {
        let (ma, mi) = self.nvrtc;
        self.dir.as_ref().map(|d| {
            d.join(format!(
                "{name}-{:016x}-{}-nvrtc{ma}.{mi}.cubin",
                fnv1a(src.as_bytes()),
                self.arch
            ))
        })
    }

    /// The cubin of a family with these defines, from the disk cache or freshly compiled.
    /// Returns the binary and whether it came from the cache.
    pub fn get(&self, fam: Family, defines: &[(&str, usize)]) -> Result<(Vec<u8>, bool)> {
        let src = full_source(fam, defines);
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            let key = (fam.name, fnv1a(src.as_bytes()));
            slots.entry(key).or_default().clone()
        };
        slot.get_or_init(|| {
            self.load_or_compile(fam.name, &src)
                .map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
    }

    /// Starts compiling these programs (a family and its defines each) on threads of their
    /// own, so that a process's first use of each kernel finds it compiled: on a machine
    /// without the disk cache NVRTC takes seconds per family, one after the other otherwise.
    /// Errors are kept for the `get` that needs the program.
    /// The threads are returned: a process must join them before it exits, since exiting
    /// while NVRTC compiles on another thread corrupts the heap.
    pub(crate) fn prefetch(self: &Arc<Self>, programs: Vec<Program>) -> Vec<JoinHandle<()>> {
        programs
            .into_iter()
            .filter_map(|(fam, defines)| {
                let cache = Arc::clone(self);
                // Without a thread the program is compiled on first use, as before.
                std::thread::Builder::new()
                    .name(format!("nvrtc-{}", fam.name))
                    .spawn(move || {
                        let _ = cache.get(fam, &defines);
                    })
                    .ok()
            })
            .collect()
    }

    /// The cubin from the disk cache, else compiled and written there.
    fn load_or_compile(&self, name: &str, src: &str) -> Result<(Vec<u8>, bool)> {
        let path = self.path_for(name, src);
        if let Some(p) = &path {
            if let Ok(bin) = std::fs::read(p) {
                if !bin.is_empty() {
                    return Ok((bin, true));
                }
            }
        }
        let bin = compile_cubin(name, src, &self.arch)?;
        if let Some(p) = &path {
            // Best effort: a read-only or missing home only costs a recompile next time.
            if let Some(dir) = p.parent() {
                if std::fs::create_dir_all(dir).is_ok() {
                    let tmp = p.with_extension(format!(
                        "tmp{}-{:?}",
                        std::process::id(),
                        std::thread::current().id()
                    ));
                    if std::fs::write(&tmp, &bin).is_ok() {
                        let _ = std::fs::rename(&tmp, p);
                    }
                }
            }
        }
        Ok((bin, false))
    }
}

/// A program: a family and the defines it is compiled with.
pub(crate) type Program = (Family, Vec<(&'static str, usize)>);

/// The programs of the families without a head dim.
pub(crate) fn plain_programs(families: &[Family]) -> Vec<Program> {
    families
        .iter()
        .filter(|f| !f.per_head_dim)
        .map(|&f| (f, vec![]))
        .collect()
}

/// The programs of the per-head-dim families for head dim `hd`, the training-only ones
/// (attention backward) only when `training`.
pub(crate) fn head_dim_programs(families: &[Family], hd: usize, training: bool) -> Vec<Program> {
    families
        .iter()
        .filter(|f| f.per_head_dim && (training || !f.training_only))
        .map(|&f| (f, vec![("HD", hd), ("TILE", attention_tile(hd))]))
        .collect()
}

/// Attention tile rows for a head dim: 64 up to 128 (shared memory of the backward fits), 32 above.
pub(crate) fn attention_tile(head_dim: usize) -> usize {
    if head_dim <= 128 {
        64
    } else {
        32
    }
}

/// Compiles `families` (the per-head-dim ones for the common head dims) for `arch`, each
/// program on a thread of its own; returns (program, cubin bytes, seconds) per program.
/// `backend::ops::compile_all` passes every family.
pub(crate) fn compile_all(families: &[Family], arch: &str) -> Result<Vec<(String, usize, f64)>> {
    let mut progs = plain_programs(families);
    for hd in [64, 128, 256] {
        progs.extend(head_dim_programs(families, hd, true));
    }
    std::thread::scope(|s| {
        let jobs: Vec<_> = progs
            .iter()
            .map(|(fam, defs)| {
                s.spawn(move || {
                    let t = std::time::Instant::now();
                    let bin = compile_cubin(fam.name, &full_source(*fam, defs), arch)?;
                    let name = match defs.first() {
                        Some((_, hd)) => format!("{} (HD={hd})", fam.name),
                        None => fam.name.to_string(),
                    };
                    Ok((name, bin.len(), t.elapsed().as_secs_f64()))
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(anyhow!("a compile thread panicked")))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn a_checkouts_kernel_files_replace_the_built_in_ones() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("src/lib/backend");
        std::fs::create_dir_all(root.join("cuda")).unwrap();
        std::fs::create_dir_all(root.join("ops/rope")).unwrap();
        assert!(super::dev_sources_in(dir.path(), "rope").is_none());
        std::fs::write(root.join("cuda/common.cuh"), "// common\n").unwrap();
        assert!(super::dev_sources_in(dir.path(), "rope").is_none());
        std::fs::write(root.join("ops/rope/rope.cu"), "// rope\n").unwrap();
        let (c, f) = super::dev_sources_in(dir.path(), "rope").unwrap();
        assert_eq!((c.as_str(), f.as_str()), ("// common\n", "// rope\n"));
        assert!(super::dev_sources_in(dir.path(), "sample").is_none());
        // The repository's own files are the built-in ones.
        let (c, f) =
            super::dev_sources_in(std::path::Path::new(env!("CARGO_MANIFEST_DIR")), "rope")
                .unwrap();
        assert_eq!(c, super::COMMON);
        assert_eq!(f, crate::backend::ops::rope::cuda::KERNELS.src);
    }

    #[test]
    fn defines_change_the_source_and_so_the_key() {
        let fam = Family {
            name: "attention",
            src: "extern \"C\" __global__ void k() {}",
            per_head_dim: true,
            training_only: false,
        };
        let a = full_source(fam, &[("HD", 64), ("TILE", 64)]);
        let b = full_source(fam, &[("HD", 128), ("TILE", 64)]);
        assert!(a.starts_with("#define HD 64\n#define TILE 64\n"));
        assert_ne!(fnv1a(a.as_bytes()), fnv1a(b.as_bytes()));
        let cache = KernelCache {
            dir: Some(PathBuf::from("/c")),
            arch: "sm_90".into(),
            nvrtc: (13, 0),
            slots: Mutex::new(HashMap::new()),
        };
        let p = cache.path_for("attention", &a).unwrap();
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("attention-") && name.ends_with("-sm_90-nvrtc13.0.cubin"));
        assert_ne!(p, cache.path_for("attention", &b).unwrap());
    }

    /// A prefetched program is read once and handed to every later `get`: several threads ask
    /// for it at once and all see the disk cache's bytes (no NVRTC needed for that).
    #[test]
    fn prefetched_programs_come_from_one_slot() {
        let dir = std::env::temp_dir().join(format!("tandem-kc-{}", std::process::id()));
        let fam = Family {
            name: "probe",
            src: "extern \"C\" __global__ void k() {}",
            per_head_dim: true,
            training_only: false,
        };
        let cache = Arc::new(KernelCache {
            dir: Some(dir.clone()),
            arch: "sm_90".into(),
            nvrtc: (13, 0),
            slots: Mutex::new(HashMap::new()),
        });
        let progs = [64, 128]
            .into_iter()
            .flat_map(|hd| head_dim_programs(&[fam], hd, false))
            .collect::<Vec<_>>();
        assert_eq!(progs.len(), 2);
        for (i, (f, defs)) in progs.iter().enumerate() {
            let p = cache.path_for(f.name, &full_source(*f, defs)).unwrap();
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, [i as u8 + 1; 8]).unwrap();
        }
        let threads = cache.prefetch(progs.clone());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let (bin, cached) = cache.get(fam, &progs[1].1).unwrap();
                    assert_eq!((bin, cached), (vec![2u8; 8], true));
                });
            }
        });
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(cache.get(fam, &progs[0].1).unwrap(), (vec![1u8; 8], true));
        assert_eq!(cache.slots.lock().unwrap().len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
