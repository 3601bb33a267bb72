//! LoRA adapters on the host: which projections they sit on, their names (PEFT's, less its
//! `base_model.model.` prefix), their initialisation (as PEFT: A Kaiming-uniform, B zero) and
//! their merge into the base weights, W + (α/r)·B·A. The decoder computes with them
//! (`decoder::lora`); the PEFT files are read and written in `model::peft`.

use anyhow::{bail, Result};

use crate::error::input_error;
use crate::model::safetensors::round_bf16;
use crate::model::{Config, Tensor, Weights};
use crate::rng::{stream_seed, SplitMix64};
use rayon::prelude::*;

/// A projection an adapter can sit on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The HF module name (PEFT's `target_modules` entry).
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's path inside a layer.
    fn path(self) -> String {
        let block = match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            _ => "mlp",
        };
        format!("{block}.{}", self.module())
    }

    /// (in features, out features) of the projection.
    pub fn dims(self, cfg: &Config) -> (usize, usize) {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        let (qd, kd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        match self {
            Target::Q => (d, qd),
            Target::K | Target::V => (d, kd),
            Target::O => (qd, d),
            Target::Gate | Target::Up => (d, f),
            Target::Down => (f, d),
        }
    }

    /// `q` or `q_proj` (and so on) to a target.
    pub fn parse(s: &str) -> Option<Target> {
        let s = s.trim();
        Target::ALL
            .into_iter()
            .find(|t| s == t.module() || Some(s) == t.module().strip_suffix("_proj"))
    }

    /// The base weight's name in layer `l`.
    pub fn weight_name(self, l: usize) -> String {
        format!("model.layers.{l}.{}.weight", self.path())
    }

    /// The names of layer `l`'s adapter matrices A [r, in] and B [out, r].
    pub fn adapter_names(self, l: usize) -> (String, String) {
        let p = format!("model.layers.{l}.{}", self.path());
        (format!("{p}.lora_A.weight"), format!("{p}.lora_B.weight"))
    }
}

/// How a rollout generates with an adapter: from a merged copy of the weights, or with the
/// adapters applied at each step on the untouched base (`rollout --lora-mode`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LoraMode {
    /// W + (α/r)·B·A per target, merged once per policy version (a copy of the weights).
    #[default]
    Merged,
    /// y = x·Wᵀ + (α/r)·(x·Aᵀ)·Bᵀ at every step: two small GEMMs per target, no copy.
    Unmerged,
}

/// The adapters of a run: rank r, alpha α (the update is scaled by α/r) and the projections
/// they sit on.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f32,
    pub targets: Vec<Target>,
}

impl LoraSpec {
    /// α/r, the factor of B·A.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// A comma-separated list of targets (`q,v`, `q_proj,v_proj`) or `all-linear` (all seven),
    /// sorted and without repeats; `what` names the flag or key in errors.
    pub fn parse_targets(s: &str, what: &str) -> Result<Vec<Target>> {
        if matches!(s.trim(), "all-linear" | "all_linear" | "all") {
            return Ok(Target::ALL.to_vec());
        }
        let mut out = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let Some(t) = Target::parse(part) else {
                bail!(input_error(format!(
                    "{what}: unknown target '{}' (one of q, k, v, o, gate, up, down, their \
                     *_proj names, or all-linear)",
                    part.trim()
                )));
            };
            out.push(t);
        }
        out.sort();
        out.dedup();
        if out.is_empty() {
            bail!(input_error(format!("{what}: no target given")));
        }
        Ok(out)
    }

    /// The spec of the `--lora-rank`, `--lora-alpha` and `--lora-targets` flags (`LoraFlags`
    /// of `update`, the daemon and the benchmarks), checked; None for rank 0 (every weight trains).
    pub fn from_flags(rank: usize, alpha: f32, targets: &str) -> Result<Option<LoraSpec>> {
        if rank == 0 {
            return Ok(None);
        }
        let spec = LoraSpec {
            rank,
            alpha,
            targets: LoraSpec::parse_targets(targets, "--lora-targets")?,
        };
        spec.check()?;
        Ok(Some(spec))
    }

    /// Refuses a rank of 0 or a non-finite or non-positive alpha (input errors).
    pub fn check(&self) -> Result<()> {
        if self.rank == 0 || !(self.alpha.is_finite() && self.alpha > 0.0) {
            bail!(input_error(format!(
                "LoRA: need lora-rank >= 1 and lora-alpha > 0, got rank {} and alpha {}",
                self.rank, self.alpha
            )));
        }
        if self.targets.is_empty() {
            bail!(input_error("LoRA: lora-targets names no projection"));
        }
        Ok(())
    }

    /// Every adapter of `cfg`: (layer, target, A's name, B's name, A's shape, B's shape).
    pub fn adapters(&self, cfg: &Config) -> Vec<AdapterSlot> {
        let mut out = Vec::new();
        for l in 0..cfg.num_layers {
            for &t in &self.targets {
                let (i, o) = t.dims(cfg);
                let (a, b) = t.adapter_names(l);
                out.push(AdapterSlot {
                    layer: l,
                    target: t,
                    a: (a, vec![self.rank, i]),
                    b: (b, vec![o, self.rank]),
                });
            }
        }
        out
    }
}

