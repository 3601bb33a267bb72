//! Ranks as threads of one process, for unit tests of code that talks through a communicator.

use super::group::{Options, ProcessGroup};
use super::world::World;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

/// Runs `f` on `n` ranks as threads of this process, each with its own process group (rank 0
/// serves the store on a free port); returns their results in rank order.
pub fn ranks<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let world = World::local(rank, n, port);
                let pg = ProcessGroup::new(world, Options::in_process(timeout)).unwrap();
                f(pg)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
