//! The fused PPO-clip launcher (one block; `ppo_loss.cu`).

use anyhow::{bail, Result};

use super::{PpoInputs, PpoLossOps, PpoShape, PPO_STATS};
use crate::backend::cuda::nvrtc::Family;
use crate::backend::cuda::{i32_of, need, Args, CudaBackend, CudaBuf};
use crate::backend::DType;

pub(crate) const KERNELS: Family = Family {
    name: "ppo_loss",
    src: include_str!("ppo_loss.cu"),
    per_head_dim: false,
    training_only: false,
};

impl PpoLossOps for CudaBackend {
    fn ppo_clip_loss(
        &self,
        dlp: &mut CudaBuf,
        stats: &mut CudaBuf,
        x: PpoInputs<&CudaBuf>,
        s: PpoShape,
    ) -> Result<()> {
        let PpoInputs {
            lp,
            old,
            adv,
            w,
            ent,
        } = x;
        let n = s.tokens;
        need(dlp.len, n, "ppo_clip_loss dlp")?;
        need(stats.len, PPO_STATS, "ppo_clip_loss stats")?;
        if stats.dtype != DType::F32 {
            bail!("ppo_clip_loss: the stats accumulator must be f32");
        }
        need(lp.len, n, "ppo_clip_loss lp")?;
        need(adv.len, n, "ppo_clip_loss adv")?;
        need(w.len, 3 * n, "ppo_clip_loss w")?;
        if let Some(o) = old {
            need(o.len, n, "ppo_clip_loss old")?;
        }
        if let Some(e) = ent {
            need(e.len, n, "ppo_clip_loss ent")?;
        }
        if n == 0 {
            return Ok(());
        }
        let args = Args::new()
            .buf(dlp)
            .ptr(stats)
            .buf(lp)
            .opt_buf_at(old, 0)
            .bufs(&[adv, w])
            .opt_buf_at(ent, 0)
            .i32(i32_of(n, "tokens")?)
            .f64(s.ratio_low)
            .f64(s.ratio_high)
            .f64(s.dual_clip);
        let f = self.func(KERNELS, 0, "ppo_clip_k")?;
        self.launch(&f, (1, 1, 1), 1024, 0, &args)
    }
}
