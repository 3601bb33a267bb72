//! The rendezvous store: rank 0 serves it over TCP at MASTER_ADDR:MASTER_PORT, every rank
//! (rank 0 too) connects to it as a client. It is small on purpose:
//! - rendezvous: a rank says hello with its rank and world size; when all have, each gets a
//!   welcome (a rank missing after the timeout fails the job, naming it);
//! - a key/value table: `set`, and `get` that waits until the key is set (rank 0 publishes the
//!   NCCL unique id there, the CPU communicator its ranks' addresses);
//! - liveness: clients send heartbeats (carrying how many collectives they have started), the
//!   server pings back. A connection that closes before its rank said it finished, or a rank
//!   silent for the timeout, is a failure of that rank; a rank that notices a failure itself
//!   (a collective timed out) reports it. Either way the server relays one abort, naming the
//!   rank, to every rank, and each rank stops (see `health`);
//! - finish: a rank says done and waits until every rank has, so no rank's exit looks like a
//!   crash to the others.
//!
//! Messages are JSON lines (values hex-encoded); nothing here is on a hot path.

use super::health::{Failure, Health};
use super::world::World;
use crate::error::input_error;
use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often clients send heartbeats and the server pings: often enough that a silent rank is
/// noticed close to the timeout, rarely enough to cost nothing.
pub(crate) fn heartbeat_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(2))
}

/// Where one rank is, as the store last heard.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct RankProgress {
    pub(crate) rank: usize,
    pub(crate) joined: bool,
    /// Collectives the rank has started.
    pub(crate) seq: u64,
    /// Milliseconds since the store last heard from it.
    pub(crate) silent_ms: u64,
    pub(crate) done: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum Msg {
    Hello {
        rank: usize,
        world_size: usize,
        pid: u32,
        host: String,
    },
    Welcome,
    Reject {
        reason: String,
    },
    Set {
        key: String,
        value: String,
    },
    Get {
        key: String,
        id: u64,
    },
    Value {
        id: u64,
        value: String,
    },
    /// Wait until one of `keys` is set; answered with `KeyValue` (the first set, in order).
    GetAny {
        keys: Vec<String>,
        id: u64,
    },
    KeyValue {
        id: u64,
        index: usize,
        value: String,
    },
    /// Forget these keys (a value read by its one reader).
    Delete {
        keys: Vec<String>,
    },
    Heartbeat {
        seq: u64,
    },
    Ping,
    Progress {
        id: u64,
    },
    ProgressReply {
        id: u64,
        ranks: Vec<RankProgress>,
    },
    Fail {
        suspect: Option<usize>,
        reason: String,
    },
    /// `reporter`: the rank that noticed the failure (None: the store itself).
    Abort {
        suspect: Option<usize>,
        reporter: Option<usize>,
        reason: String,
    },
    Done,
    AllDone,
}

fn send(out: &Mutex<TcpStream>, msg: &Msg) -> std::io::Result<()> {
    let mut line = serde_json::to_string(msg).expect("store messages serialise");
    line.push('\n');
    out.lock().unwrap().write_all(line.as_bytes())
}

