//! The communicator interface: collectives on backend buffers, started as a group on a
//! communication stream and waited for through a [`Work`] handle.
//!
//! Semantics, shared by every implementation (`n` ranks, this one is `r`):
//! - `all_reduce(buf[off..off+len])`: every rank ends with the reduction of all ranks' ranges.
//! - `all_gather(send[s..s+c] -> recv[off..off+n·c])`: rank p's piece lands at `off + p·c`.
//!   In place: rank r's piece is already at `recv[off + r·c..]`.
//! - `reduce_scatter(send[s..s+n·c] -> recv[off..off+c])`: rank r gets the reduction of chunk r.
//!   In place: the input is `buf[off..off+n·c]` and chunk r is reduced where it is
//!   (`buf[off + r·c..]`); the other chunks keep their values.
//! - `broadcast(buf[off..off+len], root)`: every rank ends with root's range.
//! - Reductions: [`ReduceOp::Sum`], [`ReduceOp::Avg`] (= Scaled(1/n)) and
//!   [`ReduceOp::Scaled`]`(s)` = Σ_p s·x_p (NCCL's pre-multiplied sum).
//! - Element type: the buffer's ([`crate::backend::Device::dtype`]). `as_dtype(BF16)` on a
//!   backend that stores f32 (the CPU) makes the collective behave as on a bf16 buffer: inputs
//!   rounded to bf16, results rounded to bf16. A CUDA buffer's dtype cannot be overridden (`as_dtype` of the
//!   buffer's own type is allowed everywhere, so generic code may always say it).
//!
//! Ordering: [`Comm::start`] runs after everything already queued on the backend (the CUDA
//! compute stream), concurrently with what is queued after it; [`Work::wait`] orders later
//! backend work after the collectives. The buffers stay borrowed until then, so the compiler
//! keeps the compute from touching them meanwhile. Dropping a `Work` waits for it.

use crate::backend::{Backend, DType};
use anyhow::{bail, Result};
use std::time::Duration;

/// `v` = Σ over the ranks, each f64 carried as two f32 (hi + lo) through the f32 collective.
pub(crate) fn sum_f64<B: Backend>(backend: &B, comm: &dyn Comm<B>, v: &mut [f64]) -> Result<()> {
    let n = v.len();
    let mut host = Vec::with_capacity(2 * n);
    host.extend(v.iter().map(|&x| x as f32));
    host.extend(v.iter().map(|&x| (x - x as f32 as f64) as f32));
    let mut buf = backend.alloc(2 * n)?;
    backend.upload(&mut buf, &host)?;
    comm.all_reduce(&mut buf, 0, 2 * n, ReduceOp::Sum)?;
    backend.download(&buf, &mut host)?;
    for (i, x) in v.iter_mut().enumerate() {
        *x = host[i] as f64 + host[n + i] as f64;
    }
    Ok(())
}

/// "f32" or "bf16".
pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
    }
}

/// Bytes of one element of `d`.
pub(crate) fn dtype_bytes(d: DType) -> usize {
    match d {
        DType::F32 => 4,
        DType::BF16 => 2,
    }
}

/// `v` as a buffer of `d` stores it (bf16: rounded to nearest even).
pub(crate) fn round_to(v: f32, d: DType) -> f32 {
    match d {
        DType::F32 => v,
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
    }
}

/// How the values of the ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReduceOp {
    /// Σ_p x_p.
    Sum,
    /// Σ_p x_p / n, computed as Σ_p (1/n)·x_p.
    Avg,
    /// Σ_p s·x_p.
    Scaled(f32),
}

impl ReduceOp {
    /// The factor each rank's value is multiplied by before the sum (None: 1).
    pub(crate) fn premul(self, world_size: usize) -> Option<f32> {
        match self {
            ReduceOp::Sum => None,
            ReduceOp::Avg => Some(1.0 / world_size as f32),
            ReduceOp::Scaled(s) => Some(s),
        }
    }
}

/// What a collective does and where (see the module docs for each kind's semantics).
pub(crate) enum Kind<'a, B: Backend> {
    AllReduce {
        buf: &'a mut B::Buf,
        off: usize,
        len: usize,
        op: ReduceOp,
    },
    AllGather {
        /// None: in place (this rank's piece is at `recv[off + rank·count..]`).
        send: Option<(&'a B::Buf, usize)>,
        recv: &'a mut B::Buf,
        off: usize,
        count: usize,
    },
    ReduceScatter {
        /// None: in place (the input is `recv[off..off + n·count]`, the result at
        /// `recv[off + rank·count..]`).
        send: Option<(&'a B::Buf, usize)>,
        recv: &'a mut B::Buf,
        off: usize,
        count: usize,
        op: ReduceOp,
    },
    Broadcast {
        buf: &'a mut B::Buf,
        off: usize,
        len: usize,
        root: usize,
    },
}

/// One collective of a group.
pub struct Collective<'a, B: Backend> {
    pub(crate) kind: Kind<'a, B>,
    /// Element type when it differs from the buffer's (the CPU emulating bf16).
    pub dtype: Option<DType>,
}

