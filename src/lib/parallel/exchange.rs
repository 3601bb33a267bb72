//! Byte payloads passed among the ranks of one job through the rendezvous store, for the work
//! that is split by rows rather than by tensors: rank 0 gathers every rank's part (the samples
//! each rank generated, the log-probs it scored) and writes the job's one output file, or
//! hands every rank a value once it has written it. (Collectives on device buffers are
//! [`super::Comm`]; these payloads are host data: token ids, log-probs and texts, about 8 bytes a token
//! plus the text, sent hex-encoded.)
//!
//! The exchange points of a job are numbered in the order the ranks reach them (every rank
//! runs the same code, so they agree). A rank whose part of the job fails marks the job failed
//! under its rank ([`Exchange::fail`]); a rank waiting for it then stops with that message
//! instead of waiting forever. A rank that dies is reported by the store as for any collective.
//! A wait has no time limit otherwise: ranks may generate for minutes, and a dead or frozen
//! rank fails the whole group anyway (`store`).

use super::group::ProcessGroup;
use crate::error::{input_error, is_input_error};
use anyhow::{anyhow, bail, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// The contiguous block of `items` that `rank` of `world` ranks takes: as even as can be, the
/// first `items % world` ranks one more (rank order is item order).
pub fn block(items: usize, world: usize, rank: usize) -> Range<usize> {
    let world = world.max(1);
    let (base, extra) = (items / world, items % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The failure of one rank's part of a job, as another rank learns it.
#[derive(Debug)]
pub(crate) struct RankFailed {
    /// The rank whose part failed first.
    pub(crate) rank: usize,
    pub(crate) message: String,
    /// Bad input (exit code 2).
    pub(crate) input: bool,
}

impl std::fmt::Display for RankFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.message)
    }
}

impl std::error::Error for RankFailed {}

/// The exchanges of one job among the ranks of a group (see the module docs). `tag` names the
/// job and must be the same on every rank and different from every other job of the group.
pub struct Exchange {
    pg: Arc<ProcessGroup>,
    tag: String,
    next: AtomicU64,
    failed: AtomicBool,
}

impl Exchange {
    pub fn new(pg: Arc<ProcessGroup>, tag: impl Into<String>) -> Exchange {
        Exchange {
            pg,
            tag: tag.into(),
            next: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        }
    }

    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    pub fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    /// Rank 0, which writes the job's files.
    pub(crate) fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// This rank's block of `items` ([`block`]).
    pub fn block(&self, items: usize) -> Range<usize> {
        block(items, self.world_size(), self.rank())
    }

    fn key(&self, point: u64, who: &str) -> String {
        format!("x/{}/{point}/{who}", self.tag)
    }

    fn fail_key(&self, rank: usize) -> String {
        format!("x/{}/fail/{rank}", self.tag)
    }

    fn point(&self) -> u64 {
        self.next.fetch_add(1, Ordering::SeqCst)
    }

    /// Waits for `key` or for `rank`'s failure.
    fn wait(&self, key: String, rank: usize) -> Result<Vec<u8>> {
        let store = self
            .pg
            .store()
            .expect("a group of several ranks has a store");
        let keys = [key, self.fail_key(rank)];
        let (index, value) = store
            .get_any(&keys, None, &|| false)?
            .expect("never stopped");
        if index == 0 {
            return Ok(value);
        }
        Err(failure_report(rank, &value)?.into())
    }

    /// Waits until a rank other than this one marks the job failed (its failure), or until
    /// `stop` says to give up (None): a daemon rank stops its own part of a job at once when
    /// another rank's part failed or was cancelled.
    pub(crate) fn watch_others(&self, stop: &dyn Fn() -> bool) -> Result<Option<RankFailed>> {
        let store = self
            .pg
            .store()
            .expect("a group of several ranks has a store");
        let others: Vec<usize> = (0..self.world_size())
            .filter(|&r| r != self.rank())
            .collect();
        let keys: Vec<String> = others.iter().map(|&r| self.fail_key(r)).collect();
        match store.get_any(&keys, None, stop)? {
            None => Ok(None),
            Some((index, value)) => failure_report(others[index], &value).map(Some),
        }
    }

