//! The decoder's passes run unit by unit (the embedding, each layer, the head: final norm and LM
//! head), and tell a [`UnitHooks`] value as they go: before a unit runs, when its gradients are
//! added, after it ran. The hooks reach the unit's weights and gradients ([`UnitBufs`]), so a
//! caller can bring a unit's weights just before it runs and take them away after, or start
//! sending its gradients while the rest of the backward runs (the engine's sharded training,
//! `engine::shard`). The decoder itself knows no more than the order of its units; every
//! method is a no-op by default ([`NoHooks`], the plain passes).
//!
//! The order, every pass alike, with or without rows (a pass over none calls the same hooks,
//! `idle_pass`):
//! ```text
//! scoring:   before(Embed, F) after(Embed, F), for each layer l: before(Layer l, F)
//!            after(Layer l, F), then before(Head, F) after(Head, F)
//! training:  the same up to before(Head, F), then for u in Head, the layers top down, Embed:
//!            before(u, B) grads_ready(u) after(u, B)
//! ```
//! In a training pass the head's forward runs on into its backward: its only `after` is the
//! backward's.

use anyhow::Result;

use super::Decoder;
use crate::backend::Backend;

/// A unit of the decoder's passes: what a hook brings, runs and takes away at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Embed,
    Layer(usize),
    /// The final norm and the LM head.
    Head,
}

/// Which way a pass goes through the units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The embedding, the layers in order, the head.
    Forward,
    /// The head, the layers in reverse order, the embedding.
    Backward,
}

/// The parameter buffers a hook may touch, indexed as the decoder's parameters (its
/// `param_units` says which unit each belongs to): the compute weights and the gradients.
pub struct UnitBufs<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) weights: &'a mut [B::Buf],
    pub(crate) grads: &'a mut [B::Buf],
}

/// What a pass tells as it goes (see the module docs for the order). An error stops the pass.
pub trait UnitHooks<B: Backend> {
    /// Before unit `u` runs in `pass`: when this returns, the weights it reads are in
    /// `p.weights` (forward; backward: a layer's, the head's stay from its forward and the
    /// embedding's backward reads none) and, in the backward, its gradient buffers in `p.grads`.
    fn before(&mut self, u: Unit, pass: Pass, p: UnitBufs<B>) -> Result<()> {
        let _ = (u, pass, p);
        Ok(())
    }

    /// Unit `u`'s backward added its gradients of this pass into `p.grads`.
    fn grads_ready(&mut self, u: Unit, p: UnitBufs<B>) -> Result<()> {
        let _ = (u, p);
        Ok(())
    }

    /// After unit `u` ran in `pass`: the pass reads its weights no more.
    fn after(&mut self, u: Unit, pass: Pass, p: UnitBufs<B>) -> Result<()> {
        let _ = (u, pass, p);
        Ok(())
    }
}

/// The hooks of a plain pass: none.
pub struct NoHooks;

impl<B: Backend> UnitHooks<B> for NoHooks {}

impl<B: Backend> Decoder<B> {
    /// The buffers the hooks reach.
    pub(super) fn unit_bufs(&mut self) -> UnitBufs<'_, B> {
        UnitBufs {
            backend: &self.backend,
            weights: &mut self.w,
            grads: &mut self.g,
        }
    }

    /// The unit each parameter belongs to, in the parameters' order: the embedding (a tied
    /// head's too), each layer's, then the final norm and an untied head (the head's).
    pub(crate) fn param_units(&self) -> Vec<Unit> {
        let mut units = vec![Unit::Embed; self.names.len()];
        for (l, ly) in self.layers.iter().enumerate() {
            for t in ly.params() {
                units[t] = Unit::Layer(l);
            }
        }
        units[self.final_norm] = Unit::Head;
        if self.head != self.embed {
            units[self.head] = Unit::Head;
        }
        if let Some(b) = self.head_bias {
            units[b] = Unit::Head;
        }
        units
    }

    /// The hooks of a pass over no rows, in the order of a real one (`train`: with its
    /// backward): a caller whose hooks run collectives keeps them in step with the other
    /// ranks' real passes.
    pub(super) fn idle_pass(&mut self, hooks: &mut dyn UnitHooks<B>, train: bool) -> Result<()> {
        let layers = self.layers.len();
        for u in std::iter::once(Unit::Embed).chain((0..layers).map(Unit::Layer)) {
            hooks.before(u, Pass::Forward, self.unit_bufs())?;
            hooks.after(u, Pass::Forward, self.unit_bufs())?;
        }
        hooks.before(Unit::Head, Pass::Forward, self.unit_bufs())?;
        match train {
            true => self.idle_backward(hooks),
            false => hooks.after(Unit::Head, Pass::Forward, self.unit_bufs()),
        }
    }

    /// The backward's hooks on no gradients, from the head on (its forward ran): a training
    /// pass whose rows score no token.
    pub(super) fn idle_backward(&mut self, hooks: &mut dyn UnitHooks<B>) -> Result<()> {
        let layers = self.layers.len();
        let units = std::iter::once(Unit::Head)
            .chain((0..layers).rev().map(Unit::Layer))
            .chain([Unit::Embed]);
        for u in units {
            hooks.before(u, Pass::Backward, self.unit_bufs())?;
            hooks.grads_ready(u, self.unit_bufs())?;
            hooks.after(u, Pass::Backward, self.unit_bufs())?;
        }
        Ok(())
    }
}
