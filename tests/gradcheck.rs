//! Finite-difference checks of every backward op of the CPU backend, through the `Backend`
//! trait: for a random upstream gradient r, the op's backward must equal the central
//! difference of L = Σ r·forward(inputs) with respect to every input element.

use tandem::backend::check::{randn, scaled_max_diff};
use tandem::backend::cpu::Cpu;
use tandem::backend::prelude::*;

const EPS: f32 = 1e-2;
const TOL: f64 = 2e-3;

/// Compares `analytic[i]` with central differences of `loss` over every element of
/// `inputs[i]`.
fn check(op: &str, inputs: &[Vec<f32>], analytic: &[Vec<f32>], loss: &dyn Fn(&[Vec<f32>]) -> f64) {
    for (i, an) in analytic.iter().enumerate() {
        let mut fd = vec![0.0f32; an.len()];
        let mut x = inputs.to_vec();
        for j in 0..an.len() {
            let orig = x[i][j];
            x[i][j] = orig + EPS;
            let lp = loss(&x);
            x[i][j] = orig - EPS;
            let lm = loss(&x);
            x[i][j] = orig;
            fd[j] = ((lp - lm) / (2.0 * EPS as f64)) as f32;
        }
        let d = scaled_max_diff(an, &fd);
        assert!(
            d < TOL,
            "{op}: gradient of input {i} differs from finite differences by {d:e}\nanalytic {an:?}\nfd       {fd:?}"
        );
        assert!(
            an.iter().any(|&v| v.abs() > 1e-3),
            "{op}: input {i} has a vanishing gradient"
        );
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

#[test]
fn matmul_backward() {
    let b = Cpu;
    let (m, k, n) = (5, 7, 6);
    let inputs = vec![randn(m * k, 1), randn(n * k, 2), randn(n, 3)];
    let r = randn(m * n, 4);
    let fwd = |x: &[Vec<f32>]| {
        let mut y = vec![0.0; m * n];
        b.matmul(
            &mut y,
            &x[0],
            &x[1],
            Some(&x[2]),
            MatmulShape { m, k, n },
            false,
        )
        .unwrap();
        dot(&y, &r)
    };
    let (mut dx, mut dw, mut db) = (vec![0.0; m * k], vec![0.0; n * k], vec![0.0; n]);
    b.matmul_backward_x(&mut dx, &r, &inputs[1], MatmulShape { m, k, n }, false)
        .unwrap();
    b.matmul_backward_w(
        &mut dw,
        Some(&mut db),
        &r,
        &inputs[0],
        MatmulShape { m, k, n },
    )
    .unwrap();
    check("matmul", &inputs, &[dx, dw, db], &fwd);
}

#[test]
fn embedding_backward() {
    let b = Cpu;
    let (v, d) = (5, 3);
    let ids = vec![4u32, 1, 4, 0];
    let inputs = vec![randn(v * d, 5)];
    let r = randn(ids.len() * d, 6);
    let fwd = |x: &[Vec<f32>]| {
        let mut y = vec![0.0; ids.len() * d];
        b.embedding(&mut y, &x[0], &ids, ids.len(), d).unwrap();
        dot(&y, &r)
    };
    let mut dt = vec![0.0; v * d];
    b.embedding_backward(&mut dt, &r, &ids, ids.len(), d)
        .unwrap();
    check("embedding", &inputs, &[dt], &fwd);
}

#[test]
fn rmsnorm_backward_and_accumulate() {
    let b = Cpu;
    let (rows, d) = (4, 6);
    let s = RmsNormShape {
        rows,
        dim: d,
        eps: 1e-5,
    };
    let inputs = vec![randn(rows * d, 7), randn(d, 8)];
    let r = randn(rows * d, 9);
    let fwd = |x: &[Vec<f32>]| {
        let (mut y, mut rs) = (vec![0.0; rows * d], vec![0.0; rows]);
        b.rmsnorm(&mut y, &mut rs, &x[0], &x[1], s).unwrap();
        dot(&y, &r)
    };
    let (mut y, mut rstd) = (vec![0.0; rows * d], vec![0.0; rows]);
    b.rmsnorm(&mut y, &mut rstd, &inputs[0], &inputs[1], s)
        .unwrap();
    let saved = RmsNormSaved {
        x: &inputs[0],
        w: &inputs[1],
        rstd: &rstd,
    };
    let (mut dx, mut dw) = (vec![0.0; rows * d], vec![0.0; d]);
    b.rmsnorm_backward(&mut dx, &mut dw, &r, saved, s, false)
        .unwrap();
    check("rmsnorm", &inputs, &[dx.clone(), dw.clone()], &fwd);
    // accumulate = true adds onto dx; dw always accumulates.
    let mut dx2 = vec![1.0; rows * d];
    b.rmsnorm_backward(&mut dx2, &mut dw, &r, saved, s, true)
        .unwrap();
    for i in 0..dx.len() {
        assert!((dx2[i] - (dx[i] + 1.0)).abs() < 1e-6);
    }
}

#[test]
fn rope_backward() {
    let b = Cpu;
    let (t, h, hd) = (3, 2, 8);
    let pos = vec![0u32, 5, 17];
    let inputs = vec![randn(t * h * hd, 10)];
    let r = randn(t * h * hd, 11);
    let fwd = |x: &[Vec<f32>]| {
        let mut y = x[0].clone();
        b.rope(
            &mut y,
            &pos,
            RopeShape {
                tokens: t,
                heads: h,
                head_dim: hd,
                theta: 10000.0,
            },
        )
        .unwrap();
        dot(&y, &r)
    };
    let mut dx = r.clone();
    b.rope_backward(
        &mut dx,
        &pos,
        RopeShape {
            tokens: t,
            heads: h,
            head_dim: hd,
            theta: 10000.0,
        },
    )
    .unwrap();
    check("rope", &inputs, &[dx], &fwd);
}

#[test]
fn attention_backward_packed_gqa() {
    let b = Cpu;
    // Two packed sequences of lengths 3 and 4; 4 query heads share 2 kv heads.
    let s = AttnShape {
        tokens: 7,
        seqs: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
    };
    let cu = vec![0u32, 3, 7];
    let (qn, kn) = (
        s.tokens * s.heads * s.head_dim,
        s.tokens * s.kv_heads * s.head_dim,
    );
    let inputs = vec![randn(qn, 12), randn(kn, 13), randn(kn, 14)];
    let r = randn(qn, 15);
    let run = |x: &[Vec<f32>]| {
        let (mut o, mut lse) = (vec![0.0; qn], vec![0.0; s.tokens * s.heads]);
        b.attention(
            AttnOut {
                o: &mut o,
                lse: &mut lse,
            },
            Qkv {
                q: &x[0],
                k: &x[1],
                v: &x[2],
            },
            &cu,
            s,
        )
        .unwrap();
        (o, lse)
    };
    let fwd = |x: &[Vec<f32>]| dot(&run(x).0, &r);
    let (o, lse) = run(&inputs);
    let (mut dq, mut dk, mut dv) = (vec![9.0; qn], vec![9.0; kn], vec![9.0; kn]);
    b.attention_backward(
        Qkv {
            q: &mut dq,
            k: &mut dk,
            v: &mut dv,
        },
        &r,
        Qkv {
            q: &inputs[0],
            k: &inputs[1],
            v: &inputs[2],
        },
        AttnOut { o: &o, lse: &lse },
        &cu,
        s,
    )
    .unwrap();
    check("attention", &inputs, &[dq, dk, dv], &fwd);
}

#[test]
fn swiglu_backward() {
    let b = Cpu;
    let n = 9;
    let inputs = vec![randn(n, 16), randn(n, 17)];
    let r = randn(n, 18);
    let fwd = |x: &[Vec<f32>]| {
        let mut h = vec![0.0; n];
        b.swiglu(&mut h, &x[0], &x[1], n).unwrap();
        dot(&h, &r)
    };
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    b.swiglu_backward(&mut dg, &mut du, &r, &inputs[0], &inputs[1], n)
        .unwrap();
    check("swiglu", &inputs, &[dg, du], &fwd);
}

fn logprob_case(with_entropy_grad: bool) {
    let b = Cpu;
    // 5 rows in chunks of 2 (the last chunk is short), temperature 0.7.
    let s = LogprobShape {
        rows: 5,
        hidden: 4,
        vocab: 11,
        temperature: 0.7,
        chunk: 2,
    };
    let targets = vec![3u32, 0, 10, 7, 3];
    let inputs = vec![randn(s.rows * s.hidden, 19), randn(s.vocab * s.hidden, 20)];
    let (a, c) = (randn(s.rows, 21), randn(s.rows, 22));
    let run = |x: &[Vec<f32>]| {
        let (mut lp, mut ent, mut lse) = (vec![0.0; 5], vec![0.0; 5], vec![0.0; 5]);
        let mut scratch = vec![0.0; s.chunk * s.vocab];
        b.logprob(
            &mut lp,
            Some(&mut ent),
            &mut lse,
            LogprobInput {
                x: &x[0],
                w: &x[1],
                targets: &targets,
            },
            s,
            &mut scratch,
        )
        .unwrap();
        (lp, ent, lse)
    };
    let fwd = |x: &[Vec<f32>]| {
        let (lp, ent, _) = run(x);
        dot(&lp, &a)
            + if with_entropy_grad {
                dot(&ent, &c)
            } else {
                0.0
            }
    };
    let (_, ent, lse) = run(&inputs);
    let mut dx = vec![5.0; s.rows * s.hidden];
    let mut dw = vec![0.0; s.vocab * s.hidden];
    let mut scratch = vec![0.0; s.chunk * s.vocab];
    let dent = with_entropy_grad.then_some(&c);
    b.logprob_backward(
        &mut dx,
        Some(&mut dw),
        LogprobInput {
            x: &inputs[0],
            w: &inputs[1],
            targets: &targets,
        },
        LogprobGrad {
            dlp: &a,
            dent,
            lse: &lse,
            ent: &ent,
        },
        s,
        &mut scratch,
    )
    .unwrap();
    check("logprob", &inputs, &[dx, dw], &fwd);
}

#[test]
fn logprob_backward_with_entropy() {
    logprob_case(true);
}

#[test]
fn logprob_backward_without_entropy() {
    logprob_case(false);
}