fn read_msg(r: &mut impl BufRead) -> Option<Msg> {
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) | Err(_) => return None,
            // Anything that is not one of our messages (a port scanner) is skipped.
            Ok(_) => match serde_json::from_str(&line) {
                Ok(m) => return Some(m),
                Err(_) => continue,
            },
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(2 * bytes.len());
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize]);
        out.push(DIGITS[(b & 15) as usize]);
    }
    String::from_utf8(out).expect("hex digits are ASCII")
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("store value of odd hex length");
    }
    let digit = |c: u8| -> Result<u8> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => bail!("store value: invalid hex digit {:?}", c as char),
        }
    };
    s.as_bytes()
        .chunks_exact(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

// ---- server ------------------------------------------------------------------------------

struct Peer {
    out: Arc<Mutex<TcpStream>>,
    pid: u32,
    host: String,
    last_heard: Instant,
    seq: u64,
    done: bool,
    gone: bool,
}

impl Peer {
    fn who(&self, rank: usize) -> String {
        format!("rank {rank} (pid {} on {})", self.pid, self.host)
    }
}

#[derive(Default)]
struct Inner {
    kv: HashMap<String, String>,
    waiters: HashMap<String, Vec<(usize, u64)>>,
    /// `GetAny` requests not answered yet: (rank, id, keys).
    any_waiters: Vec<(usize, u64, Vec<String>)>,
    peers: Vec<Option<Peer>>,
    welcomed: bool,
    /// The job's first failure as sent to every rank (`Msg::Abort`), for late joiners too.
    failure: Option<Msg>,
    all_done: bool,
    closed: bool,
}

struct Server {
    world_size: usize,
    timeout: Duration,
    addr: String,
    started: Instant,
    inner: Mutex<Inner>,
}

/// The store, served by rank 0. Dropping it before every rank finished fails the job
/// (naming rank 0), so the other ranks stop instead of waiting for a store that is gone.
pub(crate) struct StoreServer {
    server: Arc<Server>,
    #[cfg(test)]
    port: u16,
}

impl StoreServer {
    /// Listens on `bind` (port 0: any free port) for `world_size` ranks.
    pub fn start(bind: SocketAddr, world_size: usize, timeout: Duration) -> Result<StoreServer> {
        let listener = TcpListener::bind(bind).map_err(|e| {
            input_error(format!(
                "rank 0: cannot serve the rendezvous store on {bind}: {e} (choose another port with \
                 --master-port or MASTER_PORT)"
            ))
        })?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let mut inner = Inner::default();
        inner.peers.resize_with(world_size, || None);
        let server = Arc::new(Server {
            world_size,
            timeout,
            addr: format!("{}:{port}", bind.ip()),
            started: Instant::now(),
            inner: Mutex::new(inner),
        });
        let s = server.clone();
        std::thread::Builder::new()
            .name("dist-store-accept".into())
            .spawn(move || s.accept_loop(listener))?;
        let s = server.clone();
        std::thread::Builder::new()
            .name("dist-store-monitor".into())
            .spawn(move || s.monitor())?;
        Ok(StoreServer {
            server,
            #[cfg(test)]
            port,
        })
    }

    #[cfg(test)]
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// How long a store dropped before the job finished waits for a failure report already on its
/// way (rank 0's own is sent before its process drops the store, over its own connection)
/// before it reports its own stop instead: the report names the rank at fault.
const REPORT_WAIT: Duration = Duration::from_secs(1);

impl Drop for StoreServer {
    fn drop(&mut self) {
        let deadline = Instant::now() + REPORT_WAIT;
        let mut inner = self.server.inner.lock().unwrap();
        while !inner.all_done && inner.failure.is_none() && Instant::now() < deadline {
            drop(inner);
            std::thread::sleep(Duration::from_millis(10));
            inner = self.server.inner.lock().unwrap();
        }
        if !inner.all_done {
            self.server.fail(
                &mut inner,
                Some(0),
                None,
                "rank 0 (which serves the rendezvous store) stopped before finishing".into(),
            );
        }
        inner.closed = true;
        for p in inner.peers.iter().flatten() {
            let _ = p.out.lock().unwrap().shutdown(Shutdown::Both);
        }
    }
}

impl Server {
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            if self.inner.lock().unwrap().closed {
                return;
            }
            match listener.accept() {
                Ok((stream, _)) => {
                    let s = self.clone();
                    let _ = std::thread::Builder::new()
                        .name("dist-store-conn".into())
                        .spawn(move || s.serve(stream));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Sends an abort naming `suspect` to every connected rank, once.
    fn fail(
        &self,
        inner: &mut Inner,
        suspect: Option<usize>,
        reporter: Option<usize>,
        reason: String,
    ) {
        if inner.failure.is_some() || inner.closed {
            return;
        }
        let msg = Msg::Abort {
            suspect,
            reporter,
            reason,
        };
        for p in inner.peers.iter().flatten().filter(|p| !p.gone) {
            let _ = send(&p.out, &msg);
        }
        inner.failure = Some(msg);
    }

    fn serve(self: Arc<Self>, stream: TcpStream) {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(self.timeout));
        let Ok(read_half) = stream.try_clone() else {
            return;
        };
        let out = Arc::new(Mutex::new(stream));
        let mut reader = BufReader::new(read_half);
        let Some(Msg::Hello {
            rank,
            world_size,
            pid,
            host,
        }) = read_msg(&mut reader)
        else {
            return;
        };
        {
            let mut inner = self.inner.lock().unwrap();
            let reject = if world_size != self.world_size {
                Some(format!(
                    "rank {rank} was started with a world size of {world_size}, rank 0 with {}: \
                     every rank needs the same WORLD_SIZE / SLURM_NTASKS",
                    self.world_size
                ))
            } else if rank >= self.world_size {
                Some(format!(
                    "rank {rank} is outside the world of {}",
                    self.world_size
                ))
            } else if inner.peers[rank].is_some() {
                Some(format!(
                    "rank {rank} joined twice (pid {pid} on {host}): two processes were given the same RANK"
                ))
            } else {
                None
            };
            if let Some(reason) = reject {
                let _ = send(&out, &Msg::Reject { reason });
                return;
            }
            inner.peers[rank] = Some(Peer {
                out: out.clone(),
                pid,
                host,
                last_heard: Instant::now(),
                seq: 0,
                done: false,
                gone: false,
            });
            if let Some(Msg::Abort {
                suspect,
                reporter,
                reason,
            }) = inner.failure.clone()
            {
                // The first failure, with its suspect: the launcher blames that rank.
                let reason = format!("the job failed before this rank joined: {reason}");
                let _ = send(
                    &out,
                    &Msg::Abort {
                        suspect,
                        reporter,
                        reason,
                    },
                );
            } else if inner.peers.iter().all(|p| p.is_some()) {
                inner.welcomed = true;
                for p in inner.peers.iter().flatten() {
                    let _ = send(&p.out, &Msg::Welcome);
                }
            }
        }
        // After the hello, silence is judged by the monitor, not by a read timeout.
        let _ = reader.get_ref().set_read_timeout(None);
        while let Some(msg) = read_msg(&mut reader) {
            self.handle(rank, &out, msg);
        }
        let mut inner = self.inner.lock().unwrap();
        if let Some(p) = inner.peers[rank].as_mut() {
            p.gone = true;
            if !p.done {
                let reason = format!(
                    "{} exited or lost its connection to the rendezvous store before finishing",
                    p.who(rank)
                );
                self.fail(&mut inner, Some(rank), None, reason);
            }
        }
    }

    fn handle(&self, rank: usize, out: &Mutex<TcpStream>, msg: Msg) {
        let mut inner = self.inner.lock().unwrap();
        if let Some(p) = inner.peers[rank].as_mut() {
            p.last_heard = Instant::now();
        }
        match msg {
            Msg::Set { key, value } => {
                for (r, id) in inner.waiters.remove(&key).unwrap_or_default() {
                    if let Some(p) = inner.peers[r].as_ref() {
                        let _ = send(
                            &p.out,
                            &Msg::Value {
                                id,
                                value: value.clone(),
                            },
                        );
                    }
                }
                let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut inner.any_waiters)
                    .into_iter()
                    .partition(|(_, _, keys)| keys.contains(&key));
                inner.any_waiters = waiting;
                for (r, id, keys) in ready {
                    let index = keys.iter().position(|k| *k == key).expect("partitioned");
                    if let Some(p) = inner.peers[r].as_ref() {
                        let msg = Msg::KeyValue {
                            id,
                            index,
                            value: value.clone(),
                        };
                        let _ = send(&p.out, &msg);
                    }
                }
                inner.kv.insert(key, value);
            }
            Msg::GetAny { keys, id } => {
                match keys
                    .iter()
                    .enumerate()
                    .find_map(|(i, k)| Some((i, inner.kv.get(k)?)))
                {
                    Some((index, v)) => {
                        let msg = Msg::KeyValue {
                            id,
                            index,
                            value: v.clone(),
                        };
                        let _ = send(out, &msg);
                    }
                    None => inner.any_waiters.push((rank, id, keys)),
                }
            }
            Msg::Delete { keys } => {
                for k in keys {
                    inner.kv.remove(&k);
                }
            }
            Msg::Get { key, id } => match inner.kv.get(&key) {
                Some(v) => {
                    let _ = send(
                        out,
                        &Msg::Value {
                            id,
                            value: v.clone(),
                        },
                    );
                }
                None => inner.waiters.entry(key).or_default().push((rank, id)),
            },
            Msg::Heartbeat { seq } => {
                if let Some(p) = inner.peers[rank].as_mut() {
                    p.seq = seq;
                }
            }
            Msg::Progress { id } => {
                let ranks = self.progress(&inner);
                let _ = send(out, &Msg::ProgressReply { id, ranks });
            }
            Msg::Fail { suspect, reason } => self.fail(&mut inner, suspect, Some(rank), reason),
            Msg::Done => {
                if let Some(p) = inner.peers[rank].as_mut() {
                    p.done = true;
                }
                if inner
                    .peers
                    .iter()
                    .all(|p| p.as_ref().is_some_and(|p| p.done))
                {
                    inner.all_done = true;
                    for p in inner.peers.iter().flatten() {
                        let _ = send(&p.out, &Msg::AllDone);
                    }
                }
            }
            _ => {}
        }
    }

    fn progress(&self, inner: &Inner) -> Vec<RankProgress> {
        (0..self.world_size)
            .map(|rank| match &inner.peers[rank] {
                Some(p) => RankProgress {
                    rank,
                    joined: true,
                    seq: p.seq,
                    silent_ms: p.last_heard.elapsed().as_millis() as u64,
                    done: p.done,
                },
                None => RankProgress {
                    rank,
                    joined: false,
                    seq: 0,
                    silent_ms: self.started.elapsed().as_millis() as u64,
                    done: false,
                },
            })
            .collect()
    }

    /// Pings every rank, and fails the job when a rank is silent for the timeout or has not
    /// joined within it.
    fn monitor(self: Arc<Self>) {
        let every = heartbeat_interval(self.timeout);
        loop {
            std::thread::sleep(every);
            let mut inner = self.inner.lock().unwrap();
            if inner.closed || inner.all_done {
                return;
            }
            for p in inner.peers.iter().flatten().filter(|p| !p.gone) {
                let _ = send(&p.out, &Msg::Ping);
            }
            if inner.failure.is_some() {
                continue;
            }
            if !inner.welcomed && self.started.elapsed() > self.timeout {
                let missing: Vec<usize> = (0..self.world_size)
                    .filter(|&r| inner.peers[r].is_none())
                    .collect();
                let reason = format!(
                    "{} did not join the rendezvous at {} within {:?} (not started, crashed while \
                     starting, or cannot reach rank 0's host)",
                    ranks_text(&missing),
                    self.addr,
                    self.timeout
                );
                self.fail(&mut inner, missing.first().copied(), None, reason);
                continue;
            }
            let silent = inner.peers.iter().enumerate().find_map(|(r, p)| {
                let p = p.as_ref()?;
                (!p.gone && !p.done && p.last_heard.elapsed() > self.timeout).then(|| (r, p.who(r)))
            });
            if let Some((r, who)) = silent {
                let reason = format!(
                    "{who} sent no heartbeat for {:?}: it is stopped, frozen or unreachable",
                    self.timeout
                );
                self.fail(&mut inner, Some(r), None, reason);
            }
        }
    }
}

// ---- client ------------------------------------------------------------------------------

#[derive(Default)]
struct ClientState {
    welcomed: bool,
    rejected: Option<String>,
    all_done: bool,
    /// This side closed the connection: its end is no failure.
    closed: bool,
}

struct Client {
    rank: usize,
    addr: String,
    timeout: Duration,
    out: Mutex<TcpStream>,
    health: Arc<Health>,
    replies: Mutex<HashMap<u64, Sender<Msg>>>,
    next_id: AtomicU64,
    state: Mutex<ClientState>,
    changed: Condvar,
    last_heard: Mutex<Instant>,
    seq: Arc<AtomicU64>,
}

/// One rank's connection to the store.
pub(crate) struct StoreClient {
    client: Arc<Client>,
    local_ip: IpAddr,
}

impl StoreClient {
    /// Connects to the store of `world` (retrying while rank 0 starts), says hello and waits
    /// until every rank has. `seq` counts the collectives this rank started (sent as its
    /// heartbeat, so a timed-out rank can tell who is behind).
    pub fn connect(
        world: &World,
        health: Arc<Health>,
        seq: Arc<AtomicU64>,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let addr = format!("{}:{}", world.master_addr, world.master_port);
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let tried = addr
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|addrs| {
                    let mut last = "no address".to_string();
                    for a in addrs {
                        match TcpStream::connect_timeout(&a, Duration::from_secs(1)) {
                            Ok(s) => return Ok(s),
                            Err(e) => last = e.to_string(),
                        }
                    }
                    Err(last)
                });
            match tried {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    let msg = format!(
                        "rank {}: cannot reach the rendezvous store of rank 0 at {addr} within {timeout:?}: {e} \
                         (rank 0 not started or failed, or MASTER_ADDR/MASTER_PORT wrong)",
                        world.rank
                    );
                    health.fail(Some(0), msg.clone());
                    bail!(msg);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        stream.set_nodelay(true)?;
        let local_ip = stream.local_addr()?.ip();
        let read_half = stream.try_clone()?;
        let client = Arc::new(Client {
            rank: world.rank,
            addr: addr.clone(),
            timeout,
            out: Mutex::new(stream),
            health: health.clone(),
            replies: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            state: Mutex::new(ClientState::default()),
            changed: Condvar::new(),
            last_heard: Mutex::new(Instant::now()),
            seq,
        });
        send(
            &client.out,
            &Msg::Hello {
                rank: world.rank,
                world_size: world.world_size,
                pid: std::process::id(),
                host: hostname(),
            },
        )?;
        let c = client.clone();
        std::thread::Builder::new()
            .name("dist-store-read".into())
            .spawn(move || c.read_loop(read_half))?;
        let c = client.clone();
        std::thread::Builder::new()
            .name("dist-store-beat".into())
            .spawn(move || c.beat_loop())?;
        let c = client.clone();
        health.set_reporter(move |f: &Failure| {
            let _ = send(
                &c.out,
                &Msg::Fail {
                    suspect: f.suspect,
                    reason: f.reason.clone(),
                },
            );
        });
        // Wait for every rank (the server fails the job naming the missing ones after the
        // timeout; this side gives it a moment more to say so).
        let deadline = Instant::now() + timeout + Duration::from_secs(2);
        let mut st = client.state.lock().unwrap();
        loop {
            if let Some(reason) = st.rejected.clone() {
                drop(st);
                let msg = format!(
                    "rank {}: the rendezvous store refused it: {reason}",
                    world.rank
                );
                health.fail(Some(world.rank), msg.clone());
                return Err(input_error(msg));
            }
            if st.welcomed {
                break;
            }
            health.check()?;
            if Instant::now() >= deadline {
                drop(st);
                let msg = format!(
                    "rank {}: not every rank joined the rendezvous at {addr} within {timeout:?}",
                    world.rank
                );
                health.fail(None, msg.clone());
                bail!(msg);
            }
            st = client
                .changed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        drop(st);
        Ok(StoreClient { client, local_ip })
    }

    /// This machine's address on the network that reaches rank 0 (what other ranks can dial).
    pub(crate) fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.client.health.check()?;
        send(
            &self.client.out,
            &Msg::Set {
                key: key.into(),
                value: hex(value),
            },
        )
        .map_err(|e| anyhow!("rendezvous store at {}: {e}", self.client.addr))
    }

    /// The value of `key`, waiting until some rank sets it (at most the timeout).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let reply = self.request(
            |id| Msg::Get {
                key: key.into(),
                id,
            },
            self.client.timeout,
            &format!("'{key}' (the rank that sets it has not: it is hung, failed or late)"),
        )?;
        match reply {
            Msg::Value { value, .. } => unhex(&value),
            other => bail!("rendezvous store: unexpected reply {other:?}"),
        }
    }

    /// Every rank's progress as the store last heard.
    pub fn progress(&self) -> Result<Vec<RankProgress>> {
        self.prober().progress()
    }

    /// The first of `keys` that some rank sets (its index and value), waiting at most `wait`
    /// (None: as long as every rank is alive; a failure of the job ends the wait with its
    /// message), or until `stop` says to give up (then None).
    pub(crate) fn get_any(
        &self,
        keys: &[String],
        wait: Option<Duration>,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(usize, Vec<u8>)>> {
        let what = format!("one of {keys:?}");
        let reply = self.client.request_until(
            |id| Msg::GetAny {
                keys: keys.to_vec(),
                id,
            },
            wait,
            stop,
            &what,
        )?;
        match reply {
            None => Ok(None),
            Some(Msg::KeyValue { index, value, .. }) => Ok(Some((index, unhex(&value)?))),
            Some(other) => bail!("rendezvous store: unexpected reply {other:?}"),
        }
    }

    /// Forgets `keys` (values read by their only reader), so the store does not keep them.
    pub(crate) fn delete(&self, keys: &[String]) -> Result<()> {
        send(
            &self.client.out,
            &Msg::Delete {
                keys: keys.to_vec(),
            },
        )
        .map_err(|e| anyhow!("rendezvous store at {}: {e}", self.client.addr))
    }

    /// A handle that asks the store for progress from another thread (a watchdog); it does
    /// not keep the connection open.
    pub(crate) fn prober(&self) -> Prober {
        Prober(self.client.clone())
    }

    fn request(&self, make: impl FnOnce(u64) -> Msg, wait: Duration, what: &str) -> Result<Msg> {
        self.client.request(make, wait, what)
    }

    /// Says this rank is done and waits until every rank is (at most the timeout; then the
    /// job fails naming the ranks still running).
    pub fn finish(&self) -> Result<()> {
        let c = &self.client;
        c.health.check()?;
        send(&c.out, &Msg::Done).map_err(|e| anyhow!("rendezvous store at {}: {e}", c.addr))?;
        let deadline = Instant::now() + c.timeout;
        let mut st = c.state.lock().unwrap();
        while !st.all_done {
            if let Some(f) = c.health.failure() {
                bail!("{}", f.reason);
            }
            if Instant::now() >= deadline {
                drop(st);
                let behind: Vec<usize> = self
                    .progress()
                    .map(|p| p.iter().filter(|r| !r.done).map(|r| r.rank).collect())
                    .unwrap_or_default();
                let msg = format!(
                    "rank {} finished, but {} did not finish within {:?} after it",
                    c.rank,
                    if behind.is_empty() {
                        "some rank".to_string()
                    } else {
                        ranks_text(&behind)
                    },
                    c.timeout
                );
                c.health.fail(behind.first().copied(), msg.clone());
                bail!(msg);
            }
            st = c
                .changed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        Ok(())
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        self.client.state.lock().unwrap().closed = true;
        let _ = self.client.out.lock().unwrap().shutdown(Shutdown::Both);
    }
}

/// See [`StoreClient::prober`].
#[derive(Clone)]
pub(crate) struct Prober(Arc<Client>);

impl Prober {
    /// Every rank's progress as the store last heard.
    pub fn progress(&self) -> Result<Vec<RankProgress>> {
        let reply = self.0.request(
            |id| Msg::Progress { id },
            Duration::from_secs(5).min(self.0.timeout),
            "the ranks' progress",
        )?;
        match reply {
            Msg::ProgressReply { ranks, .. } => Ok(ranks),
            other => bail!("rendezvous store: unexpected reply {other:?}"),
        }
    }

    /// Who has not started collective number `seq` (counted from 0) of the group: the ranks
    /// whose count of started collectives is at most `seq`, and a sentence naming them.
    pub fn behind(&self, seq: u64) -> (Vec<usize>, String) {
        match self.progress() {
            Ok(p) => {
                let late: Vec<&RankProgress> = p.iter().filter(|r| r.seq <= seq).collect();
                let ranks: Vec<usize> = late.iter().map(|r| r.rank).collect();
                let text = if late.is_empty() {
                    "every rank has started it (a device or the network is stuck)".to_string()
                } else {
                    let who: Vec<String> = late
                        .iter()
                        .map(|r| format!("rank {} (at the group's collective #{})", r.rank, r.seq))
                        .collect();
                    format!(
                        "{} not started it: hung, failed, busy elsewhere for longer than the \
                         timeout, or calling a different collective",
                        if late.len() == 1 {
                            format!("{} has", who[0])
                        } else {
                            format!("{} have", who.join(", "))
                        }
                    )
                };
                (ranks, text)
            }
            Err(e) => (Vec::new(), format!("the store gave no progress ({e:#})")),
        }
    }
}

impl Client {
    fn request(&self, make: impl FnOnce(u64) -> Msg, wait: Duration, what: &str) -> Result<Msg> {
        let reply = self.request_until(make, Some(wait), &|| false, what)?;
        Ok(reply.expect("never stopped"))
    }

    /// Sends a request and waits for its reply: at most `wait` (None: as long as the job is
    /// healthy), or until `stop` says to give up (then None).
    fn request_until(
        &self,
        make: impl FnOnce(u64) -> Msg,
        wait: Option<Duration>,
        stop: &dyn Fn() -> bool,
        what: &str,
    ) -> Result<Option<Msg>> {
        self.health.check()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.replies.lock().unwrap().insert(id, tx);
        send(&self.out, &make(id))
            .map_err(|e| anyhow!("rendezvous store at {}: {e}", self.addr))?;
        let deadline = wait.map(|w| Instant::now() + w);
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(m) => return Ok(Some(m)),
                Err(RecvTimeoutError::Disconnected) => bail!("rendezvous store connection closed"),
                Err(RecvTimeoutError::Timeout) => {
                    self.health.check()?;
                    if stop() {
                        self.replies.lock().unwrap().remove(&id);
                        return Ok(None);
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        self.replies.lock().unwrap().remove(&id);
                        bail!(
                            "rank {}: timed out after {:?} waiting for {what} in the rendezvous store",
                            self.rank,
                            wait.unwrap_or_default()
                        );
                    }
                }
            }
        }
    }

    fn read_loop(self: Arc<Self>, stream: TcpStream) {
        let mut reader = BufReader::new(stream);
        while let Some(msg) = read_msg(&mut reader) {
            *self.last_heard.lock().unwrap() = Instant::now();
            match msg {
                Msg::Welcome => {
                    self.state.lock().unwrap().welcomed = true;
                    self.changed.notify_all();
                }
                Msg::Reject { reason } => {
                    self.state.lock().unwrap().rejected = Some(reason);
                    self.changed.notify_all();
                }
                Msg::AllDone => {
                    self.state.lock().unwrap().all_done = true;
                    self.changed.notify_all();
                }
                Msg::Value { id, .. }
                | Msg::KeyValue { id, .. }
                | Msg::ProgressReply { id, .. } => {
                    if let Some(tx) = self.replies.lock().unwrap().remove(&id) {
                        let _ = tx.send(msg);
                    }
                }
                Msg::Abort {
                    suspect,
                    reporter,
                    reason,
                } => {
                    let reason = match reporter {
                        Some(r) if r != self.rank => format!("rank {r} reported: {reason}"),
                        _ => reason,
                    };
                    self.health.relayed(Failure {
                        suspect,
                        reporter: reporter.unwrap_or(0),
                        reason,
                    });
                    self.changed.notify_all();
                }
                _ => {}
            }
        }
        let st = self.state.lock().unwrap();
        if !st.closed && !st.all_done {
            drop(st);
            self.health.fail(
                Some(0),
                format!(
                    "lost the connection to the rendezvous store at {} (rank 0 exited or the network failed)",
                    self.addr
                ),
            );
            self.changed.notify_all();
        }
    }

    fn beat_loop(self: Arc<Self>) {
        let every = heartbeat_interval(self.timeout);
        loop {
            std::thread::sleep(every);
            {
                let st = self.state.lock().unwrap();
                if st.closed || st.all_done || self.health.failure().is_some() {
                    return;
                }
            }
            let seq = self.seq.load(Ordering::Relaxed);
            let _ = send(&self.out, &Msg::Heartbeat { seq });
            if self.last_heard.lock().unwrap().elapsed() > self.timeout {
                self.health.fail(
                    Some(0),
                    format!(
                        "heard nothing from the rendezvous store at {} for {:?}: rank 0 is stopped, frozen or unreachable",
                        self.addr, self.timeout
                    ),
                );
                self.changed.notify_all();
                return;
            }
        }
    }
}

