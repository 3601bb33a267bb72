//! `tandem gpu-test --time`: each op timed alone at the Qwen2.5-0.5B training shape (one
//! micro-batch of 8 × 640 tokens, bf16 weights and activations, f32 gradients), with CUDA
//! events after warm-up, median of the runs. A big bf16 GEMM gives the measured peak that MFU
//! figures divide by. This tells where a step's time goes; `tandem bench` measures whole steps.

use anyhow::{anyhow, Result};
use cudarc::driver::sys as dsys;
use serde::Serialize;

use super::{CudaBackend, CudaBuf, CudaIdx};
use crate::backend::{AdamWStep, AttnShape, Backend, DType, LogprobShape, PagedAttnShape};

#[derive(Clone, Debug, Serialize)]
pub struct TimeRow {
    pub op: String,
    pub shape: String,
    pub ms: f64,
    /// TFLOP/s for matrix work, GB/s for memory-bound ops.
    pub rate: f64,
    pub unit: &'static str,
}

/// Uniform values in [-scale, scale): cheap to make in the millions, and never zero runs.
fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

struct Timer<'a> {
    gpu: &'a CudaBackend,
    rows: Vec<TimeRow>,
    iters: usize,
    seed: u64,
    /// Time only the ops whose name contains this (gpu-test's --only).
    only: Option<&'a str>,
}

impl<'a> Timer<'a> {
    fn buf(&mut self, n: usize, d: DType, scale: f32) -> Result<CudaBuf> {
        self.seed += 1;
        let mut b = self.gpu.alloc_as(n, d)?;
        self.gpu.upload(&mut b, &uniform(n, self.seed, scale))?;
        Ok(b)
    }

    fn idx(&self, host: &[u32]) -> Result<CudaIdx> {
        let mut b = self.gpu.alloc_idx(host.len())?;
        self.gpu.upload_idx(&mut b, host)?;
        Ok(b)
    }

    /// Median milliseconds of `f` over `iters` runs after 3 warm-up runs.
    fn time(
        &mut self,
        op: &str,
        shape: String,
        work: f64,
        unit: &'static str,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        if self.only.is_some_and(|o| !op.contains(o)) {
            return Ok(());
        }
        let ctx = self.gpu.context();
        let stream = self.gpu.stream();
        let ev = |()| ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT));
        for _ in 0..3 {
            f()?;
        }
        self.gpu.synchronize()?;
        let mut ms = Vec::with_capacity(self.iters);
        for _ in 0..self.iters {
            let (a, b) = (
                ev(()).map_err(|e| anyhow!("{e:?}"))?,
                ev(()).map_err(|e| anyhow!("{e:?}"))?,
            );
            a.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            f()?;
            b.record(stream).map_err(|e| anyhow!("{e:?}"))?;
            ms.push(a.elapsed_ms(&b).map_err(|e| anyhow!("{e:?}"))? as f64);
        }
        self.gpu.synchronize()?;
        ms.sort_by(|x, y| x.total_cmp(y));
        let med = ms[ms.len() / 2];
        let scale = if unit == "TFLOP/s" { 1e12 } else { 1e9 };
        self.rows.push(TimeRow {
            op: op.to_string(),
            shape,
            ms: med,
            rate: work / (med * 1e-3) / scale,
            unit,
        });
        Ok(())
    }

    /// Like `time`, for ops of a few microseconds: `GRAPH_REPS` calls captured as one CUDA
    /// graph and replayed, so the figure is GPU time without the host's launch gaps (as in a
    /// decode step, which replays a graph).
    fn time_graph(
        &mut self,
        op: &str,
        shape: String,
        work: f64,
        unit: &'static str,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        const GRAPH_REPS: usize = 20;
        if self.only.is_some_and(|o| !op.contains(o)) {
            return Ok(());
        }
        f()?;
        self.gpu.synchronize()?;
        let gpu = self.gpu;
        gpu.graph_begin()?;
        let captured = (0..GRAPH_REPS).try_for_each(|_| f());
        let res = gpu
            .graph_end()
            .and_then(|id| captured.map(|_| id))
            .and_then(|id| self.time(op, shape, work, unit, || gpu.graph_launch(id)));
        gpu.graph_release()?;
        res?;
        if let Some(r) = self.rows.last_mut() {
            r.ms /= GRAPH_REPS as f64;
            r.rate *= GRAPH_REPS as f64;
        }
        Ok(())
    }
}

