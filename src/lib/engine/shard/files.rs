//! The optimizer shard files of a checkpoint written by N > 1 ranks: each rank's part of the
//! f32 masters and Adam's moments, bucket by bucket, as `optimizer.rankRRRRR-of-NNNNN.safetensors`
//! ([`shard_file_name`]), with its rank, step and bucket layout in the metadata. A set of them
//! loads with any number of ranks and any layout ([`ShardSet::reshard`]) or as the whole state
//! ([`ShardSet::whole`]). What a checkpoint's trainer state says about them (how many, at
//! which step) is read by `crate::engine::resume`, which builds on this file.

use super::{Buckets, HostShard, ShardLayout};
use crate::error::input_error;
use crate::model::decoder::OptimizerState;
use crate::model::safetensors::{self as st, PartialFile};
use crate::model::Weights;
use anyhow::Result;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Tensor name prefixes of the optimizer files (shards and `optimizer.safetensors`).
pub(crate) const EXP_AVG: &str = "exp_avg.";
pub(crate) const EXP_AVG_SQ: &str = "exp_avg_sq.";
pub(crate) const MASTER: &str = "master.";

/// The file of rank `rank`'s optimizer shard in a checkpoint written by `world` ranks.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer.rank{rank:05}-of-{world:05}.safetensors")
}

const SHARD_META: &str = "tandem_optimizer_shard";

/// A view of f32 data as the file's bytes (safetensors is little-endian, as every target we
/// build for), borrowed: no copy is made.
pub(crate) fn f32_view(data: &[f32], shape: Vec<usize>) -> Result<TensorView<'_>> {
    const _: () = assert!(cfg!(target_endian = "little"));
    Ok(TensorView::new(
        Dtype::F32,
        shape,
        bytemuck::cast_slice(data),
    )?)
}

/// A shard file's metadata.
#[derive(Serialize, Deserialize)]
struct ShardHead {
    rank: usize,
    world_size: usize,
    optimizer_step: u64,
    layout: ShardLayout,
}

/// Writes `shard` into `dir` under its name: its masters and moments bucket by bucket (1-D
/// f32, `master.K`, `exp_avg.K`, `exp_avg_sq.K`), with the rank, the step and the layout in the
/// metadata; streamed from its buffers (a temporary file renamed into place, as the model
/// files; the checkpoint directory is moved into place whole).
pub fn write_shard(dir: &Path, shard: &HostShard) -> Result<()> {
    let mut groups: Vec<(&str, &[Vec<f32>])> = vec![(MASTER, &shard.master)];
    if let Some((m, v)) = &shard.moments {
        groups.push((EXP_AVG, m));
        groups.push((EXP_AVG_SQ, v));
    }
    let mut views: Vec<(String, TensorView)> = Vec::new();
    for (prefix, bufs) in groups {
        for (k, b) in bufs.iter().enumerate() {
            views.push((format!("{prefix}{k:05}"), f32_view(b, vec![b.len()])?));
        }
    }
    // One metadata entry: a map of several would be written in a random order, and the same
    // shard must give the same bytes.
    let head = ShardHead {
        rank: shard.rank,
        world_size: shard.layout.world_size,
        optimizer_step: shard.step,
        layout: shard.layout.clone(),
    };
    let meta = HashMap::from([(SHARD_META.to_string(), serde_json::to_string(&head)?)]);
    let path = dir.join(shard_file_name(shard.rank, shard.layout.world_size));
    st::write_file(&path, views, Some(meta))
}

/// Reads one shard file.
pub(crate) fn read_shard(path: &Path) -> Result<HostShard> {
    let (head, mut file, moments) = open_shard(path)?;
    let mut read = |prefix: &str| -> Result<Buckets> {
        let mut out = Vec::with_capacity(head.layout.buckets.len());
        for (k, b) in head.layout.buckets.iter().enumerate() {
            out.push(file.read_f32(&format!("{prefix}{k:05}"), 0, b.4)?);
        }
        Ok(out)
    };
    let master = read(MASTER)?;
    let moments = match moments {
        true => Some((read(EXP_AVG)?, read(EXP_AVG_SQ)?)),
        false => None,
    };
    Ok(HostShard {
        rank: head.rank,
        step: head.optimizer_step,
        layout: head.layout,
        master,
        moments,
    })
}

