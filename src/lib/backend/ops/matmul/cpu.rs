//! Linear layers: y = x·wᵀ + b with w in the HF `[out, in]` layout, and its two backward GEMMs.
//! The GEMMs are the `gemm` crate's (runtime-dispatched SIMD, rayon threads): measured on the
//! dev machine it beats `matrixmultiply` by 5-20x at the small row counts of decoding
//! (it does not pack a matrix-vector product) and is within noise of it for long prompts.

use anyhow::Result;
use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::{MatmulOps, MatmulShape};
use crate::backend::cpu::{get, get_mut, Cpu};

fn par() -> Parallelism {
    Parallelism::Rayon(rayon::current_num_threads())
}

/// y[m,n] (= or +=) x[m,k] · w[n,k]ᵀ + b[n].
pub fn forward(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    s: MatmulShape,
    accumulate: bool,
) {
    let MatmulShape { m, k, n } = s;
    assert!(y.len() == m * n && x.len() == m * k && w.len() == n * k);
    if m == 0 || n == 0 {
        return;
    }
    // The bias goes into y first so the GEMM can accumulate on top of it.
    let mut read_dst = accumulate;
    if let Some(b) = b {
        y.par_chunks_mut(n).for_each(|row| {
            if accumulate {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            } else {
                row.copy_from_slice(b);
            }
        });
        read_dst = true;
    }
    if k == 0 {
        if !read_dst {
            y.fill(0.0);
        }
        return;
    }
    let rows = invariant_rows(m, n);
    if rows > m {
        // Padded with zero rows into the kernel the larger calls run (see `invariant_rows`).
        let mut xp = x.to_vec();
        xp.resize(rows * k, 0.0);
        let mut yp = y.to_vec();
        yp.resize(rows * n, 0.0);
        gemm_forward(&mut yp, &xp, w, MatmulShape { m: rows, k, n }, read_dst);
        y.copy_from_slice(&yp[..m * n]);
        return;
    }
    gemm_forward(y, x, w, s, read_dst);
}

/// The rows a forward GEMM of `m` rows and `n` outputs runs with, so that each row's result
/// does not depend on how many rows came with it (batch invariance: a decode step's rows equal
/// the same rows in a training pass, bit for bit). The `gemm` crate runs one packed kernel for
/// every m ≥ 2 with m·n > 256, but a matrix-vector product (m = 1) and small products by other
/// kernels whose sums round differently; those calls are padded with zero rows up to the
/// packed kernel's size. (n = 1, a value head, has its own kernel at every m: left as it is.)
fn invariant_rows(m: usize, n: usize) -> usize {
    match n {
        0 | 1 => m,
        _ => m.max(2).max(256 / n + 1),
    }
}

/// y[m,n] (= or += when `read_dst`) x[m,k] · w[n,k]ᵀ through the `gemm` crate.
fn gemm_forward(y: &mut [f32], x: &[f32], w: &[f32], s: MatmulShape, read_dst: bool) {
    let MatmulShape { m, k, n } = s;
    assert!(y.len() == m * n && x.len() == m * k && w.len() == n * k);
    // SAFETY: the strides describe x as [m,k] row-major, wᵀ as a [k,n] view of w [n,k], and
    // y as [m,n] row-major; the assert above guarantees the lengths.
    unsafe {
        gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            read_dst,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            par(),
        );
    }
}

/// dx[m,k] (= or +=) dy[m,n] · w[n,k].
pub(crate) fn backward_x(dx: &mut [f32], dy: &[f32], w: &[f32], s: MatmulShape, accumulate: bool) {
    let MatmulShape { m, k, n } = s;
    assert!(dx.len() == m * k && dy.len() == m * n && w.len() == n * k);
    if m == 0 || k == 0 {
        return;
    }
    if n == 0 {
        if !accumulate {
            dx.fill(0.0);
        }
        return;
    }
    // SAFETY: dy [m,n], w [n,k], dx [m,k], all row-major and of the asserted lengths.
    unsafe {
        gemm(
            m,
            k,
            n,
            dx.as_mut_ptr(),
            1,
            k as isize,
            accumulate,
            dy.as_ptr(),
            1,
            n as isize,
            w.as_ptr(),
            1,
            k as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par(),
        );
    }
}

