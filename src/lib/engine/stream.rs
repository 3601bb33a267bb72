//! Tokens as they are drawn, for a server that streams them (`tandem serve`, `"stream":
//! true`): the server installs a watcher on the thread that generates ([`install`]), and the
//! engine tells it every token a sample accepts ([`emit`]: request, sample, token, log-prob),
//! in the order they join the sample. A thread without a watcher (every stage) pays one
//! thread-local read per token.

use std::cell::RefCell;
use std::sync::Arc;

/// Told `(request, sample, token, logprob)` for every accepted token.
pub type Watch = Arc<dyn Fn(usize, usize, u32, f32) + Send + Sync>;

thread_local! {
    static CURRENT: RefCell<Option<Watch>> = const { RefCell::new(None) };
}

/// Runs `f` with `watch` told the tokens the engine accepts on this thread (the previous
/// watcher, if any, is restored after).
pub fn install<R>(watch: Watch, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Watch>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = prev);
        }
    }
    let prev = CURRENT.with(|c| c.borrow_mut().replace(watch));
    let _restore = Restore(prev);
    f()
}

/// Sample `sample` of request `req` accepted `token` (log-prob `logprob`).
pub(crate) fn emit(req: usize, sample: usize, token: u32, logprob: f32) {
    CURRENT.with(|c| {
        if let Some(w) = c.borrow().as_ref() {
            w(req, sample, token, logprob);
        }
    });
}