impl<'a, B: Backend> Collective<'a, B> {
    fn of(kind: Kind<'a, B>) -> Self {
        Collective { kind, dtype: None }
    }

    /// `buf[off..off+len]` = reduction over the ranks, in place.
    pub fn all_reduce(buf: &'a mut B::Buf, off: usize, len: usize, op: ReduceOp) -> Self {
        Self::of(Kind::AllReduce { buf, off, len, op })
    }

    /// `recv[off + p·count..][..count]` = rank p's `send[send_off..][..count]`.
    pub fn all_gather(
        send: &'a B::Buf,
        send_off: usize,
        recv: &'a mut B::Buf,
        off: usize,
        count: usize,
    ) -> Self {
        Self::of(Kind::AllGather {
            send: Some((send, send_off)),
            recv,
            off,
            count,
        })
    }

    /// All-gather where this rank's piece already sits at `buf[off + rank·count..]`.
    pub(crate) fn all_gather_in_place(buf: &'a mut B::Buf, off: usize, count: usize) -> Self {
        Self::of(Kind::AllGather {
            send: None,
            recv: buf,
            off,
            count,
        })
    }

    /// `recv[off..][..count]` = reduction over the ranks of their `send[send_off + rank·count..]`.
    pub fn reduce_scatter(
        send: &'a B::Buf,
        send_off: usize,
        recv: &'a mut B::Buf,
        off: usize,
        count: usize,
        op: ReduceOp,
    ) -> Self {
        Self::of(Kind::ReduceScatter {
            send: Some((send, send_off)),
            recv,
            off,
            count,
            op,
        })
    }

    /// Reduce-scatter of `buf[off..off + n·count]` whose result stays at `buf[off + rank·count..]`.
    pub(crate) fn reduce_scatter_in_place(
        buf: &'a mut B::Buf,
        off: usize,
        count: usize,
        op: ReduceOp,
    ) -> Self {
        Self::of(Kind::ReduceScatter {
            send: None,
            recv: buf,
            off,
            count,
            op,
        })
    }

    /// `buf[off..off+len]` = root's values.
    pub fn broadcast(buf: &'a mut B::Buf, off: usize, len: usize, root: usize) -> Self {
        Self::of(Kind::Broadcast {
            buf,
            off,
            len,
            root,
        })
    }

    /// Runs the collective as on buffers of `dtype` (see the module docs).
    pub fn as_dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// Name for messages.
    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::AllReduce { .. } => "all_reduce",
            Kind::AllGather { .. } => "all_gather",
            Kind::ReduceScatter { .. } => "reduce_scatter",
            Kind::Broadcast { .. } => "broadcast",
        }
    }

    /// Elements this collective moves per rank's input (what bandwidth figures count).
    pub fn elements(&self, world_size: usize) -> usize {
        match &self.kind {
            Kind::AllReduce { len, .. } | Kind::Broadcast { len, .. } => *len,
            Kind::AllGather { count, .. } => *count,
            Kind::ReduceScatter { count, .. } => count * world_size,
        }
    }

    /// Checks ranges and the root against the buffers' lengths (`len_of`) and the world.
    pub(crate) fn validate(
        &self,
        world_size: usize,
        len_of: impl Fn(&B::Buf) -> usize,
    ) -> Result<()> {
        let name = self.name();
        let fits = |what: &str, have: usize, off: usize, n: usize| -> Result<()> {
            if off.checked_add(n).is_none_or(|end| end > have) {
                bail!(
                    "{name}: {what} range {off}..{} is outside its buffer of {have}",
                    off + n
                );
            }
            Ok(())
        };
        let n = world_size;
        match &self.kind {
            Kind::AllReduce { buf, off, len, .. } => fits("buffer", len_of(buf), *off, *len),
            Kind::Broadcast {
                buf,
                off,
                len,
                root,
            } => {
                if *root >= n {
                    bail!("broadcast: root {root} is outside the world of {n}");
                }
                fits("buffer", len_of(buf), *off, *len)
            }
            Kind::AllGather {
                send,
                recv,
                off,
                count,
            } => {
                fits("receive", len_of(recv), *off, n * count)?;
                if let Some((s, so)) = send {
                    fits("send", len_of(s), *so, *count)?;
                }
                Ok(())
            }
            Kind::ReduceScatter {
                send,
                recv,
                off,
                count,
                ..
            } => match send {
                Some((s, so)) => {
                    fits("send", len_of(s), *so, n * count)?;
                    fits("receive", len_of(recv), *off, *count)
                }
                None => fits("buffer", len_of(recv), *off, n * count),
            },
        }
    }
}

/// What an implementation keeps of a started group until it is waited for.
pub(crate) trait Pending {
    /// Orders later backend work after the group (and delivers its results); the error of
    /// any collective of the group.
    fn wait(self: Box<Self>) -> Result<()>;
}