    /// Rank 0 gets every rank's `part` in rank order (its own first); the others get None once
    /// theirs is handed over.
    pub fn gather(&self, part: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
        let point = self.point();
        // A launched world of one has no store and nothing to wait for.
        if self.world_size() == 1 {
            return Ok(Some(vec![part.to_vec()]));
        }
        let store = self
            .pg
            .store()
            .expect("a group of several ranks has a store");
        if !self.is_root() {
            store.set(&self.key(point, &self.rank().to_string()), part)?;
            return Ok(None);
        }
        let mut parts = vec![part.to_vec()];
        let mut keys = Vec::new();
        for r in 1..self.world_size() {
            let key = self.key(point, &r.to_string());
            parts.push(self.wait(key.clone(), r)?);
            keys.push(key);
        }
        store.delete(&keys)?;
        Ok(Some(parts))
    }

    /// Every rank gets rank 0's `value` (rank 0 passes Some; the others None), once rank 0 has
    /// reached this point: what comes after it may rely on what rank 0 did before (files
    /// written).
    pub fn broadcast(&self, value: Option<&[u8]>) -> Result<Vec<u8>> {
        let point = self.point();
        let key = self.key(point, "root");
        if self.is_root() {
            let v = value.expect("rank 0 gives the value").to_vec();
            if self.world_size() == 1 {
                return Ok(v);
            }
            self.pg
                .store()
                .expect("a group of several ranks has a store")
                .set(&key, &v)?;
            return Ok(v);
        }
        self.wait(key, 0)
    }

    /// Marks this rank's part of the job failed with `e` (once), so that no rank waits for it.
    /// A failure that came from another rank keeps naming that rank.
    pub fn fail(&self, e: &anyhow::Error) {
        if self.failed.swap(true, Ordering::SeqCst) {
            return;
        }
        let (rank, message, input) = match e.downcast_ref::<RankFailed>() {
            Some(f) => (f.rank, f.message.clone(), f.input),
            None => (self.rank(), format!("{e:#}"), is_input_error(e)),
        };
        let v = serde_json::json!({"rank": rank, "message": message, "input": input});
        if let Some(store) = self.pg.store() {
            let _ = store.set(&self.fail_key(self.rank()), v.to_string().as_bytes());
        }
    }
}

/// Reads the failure report `rank` left in the store.
fn failure_report(rank: usize, value: &[u8]) -> Result<RankFailed> {
    let v: serde_json::Value = serde_json::from_slice(value)
        .map_err(|e| anyhow!("rank {rank}'s failure report is not JSON: {e}"))?;
    Ok(RankFailed {
        rank: v["rank"].as_u64().map_or(rank, |r| r as usize),
        message: v["message"].as_str().unwrap_or("failed").to_string(),
        input: v["input"].as_bool().unwrap_or(false),
    })
}

/// An error another rank reported, as this rank's error: an input error stays one (exit 2).
pub(crate) fn as_local(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<RankFailed>() {
        Some(f) if f.input => input_error(f.to_string()),
        _ => e,
    }
}

/// A little-endian encoder of the payloads ([`Reader`] reads them back).
#[derive(Default)]
pub(crate) struct Writer(Vec<u8>);

