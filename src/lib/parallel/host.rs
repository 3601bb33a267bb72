//! The CPU communicator: N processes (on one machine or several) connected pairwise over TCP,
//! for the CPU backend's buffers, so that CI runs the same sharded code as the GPUs.
//!
//! Every pair of ranks shares one connection (set up through the rendezvous store: each rank
//! listens on the interface that reaches rank 0 and publishes its address). Each connection has
//! a reader and a writer thread, so sends never wait for receives and no collective can
//! deadlock on full socket buffers. One worker thread per communicator runs the started groups
//! in order: it is this communicator's "stream", so collectives overlap whatever the caller
//! computes between `start` and `wait`. `start` copies the inputs (rounded to bf16 when the
//! collective runs as bf16); `wait` writes the results into the borrowed buffers.
//!
//! Algorithms (bandwidth-optimal, like NCCL's ring in bytes sent: all-gather and
//! reduce-scatter send (n−1)/n of the data per rank, all-reduce 2(n−1)/n):
//! - reduce-scatter: rank p sends chunk q of its input to rank q; each rank reduces its own
//!   chunk;
//! - all-gather: every rank sends its piece to every other rank;
//! - all-reduce: a reduce-scatter of n nearly equal chunks, then an all-gather of the results;
//! - broadcast: the root sends to every rank; barrier: everyone sends an empty message to all.
//!
//! Reduction order (documented contract, `rank_order_reductions`): element i of a reduction is
//! `round(((s·x_0[i] + s·x_1[i]) + s·x_2[i]) + … + s·x_{n−1}[i])`, accumulated in f32 in rank
//! order, s the pre-multiplier (omitted for Sum), and rounded once to bf16 at the end for a
//! bf16 collective. Each chunk is reduced by exactly one rank and then copied, so every rank
//! ends with the same bits, and they equal a host loop over the ranks in order.
//!
//! Failures: a receive waits at most the timeout; then (or when a connection closes) the
//! communicator fails, naming the rank it was waiting for, tells the store, and every later
//! call fails with the same message.

use super::comm::{round_to, Collective, Comm, Kind, Pending, ReduceOp, Work};
use super::group::ProcessGroup;
use super::health::Health;
use crate::backend::cpu::Cpu;
use crate::backend::DType;
use anyhow::{anyhow, bail, Result};
use half::bf16;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One message between two ranks: which collective (sequence number and kind/phase) and its
/// values (f32 or bf16 little-endian).
struct Frame {
    seq: u64,
    tag: u16,
    payload: Vec<u8>,
}

const HEADER: usize = 4 + 8 + 2;

fn op_code(name: &str) -> u16 {
    match name {
        "all_reduce" => 1,
        "all_gather" => 2,
        "reduce_scatter" => 3,
        "broadcast" => 4,
        _ => 5,
    }
}

fn op_name(code: u16) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "all_gather",
        3 => "reduce_scatter",
        4 => "broadcast",
        _ => "barrier",
    }
}