/// A started group of collectives. Holds the buffers' borrows until `wait` (or drop).
#[must_use = "a started collective must be waited for (dropping the handle waits too)"]
pub struct Work<'a> {
    pending: Option<Box<dyn Pending + 'a>>,
}

impl<'a> Work<'a> {
    pub(crate) fn new(pending: Box<dyn Pending + 'a>) -> Work<'a> {
        Work {
            pending: Some(pending),
        }
    }

    /// Waits for the group (see [`Pending::wait`]).
    pub fn wait(mut self) -> Result<()> {
        match self.pending.take() {
            Some(p) => p.wait(),
            None => Ok(()),
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if let Err(e) = p.wait() {
                eprintln!("tandem dist: a collective dropped without wait failed: {e:#}");
            }
        }
    }
}

/// A communicator among the ranks of a process group, on the buffers of backend `B`.
pub trait Comm<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// "nccl" or "host".
    fn name(&self) -> &'static str;
    /// True when each reduction adds the ranks' values in rank order in f32 (then rounds once
    /// to the element type): results are bit-identical on every rank and to a host loop.
    fn rank_order_reductions(&self) -> bool;
    /// Starts `ops` as one group (see the module docs for the ordering).
    fn start<'a>(&'a self, ops: Vec<Collective<'a, B>>) -> Result<Work<'a>>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// How long a collective may wait for the other ranks before the job fails.
    fn set_timeout(&self, timeout: Duration);
    /// From now on orders the collectives after `backend`'s work (and `Work::wait` orders
    /// `backend`'s work after them): a communicator kept for buffers of a newer backend on the
    /// same device (a weight transfer's bridge). Nothing to do where collectives run on the host.
    fn follow(&mut self, backend: &B) -> Result<()> {
        let _ = backend;
        Ok(())
    }

    /// Starts `ops` and waits for them.
    fn run<'a>(&'a self, ops: Vec<Collective<'a, B>>) -> Result<()> {
        self.start(ops)?.wait()
    }

    fn all_reduce(&self, buf: &mut B::Buf, off: usize, len: usize, op: ReduceOp) -> Result<()> {
        self.run(vec![Collective::all_reduce(buf, off, len, op)])
    }

    fn all_gather(
        &self,
        send: &B::Buf,
        send_off: usize,
        recv: &mut B::Buf,
        off: usize,
        count: usize,
    ) -> Result<()> {
        self.run(vec![Collective::all_gather(
            send, send_off, recv, off, count,
        )])
    }

    fn reduce_scatter(
        &self,
        send: &B::Buf,
        send_off: usize,
        recv: &mut B::Buf,
        off: usize,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(vec![Collective::reduce_scatter(
            send, send_off, recv, off, count, op,
        )])
    }

    fn broadcast(&self, buf: &mut B::Buf, off: usize, len: usize, root: usize) -> Result<()> {
        self.run(vec![Collective::broadcast(buf, off, len, root)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;

    #[test]
    fn ranges_are_checked() {
        let len = |b: &Vec<f32>| b.len();
        let mut a = vec![0.0f32; 10];
        let s = vec![0.0f32; 4];
        assert!(Collective::<Cpu>::all_reduce(&mut a, 2, 8, ReduceOp::Sum)
            .validate(2, len)
            .is_ok());
        let e = Collective::<Cpu>::all_reduce(&mut a, 3, 8, ReduceOp::Sum)
            .validate(2, len)
            .unwrap_err();
        assert!(
            format!("{e}").contains("3..11 is outside its buffer of 10"),
            "{e}"
        );
        assert!(Collective::<Cpu>::all_gather(&s, 0, &mut a, 2, 4)
            .validate(2, len)
            .is_ok());
        assert!(Collective::<Cpu>::all_gather(&s, 1, &mut a, 2, 4)
            .validate(2, len)
            .is_err());
        assert!(Collective::<Cpu>::all_gather(&s, 0, &mut a, 0, 4)
            .validate(3, len)
            .is_err());
        assert!(
            Collective::<Cpu>::reduce_scatter(&a, 0, &mut vec![0.0; 5], 0, 5, ReduceOp::Avg)
                .validate(2, len)
                .is_ok()
        );
        assert!(
            Collective::<Cpu>::reduce_scatter_in_place(&mut a, 1, 5, ReduceOp::Sum)
                .validate(2, len)
                .is_err()
        );
        let e = Collective::<Cpu>::broadcast(&mut a, 0, 1, 2)
            .validate(2, len)
            .unwrap_err();
        assert!(format!("{e}").contains("root 2"));
    }

    #[test]
    fn premul_factors() {
        assert_eq!(ReduceOp::Sum.premul(4), None);
        assert_eq!(ReduceOp::Avg.premul(4), Some(0.25));
        assert_eq!(ReduceOp::Scaled(3.0).premul(4), Some(3.0));
    }
}