impl Writer {
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }

    pub(crate) fn u32s(&mut self, v: &[u32]) -> &mut Self {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }

    /// f32 values bit for bit.
    pub fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_bits().to_le_bytes());
        }
        self
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads what a [`Writer`] wrote, in the same order; a short or malformed payload is an error.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            bail!(
                "a rank's payload ends early ({} bytes, {} more wanted at {})",
                self.buf.len(),
                n,
                self.pos
            );
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }

    fn len(&mut self, width: usize) -> Result<usize> {
        let n = self.u64()? as usize;
        if n.saturating_mul(width) > self.buf.len() - self.pos {
            bail!("a rank's payload holds a length ({n}) past its end");
        }
        Ok(n)
    }

    pub(crate) fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.len(4)?;
        Ok(self
            .take(4 * n)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        Ok(self.u32s()?.into_iter().map(f32::from_bits).collect())
    }

    pub fn str(&mut self) -> Result<String> {
        let n = self.len(1)?;
        Ok(String::from_utf8(self.take(n)?.to_vec())?)
    }

    /// Whether everything was read.
    #[cfg(test)]
    pub fn done(&self) -> bool {
        self.pos == self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::group::Options;
    use crate::parallel::world::World;

    #[test]
    fn blocks_cover_the_items_in_order_and_balanced() {
        for items in 0..12 {
            for world in 1..5 {
                let blocks: Vec<Range<usize>> =
                    (0..world).map(|r| block(items, world, r)).collect();
                assert_eq!(blocks[0].start, 0);
                assert_eq!(blocks[world - 1].end, items);
                for w in blocks.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() <= w[1].len() + 1);
                }
            }
        }
        assert_eq!(block(7, 3, 0), 0..3);
        assert_eq!(block(7, 3, 1), 3..5);
        assert_eq!(block(7, 3, 2), 5..7);
    }

    #[test]
    fn payloads_round_trip_bit_for_bit() {
        let mut w = Writer::default();
        w.u64(7)
            .f32s(&[1.5, -0.0, f32::NEG_INFINITY, f32::from_bits(0x7fc0_0001)])
            .u32s(&[1, u32::MAX])
            .str("héllo")
            .f64(0.25);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u64().unwrap(), 7);
        let f = r.f32s().unwrap();
        assert_eq!(f[3].to_bits(), 0x7fc0_0001);
        assert_eq!(f[1].to_bits(), (-0.0f32).to_bits());
        assert_eq!(r.u32s().unwrap(), [1, u32::MAX]);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.f64().unwrap(), 0.25);
        assert!(r.done());
        let mut short = Reader::new(&bytes[..12]);
        short.u64().unwrap();
        assert!(short.f32s().is_err());
    }

    /// Three ranks as threads: rank 0 gathers in rank order, the broadcast reaches everyone,
    /// and a rank that fails before an exchange stops the rank waiting for it with its
    /// message (an input error stays one).
    #[test]
    fn gather_broadcast_and_failure() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let opts = Options::in_process(std::time::Duration::from_secs(20));
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let pg = Arc::new(ProcessGroup::new(World::local(r, 3, port), opts).unwrap());
                    let x = Exchange::new(pg.clone(), "job1");
                    let got = x.gather(&[r as u8; 3]).unwrap();
                    let b = x.broadcast(x.is_root().then_some(&b"written"[..])).unwrap();
                    assert_eq!(b, b"written");
                    // Rank 2 fails before the second gather.
                    let second = if r == 2 {
                        let e = crate::error::input_error("bad row 3");
                        x.fail(&e);
                        Err(e)
                    } else {
                        x.gather(b"again")
                    };
                    let second = second.map(|_| ()).map_err(as_local);
                    pg.finish_shared().unwrap();
                    (got, second)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(
            results[0].0.as_ref().unwrap(),
            &vec![vec![0u8; 3], vec![1; 3], vec![2; 3]]
        );
        assert!(results[1].0.is_none() && results[2].0.is_none());
        // Rank 1 handed its part over; rank 0 stopped at rank 2's failure, as an input error.
        assert!(results[1].1.is_ok());
        let e = results[0].1.as_ref().unwrap_err();
        assert!(is_input_error(e), "{e:#}");
        assert_eq!(format!("{e:#}"), "rank 2: bad row 3");
    }

    /// `watch_others` gives up when told to, and returns another rank's failure (not its
    /// own) once that rank marks the job failed.
    #[test]
    fn watch_others_sees_another_ranks_failure() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let opts = Options::in_process(std::time::Duration::from_secs(20));
        let handles: Vec<_> = (0..2)
            .map(|r| {
                std::thread::spawn(move || {
                    let pg = Arc::new(ProcessGroup::new(World::local(r, 2, port), opts).unwrap());
                    let x = Exchange::new(pg.clone(), "job7");
                    let seen = if r == 0 {
                        // Nothing failed yet: a watch that is told to stop returns None.
                        assert!(x.watch_others(&|| true).unwrap().is_none());
                        x.broadcast(Some(b"go")).unwrap();
                        // Its own failure is not another rank's.
                        x.fail(&anyhow!("mine"));
                        x.watch_others(&|| false).unwrap()
                    } else {
                        // Rank 1 fails once rank 0 has watched in vain.
                        x.broadcast(None).unwrap();
                        x.fail(&crate::error::input_error("bad row 1"));
                        None
                    };
                    pg.finish_shared().unwrap();
                    seen
                })
            })
            .collect();
        let seen: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let f = seen[0].as_ref().expect("rank 0 saw rank 1's failure");
        assert_eq!((f.rank, f.input), (1, true));
        assert_eq!(f.to_string(), "rank 1: bad row 1");
    }
}
