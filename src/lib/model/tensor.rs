//! Host tensors by HF name: the exchange format between model files (safetensors, GGUF, random
//! init) and the compute engine.

use std::collections::BTreeMap;

/// A dense row-major f32 tensor on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?}"
        );
        Tensor { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// All weights of a model, keyed by their HF names (`model.layers.0.self_attn.q_proj.weight`...).
pub type Weights = BTreeMap<String, Tensor>;
