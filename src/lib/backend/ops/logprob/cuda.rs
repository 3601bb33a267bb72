//! The fused LM-head launchers: per chunk, a cuBLASLt GEMM into the scratch, then one block
//! per row (`logprob.cu`).

use anyhow::Result;

use super::{LogprobGrad, LogprobInput, LogprobOps, LogprobShape};
use crate::backend::cuda::gemm::Operand;
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{esize, i32_of, need, Args, CudaBackend, CudaBuf, CudaIdx, THREADS};
use crate::backend::DType;

pub(crate) const KERNELS: Family = Family {
    name: "logprob",
    src: include_str!("logprob.cu"),
    per_head_dim: false,
    training_only: false,
};

impl LogprobOps for CudaBackend {
    fn logprob_chunk_floats(&self) -> usize {
        // 1 GiB of f32 logits (~1700 rows at vocab 151,936): the LM-head GEMMs run at full
        // size and the head's f32 gradient is read and written a few times per micro-batch
        // instead of once per ~100 rows.
        256 << 20
    }
    fn logprob(
        &self,
        lp: &mut CudaBuf,
        ent: Option<&mut CudaBuf>,
        lse: &mut CudaBuf,
        input: LogprobInput<&CudaBuf, &CudaIdx>,
        s: LogprobShape,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        let LogprobInput { x, w, targets } = input;
        s.check()?;
        need(lp.len, s.rows, "logprob lp")?;
        need(lse.len, s.rows, "logprob lse")?;
        if let Some(e) = &ent {
            need(e.len, s.rows, "logprob ent")?;
        }
        need(x.len, s.rows * s.hidden, "logprob x")?;
        need(w.len, s.vocab * s.hidden, "logprob w")?;
        need(targets.len, s.rows, "logprob targets")?;
        need(
            scratch.len,
            s.chunk.min(s.rows) * s.vocab,
            "logprob scratch",
        )?;
        if s.rows == 0 {
            return Ok(());
        }
        // Operand types are reconciled once for all chunks (w is the big one).
        let bf = [x.dtype, w.dtype, scratch.dtype].contains(&DType::BF16);
        let (xo, _tx) = self.operand_for(x, s.rows * s.hidden, bf)?;
        let (wo, _tw) = self.operand_for(w, s.vocab * s.hidden, bf)?;
        let f = self.func(KERNELS, 0, "logprob_reduce_k")?;
        let (v, ent) = (i32_of(s.vocab, "vocab")?, ent.as_deref());
        for c0 in (0..s.rows).step_by(s.chunk) {
            let cn = s.chunk.min(s.rows - c0);
            let xc = Operand {
                ptr: xo.ptr + (c0 * s.hidden * esize(xo.dtype)) as u64,
                dtype: xo.dtype,
            };
            self.gemm_xwt(scratch.operand(0), xc, wo, None, s.gemm(cn), false)?;
            let args = Args::new()
                .buf_at(lp, c0)
                .opt_buf_at(ent, c0)
                .buf_at(lse, c0)
                .buf(scratch)
                .idx_at(targets, c0)
                .i32(cn as i32)
                .i32(v)
                .f32(1.0 / s.temperature)
                .raw(self.err_ptr());
            self.launch(&f, (cn as u32, 1, 1), THREADS, 0, &args)?;
        }
        Ok(())
    }
    fn logprob_backward(
        &self,
        dx: &mut CudaBuf,
        mut dw: Option<&mut CudaBuf>,
        input: LogprobInput<&CudaBuf, &CudaIdx>,
        grad: LogprobGrad<&CudaBuf>,
        s: LogprobShape,
        scratch: &mut CudaBuf,
    ) -> Result<()> {
        let LogprobInput { x, w, targets } = input;
        let LogprobGrad {
            dlp,
            dent,
            lse,
            ent,
        } = grad;
        s.check()?;
        need(dx.len, s.rows * s.hidden, "logprob dx")?;
        if let Some(dw) = &dw {
            need(dw.len, s.vocab * s.hidden, "logprob dw")?;
        }
        need(x.len, s.rows * s.hidden, "logprob x")?;
        need(w.len, s.vocab * s.hidden, "logprob w")?;
        need(targets.len, s.rows, "logprob targets")?;
        need(lse.len, s.rows, "logprob lse")?;
        need(ent.len, s.rows, "logprob ent")?;
        need(dlp.len, s.rows, "logprob dlp")?;
        if let Some(d) = dent {
            need(d.len, s.rows, "logprob dent")?;
        }
        need(
            scratch.len,
            s.chunk.min(s.rows) * s.vocab,
            "logprob scratch",
        )?;
        if s.rows == 0 {
            return Ok(());
        }
        let dw_dtype = dw.as_ref().map_or(x.dtype, |d| d.dtype);
        let bf = [x.dtype, w.dtype, scratch.dtype, dx.dtype, dw_dtype].contains(&DType::BF16);
        let (xo, _tx) = self.operand_for(x, s.rows * s.hidden, bf)?;
        let (wo, _tw) = self.operand_for(w, s.vocab * s.hidden, bf)?;
        // dlogits go where the next GEMMs can read them: in place, or a bf16 temporary when the
        // scratch is f32 but the GEMMs run in bf16.
        let dl_tmp = if bf && scratch.dtype == DType::F32 {
            Some(self.temp(s.chunk.min(s.rows) * s.vocab, DType::BF16)?)
        } else {
            None
        };
        let dl = dl_tmp.as_ref().map_or(scratch.operand(0), |t| t.operand(0));
        let f = self.func(KERNELS, 0, "logprob_dlogits_k")?;
        let v = i32_of(s.vocab, "vocab")?;
        for c0 in (0..s.rows).step_by(s.chunk) {
            let cn = s.chunk.min(s.rows - c0);
            let xc = Operand {
                ptr: xo.ptr + (c0 * s.hidden * esize(xo.dtype)) as u64,
                dtype: xo.dtype,
            };
            self.gemm_xwt(scratch.operand(0), xc, wo, None, s.gemm(cn), false)?;
            let args = Args::new()
                .raw(dl.ptr)
                .i32((dl.dtype == DType::BF16) as i32)
                .buf(scratch)
                .idx_at(targets, c0)
                .buf_at(lse, c0)
                .buf_at(ent, c0)
                .buf_at(dlp, c0)
                .opt_buf_at(dent, c0)
                .i32(cn as i32)
                .i32(v)
                .f32(1.0 / s.temperature);
            self.launch(&f, (cn as u32, 1, 1), THREADS, 0, &args)?;
            self.gemm_dyw(dx.operand(c0 * s.hidden), dl, wo, s.gemm(cn), false)?;
            if let Some(dw) = dw.as_deref_mut() {
                self.gemm_dytx(dw.operand(0), dl, xc, s.gemm(cn))?;
            }
        }
        Ok(())
    }
}