/// The ops of one decode step at `rows` sequences of the Qwen2.5-0.5B shape (context `ctx`,
/// bf16), each timed as a graph (`Timer::time_graph`).
fn decode_rows(t: &mut Timer, rows: usize, ctx: usize) -> Result<()> {
    let gpu = t.gpu;
    let bf = DType::BF16;
    let f32t = DType::F32;
    let (hid, heads, kv, hd, ffn) = (896usize, 14usize, 2usize, 64usize, 4864usize);
    let (qd, kd) = (heads * hd, kv * hd);
    let tag = format!("{rows} rows");
    let res = t.buf(rows * hid, f32t, 1.0)?;
    let wn = t.buf(hid, bf, 1.0)?;
    let mut xn = t.buf(rows * hid, bf, 1.0)?;
    let mut rstd = t.buf(rows, f32t, 1.0)?;
    t.time_graph(
        "decode rmsnorm (f32 → bf16)",
        format!("{tag} × {hid}"),
        (rows * hid * 6) as f64,
        "GB/s",
        || gpu.rmsnorm(&mut xn, &mut rstd, &res, &wn, rows, hid, 1e-6),
    )?;
    let bs = 16usize;
    let per = ctx.div_ceil(bs);
    let blocks = rows * per;
    let qkv = t.buf(rows * (qd + 2 * kd), bf, 1.0)?;
    let mut q = t.buf(rows * qd, bf, 1.0)?;
    let mut kc = t.buf(blocks * bs * kd, bf, 1.0)?;
    let mut vc = t.buf(blocks * bs * kd, bf, 1.0)?;
    let pos = t.idx(&vec![(ctx - 1) as u32; rows])?;
    let crow: Vec<u32> = (0..rows).map(|r| (r * per * bs + ctx - 1) as u32).collect();
    let crow = t.idx(&crow)?;
    t.time_graph(
        "decode rope_store_kv_packed",
        format!("{tag}, {heads}/{kv} heads, d{hd}"),
        // Reads the q/k/v rows, writes as many bytes (q out, k and v into the cache).
        (2 * rows * (qd + 2 * kd) * 2) as f64,
        "GB/s",
        || {
            gpu.rope_store_kv_packed(
                &qkv, &mut q, &pos, &mut kc, &mut vc, &crow, rows, heads, kv, hd, 1e6,
            )
        },
    )?;
    let tables: Vec<u32> = (0..blocks as u32).collect();
    let tab = t.idx(&tables)?;
    let seq = t.idx(&(0..rows as u32).collect::<Vec<_>>())?;
    let len = t.idx(&vec![ctx as u32; rows])?;
    let mut o = t.buf(rows * qd, bf, 1.0)?;
    let shape = PagedAttnShape {
        queries: rows,
        heads,
        kv_heads: kv,
        head_dim: hd,
        block_size: bs,
        max_blocks: per,
    };
    let was = gpu.batch_invariant();
    for inv in [false, true] {
        gpu.set_batch_invariant(inv);
        t.time_graph(
            if inv {
                "decode attention_paged (invariant)"
            } else {
                "decode attention_paged"
            },
            format!("{tag}, ctx {ctx}"),
            (rows * ctx * kd * 2 * 2) as f64,
            "GB/s",
            || gpu.attention_paged(&mut o, &q, &kc, &vc, &tab, &seq, &len, shape),
        )?;
    }
    gpu.set_batch_invariant(was);
    // A decode step's attention: the rope and the cache store of the new token fused in.
    t.time_graph(
        "decode attention_paged_rope",
        format!("{tag}, ctx {ctx}"),
        (rows * ctx * kd * 2 * 2) as f64,
        "GB/s",
        || {
            gpu.attention_paged_rope(
                &mut o, &qkv, &mut q, &pos, &mut kc, &mut vc, &crow, &tab, &seq, &len, shape, 1e6,
            )
        },
    )?;
    let gu = t.buf(rows * 2 * ffn, bf, 1.0)?;
    let mut h = t.buf(rows * ffn, bf, 1.0)?;
    t.time_graph(
        "decode swiglu_packed",
        format!("{tag} × {ffn}"),
        (rows * ffn * 3 * 2) as f64,
        "GB/s",
        || gpu.swiglu_packed(&mut h, &gu, rows, ffn),
    )?;
    let mut y = t.buf(rows * hid, f32t, 1.0)?;
    for (name, n, k, acc) in [
        ("decode matmul qkv", qd + 2 * kd, hid, false),
        ("decode matmul o (+= f32)", hid, qd, true),
        ("decode matmul gate+up", 2 * ffn, hid, false),
        ("decode matmul down (+= f32)", hid, ffn, true),
    ] {
        let w = t.buf(n * k, bf, 0.03)?;
        let x = t.buf(rows * k, bf, 1.0)?;
        let mut out = if acc {
            None
        } else {
            Some(t.buf(rows * n, bf, 1.0)?)
        };
        t.time_graph(
            name,
            format!("{rows}×{k}→{n}"),
            2.0 * (rows * k * n) as f64,
            "TFLOP/s",
            || match out.as_mut() {
                Some(out) => gpu.matmul(out, &x, &w, None, rows, k, n, false),
                None => gpu.matmul(&mut y, &x, &w, None, rows, k, n, true),
            },
        )?;
    }
    Ok(())
}