fn encode(seq: u64, tag: u16, values: &[f32], bf16_wire: bool) -> Vec<u8> {
    let width = if bf16_wire { 2 } else { 4 };
    let mut out = Vec::with_capacity(HEADER + values.len() * width);
    out.extend_from_slice(&((values.len() * width) as u32).to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    if bf16_wire {
        for v in values {
            out.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
        }
    } else {
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

fn decode(bytes: &[u8], bf16_wire: bool) -> Vec<f32> {
    if bf16_wire {
        bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

/// What one collective of a started group carries to the worker.
enum HostKind {
    AllReduce { premul: Option<f32> },
    AllGather,
    ReduceScatter { premul: Option<f32> },
    Broadcast { root: usize },
    Barrier,
}

struct HostOp {
    kind: HostKind,
    bf16: bool,
    input: Vec<f32>,
}

struct Job {
    first_seq: u64,
    ops: Vec<HostOp>,
    reply: Sender<Result<Vec<Vec<f32>>, String>>,
}

/// The error of a receive: the message, and the rank it names.
struct CommError {
    suspect: Option<usize>,
    msg: String,
    /// The peer's connection closed: it may be a rank stopping for a failure it has already
    /// reported to the store, whose relay is the better message.
    closed: bool,
}

/// How long a rank whose peer's connection closed waits for the store to relay that peer's
/// report before blaming the peer itself. A peer closes its sockets right after reporting,
/// so the relay is usually on its way; a peer that truly died costs this much delay.
const RELAY_GRACE: Duration = Duration::from_secs(2);

struct Worker {
    rank: usize,
    n: usize,
    out: Vec<Option<Sender<Vec<u8>>>>,
    inbox: Vec<Option<Receiver<Frame>>>,
    timeout_ms: Arc<AtomicU64>,
    health: Arc<Health>,
    broken: Option<String>,
}

impl Worker {
    fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            let result = match &self.broken {
                Some(msg) => Err(msg.clone()),
                None => self.exec(&job).map_err(|e| {
                    if e.closed {
                        self.wait_for_relay();
                    }
                    // A failure relayed from elsewhere is the better message.
                    let msg = match self.health.failure() {
                        Some(f) => f.reason,
                        None => {
                            self.health.fail(e.suspect, e.msg.clone());
                            e.msg
                        }
                    };
                    self.broken = Some(msg.clone());
                    msg
                }),
            };
            let _ = job.reply.send(result);
        }
    }

    /// Waits up to `RELAY_GRACE` for a failure to be recorded (relayed by the store).
    fn wait_for_relay(&self) {
        let t = Instant::now();
        while self.health.failure().is_none() && t.elapsed() < RELAY_GRACE {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn exec(&mut self, job: &Job) -> Result<Vec<Vec<f32>>, CommError> {
        job.ops
            .iter()
            .enumerate()
            .map(|(i, op)| self.exec_op(job.first_seq + i as u64, op))
            .collect()
    }

    fn send(&self, to: usize, seq: u64, tag: u16, values: &[f32], bf16_wire: bool) {
        if let Some(tx) = &self.out[to] {
            // A closed writer means the peer is gone: the receive from it reports that.
            let _ = tx.send(encode(seq, tag, values, bf16_wire));
        }
    }

    fn recv(
        &self,
        from: usize,
        seq: u64,
        tag: u16,
        expect: usize,
        bf16_wire: bool,
    ) -> Result<Vec<f32>, CommError> {
        let name = op_name(tag >> 8);
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        let rx = self.inbox[from].as_ref().expect("a peer's inbox");
        let error = |msg: String, closed: bool| {
            Err(CommError {
                suspect: Some(from),
                msg,
                closed,
            })
        };
        let fail = |msg: String| error(msg, false);
        let frame = match rx.recv_timeout(timeout) {
            Ok(f) => f,
            Err(RecvTimeoutError::Timeout) => {
                return fail(format!(
                    "{name} #{seq} timed out after {timeout:?} waiting for rank {from} (rank {from} is hung, \
                     busy elsewhere for longer than the timeout, or called a different collective)"
                ))
            }
            Err(RecvTimeoutError::Disconnected) => {
                return error(
                    format!(
                        "{name} #{seq}: the connection to rank {from} closed (rank {from} exited or failed)"
                    ),
                    true,
                )
            }
        };
        if frame.seq != seq || frame.tag != tag {
            return fail(format!(
                "rank {from} sent {} #{} while rank {} runs {name} #{seq}: the ranks called different collectives",
                op_name(frame.tag >> 8),
                frame.seq,
                self.rank
            ));
        }
        let width = if bf16_wire { 2 } else { 4 };
        if frame.payload.len() != expect * width {
            return fail(format!(
                "rank {from} sent {} elements for {name} #{seq}, rank {} expected {expect}: the ranks passed different sizes",
                frame.payload.len() / width,
                self.rank
            ));
        }
        Ok(decode(&frame.payload, bf16_wire))
    }

    /// Σ over ranks in rank order of chunk `mine` of everyone's input (`own` is this rank's).
    fn reduce_chunk(
        &self,
        seq: u64,
        tag: u16,
        own: &[f32],
        premul: Option<f32>,
        bf16_wire: bool,
    ) -> Result<Vec<f32>, CommError> {
        let mut acc: Vec<f32> = Vec::new();
        for q in 0..self.n {
            let received;
            let x: &[f32] = if q == self.rank {
                own
            } else {
                received = self.recv(q, seq, tag, own.len(), bf16_wire)?;
                &received
            };
            if q == 0 {
                acc = match premul {
                    None => x.to_vec(),
                    Some(s) => x.iter().map(|v| s * v).collect(),
                };
            } else {
                match premul {
                    None => acc.iter_mut().zip(x).for_each(|(a, v)| *a += v),
                    Some(s) => acc.iter_mut().zip(x).for_each(|(a, v)| *a += s * v),
                }
            }
        }
        if bf16_wire {
            acc.iter_mut().for_each(|v| *v = round_to(*v, DType::BF16));
        }
        Ok(acc)
    }

    fn exec_op(&self, seq: u64, op: &HostOp) -> Result<Vec<f32>, CommError> {
        let (n, r, b) = (self.n, self.rank, op.bf16);
        let name = match op.kind {
            HostKind::AllReduce { .. } => "all_reduce",
            HostKind::AllGather => "all_gather",
            HostKind::ReduceScatter { .. } => "reduce_scatter",
            HostKind::Broadcast { .. } => "broadcast",
            HostKind::Barrier => "barrier",
        };
        let tag = |phase: u16| (op_code(name) << 8) | phase;
        let x = &op.input;
        match op.kind {
            HostKind::ReduceScatter { premul } => {
                let c = x.len() / n;
                for p in (0..n).filter(|&p| p != r) {
                    self.send(p, seq, tag(0), &x[p * c..(p + 1) * c], b);
                }
                self.reduce_chunk(seq, tag(0), &x[r * c..(r + 1) * c], premul, b)
            }
            HostKind::AllGather => {
                let c = x.len();
                for p in (0..n).filter(|&p| p != r) {
                    self.send(p, seq, tag(0), x, b);
                }
                let mut out = Vec::with_capacity(n * c);
                for q in 0..n {
                    if q == r {
                        out.extend_from_slice(x);
                    } else {
                        out.extend(self.recv(q, seq, tag(0), c, b)?);
                    }
                }
                Ok(out)
            }
            HostKind::AllReduce { premul } => {
                let l = x.len();
                let bound = |p: usize| l * p / n;
                for p in (0..n).filter(|&p| p != r) {
                    self.send(p, seq, tag(0), &x[bound(p)..bound(p + 1)], b);
                }
                let mine = self.reduce_chunk(seq, tag(0), &x[bound(r)..bound(r + 1)], premul, b)?;
                for p in (0..n).filter(|&p| p != r) {
                    self.send(p, seq, tag(1), &mine, b);
                }
                let mut out = Vec::with_capacity(l);
                for q in 0..n {
                    if q == r {
                        out.extend_from_slice(&mine);
                    } else {
                        out.extend(self.recv(q, seq, tag(1), bound(q + 1) - bound(q), b)?);
                    }
                }
                Ok(out)
            }
            HostKind::Broadcast { root } => {
                if r == root {
                    for p in (0..n).filter(|&p| p != r) {
                        self.send(p, seq, tag(0), x, b);
                    }
                    Ok(x.clone())
                } else {
                    self.recv(root, seq, tag(0), x.len(), b)
                }
            }
            HostKind::Barrier => {
                for p in (0..n).filter(|&p| p != r) {
                    self.send(p, seq, tag(0), &[], false);
                }
                for q in (0..n).filter(|&q| q != r) {
                    self.recv(q, seq, tag(0), 0, false)?;
                }
                Ok(Vec::new())
            }
        }
    }
}

/// The CPU communicator of one process group (see the module docs).
pub struct HostComm {
    rank: usize,
    n: usize,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    writers: Mutex<Vec<JoinHandle<()>>>,
    sockets: Arc<Vec<TcpStream>>,
    timeout_ms: Arc<AtomicU64>,
    /// Collectives started on this communicator (numbers the messages: equal on every rank).
    next_seq: AtomicU64,
    /// Collectives started in the process group (the heartbeat's progress count).
    progress: Arc<AtomicU64>,
    health: Arc<Health>,
}

impl HostComm {
    /// Connects every pair of ranks of `pg` (a collective call: every rank makes it).
    pub fn new(pg: &ProcessGroup) -> Result<HostComm> {
        let (rank, n) = (pg.rank(), pg.world_size());
        let timeout = pg.timeout();
        let peers = connect_mesh(pg)?;
        let mut out = Vec::with_capacity(n);
        let mut inbox = Vec::with_capacity(n);
        let mut writers = Vec::new();
        let mut sockets = Vec::new();
        for (p, stream) in peers.into_iter().enumerate() {
            let Some(stream) = stream else {
                out.push(None);
                inbox.push(None);
                continue;
            };
            stream.set_nodelay(true)?;
            sockets.push(stream.try_clone()?);
            let (wtx, wrx) = channel::<Vec<u8>>();
            let mut w = stream.try_clone()?;
            writers.push(
                std::thread::Builder::new()
                    .name(format!("dist-host-w{p}"))
                    .spawn(move || {
                        while let Ok(bytes) = wrx.recv() {
                            if w.write_all(&bytes).is_err() {
                                return;
                            }
                        }
                    })?,
            );
            let (rtx, rrx) = channel::<Frame>();
            let mut rd = stream;
            std::thread::Builder::new()
                .name(format!("dist-host-r{p}"))
                .spawn(move || {
                    let mut head = [0u8; HEADER];
                    while rd.read_exact(&mut head).is_ok() {
                        let len = u32::from_le_bytes(head[0..4].try_into().unwrap()) as usize;
                        let seq = u64::from_le_bytes(head[4..12].try_into().unwrap());
                        let tag = u16::from_le_bytes(head[12..14].try_into().unwrap());
                        let mut payload = vec![0u8; len];
                        if rd.read_exact(&mut payload).is_err()
                            || rtx.send(Frame { seq, tag, payload }).is_err()
                        {
                            return;
                        }
                    }
                })?;
            out.push(Some(wtx));
            inbox.push(Some(rrx));
        }
        let timeout_ms = Arc::new(AtomicU64::new(timeout.as_millis() as u64));
        let health = pg.health().clone();
        let sockets = Arc::new(sockets);
        let weak = Arc::downgrade(&sockets);
        // On a failure anywhere, close the connections so that a blocked receive returns.
        health.on_failure(move || {
            if let Some(s) = weak.upgrade() {
                for s in s.iter() {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        });
        let worker = Worker {
            rank,
            n,
            out,
            inbox,
            timeout_ms: timeout_ms.clone(),
            health: health.clone(),
            broken: None,
        };
        let (jtx, jrx) = channel::<Job>();
        let handle = std::thread::Builder::new()
            .name("dist-host-comm".into())
            .spawn(move || worker.run(jrx))?;
        Ok(HostComm {
            rank,
            n,
            jobs: Mutex::new(Some(jtx)),
            worker: Mutex::new(Some(handle)),
            writers: Mutex::new(writers),
            sockets,
            timeout_ms,
            next_seq: AtomicU64::new(0),
            progress: pg.seq().clone(),
            health,
        })
    }

    fn submit<'a>(
        &'a self,
        ops: Vec<HostOp>,
        outs: Vec<Option<(&'a mut Vec<f32>, usize)>>,
    ) -> Result<Work<'a>> {
        self.health.check()?;
        let first_seq = self.next_seq.fetch_add(ops.len() as u64, Ordering::Relaxed);
        self.progress.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.jobs
            .lock()
            .unwrap()
            .as_ref()
            .ok_or_else(|| anyhow!("host communicator is closed"))?
            .send(Job {
                first_seq,
                ops,
                reply: tx,
            })
            .map_err(|_| anyhow!("host communicator: its worker stopped"))?;
        Ok(Work::new(Box::new(HostPending { rx, outs })))
    }
}

/// A started group: the results arrive on `rx`, `outs` says where each goes.
struct HostPending<'a> {
    rx: Receiver<Result<Vec<Vec<f32>>, String>>,
    outs: Vec<Option<(&'a mut Vec<f32>, usize)>>,
}

impl Pending for HostPending<'_> {
    fn wait(self: Box<Self>) -> Result<()> {
        let results = self
            .rx
            .recv()
            .map_err(|_| anyhow!("host communicator: its worker stopped"))?
            .map_err(|e| anyhow!("{e}"))?;
        for (out, values) in self.outs.into_iter().zip(results) {
            if let Some((buf, off)) = out {
                buf[off..off + values.len()].copy_from_slice(&values);
            }
        }
        Ok(())
    }
}

fn input(src: &[f32], bf16_wire: bool) -> Vec<f32> {
    if bf16_wire {
        src.iter().map(|&v| round_to(v, DType::BF16)).collect()
    } else {
        src.to_vec()
    }
}

impl Comm<Cpu> for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn name(&self) -> &'static str {
        "host"
    }

    fn rank_order_reductions(&self) -> bool {
        true
    }

    fn start<'a>(&'a self, ops: Vec<Collective<'a, Cpu>>) -> Result<Work<'a>> {
        let (r, n) = (self.rank, self.n);
        let mut host_ops = Vec::with_capacity(ops.len());
        let mut outs = Vec::with_capacity(ops.len());
        for c in ops {
            c.validate(n, |b: &Vec<f32>| b.len())?;
            let b = match c.dtype {
                None | Some(DType::F32) => false,
                Some(DType::BF16) => true,
            };
            let premul = |op: ReduceOp| op.premul(n);
            let (kind, input, out) = match c.kind {
                Kind::AllReduce { buf, off, len, op } => (
                    HostKind::AllReduce { premul: premul(op) },
                    input(&buf[off..off + len], b),
                    (buf, off),
                ),
                Kind::AllGather {
                    send,
                    recv,
                    off,
                    count,
                } => {
                    let x = match send {
                        Some((s, so)) => input(&s[so..so + count], b),
                        None => input(&recv[off + r * count..off + (r + 1) * count], b),
                    };
                    (HostKind::AllGather, x, (recv, off))
                }
                Kind::ReduceScatter {
                    send,
                    recv,
                    off,
                    count,
                    op,
                } => {
                    let kind = HostKind::ReduceScatter { premul: premul(op) };
                    match send {
                        Some((s, so)) => (kind, input(&s[so..so + n * count], b), (recv, off)),
                        None => {
                            let x = input(&recv[off..off + n * count], b);
                            (kind, x, (recv, off + r * count))
                        }
                    }
                }
                Kind::Broadcast {
                    buf,
                    off,
                    len,
                    root,
                } => (
                    HostKind::Broadcast { root },
                    input(&buf[off..off + len], b),
                    (buf, off),
                ),
            };
            host_ops.push(HostOp {
                kind,
                bf16: b,
                input,
            });
            outs.push(Some(out));
        }
        self.submit(host_ops, outs)
    }

    fn barrier(&self) -> Result<()> {
        let op = HostOp {
            kind: HostKind::Barrier,
            bf16: false,
            input: Vec::new(),
        };
        self.submit(vec![op], vec![None])?.wait()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for HostComm {
    fn drop(&mut self) {
        // Let the worker finish, then the writers flush what it queued (a peer may still be
        // receiving the last collective), then close.
        self.jobs.lock().unwrap().take();
        if let Some(w) = self.worker.lock().unwrap().take() {
            let _ = w.join();
        }
        for w in self.writers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
        for s in self.sockets.iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// One connection per pair of ranks: rank r dials every lower rank at the address it
/// published in the store, and accepts every higher one. Entry p is the connection to rank p
/// (None for this rank).
fn connect_mesh(pg: &ProcessGroup) -> Result<Vec<Option<TcpStream>>> {
    let (rank, n) = (pg.rank(), pg.world_size());
    let mut peers: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    if n == 1 {
        return Ok(peers);
    }
    let store = pg
        .store()
        .ok_or_else(|| anyhow!("a world of {n} ranks without a rendezvous store"))?;
    let id = pg.next_comm_id();
    let key = |p: usize| format!("host_comm/{id}/{p}");
    let listener = TcpListener::bind((store.local_ip(), 0))?;
    store.set(&key(rank), listener.local_addr()?.to_string().as_bytes())?;
    let deadline = Instant::now() + pg.timeout();
    let hello = |s: &mut TcpStream| -> std::io::Result<()> {
        let mut b = (rank as u32).to_le_bytes().to_vec();
        b.extend_from_slice(&id.to_le_bytes());
        s.write_all(&b)
    };
    for (p, slot) in peers.iter_mut().enumerate().take(rank) {
        let addr = String::from_utf8(store.get(&key(p))?)?;
        let mut s = loop {
            match TcpStream::connect(&addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    bail!("rank {rank}: cannot connect to rank {p} at {addr}: {e}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        hello(&mut s)?;
        *slot = Some(s);
    }
    listener.set_nonblocking(true)?;
    let mut waiting = n - 1 - rank;
    while waiting > 0 {
        pg.health().check()?;
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                let mut b = [0u8; 12];
                if s.read_exact(&mut b).is_err() {
                    continue;
                }
                let p = u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize;
                let their_id = u64::from_le_bytes(b[4..12].try_into().unwrap());
                if p <= rank || p >= n || their_id != id || peers[p].is_some() {
                    continue;
                }
                s.set_read_timeout(None)?;
                peers[p] = Some(s);
                waiting -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (rank + 1..n)
                        .filter(|&p| peers[p].is_none())
                        .map(|p| p.to_string())
                        .collect();
                    let msg = format!(
                        "rank {rank}: rank(s) {} did not connect to the CPU communicator within {:?}",
                        missing.join(", "),
                        pg.timeout()
                    );
                    pg.health()
                        .fail((rank + 1..n).find(|&p| peers[p].is_none()), msg.clone());
                    bail!(msg);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::testing::ranks;

    #[test]
    fn collectives_on_three_ranks_match_a_rank_order_host_loop() {
        let out = ranks(3, Duration::from_secs(20), |pg| {
            let comm = HostComm::new(&pg).unwrap();
            let r = pg.rank() as f32;
            // all_reduce on a view (elements 1..4 of 5), others untouched.
            let mut a = vec![-1.0, r + 1.0, 0.1 * (r + 1.0), 1e8 * r, -1.0];
            comm.all_reduce(&mut a, 1, 3, ReduceOp::Sum).unwrap();
            // all_gather of 2 into a buffer with a one-element offset.
            let s = vec![10.0 * r, 10.0 * r + 1.0];
            let mut g = vec![7.0; 8];
            comm.all_gather(&s, 0, &mut g, 1, 2).unwrap();
            // reduce_scatter average.
            let rs_in: Vec<f32> = (0..6).map(|i| i as f32 + 100.0 * r).collect();
            let mut rs = vec![0.0; 2];
            comm.reduce_scatter(&rs_in, 0, &mut rs, 0, 2, ReduceOp::Avg)
                .unwrap();
            let mut bc = vec![r, r];
            comm.broadcast(&mut bc, 1, 1, 2).unwrap();
            comm.barrier().unwrap();
            drop(comm);
            pg.finish().unwrap();
            (a, g, rs, bc)
        });
        let sum3 = |f: &dyn Fn(f32) -> f32| (f(0.0) + f(1.0)) + f(2.0);
        for (rank, (a, g, rs, bc)) in out.iter().enumerate() {
            assert_eq!(
                a,
                &vec![
                    -1.0,
                    6.0,
                    sum3(&|r| 0.1 * (r + 1.0)),
                    sum3(&|r| 1e8 * r),
                    -1.0
                ]
            );
            assert_eq!(g, &vec![7.0, 0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 7.0]);
            let third = 1.0f32 / 3.0;
            let expect: Vec<f32> = (0..2)
                .map(|i| {
                    let x = |q: f32| (2 * rank + i) as f32 + 100.0 * q;
                    (third * x(0.0) + third * x(1.0)) + third * x(2.0)
                })
                .collect();
            assert_eq!(rs, &expect);
            assert_eq!(bc, &vec![rank as f32, 2.0]);
        }
    }

    #[test]
    fn bf16_groups_and_overlap() {
        let out = ranks(2, Duration::from_secs(20), |pg| {
            let comm = HostComm::new(&pg).unwrap();
            let r = pg.rank() as f32;
            // 257 is halfway between bf16 256 and 258: rounds to even (256).
            let mut a = vec![257.0 + r, 1.0 + 1.0 / 256.0];
            let mut b = vec![0.0f32; 4];
            let s = vec![r + 0.5, 3.0];
            let work = comm
                .start(vec![
                    Collective::all_reduce(&mut a, 0, 2, ReduceOp::Sum).as_dtype(DType::BF16),
                    Collective::all_gather(&s, 0, &mut b, 0, 2),
                ])
                .unwrap();
            // The caller computes while the group runs.
            let busy: f32 = (0..1000).map(|i| i as f32).sum();
            work.wait().unwrap();
            drop(comm);
            pg.finish().unwrap();
            (a, b, busy)
        });
        for (a, b, busy) in out {
            // rank 0: 257 -> 256, rank 1: 258; 256 + 258 = 514 -> bf16 512 (ties to even).
            // 1 + 2^-8 -> 1 on both ranks; 2 exactly.
            assert_eq!(a, vec![512.0, 2.0]);
            assert_eq!(b, vec![0.5, 3.0, 1.5, 3.0]);
            assert_eq!(busy, 499500.0);
        }
    }

    #[test]
    fn a_silent_rank_times_out_naming_it() {
        let out = ranks(3, Duration::from_millis(800), |pg| {
            let comm = HostComm::new(&pg).unwrap();
            let mut a = vec![1.0f32; 4];
            if pg.rank() == 2 {
                // Waits for the failure to arrive instead of joining the collective.
                let t = Instant::now();
                while pg.health().failure().is_none() && t.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return pg.health().failure().map(|f| f.reason).unwrap_or_default();
            }
            let e = comm.all_reduce(&mut a, 0, 4, ReduceOp::Sum).unwrap_err();
            // Every later call fails the same way.
            assert!(comm.barrier().is_err());
            format!("{e:#}")
        });
        // A rank still waiting when rank 2 has read the failure and gone may see its connection
        // close first: that names rank 2 too.
        for msg in &out {
            assert!(
                msg.contains("waiting for rank 2")
                    || msg.contains("the connection to rank 2 closed"),
                "{msg}"
            );
        }
        assert!(out[2].contains("waiting for rank 2"), "{}", out[2]);
    }

    #[test]
    fn a_peer_that_closes_before_its_report_arrives_is_not_blamed() {
        // Rank 0 closes its connections 300 ms before its report of rank 1 reaches the store:
        // the others wait for the relay instead of naming rank 0.
        let out = ranks(3, Duration::from_secs(20), |pg| {
            let comm = HostComm::new(&pg).unwrap();
            if pg.rank() == 0 {
                drop(comm);
                std::thread::sleep(Duration::from_millis(300));
                pg.health().fail(Some(1), "rank 1 died");
                return String::new();
            }
            let e = comm.barrier().unwrap_err();
            format!("{e:#}")
        });
        for msg in &out[1..] {
            assert!(msg.contains("rank 1 died"), "{msg}");
        }
    }
}
