//! The memory ops on the CPU (the reference of `memory.cu`).

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::{KvCache, MemoryOps};
use crate::backend::cpu::{get, get_mut, Cpu, ELEMWISE_GRAIN};

/// cache[rows[i], :] = x[i, :] (rows of `row_dim` floats).
pub fn kv_store(cache: &mut [f32], x: &[f32], rows: &[u32], row_dim: usize) -> Result<()> {
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        if (r + 1) * row_dim > cache.len() {
            bail!(
                "kv_store: cache row {r} is outside the cache ({} rows)",
                cache.len() / row_dim.max(1)
            );
        }
        cache[r * row_dim..(r + 1) * row_dim].copy_from_slice(&x[i * row_dim..(i + 1) * row_dim]);
    }
    Ok(())
}

impl MemoryOps for Cpu {
    fn add_assign(&self, y: &mut Vec<f32>, x: &Vec<f32>, n: usize) -> Result<()> {
        let x = get(x, n, "x")?;
        get_mut(y, n, "y")?
            .par_chunks_mut(ELEMWISE_GRAIN)
            .zip(x.par_chunks(ELEMWISE_GRAIN))
            .for_each(|(y, x)| y.iter_mut().zip(x).for_each(|(y, x)| *y += x));
        Ok(())
    }

    fn gather_rows(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "gather rows")?;
        let out = get_mut(out, n * dim, "gather out")?;
        if let Some(&r) = rows.iter().find(|&&r| (r as usize + 1) * dim > x.len()) {
            bail!(
                "cpu backend: gather row {r} outside a buffer of {} floats",
                x.len()
            );
        }
        out.par_chunks_mut(dim.max(1))
            .zip(rows.par_iter())
            .for_each(|(o, &r)| o.copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]));
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        dx: &mut Vec<f32>,
        dout: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "scatter rows")?;
        let dout = get(dout, n * dim, "scatter dout")?;
        // Serial: rows may repeat in general, and this is a memory-bound copy of n·dim floats.
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            if (r + 1) * dim > dx.len() {
                bail!(
                    "cpu backend: scatter row {r} outside a buffer of {} floats",
                    dx.len()
                );
            }
            dx[r * dim..(r + 1) * dim]
                .iter_mut()
                .zip(&dout[i * dim..(i + 1) * dim])
                .for_each(|(d, g)| *d += g);
        }
        Ok(())
    }

    fn kv_store(
        &self,
        cache: KvCache<&mut Vec<f32>>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: &Vec<u32>,
        n: usize,
        row_dim: usize,
    ) -> Result<()> {
        let rows = get(rows, n, "kv_store rows")?;
        kv_store(cache.k, get(k, n * row_dim, "kv_store k")?, rows, row_dim)?;
        kv_store(cache.v, get(v, n * row_dim, "kv_store v")?, rows, row_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_assign_adds_only_the_prefix() {
        let mut y = vec![1.0, 2.0, 3.0, 4.0];
        Cpu.add_assign(&mut y, &vec![10.0, 20.0, 30.0, 40.0], 3)
            .unwrap();
        assert_eq!(y, [11.0, 22.0, 33.0, 4.0]);
        assert!(Cpu.add_assign(&mut y, &vec![1.0], 2).is_err());
    }

    #[test]
    fn gather_then_scatter_by_hand() {
        // x: 3 rows of 2.
        let x = vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let mut out = vec![0.0; 4];
        Cpu.gather_rows(&mut out, &x, &vec![2, 0], 2, 2).unwrap();
        assert_eq!(out, [20.0, 21.0, 0.0, 1.0]);
        let mut dx = vec![1.0; 6];
        Cpu.scatter_add_rows(&mut dx, &vec![5.0, 6.0, 7.0, 8.0], &vec![1, 2], 2, 2)
            .unwrap();
        assert_eq!(dx, [1.0, 1.0, 6.0, 7.0, 8.0, 9.0]);
        let err = Cpu
            .gather_rows(&mut out, &x, &vec![3, 0], 2, 2)
            .unwrap_err();
        assert!(err.to_string().contains("gather row 3"), "{err}");
        let err = Cpu
            .scatter_add_rows(&mut dx, &vec![0.0; 2], &vec![3], 1, 2)
            .unwrap_err();
        assert!(err.to_string().contains("scatter row 3"), "{err}");
    }

    #[test]
    fn kv_store_writes_its_rows_and_refuses_rows_past_the_cache() {
        let (mut kc, mut vc) = (vec![0.0; 6], vec![0.0; 6]);
        Cpu.kv_store(
            KvCache {
                k: &mut kc,
                v: &mut vc,
            },
            &vec![1.0, 2.0, 3.0, 4.0],
            &vec![5.0, 6.0, 7.0, 8.0],
            &vec![2, 0],
            2,
            2,
        )
        .unwrap();
        assert_eq!(kc, [3.0, 4.0, 0.0, 0.0, 1.0, 2.0]);
        assert_eq!(vc, [7.0, 8.0, 0.0, 0.0, 5.0, 6.0]);
        let err = Cpu
            .kv_store(
                KvCache {
                    k: &mut kc,
                    v: &mut vc,
                },
                &vec![0.0; 2],
                &vec![0.0; 2],
                &vec![3],
                1,
                2,
            )
            .unwrap_err();
        assert!(err.to_string().contains("cache row 3"), "{err}");
    }
}