/// This machine's name, for messages.
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok && end > 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown-host".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn start(n: usize, timeout: Duration) -> StoreServer {
        StoreServer::start("127.0.0.1:0".parse().unwrap(), n, timeout).unwrap()
    }

    fn client(
        rank: usize,
        n: usize,
        port: u16,
        timeout: Duration,
    ) -> Result<(StoreClient, Arc<Health>)> {
        let h = Health::new(rank, None);
        let c = StoreClient::connect(
            &World::local(rank, n, port),
            h.clone(),
            Arc::default(),
            timeout,
        )?;
        Ok((c, h))
    }

    #[test]
    fn rank_zero_hands_out_a_value_that_others_wait_for() {
        let t = Duration::from_secs(10);
        let server = start(3, t);
        let port = server.port();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let (c, _h) = client(r, 3, port, t).unwrap();
                    if r == 0 {
                        std::thread::sleep(Duration::from_millis(100));
                        c.set("id", &[1, 2, 255]).unwrap();
                    }
                    let v = c.get("id").unwrap();
                    c.finish().unwrap();
                    v
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), vec![1, 2, 255]);
        }
    }

    #[test]
    fn a_closed_connection_fails_the_job_naming_the_rank() {
        let t = Duration::from_secs(10);
        let server = start(3, t);
        let port = server.port();
        let joins: Vec<_> = (0..3)
            .map(|r| std::thread::spawn(move || client(r, 3, port, t).unwrap()))
            .collect();
        let mut clients: Vec<_> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        let (c1, _) = clients.remove(1);
        drop(c1); // rank 1 goes away without finishing
        for (_, h) in &clients {
            let deadline = Instant::now() + Duration::from_secs(5);
            while h.failure().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let f = h.failure().expect("failure relayed");
            assert_eq!(f.suspect, Some(1));
            assert!(f.reason.contains("rank 1 (pid"), "{}", f.reason);
        }
    }

    #[test]
    fn a_rank_joining_after_the_failure_is_told_whom_it_names() {
        let t = Duration::from_secs(10);
        let server = start(2, t);
        // Rank 1 joins and dies before rank 0 has joined (a SIGKILL right after its start).
        let stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        let hello = Msg::Hello {
            rank: 1,
            world_size: 2,
            pid: 7,
            host: "here".into(),
        };
        send(&Mutex::new(stream), &hello).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.server.inner.lock().unwrap().failure.is_none() {
            assert!(Instant::now() < deadline, "rank 1's end not noticed");
            std::thread::sleep(Duration::from_millis(10));
        }
        let h = Health::new(0, None);
        let world = World::local(0, 2, server.port());
        assert!(StoreClient::connect(&world, h.clone(), Arc::default(), t).is_err());
        let f = h.failure().expect("the failure, relayed");
        assert_eq!(f.suspect, Some(1));
        assert!(
            f.reason.contains("before this rank joined") && f.reason.contains("rank 1 (pid 7"),
            "{}",
            f.reason
        );
    }

    #[test]
    fn a_reported_failure_reaches_every_rank() {
        let t = Duration::from_secs(10);
        let server = start(2, t);
        let port = server.port();
        let joins: Vec<_> = (0..2)
            .map(|r| std::thread::spawn(move || client(r, 2, port, t).unwrap()))
            .collect();
        let clients: Vec<_> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        clients[1].1.fail(Some(0), "rank 1 saw rank 0 hang");
        let h0 = &clients[0].1;
        let deadline = Instant::now() + Duration::from_secs(5);
        while h0.failure().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let f = h0.failure().unwrap();
        assert_eq!((f.suspect, f.reporter), (Some(0), 1));
        assert!(f.reason.contains("rank 1 saw rank 0 hang"));
    }

    #[test]
    fn a_missing_rank_times_out_by_name_and_a_bad_world_is_refused() {
        let t = Duration::from_millis(600);
        let server = start(3, t);
        let port = server.port();
        let a = std::thread::spawn(move || client(0, 3, port, t).map(|_| ()));
        let b = std::thread::spawn(move || client(1, 3, port, t).map(|_| ()));
        let e = format!("{:#}", a.join().unwrap().unwrap_err());
        assert!(e.contains("rank 2 did not join"), "{e}");
        b.join().unwrap().unwrap_err();

        let server = start(2, Duration::from_secs(5));
        let err = client(0, 3, server.port(), Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(crate::error::is_input_error(&err));
        assert!(format!("{err:#}").contains("world size of 3"), "{err:#}");
    }

    #[test]
    fn hex_round_trip() {
        let v: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&v)).unwrap(), v);
        assert!(unhex("abc").is_err());
    }
}