/// dw[n,k] += dy[m,n]ᵀ · x[m,k];  db[n] += Σ_m dy[m,n].
pub(crate) fn backward_w(
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    s: MatmulShape,
) {
    let MatmulShape { m, k, n } = s;
    assert!(dw.len() == n * k && dy.len() == m * n && x.len() == m * k);
    if let Some(db) = db {
        // Column blocks in parallel, rows in order: each task owns its slice of db.
        const BLOCK: usize = 256;
        db.par_chunks_mut(BLOCK).enumerate().for_each(|(bi, dbb)| {
            let (j0, len) = (bi * BLOCK, dbb.len());
            for row in dy.chunks_exact(n.max(1)).take(m) {
                dbb.iter_mut()
                    .zip(&row[j0..j0 + len])
                    .for_each(|(d, g)| *d += g);
            }
        });
    }
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    // SAFETY: dyᵀ is a [n,m] view of dy [m,n] (column stride n, row stride 1); x [m,k] and
    // dw [n,k] are row-major; lengths asserted above.
    unsafe {
        gemm(
            n,
            k,
            m,
            dw.as_mut_ptr(),
            1,
            k as isize,
            true,
            dy.as_ptr(),
            n as isize,
            1,
            x.as_ptr(),
            1,
            k as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par(),
        );
    }
}

impl MatmulOps for Cpu {
    fn matmul(
        &self,
        y: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: Option<&Vec<f32>>,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        let b = match b {
            Some(b) => Some(get(b, n, "bias")?),
            None => None,
        };
        forward(
            get_mut(y, m * n, "matmul y")?,
            get(x, m * k, "matmul x")?,
            get(w, n * k, "matmul w")?,
            b,
            s,
            accumulate,
        );
        Ok(())
    }

    fn matmul_backward_x(
        &self,
        dx: &mut Vec<f32>,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        s: MatmulShape,
        accumulate: bool,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        backward_x(
            get_mut(dx, m * k, "matmul dx")?,
            get(dy, m * n, "matmul dy")?,
            get(w, n * k, "matmul w")?,
            s,
            accumulate,
        );
        Ok(())
    }

