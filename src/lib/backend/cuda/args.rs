//! A kernel launch's arguments, built in the kernel's parameter order so that a launch site
//! states each argument once: a buffer with its type tag in one call (`buf`), a bf16-only
//! operand by address (`ptr`), an index buffer (`idx`), scalars by their C type (`i32`,
//! `i64`, `f32`, `f64`), and recurring runs of arguments as an [`ArgGroup`].
//!
//! The values live inline in the builder (fixed arrays, no allocation per launch);
//! `CudaBackend::launch` hands the driver the address of each for the duration of the call
//! (cuLaunchKernel copies the parameters before it returns).

use std::ffi::c_void;
use std::marker::PhantomData;

use anyhow::{bail, Result};

use super::{CudaBuf, CudaIdx};

/// Most arguments of one launch (`paged_attn_mma_rope_k` takes 22).
pub(crate) const MAX_ARGS: usize = 24;

/// One scalar or device address, in the first bytes of an 8-byte aligned word (the driver
/// reads as many bytes as the kernel's parameter has).
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Word([u8; 8]);

/// A struct a kernel takes by value: `#[repr(C)]` and laid out as its C twin (the rope's
/// `Freqs`). It is passed by reference to its bytes, which outlive the [`Args`].
pub(crate) trait ByValue {}

/// A run of arguments several kernels take in the same order (a shape, a block table).
pub(crate) trait ArgGroup {
    fn push<'a>(&'a self, a: Args<'a>) -> Args<'a>;
}

/// Methods that push a scalar of one C type (each its own, so that no width slips through).
macro_rules! scalars {
    ($($t:ident: $c:literal),*) => {$(
        #[doc = concat!("`", $c, "`.")]
        #[inline]
        pub(crate) fn $t(self, v: $t) -> Self {
            self.word(v.to_ne_bytes())
        }
    )*};
}

/// The arguments of one launch, in the kernel's order (see the module docs).
pub(crate) struct Args<'a> {
    words: [Word; MAX_ARGS],
    /// Where argument i lives when it is not in `words[i]` (a [`ByValue`] struct); null else.
    refs: [*const c_void; MAX_ARGS],
    /// Arguments pushed (more than `MAX_ARGS` is an error at launch).
    n: usize,
    _refs: PhantomData<&'a ()>,
}