/// One adapter's place: its layer and projection, and its A and B (name, shape).
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterSlot {
    pub layer: usize,
    pub target: Target,
    pub a: (String, Vec<usize>),
    pub b: (String, Vec<usize>),
}

/// Fresh adapters as PEFT makes them: A uniform in ±1/√in (torch's kaiming_uniform_ with
/// a = √5, PEFT's default), B zero, so that the adapted model starts equal to the base.
pub fn init_adapters(cfg: &Config, spec: &LoraSpec, seed: u64) -> Weights {
    let mut out = Weights::new();
    for slot in spec.adapters(cfg) {
        let (name, shape) = slot.a;
        let bound = 1.0 / (shape[1] as f64).sqrt();
        let mut rng = SplitMix64(stream_seed(seed, &name));
        let data = (0..shape[0] * shape[1])
            .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
            .collect();
        out.insert(name, Tensor::new(shape, data));
        out.insert(slot.b.0, Tensor::zeros(slot.b.1));
    }
    out
}

/// Checks that `adapters` holds exactly the adapters of `spec` on `cfg`, with their shapes and
/// finite values (input errors naming `what` and the tensor).
pub fn check_adapters(cfg: &Config, spec: &LoraSpec, adapters: &Weights, what: &str) -> Result<()> {
    let slots = spec.adapters(cfg);
    for slot in &slots {
        for (name, shape) in [&slot.a, &slot.b] {
            let Some(t) = adapters.get(name) else {
                bail!(input_error(format!(
                    "{what}: adapter tensor '{name}' is missing"
                )));
            };
            if &t.shape != shape {
                bail!(input_error(format!(
                    "{what}: adapter tensor '{name}' has shape {:?}, rank {} implies {shape:?}",
                    t.shape, spec.rank
                )));
            }
            if let Some(i) = t.data.iter().position(|x| !x.is_finite()) {
                bail!(input_error(format!(
                    "{what}: adapter tensor '{name}' holds a non-finite value at flat index {i}"
                )));
            }
        }
    }
    if adapters.len() != 2 * slots.len() {
        let known = |k: &String| slots.iter().any(|s| &s.a.0 == k || &s.b.0 == k);
        if let Some(extra) = adapters.keys().find(|k| !known(k)) {
            bail!(input_error(format!(
                "{what}: adapter tensor '{extra}' is not one of lora-targets {:?} on a {}-layer model",
                spec.targets.iter().map(|t| t.module()).collect::<Vec<_>>(),
                cfg.num_layers
            )));
        }
    }
    Ok(())
}

/// Adds each adapter into its base weight: W += (α/r)·B·A, in f64 sums (the caller rounds the
/// result when it writes it).
pub fn merge(cfg: &Config, base: &mut Weights, adapters: &Weights, spec: &LoraSpec) -> Result<()> {
    check_adapters(cfg, spec, adapters, "merge")?;
    let s = spec.scale() as f64;
    let r = spec.rank;
    for slot in spec.adapters(cfg) {
        let (a, b) = (&adapters[&slot.a.0], &adapters[&slot.b.0]);
        let name = slot.target.weight_name(slot.layer);
        let (i, o) = slot.target.dims(cfg);
        let Some(w) = base.get_mut(&name) else {
            bail!(input_error(format!(
                "merge: base weight '{name}' is missing"
            )));
        };
        if w.shape != [o, i] {
            bail!(input_error(format!(
                "merge: base weight '{name}' has shape {:?}, the adapter implies [{o}, {i}]",
                w.shape
            )));
        }
        // Rows in parallel, each element's sum over k in order (the products are exact in
        // f64): the result does not depend on the thread count. A's rows are read in order.
        w.data
            .par_chunks_mut(i)
            .enumerate()
            .for_each(|(row, wrow)| {
                let mut sum = vec![0.0f64; i];
                for (k, &bk) in b.data[row * r..(row + 1) * r].iter().enumerate() {
                    let arow = &a.data[k * i..(k + 1) * i];
                    for (acc, &ak) in sum.iter_mut().zip(arow) {
                        *acc += bk as f64 * ak as f64;
                    }
                }
                for (x, acc) in wrow.iter_mut().zip(&sum) {
                    *x = (*x as f64 + s * acc) as f32;
                }
            });
    }
    Ok(())
}