/// A shard file's header, checked against its tensors (every bucket's f32 master shard, and
/// its moments unless at step 0), with the file open to read any part of its buckets; true
/// when it holds the moments.
fn open_shard(path: &Path) -> Result<(ShardHead, PartialFile, bool)> {
    let file = PartialFile::open(path)?;
    let bad = |what: &str| {
        input_error(format!(
            "{}: not an optimizer shard: {what}",
            path.display()
        ))
    };
    let head: ShardHead = file
        .meta
        .get(SHARD_META)
        .and_then(|h| serde_json::from_str(h).ok())
        .ok_or_else(|| bad(&format!("metadata '{SHARD_META}' missing or malformed")))?;
    if head.world_size != head.layout.world_size {
        return Err(bad("its world size is not its layout's"));
    }
    let buckets = head.layout.buckets.len();
    let mut seen = [
        vec![false; buckets],
        vec![false; buckets],
        vec![false; buckets],
    ];
    for (name, dtype, shape) in file.tensors() {
        let (g, k) = [(0, MASTER), (1, EXP_AVG), (2, EXP_AVG_SQ)]
            .iter()
            .find_map(|&(g, p)| Some((g, name.strip_prefix(p)?.parse::<usize>().ok()?)))
            .ok_or_else(|| bad(&format!("unexpected tensor '{name}'")))?;
        if dtype != Dtype::F32
            || k >= buckets
            || shape.iter().product::<usize>() != head.layout.buckets[k].4
        {
            return Err(bad(&format!(
                "tensor '{name}' is not the layout's f32 shard"
            )));
        }
        seen[g][k] = true;
    }
    let [master, m, v] = seen.map(|g| g.iter().all(|&x| x));
    if !master {
        return Err(bad("a master bucket is missing"));
    }
    let moments = match (m, v) {
        (true, true) => true,
        _ if head.optimizer_step == 0 => false,
        _ => return Err(bad("a moment bucket is missing")),
    };
    Ok((head, file, moments))
}

/// The file of rank `rank`'s optimizer shard of the `n` in checkpoint `dir`; an input error
/// naming it when it is missing.
pub(crate) fn shard_path(dir: &Path, rank: usize, n: usize) -> Result<PathBuf> {
    let path = dir.join(shard_file_name(rank, n));
    if !path.is_file() {
        crate::bail_input!(
            "{}: the checkpoint is incomplete: {} (rank {rank}'s optimizer shard of {n}) is missing; continue from a complete checkpoint, or from the model files without optimizer state",
            dir.display(),
            path.display()
        );
    }
    Ok(path)
}

/// The shard files of one sharded checkpoint, as its trainer state describes them.
pub(crate) struct ShardSet<'a> {
    /// The checkpoint directory.
    pub(crate) dir: &'a Path,
    /// How many ranks wrote it (one file each).
    pub(crate) n: usize,
    /// The optimizer step every shard must be at.
    pub(crate) step: u64,
    /// The file that says so (named in errors).
    pub(crate) told_by: &'a Path,
}