impl Default for Args<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> Args<'a> {
    #[inline]
    pub(crate) fn new() -> Self {
        Args {
            words: [Word([0; 8]); MAX_ARGS],
            refs: [std::ptr::null(); MAX_ARGS],
            n: 0,
            _refs: PhantomData,
        }
    }

    #[inline]
    fn word<const N: usize>(mut self, bytes: [u8; N]) -> Self {
        if let Some(w) = self.words.get_mut(self.n) {
            w.0[..N].copy_from_slice(&bytes);
        }
        self.n += 1;
        self
    }

    scalars!(i32: "int", i64: "i64 (long long)", f32: "float", f64: "double");

    /// A device address (any pointer parameter): a pooled block, the error word, 0 for none.
    #[inline]
    pub(crate) fn raw(self, ptr: u64) -> Self {
        self.word(ptr.to_ne_bytes())
    }

    /// `void* x, int xbf`: a buffer and its type tag (1 for bf16, 0 for f32).
    #[inline]
    pub(crate) fn buf(self, b: &CudaBuf) -> Self {
        self.buf_at(b, 0)
    }

    /// [`Args::buf`] from element `off` on.
    #[inline]
    pub(crate) fn buf_at(self, b: &CudaBuf, off: usize) -> Self {
        self.raw(b.at(off)).i32(b.bf())
    }

    /// [`Args::buf_at`] of an optional buffer: null and tag 0 when absent.
    #[inline]
    pub(crate) fn opt_buf_at(self, b: Option<&CudaBuf>, off: usize) -> Self {
        match b {
            Some(b) => self.buf_at(b, off),
            None => self.raw(0).i32(0),
        }
    }

    /// A buffer's address alone: a parameter of one type (`bf16_t*`, `float*`, `uint4*`), the
    /// type checked by the caller.
    #[inline]
    pub(crate) fn ptr(self, b: &CudaBuf) -> Self {
        self.raw(b.ptr)
    }

    /// [`Args::buf`] of each, in order.
    #[inline]
    pub(crate) fn bufs(self, bs: &[&CudaBuf]) -> Self {
        bs.iter().fold(self, |a, b| a.buf(b))
    }

    /// [`Args::ptr`] of each, in order.
    #[inline]
    pub(crate) fn ptrs(self, bs: &[&CudaBuf]) -> Self {
        bs.iter().fold(self, |a, b| a.ptr(b))
    }

    /// `const u32*`: an index buffer.
    #[inline]
    pub(crate) fn idx(self, i: &CudaIdx) -> Self {
        self.raw(i.ptr)
    }

    /// `const u32*` from index `off` on.
    #[inline]
    pub(crate) fn idx_at(self, i: &CudaIdx, off: usize) -> Self {
        self.raw(i.at(off))
    }

    /// A struct passed by value (see [`ByValue`]).
    #[inline]
    pub(crate) fn by_value<T: ByValue>(mut self, v: &'a T) -> Self {
        if let Some(r) = self.refs.get_mut(self.n) {
            *r = v as *const T as *const c_void;
        }
        self.n += 1;
        self
    }

    /// The arguments of `g`, in its order.
    #[inline]
    pub(crate) fn with<G: ArgGroup>(self, g: &'a G) -> Self {
        g.push(self)
    }

    /// The driver's parameter array: the address of each argument, valid while `self` is
    /// borrowed; `n` of them are used.
    #[inline]
    pub(crate) fn pointers(&self) -> Result<([*mut c_void; MAX_ARGS], usize)> {
        if self.n > MAX_ARGS {
            bail!(
                "cuda: a launch of {} arguments (at most {MAX_ARGS})",
                self.n
            );
        }
        let mut ptrs = [std::ptr::null_mut(); MAX_ARGS];
        for (i, p) in ptrs.iter_mut().enumerate().take(self.n) {
            let r = self.refs[i];
            *p = if r.is_null() {
                &self.words[i] as *const Word as *mut c_void
            } else {
                r as *mut c_void
            };
        }
        Ok((ptrs, self.n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `N` bytes at an argument's address (what the driver reads for a parameter of
    /// that size).
    fn bytes<const N: usize>(p: *mut c_void) -> [u8; N] {
        // SAFETY: every pointer of `pointers` addresses at least 8 readable bytes (a `Word`)
        // or a `ByValue` struct of at least N bytes, alive while the `Args` is.
        unsafe { *(p as *const [u8; N]) }
    }

    #[test]
    fn each_argument_has_its_c_width_and_order() {
        #[repr(C)]
        struct Pair([f32; 2]);
        impl ByValue for Pair {}
        let pair = Pair([1.5, -2.0]);
        let a = Args::new()
            .i32(-3)
            .i64(1 << 40)
            .f32(0.25)
            .f64(0.5)
            .raw(0xdead_beef_0000)
            .by_value(&pair);
        let (p, n) = a.pointers().unwrap();
        assert_eq!(n, 6);
        assert_eq!(i32::from_ne_bytes(bytes(p[0])), -3);
        assert_eq!(i64::from_ne_bytes(bytes(p[1])), 1 << 40);
        assert_eq!(f32::from_ne_bytes(bytes(p[2])), 0.25);
        assert_eq!(f64::from_ne_bytes(bytes(p[3])), 0.5);
        assert_eq!(u64::from_ne_bytes(bytes(p[4])), 0xdead_beef_0000);
        assert_eq!(p[5] as *const Pair, &pair as *const Pair);
        assert!(p[6..].iter().all(|p| p.is_null()));
    }

    #[test]
    fn a_launch_past_max_args_is_an_error_not_a_panic() {
        let a = (0..MAX_ARGS + 1).fold(Args::new(), |a, i| a.i32(i as i32));
        assert!(a.pointers().is_err());
        let a = (0..MAX_ARGS).fold(Args::new(), |a, i| a.i32(i as i32));
        assert_eq!(a.pointers().unwrap().1, MAX_ARGS);
    }
}