/// Runs the timing table (only the ops whose name contains `only`, if given); prints it and
/// returns the rows.
pub fn run(gpu: &CudaBackend, iters: usize, only: Option<&str>) -> Result<Vec<TimeRow>> {
    let mut t = Timer {
        gpu,
        rows: Vec::new(),
        iters: iters.max(1),
        seed: 17,
        only,
    };
    let bf = DType::BF16;
    let f32t = DType::F32;

    // Measured bf16 GEMM peak (the MFU denominator).
    let n = 8192;
    let (a, b) = (t.buf(n * n, bf, 1.0)?, t.buf(n * n, bf, 1.0)?);
    let mut c = t.buf(n * n, bf, 1.0)?;
    t.time(
        "gemm bf16 (peak)",
        format!("{n}³"),
        2.0 * (n as f64).powi(3),
        "TFLOP/s",
        || gpu.matmul(&mut c, &a, &b, None, n, n, n, false),
    )?;
    drop((a, b, c));

    // The Qwen2.5-0.5B micro-batch.
    let (seqs, len) = (8usize, 640usize);
    let tok = seqs * len;
    let (hid, heads, kv, hd, ffn, vocab) =
        (896usize, 14usize, 2usize, 64usize, 4864usize, 151_936usize);
    let x = t.buf(tok * hid, bf, 1.0)?;
    let mut h4 = t.buf(tok * ffn, bf, 1.0)?;
    let w_up = t.buf(ffn * hid, bf, 0.03)?;
    let w_down = t.buf(hid * ffn, bf, 0.03)?;
    let w_qkv = t.buf((heads + 2 * kv) * hd * hid, bf, 0.03)?;
    let b_qkv = t.buf((heads + 2 * kv) * hd, bf, 0.1)?;
    let mut qkv = t.buf(tok * (heads + 2 * kv) * hd, bf, 1.0)?;
    let mut y = t.buf(tok * hid, bf, 1.0)?;
    let qkv_n = (heads + 2 * kv) * hd;
    t.time(
        "matmul qkv (+bias)",
        format!("{tok}×{hid}→{qkv_n}"),
        2.0 * (tok * hid * qkv_n) as f64,
        "TFLOP/s",
        || gpu.matmul(&mut qkv, &x, &w_qkv, Some(&b_qkv), tok, hid, qkv_n, false),
    )?;
    t.time(
        "matmul up",
        format!("{tok}×{hid}→{ffn}"),
        2.0 * (tok * hid * ffn) as f64,
        "TFLOP/s",
        || gpu.matmul(&mut h4, &x, &w_up, None, tok, hid, ffn, false),
    )?;
    t.time(
        "matmul down",
        format!("{tok}×{ffn}→{hid}"),
        2.0 * (tok * hid * ffn) as f64,
        "TFLOP/s",
        || gpu.matmul(&mut y, &h4, &w_down, None, tok, ffn, hid, false),
    )?;
    let mut dx = t.buf(tok * hid, bf, 1.0)?;
    t.time(
        "matmul_backward_x up",
        format!("{tok}×{ffn}→{hid}"),
        2.0 * (tok * hid * ffn) as f64,
        "TFLOP/s",
        || gpu.matmul_backward_x(&mut dx, &h4, &w_up, tok, hid, ffn, false),
    )?;
    let mut dw = gpu.alloc(ffn * hid)?;
    t.time(
        "matmul_backward_w up (f32 dw)",
        format!("{ffn}×{hid} over {tok}"),
        2.0 * (tok * hid * ffn) as f64,
        "TFLOP/s",
        || gpu.matmul_backward_w(&mut dw, None, &h4, &x, tok, hid, ffn),
    )?;
    drop((w_up, w_down, dw));

    // Attention over 8 packed sequences of 640.
    let cu: Vec<u32> = (0..=seqs as u32).map(|s| s * len as u32).collect();
    let gcu = t.idx(&cu)?;
    let s = AttnShape {
        tokens: tok,
        seqs,
        heads,
        kv_heads: kv,
        head_dim: hd,
    };
    let (q, k, v) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
    );
    let (mut o, mut lse) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * heads, f32t, 1.0)?,
    );
    let dout = t.buf(tok * heads * hd, bf, 1.0)?;
    let (mut dq, mut dk, mut dv) = (
        t.buf(tok * heads * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
        t.buf(tok * kv * hd, bf, 1.0)?,
    );
    // Causal: half of the L×L scores; forward 2 products, backward 5 (2.5× the forward).
    let fwd_flop = 2.0 * 2.0 * (seqs * len * len) as f64 / 2.0 * (hd * heads) as f64;
    let shape = format!("{seqs}×{len}, {heads}/{kv} heads, d{hd}");
    for mma in [true, false] {
        gpu.set_tensor_core_attention(mma);
        let tag = if mma { "mma" } else { "fma" };
        t.time(
            &format!("attention fwd ({tag})"),
            shape.clone(),
            fwd_flop,
            "TFLOP/s",
            || gpu.attention(&mut o, &mut lse, &q, &k, &v, &gcu, s),
        )?;
        t.time(
            &format!("attention bwd ({tag})"),
            shape.clone(),
            2.5 * fwd_flop,
            "TFLOP/s",
            || {
                gpu.attention_backward(
                    &mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &o, &lse, &gcu, s,
                )
            },
        )?;
    }
    gpu.set_tensor_core_attention(true);
    drop((q, k, v, o, dout, dq, dk, dv));

    // Memory-bound ops: bytes read + written.
    let wn = t.buf(hid, bf, 1.0)?;
    let mut rstd = t.buf(tok, f32t, 1.0)?;
    t.time(
        "rmsnorm",
        format!("{tok}×{hid}"),
        (tok * hid * 4) as f64,
        "GB/s",
        || gpu.rmsnorm(&mut y, &mut rstd, &x, &wn, tok, hid, 1e-6),
    )?;
    let mut dwn = t.buf(hid, f32t, 0.0)?;
    t.time(
        "rmsnorm_backward",
        format!("{tok}×{hid}"),
        (tok * hid * 2 * 4) as f64,
        "GB/s",
        || gpu.rmsnorm_backward(&mut dx, &mut dwn, &y, &x, &wn, &rstd, tok, hid, false),
    )?;
    let (g, u) = (t.buf(tok * ffn, bf, 1.0)?, t.buf(tok * ffn, bf, 1.0)?);
    t.time(
        "swiglu",
        format!("{tok}×{ffn}"),
        (tok * ffn * 3 * 2) as f64,
        "GB/s",
        || gpu.swiglu(&mut h4, &g, &u, tok * ffn),
    )?;
    let pos: Vec<u32> = (0..tok as u32).map(|i| i % len as u32).collect();
    let gpos = t.idx(&pos)?;
    t.time(
        "rope (q)",
        format!("{tok}×{heads}×{hd}"),
        (tok * heads * hd * 2 * 2) as f64,
        "GB/s",
        || gpu.rope(&mut qkv, &gpos, tok, heads, hd, 1e6),
    )?;
    drop((g, u, h4, qkv));

    // The LM head with chunked log-softmax, tied to a [vocab, hidden] table.
    let w = t.buf(vocab * hid, bf, 0.03)?;
    let chunk = 1024;
    let mut scratch = gpu.alloc(chunk * vocab)?;
    let targets: Vec<u32> = (0..tok as u32).map(|i| (i * 7919) % vocab as u32).collect();
    let gt = t.idx(&targets)?;
    let (mut lp, mut ent, mut lse2) = (
        t.buf(tok, f32t, 0.0)?,
        t.buf(tok, f32t, 0.0)?,
        t.buf(tok, f32t, 0.0)?,
    );
    let ls = LogprobShape {
        rows: tok,
        hidden: hid,
        vocab,
        temperature: 1.0,
        chunk,
    };
    let head_flop = 2.0 * (tok * hid * vocab) as f64;
    t.time(
        "logprob (+entropy)",
        format!("{tok}×{hid}→{vocab}, chunk {chunk}"),
        head_flop,
        "TFLOP/s",
        || {
            gpu.logprob(
                &mut lp,
                Some(&mut ent),
                &mut lse2,
                &x,
                &w,
                &gt,
                ls,
                &mut scratch,
            )
        },
    )?;
    let mut dwh = gpu.alloc(vocab * hid)?;
    let dlp = t.buf(tok, f32t, 1.0)?;
    t.time(
        "logprob_backward",
        format!("{tok}×{hid}→{vocab}, chunk {chunk}"),
        3.0 * head_flop,
        "TFLOP/s",
        || {
            gpu.logprob_backward(
                &mut dx,
                &mut dwh,
                &x,
                &w,
                &gt,
                &lse2,
                &ent,
                &dlp,
                None,
                ls,
                &mut scratch,
            )
        },
    )?;
    drop((scratch, w));

    // Optimizer over the 0.5B parameters (f32 master, grads, moments).
    let np = 494_032_768;
    let (mut p, gr, mut m, mut vv) = (
        t.buf(np, f32t, 1.0)?,
        t.buf(np, f32t, 1e-3)?,
        t.buf(np, f32t, 1e-3)?,
        t.buf(np, f32t, 1e-6)?,
    );
    let st = AdamWStep {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
        grad_scale: 1.0,
    };
    t.time(
        "adamw (f32)",
        format!("{np} params"),
        (np * 4 * 7) as f64,
        "GB/s",
        || gpu.adamw(&mut p, &gr, &mut m, &mut vv, np, &st),
    )?;
    t.time(
        "sum_squares (f32)",
        format!("{np}"),
        (np * 4) as f64,
        "GB/s",
        || gpu.sum_squares(&gr, np).map(|_| ()),
    )?;
    let mut pb = gpu.alloc_as(np, bf)?;
    t.time(
        "copy f32→bf16 (weights)",
        format!("{np}"),
        (np * 6) as f64,
        "GB/s",
        || gpu.copy(&mut pb, 0, &p, 0, np),
    )?;

    drop((p, gr, m, vv, pb));
    decode_rows(&mut t, 256, 256)?;

    println!(
        "{:<32}  {:<40}  {:>9}  {:>10}",
        "op", "shape", "median ms", "rate"
    );
    for r in &t.rows {
        println!(
            "{:<32}  {:<40}  {:>9.3}  {:>6.1} {}",
            r.op, r.shape, r.ms, r.rate, r.unit
        );
    }
    Ok(t.rows)
}