impl ShardSet<'_> {
    /// The whole masters and optimizer state put back together from every rank's shard file
    /// (for checks and `tandem merge-shards`: `update` itself never gathers them). Every shard
    /// must be there, at the optimizer step [`ShardSet::step`].
    pub fn whole(&self) -> Result<(Weights, OptimizerState)> {
        let n = self.n;
        let paths: Vec<_> = (0..n)
            .map(|r| shard_path(self.dir, r, n))
            .collect::<Result<_>>()?;
        let shards: Vec<HostShard> = paths.iter().map(|p| read_shard(p)).collect::<Result<_>>()?;
        if let Some(s) = shards.iter().find(|s| s.step != self.step) {
            crate::bail_input!(
                "{}: a shard is at optimizer step {}, {} says {}",
                self.dir.display(),
                s.step,
                self.told_by.display(),
                self.step
            );
        }
        let layout = &shards[0].layout;
        let part = |f: &dyn Fn(&HostShard) -> Option<&[Vec<f32>]>| -> Result<Weights> {
            let parts: Vec<&[Vec<f32>]> = shards
                .iter()
                .map(|s| {
                    f(s).ok_or_else(|| {
                        input_error(format!("{}: a shard has no moments", self.dir.display()))
                    })
                })
                .collect::<Result<_>>()?;
            layout.unflatten(&parts)
        };
        let master = part(&|s| Some(&s.master[..]))?;
        let state = OptimizerState {
            step: shards[0].step,
            exp_avg: part(&|s| s.moments.as_ref().map(|m| &m.0[..]))?,
            exp_avg_sq: part(&|s| s.moments.as_ref().map(|m| &m.1[..]))?,
        };
        Ok((master, state))
    }

    /// Rank `rank`'s shard in `layout` (its world size, shard mode and buckets) of the optimizer
    /// state of the sharded checkpoint, written with another layout (another number of ranks,
    /// `--shard` mode or `--bucket-elems`): each tensor's elements are copied from where the
    /// checkpoint's buckets hold them to where `layout` puts this rank's part of them. Of each
    /// shard file only the span of each bucket that holds this rank's elements is read (about 1/M
    /// of the state at M ranks), and a rank holds only its own shard.
    pub(crate) fn reshard(&self, layout: &ShardLayout, rank: usize) -> Result<HostShard> {
        let (dir, n) = (self.dir, self.n);
        // Where each tensor starts in `layout`: its bucket and offset there.
        let mut place = vec![(0usize, 0usize); layout.names.len()];
        for (k, (first, end, offsets, _, _)) in layout.buckets.iter().enumerate() {
            for (t, &off) in (*first..*end).zip(offsets) {
                place[t] = (k, off);
            }
        }
        let zeros = || -> Buckets { layout.buckets.iter().map(|b| vec![0.0; b.4]).collect() };
        let mut master = zeros();
        let mut moments: Option<(Buckets, Buckets)> = None;
        for q in 0..n {
            let path = shard_path(dir, q, n)?;
            let (old, mut file, has_moments) = open_shard(&path)?;
            if old.rank != q || old.layout.world_size != n || old.optimizer_step != self.step {
                crate::bail_input!(
                    "{}: is rank {} of {} at optimizer step {}, expected rank {q} of {n} at step {} ({})",
                    path.display(),
                    old.rank,
                    old.layout.world_size,
                    old.optimizer_step,
                    self.step,
                    self.told_by.display()
                );
            }
            if old.layout.names != layout.names || old.layout.shapes != layout.shapes {
                crate::bail_input!(
                    "{}: holds the optimizer state of another model (its tensors' names or shapes are not this model's)",
                    path.display()
                );
            }
            match (has_moments, q) {
                (true, 0) => moments = Some((zeros(), zeros())),
                (false, 0) => {}
                (m, _) if m != moments.is_some() => crate::bail_input!(
                    "{}: has {} moments where rank 0's shard has {}",
                    path.display(),
                    if m { "" } else { "no" },
                    if moments.is_some() { "them" } else { "none" }
                ),
                _ => {}
            }
            for (k, (first, end, offsets, _, slen)) in old.layout.buckets.iter().enumerate() {
                // This file holds elements [lo, lo + slen) of old bucket k; the pieces of it in
                // this rank's part of `layout`: (element of the file's bucket, bucket there,
                // element there, length).
                let lo = q * slen;
                let mut pieces = Vec::new();
                for (t, &off) in (*first..*end).zip(offsets) {
                    let numel: usize = layout.shapes[t].iter().product();
                    let (a, b) = (lo.max(off), (lo + slen).min(off + numel));
                    if a >= b {
                        continue;
                    }
                    // The same tensor elements [a - off, b - off) in this rank's part of `layout`.
                    let (k2, off2) = place[t];
                    let s2 = layout.buckets[k2].4;
                    let lo2 = rank * s2;
                    let (a2, b2) = ((off2 + a - off).max(lo2), (off2 + b - off).min(lo2 + s2));
                    if a2 >= b2 {
                        continue;
                    }
                    pieces.push((off + (a2 - off2) - lo, k2, a2 - lo2, b2 - a2));
                }
                // Only the span of the file's bucket that holds the pieces is read.
                let (Some(from), Some(to)) = (
                    pieces.iter().map(|p| p.0).min(),
                    pieces.iter().map(|p| p.0 + p.3).max(),
                ) else {
                    continue;
                };
                let mut read =
                    |prefix: &str| file.read_f32(&format!("{prefix}{k:05}"), from, to - from);
                let put = |dst: &mut Buckets, src: &[f32]| {
                    for &(s, k2, d, len) in &pieces {
                        dst[k2][d..d + len].copy_from_slice(&src[s - from..s - from + len]);
                    }
                };
                put(&mut master, &read(MASTER)?);
                if let Some((m, v)) = moments.as_mut() {
                    put(m, &read(EXP_AVG)?);
                    put(v, &read(EXP_AVG_SQ)?);
                }
            }
        }
        Ok(HostShard {
            rank,
            layout: layout.clone(),
            step: self.step,
            master,
            moments,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> ShardLayout {
        ShardLayout {
            world_size: 2,
            names: vec!["a".into(), "b".into()],
            shapes: vec![vec![3], vec![1]],
            buckets: vec![(0, 2, vec![0, 3], 4, 2)],
        }
    }

    /// A shard reads back as written, at step 0 without moments; a file that is not a shard,
    /// or a shard missing a bucket, is refused naming the file and what is wrong.
    #[test]
    fn shard_files_read_back_and_refuse_what_they_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut shard = HostShard {
            rank: 1,
            layout: layout(),
            step: 0,
            master: vec![vec![0.25, -1.5]],
            moments: None,
        };
        write_shard(dir.path(), &shard).unwrap();
        let path = dir.path().join(shard_file_name(1, 2));
        assert_eq!(
            path.file_name().unwrap(),
            "optimizer.rank00001-of-00002.safetensors"
        );
        assert_eq!(read_shard(&path).unwrap(), shard);
        shard.step = 3;
        shard.moments = Some((vec![vec![0.1, 0.2]], vec![vec![0.01, 0.02]]));
        write_shard(dir.path(), &shard).unwrap();
        assert_eq!(read_shard(&path).unwrap(), shard);
        // Past step 0 the moments must be there.
        let other = tempfile::tempdir().unwrap();
        st::write_file(
            &other.path().join("x.safetensors"),
            vec![(
                "master.00000".to_string(),
                f32_view(&[1.0, 2.0], vec![2]).unwrap(),
            )],
            Some(HashMap::from([(
                SHARD_META.to_string(),
                serde_json::to_string(&ShardHead {
                    rank: 0,
                    world_size: 2,
                    optimizer_step: 3,
                    layout: layout(),
                })
                .unwrap(),
            )])),
        )
        .unwrap();
        let err = read_shard(&other.path().join("x.safetensors")).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .ends_with("not an optimizer shard: a moment bucket is missing"),
            "{err}"
        );
        // A safetensors file without the shard metadata.
        let plain = other.path().join("plain.safetensors");
        st::write_file(
            &plain,
            vec![("w".to_string(), f32_view(&[1.0], vec![1]).unwrap())],
            None,
        )
        .unwrap();
        let err = read_shard(&plain).unwrap_err();
        assert!(
            err.to_string()
                .contains("metadata 'tandem_optimizer_shard' missing"),
            "{err}"
        );
        // A missing rank's file names the rank.
        let err = shard_path(dir.path(), 0, 2).unwrap_err();
        assert!(crate::error::is_input_error(&err));
        assert!(
            err.to_string()
                .contains("rank 0's optimizer shard of 2) is missing"),
            "{err}"
        );
        assert_eq!(shard_path(dir.path(), 1, 2).unwrap(), path);
    }
}