/// [`merge`], each merged weight then rounded to bf16 as `tandem merge-lora`'s files store
/// it: the host readers' adapted model (`model-info`, the daemon's reference of an adapter
/// directory); the stages that generate merge on their backend (`Decoder::merge_adapters`),
/// which can differ from this by one bf16 step in rare elements.
pub fn merge_rounded(
    cfg: &Config,
    base: &mut Weights,
    adapters: &Weights,
    spec: &LoraSpec,
) -> Result<()> {
    merge(cfg, base, adapters, spec)?;
    for slot in spec.adapters(cfg) {
        if let Some(t) = base.get_mut(&slot.target.weight_name(slot.layer)) {
            t.data.iter_mut().for_each(|x| *x = round_bf16(*x));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(targets: &str) -> LoraSpec {
        LoraSpec {
            rank: 2,
            alpha: 4.0,
            targets: LoraSpec::parse_targets(targets, "t").unwrap(),
        }
    }

    #[test]
    fn targets_parse_by_short_or_module_name() {
        assert_eq!(spec("v_proj, q,q").targets, [Target::Q, Target::V]);
        assert_eq!(spec("all-linear").targets.len(), 7);
        let e = LoraSpec::parse_targets("q,lm_head", "--lora-targets").unwrap_err();
        assert!(
            e.to_string()
                .contains("--lora-targets: unknown target 'lm_head'"),
            "{e}"
        );
    }

    #[test]
    fn fresh_adapters_have_peft_shapes_and_a_zero_b() {
        let cfg = Config::small_qwen2();
        let s = spec("q,down");
        let w = init_adapters(&cfg, &s, 7);
        assert_eq!(w.len(), 2 * 2 * cfg.num_layers);
        let a = &w["model.layers.1.mlp.down_proj.lora_A.weight"];
        assert_eq!(a.shape, [2, cfg.intermediate_size]);
        let bound = 1.0 / (cfg.intermediate_size as f32).sqrt();
        assert!(a.data.iter().all(|x| x.abs() <= bound) && a.data.iter().any(|x| *x != 0.0));
        let b = &w["model.layers.0.self_attn.q_proj.lora_B.weight"];
        assert_eq!(b.shape, [cfg.num_heads * cfg.head_dim, 2]);
        assert!(b.data.iter().all(|x| *x == 0.0));
        check_adapters(&cfg, &s, &w, "x").unwrap();
        let e = check_adapters(&cfg, &spec("q"), &w, "dir").unwrap_err();
        assert!(e.to_string().contains("is not one of lora-targets"), "{e}");
    }

    #[test]
    fn merge_adds_scaled_b_times_a() {
        // One layer's q: in 64, out 64; A = e0 on row 0 and e1 on row 1, B = [[1, 2], ...].
        let cfg = Config::small_qwen2();
        let s = spec("q");
        let mut ad = init_adapters(&cfg, &s, 1);
        let (an, bn) = Target::Q.adapter_names(0);
        let a = ad.get_mut(&an).unwrap();
        a.data.fill(0.0);
        a.data[0] = 1.0; // A[0, 0]
        a.data[64 + 3] = 1.0; // A[1, 3]
        let b = ad.get_mut(&bn).unwrap();
        b.data[2 * 5] = 1.0; // B[5, 0]
        b.data[2 * 5 + 1] = 2.0; // B[5, 1]
        let mut base = crate::model::init::random_weights(&cfg, 3, 0.02);
        let before = base.clone();
        merge(&cfg, &mut base, &ad, &s).unwrap();
        let name = Target::Q.weight_name(0);
        let (w0, w1) = (&before[&name].data, &base[&name].data);
        // (α/r)·(B·A)[5, 0] = 2·1, [5, 3] = 2·2; everything else unchanged.
        assert_eq!(w1[5 * 64], w0[5 * 64] + 2.0);
        assert_eq!(w1[5 * 64 + 3], w0[5 * 64 + 3] + 4.0);
        let changed = w0.iter().zip(w1).filter(|(x, y)| x != y).count();
        assert_eq!(changed, 2);
        assert_eq!(
            before[&Target::K.weight_name(0)],
            base[&Target::K.weight_name(0)]
        );
    }
}