    fn matmul_backward_w(
        &self,
        dw: &mut Vec<f32>,
        db: Option<&mut Vec<f32>>,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        s: MatmulShape,
    ) -> Result<()> {
        let MatmulShape { m, k, n } = s;
        let db = match db {
            Some(db) => Some(get_mut(db, n, "matmul db")?),
            None => None,
        };
        backward_w(
            get_mut(dw, n * k, "matmul dw")?,
            db,
            get(dy, m * n, "matmul dy")?,
            get(x, m * k, "matmul x")?,
            s,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::{assert_close, randn};

    /// A row's result does not depend on the rows computed with it, bit for bit: each of the
    /// first rows of calls of 1 to 129 rows (the `gemm` crate's matrix-vector, small and packed
    /// kernels before padding) equals the same row of a 300-row call, with and without
    /// accumulation, at the shapes of a tiny model, a LoRA rank and a 0.5B layer.
    #[test]
    fn rows_are_batch_invariant() {
        for (k, n) in [(16, 16), (16, 37), (64, 300), (64, 4), (4, 64), (896, 4864)] {
            let big = 300;
            let x = randn(big * k, 1);
            let w = randn(n * k, 2);
            let y0 = randn(big * n, 3);
            for acc in [false, true] {
                let mut want = y0.clone();
                forward(&mut want, &x, &w, None, MatmulShape { m: big, k, n }, acc);
                for m in [1, 2, 3, 5, 8, 17, 40, 129] {
                    let mut got = y0[..m * n].to_vec();
                    forward(
                        &mut got,
                        &x[..m * k],
                        &w,
                        None,
                        MatmulShape { m, k, n },
                        acc,
                    );
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "k {k} n {n} m {m} accumulate {acc}");
                }
            }
        }
    }

    fn naive(x: &[f32], w: &[f32], b: Option<&[f32]>, m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = b.map_or(0.0, |b| b[j] as f64);
                for p in 0..k {
                    s += x[i * k + p] as f64 * w[j * k + p] as f64;
                }
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    #[test]
    fn forward_matches_naive_with_bias_and_accumulate() {
        let (m, k, n) = (7, 13, 5);
        let x = randn(m * k, 1);
        let w = randn(n * k, 2);
        let b = randn(n, 3);
        let mut y = vec![f32::NAN; m * n];
        forward(&mut y, &x, &w, Some(&b), MatmulShape { m, k, n }, false);
        assert_close(&y, &naive(&x, &w, Some(&b), m, k, n), 1e-5, "y");
        let y0 = randn(m * n, 4);
        let mut y2 = y0.clone();
        forward(&mut y2, &x, &w, None, MatmulShape { m, k, n }, true);
        let want: Vec<f32> = naive(&x, &w, None, m, k, n)
            .iter()
            .zip(&y0)
            .map(|(a, b)| a + b)
            .collect();
        assert_close(&y2, &want, 1e-5, "y accumulate");
    }

    #[test]
    fn backward_matches_naive() {
        let (m, k, n) = (6, 9, 11);
        let dy = randn(m * n, 5);
        let x = randn(m * k, 6);
        let w = randn(n * k, 7);
        let mut dx = vec![f32::NAN; m * k];
        backward_x(&mut dx, &dy, &w, MatmulShape { m, k, n }, false);
        // dx = dy·w, i.e. naive(dy, wᵀ) with wᵀ [k,n].
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        assert_close(&dx, &naive(&dy, &wt, None, m, n, k), 1e-5, "dx");
        let mut dw = vec![1.0; n * k];
        let mut db = vec![2.0; n];
        backward_w(&mut dw, Some(&mut db), &dy, &x, MatmulShape { m, k, n });
        let dyt: Vec<f32> = (0..n * m).map(|i| dy[(i % m) * n + i / m]).collect();
        let xt: Vec<f32> = (0..k * m).map(|i| x[(i % m) * k + i / m]).collect();
        let want: Vec<f32> = naive(&dyt, &xt, None, n, m, k)
            .iter()
            .map(|v| v + 1.0)
            .collect();
        assert_close(&dw, &want, 1e-5, "dw");
        for j in 0..n {
            let s: f32 = (0..m).map(|i| dy[i * n + j]).sum();
            assert!((db[j] - (s + 2.0)).abs() < 1e-5, "db[{j}]");
        }
    }

    #[test]
    fn residual_is_r_plus_the_product_and_sizes_are_checked() {
        let (m, k, n) = (4, 6, 3);
        let (x, w, r) = (randn(m * k, 8), randn(n * k, 9), randn(m * n, 10));
        let mut y = vec![f32::NAN; m * n];
        Cpu.matmul_residual(&mut y, &r, &x, &w, MatmulShape { m, k, n })
            .unwrap();
        let want: Vec<f32> = naive(&x, &w, None, m, k, n)
            .iter()
            .zip(&r)
            .map(|(a, b)| a + b)
            .collect();
        assert_close(&y, &want, 1e-5, "y = r + x·wᵀ");
        let err = Cpu
            .matmul(&mut y, &x, &w, None, MatmulShape { m: m + 1, k, n }, false)
            .unwrap_err();
        assert!(err.to_string().contains("matmul y holds 12"), "{err}");
    }
}
